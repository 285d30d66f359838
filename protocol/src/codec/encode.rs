//! Frames to bytes: `Frame::encode`, `encode_for` a peer's version, and the body's writers.

use super::{
    FLAG_ALLOWED, FLAG_HOLDS_LEASE, FLAG_LOG_ONLY, FLAG_OVER_QUOTA, FORM_ATTRIBUTES, FORM_ATTRIBUTES_MODE,
    FORM_ITEMS, FORM_ITEMS_MODES, FORM_TRACED, LIST_TRUNCATED, MODE_LEASE, OVER_QUOTA, WINDOWS,
};
use crate::frame::{Body, Check, Frame, ItemMode, Verdict};
use crate::limits::{kind, LEN_PREFIX, MAX_FRAME, MAX_ITEMS, MAX_MESSAGE, VERSION};
use crate::EncodeError;

impl Frame {
    /// A frame.
    pub fn new(request_id: u32, body: Body) -> Self {
        Frame {
            request_id,
            body,
            trace: None,
        }
    }

    /// Appends the encoded frame to `out`, each kind in the newest form it has. Fails, writing
    /// nothing, if the frame breaks a limit.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.encode_for(out, VERSION)
    }

    /// `encode` for a peer that negotiated `peer_version`: a Decision whose items carry rule windows
    /// is written in version 4's form only to a peer of version 4 or later (to an older one, without
    /// them); with no window to carry, in version 1's form, which every peer reads.
    pub fn encode_for(&self, out: &mut Vec<u8>, peer_version: u8) -> Result<(), EncodeError> {
        match &self.body {
            Body::Check(check) => check
                .validate()
                .map_err(|e| EncodeError::Invalid(e.to_string()))?,
            Body::Decision(d) if d.items.len() > MAX_ITEMS => {
                return Err(EncodeError::Invalid(format!(
                    "a decision carries at most {MAX_ITEMS} items, not {}",
                    d.items.len()
                )))
            }
            _ => {}
        }
        let start = out.len();
        out.extend_from_slice(&[0; LEN_PREFIX]);
        let version = match self.body {
            // Hello is understood by every version; it announces the range itself.
            Body::Hello { max_version, .. } => max_version.min(VERSION),
            // Each frame carries the version that introduced its kind, so a version-1 peer reads
            // every frame it knows.
            Body::FailModes | Body::FailModeList(_) => 2,
            Body::Decision(ref d) if peer_version >= WINDOWS && d.items.iter().any(|i| i.window_ms > 0) => {
                WINDOWS
            }
            _ => 1,
        };
        out.push(version);
        out.push(self.kind());
        out.extend_from_slice(&self.request_id.to_be_bytes());
        self.encode_body(out, version >= WINDOWS, peer_version >= OVER_QUOTA);
        let len = out.len() - start;
        if len > MAX_FRAME {
            out.truncate(start);
            return Err(EncodeError::TooLarge(len));
        }
        let prefix = u32::try_from(len - LEN_PREFIX).expect("bounded by MAX_FRAME");
        out[start..start + LEN_PREFIX].copy_from_slice(&prefix.to_be_bytes());
        Ok(())
    }

    /// The encoded frame as a new vector.
    pub fn to_bytes(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(64);
        self.encode(&mut out)?;
        Ok(out)
    }

    fn kind(&self) -> u8 {
        match self.body {
            Body::Hello { .. } => kind::HELLO,
            Body::HelloOk { .. } => kind::HELLO_OK,
            Body::Check(_) => kind::CHECK,
            Body::Decision(_) => kind::DECISION,
            Body::Error(_) => kind::ERROR,
            Body::Ping => kind::PING,
            Body::Pong => kind::PONG,
            Body::FailModes => kind::FAIL_MODES,
            Body::FailModeList(_) => kind::FAIL_MODE_LIST,
        }
    }

    fn encode_body(&self, out: &mut Vec<u8>, windows: bool, over_quota: bool) {
        match &self.body {
            Body::Hello {
                min_version,
                max_version,
            } => out.extend_from_slice(&[*min_version, *max_version]),
            Body::HelloOk { version } => out.push(*version),
            Body::Check(check) => {
                if let Some(t) = &self.trace {
                    out.push(FORM_TRACED);
                    out.extend_from_slice(&t.trace_id);
                    out.extend_from_slice(&t.span_id);
                    out.push(t.flags);
                }
                encode_check(out, check);
            }
            Body::Decision(d) => {
                put_verdict(out, &d.combined, over_quota);
                out.push(d.items.len() as u8);
                for item in &d.items {
                    put_str8(out, &item.rule_id);
                    put_verdict(out, &item.verdict, over_quota);
                    if windows {
                        out.extend_from_slice(&item.window_ms.to_be_bytes());
                    }
                }
            }
            Body::Error(e) => {
                out.extend_from_slice(&e.code.to_u16().to_be_bytes());
                let msg = truncate_utf8(&e.message, MAX_MESSAGE);
                put_str16(out, msg);
            }
            Body::Ping | Body::Pong | Body::FailModes => {}
            Body::FailModeList(list) => {
                out.extend_from_slice(&list.rules_version.to_be_bytes());
                out.push(if list.truncated { LIST_TRUNCATED } else { 0 });
                let n = list.rules.len().min(u16::MAX as usize);
                out.extend_from_slice(&(n as u16).to_be_bytes());
                for r in &list.rules[..n] {
                    put_str8(out, &r.rule_id);
                    out.push(r.dimension.to_u8());
                    put_str16(out, &r.endpoint);
                    put_str16(out, &r.tier);
                    out.extend_from_slice(&r.limit.to_be_bytes());
                }
            }
        }
    }
}

/// A check's own form (0 to 3) and body.
fn encode_check(out: &mut Vec<u8>, check: &Check) {
    match check {
        Check::Items(items) => {
            // Every item consuming: version 1's form, which every agent reads.
            let modes = items
                .iter()
                .any(|i| i.mode != ItemMode::Consume || i.lease.is_some());
            out.push(if modes { FORM_ITEMS_MODES } else { FORM_ITEMS });
            out.push(items.len() as u8);
            for item in items {
                put_str16(out, &item.key);
                put_str8(out, &item.rule_id);
                out.extend_from_slice(&item.cost.to_be_bytes());
                if modes {
                    put_mode(out, item.mode, item.lease);
                }
            }
        }
        Check::Attributes(a) => {
            let modes = a.mode != ItemMode::Consume || a.lease.is_some();
            out.push(if modes {
                FORM_ATTRIBUTES_MODE
            } else {
                FORM_ATTRIBUTES
            });
            for (_, value) in a.fields() {
                put_str16(out, value.as_deref().unwrap_or(""));
            }
            out.extend_from_slice(&a.cost.to_be_bytes());
            if modes {
                put_mode(out, a.mode, a.lease);
            }
        }
    }
}

fn put_mode(out: &mut Vec<u8>, mode: ItemMode, lease: Option<u64>) {
    match lease {
        Some(id) => {
            out.push(mode.to_u8() | MODE_LEASE);
            out.extend_from_slice(&id.to_be_bytes());
        }
        None => out.push(mode.to_u8()),
    }
}

fn put_str8(out: &mut Vec<u8>, s: &str) {
    let s = truncate_utf8(s, u8::MAX as usize);
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    let s = truncate_utf8(s, u16::MAX as usize);
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A verdict's 34 bytes; its over-quota flag only for a peer that reads it (version 6), an older
/// one seeing the allowed verdict it is.
fn put_verdict(out: &mut Vec<u8>, v: &Verdict, over_quota: bool) {
    let mut flags = 0;
    if v.allowed {
        flags |= FLAG_ALLOWED;
    }
    if v.log_only {
        flags |= FLAG_LOG_ONLY;
    }
    if v.holds_lease {
        flags |= FLAG_HOLDS_LEASE;
    }
    if v.over_quota && over_quota {
        flags |= FLAG_OVER_QUOTA;
    }
    out.push(flags);
    out.push(v.source.to_u8());
    for n in [v.limit, v.remaining, v.reset_at_ms, v.retry_after_ms] {
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
