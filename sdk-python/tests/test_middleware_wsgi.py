"""The WSGI middleware in front of a plain WSGI app served by wsgiref over real HTTP, asking a real
agent: a 200 with the limiter's headers, then a 429 with Retry-After and the JSON body; costs by
path, the path as the app routes on it, identity only from the configured header, X-Forwarded-For
only through a trusted proxy, log mode invisible, fail open and closed without an agent, a
fail-closed rule (or a route's fail_for) once the agent is killed, a cost the response reports
charged when the server closes the response (a charge no agent takes is logged, the response
stands), and a concurrency rule's lease released when the response ends (completed, the app raised,
a streamed body ended or was abandoned by its client), with the bytes a fake agent of version 2 or 3
receives, the request's traceparent header forwarded with its check, release and charge to a
fake agent of version 5 (not 4), and quota mode: a request past a flag rule's limit let through with
X-RateLimit-Over-Quota and the rule ids in the app's environ."""

from __future__ import annotations

import logging
import os
import tempfile
import threading

import pytest
from conftest import eventually, unique
from http_util import (
    CHARGE_HEADERS,
    CHARGE_LEASE_RULES,
    CHARGE_RULES,
    LEASE_RULES,
    MAX_RESET_S,
    MIDDLEWARE_RULES,
    PATIENCE,
    Gate,
    TokensReported,
    WsgiServer,
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

from floodgate import Client
from floodgate.middleware import FloodgateWSGIMiddleware, _common


def app(environ, start_response):  # noqa: ANN001, ANN201
    path = environ["PATH_INFO"]
    if path == "/missing":
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"nope"]
    # The app sets a header of the limiter's name: the limiter's value replaces it.
    start_response("200 OK", [("Content-Type", "text/plain"), ("X-RateLimit-Remaining", "999")])
    return [f"hello {path}".encode()]


def test_wsgi_headers_and_429_over_http(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(MIDDLEWARE_RULES)
    client = Client(agent.socket, timeout=2.0)
    wrapped = FloodgateWSGIMiddleware(
        app,
        client=client,
        user_header="X-User-Id",
        costs={"/api/search": 2},
        trust_proxies=["127.0.0.0/8"],
    )
    server = WsgiServer(wrapped)
    port = server.port
    user = [("X-User-Id", unique("u"))]
    try:
        r = request(port, "GET", "/api/hello", user)
        assert r.status == 200 and r.body == b"hello /api/hello"
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (6, 5)
        assert now_s() <= r.num("x-ratelimit-reset") <= now_s() + MAX_RESET_S
        r = request(port, "GET", "/api/search?q=cats", user)
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 3), "cost 2 for /api/search"
        r = request(port, "GET", "/api/missing", user)
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 2)
        for left in (1, 0):
            r = request(port, "GET", "/api/hello", user)
            assert (r.status, r.num("x-ratelimit-remaining")) == (200, left)
        check_429(request(port, "GET", "/api/hello", user), limit=6)
        # Without the configured header there is no user: the per-user rule does not apply.
        r = request(port, "GET", "/api/hello", [("X-Other", "x")])
        assert r.status == 200 and "x-ratelimit-limit" not in r.headers
        # Log mode is invisible (limit 1 per IP, three passes without headers).
        for _ in range(3):
            r = request(port, "GET", "/missing")
            assert r.status == 404 and "x-ratelimit-limit" not in r.headers
        # Through the trusted proxy (loopback), X-Forwarded-For names the client; the rightmost
        # address the proxy did not vouch for counts.
        for left in (1, 0):
            r = request(port, "POST", "/login", [("X-Forwarded-For", "6.6.6.6, 198.51.100.7")])
            assert (r.status, r.num("x-ratelimit-remaining")) == (200, left)
        check_429(request(port, "POST", "/login", [("X-Forwarded-For", "198.51.100.7")]), limit=2)
        assert request(port, "POST", "/login", [("X-Forwarded-For", "198.51.100.8")]).status == 200
    finally:
        server.close()
        client.close()


def test_wsgi_endpoint_is_the_path_the_app_routes_on(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(MIDDLEWARE_RULES)
    client = Client(agent.socket, timeout=2.0)
    # The server gives RAW_URI as sent (/%6Cogin), as gunicorn does; the app routes on PATH_INFO.
    server = WsgiServer(FloodgateWSGIMiddleware(app, client=client))
    try:
        r = request(server.port, "POST", "/%6Cogin")
        assert (r.status, r.body) == (200, b"hello /login")
        assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (2, 1), "counted as /login"
        assert request(server.port, "POST", "/login").num("x-ratelimit-remaining") == 0
        check_429(request(server.port, "POST", "/%6cogin"), limit=2)
    finally:
        server.close()
        client.close()


def test_wsgi_without_an_agent_fails_open_or_closed() -> None:
    nobody = os.path.join(tempfile.mkdtemp(), "nobody.sock")
    for fail, status in (("open", 200), ("closed", 429)):
        server = WsgiServer(FloodgateWSGIMiddleware(app, socket=nobody, fail=fail, user_header="x-user-id"))
        try:
            r = request(server.port, "GET", "/api/hello", [("X-User-Id", "u")])
            assert r.status == status and "x-ratelimit-limit" not in r.headers
            if fail == "closed":
                assert r.num("retry-after") == 1 and r.body == b'{"error":"rate_limited","retryAfter":1}'
        finally:
            server.close()


def test_wsgi_quota_mode_lets_a_request_through_flagged_for_the_app(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(QUOTA_RULES)
    client = Client(agent.socket, timeout=2.0)

    def chat(environ, start_response):  # noqa: ANN001, ANN202
        # The app routes by the environ: the big model within the quota, a small one past it.
        over = environ.get("floodgate.over_quota")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"small model ({','.join(over)})".encode() if over else b"big model"]

    server = WsgiServer(FloodgateWSGIMiddleware(chat, client=client, user_header="X-User-Id"))
    user = [("X-User-Id", unique("u"))]
    try:
        r = request(server.port, "POST", "/v1/chat", user)
        assert (r.status, r.body) == (200, b"big model") and "x-ratelimit-over-quota" not in r.headers
        for _ in range(2):
            r = request(server.port, "POST", "/v1/chat", user)
            assert (r.status, r.body) == (200, b"small model (premium)"), "past the quota, let through"
            assert r.headers["x-ratelimit-over-quota"] == "premium"
            assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (1, 0)
    finally:
        server.close()
        client.close()


def test_wsgi_fail_closed_rules_outlive_a_killed_agent(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(FAIL_MODE_RULES)
    client = Client(agent.socket, timeout=2.0)
    default = FloodgateWSGIMiddleware(app, client=client)
    per_route = FloodgateWSGIMiddleware(app, client=client, fail_for={"/login": "open"})

    def dispatch(environ, start_response):  # noqa: ANN001, ANN202
        chosen = per_route if environ.get("HTTP_X_VARIANT") == "fail-for" else default
        return chosen(environ, start_response)

    server = WsgiServer(dispatch)
    try:
        fail_closed_after_kill(server.port, agent, client)
    finally:
        server.close()
        client.close()


def chat_app(environ, start_response):  # noqa: ANN001, ANN201
    """An LLM route whose answer is a generator (start_response called on the first part) reporting
    its tokens (the request's X-Want) in X-LLM-Tokens, and ``app`` elsewhere."""
    if environ["PATH_INFO"] != "/v1/chat":
        return app(environ, start_response)
    want = environ.get("HTTP_X_WANT")

    def parts():  # noqa: ANN202
        headers = [("Content-Type", "text/plain"), ("Content-Length", "9")]
        start_response("200 OK", headers + ([("X-LLM-Tokens", want)] if want is not None else []))
        yield b"an "
        yield b"answer"

    return parts()


def test_wsgi_charges_what_the_response_reports_after_it(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_RULES)
    client = Client(agent.socket, timeout=2.0)
    server = WsgiServer(
        FloodgateWSGIMiddleware(chat_app, client=client, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    )
    try:
        r = request(server.port, "POST", "/v1/chat", [("X-User-Id", unique("u")), ("X-Want", "7")])
        assert (r.status, r.body) == (200, b"an answer")
        charged_after_response(server.port, lambda user: client.peek(f"user:{user}", "tokens", 0).remaining)
    finally:
        server.close()
        client.close()


def test_wsgi_charges_what_a_callable_makes_of_the_response(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_RULES)
    client = Client(agent.socket, timeout=2.0)
    tokens = TokensReported()
    server = WsgiServer(
        FloodgateWSGIMiddleware(chat_app, client=client, user_header="x-user-id", charge_with={"/v1/chat": tokens})
    )
    try:
        charged_after_response(server.port, lambda user: client.peek(f"user:{user}", "tokens", 0).remaining)
        # Called once per response of the route (all but the 429), with its status as an int and its
        # headers as given.
        assert len(tokens.calls) == 11
        status, headers = tokens.calls[0]
        assert status == 200 and ("X-LLM-Tokens", "1500") in headers, tokens.calls[0]
    finally:
        server.close()
        client.close()


def test_wsgi_a_charge_no_agent_takes_is_logged_and_the_response_stands(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common.CHARGE_LOST, "_last", -1)
    caplog.set_level(logging.WARNING, logger="floodgate")
    nobody = os.path.join(tempfile.mkdtemp(), "nobody.sock")
    server = WsgiServer(
        FloodgateWSGIMiddleware(chat_app, socket=nobody, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    )
    try:
        for _ in range(3):
            r = request(server.port, "POST", "/v1/chat", [("X-User-Id", "u"), ("X-Want", "1500")])
            assert (r.status, r.body) == (200, b"an answer") and "x-ratelimit-limit" not in r.headers, r

        def said() -> list:
            return [m.getMessage() for m in caplog.records if "could not take a response's charge" in m.getMessage()]

        eventually("the lost charge is logged", said)
        assert len(said()) == 1, "once a minute, not once a request"
    finally:
        server.close()


# --- concurrency leases (protocol version 3) ----------------------------------------------------------


class SlowApp:
    """Routes under /slow/ (``LEASE_RULES``) held in flight by ``gate``: ``wait`` answers once the gate
    opens, ``boom`` raises then (before starting its response), ``stream`` is a generator that sends
    a first part, waits, then its last; ``abandoned`` sends a first part, waits, then writes parts
    until the server stops it (its client is gone), noting that it was closed early; ``done``
    answers at once."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.closed_early = threading.Semaphore(0)

    def __call__(self, environ, start_response):  # noqa: ANN001, ANN204
        kind = environ["PATH_INFO"].rsplit("/", 1)[-1]
        if kind in ("stream", "abandoned"):
            return self.stream(kind, start_response)
        if kind != "done":
            self.gate.enter()
        if kind == "boom":
            raise RuntimeError("boom")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done"]

    def stream(self, kind: str, start_response):  # noqa: ANN001, ANN201
        start_response("200 OK", [("Content-Type", "text/plain")])
        yield b"first "
        self.gate.enter()
        if kind == "stream":
            yield b"last"
            return
        try:
            for _ in range(100_000):  # the server stops at the first write to the closed connection
                yield b"x" * 1024
        except GeneratorExit:
            self.closed_early.release()
            raise


@pytest.fixture
def lease_server(make_agent):  # noqa: ANN001, ANN201
    """``(serve(app) -> port, remaining)``: a threaded server of ``app`` on a real agent with
    ``LEASE_RULES``."""
    agent = make_agent(LEASE_RULES)
    client = Client(agent.socket, timeout=2.0)
    servers = []

    def serve(app) -> int:  # noqa: ANN001
        server = WsgiServer(FloodgateWSGIMiddleware(app, client=client, user_header="x-user-id"), threads=True)
        servers.append(server)
        return server.port

    yield serve, lambda user, rule: client.peek(f"user:{user}", rule, 0).remaining
    for server in servers:
        server.close()
    client.close()


@pytest.mark.parametrize(
    "path, status, body",
    [("/slow/wait", 200, b"done"), ("/slow/boom", 500, None), ("/slow/stream", 200, b"first last")],
    ids=["completed", "app raised", "stream ended"],
)
def test_wsgi_releases_a_lease_when_the_response_ends(lease_server, path: str, status: int, body) -> None:  # noqa: ANN001
    serve, remaining = lease_server
    gate = Gate()
    # An app that raised gets wsgiref's own 500, without the limiter's headers (the middleware
    # re-raises what it caught, as it found it).
    two_in_flight_then_429(serve(SlowApp(gate)), path, gate, remaining, status, body, headers_on_answers=status != 500)


def test_wsgi_releases_a_lease_when_its_client_abandons_a_streamed_body(lease_server) -> None:  # noqa: ANN001
    serve, remaining = lease_server
    gate = Gate()
    app = SlowApp(gate)
    port = serve(app)

    def write_on() -> None:
        # The two generators wait in the gate; opened, they write until the server finds the
        # connection gone and closes the body (PEP 3333).
        gate.wait_entered(2)
        gate.open()
        for _ in range(2):
            assert app.closed_early.acquire(timeout=PATIENCE), "the server never closed the body"

    released_when_clients_leave(port, "/slow/abandoned", remaining, b"first ", write_on)


def test_wsgi_sends_a_lease_only_to_a_version_3_agent() -> None:
    from test_fake_agent import FakeAgent
    from test_middleware_asgi import leased_decision, leases_on_the_wire, no_lease_for_version_2

    from floodgate import protocol as p

    for version, scenario in ((3, leases_on_the_wire), (2, no_lease_for_version_2)):
        fake = FakeAgent(lambda conn, rid: leased_decision(rid), hello=p.encode(p.Frame(0, p.HelloOk(version))))
        client = Client(fake.path, timeout=2.0)
        # The endpoint as the FastAPI app of that scenario names it.
        mw = FloodgateWSGIMiddleware(SlowApp(Gate()), client=client, user_header="x-user-id", endpoint=lambda e: "/slow/:kind")
        server = WsgiServer(mw)
        try:
            scenario(server.port, fake)
        finally:
            server.close()
            client.close()
            fake.close()


# --- a charge route's concurrency unit (protocol version 3) -------------------------------------------


def held_chat_app(gate: Gate):  # noqa: ANN201
    """``chat_app``, whose requests with X-Hold wait in ``gate`` before answering."""

    def held(environ, start_response):  # noqa: ANN001, ANN202
        if environ.get("HTTP_X_HOLD"):
            gate.enter()
        return chat_app(environ, start_response)

    return held


@pytest.mark.parametrize("how", ["charge_headers", "charge_with"])
def test_wsgi_a_charge_route_holds_one_unit_while_in_flight(make_agent, how: str) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_LEASE_RULES)
    client = Client(agent.socket, timeout=2.0)
    gate = Gate()
    charge = {"charge_headers": CHARGE_HEADERS} if how == "charge_headers" else {"charge_with": {"/v1/chat": TokensReported()}}
    mw = FloodgateWSGIMiddleware(held_chat_app(gate), client=client, user_header="x-user-id", **charge)
    server = WsgiServer(mw, threads=True)
    try:
        charge_route_holds_a_unit(server.port, gate, lambda user, rule: client.peek(f"user:{user}", rule, 0).remaining)
    finally:
        gate.open()
        server.close()
        client.close()


def test_wsgi_a_charge_route_refused_by_its_rate_rule_holds_no_unit(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_LEASE_RULES)
    client = Client(agent.socket, timeout=2.0)
    server = WsgiServer(
        FloodgateWSGIMiddleware(chat_app, client=client, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    )
    try:
        refused_charge_route_holds_nothing(
            server.port,
            lambda user, rule: client.peek(f"user:{user}", rule, 0).remaining,
            lambda user, cost: client.charge(f"user:{user}", "tokens", cost),
        )
    finally:
        server.close()
        client.close()


# --- the request's trace context (protocol version 5) -------------------------------------------------


@pytest.mark.parametrize("version", [5, 4])
def test_wsgi_forwards_the_requests_traceparent(version: int) -> None:
    from test_fake_agent import FakeAgent, hello_ok
    from test_middleware_asgi import leased_decision, traces_on_the_wire

    fake = FakeAgent(lambda conn, rid: leased_decision(rid), hello=hello_ok(version))
    client = Client(fake.path, timeout=2.0)
    mw = FloodgateWSGIMiddleware(chat_app, client=client, user_header="x-user-id", charge_headers=CHARGE_HEADERS)
    server = WsgiServer(mw)
    try:
        traces_on_the_wire(server.port, fake, version)
    finally:
        server.close()
        client.close()
        fake.close()
