/**
 * Express and Fastify holding a concurrency lease for each request in flight and releasing it when
 * the response ends: finished, failed, streamed, or abandoned by the client (before or after the
 * check was answered), exactly once; over real HTTP in front of real agents (embedded store and
 * Redis), and byte for byte on a fake agent of versions 2 and 3. Also `chargeWith`, and a charge
 * route's request phase (a peek of cost 0 with a lease) holding one unit of its concurrency rule
 * only when its rate rules pass, released as 1. Requests are
 * held in flight by gates the test opens (no sleeps), and every wait is for an event, with a
 * deadline of seconds.
 */

import assert from "node:assert/strict";
import * as http from "node:http";
import type { AddressInfo } from "node:net";
import { PassThrough } from "node:stream";
import { after, before, describe, it } from "node:test";

import express from "express";
import Fastify, { type FastifyInstance } from "fastify";

import {
  Client,
  floodgateExpress,
  floodgateFastify,
  floodgateFastifyHook,
  type Attributes,
  type Decision,
} from "../src/index";
import {
  Agent,
  checkBodies,
  eventually,
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
# Two requests in flight per user on /conc/*.
[[rules]]
id = "c-http"
dimension = "user"
match = { endpoint = "/conc/*" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 30

# 1000 tokens an hour per user on /v1/cb, charged after the response by a chargeWith function.
[[rules]]
id = "c-cb"
dimension = "user"
match = { endpoint = "/v1/cb" }
limit = 1000
windowSeconds = 3600

# A charge route (chargeHeaders "/v1/chat": "x-usage-tokens"): two requests in flight per user, and
# 1000 tokens an hour per user, charged after the response from the header.
[[rules]]
id = "chat-conc"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 30

[[rules]]
id = "chat-tokens"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 1000
windowSeconds = 3600
`;

/** A call's timeout where the test is about figures, not latency (a loaded 2-core box may be slow). */
const PATIENT = { timeoutMs: 5_000 };

interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: string;
}

/** A request under way: its answer, its head once it arrives, and the request to destroy. */
interface Sent {
  done: Promise<Answer>;
  head: Promise<http.IncomingMessage>;
  req: http.ClientRequest;
}

/** Sends GET `path` on a connection of its own (no keep-alive: a disconnect is this request's). */
function send(base: string, path: string, headers: Record<string, string> = {}): Sent {
  let headOk!: (m: http.IncomingMessage) => void;
  let headErr!: (e: Error) => void;
  const head = new Promise<http.IncomingMessage>((res, rej) => {
    headOk = res;
    headErr = rej;
  });
  head.catch(() => {});
  const req = http.request(`${base}${path}`, { headers, agent: false });
  const done = new Promise<Answer>((resolve, reject) => {
    req.on("response", (m) => {
      headOk(m);
      let body = "";
      m.setEncoding("utf8");
      m.on("data", (c: string) => (body += c));
      m.on("end", () => resolve({ status: m.statusCode ?? 0, headers: m.headers, body }));
      m.on("error", reject);
      m.on("aborted", () => reject(new Error("aborted")));
    });
    req.on("error", (e) => {
      headErr(e);
      reject(e);
    });
  });
  done.catch(() => {});
  req.end();
  return { done, head, req };
}

const get = (base: string, path: string, headers: Record<string, string> = {}) => send(base, path, headers).done;

/** The limiter's headers of an answer. */
function limits(a: Answer): [unknown, unknown, unknown] {
  return [a.headers["x-ratelimit-limit"], a.headers["x-ratelimit-remaining"], a.headers["x-ratelimit-reset"]];
}

/** A promise and its resolve. */
interface Deferred<T = void> {
  promise: Promise<T>;
  resolve: (v: T) => void;
}

function deferred<T = void>(): Deferred<T> {
  let resolve!: (v: T) => void;
  const promise = new Promise<T>((r) => (resolve = r));
  return { promise, resolve };
}

/** Handlers wait at a named gate until the test opens it; the test learns when they got there. */
class Gates {
  private readonly gates = new Map<string, { entered: Deferred; open: Deferred }>();
  private gate(name: string) {
    let g = this.gates.get(name);
    if (!g) {
      g = { entered: deferred<void>(), open: deferred<void>() };
      this.gates.set(name, g);
    }
    return g;
  }
  /** The handler's side: says it is here, and waits for the gate to open. */
  enter(name: string): Promise<void> {
    const g = this.gate(name);
    g.entered.resolve();
    return g.open.promise;
  }
  /** Resolves once a handler waits at the gate. */
  entered(name: string): Promise<void> {
    return this.gate(name).entered.promise;
  }
  open(name: string): void {
    this.gate(name).open.resolve();
  }
  openAll(): void {
    for (const g of this.gates.values()) g.open.resolve();
  }
}

/** How a held request ends in the scenario. */
type Ending = "finish" | "error" | "disconnect" | "stream";

/** Every attribute check the middleware sent and what it got back, to count leases and releases. */
interface Sent3 {
  attributes: Attributes;
  decision?: Decision;
}

function spy(client: Client): Sent3[] {
  const log: Sent3[] = [];
  const original = client.checkAttributes.bind(client);
  client.checkAttributes = (attributes, options) => {
    const entry: Sent3 = { attributes: { ...attributes } };
    log.push(entry);
    const p = original(attributes, options);
    p.then(
      (d) => (entry.decision = d),
      () => {},
    );
    return p;
  };
  return log;
}

function middlewareSuite(store: "embedded" | "redis"): void {
  describe(`middleware holds a lease per request in flight (agent on the ${store} store)`, () => {
    let redis: RedisServer | undefined;
    let agent: Agent;
    let client: Client;
    let log: Sent3[];
    const gates = new Gates();
    let expressServer: http.Server;
    let fastify: FastifyInstance;
    const bases: Record<"Express" | "Fastify", string> = { Express: "", Fastify: "" };
    const warnings: string[] = [];
    const cbTokens = new WeakMap<object, number>();
    /** The users whose /v1/chat handler ran, once per request. */
    const chatRan: string[] = [];

    before(async () => {
      if (store === "redis") redis = await RedisServer.start();
      agent = await Agent.start({ rules: RULES, redis: redis?.url });
      client = await Client.connect(agent.socket, PATIENT);
      log = spy(client);
      const logger = { warn: (m: string) => warnings.push(m) };

      const app = express();
      const limit = floodgateExpress(client, {
        userHeader: "x-user",
        logger,
        chargeWith: { "/v1/cb": (_req, res) => res.locals?.tokens },
        chargeHeaders: { "/v1/chat": "x-usage-tokens" },
      });
      app.get("/conc/:ending", limit, async (req, res, next) => {
        const gate = req.headers["x-gate"];
        const ending = req.params.ending as Ending;
        if (ending === "stream" || ending === "disconnect") {
          res.setHeader("content-type", "text/plain");
          res.write("chunk1;");
        }
        if (typeof gate === "string") await gates.enter(gate);
        if (ending === "error") next(new Error("boom"));
        else if (ending === "finish") res.send("done");
        else res.end("chunk2");
      });
      app.get("/v1/cb", limit, (req, res) => {
        const tokens = req.headers["x-tokens"];
        if (tokens === "throw") res.locals.tokens = undefined;
        else if (typeof tokens === "string") res.locals.tokens = Number(tokens);
        res.send("answered");
      });
      app.get("/v1/chat", limit, async (req, res) => {
        chatRan.push(req.headers["x-user"] as string);
        const tokens = req.headers["x-tokens"];
        if (typeof tokens === "string") res.setHeader("x-usage-tokens", tokens);
        const gate = req.headers["x-gate"];
        if (typeof gate === "string") await gates.enter(gate);
        res.send("answer");
      });
      app.use((_err: unknown, _req: express.Request, res: express.Response, _next: express.NextFunction) => {
        res.status(500).send("failed");
      });
      expressServer = await new Promise<http.Server>((r) => {
        const s = app.listen(0, "127.0.0.1", () => r(s));
      });
      bases.Express = `http://127.0.0.1:${(expressServer.address() as AddressInfo).port}`;

      fastify = Fastify();
      await fastify.register(floodgateFastify, {
        client,
        userHeader: "x-user",
        logger,
        chargeWith: {
          "/v1/cb": (request) => {
            if (request.headers["x-tokens"] === "throw") throw new Error("no usage recorded");
            return cbTokens.get(request.raw);
          },
        },
        chargeHeaders: { "/v1/chat": "x-usage-tokens" },
      });
      fastify.get<{ Params: { ending: Ending } }>("/conc/:ending", async (request, reply) => {
        const gate = request.headers["x-gate"];
        const ending = request.params.ending;
        if (ending === "stream" || ending === "disconnect") {
          const body = new PassThrough();
          body.write("chunk1;");
          const opened = typeof gate === "string" ? gates.enter(gate) : Promise.resolve();
          void opened.then(() => body.end("chunk2"));
          reply.header("content-type", "text/plain");
          return reply.send(body);
        }
        if (typeof gate === "string") await gates.enter(gate);
        if (ending === "error") throw new Error("boom");
        return "done";
      });
      fastify.get("/v1/cb", async (request) => {
        const tokens = request.headers["x-tokens"];
        if (typeof tokens === "string" && tokens !== "throw") cbTokens.set(request.raw, Number(tokens));
        return "answered";
      });
      fastify.get("/v1/chat", async (request, reply) => {
        chatRan.push(request.headers["x-user"] as string);
        const tokens = request.headers["x-tokens"];
        if (typeof tokens === "string") reply.header("x-usage-tokens", tokens);
        const gate = request.headers["x-gate"];
        if (typeof gate === "string") await gates.enter(gate);
        return "answer";
      });
      await fastify.listen({ port: 0, host: "127.0.0.1" });
      bases.Fastify = `http://127.0.0.1:${(fastify.server.address() as AddressInfo).port}`;
    });

    after(async () => {
      gates.openAll();
      expressServer?.closeAllConnections?.();
      await new Promise((r) => expressServer?.close(r));
      await fastify?.close();
      client?.close();
      await agent?.stop();
      await redis?.stop();
    });

    for (const framework of ["Express", "Fastify"] as const) {
      for (const ending of ["finish", "error", "disconnect", "stream"] as const) {
        it(`${framework}: two requests in flight pass, a third is 429 with Retry-After 1; ending by ${ending} frees its slot`, async () => {
          const base = bases[framework];
          const user = `${framework}-${ending}-${unique()}`;
          const who = { "x-user": user };
          const path = `/conc/${ending}`;
          const [ga, gb] = [`${user}-a`, `${user}-b`];

          const a = send(base, path, { ...who, "x-gate": ga });
          const b = send(base, path, { ...who, "x-gate": gb });
          await gates.entered(ga);
          await gates.entered(gb);

          // Two units held: the third request is turned away, and its handler never runs.
          const t0 = Math.floor(Date.now() / 1000);
          const third = await get(base, `/conc/finish`, who);
          assert.equal(third.status, 429, third.body);
          assert.equal(third.headers["retry-after"], "1", "a concurrency denial retries within 1 s");
          assert.equal(third.body, '{"error":"rate_limited","retryAfter":1}');
          const [limit, remaining, reset] = limits(third);
          assert.deepEqual([limit, remaining], ["2", "0"]);
          // The reset is when the last lease held runs out: leaseSeconds (30) from when it was taken.
          assert.ok(Number(reset) >= t0 && Number(reset) <= Math.ceil(Date.now() / 1000) + 31, `reset ${reset}`);

          // End the first request.
          if (ending === "disconnect") {
            const head = await a.head;
            assert.equal(head.statusCode, 200);
            a.req.destroy();
          } else {
            gates.open(ga);
            const answer = await a.done;
            if (ending === "error") assert.equal(answer.status, 500);
            else {
              assert.equal(answer.status, 200);
              assert.equal(answer.body, ending === "finish" ? "done" : "chunk1;chunk2");
              assert.equal(limits(answer)[0], "2");
            }
          }

          // Its slot comes back once the release lands (after the response, never before it): one
          // new request passes, and with the second request still in flight nothing is left.
          const next = await eventually(`a slot freed by the ${ending}`, 10_000, async () => {
            const r = await get(base, "/conc/finish", who);
            return r.status === 200 && r;
          });
          assert.deepEqual(limits(next).slice(0, 2), ["2", "0"], "the second request still holds its unit");

          gates.open(gb);
          assert.equal((await b.done).status, ending === "error" ? 500 : 200);
          await eventually("every lease given back", 10_000, async () => {
            const r = await get(base, "/conc/finish", who);
            return r.status === 200 && r.headers["x-ratelimit-remaining"] === "1";
          });
          gates.open(ga);

          // Each lease held was released exactly once, with the check's attributes and cost.
          const mine = log.filter((e) => e.attributes.user === user);
          const held = mine.filter((e) => e.attributes.mode !== "release" && e.decision?.items.some((i) => i.verdict.holdsLease));
          const released = () => log.filter((e) => e.attributes.user === user && e.attributes.mode === "release");
          await eventually("a release for every lease held", 10_000, () => released().length >= held.length);
          const releasedNow = released();
          assert.deepEqual(
            releasedNow.map((e) => e.attributes.lease!.toString()).sort(),
            held.map((e) => e.attributes.lease!.toString()).sort(),
            "one release per lease held",
          );
          for (const r of releasedNow) {
            const acquired = held.find((e) => e.attributes.lease === r.attributes.lease)!;
            assert.deepEqual(r.attributes, { ...acquired.attributes, mode: "release" });
          }
          // The denied requests held nothing and released nothing.
          const denied = mine.filter((e) => e.attributes.mode !== "release" && e.decision && !e.decision.allowed);
          assert.ok(denied.length >= 1);
          for (const d of denied) assert.ok(!releasedNow.some((r) => r.attributes.lease === d.attributes.lease));
        });
      }

      it(`${framework}: chargeWith charges what the function gives once the response is done`, async () => {
        const base = bases[framework];
        const user = `${framework}-cb-${unique()}`;
        const left = async () => (await client.peek(`user:${user}`, "c-cb", 0)).remaining;
        const first = await get(base, "/v1/cb", { "x-user": user, "x-tokens": "400" });
        assert.equal(first.status, 200);
        assert.deepEqual(limits(first).slice(0, 2), ["1000", "1000"], "the request-phase peek takes nothing");
        const remaining = await eventually("the charge of 400 to land", 10_000, async () => {
          const r = await left();
          return r < 1000 && { r };
        });
        assert.equal(remaining.r, 600);
        // Nothing (undefined, or a function that throws) charges nothing.
        const said = () => warnings.filter((w) => w.includes("chargeWith on /v1/cb")).length;
        const before = said();
        assert.equal((await get(base, "/v1/cb", { "x-user": user, "x-tokens": "throw" })).status, 200);
        assert.equal((await get(base, "/v1/cb", { "x-user": user })).status, 200);
        assert.equal((await get(base, "/v1/cb", { "x-user": user, "x-tokens": "1500" })).status, 200);
        await eventually("the charge of 1500 to land", 10_000, async () => (await left()) === 0);
        const denied = await get(base, "/v1/cb", { "x-user": user });
        assert.equal(denied.status, 429);
        assert.deepEqual(limits(denied).slice(0, 2), ["1000", "0"]);
        if (framework === "Fastify") {
          assert.equal(said(), before + 1, "the function that threw is warned about");
          assert.match(warnings.find((w) => w.includes("chargeWith on /v1/cb threw"))!, /no usage recorded; nothing charged/);
        }
      });

      it(`${framework}: a chargeHeaders route holds one concurrency unit per request in flight, released as 1, and charges the header`, async () => {
        const base = bases[framework];
        const user = `${framework}-chat-${unique()}`;
        const who = { "x-user": user };
        const key = `user:${user}`;
        const slots = async () => (await client.peek(key, "chat-conc", 0, PATIENT)).remaining;
        const tokensLeft = async () => (await client.peek(key, "chat-tokens", 0, PATIENT)).remaining;
        const [ga, gb] = [`${user}-a`, `${user}-b`];

        const a = send(base, "/v1/chat", { ...who, "x-gate": ga, "x-tokens": "100" });
        const b = send(base, "/v1/chat", { ...who, "x-gate": gb, "x-tokens": "250" });
        await gates.entered(ga);
        await gates.entered(gb);
        // Each request in flight holds one unit (its cost is 0: max(0, 1)); nothing is charged yet.
        assert.equal(await slots(), 0, "two units held while both requests are in flight");
        assert.equal(await tokensLeft(), 1000, "the request phase (a peek of cost 0) charges nothing");

        // The third is turned away by the concurrency rule, and its handler never runs.
        const third = await get(base, "/v1/chat", { ...who, "x-tokens": "1" });
        assert.equal(third.status, 429, third.body);
        assert.equal(third.headers["retry-after"], "1", "a concurrency denial retries within 1 s");
        assert.equal(third.body, '{"error":"rate_limited","retryAfter":1}');
        assert.deepEqual(limits(third).slice(0, 2), ["2", "0"]);
        assert.equal(chatRan.filter((u) => u === user).length, 2, "the third request's handler never ran");

        gates.open(ga);
        gates.open(gb);
        for (const answer of [await a.done, await b.done]) {
          assert.equal(answer.status, 200);
          assert.equal(answer.body, "answer");
          assert.equal(limits(answer)[0], "2", "the binding rule is the concurrency rule");
        }

        // Both units come back once the releases land, and the header's tokens are charged.
        await eventually("both units released", 10_000, async () => (await slots()) === 2);
        let left = 1000;
        await eventually("the charges of 100 and 250 to land", 10_000, async () => (left = await tokensLeft()) <= 650).catch(
          (e: Error) => assert.fail(`${e.message}: ${left} tokens left`),
        );
        assert.equal(left, 650);

        // On the wire: each request phase a peek of cost 0 with a lease of its own; each lease held
        // released once, with the same attributes and lease and cost 1 (not the peek's 0); each
        // charge the header's cost with no lease; the denied request held and released nothing.
        const mine = () => log.filter((e) => e.attributes.user === user);
        await eventually("two releases and two charges", 10_000, () => mine().length === 7);
        const peeks = mine().filter((e) => e.attributes.mode === "peek");
        const releases = mine().filter((e) => e.attributes.mode === "release");
        const charges = mine().filter((e) => e.attributes.mode === "charge");
        assert.equal(peeks.length, 3);
        for (const p of peeks) {
          assert.equal(p.attributes.cost, 0);
          assert.equal(typeof p.attributes.lease, "bigint");
        }
        assert.equal(new Set(peeks.map((p) => p.attributes.lease)).size, 3, "a fresh lease each");
        const held = peeks.filter((p) => p.decision?.items.some((i) => i.verdict.holdsLease));
        const refused = peeks.filter((p) => p.decision && !p.decision.allowed);
        assert.equal(held.length, 2);
        assert.equal(refused.length, 1);
        assert.ok(!refused[0].decision!.items.some((i) => i.verdict.holdsLease), "the denied request holds nothing");
        for (const h of held) {
          assert.deepEqual(
            h.decision!.items.filter((i) => i.verdict.holdsLease).map((i) => i.ruleId),
            ["chat-conc"],
            "only the concurrency rule holds the lease",
          );
        }
        assert.deepEqual(
          releases.map((r) => r.attributes).sort((x, y) => (x.lease! < y.lease! ? -1 : 1)),
          held.map((h) => ({ ...h.attributes, cost: 1, mode: "release" })).sort((x, y) => (x.lease! < y.lease! ? -1 : 1)),
          "one release per lease held, as the peek with cost 1",
        );
        const { lease: _lease, ...withoutLease } = peeks[0].attributes;
        assert.deepEqual(
          charges.map((c) => c.attributes).sort((x, y) => x.cost! - y.cost!),
          [100, 250].map((cost) => ({ ...withoutLease, cost, mode: "charge" })),
          "the charges carry the header's cost and no lease",
        );
      });

      it(`${framework}: a chargeHeaders route past its token limit is refused and holds no concurrency unit`, async () => {
        const base = bases[framework];
        const user = `${framework}-chat-over-${unique()}`;
        const who = { "x-user": user };
        const key = `user:${user}`;
        const slots = async () => (await client.peek(key, "chat-conc", 0, PATIENT)).remaining;

        // Past the limit: a charge always commits, even over it (its item says so; a charge never
        // decides the check, so the combined verdict is allowed).
        const over = await client.charge(key, "chat-tokens", 1500, PATIENT);
        assert.deepEqual(
          over.items.map((i) => [i.ruleId, i.verdict.allowed, i.verdict.remaining]),
          [["chat-tokens", false, 0]],
        );
        assert.equal(await slots(), 2);

        const refused = await get(base, "/v1/chat", { ...who, "x-tokens": "5" });
        assert.equal(refused.status, 429, refused.body);
        assert.deepEqual(limits(refused).slice(0, 2), ["1000", "0"], "the token rule refused it");
        assert.ok(Number(refused.headers["retry-after"]) >= 1);
        assert.equal(chatRan.filter((u) => u === user).length, 0, "the handler never ran");
        // Nothing was acquired (the peeks are read first): both units are free, and stay free with
        // nothing to release them (a unit held would stay held for leaseSeconds).
        assert.equal(await slots(), 2, "no concurrency unit held by a refused charge-route request");
        const mine = log.filter((e) => e.attributes.user === user);
        assert.equal(mine.length, 1, "one check, no release, no charge");
        assert.equal(mine[0].attributes.mode, "peek");
        assert.equal(typeof mine[0].attributes.lease, "bigint");
        assert.ok(mine[0].decision && !mine[0].decision.allowed);
        assert.ok(!mine[0].decision.items.some((i) => i.verdict.holdsLease), "the refused peek holds no lease");
        // A request after it is refused the same way, and still holds nothing.
        assert.equal((await get(base, "/v1/chat", who)).status, 429);
        assert.equal(await slots(), 2);
      });
    }
  });
}

middlewareSuite("embedded");
middlewareSuite("redis");

describe("chargeWith's configuration", () => {
  it("takes functions, on endpoints without costs or chargeHeaders, checked at start", () => {
    const client = new Client(`${tempDir()}/nobody.sock`, { logger: null });
    try {
      const fn = () => 1;
      assert.throws(
        () => floodgateExpress(client, { costs: { "/v1/x": 2 }, chargeWith: { "/v1/x": fn } }),
        /in both costs and chargeWith/,
      );
      assert.throws(
        () => floodgateFastifyHook(client, { chargeHeaders: { "/v1/x": "x-cost" }, chargeWith: { "/v1/x": fn } }),
        /in both chargeHeaders and chargeWith/,
      );
      assert.throws(
        () => floodgateExpress(client, { chargeWith: { "/v1/x": "x-cost" as unknown as () => number } }),
        /chargeWith\["\/v1\/x"\] must be a function/,
      );
      // Keyed and normalised as costs are: {id} is :id.
      assert.throws(
        () => floodgateExpress(client, { costs: { "/v1/:id": 2 }, chargeWith: { "/v1/{id}": fn } }),
        /in both costs and chargeWith/,
      );
    } finally {
      client.close();
    }
  });
});

describe("middleware and the agent's protocol version (fake agent)", () => {
  const fakes: FakeAgent[] = [];
  const clients: Client[] = [];
  const servers: http.Server[] = [];
  const fastifies: FastifyInstance[] = [];
  after(async () => {
    for (const s of servers) await new Promise((r) => s.close(r));
    for (const f of fastifies) await f.close();
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  /** Express and Fastify apps limited through a client of a fake agent speaking `version`. */
  async function setup(version: number) {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = version;
    // User "holder"'s lease is held, as a concurrency rule would hold it; user "late"'s too, but
    // answered only when the test says (`answerLate`).
    const late: (() => void)[] = [];
    fake.onCheck = (f, sock) => {
      const c = f.body.kind === "check" ? f.body.check : null;
      const user = c?.form === "attributes" ? c.attributes.user : undefined;
      const answer = () => sock.write(leaseDecision(f.requestId, (user === "holder" || user === "late") && isAcquire(f), "c-http"));
      if (user === "late" && isAcquire(f)) late.push(answer);
      else answer();
    };
    const client = await Client.connect(fake.path, { timeoutMs: 5_000, logger: null });
    clients.push(client);
    assert.equal(client.protocolVersion, version);

    const app = express();
    const limit = floodgateExpress(client, { userHeader: "x-user", logger: null, chargeHeaders: { "/v1/chat": "x-usage-tokens" } });
    app.get("/conc/x", limit, (_req, res) => res.send("ok"));
    app.get("/v1/chat", limit, (_req, res) => res.set("x-usage-tokens", "7").send("answer"));
    const server = await new Promise<http.Server>((r) => {
      const s = app.listen(0, "127.0.0.1", () => r(s));
    });
    servers.push(server);
    const f = Fastify();
    await f.register(floodgateFastify, { client, userHeader: "x-user", logger: null, chargeHeaders: { "/v1/chat": "x-usage-tokens" } });
    f.get("/conc/x", async () => "ok");
    f.get("/v1/chat", async (_request, reply) => reply.header("x-usage-tokens", "7").send("answer"));
    await f.listen({ port: 0, host: "127.0.0.1" });
    fastifies.push(f);
    // Every response's close, whatever the framework does with it.
    const closed: string[] = [];
    for (const s of [server, f.server]) s.on("request", (req, res) => res.on("close", () => closed.push(req.headers["x-user"] as string)));
    return {
      fake,
      late,
      closed,
      bases: [
        `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
        `http://127.0.0.1:${(f.server.address() as AddressInfo).port}`,
      ],
    };
  }

  it("a version-2 agent gets form 1 without a lease, and no release", async () => {
    const { fake, bases } = await setup(2);
    for (const base of bases) {
      const a = await get(base, "/conc/x", { "x-user": "holder" });
      assert.equal(a.status, 200);
    }
    const bodies = checkBodies(fake);
    assert.equal(bodies.length, 2);
    const user = Buffer.from("holder").toString("hex");
    // form 1: endpoint "/conc/x", tier "", user "holder", api key "", ip "127.0.0.1", cost 1.
    for (const b of bodies) {
      assert.equal(b.slice(0, 2), "01");
      assert.ok(b.includes(`0006${user}`));
      assert.ok(b.endsWith("00000001"));
    }
  });

  it("a version-3 agent gets a fresh lease on every check, and the release of a held one, byte for byte", async () => {
    const { fake, bases } = await setup(3);
    for (const base of bases) {
      assert.equal((await get(base, "/conc/x", { "x-user": "holder" })).status, 200);
      assert.equal((await get(base, "/conc/x", { "x-user": "other" })).status, 200);
    }
    // Four checks, each with a lease of its own; the two held ones released after their response.
    await eventually("two releases", 10_000, () => checkBodies(fake).length === 6);
    const checks = fake.received.filter((f) => f.body.kind === "check");
    const acquires = checks.filter(isAcquire);
    assert.equal(acquires.length, 4);
    const leases = acquires.map((f) => (f.body.kind === "check" && f.body.check.form === "attributes" ? f.body.check.attributes.lease : 0n));
    assert.equal(new Set(leases).size, 4, "a fresh lease each");
    const bodies = checkBodies(fake);
    const acquireBodies = bodies.filter((b) => b.slice(-18, -16) === "80");
    const releaseBodies = bodies.filter((b) => b.slice(-18, -16) === "83");
    assert.equal(acquireBodies.length, 4);
    assert.ok(acquireBodies.every((b) => b.startsWith("03")), "form 3");
    assert.equal(releaseBodies.length, 2);
    const heldBodies = acquireBodies.filter((b) => b.includes(Buffer.from("holder").toString("hex")));
    // The release is the acquire with mode 3: the same attributes, cost and lease.
    assert.deepEqual(
      releaseBodies.sort(),
      heldBodies.map((b) => `${b.slice(0, -18)}83${b.slice(-16)}`).sort(),
    );
  });

  it("a charge route's peek of cost 0 with a lease, released with cost 1 when held, byte for byte", async () => {
    const { fake, bases } = await setup(3);
    // The fake holds the lease of every check that carries one and is not a release (here: the
    // request phase's peek), as a concurrency rule the request matches would.
    fake.onCheck = (f, sock) => {
      const c = f.body.kind === "check" && f.body.check.form === "attributes" ? f.body.check.attributes : undefined;
      const holds = c?.lease !== undefined && c.mode !== "release";
      sock.write(leaseDecision(f.requestId, holds, "c-chat"));
    };
    for (const [i, base] of bases.entries()) {
      const r = await get(base, "/v1/chat", { "x-user": "charger" });
      assert.equal(r.status, 200);
      assert.equal(r.body, "answer");
      // Per request: the peek, then (after the response, in either order) its release and its charge.
      await eventually("the release and the charge", 10_000, () => checkBodies(fake).length === 3 * (i + 1));
    }
    const bodies = checkBodies(fake);
    // form 3 ends with cost u32, mode u8 and (with the lease bit) lease u64.
    const peeks = bodies.filter((b) => b.slice(-18, -16) === "81");
    const releases = bodies.filter((b) => b.slice(-18, -16) === "83");
    const charges = bodies.filter((b) => b.endsWith("0000000702"));
    assert.equal(peeks.length, 2);
    assert.equal(releases.length, 2);
    assert.equal(charges.length, 2);
    for (const b of bodies) assert.ok(b.startsWith("03"), "form 3");
    for (const p of peeks) assert.equal(p.slice(-26, -18), "00000000", "the request phase costs 0");
    assert.equal(new Set(peeks.map((p) => p.slice(-16))).size, 2, "a fresh lease each");
    // The release: the peek's attributes and lease, cost 1 (max(0, 1): the unit the peek held), mode 3.
    assert.deepEqual(releases.sort(), peeks.map((p) => `${p.slice(0, -26)}0000000183${p.slice(-16)}`).sort());
    for (const r of releases) assert.notEqual(r.slice(-26, -18), "00000000", "never a release of cost 0");
    // The charge: the same attributes, the header's 7, mode 2, no lease.
    assert.deepEqual(charges.sort(), peeks.map((p) => `${p.slice(0, -26)}0000000702`).sort());
  });

  it("a client gone before the check is answered: the lease the answer holds is released at once", async () => {
    const { fake, late, closed, bases } = await setup(3);
    for (const [i, base] of bases.entries()) {
      const r = send(base, "/conc/x", { "x-user": "late" });
      await eventually("the check to reach the agent", 10_000, () => late.length === i + 1);
      r.req.destroy();
      await eventually("the server to see the response closed", 10_000, () => closed.filter((u) => u === "late").length === i + 1);
      const before = checkBodies(fake).length;
      late[i]();
      await eventually("the release", 10_000, () => checkBodies(fake).length === before + 1);
      const [acquire, release] = fake.received.filter(
        (f) => f.body.kind === "check" && f.body.check.form === "attributes" && f.body.check.attributes.user === "late",
      ).slice(-2);
      assert.ok(acquire.body.kind === "check" && release.body.kind === "check");
      assert.ok(acquire.body.check.form === "attributes" && release.body.check.form === "attributes");
      assert.deepEqual(release.body.check.attributes, { ...acquire.body.check.attributes, mode: "release" });
    }
  });
  it("a check the agent does not answer in time: the fail policy decides, and the lease is released anyway, byte for byte", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = 3;
    // Never answers a check carrying a lease (the request's, and the release too), except user
    // "free"'s, answered by the agent without holding it; answers every other check.
    fake.onCheck = (f, sock) => {
      const { lease, user } = modeAndLease(f);
      if (lease === undefined || user === "free") sock.write(leaseDecision(f.requestId, false, "c-http"));
    };
    const client = await Client.connect(fake.path, { timeoutMs: 100, logger: null });
    clients.push(client);
    assert.equal(client.protocolVersion, 3);
    const warnings: string[] = [];
    const debugs: string[] = [];
    let debugged = () => {};
    const logger = {
      warn: (m: string) => warnings.push(m),
      debug: (m: string) => {
        debugs.push(m);
        debugged();
      },
    };
    const options = { userHeader: "x-user", logger, failFor: { "/conc/closed": "closed" as const } };

    const app = express();
    const limit = floodgateExpress(client, options);
    app.get("/conc/x", limit, (_req, res) => res.send("ok"));
    app.get("/conc/closed", limit, (_req, res) => res.send("ok"));
    const server = await new Promise<http.Server>((r) => {
      const s = app.listen(0, "127.0.0.1", () => r(s));
    });
    servers.push(server);
    const f = Fastify();
    await f.register(floodgateFastify, { client, ...options });
    f.get("/conc/x", async () => "ok");
    f.get("/conc/closed", async () => "ok");
    await f.listen({ port: 0, host: "127.0.0.1" });
    fastifies.push(f);
    // Each response's close (after its finish, where a release is sent), by user.
    const closing = new Map<string, () => void>();
    for (const s of [server, f.server]) {
      s.on("request", (req, res) => res.on("close", () => closing.get(req.headers["x-user"] as string)?.()));
    }
    const closed = (user: string) => new Promise<void>((r) => closing.set(user, r));

    const bases: [string, string][] = [
      ["Express", `http://127.0.0.1:${(server.address() as AddressInfo).port}`],
      ["Fastify", `http://127.0.0.1:${(f.server.address() as AddressInfo).port}`],
    ];
    const checks = () => fake.received.filter((x) => x.body.kind === "check");
    const bodyOf = (frame: (typeof fake.received)[number]) => checkBodies(fake)[checks().indexOf(frame)];
    let n = 0;
    for (const [framework, base] of bases) {
      for (const [path, status] of [
        ["/conc/x", 200],
        ["/conc/closed", 429],
      ] as const) {
        const user = `late-${++n}`;
        const released = nextCheck(fake, `${framework} ${path}: the release`, 10_000, (x) => {
          const m = modeAndLease(x);
          return m.user === user && m.mode === "release";
        });
        const a = await get(base, path, { "x-user": user });
        assert.equal(a.status, status, `${framework} ${path}: the fail policy decides`);
        // No rate-limit headers: the SDK decided alone.
        assert.equal(a.headers["x-ratelimit-limit"], undefined);
        const r = await released;
        const check = checks().find((x) => {
          const m = modeAndLease(x);
          return m.user === user && m.mode === "consume";
        });
        assert.ok(check, "the request's check");
        const acquire = bodyOf(check);
        assert.ok(modeAndLease(check).lease !== undefined);
        // Form 3; the same attributes, cost (1) and lease as the request's check, mode 3.
        assert.ok(acquire.startsWith("03") && acquire.slice(-18, -16) === "80", acquire);
        assert.equal(r.body, `${acquire.slice(0, -18)}83${acquire.slice(-16)}`, `${framework} ${path}`);
        assert.equal(r.body.slice(-26, -18), "00000001", "cost 1");
      }
      // Answered by the agent without the lease held: nothing to release.
      const done = closed("free");
      const ok = await get(base, "/conc/x", { "x-user": "free" });
      assert.equal(ok.status, 200);
      assert.equal(ok.headers["x-ratelimit-limit"], "2");
      await within("the free request's response to close", 10_000, done);
      // A fence: a release would have been written on the same connection before this check.
      assert.equal((await client.allow("user:fence", "c-http", 1)).origin.kind, "agent");
      assert.deepEqual(
        checks()
          .filter((x) => modeAndLease(x).user === "free")
          .map((x) => modeAndLease(x).mode),
        framework === "Express" ? ["consume"] : ["consume", "consume"],
        "no release for a lease the agent said it does not hold",
      );
    }
    // Four precautionary releases, unanswered as well: logged at debug level only, never warned about.
    await within(
      "four debug lines",
      10_000,
      new Promise<void>((resolve) => {
        debugged = () => debugs.filter((m) => m.includes("precautionary")).length >= 4 && resolve();
        debugged();
      }),
    );
    assert.deepEqual(warnings, []);
  });
});
