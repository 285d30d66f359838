//! `floodgate rules`'s arguments: the API's address and token, and one subcommand per operation.

/// The CLI's arguments.
#[derive(Debug, clap::Args)]
pub struct RulesCli {
    /// The rules API, `http://host:port` or `https://host:port`.
    #[arg(long, env = "FLOODGATE_RULES_SERVER", default_value = "http://127.0.0.1:9791")]
    pub server: String,
    /// Bearer token (visible in `ps` as a flag: prefer `--token-file`).
    #[arg(long, env = "FLOODGATE_RULES_TOKEN")]
    pub token: Option<String>,
    /// A file holding the bearer token (trimmed).
    #[arg(long, env = "FLOODGATE_RULES_TOKEN_FILE", conflicts_with = "token")]
    pub token_file: Option<std::path::PathBuf>,
    /// PEM certificates to trust for an `https://` server (a private CA), besides the system's.
    #[arg(long, env = "FLOODGATE_RULES_CA")]
    pub ca: Option<std::path::PathBuf>,
    /// Print the API's JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: RulesCommand,
}

/// One operation.
#[derive(Debug, clap::Subcommand)]
pub enum RulesCommand {
    /// Every rule, and the global version.
    List,
    /// One rule.
    Get {
        /// Rule id.
        id: String,
    },
    /// Create or replace a rule from a JSON body (a file, or `-` for standard input).
    Put {
        /// Rule id.
        id: String,
        /// The rule as JSON: {dimension, match?, limit, windowSeconds, …}.
        #[arg(long)]
        file: std::path::PathBuf,
        /// Only if the rule is at this version (0: only if it does not exist yet).
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// Delete a rule.
    Delete {
        /// Rule id.
        id: String,
        /// Only if the rule is at this version.
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// What a rule in log mode would have rejected since its current version: count and top keys.
    DryRun {
        /// Rule id.
        id: String,
    },
    /// Turn envoyproxy/ratelimit YAML files into rules and PUT them (one `descriptor` rule per
    /// descriptor with a rate_limit), deleting the service's rules of the files' domains that the
    /// files no longer have. A file that cannot be mapped writes nothing; a write refused half-way
    /// leaves what was written before it (run it again once fixed).
    ImportEnvoy {
        /// The configuration files (one domain each).
        files: Vec<std::path::PathBuf>,
        /// Print the rules as JSON instead of writing them.
        #[arg(long)]
        dry_run: bool,
    },
    /// Check rules files offline, as the rules API would (every error with its file, rule and
    /// field); exit 1 if any is refused. TOML, JSON or envoyproxy/ratelimit YAML.
    Validate {
        /// The rules files.
        files: Vec<std::path::PathBuf>,
    },
    /// What `apply` would change on the server: `+` created, `~` changed (the fields), `-` deleted
    /// with `--prune`, `?` only on the server.
    Diff {
        /// The rules files.
        files: Vec<std::path::PathBuf>,
        /// Show the server's rules the files lack as deletions.
        #[arg(long)]
        prune: bool,
        /// Exit 2 when there is something to change (for CI).
        #[arg(long)]
        exit_code: bool,
    },
    /// Make the server's rules what the files say: only what differs is written, each write
    /// conditional on the version the comparison saw (a rule changed meanwhile is refused, not
    /// overwritten); a second apply writes nothing. `--prune` deletes the server's rules the files
    /// lack.
    Apply {
        /// The rules files.
        files: Vec<std::path::PathBuf>,
        /// Delete the server's rules the files do not have.
        #[arg(long)]
        prune: bool,
    },
    /// A client key's own limit under one rule (per-client overrides).
    #[command(subcommand)]
    Override(OverrideCommand),
    /// A temporary penalty on a client key over every rule: its limits scaled, or blocked.
    #[command(subcommand)]
    Penalty(PenaltyCommand),
    /// The audit: who changed what, newest first.
    Audit {
        /// At most this many records.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
}

/// What to do with an override.
#[derive(Debug, clap::Subcommand)]
pub enum OverrideCommand {
    /// Give a client key its own limit under a rule (replacing its override if it has one).
    Set {
        /// Rule id.
        rule: String,
        /// The client key, as checks build it (`apikey:abc`, `user:42`).
        key: String,
        /// The key's limit (per the rule's window, period, or in flight).
        #[arg(long)]
        limit: u64,
        /// Its own window in seconds (sliding window, token bucket); the rule's otherwise.
        #[arg(long)]
        window_seconds: Option<f64>,
        /// Its own bucket capacity (token bucket).
        #[arg(long)]
        burst: Option<u64>,
        /// It ends after this many seconds (none: until deleted).
        #[arg(long)]
        expires_in: Option<u64>,
        /// Why (recorded in the audit).
        #[arg(long)]
        reason: String,
        /// Only if the override is at this version (0: only if there is none).
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// One override.
    Get {
        /// Rule id.
        rule: String,
        /// The client key.
        key: String,
    },
    /// Remove an override: the key is back to the rule's limit.
    Delete {
        /// Rule id.
        rule: String,
        /// The client key.
        key: String,
        /// Only if the override is at this version.
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// A rule's overrides, a page at a time in client-key order.
    List {
        /// Rule id.
        rule: String,
        /// Start after this client key (the `next` of the page before).
        #[arg(long, default_value = "")]
        after: String,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// The overrides' audit: who changed which, newest first.
    Audit {
        /// At most this many records.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
}

/// What to do with a penalty.
#[derive(Debug, clap::Subcommand)]
pub enum PenaltyCommand {
    /// Penalize a client key until a time: `--factor 0.1` (its limits at 10 %) or `--block`.
    Set {
        /// The client key, as checks build it (`apikey:abc`).
        key: String,
        /// Its limits times this (above 0, below 1).
        #[arg(long, conflicts_with = "block", required_unless_present = "block")]
        factor: Option<f64>,
        /// Refuse every check of the key.
        #[arg(long)]
        block: bool,
        /// It ends after this many seconds (at most 90 days).
        #[arg(long = "for")]
        for_seconds: u64,
        /// Why (recorded in the audit).
        #[arg(long)]
        reason: String,
    },
    /// One key's penalty.
    Get {
        /// The client key.
        key: String,
    },
    /// Lift a penalty before it ends.
    Delete {
        /// The client key.
        key: String,
    },
    /// The penalties that have not ended.
    List {
        /// Start after this client key.
        #[arg(long, default_value = "")]
        after: String,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
}
