"""Errors a call can raise: only what no fail policy can answer for the caller.

Trouble with the agent (away, late, overloaded, sending garbage) never raises: calls answer by
their fail policy instead.
"""

from __future__ import annotations

from typing import SupportsInt


class FloodgateError(Exception):
    """Base class of the SDK's errors."""


class InvalidCheck(FloodgateError, ValueError):
    """The check breaks a protocol limit (empty or over-long key, a brace or control character,
    cost 0 outside a peek or a commit, a bad rule id, an unknown item mode, a reserve or a commit
    without its reservation id, no items or more than 16), or a commit's figures do not match its
    reservation's meters. Raised before anything is sent."""


class UnsupportedByAgent(InvalidCheck):
    """The check needs a newer protocol version than the connected agent speaks: an item that peeks
    or charges needs version 2 (an agent whose HelloOk said 1 cannot parse such a check: it would
    close the connection), a lease or a release needs version 3, a reserve or a commit version 6.
    Raised before anything is sent; a check the agent cannot answer for other reasons (away, late)
    answers by its fail policy instead, as any check does."""

    def __init__(self, needed: int, agent_version: int, path: str) -> None:
        # 6 is protocol.RESERVATIONS and 3 is _core.LEASES, written out: both modules import this one.
        if needed >= 6:
            message = (
                f"the agent at {path} speaks protocol version {agent_version}: it cannot hold"
                " reservations (update the agent)"
            )
        elif needed >= 3:
            message = (
                f"the agent at {path} speaks protocol version {agent_version}: it cannot hold leases"
                " (update the agent)"
            )
        else:
            message = (
                f"peek and charge items need protocol version {needed}, and the agent at {path} speaks"
                f" version {agent_version}: upgrade the agent, or consume instead"
            )
        super().__init__(message)
        self.needed = needed
        self.agent_version = agent_version


class AgentError(FloodgateError):
    """The agent refused the check: an unknown rule (code 4) or an invalid item (code 5, e.g. the
    same ``(key, rule)`` twice, or more than 16 rules matched)."""

    def __init__(self, code: SupportsInt, message: str) -> None:
        super().__init__(f"agent refused the check ({int(code)}): {message}")
        self.code = int(code)
        self.message = message
