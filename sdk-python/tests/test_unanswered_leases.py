"""A check carrying a lease whose answer is not the agent's (the call timed out; or, ASGI and
``AsyncClient.acquire``, it was cancelled while it waited) may have been taken by the agent all the
same: the SDK sends its release at once (the same attributes or item, the same lease, cost
``max(cost, 1)``, mode release), without waiting for an answer. Against a fake agent of version 3
that never answers a leased check: ``acquire`` in both clients, the ASGI and the WSGI middleware
(a consuming route and a charge route's peek), each answered by the fail policy, then the release's
bytes as the fake received them; and no release when the agent answered that nothing is held. Every
wait is on the fake's condition, bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
from typing import Any, Iterator, List, Optional

import pytest
from test_fake_agent import FakeAgent
from test_leases import either, fake_decision, hello

from floodgate import AsyncClient, Client, Degraded, Origin
from floodgate import protocol as p
from floodgate.middleware import FloodgateMiddleware, FloodgateWSGIMiddleware

CHARGE = {"/v1/chat": "x-llm-tokens"}
COSTS = {"/items": 3}


def body_of(frame: bytes) -> p.Check:
    decoded = p.decode(frame)
    assert isinstance(decoded, p.Decoded) and decoded.used == len(frame), frame.hex(" ")
    body = decoded.frame.body
    assert isinstance(body, p.Check)
    return body


def rid_of(frame: bytes) -> int:
    return int.from_bytes(frame[6:10], "big")


def mode_of(frame: bytes) -> p.ItemMode:
    body = body_of(frame)
    return body.attributes.mode if body.attributes is not None else body.items[0].mode


@pytest.fixture
def silent_agent() -> Iterator[FakeAgent]:
    """A fake agent of version 3 that never answers a check taking a lease, and answers a release
    (allowed, holding nothing)."""
    fake: Optional[FakeAgent] = None

    def respond(conn: int, rid: int) -> Optional[bytes]:
        assert fake is not None
        if mode_of(fake.checks[-1]) is p.ItemMode.RELEASE:
            return fake_decision(rid, holds=False)
        return None

    fake = FakeAgent(respond, hello=hello(3))
    yield fake
    fake.close()


@pytest.fixture
def holding_nothing() -> Iterator[FakeAgent]:
    """A fake agent of version 3 that answers every check allowed, no rule holding its lease."""
    fake = FakeAgent(lambda conn, rid: fake_decision(rid, holds=False), hello=hello(3))
    yield fake
    fake.close()


def released_attributes(check: bytes, release: bytes) -> p.Attributes:
    """Asserts ``release`` is the release of the attribute check ``check`` (form 3 with a lease):
    its bytes are the check's under another request id, with mode release and cost max(cost, 1)."""
    sent = body_of(check).attributes
    assert sent is not None and sent.lease and sent.mode in (p.ItemMode.CONSUME, p.ItemMode.PEEK), sent
    assert check[10] == p.FORM_ATTRIBUTES_MODE and check[-9] == p.MODE_LEASE | sent.mode, check.hex(" ")
    want = dataclasses.replace(sent, mode=p.ItemMode.RELEASE, cost=max(sent.cost, 1))
    assert release == p.encode(p.Frame(rid_of(release), p.Check(attributes=want))), release.hex(" ")
    assert rid_of(release) != rid_of(check)
    assert release[-9] == p.MODE_LEASE | p.ItemMode.RELEASE and release[-8:] == check[-8:], release.hex(" ")
    got = body_of(release).attributes
    assert got is not None and got.lease == sent.lease and got.cost >= 1
    return sent


# --- acquire --------------------------------------------------------------------------------------


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_an_acquire_the_agent_does_not_answer_is_released(kind: str, silent_agent: FakeAgent) -> None:
    with either(kind, silent_agent.path, timeout=0.05) as c:
        assert c.protocol_version == 3
        d, lease = c.acquire("apikey:abc", "slots", 2)
        assert d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.TIMEOUT and lease is None, d
        check, release = silent_agent.wait_checks(2)[:2]
        [item] = body_of(check).items
        assert item.mode is p.ItemMode.CONSUME and item.lease and check[-9] == p.MODE_LEASE, check.hex(" ")
        want = p.Check(items=[p.Item.release("apikey:abc", "slots", 2, item.lease)])
        assert release == p.encode(p.Frame(rid_of(release), want)), release.hex(" ")
        assert release[-9] == p.MODE_LEASE | p.ItemMode.RELEASE and release[-8:] == check[-8:]
        # Denied by the fail policy: the same.
        d, lease = c.acquire("apikey:abc", "slots", fail="closed")
        assert not d.allowed and d.origin is Origin.FAIL_CLOSED and lease is None
        check, release = silent_agent.wait_checks(4)[2:4]
        assert mode_of(release) is p.ItemMode.RELEASE and release[-8:] == check[-8:] != silent_agent.checks[0][-8:]
        assert body_of(release).items[0].cost == 1


def test_an_acquire_the_agent_answers_holding_nothing_is_not_released(kind: str, holding_nothing: FakeAgent) -> None:
    with either(kind, holding_nothing.path, timeout=2.0) as c:
        d, lease = c.acquire("apikey:abc", "slots")
        assert d.from_agent and not d.holds_lease and lease is None
        # Frames arrive in order: a release would have been sent before the acquire returned.
        assert c.allow("apikey:abc", "r").from_agent
        checks = holding_nothing.wait_checks(2)
        assert len(checks) == 2 and mode_of(checks[1]) is p.ItemMode.CONSUME and checks[1][10] == 0, checks


def test_an_acquire_cancelled_while_it_waits_is_released(silent_agent: FakeAgent) -> None:
    async def main() -> None:
        client = await AsyncClient.connect(silent_agent.path, timeout=30.0)
        loop = asyncio.get_running_loop()
        try:
            task = asyncio.create_task(client.acquire("apikey:abc", "slots"))
            [check] = await loop.run_in_executor(None, silent_agent.wait_checks, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            check, release = (await loop.run_in_executor(None, silent_agent.wait_checks, 2))[:2]
            lease = body_of(check).items[0].lease
            want = p.Check(items=[p.Item.release("apikey:abc", "slots", 1, lease)])
            assert lease and release == p.encode(p.Frame(rid_of(release), want)), release.hex(" ")
        finally:
            await client.close()

    asyncio.run(main())


def test_a_release_that_cannot_be_sent_is_logged_at_debug_only(kind: str, tmp_path, caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.DEBUG, logger="floodgate")
    with either(kind, str(tmp_path / "nobody.sock"), timeout=0.05, connect_timeout=0.05) as c:
        d, lease = c.acquire("k", "slots")
        assert d.origin is Origin.FAIL_OPEN and lease is None
    said = [r for r in caplog.records if "precautionary release" in r.getMessage()]
    assert said and all(r.levelno == logging.DEBUG for r in said), said
    assert "was not sent: no connection to the agent" in said[0].getMessage()
    # (The path is in the unreachable agent's warning: its template is what is read.)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "release" in str(r.msg)]


# --- ASGI -----------------------------------------------------------------------------------------


async def ok_app(scope, receive, send) -> None:  # noqa: ANN001
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-llm-tokens", b"5")]})
    await send({"type": "http.response.body", "body": b"ok"})


def asgi_scope(path: str) -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": [(b"x-user-id", b"u")], "client": ("203.0.113.5", 1)}


async def asgi_request(mw: FloodgateMiddleware, path: str) -> List[dict]:
    sent: List[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await mw(asgi_scope(path), receive, send)
    return sent


def asgi(fake: FakeAgent, timeout: float, fail: Optional[str] = None, **more: Any) -> "tuple[AsyncClient, FloodgateMiddleware]":
    client = AsyncClient(fake.path, timeout=timeout)
    options: dict = {"user_header": "x-user-id", "costs": COSTS, "charge_headers": CHARGE, **more}
    if fail is not None:
        options["fail"] = fail
    return client, FloodgateMiddleware(ok_app, client=client, **options)


@pytest.mark.parametrize(
    "path, cost, mode",
    [("/items", 3, p.ItemMode.CONSUME), ("/v1/chat", 0, p.ItemMode.PEEK)],
    ids=["consuming route", "charge route's peek"],
)
@pytest.mark.parametrize("fail, status", [("open", 200), ("closed", 429)])
def test_asgi_releases_a_lease_whose_check_timed_out(
    silent_agent: FakeAgent, path: str, cost: int, mode: p.ItemMode, fail: str, status: int
) -> None:
    async def main() -> None:
        client, mw = asgi(silent_agent, 0.05, fail)
        await client.start()
        loop = asyncio.get_running_loop()
        try:
            assert client.protocol_version == 3
            sent = await asgi_request(mw, path)
            assert sent[0]["status"] == status, sent
            check, release = (await loop.run_in_executor(None, silent_agent.wait_checks, 2))[:2]
            a = released_attributes(check, release)
            assert (a.endpoint, a.user, a.cost, a.mode) == (path, "u", cost, mode), a
        finally:
            await client.close()

    asyncio.run(main())


def test_asgi_releases_a_lease_whose_request_is_cancelled_mid_check(silent_agent: FakeAgent) -> None:
    async def main() -> None:
        client, mw = asgi(silent_agent, 30.0)
        await client.start()
        loop = asyncio.get_running_loop()
        try:
            task = asyncio.create_task(asgi_request(mw, "/items"))
            await loop.run_in_executor(None, silent_agent.wait_checks, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            check, release = (await loop.run_in_executor(None, silent_agent.wait_checks, 2))[:2]
            assert released_attributes(check, release).cost == 3
        finally:
            await client.close()

    asyncio.run(main())


def test_asgi_sends_no_release_when_the_agent_holds_nothing(holding_nothing: FakeAgent) -> None:
    async def main() -> None:
        client, mw = asgi(holding_nothing, 2.0)
        await client.start()
        loop = asyncio.get_running_loop()
        try:
            for _ in range(2):
                assert (await asgi_request(mw, "/items"))[0]["status"] == 200
            checks = await loop.run_in_executor(None, holding_nothing.wait_checks, 2)
            # The second request's check came straight after the first's: no release between.
            assert len(checks) == 2 and [mode_of(c) for c in checks] == [p.ItemMode.CONSUME] * 2, checks
            assert checks[0][-8:] != checks[1][-8:]
        finally:
            await client.close()

    asyncio.run(main())


# --- WSGI -----------------------------------------------------------------------------------------


def wsgi_app(environ, start_response):  # noqa: ANN001, ANN201
    start_response("200 OK", [("Content-Type", "text/plain"), ("X-LLM-Tokens", "5")])
    return [b"ok"]


def wsgi_request(mw: FloodgateWSGIMiddleware, path: str) -> str:
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "REMOTE_ADDR": "203.0.113.5",
        "HTTP_X_USER_ID": "u",
        "wsgi.input": io.BytesIO(),
    }
    status: List[str] = []
    body = mw(environ, lambda s, headers, exc_info=None: status.append(s))
    try:
        b"".join(body)
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()
    return status[0]


@pytest.mark.parametrize(
    "path, cost, mode",
    [("/items", 3, p.ItemMode.CONSUME), ("/v1/chat", 0, p.ItemMode.PEEK)],
    ids=["consuming route", "charge route's peek"],
)
@pytest.mark.parametrize("fail, status", [("open", "200 OK"), ("closed", "429 Too Many Requests")])
def test_wsgi_releases_a_lease_whose_check_timed_out(
    silent_agent: FakeAgent, path: str, cost: int, mode: p.ItemMode, fail: str, status: str
) -> None:
    with Client(silent_agent.path, timeout=0.05) as client:
        assert client.protocol_version == 3
        mw = FloodgateWSGIMiddleware(
            wsgi_app, client=client, user_header="x-user-id", costs=COSTS, charge_headers=CHARGE, fail=fail
        )
        assert wsgi_request(mw, path) == status
        check, release = silent_agent.wait_checks(2)[:2]
        a = released_attributes(check, release)
        assert (a.endpoint, a.user, a.cost, a.mode) == (path, "u", cost, mode), a


def test_wsgi_sends_no_release_when_the_agent_holds_nothing(holding_nothing: FakeAgent) -> None:
    with Client(holding_nothing.path, timeout=2.0) as client:
        mw = FloodgateWSGIMiddleware(wsgi_app, client=client, user_header="x-user-id", costs=COSTS)
        for _ in range(2):
            assert wsgi_request(mw, "/items") == "200 OK"
        checks = holding_nothing.wait_checks(2)
        assert len(checks) == 2 and [mode_of(c) for c in checks] == [p.ItemMode.CONSUME] * 2, checks
        assert checks[0][-8:] != checks[1][-8:]
