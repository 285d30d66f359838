#!/usr/bin/env bash
# The Python SDK as it ships: builds a wheel and an sdist with `python -m build` from a copy of
# sdk-python's tracked files (in a temp dir, so nothing is written into the source tree), checks
# that both carry the repository's LICENSE (the wheel in dist-info/licenses/), installs each into a
# fresh venv of its own (the wheel with no package index: the SDK has no dependencies;
# the sdist built by pip from the sdist alone), and in each imports floodgate and its ASGI and WSGI
# middleware, checks the installed files are exactly the tracked ones under src/floodgate, and asks a
# real agent for a decision: `Client(socket).allow("user:1", "api-per-user", 1)` must be allowed by
# the agent itself (not the fail-open policy). The agent is FLOODGATE_BIN (default
# <repo>/target/debug/floodgate: run `cargo build` first) on its embedded default (in-memory store,
# the example rules in a SQLite file in the temp dir). Then the source tree itself, as the README
# says to use it: `pip install ./sdk-python` into a fresh venv and `python -m build` of sdk-python
# (its output sent to the temp dir). Last, the source tree must be as clean as git keeps it: `git
# status --porcelain -- sdk-python` empty and no build/, dist/ or *.egg-info under sdk-python, and
# nothing there changed by the run (so neither of those in-tree builds wrote into it).
# Needs git, python3 (>= 3.9, with venv) and PyPI (or the pip index configured) for `build` and
# hatchling. Runs from any directory; PYTHON names another interpreter. Prints PASS or exits
# non-zero.
set -euo pipefail

SDK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
# Read-only git commands; safe.directory lets root (or another user) read a checkout it does not own.
git_ro() { git -c safe.directory='*' "$@"; }
fail() { echo "sdk-python/package-test.sh: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

REPO="$(git_ro -C "$SDK" rev-parse --show-toplevel 2>/dev/null)" \
  || fail "$SDK is not in a git checkout (the test copies git's tracked files)"
FLOODGATE_BIN="${FLOODGATE_BIN:-$REPO/target/debug/floodgate}"
[ -x "$FLOODGATE_BIN" ] || fail "no floodgate binary at $FLOODGATE_BIN; run 'cargo build' first or set FLOODGATE_BIN"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null \
  || fail "$PYTHON is missing or older than 3.9 (set PYTHON)"

# The state of sdk-python in git's eyes, ignored entries included (.venv/, build/, ...), and the
# build artefacts in it (venvs left out).
tree_state() { git_ro -C "$REPO" status --porcelain --ignored -- sdk-python; }
artefacts() {
  find "$SDK" -path "$SDK/.venv*" -prune -o \
    \( -type d \( -name build -o -name dist \) -o -name '*.egg-info' \) -print | sort
}
BEFORE_STATE="$(tree_state)"
BEFORE_ARTEFACTS="$(artefacts)"

TMP="$(mktemp -d "${TMPDIR:-/tmp}/floodgate-pkg.XXXXXX")"
AGENT_PID=""
cleanup() {
  local rc=$?
  if [ -n "$AGENT_PID" ] && kill -0 "$AGENT_PID" 2>/dev/null; then
    kill "$AGENT_PID" 2>/dev/null || true
    wait "$AGENT_PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

PIP_OPTS=(--quiet --disable-pip-version-check --no-input)
new_venv() {
  "$PYTHON" -m venv "$1" || fail "'$PYTHON -m venv' failed (Debian: apt-get install python3-venv)"
}

step "copy sdk-python's tracked files to $TMP/src"
mkdir -p "$TMP/src"
( cd "$REPO" && git_ro ls-files -z -- sdk-python ) > "$TMP/files"
# Tracked files deleted in the work tree are not copied (they would not be in a commit of it).
( cd "$REPO" && while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done < "$TMP/files" \
    | tar --null -T - -cf - ) | tar -xf - -C "$TMP/src"
COPY="$TMP/src/sdk-python"
[ -f "$COPY/pyproject.toml" ] || fail "no sdk-python/pyproject.toml among git's tracked files"
# What the installed package must hold: the tracked files under src/floodgate, relative to it.
( cd "$COPY/src/floodgate" && find . -type f | sed 's|^\./||' | sort ) > "$TMP/expected-files"

step "python -m build --sdist --wheel (build and hatchling from PyPI, hash-checked, in a venv of its own)"
new_venv "$TMP/build-venv"
# requirements-build.txt pins both with every file's SHA-256; the build then runs in this venv
# (--no-isolation) rather than in one pip would fill unchecked.
"$TMP/build-venv/bin/python" -m pip install "${PIP_OPTS[@]}" --require-hashes -r "$SDK/requirements-build.txt"
( cd "$COPY" && "$TMP/build-venv/bin/python" -m build --no-isolation --sdist --wheel --outdir "$TMP/dist" . ) \
  > "$TMP/build.log" 2>&1 || { cat "$TMP/build.log" >&2; fail "python -m build failed"; }
shopt -s nullglob
WHEELS=("$TMP"/dist/*.whl)
SDISTS=("$TMP"/dist/*.tar.gz)
shopt -u nullglob
[ "${#WHEELS[@]}" -eq 1 ] || fail "expected one .whl in dist/, got: $(ls "$TMP/dist")"
[ "${#SDISTS[@]}" -eq 1 ] || fail "expected one .tar.gz in dist/, got: $(ls "$TMP/dist")"
WHEEL="${WHEELS[0]}"
SDIST="${SDISTS[0]}"
# floodgate_client-<version>-py3-none-any.whl, floodgate_client-<version>.tar.gz
VERSION="$(basename "$WHEEL" | cut -d- -f2)"
[ "$(basename "$SDIST")" = "floodgate_client-$VERSION.tar.gz" ] \
  || fail "wheel $(basename "$WHEEL") and sdist $(basename "$SDIST") disagree"
case "$(basename "$WHEEL")" in
  floodgate_client-"$VERSION"-py3-none-any.whl) ;;
  *) fail "not a pure-Python wheel: $(basename "$WHEEL")" ;;
esac
# Warnings worth a look (a deprecated pyproject key, ...); PYTHONDONTWRITEBYTECODE's are not.
WARNINGS="$(grep -i 'warning' "$TMP/build.log" | grep -v 'byte-compiling is disabled' | sort -u || true)"
if [ -n "$WARNINGS" ]; then
  echo "   (the build warned:)"
  echo "$WARNINGS" | sed 's/^/   /'
fi
echo "   $(basename "$WHEEL") ($(wc -c < "$WHEEL") bytes), $(basename "$SDIST") ($(wc -c < "$SDIST") bytes)"

step "the licence ships in both: the wheel's dist-info/licenses/LICENSE and the sdist's LICENSE"
# Apache-2.0 asks for a copy of the licence with every redistribution; the text must be the
# repository's LICENSE and the metadata must name it.
LICENSE_CHECK='
import sys, tarfile, zipfile
wheel, sdist, version, license_path = sys.argv[1:5]
with open(license_path, "rb") as f:
    want = f.read()
info = "floodgate_client-%s.dist-info/" % version
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    assert info + "licenses/LICENSE" in names, ("no licenses/LICENSE in the wheel", names)
    assert z.read(info + "licenses/LICENSE") == want, "the wheel'"'"'s LICENSE is not the repository'"'"'s"
    metadata = z.read(info + "METADATA").decode()
assert "License-File: LICENSE" in metadata.splitlines(), metadata
assert "License-Expression: Apache-2.0" in metadata.splitlines(), metadata
with tarfile.open(sdist) as t:
    member = "floodgate_client-%s/LICENSE" % version
    names = t.getnames()
    assert member in names, ("no LICENSE at the sdist'"'"'s top", names)
    assert t.extractfile(member).read() == want, "the sdist'"'"'s LICENSE is not the repository'"'"'s"
print("   wheel:", info + "licenses/LICENSE", "(License-File, License-Expression: Apache-2.0); sdist:", member)
'
"$PYTHON" -c "$LICENSE_CHECK" "$WHEEL" "$SDIST" "$VERSION" "$REPO/LICENSE" || fail "the licence is not in the wheel and the sdist"

step "fresh venv: pip install the wheel (no index)"
new_venv "$TMP/venv-wheel"
"$TMP/venv-wheel/bin/python" -m pip install "${PIP_OPTS[@]}" --no-index "$WHEEL"
"$TMP/venv-wheel/bin/python" -m pip check > /dev/null

step "fresh venv: pip install the sdist (pip builds it on its own)"
# As a user's `pip install` does: pip fetches hatchling into an isolated build environment of its
# own, which it cannot hash-check (pip has no hashes for build dependencies). The one path here not
# pinned by SHA-256, on purpose: it is the one users take.
new_venv "$TMP/venv-sdist"
"$TMP/venv-sdist/bin/python" -m pip install "${PIP_OPTS[@]}" "$SDIST"
"$TMP/venv-sdist/bin/python" -m pip check > /dev/null

step "start the agent: $FLOODGATE_BIN (embedded default)"
mkdir -p "$TMP/agent"
AGENT_BIN="$FLOODGATE_BIN"   # the subshell below unsets FLOODGATE_*
SOCK="$TMP/agent/a.sock"
(
  cd "$TMP/agent"
  # The embedded default whatever the caller's environment says (FLOODGATE_REDIS, _RULES, ...).
  for v in $(compgen -e); do case "$v" in FLOODGATE_*) unset "$v" ;; esac; done
  export STATE_DIRECTORY="$TMP/agent" NO_COLOR=1
  exec "$AGENT_BIN" agent --socket "$SOCK" --admin off --rules-listen off \
    --rules-db "sqlite://$TMP/agent/rules.db"
) > "$TMP/agent/log" 2>&1 &
AGENT_PID=$!
for _ in $(seq 1 200); do   # up to 20 s
  [ -S "$SOCK" ] && break
  kill -0 "$AGENT_PID" 2>/dev/null || { cat "$TMP/agent/log" >&2; fail "the agent exited"; }
  sleep 0.1
done
[ -S "$SOCK" ] || { cat "$TMP/agent/log" >&2; fail "no agent socket at $SOCK after 20 s"; }

SMOKE='
import importlib.metadata, os, sys

import floodgate
import floodgate.middleware.asgi
import floodgate.middleware.wsgi
from floodgate import Client

sock, version, expected_files = sys.argv[1], sys.argv[2], sys.argv[3]
where = os.path.realpath(floodgate.__file__)
assert where.startswith(os.path.realpath(sys.prefix) + os.sep), ("not the venv'"'"'s floodgate", where)
assert floodgate.__version__ == version, (floodgate.__version__, version)
assert importlib.metadata.version("floodgate-client") == version
pkg = os.path.dirname(where)
installed = sorted(
    os.path.relpath(os.path.join(d, f), pkg)
    for d, dirs, files in os.walk(pkg)
    for f in files
    if "__pycache__" not in os.path.relpath(d, pkg).split(os.sep)
)
with open(expected_files) as f:
    expected = sorted(f.read().split())
assert installed == expected, ("installed files differ from the tracked ones",
                               sorted(set(installed) ^ set(expected)))
client = Client(sock, timeout=2.0, connect_timeout=5.0)
try:
    d = client.allow("user:1", "api-per-user", 1)
finally:
    client.close()
assert d.allowed and d.from_agent, d
assert d.limit == 100 and d.remaining < 100, d
print("   floodgate-client", version, "from", pkg, ":", len(installed), "files; allow -> allowed,",
      "limit", d.limit, "remaining", d.remaining, "(" + d.origin.value + ")")
'
mkdir -p "$TMP/cwd"
for kind in wheel sdist; do
  step "smoke test: the $kind's install"
  # -I: no cwd, no PYTHONPATH, no user site: only what the venv holds can be imported.
  ( cd "$TMP/cwd" && "$TMP/venv-$kind/bin/python" -I -c "$SMOKE" "$SOCK" "$VERSION" "$TMP/expected-files" ) \
    || fail "smoke test of the $kind's install"
done

step "from the source tree itself: pip install $SDK, python -m build $SDK"
# The build backend runs on the real tree here, where an in-place build (setuptools' build/ and
# src/*.egg-info) would show in the checks below.
new_venv "$TMP/venv-tree"
"$TMP/venv-tree/bin/python" -m pip install "${PIP_OPTS[@]}" "$SDK"
( cd "$TMP/cwd" && "$TMP/venv-tree/bin/python" -I -c '
import sys, floodgate
assert floodgate.__version__ == sys.argv[1], (floodgate.__version__, sys.argv[1])
' "$VERSION" ) || fail "pip install $SDK did not install floodgate-client $VERSION"
"$TMP/build-venv/bin/python" -m build --no-isolation --sdist --wheel --outdir "$TMP/dist-tree" "$SDK" \
  > "$TMP/build-tree.log" 2>&1 || { cat "$TMP/build-tree.log" >&2; fail "python -m build $SDK failed"; }
echo "   pip install and python -m build of the tree: $(cd "$TMP/dist-tree" && echo *)"

step "the source tree is untouched"
AFTER_STATE="$(tree_state)"
AFTER_ARTEFACTS="$(artefacts)"
if [ "$AFTER_STATE" != "$BEFORE_STATE" ]; then
  diff <(echo "$BEFORE_STATE") <(echo "$AFTER_STATE") >&2 || true
  fail "this run changed sdk-python (git status --porcelain --ignored, before < > after)"
fi
DIRTY="$(git_ro -C "$REPO" status --porcelain -- sdk-python)"
if [ -n "$DIRTY" ]; then
  echo "$DIRTY" >&2
  fail "git status --porcelain -- sdk-python is not empty (so before this run too)"
fi
if [ -n "$AFTER_ARTEFACTS" ]; then
  echo "$AFTER_ARTEFACTS" >&2
  [ "$AFTER_ARTEFACTS" = "$BEFORE_ARTEFACTS" ] && echo "(there before this run: an in-tree build left them; remove them)" >&2
  fail "build artefacts under sdk-python"
fi

echo "PASS sdk-python/package-test.sh: $(basename "$WHEEL") and $(basename "$SDIST") built outside the tree," \
  "installed into fresh venvs, allowed by the agent; sdk-python untouched (${SECONDS}s)"
