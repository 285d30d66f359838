//! Token bucket: capacity `burst`, refilled at `limit / window` tokens per millisecond.

use super::{to_u64, Outcome};

/// The longest a bucket may take to refill (100 years, as `Rule::validate` bounds a bucket's fill):
/// a charge's debt stops there. Mirrored in `lua/token_bucket.lua`.
pub const MAX_FILL_MS: f64 = 100.0 * 31_536_000_000.0;

/// A key's state: tokens in the bucket at `ts_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BucketState {
    /// Tokens (fractional) at `ts_ms`.
    pub tokens: f64,
    /// When `tokens` was computed, Unix ms.
    pub ts_ms: u64,
}

/// Checks `cost` at `now_ms`, mirroring `lua/token_bucket.lua`. Returns the outcome, the state to store
/// if committed, and when that state expires (the bucket would be full again).
pub fn token_bucket(
    state: Option<BucketState>,
    limit: u64,
    window_ms: u64,
    burst: u64,
    cost: u64,
    now_ms: u64,
) -> (Outcome, BucketState, u64) {
    let rate = limit as f64 / window_ms as f64;
    let burst_f = burst as f64;
    let cost_f = cost as f64;
    let mut tokens = tokens_at(state, rate, burst_f, now_ms);
    let allowed = tokens >= cost_f;
    let mut retry = 0;
    if allowed {
        tokens -= cost_f;
    } else {
        retry = if cost > burst {
            window_ms
        } else {
            to_u64(((cost_f - tokens) / rate).ceil())
        }
        .max(1);
    }
    let reset = now_ms.saturating_add(to_u64(((burst_f - tokens) / rate).ceil()));
    let outcome = Outcome {
        allowed,
        limit: burst,
        remaining: to_u64(tokens.floor()),
        reset_at_ms: reset,
        retry_after_ms: retry,
    };
    (
        outcome,
        BucketState {
            tokens,
            ts_ms: now_ms,
        },
        reset.saturating_add(1),
    )
}

/// What `cost` would do now, changing nothing (a peek), mirroring `lua/token_bucket.lua`'s
/// `token_bucket_peek`: allowed if it would pass; `remaining` is the tokens now; `reset_at_ms` when
/// the bucket is full; on a denial, when `cost` could pass.
pub fn token_bucket_peek(
    state: Option<BucketState>,
    limit: u64,
    window_ms: u64,
    burst: u64,
    cost: u64,
    now_ms: u64,
) -> Outcome {
    let (o, _, _) = token_bucket(state, limit, window_ms, burst, cost, now_ms);
    if !o.allowed {
        return o;
    }
    let rate = limit as f64 / window_ms as f64;
    let tokens = tokens_at(state, rate, burst as f64, now_ms);
    Outcome {
        allowed: true,
        limit: burst,
        remaining: to_u64(tokens.floor()),
        reset_at_ms: now_ms.saturating_add(to_u64(((burst as f64 - tokens) / rate).ceil())),
        retry_after_ms: 0,
    }
}

/// Takes `cost` whatever is left (a charge), mirroring `token_bucket_charge`: the bucket may go
/// below zero, a debt refilled before anything else passes. `allowed` says whether the bucket is
/// still not in debt (a charge is committed either way); `remaining` floored at 0.
pub fn token_bucket_charge(
    state: Option<BucketState>,
    limit: u64,
    window_ms: u64,
    burst: u64,
    cost: u64,
    now_ms: u64,
) -> (Outcome, BucketState, u64) {
    let rate = limit as f64 / window_ms as f64;
    // The debt is capped where the bucket would take MAX_FILL_MS to refill: its reset and expiry
    // stay times Redis can hold (PEXPIREAT refuses a number Lua prints in exponent form).
    let floor = burst as f64 - MAX_FILL_MS * rate;
    let tokens = (tokens_at(state, rate, burst as f64, now_ms) - cost as f64).max(floor);
    let reset = now_ms.saturating_add(to_u64(((burst as f64 - tokens) / rate).ceil()));
    let within = tokens >= 0.0;
    let outcome = Outcome {
        allowed: within,
        limit: burst,
        remaining: to_u64(tokens.floor()),
        reset_at_ms: reset,
        // In debt: when one unit could pass again.
        retry_after_ms: if within {
            0
        } else {
            to_u64(((1.0 - tokens) / rate).ceil()).max(1)
        },
    };
    (
        outcome,
        BucketState {
            tokens,
            ts_ms: now_ms,
        },
        reset.saturating_add(1),
    )
}

/// The tokens in the bucket at `now_ms`.
fn tokens_at(state: Option<BucketState>, rate: f64, burst: f64, now_ms: u64) -> f64 {
    match state {
        None => burst,
        Some(s) if now_ms > s.ts_ms => (s.tokens + (now_ms - s.ts_ms) as f64 * rate).min(burst),
        Some(s) => s.tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(s: &mut Option<BucketState>, limit: u64, window: u64, burst: u64, cost: u64, now: u64) -> Outcome {
        let (o, next, _) = token_bucket(*s, limit, window, burst, cost, now);
        if o.allowed {
            *s = Some(next);
        }
        o
    }

    #[test]
    fn burst_then_refill() {
        // 100 per minute with a burst of 20: 20 at once, then one every 600 ms.
        let mut s = None;
        let t0 = 1_700_000_000_000;
        for i in 0..20 {
            let o = run(&mut s, 100, 60_000, 20, 1, t0);
            assert!(o.allowed, "burst request {i}");
            assert_eq!(o.remaining, 19 - i);
        }
        let o = run(&mut s, 100, 60_000, 20, 1, t0);
        assert!(!o.allowed);
        assert_eq!(o.retry_after_ms, 600);
        assert_eq!(o.reset_at_ms, t0 + 12_000);
        assert!(!run(&mut s, 100, 60_000, 20, 1, t0 + 599).allowed);
        assert!(run(&mut s, 100, 60_000, 20, 1, t0 + 600).allowed);
    }

    #[test]
    fn cost_over_burst_never_passes() {
        let o = run(&mut None, 10, 1_000, 5, 6, 1_000);
        assert!(!o.allowed);
        assert_eq!(o.retry_after_ms, 1_000);
    }

    proptest! {
        /// Over any sequence, admitted units never exceed burst + rate × elapsed time.
        #[test]
        fn never_admits_more_than_burst_plus_refill(
            limit in 1u64..1000, burst in 1u64..200,
            steps in proptest::collection::vec((0u64..500, 1u64..5), 1..300),
        ) {
            let window = 10_000;
            let mut s = None;
            let mut now = 1_700_000_000_000u64;
            let t0 = now;
            let mut admitted = 0u64;
            for (dt, cost) in steps {
                now += dt;
                if run(&mut s, limit, window, burst, cost, now).allowed {
                    admitted += cost;
                }
                let bound = burst as f64 + (now - t0) as f64 * limit as f64 / window as f64;
                prop_assert!(admitted as f64 <= bound + 1e-6, "admitted {} > bound {}", admitted, bound);
            }
        }
    }
}
