//! The agent's reservations (protocol version 6): what each uncommitted reservation took, where,
//! and until when, so that its commit gives back the units it did not use (or charges those it used
//! past them) and a reservation whose holder died expires as its rule says.
//!
//! A reservation is held by the agent that took it, not by the store: the store counted its units
//! as a consume, and the book says which window (or quota period) to give them back to. An agent
//! that restarts forgets its book, so its uncommitted reservations stay charged (never a budget
//! passed for it); a commit it then cannot find is settled by the rule's `reservationExpiry`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use floodgate_protocol::CompactString;

use crate::guard::LedgerEntry;
use crate::rules::Rule;

/// The most reservations an agent holds unless told otherwise: 100,000 (~200 B each, ~20 MB), a
/// hundred times the streams a busy LLM gateway host keeps open at once.
pub const DEFAULT_MAX_RESERVATIONS: usize = 100_000;

/// Shards of the book, so that reserving and committing on many keys at once rarely contend.
const SHARDS: usize = 16;

/// One reservation: a client's id, for one (rule, key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Name {
    id: u64,
    rule: CompactString,
    key: CompactString,
}

/// What a reservation took, and where.
#[derive(Debug, Clone)]
pub struct Held {
    /// The rule as it was when reserved (a commit under another version gives nothing back).
    pub rule: Arc<Rule>,
    /// The units reserved in all.
    pub units: u64,
    /// Where they were counted, oldest first: (window index, or a quota's period start; units).
    /// A reserve again under the same id (a stream's next chunk) adds a part.
    pub parts: Vec<(u64, u64)>,
    /// Whether the units were counted where a take-back reaches them (the store, not the agent's
    /// limit / N fallback while the store was away, whose units are written back later).
    pub refundable: bool,
    /// When it expires uncommitted (engine clock, Unix ms).
    pub expires_at_ms: u64,
}

impl Held {
    /// The take-backs that give `units` of it back, newest part first.
    pub fn give_back(&self, key: &CompactString, units: u64) -> Vec<LedgerEntry> {
        let mut left = units;
        let mut out = Vec::new();
        for &(window, took) in self.parts.iter().rev() {
            if left == 0 {
                break;
            }
            let n = took.min(left);
            left -= n;
            out.push(LedgerEntry {
                rule: self.rule.clone(),
                key: key.clone(),
                window,
                units: n,
            });
        }
        out
    }
}

/// What became of reservations, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct ReservationStats {
    /// Reservations taken (a top-up of a held one not counted again).
    pub reserved: AtomicU64,
    /// Commits that found their reservation.
    pub committed: AtomicU64,
    /// Commits that found none (committed already, expired, or taken by an agent since restarted).
    pub unknown: AtomicU64,
    /// Reservations that expired uncommitted.
    pub expired: AtomicU64,
    /// Reserves refused because the book was full (`--max-reservations`).
    pub refused: AtomicU64,
    /// Units given back by commits and by expiries under `reservationExpiry = "release"`.
    pub returned_units: AtomicU64,
    /// Units charged by commits past their reservation, or by commits that found none.
    pub charged_units: AtomicU64,
}

/// The book: every reservation this agent holds, bounded.
pub struct Reservations {
    shards: Vec<Mutex<HashMap<Name, Held>>>,
    max: usize,
    held: AtomicU64,
    /// What became of them.
    pub stats: ReservationStats,
}

/// The book is full: a reserve is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full(pub usize);

impl Reservations {
    /// A book of at most `max` reservations.
    pub fn new(max: usize) -> Self {
        Reservations {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            max,
            held: AtomicU64::new(0),
            stats: ReservationStats::default(),
        }
    }

    /// Reservations held now.
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed) as usize
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `more` new reservations would fit.
    pub fn has_room(&self, more: usize) -> bool {
        self.len() + more <= self.max
    }

    /// Holds `took` (its rule, key, window and units) under `id` until `expires_at_ms`; a
    /// reservation already held under that name grows by it (and runs for its new time).
    pub fn hold(&self, id: u64, took: LedgerEntry, refundable: bool, expires_at_ms: u64) -> Result<(), Full> {
        let LedgerEntry {
            rule,
            key,
            window,
            units,
        } = took;
        let name = Name {
            id,
            rule: rule.id.as_str().into(),
            key,
        };
        let mut shard = self.shard(&name);
        if let Some(h) = shard.get_mut(&name) {
            h.units += units;
            match h.parts.last_mut() {
                Some((w, n)) if *w == window => *n += units,
                _ => h.parts.push((window, units)),
            }
            h.refundable &= refundable;
            h.expires_at_ms = expires_at_ms;
            return Ok(());
        }
        if self.len() >= self.max {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Full(self.max));
        }
        shard.insert(
            name,
            Held {
                rule,
                units,
                parts: vec![(window, units)],
                refundable,
                expires_at_ms,
            },
        );
        self.held.fetch_add(1, Ordering::Relaxed);
        self.stats.reserved.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Takes the reservation `id` of (`rule`, `key`) out of the book, if held: a commit.
    pub fn take(&self, id: u64, rule: &str, key: &CompactString) -> Option<Held> {
        let name = Name {
            id,
            rule: rule.into(),
            key: key.clone(),
        };
        let held = self.shard(&name).remove(&name);
        match &held {
            Some(_) => {
                self.held.fetch_sub(1, Ordering::Relaxed);
                self.stats.committed.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.stats.unknown.fetch_add(1, Ordering::Relaxed);
            }
        }
        held
    }

    /// Takes out every reservation expired at `now_ms`, with its key.
    pub fn expired(&self, now_ms: u64) -> Vec<(CompactString, Held)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let mut s = lock(shard);
            let gone: Vec<Name> = s
                .iter()
                .filter(|(_, h)| h.expires_at_ms <= now_ms)
                .map(|(n, _)| n.clone())
                .collect();
            for name in gone {
                if let Some(h) = s.remove(&name) {
                    out.push((name.key, h));
                }
            }
        }
        self.held.fetch_sub(out.len() as u64, Ordering::Relaxed);
        self.stats.expired.fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    fn shard(&self, name: &Name) -> MutexGuard<'_, HashMap<Name, Held>> {
        // The id is the client's random 64 bits: its low bits spread the shards.
        lock(&self.shards[(name.id as usize) % SHARDS])
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    fn rule() -> Arc<Rule> {
        let set = RuleSet::parse(
            r#"{"rules":[{"id":"tokens","dimension":"user","limit":100,"windowSeconds":60}]}"#,
        )
        .unwrap();
        set.get("tokens").unwrap().clone()
    }

    fn took(r: &Arc<Rule>, key: &str, window: u64, units: u64) -> LedgerEntry {
        LedgerEntry {
            rule: r.clone(),
            key: key.into(),
            window,
            units,
        }
    }

    #[test]
    fn a_reservation_is_taken_once() {
        let (book, r, key) = (Reservations::new(10), rule(), CompactString::from("user:1"));
        book.hold(7, took(&r, "user:1", 3, 40), true, 1_000).unwrap();
        let held = book.take(7, "tokens", &key).expect("held");
        assert_eq!((held.units, held.parts.clone()), (40, vec![(3, 40)]));
        assert!(
            book.take(7, "tokens", &key).is_none(),
            "a second commit finds nothing"
        );
        assert_eq!(book.stats.unknown.load(Ordering::Relaxed), 1);
        assert!(book.is_empty());
    }

    #[test]
    fn a_top_up_adds_a_part_and_gives_back_newest_first() {
        let (book, r, key) = (Reservations::new(10), rule(), CompactString::from("user:1"));
        book.hold(7, took(&r, "user:1", 3, 40), true, 1_000).unwrap();
        book.hold(7, took(&r, "user:1", 3, 10), true, 1_000).unwrap();
        book.hold(7, took(&r, "user:1", 4, 20), true, 2_000).unwrap();
        let held = book.take(7, "tokens", &key).unwrap();
        assert_eq!(
            (held.units, held.parts.clone(), held.expires_at_ms),
            (70, vec![(3, 50), (4, 20)], 2_000)
        );
        let back: Vec<(u64, u64)> = held
            .give_back(&key, 30)
            .iter()
            .map(|e| (e.window, e.units))
            .collect();
        assert_eq!(back, vec![(4, 20), (3, 10)]);
    }

    #[test]
    fn the_book_is_bounded_and_expires() {
        let (book, r) = (Reservations::new(2), rule());
        for (id, key) in [(1, "a"), (2, "b")] {
            book.hold(id, took(&r, key, 0, 1), true, 500).unwrap();
        }
        assert_eq!(book.hold(3, took(&r, "c", 0, 1), true, 900), Err(Full(2)));
        assert_eq!(book.stats.refused.load(Ordering::Relaxed), 1);
        // A top-up of a held one still fits.
        book.hold(1, took(&r, "a", 0, 1), true, 900).unwrap();
        let gone = book.expired(600);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].0, "b");
        assert_eq!(book.len(), 1);
        assert!(book.has_room(1));
    }
}
