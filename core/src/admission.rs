//! Who may hold a connection: a listener's cap on open connections and each peer's share of it,
//! for every listener the agent and the rules service run (frames, gRPC, admin and rules HTTP).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Who a connection belongs to, for its share of the cap: the Unix socket's peer uid
/// (`SO_PEERCRED`), a TCP or gRPC client's source address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A local user.
    Uid(u32),
    /// A remote (or loopback TCP) client.
    Ip(IpAddr),
    /// The kernel did not say (all such connections share one share).
    Unknown,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Uid(uid) => write!(f, "uid {uid}"),
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Unknown => f.write_str("an unknown peer"),
        }
    }
}

/// Why a connection was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener holds its cap.
    Full,
    /// This peer holds its share of the cap already.
    Share(Peer),
}

/// A listener's cap on open connections (each of the Unix socket, TCP and gRPC listeners has one),
/// and each peer's share of it: one local user (or one address) holding connections it never uses
/// must not leave every other client of the host with an Error 7, under which the SDKs fail open.
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    slots: Arc<Semaphore>,
    max: usize,
    per_peer: usize,
    peers: Arc<Mutex<HashMap<Peer, usize>>>,
}

/// One connection's place under the cap and in its peer's share, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    peer: Peer,
    peers: Arc<Mutex<HashMap<Peer, usize>>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = peers.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                peers.remove(&self.peer);
            }
        }
    }
}

impl ConnectionCap {
    /// At most `max` connections at once (at least 1), at most `per_peer` of them one peer's (at
    /// least 1, at most `max`).
    pub fn new(max: usize, per_peer: usize) -> Self {
        let max = max.max(1);
        ConnectionCap {
            slots: Arc::new(Semaphore::new(max)),
            max,
            per_peer: per_peer.clamp(1, max),
            peers: Arc::default(),
        }
    }

    /// The default share of one peer: a quarter of the cap, so that it takes at least four users
    /// (or addresses) to fill a listener. One SDK client is one connection per process, so 1,024
    /// processes of one user still fit.
    pub fn default_share(max: usize) -> usize {
        (max / 4).max(1)
    }

    /// A slot for one more connection of `peer`, held until it closes.
    pub fn try_acquire(&self, peer: Peer) -> Result<Slot, Refusal> {
        // `::ffff:10.0.0.1` on a dual-stack listener is the same peer as `10.0.0.1`.
        let peer = match peer {
            Peer::Ip(ip) => Peer::Ip(ip.to_canonical()),
            other => other,
        };
        // The cap first: a full listener is full for everyone, whatever their share.
        let permit = self
            .slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::Full)?;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let held = peers.get(&peer).copied().unwrap_or(0);
        if held >= self.per_peer {
            return Err(Refusal::Share(peer));
        }
        peers.insert(peer, held + 1);
        Ok(Slot {
            _permit: permit,
            peer,
            peers: self.peers.clone(),
        })
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.max
    }

    /// One peer's share of it.
    pub fn per_peer(&self) -> usize {
        self.per_peer
    }

    /// What a refused connection is told (an Error, code 7).
    pub fn refusal_message(&self, why: Refusal) -> String {
        match why {
            Refusal::Full => format!(
                "the agent holds its maximum of {} connections; try again later",
                self.max
            ),
            Refusal::Share(peer) => format!(
                "{peer} holds its share of {} of the agent's {} connections; close some",
                self.per_peer, self.max
            ),
        }
    }
}

/// Logs a refused connection, at most once every 10 s (a client reconnecting in a loop must not
/// flood the log; `floodgate_connections_refused_total` counts them all).
pub fn warn_refused(listener: &'static str, message: &str) {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(std::sync::atomic::Ordering::Relaxed);
    if now >= last + 10
        && LAST
            .compare_exchange(
                last,
                now,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
    {
        tracing::warn!(listener, "connection refused: {message}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_peer_takes_its_share_and_no_more() {
        let cap = ConnectionCap::new(8, 2);
        let (a, b) = (Peer::Uid(1000), Peer::Uid(1001));
        let a1 = cap.try_acquire(a).unwrap();
        let _a2 = cap.try_acquire(a).unwrap();
        assert_eq!(cap.try_acquire(a).unwrap_err(), Refusal::Share(a));
        let _b1 = cap.try_acquire(b).unwrap();
        drop(a1);
        let _a3 = cap.try_acquire(a).unwrap();
        assert!(cap
            .refusal_message(Refusal::Share(a))
            .contains("uid 1000 holds its share of 2"));
    }

    #[test]
    fn the_cap_holds_across_peers() {
        let cap = ConnectionCap::new(2, 2);
        let _x = cap.try_acquire(Peer::Uid(1)).unwrap();
        let _y = cap.try_acquire(Peer::Uid(2)).unwrap();
        assert_eq!(cap.try_acquire(Peer::Uid(3)).unwrap_err(), Refusal::Full);
        // A refused try leaves no count behind.
        assert!(!cap.peers.lock().unwrap().contains_key(&Peer::Uid(3)));
    }

    #[test]
    fn a_peer_gets_a_quarter_and_the_cap_holds_for_all() {
        let cap = ConnectionCap::new(8, ConnectionCap::default_share(8));
        let ip = |last: u8| Peer::Ip([10, 0, 0, last].into());
        let mut held: Vec<Slot> = (0..2).filter_map(|_| cap.try_acquire(ip(1)).ok()).collect();
        assert_eq!(held.len(), 2);
        assert!(cap.try_acquire(ip(1)).is_err(), "a's share is 8 / 4 = 2");
        for last in 2..=4 {
            held.extend((0..2).filter_map(|_| cap.try_acquire(ip(last)).ok()));
        }
        assert_eq!(held.len(), 8);
        assert!(cap.try_acquire(ip(5)).is_err(), "the cap is full");
        held.remove(0);
        assert!(cap.try_acquire(ip(1)).is_ok(), "a slot given back is a's again");
        drop(held);
        assert!(cap.peers.lock().unwrap().is_empty(), "no peer is left counted");
    }

    #[test]
    fn a_mapped_ipv4_address_is_the_same_peer() {
        let cap = ConnectionCap::new(8, 1);
        let _v4 = cap.try_acquire(Peer::Ip([10, 0, 0, 1].into())).unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert!(cap.try_acquire(Peer::Ip(mapped)).is_err());
    }

    #[test]
    fn a_tiny_cap_still_admits_one_per_peer() {
        let cap = ConnectionCap::new(0, ConnectionCap::default_share(0));
        assert_eq!((cap.max(), cap.per_peer()), (1, 1));
    }
}
