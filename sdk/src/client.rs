//! The client: its handles, the calls, and what a call answers when the agent cannot.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use floodgate_protocol::{Attributes, Body, Check, ErrorCode, Frame, Item};
use tokio::sync::{mpsc, oneshot};

use crate::config::{CallOptions, ClientConfig, FailPolicy, LocalLimit};
use crate::connection;
use crate::state::{Reply, Shared};
use crate::{Decision, Degraded, Error};

/// Distinct keys the local limiter tracks before it starts over (bounded memory).
const LOCAL_KEYS: usize = 100_000;

/// Counts of calls the SDK answered by itself, for the service's own metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Calls answered by the fail policy because there was no connection.
    pub unavailable: u64,
    /// Calls answered by the fail policy because the agent was late.
    pub timeouts: u64,
    /// Connections established (the first one included).
    pub connects: u64,
    /// Degraded calls the per-process fallback limit denied.
    pub local_denied: u64,
}

/// How the client's link to the agent is doing, for the service's health checks and dashboards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Whether a connection to the agent is up right now.
    pub connected: bool,
    /// The socket in use, or the last one tried.
    pub path: PathBuf,
    /// Why the last connection attempt failed, until one succeeds.
    pub last_error: Option<String>,
    /// Connection attempts that failed in a row (0 once connected).
    pub failed_attempts: u64,
    /// Calls answered by the fail policy (agent unreachable or late) since the client started.
    pub fail_policy_answers: u64,
    /// How many rules fail closed by the agent's last list; `None` until a list arrived (an agent
    /// of protocol version 2 sends it after every connection and every 10 s).
    pub fail_closed_rules: Option<usize>,
    /// The agent's rule set version that list came from.
    pub rules_version: Option<u64>,
}

/// A handle to the local agent. Cheap to clone; all clones share one connection.
#[derive(Clone)]
pub struct Client {
    pub(crate) shared: Arc<Shared>,
    tx: mpsc::Sender<Vec<u8>>,
}

impl Client {
    /// A client for the agent at `path` (a Unix socket, or `tcp://host:port` for an agent's
    /// `--listen-tcp`) with the default configuration. Returns at once; the
    /// connection is made (and remade) in the background, and calls answer by the fail policy
    /// until it is up.
    pub async fn connect(path: impl AsRef<Path>) -> Client {
        Self::with_config(path, ClientConfig::default()).await
    }

    /// A client for the agent at its default socket ([`default_socket_path`]: `$FLOODGATE_SOCKET`,
    /// else `/run/floodgate/floodgate.sock`, else `$XDG_RUNTIME_DIR/floodgate/floodgate.sock`),
    /// looked up again on every connection attempt.
    pub async fn connect_default() -> Client {
        Self::build(None, ClientConfig::default()).await
    }

    /// [`connect_default`](Self::connect_default) with a configuration.
    pub async fn with_config_default(config: ClientConfig) -> Client {
        Self::build(None, config).await
    }

    /// A client with a configuration. Waits up to `connect_timeout` for the first connection so that
    /// the first calls reach the agent when it is up.
    pub async fn with_config(path: impl AsRef<Path>, config: ClientConfig) -> Client {
        Self::build(Some(path.as_ref().to_path_buf()), config).await
    }

    async fn build(path: Option<PathBuf>, config: ClientConfig) -> Client {
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        let shared = Arc::new(Shared::new(path, config));
        let (ready_tx, ready_rx) = oneshot::channel();
        tokio::spawn(connection::run(Arc::downgrade(&shared), rx, ready_tx));
        let _ = tokio::time::timeout(shared.config.connect_timeout, ready_rx).await;
        Client { shared, tx }
    }

    /// `allow(key, ruleId, cost)`: one item.
    pub async fn allow(&self, key: &str, rule_id: &str, cost: u32) -> Result<Decision, Error> {
        self.check(vec![Item::new(key, rule_id, cost)]).await
    }

    /// Whether `cost` would pass for `key` under `rule_id`, and what is left now, changing nothing
    /// (protocol version 2; a cost of 0 only reads the figures).
    pub async fn peek(&self, key: &str, rule_id: &str, cost: u32) -> Result<Decision, Error> {
        self.check(vec![Item::peek(key, rule_id, cost)]).await
    }

    /// Takes `cost` for `key` under `rule_id` whatever the limit says (a cost known after the
    /// response: tokens, bytes); later checks wait out any debt. Never a rejection (protocol
    /// version 2).
    pub async fn charge(&self, key: &str, rule_id: &str, cost: u32) -> Result<Decision, Error> {
        self.check(vec![Item::charge(key, rule_id, cost)]).await
    }

    /// Acquires `cost` units of concurrency rule `rule_id` for `key` under a new lease (protocol
    /// version 3): the decision, and the lease if the rule now holds it. Release it with
    /// [`release`](Self::release) when the work ends; a lease not released runs out after the rule's
    /// `leaseSeconds`. When the agent cannot answer, the decision is the fail policy's and there is
    /// no lease.
    pub async fn acquire(
        &self,
        key: &str,
        rule_id: &str,
        cost: u32,
    ) -> Result<(Decision, Option<Lease>), Error> {
        let id = self.shared.next_lease();
        let d = self.check(vec![Item::acquire(key, rule_id, cost, id)]).await?;
        if !d.from_agent_answer() {
            // Late or lost: the agent may still have taken the lease. Released at once, off the
            // caller's path (a release of a lease not held changes nothing).
            let (client, item) = (self.clone(), Item::release(key, rule_id, cost, Some(id)));
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = client.check(vec![item]).await;
                });
            }
        }
        let held = d.items.first().is_some_and(|i| i.verdict.holds_lease);
        let lease = held.then(|| Lease {
            key: key.to_string(),
            rule_id: rule_id.to_string(),
            cost,
            id,
        });
        Ok((d, lease))
    }

    /// A lease for a request's attribute check when the agent can hold one (protocol version 3):
    /// what the middleware sends with every request.
    #[cfg(feature = "tower")]
    pub(crate) fn lease_for_requests(&self) -> Option<u64> {
        let v3 =
            self.shared.connected.load(Ordering::Acquire) && self.shared.version.load(Ordering::Relaxed) >= 3;
        v3.then(|| self.shared.next_lease())
    }

    /// Gives a lease's units back (protocol version 3). While the agent cannot answer, the decision
    /// is the fail policy's and the lease runs out by itself.
    pub async fn release(&self, lease: &Lease) -> Result<Decision, Error> {
        self.check(vec![Item::release(
            lease.key.as_str(),
            lease.rule_id.as_str(),
            lease.cost,
            Some(lease.id),
        )])
        .await
    }

    /// Several items at once: allowed only if every item is.
    pub async fn check(&self, items: Vec<Item>) -> Result<Decision, Error> {
        self.check_with(Check::Items(items), CallOptions::default()).await
    }

    /// Request attributes for the agent to match against its rules.
    pub async fn check_request(&self, attributes: Attributes) -> Result<Decision, Error> {
        self.check_with(Check::Attributes(attributes), CallOptions::default())
            .await
    }

    /// Any check, with per-call options. Returns within the timeout, whatever the agent does.
    ///
    /// When the agent cannot answer, the call decides by, in order: `options.fail`; a rule of the
    /// check the agent listed as fail-closed (denied, with that rule's limit); [`ClientConfig::fail`].
    pub async fn check_with(&self, check: Check, options: CallOptions) -> Result<Decision, Error> {
        let timeout = options.timeout.unwrap_or(self.shared.config.timeout);
        if self.shared.connected.load(Ordering::Acquire)
            && self.shared.version.load(Ordering::Relaxed) < 2
            && has_modes(&check)
        {
            // A version-1 agent cannot parse a peek or a charge: it would close the connection.
            return Err(Error::Invalid(
                "the agent speaks protocol version 1: it cannot peek or charge (update the agent)".into(),
            ));
        }
        let version = self.shared.version.load(Ordering::Relaxed);
        if self.shared.connected.load(Ordering::Acquire) && version < 6 && has_reservations(&check) {
            return Err(Error::Invalid(format!(
                "the agent speaks protocol version {version}: it cannot hold reservations (update the agent)"
            )));
        }
        if self.shared.connected.load(Ordering::Acquire) && version < 3 && has_leases(&check) {
            return Err(Error::Invalid(format!(
                "the agent speaks protocol version {version}: it cannot hold leases (update the agent)"
            )));
        }
        let id = self.shared.next_id();
        let mut frame = Frame::new(id, Body::Check(check));
        if version >= 5 {
            frame.trace = options.trace;
        }
        let bytes = frame.to_bytes().map_err(|e| Error::Invalid(e.to_string()))?;
        let Body::Check(check) = frame.body else {
            unreachable!("built as a check above")
        };
        let degraded = |why| self.degraded(&check, options.fail, why);
        if !self.shared.connected.load(Ordering::Acquire) {
            return Ok(degraded(Degraded::Unavailable));
        }
        let (reply_tx, reply_rx) = oneshot::channel();
        self.shared.pending().insert(id, reply_tx);
        let guard = PendingGuard {
            shared: &self.shared,
            id,
        };
        if self.tx.try_send(bytes).is_err() {
            return Ok(degraded(Degraded::Unavailable));
        }
        let result = tokio::time::timeout(timeout, reply_rx).await;
        drop(guard);
        match result {
            Ok(Ok(Reply::Decision(d))) => Ok(Decision::from_agent(d)),
            Ok(Ok(Reply::Error(e))) => match e.code {
                // Only a check the caller got wrong is an error; anything else (overload, an internal
                // error, a code from a newer agent) is the agent's trouble: answer by the policy.
                code @ (ErrorCode::UnknownRule | ErrorCode::InvalidItem) => Err(Error::Agent {
                    code,
                    message: e.message,
                }),
                _ => Ok(degraded(Degraded::Unavailable)),
            },
            Ok(Err(_)) => Ok(degraded(Degraded::Unavailable)),
            Err(_) => Ok(degraded(Degraded::Timeout)),
        }
    }

    /// Whether the client holds a live connection to the agent right now.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire)
    }

    /// How the link to the agent is doing: for the service's health checks (an app whose agent is
    /// unreachable answers every call by its fail policy, which a readiness probe should see).
    pub fn health(&self) -> Health {
        let fail_modes = self.shared.fail_modes();
        let l = self.shared.link();
        Health {
            connected: self.is_connected(),
            path: l.path.clone(),
            last_error: l.last_error.clone(),
            failed_attempts: l.failed_attempts,
            fail_policy_answers: self.shared.unavailable.load(Ordering::Relaxed)
                + self.shared.timeouts.load(Ordering::Relaxed),
            fail_closed_rules: fail_modes.as_ref().map(|l| l.rules.len()),
            rules_version: fail_modes.map(|l| l.rules_version),
        }
    }

    /// Counts of degraded answers and connections, for the service's metrics.
    pub fn stats(&self) -> ClientStats {
        ClientStats {
            unavailable: self.shared.unavailable.load(Ordering::Relaxed),
            timeouts: self.shared.timeouts.load(Ordering::Relaxed),
            connects: self.shared.connects.load(Ordering::Relaxed),
            local_denied: self.shared.local_denied.load(Ordering::Relaxed),
        }
    }

    /// The answer when the agent cannot give one: `fail` if the call gave it, else denied if the
    /// check touches a rule the agent listed as fail-closed, else the client's policy (with its
    /// fallback limit when open).
    fn degraded(&self, check: &Check, fail: Option<FailPolicy>, why: Degraded) -> Decision {
        match why {
            Degraded::Unavailable => &self.shared.unavailable,
            Degraded::Timeout => &self.shared.timeouts,
        }
        .fetch_add(1, Ordering::Relaxed);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let retry = self.shared.config.closed_retry_after.as_millis() as u64;
        let closing = match fail {
            Some(_) => None,
            None => self
                .shared
                .fail_modes()
                .and_then(|l| l.closing(check).map(|r| (r.rule_id.clone(), r.limit))),
        };
        if let Some((rule, limit)) = closing {
            return Decision::degraded(false, why, retry, now).under_rule(&rule, limit);
        }
        let policy = fail.unwrap_or(self.shared.config.fail);
        // The per-process limit counts what passes: a peek takes nothing and a charge is owed
        // whatever it says, so only consuming checks go through it.
        if let (FailPolicy::Open, Some(limit), false) =
            (policy, self.shared.config.fallback_limit, has_modes(check))
        {
            let (key, cost) = local_key(check);
            return self.local_limit(limit, &key, cost, why, now);
        }
        Decision::degraded(policy == FailPolicy::Open, why, retry, now)
    }

    /// The per-process fallback limit: a token bucket per check key.
    fn local_limit(&self, limit: LocalLimit, key: &str, cost: u32, why: Degraded, now_ms: u64) -> Decision {
        let capacity = f64::from(limit.limit.max(1));
        let rate = capacity / limit.per.as_secs_f64().max(1e-3); // tokens per second
        let now = Instant::now();
        let mut map = self.shared.local.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= LOCAL_KEYS && !map.contains_key(key) {
            map.clear();
        }
        let (tokens, at) = map.entry(key.to_string()).or_insert((capacity, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(capacity);
        *at = now;
        let cost = f64::from(cost);
        let allowed = *tokens >= cost;
        if allowed {
            *tokens -= cost;
        } else {
            self.shared.local_denied.fetch_add(1, Ordering::Relaxed);
        }
        let retry_ms = if allowed {
            0
        } else {
            (((cost - *tokens) / rate) * 1000.0).ceil().max(1.0) as u64
        };
        Decision::local(
            allowed,
            why,
            limit.limit.into(),
            tokens.max(0.0) as u64,
            retry_ms,
            now_ms,
        )
    }
}

/// Whether a check has an item that does not simply consume (protocol version 2).
fn has_modes(check: &Check) -> bool {
    match check {
        Check::Items(items) => items.iter().any(|i| !i.mode.takes_if_passed()),
        Check::Attributes(a) => !a.mode.takes_if_passed(),
    }
}

/// Whether a check names a lease or releases (protocol version 3).
fn has_leases(check: &Check) -> bool {
    match check {
        Check::Items(items) => items.iter().any(|i| i.lease.is_some() || i.mode.gives_back()),
        Check::Attributes(a) => a.lease.is_some() || a.mode.gives_back(),
    }
}

fn has_reservations(check: &Check) -> bool {
    match check {
        Check::Items(items) => items.iter().any(|i| i.mode.reserves()),
        Check::Attributes(a) => a.mode.reserves(),
    }
}

/// A concurrency rule's lease the client holds: release it with [`Client::release`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The client key.
    pub key: String,
    /// The concurrency rule.
    pub rule_id: String,
    /// The units it holds.
    pub cost: u32,
    /// Its id, chosen by this client.
    pub id: u64,
}

/// The local limiter's key and cost for a check.
fn local_key(check: &Check) -> (String, u32) {
    match check {
        Check::Items(items) => {
            let mut k = String::new();
            for i in items {
                k.push_str(&i.rule_id);
                k.push('\0');
                k.push_str(&i.key);
                k.push('\0');
            }
            (k, items.iter().map(|i| i.cost).max().unwrap_or(1))
        }
        Check::Attributes(a) => {
            let mut k = String::from("attributes\0");
            for (_, v) in a.fields() {
                k.push_str(v.as_deref().unwrap_or(""));
                k.push('\0');
            }
            (k, a.cost)
        }
    }
}

/// Removes a call's pending entry however the call ends (answered, timed out, or dropped by its caller).
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u32,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.pending().remove(&self.id);
    }
}
