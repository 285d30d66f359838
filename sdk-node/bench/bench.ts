/**
 * The Node SDK benchmark, every figure from one run of this script:
 *
 * 1. Node SDK vs Rust SDK: `allow("user:N", "bench", 1)` over 10,000 keys at 1 and 16 concurrent
 *    callers on one client, against the same release agent (embedded store, and on Redis), each
 *    measurement a fresh process: `dist/bench/node-sdk.js` and `loadgen sdk`.
 * 2. Node SDK (agent on Redis) vs rate-limiter-flexible (RateLimiterRedis over ioredis) on the same
 *    redis-server, 1 and 16 in flight.
 *
 * Each set runs `--runs` times (order reversed every other run, so neither side always goes first on
 * a warmer machine) and the report quotes medians. Run it under the heavy-work lock:
 *
 *   flock /tmp/fg-heavy.lock node dist/bench/bench.js [--runs 5] [--seconds 3] [--json ../target/bench/node-sdk.json]
 *
 * Binaries: FLOODGATE_RELEASE_BIN (default <repo>/target/release/floodgate) and LOADGEN_BIN (default
 * <repo>/target/release/loadgen; without it the Rust rows are skipped and the report says so).
 */

import { execFile } from "node:child_process";
import * as fs from "node:fs";
import * as path from "node:path";

import { Agent, REPO, RedisServer, tempDir } from "../test/helpers";
import { args, median, type Row } from "./common";

const RULES = `
# Never binding: every check is the admitted path, as in loadgen's SDK baseline.
[[rules]]
id = "bench"
dimension = "user"
limit = 1000000000
windowSeconds = 60
`;

type Impl = "node" | "rust" | "rlf";
type Store = "embedded" | "redis";
interface Result {
  run: number;
  impl: Impl;
  store: Store;
  rows: Row[];
}

function run(cmd: string, argv: string[]): Promise<string> {
  return new Promise((resolve, reject) => {
    execFile(cmd, argv, { maxBuffer: 1 << 20 }, (err, stdout, stderr) => {
      if (err) reject(new Error(`${cmd} ${argv.join(" ")} failed: ${err.message}\n${stderr}`));
      else resolve(stdout);
    });
  });
}

function copyBin(src: string, dir: string): string {
  // A copy: the lead's next cargo build must not swap a binary under a running benchmark.
  const dst = path.join(dir, path.basename(src));
  fs.copyFileSync(src, dst);
  fs.chmodSync(dst, 0o755);
  return dst;
}

async function main(): Promise<void> {
  const a = args();
  const runs = Number(a.get("runs") ?? "5");
  const seconds = a.get("seconds") ?? "3";
  const out = a.get("json") ?? path.join(REPO, "target", "bench", "node-sdk.json");
  const levels = a.get("clients") ?? "1,16";
  const bins = tempDir();
  const floodgate = copyBin(process.env.FLOODGATE_RELEASE_BIN || path.join(REPO, "target", "release", "floodgate"), bins);
  const loadgenSrc = process.env.LOADGEN_BIN || path.join(REPO, "target", "release", "loadgen");
  const loadgen = fs.existsSync(loadgenSrc) ? copyBin(loadgenSrc, bins) : null;
  if (!loadgen) console.log(`no loadgen at ${loadgenSrc}: the Rust SDK baseline is skipped`);

  const redis = await RedisServer.start();
  const agents: Record<Store, Agent> = {
    embedded: await Agent.start({ rules: RULES, bin: floodgate }),
    redis: await Agent.start({ rules: RULES, bin: floodgate, redis: redis.url, patient: false }),
  };
  const tmp = tempDir();
  const results: Result[] = [];
  const retries: { run: number; impl: Impl; store: Store; attempt: number; error: string }[] = [];
  try {
    for (let r = 0; r < runs; r++) {
      const steps: [Impl, Store][] = [
        ["node", "embedded"],
        ["rust", "embedded"],
        ["node", "redis"],
        ["rust", "redis"],
        ["rlf", "redis"],
      ];
      if (r % 2 === 1) steps.reverse();
      for (const [impl, store] of steps) {
        const json = path.join(tmp, `${r}-${impl}-${store}.json`);
        const common = ["--clients", levels, "--seconds", seconds, "--json", json];
        let cmd: [string, string[]];
        if (impl === "node") {
          cmd = [process.execPath, [
            path.join(__dirname, "node-sdk.js"),
            "--socket",
            agents[store].socket,
            "--rule",
            "bench",
            ...common,
          ]];
        } else if (impl === "rust") {
          if (!loadgen) continue;
          cmd = [loadgen, ["sdk", "--socket", agents[store].socket, "--rule", "bench", ...common]];
        } else {
          cmd = [process.execPath, [path.join(__dirname, "rlf.js"), "--redis", redis.url, ...common]];
        }
        // `loadgen sdk` stops at the first answer its 10 ms timeout turned into a fail-open one (a
        // stall of this shared machine): such a measurement is taken again, up to 3 attempts, and
        // the retries are counted in the report.
        let stdout: string | null = null;
        for (let attempt = 1; attempt <= 3 && stdout === null; attempt++) {
          try {
            stdout = await run(cmd[0], cmd[1]);
          } catch (e) {
            retries.push({ run: r, impl, store, attempt, error: String(e).split("\n").find((l) => l.startsWith("Error:")) ?? String(e) });
            console.log(`run ${r + 1}/${runs} ${impl} ${store}: attempt ${attempt} failed: ${retries[retries.length - 1].error}`);
          }
        }
        if (stdout === null) continue;
        process.stdout.write(`run ${r + 1}/${runs} ${store.padEnd(8)} ${stdout}`);
        results.push({ run: r, impl, store, rows: JSON.parse(fs.readFileSync(json, "utf8")).results });
      }
    }
  } finally {
    await agents.embedded.stop();
    await agents.redis.stop();
    await redis.stop();
  }

  // Medians over runs, per implementation, store and concurrency.
  const pick = (impl: Impl, store: Store, clients: number, f: keyof Row) =>
    results
      .filter((x) => x.impl === impl && x.store === store)
      .map((x) => x.rows.find((row) => row.clients === clients)?.[f] as number)
      .filter((v) => typeof v === "number");
  /** Median over runs of the same-run ratio a/b. */
  const ratio = (ia: Impl, ib: Impl, store: Store, clients: number, f: keyof Row) => {
    const xs: number[] = [];
    for (let r = 0; r < runs; r++) {
      const va = results.find((x) => x.run === r && x.impl === ia && x.store === store)?.rows.find((w) => w.clients === clients);
      const vb = results.find((x) => x.run === r && x.impl === ib && x.store === store)?.rows.find((w) => w.clients === clients);
      if (va && vb) xs.push((va[f] as number) / (vb[f] as number));
    }
    return median(xs);
  };
  const summary: Record<string, unknown>[] = [];
  const lines: string[] = [
    `Medians of ${runs} runs, ${seconds} s measured per level after ${Number(seconds) / 4} s of warm-up.`,
    "",
    "| store | client | in flight | p50 µs | p99 µs | checks/s | degraded (all runs) |",
    "|---|---|---:|---:|---:|---:|---:|",
  ];
  const clientLevels = levels.split(",").map(Number);
  for (const [impl, store] of [
    ["node", "embedded"],
    ["rust", "embedded"],
    ["node", "redis"],
    ["rust", "redis"],
    ["rlf", "redis"],
  ] as [Impl, Store][]) {
    for (const c of clientLevels) {
      const p50 = median(pick(impl, store, c, "p50_us"));
      const p99 = median(pick(impl, store, c, "p99_us"));
      const cps = median(pick(impl, store, c, "checks_per_s"));
      if (Number.isNaN(cps)) continue;
      const degraded = pick(impl, store, c, "degraded").reduce((s, x) => s + x, 0);
      const sources: Record<string, number> = {};
      for (const x of results.filter((y) => y.impl === impl && y.store === store)) {
        for (const [k, v] of Object.entries(x.rows.find((w) => w.clients === c)?.sources ?? {})) {
          sources[k] = (sources[k] ?? 0) + v;
        }
      }
      summary.push({ impl, store, clients: c, p50_us: p50, p99_us: p99, checks_per_s: cps, degraded, sources });
      const name = { node: "Node SDK", rust: "Rust SDK", rlf: "rate-limiter-flexible" }[impl];
      const where = impl === "rlf" ? "redis (direct)" : store === "redis" ? "agent on redis" : "agent, embedded";
      lines.push(
        `| ${where} | ${name} | ${c} | ${p50.toFixed(1)} | ${p99.toFixed(1)} | ${cps.toFixed(0)} | ${impl === "rust" ? "n/a (loadgen fails on any)" : degraded} |`,
      );
    }
  }
  const ratios: Record<string, unknown>[] = [];
  lines.push("", "Same-run ratios (median over runs):", "", "| comparison | in flight | p50 | p99 | checks/s |", "|---|---:|---:|---:|---:|");
  const comparisons: [Impl, Impl, Store, string][] = [
    ["node", "rust", "embedded", "Node / Rust SDK, agent embedded"],
    ["node", "rust", "redis", "Node / Rust SDK, agent on Redis"],
    ["node", "rlf", "redis", "Node SDK (agent on Redis) / rate-limiter-flexible"],
  ];
  for (const [ia, ib, store, label] of comparisons) {
    for (const c of clientLevels) {
      const p50 = ratio(ia, ib, store, c, "p50_us");
      const p99 = ratio(ia, ib, store, c, "p99_us");
      const cps = ratio(ia, ib, store, c, "checks_per_s");
      if (Number.isNaN(cps)) continue;
      ratios.push({ a: ia, b: ib, store, clients: c, p50, p99, checks_per_s: cps });
      lines.push(`| ${label} | ${c} | ${p50.toFixed(2)}× | ${p99.toFixed(2)}× | ${cps.toFixed(2)}× |`);
    }
  }
  if (!loadgen) lines.push("", `Rust SDK rows not run: no loadgen at ${loadgenSrc}.`);
  lines.push("", `Measurements taken again after a failed attempt: ${retries.length}${retries.length ? ` (${retries.map((x) => `${x.impl}/${x.store} run ${x.run + 1}`).join(", ")})` : ""}.`);
  console.log(`\n${lines.join("\n")}`);
  fs.mkdirSync(path.dirname(path.resolve(out)), { recursive: true });
  fs.writeFileSync(out, JSON.stringify({ runs, seconds: Number(seconds), summary, ratios, retries, results }, null, 2));
  console.log(`\nwrote ${out}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
