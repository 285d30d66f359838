/**
 * Test support: real `floodgate agent` and `redis-server` processes on temporary sockets and free
 * loopback ports, polling with deadlines, and a fake agent for malformed answers.
 */

import { spawn, type ChildProcess } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";

/** The repository root (tests run from sdk-node/dist/test). */
export const REPO = path.resolve(__dirname, "..", "..", "..");

/** The agent binary: `FLOODGATE_BIN`, else `<repo>/target/debug/floodgate`. */
export function floodgateBin(): string {
  const bin = process.env.FLOODGATE_BIN || path.join(REPO, "target", "debug", "floodgate");
  if (!fs.existsSync(bin)) {
    throw new Error(`no floodgate binary at ${bin}: run \`cargo build --bin floodgate\` or set FLOODGATE_BIN`);
  }
  return bin;
}

const children = new Set<ChildProcess>();
const dirs = new Set<string>();
process.on("exit", () => {
  for (const c of children) {
    try {
      if (c.exitCode === null && c.signalCode === null) {
        c.kill("SIGCONT");
        c.kill("SIGKILL");
      }
    } catch {
      // already gone
    }
  }
  for (const d of dirs) fs.rmSync(d, { recursive: true, force: true });
});

/** A fresh temporary directory, removed when the process exits. */
export function tempDir(): string {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "fg-node-"));
  dirs.add(dir);
  return dir;
}

/** Waits `ms`. Only for pacing polls; no test waits a fixed time for an event. */
export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

/**
 * Polls `probe` every 5 ms until it returns something other than undefined/false/null, and returns
 * that; throws after `timeoutMs`, naming what was awaited.
 */
export async function eventually<T>(
  what: string,
  timeoutMs: number,
  probe: () => T | undefined | null | false | Promise<T | undefined | null | false>,
): Promise<T> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const v = await probe();
    if (v !== undefined && v !== null && v !== false) return v;
    if (performance.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(5);
  }
}

/** A free TCP port on 127.0.0.1. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const port = (srv.address() as net.AddressInfo).port;
      srv.close(() => resolve(port));
    });
  });
}

function connects(socketPath: string): Promise<boolean> {
  return new Promise((resolve) => {
    const s = net.createConnection({ path: socketPath });
    s.once("connect", () => {
      s.destroy();
      resolve(true);
    });
    s.once("error", () => resolve(false));
  });
}

/** How to start an agent. */
export interface AgentOptions {
  /** Rules file content (TOML). */
  rules: string;
  /** Redis URL (default: the embedded store). */
  redis?: string;
  /** Socket path (default: a fresh one in the agent's temp dir). */
  socket?: string;
  /** Extra arguments. */
  args?: string[];
  /**
   * On Redis, the tests' patient store timeout (1 s) and no events (default true); false keeps the
   * agent's own defaults (benchmarks).
   */
  patient?: boolean;
  /** The binary (default: {@link floodgateBin}). */
  bin?: string;
}

/** A running `floodgate agent`. */
export class Agent {
  readonly socket: string;
  readonly dir: string;
  private child: ChildProcess | null = null;
  private readonly logPath: string;

  constructor(private readonly opts: AgentOptions) {
    this.dir = tempDir();
    this.socket = opts.socket ?? path.join(this.dir, "agent.sock");
    this.logPath = path.join(this.dir, "agent.log");
    fs.writeFileSync(path.join(this.dir, "rules.toml"), opts.rules);
  }

  /** Starts an agent and waits until it is ready. */
  static async start(opts: AgentOptions): Promise<Agent> {
    const a = new Agent(opts);
    await a.restart();
    return a;
  }

  /** Spawns the process (again) on the same socket and rules, and waits until it is ready. */
  async restart(): Promise<void> {
    const args = [
      "agent",
      "--socket",
      this.socket,
      "--admin",
      "off",
      "--rules",
      path.join(this.dir, "rules.toml"),
      "--log",
      "info",
    ];
    if (this.opts.redis && this.opts.patient === false) args.push("--redis", this.opts.redis);
    else if (this.opts.redis) {
      // A patient store timeout: tests check figures, and a 5 ms timeout on a loaded 2-core machine
      // would turn some answers into fail-mode answers.
      args.push("--redis", this.opts.redis, "--redis-timeout-ms", "1000", "--events", "false");
    }
    args.push(...(this.opts.args ?? []));
    const env: NodeJS.ProcessEnv = {};
    for (const [k, v] of Object.entries(process.env)) {
      if (!k.startsWith("FLOODGATE_")) env[k] = v;
    }
    env.STATE_DIRECTORY = this.dir;
    env.NO_COLOR = "1";
    const log = fs.openSync(this.logPath, "a");
    const child = spawn(this.opts.bin ?? floodgateBin(), args, { env, stdio: ["ignore", "ignore", log] });
    fs.closeSync(log);
    children.add(child);
    child.once("exit", () => children.delete(child));
    this.child = child;
    const started = this.log().split("\n").length;
    await eventually(`the agent at ${this.socket} to be ready`, 15_000, async () => {
      if (child.exitCode !== null || child.signalCode !== null) {
        throw new Error(`agent exited (${child.exitCode ?? child.signalCode}); log:\n${this.log()}`);
      }
      const fresh = this.log().split("\n").slice(started - 1).join("\n");
      return fresh.includes("rules loaded") && (await connects(this.socket));
    });
  }

  /** Its process id. */
  get pid(): number {
    if (!this.child?.pid) throw new Error("agent not running");
    return this.child.pid;
  }

  /** What it logged. */
  log(): string {
    try {
      return fs.readFileSync(this.logPath, "utf8");
    } catch {
      return "";
    }
  }

  /** Sends a signal. */
  signal(sig: NodeJS.Signals): void {
    this.child?.kill(sig);
  }

  /** Waits until every thread of the process is stopped (after SIGSTOP; Linux's /proc). */
  async stopped(): Promise<void> {
    const pid = this.pid;
    await eventually(`agent ${pid} to be stopped`, 5_000, () => {
      const tasks = fs.readdirSync(`/proc/${pid}/task`);
      return tasks.every((t) => {
        const stat = fs.readFileSync(`/proc/${pid}/task/${t}/stat`, "utf8");
        return stat.slice(stat.lastIndexOf(")") + 2).startsWith("T");
      });
    });
  }

  /** Kills it with SIGKILL (its socket file stays behind, as after a crash) and waits for the exit. */
  async kill(): Promise<void> {
    const c = this.child;
    if (!c || c.exitCode !== null || c.signalCode !== null) return;
    const exited = new Promise((r) => c.once("exit", r));
    c.kill("SIGCONT");
    c.kill("SIGKILL");
    await exited;
    this.child = null;
  }

  /** Stops it (SIGKILL), for `after` hooks. */
  async stop(): Promise<void> {
    await this.kill();
  }
}

/** A `redis-server` of the test's own on a free loopback port: `--save ""`, no AOF, a temp dir. */
export class RedisServer {
  private child: ChildProcess | null = null;
  private constructor(readonly port: number) {}

  static async start(): Promise<RedisServer> {
    const bin = process.env.REDIS_SERVER_BIN || "redis-server";
    for (let attempt = 0; ; attempt++) {
      const port = await freePort();
      const r = new RedisServer(port);
      const dir = tempDir();
      const child = spawn(
        bin,
        [
          "--port",
          String(port),
          "--bind",
          "127.0.0.1",
          "--save",
          "",
          "--appendonly",
          "no",
          "--dir",
          dir,
          "--logfile",
          path.join(dir, "redis.log"),
        ],
        { stdio: "ignore" },
      );
      children.add(child);
      child.once("exit", () => children.delete(child));
      const spawnError = new Promise<Error>((res) => child.once("error", res));
      r.child = child;
      try {
        await Promise.race([
          eventually(`redis-server on port ${port} to answer PING`, 10_000, async () => {
            if (child.exitCode !== null) throw new Error(`redis-server exited ${child.exitCode}`);
            return (await r.command("PING")) === "+PONG";
          }),
          spawnError.then((e) => {
            throw new Error(`cannot start ${bin} (install redis-server or set REDIS_SERVER_BIN): ${e.message}`);
          }),
        ]);
        return r;
      } catch (e) {
        child.kill("SIGKILL");
        // Another process may have taken the free port between the probe and the bind: try again.
        if (attempt >= 2 || String(e).includes("cannot start")) throw e;
      }
    }
  }

  /** `redis://127.0.0.1:PORT`. */
  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** Sends one inline command and returns the first line of the reply ("" on failure). */
  command(cmd: string): Promise<string> {
    return new Promise((resolve) => {
      const s = net.createConnection({ host: "127.0.0.1", port: this.port });
      let data = "";
      const done = (v: string) => {
        s.destroy();
        resolve(v);
      };
      s.setTimeout(1000, () => done(""));
      s.once("error", () => done(""));
      s.on("data", (d) => {
        data += d.toString("latin1");
        const nl = data.indexOf("\r\n");
        if (nl >= 0) done(data.slice(0, nl));
      });
      s.once("connect", () => s.write(`${cmd}\r\n`));
    });
  }

  async stop(): Promise<void> {
    const c = this.child;
    if (!c || c.exitCode !== null || c.signalCode !== null) return;
    const exited = new Promise((r) => c.once("exit", r));
    c.kill("SIGKILL");
    await exited;
  }
}

/** A unique suffix for keys, so tests sharing an agent or a Redis never share a counter. */
export function unique(): string {
  return `${process.pid}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

// ---------------------------------------------------------------------------------------------
// A fake agent, to send what a real one never would.

import type { FailModeList } from "../src/fail-modes";
import { decodeFrame, encodeFrame, type Frame, type Verdict } from "../src/protocol";

/** What the fake does with a Hello: answer HelloOk, refuse it (Error 3, close), or say nothing. */
export type HelloMode = "ok" | "refuse" | "silent" | "drop";

/** A Unix-socket server speaking just enough of the protocol; each test scripts its answers. */
export class FakeAgent {
  readonly path: string;
  connections = 0;
  readonly sockets: net.Socket[] = [];
  /** Called with every Check frame the fake reads. */
  onCheck: (frame: Frame, sock: net.Socket) => void = () => {};
  helloMode: HelloMode = "ok";
  /** The version its HelloOk chooses (1: an agent from before the fail-mode list). */
  helloVersion = 1;
  /** What it answers to FailModes; null: no answer. */
  failModeList: FailModeList | null = null;
  /** Every frame it read, in order, across connections. */
  readonly received: Frame[] = [];
  /** The bytes of each frame in {@link received}, length prefix included. */
  readonly receivedBytes: Buffer[] = [];
  /** Called with every Check frame and its bytes after `onCheck` ({@link watch}). */
  private readonly watchers = new Set<(frame: Frame, bytes: Buffer) => void>();
  /** When each connection was accepted (performance.now()). */
  readonly acceptedAt: number[] = [];
  private server: net.Server;

  private constructor() {
    this.path = path.join(tempDir(), "fake.sock");
    this.server = net.createServer((sock) => this.accept(sock));
  }

  static async start(): Promise<FakeAgent> {
    const f = new FakeAgent();
    await new Promise<void>((r) => f.server.listen(f.path, r));
    return f;
  }

  private accept(sock: net.Socket): void {
    this.connections++;
    this.acceptedAt.push(performance.now());
    this.sockets.push(sock);
    sock.on("error", () => {});
    if (this.helloMode === "drop") {
      sock.destroy();
      return;
    }
    let buf = Buffer.alloc(0);
    sock.on("data", (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      for (;;) {
        const r = decodeFrame(buf);
        if (!r.ok) return;
        this.receivedBytes.push(Buffer.from(buf.subarray(0, r.used)));
        buf = buf.subarray(r.used);
        const f = r.frame;
        this.received.push(f);
        if (f.body.kind === "hello") {
          if (this.helloMode === "ok") {
            sock.write(encodeFrame({ requestId: 0, body: { kind: "helloOk", version: this.helloVersion } }));
          } else if (this.helloMode === "refuse") {
            sock.end(encodeFrame({ requestId: 0, body: { kind: "error", code: 3, message: "no version in common" } }));
          }
        } else if (f.body.kind === "check") {
          this.onCheck(f, sock);
          for (const w of [...this.watchers]) w(f, this.receivedBytes[this.receivedBytes.length - 1]);
        } else if (f.body.kind === "failModes" && this.failModeList) {
          sock.write(encodeFrame({ requestId: f.requestId, body: { kind: "failModeList", list: this.failModeList } }));
        }
      }
    });
  }

  /** Calls `fn` with every Check frame read from now on, after `onCheck`; returns what stops it. */
  watch(fn: (frame: Frame, bytes: Buffer) => void): () => void {
    this.watchers.add(fn);
    return () => this.watchers.delete(fn);
  }

  /** How many times it was asked for the fail-closed rules. */
  get failModesAsked(): number {
    return this.received.filter((f) => f.body.kind === "failModes").length;
  }

  /** Drops every connection and every later one: the agent is away, its socket file still there. */
  goAway(): void {
    this.helloMode = "drop";
    for (const s of this.sockets) s.destroy();
  }

  async close(): Promise<void> {
    for (const s of this.sockets) s.destroy();
    await new Promise((r) => this.server.close(r));
  }
}

/** A verdict for the fake's answers. */
export function verdict(remaining: number, allowed = true): Verdict {
  return {
    allowed,
    logOnly: false,
    holdsLease: false,
    overQuota: false,
    source: "local",
    limit: 100,
    remaining,
    resetAtMs: 1_700_000_000_000,
    retryAfterMs: allowed ? 0 : 1500,
  };
}

/** A Decision frame answering `requestId` with one item `rule`. */
export function decisionFrame(requestId: number, remaining: number, allowed = true): Buffer {
  const v = verdict(remaining, allowed);
  return encodeFrame({ requestId, body: { kind: "decision", combined: v, items: [{ ruleId: "rule", verdict: v, windowMs: 0 }] } });
}

/** A verdict as the fake answers, holding the lease or not. */
export function leaseVerdict(holdsLease: boolean, remaining = 1): Verdict {
  return {
    allowed: true,
    logOnly: false,
    holdsLease,
    overQuota: false,
    source: "local",
    limit: 2,
    remaining,
    resetAtMs: 1_700_000_030_000,
    retryAfterMs: 0,
  };
}

/** A Decision frame answering `requestId` with one item `rule`, holding the lease or not. */
export function leaseDecision(requestId: number, holdsLease: boolean, rule = "slots"): Buffer {
  const v = leaseVerdict(holdsLease);
  // A concurrency rule has no window: a version-1 Decision frame, whatever the version.
  return encodeFrame({ requestId, body: { kind: "decision", combined: v, items: [{ ruleId: rule, verdict: v, windowMs: 0 }] } });
}

/** The body of each Check the fake read, in hex (the request ids differ from run to run). */
export const checkBodies = (fake: FakeAgent) =>
  fake.receivedBytes.filter((b) => b[5] === 0x03).map((b) => b.subarray(10).toString("hex"));

/** Whether a frame is a check carrying a lease that consumes (an acquire). */
export function isAcquire(f: Frame): boolean {
  if (f.body.kind !== "check") return false;
  const c = f.body.check;
  const [mode, lease] =
    c.form === "items" ? [c.items[0].mode, c.items[0].lease] : [c.attributes.mode, c.attributes.lease];
  return lease !== undefined && (mode ?? "consume") === "consume";
}

/** `p`, or a rejection naming `what` once `timeoutMs` passed without it settling. */
export function within<T>(what: string, timeoutMs: number, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}`)), timeoutMs);
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

/** A Check frame the fake read, and its body in hex (after the length, version, kind and request id). */
export interface SeenCheck {
  frame: Frame;
  body: string;
}

/**
 * The next Check frame the fake reads from now on that `pred` accepts, within `timeoutMs`: awaited
 * as an event (the fake's {@link FakeAgent.watch}), not polled; the fake's `onCheck` runs first.
 */
export function nextCheck(fake: FakeAgent, what: string, timeoutMs: number, pred: (f: Frame) => boolean): Promise<SeenCheck> {
  let stop = () => {};
  const seen = new Promise<SeenCheck>((resolve) => {
    stop = fake.watch((f, bytes) => {
      if (!pred(f)) return;
      stop();
      resolve({ frame: f, body: bytes.subarray(10).toString("hex") });
    });
  });
  return within(what, timeoutMs, seen).finally(stop);
}

/** The mode and lease of a Check frame (its only item's, or its attributes'). */
export function modeAndLease(f: Frame): { mode: string; lease?: bigint; cost: number; user?: string } {
  if (f.body.kind !== "check") throw new Error(`not a check: ${f.body.kind}`);
  const c = f.body.check;
  if (c.form === "items") {
    const i = c.items[0];
    return { mode: i.mode ?? "consume", lease: i.lease, cost: i.cost ?? 1 };
  }
  const a = c.attributes;
  return { mode: a.mode ?? "consume", lease: a.lease, cost: a.cost ?? 1, user: a.user ?? undefined };
}
