/**
 * Floodgate's wire protocol, versions 1 to 6 (`protocol/PROTOCOL.md`): frames to bytes and bytes
 * to frames. No I/O here. {@link decodeFrame} never throws, whatever bytes it is given.
 *
 * A frame is `length u32 | version u8 | kind u8 | request id u32 | body`, big-endian, the length
 * counting everything after itself; a whole frame is at most 65,536 bytes. The version byte is the
 * version that introduced the frame's kind (2 for FailModes and FailModeList, else 1; Hello's is
 * `min(max_version, 6)`), so a version-1 peer reads every frame it knows; except a Decision whose
 * items carry rule windows, a version-4 frame sent only to a peer that negotiated 4. A Decision's
 * layout is read by its own version byte, not by the connection's. A Check that carries the
 * caller's trace context (form 4, version 5) or reserves and commits (modes 4 and 5, version 6)
 * keeps version byte 1 and is sent only to a peer that negotiated that version. A verdict's over-quota
 * flag (version 6) is written only for a peer of version 6 or later, whose decoder knows the bit.
 */

import type { ClosedRule, FailModeList, ListedDimension } from "./fail-modes";

/**
 * The highest protocol version this SDK speaks (2: the fail-mode list and item modes; 3: leases and
 * releases of concurrency rules; 4: each decided item's rule window; 5: a check's trace context;
 * 6: reservations, reserved and committed, and quota mode's over-quota verdicts).
 */
export const VERSION = 6;
/** The lowest protocol version this SDK speaks. */
export const MIN_VERSION = 1;
/** Largest frame on the wire, the 4-byte length prefix included (64 KiB). */
export const MAX_FRAME = 64 * 1024;
/** Bytes of the length prefix. */
export const LEN_PREFIX = 4;
/** Bytes after the prefix every frame carries: version, kind, request id. */
export const HEADER = 6;
/** Most items one check may carry. */
export const MAX_ITEMS = 16;
/** Longest key, in bytes of UTF-8. */
export const MAX_KEY = 256;
/** Longest rule id, in bytes. */
export const MAX_RULE_ID = 128;
/** Longest request attribute, in bytes of UTF-8. */
export const MAX_ATTRIBUTE = 256;
/** Longest error message, in bytes of UTF-8. */
export const MAX_MESSAGE = 1024;
/** Bytes of one encoded verdict. */
export const VERDICT_LEN = 34;
/** Largest cost (u32). */
export const MAX_COST = 0xffff_ffff;
/** Largest lease id (u64); a reservation id is carried in the same field. */
export const MAX_LEASE = 0xffff_ffff_ffff_ffffn;

/** Frame kinds (the byte after the version). */
export const Kind = {
  Hello: 0x01,
  HelloOk: 0x02,
  Check: 0x03,
  Decision: 0x04,
  Error: 0x05,
  Ping: 0x06,
  Pong: 0x07,
  /** Version 2: which rules fail closed (client to agent, empty body). */
  FailModes: 0x08,
  /** Version 2: the rules that fail closed (agent to client). */
  FailModeList: 0x09,
} as const;

/** Error codes carried by Error frames. Unknown codes are kept as numbers. */
export const ErrorCode = {
  MalformedFrame: 1,
  FrameTooLarge: 2,
  UnsupportedVersion: 3,
  UnknownRule: 4,
  InvalidItem: 5,
  UnexpectedFrame: 6,
  Overloaded: 7,
  Internal: 8,
} as const;

/** Where a verdict came from. */
export type Source = "redis" | "local" | "cache" | "fallback";
const SOURCES: readonly Source[] = ["redis", "local", "cache", "fallback"];

/** A listed rule's dimension by its wire byte. */
const DIMENSIONS: readonly ListedDimension[] = ["user", "apiKey", "ip", "descriptor"];

/** FailModeList flags bit 0: more rules than one frame holds. */
const LIST_TRUNCATED = 0b01;

/**
 * Verdict flags: bit 0 allowed, bit 1 log only, bit 2 (version 3) holds lease, bit 3 (version 6)
 * over quota. Any other bit is malformed.
 */
const FLAG_ALLOWED = 0b0001;
const FLAG_LOG_ONLY = 0b0010;
const FLAG_HOLDS_LEASE = 0b0100;
const FLAG_OVER_QUOTA = 0b1000;
const KNOWN_FLAGS = FLAG_ALLOWED | FLAG_LOG_ONLY | FLAG_HOLDS_LEASE | FLAG_OVER_QUOTA;

/**
 * In a mode byte (version 3): a `lease u64` follows; bits 0 to 6 are the mode. A reserve or a
 * commit (version 6) carries its reservation id there.
 */
const MODE_LEASE = 0x80;

/** The version whose Decision frames carry each item's rule window (`window_ms u64`). */
const WINDOWS = 4;
/** The version whose verdicts may carry the over-quota flag (bit 3); an older peer refuses the bit. */
const OVER_QUOTA = 6;

/** Check forms: 0 and 1 in version 1; 2 and 3, the same with item modes, in version 2. */
const FORM_ITEMS = 0;
const FORM_ATTRIBUTES = 1;
const FORM_ITEMS_MODES = 2;
const FORM_ATTRIBUTES_MODE = 3;
/** Version 5: a trace context (trace id, span id, flags), then one of the forms above. */
const FORM_TRACED = 4;

/** The version whose Check may carry a trace context (form 4). */
export const TRACE_VERSION = 5;
/** The version whose Check may reserve and commit (modes 4 and 5). */
export const RESERVE_VERSION = 6;
/** Bytes of a trace id, of a span id, and of form 4's whole context (ids and flags). */
const TRACE_ID_LEN = 16;
const SPAN_ID_LEN = 8;
const TRACE_LEN = TRACE_ID_LEN + SPAN_ID_LEN + 1;

/**
 * What an item does with its cost (protocol version 2; version 1 knows only `consume`):
 *
 * - `consume`: takes the cost if the check passes, all or nothing with the check's other consume
 *   items (a concurrency rule: acquires the cost under the item's lease);
 * - `peek`: changes nothing; says whether the cost would pass now and what is left now;
 * - `charge`: always takes the cost, even past the limit (a debt later checks wait out); never denied;
 * - `release` (version 3): gives a concurrency rule's units back: those of the item's lease, or
 *   without a lease up to `cost` units of the key's leases; never denied (a peek on other rules);
 * - `reserve` (version 6): a consume of `cost` (a request's most, e.g. its `max_tokens`) that the
 *   agent then holds under the item's `lease`, its reservation id, until a commit settles it or
 *   the rule's `reservationSeconds` run out; a reserve again under an id held adds to it;
 * - `commit` (version 6): settles the reservation named by `lease` at `cost`, what the request
 *   used (0 allowed): the unused rest goes back, a use past it is charged; never denied. A
 *   concurrency rule's reservation is a lease, released whole whatever the figure.
 */
export type ItemMode = "consume" | "peek" | "charge" | "release" | "reserve" | "commit";
/** The modes by their wire byte. */
const MODES: readonly ItemMode[] = ["consume", "peek", "charge", "release", "reserve", "commit"];

/** One `(key, ruleId, cost)` item of a check. */
export interface Item {
  /** The client key, e.g. `user:123` (1 to 256 bytes; no braces or control characters). */
  key: string;
  /** The rule to check the key against (1 to 128 bytes of `[A-Za-z0-9_.:-]`). */
  ruleId: string;
  /**
   * Units this request consumes (an integer, 1 to 2³²−1; a peek may ask about 0, and a commit say
   * the request used 0; default 1).
   */
  cost?: number;
  /**
   * What the item does with its cost (default `consume`; the others need protocol version 2, a
   * release 3, a reserve or commit 6).
   */
  mode?: ItemMode;
  /**
   * The client's lease id, 0 to 2⁶⁴−1 (protocol version 3): a concurrency rule's units a consume
   * takes are held under it, and a release with the same lease and cost gives them back. Other
   * rules ignore it. A reserve or commit (version 6) must carry one: its reservation id.
   */
  lease?: bigint;
}

/** Request attributes for the agent to match against its rules; absent or `""` means absent. */
export interface Attributes {
  /** The matched route or path, e.g. `/search`. */
  endpoint?: string | null;
  /** The client tier, e.g. `free`. */
  tier?: string | null;
  /** The user id. */
  user?: string | null;
  /** The API key (or an id of it). */
  apiKey?: string | null;
  /** The client IP address. */
  ip?: string | null;
  /** Units this request consumes (a peek may ask about 0, a commit say 0 were used; default 1). */
  cost?: number;
  /** What every matched rule's item does with the cost (default `consume`; see {@link ItemMode}). */
  mode?: ItemMode;
  /**
   * The client's lease id for every matched concurrency rule (protocol version 3), or the
   * reservation id of a reserve or commit (version 6; see {@link Item.lease}).
   */
  lease?: bigint;
}

/** The figures of one decision, per item or combined. */
export interface Verdict {
  /** Whether the request may pass. */
  allowed: boolean;
  /** The rule is in log mode: reported, never enforced. */
  logOnly: boolean;
  /**
   * A concurrency rule holds the item's lease (protocol version 3): release it when the request
   * ends, or it runs out at `resetAtMs`. On a reserve (version 6): the agent holds the item's
   * reservation; commit it when the request's use is known.
   */
  holdsLease: boolean;
  /**
   * Quota mode (protocol version 6): the item is past the limit of a rule with
   * `overLimit = "flag"`, and allowed all the same, counting nothing, for the caller to route the
   * request elsewhere (a cheaper model, a fallback backend). It never decides the check. On the
   * combined verdict of an allowed check: some item has it. Always false from an older agent.
   */
  overQuota: boolean;
  /** Where the answer came from. */
  source: Source;
  /** The rule's limit per window (token bucket: its capacity). */
  limit: number;
  /** Units left after this request. */
  remaining: number;
  /** Unix ms at which the key is back to its full limit. */
  resetAtMs: number;
  /** On a denial, ms until this request could pass; 0 when allowed. */
  retryAfterMs: number;
}

/** A verdict on one item (one matched rule for an attribute check). */
export interface ItemDecision {
  /** The rule that decided. */
  ruleId: string;
  /** Its verdict. */
  verdict: Verdict;
  /**
   * The rule's window in ms (protocol version 4; 0 from an older agent, and in a version-1 Decision
   * frame): a sliding window's or token bucket's `windowSeconds` (an override's where the key has
   * one), a calendar quota's current period (a month of 28 to 31 days, a day of 23 or 25 hours
   * across a DST change); 0 for a concurrency rule, which has none. The IETF `RateLimit-Policy`
   * header's `w`. A number, like the verdict's figures: exact up to 2⁵³ ms (285,000 years).
   */
  windowMs: number;
}

/** The check a Check frame carries. */
export type Check =
  | { form: "items"; items: Item[] }
  | { form: "attributes"; attributes: Attributes };

/**
 * A W3C trace context as a check carries it (protocol version 5, form 4): the caller's trace and
 * span, so that the agent's span of the check is a child of the request that asked. It changes
 * nothing in the decision.
 */
export interface TraceContext {
  /** The trace's 16 bytes (never all zero): a `traceparent`'s trace-id. */
  traceId: Uint8Array;
  /** The caller's span, the parent of the agent's: 8 bytes (never all zero), a `traceparent`'s parent-id. */
  spanId: Uint8Array;
  /** Trace flags, 0 to 255: bit 0 says the caller records (samples) this trace. */
  flags: number;
}

/** A decoded frame body. */
export type Body =
  | { kind: "hello"; minVersion: number; maxVersion: number }
  | { kind: "helloOk"; version: number }
  | {
      kind: "check";
      check: Check;
      /**
       * The caller's trace context (version 5): written as form 4 only to a peer of version 5 or
       * later, left out for an older one. Absent when the check carries none (a decoded context
       * whose ids are all zero is dropped, as the agent drops it).
       */
      trace?: TraceContext;
    }
  | { kind: "decision"; combined: Verdict; items: ItemDecision[] }
  | { kind: "error"; code: number; message: string }
  | { kind: "ping" }
  | { kind: "pong" }
  | { kind: "failModes" }
  | { kind: "failModeList"; list: FailModeList };

/** A frame: a request id and what it carries. */
export interface Frame {
  requestId: number;
  body: Body;
}

/** Why {@link decodeFrame} produced no frame. */
export type DecodeFailure =
  /** Not enough bytes yet (not an error on a stream). */
  | { type: "incomplete" }
  /** The stream cannot be resynchronised: close it. */
  | { type: "fatal"; code: number; requestId: number | null; reason: string }
  /** A well-delimited frame whose content is refused: skip `frameLen` bytes and go on. */
  | { type: "rejected"; code: number; requestId: number; reason: string; frameLen: number };

/** The result of {@link decodeFrame}. */
export type DecodeResult = { ok: true; frame: Frame; used: number } | ({ ok: false } & DecodeFailure);

/** A check that breaks a protocol limit, found before it is sent. */
export class InvalidCheck extends Error {
  constructor(message: string) {
    super(message);
    this.name = "InvalidCheck";
  }
}

// ---------------------------------------------------------------------------------------------
// Validation

// Unicode general category Cc, as Rust's `char::is_control`.
// eslint-disable-next-line no-control-regex
const FORBIDDEN = /[{}\u0000-\u001f\u007f-\u009f]/;
const RULE_ID = /^[A-Za-z0-9_.:-]+$/;

function validateText(name: string, value: unknown, max: number): string | null {
  if (typeof value !== "string") return `${name} must be a string`;
  if (value.length === 0) return `${name} is empty`;
  const n = Buffer.byteLength(value, "utf8");
  if (n > max) return `${name} is ${n} bytes, over the ${max}-byte limit`;
  const bad = FORBIDDEN.exec(value);
  if (bad) {
    return `${name} contains ${JSON.stringify(bad[0])}: braces (Redis hash tags) and control characters are not allowed`;
  }
  return null;
}

/** Why a rule id is refused, or null when it is valid: 1 to 128 bytes of `[A-Za-z0-9_.:-]`. */
export function validateRuleId(ruleId: unknown): string | null {
  if (typeof ruleId !== "string") return "rule id must be a string";
  if (ruleId.length === 0 || ruleId.length > MAX_RULE_ID) {
    return `rule id must be 1 to ${MAX_RULE_ID} bytes, not ${Buffer.byteLength(ruleId)}`;
  }
  if (!RULE_ID.test(ruleId)) {
    return `rule id ${JSON.stringify(ruleId)} may hold only ASCII letters, digits and _ - . :`;
  }
  return null;
}

function validateMode(mode: unknown): string | null {
  if (mode === undefined || MODES.includes(mode as ItemMode)) return null;
  return `mode must be one of ${MODES.join(", ")}, not ${JSON.stringify(mode)}`;
}

function validateLease(lease: unknown): string | null {
  if (lease === undefined) return null;
  if (typeof lease !== "bigint" || lease < 0n || lease > MAX_LEASE) {
    const shown = typeof lease === "bigint" ? `${lease}n` : typeof lease === "string" ? JSON.stringify(lease) : String(lease);
    return `a lease must be a bigint from 0 to 2^64-1, not ${shown}`;
  }
  return null;
}

/**
 * Whether a mode may cost 0: a peek asks about nothing, a commit says the request used nothing.
 * Every other mode takes at least 1.
 */
function mayCostNothing(mode: ItemMode): boolean {
  switch (mode) {
    case "peek":
    case "commit":
      return true;
    case "consume":
    case "charge":
    case "release":
    case "reserve":
      return false;
  }
}

/** Whether a mode names a reservation (version 6): it needs its id in the lease field. */
function reserves(mode: ItemMode): boolean {
  switch (mode) {
    case "reserve":
    case "commit":
      return true;
    case "consume":
    case "peek":
    case "charge":
    case "release":
      return false;
  }
}

/**
 * Whether an item's cost and lease fit its mode (already checked to be one): a cost of 0 only
 * where the mode may cost nothing, and a reservation id on every reserve and commit.
 */
function validateCost(cost: unknown, mode: ItemMode | undefined, lease: bigint | undefined): string | null {
  const m = mode ?? "consume";
  const min = mayCostNothing(m) ? 0 : 1;
  if (typeof cost !== "number" || !Number.isInteger(cost) || cost < min || cost > MAX_COST) {
    const of = min === 0 ? `a ${m}'s cost` : "cost";
    return `${of} must be an integer from ${min} to ${MAX_COST}, not ${String(cost)}`;
  }
  if (reserves(m) && lease === undefined) return `a ${m} item needs its reservation id (lease)`;
  return null;
}

/** A protocol version a check may need: see {@link checkVersion}. */
export type CheckVersion = 1 | 2 | 3 | 6;

/**
 * The version an item (or the attributes) needs: 6 to reserve or commit, 3 with a lease or a
 * release, 2 to peek or charge.
 */
function itemVersion(mode: ItemMode | undefined, lease: bigint | undefined): CheckVersion {
  const m = mode ?? "consume";
  if (reserves(m)) return RESERVE_VERSION;
  if (lease !== undefined || m === "release") return 3;
  return m === "consume" ? 1 : 2;
}

/**
 * The lowest protocol version that carries `check`: 6 when an item (or the attributes) reserves
 * or commits, 3 when one carries a lease or releases, 2 when one peeks or charges, else 1. An
 * agent cannot parse a check of a version above its own (a version-1 agent closes the connection;
 * a version-2 one refuses the mode byte; one of 3 to 5 refuses modes 4 and 5), so such a check is
 * sent only on a connection whose HelloOk said that version.
 */
export function checkVersion(check: Check): CheckVersion {
  if (check.form === "attributes") return itemVersion(check.attributes.mode, check.attributes.lease);
  let v: CheckVersion = 1;
  for (const i of check.items) {
    const iv = itemVersion(i.mode, i.lease);
    if (iv > v) v = iv;
  }
  return v;
}

/** Whether a check needs forms 2 or 3: some item does not consume, or carries a lease. */
function hasModes(check: Check): boolean {
  return checkVersion(check) > 1;
}

/** Why a check is refused by the protocol's limits, or null when it is valid. */
export function validateCheck(check: Check): string | null {
  if (check.form === "items") {
    const items = check.items;
    if (!Array.isArray(items) || items.length === 0 || items.length > MAX_ITEMS) {
      return `a check carries 1 to ${MAX_ITEMS} items, not ${Array.isArray(items) ? items.length : "none"}`;
    }
    // The duplicate check needs a set only when there is more than one item.
    const seen = items.length > 1 ? new Set<string>() : null;
    for (const item of items) {
      if (item === null || typeof item !== "object") return "an item must be an object";
      const why =
        validateText("key", item.key, MAX_KEY) ??
        validateRuleId(item.ruleId) ??
        validateMode(item.mode) ??
        validateLease(item.lease) ??
        validateCost(item.cost ?? 1, item.mode, item.lease);
      if (why) return why;
      if (seen) {
        const pair = `${item.ruleId}\u0000${item.key}`;
        if (seen.has(pair)) return `the item (${item.key}, ${item.ruleId}) appears twice`;
        seen.add(pair);
      }
    }
    return null;
  }
  const a = check.attributes ?? {};
  for (const [name, value] of attributeFields(a)) {
    if (value !== undefined && value !== null && value !== "") {
      const why = validateText(name, value, MAX_ATTRIBUTE);
      if (why) return why;
    }
  }
  return validateMode(a.mode) ?? validateLease(a.lease) ?? validateCost(a.cost ?? 1, a.mode, a.lease);
}

/** The attributes with their names, in wire order. */
export function attributeFields(a: Attributes): [string, string | null | undefined][] {
  return [
    ["endpoint", a.endpoint],
    ["tier", a.tier],
    ["user", a.user],
    ["apiKey", a.apiKey],
    ["ip", a.ip],
  ];
}

// ---------------------------------------------------------------------------------------------
// Trace context (version 5)

function allZero(b: Uint8Array): boolean {
  for (let i = 0; i < b.length; i++) if (b[i] !== 0) return false;
  return true;
}

/**
 * Why a trace context cannot be sent, or null when it can: a 16-byte trace id and an 8-byte span
 * id (`Uint8Array`s, `Buffer`s included), neither all zero, and flags an integer 0 to 255.
 */
export function validateTrace(trace: unknown): string | null {
  if (trace === null || typeof trace !== "object") return "a trace context must be an object";
  const t = trace as Partial<TraceContext>;
  if (!(t.traceId instanceof Uint8Array) || t.traceId.length !== TRACE_ID_LEN) {
    return `a trace id must be ${TRACE_ID_LEN} bytes (a Uint8Array)`;
  }
  if (!(t.spanId instanceof Uint8Array) || t.spanId.length !== SPAN_ID_LEN) {
    return `a span id must be ${SPAN_ID_LEN} bytes (a Uint8Array)`;
  }
  if (allZero(t.traceId) || allZero(t.spanId)) return "a trace context's ids may not be all zero";
  if (typeof t.flags !== "number" || !Number.isInteger(t.flags) || t.flags < 0 || t.flags > 0xff) {
    return `trace flags must be an integer from 0 to 255, not ${String(t.flags)}`;
  }
  return null;
}

/** `version-traceid-parentid-flags`, lower-case hex; a later version may add `-` and more fields. */
const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\s\S]*)?$/;

/**
 * A W3C `traceparent` header's value as a {@link TraceContext}, or undefined when it is not one:
 * `00-<32 hex>-<16 hex>-<2 hex>`, surrounding whitespace ignored. A later version's value is read
 * by its first four fields, as the W3C recommendation says; version `ff`, all-zero ids, upper-case
 * hex and anything else are refused (as `TraceContext::parse` in the Rust protocol crate).
 */
export function parseTraceparent(value: string): TraceContext | undefined {
  if (typeof value !== "string") return undefined;
  const m = TRACEPARENT.exec(value.trim());
  if (m === null) return undefined;
  const version = parseInt(m[1], 16);
  if (version === 0xff || (version === 0 && m[5] !== undefined)) return undefined;
  const traceId = Buffer.from(m[2], "hex");
  const spanId = Buffer.from(m[3], "hex");
  if (allZero(traceId) || allZero(spanId)) return undefined;
  return { traceId, spanId, flags: parseInt(m[4], 16) };
}

/** Lower-case hex of a `Uint8Array` (a `Buffer` or not). */
function hex(b: Uint8Array): string {
  return Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString("hex");
}

/** The `traceparent` value (version 00) naming `trace.spanId` as the parent. */
export function formatTraceparent(trace: TraceContext): string {
  return `00-${hex(trace.traceId)}-${hex(trace.spanId)}-${(trace.flags & 0xff).toString(16).padStart(2, "0")}`;
}

// ---------------------------------------------------------------------------------------------
// Encoding

/** Writes a frame into one growing buffer, the 4-byte length prefix reserved at the front. */
class Writer {
  private buf = Buffer.allocUnsafe(256);
  len = LEN_PREFIX;
  private ensure(n: number): void {
    if (this.len + n <= this.buf.length) return;
    let size = this.buf.length * 2;
    while (size < this.len + n) size *= 2;
    const grown = Buffer.allocUnsafe(size);
    this.buf.copy(grown, 0, 0, this.len);
    this.buf = grown;
  }
  bytes(b: Uint8Array): void {
    this.ensure(b.length);
    this.buf.set(b, this.len);
    this.len += b.length;
  }
  u8(n: number): void {
    this.ensure(1);
    this.buf[this.len++] = n & 0xff;
  }
  u16(n: number): void {
    this.ensure(2);
    this.buf.writeUInt16BE(n & 0xffff, this.len);
    this.len += 2;
  }
  u32(n: number): void {
    this.ensure(4);
    this.buf.writeUInt32BE(n >>> 0, this.len);
    this.len += 4;
  }
  u64(n: number): void {
    this.ensure(8);
    this.buf.writeBigUInt64BE(toU64(n), this.len);
    this.len += 8;
  }
  /** A mode byte, bit 7 set and the lease (or reservation id) after it when there is one (version 3). */
  mode(mode: ItemMode | undefined, lease: bigint | undefined): void {
    const b = MODES.indexOf(mode ?? "consume");
    if (lease === undefined) {
      this.u8(b);
      return;
    }
    this.u8(b | MODE_LEASE);
    this.ensure(8);
    this.buf.writeBigUInt64BE(lease, this.len);
    this.len += 8;
  }
  private str(s: string, lenBytes: 1 | 2): void {
    const max = lenBytes === 1 ? 0xff : 0xffff;
    const n = Buffer.byteLength(s, "utf8");
    if (n > max) {
      const b = truncateUtf8(Buffer.from(s, "utf8"), max);
      if (lenBytes === 1) this.u8(b.length);
      else this.u16(b.length);
      this.bytes(b);
      return;
    }
    if (lenBytes === 1) this.u8(n);
    else this.u16(n);
    this.ensure(n);
    this.buf.write(s, this.len, n, "utf8");
    this.len += n;
  }
  str8(s: string): void {
    this.str(s, 1);
  }
  str16(s: string): void {
    this.str(s, 2);
  }
  /** The frame, its length prefix filled in. */
  done(): Buffer {
    this.buf.writeUInt32BE(this.len - LEN_PREFIX, 0);
    return this.buf.subarray(0, this.len);
  }
}

function toU64(n: number): bigint {
  if (!Number.isFinite(n) || n <= 0) return 0n;
  const b = BigInt(Math.floor(n));
  return b > 0xffff_ffff_ffff_ffffn ? 0xffff_ffff_ffff_ffffn : b;
}

/** Cuts a UTF-8 buffer to at most `max` bytes on a character boundary. */
function truncateUtf8(b: Buffer, max: number): Buffer {
  if (b.length <= max) return b;
  let end = max;
  // Step back over continuation bytes (10xxxxxx) so no character is cut.
  while (end > 0 && (b[end] & 0xc0) === 0x80) end--;
  return b.subarray(0, end);
}

function kindOf(body: Body): number {
  switch (body.kind) {
    case "hello":
      return Kind.Hello;
    case "helloOk":
      return Kind.HelloOk;
    case "check":
      return Kind.Check;
    case "decision":
      return Kind.Decision;
    case "error":
      return Kind.Error;
    case "ping":
      return Kind.Ping;
    case "pong":
      return Kind.Pong;
    case "failModes":
      return Kind.FailModes;
    case "failModeList":
      return Kind.FailModeList;
  }
}

/** Writes a verdict; its over-quota flag only when `overQuota` says the peer reads it (version 6). */
function putVerdict(w: Writer, v: Verdict, overQuota: boolean): void {
  w.u8(
    (v.allowed ? FLAG_ALLOWED : 0) |
      (v.logOnly ? FLAG_LOG_ONLY : 0) |
      (v.holdsLease ? FLAG_HOLDS_LEASE : 0) |
      (v.overQuota && overQuota ? FLAG_OVER_QUOTA : 0),
  );
  w.u8(Math.max(0, SOURCES.indexOf(v.source)));
  w.u64(v.limit);
  w.u64(v.remaining);
  w.u64(v.resetAtMs);
  w.u64(v.retryAfterMs);
}

/**
 * Encodes a frame, each kind in the newest form a peer of `peerVersion` (default: this SDK's
 * {@link VERSION}) reads. A Decision whose items carry a window (`windowMs` above 0) is a
 * version-4 frame for a peer of version 4 or later, and for an older one the same without the
 * windows; one with no window to carry is version 1's form, which every peer reads. A Check's
 * trace context is written (form 4, then the check's own form) for a peer of version 5 or later,
 * and left out for an older one, which could not parse it. A verdict's over-quota flag is written
 * for a peer of version 6 or later; an older one reads the allowed verdict it is. Throws {@link InvalidCheck} if a Check
 * breaks a protocol limit, its trace context is not one ({@link validateTrace}), or the frame would
 * exceed 64 KiB.
 */
export function encodeFrame(frame: Frame, peerVersion: number = VERSION): Buffer {
  const body = frame.body;
  if (body.kind === "check") {
    const why = validateCheck(body.check) ?? (body.trace === undefined ? null : validateTrace(body.trace));
    if (why) throw new InvalidCheck(why);
  }
  if (body.kind === "decision" && body.items.length > MAX_ITEMS) {
    throw new InvalidCheck(`a decision carries at most ${MAX_ITEMS} items, not ${body.items.length}`);
  }
  const w = new Writer();
  // Hello is understood by every version; its own version byte is min(max_version, ours). Any other
  // frame carries the version that introduced its kind, so a version-1 peer reads all it knows;
  // but a Decision with windows to carry, to a peer that reads them, is version 4's.
  const windows =
    body.kind === "decision" && peerVersion >= WINDOWS && body.items.some((i) => (i.windowMs ?? 0) > 0);
  w.u8(
    body.kind === "hello"
      ? Math.min(body.maxVersion, VERSION)
      : body.kind === "failModes" || body.kind === "failModeList"
        ? 2
        : windows
          ? WINDOWS
          : 1,
  );
  w.u8(kindOf(body));
  w.u32(frame.requestId);
  switch (body.kind) {
    case "hello":
      w.u8(body.minVersion);
      w.u8(body.maxVersion);
      break;
    case "helloOk":
      w.u8(body.version);
      break;
    case "check": {
      if (body.trace !== undefined && peerVersion >= TRACE_VERSION) {
        w.u8(FORM_TRACED);
        w.bytes(body.trace.traceId);
        w.bytes(body.trace.spanId);
        w.u8(body.trace.flags);
      }
      // Every item consuming without a lease: version 1's forms 0 and 1, which every agent reads.
      const modes = hasModes(body.check);
      if (body.check.form === "items") {
        w.u8(modes ? FORM_ITEMS_MODES : FORM_ITEMS);
        w.u8(body.check.items.length);
        for (const item of body.check.items) {
          w.str16(item.key);
          w.str8(item.ruleId);
          w.u32(item.cost ?? 1);
          if (modes) w.mode(item.mode, item.lease);
        }
      } else {
        const a = body.check.attributes;
        w.u8(modes ? FORM_ATTRIBUTES_MODE : FORM_ATTRIBUTES);
        for (const [, value] of attributeFields(a)) w.str16(value ?? "");
        w.u32(a.cost ?? 1);
        if (modes) w.mode(a.mode, a.lease);
      }
      break;
    }
    case "decision": {
      const overQuota = peerVersion >= OVER_QUOTA;
      putVerdict(w, body.combined, overQuota);
      w.u8(body.items.length);
      for (const item of body.items) {
        w.str8(item.ruleId);
        putVerdict(w, item.verdict, overQuota);
        if (windows) w.u64(item.windowMs ?? 0);
      }
      break;
    }
    case "error": {
      w.u16(body.code);
      const msg = truncateUtf8(Buffer.from(body.message, "utf8"), MAX_MESSAGE);
      w.u16(msg.length);
      w.bytes(msg);
      break;
    }
    case "ping":
    case "pong":
    case "failModes":
      break;
    case "failModeList": {
      const l = body.list;
      w.u64(l.rulesVersion);
      w.u8(l.truncated ? LIST_TRUNCATED : 0);
      const n = Math.min(l.rules.length, 0xffff);
      w.u16(n);
      for (const r of l.rules.slice(0, n)) {
        w.str8(r.ruleId);
        w.u8(Math.max(0, DIMENSIONS.indexOf(r.dimension)));
        w.str16(r.endpoint);
        w.str16(r.tier);
        w.u64(r.limit);
      }
      break;
    }
  }
  if (w.len > MAX_FRAME) {
    throw new InvalidCheck(`frame of ${w.len} bytes exceeds the ${MAX_FRAME}-byte limit`);
  }
  return w.done();
}

// ---------------------------------------------------------------------------------------------
// Decoding

class Malformed extends Error {}

const utf8 = new TextDecoder("utf-8", { fatal: true });

class Reader {
  pos: number;
  /**
   * Text that was not UTF-8, or an item mode this peer does not know: refused once the whole body
   * has parsed, like the Rust decoder (a body that does not parse is malformed, which closes the
   * connection; a refused value only refuses the check).
   */
  badText: string | null = null;
  constructor(
    private readonly buf: Buffer,
    start: number,
    private readonly end: number,
  ) {
    this.pos = start;
  }
  left(): number {
    return this.end - this.pos;
  }
  take(n: number): number {
    if (this.left() < n) throw new Malformed(`body ends early: wanted ${n} more bytes, ${this.left()} left`);
    const at = this.pos;
    this.pos += n;
    return at;
  }
  u8(): number {
    return this.buf[this.take(1)];
  }
  u16(): number {
    return this.buf.readUInt16BE(this.take(2));
  }
  u32(): number {
    return this.buf.readUInt32BE(this.take(4));
  }
  u64(): number {
    const at = this.take(8);
    // hi * 2^32 + lo: exact up to 2^53, the nearest double above.
    return this.buf.readUInt32BE(at) * 0x1_0000_0000 + this.buf.readUInt32BE(at + 4);
  }
  string(n: number): string {
    const at = this.take(n);
    // ASCII (rule ids always, keys mostly) needs no UTF-8 validation.
    let ascii = true;
    for (let i = at; i < at + n; i++) {
      if (this.buf[i] >= 0x80) {
        ascii = false;
        break;
      }
    }
    if (ascii) return this.buf.toString("latin1", at, at + n);
    try {
      return utf8.decode(this.buf.subarray(at, at + n));
    } catch {
      this.badText ??= "text is not valid UTF-8";
      return "";
    }
  }
  str8(): string {
    return this.string(this.u8());
  }
  /**
   * An item mode and the lease (a reserve's or commit's reservation id) after it when bit 7 is set
   * (version 3); a mode this peer does not know refuses the check (error 5), as bad text does.
   */
  mode(): { mode: ItemMode; lease?: bigint } {
    const b = this.u8();
    let mode = MODES[b & ~MODE_LEASE];
    if (mode === undefined) {
      this.badText ??= `unknown item mode ${b}`;
      mode = "consume";
    }
    if ((b & MODE_LEASE) === 0) return { mode };
    const at = this.take(8);
    return { mode, lease: this.buf.readBigUInt64BE(at) };
  }
  str16(): string {
    return this.string(this.u16());
  }
  /** Form 4's trace context (version 5); undefined for one whose ids are all zero, which is dropped. */
  trace(): TraceContext | undefined {
    if (this.left() < TRACE_LEN) throw new Malformed("a traced check ends inside its trace context");
    const at = this.take(TRACE_LEN);
    // Copied: the frame's bytes are the connection's read buffer.
    const traceId = Buffer.from(this.buf.subarray(at, at + TRACE_ID_LEN));
    const spanId = Buffer.from(this.buf.subarray(at + TRACE_ID_LEN, at + TRACE_ID_LEN + SPAN_ID_LEN));
    const flags = this.buf[at + TRACE_ID_LEN + SPAN_ID_LEN];
    // An invalid context (all-zero ids) is dropped, as a bad traceparent header is.
    return allZero(traceId) || allZero(spanId) ? undefined : { traceId, spanId, flags };
  }
  verdict(): Verdict {
    const flags = this.u8();
    if (flags & ~KNOWN_FLAGS) {
      throw new Malformed(`unknown verdict flags 0x${flags.toString(16).padStart(2, "0")}`);
    }
    const s = this.u8();
    const source = SOURCES[s];
    if (source === undefined) throw new Malformed(`unknown source ${s}`);
    return {
      allowed: (flags & FLAG_ALLOWED) !== 0,
      logOnly: (flags & FLAG_LOG_ONLY) !== 0,
      holdsLease: (flags & FLAG_HOLDS_LEASE) !== 0,
      overQuota: (flags & FLAG_OVER_QUOTA) !== 0,
      source,
      limit: this.u64(),
      remaining: this.u64(),
      resetAtMs: this.u64(),
      retryAfterMs: this.u64(),
    };
  }
}

/** Decodes the body of a frame of `kind` whose version byte is `version` (a Decision's layout depends on it). */
function decodeBody(kind: number, version: number, r: Reader): Body {
  switch (kind) {
    case Kind.Hello:
      return { kind: "hello", minVersion: r.u8(), maxVersion: r.u8() };
    case Kind.HelloOk:
      return { kind: "helloOk", version: r.u8() };
    case Kind.Check: {
      let form = r.u8();
      // Version 5: form 4 carries a trace context before the check's own form (never form 4 again).
      let trace: TraceContext | undefined;
      if (form === FORM_TRACED) {
        trace = r.trace();
        form = r.u8();
      }
      const body = (check: Check): Body => (trace === undefined ? { kind: "check", check } : { kind: "check", check, trace });
      if (form === FORM_ITEMS || form === FORM_ITEMS_MODES) {
        const n = r.u8();
        const items: Item[] = [];
        for (let i = 0; i < n; i++) {
          const item: Item = { key: r.str16(), ruleId: r.str8(), cost: r.u32() };
          if (form === FORM_ITEMS_MODES) {
            const { mode, lease } = r.mode();
            item.mode = mode;
            if (lease !== undefined) item.lease = lease;
          }
          items.push(item);
        }
        return body({ form: "items", items });
      }
      if (form === FORM_ATTRIBUTES || form === FORM_ATTRIBUTES_MODE) {
        const v = () => {
          const s = r.str16();
          return s === "" ? undefined : s;
        };
        const attributes: Attributes = { endpoint: v(), tier: v(), user: v(), apiKey: v(), ip: v() };
        attributes.cost = r.u32();
        if (form === FORM_ATTRIBUTES_MODE) {
          const { mode, lease } = r.mode();
          attributes.mode = mode;
          if (lease !== undefined) attributes.lease = lease;
        }
        return body({ form: "attributes", attributes });
      }
      throw new Malformed(`unknown check form ${form}`);
    }
    case Kind.Decision: {
      const combined = r.verdict();
      const n = r.u8();
      if (n > MAX_ITEMS) throw new Malformed(`a decision carries at most ${MAX_ITEMS} items, not ${n}`);
      const items: ItemDecision[] = [];
      // A version-4 frame carries each item's window after its verdict; an older one has none (0).
      const windows = version >= WINDOWS;
      for (let i = 0; i < n; i++) {
        const ruleId = r.str8();
        const verdict = r.verdict();
        items.push({ ruleId, verdict, windowMs: windows ? r.u64() : 0 });
      }
      return { kind: "decision", combined, items };
    }
    case Kind.Error:
      return { kind: "error", code: r.u16(), message: r.str16() };
    case Kind.Ping:
      return { kind: "ping" };
    case Kind.Pong:
      return { kind: "pong" };
    case Kind.FailModes:
      return { kind: "failModes" };
    case Kind.FailModeList: {
      const rulesVersion = r.u64();
      const flags = r.u8();
      if (flags & ~LIST_TRUNCATED) {
        throw new Malformed(`unknown list flags 0x${flags.toString(16).padStart(2, "0")}`);
      }
      const n = r.u16();
      const rules: ClosedRule[] = [];
      for (let i = 0; i < n; i++) {
        const ruleId = r.str8();
        const d = r.u8();
        const dimension = DIMENSIONS[d];
        if (dimension === undefined) throw new Malformed(`unknown dimension ${d}`);
        rules.push({ ruleId, dimension, endpoint: r.str16(), tier: r.str16(), limit: r.u64() });
      }
      return { kind: "failModeList", list: { rulesVersion, truncated: (flags & LIST_TRUNCATED) !== 0, rules } };
    }
    default:
      throw new Malformed(`unknown frame kind 0x${kind.toString(16).padStart(2, "0")}`);
  }
}

/**
 * Decodes one frame from the front of `buf`. Never throws: the result says whether a frame was
 * read (and how many bytes it took), more bytes are needed, the frame is refused but skippable, or
 * the stream is broken.
 */
export function decodeFrame(buf: Buffer): DecodeResult {
  try {
    return decodeUnsafe(buf);
  } catch (e) {
    // Unreachable by construction; a decoder bug must still not crash the caller.
    return { ok: false, type: "fatal", code: ErrorCode.MalformedFrame, requestId: null, reason: String(e) };
  }
}

function decodeUnsafe(buf: Buffer): DecodeResult {
  if (buf.length < LEN_PREFIX) return { ok: false, type: "incomplete" };
  const len = buf.readUInt32BE(0);
  const frameLen = LEN_PREFIX + len;
  if (frameLen > MAX_FRAME) {
    return {
      ok: false,
      type: "fatal",
      code: ErrorCode.FrameTooLarge,
      requestId: buf.length >= LEN_PREFIX + HEADER ? buf.readUInt32BE(6) : null,
      reason: `frame of ${frameLen} bytes exceeds the ${MAX_FRAME}-byte limit`,
    };
  }
  if (len < HEADER) {
    return {
      ok: false,
      type: "fatal",
      code: ErrorCode.MalformedFrame,
      requestId: null,
      reason: `length ${len} is shorter than the ${HEADER}-byte header`,
    };
  }
  if (buf.length < frameLen) return { ok: false, type: "incomplete" };
  const version = buf[4];
  const kind = buf[5];
  const requestId = buf.readUInt32BE(6);
  if ((version < MIN_VERSION || version > VERSION) && kind !== Kind.Hello) {
    return {
      ok: false,
      type: "rejected",
      code: ErrorCode.UnsupportedVersion,
      requestId,
      reason: `frame version ${version}; this peer speaks versions ${MIN_VERSION} to ${VERSION}`,
      frameLen,
    };
  }
  const r = new Reader(buf, LEN_PREFIX + HEADER, frameLen);
  let body: Body;
  try {
    body = decodeBody(kind, version, r);
  } catch (e) {
    if (e instanceof Malformed) {
      return { ok: false, type: "fatal", code: ErrorCode.MalformedFrame, requestId, reason: e.message };
    }
    throw e;
  }
  if (r.left() !== 0) {
    return {
      ok: false,
      type: "fatal",
      code: ErrorCode.MalformedFrame,
      requestId,
      reason: `${r.left()} unexpected bytes after the body`,
    };
  }
  if (r.badText !== null) {
    return { ok: false, type: "rejected", code: ErrorCode.InvalidItem, requestId, reason: r.badText, frameLen };
  }
  if (body.kind === "check") {
    const why = validateCheck(body.check);
    if (why) return { ok: false, type: "rejected", code: ErrorCode.InvalidItem, requestId, reason: why, frameLen };
  }
  return { ok: true, frame: { requestId, body }, used: frameLen };
}
