#!/usr/bin/env bash
# Redis's instructions per check-script call and per item, under callgrind, for the check script at a
# git revision (default: the working tree), at 1, 4 and 14 items per call (what coalescing carries at
# 1, 16 and 64 clients). A scratch redis-server under valgrind (hz 1: its timers would otherwise add
# work in proportion to valgrind's slowness), a warm-up pass, counts zeroed, the same calls again,
# counts dumped. Needs valgrind and redis-server; installs redis-py into target/script-cost-venv.
#
#   benches/script-cost/run.sh            # the working tree's lua/
#   benches/script-cost/run.sh c1132e8    # another revision's, to compare
#   ALGO=concurrency benches/script-cost/run.sh   # acquire and release calls of a concurrency rule,
#                                                 # alternating (instructions per call: their mean)
set -euo pipefail
cd "$(dirname "$0")/../.."
REV="${1:-}"
CALLS="${CALLS:-3000}"
ITEMS="${ITEMS:-1 4 14}"
work="$(mktemp -d)"
vp=""
# A failed run must not leave its redis-server under valgrind behind.
trap '[ -n "$vp" ] && kill "$vp" 2>/dev/null; rm -rf "$work"' EXIT
for f in sliding_window token_bucket concurrency quota check; do
  # concurrency.lua and quota.lua are newer than some revisions worth comparing: left out where not.
  if [ -n "$REV" ]; then git show "$REV:lua/$f.lua" 2>/dev/null || true; else cat "lua/$f.lua"; fi
done > "$work/check.lua"
fmt=flat
grep -q nspecs "$work/check.lua" && fmt=specs
grep -q sliding_window_key_now "$work/check.lua" && fmt=pair
venv=target/script-cost-venv
[ -x "$venv/bin/python" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q redis; }
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
for k in $ITEMS; do
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" \
    redis-server --port "$port" --save '' --appendonly no --hz 1 --dynamic-hz no >"$work/valgrind.log" 2>&1 &
  vp=$!
  for _ in $(seq 1 150); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.2; done
  ALGO="${ALGO:-sliding_window}" "$venv/bin/python" benches/script-cost/drive.py "$port" "$work/check.lua" "$fmt" "$k" "$CALLS"
  callgrind_control -z "$vp" >/dev/null 2>&1
  ALGO="${ALGO:-sliding_window}" "$venv/bin/python" benches/script-cost/drive.py "$port" "$work/check.lua" "$fmt" "$k" "$CALLS"
  callgrind_control -d "$vp" >/dev/null 2>&1
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$vp" 2>/dev/null || true
  vp=""
  total="$(grep -h '^summary:' "$work"/cg.*.1 | awk '{print $2}')"
  rm -f "$work"/cg.*
  echo "${REV:-worktree} ($fmt, ${ALGO:-sliding_window}) items/call=$k calls=$CALLS instructions/call=$((total / CALLS)) instructions/item=$((total / (CALLS * k)))"
done
