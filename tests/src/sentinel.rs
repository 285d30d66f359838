//! A real Redis Sentinel (`redis-server --sentinel`) watching one master as `mymaster`, quorum 1,
//! down after 1 s; and a Redis's replication fields.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{free_port, RedisServer};

/// A sentinel process the test owns, killed on drop. `REDIS_SERVER_BIN` names another binary.
pub struct Sentinel {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    /// Starts a sentinel that monitors the master on `master_port` as `mymaster`.
    pub fn start(master_port: u16) -> Sentinel {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(bin)
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        Sentinel {
            child,
            port,
            _dir: dir,
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A command to the sentinel.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{}", self.port))?
            .get_connection_with_timeout(Duration::from_millis(500))?;
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut conn)
    }

    /// The port of the master it names now.
    pub fn master_port(&self) -> Option<u16> {
        let addr: Vec<String> = self
            .cmd(&["SENTINEL", "get-master-addr-by-name", "mymaster"])
            .ok()?;
        addr.get(1)?.parse().ok()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A replica of `master` in sync with it, and a sentinel that knows them both (waited for).
pub async fn replica_and_sentinel(master: &RedisServer) -> (RedisServer, Sentinel) {
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
    crate::eventually("the replica is in sync", Duration::from_secs(10), || async {
        (replication_info(&replica, "master_link_status").as_deref() == Some("up")).then_some(())
    })
    .await;
    let sentinel = Sentinel::start(master.port());
    crate::eventually(
        "the sentinel knows the master and its replica",
        Duration::from_secs(15),
        || async {
            let replicas: Vec<redis::Value> = sentinel.cmd(&["SENTINEL", "replicas", "mymaster"]).ok()?;
            (!replicas.is_empty() && sentinel.master_port() == Some(master.port())).then_some(())
        },
    )
    .await;
    (replica, sentinel)
}

/// A field of a Redis's `INFO replication` (`role`, `master_link_status`, …).
pub fn replication_info(redis: &RedisServer, field: &str) -> Option<String> {
    let text: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut redis.conn())
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
}
