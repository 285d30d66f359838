//! The agent's own HTTP/2 server (`--grpc-server native`, the default) against a raw client that
//! writes frames by hand: what a well-behaved request gets, and what garbage, half-sent frames,
//! requests that never end, a client that grants no window, too many streams and a stopping agent
//! get. A hostile connection gets a GOAWAY naming its fault and is closed, or a stream its own
//! RST_STREAM or gRPC status; nothing it does takes an answer from another stream.
//!
//! Waiting is on events (a frame, the connection's end), each bounded by `PATIENCE`.

use std::time::Duration;

use floodgate_agent::envoy::proto::{Code, RateLimitResponse};
use floodgate_tests::raw_h2::*;
use floodgate_tests::Agent;
use prost::Message;

const RULES: &str = r#"{"rules":[
  {"id":"edge-ip","dimension":"descriptor","limit":1000,"windowSeconds":60,
   "envoy":{"domain":"edge","descriptors":[{"key":"remote_address"}]}}]}"#;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_client_is_answered_and_its_pings_come_back() {
    let agent = agent(2_000).await;
    let mut c = Raw::open(&agent, &[]).await;
    // The server's preface: its settings (streams capped), the connection window raised.
    let settings = c.next().await.unwrap();
    assert_eq!((settings.kind, settings.flags), (SETTINGS, 0));
    let max_streams = settings
        .payload
        .chunks(6)
        .find(|s| s[..2] == [0, 3])
        .map(|s| u32::from_be_bytes(s[2..].try_into().unwrap()));
    assert_eq!(max_streams, Some(1_024));
    c.call(1, "203.0.113.5").await;
    c.call(3, "203.0.113.5").await;
    for (stream, remaining) in [(1, 999), (3, 998)] {
        let (fields, message, status) = c.answer(stream).await;
        assert_eq!(status, "0");
        assert_eq!(field(&fields, ":status").as_deref(), Some("200"));
        assert_eq!(
            field(&fields, "content-type").as_deref(),
            Some("application/grpc")
        );
        let m = message.unwrap();
        assert_eq!(m.overall_code, Code::Ok as i32);
        assert_eq!(m.statuses[0].limit_remaining, remaining);
    }
    c.frame(PING, 0, 0, b"12345678").await;
    loop {
        let f = c.next().await.unwrap();
        if f.kind == PING {
            assert_eq!(
                (f.flags, &f.payload[..]),
                (1, &b"12345678"[..]),
                "a PING ACK, payload echoed"
            );
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_half_sent_frames_end_the_connection_with_goaway() {
    let agent = agent(300).await;
    // Not HTTP/2 at all.
    let mut c = Raw::connect(&agent).await;
    c.write(b"GET / HTTP/1.1\r\nHost: agent\r\n\r\n").await;
    assert_eq!(c.goaway().await, 1, "PROTOCOL_ERROR");
    // Nothing sent: closed when the frame timeout passes.
    let mut c = Raw::connect(&agent).await;
    assert_eq!(c.goaway().await, 1);
    // Half a frame.
    let mut c = Raw::open(&agent, &[]).await;
    c.write(&[0, 0, 50, HEADERS, END_HEADERS, 0, 0, 0, 1, 0x00]).await;
    assert_eq!(c.goaway().await, 1);
    // A frame past 16 KiB.
    let mut c = Raw::open(&agent, &[]).await;
    c.write(&[0, 0x40, 1, DATA, 0, 0, 0, 0, 1]).await;
    assert_eq!(c.goaway().await, 6, "FRAME_SIZE_ERROR");
    // A header block naming a dynamic table entry that does not exist.
    let mut c = Raw::open(&agent, &[]).await;
    c.frame(HEADERS, END_HEADERS | END_STREAM, 1, &[0xc6]).await;
    assert_eq!(c.goaway().await, 9, "COMPRESSION_ERROR");
    // DATA on a stream never opened.
    let mut c = Raw::open(&agent, &[]).await;
    c.frame(DATA, END_STREAM, 7, b"x").await;
    assert_eq!(c.goaway().await, 1);
    // The agent still answers a well-behaved client.
    let mut c = Raw::open(&agent, &[]).await;
    c.call(1, "203.0.113.9").await;
    assert_eq!(c.answer(1).await.2, "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_get_a_status_and_the_connection_goes_on() {
    let agent = agent(2_000).await;
    let mut c = Raw::open(&agent, &[]).await;
    // Another method.
    c.headers(
        1,
        "/envoy.service.ratelimit.v3.RateLimitService/Other",
        "application/grpc",
        false,
    )
    .await;
    c.frame(DATA, END_STREAM, 1, &grpc_message(&request("a"))).await;
    assert_eq!(c.answer(1).await.2, "12", "UNIMPLEMENTED");
    // A compressed message.
    let mut compressed = grpc_message(&request("a"));
    compressed[0] = 1;
    c.headers(3, PATH, "application/grpc", false).await;
    c.frame(DATA, END_STREAM, 3, &compressed).await;
    assert_eq!(c.answer(3).await.2, "12");
    // A message declared past 16 KiB: refused before its body arrives, and the stream reset.
    c.headers(5, PATH, "application/grpc", false).await;
    c.frame(DATA, 0, 5, &[0, 0, 1, 0, 0]).await;
    let (fields, _, status) = c.answer(5).await;
    assert_eq!(status, "8", "RESOURCE_EXHAUSTED: {fields:?}");
    assert!(field(&fields, "grpc-message").unwrap().contains("16384"));
    assert_eq!(c.next_on(5, RST_STREAM).await.payload, [0, 0, 0, 0]);
    // A body that is not its prefix's length.
    c.headers(7, PATH, "application/grpc", false).await;
    c.frame(DATA, END_STREAM, 7, &[0, 0, 0, 0, 9, 1]).await;
    assert_eq!(c.answer(7).await.2, "13", "INTERNAL");
    // Not a protobuf RateLimitRequest.
    c.headers(9, PATH, "application/grpc", false).await;
    c.frame(DATA, END_STREAM, 9, &[0, 0, 0, 0, 2, 0xff, 0xff]).await;
    assert_eq!(c.answer(9).await.2, "13");
    // An empty domain: the service's own refusal.
    c.headers(11, PATH, "application/grpc", false).await;
    let mut bad = request("a");
    bad.domain.clear();
    c.frame(DATA, END_STREAM, 11, &grpc_message(&bad)).await;
    let (fields, _, status) = c.answer(11).await;
    assert_eq!(status, "3", "INVALID_ARGUMENT");
    assert!(field(&fields, "grpc-message").unwrap().contains("domain"));
    // Not gRPC.
    c.headers(13, PATH, "application/json", true).await;
    let head = c.next_on(13, HEADERS).await;
    assert_eq!(decode_block(&head.payload), [(":status".into(), "415".into())]);
    // The connection still answers.
    c.call(15, "203.0.113.7").await;
    let (_, m, status) = c.answer(15).await;
    assert_eq!(
        (status.as_str(), m.unwrap().statuses[0].limit_remaining),
        ("0", 999)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_never_ends_is_reset_and_others_are_answered() {
    let agent = agent(300).await;
    let mut c = Raw::open(&agent, &[]).await;
    c.headers(1, PATH, "application/grpc", false).await;
    c.frame(DATA, 0, 1, &grpc_message(&request("a"))[..4]).await;
    // Another stream meanwhile is answered at once.
    c.call(3, "203.0.113.8").await;
    assert_eq!(c.answer(3).await.2, "0");
    // The first is reset once the frame timeout passes (CANCEL), the connection kept.
    let rst = c.next_on(1, RST_STREAM).await;
    assert_eq!(rst.payload, [0, 0, 0, 8]);
    c.call(5, "203.0.113.8").await;
    assert_eq!(c.answer(5).await.2, "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_waits_for_window_and_is_sent_as_it_comes() {
    let agent = agent(2_000).await;
    // No window for any stream.
    let mut c = Raw::open(&agent, &[(4, 0)]).await;
    c.call(1, "203.0.113.10").await;
    let head = c.next_on(1, HEADERS).await;
    assert_eq!(head.flags & END_STREAM, 0);
    // A stream given window is answered whole while stream 1 still waits for its own.
    c.call(3, "203.0.113.10").await;
    c.frame(WINDOW_UPDATE, 0, 3, &10_000u32.to_be_bytes()).await;
    let (_, m, status) = c.answer(3).await;
    assert_eq!(
        (status.as_str(), m.unwrap().statuses[0].limit_remaining),
        ("0", 998)
    );
    // A PING after the request is answered while the DATA is held back.
    c.frame(PING, 0, 0, b"window?!").await;
    loop {
        let f = c.next().await.unwrap();
        assert!(f.kind != DATA, "no DATA without window: {f:?}");
        if f.kind == PING {
            break;
        }
    }
    // Ten bytes of window: ten bytes of DATA.
    c.frame(WINDOW_UPDATE, 0, 1, &10u32.to_be_bytes()).await;
    let first = c.next_on(1, DATA).await;
    assert_eq!(first.payload.len(), 10);
    // The rest, then the trailers.
    c.frame(WINDOW_UPDATE, 0, 1, &10_000u32.to_be_bytes()).await;
    let mut body = first.payload;
    let trailers = loop {
        let f = c.next().await.unwrap();
        match (f.stream, f.kind) {
            (1, DATA) => body.extend_from_slice(&f.payload),
            (1, HEADERS) => break f,
            _ => {}
        }
    };
    assert_eq!(
        field(&decode_block(&trailers.payload), "grpc-status").as_deref(),
        Some("0")
    );
    let m = RateLimitResponse::decode(&body[5..]).unwrap();
    assert_eq!(m.statuses[0].limit_remaining, 999);
}

/// A busy connection's reads end mid-frame again and again; as long as frames complete, that is
/// progress, not a half-sent frame (a 300 ms frame timeout, 1.5 s of such writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_that_end_mid_frame_while_frames_complete_keep_the_connection() {
    let agent = agent(300).await;
    let mut c = Raw::open(&agent, &[]).await;
    // 150 calls' frames, written 5 ms apart, each write ending in the middle of a frame.
    let mut bytes = Vec::new();
    let mut cuts = Vec::new();
    for i in 0..150u32 {
        let block = block(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", PATH),
            (":authority", "agent"),
            ("content-type", "application/grpc"),
        ]);
        let data = grpc_message(&request("203.0.113.20"));
        for (kind, flags, payload) in [(HEADERS, END_HEADERS, &block), (DATA, END_STREAM, &data)] {
            let len = payload.len() as u32;
            cuts.push(bytes.len() + 9 + payload.len() / 2);
            bytes.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
            bytes.extend_from_slice(&(2 * i + 1).to_be_bytes());
            bytes.extend_from_slice(payload);
        }
    }
    cuts.push(bytes.len());
    let mut from = 0;
    for to in cuts {
        c.write(&bytes[from..to]).await;
        from = to;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for i in 0..150u32 {
        assert_eq!(c.answer(2 * i + 1).await.2, "0", "call {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_cap_are_refused() {
    let agent = agent(30_000).await;
    let mut c = Raw::open(&agent, &[]).await;
    // 1,024 requests whose bodies never come, then one more.
    for i in 0..1_025u32 {
        c.headers(2 * i + 1, PATH, "application/grpc", false).await;
    }
    let refused = c.next_on(2 * 1_024 + 1, RST_STREAM).await;
    assert_eq!(refused.payload, [0, 0, 0, 7], "REFUSED_STREAM");
    // A held stream completes and is answered.
    c.frame(DATA, END_STREAM, 1, &grpc_message(&request("203.0.113.11")))
        .await;
    assert_eq!(c.answer(1).await.2, "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_agent_says_goaway_and_exits() {
    let mut agent = agent(2_000).await;
    let mut c = Raw::open(&agent, &[]).await;
    c.call(1, "203.0.113.12").await;
    assert_eq!(c.answer(1).await.2, "0");
    let exit = tokio::spawn(async move { agent.terminate_within(PATIENCE).await });
    assert_eq!(c.goaway().await, 0, "NO_ERROR");
    assert_eq!(exit.await.unwrap(), Some(0));
}
