#!/usr/bin/env bash
# The agent's native gRPC server called from a second HTTP/2 implementation: grpcio (gRPC C-core's
# chttp2). Makes a venv (target/interop-venv), installs the pinned grpcio and pytest from PyPI (hash-checked), and
# runs the tests of this directory against the `floodgate` binary named by FLOODGATE_BIN (required:
# each test starts its own agents). Extra arguments go to pytest. Exits non-zero when anything fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
VENV="$REPO/target/interop-venv"

if [ -z "${FLOODGATE_BIN:-}" ]; then
  echo "tests/interop/run.sh: set FLOODGATE_BIN to the floodgate binary to test" >&2
  exit 2
fi
if [ ! -x "$FLOODGATE_BIN" ]; then
  echo "tests/interop/run.sh: no floodgate binary at $FLOODGATE_BIN" >&2
  exit 2
fi
export FLOODGATE_BIN

# A venv of our own (a broken or half-made one is made again).
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 9))' >/dev/null 2>&1; then
  rm -rf "$VENV"
  if ! "$PYTHON" -m venv "$VENV"; then
    # Debian's python3 without its venv module.
    echo "tests/interop/run.sh: '$PYTHON -m venv' failed; installing python3-venv with apt-get" >&2
    rm -rf "$VENV"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$PYTHON" -m venv "$VENV"
  fi
fi
# Pinned with every file's SHA-256 (requirements.txt, from requirements.in by pip-compile).
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes \
  -r tests/interop/requirements.txt
"$VENV/bin/python" -c 'import grpc, sys; print("grpcio", grpc.__version__, "on Python", sys.version.split()[0], "agent", sys.argv[1])' "$FLOODGATE_BIN"

# No __pycache__ or .pytest_cache left in the source tree.
export PYTHONDONTWRITEBYTECODE=1
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rxX tests/interop "$@"
