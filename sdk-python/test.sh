#!/usr/bin/env bash
# The Python SDK's tests: makes a venv (sdk-python/.venv), installs the package (hatchling builds it
# outside the source tree) with its test extras from PyPI, and runs pytest against real `floodgate
# agent` processes (FLOODGATE_BIN, default <repo>/target/debug/floodgate: run `cargo build` first)
# and a redis-server the tests start on a free loopback port (installed with apt-get when missing).
# Extra arguments go to pytest.
# Exits non-zero when anything fails.
set -euo pipefail
cd "$(dirname "$0")"
REPO="$(cd .. && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${FLOODGATE_PY_VENV:-$PWD/.venv}"

export FLOODGATE_BIN="${FLOODGATE_BIN:-$REPO/target/debug/floodgate}"
if [ ! -x "$FLOODGATE_BIN" ]; then
  echo "sdk-python/test.sh: no floodgate binary at $FLOODGATE_BIN; run 'cargo build' first or set FLOODGATE_BIN" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "sdk-python/test.sh: redis-server not found; installing it with apt-get" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi

# A venv of our own (a broken or half-made one is made again).
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 9))' >/dev/null 2>&1; then
  rm -rf "$VENV"
  if ! "$PYTHON" -m venv "$VENV"; then
    # Debian's python3 without its venv module.
    echo "sdk-python/test.sh: '$PYTHON -m venv' failed; installing python3-venv with apt-get" >&2
    rm -rf "$VENV"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$PYTHON" -m venv "$VENV"
  fi
fi
# The test extras and the build backend as requirements-test.txt and requirements-build.txt pin
# them, each file checked against its SHA-256 (pip-compile --generate-hashes; regenerate with the
# command in each header after changing the extras); then the package as it installs (not the
# source tree on sys.path), built by that hatchling (no isolated build fetching one unchecked),
# without dependencies (it has none; pip reinstalls a local directory every time, so the venv holds
# this tree's code).
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes \
  -r requirements-test.txt -r requirements-build.txt
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --upgrade .
"$VENV/bin/python" -m pip check >/dev/null
"$VENV/bin/python" -c 'import floodgate, sys; print("floodgate-client", floodgate.__version__, "on Python", sys.version.split()[0], "agent", sys.argv[1])' "$FLOODGATE_BIN"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
