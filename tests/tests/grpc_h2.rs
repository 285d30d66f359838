//! The agent's own HTTP/2 server (`--grpc-server native`, the default) against a raw client that
//! writes frames by hand: what a well-behaved request gets, and what garbage, half-sent frames,
//! requests that never end, a client that grants no window, too many streams and a stopping agent
//! get. A hostile connection gets a GOAWAY naming its fault and is closed, or a stream its own
//! RST_STREAM or gRPC status; nothing it does takes an answer from another stream.
//!
//! Waiting is on events (a frame, the connection's end), each bounded by `PATIENCE`.

use std::time::Duration;

use floodgate_agent::envoy::proto::{Code, Entry, RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use floodgate_tests::Agent;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const RULES: &str = r#"{"rules":[
  {"id":"edge-ip","dimension":"descriptor","limit":1000,"windowSeconds":60,
   "envoy":{"domain":"edge","descriptors":[{"key":"remote_address"}]}}]}"#;

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const PATIENCE: Duration = Duration::from_secs(10);

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const END_STREAM: u8 = 1;
const END_HEADERS: u8 = 4;

#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// A client writing frames by hand; header blocks are literals without indexing and without
/// Huffman coding, so it keeps no HPACK state.
struct Raw {
    io: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    async fn connect(agent: &Agent) -> Raw {
        let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
        Raw {
            io: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    /// The preface, with these settings.
    async fn open(agent: &Agent, settings: &[(u16, u32)]) -> Raw {
        let mut raw = Raw::connect(agent).await;
        raw.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        let payload: Vec<u8> = settings
            .iter()
            .flat_map(|(id, v)| id.to_be_bytes().into_iter().chain(v.to_be_bytes()))
            .collect();
        raw.frame(SETTINGS, 0, 0, &payload).await;
        raw
    }

    async fn write(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.unwrap();
    }

    async fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        self.write(&f).await;
    }

    /// HEADERS of a gRPC request to `path`.
    async fn headers(&mut self, stream: u32, path: &str, content_type: &str, end_stream: bool) {
        let block = block(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "agent"),
            ("content-type", content_type),
            ("te", "trailers"),
        ]);
        let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
        self.frame(HEADERS, flags, stream, &block).await;
    }

    /// A whole ShouldRateLimit call on `stream` for one address.
    async fn call(&mut self, stream: u32, address: &str) {
        self.headers(stream, PATH, "application/grpc", false).await;
        self.frame(DATA, END_STREAM, stream, &grpc_message(&request(address)))
            .await;
    }

    /// The next frame, or None when the connection ended.
    async fn next(&mut self) -> Option<Frame> {
        tokio::time::timeout(PATIENCE, async {
            loop {
                if self.buf.len() >= 9 {
                    let len = (usize::from(self.buf[0]) << 16)
                        | (usize::from(self.buf[1]) << 8)
                        | usize::from(self.buf[2]);
                    if self.buf.len() >= 9 + len {
                        let f = Frame {
                            kind: self.buf[3],
                            flags: self.buf[4],
                            stream: u32::from_be_bytes([self.buf[5], self.buf[6], self.buf[7], self.buf[8]])
                                & 0x7fff_ffff,
                            payload: self.buf[9..9 + len].to_vec(),
                        };
                        self.buf.drain(..9 + len);
                        return Some(f);
                    }
                }
                let mut chunk = [0u8; 16 * 1024];
                match self.io.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
        .expect("the agent answers or closes within the patience")
    }

    /// The next frame of `kind` on `stream`, skipping connection chatter (SETTINGS, WINDOW_UPDATE,
    /// PING) and other streams' frames.
    async fn next_on(&mut self, stream: u32, kind: u8) -> Frame {
        loop {
            let f = self.next().await.expect("the connection stays open");
            if f.stream == stream && f.kind == kind {
                return f;
            }
            assert!(
                f.stream != stream || matches!(f.kind, HEADERS | DATA),
                "stream {stream}: unexpected {f:?}"
            );
        }
    }

    /// The GOAWAY that ends the connection: its error code; then the connection closes.
    async fn goaway(&mut self) -> u32 {
        let code = loop {
            let f = self.next().await.expect("a GOAWAY before the close");
            if f.kind == GOAWAY {
                break u32::from_be_bytes(f.payload[4..8].try_into().unwrap());
            }
        };
        while let Some(f) = self.next().await {
            assert_ne!(f.kind, HEADERS, "no answer after GOAWAY: {f:?}");
        }
        code
    }

    /// The full answer on `stream`: its response headers' fields, its message (if any), and the
    /// gRPC status.
    async fn answer(&mut self, stream: u32) -> (Vec<(String, String)>, Option<RateLimitResponse>, String) {
        let head = self.next_on(stream, HEADERS).await;
        let mut fields = decode_block(&head.payload);
        if head.flags & END_STREAM != 0 {
            let status = field(&fields, "grpc-status").unwrap_or_default();
            return (fields, None, status);
        }
        let mut body = Vec::new();
        let trailers = loop {
            let f = self.next().await.expect("the answer completes");
            match (f.stream == stream, f.kind) {
                (true, DATA) => body.extend_from_slice(&f.payload),
                (true, HEADERS) => break f,
                (true, RST_STREAM) => panic!("stream {stream} reset mid-answer"),
                _ => {}
            }
        };
        assert_ne!(trailers.flags & END_STREAM, 0, "trailers end the stream");
        let trailer_fields = decode_block(&trailers.payload);
        let status = field(&trailer_fields, "grpc-status").unwrap_or_default();
        fields.extend(trailer_fields);
        assert_eq!(body[0], 0, "uncompressed");
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        assert_eq!(body.len(), 5 + len);
        let message = RateLimitResponse::decode(&body[5..]).unwrap();
        (fields, Some(message), status)
    }
}

fn request(address: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "remote_address".into(),
                value: address.into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

fn grpc_message(m: &RateLimitRequest) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// A header block of literals without indexing, new names, no Huffman (lengths under 127).
fn block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (n, v) in fields {
        out.push(0x00);
        out.push(n.len() as u8);
        out.extend_from_slice(n.as_bytes());
        out.push(v.len() as u8);
        out.extend_from_slice(v.as_bytes());
    }
    out
}

/// Decodes the agent's answer blocks: an indexed static field (only `:status: 200` is used) and
/// literals without indexing (of a static name: 8 `:status`, 31 `content-type`; or a new name).
fn decode_block(b: &[u8]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut i = 0;
    let string = |i: &mut usize| {
        assert_eq!(b[*i] & 0x80, 0, "no Huffman coding");
        let mut len = usize::from(b[*i] & 0x7f);
        *i += 1;
        if len == 127 {
            let mut shift = 0;
            loop {
                let c = b[*i];
                *i += 1;
                len += usize::from(c & 0x7f) << shift;
                shift += 7;
                if c & 0x80 == 0 {
                    break;
                }
            }
        }
        let s = String::from_utf8(b[*i..*i + len].to_vec()).unwrap();
        *i += len;
        s
    };
    while i < b.len() {
        match b[i] {
            0x88 => {
                out.push((":status".into(), "200".into()));
                i += 1;
            }
            0x00 => {
                i += 1;
                let n = string(&mut i);
                let v = string(&mut i);
                out.push((n, v));
            }
            0x08 => {
                i += 1;
                out.push((":status".into(), string(&mut i)));
            }
            0x0f if b[i + 1] == 0x10 => {
                i += 2;
                out.push(("content-type".into(), string(&mut i)));
            }
            other => panic!("unexpected representation {other:#x} in {b:02x?}"),
        }
    }
    out
}

fn field(fields: &[(String, String)], name: &str) -> Option<String> {
    fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
}

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
