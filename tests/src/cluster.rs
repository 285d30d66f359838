//! Several real `redis-server`s: independent shards, or a Redis Cluster built with
//! `redis-cli --cluster create`, all on free loopback ports and killed on drop.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::RedisServer;

/// `n` independent Redis servers (client-side sharding).
pub struct Shards {
    /// The servers.
    pub servers: Vec<RedisServer>,
}

impl Shards {
    /// Starts `n` servers.
    pub fn start(n: usize) -> Self {
        Shards {
            servers: (0..n).map(|_| RedisServer::start()).collect(),
        }
    }

    /// The URLs separated by commas, as `--redis` takes them.
    pub fn urls(&self) -> String {
        let urls: Vec<String> = self.servers.iter().map(RedisServer::url).collect();
        urls.join(",")
    }
}

/// A Redis Cluster of real nodes, every slot assigned.
pub struct Cluster {
    /// The nodes.
    pub nodes: Vec<RedisServer>,
}

impl Cluster {
    /// Starts `n` cluster-enabled servers, joins them with `redis-cli --cluster create` as `n`
    /// masters, and waits until every node reports `cluster_state:ok`. `REDIS_CLI_BIN` names
    /// another redis-cli.
    pub fn start(n: usize) -> Self {
        Cluster::start_with(n, 0)
    }

    /// [`start`](Self::start) of `masters` masters with `replicas` replicas each (which nodes
    /// are which: [`masters`](Self::masters), [`replica_of`](Self::replica_of)); waits until every
    /// replica is in sync too.
    pub fn start_with(masters: usize, replicas: usize) -> Self {
        Cluster::start_with_node_timeout(masters, replicas, 15_000)
    }

    /// [`start_with`](Self::start_with) with another `cluster-node-timeout` (Redis's default is
    /// 15 s): how long a master may not answer before its replica takes over.
    pub fn start_with_node_timeout(masters: usize, replicas: usize, node_timeout_ms: u64) -> Self {
        let n = masters * (1 + replicas);
        let timeout = node_timeout_ms.to_string();
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                RedisServer::start_on(
                    cluster_port(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        &timeout,
                    ],
                )
            })
            .collect();
        let cli = std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".into());
        let addrs: Vec<String> = nodes.iter().map(|s| format!("127.0.0.1:{}", s.port())).collect();
        let out = Command::new(&cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cli} (install redis-tools or set REDIS_CLI_BIN): {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { nodes };
        // There is no event to await from outside: poll CLUSTER INFO (gossip settles within ~1 s).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = cluster.nodes.iter().all(|s| {
                let mut conn = s.conn();
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut conn)
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
            });
            let synced = cluster.nodes.iter().all(|s| {
                crate::replication_info(s, "role").as_deref() != Some("slave")
                    || crate::replication_info(s, "master_link_status").as_deref() == Some("up")
            });
            if ok && synced {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach cluster_state:ok with its replicas in sync in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Moves `slots` hash slots from node `from` to node `to` with `redis-cli --cluster reshard`
    /// (keys migrate with their slots; clients meet ASK during the move and MOVED after it).
    pub fn reshard(&self, from: usize, to: usize, slots: u32) {
        if let Err(e) = self.reshard_plain(from, to, slots) {
            panic!("{e}");
        }
    }

    /// [`reshard`](Self::reshard) as an operator runs it, with no `--cluster-replace`: a key the
    /// importing node already holds stops the move half-way ("Target key exists"), which is the
    /// `Err` (redis-cli's output), the slot left open.
    /// `from` and `to` are node indices.
    pub fn reshard_plain(&self, from: usize, to: usize, slots: u32) -> Result<(), String> {
        let id = |i: usize| -> String {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query(&mut self.nodes[i].conn())
                .expect("CLUSTER MYID")
        };
        let cli = std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".into());
        let out = Command::new(&cli)
            .arg("--cluster")
            .arg("reshard")
            .arg(format!("127.0.0.1:{}", self.nodes[from].port()))
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster reshard");
        // redis-cli exits 0 even when a MIGRATE failed and it stopped ("[ERR] Calling MIGRATE").
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() || text.contains("[ERR]") {
            let mut tail: Vec<&str> = text.lines().filter(|l| l.contains("ERR")).take(2).collect();
            if tail.is_empty() {
                tail = text.lines().rev().take(2).collect();
            }
            return Err(format!(
                "reshard of {slots} slots from node {from} to {to} failed: {}",
                tail.join(" | ")
            ));
        }
        Ok(())
    }

    /// The masters' node indices, in the order of the slots they serve (the first serves slot 0).
    pub fn masters(&self) -> Vec<usize> {
        self.masters_seen_by(0)
    }

    /// [`masters`](Self::masters) as node `node`'s slot map has them (ask a node that answers).
    pub fn masters_seen_by(&self, node: usize) -> Vec<usize> {
        let mut owners = self.slot_ranges(node);
        owners.sort();
        let mut masters: Vec<usize> = Vec::new();
        for (_, _, i) in owners {
            if !masters.contains(&i) {
                masters.push(i);
            }
        }
        masters
    }

    /// The master that serves `slot`, as node `node`'s slot map has it.
    pub fn master_of_slot(&self, node: usize, slot: i64) -> Option<usize> {
        self.slot_ranges(node)
            .into_iter()
            .find(|(from, to, _)| (*from..=*to).contains(&slot))
            .map(|(_, _, master)| master)
    }

    /// Node `node`'s `CLUSTER SLOTS`: each range's first and last slot and its master's index.
    fn slot_ranges(&self, node: usize) -> Vec<(i64, i64, usize)> {
        let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query(&mut self.nodes[node].conn())
            .expect("CLUSTER SLOTS");
        let mut owners = Vec::new();
        for range in &ranges {
            let redis::Value::Array(v) = range else { continue };
            let (
                Some(redis::Value::Int(from)),
                Some(redis::Value::Int(to)),
                Some(redis::Value::Array(master)),
            ) = (v.first(), v.get(1), v.get(2))
            else {
                continue;
            };
            let Some(redis::Value::Int(port)) = master.get(1) else {
                continue;
            };
            if let Some(i) = self.nodes.iter().position(|n| i64::from(n.port()) == *port) {
                owners.push((*from, *to, i));
            }
        }
        owners
    }

    /// A replica of node `master`, if it has one in sync.
    pub fn replica_of(&self, master: usize) -> Option<usize> {
        let port = self.nodes[master].port().to_string();
        (0..self.nodes.len()).find(|&i| {
            crate::replication_info(&self.nodes[i], "role").as_deref() == Some("slave")
                && crate::replication_info(&self.nodes[i], "master_port").as_deref() == Some(port.as_str())
                && crate::replication_info(&self.nodes[i], "master_link_status").as_deref() == Some("up")
        })
    }

    /// `CLUSTER FAILOVER` on node `replica` (a manual failover: its master stops taking writes,
    /// the replica catches up and takes over its slots), then waits until the replica's slot map
    /// names it a master. A manual failover that Redis gave up on (it has 5 s to agree with the
    /// master; a loaded machine may not make it) is asked again, then with FORCE (no agreement with
    /// the master, still the other masters' votes).
    pub fn failover(&self, replica: usize) {
        for (how, wait) in [(None, 10), (None, 10), (Some("FORCE"), 20)] {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("FAILOVER");
            if let Some(how) = how {
                cmd.arg(how);
            }
            let _: () = cmd
                .query(&mut self.nodes[replica].conn())
                .expect("CLUSTER FAILOVER");
            let deadline = Instant::now() + Duration::from_secs(wait);
            while Instant::now() < deadline {
                if self.masters_seen_by(replica).contains(&replica) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("node {replica} did not take over its master's slots in 40 s");
    }

    /// The seed URLs separated by commas, as `--redis` takes them with `--redis-cluster`.
    pub fn urls(&self) -> String {
        let urls: Vec<String> = self.nodes.iter().map(RedisServer::url).collect();
        urls.join(",")
    }
}

/// A free port whose cluster-bus port (+10,000) is free too.
fn cluster_port() -> u16 {
    loop {
        let port = crate::free_port();
        if port < 55_535 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Keys in a server (DBSIZE).
pub fn dbsize(server: &RedisServer) -> u64 {
    redis::cmd("DBSIZE").query(&mut server.conn()).expect("DBSIZE")
}

/// Calls of one command a server has run since start (INFO commandstats), e.g. `evalsha`.
pub fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.conn())
        .expect("INFO commandstats");
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}
