//! The Redis store: one atomic Lua script call per algorithm per check, EVALSHA with a transparent
//! reload on NOSCRIPT, a bounded timeout, and errors classified for the rule's fail mode.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Client, ErrorKind, RedisError, Script};

use super::{Planned, StoreError};
use crate::algo::Outcome;
use crate::guard::membership::{AGENTS_KEY, HEARTBEAT_LUA};
use crate::guard::LedgerEntry;
use crate::rules::Algorithm;

/// The check script, embedded at build time: the two algorithms' functions and the all-or-nothing
/// driver, as one script with one SHA (see `lua/check.lua`).
pub const CHECK_LUA: &str = concat!(
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/check.lua"),
);

/// Ledger entries one write-back script call carries (keeps each call short).
pub const WRITE_BACK_CHUNK: usize = 64;

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// Longest a check may wait for Redis before the rule's fail mode decides.
    pub timeout: Duration,
}

/// Redis as the shared counter store.
pub struct RedisStore {
    conn: ConnectionManager,
    script: Script,
    heartbeat: Script,
    timeout: Duration,
    url: String,
}

impl RedisStore {
    /// Prepares a store. Connects lazily: an agent starts (and fails open) even while Redis is away.
    pub fn new(config: &RedisConfig) -> Result<Self, StoreError> {
        let client = Client::open(config.url.as_str()).map_err(|e| StoreError::Connection(e.to_string()))?;
        let manager_config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_number_of_retries(3)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config)
            .map_err(|e| StoreError::Connection(e.to_string()))?;
        Ok(RedisStore {
            conn,
            script: Script::new(CHECK_LUA),
            heartbeat: Script::new(HEARTBEAT_LUA),
            timeout: config.timeout,
            url: redact(&config.url),
        })
    }

    /// The URL without its password, for logs.
    pub fn describe(&self) -> &str {
        &self.url
    }

    /// Redis key of a (rule, key) pair. The client key is the hash tag, so all of one client's
    /// counters share a slot; keys never contain braces (the protocol refuses them).
    pub fn redis_key(rule_id: &str, key: &str) -> String {
        format!("fg:{{{key}}}:{rule_id}")
    }

    /// Checks the items in one atomic script call; outcomes come back in item order.
    pub async fn check(&self, items: &[Planned]) -> Result<Vec<Outcome>, StoreError> {
        self.run(items, None, self.timeout).await
    }

    /// Adds what agents admitted locally while Redis was away to the Redis counters, whatever the
    /// verdict (the script's write-back mode), each into the window it was admitted in, so the limit
    /// holds across the outage. Chunks of 64 keep each script call short. On failure, returns how many
    /// entries were committed before the failing chunk, and the error.
    pub async fn write_back(&self, entries: &[LedgerEntry]) -> Result<(), (usize, StoreError)> {
        for (n, chunk) in entries.chunks(WRITE_BACK_CHUNK).enumerate() {
            let items: Vec<Planned> = chunk
                .iter()
                .map(|e| Planned {
                    rule: e.rule.clone(),
                    key: e.key.clone(),
                    cost: e.units,
                })
                .collect();
            let windows: Vec<u64> = chunk.iter().map(|e| e.window).collect();
            // Not on the request path: a longer timeout than checks get.
            let timeout = self.timeout.max(Duration::from_millis(250));
            if let Err(e) = self.run(&items, Some(&windows), timeout).await {
                return Err((n * WRITE_BACK_CHUNK, e));
            }
        }
        Ok(())
    }

    /// The breaker's probe: loads the check script (a restarted Redis has an empty cache; a slow
    /// reconnection gets 250 ms), then runs one check-shaped call under the checks' own timeout, so the
    /// breaker closes only when checks would succeed too.
    pub async fn probe(&self) -> Result<(), StoreError> {
        self.preload().await?;
        let mut inv = self.script.prepare_invoke();
        inv.key("fg:{floodgate:probe}:probe");
        inv.arg(1)
            .arg(1u64 << 50)
            .arg(1_000)
            .arg(1u64 << 50)
            .arg(1)
            .arg(0)
            .arg(0);
        let mut conn = self.conn.clone();
        let _: Vec<i64> = tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(classify)?;
        Ok(())
    }

    /// Loads the check script (SCRIPT LOAD), so that a burst of checks after a start or a Redis restart
    /// finds it cached instead of each paying NOSCRIPT and a reload within its timeout.
    pub async fn preload(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        tokio::time::timeout(
            self.timeout.max(Duration::from_millis(250)),
            self.script.prepare_invoke().load_async(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))?
        .map_err(classify)?;
        Ok(())
    }

    /// Writes this agent's heartbeat (or removes it when `leaving`) and returns the live-agent count.
    pub async fn heartbeat(&self, id: &str, ttl: Duration, leaving: bool) -> Result<u64, StoreError> {
        let mut inv = self.heartbeat.prepare_invoke();
        inv.key(AGENTS_KEY)
            .arg(id)
            .arg(ttl.as_millis() as u64)
            .arg(if leaving { 1 } else { 0 });
        let mut conn = self.conn.clone();
        let n: u64 = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(250)),
            inv.invoke_async(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))?
        .map_err(classify)?;
        Ok(n)
    }

    async fn run(
        &self,
        items: &[Planned],
        write_back: Option<&[u64]>,
        timeout: Duration,
    ) -> Result<Vec<Outcome>, StoreError> {
        let mut inv = self.script.prepare_invoke();
        for (i, p) in items.iter().enumerate() {
            let r = &p.rule;
            let algorithm = match r.algorithm {
                Algorithm::SlidingWindow => 1,
                Algorithm::TokenBucket => 2,
            };
            inv.key(Self::redis_key(&r.id, &p.key));
            inv.arg(algorithm)
                .arg(r.limit.get())
                .arg(r.window_ms())
                .arg(r.burst())
                .arg(p.cost)
                .arg(match (write_back, r.enforced()) {
                    (Some(_), _) => 2,
                    (None, true) => 1,
                    (None, false) => 0,
                })
                .arg(write_back.and_then(|w| w.get(i).copied()).unwrap_or(0));
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = tokio::time::timeout(timeout, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError::Timeout(timeout))?
            .map_err(classify)?;
        if reply.len() != items.len() * 5 {
            return Err(StoreError::Script(format!(
                "script returned {} values for {} items",
                reply.len(),
                items.len()
            )));
        }
        let u = |x: i64| x.max(0) as u64;
        Ok(reply
            .chunks_exact(5)
            .map(|v| Outcome {
                allowed: v[0] == 1,
                limit: u(v[1]),
                remaining: u(v[2]),
                reset_at_ms: u(v[3]),
                retry_after_ms: u(v[4]),
            })
            .collect())
    }

    /// PING with the store timeout, for readiness.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        tokio::time::timeout(
            self.timeout.max(Duration::from_millis(100)),
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))?
        .map_err(classify)?;
        Ok(())
    }
}

fn classify(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(Duration::ZERO)
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreError::Connection(e.to_string())
    } else {
        match e.kind() {
            ErrorKind::Server(_) => StoreError::Server(e.to_string()),
            _ => StoreError::Script(e.to_string()),
        }
    }
}

fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_client_as_hash_tag() {
        assert_eq!(RedisStore::redis_key("api", "user:1"), "fg:{user:1}:api");
    }

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(redact("redis://:secret@host:6379/0"), "redis://***@host:6379/0");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }
}
