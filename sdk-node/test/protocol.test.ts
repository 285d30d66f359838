/**
 * The wire protocol: PROTOCOL.md's hex vectors both ways, refusals, rule windows (version 4), trace
 * contexts (version 5) and `traceparent` parsing, reservations and the over-quota flag (version 6),
 * and a decoder that never throws.
 */

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { describe, it } from "node:test";

import {
  checkVersion,
  decodeFrame,
  encodeFrame,
  formatTraceparent,
  InvalidCheck,
  MAX_FRAME,
  parseTraceparent,
  validateCheck,
  validateTrace,
  type Check,
  type Frame,
  type TraceContext,
  type Verdict,
} from "../src/index";
import { REPO } from "./helpers";

/** The vectors as PROTOCOL.md shows them: `<!-- vector: name -->` then a ```hex block. */
function vectorsFromDoc(): Map<string, Buffer> {
  const doc = fs.readFileSync(path.join(REPO, "protocol", "PROTOCOL.md"), "utf8");
  const out = new Map<string, Buffer>();
  const re = /<!--\s*vector:\s*([a-z0-9_]+)\s*-->\s*```hex\n([\s\S]*?)```/g;
  for (let m = re.exec(doc); m; m = re.exec(doc)) {
    out.set(m[1], Buffer.from(m[2].replace(/\s+/g, ""), "hex"));
  }
  return out;
}

const v = (
  allowed: boolean,
  source: Verdict["source"],
  limit: number,
  remaining: number,
  resetAtMs: number,
  retryAfterMs: number,
  logOnly = false,
  holdsLease = false,
  overQuota = false,
): Verdict => ({ allowed, logOnly, holdsLease, overQuota, source, limit, remaining, resetAtMs, retryAfterMs });

/** A decode result as text for an assertion's message (leases are bigints, which JSON refuses). */
const show = (x: unknown) => JSON.stringify(x, (_k, y: unknown) => (typeof y === "bigint" ? `${y}n` : y));

/** The lease of the page's version-3 vectors, and the reservation id of its version-6 ones. */
const LEASE = 0x0123456789abcdefn;

/** The trace context of the page's version-5 vector (and of the W3C recommendation's example). */
const TRACE: TraceContext = {
  traceId: Buffer.from("4bf92f3577b34da6a3ce929d0e0e4736", "hex"),
  spanId: Buffer.from("00f067aa0ba902b7", "hex"),
  flags: 1,
};
/** Its `traceparent` header. */
const TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/** The frames PROTOCOL.md describes in words, built here independently of the hex. */
const EXPECTED: Record<string, Frame> = {
  hello: { requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 1 } },
  hello_ok: { requestId: 0, body: { kind: "helloOk", version: 1 } },
  check_one_item: {
    requestId: 7,
    body: { kind: "check", check: { form: "items", items: [{ key: "user:123", ruleId: "api", cost: 1 }] } },
  },
  check_two_items: {
    requestId: 8,
    body: {
      kind: "check",
      check: {
        form: "items",
        items: [
          { key: "user:123", ruleId: "api", cost: 1 },
          { key: "ip:203.0.113.5", ruleId: "login", cost: 3 },
        ],
      },
    },
  },
  check_attributes: {
    requestId: 9,
    body: {
      kind: "check",
      check: {
        form: "attributes",
        attributes: { endpoint: "/search", tier: "free", user: undefined, apiKey: "abc", ip: undefined, cost: 2 },
      },
    },
  },
  decision_allowed: {
    requestId: 7,
    body: {
      kind: "decision",
      combined: v(true, "redis", 100, 99, 1700000120000, 0),
      items: [{ ruleId: "api", verdict: v(true, "redis", 100, 99, 1700000120000, 0), windowMs: 0 }],
    },
  },
  decision_denied: {
    requestId: 8,
    body: {
      kind: "decision",
      combined: v(false, "cache", 5, 0, 1700000060000, 12000),
      items: [
        { ruleId: "login", verdict: v(false, "cache", 5, 0, 1700000060000, 12000), windowMs: 0 },
        { ruleId: "ip-dry-run", verdict: v(false, "local", 600, 0, 1700000030000, 500, true), windowMs: 0 },
      ],
    },
  },
  error_unknown_rule: { requestId: 7, body: { kind: "error", code: 4, message: 'unknown rule "nope"' } },
  ping: { requestId: 3, body: { kind: "ping" } },
  pong: { requestId: 3, body: { kind: "pong" } },
  hello_v2: { requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 2 } },
  hello_ok_v2: { requestId: 0, body: { kind: "helloOk", version: 2 } },
  fail_modes: { requestId: 11, body: { kind: "failModes" } },
  check_modes: {
    requestId: 12,
    body: {
      kind: "check",
      check: {
        form: "items",
        items: [
          { key: "user:123", ruleId: "tokens", cost: 0, mode: "peek" },
          { key: "user:123", ruleId: "llm", cost: 1500, mode: "charge" },
        ],
      },
    },
  },
  check_attributes_charge: {
    requestId: 13,
    body: {
      kind: "check",
      check: {
        form: "attributes",
        attributes: {
          endpoint: "/v1/chat",
          tier: undefined,
          user: undefined,
          apiKey: "abc",
          ip: undefined,
          cost: 900,
          mode: "charge",
        },
      },
    },
  },
  hello_v3: { requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 3 } },
  hello_ok_v3: { requestId: 0, body: { kind: "helloOk", version: 3 } },
  check_acquire: {
    requestId: 14,
    body: {
      kind: "check",
      check: { form: "items", items: [{ key: "apikey:abc", ruleId: "gpu-slots", cost: 2, mode: "consume", lease: LEASE }] },
    },
  },
  decision_lease: {
    requestId: 14,
    body: {
      kind: "decision",
      combined: v(true, "redis", 4, 2, 1700000060000, 0, false, true),
      items: [{ ruleId: "gpu-slots", verdict: v(true, "redis", 4, 2, 1700000060000, 0, false, true), windowMs: 0 }],
    },
  },
  check_release: {
    requestId: 15,
    body: {
      kind: "check",
      check: {
        form: "items",
        items: [
          { key: "apikey:abc", ruleId: "gpu-slots", cost: 2, mode: "release", lease: LEASE },
          { key: "apikey:xyz", ruleId: "gpu-slots", cost: 1, mode: "release" },
        ],
      },
    },
  },
  check_attributes_lease: {
    requestId: 16,
    body: {
      kind: "check",
      check: {
        form: "attributes",
        attributes: {
          endpoint: "/v1/chat",
          tier: undefined,
          user: undefined,
          apiKey: "abc",
          ip: undefined,
          cost: 1,
          mode: "consume",
          lease: 42n,
        },
      },
    },
  },
  hello_v4: { requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 4 } },
  hello_ok_v4: { requestId: 0, body: { kind: "helloOk", version: 4 } },
  hello_v5: { requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 5 } },
  hello_ok_v5: { requestId: 0, body: { kind: "helloOk", version: 5 } },
  check_traced: {
    requestId: 18,
    body: {
      kind: "check",
      check: { form: "items", items: [{ key: "user:123", ruleId: "api", cost: 1 }] },
      trace: TRACE,
    },
  },
  decision_windows: {
    requestId: 17,
    body: {
      kind: "decision",
      combined: v(true, "redis", 100, 99, 1700000120000, 0),
      items: [
        { ruleId: "api", verdict: v(true, "redis", 100, 99, 1700000120000, 0), windowMs: 60_000 },
        // December 2023 in UTC: 31 days, its period ending at the reset (2024-01-01T00:00:00Z).
        { ruleId: "monthly", verdict: v(true, "redis", 10_000_000, 9_999_000, 1704067200000, 0), windowMs: 2_678_400_000 },
      ],
    },
  },
  hello_v6: { requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 6 } },
  hello_ok_v6: { requestId: 0, body: { kind: "helloOk", version: 6 } },
  check_reserve: {
    requestId: 19,
    body: {
      kind: "check",
      check: {
        form: "items",
        items: [
          { key: "apikey:abc", ruleId: "output-tokens", cost: 4096, mode: "reserve", lease: LEASE },
          { key: "apikey:abc", ruleId: "in-flight", cost: 1, mode: "reserve", lease: LEASE },
        ],
      },
    },
  },
  check_commit: {
    requestId: 20,
    body: {
      kind: "check",
      check: {
        form: "items",
        items: [
          { key: "apikey:abc", ruleId: "output-tokens", cost: 612, mode: "commit", lease: LEASE },
          { key: "apikey:abc", ruleId: "in-flight", cost: 0, mode: "commit", lease: LEASE },
        ],
      },
    },
  },
  decision_over_quota: {
    requestId: 21,
    body: {
      kind: "decision",
      combined: v(true, "redis", 100_000, 0, 1700000120000, 0, false, false, true),
      items: [{ ruleId: "gpt-tokens", verdict: v(true, "redis", 100_000, 0, 1700000120000, 0, false, false, true), windowMs: 0 }],
    },
  },
  fail_mode_list: {
    requestId: 11,
    body: {
      kind: "failModeList",
      list: {
        rulesVersion: 42,
        truncated: false,
        rules: [
          { ruleId: "login-per-ip", dimension: "ip", endpoint: "/login", tier: "", limit: 5 },
          { ruleId: "admin-per-user", dimension: "user", endpoint: "/admin/*", tier: "staff", limit: 100 },
        ],
      },
    },
  },
};

describe("PROTOCOL.md test vectors", () => {
  const vectors = vectorsFromDoc();

  it("the page has every vector this test knows, and no other", () => {
    assert.deepEqual([...vectors.keys()].sort(), Object.keys(EXPECTED).sort());
  });

  for (const [name, frame] of Object.entries(EXPECTED)) {
    it(`${name}: encodes to the page's bytes`, () => {
      const hex = vectors.get(name);
      assert.ok(hex, `PROTOCOL.md has no vector ${name}`);
      assert.equal(encodeFrame(frame).toString("hex"), hex.toString("hex"));
    });

    it(`${name}: decodes from the page's bytes`, () => {
      const hex = vectors.get(name);
      assert.ok(hex, `PROTOCOL.md has no vector ${name}`);
      const r = decodeFrame(hex);
      assert.ok(r.ok, `decode failed: ${show(r)}`);
      assert.equal(r.used, hex.length);
      assert.deepEqual(r.frame, frame);
      // Fewer bytes than the frame: wait for more, whatever the cut.
      for (let cut = 0; cut < hex.length; cut++) {
        const p = decodeFrame(hex.subarray(0, cut));
        assert.equal(p.ok ? "frame" : p.type, "incomplete", `cut at ${cut}`);
      }
    });
  }
});

describe("decoding refusals (PROTOCOL.md's decoding rules)", () => {
  const pong = Buffer.from("00000006010700000003", "hex");

  it("a length over the limit is fatal before the body arrives, naming the request when it can", () => {
    const b = Buffer.from("0001000001040000002a", "hex"); // 4 + 65537 bytes announced
    const r = decodeFrame(b);
    assert.ok(!r.ok && r.type === "fatal");
    assert.equal(r.code, 2);
    assert.equal(r.requestId, 42);
    // The largest allowed frame is incomplete, not refused.
    const max = Buffer.alloc(10);
    max.writeUInt32BE(MAX_FRAME - 4, 0);
    const m = decodeFrame(max);
    assert.ok(!m.ok && m.type === "incomplete");
  });

  it("a length under the header is fatal (code 1)", () => {
    const r = decodeFrame(Buffer.from("0000000501070000", "hex"));
    assert.ok(!r.ok && r.type === "fatal" && r.code === 1);
  });

  it("an unknown kind, unknown flags or source, or extra bytes are fatal", () => {
    const unknownKind = Buffer.from("00000006010a00000003", "hex");
    const extra = Buffer.from("0000000701070000000300", "hex");
    const vec = vectorsFromDoc().get("decision_allowed")!;
    // Bit 2 is version 3's "holds lease", bit 3 version 6's "over quota"; bits 4 to 7 are nothing.
    const badFlags = Buffer.from(vec);
    badFlags[10] = 0x11;
    const badItemFlags = Buffer.from(vec);
    badItemFlags[49] = 0x80 | 0x01; // the item's verdict, after its rule id "api"
    const badSource = Buffer.from(vec);
    badSource[11] = 4;
    const tooManyItems = Buffer.from(vec);
    tooManyItems[44] = 17;
    for (const [name, b] of Object.entries({ unknownKind, extra, badFlags, badItemFlags, badSource, tooManyItems })) {
      const r = decodeFrame(b);
      assert.ok(!r.ok && r.type === "fatal" && r.code === 1, `${name}: ${show(r)}`);
    }
  });

  it("another version and invalid UTF-8 are refused for that frame only, which can be skipped", () => {
    const v7 = Buffer.from("00000006070700000003", "hex");
    const r = decodeFrame(Buffer.concat([v7, pong]));
    assert.ok(!r.ok && r.type === "rejected");
    assert.equal(r.code, 3);
    assert.equal(r.frameLen, 10);
    const vec = Buffer.from(vectorsFromDoc().get("decision_allowed")!);
    vec[46] = 0xff; // the item's rule id "api" becomes invalid UTF-8
    const bad = decodeFrame(vec);
    assert.ok(!bad.ok && bad.type === "rejected");
    assert.equal(bad.code, 5);
    assert.equal(bad.requestId, 7);
    assert.equal(bad.frameLen, vec.length);
  });

  it("any version byte, 1 to 6, is read on any kind", () => {
    for (const version of [2, 3, 4, 5, 6]) {
      const pong2 = Buffer.from(pong);
      pong2[4] = version;
      const a = decodeFrame(pong2);
      assert.ok(a.ok, `version ${version}`);
      assert.deepEqual(a.frame, { requestId: 3, body: { kind: "pong" } });
    }
    const failModes1 = Buffer.from(vectorsFromDoc().get("fail_modes")!);
    failModes1[4] = 1;
    const b = decodeFrame(failModes1);
    assert.ok(b.ok);
    assert.deepEqual(b.frame, { requestId: 11, body: { kind: "failModes" } });
  });

  it("a fail-mode list with unknown flags or a dimension above 3 is fatal; the truncated flag is kept", () => {
    const vec = vectorsFromDoc().get("fail_mode_list")!;
    // Offsets: 10 header, 8 rules version, then the flags (18), the count (19), the first rule's
    // id length (21), its 12 bytes, its dimension (34).
    const badFlags = Buffer.from(vec);
    badFlags[18] = 0x02;
    const badDimension = Buffer.from(vec);
    badDimension[34] = 4;
    for (const [name, b] of Object.entries({ badFlags, badDimension })) {
      const r = decodeFrame(b);
      assert.ok(!r.ok && r.type === "fatal" && r.code === 1, `${name}: ${show(r)}`);
    }
    const truncated = Buffer.from(vec);
    truncated[18] = 0x01;
    const r = decodeFrame(truncated);
    assert.ok(r.ok && r.frame.body.kind === "failModeList");
    assert.equal(r.frame.body.list.truncated, true);
    assert.equal(r.frame.body.list.rules.length, 2);
    assert.equal(encodeFrame(r.frame).toString("hex"), truncated.toString("hex"));
  });

  it("error codes the SDK does not know are kept", () => {
    const e = encodeFrame({ requestId: 5, body: { kind: "error", code: 999, message: "from the future" } });
    const r = decodeFrame(e);
    assert.ok(r.ok);
    assert.deepEqual(r.frame.body, { kind: "error", code: 999, message: "from the future" });
  });

  it("never throws on random bytes, and never reads past what it is given", () => {
    // A fixed-seed xorshift, so a failure reproduces.
    let s = 0x9e3779b9;
    const rnd = () => {
      s ^= s << 13;
      s ^= s >>> 17;
      s ^= s << 5;
      return (s >>> 0) / 0x1_0000_0000;
    };
    const seeds = [...vectorsFromDoc().values()];
    for (let i = 0; i < 20_000; i++) {
      let b: Buffer;
      if (i % 2 === 0) {
        // Mutations of valid frames reach deep into the body parser.
        b = Buffer.from(seeds[i % seeds.length]);
        const flips = 1 + Math.floor(rnd() * 4);
        for (let f = 0; f < flips; f++) b[Math.floor(rnd() * b.length)] = Math.floor(rnd() * 256);
      } else {
        b = Buffer.alloc(Math.floor(rnd() * 64));
        for (let j = 0; j < b.length; j++) b[j] = Math.floor(rnd() * 256);
        if (b.length >= 4 && rnd() < 0.7) b.writeUInt32BE(Math.max(0, b.length - 4 + Math.floor(rnd() * 3) - 1), 0);
      }
      const r = decodeFrame(b);
      if (r.ok) assert.ok(r.used <= b.length);
      else if (r.type === "rejected") assert.ok(r.frameLen <= b.length);
      else if (r.type === "fatal") assert.ok(r.code === 1 || r.code === 2);
    }
  });
});

describe("item modes (version 2)", () => {
  const frame = (requestId: number, check: Check): Frame => ({ requestId, body: { kind: "check", check } });
  const pong = Buffer.from("00000006010700000003", "hex");

  it("a check whose items all consume is version 1's form 0 or 1, byte for byte", () => {
    const vectors = vectorsFromDoc();
    const one: Check = { form: "items", items: [{ key: "user:123", ruleId: "api", cost: 1, mode: "consume" }] };
    const attributes: Check = {
      form: "attributes",
      attributes: { endpoint: "/search", tier: "free", apiKey: "abc", cost: 2, mode: "consume" },
    };
    assert.equal(encodeFrame(frame(7, one)).toString("hex"), vectors.get("check_one_item")!.toString("hex"));
    assert.equal(encodeFrame(frame(9, attributes)).toString("hex"), vectors.get("check_attributes")!.toString("hex"));
    assert.deepEqual([checkVersion(one), checkVersion(attributes)], [1, 1]);
  });

  it("one item that is not consume makes the whole check form 2, consume items carrying byte 0", () => {
    const check: Check = {
      form: "items",
      items: [
        { key: "user:1", ruleId: "api", cost: 1 },
        { key: "user:1", ruleId: "tokens", cost: 0, mode: "peek" },
      ],
    };
    assert.equal(checkVersion(check), 2);
    const b = encodeFrame(frame(5, check));
    assert.equal(b[10], 2, "form 2");
    // header 10, form, count, then item 1: key 2+6, rule id 1+3, cost 4, mode.
    assert.equal(b[10 + 2 + 8 + 4 + 4], 0, "the consume item's mode byte");
    assert.equal(b[b.length - 1], 1, "the peek item's mode byte");
    const r = decodeFrame(b);
    assert.ok(r.ok && r.frame.body.kind === "check" && r.frame.body.check.form === "items");
    assert.deepEqual(
      r.frame.body.check.items.map((i) => i.mode),
      ["consume", "peek"],
    );
    const attributes: Check = { form: "attributes", attributes: { user: "u", cost: 0, mode: "peek" } };
    assert.equal(checkVersion(attributes), 2);
    assert.equal(encodeFrame(frame(6, attributes))[10], 3, "form 3");
  });

  it("a peek may have cost 0; consume and charge need at least 1, encoded or decoded", () => {
    const items = (mode: "consume" | "peek" | "charge", cost: number): Frame =>
      frame(1, { form: "items", items: [{ key: "k", ruleId: "r", cost, mode }] });
    const attrs = (mode: "consume" | "peek" | "charge", cost: number): Frame =>
      frame(1, { form: "attributes", attributes: { user: "u", cost, mode } });
    const absent = { endpoint: undefined, tier: undefined, apiKey: undefined, ip: undefined };
    for (const [f, back] of [
      [items("peek", 0), items("peek", 0)],
      [attrs("peek", 0), frame(1, { form: "attributes", attributes: { ...absent, user: "u", cost: 0, mode: "peek" } })],
    ]) {
      const r = decodeFrame(encodeFrame(f));
      assert.ok(r.ok, show(r));
      assert.deepEqual(r.frame, back);
    }
    for (const f of [items("consume", 0), items("charge", 0), attrs("consume", 0), attrs("charge", 0)]) {
      assert.throws(() => encodeFrame(f), /cost must be an integer from 1/);
    }
    assert.throws(() => encodeFrame(items("peek", -1)), /a peek's cost must be an integer from 0/);
    // The same refusals when decoding: the page's charge of 1500 made 0 is refused (error 5) and
    // skippable; its peek of cost 0 is the vector itself.
    const chargeZero = Buffer.from(vectorsFromDoc().get("check_modes")!);
    chargeZero.writeUInt32BE(0, chargeZero.length - 5);
    const r = decodeFrame(Buffer.concat([chargeZero, pong]));
    assert.ok(!r.ok && r.type === "rejected", show(r));
    assert.deepEqual([r.code, r.requestId, r.frameLen], [5, 12, chargeZero.length]);
  });

  it("an unknown mode byte refuses the check (error 5) and leaves the stream in sync", () => {
    const vectors = vectorsFromDoc();
    const items = Buffer.from(vectors.get("check_modes")!);
    items[33] = 6; // the first item's mode: peek (1) becomes 6 (3 to 5 are versions 3 and 6's)
    const attributes = Buffer.from(vectors.get("check_attributes_charge")!);
    attributes[attributes.length - 1] = 0x7f; // bit 7 clear: no lease follows
    // An unknown mode with the lease bit: the lease is read, then the check refused.
    const leased = Buffer.from(vectors.get("check_attributes_lease")!);
    leased[leased.length - 9] = 0x86;
    for (const [b, id, mode] of [
      [items, 12, 6],
      [attributes, 13, 127],
      [leased, 16, 0x86],
    ] as const) {
      const r = decodeFrame(Buffer.concat([b, pong]));
      assert.ok(!r.ok && r.type === "rejected", show(r));
      assert.deepEqual([r.code, r.requestId, r.frameLen], [5, id, b.length]);
      assert.equal(r.reason, `unknown item mode ${mode}`);
      const next = decodeFrame(Buffer.concat([b, pong]).subarray(r.frameLen));
      assert.ok(next.ok && next.frame.body.kind === "pong");
    }
    // A mode byte on a version-1 form is not read: the body is a byte too long, which is fatal.
    const form0 = Buffer.concat([vectors.get("check_one_item")!, Buffer.from([1])]);
    form0.writeUInt32BE(form0.length - 4, 0);
    const f = decodeFrame(form0);
    assert.ok(!f.ok && f.type === "fatal" && f.code === 1);
  });

  it("encoding refuses a mode it does not know", () => {
    const bad = { key: "k", ruleId: "r", mode: "Peek" } as unknown as { key: string; ruleId: string };
    assert.throws(() => encodeFrame(frame(1, { form: "items", items: [bad] })), /mode must be one of consume, peek, charge, release, reserve, commit/);
    const attributes = { user: "u", mode: 1 } as unknown as { user: string };
    assert.throws(() => encodeFrame(frame(1, { form: "attributes", attributes })), InvalidCheck);
  });
});

describe("leases and releases (version 3)", () => {
  const frame = (requestId: number, check: Check): Frame => ({ requestId, body: { kind: "check", check } });
  const pong = Buffer.from("00000006010700000003", "hex");

  it("a lease or a release needs version 3; a lease on a consume makes the check form 2 or 3", () => {
    const acquire: Check = { form: "items", items: [{ key: "k", ruleId: "r", lease: 1n }] };
    const release: Check = { form: "items", items: [{ key: "k", ruleId: "r", mode: "release" }] };
    const mixed: Check = {
      form: "items",
      items: [
        { key: "k", ruleId: "a", mode: "peek", cost: 0 },
        { key: "k", ruleId: "b", lease: 7n },
      ],
    };
    const attributes: Check = { form: "attributes", attributes: { user: "u", lease: 0n } };
    assert.deepEqual([acquire, release, mixed, attributes].map(checkVersion), [3, 3, 3, 3]);
    const a = encodeFrame(frame(1, acquire));
    // header 10, form, count, key 2+1, rule id 1+1, cost 4, then the mode byte and the lease.
    assert.equal(a[10], 2, "form 2");
    assert.equal(a.subarray(21).toString("hex"), "80" + "0000000000000001");
    const at = encodeFrame(frame(1, attributes));
    assert.equal(at[10], 3, "form 3");
    assert.equal(at.subarray(at.length - 9).toString("hex"), "80" + "0000000000000000", "lease 0 is a lease");
  });

  it("the largest lease round-trips as a bigint; a lease out of range or not a bigint is refused", () => {
    const big: Frame = frame(2, { form: "items", items: [{ key: "k", ruleId: "r", cost: 1, mode: "release", lease: 2n ** 64n - 1n }] });
    const b = encodeFrame(big);
    assert.equal(b.subarray(b.length - 9).toString("hex"), "83" + "ff".repeat(8));
    const r = decodeFrame(b);
    assert.ok(r.ok);
    assert.deepEqual(r.frame, big);
    for (const lease of [2n ** 64n, -1n, 42, "42"]) {
      const bad = frame(1, { form: "items", items: [{ key: "k", ruleId: "r", lease: lease as bigint }] });
      assert.throws(() => encodeFrame(bad), /a lease must be a bigint from 0 to 2\^64-1/, String(lease));
      const attrs = frame(1, { form: "attributes", attributes: { user: "u", lease: lease as bigint } });
      assert.throws(() => encodeFrame(attrs), InvalidCheck, String(lease));
    }
  });

  it("a release needs a cost of at least 1, encoded or decoded", () => {
    assert.throws(
      () => encodeFrame(frame(1, { form: "items", items: [{ key: "k", ruleId: "r", cost: 0, mode: "release", lease: 1n }] })),
      /cost must be an integer from 1/,
    );
    const zero = Buffer.from(vectorsFromDoc().get("check_release")!);
    zero.writeUInt32BE(0, zero.length - 5); // the second item's cost
    const r = decodeFrame(Buffer.concat([zero, pong]));
    assert.ok(!r.ok && r.type === "rejected", show(r));
    assert.deepEqual([r.code, r.requestId, r.frameLen], [5, 15, zero.length]);
  });

  it("a lease bit with the lease cut short is a body that does not parse: fatal", () => {
    const vec = vectorsFromDoc().get("check_acquire")!;
    const cut = Buffer.from(vec.subarray(0, vec.length - 1));
    cut.writeUInt32BE(cut.length - 4, 0);
    const r = decodeFrame(cut);
    assert.ok(!r.ok && r.type === "fatal" && r.code === 1, show(r));
  });

  it("a verdict's holds-lease flag is read and written beside allowed and log only", () => {
    const vec = Buffer.from(vectorsFromDoc().get("decision_lease")!);
    vec[10] = 0x06; // combined: log only and holds lease, not allowed
    const r = decodeFrame(vec);
    assert.ok(r.ok && r.frame.body.kind === "decision");
    assert.deepEqual(
      [r.frame.body.combined.allowed, r.frame.body.combined.logOnly, r.frame.body.combined.holdsLease],
      [false, true, true],
    );
    assert.equal(r.frame.body.items[0].verdict.holdsLease, true);
    assert.equal(encodeFrame(r.frame).toString("hex"), vec.toString("hex"));
  });
});

describe("reservations (version 6)", () => {
  const frame = (requestId: number, check: Check): Frame => ({ requestId, body: { kind: "check", check } });
  const pong = Buffer.from("00000006010700000003", "hex");
  const vectors = vectorsFromDoc();

  it("a reserve or a commit needs version 6, and is form 2 or 3 with its id after the mode byte", () => {
    assert.deepEqual([EXPECTED.check_reserve, EXPECTED.check_commit].map((f) => f.body.kind === "check" && checkVersion(f.body.check)), [6, 6]);
    // One reserve among version-2 and version-3 items makes the whole check version 6's.
    const mixed: Check = {
      form: "items",
      items: [
        { key: "k", ruleId: "a", cost: 0, mode: "peek" },
        { key: "k", ruleId: "b", lease: 7n },
        { key: "k", ruleId: "c", cost: 10, mode: "reserve", lease: 7n },
      ],
    };
    assert.equal(checkVersion(mixed), 6);
    // Check frames keep version byte 1, the version that introduced the kind.
    assert.deepEqual([...vectors.get("check_reserve")!.subarray(4, 6)], [1, 3]);
    for (const [mode, byte] of [
      ["reserve", "84"],
      ["commit", "85"],
    ] as const) {
      const attributes: Check = { form: "attributes", attributes: { user: "u", cost: mode === "commit" ? 0 : 5, mode, lease: 9n } };
      assert.equal(checkVersion(attributes), 6);
      const b = encodeFrame(frame(3, attributes));
      assert.equal(b[10], 3, `${mode}: form 3`);
      assert.equal(b.subarray(b.length - 9).toString("hex"), byte + "0000000000000009", mode);
      const r = decodeFrame(b);
      assert.ok(r.ok, show(r));
      assert.deepEqual(r.frame, frame(3, { form: "attributes", attributes: { endpoint: undefined, tier: undefined, ip: undefined, apiKey: undefined, ...attributes.attributes } }));
    }
  });

  it("a commit may cost 0; a reserve needs at least 1, encoded or decoded", () => {
    const item = (mode: "reserve" | "commit", cost: number): Frame =>
      frame(1, { form: "items", items: [{ key: "k", ruleId: "r", cost, mode, lease: 1n }] });
    const r = decodeFrame(encodeFrame(item("commit", 0)));
    assert.ok(r.ok, show(r));
    assert.deepEqual(r.frame, item("commit", 0));
    assert.throws(() => encodeFrame(item("reserve", 0)), /^InvalidCheck: cost must be an integer from 1/);
    assert.throws(() => encodeFrame(item("commit", -1)), /a commit's cost must be an integer from 0/);
    assert.throws(() => encodeFrame(item("commit", 2 ** 32)), /a commit's cost must be an integer from 0 to 4294967295/);
    // The page's second reserve (cost 1) made 0: refused (error 5) and skippable.
    const zero = Buffer.from(vectors.get("check_reserve")!);
    zero.writeUInt32BE(0, zero.length - 13); // cost u32, mode u8, id u64
    const z = decodeFrame(Buffer.concat([zero, pong]));
    assert.ok(!z.ok && z.type === "rejected", show(z));
    assert.deepEqual([z.code, z.requestId, z.frameLen], [5, 19, zero.length]);
  });

  it("a reserve or a commit without its reservation id is refused, encoded or decoded", () => {
    for (const mode of ["reserve", "commit"] as const) {
      const items: Check = { form: "items", items: [{ key: "k", ruleId: "r", cost: 1, mode }] };
      const attributes: Check = { form: "attributes", attributes: { user: "u", cost: 1, mode } };
      for (const check of [items, attributes]) {
        assert.equal(validateCheck(check), `a ${mode} item needs its reservation id (lease)`);
        assert.throws(() => encodeFrame(frame(1, check)), InvalidCheck, `${mode}, ${check.form}`);
      }
    }
    // The page's commit, its last item without the id (bit 7 clear, 8 bytes fewer): refused for
    // that request only, the stream in sync after it.
    const page = vectors.get("check_commit")!;
    const bare = Buffer.from(page.subarray(0, page.length - 8));
    bare[bare.length - 1] = 0x05;
    bare.writeUInt32BE(bare.length - 4, 0);
    const both = Buffer.concat([bare, pong]);
    const r = decodeFrame(both);
    assert.ok(!r.ok && r.type === "rejected", show(r));
    assert.deepEqual([r.code, r.requestId, r.frameLen, r.reason], [5, 20, bare.length, "a commit item needs its reservation id (lease)"]);
    const next = decodeFrame(both.subarray(r.frameLen));
    assert.ok(next.ok && next.frame.body.kind === "pong");
  });

  it("a Hello offering 1 to 6 is a version-6 frame; an older peer's Hello keeps its own version byte", () => {
    assert.equal(encodeFrame(EXPECTED.hello_v6)[4], 6);
    assert.equal(encodeFrame(EXPECTED.hello_v5)[4], 5);
    // A Hello offering more than this SDK speaks still says 6 in its version byte.
    assert.equal(encodeFrame({ requestId: 0, body: { kind: "hello", minVersion: 1, maxVersion: 9 } })[4], 6);
  });
});

describe("the over-quota flag (version 6)", () => {
  const vectors = vectorsFromDoc();
  const page = vectors.get("decision_over_quota")!;
  // Offsets in the page's frame: 10 header, the combined verdict's flags (10), the item count (44),
  // its rule id's length (45) and 10 bytes, the item verdict's flags (56).
  const COMBINED = 10;
  const ITEM = 56;

  it("the page's flags are allowed and over quota (0x09), on the combined verdict and the item", () => {
    assert.deepEqual([page[COMBINED], page[ITEM]], [0x09, 0x09]);
    assert.equal(page[4], 1, "a Decision without windows is a version-1 frame");
  });

  it("bit 3 is read and written beside allowed, log only and holds lease", () => {
    const all = Buffer.from(page);
    all[COMBINED] = 0x0f;
    const r = decodeFrame(all);
    assert.ok(r.ok && r.frame.body.kind === "decision", show(r));
    const c = r.frame.body.combined;
    assert.deepEqual([c.allowed, c.logOnly, c.holdsLease, c.overQuota], [true, true, true, true]);
    assert.equal(r.frame.body.items[0].verdict.overQuota, true);
    assert.equal(encodeFrame(r.frame).toString("hex"), all.toString("hex"));
    // Without it: the same verdict, not over quota.
    const none = Buffer.from(page);
    none[ITEM] = 0x01;
    const n = decodeFrame(none);
    assert.ok(n.ok && n.frame.body.kind === "decision", show(n));
    assert.deepEqual([n.frame.body.combined.overQuota, n.frame.body.items[0].verdict.overQuota], [true, false]);
  });

  it("bits 4 to 7 are still unknown: fatal, on the combined verdict or an item's", () => {
    for (let bit = 4; bit < 8; bit++) {
      for (const at of [COMBINED, ITEM]) {
        const b = Buffer.from(page);
        b[at] |= 1 << bit;
        const r = decodeFrame(b);
        assert.ok(!r.ok && r.type === "fatal" && r.code === 1, `bit ${bit} at ${at}: ${show(r)}`);
        assert.match(r.reason, /unknown verdict flags/);
      }
    }
  });

  it("a peer of version 5 or older is sent the allowed verdict without the flag, which it would refuse", () => {
    assert.equal(encodeFrame(EXPECTED.decision_over_quota, 6).toString("hex"), page.toString("hex"));
    for (const peer of [1, 2, 3, 4, 5]) {
      const b = encodeFrame(EXPECTED.decision_over_quota, peer);
      assert.equal(b.length, page.length, `peer ${peer}`);
      assert.deepEqual([b[COMBINED], b[ITEM]], [0x01, 0x01], `peer ${peer}: allowed only`);
      const r = decodeFrame(b);
      assert.ok(r.ok && r.frame.body.kind === "decision", show(r));
      assert.equal(r.frame.body.combined.overQuota, false);
      assert.equal(r.frame.body.combined.allowed, true);
    }
  });
});

describe("rule windows (version 4)", () => {
  const vectors = vectorsFromDoc();
  const windows = EXPECTED.decision_windows;
  const pong = Buffer.from("00000006010700000003", "hex");
  const items = (r: ReturnType<typeof decodeFrame>) => {
    assert.ok(r.ok && r.frame.body.kind === "decision", show(r));
    return r.frame.body.items;
  };

  it("a version-1 Decision has no window: its items decode with window 0", () => {
    for (const name of ["decision_allowed", "decision_denied", "decision_lease"]) {
      const b = vectors.get(name)!;
      assert.equal(b[4], 1, `${name} is a version-1 frame`);
      const got = items(decodeFrame(b));
      assert.ok(got.length > 0);
      for (const i of got) assert.equal(i.windowMs, 0, `${name}: ${i.ruleId}`);
    }
  });

  it("the layout is read by the frame's version byte: 2 and 3 are version 1's, 4 carries windows", () => {
    for (const version of [2, 3]) {
      const b = Buffer.from(vectors.get("decision_allowed")!);
      b[4] = version;
      const r = decodeFrame(b);
      assert.ok(r.ok, `version ${version}: ${show(r)}`);
      assert.deepEqual(r.frame, EXPECTED.decision_allowed);
    }
    // Version 1's body under version byte 4 ends before the window: a body that does not parse.
    const short = Buffer.from(vectors.get("decision_allowed")!);
    short[4] = 4;
    const s = decodeFrame(short);
    assert.ok(!s.ok && s.type === "fatal" && s.code === 1, show(s));
    // Version 4's body under version byte 1: 16 bytes of windows left over.
    const long = Buffer.from(vectors.get("decision_windows")!);
    long[4] = 1;
    const l = decodeFrame(long);
    assert.ok(!l.ok && l.type === "fatal" && l.code === 1, show(l));
    // A window cut short is fatal too, wherever the cut.
    const v = vectors.get("decision_windows")!;
    const cut = Buffer.from(v.subarray(0, v.length - 1));
    cut.writeUInt32BE(cut.length - 4, 0);
    const c = decodeFrame(cut);
    assert.ok(!c.ok && c.type === "fatal" && c.code === 1, show(c));
  });

  it("windows are written only as a version-4 frame to a peer of 4, else left out (version 1's form)", () => {
    // To a peer of version 4 (the default): the page's bytes.
    assert.equal(encodeFrame(windows, 4).toString("hex"), vectors.get("decision_windows")!.toString("hex"));
    for (const peer of [1, 2, 3]) {
      const b = encodeFrame(windows, peer);
      assert.equal(b[4], 1, `peer ${peer}: a version-1 frame`);
      assert.equal(b.length, vectors.get("decision_windows")!.length - 16, `peer ${peer}: no windows`);
      const got = items(decodeFrame(b));
      assert.deepEqual(
        got.map((i) => [i.ruleId, i.windowMs]),
        [
          ["api", 0],
          ["monthly", 0],
        ],
      );
    }
    // No window to carry (no items, or concurrency rules only): a version-1 frame even to a peer of 4.
    const none: Frame = {
      requestId: 1,
      body: { kind: "decision", combined: v(true, "local", 0, 0, 0, 0), items: [] },
    };
    assert.equal(encodeFrame(none)[4], 1);
    assert.equal(encodeFrame(EXPECTED.decision_lease).toString("hex"), vectors.get("decision_lease")!.toString("hex"));
    // One window among several items is enough: every item then carries its own, 0 included.
    const mixed: Frame = {
      requestId: 2,
      body: {
        kind: "decision",
        combined: v(true, "redis", 4, 2, 1700000060000, 0),
        items: [
          { ruleId: "gpu-slots", verdict: v(true, "redis", 4, 2, 1700000060000, 0), windowMs: 0 },
          { ruleId: "api", verdict: v(true, "redis", 100, 99, 1700000120000, 0), windowMs: 500 },
        ],
      },
    };
    const m = encodeFrame(mixed);
    assert.equal(m[4], 4);
    const r = decodeFrame(m);
    assert.ok(r.ok, show(r));
    assert.deepEqual(r.frame, mixed);
  });

  it("a version-4 Decision is followed by the next frame, in sync", () => {
    const both = Buffer.concat([vectors.get("decision_windows")!, pong]);
    const r = decodeFrame(both);
    assert.ok(r.ok, show(r));
    assert.deepEqual(r.frame, windows);
    const next = decodeFrame(both.subarray(r.used));
    assert.ok(next.ok && next.frame.body.kind === "pong");
  });
});

describe("trace context (version 5)", () => {
  const vectors = vectorsFromDoc();
  const pong = Buffer.from("00000006010700000003", "hex");
  const traced = EXPECTED.check_traced;
  const withTrace = (requestId: number, check: Check, trace: TraceContext = TRACE): Frame => ({
    requestId,
    body: { kind: "check", check, trace },
  });
  const plain = (requestId: number, check: Check): Frame => ({ requestId, body: { kind: "check", check } });

  it("traceparents round-trip, and bad ones are refused (as the Rust TraceContext::parse)", () => {
    const t = parseTraceparent(TRACEPARENT);
    assert.ok(t);
    assert.equal(t.flags & 1, 1, "sampled");
    assert.deepEqual([...t.spanId], [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
    assert.deepEqual(t, TRACE);
    assert.equal(formatTraceparent(t), TRACEPARENT);
    // A later version, read by its first fields (exactly four of them too).
    const later = parseTraceparent(`cc${TRACEPARENT.slice(2)}-what-comes-next`);
    assert.deepEqual(later, TRACE);
    assert.deepEqual(parseTraceparent(`cc${TRACEPARENT.slice(2)}`), TRACE);
    // Whitespace around the value is not part of it.
    assert.deepEqual(parseTraceparent(` ${TRACEPARENT}\t`), TRACE);
    // Not sampled: flags 00; unknown flag bits are kept.
    assert.equal(parseTraceparent(`${TRACEPARENT.slice(0, -2)}00`)?.flags, 0);
    assert.equal(parseTraceparent(`${TRACEPARENT.slice(0, -2)}ff`)?.flags, 0xff);
    for (const bad of [
      "",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
      "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
      "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
      "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
      "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
      // And a few more: a later version's fifth field must follow a dash; an upper-case version or
      // flags; a short value; Node's join of a repeated header.
      "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
      "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
      `${TRACEPARENT}, ${TRACEPARENT}`,
    ]) {
      assert.equal(parseTraceparent(bad), undefined, JSON.stringify(bad));
    }
    // What a header may be besides a string: nothing to parse.
    for (const odd of [undefined, null, 42, [TRACEPARENT]]) {
      assert.equal(parseTraceparent(odd as unknown as string), undefined, String(odd));
    }
  });

  it("the formatter takes any Uint8Array, a view into a larger buffer included", () => {
    const big = Buffer.concat([Buffer.from("ffff", "hex"), Buffer.from(TRACE.traceId), Buffer.from(TRACE.spanId)]);
    const view: TraceContext = {
      traceId: new Uint8Array(big.buffer, big.byteOffset + 2, 16),
      spanId: big.subarray(18, 26),
      flags: 0,
    };
    assert.equal(formatTraceparent(view), `${TRACEPARENT.slice(0, -2)}00`);
  });

  it("form 4 is written only to a peer of version 5; an older one gets the check as before", () => {
    const page = vectors.get("check_traced")!;
    assert.equal(encodeFrame(traced, 5).toString("hex"), page.toString("hex"));
    // Version byte 1 (the version that introduced Check), form 4, the context, then form 0.
    assert.deepEqual([page[4], page[10], page[36]], [1, 4, 0]);
    const untraced = plain(18, { form: "items", items: [{ key: "user:123", ruleId: "api", cost: 1 }] });
    for (const peer of [0, 1, 2, 3, 4]) {
      assert.equal(encodeFrame(traced, peer).toString("hex"), encodeFrame(untraced).toString("hex"), `peer ${peer}`);
    }
    // The page's check_one_item is the same check: the traced vector is it with 26 bytes inserted.
    const one = vectors.get("check_one_item")!;
    assert.equal(page.length, one.length + 26);
    assert.equal(page.subarray(36).toString("hex"), one.subarray(10).toString("hex"));
  });

  it("form 4 wraps every other form: items with modes and leases, attributes with a lease", () => {
    const checks: Check[] = [
      { form: "items", items: [{ key: "k", ruleId: "r", cost: 2 }] },
      {
        form: "items",
        items: [
          { key: "k", ruleId: "a", cost: 0, mode: "peek" },
          { key: "k", ruleId: "b", cost: 3, mode: "release", lease: LEASE },
        ],
      },
      {
        form: "attributes",
        attributes: { endpoint: "/v1/chat", tier: undefined, user: "u", apiKey: undefined, ip: "203.0.113.5", cost: 1 },
      },
      {
        form: "attributes",
        attributes: { endpoint: undefined, tier: "free", user: undefined, apiKey: "abc", ip: undefined, cost: 0, mode: "peek", lease: 42n },
      },
    ];
    const unsampled: TraceContext = { ...TRACE, flags: 0 };
    for (const [i, check] of checks.entries()) {
      const f = withTrace(100 + i, check, unsampled);
      const b = encodeFrame(f);
      const without = encodeFrame(plain(100 + i, check));
      assert.equal(b[10], 4);
      assert.equal(b.subarray(11, 36).toString("hex"), "4bf92f3577b34da6a3ce929d0e0e4736" + "00f067aa0ba902b7" + "00");
      assert.equal(b.subarray(36).toString("hex"), without.subarray(10).toString("hex"), `check ${i}: the form after the context`);
      assert.equal(b.readUInt32BE(0), without.readUInt32BE(0) + 26);
      const r = decodeFrame(Buffer.concat([b, pong]));
      assert.ok(r.ok, show(r));
      assert.deepEqual(r.frame, f);
      const next = decodeFrame(Buffer.concat([b, pong]).subarray(r.used));
      assert.ok(next.ok && next.frame.body.kind === "pong", "in sync after a traced check");
    }
  });

  it("a plain Uint8Array is written as a Buffer is; an invalid context is refused before sending", () => {
    const check: Check = { form: "items", items: [{ key: "user:123", ruleId: "api", cost: 1 }] };
    const typed: TraceContext = { traceId: new Uint8Array(TRACE.traceId), spanId: new Uint8Array(TRACE.spanId), flags: 1 };
    assert.equal(encodeFrame(withTrace(18, check, typed)).toString("hex"), vectors.get("check_traced")!.toString("hex"));
    const bad: [string, unknown][] = [
      ["a 15-byte trace id", { ...TRACE, traceId: Buffer.alloc(15, 1) }],
      ["a 9-byte span id", { ...TRACE, spanId: Buffer.alloc(9, 1) }],
      ["a trace id in hex", { ...TRACE, traceId: "4bf92f3577b34da6a3ce929d0e0e4736" }],
      ["an all-zero trace id", { ...TRACE, traceId: Buffer.alloc(16) }],
      ["an all-zero span id", { ...TRACE, spanId: Buffer.alloc(8) }],
      ["flags 256", { ...TRACE, flags: 256 }],
      ["flags 1.5", { ...TRACE, flags: 1.5 }],
      ["no flags", { traceId: TRACE.traceId, spanId: TRACE.spanId }],
      ["a string", TRACEPARENT],
    ];
    for (const [name, trace] of bad) {
      assert.ok(validateTrace(trace) !== null, name);
      // Refused whatever the peer: it is the caller's mistake, not the agent's version.
      for (const peer of [4, 5]) {
        assert.throws(() => encodeFrame(withTrace(1, check, trace as TraceContext), peer), InvalidCheck, `${name}, peer ${peer}`);
      }
    }
    assert.equal(validateTrace(TRACE), null);
  });

  it("decoding: an all-zero context is dropped, the check kept; a context cut short, or form 4 twice, is fatal", () => {
    const page = vectors.get("check_traced")!;
    const one = decodeFrame(vectors.get("check_one_item")!);
    assert.ok(one.ok && one.frame.body.kind === "check");
    for (const [at, len] of [
      [11, 16],
      [27, 8],
    ]) {
      const zero = Buffer.from(page);
      zero.fill(0, at, at + len);
      const r = decodeFrame(zero);
      assert.ok(r.ok, show(r));
      assert.deepEqual(r.frame, { requestId: 18, body: one.frame.body }, `ids zeroed at ${at}`);
      assert.ok(!("trace" in r.frame.body), "no trace key at all");
    }
    // A frame that ends inside the context, or right after it (no form), or with form 4 again.
    for (const keep of [11, 20, 35, 36]) {
      const cut = Buffer.from(page.subarray(0, keep));
      cut.writeUInt32BE(keep - 4, 0);
      const r = decodeFrame(cut);
      assert.ok(!r.ok && r.type === "fatal" && r.code === 1, `cut at ${keep}: ${show(r)}`);
      assert.equal(r.requestId, 18);
    }
    const twice = Buffer.concat([page.subarray(0, 36), page.subarray(10)]);
    twice.writeUInt32BE(twice.length - 4, 0);
    const t = decodeFrame(twice);
    assert.ok(!t.ok && t.type === "fatal" && t.code === 1, show(t));
    assert.match(t.reason, /unknown check form 4/);
    // The decoded ids are copies: reusing the read buffer does not change them.
    const buf = Buffer.from(page);
    const r = decodeFrame(buf);
    buf.fill(0);
    assert.ok(r.ok && r.frame.body.kind === "check");
    assert.deepEqual(r.frame.body.trace, TRACE);
  });
});

describe("encoding refuses what the agent would refuse", () => {
  const check = (items: { key: string; ruleId: string; cost?: number }[]): Frame => ({
    requestId: 1,
    body: { kind: "check", check: { form: "items", items } },
  });
  const refused: [string, Frame][] = [
    ["no items", check([])],
    ["17 items", check(Array.from({ length: 17 }, (_, i) => ({ key: `k${i}`, ruleId: "r" })))],
    ["an empty key", check([{ key: "", ruleId: "r" }])],
    ["a 257-byte key", check([{ key: "k".repeat(257), ruleId: "r" }])],
    ["a key of 129 two-byte characters (258 bytes)", check([{ key: "é".repeat(129), ruleId: "r" }])],
    ["a brace", check([{ key: "user:{x}", ruleId: "r" }])],
    ["a control character", check([{ key: "a\nb", ruleId: "r" }])],
    ["a C1 control character", check([{ key: "a\u0085b", ruleId: "r" }])],
    ["a rule id with a space", check([{ key: "k", ruleId: "a b" }])],
    ["a 129-byte rule id", check([{ key: "k", ruleId: "r".repeat(129) }])],
    ["cost 0", check([{ key: "k", ruleId: "r", cost: 0 }])],
    ["cost 2^32", check([{ key: "k", ruleId: "r", cost: 2 ** 32 }])],
    ["a fractional cost", check([{ key: "k", ruleId: "r", cost: 1.5 }])],
    ["the same item twice", check([{ key: "k", ruleId: "r" }, { key: "k", ruleId: "r" }])],
    [
      "a 257-byte attribute",
      { requestId: 1, body: { kind: "check", check: { form: "attributes", attributes: { user: "u".repeat(257) } } } },
    ],
  ];
  for (const [name, frame] of refused) {
    it(`refuses ${name}`, () => assert.throws(() => encodeFrame(frame), InvalidCheck));
  }

  it("accepts the limits themselves: 16 items, 256-byte keys, 128-byte rule ids, cost 2^32-1", () => {
    const items = Array.from({ length: 16 }, (_, i) => ({
      key: `${i}`.padEnd(256, "k"),
      ruleId: "r".repeat(128),
      cost: 2 ** 32 - 1,
    }));
    const b = encodeFrame(check(items));
    const r = decodeFrame(b);
    assert.ok(r.ok);
    assert.deepEqual(r.frame, check(items));
  });
});
