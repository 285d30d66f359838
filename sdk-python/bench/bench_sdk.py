"""The Python SDK's check against the Rust SDK's, on one agent (embedded store), in the same run.

For each run: one `floodgate agent` (release build), then for each level of N concurrent callers, in
turn (the order alternates between runs, to spread the machine's noise over all three): the Rust SDK
through `loadgen sdk`, the Python AsyncClient with N asyncio tasks on its one connection, and the
Python Client with N threads. Each level is a
closed loop of `allow(user:K, "bench", 1)` over 10,000 keys: a quarter of --seconds of warm-up,
then --seconds measured. Latency percentiles are exact (sorted); the report is the median of each
figure over --runs runs, and the ratios Python / Rust.

Run it under the machine's heavy-work lock:

    flock /tmp/fg-heavy.lock sdk-python/.venv/bin/python sdk-python/bench/bench_sdk.py --runs 5

Without `target/release/loadgen` (or with --no-rust) the Rust column is left out and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

from common import REPO, Agent, default_bin, medians, run_async, run_threads, write_json

sys.path.insert(0, str(REPO / "sdk-python" / "src"))  # the source tree when run without installing
import floodgate  # noqa: E402


def python_async(socket: str, clients: int, seconds: float) -> Dict[str, Any]:
    async def setup():  # noqa: ANN202
        c = await floodgate.AsyncClient.connect(socket)

        async def call(key: int) -> bool:
            return (await c.allow(f"user:{key}", "bench", 1)).from_agent

        return call

    return run_async(clients, seconds, setup)


def python_sync(client: "floodgate.Client", clients: int, seconds: float) -> Dict[str, Any]:
    return run_threads(clients, seconds, lambda key: client.allow(f"user:{key}", "bench", 1).from_agent)


def rust(loadgen: str, socket: str, levels: List[int], seconds: float) -> List[Dict[str, Any]]:
    out = os.path.join(tempfile.mkdtemp(prefix="fg-bench-"), "sdk.json")
    subprocess.run(
        [loadgen, "sdk", "--socket", socket, "--rule", "bench", "--clients", ",".join(map(str, levels)),
         "--seconds", str(seconds), "--json", out],
        check=True, stdout=subprocess.DEVNULL,
    )
    with open(out) as f:
        return json.load(f)["results"]


def attempt(what: str, fn, tries: int = 3):  # noqa: ANN001, ANN201
    """Runs ``fn``; a level where any answer came from a fail policy (a >10 ms stall of this noisy
    machine: the default timeout, on both sides) is measured again, up to ``tries`` times."""
    for i in range(tries):
        try:
            return fn()
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"{what}: attempt {i + 1} failed ({e}); measuring again", file=sys.stderr)
    raise RuntimeError(f"{what}: {tries} attempts failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("FLOODGATE_BENCH_BIN") or default_bin("floodgate"))
    ap.add_argument("--loadgen", default=default_bin("loadgen"))
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-rust", action="store_true")
    ap.add_argument("--no-sync", action="store_true", help="leave out the threaded client")
    ap.add_argument("--json", default=str(REPO / "target" / "bench" / "python-sdk.json"))
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    have_rust = not args.no_rust and os.access(args.loadgen, os.X_OK)
    if not have_rust:
        print(f"no Rust baseline: {args.loadgen} is not there (or --no-rust)", file=sys.stderr)

    rows: Dict[str, List[Dict[str, Any]]] = {}
    for run in range(args.runs):
        agent = Agent(args.bin)
        try:
            # Warm the agent's tables (keys, allocator) once per run, so no side gets a cold agent.
            warm = floodgate.Client(agent.socket, timeout=1.0)
            for k in range(2_000):
                warm.allow(f"user:{k}", "bench")
            warm.close()
            # The threaded client with the default configuration (10 ms timeout), as the others.
            sync_client = floodgate.Client(agent.socket)
            # Level by level, the three side by side (the order alternating between runs): the
            # machine's slow and fast spells then fall on all of them alike.
            for n in levels:
                steps = ["rust", "async", "sync"]
                if run % 2:
                    steps.reverse()
                for step in steps:
                    if step == "rust" and have_rust:
                        for r in attempt("rust", lambda: rust(args.loadgen, agent.socket, [n], args.seconds)):
                            rows.setdefault(f"rust/{r['clients']}", []).append(r)
                    elif step == "async":
                        row = attempt("python-async", lambda: python_async(agent.socket, n, args.seconds))
                        rows.setdefault(f"python-async/{n}", []).append(row)
                    elif step == "sync" and not args.no_sync:
                        row = attempt("python-sync", lambda: python_sync(sync_client, n, args.seconds))
                        rows.setdefault(f"python-sync/{n}", []).append(row)
            sync_client.close()
        finally:
            agent.close()
        print(f"run {run + 1}/{args.runs}: " + "; ".join(
            f"{k} p50 {v[-1]['p50_us']} µs p99 {v[-1]['p99_us']} µs {v[-1]['checks_per_s']}/s" for k, v in rows.items()
        ), file=sys.stderr)

    result: Dict[str, Any] = {
        "agent": args.bin,
        "seconds": args.seconds,
        "runs": args.runs,
        "python": sys.version.split()[0],
        "rows": {k: medians(v) for k, v in rows.items()},
        "all": rows,
    }
    ratios = {}
    for n in levels:
        base = result["rows"].get(f"rust/{n}")
        for impl in ("python-async", "python-sync"):
            py = result["rows"].get(f"{impl}/{n}")
            if base and py:
                ratios[f"{impl}/{n}"] = {
                    "p50_x": round(py["p50_us"] / base["p50_us"], 2),
                    "p99_x": round(py["p99_us"] / base["p99_us"], 2),
                    "throughput_fraction": round(py["checks_per_s"] / base["checks_per_s"], 3),
                }
    result["ratios_vs_rust"] = ratios
    write_json(args.json, result)

    print(f"\nmedians of {args.runs} runs, {args.seconds} s per level, agent {args.bin}")
    print(f"{'implementation':<16}{'callers':>8}{'p50 µs':>10}{'p99 µs':>10}{'checks/s':>11}   vs Rust (p50, p99, checks/s)")
    for k, r in sorted(result["rows"].items(), key=lambda kv: (int(kv[0].split('/')[1]), kv[0])):
        impl = k.split("/")[0]
        rt = ratios.get(k)
        vs = f"   {rt['p50_x']}×, {rt['p99_x']}×, {rt['throughput_fraction']:.0%}" if rt else ""
        print(f"{impl:<16}{r['clients']:>8}{r['p50_us']:>10}{r['p99_us']:>10}{r['checks_per_s']:>11}{vs}")
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
