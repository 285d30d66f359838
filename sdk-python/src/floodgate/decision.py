"""Decisions as the SDK returns them, the client configuration and its counters (what the SDK answers
when the agent cannot is :mod:`floodgate._policy`)."""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

from .protocol import DecisionBody, ItemDecision, Source

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
        :attr:`~floodgate.Verdict.holds_lease`, protocol version 3): release it when the work ends.
        On a reserve (version 6): the agent holds the reservation of an item."""
        return any(it.verdict.holds_lease for it in self.items)

    @property
    def over_quota(self) -> bool:
        """Whether the request passes past the limit of a rule with ``overLimit = "flag"`` (quota
        mode, an item's :attr:`~floodgate.Verdict.over_quota`, protocol version 6): allowed, counted
        nowhere on that rule, for the caller to route elsewhere (a cheaper model, a fallback)."""
        return any(it.verdict.over_quota for it in self.items)

    @property
    def over_quota_rules(self) -> List[str]:
        """The ids of the rules whose limit the request passes in quota mode, in the agent's item
        order (empty when :attr:`over_quota` is false). A check another rule refused still names
        them: such an item never decides the check (the middleware flag only what they let
        through)."""
        return [it.rule_id for it in self.items if it.verdict.over_quota]

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
