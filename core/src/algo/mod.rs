//! The limiting algorithms as pure functions of (state, now): the same maths as the Lua scripts in
//! `lua/`, so the embedded store and Redis give the same answers.

mod concurrency;
mod quota;
mod sliding_window;
mod token_bucket;

pub use concurrency::{
    concurrency_acquire, concurrency_peek, concurrency_release, HeldLease, LeaseSet, MAX_RETRY_MS,
};
pub use quota::{period_bounds, period_from_start, quota, quota_charge, quota_peek, Period};
pub use sliding_window::{sliding_window, sliding_window_charge, sliding_window_peek, WindowState};
pub use token_bucket::{token_bucket, token_bucket_charge, token_bucket_peek, BucketState};

/// The outcome of one item, before it is turned into a wire verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the cost fits.
    pub allowed: bool,
    /// The limit (sliding window) or bucket capacity (token bucket).
    pub limit: u64,
    /// Units left after this request (or now, on a denial).
    pub remaining: u64,
    /// Unix ms at which the key is back to its full limit.
    pub reset_at_ms: u64,
    /// On a denial, ms until this cost could pass (at least 1); 0 when allowed.
    pub retry_after_ms: u64,
}

/// Converts a non-negative float figure to an integer the way Redis converts a Lua number (truncation).
pub(crate) fn to_u64(x: f64) -> u64 {
    if x <= 0.0 {
        0
    } else {
        x as u64
    }
}
