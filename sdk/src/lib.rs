//! Floodgate's client SDK: ask the local agent whether a request may pass.
//!
//! One [`Client`] per process holds one multiplexed Unix-socket connection to the agent: many checks
//! are in flight at once, each with its own request id. Every call returns within its timeout
//! (default 10 ms). When the agent is unreachable or late, the call answers by its fail policy —
//! open (allow) by default, closed (deny with a Retry-After) where configured, and closed for the
//! rules the agent lists as `failMode = "closed"` (the client asks after connecting and every 10 s,
//! and keeps the list while the agent is away) — and the client reconnects in the background with
//! backoff. Nothing here panics on what the agent sends.
//!
//! # Layout
//! - `config`: [`ClientConfig`], [`CallOptions`], [`FailPolicy`], [`LocalLimit`].
//! - `client`: [`Client`]: the calls, what a call answers when the agent cannot, health and stats.
//! - `state`: what the handles and the connection task share (pending calls, the link's history,
//!   counters, the agent's fail-mode list).
//! - `decision`: [`Decision`] and where it came from ([`Origin`]).
//! - `error`: [`Error`].
//! - `connection`: the background task that owns the socket, dispatches answers, asks for the
//!   fail-mode list and reconnects (it knows `state`, never `client`).
//! - `socket`: the default socket path ([`default_socket_path`]), the same in every SDK and the agent.
//! - [`middleware`] (feature `tower`; `axum` for the matched route and peer address): the tower Layer
//!   that sets the rate-limit headers and answers 429s: `layer`, `service`, `extractors`, `headers`.
//!
//! # Example
//! ```no_run
//! use floodgate_sdk::{Client, Item};
//!
//! async fn handle(client: &Client) -> Result<(), floodgate_sdk::Error> {
//!     let d = client.allow("user:123", "api-per-user", 1).await?;
//!     if !d.allowed {
//!         println!("429, retry in {} ms", d.retry_after_ms.unwrap_or(0));
//!     }
//!     // Several limits at once: allowed only if all pass, and a denial consumes nothing.
//!     let items = vec![Item::new("user:123", "api-per-user", 1), Item::new("ip:203.0.113.5", "login-per-ip", 1)];
//!     let _d = client.check(items).await?;
//!     Ok(())
//! }
//!
//! # async fn main_() -> Result<(), floodgate_sdk::Error> {
//! // One client per process; clones share its connection. The agent's default socket
//! // ($FLOODGATE_SOCKET, else /run/floodgate/floodgate.sock, else $XDG_RUNTIME_DIR/floodgate/…):
//! let client = Client::connect_default().await;
//! handle(&client).await
//! # }
//! ```

mod client;
mod config;
mod connection;
mod decision;
mod error;
#[cfg(feature = "tower")]
pub mod middleware;
mod reserve;
mod socket;
mod state;

pub use client::{Client, ClientStats, Health, Lease};
pub use config::{CallOptions, ClientConfig, FailPolicy, LocalLimit};
pub use decision::{Decision, Degraded, Origin};
pub use error::Error;
pub use floodgate_protocol::{Attributes, Item, ItemDecision, ItemMode, Source};
pub use reserve::{Meter, Reservation};
pub use socket::{default_socket_path, user_socket, DEFAULT_SOCKET, SOCKET_ENV};
