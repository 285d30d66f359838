//! The RateLimitResponse written as protobuf bytes straight from a decision: no message structs,
//! no `String` per rule name or header, numbers written in place.
//!
//! Building prost's `RateLimitResponse` and encoding it cost the native server ~2,500 instructions
//! a check (a `Vec` of statuses, a `String` per limit name and per header name and value, prost's
//! varint writer) of ~13,000; this writes the same message (fields in another order, which protobuf
//! allows) for a fraction. The tonic server decodes these bytes into its message.

use std::io::Write;

use floodgate_protocol::http::{
    binding_rule, retry_after_seconds, write_rate_limit_headers, HeaderFigures, HeaderText,
};
use floodgate_protocol::Decision;

use super::proto::{Code, Unit};

/// What one descriptor of a request became.
#[derive(Debug, Clone, Copy)]
pub enum Slot {
    /// This item of the check.
    Item(usize),
    /// No rule answers it (or it asked for what cannot be done): OK, no limit.
    NoRule,
    /// An unlimited rule answers it: OK, no limit, all remaining.
    Unlimited,
}

/// Which rate-limit headers go into `response_headers_to_add`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GrpcHeaders {
    /// None: Envoy's own `enable_x_ratelimit_headers` (or nothing) makes them.
    None,
    /// `X-RateLimit-Limit/Remaining/Reset` on every response a rule applied to, `Retry-After` on
    /// every over-limit one (the SDK Layer's headers).
    #[default]
    XRatelimit,
    /// Those and the IETF draft's `RateLimit` and `RateLimit-Policy`.
    Both,
}

// RateLimitResponse's fields.
const OVERALL_CODE: u32 = 1;
const STATUSES: u32 = 2;
const RESPONSE_HEADERS: u32 = 3;
const REQUEST_HEADERS: u32 = 4;
const DYNAMIC_METADATA: u32 = 6;
// Struct's and its map entries'; Value's.
const FIELDS: u32 = 1;
const ENTRY_KEY: u32 = 1;
const ENTRY_VALUE: u32 = 2;
const STRING_VALUE: u32 = 3;
const BOOL_VALUE: u32 = 4;
// DescriptorStatus's.
const CODE: u32 = 1;
const CURRENT_LIMIT: u32 = 2;
const LIMIT_REMAINING: u32 = 3;
const DURATION_UNTIL_RESET: u32 = 4;
// RateLimit's.
const REQUESTS_PER_UNIT: u32 = 1;
const UNIT: u32 = 2;
const NAME: u32 = 3;
// Duration's.
const SECONDS: u32 = 1;
const NANOS: u32 = 2;
// HeaderValue's.
const KEY: u32 = 1;
const VALUE: u32 = 2;

/// A decided request's answer: each slot's status, then the headers (`headers`; `Retry-After` when
/// over the limit) and the overall code. `window_ms(slot, item)` is the window whose unit a status
/// names. Returns whether the request is allowed.
pub fn write(
    out: &mut Vec<u8>,
    d: &Decision,
    slots: &[Slot],
    window_ms: impl Fn(usize, &floodgate_protocol::ItemDecision) -> u64,
    headers: GrpcHeaders,
    now: u64,
) -> bool {
    let mut over_any = false;
    // The longest wait among the descriptors over the limit, and that descriptor's item.
    let mut longest = 0;
    let mut worst: Option<usize> = None;
    for slot in slots {
        let item = match slot {
            Slot::Item(i) => d.items.get(*i).map(|item| (*i, item)),
            _ => None,
        };
        let Some((i, item)) = item else {
            not_limited(out, *slot);
            continue;
        };
        let v = &item.verdict;
        // Shadow (log) mode answers OK, as envoyproxy/ratelimit's shadow_mode does.
        let over = !v.allowed && !v.log_only;
        // Over the limit: when this request could pass; else when the key is full again.
        let until = if over {
            v.retry_after_ms
        } else {
            v.reset_at_ms.saturating_sub(now)
        };
        if over {
            over_any = true;
            if worst.is_none() || until > longest {
                worst = Some(i);
            }
            longest = longest.max(until);
        }
        let window = window_ms(i, item);
        status(out, item, over, until, window);
    }
    // Envoy's overall code is OVER_LIMIT when any descriptor is: a hits_addend-0 descriptor past
    // its limit too, though a peek does not decide the check's consume items.
    let allowed = d.combined.allowed && !over_any;
    if headers != GrpcHeaders::None {
        let c = &d.combined;
        // Refused: the headers name the descriptor that refused (the longest wait), with nothing
        // remaining and its reset no sooner than the wait, so the 429 Envoy writes agrees with the
        // status (a peek over its limit refuses a check whose combined verdict allowed it).
        let figures = match worst.and_then(|i| d.items.get(i)).filter(|_| !allowed) {
            Some(item) => Some(HeaderFigures {
                rule: &item.rule_id,
                window_ms: item.window_ms,
                limit: item.verdict.limit,
                remaining: 0,
                reset_at_ms: item.verdict.reset_at_ms.max(now + longest),
            }),
            None => {
                binding_rule(&d.items, c.limit, c.remaining, c.reset_at_ms).map(|binding| HeaderFigures {
                    rule: &binding.rule_id,
                    window_ms: binding.window_ms,
                    limit: c.limit,
                    remaining: if allowed { c.remaining } else { 0 },
                    reset_at_ms: if allowed {
                        c.reset_at_ms
                    } else {
                        c.reset_at_ms.max(now + c.retry_after_ms)
                    },
                })
            }
        };
        if let Some(figures) = figures {
            write_rate_limit_headers(figures, headers == GrpcHeaders::Both, now, |name, value| {
                header(out, name, value)
            });
        }
        if !allowed {
            // The combined verdict's wait, unless only a peek or a charge is over.
            let seconds = retry_after_seconds(longest.max(c.retry_after_ms));
            header(out, "retry-after", HeaderText::Number(seconds));
        }
    }
    if allowed && d.combined.over_quota {
        over_quota(out, d);
    }
    uint(
        out,
        OVERALL_CODE,
        if allowed { Code::Ok } else { Code::OverLimit } as u64,
    );
    allowed
}

/// Quota mode: a request let through past the limit of rules with `overLimit = "flag"` carries
/// dynamic metadata `over_quota: true` and `over_quota_rules: "<ids>"` (the route and the next
/// filters read them in `envoy.filters.http.ratelimit`'s namespace), and the upstream request the
/// header `x-ratelimit-over-quota: <ids>`.
fn over_quota(out: &mut Vec<u8>, d: &Decision) {
    let mut rules = String::new();
    for item in d.items.iter().filter(|i| i.verdict.over_quota) {
        if !rules.is_empty() {
            rules.push(',');
        }
        rules.push_str(&item.rule_id);
    }
    nested(out, REQUEST_HEADERS, |o| {
        string(o, KEY, b"x-ratelimit-over-quota");
        string(o, VALUE, rules.as_bytes());
    });
    nested(out, DYNAMIC_METADATA, |o| {
        nested(o, FIELDS, |e| {
            string(e, ENTRY_KEY, b"over_quota");
            nested(e, ENTRY_VALUE, |v| uint(v, BOOL_VALUE, 1));
        });
        nested(o, FIELDS, |e| {
            string(e, ENTRY_KEY, b"over_quota_rules");
            nested(e, ENTRY_VALUE, |v| string(v, STRING_VALUE, rules.as_bytes()));
        });
    });
}

/// One descriptor's status: its code, the rule's limit in the unit of `window`, what remains (0
/// over the limit), and `until` (ms) as the duration until reset.
fn status(out: &mut Vec<u8>, item: &floodgate_protocol::ItemDecision, over: bool, until: u64, window: u64) {
    nested(out, STATUSES, |o| {
        uint(o, CODE, if over { Code::OverLimit } else { Code::Ok } as u64);
        nested(o, CURRENT_LIMIT, |o| {
            string(o, NAME, item.rule_id.as_bytes());
            uint(o, REQUESTS_PER_UNIT, item.verdict.limit.min(u64::from(u32::MAX)));
            uint(o, UNIT, unit(window) as u64);
        });
        // Over the limit is nothing left, whatever a larger cost would have found.
        uint(
            o,
            LIMIT_REMAINING,
            if over {
                0
            } else {
                item.verdict.remaining.min(u64::from(u32::MAX))
            },
        );
        nested(o, DURATION_UNTIL_RESET, |o| {
            uint(o, SECONDS, until / 1_000);
            uint(o, NANOS, (until % 1_000) * 1_000_000);
        });
    });
}

/// A request none of whose descriptors is limited: each OK, overall OK.
pub fn write_unlimited(out: &mut Vec<u8>, slots: &[Slot]) {
    for slot in slots {
        not_limited(out, *slot);
    }
    uint(out, OVERALL_CODE, Code::Ok as u64);
}

/// The status of a descriptor that is not counted, as envoyproxy/ratelimit answers one: OK without
/// a limit, remaining 0 when no rule applies and the largest count when it is unlimited.
fn not_limited(out: &mut Vec<u8>, slot: Slot) {
    nested(out, STATUSES, |o| {
        uint(o, CODE, Code::Ok as u64);
        if matches!(slot, Slot::Unlimited) {
            uint(o, LIMIT_REMAINING, u64::from(u32::MAX));
        }
    });
}

/// Envoy's unit for a window that is exactly one; any other window is `UNKNOWN`.
pub fn unit(window_ms: u64) -> Unit {
    match window_ms {
        1_000 => Unit::Second,
        60_000 => Unit::Minute,
        3_600_000 => Unit::Hour,
        86_400_000 => Unit::Day,
        604_800_000 => Unit::Week,
        _ => Unit::Unknown,
    }
}

fn header(out: &mut Vec<u8>, name: &str, value: HeaderText<'_>) {
    nested(out, RESPONSE_HEADERS, |o| {
        string(o, KEY, name.as_bytes());
        match value {
            HeaderText::Number(n) => string(o, VALUE, itoa::Buffer::new().format(n).as_bytes()),
            HeaderText::Formatted(text) => {
                tag(o, VALUE, 2);
                let at = o.len();
                o.push(0);
                // Writing to a Vec cannot fail.
                let _ = o.write_fmt(text);
                fix_len(o, at);
            }
        }
    });
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn tag(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field << 3 | u32::from(wire)));
}

/// A varint field, left out when 0 (proto3's default).
fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        tag(out, field, 0);
        varint(out, v);
    }
}

/// A bytes or string field, left out when empty.
fn string(out: &mut Vec<u8>, field: u32, s: &[u8]) {
    if !s.is_empty() {
        tag(out, field, 2);
        varint(out, s.len() as u64);
        out.extend_from_slice(s);
    }
}

/// A message field (present even when empty, as prost writes a `Some`).
#[inline]
fn nested(out: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    tag(out, field, 2);
    let at = out.len();
    out.push(0);
    body(out);
    fix_len(out, at);
}

/// Sets the one-byte length placeholder at `at` to the bytes after it, widening it past 127.
#[inline]
fn fix_len(out: &mut Vec<u8>, at: usize) {
    let len = out.len() - at - 1;
    if len < 0x80 {
        out[at] = len as u8;
    } else {
        let mut prefix = Vec::with_capacity(4);
        varint(&mut prefix, len as u64);
        out.splice(at..=at, prefix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envoy::proto::{DescriptorStatus, Duration, HeaderValue, RateLimit, RateLimitResponse};
    use floodgate_protocol::{ItemDecision, Source, Verdict};
    use prost::Message;

    fn verdict(allowed: bool, log_only: bool, remaining: u64, reset: u64, retry: u64) -> Verdict {
        Verdict {
            allowed,
            log_only,
            holds_lease: false,
            over_quota: false,
            source: Source::Redis,
            limit: 10,
            remaining,
            reset_at_ms: reset,
            retry_after_ms: retry,
        }
    }

    #[test]
    fn the_bytes_are_the_message_prost_reads() {
        let denied = verdict(false, false, 0, 61_000, 2_500);
        let d = Decision {
            combined: denied,
            items: vec![
                ItemDecision {
                    rule_id: "per-ip".into(),
                    verdict: denied,
                    window_ms: 60_000,
                },
                ItemDecision {
                    rule_id: "shadow-".repeat(20).into(),
                    verdict: verdict(false, true, 0, 1_500, 400),
                    window_ms: 1_000,
                },
            ],
        };
        let slots = [Slot::Item(0), Slot::NoRule, Slot::Item(1), Slot::Unlimited];
        let mut out = Vec::new();
        let allowed = write(&mut out, &d, &slots, |_, i| i.window_ms, GrpcHeaders::Both, 1_000);
        assert!(!allowed);
        let r = RateLimitResponse::decode(&out[..]).unwrap();
        let status = |code: Code, name: &str, rpu, unit: Unit, remaining, ms: u64| DescriptorStatus {
            code: code as i32,
            current_limit: Some(RateLimit {
                name: name.into(),
                requests_per_unit: rpu,
                unit: unit as i32,
            }),
            limit_remaining: remaining,
            duration_until_reset: Some(Duration::from_ms(ms)),
        };
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(
            r.statuses,
            vec![
                status(Code::OverLimit, "per-ip", 10, Unit::Minute, 0, 2_500),
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
                // A name past 127 bytes: its message's length takes two bytes.
                status(Code::Ok, &"shadow-".repeat(20), 10, Unit::Second, 0, 500),
                DescriptorStatus {
                    code: Code::Ok as i32,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                },
            ]
        );
        let h = |k: &str, v: &str| HeaderValue {
            key: k.into(),
            value: v.into(),
        };
        assert_eq!(
            r.response_headers_to_add,
            vec![
                h("x-ratelimit-limit", "10"),
                h("x-ratelimit-remaining", "0"),
                h("x-ratelimit-reset", "61"),
                h("ratelimit-policy", "\"per-ip\";q=10;w=60"),
                h("ratelimit", "\"per-ip\";r=0;t=60"),
                h("retry-after", "3"),
            ]
        );
        // No headers asked, nothing limited.
        out.clear();
        write_unlimited(&mut out, &[Slot::NoRule]);
        let r = RateLimitResponse::decode(&out[..]).unwrap();
        assert_eq!((r.overall_code, r.statuses.len()), (Code::Ok as i32, 1));
    }

    /// A peek over its budget refuses a check whose consume items passed: the headers Envoy copies
    /// into the 429 name the peeked rule, nothing remaining, and its reset, not the passed item's.
    #[test]
    fn a_refusal_s_headers_agree_with_its_status() {
        let passed = verdict(true, false, 20, 1_000, 0);
        let d = Decision {
            combined: passed,
            items: vec![
                ItemDecision {
                    rule_id: "per-user".into(),
                    verdict: passed,
                    window_ms: 60_000,
                },
                ItemDecision {
                    rule_id: "budget".into(),
                    verdict: verdict(false, false, 0, 31_000, 30_000),
                    window_ms: 60_000,
                },
            ],
        };
        let mut out = Vec::new();
        let slots = [Slot::Item(0), Slot::Item(1)];
        assert!(!write(
            &mut out,
            &d,
            &slots,
            |_, i| i.window_ms,
            GrpcHeaders::Both,
            1_000
        ));
        let r = RateLimitResponse::decode(&out[..]).unwrap();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        let headers: Vec<(String, String)> = r
            .response_headers_to_add
            .into_iter()
            .map(|h| (h.key, h.value))
            .collect();
        let h = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(
            headers,
            vec![
                h("x-ratelimit-limit", "10"),
                h("x-ratelimit-remaining", "0"),
                h("x-ratelimit-reset", "31"),
                h("ratelimit-policy", "\"budget\";q=10;w=60"),
                h("ratelimit", "\"budget\";r=0;t=30"),
                h("retry-after", "30"),
            ]
        );
    }

    #[test]
    fn durations_and_units() {
        assert_eq!(unit(60_000), Unit::Minute);
        assert_eq!(unit(90_000), Unit::Unknown);
    }
}
