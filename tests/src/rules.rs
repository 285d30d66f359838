//! The rules service as a real process (`floodgate rules-server`), and a PostgreSQL database of its
//! own for each test on the machine's PostgreSQL (127.0.0.1:5432, trust auth; `FLOODGATE_TEST_PG`
//! names another server).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{eventually, floodgate_bin};

/// A running `floodgate rules-server`, killed on drop.
pub struct RulesServer {
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
    addr: std::net::SocketAddr,
    scheme: &'static str,
}

impl RulesServer {
    /// Starts one on a free loopback port over `db` (`sqlite://…` or `postgres://…`) with these
    /// tokens (`name:secret`), and waits until it listens.
    pub async fn start(db: &str, tokens: &[&str]) -> Self {
        Self::start_with(db, tokens, &[]).await
    }

    /// The same with extra arguments; `--tls-cert` among them makes its URL `https://`.
    pub async fn start_with(db: &str, tokens: &[&str], extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("rules-server.log");
        let mut cmd = Command::new(floodgate_bin());
        cmd.args(["rules-server", "--listen", "127.0.0.1:0", "--db", db]);
        for t in tokens {
            cmd.args(["--token", t]);
        }
        cmd.args(extra);
        let scheme = if extra.contains(&"--tls-cert") {
            "https"
        } else {
            "http"
        };
        let child = cmd
            // Its log is a file: plain text without being told (NO_COLOR not set for it).
            .env_remove("NO_COLOR")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).expect("log file")))
            .spawn()
            .expect("spawn floodgate rules-server");
        let log2 = log.clone();
        let addr = eventually("the rules server listens", Duration::from_secs(10), || {
            let text = std::fs::read_to_string(&log2).unwrap_or_default();
            async move {
                let line = text.lines().find(|l| l.contains("rules service listening"))?;
                line.split("addr=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            }
        })
        .await;
        RulesServer {
            child: Some(child),
            log,
            _dir: dir,
            addr,
            scheme,
        }
    }

    /// `http://127.0.0.1:PORT` (`https://` when it serves TLS).
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    /// Its address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for it to exit (panics after 10 s); returns the exit code.
    pub async fn terminate(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        crate::signal(child.id(), 15);
        let status = eventually("the rules server exits", Duration::from_secs(10), || {
            let s = child.try_wait().ok().flatten();
            async move { s }
        })
        .await;
        status.code()
    }

    /// Kills it (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RulesServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A fresh PostgreSQL database, dropped at the end.
pub struct PgDatabase {
    name: String,
    server: String,
}

impl PgDatabase {
    /// Creates `floodgate_test_<random>` with `psql`.
    pub fn create() -> Self {
        let server = std::env::var("FLOODGATE_TEST_PG")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let name = format!("floodgate_test_{}_{}", std::process::id(), crate::free_port());
        psql(&server, &format!("CREATE DATABASE {name}"));
        PgDatabase { name, server }
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("{}/{}", self.server, self.name)
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .arg(format!("{}/postgres", self.server))
            .args([
                "-qc",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
            ])
            .output();
    }
}

fn psql(server: &str, sql: &str) {
    let out = Command::new("psql")
        .arg(format!("{server}/postgres"))
        .args(["-qc", sql])
        .output()
        .expect("run psql (install postgresql-client; scripts/test does)");
    assert!(
        out.status.success(),
        "psql {sql:?} failed (is PostgreSQL running on 127.0.0.1:5432 with trust auth?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
