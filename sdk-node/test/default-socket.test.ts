/**
 * Where a client given no path finds the agent ($FLOODGATE_SOCKET, /run/floodgate, then
 * $XDG_RUNTIME_DIR, looked up on every connection attempt), and how an unreachable agent shows: one
 * warning per client every 10 s (console.warn unless another logger is given), a line when it is
 * back, and `client.health()`. Against real agents.
 */

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { afterEach, beforeEach, describe, it } from "node:test";

import { Client, DEFAULT_SOCKET, defaultSocketPath, type Logger } from "../src/index";
import { Reachability, WARN_EVERY_MS } from "../src/health";
import { Agent, eventually, tempDir, unique } from "./helpers";

const RULES = `
[[rules]]
id = "r"
dimension = "user"
match = { endpoint = "/items-only" }
limit = 3
windowSeconds = 3600
`;

/** The machine's own agent, if it runs one, is where the resolver looks first after the variable. */
const SYSTEM_AGENT = fs.existsSync(DEFAULT_SOCKET);

/** A logger that records what it is told. */
function recorder(): Logger & { lines: string[] } {
  const lines: string[] = [];
  return { lines, warn: (m: string) => lines.push(m) };
}

describe("the default socket and an unreachable agent", () => {
  const saved = { socket: process.env.FLOODGATE_SOCKET, runtime: process.env.XDG_RUNTIME_DIR };
  const clients: Client[] = [];
  const agents: Agent[] = [];
  const track = (c: Client) => (clients.push(c), c);
  beforeEach(() => {
    // What the CI's or a developer's environment says must not decide these tests.
    delete process.env.FLOODGATE_SOCKET;
    delete process.env.XDG_RUNTIME_DIR;
  });
  afterEach(async () => {
    for (const c of clients.splice(0)) c.close();
    for (const a of agents.splice(0)) await a.stop();
    for (const [k, v] of [
      ["FLOODGATE_SOCKET", saved.socket],
      ["XDG_RUNTIME_DIR", saved.runtime],
    ] as const) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  });

  it("a client given no path uses FLOODGATE_SOCKET", async () => {
    const agent = await Agent.start({ rules: RULES });
    agents.push(agent);
    process.env.FLOODGATE_SOCKET = agent.socket;
    const log = recorder();
    const c = track(await Client.connect({ timeoutMs: 5_000, logger: log }));
    const d = await c.allow(`user:${unique()}`, "r");
    assert.deepEqual([d.allowed, d.origin.kind, d.limit, d.remaining], [true, "agent", 3, 2]);
    // The fail-closed rules are asked for after Hello, and may be answered after the check.
    await eventually("the agent's fail-closed rules", 5_000, () => c.health().rulesVersion !== undefined);
    assert.deepEqual(c.health(), {
      connected: true,
      path: agent.socket,
      lastError: null,
      failedAttempts: 0,
      failPolicyAnswers: 0,
      failClosedRules: 0,
      rulesVersion: 0,
    });
    assert.equal(c.path, agent.socket);
    assert.deepEqual(log.lines, [], "nothing to warn about");
  });

  it("an unreachable agent: one warning for many failed attempts and calls, health() says why", async () => {
    const missing = path.join(tempDir(), "nobody.sock");
    const log = recorder();
    const started = performance.now();
    // Fast retries: several failed attempts within the test, all inside one 10 s warning period.
    const c = track(new Client(missing, { logger: log, reconnectMinMs: 5, reconnectMaxMs: 20 }));
    await eventually("three failed connection attempts", 10_000, () => c.health().failedAttempts >= 3);
    const ds = await Promise.all(Array.from({ length: 5 }, () => c.allow(`user:${unique()}`, "r")));
    assert.ok(ds.every((d) => d.allowed && d.origin.kind === "failOpen"));
    const closed = await c.allow(`user:${unique()}`, "r", 1, { fail: "closed" });
    assert.deepEqual([closed.allowed, closed.origin.kind], [false, "failClosed"]);
    const h = c.health();
    assert.deepEqual([h.connected, h.path, h.lastError, h.failPolicyAnswers], [false, missing, "No such file or directory", 6]);
    assert.ok(h.failedAttempts >= 3, `${h.failedAttempts} failed attempts`);
    assert.ok(performance.now() - started < WARN_EVERY_MS, "premise: everything above within one warning period");
    assert.deepEqual(
      log.lines,
      [`floodgate: cannot reach the agent at ${missing}: No such file or directory; answering by fail policy open`],
      "one warning for all the failed attempts and calls",
    );
  });

  it("warns through console.warn by default; logger: null silences it", async () => {
    const missing = path.join(tempDir(), "nobody.sock");
    const seen: unknown[] = [];
    const warn = console.warn;
    console.warn = (...args: unknown[]) => void seen.push(args.join(" "));
    try {
      track(await Client.connect(missing, { fail: "closed" }));
      track(await Client.connect(missing, { logger: null }));
    } finally {
      console.warn = warn;
    }
    assert.deepEqual(seen, [
      `floodgate: cannot reach the agent at ${missing}: No such file or directory; answering by fail policy closed`,
    ]);
  });

  it("an agent started after the client is found, and its return is logged", async () => {
    const socket = path.join(tempDir(), "agent.sock");
    process.env.FLOODGATE_SOCKET = socket;
    const log = recorder();
    const c = track(await Client.connect({ timeoutMs: 5_000, logger: log, reconnectMinMs: 5, reconnectMaxMs: 50 }));
    const d = await c.allow(`user:${unique()}`, "r");
    assert.equal(d.origin.kind, "failOpen");
    assert.equal(c.health().connected, false);
    assert.equal(log.lines.length, 1);
    assert.ok(log.lines[0].startsWith(`floodgate: cannot reach the agent at ${socket}: `), log.lines[0]);
    agents.push(await Agent.start({ rules: RULES, socket }));
    await eventually("the client to connect to the agent started after it", 10_000, () => c.isConnected());
    const back = await c.allow(`user:${unique()}`, "r");
    assert.deepEqual([back.origin.kind, back.remaining], ["agent", 2]);
    await eventually("the agent's fail-closed rules", 5_000, () => c.health().rulesVersion !== undefined);
    assert.deepEqual(c.health(), {
      connected: true,
      path: socket,
      lastError: null,
      failedAttempts: 0,
      failPolicyAnswers: 1,
      failClosedRules: 0,
      rulesVersion: 0,
    });
    assert.equal(log.lines.length, 2);
    assert.match(log.lines[1], new RegExp(`^floodgate: agent reachable again at ${socket} \\(after \\d+ failed attempts\\)$`));
  });

  it("the resolver's order", () => {
    const runtime = tempDir();
    const userSocket = path.join(runtime, "floodgate", "floodgate.sock");
    fs.mkdirSync(path.dirname(userSocket));
    fs.writeFileSync(userSocket, ""); // the resolver asks only whether the file exists
    // Nothing set: the default, which errors and logs name (whether or not an agent is there).
    assert.equal(defaultSocketPath(), DEFAULT_SOCKET);
    // The variable wins over everything; empty is unset.
    process.env.XDG_RUNTIME_DIR = runtime;
    process.env.FLOODGATE_SOCKET = "/elsewhere/agent.sock";
    assert.equal(defaultSocketPath(), "/elsewhere/agent.sock");
    process.env.FLOODGATE_SOCKET = "";
    // Then the system agent's socket if it exists, else the user's.
    assert.equal(defaultSocketPath(), SYSTEM_AGENT ? DEFAULT_SOCKET : userSocket);
    // A relative XDG_RUNTIME_DIR is not one (the XDG spec): ignored, even where it would resolve.
    const cwd = process.cwd();
    process.chdir(path.dirname(runtime));
    try {
      process.env.XDG_RUNTIME_DIR = path.basename(runtime);
      assert.equal(defaultSocketPath(), DEFAULT_SOCKET);
    } finally {
      process.chdir(cwd);
    }
    // A runtime dir without the socket: the default.
    process.env.XDG_RUNTIME_DIR = tempDir();
    assert.equal(defaultSocketPath(), DEFAULT_SOCKET);
  });

  it(
    "the resolver finds an agent in XDG_RUNTIME_DIR started after the client",
    {
      skip: SYSTEM_AGENT
        ? `${DEFAULT_SOCKET} exists on this machine, and the resolver rightly prefers it to XDG_RUNTIME_DIR`
        : false,
    },
    async () => {
      const runtime = tempDir();
      process.env.XDG_RUNTIME_DIR = runtime;
      const userSocket = path.join(runtime, "floodgate", "floodgate.sock");
      assert.equal(defaultSocketPath(), DEFAULT_SOCKET, "no agent anywhere yet");
      const c = track(await Client.connect({ timeoutMs: 5_000, logger: null, reconnectMinMs: 5, reconnectMaxMs: 50 }));
      const h = c.health();
      assert.deepEqual([h.connected, h.path], [false, DEFAULT_SOCKET]);
      assert.ok(h.failedAttempts >= 1);
      fs.mkdirSync(path.dirname(userSocket));
      agents.push(await Agent.start({ rules: RULES, socket: userSocket }));
      assert.equal(defaultSocketPath(), userSocket);
      // Looked up again on the next attempt: the client finds the agent there by itself.
      await eventually("the client to connect to the agent in XDG_RUNTIME_DIR", 10_000, () => c.isConnected());
      assert.equal((await c.allow(`user:${unique()}`, "r")).origin.kind, "agent");
      assert.equal(c.health().path, userSocket);
    },
  );

  it("one warning per 10 s, with the count of the others; 'reachable again' only after a warning", () => {
    let now = 100_000;
    const log = recorder();
    const r = new Reachability("/x.sock", "closed", log, () => now);
    r.failed("/x.sock", "Connection refused");
    for (const t of [101_000, 105_000, 109_900]) {
      now = t;
      r.failed("/x.sock", "Connection refused");
    }
    now = 110_000;
    r.failed("/x.sock", "No such file or directory");
    r.connected("/x.sock");
    assert.deepEqual(log.lines, [
      "floodgate: cannot reach the agent at /x.sock: Connection refused; answering by fail policy closed",
      "floodgate: cannot reach the agent at /x.sock: No such file or directory; answering by fail policy closed" +
        " (3 more failed attempts not logged since the last warning)",
      "floodgate: agent reachable again at /x.sock (after 5 failed attempts)",
    ]);
    assert.deepEqual([r.failedAttempts, r.lastError], [0, null]);
    // A short outage inside the same period: not logged, neither is its end; the next warning counts it.
    log.lines.length = 0;
    now = 111_000;
    r.failed("/x.sock", "Connection refused");
    r.connected("/x.sock");
    assert.deepEqual(log.lines, []);
    now = 120_000;
    r.failed("/x.sock", "Connection refused");
    assert.deepEqual(log.lines, [
      "floodgate: cannot reach the agent at /x.sock: Connection refused; answering by fail policy closed" +
        " (1 more failed attempts not logged since the last warning)",
    ]);
  });
});
