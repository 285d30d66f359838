"""Leases of concurrency rules (protocol version 3): what ``acquire`` returns and ``release`` gives
back, and the lease ids a client picks."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional, Union

from . import protocol as p
from .decision import Decision, RareWarning, log


@dataclass(frozen=True)
class Lease:
    """Units a concurrency rule holds for this client: ``cost`` units of ``rule_id`` for ``key``,
    under the lease ``id``. Release it (``client.release(lease)``) when the work ends; the agent
    frees it by itself once the rule's ``leaseSeconds`` have passed otherwise."""

    key: str
    rule_id: str
    cost: int
    id: int


def new_lease_id() -> int:
    """A fresh lease id: 64 random bits, never 0 (PROTOCOL.md: random, so that two clients never
    pick the same one for a key). From the OS's CSPRNG, so forked workers never share a sequence."""
    while True:
        lease = secrets.randbits(64)
        if lease:
            return lease


def held(d: Decision, key: str, rule_id: str, cost: int, lease: int) -> Optional[Lease]:
    """The lease an acquire's decision says its rule now holds, else ``None`` (denied, the agent
    away, or a rule that is not a concurrency rule)."""
    for it in d.items:
        if it.rule_id == rule_id and it.verdict.holds_lease:
            return Lease(key, rule_id, cost, lease)
    return None


RELEASE_LOST = RareWarning()


def release_taken(d: Decision, lease: Optional[int] = None) -> None:
    """Logs a release the agent did not take (away or late: the SDK answered for it): at debug each
    time, and a warning at most once a minute, since its units stay held until the lease runs out
    (the rule's ``leaseSeconds``) and may deny requests meanwhile."""
    if not d.from_agent:
        why = d.degraded.value if d.degraded is not None else d.origin.value
        log.debug("floodgate: the agent could not take the release of lease %s (%s)", lease, why)
        RELEASE_LOST.warn(
            "floodgate: the agent could not take a lease's release (%s); its units stay held until the"
            " lease runs out (said at most once a minute)",
            why,
        )


def release_failed(e: BaseException, lease: Optional[int] = None) -> None:
    """Logs a release that raised (e.g. to an agent that speaks a version older than 3, or a rule
    gone since the acquire): at debug each time, a warning at most once a minute; never raised."""
    log.debug("floodgate: the release of lease %s failed: %s", lease, e)
    RELEASE_LOST.warn(
        "floodgate: a lease's release failed; its units stay held until the lease runs out (said at"
        " most once a minute): %s",
        e,
    )


def precaution_not_sent(lease: Optional[int], why: object) -> None:
    """Logs, at debug only, a precautionary release (of a lease whose check the agent did not
    answer) that could not be sent: the agent may never have taken the lease, and a release of a
    lease not held changes nothing, so it is no cause for a warning."""
    log.debug("floodgate: the precautionary release of lease %s was not sent: %s", lease, why)


def release_frame(request_id: int, release: Union[p.Attributes, p.Item]) -> bytes:
    """The Check frame of ``release`` (mode release, with its lease): attributes (form 3) or one
    item (form 2)."""
    if isinstance(release, p.Attributes):
        return p.check_attributes_frame(request_id, release)
    return p.check_one_frame(request_id, release.key, release.rule_id, release.cost, p.ItemMode.RELEASE, release.lease)
