/** What both middlewares share: wire-safe values, trusted proxies, headers, Retry-After, routes. */

import assert from "node:assert/strict";
import * as os from "node:os";
import { describe, it } from "node:test";

import { reportedCost } from "../src/http";
import {
  Cidr,
  Client,
  clientIp,
  floodgateExpress,
  floodgateFastifyHook,
  fnv1a64Hex,
  rateLimitHeaders,
  retryAfterSeconds,
  routeName,
  validateCheck,
  wireSafe,
  type Decision,
} from "../src/index";

describe("wireSafe", () => {
  it("FNV-1a 64 matches the published test vectors", () => {
    // From the FNV reference (Fowler/Noll/Vo test suite): "", "a", "foobar".
    assert.equal(fnv1a64Hex(""), "cbf29ce484222325");
    assert.equal(fnv1a64Hex("a"), "af63dc4c8601ec8c");
    assert.equal(fnv1a64Hex("foobar"), "85944171f73967e8");
  });

  it("hashes exactly the values the wire refuses, as h: and 16 hex digits of FNV-1a", () => {
    // Expected values computed independently (Python, over the UTF-8 bytes).
    assert.equal(wireSafe("{"), "h:af63f64c860218ba");
    assert.equal(wireSafe("}"), "h:af63f04c86020e88");
    assert.equal(wireSafe("user:{alice}"), "h:fa907b7feed6a55a");
    assert.equal(wireSafe("{victim}"), "h:0a5b9694d4ec70f5"); // PROTOCOL.md's worked example
    assert.equal(wireSafe("x".repeat(300)), "h:e78ddf9f1ba85555");
    assert.equal(wireSafe("a\u0007b"), "h:e5cfb31904245d09");
    // 129 two-byte characters are 258 bytes: over the limit although only 129 characters.
    assert.equal(wireSafe("é".repeat(129)), "h:73ea2ad5bad1f801");
    // Values the wire accepts pass unchanged, up to 256 bytes.
    assert.equal(wireSafe("alice"), "alice");
    assert.equal(wireSafe("é".repeat(128)), "é".repeat(128));
    assert.equal(wireSafe("a\u00a0b"), "a\u00a0b"); // no-break space is not a control character
    assert.equal(wireSafe("a\u0085b").slice(0, 2), "h:"); // NEL is (C1)
  });

  it("what it gives is always a valid attribute", () => {
    for (const odd of ["{", "x".repeat(300), "a\u0007b", "\u0000", "é".repeat(200)]) {
      assert.equal(validateCheck({ form: "attributes", attributes: { user: wireSafe(odd), cost: 1 } }), null);
    }
  });
});

describe("client IP and trusted proxies", () => {
  const trusted = [Cidr.parse("10.0.0.0/8"), Cidr.parse("::1")];
  const ip = (peer: string, xff?: string | string[]) => clientIp(peer, xff, trusted);

  it("believes X-Forwarded-For only from trusted proxies, read from the right", () => {
    // Not from a proxy: the header is the client's own words, ignored.
    assert.equal(ip("203.0.113.9", "1.2.3.4"), "203.0.113.9");
    // From a proxy: the rightmost address it did not vouch for.
    assert.equal(ip("10.0.0.2", "6.6.6.6, 198.51.100.7, 10.0.0.5"), "198.51.100.7");
    // Several header lines count as one list, in order.
    assert.equal(ip("10.0.0.2", ["6.6.6.6", "198.51.100.7"]), "198.51.100.7");
    // Garbage stops the walk at the last trusted hop.
    assert.equal(ip("10.0.0.2", "198.51.100.7, bogus"), "10.0.0.2");
    assert.equal(ip("10.0.0.2", "198.51.100.7, 1.2.3.4:80"), "10.0.0.2");
    // A proxy without the header: the proxy is the client.
    assert.equal(ip("::1"), "::1");
    // No proxies configured: never the header.
    assert.equal(clientIp("10.0.0.2", "6.6.6.6", []), "10.0.0.2");
    assert.equal(clientIp(undefined, "6.6.6.6", trusted), undefined);
  });

  it("handles IPv4-mapped addresses on both sides, and gives IPv4 and canonical IPv6", () => {
    // A dual-stack listener shows an IPv4 proxy as ::ffff:10.0.0.2.
    assert.equal(ip("::ffff:10.0.0.2", "198.51.100.7"), "198.51.100.7");
    assert.equal(ip("::ffff:203.0.113.9", "1.2.3.4"), "203.0.113.9");
    assert.equal(ip("10.0.0.2", "::ffff:10.1.1.1, ::FFFF:198.51.100.7"), "198.51.100.7");
    assert.equal(ip("10.0.0.2", "2001:DB8:0:0:0:0:0:1"), "2001:db8::1");
    assert.equal(ip("2001:db8:0:0:1:0:0:1"), "2001:db8::1:0:0:1");
    assert.equal(ip("fe80::1%eth0"), undefined);
    assert.ok(Cidr.parse("::ffff:10.1.2.3").contains("10.1.2.3"));
    assert.ok(Cidr.parse("10.0.0.0/8").contains("::ffff:10.9.9.9"));
    const mapped = Cidr.parse("::ffff:10.0.0.0/104");
    assert.ok(mapped.contains("10.9.9.9"));
    assert.ok(mapped.contains("::ffff:10.9.9.9"));
    assert.ok(!mapped.contains("11.0.0.1"));
    assert.ok(Cidr.parse("0.0.0.0/0").contains("8.8.8.8"));
    assert.ok(!Cidr.parse("0.0.0.0/0").contains("2001:db8::1"));
    assert.ok(Cidr.parse("2001:db8::/32").contains("2001:db8:ffff::1"));
    assert.ok(!Cidr.parse("2001:db8::/32").contains("2001:db9::1"));
  });

  it("refuses bad blocks", () => {
    for (const bad of ["10.0.0.0/33", "::/129", "10.0.0", "nope", "10.0.0.0/x", "10.0.0.0/-1"]) {
      assert.throws(() => Cidr.parse(bad), /./, bad);
    }
  });
});

describe("headers and Retry-After", () => {
  const verdict = (limit: number, remaining: number, resetAtMs: number, logOnly = false) => ({
    allowed: true,
    logOnly,
    holdsLease: false,
    overQuota: false,
    source: "redis" as const,
    limit,
    remaining,
    resetAtMs,
    retryAfterMs: 0,
  });
  const decision = (d: Partial<Decision>): Decision => ({
    allowed: true,
    limit: 0,
    remaining: 0,
    resetAtMs: 0,
    origin: { kind: "agent", source: "redis" },
    logOnly: false,
    overQuota: false,
    overQuotaRules: [],
    items: [],
    ...d,
  });

  it("carry the binding enforced rule's figures, reset in epoch seconds rounded up", () => {
    const d = decision({
      limit: 100,
      remaining: 7,
      resetAtMs: 1_700_000_000_001,
      items: [
        { ruleId: "dry", verdict: verdict(100, 7, 1_700_000_000_001, true), windowMs: 10_000 },
        { ruleId: "api", verdict: verdict(100, 7, 1_700_000_000_001), windowMs: 60_000 },
      ],
    });
    assert.deepEqual(rateLimitHeaders(d, true, 1_699_999_998_500), [
      ["X-RateLimit-Limit", "100"],
      ["X-RateLimit-Remaining", "7"],
      ["X-RateLimit-Reset", "1700000001"],
      ["RateLimit-Policy", '"api";q=100;w=60'],
      ["RateLimit", '"api";r=7;t=2'],
    ]);
  });

  it("RateLimit-Policy names the binding rule's window in whole seconds, rounded up; none for 0", () => {
    const policy = (windowMs: number) => {
      const d = decision({
        limit: 10,
        remaining: 3,
        resetAtMs: 2_001,
        items: [{ ruleId: "r", verdict: verdict(10, 3, 2_001), windowMs }],
      });
      const h = rateLimitHeaders(d, true, 1_000);
      assert.deepEqual(h[4], ["RateLimit", '"r";r=3;t=2'], "RateLimit is unchanged by the window");
      return h[3];
    };
    assert.deepEqual(policy(60_000), ["RateLimit-Policy", '"r";q=10;w=60']);
    assert.deepEqual(policy(500), ["RateLimit-Policy", '"r";q=10;w=1'], "a 500 ms window is w=1, never w=0");
    assert.deepEqual(policy(60_001), ["RateLimit-Policy", '"r";q=10;w=61']);
    // A month's period (December: 31 days).
    assert.deepEqual(policy(2_678_400_000), ["RateLimit-Policy", '"r";q=10;w=2678400']);
    // No window (a concurrency rule, an agent of version 3 or older): no w= at all.
    assert.deepEqual(policy(0), ["RateLimit-Policy", '"r";q=10']);
    // Without ietf, no policy at all, window or not.
    const d = decision({ limit: 10, remaining: 3, resetAtMs: 2_001, items: [{ ruleId: "r", verdict: verdict(10, 3, 2_001), windowMs: 60_000 }] });
    assert.equal(rateLimitHeaders(d, false, 1_000).length, 3);
  });

  it("the window is the binding item's, not another item's", () => {
    // The tighter item binds: its window is named, not the looser one's.
    const d = decision({
      limit: 5,
      remaining: 1,
      resetAtMs: 9_000,
      items: [
        { ruleId: "wide", verdict: verdict(1000, 900, 3_600_000), windowMs: 3_600_000 },
        { ruleId: "slots", verdict: verdict(4, 2, 30_000), windowMs: 0 },
        { ruleId: "narrow", verdict: verdict(5, 1, 9_000), windowMs: 10_000 },
      ],
    });
    assert.deepEqual(rateLimitHeaders(d, true, 0)[3], ["RateLimit-Policy", '"narrow";q=5;w=10']);
    // A concurrency rule binding: no window to name.
    const held = decision({ ...d, limit: 4, remaining: 2, resetAtMs: 30_000 });
    assert.deepEqual(rateLimitHeaders(held, true, 0)[3], ["RateLimit-Policy", '"slots";q=4']);
  });

  it("are absent when no enforced rule applied (no match, log mode only, SDK decided)", () => {
    assert.deepEqual(rateLimitHeaders(decision({})), []);
    const logOnly = decision({
      limit: 600,
      remaining: 0,
      resetAtMs: 5,
      logOnly: true,
      items: [{ ruleId: "dry", verdict: verdict(600, 0, 5, true), windowMs: 60_000 }],
    });
    assert.deepEqual(rateLimitHeaders(logOnly), []);
    const failClosed = decision({ allowed: false, retryAfterMs: 1000, origin: { kind: "failClosed", reason: "timeout" } });
    assert.deepEqual(rateLimitHeaders(failClosed), []);
  });

  it("Retry-After is whole seconds, rounded up, at least 1", () => {
    const d = (ms: number | undefined) => decision({ allowed: false, retryAfterMs: ms });
    assert.equal(retryAfterSeconds(d(1)), 1);
    assert.equal(retryAfterSeconds(d(1000)), 1);
    assert.equal(retryAfterSeconds(d(1001)), 2);
    assert.equal(retryAfterSeconds(d(0)), 1);
    assert.equal(retryAfterSeconds(d(undefined)), 1);
  });

  it("routes lose their braces", () => {
    assert.equal(routeName("/items/{id}/parts/{*rest}"), "/items/:id/parts/*rest");
    assert.equal(routeName("/plain/:id"), "/plain/:id");
    assert.equal(routeName("/users{/:id}"), "/users/:id");
  });
});

describe("chargeHeaders", () => {
  it("reads a cost of 1 to 2^32-1 from the header; 0 or none is nothing, anything else is bad", () => {
    assert.equal(reportedCost("1500"), 1500);
    assert.equal(reportedCost(" 42 "), 42);
    assert.equal(reportedCost(400), 400, "reply.header(name, 400) keeps the number");
    assert.equal(reportedCost(["7"]), 7, "one line");
    assert.equal(reportedCost("4294967295"), 4294967295);
    for (const none of [undefined, null, "0", 0, "000"]) assert.equal(reportedCost(none), 0, String(none));
    for (const bad of ["", " ", "lots", "1e3", "-5", "+5", "1.5", "0x10", "4294967296", 1.5, -1, 2 ** 32, NaN, ["1", "2"], {}]) {
      assert.equal(reportedCost(bad), undefined, JSON.stringify(bad));
    }
  });

  it("takes header names only, and no endpoint that also has a fixed cost, at start", () => {
    const client = new Client(`${os.tmpdir()}/fg-node-nobody-${process.pid}.sock`, { logger: null });
    try {
      assert.throws(() => floodgateExpress(client, { chargeHeaders: { "/v1/chat": "x llm tokens" } }), /must be a header name/);
      assert.throws(
        () => floodgateFastifyHook(client, { costs: { "/v1/{id}": 5 }, chargeHeaders: { "/v1/:id": "x-llm-tokens" } }),
        /in both costs and chargeHeaders/,
      );
      floodgateExpress(client, { costs: { "/search": 5 }, chargeHeaders: { "/v1/chat": "X-LLM-Tokens" } });
    } finally {
      client.close();
    }
  });
});
