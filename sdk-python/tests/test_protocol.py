"""The wire format: PROTOCOL.md's hex vectors both ways, the decoding rules, the limits a check is
validated against before anything is sent, the wire_safe hash PROTOCOL.md documents, a decoder
that never raises on any input, and version 2's fail-mode list (the page's endpoint pattern table and
which checks a listed rule closes) and item modes (forms 2 and 3 only when an item does not consume,
cost 0 only for a peek, an unknown mode refusing only its check), and version 3's leases and releases
(the lease bit and its u64, mode release, the verdict's holds-lease flag, what version each check
needs), version 4's rule windows (a Decision's layout read by its frame's version byte), version 5's
trace context (form 4 around any other form, traceparent parsing as the Rust crate does it, only to
a peer of version 5), version 6's reservations (modes reserve and commit, each with its
reservation id in the lease field, a commit of 0, what version each check needs) and its verdict's
over-quota flag (bit 3, read by both decoders; bits above it still refused)."""

from __future__ import annotations

import random
import re

import pytest
from conftest import PROTOCOL_MD

from floodgate import InvalidCheck
from floodgate import protocol as p
from floodgate.protocol import (
    Attributes,
    Check,
    ClosedRule,
    DecisionBody,
    Decoded,
    ErrorBody,
    ErrorCode,
    FailModeList,
    FailModes,
    Fatal,
    Frame,
    Hello,
    HelloOk,
    Item,
    ItemDecision,
    ItemMode,
    ListedDimension,
    Ping,
    Pong,
    Rejected,
    Source,
    TraceContext,
    Verdict,
)

DOC = PROTOCOL_MD.read_text()


def vector(name: str) -> bytes:
    marker = f"<!-- vector: {name} -->"
    at = DOC.index(marker)
    rest = DOC[at + len(marker):]
    start = rest.index("```hex") + len("```hex")
    end = start + rest[start:].index("```")
    return p.parse_hex(rest[start:end])


ALLOWED = Verdict(True, False, Source.REDIS, 100, 99, 1_700_000_120_000, 0)
DENIED = Verdict(False, False, Source.CACHE, 5, 0, 1_700_000_060_000, 12_000)
DRY = Verdict(False, True, Source.LOCAL, 600, 0, 1_700_000_030_000, 500)
LEASE = 0x0123_4567_89AB_CDEF
HELD = Verdict(True, False, Source.REDIS, 4, 2, 1_700_000_060_000, 0, holds_lease=True)
MONTHLY = Verdict(True, False, Source.REDIS, 10_000_000, 9_999_000, 1_704_067_200_000, 0)
DECEMBER_2023_MS = 31 * 86_400_000
OVER_QUOTA = Verdict(True, False, Source.REDIS, 100_000, 0, 1_700_000_120_000, 0, over_quota=True)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE = TraceContext(bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736"), bytes.fromhex("00f067aa0ba902b7"), 1)

FRAMES = {
    "hello": Frame(0, Hello(1, 1)),
    "hello_ok": Frame(0, HelloOk(1)),
    "check_one_item": Frame(7, Check(items=[Item("user:123", "api", 1)])),
    "check_two_items": Frame(8, Check(items=[Item("user:123", "api", 1), Item("ip:203.0.113.5", "login", 3)])),
    "check_attributes": Frame(9, Check(attributes=Attributes(endpoint="/search", tier="free", api_key="abc", cost=2))),
    "decision_allowed": Frame(7, DecisionBody(ALLOWED, [ItemDecision("api", ALLOWED)])),
    "decision_denied": Frame(8, DecisionBody(DENIED, [ItemDecision("login", DENIED), ItemDecision("ip-dry-run", DRY)])),
    "error_unknown_rule": Frame(7, ErrorBody(ErrorCode.UNKNOWN_RULE, 'unknown rule "nope"')),
    "ping": Frame(3, Ping()),
    "pong": Frame(3, Pong()),
    "hello_v2": Frame(0, Hello(1, 2)),
    "hello_ok_v2": Frame(0, HelloOk(2)),
    "fail_modes": Frame(11, FailModes()),
    "check_modes": Frame(12, Check(items=[Item.peek("user:123", "tokens", 0), Item.charge("user:123", "llm", 1500)])),
    "check_attributes_charge": Frame(
        13, Check(attributes=Attributes(endpoint="/v1/chat", api_key="abc", cost=900, mode=ItemMode.CHARGE))
    ),
    "hello_v3": Frame(0, Hello(1, 3)),
    "hello_ok_v3": Frame(0, HelloOk(3)),
    "check_acquire": Frame(14, Check(items=[Item.acquire("apikey:abc", "gpu-slots", 2, LEASE)])),
    "decision_lease": Frame(14, DecisionBody(HELD, [ItemDecision("gpu-slots", HELD)])),
    "check_release": Frame(
        15, Check(items=[Item.release("apikey:abc", "gpu-slots", 2, LEASE), Item.release("apikey:xyz", "gpu-slots", 1)])
    ),
    "check_attributes_lease": Frame(16, Check(attributes=Attributes(endpoint="/v1/chat", api_key="abc", cost=1, lease=42))),
    "hello_v4": Frame(0, Hello(1, 4)),
    "hello_ok_v4": Frame(0, HelloOk(4)),
    "hello_v5": Frame(0, Hello(1, 5)),
    "hello_ok_v5": Frame(0, HelloOk(5)),
    "hello_v6": Frame(0, Hello(1, 6)),
    "hello_ok_v6": Frame(0, HelloOk(6)),
    "check_reserve": Frame(
        19,
        Check(
            items=[
                Item.reserve("apikey:abc", "output-tokens", 4096, LEASE),
                Item.reserve("apikey:abc", "in-flight", 1, LEASE),
            ]
        ),
    ),
    "check_commit": Frame(
        20,
        Check(
            items=[
                Item.commit("apikey:abc", "output-tokens", 612, LEASE),
                Item.commit("apikey:abc", "in-flight", 0, LEASE),
            ]
        ),
    ),
    "decision_over_quota": Frame(21, DecisionBody(OVER_QUOTA, [ItemDecision("gpt-tokens", OVER_QUOTA)])),
    "check_traced": Frame(18, Check(items=[Item("user:123", "api", 1)], trace=TRACE)),
    "decision_windows": Frame(
        17,
        DecisionBody(ALLOWED, [ItemDecision("api", ALLOWED, 60_000), ItemDecision("monthly", MONTHLY, DECEMBER_2023_MS)]),
    ),
    "fail_mode_list": Frame(
        11,
        FailModeList(
            42,
            False,
            [
                ClosedRule("login-per-ip", ListedDimension.IP, "/login", "", 5),
                ClosedRule("admin-per-user", ListedDimension.USER, "/admin/*", "staff", 100),
            ],
        ),
    ),
}


def test_every_vector_in_protocol_md_is_covered() -> None:
    named = set(re.findall(r"<!-- vector: ([a-z0-9_]+) -->", DOC))
    assert named == set(FRAMES), "PROTOCOL.md's vectors and this test's frames differ"


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_vector_encodes_to_its_bytes(name: str) -> None:
    assert p.encode(FRAMES[name]).hex(" ") == vector(name).hex(" ")


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_vector_decodes_to_its_frame(name: str) -> None:
    data = vector(name)
    assert p.decode(data) == Decoded(FRAMES[name], len(data))
    # Every prefix is incomplete, never an error.
    for cut in range(len(data)):
        assert p.decode(data[:cut]) is None, cut
    # Two frames back to back: the second starts where the first ended.
    twice = data + data
    first = p.decode(twice)
    assert isinstance(first, Decoded)
    assert p.decode(twice, first.used) == Decoded(FRAMES[name], len(data))


def test_the_client_fast_path_builds_the_vectors_bytes() -> None:
    assert p.check_items_frame(8, [("user:123", "api"), Item("ip:203.0.113.5", "login", 3)]) == vector("check_two_items")
    assert p.check_attributes_frame(9, Attributes("/search", "free", None, "abc", None, 2)) == vector("check_attributes")
    assert p.check_one_frame(7, "user:123", "api", 1) == vector("check_one_item")
    assert p.HELLO_FRAME == vector("hello_v6")
    assert p.fail_modes_frame(11) == vector("fail_modes")
    modes = vector("check_modes")
    assert p.check_items_frame(12, [("user:123", "tokens", 0, "peek"), ("user:123", "llm", 1500, 2)]) == modes
    charge = Attributes("/v1/chat", None, None, "abc", None, 900, ItemMode.CHARGE)
    assert p.check_attributes_frame(13, charge) == vector("check_attributes_charge")
    # One item, the fast path of peek and charge: form 2 whenever the item does not consume.
    one = p.check_one_frame(12, "user:123", "llm", 1500, ItemMode.CHARGE)
    assert one == p.check_items_frame(12, [Item.charge("user:123", "llm", 1500)])
    assert one[10:12] == b"\x02\x01" and one[-1] == ItemMode.CHARGE
    assert p.check_one_frame(7, "user:123", "api", 1, ItemMode.CONSUME) == vector("check_one_item")
    status, value, used = p.decode_reply(vector("decision_denied"), 0)
    assert (status, used) == (1, len(vector("decision_denied")))
    assert value == (8, FRAMES["decision_denied"].body)
    # The client reads HelloOk of any version and the list; an agent never sends FailModes.
    hellos = ("hello_ok", "hello_ok_v2", "hello_ok_v3", "hello_ok_v4", "hello_ok_v5", "hello_ok_v6")
    for name in (*hellos, "fail_mode_list"):
        data = vector(name)
        assert p.decode_reply(data, 0) == (1, (FRAMES[name].request_id, FRAMES[name].body), len(data))
    assert p.decode_reply(vector("fail_modes"), 0)[0] == 3


def test_wire_safe_matches_the_worked_example_in_protocol_md() -> None:
    m = re.search(r'`wire_safe\("(.+?)"\)` = `(h:[0-9a-f]{16})`', DOC)
    assert m, "PROTOCOL.md has no wire_safe worked example"
    value, expected = m.groups()
    assert p.wire_safe(value) == expected
    # The example's bytes as PROTOCOL.md lists them.
    listed = re.search(r"`" + re.escape(value) + r"` is the bytes `([0-9a-f ]+)`", DOC)
    assert listed and p.parse_hex(listed.group(1)) == value.encode()


def test_fnv1a64_known_values_and_wire_safe_rules() -> None:
    # Reference values of 64-bit FNV-1a (the algorithm's published test vectors).
    assert p.fnv1a64(b"") == 0xCBF29CE484222325
    assert p.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert p.fnv1a64(b"foobar") == 0x85944171F73967E8
    assert p.wire_safe("alice") == "alice"
    assert p.wire_safe("x" * 256) == "x" * 256  # 256 bytes is still fine
    for odd in ["x" * 257, "é" * 129, "{", "}", "a\x07b", "tab\there", "nel\x85", "del\x7f"]:
        h = p.wire_safe(odd)
        assert re.fullmatch(r"h:[0-9a-f]{16}", h), (odd, h)
        assert h == f"h:{p.fnv1a64(odd.encode()):016x}"
        # The hash is itself a valid attribute.
        p.attributes_body(Attributes(user=h))
    assert p.wire_safe("{") != p.wire_safe("}")
    assert p.wire_safe("ü") == "ü"  # non-ASCII text is fine when short and printable
    # A lone surrogate (undecodable bytes carried by surrogateescape) is no valid UTF-8: hashed.
    assert p.wire_safe("a\udcff").startswith("h:")


@pytest.mark.parametrize(
    "items",
    [
        [],
        [("", "r", 1)],
        [("k" * 257, "r", 1)],
        [("é" * 129, "r", 1)],  # 258 bytes of UTF-8, 129 characters
        [("a{b", "r", 1)],
        [("a}b", "r", 1)],
        [("a\nb", "r", 1)],
        [("a\u0085b", "r", 1)],  # Cc, as Rust's char::is_control
        [("k", "", 1)],
        [("k", "r" * 129, 1)],
        [("k", "bad rule", 1)],
        [("k", "régle", 1)],
        [("k", "r", 0)],
        [("k", "r", 2**32)],
        [("k", "r", "1")],
        [(1, "r", 1)],
        [("k",)],
        [("k", "r", 1)] * 17,
    ],
)
def test_invalid_items_are_refused_before_sending(items) -> None:  # noqa: ANN001
    with pytest.raises(InvalidCheck):
        p.check_items_frame(1, items)


def test_limits_are_inclusive() -> None:
    p.check_items_frame(1, [("k" * 256, "r" * 128, 2**32 - 1)] * 16)
    p.check_items_frame(1, [("é" * 128, "a-b_c.d:e", 1)])  # 256 bytes


@pytest.mark.parametrize("field", ["endpoint", "tier", "user", "api_key", "ip"])
def test_invalid_attributes_are_refused(field: str) -> None:
    for bad in ["", "x" * 257, "{tag}", "a\x00b"]:
        with pytest.raises(InvalidCheck):
            p.check_attributes_frame(1, Attributes(**{field: bad}))
    with pytest.raises(InvalidCheck):
        p.check_attributes_frame(1, Attributes(cost=0))
    p.check_attributes_frame(1, Attributes(**{field: "x" * 256}))


def _frame(kind: int, rid: int, body: bytes, version: int = 1, length: int = -1) -> bytes:
    n = 6 + len(body) if length < 0 else length
    return n.to_bytes(4, "big") + bytes((version, kind)) + rid.to_bytes(4, "big") + body


def test_decoding_rules() -> None:
    verdict = p._verdict_bytes(ALLOWED)
    # 2: over the limit, before the body arrives; the request id named when the header is there.
    assert p.decode(_frame(4, 9, b"", length=65533)) == Fatal(
        ErrorCode.FRAME_TOO_LARGE, 9, "frame of 65537 bytes exceeds the 65536-byte limit"
    )
    assert isinstance(p.decode(b"\xff\xff\xff\xff"), Fatal)
    # The largest length is accepted (and waits for its body).
    assert p.decode(_frame(4, 9, b"", length=65532)) is None
    # 3: shorter than the header.
    assert p.decode(b"\x00\x00\x00\x05\x01\x04\x00\x00\x00").code == ErrorCode.MALFORMED_FRAME  # type: ignore[union-attr]
    # 4: unknown kind, trailing bytes, a short body, unknown flags or source, 17 items.
    for bad in [
        _frame(0x0A, 1, b""),
        _frame(0x07, 1, b"\x00"),
        _frame(0x08, 1, b"\x00", version=2),
        _frame(0x09, 1, b"", version=2),
        _frame(0x04, 1, verdict[:-1]),
        _frame(0x04, 1, verdict + b"\x00\x00"),
        _frame(0x04, 1, b"\x10" + verdict[1:] + b"\x00"),
        _frame(0x04, 1, verdict[:1] + b"\x04" + verdict[2:] + b"\x00"),
        _frame(0x04, 1, verdict + b"\x11" + (b"\x01r" + verdict) * 17),
        _frame(0x05, 1, b"\x00\x04\x00\x10short"),
    ]:
        r = p.decode(bad)
        assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME, (bad.hex(), r)
    # A fail-mode list with unknown flags, an unknown dimension, a rule cut short, or bytes after.
    listed = vector("fail_mode_list")
    body = listed[10:]
    for bad in [
        _frame(0x09, 11, body[:8] + b"\x02" + body[9:], version=2),
        _frame(0x09, 11, body[:24] + b"\x04" + body[25:], version=2),
        _frame(0x09, 11, body[:-1], version=2),
        _frame(0x09, 11, body + b"\x00", version=2),
    ]:
        r = p.decode(bad)
        assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME, (bad.hex(), r)
    assert body[24] == ListedDimension.IP, "the byte changed above is the first rule's dimension"
    # Either version byte is read on any kind (a version-2 peer accepts both).
    v2 = _frame(0x04, 5, verdict + b"\x00", version=2)
    assert p.decode(v2) == Decoded(Frame(5, DecisionBody(ALLOWED, [])), len(v2))
    assert p.decode(_frame(0x09, 11, body, version=1)) == Decoded(FRAMES["fail_mode_list"], len(listed))
    # Refused but well delimited: another version, text that is not UTF-8. Skip and go on.
    other_version = _frame(0x04, 5, verdict + b"\x00", version=7)
    assert p.decode(other_version) == Rejected(
        ErrorCode.UNSUPPORTED_VERSION, 5, "frame version 7; this peer speaks versions 1 to 6", len(other_version)
    )
    bad_text = _frame(0x04, 6, verdict + b"\x01\x02\xff\xfe" + verdict)
    r = p.decode(bad_text)
    assert isinstance(r, Rejected) and (r.code, r.request_id, r.frame_len) == (ErrorCode.INVALID_ITEM, 6, len(bad_text))
    # A Hello of any version is read (it announces the range itself).
    assert p.decode(_frame(0x01, 0, b"\x02\x03", version=2)) == Decoded(Frame(0, Hello(2, 3)), 12)
    # Unknown error codes are kept, not refused.
    r = p.decode(_frame(0x05, 4, b"\x03\xe7\x00\x02hi"))
    assert r == Decoded(Frame(4, ErrorBody(999, "hi")), 16)
    # A Check that breaks a limit is refused for its id (error 5), not fatal.
    r = p.decode(_frame(0x03, 3, b"\x00\x01\x00\x03a{b\x01r\x00\x00\x00\x01"))
    assert isinstance(r, Rejected) and r.code == ErrorCode.INVALID_ITEM


def test_decoder_never_raises_on_any_input() -> None:
    rng = random.Random(13)
    seeds = [vector(n) for n in FRAMES]
    kinds = {Decoded, Rejected, Fatal, type(None)}
    for i in range(20_000):
        if i % 4 == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        else:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(len(data))
                data[at] = rng.randrange(256)
            if rng.random() < 0.3:
                data = data[: rng.randrange(len(data) + 1)]
            data = bytes(data)
        r = p.decode(data)
        assert type(r) in kinds
        if isinstance(r, Decoded):
            assert 10 <= r.used <= len(data)
        status, value, used = p.decode_reply(data, 0)
        assert status in (0, 1, 2, 3) and used >= 0
        # The client's fast path agrees with the full decoder.
        if r is None:
            assert status == 0
        elif isinstance(r, Decoded) and isinstance(
            r.frame.body, (DecisionBody, ErrorBody, HelloOk, Pong, FailModeList)
        ):
            assert (status, value, used) == (1, (r.frame.request_id, r.frame.body), r.used)
        elif isinstance(r, Rejected):
            assert (status, value, used) == (2, r.request_id, r.frame_len)
        else:
            assert status == 3


# --- version 2: the fail-mode list ------------------------------------------------------------------


def test_endpoint_patterns_as_the_protocol_page_lists_them() -> None:
    # The page's table itself, so that the page and this test cannot drift (as the Rust test does).
    rows = 0
    for line in DOC.splitlines():
        if not line.startswith("| `/"):
            continue
        cells = [c.strip().strip("`") for c in line.split("|")]
        pattern, endpoint, want = cells[1], cells[2], cells[3] == "yes"
        assert p.endpoint_matches(pattern, endpoint) is want, (pattern, endpoint)
        rows += 1
    assert rows == 10, "the page's pattern table"


LOGIN = ClosedRule("login-per-ip", ListedDimension.IP, "/login", "", 5)


def attributes(**kw: object) -> Check:
    return Check(attributes=Attributes(**kw))  # type: ignore[arg-type]


def test_items_touch_a_listed_rule_they_name() -> None:
    api = ClosedRule("api", ListedDimension.USER, "/api/*", "", 100)
    listed = FailModeList(1, False, [api, LOGIN])
    named = Check(items=[Item("a", "other", 1), Item("ip:1", "login-per-ip", 1)])
    assert listed.closing(named) is LOGIN
    assert listed.closing(Check(items=[("a", "other")])) is None
    # Two listed rules named: the first in the list's order decides, whichever item comes first.
    both = Check(items=[("ip:1", "login-per-ip", 1), ("u:1", "api", 1)])
    assert listed.closing(both) is api
    # Items name rules: their attributes do not matter.
    assert LOGIN.touches(Check(items=[("anything", "login-per-ip", 1)]))


def test_attributes_touch_a_listed_rule_the_agent_would_match() -> None:
    assert LOGIN.touches(attributes(endpoint="/login", ip="203.0.113.5"))
    assert not LOGIN.touches(attributes(endpoint="/login")), "no IP: the rule would not apply"
    assert not LOGIN.touches(attributes(endpoint="/login", ip="")), "an empty IP is absent"
    assert not LOGIN.touches(attributes(endpoint="/login", user="u")), "another dimension"
    assert not LOGIN.touches(attributes(endpoint="/search", ip="203.0.113.5"))
    assert not LOGIN.touches(attributes(ip="203.0.113.5")), "no endpoint: a pattern cannot match"
    everywhere = ClosedRule("ip-all", ListedDimension.IP, "", "", 9)
    assert everywhere.touches(attributes(ip="1")) and everywhere.touches(attributes(endpoint="/x", ip="1"))
    staff = ClosedRule("admin-per-user", ListedDimension.USER, "/admin/*", "staff", 100)
    assert staff.touches(attributes(endpoint="/admin/users", tier="staff", user="u"))
    assert not staff.touches(attributes(endpoint="/admin/users", user="u")), "tier absent"
    assert not staff.touches(attributes(endpoint="/admin/users", tier="free", user="u"))
    assert not staff.touches(attributes(endpoint="/admin", tier="staff", user="u"))
    key = ClosedRule("key", ListedDimension.API_KEY, "", "", 3)
    assert key.touches(attributes(api_key="k")) and not key.touches(attributes(user="u"))
    descriptor = ClosedRule("d", ListedDimension.DESCRIPTOR, "", "", 1)
    assert not descriptor.touches(attributes(endpoint="/login", ip="1", user="u", api_key="k"))
    # The first listed rule the check touches is the one that closes it.
    listed = FailModeList(7, False, [staff, everywhere, LOGIN])
    assert listed.closing(attributes(endpoint="/login", ip="1")) is everywhere
    assert FailModeList().closing(attributes(endpoint="/login", ip="1")) is None


# --- version 2: item modes ----------------------------------------------------------------------------


def test_forms_2_and_3_only_when_an_item_does_not_consume() -> None:
    # Consume given explicitly, as an ItemMode, its value or its name: version 1's forms, byte for byte.
    for mode in (ItemMode.CONSUME, 0, "consume"):
        assert p.check_items_frame(8, [("user:123", "api", 1, mode), Item("ip:203.0.113.5", "login", 3)]) == vector(
            "check_two_items"
        )
        a = Attributes(endpoint="/search", tier="free", api_key="abc", cost=2, mode=mode)  # type: ignore[arg-type]
        assert p.check_attributes_frame(9, a) == vector("check_attributes")
        assert p.check_one_frame(7, "user:123", "api", 1, mode) == vector("check_one_item")  # type: ignore[arg-type]
    # One item that does not consume makes the whole check form 2, every item with its mode.
    mixed = p.check_items_frame(1, [("a", "r", 1), Item.peek("b", "r")])
    assert mixed[10:12] == b"\x02\x02"
    both = Check(items=[Item("a", "r", 1), Item("b", "r", 0, ItemMode.PEEK)])
    assert p.decode(mixed) == Decoded(Frame(1, both), len(mixed))
    # What a connection must have said in its HelloOk to be sent each.
    assert p.check_version(vector("check_modes")) == p.check_version(vector("check_attributes_charge")) == 2
    for name in ("check_one_item", "check_two_items", "check_attributes"):
        assert p.check_version(vector(name)) == 1


def test_a_peek_may_have_cost_0_the_other_modes_need_1() -> None:
    p.check_items_frame(1, [Item.peek("k", "r", 0)])
    p.check_one_frame(1, "k", "r", 0, ItemMode.PEEK)
    p.check_attributes_frame(1, Attributes(user="u", cost=0, mode=ItemMode.PEEK))
    for mode in (ItemMode.CONSUME, ItemMode.CHARGE):
        with pytest.raises(InvalidCheck, match="cost must be an int from 1"):
            p.check_items_frame(1, [("k", "r", 0, mode)])
        with pytest.raises(InvalidCheck):
            p.check_one_frame(1, "k", "r", 0, mode)
        with pytest.raises(InvalidCheck):
            p.check_attributes_frame(1, Attributes(user="u", cost=0, mode=mode))
    with pytest.raises(InvalidCheck, match="a peek's cost"):
        p.check_items_frame(1, [Item.peek("k", "r", -1)])
    # The largest cost is the same for every mode.
    p.check_items_frame(1, [Item.peek("k", "r", 2**32 - 1), Item.charge("k", "s", 2**32 - 1)])
    # A decoded check is held to the same rules: a charge of 0 refuses the check, a peek of 0 does not.
    peek0 = _frame(0x03, 4, b"\x02\x01\x00\x01k\x01r\x00\x00\x00\x00\x01")
    assert p.decode(peek0) == Decoded(Frame(4, Check(items=[Item.peek("k", "r", 0)])), len(peek0))
    charge0 = _frame(0x03, 4, b"\x02\x01\x00\x01k\x01r\x00\x00\x00\x00\x02")
    r = p.decode(charge0)
    assert isinstance(r, Rejected) and (r.code, r.request_id, r.frame_len) == (ErrorCode.INVALID_ITEM, 4, len(charge0))
    assert "cost" in r.reason


@pytest.mark.parametrize("mode", [6, 0x80, 0x83, 0x84, 255, -1, True, "Peek", "borrow", None, 1.0])
def test_an_unknown_mode_is_refused_before_sending(mode: object) -> None:
    with pytest.raises(InvalidCheck, match="item mode"):
        p.check_items_frame(1, [("k", "r", 1, mode)])
    with pytest.raises(InvalidCheck, match="item mode"):
        p.check_one_frame(1, "k", "r", 1, mode)  # type: ignore[arg-type]
    with pytest.raises(InvalidCheck, match="item mode"):
        p.check_attributes_frame(1, Attributes(user="u", mode=mode))  # type: ignore[arg-type]


def test_an_unknown_mode_on_the_wire_refuses_only_its_check() -> None:
    # The body parses: refused as invalid (error 5) for its request id, like text that is not UTF-8;
    # the next frame starts right after it.
    modes = bytearray(vector("check_modes"))
    modes[-1] = 6
    charge = bytearray(vector("check_attributes_charge"))
    charge[-1] = 0x7F  # bit 7 clear: no lease follows
    for bad, rid in ((bytes(modes), 12), (bytes(charge), 13)):
        r = p.decode(bad + vector("ping"))
        assert r == Rejected(ErrorCode.INVALID_ITEM, rid, f"unknown item mode {bad[-1]}", len(bad))
        assert p.decode(bad + vector("ping"), r.frame_len) == Decoded(FRAMES["ping"], len(vector("ping")))
    # Form 2 or 3 without its mode byte, or an unknown form: the body does not parse.
    for cut in (vector("check_modes")[:-1], vector("check_attributes_charge")[:-1]):
        body = cut[10:]
        r = p.decode(_frame(0x03, 1, body))
        assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME, r
    r = p.decode(_frame(0x03, 1, b"\x05" + vector("check_modes")[11:]))
    assert isinstance(r, Fatal) and "unknown check form 5" in r.reason


# --- version 3: leases and releases -----------------------------------------------------------------


def test_the_client_fast_path_builds_the_lease_vectors() -> None:
    acquire = vector("check_acquire")
    assert p.check_one_frame(14, "apikey:abc", "gpu-slots", 2, ItemMode.CONSUME, LEASE) == acquire
    assert p.check_items_frame(14, [("apikey:abc", "gpu-slots", 2, "consume", LEASE)]) == acquire
    release = [("apikey:abc", "gpu-slots", 2, "release", LEASE), ("apikey:xyz", "gpu-slots", 1, ItemMode.RELEASE)]
    assert p.check_items_frame(15, release) == vector("check_release")
    one = p.check_one_frame(15, "apikey:xyz", "gpu-slots", 1, ItemMode.RELEASE)
    assert one == p.check_items_frame(15, [Item.release("apikey:xyz", "gpu-slots", 1)]) and one[-1] == 3
    leased = Attributes("/v1/chat", None, None, "abc", None, 1, ItemMode.CONSUME, 42)
    assert p.check_attributes_frame(16, leased) == vector("check_attributes_lease")
    # Both decoders read the holds-lease flag, on the item and on the combined verdict.
    data = vector("decision_lease")
    assert p.decode_reply(data, 0) == (1, (14, FRAMES["decision_lease"].body), len(data))
    assert data[10] == 0x05 and FRAMES["decision_lease"].body.items[0].holds_lease
    # A consume without a lease is still version 1's form 0; with one, form 2 with bit 7 and a u64.
    assert p.check_one_frame(7, "user:123", "api", 1, ItemMode.CONSUME, None) == vector("check_one_item")
    assert p.check_items_frame(1, [Item.acquire("k", "r", 1, 0)])[-9:] == b"\x80" + bytes(8), "lease 0 is a lease"
    top = p.check_items_frame(1, [Item.acquire("k", "r", 1, 2**64 - 1)])
    assert top[-9:] == b"\x80" + b"\xff" * 8
    assert p.decode(top) == Decoded(Frame(1, Check(items=[Item.acquire("k", "r", 1, 2**64 - 1)])), len(top))


def test_what_version_each_check_needs() -> None:
    for name in ("check_acquire", "check_release", "check_attributes_lease"):
        assert p.check_version(vector(name)) == 3, name
    assert p.check_version(vector("check_modes")) == 2
    # A lease or a release anywhere in the check, behind items that only need version 2.
    peek = Item.peek("user:1", "tokens", 0)
    assert p.check_version(p.check_items_frame(1, [peek, Item.charge("u", "r", 5)])) == 2
    assert p.check_version(p.check_items_frame(1, [peek, ("k" * 200, "r", 1, "consume", 9)])) == 3
    assert p.check_version(p.check_items_frame(1, [peek, Item.release("k", "r", 1)])) == 3
    assert p.check_version(p.check_items_frame(1, [Item("k", "r", 1), Item.acquire("k", "s", 1, 1)])) == 3
    # Attributes: a lease on any mode, or a release without one.
    for mode, lease, need in ((ItemMode.PEEK, None, 2), (ItemMode.PEEK, 5, 3), (ItemMode.RELEASE, None, 3)):
        a = Attributes("/x" * 50, "t", "u", "k", "203.0.113.5", 1, mode, lease)
        assert p.check_version(p.check_attributes_frame(1, a)) == need, (mode, lease)


@pytest.mark.parametrize("lease", [-1, 2**64, True, "1", 1.5])
def test_an_invalid_lease_is_refused_before_sending(lease: object) -> None:
    with pytest.raises(InvalidCheck, match="a lease is an int"):
        p.check_items_frame(1, [("k", "r", 1, "consume", lease)])
    with pytest.raises(InvalidCheck, match="a lease is an int"):
        p.check_one_frame(1, "k", "r", 1, ItemMode.CONSUME, lease)  # type: ignore[arg-type]
    with pytest.raises(InvalidCheck, match="a lease is an int"):
        p.check_attributes_frame(1, Attributes(user="u", lease=lease))  # type: ignore[arg-type]


def test_a_release_takes_a_cost_of_at_least_1() -> None:
    with pytest.raises(InvalidCheck, match="cost must be an int from 1"):
        p.check_items_frame(1, [Item.release("k", "r", 0, 7)])
    with pytest.raises(InvalidCheck):
        p.check_attributes_frame(1, Attributes(user="u", cost=0, mode=ItemMode.RELEASE))


def test_the_lease_bit_on_the_wire() -> None:
    # An unknown mode with the lease bit: the lease is read (the frame stays delimited), and only
    # the check is refused; the next frame starts right after it.
    acquire = bytearray(vector("check_acquire"))
    assert acquire[-9] == 0x80
    acquire[-9] = 0x86
    r = p.decode(bytes(acquire) + vector("ping"))
    assert r == Rejected(ErrorCode.INVALID_ITEM, 14, "unknown item mode 6", len(acquire))
    assert p.decode(bytes(acquire) + vector("ping"), r.frame_len) == Decoded(FRAMES["ping"], len(vector("ping")))
    # The lease bit without its 8 bytes, or bytes after a mode without the bit: malformed.
    for bad in (vector("check_acquire")[10:-1], vector("check_attributes_lease")[10:-8], vector("check_modes")[10:] + bytes(8)):
        r = p.decode(_frame(0x03, 1, bad))
        assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME, (bad.hex(" "), r)


# --- version 4: rule windows ------------------------------------------------------------------------


def test_a_decision_is_read_by_its_frames_version_byte() -> None:
    # Version 1's layout: no window, read as 0, by both decoders.
    for name in ("decision_allowed", "decision_denied", "decision_lease"):
        data = vector(name)
        assert data[4] == 1, name
        r = p.decode(data)
        assert isinstance(r, Decoded) and [it.window_ms for it in r.frame.body.items] == [0] * len(r.frame.body.items)
        assert p.decode_reply(data, 0) == (1, (r.frame.request_id, r.frame.body), len(data))
    # Version 4's: each item's window after its verdict, by both decoders.
    data = vector("decision_windows")
    assert data[4] == 4
    body = FRAMES["decision_windows"].body
    assert p.decode_reply(data, 0) == (1, (17, body), len(data))
    assert [it.window_ms for it in body.items] == [60_000, 2_678_400_000]
    # Versions 2 and 3 added no Decision field: their Decision is version 1's layout.
    v1 = vector("decision_allowed")
    for version in (2, 3):
        data = v1[:4] + bytes((version,)) + v1[5:]
        assert p.decode(data) == Decoded(FRAMES["decision_allowed"], len(data)), version
        assert p.decode_reply(data, 0) == (1, (7, FRAMES["decision_allowed"].body), len(data)), version
    # The same bytes under the other version byte: a window missing, or one too many (malformed).
    windows = vector("decision_windows")
    for bad in (v1[:4] + b"\x04" + v1[5:], windows[:4] + b"\x01" + windows[5:]):
        r = p.decode(bad)
        assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME, (bad.hex(" "), r)
        assert p.decode_reply(bad, 0)[0] == 3
    # A window cut short.
    short = _frame(0x04, 17, windows[10:-1], version=4)
    assert isinstance(p.decode(short), Fatal) and p.decode_reply(short, 0)[0] == 3


def test_windows_go_only_to_a_peer_of_version_4() -> None:
    frame = FRAMES["decision_windows"]
    old = p.encode(frame, peer_version=3)
    assert old[4] == 1, "a version-3 peer gets version 1's decision"
    assert len(old) + 2 * 8 == len(vector("decision_windows")), "a u64 per item"
    r = p.decode(old)
    assert isinstance(r, Decoded) and all(it.window_ms == 0 for it in r.frame.body.items)
    assert p.encode(frame, peer_version=4) == p.encode(frame) == vector("decision_windows")
    # No window to carry (no items, or only concurrency rules): still version 1's frame.
    assert p.encode(FRAMES["decision_lease"]) == vector("decision_lease")
    assert p.encode(Frame(5, DecisionBody(ALLOWED, [])))[4] == 1
    # The largest window survives the trip.
    top = Frame(18, DecisionBody(ALLOWED, [ItemDecision("api", ALLOWED, 2**64 - 1)]))
    data = p.encode(top)
    assert data[4] == 4 and p.decode(data) == Decoded(top, len(data))
    assert p.decode_reply(data, 0) == (1, (18, top.body), len(data))


# --- version 5: trace context -----------------------------------------------------------------------


def test_traceparents_round_trip_and_bad_ones_are_refused() -> None:
    # As floodgate_protocol::trace's test.
    t = TraceContext.parse(TRACEPARENT)
    assert t == TRACE and t.sampled and t.is_valid()
    assert t.span_id == bytes([0x00, 0xF0, 0x67, 0xAA, 0x0B, 0xA9, 0x02, 0xB7])
    assert t.traceparent() == TRACEPARENT
    # A later version, read by its first fields (with more after a dash, or none).
    assert TraceContext.parse("cc" + TRACEPARENT[2:] + "-what-comes-next") == TRACE
    assert TraceContext.parse("cc" + TRACEPARENT[2:]) == TRACE
    for bad in [
        "",
        TRACEPARENT + "-extra",
        "ff" + TRACEPARENT[2:],
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
        # And more: a later version's fields run on without a dash; a field too short; upper-case
        # in the version, span or flags; a non-hex version; not a str at all.
        "cc" + TRACEPARENT[2:] + "x",
        TRACEPARENT[:-1],
        "0A" + TRACEPARENT[2:],
        TRACEPARENT.replace("00f067aa", "00F067AA"),
        TRACEPARENT[:-2] + "0A",
        "zz" + TRACEPARENT[2:],
        TRACEPARENT.replace("-", "_"),
        None,
        TRACEPARENT.encode(),
        42,
    ]:
        assert TraceContext.parse(bad) is None, bad  # type: ignore[arg-type]
    # Surrounding white space is trimmed, as Rust's str::trim does (Unicode White_Space, which
    # U+001C, a Python str.isspace() character, is not).
    assert TraceContext.parse(f" \t{TRACEPARENT}\r\n\u3000") == TRACE
    assert TraceContext.parse(TRACEPARENT + "\x1c") is None
    # Flags are kept whole, whatever their bits; unsampled is flags 0.
    assert TraceContext.parse(TRACEPARENT[:-2] + "ff").flags == 0xFF  # type: ignore[union-attr]
    unsampled = TraceContext.parse(TRACEPARENT[:-2] + "00")
    assert unsampled is not None and not unsampled.sampled and unsampled.traceparent() == TRACEPARENT[:-2] + "00"


def test_a_trace_context_is_16_and_8_bytes_and_a_flag_byte() -> None:
    for trace_id, span_id, flags in (
        (bytes(15), bytes(8), 0),
        (bytes(16), bytes(9), 0),
        ("4bf92f3577b34da6a3ce929d0e0e4736", bytes(8), 0),
        (bytes(16), bytes(8), 256),
        (bytes(16), bytes(8), -1),
        (bytes(16), bytes(8), True),
    ):
        with pytest.raises(InvalidCheck):
            TraceContext(trace_id, span_id, flags)  # type: ignore[arg-type]
    # All-zero ids make a context, an invalid one (the decoder and the agent drop it).
    assert not TraceContext(bytes(16), bytes(8)).is_valid()


def test_the_client_fast_path_wraps_any_check_in_form_4() -> None:
    # The clients build the plain frame, then wrap it for a version-5 connection.
    assert p.traced(p.check_one_frame(18, "user:123", "api", 1), TRACE) == vector("check_traced")
    assert p.traced(p.check_items_frame(18, [("user:123", "api")]), TRACE) == vector("check_traced")
    assert p.check_version(vector("check_traced")) == 5
    # Around every other form, both ways; the check's own version needs stay behind the context.
    for name in ("check_two_items", "check_attributes", "check_modes", "check_attributes_charge", "check_acquire",
                 "check_release", "check_attributes_lease"):
        plain = vector(name)
        wrapped = p.traced(plain, TRACE)
        assert wrapped[:4] == (len(plain) - 4 + 26).to_bytes(4, "big") and wrapped[4:10] == plain[4:10], name
        assert wrapped[10:36] == b"\x04" + TRACE.trace_id + TRACE.span_id + b"\x01" and wrapped[36:] == plain[10:]
        check = FRAMES[name].body
        want = Check(check.items, check.attributes, TRACE)
        assert p.decode(wrapped) == Decoded(Frame(FRAMES[name].request_id, want), len(wrapped)), name
        assert p.encode(Frame(FRAMES[name].request_id, want)) == wrapped, name
        assert p.check_version(wrapped) == 5


def test_a_trace_context_goes_only_to_a_peer_of_version_5() -> None:
    frame = FRAMES["check_traced"]
    assert p.encode(frame) == p.encode(frame, peer_version=5) == vector("check_traced")
    for older in (1, 2, 3, 4):
        assert p.encode(frame, peer_version=older) == vector("check_one_item")[:6] + vector("check_traced")[6:10] + (
            vector("check_one_item")[10:]
        ), older
    # A check without a context is its own form to every peer.
    plain = Frame(18, Check(items=[Item("user:123", "api", 1)]))
    assert p.encode(plain) == p.encode(plain, peer_version=4)
    assert p.encode(plain)[10] == 0


def test_form_4_on_the_wire() -> None:
    traced = vector("check_traced")
    body = traced[10:]
    # A Check frame's version byte stays 1: form 4 is what needs version 5, not the frame.
    assert traced[4] == 1
    # All-zero ids: the context is dropped (as the agent drops it), the check decoded as usual.
    for zero in (body[:1] + bytes(16) + body[17:], body[:17] + bytes(8) + body[25:]):
        r = p.decode(_frame(0x03, 18, zero))
        assert r == Decoded(Frame(18, Check(items=[Item("user:123", "api", 1)])), len(zero) + 10), r
    # A context cut short, form 4 twice, or no form after it: malformed.
    for bad in (body[:20], body[:26], body[:1] + body[1:26] + body):
        r = p.decode(_frame(0x03, 18, bad))
        assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME, (bad.hex(" "), r)
    # Form 4 around a check that breaks a limit refuses that check only (error 5), as without it.
    r = p.decode(_frame(0x03, 3, body[:26] + b"\x00\x01\x00\x03a{b\x01r\x00\x00\x00\x01") + vector("ping"))
    assert isinstance(r, Rejected) and (r.code, r.request_id) == (ErrorCode.INVALID_ITEM, 3)
    # Only a Check has forms: a Decision starting with 4 is a Decision (flags 4: holds lease).
    lease = vector("decision_lease")
    assert p.decode(lease) == Decoded(FRAMES["decision_lease"], len(lease))


# --- version 6: reservations ------------------------------------------------------------------------


def test_the_client_fast_path_builds_the_reservation_vectors() -> None:
    # A mode as an ItemMode, its value or its name.
    reserve = [("apikey:abc", "output-tokens", 4096, "reserve", LEASE), ("apikey:abc", "in-flight", 1, 4, LEASE)]
    assert p.check_items_frame(19, reserve) == vector("check_reserve")
    commit = [("apikey:abc", "output-tokens", 612, ItemMode.COMMIT, LEASE), ("apikey:abc", "in-flight", 0, 5, LEASE)]
    assert p.check_items_frame(20, commit) == vector("check_commit")
    # Mode byte 0x84 and 0x85: bit 7, the reservation id after it, then the mode.
    assert vector("check_reserve")[-9] == 0x84 and vector("check_commit")[-9] == 0x85
    one = p.check_one_frame(19, "apikey:abc", "in-flight", 1, ItemMode.RESERVE, LEASE)
    assert one == p.check_items_frame(19, [Item.reserve("apikey:abc", "in-flight", 1, LEASE)])
    assert one[10:12] == b"\x02\x01" and one[-9:] == b"\x84" + LEASE.to_bytes(8, "big")
    # Attributes too (form 3): every matched rule reserves, or commits, under the id.
    for mode in (ItemMode.RESERVE, ItemMode.COMMIT):
        a = Attributes(endpoint="/v1/chat", api_key="abc", cost=7, mode=mode, lease=LEASE)
        data = p.check_attributes_frame(21, a)
        assert data[10] == p.FORM_ATTRIBUTES_MODE and data[-9] == 0x80 | mode, data.hex(" ")
        assert p.decode(data) == Decoded(Frame(21, Check(attributes=a)), len(data))


def test_a_reserve_or_a_commit_needs_its_reservation_id() -> None:
    for mode in ("reserve", "commit"):
        with pytest.raises(InvalidCheck, match=f"a {mode} item needs its reservation id"):
            p.check_items_frame(1, [("k", "r", 1, mode)])
        with pytest.raises(InvalidCheck, match=f"a {mode} item needs its reservation id"):
            p.check_one_frame(1, "k", "r", 1, p.item_mode(mode))
        with pytest.raises(InvalidCheck, match=f"a {mode} item needs its reservation id"):
            p.check_attributes_frame(1, Attributes(user="u", mode=p.item_mode(mode)))
    # On the wire: refused as invalid (error 5) for its request id, the next frame right after it.
    for name, mode in (("check_reserve", 0x04), ("check_commit", 0x05)):
        data = vector(name)
        body = data[10:]
        # The first item without its id: its mode byte with bit 7 clear, its 8 bytes gone.
        first = body.index(bytes((0x80 | mode,)))
        bare = body[:first] + bytes((mode,)) + body[first + 9 :]
        frame = _frame(0x03, 19, bare)
        r = p.decode(frame + vector("ping"))
        assert isinstance(r, Rejected) and (r.code, r.request_id) == (ErrorCode.INVALID_ITEM, 19), r
        assert r.frame_len == len(frame) and "needs its reservation id" in r.reason
        assert p.decode(frame + vector("ping"), r.frame_len) == Decoded(FRAMES["ping"], len(vector("ping")))


def test_a_commit_may_have_cost_0_a_reserve_needs_1() -> None:
    p.check_items_frame(1, [Item.commit("k", "r", 0, 1)])
    p.check_one_frame(1, "k", "r", 0, ItemMode.COMMIT, 1)
    p.check_attributes_frame(1, Attributes(user="u", cost=0, mode=ItemMode.COMMIT, lease=1))
    with pytest.raises(InvalidCheck, match="cost must be an int from 1"):
        p.check_items_frame(1, [Item.reserve("k", "r", 0, 1)])
    with pytest.raises(InvalidCheck, match="cost must be an int from 1"):
        p.check_one_frame(1, "k", "r", 0, ItemMode.RESERVE, 1)
    with pytest.raises(InvalidCheck, match="a commit's cost must be an int from 0"):
        p.check_items_frame(1, [Item.commit("k", "r", -1, 1)])
    # The largest cost, and the largest id.
    items = [Item.reserve("k", "r", 2**32 - 1, 2**64 - 1), Item.commit("k", "s", 2**32 - 1, 0)]
    top = p.check_items_frame(1, items)
    assert p.decode(top) == Decoded(Frame(1, Check(items=items)), len(top))
    # A decoded reserve of 0 is refused as the agent refuses it (error 5); a commit of 0 is not.
    reserve0 = _frame(0x03, 4, b"\x02\x01\x00\x01k\x01r\x00\x00\x00\x00\x84" + bytes(8))
    r = p.decode(reserve0)
    assert isinstance(r, Rejected) and (r.code, r.request_id) == (ErrorCode.INVALID_ITEM, 4) and "cost" in r.reason
    commit0 = _frame(0x03, 4, b"\x02\x01\x00\x01k\x01r\x00\x00\x00\x00\x85" + bytes(8))
    assert p.decode(commit0) == Decoded(Frame(4, Check(items=[Item.commit("k", "r", 0, 0)])), len(commit0))


def test_a_reserve_or_a_commit_needs_version_6() -> None:
    for name in ("check_reserve", "check_commit"):
        assert p.check_version(vector(name)) == p.RESERVATIONS == 6, name
    # Anywhere in the check, behind items that need less (a lease's 8 bytes skipped on the way).
    peek = Item.peek("user:1", "tokens", 0)
    for tail in (Item.reserve("k", "r", 1, 9), Item.commit("k", "r", 0, 9)):
        assert p.check_version(p.check_items_frame(1, [peek, Item.acquire("k" * 200, "s", 1, 7), tail])) == 6, tail
        assert p.check_version(p.check_items_frame(1, [tail, Item.acquire("k", "s", 1, 7)])) == 6, tail
    assert p.check_version(p.check_items_frame(1, [Item.acquire("k", "s", 1, 7), peek])) == 3
    for mode in (ItemMode.RESERVE, ItemMode.COMMIT):
        a = Attributes("/x" * 50, "t", "u", "k", "203.0.113.5", 1, mode, 5)
        assert p.check_version(p.check_attributes_frame(1, a)) == 6, mode
    # Around form 4: the check's own needs, when they are above the context's.
    assert p.check_version(p.traced(vector("check_reserve"), TRACE)) == 6
    assert p.check_version(p.traced(vector("check_acquire"), TRACE)) == 5


# --- version 6: quota mode --------------------------------------------------------------------------


def test_the_over_quota_flag_is_bit_3_and_bits_above_it_are_refused() -> None:
    data = vector("decision_over_quota")
    body = FRAMES["decision_over_quota"].body
    # Allowed (bit 0) and over quota (bit 3), on the combined verdict and on the item; a version-1
    # Decision frame (the flag is what needs version 6, not the frame's layout).
    assert data[4] == 1 and data[10] == 0x09 and data[10 + 34 + 1 + 1 + len(b"gpt-tokens")] == 0x09
    assert p.decode_reply(data, 0) == (1, (21, body), len(data))
    assert body.combined.over_quota and body.items[0].over_quota and not body.items[0].holds_lease
    # Every flag together survives both decoders, the window layout too.
    every = Verdict(True, True, Source.LOCAL, 5, 0, 1, 0, holds_lease=True, over_quota=True)
    for windows in (0, 60_000):
        frame = Frame(3, DecisionBody(every, [ItemDecision("r", every, windows)]))
        wire = p.encode(frame)
        assert wire[10] == 0x0F and wire[4] == (4 if windows else 1)
        assert p.decode(wire) == Decoded(frame, len(wire))
        assert p.decode_reply(wire, 0) == (1, (3, frame.body), len(wire))
    # A flag this version does not know (bits 4 to 7), on the combined verdict or on an item: the
    # frame is malformed, for both decoders.
    item_flags = 10 + 34 + 1 + 1 + len(b"gpt-tokens")
    for at in (10, item_flags):
        for bit in range(4, 8):
            bad = bytearray(data)
            bad[at] |= 1 << bit
            r = p.decode(bytes(bad))
            assert isinstance(r, Fatal) and r.code == ErrorCode.MALFORMED_FRAME and "unknown verdict flags" in r.reason
            assert p.decode_reply(bytes(bad), 0)[0] == 3, (at, bit)
    # Off by default: an older agent's verdict is never over quota.
    assert not ALLOWED.over_quota and not p.decode(vector("decision_allowed")).frame.body.combined.over_quota
