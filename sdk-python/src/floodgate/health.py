"""Whether a client reaches its agent: the :class:`Health` it reports, and the warnings it logs
(logger ``floodgate``) when connection attempts fail and when the agent is reachable again.

An unreachable agent is otherwise silent: every call answers by the fail policy (open: allowed, with
no headers), which looks exactly like a limiter with nothing to say.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .fail_modes import FailModeList

log = logging.getLogger("floodgate")

WARN_EVERY = 10.0
"""At most one "cannot reach the agent" warning per client in this many seconds: the client retries
every 10 ms to 1 s while the agent is away, so an outage would otherwise log up to 100 lines a
second per process."""


@dataclass
class Health:
    """A client's view of its agent, for a service's health or readiness endpoint."""

    connected: bool
    """Whether the client holds a live connection to the agent right now."""
    path: str
    """The agent's address in use, or tried last (a path given by no one is looked up again on each
    attempt: see :func:`~floodgate.default_socket_path`)."""
    last_error: Optional[str]
    """Why the last connection attempt failed or the last connection ended; ``None`` once connected."""
    failed_attempts: int
    """Connection attempts that failed since the last connection was made."""
    fail_policy_answers: int
    """Calls the SDK answered by itself (fail policy, a fail-closed rule, or fallback limit), not
    the agent, since the client started: the agent was unreachable, late, or could not answer."""
    fail_closed_rules: int = 0
    """Rules in the agent's last fail-mode list: checks touching them are denied while the agent
    cannot answer (0 before any list)."""
    rules_version: Optional[int] = None
    """The agent's rule set version that list came with (0 for a rules file); ``None`` until a
    version-2 agent sent one."""


def describe(error: BaseException, connect_timeout: float) -> str:
    """A connection attempt's error as the warning says it."""
    if isinstance(error, (asyncio.TimeoutError, socket.timeout, TimeoutError)):
        return f"no answer to Hello within {connect_timeout * 1000:g} ms"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror  # "No such file or directory", "Connection refused", "Permission denied"
    return str(error) or type(error).__name__


class Reachability:
    """The connection state behind :class:`Health`, and its log lines. Thread-safe: the threaded
    client's I/O thread writes it while callers read it."""

    def __init__(self, path: str, fail: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._fail = fail
        self._clock = clock
        self.path = path
        self.last_error: Optional[str] = None
        self.failed_attempts = 0
        self._last_warning: Optional[float] = None
        self._suppressed = 0
        # Whether this outage was logged: "reachable again" answers a warning someone may have seen,
        # and is not logged for an outage no line announced (its attempts are counted in the next).
        self._announced = False

    def failed(self, path: str, error: str) -> None:
        """A connection attempt to ``path`` failed."""
        with self._lock:
            self.path = path
            self.last_error = error
            self.failed_attempts += 1
            now = self._clock()
            if self._last_warning is not None and now - self._last_warning < WARN_EVERY:
                self._suppressed += 1
                return
            self._last_warning = now
            suppressed, self._suppressed = self._suppressed, 0
            self._announced = True
        more = f" ({suppressed} more failed attempts not logged since the last warning)" if suppressed else ""
        log.warning(
            "floodgate: cannot reach the agent at %s: %s; answering by fail policy %s%s",
            path, error, self._fail, more,
        )

    def connected(self, path: str) -> None:
        """A connection to ``path`` was made (its Hello answered)."""
        with self._lock:
            self.path = path
            self.last_error = None
            failed, self.failed_attempts = self.failed_attempts, 0
            announced, self._announced = self._announced, False
        if announced:
            # A warning, as the line it answers: the default logging config shows warnings only.
            log.warning("floodgate: agent reachable again at %s (after %d failed attempts)", path, failed)

    def lost(self, error: str) -> None:
        """The live connection ended. Not logged: the client reconnects at once, and only if that
        fails is there something to say."""
        with self._lock:
            self.last_error = error

    def health(self, connected: bool, fail_policy_answers: int, fail_modes: Optional[FailModeList]) -> Health:
        with self._lock:
            return Health(
                connected,
                self.path,
                self.last_error,
                self.failed_attempts,
                fail_policy_answers,
                0 if fail_modes is None else len(fail_modes.rules),
                None if fail_modes is None else fail_modes.rules_version,
            )
