//! Support for Floodgate's integration tests and benchmarks: real `redis-server` and `floodgate agent`
//! processes on free loopback ports and temporary sockets, killed on drop, plus small helpers.
//!
//! # Layout
//! - `redis`: [`RedisServer`], one `redis-server` process (kill, restart, pause).
//! - `agent`: [`Agent`], one `floodgate agent` process.
//! - `wire`: [`RawConn`], a bare protocol connection for sending hand-made frames.
//! - `wait`: [`eventually`], polling with a patience bound instead of fixed sleeps.
//!
//! # Example
//! ```no_run
//! # async fn demo() {
//! use floodgate_tests::{Agent, RedisServer};
//!
//! let redis = RedisServer::start();
//! let agent = Agent::builder().redis(&redis.url()).start().await;
//! let client = floodgate_sdk::Client::connect(agent.socket()).await;
//! assert!(client.allow("user:1", "api-per-user", 1).await.unwrap().allowed);
//! # }
//! ```

mod agent;
mod redis;
mod wait;
mod wire;

pub use agent::{floodgate_bin, Agent, AgentBuilder};
pub use redis::{redis_time_ms, sleep_until_window_offset, RedisServer};
pub use wait::eventually;
pub use wire::RawConn;

/// A free TCP port on 127.0.0.1 (bound and released; good enough for test processes).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Sends a signal (by number: 15 TERM, 19 STOP, 18 CONT) to a process, through kill(1) so that no
/// unsafe code is needed.
pub fn signal(pid: u32, sig: i32) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}
