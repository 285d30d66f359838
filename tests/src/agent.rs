//! One real `floodgate agent` process on a temporary socket.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::eventually;

/// The `floodgate` binary: `FLOODGATE_BIN`, else the one in the running test's or bench's target
/// directory (rebuilt through cargo first when running under cargo).
pub fn floodgate_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("FLOODGATE_BIN") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().expect("current exe");
        let mut dir = exe.parent().expect("exe dir").to_path_buf();
        if dir.ends_with("deps") {
            dir.pop();
        }
        let bin = dir.join("floodgate");
        // Under cargo (tests, `cargo run` of the benches) build the binary first, so a test never runs
        // a stale agent: `cargo test -p floodgate-tests` alone does not rebuild other packages' bins.
        // Built as users build it (`cargo build --bin floodgate` at the root: the whole workspace's
        // features, as `scripts/test`'s `cargo build --workspace --bins` and the container), not with
        // `-p floodgate-agent`, whose narrower feature set would compile redis, sqlx and the agent a
        // second time and test a binary nobody ships. Elsewhere, use what is there.
        if let Ok(cargo) = std::env::var("CARGO") {
            let mut cmd = Command::new(cargo);
            cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
            cmd.args(["build", "--quiet", "--bin", "floodgate"]);
            // What cargo sets for the running test, not the user's settings: ring's build script
            // tracks CARGO_MANIFEST_DIR, so passing this test's on made the nested build compile
            // ring, rustls, redis and the agent again (and the next outer build undo it).
            for (k, _) in std::env::vars_os() {
                let k = k.to_string_lossy();
                if k.starts_with("CARGO_PKG_")
                    || [
                        "CARGO_MANIFEST_DIR",
                        "CARGO_MANIFEST_PATH",
                        "CARGO_CRATE_NAME",
                        "CARGO_BIN_NAME",
                        "CARGO_PRIMARY_PACKAGE",
                        "CARGO_TARGET_TMPDIR",
                        "OUT_DIR",
                    ]
                    .contains(&k.as_ref())
                {
                    cmd.env_remove(k.as_ref());
                }
            }
            if dir.ends_with("release") {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("cargo build of the floodgate binary");
            assert!(status.success(), "cargo build of the floodgate binary failed");
        }
        assert!(
            bin.exists(),
            "no floodgate binary at {}; build it or set FLOODGATE_BIN",
            bin.display()
        );
        bin
    })
    .clone()
}

/// How to start an agent.
#[derive(Default)]
pub struct AgentBuilder {
    redis: Option<String>,
    rules: Option<String>,
    yaml: bool,
    socket: Option<PathBuf>,
    args: Vec<String>,
    wrapper: Vec<String>,
    ready_within: Option<Duration>,
    shipped_timeout: bool,
    envs: Vec<(String, String)>,
}

/// The store timeout an agent under test gets unless the test sets one: a Redis on a loaded
/// 2-core machine answers well within it, so no answer of a test that is not about timeouts comes
/// from the fail mode.
pub const PATIENT_STORE_TIMEOUT_MS: u64 = 1_000;

impl AgentBuilder {
    /// Use Redis at this URL (default: the embedded store), with a store timeout of
    /// [`PATIENT_STORE_TIMEOUT_MS`] unless the arguments set `--redis-timeout-ms` themselves (tests
    /// about timeouts do, and say why) or [`shipped_timeout`](Self::shipped_timeout) keeps the
    /// shipped 5 ms: on a loaded CI machine a 5 ms timeout turns some of Redis's answers into
    /// fail-mode answers, which no test that is not about timeouts may depend on.
    pub fn redis(mut self, url: &str) -> Self {
        self.redis = Some(url.into());
        self
    }

    /// Keeps the agent's shipped store timeout (5 ms): for benchmarks that measure what users get.
    pub fn shipped_timeout(mut self) -> Self {
        self.shipped_timeout = true;
        self
    }

    /// Rules file content (TOML or JSON); default: the built-in example.
    pub fn rules(mut self, text: &str) -> Self {
        self.rules = Some(text.into());
        self
    }

    /// An envoyproxy/ratelimit YAML configuration as the rules file (`--rules rules.yaml`).
    pub fn envoy_config(mut self, yaml: &str) -> Self {
        self.rules = Some(yaml.into());
        self.yaml = true;
        self
    }

    /// Serve this socket path instead of a fresh temporary one.
    pub fn socket(mut self, path: &Path) -> Self {
        self.socket = Some(path.into());
        self
    }

    /// An environment variable of the agent's (after the test's own `FLOODGATE_*` are removed).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// Extra command-line arguments.
    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.into());
        self
    }

    /// Runs the agent under this command (e.g. `valgrind --tool=callgrind`), which gets the binary
    /// and its arguments after its own.
    pub fn under(mut self, wrapper: &[&str]) -> Self {
        self.wrapper = wrapper.iter().map(|s| s.to_string()).collect();
        self
    }

    /// How long [`start`](Self::start) waits for the socket (default 10 s; longer under a wrapper).
    pub fn ready_within(mut self, d: Duration) -> Self {
        self.ready_within = Some(d);
        self
    }

    /// Spawns the agent without waiting for it (for tests that expect it to fail).
    pub fn spawn(self) -> Agent {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = self
            .socket
            .clone()
            .unwrap_or_else(|| dir.path().join("agent.sock"));
        let log = dir.path().join("agent.log");
        let mut cmd = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(floodgate_bin());
                c
            }
            None => Command::new(floodgate_bin()),
        };
        cmd.arg("agent")
            .arg("--socket")
            .arg(&socket)
            .args(["--admin", "127.0.0.1:0"]);
        if let Some(url) = &self.redis {
            cmd.args(["--redis", url]);
            if !self.shipped_timeout && !self.args.iter().any(|a| a == "--redis-timeout-ms") {
                cmd.arg("--redis-timeout-ms")
                    .arg(PATIENT_STORE_TIMEOUT_MS.to_string());
            }
        }
        if let Some(text) = &self.rules {
            let path = dir.path().join(if self.yaml {
                "rules.yaml"
            } else if text.trim_start().starts_with('{') {
                "rules.json"
            } else {
                "rules.toml"
            });
            std::fs::write(&path, text).expect("write rules");
            cmd.arg("--rules").arg(path);
        } else {
            // The embedded default: its rules API on a free port, its store in the temp dir.
            cmd.args(["--rules-listen", "127.0.0.1:0"])
                .arg("--rules-db")
                .arg(format!("sqlite://{}", dir.path().join("rules.db").display()));
        }
        cmd.args(&self.args);
        // Files the agent keeps (the rules cache) go to its temp dir, as under systemd.
        cmd.env("STATE_DIRECTORY", dir.path());
        // Keep the environment from leaking FLOODGATE_* settings into tests.
        for (k, _) in std::env::vars() {
            if (k.starts_with("FLOODGATE_") && k != "FLOODGATE_BIN") || k.starts_with("OTEL_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        let logfile = std::fs::File::create(&log).expect("agent log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(logfile))
            // Its log is a file, as under systemd: the agent must write plain text there without
            // being told, so NO_COLOR is not set for it (the tests read fields out of the lines).
            .env_remove("NO_COLOR")
            .spawn()
            .expect("spawn floodgate agent");
        Agent {
            child: Some(child),
            socket,
            log,
            ready_within: self.ready_within.unwrap_or(Duration::from_secs(10)),
            _dir: dir,
        }
    }

    /// An agent on this Redis (patient: 1 s store timeout) with these rules, started.
    pub async fn patient(url: &str, rules: &str) -> Agent {
        Agent::builder().redis(url).rules(rules).start().await
    }

    /// Spawns the agent and waits until its socket accepts connections.
    pub async fn start(self) -> Agent {
        let mut agent = self.spawn();
        agent.wait_ready().await;
        agent
    }
}

/// A running `floodgate agent`, killed on drop.
pub struct Agent {
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
    ready_within: Duration,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// How to start one.
    pub fn builder() -> AgentBuilder {
        AgentBuilder::default()
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What it has logged so far (stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The admin address it logged.
    pub async fn admin_addr(&self) -> std::net::SocketAddr {
        self.logged_addr("admin HTTP listening").await
    }

    /// The embedded rules API's address (an agent started without `--rules` serves it).
    pub async fn rules_addr(&self) -> std::net::SocketAddr {
        self.logged_addr("rules API listening").await
    }

    /// The `addr=` of the first log line containing `what`.
    pub async fn logged_addr(&self, what: &str) -> std::net::SocketAddr {
        eventually(
            &format!("the process logs {what:?}"),
            Duration::from_secs(10),
            || async {
                let log = self.log();
                let line = log.lines().find(|l| l.contains(what))?;
                let addr = line.split("addr=").nth(1)?.split_whitespace().next()?;
                addr.parse().ok()
            },
        )
        .await
    }

    /// Waits until the socket accepts connections and the agent has logged its start (panics after
    /// 10 s, or the builder's `ready_within`, showing the log).
    pub async fn wait_ready(&mut self) {
        let deadline = std::time::Instant::now() + self.ready_within;
        loop {
            if tokio::net::UnixStream::connect(&self.socket).await.is_ok()
                && self.log().contains("rules loaded")
            {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("agent exited with {status}; log:\n{}", self.log());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "agent not ready in {:?}; log:\n{}",
                self.ready_within,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for the process to exit and returns its exit code (panics after 10 s).
    pub async fn wait_exit(&mut self) -> Option<i32> {
        self.wait_exit_within(Duration::from_secs(10)).await
    }

    /// Waits up to `limit` for the process to exit and returns its exit code (panics past it).
    pub async fn wait_exit_within(&mut self, limit: Duration) -> Option<i32> {
        let child = self.child.as_mut()?;
        let status = eventually("the agent exits", limit, || {
            let s = child.try_wait().ok().flatten();
            async move { s }
        })
        .await;
        self.child = None;
        status.code()
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub async fn terminate(&mut self) -> Option<i32> {
        self.terminate_within(Duration::from_secs(10)).await
    }

    /// Sends SIGTERM and waits up to `limit` for a clean exit.
    pub async fn terminate_within(&mut self, limit: Duration) -> Option<i32> {
        if let Some(pid) = self.pid() {
            crate::signal(pid, 15);
        }
        self.wait_exit_within(limit).await
    }

    /// Kills with SIGKILL (leaves its socket file behind, like a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}
