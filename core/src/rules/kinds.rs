//! What a rule is made of: the dimension it counts by, its algorithm, modes and execution, and what
//! requests it matches (attributes, Envoy descriptors).

use serde::{Deserialize, Serialize};

/// Which request attribute a rule counts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    /// The user id.
    User,
    /// The API key.
    ApiKey,
    /// The client IP.
    Ip,
    /// The caller builds the key (Envoy descriptors, or item checks that name the rule): an
    /// attribute check never matches such a rule.
    Descriptor,
}

impl Dimension {
    /// The prefix of keys built from this dimension, e.g. `user` in `user:123`.
    pub fn key_prefix(self) -> &'static str {
        match self {
            Dimension::User => "user",
            Dimension::ApiKey => "apikey",
            Dimension::Ip => "ip",
            Dimension::Descriptor => "descriptor",
        }
    }
}

/// The limiting algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Sliding-window counter (the default): no 2× burst at window edges.
    #[default]
    SlidingWindow,
    /// Token bucket: bursts up to `burst`, refilled at `limit / window`.
    TokenBucket,
    /// Units in flight: at most `limit` units held at once per key, each under a lease that its
    /// holder releases, or that runs out after `leaseSeconds`.
    Concurrency,
    /// A calendar quota: exactly `limit` per `period` (day, week, month, year) in `timezone`, back
    /// to zero at the period's boundary.
    Quota,
}

impl Algorithm {
    /// Whether its limit is per window of `windowSeconds` (a rate): sliding window and token bucket;
    /// a concurrency rule holds units, a quota counts per calendar period.
    pub fn has_window(self) -> bool {
        match self {
            Algorithm::SlidingWindow | Algorithm::TokenBucket => true,
            Algorithm::Concurrency | Algorithm::Quota => false,
        }
    }

    /// Whether `burst` applies (a token bucket's capacity).
    pub fn has_burst(self) -> bool {
        match self {
            Algorithm::TokenBucket => true,
            Algorithm::SlidingWindow | Algorithm::Concurrency | Algorithm::Quota => false,
        }
    }

    /// Whether it can run batched (local counters flushed to Redis): the sliding window only, whose
    /// counts add up across agents.
    pub fn batches(self) -> bool {
        match self {
            Algorithm::SlidingWindow => true,
            Algorithm::TokenBucket | Algorithm::Concurrency | Algorithm::Quota => false,
        }
    }
}

/// Whether a rule rejects or only reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Rejections are enforced.
    #[default]
    Enforce,
    /// Dry run: decisions are computed and reported, never enforced.
    Log,
}

/// What a rule does when its store is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// Allow (the default: a limiter outage must not become an API outage).
    #[default]
    Open,
    /// Reject with a Retry-After (login, OTP verification).
    Closed,
}

/// What an Envoy request past a rule's limit does to its counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OverLimit {
    /// Counts nothing (the default): a rejected request consumes nothing.
    #[default]
    Deny,
    /// Counts it anyway, as envoyproxy/ratelimit does: over the gRPC path each descriptor's cost is
    /// charged (answered OVER_LIMIT once past the limit), so `apply_on_stream_done` reports of a
    /// cost known after the response are counted even past the limit.
    Charge,
    /// Quota mode, on every path: a request past the limit is allowed, counts nothing, and is
    /// flagged `over_quota` (a header from the middleware, Envoy dynamic metadata) for the caller
    /// to route to a cheaper model or a fallback backend. Its denials never refuse a check.
    Flag,
}

/// What an uncommitted reservation leaves counted when it expires (its holder died, or never
/// committed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReservationExpiry {
    /// Its reserved units stay counted (the default): a holder that died is assumed to have used
    /// them, so the budget is never passed for it.
    #[default]
    Charge,
    /// Its reserved units go back: a late commit then charges what it used in full.
    Release,
}

/// Where a rule's counting happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Execution {
    /// One atomic script per check: exact, one Redis round trip. For low limits (login, OTP).
    #[default]
    Sync,
    /// Counted by each agent from its local view and flushed to Redis every flush interval, learning
    /// the global totals back: 10-100× fewer Redis calls, over-admission bounded by the agents'
    /// shares. Sliding window only (a token-bucket rule runs sync).
    Batched,
    /// Batched when the expected error (agents × interval × rate) stays within the accuracy target,
    /// else sync; decided per check, as the live-agent count and the flush interval change.
    Auto,
}

/// Which requests a rule applies to, for attribute checks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// Endpoint pattern: exact (`/search`), or a prefix ending in `*` (`/api/*`). None matches all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Client tier. None matches all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
}

/// The Envoy rate-limit descriptors a `descriptor` rule answers: requests of `domain` whose
/// descriptor entries walk this path (envoyproxy/ratelimit's configuration tree, one leaf per rule).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyMatch {
    /// The `domain` of the ShouldRateLimit request.
    pub domain: String,
    /// The entries, outermost first.
    pub descriptors: Vec<EnvoyEntry>,
    /// Answered OK without a limit and never counted (envoyproxy/ratelimit's `unlimited`, or a
    /// descriptor listed without a rate_limit: a value exempt from a sibling's limit). The rule's
    /// own limit is then unused; the import writes the largest one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unlimited: bool,
    /// A request's descriptor may bring its own limit (Envoy's `RateLimitOverride`,
    /// `requests_per_unit` per `unit`), which then replaces the rule's for that request, as
    /// envoyproxy/ratelimit honours it. Off by default: the operator's rule decides.
    #[serde(default, rename = "limitOverride", skip_serializing_if = "std::ops::Not::not")]
    pub limit_override: bool,
}

/// One step of an [`EnvoyMatch`] path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyEntry {
    /// The descriptor entry's key.
    pub key: String,
    /// Its value: exact, or a prefix ending in `*`; absent matches any value, each value counted apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// Most entries in one [`EnvoyMatch`] path.
pub const MAX_ENVOY_DEPTH: usize = 8;

impl EnvoyMatch {
    /// Checks the domain and every entry: non-empty, bounded, no control characters.
    pub fn validate(&self) -> Result<(), String> {
        let text = |what: &str, s: &str, max: usize| {
            if s.is_empty() || s.len() > max || s.chars().any(char::is_control) {
                Err(format!(
                    "envoy {what} {s:?} must be 1 to {max} bytes without control characters"
                ))
            } else {
                Ok(())
            }
        };
        text("domain", &self.domain, 128)?;
        if self.descriptors.is_empty() || self.descriptors.len() > MAX_ENVOY_DEPTH {
            return Err(format!(
                "envoy descriptors must have 1 to {MAX_ENVOY_DEPTH} entries, not {}",
                self.descriptors.len()
            ));
        }
        for e in &self.descriptors {
            text("descriptor key", &e.key, 128)?;
            if let Some(v) = &e.value {
                text("descriptor value", v, 256)?;
            }
        }
        Ok(())
    }

    /// The path as envoyproxy/ratelimit names it: `domain.key1_value1.key2`.
    pub fn path(&self) -> String {
        let mut p = self.domain.clone();
        for e in &self.descriptors {
            p.push('.');
            p.push_str(&e.key);
            if let Some(v) = &e.value {
                p.push('_');
                p.push_str(v);
            }
        }
        p
    }
}
