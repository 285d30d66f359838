"""Version 2's fail-mode list: the rules that deny while the agent is away, as the agent sends them
(``FailModeList``, PROTOCOL.md "Version 2") and as the SDK matches a check against them. The
endpoint matcher is the agent's own, and passes the page's pattern table."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

REFRESH_EVERY = 10.0
"""Seconds between two FailModes asks on one connection (PROTOCOL.md: "again every 10 s while
connected"): an operator's new fail-closed rule reaches every SDK within 10 s, for one small frame
per process every 10 s."""


class ListedDimension(enum.IntEnum):
    """The attribute a listed rule's keys are built from."""

    USER = 0
    API_KEY = 1
    IP = 2
    DESCRIPTOR = 3
    """An Envoy descriptor: never matches an attribute check."""


@dataclass
class ClosedRule:
    """One enforced rule with ``failMode = "closed"``: what the SDK needs to tell whether a check
    touches it, and its limit for ``X-RateLimit-Limit``."""

    rule_id: str
    dimension: ListedDimension
    endpoint: str = ""
    """Its endpoint pattern; empty: every endpoint."""
    tier: str = ""
    """Its tier; empty: every tier."""
    limit: int = 0
    """Its limit (token bucket: its capacity)."""

    def touches(self, check: Any) -> bool:
        """Whether the agent would check ``check`` (a :class:`~floodgate.protocol.Check`) against
        this rule: an item names it, or the attributes match it as the agent matches them (the
        rule's dimension carried, its tier, its endpoint pattern)."""
        if check.items is not None:
            return any(it[1] == self.rule_id for it in check.items)
        a = check.attributes
        if self.dimension is ListedDimension.USER:
            carried = a.user
        elif self.dimension is ListedDimension.API_KEY:
            carried = a.api_key
        elif self.dimension is ListedDimension.IP:
            carried = a.ip
        else:
            return False
        if not carried:
            return False
        if self.tier and a.tier != self.tier:
            return False
        return not self.endpoint or (bool(a.endpoint) and endpoint_matches(self.endpoint, a.endpoint))


@dataclass
class FailModeList:
    """The body of a FailModeList frame: every enforced fail-closed rule, in rule-set order."""

    rules_version: int = 0
    """The agent's rule set version (0 for a rules file)."""
    truncated: bool = False
    """More rules than one frame holds: ``rules`` is a prefix of the list."""
    rules: List[ClosedRule] = field(default_factory=list)
    # The first rule of each id and its place in the list, for items checks: built on first use.
    _by_id: Optional[Dict[str, Tuple[int, ClosedRule]]] = field(default=None, init=False, repr=False, compare=False)

    def closing(self, check: Any) -> Optional[ClosedRule]:
        """The first listed rule ``check`` touches, if any: such a check is denied while the agent is
        away."""
        if check.items is not None:
            by_id = self._by_id
            if by_id is None:
                by_id = {}
                for i, r in enumerate(self.rules):
                    by_id.setdefault(r.rule_id, (i, r))
                self._by_id = by_id
            # The first in list order, whichever item named it.
            found = [hit for hit in (by_id.get(it[1]) for it in check.items) if hit is not None]
            return min(found, key=lambda hit: hit[0])[1] if found else None
        for r in self.rules:
            if r.touches(check):
                return r
        return None


def endpoint_matches(pattern: str, endpoint: str) -> bool:
    """Whether ``endpoint`` matches a rule's endpoint ``pattern`` as the agent matches it: exactly
    when the pattern has no ``*``; else segment by segment (split at ``/``), a ``*`` segment matching
    any one segment and a ``*`` as the last segment matching that segment and everything after it
    (``/api/*`` matches ``/api/a/b``, not ``/api``)."""
    if "*" not in pattern:
        return pattern == endpoint
    want = pattern.split("/")
    have = endpoint.split("/")
    last = len(want) - 1
    for i, w in enumerate(want):
        if i >= len(have):
            return False
        if w == "*":
            if i == last:
                return True
        elif w != have[i]:
            return False
    return len(have) == len(want)
