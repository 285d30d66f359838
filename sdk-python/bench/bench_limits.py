"""The Python SDK (agent on Redis) against the `limits` library on the same redis-server.

For each run: a redis-server on a free loopback port (`--save ""`, no AOF) and a `floodgate agent`
(release build) on it with the bench rule (a limit so high every check is allowed and does the full
work: for the agent, one sliding-window script call per check or per coalesced batch). Then, in an
order that alternates between runs, closed loops of one check per call over 10,000 keys:

- floodgate: `AsyncClient.allow` with 1 and 16 asyncio tasks, `Client.allow` with 1 thread; every
  answer must come from Redis (source redis: the agent runs with a 1 s store timeout and the clients
  with a 1 s call timeout, since `limits` waits for Redis however long it takes);
- limits: `limits.aio` (redis-py's asyncio client) with 1 and 16 tasks and `limits` (redis-py) with 1 thread, with
  its sliding-window-counter strategy (the same algorithm as Floodgate's sliding window) and its
  moving-window strategy (an exact log of timestamps).

Reported per level: p50/p99 of one check, checks/s, and the Redis CPU (user + system, from INFO)
per check. Medians over --runs runs. Run it under the machine's heavy-work lock:

    flock /tmp/fg-heavy.lock sdk-python/.venv/bin/python sdk-python/bench/bench_limits.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any, Callable, Dict, List

from common import REPO, Agent, Redis, default_bin, medians, run_async, run_threads, write_json

sys.path.insert(0, str(REPO / "sdk-python" / "src"))
import floodgate  # noqa: E402
from floodgate import Source  # noqa: E402

LIMIT = "1000000000000/minute"


def redis_cpu_s(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"INFO cpu\r\n")
        data = b""
        while b"used_cpu_user:" not in data or not data.endswith(b"\r\n"):
            data += s.recv(65536)
    info = dict(line.split(":", 1) for line in data.decode().splitlines() if ":" in line)
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def with_redis_cpu(port: int, fn: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    before = redis_cpu_s(port)
    row = fn()
    # The CPU covers warm-up and measurement; the checks counted are the measured ones, so scale.
    total_checks = row["checks"] * 1.25
    row["redis_cpu_us_per_check"] = round((redis_cpu_s(port) - before) / total_checks * 1e6, 2)
    return row


def floodgate_async(socket_path: str, clients: int, seconds: float) -> Dict[str, Any]:
    async def setup():  # noqa: ANN202
        # A patient client (1 s, like the agent's store timeout): `limits` waits for Redis however
        # long it takes, so the SDK must not answer by its fail policy after 10 ms either.
        c = await floodgate.AsyncClient.connect(socket_path, timeout=1.0)

        async def call(key: int) -> bool:
            return (await c.allow(f"user:{key}", "bench", 1)).source is Source.REDIS

        return call

    return run_async(clients, seconds, setup)


def limits_async(url: str, strategy: str, clients: int, seconds: float) -> Dict[str, Any]:
    import limits
    from limits.aio import storage, strategies

    item = limits.parse(LIMIT)

    async def setup():  # noqa: ANN202
        # redis-py's asyncio client (limits' coredis bridge does not run with coredis 6 here).
        store = storage.RedisStorage(f"async+{url}", implementation="redispy")
        limiter = getattr(strategies, strategy)(store)

        async def call(key: int) -> bool:
            return await limiter.hit(item, "user", str(key))

        return call

    return run_async(clients, seconds, setup)


def limits_sync(url: str, strategy: str, clients: int, seconds: float) -> Dict[str, Any]:
    import limits
    from limits import storage, strategies

    item = limits.parse(LIMIT)
    limiter = getattr(strategies, strategy)(storage.RedisStorage(url))
    return run_threads(clients, seconds, lambda key: limiter.hit(item, "user", str(key)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("FLOODGATE_BENCH_BIN") or default_bin("floodgate"))
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=str(REPO / "target" / "bench" / "python-vs-limits.json"))
    args = ap.parse_args()

    rows: Dict[str, List[Dict[str, Any]]] = {}

    def add(name: str, row: Dict[str, Any]) -> None:
        rows.setdefault(f"{name}/{row['clients']}", []).append(row)

    for run in range(args.runs):
        redis = Redis()
        agent = Agent(args.bin, redis=redis.url, extra=["--redis-timeout-ms", "1000", "--events", "false"])
        try:
            sync_client = floodgate.Client(agent.socket, timeout=1.0)
            steps: List[Callable[[], None]] = [
                lambda: [add("floodgate-async", with_redis_cpu(redis.port, lambda: floodgate_async(agent.socket, n, args.seconds))) for n in (1, 16)],
                lambda: add("floodgate-sync", with_redis_cpu(redis.port, lambda: run_threads(
                    1, args.seconds, lambda k: sync_client.allow(f"user:{k}", "bench").source is Source.REDIS))),
            ]
            for strategy, short in (("SlidingWindowCounterRateLimiter", "sliding"), ("MovingWindowRateLimiter", "moving")):
                steps.append(lambda s=strategy, sh=short: [add(f"limits-{sh}-async", with_redis_cpu(redis.port, lambda: limits_async(redis.url, s, n, args.seconds))) for n in (1, 16)])
                steps.append(lambda s=strategy, sh=short: add(f"limits-{sh}-sync", with_redis_cpu(redis.port, lambda: limits_sync(redis.url, s, 1, args.seconds))))
            if run % 2:
                steps.reverse()
            for step in steps:
                step()
            sync_client.close()
        finally:
            agent.close()
            redis.close()
        print(f"run {run + 1}/{args.runs}: " + "; ".join(
            f"{k} p50 {v[-1]['p50_us']} p99 {v[-1]['p99_us']} {v[-1]['checks_per_s']}/s" for k, v in sorted(rows.items())
        ), file=sys.stderr)

    result: Dict[str, Any] = {"agent": args.bin, "seconds": args.seconds, "runs": args.runs, "rows": {}, "all": rows}
    for k, v in rows.items():
        m = medians(v)
        m["redis_cpu_us_per_check"] = sorted(r["redis_cpu_us_per_check"] for r in v)[len(v) // 2]
        result["rows"][k] = m
    write_json(args.json, result)

    print(f"\nmedians of {args.runs} runs, {args.seconds} s per level, agent {args.bin} on Redis")
    print(f"{'implementation':<26}{'callers':>8}{'p50 µs':>10}{'p99 µs':>10}{'checks/s':>11}{'Redis CPU µs/check':>20}")
    for k, r in sorted(result["rows"].items(), key=lambda kv: (kv[0].split('/')[0].split('-')[-1], int(kv[0].split('/')[1]), kv[0])):
        print(f"{k.split('/')[0]:<26}{r['clients']:>8}{r['p50_us']:>10}{r['p99_us']:>10}{r['checks_per_s']:>11}{r['redis_cpu_us_per_check']:>20}")
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
