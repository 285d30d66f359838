"""The ASGI middleware in front of a FastAPI app served by uvicorn over real HTTP, asking a real agent:
headers on every response a rule applied to, costs by matched route, 429 with Retry-After and the
JSON body, log mode invisible, odd values hashed as PROTOCOL.md says, X-Forwarded-For believed only
from trusted proxies (also when uvicorn's proxy headers read it first), IETF headers, a handler's
error as a 500 with the headers, a plain ASGI app checked as the path it routes on, fail open and
closed without an agent, a fail-closed rule (or a route's fail_for) once the agent is killed, a
cost a streamed response reports charged after it (a charge no agent takes is logged, the response
stands), and a concurrency rule's lease released when the response ends (completed, the handler
raised, a stream ended, the client gone mid-response), with the bytes a fake agent of version 2 or 3
receives, the request's traceparent header forwarded with its check, release and charge to a
fake agent of version 5 (not 4), and quota mode: a request past a flag rule's limit let through with
X-RateLimit-Over-Quota and the rule ids in the handler's scope."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from typing import Optional

import pytest
from conftest import eventually, unique
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from http_util import (
    CHARGE_HEADERS,
    CHARGE_LEASE_RULES,
    CHARGE_RULES,
    LEASE_RULES,
    MAX_RESET_S,
    MIDDLEWARE_RULES,
    Gate,
    TokensReported,
    UvicornServer,
    charge_route_holds_a_unit,
    charged_after_response,
    check_429,
    fail_closed_after_kill,
    now_s,
    refused_charge_route_holds_nothing,
    released_when_clients_leave,
    request,
    two_in_flight_then_429,
)
from rules import FAIL_MODE_RULES, QUOTA_RULES
from starlette.applications import Starlette
from starlette.routing import Route

from floodgate import AsyncClient, Client
from floodgate import protocol as p
from floodgate.middleware import FloodgateMiddleware, _common
from floodgate.middleware.asgi import scope_header


def make_app(**options: object) -> FastAPI:
    app = FastAPI()

    @app.get("/api/hello")
    async def hello() -> dict:
        return {"hello": "world"}

    @app.get("/api/search/{q}")
    async def search(q: str) -> dict:
        return {"results": q}

    @app.post("/login")
    async def login() -> PlainTextResponse:
        # An app that sets a header of the same name: the limiter's value wins, once.
        return PlainTextResponse("welcome", headers={"X-RateLimit-Limit": "999"})

    @app.get("/open")
    async def open_() -> str:
        return "open"

    router = APIRouter(prefix="/api/v2")

    @router.get("/items/{item_id}")
    async def item(item_id: int) -> dict:
        return {"id": item_id}

    app.include_router(router)

    async def sub(request):  # noqa: ANN001, ANN202
        return PlainTextResponse("sub")

    app.mount("/api/mounted", Starlette(routes=[Route("/things/{name}", sub)]))
    app.add_middleware(FloodgateMiddleware, **options)
    return app


def test_headers_costs_and_429s_over_http(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(MIDDLEWARE_RULES)
    app = make_app(
        socket=agent.socket,
        timeout=2.0,
        # Behind an authenticating hop that sets X-User-Id (no identity header is trusted unless
        # configured), and a proxy on loopback: the test's own requests come from 127.0.0.1.
        user_header="x-user-id",
        costs={"/api/search/{q}": 3, "/api/v2/items/{item_id}": 2, "/api/mounted/things/:name": 3},
        trust_proxies=["127.0.0.1/32"],
    )
    server = UvicornServer(app)
    port = server.port
    u1 = [("X-User-Id", unique("u1"))]
    try:
        r = request(port, "GET", "/api/hello", u1)
        assert r.status == 200 and r.body == b'{"hello":"world"}'
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (6, 5)
        assert now_s() <= r.num("x-ratelimit-reset") <= now_s() + MAX_RESET_S
        # The cost comes from the matched route, not the raw path.
        r = request(port, "GET", "/api/search/cats", u1)
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 2)
        for left in (1, 0):
            r = request(port, "GET", "/api/hello", u1)
            assert (r.status, r.num("x-ratelimit-remaining")) == (200, left)
        check_429(request(port, "GET", "/api/hello", u1), limit=6)
        # Another user is not affected.
        assert request(port, "GET", "/api/hello", [("X-User-Id", unique("u2"))]).status == 200

        # A value the wire refuses (a brace: a Redis hash tag) is limited under its hash: 6 then 429.
        odd = [("X-User-Id", "{victim}")]
        for _ in range(6):
            assert request(port, "GET", "/api/hello", odd).status == 200
        check_429(request(port, "GET", "/api/hello", odd), limit=6)

        # The key is exactly PROTOCOL.md's worked example: that user is spent as seen by the agent.
        async def spent() -> bool:
            c = await AsyncClient.connect(agent.socket, timeout=2.0)
            d = await c.check_attributes(endpoint="/api/hello", user="h:0a5b9694d4ec70f5")
            await c.close()
            return not d.allowed and d.limit == 6

        assert asyncio.run(spent())

        # Nested routes: an APIRouter prefix and a mounted Starlette app are matched as their
        # templates (their costs, 2 and 3, are keyed by template, in either spelling).
        u3 = [("X-User-Id", unique("u3"))]
        r = request(port, "GET", "/api/v2/items/7", u3)
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 4)
        r = request(port, "GET", "/api/mounted/things/x", u3)
        assert (r.status, r.body, r.num("x-ratelimit-remaining")) == (200, b"sub", 1)
        # An unmatched path is checked as itself (cost 1), and the app's 404 still gets headers.
        r = request(port, "GET", "/api/nowhere", u3)
        assert (r.status, r.num("x-ratelimit-remaining")) == (404, 0)

        # Log mode (limit 1 per IP) never blocks and never shows; no enforced rule applies to /open.
        for _ in range(3):
            r = request(port, "GET", "/open")
            assert r.status == 200 and "x-ratelimit-limit" not in r.headers, r.headers

        # X-Forwarded-For from a trusted proxy names the client.
        def via_proxy(xff: str):  # noqa: ANN202
            return request(port, "POST", "/login", [("X-Forwarded-For", xff)])

        for left in (1, 0):
            r = via_proxy("9.9.9.9")
            assert (r.status, r.num("x-ratelimit-remaining")) == (200, left)
            assert r.headers["x-ratelimit-limit"] == "2", "the app's own header is replaced"
        check_429(via_proxy("9.9.9.9"), limit=2)
        assert via_proxy("8.8.8.8").status == 200, "another client behind the proxy"
        # A client prepending to the header through the proxy does not move the key.
        assert via_proxy("1.1.1.1, 9.9.9.9").status == 429
    finally:
        server.close()

    # Without trusted proxies the header is the client's own words: keyed by the peer (127.0.0.1),
    # which has not used its 2 logins although 9.9.9.9 has.
    server = UvicornServer(make_app(socket=agent.socket, timeout=2.0, ietf_headers=True))
    try:
        r = request(server.port, "POST", "/login", [("X-Forwarded-For", "9.9.9.9")])
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1)
        # The login rule's hour-long window (MIDDLEWARE_RULES), from the agent's version-4 Decision.
        assert r.headers["ratelimit-policy"] == '"login";q=2;w=3600'
        assert r.headers["ratelimit"].startswith('"login";r=1;t=')
        assert request(server.port, "POST", "/login").status == 200
        check_429(request(server.port, "POST", "/login"), limit=2)
    finally:
        server.close()


def test_no_agent_fails_open_without_headers_or_closed_with_429() -> None:
    nobody = os.path.join(tempfile.mkdtemp(), "nobody.sock")
    server = UvicornServer(make_app(socket=nobody))
    try:
        r = request(server.port, "GET", "/api/hello", [("X-User-Id", "u")])
        assert r.status == 200 and "x-ratelimit-limit" not in r.headers
    finally:
        server.close()
    server = UvicornServer(make_app(socket=nobody, fail="closed"))
    try:
        r = request(server.port, "GET", "/api/hello")
        assert r.status == 429 and r.num("retry-after") == 1
        assert r.body == b'{"error":"rate_limited","retryAfter":1}'
    finally:
        server.close()


def error_app(own_500: bool = False) -> FastAPI:
    """An app whose handler raises; with ``own_500``, a handler of its own for every error."""
    app = FastAPI()

    @app.get("/api/boom/{n}")
    async def boom(n: int) -> dict:
        raise RuntimeError(f"boom {n}")

    if own_500:

        @app.exception_handler(Exception)
        async def oops(request, exc):  # noqa: ANN001, ANN202
            return JSONResponse({"error": "oops"}, status_code=500)

    return app


async def plain_app(scope, receive, send) -> None:  # noqa: ANN001
    """An ASGI app that is not Starlette's: it routes on scope["path"], which the server decoded."""
    if scope["path"] == "/api/boom":
        raise RuntimeError("boom")
    status = 200 if scope["path"] == "/login" else 404
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": scope["path"].encode()})


def test_a_handler_error_is_the_500_it_was_with_the_headers(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(MIDDLEWARE_RULES)
    options = dict(socket=agent.socket, timeout=2.0, user_header="x-user-id", costs={"/api/boom/{n}": 2})
    user = [("X-User-Id", unique("u"))]

    # Added to a FastAPI app: Starlette's own 500, with the headers of the check that let it through
    # (cost 2 by route), and the error still reaches the server (uvicorn logs it).
    app = error_app()
    app.add_middleware(FloodgateMiddleware, **options)
    server = UvicornServer(app)
    try:
        r = request(server.port, "GET", "/api/boom/1", user)
        assert (r.status, r.body) == (500, b"Internal Server Error"), r
        assert r.headers["content-type"] == "text/plain; charset=utf-8"
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (6, 4)
    finally:
        server.close()

    # In front of a plain ASGI app: uvicorn's own 500, with the headers.
    server = UvicornServer(FloodgateMiddleware(plain_app, **options))
    try:
        r = request(server.port, "GET", "/api/boom", user)
        assert (r.status, r.body) == (500, b"Internal Server Error"), r
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (6, 3)
    finally:
        server.close()

    # An app with a 500 of its own keeps it: added as a middleware, Starlette sends it from outside
    # the middleware (no headers, as before); wrapped around the app, the middleware sees it, adds the
    # headers, and still matches routes (cost 2).
    app = error_app(own_500=True)
    app.add_middleware(FloodgateMiddleware, **options)
    server = UvicornServer(app)
    try:
        r = request(server.port, "GET", "/api/boom/2", user)
        assert (r.status, r.body) == (500, b'{"error":"oops"}'), r
        assert "x-ratelimit-limit" not in r.headers, "sent from outside every added middleware"
    finally:
        server.close()
    server = UvicornServer(FloodgateMiddleware(error_app(own_500=True), **options))
    try:
        r = request(server.port, "GET", "/api/boom/3", [("X-User-Id", unique("w"))])
        assert (r.status, r.body) == (500, b'{"error":"oops"}'), r
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (6, 4)
    finally:
        server.close()


def test_an_address_uvicorn_took_from_x_forwarded_for_is_believed_only_through_trust_proxies(make_agent) -> None:  # noqa: ANN001, E501
    agent = make_agent(MIDDLEWARE_RULES)
    # uvicorn as it runs by default: proxy headers on, trusting 127.0.0.1 and ::1, the test's own
    # address; it puts an X-Forwarded-For entry in scope["client"] before the middleware runs.
    server = UvicornServer(make_app(socket=agent.socket, timeout=2.0), proxy_headers=True)

    def login(port: int, xff: str):  # noqa: ANN202
        return request(port, "POST", "/login", [("X-Forwarded-For", xff)])

    try:
        r = login(server.port, "9.9.9.9")
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1)
        r = login(server.port, "8.8.8.8")
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 0), "another address written is not another client"
        check_429(login(server.port, "7.7.7.7:4444"), limit=2)
        # Without the header, the peer is the client, with a budget of its own.
        r = request(server.port, "POST", "/login")
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1)
    finally:
        server.close()

    # With trust_proxies naming the proxies uvicorn trusts, the header is read through them.
    server = UvicornServer(
        make_app(socket=agent.socket, timeout=2.0, trust_proxies=["127.0.0.1", "::1"]), proxy_headers=True
    )
    try:
        for left in (1, 0):
            r = login(server.port, "1.1.1.1, 5.5.5.5")
            assert (r.status, r.num("x-ratelimit-remaining")) == (200, left)
        check_429(login(server.port, "5.5.5.5"), limit=2)
        assert login(server.port, "6.6.6.6").status == 200
    finally:
        server.close()


def test_a_plain_asgi_app_is_checked_as_the_path_it_routes_on(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(MIDDLEWARE_RULES)
    server = UvicornServer(FloodgateMiddleware(plain_app, socket=agent.socket, timeout=2.0))
    try:
        # /%6Cogin reaches the app as /login, so it counts as /login.
        r = request(server.port, "POST", "/%6Cogin")
        assert (r.status, r.body) == (200, b"/login")
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (2, 1)
        r = request(server.port, "POST", "/login")
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 0)
        check_429(request(server.port, "POST", "/%6cogin"), limit=2)
    finally:
        server.close()


def test_asgi_quota_mode_lets_a_request_through_flagged_for_the_handler(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(QUOTA_RULES)
    app = FastAPI()
    seen = []

    # The handler routes by the scope: the big model within the quota, a small one past it.
    @app.post("/v1/chat")
    async def chat(request: Request) -> PlainTextResponse:
        over = request.scope.get("floodgate.over_quota")
        seen.append(over)
        return PlainTextResponse(f"small model ({','.join(over)})" if over else "big model")

    app.add_middleware(FloodgateMiddleware, socket=agent.socket, timeout=2.0, user_header="x-user-id")
    server = UvicornServer(app)
    user = [("X-User-Id", unique("u"))]
    try:
        r = request(server.port, "POST", "/v1/chat", user)
        assert (r.status, r.body) == (200, b"big model")
        assert "x-ratelimit-over-quota" not in r.headers and seen == [None], r.headers
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (1, 0)
        for _ in range(2):
            r = request(server.port, "POST", "/v1/chat", user)
            assert (r.status, r.body) == (200, b"small model (premium)"), "past the quota, let through"
            assert r.headers["x-ratelimit-over-quota"] == "premium"
            assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (1, 0)
        assert seen[1:] == [["premium"], ["premium"]]
        # Another user is within its quota.
        r = request(server.port, "POST", "/v1/chat", [("X-User-Id", unique("v"))])
        assert r.body == b"big model" and "x-ratelimit-over-quota" not in r.headers
    finally:
        server.close()
    # A plain ASGI app finds the ids in the scope it is given.
    got = []

    async def plain(scope, receive, send) -> None:  # noqa: ANN001
        got.append(scope.get("floodgate.over_quota"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = UvicornServer(FloodgateMiddleware(plain, socket=agent.socket, timeout=2.0, user_header="x-user-id"))
    try:
        r = request(server.port, "POST", "/anywhere", user)
        assert r.status == 200 and r.headers["x-ratelimit-over-quota"] == "premium" and got == [["premium"]]
    finally:
        server.close()


def test_asgi_fail_closed_rules_outlive_a_killed_agent(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(FAIL_MODE_RULES)
    app = FastAPI()

    @app.post("/login")
    async def login() -> str:
        return "welcome"

    @app.get("/api/hello")
    async def hello() -> str:
        return "hello"

    # One client (made outside the server's loop, started on it by the first request), two middleware.
    client = AsyncClient(agent.socket, timeout=2.0)
    default = FloodgateMiddleware(app, client=client)
    per_route = FloodgateMiddleware(app, client=client, fail_for={"/login": "open"})

    async def dispatch(scope, receive, send):  # noqa: ANN001, ANN202
        chosen = per_route if scope["type"] == "http" and scope_header(scope, "x-variant") == "fail-for" else default
        await chosen(scope, receive, send)

    server = UvicornServer(dispatch)
    try:
        fail_closed_after_kill(server.port, agent, client)
    finally:
        server.close()


def chat_app(gate: Optional[Gate] = None, **options: object) -> FastAPI:
    """An LLM route that streams its answer in parts and reports its tokens (the request's X-Want) in
    X-LLM-Tokens (after waiting in ``gate`` when the request has X-Hold), and an ordinary route."""
    app = FastAPI()

    @app.post("/v1/chat")
    async def chat(request: Request) -> StreamingResponse:
        want = request.headers.get("x-want")
        if gate is not None and request.headers.get("x-hold"):
            await gate.aenter()

        async def parts():  # noqa: ANN202
            for part in (b"an ", b"answer"):
                yield part

        return StreamingResponse(parts(), headers={"x-llm-tokens": want} if want is not None else {})

    @app.get("/api/hello")
    async def hello() -> str:
        return "hello"

    app.add_middleware(FloodgateMiddleware, **options)
    return app


def test_asgi_charges_what_the_response_reports_after_it(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_RULES)
    app = chat_app(socket=agent.socket, timeout=2.0, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    server = UvicornServer(app)
    reader = Client(agent.socket, timeout=2.0)
    try:
        r = request(server.port, "POST", "/v1/chat", [("X-User-Id", unique("u")), ("X-Want", "7")])
        assert (r.status, r.body) == (200, b"an answer"), "the streamed body is whole"
        charged_after_response(server.port, lambda user: reader.peek(f"user:{user}", "tokens", 0).remaining)
    finally:
        server.close()
        reader.close()


def test_asgi_charges_what_a_callable_makes_of_the_response(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_RULES)
    tokens = TokensReported()
    server = UvicornServer(chat_app(socket=agent.socket, timeout=2.0, user_header="x-user-id", charge_with={"/v1/chat": tokens}))
    reader = Client(agent.socket, timeout=2.0)
    try:
        charged_after_response(server.port, lambda user: reader.peek(f"user:{user}", "tokens", 0).remaining)
        # Called once per response of the route (all but the 429), with its status and its headers as
        # text pairs.
        assert len(tokens.calls) == 11
        for status, headers in tokens.calls:
            assert status == 200 and all(isinstance(k, str) and isinstance(v, str) for k, v in headers), headers
        assert ("x-llm-tokens", "1500") in tokens.calls[0][1]
    finally:
        server.close()
        reader.close()


@pytest.fixture
def charge_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """The ``floodgate`` logger's warnings, with the once-a-minute charge warnings not yet said."""
    monkeypatch.setattr(_common.CHARGE_LOST, "_last", -1)
    monkeypatch.setattr(_common.CHECK_FAILED, "_last", -1)
    caplog.set_level(logging.WARNING, logger="floodgate")
    return caplog


def test_asgi_a_charge_no_agent_takes_is_logged_and_the_response_stands(charge_log) -> None:  # noqa: ANN001
    nobody = os.path.join(tempfile.mkdtemp(), "nobody.sock")
    server = UvicornServer(chat_app(socket=nobody, user_header="x-user-id", charge_headers=CHARGE_HEADERS))
    try:
        for _ in range(3):
            r = request(server.port, "POST", "/v1/chat", [("X-User-Id", "u"), ("X-Want", "1500")])
            assert (r.status, r.body) == (200, b"an answer") and "x-ratelimit-limit" not in r.headers, r

        def said() -> list:
            text = "could not take a response's charge"
            return [m.getMessage() for m in charge_log.records if text in m.getMessage()]

        eventually("the lost charge is logged", said)
        assert said() == [
            "floodgate: the agent could not take a response's charge (unavailable); it is not counted"
            " (said at most once a minute)"
        ], "once a minute, not once a request"
    finally:
        server.close()


def test_asgi_charge_routes_pass_unchecked_by_a_version_1_agent(charge_log) -> None:  # noqa: ANN001
    from test_fake_agent import FakeAgent, decision

    fake = FakeAgent(lambda conn, rid: decision(rid))  # answers HelloOk 1
    app = chat_app(socket=fake.path, timeout=2.0, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    server = UvicornServer(app)
    try:
        for _ in range(2):
            r = request(server.port, "POST", "/v1/chat", [("X-User-Id", "u"), ("X-Want", "1500")])
            assert (r.status, r.body) == (200, b"an answer") and "x-ratelimit-limit" not in r.headers, r
        said = [m.getMessage() for m in charge_log.records if "speaks version 1" in m.getMessage()]
        assert len(said) == 1 and "the request passes" in said[0], said
        assert fake.checks == [], "a version-1 agent is sent neither the peek nor the charge"
        # Other routes are checked as before.
        r = request(server.port, "GET", "/api/hello", [("X-User-Id", "u")])
        assert r.status == 200 and r.num("x-ratelimit-limit") == 10 and len(fake.checks) == 1
    finally:
        server.close()
        fake.close()


# --- concurrency leases (protocol version 3) ----------------------------------------------------------


def slow_app(gate: Gate, **options: object) -> FastAPI:
    """Routes under /slow/ (``LEASE_RULES``) held in flight by ``gate``: ``wait`` answers once the gate
    opens, ``boom`` raises then, ``stream`` streams a first part, waits, then its last; ``hang``
    streams a first part and waits until the client goes; ``done`` answers at once."""
    app = FastAPI()

    @app.get("/slow/{kind}")
    async def slow(kind: str):  # noqa: ANN202
        if kind == "stream":

            async def parts():  # noqa: ANN202
                yield b"first "
                await gate.aenter()
                yield b"last"

            return StreamingResponse(parts())
        if kind == "hang":

            async def forever():  # noqa: ANN202
                yield b"first "
                await asyncio.Event().wait()  # until Starlette sees the client go and cancels it
                yield b"never"

            return StreamingResponse(forever())
        if kind != "done":
            await gate.aenter()
        if kind == "boom":
            raise RuntimeError("boom")
        return PlainTextResponse("done")

    app.add_middleware(FloodgateMiddleware, **options)
    return app


@pytest.fixture
def lease_server(make_agent):  # noqa: ANN001, ANN201
    """``(serve(gate) -> port, remaining)``: the slow app on a real agent with ``LEASE_RULES``."""
    agent = make_agent(LEASE_RULES)
    reader = Client(agent.socket, timeout=2.0)
    servers = []

    def serve(gate: Gate) -> int:
        server = UvicornServer(slow_app(gate, socket=agent.socket, timeout=2.0, user_header="x-user-id"))
        servers.append(server)
        return server.port

    yield serve, lambda user, rule: reader.peek(f"user:{user}", rule, 0).remaining
    for server in servers:
        server.close()
    reader.close()


@pytest.mark.parametrize(
    "path, status, body",
    [("/slow/wait", 200, b"done"), ("/slow/boom", 500, b"Internal Server Error"), ("/slow/stream", 200, b"first last")],
    ids=["completed", "handler raised", "stream ended"],
)
def test_asgi_releases_a_lease_when_the_response_ends(lease_server, path: str, status: int, body: bytes) -> None:  # noqa: ANN001
    serve, remaining = lease_server
    gate = Gate()
    two_in_flight_then_429(serve(gate), path, gate, remaining, status, body)


def test_asgi_releases_a_lease_when_the_client_goes_mid_response(lease_server) -> None:  # noqa: ANN001
    serve, remaining = lease_server
    released_when_clients_leave(serve(Gate()), "/slow/hang", remaining, b"first ")


def leased_decision(rid: int) -> bytes:
    """A fake agent's answer: allowed, and the slots rule holds the check's lease."""
    v = p.Verdict(True, False, p.Source.LOCAL, 2, 1, 1_700_000_000_000, 0, holds_lease=True)
    return p.encode(p.Frame(rid, p.DecisionBody(v, [p.ItemDecision("slots", v)])))


def leases_on_the_wire(port: int, fake) -> None:  # noqa: ANN001
    """What a middleware at ``port`` sends a fake agent of version 3 that says every check holds its
    lease: the request's check with a fresh lease (form 3, bit 7), then, once the response has
    ended, the same bytes but the request id and the mode, release (0x83)."""
    r = request(port, "GET", "/slow/done", [("X-User-Id", "u")])
    assert r.status == 200 and r.num("x-ratelimit-limit") == 2, r
    eventually("the release is sent", lambda: len(fake.checks) >= 2)
    check, release = fake.checks[:2]
    assert check[10] == p.FORM_ATTRIBUTES_MODE and check[-9] == p.MODE_LEASE, check.hex(" ")
    decoded = p.decode(check)
    assert isinstance(decoded, p.Decoded)
    a = decoded.frame.body.attributes
    assert (a.endpoint, a.user, a.cost, a.mode) == ("/slow/:kind", "u", 1, p.ItemMode.CONSUME) and a.lease
    assert release[-9] == p.MODE_LEASE | p.ItemMode.RELEASE
    assert release[:6] + release[10:-9] == check[:6] + check[10:-9] and release[-8:] == check[-8:], release.hex(" ")
    # Another request, another lease.
    request(port, "GET", "/slow/done", [("X-User-Id", "u")])
    eventually("its release is sent", lambda: len(fake.checks) >= 4)
    assert fake.checks[2][-8:] != check[-8:] and fake.checks[3][-8:] == fake.checks[2][-8:]


def no_lease_for_version_2(port: int, fake) -> None:  # noqa: ANN001
    """What a middleware at ``port`` sends a fake agent of version 2: checks without a lease (form 1:
    every rule consumes), whatever the answer says, and no release."""
    for _ in range(2):
        r = request(port, "GET", "/slow/done", [("X-User-Id", "u")])
        assert r.status == 200, r
    assert len(fake.checks) == 2 and all(c[10] == p.FORM_ATTRIBUTES for c in fake.checks), fake.checks


@pytest.mark.parametrize("own_client", [True, False], ids=["own client", "a client not started yet"])
def test_asgi_sends_a_lease_only_to_a_version_3_agent(own_client: bool) -> None:
    from test_fake_agent import FakeAgent

    for version, scenario in ((3, leases_on_the_wire), (2, no_lease_for_version_2)):
        hello = p.encode(p.Frame(0, p.HelloOk(version)))
        fake = FakeAgent(lambda conn, rid: leased_decision(rid), hello=hello)
        # A client given to the middleware connects on the first request's check: that check does
        # not know the agent's version when it is built.
        where = {"socket": fake.path} if own_client else {"client": AsyncClient(fake.path, timeout=2.0)}
        server = UvicornServer(slow_app(Gate(), timeout=2.0, user_header="x-user-id", **where))
        try:
            scenario(server.port, fake)
        finally:
            server.close()
            fake.close()


# --- a charge route's concurrency unit (protocol version 3) -------------------------------------------


@pytest.mark.parametrize("how", ["charge_headers", "charge_with"])
def test_asgi_a_charge_route_holds_one_unit_while_in_flight(make_agent, how: str) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_LEASE_RULES)
    gate = Gate()
    charge = {"charge_headers": CHARGE_HEADERS} if how == "charge_headers" else {"charge_with": {"/v1/chat": TokensReported()}}
    server = UvicornServer(chat_app(gate, socket=agent.socket, timeout=2.0, user_header="x-user-id", **charge))
    reader = Client(agent.socket, timeout=2.0)
    try:
        charge_route_holds_a_unit(server.port, gate, lambda user, rule: reader.peek(f"user:{user}", rule, 0).remaining)
    finally:
        gate.open()
        server.close()
        reader.close()


def test_asgi_a_charge_route_refused_by_its_rate_rule_holds_no_unit(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_LEASE_RULES)
    server = UvicornServer(chat_app(socket=agent.socket, timeout=2.0, user_header="x-user-id", charge_headers=CHARGE_HEADERS))
    reader = Client(agent.socket, timeout=2.0)
    try:
        refused_charge_route_holds_nothing(
            server.port,
            lambda user, rule: reader.peek(f"user:{user}", rule, 0).remaining,
            lambda user, cost: reader.charge(f"user:{user}", "tokens", cost),
        )
    finally:
        server.close()
        reader.close()


# --- the request's trace context (protocol version 5) -------------------------------------------------


def traces_on_the_wire(port: int, fake, version: int) -> None:  # noqa: ANN001
    """What a middleware at ``port`` (``/v1/chat`` charged from X-LLM-Tokens) sends a fake agent of
    ``version`` (4 or more) that says every check holds its lease: for a request with a
    ``traceparent`` header, its check (a peek with a lease), then, once the response has ended, its
    release and its charge, all three with the header's trace context (form 4) when the agent speaks
    version 5, and without it to an older one; for a request without the header, or with one that
    does not parse, the same checks without it (form 3)."""
    from test_fake_agent import TRACE, TRACEPARENT

    def sent(headers: list) -> list:
        before = len(fake.checks)
        r = request(port, "POST", "/v1/chat", [("X-User-Id", "u"), ("X-Want", "7"), *headers])
        assert (r.status, r.body) == (200, b"an answer"), r
        eventually("the check, its release and its charge are sent", lambda: len(fake.checks) >= before + 3)
        frames = fake.checks[before:]
        modes = sorted(p.decode(f).frame.body.attributes.mode for f in frames)
        assert modes == [p.ItemMode.PEEK, p.ItemMode.CHARGE, p.ItemMode.RELEASE], modes
        return frames

    for f in sent([("traceparent", TRACEPARENT)]):
        body = p.decode(f).frame.body
        if version >= 5:
            assert f[10] == p.FORM_TRACED and body.trace == TRACE, f.hex(" ")
        else:
            assert f[10] == p.FORM_ATTRIBUTES_MODE and body.trace is None, f.hex(" ")
        assert (body.attributes.endpoint, body.attributes.user) == ("/v1/chat", "u")
    for headers in ([], [("traceparent", TRACEPARENT.upper())], [("traceparent", "00-garbage")]):
        for f in sent(headers):
            assert f[10] == p.FORM_ATTRIBUTES_MODE and p.decode(f).frame.body.trace is None, (headers, f.hex(" "))
    assert fake.connections == 1


@pytest.mark.parametrize("version", [5, 4])
def test_asgi_forwards_the_requests_traceparent(version: int) -> None:
    from test_fake_agent import FakeAgent, hello_ok

    fake = FakeAgent(lambda conn, rid: leased_decision(rid), hello=hello_ok(version))
    app = chat_app(socket=fake.path, timeout=2.0, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    server = UvicornServer(app)
    try:
        traces_on_the_wire(server.port, fake, version)
    finally:
        server.close()
        fake.close()
