//! How a client behaves: its configuration, the per-call options, and the fail policy.

use std::time::Duration;

/// What a call answers when the agent cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailPolicy {
    /// Allow: a limiter outage must not become an API outage (the default).
    #[default]
    Open,
    /// Deny with a Retry-After: for checks where over-admission is worse than downtime.
    Closed,
}

/// How a client behaves; `ClientConfig::default()` suits most services.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Longest a call waits for the agent (default 10 ms).
    pub timeout: Duration,
    /// What a call answers when the agent cannot (default open).
    pub fail: FailPolicy,
    /// The Retry-After a fail-closed answer carries (default 1 s).
    pub closed_retry_after: Duration,
    /// First reconnection delay; doubles on each failure (default 10 ms).
    pub reconnect_min: Duration,
    /// Longest reconnection delay (default 1 s).
    pub reconnect_max: Duration,
    /// Longest a connection attempt and its Hello may take (default 250 ms).
    pub connect_timeout: Duration,
    /// Checks queued for the socket at most; past it calls answer by their fail policy (default 8192).
    pub queue: usize,
    /// A limit this process enforces by itself while the agent is away, for fail-open calls (off by
    /// default): the service is not left unprotected when its agent is gone.
    pub fallback_limit: Option<LocalLimit>,
}

/// A per-process limit per check key (items: every `(key, rule)` of the check; attributes: all of
/// them), as a token bucket of `limit` refilled over `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalLimit {
    /// Bucket capacity and refill per `per`.
    pub limit: u32,
    /// The refill period.
    pub per: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            timeout: Duration::from_millis(10),
            fail: FailPolicy::Open,
            closed_retry_after: Duration::from_secs(1),
            reconnect_min: Duration::from_millis(10),
            reconnect_max: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(250),
            queue: 8192,
            fallback_limit: None,
        }
    }
}

/// Per-call overrides of the client's configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallOptions {
    /// The caller's W3C trace context (a `traceparent`, [`TraceContext::parse`]): sent with the
    /// check to an agent of protocol version 5, whose span of the check (when it exports traces)
    /// is then its child. Never sent to an older agent.
    ///
    /// [`TraceContext::parse`]: floodgate_protocol::TraceContext::parse
    pub trace: Option<floodgate_protocol::TraceContext>,
    /// Overrides [`ClientConfig::timeout`].
    pub timeout: Option<Duration>,
    /// Decides alone when the agent cannot answer: overrides both the rules' fail modes the client
    /// learned from the agent and [`ClientConfig::fail`].
    pub fail: Option<FailPolicy>,
}
