/**
 * Express and Fastify middleware driven over real HTTP, in front of a real agent: a 200 with the
 * binding rule's headers, then a 429 with Retry-After and the JSON body; the matched route as the
 * endpoint, else the path as the framework's router matches it; log-mode rules never block or show;
 * identity headers and X-Forwarded-For believed only when configured (whatever the framework's own
 * proxy setting); odd header values limited under their hash; the fail policy when the agent is away;
 * costs reported in a response header (`chargeHeaders`) charged after the response.
 */

import assert from "node:assert/strict";
import type { AddressInfo } from "node:net";
import type { Server } from "node:http";
import { after, before, describe, it } from "node:test";

import express from "express";
import Fastify, { type FastifyInstance } from "fastify";

import { Client, floodgateExpress, floodgateFastify, floodgateFastifyHook } from "../src/index";
import { Agent, eventually, FakeAgent, RedisServer, tempDir, unique } from "./helpers";

const RULES = `
# Per user and per endpoint: 2 a minute on /api/*.
[[rules]]
id = "mw-user"
dimension = "user"
match = { endpoint = "/api/*" }
limit = 2
windowSeconds = 60
perEndpoint = true

# A dry run on the same routes, tighter: it must never block nor show in the headers.
[[rules]]
id = "mw-dry"
dimension = "ip"
match = { endpoint = "/api/*" }
limit = 1
windowSeconds = 60
mode = "log"

# One request a minute per client IP on /ip.
[[rules]]
id = "mw-ip"
dimension = "ip"
match = { endpoint = "/ip" }
limit = 1
windowSeconds = 60

# Per user on /login exactly: the routing tests' spellings that reach the /login handler count here.
[[rules]]
id = "mw-login"
dimension = "user"
match = { endpoint = "/login" }
limit = 3
windowSeconds = 60

# 1000 LLM tokens an hour per user on /v1/chat, charged after the response (chargeHeaders).
[[rules]]
id = "mw-chat"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 1000
windowSeconds = 3600

# Two requests a minute per client IP on /peer.
[[rules]]
id = "mw-peer"
dimension = "ip"
match = { endpoint = "/peer" }
limit = 2
windowSeconds = 60
`;

interface Answer {
  status: number;
  headers: Headers;
  body: string;
}

async function get(base: string, path: string, headers: Record<string, string> = {}): Promise<Answer> {
  const r = await fetch(`${base}${path}`, { headers });
  return { status: r.status, headers: r.headers, body: await r.text() };
}

/** Serves an Express app on a free loopback port; its base URL. */
async function listen(app: express.Express, servers: Server[]): Promise<string> {
  const server = await new Promise<Server>((r) => {
    const s = app.listen(0, "127.0.0.1", () => r(s));
  });
  servers.push(server);
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/** The limiter's headers of an answer. */
function limits(a: Answer): [string | null, string | null, string | null] {
  return [a.headers.get("x-ratelimit-limit"), a.headers.get("x-ratelimit-remaining"), a.headers.get("x-ratelimit-reset")];
}

/** Distinct client addresses for the X-Forwarded-For scenario, in every run of it. */
let nextClient = 1;

/** Where the middlewares under test report the cost of a /v1/chat response. */
const CHARGE_HEADERS = { "/v1/chat": "x-llm-tokens" };

/**
 * The chargeHeaders scenario both frameworks must pass: /v1/chat's handler reports the cost given
 * in the request's `x-tokens` header (none without it) in `x-llm-tokens`; `warnings` is what the
 * middleware logged.
 */
function chargeScenario(name: string, base: () => string, handled: () => number, client: () => Client, warnings: string[]): void {
  describe(`${name}: costs charged after the response`, () => {
    const left = async (user: string) => (await client().peek(`user:${user}`, "mw-chat", 0)).remaining;

    it("a response reporting 1500 of 1000 passes, and the debt denies the next request", async () => {
      const user = `ivy-${unique()}`;
      const before = handled();
      const first = await get(base(), "/v1/chat", { "x-user": user, "x-tokens": "1500" });
      assert.equal(first.status, 200, first.body);
      assert.equal(first.headers.get("x-llm-tokens"), "1500");
      assert.equal(handled(), before + 1);
      assert.deepEqual(limits(first).slice(0, 2), ["1000", "1000"], "the request-phase peek's figures");
      // The charge is made after the response, not before it: wait for it to land.
      await eventually("the charge of 1500 to land", 10_000, async () => {
        const p = await client().peek(`user:${user}`, "mw-chat", 0);
        return !p.allowed;
      });
      const second = await get(base(), "/v1/chat", { "x-user": user, "x-tokens": "1" });
      assert.equal(second.status, 429, second.body);
      assert.equal(handled(), before + 1, "the handler did not run");
      const retryAfter = second.headers.get("retry-after");
      assert.match(retryAfter ?? "", /^[1-9][0-9]*$/);
      // A window of an hour: 500 over the limit is waited out within two windows at the most.
      assert.ok(Number(retryAfter) <= 7200, `retry after ${retryAfter}`);
      assert.equal(second.body, `{"error":"rate_limited","retryAfter":${retryAfter}}`);
      assert.deepEqual(limits(second).slice(0, 2), ["1000", "0"]);
    });

    it("a response reporting 400 leaves 600; a response without the header charges nothing", async () => {
      const user = `jack-${unique()}`;
      const plain = await get(base(), "/v1/chat", { "x-user": user });
      assert.equal(plain.status, 200);
      assert.equal(plain.headers.get("x-llm-tokens"), null);
      const reported = await get(base(), "/v1/chat", { "x-user": user, "x-tokens": "400" });
      assert.equal(reported.status, 200);
      // The first response's finish came before this request was handled: had it charged
      // anything, this peek would show it, and the wait below would end short of 600.
      assert.deepEqual(limits(reported).slice(0, 2), ["1000", "1000"]);
      const remaining = await eventually("the charge of 400 to land", 10_000, async () => {
        const r = await left(user);
        return r < 1000 && { r };
      });
      assert.equal(remaining.r, 600);
      const after = await get(base(), "/v1/chat", { "x-user": user });
      assert.equal(after.status, 200);
      assert.deepEqual(limits(after).slice(0, 2), ["1000", "600"]);
    });

    it("a value that is not a cost charges nothing, warned about once a minute", async () => {
      const user = `kate-${unique()}`;
      const said = () => warnings.filter((w) => w.includes("x-llm-tokens on /v1/chat")).length;
      assert.equal((await get(base(), "/v1/chat", { "x-user": user, "x-tokens": "lots" })).status, 200);
      await eventually("the warning", 10_000, () => said() === 1);
      assert.match(warnings.find((w) => w.includes("x-llm-tokens on /v1/chat"))!, /"lots", not an integer 0 to 4294967295; nothing charged/);
      assert.equal((await get(base(), "/v1/chat", { "x-user": user, "x-tokens": "4294967296" })).status, 200);
      // A good value after them: once it has landed, both bad ones were read (and charged nothing).
      assert.equal((await get(base(), "/v1/chat", { "x-user": user, "x-tokens": "5" })).status, 200);
      await eventually("the charge of 5 to land", 10_000, async () => (await left(user)) < 1000);
      assert.equal(await left(user), 995);
      assert.equal(said(), 1, "the second bad value within the minute is not warned about");
    });
  });
}

/** The scenario both frameworks must pass, on a server at `base` with the routes below. */
function scenario(name: string, base: () => string, handled: () => number): void {
  describe(`${name} over real HTTP`, () => {
    it("200 with the binding rule's headers, then 429 with Retry-After and the JSON body", async () => {
      const user = `alice-${unique()}`;
      const t0 = Math.floor(Date.now() / 1000);
      const first = await get(base(), "/api/items/1", { "x-user": user });
      assert.equal(first.status, 200, first.body);
      assert.equal(first.body, '{"ok":true}');
      const [limit, remaining, reset] = limits(first);
      assert.equal(limit, "2", "the enforced rule's limit, not the dry run's 1");
      assert.equal(remaining, "1");
      // Epoch seconds of the end of the window after the current one: within 2 × 60 s (+1 for rounding up).
      assert.ok(Number(reset) >= t0 && Number(reset) <= Math.ceil(Date.now() / 1000) + 121, `reset ${reset}`);

      // Another id on the same route: the same endpoint (the matched route), so the same counter.
      const second = await get(base(), "/api/items/2", { "x-user": user });
      assert.equal(second.status, 200, "the dry run's would-be rejection does not block");
      assert.deepEqual(limits(second).slice(0, 2), ["2", "0"]);

      const before = handled();
      const third = await get(base(), "/api/items/3", { "x-user": user });
      assert.equal(third.status, 429);
      assert.equal(handled(), before, "the handler did not run");
      assert.match(third.headers.get("content-type") ?? "", /^application\/json/);
      const retryAfter = third.headers.get("retry-after");
      assert.match(retryAfter ?? "", /^[1-9][0-9]*$/, "whole seconds, at least 1");
      // The window is 60 s: one more request fits within two windows at the most.
      assert.ok(Number(retryAfter) <= 120);
      assert.deepEqual(JSON.parse(third.body), { error: "rate_limited", retryAfter: Number(retryAfter) });
      assert.equal(third.body, `{"error":"rate_limited","retryAfter":${retryAfter}}`);
      assert.deepEqual(limits(third).slice(0, 2), ["2", "0"]);

      // Another user has a budget of its own.
      const other = await get(base(), "/api/items/3", { "x-user": `bob-${unique()}` });
      assert.equal(other.status, 200);
    });

    it("no headers where no enforced rule applies", async () => {
      const a = await get(base(), "/open", { "x-user": `carol-${unique()}` });
      assert.equal(a.status, 200);
      assert.deepEqual(limits(a), [null, null, null]);
    });

    it("X-Forwarded-For from a trusted proxy names the client", async () => {
      // Addresses no other test of this process uses (random ones collided between the Express and
      // Fastify runs on one agent about once in 250).
      const ip = `2001:db8:1::${(nextClient++).toString(16)}`;
      const ip2 = `2001:db8:2::${(nextClient++).toString(16)}`;
      const a = await get(base(), "/ip", { "x-forwarded-for": `6.6.6.6, ${ip}` });
      assert.equal(a.status, 200);
      assert.deepEqual(limits(a).slice(0, 2), ["1", "0"]);
      const b = await get(base(), "/ip", { "x-forwarded-for": `7.7.7.7, ${ip}` });
      assert.equal(b.status, 429, "the same client behind the proxy");
      const c = await get(base(), "/ip", { "x-forwarded-for": ip2 });
      assert.equal(c.status, 200, "another client");
    });

    it("odd header values are limited under their hash instead of breaking the check", async () => {
      const odd = `{evil}-${unique()}`;
      const a = await get(base(), "/api/items/1", { "x-user": odd });
      assert.equal(a.status, 200);
      assert.deepEqual(limits(a).slice(0, 2), ["2", "1"], "the user rule applied");
      await get(base(), "/api/items/1", { "x-user": odd });
      const c = await get(base(), "/api/items/1", { "x-user": odd });
      assert.equal(c.status, 429);
    });

    it("identity headers are not believed unless configured", async () => {
      // /untrusted/... is limited by a middleware with no userHeader: the user rule cannot apply.
      const user = `dave-${unique()}`;
      for (let i = 0; i < 3; i++) {
        const a = await get(base(), "/api/untrusted/1", { "x-user": user });
        assert.equal(a.status, 200);
        assert.deepEqual(limits(a), [null, null, null]);
      }
    });
  });
}

function middleware(store: "embedded" | "redis"): void {
  describe(`middleware (agent on the ${store} store)`, () => {
    let redis: RedisServer | undefined;
    let agent: Agent;
    let client: Client;
    let expressServer: Server;
    let fastify: FastifyInstance;
    let expressBase = "";
    let fastifyBase = "";
    let expressHandled = 0;
    let fastifyHandled = 0;
    const expressWarnings: string[] = [];
    const fastifyWarnings: string[] = [];

    before(async () => {
      if (store === "redis") redis = await RedisServer.start();
      agent = await Agent.start({ rules: RULES, redis: redis?.url });
      client = await Client.connect(agent.socket, { timeoutMs: 5_000 }); // figures, not latency, on a loaded box

      const app = express();
      const limit = floodgateExpress(client, {
        userHeader: "x-user",
        trustProxies: ["127.0.0.1", "::1"],
        chargeHeaders: CHARGE_HEADERS,
        logger: { warn: (m) => expressWarnings.push(m) },
      });
      const noIdentity = floodgateExpress(client, { trustProxies: ["127.0.0.1", "::1"] });
      const ok = (_req: express.Request, res: express.Response) => {
        expressHandled++;
        res.json({ ok: true });
      };
      app.get("/api/items/:id", limit, ok);
      app.get("/api/untrusted/:id", noIdentity, ok);
      app.get("/open", limit, ok);
      app.get("/ip", limit, ok);
      app.get("/v1/chat", limit, (req, res) => {
        expressHandled++;
        const tokens = req.headers["x-tokens"];
        if (typeof tokens === "string") res.setHeader("x-llm-tokens", tokens);
        res.json({ ok: true });
      });
      expressServer = await new Promise<Server>((r) => {
        const s = app.listen(0, "127.0.0.1", () => r(s));
      });
      expressBase = `http://127.0.0.1:${(expressServer.address() as AddressInfo).port}`;

      fastify = Fastify();
      await fastify.register(async (scope) => {
        await scope.register(floodgateFastify, {
          client,
          userHeader: "x-user",
          trustProxies: ["127.0.0.1", "::1"],
          chargeHeaders: CHARGE_HEADERS,
          logger: { warn: (m) => fastifyWarnings.push(m) },
        });
        const ok = async () => {
          fastifyHandled++;
          return { ok: true };
        };
        scope.get("/api/items/:id", ok);
        scope.get("/open", ok);
        scope.get("/ip", ok);
        scope.get("/v1/chat", async (request, reply) => {
          fastifyHandled++;
          const tokens = request.headers["x-tokens"];
          // A number as routes often set one (reply.header keeps it a number until it is written).
          if (typeof tokens === "string") reply.header("x-llm-tokens", /^[0-9]+$/.test(tokens) ? Number(tokens) : tokens);
          return { ok: true };
        });
      });
      fastify.get(
        "/api/untrusted/:id",
        { onRequest: floodgateFastifyHook(client, { trustProxies: ["127.0.0.1"] }) },
        async () => {
          fastifyHandled++;
          return { ok: true };
        },
      );
      await fastify.listen({ port: 0, host: "127.0.0.1" });
      fastifyBase = `http://127.0.0.1:${(fastify.server.address() as AddressInfo).port}`;
    });

    after(async () => {
      await new Promise((r) => expressServer?.close(r));
      await fastify?.close();
      client?.close();
      await agent?.stop();
      await redis?.stop();
    });

    scenario("Express", () => expressBase, () => expressHandled);
    scenario("Fastify", () => fastifyBase, () => fastifyHandled);

    describe("IETF headers (ietfHeaders) name the binding rule's window", () => {
      const servers: Server[] = [];
      let ietfFastify: FastifyInstance | undefined;
      let expressIetf = "";
      let fastifyIetf = "";

      before(async () => {
        const app = express();
        app.get("/api/items/:id", floodgateExpress(client, { userHeader: "x-user", ietfHeaders: true }), (_req, res) =>
          res.send("ok"),
        );
        expressIetf = await listen(app, servers);
        ietfFastify = Fastify();
        await ietfFastify.register(floodgateFastify, { client, userHeader: "x-user", ietfHeaders: true });
        ietfFastify.get("/api/items/:id", async () => "ok");
        await ietfFastify.listen({ port: 0, host: "127.0.0.1" });
        fastifyIetf = `http://127.0.0.1:${(ietfFastify.server.address() as AddressInfo).port}`;
      });
      after(async () => {
        for (const s of servers) await new Promise((r) => s.close(r));
        await ietfFastify?.close();
      });

      for (const [name, base] of [
        ["Express", () => expressIetf],
        ["Fastify", () => fastifyIetf],
      ] as const) {
        it(`${name}: RateLimit-Policy "mw-user";q=2;w=60 (windowSeconds = 60), and RateLimit`, async () => {
          const user = `ietf-${unique()}`;
          const a = await get(base(), "/api/items/1", { "x-user": user });
          assert.equal(a.status, 200, a.body);
          assert.equal(a.headers.get("ratelimit-policy"), '"mw-user";q=2;w=60');
          assert.match(a.headers.get("ratelimit") ?? "", /^"mw-user";r=1;t=[0-9]+$/);
          await get(base(), "/api/items/1", { "x-user": user });
          const denied = await get(base(), "/api/items/1", { "x-user": user });
          assert.equal(denied.status, 429);
          assert.equal(denied.headers.get("ratelimit-policy"), '"mw-user";q=2;w=60', "the window on a 429 too");
        });
      }
    });
    chargeScenario("Express", () => expressBase, () => expressHandled, () => client, expressWarnings);
    chargeScenario("Fastify", () => fastifyBase, () => fastifyHandled, () => client, fastifyWarnings);

    describe("endpoints and peers as the frameworks route and see them", () => {
      const servers: Server[] = [];
      const fastifies: FastifyInstance[] = [];
      let useBase = ""; // app.use(limit), Express's default routing
      let strictBase = ""; // app.use(limit), case sensitive and strict routing
      let mountedBase = ""; // a route's limit in a router mounted at /api/sub
      let expressProxyBase = ""; // Express with `trust proxy` on, no trustProxies
      let fastifyLooseBase = ""; // Fastify with caseSensitive false and ignoreTrailingSlash
      let fastifyProxyBase = ""; // Fastify with trustProxy on, no trustProxies

      before(async () => {
        const limit = floodgateExpress(client, { userHeader: "x-user" });
        const use = express();
        use.use(limit);
        use.get("/login", (_req, res) => res.send("login"));
        useBase = await listen(use, servers);

        const strict = express();
        strict.set("case sensitive routing", true);
        strict.set("strict routing", true);
        strict.use(limit);
        strict.get("/login", (_req, res) => res.send("login"));
        strictBase = await listen(strict, servers);

        const mounted = express();
        const sub = express.Router();
        sub.get("/items/:id", limit, (_req, res) => res.send("item"));
        mounted.use("/api/sub", sub);
        mountedBase = await listen(mounted, servers);

        const expressProxy = express();
        expressProxy.set("trust proxy", true);
        expressProxy.use(floodgateExpress(client));
        expressProxy.get("/peer", (req, res) => res.send(req.ip));
        expressProxyBase = await listen(expressProxy, servers);

        const loose = Fastify({ routerOptions: { caseSensitive: false, ignoreTrailingSlash: true } });
        await loose.register(floodgateFastify, { client, userHeader: "x-user" });
        loose.get("/login", async () => "login");
        await loose.listen({ port: 0, host: "127.0.0.1" });
        fastifies.push(loose);
        fastifyLooseBase = `http://127.0.0.1:${(loose.server.address() as AddressInfo).port}`;

        const fastifyProxy = Fastify({ trustProxy: true });
        await fastifyProxy.register(floodgateFastify, { client });
        fastifyProxy.get("/peer", async (req) => req.ip);
        await fastifyProxy.listen({ port: 0, host: "127.0.0.1" });
        fastifies.push(fastifyProxy);
        fastifyProxyBase = `http://127.0.0.1:${(fastifyProxy.server.address() as AddressInfo).port}`;
      });

      after(async () => {
        for (const s of servers) await new Promise((r) => s.close(r));
        for (const f of fastifies) await f.close();
      });

      it("Express app.use(): /Login and /login/ reach /login by default, so they count as /login", async () => {
        const user = { "x-user": `erin-${unique()}` };
        for (const [path, left] of [["/login", "2"], ["/Login", "1"], ["/LOGIN/", "0"]]) {
          const a = await get(useBase, path, user);
          assert.equal(a.status, 200, path);
          assert.equal(a.body, "login");
          assert.deepEqual(limits(a).slice(0, 2), ["3", left], path);
        }
        assert.equal((await get(useBase, "/login/", user)).status, 429);
        // Express matches the path as sent: /%6Cogin and //login are not /login to it (404), and are
        // not checked as /login either (no 429 for this spent user, no headers).
        for (const path of ["/%6Cogin", "//login"]) {
          const a = await get(useBase, path, user);
          assert.equal(a.status, 404, path);
          assert.deepEqual(limits(a), [null, null, null], path);
        }
      });

      it("Express app.use() with case sensitive and strict routing: /Login and /login/ are not /login", async () => {
        const user = { "x-user": `fred-${unique()}` };
        for (const path of ["/Login", "/login/"]) {
          const a = await get(strictBase, path, user);
          assert.equal(a.status, 404, path);
          assert.deepEqual(limits(a), [null, null, null], path);
        }
        const a = await get(strictBase, "/login", user);
        assert.equal(a.status, 200);
        assert.deepEqual(limits(a).slice(0, 2), ["3", "2"]);
      });

      it("Express route in a mounted router: the mount path in any case is the one route", async () => {
        const user = { "x-user": `gina-${unique()}` };
        const a = await get(mountedBase, "/API/Sub/items/1", user);
        assert.equal(a.status, 200);
        assert.deepEqual(limits(a).slice(0, 2), ["2", "1"], "/api/* applies to /api/sub/items/:id");
        const b = await get(mountedBase, "/api/sub/items/2", user);
        assert.deepEqual(limits(b).slice(0, 2), ["2", "0"], "the same endpoint, the same per-endpoint key");
        assert.equal((await get(mountedBase, "/Api/SUB/items/3/", user)).status, 429);
      });

      it("Fastify: every spelling its router takes to a route counts as that route", async () => {
        const user = { "x-user": `hugo-${unique()}` };
        for (const [path, left] of [["/LOGIN/", "2"], ["/Login", "1"], ["/login", "0"]]) {
          const a = await get(fastifyLooseBase, path, user);
          assert.equal(a.status, 200, path);
          assert.deepEqual(limits(a).slice(0, 2), ["3", left], path);
        }
        assert.equal((await get(fastifyLooseBase, "/login/", user)).status, 429);
      });

      it("the peer is the socket's, whatever Express's trust proxy or Fastify's trustProxy say", async () => {
        // Both frameworks believe the header for req.ip; the middleware, given no trustProxies,
        // keys every request by the socket's peer (127.0.0.1): one client, 2 a minute.
        const a = await get(expressProxyBase, "/peer", { "x-forwarded-for": "9.9.9.1" });
        assert.equal(a.body, "9.9.9.1", "Express took req.ip from the header");
        assert.deepEqual([a.status, ...limits(a).slice(0, 2)], [200, "2", "1"]);
        const b = await get(fastifyProxyBase, "/peer", { "x-forwarded-for": "9.9.9.2" });
        assert.equal(b.body, "9.9.9.2", "Fastify took request.ip from the header");
        assert.deepEqual([b.status, ...limits(b).slice(0, 2)], [200, "2", "0"]);
        assert.equal((await get(expressProxyBase, "/peer", { "x-forwarded-for": "9.9.9.3" })).status, 429);
      });
    });
  });
}

middleware("embedded");
middleware("redis");

describe("middleware when the agent is away", () => {
  it("failFor takes only open or closed, at start", () => {
    const client = new Client(`${tempDir()}/nobody.sock`, { logger: null });
    try {
      assert.throws(() => floodgateExpress(client, { failFor: { "/login": "close" as "closed" } }), /must be "open" or "closed"/);
      assert.throws(() => floodgateFastifyHook(client, { failFor: { "/login": "deny" as "closed" } }), /must be "open" or "closed"/);
    } finally {
      client.close();
    }
  });

  it("fail open: the request passes without headers; fail closed: 429 with Retry-After 1", async () => {
    const missing = `${tempDir()}/nobody.sock`;
    const open = await Client.connect(missing);
    const closed = await Client.connect(missing, { fail: "closed", closedRetryAfterMs: 1000 });
    const app = express();
    app.get("/open", floodgateExpress(open), (_req, res) => res.send("passed"));
    app.get("/closed", floodgateExpress(closed), (_req, res) => res.send("passed"));
    const server = await new Promise<Server>((r) => {
      const s = app.listen(0, "127.0.0.1", () => r(s));
    });
    const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    try {
      const a = await get(base, "/open");
      assert.equal(a.status, 200);
      assert.equal(a.body, "passed");
      assert.deepEqual(limits(a), [null, null, null]);
      const b = await get(base, "/closed");
      assert.equal(b.status, 429);
      assert.equal(b.headers.get("retry-after"), "1");
      assert.equal(b.body, '{"error":"rate_limited","retryAfter":1}');
      assert.deepEqual(limits(b), [null, null, null]);
    } finally {
      await new Promise((r) => server.close(r));
      open.close();
      closed.close();
    }
  });

  /** An Express app whose /v1/chat reports a cost of 1500, limited through `client`; its base URL. */
  async function chatApp(client: Client, warnings: string[], servers: Server[]): Promise<string> {
    const app = express();
    const limit = floodgateExpress(client, { chargeHeaders: CHARGE_HEADERS, logger: { warn: (m) => warnings.push(m) } });
    app.get("/v1/chat", limit, (_req, res) => {
      res.setHeader("x-llm-tokens", "1500");
      res.send("answered");
    });
    return listen(app, servers);
  }

  it("chargeHeaders: the response is not held for a charge the agent cannot take, which is warned about", async () => {
    const client = await Client.connect(`${tempDir()}/nobody.sock`, { logger: null });
    const warnings: string[] = [];
    const servers: Server[] = [];
    try {
      const base = await chatApp(client, warnings, servers);
      const a = await get(base, "/v1/chat");
      assert.deepEqual([a.status, a.body, ...limits(a)], [200, "answered", null, null, null], "fail open");
      const w = await eventually("the warning", 10_000, () => warnings.find((m) => m.includes("charge of 1500")));
      assert.equal(w, "floodgate: the charge of 1500 on /v1/chat was not counted: the agent is unreachable (at most one such warning a minute)");
    } finally {
      for (const s of servers) await new Promise((r) => s.close(r));
      client.close();
    }
  });

  it("chargeHeaders: a version-1 agent is sent neither the peek nor the charge; the request passes, warned", async () => {
    const fake = await FakeAgent.start(); // answers HelloOk with version 1
    const client = await Client.connect(fake.path, { logger: null });
    const warnings: string[] = [];
    const servers: Server[] = [];
    try {
      assert.ok(client.isConnected());
      const base = await chatApp(client, warnings, servers);
      const a = await get(base, "/v1/chat");
      assert.deepEqual([a.status, a.body, ...limits(a)], [200, "answered", null, null, null]);
      const w = await eventually("the warning", 10_000, () => warnings.find((m) => m.includes("version 1")));
      assert.match(w, /the check failed; the request passes: .*peek and charge need protocol version 2/);
      assert.equal(fake.received.filter((f) => f.body.kind === "check").length, 0);
      assert.ok(client.isConnected(), "the connection is kept");
    } finally {
      for (const s of servers) await new Promise((r) => s.close(r));
      client.close();
      await fake.close();
    }
  });
});
