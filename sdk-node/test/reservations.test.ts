/**
 * Reservations (protocol version 6) from the client: reserve, reserveMeters and commit against real
 * agents on the embedded store and on Redis; their bytes, the precautionary commit of a reserve the
 * agent did not answer, and their refusal by an older agent on a fake one; and their answers while
 * the agent is away.
 */

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { after, before, describe, it } from "node:test";

import {
  Client,
  encodeFrame,
  FloodgateError,
  type Decision,
  type Frame,
  type ItemDecision,
  type Reservation,
  type Verdict,
} from "../src/index";
import { Agent, checkBodies, FakeAgent, nextCheck, RedisServer, REPO, sleep, tempDir, unique } from "./helpers";

const RULES = `
# A budget metered per request, reserved before and committed after; item checks only (no
# attribute check sends this endpoint).
[[rules]]
id = "rs-tokens"
dimension = "api_key"
match = { endpoint = "/reserve-only" }
limit = 1000
windowSeconds = 60
reservationSeconds = 30

# Requests in flight, reserved with the tokens: a concurrency rule's reservation is a lease.
[[rules]]
id = "rs-inflight"
dimension = "api_key"
match = { endpoint = "/reserve-only" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 30

# A small budget whose expired reservations go back.
[[rules]]
id = "rs-budget"
dimension = "api_key"
match = { endpoint = "/reserve-only" }
limit = 100
windowSeconds = 60
reservationExpiry = "release"
`;

/** The rate rules' window (60 s). */
const WINDOW_MS = 60_000;

/** A call's timeout where the test is about figures, not latency (a loaded 2-core box may be slow). */
const PATIENT = { timeoutMs: 5_000 };

/** Reservation ids are bigints, which JSON refuses: as hex text in assertion messages. */
const show = (x: unknown) => JSON.stringify(x, (_k, y: unknown) => (typeof y === "bigint" ? `0x${y.toString(16)}` : y));

/**
 * Waits, when less than `needMs` of the current 60-s window is left, until the next one starts. The
 * sliding window is aligned to the epoch (`now / window`), and a test's figures assume its fresh
 * key's counts stay in one window: a commit after the edge gives back to the window before, which
 * the estimate then weighs down. 10 s is far more than a test's dozen calls take, even loaded.
 */
async function clearOfWindowEdge(needMs = 10_000): Promise<void> {
  const left = WINDOW_MS - (Date.now() % WINDOW_MS);
  if (left < needMs) await sleep(left + 50);
}

function clientSuite(store: "embedded" | "redis"): void {
  describe(`reserve, reserveMeters and commit against a real agent (${store} store)`, () => {
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

    /** What is left for `key` under `ruleId` now: a peek of cost 0 changes nothing. */
    const left = async (key: string, ruleId: string) => {
      const d = await client.peek(key, ruleId, 0);
      assert.deepEqual(d.origin, { kind: "agent", source }, show(d));
      return d.remaining;
    };

    it("a reserve of 400 counts at once; a commit of 150 gives 250 back; a second commit changes nothing", async () => {
      assert.equal(client.protocolVersion, 6, "the agent speaks version 6");
      await clearOfWindowEdge();
      const key = `apikey:${unique()}`;
      const { decision, reservation } = await client.reserve(key, "rs-tokens", 400);
      assert.deepEqual([decision.allowed, decision.limit, decision.remaining], [true, 1000, 600], show(decision));
      assert.deepEqual(decision.origin, { kind: "agent", source });
      assert.equal(decision.items[0].verdict.holdsLease, true, "the agent holds the reservation");
      assert.ok(reservation, "the reservation is returned");
      assert.equal(typeof reservation.id, "bigint");
      assert.notEqual(reservation.id, 0n);
      assert.deepEqual(reservation.meters, [{ key, ruleId: "rs-tokens", units: 400 }]);
      assert.equal(await left(key, "rs-tokens"), 600, "the reservation is counted at once");

      const c = await client.commit(reservation, [150]);
      assert.deepEqual([c.allowed, c.remaining], [true, 850], show(c));
      assert.deepEqual(c.origin, { kind: "agent", source });
      assert.equal(await left(key, "rs-tokens"), 850, "250 unused units came back");

      // A retry of the commit finds nothing held: nothing is given back twice, and under the
      // rule's default reservationExpiry ("charge") nothing is charged either.
      const again = await client.commit(reservation, [150]);
      assert.equal(again.allowed, true, show(again));
      assert.equal(await left(key, "rs-tokens"), 850);
    });

    it("a use past the reservation is charged, never refused", async () => {
      await clearOfWindowEdge();
      const key = `apikey:${unique()}`;
      const { reservation } = await client.reserve(key, "rs-tokens", 100);
      assert.ok(reservation);
      const c = await client.commit(reservation, [300]);
      assert.deepEqual([c.allowed, c.remaining], [true, 700], show(c));
      assert.equal(await left(key, "rs-tokens"), 700);
    });

    it("several meters are reserved all or nothing: a full concurrency rule or budget refuses every one", async () => {
      await clearOfWindowEdge();
      const key = `apikey:${unique()}`;
      const meters = (tokens: number) => [
        { key, ruleId: "rs-tokens", units: tokens },
        { key, ruleId: "rs-inflight", units: 1 },
      ];
      const a = await client.reserveMeters(meters(300));
      const b = await client.reserveMeters(meters(300));
      for (const [x, tokens, slots] of [
        [a, 700, 1],
        [b, 400, 0],
      ] as const) {
        assert.equal(x.decision.allowed, true, show(x));
        assert.ok(x.reservation, show(x));
        assert.deepEqual(x.reservation.meters, meters(300));
        assert.deepEqual(
          x.decision.items.map((i: ItemDecision) => [i.ruleId, i.verdict.holdsLease, i.verdict.remaining]),
          [
            ["rs-tokens", true, tokens],
            ["rs-inflight", true, slots],
          ],
        );
      }
      assert.notEqual(a.reservation!.id, b.reservation!.id);

      // Both slots held: a third is refused whole, its 100 tokens not taken.
      const full = await client.reserveMeters(meters(100));
      assert.equal(full.decision.allowed, false, show(full));
      assert.equal(full.reservation, undefined, "a refusal reserves nothing");
      assert.ok(full.decision.retryAfterMs! >= 1 && full.decision.retryAfterMs! <= 1000, `retry ${full.decision.retryAfterMs}`);
      assert.equal(await left(key, "rs-tokens"), 400);

      // A commit names one figure per meter: anything else is refused before it is sent.
      for (const used of [[100], [100, 0, 0], []]) {
        await assert.rejects(client.commit(a.reservation!, used), (e: unknown) => {
          assert.ok(e instanceof FloodgateError);
          assert.equal(e.kind, "invalid");
          assert.match(e.message, new RegExp(`^invalid commit: ${used.length} figures? for a reservation of 2 meters`));
          return true;
        });
      }
      assert.equal(await left(key, "rs-tokens"), 400, "nothing committed");

      // The first request used 100 tokens: 200 go back, and its slot is released whole.
      const c = await client.commit(a.reservation!, [100, 0]);
      assert.equal(c.allowed, true, show(c));
      assert.equal(await left(key, "rs-tokens"), 600);
      assert.equal(await left(key, "rs-inflight"), 1);

      // A slot is free now, but 700 tokens are not: refused whole, the slot not taken.
      const over = await client.reserveMeters(meters(700));
      assert.equal(over.decision.allowed, false, show(over));
      assert.equal(over.reservation, undefined);
      assert.equal(await left(key, "rs-inflight"), 1);
      assert.equal(await left(key, "rs-tokens"), 600);

      await client.commit(b.reservation!, [300, 1]);
      assert.equal(await left(key, "rs-tokens"), 600, "the second request used all it reserved");
      assert.equal(await left(key, "rs-inflight"), 2);
    });

    it("a budget refusal returns no reservation and reserves nothing", async () => {
      await clearOfWindowEdge();
      const key = `apikey:${unique()}`;
      const first = await client.reserve(key, "rs-budget", 60);
      assert.ok(first.decision.allowed && first.reservation, show(first));
      const second = await client.reserve(key, "rs-budget", 60);
      assert.deepEqual([second.decision.allowed, second.decision.limit, second.decision.remaining], [false, 100, 40], show(second));
      assert.equal(second.reservation, undefined);
      assert.equal(second.decision.items[0].verdict.holdsLease, false);
      assert.ok(second.decision.retryAfterMs! >= 1, `retry ${second.decision.retryAfterMs}`);
      assert.equal(await left(key, "rs-budget"), 40, "the refused reserve took nothing");
      // The first request used 10: the 50 it did not use go back.
      const c = await client.commit(first.reservation, [10]);
      assert.deepEqual([c.allowed, c.remaining], [true, 90], show(c));
      assert.equal(await left(key, "rs-budget"), 90);
    });
  });
}

clientSuite("embedded");
clientSuite("redis");

// ---------------------------------------------------------------------------------------------
// A fake agent: the bytes, and agents of older versions.

/** The page's vectors (PROTOCOL.md), by name. */
function vector(name: string): Buffer {
  const doc = fs.readFileSync(path.join(REPO, "protocol", "PROTOCOL.md"), "utf8");
  const m = new RegExp(`<!--\\s*vector:\\s*${name}\\s*-->\\s*\`\`\`hex\\n([\\s\\S]*?)\`\`\``).exec(doc);
  assert.ok(m, `PROTOCOL.md has no vector ${name}`);
  return Buffer.from(m[1].replace(/\s+/g, ""), "hex");
}

/** A verdict as the fake answers a reserve or a commit. */
function fakeVerdict(holdsLease: boolean): Verdict {
  return {
    allowed: true,
    logOnly: false,
    holdsLease,
    overQuota: false,
    source: "local",
    limit: 1000,
    remaining: 500,
    resetAtMs: 1_700_000_060_000,
    retryAfterMs: 0,
  };
}

/** A Decision answering `f`: one item per item of the check, the `holds`-th of them holding it. */
function answer(f: Frame, holds: (i: number) => boolean): Buffer {
  assert.ok(f.body.kind === "check" && f.body.check.form === "items");
  const items = f.body.check.items.map((it, i) => ({ ruleId: it.ruleId, verdict: fakeVerdict(holds(i)), windowMs: 0 }));
  return encodeFrame({ requestId: f.requestId, body: { kind: "decision", combined: fakeVerdict(false), items } });
}

/** The first item's mode of a Check frame. */
const modeOf = (f: Frame) => (f.body.kind === "check" && f.body.check.form === "items" ? f.body.check.items[0].mode : undefined);

describe("reservations on a fake agent", () => {
  const clients: Client[] = [];
  const fakes: FakeAgent[] = [];
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  /** A client of a fake agent speaking `version` that answers every check, reserves held as `holds` says. */
  async function setup(version: number, holds: (i: number) => boolean = () => true, timeoutMs = 5_000) {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = version;
    fake.onCheck = (f, sock) => sock.write(answer(f, (i) => modeOf(f) === "reserve" && holds(i)));
    const client = await Client.connect(fake.path, { timeoutMs, logger: null });
    clients.push(client);
    assert.equal(client.protocolVersion, version);
    return { fake, client };
  }

  it("Hello is the page's hello_v6; a reserve and its commit are its check_reserve and check_commit, byte for byte", async () => {
    const { fake, client } = await setup(6);
    assert.equal(fake.receivedBytes[0].toString("hex"), vector("hello_v6").toString("hex"));
    const r = await client.reserveMeters([
      { key: "apikey:abc", ruleId: "output-tokens", units: 4096 },
      { key: "apikey:abc", ruleId: "in-flight", units: 1 },
    ]);
    assert.ok(r.reservation, show(r));
    const c = await client.commit(r.reservation, [612, 0]);
    assert.equal(c.origin.kind, "agent");
    // The page's bodies (after length, version, kind and request id) with this reservation's id.
    const id = r.reservation.id.toString(16).padStart(16, "0");
    const body = (name: string) => vector(name).subarray(10).toString("hex").replaceAll("0123456789abcdef", id);
    assert.deepEqual(checkBodies(fake), [body("check_reserve"), body("check_commit")]);
    // Check frames carry version byte 1 whatever their modes.
    assert.ok(fake.receivedBytes.filter((b) => b[5] === 0x03).every((b) => b[4] === 1));
  });

  it("a reservation of the meters held (a flagged quota-mode meter took nothing); a traceparent goes with the reserve and the commit", async () => {
    const { fake, client } = await setup(6, (i) => i === 0);
    const meters = [
      { key: "k", ruleId: "a", units: 2 },
      { key: "k", ruleId: "b", units: 3 },
    ];
    const r = await client.reserveMeters(meters);
    assert.deepEqual([r.decision.allowed, r.decision.origin.kind, r.reservation?.held], [true, "agent", [true, false]]);
    // Its commit names only the meter the agent holds.
    await client.commit(r.reservation!, [1, 0]);
    const committed = fake.received.filter((f) => f.body.kind === "check" && modeOf(f) === "commit");
    assert.deepEqual(
      committed.map((f) => (f.body.kind === "check" && f.body.check.form === "items" ? f.body.check.items.map((i) => i.ruleId) : [])),
      [["a"]],
    );
    // Held on both: returned, with a copy of the meters (the caller's array may change later).
    const all = await setup(6);
    const given = [...meters];
    const held = await all.client.reserveMeters(given, { traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" });
    given.pop();
    assert.ok(held.reservation);
    assert.deepEqual(held.reservation.meters, meters);
    await all.client.commit(held.reservation, [1, 0], { traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" });
    const checks = all.fake.received.filter((f) => f.body.kind === "check");
    assert.deepEqual(
      checks.map((f) => [modeOf(f), f.body.kind === "check" && f.body.trace !== undefined]),
      [
        ["reserve", true],
        ["commit", true],
      ],
    );
    // Nothing is sent on behalf of a reservation the agent answered about but the caller's commit.
    assert.deepEqual(fake.received.filter((f) => f.body.kind === "check").map(modeOf), ["reserve", "commit"]);
  });

  it("a reserve the agent does not answer in time: the fail policy, no reservation, and a commit at 0 sent at once", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = 6;
    // Never answers a reserve; answers the commit.
    fake.onCheck = (f, sock) => {
      if (modeOf(f) === "commit") sock.write(answer(f, () => false));
    };
    const client = await Client.connect(fake.path, { timeoutMs: 100, logger: null });
    clients.push(client);
    for (const [fail, allowed] of [
      [undefined, true],
      ["closed", false],
    ] as const) {
      const committed = nextCheck(fake, "the precautionary commit", 10_000, (f) => modeOf(f) === "commit");
      const r = await client.reserveMeters(
        [
          { key: "k", ruleId: "a", units: 40 },
          { key: "k", ruleId: "b", units: 1 },
        ],
        fail === undefined ? undefined : { fail },
      );
      assert.deepEqual(
        [r.decision.allowed, r.decision.origin, r.reservation],
        [allowed, { kind: allowed ? "failOpen" : "failClosed", reason: "timeout" }, undefined],
      );
      const c = await committed;
      const reserve = fake.received.filter((f) => modeOf(f) === "reserve").at(-1)!;
      assert.ok(reserve.body.kind === "check" && reserve.body.check.form === "items");
      const id = reserve.body.check.items[0].lease!;
      assert.deepEqual(c.frame.body.kind === "check" && c.frame.body.check, {
        form: "items",
        items: [
          { key: "k", ruleId: "a", cost: 0, mode: "commit", lease: id },
          { key: "k", ruleId: "b", cost: 0, mode: "commit", lease: id },
        ],
      });
    }
  });

  for (const version of [5, 3, 1]) {
    it(`a version-${version} agent never gets a reservation: reserve, reserveMeters and commit reject, saying so`, async () => {
      const { fake, client } = await setup(version);
      const said = (e: unknown) => {
        assert.ok(e instanceof FloodgateError);
        assert.equal(e.kind, "invalid");
        assert.equal(
          e.message,
          `invalid check: the agent speaks protocol version ${version}: it cannot hold reservations (update the agent)`,
        );
        return true;
      };
      const reservation: Reservation = { id: 5n, meters: [{ key: "k", ruleId: "a", units: 1 }] };
      await assert.rejects(client.reserve("k", "a", 1), said);
      await assert.rejects(client.reserveMeters(reservation.meters), said);
      await assert.rejects(client.commit(reservation, [0]), said);
      await assert.rejects(client.check([{ key: "k", ruleId: "a", mode: "reserve", lease: 1n }]), said);
      await assert.rejects(client.checkAttributes({ user: "1", cost: 0, mode: "commit", lease: 1n }), said);
      // Nothing was sent; the connection stays and consume checks still go.
      assert.equal((await client.allow("k", "a")).origin.kind, "agent");
      assert.deepEqual(
        fake.received.map((f) => f.body.kind).filter((k) => k !== "failModes"),
        ["hello", "check"],
      );
      assert.equal(fake.connections, 1);
      assert.ok(client.isConnected());
    });
  }

  it("invalid meters and figures reject before anything is sent", async () => {
    const { fake, client } = await setup(6);
    const invalid = (pattern: RegExp) => (e: unknown) => {
      assert.ok(e instanceof FloodgateError && e.kind === "invalid", String(e));
      assert.match(e.message, pattern);
      return true;
    };
    await assert.rejects(client.reserveMeters([]), invalid(/1 to 16 items, not 0/));
    await assert.rejects(client.reserve("k", "a", 0), invalid(/cost must be an integer from 1/));
    const reservation: Reservation = { id: 9n, meters: [{ key: "k", ruleId: "a", units: 3 }] };
    await assert.rejects(client.commit(reservation, [-1]), invalid(/a commit's cost must be an integer from 0/));
    await assert.rejects(client.commit(reservation, [1.5]), invalid(/a commit's cost must be an integer from 0/));
    await assert.rejects(client.commit(reservation, [1, 2]), invalid(/^invalid commit: 2 figures for a reservation of 1 meter \(one per meter/));
    await assert.rejects(
      client.commit(reservation, 3 as unknown as number[]),
      invalid(/^invalid commit: no array of figures for a reservation of 1 meter/),
    );
    assert.deepEqual(checkBodies(fake), []);
  });
});

describe("reservations while the agent is away", () => {
  const missing = `${tempDir()}/nobody-here.sock`;

  it("reserve decides by the fail policy and holds nothing; commit resolves with the degraded decision", async () => {
    const client = await Client.connect(missing, { logger: null });
    try {
      assert.equal(client.protocolVersion, 0);
      const open = await client.reserve("k", "a", 10);
      assert.deepEqual([open.decision.allowed, open.decision.origin, open.reservation], [
        true,
        { kind: "failOpen", reason: "unavailable" },
        undefined,
      ]);
      const closed = await client.reserve("k", "a", 10, { fail: "closed" });
      assert.deepEqual([closed.decision.allowed, closed.decision.origin.kind, closed.reservation], [false, "failClosed", undefined]);
      const c: Decision = await client.commit({ id: 3n, meters: [{ key: "k", ruleId: "a", units: 10 }] }, [4]);
      assert.deepEqual([c.allowed, c.origin], [true, { kind: "failOpen", reason: "unavailable" }]);
    } finally {
      client.close();
    }
  });

  it("the fallback limit counts a reserve as a consume, and a commit not at all", async () => {
    const client = await Client.connect(missing, { logger: null, fallbackLimit: { limit: 10, perMs: 60_000 } });
    try {
      const first = await client.reserve("k", "a", 10);
      assert.deepEqual([first.decision.allowed, first.decision.origin.kind, first.reservation], [true, "localLimit", undefined]);
      for (let i = 0; i < 3; i++) {
        const c = await client.commit({ id: BigInt(i + 1), meters: [{ key: "k", ruleId: "a", units: 10 }] }, [0]);
        assert.deepEqual(c.origin, { kind: "failOpen", reason: "unavailable" }, "a commit passes the limit by");
      }
      const second = await client.reserve("k", "a", 1);
      assert.deepEqual([second.decision.allowed, second.decision.origin.kind], [false, "localLimit"]);
      assert.equal(client.stats().localDenied, 1);
    } finally {
      client.close();
    }
  });
});
