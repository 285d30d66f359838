//! Peers whose gRPC connection was closed for spending a budget (GOAWAY `ENHANCE_YOUR_CALM`): their
//! new connections are refused for a while, 1 s after the first such close, doubling with each
//! repeat within a minute, at most 30 s. Without it a peer that reconnects after every GOAWAY makes
//! the budget itself the cost: four connections resetting streams in a loop, each closed after
//! 200, reopened ~500 connections and ~100,000 streams a second and pushed honest clients' p99 past
//! 10 ms (BENCHMARKS.md, "Hostile gRPC peers").

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::server::Peer;

/// The first refusal period.
pub const FIRST: Duration = Duration::from_secs(1);

/// The longest.
pub const LONGEST: Duration = Duration::from_secs(30);

/// A peer with no budget spent for this long starts again at [`FIRST`].
pub const FORGIVEN: Duration = Duration::from_secs(60);

/// Peers remembered at most (past it, those whose period is over are forgotten first, and a new one
/// is not recorded while all are current).
pub const MAX_PEERS: usize = 4_096;

#[derive(Debug, Clone, Copy)]
struct Penalty {
    until: Instant,
    next: Duration,
    last: Instant,
}

/// The peers refused for now, and how long their next refusal lasts.
#[derive(Debug, Default)]
pub struct Penalties {
    peers: Mutex<HashMap<Peer, Penalty>>,
}

impl Penalties {
    /// `peer` spent a budget at `now`: refused until its period is over.
    pub fn punish(&self, peer: Peer, now: Instant) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.len() >= MAX_PEERS && !peers.contains_key(&peer) {
            peers.retain(|_, p| p.until > now);
            if peers.len() >= MAX_PEERS {
                return;
            }
        }
        let p = peers.entry(peer).or_insert(Penalty {
            until: now,
            next: FIRST,
            last: now,
        });
        if now >= p.last + FORGIVEN {
            p.next = FIRST;
        }
        p.until = now + p.next;
        p.next = (p.next * 2).min(LONGEST);
        p.last = now;
    }

    /// How much longer `peer` is refused at `now`, if it is.
    pub fn refused(&self, peer: Peer, now: Instant) -> Option<Duration> {
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers
            .get(&peer)
            .and_then(|p| p.until.checked_duration_since(now))
            .filter(|d| !d.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_doubles_the_period_and_a_quiet_minute_forgives() {
        let penalties = Penalties::default();
        let peer = Peer::Ip([10, 0, 0, 1].into());
        let t = Instant::now();
        assert_eq!(penalties.refused(peer, t), None);
        penalties.punish(peer, t);
        assert_eq!(penalties.refused(peer, t), Some(FIRST));
        assert_eq!(penalties.refused(peer, t + FIRST), None, "over after 1 s");
        penalties.punish(peer, t + FIRST);
        assert_eq!(penalties.refused(peer, t + FIRST), Some(2 * FIRST));
        for i in 2..10 {
            penalties.punish(peer, t + i * FIRST);
        }
        assert_eq!(
            penalties.refused(peer, t + 9 * FIRST),
            Some(LONGEST),
            "at most 30 s"
        );
        let later = t + 9 * FIRST + FORGIVEN;
        penalties.punish(peer, later);
        assert_eq!(
            penalties.refused(peer, later),
            Some(FIRST),
            "forgiven after a quiet minute"
        );
        assert_eq!(
            penalties.refused(Peer::Ip([10, 0, 0, 2].into()), t),
            None,
            "another peer"
        );
    }
}
