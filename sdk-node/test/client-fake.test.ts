/**
 * The client against a fake agent that answers out of order, in fragments, with garbage, oversize
 * frames, unknown kinds, bad text and error codes: the client never crashes, never rejects for the
 * agent's trouble, and answers each call by its fail policy without waiting out its timeout; and
 * how it asks for, keeps and applies the agent's fail-closed rules, and sends peeks and charges
 * only to an agent that speaks protocol version 2.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import * as path from "node:path";
import { promisify } from "node:util";
import { after, describe, it } from "node:test";

import { FAIL_MODES_EVERY_MS } from "../src/client";
import { Client, FloodgateError, type ClosedRule, type Decision, type FailModeList } from "../src/index";
import { encodeFrame, type Frame } from "../src/protocol";
import { decisionFrame, eventually, FakeAgent, tempDir, verdict } from "./helpers";

const execFileP = promisify(execFile);

/** A call's time limit far above any answer here: a call that ends early was not timed out. */
const LONG = 5_000;
/**
 * "Promptly": well under LONG. Generous for a loaded 2-core machine, yet a call that waited for its
 * timeout (5 s) fails it.
 */
const PROMPT_MS = 1_000;

function costOf(f: Frame): number {
  return f.body.kind === "check" && f.body.check.form === "items" ? f.body.check.items[0].cost ?? 1 : 0;
}

async function timed<T>(p: Promise<T>): Promise<[T, number]> {
  const t = performance.now();
  const v = await p;
  return [v, performance.now() - t];
}

describe("client against a fake agent", () => {
  const clients: Client[] = [];
  const fakes: FakeAgent[] = [];
  const setup = async (config: ConstructorParameters<typeof Client>[1] = {}) => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    const client = await Client.connect(fake.path, { timeoutMs: LONG, ...config });
    clients.push(client);
    return { fake, client };
  };
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  it("matches answers to calls by request id, out of order and byte by byte", async () => {
    const { fake, client } = await setup();
    assert.ok(client.isConnected());
    const seen: Frame[] = [];
    fake.onCheck = (f, sock) => {
      seen.push(f);
      if (seen.length < 5) return;
      // Reverse order, each answer's `remaining` the cost its call asked for, one byte per write.
      const bytes = Buffer.concat(seen.reverse().map((s) => decisionFrame(s.requestId, costOf(s))));
      void (async () => {
        for (const b of bytes) {
          sock.write(Buffer.from([b]));
          await new Promise((r) => setImmediate(r));
        }
      })();
    };
    const costs = [11, 22, 33, 44, 55];
    const ds = await Promise.all(costs.map((c) => client.allow("k", "rule", c)));
    assert.deepEqual(
      ds.map((d) => d.remaining),
      costs,
    );
    assert.ok(ds.every((d) => d.origin.kind === "agent" && d.allowed));
    assert.equal(new Set(seen.map((s) => s.requestId)).size, 5, "distinct request ids");
    assert.ok(!seen.some((s) => s.requestId === 0), "id 0 is never used for a check");
    assert.equal(fake.connections, 1);
  });

  const broken: [string, (id: number) => Buffer][] = [
    ["a length under the header", () => Buffer.from("0000000301020304", "hex")],
    ["an oversize length prefix", () => Buffer.from("7fffffff0104000000010000", "hex")],
    [
      "an unknown kind",
      (id) => {
        const b = encodeFrame({ requestId: id, body: { kind: "pong" } });
        b[5] = 0x42;
        return b;
      },
    ],
    [
      "an unknown source",
      (id) => {
        const b = decisionFrame(id, 1);
        b[11] = 9;
        return b;
      },
    ],
    [
      "a decision with bytes missing (length says so)",
      (id) => {
        const b = decisionFrame(id, 1).subarray(0, 30);
        b.writeUInt32BE(26, 0);
        return b;
      },
    ],
  ];
  for (const [name, bad] of broken) {
    it(`answers by the fail policy at once and reconnects after ${name}`, async () => {
      const { fake, client } = await setup();
      let n = 0;
      fake.onCheck = (f, sock) => {
        n++;
        // The first connection's first check gets the broken frame; every later check a good answer.
        sock.write(n === 1 ? bad(f.requestId) : decisionFrame(f.requestId, 7));
      };
      const [open, ms] = await timed(client.allow("k", "rule"));
      assert.equal(open.allowed, true);
      assert.deepEqual(open.origin, { kind: "failOpen", reason: "unavailable" });
      assert.ok(ms < PROMPT_MS, `answered after ${ms} ms`);
      await eventually("a second connection", 5_000, () => fake.connections >= 2 && client.isConnected());
      const good = await client.allow("k", "rule");
      assert.equal(good.origin.kind, "agent");
      assert.equal(good.remaining, 7);
    });
  }

  it("a broken frame answers a fail-closed call denied", async () => {
    const { fake, client } = await setup({ closedRetryAfterMs: 2500 });
    fake.onCheck = (_f, sock) => sock.write(Buffer.from("0000000301020304", "hex"));
    const d = await client.allow("k", "rule", 1, { fail: "closed" });
    assert.equal(d.allowed, false);
    assert.deepEqual(d.origin, { kind: "failClosed", reason: "unavailable" });
    assert.equal(d.retryAfterMs, 2500);
    assert.equal(d.limit, 0);
  });

  it("an unreadable answer (bad UTF-8, another version) fails only its call and keeps the connection", async () => {
    const { fake, client } = await setup();
    let n = 0;
    fake.onCheck = (f, sock) => {
      n++;
      if (n === 1) {
        const b = decisionFrame(f.requestId, 1);
        b[b.length - 34 - 2] = 0xff; // inside the item's rule id "rule"
        sock.write(b);
      } else if (n === 2) {
        const b = decisionFrame(f.requestId, 1);
        b[4] = 7; // version 7, which this SDK does not speak
        sock.write(b);
      } else sock.write(decisionFrame(f.requestId, 9));
    };
    for (let i = 0; i < 2; i++) {
      const [d, ms] = await timed(client.allow("k", "rule"));
      assert.deepEqual(d.origin, { kind: "failOpen", reason: "unavailable" });
      assert.ok(ms < PROMPT_MS, `answered after ${ms} ms`);
    }
    const good = await client.allow("k", "rule");
    assert.equal(good.remaining, 9);
    assert.equal(fake.connections, 1, "the stream stayed in sync: no reconnection");
  });

  it("a version-4 Decision's windows reach the items; a version-1 Decision's items have window 0", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = 4;
    const client = await Client.connect(fake.path, { timeoutMs: LONG });
    clients.push(client);
    assert.equal(client.protocolVersion, 4);
    let windowMs = 60_000;
    fake.onCheck = (f, sock) =>
      sock.write(
        encodeFrame({
          requestId: f.requestId,
          body: {
            kind: "decision",
            combined: verdict(9),
            items: [
              { ruleId: "rule", verdict: verdict(9), windowMs },
              { ruleId: "slots", verdict: verdict(3), windowMs: 0 },
            ],
          },
        }),
      );
    const four = await client.allow("k", "rule");
    assert.equal(four.origin.kind, "agent");
    assert.equal(four.remaining, 9);
    assert.deepEqual(
      four.items.map((i) => [i.ruleId, i.windowMs]),
      [
        ["rule", 60_000],
        ["slots", 0],
      ],
    );
    windowMs = 0; // no window to carry: a version-1 frame
    const one = await client.allow("k", "rule");
    assert.deepEqual(one.items.map((i) => i.windowMs), [0, 0]);
    assert.equal(fake.connections, 1, "both layouts read on one connection");
  });

  it("error codes: 4 and 5 reject the call; overload, internal and unknown codes answer by policy", async () => {
    const { fake, client } = await setup();
    let code = 0;
    fake.onCheck = (f, sock) =>
      sock.write(encodeFrame({ requestId: f.requestId, body: { kind: "error", code, message: `code ${code}` } }));
    for (const c of [4, 5]) {
      code = c;
      await assert.rejects(client.allow("k", "rule"), (e: unknown) => {
        assert.ok(e instanceof FloodgateError);
        assert.equal(e.kind, "agent");
        assert.equal(e.code, c);
        return true;
      });
    }
    for (const c of [7, 8, 3, 999]) {
      code = c;
      const open = await client.allow("k", "rule");
      assert.deepEqual(open.origin, { kind: "failOpen", reason: "unavailable" }, `code ${c}`);
      const closed = await client.allow("k", "rule", 1, { fail: "closed" });
      assert.deepEqual(closed.origin, { kind: "failClosed", reason: "unavailable" }, `code ${c}`);
    }
    assert.equal(fake.connections, 1);
    assert.equal(client.stats().unavailable, 8);
  });

  it("frames that answer nothing (other ids, Pong, HelloOk, id-0 errors) are ignored", async () => {
    const { fake, client } = await setup();
    fake.onCheck = (f, sock) => {
      sock.write(
        Buffer.concat([
          decisionFrame(f.requestId + 1000, 1),
          encodeFrame({ requestId: f.requestId, body: { kind: "pong" } }),
          encodeFrame({ requestId: 0, body: { kind: "helloOk", version: 1 } }),
          encodeFrame({ requestId: 0, body: { kind: "error", code: 8, message: "about the stream" } }),
          decisionFrame(f.requestId, 42),
        ]),
      );
    };
    const d = await client.allow("k", "rule");
    assert.equal(d.remaining, 42);
    assert.equal(d.origin.kind, "agent");
  });

  it("random garbage never crashes the client and every call settles by its timeout", async () => {
    const { fake, client } = await setup({ timeoutMs: 200, reconnectMinMs: 1, reconnectMaxMs: 5 });
    let s = 12345;
    const rnd = () => {
      s = (Math.imul(s, 1103515245) + 12345) >>> 0;
      return s / 0x1_0000_0000;
    };
    fake.onCheck = (f, sock) => {
      const len = Math.floor(rnd() * 80);
      const b = Buffer.alloc(len);
      for (let i = 0; i < len; i++) b[i] = Math.floor(rnd() * 256);
      // Half the time a plausible header for this very call, so the body parser is reached.
      if (len >= 10 && rnd() < 0.5) {
        b.writeUInt32BE(len - 4, 0);
        b[4] = 1;
        b[5] = 4;
        b.writeUInt32BE(f.requestId, 6);
      }
      sock.write(b);
    };
    for (let i = 0; i < 200; i++) {
      await eventually("a connection", 5_000, () => client.isConnected());
      const [r, ms] = await timed(
        client.allow("k", "rule").then(
          (d: Decision) => d,
          (e: unknown) => e,
        ),
      );
      // Garbage cannot be an agent refusal for this call except by a 1-in-billions accident.
      assert.ok(!(r instanceof Error) || r instanceof FloodgateError, String(r));
      // Timer lateness on a loaded machine: 200 ms timeout + 1 s is still "did not hang".
      assert.ok(ms < 200 + PROMPT_MS, `settled after ${ms} ms`);
    }
    assert.ok(fake.connections > 1, "broken frames made it reconnect");
  });

  it("a refused Hello leaves the client unconnected, answering by policy", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloMode = "refuse";
    const client = await Client.connect(fake.path, { timeoutMs: LONG });
    clients.push(client);
    assert.equal(client.isConnected(), false);
    const [d, ms] = await timed(client.allow("k", "rule"));
    assert.deepEqual(d.origin, { kind: "failOpen", reason: "unavailable" });
    assert.ok(ms < PROMPT_MS);
    assert.equal(client.stats().connects, 0);
  });

  it("an agent silent on Hello: connect() gives up after connectTimeoutMs, then retries", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloMode = "silent";
    const t = performance.now();
    const client = await Client.connect(fake.path, { timeoutMs: LONG, connectTimeoutMs: 100 });
    clients.push(client);
    const ms = performance.now() - t;
    // At least the connect timeout (less 10 ms: timers run on the loop's clock, read once per turn);
    // at most it plus scheduling slack on a loaded machine.
    assert.ok(ms >= 90 && ms < 100 + PROMPT_MS, `connect() took ${ms} ms`);
    assert.equal(client.isConnected(), false);
    await eventually("a retry", 5_000, () => fake.connections >= 2);
  });

  it("reconnection backs off: an agent dropping every connection is not hammered", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloMode = "drop";
    const client = new Client(fake.path, { reconnectMinMs: 10, reconnectMaxMs: 1000 });
    clients.push(client);
    await eventually("6 connection attempts", 10_000, () => fake.connections >= 6);
    // Delays double from 10 ms with equal jitter (each at least half its base): between the 1st and
    // the 6th attempt at least (10+20+40+80+160)/2 = 155 ms passed (less 15 ms: timers run on the
    // loop's clock, read once per turn). Without backoff it would be ~50 ms.
    const spent = fake.acceptedAt[5] - fake.acceptedAt[0];
    assert.ok(spent >= 140, `6 attempts within ${spent} ms`);
    assert.ok(spent < 310 + PROMPT_MS * 2, `backoff too slow: ${spent} ms`);
  });

  it("past maxPending, calls answer by policy at once; the others time out by policy", async () => {
    const { fake, client } = await setup({ maxPending: 2, timeoutMs: 100 });
    fake.onCheck = () => {}; // never answers
    const t = performance.now();
    const calls = [client.allow("a", "rule"), client.allow("b", "rule"), client.allow("c", "rule", 1, { fail: "closed" })];
    const third = await calls[2];
    assert.deepEqual(third.origin, { kind: "failClosed", reason: "unavailable" });
    assert.ok(performance.now() - t < 100, "the third did not wait for the timeout");
    const [a, b] = await Promise.all(calls.slice(0, 2));
    for (const d of [a, b]) assert.deepEqual(d.origin, { kind: "failOpen", reason: "timeout" });
    // Node times timers from the event loop's clock, read once per loop turn, so measured with
    // performance.now() a timer may end up to a turn's length early: 10 ms of leeway.
    assert.ok(performance.now() - t >= 90, "the first two waited for their timeout");
    assert.deepEqual(client.stats(), { unavailable: 1, timeouts: 2, connects: 1, localDenied: 0 });
  });

  it("an open client does not keep its process alive", async () => {
    const { fake } = await setup();
    // Version 2, so the fail-closed rules' refresh timer is armed too.
    fake.helloVersion = 2;
    fake.failModeList = { rulesVersion: 4, truncated: false, rules: [] };
    fake.onCheck = (f, sock) => sock.write(decisionFrame(f.requestId, 5));
    const script = `
      const { Client } = require(${JSON.stringify(path.join(__dirname, "..", "src", "index.js"))});
      Client.connect(${JSON.stringify(fake.path)}).then(async (c) => {
        const d = await c.allow("k", "rule");
        while (c.health().rulesVersion === undefined) await new Promise((r) => setTimeout(r, 5));
        console.log(JSON.stringify([c.isConnected(), d.remaining, c.health().rulesVersion]));
      });`;
    const t = performance.now();
    const { stdout } = await execFileP(process.execPath, ["-e", script], { timeout: 10_000 });
    assert.deepEqual(JSON.parse(stdout), [true, 5, 4], "it was connected, answered and had the list");
    // It exited by itself, connection open and reconnection armed, without close(): well before the
    // 10 s kill (node itself starts in well under a second even on a loaded machine).
    assert.ok(performance.now() - t < 5_000);
  });

  it("close() answers calls in flight by policy and every later call too", async () => {
    const { fake, client } = await setup();
    fake.onCheck = () => {};
    const inFlight = client.allow("k", "rule", 1, { fail: "closed" });
    await eventually("the check to reach the fake", 5_000, () => fake.sockets.length > 0);
    client.close();
    const d = await inFlight;
    assert.deepEqual(d.origin, { kind: "failClosed", reason: "unavailable" });
    const later = await client.allow("k", "rule");
    assert.deepEqual(later.origin, { kind: "failOpen", reason: "unavailable" });
    assert.equal(client.isConnected(), false);
  });
});

describe("client with no agent at all", () => {
  const missing = `${tempDir()}/nobody-here.sock`;

  it("answers fail-open and fail-closed at once; invalid checks still reject", async () => {
    const client = await Client.connect(missing, { closedRetryAfterMs: 3000 });
    try {
      const t = Date.now();
      const open = await client.allow("k", "rule");
      assert.equal(open.allowed, true);
      assert.deepEqual(open.origin, { kind: "failOpen", reason: "unavailable" });
      assert.equal(open.retryAfterMs, undefined);
      const closed = await client.check([{ key: "k", ruleId: "rule" }], { fail: "closed" });
      assert.equal(closed.allowed, false);
      assert.equal(closed.retryAfterMs, 3000);
      assert.ok(closed.resetAtMs >= t + 3000 && closed.resetAtMs <= Date.now() + 3000);
      await assert.rejects(client.allow("{bad}", "rule"), (e: unknown) => e instanceof FloodgateError && e.kind === "invalid");
      await assert.rejects(client.check([]), FloodgateError);
      await assert.rejects(client.checkAttributes({ user: "u", cost: 0 }), FloodgateError);
      assert.deepEqual(client.stats(), { unavailable: 2, timeouts: 0, connects: 0, localDenied: 0 });
    } finally {
      client.close();
    }
  });

  it("the per-process fallback limit decides fail-open calls while the agent is away", async () => {
    const client = await Client.connect(missing, { fallbackLimit: { limit: 2, perMs: 60_000 } });
    try {
      const a = await client.allow("user:1", "rule");
      const b = await client.allow("user:1", "rule");
      const c = await client.allow("user:1", "rule");
      const other = await client.allow("user:2", "rule");
      assert.deepEqual([a.allowed, b.allowed, c.allowed, other.allowed], [true, true, false, true]);
      assert.deepEqual(c.origin, { kind: "localLimit", reason: "unavailable" });
      assert.equal(c.limit, 2);
      assert.equal(c.remaining, 0);
      // 2 tokens per 60 s: one token takes 30 s; some ms passed since the bucket emptied.
      assert.ok(c.retryAfterMs! > 29_000 && c.retryAfterMs! <= 30_000, `retry ${c.retryAfterMs}`);
      // Fail-closed calls are not the fallback limit's: denied by policy.
      const closed = await client.allow("user:3", "rule", 1, { fail: "closed" });
      assert.deepEqual(closed.origin, { kind: "failClosed", reason: "unavailable" });
      assert.equal(client.stats().localDenied, 1);
      // Peeks and charges consume nothing here: answered by the policy, the bucket untouched.
      const charged = await client.charge("user:2", "rule", 5);
      const peeked = await client.peek("user:2", "rule", 0);
      assert.deepEqual([charged.origin, peeked.origin], [{ kind: "failOpen", reason: "unavailable" }, { kind: "failOpen", reason: "unavailable" }]);
      assert.equal((await client.allow("user:2", "rule")).allowed, true, "user:2 still has its second token");
      assert.equal(client.stats().localDenied, 1);
    } finally {
      client.close();
    }
  });
});

describe("the agent's fail-closed rules (fake agent)", () => {
  const clients: Client[] = [];
  const fakes: FakeAgent[] = [];
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  const login: ClosedRule = { ruleId: "login-per-ip", dimension: "ip", endpoint: "/login", tier: "", limit: 5 };
  const admin: ClosedRule = { ruleId: "admin-per-user", dimension: "user", endpoint: "/admin/*", tier: "staff", limit: 100 };
  const loginCheck = { endpoint: "/login", ip: "203.0.113.5" };

  async function setup(helloVersion: number, list: FailModeList, config: ConstructorParameters<typeof Client>[1] = {}) {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = helloVersion;
    fake.failModeList = list;
    fake.onCheck = (f, sock) => sock.write(decisionFrame(f.requestId, 1));
    const client = await Client.connect(fake.path, { timeoutMs: LONG, ...config });
    clients.push(client);
    assert.ok(client.isConnected());
    return { fake, client };
  }

  it("an agent answering HelloOk 1 is never asked for them, and its rules fail by the client's policy", async (t) => {
    t.mock.timers.enable({ apis: ["setInterval"] });
    const { fake, client } = await setup(1, { rulesVersion: 1, truncated: false, rules: [login] });
    // FailModes would be written right after HelloOk, before any check: a check the fake has read
    // shows that nothing was sent before it.
    assert.equal((await client.checkAttributes(loginCheck)).origin.kind, "agent");
    t.mock.timers.tick(3 * FAIL_MODES_EVERY_MS);
    assert.equal((await client.checkAttributes(loginCheck)).origin.kind, "agent");
    assert.deepEqual(
      fake.received.map((f) => f.body.kind),
      ["hello", "check", "check"],
    );
    assert.equal(fake.received[0].body.kind === "hello" && fake.received[0].body.maxVersion, 6, "Hello offers 1..6");
    assert.equal(client.health().failClosedRules, 0);
    assert.ok(!("rulesVersion" in client.health()), "no list: no rules version");
    fake.goAway();
    await eventually("the client to see the agent gone", 5_000, () => !client.isConnected());
    assert.deepEqual((await client.checkAttributes(loginCheck)).origin, { kind: "failOpen", reason: "unavailable" });
  });

  it("a version-2 agent's list is asked for, refreshed every 10 s, replaced whole and kept while away", async (t) => {
    t.mock.timers.enable({ apis: ["setInterval"] });
    const { fake, client } = await setup(2, { rulesVersion: 7, truncated: false, rules: [login] }, { closedRetryAfterMs: 2000 });
    await eventually("the first list", 5_000, () => client.health().rulesVersion === 7);
    assert.equal(client.health().failClosedRules, 1);
    assert.equal(fake.failModesAsked, 1);
    assert.ok(fake.received.every((f) => f.body.kind === "hello" || f.requestId !== 0), "FailModes never uses id 0");

    // Late answers are the agent's failure too: a listed rule denies, with the call's reason.
    fake.onCheck = () => {};
    const late = await client.checkAttributes(loginCheck, { timeoutMs: 50 });
    assert.equal(late.allowed, false);
    assert.deepEqual(late.origin, { kind: "failClosed", reason: "timeout" });
    assert.equal(late.limit, 5);

    fake.failModeList = { rulesVersion: 8, truncated: false, rules: [admin] };
    fake.onCheck = (f, sock) => sock.write(decisionFrame(f.requestId, 1));
    t.mock.timers.tick(FAIL_MODES_EVERY_MS - 1);
    // A FailModes written now would reach the fake before this check.
    assert.equal((await client.checkAttributes(loginCheck)).origin.kind, "agent");
    assert.equal(fake.failModesAsked, 1, "not asked again before 10 s");
    t.mock.timers.tick(1);
    await eventually("the refreshed list", 5_000, () => client.health().rulesVersion === 8);
    assert.equal(fake.failModesAsked, 2);

    fake.goAway();
    await eventually("the client to see the agent gone", 5_000, () => !client.isConnected());
    assert.deepEqual(
      [client.health().failClosedRules, client.health().rulesVersion],
      [1, 8],
      "the last list is kept across the disconnection",
    );
    const t0 = Date.now();
    const denied = await client.checkAttributes({ endpoint: "/admin/users", user: "u1", tier: "staff" });
    assert.equal(denied.allowed, false);
    assert.deepEqual(denied.origin, { kind: "failClosed", reason: "unavailable" });
    assert.deepEqual([denied.limit, denied.remaining, denied.retryAfterMs, denied.source], [100, 0, 2000, "fallback"]);
    assert.ok(denied.resetAtMs >= t0 + 2000 && denied.resetAtMs <= Date.now() + 2000, `reset ${denied.resetAtMs}`);
    assert.deepEqual(denied.items.map((i) => [i.ruleId, i.verdict.allowed, i.verdict.limit]), [["admin-per-user", false, 100]]);
    const named = await client.allow("user:u1", "admin-per-user");
    assert.equal(named.allowed, false, "an item naming the rule touches it");
    const replaced = await client.checkAttributes(loginCheck);
    assert.deepEqual(replaced.origin, { kind: "failOpen", reason: "unavailable" }, "the old list's rule is gone");
    const otherTier = await client.checkAttributes({ endpoint: "/admin/users", user: "u1", tier: "free" });
    assert.equal(otherTier.allowed, true);
    const perCall = await client.checkAttributes({ endpoint: "/admin/users", user: "u1", tier: "staff" }, { fail: "open" });
    assert.deepEqual(perCall.origin, { kind: "failOpen", reason: "unavailable" }, "a per-call policy decides alone");
  });

  it("the per-call policy, then the list, then the client's policy and its fallback limit", async () => {
    const { fake, client } = await setup(
      2,
      { rulesVersion: 3, truncated: false, rules: [login] },
      { fail: "open", fallbackLimit: { limit: 1, perMs: 60_000 } },
    );
    await eventually("the list", 5_000, () => client.health().rulesVersion === 3);
    fake.goAway();
    await eventually("the client to see the agent gone", 5_000, () => !client.isConnected());
    assert.equal((await client.checkAttributes(loginCheck)).origin.kind, "failClosed", "the list before the fallback limit");
    const a = await client.checkAttributes({ endpoint: "/search", ip: "1" });
    const b = await client.checkAttributes({ endpoint: "/search", ip: "1" });
    assert.deepEqual([a.allowed, b.allowed, b.origin.kind], [true, false, "localLimit"]);
    const closed = await client.checkAttributes({ endpoint: "/other", ip: "1" }, { fail: "closed" });
    assert.deepEqual([closed.allowed, closed.origin.kind, closed.limit], [false, "failClosed", 0]);
  });

  it("a truncated list is used as far as it goes, and said once", async (t) => {
    t.mock.timers.enable({ apis: ["setInterval"] });
    const lines: string[] = [];
    const { fake, client } = await setup(2, { rulesVersion: 1, truncated: true, rules: [login] }, {
      logger: { warn: (m) => lines.push(m) },
    });
    await eventually("the list", 5_000, () => client.health().rulesVersion === 1);
    fake.failModeList = { rulesVersion: 2, truncated: true, rules: [login] };
    t.mock.timers.tick(FAIL_MODES_EVERY_MS);
    await eventually("the refreshed list", 5_000, () => client.health().rulesVersion === 2);
    const said = lines.filter((l) => l.includes("fail-closed rules fill more than one frame"));
    assert.equal(said.length, 1, lines.join("\n"));
    assert.match(said[0], /the first 1 deny while the agent is away/);
    fake.goAway();
    await eventually("the client to see the agent gone", 5_000, () => !client.isConnected());
    assert.equal((await client.checkAttributes(loginCheck)).allowed, false, "the listed rule still denies");
    assert.deepEqual((await client.allow("user:1", "past-the-list")).origin, { kind: "failOpen", reason: "unavailable" });
  });
});

describe("peek and charge (fake agent)", () => {
  const clients: Client[] = [];
  const fakes: FakeAgent[] = [];
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  async function setup(helloVersion: number) {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = helloVersion;
    fake.onCheck = (f, sock) => sock.write(decisionFrame(f.requestId, 3));
    const client = await Client.connect(fake.path, { timeoutMs: LONG });
    clients.push(client);
    assert.ok(client.isConnected());
    return { fake, client };
  }

  /** The body of each Check the fake read, in hex (the request ids differ from run to run). */
  const checkBodies = (fake: FakeAgent) =>
    fake.receivedBytes.filter((b) => b[5] === 0x03).map((b) => b.subarray(10).toString("hex"));

  it("a version-2 agent gets peeks and charges as form 2 (items) and 3 (attributes)", async () => {
    const { fake, client } = await setup(2);
    const answers = [
      await client.peek("user:1", "rule"),
      await client.charge("user:1", "rule", 1500),
      await client.check([
        { key: "user:1", ruleId: "rule" },
        { key: "user:1", ruleId: "tok", cost: 2, mode: "peek" },
      ]),
      await client.checkAttributes({ user: "1", cost: 900, mode: "charge" }),
      await client.allow("user:1", "rule"),
    ];
    assert.ok(answers.every((d) => d.origin.kind === "agent" && d.remaining === 3));
    const key = "0006" + Buffer.from("user:1").toString("hex");
    const rule = "04" + Buffer.from("rule").toString("hex");
    assert.deepEqual(checkBodies(fake), [
      // form 2, one item: key, rule id, cost 0, mode 1 (peek)
      `0201${key}${rule}0000000001`,
      // cost 1500, mode 2 (charge)
      `0201${key}${rule}000005dc02`,
      // a consume item carries mode 0 beside a peek
      `0202${key}${rule}0000000100${key}03${Buffer.from("tok").toString("hex")}0000000201`,
      // form 3: endpoint "", tier "", user "1", api key "", ip "", cost 900, mode 2 (charge)
      "03" + "0000" + "0000" + "000131" + "0000" + "0000" + "00000384" + "02",
      // every item consuming: form 0, as to a version-1 agent
      `0001${key}${rule}00000001`,
    ]);
    // Check frames carry version byte 1 whatever their form (the version that introduced the kind).
    assert.ok(fake.receivedBytes.filter((b) => b[5] === 0x03).every((b) => b[4] === 1));
  });

  it("a version-1 agent never gets one: the call rejects, saying so, and the connection stays", async () => {
    const { fake, client } = await setup(1);
    const said = (e: unknown) => {
      assert.ok(e instanceof FloodgateError);
      assert.equal(e.kind, "invalid");
      assert.match(e.message, /peek and charge need protocol version 2, and the agent speaks version 1/);
      return true;
    };
    await assert.rejects(client.peek("user:1", "rule"), said);
    await assert.rejects(client.charge("user:1", "rule", 10), said);
    await assert.rejects(client.check([{ key: "user:1", ruleId: "rule", mode: "peek" }]), said);
    await assert.rejects(client.checkAttributes({ user: "1", mode: "charge" }), said);
    // Consume checks still go, as forms 0 and 1; a check in flight is not failed by a refused one.
    const inFlight = client.allow("user:1", "rule", 1);
    await assert.rejects(client.peek("user:1", "rule"), said);
    assert.equal((await inFlight).origin.kind, "agent");
    assert.equal((await client.check([{ key: "user:1", ruleId: "rule", mode: "consume" }])).origin.kind, "agent");
    assert.deepEqual(
      fake.received.map((f) => f.body.kind),
      ["hello", "check", "check"],
    );
    assert.deepEqual(
      checkBodies(fake).map((b) => b.slice(0, 2)),
      ["00", "00"],
    );
    assert.equal(fake.connections, 1);
    assert.ok(client.isConnected());
  });

  it("an invalid peek or charge rejects before the version matters; without an agent they answer by policy", async () => {
    const { fake, client } = await setup(1);
    await assert.rejects(client.charge("user:1", "rule", 0), /cost must be an integer from 1/);
    await assert.rejects(client.peek("user:1", "rule", -1), /a peek's cost must be an integer from 0/);
    // No connection: a peek and a charge are decided as any check is (the agent may return speaking 2).
    fake.goAway();
    await eventually("the client to see the agent gone", 5_000, () => !client.isConnected());
    assert.deepEqual((await client.peek("user:1", "rule")).origin, { kind: "failOpen", reason: "unavailable" });
    const closed = await client.charge("user:1", "rule", 10, { fail: "closed" });
    assert.deepEqual([closed.allowed, closed.origin], [false, { kind: "failClosed", reason: "unavailable" }]);
  });

  it("while a version-2 agent is away, a peek under its fail-closed rule is denied like any check", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = 2;
    fake.failModeList = {
      rulesVersion: 1,
      truncated: false,
      rules: [{ ruleId: "tokens", dimension: "user", endpoint: "", tier: "", limit: 50 }],
    };
    const client = await Client.connect(fake.path, { timeoutMs: LONG });
    clients.push(client);
    await eventually("the list", 5_000, () => client.health().rulesVersion === 1);
    fake.goAway();
    await eventually("the client to see the agent gone", 5_000, () => !client.isConnected());
    const peek = await client.peek("user:1", "tokens");
    assert.deepEqual([peek.allowed, peek.origin.kind, peek.limit], [false, "failClosed", 50]);
    const charge = await client.charge("user:1", "tokens", 10);
    assert.deepEqual([charge.allowed, charge.origin.kind], [false, "failClosed"]);
    assert.equal((await client.peek("user:1", "other")).origin.kind, "failOpen");
  });
});
