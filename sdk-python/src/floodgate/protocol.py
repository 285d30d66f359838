"""Floodgate's wire protocol, versions 1 to 6: frames to bytes and bytes to frames.

``protocol/PROTOCOL.md`` in the Floodgate repository documents every byte; this module follows it
and its hex test vectors. Nothing here does I/O. :func:`decode` never raises, whatever it is given:
it answers ``None`` (incomplete: read more), a :class:`Decoded` frame, a :class:`Rejected` frame
(well delimited but refused: skip it and go on) or :class:`Fatal` (the stream cannot be trusted).
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from .errors import InvalidCheck
from .fail_modes import ClosedRule, FailModeList, ListedDimension, endpoint_matches

VERSION = 6
"""The highest protocol version this module speaks (2: the fail-mode list and item modes; 3: leases
and releases of concurrency rules; 4: each decided item's rule window; 5: a check's trace context;
6: reservations, reserved and committed, and the verdict's over-quota flag)."""
MIN_VERSION = 1
"""The lowest protocol version this module speaks."""

MAX_FRAME = 64 * 1024
"""Largest frame on the wire, the 4-byte length prefix included."""
LEN_PREFIX = 4
HEADER = 6
"""Bytes after the length prefix in every frame: version, kind, request id."""
MAX_ITEMS = 16
MAX_KEY = 256
MAX_RULE_ID = 128
MAX_ATTRIBUTE = 256
MAX_MESSAGE = 1024
MAX_COST = 0xFFFF_FFFF
VERDICT_LEN = 34
WINDOWS = 4
"""The version whose Decision frame carries each item's rule window (``window_ms u64`` after its
verdict). A Decision's layout is read by its frame's version byte, not by the connection's."""
TRACE_CONTEXT = 5
"""The version whose Check may carry the caller's trace context (form 4): a client sends it only on
a connection whose HelloOk said this or more (an older agent cannot parse it and closes the
connection)."""
RESERVATIONS = 6
"""The version whose items may reserve and commit (modes 4 and 5): a client sends them only on a
connection whose HelloOk said this or more."""


class Kind(enum.IntEnum):
    """Frame kinds: the byte after the version."""

    HELLO = 0x01
    HELLO_OK = 0x02
    CHECK = 0x03
    DECISION = 0x04
    ERROR = 0x05
    PING = 0x06
    PONG = 0x07
    FAIL_MODES = 0x08
    """Client to agent (version 2): which rules fail closed."""
    FAIL_MODE_LIST = 0x09
    """Agent to client (version 2): the rules that fail closed."""


class ItemMode(enum.IntEnum):
    """What an item does with its cost (version 2, ``RELEASE`` version 3, ``RESERVE`` and ``COMMIT``
    version 6; a version-1 agent knows only ``CONSUME``)."""

    CONSUME = 0
    """Takes the cost if the check passes, all or nothing with the check's other consume items."""
    PEEK = 1
    """Changes nothing: says whether the cost would pass now and what is left (a cost of 0 may be
    asked about)."""
    CHARGE = 2
    """Always takes the cost, even past the limit (a debt later checks wait out); never denied."""
    RELEASE = 3
    """Gives back units a concurrency rule holds (version 3): with a lease, that lease; without one,
    up to the cost of the key's leases. Never denied; on a rule of another algorithm, a peek."""
    RESERVE = 4
    """Takes the cost as a consume does and holds it under the item's reservation id (version 6),
    until a commit with that id settles it or the rule's ``reservationSeconds`` run out. Needs the
    id."""
    COMMIT = 5
    """Settles the reservation named by the item's id (version 6): the cost is what the request
    used (0 allowed); the reserved units past it go back, a use past them is charged. Never denied;
    needs the id."""


class ErrorCode(enum.IntEnum):
    """The codes an Error frame carries. Unknown codes are kept as plain ints."""

    MALFORMED_FRAME = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    UNKNOWN_RULE = 4
    INVALID_ITEM = 5
    UNEXPECTED_FRAME = 6
    OVERLOADED = 7
    INTERNAL = 8


class Source(enum.IntEnum):
    """Where a verdict came from."""

    REDIS = 0
    """An atomic script on the shared Redis state."""
    LOCAL = 1
    """The agent's own state: the embedded store, or local counters of a batched rule."""
    CACHE = 2
    """A rejection the agent cached until its reset time."""
    FALLBACK = 3
    """The store was unavailable; the rule's fail mode (or the fallback limiter) decided."""


_SOURCES = (Source.REDIS, Source.LOCAL, Source.CACHE, Source.FALLBACK)
_ERROR_CODES = {c.value: c for c in ErrorCode}

FLAG_ALLOWED = 0x01
FLAG_LOG_ONLY = 0x02
FLAG_HOLDS_LEASE = 0x04
"""Verdict flag (version 3): the item carried a lease and its concurrency rule now holds it."""
FLAG_OVER_QUOTA = 0x08
"""Verdict flag (version 6): allowed past the limit of a rule with ``overLimit = "flag"`` (quota
mode), counted nowhere."""
_FLAGS = FLAG_ALLOWED | FLAG_LOG_ONLY | FLAG_HOLDS_LEASE | FLAG_OVER_QUOTA
MODE_LEASE = 0x80
"""Mode byte bit (version 3): a ``lease u64`` follows the mode byte; bits 0 to 6 are the mode."""
MAX_LEASE = 0xFFFF_FFFF_FFFF_FFFF
FORM_ITEMS = 0
FORM_ATTRIBUTES = 1
FORM_ITEMS_MODES = 2
"""Items each followed by its mode (version 2)."""
FORM_ATTRIBUTES_MODE = 3
"""Attributes followed by one mode (version 2)."""
FORM_TRACED = 4
"""A trace context (trace id, parent span id, flags), then the check's own form (version 5)."""
TRACE_LEN = 1 + 16 + 8 + 1
"""Bytes form 4 puts before the check's own form: its form byte and the context."""
LIST_TRUNCATED = 0x01


# --- frame bodies ---------------------------------------------------------------------------------


# What Rust's str::trim strips (Unicode White_Space); str.strip() would strip U+001C to U+001F too.
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
# A traceparent: version, trace id, parent span id and flags in lower-case hex; a later version may
# add fields after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
_NO_TRACE = bytes(16)
_NO_SPAN = bytes(8)


@dataclass(frozen=True)
class TraceContext:
    """The caller's W3C trace context (version 5): the trace, the caller's span (the parent of the
    agent's span of the check) and the trace flags (bit 0: sampled). A check carries it as form 4,
    to an agent whose HelloOk said 5 or more; it never changes the decision."""

    trace_id: bytes
    """The trace's 16 bytes (never all zero in a valid context)."""
    span_id: bytes
    """The parent span's 8 bytes (never all zero in a valid context)."""
    flags: int = 0
    """Trace flags: bit 0 says the caller records (samples) this trace."""

    def __post_init__(self) -> None:
        if not isinstance(self.trace_id, bytes) or len(self.trace_id) != 16:
            raise InvalidCheck(f"a trace id is 16 bytes, not {self.trace_id!r}")
        if not isinstance(self.span_id, bytes) or len(self.span_id) != 8:
            raise InvalidCheck(f"a span id is 8 bytes, not {self.span_id!r}")
        if isinstance(self.flags, bool) or not isinstance(self.flags, int) or not 0 <= self.flags <= 0xFF:
            raise InvalidCheck(f"trace flags are an int from 0 to 255, not {self.flags!r}")

    @property
    def sampled(self) -> bool:
        """Whether the caller records (samples) this trace."""
        return bool(self.flags & 1)

    def is_valid(self) -> bool:
        """Whether both ids are valid (not all zero)."""
        return self.trace_id != _NO_TRACE and self.span_id != _NO_SPAN

    @classmethod
    def parse(cls, traceparent: object) -> Optional["TraceContext"]:
        """A ``traceparent`` header's value (``00-<32 hex>-<16 hex>-<2 hex>``, surrounding white space
        ignored) as a context, else ``None``. A later version's value is read by its first four
        fields, as the W3C recommendation says; version ``ff``, all-zero ids, upper-case hex, and
        anything that is not a ``str`` give ``None``. As the Rust ``TraceContext::parse``."""
        if not isinstance(traceparent, str):
            return None
        m = _TRACEPARENT.fullmatch(traceparent.strip(_WHITE_SPACE))
        if m is None:
            return None
        version, trace, span, flags, more = m.groups()
        # Version 00 has exactly four fields; ff is invalid; a later one may have more.
        if version == "ff" or (version == "00" and more is not None):
            return None
        t = cls(bytes.fromhex(trace), bytes.fromhex(span), int(flags, 16))
        return t if t.is_valid() else None

    def traceparent(self) -> str:
        """The ``traceparent`` value naming ``span_id`` as the parent (version 00)."""
        return f"00-{self.trace_id.hex()}-{self.span_id.hex()}-{self.flags:02x}"

    def wire(self) -> bytes:
        """Form 4's prefix: its form byte, the trace id, the span id and the flags."""
        return b"".join((_FORM_TRACED_BYTE, self.trace_id, self.span_id, bytes((self.flags,))))


_FORM_TRACED_BYTE = bytes((FORM_TRACED,))


class Item(NamedTuple):
    """One ``(key, rule_id, cost, mode, lease)`` item of a check; it consumes its cost unless its
    mode says otherwise. ``lease`` (version 3) names the units a concurrency rule holds for it; on a
    reserve or a commit (version 6) it is the reservation id, which they need."""

    key: str
    rule_id: str
    cost: int = 1
    mode: ItemMode = ItemMode.CONSUME
    lease: Optional[int] = None

    @classmethod
    def peek(cls, key: str, rule_id: str, cost: int = 0) -> "Item":
        """An item that asks whether ``cost`` would pass, changing nothing (version 2)."""
        return cls(key, rule_id, cost, ItemMode.PEEK)

    @classmethod
    def charge(cls, key: str, rule_id: str, cost: int) -> "Item":
        """An item that takes ``cost`` whatever the limit says: a cost known after the response
        (version 2)."""
        return cls(key, rule_id, cost, ItemMode.CHARGE)

    @classmethod
    def acquire(cls, key: str, rule_id: str, cost: int, lease: int) -> "Item":
        """An item that consumes ``cost`` under ``lease`` (version 3): a concurrency rule holds the
        units until the lease is released or runs out (a rate rule ignores the lease)."""
        return cls(key, rule_id, cost, ItemMode.CONSUME, lease)

    @classmethod
    def release(cls, key: str, rule_id: str, cost: int, lease: Optional[int] = None) -> "Item":
        """An item that gives back what a concurrency rule holds (version 3): ``lease`` of ``cost``
        units, or without a lease up to ``cost`` units of the key's leases."""
        return cls(key, rule_id, cost, ItemMode.RELEASE, lease)

    @classmethod
    def reserve(cls, key: str, rule_id: str, cost: int, reservation: int) -> "Item":
        """An item that reserves ``cost`` (e.g. a request's ``max_tokens``) under the reservation id
        ``reservation``, if the check passes (version 6); settle it with :meth:`commit` and the same
        id."""
        return cls(key, rule_id, cost, ItemMode.RESERVE, reservation)

    @classmethod
    def commit(cls, key: str, rule_id: str, used: int, reservation: int) -> "Item":
        """An item that settles the reservation ``reservation`` at what the request used (``used``,
        0 allowed; version 6)."""
        return cls(key, rule_id, used, ItemMode.COMMIT, reservation)


@dataclass
class Attributes:
    """Request attributes the agent matches against its rules (``None`` = absent)."""

    endpoint: Optional[str] = None
    tier: Optional[str] = None
    user: Optional[str] = None
    api_key: Optional[str] = None
    ip: Optional[str] = None
    cost: int = 1
    mode: ItemMode = ItemMode.CONSUME
    """What every rule the attributes match does with the cost (version 2 unless ``CONSUME``)."""
    lease: Optional[int] = None
    """The lease the matched concurrency rules hold the cost under (version 3); the reservation id
    of a reserve or a commit (version 6), which needs one."""

    def fields(self) -> List[Tuple[str, Optional[str]]]:
        """The attributes with their names, in wire order."""
        return [
            ("endpoint", self.endpoint),
            ("tier", self.tier),
            ("user", self.user),
            ("apiKey", self.api_key),
            ("ip", self.ip),
        ]


@dataclass
class Hello:
    min_version: int = MIN_VERSION
    max_version: int = VERSION


@dataclass
class HelloOk:
    version: int = VERSION


@dataclass
class Check:
    """A check: ``items`` (form 0, or 2 when an item does not consume) or ``attributes`` (form 1,
    or 3), exactly one of them; with a ``trace`` context, wrapped in form 4 (version 5)."""

    items: Optional[List[Item]] = None
    attributes: Optional[Attributes] = None
    trace: Optional[TraceContext] = None
    """The caller's trace context (version 5), written only for a peer of version 5 or more. A
    decoded check's is ``None`` without one, and for one with an all-zero id (dropped, as the agent
    drops it)."""


@dataclass
class Verdict:
    """The figures of one decision, per item or combined."""

    allowed: bool
    log_only: bool
    source: Source
    limit: int
    remaining: int
    reset_at_ms: int
    retry_after_ms: int
    holds_lease: bool = False
    """The item carried a lease and its concurrency rule now holds it (version 3): release it when
    the work ends; it runs out at ``reset_at_ms`` otherwise. On a reserve (version 6): the agent
    holds the item's reservation."""
    over_quota: bool = False
    """Allowed past the limit of a rule with ``overLimit = "flag"`` (quota mode, version 6): the
    request passes, counted nowhere on that rule, for the caller to route elsewhere (a cheaper
    model, a fallback backend). An allowed combined verdict has it when any item has it. An agent
    sets it only for a peer whose HelloOk said 6 or more."""


@dataclass
class ItemDecision:
    """A verdict named by its rule."""

    rule_id: str
    verdict: Verdict
    window_ms: int = 0
    """The rule's window in ms (version 4; 0 from an older agent): a sliding window's or token
    bucket's ``windowSeconds`` (an override's, where the key has one), a calendar quota's current
    period; 0 for a concurrency rule, which has none. The IETF ``RateLimit-Policy`` header's ``w``."""

    @property
    def holds_lease(self) -> bool:
        """:attr:`Verdict.holds_lease`: this rule now holds the check's lease."""
        return self.verdict.holds_lease

    @property
    def over_quota(self) -> bool:
        """:attr:`Verdict.over_quota`: the request passes past this rule's limit (quota mode)."""
        return self.verdict.over_quota


@dataclass
class DecisionBody:
    """The answer to a check as the wire carries it."""

    combined: Verdict
    items: List[ItemDecision] = field(default_factory=list)


@dataclass
class ErrorBody:
    """The content of an Error frame. ``code`` is an :class:`ErrorCode`, or an int for codes this
    version does not know."""

    code: Union[ErrorCode, int]
    message: str


@dataclass
class Ping:
    pass


@dataclass
class Pong:
    pass


@dataclass
class FailModes:
    """The client's ask for the fail-mode list (version 2); the agent answers a :class:`FailModeList`."""


Body = Union[Hello, HelloOk, Check, DecisionBody, ErrorBody, Ping, Pong, FailModes, FailModeList]


@dataclass
class Frame:
    """One frame: a request id and what it carries."""

    request_id: int
    body: Body


class Decoded(NamedTuple):
    """A frame and the bytes it took."""

    frame: Frame
    used: int


class Rejected(NamedTuple):
    """A well-delimited frame whose content is refused: skip ``frame_len`` bytes and go on."""

    code: int
    request_id: int
    reason: str
    frame_len: int


class Fatal(NamedTuple):
    """The stream cannot be resynchronised: close the connection."""

    code: int
    request_id: Optional[int]
    reason: str


DecodeResult = Union[None, Decoded, Rejected, Fatal]


# --- validation -----------------------------------------------------------------------------------

# Braces (Redis hash tags) and control characters (Unicode category Cc: U+0000-U+001F, U+007F-U+009F,
# as Rust's char::is_control) are refused in keys and attributes.
_FORBIDDEN = re.compile("[{}\x00-\x1f\x7f-\x9f]")
_RULE_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


def _text(name: str, value: object, limit: int) -> bytes:
    if not isinstance(value, str):
        raise InvalidCheck(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidCheck(f"{name} is empty")
    m = _FORBIDDEN.search(value)
    if m is not None:
        raise InvalidCheck(
            f"{name} contains {m.group()!r}: braces (Redis hash tags) and control characters are not allowed"
        )
    try:
        b = value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidCheck(f"{name} is not valid Unicode text (a lone surrogate)") from None
    if len(b) > limit:
        raise InvalidCheck(f"{name} is {len(b)} bytes, over the {limit}-byte limit")
    return b


def validate_rule_id(rule_id: object) -> bytes:
    """The rule id as bytes; raises :class:`InvalidCheck` unless it is 1 to 128 of ``[A-Za-z0-9_.:-]``."""
    if not isinstance(rule_id, str) or _RULE_ID.fullmatch(rule_id) is None:
        raise InvalidCheck(
            f"rule id {rule_id!r} must be 1 to {MAX_RULE_ID} ASCII letters, digits and _ - . :"
        )
    return rule_id.encode("ascii")


# Module constants, not ItemMode.X: an enum member looked up on its class costs ~60 ns a time in
# CPython 3.11, and allow's fast path looks up two.
_CONSUME = ItemMode.CONSUME
_PEEK = ItemMode.PEEK
_RESERVE = ItemMode.RESERVE
_COMMIT = ItemMode.COMMIT


def _cost(cost: object, mode: int = 0) -> int:
    # A peek may ask about 0 units (is the key already past its limit?) and a commit may say the
    # request used nothing; taking 0 is no request.
    low = 0 if mode == _PEEK or mode == _COMMIT else 1
    if not isinstance(cost, int) or not low <= cost <= MAX_COST:
        what = "cost" if low else f"a {ItemMode(mode).name.lower()}'s cost"
        raise InvalidCheck(f"{what} must be an int from {low} to {MAX_COST}, not {cost!r}")
    return cost


_MODE_NAMES = {m.name.lower(): m for m in ItemMode}


def item_mode(mode: object) -> ItemMode:
    """``mode`` as an :class:`ItemMode`: one already, its value (0 to 5) or its lower-case name
    (``"peek"``); raises :class:`InvalidCheck` for anything else."""
    if isinstance(mode, ItemMode):
        return mode
    if isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= _COMMIT:
        return ItemMode(mode)
    if isinstance(mode, str) and mode in _MODE_NAMES:
        return _MODE_NAMES[mode]
    raise InvalidCheck(
        f"an item mode is consume, peek, charge, release, reserve or commit (0 to 5), not {mode!r}"
    )


def _lease(lease: object) -> Optional[int]:
    if lease is None:
        return None
    if isinstance(lease, bool) or not isinstance(lease, int) or not 0 <= lease <= MAX_LEASE:
        raise InvalidCheck(f"a lease is an int from 0 to 2**64 - 1, not {lease!r}")
    return lease


def _mode_bytes(mode: int, lease: Optional[int]) -> bytes:
    """The mode byte of forms 2 and 3, and the lease after it when there is one (version 3): a
    reserve's or a commit's reservation id, which they need (the agent refuses either without one,
    error 5)."""
    if lease is None:
        if mode == _RESERVE or mode == _COMMIT:
            raise InvalidCheck(f"a {ItemMode(mode).name.lower()} item needs its reservation id")
        return bytes((mode,))
    return bytes((mode | MODE_LEASE,)) + _U64.pack(lease)


# Encoded (validated) rule ids: most services name a handful of rules.
_rule_cache: dict = {}


def _rule_bytes(rule_id: object) -> bytes:
    b = _rule_cache.get(rule_id)
    if b is None:
        b = validate_rule_id(rule_id)
        if len(_rule_cache) >= 1024:
            _rule_cache.clear()
        _rule_cache[rule_id] = b
    return b


# --- encoding -------------------------------------------------------------------------------------

_HDR = struct.Struct(">IBBI")
_STR16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_VERDICT = struct.Struct(">BBQQQQ")
_ERR = struct.Struct(">HH")
_U64 = struct.Struct(">Q")
_VERDICT_WINDOW = struct.Struct(">BBQQQQQ")
"""A version-4 Decision item's verdict and its ``window_ms``."""
_LIST_HEAD = struct.Struct(">QBH")
_PREFIX_ITEMS = b"\x00"


def _frame(kind: int, request_id: int, body: bytes, version: int = 1) -> bytes:
    """A frame; ``version`` is the one that introduced its kind (1, or 2 for the fail-mode kinds), so
    a version-1 peer reads every frame it knows."""
    n = HEADER + len(body)
    if LEN_PREFIX + n > MAX_FRAME:
        raise InvalidCheck(f"frame of {LEN_PREFIX + n} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HDR.pack(n, version, kind, request_id & 0xFFFF_FFFF) + body


def items_body(items: Iterable[object]) -> bytes:
    """The body of an items Check (validated): ``items`` are :class:`Item` or ``(key, rule_id[,
    cost[, mode[, lease]]])``. Form 0 when every item consumes without a lease (what every agent
    reads), else form 2."""
    parts = []
    modes: List[bytes] = []
    plain = True
    n = 0
    key: Any
    rule_id: Any
    cost: Any
    mode: Any
    lease: Any
    for it in items:
        n += 1
        if n > MAX_ITEMS:
            break
        try:
            size = len(it)  # type: ignore[arg-type]
            if size == 2:
                key, rule_id = it  # type: ignore[misc]
                cost, mode, lease = 1, ItemMode.CONSUME, None
            elif size == 3:
                key, rule_id, cost = it  # type: ignore[misc]
                mode, lease = ItemMode.CONSUME, None
            elif size == 4:
                key, rule_id, cost, mode = it  # type: ignore[misc]
                lease = None
            else:
                key, rule_id, cost, mode, lease = it  # type: ignore[misc]
        except (TypeError, ValueError):
            raise InvalidCheck(f"an item is (key, rule_id[, cost[, mode[, lease]]]), not {it!r}") from None
        k = _text("key", key, MAX_KEY)
        r = _rule_bytes(rule_id)
        m = item_mode(mode)
        lease = _lease(lease)
        parts.append(b"".join((_STR16.pack(len(k)), k, bytes((len(r),)), r, _U32.pack(_cost(cost, m)))))
        modes.append(_mode_bytes(m, lease))
        plain = plain and not m and lease is None
    if not 1 <= n <= MAX_ITEMS:
        raise InvalidCheck(f"a check carries 1 to {MAX_ITEMS} items, not {n if n <= MAX_ITEMS else 'more'}")
    if not plain:
        return b"".join((bytes((FORM_ITEMS_MODES, n)), *(part + m for part, m in zip(parts, modes))))
    return b"".join((_PREFIX_ITEMS, bytes((n,)), *parts))


def attributes_body(a: Attributes) -> bytes:
    """The body of an attributes Check (validated): form 1 when its mode is consume without a lease,
    else form 3."""
    mode = item_mode(a.mode)
    lease = _lease(a.lease)
    moded = bool(mode) or lease is not None
    parts = [bytes((FORM_ATTRIBUTES_MODE if moded else FORM_ATTRIBUTES,))]
    for name, value in a.fields():
        if value is None:
            parts.append(b"\x00\x00")
        else:
            b = _text(name, value, MAX_ATTRIBUTE)
            parts.append(_STR16.pack(len(b)))
            parts.append(b)
    parts.append(_U32.pack(_cost(a.cost, mode)))
    if moded:
        parts.append(_mode_bytes(mode, lease))
    return b"".join(parts)


def _str8(s: str) -> bytes:
    b = _truncate(s, 0xFF)
    return bytes((len(b),)) + b


def _str16(s: str, limit: int = 0xFFFF) -> bytes:
    b = _truncate(s, limit)
    return _STR16.pack(len(b)) + b


def _truncate(s: str, limit: int) -> bytes:
    b = s.encode("utf-8", "replace")
    if len(b) <= limit:
        return b
    return b[:limit].decode("utf-8", "ignore").encode("utf-8")


def _verdict_bytes(v: Verdict) -> bytes:
    flags = (
        (FLAG_ALLOWED if v.allowed else 0)
        | (FLAG_LOG_ONLY if v.log_only else 0)
        | (FLAG_HOLDS_LEASE if v.holds_lease else 0)
        | (FLAG_OVER_QUOTA if v.over_quota else 0)
    )
    return _VERDICT.pack(flags, int(v.source), v.limit, v.remaining, v.reset_at_ms, v.retry_after_ms)


def encode(frame: Frame, peer_version: int = VERSION) -> bytes:
    """The frame as bytes. Checks are validated (raises :class:`InvalidCheck`); the other kinds are
    encoded as given (the agent-side kinds exist for tests and fake agents). A check's trace context
    is written (form 4) for a ``peer_version`` of 5 or more (the default), else left out. A Decision
    whose items carry a window is a version-4 frame for a ``peer_version`` of 4 or more, else
    version 1's form without the windows, as the agent writes it."""
    b = frame.body
    rid = frame.request_id
    if isinstance(b, Check):
        if (b.items is None) == (b.attributes is None):
            raise InvalidCheck("a check carries items or attributes, exactly one of them")
        body = items_body(b.items) if b.items is not None else attributes_body(b.attributes)  # type: ignore[arg-type]
        if b.trace is not None and peer_version >= TRACE_CONTEXT:
            body = b.trace.wire() + body
        return _frame(Kind.CHECK, rid, body)
    if isinstance(b, Hello):
        return _frame(Kind.HELLO, rid, bytes((b.min_version, b.max_version)), min(b.max_version, VERSION))
    if isinstance(b, HelloOk):
        return _frame(Kind.HELLO_OK, rid, bytes((b.version,)))
    if isinstance(b, DecisionBody):
        windows = peer_version >= WINDOWS and any(it.window_ms for it in b.items)
        parts = [_verdict_bytes(b.combined), bytes((len(b.items),))]
        for it in b.items:
            parts.append(_str8(it.rule_id))
            parts.append(_verdict_bytes(it.verdict))
            if windows:
                parts.append(_U64.pack(it.window_ms))
        return _frame(Kind.DECISION, rid, b"".join(parts), WINDOWS if windows else 1)
    if isinstance(b, ErrorBody):
        return _frame(Kind.ERROR, rid, _STR16.pack(int(b.code)) + _str16(b.message, MAX_MESSAGE))
    if isinstance(b, Ping):
        return _frame(Kind.PING, rid, b"")
    if isinstance(b, Pong):
        return _frame(Kind.PONG, rid, b"")
    if isinstance(b, FailModes):
        return _frame(Kind.FAIL_MODES, rid, b"", 2)
    if isinstance(b, FailModeList):
        n = min(len(b.rules), 0xFFFF)
        parts = [_LIST_HEAD.pack(b.rules_version, LIST_TRUNCATED if b.truncated else 0, n)]
        for r in b.rules[:n]:
            parts.append(_str8(r.rule_id))
            parts.append(bytes((int(r.dimension),)))
            parts.append(_str16(r.endpoint))
            parts.append(_str16(r.tier))
            parts.append(_U64.pack(r.limit))
        return _frame(Kind.FAIL_MODE_LIST, rid, b"".join(parts), 2)
    raise TypeError(f"not a frame body: {b!r}")


def check_items_frame(request_id: int, items: Iterable[object]) -> bytes:
    """A Check frame for items (validated; raises :class:`InvalidCheck`)."""
    return _frame(Kind.CHECK, request_id, items_body(items))


def check_one_frame(
    request_id: int,
    key: str,
    rule_id: str,
    cost: int = 1,
    mode: ItemMode = ItemMode.CONSUME,
    lease: Optional[int] = None,
) -> bytes:
    """A Check frame for one item (validated; raises :class:`InvalidCheck`): the fast path of
    ``allow``, ``peek``, ``charge``, ``acquire`` and ``release`` (form 0 to consume without a lease,
    else form 2)."""
    if mode is not _CONSUME:
        mode = item_mode(mode)
    k = _text("key", key, MAX_KEY)
    r = _rule_bytes(rule_id)
    c = _cost(cost, mode)
    if not mode and lease is None:
        return b"".join(
            (_HDR.pack(15 + len(k) + len(r), 1, Kind.CHECK, request_id & 0xFFFF_FFFF), b"\x00\x01",
             _STR16.pack(len(k)), k, bytes((len(r),)), r, _U32.pack(c))
        )
    m = _mode_bytes(mode, _lease(lease))
    return b"".join(
        (_HDR.pack(15 + len(m) + len(k) + len(r), 1, Kind.CHECK, request_id & 0xFFFF_FFFF), b"\x02\x01",
         _STR16.pack(len(k)), k, bytes((len(r),)), r, _U32.pack(c), m)
    )


def check_attributes_frame(request_id: int, attributes: Attributes) -> bytes:
    """A Check frame for request attributes (validated; raises :class:`InvalidCheck`)."""
    return _frame(Kind.CHECK, request_id, attributes_body(attributes))


def traced(frame: bytes, trace: TraceContext) -> bytes:
    """A Check frame this module encoded (forms 0 to 3) wrapped in form 4 with ``trace``: send it
    only on a connection whose HelloOk said 5 or more (:data:`TRACE_CONTEXT`). The clients build the
    plain frame and wrap it once they know the connection it goes to. A check is far below the frame
    limit, so the 26 bytes always fit."""
    return b"".join(
        (_U32.pack(len(frame) - LEN_PREFIX + TRACE_LEN), frame[LEN_PREFIX : LEN_PREFIX + HEADER], trace.wire(),
         frame[LEN_PREFIX + HEADER :])
    )


def _mode_version(mode_byte: int) -> int:
    mode = mode_byte & ~MODE_LEASE
    if mode == _RESERVE or mode == _COMMIT:
        return RESERVATIONS
    return 3 if mode_byte & MODE_LEASE or mode == ItemMode.RELEASE else 2


def check_version(frame: bytes) -> int:
    """The lowest protocol version an agent must speak to read a Check frame this module encoded: 6
    for a reserve or a commit, else 5 for a trace context (form 4), 3 for a lease or a release, 2
    for forms 2 and 3 otherwise (an item that peeks or charges), else 1. A version-1 agent cannot
    parse forms 2 and 3 and closes the connection, and an older agent refuses a mode or a lease it
    does not know, so a client sends them only on a connection whose HelloOk said as much. (The
    clients add a trace context only on a connection of version 5, and leave it out on older
    ones.)"""
    off = LEN_PREFIX + HEADER
    form = frame[off]
    if form == FORM_TRACED:
        return max(TRACE_CONTEXT, _form_version(frame, off + TRACE_LEN))
    return _form_version(frame, off)


def _form_version(frame: bytes, off: int) -> int:
    """:func:`check_version` of the check whose form byte is at ``off`` (form 0 to 3)."""
    form = frame[off]
    if form < FORM_ITEMS_MODES:
        return 1
    if form == FORM_ATTRIBUTES_MODE:
        off += 1
        for _ in range(5):
            off += 2 + _STR16.unpack_from(frame, off)[0]
        return _mode_version(frame[off + 4])
    n = frame[off + 1]
    off += 2
    need = 2
    for _ in range(n):
        off += 2 + _STR16.unpack_from(frame, off)[0]
        off += 1 + frame[off] + 4
        mode = frame[off]
        need = max(need, _mode_version(mode))
        off += 9 if mode & MODE_LEASE else 1
    return need


HELLO_FRAME = encode(Frame(0, Hello(MIN_VERSION, VERSION)))
"""The Hello a client opens with: versions 1 to 6."""


def fail_modes_frame(request_id: int) -> bytes:
    """A FailModes frame: send it only on a connection whose HelloOk said 2."""
    return _frame(Kind.FAIL_MODES, request_id, b"", 2)


# --- decoding -------------------------------------------------------------------------------------


class _Malformed(Exception):
    pass


class _BadText(Exception):
    pass


def _verdict(buf: Union[bytes, bytearray, memoryview], off: int, end: int) -> Verdict:
    if off + VERDICT_LEN > end:
        raise _Malformed("body ends inside a verdict")
    flags, source, limit, remaining, reset, retry = _VERDICT.unpack_from(buf, off)
    if flags & ~_FLAGS:
        raise _Malformed(f"unknown verdict flags 0x{flags:02x}")
    if source > 3:
        raise _Malformed(f"unknown source {source}")
    return Verdict(
        bool(flags & FLAG_ALLOWED),
        bool(flags & FLAG_LOG_ONLY),
        _SOURCES[source],
        limit,
        remaining,
        reset,
        retry,
        bool(flags & FLAG_HOLDS_LEASE),
        bool(flags & FLAG_OVER_QUOTA),
    )


class _Reader:
    __slots__ = ("buf", "pos", "end", "bad_text")

    def __init__(self, buf: Union[bytes, bytearray, memoryview], pos: int, end: int) -> None:
        self.buf = buf
        self.pos = pos
        self.end = end
        self.bad_text: Optional[str] = None

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise _Malformed(f"body ends early: wanted {n} more bytes, {self.end - self.pos} left")
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def u8(self) -> int:
        if self.pos >= self.end:
            raise _Malformed("body ends early")
        v = self.buf[self.pos]
        self.pos += 1
        return v

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def text(self, n: int) -> str:
        b = self.take(n)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            if self.bad_text is None:
                self.bad_text = "text is not valid UTF-8"
            return ""

    def str8(self) -> str:
        return self.text(self.u8())

    def str16(self) -> str:
        return self.text(self.u16())

    def mode(self) -> Tuple[ItemMode, Optional[int]]:
        """An item mode and its lease (``None`` without bit 7). A mode this peer does not know
        refuses the check (error 5) once the body has parsed, as bad text does: the frame is well
        delimited, only the check is wrong."""
        b = self.u8()
        lease = self.u64() if b & MODE_LEASE else None
        m = b & ~MODE_LEASE
        if m > _COMMIT:
            if self.bad_text is None:
                self.bad_text = f"unknown item mode {m}"
            return ItemMode.CONSUME, lease
        return ItemMode(m), lease

    def verdict(self) -> Verdict:
        v = _verdict(self.buf, self.pos, self.end)
        self.pos += VERDICT_LEN
        return v


def _body(kind: int, version: int, r: _Reader) -> Body:
    if kind == Kind.DECISION:
        combined = r.verdict()
        n = r.u8()
        if n > MAX_ITEMS:
            raise _Malformed(f"a decision carries at most {MAX_ITEMS} items, not {n}")
        windows = version >= WINDOWS
        items = []
        for _ in range(n):
            rule_id = r.str8()
            verdict = r.verdict()
            items.append(ItemDecision(rule_id, verdict, r.u64() if windows else 0))
        return DecisionBody(combined, items)
    if kind == Kind.ERROR:
        code = r.u16()
        return ErrorBody(_ERROR_CODES.get(code, code), r.str16())
    if kind == Kind.HELLO_OK:
        return HelloOk(r.u8())
    if kind == Kind.PONG:
        return Pong()
    if kind == Kind.PING:
        return Ping()
    if kind == Kind.HELLO:
        return Hello(r.u8(), r.u8())
    if kind == Kind.CHECK:
        form = r.u8()
        trace = None
        if form == FORM_TRACED:
            # Version 5: the context, then the check's own form (not 4 again).
            t = TraceContext(r.take(16), r.take(8), r.u8())
            # One with an all-zero id is dropped, as the agent drops it (and a bad traceparent).
            trace = t if t.is_valid() else None
            form = r.u8()
        if form == FORM_ITEMS or form == FORM_ITEMS_MODES:
            n = r.u8()
            check_items: List[Item] = []
            for _ in range(n):
                key = r.str16()
                rule_id = r.str8()
                cost = r.u32()
                mode, lease = r.mode() if form == FORM_ITEMS_MODES else (ItemMode.CONSUME, None)
                check_items.append(Item(key, rule_id, cost, mode, lease))
            return Check(items=check_items, trace=trace)
        if form == FORM_ATTRIBUTES or form == FORM_ATTRIBUTES_MODE:
            v = [r.str16() or None for _ in range(5)]
            cost = r.u32()
            mode, lease = r.mode() if form == FORM_ATTRIBUTES_MODE else (ItemMode.CONSUME, None)
            return Check(attributes=Attributes(v[0], v[1], v[2], v[3], v[4], cost, mode, lease), trace=trace)
        raise _Malformed(f"unknown check form {form}")
    if kind == Kind.FAIL_MODE_LIST:
        return _fail_mode_list(r)
    if kind == Kind.FAIL_MODES:
        return FailModes()
    raise _Malformed(f"unknown frame kind 0x{kind:02x}")


def _fail_mode_list(r: _Reader) -> FailModeList:
    rules_version = r.u64()
    flags = r.u8()
    if flags & ~LIST_TRUNCATED:
        raise _Malformed(f"unknown list flags 0x{flags:02x}")
    rules = []
    for _ in range(r.u16()):
        rule_id = r.str8()
        d = r.u8()
        if d > ListedDimension.DESCRIPTOR:
            raise _Malformed(f"unknown dimension {d}")
        endpoint = r.str16()
        tier = r.str16()
        rules.append(ClosedRule(rule_id, ListedDimension(d), endpoint, tier, r.u64()))
    return FailModeList(rules_version, bool(flags & LIST_TRUNCATED), rules)


def _check_limits(c: Check) -> Optional[str]:
    try:
        if c.items is not None:
            items_body(c.items)
        elif c.attributes is not None:
            attributes_body(c.attributes)
    except InvalidCheck as e:
        return str(e)
    return None


def decode(buf: Union[bytes, bytearray, memoryview], pos: int = 0) -> DecodeResult:
    """Decodes one frame starting at ``buf[pos]``. Never raises.

    Returns ``None`` when more bytes are needed, :class:`Decoded` (the frame and the bytes it took),
    :class:`Rejected` (skip ``frame_len`` bytes and go on) or :class:`Fatal` (close the stream).
    """
    try:
        avail = len(buf) - pos
        if avail < LEN_PREFIX:
            return None
        length = int.from_bytes(buf[pos : pos + 4], "big")
        frame_len = LEN_PREFIX + length
        if frame_len > MAX_FRAME:
            rid = int.from_bytes(buf[pos + 6 : pos + 10], "big") if avail >= LEN_PREFIX + HEADER else None
            return Fatal(
                ErrorCode.FRAME_TOO_LARGE, rid, f"frame of {frame_len} bytes exceeds the {MAX_FRAME}-byte limit"
            )
        if length < HEADER:
            return Fatal(ErrorCode.MALFORMED_FRAME, None, f"length {length} is shorter than the {HEADER}-byte header")
        if avail < frame_len:
            return None
        version = buf[pos + 4]
        kind = buf[pos + 5]
        rid = int.from_bytes(buf[pos + 6 : pos + 10], "big")
        if not MIN_VERSION <= version <= VERSION and kind != Kind.HELLO:
            return Rejected(
                ErrorCode.UNSUPPORTED_VERSION,
                rid,
                f"frame version {version}; this peer speaks versions {MIN_VERSION} to {VERSION}",
                frame_len,
            )
        end = pos + frame_len
        r = _Reader(buf, pos + LEN_PREFIX + HEADER, end)
        try:
            body = _body(kind, version, r)
        except _Malformed as e:
            return Fatal(ErrorCode.MALFORMED_FRAME, rid, str(e))
        if r.pos != end:
            return Fatal(ErrorCode.MALFORMED_FRAME, rid, f"{end - r.pos} unexpected bytes after the body")
        if r.bad_text is not None:
            return Rejected(ErrorCode.INVALID_ITEM, rid, r.bad_text, frame_len)
        if isinstance(body, Check):
            problem = _check_limits(body)
            if problem is not None:
                return Rejected(ErrorCode.INVALID_ITEM, rid, problem, frame_len)
        return Decoded(Frame(rid, body), frame_len)
    except Exception as e:  # noqa: BLE001 - the decoder must never raise; this is a bug guard
        return Fatal(ErrorCode.MALFORMED_FRAME, None, f"undecodable frame ({type(e).__name__}: {e})")


# --- the client's fast path -----------------------------------------------------------------------


_HEAD = struct.Struct(">IBBI")


def decode_reply(buf: Union[bytes, bytearray], pos: int) -> Tuple[int, Any, int]:
    """The client's decoder for what an agent sends: ``(status, value, used)``.

    ``status`` 0: incomplete (read more). 1: ``value`` is ``(request_id, body)`` with body a
    :class:`DecisionBody`, :class:`ErrorBody`, :class:`HelloOk`, :class:`Pong` or
    :class:`FailModeList`; skip ``used``
    bytes. 2: a refused frame for request id ``value``; skip ``used`` bytes. 3: fatal, ``value`` is the
    reason: close the connection. Never raises. A well-formed Decision takes a fast path; anything
    else goes through :func:`decode`.
    """
    try:
        avail = len(buf) - pos
        if avail < 10:
            if avail < 4 or 4 + int.from_bytes(buf[pos : pos + 4], "big") > avail:
                res = decode(buf, pos)
                return (0, None, 0) if res is None else _slow(res)
        length, version, kind, rid = _HEAD.unpack_from(buf, pos)
        total = 4 + length
        # Version 1's Decision, or version 4's (each item's window after its verdict).
        if kind == 4 and (version == 1 or version == WINDOWS) and 45 <= total <= avail:
            end = pos + total
            flags, src, limit, remaining, reset, retry = _VERDICT.unpack_from(buf, pos + 10)
            count = buf[pos + 44]
            off = pos + 45
            # Flags above bit 3 and unknown sources are refused by the full decoder.
            if flags < 16 and src < 4 and count <= MAX_ITEMS:
                windows = version == WINDOWS
                item_len = VERDICT_LEN + 8 if windows else VERDICT_LEN
                items = []
                for _ in range(count):
                    if off >= end:
                        break
                    n = buf[off]
                    off += 1
                    if off + n + item_len > end:
                        break
                    rule = bytes(buf[off : off + n]).decode("utf-8")
                    off += n
                    if windows:
                        f, s, li, re_, rs, rt, w = _VERDICT_WINDOW.unpack_from(buf, off)
                    else:
                        f, s, li, re_, rs, rt = _VERDICT.unpack_from(buf, off)
                        w = 0
                    if f >= 16 or s >= 4:
                        break
                    off += item_len
                    items.append(
                        ItemDecision(
                            rule,
                            Verdict(bool(f & 1), bool(f & 2), _SOURCES[s], li, re_, rs, rt, bool(f & 4), bool(f & 8)),
                            w,
                        )
                    )
                else:
                    if off == end:
                        combined = Verdict(
                            bool(flags & 1),
                            bool(flags & 2),
                            _SOURCES[src],
                            limit,
                            remaining,
                            reset,
                            retry,
                            bool(flags & 4),
                            bool(flags & 8),
                        )
                        return 1, (rid, DecisionBody(combined, items)), total
    except (UnicodeDecodeError, struct.error, IndexError):
        pass
    res = decode(buf, pos)
    if res is None:
        return 0, None, 0
    return _slow(res)


def _slow(res: DecodeResult) -> Tuple[int, Any, int]:
    if isinstance(res, Decoded):
        f = res.frame
        if isinstance(f.body, (DecisionBody, ErrorBody, HelloOk, Pong, FailModeList)):
            return 1, (f.request_id, f.body), res.used
        # Hello, Check, Ping or FailModes: only a client sends those; an agent that does is confused.
        return 3, f"the agent sent a {type(f.body).__name__} frame", res.used
    if isinstance(res, Rejected):
        return 2, res.request_id, res.frame_len
    if isinstance(res, Fatal):
        return 3, res.reason, 0
    return 0, None, 0


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a of ``data``."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def wire_safe(value: str) -> str:
    """A value the agent accepts as an attribute: as it is when the wire allows it (at most 256 bytes
    of UTF-8, no braces, no control characters), else ``h:`` and the 16 lower-case hex digits of the
    64-bit FNV-1a of its UTF-8 bytes: the same value always maps to the same key. Matches the Rust
    SDK's ``middleware::wire_safe`` (PROTOCOL.md, "Values the wire refuses").
    """
    try:
        b = value.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates (text decoded with surrogateescape) are no valid UTF-8: always hashed.
        b = value.encode("utf-8", "surrogatepass")
    else:
        if len(b) <= MAX_ATTRIBUTE and _FORBIDDEN.search(value) is None:
            return value
    return f"h:{fnv1a64(b):016x}"


def tcp_address(path: str) -> Optional[Tuple[str, int]]:
    """``(host, port)`` for ``tcp://host:port`` (an agent's ``--listen-tcp``; ``[::1]`` for IPv6),
    ``None`` for a Unix socket path. Raises ``ValueError`` for a ``tcp://`` address without a port."""
    if not path.startswith("tcp://"):
        return None
    host, sep, port = path[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{path!r}: a TCP agent address is tcp://host:port")
    return host.strip("[]"), int(port)


def parse_hex(text: str) -> bytes:
    """Bytes from whitespace-separated hex pairs, as PROTOCOL.md writes its vectors."""
    return bytes(int(x, 16) for x in text.split())


__all__: Sequence[str] = [
    "VERSION",
    "MIN_VERSION",
    "WINDOWS",
    "TRACE_CONTEXT",
    "RESERVATIONS",
    "MAX_FRAME",
    "MAX_ITEMS",
    "MAX_KEY",
    "MAX_RULE_ID",
    "MAX_ATTRIBUTE",
    "Kind",
    "ErrorCode",
    "Source",
    "ItemMode",
    "Item",
    "Attributes",
    "TraceContext",
    "Hello",
    "HelloOk",
    "Check",
    "Verdict",
    "ItemDecision",
    "DecisionBody",
    "ErrorBody",
    "Ping",
    "Pong",
    "FailModes",
    "FailModeList",
    "ClosedRule",
    "ListedDimension",
    "endpoint_matches",
    "Frame",
    "Decoded",
    "Rejected",
    "Fatal",
    "encode",
    "decode",
    "check_items_frame",
    "check_attributes_frame",
    "check_version",
    "traced",
    "item_mode",
    "fail_modes_frame",
    "wire_safe",
    "fnv1a64",
    "validate_rule_id",
]
