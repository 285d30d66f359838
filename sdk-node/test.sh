#!/usr/bin/env bash
# The Node SDK's tests: installs the locked dependencies (npm ci), builds with tsc, and runs every
# test with node's own runner against real `floodgate agent` processes (embedded store and a
# redis-server of the tests' own on a free loopback port). Needs Node >= 18 and npm; installs
# redis-server with apt-get when missing. The agent binary: $FLOODGATE_BIN, else
# <repo>/target/debug/floodgate (build it first: cargo build --bin floodgate).
set -euo pipefail
cd "$(dirname "$0")"

bin="${FLOODGATE_BIN:-$(cd .. && pwd)/target/debug/floodgate}"
if [ ! -x "$bin" ]; then
  echo "sdk-node/test.sh: no floodgate binary at $bin (cargo build --bin floodgate, or set FLOODGATE_BIN)" >&2
  exit 1
fi
export FLOODGATE_BIN="$bin"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "sdk-node/test.sh: redis-server not found; installing it with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi

# --ignore-scripts: no dependency has install scripts to run (and npm ci runs none of the package's
# own: its build for packing is `prepack`).
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
rm -rf dist
npx tsc -p tsconfig.json
node --test dist/test/*.test.js
