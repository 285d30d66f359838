"""The sans-I/O core of a client: everything ``Client`` and ``AsyncClient`` decide without a socket.

The two clients are transports over one :class:`Core`: they connect, write the bytes it gives them,
feed it the bytes the agent sends and wait for their calls' answers (a blocking socket and a lock
per call, or asyncio streams and futures). The core builds each call's request, refuses what the
connection's protocol version cannot carry and adds the trace context, matches replies to the calls
waiting for them, judges the agent's answer to Hello, asks for the fail-mode list, picks the
reconnection delays, and through its :class:`~floodgate._policy.Policy` answers by the fail policy
and keeps the counters behind ``stats()`` and ``health()``. It opens nothing, awaits nothing and
reads no clock it is not given (its one look outside is the socket lookup, which it is given too),
so tests drive it with bytes (tests/test_core.py).
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import protocol as p
from ._policy import UNAVAILABLE, Policy, Subject
from .decision import ClientConfig
from .errors import UnsupportedByAgent
from .fail_modes import FailModeList
from .health import Health, Reachability, describe
from .lease import Lease, precaution_not_sent, release_frame
from .reservation import Reservation, commit_frame, commit_items, commit_not_sent, reserve_items
from .socket_path import default_socket_path

MAX_UNSENT = 1 << 20
"""Past this many bytes written but not yet taken by the socket (an agent that stopped reading),
calls answer by their policy instead of queueing more: 1 MiB is some 20,000 one-item checks, more
than the 8,192 a client has in flight at most by default (``max_pending``)."""

FAIL_MODES = 2
"""The protocol version from which the agent keeps a fail-mode list: asked right after Hello and
again every ``fail_modes.REFRESH_EVERY`` seconds."""

LEASES = 3
"""The protocol version from which an agent holds leases (acquire, release)."""

RESERVATIONS = p.RESERVATIONS
"""The protocol version from which an agent holds reservations (reserve, commit)."""

LASTED = 1.0
"""A connection that stayed up this many seconds resets the reconnection backoff; one that did not
(an agent that accepts and then drops every connection) keeps doubling it, so it is not hammered
every ``reconnect_min``."""

Request = Tuple[int, bytes, Subject, int]
"""A call's request: its id, its Check frame, what it checks (for the fail policy) and the protocol
version the connection must speak to be sent it (a plain tuple: it is built on every call)."""

_CONSUME = p.ItemMode.CONSUME
_PEEK = p.ItemMode.PEEK
_CHARGE = p.ItemMode.CHARGE
_RELEASE = p.ItemMode.RELEASE


class HandshakeError(Exception):
    """The agent's answer to Hello is not one this SDK can use; the message says why (it is what
    ``health().last_error`` and the "cannot reach the agent" warning say)."""


def configure(config: Optional[ClientConfig], overrides: Dict[str, Any]) -> ClientConfig:
    """A client's configuration: ``config`` (the defaults if ``None``) with the keyword arguments
    given to the client's constructor overriding its fields (checked again by ``ClientConfig``)."""
    config = config or ClientConfig()
    if overrides:
        config = ClientConfig(**{**config.__dict__, **overrides})
    return config


class Core:
    """One client's state and decisions, whatever carries its bytes. ``path`` is the address the
    client was given (``None``: looked up with ``lookup`` on each connection attempt). ``lookup``,
    ``clock`` (monotonic seconds) and ``wall`` (Unix seconds) are the world as the core sees it,
    given by tests. Used from one event loop, or from several threads as the threaded client does:
    what it changes in place is one atomic step under the GIL (a dict's set or pop, the id
    counter's ``next``), and its :class:`~floodgate._policy.Policy` and
    :class:`~floodgate.health.Reachability` lock themselves."""

    def __init__(
        self,
        path: Optional[str],
        config: ClientConfig,
        fail_modes: Optional[FailModeList] = None,
        *,
        lookup: Callable[[], str] = default_socket_path,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.given = None if path is None else str(path)
        if self.given is not None:
            p.tcp_address(self.given)  # a bad tcp:// address given here is the caller's mistake: raise now
        self._lookup = lookup
        self.path = self.given if self.given is not None else lookup()
        """The agent's address in use, or tried last."""
        self.config = config
        self._clocks = (clock, wall)
        self.policy = Policy(config, fail_modes, clock=clock, wall=wall)
        self.reach = Reachability(self.path, config.fail.value, clock)
        self.pending: Dict[int, Any] = {}
        """The calls waiting for an answer, by request id: whatever the transport wakes them with."""
        self._ids = itertools.count(1)  # next() on it is atomic: threads never draw the same id

    def renewed(self) -> "Core":
        """A fresh core for the same address and configuration (a forked process's): no calls, no
        counters, and the fail-mode list known so far, kept as across a disconnection."""
        clock, wall = self._clocks
        return Core(self.given, self.config, self.policy.fail_modes, lookup=self._lookup, clock=clock, wall=wall)

    # --- requests ------------------------------------------------------------------------------

    def next_id(self) -> int:
        """A request id: never 0, never one a waiting call holds (ids wrap at 32 bits)."""
        while True:
            rid = next(self._ids) & 0xFFFF_FFFF
            if rid != 0 and rid not in self.pending:
                return rid

    def allow(self, key: str, rule_id: str, cost: int) -> Request:
        rid = self.next_id()
        return rid, p.check_one_frame(rid, key, rule_id, cost), ((key, rule_id, cost),), 1

    def peek(self, key: str, rule_id: str, cost: int) -> Request:
        rid = self.next_id()
        return rid, p.check_one_frame(rid, key, rule_id, cost, _PEEK), (p.Item(key, rule_id, cost, _PEEK),), 2

    def charge(self, key: str, rule_id: str, cost: int) -> Request:
        rid = self.next_id()
        return rid, p.check_one_frame(rid, key, rule_id, cost, _CHARGE), (p.Item(key, rule_id, cost, _CHARGE),), 2

    def acquire(self, key: str, rule_id: str, cost: int, lease: int) -> Request:
        rid = self.next_id()
        frame = p.check_one_frame(rid, key, rule_id, cost, _CONSUME, lease)
        return rid, frame, (p.Item.acquire(key, rule_id, cost, lease),), LEASES

    def release(self, lease: Lease) -> Request:
        rid = self.next_id()
        item = p.Item.release(lease.key, lease.rule_id, lease.cost, lease.id)
        return rid, p.check_one_frame(rid, item.key, item.rule_id, item.cost, _RELEASE, item.lease), (item,), LEASES

    def reserve(self, reservation: Reservation) -> Request:
        rid = self.next_id()
        items = reserve_items(reservation)
        return rid, p.check_items_frame(rid, items), items, RESERVATIONS

    def commit(self, reservation: Reservation, used: Sequence[int]) -> Request:
        rid = self.next_id()
        items = commit_items(reservation, used)
        return rid, p.check_items_frame(rid, items), items, RESERVATIONS

    def check(self, items: Sequence[Any]) -> Request:
        rid = self.next_id()
        frame = p.check_items_frame(rid, items)
        return rid, frame, items, p.check_version(frame)

    def check_request(self, attributes: p.Attributes) -> Request:
        rid = self.next_id()
        frame = p.check_attributes_frame(rid, attributes)
        return rid, frame, attributes, p.check_version(frame)

    def prepare(self, frame: bytes, need: int, version: int, traceparent: Optional[str]) -> bytes:
        """``frame`` as it goes to a connection of ``version``: raises
        :class:`~floodgate.UnsupportedByAgent` when that is below ``need`` (a version-1 agent cannot
        parse a peek and would close the connection), and wraps it in the caller's trace context
        (form 4) only for version 5 or more; a ``traceparent`` that does not parse is left out."""
        if need > version:
            raise UnsupportedByAgent(need, version, self.path)
        if traceparent is not None and version >= p.TRACE_CONTEXT:
            trace = p.TraceContext.parse(traceparent)
            if trace is not None:
                return p.traced(frame, trace)
        return frame

    def unanswered_release(
        self, release: Union[p.Attributes, p.Item], version: Optional[int], traceparent: Optional[str]
    ) -> Optional[bytes]:
        """The precautionary release of a lease whose check the agent did not answer (it timed out,
        the connection went, or the caller was cancelled), for a connection of ``version`` (``None``:
        none): the frame to send without waiting for its answer, or ``None`` when it cannot be sent,
        said at debug only (the agent may never have taken the lease). Never raises."""
        return self._precaution(
            lambda rid: release_frame(rid, release),
            LEASES,
            version,
            traceparent,
            lambda why: precaution_not_sent(release.lease, why),
        )

    def unanswered_commit(
        self, reservation: Reservation, version: Optional[int], traceparent: Optional[str]
    ) -> Optional[bytes]:
        """The precautionary commit at 0 of a reservation whose check the agent did not answer (it
        may hold it all the same; a commit of a reservation not held gives nothing back and, under
        the default ``reservationExpiry``, charges nothing), as :meth:`unanswered_release` builds a
        release. Never raises."""
        return self._precaution(
            lambda rid: commit_frame(rid, reservation, [0] * len(reservation.meters)),
            RESERVATIONS,
            version,
            traceparent,
            lambda why: commit_not_sent(reservation.id, why),
        )

    def _precaution(
        self,
        build: Callable[[int], bytes],
        need: int,
        version: Optional[int],
        traceparent: Optional[str],
        not_sent: Callable[[object], None],
    ) -> Optional[bytes]:
        """The frame ``build`` makes for a fresh request id, prepared for a connection of
        ``version``, or ``None`` (``not_sent`` told why) when there is none or it cannot carry it."""
        if version is None:
            not_sent("no connection to the agent")
            return None
        try:
            return self.prepare(build(self.next_id()), need, version, traceparent)
        except Exception as e:  # noqa: BLE001 - a precaution: it never fails the caller
            not_sent(e)
            return None

    def fail_modes_ask(self, version: int) -> Optional[bytes]:
        """The FailModes ask for a connection of ``version``; ``None`` below version 2."""
        return p.fail_modes_frame(self.next_id()) if version >= FAIL_MODES else None

    # --- what the agent sends ------------------------------------------------------------------

    @staticmethod
    def hello(buf: bytearray) -> Optional[int]:
        """The protocol version the agent's answer to Hello at the start of ``buf`` chose, that
        answer then dropped from ``buf``; ``None`` while it is incomplete. Raises
        :class:`HandshakeError` for any other answer."""
        status, value, used = p.decode_reply(buf, 0)
        if status == 0:
            return None
        if status == 1:
            _, body = value
            if isinstance(body, p.HelloOk) and p.MIN_VERSION <= body.version <= p.VERSION:
                del buf[:used]
                return body.version
            if isinstance(body, p.HelloOk):
                raise HandshakeError(
                    f"agent chose version {body.version}; this SDK speaks {p.MIN_VERSION} to {p.VERSION}"
                )
            if isinstance(body, p.ErrorBody):
                raise HandshakeError(f"agent refused Hello: {int(body.code)}: {body.message}")
        raise HandshakeError("unexpected answer to Hello (not a Floodgate agent?)")

    def dispatch(self, buf: bytearray, wake: Callable[[Any, object], None]) -> Optional[str]:
        """Wakes, with ``wake(waiter, reply)``, each call whose answer ``buf`` holds, learns the
        fail-mode lists it holds, and drops what it used from ``buf``, keeping a partial frame;
        returns why the stream broke (close the connection), else ``None``. An answer this SDK
        cannot read (bad text, another version) wakes its call with ``UNAVAILABLE``: it answers by
        its fail policy now instead of waiting out its timeout. A HelloOk or a Pong after the
        handshake, and an answer to a call that stopped waiting, wake no one."""
        pos = 0
        pending = self.pending
        decode = p.decode_reply
        try:
            while True:
                status, value, used = decode(buf, pos)
                if status == 0:
                    return None
                if status == 3:
                    return f"the agent sent a broken frame: {value}"
                pos += used
                if status == 1:
                    rid, body = value
                    if isinstance(body, (p.DecisionBody, p.ErrorBody)):
                        w = pending.pop(rid, None)
                        if w is not None:
                            wake(w, body)
                    elif isinstance(body, FailModeList):
                        self.policy.learn(body)
                else:
                    w = pending.pop(value, None)
                    if w is not None:
                        wake(w, UNAVAILABLE)
        finally:
            if pos:
                del buf[:pos]

    def drain(self) -> List[Any]:
        """Every waiting call, taken out of :attr:`pending` (emptied in place: a caller that
        registered its call just now, on another thread, is in this same dict): wake them with
        ``UNAVAILABLE``, the connection is gone."""
        pending = self.pending
        out = []
        for rid in list(pending):
            w = pending.pop(rid, None)
            if w is not None:
                out.append(w)
        return out

    # --- the connection's life -----------------------------------------------------------------

    def next_address(self) -> str:
        """The address to try now: the one given, else looked up again on every attempt (an agent
        started after this process is found where it is)."""
        self.path = self.given if self.given is not None else self._lookup()
        return self.path

    def connected(self, path: str) -> None:
        """A connection to ``path`` was made and its Hello answered."""
        self.policy.connected()
        self.reach.connected(path)

    def failed(self, path: str, error: BaseException) -> None:
        """A connection attempt to ``path`` failed with ``error`` (logged at most every 10 s)."""
        self.reach.failed(path, describe(error, self.config.connect_timeout))

    def lost(self, why: str) -> None:
        """The live connection ended, for ``why`` (``health().last_error``)."""
        self.reach.lost(why)

    def health(self, connected: bool) -> Health:
        s = self.policy.snapshot()
        return self.reach.health(connected, s.unavailable + s.timeouts, self.policy.fail_modes)


class Backoff:
    """The delays between connection attempts: ``reconnect_min`` after a connection that lasted,
    doubled after each attempt that failed (or connection that did not last) up to
    ``reconnect_max``, each times a random factor in [0.5, 1) so that a fleet of processes whose
    agent restarted does not reconnect in lockstep. ``uniform`` draws that factor."""

    def __init__(
        self, config: ClientConfig, uniform: Callable[[float, float], float] = random.uniform
    ) -> None:
        self._min = config.reconnect_min
        self._max = config.reconnect_max
        self._uniform = uniform
        self._last: Optional[float] = None

    def lasted(self, seconds: float) -> None:
        """A connection ended after ``seconds`` up: at least :data:`LASTED` starts the doubling afresh."""
        if seconds >= LASTED:
            self._last = None

    def next_delay(self) -> float:
        """The seconds to wait before the next attempt."""
        delay = self._min if self._last is None else min(self._last * 2, self._max)
        self._last = delay
        return delay * self._uniform(0.5, 1.0)
