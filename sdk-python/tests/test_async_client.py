"""The asyncio client against real agent processes, on the embedded store and on Redis: figures,
all-or-nothing checks, attribute checks and log mode, many checks in flight on one connection, the
fail policy when the agent is away or stopped, the agent's fail-closed rules once it is killed, and
reconnection after a restart."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Awaitable, Callable, Optional, TypeVar

import pytest
from conftest import unique
from rules import CLIENT_RULES, FAIL_MODE_RULES, WINDOW_S, now_ms, window_reset_ms

from floodgate import AgentError, AsyncClient, Degraded, InvalidCheck, LocalLimit, Origin, Source

T = TypeVar("T")

# What a call may take beyond its timeout: event-loop and scheduler wake-ups on a loaded 2-core
# machine shared with other builds and test runs. Far below any timeout a caller would notice, far
# above what the call itself costs (tens of microseconds).
MARGIN = 0.25
# How long a test waits for something that happens "soon" (a reconnection, a restarted agent).
PATIENCE = 10.0


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def until(what: str, fn: Callable[[], Awaitable[Optional[T]]], timeout: float = PATIENCE) -> T:
    deadline = time.monotonic() + timeout
    while True:
        v = await fn()
        if v is not None and v is not False:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        await asyncio.sleep(0.005)


async def answered_by_agent(client: AsyncClient, what: str) -> None:
    """Waits until a check is answered by the agent itself (a short timeout may miss on a busy
    machine; what matters is that answers come back)."""

    async def once() -> Optional[bool]:
        return (await client.allow(unique("probe"), "r")).from_agent or None

    await until(what, once)


def expected_source(store: Optional[str]) -> Source:
    return Source.REDIS if store else Source.LOCAL


def test_allow_then_deny_with_figures(make_agent, store) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES, redis=store)

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=2.0)
        key = unique("user")
        for left in (2, 1, 0):
            t0 = now_ms()
            d = await client.allow(key, "r", 1)
            t1 = now_ms()
            assert d.allowed and d.from_agent and d.origin is Origin.AGENT
            assert (d.limit, d.remaining, d.retry_after_ms) == (3, left, None)
            assert d.source is expected_source(store) and not d.log_only
            # The window's end after the current one, exactly (windows are aligned on the epoch).
            assert d.reset_at_ms in (window_reset_ms(t0), window_reset_ms(t1))
            assert [i.rule_id for i in d.items] == ["r"]
            assert d.items[0].verdict.remaining == left
            assert d.items[0].window_ms == WINDOW_S * 1000, "the rule's window (protocol version 4)"
        t0 = now_ms()
        d = await client.allow(key, "r", 1)
        assert not d.allowed and d.from_agent and (d.limit, d.remaining) == (3, 0)
        assert d.retry_after_ms is not None and 1 <= d.retry_after_ms <= d.reset_at_ms - t0
        assert not d.items[0].verdict.allowed
        # Another key has its own budget.
        assert (await client.allow(unique("user"), "r", 2)).remaining == 1

        # Token bucket: 2 tokens, one back every 60 s.
        key = unique("user")
        t0 = now_ms()
        assert [(await client.allow(key, "tb")).remaining for _ in range(2)] == [1, 0]
        d = await client.allow(key, "tb")
        t1 = now_ms()
        assert not d.allowed and d.limit == 2
        assert d.retry_after_ms is not None and 1 <= d.retry_after_ms <= 60_000
        # Full again when both tokens are back: 120 s after they were taken (±1 ms of rounding).
        assert t0 + 120_000 - 1 <= d.reset_at_ms <= t1 + 120_000 + 1
        await client.close()

    run(main())


def test_a_check_is_all_or_nothing(make_agent, store) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES, redis=store)

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=2.0)
        a, b = unique("a"), unique("b")
        d = await client.check([(a, "r"), (b, "tight", 1)])
        assert d.allowed and [i.rule_id for i in d.items] == ["r", "tight"]
        # The binding item when allowed: the least remaining (tight: 0 left of 1).
        assert (d.limit, d.remaining) == (1, 0)
        d = await client.check([(a, "r"), (b, "tight")])
        assert not d.allowed
        # The binding item on a denial is the denied one; the allowed one is still reported.
        assert (d.limit, d.remaining) == (1, 0) and d.retry_after_ms is not None
        by_rule = {i.rule_id: i.verdict for i in d.items}
        assert by_rule["r"].allowed and not by_rule["tight"].allowed
        # The denied check took nothing from `r`: 2 left after the first check, 1 after this one.
        assert (await client.allow(a, "r")).remaining == 1
        await client.close()

    run(main())


def test_attribute_checks_log_mode_and_refusals(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=2.0)
        user = unique("u")
        d = await client.check_attributes(endpoint="/search", user=user)
        assert d.allowed and (d.limit, d.remaining) == (2, 1) and [i.rule_id for i in d.items] == ["search"]
        d = await client.check_attributes(endpoint="/search", user=user, cost=2)
        assert not d.allowed and d.remaining == 1, "a cost of 2 does not fit the 1 left"
        # Log mode: would reject the second request, never does; the decision says it is log-only.
        for i in range(3):
            d = await client.check_attributes(endpoint="/dry", ip="203.0.113.7")
            assert d.allowed and d.log_only and d.limit == 1
            assert d.items[0].verdict.log_only and d.items[0].verdict.allowed == (i == 0)
        # No rule matched: allowed, limit 0, no items.
        d = await client.check_attributes(endpoint="/nothing", user=user)
        assert d.allowed and d.from_agent and (d.limit, d.items) == (0, [])

        # The caller's mistakes raise; the agent's refusals too.
        with pytest.raises(AgentError) as e:
            await client.allow("k", "no-such-rule")
        assert e.value.code == 4 and "no-such-rule" in e.value.message
        with pytest.raises(AgentError) as e:
            await client.check([("k", "r"), ("k", "r")])
        assert e.value.code == 5
        for bad in [dict(key="", rule_id="r"), dict(key="a{b}", rule_id="r"), dict(key="k", rule_id="r", cost=0)]:
            with pytest.raises(InvalidCheck):
                await client.allow(**bad)
        with pytest.raises(InvalidCheck):
            await client.check_attributes(user="")
        # None of these was answered by the fail policy.
        s = client.stats()
        assert (s.unavailable, s.timeouts, s.connects) == (0, 0, 1)
        await client.close()

    run(main())


def test_a_burst_of_pipelined_checks_on_one_connection(make_agent, store) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES, redis=store)

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=5.0)
        keys = [unique("user"), unique("user")]
        ds = await asyncio.gather(*(client.allow(keys[i % 2], "burst") for i in range(2_000)))
        assert all(d.from_agent for d in ds), "every answer came from the agent"
        # Two keys, 1,000 checks each, limit 500: exactly 500 admitted per key.
        assert sum(d.allowed for d in ds) == 1_000
        s = client.stats()
        assert s.connects == 1, "one multiplexed connection carried them all"
        assert s.max_in_flight >= 1_000, f"checks were in flight together ({s.max_in_flight})"
        await client.close()

    run(main())


def test_no_agent_fails_open_by_default_and_closed_on_request() -> None:
    path = os.path.join(tempfile.mkdtemp(), "nobody.sock")

    async def main() -> None:
        client = await AsyncClient.connect(path)
        t = time.monotonic()
        d = await client.allow("user:1", "r")
        assert time.monotonic() - t < client.config.timeout + MARGIN
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.UNAVAILABLE
        assert (d.limit, d.retry_after_ms, d.items) == (0, None, [])
        d = await client.allow("user:1", "login", fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED
        assert d.retry_after_ms == 1_000, "a fail-closed denial still says when to retry"
        assert client.stats().unavailable == 2
        await client.close()

        # The optional per-process fallback limit: 3 per minute per check key while the agent is away.
        client = await AsyncClient.connect(path, fallback_limit=LocalLimit(3, 60.0))
        for _ in range(3):
            d = await client.allow("user:1", "r")
            assert d.allowed and d.origin is Origin.LOCAL_LIMIT
        d = await client.allow("user:1", "r")
        assert not d.allowed and d.origin is Origin.LOCAL_LIMIT
        # One token per 20 s: the wait is at most 20 s and always stated.
        assert d.retry_after_ms is not None and 1 <= d.retry_after_ms <= 20_000
        assert (await client.allow("user:2", "r")).allowed, "another key has its own budget"
        assert client.stats().local_denied == 1
        await client.close()

    run(main())


def test_a_stopped_agent_costs_the_timeout_and_no_more(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    timeout = 0.05

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=timeout)
        await answered_by_agent(client, "the agent answers")
        agent.stop()  # SIGSTOP: alive, connected, answering nothing.
        try:
            t = time.monotonic()
            d = await client.allow(unique("u"), "r")
            took = time.monotonic() - t
            t = time.monotonic()
            closed = await client.allow(unique("u"), "r", fail="closed")
            took_closed = time.monotonic() - t
        finally:
            agent.cont()
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.TIMEOUT
        assert not closed.allowed and closed.origin is Origin.FAIL_CLOSED and closed.retry_after_ms == 1_000
        # At least the timeout (the loop's timer may fire up to its clock resolution early: 1 ms of
        # slack is plenty), at most the timeout and the scheduling margin.
        for t in (took, took_closed):
            assert timeout - 0.001 <= t < timeout + MARGIN, t
        assert client.stats().timeouts == 2
        # The late answers are dropped, and the connection keeps working.
        await answered_by_agent(client, "the agent answers again after SIGCONT")
        assert client.stats().connects == 1
        await client.close()

    run(main())


def test_a_killed_agents_fail_closed_rules_still_deny(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(FAIL_MODE_RULES)
    ip = "203.0.113.9"

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=2.0)
        try:
            d = await client.check_attributes(endpoint="/login", ip=ip)
            assert d.from_agent and d.allowed and d.limit == 5

            async def learnt() -> bool:
                return client.health().rules_version is not None

            await until("the client learns the fail-closed rules", learnt)
            h = client.health()
            assert (h.fail_closed_rules, h.rules_version) == (1, 0), "one listed rule, from a rules file"
            agent.kill()

            async def gone() -> bool:
                return not client.is_connected()

            await until("the client sees the agent gone", gone)
            t0 = now_ms()
            d = await client.check_attributes(endpoint="/login", ip=ip)
            assert not d.allowed and d.origin is Origin.FAIL_CLOSED and d.degraded is Degraded.UNAVAILABLE
            assert (d.limit, d.remaining, d.retry_after_ms) == (5, 0, 1_000)
            assert t0 + 1_000 <= d.reset_at_ms <= now_ms() + 1_000
            assert [i.rule_id for i in d.items] == ["login-closed"]
            # An items check naming the rule, likewise; the fail-open rule and no rule pass.
            assert not (await client.allow(f"ip:{ip}", "login-closed")).allowed
            d = await client.check_attributes(endpoint="/api/search", ip=ip)
            assert d.allowed and d.origin is Origin.FAIL_OPEN
            assert (await client.check_attributes(endpoint="/other", ip=ip)).allowed
            # A per-call policy decides alone.
            assert (await client.check_attributes(endpoint="/login", ip=ip, fail="open")).allowed
            assert client.health().fail_closed_rules == 1, "kept while the agent is away"
        finally:
            await client.close()

    run(main())


def test_the_client_reconnects_after_the_agent_is_killed_and_restarted(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=2.0)
        await answered_by_agent(client, "the agent answers")
        agent.kill()

        async def gone() -> Optional[bool]:
            return (not client.is_connected()) or None

        await until("the client notices the agent is gone", gone)
        # While it is gone every call answers by the policy at once: well before the 2 s timeout.
        t = time.monotonic()
        d = await client.allow("user:1", "r")
        assert time.monotonic() - t < 1.0
        assert d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.UNAVAILABLE
        # A new agent on the same path (the killed one's socket file is stale and gets replaced).
        await asyncio.get_running_loop().run_in_executor(None, agent.start)
        await answered_by_agent(client, "the client reconnects by itself")
        assert client.stats().connects >= 2
        await client.close()

    run(main())


def test_a_client_belongs_to_its_event_loop(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    client = AsyncClient(agent.socket, timeout=2.0)
    # Used before any connection: the first call waits (within its timeout) for the first attempt.
    assert run(client.allow(unique("u"), "r")).from_agent

    async def other_loop() -> None:
        with pytest.raises(RuntimeError):
            await client.allow("k", "r")

    run(other_loop())


def test_the_first_call_of_a_lazy_client_keeps_to_its_timeout() -> None:
    # A socket that accepts connections and never answers Hello: the connection attempt takes its
    # whole connect_timeout (2 s here); a first call with a 50 ms timeout must not wait for it.
    import socket

    path = os.path.join(tempfile.mkdtemp(), "mute.sock")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(8)
    timeout = 0.05

    async def main() -> None:
        client = AsyncClient(path, timeout=timeout, connect_timeout=2.0)
        t = time.monotonic()
        d = await client.allow("k", "r")
        took = time.monotonic() - t
        assert d.allowed and d.degraded is Degraded.UNAVAILABLE
        # As in the stopped-agent test: at most the timeout and the scheduling margin.
        assert took < timeout + MARGIN, took
        await client.close()

    try:
        run(main())
    finally:
        mute.close()
