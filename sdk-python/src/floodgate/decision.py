"""Decisions as the SDK returns them, the client configuration, and what both clients share: the
fail policy, the fail-mode list learnt from the agent, the per-process fallback limit and the
counters."""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .errors import AgentError
from .fail_modes import ClosedRule, FailModeList
from .protocol import Attributes, Check, DecisionBody, ErrorBody, ErrorCode, ItemDecision, ItemMode, Source, Verdict

log = logging.getLogger("floodgate")


class RareWarning:
    """Logs at most one warning a minute (a bad request per request must not flood the log)."""

    def __init__(self) -> None:
        self._last = -1
        self._lock = threading.Lock()

    def warn(self, message: str, *args: object) -> None:
        minute = int(time.time() // 60)
        with self._lock:
            if self._last == minute:
                return
            self._last = minute
        log.warning(message, *args)


class FailPolicy(str, enum.Enum):
    """What a call answers when the agent cannot."""

    OPEN = "open"
    """Allow: a limiter outage must not become an API outage (the default)."""
    CLOSED = "closed"
    """Deny with a Retry-After: for checks where over-admission is worse than downtime."""


class Degraded(str, enum.Enum):
    """Why the SDK answered by itself instead of the agent."""

    UNAVAILABLE = "unavailable"
    """No connection to the agent (down, restarting, socket missing), or it could not answer."""
    TIMEOUT = "timeout"
    """The agent did not answer within the call's timeout."""


class Origin(str, enum.Enum):
    """Who decided."""

    AGENT = "agent"
    """The agent (see :attr:`Decision.source`)."""
    FAIL_OPEN = "fail_open"
    """The SDK's fail policy: allowed because the agent could not answer."""
    FAIL_CLOSED = "fail_closed"
    """Denied by the SDK because the agent could not answer: by the fail policy, or because the
    check touches a rule the agent lists as fail-closed (then :attr:`Decision.items` names it)."""
    LOCAL_LIMIT = "local_limit"
    """The SDK's per-process fallback limit decided because the agent could not."""


@dataclass
class LocalLimit:
    """A per-process limit per check key, enforced by fail-open calls while the agent is away: a
    token bucket of ``limit`` refilled over ``per`` seconds."""

    limit: int
    per: float


@dataclass
class ClientConfig:
    """How a client behaves; the defaults are the Rust SDK's. Durations are in seconds."""

    timeout: float = 0.010
    """Longest a call waits for the agent (10 ms)."""
    fail: FailPolicy = FailPolicy.OPEN
    """What a call answers when the agent cannot (open)."""
    closed_retry_after: float = 1.0
    """The Retry-After a fail-closed answer carries (1 s)."""
    reconnect_min: float = 0.010
    """First reconnection delay; doubles after each failure (10 ms), with jitter."""
    reconnect_max: float = 1.0
    """Longest reconnection delay (1 s)."""
    connect_timeout: float = 0.25
    """Longest a connection attempt and its Hello may take (250 ms)."""
    max_pending: int = 8192
    """Checks in flight at most; past it calls answer by their fail policy."""
    fallback_limit: Optional[LocalLimit] = None
    """Off by default; see :class:`LocalLimit`."""

    def __post_init__(self) -> None:
        # "open" / "closed" as strings are the policies, not a policy that is never `is` OPEN; a
        # misspelt one is refused here rather than silently failing closed.
        self.fail = FailPolicy(self.fail)
        for name in ("timeout", "closed_retry_after", "reconnect_min", "reconnect_max", "connect_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ClientConfig.{name} must be a number of seconds above 0, not {v!r}")
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ValueError(f"ClientConfig.max_pending must be an int of at least 1, not {self.max_pending!r}")


@dataclass
class ClientStats:
    """Counts of calls the SDK answered by itself, for the service's own metrics."""

    unavailable: int = 0
    """Calls answered by the fail policy because there was no connection (or no usable answer)."""
    timeouts: int = 0
    """Calls answered by the fail policy because the agent was late."""
    connects: int = 0
    """Connections established (the first one included)."""
    local_denied: int = 0
    """Degraded calls the per-process fallback limit denied."""
    max_in_flight: int = 0
    """Most checks that were waiting for the agent at once on the connection (pipelining depth)."""
    rule_denied: int = 0
    """Degraded calls denied because they touch a rule the agent lists as fail-closed."""


@dataclass
class Decision:
    """The answer to a check."""

    allowed: bool
    """Whether the request may pass."""
    limit: int
    """The binding rule's limit (0 when no rule applied or the SDK decided alone)."""
    remaining: int
    """Units left under the binding rule."""
    reset_at_ms: int
    """Unix ms at which the binding key is back to its full limit."""
    retry_after_ms: Optional[int]
    """On a denial, ms until retrying can succeed (at least 1); ``None`` when allowed."""
    origin: Origin
    """Who decided."""
    source: Optional[Source] = None
    """Where the agent's answer came from (``None`` when the SDK decided)."""
    degraded: Optional[Degraded] = None
    """Why the SDK decided (``None`` when the agent did)."""
    log_only: bool = False
    """Only rules in log mode applied: the figures are theirs and nothing was enforced."""
    items: List[ItemDecision] = field(default_factory=list)
    """Per-rule verdicts from the agent. When the SDK decided alone: empty, except for a denial by a
    listed fail-closed rule, which carries that rule's verdict (source ``FALLBACK``)."""

    @property
    def from_agent(self) -> bool:
        """Whether the agent decided (not the SDK's fail policy)."""
        return self.origin is Origin.AGENT

    @property
    def holds_lease(self) -> bool:
        """Whether a concurrency rule now holds the check's lease (an item's
        :attr:`~floodgate.Verdict.holds_lease`, protocol version 3): release it when the work ends."""
        return any(it.verdict.holds_lease for it in self.items)

    @property
    def reset_at(self) -> float:
        """:attr:`reset_at_ms` in Unix seconds."""
        return self.reset_at_ms / 1000.0

    @property
    def retry_after(self) -> Optional[float]:
        """:attr:`retry_after_ms` in seconds."""
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000.0


def decision_from_agent(d: DecisionBody) -> Decision:
    """The SDK's decision for an agent's answer."""
    c = d.combined
    return Decision(
        c.allowed,
        c.limit,
        c.remaining,
        c.reset_at_ms,
        None if c.allowed else max(c.retry_after_ms, 1),
        Origin.AGENT,
        c.source,
        None,
        c.log_only,
        d.items,
    )


# Sentinels a waiting call may be woken with instead of an agent's answer.
UNAVAILABLE = object()
TIMEOUT = object()

_LOCAL_KEYS = 100_000


def _now_ms() -> int:
    return int(time.time() * 1000)


Subject = Union[Sequence[Any], Attributes]
"""What a call checks: its items (``(key, rule_id[, cost])``), or its attributes."""


def consumes_only(subject: Subject) -> bool:
    """Whether every item of what a call checks consumes (no peek, charge or release; an acquire,
    a consume under a lease, counts as a consume)."""
    if isinstance(subject, Attributes):
        return subject.mode == ItemMode.CONSUME
    return all(getattr(it, "mode", ItemMode.CONSUME) == ItemMode.CONSUME for it in subject)


def local_key(subject: Subject) -> Tuple[str, int]:
    """The fallback limiter's key and cost for what a call checks."""
    if isinstance(subject, Attributes):
        return local_key_attributes(subject)
    return local_key_items(subject)


def local_key_items(items: Sequence[Any]) -> Tuple[str, int]:
    """The fallback limiter's key and cost for items."""
    parts = []
    cost = 1
    for it in items:
        key, rule = it[0], it[1]
        parts.append(f"{rule}\0{key}\0")
        c = it[2] if len(it) > 2 else 1
        if isinstance(c, int) and c > cost:
            cost = c
    return "".join(parts), cost


def local_key_attributes(a: Attributes) -> Tuple[str, int]:
    """The fallback limiter's key and cost for attributes."""
    return "attributes\0" + "".join(f"{v or ''}\0" for _, v in a.fields()), a.cost


class Core:
    """What the asyncio and the threaded client share: configuration, counters, the fail policy,
    the fail-mode list and the fallback limit. Thread-safe."""

    def __init__(self, config: ClientConfig, fail_modes: Optional[FailModeList] = None) -> None:
        self.config = config
        self.stats = ClientStats()
        self._lock = threading.Lock()
        self._local: Dict[str, Tuple[float, float]] = {}
        # The agent's last FailModeList (None until a version-2 agent sent one): replaced whole by
        # each new list (one reference store, so callers on other threads read one list or the
        # other), and kept across disconnections, which is when it is used.
        self.fail_modes = fail_modes
        self._warned_truncated = False

    def policy(self, fail: Union[FailPolicy, str, None]) -> Optional[FailPolicy]:
        """A call's own fail policy, converted (a misspelt one raises ``ValueError`` before anything
        is sent); ``None`` when the call gives none."""
        if fail is None:
            return None
        return fail if isinstance(fail, FailPolicy) else FailPolicy(fail)

    def learn(self, listed: FailModeList) -> None:
        """The agent's fail-mode list: it replaces the one known."""
        self.fail_modes = listed
        if listed.truncated:
            with self._lock:
                warned, self._warned_truncated = self._warned_truncated, True
            if not warned:
                log.warning(
                    "floodgate: the agent's list of fail-closed rules is truncated (more than one frame"
                    " holds): the %d rules listed deny while the agent is away, the others answer by"
                    " the fail policy (said once)",
                    len(listed.rules),
                )

    def result(self, reply: object, fail: Optional[FailPolicy], subject: Subject) -> Decision:
        """A call's decision from what it was woken with; raises :class:`AgentError` for a check the
        agent refuses as the caller's mistake (unknown rule, invalid item). ``fail`` is the call's
        own policy (``None``: none given)."""
        if isinstance(reply, DecisionBody):
            return decision_from_agent(reply)
        if isinstance(reply, ErrorBody):
            if reply.code in (ErrorCode.UNKNOWN_RULE, ErrorCode.INVALID_ITEM):
                raise AgentError(reply.code, reply.message)
            # Overload, an internal error, a code from a newer agent: the agent's trouble.
            return self.degraded(fail, Degraded.UNAVAILABLE, subject)
        if reply is TIMEOUT:
            return self.degraded(fail, Degraded.TIMEOUT, subject)
        return self.degraded(fail, Degraded.UNAVAILABLE, subject)

    def degraded(self, fail: Optional[FailPolicy], why: Degraded, subject: Subject) -> Decision:
        """The SDK's own answer to a check the agent could not answer (PROTOCOL.md, "Version 2"):
        the call's own policy ``fail`` decides alone when given; else a check that touches a rule
        the agent lists as fail-closed is denied; else the client's fail policy decides (open: the
        fallback limit's answer when one is configured)."""
        now = _now_ms()
        rule = None
        if fail is None:
            listed = self.fail_modes
            if listed is not None:
                rule = listed.closing(
                    Check(attributes=subject) if isinstance(subject, Attributes) else Check(items=subject)
                )
            fail = self.config.fail  # a FailPolicy: ClientConfig converts it
        with self._lock:
            if why is Degraded.TIMEOUT:
                self.stats.timeouts += 1
            else:
                self.stats.unavailable += 1
            if rule is not None:
                self.stats.rule_denied += 1
        if rule is not None:
            return self._denied_by_rule(rule, why, now)
        limit = self.config.fallback_limit
        # The per-process limit counts what passes: a peek takes nothing, a charge is owed whatever
        # it says and a release gives back, so only consuming checks (acquires among them) go
        # through it (as in the Rust SDK).
        if fail is FailPolicy.OPEN and limit is not None and consumes_only(subject):
            key, cost = local_key(subject)
            return self._local_limit(limit, key, cost, why, now)
        retry = int(self.config.closed_retry_after * 1000)
        if fail is FailPolicy.OPEN:
            return Decision(True, 0, 0, now, None, Origin.FAIL_OPEN, None, why)
        return Decision(False, 0, 0, now + retry, max(retry, 1), Origin.FAIL_CLOSED, None, why)

    def _denied_by_rule(self, rule: ClosedRule, why: Degraded, now_ms: int) -> Decision:
        # The rule's verdict goes in items, so that middleware sends its X-RateLimit-* headers as
        # for any denial (limit: the rule's, remaining 0, reset when Retry-After says to retry).
        retry = max(int(self.config.closed_retry_after * 1000), 1)
        verdict = Verdict(False, False, Source.FALLBACK, rule.limit, 0, now_ms + retry, retry)
        return Decision(
            False,
            rule.limit,
            0,
            now_ms + retry,
            retry,
            Origin.FAIL_CLOSED,
            None,
            why,
            False,
            [ItemDecision(rule.rule_id, verdict)],
        )

    def _local_limit(self, limit: LocalLimit, key: str, cost: int, why: Degraded, now_ms: int) -> Decision:
        capacity = float(max(limit.limit, 1))
        rate = capacity / max(limit.per, 1e-3)  # tokens per second
        now = time.monotonic()
        with self._lock:
            if len(self._local) >= _LOCAL_KEYS and key not in self._local:
                self._local.clear()
            tokens, at = self._local.get(key, (capacity, now))
            tokens = min(tokens + (now - at) * rate, capacity)
            allowed = tokens >= cost
            if allowed:
                tokens -= cost
            else:
                self.stats.local_denied += 1
            self._local[key] = (tokens, now)
        retry = 0 if allowed else max(math.ceil((cost - tokens) / rate * 1000), 1)
        return Decision(
            allowed,
            limit.limit,
            int(max(tokens, 0.0)),
            now_ms + retry,
            None if allowed else retry,
            Origin.LOCAL_LIMIT,
            None,
            why,
        )

    def note_in_flight(self, n: int) -> None:
        if n > self.stats.max_in_flight:
            self.stats.max_in_flight = n

    def snapshot(self) -> ClientStats:
        with self._lock:
            s = self.stats
            return ClientStats(
                s.unavailable, s.timeouts, s.connects, s.local_denied, s.max_in_flight, s.rule_denied
            )

    def connected(self) -> None:
        with self._lock:
            self.stats.connects += 1
