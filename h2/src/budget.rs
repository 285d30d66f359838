//! What one connection may make the agent hold or redo before it is refused: answer bytes parked
//! behind flow control (per connection and agent-wide), a budget of streams it resets or gets
//! refused and of settings it changes, and the memory of streams lately closed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Answer bytes one connection may have waiting for flow-control window. An honest peer parks
/// nothing: Envoy opens a 1 MiB connection window and 256 MiB per stream, and reads as it goes.
pub const MAX_PARKED_BYTES: usize = 64 * 1024;

/// Answers one connection may have waiting for window, whatever their size: at this many, a new
/// stream is refused (REFUSED_STREAM, before any work is done for it) until window comes.
pub const MAX_PARKED_STREAMS: usize = 32;

/// Answer bytes all gRPC connections together may have waiting for window: past it an answer that
/// cannot be sent at once is dropped and its stream reset (ENHANCE_YOUR_CALM).
pub const AGENT_PARKED_BYTES: usize = 8 * 1024 * 1024;

/// What a connection may spend before GOAWAY ENHANCE_YOUR_CALM: one unit for each stream the client
/// resets before its answer is written, each stream refused or reset for a fault of the client's,
/// and each SETTINGS frame (whose window change costs a pass over the streams); each call answered
/// gives one back. A client that resets every call it makes (the rapid reset attack, CVE-2023-44487)
/// is closed after 200; one that cancels fewer calls than it completes never is. (h2 closes after
/// 20 streams reset before the server accepted them; here work has started on every stream.)
pub const CALM: u32 = 200;

/// Streams lately closed that the connection remembers (frames on them after they closed are
/// judged by how they closed, RFC 9113 §5.1).
pub const REMEMBERED: usize = 128;

/// Answer bytes parked by every connection of the agent.
static PARKED: AtomicUsize = AtomicUsize::new(0);

/// One connection's parked answer bytes, counted agent-wide too (given back when dropped).
#[derive(Debug, Default)]
pub struct Parked {
    bytes: usize,
}

impl Parked {
    /// Takes `n` bytes if this connection and the agent both have room for them.
    pub fn take(&mut self, n: usize, streams: usize) -> bool {
        if self.bytes + n > MAX_PARKED_BYTES || streams >= MAX_PARKED_STREAMS {
            return false;
        }
        if PARKED.fetch_add(n, Ordering::Relaxed) + n > AGENT_PARKED_BYTES {
            PARKED.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        self.bytes += n;
        true
    }

    /// Gives `n` bytes back.
    pub fn give(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        PARKED.fetch_sub(n, Ordering::Relaxed);
    }

    /// This connection's parked bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        PARKED.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// How a stream closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// This server reset it: frames the client sent before it knew are ignored.
    ByUs,
    /// Both sides ended it, or the client reset it: a frame on it is STREAM_CLOSED.
    Done,
}

/// The last [`REMEMBERED`] streams closed, newest last.
#[derive(Debug, Default)]
pub struct ClosedStreams {
    ring: VecDeque<(u32, Closed)>,
}

impl ClosedStreams {
    /// Remembers that `id` closed `how`.
    pub fn push(&mut self, id: u32, how: Closed) {
        if self.ring.len() == REMEMBERED {
            self.ring.pop_front();
        }
        self.ring.push_back((id, how));
    }

    /// How `id` closed, if it is remembered.
    pub fn get(&self, id: u32) -> Option<Closed> {
        self.ring
            .iter()
            .rev()
            .find(|(i, _)| *i == id)
            .map(|(_, how)| *how)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_bytes_are_bounded_per_connection_and_given_back() {
        let mut a = Parked::default();
        assert!(a.take(MAX_PARKED_BYTES - 10, 0));
        assert!(!a.take(11, 1), "past the connection's budget");
        assert!(a.take(10, 1));
        assert!(!a.take(1, MAX_PARKED_STREAMS), "past the connection's streams");
        a.give(MAX_PARKED_BYTES);
        assert_eq!(a.bytes(), 0);
        assert!(a.take(100, 0));
        drop(a);
    }

    #[test]
    fn closed_streams_remember_the_newest() {
        let mut c = ClosedStreams::default();
        for id in 0..REMEMBERED as u32 + 10 {
            c.push(2 * id + 1, if id % 2 == 0 { Closed::ByUs } else { Closed::Done });
        }
        assert_eq!(c.get(1), None, "forgotten");
        assert_eq!(c.get(2 * (REMEMBERED as u32 + 9) + 1), Some(Closed::Done));
        assert_eq!(c.get(2 * (REMEMBERED as u32 + 8) + 1), Some(Closed::ByUs));
    }
}
