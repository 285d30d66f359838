"""The asyncio client: one multiplexed Unix-socket connection per event loop, many checks in flight.

A transport over the sans-I/O core (:mod:`floodgate._core`), which builds the requests, matches the
answers, judges the Hello and answers by the fail policy; this module connects, writes, and waits
with futures and timers.

Every call returns within its timeout (10 ms by default), whatever the agent does: when the agent
is unreachable, late or confused the call answers by its fail policy (open by default, closed per
client or per call, or the agent's fail-closed rules) and the client reconnects in the background
with backoff and jitter. Only a
check the caller got wrong raises (:class:`~floodgate.InvalidCheck` before sending, among them
:class:`~floodgate.UnsupportedByAgent` for a peek or charge to a version-1 agent;
:class:`~floodgate.AgentError` for an unknown rule).

Example::

    client = await AsyncClient.connect()  # $FLOODGATE_SOCKET, else the agent's default socket
    d = await client.allow("user:123", "api-per-user")
    if not d.allowed:
        ...  # 429, Retry-After: ceil(d.retry_after_ms / 1000)
    async with client.hold("apikey:abc", "gpu-slots") as d:  # a concurrency rule: one unit in flight
        if d.allowed:
            ...  # the unit is given back when the block ends
    d, r = await client.reserve("apikey:abc", "output-tokens", 4096)  # the request's max_tokens
    if r is not None:
        ...  # call the model; then settle at what it used, the rest given back:
        await client.commit(r, [used])
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any, AsyncIterator, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import fail_modes as fm
from . import protocol as p
from ._core import FAIL_MODES, MAX_UNSENT, Backoff, Core, HandshakeError, Request, configure
from ._policy import TIMEOUT, UNAVAILABLE
from .decision import ClientConfig, ClientStats, Decision, Degraded, FailPolicy
from .health import Health
from .lease import Lease, held, new_lease_id, precaution_not_sent, release_failed, release_taken
from .reservation import Meter, MeterLike, Reservation, commit_not_sent, meters_of
from .reservation import held as reservation_held

_Mode = Union[p.ItemMode, int, str]
"""An item mode: an :class:`~floodgate.ItemMode`, its value or its lower-case name."""


def _settle(fut: asyncio.Future, reply: object) -> None:
    """Wakes a waiting call with ``reply``, unless its timeout woke it first."""
    if not fut.done():
        fut.set_result(reply)


class _Conn(asyncio.Protocol):
    """One connection: feeds what the agent sends to the client's core, which wakes the waiting
    calls."""

    def __init__(self, core: Core, loop: asyncio.AbstractEventLoop, lost: Callable[[_Conn], None]) -> None:
        self.core = core
        self.on_lost = lost
        self.buf = bytearray()
        self.transport: Optional[asyncio.Transport] = None
        self.hello: asyncio.Future = loop.create_future()
        self.lost: asyncio.Future = loop.create_future()
        self.why: Optional[str] = None  # why the connection ended, for the client's health()
        self.version = 1  # the version the agent's HelloOk chose

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.hello.done():
            try:
                version = self.core.hello(buf)
            except HandshakeError as e:
                self._broken(str(e))
                return
            if version is None:
                return
            self.version = version
            self.hello.set_result(None)
        broken = self.core.dispatch(buf, _settle)
        if broken is not None:
            self._broken(broken)

    def _broken(self, why: str) -> None:
        self.why = why
        if not self.hello.done():
            self.hello.set_exception(HandshakeError(why))
        self.buf.clear()
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.why is None and exc is not None:
            self.why = f"connection lost: {exc}"
        if not self.hello.done():
            self.hello.set_exception(HandshakeError("the agent closed the connection during Hello"))
        if not self.lost.done():
            self.lost.set_result(None)
        self.on_lost(self)


class AsyncClient:
    """A client of the local agent for asyncio code. Use one per process (per event loop); it holds
    one connection on which every call is multiplexed by request id. ``path`` is the agent's Unix
    socket, or ``tcp://host:port`` for an agent's ``--listen-tcp``, used as given; without it the
    client looks the socket up with :func:`~floodgate.default_socket_path` (``$FLOODGATE_SOCKET``
    first) on every connection attempt.

    ``AsyncClient(path)`` returns at once; the connection is made on first use (or by
    :meth:`start`), and remade in the background whenever it breaks. :meth:`connect` creates one and
    waits up to ``connect_timeout`` for the first connection, so the first calls reach the agent.
    Keyword arguments override fields of :class:`~floodgate.ClientConfig`.

    Every check call (``allow``, ``peek``, ``charge``, ``acquire``, ``release``, ``hold``,
    ``reserve``, ``reserve_meters``, ``commit``, ``check``, ``check_attributes``,
    ``check_request``) takes ``traceparent=``: the W3C ``traceparent`` header
    of the request being served (``00-<trace id>-<span id>-<flags>``). To an agent speaking protocol
    version 5 the check then carries that trace context, so that the agent's span of the check (an
    agent exporting traces, ``--otlp-endpoint``) is a child of the caller's span; an older agent is
    sent the check without it. A value that does not parse is ignored: it never fails a check. It
    never changes the decision.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        config: Optional[ClientConfig] = None,
        **overrides: Any,
    ) -> None:
        self._config = configure(config, overrides)
        self._core = Core(path, self._config)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._conn: Optional[_Conn] = None
        self._ready: Optional[asyncio.Event] = None
        self._out: List[bytes] = []
        self._deadlines: Dict[float, _Deadlines] = {}
        self._flush_scheduled = False
        self._closed = False

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls, path: Optional[str] = None, config: Optional[ClientConfig] = None, **overrides: Any
    ) -> "AsyncClient":
        """A started client: waits up to ``connect_timeout`` for the first connection (it is not an
        error if the agent is not there: calls then answer by the fail policy)."""
        client = cls(path, config, **overrides)
        await client.start()
        return client

    async def start(self) -> None:
        """Starts the background connection task if needed and waits up to ``connect_timeout`` for
        its first attempt."""
        self._ensure_started()
        assert self._ready is not None
        try:
            await asyncio.wait_for(self._ready.wait(), self._config.connect_timeout)
        except asyncio.TimeoutError:
            pass

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            if self._closed:
                raise RuntimeError("this AsyncClient is closed")
            self._loop = loop
            self._ready = asyncio.Event()
            self._task = loop.create_task(self._run())
        elif self._loop is not loop:
            raise RuntimeError("an AsyncClient belongs to the event loop it started on; make one per loop")
        return loop

    async def close(self) -> None:
        """Stops reconnecting and closes the connection; calls in flight answer by their policy."""
        self._closed = True
        if self._ready is not None:
            self._ready.set()
        task, self._task = self._task, None
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.abort()
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_pending()

    async def __aenter__(self) -> "AsyncClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def config(self) -> ClientConfig:
        return self._config

    @property
    def path(self) -> str:
        """The agent's address in use, or tried last (what :meth:`health` reports)."""
        return self._core.path

    def is_connected(self) -> bool:
        """Whether the client holds a live connection to the agent right now."""
        c = self._conn
        return c is not None and c.transport is not None and not c.transport.is_closing()

    @property
    def protocol_version(self) -> Optional[int]:
        """The protocol version the connection's handshake chose (1 to 6), ``None`` while there is
        no connection."""
        c = self._conn
        return c.version if self.is_connected() and c is not None else None

    def stats(self) -> ClientStats:
        """Counts of degraded answers and connections, for the service's metrics."""
        return self._core.policy.snapshot()

    def health(self) -> Health:
        """Whether the agent is reachable, where, why not, and how many calls the fail policy
        answered, and the fail-closed rules it knows: for a service's health endpoint (an
        unreachable agent otherwise shows only as requests passing without rate-limit headers)."""
        return self._core.health(self.is_connected())

    # --- calls -------------------------------------------------------------------------------

    async def allow(
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
        return await self._call(self._core.allow(key, rule_id, cost), timeout, fail, traceparent)

    async def peek(
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
        return await self._call(self._core.peek(key, rule_id, cost), timeout, fail, traceparent)

    async def charge(
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
        return await self._call(self._core.charge(key, rule_id, cost), timeout, fail, traceparent)

    async def acquire(
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
        waiting for an answer; so it is when the call is cancelled while it waits."""
        lease = new_lease_id()
        try:
            d = await self._call(self._core.acquire(key, rule_id, cost, lease), timeout, fail, traceparent)
        except asyncio.CancelledError:
            # The acquire may be on its way, or taken already: nobody would release it.
            self._release_unanswered(p.Item.release(key, rule_id, cost, lease), traceparent)
            raise
        if not d.from_agent:
            # Late or lost: the agent may still have taken the lease. Released at once, without
            # waiting for the answer (a release of a lease not held changes nothing).
            self._release_unanswered(p.Item.release(key, rule_id, cost, lease), traceparent)
        return d, held(d, key, rule_id, cost, lease)

    async def release(
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
        return await self._call(self._core.release(lease), timeout, fail, traceparent)

    @contextlib.asynccontextmanager
    async def hold(
        self,
        key: str,
        rule_id: str,
        cost: int = 1,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> AsyncIterator[Decision]:
        """``async with client.hold(key, rule_id) as d:`` :meth:`acquire`, the block (check
        ``d.allowed``), then :meth:`release` of the lease, if one was taken, however the block ends
        (an exception or a cancellation too). A release the agent cannot take, or that raises (an
        agent replaced by an older one meanwhile), is logged, not raised: the lease runs out by
        itself."""
        d, lease = await self.acquire(key, rule_id, cost, timeout=timeout, fail=fail, traceparent=traceparent)
        try:
            yield d
        finally:
            if lease is not None:
                try:
                    release_taken(await self.release(lease, timeout=timeout, traceparent=traceparent), lease.id)
                except Exception as e:  # noqa: BLE001 - the block's own outcome is the one to keep
                    release_failed(e, lease.id)

    async def reserve(
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
        return await self.reserve_meters(
            [Meter(key, rule_id, units)], timeout=timeout, fail=fail, traceparent=traceparent
        )

    async def reserve_meters(
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
        waiting for an answer; so it is when the call is cancelled while it waits."""
        reservation = Reservation(new_lease_id(), meters_of(meters))
        try:
            d = await self._call(self._core.reserve(reservation), timeout, fail, traceparent)
        except asyncio.CancelledError:
            # The reserve may be on its way, or held already: nobody would commit it.
            self._commit_unanswered(reservation, traceparent)
            raise
        if not d.from_agent:
            # Late or lost: the agent may still hold it. Committed at 0 at once, without waiting
            # for the answer (a commit of a reservation not held gives nothing back and, under the
            # default reservationExpiry, charges nothing).
            self._commit_unanswered(reservation, traceparent)
        return d, reservation_held(d, reservation)

    async def commit(
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
        return await self._call(self._core.commit(reservation, used), timeout, fail, traceparent)

    async def check(
        self,
        items: Iterable[Union[p.Item, Tuple[str, str], Tuple[str, str, int], Tuple[str, str, int, _Mode]]],
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """Up to 16 items at once: allowed only if every enforced item is; a denial consumes
        nothing. Items are :class:`~floodgate.Item` or ``(key, rule_id[, cost[, mode]])`` tuples;
        peek and charge items (see :meth:`peek`, :meth:`charge`) need an agent speaking version 2."""
        return await self._call(self._core.check(list(items)), timeout, fail, traceparent)

    async def check_attributes(
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
        """Request attributes (``None`` = absent) for the agent to match against its rules; every
        matching rule is checked, all or nothing. ``mode`` is what every matched rule does with
        ``cost`` (peek and charge need version 2); ``lease`` (version 3) is the lease the matched
        concurrency rules hold ``cost`` under, or give back with ``mode="release"``
        (``decision.holds_lease`` says whether one now holds it)."""
        return await self.check_request(
            p.Attributes(endpoint, tier, user, api_key, ip, cost, p.item_mode(mode), lease),
            timeout=timeout,
            fail=fail,
            traceparent=traceparent,
        )

    async def check_request(
        self,
        attributes: p.Attributes,
        *,
        timeout: Optional[float] = None,
        fail: Union[FailPolicy, str, None] = None,
        traceparent: Optional[str] = None,
    ) -> Decision:
        """:meth:`check_attributes` with an :class:`~floodgate.Attributes`."""
        return await self._call(self._core.check_request(attributes), timeout, fail, traceparent)

    def _release_unanswered(self, release: Union[p.Attributes, p.Item], traceparent: Optional[str] = None) -> None:
        """Sends ``release`` (mode release, with the lease of a check the agent did not answer: it
        timed out, the connection went, or its caller was cancelled while waiting) on the connection
        at hand, after any check still queued for it, without waiting for its answer (dropped when
        it comes, as a late answer is). Never raises, never awaits: one that cannot be sent (no
        connection, an agent older than version 3) is logged at debug, since the agent may never
        have taken the lease. Called on the client's event loop."""
        data = self._core.unanswered_release(release, self._live_version(), traceparent)
        self._write_precaution(data, lambda why: precaution_not_sent(release.lease, why))

    def _commit_unanswered(self, reservation: Reservation, traceparent: Optional[str] = None) -> None:
        """Sends the commit at 0 of ``reservation`` (whose check the agent did not answer, or whose
        caller was cancelled while it waited) as :meth:`_release_unanswered` sends a release:
        without waiting, never raising, never awaiting."""
        data = self._core.unanswered_commit(reservation, self._live_version(), traceparent)
        self._write_precaution(data, lambda why: commit_not_sent(reservation.id, why))

    def _live_version(self) -> Optional[int]:
        """The live connection's protocol version, ``None`` without one."""
        conn = self._conn
        live = conn is not None and conn.transport is not None and not conn.transport.is_closing()
        return conn.version if live and conn is not None else None

    def _write_precaution(self, data: Optional[bytes], not_sent: Callable[[object], None]) -> None:
        """Writes a precautionary frame the core prepared for the live connection (``None``: it
        could not, and said why), behind any check queued for the next flush."""
        conn = self._conn
        transport = conn.transport if conn is not None else None
        if data is None or transport is None:
            return
        if transport.get_write_buffer_size() > MAX_UNSENT:
            not_sent("the agent is not reading")
            return
        if self._out:
            # Behind the checks queued for the next flush (the check it follows may be among them).
            self._out.append(data)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)
        else:
            transport.write(data)

    async def _call(
        self,
        req: Request,
        timeout: Optional[float],
        fail: Union[FailPolicy, str, None],
        traceparent: Optional[str],
    ) -> Decision:
        """Sends a request and waits for its answer. ``traceparent``: the caller's trace context,
        added (form 4) only on a connection of version 5; one that does not parse is left out."""
        rid, data, subject, need = req
        core = self._core
        policy = core.policy
        own = policy.policy(fail)
        loop = self._ensure_started()
        tmo = max(self._config.timeout if timeout is None else timeout, 0.0)
        conn = self._conn
        waited = None
        if conn is None and self._ready is not None and not self._ready.is_set():
            # A client used before its first connection attempt finished: wait for it, within the
            # call's timeout, so that the first calls of a lazily started client reach the agent.
            started = loop.time()
            try:
                await asyncio.wait_for(self._ready.wait(), tmo)
            except asyncio.TimeoutError:
                pass
            waited = loop.time() - started
            conn = self._conn
        pending = core.pending
        if (
            conn is None
            or conn.transport is None
            or conn.transport.is_closing()
            or len(pending) >= self._config.max_pending
            or conn.transport.get_write_buffer_size() > MAX_UNSENT
        ):
            return policy.degraded(own, Degraded.UNAVAILABLE, subject)
        data = core.prepare(data, need, conn.version, traceparent)
        fut = loop.create_future()
        if not pending and not self._out:
            # Nothing in flight: write now (a lone caller pays no extra loop iteration).
            conn.transport.write(data)
        else:
            # Others are in flight: coalesce the checks of this loop iteration into one write.
            self._out.append(data)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
        pending[rid] = fut
        policy.note_in_flight(len(pending))
        if waited is None:
            self._deadline(loop, tmo, fut)
        else:
            loop.call_later(max(tmo - waited, 0.0), _expire, fut)
        try:
            reply = await fut
        finally:
            pending.pop(rid, None)
        return policy.result(reply, own, subject)

    def _deadline(self, loop: asyncio.AbstractEventLoop, timeout: float, fut: asyncio.Future) -> None:
        """Wakes ``fut`` with TIMEOUT after ``timeout`` unless it is answered first.

        Calls with the same timeout expire in the order they started, so each timeout value keeps a
        FIFO of deadlines and one timer for its oldest: one append per call instead of a timer
        handle per call (a heap push and a cancel), which is most of a call's cost in asyncio."""
        q = self._deadlines.get(timeout)
        if q is None:
            if len(self._deadlines) >= 64:
                # Many distinct per-call timeouts: a timer each for the rest.
                loop.call_later(timeout, _expire, fut)
                return
            q = self._deadlines[timeout] = _Deadlines(loop, timeout)
        q.add(fut)

    def _flush(self) -> None:
        """Writes every check queued since the last flush in one write (one syscall for a burst)."""
        self._flush_scheduled = False
        out, self._out = self._out, []
        conn = self._conn
        if not out or conn is None or conn.transport is None or conn.transport.is_closing():
            return
        conn.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # --- the connection ----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self._core
        backoff = Backoff(self._config)
        assert self._ready is not None
        while not self._closed:
            conn = None
            path = core.next_address()
            try:
                conn = await asyncio.wait_for(self._handshake(loop, path), self._config.connect_timeout)
            except asyncio.CancelledError:
                raise
            except (OSError, asyncio.TimeoutError, HandshakeError, ValueError) as e:
                # ValueError: a bad tcp:// address in $FLOODGATE_SOCKET.
                conn = None
                if self._closed:
                    return
                core.failed(path, e)
            if conn is not None:
                up_since = time.monotonic()
                self._conn = conn
                core.connected(path)
                self._ready.set()
                await self._serve(conn)
                self._conn = None
                core.lost(conn.why or "the agent closed the connection")
                self._fail_pending()
                if self._closed:
                    return
                backoff.lasted(time.monotonic() - up_since)
            self._ready.set()
            await asyncio.sleep(backoff.next_delay())

    async def _serve(self, conn: _Conn) -> None:
        """Waits for the connection to end; on version 2, asks for the fail-mode list again every
        ``fail_modes.REFRESH_EVERY`` seconds meanwhile."""
        if conn.version < FAIL_MODES:
            await asyncio.shield(conn.lost)
            return
        while True:
            # asyncio.wait does not cancel conn.lost when this task is cancelled (close()).
            done, _ = await asyncio.wait({conn.lost}, timeout=fm.REFRESH_EVERY)
            if done:
                return
            t = conn.transport
            # An agent that stopped reading is asked again next time, not buffered for.
            if t is not None and not t.is_closing() and t.get_write_buffer_size() <= MAX_UNSENT:
                ask = self._core.fail_modes_ask(conn.version)
                if ask is not None:
                    t.write(ask)

    async def _handshake(self, loop: asyncio.AbstractEventLoop, path: str) -> _Conn:
        tcp = p.tcp_address(path)
        core = self._core
        if tcp is not None:
            # asyncio sets TCP_NODELAY on its TCP transports: a check is not held back for Nagle.
            transport, conn = await loop.create_connection(lambda: _Conn(core, loop, self._lost), *tcp)
        else:
            transport, conn = await loop.create_unix_connection(lambda: _Conn(core, loop, self._lost), path)
        try:
            transport.write(p.HELLO_FRAME)
            await conn.hello
            ask = core.fail_modes_ask(conn.version)
            if ask is not None:
                # Before any check can be written: the list arrives as soon as the agent can say it.
                transport.write(ask)
        except BaseException:
            transport.abort()
            raise
        return conn

    def _lost(self, conn: _Conn) -> None:
        if self._conn is conn:
            self._conn = None
            self._fail_pending()

    def _fail_pending(self) -> None:
        """Wakes every waiting call: the connection is gone, they answer by their policy."""
        self._out = []
        for fut in self._core.drain():
            _settle(fut, UNAVAILABLE)


class _Deadlines:
    """The waiting calls of one timeout value, oldest first, with one timer for the oldest."""

    __slots__ = ("loop", "timeout", "queue", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout
        self.queue: Deque[Tuple[float, asyncio.Future]] = collections.deque()
        self.timer: Optional[asyncio.TimerHandle] = None

    def add(self, fut: asyncio.Future) -> None:
        when = self.loop.time() + self.timeout
        self.queue.append((when, fut))
        if self.timer is None:
            self.timer = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.timer = None
        q = self.queue
        now = self.loop.time()
        while q:
            when, fut = q[0]
            if fut.done():
                q.popleft()
            elif when <= now:
                q.popleft()
                fut.set_result(TIMEOUT)
            else:
                self.timer = self.loop.call_at(when, self._fire)
                return


def _expire(fut: asyncio.Future) -> None:
    _settle(fut, TIMEOUT)
