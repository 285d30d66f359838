//! The batcher's flushes: which rules are due on Redis's clock, what each pass sends, and what a
//! reply teaches.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::batcher::{shard_of, Batcher, RuleCounters, SHARDS};
use crate::rules::Rule;

/// Most entries one flush pass carries (writes and learns of all rules): bounds the pass's memory and
/// Redis time (~256 calls). What does not fit waits for the next pass: unwritten units stay pending,
/// unlearned keys stay stale (one check per key and slot until learned).
pub const MAX_FLUSH_ENTRIES: usize = 65_536;

/// One entry of a flush: a write of units admitted for (rule, key) in window `target`, or a learn
/// (0 units) that reads the global counts back.
#[derive(Debug, Clone)]
pub struct FlushEntry {
    /// The rule.
    pub rule: Arc<Rule>,
    /// The client key.
    pub key: String,
    /// The window the units belong to (Redis clock).
    pub target: u64,
    /// Units to add.
    pub units: u64,
    /// For a learn, the rule's learn sequence number.
    pub seq: u32,
    /// Whether this entry learns (reads) rather than writes.
    pub learn: bool,
}

/// What Redis answered for one entry: its window index then, and the counts of that window and the
/// one before.
#[derive(Debug, Clone, Copy)]
pub struct Learned {
    /// Redis's window index when the entry was applied.
    pub window: u64,
    /// The global count of that window.
    pub cur: u64,
    /// The global count of the window before.
    pub prev: u64,
}

/// What one flush pass takes from one rule: whether it writes and learns, the learn's sequence
/// number, and the pass's Redis time, live-agent count and entry cap.
struct Pass {
    write: bool,
    learn: bool,
    seq: u32,
    redis_now: u64,
    n: u64,
    cap: usize,
}

impl Batcher {
    /// The entries of every rule whose flush is due now (Redis clock): at the start of each flush
    /// slot (time / interval) a write of what was admitted since the last one; half a slot later,
    /// when every agent has written, a learn of the keys that need one (`Counter::needs_learn`: near
    /// their share, or not learned for `LEARN_EVERY` passes).
    /// With `force` (shutdown), a write of everything pending. Idle counters whose windows have
    /// passed are dropped at each learn.
    pub fn take_due(&self, rules: &[Arc<Rule>], n: u64, force: bool) -> Vec<FlushEntry> {
        let redis_now = self.redis_now_ms();
        let cap = if force { usize::MAX } else { MAX_FLUSH_ENTRIES };
        let mut out = Vec::new();
        self.forget_removed(rules);
        for rule in rules {
            let Some(rc) = self.existing(rule) else {
                continue;
            };
            let interval = self.flush_ms(rule);
            let (write, learn) = slots_due(&rc, redis_now, interval, force);
            if !(write || learn) {
                continue;
            }
            let seq = if learn {
                rc.seq.fetch_add(1, Ordering::Relaxed) + 1
            } else {
                0
            };
            let pass = Pass {
                write,
                learn,
                seq,
                redis_now,
                n,
                cap,
            };
            self.take_rule(rule, &rc, pass, &mut out);
        }
        if !out.is_empty() {
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.entries.fetch_add(out.len() as u64, Ordering::Relaxed);
        self.stats
            .units
            .fetch_add(out.iter().map(|e| e.units).sum(), Ordering::Relaxed);
        out
    }

    /// One rule's entries of a pass, shard by shard from its cursor, up to the pass's cap; a learn
    /// first drops the idle counters whose windows have passed.
    fn take_rule(&self, rule: &Arc<Rule>, rc: &RuleCounters, pass: Pass, out: &mut Vec<FlushEntry>) {
        let Pass {
            write,
            learn,
            seq,
            redis_now,
            n,
            cap,
        } = pass;
        let idx = redis_now / rc.window_ms;
        // A pass that hits the cap stops at a shard; the next one starts there, so no shard's
        // keys wait behind the others' for more than a few passes.
        let first = rc.cursor.load(Ordering::Relaxed);
        for k in 0..SHARDS {
            let s = (first + k) % SHARDS;
            if out.len() >= cap {
                rc.cursor.store(s, Ordering::Relaxed);
                break;
            }
            let mut shard = rc.shards[s].lock().unwrap_or_else(|p| p.into_inner());
            if learn {
                let dropped = shard.retain(|c| c.active || c.busy() || c.window + 2 > idx);
                self.forget_keys(dropped);
            }
            for (key, c) in shard.iter_mut() {
                if out.len() >= cap {
                    break;
                }
                if write && c.pending() > 0 {
                    for (target, units) in c.take() {
                        if units > 0 {
                            out.push(FlushEntry {
                                rule: rule.clone(),
                                key: key.to_string(),
                                target,
                                units,
                                seq,
                                learn: false,
                            });
                        }
                    }
                }
                if learn && c.needs_learn(rule.limit.get(), rc.window_ms, redis_now, n, seq) {
                    c.active = false;
                    out.push(FlushEntry {
                        rule: rule.clone(),
                        key: key.to_string(),
                        target: c.window,
                        units: 0,
                        seq,
                        learn: true,
                    });
                }
            }
        }
    }

    /// Applies a flush reply: written units stay written and learns set the learned counts (`Ok`), written units
    /// pending again (`Err(true)`: the call surely failed), or given up as uncertain (`Err(false)`:
    /// it timed out and may have been applied).
    pub fn apply(&self, entries: &[FlushEntry], reply: Result<&[Learned], bool>) {
        match reply {
            Err(false) => self
                .stats
                .uncertain_units
                .fetch_add(entries.iter().map(|e| e.units).sum(), Ordering::Relaxed),
            Err(true) => self.stats.errors.fetch_add(1, Ordering::Relaxed),
            Ok(_) => 0,
        };
        for (i, e) in entries.iter().enumerate() {
            let Some(rc) = self.existing(&e.rule) else {
                continue;
            };
            let mut shard = rc.shards[shard_of(&e.key)]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let Some(c) = shard.get_mut(e.key.as_str()) else {
                continue;
            };
            match reply {
                Ok(learned) if e.learn => {
                    if let Some(l) = learned.get(i) {
                        c.learn(l.window, l.cur, l.prev, e.seq);
                    }
                }
                Ok(learned) => {
                    // A write answers with its window's count after it.
                    if let Some(l) = learned.get(i) {
                        crate::metrics::over_admitted(
                            &e.rule,
                            crate::metrics::OverSource::Flush,
                            l.cur,
                            e.units,
                        );
                    }
                }
                // A learn that failed teaches nothing: the counts stay as stale as they are.
                Err(_) if e.learn => {}
                // Written, or maybe written (a timeout): it stays counted as written.
                Err(false) => {}
                Err(true) => c.resend(e.target, e.units),
            }
        }
    }
}

/// Whether a rule's flush writes now (a new flush slot, or `force`) or learns (half a slot
/// later, once per slot); the slots it did are recorded.
fn slots_due(rc: &RuleCounters, redis_now: u64, interval: u64, force: bool) -> (bool, bool) {
    let slot = redis_now / interval;
    let mut slots = rc.slots.lock().unwrap_or_else(|p| p.into_inner());
    let write = force || slots.0 != slot;
    let learn = !force && !write && slots.1 != slot && redis_now % interval >= interval / 2;
    if write {
        slots.0 = slot;
    }
    if learn {
        slots.1 = slot;
    }
    (write, learn)
}
