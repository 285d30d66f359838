//! Bad input against a real agent: malformed and oversize frames get an Error and the connection is
//! closed; refused items get an Error and the connection goes on; other clients are served throughout.

use floodgate_protocol::{Body, Check, ErrorCode, Frame, Item};
use floodgate_tests::{Agent, RawConn};

fn check(id: u32, key: &str) -> Frame {
    Frame::new(
        id,
        Body::Check(Check::Items(vec![Item::new(key, "api-per-user", 1)])),
    )
}

fn error_code(frame: &Frame) -> ErrorCode {
    match &frame.body {
        Body::Error(e) => e.code,
        other => panic!("expected an Error frame, got {other:?}"),
    }
}

#[tokio::test]
async fn broken_frames_close_the_connection_and_spare_the_others() {
    let agent = Agent::builder().start().await;
    let mut bystander = RawConn::connect(agent.socket()).await.unwrap();

    // Unknown frame kind 0x7f: the stream can no longer be trusted.
    let mut bad = RawConn::connect(agent.socket()).await.unwrap();
    bad.send_bytes(&[0, 0, 0, 6, 1, 0x7f, 0, 0, 0, 9]).await.unwrap();
    let e = bad.recv().await.expect("an Error before the close");
    assert_eq!(error_code(&e), ErrorCode::MalformedFrame);
    assert!(
        bad.recv().await.is_none(),
        "connection closed after a malformed frame"
    );

    // A length prefix of 1 MiB: refused before reading the body.
    let mut big = RawConn::connect(agent.socket()).await.unwrap();
    big.send_bytes(&(1u32 << 20).to_be_bytes()).await.unwrap();
    let e = big.recv().await.expect("an Error before the close");
    assert_eq!(error_code(&e), ErrorCode::FrameTooLarge);
    assert!(
        big.recv().await.is_none(),
        "connection closed after an oversize frame"
    );

    // A length shorter than the header.
    let mut short = RawConn::connect(agent.socket()).await.unwrap();
    short.send_bytes(&[0, 0, 0, 2, 1, 3]).await.unwrap();
    assert_eq!(
        error_code(&short.recv().await.unwrap()),
        ErrorCode::MalformedFrame
    );
    assert!(short.recv().await.is_none());

    // The bystander was served all along.
    bystander.send(&check(1, "user:ok")).await.unwrap();
    let answer = bystander.recv().await.unwrap();
    assert!(
        matches!(answer.body, Body::Decision(ref d) if d.combined.allowed),
        "{answer:?}"
    );
}

#[tokio::test]
async fn refused_items_get_an_error_and_the_connection_goes_on() {
    let agent = Agent::builder().start().await;
    let mut conn = RawConn::connect(agent.socket()).await.unwrap();

    // Frames hand-made so that they break the limits the SDK would refuse to encode.
    let mut smuggled = Vec::new();
    let key = b"{victim}";
    let rule = b"api-per-user";
    smuggled.extend_from_slice(&[1, 3, 0, 0, 0, 5, 0, 1]);
    smuggled.extend_from_slice(&(key.len() as u16).to_be_bytes());
    smuggled.extend_from_slice(key);
    smuggled.push(rule.len() as u8);
    smuggled.extend_from_slice(rule);
    smuggled.extend_from_slice(&1u32.to_be_bytes());
    let mut framed = (smuggled.len() as u32).to_be_bytes().to_vec();
    framed.extend_from_slice(&smuggled);
    conn.send_bytes(&framed).await.unwrap();
    let e = conn.recv().await.unwrap();
    assert_eq!(e.request_id, 5);
    assert_eq!(error_code(&e), ErrorCode::InvalidItem);

    // Cost 0: same frame shape, last four bytes zero.
    let mut zero = framed.clone();
    let n = zero.len();
    zero[n - 4..].copy_from_slice(&0u32.to_be_bytes());
    zero[14..22].copy_from_slice(b"user:abc"); // a valid key of the same length
    conn.send_bytes(&zero).await.unwrap();
    assert_eq!(error_code(&conn.recv().await.unwrap()), ErrorCode::InvalidItem);

    // An unknown rule names itself.
    conn.send(&Frame::new(
        6,
        Body::Check(Check::Items(vec![Item::new("user:1", "nope", 1)])),
    ))
    .await
    .unwrap();
    match conn.recv().await.unwrap().body {
        Body::Error(e) => {
            assert_eq!(e.code, ErrorCode::UnknownRule);
            assert!(e.message.contains("nope"));
        }
        other => panic!("{other:?}"),
    }

    // A frame only an agent may send.
    conn.send(&Frame::new(7, Body::Pong)).await.unwrap();
    assert_eq!(
        error_code(&conn.recv().await.unwrap()),
        ErrorCode::UnexpectedFrame
    );

    // Still open: pipelined checks all get their own answers.
    for id in 10..20 {
        conn.send(&check(id, "user:pipelined")).await.unwrap();
    }
    let mut ids = Vec::new();
    for _ in 10..20 {
        let f = conn.recv().await.unwrap();
        assert!(matches!(f.body, Body::Decision(_)));
        ids.push(f.request_id);
    }
    ids.sort_unstable();
    assert_eq!(ids, (10..20).collect::<Vec<_>>());
}

#[tokio::test]
async fn hello_negotiates_or_refuses() {
    let agent = Agent::builder().start().await;
    let mut conn = RawConn::connect(agent.socket()).await.unwrap();
    conn.send(&Frame::new(
        0,
        Body::Hello {
            min_version: 1,
            max_version: 9,
        },
    ))
    .await
    .unwrap();
    assert_eq!(
        conn.recv().await.unwrap().body,
        Body::HelloOk {
            version: floodgate_protocol::VERSION
        },
        "the highest version both speak"
    );
    conn.send(&Frame::new(1, Body::Ping)).await.unwrap();
    assert_eq!(conn.recv().await.unwrap(), Frame::new(1, Body::Pong));
    conn.send(&Frame::new(
        2,
        Body::Hello {
            min_version: floodgate_protocol::VERSION + 1,
            max_version: 9,
        },
    ))
    .await
    .unwrap();
    assert_eq!(
        error_code(&conn.recv().await.unwrap()),
        ErrorCode::UnsupportedVersion
    );
}

/// A client that never lets its socket run dry (checks written as fast as the agent reads them) is
/// answered and closed on SIGTERM, and the agent exits cleanly without leaving the connection to
/// its 2 s drain deadline. The connection loop polls its shutdown wait after reads, so it also
/// looks at the shutdown watch at the top of every turn; without that look this client's
/// connection ended only by the agent's 1 s write timeout (the test took 1.9 s instead of 0.1 s
/// here, a difference this test does not assert: no timing thresholds in tests).
#[tokio::test]
async fn a_client_that_never_stops_sending_is_closed_on_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut agent = Agent::builder().start().await;
    let (mut rd, mut wr) = tokio::net::UnixStream::connect(agent.socket())
        .await
        .unwrap()
        .into_split();
    let mut burst = Vec::new();
    // Bursts of ~100 KB: the agent's socket buffer never empties while the writer runs.
    for id in 1..=4096 {
        burst.extend_from_slice(&check(id, "user:busy").to_bytes().unwrap());
    }
    let writer = tokio::spawn(async move { while wr.write_all(&burst).await.is_ok() {} });
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0usize;
        while let Ok(n @ 1..) = rd.read(&mut buf).await {
            got += n;
        }
        got
    });
    // The agent is busy with this client's checks before it is told to stop.
    let mut probe = RawConn::connect(agent.socket()).await.unwrap();
    probe.send(&check(1, "user:probe")).await.unwrap();
    assert!(probe.recv().await.is_some());
    assert_eq!(agent.terminate().await, Some(0), "SIGTERM is a clean exit");
    let answered = reader.await.unwrap();
    assert!(answered > 0, "the busy client was answered before the close");
    writer.await.unwrap();
    assert!(
        !agent.log().contains("still open after 2 s"),
        "the busy connection was closed by shutdown, not left to the drain's deadline:\n{}",
        agent.log()
    );
}
