//! Redis behind Sentinel (`redis+sentinel://s1:26379,s2:26379/mymaster`): the sentinels name the
//! master, and after any failed call the next one asks them again, so a failover costs the calls
//! in flight (answered by the fail mode), then the new master answers. A watch asks the sentinels
//! every 100 ms too: an old master that stays writable after its replica's promotion (a `SENTINEL
//! FAILOVER` leaves it so for seconds) is left as soon as they name the new one, and the failover
//! is counted, so that the agent writes its recent admissions again into the new master.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use floodgate_core::store::StoreError;

/// A parsed `redis+sentinel://` (or `rediss+sentinel://`: TLS to the master) URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    /// The sentinels, `host:port`.
    pub sentinels: Vec<String>,
    /// The monitored master's name.
    pub service: String,
    /// TLS to the master.
    pub tls: bool,
    /// The master's AUTH user and password from the URL.
    pub user: Option<String>,
    /// The password.
    pub password: Option<String>,
}

/// Whether `url` names Redis through Sentinel.
pub fn is_sentinel(url: &str) -> bool {
    url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://")
}

impl SentinelUrl {
    /// Parses `redis+sentinel://[user:password@]host:port[,host:port…]/service`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("rediss+sentinel://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("redis+sentinel://") {
            (false, r)
        } else {
            return Err(format!(
                "{}: not a redis+sentinel:// URL",
                floodgate_core::store::redact(url)
            ));
        };
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (Some(a), r),
            None => (None, rest),
        };
        let (hosts, service) = rest
            .split_once('/')
            .ok_or_else(|| "a redis+sentinel:// URL ends in /<master name>".to_string())?;
        let service = service.trim_end_matches('/').to_string();
        if service.is_empty() {
            return Err("a redis+sentinel:// URL ends in /<master name>".into());
        }
        let sentinels: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(String::from)
            .collect();
        if sentinels.is_empty() {
            return Err("a redis+sentinel:// URL names at least one sentinel host:port".into());
        }
        let (user, password) = match auth.map(|a| a.split_once(':').unwrap_or((a, ""))) {
            Some((u, p)) => (
                Some(u.to_string()).filter(|u| !u.is_empty()),
                Some(p.to_string()).filter(|p| !p.is_empty()),
            ),
            None => (None, None),
        };
        Ok(SentinelUrl {
            sentinels,
            service,
            tls,
            user,
            password,
        })
    }
}

/// How often the watch asks the sentinels which master they name.
const WATCH_EVERY: Duration = Duration::from_millis(100);

struct Inner {
    client: tokio::sync::Mutex<SentinelClient>,
    conn: std::sync::Mutex<Option<MultiplexedConnection>>,
    /// The sentinels (`host:port`) and the master's name, for the watch.
    sentinels: Vec<String>,
    service: String,
    /// Whether the watch runs (it starts with the first call, on the caller's runtime).
    watching: std::sync::atomic::AtomicBool,
    /// New masters the watch has seen named.
    failovers: std::sync::atomic::AtomicU64,
}

/// The connection to the current master, asked of the sentinels again after a failed call.
#[derive(Clone)]
pub struct SentinelConn {
    inner: Arc<Inner>,
}

impl SentinelConn {
    /// A client for `url`; `password` (from `--redis-password-file`) replaces the URL's.
    pub fn new(url: &SentinelUrl, password: Option<&str>) -> Result<Self, StoreError> {
        let mut info = redis::RedisConnectionInfo::default();
        if let Some(u) = &url.user {
            info = info.set_username(u);
        }
        if let Some(p) = password.or(url.password.as_deref()) {
            info = info.set_password(p);
        }
        let mut node = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
        if url.tls {
            node = node.set_tls_mode(redis::TlsMode::Secure);
        }
        let sentinels: Vec<String> = url.sentinels.iter().map(|h| format!("redis://{h}")).collect();
        let client = SentinelClient::build(
            sentinels,
            url.service.clone(),
            Some(node),
            SentinelServerType::Master,
        )
        .map_err(|e| StoreError::Connection(e.to_string()))?;
        Ok(SentinelConn {
            inner: Arc::new(Inner {
                client: tokio::sync::Mutex::new(client),
                conn: std::sync::Mutex::new(None),
                sentinels: url.sentinels.clone(),
                service: url.service.clone(),
                watching: std::sync::atomic::AtomicBool::new(false),
                failovers: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    fn cached(&self) -> Option<MultiplexedConnection> {
        self.inner.conn.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn forget(&self) {
        *self.inner.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// New masters the sentinels have named since the first call.
    pub fn failovers(&self) -> u64 {
        self.inner.failovers.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn get(&self) -> redis::RedisResult<MultiplexedConnection> {
        if !self
            .inner
            .watching
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tokio::spawn(watch(Arc::downgrade(&self.inner)));
        }
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let mut client = self.inner.client.lock().await;
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_response_timeout(None);
        let master = client.async_get_client().await?;
        let mut info = master.get_connection_info().clone();
        // The sentinels' own answer wins: during a failover `SENTINEL MASTERS` (what redis-rs
        // reads) still names the old master, which also still says it is one, for seconds after
        // `get-master-addr-by-name` names the promoted replica (seen in the fault runner: an agent
        // that followed the switch reconnected to the old master).
        let mut conns = vec![None; self.inner.sentinels.len()];
        if let Some((host, port)) = master_named(&self.inner, &mut conns).await {
            let mut addr = info.addr().clone();
            if let redis::ConnectionAddr::Tcp(h, p) | redis::ConnectionAddr::TcpTls { host: h, port: p, .. } =
                &mut addr
            {
                (*h, *p) = (host, port);
            }
            info = info.set_addr(addr);
        }
        tracing::info!(master = %info.addr(), "connecting to the master the sentinels name");
        let c = redis::Client::open(info)?
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        *self.inner.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
        Ok(c)
    }
}

/// Asks the sentinels every [`WATCH_EVERY`] which master they name; when it changes, drops the
/// connection to the old one (the next call asks for the new one) and counts a failover. Ends when
/// the connection's owner is gone.
async fn watch(inner: std::sync::Weak<Inner>) {
    let mut named: Option<(String, u16)> = None;
    let mut conns: Vec<Option<MultiplexedConnection>> = Vec::new();
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        conns.resize(inner.sentinels.len(), None);
        let Some(now) = master_named(&inner, &mut conns).await else {
            continue;
        };
        if named.as_ref().is_some_and(|was| *was != now) {
            tracing::warn!(
                master = %format!("{}:{}", now.0, now.1),
                "the sentinels name a new master: leaving the old one, and writing this agent's recent admissions again"
            );
            *inner.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
            inner.failovers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        named = Some(now);
    }
}

/// The master the first sentinel that answers names (within 200 ms each).
async fn master_named(inner: &Inner, conns: &mut [Option<MultiplexedConnection>]) -> Option<(String, u16)> {
    for (host, slot) in inner.sentinels.iter().zip(conns.iter_mut()) {
        if slot.is_none() {
            let client = redis::Client::open(format!("redis://{host}")).ok()?;
            let config = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(200)))
                .set_response_timeout(Some(Duration::from_millis(200)));
            *slot = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .ok();
        }
        let Some(conn) = slot.as_mut() else { continue };
        let asked: redis::RedisResult<Vec<String>> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&inner.service)
            .query_async(conn)
            .await;
        match asked {
            Ok(addr) if addr.len() == 2 => {
                if let Ok(port) = addr[1].parse() {
                    return Some((addr[0].clone(), port));
                }
            }
            Ok(_) => {}
            Err(_) => *slot = None,
        }
    }
    None
}

/// Whether an error means the master is gone from this connection (dropped, refused, or turned
/// replica: READONLY, MASTERDOWN), so the sentinels are asked again next time. A script or command
/// error (NOSCRIPT on a new master, OOM, BUSY) keeps the connection: asking again would not help.
fn lost(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly | redis::ServerErrorKind::MasterDown)
        )
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut c = self.get().await?;
            let r = c.req_packed_command(cmd).await;
            if r.as_ref().is_err_and(lost) {
                self.forget();
            }
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut c = self.get().await?;
            let r = c.req_packed_commands(pipeline, offset, count).await;
            if r.as_ref().is_err_and(lost) {
                self.forget();
            }
            r
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_parse() {
        let u = SentinelUrl::parse("redis+sentinel://app:pw@10.0.0.1:26379,10.0.0.2:26379/mymaster").unwrap();
        assert_eq!(u.sentinels, ["10.0.0.1:26379", "10.0.0.2:26379"]);
        assert_eq!((u.service.as_str(), u.tls), ("mymaster", false));
        assert_eq!(
            (u.user.as_deref(), u.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        assert!(SentinelUrl::parse("rediss+sentinel://h:1/m").unwrap().tls);
        assert!(SentinelUrl::parse("redis+sentinel://h:1").is_err());
        assert!(SentinelUrl::parse("redis+sentinel:///m").is_err());
        assert!(is_sentinel("redis+sentinel://h:1/m") && !is_sentinel("redis://h:1"));
    }
}
