//! Calendar quotas against real agents: exact across agents on one Redis, reset and Retry-After at
//! the period's end in the rule's time zone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use floodgate_core::rules::RuleSet;
use floodgate_protocol::Item;
use floodgate_tests::{patient_client, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"monthly","dimension":"api_key","limit":500,"algorithm":"quota","period":"month","timezone":"America/New_York"}
]}"#;

/// Four agents on one Redis, 64 clients racing for one key's monthly quota: exactly its count is
/// admitted, and every answer ends at the month's end in New York.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monthly_quota_across_four_agents_admits_exactly_its_count() {
    let redis = RedisServer::start();
    let mut agents = Vec::new();
    for _ in 0..4 {
        // The rejection cache off: every check reaches Redis (with it, the same count holds).
        agents.push(
            Agent::builder()
                .redis(&redis.url())
                .rules(RULES)
                .arg("--rejection-cache")
                .arg("0")
                .start()
                .await,
        );
    }
    let mut clients = Vec::new();
    for a in &agents {
        clients.push(Arc::new(patient_client(a.socket()).await));
    }
    let rule = RuleSet::parse(RULES).unwrap().get("monthly").unwrap().clone();
    let (month_start, month_end) = rule.quota_period(floodgate_core::store::Clock::System.now_ms());
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let (client, admitted) = (clients[i % 4].clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            let mut resets = Vec::new();
            for _ in 0..12 {
                let d = client
                    .check(vec![Item::new("apikey:acme", "monthly", 1)])
                    .await
                    .unwrap();
                assert!(d.from_agent_answer(), "{d:?}");
                // The window a v4 decision names: this month in New York, its exact length.
                assert_eq!(d.items[0].window_ms, month_end - month_start, "{d:?}");
                if d.allowed {
                    admitted.fetch_add(1, Ordering::Relaxed);
                } else {
                    assert!(d.retry_after_ms.unwrap() > 0);
                }
                resets.push(d.reset_at_ms);
            }
            resets
        }));
    }
    for t in tasks {
        for reset in t.await.unwrap() {
            assert_eq!(reset, month_end, "reset at the month's end in New York");
        }
    }
    assert_eq!(
        admitted.load(Ordering::Relaxed),
        500,
        "64 × 12 = 768 asked, the quota is 500"
    );
    let p = clients[0].peek("apikey:acme", "monthly", 0).await.unwrap();
    assert_eq!(p.remaining, 0);
}
