//! What a limiter decision means at HTTP: the rate-limit headers, `Retry-After`, and the hash that
//! makes any client-written value a valid key. Shared by the SDK's tower Layer and the agent's
//! Envoy service, so a client sees the same headers whichever way it was limited.

use crate::limits::MAX_ATTRIBUTE;

/// The figures a response's headers are made from (the binding item's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderFigures<'a> {
    /// The binding rule's id (named in the IETF headers).
    pub rule: &'a str,
    /// Its limit per window.
    pub limit: u64,
    /// Units left.
    pub remaining: u64,
    /// Unix ms at which the key is back to its full limit.
    pub reset_at_ms: u64,
    /// The rule's window in ms (`RateLimit-Policy`'s `w`, in whole seconds rounded up); 0 for none
    /// (a concurrency rule, or an agent of protocol version 3 or older).
    pub window_ms: u64,
}

/// `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (epoch seconds, rounded up),
/// plus, with `ietf`, draft-ietf-httpapi-ratelimit-headers' `RateLimit-Policy` and `RateLimit`
/// (seconds until reset), as lower-case names and values.
pub fn rate_limit_headers(f: HeaderFigures<'_>, ietf: bool, now_ms: u64) -> Vec<(&'static str, String)> {
    let mut h = Vec::with_capacity(if ietf { 5 } else { 3 });
    write_rate_limit_headers(f, ietf, now_ms, |name, value| h.push((name, value.to_string())));
    h
}

/// A header value as [`write_rate_limit_headers`] makes it: a number, or text to format.
#[derive(Debug, Clone, Copy)]
pub enum HeaderText<'a> {
    /// A decimal number.
    Number(u64),
    /// Anything else.
    Formatted(std::fmt::Arguments<'a>),
}

impl std::fmt::Display for HeaderText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderText::Number(n) => write!(f, "{n}"),
            HeaderText::Formatted(a) => f.write_fmt(*a),
        }
    }
}

/// [`rate_limit_headers`], each name and value handed to `put` as it is made (no `String` of its
/// own: the gRPC service writes them straight into its answer).
pub fn write_rate_limit_headers(
    f: HeaderFigures<'_>,
    ietf: bool,
    now_ms: u64,
    mut put: impl FnMut(&'static str, HeaderText<'_>),
) {
    put("x-ratelimit-limit", HeaderText::Number(f.limit));
    put("x-ratelimit-remaining", HeaderText::Number(f.remaining));
    put(
        "x-ratelimit-reset",
        HeaderText::Number(f.reset_at_ms.div_ceil(1_000)),
    );
    if ietf {
        // Rule ids are [A-Za-z0-9_.:-], safe in a quoted string.
        let t = f.reset_at_ms.saturating_sub(now_ms).div_ceil(1_000);
        let (rule, limit, remaining) = (f.rule, f.limit, f.remaining);
        match f.window_ms.div_ceil(1_000) {
            0 => put(
                "ratelimit-policy",
                HeaderText::Formatted(format_args!("\"{rule}\";q={limit}")),
            ),
            w => put(
                "ratelimit-policy",
                HeaderText::Formatted(format_args!("\"{rule}\";q={limit};w={w}")),
            ),
        }
        put(
            "ratelimit",
            HeaderText::Formatted(format_args!("\"{rule}\";r={remaining};t={t}")),
        );
    }
}

/// The enforced item whose figures a combined verdict (`limit`, `remaining`, `reset_at_ms`) carries:
/// the rule the headers name. None when no enforced rule applied (`limit` 0).
pub fn binding_rule(
    items: &[crate::ItemDecision],
    limit: u64,
    remaining: u64,
    reset_at_ms: u64,
) -> Option<&crate::ItemDecision> {
    if limit == 0 {
        return None;
    }
    items.iter().filter(|i| !i.verdict.log_only).find(|i| {
        i.verdict.limit == limit && i.verdict.remaining == remaining && i.verdict.reset_at_ms == reset_at_ms
    })
}

/// `Retry-After` in whole seconds: rounded up, never 0 (a client told 0 retries at once).
pub fn retry_after_seconds(retry_after_ms: u64) -> u64 {
    retry_after_ms.div_ceil(1_000).max(1)
}

/// A value the agent accepts as a key or attribute: as it is when the wire allows it (at most
/// [`MAX_ATTRIBUTE`] bytes, no `{`, `}` or control character), else `h:` and the 16 lower-case hex
/// digits of its 64-bit FNV-1a hash (offset basis 0xcbf29ce484222325, prime 0x100000001b3, over the
/// UTF-8 bytes). The same value always maps to the same key, so a client sending an odd value is
/// still limited, under a key of its own, instead of making the check invalid.
pub fn wire_safe(value: String) -> String {
    let ok = value.len() <= MAX_ATTRIBUTE && !value.chars().any(|c| c == '{' || c == '}' || c.is_control());
    if ok {
        return value;
    }
    format!("h:{:016x}", fnv1a64(value.as_bytes()))
}

/// 64-bit FNV-1a.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_values_hash_and_fine_values_stay() {
        assert_eq!(wire_safe("user:1".into()), "user:1");
        // FNV-1a of "a{b}" computed by hand from the definition above.
        let h = wire_safe("a{b}".into());
        assert_eq!(h, format!("h:{:016x}", fnv1a64(b"a{b}")));
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(wire_safe("x".repeat(257)).len(), 18);
        // PROTOCOL.md's worked example.
        assert_eq!(wire_safe("{victim}".into()), "h:0a5b9694d4ec70f5");
    }

    #[test]
    fn headers_round_up_and_name_the_rule() {
        let f = HeaderFigures {
            rule: "r",
            limit: 10,
            remaining: 3,
            reset_at_ms: 2_001,
            window_ms: 0,
        };
        let h = rate_limit_headers(f, true, 1_000);
        assert_eq!(h[2], ("x-ratelimit-reset", "3".to_string()));
        assert_eq!(h[3], ("ratelimit-policy", "\"r\";q=10".to_string()));
        assert_eq!(h[4], ("ratelimit", "\"r\";r=3;t=2".to_string()));
        // A window in whole seconds, rounded up (a 500 ms window is w=1, never w=0).
        let windowed = |window_ms| {
            rate_limit_headers(HeaderFigures { window_ms, ..f }, true, 1_000)[3]
                .1
                .clone()
        };
        assert_eq!(windowed(60_000), "\"r\";q=10;w=60");
        assert_eq!(windowed(500), "\"r\";q=10;w=1");
        assert_eq!(windowed(2_678_400_000), "\"r\";q=10;w=2678400");
        assert_eq!(retry_after_seconds(0), 1);
        assert_eq!(retry_after_seconds(1_001), 2);
    }
}
