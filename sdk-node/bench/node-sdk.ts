/**
 * The Node SDK's `allow` against an agent already running at `--socket`, the same workload as
 * `loadgen sdk`: `allow("user:N", rule, 1)` over 10,000 keys from 1 and 16 concurrent callers (promises
 * in flight on one client), exact p50/p99 and checks/s.
 *
 *   node dist/bench/node-sdk.js --socket /tmp/floodgate.sock [--rule bench] [--clients 1,16] [--seconds 3] [--json OUT]
 */

import { Client } from "../src/index";
import { args, closedLoop, writeReport, type Row } from "./common";

async function main(): Promise<void> {
  const a = args();
  const socket = a.get("socket");
  if (!socket) throw new Error("--socket PATH is required");
  const rule = a.get("rule") ?? "bench";
  const levels = (a.get("clients") ?? "1,16").split(",").map(Number);
  const seconds = Number(a.get("seconds") ?? "3");
  // The default configuration (10 ms timeout, fail open), as a service would run it.
  const client = await Client.connect(socket);
  if (!client.isConnected()) throw new Error(`no agent at ${socket}`);
  const rows: Row[] = [];
  for (const clients of levels) {
    const row = await closedLoop(clients, seconds, async (user) => {
      const d = await client.allow(`user:${user}`, rule, 1);
      return d.origin.kind === "agent" ? d.origin.source : null;
    });
    rows.push(row);
    console.log(
      `node sdk  clients ${String(clients).padStart(3)}  p50 ${row.p50_us.toFixed(1).padStart(8)} µs  p99 ${row.p99_us
        .toFixed(1)
        .padStart(8)} µs  ${row.checks_per_s.toFixed(0).padStart(9)} checks/s  degraded ${row.degraded}`,
    );
  }
  client.close();
  if (a.has("json")) writeReport(a.get("json")!, rows);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
