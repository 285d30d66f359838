"""The ASGI middleware in front of a FastAPI app served by uvicorn over real HTTP, asking a real agent:
headers on every response a rule applied to, costs by matched route, 429 with Retry-After and the
JSON body, log mode invisible, odd values hashed as PROTOCOL.md says, X-Forwarded-For believed only
from trusted proxies, IETF headers, fail open and closed without an agent."""

from __future__ import annotations

import asyncio
import os
import tempfile

from conftest import unique
from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse
from http_util import MAX_RESET_S, MIDDLEWARE_RULES, UvicornServer, check_429, now_s, request
from starlette.applications import Starlette
from starlette.routing import Route

from floodgate import AsyncClient
from floodgate.middleware import FloodgateMiddleware


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
        assert r.headers["ratelimit-policy"] == '"login";q=2'
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
