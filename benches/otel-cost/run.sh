#!/usr/bin/env bash
# What traces cost the agent when on: its CPU time (utime + stime) per check with no export, with
# OTLP/HTTP JSON and with OTLP/HTTP protobuf, a tenth of the checks sampled, against a sink that
# answers 200 (sink.py), under `loadgen sdk` (16 callers, 4 s after 1 s of warm-up, in-memory store);
# and the bytes each encoding sent. Each binary given is measured RUNS times (default 3), the
# binaries and encodings alternating; the medians are printed last.
#
#   cargo build --release --bins
#   benches/otel-cost/run.sh target/release/floodgate /tmp/floodgate-before
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS="${RUNS:-3}"
loadgen="$PWD/target/release/loadgen"
work="$(mktemp -d)"
sink=""
agent=""
trap '[ -n "$agent" ] && kill "$agent" 2>/dev/null; [ -n "$sink" ] && kill "$sink" 2>/dev/null; rm -rf "$work"' EXIT
echo '{"rules":[{"id":"bench","dimension":"user","limit":1000000000,"windowSeconds":60}]}' > "$work/rules.json"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"

one() { # binary protocol -> "µs-per-check posts bytes"
  local bin="$1" proto="$2"
  python3 benches/otel-cost/sink.py "$port" > "$work/sink.out" & sink=$!
  rm -f "$work/a.sock"
  if [ "$proto" = off ]; then
    "$bin" agent --socket "$work/a.sock" --rules "$work/rules.json" 2>"$work/agent.log" & agent=$!
  else
    OTEL_EXPORTER_OTLP_PROTOCOL="$proto" "$bin" agent --socket "$work/a.sock" --rules "$work/rules.json" \
      --otlp-endpoint "http://127.0.0.1:$port" --otlp-sample-ratio 0.1 2>"$work/agent.log" & agent=$!
  fi
  for _ in $(seq 100); do [ -S "$work/a.sock" ] && break; sleep 0.05; done
  local t0 t1
  t0="$(awk '{print $14 + $15}' "/proc/$agent/stat")"
  "$loadgen" sdk --socket "$work/a.sock" --clients 16 --seconds 4 --json "$work/sdk.json" >/dev/null
  sleep 1.5 # the last batch's export
  t1="$(awk '{print $14 + $15}' "/proc/$agent/stat")"
  kill "$agent"; wait "$agent" 2>/dev/null || true; agent=""
  kill "$sink"; wait "$sink" 2>/dev/null || true; sink=""
  # Checks: the measured rate over the 5 s the agent was driven (warm-up included).
  python3 - "$t0" "$t1" "$work/sdk.json" "$(getconf CLK_TCK)" "$(cat "$work/sink.out")" <<'PY'
import json, sys
t0, t1, path, tck, sink = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
checks = json.load(open(path))["results"][0]["checks_per_s"] * 5
print(f"{(t1 - t0) / tck * 1e6 / checks:.2f} {sink}")
PY
}

for run in $(seq "$RUNS"); do
  for bin in "$@"; do
    for proto in off http/json http/protobuf; do
      echo "$bin $proto $(one "$bin" "$proto")" | tee -a "$work/all"
    done
  done
done
echo "medians of $RUNS (agent CPU µs per check; POSTs and bytes sent):"
python3 - "$work/all" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    bin, proto, us, posts, size = line.split()
    rows.setdefault((bin, proto), []).append((float(us), int(posts), int(size)))
for (bin, proto), r in rows.items():
    print(f"{bin:40} {proto:14} {statistics.median(x[0] for x in r):6.2f} µs/check"
          f"  {statistics.median(x[1] for x in r):6.0f} POSTs  {statistics.median(x[2] for x in r) / 1e6:7.1f} MB")
PY
