"""What the benchmarks share: processes (agent, redis-server), closed-loop drivers for asyncio tasks
and threads, exact percentiles, medians over runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Optional

SDK_DIR = Path(__file__).resolve().parent.parent
REPO = SDK_DIR.parent

# The rule every bench check names: a limit so high that checks stay allowed, so each one does the
# full work of the limiter (the same rule as the Rust loadgen's).
RULES = '{"rules":[{"id":"bench","dimension":"user","limit":1000000000000,"windowSeconds":60}]}'
KEYS = 10_000


def default_bin(name: str) -> str:
    """The release binary if it is there, else the debug one (said in the report)."""
    for profile in ("release", "debug"):
        p = REPO / "target" / profile / name
        if p.exists():
            return str(p)
    return str(REPO / "target" / "release" / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, binary: str, redis: Optional[str] = None, extra: Optional[List[str]] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="fg-bench-")
        self.socket = os.path.join(self.dir, "agent.sock")
        rules = os.path.join(self.dir, "rules.json")
        Path(rules).write_text(RULES)
        cmd = [binary, "agent", "--socket", self.socket, "--admin", "off", "--rules", rules]
        if redis:
            cmd += ["--redis", redis]
        cmd += extra or []
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOODGATE_")}
        env.update(STATE_DIRECTORY=self.dir, NO_COLOR="1")
        self.log = os.path.join(self.dir, "agent.log")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), env=env)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {Path(self.log).read_text()}")
            if "rules loaded" in Path(self.log).read_text():
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.socket)
                    break
                except OSError:
                    pass
                finally:
                    s.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent not ready: {Path(self.log).read_text()}")
            time.sleep(0.01)

    def cpu_seconds(self) -> float:
        """User + system CPU the agent has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / tick

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Redis:
    """A redis-server on a free loopback port: `--save ""`, no AOF, its own temp dir."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if not exe:
            raise RuntimeError("redis-server not found")
        self.dir = tempfile.mkdtemp(prefix="fg-bench-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir,
             "--logfile", os.path.join(self.dir, "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.01)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def flushall(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def percentile(sorted_ns: List[int], q: float) -> float:
    """The exact q-quantile (nearest rank) of sorted nanoseconds, in µs."""
    if not sorted_ns:
        return float("nan")
    i = min(len(sorted_ns) - 1, max(0, int(q * len(sorted_ns) + 0.999999) - 1))
    return sorted_ns[i] / 1000.0


def summarise(latencies_ns: List[int], seconds: float, clients: int, **extra: Any) -> Dict[str, Any]:
    s = sorted(latencies_ns)
    return {
        "clients": clients,
        "p50_us": round(percentile(s, 0.50), 1),
        "p99_us": round(percentile(s, 0.99), 1),
        "checks_per_s": round(len(s) / seconds),
        "checks": len(s),
        **extra,
    }


def run_async(
    clients: int, seconds: float, setup: Callable[[], Awaitable[Callable[[int], Awaitable[bool]]]]
) -> Dict[str, Any]:
    """``clients`` asyncio tasks each calling ``call(key)`` back to back, a quarter of ``seconds`` of
    warm-up then ``seconds`` measured; ``call`` comes from ``await setup()`` on the run's loop and
    answers whether the limiter (not a fail policy) decided; every answer must."""

    async def main() -> Dict[str, Any]:
        call = await setup()
        lat: List[int] = []
        bad = [0]
        phase = {"measure": False, "stop": False}

        async def worker(n: int) -> None:
            i = n
            clock = time.perf_counter_ns
            while not phase["stop"]:
                t = clock()
                ok = await call(i % KEYS)
                took = clock() - t
                if phase["measure"]:
                    lat.append(took)
                    if not ok:
                        bad[0] += 1
                i += clients

        tasks = [asyncio.ensure_future(worker(n)) for n in range(clients)]
        await asyncio.sleep(seconds / 4)
        phase["measure"] = True
        await asyncio.sleep(seconds)
        phase["measure"] = False
        phase["stop"] = True
        await asyncio.gather(*tasks)
        if bad[0]:
            raise RuntimeError(f"{bad[0]} answers did not come from the limiter")
        return summarise(lat, seconds, clients)

    return asyncio.run(main())


def run_threads(clients: int, seconds: float, call: Callable[[int], bool]) -> Dict[str, Any]:
    """As :func:`run_async`, with ``clients`` threads."""
    lats: List[List[int]] = [[] for _ in range(clients)]
    bad = [0]
    phase = {"measure": False, "stop": False}

    def worker(n: int) -> None:
        i = n
        mine = lats[n]
        clock = time.perf_counter_ns
        while not phase["stop"]:
            t = clock()
            ok = call(i % KEYS)
            took = clock() - t
            if phase["measure"]:
                mine.append(took)
                if not ok:
                    bad[0] += 1
            i += clients

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds / 4)
    phase["measure"] = True
    time.sleep(seconds)
    phase["measure"] = False
    phase["stop"] = True
    for t in threads:
        t.join()
    if bad[0]:
        raise RuntimeError(f"{bad[0]} answers did not come from the limiter")
    return summarise([x for l in lats for x in l], seconds, clients)


def medians(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The median of each figure over runs (runs are rows of one (implementation, clients))."""
    out = dict(runs[0])
    for k in ("p50_us", "p99_us", "checks_per_s"):
        out[k] = round(statistics.median(r[k] for r in runs), 1)
    out["runs"] = len(runs)
    out["p50_us_range"] = [min(r["p50_us"] for r in runs), max(r["p50_us"] for r in runs)]
    out["checks_per_s_range"] = [min(r["checks_per_s"] for r in runs), max(r["checks_per_s"] for r in runs)]
    return out


def write_json(path: str, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
