//! A ledger file's lines: a [`Header`] first, then one [`Record`] per decided item, and lines that
//! say how many records were dropped (the queue was full) or that the agent closed the ledger.

use serde::{Deserialize, Serialize};

use crate::rules::Algorithm;

/// A ledger file's first line: who wrote it, and against which store.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Header {
    /// The ledger format's version (1).
    pub ledger: u32,
    /// The agent that wrote it (its id: host and pid).
    pub agent: String,
    /// `shared` (Redis: the limits are the fleet's) or `memory` (the embedded store: one agent's).
    pub store: String,
}

/// One decided item.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Record {
    /// When the check's frame was read, Unix ms by the agent's clock.
    pub recv: u64,
    /// When it was decided, Unix ms by the agent's clock.
    pub done: u64,
    /// How far the store's clock was ahead of the agent's (ms) as the agent had learned it (0 until
    /// a batched flush teaches it; on one host the clocks are one).
    pub off: i64,
    /// The rule's id, version and what it limits.
    pub rule: String,
    /// The rule's version.
    pub ver: u64,
    /// The rule's algorithm.
    pub alg: Algorithm,
    /// The rule's window (a quota's nominal period, a concurrency rule's lease), ms.
    pub window_ms: u64,
    /// The rule's limit.
    pub limit: u64,
    /// A token bucket's burst (its capacity); the limit otherwise.
    pub burst: u64,
    /// Whether the rule enforces (`false`: log mode, never judged).
    pub enforced: bool,
    /// The client key.
    pub key: String,
    /// The item's cost.
    pub cost: u64,
    /// `consume`, `peek`, `charge`, `release`, `reserve`, or `return`: units a commit (or an
    /// expiry) gave back of a reservation, out of the window named by `from`.
    pub mode: String,
    /// Whether the item was admitted (a charge always commits).
    pub allowed: bool,
    /// Where the answer came from: `redis`, `local`, `cache` or `fallback`.
    pub source: String,
    /// Live agents as this agent counted them when it decided (the N of its limit/N fallback).
    #[serde(default = "one")]
    pub n: u64,
    /// A concurrency item's lease id (the client's, or one the agent picked); none for a release by
    /// count and for other rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u64>,
    /// A quota item's period as the agent named it when it decided: its start and end, Unix ms by
    /// the agent's clock (the period the store counted it in, unless the check was read in the one
    /// before); none for other rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<[u64; 2]>,
    /// A `return`'s window: a sliding window's index (the store's clock), a quota period's start;
    /// none for a token bucket, whose tokens come back at the return's time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<u64>,
}

fn one() -> u64 {
    1
}
