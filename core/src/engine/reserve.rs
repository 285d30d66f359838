//! Reservations (protocol version 6) on their way through the engine: a reserve is a consume the
//! agent remembers (`crate::reserve`); a commit settles it before the check runs: the reserved
//! units it did not use go back (a take-back into where they were counted), a use past them is
//! charged, and a concurrency rule's reservation, a lease, is released. Expired reservations are
//! settled by their rule's `reservationExpiry`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use floodgate_protocol::{Decision, ErrorBody, ErrorCode, Source};

use super::groups::counted_in;
use super::{Answer, Engine, Store};
use crate::algo::Outcome;
use crate::guard::LedgerEntry;
use crate::rules::{Algorithm, ReservationExpiry};
use crate::shared_store::Adjust;
use crate::store::{ItemMode, Planned};

impl Engine {
    /// A check with reserve or commit items: its commits settled (what they give back given back
    /// first, so that the check sees it), then the check, then its admitted reserves held.
    pub(super) fn reserved(self: &Arc<Self>, mut plan: Vec<Planned>, received: Instant) -> Answer {
        let book = &self.reservations;
        let new = plan.iter().filter(|p| p.mode == ItemMode::Reserve).count();
        if !book.has_room(new) {
            book.stats.refused.fetch_add(1, Ordering::Relaxed);
            return Answer::Ready(Err(ErrorBody {
                code: ErrorCode::Overloaded,
                message: format!(
                    "the agent holds {} reservations, its most (--max-reservations): commit some first",
                    book.len()
                ),
            }));
        }
        let mut give_back = Vec::new();
        for p in plan.iter_mut().filter(|p| p.mode == ItemMode::Commit) {
            give_back.extend(self.settle(p));
        }
        let reserves: Vec<(usize, Planned)> = plan
            .iter()
            .enumerate()
            .filter(|(_, p)| p.mode == ItemMode::Reserve)
            .map(|(i, p)| (i, p.clone()))
            .collect();
        let r = match &self.store {
            Store::Memory(m) => {
                self.returned(m.take_back(&give_back));
                self.ledger_returned(give_back);
                return match self.answer_plan(plan, received) {
                    Answer::Ready(d) => Answer::Ready(d.map(|d| self.hold(&reserves, d))),
                    Answer::Pending(f) => {
                        let this = self.clone();
                        Answer::Pending(Box::pin(async move { Ok(this.hold(&reserves, f.await?)) }))
                    }
                };
            }
            Store::Shared(r) => r.clone(),
        };
        let this = self.clone();
        // Spawned, not just awaited: the book has let go of the committed reservations, so their
        // take-backs and charges must land, and the admitted reserves be held, even if the
        // caller's connection goes away mid-call.
        let task = tokio::spawn(async move {
            if !give_back.is_empty() {
                // Awaited (bounded by the store's timeout), so that this check, and the next
                // reserve of the caller, sees the units back; one that fails stays counted.
                let done = r.adjust(give_back.clone(), Adjust::TakeBack).await;
                this.returned(done.units);
                this.ledger_surely_returned(give_back, &done);
            }
            let d = match this.answer_plan(plan, received) {
                Answer::Ready(d) => d,
                Answer::Pending(f) => f.await,
            }?;
            Ok(this.hold(&reserves, d))
        });
        Answer::Pending(Box::pin(async move {
            task.await.map_err(|e| ErrorBody {
                code: ErrorCode::Internal,
                message: format!("reservation task failed: {e}"),
            })?
        }))
    }

    /// Turns a commit into what it does to the store (a charge of the use past the reservation, a
    /// look, or a lease's release) and answers the take-backs that give its unused units back.
    fn settle(&self, p: &mut Planned) -> Vec<LedgerEntry> {
        let Some(id) = p.lease.id() else {
            return Vec::new();
        };
        let stats = &self.reservations.stats;
        let used = p.cost;
        let held = self.reservations.take(id, &p.rule.id, &p.key);
        let look = |p: &mut Planned| {
            p.mode = ItemMode::Peek;
            p.cost = 0;
        };
        let charge = |p: &mut Planned, units: u64| {
            if units == 0 {
                return look(p);
            }
            stats.charged_units.fetch_add(units, Ordering::Relaxed);
            p.mode = ItemMode::Charge;
            p.cost = units;
        };
        match (held, p.rule.algorithm) {
            // Units in flight: the reservation is the lease; held, it is released whole; not held
            // (an agent since restarted), a commit naming its units frees it in the store.
            (Some(h), Algorithm::Concurrency) => {
                p.mode = ItemMode::Release;
                p.cost = h.units;
                Vec::new()
            }
            (None, Algorithm::Concurrency) => {
                p.mode = ItemMode::Release;
                Vec::new()
            }
            (Some(h), Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Quota) => {
                if used > h.units {
                    charge(p, used - h.units);
                    return Vec::new();
                }
                look(p);
                // Given back only into the rule it was counted under, and only where a take-back
                // reaches it (not what the fallback admitted while the store was away).
                let back = h.units - used;
                if back == 0 || !h.refundable || *h.rule != *p.rule {
                    return Vec::new();
                }
                // Units come back: a rejection this agent cached for the key no longer holds.
                self.cache.forget(&p.rule.id, &p.key);
                h.give_back(&p.key, back)
            }
            // Not held: committed already, expired, or taken by an agent since restarted.
            (None, Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Quota) => {
                match p.rule.reservation_expiry {
                    // Its reserved units stayed counted: nothing more.
                    ReservationExpiry::Charge => look(p),
                    // Its reserved units went back (or never were): the use is charged whole.
                    ReservationExpiry::Release => charge(p, used),
                }
                Vec::new()
            }
        }
    }

    /// Holds the reservations a decided check took: each admitted reserve item, under its id, where
    /// its units were counted. One the book cannot take (it filled meanwhile) stays counted and is
    /// told it is not held.
    fn hold(&self, reserves: &[(usize, Planned)], mut d: Decision) -> Decision {
        let now = self.clock.now_ms();
        for (i, p) in reserves {
            let Some(item) = d.items.get_mut(*i) else {
                continue;
            };
            let (Some(id), true) = (p.lease.id(), item.verdict.holds_lease) else {
                continue;
            };
            let v = item.verdict;
            let o = Outcome {
                allowed: v.allowed,
                limit: v.limit,
                remaining: v.remaining,
                reset_at_ms: v.reset_at_ms,
                retry_after_ms: v.retry_after_ms,
            };
            let refundable = v.source != Source::Fallback;
            let expires = now + p.rule.reservation_ms();
            if self
                .reservations
                .hold(id, counted_in(p, &o), refundable, expires)
                .is_err()
            {
                item.verdict.holds_lease = false;
            }
        }
        d
    }

    /// Settles the reservations expired now: under `reservationExpiry = "release"` their units go
    /// back (off the caller's path on the shared store); under `charge` they stay counted. A
    /// concurrency rule's lease runs out by itself. Answers how many expired.
    pub fn expire_reservations(self: &Arc<Self>) -> usize {
        let expired = self.reservations.expired(self.clock.now_ms());
        let n = expired.len();
        let back: Vec<LedgerEntry> = expired
            .into_iter()
            .filter(|(_, h)| {
                h.refundable
                    && h.rule.reservation_expiry == ReservationExpiry::Release
                    && !h.rule.is_concurrency()
            })
            .flat_map(|(key, h)| h.give_back(&key, h.units))
            .collect();
        if back.is_empty() {
            return n;
        }
        match &self.store {
            Store::Memory(m) => {
                self.returned(m.take_back(&back));
                self.ledger_returned(back);
            }
            Store::Shared(r) => {
                let (r, this) = (r.clone(), self.clone());
                tokio::spawn(async move {
                    let done = r.adjust(back.clone(), Adjust::TakeBack).await;
                    this.returned(done.units);
                    this.ledger_surely_returned(back, &done);
                });
            }
        }
        n
    }

    /// The agent's reservations.
    pub fn reservations(&self) -> &crate::reserve::Reservations {
        &self.reservations
    }

    /// Records units given back in the ledger, when it is on: the checker takes them off the
    /// key-window they were counted in.
    fn ledger_returned(&self, entries: Vec<LedgerEntry>) {
        if let Some(ledger) = &self.ledger {
            let done = self.clock.now_ms();
            let at = crate::ledger::Decided {
                recv: done,
                done,
                off: self.batcher.offset_ms(),
                n: self.live_agents(),
            };
            ledger.returned(entries, at);
        }
    }

    /// [`ledger_returned`](Self::ledger_returned) for a take-back the store may have applied in
    /// part: recorded only when every entry surely landed (what failed or timed out stays counted
    /// in the ledger, as it may in the store: never a give-back the store did not make).
    fn ledger_surely_returned(&self, entries: Vec<LedgerEntry>, done: &crate::shared_store::Adjusted) {
        if done.retry.is_empty() && done.uncertain.is_empty() && done.refused == 0 && done.error.is_none() {
            self.ledger_returned(entries);
        }
    }

    fn returned(&self, units: u64) {
        self.reservations
            .stats
            .returned_units
            .fetch_add(units, Ordering::Relaxed);
    }
}
