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
    let mut h = vec![
        ("x-ratelimit-limit", f.limit.to_string()),
        ("x-ratelimit-remaining", f.remaining.to_string()),
        ("x-ratelimit-reset", f.reset_at_ms.div_ceil(1_000).to_string()),
    ];
    if ietf {
        // Rule ids are [A-Za-z0-9_.:-], safe in a quoted string.
        let t = f.reset_at_ms.saturating_sub(now_ms).div_ceil(1_000);
        let policy = match f.window_ms {
            0 => format!("\"{}\";q={}", f.rule, f.limit),
            w => format!("\"{}\";q={};w={}", f.rule, f.limit, w.div_ceil(1_000)),
        };
        h.push(("ratelimit-policy", policy));
        h.push(("ratelimit", format!("\"{}\";r={};t={t}", f.rule, f.remaining)));
    }
    h
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
