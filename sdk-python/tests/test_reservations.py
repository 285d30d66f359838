"""Reservations (protocol version 6) in both clients: against real agents on the embedded store and
on Redis, a reserve of 400 out of 1,000 leaves 600, its commit at 150 gives back 250, a second commit
changes nothing (it charges its figure whole under ``reservationExpiry = "release"``), a use past the
reservation is charged, meters of a tokens rule and a concurrency rule are reserved all or nothing
and committed together (the unit in flight released whole), and a reserve the budget cannot hold
gives no reservation and takes nothing. Against fake agents: the bytes reserve and commit put on the
wire, an agent older than version 6 never sent them (the call raises), a reserve the agent does not
answer (late, or a cancelled caller) committed at 0 at once with its id, none when the agent
answered, and no agent at all (no reservation; the fallback limit counts a reserve as a consume,
never a commit). Every wait is bounded."""

from __future__ import annotations

import asyncio
from typing import Iterator, List, Optional

import pytest
from conftest import unique
from rules import RESERVATION_RULES, RESERVATION_WINDOW_S, clear_of_window_edge
from test_fake_agent import FakeAgent
from test_leases import either, hello

from floodgate import (
    AgentError,
    AsyncClient,
    ClientConfig,
    Decision,
    Degraded,
    InvalidCheck,
    LocalLimit,
    Meter,
    Origin,
    Reservation,
    UnsupportedByAgent,
)
from floodgate import protocol as p

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def figures(d: Decision) -> dict:
    """Each item's rule: whether it holds the reservation, and its remaining units."""
    return {i.rule_id: (i.holds_lease, i.verdict.remaining) for i in d.items}


# --- against the agent ------------------------------------------------------------------------------


def test_reserve_then_commit_gives_back_what_was_not_used(make_agent, store, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(RESERVATION_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        assert c.protocol_version == 6
        key = unique("apikey")
        clear_of_window_edge(RESERVATION_WINDOW_S)

        d, r = c.reserve(key, "output-tokens", 400)
        assert d.from_agent and d.allowed and d.holds_lease and (d.limit, d.remaining) == (1000, 600), d
        assert figures(d) == {"output-tokens": (True, 600)}, d
        assert isinstance(r, Reservation) and r.meters == (Meter(key, "output-tokens", 400),) and 0 <= r.id < 2**64
        assert c.peek(key, "output-tokens").remaining == 600, "the reservation is counted"

        d = c.commit(r, [150])
        assert d.from_agent and d.allowed and d.remaining == 850 and not d.holds_lease, d
        assert c.peek(key, "output-tokens").remaining == 850, "the 250 not used are given back"
        # Committed already: the agent holds nothing for it, and under reservationExpiry "charge"
        # such a commit changes nothing.
        d = c.commit(r, [150])
        assert d.from_agent and d.allowed and d.remaining == 850, d
        assert c.peek(key, "output-tokens").remaining == 850

        # A use past the reservation is charged: 100 reserved, 300 used.
        d, r = c.reserve(key, "output-tokens", 100, traceparent=TRACEPARENT)
        assert d.allowed and d.remaining == 750 and r is not None, d
        d = c.commit(r, [300], traceparent=TRACEPARENT)
        assert d.from_agent and d.allowed and d.remaining == 550, d

        # Two reservations, two ids.
        _, a = c.reserve(key, "output-tokens", 1)
        _, b = c.reserve(key, "output-tokens", 1)
        assert a is not None and b is not None and a.id != b.id
        assert c.commit(a, [0]).remaining == 549 and c.commit(b, [0]).remaining == 550

        # Under reservationExpiry "release", a commit the agent holds nothing for charges its figure
        # whole (the units of an expired reservation went back).
        d, r = c.reserve(key, "tokens-released", 400)
        assert d.allowed and d.remaining == 600 and r is not None, d
        assert c.commit(r, [150]).remaining == 850
        d = c.commit(r, [150])
        assert d.from_agent and d.allowed and d.remaining == 700, d


def test_meters_are_reserved_all_or_nothing(make_agent, store, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(RESERVATION_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        key = unique("apikey")
        clear_of_window_edge(RESERVATION_WINDOW_S)

        def left() -> dict:
            return {rule: c.peek(key, rule).remaining for rule in ("output-tokens", "in-flight")}

        d, first = c.reserve_meters([Meter(key, "output-tokens", 400), (key, "in-flight", 1)])
        assert d.from_agent and d.allowed, d
        assert figures(d) == {"output-tokens": (True, 600), "in-flight": (True, 1)}, d
        assert first is not None and first.meters == (Meter(key, "output-tokens", 400), Meter(key, "in-flight", 1))
        assert left() == {"output-tokens": 600, "in-flight": 1}

        # More tokens than are left: refused whole, the free unit in flight not taken either.
        d, none = c.reserve_meters([(key, "output-tokens", 700), (key, "in-flight", 1)])
        assert d.from_agent and not d.allowed and none is None and not d.holds_lease, d
        assert d.limit == 1000 and d.retry_after_ms is not None and d.retry_after_ms > 1000, d
        assert left() == {"output-tokens": 600, "in-flight": 1}

        d, second = c.reserve_meters([(key, "output-tokens", 100), (key, "in-flight", 1)])
        assert d.allowed and second is not None and figures(d) == {"output-tokens": (True, 500), "in-flight": (True, 0)}
        # Both units in flight held: refused by the concurrency rule (a retry of at most 1 s), no
        # token taken.
        d, none = c.reserve_meters([(key, "output-tokens", 1), (key, "in-flight", 1)])
        assert d.from_agent and not d.allowed and none is None and d.limit == 2, d
        assert d.retry_after_ms is not None and 1 <= d.retry_after_ms <= 1000, d
        assert left() == {"output-tokens": 500, "in-flight": 0}

        # Committed: the tokens not used go back, the unit in flight is released whole whatever
        # its figure.
        d = c.commit(first, [150, 0])
        assert d.from_agent and d.allowed and figures(d) == {"output-tokens": (False, 750), "in-flight": (False, 1)}, d
        assert left() == {"output-tokens": 750, "in-flight": 1}
        d = c.commit(second, [100, 1])
        assert d.allowed and left() == {"output-tokens": 750, "in-flight": 2}

        # One figure per meter, or nothing is sent.
        for used in ([150], [1, 2, 3], 150, "150"):
            with pytest.raises(InvalidCheck, match="one used figure per meter|a list of used figures"):
                c.commit(second, used)
        assert left() == {"output-tokens": 750, "in-flight": 2}


def test_a_reserve_the_budget_cannot_hold_gives_no_reservation(make_agent, store, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(RESERVATION_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        key = unique("apikey")
        clear_of_window_edge(RESERVATION_WINDOW_S)
        d, none = c.reserve(key, "output-tokens", 1200)
        assert d.from_agent and not d.allowed and none is None and not d.holds_lease, d
        assert d.limit == 1000 and d.retry_after_ms is not None and d.retry_after_ms > 0, d
        assert c.peek(key, "output-tokens").remaining == 1000, "a refused reserve takes nothing"
        # With 400 held, 601 more do not fit; 600 do.
        _, r = c.reserve(key, "output-tokens", 400)
        assert r is not None
        d, none = c.reserve(key, "output-tokens", 601)
        assert not d.allowed and none is None, d
        d, full = c.reserve(key, "output-tokens", 600)
        assert d.allowed and d.remaining == 0 and full is not None, d
        # A rule the agent does not know: its error, and nothing held.
        with pytest.raises(AgentError) as e:
            c.reserve(key, "nope", 1)
        assert e.value.code == p.ErrorCode.UNKNOWN_RULE
        s = c.stats()
        assert (s.connects, s.unavailable, s.timeouts) == (1, 0, 0), s


# --- fake agents: the bytes, agents that cannot hold reservations, agents that do not answer ---------

TOKENS = Meter("apikey:abc", "output-tokens", 4096)
IN_FLIGHT = Meter("apikey:abc", "in-flight", 1)


def answer(rid: int, rules: List[str], holds: List[bool], allowed: bool = True) -> bytes:
    """A Decision for a check of ``rules``, each item holding its reservation as ``holds`` says."""
    retry = 0 if allowed else 1000
    items = [
        p.ItemDecision(rule, p.Verdict(allowed, False, p.Source.LOCAL, 1000, 600, 1_700_000_000_000, retry, h))
        for rule, h in zip(rules, holds)
    ]
    return p.encode(p.Frame(rid, p.DecisionBody(items[0].verdict, items)))


def body_of(frame: bytes) -> p.Check:
    decoded = p.decode(frame)
    assert isinstance(decoded, p.Decoded) and decoded.used == len(frame), frame.hex(" ")
    body = decoded.frame.body
    assert isinstance(body, p.Check)
    return body


def items_of(frame: bytes) -> List[p.Item]:
    items = body_of(frame).items
    assert items is not None, frame.hex(" ")
    return items


def rid_of(frame: bytes) -> int:
    return int.from_bytes(frame[6:10], "big")


def committed_at_0(check: bytes, commit: bytes) -> None:
    """Asserts ``commit`` is the commit at 0 of the reserve ``check``: every meter, the same id."""
    reserved = items_of(check)
    assert reserved and all(it.mode is p.ItemMode.RESERVE and it.lease is not None for it in reserved), check.hex(" ")
    want = p.Check(items=[p.Item.commit(it.key, it.rule_id, 0, it.lease) for it in reserved if it.lease is not None])
    assert commit == p.encode(p.Frame(rid_of(commit), want)), commit.hex(" ")
    assert rid_of(commit) != rid_of(check) and commit[-8:] == check[-8:]


def test_reserve_and_commit_put_the_reservation_on_the_wire(kind: str) -> None:
    # Holds both meters, then only the first, then none.
    holds = iter([[True, True], [True, False], [False, False]])
    rules = ["output-tokens", "in-flight"]
    fake = FakeAgent(lambda conn, rid: answer(rid, rules, next(holds, [True, True])), hello=hello(6))
    try:
        with either(kind, fake.path, timeout=2.0) as c:
            assert c.protocol_version == 6
            d, r = c.reserve_meters([TOKENS, ("apikey:abc", "in-flight", 1)])
            assert d.from_agent and r is not None and r.meters == (TOKENS, IN_FLIGHT) and 0 <= r.id < 2**64, (d, r)
            sent = fake.checks[-1]
            want = p.Check(items=[p.Item.reserve(m.key, m.rule_id, m.units, r.id) for m in (TOKENS, IN_FLIGHT)])
            assert sent == p.encode(p.Frame(rid_of(sent), want)), sent.hex(" ")
            assert sent[10] == p.FORM_ITEMS_MODES and sent[-9] == p.MODE_LEASE | p.ItemMode.RESERVE
            # As PROTOCOL.md's vector, but for the request and reservation ids.
            vector = p.check_items_frame(19, [p.Item.reserve(*m, 0x0123456789ABCDEF) for m in (TOKENS, IN_FLIGHT)])
            assert sent[10:] == vector[10:].replace(bytes.fromhex("0123456789abcdef"), r.id.to_bytes(8, "big"))
            # Held by one meter only (a quota-mode meter let through flagged took nothing): a
            # reservation of that meter, whose commit names it alone; held by none: no reservation.
            d, part = c.reserve_meters([TOKENS, IN_FLIGHT])
            assert d.from_agent and part is not None and part.held == (True, False), (d, part)
            d, none = c.reserve_meters([TOKENS, IN_FLIGHT])
            assert d.from_agent and none is None, d
            c.commit(part, [612, 0])
            assert items_of(fake.checks[-1]) == [p.Item.commit(*TOKENS[:2], 612, part.id)]
            c.commit(r, [612, 0])
            sent = fake.checks[-1]
            want = p.Check(items=[p.Item.commit(m.key, m.rule_id, u, r.id) for m, u in ((TOKENS, 612), (IN_FLIGHT, 0))])
            assert sent == p.encode(p.Frame(rid_of(sent), want)) and sent[-9] == 0x85, sent.hex(" ")
            # One meter: reserve; three reserves, three ids.
            d, one = c.reserve("apikey:abc", "output-tokens", 4096)
            assert one is not None and one.meters == (TOKENS,)
            assert items_of(fake.checks[-1]) == [p.Item.reserve(*TOKENS, one.id)]
            assert len({int.from_bytes(ch[-8:], "big") for ch in fake.checks[:3]}) == 3
    finally:
        fake.close()


@pytest.mark.parametrize("version", [1, 3, 5])
def test_an_agent_older_than_version_6_is_never_sent_a_reservation(kind: str, version: int) -> None:
    fake = FakeAgent(lambda conn, rid: answer(rid, ["output-tokens"], [False]), hello=hello(version))
    try:
        with either(kind, fake.path, timeout=2.0) as c:
            assert c.allow("apikey:abc", "output-tokens").from_agent and c.protocol_version == version
            r = Reservation(42, (TOKENS,))
            for call in (
                lambda: c.reserve("apikey:abc", "output-tokens", 10),
                lambda: c.reserve_meters([TOKENS, IN_FLIGHT]),
                lambda: c.commit(r, [10]),
                lambda: c.commit(r, [0], fail="open"),
            ):
                with pytest.raises(UnsupportedByAgent) as e:
                    call()
                assert isinstance(e.value, InvalidCheck) and (e.value.needed, e.value.agent_version) == (6, version)
                assert str(e.value) == (
                    f"the agent at {fake.path} speaks protocol version {version}: it cannot hold reservations"
                    " (update the agent)"
                )
            assert len(fake.checks) == 1, "nothing but the first allow was sent"
            assert c.allow("apikey:abc", "output-tokens").from_agent, "the connection is kept"
            assert c.stats().connects == 1
    finally:
        fake.close()


@pytest.fixture
def silent_agent() -> Iterator[FakeAgent]:
    """A fake agent of version 6 that never answers a reserve, and answers anything else (allowed,
    holding nothing)."""
    fake: Optional[FakeAgent] = None

    def respond(conn: int, rid: int) -> Optional[bytes]:
        assert fake is not None
        items = items_of(fake.checks[-1])
        if any(it.mode is p.ItemMode.RESERVE for it in items):
            return None
        return answer(rid, [it.rule_id for it in items], [False] * len(items))

    fake = FakeAgent(respond, hello=hello(6))
    yield fake
    fake.close()


def test_a_reserve_the_agent_does_not_answer_is_committed_at_0(kind: str, silent_agent: FakeAgent) -> None:
    with either(kind, silent_agent.path, timeout=0.05) as c:
        assert c.protocol_version == 6
        d, r = c.reserve_meters([TOKENS, IN_FLIGHT], traceparent=TRACEPARENT)
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.TIMEOUT and r is None, d
        check, commit = silent_agent.wait_checks(2)[:2]
        # Both carry the caller's trace context (form 4), as the call did; compared without it.
        trace = p.TraceContext.parse(TRACEPARENT)
        assert body_of(check).trace == body_of(commit).trace == trace and trace is not None
        committed_at_0(_untraced(check), _untraced(commit))
        # Denied by the fail policy: the same, under another id.
        d, r = c.reserve("apikey:abc", "output-tokens", 10, fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and r is None, d
        check, commit = silent_agent.wait_checks(4)[2:4]
        committed_at_0(check, commit)
        assert check[-8:] != silent_agent.checks[0][-8:]


def _untraced(frame: bytes) -> bytes:
    """A form-4 Check frame without its trace context (its form byte and 25 bytes)."""
    assert frame[10] == p.FORM_TRACED, frame.hex(" ")
    return (len(frame) - 4 - p.TRACE_LEN).to_bytes(4, "big") + frame[4:10] + frame[10 + p.TRACE_LEN :]


def test_a_reserve_the_agent_answered_is_not_committed(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: answer(rid, ["output-tokens"], [False], allowed=False), hello=hello(6))
    try:
        with either(kind, fake.path, timeout=2.0) as c:
            d, r = c.reserve("apikey:abc", "output-tokens", 10)
            assert d.from_agent and not d.allowed and r is None
            # Frames arrive in order: a commit would have been sent before the reserve returned.
            assert c.allow("apikey:abc", "output-tokens").from_agent
            checks = fake.wait_checks(2)
            assert [items_of(ch)[0].mode for ch in checks] == [p.ItemMode.RESERVE, p.ItemMode.CONSUME]
    finally:
        fake.close()


def test_a_reserve_cancelled_while_it_waits_is_committed_at_0(silent_agent: FakeAgent) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        client = await AsyncClient.connect(silent_agent.path, timeout=5.0)
        try:
            task = asyncio.create_task(client.reserve_meters([TOKENS, IN_FLIGHT]))
            await loop.run_in_executor(None, silent_agent.wait_checks, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            check, commit = (await loop.run_in_executor(None, silent_agent.wait_checks, 2))[:2]
            committed_at_0(check, commit)
        finally:
            await client.close()

    asyncio.run(main())


def test_an_agent_that_cannot_answer_gives_no_reservation(kind: str, tmp_path) -> None:  # noqa: ANN001
    nobody = str(tmp_path / "nobody.sock")
    with either(kind, nobody, timeout=0.05, connect_timeout=0.05) as c:
        assert c.protocol_version is None
        d, r = c.reserve("apikey:abc", "output-tokens", 10)
        assert d.allowed and d.origin is Origin.FAIL_OPEN and r is None, d
        d, r = c.reserve_meters([TOKENS, IN_FLIGHT], fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and r is None, d
        # A commit the agent never gets is answered, not raised: the reservation expires by its time.
        d = c.commit(Reservation(42, (TOKENS,)), [10])
        assert d.allowed and d.origin is Origin.FAIL_OPEN, d
        # What the caller got wrong raises all the same, before anything is sent.
        for meters in ([], [TOKENS] * 17, [("apikey:abc", "output-tokens")], [("apikey:abc", "output-tokens", 0)]):
            with pytest.raises(InvalidCheck):
                c.reserve_meters(meters)
        with pytest.raises(InvalidCheck, match="1 given for a reservation of 2 meters"):
            c.commit(Reservation(42, (TOKENS, IN_FLIGHT)), [10])
    # The fallback limit counts a reserve as a consume, and never a commit.
    config = ClientConfig(fallback_limit=LocalLimit(limit=10, per=60.0), connect_timeout=0.05, timeout=0.05)
    with either(kind, nobody, config=config) as c:
        for _ in range(3):
            assert c.commit(Reservation(42, (TOKENS,)), [10]).allowed
        d, r = c.reserve("apikey:abc", "output-tokens", 10)
        assert d.allowed and d.origin is Origin.LOCAL_LIMIT and r is None, d
        d, r = c.reserve("apikey:abc", "output-tokens", 1)
        assert not d.allowed and d.origin is Origin.LOCAL_LIMIT and r is None, d
        assert c.stats().local_denied == 1
