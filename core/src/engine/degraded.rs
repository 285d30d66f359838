//! When a call group cannot reach its shard (breaker open, error, timeout, shed): the store error
//! counted and logged, and the items answered by their rules' fail modes, fail-open rules through
//! the limit/N fallback.

use std::sync::atomic::Ordering;

use floodgate_protocol::Source;

use super::{Engine, Store, FAIL_CLOSED_RETRY_MS};
use crate::algo::Outcome;
use crate::guard::Guard;
use crate::rules::{FailMode, Rule};
use crate::store::{Planned, StoreError};

impl Engine {
    /// A check's store call that failed (or was shed): counted, its kind's metric, and a log line
    /// at most once a second.
    pub(super) fn note_store_error(&self, e: &StoreError) {
        self.store_errors.fetch_add(1, Ordering::Relaxed);
        match e {
            StoreError::Shed => {
                self.shed.fetch_add(1, Ordering::Relaxed);
                crate::metrics::shed();
            }
            StoreError::Script(_) => crate::metrics::script_errors("check", 1),
            _ => {}
        }
        let now = self.clock.now_ms();
        // At most one log line per second: a store outage at 100K checks/s must not flood the logs.
        let last = self.last_error_log_ms.load(Ordering::Relaxed);
        if now >= last + 1_000
            && self
                .last_error_log_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            match e {
                StoreError::Shed => tracing::warn!(shed = self.shed.load(Ordering::Relaxed), "the agent is past its capacity toward the store: shedding checks to their rules' fail modes"),
                StoreError::Script(_) => {
                    tracing::warn!(error = %e, total = self.store_errors(), "Redis refused a check's script (the shard still answers); its rules' fail modes decide")
                }
                _ => {
                    tracing::warn!(error = %e, total = self.store_errors(), "store unavailable; rules' fail modes decide")
                }
            }
        }
    }

    /// The answer for items whose shard is away: fail-closed rules deny with a Retry-After; fail-open
    /// rules are enforced locally at limit / N (all or nothing, like every store). Each item comes
    /// with its record flag: whether what the fallback admits for it is Redis's to learn (written
    /// back), false when its Redis call timed out and may have run.
    pub(super) fn degraded(
        &self,
        plan: &[Planned],
        items: &[(usize, bool)],
        guard: &Guard,
        out: &mut [Option<(Outcome, Source)>],
    ) {
        if items.is_empty() {
            return;
        }
        let now = self.clock.now_ms();
        let store = match &self.store {
            Store::Shared(r) => Some(r),
            Store::Memory(_) => None,
        };
        let retry = |p: &Planned| {
            let shard = store.map_or(0, |r| r.route(&p.key).shard);
            let cooldown = guard
                .breaker(shard)
                .cooldown_left(self.clock.instant())
                .as_millis() as u64;
            FAIL_CLOSED_RETRY_MS.max(cooldown)
        };
        let closed = |p: &Planned| p.rule.fail_mode == FailMode::Closed;
        let blocked = items
            .iter()
            .any(|&(i, _)| closed(&plan[i]) && plan[i].rule.enforced());
        let open: Vec<(usize, bool)> = items
            .iter()
            .copied()
            .filter(|&(i, _)| !closed(&plan[i]))
            .collect();
        let mut local = if blocked || open.is_empty() {
            // The request is denied anyway: take nothing locally.
            Vec::new()
        } else {
            let planned: Vec<Planned> = open.iter().map(|&(i, _)| plan[i].clone()).collect();
            let record: Vec<bool> = open.iter().map(|&(_, r)| r).collect();
            guard.fallback.check(&planned, guard.membership.live(), &record)
        }
        .into_iter();
        for &(i, _) in items {
            let p = &plan[i];
            let o = if closed(p) {
                fail_outcome(&p.rule, now, retry(p))
            } else {
                local
                    .next()
                    .unwrap_or_else(|| fail_outcome(&p.rule, now, retry(p)))
            };
            out[i] = Some((o, Source::Fallback));
        }
    }
}

/// A fail mode's answer for one item: open (allowed, its limit) or closed (denied until `retry_ms`).
pub(super) fn fail_outcome(rule: &Rule, now: u64, retry_ms: u64) -> Outcome {
    let limit = rule.display_limit();
    match rule.fail_mode {
        FailMode::Open => Outcome {
            allowed: true,
            limit,
            remaining: limit,
            reset_at_ms: now + rule.window_ms(),
            retry_after_ms: 0,
        },
        FailMode::Closed => Outcome {
            allowed: false,
            limit,
            remaining: 0,
            reset_at_ms: now + retry_ms,
            retry_after_ms: retry_ms,
        },
    }
}
