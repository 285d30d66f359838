//! Item modes (protocol version 2) against real agents, on the embedded store and on Redis: a peek
//! changes nothing and says whether its cost would pass, a charge counts past the limit and is never
//! a rejection, later consumes wait out the debt, and modes combine in one check as PROTOCOL.md says.

use floodgate_protocol::Item;
use floodgate_sdk::{Client, Origin, Source};
use floodgate_tests::{patient_client, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"sw","dimension":"user","limit":5,"windowSeconds":3600},
  {"id":"tb","dimension":"user","limit":5,"windowSeconds":3600,"algorithm":"token_bucket"},
  {"id":"closed","dimension":"user","limit":5,"windowSeconds":3600,"failMode":"closed"}
]}"#;

/// The whole story on one rule: consume, peek, charge past the limit, the debt.
async fn peek_charge_and_debt(client: &Client, rule: &str, key: &str) {
    let d = client.check(vec![Item::new(key, rule, 3)]).await.unwrap();
    assert!(d.allowed && d.remaining == 2, "{rule}: {d:?}");
    for _ in 0..2 {
        let p = client.peek(key, rule, 0).await.unwrap();
        assert!(p.allowed, "{rule}: {p:?}");
        assert_eq!(
            p.remaining, 2,
            "{rule}: a peek tells what is left and takes nothing"
        );
    }
    let p = client.peek(key, rule, 3).await.unwrap();
    assert!(!p.allowed, "{rule}: 3 would not pass: {p:?}");
    assert_eq!(p.remaining, 2);
    assert!(p.retry_after_ms.unwrap() > 0);
    let c = client.charge(key, rule, 10).await.unwrap();
    assert!(c.allowed, "{rule}: a charge is never a rejection: {c:?}");
    assert_eq!(c.remaining, 0);
    assert_eq!(c.retry_after_ms, None);
    let v = c.items[0].verdict;
    assert!(
        !v.allowed && v.retry_after_ms > 0,
        "{rule}: the charge's own verdict says past the limit: {v:?}"
    );
    let d = client.check(vec![Item::new(key, rule, 1)]).await.unwrap();
    assert!(!d.allowed, "{rule}: the debt is waited out: {d:?}");
    assert!(
        d.retry_after_ms.unwrap() > 60_000,
        "{rule}: a debt of 8 at 5 an hour: {d:?}"
    );
    let p = client.peek(key, rule, 0).await.unwrap();
    assert_eq!(p.remaining, 0);
}

/// Peeks do not decide a check that consumes; charges commit whatever the check's verdict.
async fn combinations(client: &Client) {
    // A denied peek beside a passing consume: the consume counts, the check is allowed.
    client.charge("user:full", "sw", 9).await.unwrap();
    let d = client
        .check(vec![
            Item::new("user:c1", "sw", 1),
            Item::peek("user:full", "sw", 1),
        ])
        .await
        .unwrap();
    assert!(d.allowed, "{d:?}");
    assert!(!d.items[1].verdict.allowed, "the peek itself says no");
    assert_eq!(
        client.peek("user:c1", "sw", 0).await.unwrap().remaining,
        4,
        "the consume counted"
    );
    // A check of peeks alone is decided by them.
    let d = client
        .check(vec![Item::peek("user:full", "sw", 1)])
        .await
        .unwrap();
    assert!(!d.allowed);
    // A charge within the limit says so.
    let c = client.charge("user:c3", "sw", 1).await.unwrap();
    assert!(c.items[0].verdict.allowed && c.remaining == 4, "{c:?}");
    // A denied consume beside a charge: nothing consumed, the charge counted.
    let d = client
        .check(vec![
            Item::new("user:full", "tb", 9),
            Item::charge("user:c2", "sw", 2),
        ])
        .await
        .unwrap();
    assert!(!d.allowed, "{d:?}");
    assert_eq!(
        client.peek("user:full", "tb", 0).await.unwrap().remaining,
        5,
        "nothing consumed"
    );
    assert_eq!(
        client.peek("user:c2", "sw", 0).await.unwrap().remaining,
        3,
        "the charge counted"
    );
}

#[tokio::test]
async fn on_the_embedded_store() {
    let agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    peek_charge_and_debt(&client, "sw", "user:1").await;
    peek_charge_and_debt(&client, "tb", "user:1").await;
    combinations(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_and_while_redis_is_away() {
    let mut redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    peek_charge_and_debt(&client, "sw", "user:1").await;
    peek_charge_and_debt(&client, "tb", "user:1").await;
    combinations(&client).await;
    let d = client.peek("user:1", "sw", 0).await.unwrap();
    assert_eq!(
        d.items[0].verdict.source,
        Source::Redis,
        "peeks are Redis's, not the cache's"
    );

    // Redis gone: peeks and charges are answered by their rules' fail modes.
    redis.kill();
    let d = client.charge("user:9", "sw", 2).await.unwrap();
    assert!(d.allowed);
    assert_eq!(d.origin, Origin::Agent(Source::Fallback));
    let d = client.peek("user:9", "closed", 0).await.unwrap();
    assert!(
        !d.allowed,
        "a fail-closed rule's peek denies while the store is away: {d:?}"
    );
    assert_eq!(d.origin, Origin::Agent(Source::Fallback));
}
