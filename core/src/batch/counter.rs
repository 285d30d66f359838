//! One (rule, key)'s batched counter: the global counts last learned from Redis and what this agent
//! admitted since, per window, and the admission rule that spends only this agent's share.

use crate::algo::{sliding_window, Outcome, WindowState};

/// What the agent knows of one (rule, key): windows are Redis-clock window indexes. Counts are
/// `u32` (batched rules have limits below 2³², `Engine::batched_by_rule`): 40 bytes a key.
#[derive(Debug, Clone, Default)]
pub struct Counter {
    /// The window `*_cur` counts.
    pub window: u64,
    /// Global count of `window` at the last learn (ours included up to the write before it).
    pub learned_cur: u32,
    /// Global count of the window before.
    pub learned_prev: u32,
    /// Admitted here for `window`, not written yet.
    pub pending_cur: u32,
    /// Admitted here for the window before, not written yet.
    pub pending_prev: u32,
    /// Written (or being written) to Redis, not yet in a learned count, for `window`.
    pub written_cur: u32,
    /// Written (or being written) to Redis, not yet in a learned count, for the window before.
    pub written_prev: u32,
    /// The learn (sequence number) the learned counts came from; 0 = never learned.
    pub learned_seq: u32,
    /// Checked since the last learn (so the next learn refreshes its counts).
    pub active: bool,
}

/// Why a batched check was denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The limit is reached (globally, as far as this agent knows).
    Limit,
    /// This agent has spent its share of what remains until the next flush.
    Share,
}

/// Learns a counter may miss while it is far from its limit: a key that has used less than half its
/// share since it last learned is learned at most every 10 slots (1 s at 100 ms), so keys far from
/// their limits cost a write per slot and a read per second, not a read per slot.
pub const LEARN_EVERY: u32 = 10;

fn narrow(x: u64) -> u32 {
    x.min(u64::from(u32::MAX)) as u32
}

impl Counter {
    /// Moves the counter to window `idx` (Redis clock): the current counts become the previous ones
    /// after one window; both are gone after two. Unwritten units of a window that no longer weighs
    /// are dropped (the script would ignore them too).
    pub fn roll(&mut self, idx: u64) {
        if idx <= self.window {
            return;
        }
        if idx == self.window + 1 {
            self.learned_prev = self.learned_cur;
            self.pending_prev = self.pending_cur;
            self.written_prev = self.written_cur;
        } else {
            self.learned_prev = 0;
            self.pending_prev = 0;
            self.written_prev = 0;
        }
        self.learned_cur = 0;
        self.pending_cur = 0;
        self.written_cur = 0;
        self.window = idx;
    }

    /// Decides `cost` at `now_ms` (Redis clock) against `limit` per `window_ms`, with `n` live agents
    /// and the current learn sequence `seq`, and on success counts it as pending.
    ///
    /// The agent's view is the learned global counts plus what it admitted since ("unlearned"). It
    /// admits while the unlearned estimate stays within its share, (limit − learned estimate) / n.
    /// Agents write at the start of each flush slot and learn half a slot later (Redis clock), so
    /// they all learn the same total, which holds everything admitted before the writes: n agents
    /// together then cannot spend more than what remained. A counter whose counts are stale (not
    /// refreshed by the last learn) or never learned has no share: it admits one check until the next
    /// learn, if the limit allows it, so over-admission is bounded by about n × cost per slot.
    pub fn admit(
        &mut self,
        limit: u64,
        window_ms: u64,
        cost: u64,
        now_ms: u64,
        n: u64,
        seq: u32,
    ) -> (Outcome, Option<Denial>) {
        self.roll(now_ms / window_ms);
        // A learn may have moved the counter to Redis's window while this agent's clock estimate is
        // a little behind: count the check at the window's start, never before it.
        let now_ms = now_ms.max(self.window * window_ms);
        self.active = true;
        let (unlearned_cur, unlearned_prev) = self.unlearned();
        let state = WindowState {
            window: self.window,
            cur: u64::from(self.learned_cur) + unlearned_cur,
            prev: u64::from(self.learned_prev) + unlearned_prev,
        };
        let (outcome, _, _) = sliding_window(Some(state), limit, window_ms, cost, now_ms);
        if !outcome.allowed {
            return (outcome, Some(Denial::Limit));
        }
        let elapsed = (now_ms - self.window * window_ms) as f64 / window_ms as f64;
        let weight = 1.0 - elapsed;
        let learned = f64::from(self.learned_prev) * weight + f64::from(self.learned_cur);
        let unlearned = unlearned_prev as f64 * weight + unlearned_cur as f64;
        let fresh = self.learned_seq > 0 && self.learned_seq + LEARN_EVERY >= seq;
        let share = if fresh {
            (limit as f64 - learned) / n.max(1) as f64
        } else {
            0.0
        };
        let fits = unlearned + cost as f64 <= share || unlearned <= 0.0;
        if !fits {
            let mut denied = outcome;
            denied.allowed = false;
            return (denied, Some(Denial::Share));
        }
        self.pending_cur = narrow(u64::from(self.pending_cur) + cost);
        (outcome, None)
    }

    /// Whether the learn pass `seq` should read this counter back: it was checked or has unlearned
    /// units, and it never learned, learned `LEARN_EVERY` passes ago, or has used half its share
    /// (then it learns every pass: near the limit the view must be one slot old at most).
    pub fn needs_learn(&self, limit: u64, window_ms: u64, now_ms: u64, n: u64, seq: u32) -> bool {
        if !(self.active || self.busy()) {
            return false;
        }
        if self.learned_seq == 0 || self.learned_seq + LEARN_EVERY <= seq {
            return true;
        }
        let idx = now_ms / window_ms;
        if idx != self.window {
            return true;
        }
        let weight = 1.0 - now_ms.saturating_sub(self.window * window_ms) as f64 / window_ms as f64;
        let learned = f64::from(self.learned_prev) * weight + f64::from(self.learned_cur);
        let (cur, prev) = self.unlearned();
        let unlearned = prev as f64 * weight + cur as f64;
        let share = (limit as f64 - learned) / n.max(1) as f64;
        unlearned * 2.0 >= share
    }

    /// Units admitted here and not in the learned counts: (this window, the one before).
    pub fn unlearned(&self) -> (u64, u64) {
        (
            u64::from(self.pending_cur) + u64::from(self.written_cur),
            u64::from(self.pending_prev) + u64::from(self.written_prev),
        )
    }

    /// Units admitted here and not written yet.
    pub fn pending(&self) -> u64 {
        u64::from(self.pending_cur) + u64::from(self.pending_prev)
    }

    /// Takes back `cost` admitted at window `window` (the check was rejected by another item).
    pub fn undo(&mut self, window: u64, cost: u64) {
        if window == self.window {
            self.pending_cur = narrow(u64::from(self.pending_cur).saturating_sub(cost));
        } else if window + 1 == self.window {
            self.pending_prev = narrow(u64::from(self.pending_prev).saturating_sub(cost));
        }
    }

    /// Whether anything waits to be written or learned.
    pub fn busy(&self) -> bool {
        let (cur, prev) = self.unlearned();
        cur + prev > 0
    }

    /// The units to write now, as (window, units) pairs; they count as written from now on (a write
    /// that surely failed gives them back with [`Counter::resend`]).
    pub fn take(&mut self) -> [(u64, u64); 2] {
        let out = [
            (self.window, u64::from(self.pending_cur)),
            (self.window.wrapping_sub(1), u64::from(self.pending_prev)),
        ];
        self.written_cur = self.written_cur.saturating_add(self.pending_cur);
        self.written_prev = self.written_prev.saturating_add(self.pending_prev);
        self.pending_cur = 0;
        self.pending_prev = 0;
        out
    }

    /// A learn reply: Redis was at window `idx` and held `cur` for it and `prev` for the one before,
    /// every unit this counter wrote before the learn was sent included.
    pub fn learn(&mut self, idx: u64, cur: u64, prev: u64, seq: u32) {
        self.roll(idx);
        if idx == self.window {
            self.learned_cur = narrow(cur);
            self.learned_prev = narrow(prev);
            self.written_cur = 0;
            self.written_prev = 0;
            self.learned_seq = seq;
        } else if idx + 1 == self.window {
            self.learned_prev = narrow(cur);
            self.written_prev = 0;
        }
    }

    /// A write that surely failed: its units are pending again.
    pub fn resend(&mut self, target: u64, units: u64) {
        let units = narrow(units);
        if target == self.window {
            let u = units.min(self.written_cur);
            self.written_cur -= u;
            self.pending_cur = self.pending_cur.saturating_add(u);
        } else if target.wrapping_add(1) == self.window {
            let u = units.min(self.written_prev);
            self.written_prev -= u;
            self.pending_prev = self.pending_prev.saturating_add(u);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 1_000;

    #[test]
    fn a_counter_never_learned_admits_one_check_per_flush() {
        let mut c = Counter::default();
        assert_eq!(c.admit(100, W, 1, 10_000, 4, 1).1, None);
        assert_eq!(c.admit(100, W, 1, 10_001, 4, 1).1, Some(Denial::Share));
        let sent = c.take();
        assert_eq!(sent[0], (10, 1));
        // Redis holds 1 (ours) + 39 from other agents.
        c.learn(10, 40, 0, 2);
        assert_eq!(c.unlearned(), (0, 0));
        // Share: (100 − 40) / 4 = 15 until the next flush.
        let admitted = (0..30)
            .filter(|i| c.admit(100, W, 1, 10_002 + i, 4, 2).1.is_none())
            .count();
        assert_eq!(admitted, 15);
    }

    #[test]
    fn one_agent_is_exact() {
        let mut c = Counter::default();
        c.admit(10, W, 1, 5_000, 1, 1);
        c.take();
        c.learn(5, 1, 0, 2);
        let admitted = (0..20)
            .filter(|i| c.admit(10, W, 1, 5_001 + i, 1, 2).1.is_none())
            .count();
        assert_eq!(admitted, 9, "1 learned + 9 = the limit");
        let (o, d) = c.admit(10, W, 1, 5_100, 1, 2);
        assert_eq!(d, Some(Denial::Limit));
        assert!(!o.allowed && o.retry_after_ms > 0);
    }

    #[test]
    fn n_agents_together_stay_within_what_remained() {
        // Four agents learn the same total (60 of 100) at the same flush, then each admits alone.
        let mut agents: Vec<Counter> = (0..4).map(|_| Counter::default()).collect();
        let mut admitted = 0;
        for c in &mut agents {
            c.roll(3);
            c.learn(3, 60, 0, 7);
            admitted += (0..100)
                .filter(|i| c.admit(100, W, 1, 3_000 + i, 4, 7).1.is_none())
                .count();
        }
        assert_eq!(admitted, 40, "the four shares add up to the 40 that remained");
    }

    #[test]
    fn stale_counts_admit_one_check_only() {
        let mut c = Counter::default();
        c.roll(3);
        c.learn(3, 10, 0, 5);
        // LEARN_EVERY + 1 passes later without a refresh (the key was idle): stale.
        let seq = 5 + LEARN_EVERY + 1;
        assert_eq!(c.admit(100, W, 1, 3_000, 1, seq).1, None);
        assert_eq!(c.admit(100, W, 1, 3_001, 1, seq).1, Some(Denial::Share));
    }

    #[test]
    fn a_clock_estimate_behind_the_learned_window_does_not_underflow() {
        let mut c = Counter::default();
        // Redis is in window 5; this agent's estimate still says 4,999 ms.
        c.learn(5, 399, 0, 3);
        let (o, d) = c.admit(400, W, 1, 4_999, 1, 3);
        assert_eq!(d, None);
        assert_eq!(o.remaining, 0, "counted at the window's start: 399 + 1 of 400");
        assert_eq!(c.admit(400, W, 1, 4_999, 1, 3).1, Some(Denial::Limit));
        assert!(c.needs_learn(400, W, 4_999, 1, 3));
    }

    #[test]
    fn keys_far_from_their_limit_learn_less_often() {
        let mut c = Counter::default();
        c.roll(3);
        c.learn(3, 10, 0, 5);
        c.admit(1_000, W, 1, 3_100, 4, 5);
        // 1 unit used of a share of (1000 − 10) / 4: far; learned 1 pass ago.
        assert!(!c.needs_learn(1_000, W, 3_150, 4, 6));
        assert!(c.needs_learn(1_000, W, 3_150, 4, 5 + LEARN_EVERY), "stale");
        for i in 0..130 {
            c.admit(1_000, W, 1, 3_200 + i, 4, 6);
        }
        assert!(c.needs_learn(1_000, W, 3_400, 4, 6), "half the share used: near");
        c.learn(3, 500, 0, 6);
        let idle = Counter::default();
        assert!(!idle.needs_learn(1_000, W, 3_400, 4, 7), "never checked");
    }

    #[test]
    fn windows_roll_and_replies_after_a_roll_land_in_the_right_window() {
        let mut c = Counter::default();
        c.admit(100, W, 3, 2_500, 1, 1);
        let sent = c.take();
        assert_eq!(sent[0], (2, 3));
        // The window rolls before the write is learned.
        c.roll(3);
        assert_eq!((c.written_prev, c.written_cur), (3, 0));
        c.learn(3, 0, 3, 2);
        assert_eq!((c.written_prev, c.learned_prev, c.learned_cur), (0, 3, 0));
        // A failed flush puts units back to pending.
        c.admit(100, W, 2, 3_100, 1, 2);
        let sent = c.take();
        c.resend(sent[0].0, sent[0].1);
        assert_eq!((c.pending_cur, c.written_cur), (2, 0));
        c.undo(3, 2);
        assert!(!c.busy());
    }
}

#[cfg(test)]
mod simulation {
    use super::*;
    use std::collections::HashMap;

    /// Four agents, each offered 100 checks/s of one key (2× a limit of 400 per 2 s window in all),
    /// writing at each 100 ms slot start and learning half a slot later, against a simulated Redis.
    #[test]
    fn four_agents_at_twice_the_limit() {
        const W: u64 = 2_000;
        let mut agents: Vec<Counter> = (0..4).map(|_| Counter::default()).collect();
        let mut redis: HashMap<u64, u64> = HashMap::new();
        let mut seq = [1u32; 4];
        let mut admitted: HashMap<u64, u64> = HashMap::new();
        let start = 100 * W;
        for t in start..start + 4 * W {
            for (i, c) in agents.iter_mut().enumerate() {
                let d = i as u64 + 1;
                if t % 100 == d {
                    for (target, units) in c.take() {
                        if units > 0 && target + 1 >= t / W {
                            *redis.entry(target).or_default() += units;
                        }
                    }
                }
                if t % 100 == 50 + d {
                    seq[i] += 1;
                    let idx = t / W;
                    c.learn(
                        idx,
                        redis.get(&idx).copied().unwrap_or(0),
                        redis.get(&(idx - 1)).copied().unwrap_or(0),
                        seq[i],
                    );
                }
                if t % 10 == (i as u64 * 3) % 10 {
                    let (_, denial) = c.admit(400, W, 1, t, 4, seq[i]);
                    if denial.is_none() {
                        *admitted.entry(t / W).or_default() += 1;
                    }
                }
            }
        }
        let mut per_window: Vec<_> = admitted.into_iter().collect();
        per_window.sort();
        // Everyone learns the same total half a slot after everyone wrote, so the shares add up to
        // what remained: at most one check per agent (the floor) over, and no starvation.
        for (w, n) in per_window {
            assert!((380..=404).contains(&n), "window {w}: {n}");
        }
    }
}
