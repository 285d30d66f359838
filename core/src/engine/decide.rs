//! Combining per-item outcomes into a decision: which items gate the check (by mode), the combined
//! verdict and the binding item's figures.

use floodgate_protocol::{Decision, ItemDecision, Source, Verdict};

use crate::algo::Outcome;
use crate::rules::Rule;
use crate::store::{Clock, ItemMode, Lease, Planned};

/// An item a check did not look at because another item rejected it: its rule's plain figures.
pub(super) fn unseen(rule: &Rule, now: u64) -> Outcome {
    let limit = rule.display_limit();
    Outcome {
        allowed: true,
        limit,
        remaining: limit,
        reset_at_ms: now,
        retry_after_ms: 0,
    }
}

/// The decision from every item's outcome and source.
pub(super) fn finish(plan: &[Planned], out: Vec<Option<(Outcome, Source)>>) -> Decision {
    let now = Clock::System.now_ms();
    decide(
        plan,
        out.into_iter()
            .zip(plan)
            .map(|(o, p)| o.unwrap_or_else(|| (unseen(&p.rule, now), Source::Fallback))),
    )
}

pub(super) fn no_rule() -> Verdict {
    Verdict {
        allowed: true,
        log_only: false,
        holds_lease: false,
        over_quota: false,
        source: Source::Local,
        limit: 0,
        remaining: 0,
        reset_at_ms: 0,
        retry_after_ms: 0,
    }
}

/// Per-item verdicts and the combined one: allowed only if every enforced item is; the figures of the
/// binding item (on a denial the longest retry, else the smallest remaining). `sources` has one
/// source per item, or one for all.
pub fn combine(plan: &[Planned], outcomes: &[Outcome], sources: &[Source]) -> Decision {
    let source = |i: usize| {
        sources
            .get(i)
            .or(sources.first())
            .copied()
            .unwrap_or(Source::Local)
    };
    decide(plan, outcomes.iter().enumerate().map(|(i, o)| (*o, source(i))))
}

/// `combine` over each item's (outcome, source) in plan order, with no vectors in between.
pub(super) fn decide(plan: &[Planned], outcomes: impl Iterator<Item = (Outcome, Source)>) -> Decision {
    let items: Vec<ItemDecision> = plan
        .iter()
        .zip(outcomes)
        .map(|(p, (o, source))| ItemDecision {
            rule_id: p.rule.id.as_str().into(),
            verdict: Verdict {
                allowed: o.allowed || (p.rule.flags_over_quota() && p.mode.can_refuse()),
                log_only: p.rule.logs_only(),
                // Quota mode: past the limit the request passes, flagged, its cost counted nowhere.
                over_quota: !o.allowed && p.rule.flags_over_quota() && p.mode.can_refuse(),
                // The client's lease its concurrency item acquired (cleared below if the check
                // was denied: then nothing is held).
                holds_lease: o.allowed
                    && p.mode.takes_if_passed()
                    && matches!(p.lease, Lease::Client(_))
                    && source != Source::Cache,
                source,
                limit: o.limit,
                remaining: o.remaining,
                reset_at_ms: o.reset_at_ms,
                retry_after_ms: if o.allowed || !p.rule.flags_over_quota() {
                    o.retry_after_ms
                } else {
                    0
                },
            },
            window_ms: p.rule.policy_window_ms(o.reset_at_ms),
        })
        .collect();
    // What decides the check: its consume items; a check without any, its peeks (a charge or a
    // release is never a rejection).
    let consumes = plan.iter().any(|p| p.mode.takes_if_passed());
    let gates = |mode: ItemMode| match mode {
        ItemMode::Consume | ItemMode::Reserve => true,
        ItemMode::Peek => !consumes,
        ItemMode::Charge | ItemMode::Release | ItemMode::Commit => false,
    };
    let denied = items
        .iter()
        .zip(plan)
        .filter(|(i, p)| !i.verdict.log_only && !i.verdict.allowed && gates(p.mode))
        .map(|(i, _)| i.verdict)
        .max_by_key(|v| v.retry_after_ms);
    let mut items = items;
    if denied.is_some() {
        for i in &mut items {
            i.verdict.holds_lease = false;
        }
    }
    let enforced = || items.iter().filter(|i| !i.verdict.log_only);
    let binding = denied.or_else(|| {
        // Allowed: the tightest enforced item's figures (a denied peek beside consume items
        // included, as what it would cost), the check itself allowed.
        enforced()
            .min_by_key(|i| (i.verdict.remaining, i.verdict.limit))
            .map(|i| Verdict {
                allowed: true,
                retry_after_ms: 0,
                ..i.verdict
            })
    });
    let combined = match binding {
        Some(v) => v,
        // Only log-mode items: allowed, with the figures of the tightest of them, marked log-only.
        None => {
            let mut v = items
                .iter()
                .min_by_key(|i| (i.verdict.remaining, i.verdict.limit))
                .map(|i| i.verdict)
                .unwrap_or_else(no_rule);
            v.allowed = true;
            v.retry_after_ms = 0;
            v
        }
    };
    // Quota mode: a check let through past a rule's limit says so, whichever item binds.
    let combined = Verdict {
        over_quota: combined.allowed && items.iter().any(|i| i.verdict.over_quota),
        ..combined
    };
    Decision { combined, items }
}
