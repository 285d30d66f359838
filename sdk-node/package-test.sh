#!/usr/bin/env bash
# The Node SDK as an app gets it: packs the package with `npm pack` from a copy of sdk-node's
# tracked files (its `prepack` builds dist/src there), checks the tarball holds the repository's
# LICENSE and nothing but it, package.json, README.md and dist/src, that the packed package.json runs
# nothing at install (no preinstall, install, postinstall or prepare script) and that every file its
# `exports` map names is packed. Then installs it into a fresh project (`npm init -y`), and there
# `require`s from CommonJS and `import`s from ESM the root and every subpath of the exports map
# (`@floodgate/client/express`, ...: the same objects either way, a path outside the map refused),
# and type-checks a .cts and a .mts against its declarations (nodenext), and a .ts as
# `"moduleResolution": "node10"` reads them (typesVersions); then builds the copy
# (`npm run build:package`) and installs its folder into a second fresh project (`npm install
# <folder>`: npm links it and runs nothing). Each import of the root asks a real agent (started here,
# embedded store, the built-in example rules) for `allow("user:1", "api-per-user", 1)` and needs an
# allowed decision from the agent itself. The real sdk-node tree is only read: the script fails if
# anything in it changed. Needs Node >= 18 and npm (the copy's `npm ci` reads the registry or npm's
# cache). The agent binary: $FLOODGATE_BIN, else <repo>/target/debug/floodgate (cargo build --bin
# floodgate).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(git -C "$here" rev-parse --show-toplevel)"
bin="${FLOODGATE_BIN:-$repo/target/debug/floodgate}"
if [ ! -x "$bin" ]; then
  echo "sdk-node/package-test.sh: no floodgate binary at $bin (cargo build --bin floodgate, or set FLOODGATE_BIN)" >&2
  exit 1
fi

fail() {
  echo "sdk-node/package-test.sh: FAIL: $*" >&2
  exit 1
}
step() { echo "== $* ($((SECONDS))s)"; }

work="$(mktemp -d "${TMPDIR:-/tmp}/floodgate-sdk-node-package.XXXXXX")"
agent_pid=""
cleanup() {
  if [ -n "$agent_pid" ]; then
    kill "$agent_pid" 2>/dev/null || true
    wait "$agent_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# What the real tree looks like now, ignored files (dist/, node_modules/) included, and a stamp
# that any file or directory written under it afterwards would be newer than.
status_before="$(git -C "$here" status --porcelain --ignored -- .)"
touch "$work/stamp"

step "copying sdk-node's tracked files to $work/sdk"
mkdir "$work/sdk"
(
  cd "$here"
  git ls-files -z -- . | while IFS= read -r -d '' f; do
    # A tracked file deleted in the working tree is not part of what is being tested.
    if [ -e "$f" ]; then cp --parents -- "$f" "$work/sdk/"; fi
  done
)
[ -f "$work/sdk/package.json" ] || fail "the copy has no package.json"
[ ! -e "$work/sdk/dist" ] || fail "the copy has a dist/ before any build"

step "npm ci in the copy (dependencies only)"
cd "$work/sdk"
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
[ ! -e dist ] || fail "npm ci --ignore-scripts built dist/"

step "npm pack (prepack builds dist/src)"
npm pack --pack-destination "$work" --loglevel=error >"$work/pack.log"
shopt -s nullglob
tarballs=("$work"/floodgate-client-*.tgz)
shopt -u nullglob
[ "${#tarballs[@]}" -eq 1 ] || fail "expected one floodgate-client-*.tgz, got ${#tarballs[@]}: $(cat "$work/pack.log")"
tgz="${tarballs[0]}"
tar -tzf "$tgz" | sort >"$work/contents"
for f in package/package.json package/README.md package/LICENSE package/dist/src/index.js package/dist/src/index.d.ts; do
  grep -qx "$f" "$work/contents" || fail "$f is not in the tarball"
done
for src in src/*.ts; do
  base="$(basename "$src" .ts)"
  grep -qx "package/dist/src/$base.js" "$work/contents" || fail "package/dist/src/$base.js (from $src) is not in the tarball"
  grep -qx "package/dist/src/$base.d.ts" "$work/contents" || fail "package/dist/src/$base.d.ts is not in the tarball"
done
if grep -Ev '^package/(package\.json|README\.md|LICENSE|dist/src/[A-Za-z0-9_-]+\.(js|js\.map|d\.ts|mjs|d\.mts))$' "$work/contents"; then
  fail "the tarball holds more than package.json, README.md, LICENSE and dist/src (above)"
fi
# Apache-2.0 asks for a copy of the licence with every redistribution: the repository's text.
tar -xzOf "$tgz" package/LICENSE | cmp -s - "$repo/LICENSE" || fail "the tarball's LICENSE is not the repository's"
# What an install of the tarball runs (npm 11 warns of a packed `prepare`): nothing. And the exports
# map names only packed files: a subpath whose file is missing fails only when an app imports it.
tar -xzOf "$tgz" package/package.json >"$work/packed-package.json"
node - "$work/packed-package.json" "$work/contents" <<'EOF' || fail "the packed package.json (above)"
const fs = require("node:fs");
const pkg = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const packed = new Set(fs.readFileSync(process.argv[3], "utf8").split("\n"));
const problems = [];
const runsAtInstall = ["preinstall", "install", "postinstall", "prepare"].filter((s) => s in (pkg.scripts ?? {}));
if (runsAtInstall.length > 0) problems.push(`scripts an install runs: ${runsAtInstall.join(", ")}`);
if (typeof pkg.exports !== "object" || !pkg.exports["."] || !pkg.exports["./express"]) {
  problems.push("no exports map with . and ./express");
}
const targets = (v) => (typeof v === "string" ? [v] : Object.values(v).flatMap(targets));
for (const [subpath, entry] of Object.entries(pkg.exports ?? {})) {
  if (typeof entry !== "string" && !(entry.import && entry.require)) problems.push(`${subpath}: not both import and require`);
  for (const t of targets(entry)) {
    if (!packed.has(`package/${t.replace(/^\.\//, "")}`)) problems.push(`${subpath}: ${t} is not in the tarball`);
  }
}
if (problems.length > 0) {
  console.error(problems.join("\n"));
  process.exit(1);
}
const subpaths = Object.keys(pkg.exports).filter((s) => s !== "./package.json");
console.log(`exports: ${subpaths.join(", ")} (import and require each); scripts: ${Object.keys(pkg.scripts).join(", ")}`);
EOF
echo "$(basename "$tgz"): $(wc -l <"$work/contents") files"

step "starting the agent"
mkdir "$work/agent"
sock="$work/agent/a.sock"
(
  # The agent reads FLOODGATE_* variables as its flags: none of the caller's may change it.
  for v in $(compgen -e); do
    case "$v" in FLOODGATE_*) unset "$v" ;; esac
  done
  export STATE_DIRECTORY="$work/agent" NO_COLOR=1
  exec "$bin" agent --socket "$sock" --admin off --rules-listen off --log info
) >"$work/agent/log" 2>&1 &
agent_pid=$!
ready=""
for _ in $(seq 1 150); do
  kill -0 "$agent_pid" 2>/dev/null || fail "the agent exited; its log:
$(cat "$work/agent/log")"
  if [ -S "$sock" ] && grep -q "rules loaded" "$work/agent/log"; then
    ready=1
    break
  fi
  sleep 0.1
done
[ -n "$ready" ] || fail "the agent was not ready within 15 s; its log:
$(cat "$work/agent/log")"
grep -q "api-per-user" "$work/agent/log" || fail "the agent's rules have no api-per-user; its log:
$(cat "$work/agent/log")"

# The smoke tests, written once and run in each fresh project. A decision that the SDK made alone
# (fail-open while the agent is unreachable) is also "allowed": the origin must be the agent.
cat >"$work/smoke.cjs" <<'EOF'
"use strict";
const path = require("node:path");
const fg = require("@floodgate/client");
// Where the install put it (never the real sdk-node tree): the project's node_modules for the
// tarball, the copy's folder (the link's target) for the folder install.
const where = require.resolve("@floodgate/client");
if (!where.startsWith(path.resolve(process.env.EXPECT_UNDER) + path.sep)) {
  throw new Error(`@floodgate/client resolved to ${where}, not under ${process.env.EXPECT_UNDER}`);
}
if (typeof fg.Client !== "function") throw new Error("require: no Client export");
// Every subpath of the exports map: loadable, and what the root exports of it is the same object.
const { exports: map } = require("@floodgate/client/package.json");
for (const subpath of Object.keys(map)) {
  if (subpath === "." || subpath === "./package.json") continue;
  const name = `@floodgate/client/${subpath.slice(2)}`;
  const mod = require(name);
  const keys = Object.keys(mod);
  if (keys.length === 0) throw new Error(`require(${name}): no exports`);
  for (const k of keys) {
    if (k in fg && fg[k] !== mod[k]) throw new Error(`require(${name}).${k} is not the root's ${k}`);
  }
}
if (typeof require("@floodgate/client/express").floodgateExpress !== "function") {
  throw new Error("require: no floodgateExpress in @floodgate/client/express");
}
// Outside the map, nothing: the build's layout is not an interface.
try {
  require("@floodgate/client/dist/src/http.js");
  throw new Error("@floodgate/client/dist/src/http.js was importable");
} catch (e) {
  if (e.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED") throw e;
}
(async () => {
  const client = await fg.Client.connect(process.env.SOCK, { timeoutMs: 5000, connectTimeoutMs: 5000 });
  try {
    const d = await client.allow("user:1", "api-per-user", 1);
    if (!d.allowed || d.origin.kind !== "agent" || d.limit !== 100) {
      throw new Error(`unexpected decision: ${JSON.stringify(d)}`);
    }
    console.log(`cjs: allowed by the agent (source ${d.origin.source}, ${d.remaining}/${d.limit} left)`);
  } finally {
    client.close();
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
EOF
cat >"$work/smoke.mjs" <<'EOF'
import { Client } from "@floodgate/client";
import * as ns from "@floodgate/client";
import { createRequire } from "node:module";

// Node's CommonJS named-export detection must give ESM every export `require` sees, and the same
// objects (one module instance, not a second copy).
const cjsRequire = createRequire(import.meta.url);
const cjs = cjsRequire("@floodgate/client");
const missing = Object.keys(cjs).filter((k) => k !== "__esModule" && !(k in ns));
if (missing.length > 0) throw new Error(`not importable by name from ESM: ${missing.join(", ")}`);
if (Client !== cjs.Client || ns.default !== cjs) throw new Error("ESM and CommonJS see different modules");
// The same of every subpath: its ESM entry re-exports the CommonJS module, one instance for both.
const { exports: map } = cjsRequire("@floodgate/client/package.json");
for (const subpath of Object.keys(map)) {
  if (subpath === "." || subpath === "./package.json") continue;
  const name = `@floodgate/client/${subpath.slice(2)}`;
  const esm = await import(name);
  const cjsMod = cjsRequire(name);
  const differ = Object.keys(cjsMod).filter((k) => k !== "__esModule" && esm[k] !== cjsMod[k]);
  if (differ.length > 0 || esm.default !== cjsMod) throw new Error(`import(${name}) differs from require: ${differ.join(", ")}`);
}
const { floodgateExpress } = await import("@floodgate/client/express");
if (typeof floodgateExpress !== "function" || floodgateExpress !== ns.floodgateExpress) {
  throw new Error("import: floodgateExpress of @floodgate/client/express is not the root's");
}
const client = await Client.connect(process.env.SOCK, { timeoutMs: 5000, connectTimeoutMs: 5000 });
try {
  const d = await client.allow("user:1", "api-per-user", 1);
  if (!d.allowed || d.origin.kind !== "agent" || d.limit !== 100) {
    throw new Error(`unexpected decision: ${JSON.stringify(d)}`);
  }
  console.log(`esm: allowed by the agent (source ${d.origin.source}, ${d.remaining}/${d.limit} left)`);
} finally {
  client.close();
}
EOF
# Type-only: the shipped declarations, read as a TypeScript app of either module kind reads them.
cat >"$work/types.cts" <<'EOF'
import { Client, type Decision } from "@floodgate/client";
import { floodgateExpress, type ExpressMiddleware } from "@floodgate/client/express";
import { floodgateFastifyHook, type FastifyHook } from "@floodgate/client/fastify";
import { VERSION } from "@floodgate/client/protocol";
export async function check(path: string): Promise<boolean> {
  const client: Client = await Client.connect(path, { timeoutMs: 5 });
  const d: Decision = await client.allow("user:1", "api-per-user", 1);
  const middleware: ExpressMiddleware = floodgateExpress(client, { costs: { "/api/search": 5 } });
  const hook: FastifyHook = floodgateFastifyHook(client);
  const version: number = VERSION;
  void [middleware, hook, version];
  client.close();
  return d.allowed;
}
EOF
cp "$work/types.cts" "$work/types.mts"
cp "$work/types.cts" "$work/types-node10.ts"

smoke() { # <the directory the package must resolve under>
  cp "$work/smoke.cjs" "$work/smoke.mjs" .
  SOCK="$sock" EXPECT_UNDER="$1" node smoke.cjs
  SOCK="$sock" node smoke.mjs
}

step "a fresh project installs the tarball"
mkdir "$work/app" && cd "$work/app"
npm init -y >/dev/null
npm install --no-audit --no-fund --loglevel=error "$tgz"
[ -d node_modules/@floodgate/client ] && [ ! -L node_modules/@floodgate/client ] ||
  fail "node_modules/@floodgate/client is not an installed copy"
node -e 'const d = require("./package.json").dependencies; if (!/^file:.*\.tgz$/.test(d["@floodgate/client"])) { console.error(d); process.exit(1); }' ||
  fail "package.json does not depend on the tarball"
smoke "$work/app/node_modules"
cp "$work/types.cts" "$work/types.mts" .
"$work/sdk/node_modules/.bin/tsc" --noEmit --strict --target es2022 --module nodenext --moduleResolution nodenext \
  --typeRoots "$work/sdk/node_modules/@types" --types node types.cts types.mts ||
  fail "the package's declarations do not type-check from .cts and .mts"
cp "$work/types-node10.ts" .
"$work/sdk/node_modules/.bin/tsc" --noEmit --strict --target es2022 --module commonjs --moduleResolution node10 \
  --typeRoots "$work/sdk/node_modules/@types" --types node types-node10.ts ||
  fail "the package's declarations do not type-check as moduleResolution node10 reads them"
echo "types: .cts and .mts (nodenext) and .ts (node10) type-check against the package's declarations"

step "a fresh project installs the folder, built first (npm run build:package; npm install <folder>: linked)"
rm -rf "$work/sdk/dist"
(cd "$work/sdk" && npm run --silent build:package)
[ -f "$work/sdk/dist/src/index.mjs" ] || fail "npm run build:package did not build dist/src"
mkdir "$work/app-folder" && cd "$work/app-folder"
npm init -y >/dev/null
npm install --no-audit --no-fund --loglevel=error "$work/sdk"
[ -L node_modules/@floodgate/client ] || fail "node_modules/@floodgate/client is not a link to the folder"
smoke "$work/sdk"

step "the real sdk-node tree"
status_after="$(git -C "$here" status --porcelain --ignored -- .)"
[ "$status_before" = "$status_after" ] || fail "git status of sdk-node changed:
before:
$status_before
after:
$status_after"
changed="$(find "$here" -newer "$work/stamp" -print -quit)"
[ -z "$changed" ] || fail "written under sdk-node while the script ran: $changed"

echo "PASS sdk-node/package-test.sh: npm pack, tarball and folder installs, CommonJS + ESM + types against a real agent (${SECONDS}s)"
