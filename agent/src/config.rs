//! The agent's configuration: one struct, filled from flags and FLOODGATE_* environment variables;
//! the rules server's (`rules_server`) and the traces' flags (`otlp`) beside it.

use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::path::PathBuf;

mod otlp;
mod rules_server;
mod values;

pub use otlp::OtlpArgs;
pub use rules_server::RulesServerConfig;
use values::{http_header_timeout_ms, http_max_connections, parse_admin, parse_grpc, parse_mode};
pub use values::{http_limits, Admin, LogFormat};

/// How `floodgate agent` runs. Every field has a flag and an environment variable; the table in
/// docs/configuration.md mirrors this struct.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentConfig {
    /// A TOML config file whose keys are these flags in snake case (`redis_timeout_ms = 5`); its
    /// values are the defaults that environment variables and flags override.
    #[arg(long, env = "FLOODGATE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Unix socket the SDK connects to (default: `/run/floodgate/floodgate.sock` when the agent may
    /// use `/run/floodgate`: as root, or the directory is its own as under systemd; else
    /// `$XDG_RUNTIME_DIR/floodgate/floodgate.sock`: where every SDK looks when given no path).
    #[arg(help_heading = "Listeners", long, env = "FLOODGATE_SOCKET")]
    pub socket: Option<PathBuf>,

    /// File mode of the socket, in octal.
    #[arg(help_heading = "Listeners", long, env = "FLOODGATE_SOCKET_MODE", default_value = "0660", value_parser = parse_mode)]
    pub socket_mode: u32,

    /// Also serve the frames protocol on this TCP address (e.g. `0.0.0.0:9792` for pods that cannot
    /// mount the host's socket); off by default. It has no authentication: bind it to an address only
    /// the host's pods reach.
    #[arg(help_heading = "Listeners", long, env = "FLOODGATE_LISTEN_TCP")]
    pub listen_tcp: Option<SocketAddr>,

    /// Serve Envoy's RateLimitService (gRPC) on this TCP address; off by default. `on` means
    /// `127.0.0.1:8081` (loopback, envoyproxy/ratelimit's gRPC port).
    #[arg(help_heading = "Envoy gRPC", long, env = "FLOODGATE_GRPC", value_parser = parse_grpc)]
    pub grpc: Option<SocketAddr>,

    /// Serve Envoy's RateLimitService on this Unix socket too (for an Envoy on the same host).
    #[arg(help_heading = "Envoy gRPC", long, env = "FLOODGATE_GRPC_SOCKET")]
    pub grpc_socket: Option<PathBuf>,

    /// Serve the gRPC TCP listener over TLS with this certificate chain (PEM; ALPN `h2`; read
    /// again on SIGHUP). Needs `--grpc-tls-key` and the native server.
    #[arg(
        help_heading = "Envoy gRPC",
        long,
        env = "FLOODGATE_GRPC_TLS_CERT",
        requires = "grpc_tls_key"
    )]
    pub grpc_tls_cert: Option<PathBuf>,

    /// The private key of `--grpc-tls-cert` (PEM).
    #[arg(
        help_heading = "Envoy gRPC",
        long,
        env = "FLOODGATE_GRPC_TLS_KEY",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_key: Option<PathBuf>,

    /// Require gRPC clients to present a certificate signed by one of these CAs (PEM); with
    /// `--grpc-tls-cert`.
    #[arg(
        help_heading = "Envoy gRPC",
        long,
        env = "FLOODGATE_GRPC_TLS_CLIENT_CA",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_client_ca: Option<PathBuf>,

    /// Rate-limit headers the gRPC answers ask Envoy to add (`response_headers_to_add`).
    #[arg(
        help_heading = "Envoy gRPC",
        long,
        env = "FLOODGATE_GRPC_HEADERS",
        value_enum,
        default_value = "x-ratelimit"
    )]
    pub grpc_headers: crate::envoy::GrpcHeaders,

    /// Which gRPC server answers Envoy: `native` (Floodgate's own HTTP/2, `floodgate-h2`: about a
    /// fifth of tonic's CPU per check, and the budgets of docs/envoy.md), `tonic` (hyper and tonic;
    /// a fallback) or `h2` (the `h2` crate used directly, about 3× native's CPU per check; kept to
    /// be measured).
    #[arg(
        help_heading = "Envoy gRPC",
        long,
        env = "FLOODGATE_GRPC_SERVER",
        value_enum,
        default_value = "native"
    )]
    pub grpc_server: crate::envoy::GrpcServer,

    /// Most connections each listener (Unix socket, TCP, gRPC) holds open; past it a frames
    /// connection gets an Error (code 7, overloaded) and is closed, a gRPC one is closed.
    #[arg(help_heading = "Connections", long, env = "FLOODGATE_MAX_CONNECTIONS", default_value_t = NonZeroUsize::new(crate::server::DEFAULT_MAX_CONNECTIONS).expect("non-zero"))]
    pub max_connections: NonZeroUsize,

    /// Most of a listener's connections one peer holds (a uid on the Unix socket, an address on TCP
    /// and gRPC; one process at most a quarter of its uid's); default a quarter of
    /// `--max-connections`, so one user's idle or half-sent connections cannot take every slot
    /// (past it: Error 7, and the connection is closed). The last eighth of the cap is kept for
    /// peers holding none (docs/operating.md).
    #[arg(
        help_heading = "Connections",
        long,
        env = "FLOODGATE_MAX_CONNECTIONS_PER_PEER"
    )]
    pub max_connections_per_peer: Option<NonZeroUsize>,

    /// A frames connection with nothing in flight and nothing received for this long is closed, and
    /// a gRPC connection with no call for this long (GOAWAY `NO_ERROR`), in milliseconds (the SDKs
    /// and Envoy reconnect).
    #[arg(help_heading = "Connections", long, env = "FLOODGATE_IDLE_TIMEOUT_MS", default_value_t = NonZeroU64::new(crate::server::DEFAULT_IDLE_TIMEOUT.as_millis() as u64).expect("non-zero"))]
    pub idle_timeout_ms: NonZeroU64,

    /// A frame whose first bytes arrived must be complete within this, in milliseconds; else the
    /// connection gets an Error (code 1) and is closed.
    #[arg(help_heading = "Connections", long, env = "FLOODGATE_FRAME_TIMEOUT_MS", default_value_t = NonZeroU64::new(crate::server::DEFAULT_FRAME_TIMEOUT.as_millis() as u64).expect("non-zero"))]
    pub frame_timeout_ms: NonZeroU64,

    /// Most connections each HTTP listener (admin API, embedded rules API) holds open, a quarter of
    /// them per peer address; past it a new connection is closed at once and counted in
    /// `floodgate_connections_refused_total` (listener `admin` or `rules`).
    #[arg(help_heading = "Connections", long, env = "FLOODGATE_HTTP_MAX_CONNECTIONS", default_value_t = floodgate_rules_service::listen::AGENT_MAX_CONNECTIONS, value_parser = http_max_connections())]
    pub http_max_connections: usize,

    /// How long an HTTP client (admin API, embedded rules API) has to send a request's head, and
    /// how long a kept-alive connection may wait idle, in milliseconds; then it is closed.
    #[arg(help_heading = "Connections", long, env = "FLOODGATE_HTTP_HEADER_TIMEOUT_MS", default_value_t = floodgate_rules_service::listen::DEFAULT_HEADER_TIMEOUT_MS, value_parser = http_header_timeout_ms())]
    pub http_header_timeout_ms: u64,

    /// Admin HTTP address (`/healthz`, `/readyz`, `/metrics`, `/v1/status`, `/v1/batch`), or `off`;
    /// port 0 picks one and logs it. It has no authentication: keep it off public networks.
    #[arg(help_heading = "Connections", long, env = "FLOODGATE_ADMIN", default_value = "127.0.0.1:9790", value_parser = parse_admin)]
    pub admin: Admin,

    /// Redis URL (`redis://host:port/db`, `rediss://` for TLS, `redis://user:password@host` for
    /// AUTH, `redis+sentinel://s1:26379,s2:26379/mymaster` for the master Sentinel names), or several
    /// separated by commas: independent shards (each
    /// hash tag placed by rendezvous hashing), or with `--redis-cluster` the seeds of one Redis
    /// Cluster. Without it the agent uses its embedded in-memory store.
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_REDIS")]
    pub redis: Option<String>,

    /// PEM certificates to trust for `rediss://` URLs (a private CA) instead of the system's store.
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,

    /// A file holding the Redis AUTH password (kept out of the URL, `ps` and the environment); the
    /// user, for ACLs, is the URL's (`redis://user@host`).
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,

    /// Treat the `--redis` URLs as seed nodes of one Redis Cluster (MOVED and ASK are followed).
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_REDIS_CLUSTER")]
    pub redis_cluster: bool,

    /// Buckets per (rule, window) of the Redis key layout; the same on every agent of a fleet.
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_REDIS_BUCKETS", default_value_t = floodgate_core::store::layout::DEFAULT_BUCKETS)]
    pub redis_buckets: u32,

    /// Hash tags (bucket groups) of the Redis key layout; the same on every agent of a fleet.
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_REDIS_TAGS", default_value_t = floodgate_core::store::layout::DEFAULT_TAGS)]
    pub redis_tags: u32,

    /// Most check items one coalesced script call carries: sync checks that arrive together for one
    /// shard share a call (1 turns coalescing off: one call per check).
    #[arg(help_heading = "Redis", long, env = "FLOODGATE_COALESCE", default_value_t = floodgate_redis::DEFAULT_COALESCE)]
    pub coalesce: usize,

    /// Default flush interval of batched rules in milliseconds, at least 1 (a rule's flushIntervalMs
    /// overrides it; both can be changed at run time through the admin API).
    #[arg(help_heading = "Execution modes", long, env = "FLOODGATE_FLUSH_INTERVAL_MS", default_value_t = floodgate_core::batch::DEFAULT_FLUSH_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub flush_interval_ms: u64,

    /// Most (rule, key) counters tracked for batched rules; past it new keys run sync.
    #[arg(help_heading = "Execution modes", long, env = "FLOODGATE_BATCH_MAX_KEYS", default_value_t = floodgate_core::batch::DEFAULT_MAX_KEYS)]
    pub batch_max_keys: usize,

    /// Most reservations (protocol version 6) held at once, 1 to 10,000,000 (~200 B each); past it
    /// a reserve is refused with error 7 until commits or expiries free room.
    #[arg(help_heading = "Execution modes", long, env = "FLOODGATE_MAX_RESERVATIONS", default_value_t = floodgate_core::reserve::DEFAULT_MAX_RESERVATIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000_000))]
    pub max_reservations: usize,

    /// Sync checks per second of one (rule, key) on this agent that promote it to batched execution
    /// while it stays hot (0 turns promotion off).
    #[arg(help_heading = "Execution modes", long, env = "FLOODGATE_HOT_KEY_RATE", default_value_t = floodgate_core::engine::DEFAULT_HOT_KEY_RATE)]
    pub hot_key_rate: u64,

    /// Accuracy target of `auto` rules: batched when the expected over-admission stays within this
    /// fraction of the limit.
    #[arg(help_heading = "Execution modes", long, env = "FLOODGATE_ACCURACY", default_value_t = floodgate_core::engine::DEFAULT_ACCURACY)]
    pub accuracy: f64,

    /// Most (rule, key) rejections cached locally (0 turns the cache off).
    #[arg(help_heading = "Execution modes", long, env = "FLOODGATE_REJECTION_CACHE", default_value_t = floodgate_core::cache::DEFAULT_CAP)]
    pub rejection_cache: usize,

    /// Longest a check waits for Redis before the rule's fail mode decides, in milliseconds (at least 1).
    #[arg(help_heading = "When Redis is slow or away", long, env = "FLOODGATE_REDIS_TIMEOUT_MS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub redis_timeout_ms: u64,

    /// Consecutive Redis failures (errors or timeouts) that open the circuit breaker (at least 1).
    #[arg(help_heading = "When Redis is slow or away", long, env = "FLOODGATE_BREAKER_FAILURES", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub breaker_failures: u32,

    /// How long a failure streak must last before it opens the breaker, in milliseconds (one stall
    /// times out every pipelined check at once; that alone should not open it).
    #[arg(
        help_heading = "When Redis is slow or away",
        long,
        env = "FLOODGATE_BREAKER_MIN_STREAK_MS",
        default_value_t = 100
    )]
    pub breaker_min_streak_ms: u64,

    /// How long an open breaker decides locally before it probes Redis again, in milliseconds.
    #[arg(
        help_heading = "When Redis is slow or away",
        long,
        env = "FLOODGATE_BREAKER_COOLDOWN_MS",
        default_value_t = 2_000
    )]
    pub breaker_cooldown_ms: u64,

    /// Pin N, the live-agent count the fallback divides limits by (default: learned from heartbeats).
    #[arg(help_heading = "When Redis is slow or away", long, env = "FLOODGATE_AGENTS")]
    pub agents: Option<u64>,

    /// This agent's id in the heartbeats (default: hostname:pid).
    #[arg(help_heading = "When Redis is slow or away", long, env = "FLOODGATE_AGENT_ID")]
    pub agent_id: Option<String>,

    /// How often the agent writes its heartbeat, in milliseconds, at least 10 (it counts for 5
    /// intervals).
    #[arg(help_heading = "When Redis is slow or away", long, env = "FLOODGATE_HEARTBEAT_MS", default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(10..))]
    pub heartbeat_ms: u64,

    /// Rules file (TOML or JSON), read at start. Without it and without `--rules-url`, the agent
    /// serves the rules API itself over a SQLite file (`--rules-db`), seeded with the built-in
    /// example rules: the embedded default.
    #[arg(
        help_heading = "Rules",
        long,
        env = "FLOODGATE_RULES",
        conflicts_with = "rules_url"
    )]
    pub rules: Option<PathBuf>,

    /// Follow this rules service (`http://host:port`): pull every `--rules-poll-ms`, watch between.
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_URL")]
    pub rules_url: Option<String>,

    /// Bearer token for the rules service (visible in `ps` as a flag: prefer `--rules-token-file`).
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_TOKEN")]
    pub rules_token: Option<String>,

    /// A file holding the bearer token for the rules service (trimmed), kept out of `ps` and the
    /// environment; read at start.
    #[arg(
        help_heading = "Rules",
        long,
        env = "FLOODGATE_RULES_TOKEN_FILE",
        conflicts_with = "rules_token"
    )]
    pub rules_token_file: Option<PathBuf>,

    /// PEM certificates to trust for an `https://` rules service (a private CA), besides the
    /// system's store.
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_CA")]
    pub rules_ca: Option<PathBuf>,

    /// How often to pull the rule set, in milliseconds, at least 100 (also the retry interval after
    /// a failure).
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_POLL_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..))]
    pub rules_poll_ms: u64,

    /// How long each long-poll watch may wait for a change, in seconds, at most 55 (0: no watch,
    /// pull only).
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_WATCH_S", default_value_t = 25, value_parser = clap::value_parser!(u64).range(0..=floodgate_rules_service::service::MAX_WATCH_SECONDS))]
    pub rules_watch_s: u64,

    /// The last good rule set from the service, kept across restarts (default:
    /// `floodgate-rules-cache.json` in the state directory: systemd's `$STATE_DIRECTORY`, else the
    /// working directory).
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_CACHE")]
    pub rules_cache: Option<PathBuf>,

    /// Embedded default: where the agent serves the rules API (loopback only: it has no token), or
    /// `off`.
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_LISTEN", default_value = "127.0.0.1:9791", value_parser = parse_admin)]
    pub rules_listen: Admin,

    /// Embedded default: the rules store, a SQLite file (`sqlite://path`; default
    /// `floodgate-rules.db` in the state directory: systemd's `$STATE_DIRECTORY`, else the working
    /// directory).
    #[arg(help_heading = "Rules", long, env = "FLOODGATE_RULES_DB")]
    pub rules_db: Option<String>,

    /// Export Prometheus metrics at the admin port's `/metrics` (`false`: record nothing).
    #[arg(help_heading = "Observability", long, env = "FLOODGATE_METRICS", default_value_t = true, action = clap::ArgAction::Set)]
    pub metrics: bool,

    /// Write rejection events to a Redis Stream on the agent's Redis (`false`: none). Without Redis
    /// (the embedded store) there are none.
    #[arg(help_heading = "Observability", long, env = "FLOODGATE_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub events: bool,

    /// The rejection events' stream key.
    #[arg(
        help_heading = "Observability",
        long,
        env = "FLOODGATE_EVENTS_STREAM",
        default_value = "floodgate:rejections"
    )]
    pub events_stream: String,

    /// `MAXLEN ~` of the stream: Redis keeps about this many events.
    #[arg(
        help_heading = "Observability",
        long,
        env = "FLOODGATE_EVENTS_MAXLEN",
        default_value_t = 100_000
    )]
    pub events_maxlen: u64,

    /// Events queued between the request path and the writer; past it, events are dropped and
    /// counted (`floodgate_events_dropped_total`).
    #[arg(
        help_heading = "Observability",
        long,
        env = "FLOODGATE_EVENTS_QUEUE",
        default_value_t = 10_000
    )]
    pub events_queue: usize,

    /// Write every decision to this file (created anew), one JSON line per item: the decision
    /// ledger that `floodgate ledger check` judges against the accuracy contract
    /// (docs/accuracy.md). Off by default; for test and fault runs, not for production traffic.
    #[arg(help_heading = "Observability", long, env = "FLOODGATE_LEDGER")]
    pub ledger: Option<PathBuf>,

    /// Worker threads of the agent's runtime; 0 means one per core. One by default: a sidecar should
    /// leave the host's cores to the services, and on a loaded 2-core machine one worker measured
    /// both faster and steadier than two (BENCHMARKS.md); one thread serves ~1 M in-memory checks/s.
    #[arg(
        help_heading = "Process",
        long,
        env = "FLOODGATE_THREADS",
        default_value_t = 1
    )]
    pub threads: usize,

    /// OpenTelemetry traces (off unless `--otlp-endpoint`).
    #[command(flatten, next_help_heading = "Traces")]
    pub otlp: OtlpArgs,

    /// Log filter (tracing's env-filter syntax), e.g. `info`, or `info,floodgate_core=debug` (targets: `floodgate_core`, `floodgate_redis`, `floodgate_rules_service`, `floodgate_agent`).
    #[arg(
        help_heading = "Observability",
        long,
        env = "FLOODGATE_LOG",
        default_value = "info"
    )]
    pub log: String,

    /// Log lines as text or as JSON objects (one per line, for log shippers).
    #[arg(
        help_heading = "Observability",
        long,
        env = "FLOODGATE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
}

impl AgentConfig {
    /// The gRPC listener's TLS files, when `--grpc-tls-cert` is given.
    pub fn grpc_tls_files(&self) -> Option<crate::envoy::TlsFiles> {
        Some(crate::envoy::TlsFiles {
            cert: self.grpc_tls_cert.clone()?,
            key: self.grpc_tls_key.clone()?,
            client_ca: self.grpc_tls_client_ca.clone(),
        })
    }

    /// The socket to serve: `--socket`, else the default the SDKs look for, its directory created
    /// (`/run/floodgate` 0755, so services of other users reach the socket, whose own mode then
    /// decides; `$XDG_RUNTIME_DIR/floodgate` 0700, the user's own). Never a world-writable
    /// directory: a local user who binds the path first would answer "allowed" to every check.
    pub fn serve_socket(&self) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        if let Some(p) = &self.socket {
            return Ok(p.clone());
        }
        let system = std::path::Path::new(floodgate_sdk::DEFAULT_SOCKET);
        let dir = system.parent().expect("a directory");
        // The process's own uid, without unsafe code: /proc/self belongs to it.
        let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
        match std::fs::DirBuilder::new().mode(0o755).create(dir) {
            Ok(()) => return Ok(system.to_path_buf()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let owner = std::fs::metadata(dir).map(|m| m.uid()).ok();
                if uid.is_some() && (uid == Some(0) || owner == uid) {
                    return Ok(system.to_path_buf());
                }
            }
            Err(_) => {}
        }
        let Some(user) = floodgate_sdk::user_socket() else {
            anyhow::bail!(
                "no socket directory of the agent's own: {} is not writable and XDG_RUNTIME_DIR is \
                 not set; run as root (or under the systemd unit), or name the socket with --socket \
                 or FLOODGATE_SOCKET (and give the SDKs the same FLOODGATE_SOCKET)",
                dir.display()
            );
        };
        let user_dir = user.parent().expect("a directory");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(user_dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", user_dir.display()))?;
        Ok(user)
    }

    /// Where the agent keeps files that must outlive it: systemd's `$STATE_DIRECTORY` (its first
    /// entry) when set, else the working directory.
    pub fn state_dir() -> PathBuf {
        std::env::var_os("STATE_DIRECTORY")
            .and_then(|v| {
                v.to_str()
                    .and_then(|s| s.split(':').next())
                    .filter(|s| !s.is_empty())
                    .map(PathBuf::from)
            })
            .unwrap_or_default()
    }

    /// The limits of each of the agent's HTTP listeners (admin API, embedded rules API).
    pub fn http_limits(&self) -> floodgate_rules_service::listen::Limits {
        http_limits(self.http_max_connections, self.http_header_timeout_ms)
    }

    /// The rules service's bearer token: `--rules-token`, or read from `--rules-token-file`.
    /// Both set (a flag and the config file, say) is refused rather than one picked.
    pub fn rules_token(&self) -> anyhow::Result<Option<String>> {
        match (&self.rules_token, &self.rules_token_file) {
            (Some(_), Some(_)) => anyhow::bail!(
                "both rules_token and rules_token_file are set (flags, environment or config file); keep one"
            ),
            (_, Some(path)) => Ok(Some(
                floodgate_rules_service::tokens::secret_from_file(path)
                    .map_err(|e| anyhow::anyhow!("--rules-token-file: {e}"))?,
            )),
            (token, None) => Ok(token.clone()),
        }
    }

    /// The embedded rules store's URL.
    pub fn rules_db(&self) -> String {
        self.rules_db.clone().unwrap_or_else(|| {
            format!(
                "sqlite://{}",
                Self::state_dir().join("floodgate-rules.db").display()
            )
        })
    }

    /// The rules cache file (when following a rules service).
    pub fn rules_cache(&self) -> PathBuf {
        self.rules_cache
            .clone()
            .unwrap_or_else(|| Self::state_dir().join("floodgate-rules-cache.json"))
    }

    /// The `--redis` URLs, split at commas (a `redis+sentinel://` URL, whose sentinels are
    /// comma-separated, is one).
    pub fn redis_urls(&self) -> Vec<String> {
        if let Some(r) = self.redis.as_deref().map(str::trim) {
            if r.starts_with("redis+sentinel://") || r.starts_with("rediss+sentinel://") {
                return vec![r.to_string()];
            }
        }
        self.redis
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_token_comes_from_a_flag_or_a_file_not_both() {
        use clap::{Args, FromArgMatches};
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        let file = file.to_str().unwrap();
        let parse = |cmd: clap::Command, args: &[&str]| {
            cmd.try_get_matches_from(std::iter::once("agent").chain(args.iter().copied()))
                .map_err(|e| e.to_string())
                .and_then(|m| AgentConfig::from_arg_matches(&m).map_err(|e| e.to_string()))
        };
        let agent = || AgentConfig::augment_args(clap::Command::new("agent"));
        let c = parse(agent(), &["--rules-token-file", file]).unwrap();
        assert_eq!(c.rules_token().unwrap().as_deref(), Some("s3cret"));
        let e = parse(agent(), &["--rules-token", "x", "--rules-token-file", file]).unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        // A config file's value is a default, which clap does not count as a conflict: refused when
        // the token is asked for, rather than one of the two picked.
        let cmd = crate::settings::apply_file(agent(), "rules_token = \"x\"\n").unwrap();
        let c = parse(cmd, &["--rules-token-file", file]).unwrap();
        assert!(c.rules_token().is_err());
    }

    #[test]
    fn http_limits_are_checked_when_parsed() {
        use clap::{Args, FromArgMatches};
        let parse = |args: &[&str]| {
            let cmd = RulesServerConfig::augment_args(clap::Command::new("rules-server"));
            cmd.try_get_matches_from(std::iter::once("rules-server").chain(args.iter().copied()))
                .map_err(|e| e.to_string())
                .and_then(|m| RulesServerConfig::from_arg_matches(&m).map_err(|e| e.to_string()))
        };
        let c = parse(&[]).unwrap();
        assert_eq!((c.http_max_connections, c.http_header_timeout_ms), (4_096, 5_000));
        let c = parse(&["--http-max-connections", "8", "--http-header-timeout-ms", "250"]).unwrap();
        let limits = c.serve_options().limits;
        assert_eq!(
            (limits.max_connections, limits.per_peer(), limits.header_timeout),
            (8, 2, std::time::Duration::from_millis(250))
        );
        for bad in [
            ["--http-max-connections", "0"],
            ["--http-max-connections", "many"],
            ["--http-header-timeout-ms", "0"],
        ] {
            let e = parse(&bad).unwrap_err();
            assert!(e.contains(bad[0]), "{e}");
        }
    }
}
