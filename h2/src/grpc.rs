//! gRPC over HTTP/2 for unary methods: the request's message framing, the response's header blocks
//! (written without the dynamic table or Huffman coding, so each is a few constant bytes), statuses,
//! and grpc.health.v1's messages.

/// gRPC's health service (grpc.health.v1), as Kubernetes' gRPC probes and Envoy's gRPC health
/// checks ask it.
pub const HEALTH_CHECK: &[u8] = b"/grpc.health.v1.Health/Check";

/// Its streaming method, refused (UNIMPLEMENTED): probes and Envoy poll `Check`.
pub const HEALTH_WATCH: &[u8] = b"/grpc.health.v1.Health/Watch";

/// A HealthCheckResponse: `status` (field 1) SERVING (1) or NOT_SERVING (2).
pub fn health_response(serving: bool) -> Vec<u8> {
    vec![0x08, if serving { 1 } else { 2 }]
}

/// The `service` (field 1) of a HealthCheckRequest; None if the message does not decode as one.
pub fn health_service(m: &[u8]) -> Option<&[u8]> {
    let mut service: &[u8] = &[];
    let mut pos = 0;
    while pos < m.len() {
        let (key, n) = varint(&m[pos..])?;
        pos += n;
        match key & 7 {
            0 => pos += varint(m.get(pos..)?)?.1,
            1 => pos += 8,
            2 => {
                let (len, n) = varint(m.get(pos..)?)?;
                let start = pos + n;
                let end = start.checked_add(usize::try_from(len).ok()?)?;
                let bytes = m.get(start..end)?;
                if key >> 3 == 1 {
                    service = bytes;
                }
                pos = end;
            }
            5 => pos += 4,
            _ => return None,
        }
    }
    (pos == m.len()).then_some(service)
}

/// A protobuf varint at the start of `b`: its value and length.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// The largest request message accepted (a RateLimitRequest of 64 descriptors with long values is a
/// few KiB); past this the call is refused (RESOURCE_EXHAUSTED) before its body arrives.
pub const MAX_MESSAGE: usize = 16 * 1024;

/// gRPC status codes used here.
pub mod status {
    /// A health check of a service this server does not have.
    pub const NOT_FOUND: i32 = 5;
    /// Too large, or the agent is overloaded.
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    /// Unknown method, or a compressed message.
    pub const UNIMPLEMENTED: i32 = 12;
    /// A message that does not decode.
    pub const INTERNAL: i32 = 13;
}

/// `:status: 200` (static index 8) and `content-type: application/grpc` (a literal of static name
/// 31, not indexed).
pub const RESPONSE_HEAD: &[u8] = &[
    0x88, 0x0f, 0x10, 16, b'a', b'p', b'p', b'l', b'i', b'c', b'a', b't', b'i', b'o', b'n', b'/', b'g', b'r',
    b'p', b'c',
];

/// `grpc-status: 0`, a literal of a new name, not indexed.
pub const OK_TRAILERS: &[u8] = &[
    0x00, 11, b'g', b'r', b'p', b'c', b'-', b's', b't', b'a', b't', b'u', b's', 1, b'0',
];

/// `:status: 415` (a literal of static name 8): a request that is not gRPC.
pub const NOT_GRPC: &[u8] = &[0x08, 3, b'4', b'1', b'5'];

/// Appends `grpc-status` and, when there is one, `grpc-message` (percent-encoded, at most 1 KiB) to
/// a header block.
pub fn status_fields(out: &mut Vec<u8>, code: i32, message: &str) {
    literal(out, b"grpc-status", code.to_string().as_bytes());
    if !message.is_empty() {
        literal(out, b"grpc-message", &percent_encode(message, 1_024));
    }
}

/// A literal field of a new name, not indexed, no Huffman coding.
fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    string(out, name);
    string(out, value);
}

/// A string with its length as a 7-bit-prefix integer.
fn string(out: &mut Vec<u8>, s: &[u8]) {
    let mut n = s.len();
    if n < 127 {
        out.push(n as u8);
    } else {
        out.push(127);
        n -= 127;
        while n >= 128 {
            out.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        out.push(n as u8);
    }
    out.extend_from_slice(s);
}

/// What gRPC escapes in `grpc-message` besides every byte outside ASCII: control characters and `%`.
const GRPC_MESSAGE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');

/// gRPC's percent-encoding of `grpc-message`: bytes outside printable ASCII, and `%`, as `%XX`; cut
/// at a character boundary before `max` bytes.
pub fn percent_encode(message: &str, max: usize) -> Vec<u8> {
    // The longest prefix whose encoding fits, cut between characters, then encoded whole.
    let (mut used, mut end) = (0, 0);
    for (i, c) in message.char_indices() {
        let need = if c.is_ascii() && c != '%' && !c.is_ascii_control() {
            1
        } else {
            3 * c.len_utf8()
        };
        if used + need > max {
            break;
        }
        used += need;
        end = i + c.len_utf8();
    }
    percent_encoding::utf8_percent_encode(&message[..end], GRPC_MESSAGE)
        .to_string()
        .into_bytes()
}

/// Why a request body is not one gRPC message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadMessage {
    /// The gRPC status to answer with.
    pub code: i32,
    /// Why.
    pub message: String,
}

/// The one message of a unary request body: a 5-byte prefix (compressed flag, length) and that
/// many bytes, nothing after.
pub fn message(body: &[u8]) -> Result<&[u8], BadMessage> {
    let bad = |code, message: String| Err(BadMessage { code, message });
    let Some(prefix) = body.get(..5) else {
        return bad(status::INTERNAL, "the request carries no message".into());
    };
    if prefix[0] != 0 {
        return bad(
            status::UNIMPLEMENTED,
            "compressed messages are not accepted (no grpc-encoding is supported)".into(),
        );
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if body.len() != 5 + len {
        return bad(
            status::INTERNAL,
            format!(
                "the body is {} bytes; a {len}-byte message and its prefix would be {}",
                body.len(),
                5 + len
            ),
        );
    }
    Ok(&body[5..])
}

/// The declared length of the message whose prefix starts `body`, once the prefix is there.
pub fn declared_len(body: &[u8]) -> Option<usize> {
    let p = body.get(..5)?;
    Some(u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_message_escapes_what_grpc_says_and_is_cut_between_characters() {
        assert_eq!(
            percent_encode("héllo 100%\n", 1_024),
            b"h%C3%A9llo 100%25%0A".to_vec()
        );
        // "é" needs 6 bytes encoded: with 6 left after "a" it fits, with 5 it is left out whole.
        assert_eq!(percent_encode("aé", 7), b"a%C3%A9".to_vec());
        assert_eq!(percent_encode("aéb", 6), b"a".to_vec());
    }
    use crate::hpack::{tests::fields, Decoder};

    fn decoded(block: &[u8]) -> Vec<(String, String)> {
        fields(&mut Decoder::default(), block)
    }

    #[test]
    fn the_constant_blocks_say_what_they_mean() {
        let pair = |n: &str, v: &str| (n.to_string(), v.to_string());
        assert_eq!(
            decoded(RESPONSE_HEAD),
            [pair(":status", "200"), pair("content-type", "application/grpc")]
        );
        assert_eq!(decoded(OK_TRAILERS), [pair("grpc-status", "0")]);
        assert_eq!(decoded(NOT_GRPC), [pair(":status", "415")]);
        let mut block = Vec::new();
        status_fields(&mut block, 3, &format!("bad 100% ünïcode {}", "x".repeat(200)));
        let fields = decoded(&block);
        assert_eq!(fields[0], pair("grpc-status", "3"));
        assert!(
            fields[1].1.starts_with("bad 100%25 %C3%BCn%C3%AFcode xxx"),
            "{}",
            fields[1].1
        );
    }

    #[test]
    fn a_health_request_names_its_service() {
        assert_eq!(health_service(&[]), Some(&b""[..]));
        assert_eq!(health_service(&[0x0a, 2, b'a', b'b']), Some(&b"ab"[..]));
        // Other fields are skipped; a truncated string or a bad wire type does not decode.
        assert_eq!(
            health_service(&[0x10, 0x96, 0x01, 0x0a, 1, b'x']),
            Some(&b"x"[..])
        );
        assert_eq!(health_service(&[0x0a, 5, b'a']), None);
        assert_eq!(health_service(&[0x0f]), None);
        assert_eq!(
            health_service(&[0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
            None
        );
        assert_eq!(health_response(true), [0x08, 1]);
    }

    #[test]
    fn a_body_is_exactly_one_uncompressed_message() {
        assert_eq!(message(&[0, 0, 0, 0, 2, 8, 1]), Ok(&[8, 1][..]));
        assert_eq!(message(&[0, 0, 0, 0, 0]), Ok(&[][..]));
        assert_eq!(message(&[0, 0, 0]).unwrap_err().code, status::INTERNAL);
        assert_eq!(message(&[1, 0, 0, 0, 0]).unwrap_err().code, status::UNIMPLEMENTED);
        assert_eq!(
            message(&[0, 0, 0, 0, 3, 8, 1]).unwrap_err().code,
            status::INTERNAL
        );
        assert_eq!(
            message(&[0, 0, 0, 0, 1, 8, 1]).unwrap_err().code,
            status::INTERNAL
        );
        assert_eq!(declared_len(&[0, 0, 1, 0, 0]), Some(65_536));
    }
}
