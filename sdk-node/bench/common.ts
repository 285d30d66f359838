/** What the benchmark scripts share: arguments, exact percentiles, the closed loop, the report row. */

import * as fs from "node:fs";
import * as path from "node:path";

/** `--name value` arguments. */
export function args(): Map<string, string> {
  const m = new Map<string, string>();
  const a = process.argv.slice(2);
  for (let i = 0; i < a.length; i++) {
    if (a[i].startsWith("--")) {
      const next = a[i + 1];
      if (next === undefined || next.startsWith("--")) m.set(a[i].slice(2), "true");
      else m.set(a[i].slice(2), a[++i]);
    }
  }
  return m;
}

/** Exact nearest-rank percentile of sorted values: the smallest value with at least q of them at or below. */
export function percentile(sorted: Float64Array, q: number): number {
  if (sorted.length === 0) return NaN;
  const rank = Math.max(1, Math.ceil(q * sorted.length));
  return sorted[Math.min(sorted.length, rank) - 1];
}

/** The median of some numbers (mean of the middle two for an even count). */
export function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  if (s.length === 0) return NaN;
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** One concurrency level, as `loadgen sdk` reports it (µs and checks per second). */
export interface Row {
  clients: number;
  p50_us: number;
  p99_us: number;
  checks_per_s: number;
  /** Calls not answered as asked (the SDK's fail policy; rate-limiter-flexible errors). */
  degraded: number;
  /** Answers by source, where the limiter says (the agent's `fallback` means Redis was late). */
  sources?: Record<string, number>;
  /** This process's CPU (user + system) per measured call, in µs. */
  cpu_us_per_check?: number;
}

/** A growable array of latencies in µs. */
class Samples {
  private a = new Float64Array(1 << 16);
  n = 0;
  push(v: number): void {
    if (this.n === this.a.length) {
      const b = new Float64Array(this.a.length * 2);
      b.set(this.a);
      this.a = b;
    }
    this.a[this.n++] = v;
  }
  sorted(): Float64Array {
    return this.a.slice(0, this.n).sort();
  }
}

/**
 * The closed loop of `loadgen sdk`: `clients` concurrent callers (promises in flight on one client),
 * each calling `request(user)` for user = c·7919, c·7919+1, … modulo 10,000, for a quarter of
 * `seconds` of warm-up and then `seconds` measured. A call counts when it ends after the warm-up;
 * checks/s is the measured count over `seconds`.
 */
export async function closedLoop(
  clients: number,
  seconds: number,
  request: (user: number) => Promise<string | null>,
): Promise<Row> {
  const samples = new Samples();
  const sources: Record<string, number> = {};
  let degraded = 0;
  const start = performance.now();
  const warmup = (seconds * 1000) / 4;
  const end = warmup + seconds * 1000;
  // The process's CPU over the measured part only: read when the warm-up ends and when it is over.
  let cpuAtWarmup = process.cpuUsage();
  const warmed = setTimeout(() => {
    cpuAtWarmup = process.cpuUsage();
  }, warmup);
  const caller = async (c: number) => {
    let user = c * 7919;
    while (performance.now() - start < end) {
      const t = performance.now();
      const source = await request(user % 10_000);
      const done = performance.now();
      user++;
      if (done - start >= warmup) {
        samples.push((done - t) * 1000);
        if (source === null) degraded++;
        else sources[source] = (sources[source] ?? 0) + 1;
      }
    }
  };
  await Promise.all(Array.from({ length: clients }, (_, c) => caller(c)));
  clearTimeout(warmed);
  const cpu = process.cpuUsage(cpuAtWarmup);
  const s = samples.sorted();
  return {
    clients,
    p50_us: percentile(s, 0.5),
    p99_us: percentile(s, 0.99),
    checks_per_s: s.length / seconds,
    degraded,
    sources,
    cpu_us_per_check: (cpu.user + cpu.system) / Math.max(1, s.length),
  };
}

/** Writes `{"results": rows}` to `file`, making its folder. */
export function writeReport(file: string, rows: Row[]): void {
  fs.mkdirSync(path.dirname(path.resolve(file)), { recursive: true });
  fs.writeFileSync(file, JSON.stringify({ results: rows }, null, 2));
}
