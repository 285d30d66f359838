"""The Django middleware in a minimal Django project served over real HTTP (Django's WSGI handler
under wsgiref, its ASGI handler under uvicorn), asking a real agent: the endpoint is Django's
resolved route, a 200 with headers, then a 429 with Retry-After and the JSON body; under uvicorn's
proxy headers, X-Forwarded-For does not choose the IP key; a fail-closed rule (or a route's
fail_for) once the agent is killed; a cost the response reports charged when the server closes the
response, under both handlers; a concurrency rule's lease released when the response is closed
(completed, the view raised, a streamed response ended); the request's traceparent header forwarded
with its check, release and charge to a fake agent of version 5; quota mode: a request past a flag
rule's limit let through with X-RateLimit-Over-Quota and the rule ids on the request."""

from __future__ import annotations

import django
import pytest
from conftest import unique
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse
from django.urls import path
from http_util import (
    CHARGE_LEASE_RULES,
    CHARGE_RULES,
    LEASE_RULES,
    MIDDLEWARE_RULES,
    Gate,
    TokensReported,
    UvicornServer,
    WsgiServer,
    charge_route_holds_a_unit,
    charged_after_response,
    check_429,
    fail_closed_after_kill,
    refused_charge_route_holds_nothing,
    request,
    two_in_flight_then_429,
)
from rules import FAIL_MODE_RULES, QUOTA_RULES

from floodgate import Client


def item(request, pk):  # noqa: ANN001, ANN201
    return HttpResponse(f"item {pk}")


def hello(request):  # noqa: ANN001, ANN201
    return HttpResponse("hello")


def model(request):  # noqa: ANN001, ANN201
    """Routes by quota mode: the big model within the quota, a small one past it."""
    over = getattr(request, "floodgate_over_quota", None)
    return HttpResponse(f"small model ({','.join(over)})" if over else "big model")


def chat(request):  # noqa: ANN001, ANN201
    """An LLM route, its tokens (the request's X-Want) in X-LLM-Tokens; a request with X-Hold waits
    in the gate first."""
    if request.headers.get("x-hold"):
        GATE["gate"].enter()
    response = HttpResponse(b"an answer")
    want = request.headers.get("x-want")
    if want is not None:
        response["X-LLM-Tokens"] = want
    return response


# charge_with's callable for Django, named by its dotted path in the settings: it takes the response.
TOKENS = TokensReported(lambda response: response.headers.get("X-LLM-Tokens"))


def tokens(response):  # noqa: ANN001, ANN201
    return TOKENS(response)


# The gate the slow views wait in (a test puts a fresh one here).
GATE = {"gate": Gate()}


def slow(request, kind):  # noqa: ANN001, ANN201
    """Held in flight by the gate: ``wait`` answers once it opens, ``boom`` raises then (Django makes
    it a 500), ``stream`` streams a first part, waits, then its last; ``done`` answers at once."""
    gate = GATE["gate"]
    if kind == "stream":

        def parts():  # noqa: ANN202
            yield b"first "
            gate.enter()
            yield b"last"

        return StreamingHttpResponse(parts())
    if kind != "done":
        gate.enter()
    if kind == "boom":
        raise RuntimeError("boom")
    return HttpResponse(b"done")


urlpatterns = [
    path("api/items/<int:pk>", item),
    path("api/hello", hello),
    path("login", hello),
    path("v1/chat", chat),
    path("slow/<str:kind>", slow),
    path("v1/model", model),
]


def configure(agent, **more: object) -> None:  # noqa: ANN001
    """Django's settings for a project whose middleware asks ``agent`` (a handler made after this
    builds its middleware with them), with ``more`` keys of ``FLOODGATE``."""
    conf = {
        "socket": agent.socket,
        "timeout": 2.0,
        "user_header": "X-User-Id",
        # Costs by Django route, in Django's spelling or the agent's.
        "costs": {"api/items/<int:pk>": 4, "/api/hello": 1},
        **more,
    }
    if settings.configured:
        settings.FLOODGATE = conf
    else:
        settings.configure(
            DEBUG=False,
            ALLOWED_HOSTS=["*"],
            ROOT_URLCONF=__name__,
            SECRET_KEY="test",
            MIDDLEWARE=["floodgate.middleware.django.FloodgateDjangoMiddleware"],
            INSTALLED_APPS=[],
            FLOODGATE=conf,
        )
        django.setup()


@pytest.fixture
def django_app(make_agent):  # noqa: ANN001, ANN201
    configure(make_agent(MIDDLEWARE_RULES))
    from django.core.wsgi import get_wsgi_application

    server = WsgiServer(get_wsgi_application())
    yield server
    server.close()


def test_django_route_costs_headers_and_429(django_app) -> None:  # noqa: ANN001
    port = django_app.port
    user = [("X-User-Id", unique("u"))]
    r = request(port, "GET", "/api/items/41", user)
    assert (r.status, r.body) == (200, b"item 41")
    assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (6, 2), "route api/items/<int:pk> costs 4"
    r = request(port, "GET", "/api/hello", user)
    assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1)
    # An unresolved path is checked as itself: Django's 404 carries the headers too.
    r = request(port, "GET", "/api/nowhere", user)
    assert (r.status, r.num("x-ratelimit-remaining")) == (404, 0)
    check_429(request(port, "GET", "/api/hello", user), limit=6)
    # The rejection did not reach the view, and another user passes.
    assert request(port, "GET", "/api/hello", [("X-User-Id", unique("v"))]).status == 200


def test_django_under_uvicorn_proxy_headers_does_not_let_a_client_choose_its_ip_key(make_agent) -> None:  # noqa: ANN001, E501
    configure(make_agent(MIDDLEWARE_RULES))
    from django.core.asgi import get_asgi_application

    # uvicorn's defaults: proxy headers on for 127.0.0.1 and ::1, so REMOTE_ADDR is the header's entry.
    server = UvicornServer(get_asgi_application(), proxy_headers=True)
    try:

        def login(xff: str):  # noqa: ANN202
            return request(server.port, "POST", "/login", [("X-Forwarded-For", xff)])

        r = login("9.9.9.9")
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1)
        r = login("8.8.8.8")
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 0), "another address written is not another client"
        check_429(login("7.7.7.7"), limit=2)
    finally:
        server.close()


@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
def test_django_quota_mode_lets_a_request_through_flagged_for_the_view(make_agent, handler: str) -> None:  # noqa: ANN001, E501
    configure(make_agent(QUOTA_RULES))
    if handler == "wsgi":
        from django.core.wsgi import get_wsgi_application

        server = WsgiServer(get_wsgi_application())
    else:
        from django.core.asgi import get_asgi_application

        server = UvicornServer(get_asgi_application())
    user = [("X-User-Id", unique("u"))]
    try:
        r = request(server.port, "GET", "/v1/model", user)
        assert (r.status, r.body) == (200, b"big model") and "x-ratelimit-over-quota" not in r.headers
        for _ in range(2):
            r = request(server.port, "GET", "/v1/model", user)
            assert (r.status, r.body) == (200, b"small model (premium)"), "past the quota, let through"
            assert r.headers["x-ratelimit-over-quota"] == "premium"
            assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (1, 0)
    finally:
        server.close()


def test_django_fail_closed_rules_outlive_a_killed_agent(make_agent) -> None:  # noqa: ANN001
    from django.core.wsgi import get_wsgi_application

    from floodgate.middleware import django as fg_django

    agent = make_agent(FAIL_MODE_RULES)
    # Two handlers, each building its middleware from the settings of the moment; one client per
    # socket is shared by both (the middleware's one connection per process).
    configure(agent)
    default = get_wsgi_application()
    configure(agent, fail_for={"login": "open"})  # Django's spelling of the route /login
    per_route = get_wsgi_application()

    def dispatch(environ, start_response):  # noqa: ANN001, ANN202
        chosen = per_route if environ.get("HTTP_X_VARIANT") == "fail-for" else default
        return chosen(environ, start_response)

    server = WsgiServer(dispatch)
    try:
        fail_closed_after_kill(server.port, agent, fg_django._clients[agent.socket])
    finally:
        server.close()


@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
def test_django_charges_what_the_response_reports_after_it(make_agent, handler: str) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_RULES)
    # The route in Django's spelling; the agent's (/v1/chat) works too.
    configure(agent, charge_headers={"v1/chat": "X-LLM-Tokens"})
    if handler == "wsgi":
        from django.core.wsgi import get_wsgi_application

        server = WsgiServer(get_wsgi_application())
    else:
        from django.core.asgi import get_asgi_application

        server = UvicornServer(get_asgi_application())
    reader = Client(agent.socket, timeout=2.0)
    try:
        r = request(server.port, "POST", "/v1/chat", [("X-User-Id", unique("u")), ("X-Want", "7")])
        assert (r.status, r.body) == (200, b"an answer")
        charged_after_response(server.port, lambda user: reader.peek(f"user:{user}", "tokens", 0).remaining)
    finally:
        server.close()
        reader.close()


@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
def test_django_charges_what_a_callable_makes_of_the_response(make_agent, handler: str) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_RULES)
    configure(agent, charge_with={"v1/chat": f"{__name__}.tokens"})
    TOKENS.calls.clear()
    if handler == "wsgi":
        from django.core.wsgi import get_wsgi_application

        server = WsgiServer(get_wsgi_application())
    else:
        from django.core.asgi import get_asgi_application

        server = UvicornServer(get_asgi_application())
    reader = Client(agent.socket, timeout=2.0)
    try:
        charged_after_response(server.port, lambda user: reader.peek(f"user:{user}", "tokens", 0).remaining)
        assert len(TOKENS.calls) == 11 and all(isinstance(r, HttpResponse) for (r,) in TOKENS.calls)
    finally:
        server.close()
        reader.close()


@pytest.mark.parametrize(
    "route, status, body",
    [("/slow/wait", 200, b"done"), ("/slow/boom", 500, None), ("/slow/stream", 200, b"first last")],
    ids=["completed", "view raised", "stream ended"],
)
def test_django_releases_a_lease_when_the_response_is_closed(make_agent, route: str, status: int, body) -> None:  # noqa: ANN001
    import logging

    from django.core.wsgi import get_wsgi_application

    agent = make_agent(LEASE_RULES)
    configure(agent)
    gate = GATE["gate"] = Gate()
    server = WsgiServer(get_wsgi_application(), threads=True)
    reader = Client(agent.socket, timeout=2.0)
    # Django logs the view's error (as it should); not this test's business.
    quiet = logging.getLogger("django.request")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        two_in_flight_then_429(
            server.port, route, gate, lambda user, rule: reader.peek(f"user:{user}", rule, 0).remaining, status, body
        )
    finally:
        quiet.level = level
        server.close()
        reader.close()


def test_django_a_charge_route_holds_one_unit_while_in_flight(make_agent) -> None:  # noqa: ANN001
    from django.core.wsgi import get_wsgi_application

    # WSGI only: Django's ASGI handler runs sync views one at a time, so two could not wait in the gate.
    agent = make_agent(CHARGE_LEASE_RULES)
    configure(agent, charge_headers={"v1/chat": "X-LLM-Tokens"})
    gate = GATE["gate"] = Gate()
    server = WsgiServer(get_wsgi_application(), threads=True)
    reader = Client(agent.socket, timeout=2.0)
    try:
        charge_route_holds_a_unit(server.port, gate, lambda user, rule: reader.peek(f"user:{user}", rule, 0).remaining)
    finally:
        gate.open()
        server.close()
        reader.close()


@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
def test_django_a_charge_route_refused_by_its_rate_rule_holds_no_unit(make_agent, handler: str) -> None:  # noqa: ANN001
    agent = make_agent(CHARGE_LEASE_RULES)
    configure(agent, charge_headers={"v1/chat": "X-LLM-Tokens"})
    if handler == "wsgi":
        from django.core.wsgi import get_wsgi_application

        server = WsgiServer(get_wsgi_application())
    else:
        from django.core.asgi import get_asgi_application

        server = UvicornServer(get_asgi_application())
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


@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
def test_django_forwards_the_requests_traceparent(handler: str) -> None:
    from types import SimpleNamespace

    from test_fake_agent import FakeAgent, hello_ok
    from test_middleware_asgi import leased_decision, traces_on_the_wire

    fake = FakeAgent(lambda conn, rid: leased_decision(rid), hello=hello_ok(5))
    configure(SimpleNamespace(socket=fake.path), charge_headers={"v1/chat": "X-LLM-Tokens"})
    if handler == "wsgi":
        from django.core.wsgi import get_wsgi_application

        server = WsgiServer(get_wsgi_application())
    else:
        from django.core.asgi import get_asgi_application

        server = UvicornServer(get_asgi_application())
    try:
        traces_on_the_wire(server.port, fake, 5)
    finally:
        server.close()
        fake.close()
