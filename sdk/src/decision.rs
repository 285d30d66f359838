//! A decision as the SDK returns it, with where it came from.

use floodgate_protocol::{ItemDecision, Source};

/// Why the SDK answered by itself instead of the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degraded {
    /// No connection to the agent (down, restarting, socket missing).
    Unavailable,
    /// The agent did not answer within the call's timeout.
    Timeout,
}

/// Who decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The agent, from this source.
    Agent(Source),
    /// The SDK's fail policy: allowed because the agent could not answer.
    FailOpen(Degraded),
    /// The SDK's fail policy: denied because the agent could not answer.
    FailClosed(Degraded),
    /// The SDK's per-process fallback limit decided (allowed or not) because the agent could not.
    LocalLimit(Degraded),
}

/// The answer to a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may pass.
    pub allowed: bool,
    /// The binding rule's limit (0 when no rule applied or the SDK decided alone, except under a
    /// rule the agent listed as fail-closed: that rule's limit).
    pub limit: u64,
    /// Units left under the binding rule.
    pub remaining: u64,
    /// Unix ms at which the binding key is back to its full limit.
    pub reset_at_ms: u64,
    /// On a denial, milliseconds until retrying can succeed; always set when `allowed` is false.
    pub retry_after_ms: Option<u64>,
    /// Who decided.
    pub origin: Origin,
    /// Per-rule verdicts from the agent (empty when the SDK decided alone, except under a rule the
    /// agent listed as fail-closed: that rule's verdict, source fallback).
    pub items: Vec<ItemDecision>,
}

impl Decision {
    /// Whether the request passes past the limit of a rule with `overLimit = "flag"` (quota mode,
    /// protocol version 6): allowed, counted nowhere, for the caller to route elsewhere.
    pub fn over_quota(&self) -> bool {
        self.items.iter().any(|i| i.verdict.over_quota)
    }

    /// The ids of the rules whose limit the request passes in quota mode.
    pub fn over_quota_rules(&self) -> Vec<String> {
        self.items
            .iter()
            .filter(|i| i.verdict.over_quota)
            .map(|i| i.rule_id.to_string())
            .collect()
    }

    pub(crate) fn from_agent(d: floodgate_protocol::Decision) -> Self {
        let c = d.combined;
        Decision {
            allowed: c.allowed,
            limit: c.limit,
            remaining: c.remaining,
            reset_at_ms: c.reset_at_ms,
            retry_after_ms: (!c.allowed).then_some(c.retry_after_ms.max(1)),
            origin: Origin::Agent(c.source),
            items: d.items,
        }
    }

    pub(crate) fn degraded(allow: bool, why: Degraded, retry_after_ms: u64, now_ms: u64) -> Self {
        Decision {
            allowed: allow,
            limit: 0,
            remaining: 0,
            reset_at_ms: if allow { now_ms } else { now_ms + retry_after_ms },
            retry_after_ms: (!allow).then_some(retry_after_ms.max(1)),
            origin: if allow {
                Origin::FailOpen(why)
            } else {
                Origin::FailClosed(why)
            },
            items: Vec::new(),
        }
    }

    /// The same answer as that rule's verdict (a fail-closed rule the agent listed), so headers name
    /// the rule and its limit.
    pub(crate) fn under_rule(mut self, rule_id: &str, limit: u64) -> Self {
        self.limit = limit;
        self.items = vec![ItemDecision {
            rule_id: rule_id.into(),
            verdict: floodgate_protocol::Verdict {
                allowed: self.allowed,
                log_only: false,
                holds_lease: false,
                over_quota: false,
                source: Source::Fallback,
                limit,
                remaining: self.remaining,
                reset_at_ms: self.reset_at_ms,
                retry_after_ms: self.retry_after_ms.unwrap_or(0),
            },
            window_ms: 0,
        }];
        self
    }

    pub(crate) fn local(
        allowed: bool,
        why: Degraded,
        limit: u64,
        remaining: u64,
        retry_after_ms: u64,
        now_ms: u64,
    ) -> Self {
        Decision {
            allowed,
            limit,
            remaining,
            reset_at_ms: now_ms + retry_after_ms,
            retry_after_ms: (!allowed).then_some(retry_after_ms.max(1)),
            origin: Origin::LocalLimit(why),
            items: Vec::new(),
        }
    }

    /// Whether the agent decided (not the SDK's fail policy).
    pub fn from_agent_answer(&self) -> bool {
        matches!(self.origin, Origin::Agent(_))
    }
}
