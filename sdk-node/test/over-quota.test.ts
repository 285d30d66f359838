/**
 * Quota mode (protocol version 6) against a real agent, on its embedded store and on Redis: a rule
 * with `overLimit = "flag"` lets a request past its limit through, flagged; the client's decision
 * says so (`overQuota`, `overQuotaRules`), and the Express and Fastify middleware name the rules in
 * `X-RateLimit-Over-Quota` and hand them to the handler as `req.floodgate.overQuota`. A fake agent
 * for what one rule cannot show: several flagged rules, and a check another rule denies.
 */

import assert from "node:assert/strict";
import type { AddressInfo } from "node:net";
import type { Server } from "node:http";
import { after, before, describe, it } from "node:test";

import express from "express";
import Fastify, { type FastifyInstance } from "fastify";

import { Client, floodgateExpress, floodgateFastify, OVER_QUOTA_HEADER, type FloodgateRequestState } from "../src/index";
import { leaveState, Limiter, type RequestView } from "../src/http";
import { encodeFrame, type Verdict } from "../src/protocol";
import { Agent, FakeAgent, RedisServer, unique } from "./helpers";

// How an app types what the middleware leaves on its requests (sdk-node/README.md shows the same).
declare module "express-serve-static-core" {
  interface Request {
    floodgate?: FloodgateRequestState | null;
  }
}
declare module "fastify" {
  interface FastifyRequest {
    floodgate?: FloodgateRequestState | null;
  }
}

/** One request an hour per user, and past it: let through, flagged (the brief's rule). */
const RULES = `
[[rules]]
id = "premium"
dimension = "user"
limit = 1
windowSeconds = 3600
overLimit = "flag"
`;

/** A call's timeout where the test is about figures, not latency (a loaded CI box may be slow). */
const PATIENT = { timeoutMs: 5_000 };

interface Answer {
  status: number;
  overQuota: string | null;
  /** What the handler found on its request. */
  floodgate: unknown;
}

async function get(base: string, user: string): Promise<Answer> {
  const r = await fetch(`${base}/v1/chat`, { headers: { "x-user": user } });
  const body = await r.text();
  assert.equal(r.status, 200, body);
  return { status: r.status, overQuota: r.headers.get("x-ratelimit-over-quota"), floodgate: JSON.parse(body).floodgate };
}

function suite(store: "embedded" | "redis"): void {
  describe(`quota mode (agent on the ${store} store)`, () => {
    let redis: RedisServer | undefined;
    let agent: Agent;
    let client: Client;
    let expressServer: Server | undefined;
    let fastify: FastifyInstance | undefined;
    let expressBase = "";
    let fastifyBase = "";

    before(async () => {
      if (store === "redis") redis = await RedisServer.start();
      agent = await Agent.start({ rules: RULES, redis: redis?.url });
      client = await Client.connect(agent.socket, PATIENT);

      const app = express();
      app.get("/v1/chat", floodgateExpress(client, { userHeader: "x-user" }), (req, res) => {
        res.json({ floodgate: req.floodgate });
      });
      expressServer = await new Promise<Server>((r) => {
        const s = app.listen(0, "127.0.0.1", () => r(s));
      });
      expressBase = `http://127.0.0.1:${(expressServer.address() as AddressInfo).port}`;

      fastify = Fastify();
      await fastify.register(floodgateFastify, { client, userHeader: "x-user" });
      fastify.get("/v1/chat", async (request) => ({ floodgate: request.floodgate }));
      await fastify.listen({ port: 0, host: "127.0.0.1" });
      fastifyBase = `http://127.0.0.1:${(fastify.server.address() as AddressInfo).port}`;
    });

    after(async () => {
      await new Promise((r) => (expressServer ? expressServer.close(r) : r(undefined)));
      await fastify?.close();
      client?.close();
      await agent?.stop();
      await redis?.stop();
    });

    it("the client: within the limit not flagged; past it allowed, over quota, counting nothing", async () => {
      assert.equal(client.protocolVersion, 6);
      const key = `user:${unique()}`;
      const first = await client.allow(key, "premium", 1, PATIENT);
      assert.deepEqual([first.allowed, first.overQuota, first.overQuotaRules], [true, false, []]);
      assert.equal(first.items[0].verdict.overQuota, false);
      assert.equal(first.origin.kind, "agent");

      const second = await client.allow(key, "premium", 1, PATIENT);
      assert.deepEqual([second.allowed, second.overQuota, second.overQuotaRules], [true, true, ["premium"]]);
      assert.equal(second.retryAfterMs, undefined, "allowed: no retry");
      assert.deepEqual(
        second.items.map((i) => [i.ruleId, i.verdict.allowed, i.verdict.overQuota]),
        [["premium", true, true]],
      );
      // It counted nothing: the next one is let through flagged the same way.
      const third = await client.allow(key, "premium", 1, PATIENT);
      assert.deepEqual([third.allowed, third.overQuota, third.overQuotaRules], [true, true, ["premium"]]);
    });

    for (const [name, base] of [
      ["Express", () => expressBase],
      ["Fastify", () => fastifyBase],
    ] as const) {
      it(`${name}: the second request carries ${OVER_QUOTA_HEADER}: premium and req.floodgate.overQuota`, async () => {
        const user = `quota-${unique()}`;
        const first = await get(base(), user);
        assert.equal(first.overQuota, null, "within the limit: no header");
        assert.deepEqual(first.floodgate, { overQuota: [] }, "within the limit: an empty list");

        const second = await get(base(), user);
        assert.equal(second.overQuota, "premium");
        assert.deepEqual(second.floodgate, { overQuota: ["premium"] });

        // Another user is within its own limit.
        const other = await get(base(), `quota-${unique()}`);
        assert.equal(other.overQuota, null);
        assert.deepEqual(other.floodgate, { overQuota: [] });
      });
    }
  });
}

suite("embedded");
suite("redis");

describe("quota mode in the middleware's outcome (fake agent of version 6)", () => {
  let fake: FakeAgent;
  let client: Client;
  /** The items the fake answers the next check with; the combined verdict is the first's. */
  let answer: { ruleId: string; verdict: Verdict }[] = [];

  const verdict = (allowed: boolean, overQuota: boolean): Verdict => ({
    allowed,
    logOnly: false,
    holdsLease: false,
    overQuota,
    source: "local",
    limit: 10,
    remaining: 0,
    resetAtMs: Date.now() + 60_000,
    retryAfterMs: allowed ? 0 : 2_000,
  });
  const view: RequestView = { headers: { "x-user": "u" }, remoteAddress: "127.0.0.1", path: "/v1/chat", native: null };

  before(async () => {
    fake = await FakeAgent.start();
    fake.helloVersion = 6;
    fake.onCheck = (f, sock) => {
      const combined = answer[0].verdict;
      const items = answer.map((i) => ({ ...i, windowMs: 60_000 }));
      sock.write(encodeFrame({ requestId: f.requestId, body: { kind: "decision", combined, items } }, 6));
    };
    client = await Client.connect(fake.path, PATIENT);
  });
  after(async () => {
    client?.close();
    await fake?.close();
  });

  it("every flagged rule of an allowed check, in the header comma-separated and in the list", async () => {
    answer = [
      { ruleId: "gpt-4o", verdict: verdict(true, true) },
      { ruleId: "per-user", verdict: { ...verdict(true, false), remaining: 3 } },
      { ruleId: "gpt-4o-mini", verdict: verdict(true, true) },
    ];
    const outcome = await new Limiter(client, { userHeader: "x-user" }).decide(view);
    assert.equal(outcome.reject, undefined);
    assert.deepEqual(outcome.decision?.overQuotaRules, ["gpt-4o", "gpt-4o-mini"]);
    assert.deepEqual(outcome.overQuota, ["gpt-4o", "gpt-4o-mini"]);
    assert.deepEqual(
      outcome.headers.filter(([n]) => n === OVER_QUOTA_HEADER),
      [[OVER_QUOTA_HEADER, "gpt-4o,gpt-4o-mini"]],
    );
  });

  it("a check another rule denies is a 429 without the header: nothing is let through", async () => {
    answer = [
      { ruleId: "per-user", verdict: verdict(false, false) },
      { ruleId: "gpt-4o", verdict: verdict(true, true) },
    ];
    const outcome = await new Limiter(client, { userHeader: "x-user" }).decide(view);
    assert.ok(outcome.reject, "denied");
    assert.equal(outcome.decision?.overQuota, true, "the decision still says which rule was past its limit");
    assert.deepEqual(outcome.overQuota, []);
    assert.ok(!outcome.headers.some(([n]) => n === OVER_QUOTA_HEADER));
  });
});

describe("req.floodgate", () => {
  it("a second Floodgate middleware on the request adds its rules to the first's", () => {
    const req: { floodgate?: FloodgateRequestState | null } = { floodgate: null };
    leaveState(req, ["a"]);
    assert.deepEqual(req.floodgate, { overQuota: ["a"] });
    leaveState(req, []);
    leaveState(req, ["b", "a"]);
    assert.deepEqual(req.floodgate, { overQuota: ["a", "b"] });
  });
});
