"""What a client answers by itself when the agent cannot, and its counters: the fail policy, the
agent's fail-closed rules, the per-process fallback limit (PROTOCOL.md, "Version 2"). Both clients
share one :class:`Policy` through their sans-I/O core (:mod:`floodgate._core`); it reads the time
only through the clocks it is given, so tests drive the fallback limit by hand."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from .decision import ClientConfig, ClientStats, Decision, Degraded, FailPolicy, LocalLimit, Origin, decision_from_agent
from .errors import AgentError
from .fail_modes import ClosedRule, FailModeList
from .protocol import Attributes, Check, DecisionBody, ErrorBody, ErrorCode, ItemDecision, ItemMode, Source, Verdict

log = logging.getLogger("floodgate")

# Sentinels a waiting call may be woken with instead of an agent's answer.
UNAVAILABLE = object()
TIMEOUT = object()

_LOCAL_KEYS = 100_000


Subject = Union[Sequence[Any], Attributes]
"""What a call checks: its items (``(key, rule_id[, cost])``), or its attributes."""


_TAKES_IF_PASSED = (ItemMode.CONSUME, ItemMode.RESERVE)


def consumes_only(subject: Subject) -> bool:
    """Whether every item of what a call checks takes its cost if it passes (no peek, charge,
    release or commit; an acquire, a consume under a lease, and a reserve count as consumes)."""
    if isinstance(subject, Attributes):
        return subject.mode in _TAKES_IF_PASSED
    return all(getattr(it, "mode", ItemMode.CONSUME) in _TAKES_IF_PASSED for it in subject)


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


class Policy:
    """What the asyncio and the threaded client answer when the agent cannot, and their counters:
    the configuration's fail policy, the fail-mode list and the fallback limit. Thread-safe.
    ``clock`` (monotonic seconds) refills the fallback limit's buckets; ``wall`` (Unix seconds)
    dates the decisions' ``reset_at_ms``."""

    def __init__(
        self,
        config: ClientConfig,
        fail_modes: Optional[FailModeList] = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self._wall = wall
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
        now = int(self._wall() * 1000)
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
        # The per-process limit counts what passes: a peek takes nothing, a charge or a commit is
        # owed whatever it says and a release gives back, so only consuming checks (acquires and
        # reserves among them) go through it (as in the Rust SDK).
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
        now = self._clock()
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
