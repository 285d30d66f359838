"""Reservations (protocol version 6): reserve what a request may use before it runs (``max_tokens``,
or an estimate), commit what it used after; the agent gives the rest back, or charges a use past
it. Several meters (input tokens, output tokens, cost, requests in flight) are reserved all or
nothing in one check and committed in one more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import protocol as p
from .decision import Decision, log
from .errors import InvalidCheck


class Meter(NamedTuple):
    """One meter of a reservation: a ``(key, rule_id)`` and the units reserved on it. A plain
    ``(key, rule_id, units)`` tuple is taken wherever a meter is."""

    key: str
    """The client key, e.g. ``apikey:abc``."""
    rule_id: str
    """The rule that meters it, e.g. ``output-tokens``."""
    units: int
    """The units reserved (at least 1)."""


MeterLike = Union[Meter, Tuple[str, str, int]]
"""A :class:`Meter`, or the ``(key, rule_id, units)`` tuple it is."""


@dataclass(frozen=True)
class Reservation:
    """A reservation the agent holds: commit it (``client.commit(reservation, used)``) once the
    request's use is known; one never committed expires after its rules' ``reservationSeconds``."""

    id: int
    """Its id, chosen by this client (64 random bits, as a lease id)."""
    meters: Tuple[Meter, ...]
    """Its meters, in the order they were reserved (the order ``commit`` takes its figures in)."""
    held: Optional[Tuple[bool, ...]] = None
    """Which meters the agent holds, in that order (``None``: all): every one but a quota-mode
    meter (``overLimit = "flag"``) the request passed flagged, which took nothing."""


def meters_of(meters: Iterable[MeterLike]) -> Tuple[Meter, ...]:
    """``meters`` as :class:`Meter` (the protocol checks their figures when the check is built)."""
    out = []
    for m in meters:
        if isinstance(m, Meter):
            out.append(m)
            continue
        try:
            key, rule_id, units = m
        except (TypeError, ValueError):
            raise InvalidCheck(f"a meter is (key, rule_id, units), not {m!r}") from None
        out.append(Meter(key, rule_id, units))
    return tuple(out)


def reserve_items(reservation: Reservation) -> List[p.Item]:
    """The items that reserve ``reservation``'s meters under its id."""
    return [p.Item.reserve(m.key, m.rule_id, m.units, reservation.id) for m in reservation.meters]


def commit_items(reservation: Reservation, used: Sequence[int]) -> List[p.Item]:
    """The items that settle ``reservation`` at ``used``, one figure per meter in its order; raises
    :class:`~floodgate.InvalidCheck` when the figures and the meters do not pair up. A meter of
    units in flight (a concurrency rule) is released whole whatever its figure: the agent knows
    what it holds."""
    if isinstance(used, (int, str, bytes)) or not isinstance(used, Sequence):
        raise InvalidCheck(f"commit takes a list of used figures, one per meter, not {used!r}")
    if len(used) != len(reservation.meters):
        raise InvalidCheck(
            f"commit takes one used figure per meter, in the reservation's order: {len(used)} given"
            f" for a reservation of {len(reservation.meters)} meters"
        )
    # Only the meters the agent holds (a flagged quota-mode meter took nothing).
    held = reservation.held or (True,) * len(reservation.meters)
    items = [
        p.Item.commit(m.key, m.rule_id, u, reservation.id)
        for m, u, h in zip(reservation.meters, used, held)
        if h
    ]
    if not items:
        raise InvalidCheck("the reservation holds no meter")
    return items


def commit_frame(request_id: int, reservation: Reservation, used: Sequence[int]) -> bytes:
    """The Check frame of :func:`commit_items` (form 2)."""
    return p.check_items_frame(request_id, commit_items(reservation, used))


def held(d: Decision, reservation: Reservation) -> Optional[Reservation]:
    """``reservation`` with the meters the agent holds (each item's holds-lease flag: every meter
    of an admitted check, but a quota-mode meter let through flagged) when the check passed and
    any is held, else ``None``: denied, or the agent away."""
    flags = tuple(it.verdict.holds_lease for it in d.items)
    if d.from_agent and d.allowed and any(flags):
        return Reservation(reservation.id, reservation.meters, flags)
    return None


def commit_not_sent(reservation: Optional[int], why: object) -> None:
    """Logs, at debug only, a precautionary commit at 0 (of a reservation whose check the agent did
    not answer) that could not be sent: the agent may never have taken the reservation, and one it
    did take expires after its rules' ``reservationSeconds``."""
    log.debug("floodgate: the precautionary commit of reservation %s was not sent: %s", reservation, why)
