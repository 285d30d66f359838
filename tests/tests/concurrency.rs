//! Concurrency rules (protocol version 3) against real agents: units in flight held under leases,
//! released by the client or freed when the lease runs out, exact across agents on one Redis, and
//! never leaked by an agent killed while it held leases.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use floodgate_protocol::Item;
use floodgate_sdk::{Client, Source};
use floodgate_tests::{agent_status, eventually, patient_client, redis_time_ms, Agent, RedisServer};

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

/// An agent on Redis whose breaker reopens the shard quickly once Redis answers again, and counts
/// itself alone (N = 1): its fallback's share of a concurrency rule is the whole limit.
async fn quick_agent(redis: &RedisServer) -> Agent {
    Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--redis-timeout-ms")
        .arg("20")
        .arg("--breaker-cooldown-ms")
        .arg("200")
        .arg("--agents")
        .arg("1")
        .start()
        .await
}

/// Acquires `slots` leases of 1 on `key` until one is refused; answers those held and the sources
/// that answered them.
async fn acquire_all(client: &Client, key: &str) -> (Vec<floodgate_sdk::Lease>, Vec<Source>) {
    let (mut held, mut sources) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let (d, lease) = client.acquire(key, "slots", 1).await.unwrap();
        sources.push(d.items[0].verdict.source);
        match lease {
            Some(l) => held.push(l),
            None => break,
        }
    }
    (held, sources)
}

/// Waits for the agent's breaker to close and its fallback's write-back to be done.
async fn written_back(agent: &Agent) {
    eventually(
        "the breaker closes and the write-back is done",
        Duration::from_secs(10),
        || async {
            let s = agent_status(agent).await;
            let done = s["breakers"][0]["state"] == "closed"
                && s["fallback"]["pendingWriteBack"] == 0
                && s["fallback"]["writtenBackUnits"].as_u64() > Some(0);
            done.then_some(())
        },
    )
    .await
}

/// Leases the fallback granted while Redis was away are taken in Redis once it answers again (issue
/// 33: Redis knew nothing of them and granted its whole limit again, so a limit of 3 held 6 until
/// the clients released). A release then frees them in both places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_granted_while_redis_was_away_are_taken_there_when_it_answers() {
    let mut redis = RedisServer::start();
    let agent = quick_agent(&redis).await;
    let client = patient_client(agent.socket()).await;
    redis.kill();
    let (mut held, sources) = acquire_all(&client, "apikey:back").await;
    assert_eq!(held.len(), 3, "the fallback holds the limit (N = 1): {sources:?}");
    assert!(sources.iter().all(|s| *s == Source::Fallback), "{sources:?}");
    redis.restart();
    written_back(&agent).await;
    let (d, lease) = client.acquire("apikey:back", "slots", 1).await.unwrap();
    assert!(
        !d.allowed && lease.is_none() && d.items[0].verdict.source == Source::Redis,
        "Redis holds the 3 leases the fallback granted: {d:?}"
    );
    // A release reaches Redis's copy too: one unit is free again, and only one.
    client.release(&held.pop().unwrap()).await.unwrap();
    let (d, lease) = client.acquire("apikey:back", "slots", 1).await.unwrap();
    assert!(d.allowed && d.items[0].verdict.source == Source::Redis, "{d:?}");
    held.push(lease.unwrap());
    let (d, _) = client.acquire("apikey:back", "slots", 1).await.unwrap();
    assert!(!d.allowed, "{d:?}");
}

/// The same while Redis is only stopped: acquires that timed out may still run in Redis when it
/// wakes, under the same lease ids the fallback granted; taking a lease Redis already holds renews
/// it, so each unit is held there once (the cold start's case: a first call that outlasts the store
/// timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_late_by_redis_and_by_the_write_back_counts_once() {
    let redis = RedisServer::start();
    let agent = quick_agent(&redis).await;
    let client = patient_client(agent.socket()).await;
    let pid = redis.pid().unwrap();
    floodgate_tests::pause_process(pid);
    let (held, sources) = acquire_all(&client, "apikey:late").await;
    floodgate_tests::resume_process(pid);
    assert_eq!(held.len(), 3, "the fallback holds the limit (N = 1): {sources:?}");
    written_back(&agent).await;
    let mut conn = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("fg:*/c/apikey:late")
        .query(&mut conn)
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let members: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&keys[0])
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut conn)
        .unwrap();
    let leases: Vec<&String> = members.iter().map(|(m, _)| m).filter(|m| *m != "#").collect();
    assert_eq!(leases.len(), 3, "each lease held once: {members:?}");
    let units = members.iter().find(|(m, _)| m == "#").map(|(_, s)| -s);
    assert_eq!(units, Some(3.0), "3 units held: {members:?}");
    let (d, _) = client.acquire("apikey:late", "slots", 1).await.unwrap();
    assert!(!d.allowed && d.items[0].verdict.source == Source::Redis, "{d:?}");
}

/// Cold start (issue 33: "4 units held in 8 of 10 rounds"): two fresh agents on a Redis whose
/// connections take 300 ms to open (a slow connect or handshake), a concurrency rule of limit 2,
/// four clients acquiring at once. Each agent loads its scripts, opens its connections and learns
/// N before it serves, so Redis decides the first acquires; before, they outlasted the store timeout
/// and each agent's fallback, counting itself alone, granted the whole limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_holds_no_more_than_the_limit() {
    const TWO: &str = r#"{"rules":[{"id":"two","dimension":"api_key","limit":2,"algorithm":"concurrency"}]}"#;
    let redis = RedisServer::start();
    let proxy = floodgate_tests::Proxy::start(redis.port());
    proxy.set_connect_delay(Duration::from_millis(300));
    let cold = || {
        Agent::builder()
            .redis(&proxy.url())
            .rules(TWO)
            .arg("--redis-timeout-ms")
            .arg("100")
            .start()
    };
    let (a, b) = tokio::join!(cold(), cold());
    let clients = [
        patient_client(a.socket()).await,
        patient_client(a.socket()).await,
        patient_client(b.socket()).await,
        patient_client(b.socket()).await,
    ];
    let acquires = clients.iter().map(|c| c.acquire("apikey:cold", "two", 1));
    let decisions = futures::future::join_all(acquires).await;
    let held: Vec<_> = decisions
        .iter()
        .map(|r| r.as_ref().unwrap())
        .filter(|(_, lease)| lease.is_some())
        .map(|(d, _)| d.items[0].verdict.source)
        .collect();
    assert_eq!(held, [Source::Redis; 2], "{decisions:?}\n{}", a.log());
}
