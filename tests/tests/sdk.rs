//! The SDK against real agent processes: fail open or closed within its timeout when the agent is
//! away or late, reconnection after a restart, many checks in flight on one connection.

use std::time::{Duration, Instant};

use floodgate_protocol::{Check, Item};
use floodgate_sdk::{CallOptions, Client, ClientConfig, Degraded, FailPolicy, Origin};
use floodgate_tests::{eventually, pause_process, resume_process, Agent};

/// What a call may take beyond its timeout: scheduler wake-ups on a loaded 2-core CI machine, where
/// other test binaries run beside this one. Far below any timeout a caller would notice.
const MARGIN: Duration = Duration::from_millis(250);

#[tokio::test]
async fn no_agent_fails_open_by_default_and_closed_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let client = Client::connect(dir.path().join("nobody.sock")).await;
    let started = Instant::now();
    let d = client.allow("user:1", "api-per-user", 1).await.unwrap();
    assert!(started.elapsed() < ClientConfig::default().timeout + MARGIN);
    assert!(d.allowed);
    assert_eq!(d.origin, Origin::FailOpen(Degraded::Unavailable));

    let closed = CallOptions {
        fail: Some(FailPolicy::Closed),
        ..Default::default()
    };
    let d = client
        .check_with(Check::Items(vec![Item::new("user:1", "login", 1)]), closed)
        .await
        .unwrap();
    assert!(!d.allowed);
    assert_eq!(d.origin, Origin::FailClosed(Degraded::Unavailable));
    assert_eq!(
        d.retry_after_ms,
        Some(1_000),
        "a fail-closed denial still says when to retry"
    );
    assert_eq!(client.stats().unavailable, 2);
}

#[tokio::test]
async fn a_stopped_agent_costs_the_timeout_and_no_more() {
    let agent = Agent::builder().start().await;
    let client = Client::with_config(
        agent.socket(),
        ClientConfig {
            timeout: Duration::from_millis(20),
            ..Default::default()
        },
    )
    .await;
    answered_by_agent(&client, "the agent answers").await;

    let pid = agent.pid().unwrap();
    pause_process(pid); // SIGSTOP: the agent is alive but answers nothing.
    let started = Instant::now();
    let d = client.allow("user:1", "api-per-user", 1).await.unwrap();
    let took = started.elapsed();
    resume_process(pid);
    assert_eq!(d.origin, Origin::FailOpen(Degraded::Timeout));
    assert!(
        took >= Duration::from_millis(20) && took < Duration::from_millis(20) + MARGIN,
        "took {took:?}"
    );
    assert_eq!(client.stats().timeouts, 1);
    // The late answer is discarded, and the connection keeps working.
    answered_by_agent(&client, "the agent answers again after SIGCONT").await;
}

#[tokio::test]
async fn the_client_reconnects_after_an_agent_restart() {
    let mut agent = Agent::builder().start().await;
    let socket = agent.socket().to_path_buf();
    let client = Client::connect(&socket).await;
    answered_by_agent(&client, "the agent answers").await;

    agent.kill();
    // While it is gone every call answers by the policy at once.
    eventually(
        "the client notices the agent is gone",
        Duration::from_secs(5),
        || {
            let client = client.clone();
            async move { (!client.is_connected()).then_some(()) }
        },
    )
    .await;
    let d = client.allow("user:1", "api-per-user", 1).await.unwrap();
    assert_eq!(d.origin, Origin::FailOpen(Degraded::Unavailable));

    // A new agent on the same path (the crashed one's socket file is stale and gets replaced).
    let _again = Agent::builder().socket(&socket).start().await;
    answered_by_agent(&client, "the client reconnects by itself").await;
    assert!(client.stats().connects >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_checks_in_flight_on_one_connection() {
    let agent = Agent::builder()
        // An hour-long window: the run cannot straddle a window edge (well, once in ~10,000 runs).
        .rules(r#"{"rules":[{"id":"r","dimension":"user","limit":500,"windowSeconds":3600}]}"#)
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
    let calls = (0..2_000).map(|i| {
        let client = client.clone();
        async move { client.allow(&format!("user:{}", i % 2), "r", 1).await.unwrap() }
    });
    let all = futures::future::join_all(calls).await;
    assert!(
        all.iter().all(|d| d.from_agent_answer()),
        "every answer came from the agent"
    );
    // Two keys, 1,000 checks each, limit 500: exactly 500 admitted per key.
    assert_eq!(all.iter().filter(|d| d.allowed).count(), 1_000);
    assert_eq!(
        client.stats().connects,
        1,
        "one multiplexed connection carried them all"
    );
}

/// Waits until a check is answered by the agent itself (short timeouts may miss on a busy machine;
/// what matters is that answers come back, not how fast the first one is).
async fn answered_by_agent(client: &Client, what: &str) {
    eventually(what, Duration::from_secs(5), || {
        let client = client.clone();
        async move {
            client
                .allow("user:1", "api-per-user", 1)
                .await
                .unwrap()
                .from_agent_answer()
                .then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn a_per_process_fallback_limit_protects_the_service_while_the_agent_is_away() {
    let dir = tempfile::tempdir().unwrap();
    let config = ClientConfig {
        fallback_limit: Some(floodgate_sdk::LocalLimit {
            limit: 3,
            per: Duration::from_secs(60),
        }),
        ..Default::default()
    };
    let client = Client::with_config(dir.path().join("nobody.sock"), config).await;
    for i in 0..3 {
        let d = client.allow("user:1", "api-per-user", 1).await.unwrap();
        assert!(d.allowed, "call {i} within the local limit");
        assert_eq!(d.origin, Origin::LocalLimit(Degraded::Unavailable));
    }
    let d = client.allow("user:1", "api-per-user", 1).await.unwrap();
    assert!(!d.allowed, "the fourth call is over the per-process limit");
    // One token per 20 s: the wait is at most 20 s and always stated.
    assert!((1..=20_000).contains(&d.retry_after_ms.unwrap()));
    // Another key has its own budget; a fail-closed call ignores the local limit and denies.
    assert!(client.allow("user:2", "api-per-user", 1).await.unwrap().allowed);
    let closed = CallOptions {
        fail: Some(FailPolicy::Closed),
        ..Default::default()
    };
    let d = client
        .check_with(Check::Items(vec![Item::new("user:3", "login", 1)]), closed)
        .await
        .unwrap();
    assert_eq!(d.origin, Origin::FailClosed(Degraded::Unavailable));
    assert_eq!(client.stats().local_denied, 1);
}
