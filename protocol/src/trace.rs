//! W3C Trace Context (`traceparent`) as a check carries it (protocol version 5): the caller's trace
//! and span, so the agent's span of the check is a child of the request that asked.

/// A trace context: trace id, the parent span's id, and the trace flags (bit 0: sampled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace's 16 bytes (never all zero).
    pub trace_id: [u8; 16],
    /// The parent span's 8 bytes (never all zero).
    pub span_id: [u8; 8],
    /// Trace flags: bit 0 says the caller records this trace.
    pub flags: u8,
}

impl TraceContext {
    /// Whether the caller records (samples) this trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 != 0
    }

    /// Whether both ids are valid (not all zero).
    pub fn is_valid(&self) -> bool {
        self.trace_id != [0; 16] && self.span_id != [0; 8]
    }

    /// A `traceparent` header's value: `00-<32 hex>-<16 hex>-<2 hex>` (a later version's value is read
    /// by its first four fields, as the W3C recommendation says; version `ff` and all-zero ids are
    /// invalid). Upper-case hex is refused, as the recommendation says.
    pub fn parse(value: &str) -> Option<TraceContext> {
        let b = value.trim().as_bytes();
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let version = hex::<1>(&b[0..2])?[0];
        if version == 0xff || (version == 0 && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
            return None;
        }
        let t = TraceContext {
            trace_id: hex::<16>(&b[3..35])?,
            span_id: hex::<8>(&b[36..52])?,
            flags: hex::<1>(&b[53..55])?[0],
        };
        t.is_valid().then_some(t)
    }

    /// The `traceparent` value naming `span_id` as the parent (version 00).
    pub fn traceparent(&self) -> String {
        let mut s = String::with_capacity(55);
        s.push_str("00-");
        push_hex(&mut s, &self.trace_id);
        s.push('-');
        push_hex(&mut s, &self.span_id);
        s.push('-');
        push_hex(&mut s, &[self.flags]);
        s
    }
}

fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        *out.get_mut(i)? = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Lower-case hex of `bytes` appended to `s`.
pub fn push_hex(s: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        s.push(HEX[usize::from(b >> 4)] as char);
        s.push(HEX[usize::from(b & 15)] as char);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip_and_bad_ones_are_refused() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::parse(v).unwrap();
        assert!(t.sampled());
        assert_eq!(t.span_id, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert_eq!(t.traceparent(), v);
        // A later version, read by its first fields.
        assert!(TraceContext::parse(&format!("cc{}-what-comes-next", &v[2..])).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }
}
