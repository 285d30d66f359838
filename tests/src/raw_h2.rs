//! A raw HTTP/2 client for the agent's gRPC listener: frames written by hand, header blocks of
//! literals (no HPACK state), and the agent's answers read back, so tests can be the hostile or
//! broken peer a library client never is.

use std::time::Duration;

use floodgate_agent::envoy::proto::{Entry, RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::Agent;

/// The one method the agent serves.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// How long a test waits for any one frame or close.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Frame type DATA.
pub const DATA: u8 = 0;
/// Frame type HEADERS.
pub const HEADERS: u8 = 1;
/// Frame type RST_STREAM.
pub const RST_STREAM: u8 = 3;
/// Frame type SETTINGS.
pub const SETTINGS: u8 = 4;
/// Frame type PING.
pub const PING: u8 = 6;
/// Frame type GOAWAY.
pub const GOAWAY: u8 = 7;
/// Frame type WINDOW_UPDATE.
pub const WINDOW_UPDATE: u8 = 8;
/// Flag END_STREAM.
pub const END_STREAM: u8 = 1;
/// Flag END_HEADERS.
pub const END_HEADERS: u8 = 4;
/// Frame type CONTINUATION.
pub const CONTINUATION: u8 = 9;
/// Frame type PRIORITY.
pub const PRIORITY: u8 = 2;

/// A frame the agent sent.
#[derive(Debug)]
pub struct Frame {
    /// The frame type.
    pub kind: u8,
    /// Its flags.
    pub flags: u8,
    /// Its stream id.
    pub stream: u32,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// A client writing frames by hand; header blocks are literals without indexing and without
/// Huffman coding, so it keeps no HPACK state.
pub struct Raw {
    io: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    /// A TCP connection to the agent's gRPC listener, nothing sent.
    pub async fn connect(agent: &Agent) -> Raw {
        let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
        Raw {
            io: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    /// The preface, with these settings.
    pub async fn open(agent: &Agent, settings: &[(u16, u32)]) -> Raw {
        let mut raw = Raw::connect(agent).await;
        raw.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        let payload: Vec<u8> = settings
            .iter()
            .flat_map(|(id, v)| id.to_be_bytes().into_iter().chain(v.to_be_bytes()))
            .collect();
        raw.frame(SETTINGS, 0, 0, &payload).await;
        raw
    }

    /// Writes raw bytes (the agent must still be reading).
    pub async fn write(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.unwrap();
    }

    /// Writes one frame, or returns false if the agent has closed the connection.
    pub async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> bool {
        self.io
            .write_all(&frame_bytes(kind, flags, stream, payload))
            .await
            .is_ok()
    }

    /// Hands back the socket, for a test that reads and writes on separate tasks.
    pub fn into_split(self) -> (tokio::net::tcp::OwnedReadHalf, tokio::net::tcp::OwnedWriteHalf) {
        self.io.into_split()
    }

    /// Writes one frame.
    pub async fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        self.write(&f).await;
    }

    /// HEADERS of a gRPC request to `path`.
    pub async fn headers(&mut self, stream: u32, path: &str, content_type: &str, end_stream: bool) {
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
    pub async fn call(&mut self, stream: u32, address: &str) {
        self.headers(stream, PATH, "application/grpc", false).await;
        self.frame(DATA, END_STREAM, stream, &grpc_message(&request(address)))
            .await;
    }

    /// The next frame, or None when the connection ended.
    pub async fn next(&mut self) -> Option<Frame> {
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
    pub async fn next_on(&mut self, stream: u32, kind: u8) -> Frame {
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
    pub async fn goaway(&mut self) -> u32 {
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
    pub async fn answer(
        &mut self,
        stream: u32,
    ) -> (Vec<(String, String)>, Option<RateLimitResponse>, String) {
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

/// One frame's bytes: its 9-byte header, then `payload`.
pub fn frame_bytes(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A ShouldRateLimit request of domain `edge` for one `remote_address`.
pub fn request(address: &str) -> RateLimitRequest {
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

/// `m` as a gRPC message: uncompressed, its length before it.
pub fn grpc_message(m: &RateLimitRequest) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// A header block of literals without indexing, new names, no Huffman (lengths under 127).
pub fn block(fields: &[(&str, &str)]) -> Vec<u8> {
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
pub fn decode_block(b: &[u8]) -> Vec<(String, String)> {
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

/// The value of the first field named `name`.
pub fn field(fields: &[(String, String)], name: &str) -> Option<String> {
    fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
}
