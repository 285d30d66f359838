/**
 * The client: one multiplexed Unix-socket connection to the local agent, request ids, pipelining,
 * a timeout per call, the agent's fail-closed rules and the fail policy, reconnection with backoff
 * and jitter, and its health.
 */

import { randomFillSync } from "node:crypto";
import * as net from "node:net";

import {
  agentDecision,
  closedRuleDecision,
  degradedDecision,
  fromAgent,
  localDecision,
  type Decision,
  type Degraded,
} from "./decision";
import { closing, type FailModeList } from "./fail-modes";
import { describeError, Reachability, type Health } from "./health";
import {
  attributeFields,
  checkVersion,
  decodeFrame,
  encodeFrame,
  ErrorCode,
  InvalidCheck,
  MIN_VERSION,
  parseTraceparent,
  RESERVE_VERSION,
  TRACE_VERSION,
  VERSION,
  type Attributes,
  type Body,
  type Check,
  type Item,
  type ItemMode,
} from "./protocol";
import { defaultSocketPath } from "./socket-path";

/**
 * What a call answers when the agent cannot: allow (`open`, the default) or deny (`closed`). Given
 * per call it decides alone; the client's own applies to checks no fail-closed rule of the agent's
 * touches.
 */
export type FailPolicy = "open" | "closed";

/**
 * A limit this process enforces by itself while the agent is away, for fail-open calls: a token
 * bucket of `limit` refilled over `perMs`, per check key.
 */
export interface LocalLimit {
  /** Bucket capacity, and refill per `perMs`. */
  limit: number;
  /** The refill period in milliseconds. */
  perMs: number;
}

/** Where the client reports what goes wrong with the agent (`console.warn` by default). */
export interface Logger {
  warn(message: string): void;
  debug?(message: string): void;
}

/** How a client behaves; every field is optional and the defaults suit most services. */
export interface ClientConfig {
  /** Longest a call waits for the agent, in ms (default 10). */
  timeoutMs?: number;
  /**
   * What a call answers when the agent cannot and it touches none of the agent's fail-closed rules
   * (default `open`).
   */
  fail?: FailPolicy;
  /** The Retry-After a fail-closed answer carries (a rule's or a policy's), in ms (default 1000). */
  closedRetryAfterMs?: number;
  /** First reconnection delay in ms; doubles on each failure (default 10). */
  reconnectMinMs?: number;
  /** Longest reconnection delay in ms (default 1000). */
  reconnectMaxMs?: number;
  /** Longest a connection attempt and its Hello may take, in ms (default 250). */
  connectTimeoutMs?: number;
  /** Calls in flight at most; past it calls answer by their fail policy at once (default 8192). */
  maxPending?: number;
  /**
   * Bytes written but not yet taken by the socket at most (an agent that stopped reading); past it
   * calls answer by their fail policy at once (default 1 MiB).
   */
  maxBufferedBytes?: number;
  /**
   * A per-process limit fail-open calls enforce while the agent is away (default off); peeks,
   * charges, releases and commits pass it by (they consume nothing here); an acquire and a reserve
   * count as a consume.
   */
  fallbackLimit?: LocalLimit | null;
  /**
   * Where warnings go: an unreachable agent (at most one line every 10 s), its return, unreadable
   * answers. Default `console.warn`; `null` silences them.
   */
  logger?: Logger | null;
}

/** Per-call overrides of the client's configuration. */
export interface CallOptions {
  /** Overrides {@link ClientConfig.timeoutMs}. */
  timeoutMs?: number;
  /**
   * What this call answers when the agent cannot, whatever the agent's fail-closed rules and
   * {@link ClientConfig.fail} say.
   */
  fail?: FailPolicy;
  /**
   * The caller's W3C trace context, a `traceparent` header's value
   * (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`): sent with the check (protocol version
   * 5) so that the agent's span of it, when the agent exports traces, is a child of the caller's
   * span. It changes nothing in the decision. A value that is not a valid `traceparent` (it came
   * from an HTTP header) is ignored, and so is any on a connection to an agent of version 4 or
   * older: the check goes as it would without it.
   */
  traceparent?: string;
}

/** Counts of calls the SDK answered by itself, for the service's own metrics. */
export interface ClientStats {
  /** Calls answered by the fail policy because there was no connection (or the agent could not answer). */
  unavailable: number;
  /** Calls answered by the fail policy because the agent was late. */
  timeouts: number;
  /** Connections established (the first one included). */
  connects: number;
  /** Degraded calls the per-process fallback limit denied. */
  localDenied: number;
}

/**
 * Units of a concurrency rule held under a lease ({@link Client.acquire}): what
 * {@link Client.release} gives back. Unreleased, it runs out after the rule's `leaseSeconds`.
 */
export interface Lease {
  /** The key the units are held for. */
  readonly key: string;
  /** The concurrency rule that holds them. */
  readonly ruleId: string;
  /** How many units. */
  readonly cost: number;
  /** The lease id the client picked: a random nonzero 64-bit value. */
  readonly id: bigint;
}

/** What {@link Client.acquire} returns: the decision, and the lease when the rule holds it. */
export interface Acquired {
  /** The decision on the acquire, as any check's. */
  decision: Decision;
  /**
   * The lease, when the decision's item holds it (an allowed acquire on a concurrency rule the
   * agent decided); absent on a denial, on a rule of another algorithm and when the SDK decided
   * alone (agent unreachable or late). Release it with {@link Client.release}.
   */
  lease?: Lease;
}

/**
 * One meter of a reservation ({@link Client.reserveMeters}): a (key, rule) and the units reserved
 * on it.
 */
export interface Meter {
  /** The client key, e.g. `apikey:abc`. */
  readonly key: string;
  /** The rule that meters it, e.g. `output-tokens`. */
  readonly ruleId: string;
  /** The units reserved (an integer, 1 to 2³²−1): the most the request may use, e.g. its `max_tokens`. */
  readonly units: number;
}

/**
 * A reservation the agent holds ({@link Client.reserve}, {@link Client.reserveMeters}): settle it
 * with {@link Client.commit} once the request's use is known. One never committed expires after
 * its rules' `reservationSeconds` (default 300), its units staying counted under
 * `reservationExpiry = "charge"` (the default) or going back under `"release"`.
 */
export interface Reservation {
  /** Its id, chosen by this client: a random nonzero 64-bit value. */
  readonly id: bigint;
  /** Its meters, in the order they were reserved (the order of a commit's figures). */
  readonly meters: readonly Meter[];
  /**
   * Which meters the agent holds, in that order: all, except a quota-mode meter
   * (`overLimit = "flag"`) the request passed flagged, which took nothing (absent: all).
   */
  readonly held?: readonly boolean[];
}

/** What {@link Client.reserve} and {@link Client.reserveMeters} return. */
export interface Reserved {
  /** The decision on the reserve, as any check's. */
  decision: Decision;
  /**
   * The reservation, when the agent decided and holds every meter of it (each item's
   * `holdsLease`); absent on a denial (which reserves nothing) and when the SDK decided alone
   * (agent unreachable or late). Commit it with {@link Client.commit}.
   */
  reservation?: Reservation;
}

/**
 * What {@link Client.hold} returns: `{ allowed: true, decision, value }` with what `fn` returned
 * when the acquire passed (its lease released once `fn` settled), or `{ allowed: false, decision }`
 * when it was denied (`fn` not run; `decision.retryAfterMs` says when to retry).
 */
export type HoldResult<T> = { allowed: true; decision: Decision; value: T } | { allowed: false; decision: Decision };

/** Lease ids drawn from the CSPRNG 512 at a time: one random read per 512 acquires. */
const LEASE_POOL = Buffer.alloc(8 * 512);
let leaseAt = LEASE_POOL.length;

/**
 * A fresh lease id: a random nonzero 64-bit value (PROTOCOL.md: random, so that two clients never
 * pick the same one for a key), from `crypto.randomFillSync`.
 */
export function newLeaseId(): bigint {
  for (;;) {
    if (leaseAt >= LEASE_POOL.length) {
      randomFillSync(LEASE_POOL);
      leaseAt = 0;
    }
    const id = LEASE_POOL.readBigUInt64BE(leaseAt);
    leaseAt += 8;
    if (id !== 0n) return id;
  }
}

/**
 * Why a check returned no decision: only what no fail policy can answer for the caller. An
 * unreachable or late agent never shows up here: those calls resolve by the fail policy.
 */
export class FloodgateError extends Error {
  /**
   * `invalid`: the check breaks a protocol limit, or peeks or charges on a connection to an agent
   * that speaks only protocol version 1, or acquires or releases a lease on one that speaks less
   * than version 3, or reserves or commits on one that speaks less than version 6, or a commit's
   * figures do not match its reservation's meters (found before sending); `agent`: the agent
   * refused it (unknown rule, invalid item), with the wire `code`.
   */
  readonly kind: "invalid" | "agent";
  /** The agent's error code (4 unknown rule, 5 invalid item) when `kind` is `agent`. */
  readonly code?: number;
  constructor(kind: "invalid" | "agent", message: string, code?: number) {
    super(message);
    this.name = "FloodgateError";
    this.kind = kind;
    this.code = code;
  }
}

interface Pending {
  resolve(d: Decision): void;
  reject(e: Error): void;
  timer: NodeJS.Timeout;
  /** The call's own fail policy; null: the agent's fail-closed rules, then the client's policy. */
  fail: FailPolicy | null;
  check: Check;
}

/** Distinct keys the local limiter tracks before it starts over (bounded memory). */
const LOCAL_KEYS = 100_000;

interface Resolved {
  timeoutMs: number;
  fail: FailPolicy;
  closedRetryAfterMs: number;
  reconnectMinMs: number;
  reconnectMaxMs: number;
  connectTimeoutMs: number;
  maxPending: number;
  maxBufferedBytes: number;
  fallbackLimit: LocalLimit | null;
  logger: Logger | null;
}

/**
 * How often a connected client asks again for the fail-closed rules (PROTOCOL.md, "Version 2"): a
 * rule changed on the agent is applied by the SDK within 10 s, for one small frame each way per
 * process.
 */
export const FAIL_MODES_EVERY_MS = 10_000;

/** Node runs a timer of more than 2^31 - 1 ms after 1 ms: every duration is held below it. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** The default logger: warnings to stderr, where an unreachable agent is seen without any setup. */
const CONSOLE: Logger = { warn: (message) => console.warn(message) };

const HELLO = encodeFrame({ requestId: 0, body: { kind: "hello", minVersion: MIN_VERSION, maxVersion: VERSION } });

function resolveConfig(c: ClientConfig): Resolved {
  const ms = (v: number | undefined, d: number, min = 0) =>
    typeof v === "number" && Number.isFinite(v) ? Math.min(Math.max(min, v), MAX_TIMER_MS) : d;
  return {
    timeoutMs: ms(c.timeoutMs, 10),
    fail: c.fail === "closed" ? "closed" : "open",
    closedRetryAfterMs: ms(c.closedRetryAfterMs, 1000),
    reconnectMinMs: ms(c.reconnectMinMs, 10, 1),
    reconnectMaxMs: ms(c.reconnectMaxMs, 1000, 1),
    connectTimeoutMs: ms(c.connectTimeoutMs, 250, 1),
    maxPending: ms(c.maxPending, 8192, 1),
    maxBufferedBytes: ms(c.maxBufferedBytes, 1 << 20, 1),
    fallbackLimit: c.fallbackLimit ?? null,
    logger: c.logger === undefined ? CONSOLE : c.logger,
  };
}

/**
 * A client of the local agent. One per process: every call shares its one connection, many in
 * flight at once. Every call resolves within its timeout (default 10 ms), whatever the agent does:
 * when the agent is unreachable or late a call under one of the agent's fail-closed rules is
 * denied and any other answers by its fail policy, open (allow) by default, and the client
 * reconnects in the background with backoff and jitter. Calls reject only for checks no policy can
 * answer ({@link FloodgateError}: an invalid check, an unknown rule, a peek or charge to an agent
 * that speaks only protocol version 1, a lease to one that speaks less than 3, a reservation to
 * one that speaks less than 6).
 *
 * ```ts
 * const client = await Client.connect(); // $FLOODGATE_SOCKET, else the agent's default socket
 * const d = await client.allow("user:123", "api-per-user");
 * if (!d.allowed) console.log(`429, retry in ${d.retryAfterMs} ms`);
 * ```
 */
export class Client {
  /** The path given to the constructor; null: looked up on every attempt ({@link defaultSocketPath}). */
  private readonly given: string | null;
  /** The socket in use, or tried last. */
  private current: string;
  private readonly reach: Reachability;
  private readonly config: Resolved;
  private readonly pending = new Map<number, Pending>();
  private socket: net.Socket | null = null;
  private connected = false;
  /** The version the connection's HelloOk chose; 0 while there is no connection. */
  private version = 0;
  private closed = false;
  private nextId = 1;
  private rbuf: Buffer = Buffer.alloc(0);
  private backoff: number | null = null;
  private reconnectTimer: NodeJS.Timeout | null = null;
  private readyWaiters: (() => void)[] = [];
  private readonly local = new Map<string, { tokens: number; at: number }>();
  private readonly counts: ClientStats = { unavailable: 0, timeouts: 0, connects: 0, localDenied: 0 };
  private lastWarn = new Map<string, number>();
  /** The agent's last fail-closed rules, kept across disconnections (that is when they are needed). */
  private failModes: FailModeList | null = null;
  /** Asks for the list again while a version-2 connection is up. */
  private failModesTimer: NodeJS.Timeout | null = null;
  private truncationSaid = false;

  /**
   * A client for the agent at `path`, used as given. Without it (`new Client()` or
   * `new Client(config)`) the client looks the socket up with {@link defaultSocketPath}
   * (`$FLOODGATE_SOCKET` first) on every connection attempt. Returns at once; the connection is made
   * (and remade) in the background, and calls answer by the fail policy until it is up.
   * {@link Client.connect} waits for the first connection.
   */
  constructor(path?: string | null | ClientConfig, config: ClientConfig = {}) {
    if (typeof path === "object" && path !== null) {
      config = path;
      path = undefined;
    }
    this.given = path ?? null;
    this.current = this.given ?? defaultSocketPath();
    this.config = resolveConfig(config);
    this.reach = new Reachability(this.current, this.config.fail, this.config.logger);
    this.open();
  }

  /**
   * A client that has tried its first connection: waits up to `connectTimeoutMs` so that the first
   * calls reach the agent when it is up. Never rejects: an absent agent is the fail policy's case.
   * `Client.connect()` and `Client.connect(config)` look the socket up as the constructor does.
   */
  static async connect(path?: string | null | ClientConfig, config: ClientConfig = {}): Promise<Client> {
    const client = new Client(path, config);
    await client.ready(client.config.connectTimeoutMs);
    return client;
  }

  /** The agent's socket path in use, or tried last. */
  get path(): string {
    return this.current;
  }

  /**
   * Resolves once the client is connected, or its connection attempt under way has failed, or after
   * `waitMs` — whichever comes first. Resolves to whether it is connected; never rejects.
   */
  ready(waitMs: number = this.config.connectTimeoutMs): Promise<boolean> {
    if (this.connected || this.closed) return Promise.resolve(this.connected);
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        resolve(this.connected);
      };
      const timer = setTimeout(() => {
        const i = this.readyWaiters.indexOf(done);
        if (i >= 0) this.readyWaiters.splice(i, 1);
        resolve(this.connected);
      }, waitMs);
      this.readyWaiters.push(done);
    });
  }

  /** One item: `allow(key, ruleId, cost)`. */
  allow(key: string, ruleId: string, cost = 1, options?: CallOptions): Promise<Decision> {
    return this.send({ form: "items", items: [{ key, ruleId, cost }] }, options);
  }

  /**
   * Whether `cost` would pass now, changing nothing: `allowed`, `remaining` (what is left now,
   * before any cost), `resetAtMs`, and on a denial `retryAfterMs` until it could pass. A cost of 0
   * (the default) is allowed unless the key is already past its limit. Needs an agent that speaks
   * protocol version 2: connected to one that speaks 1, it rejects ({@link FloodgateError},
   * `invalid`). While the agent cannot answer, it is answered as any check is.
   */
  peek(key: string, ruleId: string, cost = 0, options?: CallOptions): Promise<Decision> {
    return this.send({ form: "items", items: [{ key, ruleId, cost, mode: "peek" }] }, options);
  }

  /**
   * Takes `cost` (at least 1) whatever the limit says, for a cost known only after the response
   * (tokens, bytes): past the limit later checks wait the debt out. Never a rejection by the agent:
   * the decision is the state after the charge. Needs an agent that speaks protocol version 2, as
   * {@link peek} does.
   */
  charge(key: string, ruleId: string, cost: number, options?: CallOptions): Promise<Decision> {
    return this.send({ form: "items", items: [{ key, ruleId, cost, mode: "charge" }] }, options);
  }

  /**
   * Takes `cost` units (at least 1) of a concurrency rule under a fresh lease (a random nonzero
   * 64-bit id): allowed while the units the key's live leases hold plus `cost` stay within the
   * rule's limit; denied otherwise, with `retryAfterMs` at most 1000 (the soonest lease to run out,
   * capped: holders usually release well before). `lease` is returned only when the decision's item
   * holds it: give it back with {@link release} when the work ends, else it runs out after the
   * rule's `leaseSeconds`. On a rule of another algorithm it is a plain consume and holds nothing.
   *
   * Needs an agent that speaks protocol version 3: connected to one that speaks less, it rejects
   * ({@link FloodgateError}, `invalid`) and nothing is sent. While the agent cannot answer it is
   * decided as any check is (the call's `fail`, the agent's fail-closed rules, the client's policy
   * and `fallbackLimit`, where it counts as a consume) and returns no lease. When the acquire was
   * sent but the answer is not the agent's (late, or the connection lost mid-call), the agent may
   * still have taken the lease: it is released in the background at once, not awaited (a release of
   * a lease not held changes nothing; its failure is logged at debug level only).
   */
  async acquire(key: string, ruleId: string, cost = 1, options?: CallOptions): Promise<Acquired> {
    const id = newLeaseId();
    const sent = { written: false };
    const decision = await this.send({ form: "items", items: [{ key, ruleId, cost, lease: id }] }, options, sent);
    if (sent.written && !fromAgent(decision)) {
      this.releaseUnanswered(
        {
          form: "items",
          items: [{ key, ruleId, cost: Math.max(cost, 1), mode: "release", lease: id }],
        },
        options?.traceparent,
      );
    }
    if (!decision.items.some((i) => i.verdict.holdsLease)) return { decision };
    return { decision, lease: { key, ruleId, cost, id } };
  }

  /**
   * Sends `release` (a check of mode release with the lease of a check the agent did not answer,
   * and that check's trace context) and forgets it: the agent may have taken the lease after all,
   * and otherwise the release changes nothing, so a release that fails too is only logged at debug
   * level.
   */
  private releaseUnanswered(release: Check, traceparent: string | undefined): void {
    this.send(release, traceparent === undefined ? undefined : { traceparent }).then(
      (d) => {
        if (!fromAgent(d)) {
          this.debug(
            `floodgate: a precautionary lease release was not confirmed (${"reason" in d.origin ? d.origin.reason : "unavailable"}); ` +
              `if the agent took the lease, it runs out by itself`,
          );
        }
      },
      (e: unknown) => this.debug(`floodgate: a precautionary lease release failed: ${(e as Error)?.message ?? e}`),
    );
  }

  /**
   * Gives back the units `lease` holds (mode release with its key, rule, cost and id). Never a
   * rejection by the agent: allowed, with the units left after it; a lease no longer held (released
   * already, run out) changes nothing. Needs protocol version 3, as {@link acquire} does. While the
   * agent cannot answer it resolves with the SDK's degraded decision (the fail policy's, as any
   * check's; it takes nothing from `fallbackLimit`) and the units stay held until the lease runs out
   * (`leaseSeconds`).
   */
  release(lease: Lease, options?: CallOptions): Promise<Decision> {
    return this.send(
      { form: "items", items: [{ key: lease.key, ruleId: lease.ruleId, cost: lease.cost, mode: "release", lease: lease.id }] },
      options,
    );
  }

  /**
   * Runs `fn` while holding `cost` units of a concurrency rule: {@link acquire}s, and if allowed
   * runs `fn(decision)` and releases the lease (when one is held) once `fn` settles, before
   * resolving; `fn`'s error is rethrown after the release. Resolves to
   * `{ allowed: true, decision, value }`, or `{ allowed: false, decision }` without running `fn`
   * when the acquire is denied. A release that fails is warned about through the logger, never
   * thrown. An acquire the agent did not answer (late, connection lost) holds no lease here: `fn`
   * runs or not by the fail policy, and {@link acquire} has already sent the lease's release in the
   * background. Rejects, without running `fn`, where {@link acquire} does.
   *
   * ```ts
   * const r = await client.hold("gpu:a100", "gpu-slots", 1, () => render(job));
   * if (!r.allowed) return reply.code(429).header("Retry-After", "1").send();
   * ```
   */
  async hold<T>(
    key: string,
    ruleId: string,
    cost: number,
    fn: (decision: Decision) => T | Promise<T>,
    options?: CallOptions,
  ): Promise<HoldResult<T>> {
    const { decision, lease } = await this.acquire(key, ruleId, cost, options);
    try {
      if (!decision.allowed) return { allowed: false, decision };
      return { allowed: true, decision, value: await fn(decision) };
    } finally {
      if (lease) {
        await this.release(lease, options).then(
          (d) => {
            if (d.origin.kind !== "agent") {
              this.warn(
                "release",
                `floodgate: the release of a lease on ${ruleId} was not confirmed (${"reason" in d.origin ? d.origin.reason : "unavailable"}); ` +
                  `its units stay held until the lease runs out (at most one such warning a minute)`,
              );
            }
          },
          (e: unknown) =>
            this.warn("release", `floodgate: the release of a lease on ${ruleId} failed: ${(e as Error)?.message ?? e}`),
        );
      }
    }
  }

  /**
   * Reserves `units` (at least 1) of `ruleId` for `key` before a request whose use is known only
   * after it (an LLM call's `max_tokens`, say): {@link reserveMeters} with one meter. Commit the
   * reservation with {@link commit} once the use is known.
   *
   * ```ts
   * const { decision, reservation } = await client.reserve("apikey:abc", "output-tokens", maxTokens);
   * if (!decision.allowed) return reply429(decision.retryAfterMs);
   * const out = await llm(prompt, maxTokens);
   * if (reservation) await client.commit(reservation, [out.usage.outputTokens]);
   * ```
   */
  reserve(key: string, ruleId: string, units: number, options?: CallOptions): Promise<Reserved> {
    return this.reserveMeters([{ key, ruleId, units }], options);
  }

  /**
   * Reserves every meter at once (1 to 16), all or nothing, under one fresh reservation id (a
   * random nonzero 64-bit value): a check of mode reserve, decided as consumes are (a denial
   * reserves nothing), whose admitted units the agent counts at once and holds until
   * {@link commit} settles them. A meter on a concurrency rule holds its units in flight under the
   * reservation, as a lease. `reservation` is returned only when the agent decided and every item
   * holds it.
   *
   * Needs an agent that speaks protocol version 6: connected to one that speaks less, it rejects
   * ({@link FloodgateError}, `invalid`) and nothing is sent. While the agent cannot answer it is
   * decided as any check is (the call's `fail`, the agent's fail-closed rules, the client's policy
   * and `fallbackLimit`, where it counts as a consume) and returns no reservation. When the reserve
   * was sent but the answer is not the agent's (late, or the connection lost mid-call), the agent
   * may still hold it: it is committed at 0 in the background at once, not awaited (a commit of a
   * reservation not held gives nothing back and charges its cost, 0; its failure is logged at
   * debug level only).
   */
  async reserveMeters(meters: readonly Meter[], options?: CallOptions): Promise<Reserved> {
    const id = newLeaseId();
    // Copied: the caller's array (and its objects) may change after the call; the commit must
    // name what was reserved.
    const held: Meter[] = Array.isArray(meters) ? meters.map((m) => ({ key: m?.key, ruleId: m?.ruleId, units: m?.units })) : [];
    const sent = { written: false };
    const decision = await this.send(
      { form: "items", items: held.map((m) => ({ key: m.key, ruleId: m.ruleId, cost: m.units, mode: "reserve", lease: id })) },
      options,
      sent,
    );
    const reservation: Reservation = { id, meters: held };
    if (!fromAgent(decision)) {
      if (sent.written) this.commitUnanswered(reservation, options?.traceparent);
      return { decision };
    }
    // Held when the check passed: every meter, but one a quota-mode rule let through flagged.
    const flags = decision.items.map((i) => i.verdict.holdsLease);
    const holds = decision.allowed && flags.some((h) => h);
    return holds ? { decision, reservation: { ...reservation, held: flags } } : { decision };
  }

  /**
   * Settles `reservation` at what the request used: `used` holds one figure per meter, in the
   * order of `reservation.meters` (an integer 0 to 2³²−1; 0 for a meter it did not use). On each
   * meter the reserved units past its figure go back to the window (or quota period) they were
   * counted in, while that window still counts; a use past them is charged, as {@link charge}
   * does. A meter on a concurrency rule is released whole, whatever its figure. Never a rejection
   * by the agent: its figures are each meter's state after the commit. A reservation the agent no
   * longer holds (committed already, expired, or reserved with an agent since restarted) gives
   * nothing back; under its rule's `reservationExpiry = "release"` the figure is charged whole.
   *
   * Rejects ({@link FloodgateError}, `invalid`) when `used` does not hold one figure per meter, and
   * where {@link reserveMeters} does. While the agent cannot answer it resolves with the SDK's
   * degraded decision (the fail policy's, as any check's; it takes nothing from `fallbackLimit`)
   * and the reservation stays counted until it expires.
   */
  commit(reservation: Reservation, used: readonly number[], options?: CallOptions): Promise<Decision> {
    const meters = reservation?.meters ?? [];
    if (!Array.isArray(used) || used.length !== meters.length) {
      const n = Array.isArray(used) ? `${used.length} figure${used.length === 1 ? "" : "s"}` : "no array of figures";
      return Promise.reject(
        new FloodgateError(
          "invalid",
          `invalid commit: ${n} for a reservation of ${meters.length} meter${meters.length === 1 ? "" : "s"} (one per meter, in its order)`,
        ),
      );
    }
    // Only the meters the agent holds (a flagged quota-mode meter took nothing). A meter of units
    // in flight (a concurrency rule) is released whole, whatever its figure.
    const items = meters
      .map((m, i) => ({ key: m.key, ruleId: m.ruleId, cost: used[i], mode: "commit" as const, lease: reservation.id }))
      .filter((_, i) => reservation.held?.[i] ?? true);
    if (items.length === 0) {
      return Promise.reject(new FloodgateError("invalid", "invalid commit: the reservation holds no meter"));
    }
    return this.send({ form: "items", items }, options);
  }

  /**
   * Commits at 0 a reservation whose reserve the agent did not answer (with that reserve's trace
   * context), and forgets it: the agent may hold it after all, and otherwise a commit of 0 changes
   * nothing, so a commit that fails too is only logged at debug level.
   */
  private commitUnanswered(reservation: Reservation, traceparent: string | undefined): void {
    const zeros = reservation.meters.map(() => 0);
    this.commit(reservation, zeros, traceparent === undefined ? undefined : { traceparent }).then(
      (d) => {
        if (!fromAgent(d)) {
          this.debug(
            `floodgate: a precautionary commit of a reservation was not confirmed (${"reason" in d.origin ? d.origin.reason : "unavailable"}); ` +
              `if the agent holds it, it expires by itself`,
          );
        }
      },
      (e: unknown) => this.debug(`floodgate: a precautionary commit of a reservation failed: ${(e as Error)?.message ?? e}`),
    );
  }

  /**
   * Several items at once (1 to 16): allowed only if every enforced consume item is (in a check of
   * peeks only, every enforced peek); a denial consumes nothing. Each item may peek or charge
   * (`mode`), as {@link peek} and {@link charge} do, or carry a `lease` or release one (version 3),
   * or reserve or commit under a reservation id in `lease` (version 6).
   */
  check(items: Item[], options?: CallOptions): Promise<Decision> {
    return this.send({ form: "items", items }, options);
  }

  /**
   * Request attributes for the agent to match against its rules (every matching rule is checked);
   * `mode` applies to every matched rule.
   */
  checkAttributes(attributes: Attributes, options?: CallOptions): Promise<Decision> {
    return this.send({ form: "attributes", attributes }, options);
  }

  /** Whether the client holds a live connection to the agent right now. */
  isConnected(): boolean {
    return this.connected;
  }

  /**
   * The protocol version the agent chose for the connection (1 to 6), or 0 while there is none. A
   * check needing a higher version ({@link checkVersion}) is refused before it is sent; a
   * `traceparent` is sent only at 5 or later.
   */
  get protocolVersion(): number {
    return this.version;
  }

  /** Counts of degraded answers and connections, for the service's metrics. */
  stats(): ClientStats {
    return { ...this.counts };
  }

  /**
   * Whether the agent is reachable, where, why not, and how many calls the fail policy answered:
   * for a service's health endpoint (an unreachable agent otherwise shows only as requests passing
   * without rate-limit headers).
   */
  health(): Health {
    const h: Health = {
      connected: this.connected,
      path: this.current,
      lastError: this.reach.lastError,
      failedAttempts: this.reach.failedAttempts,
      failPolicyAnswers: this.counts.unavailable + this.counts.timeouts,
      failClosedRules: this.failModes?.rules.length ?? 0,
    };
    if (this.failModes) h.rulesVersion = this.failModes.rulesVersion;
    return h;
  }

  /**
   * Closes the connection and stops reconnecting. Calls in flight, and any made afterwards,
   * answer by their fail policy.
   */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    this.reconnectTimer = null;
    this.stopFailModes();
    const s = this.socket;
    this.socket = null;
    this.connected = false;
    this.version = 0;
    s?.destroy();
    this.failAll("unavailable");
    this.wake();
  }

  // -------------------------------------------------------------------------------------------
  // Calls

  /**
   * Sends `check`, resolving with the agent's decision or the SDK's own. `sent.written` is set when
   * the check's frame was written to a connection (the agent may act on it whatever the answer).
   */
  private send(check: Check, options?: CallOptions, sent?: { written: boolean }): Promise<Decision> {
    const timeoutMs =
      typeof options?.timeoutMs === "number" && Number.isFinite(options.timeoutMs)
        ? Math.min(Math.max(0, options.timeoutMs), MAX_TIMER_MS)
        : this.config.timeoutMs;
    // As the client's own setting is read: anything but "closed" fails open.
    const fail: FailPolicy | null =
      options?.fail === undefined || options.fail === null ? null : options.fail === "closed" ? "closed" : "open";
    const id = this.allocateId();
    // The caller's trace context, only for an agent that reads it (version 5: form 4); parsed only
    // when there is one. Read and written in this one synchronous run, on the connection of this
    // version.
    const trace =
      options?.traceparent !== undefined && this.version >= TRACE_VERSION ? parseTraceparent(options.traceparent) : undefined;
    const body: Body = trace === undefined ? { kind: "check", check } : { kind: "check", check, trace };
    let bytes: Buffer;
    try {
      bytes = encodeFrame({ requestId: id, body }, this.version);
    } catch (e) {
      const message = e instanceof InvalidCheck ? e.message : String(e);
      return Promise.reject(new FloodgateError("invalid", `invalid check: ${message}`));
    }
    // A version-1 agent cannot parse forms 2 and 3 and would close the connection, failing every
    // call in flight, a version-2 one refuses a lease's mode byte, and one of 3 to 5 refuses modes
    // 4 and 5: such a check is never sent to it. Without a connection it is answered as any check
    // is (the agent may come back speaking 6).
    const needs = checkVersion(check);
    if (this.connected && needs > this.version) {
      const what =
        needs >= RESERVE_VERSION
          ? "it cannot hold reservations (update the agent)"
          : needs >= 3
            ? "it cannot hold leases (update the agent)"
            : null;
      return Promise.reject(
        new FloodgateError(
          "invalid",
          what !== null
            ? `invalid check: the agent speaks protocol version ${this.version}: ${what}`
            : `invalid check: peek and charge need protocol version 2, and the agent speaks version ${this.version}`,
        ),
      );
    }
    const sock = this.socket;
    if (
      !this.connected ||
      sock === null ||
      this.pending.size >= this.config.maxPending ||
      sock.writableLength > this.config.maxBufferedBytes
    ) {
      return Promise.resolve(this.degraded(fail, check, "unavailable"));
    }
    return new Promise<Decision>((resolve, reject) => {
      const timer = setTimeout(() => {
        if (this.pending.delete(id)) resolve(this.degraded(fail, check, "timeout"));
      }, timeoutMs);
      this.pending.set(id, { resolve, reject, timer, fail, check });
      // Written at once rather than coalesced per tick: measured, a closed loop of 16 callers ran
      // ~1.6x faster and with less CPU per check, since the agent starts on the first check while
      // this process still resumes the others (coalescing made both sides take turns).
      sock.write(bytes);
      if (sent) sent.written = true;
    });
  }

  private allocateId(): number {
    // Id 0 is reserved for connection-level frames; an id still in flight is never reused.
    for (;;) {
      const id = this.nextId;
      this.nextId = this.nextId >= 0xffff_ffff ? 1 : this.nextId + 1;
      if (!this.pending.has(id)) return id;
    }
  }

  private settle(id: number): Pending | undefined {
    const p = this.pending.get(id);
    if (p) {
      this.pending.delete(id);
      clearTimeout(p.timer);
    }
    return p;
  }

  private failAll(why: Degraded): void {
    const all = [...this.pending.values()];
    this.pending.clear();
    for (const p of all) {
      clearTimeout(p.timer);
      p.resolve(this.degraded(p.fail, p.check, why));
    }
  }

  /**
   * The answer to a check the agent cannot answer, in PROTOCOL.md's order: the call's own policy
   * alone; else denied if it touches one of the agent's fail-closed rules; else the client's policy.
   * Open answers go through the per-process fallback limit when there is one.
   */
  private degraded(fail: FailPolicy | null, check: Check, why: Degraded): Decision {
    if (why === "unavailable") this.counts.unavailable++;
    else this.counts.timeouts++;
    const now = Date.now();
    let policy = fail;
    if (policy === null) {
      const rule = this.failModes ? closing(this.failModes, check) : undefined;
      if (rule) return closedRuleDecision(rule, why, this.config.closedRetryAfterMs, now);
      policy = this.config.fail;
    }
    const limit = this.config.fallbackLimit;
    // The per-process limit counts what passes: a peek takes nothing, a charge or a commit is owed
    // whatever it says and a release gives back, so only consuming checks (acquires and reserves
    // included) go through it (as in the Rust SDK).
    if (policy === "open" && limit && consumesOnly(check)) {
      const [key, cost] = localKey(check);
      return this.localLimit(limit, key, cost, why, now);
    }
    return degradedDecision(policy === "open", why, this.config.closedRetryAfterMs, now);
  }

  /** The per-process fallback limit: a token bucket per check key. */
  private localLimit(limit: LocalLimit, key: string, cost: number, why: Degraded, nowMs: number): Decision {
    const capacity = Math.max(1, Math.floor(limit.limit));
    const rate = capacity / (Math.max(1, limit.perMs) / 1000); // tokens per second
    const now = performance.now();
    if (this.local.size >= LOCAL_KEYS && !this.local.has(key)) this.local.clear();
    let s = this.local.get(key);
    if (!s) {
      s = { tokens: capacity, at: now };
      this.local.set(key, s);
    }
    s.tokens = Math.min(capacity, s.tokens + ((now - s.at) / 1000) * rate);
    s.at = now;
    const allowed = s.tokens >= cost;
    if (allowed) s.tokens -= cost;
    else this.counts.localDenied++;
    const retryMs = allowed ? 0 : Math.max(1, Math.ceil(((cost - s.tokens) / rate) * 1000));
    return localDecision(allowed, why, capacity, Math.max(0, Math.floor(s.tokens)), retryMs, nowMs);
  }

  // -------------------------------------------------------------------------------------------
  // The connection

  private open(): void {
    if (this.closed) return;
    // Looked up on every attempt: an agent started after this process is found where it is.
    const path = this.given ?? defaultSocketPath();
    this.current = path;
    const sock = net.createConnection({ path });
    // The socket alone does not keep the process alive; a call in flight does (its timer).
    sock.unref();
    this.socket = sock;
    this.rbuf = Buffer.alloc(0);
    let upSince = 0;
    // Why this attempt failed or this connection ended: the first cause seen ("close" follows).
    let why: string | null = null;
    const timer = setTimeout(() => {
      why ??= `no answer to Hello within ${this.config.connectTimeoutMs} ms`;
      this.debug("connecting to the agent timed out");
      sock.destroy();
    }, this.config.connectTimeoutMs);
    timer.unref();
    sock.on("connect", () => sock.write(HELLO));
    sock.on("error", (e) => {
      why ??= this.connected ? `connection lost: ${describeError(e)}` : describeError(e);
      this.debug(`agent connection: ${e.message}`);
    });
    sock.on("data", (chunk: Buffer) => {
      if (this.socket !== sock) return;
      this.rbuf = this.rbuf.length === 0 ? chunk : Buffer.concat([this.rbuf, chunk]);
      if (!this.connected) {
        const r = decodeFrame(this.rbuf);
        if (!r.ok && r.type === "incomplete") return;
        if (
          r.ok &&
          r.frame.body.kind === "helloOk" &&
          r.frame.body.version >= MIN_VERSION &&
          r.frame.body.version <= VERSION
        ) {
          clearTimeout(timer);
          this.rbuf = this.rbuf.subarray(r.used);
          this.connected = true;
          this.version = r.frame.body.version;
          upSince = performance.now();
          this.counts.connects++;
          this.reach.connected(path);
          // A version-1 agent would refuse FailModes (error 3): it is asked only on version 2.
          if (r.frame.body.version >= 2) this.startFailModes(sock);
          this.wake();
        } else {
          // Warned about as a failed attempt, with this reason, when the socket closes.
          why = r.ok
            ? r.frame.body.kind === "error"
              ? `agent refused Hello: ${r.frame.body.code}: ${r.frame.body.message}`
              : r.frame.body.kind === "helloOk"
                ? `agent chose version ${r.frame.body.version}; this SDK speaks ${MIN_VERSION} to ${VERSION}`
                : `unexpected answer to Hello (${r.frame.body.kind})`
            : `unexpected answer to Hello (not a Floodgate agent?): ${r.reason}`;
          sock.destroy();
          return;
        }
      }
      why ??= this.readFrames(sock);
    });
    sock.on("close", () => {
      clearTimeout(timer);
      if (this.socket !== sock) return;
      const wasUp = this.connected;
      this.socket = null;
      this.connected = false;
      this.version = 0;
      this.stopFailModes();
      this.rbuf = Buffer.alloc(0);
      this.failAll("unavailable");
      if (this.closed) return;
      if (wasUp) this.reach.lost(why ?? "the agent closed the connection");
      else this.reach.failed(path, why ?? "the agent closed the connection during Hello");
      // Back off afresh only after a connection that lasted: an agent that accepts and then drops
      // every connection must not be hammered every reconnectMinMs.
      if (wasUp && performance.now() - upSince >= 1000) this.backoff = null;
      if (wasUp) this.debug("connection to the agent lost; reconnecting");
      this.wake();
      this.scheduleReconnect();
    });
  }

  /** Asks for the fail-closed rules now and every {@link FAIL_MODES_EVERY_MS} while `sock` is up. */
  private startFailModes(sock: net.Socket): void {
    this.stopFailModes();
    const ask = () => {
      if (this.socket !== sock || !this.connected) return;
      // An id of the checks' sequence: never one a call in flight holds.
      sock.write(encodeFrame({ requestId: this.allocateId(), body: { kind: "failModes" } }));
    };
    ask();
    this.failModesTimer = setInterval(ask, FAIL_MODES_EVERY_MS);
    // Like the socket, the refresh never keeps the process alive.
    this.failModesTimer.unref();
  }

  private stopFailModes(): void {
    if (this.failModesTimer) clearInterval(this.failModesTimer);
    this.failModesTimer = null;
  }

  /** A new list replaces the old one whole. */
  private learn(list: FailModeList): void {
    this.failModes = list;
    if (list.truncated && !this.truncationSaid) {
      this.truncationSaid = true;
      this.config.logger?.warn(
        `floodgate: the agent's fail-closed rules fill more than one frame; the first ${list.rules.length} ` +
          `deny while the agent is away, checks touching only later ones answer by fail policy ` +
          `${this.config.fail} (said once)`,
      );
    }
  }

  private scheduleReconnect(): void {
    const { reconnectMinMs: min, reconnectMaxMs: max } = this.config;
    const base = this.backoff === null ? min : Math.min(this.backoff * 2, max);
    this.backoff = base;
    // Equal jitter: between half the delay and the whole of it, so that many processes whose
    // agent restarted do not reconnect in lockstep.
    const delay = base / 2 + Math.random() * (base / 2);
    this.reconnectTimer = setTimeout(() => {
      this.reconnectTimer = null;
      this.open();
    }, delay);
    this.reconnectTimer.unref();
  }

  /** Answers the calls of every complete frame; returns why it dropped the connection, if it did. */
  private readFrames(sock: net.Socket): string | null {
    let pos = 0;
    const buf = this.rbuf;
    while (pos < buf.length) {
      const r = decodeFrame(pos === 0 ? buf : buf.subarray(pos));
      if (r.ok) {
        pos += r.used;
        const { requestId, body } = r.frame;
        if (body.kind === "decision") {
          const p = this.settle(requestId);
          if (p) p.resolve(agentDecision(body.combined, body.items));
        } else if (body.kind === "failModeList") {
          this.learn(body.list);
        } else if (body.kind === "error") {
          const p = this.settle(requestId);
          if (!p) continue; // connection-level (id 0) or a call that already timed out
          if (body.code === ErrorCode.UnknownRule || body.code === ErrorCode.InvalidItem) {
            p.reject(new FloodgateError("agent", `agent refused the check (${body.code}): ${body.message}`, body.code));
          } else {
            // Overload, an internal error, a code from a newer agent: the agent's trouble.
            p.resolve(this.degraded(p.fail, p.check, "unavailable"));
          }
        }
        // Any other kind is not an answer: ignored.
        continue;
      }
      if (r.type === "incomplete") break;
      if (r.type === "rejected") {
        // An answer this SDK cannot read (bad text, another version): its call answers by its
        // fail policy now instead of waiting out its timeout.
        pos += r.frameLen;
        const p = this.settle(r.requestId);
        if (p) p.resolve(this.degraded(p.fail, p.check, "unavailable"));
        this.warn("rejected", `floodgate: unreadable answer from the agent: ${r.reason}`);
        continue;
      }
      this.warn("fatal", `floodgate: the agent sent a broken frame (${r.reason}); reconnecting`);
      sock.destroy();
      return `the agent sent a broken frame: ${r.reason}`;
    }
    this.rbuf = pos >= buf.length ? Buffer.alloc(0) : buf.subarray(pos);
    return null;
  }

  private wake(): void {
    const w = this.readyWaiters;
    this.readyWaiters = [];
    for (const f of w) f();
  }

  private debug(message: string): void {
    this.config.logger?.debug?.(message);
  }

  /** At most one warning a minute of each kind. */
  private warn(kind: string, message: string): void {
    const logger = this.config.logger;
    if (!logger) return;
    const now = Date.now();
    if ((this.lastWarn.get(kind) ?? -Infinity) + 60_000 > now) return;
    this.lastWarn.set(kind, now);
    logger.warn(message);
  }
}

/** Whether every item of a check takes its cost only if the check passes (a consume or a reserve). */
function consumesOnly(check: Check): boolean {
  if (check.form === "items") return check.items.every((i) => takesIfPassed(i.mode ?? "consume"));
  return takesIfPassed(check.attributes.mode ?? "consume");
}

/** Whether a mode takes its cost only if the check passes: a consume (an acquire too) or a reserve. */
function takesIfPassed(mode: ItemMode): boolean {
  switch (mode) {
    case "consume":
    case "reserve":
      return true;
    case "peek":
    case "charge":
    case "release":
    case "commit":
      return false;
  }
}

/** The local limiter's key and cost for a check. */
function localKey(check: Check): [string, number] {
  if (check.form === "items") {
    let k = "";
    let cost = 1;
    for (const i of check.items) {
      k += `${i.ruleId}\u0000${i.key}\u0000`;
      cost = Math.max(cost, i.cost ?? 1);
    }
    return [k, cost];
  }
  let k = "attributes\u0000";
  for (const [, v] of attributeFields(check.attributes)) k += `${v ?? ""}\u0000`;
  return [k, check.attributes.cost ?? 1];
}
