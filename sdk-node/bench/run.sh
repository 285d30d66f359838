#!/usr/bin/env bash
# Builds the Node SDK and runs its benchmark under the machine's heavy-work lock (never during a
# cargo build or another benchmark). Arguments go to dist/bench/bench.js (--runs, --seconds, --json).
# Needs the release binaries: cargo build --release --bin floodgate --bin loadgen.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d node_modules ] || npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
npx tsc -p tsconfig.json
exec flock /tmp/fg-heavy.lock node dist/bench/bench.js "$@"
