/**
 * The caller's W3C trace context (protocol version 5): every check-making call of the client takes
 * a `traceparent` and, on a connection to an agent of version 5, sends its check as form 4 with
 * those ids; without one, with an invalid one, or to an agent of version 4, the check goes as
 * before, byte for byte (fake agent). Express and Fastify forward the request's `traceparent`
 * header with its check, its charge and its release (fake agent, over real HTTP). A real agent of
 * version 5 answers a traced check as any other.
 */

import assert from "node:assert/strict";
import * as http from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, it } from "node:test";

import express from "express";
import Fastify, { type FastifyInstance } from "fastify";

import {
  Client,
  floodgateExpress,
  floodgateFastify,
  type CallOptions,
  type Frame,
  type TraceContext,
} from "../src/index";
import { Agent, checkBodies, eventually, FakeAgent, leaseDecision, modeAndLease, nextCheck, unique } from "./helpers";

/** The W3C recommendation's example, and the page's `check_traced` vector's context. */
const TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE: TraceContext = {
  traceId: Buffer.from("4bf92f3577b34da6a3ce929d0e0e4736", "hex"),
  spanId: Buffer.from("00f067aa0ba902b7", "hex"),
  flags: 1,
};
/** Form 4 and the context, in hex: what a traced check's body starts with. */
const PREFIX = "04" + "4bf92f3577b34da6a3ce929d0e0e4736" + "00f067aa0ba902b7" + "01";

/** Values a `traceparent` header may hold that are none: each is ignored. */
const INVALID = [
  "",
  "garbage",
  "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
  "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
  "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
  "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
  `${TRACEPARENT}-extra`,
  `${TRACEPARENT}, ${TRACEPARENT}`,
];

const LONG = 5_000;

/** Every check-making call of the client, as `name` and a function of the call's options. */
function calls(client: Client): [string, (o?: CallOptions) => Promise<unknown>][] {
  return [
    ["allow", (o) => client.allow("user:1", "rule", 2, o)],
    ["check", (o) => client.check([{ key: "user:1", ruleId: "rule" }, { key: "ip:1", ruleId: "other", cost: 3 }], o)],
    ["checkAttributes", (o) => client.checkAttributes({ endpoint: "/x", user: "1", cost: 2 }, o)],
    ["peek", (o) => client.peek("user:1", "rule", 0, o)],
    ["charge", (o) => client.charge("user:1", "rule", 9, o)],
    // A release of a given lease: the same bytes each time.
    ["release", (o) => client.release({ key: "user:1", ruleId: "slots", cost: 1, id: 7n }, o)],
  ];
}

describe("the client's traceparent (fake agent)", () => {
  const clients: Client[] = [];
  const fakes: FakeAgent[] = [];
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.close();
  });

  /** A client of a fake agent speaking `version` that answers every check (holding acquires' leases). */
  async function setup(version: number, timeoutMs = LONG) {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = version;
    fake.onCheck = (f, sock) => {
      const { mode, lease } = modeAndLease(f);
      sock.write(leaseDecision(f.requestId, lease !== undefined && mode === "consume"));
    };
    const client = await Client.connect(fake.path, { timeoutMs, logger: null });
    clients.push(client);
    assert.equal(client.protocolVersion, version);
    return { fake, client };
  }

  /** The bodies (hex) of the checks the fake reads while `fn` runs. */
  async function bodiesOf(fake: FakeAgent, fn: () => Promise<unknown>): Promise<string[]> {
    const before = checkBodies(fake).length;
    await fn();
    return checkBodies(fake).slice(before);
  }

  const traces = (fake: FakeAgent) => fake.received.filter((f) => f.body.kind === "check").map((f) => (f.body.kind === "check" ? f.body.trace : undefined));

  it("on a version-5 connection every call sends form 4 with the traceparent's ids, and without one the check as before", async () => {
    const { fake, client } = await setup(5);
    for (const [name, call] of calls(client)) {
      const [plain] = await bodiesOf(fake, () => call());
      const [timed] = await bodiesOf(fake, () => call({ timeoutMs: LONG }));
      const [traced] = await bodiesOf(fake, () => call({ traceparent: TRACEPARENT }));
      const [both] = await bodiesOf(fake, () => call({ traceparent: TRACEPARENT, fail: "closed", timeoutMs: LONG }));
      assert.ok(!plain.startsWith("04") && plain === timed, `${name}: no traceparent, the check as before`);
      assert.equal(traced, PREFIX + plain, `${name}: form 4, the context, then the same check`);
      assert.equal(both, traced, `${name}: with other options too`);
    }
    // Decoded by the fake as the context it was given.
    const seen = traces(fake);
    assert.equal(seen.length, 4 * calls(client).length);
    assert.deepEqual(
      seen.filter((t) => t !== undefined),
      Array(2 * calls(client).length).fill(TRACE),
    );
    // Whitespace around the header's value is not part of it; a later version is read by its fields.
    for (const tp of [`  ${TRACEPARENT} `, `cc${TRACEPARENT.slice(2)}-more`]) {
      const [b] = await bodiesOf(fake, () => client.allow("user:1", "rule", 2, { traceparent: tp }));
      assert.ok(b.startsWith(PREFIX), tp);
    }
    // Check frames keep version byte 1, traced or not.
    assert.ok(fake.receivedBytes.filter((b) => b[5] === 0x03).every((b) => b[4] === 1));
    assert.equal(fake.connections, 1);
  });

  it("acquire and hold send the traceparent with the acquire and with the release", async () => {
    const { fake, client } = await setup(5);
    const isTraced = (f: Frame) => f.body.kind === "check" && f.body.trace !== undefined;
    const a = await client.acquire("user:2", "slots", 1, { traceparent: TRACEPARENT });
    assert.ok(a.lease, "the fake holds it");
    await client.release(a.lease, { traceparent: TRACEPARENT });
    const h = await client.hold("user:3", "slots", 2, () => "done", { traceparent: TRACEPARENT });
    assert.ok(h.allowed);
    const checks = fake.received.filter((f) => f.body.kind === "check");
    assert.deepEqual(
      checks.map((f) => [modeAndLease(f).mode, isTraced(f)]),
      [
        ["consume", true],
        ["release", true],
        ["consume", true],
        ["release", true],
      ],
    );
    for (const b of checkBodies(fake)) assert.ok(b.startsWith(PREFIX), b);
    // Without one: neither.
    await client.hold("user:4", "slots", 1, () => "done");
    assert.deepEqual(
      fake.received.filter((f) => f.body.kind === "check").slice(4).map(isTraced),
      [false, false],
    );
  });

  it("an acquire the agent does not answer: its precautionary release carries the traceparent too", async () => {
    const fake = await FakeAgent.start();
    fakes.push(fake);
    fake.helloVersion = 5;
    // Never answers the acquire; answers the release.
    fake.onCheck = (f, sock) => {
      if (modeAndLease(f).mode === "release") sock.write(leaseDecision(f.requestId, false));
    };
    const client = await Client.connect(fake.path, { timeoutMs: 100, logger: null });
    clients.push(client);
    const released = nextCheck(fake, "the precautionary release", 10_000, (f) => modeAndLease(f).mode === "release");
    const a = await client.acquire("user:5", "slots", 1, { traceparent: TRACEPARENT });
    assert.equal(a.decision.origin.kind, "failOpen");
    const r = await released;
    assert.ok(r.frame.body.kind === "check");
    assert.deepEqual(r.frame.body.trace, TRACE);
    assert.ok(r.body.startsWith(PREFIX));
  });

  it("an invalid traceparent is ignored: the check goes as without one", async () => {
    const { fake, client } = await setup(5);
    for (const [name, call] of calls(client)) {
      const [plain] = await bodiesOf(fake, () => call());
      for (const tp of INVALID) {
        const [b] = await bodiesOf(fake, () => call({ traceparent: tp }));
        assert.equal(b, plain, `${name} with ${JSON.stringify(tp)}`);
      }
      // What a header may be besides a string (JavaScript callers): ignored as well.
      for (const odd of [null, 42, [TRACEPARENT]]) {
        const [b] = await bodiesOf(fake, () => call({ traceparent: odd as unknown as string }));
        assert.equal(b, plain, `${name} with ${String(odd)}`);
      }
    }
    assert.ok(traces(fake).every((t) => t === undefined));
    assert.equal(fake.connections, 1);
  });

  for (const version of [4, 3]) {
    it(`on a version-${version} connection no form 4 is ever sent: the same bytes as without a traceparent`, async () => {
      const { fake, client } = await setup(version);
      for (const [name, call] of calls(client)) {
        const [plain] = await bodiesOf(fake, () => call());
        const [traced] = await bodiesOf(fake, () => call({ traceparent: TRACEPARENT }));
        assert.equal(traced, plain, name);
      }
      const a = await client.acquire("user:6", "slots", 1, { traceparent: TRACEPARENT });
      assert.ok(a.lease);
      await client.release(a.lease, { traceparent: TRACEPARENT });
      assert.ok(checkBodies(fake).every((b) => !b.startsWith("04")));
      assert.ok(traces(fake).every((t) => t === undefined));
      assert.equal(fake.connections, 1, "the agent never saw a form it cannot parse");
    });
  }

  it("the version is the connection's: a traced check to a version-4 agent, then to its version-5 successor", async () => {
    const { fake, client } = await setup(4);
    const [old] = await bodiesOf(fake, () => client.allow("user:7", "rule", 1, { traceparent: TRACEPARENT }));
    assert.ok(!old.startsWith("04"));
    // The agent is upgraded: the connection is remade and the new one negotiates 5.
    fake.helloVersion = 5;
    for (const s of fake.sockets) s.destroy();
    await eventually("the client to reconnect at version 5", 10_000, () => client.protocolVersion === 5);
    const [upgraded] = await bodiesOf(fake, () => client.allow("user:7", "rule", 1, { traceparent: TRACEPARENT }));
    assert.equal(upgraded, PREFIX + old);
  });
});

// ---------------------------------------------------------------------------------------------
// Middleware

interface Answer {
  status: number;
  body: string;
}

function get(base: string, path: string, headers: Record<string, string> = {}): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = http.request(`${base}${path}`, { headers, agent: false }, (m) => {
      let body = "";
      m.setEncoding("utf8");
      m.on("data", (c: string) => (body += c));
      m.on("end", () => resolve({ status: m.statusCode ?? 0, body }));
      m.on("error", reject);
    });
    req.on("error", reject);
    req.end();
  });
}

describe("Express and Fastify forward the request's traceparent (fake agent)", () => {
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
    // Every check carrying a lease that is not a release holds it, as a concurrency rule would: the
    // request's check, and a charge route's peek, are released once the response is done.
    fake.onCheck = (f, sock) => {
      const { mode, lease } = modeAndLease(f);
      sock.write(leaseDecision(f.requestId, lease !== undefined && mode !== "release", "c-http"));
    };
    const client = await Client.connect(fake.path, { timeoutMs: LONG, logger: null });
    clients.push(client);
    assert.equal(client.protocolVersion, version);
    const options = { userHeader: "x-user", logger: null, chargeHeaders: { "/v1/chat": "x-usage-tokens" } };

    const app = express();
    const limit = floodgateExpress(client, options);
    app.get("/conc/x", limit, (_req, res) => res.send("ok"));
    app.get("/v1/chat", limit, (_req, res) => res.set("x-usage-tokens", "7").send("answer"));
    const server = await new Promise<http.Server>((r) => {
      const s = app.listen(0, "127.0.0.1", () => r(s));
    });
    servers.push(server);
    const f = Fastify();
    await f.register(floodgateFastify, { client, ...options });
    f.get("/conc/x", async () => "ok");
    f.get("/v1/chat", async (_request, reply) => reply.header("x-usage-tokens", "7").send("answer"));
    await f.listen({ port: 0, host: "127.0.0.1" });
    fastifies.push(f);
    return {
      fake,
      bases: [
        ["Express", `http://127.0.0.1:${(server.address() as AddressInfo).port}`],
        ["Fastify", `http://127.0.0.1:${(f.server.address() as AddressInfo).port}`],
      ] as const,
    };
  }

  /** The checks the fake read for `user`, with their bodies in hex. */
  function checksOf(fake: FakeAgent, user: string): { frame: Frame; body: string }[] {
    const bodies = checkBodies(fake);
    return fake.received
      .filter((f) => f.body.kind === "check")
      .map((frame, i) => ({ frame, body: bodies[i] }))
      .filter((c) => modeAndLease(c.frame).user === user);
  }

  /**
   * Sends one request per route as `user` (a fresh one each) with `headers`, and waits for its
   * checks: the check and its release on /conc/x; the peek, its release and the charge on /v1/chat.
   */
  async function run(fake: FakeAgent, base: string, headers: Record<string, string>) {
    const user = unique();
    const conc = `${user}-conc`;
    const chat = `${user}-chat`;
    assert.equal((await get(base, "/conc/x", { ...headers, "x-user": conc })).status, 200);
    assert.equal((await get(base, "/v1/chat", { ...headers, "x-user": chat })).body, "answer");
    await eventually("the releases and the charge", 10_000, () => checksOf(fake, conc).length === 2 && checksOf(fake, chat).length === 3);
    const all = [...checksOf(fake, conc), ...checksOf(fake, chat)];
    assert.deepEqual(
      all.map((c) => modeAndLease(c.frame).mode).sort(),
      ["charge", "consume", "peek", "release", "release"],
    );
    return all;
  }

  it("on a version-5 agent the check, the charge and the release of a request carry its traceparent", async () => {
    const { fake, bases } = await setup(5);
    for (const [framework, base] of bases) {
      for (const c of await run(fake, base, { traceparent: TRACEPARENT })) {
        const what = `${framework} ${modeAndLease(c.frame).mode}`;
        assert.ok(c.frame.body.kind === "check");
        assert.deepEqual(c.frame.body.trace, TRACE, what);
        assert.ok(c.body.startsWith(PREFIX), what);
      }
      // Without the header, or with one that is not a traceparent: the checks as before.
      const untraced: Record<string, string>[] = [{}, { traceparent: "00-not-a-trace-01" }, { traceparent: INVALID[2] }];
      for (const headers of untraced) {
        for (const c of await run(fake, base, headers)) {
          assert.ok(c.frame.body.kind === "check" && c.frame.body.trace === undefined, `${framework} ${JSON.stringify(headers)}`);
          assert.ok(c.body.startsWith("03"), "form 3");
        }
      }
    }
  });

  it("a version-4 agent gets no form 4 from the middleware, traceparent or not", async () => {
    const { fake, bases } = await setup(4);
    for (const [framework, base] of bases) {
      for (const c of await run(fake, base, { traceparent: TRACEPARENT })) {
        assert.ok(c.frame.body.kind === "check" && c.frame.body.trace === undefined, framework);
        assert.ok(c.body.startsWith("03"), `${framework}: form 3`);
      }
    }
    assert.equal(fake.connections, 1);
  });
});

// ---------------------------------------------------------------------------------------------
// A real agent

describe("a traced check against a real agent (embedded store)", () => {
  let agent: Agent;
  let client: Client;
  const PATIENT = { timeoutMs: 5_000 };

  before(async () => {
    agent = await Agent.start({
      rules: `
[[rules]]
id = "tr-three"
dimension = "user"
match = { endpoint = "/trace/*" }
limit = 3
windowSeconds = 60
`,
    });
    client = await Client.connect(agent.socket, PATIENT);
  });
  after(async () => {
    client?.close();
    await agent?.stop();
  });

  it("is answered as any check: the same figures, counted with untraced ones", async () => {
    assert.equal(client.protocolVersion, 6, "the agent speaks version 6, trace contexts included");
    const key = `user:${unique()}`;
    const unsampled = `${TRACEPARENT.slice(0, -2)}00`;
    const a = await client.allow(key, "tr-three", 1, { ...PATIENT, traceparent: TRACEPARENT });
    const b = await client.allow(key, "tr-three", 1, PATIENT);
    const c = await client.allow(key, "tr-three", 1, { ...PATIENT, traceparent: unsampled });
    const d = await client.allow(key, "tr-three", 1, { ...PATIENT, traceparent: TRACEPARENT });
    assert.deepEqual(
      [a, b, c, d].map((x) => [x.origin.kind, x.allowed, x.limit, x.remaining]),
      [
        ["agent", true, 3, 2],
        ["agent", true, 3, 1],
        ["agent", true, 3, 0],
        ["agent", false, 3, 0],
      ],
    );
    assert.ok((d.retryAfterMs ?? 0) > 0);
    // The agent's rule matching, traced too.
    const e = await client.checkAttributes({ endpoint: "/trace/x", user: unique() }, { ...PATIENT, traceparent: TRACEPARENT });
    assert.deepEqual([e.origin.kind, e.allowed, e.limit, e.remaining, e.items.map((i) => i.ruleId)], ["agent", true, 3, 2, ["tr-three"]]);
    assert.ok(client.isConnected(), "the connection stayed up");
    assert.equal(client.stats().connects, 1);
  });
});
