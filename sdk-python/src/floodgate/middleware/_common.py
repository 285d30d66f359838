"""What the ASGI, WSGI and Django middleware share; the same behaviour as the Rust SDK's tower Layer
(``sdk/src/middleware/``): headers, 429s, trusted proxies, wire-safe values, costs charged after the
response, concurrency leases released when it ends, the request's trace context forwarded with its
check, charge and releases, and the rules a request passes past in quota mode."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import re
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..decision import Decision, FailPolicy, RareWarning
from ..errors import UnsupportedByAgent
from ..lease import new_lease_id, precaution_not_sent, release_failed, release_taken
from ..protocol import _RULE_ID, Attributes, ItemDecision, ItemMode, wire_safe

log = logging.getLogger("floodgate")

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

RATE_LIMIT_HEADERS = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
IETF_HEADERS = ("ratelimit-policy", "ratelimit")


class Cidr:
    """An address block, ``10.0.0.0/8`` or a single address. An IPv4-mapped IPv6 block (prefix at
    least 96) is its IPv4 block, and addresses are compared mapped-to-IPv4 too."""

    __slots__ = ("network",)

    def __init__(self, text: str) -> None:
        addr, _, prefix = text.partition("/")
        try:
            ip = ipaddress.ip_address(addr.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an IP address or CIDR block") from None
        top = 32 if ip.version == 4 else 128
        if prefix.strip():
            try:
                bits = int(prefix.strip())
            except ValueError:
                bits = -1
            if not 0 <= bits <= top:
                raise ValueError(f"{text!r}: the prefix must be 0..={top}")
        else:
            bits = top
        if ip.version == 6 and ip.ipv4_mapped is not None and bits >= 96:  # type: ignore[union-attr]
            ip, bits = ip.ipv4_mapped, bits - 96  # type: ignore[union-attr]
        self.network = ipaddress.ip_network(f"{ip}/{bits}", strict=False)

    def contains(self, ip: IPAddress) -> bool:
        """Whether ``ip`` is in the block (an IPv4-mapped IPv6 address counts as its IPv4 address)."""
        if ip.version == 6 and ip.ipv4_mapped is not None:  # type: ignore[union-attr]
            ip = ip.ipv4_mapped  # type: ignore[union-attr]
        return ip.version == self.network.version and ip in self.network

    def __repr__(self) -> str:
        return f"Cidr({str(self.network)!r})"


def parse_cidrs(blocks: Iterable[str]) -> List[Cidr]:
    """The trusted proxies; raises ``ValueError`` naming a bad block."""
    if isinstance(blocks, str):
        blocks = [blocks]
    return [Cidr(b) for b in blocks]


def parse_ip(text: str) -> Optional[IPAddress]:
    """An address as Rust's ``IpAddr`` parses it (no brackets, ports or zone ids), else ``None``."""
    if not text or "%" in text or not text.isascii():
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def format_ip(ip: IPAddress) -> str:
    """An address written as Rust writes it (RFC 5952; an IPv4-mapped address as ``::ffff:a.b.c.d``),
    so that one client gets the same key behind the Python and the Rust SDK."""
    if ip.version == 6 and ip.ipv4_mapped is not None:  # type: ignore[union-attr]
        return f"::ffff:{ip.ipv4_mapped}"  # type: ignore[union-attr]
    return str(ip)


def client_ip(peer: Optional[str], forwarded_for: Sequence[str], trusted: Sequence[Cidr]) -> Optional[IPAddress]:
    """The client's address: the peer, unless the peer is a trusted proxy; then ``X-Forwarded-For``
    read from the right, skipping trusted proxies, up to the first address they did not vouch for.
    ``forwarded_for`` is every value of the header, in order. A client can write anything at the left
    of the header; only what trusted proxies appended counts."""
    ip = parse_ip(peer) if peer else None
    if ip is None:
        return None
    if not any(c.contains(ip) for c in trusted):
        return ip
    hops = [h.strip() for v in forwarded_for for h in v.split(",")]
    client = ip
    for hop in reversed(hops):
        addr = parse_ip(hop)
        if addr is None:
            # Garbage where an address should be: stop at the last address we could vouch for.
            break
        client = addr
        if not any(c.contains(addr) for c in trusted):
            break
    return client


# The IP key of the requests whose peer an ASGI server replaced with an X-Forwarded-For entry while
# the middleware trusts no proxy: the connection's address is lost, and the entry is the client's own
# words, so they all count as the one proxy that sent them (as its address would, were it known).
SERVER_FORWARDED_KEY = "proxy"


def _server_host_port(hop: str) -> Tuple[str, int]:
    """An ``X-Forwarded-For`` entry as uvicorn's proxy headers read one into ``scope["client"]``:
    ``[v6]:port``, ``v4:port`` or ``host:port``, else the whole entry with port 0."""
    if hop.startswith("["):
        end = hop.find("]")
        if end == -1:
            return hop, 0
        rest = hop[end + 1 :]
        if not rest:
            return hop[1:end], 0
        if not rest.startswith(":"):
            return hop, 0
        try:
            return hop[1:end], int(rest[1:])
        except ValueError:
            return hop[1:end], 0
    if hop.count(":") == 1:
        host, _, port = hop.partition(":")
        try:
            return host, int(port)
        except ValueError:
            return hop, 0
    return hop, 0


def server_took_forwarded_for(client: Any, forwarded_for: Sequence[str]) -> bool:
    """Whether the client an ASGI server reports (``scope["client"]``) is an ``X-Forwarded-For``
    entry, as uvicorn's proxy headers make it (on by default for peers at 127.0.0.1 and ::1): the
    entry's host, with its port or 0. ``forwarded_for`` is every value of the header as the server
    read it (latin-1, unfiltered). A connection's own port is never 0, so the only other way to match
    is a client writing its own address and port into the header."""
    if not client or len(client) < 2 or not forwarded_for:
        return False
    reported = (client[0], client[1])
    for value in forwarded_for:
        for hop in value.split(","):
            hop = hop.strip()
            if reported == (hop, 0) or reported == _server_host_port(hop):
                return True
    return False


def scope_took_forwarded_for(scope: Mapping[str, Any]) -> bool:
    """:func:`server_took_forwarded_for` for an ASGI scope."""
    values = [
        bytes(v).decode("latin-1") for k, v in scope.get("headers") or () if bytes(k).lower() == b"x-forwarded-for"
    ]
    return server_took_forwarded_for(scope.get("client"), values)


def header_text(raw: Union[bytes, str, None]) -> Optional[str]:
    """A header value as the Rust Layer reads one: only visible ASCII (and tabs), trimmed, non-empty;
    anything else counts as absent."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = raw.encode("latin-1")
        except UnicodeEncodeError:
            return None
    for b in raw:
        if not (32 <= b < 127 or b == 9):
            return None
    v = raw.decode("ascii").strip(" \t")
    return v or None


def route_name(route: str) -> str:
    """A route as the agent may see it: ``{param}`` (and Starlette's ``{param:conv}``) becomes
    ``:param``, ``{*rest}`` becomes ``*rest`` (braces are refused on the wire, since Redis reads them
    as hash tags). Rules and ``costs`` name routes either way."""
    out = []
    for seg in route.split("/"):
        if len(seg) >= 2 and seg[0] == "{" and seg[-1] == "}":
            inner = seg[1:-1]
            out.append(inner if inner.startswith("*") else ":" + inner.split(":", 1)[0])
        else:
            out.append(seg)
    return "/".join(out)


def normalise_costs(costs: Optional[Mapping[str, int]]) -> Dict[str, int]:
    return {route_name(k): max(int(v), 1) for k, v in (costs or {}).items()}


# An HTTP header name (RFC 9110 token).
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def normalise_charge_headers(
    charge_headers: Optional[Mapping[str, str]], costs: Mapping[str, int]
) -> Dict[str, str]:
    """``charge_headers`` keyed as ``costs`` is (``costs`` already normalised), each header name
    lower-case. A name that is not a header name, or a route that also has a cost (its check is a
    peek of cost 0, so the cost would be ignored), raises ``ValueError`` here, not on a request."""
    out: Dict[str, str] = {}
    for route, header in (charge_headers or {}).items():
        if not isinstance(header, str) or not _TOKEN.fullmatch(header):
            raise ValueError(f"charge_headers[{route!r}]: {header!r} is not a header name")
        key = route_name(route)
        if key in costs:
            raise ValueError(f"{route!r} is in costs and in charge_headers: give it one or the other")
        out[key] = header.lower()
    return out


ChargeWith = Callable[..., Optional[int]]
"""A ``charge_with`` callable: the response (ASGI and WSGI: its status and headers; Django: the
``HttpResponse``) to the cost to charge, or ``None``."""


def normalise_charge_with(
    charge_with: Optional[Mapping[str, ChargeWith]], costs: Mapping[str, int], charge_headers: Mapping[str, str]
) -> Dict[str, ChargeWith]:
    """``charge_with`` keyed as ``costs`` is (``costs`` and ``charge_headers`` already normalised). A
    value that is not callable, or a route that also has a cost or a charge header, raises
    ``ValueError`` here, not on a request."""
    out: Dict[str, ChargeWith] = {}
    for route, fn in (charge_with or {}).items():
        if not callable(fn):
            raise ValueError(f"charge_with[{route!r}]: {fn!r} is not callable")
        key = route_name(route)
        if key in costs:
            raise ValueError(f"{route!r} is in costs and in charge_with: give it one or the other")
        if key in charge_headers:
            raise ValueError(f"{route!r} is in charge_headers and in charge_with: give it one or the other")
        out[key] = fn
    return out


def normalise_fail_for(fail_for: Optional[Mapping[str, Union[str, FailPolicy]]]) -> Dict[str, FailPolicy]:
    """``fail_for`` keyed as ``costs`` is, each policy checked (a misspelt one raises ``ValueError``
    here, not on a request)."""
    return {route_name(k): FailPolicy(v) for k, v in (fail_for or {}).items()}


def _safe(v: Optional[str]) -> Optional[str]:
    if v is None:
        return None
    v = str(v)
    # An empty value is absent (the wire's "" means absent; a check with an empty attribute is
    # invalid and would otherwise let the request pass unchecked).
    return wire_safe(v) if v else None


def build_attributes(
    endpoint: Optional[str],
    tier: Optional[str],
    user: Optional[str],
    api_key: Optional[str],
    ip: Optional[str],
    costs: Mapping[str, int],
) -> Attributes:
    """The attributes a request is checked as: every value wire-safe, the cost from the endpoint."""
    cost = costs.get(endpoint, 1) if endpoint else 1
    return Attributes(_safe(endpoint), _safe(tier), _safe(user), _safe(api_key), _safe(ip), cost)


def _binding_item(d: Decision) -> Optional[ItemDecision]:
    """The enforced item whose figures the decision carries, if any."""
    if d.limit == 0:
        return None
    for it in d.items:
        v = it.verdict
        if not v.log_only and v.limit == d.limit and v.remaining == d.remaining and v.reset_at_ms == d.reset_at_ms:
            return it
    return None


def binding_rule(d: Decision) -> Optional[str]:
    """The enforced rule whose figures the decision carries, if any (none: no headers)."""
    it = _binding_item(d)
    return None if it is None else it.rule_id


def rate_limit_headers(d: Decision, ietf: bool = False, now_ms: Optional[int] = None) -> List[Tuple[str, str]]:
    """The headers for a decision, lower-case names: ``X-RateLimit-Limit``, ``-Remaining`` and
    ``-Reset`` (epoch seconds, rounded up) of the binding enforced rule, and with ``ietf`` the
    draft's ``RateLimit-Policy`` (``"rule";q=<limit>;w=<window in seconds, rounded up>``, without
    ``;w=`` when the rule names no window: a concurrency rule, or an agent older than protocol
    version 4) and ``RateLimit``. None when no enforced rule applied."""
    binding = _binding_item(d)
    if binding is None:
        return []
    rule = binding.rule_id
    reset_s = -(-d.reset_at_ms // 1000)
    h = [
        ("x-ratelimit-limit", str(d.limit)),
        ("x-ratelimit-remaining", str(d.remaining)),
        ("x-ratelimit-reset", str(reset_s)),
    ]
    # A rule id goes into the IETF headers quoted: one no agent sends (quotes, CR/LF) is left out.
    if ietf and _RULE_ID.fullmatch(rule):
        now = int(time.time() * 1000) if now_ms is None else now_ms
        t = -(-max(d.reset_at_ms - now, 0) // 1000)
        policy = f'"{rule}";q={d.limit}'
        if binding.window_ms > 0:
            policy += f";w={-(-binding.window_ms // 1000)}"
        h.append(("ratelimit-policy", policy))
        h.append(("ratelimit", f'"{rule}";r={d.remaining};t={t}'))
    return h


# --- quota mode (protocol version 6) ---------------------------------------------------------------

OVER_QUOTA_HEADER = "x-ratelimit-over-quota"
"""The response header naming the rules a request was let through past (quota mode), as the Rust
Layer's ``OVER_QUOTA_HEADER``."""
OVER_QUOTA_KEY = "floodgate.over_quota"
"""Where the ASGI scope and the WSGI environ carry those rules' ids for the handler."""


def over_quota_rules(d: Decision) -> List[str]:
    """The ids of the rules an allowed request passes past in quota mode (``overLimit = "flag"``:
    :attr:`~floodgate.Decision.over_quota_rules`), for the handler to route it (a cheaper model, a
    fallback backend); empty for a request that is refused (no handler runs) or within every
    limit."""
    return d.over_quota_rules if d.allowed else []


def over_quota_header(rules: Sequence[str]) -> List[Tuple[str, str]]:
    """``X-RateLimit-Over-Quota: <ids comma-separated>`` (lower-case name) for ``rules``, or none.
    Only ids an agent sends go in (``[A-Za-z0-9_.:-]``): anything else could not be a header value."""
    ids = [r for r in rules if _RULE_ID.fullmatch(r)]
    return [(OVER_QUOTA_HEADER, ",".join(ids))] if ids else []


def retry_after_seconds(d: Decision) -> int:
    """``Retry-After`` in whole seconds: rounded up, never 0."""
    ms = 1000 if d.retry_after_ms is None else d.retry_after_ms
    return max(-(-ms // 1000), 1)


def rejection_body(seconds: int) -> bytes:
    """The 429's JSON body."""
    return json.dumps({"error": "rate_limited", "retryAfter": seconds}, separators=(",", ":")).encode()


class Once:
    """Logs a warning once per process."""

    def __init__(self) -> None:
        self._done = False

    def warn(self, message: str) -> None:
        if not self._done:
            self._done = True
            log.warning(message)


CHECK_FAILED = RareWarning()
BAD_CHARGE = RareWarning()
CHARGE_LOST = RareWarning()
NO_PEER = Once()
SERVER_FORWARDED = Once()


Extractor = Callable[..., Optional[str]]


class Settings:
    """The middleware's configuration, the same for every framework (extractors take the framework's
    request: an ASGI scope, a WSGI environ, a Django request)."""

    def __init__(
        self,
        *,
        endpoint: Optional[Extractor] = None,
        tier: Optional[Extractor] = None,
        user: Optional[Extractor] = None,
        api_key: Optional[Extractor] = None,
        ip: Optional[Extractor] = None,
        tier_header: Optional[str] = None,
        user_header: Optional[str] = None,
        api_key_header: Optional[str] = None,
        trust_proxies: Iterable[str] = (),
        costs: Optional[Mapping[str, int]] = None,
        ietf_headers: bool = False,
        timeout: Optional[float] = None,
        fail: Union[str, FailPolicy, None] = None,
        fail_for: Optional[Mapping[str, Union[str, FailPolicy]]] = None,
        charge_headers: Optional[Mapping[str, str]] = None,
        charge_with: Optional[Mapping[str, ChargeWith]] = None,
    ) -> None:
        for name, f, h in (("tier", tier, tier_header), ("user", user, user_header), ("api_key", api_key, api_key_header)):
            if f is not None and h is not None:
                raise ValueError(f"give {name} or {name}_header, not both")
        self.endpoint = endpoint
        self.tier = tier
        self.user = user
        self.api_key = api_key
        self.ip = ip
        self.tier_header = tier_header.lower() if tier_header else None
        self.user_header = user_header.lower() if user_header else None
        self.api_key_header = api_key_header.lower() if api_key_header else None
        self.trusted = parse_cidrs(trust_proxies)
        self.costs = normalise_costs(costs)
        self.ietf = bool(ietf_headers)
        self.timeout = timeout
        self.fail = None if fail is None else FailPolicy(fail)
        self.fail_for = normalise_fail_for(fail_for)
        self.charge_headers = normalise_charge_headers(charge_headers, self.costs)
        self.charge_with = normalise_charge_with(charge_with, self.costs, self.charge_headers)

    def fail_policy(self, endpoint: Optional[str]) -> Optional[FailPolicy]:
        """The per-call fail policy of a request to ``endpoint``: its route's in ``fail_for``, else
        ``fail``; ``None`` (neither given) leaves it to the agent's fail-closed rules, then the
        client's policy."""
        if endpoint and self.fail_for:
            return self.fail_for.get(endpoint, self.fail)
        return self.fail


def request_attributes(
    s: Settings,
    request: Any,
    *,
    header: Callable[[Any, str], Optional[str]],
    default_endpoint: Callable[[Any], Optional[str]],
    peer: Callable[[Any], Tuple[Optional[str], Sequence[str], bool]],
    no_peer: str,
) -> Attributes:
    """What a request is checked as: :func:`request_check` without the fail policy and the charge
    header."""
    return request_check(
        s, request, header=header, default_endpoint=default_endpoint, peer=peer, no_peer=no_peer
    )[0]


def request_check(
    s: Settings,
    request: Any,
    *,
    header: Callable[[Any, str], Optional[str]],
    default_endpoint: Callable[[Any], Optional[str]],
    peer: Callable[[Any], Tuple[Optional[str], Sequence[str], bool]],
    no_peer: str,
) -> Tuple[Attributes, Optional[FailPolicy], Union[str, ChargeWith, None]]:
    """What a request is checked as, for every framework, its per-call fail policy
    (:meth:`Settings.fail_policy`, by the same endpoint ``costs`` is looked up by) and what its cost
    is charged from: the response header its route has in ``charge_headers``, or the callable it has
    in ``charge_with`` (the check is then a peek of cost 0, and :func:`charge_attributes` is what to
    charge afterwards); ``None`` for other routes. ``header(request, name)``
    reads a header (lower-case name), ``default_endpoint(request)`` names the route,
    ``peer(request)`` gives the peer address, the ``X-Forwarded-For`` values and whether the server
    took that address from the header itself (:func:`server_took_forwarded_for`); ``no_peer`` is said
    once when there is no peer."""

    def value(f: Optional[Extractor], name: Optional[str]) -> Optional[str]:
        if f is not None:
            return f(request)
        if name is not None:
            return header(request, name)
        return None

    endpoint = s.endpoint(request) if s.endpoint is not None else default_endpoint(request)
    ip: Optional[str]
    if s.ip is not None:
        ip = s.ip(request)
    else:
        address, forwarded_for, from_header = peer(request)
        if from_header and not s.trusted:
            # The header is believed only through trust_proxies, and the server believed it for us:
            # the address is the client's choice and the peer's is lost, so all such requests share
            # one key, as the peer's address would be. (A client writing its own address and port
            # into the header lands there too: one more budget shared by all who do, never a key of
            # its choice.) With trust_proxies set, the walk below starts from the server's choice,
            # which is right when the server trusts no proxy the middleware does not (README).
            SERVER_FORWARDED.warn(
                "floodgate: the server took the client address from X-Forwarded-For (uvicorn's proxy"
                " headers, on by default for 127.0.0.1 and ::1) and no trust_proxies are set, so such"
                f" requests share the IP key {SERVER_FORWARDED_KEY!r}: run uvicorn with --no-proxy-headers,"
                " and give the middleware trust_proxies if a proxy is in front (said once)"
            )
            ip = SERVER_FORWARDED_KEY
        else:
            addr = client_ip(address, forwarded_for, s.trusted)
            if addr is None:
                NO_PEER.warn(no_peer)
            ip = format_ip(addr) if addr is not None else None
    attributes = build_attributes(
        endpoint,
        value(s.tier, s.tier_header),
        value(s.user, s.user_header),
        value(s.api_key, s.api_key_header),
        ip,
        s.costs,
    )
    charge: Union[str, ChargeWith, None] = None
    if endpoint:
        charge = s.charge_headers.get(endpoint) if s.charge_headers else None
        if charge is None and s.charge_with:
            charge = s.charge_with.get(endpoint)
    if charge is not None:
        # Only a rule already past its limit refuses the request; its cost is known afterwards.
        attributes = dataclasses.replace(attributes, cost=0, mode=ItemMode.PEEK)
    return attributes, s.fail_policy(endpoint), charge


# A charge is a u32 on the wire (PROTOCOL.md, "Item modes").
MAX_CHARGE = 2**32 - 1


def reported_cost(header: str, raw: Union[bytes, str, None]) -> Optional[int]:
    """The cost a response's ``header`` reports: a whole number from 1 to 4294967295 (ASCII digits,
    surrounding spaces and tabs allowed). Absent, empty or 0: ``None``, nothing to charge. Anything
    else (not a number, negative, too big): ``None`` too, logged at most once a minute, since it is
    the app's bug and it would otherwise go uncounted unseen."""
    if raw is None:
        return None
    text = raw.decode("latin-1") if isinstance(raw, (bytes, bytearray)) else str(raw)
    if not text.strip(" \t"):
        return None
    v = header_text(raw)
    digits = v.lstrip("0") if v is not None and v.isascii() and v.isdigit() else None
    if digits is not None and len(digits) <= 10 and int(digits or "0") <= MAX_CHARGE:
        return int(digits) if digits else None
    BAD_CHARGE.warn(
        "floodgate: the response's %s header is not a whole number from 0 to %d (%.60r); nothing"
        " charged (said at most once a minute)",
        header,
        MAX_CHARGE,
        text,
    )
    return None


def called_cost(fn: ChargeWith, *response: Any) -> Optional[int]:
    """The cost a ``charge_with`` callable gives for ``response``: an int from 1 to 4294967295; 0 or
    ``None``: nothing to charge. Anything else, or an exception, is nothing charged too, logged at
    most once a minute (the app's bug, which would otherwise go uncounted unseen); never raised: the
    response goes out all the same."""
    try:
        cost = fn(*response)
    except Exception as e:  # noqa: BLE001 - the app's callable; its response must still go out
        BAD_CHARGE.warn("floodgate: charge_with's %r raised %r; nothing charged (said at most once a minute)", fn, e)
        return None
    whole = isinstance(cost, int) and not isinstance(cost, bool)
    if cost is None or (whole and cost == 0):
        return None
    if whole and 0 < cost <= MAX_CHARGE:
        return cost
    BAD_CHARGE.warn(
        "floodgate: charge_with's %r returned %.60r, not None or a whole number from 0 to %d; nothing"
        " charged (said at most once a minute)",
        fn,
        cost,
        MAX_CHARGE,
    )
    return None


def response_cost(
    charge: Union[str, ChargeWith], status: int, headers: Sequence[Tuple[Union[bytes, str], Union[bytes, str]]]
) -> Optional[int]:
    """What a response of ``status`` and ``headers`` (ASGI's byte pairs or WSGI's text pairs, as the
    app gave them) is charged: its ``charge`` header's first value (:func:`reported_cost`), or what
    the ``charge_with`` callable gives for ``(status, headers)``, the headers as ``(name, value)``
    text pairs (ASGI's bytes read as latin-1)."""
    if isinstance(charge, str):
        for k, v in headers:
            if _text(k).lower() == charge:
                return reported_cost(charge, v)
        return None
    return called_cost(charge, status, [(_text(k), _text(v)) for k, v in headers])


def _text(b: Union[bytes, bytearray, str]) -> str:
    return b.decode("latin-1") if isinstance(b, (bytes, bytearray)) else b


def charge_attributes(attributes: Attributes, cost: int) -> Attributes:
    """What a request whose response reported ``cost`` is charged as: its request-phase attributes
    (a peek), charging ``cost`` to every rule they match."""
    return dataclasses.replace(attributes, cost=cost, mode=ItemMode.CHARGE)


def charge_taken(d: Decision) -> None:
    """Logs (at most once a minute) a charge the agent did not take: the SDK answered for it (agent
    away or late), so it is counted nowhere. A charge the agent took may say the key is now past its
    limit: that is the debt, not an error."""
    if not d.from_agent:
        CHARGE_LOST.warn(
            "floodgate: the agent could not take a response's charge (%s); it is not counted (said at"
            " most once a minute)",
            d.degraded.value if d.degraded is not None else d.origin.value,
        )


def charge_failed(e: BaseException) -> None:
    """Logs (at most once a minute) a charge that raised, e.g. to an agent speaking only protocol
    version 1 (:class:`~floodgate.UnsupportedByAgent`); the response was sent all the same."""
    CHARGE_LOST.warn("floodgate: a response's charge failed; it is not counted (said at most once a minute): %s", e)


def charge_now(
    client: Any, attributes: Attributes, cost: int, timeout: Optional[float], traceparent: Optional[str] = None
) -> None:
    """Charges ``cost`` with a request's attributes through the threaded ``client``, waiting at most
    ``timeout`` (the client's when ``None``), with the request's ``traceparent``
    (:func:`request_traceparent`). Never raises: a charge the agent cannot take is logged at most
    once a minute."""
    try:
        charge = charge_attributes(attributes, cost)
        charge_taken(client.check_request(charge, timeout=timeout, fail="open", traceparent=traceparent))
    except Exception as e:  # noqa: BLE001 - the response is sent; a charge never fails it
        charge_failed(e)


# --- trace context (protocol version 5) -----------------------------------------------------------

TRACEPARENT = "traceparent"
"""The W3C Trace Context request header the middleware forwards."""


def request_traceparent(request: Any, header: Callable[[Any, str], Optional[str]]) -> Optional[str]:
    """The request's ``traceparent`` header (``header(request, name)`` reads one, as for
    :func:`request_check`), which the middleware passes to the request's check, its charge and its
    releases, so that the agent's spans of them (an agent exporting traces) are children of the
    caller's span; ``None`` when absent. Not parsed here: the client sends a value that parses as
    the check's trace context to an agent speaking protocol version 5, and ignores any other."""
    return header(request, TRACEPARENT)


# --- concurrency leases (protocol version 3) ------------------------------------------------------


def with_lease(attributes: Attributes, version: Optional[int]) -> Attributes:
    """A consuming check, or a charge route's peek, with a fresh lease unless the connection is known
    to speak a version older than 3 (``version``: the client's
    :attr:`~floodgate.Client.protocol_version`): the concurrency rules it matches then hold the
    request's units (a peek: one unit, once its rate rules passed) until :func:`release_attributes`
    gives them back. With no connection yet (``None``) it carries one too: a check sent without a
    lease to the version-3 agent the client then reaches would hold a unit no release names, for the
    rule's whole ``leaseSeconds``; an older agent refuses it before it is sent
    (:func:`without_lease`)."""
    if (version is None or version >= 3) and attributes.mode in (ItemMode.CONSUME, ItemMode.PEEK):
        return dataclasses.replace(attributes, lease=new_lease_id())
    return attributes


def without_lease(e: UnsupportedByAgent, attributes: Attributes) -> Attributes:
    """The check again without its lease when the connection it went to turned out older than
    version 3 (the client connected, or reconnected to another agent, between reading the version
    and sending); else ``e`` raised."""
    if attributes.lease is None or e.needed < 3:
        raise e
    return dataclasses.replace(attributes, lease=None)


def check_leased(
    client: Any,
    attributes: Attributes,
    timeout: Optional[float],
    fail: Optional[FailPolicy],
    traceparent: Optional[str] = None,
) -> Tuple[Attributes, Decision]:
    """A request's check through the threaded ``client``, with a fresh lease when its connection
    speaks version 3 (:func:`with_lease`) and the request's ``traceparent``: the attributes sent
    (with the lease, if any) and the decision. A check with a lease the agent did not answer (late,
    or gone) may have been taken all the same: its release goes at once
    (:func:`release_unanswered`)."""
    attributes = with_lease(attributes, getattr(client, "protocol_version", None))
    try:
        d = client.check_request(attributes, timeout=timeout, fail=fail, traceparent=traceparent)
    except UnsupportedByAgent as e:
        attributes = without_lease(e, attributes)
        d = client.check_request(attributes, timeout=timeout, fail=fail, traceparent=traceparent)
    if not d.from_agent:
        release_unanswered(client, attributes, traceparent)
    return attributes, d


def release_attributes(attributes: Attributes) -> Attributes:
    """What gives back what a request's check took under its lease: the same attributes (the agent
    matches the same rules), the same cost and lease, mode release (rate rules only peek). A charge
    route's peek (cost 0) holds one unit of each concurrency rule: released as 1."""
    return dataclasses.replace(attributes, mode=ItemMode.RELEASE, cost=max(attributes.cost, 1))


def releases(d: Decision, attributes: Attributes) -> Optional[Attributes]:
    """The release a request owes when its response ends: when a concurrency rule holds its lease
    (an item's ``holds_lease``), :func:`release_attributes`; else ``None``."""
    if attributes.lease is not None and d.holds_lease:
        return release_attributes(attributes)
    return None


def release_now(
    client: Any, release: Attributes, timeout: Optional[float], traceparent: Optional[str] = None
) -> None:
    """Sends ``release`` through the threaded ``client``, waiting at most ``timeout`` (the client's
    when ``None``), with the request's ``traceparent``. Never raises: a release the agent cannot
    take, or that fails, is logged (its units stay held until the lease runs out)."""
    try:
        d = client.check_request(release, timeout=timeout, fail="open", traceparent=traceparent)
        release_taken(d, release.lease)
    except Exception as e:  # noqa: BLE001 - the response is sent; a release never fails it
        release_failed(e, release.lease)


def release_unanswered(client: Any, attributes: Attributes, traceparent: Optional[str] = None) -> None:
    """The precaution for a check with a lease whose answer is not the agent's (the call timed out,
    the connection went, or, ASGI, the request was cancelled while it waited): the agent may have
    taken the lease all the same, and nobody would release it for the rule's ``leaseSeconds``. The
    release (:func:`release_attributes`: the same attributes and lease, cost ``max(cost, 1)``) goes
    at once on the connection at hand, without waiting for an answer, so it never holds the request
    back; one that cannot be sent is logged at debug only (a release of a lease not held changes
    nothing). It carries the request's ``traceparent`` as the check did. Nothing for a check without a
    lease."""
    if attributes.lease is None:
        return
    let_go = getattr(client, "_release_unanswered", None)
    if let_go is None:
        # A stand-in for the SDK's client: nothing to send it through.
        precaution_not_sent(attributes.lease, f"{type(client).__name__} is not a floodgate client")
        return
    let_go(release_attributes(attributes), traceparent)
