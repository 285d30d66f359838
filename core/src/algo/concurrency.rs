//! Units in flight: a key holds leases, each some units until its holder releases it or its time runs
//! out; an acquire passes while the units held plus its own stay within the limit. The same maths as
//! `lua/concurrency.lua`.

use super::Outcome;

/// Longest a denied acquire is told to wait: holders usually release long before their lease runs
/// out, so the time to the soonest expiry is only an upper bound.
pub const MAX_RETRY_MS: u64 = 1_000;

/// One lease a key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldLease {
    /// The lease id (the client's, or one the agent picked).
    pub id: u64,
    /// Units it holds.
    pub units: u64,
    /// Unix ms at which it runs out.
    pub expires_at_ms: u64,
}

/// The leases one key holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseSet {
    leases: Vec<HeldLease>,
}

impl LeaseSet {
    /// Drops the leases that ran out by `now`.
    pub fn expire(&mut self, now: u64) {
        self.leases.retain(|l| l.expires_at_ms > now);
    }

    /// Units held by leases live at `now`.
    pub fn held(&self, now: u64) -> u64 {
        self.live(now).map(|l| l.units).sum()
    }

    /// How many leases are live at `now`.
    pub fn count(&self, now: u64) -> usize {
        self.live(now).count()
    }

    /// When the last live lease runs out (`now` if none).
    pub fn last_expiry(&self, now: u64) -> u64 {
        self.live(now).map(|l| l.expires_at_ms).max().unwrap_or(now)
    }

    fn live(&self, now: u64) -> impl Iterator<Item = &HeldLease> {
        self.leases.iter().filter(move |l| l.expires_at_ms > now)
    }

    fn position(&self, id: u64, units: u64, now: u64) -> Option<usize> {
        self.leases
            .iter()
            .position(|l| l.id == id && l.units == units && l.expires_at_ms > now)
    }
}

/// The figures of a key that holds `held` units of `limit` now, for `cost` more: allowed when they
/// fit, else the wait until the soonest lease runs out (at most [`MAX_RETRY_MS`]).
fn verdict(set: &LeaseSet, limit: u64, cost: u64, now: u64) -> Outcome {
    let held = set.held(now);
    let allowed = held + cost <= limit;
    let retry_after_ms = if allowed {
        0
    } else {
        let soonest = set.live(now).map(|l| l.expires_at_ms).min().unwrap_or(now + 1);
        (soonest - now).clamp(1, MAX_RETRY_MS)
    };
    Outcome {
        allowed,
        limit,
        remaining: limit.saturating_sub(held),
        reset_at_ms: set.last_expiry(now),
        retry_after_ms,
    }
}

/// Whether `cost` more units would fit now; nothing changes.
pub fn concurrency_peek(set: &LeaseSet, limit: u64, cost: u64, now: u64) -> Outcome {
    verdict(set, limit, cost, now)
}

/// Acquires `cost` units under lease `id` for `lease_ms`: the outcome, and the set to keep if the
/// check commits (the same lease held again, with the same units, is renewed and always passes).
pub fn concurrency_acquire(
    set: &LeaseSet,
    limit: u64,
    lease_ms: u64,
    id: u64,
    cost: u64,
    now: u64,
) -> (Outcome, LeaseSet) {
    let expires_at_ms = now + lease_ms;
    let mut next = set.clone();
    next.expire(now);
    if let Some(at) = next.position(id, cost, now) {
        // Renewed: the figures as they were, its end now the later of the last one's and its own.
        let mut o = verdict(&next, limit, 0, now);
        next.leases[at].expires_at_ms = expires_at_ms;
        o.allowed = true;
        o.retry_after_ms = 0;
        o.reset_at_ms = o.reset_at_ms.max(expires_at_ms);
        return (o, next);
    }
    let o = verdict(&next, limit, cost, now);
    if !o.allowed {
        return (o, next);
    }
    next.leases.push(HeldLease {
        id,
        units: cost,
        expires_at_ms,
    });
    let mut after = verdict(&next, limit, 0, now);
    after.allowed = true;
    (after, next)
}

/// Releases lease `id` of `cost` units, or without an id up to `cost` units of whole leases, the
/// soonest to run out first. Always allowed; the figures after.
pub fn concurrency_release(set: &mut LeaseSet, limit: u64, id: Option<u64>, cost: u64, now: u64) -> Outcome {
    set.expire(now);
    match id {
        Some(id) => {
            if let Some(at) = set.position(id, cost, now) {
                set.leases.swap_remove(at);
            }
        }
        None => {
            // Redis's order: by expiry, then by member (`<id>:<units>`) as text.
            set.leases
                .sort_by_cached_key(|l| (l.expires_at_ms, format!("{}:{}", l.id, l.units)));
            let mut left = cost;
            set.leases.retain(|l| {
                if left > 0 && l.units <= left {
                    left -= l.units;
                    false
                } else {
                    true
                }
            });
        }
    }
    let mut o = verdict(set, limit, 0, now);
    o.allowed = true;
    o.retry_after_ms = 0;
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_at_most_the_limit_and_frees_on_release_or_expiry() {
        let now = 1_000_000;
        let set = LeaseSet::default();
        let (o, set) = concurrency_acquire(&set, 3, 10_000, 1, 2, now);
        assert!(o.allowed);
        assert_eq!((o.remaining, o.reset_at_ms), (1, now + 10_000));
        let (o, set2) = concurrency_acquire(&set, 3, 10_000, 2, 2, now + 5);
        assert!(!o.allowed, "2 + 2 > 3");
        assert_eq!(o.remaining, 1);
        assert_eq!(
            o.retry_after_ms, MAX_RETRY_MS,
            "soonest expiry is 10 s away: capped"
        );
        assert_eq!(set2.held(now + 5), 2, "a denied acquire holds nothing");
        // The same lease again renews it and passes even at the limit.
        let (o, set) = concurrency_acquire(&set, 2, 10_000, 1, 2, now + 100);
        assert!(o.allowed);
        assert_eq!(o.reset_at_ms, now + 10_100);
        let mut set = set;
        let o = concurrency_release(&mut set, 3, Some(1), 1, now + 200);
        assert_eq!(o.remaining, 1, "a release with other units frees nothing");
        let o = concurrency_release(&mut set, 3, Some(1), 2, now + 200);
        assert_eq!((o.remaining, o.reset_at_ms), (3, now + 200));
        // Expiry: a lease whose holder died frees itself.
        let (_, set) = concurrency_acquire(&set, 3, 10_000, 9, 3, now);
        assert!(!concurrency_peek(&set, 3, 1, now + 9_999).allowed);
        let o = concurrency_peek(&set, 3, 1, now + 9_999);
        assert_eq!(o.retry_after_ms, 1);
        assert!(concurrency_peek(&set, 3, 3, now + 10_000).allowed);
    }

    #[test]
    fn a_release_by_count_frees_whole_leases_soonest_first() {
        let now = 5_000;
        let mut set = LeaseSet::default();
        for (id, units, at) in [(1, 1, 300), (2, 2, 100), (3, 1, 200)] {
            set = concurrency_acquire(&set, 10, at, id, units, now).1;
        }
        let o = concurrency_release(&mut set, 10, None, 2, now);
        // Lease 2 (2 units, soonest) fits exactly; nothing else.
        assert_eq!(o.remaining, 8);
        assert_eq!(set.count(now), 2);
        let o = concurrency_release(&mut set, 10, None, 1, now);
        assert_eq!(o.remaining, 9);
        assert_eq!(set.last_expiry(now), now + 300, "lease 3 went first");
        // Leases that run out together go in Redis's order, their members as text: "10:1" before
        // "9:2", so a release of 2 frees the 1-unit lease and then none fits.
        let mut set = LeaseSet::default();
        for (id, units) in [(9, 2), (10, 1)] {
            set = concurrency_acquire(&set, 10, 100, id, units, now).1;
        }
        let o = concurrency_release(&mut set, 10, None, 2, now);
        assert_eq!(o.remaining, 8, "only lease 10 went");
    }
}
