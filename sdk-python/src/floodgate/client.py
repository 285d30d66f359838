"""The synchronous client, for WSGI apps and threads: thread-safe, one connection per process.

A background thread owns the socket: it connects and says Hello, reads answers and wakes the
calling thread by request id, writes what callers could not write at once, asks a version-2 agent
for its fail-mode list every 10 s, and reconnects with backoff and jitter. Callers write their own checks when the socket takes them (the common case),
so a call costs one ``send`` and one wake-up. Like the asyncio client, every call returns within
its timeout, answering by its fail policy when the agent cannot.

Example::

    client = Client()  # $FLOODGATE_SOCKET, else the agent's default socket: see default_socket_path
    d = client.allow("user:123", "api-per-user")
    if client.peek("user:123", "llm-tokens").allowed:  # not yet out of tokens
        ...  # call the model; then take what it used, even past the limit:
        client.charge("user:123", "llm-tokens", used)
    with client.hold("apikey:abc", "gpu-slots") as d:  # a concurrency rule: one unit in flight
        if d.allowed:
            ...  # the unit is given back when the block ends
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import selectors
import socket
import threading
import time
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from . import fail_modes as fm
from . import protocol as p
from ._policy import TIMEOUT, UNAVAILABLE, Policy, Subject
from .decision import ClientConfig, ClientStats, Decision, Degraded, FailPolicy
from .errors import UnsupportedByAgent
from .health import Health, Reachability, describe
from .lease import Lease, held, new_lease_id, precaution_not_sent, release_failed, release_frame, release_taken
from .socket_path import default_socket_path

_MAX_OUT = 1 << 20
_CONSUME = p.ItemMode.CONSUME
_PEEK = p.ItemMode.PEEK
_CHARGE = p.ItemMode.CHARGE
_RELEASE = p.ItemMode.RELEASE
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

    Every check call (``allow``, ``peek``, ``charge``, ``acquire``, ``release``, ``hold``, ``check``,
    ``check_attributes``, ``check_request``) takes ``traceparent=``: the W3C ``traceparent`` header
    of the request being served (``00-<trace id>-<span id>-<flags>``). To an agent speaking protocol
    version 5 the check then carries that trace context, so that the agent's span of the check (an
    agent exporting traces, ``--otlp-endpoint``) is a child of the caller's span; an older agent is
    sent the check without it. A value that does not parse is ignored: it never fails a check. It
    never changes the decision.
    """

    def __init__(self, path: Optional[str] = None, config: Optional[ClientConfig] = None, **overrides: Any):
        config = config or ClientConfig()
        if overrides:
            config = ClientConfig(**{**config.__dict__, **overrides})
        self._given = None if path is None else str(path)
        if self._given is not None:
            p.tcp_address(self._given)  # a bad tcp:// address given here is the caller's mistake: raise now
        # The agent's address in use, or tried last (public: it is what health() reports).
        self.path = self._given if self._given is not None else default_socket_path()
        self._config = config
        self._core = Policy(config)
        self._reach = Reachability(self.path, config.fail.value)
        self._forked = False
        self._closed = False
        self._init_state()
        _clients.add(self)
        self._start()

    def _init_state(self) -> None:
        self._lock = threading.Lock()  # guards _sock and _out
        self._pending: Dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
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
            # The parent's fail-mode list is the last one known: kept, as across a disconnection.
            self._core = Policy(self._config, self._core.fail_modes)
            self._reach = Reachability(self.path, self._config.fail.value)
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

    def is_connected(self) -> bool:
        """Whether the client holds a live connection to the agent right now."""
        return self._sock is not None

    @property
    def protocol_version(self) -> Optional[int]:
        """The protocol version the connection's handshake chose (1 to 5), ``None`` while there is
        no connection."""
        return self._version if self._sock is not None else None

    def stats(self) -> ClientStats:
        """Counts of degraded answers and connections, for the service's metrics."""
        return self._core.snapshot()

    def health(self) -> Health:
        """Whether the agent is reachable, where, why not, and how many calls the fail policy
        answered, and the fail-closed rules it knows: for a service's health endpoint (an
        unreachable agent otherwise shows only as requests passing without rate-limit headers)."""
        s = self._core.snapshot()
        return self._reach.health(self.is_connected(), s.unavailable + s.timeouts, self._core.fail_modes)

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
        rid = self._next_id()
        data = p.check_one_frame(rid, key, rule_id, cost)
        return self._call(rid, data, timeout, fail, ((key, rule_id, cost),), 1, traceparent)

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
        rid = self._next_id()
        data = p.check_one_frame(rid, key, rule_id, cost, _PEEK)
        return self._call(rid, data, timeout, fail, (p.Item(key, rule_id, cost, _PEEK),), 2, traceparent)

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
        rid = self._next_id()
        data = p.check_one_frame(rid, key, rule_id, cost, _CHARGE)
        return self._call(rid, data, timeout, fail, (p.Item(key, rule_id, cost, _CHARGE),), 2, traceparent)

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
        rid = self._next_id()
        data = p.check_one_frame(rid, key, rule_id, cost, _CONSUME, lease)
        d = self._call(rid, data, timeout, fail, (p.Item.acquire(key, rule_id, cost, lease),), 3, traceparent)
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
        rid = self._next_id()
        item = p.Item.release(lease.key, lease.rule_id, lease.cost, lease.id)
        data = p.check_one_frame(rid, item.key, item.rule_id, item.cost, _RELEASE, item.lease)
        return self._call(rid, data, timeout, fail, (item,), 3, traceparent)

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
        items = list(items)
        rid = self._next_id()
        data = p.check_items_frame(rid, items)
        return self._call(rid, data, timeout, fail, items, p.check_version(data), traceparent)

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
        rid = self._next_id()
        data = p.check_attributes_frame(rid, attributes)
        return self._call(rid, data, timeout, fail, attributes, p.check_version(data), traceparent)

    def _release_unanswered(self, release: Union[p.Attributes, p.Item], traceparent: Optional[str] = None) -> None:
        """Sends ``release`` (mode release, with the lease of a check the agent did not answer: it
        timed out, or the connection went) on the connection at hand, without waiting for its
        answer (dropped when it comes, as a late answer is). Never raises: one that cannot be sent
        (no connection, an agent older than version 3) is logged at debug, since the agent may
        never have taken the lease."""
        try:
            trace = None if traceparent is None else p.TraceContext.parse(traceparent)
            sent = self._send(release_frame(self._next_id(), release), 3, trace)
        except Exception as e:  # noqa: BLE001 - a precaution: it never fails the caller
            precaution_not_sent(release.lease, e)
            return
        if not sent:
            precaution_not_sent(release.lease, "no connection to the agent")

    def _next_id(self) -> int:
        while True:
            rid = next(self._ids) & 0xFFFF_FFFF
            if rid != 0 and rid not in self._pending:
                return rid

    def _call(
        self,
        rid: int,
        data: bytes,
        timeout: Optional[float],
        fail: Union[FailPolicy, str, None],
        subject: Subject,
        need: int = 1,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Sends a check and waits for its answer. ``need``: the protocol version the connection
        must speak to be sent it (:func:`~floodgate.protocol.check_version`). ``traceparent``: the
        caller's trace context, added (form 4) only on a connection of version 5; one that does not
        parse is left out."""
        if self._forked:
            self._restart_after_fork()
        core = self._core
        policy = core.policy(fail)
        pending = self._pending
        if self._sock is None or len(pending) >= self._config.max_pending:
            return core.degraded(policy, Degraded.UNAVAILABLE, subject)
        w = _Waiter()
        pending[rid] = w
        core.note_in_flight(len(pending))
        try:
            sent = self._send(data, need, None if traceparent is None else p.TraceContext.parse(traceparent))
        except UnsupportedByAgent:
            pending.pop(rid, None)
            raise
        if not sent:
            pending.pop(rid, None)
            return core.degraded(policy, Degraded.UNAVAILABLE, subject)
        w.lock.acquire(True, max(self._config.timeout if timeout is None else timeout, 0.0))
        pending.pop(rid, None)
        reply = w.reply
        return core.result(TIMEOUT if reply is None else reply, policy, subject)

    def _send(self, data: bytes, need: int = 1, trace: Optional[p.TraceContext] = None) -> bool:
        """Writes a frame now if the socket takes it, else queues it for the I/O thread. False when
        there is no connection or the queue is full (an agent that stopped reading). Raises
        :class:`~floodgate.UnsupportedByAgent` when the connection's version is below ``need``, and
        wraps a check in ``trace`` (form 4) only when it is 5 or more: both checked under the lock,
        so against the very connection the frame goes to (a queued frame never outlives it)."""
        with self._lock:
            sock = self._sock
            if sock is None or self._out_len > _MAX_OUT:
                return False
            if need > self._version:
                raise UnsupportedByAgent(need, self._version, self.path)
            if trace is not None and self._version >= p.TRACE_CONTEXT:
                data = p.traced(data, trace)
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
        backoff: Optional[float] = None
        cfg = self._config
        while not self._stop.is_set():
            conn = self._handshake()
            if conn is not None:
                sock, leftover, version = conn
                up_since = time.monotonic()
                with self._lock:
                    self._sock = sock
                    self._version = version
                self._core.connected()
                self._reach.connected(self.path)
                self._ready.set()
                try:
                    why = self._serve(sock, leftover, version)
                except Exception as e:  # noqa: BLE001 - never let the I/O thread die; reconnect instead
                    why = f"connection lost: {e}"
                self._reach.lost(why)
                with self._lock:
                    self._sock = None
                    self._out = []
                    self._out_len = 0
                try:
                    sock.close()
                except OSError:
                    pass
                self._fail_pending()
                if time.monotonic() - up_since >= 1.0:
                    backoff = None
            self._ready.set()
            if self._stop.is_set():
                break
            delay = cfg.reconnect_min if backoff is None else min(backoff * 2, cfg.reconnect_max)
            backoff = delay
            self._stop.wait(delay * random.uniform(0.5, 1.0))
        self._fail_pending()
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def _handshake(self) -> Optional[Tuple[socket.socket, bytearray, int]]:
        """One connection attempt and its Hello: the socket, what was read past the HelloOk and the
        version chosen; None (and the failure recorded) when it fails. On version 2 the first ask
        for the fail-mode list is sent before any check can be."""
        deadline = time.monotonic() + self._config.connect_timeout
        sock: Optional[socket.socket] = None
        # Looked up on every attempt: an agent started after this process is found where it is.
        path = self._given if self._given is not None else default_socket_path()
        self.path = path
        try:
            try:
                tcp = p.tcp_address(path)
            except ValueError as e:  # a bad tcp:// address in $FLOODGATE_SOCKET
                raise OSError(str(e)) from None
            if tcp is not None:
                sock = socket.create_connection(tcp, timeout=self._config.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._config.connect_timeout)
                sock.connect(path)
            sock.sendall(p.HELLO_FRAME)
            buf = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("Hello timed out")
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("the agent closed the connection during Hello")
                buf += chunk
                status, value, used = p.decode_reply(buf, 0)
                if status == 0:
                    continue
                if status == 1:
                    _, body = value  # type: ignore[misc]
                    if isinstance(body, p.HelloOk) and p.MIN_VERSION <= body.version <= p.VERSION:
                        del buf[:used]
                        if body.version >= 2:
                            sock.sendall(p.fail_modes_frame(self._next_id()))
                        sock.setblocking(False)
                        return sock, buf, body.version
                    if isinstance(body, p.HelloOk):
                        raise OSError(f"agent chose version {body.version}; this SDK speaks {p.MIN_VERSION} to {p.VERSION}")
                    if isinstance(body, p.ErrorBody):
                        raise OSError(f"agent refused Hello: {int(body.code)}: {body.message}")
                raise OSError("unexpected answer to Hello (not a Floodgate agent?)")
        except OSError as e:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
            self._reach.failed(path, describe(e, self._config.connect_timeout))
            return None

    def _serve(self, sock: socket.socket, buf: bytearray, version: int) -> str:
        """Serves the connection until it ends; returns why it ended. On version 2 it asks for the
        fail-mode list again every ``fail_modes.REFRESH_EVERY`` seconds."""
        sel = selectors.DefaultSelector()
        broken = "the agent sent a broken frame"
        next_ask = time.monotonic() + fm.REFRESH_EVERY if version >= 2 else None
        try:
            sel.register(sock, selectors.EVENT_READ, "sock")
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            writing = False
            if buf and not self._dispatch(buf):
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
                    self._send(p.fail_modes_frame(self._next_id()))
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
                        if not self._dispatch(buf):
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

    def _dispatch(self, buf: bytearray) -> bool:
        """Wakes the calls answered in ``buf`` and drops what was used; False when the stream broke."""
        pos = 0
        pending = self._pending
        decode = p.decode_reply
        try:
            while True:
                status, value, used = decode(buf, pos)
                if status == 0:
                    return True
                if status == 3:
                    return False
                pos += used
                if status == 1:
                    rid, body = value  # type: ignore[misc]
                    if isinstance(body, (p.DecisionBody, p.ErrorBody)):
                        w = pending.pop(rid, None)
                        if w is not None:
                            w.wake(body)
                    elif isinstance(body, p.FailModeList):
                        self._core.learn(body)
                else:
                    w = pending.pop(value, None)
                    if w is not None:
                        w.wake(UNAVAILABLE)
        finally:
            if pos:
                del buf[:pos]

    def _fail_pending(self) -> None:
        # Emptied in place: a caller that registered its waiter just now is in this same dict.
        pending = self._pending
        for rid in list(pending):
            w = pending.pop(rid, None)
            if w is not None:
                w.wake(UNAVAILABLE)
