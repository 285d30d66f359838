"""Floodgate's Python client: ask the local agent whether a request may pass.

One client per process holds one multiplexed Unix-socket connection to the agent: many checks are
in flight at once, each with its own request id. Every call returns within its timeout (10 ms by
default); when the agent is unreachable or late the call answers by its fail policy (open by
default, closed per client or per call) and the client reconnects in the background.

- :class:`AsyncClient`: asyncio (ASGI apps, FastAPI, Starlette).
- :class:`Client`: threads (WSGI apps, Django, scripts); thread-safe.
- :class:`Lease`: what ``acquire`` takes of a concurrency rule and ``release`` gives back (``hold``
  does both around a block).
- :class:`Reservation`: what ``reserve`` (one :class:`Meter`) or ``reserve_meters`` (several, all or
  nothing) holds before a request runs, settled by ``commit`` at what it used (protocol version 6).
- :mod:`floodgate.middleware`: ASGI, WSGI and Django middleware.
- :mod:`floodgate.protocol`: the wire format (``protocol/PROTOCOL.md``, versions 1 to 6).
- :func:`default_socket_path`: where a client given no path finds the agent (``$FLOODGATE_SOCKET``,
  else ``/run/floodgate/floodgate.sock``, else ``$XDG_RUNTIME_DIR/floodgate/floodgate.sock``).
- :class:`Health`: ``client.health()``, whether the agent is reachable. A failed connection attempt
  is logged as a warning on the ``floodgate`` logger (at most one per client every 10 s).

Example::

    from floodgate import AsyncClient

    client = await AsyncClient.connect()  # the agent's default socket, or $FLOODGATE_SOCKET
    d = await client.allow("user:123", "api-per-user", 1)
    if not d.allowed:
        ...  # 429; d.retry_after_ms is always set on a denial
"""

from .aio import AsyncClient
from .client import Client
from .decision import ClientConfig, ClientStats, Decision, Degraded, FailPolicy, LocalLimit, Origin
from .errors import AgentError, FloodgateError, InvalidCheck, UnsupportedByAgent
from .health import Health
from .lease import Lease
from .protocol import Attributes, Item, ItemDecision, ItemMode, Source, TraceContext, Verdict, wire_safe
from .reservation import Meter, Reservation
from .socket_path import DEFAULT_SOCKET, default_socket_path

__version__ = "0.6.0"

__all__ = [
    "AsyncClient",
    "Client",
    "ClientConfig",
    "ClientStats",
    "Decision",
    "Degraded",
    "FailPolicy",
    "Health",
    "Lease",
    "LocalLimit",
    "Meter",
    "Reservation",
    "Origin",
    "AgentError",
    "FloodgateError",
    "InvalidCheck",
    "UnsupportedByAgent",
    "Attributes",
    "Item",
    "ItemDecision",
    "ItemMode",
    "Source",
    "TraceContext",
    "Verdict",
    "wire_safe",
    "DEFAULT_SOCKET",
    "default_socket_path",
    "__version__",
]
