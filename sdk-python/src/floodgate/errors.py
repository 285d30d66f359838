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
    cost 0, a bad rule id, no items or more than 16). Raised before anything is sent."""


class AgentError(FloodgateError):
    """The agent refused the check: an unknown rule (code 4) or an invalid item (code 5, e.g. the
    same ``(key, rule)`` twice, or more than 16 rules matched)."""

    def __init__(self, code: SupportsInt, message: str) -> None:
        super().__init__(f"agent refused the check ({int(code)}): {message}")
        self.code = int(code)
        self.message = message
