"""A pure ASGI middleware (Starlette, FastAPI, any ASGI app): one agent check per HTTP request.

Every response a rule applied to carries ``X-RateLimit-Limit``, ``X-RateLimit-Remaining`` and
``X-RateLimit-Reset`` of the binding rule; a rejection is a 429 with ``Retry-After`` (whole seconds,
rounded up, at least 1) and ``{"error":"rate_limited","retryAfter":N}``. Rules in log mode never
block and never show. When the agent cannot answer, the route's ``fail_for`` policy (or ``fail``)
decides when given; else a request a rule the agent lists as fail-closed would match is a 429 with
that rule's headers; else the client's fail policy decides (open by default: the request passes
without headers).

The endpoint is the matched route when the app is a Starlette/FastAPI app (``/items/{id}`` is sent
as ``/items/:id``), else the path the app routes on (``scope["path"]``, percent-decoded by the
server, so ``/%6Cogin`` is ``/login`` as it is to the app). The client IP is the peer
(``scope["client"]``), or the ``X-Forwarded-For`` entry a trusted proxy added; a client the server
itself took from that header (uvicorn's proxy headers) is not believed unless ``trust_proxies`` is
set. Tier, user and API key are read only where configured: a header the client writes itself would
let it pick its tier or spend another user's quota, so ``user_header`` is for a header an
authenticating hop in front of this service sets.

A request let through past the limit of a rule with ``overLimit = "flag"`` (quota mode, protocol
version 6) carries ``X-RateLimit-Over-Quota: <rule ids, comma-separated>``, and its handler finds
the ids in ``scope["floodgate.over_quota"]`` (a list; absent within every limit), to route it
elsewhere: a cheaper model, a fallback backend.

A handler that raises before its response started gets the 500 it would have got (``Internal Server
Error``, as Starlette's and uvicorn's) with the limiter's headers, and the exception goes on to the
server's log. An app whose 500 is its own (a Starlette handler for 500 or ``Exception``, or
``debug``) keeps it as it was: Starlette sends it from outside every added middleware, so wrap the
app instead (``app = FloodgateMiddleware(app, ...)``) to have the headers on it too.

A route in ``charge_headers`` costs what its response says (LLM tokens, bytes): the request is a peek
of cost 0, refused only by a rule already past its limit, and once the response's last body part is
sent, the number in that response header is charged with the request's attributes, in the request's
own task (bounded by the client's timeout), so the client has its response before the charge goes. A
route in ``charge_with`` is charged what its callable returns for the response's status and headers.

The request's W3C ``traceparent`` header goes with its check, its charge and its releases: to an
agent that speaks protocol version 5 they carry that trace context, so that the agent's spans of them
(an agent started with ``--otlp-endpoint``) are children of the caller's span. A header that does not
parse is ignored.

On a connection to an agent that speaks protocol version 3, every consuming check carries a fresh
lease; when a concurrency rule holds it, the lease is released (the same attributes, cost and lease,
mode release) once the response's last body part is sent, or the app returns or raises without one
(a client gone mid-response, an abandoned stream), in a task of its own, so that neither the
response nor a cancelled request holds it back. A check whose answer is not the agent's (it timed
out, or the agent went away mid-call), or whose request is cancelled while it waits, may have taken
its lease all the same: its release is sent at once, without waiting for an answer (logged at debug
if it cannot be sent).

Example::

    app = FastAPI()
    # The agent's default socket, or $FLOODGATE_SOCKET; socket="..." names another.
    app.add_middleware(FloodgateMiddleware, user_header="x-user-id")
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Dict, List, Mapping, MutableMapping, Optional, Set, Tuple

from ..aio import AsyncClient
from ..errors import FloodgateError, UnsupportedByAgent
from ..lease import release_failed, release_taken
from ..protocol import Attributes
from ._common import (
    CHECK_FAILED,
    IETF_HEADERS,
    OVER_QUOTA_HEADER,
    OVER_QUOTA_KEY,
    RATE_LIMIT_HEADERS,
    ChargeWith,
    Settings,
    charge_attributes,
    charge_failed,
    charge_taken,
    header_text,
    over_quota_header,
    over_quota_rules,
    rate_limit_headers,
    release_unanswered,
    releases,
    request_check,
    request_traceparent,
    rejection_body,
    response_cost,
    retry_after_seconds,
    route_name,
    scope_took_forwarded_for,
    with_lease,
    without_lease,
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_OURS = frozenset(n.encode() for n in RATE_LIMIT_HEADERS + IETF_HEADERS)
# With an over-quota header of ours, the app's own of that name goes too.
_OURS_OVER_QUOTA = _OURS | {OVER_QUOTA_HEADER.encode()}


def scope_header(scope: Scope, name: str) -> Optional[str]:
    """The first value of a request header (``name`` lower-case), as the Rust Layer reads it."""
    key = name.encode("latin-1")
    for k, v in scope.get("headers") or ():
        if k.lower() == key:
            return header_text(v)
    return None


def _peer(scope: Scope) -> Tuple[Optional[str], List[str], bool]:
    peer = scope.get("client")
    return (peer[0] if peer else None), _all_headers(scope, b"x-forwarded-for"), scope_took_forwarded_for(scope)


def _all_headers(scope: Scope, name: bytes) -> List[str]:
    out = []
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            t = header_text(v)
            if t is not None:
                out.append(t)
    return out


_flat_cache: Dict[int, Tuple[Any, int, Any]] = {}


def _flatten(routes: Any) -> Any:
    """FastAPI (since 0.16x) keeps an included router as one internal route; its public
    ``iter_route_contexts`` lists the routes it holds, with their full paths. Cached per route list
    (and its length, so routes added later are seen)."""
    hit = _flat_cache.get(id(routes))
    if hit is not None and hit[0] is routes and hit[1] == len(routes):
        return hit[2]
    flat = routes
    try:
        from fastapi.routing import iter_route_contexts  # type: ignore[attr-defined]

        flat = list(iter_route_contexts(routes))
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - an older or newer FastAPI: walk the routes as they are
        pass
    if isinstance(routes, list):
        if len(_flat_cache) > 256:
            _flat_cache.clear()
        _flat_cache[id(routes)] = (routes, len(routes), flat)
    return flat


def _match_routes(routes: Any, scope: Scope, prefix: str) -> Optional[str]:
    from starlette.routing import Match  # only reached for Starlette apps

    partial = None
    for route in _flatten(routes or ()):
        try:
            match, child = route.matches(scope)
        except Exception:  # noqa: BLE001 - a route that cannot be matched is not ours to fix
            continue
        if match == Match.NONE:
            continue
        path = prefix + (getattr(route, "path", "") or "")
        sub = getattr(route, "routes", None)  # Mount and Host: the routes inside
        if sub:
            inner = _match_routes(sub, {**scope, **child}, path)
            found = inner if inner is not None else path
        else:
            found = path
        if match == Match.FULL:
            return found
        if partial is None:
            partial = found
    return partial


def starlette_route(scope: Scope, app: Any = None) -> Optional[str]:
    """The route template a Starlette/FastAPI app will route this request to (``None`` if the app is
    not one, or nothing matches). Mounted apps and included routers give their full template. The
    app is ``scope["app"]`` (set once the request is inside the app), else ``app`` (the one this
    middleware wraps, when it wraps the whole app)."""
    app = scope.get("app") or app
    router = getattr(app, "router", app)
    routes = getattr(router, "routes", None)
    if not routes:
        return None
    try:
        return _match_routes(routes, scope, "")
    except ImportError:
        return None


def default_endpoint(scope: Scope, app: Any = None) -> Optional[str]:
    """The matched route (Starlette/FastAPI), else the path as ASGI apps route on it: ``path``,
    percent-decoded by the server (``raw_path``, as sent, would let ``/%6Cogin`` reach the ``/login``
    handler of an app routing on ``path`` without counting as ``/login``)."""
    route = starlette_route(scope, app)
    if route:
        return route_name(route)
    path = scope.get("path") or ""
    root = scope.get("root_path") or ""
    if root and path != root and not path.startswith(root + "/"):
        # A server older than the ASGI spec's "path includes root_path".
        path = root + path
    return path or None


class FloodgateMiddleware:
    """The ASGI middleware. It makes its own :class:`~floodgate.AsyncClient` on first use, in the
    server's event loop, for the agent at ``socket`` (default: :func:`~floodgate.default_socket_path`,
    ``$FLOODGATE_SOCKET`` first, looked up on every connection attempt), or uses ``client``.

    Options (all keyword): ``user_header`` / ``tier_header`` / ``api_key_header`` (read a header an
    authenticating hop sets), or ``user`` / ``tier`` / ``api_key`` (callables taking the ASGI scope,
    e.g. reading what your auth middleware put in ``scope["state"]``); ``endpoint`` and ``ip``
    replace the default extractors; ``trust_proxies`` (CIDR blocks whose ``X-Forwarded-For`` entries
    are believed); ``costs`` (``{route: cost}``, 1 elsewhere); ``ietf_headers``; ``timeout`` and
    ``fail`` (per-call overrides of the client's: a ``fail`` given decides alone for every route,
    over the agent's fail-closed rules); ``fail_for`` (``{route: "open" | "closed"}``, keyed as
    ``costs``: that route's per-call fail policy, over ``fail``); ``charge_headers`` (``{route:
    header}``, keyed as ``costs``: a request to that route is a peek of cost 0, and the number its
    response's header reports is charged after the response); ``charge_with`` (``{route:
    callable}``, keyed as ``costs``: the same, charging what ``callable(status, headers)`` returns,
    an int or ``None``, the headers as ``(name, value)`` text pairs). Other keyword arguments
    configure the client (:class:`~floodgate.ClientConfig` fields) when the middleware makes it.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        socket: Optional[str] = None,
        client: Optional[AsyncClient] = None,
        endpoint: Optional[Callable[[Scope], Optional[str]]] = None,
        tier: Optional[Callable[[Scope], Optional[str]]] = None,
        user: Optional[Callable[[Scope], Optional[str]]] = None,
        api_key: Optional[Callable[[Scope], Optional[str]]] = None,
        ip: Optional[Callable[[Scope], Optional[str]]] = None,
        tier_header: Optional[str] = None,
        user_header: Optional[str] = None,
        api_key_header: Optional[str] = None,
        trust_proxies: Any = (),
        costs: Optional[Dict[str, int]] = None,
        ietf_headers: bool = False,
        timeout: Optional[float] = None,
        fail: Optional[str] = None,
        fail_for: Optional[Dict[str, str]] = None,
        charge_headers: Optional[Dict[str, str]] = None,
        charge_with: Optional[Dict[str, ChargeWith]] = None,
        **client_config: Any,
    ) -> None:
        self.app = app
        self.settings = Settings(
            endpoint=endpoint,
            tier=tier,
            user=user,
            api_key=api_key,
            ip=ip,
            tier_header=tier_header,
            user_header=user_header,
            api_key_header=api_key_header,
            trust_proxies=trust_proxies,
            costs=costs,
            ietf_headers=ietf_headers,
            timeout=timeout,
            fail=fail,
            fail_for=fail_for,
            charge_headers=charge_headers,
            charge_with=charge_with,
        )
        self._socket = socket
        self._client_config = client_config
        self._client = client
        self._own_client = client is None
        self._starting: Optional[asyncio.Task] = None
        self._client_loop: Optional[asyncio.AbstractEventLoop] = None

    async def _get_client(self) -> AsyncClient:
        if not self._own_client:
            return self._client  # type: ignore[return-value]
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # First request (or a new event loop): our own client, started once; requests that
            # arrive meanwhile wait for the same start (at most connect_timeout).
            self._client = AsyncClient(self._socket, **self._client_config)
            self._client_loop = loop
            self._starting = loop.create_task(self._client.start())
        starting = self._starting
        if starting is not None and not starting.done():
            await asyncio.shield(starting)
        return self._client

    def attributes(self, scope: Scope):  # noqa: ANN201 - floodgate.Attributes
        """What the request is checked as."""
        return self._check(scope)[0]

    def _check(self, scope: Scope):  # noqa: ANN202 - (Attributes, per-call fail policy, charge)
        return request_check(
            self.settings,
            scope,
            header=scope_header,
            default_endpoint=lambda sc: default_endpoint(sc, self.app),
            peer=_peer,
            no_peer="floodgate: no peer address on the request, so IP rules do not apply (said once)",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        s = self.settings
        try:
            attributes, fail, charge = self._check(scope)
            traceparent = request_traceparent(scope, scope_header)
            client = await self._get_client()
            attributes = with_lease(attributes, getattr(client, "protocol_version", None))
            try:
                try:
                    decision = await client.check_request(
                        attributes, timeout=s.timeout, fail=fail, traceparent=traceparent
                    )
                except UnsupportedByAgent as e:
                    attributes = without_lease(e, attributes)
                    decision = await client.check_request(
                        attributes, timeout=s.timeout, fail=fail, traceparent=traceparent
                    )
            except asyncio.CancelledError:
                # The request went away with its check in flight: the agent may take the lease.
                release_unanswered(client, attributes, traceparent)
                raise
            if not decision.from_agent:
                # Late or lost: the agent may have taken the lease all the same (nothing held when
                # it answered; else the release is owed below).
                release_unanswered(client, attributes, traceparent)
        except FloodgateError as e:
            # Values are made wire-safe, so this is a bug or an SDK/agent mismatch (e.g. more than 16
            # rules matched), not something a client can cause: the request passes.
            CHECK_FAILED.warn("floodgate: the check failed; the request passes: %s", e)
            await self.app(scope, receive, send)
            return
        # The release the request owes once its response ends (a concurrency rule holds its lease).
        release = releases(decision, attributes)
        headers = [(n.encode(), v.encode()) for n, v in rate_limit_headers(decision, s.ietf)]
        if not decision.allowed:
            if release is not None:  # a denied check holds nothing; given back should it ever
                _release_soon(client, release, s.timeout, traceparent)
            secs = retry_after_seconds(decision)
            body = rejection_body(secs)
            await send(
                {
                    "type": "http.response.start",
                    "status": 429,
                    "headers": [
                        (b"retry-after", str(secs).encode()),
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        *headers,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        ours = _OURS
        over = over_quota_rules(decision)
        if over:
            # Quota mode: the handler finds the rules in its scope (a copy: the ASGI spec has a
            # middleware's changes stay out of the caller's scope), the client in the header.
            scope = dict(scope)
            scope[OVER_QUOTA_KEY] = over
            flagged = over_quota_header(over)
            if flagged:
                headers += [(n.encode(), v.encode()) for n, v in flagged]
                ours = _OURS_OVER_QUOTA
        if not headers and charge is None and release is None:
            await self.app(scope, receive, send)
            return

        started = False
        # What the response reported (charge routes): charged once its last body part is sent, or
        # when the app returns without sending one (the work was done, whoever got the answer).
        owed: Optional[int] = None

        def let_go() -> None:
            # Once: after the last body part, else when the app returns, raises or is cancelled.
            nonlocal release
            if release is not None:
                held, release = release, None
                _release_soon(client, held, s.timeout, traceparent)

        async def settle() -> None:
            nonlocal owed
            if owed is not None:
                cost, owed = owed, None
                try:
                    charged = charge_attributes(attributes, cost)
                    charge_taken(
                        await client.check_request(charged, timeout=s.timeout, fail="open", traceparent=traceparent)
                    )
                except Exception as e:  # noqa: BLE001 - the response is sent; a charge never fails it
                    charge_failed(e)

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            nonlocal started, owed
            kind = message.get("type")
            if kind == "http.response.start":
                started = True
                if charge is not None:
                    owed = response_cost(charge, int(message.get("status", 200)), message.get("headers") or ())
                if headers:
                    message = dict(message)
                    kept: List[Tuple[bytes, bytes]] = [
                        (k, v) for k, v in message.get("headers") or () if bytes(k).lower() not in ours
                    ]
                    message["headers"] = kept + headers
            await send(message)
            if kind == "http.response.body" and not message.get("more_body", False):
                let_go()
                await settle()

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:
            # The 500 for this error would be sent from outside this middleware (Starlette's
            # ServerErrorMiddleware wraps every added middleware; a plain app's server answers
            # itself), without the headers. The same 500, sent here with them; the error goes on,
            # so that the server logs it (and, the response having started, sends nothing more).
            if not started and not _own_error_response(scope):
                try:
                    await send_with_headers(
                        {
                            "type": "http.response.start",
                            "status": 500,
                            "headers": [
                                (b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(_ERROR_BODY)).encode()),
                            ],
                        }
                    )
                    await send_with_headers({"type": "http.response.body", "body": _ERROR_BODY})
                except Exception:  # noqa: BLE001 - the client is gone; the app's error is the one to raise
                    pass
            raise
        finally:
            let_go()
            await settle()


# Releases under way: the loop keeps only weak references to its tasks.
_releasing: Set["asyncio.Task[None]"] = set()


def _release_soon(
    client: AsyncClient, release: Attributes, timeout: Optional[float], traceparent: Optional[str] = None
) -> None:
    """Sends ``release`` in a task of its own: it holds back neither the request's task nor the
    app's return, and a request cancelled meanwhile (its cancel scope would cancel every await in
    it) still gives its units back."""
    task = asyncio.get_running_loop().create_task(_release(client, release, timeout, traceparent))
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)


async def _release(
    client: AsyncClient, release: Attributes, timeout: Optional[float], traceparent: Optional[str] = None
) -> None:
    try:
        d = await client.check_request(release, timeout=timeout, fail="open", traceparent=traceparent)
        release_taken(d, release.lease)
    except Exception as e:  # noqa: BLE001 - the response is sent; a release never fails it
        release_failed(e, release.lease)


_ERROR_BODY = b"Internal Server Error"


def _own_error_response(scope: Scope) -> bool:
    """Whether the Starlette app the request went into answers errors its own way (a handler for 500
    or ``Exception``, or the debug page): then its 500, not ours, is the one the client gets."""
    app = scope.get("app")
    if getattr(app, "debug", False) is True:
        return True
    handlers = getattr(app, "exception_handlers", None)
    return isinstance(handlers, Mapping) and (500 in handlers or Exception in handlers)
