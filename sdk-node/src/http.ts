/**
 * What the Express and Fastify middleware share, mirroring the Rust tower Layer
 * (`sdk/src/middleware/`): the request's attributes (endpoint, tier, user, API key, client IP),
 * values made wire-safe, the client IP through trusted proxies only, the request's `traceparent`
 * header forwarded with its checks, the headers and 429 body of a decision, and what a request let
 * through past a quota-mode rule carries to its handler (`req.floodgate`).
 */

import * as net from "node:net";

import { newLeaseId, type CallOptions, type Client, type FailPolicy } from "./client";
import { fromAgent, type Decision } from "./decision";
import { MAX_ATTRIBUTE, validateRuleId, type Attributes, type ItemDecision } from "./protocol";

// ---------------------------------------------------------------------------------------------
// Wire-safe values

const FNV_OFFSET = 0xcbf29ce484222325n;
const FNV_PRIME = 0x100000001b3n;
const U64 = 0xffffffffffffffffn;

/** 64-bit FNV-1a over the UTF-8 bytes of `value`, as 16 lowercase hex digits. */
export function fnv1a64Hex(value: string): string {
  let h = FNV_OFFSET;
  for (const b of Buffer.from(value, "utf8")) h = ((h ^ BigInt(b)) * FNV_PRIME) & U64;
  return h.toString(16).padStart(16, "0");
}

// eslint-disable-next-line no-control-regex
const REFUSED = /[{}\u0000-\u001f\u007f-\u009f]/;

/**
 * A value the agent accepts: as it is when the wire allows it, else `h:` and the 64-bit FNV-1a
 * hash of its UTF-8 bytes (the same value always maps to the same key, so a client sending an odd
 * value is still limited, under a key of its own, instead of making the check invalid). The same
 * function as the Rust Layer's `wire_safe`.
 */
export function wireSafe(value: string): string {
  if (Buffer.byteLength(value, "utf8") <= MAX_ATTRIBUTE && !REFUSED.test(value)) return value;
  return `h:${fnv1a64Hex(value)}`;
}

// ---------------------------------------------------------------------------------------------
// Addresses

/** An IP address as a number: 32 bits (v4) or 128 bits (v6). */
interface Ip {
  v: 4 | 6;
  n: bigint;
}

function parseV4(s: string): bigint | null {
  if (net.isIPv4(s) === false) return null;
  let n = 0n;
  for (const p of s.split(".")) n = (n << 8n) | BigInt(Number(p));
  return n;
}

/** Parses an IP address as Rust's `IpAddr` does: no zone ids, no brackets, no ports. */
export function parseIp(text: string): Ip | null {
  const s = text.trim();
  if (net.isIPv4(s)) {
    const n = parseV4(s);
    return n === null ? null : { v: 4, n };
  }
  if (!net.isIPv6(s) || s.includes("%")) return null;
  let head = s;
  let tail: bigint[] = [];
  // An embedded IPv4 address at the end counts as two groups.
  const lastColon = s.lastIndexOf(":");
  if (s.slice(lastColon + 1).includes(".")) {
    const v4 = parseV4(s.slice(lastColon + 1));
    if (v4 === null) return null;
    tail = [v4 >> 16n, v4 & 0xffffn];
    head = s.slice(0, lastColon + 1);
    // Keep a "::" right before the IPv4 part for the split below; drop a single ":".
    if (!head.endsWith("::")) head = head.slice(0, -1);
  }
  const [left, right] = head.includes("::") ? head.split("::") : [head, null];
  const groups = (part: string) => (part === "" ? [] : part.split(":").map((g) => BigInt(parseInt(g, 16))));
  const l = groups(left);
  const r = right === null ? [] : groups(right);
  const fill = 8 - l.length - r.length - tail.length;
  if (fill < 0 || (right === null && fill !== 0)) return null;
  const all = [...l, ...Array<bigint>(right === null ? 0 : fill).fill(0n), ...r, ...tail];
  if (all.length !== 8) return null;
  let n = 0n;
  for (const g of all) n = (n << 16n) | g;
  return { v: 6, n };
}

/** An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) as its IPv4 address; any other unchanged. */
function unmap(ip: Ip): Ip {
  if (ip.v === 6 && ip.n >> 32n === 0xffffn) return { v: 4, n: ip.n & 0xffffffffn };
  return ip;
}

/** The address as text: dotted quad, or RFC 5952 (lower case, the longest zero run as `::`). */
export function formatIp(ip: Ip): string {
  if (ip.v === 4) {
    return [24n, 16n, 8n, 0n].map((s) => ((ip.n >> s) & 0xffn).toString()).join(".");
  }
  if (ip.n >> 32n === 0xffffn) return `::ffff:${formatIp({ v: 4, n: ip.n & 0xffffffffn })}`;
  const g: number[] = [];
  for (let i = 7; i >= 0; i--) g.push(Number((ip.n >> BigInt(i * 16)) & 0xffffn));
  let best = -1;
  let bestLen = 1; // a single zero group is not compressed
  for (let i = 0; i < 8; ) {
    if (g[i] !== 0) {
      i++;
      continue;
    }
    let j = i;
    while (j < 8 && g[j] === 0) j++;
    if (j - i > bestLen) {
      best = i;
      bestLen = j - i;
    }
    i = j;
  }
  const hex = (a: number[]) => a.map((x) => x.toString(16)).join(":");
  if (best < 0) return hex(g);
  return `${hex(g.slice(0, best))}::${hex(g.slice(best + bestLen))}`;
}

/** An address block, `10.0.0.0/8`, `2001:db8::/32` or a single address. */
export class Cidr {
  private constructor(
    private readonly addr: Ip,
    readonly prefix: number,
  ) {}

  /** Parses `addr/prefix` or `addr`; throws on anything else. An IPv4-mapped block is its IPv4 block. */
  static parse(text: string): Cidr {
    const slash = text.indexOf("/");
    const a = slash < 0 ? text : text.slice(0, slash);
    const p = slash < 0 ? "" : text.slice(slash + 1).trim();
    const addr = parseIp(a);
    if (!addr) throw new Error(`${JSON.stringify(text)} is not an IP address or CIDR block`);
    const max = addr.v === 4 ? 32 : 128;
    let prefix = max;
    if (p !== "") {
      if (!/^\d{1,3}$/.test(p) || Number(p) > max) {
        throw new Error(`${JSON.stringify(text)}: the prefix must be 0..=${max}`);
      }
      prefix = Number(p);
    }
    if (addr.v === 6 && addr.n >> 32n === 0xffffn && prefix >= 96) {
      return new Cidr({ v: 4, n: addr.n & 0xffffffffn }, prefix - 96);
    }
    return new Cidr(addr, prefix);
  }

  /** Whether `ip` (text or parsed) is in the block; an IPv4-mapped address counts as its IPv4 address. */
  contains(ip: string | Ip): boolean {
    const parsed = typeof ip === "string" ? parseIp(ip) : ip;
    if (!parsed) return false;
    const x = unmap(parsed);
    if (x.v !== this.addr.v) return false;
    const bits = BigInt(x.v === 4 ? 32 : 128);
    const host = bits - BigInt(this.prefix);
    return x.n >> host === this.addr.n >> host;
  }
}

/**
 * The client's address: the peer, unless the peer is a trusted proxy; then `X-Forwarded-For` read
 * from the right, skipping trusted proxies, up to the first address they did not vouch for (a
 * client can write anything at the left of the header; only what trusted proxies appended counts).
 * Garbage where an address should be stops the walk at the last address vouched for. IPv4-mapped
 * addresses are given as IPv4 (a dual-stack listener shows IPv4 peers as `::ffff:a.b.c.d`), IPv6 in
 * RFC 5952 form, so one client is one key whatever the listener.
 */
export function clientIp(
  peer: string | undefined | null,
  forwardedFor: string | string[] | undefined,
  trusted: readonly Cidr[],
): string | undefined {
  const p = peer ? parseIp(peer) : null;
  if (!p) return undefined;
  let client = unmap(p);
  const isTrusted = (ip: Ip) => trusted.some((c) => c.contains(ip));
  if (trusted.length === 0 || !isTrusted(client)) return formatIp(client);
  const lines = forwardedFor === undefined ? [] : Array.isArray(forwardedFor) ? forwardedFor : [forwardedFor];
  const hops = lines.flatMap((l) => l.split(",")).map((h) => h.trim());
  for (let i = hops.length - 1; i >= 0; i--) {
    const ip = parseIp(hops[i]);
    if (!ip) break;
    client = unmap(ip);
    if (!isTrusted(client)) break;
  }
  return formatIp(client);
}

// ---------------------------------------------------------------------------------------------
// Headers

/** A u64 figure as header text (no exponent for figures past 2^53). */
function int(n: number): string {
  return Number.isSafeInteger(n) ? String(n) : BigInt(Math.floor(Math.max(0, n))).toString();
}

/** The enforced item whose figures the decision carries, if any (none: no headers). */
function bindingItem(d: Decision): ItemDecision | undefined {
  if (d.limit === 0) return undefined;
  return d.items.find(
    (i) =>
      !i.verdict.logOnly &&
      i.verdict.limit === d.limit &&
      i.verdict.remaining === d.remaining &&
      i.verdict.resetAtMs === d.resetAtMs,
  );
}

/** The enforced rule whose figures the decision carries, if any (none: no headers). */
export function bindingRule(d: Decision): string | undefined {
  return bindingItem(d)?.ruleId;
}

/**
 * The headers for a decision: `X-RateLimit-Limit`, `-Remaining` and `-Reset` (epoch seconds, rounded
 * up) of the binding enforced rule, and with `ietf` the draft's `RateLimit-Policy` and `RateLimit`.
 * `RateLimit-Policy` is `"rule";q=<limit>;w=<window>`, the binding rule's window in whole seconds
 * rounded up (a 500 ms window is `w=1`), without `;w=` when the rule has none (a concurrency rule,
 * an agent of protocol version 3 or older). None when no enforced rule applied (no rule matched,
 * only log-mode rules, or the SDK decided alone).
 */
export function rateLimitHeaders(d: Decision, ietf = false, nowMs = Date.now()): [string, string][] {
  const binding = bindingItem(d);
  if (binding === undefined) return [];
  const rule = binding.ruleId;
  const h: [string, string][] = [
    ["X-RateLimit-Limit", int(d.limit)],
    ["X-RateLimit-Remaining", int(d.remaining)],
    ["X-RateLimit-Reset", int(Math.ceil(d.resetAtMs / 1000))],
  ];
  // A rule id goes into the IETF headers quoted: one no agent sends (quotes, CR/LF) is left out.
  if (ietf && validateRuleId(rule) === null) {
    const t = Math.ceil(Math.max(0, d.resetAtMs - nowMs) / 1000);
    const windowMs = binding.windowMs ?? 0;
    const w = windowMs > 0 ? `;w=${int(Math.ceil(windowMs / 1000))}` : "";
    h.push(["RateLimit-Policy", `"${rule}";q=${int(d.limit)}${w}`]);
    h.push(["RateLimit", `"${rule}";r=${int(d.remaining)};t=${int(t)}`]);
  }
  return h;
}

/**
 * The response header naming the rules a request was let through past in quota mode
 * (`overLimit = "flag"`), comma-separated: the Rust Layer's `x-ratelimit-over-quota`.
 */
export const OVER_QUOTA_HEADER = "X-RateLimit-Over-Quota";

/**
 * What the middleware leaves for the handlers on each request it lets through: Express's
 * `req.floodgate`, Fastify's `request.floodgate`. The Rust Layer puts the same in the request's
 * extensions (`OverQuota`), the Python middleware in `scope["floodgate.over_quota"]`.
 */
export interface FloodgateRequestState {
  /**
   * The ids of the rules whose limit the request is past in quota mode (`overLimit = "flag"`):
   * let through all the same, for the handler to route elsewhere (a cheaper model, a fallback
   * backend). Empty when none, and whenever the agent did not answer. Where two Floodgate
   * middlewares run on one request, the rules of both.
   */
  overQuota: string[];
}

/**
 * @internal Leaves the request's state on `target` (Express's `req`, Fastify's `request`), adding
 * to what an earlier Floodgate middleware on the same request left there.
 */
export function leaveState(target: { floodgate?: FloodgateRequestState | null }, overQuota: readonly string[]): void {
  const before = target.floodgate?.overQuota;
  const rules = Array.isArray(before) ? [...new Set([...before, ...overQuota])] : [...overQuota];
  target.floodgate = { ...(target.floodgate ?? {}), overQuota: rules };
}

/** `Retry-After` in whole seconds: rounded up, never 0. */
export function retryAfterSeconds(d: Decision): number {
  return Math.max(1, Math.ceil((d.retryAfterMs ?? 1000) / 1000));
}

/** The 429 body. */
export function rejectionBody(secs: number): string {
  return `{"error":"rate_limited","retryAfter":${secs}}`;
}

/**
 * A route as the agent may see it: braces are refused on the wire (Redis reads them as hash tags),
 * so `{id}` becomes `:id`, `{*rest}` becomes `*rest`, and other braces (Express 5's optional
 * groups, `/a{/:b}`) are dropped. Rules and `costs` name routes either way.
 */
/** A request URL's path: everything before its query or fragment. */
export function stripQuery(url: string): string {
  const q = url.search(/[?#]/);
  return q < 0 ? url : url.slice(0, q);
}

export function routeName(route: string): string {
  return route
    .split("/")
    .map((seg) => {
      const m = /^\{(.*)\}$/.exec(seg);
      if (m && !m[1].includes("{") && !m[1].includes("}")) return m[1].startsWith("*") ? m[1] : `:${m[1]}`;
      return seg;
    })
    .join("/")
    .replace(/[{}]/g, "");
}

// ---------------------------------------------------------------------------------------------
// The shared part of both middlewares

/** The parts of a request the extractors read (Node's `IncomingMessage` has them all). */
export interface RequestView {
  /** Header names in lower case. */
  headers: Record<string, string | string[] | undefined>;
  /** Alternating names and values as received (Node's `rawHeaders`), to read a header's first line. */
  rawHeaders?: string[];
  /** The peer address. */
  remoteAddress?: string;
  /** The matched route when the framework knows it, else undefined. */
  route?: string;
  /**
   * The path without the query; Express's as its router matches it (lower-cased unless `case
   * sensitive routing`, one trailing slash dropped unless `strict routing`: `expressView`).
   */
  path: string;
  /** The framework's own request object (Express `req`, Fastify `request`). */
  native: unknown;
}

/** Reads one attribute off a request; undefined or `""` means absent. */
export type Extractor = (req: RequestView) => string | undefined | null;

/**
 * A `chargeWith` function: the cost of a request, read once its response is finished (or its
 * connection closed), from the framework's own objects (Express `(req, res)`, Fastify
 * `(request, reply)`). An integer 1 to 2³²−1 is charged; 0, undefined or null charge nothing.
 */
// A method's parameters are compared both ways: a function written for express.Request or
// FastifyRequest is accepted where the structural request types are expected.
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type ChargeFunction<Req = any, Res = any> = {
  bivarianceHack(request: Req, response: Res): number | undefined | null;
}["bivarianceHack"];

/** What both middlewares take (`Req` and `Res`: the framework's request and response, for `chargeWith`). */
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export interface RateLimitOptions<Req = any, Res = any> {
  /** The endpoint (default: the matched route, else the path). */
  endpoint?: Extractor;
  /** The tier, from what your auth layer knows (none by default). */
  tier?: Extractor;
  /** The user id (none by default). */
  user?: Extractor;
  /** The API key or an id of it (none by default). */
  apiKey?: Extractor;
  /**
   * The client IP (default: the socket's peer, or X-Forwarded-For through `trustProxies`; never
   * `req.ip`, which Express's `trust proxy` and Fastify's `trustProxy` take from X-Forwarded-For).
   */
  ip?: Extractor;
  /**
   * The tier from a header an authenticating hop in front of this service sets (and strips from what
   * clients send). A header a client writes itself would let it choose its tier.
   */
  tierHeader?: string;
  /** The user id from a header an authenticating hop sets (see `tierHeader`). */
  userHeader?: string;
  /** The API key from a header (a client can spend another key's quota only if it knows that key). */
  apiKeyHeader?: string;
  /** Proxies whose X-Forwarded-For entries are believed (CIDR blocks or addresses); none by default. */
  trustProxies?: readonly string[];
  /** What a request to an endpoint (as the endpoint extractor gives it) costs; 1 elsewhere. */
  costs?: Readonly<Record<string, number>>;
  /**
   * Endpoints (keyed as `costs`) whose cost is known only after the response (LLM tokens, bytes),
   * and the response header the handler reports it in: `{ "/v1/chat": "x-llm-tokens" }`. A request
   * there is checked with a peek of cost 0 (denied while a matching rate rule is past its limit or
   * a matching concurrency rule is full, of which it then holds one unit until the response ends);
   * once its response is finished, the header's value (an integer 1 to 2³²−1) is charged to the
   * same rules. An endpoint may not be in both `costs` and `chargeHeaders` (throws at start).
   */
  chargeHeaders?: Readonly<Record<string, string>>;
  /**
   * Endpoints (keyed as `costs`) whose cost a function gives once the response is finished, from
   * the framework's request and response: `{ "/v1/chat": (req, res) => res.locals.tokens }`. The
   * same request-phase peek of cost 0 as `chargeHeaders`, and the same charge of what the function
   * returns (an integer 1 to 2³²−1; 0, undefined or null: nothing). An endpoint may be in only one
   * of `costs`, `chargeHeaders` and `chargeWith` (throws at start).
   */
  chargeWith?: Readonly<Record<string, ChargeFunction<Req, Res>>>;
  /**
   * What a request to an endpoint (keyed as `costs`) answers when the agent cannot: `open` or
   * `closed`, deciding alone, over the agent's fail-closed rules and the client's fail policy.
   * Elsewhere: denied if a fail-closed rule of the agent's applies, else the client's fail policy.
   */
  failFor?: Readonly<Record<string, FailPolicy>>;
  /** Also set the IETF draft's `RateLimit-Policy` and `RateLimit` headers (default false). */
  ietfHeaders?: boolean;
  /**
   * Where the rare warnings go (default `console`). Its `debug`, when it has one, gets what is
   * logged at debug level (the default logs nothing at debug level): a precautionary release of a
   * lease whose check the agent did not answer that fails too.
   */
  logger?: { warn(message: string): void; debug?(message: string): void } | null;
}

/** What to do with a request. */
export interface LimitOutcome {
  /** Headers to set on the response, whatever it is. */
  headers: [string, string][];
  /** On a rejection: the Retry-After seconds and the body of the 429. */
  reject?: { retryAfter: number; body: string };
  /** The decision, when the check returned one. */
  decision?: Decision;
  /**
   * The ids of the rules an allowed request is past in quota mode (`overLimit = "flag"`), also in
   * `headers` as `X-RateLimit-Over-Quota`; empty otherwise. The handler gets them as
   * `req.floodgate.overQuota`.
   */
  overQuota: string[];
  /**
   * For an allowed request to a `chargeHeaders` or `chargeWith` endpoint: what to charge once the
   * response is done.
   */
  charge?: PendingCharge;
  /**
   * When a concurrency rule holds the request's lease, or may hold it (the check carried a lease
   * and the answer is not the agent's: late, or the connection lost mid-call): what to release
   * once the response is done.
   */
  release?: PendingRelease;
}

/**
 * @internal A charge to make after the response: the request's attributes and what reports the
 * cost (a response header, or a `chargeWith` function).
 */
export interface PendingCharge {
  /** The response header that reports the cost, in lower case (a `chargeHeaders` endpoint). */
  header?: string;
  /** The function that gives the cost (a `chargeWith` endpoint). */
  fn?: ChargeFunction;
  /** The request's attributes, as the request-phase peek sent them (the charge sets cost and mode). */
  attributes: Attributes;
  /** The endpoint's `failFor`, if any. */
  fail?: FailPolicy;
  /** The request's `traceparent` header, forwarded with the charge as with the request's check. */
  traceparent?: string;
}

/**
 * @internal A release to send after the response: the request's attributes, cost and lease as its
 * check sent them, mode release (the agent matches the same rules, and frees the lease in each).
 */
export interface PendingRelease {
  attributes: Attributes;
  /**
   * The agent said it holds the lease. False: a precaution, the check's answer was not the agent's
   * and the agent may or may not have taken the lease; a release that fails is then logged at debug
   * level only (a release of a lease not held changes nothing).
   */
  sure: boolean;
  /** The request's `traceparent` header, forwarded with the release as with the request's check. */
  traceparent?: string;
}

/** The most a check may cost: the wire's u32. */
const MAX_COST = 0xffff_ffff;

/**
 * The cost a response reports in its charge header, as Node or the framework holds it (a string, a
 * number, or a list of lines): the integer (1 to 2³²−1, decimal digits only around optional
 * spaces), 0 for nothing to charge (no header, or 0), or undefined for a value that is none of
 * these (empty, not a number, a fraction, past 2³²−1, several lines).
 */
export function reportedCost(value: unknown): number | undefined {
  if (value === undefined || value === null) return 0;
  if (Array.isArray(value)) return value.length === 1 ? reportedCost(value[0]) : undefined;
  let n: number;
  if (typeof value === "number") n = value;
  else if (typeof value === "string" && /^\s*[0-9]+\s*$/.test(value)) n = Number(value);
  else return undefined;
  return Number.isInteger(n) && n >= 0 && n <= MAX_COST ? n : undefined;
}

/** The events of a response the charge and the release wait for (Node's `ServerResponse` has them). */
export interface Finishing {
  once(event: "finish" | "close", listener: () => void): unknown;
  /** Node: the response is finished (`finish` was emitted). */
  readonly writableFinished?: boolean;
  /** Node: the response is destroyed (its connection closed; `close` was or is being emitted). */
  readonly destroyed?: boolean;
  /** Node ≥ 18: `close` was emitted. */
  readonly closed?: boolean;
}

/**
 * Runs `fn` once when `res` is done: finished (`finish`: handed to the OS whole) or its connection
 * closed first (`close`: a client that went away, a destroyed stream), whichever comes first, and
 * at once when that already happened (a client that left while the check was in flight). Node's
 * `ServerResponse` emits `close` in every case, after `finish` when there is one, so `fn` always
 * runs, and runs once.
 */
export function whenDone(res: Finishing, fn: () => void): void {
  let done = false;
  const settle = () => {
    if (done) return;
    done = true;
    fn();
  };
  if (res.writableFinished === true || res.destroyed === true || res.closed === true) {
    settle();
    return;
  }
  res.once("finish", settle);
  res.once("close", settle);
}

/** A header name as HTTP writes it (RFC 9110 token). */
const TOKEN = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/;

/** Warnings of one kind at most once a minute: one bad handler must not flood the log. */
const WARN_EVERY_MS = 60_000;

/** A header's first line, trimmed, if it is visible ASCII and not empty (as the Rust Layer reads it). */
export function firstHeader(req: RequestView, name: string): string | undefined {
  const lower = name.toLowerCase();
  let value: string | undefined;
  const raw = req.rawHeaders;
  if (raw) {
    for (let i = 0; i + 1 < raw.length; i += 2) {
      if (raw[i].toLowerCase() === lower) {
        value = raw[i + 1];
        break;
      }
    }
  } else {
    const v = req.headers[lower];
    value = Array.isArray(v) ? v[0] : v;
  }
  if (value === undefined || /[^\t\x20-\x7e]/.test(value)) return undefined;
  const t = value.trim();
  return t === "" ? undefined : t;
}

function headerExtractor(name: string): Extractor {
  return (req) => firstHeader(req, name);
}

/**
 * The request's W3C `traceparent` header as received, if it has one: forwarded with its checks for
 * the client to parse (a value that is not a valid traceparent is ignored there). Node joins a
 * repeated header's lines with ", ", which no valid traceparent is.
 */
export function traceparentOf(req: RequestView): string | undefined {
  const v = req.headers.traceparent;
  return typeof v === "string" ? v : undefined;
}

/** A call's options: the endpoint's `failFor` and the request's `traceparent`; none when neither. */
function callOptions(fail: FailPolicy | undefined, traceparent: string | undefined): CallOptions | undefined {
  if (traceparent === undefined) return fail === undefined ? undefined : { fail };
  return fail === undefined ? { traceparent } : { fail, traceparent };
}

/** What reports a charge's cost, for warnings: the header's name, or `chargeWith`. */
function describeSource(pending: PendingCharge): string {
  return pending.header ?? "chargeWith";
}

/** @internal The configured limiter both middlewares run. */
export class Limiter {
  private readonly endpoint: Extractor;
  private readonly tier?: Extractor;
  private readonly user?: Extractor;
  private readonly apiKey?: Extractor;
  private readonly ip?: Extractor;
  private readonly trusted: Cidr[];
  private readonly costs = new Map<string, number>();
  private readonly failFor = new Map<string, FailPolicy>();
  /** Endpoint → the response header that reports its cost (`chargeHeaders`, names in lower case). */
  private readonly chargeHeaders = new Map<string, string>();
  /** Endpoint → the function that gives its cost (`chargeWith`). */
  private readonly chargeWith = new Map<string, ChargeFunction>();
  private readonly ietf: boolean;
  private readonly logger: { warn(message: string): void } | null;
  /** Debug-level messages: only to a `logger` given with a `debug` method. */
  private readonly debugLog: ((message: string) => void) | null;
  private lastCheckFailed = -Infinity;
  /** When each kind of charge warning was last given. */
  private readonly lastWarned = new Map<string, number>();
  private noPeerSaid = false;

  constructor(
    readonly client: Client,
    o: RateLimitOptions = {},
  ) {
    this.endpoint = o.endpoint ?? ((r) => (r.route !== undefined ? routeName(r.route) : r.path));
    this.tier = o.tier ?? (o.tierHeader ? headerExtractor(o.tierHeader) : undefined);
    this.user = o.user ?? (o.userHeader ? headerExtractor(o.userHeader) : undefined);
    this.apiKey = o.apiKey ?? (o.apiKeyHeader ? headerExtractor(o.apiKeyHeader) : undefined);
    this.ip = o.ip;
    // Throws on a bad block: a misconfigured proxy list must fail at start, not trust nothing silently.
    this.trusted = (o.trustProxies ?? []).map((b) => Cidr.parse(b));
    for (const [e, c] of Object.entries(o.costs ?? {})) {
      this.costs.set(routeName(e), Math.max(1, Math.floor(Number(c)) || 1));
    }
    // Throws on anything else: a misspelt "close" must fail at start, not fail open in an outage.
    for (const [e, f] of Object.entries(o.failFor ?? {})) {
      if (f !== "open" && f !== "closed") {
        throw new Error(`failFor[${JSON.stringify(e)}] must be "open" or "closed", not ${JSON.stringify(f)}`);
      }
      this.failFor.set(routeName(e), f);
    }
    // Throws on a header name HTTP cannot carry, or an endpoint with a fixed cost as well: the
    // request phase of a charged endpoint costs nothing, so its `costs` entry would be ignored.
    for (const [e, h] of Object.entries(o.chargeHeaders ?? {})) {
      if (typeof h !== "string" || !TOKEN.test(h)) {
        throw new Error(`chargeHeaders[${JSON.stringify(e)}] must be a header name, not ${JSON.stringify(h)}`);
      }
      const endpoint = routeName(e);
      if (this.costs.has(endpoint)) {
        throw new Error(
          `${JSON.stringify(e)} is in both costs and chargeHeaders: a charged endpoint costs what its response reports`,
        );
      }
      this.chargeHeaders.set(endpoint, h.toLowerCase());
    }
    // The same for a function, which may not share its endpoint with a header either.
    for (const [e, f] of Object.entries(o.chargeWith ?? {})) {
      if (typeof f !== "function") {
        throw new Error(`chargeWith[${JSON.stringify(e)}] must be a function, not ${typeof f}`);
      }
      const endpoint = routeName(e);
      if (this.costs.has(endpoint)) {
        throw new Error(
          `${JSON.stringify(e)} is in both costs and chargeWith: a charged endpoint costs what its response reports`,
        );
      }
      if (this.chargeHeaders.has(endpoint)) {
        throw new Error(`${JSON.stringify(e)} is in both chargeHeaders and chargeWith: one reports its cost`);
      }
      this.chargeWith.set(endpoint, f);
    }
    this.ietf = o.ietfHeaders ?? false;
    this.logger = o.logger === undefined ? console : o.logger;
    const given = o.logger;
    this.debugLog = typeof given?.debug === "function" ? (m) => given.debug?.(m) : null;
  }

  /** The request's attributes, every value wire-safe. */
  attributes(req: RequestView): Attributes {
    return this.prepare(req).attributes;
  }

  /**
   * The request's attributes (a peek of cost 0 at a `chargeHeaders` or `chargeWith` endpoint), the
   * fail policy its endpoint is given (`failFor`), if any, and what will report its cost, if anything.
   */
  private prepare(req: RequestView): {
    attributes: Attributes;
    fail?: FailPolicy;
    chargeHeader?: string;
    chargeFn?: ChargeFunction;
  } {
    const endpoint = this.endpoint(req) || undefined;
    const chargeHeader = endpoint !== undefined ? this.chargeHeaders.get(endpoint) : undefined;
    const chargeFn = endpoint !== undefined ? this.chargeWith.get(endpoint) : undefined;
    const charged = chargeHeader !== undefined || chargeFn !== undefined;
    const cost = charged ? 0 : (endpoint !== undefined && this.costs.get(endpoint)) || 1;
    const fail = endpoint !== undefined ? this.failFor.get(endpoint) : undefined;
    let ip: string | undefined | null;
    if (this.ip) ip = this.ip(req);
    else {
      ip = clientIp(req.remoteAddress, req.headers["x-forwarded-for"], this.trusted);
      if (ip === undefined && !this.noPeerSaid) {
        this.noPeerSaid = true;
        this.logger?.warn("floodgate: no peer address on the request, so IP rules do not apply (said once)");
      }
    }
    const read = (f?: Extractor) => {
      const v = f?.(req);
      return v ? wireSafe(v) : undefined;
    };
    const attributes: Attributes = {
      endpoint: endpoint !== undefined ? wireSafe(endpoint) : undefined,
      tier: read(this.tier),
      user: read(this.user),
      apiKey: read(this.apiKey),
      ip: ip ? wireSafe(ip) : undefined,
      cost,
    };
    if (charged) attributes.mode = "peek";
    return { attributes, fail, chargeHeader, chargeFn };
  }

  /**
   * Asks the agent and says what to do: never rejects (a failed check lets the request pass). On a
   * connection to an agent that speaks protocol version 3 the check carries a fresh lease, and when
   * a concurrency rule holds it the outcome says what to release once the response is done.
   */
  async decide(req: RequestView): Promise<LimitOutcome> {
    let decision: Decision;
    let charge: PendingCharge | undefined;
    let release: PendingRelease | undefined;
    try {
      const { attributes, fail, chargeHeader, chargeFn } = this.prepare(req);
      // The caller's trace context goes with the check, and with the charge and release after it.
      const traceparent = traceparentOf(req);
      // Read and sent in one synchronous run: the check goes on the connection whose version this
      // is (an older agent, or none, gets no lease and holds nothing).
      if (this.client.protocolVersion >= 3) attributes.lease = newLeaseId();
      decision = await this.client.checkAttributes(attributes, callOptions(fail, traceparent));
      if (chargeHeader !== undefined || chargeFn !== undefined) {
        // A charge holds nothing: it goes without the lease (and so to a version-2 agent as well).
        const { lease: _lease, ...rest } = attributes;
        charge = { header: chargeHeader, fn: chargeFn, attributes: rest, fail };
        if (traceparent !== undefined) charge.traceparent = traceparent;
      }
      // A charge endpoint's peek (cost 0) holds one unit of each concurrency rule: released as 1.
      // An answer that is not the agent's (late, the connection lost mid-call) says nothing of the
      // lease, which the agent may still have taken: released as well, as a precaution (a release
      // of a lease not held changes nothing). The agent's own answer without it: nothing to release.
      const held = decision.items.some((i) => i.verdict.holdsLease);
      if (held || (attributes.lease !== undefined && !fromAgent(decision))) {
        release = {
          attributes: { ...attributes, cost: Math.max(attributes.cost ?? 1, 1), mode: "release" },
          sure: held,
        };
        if (traceparent !== undefined) release.traceparent = traceparent;
      }
    } catch (e) {
      // Attributes are wire-safe, so this is a bug or an SDK/agent mismatch, not something a client
      // can cause: the request passes (the agent-unreachable case is the fail policy, decided before).
      const now = Date.now();
      if (now - this.lastCheckFailed >= 60_000) {
        this.lastCheckFailed = now;
        this.logger?.warn(`floodgate: the check failed; the request passes: ${(e as Error)?.message ?? e}`);
      }
      return { headers: [], overQuota: [] };
    }
    const headers = rateLimitHeaders(decision, this.ietf);
    const outcome: LimitOutcome = { headers, decision, overQuota: [] };
    if (release) outcome.release = release;
    if (decision.allowed) {
      if (charge) outcome.charge = charge;
      // Quota mode: let through past these rules' limits; the client learns which from the header,
      // the handler from req.floodgate. A rule id no agent sends (not a header's text) is left out
      // of the header only.
      if (decision.overQuota) {
        outcome.overQuota = decision.overQuotaRules;
        const named = decision.overQuotaRules.filter((r) => validateRuleId(r) === null);
        if (named.length > 0) headers.push([OVER_QUOTA_HEADER, named.join(",")]);
      }
      return outcome;
    }
    const secs = retryAfterSeconds(decision);
    outcome.reject = { retryAfter: secs, body: rejectionBody(secs) };
    return outcome;
  }

  /**
   * Charges what the response reports once it is finished (`finish`), or once its connection
   * closed before that (`close`; the header is read as the handler left it). `read` gives the
   * header's value as the framework holds it, or calls the `chargeWith` function. Never delays the
   * response, never throws.
   */
  chargeWhenDone(res: Finishing, pending: PendingCharge, read: () => unknown): void {
    whenDone(res, () => {
      let value: unknown;
      try {
        value = read();
      } catch (e) {
        const endpoint = pending.attributes.endpoint ?? "";
        this.warnEvery(
          "value",
          `floodgate: ${describeSource(pending)} on ${endpoint} threw: ${(e as Error)?.message ?? e}; nothing charged ` +
            `(at most one such warning a minute)`,
        );
        return;
      }
      try {
        this.charge(pending, value);
      } catch (e) {
        this.warnEvery("charge", `floodgate: the charge failed: ${(e as Error)?.message ?? e}`);
      }
    });
  }

  /**
   * Releases the request's lease once its response is done (finished, or its connection closed
   * first: a client that went away, a handler's error answered by the framework): the same
   * attributes, cost and lease, mode release. Once per request; never delays the response, never
   * throws. A release the agent does not take is warned about; the lease then runs out by itself
   * (a precautionary one, for a check the agent did not answer, is only logged at debug level).
   */
  releaseWhenDone(res: Finishing, pending: PendingRelease): void {
    whenDone(res, () => {
      try {
        this.release(pending);
      } catch (e) {
        this.warnEvery("release", `floodgate: the release failed: ${(e as Error)?.message ?? e}`);
      }
    });
  }

  private release(pending: PendingRelease): void {
    const endpoint = pending.attributes.endpoint ?? "";
    const lost = (why: string) =>
      this.warnEvery(
        "release",
        `floodgate: the release of a concurrency lease on ${endpoint} ${why}; its units stay held until ` +
          `the lease runs out (leaseSeconds) (at most one such warning a minute)`,
      );
    const said = (why: string) => {
      if (pending.sure) {
        lost(why);
        return;
      }
      try {
        this.debugLog?.(
          `floodgate: the precautionary release of a lease on ${endpoint} (its check was not answered by the agent) ${why}`,
        );
      } catch {
        // nothing else to tell
      }
    };
    this.client.checkAttributes(pending.attributes, callOptions(undefined, pending.traceparent)).then(
      (d) => {
        if (fromAgent(d)) return;
        const reason = "reason" in d.origin ? d.origin.reason : "unavailable";
        said(reason === "timeout" ? "was not confirmed within the client's timeout" : "did not reach the agent");
      },
      (e: unknown) => said(`failed: ${(e as Error)?.message ?? e}`),
    );
  }

  /** Charges `value` (the header's or the function's) to the request's rules; nothing for 0 or a bad value. */
  private charge(pending: PendingCharge, value: unknown): void {
    const cost = reportedCost(value);
    const endpoint = pending.attributes.endpoint ?? "";
    if (cost === undefined) {
      const shown = (Array.isArray(value) ? JSON.stringify(value) : String(value)).slice(0, 64);
      this.warnEvery(
        "value",
        `floodgate: ${describeSource(pending)} on ${endpoint} ${pending.fn ? "gave" : "is"} ${JSON.stringify(shown)}, ` +
          `not an integer 0 to ${MAX_COST}; nothing charged (at most one such warning a minute)`,
      );
      return;
    }
    if (cost === 0) return;
    const lost = (why: string) =>
      this.warnEvery(
        "charge",
        `floodgate: the charge of ${cost} on ${endpoint} ${why} (at most one such warning a minute)`,
      );
    this.client
      .checkAttributes({ ...pending.attributes, cost, mode: "charge" }, callOptions(pending.fail, pending.traceparent))
      .then(
        (d) => {
          if (fromAgent(d)) {
            // The agent answers a charge by the rule's fail mode while its store is away, uncounted.
            if (d.items.some((i) => i.verdict.source === "fallback")) lost("was not counted: the agent's store is away");
            return;
          }
          const reason = "reason" in d.origin ? d.origin.reason : "unavailable";
          lost(
            reason === "timeout"
              ? "was not confirmed within the client's timeout; the agent may not have counted it"
              : "was not counted: the agent is unreachable",
          );
        },
        (e: unknown) => lost(`was not counted: ${(e as Error)?.message ?? e}`),
      );
  }

  /**
   * Warns at most once a minute for each kind. A logger that throws is ignored: the charge runs in
   * the response's events and its promise, where a throw would crash the app.
   */
  private warnEvery(kind: string, message: string): void {
    if (!this.logger) return;
    const now = Date.now();
    if (now - (this.lastWarned.get(kind) ?? -Infinity) < WARN_EVERY_MS) return;
    this.lastWarned.set(kind, now);
    try {
      this.logger.warn(message);
    } catch {
      // nothing else to tell
    }
  }
}
