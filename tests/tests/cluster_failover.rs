//! A Redis Cluster failover: the agent notices a replica taking over its master's slots (from the
//! slot map) and writes what it admitted lately for keys on those slots, and only those, into the
//! new master (docs/accuracy.md, "Cluster failover").

use std::time::Duration;

use floodgate_core::rules::RuleSet;
use floodgate_core::store::Layout;
use floodgate_tests::{eventually, patient_client, redis_time_ms, sleep_until_window_offset, Agent, Cluster};

const RULES: &str = r#"{"rules":[{"id":"twenty","dimension":"user","limit":20,"windowSeconds":60}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_writes_the_recent_admissions_of_its_slots_again() {
    let cluster = Cluster::start_with(3, 1);
    // A patient store timeout: every check is answered by Redis (none by the fallback), so each
    // key's count is exactly what this test admitted.
    let agent = Agent::builder()
        .redis(&cluster.urls())
        .arg("--redis-cluster")
        .arg("--redis-timeout-ms")
        .arg("2000")
        .rules(RULES)
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let mut conn = cluster.nodes[0].conn();
    // One 60 s window holds the whole test (the failover takes a second or so).
    if redis_time_ms(&mut conn) % 60_000 > 35_000 {
        sleep_until_window_offset(&mut conn, 60_000, 0);
    }
    // Which keys live on the slots of the master that fails over.
    let failing = cluster.masters()[0];
    let rules = RuleSet::parse(RULES).unwrap();
    let rule = rules.get("twenty").unwrap();
    let layout = Layout::default();
    let keys: Vec<String> = (0..30).map(|i| format!("user:f{i}")).collect();
    let moved: Vec<bool> = keys
        .iter()
        .map(|k| {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(layout.state_key(rule, k))
                .query(&mut conn)
                .expect("CLUSTER KEYSLOT");
            cluster.master_of_slot(0, slot) == Some(failing)
        })
        .collect();
    let on_failing = moved.iter().filter(|m| **m).count();
    assert!(
        (1..keys.len()).contains(&on_failing),
        "30 keys over 3 masters, some on the failing one: {on_failing}"
    );
    for k in &keys {
        for _ in 0..10 {
            assert!(client.allow(k, "twenty", 1).await.unwrap().allowed);
        }
    }
    let replica = cluster
        .replica_of(failing)
        .expect("the master has a replica in sync");
    tokio::task::block_in_place(|| cluster.failover(replica));
    // The agent's watch sees the new slot map and writes the recent admissions on its slots again.
    eventually(
        "the agent wrote its recent admissions into the new master",
        Duration::from_secs(15),
        || {
            let log = agent.log();
            async move {
                log.contains("wrote this agent's recent admissions into the new primary")
                    .then_some(())
            }
        },
    )
    .await;
    // A manual failover loses nothing, so the moved keys now count their 10 twice (stricter, never
    // looser: docs/accuracy.md) and admit nothing more; the others admit their last 10.
    for (k, moved) in keys.iter().zip(&moved) {
        let mut admitted = 0;
        for _ in 0..12 {
            admitted += u64::from(client.allow(k, "twenty", 1).await.unwrap().allowed);
        }
        let want = if *moved { 0 } else { 10 };
        assert_eq!(admitted, want, "{k} (on the failed-over slots: {moved})");
    }
    assert!(
        agent
            .log()
            .contains("a Redis Cluster replica took over its master's slots"),
        "the watch said so"
    );
}
