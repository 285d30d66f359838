"""Real processes for the tests: `floodgate agent` (the binary from FLOODGATE_BIN, default
<repo>/target/debug/floodgate) on its embedded store or on a `redis-server` the session starts on a
free loopback port (never the machine's own Redis)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional, TypeVar

import pytest

SDK_DIR = Path(__file__).resolve().parent.parent
REPO = SDK_DIR.parent
PROTOCOL_MD = REPO / "protocol" / "PROTOCOL.md"

T = TypeVar("T")


def floodgate_bin() -> str:
    path = os.environ.get("FLOODGATE_BIN") or str(REPO / "target" / "debug" / "floodgate")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no floodgate binary at {path}: build it (cargo build) or set FLOODGATE_BIN", pytrace=False)
    return path


def eventually(what: str, fn: Callable[[], Optional[T]], timeout: float = 10.0, every: float = 0.005) -> T:
    """Polls ``fn`` until it returns something other than None/False, failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v is not None and v is not False:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique(prefix: str = "k") -> str:
    """A key no other test (or earlier run on the same Redis) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Agent:
    """One `floodgate agent` process on a socket in a temporary directory; killed by :meth:`kill`."""

    def __init__(self, rules: str, redis: Optional[str] = None, socket_path: Optional[str] = None, args: Optional[List[str]] = None):
        self.dir = tempfile.mkdtemp(prefix="fg-agent-")
        self.socket = socket_path or os.path.join(self.dir, "agent.sock")
        self.rules = rules
        self.redis = redis
        self.args = list(args or [])
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.dir, "agent.log")
        self.start()

    def start(self) -> "Agent":
        rules_path = os.path.join(self.dir, "rules.json" if self.rules.lstrip().startswith("{") else "rules.toml")
        with open(rules_path, "w") as f:
            f.write(self.rules)
        cmd = [floodgate_bin(), "agent", "--socket", self.socket, "--admin", "off", "--rules", rules_path]
        if self.redis:
            # A patient store timeout: figures tested here must come from Redis, not from a fail mode
            # on a loaded 2-core machine.
            cmd += ["--redis", self.redis, "--redis-timeout-ms", "1000", "--events", "false"]
        cmd += self.args
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOODGATE_")}
        env.update(STATE_DIRECTORY=self.dir, NO_COLOR="1")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "w"), env=env
        )
        self.wait_ready()
        return self

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}; log:\n{self.log()}")
            if "rules loaded" in self.log():
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            if time.monotonic() > deadline:
                raise AssertionError(f"agent not ready in {timeout} s; log:\n{self.log()}")
            time.sleep(0.005)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        """SIGSTOP, and wait until every thread of the agent is stopped (the signal is delivered
        asynchronously: a thread running on the other core could still answer a check otherwise)."""
        os.kill(self.pid, signal.SIGSTOP)
        eventually("every agent thread is stopped", self._stopped, timeout=5)

    def _stopped(self) -> bool:
        tasks = f"/proc/{self.pid}/task"
        try:
            states = []
            for t in os.listdir(tasks):
                with open(f"{tasks}/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return False
        return bool(states) and all(s in ("T", "t") for s in states)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, like a crash: the socket file stays behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except OSError:
                pass
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    """A `redis-server` on a free loopback port: `--save ""`, no AOF, its own temp dir."""

    def __init__(self) -> None:
        exe = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
        if not exe:
            pytest.fail("redis-server not found (install redis-server or set REDIS_SERVER_BIN)", pytrace=False)
        self.dir = tempfile.mkdtemp(prefix="fg-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        eventually("redis-server answers PING", self.ping, timeout=10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    r = RedisServer()
    yield r
    r.close()


@pytest.fixture(params=["embedded", "redis"])
def store(request: pytest.FixtureRequest) -> Optional[str]:
    """None for the agent's embedded store, else the session's Redis URL."""
    if request.param == "embedded":
        return None
    return request.getfixturevalue("redis_server").url


@pytest.fixture
def make_agent() -> Iterator[Callable[..., Agent]]:
    agents: List[Agent] = []

    def make(rules: str, redis: Optional[str] = None, socket_path: Optional[str] = None, args: Optional[List[str]] = None) -> Agent:
        a = Agent(rules, redis=redis, socket_path=socket_path, args=args)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()
