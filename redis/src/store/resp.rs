//! RESP, written and read in this one place: the writer of commands (array headers, bulk strings,
//! numbers put together on the stack) and the parser of the replies the check path reads, whose
//! [`RespError::Incomplete`] is the normal state of a reply still arriving, not a failure.
//!
//! The check path's writers are `#[inline]`: its EVALSHA goes through them once per argument (ten
//! per check item), and a call per argument into another codegen unit would cost more than the bytes.

/// Longest a reply line or bulk string may be (a Redis reply to our commands is far shorter).
pub(super) const MAX_REPLY: usize = 1 << 20;

/// Why no reply could be read from the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum RespError {
    /// The buffer holds the start of a reply, not all of it: read more and parse again. Cheap (no
    /// allocation): it is what a parse of a reply still arriving gives, not an error.
    #[error("an incomplete reply")]
    Incomplete,
    /// The bytes are not a RESP2 reply (or one longer than [`MAX_REPLY`]): the connection cannot be
    /// read further.
    #[error("an unreadable reply from Redis: {0}")]
    Invalid(String),
}

impl From<&'static str> for RespError {
    fn from(why: &'static str) -> Self {
        RespError::Invalid(why.to_string())
    }
}

impl From<String> for RespError {
    fn from(why: String) -> Self {
        RespError::Invalid(why)
    }
}

/// Appends an array header: `*<len>\r\n`.
pub(super) fn array(buf: &mut Vec<u8>, len: usize) {
    buf.push(b'*');
    buf.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
    buf.extend_from_slice(b"\r\n");
}

/// Appends the array header of an EVALSHA of `len` elements and its first, the command's name, in
/// one copy (the check path writes one per call).
#[inline]
pub(super) fn evalsha(buf: &mut Vec<u8>, len: usize) {
    buf.push(b'*');
    buf.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
    buf.extend_from_slice(b"\r\n$7\r\nEVALSHA\r\n");
}

/// Appends `s` as a bulk string (`$<len>\r\n<bytes>\r\n`), its header put together on the stack.
#[inline]
pub(super) fn bulk(buf: &mut Vec<u8>, s: &[u8]) {
    let mut len = itoa::Buffer::new();
    let len = len.format(s.len()).as_bytes();
    // "$" + up to 20 digits + CRLF.
    let mut head = [0u8; 23];
    head[0] = b'$';
    head[1..1 + len.len()].copy_from_slice(len);
    head[1 + len.len()..3 + len.len()].copy_from_slice(b"\r\n");
    buf.extend_from_slice(&head[..3 + len.len()]);
    buf.extend_from_slice(s);
    buf.extend_from_slice(b"\r\n");
}

/// Appends `n`'s digits as a bulk string. The whole argument (at most 27 bytes) is put together on
/// the stack and copied once: nine of a check item's ten arguments are numbers, and a copy per piece
/// (five, each a `memcpy` call) cost more than the digits.
#[inline]
pub(super) fn bulk_num(buf: &mut Vec<u8>, n: u64) {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(n).as_bytes();
    // "$" + a length of one or two digits + CRLF + up to 20 digits + CRLF.
    let mut arg = [0u8; 27];
    arg[0] = b'$';
    let mut at = 1;
    if digits.len() >= 10 {
        arg[at] = b'0' + (digits.len() / 10) as u8;
        at += 1;
    }
    arg[at] = b'0' + (digits.len() % 10) as u8;
    arg[at + 1..at + 3].copy_from_slice(b"\r\n");
    at += 3;
    arg[at..at + digits.len()].copy_from_slice(digits);
    at += digits.len();
    arg[at..at + 2].copy_from_slice(b"\r\n");
    buf.extend_from_slice(&arg[..at + 2]);
}

/// Appends a command of `args` as RESP.
pub(super) fn command(buf: &mut Vec<u8>, args: &[&[u8]]) {
    array(buf, args.len());
    for a in args {
        bulk(buf, a);
    }
}

/// What the check path needs to know of a reply.
#[derive(Debug, PartialEq)]
pub(super) enum Reply {
    /// An integer.
    Int(i64),
    /// An array of integers (the check script's reply).
    Ints(Vec<i64>),
    /// An error reply, its text.
    Error(String),
    /// Anything else (`+OK`, a bulk string, nil, an array of other things).
    Other,
}

/// One RESP2 reply at the start of `buf`, with the bytes it took; [`RespError::Incomplete`] while
/// it is still arriving.
pub(super) fn parse(buf: &[u8]) -> Result<(Reply, usize), RespError> {
    let mut at = 0;
    let reply = value(buf, &mut at, 0)?;
    Ok((reply, at))
}

fn value(buf: &[u8], at: &mut usize, depth: usize) -> Result<Reply, RespError> {
    let line = line(buf, at)?;
    let (kind, rest) = line.split_first().ok_or("an empty reply line")?;
    Ok(match kind {
        b':' => Reply::Int(int(rest)?),
        b'+' => Reply::Other,
        b'-' => Reply::Error(String::from_utf8_lossy(rest).into_owned()),
        b'$' => {
            let len = int(rest)?;
            if len >= 0 {
                let len = usize::try_from(len).map_err(|_| "a bulk string too long")?;
                if len > MAX_REPLY {
                    return Err(format!("a bulk string of {len} bytes").into());
                }
                if buf.len() < *at + len + 2 {
                    return Err(RespError::Incomplete);
                }
                if &buf[*at + len..*at + len + 2] != b"\r\n" {
                    return Err("a bulk string without its CRLF".into());
                }
                *at += len + 2;
            }
            Reply::Other
        }
        b'*' => {
            let len = int(rest)?;
            if len < 0 {
                return Ok(Reply::Other);
            }
            if depth >= 8 || len > MAX_REPLY as i64 {
                return Err(format!("an array of {len} elements at depth {depth}").into());
            }
            let mut ints = Vec::with_capacity((len as usize).min(1024));
            let mut all_ints = true;
            for _ in 0..len {
                match value(buf, at, depth + 1)? {
                    Reply::Int(i) => ints.push(i),
                    _ => all_ints = false,
                }
            }
            if all_ints {
                Reply::Ints(ints)
            } else {
                Reply::Other
            }
        }
        other => return Err(format!("a reply starting with byte {other:#04x}").into()),
    })
}

/// The line at `*at` without its CRLF, moving `at` past it.
fn line<'a>(buf: &'a [u8], at: &mut usize) -> Result<&'a [u8], RespError> {
    let rest = &buf[*at..];
    let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
        if rest.len() > MAX_REPLY {
            return Err("a reply line with no end".into());
        }
        return Err(RespError::Incomplete);
    };
    if nl == 0 || rest[nl - 1] != b'\r' {
        return Err("a reply line not ended by CRLF".into());
    }
    *at += nl + 1;
    Ok(&rest[..nl - 1])
}

fn int(s: &[u8]) -> Result<i64, String> {
    let bad = || format!("not an integer: {:?}", String::from_utf8_lossy(s));
    let (negative, digits) = match s.split_first() {
        Some((b'-', d)) => (true, d),
        _ => (false, s),
    };
    if digits.is_empty() {
        return Err(bad());
    }
    // Up to 18 digits cannot overflow (the script's figures: counts, limits, milliseconds): one pass.
    if digits.len() <= 18 {
        let mut n: i64 = 0;
        for &d in digits {
            let v = d.wrapping_sub(b'0');
            if v > 9 {
                return Err(bad());
            }
            n = n * 10 + i64::from(v);
        }
        return Ok(if negative { -n } else { n });
    }
    if !digits.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    // Accumulated negatively: i64::MIN has no positive counterpart.
    let mut n: i64 = 0;
    for &d in digits {
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_sub(i64::from(d - b'0')))
            .ok_or_else(bad)?;
    }
    if negative {
        Ok(n)
    } else {
        n.checked_neg().ok_or_else(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_redis_rs_own_packing() {
        let mut buf = Vec::new();
        command(&mut buf, &[b"SCRIPT", b"LOAD", b"", "é".as_bytes()]);
        let packed = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg("")
            .arg("é")
            .get_packed_command();
        assert_eq!(buf, packed);
        let mut buf = Vec::new();
        evalsha(&mut buf, 12);
        assert_eq!(buf, b"*12\r\n$7\r\nEVALSHA\r\n");
    }

    #[test]
    fn replies_are_read_whole_or_not_at_all() {
        let whole: &[u8] = b"*3\r\n:1\r\n:-42\r\n:9223372036854775807\r\n+OK\r\n";
        let (r, used) = parse(whole).unwrap();
        assert_eq!(r, Reply::Ints(vec![1, -42, i64::MAX]));
        assert_eq!(parse(&whole[used..]), Ok((Reply::Other, 5)));
        // Every prefix of a reply is incomplete, never an error or a different reply.
        for cut in 0..used {
            assert_eq!(parse(&whole[..cut]), Err(RespError::Incomplete), "cut at {cut}");
        }
        let bulk: &[u8] = b"*2\r\n$3\r\nabc\r\n$-1\r\n";
        for cut in 0..bulk.len() {
            assert_eq!(parse(&bulk[..cut]), Err(RespError::Incomplete), "cut at {cut}");
        }
        assert_eq!(parse(bulk), Ok((Reply::Other, bulk.len())));
        assert_eq!(
            parse(b"-NOSCRIPT No matching script\r\n"),
            Ok((Reply::Error("NOSCRIPT No matching script".into()), 30))
        );
        assert_eq!(parse(b"$5\r\nab\r\nc\r\n"), Ok((Reply::Other, 11)));
        assert_eq!(parse(b"$-1\r\n"), Ok((Reply::Other, 5)));
        assert_eq!(parse(b"*2\r\n:1\r\n$1\r\nx\r\n"), Ok((Reply::Other, 15)));
        assert_eq!(
            parse(b":-9223372036854775808\r\n"),
            Ok((Reply::Int(i64::MIN), 23))
        );
    }

    #[test]
    fn malformed_replies_are_invalid_not_panics() {
        for bad in [
            &b"?1\r\n"[..],
            b":12a\r\n",
            b":\r\n",
            b":-\r\n",
            b":9223372036854775808\r\n",
            b"$3\r\nabcd\r\n",
            b"*1\n",
            b"\r\n",
            b"$-2x\r\n",
            b"*9999999999\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        ] {
            assert!(
                matches!(parse(bad), Err(RespError::Invalid(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Said as the connection's error says it.
        assert_eq!(
            parse(b"?1\r\n").unwrap_err().to_string(),
            "an unreadable reply from Redis: a reply starting with byte 0x3f"
        );
    }
}
