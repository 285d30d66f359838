"""Where a client looks for the agent when it is given no path: the same places, in the same order,
as the agent's own default and every other Floodgate SDK."""

from __future__ import annotations

import os

DEFAULT_SOCKET = "/run/floodgate/floodgate.sock"
"""The agent's default socket: under ``/run`` (root-owned), never in world-writable ``/tmp``, where
any local user could bind the path first and answer "allowed" to every check."""

SOCKET_ENV = "FLOODGATE_SOCKET"
"""The environment variable that names the agent's socket (or ``tcp://host:port``)."""


def default_socket_path() -> str:
    """The agent's socket for a client given no path, looked up again on every connection attempt
    (so an agent started after the app is still found):

    1. ``$FLOODGATE_SOCKET``, if set and not empty;
    2. else ``/run/floodgate/floodgate.sock`` if it exists (a system agent);
    3. else ``$XDG_RUNTIME_DIR/floodgate/floodgate.sock`` if ``XDG_RUNTIME_DIR`` is an absolute
       path and that file exists (an agent run by the user);
    4. else ``/run/floodgate/floodgate.sock``: the path errors and logs name.
    """
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    if os.path.exists(DEFAULT_SOCKET):
        return DEFAULT_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    # A relative XDG_RUNTIME_DIR is invalid per the XDG spec (and would depend on the app's cwd).
    if runtime and os.path.isabs(runtime):
        user = os.path.join(runtime, "floodgate", "floodgate.sock")
        if os.path.exists(user):
            return user
    return DEFAULT_SOCKET
