//! Fleet scale on real servers: three independent shards and a three-node Redis Cluster, the rejection
//! cache, and multi-item checks that stay all or nothing across shards.

use std::time::Duration;

use floodgate_core::store::Layout;
use floodgate_protocol::Item;
use floodgate_redis::shards::rendezvous;
use floodgate_sdk::{Origin, Source};
use floodgate_tests::{
    command_calls, dbsize, eventually, patient_client, redis_time_ms, sleep_until_window_offset,
    window_count, Agent, AgentBuilder, Cluster, RedisServer, Shards,
};

const RULES: &str = r#"{"rules":[
  {"id":"one","dimension":"user","limit":1,"windowSeconds":60},
  {"id":"ten","dimension":"user","limit":10,"windowSeconds":60},
  {"id":"bucket","dimension":"user","limit":10,"windowSeconds":60,"burst":3,"algorithm":"token_bucket"}
]}"#;

/// 300 keys through one agent: each is admitted once and rejected the second time (the limits hold
/// on every shard), and every server ends up holding keys.
async fn spread_and_hold(agent: &Agent, servers: &[&RedisServer]) {
    let client = patient_client(agent.socket()).await;
    for i in 0..300 {
        let key = format!("user:{i}");
        assert!(client.allow(&key, "one", 1).await.unwrap().allowed, "{key} first");
        let d = client.allow(&key, "one", 1).await.unwrap();
        assert!(!d.allowed, "{key} second");
        assert_eq!(d.origin, Origin::Agent(Source::Redis));
        let b = client.allow(&key, "bucket", 1).await.unwrap();
        assert!(b.allowed && b.remaining == 2, "{key} bucket {b:?}");
    }
    for (n, s) in servers.iter().enumerate() {
        let keys = dbsize(s);
        // 300 clients × 2 rules over 128 tags: every server holds some of both (the odds of a server
        // winning none of ~40 tags are nil).
        assert!(keys >= 10, "server {n} holds {keys} keys");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_shards_hold_limits_and_each_holds_keys() {
    let shards = Shards::start(3);
    let agent = AgentBuilder::patient(&shards.urls(), RULES).await;
    spread_and_hold(&agent, &shards.servers.iter().collect::<Vec<_>>()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_holds_limits_and_each_node_holds_keys() {
    let cluster = Cluster::start(3);
    let agent = Agent::builder()
        .redis(&cluster.urls())
        .arg("--redis-cluster")
        .rules(RULES)
        .start()
        .await;
    spread_and_hold(&agent, &cluster.nodes.iter().collect::<Vec<_>>()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_rejection_is_answered_without_redis() {
    let redis = RedisServer::start();
    let agent = AgentBuilder::patient(&redis.url(), RULES).await;
    let client = patient_client(agent.socket()).await;
    assert!(client.allow("user:abuser", "one", 1).await.unwrap().allowed);
    let first = client.allow("user:abuser", "one", 1).await.unwrap();
    assert!(!first.allowed);
    assert_eq!(first.origin, Origin::Agent(Source::Redis));
    // Every sliding-window check that reaches Redis runs one HINCRBY (the agent's heartbeat script,
    // also an EVALSHA, runs none, so HINCRBY counts checks and nothing else).
    let calls = command_calls(&redis, "hincrby");
    let mut last_retry = first.retry_after_ms.unwrap();
    for _ in 0..200 {
        let d = client.allow("user:abuser", "one", 1).await.unwrap();
        assert!(!d.allowed);
        assert_eq!(d.origin, Origin::Agent(Source::Cache));
        let retry = d.retry_after_ms.expect("a cached rejection carries retryAfter");
        assert!(
            retry <= last_retry,
            "retryAfter counts down: {retry} after {last_retry}"
        );
        last_retry = retry;
    }
    assert_eq!(
        command_calls(&redis, "hincrby"),
        calls,
        "Redis saw no check for the key while its rejection was cached"
    );
    // Another key still goes to Redis.
    let other = client.allow("user:fine", "one", 1).await.unwrap();
    assert_eq!(other.origin, Origin::Agent(Source::Redis));
    assert_eq!(command_calls(&redis, "hincrby"), calls + 1);
}

/// Two keys whose counters live on different shards of these three servers.
fn keys_on_two_shards(shards: &Shards) -> (String, String, usize, usize) {
    let layout = Layout::default();
    let urls: Vec<String> = shards.servers.iter().map(RedisServer::url).collect();
    let names: Vec<&str> = urls.iter().map(String::as_str).collect();
    let shard = |k: &str| rendezvous(&names, layout.bucket(k));
    let a = "user:a".to_string();
    let b = (0..)
        .map(|i| format!("user:b{i}"))
        .find(|k| shard(k) != shard(&a))
        .unwrap();
    let (sa, sb) = (shard(&a), shard(&b));
    (a, b, sa, sb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_item_check_rejected_by_one_item_leaves_the_others_unchanged() {
    let shards = Shards::start(3);
    let agent = AgentBuilder::patient(&shards.urls(), RULES).await;
    let client = patient_client(agent.socket()).await;
    let (a, b, sa, sb) = keys_on_two_shards(&shards);
    // Counts are read in the current 60 s window: keep the run (~1 s) inside one.
    let mut conn = shards.servers[0].conn();
    if redis_time_ms(&mut conn) % 60_000 > 55_000 {
        sleep_until_window_offset(&mut conn, 60_000, 0);
    }

    // Same client, two rules: one script call on one shard, checked first and committed only if
    // both pass. "one" is spent, so "ten" must not move.
    assert!(client.allow(&a, "one", 1).await.unwrap().allowed);
    assert!(client.allow(&a, "ten", 1).await.unwrap().allowed);
    let d = client
        .check(vec![Item::new(&a, "ten", 1), Item::new(&a, "one", 1)])
        .await
        .unwrap();
    assert!(!d.allowed);
    let mut conn = shards.servers[sa].conn();
    assert_eq!(
        window_count(&mut conn, "ten", &a, 60_000).0,
        1,
        "same shard: nothing taken"
    );

    // Two clients on two shards: the first shard commits, the second rejects, and the first's
    // units are taken back (off the request path, so the test waits for it).
    assert!(client.allow(&b, "one", 1).await.unwrap().allowed);
    let d = client
        .check(vec![Item::new(&a, "ten", 2), Item::new(&b, "one", 1)])
        .await
        .unwrap();
    assert!(!d.allowed);
    assert!(
        !d.items[1].verdict.allowed,
        "the second item is the one that rejected"
    );
    eventually("the take-back lands", Duration::from_secs(5), || {
        let (mut conn, a) = (shards.servers[sa].conn(), a.clone());
        async move { (window_count(&mut conn, "ten", &a, 60_000).0 == 1).then_some(()) }
    })
    .await;
    let mut conn_b = shards.servers[sb].conn();
    assert_eq!(window_count(&mut conn_b, "one", &b, 60_000).0, 1);
    // The whole check's figures are the binding item's: the rejection.
    assert!(d.retry_after_ms.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_follow_their_slots_when_the_cluster_reshards() {
    const FIVE: &str = r#"{"rules":[{"id":"five","dimension":"user","limit":5,"windowSeconds":60},
        {"id":"many","dimension":"user","limit":1000000,"windowSeconds":60}]}"#;
    let cluster = Cluster::start(3);
    // A check on a slot whose keys are partly moved is retried (TRYAGAIN) until they are all on
    // one node: a patient store timeout, so that a busy machine's retries never reach the fallback.
    let agent = Agent::builder()
        .redis(&cluster.urls())
        .arg("--redis-cluster")
        .arg("--redis-timeout-ms")
        .arg("2000")
        .rules(FIVE)
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    // Counts are per 60 s window: keep the run (a few seconds) inside one.
    let mut conn = cluster.nodes[0].conn();
    if redis_time_ms(&mut conn) % 60_000 > 45_000 {
        sleep_until_window_offset(&mut conn, 60_000, 0);
    }
    let keys: Vec<String> = (0..100).map(|i| format!("user:r{i}")).collect();
    for k in &keys {
        for _ in 0..3 {
            assert!(client.allow(k, "five", 1).await.unwrap().allowed);
        }
    }
    // Load on other keys while a third of the slots moves: the agent meets ASK and MOVED.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let mut answered = 0u64;
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let d = client
                    .allow(&format!("user:l{}", i % 500), "many", 1)
                    .await
                    .unwrap();
                assert_eq!(
                    d.origin,
                    Origin::Agent(Source::Redis),
                    "answered by Redis during the move: {d:?}"
                );
                answered += 1;
                i += 1;
            }
            answered
        })
    };
    // Every slot of node 0 goes to node 1 (redis-cli runs on this worker; the load on the other).
    tokio::task::block_in_place(|| cluster.reshard(0, 1, 5461));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered = load.await.unwrap();
    assert!(answered > 0);
    assert_eq!(dbsize(&cluster.nodes[0]), 0, "node 0 gave all its keys away");
    // The counts moved with their slots: two more checks each, then the limit.
    for k in &keys {
        for n in 4..=6 {
            let d = client.allow(k, "five", 1).await.unwrap();
            assert_eq!(d.allowed, n <= 5, "{k} check {n}: {d:?}");
        }
    }
    // Node 0, emptied, turns replica of node 1: no failover (its keys would count twice).
    assert!(
        !agent.log().contains("replica took over"),
        "a reshard read as a failover:\n{}",
        agent.log()
    );
}
