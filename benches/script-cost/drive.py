"""Drives check.lua calls at one redis-server for benches/script-cost/run.sh.

usage: drive.py PORT SCRIPT FORMAT ITEMS CALLS
10,000 clients over 16,384 buckets (the agent's default layout), ITEMS checks per call (each its own
group, as the coalescer sends them), one sliding-window rule, 50 calls per pipeline. FORMAT is the
script's argument layout: "pair" (9 per item, a sliding window's two window hashes as its keys;
since issue 33), "specs" (nspecs, 4 per spec, 4 per item; tried in issue 14) or "flat" (9 per item,
one key prefix per item). The same seed every time, so a second run repeats the first's keys (a warm state).
With ALGO=concurrency (flat format only), each pipeline's calls alternate: an acquire of one unit of
a concurrency rule under a lease for each of the call's clients, then the release of those leases.
"""
import os
import random
import sys
import zlib

import redis

port, script, fmt, k, calls = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
r = redis.Redis(port=port)
sha = r.script_load(open(script).read())
clients = [f"user:{i}" for i in range(10000)]


def prefix(c):
    h = zlib.crc32(c.encode())
    return f"fg:{{{h % 1024}}}:bench/{h % 16384}"


def keys_of(cs):
    if fmt == "pair":
        return [f"{prefix(c)}:w{w}" for c in cs for w in (0, 1)]
    return [prefix(c) for c in cs]


def args_of(cs):
    if fmt == "specs":
        args = [1, 1, 1000000000, 600000, 1000000000]
        for c in cs:
            args += [1 * 8 + 1 * 2 + 1, 1, 0, c]
        return args
    args = []
    for c in cs:
        args += [1, 1000000000, 600000, 1000000000, 1, 1, 0, c, 1]
    return args


def lease_call(cs, n, mode):
    """An acquire (mode 1) or release (mode 6) of lease n for each client."""
    keys = [f"fg:{{{zlib.crc32(c.encode()) % 1024}}}:slots/c/{c}" for c in cs]
    args = []
    for c in cs:
        args += [3, 1000000, 3600000, 0, 1, mode, n, c, 1]
    return keys, args


rng = random.Random(7)
if os.environ.get("ALGO") == "concurrency":
    n = 0
    for _ in range(calls // 50):
        p = r.pipeline(transaction=False)
        for _ in range(25):
            cs = rng.sample(clients, k)
            n += 1
            for mode in (1, 6):
                keys, args = lease_call(cs, n, mode)
                p.evalsha(sha, len(keys), *keys, *args)
        for res in p.execute():
            assert res[0] == 1, res
    sys.exit(0)
for _ in range(calls // 50):
    p = r.pipeline(transaction=False)
    for _ in range(50):
        cs = rng.sample(clients, k)
        keys = keys_of(cs)
        p.evalsha(sha, len(keys), *keys, *args_of(cs))
    for res in p.execute():
        assert res[0] == 1, res
