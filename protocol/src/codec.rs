//! Encoding frames to bytes and decoding them back; the decoder never panics on any input.

use crate::fail_modes::{ClosedRule, FailModeList, ListedDimension};
use crate::frame::{
    Attributes, Body, Check, Decision, ErrorBody, Frame, Item, ItemDecision, ItemMode, Source, Verdict,
};
use crate::limits::{kind, HEADER, LEN_PREFIX, MAX_FRAME, MAX_ITEMS, MAX_MESSAGE, MIN_VERSION, VERSION};
use crate::{DecodeError, EncodeError, ErrorCode, InvalidValue};

/// Bytes of one encoded [`Verdict`].
pub const VERDICT_LEN: usize = 2 + 4 * 8;

const FLAG_ALLOWED: u8 = 0b01;
const FLAG_LOG_ONLY: u8 = 0b10;
const FLAG_HOLDS_LEASE: u8 = 0b100;
/// In a mode byte (version 3): a `lease u64` follows.
const MODE_LEASE: u8 = 0x80;
const FORM_ITEMS: u8 = 0;
const FORM_ATTRIBUTES: u8 = 1;
const FORM_ITEMS_MODES: u8 = 2;
const FORM_ATTRIBUTES_MODE: u8 = 3;
/// Version 5: a trace context, then another form.
const FORM_TRACED: u8 = 4;
const LIST_TRUNCATED: u8 = 0b01;
/// The version whose Decision carries each item's rule window.
const WINDOWS: u8 = 4;

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
        self.encode_body(out, version >= WINDOWS);
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

    fn encode_body(&self, out: &mut Vec<u8>, windows: bool) {
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
                put_verdict(out, &d.combined);
                out.push(d.items.len() as u8);
                for item in &d.items {
                    put_str8(out, &item.rule_id);
                    put_verdict(out, &item.verdict);
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
        kind::CHECK => {
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
            Body::Check(check)
        }
        kind::DECISION => {
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
            Body::Decision(Decision { combined, items })
        }
        kind::ERROR => Body::Error(ErrorBody {
            code: ErrorCode::from_u16(r.u16()?),
            message: r.str16()?,
        }),
        kind::PING => Body::Ping,
        kind::PONG => Body::Pong,
        kind::FAIL_MODES => Body::FailModes,
        kind::FAIL_MODE_LIST => {
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
            Body::FailModeList(FailModeList {
                rules_version,
                truncated: flags & LIST_TRUNCATED != 0,
                rules,
            })
        }
        other => return Err(Problem::Malformed(format!("unknown frame kind 0x{other:02x}"))),
    })
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
        if flags & !(FLAG_ALLOWED | FLAG_LOG_ONLY | FLAG_HOLDS_LEASE) != 0 {
            return Err(Problem::Malformed(format!("unknown verdict flags 0x{flags:02x}")));
        }
        let source = self.u8()?;
        let source =
            Source::from_u8(source).ok_or_else(|| Problem::Malformed(format!("unknown source {source}")))?;
        Ok(Verdict {
            allowed: flags & FLAG_ALLOWED != 0,
            log_only: flags & FLAG_LOG_ONLY != 0,
            holds_lease: flags & FLAG_HOLDS_LEASE != 0,
            source,
            limit: self.u64()?,
            remaining: self.u64()?,
            reset_at_ms: self.u64()?,
            retry_after_ms: self.u64()?,
        })
    }
}

/// A check's own form (0 to 3) and body.
fn encode_check(out: &mut Vec<u8>, check: &Check) {
    match check {
        Check::Items(items) => {
            // Every item consuming: version 1's form, which every agent reads.
            let modes = items
                .iter()
                .any(|i| !i.mode.takes_if_passed() || i.lease.is_some());
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
            let modes = !a.mode.takes_if_passed() || a.lease.is_some();
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

fn put_verdict(out: &mut Vec<u8>, v: &Verdict) {
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
