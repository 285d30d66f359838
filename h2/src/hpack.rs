//! HPACK (RFC 7541): decoding a request's header block into (name, value) pairs, with the dynamic
//! table the client's encoder keeps in step with.
//!
//! Every block of a connection must be decoded, a refused stream's too, or the tables part ways.
//! Pairs are handed to a callback as slices (of the block, of the table, or of a Huffman scratch
//! buffer) and never collected: a header the server does not read costs no copy, and a block of
//! indexed references to large entries costs its own length in work, not theirs. The only
//! allocation is an entry the client asks to index (one per new header value: a client's encoder
//! sends the usual gRPC headers as one-byte references from its second request on). A value sent
//! without indexing (h2 sends every `:path` so) reaches the callback still Huffman-coded, so that
//! comparing it with a constant costs a `memcmp` instead of ~10 instructions a bit.

use std::collections::VecDeque;

use crate::huffman;

/// The table size this server announces (SETTINGS_HEADER_TABLE_SIZE, the default): the most a
/// client's size update may ask for.
pub const TABLE_SIZE: usize = 4_096;

/// A header block that cannot be decoded: a connection error (COMPRESSION_ERROR), since the
/// tables can no longer agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HpackError {
    /// The block ends inside a representation.
    Truncated,
    /// An index of no entry (0, or past the dynamic table).
    BadIndex(usize),
    /// A Huffman string that does not decode.
    BadHuffman,
    /// An integer of more than 28 bits.
    Overflow,
    /// A size update past the announced table size.
    TableTooLarge(usize),
    /// A dynamic table size update after a field of the block.
    LateSizeUpdate,
    /// A header list past the given size, counted as RFC 9113 §6.5.2 does (names and values as
    /// sent, plus 32 a field): its size when it passed.
    ListTooLarge(usize),
}

impl std::fmt::Display for HpackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HpackError::Truncated => write!(f, "a header block ends inside a field"),
            HpackError::BadIndex(i) => write!(f, "header index {i} names no entry"),
            HpackError::BadHuffman => write!(f, "a Huffman-coded header string does not decode"),
            HpackError::Overflow => write!(f, "a header block integer overflows"),
            HpackError::TableTooLarge(n) => {
                write!(f, "a dynamic table size of {n} past the {TABLE_SIZE} announced")
            }
            HpackError::LateSizeUpdate => write!(f, "a dynamic table size update after a field"),
            HpackError::ListTooLarge(n) => {
                write!(f, "a header list of {n} bytes or more, past the size announced")
            }
        }
    }
}

/// RFC 7541 Appendix A: indexes 1 to 61.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// A field's value as sent: plain, or still Huffman-coded (a literal the client did not index).
#[derive(Debug, Clone, Copy)]
pub enum Value<'a> {
    /// The value's bytes.
    Plain(&'a [u8]),
    /// Its Huffman code.
    Huffman(&'a [u8]),
}

impl Value<'_> {
    /// Its length as sent (a Huffman-coded value's code: at most its decoded length).
    pub fn sent_len(&self) -> usize {
        match self {
            Value::Plain(v) | Value::Huffman(v) => v.len(),
        }
    }

    /// Whether the value is `plain`, whose Huffman code is `coded` (`huffman::encode(plain)`).
    pub fn is(&self, plain: &[u8], coded: &[u8]) -> bool {
        match self {
            Value::Plain(v) => *v == plain,
            Value::Huffman(v) => *v == coded,
        }
    }

    /// The value's bytes (decoded into `buf` if need be); None if its code does not decode.
    pub fn bytes<'b>(&'b self, buf: &'b mut Vec<u8>) -> Option<&'b [u8]> {
        match self {
            Value::Plain(v) => Some(v),
            Value::Huffman(v) => {
                buf.clear();
                huffman::decode(v, buf).ok()?;
                Some(buf)
            }
        }
    }
}

/// A dynamic table entry: name and value in one allocation.
struct Entry {
    bytes: Box<[u8]>,
    name_len: usize,
    /// Its name has an upper-case letter (looked at once, when the entry is made).
    upper: bool,
}

impl Entry {
    fn name(&self) -> &[u8] {
        &self.bytes[..self.name_len]
    }
    fn value(&self) -> &[u8] {
        &self.bytes[self.name_len..]
    }
    /// RFC 7541 §4.1: the octets plus 32.
    fn size(&self) -> usize {
        self.bytes.len() + 32
    }
}

/// One connection's decoder.
pub struct Decoder {
    /// Newest first (index 62).
    table: VecDeque<Entry>,
    size: usize,
    max: usize,
    name_buf: Vec<u8>,
    value_buf: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max: TABLE_SIZE,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
        }
    }
}

impl Decoder {
    /// Decodes a whole header block, calling `field(name, value, upper)` for each field in order
    /// (`upper`: the name has an upper-case letter, which RFC 9113 §8.2.1 makes a malformed
    /// request; looked at only where the name's bytes came from the block, once for a table entry);
    /// a list past `max_list` bytes (names, values as sent, 32 a field) is an error when it passes it.
    pub fn decode(
        &mut self,
        block: &[u8],
        max_list: usize,
        mut field: impl FnMut(&[u8], Value<'_>, bool),
    ) -> Result<(), HpackError> {
        let mut name_buf = std::mem::take(&mut self.name_buf);
        let mut value_buf = std::mem::take(&mut self.value_buf);
        let mut list = 0;
        let mut counted = |name: &[u8], value: Value<'_>, upper: bool| {
            list += name.len() + value.sent_len() + 32;
            field(name, value, upper);
            list
        };
        let result = self.decode_with(block, max_list, &mut counted, &mut name_buf, &mut value_buf);
        self.name_buf = name_buf;
        self.value_buf = value_buf;
        result
    }

    fn decode_with(
        &mut self,
        block: &[u8],
        max_list: usize,
        field: &mut impl FnMut(&[u8], Value<'_>, bool) -> usize,
        name_buf: &mut Vec<u8>,
        value_buf: &mut Vec<u8>,
    ) -> Result<(), HpackError> {
        let mut pos = 0;
        let mut list = 0;
        while pos < block.len() {
            if list > max_list {
                return Err(HpackError::ListTooLarge(list));
            }
            let b = block[pos];
            if b & 0x80 != 0 {
                // Indexed field.
                let i = integer(block, &mut pos, 7)?;
                let (name, value) = self.get(i)?;
                list = field(name, Value::Plain(value), self.upper(i));
            } else if b & 0xc0 == 0x40 {
                // Literal with incremental indexing.
                let i = integer(block, &mut pos, 6)?;
                let mut bytes = Vec::new();
                let upper = if i == 0 {
                    bytes.extend_from_slice(string(block, &mut pos, name_buf)?);
                    has_upper(&bytes)
                } else {
                    bytes.extend_from_slice(self.get(i)?.0);
                    self.upper(i)
                };
                let name_len = bytes.len();
                bytes.extend_from_slice(string(block, &mut pos, value_buf)?);
                let entry = Entry {
                    bytes: bytes.into_boxed_slice(),
                    name_len,
                    upper,
                };
                list = field(entry.name(), Value::Plain(entry.value()), upper);
                self.insert(entry);
            } else if b & 0xe0 == 0x20 {
                // Dynamic table size update: only before the block's first field (§4.2).
                if list > 0 {
                    return Err(HpackError::LateSizeUpdate);
                }
                let n = integer(block, &mut pos, 5)?;
                if n > TABLE_SIZE {
                    return Err(HpackError::TableTooLarge(n));
                }
                self.max = n;
                self.evict(0);
            } else {
                // Literal without indexing (0000) or never indexed (0001).
                let i = integer(block, &mut pos, 4)?;
                if i == 0 {
                    let name = string(block, &mut pos, name_buf)?;
                    let value = raw_string(block, &mut pos)?;
                    let upper = has_upper(name);
                    list = field(name, value, upper);
                } else {
                    let value = raw_string(block, &mut pos)?;
                    let (name, _) = self.get(i)?;
                    list = field(name, value, self.upper(i));
                }
            }
        }
        if list > max_list {
            return Err(HpackError::ListTooLarge(list));
        }
        Ok(())
    }

    /// Whether entry `i`'s name has an upper-case letter (the static table's have none).
    fn upper(&self, i: usize) -> bool {
        i > 61 && self.table.get(i - 62).is_some_and(|e| e.upper)
    }

    fn get(&self, i: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match i {
            1..=61 => {
                let (n, v) = STATIC[i - 1];
                Ok((n.as_bytes(), v.as_bytes()))
            }
            _ => self
                .table
                .get(i.wrapping_sub(62))
                .map(|e| (e.name(), e.value()))
                .ok_or(HpackError::BadIndex(i)),
        }
    }

    fn insert(&mut self, entry: Entry) {
        let size = entry.size();
        if size > self.max {
            // An entry larger than the table empties it (RFC 7541 §4.4).
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front(entry);
    }

    /// Drops the oldest entries until `room` more fits.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max {
            match self.table.pop_back() {
                Some(e) => self.size -= e.size(),
                None => break,
            }
        }
    }
}

fn has_upper(name: &[u8]) -> bool {
    name.iter().any(u8::is_ascii_uppercase)
}

/// An integer with an `n`-bit prefix (RFC 7541 §5.1), at most 28 bits.
fn integer(block: &[u8], pos: &mut usize, n: u32) -> Result<usize, HpackError> {
    let mask = (1usize << n) - 1;
    let first = usize::from(*block.get(*pos).ok_or(HpackError::Truncated)?) & mask;
    *pos += 1;
    if first < mask {
        return Ok(first);
    }
    let mut value = mask;
    let mut shift = 0;
    loop {
        let b = *block.get(*pos).ok_or(HpackError::Truncated)?;
        *pos += 1;
        value += usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return Ok(value);
        }
        if shift > 21 {
            return Err(HpackError::Overflow);
        }
    }
}

/// A string literal as sent: its bytes and whether they are Huffman-coded.
fn raw_string<'a>(block: &'a [u8], pos: &mut usize) -> Result<Value<'a>, HpackError> {
    let huffman = block.get(*pos).ok_or(HpackError::Truncated)? & 0x80 != 0;
    let len = integer(block, pos, 7)?;
    let raw = block.get(*pos..*pos + len).ok_or(HpackError::Truncated)?;
    *pos += len;
    Ok(if huffman {
        Value::Huffman(raw)
    } else {
        Value::Plain(raw)
    })
}

/// A string literal (RFC 7541 §5.2): a slice of the block, or Huffman-decoded into `buf`.
fn string<'a>(block: &'a [u8], pos: &mut usize, buf: &'a mut Vec<u8>) -> Result<&'a [u8], HpackError> {
    match raw_string(block, pos)? {
        Value::Plain(raw) => Ok(raw),
        Value::Huffman(raw) => {
            buf.clear();
            huffman::decode(raw, buf).map_err(|_| HpackError::BadHuffman)?;
            Ok(buf)
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A block's fields as strings (the grpc module's tests read its constant blocks with it).
    pub(crate) fn fields(d: &mut Decoder, block: &[u8]) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut buf = Vec::new();
        d.decode(block, usize::MAX, |n, v, _| {
            out.push((
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v.bytes(&mut buf).unwrap()).into_owned(),
            ))
        })
        .unwrap();
        out
    }

    #[test]
    fn an_unindexed_value_compares_in_its_code() {
        let path = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
        let coded = huffman::encode(path);
        // A literal without indexing of static name 4 (`:path`), Huffman-coded.
        let mut block = vec![0x04, 0x80 | coded.len() as u8];
        block.extend_from_slice(&coded);
        let mut seen = 0;
        Decoder::default()
            .decode(&block, usize::MAX, |n, v, _| {
                assert_eq!(n, b":path");
                assert!(matches!(v, Value::Huffman(_)));
                assert!(v.is(path, &coded));
                assert!(!v.is(b"/other", &huffman::encode(b"/other")));
                assert_eq!(v.bytes(&mut Vec::new()), Some(&path[..]));
                seen += 1;
            })
            .unwrap();
        assert_eq!(seen, 1);
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    /// RFC 7541 C.4: three requests with Huffman coding, the table carried between them.
    #[test]
    fn rfc_7541_c4_requests_with_huffman() {
        let mut d = Decoder::default();
        assert_eq!(
            fields(&mut d, &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(d.size, 57);
        assert_eq!(
            fields(&mut d, &hex("8286 84be 5886 a8eb 1064 9cbf")),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache")
            ])
        );
        assert_eq!(d.size, 110);
        assert_eq!(
            fields(
                &mut d,
                &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf")
            ),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(d.size, 164);
    }

    /// RFC 7541 C.5.1 then C.5.2 with a 256-byte table: the oldest entry is evicted.
    #[test]
    fn eviction_follows_the_size_update() {
        let mut d = Decoder::default();
        // A size update to 256, then C.5.1's literals (no Huffman).
        let mut block = vec![0x3f, 0xe1, 0x01];
        block.extend(hex(
            "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        ));
        assert_eq!(fields(&mut d, &block).len(), 4);
        assert_eq!(d.size, 222);
        // C.5.2: ":status: 307" evicts ":status: 302".
        let second = fields(&mut d, &hex("4803 3330 37c1 c0bf"));
        assert_eq!(second[0], (":status".into(), "307".into()));
        assert_eq!(second[3].0, "location");
        assert_eq!(d.size, 222);
        assert_eq!(d.table.len(), 4);
    }

    #[test]
    fn an_upper_case_name_is_flagged_however_it_is_referred_to() {
        let mut d = Decoder::default();
        // "X-A: 1" as a literal indexed under a new name, then referred to by its index (62), then
        // a literal not indexed whose name is that entry's.
        let block = [0x40, 3, b'X', b'-', b'A', 1, b'1', 0xbe, 0x0f, 0x2f, 1, b'2'];
        let mut seen = Vec::new();
        d.decode(&block, usize::MAX, |n, _, upper| seen.push((n.to_vec(), upper)))
            .unwrap();
        let x = b"X-A".to_vec();
        assert_eq!(seen, [(x.clone(), true), (x.clone(), true), (x, true)]);
        let mut seen = Vec::new();
        d.decode(&[0x82, 0x00, 1, b'x', 1, b'1'], usize::MAX, |_, _, upper| {
            seen.push(upper)
        })
        .unwrap();
        assert_eq!(seen, [false, false], "a static name, a lower-case literal");
    }

    #[test]
    fn bad_blocks_are_errors_not_panics() {
        for (block, want) in [
            (vec![0x80], HpackError::BadIndex(0)),
            (vec![0xbe], HpackError::BadIndex(62)),
            (vec![0x41], HpackError::Truncated),
            (vec![0x41, 0x05, b'a'], HpackError::Truncated),
            (vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff], HpackError::Overflow),
            (vec![0x3f, 0xe2, 0x1f], HpackError::TableTooLarge(4_097)),
            // A size update after a field.
            (vec![0x82, 0x20], HpackError::LateSizeUpdate),
            // A Huffman-coded name that does not decode.
            (vec![0x00, 0x81, 0x00, 0x00], HpackError::BadHuffman),
        ] {
            let mut d = Decoder::default();
            assert_eq!(
                d.decode(&block, usize::MAX, |_, _, _| {}),
                Err(want),
                "{block:02x?}"
            );
        }
    }
}
