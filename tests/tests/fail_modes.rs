//! Rules that fail closed keep denying when the agent itself is gone: the agent lists them (protocol
//! version 2), the SDK keeps the list, and a check touching one is denied while the agent is away —
//! by the client, by the tower Layer, and per route where a route says otherwise. Version-1 clients
//! and agents keep working as they did.

use std::time::Duration;

use axum::body::Body;
use axum::routing::{get, post};
use axum::Router;
use floodgate_protocol::{Body as Frame_, Check, ClosedRule, FailModeList, Frame, Item, ListedDimension};
use floodgate_sdk::middleware::{PeerAddr, RateLimitLayer};
use floodgate_sdk::{CallOptions, Client, Degraded, FailPolicy, Origin};
use floodgate_tests::{eventually, patient_client, Agent, RawConn};
use http::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

const RULES: &str = r#"
[[rules]]
id = "login-per-ip"
dimension = "ip"
match = { endpoint = "/login" }
limit = 5
windowSeconds = 60
failMode = "closed"

[[rules]]
id = "search-per-ip"
dimension = "ip"
match = { endpoint = "/search" }
limit = 100
windowSeconds = 60

# Fails closed but only logs: never listed, never denies.
[[rules]]
id = "audit"
dimension = "ip"
limit = 1
windowSeconds = 60
failMode = "closed"
mode = "log"
"#;

#[tokio::test]
async fn the_agent_speaks_both_versions_and_lists_its_closed_rules() {
    let agent = Agent::builder().rules(RULES).start().await;
    let mut conn = RawConn::connect(agent.socket()).await.unwrap();
    let hello = |min, max| {
        Frame::new(
            0,
            Frame_::Hello {
                min_version: min,
                max_version: max,
            },
        )
    };
    conn.send(&hello(1, 2)).await.unwrap();
    assert_eq!(conn.recv().await.unwrap().body, Frame_::HelloOk { version: 2 });
    conn.send(&hello(1, 1)).await.unwrap();
    assert_eq!(
        conn.recv().await.unwrap().body,
        Frame_::HelloOk { version: 1 },
        "a version-1 client is answered in version 1"
    );
    conn.send(&hello(1, 3)).await.unwrap();
    assert_eq!(conn.recv().await.unwrap().body, Frame_::HelloOk { version: 3 });
    conn.send(&hello(7, 9)).await.unwrap();
    assert!(matches!(conn.recv().await.unwrap().body, Frame_::Error(_)));

    conn.send(&Frame::new(5, Frame_::FailModes)).await.unwrap();
    let answer = conn.recv().await.unwrap();
    assert_eq!(answer.request_id, 5);
    let Frame_::FailModeList(list) = answer.body else {
        panic!("not a list: {answer:?}")
    };
    assert_eq!(
        list.rules,
        vec![ClosedRule {
            rule_id: "login-per-ip".into(),
            dimension: ListedDimension::Ip,
            endpoint: "/login".into(),
            tier: String::new(),
            limit: 5,
        }],
        "only the enforced fail-closed rule"
    );
    assert!(!list.truncated);

    // A version-1 check on the same connection is answered as before.
    let check = Check::Items(vec![Item::new("ip:1", "search-per-ip", 1)]);
    conn.send(&Frame::new(6, Frame_::Check(check))).await.unwrap();
    let bytes = {
        let d = conn.recv().await.unwrap();
        assert!(
            matches!(d.body, Frame_::Decision(ref d) if d.combined.allowed),
            "{d:?}"
        );
        d.to_bytes().unwrap()
    };
    assert_eq!(bytes[4], 1, "a decision carries version byte 1");
    let window = |d: Frame| match d.body {
        Frame_::Decision(d) => d.items[0].window_ms,
        other => panic!("not a decision: {other:?}"),
    };
    assert_eq!(
        window(d_for(&mut conn, 7).await),
        0,
        "no window for a version-3 client"
    );

    // A version-4 client is told each rule's window.
    conn.send(&hello(1, 4)).await.unwrap();
    assert_eq!(conn.recv().await.unwrap().body, Frame_::HelloOk { version: 4 });
    assert_eq!(window(d_for(&mut conn, 8).await), 60_000);
}

/// The decision for one more check of `search-per-ip`, under request id `id`.
async fn d_for(conn: &mut RawConn, id: u32) -> Frame {
    let check = Check::Items(vec![Item::new("ip:1", "search-per-ip", 1)]);
    conn.send(&Frame::new(id, Frame_::Check(check))).await.unwrap();
    let d = conn.recv().await.unwrap();
    assert_eq!(d.request_id, id);
    d
}

/// Waits until the client holds the agent's list of `n` fail-closed rules.
async fn learned(client: &Client, n: usize) {
    eventually(
        "the client learns the fail-closed rules",
        Duration::from_secs(10),
        || {
            let h = client.health();
            async move { (h.fail_closed_rules == Some(n)).then_some(()) }
        },
    )
    .await;
}

async fn gone(client: &Client) {
    eventually(
        "the client notices the agent is gone",
        Duration::from_secs(10),
        || {
            let c = client.is_connected();
            async move { (!c).then_some(()) }
        },
    )
    .await;
}

#[tokio::test]
async fn with_the_agent_killed_a_closed_rule_denies_and_an_open_rule_passes() {
    let mut agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    learned(&client, 1).await;
    agent.kill();
    gone(&client).await;

    let login = Check::Items(vec![Item::new("ip:203.0.113.5", "login-per-ip", 1)]);
    let d = client
        .check_with(login.clone(), CallOptions::default())
        .await
        .unwrap();
    assert!(!d.allowed, "{d:?}");
    assert_eq!(d.origin, Origin::FailClosed(Degraded::Unavailable));
    assert_eq!(d.limit, 5, "the rule's limit, for X-RateLimit-Limit");
    assert_eq!(d.retry_after_ms, Some(1_000));

    let search = Check::Items(vec![Item::new("ip:203.0.113.5", "search-per-ip", 1)]);
    let d = client.check_with(search, CallOptions::default()).await.unwrap();
    assert!(d.allowed);
    assert_eq!(d.origin, Origin::FailOpen(Degraded::Unavailable));

    // Two items: one closed rule closes the check.
    let both = Check::Items(vec![
        Item::new("ip:1", "search-per-ip", 1),
        Item::new("ip:1", "login-per-ip", 1),
    ]);
    assert!(
        !client
            .check_with(both, CallOptions::default())
            .await
            .unwrap()
            .allowed
    );

    // An attribute check the agent would match to the closed rule; one it would not.
    let attrs = |endpoint: &str| {
        Check::Attributes(floodgate_protocol::Attributes {
            endpoint: Some(endpoint.into()),
            ip: Some("203.0.113.5".into()),
            cost: 1,
            ..Default::default()
        })
    };
    assert!(
        !client
            .check_with(attrs("/login"), CallOptions::default())
            .await
            .unwrap()
            .allowed
    );
    assert!(
        client
            .check_with(attrs("/search"), CallOptions::default())
            .await
            .unwrap()
            .allowed
    );

    // The call's own policy decides alone.
    let open = CallOptions {
        fail: Some(FailPolicy::Open),
        ..Default::default()
    };
    assert!(client.check_with(login, open).await.unwrap().allowed);
    assert_eq!(
        client.health().fail_closed_rules,
        Some(1),
        "the list outlives the agent"
    );
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/login", post(|| async { "welcome" }))
        .route("/search", get(|| async { "results" }))
        .layer(layer)
}

fn req(method: &str, path: &str) -> Request<Body> {
    let mut r = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap();
    r.extensions_mut()
        .insert(PeerAddr("203.0.113.9:40000".parse().unwrap()));
    r
}

#[tokio::test]
async fn the_layer_answers_429_for_a_closed_rule_while_the_agent_is_gone() {
    let mut agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    learned(&client, 1).await;
    let rules_only = app(RateLimitLayer::new(client.clone()));
    let overridden = app(RateLimitLayer::new(client.clone()).fail_for("/login", FailPolicy::Open));
    assert_eq!(
        rules_only
            .clone()
            .oneshot(req("POST", "/login"))
            .await
            .unwrap()
            .status(),
        200
    );
    agent.kill();
    gone(&client).await;

    let r = rules_only.clone().oneshot(req("POST", "/login")).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(r.headers()["x-ratelimit-limit"], "5");
    assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
    let r = rules_only.oneshot(req("GET", "/search")).await.unwrap();
    assert_eq!(r.status(), 200, "a fail-open rule's route passes");
    let r = overridden.oneshot(req("POST", "/login")).await.unwrap();
    assert_eq!(r.status(), 200, "the route's own policy decides");
}

/// A fake agent on a socket: answers Hello with `version` and each FailModes with the next of
/// `lists` (the last one again once they run out), closing the connection after each list but the
/// last, so the client reconnects and asks again. Says on `asked` which version was asked.
async fn fake_agent(
    socket: std::path::PathBuf,
    version: u8,
    lists: Vec<FailModeList>,
    asked: tokio::sync::mpsc::UnboundedSender<u8>,
) {
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let mut answered = 0;
    loop {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        'conn: loop {
            while let Ok((frame, used)) = floodgate_protocol::decode(&buf) {
                buf.drain(..used);
                let answer = match frame.body {
                    Frame_::Hello { .. } => Frame_::HelloOk { version },
                    Frame_::FailModes => {
                        let _ = asked.send(version);
                        let list = lists[answered.min(lists.len() - 1)].clone();
                        answered += 1;
                        let bytes = Frame::new(frame.request_id, Frame_::FailModeList(list))
                            .to_bytes()
                            .unwrap();
                        let _ = s.write_all(&bytes).await;
                        if answered < lists.len() {
                            break 'conn;
                        }
                        continue;
                    }
                    _ => continue,
                };
                s.write_all(&Frame::new(frame.request_id, answer).to_bytes().unwrap())
                    .await
                    .unwrap();
            }
            if s.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                break;
            }
        }
    }
}

fn list(version: u64, ids: &[&str]) -> FailModeList {
    FailModeList {
        rules_version: version,
        truncated: false,
        rules: ids
            .iter()
            .map(|id| ClosedRule {
                rule_id: (*id).into(),
                dimension: ListedDimension::Ip,
                endpoint: String::new(),
                tier: String::new(),
                limit: 1,
            })
            .collect(),
    }
}

#[tokio::test]
async fn a_new_list_replaces_the_old_and_a_version_1_agent_is_never_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    let socket = dir.path().join("v2.sock");
    tokio::spawn(fake_agent(
        socket.clone(),
        2,
        vec![list(1, &["a", "b"]), list(2, &["c"])],
        tx.clone(),
    ));
    let client = Client::connect(&socket).await;
    assert_eq!(asked.recv().await, Some(2));
    assert_eq!(asked.recv().await, Some(2), "asked again after reconnecting");
    eventually(
        "the second list replaces the first",
        Duration::from_secs(10),
        || {
            let h = client.health();
            async move { (h.rules_version == Some(2) && h.fail_closed_rules == Some(1)).then_some(()) }
        },
    )
    .await;

    let socket = dir.path().join("v1.sock");
    tokio::spawn(fake_agent(socket.clone(), 1, vec![list(1, &["a"])], tx));
    let old = Client::connect(&socket).await;
    // A check round trip through the v1 fake goes unanswered (it answers only Hello); what matters
    // is that after the Hello and a check no FailModes arrived.
    let quick = CallOptions {
        timeout: Some(Duration::from_millis(200)),
        ..Default::default()
    };
    let _ = old
        .check_with(Check::Items(vec![Item::new("k", "a", 1)]), quick)
        .await;
    assert!(old.is_connected());
    while let Ok(v) = asked.try_recv() {
        assert_eq!(v, 2, "a version-1 agent was asked for its list");
    }
    assert_eq!(old.health().fail_closed_rules, None);
}
