"""The middleware's shared rules, as the Rust Layer's unit tests state them: X-Forwarded-For believed
only from trusted proxies, IPv4-mapped addresses, routes without braces, Retry-After rounding, the
binding rule's headers (its window as RateLimit-Policy's w=), wire-safe attribute values, the cost a
response reports and when it is charged, quota mode's header and the ids a handler is given (only
for a request let through); and what only the Python servers need: a client address the server took
from X-Forwarded-For, the WSGI path as apps route on it, an ASGI scope left as the server gave it."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading

import pytest

from floodgate import Attributes, Decision, FailPolicy, ItemDecision, ItemMode, Origin, Source, Verdict
from floodgate.middleware import (
    Cidr,
    build_attributes,
    client_ip,
    format_ip,
    header_text,
    over_quota_header,
    over_quota_rules,
    parse_cidrs,
    rate_limit_headers,
    rejection_body,
    retry_after_seconds,
    route_name,
    server_took_forwarded_for,
)
from floodgate.middleware import FloodgateMiddleware, _common
from floodgate.middleware._common import Settings, called_cost, reported_cost, request_check, response_cost
from floodgate.middleware.django import django_route_name
from floodgate.middleware.wsgi import default_endpoint as wsgi_endpoint


def test_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    trusted = parse_cidrs(["10.0.0.0/8", "::1"])

    def ip(peer: str, xff: list) -> str:
        got = client_ip(peer, xff, trusted)
        assert got is not None
        return format_ip(got)

    # Not from a proxy: the header is the client's own words, ignored.
    assert ip("203.0.113.9", ["1.2.3.4"]) == "203.0.113.9"
    # From a proxy: the rightmost address it did not vouch for.
    assert ip("10.0.0.2", ["6.6.6.6, 198.51.100.7, 10.0.0.5"]) == "198.51.100.7"
    # Several header lines count as one list, in order.
    assert ip("10.0.0.2", ["6.6.6.6", "198.51.100.7"]) == "198.51.100.7"
    # Garbage stops the walk at the last trusted hop (ports, brackets and zone ids are garbage too).
    for bad in ["bogus", "198.51.100.7:80", "[::2]", "fe80::1%eth0", ""]:
        assert ip("10.0.0.2", [f"198.51.100.7, {bad}"]) == "10.0.0.2", bad
    # A proxy without the header: the proxy is the client.
    assert ip("::1", []) == "::1"
    # No peer: no IP at all.
    assert client_ip(None, ["1.2.3.4"], trusted) is None
    # An IPv4-mapped peer is in an IPv4 block, and keeps its own spelling as a key.
    assert ip("::ffff:10.9.9.9", ["198.51.100.7"]) == "198.51.100.7"
    assert ip("::ffff:203.0.113.1", []) == "::ffff:203.0.113.1"


def test_a_client_the_server_took_from_x_forwarded_for_is_recognised() -> None:
    took = server_took_forwarded_for
    # uvicorn's proxy headers: the entry's host, with its port or 0; any line, any position.
    assert took(("9.9.9.9", 0), ["9.9.9.9"])
    assert took(("9.9.9.9", 5555), ["1.1.1.1, 9.9.9.9:5555"])
    assert took(("2001:db8::1", 80), ["[2001:db8::1]:80"])
    assert took(("2001:db8::1", 0), [" 2001:db8::1 "])
    assert took(("9.9.9.9", 0), ["1.1.1.1", "9.9.9.9, 127.0.0.1"])
    # Older uvicorn: the whole entry, port 0.
    assert took(("9.9.9.9:5555", 0), ["9.9.9.9:5555"])
    # A connection's own address (its port is never 0), whatever the header says about others.
    assert not took(("203.0.113.9", 51234), ["203.0.113.9"])
    assert not took(("203.0.113.9", 51234), ["9.9.9.9:51234"])
    assert not took(("203.0.113.9", 51234), [])
    assert not took(None, ["9.9.9.9"])


def test_the_wsgi_endpoint_is_the_path_apps_route_on() -> None:
    # gunicorn gives the target as sent in RAW_URI; the app routes on the decoded PATH_INFO.
    assert wsgi_endpoint({"RAW_URI": "/%6Cogin?next=/", "SCRIPT_NAME": "", "PATH_INFO": "/login"}) == "/login"
    assert wsgi_endpoint({"REQUEST_URI": "/%6Cogin", "PATH_INFO": "/login"}) == "/login"
    # WSGI carries the bytes as latin-1 text; read as UTF-8, percent-encoded when they are not.
    assert wsgi_endpoint({"SCRIPT_NAME": "/app", "PATH_INFO": "/caf\u00c3\u00a9"}) == "/app/caf\u00e9"
    assert wsgi_endpoint({"PATH_INFO": "/a b/\u00ff"}) == "/a%20b/%FF"
    assert wsgi_endpoint({"PATH_INFO": ""}) is None


def test_cidrs() -> None:
    with pytest.raises(ValueError):
        Cidr("10.0.0.0/33")
    with pytest.raises(ValueError):
        Cidr("not-an-ip")
    a = ipaddress.ip_address
    assert Cidr("::ffff:10.1.2.3").contains(a("10.1.2.3"))
    assert Cidr("10.0.0.0/8").contains(a("::ffff:10.9.9.9"))
    assert Cidr("0.0.0.0/0").contains(a("8.8.8.8"))
    assert not Cidr("0.0.0.0/0").contains(a("2001:db8::1"))
    mapped = Cidr("::ffff:10.0.0.0/104")
    assert mapped.contains(a("10.9.9.9")) and mapped.contains(a("::ffff:10.9.9.9"))
    assert not mapped.contains(a("11.0.0.1"))
    assert Cidr("10.1.2.3/8").contains(a("10.200.0.1")), "host bits are allowed, as in Rust"


def test_addresses_are_written_as_rust_writes_them() -> None:
    # RFC 5952, as Rust's Display: the longest run of zero groups (the leftmost on a tie, never a
    # single group) is "::"; lower case; an IPv4-mapped address in dotted form.
    rust = {
        "2001:0DB8:0000:0000:0000:0000:0000:0001": "2001:db8::1",
        "0:0:0:0:0:0:0:1": "::1",
        "0:0:0:0:0:0:0:0": "::",
        "2001:db8:0:0:1:0:0:1": "2001:db8::1:0:0:1",
        "1:0:0:2:0:0:0:3": "1:0:0:2::3",
        "2001:db8:0:1:1:1:1:1": "2001:db8:0:1:1:1:1:1",
        "::ffff:1.2.3.4": "::ffff:1.2.3.4",
        "0:0:0:0:0:ffff:0a00:0001": "::ffff:10.0.0.1",
        "203.0.113.5": "203.0.113.5",
    }
    for text, want in rust.items():
        assert format_ip(ipaddress.ip_address(text)) == want, text


def test_routes_lose_their_braces() -> None:
    assert route_name("/items/{id}/parts/{*rest}") == "/items/:id/parts/*rest"
    assert route_name("/items/{id:int}") == "/items/:id"
    assert route_name("/plain/path") == "/plain/path"
    assert django_route_name("api/items/<int:pk>/<slug>") == "/api/items/:pk/:slug"


def test_header_values_are_read_as_the_rust_layer_reads_them() -> None:
    assert header_text(b"  alice\t") == "alice"
    assert header_text(b"") is None and header_text(b"   ") is None and header_text(None) is None
    assert header_text("caf\u00e9") is None, "only visible ASCII: anything else counts as absent"
    assert header_text(b"a\x7fb") is None


def verdict(allowed: bool, log_only: bool, limit: int, remaining: int, reset: int, retry: int = 0) -> Verdict:
    return Verdict(allowed, log_only, Source.LOCAL, limit, remaining, reset, retry)


def agent_decision(combined: Verdict, items: list) -> Decision:
    return Decision(
        combined.allowed, combined.limit, combined.remaining, combined.reset_at_ms,
        None if combined.allowed else max(combined.retry_after_ms, 1), Origin.AGENT, combined.source,
        None, combined.log_only, items,
    )


def test_headers_come_from_the_binding_enforced_rule() -> None:
    api = verdict(True, False, 6, 5, 2_001)
    dry = verdict(False, True, 1, 0, 9_000, 500)
    d = agent_decision(api, [ItemDecision("ip-dry-run", dry), ItemDecision("api", api)])
    assert rate_limit_headers(d, ietf=True, now_ms=1_000) == [
        ("x-ratelimit-limit", "6"),
        ("x-ratelimit-remaining", "5"),
        ("x-ratelimit-reset", "3"),  # 2.001 s rounded up
        ("ratelimit-policy", '"api";q=6'),
        ("ratelimit", '"api";r=5;t=2'),
    ]
    # Only log-mode rules applied: no headers (a dry run is invisible); no rule: none either.
    only_dry = verdict(True, True, 1, 0, 9_000)
    assert rate_limit_headers(agent_decision(only_dry, [ItemDecision("ip-dry-run", dry)])) == []
    assert rate_limit_headers(agent_decision(verdict(True, False, 0, 0, 0), [])) == []
    # The SDK's own answers (fail open) carry none.
    fail_open = Decision(True, 0, 0, 5_000, None, Origin.FAIL_OPEN)
    assert rate_limit_headers(fail_open) == []


def test_the_policy_names_the_binding_rules_window_in_whole_seconds_rounded_up() -> None:
    api = verdict(True, False, 6, 5, 2_001)
    dry = verdict(False, True, 1, 0, 9_000, 500)

    def policy(window_ms: int, dry_window_ms: int = 30_000) -> str:
        items = [ItemDecision("ip-dry-run", dry, dry_window_ms), ItemDecision("api", api, window_ms)]
        h = dict(rate_limit_headers(agent_decision(api, items), ietf=True, now_ms=1_000))
        assert h["ratelimit"] == '"api";r=5;t=2', "RateLimit is unchanged"
        return h["ratelimit-policy"]

    assert policy(60_000) == '"api";q=6;w=60'
    assert policy(500) == '"api";q=6;w=1', "a 500 ms window is w=1, never w=0"
    assert policy(1_001) == '"api";q=6;w=2'
    assert policy(2_678_400_000) == '"api";q=6;w=2678400', "a 31-day month"
    # No window (a concurrency rule, an agent older than version 4): no w=, whatever other items say.
    assert policy(0) == '"api";q=6'
    # The window is the binding rule's, not a log-mode rule's.
    assert policy(3_600_000, dry_window_ms=1_000) == '"api";q=6;w=3600'
    # Without ietf, no policy at all.
    d = agent_decision(api, [ItemDecision("api", api, 60_000)])
    assert [n for n, _ in rate_limit_headers(d, now_ms=1_000)] == [
        "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"
    ]


def test_retry_after_is_whole_seconds_rounded_up_and_never_zero() -> None:
    def d(ms):  # noqa: ANN001, ANN202
        return Decision(False, 5, 0, 0, ms, Origin.FAIL_CLOSED)

    assert [retry_after_seconds(d(ms)) for ms in (1, 1_000, 1_001, 0, None)] == [1, 1, 2, 1, 1]
    assert rejection_body(4) == b'{"error":"rate_limited","retryAfter":4}'


def test_attributes_are_wire_safe_and_costed_by_endpoint() -> None:
    a = build_attributes("/search", "", "{victim}", "k" * 300, "203.0.113.5", {"/search": 5})
    assert a.endpoint == "/search" and a.cost == 5
    assert a.tier is None, "an empty value is absent, not an invalid check"
    assert a.user == "h:0a5b9694d4ec70f5", "PROTOCOL.md's worked example"
    assert a.api_key is not None and a.api_key.startswith("h:") and len(a.api_key) == 18
    assert build_attributes(None, None, None, None, None, {"/search": 5}).cost == 1


def test_fail_for_is_keyed_as_costs_and_checked_up_front() -> None:
    s = Settings(fail_for={"/login": "closed", "/items/{id}": FailPolicy.OPEN, "/health": "open"})
    assert s.fail_policy("/login") is FailPolicy.CLOSED
    assert s.fail_policy("/items/:id") is FailPolicy.OPEN, "a route's braces as costs spell them"
    assert s.fail_policy("/search") is None and s.fail_policy(None) is None
    # A route's fail_for over the middleware's fail; fail for the others.
    s = Settings(fail="closed", fail_for={"/health": "open"})
    assert (s.fail_policy("/health"), s.fail_policy("/login")) == (FailPolicy.OPEN, FailPolicy.CLOSED)
    with pytest.raises(ValueError):
        Settings(fail_for={"/login": "Closed"})
    with pytest.raises(ValueError):
        Settings(fail="shut")


def test_a_reported_cost_is_a_whole_number_that_fits_a_u32(caplog, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(_common.BAD_CHARGE, "_last", -1)
    caplog.set_level(logging.WARNING, logger="floodgate")
    good = {"1500": 1500, b"400": 400, " 7\t": 7, "0042": 42, "4294967295": 2**32 - 1}
    for raw, want in good.items():
        assert reported_cost("x-llm-tokens", raw) == want, raw
    # Nothing reported: nothing charged, nothing said.
    for raw in (None, "", b"  ", "0", "000"):
        assert reported_cost("x-llm-tokens", raw) is None, raw

    # reported_cost logs on the caller's thread: records from other threads (a client of an earlier
    # test still reconnecting in the background) are not its.
    def said_here() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.thread == threading.get_ident()]

    assert not said_here()
    # A bad value: nothing charged, said once a minute (naming the header and the value).
    for raw in ("lots", "-5", "+5", "1.5", "1e3", "4294967296", "9" * 5000, "\u0661", b"1\x002"):
        assert reported_cost("x-llm-tokens", raw) is None, raw
    said = said_here()
    assert len(said) == 1 and "x-llm-tokens" in said[0] and "'lots'" in said[0], said


def test_charge_headers_make_the_check_a_peek_of_cost_0() -> None:
    s = Settings(costs={"/search": 5}, charge_headers={"/v1/chat/{model}": "X-LLM-Tokens"})
    assert s.charge_headers == {"/v1/chat/:model": "x-llm-tokens"}, "keyed as costs, the name lower-case"

    def check(endpoint: str):  # noqa: ANN202
        return request_check(
            s,
            endpoint,
            header=lambda r, n: None,
            default_endpoint=lambda r: r,
            peer=lambda r: ("203.0.113.5", [], False),
            no_peer="",
        )

    a, _, charge = check("/v1/chat/:model")
    assert (a.endpoint, a.ip, a.cost, a.mode) == ("/v1/chat/:model", "203.0.113.5", 0, ItemMode.PEEK)
    assert charge == "x-llm-tokens"
    a, _, charge = check("/search")
    assert (a.cost, a.mode, charge) == (5, ItemMode.CONSUME, None), "other routes are unchanged"
    with pytest.raises(ValueError, match="costs and in charge_headers"):
        Settings(costs={"/v1/chat": 2}, charge_headers={"/v1/chat": "x-llm-tokens"})
    for bad in ("", "x llm", "x-tokens:", 5):
        with pytest.raises(ValueError, match="not a header name"):
            Settings(charge_headers={"/v1/chat": bad})


def test_charge_with_is_keyed_as_costs_and_makes_the_check_a_peek_of_cost_0() -> None:
    def cost(status, headers):  # noqa: ANN001, ANN202
        return 3

    s = Settings(costs={"/search": 5}, charge_headers={"/v1/chat": "x-llm-tokens"}, charge_with={"/v1/embed/{model}": cost})
    assert s.charge_with == {"/v1/embed/:model": cost}

    def check(endpoint: str):  # noqa: ANN202
        return request_check(
            s, endpoint, header=lambda r, n: None, default_endpoint=lambda r: r, peer=lambda r: ("203.0.113.5", [], False), no_peer=""
        )

    a, _, charge = check("/v1/embed/:model")
    assert (a.cost, a.mode, charge) == (0, ItemMode.PEEK, cost)
    assert check("/v1/chat")[2] == "x-llm-tokens" and check("/search")[2] is None
    with pytest.raises(ValueError, match="costs and in charge_with"):
        Settings(costs={"/v1/chat": 2}, charge_with={"/v1/chat": cost})
    with pytest.raises(ValueError, match="charge_headers and in charge_with"):
        Settings(charge_headers={"/v1/chat/{m}": "x-llm-tokens"}, charge_with={"/v1/chat/:m": cost})
    with pytest.raises(ValueError, match="not callable"):
        Settings(charge_with={"/v1/chat": "x-llm-tokens"})


def test_what_a_charge_with_callable_returns_is_a_cost_or_nothing(caplog, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(_common.BAD_CHARGE, "_last", -1)
    caplog.set_level(logging.WARNING, logger="floodgate")
    for value, want in ((1, 1), (1500, 1500), (2**32 - 1, 2**32 - 1), (None, None), (0, None)):
        assert called_cost(lambda s, h: value, 200, []) == want, value
    assert not caplog.records
    # Not a whole number from 0 to 2**32 - 1, or an exception: nothing charged, said once a minute.
    for bad in (-1, 2**32, True, 1.5, "7", b"7"):
        assert called_cost(lambda s, h: bad, 200, []) is None, bad

    def boom(status, headers):  # noqa: ANN001, ANN202
        raise KeyError("x-llm-tokens")

    assert called_cost(boom, 200, []) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "returned -1" in said[0], said
    monkeypatch.setattr(_common.BAD_CHARGE, "_last", -1)
    assert called_cost(boom, 200, []) is None
    assert "raised KeyError('x-llm-tokens')" in caplog.records[-1].getMessage()
    # The response as every framework gives it: ASGI's byte pairs are read as latin-1 text.
    seen = []
    assert response_cost(lambda s, h: seen.append((s, h)) or 9, 201, [(b"X-A", b"\xe9")]) == 9
    assert seen == [(201, [("X-A", "\xe9")])]
    assert response_cost("x-a", 200, [(b"X-A", b"12"), (b"x-a", b"13")]) == 12, "the first value"
    assert response_cost("x-a", 200, [("X-A", "14")]) == 14 and response_cost("x-a", 200, []) is None


class Recorder:
    """An AsyncClient stand-in for the ASGI middleware: answers every check allowed, recording the
    checks among the messages sent to the server."""

    def __init__(self, events: list) -> None:
        self.events = events

    async def check_request(self, attributes: Attributes, **kw: object) -> Decision:
        self.events.append(("check", attributes.mode, attributes.cost, kw.get("fail")))
        return Decision(True, 0, 0, 0, None, Origin.AGENT)


def test_asgi_charges_after_the_last_body_part_is_sent() -> None:
    events: list = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": [(b"X-LLM-Tokens", b"12")]})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        events.append("app sends its last part")
        await send({"type": "http.response.body", "body": b"b"})
        events.append("app returns")

    async def send(message) -> None:  # noqa: ANN001
        events.append((message["type"], message.get("more_body", False)))

    mw = FloodgateMiddleware(app, client=Recorder(events), charge_headers={"/v1/chat": "x-llm-tokens"})
    scope = {"type": "http", "method": "POST", "path": "/v1/chat", "headers": [], "client": ("203.0.113.5", 1)}
    asyncio.run(mw(scope, None, send))
    assert events == [
        ("check", ItemMode.PEEK, 0, None),
        ("http.response.start", False),
        ("http.response.body", True),
        "app sends its last part",
        ("http.response.body", False),
        ("check", ItemMode.CHARGE, 12, "open"),
        "app returns",
    ]

    # An app that stops without a last part (the client went away) still did the work: charged once.
    async def cut_short(scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-llm-tokens", b"5")]})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        raise OSError("gone")

    events.clear()
    mw = FloodgateMiddleware(cut_short, client=Recorder(events), charge_headers={"/v1/chat": "x-llm-tokens"})
    with pytest.raises(OSError):
        asyncio.run(mw(scope, None, send))
    checks = [e for e in events if e[0] == "check"]
    assert checks == [("check", ItemMode.PEEK, 0, None), ("check", ItemMode.CHARGE, 5, "open")]


def flagged(allowed: bool) -> Decision:
    """A check naming a flag rule past its limit (premium) and an enforced one (strict) that allowed
    it, or refused it."""
    over = Verdict(True, False, Source.REDIS, 1, 0, 1_700_000_120_000, 0, over_quota=True)
    strict = Verdict(allowed, False, Source.REDIS, 2, 0, 1_700_000_120_000, 0 if allowed else 5_000)
    binding = over if allowed else strict
    return Decision(
        allowed,
        binding.limit,
        0,
        binding.reset_at_ms,
        None if allowed else 5_000,
        Origin.AGENT,
        Source.REDIS,
        items=[ItemDecision("premium", over), ItemDecision("strict", strict)],
    )


def test_quota_mode_flags_only_a_request_let_through() -> None:
    assert over_quota_rules(flagged(True)) == ["premium"]
    # Refused by the other rule: no handler runs, nothing to route (the decision still names it).
    assert flagged(False).over_quota_rules == ["premium"] and over_quota_rules(flagged(False)) == []
    assert over_quota_rules(Decision(True, 0, 0, 0, None, Origin.FAIL_OPEN)) == []
    assert over_quota_header(["premium"]) == [("x-ratelimit-over-quota", "premium")]
    assert over_quota_header(["a", "b.c:d-e_f"]) == [("x-ratelimit-over-quota", "a,b.c:d-e_f")]
    # An id no agent sends (it could not be a header value) is left out of the header.
    assert over_quota_header(["x\r\ny", "premium"]) == [("x-ratelimit-over-quota", "premium")]
    assert over_quota_header([]) == over_quota_header(["bad id"]) == []


class Answers:
    """An AsyncClient stand-in answering every check with ``decision``."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision

    async def check_request(self, attributes: Attributes, **kw: object) -> Decision:
        return self.decision


def test_asgi_gives_the_handler_a_scope_of_its_own_with_the_ids() -> None:
    seen: list = []
    sent: list = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        seen.append(scope.get("floodgate.over_quota"))
        # The app's own header of that name gives way to the limiter's.
        headers = [(b"content-type", b"text/plain"), (b"X-RateLimit-Over-Quota", b"the app's")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message) -> None:  # noqa: ANN001
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat", "headers": [], "client": ("203.0.113.5", 1)}
    given = dict(scope)
    asyncio.run(FloodgateMiddleware(app, client=Answers(flagged(True)))(scope, None, send))
    assert seen == [["premium"]] and scope == given, "the caller's scope is as it gave it"
    headers = [(bytes(k).lower(), v) for k, v in sent[0]["headers"]]
    assert [v for k, v in headers if k == b"x-ratelimit-over-quota"] == [b"premium"], headers
    # Refused: a 429 without the header; the app never runs.
    seen.clear()
    sent.clear()
    asyncio.run(FloodgateMiddleware(app, client=Answers(flagged(False)))(scope, None, send))
    assert seen == [] and sent[0]["status"] == 429
    assert all(bytes(k).lower() != b"x-ratelimit-over-quota" for k, _ in sent[0]["headers"])
