"""A thin Django middleware: the WSGI middleware's behaviour, with the endpoint taken from Django's
URL resolver (``items/<int:pk>`` is sent as ``/items/:pk``; an unmatched path as itself).

Configure it in ``settings.py``::

    MIDDLEWARE = ["floodgate.middleware.django.FloodgateDjangoMiddleware", ...]
    FLOODGATE = {
        # "socket": a path; by default the agent's default socket, or $FLOODGATE_SOCKET
        "user_header": "x-authenticated-user",  # set by your auth hop, or "user": callable(request)
        "trust_proxies": ["10.0.0.0/8"],
        "costs": {"/api/search": 5},
        "fail_for": {"login": "closed"},  # per route while the agent is away, keyed as costs
        "charge_headers": {"v1/chat": "x-llm-tokens"},  # a cost the response reports, keyed as costs
        "charge_with": {"v1/embed": "myapp.costs.embed_cost"},  # callable(response) -> int | None
    }

Every key of ``FLOODGATE`` is a keyword of :class:`~floodgate.middleware.FloodgateWSGIMiddleware`;
extractors (``endpoint``, ``tier``, ``user``, ``api_key``, ``ip``) take the Django request and may be
given as dotted paths, and so may the callables of ``charge_with``, which take the ``HttpResponse``.
It is a synchronous middleware (Django adapts it under ASGI).

A route in ``charge_headers`` (or ``charge_with``) is charged what its response header reports (what
its callable returns) when the server closes the response (Django's end of request: the WSGI server,
or Django's ASGI handler once the body is sent or the client is gone), a blocking call bounded by the
client's timeout after the client has the body. On a connection to an agent that speaks protocol
version 3, a concurrency rule's lease taken by the request is released at the same moment, or at
once when the view raises past Django's own error handling; the lease of a check whose answer is not
the agent's (late, or the agent gone) is released at once, without waiting for an answer. The
request's ``traceparent`` header goes with its check, charge and releases (protocol version 5).

A request let through past the limit of a rule with ``overLimit = "flag"`` (quota mode, protocol
version 6) carries ``X-RateLimit-Over-Quota: <rule ids, comma-separated>``, and its view finds the
ids in ``request.floodgate_over_quota`` (a list; absent within every limit:
``getattr(request, "floodgate_over_quota", [])``), to route it elsewhere.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from ..client import Client
from ..errors import FloodgateError
from ..protocol import Attributes
from ._common import (
    CHECK_FAILED,
    Settings,
    called_cost,
    charge_now,
    check_leased,
    header_text,
    over_quota_header,
    over_quota_rules,
    rate_limit_headers,
    release_now,
    releases,
    reported_cost,
    request_check,
    request_traceparent,
    rejection_body,
    retry_after_seconds,
    scope_took_forwarded_for,
)

_CONVERTER = re.compile(r"<(?:[^>:]+:)?([^>]+)>")
_clients: Dict[Optional[str], Client] = {}
_clients_lock = threading.Lock()


def django_route_name(route: str) -> str:
    """A Django route as the agent sees it: ``items/<int:pk>`` becomes ``/items/:pk``."""
    r = _CONVERTER.sub(lambda m: ":" + m.group(1), route)
    return r if r.startswith("/") else "/" + r


def default_endpoint(request: HttpRequest) -> Optional[str]:
    """The route Django resolves the request to, else its path."""
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
        if match.route:
            return django_route_name(match.route)
    except Resolver404:
        pass
    return request.path or None


def _shared_client(socket: Optional[str], config: Dict[str, Any]) -> Client:
    # One connection per process, however many times Django builds the middleware.
    with _clients_lock:
        c = _clients.get(socket)
        if c is None:
            c = _clients[socket] = Client(socket, **config)
        return c


def _callable(v: Any) -> Optional[Callable[..., Optional[str]]]:
    if v is None:
        return None
    return import_string(v) if isinstance(v, str) else v


def _header(request: HttpRequest, name: str) -> Optional[str]:
    return header_text(request.META.get("HTTP_" + name.upper().replace("-", "_")))


def _peer(request: HttpRequest) -> Tuple[Optional[str], List[str], bool]:
    xff = header_text(request.META.get("HTTP_X_FORWARDED_FOR"))
    # Under ASGI, REMOTE_ADDR is the server's scope["client"], which uvicorn's proxy headers may
    # have taken from X-Forwarded-For; a WSGI server gives the connection's address.
    scope = getattr(request, "scope", None)
    from_header = isinstance(scope, dict) and scope_took_forwarded_for(scope)
    return request.META.get("REMOTE_ADDR"), [xff] if xff else [], from_header


class FloodgateDjangoMiddleware:
    """Asks the agent once per request; 429 with ``Retry-After`` on a rejection, ``X-RateLimit-*``
    headers on every response a rule applied to."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        conf = dict(getattr(settings, "FLOODGATE", {}) or {})
        # None: the client looks the socket up itself (default_socket_path) on every attempt.
        socket = conf.pop("socket", None)
        client = conf.pop("client", None)
        options: Dict[str, Any] = {
            k: conf.pop(k)
            for k in (
                "tier_header",
                "user_header",
                "api_key_header",
                "trust_proxies",
                "costs",
                "ietf_headers",
                "timeout",
                "fail",
                "fail_for",
                "charge_headers",
                "charge_with",
            )
            if k in conf
        }
        if "charge_with" in options:
            options["charge_with"] = {k: _callable(v) for k, v in dict(options["charge_with"]).items()}
        for routes in ("costs", "fail_for", "charge_headers", "charge_with"):
            if routes in options:
                # Routes in Django's spelling (api/items/<int:pk>) or the agent's (/api/items/:pk).
                options[routes] = {
                    (django_route_name(k) if "<" in k or not k.startswith("/") else k): v
                    for k, v in dict(options[routes]).items()
                }
        extractors: Dict[str, Any] = {k: _callable(conf.pop(k, None)) for k in ("endpoint", "tier", "user", "api_key", "ip")}
        self.settings = Settings(**options, **extractors)
        self.client: Client = client if client is not None else _shared_client(socket, conf)

    def attributes(self, request: HttpRequest):  # noqa: ANN201 - floodgate.Attributes
        """What the request is checked as."""
        return self._check(request)[0]

    def _check(self, request: HttpRequest):  # noqa: ANN202 - (Attributes, per-call fail policy, charge)
        return request_check(
            self.settings,
            request,
            header=_header,
            default_endpoint=default_endpoint,
            peer=_peer,
            no_peer="floodgate: no REMOTE_ADDR on the request, so IP rules do not apply (said once)",
        )

    def __call__(self, request: HttpRequest) -> HttpResponse:
        s = self.settings
        client = self.client
        try:
            attributes, fail, charge = self._check(request)
            traceparent = request_traceparent(request, _header)
            attributes, decision = check_leased(client, attributes, s.timeout, fail, traceparent)
        except FloodgateError as e:
            CHECK_FAILED.warn("floodgate: the check failed; the request passes: %s", e)
            return self.get_response(request)
        # The release the request owes once its response ends (a concurrency rule holds its lease).
        release = releases(decision, attributes)
        over = over_quota_rules(decision)
        if over:
            # Quota mode: the view finds the rules on the request, the client in the header.
            request.floodgate_over_quota = over  # type: ignore[attr-defined]
        if decision.allowed:
            try:
                response = self.get_response(request)
            except BaseException:
                # Past Django's own handling (which makes a view's error a 500 response).
                if release is not None:
                    release_now(client, release, s.timeout, traceparent)
                raise
            cost = None
            if isinstance(charge, str):
                cost = reported_cost(charge, response.headers.get(charge))
            elif charge is not None:
                cost = called_cost(charge, response)
            if cost is not None or release is not None:
                self._settle_on_close(response, attributes, cost, release, traceparent)
        else:
            if release is not None:  # a denied check holds nothing; given back should it ever
                release_now(client, release, s.timeout, traceparent)
            secs = retry_after_seconds(decision)
            response = HttpResponse(rejection_body(secs), status=429, content_type="application/json")
            response["Retry-After"] = str(secs)
        for name, value in rate_limit_headers(decision, s.ietf) + over_quota_header(over):
            response[name] = value
        return response

    def _settle_on_close(
        self,
        response: HttpResponse,
        attributes: Attributes,
        cost: Optional[int],
        release: Optional[Attributes],
        traceparent: Optional[str] = None,
    ) -> None:
        """Releases the request's lease (``release``) and charges ``cost`` when the server closes
        ``response`` (after its body is sent, or once the client is gone), after Django's own
        ``close`` (which ends the request: files closed, ``request_finished`` sent); both with the
        request's ``traceparent``."""
        close = response.close
        timeout = self.settings.timeout
        client = self.client
        owes = [(cost, release)]

        def close_then_settle() -> None:
            try:
                close()
            finally:
                # Once, however many times the response is closed.
                if owes:
                    owed, held = owes.pop()
                    if held is not None:
                        release_now(client, held, timeout, traceparent)
                    if owed is not None:
                        charge_now(client, attributes, owed, timeout, traceparent)

        response.close = close_then_settle  # type: ignore[method-assign]
