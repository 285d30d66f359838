"""Malformed answers never crash either client: a fake agent in this test sends garbage, oversize
frames, unknown kinds, bad verdicts, unreadable text, unknown error codes, answers to nobody, a
refused handshake, and valid answers one byte at a time. Each call still returns a decision (by the
fail policy where the answer is unusable), within its timeout, and the client recovers: it
reconnects after a broken stream, or keeps the connection after a frame it could skip."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import time
from typing import Callable, List, Optional, Union

import pytest
from conftest import eventually

from floodgate import AgentError, AsyncClient, Client, Decision, Degraded, Origin
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
    """A Unix-socket server that answers Hello with ``hello`` and each Check with what
    ``respond(connection_number, request_id)`` gives: bytes, a list of chunks sent one by one, or
    None (no answer)."""

    def __init__(self, respond: Callable[[int, int], Reply], hello: Optional[bytes] = None) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="fg-fake-"), "fake.sock")
        self.respond = respond
        self.hello = hello
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
                    del buf[: r.used]
                    f = r.frame
                    if isinstance(f.body, p.Hello):
                        conn.sendall(self.hello if self.hello is not None else p.encode(p.Frame(f.request_id, p.HelloOk(1))))
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

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


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
        p.encode(p.Frame(0, p.HelloOk(3))),
        p.encode(p.Frame(0, p.ErrorBody(p.ErrorCode.UNSUPPORTED_VERSION, "no"))),
        p.encode(p.Frame(0, p.Pong())),
        b"\x00\x00\x00\x01x",
    ],
    ids=["version 3", "error", "pong", "garbage"],
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
