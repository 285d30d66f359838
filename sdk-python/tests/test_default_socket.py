"""Where a client given no path finds the agent ($FLOODGATE_SOCKET, /run/floodgate, then
$XDG_RUNTIME_DIR, looked up on every connection attempt), and how an unreachable agent shows: one
warning per client every 10 s on the ``floodgate`` logger, a line when it is back, and
``client.health()``. Both clients, against real agents."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import List

import pytest
from conftest import eventually, unique
from rules import CLIENT_RULES
from test_fake_agent import Either

from floodgate import DEFAULT_SOCKET, Degraded, Origin, default_socket_path
from floodgate.health import WARN_EVERY, Reachability
from floodgate.middleware import FloodgateWSGIMiddleware

# The machine's own agent, if it runs one, is where the resolver looks first after the variable.
SYSTEM_AGENT = os.path.exists(DEFAULT_SOCKET)


@pytest.fixture(params=["async", "sync"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the CI's or a developer's environment says must not decide these tests.
    monkeypatch.delenv("FLOODGATE_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


@pytest.fixture
def floodgate_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="floodgate")
    return caplog


def lines(caplog: pytest.LogCaptureFixture, text: str) -> List[str]:
    """The ``floodgate`` logger's warnings containing ``text``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "floodgate" and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def short_dir(prefix: str) -> str:
    # A Unix socket path is at most 107 bytes: tempfile's /tmp/fg-xxxx, not pytest's longer tmp_path.
    return tempfile.mkdtemp(prefix=prefix)


def test_a_client_given_no_path_uses_FLOODGATE_SOCKET(kind, make_agent, monkeypatch, floodgate_log) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES)
    monkeypatch.setenv("FLOODGATE_SOCKET", agent.socket)
    c = Either(kind, None, timeout=2.0)
    try:
        d = c.allow(unique("user"), "r")
        assert d.allowed and d.origin is Origin.AGENT and (d.limit, d.remaining) == (3, 2)
        h = c.health()
        assert (h.connected, h.path, h.last_error, h.failed_attempts, h.fail_policy_answers) == (
            True, agent.socket, None, 0, 0,
        )
        assert lines(floodgate_log, "") == [], "nothing to warn about"
    finally:
        c.close()
    # The middleware's own client (no socket= given) finds the same agent.
    mw = FloodgateWSGIMiddleware(lambda environ, start_response: [], timeout=2.0)
    try:
        assert mw.client.allow(unique("user"), "r").from_agent and mw.client.path == agent.socket
    finally:
        mw.client.close()


def test_an_unreachable_agent_is_logged_once_and_shown_by_health(kind, floodgate_log) -> None:  # noqa: ANN001
    path = os.path.join(short_dir("fg-none-"), "nobody.sock")
    started = time.monotonic()
    # Fast retries: several failed attempts within the test, all inside one 10 s warning period.
    c = Either(kind, path, reconnect_min=0.005, reconnect_max=0.02)
    try:
        eventually("three failed connection attempts", lambda: c.health().failed_attempts >= 3)
        ds = [c.allow(unique("user"), "r") for _ in range(5)]
        assert all(d.allowed and d.origin is Origin.FAIL_OPEN and d.degraded is Degraded.UNAVAILABLE for d in ds)
        closed = c.allow(unique("user"), "r", fail="closed")
        assert not closed.allowed and closed.origin is Origin.FAIL_CLOSED
        h = c.health()
        assert not h.connected and h.path == path
        assert h.failed_attempts >= 3 and h.fail_policy_answers == 6
        assert h.last_error == "No such file or directory"
        warned = lines(floodgate_log, "cannot reach the agent")
        assert time.monotonic() - started < WARN_EVERY, "premise: everything above within one warning period"
        assert warned == [
            f"floodgate: cannot reach the agent at {path}: No such file or directory; answering by fail policy open"
        ], "one warning for all the failed attempts and calls"
        assert lines(floodgate_log, "reachable again") == []
    finally:
        c.close()


def test_an_agent_started_after_the_client_is_found(kind, make_agent, monkeypatch, floodgate_log) -> None:  # noqa: ANN001
    path = os.path.join(short_dir("fg-late-"), "agent.sock")
    monkeypatch.setenv("FLOODGATE_SOCKET", path)
    c = Either(kind, None, timeout=2.0, reconnect_min=0.005, reconnect_max=0.05)
    try:
        d = c.allow(unique("user"), "r")
        assert d.origin is Origin.FAIL_OPEN and not c.health().connected
        assert len(lines(floodgate_log, f"cannot reach the agent at {path}")) == 1
        make_agent(CLIENT_RULES, socket_path=path)
        eventually("the client connects to the agent started after it", c.connected)
        d = c.allow(unique("user"), "r")
        assert d.from_agent and (d.limit, d.remaining) == (3, 2)
        h = c.health()
        assert (h.connected, h.path, h.last_error, h.failed_attempts) == (True, path, None, 0)
        assert h.fail_policy_answers == 1
        back = lines(floodgate_log, "reachable again")
        assert len(back) == 1 and back[0].startswith(f"floodgate: agent reachable again at {path} (after "), back
    finally:
        c.close()


def test_the_resolvers_order(monkeypatch) -> None:  # noqa: ANN001
    runtime = short_dir("fg-xdg-")
    user_socket = os.path.join(runtime, "floodgate", "floodgate.sock")
    os.makedirs(os.path.dirname(user_socket))
    open(user_socket, "w").close()  # the resolver asks only whether the file exists
    # Nothing set: the default, which errors and logs name (whether or not an agent is there).
    assert default_socket_path() == DEFAULT_SOCKET
    # The variable wins over everything; empty is unset.
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    monkeypatch.setenv("FLOODGATE_SOCKET", "/elsewhere/agent.sock")
    assert default_socket_path() == "/elsewhere/agent.sock"
    monkeypatch.setenv("FLOODGATE_SOCKET", "")
    # Then the system agent's socket if it exists, else the user's.
    assert default_socket_path() == (DEFAULT_SOCKET if SYSTEM_AGENT else user_socket)
    # A relative XDG_RUNTIME_DIR is not one (the XDG spec): ignored.
    monkeypatch.chdir(os.path.dirname(runtime))
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.basename(runtime))
    assert default_socket_path() == DEFAULT_SOCKET
    # A runtime dir without the socket: the default.
    monkeypatch.setenv("XDG_RUNTIME_DIR", short_dir("fg-xdg-empty-"))
    assert default_socket_path() == DEFAULT_SOCKET


@pytest.mark.skipif(
    SYSTEM_AGENT,
    reason=f"{DEFAULT_SOCKET} exists on this machine, and the resolver rightly prefers it to XDG_RUNTIME_DIR",
)
def test_the_resolver_finds_an_agent_in_XDG_RUNTIME_DIR_started_after_the_client(kind, make_agent, monkeypatch) -> None:  # noqa: ANN001
    runtime = short_dir("fg-xdg-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    user_socket = os.path.join(runtime, "floodgate", "floodgate.sock")
    assert default_socket_path() == DEFAULT_SOCKET, "no agent anywhere yet"
    c = Either(kind, None, timeout=2.0, reconnect_min=0.005, reconnect_max=0.05)
    try:
        h = c.health()
        assert not h.connected and h.path == DEFAULT_SOCKET and h.failed_attempts >= 1
        os.makedirs(os.path.dirname(user_socket))
        make_agent(CLIENT_RULES, socket_path=user_socket)
        assert default_socket_path() == user_socket
        # Looked up again on the next attempt: the client finds the agent there by itself.
        eventually("the client connects to the agent in XDG_RUNTIME_DIR", c.connected)
        assert c.allow(unique("user"), "r").from_agent
        assert c.health().path == user_socket
    finally:
        c.close()


def test_one_warning_per_10_s_with_the_count_of_the_others(floodgate_log) -> None:  # noqa: ANN001
    now = [100.0]
    r = Reachability("/x.sock", "closed", clock=lambda: now[0])
    r.failed("/x.sock", "Connection refused")
    for t in (101.0, 105.0, 109.9):
        now[0] = t
        r.failed("/x.sock", "Connection refused")
    now[0] = 110.0
    r.failed("/x.sock", "No such file or directory")
    assert lines(floodgate_log, "") == [
        "floodgate: cannot reach the agent at /x.sock: Connection refused; answering by fail policy closed",
        "floodgate: cannot reach the agent at /x.sock: No such file or directory; answering by fail policy"
        " closed (3 more failed attempts not logged since the last warning)",
    ]
    r.connected("/x.sock")
    assert lines(floodgate_log, "reachable")[-1] == "floodgate: agent reachable again at /x.sock (after 5 failed attempts)"
    assert (r.failed_attempts, r.last_error) == (0, None)
    # A short outage inside the same period: not logged, neither is its end; the next warning counts it.
    floodgate_log.clear()
    now[0] = 111.0
    r.failed("/x.sock", "Connection refused")
    r.connected("/x.sock")
    assert lines(floodgate_log, "") == []
    now[0] = 120.0
    r.failed("/x.sock", "Connection refused")
    assert lines(floodgate_log, "") == [
        "floodgate: cannot reach the agent at /x.sock: Connection refused; answering by fail policy closed"
        " (1 more failed attempts not logged since the last warning)",
    ]
