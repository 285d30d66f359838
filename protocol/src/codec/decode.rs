//! Bytes to frames: `decode` (one frame from a buffer's head, checked against the limits) and the
//! bodies' readers; nothing here panics on any input.

use super::{
    FLAG_ALLOWED, FLAG_HOLDS_LEASE, FLAG_LOG_ONLY, FLAG_OVER_QUOTA, FORM_ATTRIBUTES, FORM_ATTRIBUTES_MODE,
    FORM_ITEMS, FORM_ITEMS_MODES, FORM_TRACED, LIST_TRUNCATED, MODE_LEASE, WINDOWS,
};
use crate::fail_modes::{ClosedRule, FailModeList, ListedDimension};
use crate::frame::{
    Attributes, Body, Check, Decision, ErrorBody, Frame, Item, ItemDecision, ItemMode, Source, Verdict,
};
use crate::limits::{kind, HEADER, LEN_PREFIX, MAX_FRAME, MAX_ITEMS, MIN_VERSION, VERSION};
use crate::{DecodeError, ErrorCode, InvalidValue};

/// Decodes one frame from the front of `buf`, returning it and the number of bytes it took.
///
/// `Err(Incomplete)` asks for more bytes. `Err(Rejected)` names a well-delimited frame whose content is
/// refused: skip `frame_len` bytes and go on. `Err(Fatal)` means the stream cannot be resynchronised.
pub fn decode(buf: &[u8]) -> Result<(Frame, usize), DecodeError> {
    if buf.len() < LEN_PREFIX {
        return Err(DecodeError::Incomplete);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let frame_len = LEN_PREFIX.saturating_add(len);
    if frame_len > MAX_FRAME {
        // Name the request when its header has arrived, so the client can tell which call failed.
        let request_id =
            (buf.len() >= LEN_PREFIX + HEADER).then(|| u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]));
        return Err(DecodeError::Fatal {
            code: ErrorCode::FrameTooLarge,
            request_id,
            reason: format!("frame of {frame_len} bytes exceeds the {MAX_FRAME}-byte limit"),
        });
    }
    if len < HEADER {
        return Err(DecodeError::Fatal {
            code: ErrorCode::MalformedFrame,
            request_id: None,
            reason: format!("length {len} is shorter than the {HEADER}-byte header"),
        });
    }
    if buf.len() < frame_len {
        return Err(DecodeError::Incomplete);
    }
    let version = buf[4];
    let frame_kind = buf[5];
    let request_id = u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]);
    let reject = |code: ErrorCode, reason: String| DecodeError::Rejected {
        code,
        request_id,
        reason,
        frame_len,
    };
    if !(MIN_VERSION..=VERSION).contains(&version) && frame_kind != kind::HELLO {
        return Err(reject(
            ErrorCode::UnsupportedVersion,
            format!("frame version {version}; this peer speaks versions {MIN_VERSION} to {VERSION}"),
        ));
    }
    let mut r = Reader {
        buf: &buf[LEN_PREFIX + HEADER..frame_len],
        bad_text: None,
    };
    // Version 5: a check's form 4 carries a trace context before the check's own form.
    let mut trace = None;
    if frame_kind == kind::CHECK && r.buf.first() == Some(&FORM_TRACED) {
        let Some(t) = r.buf.get(1..26) else {
            return Err(DecodeError::Fatal {
                code: ErrorCode::MalformedFrame,
                request_id: Some(request_id),
                reason: "a traced check ends inside its trace context".into(),
            });
        };
        let t = crate::TraceContext {
            trace_id: t[..16].try_into().expect("16 bytes"),
            span_id: t[16..24].try_into().expect("8 bytes"),
            flags: t[24],
        };
        // An invalid context (all-zero ids) is dropped, as a bad traceparent header is.
        trace = t.is_valid().then_some(t);
        r.buf = &r.buf[26..];
    }
    let body = match decode_body(frame_kind, version, &mut r) {
        Ok(body) => body,
        Err(Problem::Malformed(reason)) => {
            return Err(DecodeError::Fatal {
                code: ErrorCode::MalformedFrame,
                request_id: Some(request_id),
                reason,
            });
        }
        Err(Problem::Invalid(reason)) => return Err(reject(ErrorCode::InvalidItem, reason)),
    };
    if !r.buf.is_empty() {
        return Err(DecodeError::Fatal {
            code: ErrorCode::MalformedFrame,
            request_id: Some(request_id),
            reason: format!("{} unexpected bytes after the body", r.buf.len()),
        });
    }
    if let Some(reason) = r.bad_text {
        return Err(reject(ErrorCode::InvalidItem, reason));
    }
    Ok((
        Frame {
            request_id,
            body,
            trace,
        },
        frame_len,
    ))
}

enum Problem {
    Malformed(String),
    Invalid(String),
}

fn decode_body(frame_kind: u8, version: u8, r: &mut Reader<'_>) -> Result<Body, Problem> {
    Ok(match frame_kind {
        kind::HELLO => Body::Hello {
            min_version: r.u8()?,
            max_version: r.u8()?,
        },
        kind::HELLO_OK => Body::HelloOk { version: r.u8()? },
        kind::CHECK => decode_check(r)?,
        kind::DECISION => decode_decision(version, r)?,
        kind::ERROR => Body::Error(ErrorBody {
            code: ErrorCode::from_u16(r.u16()?),
            message: r.str16()?,
        }),
        kind::PING => Body::Ping,
        kind::PONG => Body::Pong,
        kind::FAIL_MODES => Body::FailModes,
        kind::FAIL_MODE_LIST => decode_fail_mode_list(r)?,
        other => return Err(Problem::Malformed(format!("unknown frame kind 0x{other:02x}"))),
    })
}

/// A Check's body: its form (items or attributes, with or without modes), then nothing more;
/// validated unless some text was refused already.
fn decode_check(r: &mut Reader<'_>) -> Result<Body, Problem> {
    let check = match r.u8()? {
        form @ (FORM_ITEMS | FORM_ITEMS_MODES) => {
            let n = r.u8()? as usize;
            let mut items = Vec::with_capacity(n.min(MAX_ITEMS));
            for _ in 0..n {
                let key = r.str16()?;
                let rule_id = r.str8()?;
                let cost = r.u32()?;
                let (mode, lease) = if form == FORM_ITEMS_MODES {
                    r.mode()?
                } else {
                    (ItemMode::Consume, None)
                };
                items.push(Item {
                    key,
                    rule_id,
                    cost,
                    mode,
                    lease,
                });
            }
            Check::Items(items)
        }
        form @ (FORM_ATTRIBUTES | FORM_ATTRIBUTES_MODE) => {
            let mut a = Attributes::default();
            for slot in [
                &mut a.endpoint,
                &mut a.tier,
                &mut a.user,
                &mut a.api_key,
                &mut a.ip,
            ] {
                let v: String = r.str16()?;
                *slot = (!v.is_empty()).then_some(v);
            }
            a.cost = r.u32()?;
            if form == FORM_ATTRIBUTES_MODE {
                (a.mode, a.lease) = r.mode()?;
            }
            Check::Attributes(a)
        }
        form => return Err(Problem::Malformed(format!("unknown check form {form}"))),
    };
    if !r.buf.is_empty() {
        return Err(Problem::Malformed(format!(
            "{} unexpected bytes after the check",
            r.buf.len()
        )));
    }
    if r.bad_text.is_none() {
        check.validate().map_err(|e| Problem::Invalid(e.to_string()))?;
    }
    Ok(Body::Check(check))
}

/// A Decision's body: the combined verdict and each item's (with its rule window from version 4).
fn decode_decision(version: u8, r: &mut Reader<'_>) -> Result<Body, Problem> {
    let combined = r.verdict()?;
    let n = r.u8()? as usize;
    if n > MAX_ITEMS {
        return Err(Problem::Malformed(format!(
            "a decision carries at most {MAX_ITEMS} items, not {n}"
        )));
    }
    let mut items = Vec::with_capacity(n);
    for _ in 0..n {
        let rule_id = r.str8()?;
        let verdict = r.verdict()?;
        let window_ms = if version >= WINDOWS { r.u64()? } else { 0 };
        items.push(ItemDecision {
            rule_id,
            verdict,
            window_ms,
        });
    }
    Ok(Body::Decision(Decision { combined, items }))
}

/// A FailModeList's body: the rules version, its flags, and the enforced fail-closed rules.
fn decode_fail_mode_list(r: &mut Reader<'_>) -> Result<Body, Problem> {
    let rules_version = r.u64()?;
    let flags = r.u8()?;
    if flags & !LIST_TRUNCATED != 0 {
        return Err(Problem::Malformed(format!("unknown list flags 0x{flags:02x}")));
    }
    let n = r.u16()? as usize;
    // Each rule takes at least 15 bytes: no allocation beyond what the body can hold.
    let mut rules = Vec::with_capacity(n.min(r.buf.len() / 15));
    for _ in 0..n {
        let rule_id = r.str8()?;
        let d = r.u8()?;
        let dimension = ListedDimension::from_u8(d)
            .ok_or_else(|| Problem::Malformed(format!("unknown dimension {d}")))?;
        rules.push(ClosedRule {
            rule_id,
            dimension,
            endpoint: r.str16()?,
            tier: r.str16()?,
            limit: r.u64()?,
        });
    }
    Ok(Body::FailModeList(FailModeList {
        rules_version,
        truncated: flags & LIST_TRUNCATED != 0,
        rules,
    }))
}

struct Reader<'a> {
    buf: &'a [u8],
    /// Text that was not UTF-8, or an item mode this peer does not know: noted, and refused only
    /// once the whole body has parsed (a body that does not parse is malformed, which closes the
    /// connection; a refused value only refuses the check).
    bad_text: Option<String>,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Problem> {
        if self.buf.len() < n {
            return Err(Problem::Malformed(format!(
                "body ends early: wanted {n} more bytes, {} left",
                self.buf.len()
            )));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, Problem> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, Problem> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, Problem> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Problem> {
        let b = self.take(8)?;
        let mut a = [0; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// A string of `n` bytes, as a `String` or (keys and rule ids) a `CompactString`, which holds
    /// up to 24 bytes inline: most keys and every short rule id decode without an allocation.
    fn string<S: for<'s> From<&'s str> + Default>(&mut self, n: usize) -> Result<S, Problem> {
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(S::from(s)),
            Err(_) => {
                self.bad_text
                    .get_or_insert_with(|| "text is not valid UTF-8".into());
                Ok(S::default())
            }
        }
    }

    fn str8<S: for<'s> From<&'s str> + Default>(&mut self) -> Result<S, Problem> {
        let n = self.u8()? as usize;
        self.string(n)
    }

    fn str16<S: for<'s> From<&'s str> + Default>(&mut self) -> Result<S, Problem> {
        let n = self.u16()? as usize;
        self.string(n)
    }

    /// An item mode and the lease that follows it when bit 7 is set; a mode this peer does not know
    /// refuses the check (error 5) once the body has parsed, as bad text does.
    fn mode(&mut self) -> Result<(ItemMode, Option<u64>), Problem> {
        let b = self.u8()?;
        let mode = ItemMode::from_u8(b & !MODE_LEASE).unwrap_or_else(|| {
            self.bad_text
                .get_or_insert_with(|| InvalidValue::UnknownMode(b).to_string());
            ItemMode::Consume
        });
        let lease = if b & MODE_LEASE != 0 {
            Some(self.u64()?)
        } else {
            None
        };
        Ok((mode, lease))
    }

    fn verdict(&mut self) -> Result<Verdict, Problem> {
        let flags = self.u8()?;
        if flags & !(FLAG_ALLOWED | FLAG_LOG_ONLY | FLAG_HOLDS_LEASE | FLAG_OVER_QUOTA) != 0 {
            return Err(Problem::Malformed(format!("unknown verdict flags 0x{flags:02x}")));
        }
        let source = self.u8()?;
        let source =
            Source::from_u8(source).ok_or_else(|| Problem::Malformed(format!("unknown source {source}")))?;
        Ok(Verdict {
            allowed: flags & FLAG_ALLOWED != 0,
            log_only: flags & FLAG_LOG_ONLY != 0,
            holds_lease: flags & FLAG_HOLDS_LEASE != 0,
            over_quota: flags & FLAG_OVER_QUOTA != 0,
            source,
            limit: self.u64()?,
            remaining: self.u64()?,
            reset_at_ms: self.u64()?,
            retry_after_ms: self.u64()?,
        })
    }
}
