//! Support for Floodgate's integration tests and benchmarks: real `redis-server` and `floodgate agent`
//! processes on free loopback ports and temporary sockets, killed on drop, plus small helpers.
//!
//! # Layout
//! - `redis`: [`RedisServer`], one `redis-server` process (kill, restart, pause).
//! - `cluster`: [`Shards`] (independent servers) and [`Cluster`] (a Redis Cluster of real nodes).
//! - `agent`: [`Agent`], one `floodgate agent` process.
//! - `wire`: [`RawConn`], a bare protocol connection for sending hand-made frames.
//! - `wait`: [`eventually`], polling with a patience bound instead of fixed sleeps.
//! - [`faults`]: the seeded fault runner: real Redis and agents with ledgers, a load, faults from a
//!   seed, the checker's verdict.
//! - `sentinel`: [`Sentinel`], a real `redis-server --sentinel` watching one master.
//! - `proxy`: [`Proxy`], a TCP proxy that injects latency between an agent and Redis.
//! - `rules`: [`RulesServer`] (a `floodgate rules-server` process) and [`PgDatabase`].
//! - `fleet`: [`Fleet`], one fixture for a Redis, a rules service and agents following both.
//! - [`raw_h2`]: hand-made HTTP/2 frames to the agent's gRPC listener, and its answers read back.
//! - [`raw_http`]: hand-made HTTP/1.1 from a chosen loopback address: half-sent requests, one
//!   exchange on a kept-alive connection, whether the server closed it.
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
mod cluster;
pub mod faults;
mod fleet;
mod pki;
mod proxy;
pub mod raw_h2;
pub mod raw_http;
mod redis;
mod rules;
mod sentinel;
mod wait;
mod wire;

pub use agent::{floodgate_bin, Agent, AgentBuilder, PATIENT_STORE_TIMEOUT_MS};
pub use cluster::{command_calls, dbsize, Cluster, Shards};
pub use fleet::{rules_call, rules_version, wait_rules_version, Fleet, OPERATOR_TOKEN};
pub use pki::TestCa;
pub use proxy::Proxy;
pub use redis::{redis_time_ms, sleep_until_window_offset, window_count, window_count_at, RedisServer};
pub use rules::{PgDatabase, RulesServer};
pub use sentinel::{replica_and_sentinel, replication_info, Sentinel};
pub use wait::eventually;
pub use wire::RawConn;

/// The agent's rejection events so far (`XRANGE floodgate:rejections - +`), each as its fields
/// (`key`, `ruleId`, `ts`, `agent`, `version`, `mode`); none while the stream does not exist.
pub fn rejection_events(conn: &mut ::redis::Connection) -> Vec<std::collections::HashMap<String, String>> {
    let entries: Vec<(String, Vec<(String, String)>)> = ::redis::cmd("XRANGE")
        .arg("floodgate:rejections")
        .arg("-")
        .arg("+")
        .query(conn)
        .unwrap_or_default();
    entries
        .into_iter()
        .map(|(_, fields)| fields.into_iter().collect())
        .collect()
}

/// The agent's `/v1/status`.
pub async fn agent_status(agent: &Agent) -> serde_json::Value {
    let (code, body) = http_get(agent.admin_addr().await, "/v1/status").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("status is JSON")
}

/// An SDK client with 2 s call and connect timeouts: for tests that check figures, not latency, where
/// a fail-policy answer on a loaded machine would spoil the count.
pub async fn patient_client(socket: &std::path::Path) -> floodgate_sdk::Client {
    let config = floodgate_sdk::ClientConfig {
        timeout: std::time::Duration::from_secs(2),
        connect_timeout: std::time::Duration::from_secs(2),
        ..Default::default()
    };
    floodgate_sdk::Client::with_config(socket, config).await
}

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

/// SIGSTOPs a process and waits until every one of its threads is stopped (state `T` in /proc), so
/// that a test knows the process can no longer answer. Panics after 5 s.
pub fn pause_process(pid: u32) {
    signal(pid, 19);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process exists");
        let all_stopped = tasks.filter_map(Result::ok).all(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            // The state follows the command name in parentheses: "pid (comm) T ...".
            stat.rsplit_once(") ")
                .map(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
                .unwrap_or(true)
        });
        if all_stopped {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// SIGCONTs a process paused by [`pause_process`].
pub fn resume_process(pid: u32) {
    signal(pid, 18);
}

/// A plain HTTP/1.1 GET against an agent's admin address: (status code, body). Panics after 5 s.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_request(addr, "GET", path, "").await
}

/// A plain HTTP/1.1 request with a JSON body (empty for none): (status code, body). Panics after 5 s.
pub async fn http_request(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect admin");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(format!("{head}{body}").as_bytes())
            .await
            .expect("write request");
        let mut resp = String::new();
        s.read_to_string(&mut resp).await.expect("read response");
        let code = resp.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = resp
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (code, body)
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), fut)
        .await
        .expect("admin answered within 5 s")
}
