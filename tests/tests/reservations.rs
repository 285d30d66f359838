//! Reservations (protocol version 6) against real agents on a real Redis: a reserve counts at once
//! and fleet-wide, a commit gives back what was not used, and a thousand requests reserving their
//! `max_tokens` together never pass the budget, whatever they end up using.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use floodgate_sdk::{Client, Meter};
use floodgate_tests::{eventually, http_get, patient_client, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"tokens","dimension":"api_key","limit":1000,"windowSeconds":3600},
  {"id":"budget","dimension":"api_key","limit":200000,"algorithm":"quota","period":"year"},
  {"id":"inflight","dimension":"api_key","limit":2,"algorithm":"concurrency"},
  {"id":"short","dimension":"api_key","limit":1000,"windowSeconds":3600,"execution":"batched","reservationSeconds":0.5,"reservationExpiry":"release"}
]}"#;

async fn remaining(c: &Client, key: &str, rule: &str) -> u64 {
    c.peek(key, rule, 0).await.unwrap().remaining
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_gives_back_fleet_wide() {
    let redis = RedisServer::start();
    let a = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let b = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let (ca, cb) = (patient_client(a.socket()).await, patient_client(b.socket()).await);
    let key = "apikey:fleet";
    let (d, r) = ca.reserve(key, "tokens", 400).await.unwrap();
    assert!(d.allowed, "{d:?}");
    let r = r.expect("the agent holds the reservation");
    assert_eq!(
        remaining(&cb, key, "tokens").await,
        600,
        "the other agent sees it counted"
    );
    let c = ca.commit(&r, &[150]).await.unwrap();
    assert!(c.allowed, "a commit is never a rejection: {c:?}");
    assert_eq!(
        remaining(&cb, key, "tokens").await,
        850,
        "the 250 unused came back"
    );
    // The reservation lives in the agent that took it: a commit there again, or at another agent,
    // finds nothing and changes nothing (the rule keeps an expired reservation's units).
    ca.commit(&r, &[150]).await.unwrap();
    cb.commit(&r, &[0]).await.unwrap();
    assert_eq!(remaining(&cb, key, "tokens").await, 850);
    let (_, metrics) = http_get(a.admin_addr().await, "/metrics").await;
    for line in [
        "floodgate_reservations_total{outcome=\"reserved\"} 1",
        "floodgate_reservations_total{outcome=\"committed\"} 1",
        "floodgate_reservations_total{outcome=\"unknown\"} 1",
        "floodgate_reservation_units_total{way=\"returned\"} 250",
        "floodgate_reservations_held 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "no {line:?} in\n{metrics}");
    }

    // Meters reserved together, all or nothing: tokens and a request in flight.
    let meters = |tokens| vec![Meter::new(key, "tokens", tokens), Meter::new(key, "inflight", 1)];
    let (_, first) = ca.reserve_meters(meters(100)).await.unwrap();
    let (d, none) = ca.reserve_meters(meters(900)).await.unwrap();
    assert!(!d.allowed && none.is_none(), "750 left: {d:?}");
    let (_, second) = ca.reserve_meters(meters(100)).await.unwrap();
    let (d, _) = ca.reserve_meters(meters(1)).await.unwrap();
    assert!(!d.allowed, "two requests in flight already: {d:?}");
    ca.commit(&first.unwrap(), &[100, 1]).await.unwrap();
    ca.commit(&second.unwrap(), &[0, 1]).await.unwrap();
    assert_eq!(remaining(&cb, key, "tokens").await, 750);
    assert_eq!(
        remaining(&cb, key, "inflight").await,
        2,
        "both units in flight were released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncommitted_reservation_of_a_batched_rule_expires_back() {
    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    let key = "apikey:gone";
    let (d, r) = client.reserve(key, "short", 300).await.unwrap();
    // A reserve of a batched rule runs sync, in Redis, where its expiry can give it back.
    assert!(
        d.allowed && r.is_some() && d.items[0].verdict.source == floodgate_sdk::Source::Redis,
        "{d:?}"
    );
    assert_eq!(remaining(&client, key, "short").await, 700);
    eventually(
        "the expired reservation's units come back",
        Duration::from_secs(10),
        || async { (remaining(&client, key, "short").await == 1000).then_some(()) },
    )
    .await;
}

/// What each request uses after its response: 1 to 1,000 tokens, by a fixed sequence.
fn used(n: u64) -> u32 {
    (n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as u32 + 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_requests_reserving_max_tokens_never_pass_the_budget() {
    let redis = RedisServer::start();
    let agents = [
        Agent::builder().redis(&redis.url()).rules(RULES).start().await,
        Agent::builder().redis(&redis.url()).rules(RULES).start().await,
    ];
    let clients = [
        Arc::new(patient_client(agents[0].socket()).await),
        Arc::new(patient_client(agents[1].socket()).await),
    ];
    let key = "apikey:many";
    let (spent, admitted) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let tasks: Vec<_> = (0..1_000u64)
        .map(|n| {
            let (c, spent, admitted) = (clients[n as usize % 2].clone(), spent.clone(), admitted.clone());
            tokio::spawn(async move {
                let (d, r) = c.reserve(key, "budget", 1_000).await.unwrap();
                let Some(r) = r else {
                    assert!(!d.allowed, "no reservation without a denial: {d:?}");
                    return;
                };
                admitted.fetch_add(1, Ordering::Relaxed);
                // The response streams: other requests reserve and commit meanwhile.
                tokio::task::yield_now().await;
                let u = used(n);
                spent.fetch_add(u64::from(u), Ordering::Relaxed);
                let c = c.commit(&r, &[u]).await.unwrap();
                assert!(c.allowed || c.remaining == 0, "{c:?}");
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let (spent, admitted) = (spent.load(Ordering::Relaxed), admitted.load(Ordering::Relaxed));
    assert!(spent <= 200_000, "the budget was passed: {spent} tokens used");
    assert!(
        admitted > 200,
        "commits gave room back: {admitted} admitted of 1,000"
    );
    assert_eq!(
        remaining(&clients[0], key, "budget").await,
        200_000 - spent,
        "what the store counts is what was used, every unused unit given back"
    );
}
