//! Fleet membership: every agent writes a heartbeat (its id with an expiry) to Redis and learns N,
//! the number of live agents, which the fallback limiter divides limits by. The last known N is kept
//! while Redis is away (floor 1), and an operator may pin N in config.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Membership settings.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    /// This agent's id (default: hostname and pid).
    pub id: String,
    /// How often to write the heartbeat (default 1 s).
    pub interval: Duration,
    /// How long a heartbeat counts (default 5 s: a missed beat or two does not drop an agent).
    pub ttl: Duration,
    /// A fixed N from the operator, overriding the heartbeats.
    pub fixed: Option<u64>,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            id: default_agent_id(),
            interval: Duration::from_secs(1),
            ttl: Duration::from_secs(5),
            fixed: None,
        }
    }
}

/// `hostname:pid`, unique per agent process on a fleet.
pub fn default_agent_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into());
    format!("{host}:{}", std::process::id())
}

/// The live-agent count.
#[derive(Debug)]
pub struct Membership {
    config: MembershipConfig,
    live: AtomicU64,
}

impl Membership {
    /// Membership with N = 1 until the first heartbeat answers.
    pub fn new(config: MembershipConfig) -> Self {
        let start = config.fixed.unwrap_or(1).max(1);
        Membership {
            config,
            live: AtomicU64::new(start),
        }
    }

    /// N: the operator's value, else the last count Redis gave (at least 1).
    pub fn live(&self) -> u64 {
        self.config
            .fixed
            .unwrap_or_else(|| self.live.load(Ordering::Relaxed))
            .max(1)
    }

    /// Records a count from a heartbeat.
    pub fn observe(&self, n: u64) {
        self.live.store(n.max(1), Ordering::Relaxed);
    }

    /// The settings.
    pub fn config(&self) -> &MembershipConfig {
        &self.config
    }
}
