/**
 * A real agent SIGKILLed under a `failMode = "closed"` rule: the client has learned the agent's
 * fail-closed rules, so checks touching that rule are denied (429 with Retry-After and the rule's
 * X-RateLimit-* headers in Express and Fastify) while the others answer by the fail policy (open),
 * and a route's `failFor` decides alone.
 */

import assert from "node:assert/strict";
import type { AddressInfo } from "node:net";
import type { Server } from "node:http";
import { describe, it } from "node:test";

import express from "express";
import Fastify from "fastify";

import { Client, floodgateExpress, floodgateFastify, type RateLimitOptions } from "../src/index";
import { Agent, eventually } from "./helpers";

const RULES = `
# Login attempts per client IP: denied while the agent is away.
[[rules]]
id = "fc-login"
dimension = "ip"
match = { endpoint = "/login" }
limit = 5
windowSeconds = 60
failMode = "closed"

# Searches per client IP: pass while the agent is away.
[[rules]]
id = "fc-search"
dimension = "ip"
match = { endpoint = "/search" }
limit = 100
windowSeconds = 60
failMode = "open"
`;

interface Answer {
  status: number;
  headers: Headers;
  body: string;
}

async function get(base: string, path: string): Promise<Answer> {
  const r = await fetch(`${base}${path}`);
  return { status: r.status, headers: r.headers, body: await r.text() };
}

function limits(a: Answer): [string | null, string | null, string | null] {
  return [a.headers.get("x-ratelimit-limit"), a.headers.get("x-ratelimit-remaining"), a.headers.get("x-ratelimit-reset")];
}

/** An agent on RULES and a client connected to it (figures, not latency: a patient timeout). */
async function start(): Promise<{ agent: Agent; client: Client }> {
  const agent = await Agent.start({ rules: RULES });
  const client = await Client.connect(agent.socket, { timeoutMs: 5_000, logger: null });
  return { agent, client };
}

/** Waits until the client holds the agent's list: the one fail-closed rule, from a rules file. */
async function learned(client: Client): Promise<void> {
  await eventually("the client to learn the fail-closed rules", 10_000, () => client.health().failClosedRules === 1);
  assert.equal(client.health().rulesVersion, 0, "a rules file's version");
}

describe("the agent killed under a fail-closed rule", () => {
  it("client: the rule's checks are denied with its figures, the others pass, a per-call policy decides alone", async () => {
    const { agent, client } = await start();
    try {
      const first = await client.checkAttributes({ endpoint: "/login", ip: "192.0.2.1" });
      assert.deepEqual([first.origin.kind, first.allowed, first.limit], ["agent", true, 5]);
      await learned(client);
      await agent.kill();

      const t0 = Date.now();
      const login = await client.checkAttributes({ endpoint: "/login", ip: "192.0.2.1" });
      assert.equal(login.allowed, false);
      assert.equal(login.origin.kind, "failClosed");
      assert.deepEqual([login.limit, login.remaining, login.retryAfterMs, login.source], [5, 0, 1000, "fallback"]);
      assert.ok(login.resetAtMs >= t0 + 1000 && login.resetAtMs <= Date.now() + 1000, `reset ${login.resetAtMs}`);
      assert.deepEqual(login.items.map((i) => i.ruleId), ["fc-login"]);
      assert.equal((await client.allow("ip:192.0.2.1", "fc-login")).allowed, false, "an item naming the rule");

      const search = await client.checkAttributes({ endpoint: "/search", ip: "192.0.2.1" });
      assert.deepEqual([search.allowed, search.origin.kind], [true, "failOpen"]);
      const perCall = await client.checkAttributes({ endpoint: "/login", ip: "192.0.2.1" }, { fail: "open" });
      assert.deepEqual([perCall.allowed, perCall.origin.kind], [true, "failOpen"]);

      const h = client.health();
      assert.deepEqual([h.connected, h.failClosedRules, h.rulesVersion], [false, 1, 0], "the list outlives the agent");
    } finally {
      client.close();
      await agent.stop();
    }
  });

  /**
   * The scenario both frameworks pass. `serve(options)` serves /login and /search behind the
   * framework's middleware with those options and returns the base URL.
   */
  function http(name: string, serve: (client: Client, options: RateLimitOptions) => Promise<[string, () => Promise<void>]>) {
    it(`${name}: /login answers 429 with Retry-After and the rule's headers, /search 200, failFor decides alone`, async () => {
      const { agent, client } = await start();
      const closers: (() => Promise<void>)[] = [];
      try {
        const [base, close] = await serve(client, {});
        closers.push(close);
        const [forBase, forClose] = await serve(client, { failFor: { "/login": "open", "/search": "closed" } });
        closers.push(forClose);

        const up = await get(base, "/login");
        assert.equal(up.status, 200, "the agent answered");
        assert.deepEqual(limits(up).slice(0, 2), ["5", "4"]);
        await learned(client);
        await agent.kill();

        const t0 = Math.floor(Date.now() / 1000);
        const login = await get(base, "/login");
        assert.equal(login.status, 429);
        assert.equal(login.headers.get("retry-after"), "1");
        assert.equal(login.body, '{"error":"rate_limited","retryAfter":1}');
        const [limit, remaining, reset] = limits(login);
        assert.deepEqual([limit, remaining], ["5", "0"]);
        // Now + the client's fail-closed Retry-After (1 s), in epoch seconds rounded up.
        assert.ok(Number(reset) >= t0 + 1 && Number(reset) <= Math.ceil(Date.now() / 1000) + 1, `reset ${reset}`);

        const search = await get(base, "/search");
        assert.equal(search.status, 200, "an open rule passes");
        assert.equal(search.body, "search");
        assert.deepEqual(limits(search), [null, null, null]);

        const openLogin = await get(forBase, "/login");
        assert.equal(openLogin.status, 200, "failFor open on /login");
        assert.equal(openLogin.body, "login");
        const closedSearch = await get(forBase, "/search");
        assert.equal(closedSearch.status, 429, "failFor closed on /search");
        assert.equal(closedSearch.headers.get("retry-after"), "1");
        assert.deepEqual(limits(closedSearch), [null, null, null], "no rule's figures: the route's policy decided");
      } finally {
        for (const c of closers) await c();
        client.close();
        await agent.stop();
      }
    });
  }

  http("Express", async (client, options) => {
    const app = express();
    const limit = floodgateExpress(client, options);
    app.get("/login", limit, (_req, res) => res.send("login"));
    app.get("/search", limit, (_req, res) => res.send("search"));
    const server = await new Promise<Server>((r) => {
      const s = app.listen(0, "127.0.0.1", () => r(s));
    });
    return [
      `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
      () => new Promise<void>((r) => server.close(() => r())),
    ];
  });

  http("Fastify", async (client, options) => {
    const app = Fastify();
    await app.register(floodgateFastify, { client, ...options });
    app.get("/login", async () => "login");
    app.get("/search", async () => "search");
    await app.listen({ port: 0, host: "127.0.0.1" });
    return [`http://127.0.0.1:${(app.server.address() as AddressInfo).port}`, () => app.close()];
  });
});
