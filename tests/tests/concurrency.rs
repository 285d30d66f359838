//! Concurrency rules (protocol version 3) against real agents: units in flight held under leases,
//! released by the client or freed when the lease runs out, exact across agents on one Redis, and
//! never leaked by an agent killed while it held leases.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use floodgate_protocol::Item;
use floodgate_sdk::{Client, Source};
use floodgate_tests::{patient_client, redis_time_ms, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"slots","dimension":"api_key","limit":3,"algorithm":"concurrency","leaseSeconds":60},
  {"id":"short","dimension":"api_key","limit":2,"algorithm":"concurrency","leaseSeconds":1},
  {"id":"rate","dimension":"api_key","limit":100,"windowSeconds":3600}
]}"#;

/// Acquire, deny at the limit, release, renew, release by count: the whole story on one store.
async fn acquire_and_release(client: &Client, key: &str) {
    let (a, la) = client.acquire(key, "slots", 2).await.unwrap();
    assert!(a.allowed && a.remaining == 1, "{a:?}");
    let la = la.expect("the lease is held");
    assert!(a.items[0].verdict.holds_lease);
    let (b, lb) = client.acquire(key, "slots", 2).await.unwrap();
    assert!(!b.allowed, "2 + 2 > 3: {b:?}");
    assert!(lb.is_none() && !b.items[0].verdict.holds_lease);
    assert_eq!(b.remaining, 1);
    let retry = b.retry_after_ms.unwrap();
    assert!(
        (1..=1_000).contains(&retry),
        "a denial waits at most 1 s: {retry}"
    );
    // A peek says what is held and changes nothing.
    let p = client.peek(key, "slots", 1).await.unwrap();
    assert!(p.allowed && p.remaining == 1, "{p:?}");
    // Released, the units are free again.
    let r = client.release(&la).await.unwrap();
    assert!(r.allowed && r.remaining == 3, "{r:?}");
    // Releasing twice changes nothing.
    let r = client.release(&la).await.unwrap();
    assert_eq!(r.remaining, 3);
    let (c, lc) = client.acquire(key, "slots", 3).await.unwrap();
    assert!(c.allowed && c.remaining == 0, "{c:?}");
    let lc = lc.unwrap();
    // The same lease again renews it: allowed at the limit, nothing more held.
    let renew = client
        .check(vec![Item::acquire(key, "slots", 3, lc.id)])
        .await
        .unwrap();
    assert!(renew.allowed && renew.remaining == 0, "{renew:?}");
    // A release without a lease frees whole leases by count.
    let r = client
        .check(vec![Item::release(key, "slots", 3, None)])
        .await
        .unwrap();
    assert_eq!(r.items[0].verdict.remaining, 3, "{r:?}");
    // An acquire without a lease (a version-1 client, Envoy) holds units the client is not told of.
    let anon = client.check(vec![Item::new(key, "slots", 1)]).await.unwrap();
    assert!(anon.allowed && !anon.items[0].verdict.holds_lease && anon.remaining == 2);
    client
        .check(vec![Item::release(key, "slots", 1, None)])
        .await
        .unwrap();
    // All or nothing with the check's other consume items: a denied check takes no lease.
    let (_, full) = client.acquire(key, "slots", 3).await.unwrap();
    let d = client
        .check(vec![
            Item::new(key, "rate", 1),
            Item::acquire(key, "slots", 1, 77),
        ])
        .await
        .unwrap();
    assert!(!d.allowed && !d.items[1].verdict.holds_lease, "{d:?}");
    assert_eq!(
        client.peek(key, "rate", 0).await.unwrap().remaining,
        d.items[0].verdict.remaining,
        "the rate item of the denied check took nothing"
    );
    client.release(&full.unwrap()).await.unwrap();
    // A release on a rate rule is a peek of 0: it changes nothing.
    let before = client.peek(key, "rate", 0).await.unwrap().remaining;
    let r = client
        .check(vec![Item::release(key, "rate", 5, Some(1))])
        .await
        .unwrap();
    assert_eq!(r.items[0].verdict.remaining, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_on_the_embedded_store_and_on_redis() {
    let embedded = Agent::builder().rules(RULES).start().await;
    acquire_and_release(&patient_client(embedded.socket()).await, "apikey:e").await;
    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    acquire_and_release(&client, "apikey:r").await;
    let (d, _) = client.acquire("apikey:src", "slots", 1).await.unwrap();
    assert_eq!(d.items[0].verdict.source, Source::Redis);
    // The key's sorted set is gone once nothing is held.
    let mut conn = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("fg:*/c/apikey:r")
        .query(&mut conn)
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

/// Two agents on one Redis, 64 clients acquiring and releasing: the units in flight never pass the
/// limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_never_passes_the_limit_across_agents() {
    let redis = RedisServer::start();
    let agents = [
        Agent::builder().redis(&redis.url()).rules(RULES).start().await,
        Agent::builder().redis(&redis.url()).rules(RULES).start().await,
    ];
    let clients = [
        Arc::new(patient_client(agents[0].socket()).await),
        Arc::new(patient_client(agents[1].socket()).await),
    ];
    let in_flight = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let (held, denied) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let client = clients[i % 2].clone();
        let (in_flight, most, held, denied) = (in_flight.clone(), most.clone(), held.clone(), denied.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let (d, lease) = client.acquire("apikey:hot", "slots", 1).await.unwrap();
                assert!(d.from_agent_answer(), "{d:?}");
                let Some(lease) = lease else {
                    denied.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                    continue;
                };
                // Counted between the acquire's answer and the release's sending: at most what
                // the limiter holds.
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                held.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                let r = client.release(&lease).await.unwrap();
                assert!(r.from_agent_answer());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (most, held, denied) = (
        most.load(Ordering::SeqCst),
        held.load(Ordering::Relaxed),
        denied.load(Ordering::Relaxed),
    );
    assert!(most <= 3, "{most} in flight at once, over the limit of 3");
    assert!(
        held >= 20 && denied > 0,
        "the test contended: {held} held, {denied} denied"
    );
    // Everything released: the key holds nothing.
    let p = clients[0].peek("apikey:hot", "slots", 0).await.unwrap();
    assert_eq!(p.remaining, 3, "{p:?}");
}

/// An agent killed while its clients hold leases leaks nothing past the lease time: another agent
/// is refused until then, and served from the moment the leases run out (Redis's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_of_a_killed_agent_run_out() {
    let redis = RedisServer::start();
    let mut doomed = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let survivor = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(doomed.socket()).await;
    for _ in 0..2 {
        let (d, lease) = client.acquire("apikey:dead", "short", 1).await.unwrap();
        assert!(d.allowed && lease.is_some(), "{d:?}");
    }
    doomed.kill();
    let other = patient_client(survivor.socket()).await;
    let (d, _) = other.acquire("apikey:dead", "short", 1).await.unwrap();
    assert!(!d.allowed, "the dead agent's leases still hold: {d:?}");
    let free_at = d.reset_at_ms;
    let mut conn = redis.conn();
    let now = redis_time_ms(&mut conn);
    assert!(
        free_at <= now + 1_000,
        "they run out within the 1 s lease time: at {free_at}, now {now}"
    );
    // Waited out on Redis's clock, then served.
    while redis_time_ms(&mut conn) <= free_at {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (d, lease) = other.acquire("apikey:dead", "short", 2).await.unwrap();
    assert!(d.allowed && lease.is_some(), "freed after the lease time: {d:?}");
}

/// Redis away: a fail-open concurrency rule holds leases in the agent at limit / N, and a release
/// frees them there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_while_redis_is_away() {
    let mut redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    redis.kill();
    let mut leases = Vec::new();
    for _ in 0..3 {
        let (d, lease) = client.acquire("apikey:away", "slots", 1).await.unwrap();
        assert!(
            d.allowed && d.items[0].verdict.source == Source::Fallback,
            "{d:?}"
        );
        leases.push(lease.unwrap());
    }
    let (d, _) = client.acquire("apikey:away", "slots", 1).await.unwrap();
    assert!(!d.allowed, "the fallback holds at most the limit (N = 1): {d:?}");
    client.release(&leases.pop().unwrap()).await.unwrap();
    let (d, _) = client.acquire("apikey:away", "slots", 1).await.unwrap();
    assert!(d.allowed, "the release freed a unit in the fallback: {d:?}");
}
