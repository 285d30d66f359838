"""The sans-I/O core both clients run on (floodgate._core, floodgate._policy), driven with bytes and
clocks by hand: no socket, no agent, no sleep."""

from __future__ import annotations

import errno
import logging
from typing import Any, List, Optional, Tuple

import pytest

from floodgate import (
    AgentError,
    Attributes,
    ClientConfig,
    Degraded,
    FailPolicy,
    InvalidCheck,
    Item,
    ItemMode,
    Lease,
    LocalLimit,
    Meter,
    Origin,
    Reservation,
    Source,
    TraceContext,
    UnsupportedByAgent,
)
from floodgate import protocol as p
from floodgate._core import LASTED, Backoff, Core, HandshakeError, configure
from floodgate._policy import TIMEOUT, UNAVAILABLE, Policy

PATH = "/tmp/nowhere/agent.sock"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OK = p.Verdict(True, False, Source.LOCAL, 10, 9, 1_000, 0)


class Clock:
    """Monotonic and wall time, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def mono(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now


def core(config: Optional[ClientConfig] = None, clock: Optional[Clock] = None, **kw: Any) -> Core:
    c = clock or Clock()
    return Core(PATH, config or ClientConfig(), clock=c.mono, wall=c.wall, **kw)


def body(frame: bytes) -> Any:
    decoded = p.decode(frame)
    assert isinstance(decoded, p.Decoded) and decoded.used == len(frame), decoded
    return decoded.frame


def answer(rid: int, b: Any) -> bytes:
    return p.encode(p.Frame(rid, b))


def woken() -> Tuple[List[Tuple[Any, object]], Any]:
    got: List[Tuple[Any, object]] = []
    return got, lambda w, reply: got.append((w, reply))


# --- requests -------------------------------------------------------------------------------------


def test_each_call_builds_its_frame_its_subject_and_the_version_it_needs() -> None:
    c = core()
    lease = Lease("k", "slots", 2, 0xABCDEF)
    acquire = Item.acquire("k", "slots", 2, 0xABCDEF)
    release = Item.release("k", "slots", 2, 0xABCDEF)
    mixed = [("a", "r"), Item("b", "r", 1, ItemMode.PEEK)]
    attrs = Attributes(endpoint="/x", user="u", lease=5)
    cases = [
        # (request, the frame's Check, what the fail policy checks, the version needed)
        (c.allow("k", "r", 3), p.Check(items=[Item("k", "r", 3)]), (("k", "r", 3),), 1),
        (c.peek("k", "r", 0), p.Check(items=[Item("k", "r", 0, ItemMode.PEEK)]), None, 2),
        (c.charge("k", "r", 7), p.Check(items=[Item("k", "r", 7, ItemMode.CHARGE)]), None, 2),
        (c.acquire("k", "slots", 2, 0xABCDEF), p.Check(items=[acquire]), (acquire,), 3),
        (c.release(lease), p.Check(items=[release]), (release,), 3),
        (c.check(mixed), p.Check(items=[Item("a", "r"), Item("b", "r", 1, ItemMode.PEEK)]), mixed, 2),
        (c.check_request(attrs), p.Check(attributes=attrs), attrs, 3),
    ]
    for n, ((rid, frame, subject, need), check, want_subject, want_need) in enumerate(cases, 1):
        got = body(frame)
        assert (rid, got.request_id, got.body, need) == (n, n, check, want_need)
        if want_subject is not None:
            assert subject == want_subject
        else:
            assert list(subject) == check.items


def test_request_ids_skip_0_and_the_ids_of_waiting_calls() -> None:
    c = core()
    c.pending.update({1: object(), 3: object()})
    assert [c.next_id() for _ in range(3)] == [2, 4, 5]
    # 32 bits: 2**32 wraps to 0, never an id; 2**32 + 6 to 6, a waiting call's.
    c._ids = iter([0x1_0000_0000, 0x1_0000_0006, 0x1_0000_0007])
    c.pending[6] = object()
    assert c.next_id() == 7


def test_prepare_refuses_what_the_connection_cannot_carry_and_adds_the_trace_only_for_version_5() -> None:
    c = core()
    _, frame, _, need = c.peek("k", "r", 0)
    with pytest.raises(UnsupportedByAgent, match=f"the agent at {PATH} speaks version 1"):
        c.prepare(frame, need, 1, None)
    assert c.prepare(frame, need, 2, None) is frame
    assert c.prepare(frame, need, 4, TRACEPARENT) is frame  # version 4 cannot parse form 4
    assert c.prepare(frame, need, 5, "not a traceparent") is frame  # ignored, never fails the check
    traced = body(c.prepare(frame, need, 5, TRACEPARENT))
    assert traced.body.trace == TraceContext.parse(TRACEPARENT)
    assert traced.body.items == body(frame).body.items


def test_configure_overrides_fields_and_refuses_a_misspelt_policy() -> None:
    base = ClientConfig(timeout=0.5)
    assert configure(base, {}) is base
    got = configure(base, {"fail": "closed"})
    assert (got.timeout, got.fail) == (0.5, FailPolicy.CLOSED)
    with pytest.raises(ValueError):
        configure(None, {"fail": "clsoed"})


# --- what the agent sends -------------------------------------------------------------------------


def test_hello_waits_for_the_whole_answer_and_keeps_what_follows_it() -> None:
    after = answer(7, p.DecisionBody(OK, []))
    whole = answer(0, p.HelloOk(4)) + after
    buf = bytearray(whole[:5])
    assert Core.hello(buf) is None and bytes(buf) == whole[:5]
    buf = bytearray(whole)
    assert Core.hello(buf) == 4
    assert bytes(buf) == after


@pytest.mark.parametrize(
    "reply, why",
    [
        (answer(0, p.HelloOk(7)), "agent chose version 7; this SDK speaks 1 to 6"),
        (answer(0, p.HelloOk(0)), "agent chose version 0; this SDK speaks 1 to 6"),
        (answer(0, p.ErrorBody(p.ErrorCode.UNSUPPORTED_VERSION, "too old")), "agent refused Hello: 3: too old"),
        (answer(0, p.Pong()), "unexpected answer to Hello (not a Floodgate agent?)"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "unexpected answer to Hello (not a Floodgate agent?)"),
    ],
)
def test_hello_refuses_any_other_answer_with_why(reply: bytes, why: str) -> None:
    with pytest.raises(HandshakeError) as e:
        Core.hello(bytearray(reply))
    assert str(e.value) == why


def test_dispatch_wakes_each_answered_call_and_keeps_a_partial_frame() -> None:
    c = core()
    a, b = object(), object()
    c.pending.update({1: a, 2: b})
    d1 = p.DecisionBody(OK, [p.ItemDecision("r", OK)])
    refused = p.ErrorBody(p.ErrorCode.UNKNOWN_RULE, "no rule r")
    second = answer(2, refused)
    stream = answer(1, d1) + answer(9, p.DecisionBody(OK, [])) + answer(0, p.Pong()) + second[:7]
    got, wake = woken()
    buf = bytearray(stream)
    assert c.dispatch(buf, wake) is None
    assert got == [(a, d1)]  # 9 waits for nothing (it gave up): dropped, as a Pong is
    assert bytes(buf) == second[:7] and c.pending == {2: b}
    buf += second[7:]
    assert c.dispatch(buf, wake) is None
    assert got[1] == (b, refused) and not buf and not c.pending


def test_dispatch_learns_the_fail_mode_list() -> None:
    c = core()
    listed = p.FailModeList(12, False, [p.ClosedRule("login", p.ListedDimension.IP, "/login", "", 5)])
    got, wake = woken()
    assert c.dispatch(bytearray(answer(3, listed)), wake) is None
    assert got == [] and c.policy.fail_modes == listed
    assert c.health(False).fail_closed_rules == 1 and c.health(False).rules_version == 12


def test_dispatch_answers_an_unreadable_reply_by_policy_and_ends_a_broken_stream() -> None:
    c = core()
    w = object()
    c.pending[5] = w
    # A Decision of a version this SDK does not speak: refused, its call woken now.
    unreadable = (6).to_bytes(4, "big") + bytes((99, 4)) + (5).to_bytes(4, "big")
    got, wake = woken()
    buf = bytearray(unreadable)
    assert c.dispatch(buf, wake) is None
    assert got == [(w, UNAVAILABLE)] and not buf
    broken = c.dispatch(bytearray(b"\xff\xff\xff\xff" + bytes(8)), wake)
    assert broken is not None and broken.startswith("the agent sent a broken frame: "), broken


def test_drain_empties_the_waiting_calls_in_place() -> None:
    c = core()
    pending = c.pending
    pending.update({1: "a", 2: "b"})
    assert sorted(c.drain()) == ["a", "b"]
    assert c.pending is pending and not pending


# --- unanswered acquires --------------------------------------------------------------------------


def test_the_precautionary_release_goes_only_where_it_can(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="floodgate")
    c = core()
    release = Item.release("k", "slots", 1, 0x1234)
    assert c.unanswered_release(release, None, TRACEPARENT) is None
    assert c.unanswered_release(release, 2, TRACEPARENT) is None
    said = [r.getMessage() for r in caplog.records]
    assert said[0].endswith("lease 4660 was not sent: no connection to the agent"), said
    assert "lease 4660 was not sent: the agent at" in said[1] and "cannot hold leases" in said[1], said
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    plain = body(c.unanswered_release(release, 3, TRACEPARENT))  # type: ignore[arg-type]
    assert plain.body == p.Check(items=[release])
    traced = body(c.unanswered_release(release, 5, TRACEPARENT))  # type: ignore[arg-type]
    assert traced.body.trace == TraceContext.parse(TRACEPARENT) and traced.body.items == [release]
    assert traced.request_id != plain.request_id


def test_the_precautionary_commit_goes_only_where_it_can(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="floodgate")
    c = core()
    r = Reservation(0x1234, (Meter("k", "tokens", 4096), Meter("k", "slots", 1)))
    assert c.unanswered_commit(r, None, TRACEPARENT) is None
    assert c.unanswered_commit(r, 5, TRACEPARENT) is None
    said = [rec.getMessage() for rec in caplog.records]
    assert said[0].endswith("reservation 4660 was not sent: no connection to the agent"), said
    assert "reservation 4660 was not sent: the agent at" in said[1] and "cannot hold reservations" in said[1], said
    assert all(rec.levelno == logging.DEBUG for rec in caplog.records)
    # Every meter at 0, under the reservation's id; traced for a caller that was.
    at_0 = [Item.commit("k", "tokens", 0, 0x1234), Item.commit("k", "slots", 0, 0x1234)]
    plain = body(c.unanswered_commit(r, 6, None))  # type: ignore[arg-type]
    assert plain.body == p.Check(items=at_0)
    traced = body(c.unanswered_commit(r, 6, TRACEPARENT))  # type: ignore[arg-type]
    assert traced.body.trace == TraceContext.parse(TRACEPARENT) and traced.body.items == at_0


def test_reserve_and_commit_need_version_6_and_a_figure_per_meter() -> None:
    c = core()
    r = Reservation(7, (Meter("k", "tokens", 400), Meter("k", "slots", 1)))
    rid, frame, subject, need = c.reserve(r)
    reserved = [Item.reserve("k", "tokens", 400, 7), Item.reserve("k", "slots", 1, 7)]
    assert (body(frame).body, list(subject), need) == (p.Check(items=reserved), reserved, 6)
    rid, frame, subject, need = c.commit(r, [150, 0])
    committed = [Item.commit("k", "tokens", 150, 7), Item.commit("k", "slots", 0, 7)]
    assert (body(frame).body, list(subject), need) == (p.Check(items=committed), committed, 6)
    with pytest.raises(UnsupportedByAgent, match="speaks protocol version 5: it cannot hold reservations"):
        c.prepare(frame, need, 5, None)
    for used in ([150], [150, 0, 0], [], 150, None, "15"):
        with pytest.raises(InvalidCheck, match="used figure"):
            c.commit(r, used)  # type: ignore[arg-type]
    with pytest.raises(InvalidCheck, match="cost must be an int from 1"):
        c.reserve(Reservation(7, (Meter("k", "tokens", 0),)))
    # The fallback limit counts a reserve as a consume, never a commit.
    limited = core(ClientConfig(fallback_limit=LocalLimit(limit=400, per=60.0)))
    _, _, reserve_subject, _ = limited.reserve(Reservation(8, (Meter("k", "tokens", 400),)))
    _, _, commit_subject, _ = limited.commit(r, [1000, 0])
    assert limited.policy.degraded(None, Degraded.TIMEOUT, commit_subject).origin is Origin.FAIL_OPEN
    assert limited.policy.degraded(None, Degraded.TIMEOUT, reserve_subject).origin is Origin.LOCAL_LIMIT
    assert not limited.policy.degraded(None, Degraded.TIMEOUT, reserve_subject).allowed


def test_the_fail_mode_list_is_asked_from_version_2() -> None:
    c = core()
    assert c.fail_modes_ask(1) is None
    asked = body(c.fail_modes_ask(2))  # type: ignore[arg-type]
    assert isinstance(asked.body, p.FailModes) and asked.request_id != 0


# --- the fail policy ------------------------------------------------------------------------------


def test_a_call_is_answered_by_the_agent_or_by_its_policy() -> None:
    c = core(ClientConfig(fail="closed", closed_retry_after=2.0))
    pol = c.policy
    d = pol.result(p.DecisionBody(OK, [p.ItemDecision("r", OK)]), None, (("k", "r", 1),))
    assert d.from_agent and d.remaining == 9
    with pytest.raises(AgentError, match="agent refused the check"):
        pol.result(p.ErrorBody(p.ErrorCode.UNKNOWN_RULE, "no rule r"), None, (("k", "r", 1),))
    overloaded = pol.result(p.ErrorBody(p.ErrorCode.OVERLOADED, "busy"), None, (("k", "r", 1),))
    late = pol.result(TIMEOUT, FailPolicy.OPEN, (("k", "r", 1),))
    assert (overloaded.origin, overloaded.degraded, overloaded.retry_after_ms) == (
        Origin.FAIL_CLOSED, Degraded.UNAVAILABLE, 2000,
    )
    assert (late.origin, late.degraded, late.allowed) == (Origin.FAIL_OPEN, Degraded.TIMEOUT, True)
    s = pol.snapshot()
    assert (s.unavailable, s.timeouts) == (1, 1)
    assert c.health(False).fail_policy_answers == 2


def test_the_fallback_limit_refills_with_the_clock_it_is_given() -> None:
    clock = Clock()
    c = core(ClientConfig(fallback_limit=LocalLimit(2, 1.0)), clock)
    item = (("user:1", "r", 1),)
    first, second, third = (c.policy.degraded(None, Degraded.UNAVAILABLE, item) for _ in range(3))
    assert [d.allowed for d in (first, second, third)] == [True, True, False]
    assert third.origin is Origin.LOCAL_LIMIT and third.retry_after_ms == 500
    assert third.reset_at_ms == int(clock.wall() * 1000) + 500
    clock.now += 0.5  # one token back at 2 per second
    assert c.policy.degraded(None, Degraded.UNAVAILABLE, item).allowed
    assert not c.policy.degraded(None, Degraded.UNAVAILABLE, item).allowed
    # A peek takes nothing from it: the policy (open) answers.
    peek = c.policy.degraded(None, Degraded.UNAVAILABLE, (Item("user:1", "r", 0, ItemMode.PEEK),))
    assert peek.origin is Origin.FAIL_OPEN
    assert c.policy.snapshot().local_denied == 2


# --- the connection's life ------------------------------------------------------------------------


def test_health_follows_attempts_and_connections(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    looked = iter(["/run/a.sock", "/run/b.sock", "/run/c.sock"])
    c = Core(None, ClientConfig(), lookup=lambda: next(looked), clock=clock.mono, wall=clock.wall)
    assert c.path == "/run/a.sock"
    path = c.next_address()
    c.failed(path, FileNotFoundError(errno.ENOENT, "No such file or directory"))
    clock.now += 1.0
    c.failed(c.next_address(), HandshakeError("agent refused Hello: 3: too old"))
    h = c.health(False)
    assert (h.path, h.last_error, h.failed_attempts) == ("/run/c.sock", "agent refused Hello: 3: too old", 2)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "floodgate: cannot reach the agent at /run/b.sock: No such file or directory; answering by fail policy open"
    ]  # the second within 10 s is counted, not logged
    c.connected("/run/c.sock")
    h = c.health(True)
    assert (h.connected, h.last_error, h.failed_attempts, c.policy.snapshot().connects) == (True, None, 0, 1)
    c.lost("the agent closed the connection")
    assert c.health(False).last_error == "the agent closed the connection"


def test_a_renewed_core_keeps_only_the_fail_mode_list() -> None:
    c = core()
    listed = p.FailModeList(3, False, [])
    c.policy.learn(listed)
    c.pending[1] = object()
    c.connected(PATH)
    fresh = c.renewed()
    assert fresh.policy.fail_modes is listed and not fresh.pending
    assert fresh.policy.snapshot().connects == 0 and fresh.next_id() == 1


def test_backoff_doubles_to_its_cap_and_starts_again_after_a_connection_that_lasted() -> None:
    cfg = ClientConfig(reconnect_min=0.01, reconnect_max=0.05)
    b = Backoff(cfg, uniform=lambda lo, hi: hi)
    assert [b.next_delay() for _ in range(5)] == pytest.approx([0.01, 0.02, 0.04, 0.05, 0.05])
    b.lasted(LASTED - 0.001)  # dropped at once: an agent that drops every connection is not hammered
    assert b.next_delay() == pytest.approx(0.05)
    b.lasted(LASTED)
    assert b.next_delay() == pytest.approx(0.01)
    jittered = Backoff(cfg, uniform=lambda lo, hi: lo)
    assert jittered.next_delay() == pytest.approx(0.005)
