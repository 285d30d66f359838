//! HTTP/2 frames (RFC 9113 §4 and §6): the 9-byte header, the kinds and flags a server meets, and
//! writers for the frames it sends.

/// What a client sends first.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Bytes of a frame header.
pub const HEAD: usize = 9;

/// The largest frame payload either side sends or accepts (SETTINGS_MAX_FRAME_SIZE's default; this
/// server announces no other).
pub const MAX_PAYLOAD: usize = 16_384;

/// Frame kinds.
pub mod kind {
    /// Request or response body bytes.
    pub const DATA: u8 = 0x0;
    /// A header block's start.
    pub const HEADERS: u8 = 0x1;
    /// A stream's priority (deprecated; read for its faults only).
    pub const PRIORITY: u8 = 0x2;
    /// Ends a stream at once.
    pub const RST_STREAM: u8 = 0x3;
    /// Connection settings, or their acknowledgement.
    pub const SETTINGS: u8 = 0x4;
    /// Server push (never from a client).
    pub const PUSH_PROMISE: u8 = 0x5;
    /// Liveness, answered with its payload.
    pub const PING: u8 = 0x6;
    /// The sender is closing the connection.
    pub const GOAWAY: u8 = 0x7;
    /// Flow-control credit.
    pub const WINDOW_UPDATE: u8 = 0x8;
    /// The rest of a header block.
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    /// DATA, HEADERS: the sender's last frame on the stream.
    pub const END_STREAM: u8 = 0x1;
    /// SETTINGS, PING: an acknowledgement.
    pub const ACK: u8 = 0x1;
    /// HEADERS, CONTINUATION: the header block is complete.
    pub const END_HEADERS: u8 = 0x4;
    /// DATA, HEADERS: a pad length byte leads, padding trails.
    pub const PADDED: u8 = 0x8;
    /// HEADERS: 5 bytes of priority follow the pad length.
    pub const PRIORITY: u8 = 0x20;
}

/// Error codes (RFC 9113 §7).
pub mod code {
    /// Graceful.
    pub const NO_ERROR: u32 = 0x0;
    /// The peer broke the protocol.
    pub const PROTOCOL_ERROR: u32 = 0x1;
    /// A flow-control window overrun.
    pub const FLOW_CONTROL_ERROR: u32 = 0x3;
    /// A frame of the wrong size.
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    /// A frame on a stream already closed.
    pub const STREAM_CLOSED: u32 = 0x5;
    /// Past the streams the server allows at once.
    pub const REFUSED_STREAM: u32 = 0x7;
    /// The stream is no longer needed.
    pub const CANCEL: u32 = 0x8;
    /// A header block that does not decode.
    pub const COMPRESSION_ERROR: u32 = 0x9;
    /// The peer is generating excessive load (or too large a header block).
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;
}

/// Setting identifiers.
pub mod setting {
    /// Whether server push is allowed.
    pub const ENABLE_PUSH: u16 = 0x2;
    /// Streams the sender allows at once.
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    /// Each new stream's flow-control window.
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    /// The largest frame payload the sender accepts.
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    /// Advisory: the largest header list the sender accepts.
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// The largest flow-control window (2³¹ − 1).
pub const MAX_WINDOW: i64 = (1 << 31) - 1;

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Payload bytes.
    pub len: usize,
    /// Its kind.
    pub kind: u8,
    /// Its flags.
    pub flags: u8,
    /// Its stream (0: the connection), the reserved bit cleared.
    pub stream: u32,
}

impl Head {
    /// The header at the start of `buf`, once its 9 bytes are there.
    pub fn parse(buf: &[u8]) -> Option<Head> {
        let b: &[u8; HEAD] = buf.get(..HEAD)?.try_into().ok()?;
        Some(Head {
            len: (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        })
    }

    /// Whether a flag is set.
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// Appends a frame header.
pub fn head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = len as u32;
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// SETTINGS with these values.
pub fn settings(out: &mut Vec<u8>, values: &[(u16, u32)]) {
    head(out, values.len() * 6, kind::SETTINGS, 0, 0);
    for (id, v) in values {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// A SETTINGS acknowledgement.
pub fn settings_ack(out: &mut Vec<u8>) {
    head(out, 0, kind::SETTINGS, flag::ACK, 0);
}

/// A PING (`ack`: the answer to one) with its 8 bytes.
pub fn ping(out: &mut Vec<u8>, payload: [u8; 8], ack: bool) {
    head(out, 8, kind::PING, if ack { flag::ACK } else { 0 }, 0);
    out.extend_from_slice(&payload);
}

/// WINDOW_UPDATE of `stream` (0: the connection) by `increment` (1 to 2³¹ − 1).
pub fn window_update(out: &mut Vec<u8>, stream: u32, increment: u32) {
    head(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.extend_from_slice(&increment.to_be_bytes());
}

/// RST_STREAM of `stream` with `code`.
pub fn rst_stream(out: &mut Vec<u8>, stream: u32, code: u32) {
    head(out, 4, kind::RST_STREAM, 0, stream);
    out.extend_from_slice(&code.to_be_bytes());
}

/// GOAWAY: the last stream this server processes or may have, the code, and why.
pub fn goaway(out: &mut Vec<u8>, last_stream: u32, code: u32, why: &str) {
    let why = &why.as_bytes()[..why.len().min(256)];
    head(out, 8 + why.len(), kind::GOAWAY, 0, 0);
    out.extend_from_slice(&last_stream.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(why);
}

/// A frame's payload without its padding (PADDED: a length byte first, that many bytes last), or
/// None when the padding is longer than the frame.
pub fn unpadded(h: &Head, payload: &[u8]) -> Option<std::ops::Range<usize>> {
    if !h.has(flag::PADDED) {
        return Some(0..payload.len());
    }
    let pad = usize::from(*payload.first()?);
    (pad < payload.len()).then(|| 1..payload.len() - pad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_round_trips_and_the_reserved_bit_is_dropped() {
        let mut out = Vec::new();
        head(&mut out, 0x01_02_03, kind::HEADERS, flag::END_HEADERS, 7);
        out[5] |= 0x80;
        assert_eq!(
            Head::parse(&out),
            Some(Head {
                len: 0x01_02_03,
                kind: kind::HEADERS,
                flags: flag::END_HEADERS,
                stream: 7
            })
        );
        assert_eq!(Head::parse(&out[..8]), None);
    }

    #[test]
    fn padding_is_stripped_or_refused() {
        let h = |flags| Head {
            len: 0,
            kind: kind::DATA,
            flags,
            stream: 1,
        };
        assert_eq!(unpadded(&h(0), b"abc"), Some(0..3));
        assert_eq!(unpadded(&h(flag::PADDED), &[2, b'a', 0, 0]), Some(1..2));
        assert_eq!(unpadded(&h(flag::PADDED), &[4, b'a', 0, 0]), None);
        assert_eq!(unpadded(&h(flag::PADDED), &[]), None);
    }
}
