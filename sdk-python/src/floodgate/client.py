"""The synchronous client, for WSGI apps and threads: thread-safe, one connection per process.

A transport over the sans-I/O core (:mod:`floodgate._core`), which builds the requests, matches
the answers, judges the Hello and answers by the fail policy. A background thread owns the socket:
it connects and says Hello, reads answers and wakes the calling thread by request id, writes what
callers could not write at once, asks a version-2 agent for its fail-mode list every 10 s, and
reconnects with backoff and jitter. Callers write their own checks when the socket takes them (the
common case), so a call costs one ``send`` and one wake-up. Like the asyncio client, every call
returns within its timeout, answering by its fail policy when the agent cannot.

Example::

    client = Client()  # $FLOODGATE_SOCKET, else the agent's default socket: see default_socket_path
    d = client.allow("user:123", "api-per-user")
    if client.peek("user:123", "llm-tokens").allowed:  # not yet out of tokens
        ...  # call the model; then take what it used, even past the limit:
        client.charge("user:123", "llm-tokens", used)
    with client.hold("apikey:abc", "gpu-slots") as d:  # a concurrency rule: one unit in flight
        if d.allowed:
            ...  # the unit is given back when the block ends
    d, r = client.reserve("apikey:abc", "output-tokens", 4096)  # the request's max_tokens
    if r is not None:
        ...  # call the model; then settle at what it used, the rest given back:
        client.commit(r, [used])
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import fail_modes as fm
from . import protocol as p
from ._core import FAIL_MODES, MAX_UNSENT, Backoff, Core, HandshakeError, Request, configure
from ._policy import TIMEOUT, UNAVAILABLE
from .decision import ClientConfig, ClientStats, Decision, Degraded, FailPolicy
from .errors import UnsupportedByAgent
from .health import Health, describe
from .lease import Lease, held, new_lease_id, precaution_not_sent, release_failed, release_taken
from .reservation import Meter, MeterLike, Reservation, commit_not_sent, meters_of
from .reservation import held as reservation_held

_Mode = Union[p.ItemMode, int, str]
"""An item mode: an :class:`~floodgate.ItemMode`, its value or its lower-case name."""


class _Waiter:
    """One call waiting for its answer: a lock held until the reader thread releases it."""

    __slots__ = ("lock", "reply")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.reply: object = None

    def wake(self, reply: object) -> None:
        self.reply = reply
        try:
            self.lock.release()
        except RuntimeError:  # already woken
            pass


_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
_fork_lock = threading.Lock()


def _after_fork() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()
    for c in list(_clients):
        c._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class Client:
    """A thread-safe client of the local agent. Use one per process: it holds one connection on
    which calls from every thread are multiplexed by request id. ``path`` is the agent's Unix socket,
    or ``tcp://host:port`` for an agent's ``--listen-tcp``, used as given; without it the client
    looks the socket up with :func:`~floodgate.default_socket_path` (``$FLOODGATE_SOCKET`` first) on
    every connection attempt.

    The constructor starts the background thread and waits up to ``connect_timeout`` for the first
    connection (it is not an error if the agent is not there). Keyword arguments override fields of
    :class:`~floodgate.ClientConfig`. A process forked after the client was made (a pre-forking
    server) gets a fresh connection of its own on its first call.

    Every check call (``allow``, ``peek``, ``charge``, ``acquire``, ``release``, ``hold``,
    ``reserve``, ``reserve_meters``, ``commit``, ``check``, ``check_attributes``,
    ``check_request``) takes ``traceparent=``: the W3C ``traceparent`` header
    of the request being served (``00-<trace id>-<span id>-<flags>``). To an agent speaking protocol
    version 5 the check then carries that trace context, so that the agent's span of the check (an
    agent exporting traces, ``--otlp-endpoint``) is a child of the caller's span; an older agent is
    sent the check without it. A value that does not parse is ignored: it never fails a check. It
    never changes the decision.
    """

    def __init__(self, path: Optional[str] = None, config: Optional[ClientConfig] = None, **overrides: Any):
        self._config = configure(config, overrides)
        self._core = Core(path, self._config)
        self._forked = False
        self._closed = False
        self._init_state()
        _clients.add(self)
        self._start()

    def _init_state(self) -> None:
        self._lock = threading.Lock()  # guards _sock, _version and _out
        self._sock: Optional[socket.socket] = None
        # The version the connection's HelloOk chose (set with _sock, under _lock): a check that
        # needs more is refused before it is written.
        self._version = 1
        self._out: List[bytes] = []
        self._out_len = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: Optional[threading.Thread] = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="floodgate-client", daemon=True)
        self._thread.start()
        self._ready.wait(self._config.connect_timeout)

    def _restart_after_fork(self) -> None:
        # The parent's thread does not exist here, and its socket is the parent's connection.
        with _fork_lock:
            if not self._forked:
                return
            self._forked = False
            if self._closed:
                return
            # The child's copies of the parent's descriptors: closing them leaves the parent's alone.
            old = [self._sock, self._wake_r, self._wake_w]
            self._init_state()
            for s in old:
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
            # No calls, no counters; the parent's fail-mode list, the last one known, is kept.
            self._core = self._core.renewed()
            self._start()

    def close(self) -> None:
        """Stops the background thread and closes the connection; waiting calls answer by policy."""
        self._closed = True
        self._stop.set()
        self._wake()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def config(self) -> ClientConfig:
        return self._config

    @property
    def path(self) -> str:
        """The agent's address in use, or tried last (what :meth:`health` reports)."""
        return self._core.path

    def is_connected(self) -> bool:
        """Whether the client holds a live connection to the agent right now."""
        return self._sock is not None

    @property
    def protocol_version(self) -> Optional[int]:
        """The protocol version the connection's handshake chose (1 to 6), ``None`` while there is
        no connection."""
        return self._version if self._sock is not None else None

    def stats(self) -> ClientStats:
        """Counts of degraded answers and connections, for the service's metrics."""
        return self._core.policy.snapshot()

    def health(self) -> Health:
        """Whether the agent is reachable, where, why not, and how many calls the fail policy
        answered, and the fail-closed rules it knows: for a service's health endpoint (an
        unreachable agent otherwise shows only as requests passing without rate-limit headers)."""
        return self._core.health(self.is_connected())

    # --- calls -------------------------------------------------------------------------------

    def allow(
        self,
        key: str,
        rule_id: str,
        cost: int = 1,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """One ``(key, rule_id, cost)`` item: consumes ``cost`` if it passes."""
        return self._call(self._core.allow(key, rule_id, cost), timeout, fail, traceparent)

    def peek(
        self,
        key: str,
        rule_id: str,
        cost: int = 0,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Whether ``cost`` would pass now, changing nothing: ``remaining`` is what is left now, and
        a denial says when ``cost`` could pass. A cost of 0 asks whether the key is already past its
        limit. Needs an agent speaking protocol version 2 (:class:`~floodgate.UnsupportedByAgent`
        otherwise); when the agent cannot answer, the fail policy decides as for any check."""
        return self._call(self._core.peek(key, rule_id, cost), timeout, fail, traceparent)

    def charge(
        self,
        key: str,
        rule_id: str,
        cost: int,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Takes ``cost`` whatever the limit says, for a cost known only after the response (tokens,
        bytes): past the limit it is a debt that later checks wait out. The agent always allows it;
        the decision is the state after it (``remaining`` floored at 0). Needs an agent speaking
        protocol version 2, as :meth:`peek` does."""
        return self._call(self._core.charge(key, rule_id, cost), timeout, fail, traceparent)

    def acquire(
        self,
        key: str,
        rule_id: str,
        cost: int = 1,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Tuple[Decision, Optional[Lease]]:
        """Takes ``cost`` units of a concurrency rule under a fresh lease: the decision, and the
        :class:`~floodgate.Lease` to :meth:`release` when the work ends, if the rule now holds it
        (``None`` when denied, when the agent could not answer, or for a rule of another algorithm,
        which consumes as :meth:`allow` does). A lease not released runs out after the rule's
        ``leaseSeconds``. Needs an agent speaking protocol version 3
        (:class:`~floodgate.UnsupportedByAgent` otherwise); when the agent cannot answer, the fail
        policy decides as for any check (the fallback limit counts it as a consume), and since a
        late agent may have taken the lease all the same, its release is sent at once, without
        waiting for an answer."""
        lease = new_lease_id()
        d = self._call(self._core.acquire(key, rule_id, cost, lease), timeout, fail, traceparent)
        if not d.from_agent:
            # Late or lost: the agent may still have taken the lease. Released at once, without
            # waiting for the answer (a release of a lease not held changes nothing).
            self._release_unanswered(p.Item.release(key, rule_id, cost, lease), traceparent)
        return d, held(d, key, rule_id, cost, lease)

    def release(
        self,
        lease: Lease,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Gives back what :meth:`acquire` took: allowed, with the units left after it (a lease no
        longer held changes nothing). Never raises for an agent that cannot answer: the decision is
        then the fail policy's, and the lease runs out by itself after the rule's
        ``leaseSeconds``. Needs protocol version 3, as :meth:`acquire` does."""
        return self._call(self._core.release(lease), timeout, fail, traceparent)

    @contextlib.contextmanager
    def hold(
        self,
        key: str,
        rule_id: str,
        cost: int = 1,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Iterator[Decision]:
        """``with client.hold(key, rule_id) as d:`` :meth:`acquire`, the block (check
        ``d.allowed``), then :meth:`release` of the lease, if one was taken, however the block ends
        (an exception too). A release the agent cannot take, or that raises (an agent replaced by an
        older one meanwhile), is logged, not raised: the lease runs out by itself."""
        d, lease = self.acquire(key, rule_id, cost, timeout=timeout, fail=fail, traceparent=traceparent)
        try:
            yield d
        finally:
            if lease is not None:
                try:
                    release_taken(self.release(lease, timeout=timeout, traceparent=traceparent), lease.id)
                except Exception as e:  # noqa: BLE001 - the block's own outcome is the one to keep
                    release_failed(e, lease.id)

    def reserve(
        self,
        key: str,
        rule_id: str,
        units: int,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Tuple[Decision, Optional[Reservation]]:
        """Reserves ``units`` of ``rule_id`` for ``key`` (a request's ``max_tokens``, or an
        estimate): the decision, and the :class:`~floodgate.Reservation` to :meth:`commit` once the
        use is known, if the agent holds it. :meth:`reserve_meters` with one meter."""
        return self.reserve_meters([Meter(key, rule_id, units)], timeout=timeout, fail=fail, traceparent=traceparent)

    def reserve_meters(
        self,
        meters: Iterable[MeterLike],
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Tuple[Decision, Optional[Reservation]]:
        """Reserves every meter (:class:`~floodgate.Meter` or ``(key, rule_id, units)``, 1 to 16)
        at once, all or nothing, under one fresh reservation id: the decision, and the
        :class:`~floodgate.Reservation` of the meters the agent holds (``None`` when denied, or when
        the agent could not answer). A meter of a concurrency rule holds its units in flight until
        the commit. Needs an agent speaking protocol version 6
        (:class:`~floodgate.UnsupportedByAgent` otherwise); when the agent cannot answer, the fail
        policy decides as for any check (the fallback limit counts it as a consume), and since a
        late agent may hold the reservation all the same, it is committed at 0 at once, without
        waiting for an answer."""
        reservation = Reservation(new_lease_id(), meters_of(meters))
        d = self._call(self._core.reserve(reservation), timeout, fail, traceparent)
        if not d.from_agent:
            # Late or lost: the agent may still hold it. Committed at 0 at once, without waiting
            # for the answer (a commit of a reservation not held gives nothing back and, under the
            # default reservationExpiry, charges nothing).
            self._commit_unanswered(reservation, traceparent)
        return d, reservation_held(d, reservation)

    def commit(
        self,
        reservation: Reservation,
        used: Sequence[int],
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Settles ``reservation`` at what the request used: ``used`` holds one figure per meter,
        in the reservation's order (0 for a meter it did not use; a concurrency meter is released
        whole whatever its figure). The unused units go back, a use past the reservation is
        charged. Never a rejection: the decision is each meter's state after it. Raises
        :class:`~floodgate.InvalidCheck` when ``used`` does not have one figure per meter; needs
        protocol version 6, as :meth:`reserve_meters` does. When the agent cannot answer, the
        decision is the fail policy's and the reservation expires after its rules'
        ``reservationSeconds``."""
        return self._call(self._core.commit(reservation, used), timeout, fail, traceparent)

    def check(
        self,
        items: Iterable[Union[p.Item, Tuple[str, str], Tuple[str, str, int], Tuple[str, str, int, _Mode]]],
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Up to 16 items at once: allowed only if every enforced item is; a denial consumes nothing.
        Items are :class:`~floodgate.Item` or ``(key, rule_id[, cost[, mode]])`` tuples; peek and
        charge items (see :meth:`peek`, :meth:`charge`) need an agent speaking version 2."""
        return self._call(self._core.check(list(items)), timeout, fail, traceparent)

    def check_attributes(
        self,
        endpoint: Optional[str] = None,
        tier: Optional[str] = None,
        user: Optional[str] = None,
        api_key: Optional[str] = None,
        ip: Optional[str] = None,
        cost: int = 1,
        *,
        mode: _Mode = p.ItemMode.CONSUME,
        lease: Optional[int] = None,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Request attributes (``None`` = absent) for the agent to match against its rules; ``mode``
        is what every matched rule does with ``cost`` (peek and charge need version 2); ``lease``
        (version 3) is the lease the matched concurrency rules hold ``cost`` under, or give back
        with ``mode="release"`` (``decision.holds_lease`` says whether one now holds it)."""
        return self.check_request(
            p.Attributes(endpoint, tier, user, api_key, ip, cost, p.item_mode(mode), lease),
            timeout=timeout,
            fail=fail,
            traceparent=traceparent,
        )

    def check_request(
        self,
        attributes: p.Attributes,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """:meth:`check_attributes` with an :class:`~floodgate.Attributes`."""
        return self._call(self._core.check_request(attributes), timeout, fail, traceparent)

    def _release_unanswered(self, release: Union[p.Attributes, p.Item], traceparent: Optional[str] = None) -> None:
        """Sends ``release`` (mode release, with the lease of a check the agent did not answer: it
        timed out, or the connection went) on the connection at hand, without waiting for its
        answer (dropped when it comes, as a late answer is). Never raises: one that cannot be sent
        (no connection, an agent older than version 3) is logged at debug, since the agent may
        never have taken the lease."""
        frame = self._core.unanswered_release(release, self.protocol_version, traceparent)
        self._send_precaution(frame, lambda why: precaution_not_sent(release.lease, why))

    def _commit_unanswered(self, reservation: Reservation, traceparent: Optional[str] = None) -> None:
        """Sends the commit at 0 of ``reservation`` (whose check the agent did not answer) as
        :meth:`_release_unanswered` sends a release: without waiting, never raising."""
        frame = self._core.unanswered_commit(reservation, self.protocol_version, traceparent)
        self._send_precaution(frame, lambda why: commit_not_sent(reservation.id, why))

    def _send_precaution(self, frame: Optional[bytes], not_sent: Callable[[object], None]) -> None:
        if frame is None:
            return
        try:
            # The version checked again under the lock: the connection may have changed meanwhile.
            sent = self._send(frame, p.check_version(frame))
        except Exception as e:  # noqa: BLE001 - a precaution: it never fails the caller
            not_sent(e)
            return
        if not sent:
            not_sent("no connection to the agent")

    def _call(
        self,
        req: Request,
        timeout: Optional[float],
        fail: Union[FailPolicy, str, None],
        traceparent: Optional[str],
    ) -> Decision:
        """Sends a request and waits for its answer. ``traceparent``: the caller's trace context,
        added (form 4) only on a connection of version 5; one that does not parse is left out."""
        if self._forked:
            self._restart_after_fork()
        rid, data, subject, need = req
        policy = self._core.policy
        own = policy.policy(fail)
        pending = self._core.pending
        if self._sock is None or len(pending) >= self._config.max_pending:
            return policy.degraded(own, Degraded.UNAVAILABLE, subject)
        w = _Waiter()
        pending[rid] = w
        policy.note_in_flight(len(pending))
        try:
            sent = self._send(data, need, traceparent)
        except UnsupportedByAgent:
            pending.pop(rid, None)
            raise
        if not sent:
            pending.pop(rid, None)
            return policy.degraded(own, Degraded.UNAVAILABLE, subject)
        w.lock.acquire(True, max(self._config.timeout if timeout is None else timeout, 0.0))
        pending.pop(rid, None)
        reply = w.reply
        return policy.result(TIMEOUT if reply is None else reply, own, subject)

    def _send(self, data: bytes, need: int = 1, traceparent: Optional[str] = None) -> bool:
        """Writes a frame now if the socket takes it, else queues it for the I/O thread. False when
        there is no connection or the queue is full (an agent that stopped reading). The core's
        :meth:`~floodgate._core.Core.prepare` (:class:`~floodgate.UnsupportedByAgent` below ``need``,
        the trace context for version 5) runs under the lock, so against the very connection the
        frame goes to (a queued frame never outlives it)."""
        with self._lock:
            sock = self._sock
            if sock is None or self._out_len > MAX_UNSENT:
                return False
            data = self._core.prepare(data, need, self._version, traceparent)
            if self._out:
                self._out.append(data)
                self._out_len += len(data)
                return True
            try:
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                # Broken: the I/O thread sees it too and reconnects; this call answers by policy.
                return False
            if n < len(data):
                self._out.append(data[n:])
                self._out_len += len(data) - n
                wake = True
            else:
                wake = False
        if wake:
            self._wake()
        return True

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    # --- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core  # this thread's: a forked child starts another thread with another core
        backoff = Backoff(self._config)
        while not self._stop.is_set():
            conn = self._handshake(core)
            if conn is not None:
                sock, leftover, version, path = conn
                up_since = time.monotonic()
                with self._lock:
                    self._sock = sock
                    self._version = version
                core.connected(path)
                self._ready.set()
                try:
                    why = self._serve(core, sock, leftover, version)
                except Exception as e:  # noqa: BLE001 - never let the I/O thread die; reconnect instead
                    why = f"connection lost: {e}"
                core.lost(why)
                with self._lock:
                    self._sock = None
                    self._out = []
                    self._out_len = 0
                try:
                    sock.close()
                except OSError:
                    pass
                self._fail_pending()
                backoff.lasted(time.monotonic() - up_since)
            self._ready.set()
            if self._stop.is_set():
                break
            self._stop.wait(backoff.next_delay())
        self._fail_pending()
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def _handshake(self, core: Core) -> Optional[Tuple[socket.socket, bytearray, int, str]]:
        """One connection attempt and its Hello: the socket, what was read past the HelloOk, the
        version chosen and the address; None (and the failure recorded) when it fails. On version
        2 the first ask for the fail-mode list is sent before any check can be."""
        timeout = self._config.connect_timeout
        deadline = time.monotonic() + timeout
        sock: Optional[socket.socket] = None
        path = core.next_address()
        try:
            tcp = p.tcp_address(path)  # ValueError: a bad tcp:// address in $FLOODGATE_SOCKET
            if tcp is not None:
                sock = socket.create_connection(tcp, timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(path)
            sock.sendall(p.HELLO_FRAME)
            buf = bytearray()
            version = None
            while version is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("Hello timed out")
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("the agent closed the connection during Hello")
                buf += chunk
                version = core.hello(buf)
            ask = core.fail_modes_ask(version)
            if ask is not None:
                sock.sendall(ask)
            sock.setblocking(False)
            return sock, buf, version, path
        except (OSError, HandshakeError, ValueError) as e:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
            core.failed(path, e)
            return None

    def _serve(self, core: Core, sock: socket.socket, buf: bytearray, version: int) -> str:
        """Serves the connection until it ends; returns why it ended. On version 2 it asks for the
        fail-mode list again every ``fail_modes.REFRESH_EVERY`` seconds."""
        sel = selectors.DefaultSelector()
        wake = _Waiter.wake
        next_ask = time.monotonic() + fm.REFRESH_EVERY if version >= FAIL_MODES else None
        try:
            sel.register(sock, selectors.EVENT_READ, "sock")
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            writing = False
            broken = core.dispatch(buf, wake) if buf else None
            if broken is not None:
                return broken
            while not self._stop.is_set():
                with self._lock:
                    want_write = bool(self._out)
                if want_write != writing:
                    sel.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0), "sock")
                    writing = want_write
                wait = None if next_ask is None else max(next_ask - time.monotonic(), 0.0)
                ready = sel.select(wait)
                if next_ask is not None and time.monotonic() >= next_ask:
                    # Queued behind callers' checks when the socket is full; dropped (asked again
                    # next time) when the queue is over its cap.
                    ask = core.fail_modes_ask(version)
                    if ask is not None:
                        self._send(ask)
                    next_ask = time.monotonic() + fm.REFRESH_EVERY
                for key, events in ready:
                    if key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, InterruptedError):
                            pass
                        continue
                    if events & selectors.EVENT_WRITE:
                        if not self._flush(sock):
                            return "connection lost while writing"
                    if events & selectors.EVENT_READ:
                        try:
                            chunk = sock.recv(65536)
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError as e:
                            return f"connection lost: {describe(e, self._config.connect_timeout)}"
                        if not chunk:
                            return "the agent closed the connection"
                        buf += chunk
                        broken = core.dispatch(buf, wake)
                        if broken is not None:
                            return broken
            return "client closed"
        finally:
            sel.close()

    def _flush(self, sock: socket.socket) -> bool:
        with self._lock:
            if not self._out:
                return True
            data = b"".join(self._out)
            try:
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                return False
            rest = data[n:]
            self._out = [rest] if rest else []
            self._out_len = len(rest)
        return True

    def _fail_pending(self) -> None:
        for w in self._core.drain():
            w.wake(UNAVAILABLE)
