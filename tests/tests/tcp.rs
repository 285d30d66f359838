//! The frames protocol over TCP (`--listen-tcp`) and the agent's connection cap, against a real agent.

use floodgate_protocol::{Body, Check, ErrorCode, Frame, Item, MAX_FRAME};
use floodgate_tests::{Agent, RawConn};

const RULES: &str = r#"{"rules":[{"id":"api","dimension":"user","limit":3,"windowSeconds":60}]}"#;

async fn tcp_agent(extra: &[&str]) -> (Agent, std::net::SocketAddr) {
    let mut b = Agent::builder()
        .rules(RULES)
        .arg("--listen-tcp")
        .arg("127.0.0.1:0");
    for a in extra {
        b = b.arg(a);
    }
    let agent = b.start().await;
    let addr = agent.logged_addr("frames protocol on TCP").await;
    (agent, addr)
}

fn check(id: u32, key: &str) -> Frame {
    Frame::new(id, Body::Check(Check::Items(vec![Item::new(key, "api", 1)])))
}

/// A one-minute window: the four checks take milliseconds of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_over_tcp_shares_counts_with_the_socket() {
    let (agent, addr) = tcp_agent(&[]).await;
    let uds = floodgate_tests::patient_client(agent.socket()).await;
    let tcp = floodgate_tests::patient_client(std::path::Path::new(&format!("tcp://{addr}"))).await;
    assert!(uds.allow("user:1", "api", 1).await.unwrap().allowed);
    assert!(uds.allow("user:1", "api", 1).await.unwrap().allowed);
    let d = tcp.allow("user:1", "api", 1).await.unwrap();
    assert!(d.allowed && d.from_agent_answer(), "{d:?}");
    assert_eq!(d.remaining, 0);
    let d = tcp.allow("user:1", "api", 1).await.unwrap();
    assert!(!d.allowed && d.from_agent_answer(), "{d:?}");
    assert!(d.retry_after_ms.unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_over_tcp_gets_the_same_errors() {
    let (_agent, addr) = tcp_agent(&[]).await;
    // An unknown rule: an Error for that request, and the connection goes on.
    let mut c = RawConn::connect_tcp(addr).await.unwrap();
    c.send(&Frame::new(
        1,
        Body::Check(Check::Items(vec![Item::new("user:1", "nope", 1)])),
    ))
    .await
    .unwrap();
    match c.recv().await.unwrap().body {
        Body::Error(e) => assert_eq!(e.code, ErrorCode::UnknownRule),
        other => panic!("{other:?}"),
    }
    c.send(&check(2, "user:2")).await.unwrap();
    assert!(matches!(c.recv().await.unwrap().body, Body::Decision(_)));
    // A length prefix past the limit: error 2 before any body is read, then the agent closes.
    let mut c = RawConn::connect_tcp(addr).await.unwrap();
    c.send_bytes(&((MAX_FRAME as u32) * 2).to_be_bytes())
        .await
        .unwrap();
    match c.recv().await.unwrap().body {
        Body::Error(e) => assert_eq!(e.code, ErrorCode::FrameTooLarge),
        other => panic!("{other:?}"),
    }
    assert!(c.recv().await.is_none(), "closed after a fatal error");
    // Garbage: error 1, closed.
    let mut c = RawConn::connect_tcp(addr).await.unwrap();
    c.send_bytes(&[0, 0, 0, 6, 1, 0xEE, 0, 0, 0, 9]).await.unwrap();
    match c.recv().await.unwrap().body {
        Body::Error(e) => assert_eq!(e.code, ErrorCode::MalformedFrame),
        other => panic!("{other:?}"),
    }
    assert!(c.recv().await.is_none());
}

/// A connection the agent serves (a Check answered), retried while the listener's slots are still
/// held by `wait_ready`'s probe connections closing.
async fn served(
    connect: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<RawConn>> + Send>>,
) -> RawConn {
    floodgate_tests::eventually("a served connection", std::time::Duration::from_secs(5), || {
        let c = connect();
        async move {
            let mut c = c.await.ok()?;
            c.send(&check(1, "user:s")).await.ok()?;
            matches!(c.recv().await?.body, Body::Decision(_)).then_some(c)
        }
    })
    .await
}

fn refused_count(metrics: &str, listener: &str) -> u64 {
    let series = format!("floodgate_connections_refused_total{{listener=\"{listener}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Each listener has a cap of its own (here 1): past it a client is told why and closed, and the
/// other listener's clients are not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_a_client_is_told_and_closed() {
    let (agent, addr) = tcp_agent(&["--max-connections", "1"]).await;
    let socket = agent.socket().to_path_buf();
    let admin = agent.admin_addr().await;
    let mut a = served(|| {
        let s = socket.clone();
        Box::pin(async move { RawConn::connect(&s).await })
    })
    .await;
    let b = served(|| Box::pin(RawConn::connect_tcp(addr))).await;
    let (_, before) = floodgate_tests::http_get(admin, "/metrics").await;
    for refused in [RawConn::connect_tcp(addr).await, RawConn::connect(&socket).await] {
        let mut c = refused.unwrap();
        match c.recv().await.expect("an Error before the close").body {
            Body::Error(e) => {
                assert_eq!(e.code, ErrorCode::Overloaded);
                assert!(e.message.contains("maximum of 1 connections"), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
        assert!(c.recv().await.is_none(), "then closed");
    }
    let (_, after) = floodgate_tests::http_get(admin, "/metrics").await;
    for listener in ["tcp", "unix"] {
        assert_eq!(
            refused_count(&after, listener),
            refused_count(&before, listener) + 1,
            "{listener}: {after}"
        );
    }
    // The served connection is untouched; once the TCP one closes, its slot is free again.
    a.send(&check(2, "user:a")).await.unwrap();
    assert!(matches!(a.recv().await.unwrap().body, Body::Decision(_)));
    drop(b);
    served(|| Box::pin(RawConn::connect_tcp(addr))).await;
}
