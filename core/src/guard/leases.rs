//! The leases the fallback granted while the store was away, kept until the store answers again
//! and they are taken there (check.lua's concurrency add, `concurrency_take`): otherwise Redis knows
//! nothing of units the agent's clients hold, and grants its whole limit again beside them.
//!
//! A lease is taken whatever the store's own count (the client holds it; it cannot be revoked), and
//! taking one the store holds already (an acquire that timed out here but ran there) renews it, so
//! each is counted once: unlike a rate's write-back, the acquires that timed out are kept too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use floodgate_protocol::CompactString;

use super::fallback::{LedgerEntry, LEDGER_CAP};
use crate::rules::Rule;

/// (rule id, client key, lease id).
type LeaseKey = (CompactString, CompactString, u64);

/// The fallback's leases waiting to be taken in the store, each as a ledger entry whose `window` is
/// the lease id, with the Unix ms (local clock) at which it runs out.
#[derive(Default)]
pub(super) struct LeaseLedger {
    leases: Mutex<HashMap<LeaseKey, (LedgerEntry, u64)>>,
}

impl LeaseLedger {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseKey, (LedgerEntry, u64)>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps lease `id` of `units` on (`rule`, `key`), held from `now` for the rule's lease time (a
    /// lease acquired again is renewed); false when the ledger is full and it was not kept.
    pub(super) fn granted(
        &self,
        rule: &Arc<Rule>,
        key: &CompactString,
        id: u64,
        units: u64,
        now: u64,
    ) -> bool {
        let mut leases = self.lock();
        let k = (CompactString::from(rule.id.as_str()), key.clone(), id);
        let until = now + rule.window_ms();
        if let Some((e, end)) = leases.get_mut(&k) {
            e.units = units;
            *end = until;
            return true;
        }
        if leases.len() >= LEDGER_CAP {
            return false;
        }
        let entry = LedgerEntry {
            rule: rule.clone(),
            key: key.clone(),
            window: id,
            units,
        };
        leases.insert(k, (entry, until));
        true
    }

    /// Forgets lease `id` (released before the store answered: nothing to take).
    pub(super) fn released(&self, rule: &str, key: &CompactString, id: u64) {
        self.lock().remove(&(CompactString::from(rule), key.clone(), id));
    }

    /// Forgets up to `units` units of whole leases of (`rule`, `key`), the soonest to run out first,
    /// as a release by count frees them in the fallback's store.
    pub(super) fn released_by_count(&self, rule: &str, key: &CompactString, units: u64) {
        let mut leases = self.lock();
        let mut mine: Vec<(LeaseKey, u64, u64)> = leases
            .iter()
            .filter(|((r, k, _), _)| r.as_str() == rule && k == key)
            .map(|(k, (e, end))| (k.clone(), e.units, *end))
            .collect();
        mine.sort_by_key(|(_, _, end)| *end);
        let mut left = units;
        for (k, held, _) in mine {
            if held <= left {
                leases.remove(&k);
                left -= held;
            }
        }
    }

    /// Takes up to `max` live leases that are `ready` (their shard answers); the ones that ran out
    /// by `now` are dropped (the store would have expired them too).
    pub(super) fn drain(
        &self,
        max: usize,
        now: u64,
        ready: impl Fn(&LedgerEntry) -> bool,
    ) -> Vec<LedgerEntry> {
        let mut leases = self.lock();
        leases.retain(|_, (_, end)| *end > now);
        let keys: Vec<LeaseKey> = leases
            .iter()
            .filter(|(_, (e, _))| ready(e))
            .map(|(k, _)| k.clone())
            .take(max)
            .collect();
        keys.into_iter()
            .filter_map(|k| leases.remove(&k).map(|(e, _)| e))
            .collect()
    }

    /// Puts back a lease whose taking failed surely, held for its rule's lease time from `now` (its
    /// first end is not kept: longer only delays when the store would expire it).
    pub(super) fn restore(&self, entry: LedgerEntry, now: u64) {
        let (rule, key, id, units) = (entry.rule.clone(), entry.key.clone(), entry.window, entry.units);
        let known = self
            .lock()
            .contains_key(&(CompactString::from(rule.id.as_str()), key.clone(), id));
        if !known {
            self.granted(&rule, &key, id, units, now);
        }
    }

    /// Leases waiting.
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;
    use crate::guard::Fallback;
    use crate::rules::RuleSet;
    use crate::store::{Clock, ItemMode, Lease, Planned};

    fn acquire(rule: &Arc<Rule>, key: &str, id: u64, units: u64) -> Planned {
        Planned {
            lease: Lease::Client(id),
            ..Planned::consume(rule.clone(), key, units)
        }
    }

    /// Granted leases wait for the store; released ones (by id or by count, soonest end first) and
    /// those that ran out are not taken; a denied acquire keeps nothing.
    #[test]
    fn the_fallback_keeps_the_leases_it_granted_until_the_store_takes_them() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"c","dimension":"user","limit":3,"algorithm":"concurrency","leaseSeconds":10}]}"#,
        )
        .unwrap();
        let rule = rules.get("c").unwrap().clone();
        let t = Arc::new(AtomicU64::new(1_000_000));
        let f = Fallback::new(Clock::Manual(t.clone()));
        for id in 1..=3 {
            // Recorded whether or not the store call timed out: the record flag is for rates.
            assert!(f.check(&[acquire(&rule, "user:a", id, 1)], 1, &[false])[0].allowed);
            t.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        assert!(!f.check(&[acquire(&rule, "user:a", 4, 1)], 1, &[true])[0].allowed);
        assert_eq!(f.pending(), 3, "the denied acquire keeps nothing");
        let release = |lease| Planned {
            mode: ItemMode::Release,
            lease,
            ..Planned::consume(rule.clone(), "user:a", 1)
        };
        f.release(&release(Lease::Client(2)), 1);
        assert_eq!(f.pending(), 2);
        // By count: the lease that runs out first (id 1) goes.
        f.release(&release(Lease::None), 1);
        let left = f.drain(10, |_| true);
        assert_eq!(
            left.iter().map(|e| (e.window, e.units)).collect::<Vec<_>>(),
            [(3, 1)]
        );
        // Put back after a failed write, then run out: dropped, never taken.
        f.restore(left);
        assert_eq!(f.pending(), 1);
        t.fetch_add(10_001, std::sync::atomic::Ordering::Relaxed);
        assert!(f.drain(10, |_| true).is_empty());
        assert_eq!(f.pending(), 0);
    }
}
