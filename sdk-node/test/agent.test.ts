/**
 * The client against a real `floodgate agent` process, on its embedded store and on a redis-server
 * of the test's own: figures, all-or-nothing, log mode, attributes, peek and charge, a pipelined
 * burst on one connection, the agent stopped (SIGSTOP) and killed and restarted.
 */

import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Client, FloodgateError, type Decision } from "../src/index";
import { Agent, eventually, RedisServer, unique } from "./helpers";

export const RULES = `
# Rules the tests name in item checks carry a match no attribute check sends, so that the attribute
# test sees only its own rules.
[[rules]]
id = "t-window"
dimension = "user"
match = { endpoint = "/items-only" }
limit = 3
windowSeconds = 60

[[rules]]
id = "t-bucket"
dimension = "user"
match = { endpoint = "/items-only" }
limit = 10
windowSeconds = 10
burst = 2
algorithm = "token_bucket"

[[rules]]
id = "t-log"
dimension = "user"
match = { endpoint = "/items-only" }
limit = 1
windowSeconds = 60
mode = "log"

[[rules]]
id = "t-five"
dimension = "user"
match = { endpoint = "/items-only" }
limit = 5
windowSeconds = 60

[[rules]]
id = "t-big"
dimension = "user"
match = { endpoint = "/items-only" }
limit = 1000000
windowSeconds = 60

[[rules]]
id = "t-attr"
dimension = "user"
match = { endpoint = "/attr/*" }
limit = 5
windowSeconds = 60

[[rules]]
id = "t-attr-dry"
dimension = "user"
match = { endpoint = "/attr/*" }
limit = 1
windowSeconds = 60
mode = "log"
`;

/** "Promptly" on a loaded 2-core machine: far below the multi-second waits a hung call would show. */
const PROMPT_MS = 1_000;
/** A call's timeout where the test is about figures, not latency (a loaded CI box may be slow). */
const PATIENT = { timeoutMs: 5_000 };

async function timed<T>(p: Promise<T>): Promise<[T, number]> {
  const t = performance.now();
  const v = await p;
  return [v, performance.now() - t];
}

function suite(store: "embedded" | "redis"): void {
  describe(`client against a real agent (${store} store)`, () => {
    let redis: RedisServer | undefined;
    let agent: Agent;
    let client: Client;
    const source = store === "redis" ? "redis" : "local";

    before(async () => {
      if (store === "redis") redis = await RedisServer.start();
      agent = await Agent.start({ rules: RULES, redis: redis?.url });
      client = await Client.connect(agent.socket);
    });
    after(async () => {
      client?.close();
      await agent?.stop();
      await redis?.stop();
    });

    it("allows up to the limit with the figures, then denies with a retry-after", async () => {
      assert.ok(client.isConnected());
      assert.equal(client.protocolVersion, 6, "the agent speaks version 6: decisions name each rule's window, checks may carry a trace");
      const key = `user:${unique()}`;
      const t0 = Date.now();
      const ds: Decision[] = [];
      for (let i = 0; i < 4; i++) ds.push(await client.allow(key, "t-window", 1, PATIENT));
      assert.deepEqual(
        ds.map((d) => [d.allowed, d.limit, d.remaining]),
        [
          [true, 3, 2],
          [true, 3, 1],
          [true, 3, 0],
          [false, 3, 0],
        ],
      );
      for (const d of ds.slice(0, 3)) {
        assert.deepEqual(d.origin, { kind: "agent", source });
        assert.equal(d.source, source);
        assert.equal(d.retryAfterMs, undefined);
        assert.equal(d.logOnly, false);
        assert.equal(d.items.length, 1);
        assert.equal(d.items[0].ruleId, "t-window");
        assert.equal(d.items[0].windowMs, 60_000, "windowSeconds = 60");
        // The sliding window's reset is the end of the window after the current one: within two
        // 60 s windows of now (the agent's clock is this machine's; 1 s for clock reads in between).
        assert.ok(d.resetAtMs > t0 && d.resetAtMs <= Date.now() + 120_000 + 1_000, `reset ${d.resetAtMs}`);
      }
      const denied = ds[3];
      assert.ok(denied.retryAfterMs !== undefined && denied.retryAfterMs >= 1 && denied.retryAfterMs <= 120_000);
      assert.equal(denied.items[0].verdict.allowed, false);
      assert.ok(["local", "redis", "cache"].includes(denied.source!));
    });

    it("a check is all or nothing: a denial consumes nothing from its other items", async () => {
      const full = `user:${unique()}`;
      const fresh = `user:${unique()}`;
      for (let i = 0; i < 3; i++) assert.ok((await client.allow(full, "t-window", 1, PATIENT)).allowed);
      const both = await client.check(
        [
          { key: fresh, ruleId: "t-window", cost: 2 },
          { key: full, ruleId: "t-window" },
        ],
        PATIENT,
      );
      assert.equal(both.allowed, false);
      assert.equal(both.items.length, 2);
      assert.equal(both.items[0].verdict.allowed, true);
      assert.equal(both.items[1].verdict.allowed, false);
      const after = await client.allow(fresh, "t-window", 1, PATIENT);
      assert.equal(after.remaining, 2, "the denied check took nothing from the fresh key");
    });

    it("a token bucket's retry-after is the refill time of what is missing", async () => {
      const key = `user:${unique()}`;
      assert.ok((await client.allow(key, "t-bucket", 1, PATIENT)).allowed);
      assert.ok((await client.allow(key, "t-bucket", 1, PATIENT)).allowed);
      const d = await client.allow(key, "t-bucket", 1, PATIENT);
      assert.equal(d.allowed, false);
      assert.equal(d.limit, 2, "a bucket's limit is its capacity (burst)");
      assert.equal(d.items[0].windowMs, 10_000, "a bucket's window is its windowSeconds");
      // 10 per 10 s refills one unit a second: one missing unit is back within 1000 ms.
      assert.ok(d.retryAfterMs! >= 1 && d.retryAfterMs! <= 1000, `retry ${d.retryAfterMs}`);
    });

    it("log-mode rules report and never deny", async () => {
      const key = `user:${unique()}`;
      const first = await client.allow(key, "t-log", 1, PATIENT);
      const second = await client.allow(key, "t-log", 1, PATIENT);
      assert.equal(first.allowed, true);
      assert.equal(second.allowed, true);
      assert.equal(second.logOnly, true);
      assert.equal(second.items[0].verdict.logOnly, true);
      assert.equal(second.items[0].verdict.allowed, false, "the item would have been denied");
    });

    it("a peek changes nothing; a charge commits past the limit, and a consume is then denied", async () => {
      const key = `user:${unique()}`;
      for (let i = 0; i < 3; i++) assert.ok((await client.allow(key, "t-five", 1, PATIENT)).allowed);
      for (let i = 0; i < 2; i++) {
        const p = await client.peek(key, "t-five", 0, PATIENT);
        assert.deepEqual([p.allowed, p.limit, p.remaining, p.retryAfterMs], [true, 5, 2, undefined], `peek ${i + 1}`);
        assert.deepEqual(p.origin, { kind: "agent", source });
      }
      // 3 + 10 is past the limit of 5: taken all the same, and never a rejection.
      const c = await client.charge(key, "t-five", 10, PATIENT);
      assert.deepEqual([c.allowed, c.limit, c.remaining, c.retryAfterMs], [true, 5, 0, undefined]);
      const d = await client.allow(key, "t-five", 1, PATIENT);
      assert.equal(d.allowed, false);
      assert.ok(d.retryAfterMs !== undefined && d.retryAfterMs > 0, `retry ${d.retryAfterMs}`);
    });

    it("an unknown rule rejects with the agent's code 4; an invalid item never leaves the process", async () => {
      await assert.rejects(client.allow("user:1", "no-such-rule", 1, PATIENT), (e: unknown) => {
        assert.ok(e instanceof FloodgateError);
        assert.equal(e.kind, "agent");
        assert.equal(e.code, 4);
        return true;
      });
      await assert.rejects(client.allow("k".repeat(257), "t-window"), (e: unknown) => e instanceof FloodgateError && e.kind === "invalid");
      assert.ok(client.isConnected(), "a refusal keeps the connection");
    });

    it("attribute checks: every matching rule, the enforced one binding; no match is limit 0", async () => {
      const user = unique();
      const a = await client.checkAttributes({ endpoint: "/attr/x", user }, PATIENT);
      const b = await client.checkAttributes({ endpoint: "/attr/x", user, cost: 2 }, PATIENT);
      assert.deepEqual(a.items.map((i) => i.ruleId).sort(), ["t-attr", "t-attr-dry"]);
      assert.deepEqual([a.allowed, a.limit, a.remaining], [true, 5, 4]);
      // The dry run's limit of 1 is exceeded by b, which passes: it carries the enforced figures.
      assert.deepEqual([b.allowed, b.limit, b.remaining, b.logOnly], [true, 5, 2, false]);
      const dry = b.items.find((i) => i.ruleId === "t-attr-dry")!;
      assert.deepEqual([dry.verdict.allowed, dry.verdict.logOnly], [false, true]);
      // Each matched rule names its own window, the log-mode one's too (windowSeconds = 60 both).
      assert.deepEqual(b.items.map((i) => i.windowMs), [60_000, 60_000]);
      const none = await client.checkAttributes({ endpoint: "/elsewhere", user }, PATIENT);
      assert.deepEqual([none.allowed, none.limit, none.items.length], [true, 0, 0]);
    });

    it("a burst of 2,000 pipelined checks on one connection, each answer for its own call", async () => {
      const connects = client.stats().connects;
      const run = unique();
      // Each call its own key and a cost only it asks for: its `remaining` proves the answer is its own.
      const calls = Array.from({ length: 2000 }, (_, i) =>
        client.allow(`user:${run}:${i}`, "t-big", 1 + (i % 997), PATIENT),
      );
      const ds = await Promise.all(calls);
      ds.forEach((d, i) => {
        assert.deepEqual(d.origin, { kind: "agent", source }, `call ${i}`);
        assert.equal(d.remaining, 1_000_000 - (1 + (i % 997)), `call ${i}`);
      });
      assert.equal(client.stats().connects, connects, "one connection throughout");
      assert.equal(client.stats().timeouts, 0);
    });

    it("a stopped agent (SIGSTOP): calls answer by their fail policy within their timeout", async () => {
      const c = await Client.connect(agent.socket, { timeoutMs: 50 });
      const key = `user:${unique()}`;
      try {
        assert.equal((await c.allow(key, "t-big", 1, PATIENT)).origin.kind, "agent");
        agent.signal("SIGSTOP");
        try {
          await agent.stopped();
          const [open, ms] = await timed(c.allow(key, "t-big"));
          assert.deepEqual(open.origin, { kind: "failOpen", reason: "timeout" });
          assert.equal(open.allowed, true);
          // The call waited its 50 ms for the agent and no longer. The lower bound leaves 5 ms because
          // timers run on the loop's clock, read once per turn; the upper bound allows event-loop
          // lateness on a loaded 2-core machine. The agent stays stopped until after these asserts,
          // so a call waiting for it would not return at all.
          assert.ok(ms >= 45 && ms < 50 + PROMPT_MS, `answered after ${ms} ms`);
          const [closed, ms2] = await timed(c.allow(key, "t-big", 1, { fail: "closed" }));
          assert.deepEqual(closed.origin, { kind: "failClosed", reason: "timeout" });
          assert.equal(closed.allowed, false);
          assert.equal(closed.retryAfterMs, 1000);
          assert.ok(ms2 < 50 + PROMPT_MS);
          const burst = await Promise.all(Array.from({ length: 50 }, () => c.allow(key, "t-big")));
          assert.ok(burst.every((d) => d.origin.kind === "failOpen" && d.allowed));
          assert.equal(c.stats().timeouts, 52);
        } finally {
          agent.signal("SIGCONT");
        }
        // The agent now answers the 52 stale requests too; they are dropped, and new calls get answers.
        await eventually("an agent answer after SIGCONT", 10_000, async () => {
          const d = await c.allow(key, "t-big", 1, PATIENT);
          return d.origin.kind === "agent";
        });
        assert.equal(c.stats().connects, 1, "the stop did not cost the connection");
      } finally {
        c.close();
      }
    });

    it("a killed and restarted agent: calls answer by policy at once, then the client reconnects", async () => {
      const c = await Client.connect(agent.socket);
      const key = `user:${unique()}`;
      try {
        assert.equal((await c.allow(key, "t-window", 1, PATIENT)).remaining, 2);
        assert.equal((await c.allow(key, "t-window", 1, PATIENT)).remaining, 1);
        await agent.kill();
        await eventually("the client to see the connection gone", 5_000, () => !c.isConnected());
        const [d, ms] = await timed(c.allow(key, "t-window", 1, PATIENT));
        assert.deepEqual(d.origin, { kind: "failOpen", reason: "unavailable" });
        assert.ok(ms < PROMPT_MS, `answered after ${ms} ms: it should not wait for a dead agent`);
        const closed = await c.allow(key, "t-window", 1, { fail: "closed" });
        assert.deepEqual(closed.origin, { kind: "failClosed", reason: "unavailable" });
        await agent.restart();
        await eventually("the client to reconnect", 10_000, () => c.isConnected());
        const back = await c.allow(key, "t-window", 1, PATIENT);
        assert.equal(back.origin.kind, "agent");
        // On Redis the count outlives the agent; the embedded store starts afresh.
        assert.equal(back.remaining, store === "redis" ? 0 : 2);
        assert.equal(c.stats().connects, 2);
        // The suite's shared client reconnects too.
        await eventually("the shared client to reconnect", 10_000, () => client.isConnected());
      } finally {
        c.close();
      }
    });
  });
}

suite("embedded");
suite("redis");
