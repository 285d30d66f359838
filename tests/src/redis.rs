//! One real `redis-server` process on a free loopback port, in a temporary directory.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// A `redis-server` the test owns: `--save ""`, no AOF, killed on drop. `REDIS_SERVER_BIN` names
/// another binary.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server and waits until it answers PING.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra arguments (e.g. `["--maxmemory", "10mb"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_on(free_port(), extra)
    }

    /// Starts a server on this port with extra arguments.
    pub fn start_on(port: u16, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut s = RedisServer {
            child: None,
            port,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let log = self.dir.path().join("redis.log");
        let child = Command::new(&bin)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(&log)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {bin} (install redis-server or set REDIS_SERVER_BIN): {e}")
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10 s; log {}",
            self.port,
            log.display()
        );
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(100)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut conn).is_ok()
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A blocking connection for assertions.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .expect("connection to the test redis")
    }

    /// Kills the server with SIGKILL (its data and script cache are gone).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Redis `TIME` in Unix ms: the clock the scripts decide by.
pub fn redis_time_ms(conn: &mut impl redis::ConnectionLike) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    s * 1000 + us / 1000
}

/// Sleeps until Redis's clock reaches `offset_ms` into a window of `window_ms` (the next such point).
/// Tests of window edges must place requests at wall-clock points; there is no event to await.
pub fn sleep_until_window_offset(
    conn: &mut impl redis::ConnectionLike,
    window_ms: u64,
    offset_ms: u64,
) -> u64 {
    let now = redis_time_ms(conn);
    let start = now - now % window_ms;
    let mut target = start + offset_ms;
    if target <= now {
        target += window_ms;
    }
    std::thread::sleep(Duration::from_millis(target - now));
    target
}

/// A sliding-window client's count in the current window and the window hash's TTL in ms, read the
/// way the scripts lay them out (`floodgate_core::store::Layout`, default buckets and tags).
pub fn window_count(
    conn: &mut impl redis::ConnectionLike,
    rule_id: &str,
    key: &str,
    window_ms: u64,
) -> (u64, i64) {
    let idx = redis_time_ms(conn) / window_ms;
    window_count_at(conn, rule_id, key, idx)
}

/// A sliding-window client's count in window `idx` (the current window or the one before: the
/// window hashes are a pair, each reused two windows on) and the window hash's TTL in ms.
pub fn window_count_at(
    conn: &mut impl redis::ConnectionLike,
    rule_id: &str,
    key: &str,
    idx: u64,
) -> (u64, i64) {
    let layout = floodgate_core::store::Layout::default();
    let hash = format!(
        "fg:{{{}}}:{rule_id}/{}{}",
        layout.tag(key),
        layout.bucket(key),
        floodgate_core::store::WINDOW_HASHES[(idx % 2) as usize]
    );
    let count: Option<u64> = redis::cmd("HGET").arg(&hash).arg(key).query(conn).expect("HGET");
    let ttl: i64 = redis::cmd("PTTL").arg(&hash).query(conn).expect("PTTL");
    (count.unwrap_or(0), ttl)
}
