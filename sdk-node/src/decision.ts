/** A decision as the SDK returns it, with who decided. */

import type { ClosedRule } from "./fail-modes";
import type { ItemDecision, Source, Verdict } from "./protocol";

/** Why the SDK answered by itself instead of the agent. */
export type Degraded =
  /** No connection to the agent (down, restarting, socket missing), or the agent could not answer. */
  | "unavailable"
  /** The agent did not answer within the call's timeout. */
  | "timeout";

/** Who decided. */
export type Origin =
  /** The agent, from this source. */
  | { kind: "agent"; source: Source }
  /** The SDK's fail policy: allowed because the agent could not answer. */
  | { kind: "failOpen"; reason: Degraded }
  /** Denied because the agent could not answer: a fail-closed rule of the agent's, or the fail policy. */
  | { kind: "failClosed"; reason: Degraded }
  /** The SDK's per-process fallback limit decided (allowed or not) because the agent could not. */
  | { kind: "localLimit"; reason: Degraded };

/** The answer to a check. */
export interface Decision {
  /** Whether the request may pass. */
  allowed: boolean;
  /** The binding rule's limit (0 when no rule applied or the SDK's fail policy decided). */
  limit: number;
  /** Units left under the binding rule. */
  remaining: number;
  /** Unix ms at which the binding key is back to its full limit. */
  resetAtMs: number;
  /** On a denial, ms until retrying can succeed (at least 1); always set when `allowed` is false. */
  retryAfterMs?: number;
  /** Who decided. */
  origin: Origin;
  /**
   * The agent's source of the combined verdict; `fallback` when a fail-closed rule denied while the
   * agent was away; undefined when the SDK's fail policy or fallback limit decided.
   */
  source?: Source;
  /** The combined verdict carries the log-only flag: every item is in log mode (never enforced). */
  logOnly: boolean;
  /**
   * Quota mode (protocol version 6): the request is past the limit of a rule with
   * `overLimit = "flag"` (some item's verdict is over quota), let through all the same and counted
   * nowhere on that rule, for the caller to route elsewhere (a cheaper model, a fallback backend).
   * False from an older agent and whenever the SDK decided alone.
   */
  overQuota: boolean;
  /** The ids of the rules whose limit the request is past in quota mode; empty when none. */
  overQuotaRules: string[];
  /**
   * Per-rule verdicts from the agent; the fail-closed rule that denied while the agent was away;
   * empty when the SDK's fail policy or fallback limit decided.
   */
  items: ItemDecision[];
}

/** Whether the agent decided (not the SDK's fail policy or fallback limit). */
export function fromAgent(d: Decision): boolean {
  return d.origin.kind === "agent";
}

/** @internal A decision from the agent's combined verdict and items. */
export function agentDecision(
  combined: import("./protocol").Verdict,
  items: ItemDecision[],
): Decision {
  const overQuotaRules = items.filter((i) => i.verdict.overQuota).map((i) => i.ruleId);
  return {
    allowed: combined.allowed,
    limit: combined.limit,
    remaining: combined.remaining,
    resetAtMs: combined.resetAtMs,
    retryAfterMs: combined.allowed ? undefined : Math.max(1, combined.retryAfterMs),
    origin: { kind: "agent", source: combined.source },
    source: combined.source,
    logOnly: combined.logOnly,
    overQuota: overQuotaRules.length > 0,
    overQuotaRules,
    items,
  };
}

/** @internal The fail policy's answer. */
export function degradedDecision(allow: boolean, why: Degraded, retryAfterMs: number, nowMs: number): Decision {
  return {
    allowed: allow,
    limit: 0,
    remaining: 0,
    resetAtMs: allow ? nowMs : nowMs + retryAfterMs,
    retryAfterMs: allow ? undefined : Math.max(1, retryAfterMs),
    origin: allow ? { kind: "failOpen", reason: why } : { kind: "failClosed", reason: why },
    logOnly: false,
    overQuota: false,
    overQuotaRules: [],
    items: [],
  };
}

/**
 * @internal A fail-closed rule's answer while the agent is away (PROTOCOL.md, "Version 2"): denied,
 * source fallback, the rule's limit, nothing remaining, retry after the client's fail-closed
 * Retry-After. The rule is its one item, so the middleware's headers name its figures.
 */
export function closedRuleDecision(rule: ClosedRule, why: Degraded, retryAfterMs: number, nowMs: number): Decision {
  const verdict: Verdict = {
    allowed: false,
    logOnly: false,
    holdsLease: false,
    overQuota: false,
    source: "fallback",
    limit: rule.limit,
    remaining: 0,
    resetAtMs: nowMs + retryAfterMs,
    retryAfterMs: Math.max(1, retryAfterMs),
  };
  return {
    allowed: false,
    limit: verdict.limit,
    remaining: 0,
    resetAtMs: verdict.resetAtMs,
    retryAfterMs: verdict.retryAfterMs,
    origin: { kind: "failClosed", reason: why },
    source: "fallback",
    logOnly: false,
    overQuota: false,
    overQuotaRules: [],
    // The fail-mode list names no window: the headers' RateLimit-Policy carries none (no `w=`).
    items: [{ ruleId: rule.ruleId, verdict, windowMs: 0 }],
  };
}

/** @internal The per-process fallback limit's answer. */
export function localDecision(
  allowed: boolean,
  why: Degraded,
  limit: number,
  remaining: number,
  retryAfterMs: number,
  nowMs: number,
): Decision {
  return {
    allowed,
    limit,
    remaining,
    resetAtMs: nowMs + retryAfterMs,
    retryAfterMs: allowed ? undefined : Math.max(1, retryAfterMs),
    origin: { kind: "localLimit", reason: why },
    logOnly: false,
    overQuota: false,
    overQuotaRules: [],
    items: [],
  };
}
