//! The native gRPC server against hostile peers: each test is one way a peer could stall the agent
//! or make it hold memory without end (issue 32's findings against the server before its budgets),
//! and what the agent does instead: a GOAWAY naming the fault (ENHANCE_YOUR_CALM for a budget spent,
//! STREAM_CLOSED or PROTOCOL_ERROR for a broken rule), or a stream reset, with a bound on what it
//! held meanwhile. Budgets are in `agent/src/envoy/h2/budget.rs` and docs/envoy.md.
//!
//! Waiting is on events (a frame, the connection's end), each bounded by `PATIENCE`.

use std::time::Duration;

use floodgate_tests::raw_h2::*;
use floodgate_tests::Agent;

const RULES: &str = r#"{"rules":[
  {"id":"edge-ip","dimension":"descriptor","limit":1000000,"windowSeconds":60,
   "envoy":{"domain":"edge","descriptors":[{"key":"remote_address"}]}}]}"#;

/// GOAWAY codes.
const PROTOCOL_ERROR: u32 = 1;
const STREAM_CLOSED: u32 = 5;
const REFUSED_STREAM: u32 = 7;
const CANCEL: u32 = 8;
const ENHANCE_YOUR_CALM: u32 = 11;

async fn agent(frame_timeout_ms: u64) -> Agent {
    Agent::builder()
        .rules(RULES)
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .arg("--frame-timeout-ms")
        .arg(&frame_timeout_ms.to_string())
        .start()
        .await
}

fn request_block() -> Vec<u8> {
    block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PATH),
        (":authority", "agent"),
        ("content-type", "application/grpc"),
    ])
}

/// A header block held open by an empty CONTINUATION every 100 ms is closed once the frame timeout
/// (300 ms) has passed since its HEADERS, while the CONTINUATIONs still come (the server before
/// counted from each CONTINUATION, and kept such a block open as long as they came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_block_is_due_within_the_frame_timeout_of_its_headers() {
    let agent = agent(300).await;
    let mut c = Raw::open(&agent, &[]).await;
    c.frame(HEADERS, 0, 1, &request_block()).await;
    let mut goaway = None;
    for _ in 0..40 {
        c.send(CONTINUATION, 0, 1, &[]).await;
        if let Ok(next) = tokio::time::timeout(Duration::from_millis(100), c.next()).await {
            match next {
                Some(f) if f.kind == GOAWAY => {
                    goaway = Some(u32::from_be_bytes(f.payload[4..8].try_into().unwrap()));
                    break;
                }
                Some(_) => {}
                None => break,
            }
        }
    }
    assert_eq!(
        goaway,
        Some(PROTOCOL_ERROR),
        "a GOAWAY while the CONTINUATIONs still came (4 s of them)"
    );
}

/// A connection whose header block takes 17 CONTINUATIONs: the GOAWAY code it gets.
async fn too_many_continuations(agent: &Agent) -> u32 {
    let mut c = Raw::open(agent, &[]).await;
    c.frame(HEADERS, 0, 1, &request_block()).await;
    for _ in 0..17 {
        c.send(CONTINUATION, 0, 1, &[]).await;
    }
    c.goaway().await
}

/// More CONTINUATIONs than a header block may take end the connection at once, whatever their size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_block_in_too_many_continuations_is_refused() {
    let agent = agent(2_000).await;
    assert_eq!(too_many_continuations(&agent).await, ENHANCE_YOUR_CALM);
}

/// A client that opens streams and resets them (the rapid reset attack) spends its budget and is
/// closed; one that cancels a stream for each call it completes is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_reset_faster_than_calls_are_answered_end_the_connection() {
    let agent = agent(2_000).await;
    let mut c = Raw::open(&agent, &[]).await;
    let mut id = 1;
    for _ in 0..300 {
        c.call(id, "203.0.113.40").await;
        assert_eq!(c.answer(id).await.2, "0");
        c.headers(id + 2, PATH, "application/grpc", false).await;
        c.frame(RST_STREAM, 0, id + 2, &CANCEL.to_be_bytes()).await;
        id += 4;
    }
    c.call(id, "203.0.113.40").await;
    assert_eq!(c.answer(id).await.2, "0", "an honest canceller is still served");
    id += 2;
    for _ in 0..300 {
        if !c.send(HEADERS, END_HEADERS, id, &request_block()).await
            || !c.send(RST_STREAM, 0, id, &CANCEL.to_be_bytes()).await
        {
            break;
        }
        id += 2;
    }
    assert_eq!(c.goaway().await, ENHANCE_YOUR_CALM);
}

/// Frames on a stream that is closed are errors (RFC 9113 §5.1): HEADERS again on an answered
/// stream, HEADERS on a lower stream id never opened, DATA after the client's own RST_STREAM. The
/// server before decoded and dropped them, 200,000 in a row. Frames on a stream the agent reset are
/// ignored, since the client may have sent them before it knew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_on_closed_streams_end_the_connection() {
    let agent = agent(2_000).await;
    let mut c = Raw::open(&agent, &[]).await;
    c.call(1, "203.0.113.41").await;
    assert_eq!(c.answer(1).await.2, "0");
    c.headers(1, PATH, "application/grpc", true).await;
    assert_eq!(c.goaway().await, STREAM_CLOSED, "HEADERS on an answered stream");

    let mut c = Raw::open(&agent, &[]).await;
    c.call(5, "203.0.113.41").await;
    assert_eq!(c.answer(5).await.2, "0");
    c.headers(3, PATH, "application/grpc", true).await;
    assert_eq!(
        c.goaway().await,
        PROTOCOL_ERROR,
        "a stream id lower than one opened"
    );

    let mut c = Raw::open(&agent, &[]).await;
    c.headers(1, PATH, "application/grpc", false).await;
    c.frame(RST_STREAM, 0, 1, &CANCEL.to_be_bytes()).await;
    c.frame(DATA, END_STREAM, 1, &grpc_message(&request("a"))).await;
    assert_eq!(c.goaway().await, STREAM_CLOSED, "DATA after the client's reset");

    let mut c = Raw::open(&agent, &[]).await;
    c.headers(1, PATH, "application/grpc", false).await;
    // A message declared past 16 KiB: answered, and the stream reset by the agent.
    c.frame(DATA, 0, 1, &[0, 0, 1, 0, 0]).await;
    assert_eq!(c.answer(1).await.2, "8");
    c.frame(DATA, END_STREAM, 1, b"the rest").await;
    c.call(3, "203.0.113.41").await;
    assert_eq!(c.answer(3).await.2, "0", "the connection goes on");
}

/// A client that grants no window (SETTINGS_INITIAL_WINDOW_SIZE 0) and keeps asking: its answers
/// wait up to the parked budget (32 streams or 64 KiB), later streams are refused before any work
/// (REFUSED_STREAM) or their answers dropped (ENHANCE_YOUR_CALM), and when that has spent its
/// budget the connection ends. The server before parked all 1,000 answers, with no deadline, and
/// 100 such connections took 345 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_grants_no_window_parks_a_bounded_amount_then_is_closed() {
    let agent = agent(30_000).await;
    let mut c = Raw::open(&agent, &[(4, 0)]).await;
    for i in 0..1_000u32 {
        if !c.send(HEADERS, END_HEADERS, 2 * i + 1, &request_block()).await
            || !c
                .send(
                    DATA,
                    END_STREAM,
                    2 * i + 1,
                    &grpc_message(&request("203.0.113.42")),
                )
                .await
        {
            break;
        }
    }
    let (mut parked, mut calmed) = (0, 0);
    let code = loop {
        let f = c.next().await.expect("a GOAWAY before the close");
        match f.kind {
            HEADERS => parked += 1,
            RST_STREAM => {
                let code = u32::from_be_bytes(f.payload[..4].try_into().unwrap());
                assert!([REFUSED_STREAM, ENHANCE_YOUR_CALM].contains(&code), "{code}");
                calmed += 1;
            }
            DATA => panic!("DATA without window: {f:?}"),
            GOAWAY => break u32::from_be_bytes(f.payload[4..8].try_into().unwrap()),
            _ => {}
        }
    };
    assert_eq!(code, ENHANCE_YOUR_CALM);
    assert!(parked <= 32, "{parked} answers parked");
    assert!(calmed >= 1, "answers past the budget are reset");
}

/// An answer that finds no window is dropped when the frame timeout passes (CANCEL), and the
/// connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_parked_past_the_frame_timeout_is_dropped() {
    let agent = agent(300).await;
    let mut c = Raw::open(&agent, &[(4, 0)]).await;
    c.call(1, "203.0.113.43").await;
    let rst = c.next_on(1, RST_STREAM).await;
    assert_eq!(u32::from_be_bytes(rst.payload[..4].try_into().unwrap()), CANCEL);
    c.call(3, "203.0.113.43").await;
    c.frame(WINDOW_UPDATE, 0, 3, &10_000u32.to_be_bytes()).await;
    assert_eq!(c.answer(3).await.2, "0");
}

/// SETTINGS frames each cost a unit of the budget (a change of the initial window is a pass over the
/// streams): a flood of them, here each with 2,730 entries over 256 parked answers, ends in
/// ENHANCE_YOUR_CALM. Before, each such frame took the worker 46 ms and none ended the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settings_flood_ends_the_connection() {
    let agent = agent(30_000).await;
    let mut c = Raw::open(&agent, &[(4, 0)]).await;
    for i in 0..256u32 {
        c.call(2 * i + 1, "203.0.113.44").await;
    }
    let mut entries = Vec::new();
    for i in 0..2_730u32 {
        entries.extend_from_slice(&4u16.to_be_bytes());
        entries.extend_from_slice(&(i % 2).to_be_bytes());
    }
    for _ in 0..250 {
        if !c.send(SETTINGS, 0, 0, &entries).await {
            break;
        }
    }
    assert_eq!(c.goaway().await, ENHANCE_YOUR_CALM);
}

/// Forty connections that grant no window and send 1,000 calls each: the agent's peak memory grows
/// by what the parked budgets allow (64 KiB and 32 streams a connection), not by every answer. All
/// forty are open before any spends its budget (after that, the address is refused for a while).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_window_connections_hold_bounded_memory() {
    let agent = agent(30_000).await;
    let pid = agent.pid().expect("the agent runs");
    let before = peak_rss_kib(pid);
    let mut conns = Vec::new();
    for _ in 0..40u32 {
        conns.push(Raw::open(&agent, &[(4, 0)]).await);
    }
    let mut tasks = Vec::new();
    for (conn, mut c) in conns.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            for i in 0..1_000u32 {
                let address = format!("198.51.100.{conn}");
                if !c.send(HEADERS, END_HEADERS, 2 * i + 1, &request_block()).await
                    || !c
                        .send(DATA, END_STREAM, 2 * i + 1, &grpc_message(&request(&address)))
                        .await
                {
                    break;
                }
            }
            c.goaway().await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), ENHANCE_YOUR_CALM);
    }
    let grown = peak_rss_kib(pid).saturating_sub(before);
    assert!(grown < 40 * 1024, "peak RSS grew {grown} KiB for 40 connections");
}

/// The process's peak resident memory (VmHWM), KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap()
}

/// A connection that answers PINGs but makes no call is idle: past `--idle-timeout-ms` it gets
/// GOAWAY NO_ERROR and is closed, and its slot of the cap goes back (Envoy reconnects when it has a
/// call). Before, such a connection was held for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_grpc_connection_is_closed() {
    let agent = Agent::builder()
        .rules(RULES)
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .arg("--idle-timeout-ms")
        .arg("500")
        .start()
        .await;
    let mut c = Raw::open(&agent, &[]).await;
    c.call(1, "203.0.113.45").await;
    assert_eq!(c.answer(1).await.2, "0");
    assert_eq!(c.goaway().await, 0, "NO_ERROR");
}

/// A peer whose connection spent a budget is refused for a while (1 s, doubling with each repeat):
/// reconnecting at once does not buy a new budget. Its next connection is closed without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_spent_a_budget_is_refused_for_a_while() {
    let agent = agent(2_000).await;
    assert_eq!(too_many_continuations(&agent).await, ENHANCE_YOUR_CALM);
    // The penalty is recorded as the GOAWAY is decided: the next connection is closed at once.
    let mut again = Raw::connect(&agent).await;
    again.send(DATA, 0, 0, b"").await;
    assert!(
        again.next().await.is_none(),
        "closed at once, no SETTINGS, no GOAWAY"
    );
}
