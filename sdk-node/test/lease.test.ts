/**
 * Leases of concurrency rules (protocol version 3) from the client: acquire, release and hold
 * against real agents on the embedded store and on Redis; their bytes and their refusal by an older
 * agent on a fake one; and their answers while the agent is away.
 */

import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Client, FloodgateError, newLeaseId, type Decision, type Lease } from "../src/index";
import {
  Agent,
  checkBodies,
  FakeAgent,
  isAcquire,
  leaseDecision,
  modeAndLease,
  nextCheck,
  RedisServer,
  tempDir,
  unique,
  within,
} from "./helpers";

const RULES = `
# Two units in flight per user; item checks only (no attribute check sends this endpoint).
[[rules]]
id = "c-slots"
dimension = "user"
match = { endpoint = "/conc-only" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 30

# A rate on the same endpoint: a lease means nothing to it.
[[rules]]
id = "c-window"
dimension = "user"
match = { endpoint = "/conc-only" }
limit = 5
windowSeconds = 60
`;

/** A call's timeout where the test is about figures, not latency (a loaded 2-core box may be slow). */
const PATIENT = { timeoutMs: 5_000 };

/** Leases are bigints, which JSON refuses: as hex text in assertion messages. */
const show = (x: unknown) => JSON.stringify(x, (_k, y: unknown) => (typeof y === "bigint" ? `0x${y.toString(16)}` : y));

function clientSuite(store: "embedded" | "redis"): void {
  describe(`acquire, release and hold against a real agent (${store} store)`, () => {
    let redis: RedisServer | undefined;
    let agent: Agent;
    let client: Client;
    const source = store === "redis" ? "redis" : "local";

    before(async () => {
      if (store === "redis") redis = await RedisServer.start();
      agent = await Agent.start({ rules: RULES, redis: redis?.url });
      client = await Client.connect(agent.socket, PATIENT);
    });
    after(async () => {
      client?.close();
      await agent?.stop();
      await redis?.stop();
    });

    /** The units free now for `key`: a peek of cost 0 changes nothing. */
    const free = async (key: string) => (await client.peek(key, "c-slots", 0)).remaining;

    it("two acquires hold a slot each; a third is denied within 1 s, without a lease; a release frees one", async () => {
      assert.equal(client.protocolVersion, 6);
      const key = `user:${unique()}`;
      const t0 = Date.now();
      const a = await client.acquire(key, "c-slots");
      const b = await client.acquire(key, "c-slots");
      for (const [x, left] of [
        [a, 1],
        [b, 0],
      ] as const) {
        assert.deepEqual([x.decision.allowed, x.decision.limit, x.decision.remaining], [true, 2, left], show(x));
        assert.deepEqual(x.decision.origin, { kind: "agent", source });
        assert.equal(x.decision.items[0].verdict.holdsLease, true);
        assert.equal(x.decision.items[0].windowMs, 0, "a concurrency rule has no window");
        assert.ok(x.lease, "the lease is returned");
        assert.deepEqual([x.lease.key, x.lease.ruleId, x.lease.cost], [key, "c-slots", 1]);
        assert.equal(typeof x.lease.id, "bigint");
        assert.notEqual(x.lease.id, 0n);
        // A lease just taken ends leaseSeconds (30 s) from now.
        assert.ok(
          x.decision.resetAtMs >= t0 + 29_000 && x.decision.resetAtMs <= Date.now() + 31_000,
          `reset ${x.decision.resetAtMs}`,
        );
      }
      assert.notEqual(a.lease!.id, b.lease!.id);

      const c = await client.acquire(key, "c-slots");
      assert.equal(c.decision.allowed, false);
      assert.equal(c.lease, undefined, "a denied acquire holds nothing");
      assert.equal(c.decision.items[0].verdict.holdsLease, false);
      assert.ok(c.decision.retryAfterMs! >= 1 && c.decision.retryAfterMs! <= 1000, `retry ${c.decision.retryAfterMs}`);

      const r = await client.release(a.lease!);
      assert.deepEqual([r.allowed, r.limit, r.remaining], [true, 2, 1], show(r));
      assert.deepEqual(r.origin, { kind: "agent", source });
      // A lease released already changes nothing.
      assert.equal((await client.release(a.lease!)).remaining, 1);
      assert.equal(await free(key), 1);
      const d = await client.acquire(key, "c-slots");
      assert.ok(d.decision.allowed && d.lease, show(d));
      assert.equal((await client.acquire(key, "c-slots")).decision.allowed, false);
      await client.release(b.lease!);
      await client.release(d.lease);
      assert.equal(await free(key), 2);
    });

    it("an acquire of cost 2 holds two units, and its release gives both back", async () => {
      const key = `user:${unique()}`;
      const two = await client.acquire(key, "c-slots", 2);
      assert.deepEqual([two.decision.allowed, two.decision.remaining, two.lease?.cost], [true, 0, 2]);
      assert.equal((await client.acquire(key, "c-slots")).decision.allowed, false);
      assert.equal((await client.release(two.lease!)).remaining, 2);
    });

    it("hold runs fn while holding and releases after, when fn throws too; a denied hold never runs fn", async () => {
      const key = `user:${unique()}`;
      const held = await client.hold(key, "c-slots", 1, async (d: Decision) => {
        assert.equal(await free(key), 1, "one unit held while fn runs");
        return d.remaining;
      });
      assert.ok(held.allowed);
      assert.equal(held.value, 1);
      assert.equal(held.decision.remaining, 1);
      assert.equal(await free(key), 2, "released before hold resolved");

      await assert.rejects(
        client.hold(key, "c-slots", 2, () => {
          throw new Error("boom");
        }),
        /boom/,
      );
      assert.equal(await free(key), 2, "released after fn threw");

      const a = await client.acquire(key, "c-slots", 2);
      assert.ok(a.lease);
      let ran = false;
      const denied = await client.hold(key, "c-slots", 1, () => {
        ran = true;
      });
      assert.equal(denied.allowed, false);
      assert.equal(ran, false);
      assert.ok(!("value" in denied));
      assert.ok(denied.decision.retryAfterMs! >= 1 && denied.decision.retryAfterMs! <= 1000);
      await client.release(a.lease);
      assert.equal(await free(key), 2);
    });

    it("on a rule of another algorithm an acquire is a plain consume: no lease", async () => {
      const key = `user:${unique()}`;
      const a = await client.acquire(key, "c-window");
      assert.deepEqual([a.decision.allowed, a.decision.limit, a.decision.remaining, a.lease], [true, 5, 4, undefined]);
      assert.equal(a.decision.items[0].windowMs, 60_000, "the rate rule's window (version 4)");
      // A release there is answered as a peek: nothing given back, nothing taken.
      const r = await client.release({ key, ruleId: "c-window", cost: 1, id: 7n });
      assert.deepEqual([r.allowed, r.remaining], [true, 4]);
      assert.equal((await client.allow(key, "c-window", 1)).remaining, 3);
    });
  });
}

clientSuite("embedded");
clientSuite("redis");

// ---------------------------------------------------------------------------------------------
// A fake agent: the bytes, and agents of older versions.

describe("leases on a fake agent", () => {
  const clients: Client[] = [];
  const fakes: FakeAgent[] = [];
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  async function setup(helloVersion: number, holds = true) {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = helloVersion;
    fake.onCheck = (f, sock) => sock.write(leaseDecision(f.requestId, holds && isAcquire(f)));
    const client = await Client.connect(fake.path, { timeoutMs: 5_000, logger: null });
    clients.push(client);
    assert.ok(client.isConnected());
    return { fake, client };
  }

  it("a version-3 agent gets an acquire as form 2 with the lease bit, and the release with the same lease", async () => {
    const { fake, client } = await setup(3);
    assert.equal(client.protocolVersion, 3);
    const a = await client.acquire("user:1", "slots", 2);
    assert.ok(a.lease, "the item holds the lease");
    const r = await client.release(a.lease);
    assert.equal(r.origin.kind, "agent");
    const id = a.lease.id.toString(16).padStart(16, "0");
    const item = "0006" + Buffer.from("user:1").toString("hex") + "05" + Buffer.from("slots").toString("hex") + "00000002";
    assert.deepEqual(checkBodies(fake), [`0201${item}80${id}`, `0201${item}83${id}`]);
    // Check frames carry version byte 1 whatever their form (the version that introduced the kind).
    assert.ok(fake.receivedBytes.filter((b) => b[5] === 0x03).every((b) => b[4] === 1));
    // Hello offered 1..6 (the agent chose 3).
    const hello = fake.received[0];
    assert.ok(hello.body.kind === "hello" && hello.body.minVersion === 1 && hello.body.maxVersion === 6);
  });

  it("no lease is returned when no item holds it, and nothing is released", async () => {
    const { fake, client } = await setup(3, false);
    const a = await client.acquire("user:1", "slots");
    assert.deepEqual([a.decision.allowed, a.decision.origin.kind, a.lease], [true, "agent", undefined]);
    let ran = 0;
    const h = await client.hold("user:1", "slots", 1, () => ++ran);
    assert.deepEqual([h.allowed, ran], [true, 1]);
    // A fence: a release would have been written before this check, on the same connection.
    assert.equal((await client.allow("user:1", "slots")).origin.kind, "agent");
    assert.deepEqual(
      fake.received.filter((f) => f.body.kind === "check").map((f) => modeAndLease(f).mode),
      ["consume", "consume", "consume"],
      "the agent answered that nothing is held: no release",
    );
  });

  it("an acquire the agent does not answer in time: the fail policy, no lease, and its release sent at once, byte for byte", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = 3;
    // Never answers a check carrying a lease (an acquire, or the release that follows); answers others.
    fake.onCheck = (f, sock) => {
      if (modeAndLease(f).lease === undefined) sock.write(leaseDecision(f.requestId, false));
    };
    const warnings: string[] = [];
    const debugs: string[] = [];
    let debugged = () => {};
    const client = await Client.connect(fake.path, {
      timeoutMs: 100,
      logger: {
        warn: (m) => warnings.push(m),
        debug: (m) => {
          debugs.push(m);
          debugged();
        },
      },
    });
    clients.push(client);
    assert.equal(client.protocolVersion, 3);
    const isRelease = (f: Parameters<typeof modeAndLease>[0]) => modeAndLease(f).mode === "release";
    const item = (cost: number) =>
      "0006" + Buffer.from("user:1").toString("hex") + "05" + Buffer.from("slots").toString("hex") + cost.toString(16).padStart(8, "0");

    const cases: [string, () => Promise<{ allowed: boolean; origin: unknown; lease?: unknown }>, number, boolean][] = [
      ["acquire, fail open", async () => {
        const a = await client.acquire("user:1", "slots", 2);
        return { allowed: a.decision.allowed, origin: a.decision.origin, lease: a.lease };
      }, 2, true],
      ["acquire, fail closed", async () => {
        const a = await client.acquire("user:1", "slots", 1, { fail: "closed" });
        return { allowed: a.decision.allowed, origin: a.decision.origin, lease: a.lease };
      }, 1, false],
      ["hold, fail open", async () => {
        let ran = 0;
        const h = await client.hold("user:1", "slots", 3, () => ++ran);
        assert.deepEqual([h.allowed, ran], [true, 1], "fail open: fn runs");
        return { allowed: h.allowed, origin: h.decision.origin };
      }, 3, true],
    ];
    for (const [name, call, cost, allowed] of cases) {
      const released = nextCheck(fake, `the release after ${name}`, 10_000, isRelease);
      const before = fake.received.length;
      const d = await call();
      assert.deepEqual([d.allowed, d.origin, d.lease], [
        allowed,
        { kind: allowed ? "failOpen" : "failClosed", reason: "timeout" },
        undefined,
      ], name);
      const r = await released;
      // The acquire's bytes, then the release's: the same item and lease, mode 3; cost ≥ 1.
      const i = fake.received.findIndex((f, j) => j >= before && f.body.kind === "check" && !isRelease(f));
      const acquire = fake.receivedBytes[i].subarray(10).toString("hex");
      const id = modeAndLease(fake.received[i]).lease!.toString(16).padStart(16, "0");
      assert.equal(acquire, `0201${item(cost)}80${id}`, name);
      assert.equal(r.body, `0201${item(cost)}83${id}`, name);
      assert.ok(modeAndLease(r.frame).cost >= 1);
    }
    // Three acquires, three releases: nothing else was sent (hold has no lease of its own to release).
    const modes = fake.received.filter((f) => f.body.kind === "check").map((f) => modeAndLease(f).mode);
    assert.deepEqual(modes, ["consume", "release", "consume", "release", "consume", "release"]);
    // The releases time out too: logged at debug level only, never warned about.
    await within(
      "three debug lines",
      10_000,
      new Promise<void>((resolve) => {
        debugged = () => debugs.filter((m) => m.includes("precautionary")).length >= 3 && resolve();
        debugged();
      }),
    );
    assert.deepEqual(warnings, []);
  });

  it("lease ids are random, nonzero 64-bit values", () => {
    const ids = new Set<bigint>();
    for (let i = 0; i < 2000; i++) {
      const id = newLeaseId();
      assert.ok(id > 0n && id < 2n ** 64n);
      ids.add(id);
    }
    assert.equal(ids.size, 2000);
    // Uniform 64-bit values: about half of them have the top bit set.
    const high = [...ids].filter((id) => id >= 2n ** 63n).length;
    assert.ok(high > 800 && high < 1200, `${high} of 2000`);
  });

  for (const version of [1, 2]) {
    it(`a version-${version} agent never gets a lease: acquire, release and hold reject, saying so`, async () => {
      const { fake, client } = await setup(version);
      const said = (e: unknown) => {
        assert.ok(e instanceof FloodgateError);
        assert.equal(e.kind, "invalid");
        assert.equal(
          e.message,
          `invalid check: the agent speaks protocol version ${version}: it cannot hold leases (update the agent)`,
        );
        return true;
      };
      await assert.rejects(client.acquire("user:1", "slots"), said);
      await assert.rejects(client.release({ key: "user:1", ruleId: "slots", cost: 1, id: 5n }), said);
      let ran = false;
      await assert.rejects(
        client.hold("user:1", "slots", 1, () => {
          ran = true;
        }),
        said,
      );
      assert.equal(ran, false);
      await assert.rejects(client.check([{ key: "user:1", ruleId: "slots", mode: "release" }]), said);
      await assert.rejects(client.checkAttributes({ user: "1", lease: 1n }), said);
      // Nothing was sent; the connection stays and consume checks still go.
      assert.equal((await client.allow("user:1", "slots")).origin.kind, "agent");
      assert.deepEqual(
        fake.received.map((f) => f.body.kind).filter((k) => k !== "failModes"),
        ["hello", "check"],
      );
      assert.deepEqual(
        checkBodies(fake).map((b) => b.slice(0, 2)),
        ["00"],
      );
      assert.equal(fake.connections, 1);
      assert.ok(client.isConnected());
    });
  }
});

describe("leases while the agent is away", () => {
  const missing = `${tempDir()}/nobody-here.sock`;
  const lease: Lease = { key: "user:1", ruleId: "slots", cost: 1, id: 99n };

  it("acquire decides by the fail policy and holds nothing; release resolves with the degraded decision", async () => {
    const client = await Client.connect(missing, { logger: null });
    try {
      assert.equal(client.protocolVersion, 0);
      const open = await client.acquire("user:1", "slots");
      assert.deepEqual([open.decision.allowed, open.decision.origin, open.lease], [
        true,
        { kind: "failOpen", reason: "unavailable" },
        undefined,
      ]);
      const closed = await client.acquire("user:1", "slots", 1, { fail: "closed" });
      assert.deepEqual([closed.decision.allowed, closed.decision.origin.kind, closed.lease], [false, "failClosed", undefined]);
      const r = await client.release(lease);
      assert.deepEqual([r.allowed, r.origin], [true, { kind: "failOpen", reason: "unavailable" }]);
      let ran = 0;
      const h = await client.hold("user:1", "slots", 1, () => ++ran);
      assert.deepEqual([h.allowed, ran], [true, 1], "fail open: fn runs, nothing to release");
      const hc = await client.hold("user:1", "slots", 1, () => ++ran, { fail: "closed" });
      assert.deepEqual([hc.allowed, ran], [false, 1]);
    } finally {
      client.close();
    }
  });

  it("the fallback limit counts an acquire as a consume, and a release not at all", async () => {
    const client = await Client.connect(missing, { logger: null, fallbackLimit: { limit: 1, perMs: 60_000 } });
    try {
      const first = await client.acquire("user:1", "slots");
      assert.deepEqual([first.decision.allowed, first.decision.origin.kind, first.lease], [true, "localLimit", undefined]);
      for (let i = 0; i < 3; i++) {
        const r = await client.release({ ...lease, id: BigInt(i + 1) });
        assert.deepEqual(r.origin, { kind: "failOpen", reason: "unavailable" }, "a release passes the limit by");
      }
      const second = await client.acquire("user:1", "slots");
      assert.deepEqual([second.decision.allowed, second.decision.origin.kind], [false, "localLimit"]);
      assert.equal(client.stats().localDenied, 1);
    } finally {
      client.close();
    }
  });
});
