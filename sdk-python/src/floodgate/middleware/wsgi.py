"""A WSGI middleware (Flask, Bottle, Pyramid, any WSGI app): one agent check per request, through
the thread-safe :class:`~floodgate.Client`. The same behaviour as the ASGI middleware and the Rust
Layer; see :mod:`floodgate.middleware.asgi`.

A plain WSGI app has no route table the middleware can read, so the endpoint is the request path as
WSGI apps route on it (``SCRIPT_NAME`` + ``PATH_INFO``, percent-decoded by the server) unless
``endpoint`` (a callable taking the environ) says otherwise; the client IP is ``REMOTE_ADDR``, or the
``X-Forwarded-For`` entry a trusted proxy added.

A route in ``charge_headers`` is charged what its response header reports when the server closes the
response (PEP 3333's ``close()``, called once the body is written): a blocking call on the worker's
thread, bounded by the client's timeout (10 ms by default), after the client has the body. A route in
``charge_with`` is charged what its callable returns for ``(status, headers)`` (the status as an int).

On a connection to an agent that speaks protocol version 3, every consuming check carries a fresh
lease; when a concurrency rule holds it, the lease is released at the same moment (``close()``: the
body written, the client gone, or an error while iterating it), or at once when the app raises
instead of returning a body. A check whose answer is not the agent's (it timed out, or the agent went
away mid-call) may have taken its lease all the same: its release is sent at once, without waiting
for an answer (logged at debug if it cannot be sent).

A request let through past the limit of a rule with ``overLimit = "flag"`` (quota mode, protocol
version 6) carries ``X-RateLimit-Over-Quota: <rule ids, comma-separated>``, and the app finds the ids
in ``environ["floodgate.over_quota"]`` (a list; absent within every limit), to route it elsewhere.

The request's W3C ``traceparent`` header goes with its check, its charge and its releases: to an
agent that speaks protocol version 5 they carry that trace context (a header that does not parse is
ignored).

Example::

    # The agent's default socket, or $FLOODGATE_SOCKET; socket="..." names another.
    app = FloodgateWSGIMiddleware(app, user_header="x-user-id")
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple
from urllib.parse import quote

from ..client import Client
from ..errors import FloodgateError
from ._common import (
    CHECK_FAILED,
    IETF_HEADERS,
    OVER_QUOTA_HEADER,
    OVER_QUOTA_KEY,
    RATE_LIMIT_HEADERS,
    ChargeWith,
    Settings,
    charge_now,
    check_leased,
    header_text,
    over_quota_header,
    over_quota_rules,
    rate_limit_headers,
    release_now,
    releases,
    request_check,
    request_traceparent,
    rejection_body,
    response_cost,
    retry_after_seconds,
)

Environ = Dict[str, Any]
StartResponse = Callable[..., Any]

_OURS = frozenset(RATE_LIMIT_HEADERS + IETF_HEADERS)
# With an over-quota header of ours, the app's own of that name goes too.
_OURS_OVER_QUOTA = _OURS | {OVER_QUOTA_HEADER}
# RFC 3986 pchar: what stays unescaped when a path that is not UTF-8 is sent percent-encoded.
_PCHAR = "/:@!$&'()*+,;=-._~"


def environ_header(environ: Environ, name: str) -> Optional[str]:
    """A request header from the environ (``X-User-Id`` is ``HTTP_X_USER_ID``), as the Rust Layer
    reads one."""
    return header_text(environ.get("HTTP_" + name.upper().replace("-", "_")))


def default_endpoint(environ: Environ) -> Optional[str]:
    """The request's path as WSGI apps route on it: ``SCRIPT_NAME`` + ``PATH_INFO``, which the server
    percent-decoded, read as UTF-8 (as Flask and Django read it). Not ``RAW_URI``/``REQUEST_URI``, as
    sent: ``/%6Cogin`` reaches the ``/login`` handler and must count as ``/login``. A path whose bytes
    are not UTF-8 is sent percent-encoded."""
    path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
    try:
        b = path.encode("latin-1")  # WSGI carries the path's bytes as latin-1 text
    except UnicodeEncodeError:
        b = path.encode("utf-8", "surrogatepass")
    try:
        return b.decode("utf-8") or None
    except UnicodeDecodeError:
        return quote(b, safe=_PCHAR) or None


def _peer(environ: Environ) -> Tuple[Optional[str], List[str], bool]:
    # WSGI servers give the connection's address; a proxy fix that rewrites REMOTE_ADDR is the app's
    # own choice (e.g. Werkzeug's ProxyFix), made on purpose.
    xff = environ_header(environ, "x-forwarded-for")
    return environ.get("REMOTE_ADDR"), [xff] if xff else [], False


class FloodgateWSGIMiddleware:
    """The WSGI middleware. It makes a :class:`~floodgate.Client` for the agent at ``socket``
    (default: :func:`~floodgate.default_socket_path`, ``$FLOODGATE_SOCKET`` first, looked up on
    every connection attempt), or uses ``client``. Options as :class:`~floodgate.middleware.FloodgateMiddleware`, with extractors
    taking the WSGI environ. Other keyword arguments configure the client when the middleware makes it.
    """

    def __init__(
        self,
        app: Callable[[Environ, StartResponse], Iterable[bytes]],
        *,
        socket: Optional[str] = None,
        client: Optional[Client] = None,
        endpoint: Optional[Callable[[Environ], Optional[str]]] = None,
        tier: Optional[Callable[[Environ], Optional[str]]] = None,
        user: Optional[Callable[[Environ], Optional[str]]] = None,
        api_key: Optional[Callable[[Environ], Optional[str]]] = None,
        ip: Optional[Callable[[Environ], Optional[str]]] = None,
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
        self.client = client if client is not None else Client(socket, **client_config)

    def attributes(self, environ: Environ):  # noqa: ANN201 - floodgate.Attributes
        """What the request is checked as."""
        return self._check(environ)[0]

    def _check(self, environ: Environ):  # noqa: ANN202 - (Attributes, per-call fail policy, charge)
        return request_check(
            self.settings,
            environ,
            header=environ_header,
            default_endpoint=default_endpoint,
            peer=_peer,
            no_peer="floodgate: no REMOTE_ADDR on the request, so IP rules do not apply (said once)",
        )

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        s = self.settings
        client = self.client
        try:
            attributes, fail, charge = self._check(environ)
            traceparent = request_traceparent(environ, environ_header)
            attributes, decision = check_leased(client, attributes, s.timeout, fail, traceparent)
        except FloodgateError as e:
            CHECK_FAILED.warn("floodgate: the check failed; the request passes: %s", e)
            return self.app(environ, start_response)
        # The release the request owes once its response ends (a concurrency rule holds its lease).
        release = releases(decision, attributes)
        headers = rate_limit_headers(decision, s.ietf)
        if not decision.allowed:
            if release is not None:  # a denied check holds nothing; given back should it ever
                release_now(client, release, s.timeout, traceparent)
            secs = retry_after_seconds(decision)
            body = rejection_body(secs)
            start_response(
                "429 Too Many Requests",
                [
                    ("Retry-After", str(secs)),
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(body))),
                    *[(_title(n), v) for n, v in headers],
                ],
            )
            return [body]
        strip = _OURS
        over = over_quota_rules(decision)
        if over:
            # Quota mode: the app finds the rules in its environ, the client in the header.
            environ[OVER_QUOTA_KEY] = over
            flagged = over_quota_header(over)
            if flagged:
                headers += flagged
                strip = _OURS_OVER_QUOTA
        if not headers and charge is None and release is None:
            return self.app(environ, start_response)
        ours = [(_title(n), v) for n, v in headers]
        # What the response reported (charge routes); the last start_response call's (one with
        # exc_info replaces the headers of the one before).
        owed: List[Optional[int]] = [None]

        def start_with_headers(status: str, response_headers: List[Tuple[str, str]], exc_info: Any = None) -> Any:
            if charge is not None:
                owed[0] = response_cost(charge, _status_code(status), response_headers)
            kept = [(k, v) for k, v in response_headers if k.lower() not in strip] if ours else response_headers
            if exc_info is None:
                return start_response(status, kept + ours)
            return start_response(status, kept + ours, exc_info)

        try:
            body = self.app(environ, start_with_headers)
        except BaseException:
            if release is not None:
                release_now(client, release, s.timeout, traceparent)
            raise
        if charge is None and release is None:
            return body
        owes = [release]

        def settle() -> None:
            # Once, however many times the body is closed.
            held, owes[0] = owes[0], None
            if held is not None:
                release_now(client, held, s.timeout, traceparent)
            cost, owed[0] = owed[0], None
            if cost is not None:
                charge_now(client, attributes, cost, s.timeout, traceparent)

        return SettleOnClose(body, settle)


def _status_code(status: str) -> int:
    """``"429 Too Many Requests"`` as 429 (0 for a status that is not one)."""
    try:
        return int(status.split(" ", 1)[0])
    except ValueError:
        return 0


class SettleOnClose:
    """A response body that releases the request's lease and charges its cost when the server closes
    it (PEP 3333: after the body is written, whether or not the client read it all, and after an
    error while iterating it), after the app's own ``close``."""

    def __init__(self, body: Iterable[bytes], settle: Callable[[], None]) -> None:
        self._body = body
        self._settle = settle

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._body)

    def __len__(self) -> int:
        # The body's own length, where it has one: a server sets Content-Length from a one-part
        # list (wsgiref does), so the client need not wait for the connection to close.
        return len(self._body)  # type: ignore[arg-type]

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._settle()


def _title(name: str) -> str:
    return "-".join(part[:1].upper() + part[1:] for part in name.split("-")).replace("Ratelimit", "RateLimit")
