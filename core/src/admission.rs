//! Who may hold a connection: a listener's cap on open connections and each peer's share of it,
//! for every listener the agent and the rules service run (frames, gRPC, admin and rules HTTP).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Who a connection belongs to, for its share of the cap: the Unix socket's peer process and uid
/// (`SO_PEERCRED`), a TCP or gRPC client's source address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A local process, and its user.
    Process {
        /// Its uid: the share it counts against.
        uid: u32,
        /// Its pid: a process holds at most a quarter of its user's share.
        pid: i32,
    },
    /// A local user (the kernel named no process).
    Uid(u32),
    /// A remote (or loopback TCP) client.
    Ip(IpAddr),
    /// The kernel did not say (all such connections share one share).
    Unknown,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Process { uid, pid } => write!(f, "uid {uid} (pid {pid})"),
            Peer::Uid(uid) => write!(f, "uid {uid}"),
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Unknown => f.write_str("an unknown peer"),
        }
    }
}

impl Peer {
    /// The peer whose share this one also counts against: a process's user.
    pub fn group(self) -> Peer {
        match self {
            Peer::Process { uid, .. } => Peer::Uid(uid),
            other => other,
        }
    }

    /// The network this peer is on, as far as an address tells it, for its part of the slots kept
    /// for newcomers: 127.0.0.0/8 is one host, an IPv6 address's /64 one network (a host holds many
    /// such addresses, and must not pose as many newcomers); a local process is its user.
    pub fn network(self) -> Peer {
        match self {
            Peer::Process { uid, .. } => Peer::Uid(uid),
            Peer::Ip(IpAddr::V4(v4)) if v4.is_loopback() => Peer::Ip(IpAddr::V4([127, 0, 0, 0].into())),
            Peer::Ip(IpAddr::V6(v6)) => {
                let mut o = v6.octets();
                o[8..].fill(0);
                Peer::Ip(IpAddr::V6(o.into()))
            }
            other => other,
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

/// A listener's cap on open connections (each of the Unix socket, TCP, gRPC and HTTP listeners has
/// one), and each peer's share of it: one local user (or one address) holding connections it never
/// uses must not leave every other client of the host with an Error 7, under which the SDKs fail
/// open. Three rules, checked when a connection comes:
///
/// - a peer (an address; a user) holds at most `per_peer` connections, and one process at most a
///   quarter of its user's share;
/// - the last eighth of the cap is kept for peers that hold no connection yet, so a few greedy peers
///   at their share cannot leave a newcomer (a probe, a new gRPC channel) nothing;
/// - one network ([`Peer::network`]: 127.0.0.0/8, an IPv6 /64, a user) holds at most a quarter of
///   that kept eighth, so a host cycling through its addresses cannot take it all.
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    slots: Arc<Semaphore>,
    max: usize,
    per_peer: usize,
    per_process: usize,
    /// Slots only a peer holding none may take.
    reserve: usize,
    held: Arc<Mutex<Held>>,
}

/// What each peer, user and network holds.
#[derive(Debug, Default)]
struct Held {
    peers: HashMap<Peer, usize>,
    /// A user's connections over all its processes.
    groups: HashMap<Peer, usize>,
    /// Kept slots each network holds.
    kept: HashMap<Peer, usize>,
}

/// One connection's place under the cap and in its peer's share, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    peer: Peer,
    /// One of the slots kept for newcomers.
    kept: bool,
    held: Arc<Mutex<Held>>,
}

impl Slot {
    /// Whose connection this is.
    pub fn peer(&self) -> Peer {
        self.peer
    }
}

fn give_back(map: &mut HashMap<Peer, usize>, key: Peer) {
    if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        give_back(&mut held.peers, self.peer);
        if self.peer.group() != self.peer {
            give_back(&mut held.groups, self.peer.group());
        }
        if self.kept {
            give_back(&mut held.kept, self.peer.network());
        }
    }
}

impl ConnectionCap {
    /// At most `max` connections at once (at least 1), at most `per_peer` of them one peer's (at
    /// least 1, at most `max`).
    pub fn new(max: usize, per_peer: usize) -> Self {
        let max = max.max(1);
        let per_peer = per_peer.clamp(1, max);
        ConnectionCap {
            slots: Arc::new(Semaphore::new(max)),
            max,
            per_peer,
            per_process: (per_peer / 4).max(1),
            reserve: max / 8,
            held: Arc::default(),
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
        let in_use = self.max - self.slots.available_permits();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mine = held.peers.get(&peer).copied().unwrap_or(0);
        let own_share = match peer {
            Peer::Process { .. } => self.per_process,
            _ => self.per_peer,
        };
        if mine >= own_share {
            return Err(Refusal::Share(peer));
        }
        let group = peer.group();
        if group != peer && held.groups.get(&group).copied().unwrap_or(0) >= self.per_peer {
            return Err(Refusal::Share(group));
        }
        let kept = in_use > self.max - self.reserve;
        if kept {
            let network = held.kept.get(&peer.network()).copied().unwrap_or(0);
            if mine > 0 || network >= (self.reserve / 4).max(1) {
                return Err(Refusal::Full);
            }
            *held.kept.entry(peer.network()).or_default() += 1;
        }
        *held.peers.entry(peer).or_default() += 1;
        if group != peer {
            *held.groups.entry(group).or_default() += 1;
        }
        Ok(Slot {
            _permit: permit,
            peer,
            kept,
            held: self.held.clone(),
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
        assert!(!cap.held.lock().unwrap().peers.contains_key(&Peer::Uid(3)));
    }

    #[test]
    fn a_peer_gets_a_quarter_and_the_last_eighth_is_kept_for_newcomers() {
        let cap = ConnectionCap::new(8, ConnectionCap::default_share(8));
        let ip = |last: u8| Peer::Ip([10, 0, 0, last].into());
        let mut held: Vec<Slot> = (0..2).filter_map(|_| cap.try_acquire(ip(1)).ok()).collect();
        assert_eq!(held.len(), 2);
        assert!(cap.try_acquire(ip(1)).is_err(), "a's share is 8 / 4 = 2");
        for last in 2..=4 {
            held.extend((0..2).filter_map(|_| cap.try_acquire(ip(last)).ok()));
        }
        assert_eq!(held.len(), 7, "four greedy peers leave the last slot");
        held.push(cap.try_acquire(ip(5)).expect("a newcomer takes the kept slot"));
        assert_eq!(
            cap.try_acquire(ip(6)).unwrap_err(),
            Refusal::Full,
            "the cap is full"
        );
        held.remove(0);
        assert_eq!(
            cap.try_acquire(ip(1)).unwrap_err(),
            Refusal::Full,
            "a's freed slot is the kept one now: a holds one already"
        );
        held.remove(0);
        assert!(
            cap.try_acquire(ip(1)).is_ok(),
            "a holding none is a newcomer again"
        );
        drop(held);
        let held = cap.held.lock().unwrap();
        assert!(
            held.peers.is_empty() && held.kept.is_empty(),
            "no peer is left counted"
        );
    }

    #[test]
    fn a_process_gets_a_quarter_of_its_users_share() {
        let cap = ConnectionCap::new(64, ConnectionCap::default_share(64));
        let p = |pid| Peer::Process { uid: 1000, pid };
        let greedy: Vec<Slot> = (0..200).filter_map(|_| cap.try_acquire(p(7)).ok()).collect();
        assert_eq!(greedy.len(), 4, "16 for uid 1000, 4 for one of its processes");
        assert!(cap
            .refusal_message(Refusal::Share(p(7)))
            .contains("uid 1000 (pid 7) holds its share"));
        let others: Vec<Slot> = (8..40).filter_map(|pid| cap.try_acquire(p(pid)).ok()).collect();
        assert_eq!(others.len(), 12, "the rest of the user's share, one each");
        assert_eq!(
            cap.try_acquire(p(50)).unwrap_err(),
            Refusal::Share(Peer::Uid(1000))
        );
        assert!(
            cap.try_acquire(Peer::Process { uid: 1001, pid: 60 }).is_ok(),
            "another user"
        );
        drop((greedy, others));
        assert!(cap.held.lock().unwrap().groups.is_empty());
    }

    #[test]
    fn a_host_cycling_addresses_takes_a_quarter_of_the_kept_slots() {
        let lo = |last: u8| Peer::Ip([127, 0, 0, last].into());
        assert_eq!(lo(2).network(), lo(9).network());
        let v6 = |s: &str| Peer::Ip(s.parse().unwrap());
        assert_eq!(v6("2001:db8::1").network(), v6("2001:db8::ffff:1").network());
        assert_ne!(v6("2001:db8::1").network(), v6("2001:db8:0:1::1").network());
        let cap = ConnectionCap::new(64, ConnectionCap::default_share(64));
        // 200 loopback addresses, each taking all it can: 56 slots at their shares, and of the 8
        // kept for newcomers, 2 for the loopback network.
        let held: Vec<Slot> = (2..=201u8)
            .flat_map(|last| (0..16).map(move |_| last))
            .filter_map(|last| cap.try_acquire(lo(last)).ok())
            .collect();
        assert_eq!(held.len(), 58);
        // Other hosts still find room, one connection each.
        assert!(cap.try_acquire(v6("::1")).is_ok());
        let a = cap.try_acquire(Peer::Ip([10, 1, 1, 1].into())).unwrap();
        assert_eq!(
            cap.try_acquire(Peer::Ip([10, 1, 1, 1].into())).unwrap_err(),
            Refusal::Full
        );
        drop((held, a));
        let held = cap.held.lock().unwrap();
        assert!(held.peers.is_empty() && held.kept.is_empty());
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
