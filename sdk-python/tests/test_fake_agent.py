"""Malformed answers never crash either client: a fake agent in this test sends garbage, oversize
frames, unknown kinds, bad verdicts, unreadable text, unknown error codes, answers to nobody, a
refused handshake, and valid answers one byte at a time. Each call still returns a decision (by the
fail policy where the answer is unusable), within its timeout, and the client recovers: it
reconnects after a broken stream, or keeps the connection after a frame it could skip. Version 2:
an agent that answers HelloOk 1 is never asked for the fail-mode list, a refreshed list replaces the
old one whole and is kept once the agent is gone, and a truncated list is used and warned about once;
peek and charge go out as forms 2 and 3 to a version-2 agent only (a version-1 agent's client raises
instead of sending them), and answer by the fail policy like any check when the agent cannot.
Version 5: every check call's ``traceparent`` goes out as form 4 with its ids to a version-5 agent
only (never to an older one, nor after a reconnection to one), a check without one or with one that
does not parse as before."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import threading
import time
from typing import Any, Callable, List, Optional, Union

import pytest
from conftest import eventually

from floodgate import (
    AgentError,
    AsyncClient,
    Client,
    Decision,
    Degraded,
    InvalidCheck,
    Lease,
    Origin,
    UnsupportedByAgent,
)
from floodgate import fail_modes as fm
from floodgate import protocol as p

OK = p.Verdict(True, False, p.Source.LOCAL, 10, 9, 1_700_000_000_000, 0)
# Scheduling slack on a loaded 2-core machine (see test_async_client).
MARGIN = 0.25

Reply = Union[bytes, List[bytes], None]


def decision(rid: int) -> bytes:
    return p.encode(p.Frame(rid, p.DecisionBody(OK, [p.ItemDecision("r", OK)])))


def raw(kind: int, rid: int, body: bytes, version: int = 1, length: int = -1) -> bytes:
    n = 6 + len(body) if length < 0 else length
    return n.to_bytes(4, "big") + bytes((version, kind)) + rid.to_bytes(4, "big") + body


class FakeAgent:
    """A Unix-socket server that answers Hello with ``hello`` (or ``hello(connection_number)``) and
    each Check with what
    ``respond(connection_number, request_id)`` gives: bytes, a list of chunks sent one by one, or
    None (no answer); the n-th FailModes (from 1, over all connections) with what
    ``fail_modes(n, request_id)`` gives. ``kinds`` lists the kind of every frame received, in order;
    ``checks`` the bytes of every Check frame (:meth:`wait_checks` waits for them)."""

    def __init__(
        self,
        respond: Callable[[int, int], Reply],
        hello: Union[bytes, Callable[[int], bytes], None] = None,
        fail_modes: Optional[Callable[[int, int], Optional[bytes]]] = None,
    ) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="fg-fake-"), "fake.sock")
        self.respond = respond
        self.hello = hello
        self.fail_modes = fail_modes
        self.asks = 0
        self.kinds: List[int] = []
        self.checks: List[bytes] = []
        # Notified on every Check frame received.
        self.received = threading.Condition()
        self.connections = 0
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(self.path)
        self.server.listen(16)
        self.closed = False
        self.socks: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            self.socks.append(conn)
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn: socket.socket, n: int) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
                while True:
                    r = p.decode(buf)
                    if not isinstance(r, p.Decoded):
                        break
                    if isinstance(r.frame.body, p.Check):
                        with self.received:
                            self.checks.append(bytes(buf[: r.used]))
                            self.received.notify_all()
                    del buf[: r.used]
                    f = r.frame
                    self.kinds.append(buf_kind(f.body))
                    if isinstance(f.body, p.FailModes):
                        self.asks += 1
                        answer = self.fail_modes(self.asks, f.request_id) if self.fail_modes else None
                        if answer:
                            conn.sendall(answer)
                    elif isinstance(f.body, p.Hello):
                        hello = self.hello(n) if callable(self.hello) else self.hello
                        conn.sendall(hello if hello is not None else p.encode(p.Frame(f.request_id, p.HelloOk(1))))
                    elif isinstance(f.body, p.Check):
                        out = self.respond(n, f.request_id)
                        if isinstance(out, list):
                            for piece in out:
                                conn.sendall(piece)
                                time.sleep(0.001)
                        elif out:
                            conn.sendall(out)
        except OSError:
            return

    def wait_checks(self, n: int, timeout: float = 10.0) -> List[bytes]:
        """The Check frames received once there are at least ``n``; fails after ``timeout``."""
        with self.received:
            if not self.received.wait_for(lambda: len(self.checks) >= n, timeout):
                raise AssertionError(f"the fake agent received {len(self.checks)} checks in {timeout} s, not {n}")
            return list(self.checks)

    def close(self) -> None:
        self.closed = True
        # shutdown, not only close: a thread blocked in accept or recv keeps a closed socket open
        # (a closed listener would still accept a reconnecting client).
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass


def buf_kind(body: object) -> int:
    """The kind byte of a decoded frame's body."""
    return {
        p.Hello: p.Kind.HELLO,
        p.Check: p.Kind.CHECK,
        p.Ping: p.Kind.PING,
        p.FailModes: p.Kind.FAIL_MODES,
    }.get(type(body), 0)


# What the fake sends on its first connection for the first check; on later checks and connections
# it answers properly. `fatal`: the stream cannot be trusted, the client must reconnect.
SCENARIOS = {
    "garbage": (lambda rid: b"\x00\x00\x00\x02garbage!", True),
    "oversize length prefix": (lambda rid: b"\x7f\xff\xff\xff" + b"\x01\x04" + rid.to_bytes(4, "big"), True),
    "unknown kind": (lambda rid: raw(0x42, rid, b"\x00\x01"), True),
    "unknown verdict source": (lambda rid: raw(0x04, rid, b"\x01\x09" + bytes(32) + b"\x00"), True),
    "unknown verdict flags": (lambda rid: raw(0x04, rid, b"\x81\x00" + bytes(32) + b"\x00"), True),
    "truncated decision": (lambda rid: raw(0x04, rid, b"\x01\x00" + bytes(20)), True),
    "trailing bytes": (lambda rid: raw(0x04, rid, decision(rid)[10:] + b"\xff"), True),
    "17 items": (lambda rid: raw(0x04, rid, decision(rid)[10:44] + b"\x11" + (b"\x01r" + decision(rid)[10:44]) * 17), True),
    "a Check frame from the agent": (lambda rid: p.encode(p.Frame(rid, p.Check(items=[p.Item("k", "r", 1)]))), True),
    "rule id not UTF-8": (lambda rid: raw(0x04, rid, decision(rid)[10:44] + b"\x01\x02\xff\xfe" + decision(rid)[10:44]), False),
    "another version": (lambda rid: raw(0x04, rid, decision(rid)[10:], version=9), False),
    "unknown error code": (lambda rid: p.encode(p.Frame(rid, p.ErrorBody(999, "from the future"))), False),
    "overloaded": (lambda rid: p.encode(p.Frame(rid, p.ErrorBody(p.ErrorCode.OVERLOADED, "busy"))), False),
    "internal error": (lambda rid: p.encode(p.Frame(rid, p.ErrorBody(p.ErrorCode.INTERNAL, "oops"))), False),
}


def first_bad(make: Callable[[int], bytes]) -> Callable[[int, int], Reply]:
    state = {"bad": False}

    def respond(conn: int, rid: int) -> Reply:
        if conn == 1 and not state["bad"]:
            state["bad"] = True
            return make(rid)
        return decision(rid)

    return respond


class Either:
    """The same calls on either client, timed. The asyncio client runs on an event loop in a thread
    of its own, so that it reconnects in the background while the test polls."""

    def __init__(self, kind: str, path: Optional[str], **config: object) -> None:
        self.kind = kind
        if kind == "sync":
            self.sync = Client(path, **config)  # type: ignore[arg-type]
        else:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.aio = self._run(AsyncClient.connect(path, **config))  # type: ignore[arg-type]

    def _run(self, coro):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def allow(self, key: str = "k", rule: str = "r", **kw: object) -> Decision:
        if self.kind == "sync":
            return self.sync.allow(key, rule, **kw)  # type: ignore[arg-type]
        return self._run(self.aio.allow(key, rule, **kw))  # type: ignore[arg-type]

    def attributes(self, **kw: object) -> Decision:
        if self.kind == "sync":
            return self.sync.check_attributes(**kw)  # type: ignore[arg-type]
        return self._run(self.aio.check_attributes(**kw))  # type: ignore[arg-type]

    def call(self, method: str, *args: object, **kw: object) -> Decision:
        """Any call by its name: ``peek``, ``charge``, ``check``..."""
        if self.kind == "sync":
            return getattr(self.sync, method)(*args, **kw)
        return self._run(getattr(self.aio, method)(*args, **kw))

    def timed(self, **kw: object) -> "tuple[Decision, float]":
        t = time.monotonic()
        d = self.allow(**kw)
        return d, time.monotonic() - t

    def stats(self):  # noqa: ANN201
        return self.sync.stats() if self.kind == "sync" else self.aio.stats()

    def connected(self) -> bool:
        return self.sync.is_connected() if self.kind == "sync" else self.aio.is_connected()

    def health(self):  # noqa: ANN201
        return self.sync.health() if self.kind == "sync" else self.aio.health()

    def close(self) -> None:
        if self.kind == "sync":
            self.sync.close()
        else:
            self._run(self.aio.close())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


@pytest.fixture(params=["async", "sync"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_malformed_answers_never_crash_the_client(kind: str, scenario: str) -> None:
    make, fatal = SCENARIOS[scenario]
    fake = FakeAgent(first_bad(make))
    timeout = 1.0
    c = Either(kind, fake.path, timeout=timeout, reconnect_min=0.005)
    try:
        # The first check gets the bad answer: a decision all the same, by the policy (open), and
        # at once: the bad frame itself ends the wait, not the 1 s timeout.
        d, took = c.timed()
        assert d.allowed and d.origin is Origin.FAIL_OPEN and took < timeout / 2, (d, took)
        s = c.stats()
        if fatal:
            # The stream broke: reconnected, the next answers come from the fake on a new connection.
            assert s.unavailable == 1 and s.timeouts == 0, s
            eventually("the client reconnects", lambda: c.connected() and fake.connections >= 2)
            d = c.allow()
            assert d.from_agent and (d.limit, d.remaining) == (10, 9)
            assert fake.connections == 2 and c.stats().connects == 2
        else:
            # A frame it could skip: that call answered by the policy at once, the connection kept.
            assert s.unavailable == 1 and s.timeouts == 0, s
            d = c.allow()
            assert d.from_agent and d.remaining == 9
            assert fake.connections == 1 and c.stats().connects == 1
    finally:
        c.close()
        fake.close()


def test_a_bad_answer_is_answered_by_policy_fast_and_closed_when_asked(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: raw(0x42, rid, b""))
    c = Either(kind, fake.path, timeout=2.0)
    try:
        d, took = c.timed(fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and d.degraded is Degraded.UNAVAILABLE
        assert took < 1.0, "the broken stream answered the call, not its 2 s timeout"
    finally:
        c.close()
        fake.close()


def test_answers_for_nobody_and_pongs_are_ignored_and_late_answers_dropped(kind: str) -> None:
    seen = {"n": 0}

    def respond(conn: int, rid: int) -> Reply:
        seen["n"] += 1
        if seen["n"] == 1:
            # Not this call's id, an unsolicited Pong and HelloOk: ignored; this call times out.
            return decision(rid + 1000) + p.encode(p.Frame(0, p.Pong())) + p.encode(p.Frame(0, p.HelloOk(1)))
        if seen["n"] == 2:
            # Late: the answer to the first call arrives with the second's (the second is answered).
            return decision(rid - 1) + decision(rid)
        return decision(rid)

    fake = FakeAgent(respond)
    c = Either(kind, fake.path, timeout=0.1)
    try:
        d, took = c.timed()
        assert d.degraded is Degraded.TIMEOUT and 0.099 <= took < 0.1 + MARGIN
        d = c.allow()
        assert d.from_agent
        assert c.stats().connects == 1 and fake.connections == 1
    finally:
        c.close()
        fake.close()


def test_an_answer_arriving_one_byte_at_a_time_is_assembled(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: [bytes((b,)) for b in decision(rid)])
    c = Either(kind, fake.path, timeout=5.0)
    try:
        d = c.allow()
        assert d.from_agent and (d.limit, d.remaining, d.reset_at_ms) == (10, 9, 1_700_000_000_000)
    finally:
        c.close()
        fake.close()


def test_the_agents_refusals_raise_only_for_the_callers_mistakes(kind: str) -> None:
    codes = iter([4, 5])
    fake = FakeAgent(lambda conn, rid: p.encode(p.Frame(rid, p.ErrorBody(next(codes), "refused"))))
    c = Either(kind, fake.path, timeout=2.0)
    try:
        for code in (4, 5):
            with pytest.raises(AgentError) as e:
                c.allow()
            assert e.value.code == code and e.value.message == "refused"
    finally:
        c.close()
        fake.close()


@pytest.mark.parametrize(
    "hello",
    [
        p.encode(p.Frame(0, p.HelloOk(p.VERSION + 1))),
        p.encode(p.Frame(0, p.ErrorBody(p.ErrorCode.UNSUPPORTED_VERSION, "no"))),
        p.encode(p.Frame(0, p.Pong())),
        b"\x00\x00\x00\x01x",
    ],
    ids=["a newer version", "error", "pong", "garbage"],
)
def test_a_refused_handshake_leaves_the_client_answering_by_policy(kind: str, hello: bytes) -> None:
    fake = FakeAgent(lambda conn, rid: decision(rid), hello=hello)
    c = Either(kind, fake.path, timeout=2.0, reconnect_min=0.005, reconnect_max=0.05)
    try:
        # It keeps trying (with backoff), never counting a connection.
        eventually("the client retries the handshake", lambda: fake.connections >= 3)
        d, took = c.timed()
        assert d.allowed and d.degraded is Degraded.UNAVAILABLE and took < 1.0
        assert c.stats().connects == 0 and not c.connected()
    finally:
        c.close()
        fake.close()


# --- version 2: the fail-mode list --------------------------------------------------------------------

HELLO_OK_2 = p.encode(p.Frame(0, p.HelloOk(2)))


def listing(rid: int, version: int, *rules: p.ClosedRule, truncated: bool = False) -> bytes:
    return p.encode(p.Frame(rid, p.FailModeList(version, truncated, list(rules))))


def closed(rule_id: str, limit: int, endpoint: str = "") -> p.ClosedRule:
    return p.ClosedRule(rule_id, p.ListedDimension.IP, endpoint, "", limit)


@pytest.fixture
def quick_refresh(monkeypatch: pytest.MonkeyPatch) -> float:
    """Asks for the list every 20 ms instead of every 10 s, so that a test sees several refreshes."""
    monkeypatch.setattr(fm, "REFRESH_EVERY", 0.02)
    return 0.02


def test_an_agent_answering_hello_ok_1_is_never_asked_for_fail_modes(kind: str, quick_refresh: float) -> None:
    v1 = FakeAgent(lambda conn, rid: decision(rid))
    v2 = FakeAgent(lambda conn, rid: decision(rid), hello=HELLO_OK_2,
                   fail_modes=lambda n, rid: listing(rid, 1, closed("r", 5)))
    old = Either(kind, v1.path, timeout=2.0)
    new = None
    try:
        assert old.allow().from_agent
        # A client of a version-2 agent, connected after the first, asks again and again meanwhile.
        new = Either(kind, v2.path, timeout=2.0)
        assert new.allow().from_agent
        eventually("the version-2 agent is asked three times", lambda: v2.asks >= 3)
        assert v2.kinds[:2] == [p.Kind.HELLO, p.Kind.FAIL_MODES], "asked right after its HelloOk"
        assert old.allow().from_agent
        assert p.Kind.FAIL_MODES not in v1.kinds and v1.kinds[0] == p.Kind.HELLO, v1.kinds
        h = old.health()
        assert (h.fail_closed_rules, h.rules_version) == (0, None)
        assert new.health().rules_version == 1
        # With no list, the agent gone, the client's fail policy decides.
        v1.close()
        eventually("the client sees the agent gone", lambda: not old.connected())
        d = old.allow()
        assert d.allowed and d.origin is Origin.FAIL_OPEN
    finally:
        old.close()
        if new is not None:
            new.close()
        v1.close()
        v2.close()


def test_a_refreshed_list_replaces_the_old_and_outlives_the_agent(kind: str, quick_refresh: float) -> None:
    def lists(n: int, rid: int) -> bytes:
        if n == 1:
            return listing(rid, 1, closed("a", 3), closed("b", 4))
        return listing(rid, 2, closed("b", 7, endpoint="/b"), closed("c", 9, endpoint="/login"))

    fake = FakeAgent(lambda conn, rid: decision(rid), hello=HELLO_OK_2, fail_modes=lists)
    c = Either(kind, fake.path, timeout=2.0, closed_retry_after=2.5)
    try:
        assert c.allow().from_agent
        eventually("the refreshed list is learnt", lambda: c.health().rules_version == 2)
        assert c.health().fail_closed_rules == 2
        fake.close()
        eventually("the client sees the agent gone", lambda: not c.connected())
        h = c.health()
        assert (h.fail_closed_rules, h.rules_version) == (2, 2), "the last list is kept"
        # "a" was only in the first list: the client's policy (open) decides.
        d = c.allow("k", "a")
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.items == []
        # "b" is listed (its limit from the new list): denied as PROTOCOL.md says.
        t0 = int(time.time() * 1000)
        d = c.allow("k", "b")
        t1 = int(time.time() * 1000)
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and d.degraded is Degraded.UNAVAILABLE
        assert (d.limit, d.remaining, d.retry_after_ms, d.source) == (7, 0, 2_500, None)
        assert t0 + 2_500 <= d.reset_at_ms <= t1 + 2_500
        [item] = d.items
        assert item.rule_id == "b"
        assert item.verdict == p.Verdict(False, False, p.Source.FALLBACK, 7, 0, d.reset_at_ms, 2_500)
        # An attribute check the listed rule "c" (ip, /login) would match; not another endpoint.
        d = c.attributes(endpoint="/login", ip="203.0.113.5")
        assert not d.allowed and d.limit == 9 and d.items[0].rule_id == "c"
        assert c.attributes(endpoint="/search", ip="203.0.113.5").allowed
        # A per-call policy decides alone, either way.
        assert c.allow("k", "b", fail="open").allowed
        d = c.allow("k", "a", fail="closed")
        assert not d.allowed and d.limit == 0 and d.items == []
        assert c.stats().rule_denied == 2
    finally:
        c.close()
        fake.close()


def test_a_listed_check_the_agent_is_late_for_is_denied(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: None, hello=HELLO_OK_2,
                     fail_modes=lambda n, rid: listing(rid, 5, closed("b", 4)))
    c = Either(kind, fake.path, timeout=0.05)
    try:
        eventually("the list is learnt", lambda: c.health().rules_version == 5)
        d = c.allow("k", "b")
        assert not d.allowed and d.degraded is Degraded.TIMEOUT and d.limit == 4
        assert c.allow("k", "other").allowed
    finally:
        c.close()
        fake.close()


def test_a_truncated_list_is_used_and_warned_about_once(
    kind: str, quick_refresh: float, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeAgent(lambda conn, rid: decision(rid), hello=HELLO_OK_2,
                     fail_modes=lambda n, rid: listing(rid, 3, closed("b", 4), truncated=True))
    caplog.set_level(logging.WARNING, logger="floodgate")
    c = Either(kind, fake.path, timeout=2.0)
    try:
        eventually("three lists were sent", lambda: fake.asks >= 3)
        # Answers come in order on the connection: once this one is back, the lists before it are read.
        assert c.allow().from_agent
        warned = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "the 1 rules listed deny" in warned[0]
        fake.close()
        eventually("the client sees the agent gone", lambda: not c.connected())
        d = c.allow("k", "b")
        assert not d.allowed and d.limit == 4
        assert c.allow("k", "past-the-prefix").allowed, "rules past the list answer by the policy"
    finally:
        c.close()
        fake.close()


# --- version 2: item modes ----------------------------------------------------------------------------

# A call, and the check it must put on the wire.
MODE_CALLS = [
    (("peek", "user:1", "tokens"), {}, p.Check(items=[p.Item.peek("user:1", "tokens", 0)])),
    (("peek", "user:1", "tokens", 7), {}, p.Check(items=[p.Item.peek("user:1", "tokens", 7)])),
    (("charge", "user:1", "llm", 1500), {}, p.Check(items=[p.Item.charge("user:1", "llm", 1500)])),
    (
        ("check", [("user:1", "api", 1), ("user:1", "llm", 2, "charge")]),
        {},
        p.Check(items=[p.Item("user:1", "api", 1), p.Item.charge("user:1", "llm", 2)]),
    ),
    (
        ("check_attributes",),
        {"endpoint": "/v1/chat", "api_key": "abc", "cost": 900, "mode": p.ItemMode.CHARGE},
        p.Check(attributes=p.Attributes(endpoint="/v1/chat", api_key="abc", cost=900, mode=p.ItemMode.CHARGE)),
    ),
]


def test_peek_and_charge_go_out_as_forms_2_and_3(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: decision(rid), hello=HELLO_OK_2)
    c = Either(kind, fake.path, timeout=2.0)
    try:
        for (method, *args), kw, want in MODE_CALLS:
            d = c.call(method, *args, **kw)
            assert d.from_agent and d.remaining == 9, (method, d)
            sent = fake.checks[-1]
            # The bytes this SDK's encoder makes for that check, under the id the client chose...
            rid = int.from_bytes(sent[6:10], "big")
            assert sent == p.encode(p.Frame(rid, want)), (method, sent.hex(" "))
            # ...which are form 2 (items with modes) or 3 (attributes with a mode), version byte 1.
            assert sent[4:6] == b"\x01\x03" and sent[10] == (2 if want.items else 3), sent.hex(" ")
            assert p.decode(sent) == p.Decoded(p.Frame(rid, want), len(sent))
        # A check whose items all consume is still version 1's form 0.
        assert c.allow("user:1", "api").from_agent and fake.checks[-1][10] == 0
        assert c.call("check", [("user:1", "api", 1, "consume")]).from_agent and fake.checks[-1][10] == 0
        assert fake.connections == 1 and c.stats().unavailable == 0
    finally:
        c.close()
        fake.close()


def test_a_version_1_agent_is_never_sent_a_peek_or_charge(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: decision(rid))  # answers HelloOk 1
    c = Either(kind, fake.path, timeout=2.0)
    try:
        assert c.allow().from_agent
        for (method, *args), kw, _ in MODE_CALLS:
            # Raised whatever the call's fail policy: no policy can make the agent read the check.
            for fail in (None, "open", "closed"):
                with pytest.raises(UnsupportedByAgent) as e:
                    c.call(method, *args, fail=fail, **kw)
                assert isinstance(e.value, InvalidCheck)
                assert (e.value.needed, e.value.agent_version) == (2, 1)
                assert "speaks version 1" in str(e.value) and fake.path in str(e.value), str(e.value)
        assert len(fake.checks) == 1, "nothing but the first allow was sent"
        # The connection is kept, and consuming checks go on as before.
        assert c.allow().from_agent and c.call("check", [("k", "r", 2, 0)]).from_agent
        assert fake.connections == 1 and c.stats().connects == 1
        # Once the agent is gone, they answer by the fail policy as any check does.
        fake.close()
        eventually("the client sees the agent gone", lambda: not c.connected())
        d = c.call("peek", "k", "r")
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.UNAVAILABLE
        d = c.call("charge", "k", "r", 5, fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED
    finally:
        c.close()
        fake.close()


def test_peek_and_charge_answer_by_policy_when_the_agent_cannot(kind: str) -> None:
    # A version-2 agent that never answers a check, and lists "b" as failing closed.
    fake = FakeAgent(lambda conn, rid: None, hello=HELLO_OK_2,
                     fail_modes=lambda n, rid: listing(rid, 5, closed("b", 4)))
    c = Either(kind, fake.path, timeout=0.05)
    try:
        eventually("the list is learnt", lambda: c.health().rules_version == 5)
        # 1. A per-call policy decides alone.
        assert c.call("peek", "k", "b", fail="open").allowed
        d = c.call("charge", "k", "other", 3, fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and d.degraded is Degraded.TIMEOUT
        # 2. Else a listed fail-closed rule denies, whatever the item's mode.
        for method, args in (("peek", ("k", "b")), ("charge", ("k", "b", 3))):
            d = c.call(method, *args)
            assert not d.allowed and d.limit == 4 and d.items[0].rule_id == "b", (method, d)
        # 3. Else the client's policy (open).
        d = c.call("charge", "k", "other", 3)
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.TIMEOUT
        assert all(check[10] == 2 for check in fake.checks), "each was sent, as form 2"
    finally:
        c.close()
        fake.close()


# --- version 5: trace context -------------------------------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE = p.TraceContext(bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736"), bytes.fromhex("00f067aa0ba902b7"), 1)
# What the callers' headers may carry instead: none of them is a context, none fails a check.
NOT_TRACEPARENTS = [
    "",
    "garbage",
    TRACEPARENT.upper(),
    "ff" + TRACEPARENT[2:],
    TRACEPARENT + "-more",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
]


def hello_ok(version: int) -> bytes:
    return p.encode(p.Frame(0, p.HelloOk(version)))


def holding(rid: int) -> bytes:
    """Allowed, and the concurrency rule "slots" holds the check's lease (if it had one)."""
    v = p.Verdict(True, False, p.Source.LOCAL, 2, 1, 1_700_000_000_000, 0, holds_lease=True)
    return p.encode(p.Frame(rid, p.DecisionBody(v, [p.ItemDecision("slots", v)])))


def hold(c: Either, *args: Any, **kw: Any) -> Decision:
    """``hold``'s block, empty, on either client: an acquire, then its release."""
    if c.kind == "sync":
        with c.sync.hold(*args, **kw) as d:
            return d

    async def block() -> Decision:
        async with c.aio.hold(*args, **kw) as d:
            return d

    return c._run(block())


# Every check call: its name, its arguments, the least version it needs, how many checks it sends,
# and whether they carry a fresh lease (random: compared without their last 8 bytes).
TRACED_CALLS = [
    ("allow", ("user:1", "slots"), {}, 1, 1, False),
    ("check", ([("user:1", "slots", 1), ("user:1", "api", 2)],), {}, 1, 1, False),
    ("check_attributes", (), {"endpoint": "/v1/chat", "user": "u", "cost": 3}, 1, 1, False),
    ("check_request", (p.Attributes(endpoint="/v1/chat", api_key="abc"),), {}, 1, 1, False),
    ("peek", ("user:1", "slots"), {}, 2, 1, False),
    ("charge", ("user:1", "llm", 1500), {}, 2, 1, False),
    ("check", ([("user:1", "tokens", 0, "peek"), ("user:1", "llm", 9, "charge")],), {}, 2, 1, False),
    ("check_attributes", (), {"endpoint": "/v1/chat", "cost": 900, "mode": "charge"}, 2, 1, False),
    ("acquire", ("apikey:abc", "slots", 2), {}, 3, 1, True),
    ("release", (Lease("apikey:abc", "slots", 2, 42),), {}, 3, 1, False),
    ("hold", ("apikey:abc", "slots"), {}, 3, 2, True),
    ("check_request", (p.Attributes(endpoint="/v1/chat", user="u", cost=0, mode=p.ItemMode.PEEK, lease=7),), {}, 3, 1,
     False),
    ("check_attributes", (), {"endpoint": "/v1/chat", "user": "u", "mode": "release", "lease": 7}, 3, 1, False),
]


def sent_by(c: Either, fake: FakeAgent, method: str, args: Any, kw: Any, count: int) -> List[bytes]:
    """The Check frames one call puts on the wire (answered by the agent)."""
    before = len(fake.checks)
    d = hold(c, *args, **kw) if method == "hold" else c.call(method, *args, **kw)
    d = d[0] if isinstance(d, tuple) else d  # acquire: (decision, lease)
    assert d.from_agent and d.allowed, (method, d)
    return fake.wait_checks(before + count)[before:]


def test_a_version_5_agent_is_sent_each_calls_trace_context(kind: str) -> None:
    fake = FakeAgent(lambda conn, rid: holding(rid), hello=hello_ok(5))
    c = Either(kind, fake.path, timeout=2.0)
    try:
        for method, args, kw, _, count, leased in TRACED_CALLS:
            traced = sent_by(c, fake, method, args, {**kw, "traceparent": TRACEPARENT}, count)
            plain = sent_by(c, fake, method, args, kw, count)
            for t, q in zip(traced, plain):
                # Form 4 with the header's ids and flags, around the very check sent without it.
                assert t[10:36] == b"\x04" + TRACE.trace_id + TRACE.span_id + b"\x01", (method, t.hex(" "))
                assert q[10] in (0, 1, 2, 3), (method, q.hex(" "))
                assert int.from_bytes(t[:4], "big") == int.from_bytes(q[:4], "big") + 26 and t[4:6] == q[4:6] == b"\x01\x03"
                end = -8 if leased else None
                assert t[36:end] == q[10:end], (method, t.hex(" "), q.hex(" "))
                decoded = p.decode(t)
                assert isinstance(decoded, p.Decoded) and decoded.frame.body.trace == TRACE, (method, decoded)
                assert p.decode(q).frame.body.trace is None  # type: ignore[union-attr]
        # A header that does not parse is no error: the check goes out as if there were none.
        for bad in NOT_TRACEPARENTS:
            [q] = sent_by(c, fake, "allow", ("user:1", "slots"), {"traceparent": bad}, 1)
            assert q[10] == 0 and p.decode(q).frame.body == p.Check(items=[p.Item("user:1", "slots", 1)]), bad  # type: ignore[union-attr]
        # Surrounding white space is no part of it (a header value may carry some).
        [t] = sent_by(c, fake, "allow", ("user:1", "slots"), {"traceparent": f" {TRACEPARENT}\t"}, 1)
        assert p.decode(t).frame.body.trace == TRACE  # type: ignore[union-attr]
        assert fake.connections == 1 and c.stats().connects == 1 and c.stats().unavailable == 0
    finally:
        c.close()
        fake.close()


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_an_agent_older_than_version_5_is_never_sent_a_trace_context(kind: str, version: int) -> None:
    fake = FakeAgent(lambda conn, rid: holding(rid), hello=hello_ok(version))
    c = Either(kind, fake.path, timeout=2.0)
    try:
        for method, args, kw, need, count, leased in TRACED_CALLS:
            if need > version:
                continue
            traced = sent_by(c, fake, method, args, {**kw, "traceparent": TRACEPARENT}, count)
            plain = sent_by(c, fake, method, args, kw, count)
            for t, q in zip(traced, plain):
                # The same check as without the header, the same length: no form 4.
                assert t[10] != 4 and len(t) == len(q), (method, t.hex(" "))
                end = -8 if leased else None
                assert t[:6] == q[:6] and t[10:end] == q[10:end], (method, t.hex(" "), q.hex(" "))
                assert p.decode(t).frame.body.trace is None  # type: ignore[union-attr]
        assert all(check[10] != 4 for check in fake.checks)
        # Nothing made the agent drop the connection.
        assert fake.connections == 1 and c.stats().connects == 1 and c.stats().unavailable == 0
    finally:
        c.close()
        fake.close()


def test_a_client_reconnected_to_an_older_agent_sends_no_trace_context(kind: str) -> None:
    # The first connection's agent speaks 5, the next one's (an agent rolled back) 4: the version is
    # that of the connection the check goes to, not of the one before.
    fake = FakeAgent(lambda conn, rid: decision(rid), hello=lambda n: hello_ok(5 if n == 1 else 4))
    c = Either(kind, fake.path, timeout=2.0, reconnect_min=0.005)
    try:
        assert c.allow(traceparent=TRACEPARENT).from_agent and fake.checks[-1][10] == 4
        fake.socks[0].shutdown(socket.SHUT_RDWR)
        eventually("the client reconnects", lambda: fake.connections == 2 and c.connected())
        assert c.allow(traceparent=TRACEPARENT).from_agent
        assert fake.checks[-1][10] == 0 and len(fake.checks) == 2, [ch.hex(" ") for ch in fake.checks]
    finally:
        c.close()
        fake.close()


def test_the_precautionary_release_carries_the_trace_context(kind: str) -> None:
    # A version-5 agent that never answers: the acquire times out, and its release goes at once,
    # with the acquire's trace context.
    fake = FakeAgent(lambda conn, rid: None, hello=hello_ok(5))
    c = Either(kind, fake.path, timeout=0.05)
    try:
        d, lease = c.call("acquire", "apikey:abc", "slots", traceparent=TRACEPARENT)
        assert d.degraded is Degraded.TIMEOUT and lease is None
        acquire, release = fake.wait_checks(2)
        for sent, mode in ((acquire, p.ItemMode.CONSUME), (release, p.ItemMode.RELEASE)):
            body = p.decode(sent).frame.body  # type: ignore[union-attr]
            assert body.trace == TRACE and body.items[0].mode == mode, body
        assert acquire[-8:] == release[-8:], "the same lease"
    finally:
        c.close()
        fake.close()
