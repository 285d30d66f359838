"""Rules files the tests give their agents, and the figures they imply."""

from __future__ import annotations

import time

# An hour-long window: a test (a few seconds) straddles a window edge once in ~1,000 runs, which
# could shift a `remaining` by the previous window's weight.
WINDOW_S = 3600

CLIENT_RULES = f"""
# Rules named by items checks match an endpoint no attribute check in these tests sends.
[[rules]]
id = "r"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 3
windowSeconds = {WINDOW_S}

[[rules]]
id = "tight"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 1
windowSeconds = {WINDOW_S}

[[rules]]
id = "burst"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 500
windowSeconds = {WINDOW_S}

# A bucket of 2, refilled at 10 per 600 s: one token per 60 s.
[[rules]]
id = "tb"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 10
windowSeconds = 600
burst = 2
algorithm = "token_bucket"

[[rules]]
id = "search"
dimension = "user"
match = {{ endpoint = "/search" }}
limit = 2
windowSeconds = {WINDOW_S}

# Would reject after one request, if it were enforced.
[[rules]]
id = "dry"
dimension = "ip"
match = {{ endpoint = "/dry" }}
limit = 1
windowSeconds = {WINDOW_S}
mode = "log"
"""

# A login rule that fails closed (the agent lists it to the SDKs) and an API rule that fails open:
# what a client answers for each once the agent is killed.
FAIL_MODE_RULES = f"""
[[rules]]
id = "login-closed"
dimension = "ip"
match = {{ endpoint = "/login" }}
limit = 5
windowSeconds = {WINDOW_S}
failMode = "closed"

[[rules]]
id = "api-open"
dimension = "ip"
match = {{ endpoint = "/api/*" }}
limit = 100
windowSeconds = {WINDOW_S}
"""


def now_ms() -> int:
    return int(time.time() * 1000)


def window_reset_ms(at_ms: int, window_s: int = WINDOW_S) -> int:
    """A sliding window's reset once the current window holds anything: the end of the window after
    the current one (PROTOCOL.md, Decision)."""
    w = window_s * 1000
    return (at_ms // w + 2) * w

# Item modes. A bucket of 5 refilled at 5 per minute (one unit per 12 s): its figures move only 12 s
# after a test's consume, where a one-minute sliding window's move when a test straddles a minute
# boundary. The sliding window therefore gets the hour-long window, as above.
MODE_RULES = f"""
[[rules]]
id = "tb-5-per-min"
dimension = "user"
match = {{ endpoint = "/modes-tb" }}
limit = 5
windowSeconds = 60
algorithm = "token_bucket"

[[rules]]
id = "sw-5"
dimension = "user"
match = {{ endpoint = "/modes-sw" }}
limit = 5
windowSeconds = {WINDOW_S}
"""

# Concurrency (protocol version 3): two units in flight per key, each lease lasting 30 s unless
# released (longer than any test waits for a release, so a release that never came fails the test),
# and a sliding window to acquire from, which holds no lease.
LEASE_SECONDS = 30
LEASE_RULES = f"""
[[rules]]
id = "slots"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 2
algorithm = "concurrency"
leaseSeconds = {LEASE_SECONDS}

[[rules]]
id = "r"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 3
windowSeconds = {WINDOW_S}
"""

# Reservations (protocol version 6): 1,000 output tokens per 60 s whose reservations are charged
# when they expire, the same whose expired reservations are given back, and two requests in flight
# (a concurrency rule reserves units in flight). A reservation lasts 30 s uncommitted: longer than
# any test runs, so one that expired never explains a figure.
RESERVATION_WINDOW_S = 60
RESERVATION_RULES = f"""
[[rules]]
id = "output-tokens"
dimension = "api_key"
match = {{ endpoint = "/items-only" }}
limit = 1000
windowSeconds = {RESERVATION_WINDOW_S}
reservationSeconds = 30
reservationExpiry = "charge"

[[rules]]
id = "tokens-released"
dimension = "api_key"
match = {{ endpoint = "/items-only" }}
limit = 1000
windowSeconds = {RESERVATION_WINDOW_S}
reservationSeconds = 30
reservationExpiry = "release"

[[rules]]
id = "in-flight"
dimension = "api_key"
match = {{ endpoint = "/items-only" }}
limit = 2
algorithm = "concurrency"
leaseSeconds = 30
reservationSeconds = 30
"""


def clear_of_window_edge(window_s: int, margin_s: float = 5.0) -> None:
    """Waits, when fewer than ``margin_s`` seconds are left in the current window (windows start at
    multiples of ``window_s`` in Unix time), until the next one starts: a sliding window's figures
    move when a test straddles an edge (the previous window's count is weighted by what is left of
    it, and a commit gives back to the window its reserve was counted in). 5 s: a test's figures
    take a few round trips, well under a second even on a loaded 2-core machine; the wait costs
    0.2 s a test on average (a 5-in-60 chance of waiting 2.5 s on average)."""
    left = window_s - time.time() % window_s
    if left < margin_s:
        time.sleep(left + 0.05)


# Quota mode (protocol version 6): past its limit of 1 a request passes flagged over quota, counted
# nowhere on the rule (every endpoint: the middleware tests send theirs); and a rule of 2 that
# enforces, for checks naming both (items only, as above).
QUOTA_RULES = f"""
[[rules]]
id = "premium"
dimension = "user"
limit = 1
windowSeconds = {WINDOW_S}
overLimit = "flag"

[[rules]]
id = "strict"
dimension = "user"
match = {{ endpoint = "/items-only" }}
limit = 2
windowSeconds = {WINDOW_S}
"""
