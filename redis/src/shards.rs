//! The Redis deployment behind the store: independent nodes, each bucket of clients placed by
//! rendezvous hashing (adding a node moves only the buckets it wins, ~1/(n+1) of them; 16,384 buckets
//! keep the nodes' shares within a percent or so), or one Redis Cluster (redis-rs routes each call by
//! its keys' slot — the hash tag — and follows MOVED and ASK).

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, Pipeline, RedisFuture, Value};
use tokio::sync::OnceCell;

use floodgate_core::store::layout::fnv1a;
use floodgate_core::store::{redact, StoreError};

/// One connection to wherever a call goes: a node's connection manager or the cluster connection.
#[derive(Clone)]
pub enum Conn {
    /// One node (reconnects by itself).
    Node(ConnectionManager),
    /// The cluster (routes by slot, refreshes its slot map on MOVED).
    Cluster(ClusterConnection),
    /// The master the sentinels name.
    Sentinel(crate::sentinel::SentinelConn),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// How the agent proves itself to Redis beyond its URLs: TLS roots for `rediss://` and a password
/// kept out of the URL (and so out of `ps` and the environment).
#[derive(Debug, Clone, Default)]
pub struct RedisAccess {
    /// PEM certificates to trust for `rediss://` instead of the system's store (a private CA).
    pub ca: Option<Vec<u8>>,
    /// The AUTH password (the URL's own, if any, is replaced); the user, if any, is the URL's.
    pub password: Option<String>,
}

impl RedisAccess {
    /// Reads `--redis-ca` and `--redis-password-file` (the password's trailing newline dropped).
    pub fn load(
        ca: Option<&std::path::Path>,
        password_file: Option<&std::path::Path>,
    ) -> Result<Self, StoreError> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| StoreError::Connection(format!("cannot read {}: {e}", p.display())))
        };
        let ca = ca.map(read).transpose()?;
        let password = match password_file {
            Some(p) => Some(
                String::from_utf8(read(p)?)
                    .map_err(|_| StoreError::Connection(format!("{} is not UTF-8", p.display())))?
                    .trim_end_matches(['\n', '\r'])
                    .to_string(),
            ),
            None => None,
        };
        Ok(RedisAccess { ca, password })
    }

    fn client(&self, url: &str) -> redis::RedisResult<Client> {
        let mut info = redis::IntoConnectionInfo::into_connection_info(url)?;
        if let Some(p) = &self.password {
            let settings = info.redis_settings().clone().set_password(p);
            info = info.set_redis_settings(settings);
        }
        match &self.ca {
            Some(ca) => Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                },
            ),
            None => Client::open(info),
        }
    }
}

/// Makes rustls use ring (once per process; the TLS connections to Redis need a provider).
fn tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The nodes, or the cluster.
pub enum Shards {
    /// Independent nodes; `by_bucket[bucket]` is the node that holds the bucket.
    Nodes {
        /// One connection per node, in the order given.
        nodes: Vec<(String, ConnectionManager)>,
        /// Bucket → node index.
        by_bucket: Vec<usize>,
    },
    /// A Redis Cluster, connected on first use (an agent starts while Redis is away).
    Cluster {
        /// The seed nodes, for logs.
        seeds: Vec<String>,
        /// The client that builds the connection.
        client: Box<ClusterClient>,
        /// The connection, once made.
        conn: OnceCell<ClusterConnection>,
        /// Its failovers, watched from the first connection on.
        watch: std::sync::Arc<crate::cluster_watch::ClusterWatch>,
    },
    /// One master found through Sentinel (one shard; failovers are followed).
    Sentinel {
        /// The URL without its password, for logs.
        name: String,
        /// The connection to whichever node is master.
        conn: crate::sentinel::SentinelConn,
    },
}

impl Shards {
    /// Connects lazily to `urls`: independent nodes, or the seeds of one cluster; `rediss://` URLs
    /// over TLS.
    pub fn new(
        urls: &[String],
        cluster: bool,
        buckets: u32,
        access: &RedisAccess,
    ) -> Result<Self, StoreError> {
        let err = |e: redis::RedisError| StoreError::Connection(e.to_string());
        if urls.is_empty() {
            return Err(StoreError::Connection("no Redis URL given".into()));
        }
        tls_provider();
        if let [url] = urls {
            if crate::sentinel::is_sentinel(url) {
                let parsed = crate::sentinel::SentinelUrl::parse(url).map_err(StoreError::Connection)?;
                return Ok(Shards::Sentinel {
                    name: redact(url),
                    conn: crate::sentinel::SentinelConn::new(&parsed, access.password.as_deref())?,
                });
            }
        }
        if urls.iter().any(|u| crate::sentinel::is_sentinel(u)) {
            return Err(StoreError::Connection(
                "a redis+sentinel:// URL names one master; it cannot be one of several shards".into(),
            ));
        }
        if cluster {
            // Redirects (MOVED, ASK) and TRYAGAIN are retried: a slot that is moving answers
            // TRYAGAIN to a call whose keys are only partly moved (every key a script touches is
            // declared), for the milliseconds its keys take. redis-rs waits at least 1.28 s by
            // default, past any check's budget; here 1 ms, doubling, at most 8 ms, within the
            // store timeout that bounds the call anyway.
            let mut builder = ClusterClient::builder(urls.iter().map(String::as_str))
                .connection_timeout(Duration::from_millis(500))
                .retries(4)
                .min_retry_wait(1)
                .max_retry_wait(8)
                .retry_wait_formula(1, 2);
            if let Some(p) = &access.password {
                builder = builder.password(p);
            }
            if let Some(ca) = &access.ca {
                builder = builder.certs(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(ca.clone()),
                });
            }
            let client = builder.build().map_err(err)?;
            return Ok(Shards::Cluster {
                seeds: urls.iter().map(|u| redact(u)).collect(),
                client: Box::new(client),
                conn: OnceCell::new(),
                watch: Default::default(),
            });
        }
        let mut nodes = Vec::with_capacity(urls.len());
        for url in urls {
            let client = access.client(url).map_err(err)?;
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(500)))
                .set_number_of_retries(3)
                .set_min_delay(Duration::from_millis(10))
                .set_max_delay(Duration::from_millis(500));
            let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(err)?;
            nodes.push((redact(url), conn));
        }
        let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
        let by_bucket = (0..buckets).map(|b| rendezvous(&names, b)).collect();
        Ok(Shards::Nodes { nodes, by_bucket })
    }

    /// How many shards have breakers of their own: one per node; a cluster is one (redis-rs follows
    /// its failovers).
    pub fn len(&self) -> usize {
        match self {
            Shards::Nodes { nodes, .. } => nodes.len(),
            Shards::Cluster { .. } | Shards::Sentinel { .. } => 1,
        }
    }

    /// Always false: a store has at least one shard.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// New masters the sentinels have named, or failovers a Cluster's slot map showed (0 for
    /// independent nodes).
    pub fn failovers(&self) -> u64 {
        match self {
            Shards::Sentinel { conn, .. } => conn.failovers(),
            Shards::Cluster { watch, .. } => watch.failovers(),
            Shards::Nodes { .. } => 0,
        }
    }

    /// Watches a Cluster's failovers from its first connection on (the store's shards; a second
    /// user of the same Cluster, the events' writer, need not).
    pub fn watch_failovers(&self) {
        if let Shards::Cluster { watch, .. } = self {
            watch.want();
        }
    }

    /// A Cluster's slots failed over since the last call (one bit each); `None` elsewhere (a
    /// Sentinel failover moves every key).
    pub fn take_failed_slots(&self) -> Option<Vec<u64>> {
        match self {
            Shards::Cluster { watch, .. } => Some(watch.take_failed()),
            Shards::Nodes { .. } | Shards::Sentinel { .. } => None,
        }
    }

    /// Whether the master is found through Sentinel.
    pub fn is_sentinel(&self) -> bool {
        matches!(self, Shards::Sentinel { .. })
    }

    /// Whether this is a Redis Cluster (one script call may carry keys of one tag only).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Shards::Cluster { .. })
    }

    /// The shard that holds a bucket.
    pub fn shard_of_bucket(&self, bucket: u32) -> usize {
        match self {
            Shards::Nodes { by_bucket, .. } => by_bucket[bucket as usize % by_bucket.len()],
            Shards::Cluster { .. } | Shards::Sentinel { .. } => 0,
        }
    }

    /// The connection for a shard (for a cluster, its one connection, made on first use).
    pub async fn conn(&self, shard: usize) -> Result<Conn, StoreError> {
        match self {
            Shards::Nodes { nodes, .. } => Ok(Conn::Node(nodes[shard % nodes.len()].1.clone())),
            Shards::Cluster {
                client, conn, watch, ..
            } => {
                let c = conn
                    .get_or_try_init(|| client.get_async_connection())
                    .await
                    .map_err(|e| StoreError::Connection(e.to_string()))?;
                watch.start(c.clone());
                Ok(Conn::Cluster(c.clone()))
            }
            Shards::Sentinel { conn, .. } => Ok(Conn::Sentinel(conn.clone())),
        }
    }

    /// For logs: the nodes or the cluster's seeds, without passwords.
    pub fn describe(&self) -> String {
        match self {
            Shards::Nodes { nodes, .. } if nodes.len() == 1 => nodes[0].0.clone(),
            Shards::Nodes { nodes, .. } => {
                let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
                format!("{} shards: {}", nodes.len(), names.join(", "))
            }
            Shards::Cluster { seeds, .. } => format!("a cluster (seeds {})", seeds.join(", ")),
            Shards::Sentinel { name, .. } => format!("the master of {name}"),
        }
    }
}

/// The node that wins a bucket: the highest hash of (node name, bucket). Names, not positions, decide, so
/// the order of URLs does not matter and a new node takes only the tags it now wins.
pub fn rendezvous(names: &[&str], bucket: u32) -> usize {
    let score = |name: &str| {
        let mut bytes = name.as_bytes().to_vec();
        bytes.extend_from_slice(&bucket.to_le_bytes());
        // FNV-1a's last bytes mix poorly; a final avalanche (splitmix64) spreads them.
        let mut z = fnv1a(&bytes).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..names.len()).max_by_key(|&i| score(names[i])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_node_takes_only_the_buckets_it_wins() {
        let three = ["redis://a:1", "redis://b:1", "redis://c:1"];
        let four = ["redis://a:1", "redis://b:1", "redis://c:1", "redis://d:1"];
        let tags = 4096;
        let mut per_node = [0u32; 3];
        let mut moved = 0;
        for t in 0..tags {
            let before = rendezvous(&three, t);
            let after = rendezvous(&four, t);
            per_node[before] += 1;
            if before != after {
                // A tag only ever moves to the new node.
                assert_eq!(after, 3, "tag {t} moved between old nodes");
                moved += 1;
            }
        }
        // Ideal: 1/4 of the tags move, and each of 3 nodes holds 1/3. Binomial sd ~28 and ~30 here,
        // so ±10 % of the expected count is more than 3 sigma.
        assert!((922..1126).contains(&moved), "{moved} of {tags} tags moved");
        assert!(per_node.iter().all(|n| (1228..1502).contains(n)), "{per_node:?}");
    }
}
