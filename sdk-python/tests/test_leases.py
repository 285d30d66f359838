"""Leases of concurrency rules (protocol version 3) in both clients: against real agents on the
embedded store and on Redis, acquire, release and hold (a third unit denied with a retry of at most
1 s, a release freeing a slot, lease ids that differ, a hold given back however its block ends);
against fake agents, the bytes acquire and release put on the wire, an agent of version 1 or 2 never
sent them (the call raises), and an agent that cannot answer (no lease; the fallback limit counts an
acquire as a consume, never a release). And the agent (of version 5 or more) answers every call
that carries the caller's trace context as it answers the same call without one."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any, Callable, Iterator

import pytest
from conftest import eventually, unique
from rules import LEASE_RULES, LEASE_SECONDS, WINDOW_S, now_ms

from floodgate import (
    AsyncClient,
    Client,
    ClientConfig,
    Decision,
    InvalidCheck,
    Lease,
    LocalLimit,
    Origin,
    UnsupportedByAgent,
)
from floodgate import protocol as p


class Sync:
    """The calls of either client, made from the test's thread."""

    def __init__(self, client: Any, loop: Any = None) -> None:
        self.client = client
        self.loop = loop

    def __getattr__(self, method: str) -> Callable[..., Any]:
        f = getattr(self.client, method)
        if self.loop is None or not callable(f):
            return f

        def call(*a: Any, **kw: Any) -> Any:
            r = f(*a, **kw)
            return self.loop.run_until_complete(r) if asyncio.iscoroutine(r) else r

        return call

    @contextlib.contextmanager
    def hold(self, *a: Any, **kw: Any) -> Iterator[Decision]:
        if self.loop is None:
            with self.client.hold(*a, **kw) as d:
                yield d
            return
        cm = self.client.hold(*a, **kw)
        d = self.loop.run_until_complete(cm.__aenter__())
        try:
            yield d
        except BaseException:
            if not self.loop.run_until_complete(cm.__aexit__(*sys.exc_info())):
                raise
        else:
            self.loop.run_until_complete(cm.__aexit__(None, None, None))


@contextlib.contextmanager
def either(kind: str, path: str, **config: Any) -> Iterator[Sync]:
    if kind == "sync":
        with Client(path, **config) as client:
            yield Sync(client)
        return
    loop = asyncio.new_event_loop()
    aclient = loop.run_until_complete(AsyncClient.connect(path, **config))
    try:
        yield Sync(aclient, loop)
    finally:
        loop.run_until_complete(aclient.close())
        loop.close()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_acquire_and_release_against_the_agent(make_agent, store, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(LEASE_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        assert c.protocol_version == 6
        key = unique("user")
        t0 = now_ms()
        first, a = c.acquire(key, "slots")
        second, b = c.acquire(key, "slots")
        t1 = now_ms()
        for d, left in ((first, 1), (second, 0)):
            assert d.from_agent and d.allowed and d.holds_lease and (d.limit, d.remaining) == (2, left), d
            [item] = d.items
            assert item.rule_id == "slots" and item.holds_lease and item.verdict.holds_lease
            # A lease just taken ends leaseSeconds from now.
            assert t0 + LEASE_SECONDS * 1000 <= d.reset_at_ms <= t1 + LEASE_SECONDS * 1000 + 1000, d
        assert isinstance(a, Lease) and isinstance(b, Lease)
        assert (a.key, a.rule_id, a.cost) == (key, "slots", 1) and a.id != b.id and 0 < a.id < 2**64

        # The third unit: denied, soon retried (the agent caps it at 1 s: holders release sooner), no lease.
        third, c3 = c.acquire(key, "slots")
        assert third.from_agent and not third.allowed and c3 is None, third
        assert third.retry_after_ms is not None and 1 <= third.retry_after_ms <= 1000, third
        assert not third.holds_lease and not third.items[0].holds_lease and third.remaining == 0

        # A release frees its slot, once: a lease no longer held changes nothing.
        d = c.release(a)
        assert d.from_agent and d.allowed and d.remaining == 1 and not d.holds_lease, d
        assert c.release(a).remaining == 1
        assert c.peek(key, "slots").remaining == 1, "a peek reads what is held, changing nothing"
        d, again = c.acquire(key, "slots")
        assert d.allowed and again is not None and again.id not in (a.id, b.id)
        # Costs: a lease of 2 units needs two free slots.
        c.release(b)
        c.release(again)
        big, lease = c.acquire(key, "slots", 2)
        assert big.allowed and big.remaining == 0 and lease is not None and lease.cost == 2
        assert not c.acquire(key, "slots")[0].allowed
        assert c.release(lease).remaining == 2

        # A rule of another algorithm ignores the lease: it consumes as allow does, and holds nothing.
        d, none = c.acquire(key, "r")
        assert d.allowed and d.remaining == 2 and none is None and not d.holds_lease


def test_hold_gives_its_units_back_however_its_block_ends(make_agent, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(LEASE_RULES)
    with either(kind, agent.socket, timeout=2.0) as c:
        key = unique("user")
        with c.hold(key, "slots") as one, c.hold(key, "slots") as two:
            assert one.allowed and two.allowed and two.remaining == 0
            with c.hold(key, "slots") as three:
                assert not three.allowed and three.retry_after_ms <= 1000, "a denial holds nothing"
        assert c.peek(key, "slots").remaining == 2, "both given back when the block ended"

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            with c.hold(key, "slots", 2) as d:
                assert d.allowed and d.remaining == 0
                raise Boom()
        assert c.peek(key, "slots").remaining == 2, "given back when the block raised"


def test_a_hold_cancelled_in_its_block_gives_its_units_back(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(LEASE_RULES)

    async def main() -> None:
        client = await AsyncClient.connect(agent.socket, timeout=2.0)
        key = unique("user")
        entered = asyncio.Event()

        async def holder() -> None:
            async with client.hold(key, "slots", 2) as d:
                assert d.allowed
                entered.set()
                await asyncio.Event().wait()  # in flight until cancelled

        task = asyncio.create_task(holder())
        await entered.wait()
        assert (await client.peek(key, "slots")).remaining == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.peek(key, "slots")).remaining == 2
        await client.close()

    asyncio.run(main())


# --- fake agents: the bytes, and agents that cannot hold leases -------------------------------------


def fake_decision(rid: int, holds: bool = True, allowed: bool = True) -> bytes:
    v = p.Verdict(allowed, False, p.Source.LOCAL, 2, 1, 1_700_000_000_000, 0 if allowed else 1000, holds)
    return p.encode(p.Frame(rid, p.DecisionBody(v, [p.ItemDecision("slots", v)])))


def hello(version: int) -> bytes:
    return p.encode(p.Frame(0, p.HelloOk(version)))


def test_acquire_and_release_put_the_lease_on_the_wire(kind: str) -> None:
    from test_fake_agent import FakeAgent

    holds = iter([True, False])
    fake = FakeAgent(lambda conn, rid: fake_decision(rid, next(holds, True)), hello=hello(3))
    try:
        with either(kind, fake.path, timeout=2.0) as c:
            d, lease = c.acquire("apikey:abc", "slots", 2)
            assert d.holds_lease and lease is not None and (lease.key, lease.cost) == ("apikey:abc", 2)
            sent = fake.checks[-1]
            rid = int.from_bytes(sent[6:10], "big")
            want = p.Check(items=[p.Item.acquire("apikey:abc", "slots", 2, lease.id)])
            assert sent == p.encode(p.Frame(rid, want)), sent.hex(" ")
            assert sent[10] == 2 and sent[-9] == 0x80, "form 2, the lease bit, the lease"
            # An item that does not say it holds the lease gives none.
            assert c.acquire("apikey:abc", "slots")[1] is None
            c.release(lease)
            sent = fake.checks[-1]
            rid = int.from_bytes(sent[6:10], "big")
            want = p.Check(items=[p.Item.release("apikey:abc", "slots", 2, lease.id)])
            assert sent == p.encode(p.Frame(rid, want)) and sent[-9] == 0x83, sent.hex(" ")
            # Two acquires, two ids.
            ids = {int.from_bytes(ch[-8:], "big") for ch in fake.checks[:2]}
            assert len(ids) == 2
    finally:
        fake.close()


@pytest.mark.parametrize("version", [1, 2])
def test_an_agent_older_than_version_3_is_never_sent_a_lease(kind: str, version: int) -> None:
    from test_fake_agent import FakeAgent

    fake = FakeAgent(lambda conn, rid: fake_decision(rid, holds=False), hello=hello(version))
    try:
        with either(kind, fake.path, timeout=2.0) as c:
            assert c.allow("k", "slots").from_agent and c.protocol_version == version
            lease = Lease("k", "slots", 1, 42)
            for call in (lambda: c.acquire("k", "slots"), lambda: c.release(lease), lambda: c.release(lease, fail="open")):
                with pytest.raises(UnsupportedByAgent) as e:
                    call()
                assert isinstance(e.value, InvalidCheck) and (e.value.needed, e.value.agent_version) == (3, version)
                assert str(e.value) == (
                    f"the agent at {fake.path} speaks protocol version {version}: it cannot hold leases (update the agent)"
                )
            with pytest.raises(UnsupportedByAgent):
                with c.hold("k", "slots"):
                    pass
            assert len(fake.checks) == 1, "nothing but the first allow was sent"
            assert c.allow("k", "slots").from_agent and c.stats().connects == 1, "the connection is kept"
    finally:
        fake.close()


def test_an_agent_that_cannot_answer_gives_no_lease(kind: str, tmp_path) -> None:  # noqa: ANN001
    nobody = str(tmp_path / "nobody.sock")
    with either(kind, nobody, timeout=0.05, connect_timeout=0.05) as c:
        assert c.protocol_version is None
        d, lease = c.acquire("k", "slots")
        assert d.allowed and d.origin is Origin.FAIL_OPEN and lease is None
        d, lease = c.acquire("k", "slots", fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and lease is None
        # A release the agent never gets is answered, not raised: the lease runs out by its time.
        d = c.release(Lease("k", "slots", 1, 42))
        assert d.allowed and d.origin is Origin.FAIL_OPEN
        with c.hold("k", "slots") as d:
            assert d.allowed and d.origin is Origin.FAIL_OPEN
    # The fallback limit counts an acquire as a consume, and never a release.
    config = ClientConfig(fallback_limit=LocalLimit(limit=1, per=60.0), connect_timeout=0.05, timeout=0.05)
    with either(kind, nobody, config=config) as c:
        for _ in range(3):
            assert c.release(Lease("k", "slots", 1, 42)).allowed
        d, lease = c.acquire("k", "slots")
        assert d.allowed and d.origin is Origin.LOCAL_LIMIT and lease is None
        d, lease = c.acquire("k", "slots")
        assert not d.allowed and d.origin is Origin.LOCAL_LIMIT and lease is None
        assert c.stats().local_denied == 1


def test_a_release_the_agent_does_not_take_is_logged_by_hold(kind: str, caplog) -> None:  # noqa: ANN001
    import logging

    from test_fake_agent import FakeAgent

    from floodgate import lease as lease_module

    # Holds on acquire, never answers the release (timeout 0.05 s).
    answers = iter([True])
    fake = FakeAgent(lambda conn, rid: fake_decision(rid) if next(answers, False) else None, hello=hello(3))
    caplog.set_level(logging.DEBUG, logger="floodgate")
    lease_module.RELEASE_LOST._last = -1
    try:
        with either(kind, fake.path, timeout=0.05) as c:
            eventually("connected", lambda: c.protocol_version == 3)
            with c.hold("k", "slots") as d:
                assert d.holds_lease
            said = [r.getMessage() for r in caplog.records if "release" in r.getMessage()]
            assert any("could not take a lease's release (timeout)" in m for m in said), said
            assert fake.checks[-1][-9] == 0x83, "the release was sent"
    finally:
        fake.close()


def test_attribute_checks_carry_a_lease(make_agent, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(LEASE_RULES)
    with either(kind, agent.socket, timeout=2.0) as c:
        user = unique("u")
        # Both rules of /items-only match: the concurrency rule holds the lease, the window consumes.
        d = c.check_attributes(endpoint="/items-only", user=user, lease=7)
        assert d.allowed and d.holds_lease, d
        held = {i.rule_id: (i.holds_lease, i.verdict.remaining) for i in d.items}
        assert held == {"slots": (True, 1), "r": (False, 2)}, held
        # Protocol version 4: the window's windowSeconds; a concurrency rule has no window.
        assert {i.rule_id: i.window_ms for i in d.items} == {"slots": 0, "r": WINDOW_S * 1000}, d
        # Given back with the same attributes, cost and lease: the window is only peeked.
        d = c.check_attributes(endpoint="/items-only", user=user, lease=7, mode="release")
        assert {i.rule_id: i.verdict.remaining for i in d.items} == {"slots": 2, "r": 2}, d
        assert not d.holds_lease


def test_a_peek_with_a_lease_holds_one_unit_only_when_its_rate_rules_pass(make_agent, store, kind: str) -> None:  # noqa: ANN001
    """Form 3, a peek with a lease (a middleware's charge route): the rate rule is peeked (cost 0,
    nothing taken) and the concurrency rule holds max(cost, 1) = 1 unit under the lease, released
    with cost 1; when the rate rule is already past its limit, nothing is held."""
    agent = make_agent(LEASE_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        user = unique("u")

        def peek(lease: int):  # noqa: ANN202
            return c.check_attributes(endpoint="/items-only", user=user, cost=0, mode="peek", lease=lease)

        def release(lease: int):  # noqa: ANN202
            return c.check_attributes(endpoint="/items-only", user=user, cost=1, mode="release", lease=lease)

        def figures(d: Decision) -> dict:
            return {i.rule_id: (i.holds_lease, i.verdict.remaining) for i in d.items}

        def slots() -> int:
            return c.peek(f"user:{user}", "slots").remaining

        for lease, left in ((11, 1), (12, 0)):
            d = peek(lease)
            assert d.from_agent and d.allowed and d.holds_lease, d
            assert figures(d) == {"slots": (True, left), "r": (False, 3)}, d
        # Full: a third is denied by the concurrency rule (a retry of at most 1 s) and holds nothing.
        d = peek(13)
        assert not d.allowed and not d.holds_lease and d.limit == 2, d
        assert d.retry_after_ms is not None and 1 <= d.retry_after_ms <= 1000, d
        assert slots() == 0
        d = release(11)
        assert d.allowed and figures(d) == {"slots": (False, 1), "r": (False, 3)}, d

        # The rate rule past its limit: refused by it, and the free unit is not taken.
        c.charge(f"user:{user}", "r", 5)
        d = peek(14)
        assert d.from_agent and not d.allowed and not d.holds_lease and d.limit == 3, d
        assert d.retry_after_ms is not None and d.retry_after_ms > 1000, d
        assert not any(i.holds_lease for i in d.items), d
        assert slots() == 1, "a refused peek holds no unit"
        # A release while the rate rule is past its limit: the rate rule answers it as a peek of cost
        # 0, denied, and that peek decides the check (no consume items), so the combined verdict is a
        # denial; the concurrency rule's unit is freed all the same. The refused peek's lease (were its
        # release sent) frees nothing: lease 12 still holds its unit.
        d = release(14)
        assert d.from_agent and figures(d) == {"slots": (False, 1), "r": (False, 0)}, d
        assert slots() == 1
        d = release(12)
        assert d.from_agent and not d.allowed and figures(d) == {"slots": (False, 2), "r": (False, 0)}, d
        assert slots() == 2


# --- the caller's trace context (protocol version 5) ------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_agent_answers_traced_checks_as_any(make_agent, store, kind: str) -> None:  # noqa: ANN001
    # The agent reads form 4 (it exports no span here: it was not given an OTLP endpoint); the
    # context changes nothing in the decision, and the connection stays.
    agent = make_agent(LEASE_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        assert c.protocol_version == 6
        key = unique("user")
        traced = {"traceparent": TRACEPARENT}
        for left in (2, 1):
            d = c.allow(key, "r", **traced)
            assert d.from_agent and d.allowed and (d.limit, d.remaining) == (3, left), d
        assert c.peek(key, "r", **traced).remaining == 1
        d = c.charge(key, "r", 2, **traced)
        assert d.from_agent and d.allowed and d.remaining == 0 and not d.items[0].verdict.allowed, "a debt"
        d = c.check([(key, "r", 1)], traceparent=TRACEPARENT[:-2] + "00")  # not sampled
        assert d.from_agent and not d.allowed and d.retry_after_ms, d
        d, lease = c.acquire(key, "slots", **traced)
        assert d.allowed and d.holds_lease and lease is not None and d.remaining == 1, d
        with c.hold(key, "slots", **traced) as h:
            assert h.allowed and h.holds_lease and h.remaining == 0
            assert not c.acquire(key, "slots", **traced)[0].allowed
        assert c.release(lease, **traced).remaining == 2
        d = c.check_attributes(endpoint="/items-only", user=unique("u"), cost=2, **traced)
        assert d.from_agent and d.allowed and {i.rule_id: i.verdict.remaining for i in d.items} == {"slots": 0, "r": 1}
        # A header that does not parse: the same check, without it.
        d = c.allow(unique("user"), "r", traceparent="00-not-a-trace")
        assert d.from_agent and d.remaining == 2
        s = c.stats()
        assert (s.connects, s.unavailable, s.timeouts) == (1, 0, 0), s
