"""Real HTTP servers in threads for the middleware tests (uvicorn for ASGI, wsgiref for WSGI, both on a
free loopback port) and a plain HTTP/1.1 client."""

from __future__ import annotations

import asyncio
import http.client
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from conftest import eventually, unique


class Response:
    def __init__(self, status: int, headers: Dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def num(self, name: str) -> int:
        v = self.headers.get(name.lower())
        assert v is not None, f"{name} missing: {self.headers}"
        return int(v)

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.headers}, {self.body[:80]!r})"


def request(port: int, method: str, path: str, headers: Iterable[Tuple[str, str]] = ()) -> Response:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path)
        for k, v in headers:
            conn.putheader(k, v)
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        r = conn.getresponse()
        body = r.read()
        hs: Dict[str, str] = {}
        for k, v in r.getheaders():
            hs[k.lower()] = v
        return Response(r.status, hs, body)
    finally:
        conn.close()


class UvicornServer:
    """An ASGI app served by uvicorn on a free loopback port, in a thread. ``proxy_headers`` off by
    default: uvicorn would otherwise rewrite scope["client"] from X-Forwarded-For itself (for peers
    at 127.0.0.1 and ::1 by default), and the middleware's own proxy rules are under test; on, it
    trusts ``forwarded_allow_ips`` (uvicorn's default, which includes the tests' own address)."""

    def __init__(self, app: Any, proxy_headers: bool = False, forwarded_allow_ips: str = "127.0.0.1,::1") -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            proxy_headers=proxy_headers,
            forwarded_allow_ips=forwarded_allow_ips,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        eventually("uvicorn started", lambda: self.server.started, timeout=10)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:  # noqa: D401 - silence per-request logging
        pass

    def get_environ(self) -> Dict[str, Any]:
        env = super().get_environ()
        # The request target as sent, as gunicorn gives it (wsgiref gives only the decoded PATH_INFO).
        env["RAW_URI"] = self.path
        return env


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class WsgiServer:
    """A WSGI app served by wsgiref on a free loopback port, in a thread, with gunicorn's ``RAW_URI``;
    ``threads``: a thread per request (requests in flight at once), as gunicorn's threaded workers."""

    def __init__(self, app: Any, threads: bool = False) -> None:
        server_class = _ThreadingWSGIServer if threads else WSGIServer
        self.httpd: WSGIServer = make_server("127.0.0.1", 0, app, server_class=server_class, handler_class=_Quiet)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


def now_s() -> int:
    return int(time.time())


MIDDLEWARE_RULES = """
[[rules]]
id = "api"
dimension = "user"
match = { endpoint = "/api/*" }
limit = 6
windowSeconds = 3600

[[rules]]
id = "login"
dimension = "ip"
match = { endpoint = "/login" }
limit = 2
windowSeconds = 3600

# Would reject every client after its first request, if it were enforced.
[[rules]]
id = "ip-dry-run"
dimension = "ip"
limit = 1
windowSeconds = 3600
mode = "log"
"""
# An hour-long window (see rules.py); X-RateLimit-Reset is at most two windows ahead (+1 s rounding).
MAX_RESET_S = 2 * 3600 + 1


def check_429(r: Response, limit: Optional[int] = None) -> int:
    """The rejection's shape: 429, Retry-After in whole seconds (1 to two windows), the JSON body
    naming the same number, and X-RateLimit-Remaining 0. Returns Retry-After."""
    import json

    assert r.status == 429, r
    retry = r.num("retry-after")
    assert 1 <= retry <= MAX_RESET_S, retry
    assert now_s() + retry <= r.num("x-ratelimit-reset") + 1, "retrying is possible before the full reset"
    assert r.num("x-ratelimit-remaining") == 0
    if limit is not None:
        assert r.num("x-ratelimit-limit") == limit
    assert r.headers.get("content-type") == "application/json"
    assert json.loads(r.body) == {"error": "rate_limited", "retryAfter": retry}
    return retry


def fail_closed_after_kill(port: int, agent: Any, client: Any) -> None:
    """What every middleware does once its agent is killed, with ``rules.FAIL_MODE_RULES`` (a
    fail-closed rule on ``/login``, a fail-open one on ``/api/*``), served at ``port`` with the
    agent's ``client``; a request with ``X-Variant: fail-for`` goes through a middleware configured
    with ``fail_for={"/login": "open"}`` on the same client."""
    r = request(port, "POST", "/login")
    assert r.status == 200 and r.num("x-ratelimit-limit") == 5, r
    eventually("the SDK learns the fail-closed rules", lambda: client.health().rules_version is not None)
    assert client.health().fail_closed_rules == 1
    agent.kill()
    eventually("the SDK sees the agent gone", lambda: not client.is_connected())
    # A 429 as any denial: Retry-After (the client's closed_retry_after, 1 s) and the rule's headers.
    assert check_429(request(port, "POST", "/login"), limit=5) == 1
    r = request(port, "GET", "/api/hello")
    assert r.status == 200 and "x-ratelimit-limit" not in r.headers, "the fail-open rule passes"
    r = request(port, "POST", "/login", [("X-Variant", "fail-for")])
    assert r.status == 200 and "x-ratelimit-limit" not in r.headers, "fail_for decides alone"


# MIDDLEWARE_RULES and a budget of tokens an LLM route's responses report, charged afterwards.
CHARGE_RULES = (
    MIDDLEWARE_RULES
    + """
[[rules]]
id = "tokens"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 1000
windowSeconds = 3600
"""
)
CHARGE_HEADERS = {"/v1/chat": "x-llm-tokens"}


class TokensReported:
    """A ``charge_with`` callable that charges what ``charge_headers=CHARGE_HEADERS`` does: the
    response's X-LLM-Tokens as a number (or what is not one, for the middleware to refuse), ``None``
    without it; it keeps what it was given (ASGI and WSGI: the status and the headers; Django: the
    response, read by ``header``)."""

    def __init__(self, header: Optional[Callable[..., Optional[str]]] = None) -> None:
        self.calls: List[Tuple[Any, ...]] = []
        self.header = header

    def __call__(self, *response: Any) -> Any:
        self.calls.append(response)
        if self.header is not None:
            value = self.header(*response)
        else:
            _, headers = response
            value = next((v for k, v in headers if k.lower() == "x-llm-tokens"), None)
        if value is None or not value.strip():
            return None
        value = value.strip()
        # "-5" is -5 and "4294967296" too big: the middleware refuses those, as it refuses the header.
        return int(value) if value.lstrip("-").isdigit() else None


def charged_after_response(port: int, remaining: Callable[[str], int]) -> None:
    """What every middleware does with ``charge_headers=CHARGE_HEADERS`` (or ``charge_with`` a
    :class:`TokensReported`) and ``CHARGE_RULES``, serving
    at ``port`` an app whose ``POST /v1/chat`` answers with ``X-LLM-Tokens`` set to the request's
    ``X-Want`` (none without it), and whose ``/api/hello`` answers 200; users come in ``X-User-Id``.
    ``remaining(user)`` reads the user's tokens left (a peek of the rule ``tokens``)."""

    def chat(user: str, want: Optional[str] = None) -> Response:
        headers = [("X-User-Id", user)] + ([("X-Want", want)] if want is not None else [])
        return request(port, "POST", "/v1/chat", headers)

    alice, bob = unique("alice"), unique("bob")
    r = chat(alice, "1500")
    assert r.status == 200 and r.headers.get("x-llm-tokens") == "1500", r
    assert (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (1000, 1000), "the request phase peeks"
    # Charged once the response is out, past the limit: a debt of 500 that the next request waits out.
    eventually("alice's 1500 tokens are charged", lambda: remaining(alice) == 0)
    check_429(chat(alice), limit=1000)

    r = chat(bob, "400")
    assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1000), r
    eventually("bob's 400 tokens are charged", lambda: remaining(bob) == 600)
    # No header, an empty one, 0, not a whole number, past a u32: nothing charged.
    for want in (None, "", "0", "lots", "-5", "1.5", "4294967296"):
        r = chat(bob, want)
        assert (r.status, r.num("x-ratelimit-remaining")) == (200, 600), (want, r)
    # Had any of those been charged (after its response, as these are), bob would end below 500.
    assert chat(bob, "100").status == 200
    eventually("bob's 100 tokens are charged", lambda: remaining(bob) == 500)
    assert chat(bob).num("x-ratelimit-remaining") == 500
    # Other routes consume as before.
    r = request(port, "GET", "/api/hello", [("X-User-Id", bob)])
    assert (r.status, r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (200, 6, 5), r


# --- concurrency (protocol version 3) ---------------------------------------------------------------

# MIDDLEWARE_RULES and, on /slow/*, two requests in flight per user (a lease lasts 30 s unless
# released: longer than a test waits for a release) and an hourly rate rule that each request passed
# consumes once (a release only peeks it).
LEASE_RULES = (
    MIDDLEWARE_RULES
    + """
[[rules]]
id = "slots"
dimension = "user"
match = { endpoint = "/slow/*" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 30

[[rules]]
id = "slow-hourly"
dimension = "user"
match = { endpoint = "/slow/*" }
limit = 100
windowSeconds = 3600
"""
)
# How long a held handler or a test waits for the other side before failing.
PATIENCE = 10.0


class Gate:
    """Holds handlers in flight: each one says it entered, then waits until the test opens the gate
    (no sleeps: the test waits for the handlers to enter, the handlers for the gate)."""

    def __init__(self) -> None:
        self._entered = threading.Semaphore(0)
        self._open = threading.Event()

    def enter(self) -> None:
        """In a handler's thread."""
        self._entered.release()
        assert self._open.wait(PATIENCE), "the test never opened the gate"

    async def aenter(self) -> None:
        """In a handler's event loop."""
        self._entered.release()
        opened = await asyncio.get_running_loop().run_in_executor(None, self._open.wait, PATIENCE)
        assert opened, "the test never opened the gate"

    def wait_entered(self, n: int) -> None:
        for _ in range(n):
            assert self._entered.acquire(timeout=PATIENCE), "a handler never started"

    def open(self) -> None:
        self._open.set()


Remaining = Callable[[str, str], int]
"""``remaining(user, rule)``: what the user has left under the rule now (a peek of its key)."""


def two_in_flight_then_429(
    port: int,
    path: str,
    gate: Gate,
    remaining: Remaining,
    status: int = 200,
    body: Optional[bytes] = None,
    headers_on_answers: bool = True,
) -> None:
    """What every middleware does with ``LEASE_RULES`` for an app serving at ``port``, whose ``path``
    (under /slow/) waits in ``gate`` and then answers ``status`` (and ``body``), and whose
    ``/slow/done`` answers 200 at once; users come in ``X-User-Id``: two
    requests in flight pass, a third is a 429 (Retry-After 1: the agent retries a concurrency denial
    within 1 s), and once both have ended their leases are released and a new request passes.
    ``headers_on_answers``: whether the two answers carry the limiter's headers (not wsgiref's own
    500 for an app that raised)."""
    user = unique("u")
    headers = [("X-User-Id", user)]
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(request, port, "GET", path, headers) for _ in range(2)]
        gate.wait_entered(2)
        assert remaining(user, "slots") == 0
        assert check_429(request(port, "GET", path, headers), limit=2) == 1
        gate.open()
        answers = [f.result() for f in held]
    for r in answers:
        assert r.status == status and (body is None or r.body == body), r
    if headers_on_answers:
        figures = sorted((r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) for r in answers)
        assert figures == [(2, 0), (2, 1)], answers
    eventually("both leases are released", lambda: remaining(user, "slots") == 2)
    r = request(port, "GET", "/slow/done", headers)
    assert (r.status, r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (200, 2, 1), r
    eventually("its lease is released too", lambda: remaining(user, "slots") == 2)
    # Three requests passed, each consumed the rate rule once: the releases (and the 429) took nothing.
    assert remaining(user, "slow-hourly") == 97


def open_response(port: int, path: str, headers: Iterable[Tuple[str, str]], until: bytes) -> socket.socket:
    """A request whose response has begun: the connection, once its first bytes up to ``until``
    (a streamed body's first part) have arrived."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers), "", ""]
    sock.sendall("\r\n".join(lines).encode())
    got = b""
    while until not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {got!r}"
        got += chunk
    assert got.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")), got
    return sock


def released_when_clients_leave(
    port: int, path: str, remaining: Remaining, first: bytes, after_leaving: Optional[Callable[[], None]] = None
) -> None:
    """Two clients whose responses from ``path`` have begun (their first part, ``first``) hold both
    slots, a third request is a 429; once the two go away mid-response (and ``after_leaving``, e.g.
    an app's next write, lets the server notice), their leases are released and a new request
    passes."""
    user = unique("u")
    headers = [("X-User-Id", user)]
    socks: List[socket.socket] = [open_response(port, path, headers, first) for _ in range(2)]
    try:
        assert remaining(user, "slots") == 0
        assert check_429(request(port, "GET", path, headers), limit=2) == 1
    finally:
        for sock in socks:
            sock.close()
    if after_leaving is not None:
        after_leaving()
    eventually("both leases are released", lambda: remaining(user, "slots") == 2)
    r = request(port, "GET", "/slow/done", headers)
    assert (r.status, r.num("x-ratelimit-remaining")) == (200, 1), r


# --- a charge route's concurrency unit (protocol version 3) -------------------------------------------

# CHARGE_RULES and, on the LLM route, two requests in flight per user. A charge route's request is a
# peek of cost 0 with a lease (PROTOCOL.md, "Form 3, a peek with a lease"): the agent reads the rate
# rules (tokens) first and, only if they pass, holds one unit of chat-slots under the lease, given back
# (cost 1) when the response ends.
CHARGE_LEASE_RULES = (
    CHARGE_RULES
    + """
[[rules]]
id = "chat-slots"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 30
"""
)


def chat(port: int, user: str, want: Optional[str] = None, hold: bool = False) -> Response:
    """``POST /v1/chat`` as ``user``, its response reporting ``want`` tokens (none: no header); with
    ``hold``, an ``X-Hold`` header that makes the handler wait in the app's gate."""
    headers = [("X-User-Id", user)]
    if want is not None:
        headers.append(("X-Want", want))
    if hold:
        headers.append(("X-Hold", "1"))
    return request(port, "POST", "/v1/chat", headers)


def charge_route_holds_a_unit(port: int, gate: Gate, remaining: Remaining, body: bytes = b"an answer") -> None:
    """What every middleware does with ``CHARGE_LEASE_RULES`` and ``charge_headers=CHARGE_HEADERS``
    (or ``charge_with`` a :class:`TokensReported`), serving at ``port`` an app whose ``POST
    /v1/chat`` answers ``body`` with ``X-LLM-Tokens`` set to the request's ``X-Want``, after waiting
    in ``gate`` when the request has ``X-Hold``: two requests held in flight hold both units of
    chat-slots (nothing charged yet), a third is a 429 of chat-slots with ``Retry-After: 1``; once the
    two have ended, both units are given back and both reports charged (not the refused request's), and
    a new request passes, holds a unit, gives it back and is charged too."""
    user = unique("u")
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(chat, port, user, "300", True) for _ in range(2)]
        gate.wait_entered(2)
        assert remaining(user, "chat-slots") == 0, "each request in flight holds one unit"
        assert remaining(user, "tokens") == 1000, "nothing is charged before a response"
        assert check_429(chat(port, user, "5"), limit=2) == 1
        gate.open()
        answers = [f.result() for f in held]
    for r in answers:
        assert (r.status, r.body, r.headers.get("x-llm-tokens")) == (200, body, "300"), r
    # The binding rule is chat-slots (1, then 0 units left), not tokens (1000 left before the request).
    figures = sorted((r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) for r in answers)
    assert figures == [(2, 0), (2, 1)], answers
    eventually("both units are released", lambda: remaining(user, "chat-slots") == 2)
    eventually("both responses' tokens are charged", lambda: remaining(user, "tokens") == 400)

    r = chat(port, user, "100")
    assert (r.status, r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (200, 2, 1), r
    eventually("its unit is released too", lambda: remaining(user, "chat-slots") == 2)
    eventually("its tokens are charged", lambda: remaining(user, "tokens") == 300)
    # The refused request (5 tokens) was never charged, and a release took no tokens.
    assert remaining(user, "tokens") == 300


def refused_charge_route_holds_nothing(port: int, remaining: Remaining, charge: Callable[[str, int], Any]) -> None:
    """With the app and rules of :func:`charge_route_holds_a_unit`: a user whose tokens are already
    past their limit (``charge(user, cost)`` charges the tokens rule directly, as a client does) is
    refused on the charge route by the tokens rule, and the refused requests hold no unit of
    chat-slots (a unit held would stay for the lease's 30 s: none is given back for a refusal)."""
    user = unique("u")
    charge(user, 1500)
    assert remaining(user, "tokens") == 0
    for _ in range(3):
        retry = check_429(chat(port, user, "5"), limit=1000)
        assert retry > 1, "the tokens rule's retry, not a concurrency rule's"
        assert remaining(user, "chat-slots") == 2, "a refused request holds no unit"
    # Another user, not in debt, passes and holds (then gives back) a unit as usual.
    other = unique("v")
    r = chat(port, other, "5")
    assert (r.status, r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")) == (200, 2, 1), r
    eventually("its unit is released", lambda: remaining(other, "chat-slots") == 2)
    assert remaining(user, "chat-slots") == 2 and remaining(user, "tokens") == 0
