"""The threaded client against real agent processes: figures, many threads on one connection, the
fail policy when the agent is away or stopped, the agent's fail-closed rules once it is killed,
reconnection, and a forked child's own connection."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import List, Optional

import pytest
from conftest import eventually, unique
from rules import CLIENT_RULES, FAIL_MODE_RULES, WINDOW_S, now_ms, window_reset_ms

from floodgate import AgentError, Client, Decision, Degraded, InvalidCheck, Origin, Source

# See test_async_client: scheduling slack on a loaded 2-core machine, far above a call's own cost.
MARGIN = 0.25


def answered_by_agent(client: Client, what: str) -> None:
    eventually(what, lambda: client.allow(unique("probe"), "r").from_agent)


def test_allow_then_deny_with_figures(make_agent, store) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES, redis=store)
    with Client(agent.socket, timeout=2.0) as client:
        key = unique("user")
        for left in (2, 1, 0):
            t0 = now_ms()
            d = client.allow(key, "r")
            t1 = now_ms()
            assert d.allowed and d.origin is Origin.AGENT and (d.limit, d.remaining) == (3, left)
            assert d.source is (Source.REDIS if store else Source.LOCAL)
            assert d.reset_at_ms in (window_reset_ms(t0), window_reset_ms(t1))
            assert [(i.rule_id, i.window_ms) for i in d.items] == [("r", WINDOW_S * 1000)], "protocol version 4"
        t0 = now_ms()
        d = client.allow(key, "r")
        assert not d.allowed and d.retry_after_ms is not None and 1 <= d.retry_after_ms <= d.reset_at_ms - t0
        d = client.check_attributes(endpoint="/search", user=unique("u"), cost=2)
        assert d.allowed and (d.limit, d.remaining) == (2, 0)
        with pytest.raises(AgentError):
            client.allow("k", "no-such-rule")
        with pytest.raises(InvalidCheck):
            client.allow("k" * 257, "r")
        assert client.stats().unavailable == 0


def test_many_threads_share_one_connection(make_agent, store) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES, redis=store)
    keys = [unique("user"), unique("user")]
    with Client(agent.socket, timeout=5.0) as client:
        results: List[Decision] = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def worker(n: int) -> None:
            start.wait()
            mine = [client.allow(keys[(n + i) % 2], "burst") for i in range(250)]
            with lock:
                results.extend(mine)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 2_000 and all(d.from_agent for d in results)
        assert sum(d.allowed for d in results) == 1_000, "exactly 500 admitted per key"
        s = client.stats()
        assert s.connects == 1 and s.max_in_flight >= 2, s


def test_no_agent_fails_open_by_default_and_closed_on_request() -> None:
    path = os.path.join(tempfile.mkdtemp(), "nobody.sock")
    with Client(path) as client:
        t = time.monotonic()
        d = client.allow("user:1", "r")
        assert time.monotonic() - t < client.config.timeout + MARGIN
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.UNAVAILABLE
        d = client.allow("user:1", "r", fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and d.retry_after_ms == 1_000
        assert client.stats().unavailable == 2
    # Closed for every call of a client.
    with Client(path, fail="closed", closed_retry_after=2.5) as client:
        d = client.allow("user:1", "r")
        assert not d.allowed and d.retry_after_ms == 2_500
    # "open" given as a string is the open policy (it used to fail closed: never `is` OPEN).
    with Client(path, fail="open") as client:
        d = client.allow("user:1", "r")
        assert d.allowed and d.origin is Origin.FAIL_OPEN
    with pytest.raises(ValueError):
        Client(path, fail="Open")
    with pytest.raises(ValueError):
        Client(path, timeout=0)


def test_a_stopped_agent_costs_the_timeout_and_no_more(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    timeout = 0.05
    with Client(agent.socket, timeout=timeout) as client:
        answered_by_agent(client, "the agent answers")
        agent.stop()
        try:
            t = time.monotonic()
            d = client.allow(unique("u"), "r")
            took = time.monotonic() - t
            t = time.monotonic()
            closed = client.allow(unique("u"), "r", fail="closed")
            took_closed = time.monotonic() - t
        finally:
            agent.cont()
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.TIMEOUT
        assert not closed.allowed and closed.origin is Origin.FAIL_CLOSED
        # A lock's timed wait does not return early; the upper bound is the scheduling margin.
        for t in (took, took_closed):
            assert timeout <= t < timeout + MARGIN, t
        assert client.stats().timeouts == 2
        answered_by_agent(client, "the agent answers again after SIGCONT")
        assert client.stats().connects == 1


def test_a_killed_agents_fail_closed_rules_still_deny(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(FAIL_MODE_RULES)
    ip = "203.0.113.9"
    with Client(agent.socket, timeout=2.0) as client:
        d = client.check_attributes(endpoint="/login", ip=ip)
        assert d.from_agent and d.allowed and d.limit == 5
        eventually("the client learns the fail-closed rules", lambda: client.health().rules_version is not None)
        h = client.health()
        assert (h.fail_closed_rules, h.rules_version) == (1, 0), "one listed rule, from a rules file"
        agent.kill()
        eventually("the client sees the agent gone", lambda: not client.is_connected())
        t0 = now_ms()
        d = client.check_attributes(endpoint="/login", ip=ip)
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and d.degraded is Degraded.UNAVAILABLE
        assert (d.limit, d.remaining, d.retry_after_ms) == (5, 0, 1_000)
        assert t0 + 1_000 <= d.reset_at_ms <= now_ms() + 1_000
        assert [i.rule_id for i in d.items] == ["login-closed"]
        # An items check naming the rule, likewise; the fail-open rule and no rule pass.
        assert not client.allow(f"ip:{ip}", "login-closed").allowed
        d = client.check_attributes(endpoint="/api/search", ip=ip)
        assert d.allowed and d.origin is Origin.FAIL_OPEN
        assert client.check_attributes(endpoint="/other", ip=ip).allowed
        # A per-call policy decides alone.
        assert client.check_attributes(endpoint="/login", ip=ip, fail="open").allowed
        assert client.health().fail_closed_rules == 1, "kept while the agent is away"


def test_the_client_reconnects_after_the_agent_is_killed_and_restarted(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    with Client(agent.socket, timeout=2.0) as client:
        answered_by_agent(client, "the agent answers")
        agent.kill()
        eventually("the client notices the agent is gone", lambda: not client.is_connected())
        t = time.monotonic()
        d = client.allow("user:1", "r")
        assert time.monotonic() - t < 1.0, "answered at once, not after the 2 s timeout"
        assert d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.UNAVAILABLE
        agent.start()
        answered_by_agent(client, "the client reconnects by itself")
        assert client.stats().connects >= 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_connection(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    with Client(agent.socket, timeout=2.0) as client:
        answered_by_agent(client, "the parent's client answers")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a pre-forking server's worker
            code = 1
            try:
                d = client.allow(unique("child"), "r")
                s = client.stats()
                os.write(w, f"{d.from_agent} {s.connects}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        out = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = os.read(r, 100)
            if not chunk:
                break
            out += chunk
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert out.decode() == "True 1", "the child connected on its own and the agent answered"
        answered_by_agent(client, "the parent's connection is untouched")
        assert client.stats().connects == 1


def test_close_answers_waiting_calls_and_stops_the_thread(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    client = Client(agent.socket, timeout=5.0)
    answered_by_agent(client, "the agent answers")
    agent.stop()
    got: List[Optional[Decision]] = [None]

    def call() -> None:
        got[0] = client.allow(unique("u"), "r")

    t = threading.Thread(target=call)
    t.start()
    try:
        eventually("the call is waiting", lambda: len(client._core.pending) == 1)
        started = time.monotonic()
        client.close()
        t.join(5)
        # Woken by close (the connection is gone), not by its 5 s timeout.
        assert time.monotonic() - started < 2.0
    finally:
        agent.cont()
    d = got[0]
    assert d is not None and d.allowed and d.degraded is Degraded.UNAVAILABLE
    assert client._thread is not None and not client._thread.is_alive()
