//! How `floodgate rules-server` runs: its flags and what the rules service is started with.

use std::net::SocketAddr;

use super::{http_header_timeout_ms, http_limits, http_max_connections, LogFormat, OtlpArgs};

/// How `floodgate rules-server` runs.
#[derive(Debug, Clone, clap::Args)]
pub struct RulesServerConfig {
    /// Address of the rules API.
    #[arg(long, env = "FLOODGATE_RULES_LISTEN", default_value = "127.0.0.1:9791")]
    pub listen: SocketAddr,

    /// Serve the API over TLS with this certificate chain (PEM; with `--tls-key`).
    #[arg(long, env = "FLOODGATE_RULES_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The TLS certificate's private key (PEM).
    #[arg(long, env = "FLOODGATE_RULES_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// The store: `sqlite://path` (one file) or `postgres://user@host/db`.
    #[arg(
        long,
        env = "FLOODGATE_RULES_DB",
        default_value = "sqlite://floodgate-rules.db"
    )]
    pub db: String,

    /// Write tokens (every request), `name:secret` (or a bare secret, named `operator`); repeat for
    /// several. With no token of any kind, the API listens on loopback only. A flag's secret is in
    /// `ps`: prefer `--token-file`.
    #[arg(long = "token", env = "FLOODGATE_RULES_TOKENS", value_delimiter = ',')]
    pub tokens: Vec<String>,

    /// Read tokens, `name:secret`: list, get and watch rules, read and report dry runs (what agents
    /// do); anything else gets 403. Repeat for several.
    #[arg(
        long = "read-token",
        env = "FLOODGATE_RULES_READ_TOKENS",
        value_delimiter = ','
    )]
    pub read_tokens: Vec<String>,

    /// A file of tokens, one `write name:secret` or `read name:secret` a line (blank lines and `#`
    /// comments allowed), readable by its owner only (mode 0600 or 0400).
    #[arg(long, env = "FLOODGATE_RULES_TOKENS_FILE")]
    pub token_file: Option<std::path::PathBuf>,

    /// Most connections the rules API holds open, a quarter of them per peer address (each
    /// following agent keeps one); past it a new connection is closed at once.
    #[arg(long, env = "FLOODGATE_HTTP_MAX_CONNECTIONS", default_value_t = floodgate_rules_service::listen::SERVICE_MAX_CONNECTIONS, value_parser = http_max_connections())]
    pub http_max_connections: usize,

    /// How long a client has to send a request's head, and how long a kept-alive connection may
    /// wait idle, in milliseconds; then it is closed.
    #[arg(long, env = "FLOODGATE_HTTP_HEADER_TIMEOUT_MS", default_value_t = floodgate_rules_service::listen::DEFAULT_HEADER_TIMEOUT_MS, value_parser = http_header_timeout_ms())]
    pub http_header_timeout_ms: u64,

    /// Log filter (tracing's env-filter syntax).
    #[arg(long, env = "FLOODGATE_LOG", default_value = "info")]
    pub log: String,

    /// Log lines as text or as JSON objects.
    #[arg(long, env = "FLOODGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// OpenTelemetry traces of the API's requests (off unless `--otlp-endpoint`).
    #[command(flatten)]
    pub otlp: OtlpArgs,
}

impl RulesServerConfig {
    /// What the rules service runs with.
    pub fn serve_options(&self) -> floodgate_rules_service::ServeOptions {
        floodgate_rules_service::ServeOptions {
            listen: self.listen,
            db: self.db.clone(),
            tokens: self.tokens.clone(),
            read_tokens: self.read_tokens.clone(),
            token_file: self.token_file.clone(),
            tls: self.tls_cert.clone().zip(self.tls_key.clone()),
            limits: http_limits(self.http_max_connections, self.http_header_timeout_ms),
            // The traces' layer, added by the caller once traces are on (flags or OTEL_*).
            wrap: None,
        }
    }
}
