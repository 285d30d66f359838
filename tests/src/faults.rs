//! A seeded fault runner over real processes (issue 33 item 3): its own `redis-server` behind a
//! latency proxy, several agents each writing a decision ledger, an open-loop load over many keys
//! of a sliding-window and a token-bucket rule offered about twice their limits, and a schedule of
//! faults drawn from the seed: Redis killed and restarted empty, Redis paused (slow, data kept),
//! latency past the store timeout, an agent killed and cold-started. The run ends with the checker
//! (`floodgate_core::ledger::judge`) over every ledger, told of the faults whose loss the contract
//! states (docs/accuracy.md). The same seed draws the same schedule, so a failing seed reruns.
//!
//! Deployments: one `redis-server` (faults: Redis killed, paused, slowed; an agent killed), or a
//! master, its replica and a sentinel (faults: `SENTINEL FAILOVER`; an agent killed), or a Redis
//! Cluster of three masters with a replica each (faults: a reshard under load with plain
//! `redis-cli --cluster reshard`; `CLUSTER FAILOVER` on a replica; a master paused past the node
//! timeout, an unplanned failover; an agent killed). Not covered yet: clock skew.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate_core::ledger::{judge, FaultKind, FaultSpan, Judgement, LedgerFile, Options};
use floodgate_sdk::Origin;

use crate::{
    eventually, patient_client, pause_process, replica_and_sentinel, replication_info, resume_process, Agent,
    Cluster, Proxy, RedisServer,
};

/// Where the agents' counters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deployment {
    /// One `redis-server`, behind a latency proxy.
    Single,
    /// A master, its replica and a sentinel; agents on `redis+sentinel://`.
    Sentinel,
    /// A Redis Cluster of three masters with a replica each; agents with `--redis-cluster`, their
    /// rejection caches and hot-key promotion off, so every check on a moving slot reaches it.
    Cluster,
}

/// Slots each master of the Cluster deployment starts with (`redis-cli --cluster create`'s split).
const CLUSTER_SLOTS: [u64; 3] = [5_461, 5_462, 5_461];

/// The rules of a run: a sync sliding window, a token bucket, a concurrency rule and a daily
/// calendar quota (a run's keys pass its limit within seconds, then it refuses them until UTC
/// midnight), all fail open (the default).
pub const RULES: &str = r#"{"rules":[
  {"id":"sw","dimension":"user","limit":20,"windowSeconds":2},
  {"id":"tb","dimension":"user","limit":20,"windowSeconds":2,"algorithm":"token_bucket","burst":10},
  {"id":"conc","dimension":"user","limit":2,"algorithm":"concurrency","leaseSeconds":2},
  {"id":"quota","dimension":"user","limit":40,"algorithm":"quota","period":"day"}
]}"#;

/// What a run does.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The seed the schedule and the load's keys are drawn from.
    pub seed: u64,
    /// How long the load runs.
    pub seconds: u64,
    /// Agents (each with its own SDK client).
    pub agents: usize,
    /// Checks per second offered, over all agents (open loop).
    pub rate: u64,
    /// Client keys per rule.
    pub keys: u64,
    /// Where the counters live.
    pub deployment: Deployment,
}

impl Plan {
    /// The default run of a seed: 12 s, 2 agents, 1,000 checks/s over 25 keys of each rule (2x
    /// their limits of 20 per 2 s).
    pub fn seed(seed: u64) -> Self {
        Plan {
            seed,
            seconds: 12,
            agents: 2,
            rate: 1_000,
            keys: 25,
            deployment: Deployment::Single,
        }
    }
}

/// A fault of the schedule: when (`at_ms` from the load's start) and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // the fields are the doc above: a start and a length, in ms
pub enum Fault {
    /// `kill -9` of Redis, restarted empty on the same port after `down_ms`.
    RedisKilled { at_ms: u64, down_ms: u64 },
    /// SIGSTOP of Redis for `for_ms`, then SIGCONT: slow, data kept.
    RedisPaused { at_ms: u64, for_ms: u64 },
    /// Replies from Redis delayed by `delay_ms` (past the store timeout) for `for_ms`.
    RedisSlow { at_ms: u64, for_ms: u64, delay_ms: u64 },
    /// `kill -9` of agent `agent`, started again (cold) after `down_ms` on the same socket.
    AgentKilled { at_ms: u64, agent: usize, down_ms: u64 },
    /// `SENTINEL FAILOVER`: the replica promoted while the old master still runs, then demoted.
    SentinelFailover { at_ms: u64 },
    /// `redis-cli --cluster reshard` of `slots` slots from master `from` to master `to` (masters
    /// by the slots they started with: 0 serves slot 0), without `--cluster-replace`, under the load.
    Reshard {
        at_ms: u64,
        from: usize,
        to: usize,
        slots: u64,
    },
    /// `CLUSTER FAILOVER` on the replica of master `master` (numbered as for `Reshard`).
    ClusterFailover { at_ms: u64, master: usize },
    /// SIGSTOP of master `master` for `for_ms`, past the Cluster's node timeout (2 s here): its
    /// replica takes over unasked, then the old master wakes up to find itself demoted.
    ClusterMasterPaused { at_ms: u64, master: usize, for_ms: u64 },
}

impl Fault {
    fn at_ms(&self) -> u64 {
        match *self {
            Fault::RedisKilled { at_ms, .. }
            | Fault::RedisPaused { at_ms, .. }
            | Fault::RedisSlow { at_ms, .. }
            | Fault::AgentKilled { at_ms, .. }
            | Fault::SentinelFailover { at_ms }
            | Fault::Reshard { at_ms, .. }
            | Fault::ClusterFailover { at_ms, .. }
            | Fault::ClusterMasterPaused { at_ms, .. } => at_ms,
        }
    }

    fn lasts_ms(&self) -> u64 {
        match *self {
            Fault::RedisKilled { down_ms, .. } | Fault::AgentKilled { down_ms, .. } => down_ms,
            Fault::RedisPaused { for_ms, .. }
            | Fault::RedisSlow { for_ms, .. }
            | Fault::ClusterMasterPaused { for_ms, .. } => for_ms,
            // Until the sentinel names the new master, measured; this much is planned for it.
            Fault::SentinelFailover { .. } | Fault::ClusterFailover { .. } => 1_500,
            // redis-cli moves ~1,000 slots a second here; the runner waits for it to end.
            Fault::Reshard { slots, .. } => slots,
        }
    }
}

/// What a run found.
#[derive(Debug)]
pub struct Report {
    /// The plan run.
    pub plan: Plan,
    /// The faults injected, in order.
    pub schedule: Vec<Fault>,
    /// Checks sent, and answered by the agents (by source) or by the SDK's fail policy.
    pub sent: u64,
    /// Answers the agents decided.
    pub by_agent: u64,
    /// Answers of the SDK's fail policy (its agent was away: given up by the contract).
    pub by_sdk: u64,
    /// The checker's verdict over every ledger of the run.
    pub judgement: Judgement,
    /// What went wrong outside the ledgers: a reshard that stopped half-way, with redis-cli's words.
    pub troubles: Vec<String>,
}

impl Report {
    /// One paragraph for a terminal.
    pub fn text(&self) -> String {
        let mut out = format!(
            "seed {} ({:?}): {} s, {} agents, {} checks/s over {} keys a rule\nschedule: {:?}\nsent {}, answered by the agents {}, by the SDK's fail policy {}\n",
            self.plan.seed,
            self.plan.deployment,
            self.plan.seconds,
            self.plan.agents,
            self.plan.rate,
            self.plan.keys,
            self.schedule,
            self.sent,
            self.by_agent,
            self.by_sdk
        );
        let j = &self.judgement;
        out += &format!(
            "ledgers: {} (not closed: {}), {} records, {} dropped\n",
            j.agents,
            j.unclosed.len(),
            j.records,
            j.dropped
        );
        for t in &self.troubles {
            out += &format!("trouble: {t}\n");
        }
        for r in &j.rules {
            out += &format!(
                "rule {}: {} key-windows, {} units admitted, worst {:.2}x its limit, {} past their bound\n",
                r.rule, r.key_windows, r.admitted, r.worst_ratio, r.breaches
            );
        }
        for b in j.breaches.iter().take(10) {
            out += &format!(
                "breach: rule {} key {} window from {} ms: {} admitted (+{} maybe) > bound {} ({})\n",
                b.rule,
                b.key,
                b.window_start_ms,
                b.admitted,
                b.maybe,
                b.bound,
                b.sources.join(", ")
            );
        }
        out
    }
}

/// splitmix64: the schedule's and the load's numbers, the same for the same seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo).max(1)
    }
}

/// An agent drawn from the seed, killed at `at_ms` and started again `down_ms` later.
fn agent_killed(rng: &mut Rng, plan: &Plan, at_ms: u64, down_ms: u64) -> Fault {
    Fault::AgentKilled {
        at_ms,
        agent: rng.range(0, plan.agents as u64) as usize,
        down_ms,
    }
}

/// The seed's schedule: one to three faults, one after another, from 2 s into the load until 3 s
/// before its end.
pub fn schedule(plan: &Plan) -> Vec<Fault> {
    let mut rng = Rng(plan.seed);
    let end = plan.seconds.saturating_sub(3) * 1_000;
    let mut at = 2_000;
    let mut faults = Vec::new();
    let mut slots = CLUSTER_SLOTS;
    for _ in 0..rng.range(1, 4) {
        if at + 500 >= end {
            break;
        }
        let lasts = rng.range(300, 1_500).min(end - at);
        if plan.deployment == Deployment::Cluster {
            // A reshard first; then a reshard, a failover, a master paused past the node timeout
            // or an agent killed. A reshard takes a third to all of its source's slots, so every
            // hash tag of the load may move.
            let pick = if faults.is_empty() { 0 } else { rng.range(0, 4) };
            let fault = if pick == 0 {
                let from = rng.range(0, 3) as usize;
                let to = (from + 1 + rng.range(0, 2) as usize) % 3;
                let have = slots[from];
                let moved = rng.range(have / 3, have + 1).max(1);
                slots[from] -= moved;
                slots[to] += moved;
                Fault::Reshard {
                    at_ms: at,
                    from,
                    to,
                    slots: moved,
                }
            } else if pick == 1 {
                Fault::ClusterFailover {
                    at_ms: at,
                    master: rng.range(0, 3) as usize,
                }
            } else if pick == 2 {
                Fault::ClusterMasterPaused {
                    at_ms: at,
                    master: rng.range(0, 3) as usize,
                    for_ms: rng.range(4_000, 6_000),
                }
            } else {
                agent_killed(&mut rng, plan, at, lasts)
            };
            at += fault.lasts_ms() + rng.range(1_000, 3_000);
            faults.push(fault);
            continue;
        }
        if plan.deployment == Deployment::Sentinel {
            // A failover first; then a failover or an agent killed.
            let fault = if faults.is_empty() || rng.next().is_multiple_of(2) {
                Fault::SentinelFailover { at_ms: at }
            } else {
                agent_killed(&mut rng, plan, at, lasts)
            };
            at += fault.lasts_ms() + rng.range(1_000, 3_000);
            faults.push(fault);
            continue;
        }
        let fault = match rng.range(0, 4) {
            0 => Fault::RedisKilled {
                at_ms: at,
                down_ms: lasts,
            },
            1 => Fault::RedisPaused {
                at_ms: at,
                for_ms: lasts,
            },
            2 => Fault::RedisSlow {
                at_ms: at,
                for_ms: lasts,
                delay_ms: rng.range(60, 200),
            },
            _ => agent_killed(&mut rng, plan, at, lasts),
        };
        faults.push(fault);
        at += lasts + rng.range(500, 2_000);
    }
    faults
}

/// A client key whose slot the schedule's first reshard moves (redis-cli moves a master's lowest
/// slots first; the Cluster starts with node i on the i-th third), so that checks meet the move.
fn hot_key(cluster: &Cluster, faults: &[Fault]) -> Option<String> {
    let Fault::Reshard { from, slots, .. } = faults.iter().find(|f| matches!(f, Fault::Reshard { .. }))?
    else {
        return None;
    };
    let first: u64 = CLUSTER_SLOTS[..*from].iter().sum();
    let layout = floodgate_core::store::Layout::default();
    let mut conn = cluster.nodes[0].conn();
    (0..10_000).map(|i| format!("user:hot{i}")).find(|key| {
        let slot: u64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("{{{}}}", layout.tag(key)))
            .query(&mut conn)
            .expect("CLUSTER KEYSLOT");
        (first..first + slots).contains(&slot)
    })
}

/// Other clients' counters on the hot key's slot, as a fleet's slot gets them: a new key of its
/// hash tag every millisecond until `stop`. redis-cli migrates a slot's newest keys first, so a
/// move meets these before the hot key's window hashes and takes ~0.1 s, not two round trips.
async fn fill_hot_slot(cluster: &Cluster, hot: &str, stop: Arc<AtomicBool>) {
    let tag = floodgate_core::store::Layout::default().tag(hot);
    let client =
        redis::cluster::ClusterClient::new(cluster.nodes.iter().map(RedisServer::url).collect::<Vec<_>>())
            .expect("a cluster client");
    let Ok(mut conn) = client.get_async_connection().await else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        i += 1;
        let _: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("fg:{{{tag}}}:other/k/{i}"))
            .arg(1)
            .arg("EX")
            .arg(60)
            .query_async(&mut conn)
            .await;
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One agent slot: its socket stays, its process and ledger change with each start.
struct Slot {
    socket: PathBuf,
    agent: Option<Agent>,
    starts: usize,
}

async fn start_agent(dir: &Path, index: usize, slot: &mut Slot, redis_url: &str, cluster: bool) {
    let ledger = dir.join(format!("agent-{index}-{}.jsonl", slot.starts));
    slot.starts += 1;
    let mut builder = Agent::builder();
    if cluster {
        for a in ["--redis-cluster", "--rejection-cache", "0", "--hot-key-rate", "0"] {
            builder = builder.arg(a);
        }
    }
    let agent = builder
        .redis(redis_url)
        .rules(RULES)
        .socket(&slot.socket)
        .arg("--ledger")
        .arg(ledger.to_str().expect("a UTF-8 temp path"))
        // A store timeout a loaded 2-core machine meets, a short cool-down and fast heartbeats:
        // the faults' phases fit in seconds.
        .arg("--redis-timeout-ms")
        .arg("50")
        .arg("--breaker-cooldown-ms")
        .arg("300")
        .arg("--heartbeat-ms")
        .arg("100")
        .start()
        .await;
    slot.agent = Some(agent);
}

/// Runs a plan: starts everything, offers the load, injects the seed's faults, stops, judges.
pub async fn run(plan: Plan) -> Report {
    let faults = schedule(&plan);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    // Sentinel: `redis` is the first master; its replica and the sentinel watching them. Cluster:
    // three masters of their own (`redis` stays idle).
    let (url, _replica, sentinel, cluster) = match plan.deployment {
        Deployment::Single => (proxy.url(), None, None, None),
        Deployment::Sentinel => {
            let (r, s) = replica_and_sentinel(&redis).await;
            let url = format!("redis+sentinel://127.0.0.1:{}/mymaster", s.port());
            (url, Some(r), Some(s), None)
        }
        Deployment::Cluster => {
            let c = tokio::task::spawn_blocking(|| Cluster::start_with_node_timeout(3, 1, 2_000))
                .await
                .expect("cluster start");
            (c.urls(), None, None, Some(Arc::new(c)))
        }
    };
    // The Cluster's masters by the slots they started with (a failover puts its replica there).
    let mut masters = cluster.as_ref().map(|c| c.masters()).unwrap_or_default();
    let on_cluster = cluster.is_some();
    let hot = cluster.as_deref().and_then(|c| hot_key(c, &faults));
    let mut troubles = Vec::new();
    let mut slots: Vec<Slot> = (0..plan.agents)
        .map(|i| Slot {
            socket: dir.path().join(format!("agent-{i}.sock")),
            agent: None,
            starts: 0,
        })
        .collect();
    for (i, slot) in slots.iter_mut().enumerate() {
        start_agent(dir.path(), i, slot, &url, on_cluster).await;
    }
    let mut clients = Vec::new();
    for slot in &slots {
        clients.push(patient_client(&slot.socket).await);
    }

    // The open-loop load: every millisecond, rate / 1000 checks, each its own task; keys and rules
    // drawn from the seed (a second stream of it).
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, by_agent, by_sdk) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let load = {
        let (stop, sent, by_agent, by_sdk) = (stop.clone(), sent.clone(), by_agent.clone(), by_sdk.clone());
        let clients = clients.clone();
        let plan = plan.clone();
        let hot = hot.clone();
        tokio::spawn(async move {
            let mut rng = Rng(plan.seed ^ 0x5EED);
            let per_tick = (plan.rate / 1_000).max(1);
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tasks = tokio::task::JoinSet::new();
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for _ in 0..per_tick {
                    let client = clients[rng.range(0, clients.len() as u64) as usize].clone();
                    // A quarter of the checks on the Cluster go to a key on the first reshard's slots.
                    let key = match &hot {
                        Some(hot) if rng.next().is_multiple_of(4) => hot.clone(),
                        _ => format!("user:{}", rng.range(0, plan.keys)),
                    };
                    let (by_agent, by_sdk) = (by_agent.clone(), by_sdk.clone());
                    sent.fetch_add(1, Ordering::Relaxed);
                    // A tenth are acquires of the concurrency rule, each lease released after up to
                    // 1.5 s (its 2 s lease time runs out if its agent is killed first).
                    if rng.next().is_multiple_of(10) {
                        let key = format!("user:{}", rng.range(0, plan.keys));
                        let hold = Duration::from_millis(rng.range(0, 1_500));
                        let sent = sent.clone();
                        tasks.spawn(async move {
                            let count = |d: &floodgate_sdk::Decision| match d.origin {
                                Origin::Agent(_) => by_agent.fetch_add(1, Ordering::Relaxed),
                                _ => by_sdk.fetch_add(1, Ordering::Relaxed),
                            };
                            let Ok((d, lease)) = client.acquire(&key, "conc", 1).await else {
                                return;
                            };
                            count(&d);
                            if let Some(lease) = lease {
                                tokio::time::sleep(hold).await;
                                // The release is a check of its own (and a ledger record).
                                sent.fetch_add(1, Ordering::Relaxed);
                                if let Ok(d) = client.release(&lease).await {
                                    count(&d);
                                }
                            }
                        });
                        continue;
                    }
                    // Of the rest, a tenth check the quota, the others the window or the bucket.
                    let rule = match rng.next() % 10 {
                        0 => "quota",
                        r if r % 2 == 0 => "sw",
                        _ => "tb",
                    };
                    tasks.spawn(async move {
                        if let Ok(d) = client.allow(&key, rule, 1).await {
                            match d.origin {
                                Origin::Agent(_) => by_agent.fetch_add(1, Ordering::Relaxed),
                                _ => by_sdk.fetch_add(1, Ordering::Relaxed),
                            };
                        }
                    });
                }
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    };

    let filler = match (&cluster, &hot) {
        (Some(c), Some(hot)) => {
            let (c, hot, stop) = (c.clone(), hot.clone(), stop.clone());
            Some(tokio::spawn(async move { fill_hot_slot(&c, &hot, stop).await }))
        }
        _ => None,
    };

    // The schedule, in order, on the wall clock from the load's start.
    let started = Instant::now();
    let mut spans = Vec::new();
    for fault in &faults {
        let at = started + Duration::from_millis(fault.at_ms());
        tokio::time::sleep_until(at.into()).await;
        let lasts = Duration::from_millis(fault.lasts_ms());
        match *fault {
            Fault::RedisKilled { .. } => {
                let from_ms = unix_ms();
                redis.kill();
                tokio::time::sleep(lasts).await;
                redis.restart();
                spans.push(FaultSpan {
                    kind: FaultKind::RestartEmpty,
                    from_ms,
                    to_ms: unix_ms(),
                });
            }
            Fault::RedisPaused { .. } => {
                let pid = redis.pid().expect("redis runs");
                pause_process(pid);
                tokio::time::sleep(lasts).await;
                resume_process(pid);
            }
            Fault::RedisSlow { delay_ms, .. } => {
                proxy.set_delay(Duration::from_millis(delay_ms));
                tokio::time::sleep(lasts).await;
                proxy.set_delay(Duration::ZERO);
            }
            Fault::AgentKilled { agent, .. } => {
                if let Some(mut a) = slots[agent].agent.take() {
                    a.kill();
                    if std::env::var_os("FLOODGATE_FAULTS_LOGS").is_some() {
                        for line in a
                            .log()
                            .lines()
                            .filter(|l| l.contains("WARN") || l.contains("sentinel"))
                        {
                            eprintln!("agent {agent} (killed): {line}");
                        }
                    }
                }
                tokio::time::sleep(lasts).await;
                start_agent(dir.path(), agent, &mut slots[agent], &url, on_cluster).await;
            }
            Fault::SentinelFailover { .. } => {
                let s = sentinel.as_ref().expect("a sentinel deployment");
                let before = s.master_port();
                if std::env::var_os("FLOODGATE_FAULTS_LOGS").is_some() {
                    for node in std::iter::once(&redis).chain(_replica.as_ref()) {
                        let info = |f| replication_info(node, f).unwrap_or_default();
                        eprintln!(
                            "{} ms: node {}: role {}, link {}, offset {}",
                            unix_ms(),
                            node.port(),
                            info("role"),
                            info("master_link_status"),
                            info("master_repl_offset")
                        );
                    }
                }
                let from_ms = unix_ms();
                let _: redis::RedisResult<String> = s.cmd(&["SENTINEL", "FAILOVER", "mymaster"]);
                if std::env::var_os("FLOODGATE_FAULTS_LOGS").is_some() {
                    eprintln!("{} ms: SENTINEL FAILOVER sent", unix_ms());
                }
                eventually(
                    "the sentinel names the new master",
                    Duration::from_secs(30),
                    || async { (s.master_port().is_some() && s.master_port() != before).then_some(()) },
                )
                .await;
                if std::env::var_os("FLOODGATE_FAULTS_LOGS").is_some() {
                    eprintln!("{} ms: the sentinel names the new master", unix_ms());
                }
                spans.push(FaultSpan {
                    kind: FaultKind::Failover,
                    from_ms,
                    to_ms: unix_ms(),
                });
            }
            Fault::Reshard { from, to, slots, .. } => {
                let c = cluster.clone().expect("a cluster deployment");
                let (from, to) = (masters[from], masters[to]);
                let moved = tokio::task::spawn_blocking(move || c.reshard_plain(from, to, slots as u32))
                    .await
                    .expect("the reshard's thread");
                if let Err(e) = moved {
                    troubles.push(e);
                }
            }
            Fault::ClusterMasterPaused { master, .. } => {
                let c = cluster.clone().expect("a cluster deployment");
                let old = masters[master];
                let replica = {
                    let c = c.clone();
                    tokio::task::spawn_blocking(move || c.replica_of(old))
                        .await
                        .expect("the replica's lookup")
                };
                let Some(replica) = replica else {
                    troubles.push(format!("master {master} (node {old}) has no replica in sync"));
                    continue;
                };
                let pid = c.nodes[old].pid().expect("the master runs");
                let from_ms = unix_ms();
                pause_process(pid);
                // The replica takes over once the others have marked the master failed (the node
                // timeout) and voted: polled from the replica, which answers throughout.
                let until = Instant::now() + lasts;
                let mut promoted = false;
                while Instant::now() < until {
                    let c = c.clone();
                    promoted =
                        tokio::task::spawn_blocking(move || c.masters_seen_by(replica).contains(&replica))
                            .await
                            .expect("the slot map's read");
                    if promoted {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                tokio::time::sleep_until(until.into()).await;
                resume_process(pid);
                if promoted {
                    masters[master] = replica;
                } else {
                    troubles.push(format!(
                        "master {master} paused {} ms: its replica did not take over",
                        lasts.as_millis()
                    ));
                }
                spans.push(FaultSpan {
                    kind: FaultKind::Failover,
                    from_ms,
                    to_ms: unix_ms(),
                });
            }
            Fault::ClusterFailover { master, .. } => {
                let c = cluster.clone().expect("a cluster deployment");
                let old = masters[master];
                let from_ms = unix_ms();
                let promoted = tokio::task::spawn_blocking(move || {
                    let replica = c.replica_of(old)?;
                    c.failover(replica);
                    Some(replica)
                })
                .await
                .expect("the failover's thread");
                match promoted {
                    Some(replica) => masters[master] = replica,
                    None => troubles.push(format!("master {master} (node {old}) has no replica in sync")),
                }
                spans.push(FaultSpan {
                    kind: FaultKind::Failover,
                    from_ms,
                    to_ms: unix_ms(),
                });
            }
        }
    }
    tokio::time::sleep_until((started + Duration::from_secs(plan.seconds)).into()).await;
    stop.store(true, Ordering::Relaxed);
    let _ = load.await;
    if let Some(filler) = filler {
        let _ = filler.await;
    }
    for slot in &mut slots {
        if let Some(agent) = slot.agent.as_mut() {
            agent.terminate_within(Duration::from_secs(10)).await;
            // FLOODGATE_FAULTS_LOGS=1 prints each agent's warnings: what it saw of the faults.
            if std::env::var_os("FLOODGATE_FAULTS_LOGS").is_some() {
                for line in agent
                    .log()
                    .lines()
                    .filter(|l| l.contains("WARN") || l.contains("sentinel"))
                {
                    eprintln!("agent {}: {line}", slot.socket.display());
                }
            }
        }
    }

    let mut ledgers = Vec::new();
    let dir_path = dir.path().to_path_buf();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir_path)
        .expect("the run's dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    paths.sort();
    for path in paths {
        let text = std::fs::read_to_string(&path).expect("a ledger");
        ledgers.push(LedgerFile::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    }
    if std::env::var_os("FLOODGATE_FAULTS_LOGS").is_some() {
        let kept = dir.keep();
        eprintln!("ledgers kept in {}", kept.display());
    }
    let options = Options {
        faults: spans,
        ..Options::contract()
    };
    Report {
        judgement: judge(&ledgers, &options),
        plan,
        schedule: faults,
        sent: sent.load(Ordering::Relaxed),
        by_agent: by_agent.load(Ordering::Relaxed),
        by_sdk: by_sdk.load(Ordering::Relaxed),
        troubles,
    }
}
