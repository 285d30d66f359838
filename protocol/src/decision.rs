//! What an agent answers a check with, as plain Rust values: a [`Decision`] (each item's
//! [`Verdict`], named by its rule, and where it came from), or an [`ErrorBody`].

use crate::frame::CompactString;
use crate::ErrorCode;

/// Where a verdict came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// An atomic script on the shared Redis state.
    Redis,
    /// The agent's own state: the embedded in-memory store, or local counters of a batched rule.
    Local,
    /// A rejection the agent cached until its reset time.
    Cache,
    /// The store was unavailable and the rule's fail mode (or fallback limiter) decided.
    Fallback,
}

impl Source {
    /// The byte on the wire.
    pub fn to_u8(self) -> u8 {
        match self {
            Source::Redis => 0,
            Source::Local => 1,
            Source::Cache => 2,
            Source::Fallback => 3,
        }
    }

    /// The source for a wire byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Source::Redis,
            1 => Source::Local,
            2 => Source::Cache,
            3 => Source::Fallback,
            _ => return None,
        })
    }

    /// Lower-case name, as used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Redis => "redis",
            Source::Local => "local",
            Source::Cache => "cache",
            Source::Fallback => "fallback",
        }
    }
}

/// The figures of one decision, per item or combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the request may pass.
    pub allowed: bool,
    /// The rule is in `log` mode: this verdict is reported, never enforced.
    pub log_only: bool,
    /// A concurrency rule holds the item's lease (version 3): the client releases it when its
    /// request ends, or it expires at `reset_at_ms`.
    pub holds_lease: bool,
    /// Allowed past the limit of a rule with `overLimit = "flag"` (version 6): the request passes,
    /// counted nowhere, for the caller to route (a cheaper model, a fallback backend).
    pub over_quota: bool,
    /// Where the answer came from.
    pub source: Source,
    /// The rule's limit per window (or bucket capacity).
    pub limit: u64,
    /// Units left after this request.
    pub remaining: u64,
    /// Unix time in milliseconds at which the key is back to its full limit.
    pub reset_at_ms: u64,
    /// On a denial, milliseconds until this request could pass (at least 1); 0 when allowed.
    pub retry_after_ms: u64,
}

/// A decision on one item, named by its rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemDecision {
    /// The rule that decided.
    pub rule_id: CompactString,
    /// Its verdict.
    pub verdict: Verdict,
    /// The rule's window in ms (version 4; 0 from an older peer): a sliding window's or token
    /// bucket's `windowSeconds`, a quota's current period (a day of 23 to 25 hours across a DST
    /// change, a month of 28 to 31 days); 0 for a concurrency rule, which has none. The IETF
    /// `RateLimit-Policy` header's `w`.
    pub window_ms: u64,
}

/// The answer to a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Allowed only if every enforced item is; the figures of the most restrictive item.
    pub combined: Verdict,
    /// One per item (per matched rule for an attribute check), in request order.
    pub items: Vec<ItemDecision>,
}

/// The content of an `Error` frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorBody {
    /// What kind of error.
    pub code: ErrorCode,
    /// A human-readable explanation (at most 1 KiB).
    pub message: String,
}
