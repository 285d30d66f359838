/**
 * rate-limiter-flexible's RateLimiterRedis (over ioredis) on a redis-server, the same closed loop as
 * the Node SDK benchmark: `consume("user:N", 1)` over 10,000 keys, 1 and 16 in flight (or
 * `--clients`), on one ioredis connection; each row has this process's CPU per call (`loadgen
 * versus` sets it beside the agent's).
 *
 *   node dist/bench/rlf.js --redis redis://127.0.0.1:PORT [--clients 1,16] [--seconds 3] [--json OUT]
 */

import Redis from "ioredis";
import { RateLimiterRedis } from "rate-limiter-flexible";

import { args, closedLoop, writeReport, type Row } from "./common";

async function main(): Promise<void> {
  const a = args();
  const url = a.get("redis");
  if (!url) throw new Error("--redis URL is required");
  const levels = (a.get("clients") ?? "1,16").split(",").map(Number);
  const seconds = Number(a.get("seconds") ?? "3");
  const redis = new Redis(url, { enableOfflineQueue: true, maxRetriesPerRequest: 1 });
  await redis.ping();
  // The limit never binds (as the agent's `bench` rule): every call is the admitted path.
  const limiter = new RateLimiterRedis({ storeClient: redis, keyPrefix: `rlf-${process.pid}`, points: 1e9, duration: 60 });
  const rows: Row[] = [];
  for (const clients of levels) {
    const row = await closedLoop(clients, seconds, async (user) => {
      try {
        await limiter.consume(`user:${user}`, 1);
        return "redis";
      } catch {
        return null;
      }
    });
    rows.push(row);
    console.log(
      `rlf       clients ${String(clients).padStart(3)}  p50 ${row.p50_us.toFixed(1).padStart(8)} µs  p99 ${row.p99_us
        .toFixed(1)
        .padStart(8)} µs  ${row.checks_per_s.toFixed(0).padStart(9)} checks/s  errors ${row.degraded}  cpu ${(row.cpu_us_per_check ?? 0).toFixed(1)} µs/call`,
    );
  }
  redis.disconnect();
  if (a.has("json")) writeReport(a.get("json")!, rows);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
