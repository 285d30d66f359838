//! Past capacity the agent sheds instead of queueing: a check's budget (the store timeout) runs
//! from its frame's read, a check that could not be answered within it is answered by its rule's
//! fail mode at once, counted (`shed` in /v1/status, `floodgate_checks_shed_total`), and no breaker
//! opens for it. Driven here by a Redis reached through a proxy that delays every reply by 200 ms
//! with a 300 ms budget and one check per call: of 40 checks sent at once the first is Redis's and
//! the queue behind it, which could not be answered within the budget, is shed at once.

use std::time::{Duration, Instant};

use floodgate_sdk::{Client, ClientConfig, Origin, Source};
use floodgate_tests::{agent_status, http_get, Agent, Proxy, RedisServer};

const RULES: &str = r#"{"rules":[{"id":"api","dimension":"user","limit":1000,"windowSeconds":60}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_capacity_checks_are_shed_within_their_budget() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let agent = Agent::builder()
        .redis(&proxy.url())
        .rules(RULES)
        .arg("--redis-timeout-ms")
        .arg("300")
        .arg("--coalesce")
        .arg("1")
        .arg("--agents")
        .arg("1")
        .start()
        .await;
    let client = Client::with_config(
        agent.socket(),
        ClientConfig {
            timeout: Duration::from_secs(5),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        client.allow("user:warm", "api", 1).await.unwrap().origin,
        Origin::Agent(Source::Redis)
    );
    proxy.set_delay(Duration::from_millis(200));
    // The agent learns what a call takes now (each ~200 ms, one after another).
    for i in 0..3 {
        let d = client.allow(&format!("user:learn{i}"), "api", 1).await.unwrap();
        assert_eq!(d.origin, Origin::Agent(Source::Redis));
    }
    let answers = futures::future::join_all((0..40).map(|i| {
        let client = client.clone();
        async move {
            let t = Instant::now();
            let d = client.allow(&format!("user:{i}"), "api", 1).await.unwrap();
            (d, t.elapsed())
        }
    }))
    .await;
    let from_redis = answers
        .iter()
        .filter(|(d, _)| d.origin == Origin::Agent(Source::Redis))
        .count();
    let fallback = answers
        .iter()
        .filter(|(d, _)| d.origin == Origin::Agent(Source::Fallback))
        .count();
    // At least the first call in flight (the proxy delays replies one after another).
    assert!(
        from_redis >= 1,
        "the first call in flight is Redis's: {from_redis}"
    );
    assert_eq!(from_redis + fallback, 40, "every answer is the agent's");
    assert!(
        answers.iter().all(|(d, _)| d.allowed),
        "the rule fails open, at limit / 1"
    );
    // Bounded by the budget: 300 ms, plus what a loaded 2-core machine may add to a wake-up. Before,
    // a check waited in the queue for its turn and then the whole timeout again.
    let slowest = answers.iter().map(|(_, t)| *t).max().unwrap();
    assert!(
        slowest < Duration::from_millis(300 + 700),
        "slowest answer {slowest:?}"
    );
    let status = agent_status(&agent).await;
    let shed = status["shed"].as_u64().unwrap();
    assert!(
        shed >= 30,
        "the queue behind the calls in flight is shed: {status}"
    );
    assert_eq!(status["breakers"][0]["state"], "closed", "{status}");
    let (_, text) = http_get(agent.admin_addr().await, "/metrics").await;
    assert!(
        text.contains(&format!("floodgate_checks_shed_total {shed}")),
        "{text}"
    );
    // Once the load is gone, Redis answers again: as soon as the delayed calls still in flight
    // are answered and the queue is seen empty.
    proxy.set_delay(Duration::ZERO);
    floodgate_tests::eventually("Redis answers again", Duration::from_secs(10), || async {
        let d = client.allow("user:after", "api", 1).await.ok()?;
        (d.origin == Origin::Agent(Source::Redis)).then_some(())
    })
    .await;
}
