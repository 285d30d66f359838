//! The frames server: the Unix socket bound safely (`bind`), TCP where asked, each listener under a
//! connection cap with a share per peer (`floodgate_core::admission`) and a shared read-buffer
//! budget (`cap`), the accept loop
//! (`listener`), and the pipelined per-connection loop with its idle and frame timeouts
//! (`connection`), which hands each frame it reads to `frames`.

mod bind;
mod cap;
mod connection;
mod frames;
mod listener;

pub use bind::bind;
pub use cap::{BufferBudget, BASE_BUFFER, BUFFER_BUDGET, DEFAULT_MAX_CONNECTIONS};
pub use connection::{
    connection, Limits, DEFAULT_FRAME_TIMEOUT, DEFAULT_IDLE_TIMEOUT, MAX_IN_FLIGHT, WRITE_TIMEOUT,
};
pub use floodgate_core::admission::{warn_refused, ConnectionCap, Peer, Refusal, Slot};
pub use listener::{serve, Listener, Serving};

/// A Unix-socket peer as `SO_PEERCRED` names it: its process where the kernel says, else its user.
pub fn local_peer(cred: tokio::net::unix::UCred) -> Peer {
    match cred.pid() {
        Some(pid) => Peer::Process { uid: cred.uid(), pid },
        None => Peer::Uid(cred.uid()),
    }
}
