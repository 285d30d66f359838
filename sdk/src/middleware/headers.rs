//! The headers a decision sets (`X-RateLimit-*`, optionally the IETF draft's) and `Retry-After`,
//! as the gRPC service and every SDK set them (`floodgate_protocol::http`).

use http::header::{HeaderName, HeaderValue};

use crate::Decision;

/// The headers for a decision (none when no enforced rule applied).
pub fn rate_limit_headers(d: &Decision, ietf: bool, now_ms: u64) -> Vec<(HeaderName, HeaderValue)> {
    let Some(binding) = binding_rule(d) else {
        return Vec::new();
    };
    let figures = floodgate_protocol::http::HeaderFigures {
        rule: &binding.rule_id,
        window_ms: binding.window_ms,
        limit: d.limit,
        remaining: d.remaining,
        reset_at_ms: d.reset_at_ms,
    };
    floodgate_protocol::http::rate_limit_headers(figures, ietf, now_ms)
        .into_iter()
        .filter_map(|(name, value)| Some((HeaderName::from_static(name), HeaderValue::try_from(value).ok()?)))
        .collect()
}

/// The enforced rule whose figures the decision carries, if any.
fn binding_rule(d: &Decision) -> Option<&floodgate_protocol::ItemDecision> {
    floodgate_protocol::http::binding_rule(&d.items, d.limit, d.remaining, d.reset_at_ms)
}

/// `Retry-After` in whole seconds: rounded up, never 0.
pub fn retry_after_seconds(d: &Decision) -> u64 {
    floodgate_protocol::http::retry_after_seconds(d.retry_after_ms.unwrap_or(1_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_never_zero() {
        let d = |ms| Decision {
            allowed: false,
            limit: 5,
            remaining: 0,
            reset_at_ms: 0,
            retry_after_ms: ms,
            origin: crate::Origin::FailClosed(crate::Degraded::Timeout),
            items: Vec::new(),
        };
        assert_eq!(retry_after_seconds(&d(Some(1))), 1);
        assert_eq!(retry_after_seconds(&d(Some(1_000))), 1);
        assert_eq!(retry_after_seconds(&d(Some(1_001))), 2);
        assert_eq!(retry_after_seconds(&d(Some(0))), 1);
        assert_eq!(retry_after_seconds(&d(None)), 1);
    }
}
