// The package's build, run by npm as `prepare`: before `npm pack` / `npm publish` pack the
// package, and when an app installs this folder (`npm install ./sdk-node`). It compiles src/ alone
// (tsconfig.build.json) into dist/src, the only thing the package ships, after removing what an
// earlier build left there (a source since deleted must not be packed). TypeScript is a
// devDependency, and npm does not install a folder dependency's devDependencies: when it is
// missing, this says what to do rather than "tsc: not found".
"use strict";
const { spawnSync } = require("node:child_process");
const fs = require("node:fs");
const path = require("node:path");

const root = path.join(__dirname, "..");
let tsc;
try {
  tsc = require.resolve("typescript/bin/tsc", { paths: [root] });
} catch {
  console.error(
    "@floodgate/client: building the package needs its devDependencies (TypeScript): run `npm ci` " +
      "in sdk-node/ first, or install a tarball made by `npm pack` there (see sdk-node/README.md)",
  );
  process.exit(1);
}
fs.rmSync(path.join(root, "dist", "src"), { recursive: true, force: true });
const r = spawnSync(process.execPath, [tsc, "-p", path.join(root, "tsconfig.build.json")], {
  cwd: root,
  stdio: "inherit",
});
process.exit(r.status ?? 1);
