//! After a decision: the decision ledger and the store's recent admissions (`recorded`), and log
//! mode's would-be rejections and the rejection events (`observe`).

use std::sync::Arc;

use floodgate_protocol::{CompactString, Decision, Source};

use super::{Answer, Engine};
use crate::rules::Rule;
use crate::store::{ItemMode, Planned};

impl Engine {
    /// The answer, recorded once decided: in the ledger, the plan's items and their verdicts, with
    /// when the check was read and decided and the store clock's offset as learned; in `recent`,
    /// the units the store admitted.
    pub(super) fn recorded(
        self: &Arc<Self>,
        plan: Vec<Planned>,
        answer: Answer,
        received: std::time::Instant,
    ) -> Answer {
        let record = move |this: &Engine, d: &Decision| {
            // Both truncated from µs, so each is the ms it happened in: the read's ms was `done`
            // less the whole ms elapsed before, up to 1 ms late, which the judge of concurrency
            // rules took for a lease still held (single seed 8).
            let now_us = this.clock.now_us();
            let done = now_us / 1_000;
            let recv = now_us.saturating_sub(received.elapsed().as_micros() as u64) / 1_000;
            if let Some(recent) = &this.recent {
                for (p, it) in plan.iter().zip(&d.items) {
                    let by_store = it.verdict.allowed && it.verdict.source == Source::Redis;
                    match (p.rule.is_concurrency(), p.lease.id()) {
                        (true, Some(id)) if p.mode == ItemMode::Release => {
                            recent.released(&p.rule.id, &p.key, id)
                        }
                        (true, Some(id)) if p.mode.takes_if_passed() && by_store => {
                            recent.leased(&p.rule, &p.key, id, p.cost, done)
                        }
                        (true, _) => {}
                        (false, _) if p.mode.counts() && by_store => {
                            recent.record(&p.rule, &p.key, p.cost, recv, done)
                        }
                        (false, _) => {}
                    }
                }
            }
            if let Some(ledger) = &this.ledger {
                let at = crate::ledger::Decided {
                    recv,
                    done,
                    off: this.batcher.offset_ms(),
                    n: this.live_agents(),
                };
                ledger.record(&plan, d, at);
            }
        };
        self.then(answer, record)
    }

    /// The answer, with `f` run on its decision once there is one (at once for a ready answer, when
    /// the future completes for a pending one; not for an error).
    pub(super) fn then(
        self: &Arc<Self>,
        answer: Answer,
        f: impl FnOnce(&Engine, &Decision) + Send + 'static,
    ) -> Answer {
        match answer {
            Answer::Ready(Ok(d)) => {
                f(self, &d);
                Answer::Ready(Ok(d))
            }
            Answer::Pending(fut) => {
                let this = self.clone();
                Answer::Pending(Box::pin(async move {
                    let r = fut.await;
                    if let Ok(d) = &r {
                        f(&this, d);
                    }
                    r
                }))
            }
            other => other,
        }
    }

    /// Counts the log-mode items a decision would have rejected, and emits an event for each enforced
    /// item the limiter rejected and for each would-be rejection the dry run calls news (`mode`
    /// `log`). Repeats answered from the rejection cache make no event: the key's first rejection
    /// already said it is blocked until its reset, and a hot abusive key must not flood the stream
    /// (and Redis) the cache keeps it away from; they are counted in
    /// `floodgate_checks_total{source="cache"}`.
    pub(super) fn observe(&self, logged: &[(usize, Arc<Rule>, CompactString)], d: &Decision) {
        if d.combined.allowed && logged.iter().all(|(_, r, _)| !r.logs_only()) {
            return;
        }
        let now = self.clock.now_ms();
        for (i, rule, key) in logged {
            let Some(it) = d.items.get(*i) else { continue };
            if it.verdict.allowed {
                continue;
            }
            if it.verdict.source == Source::Cache {
                continue;
            }
            // A log-mode rule's would-be rejection is an event when the dry run says it is news
            // (the key's first since its last report), as an enforced key's repeats are kept off
            // the stream by the rejection cache.
            let news = !rule.logs_only() || self.dry_run.record(&rule.id, rule.version, key, now);
            if let (Some(events), true) = (&self.events, news) {
                events.emit(crate::events::Event {
                    key: key.to_string(),
                    rule: rule.id.clone(),
                    ts_ms: now,
                    version: rule.version,
                    dry_run: rule.logs_only(),
                });
            }
        }
    }
}
