/**
 * Version 2's fail-mode list (`protocol/PROTOCOL.md`, "Version 2"): the rules that deny while the
 * agent is away, and whether a check touches one of them, matched as the agent matches rules.
 */

import type { Attributes, Check } from "./protocol";

/** The attribute a listed rule's keys are built from; `descriptor` never matches an attribute check. */
export type ListedDimension = "user" | "apiKey" | "ip" | "descriptor";

/** One enforced rule with `failMode = "closed"`: what it takes to tell whether a check touches it. */
export interface ClosedRule {
  /** The rule id items name. */
  ruleId: string;
  /** The attribute its keys are built from. */
  dimension: ListedDimension;
  /** Its endpoint pattern; `""`: every endpoint. */
  endpoint: string;
  /** Its tier; `""`: every tier. */
  tier: string;
  /** Its limit (token bucket: its capacity), for `X-RateLimit-Limit`. */
  limit: number;
}

/** A FailModeList frame's body: every enforced fail-closed rule, in rule-set order. */
export interface FailModeList {
  /** The agent's rule set version (0 for a rules file). */
  rulesVersion: number;
  /** More rules than one frame holds: `rules` is a prefix of the list. */
  truncated: boolean;
  /** The rules. */
  rules: ClosedRule[];
}

/**
 * Whether `endpoint` matches a rule's endpoint `pattern`, as the agent matches it: a pattern without
 * `*` matches only itself; otherwise both are split at `/` and compared segment by segment, a `*`
 * segment matching any one segment, and a `*` as the last segment matching that segment and
 * everything after it (`/api/*` matches `/api/a/b`, not `/api`).
 */
export function endpointMatches(pattern: string, endpoint: string): boolean {
  if (!pattern.includes("*")) return pattern === endpoint;
  const want = pattern.split("/");
  const have = endpoint.split("/");
  for (let i = 0; i < want.length; i++) {
    if (i >= have.length) return false;
    if (want[i] === "*") {
      if (i === want.length - 1) return true;
    } else if (want[i] !== have[i]) {
      return false;
    }
  }
  return have.length === want.length;
}

/** An attribute as the wire carries it: absent, null and `""` are all absent. */
function present(v: string | null | undefined): v is string {
  return v !== undefined && v !== null && v !== "";
}

function carried(rule: ClosedRule, a: Attributes): string | null | undefined {
  switch (rule.dimension) {
    case "user":
      return a.user;
    case "apiKey":
      return a.apiKey;
    case "ip":
      return a.ip;
    case "descriptor":
      return undefined;
  }
}

/**
 * Whether the agent would check `check` against `rule`: an item names it, or the attributes carry
 * its dimension and match its tier and endpoint pattern (an empty one matching everything).
 */
export function touches(rule: ClosedRule, check: Check): boolean {
  if (check.form === "items") return check.items.some((i) => i.ruleId === rule.ruleId);
  const a = check.attributes;
  if (!present(carried(rule, a))) return false;
  if (rule.tier !== "" && a.tier !== rule.tier) return false;
  return rule.endpoint === "" || (present(a.endpoint) && endpointMatches(rule.endpoint, a.endpoint));
}

/** The first listed rule `check` touches, if any: such a check is denied while the agent is away. */
export function closing(list: FailModeList, check: Check): ClosedRule | undefined {
  return list.rules.find((r) => touches(r, check));
}
