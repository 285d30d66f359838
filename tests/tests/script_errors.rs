//! When Redis refuses one client's item (its key holds another type, so the script fails on it):
//! the check is answered by its rule's fail mode, the shard's breaker stays closed for every other
//! check, and a write-back entry Redis refuses is dropped without holding back the others.

use std::time::Duration;

use floodgate_core::rules::RuleSet;
use floodgate_core::store::Layout;
use floodgate_sdk::{Origin, Source};
use floodgate_tests::{agent_status, eventually, http_get, patient_client, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"tb","dimension":"user","limit":1000,"windowSeconds":3600,"algorithm":"token_bucket"},
  {"id":"tbc","dimension":"ip","limit":1000,"windowSeconds":3600,"algorithm":"token_bucket","failMode":"closed"}
]}"#;

/// The Redis key a token-bucket rule keeps `key`'s state in.
fn state_key(rule: &str, key: &str) -> String {
    let set = RuleSet::parse(RULES).unwrap();
    let rule = set.iter().find(|r| r.id == rule).unwrap();
    Layout::default().state_key(rule, key)
}

/// Puts a string where the script expects a hash: HMGET fails with WRONGTYPE inside the script.
fn spoil(redis: &RedisServer, rule: &str, key: &str) {
    let mut conn = redis.conn();
    let _: () = redis::cmd("SET")
        .arg(state_key(rule, key))
        .arg("not a bucket")
        .query(&mut conn)
        .unwrap();
}

fn metric(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_redis_refuses_fails_its_check_by_fail_mode_and_no_breaker_opens() {
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--agents")
        .arg("1")
        .start()
        .await;
    spoil(&redis, "tb", "user:bad");
    spoil(&redis, "tbc", "ip:10.0.0.9");
    let client = patient_client(agent.socket()).await;
    // Far more failures than the breaker's threshold (5 consecutive).
    for _ in 0..20 {
        let d = client.allow("user:bad", "tb", 1).await.unwrap();
        assert_eq!(d.origin, Origin::Agent(Source::Fallback));
        assert!(d.allowed, "a fail-open rule answers at limit / N");
        let d = client.allow("ip:10.0.0.9", "tbc", 1).await.unwrap();
        assert_eq!(d.origin, Origin::Agent(Source::Fallback));
        assert!(!d.allowed, "a fail-closed rule rejects");
        assert!(d.retry_after_ms.is_some_and(|ms| ms > 0), "with a Retry-After");
    }
    // Every other client is still decided by Redis: the shard's breaker never opened.
    let d = client.allow("user:good", "tb", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Redis));
    assert_eq!(d.remaining, 999);
    let status = agent_status(&agent).await;
    assert_eq!(status["breakers"][0]["state"], "closed", "{status}");
    // Visible: counted, and what the fallback admitted for the refused key is not queued for a
    // write-back that would fail the same way.
    assert_eq!(status["fallback"]["pendingWriteBack"], 0, "{status}");
    let (_, text) = http_get(agent.admin_addr().await, "/metrics").await;
    assert_eq!(
        metric(&text, "floodgate_script_errors_total{op=\"check\"}"),
        40.0,
        "{text}"
    );
    assert!(agent.log().contains("Redis refused a check's script"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_entry_redis_refuses_is_dropped_and_the_others_land() {
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--redis-timeout-ms")
        .arg("100")
        .arg("--breaker-cooldown-ms")
        .arg("200")
        .arg("--agents")
        .arg("1")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let d = client.allow("user:w", "tb", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Redis));
    // user:bad's bucket is a string: its checks fail in the script (answered by the fail mode, not
    // recorded), and so will its write-back.
    spoil(&redis, "tb", "user:bad");
    // Redis paused (SIGSTOP): checks time out until the breaker opens, then the fallback answers
    // and records what it admits for the write-back.
    let pid = redis.pid().unwrap();
    floodgate_tests::pause_process(pid);
    eventually("the breaker opens", Duration::from_secs(20), || async {
        let d = client.allow("user:other", "tb", 1).await.ok()?;
        (d.origin == Origin::Agent(Source::Fallback)
            && agent_status(&agent).await["breakers"][0]["state"] != "closed")
            .then_some(())
    })
    .await;
    let recorded_before = agent_status(&agent).await["fallback"]["pendingWriteBack"]
        .as_u64()
        .unwrap();
    for _ in 0..10 {
        for key in ["user:w", "user:bad"] {
            let d = client.allow(key, "tb", 1).await.unwrap();
            assert_eq!(d.origin, Origin::Agent(Source::Fallback));
            assert!(d.allowed);
        }
    }
    let pending = agent_status(&agent).await["fallback"]["pendingWriteBack"]
        .as_u64()
        .unwrap();
    assert!(
        pending >= recorded_before + 2,
        "both keys wait for the write-back: {pending}"
    );
    floodgate_tests::resume_process(pid);
    let status = eventually("the write-back is done", Duration::from_secs(20), || async {
        let s = agent_status(&agent).await;
        (s["breakers"][0]["state"] == "closed" && s["fallback"]["pendingWriteBack"] == 0).then_some(s)
    })
    .await;
    assert_eq!(status["fallback"]["writeBackRefusedUnits"], 10, "{status}");
    assert!(
        status["fallback"]["writtenBackUnits"].as_u64().unwrap() >= 10,
        "user:w's units landed: {status}"
    );
    // user:w's bucket holds the outage: 1,000 − 1 − 10 tokens (plus a few refilled, 0.28/s).
    let mut conn = redis.conn();
    let tokens: f64 = redis::cmd("HGET")
        .arg(state_key("tb", "user:w"))
        .arg("t")
        .query(&mut conn)
        .unwrap();
    assert!((989.0..992.0).contains(&tokens), "user:w's bucket: {tokens}");
    let (_, text) = http_get(agent.admin_addr().await, "/metrics").await;
    assert_eq!(
        metric(&text, "floodgate_script_errors_total{op=\"write_back\"}"),
        1.0,
        "{text}"
    );
    // The write-back is over, not retried for ever: the breaker stays closed and Redis answers.
    let d = client.allow("user:w", "tb", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Redis));
}
