//! Redis losing its script cache (SCRIPT FLUSH, then a full restart) mid-test: no check fails; the
//! script is reloaded transparently and answers come from Redis again.

use std::time::{Duration, Instant};

use floodgate_sdk::{Origin, Source};
use floodgate_tests::{eventually, patient_client, window_count, Agent, RedisServer};

const RULES: &str = r#"{"rules":[{"id":"r","dimension":"user","limit":1000000,"windowSeconds":60}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_script_cache_is_reloaded_without_a_failed_check() {
    let mut redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;

    let d = client.allow("user:1", "r", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Redis));

    // 1. The cache emptied under a live connection: the next EVALSHA gets NOSCRIPT and is retried.
    let mut conn = redis.conn();
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
    // Count only what happens from here: the first check above already loaded the script once.
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut conn).unwrap();
    for _ in 0..10 {
        let d = client.allow("user:1", "r", 1).await.unwrap();
        assert_eq!(
            d.origin,
            Origin::Agent(Source::Redis),
            "answered by Redis after the flush, not by the fail mode"
        );
        assert!(d.allowed);
    }
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn).unwrap();
    assert!(
        info.contains("cmdstat_script|load") || info.contains("cmdstat_script:"),
        "the script was reloaded: {info}"
    );

    // 2. A restart: the server is gone for a moment, then back empty on the same port. Every check
    // still gets an answer (fail open while it is away), none waits past its timeout, and answers
    // come from Redis again without operator action.
    redis.kill();
    let started = Instant::now();
    let during = client.allow("user:1", "r", 1).await.unwrap();
    assert!(during.allowed, "fail open while Redis is away: {during:?}");
    assert_eq!(during.origin, Origin::Agent(Source::Fallback));
    assert!(started.elapsed() < Duration::from_secs(2));
    redis.restart();
    eventually(
        "answers come from Redis again after the restart",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            async move {
                let d = client.allow("user:1", "r", 1).await.unwrap();
                (d.origin == Origin::Agent(Source::Redis)).then_some(())
            }
        },
    )
    .await;
    let mut conn = redis.conn();
    let (c, _) = window_count(&mut conn, "r", "user:1", 60_000);
    assert!(c >= 1, "counting resumed in the new server");
}
