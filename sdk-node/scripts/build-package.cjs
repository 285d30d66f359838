// The package's build (`npm run build:package`; npm runs it as `prepack` before `npm pack` and
// `npm publish`, never when an app installs the package): compiles src/ alone (tsconfig.build.json)
// into dist/src, the only thing the package ships, after removing what an earlier build left there (a
// source since deleted must not be packed). Then, for each entry of package.json's `exports`, the
// ESM side: `X.mjs` and its declarations `X.d.mts`, each re-exporting the CommonJS build `X.js`, so
// that `import` and `require` get the same module instance (one client state, one `instanceof`
// class) rather than two copies. Last, every path the exports map names must exist. TypeScript is a
// devDependency, and npm does not install a folder dependency's devDependencies: when it is
// missing, this says what to do rather than "tsc: not found".
"use strict";
const { spawnSync } = require("node:child_process");
const fs = require("node:fs");
const path = require("node:path");

const root = path.join(__dirname, "..");
const fail = (message) => {
  console.error(`@floodgate/client: ${message}`);
  process.exit(1);
};

let tsc;
try {
  tsc = require.resolve("typescript/bin/tsc", { paths: [root] });
} catch {
  fail(
    "building the package needs its devDependencies (TypeScript): run `npm ci` in sdk-node/ " +
      "first, or install a tarball made by `npm pack` there (see sdk-node/README.md)",
  );
}
fs.rmSync(path.join(root, "dist", "src"), { recursive: true, force: true });
const r = spawnSync(process.execPath, [tsc, "-p", path.join(root, "tsconfig.build.json")], {
  cwd: root,
  stdio: "inherit",
});
if (r.status !== 0) process.exit(r.status ?? 1);

// An entry is { import: { types: X.d.mts, default: X.mjs }, require: { types: X.d.ts, default: X.js } }.
const pkg = JSON.parse(fs.readFileSync(path.join(root, "package.json"), "utf8"));
const targets = [];
for (const [subpath, entry] of Object.entries(pkg.exports)) {
  if (typeof entry === "string") {
    targets.push(entry);
    continue;
  }
  const cjs = entry.require.default;
  const base = path.posix.basename(cjs, ".js");
  const dir = path.posix.dirname(cjs);
  const want = {
    [entry.import.default]: `${dir}/${base}.mjs`,
    [entry.import.types]: `${dir}/${base}.d.mts`,
    [entry.require.types]: `${dir}/${base}.d.ts`,
  };
  for (const [got, expected] of Object.entries(want)) {
    if (got !== expected) fail(`exports["${subpath}"] names ${got}; the build writes ${expected}`);
  }
  // A CommonJS module's `default`, imported from ESM, is its module.exports: re-exported so that
  // `import fg from "@floodgate/client"` reads as it did before the exports map.
  const body = `export * from "./${base}.js";\nexport { default } from "./${base}.js";\n`;
  const header = `// ${subpath} for ESM: the CommonJS build ./${base}.js, one module instance for both.\n`;
  fs.writeFileSync(path.join(root, entry.import.default), header + body);
  fs.writeFileSync(path.join(root, entry.import.types), header + body);
  targets.push(cjs, entry.import.default, entry.import.types, entry.require.types);
}
const missing = targets.filter((t) => !fs.existsSync(path.join(root, t)));
if (missing.length > 0) fail(`package.json's exports name files the build did not write: ${missing.join(", ")}`);
