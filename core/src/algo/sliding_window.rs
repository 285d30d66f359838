//! Sliding-window counter: estimate = previous × (1 − elapsed fraction of the window) + current.

use super::{to_u64, Outcome};

/// A key's state: which window `cur` counts, and the counts of that window and the one before.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WindowState {
    /// Index of the window `cur` belongs to (`now_ms / window_ms`).
    pub window: u64,
    /// Units admitted in that window.
    pub cur: u64,
    /// Units admitted in the window before it.
    pub prev: u64,
}

/// Checks `cost` against `limit` per `window_ms` at `now_ms`, mirroring `lua/sliding_window.lua`.
///
/// Returns the outcome and the state to store if the cost is committed (the caller decides whether to
/// commit: a multi-item check commits only if every enforced item passes). `state` is `None` for a key
/// never seen (or expired).
pub fn sliding_window(
    state: Option<WindowState>,
    limit: u64,
    window_ms: u64,
    cost: u64,
    now_ms: u64,
) -> (Outcome, WindowState, u64) {
    let idx = now_ms / window_ms;
    let (cur, prev) = counts(state, idx);
    let (limit_f, window_f, cost_f, now_f) = (limit as f64, window_ms as f64, cost as f64, now_ms as f64);
    let (cur_f, prev_f) = (cur as f64, prev as f64);
    let start = idx * window_ms;
    let start_f = start as f64;
    let elapsed = (now_f - start_f) / window_f;
    let estimate = prev_f * (1.0 - elapsed) + cur_f;
    let allowed = estimate + cost_f <= limit_f;
    let expire_at = start + 2 * window_ms;
    let outcome = if allowed {
        Outcome {
            allowed,
            limit,
            remaining: to_u64((limit_f - estimate - cost_f).floor()),
            reset_at_ms: expire_at,
            retry_after_ms: 0,
        }
    } else {
        let retry = if cost > limit {
            window_f
        } else if cur + cost <= limit {
            // Still this window: wait until the previous window's weight has decayed enough.
            let frac = 1.0 - (limit_f - cur_f - cost_f) / prev_f;
            (start_f + frac * window_f - now_f).ceil()
        } else {
            // Next window: the current count becomes the previous one and decays from there.
            let frac = (1.0 - (limit_f - cost_f) / cur_f).max(0.0);
            (start_f + window_f + frac * window_f - now_f).ceil()
        };
        let reset_at_ms = if cur > 0 {
            expire_at
        } else if prev > 0 {
            start + window_ms
        } else {
            now_ms
        };
        Outcome {
            allowed,
            limit,
            remaining: to_u64((limit_f - estimate).floor()),
            reset_at_ms,
            retry_after_ms: to_u64(retry).max(1),
        }
    };
    let next = WindowState {
        window: idx,
        cur: cur + cost,
        prev,
    };
    (outcome, next, expire_at)
}

/// What `cost` would do now, changing nothing (a peek), mirroring `lua/sliding_window.lua`'s
/// `sliding_window_peek`: allowed if it would pass; `remaining` is what is left now, before any cost;
/// `reset_at_ms` when the counts weighing now are gone; on a denial, when `cost` could pass.
pub fn sliding_window_peek(
    state: Option<WindowState>,
    limit: u64,
    window_ms: u64,
    cost: u64,
    now_ms: u64,
) -> Outcome {
    let (o, _, _) = sliding_window(state, limit, window_ms, cost, now_ms);
    if !o.allowed {
        // A denial already reports what is left now and when the counts are gone.
        return o;
    }
    let idx = now_ms / window_ms;
    let (cur, prev) = counts(state, idx);
    let start = idx * window_ms;
    let estimate = prev as f64 * (1.0 - (now_ms as f64 - start as f64) / window_ms as f64) + cur as f64;
    let reset_at_ms = if cur > 0 {
        start + 2 * window_ms
    } else if prev > 0 {
        start + window_ms
    } else {
        now_ms
    };
    Outcome {
        allowed: true,
        limit,
        remaining: to_u64((limit as f64 - estimate).floor()),
        reset_at_ms,
        retry_after_ms: 0,
    }
}

/// Counts `cost` whatever the limit says (a charge), mirroring `sliding_window_charge`: the state
/// after it, `allowed` whether the key is still within its limit (a charge is committed either way
/// and never decides a check), `remaining` floored at 0. Returns the outcome, the state to store and
/// when it expires.
pub fn sliding_window_charge(
    state: Option<WindowState>,
    limit: u64,
    window_ms: u64,
    cost: u64,
    now_ms: u64,
) -> (Outcome, WindowState, u64) {
    let idx = now_ms / window_ms;
    let (cur, prev) = counts(state, idx);
    let start = idx * window_ms;
    let cur = cur + cost;
    let estimate = prev as f64 * (1.0 - (now_ms as f64 - start as f64) / window_ms as f64) + cur as f64;
    let expire_at = start + 2 * window_ms;
    let next = WindowState {
        window: idx,
        cur,
        prev,
    };
    let within = estimate <= limit as f64;
    // Past the limit: when one unit could pass again.
    let retry_after_ms = if within {
        0
    } else {
        sliding_window_peek(Some(next), limit, window_ms, 1, now_ms)
            .retry_after_ms
            .max(1)
    };
    let outcome = Outcome {
        allowed: within,
        limit,
        remaining: to_u64((limit as f64 - estimate).floor()),
        reset_at_ms: expire_at,
        retry_after_ms,
    };
    (outcome, next, expire_at)
}

/// The current and previous windows' counts at window `idx`.
fn counts(state: Option<WindowState>, idx: u64) -> (u64, u64) {
    match state {
        None => (0, 0),
        Some(s) if s.window == idx => (s.cur, s.prev),
        Some(s) if s.window + 1 == idx => (0, s.cur),
        Some(_) => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const W: u64 = 60_000;

    fn run(state: &mut Option<WindowState>, limit: u64, cost: u64, now: u64) -> Outcome {
        let (o, next, _) = sliding_window(*state, limit, W, cost, now);
        if o.allowed {
            *state = Some(next);
        }
        o
    }

    #[test]
    fn admits_up_to_the_limit_then_denies_with_figures() {
        let mut s = None;
        let t0 = 1_000 * W; // the start of a window
        for i in 0..10 {
            let o = run(&mut s, 10, 1, t0 + i);
            assert!(o.allowed, "request {i}");
            assert_eq!(o.remaining, 9 - i);
            assert_eq!(o.reset_at_ms, t0 + 2 * W);
        }
        let o = run(&mut s, 10, 1, t0 + 10);
        assert!(!o.allowed);
        assert_eq!(o.remaining, 0);
        // 10 in this window, none before: the next window starts with prev = 10 at weight 1, which
        // must decay to 9 → 10% into the next window.
        assert_eq!(o.retry_after_ms, W - 10 + W / 10);
    }

    #[test]
    fn previous_window_decays_linearly() {
        let mut s = None;
        let t0 = 1_000 * W;
        for _ in 0..100 {
            assert!(run(&mut s, 100, 1, t0).allowed);
        }
        // A quarter into the next window: estimate = 100 × 0.75 = 75, so 25 more fit.
        let t1 = t0 + W + W / 4;
        for i in 0..25 {
            assert!(run(&mut s, 100, 1, t1).allowed, "request {i}");
        }
        let o = run(&mut s, 100, 1, t1);
        assert!(!o.allowed);
        // cur = 25: one more unit needs prev × (1 − f) ≤ 74 → f ≥ 0.26 → 0.01 × W later.
        assert_eq!(o.retry_after_ms, W / 100);
    }

    #[test]
    fn cost_over_limit_never_passes_and_says_so() {
        let o = run(&mut None, 5, 6, 1_000 * W);
        assert!(!o.allowed);
        assert_eq!(o.retry_after_ms, W);
    }

    #[test]
    fn an_old_state_is_forgotten() {
        let mut s = Some(WindowState {
            window: 10,
            cur: 100,
            prev: 100,
        });
        assert!(run(&mut s, 100, 100, 13 * W).allowed);
    }

    proptest! {
        /// Over any two consecutive windows the admitted total never reaches 2× the limit, and over
        /// any one window-length span the sliding estimate keeps admissions within the limit plus the
        /// decaying share of the previous window.
        #[test]
        fn no_double_burst_at_edges(limit in 1u64..500, offsets in proptest::collection::vec(0u64..2 * W, 1..400)) {
            let mut s = None;
            let mut offsets = offsets;
            offsets.sort_unstable();
            let t0 = 1_000 * W;
            let mut admitted = Vec::new();
            for off in offsets {
                if run(&mut s, limit, 1, t0 + off).allowed {
                    admitted.push(off);
                }
            }
            // Any span of one window length admits at most 2× limit − 1; the estimate bounds the
            // end-of-window plus start-of-window burst to limit × (1 + elapsed share) in practice.
            for &a in &admitted {
                let in_span = admitted.iter().filter(|&&b| b >= a && b < a + W).count() as u64;
                prop_assert!(in_span < 2 * limit, "{} admitted in one window span, limit {}", in_span, limit);
            }
            let first = admitted.iter().filter(|&&b| b < W).count() as u64;
            prop_assert!(first <= limit);
        }

        /// Keys are isolated: a key's answers do not depend on another key's traffic.
        #[test]
        fn remaining_never_exceeds_limit(limit in 1u64..1000, cost in 1u64..50, now in 0u64..10_000_000) {
            let (o, _, _) = sliding_window(None, limit, W, cost, now);
            prop_assert!(o.remaining <= limit);
            prop_assert_eq!(o.allowed, cost <= limit);
        }
    }
}
