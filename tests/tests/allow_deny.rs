//! Allow and deny with their figures, through the SDK and a real agent on a real Redis (and on the
//! embedded store): limit, remaining, resetAt and retryAfter; token-bucket burst and refill.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use floodgate_sdk::{Client, Origin, Source};
use floodgate_tests::{patient_client, window_count, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"five-a-minute","dimension":"user","limit":5,"windowSeconds":60},
  {"id":"bucket","dimension":"user","limit":10,"windowSeconds":3600,"burst":5,"algorithm":"token_bucket"},
  {"id":"fast-bucket","dimension":"user","limit":10,"windowSeconds":1,"burst":1,"algorithm":"token_bucket"}
]}"#;

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

async fn limit_then_deny(client: &Client, source: Source) {
    let before = now_ms();
    for i in 0..5u64 {
        let d = client.allow("user:alice", "five-a-minute", 1).await.unwrap();
        assert!(d.allowed, "request {i}");
        assert_eq!(d.origin, Origin::Agent(source));
        assert_eq!(d.limit, 5);
        assert_eq!(d.remaining, 4 - i);
        assert_eq!(d.retry_after_ms, None);
        // The key is back to its full limit when both windows it touches have passed: at most 2 × 60 s.
        assert!(
            d.reset_at_ms > before && d.reset_at_ms <= before + 120_000 + 1_000,
            "{d:?}"
        );
    }
    let d = client.allow("user:alice", "five-a-minute", 1).await.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.remaining, 0);
    assert_eq!(d.limit, 5);
    let retry = d.retry_after_ms.expect("a denial always carries retryAfter");
    // Five in this window, none before: one more fits once the window rolls and 1/5 of it has
    // passed, so the wait is over 12 s and at most one window plus 12 s.
    assert!((12_000..=72_000).contains(&retry), "retry {retry}");
    // Another key is untouched.
    let other = client.allow("user:bob", "five-a-minute", 2).await.unwrap();
    assert!(other.allowed);
    assert_eq!(other.remaining, 3);
}

async fn bucket_burst_and_refill(client: &Client) {
    // Burst: 5 at once from a bucket that refills one token per 360 s, so no refill can blur the
    // figures however slow the machine is.
    for i in 0..5u64 {
        let d = client.allow("user:carol", "bucket", 1).await.unwrap();
        assert!(d.allowed, "burst request {i}");
        assert_eq!(d.limit, 5);
        assert_eq!(d.remaining, 4 - i);
    }
    let d = client.allow("user:carol", "bucket", 1).await.unwrap();
    assert!(!d.allowed, "the burst is spent");
    let retry = d.retry_after_ms.unwrap();
    assert!(
        (1..=360_000).contains(&retry),
        "one token takes at most 360 s: {retry}"
    );

    // Refill: a bucket of 1 refilled at 10/s. Take the token, then ask until denied (a slow machine
    // may let 100 ms pass between two calls, refilling it).
    let mut denial = None;
    for _ in 0..20 {
        let d = client.allow("user:dave", "fast-bucket", 1).await.unwrap();
        if !d.allowed {
            denial = Some(d);
            break;
        }
    }
    let retry = denial
        .expect("a bucket of 1 denies a second call")
        .retry_after_ms
        .unwrap();
    // One token takes at most 100 ms (less if part of one has refilled).
    assert!((1..=100).contains(&retry), "retry {retry}");
    // The refill is a function of time, so this test has to let time pass; waiting the advertised
    // retryAfter (+ 20 ms for the two clocks' read order) must be enough for one request.
    tokio::time::sleep(Duration::from_millis(retry + 20)).await;
    let d = client.allow("user:dave", "fast-bucket", 1).await.unwrap();
    assert!(d.allowed, "one token refilled after retryAfter: {d:?}");
}

#[tokio::test]
async fn redis_store_allows_then_denies_with_figures() {
    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    limit_then_deny(&client, Source::Redis).await;
    bucket_burst_and_refill(&client).await;
    // The counters live in Redis as fields of the client's bucket hash of this window.
    let mut conn = redis.conn();
    let (c, ttl) = window_count(&mut conn, "five-a-minute", "user:alice", 60_000);
    assert_eq!(c, 5, "the rejected request consumed nothing");
    assert!(ttl > 0 && ttl <= 120_000, "every key has a TTL, got {ttl}");
}

#[tokio::test]
async fn embedded_store_allows_then_denies_with_figures() {
    let agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    limit_then_deny(&client, Source::Local).await;
    bucket_burst_and_refill(&client).await;
}

#[tokio::test]
async fn unknown_rules_and_bad_keys_are_errors_not_allows() {
    let agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    match client.allow("user:1", "no-such-rule", 1).await {
        Err(floodgate_sdk::Error::Agent { code, message }) => {
            assert_eq!(code, floodgate_protocol::ErrorCode::UnknownRule);
            assert!(message.contains("no-such-rule"), "{message}");
        }
        other => panic!("expected an unknown-rule error, got {other:?}"),
    }
    for (key, cost) in [("{user:1}", 1), ("user:1", 0), ("", 1)] {
        let e = client.allow(key, "five-a-minute", cost).await.unwrap_err();
        assert!(
            matches!(e, floodgate_sdk::Error::Invalid(_)),
            "{key:?}/{cost}: {e:?}"
        );
    }
    let long = "k".repeat(257);
    assert!(client.allow(&long, "five-a-minute", 1).await.is_err());
}
