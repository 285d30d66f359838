//! A check's way into the engine: `check`, `check_received`, `check_under` (planned, a caller's
//! rules put in, penalties applied), `looks_first` (a request phase's peeks before its acquires),
//! and `answer_plan` (to the store, then to the ledger, the dry run and the events).

use std::sync::Arc;

use floodgate_protocol::{Check, CompactString, Decision, Source};

use super::decide::no_rule;
use super::{combine, Answer, Engine, Store};
use crate::rules::Rule;
use crate::store::{ItemMode, Lease, Planned};

impl Engine {
    /// Decides a check.
    pub fn check(self: &Arc<Self>, check: Check) -> Answer {
        self.check_received(check, self.clock.instant())
    }

    /// [`check`](Self::check) of a frame read at `received`: the store's budget runs from then, so
    /// time spent in the agent before the store is asked counts against it.
    pub fn check_received(self: &Arc<Self>, check: Check, received: std::time::Instant) -> Answer {
        self.check_under(check, &[], received)
    }

    /// [`check_received`](Self::check_received) with some items checked under a rule of the
    /// caller's (by item index; Envoy's per-request `RateLimitOverride`): the same id, its own
    /// figures.
    pub fn check_under(
        self: &Arc<Self>,
        check: Check,
        under: &[(usize, Arc<Rule>)],
        received: std::time::Instant,
    ) -> Answer {
        // The request phase of a request whose cost comes after its response: its rate rules peek,
        // its concurrency rules acquire under its lease, and the peeks decide first.
        let looks_first = matches!(&check, Check::Attributes(a) if a.mode.only_looks() && a.lease.is_some());
        let mut plan = match self.plan(check) {
            Ok(plan) => plan,
            Err(e) => return Answer::Ready(Err(e)),
        };
        for (i, rule) in under {
            if let Some(p) = plan.get_mut(*i) {
                p.rule = rule.clone();
            }
        }
        if self.overrides.penalties() > 0 {
            if let Some(blocked) = self.penalize(&mut plan) {
                return Answer::Ready(Ok(blocked));
            }
        }
        if looks_first && plan.iter().any(|p| p.mode.takes_if_passed()) {
            return self.looks_first(plan, received);
        }
        if plan.iter().any(|p| p.mode.reserves()) {
            return self.reserved(plan, received);
        }
        self.answer_plan(plan, received)
    }

    /// A check of peeks and concurrency acquires (a form-3 peek with a lease): every item peeked
    /// first; refused, the check is that answer and nothing is held; else it runs as planned. (A
    /// quota spent between the two is a peek's usual race: the request's cost is charged after.)
    fn looks_first(self: &Arc<Self>, plan: Vec<Planned>, received: std::time::Instant) -> Answer {
        let looks: Vec<Planned> = plan
            .iter()
            .map(|p| Planned {
                mode: ItemMode::Peek,
                lease: Lease::None,
                ..p.clone()
            })
            .collect();
        let first = self.answer_plan(looks, received);
        let this = self.clone();
        Answer::Pending(Box::pin(async move {
            let looked = match first {
                Answer::Ready(r) => r,
                Answer::Pending(f) => f.await,
            }?;
            if !looked.combined.allowed {
                return Ok(looked);
            }
            match this.answer_plan(plan, received) {
                Answer::Ready(r) => r,
                Answer::Pending(f) => f.await,
            }
        }))
    }

    /// Decides a planned check.
    pub(super) fn answer_plan(self: &Arc<Self>, plan: Vec<Planned>, received: std::time::Instant) -> Answer {
        if plan.is_empty() {
            return Answer::Ready(Ok(Decision {
                combined: no_rule(),
                items: Vec::new(),
            }));
        }
        // Items of rules in log mode: what they would have rejected is the dry run's to count. With
        // events on, every item: a rejection becomes an event (the key is only in the plan).
        let events = self.events.is_some();
        let logged: Vec<(usize, Arc<Rule>, CompactString)> = plan
            .iter()
            .enumerate()
            // A charge is never a rejection, a peek takes nothing: neither is evented nor a
            // would-be rejection of the dry run.
            .filter(|(_, p)| (events || p.rule.logs_only()) && p.mode.takes_if_passed())
            .map(|(i, p)| (i, p.rule.clone(), p.key.clone()))
            .collect();
        // With the ledger on, or the store's admissions kept for a failover, the plan is kept to
        // record the decision's items against.
        let ledger = (self.ledger.is_some() || self.recent.is_some()).then(|| plan.clone());
        let answer = match &self.store {
            Store::Memory(m) => {
                let outcomes = m.check(&plan);
                Answer::Ready(Ok(combine(&plan, &outcomes, &[Source::Local])))
            }
            Store::Shared(r) => self.check_shared(r, plan, received),
        };
        let answer = match ledger {
            Some(plan) => self.recorded(plan, answer, received),
            None => answer,
        };
        if logged.is_empty() {
            return answer;
        }
        self.then(answer, move |this, d| this.observe(&logged, d))
    }
}
