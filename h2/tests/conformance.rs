//! RFC 9113 (HTTP/2) and RFC 7541 (HPACK) conformance of floodgate-h2, case by case as h2spec checks
//! a server: a client writing raw frames over an in-process pipe, each test one rule (a MUST of the
//! RFCs, or this server's documented choice where the RFC lets it choose). A connection error must
//! be a GOAWAY with the code the rule names, then the close; a stream error an RST_STREAM with it.
//! Time is tokio's paused clock, so timeouts are exact and nothing sleeps.
//!
//! The cases (section: rule -> test):
//! - 3.4: a preface that is not HTTP/2's -> `preface_must_be_http2s`; the server's first frame is
//!   SETTINGS -> `the_server_speaks_settings_first`
//! - 4.1: unknown frame types and unknown flags are ignored -> `unknown_types_and_flags_are_ignored`
//! - 4.2: a frame past MAX_FRAME_SIZE is FRAME_SIZE_ERROR -> `oversize_frames`
//! - 4.3: a block that does not decode is COMPRESSION_ERROR; a block interrupted by another frame is
//!   PROTOCOL_ERROR -> `header_blocks`
//! - 5.1: idle streams take only HEADERS and PRIORITY; half-closed (remote) streams take no DATA or
//!   HEADERS (STREAM_CLOSED); closed streams: frames after RST_STREAM or END_STREAM are STREAM_CLOSED
//!   -> `idle_streams`, `half_closed_streams`, `closed_streams`
//! - 5.1.1: even stream ids and ids lower than one opened are PROTOCOL_ERROR -> `stream_ids`
//! - 5.1.2: streams past MAX_CONCURRENT_STREAMS are REFUSED_STREAM -> `concurrent_streams`
//! - 5.3.1: a stream that depends on itself is a stream error -> `self_dependency`
//! - 6.1: DATA on stream 0, or padded past its length, is PROTOCOL_ERROR -> `data_frames`
//! - 6.2: HEADERS on stream 0, or padded past its length, is PROTOCOL_ERROR; a PRIORITY flag's bytes
//!   are skipped -> `headers_frames`
//! - 6.3: PRIORITY on stream 0 is PROTOCOL_ERROR, of a length other than 5 FRAME_SIZE_ERROR
//!   -> `priority_frames`
//! - 6.4: RST_STREAM on stream 0 is PROTOCOL_ERROR, of a length other than 4 FRAME_SIZE_ERROR
//!   -> `rst_stream_frames`
//! - 6.5: SETTINGS: ACK with a payload, on a stream, a length not a multiple of 6, ENABLE_PUSH > 1,
//!   INITIAL_WINDOW_SIZE > 2^31-1, MAX_FRAME_SIZE out of range are errors; unknown settings ignored;
//!   every SETTINGS acknowledged -> `settings_frames`
//! - 6.7: PING answered with ACK and its payload, an ACK not answered, on a stream PROTOCOL_ERROR, of
//!   a length other than 8 FRAME_SIZE_ERROR -> `ping_frames`
//! - 6.8: after the client's GOAWAY the server ends its streams and closes -> `client_goaway`
//! - 6.9: WINDOW_UPDATE of 0 (connection: PROTOCOL_ERROR; stream: stream error), of a length other
//!   than 4, or past 2^31-1 -> `window_update_frames`
//! - 6.9.1, 6.9.2: the server sends no more than the windows allow, and a SETTINGS change of the
//!   initial window applies to open streams, below zero too -> `flow_control`
//! - 6.10: CONTINUATION without HEADERS, or on another stream, is PROTOCOL_ERROR
//!   -> `continuation_frames`
//! - 8.1.1: malformed requests (pseudo-header after a regular field, unknown or repeated pseudo-header,
//!   a missing one, upper-case names, connection-specific fields, TE other than trailers, trailers
//!   with pseudo-headers, content-length not matching DATA) are stream errors PROTOCOL_ERROR
//!   -> `malformed_requests`
//! - this server's choice: a connection that answers PINGs but makes no call for the idle timeout
//!   gets GOAWAY NO_ERROR and is closed -> `an_idle_connection_is_closed`
//! - RFC 7541 2.3.3, 4.2, 5.1, 5.2: index 0 or past the table, a size update past the setting or
//!   after a field, an integer overflow, a Huffman string with EOS or bad padding are
//!   COMPRESSION_ERROR -> `hpack_errors`

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use floodgate_h2::{serve, Config, Ended, Service, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const PRIORITY: u8 = 2;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PUSH_PROMISE: u8 = 5;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const CONTINUATION: u8 = 9;
const END_STREAM: u8 = 1;
const ACK: u8 = 1;
const END_HEADERS: u8 = 4;
const PADDED: u8 = 8;
const PRIORITY_FLAG: u8 = 0x20;

const PROTOCOL_ERROR: u32 = 1;
const FLOW_CONTROL_ERROR: u32 = 3;
const STREAM_CLOSED: u32 = 5;
const FRAME_SIZE_ERROR: u32 = 6;
const REFUSED_STREAM: u32 = 7;
const COMPRESSION_ERROR: u32 = 9;

/// `/t.T/Now` answers at once with the request's bytes; `/t.T/Never` never answers, so its stream
/// stays half-closed (remote).
struct Test;

impl Service for Test {
    type Future = Pin<Box<dyn Future<Output = Result<Vec<u8>, Status>> + Send>>;
    fn call(&self, method: usize, message: &[u8], _trace: Option<&[u8]>) -> Self::Future {
        match method {
            0 => Box::pin(std::future::ready(Ok(message.to_vec()))),
            _ => Box::pin(std::future::pending()),
        }
    }
}

#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    fn code(&self) -> u32 {
        let at = if self.kind == GOAWAY { 4 } else { 0 };
        u32::from_be_bytes(self.payload[at..at + 4].try_into().unwrap())
    }
}

struct Peer {
    io: DuplexStream,
    buf: Vec<u8>,
    server: JoinHandle<Ended>,
    _stop: watch::Sender<bool>,
}

impl Peer {
    /// A connection with nothing sent.
    fn bare() -> Peer {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (stop_tx, stop) = watch::channel(false);
        let config = Arc::new(
            Config::new(&[b"/t.T/Now", b"/t.T/Never"], &[])
                .timeouts(Duration::from_secs(2), Duration::from_secs(1)),
        );
        Peer {
            io: client,
            buf: Vec::new(),
            server: tokio::spawn(serve(server, Arc::new(Test), config, stop)),
            _stop: stop_tx,
        }
    }

    /// The preface and an empty SETTINGS; the server's SETTINGS and window update read.
    async fn open() -> Peer {
        Peer::with_settings(&[]).await
    }

    async fn with_settings(settings: &[(u16, u32)]) -> Peer {
        let mut p = Peer::bare();
        p.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        let payload: Vec<u8> = settings
            .iter()
            .flat_map(|(id, v)| id.to_be_bytes().into_iter().chain(v.to_be_bytes()))
            .collect();
        p.frame(SETTINGS, 0, 0, &payload).await;
        let first = p.next().await.unwrap();
        assert_eq!((first.kind, first.flags), (SETTINGS, 0), "the server's preface");
        p
    }

    async fn write(&mut self, bytes: &[u8]) {
        // A closed server may refuse the bytes; what it answered is still read.
        let _ = self.io.write_all(bytes).await;
    }

    async fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        self.write(&f).await;
    }

    async fn request(&mut self, stream: u32, path: &str, end_stream: bool) {
        let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
        self.frame(HEADERS, flags, stream, &request_block(path)).await;
    }

    async fn call(&mut self, stream: u32, path: &str, message: &[u8]) {
        self.request(stream, path, false).await;
        self.frame(DATA, END_STREAM, stream, &grpc(message)).await;
    }

    /// The next frame, or None at the close (the paused clock runs out the server's timers).
    async fn next(&mut self) -> Option<Frame> {
        loop {
            if self.buf.len() >= 9 {
                let len = (usize::from(self.buf[0]) << 16)
                    | (usize::from(self.buf[1]) << 8)
                    | usize::from(self.buf[2]);
                if self.buf.len() >= 9 + len {
                    let f = Frame {
                        kind: self.buf[3],
                        flags: self.buf[4],
                        stream: u32::from_be_bytes(self.buf[5..9].try_into().unwrap()) & 0x7fff_ffff,
                        payload: self.buf[9..9 + len].to_vec(),
                    };
                    self.buf.drain(..9 + len);
                    return Some(f);
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            match tokio::time::timeout(Duration::from_secs(60), self.io.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return None,
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                Err(_) => panic!("the server neither answered nor closed in 60 s"),
            }
        }
    }

    /// The next frame that is not connection chatter (SETTINGS, its ACK, WINDOW_UPDATE, PING ACK).
    async fn next_event(&mut self) -> Option<Frame> {
        loop {
            let f = self.next().await?;
            let chatter =
                matches!(f.kind, SETTINGS | WINDOW_UPDATE) || (f.kind == PING && f.flags & ACK != 0);
            if !chatter {
                return Some(f);
            }
        }
    }

    /// The connection error: its GOAWAY's code, then the close and the server's own word on it.
    async fn connection_error(mut self) -> u32 {
        let code = loop {
            let f = self.next().await.expect("a GOAWAY before the close");
            if f.kind == GOAWAY {
                break f.code();
            }
        };
        while self.next().await.is_some() {}
        match self.server.await.unwrap() {
            Ended::Error { code: ended, .. } => assert_eq!(ended, code),
            Ended::Closed | Ended::Idle => panic!("the server says it closed without an error"),
        }
        code
    }

    /// The stream error on `stream`: its RST_STREAM's code.
    async fn stream_error(&mut self, stream: u32) -> u32 {
        loop {
            let f = self.next_event().await.expect("an RST_STREAM before the close");
            match (f.kind, f.stream == stream) {
                (RST_STREAM, true) => return f.code(),
                (GOAWAY, _) => panic!("a connection error ({}) where a stream error was due", f.code()),
                _ => {}
            }
        }
    }

    /// The gRPC status of a call answered on `stream`, and its message.
    async fn answer(&mut self, stream: u32) -> (Vec<u8>, String) {
        let mut body = Vec::new();
        loop {
            let f = self.next_event().await.expect("an answer");
            assert_eq!(f.stream, stream, "{f:?}");
            match f.kind {
                DATA => body.extend_from_slice(&f.payload),
                HEADERS if f.flags & END_STREAM != 0 => {
                    let status = status_of(&f.payload);
                    return (body.get(5..).map(<[u8]>::to_vec).unwrap_or_default(), status);
                }
                HEADERS => {}
                _ => panic!("unexpected {f:?}"),
            }
        }
    }

    /// The connection still serves: a call on `stream` is answered.
    async fn still_serves(&mut self, stream: u32) {
        self.call(stream, "/t.T/Now", b"ok").await;
        assert_eq!(self.answer(stream).await, (b"ok".to_vec(), "0".to_string()));
    }
}

fn literal(out: &mut Vec<u8>, n: &str, v: &str) {
    out.push(0x00);
    out.push(n.len() as u8);
    out.extend_from_slice(n.as_bytes());
    out.push(v.len() as u8);
    out.extend_from_slice(v.as_bytes());
}

fn block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (n, v) in fields {
        literal(&mut out, n, v);
    }
    out
}

fn request_fields(path: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":scheme", "http".into()),
        (":path", path.into()),
        (":authority", "t".into()),
        ("content-type", "application/grpc".into()),
        ("te", "trailers".into()),
    ]
}

fn request_block(path: &str) -> Vec<u8> {
    let f = request_fields(path);
    let borrowed: Vec<(&str, &str)> = f.iter().map(|(n, v)| (*n, v.as_str())).collect();
    block(&borrowed)
}

fn grpc(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// The `grpc-status` of the server's trailers (a literal of a new name, as it writes them).
fn status_of(block: &[u8]) -> String {
    let needle = b"grpc-status";
    let at = block
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("grpc-status");
    let len = usize::from(block[at + needle.len()]);
    String::from_utf8(block[at + needle.len() + 1..at + needle.len() + 1 + len].to_vec()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn preface_must_be_http2s() {
    let mut p = Peer::bare();
    p.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR);
}

#[tokio::test(start_paused = true)]
async fn the_server_speaks_settings_first() {
    let mut p = Peer::bare();
    p.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    let f = p.next().await.unwrap();
    assert_eq!((f.kind, f.flags, f.stream), (SETTINGS, 0, 0));
    // Our SETTINGS is acknowledged after the server's own.
    p.frame(SETTINGS, 0, 0, &[]).await;
    loop {
        let f = p.next().await.unwrap();
        if f.kind == SETTINGS {
            assert_eq!((f.flags, f.payload.len()), (ACK, 0));
            break;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn unknown_types_and_flags_are_ignored() {
    let mut p = Peer::open().await;
    p.frame(0x42, 0xff, 0, b"anything").await;
    p.frame(0x42, 0, 1, b"").await;
    // PING with an unknown flag (0x10) is still a PING.
    p.frame(PING, 0x10, 0, b"abcdefgh").await;
    let pong = loop {
        let f = p.next().await.unwrap();
        if f.kind == PING {
            break f;
        }
    };
    assert_eq!((pong.flags, &pong.payload[..]), (ACK, &b"abcdefgh"[..]));
    p.still_serves(1).await;
}

#[tokio::test(start_paused = true)]
async fn oversize_frames() {
    let mut p = Peer::open().await;
    p.frame(DATA, 0, 1, &vec![0; 16_385]).await;
    assert_eq!(p.connection_error().await, FRAME_SIZE_ERROR);
}

#[tokio::test(start_paused = true)]
async fn header_blocks() {
    let mut p = Peer::open().await;
    p.frame(HEADERS, END_HEADERS, 1, &[0xc6]).await;
    assert_eq!(
        p.connection_error().await,
        COMPRESSION_ERROR,
        "an index past the table"
    );
    let mut p = Peer::open().await;
    p.frame(HEADERS, 0, 1, &request_block("/t.T/Now")).await;
    p.frame(DATA, END_STREAM, 1, &grpc(b"x")).await;
    assert_eq!(
        p.connection_error().await,
        PROTOCOL_ERROR,
        "a block interrupted by DATA"
    );
}

#[tokio::test(start_paused = true)]
async fn idle_streams() {
    for (kind, payload) in [
        (DATA, grpc(b"x")),
        (RST_STREAM, 8u32.to_be_bytes().to_vec()),
        (WINDOW_UPDATE, 100u32.to_be_bytes().to_vec()),
        (CONTINUATION, request_block("/t.T/Now")),
    ] {
        let mut p = Peer::open().await;
        p.frame(kind, END_HEADERS, 1, &payload).await;
        assert_eq!(
            p.connection_error().await,
            PROTOCOL_ERROR,
            "frame type {kind} on an idle stream"
        );
    }
    // PRIORITY on an idle stream is allowed.
    let mut p = Peer::open().await;
    p.frame(PRIORITY, 0, 3, &[0, 0, 0, 0, 16]).await;
    p.still_serves(1).await;
}

#[tokio::test(start_paused = true)]
async fn half_closed_streams() {
    let mut p = Peer::open().await;
    p.call(1, "/t.T/Never", b"x").await;
    p.frame(DATA, 0, 1, &grpc(b"more")).await;
    assert_eq!(p.stream_error(1).await, STREAM_CLOSED, "DATA after END_STREAM");
    p.call(3, "/t.T/Never", b"x").await;
    p.request(3, "/t.T/Now", true).await;
    assert_eq!(p.stream_error(3).await, STREAM_CLOSED, "HEADERS after END_STREAM");
    p.still_serves(5).await;
}

#[tokio::test(start_paused = true)]
async fn closed_streams() {
    let mut p = Peer::open().await;
    p.request(1, "/t.T/Now", false).await;
    p.frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()).await;
    p.frame(DATA, END_STREAM, 1, &grpc(b"x")).await;
    assert_eq!(
        p.connection_error().await,
        STREAM_CLOSED,
        "DATA after the client's RST_STREAM"
    );
    let mut p = Peer::open().await;
    p.still_serves(1).await;
    p.request(1, "/t.T/Now", true).await;
    assert_eq!(
        p.connection_error().await,
        STREAM_CLOSED,
        "HEADERS after both sides' END_STREAM"
    );
    // Frames on a stream the server reset are ignored: the client may have sent them first.
    let mut p = Peer::open().await;
    p.request(1, "/t.T/Now", false).await;
    p.frame(DATA, 0, 1, &[0, 0, 1, 0, 0]).await;
    assert_eq!(p.answer(1).await.1, "8", "RESOURCE_EXHAUSTED");
    assert_eq!(p.stream_error(1).await, 0, "then RST_STREAM NO_ERROR");
    p.frame(DATA, END_STREAM, 1, b"late").await;
    p.still_serves(3).await;
}

#[tokio::test(start_paused = true)]
async fn stream_ids() {
    let mut p = Peer::open().await;
    p.request(2, "/t.T/Now", true).await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR, "an even stream id");
    let mut p = Peer::open().await;
    p.still_serves(5).await;
    p.request(3, "/t.T/Now", true).await;
    assert_eq!(
        p.connection_error().await,
        PROTOCOL_ERROR,
        "an id lower than one opened"
    );
}

#[tokio::test(start_paused = true)]
async fn concurrent_streams() {
    let mut p = Peer::open().await;
    for i in 0..1_025u32 {
        p.request(2 * i + 1, "/t.T/Never", false).await;
    }
    assert_eq!(p.stream_error(2 * 1_024 + 1).await, REFUSED_STREAM);
}

#[tokio::test(start_paused = true)]
async fn self_dependency() {
    let mut p = Peer::open().await;
    let mut payload = vec![0, 0, 0, 1, 16];
    payload.extend(request_block("/t.T/Now"));
    p.frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1, &payload)
        .await;
    assert_eq!(
        p.stream_error(1).await,
        PROTOCOL_ERROR,
        "HEADERS depending on itself"
    );
    p.frame(PRIORITY, 0, 3, &[0, 0, 0, 3, 16]).await;
    assert_eq!(
        p.stream_error(3).await,
        PROTOCOL_ERROR,
        "PRIORITY depending on itself"
    );
    p.still_serves(5).await;
}

#[tokio::test(start_paused = true)]
async fn data_frames() {
    let mut p = Peer::open().await;
    p.frame(DATA, 0, 0, b"x").await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR, "DATA on stream 0");
    let mut p = Peer::open().await;
    p.request(1, "/t.T/Now", false).await;
    p.frame(DATA, PADDED | END_STREAM, 1, &[5, 0, 0]).await;
    assert_eq!(
        p.connection_error().await,
        PROTOCOL_ERROR,
        "padding past the frame"
    );
    // Padding is stripped.
    let mut p = Peer::open().await;
    p.request(1, "/t.T/Now", false).await;
    let mut padded = vec![3];
    padded.extend(grpc(b"pad"));
    padded.extend([0, 0, 0]);
    p.frame(DATA, PADDED | END_STREAM, 1, &padded).await;
    assert_eq!(p.answer(1).await, (b"pad".to_vec(), "0".to_string()));
}

#[tokio::test(start_paused = true)]
async fn headers_frames() {
    let mut p = Peer::open().await;
    p.frame(HEADERS, END_HEADERS, 0, &request_block("/t.T/Now")).await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR, "HEADERS on stream 0");
    let mut p = Peer::open().await;
    p.frame(HEADERS, END_HEADERS | PADDED, 1, &[200, 0x82]).await;
    assert_eq!(
        p.connection_error().await,
        PROTOCOL_ERROR,
        "padding past the frame"
    );
    // A PRIORITY flag's five bytes are skipped.
    let mut p = Peer::open().await;
    let mut payload = vec![0, 0, 0, 0, 16];
    payload.extend(request_block("/t.T/Now"));
    p.frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, &payload).await;
    p.frame(DATA, END_STREAM, 1, &grpc(b"p")).await;
    assert_eq!(p.answer(1).await.1, "0");
}

#[tokio::test(start_paused = true)]
async fn priority_frames() {
    let mut p = Peer::open().await;
    p.frame(PRIORITY, 0, 0, &[0, 0, 0, 1, 16]).await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR, "PRIORITY on stream 0");
    let mut p = Peer::open().await;
    p.frame(PRIORITY, 0, 1, &[0, 0, 0, 0]).await;
    assert_eq!(p.stream_error(1).await, FRAME_SIZE_ERROR);
    p.still_serves(3).await;
}

#[tokio::test(start_paused = true)]
async fn rst_stream_frames() {
    let mut p = Peer::open().await;
    p.frame(RST_STREAM, 0, 0, &8u32.to_be_bytes()).await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR);
    let mut p = Peer::open().await;
    p.request(1, "/t.T/Never", false).await;
    p.frame(RST_STREAM, 0, 1, &[0, 0, 8]).await;
    assert_eq!(p.connection_error().await, FRAME_SIZE_ERROR);
}

#[tokio::test(start_paused = true)]
async fn settings_frames() {
    for (flags, stream, payload, code, what) in [
        (
            ACK,
            0,
            vec![0, 4, 0, 0, 0, 0],
            FRAME_SIZE_ERROR,
            "an ACK with a payload",
        ),
        (0, 1, vec![], PROTOCOL_ERROR, "on a stream"),
        (
            0,
            0,
            vec![0, 4, 0, 0, 0],
            FRAME_SIZE_ERROR,
            "a length not a multiple of 6",
        ),
        (0, 0, vec![0, 2, 0, 0, 0, 2], PROTOCOL_ERROR, "ENABLE_PUSH 2"),
        (
            0,
            0,
            vec![0, 4, 0x80, 0, 0, 0],
            FLOW_CONTROL_ERROR,
            "INITIAL_WINDOW_SIZE 2^31",
        ),
        (
            0,
            0,
            vec![0, 5, 0, 0, 0x3f, 0xff],
            PROTOCOL_ERROR,
            "MAX_FRAME_SIZE 16,383",
        ),
        (
            0,
            0,
            vec![0, 5, 1, 0, 0, 0],
            PROTOCOL_ERROR,
            "MAX_FRAME_SIZE 2^24",
        ),
    ] {
        let mut p = Peer::open().await;
        p.frame(SETTINGS, flags, stream, &payload).await;
        assert_eq!(p.connection_error().await, code, "{what}");
    }
    // An unknown setting is ignored, and the frame acknowledged.
    let mut p = Peer::open().await;
    p.frame(SETTINGS, 0, 0, &[0xff, 0xff, 0, 0, 0, 1]).await;
    let mut acks = 0;
    while acks < 2 {
        let f = p.next().await.unwrap();
        if f.kind == SETTINGS && f.flags == ACK {
            acks += 1;
        }
    }
    p.still_serves(1).await;
}

#[tokio::test(start_paused = true)]
async fn ping_frames() {
    let mut p = Peer::open().await;
    p.frame(PING, ACK, 0, b"no-reply").await;
    p.frame(PING, 0, 0, b"12345678").await;
    let pong = loop {
        let f = p.next().await.unwrap();
        if f.kind == PING {
            break f;
        }
    };
    assert_eq!(
        (pong.flags, &pong.payload[..]),
        (ACK, &b"12345678"[..]),
        "only the PING is answered"
    );
    p.frame(PING, 0, 1, b"12345678").await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR, "PING on a stream");
    let mut p = Peer::open().await;
    p.frame(PING, 0, 0, b"1234567").await;
    assert_eq!(p.connection_error().await, FRAME_SIZE_ERROR);
}

#[tokio::test(start_paused = true)]
async fn client_goaway() {
    let mut p = Peer::open().await;
    p.call(1, "/t.T/Now", b"bye").await;
    p.frame(GOAWAY, 0, 0, &[0, 0, 0, 1, 0, 0, 0, 0]).await;
    assert_eq!(p.answer(1).await.1, "0");
    while p.next().await.is_some() {}
    assert_eq!(p.server.await.unwrap(), Ended::Closed);
}

#[tokio::test(start_paused = true)]
async fn window_update_frames() {
    let mut p = Peer::open().await;
    p.frame(WINDOW_UPDATE, 0, 0, &0u32.to_be_bytes()).await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR, "0 on the connection");
    let mut p = Peer::open().await;
    p.frame(WINDOW_UPDATE, 0, 0, &[0, 0, 1]).await;
    assert_eq!(p.connection_error().await, FRAME_SIZE_ERROR);
    let mut p = Peer::open().await;
    p.frame(WINDOW_UPDATE, 0, 0, &0x7fff_ffffu32.to_be_bytes()).await;
    assert_eq!(
        p.connection_error().await,
        FLOW_CONTROL_ERROR,
        "past 2^31-1 on the connection"
    );
    let mut p = Peer::open().await;
    p.call(1, "/t.T/Never", b"x").await;
    p.frame(WINDOW_UPDATE, 0, 1, &0u32.to_be_bytes()).await;
    assert_eq!(p.stream_error(1).await, PROTOCOL_ERROR, "0 on a stream");
    p.call(3, "/t.T/Never", b"x").await;
    p.frame(WINDOW_UPDATE, 0, 3, &0x7fff_ffffu32.to_be_bytes()).await;
    assert_eq!(
        p.stream_error(3).await,
        FLOW_CONTROL_ERROR,
        "past 2^31-1 on a stream"
    );
    p.still_serves(5).await;
}

#[tokio::test(start_paused = true)]
async fn flow_control() {
    // Streams open with a window of 10: the answer (5 + 100 bytes) comes 10 at a time.
    let mut p = Peer::with_settings(&[(4, 10)]).await;
    p.call(1, "/t.T/Now", &[7; 100]).await;
    let head = p.next_event().await.unwrap();
    assert_eq!((head.kind, head.flags & END_STREAM), (HEADERS, 0));
    let first = p.next_event().await.unwrap();
    assert_eq!((first.kind, first.payload.len()), (DATA, 10));
    // The initial window lowered to 5 after 10 sent: the stream's window is -5; 10 more bring it
    // to 5, and 5 bytes come.
    p.frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0, 5]).await;
    p.frame(WINDOW_UPDATE, 0, 1, &10u32.to_be_bytes()).await;
    let second = p.next_event().await.unwrap();
    assert_eq!((second.kind, second.payload.len()), (DATA, 5));
    // Raised to 1,000: the rest, then the trailers.
    p.frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0x03, 0xe8]).await;
    let mut got = 15;
    loop {
        let f = p.next_event().await.unwrap();
        match f.kind {
            DATA => got += f.payload.len(),
            HEADERS => {
                assert_eq!(status_of(&f.payload), "0");
                break;
            }
            _ => panic!("{f:?}"),
        }
    }
    assert_eq!(got, 105);
    // DATA past a stream's 65,535-byte window is a stream error.
    p.request(3, "/t.T/Now", false).await;
    for _ in 0..4 {
        p.frame(DATA, 0, 3, &vec![0; 16_384]).await;
    }
    assert_eq!(p.stream_error(3).await, FLOW_CONTROL_ERROR);
}

#[tokio::test(start_paused = true)]
async fn continuation_frames() {
    let mut p = Peer::open().await;
    p.still_serves(1).await;
    p.frame(CONTINUATION, END_HEADERS, 1, &request_block("/t.T/Now"))
        .await;
    assert_eq!(
        p.connection_error().await,
        PROTOCOL_ERROR,
        "CONTINUATION after END_HEADERS"
    );
    let mut p = Peer::open().await;
    let b = request_block("/t.T/Now");
    p.frame(HEADERS, 0, 1, &b[..10]).await;
    p.frame(CONTINUATION, END_HEADERS, 3, &b[10..]).await;
    assert_eq!(
        p.connection_error().await,
        PROTOCOL_ERROR,
        "CONTINUATION on another stream"
    );
    // A block in HEADERS and two CONTINUATIONs is one request.
    let mut p = Peer::open().await;
    p.frame(HEADERS, 0, 1, &b[..10]).await;
    p.frame(CONTINUATION, 0, 1, &b[10..30]).await;
    p.frame(CONTINUATION, END_HEADERS, 1, &b[30..]).await;
    p.frame(DATA, END_STREAM, 1, &grpc(b"c")).await;
    assert_eq!(p.answer(1).await, (b"c".to_vec(), "0".to_string()));
}

#[tokio::test(start_paused = true)]
async fn malformed_requests() {
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "a pseudo-header after a regular field",
            vec![
                ("content-type", "application/grpc"),
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.T/Now"),
            ],
        ),
        (
            "an unknown pseudo-header",
            vec![
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.T/Now"),
                (":status", "200"),
            ],
        ),
        (
            "a repeated pseudo-header",
            vec![
                (":method", "POST"),
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.T/Now"),
            ],
        ),
        ("no :path", vec![(":method", "POST"), (":scheme", "http")]),
        (
            "an empty :path",
            vec![(":method", "POST"), (":scheme", "http"), (":path", "")],
        ),
        (
            "an upper-case name",
            vec![
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.T/Now"),
                ("X-Trace", "1"),
            ],
        ),
        (
            "a connection-specific field",
            vec![
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.T/Now"),
                ("connection", "keep-alive"),
            ],
        ),
        (
            "TE other than trailers",
            vec![
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.T/Now"),
                ("te", "gzip"),
            ],
        ),
    ];
    let mut p = Peer::open().await;
    let mut id = 1;
    for (what, fields) in cases {
        p.frame(HEADERS, END_HEADERS | END_STREAM, id, &block(&fields))
            .await;
        assert_eq!(p.stream_error(id).await, PROTOCOL_ERROR, "{what}");
        id += 2;
    }
    // Trailers with a pseudo-header.
    p.request(id, "/t.T/Now", false).await;
    p.frame(DATA, 0, id, &grpc(b"t")).await;
    p.frame(HEADERS, END_HEADERS | END_STREAM, id, &block(&[(":path", "/")]))
        .await;
    assert_eq!(
        p.stream_error(id).await,
        PROTOCOL_ERROR,
        "trailers with a pseudo-header"
    );
    id += 2;
    // A content-length the DATA does not add up to.
    let mut fields = request_fields("/t.T/Now");
    fields.push(("content-length", "99".into()));
    let borrowed: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (*n, v.as_str())).collect();
    p.frame(HEADERS, END_HEADERS, id, &block(&borrowed)).await;
    p.frame(DATA, END_STREAM, id, &grpc(b"short")).await;
    assert_eq!(
        p.stream_error(id).await,
        PROTOCOL_ERROR,
        "content-length 99, 10 bytes sent"
    );
    p.still_serves(id + 2).await;
}

#[tokio::test(start_paused = true)]
async fn hpack_errors() {
    for (block, what) in [
        (vec![0x80], "index 0"),
        (vec![0xbe], "an index past the dynamic table"),
        (
            vec![0x3f, 0xe2, 0x1f],
            "a size update past SETTINGS_HEADER_TABLE_SIZE",
        ),
        (vec![0x82, 0x20], "a size update after a field"),
        (
            vec![0x82, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            "an integer past 28 bits",
        ),
        (
            vec![0x00, 0x81, 0xff, 0x81, 0xff],
            "a Huffman string of all ones (EOS)",
        ),
        (
            vec![0x00, 0x81, 0x00, 0x00],
            "a Huffman string with padding not of ones",
        ),
        (vec![0x41, 0x05, b'a'], "a string past the block"),
    ] {
        let mut p = Peer::open().await;
        p.frame(HEADERS, END_HEADERS | END_STREAM, 1, &block).await;
        assert_eq!(p.connection_error().await, COMPRESSION_ERROR, "{what}");
    }
}

#[tokio::test(start_paused = true)]
async fn push_promise_from_a_client() {
    let mut p = Peer::open().await;
    p.frame(PUSH_PROMISE, END_HEADERS, 1, &[0, 0, 0, 2]).await;
    assert_eq!(p.connection_error().await, PROTOCOL_ERROR);
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_is_closed() {
    let mut p = Peer::open().await;
    p.still_serves(1).await;
    let quiet = tokio::time::Instant::now();
    let code = loop {
        let f = p.next().await.expect("a GOAWAY before the close");
        match f.kind {
            // The server's keepalive PING, answered: the peer is alive, only idle.
            PING if f.flags & ACK == 0 => p.frame(PING, ACK, 0, &f.payload).await,
            GOAWAY => break f.code(),
            _ => {}
        }
    };
    assert_eq!(code, 0, "NO_ERROR");
    assert!(
        quiet.elapsed() >= Duration::from_secs(60),
        "{:?}",
        quiet.elapsed()
    );
    while p.next().await.is_some() {}
    assert_eq!(p.server.await.unwrap(), Ended::Idle);
}
