//! What a listener lets one client take: its cap on open connections, each peer's share of the
//! cap, and the bytes all connections may hold in frames still arriving.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most connections one listener holds open by default (each costs a task and its buffers, about
/// 16 KiB idle; a host's services need far fewer, an accept loop gone wrong far more).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4_096;

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

/// What every frames connection's read buffer holds without asking: a legitimate frame is at most
/// ~7 KiB (16 items of 256-byte keys), so it always fits; a pipelining client's read of 4 KiB of
/// small checks too.
pub const BASE_BUFFER: usize = 8 * 1024;

/// The bytes all frames connections together may hold in read buffers past [`BASE_BUFFER`] (a frame
/// of up to 64 KiB announced and still arriving): 32 MiB, 512 such frames at once. Without it, each
/// half-sent frame held ~71 KiB for as long as its sender liked, and 400 of them passed the Helm
/// chart's 32 MiB memory limit.
pub const BUFFER_BUDGET: usize = 32 << 20;

/// The budget of read-buffer bytes past [`BASE_BUFFER`], shared by the agent's frames listeners.
#[derive(Debug, Clone)]
pub struct BufferBudget {
    kib: Arc<Semaphore>,
}

impl Default for BufferBudget {
    fn default() -> Self {
        Self::new(BUFFER_BUDGET)
    }
}

impl BufferBudget {
    /// A budget of `bytes` (in whole KiB).
    pub fn new(bytes: usize) -> Self {
        BufferBudget {
            kib: Arc::new(Semaphore::new(bytes / 1024)),
        }
    }

    /// What is left, in bytes.
    pub fn available(&self) -> usize {
        self.kib.available_permits() * 1024
    }
}

/// One connection's part of the budget: grown with its buffer, given back when the buffer is (and
/// when the connection ends).
#[derive(Debug)]
pub struct Charge {
    budget: BufferBudget,
    kib: u32,
}

impl Charge {
    /// Nothing charged yet.
    pub fn new(budget: BufferBudget) -> Self {
        Charge { budget, kib: 0 }
    }

    /// Makes the charge cover a buffer of `capacity` bytes; false when the budget cannot.
    pub fn cover(&mut self, capacity: usize) -> bool {
        let want = capacity.saturating_sub(BASE_BUFFER).div_ceil(1024) as u32;
        if want <= self.kib {
            return true;
        }
        match self.budget.kib.try_acquire_many(want - self.kib) {
            Ok(p) => {
                p.forget();
                self.kib = want;
                true
            }
            Err(_) => false,
        }
    }

    /// Gives everything back (the buffer went back to its base).
    pub fn release(&mut self) {
        if self.kib > 0 {
            self.budget.kib.add_permits(self.kib as usize);
            self.kib = 0;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
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
    fn the_budget_is_charged_past_the_base_and_given_back() {
        let budget = BufferBudget::new(64 * 1024);
        let mut a = Charge::new(budget.clone());
        assert!(a.cover(BASE_BUFFER));
        assert_eq!(budget.available(), 64 * 1024);
        assert!(a.cover(BASE_BUFFER + 40 * 1024));
        assert_eq!(budget.available(), 24 * 1024);
        let mut b = Charge::new(budget.clone());
        assert!(!b.cover(BASE_BUFFER + 30 * 1024), "past the budget");
        a.release();
        assert!(b.cover(BASE_BUFFER + 30 * 1024));
        drop(b);
        assert_eq!(budget.available(), 64 * 1024);
    }
}
