//! HPACK's Huffman code (RFC 7541, Appendix B): decoding a header string sent Huffman-coded.
//!
//! The code is canonical (codes of one length are consecutive integers, each length's first code
//! follows the last of the length before, shifted), so a decoder needs per length only its first
//! code and where its symbols start in the symbols ordered by (length, code): one comparison per
//! bit read. Strings reach it only when a header is first sent (a client's encoder indexes the rest),
//! so its ~10 instructions a bit are not on a check's usual path.
//!
//! The two tables are RFC 7541's, as written out by the h2 crate (`src/hpack/huffman/table.rs`,
//! MIT, Copyright (c) 2017 h2 authors).

use std::sync::OnceLock;

/// Each byte's code, right-aligned.
const ENCODE_CODES: [u32; 256] = [
    0x1ff8, 0x7fffd8, 0xfffffe2, 0xfffffe3, 0xfffffe4, 0xfffffe5, 0xfffffe6, 0xfffffe7, 0xfffffe8, 0xffffea,
    0x3ffffffc, 0xfffffe9, 0xfffffea, 0x3ffffffd, 0xfffffeb, 0xfffffec, 0xfffffed, 0xfffffee, 0xfffffef,
    0xffffff0, 0xffffff1, 0xffffff2, 0x3ffffffe, 0xffffff3, 0xffffff4, 0xffffff5, 0xffffff6, 0xffffff7,
    0xffffff8, 0xffffff9, 0xffffffa, 0xffffffb, 0x14, 0x3f8, 0x3f9, 0xffa, 0x1ff9, 0x15, 0xf8, 0x7fa, 0x3fa,
    0x3fb, 0xf9, 0x7fb, 0xfa, 0x16, 0x17, 0x18, 0x0, 0x1, 0x2, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
    0x5c, 0xfb, 0x7ffc, 0x20, 0xffb, 0x3fc, 0x1ffa, 0x21, 0x5d, 0x5e, 0x5f, 0x60, 0x61, 0x62, 0x63, 0x64,
    0x65, 0x66, 0x67, 0x68, 0x69, 0x6a, 0x6b, 0x6c, 0x6d, 0x6e, 0x6f, 0x70, 0x71, 0x72, 0xfc, 0x73, 0xfd,
    0x1ffb, 0x7fff0, 0x1ffc, 0x3ffc, 0x22, 0x7ffd, 0x3, 0x23, 0x4, 0x24, 0x5, 0x25, 0x26, 0x27, 0x6, 0x74,
    0x75, 0x28, 0x29, 0x2a, 0x7, 0x2b, 0x76, 0x2c, 0x8, 0x9, 0x2d, 0x77, 0x78, 0x79, 0x7a, 0x7b, 0x7ffe,
    0x7fc, 0x3ffd, 0x1ffd, 0xffffffc, 0xfffe6, 0x3fffd2, 0xfffe7, 0xfffe8, 0x3fffd3, 0x3fffd4, 0x3fffd5,
    0x7fffd9, 0x3fffd6, 0x7fffda, 0x7fffdb, 0x7fffdc, 0x7fffdd, 0x7fffde, 0xffffeb, 0x7fffdf, 0xffffec,
    0xffffed, 0x3fffd7, 0x7fffe0, 0xffffee, 0x7fffe1, 0x7fffe2, 0x7fffe3, 0x7fffe4, 0x1fffdc, 0x3fffd8,
    0x7fffe5, 0x3fffd9, 0x7fffe6, 0x7fffe7, 0xffffef, 0x3fffda, 0x1fffdd, 0xfffe9, 0x3fffdb, 0x3fffdc,
    0x7fffe8, 0x7fffe9, 0x1fffde, 0x7fffea, 0x3fffdd, 0x3fffde, 0xfffff0, 0x1fffdf, 0x3fffdf, 0x7fffeb,
    0x7fffec, 0x1fffe0, 0x1fffe1, 0x3fffe0, 0x1fffe2, 0x7fffed, 0x3fffe1, 0x7fffee, 0x7fffef, 0xfffea,
    0x3fffe2, 0x3fffe3, 0x3fffe4, 0x7ffff0, 0x3fffe5, 0x3fffe6, 0x7ffff1, 0x3ffffe0, 0x3ffffe1, 0xfffeb,
    0x7fff1, 0x3fffe7, 0x7ffff2, 0x3fffe8, 0x1ffffec, 0x3ffffe2, 0x3ffffe3, 0x3ffffe4, 0x7ffffde, 0x7ffffdf,
    0x3ffffe5, 0xfffff1, 0x1ffffed, 0x7fff2, 0x1fffe3, 0x3ffffe6, 0x7ffffe0, 0x7ffffe1, 0x3ffffe7, 0x7ffffe2,
    0xfffff2, 0x1fffe4, 0x1fffe5, 0x3ffffe8, 0x3ffffe9, 0xffffffd, 0x7ffffe3, 0x7ffffe4, 0x7ffffe5, 0xfffec,
    0xfffff3, 0xfffed, 0x1fffe6, 0x3fffe9, 0x1fffe7, 0x1fffe8, 0x7ffff3, 0x3fffea, 0x3fffeb, 0x1ffffee,
    0x1ffffef, 0xfffff4, 0xfffff5, 0x3ffffea, 0x7ffff4, 0x3ffffeb, 0x7ffffe6, 0x3ffffec, 0x3ffffed,
    0x7ffffe7, 0x7ffffe8, 0x7ffffe9, 0x7ffffea, 0x7ffffeb, 0xffffffe, 0x7ffffec, 0x7ffffed, 0x7ffffee,
    0x7ffffef, 0x7fffff0, 0x3ffffee,
];

/// Each byte's code length in bits.
const ENCODE_CODE_LENGTHS: [u8; 256] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28,
    28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6,
    6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7,
    8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7,
    15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24,
    23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23,
    23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26,
    26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20,
    21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27,
    27, 27, 26,
];

/// EOS: 30 ones. Padding is a prefix of it; EOS itself in a string is an error.
const EOS: (u32, u8) = (0x3fff_ffff, 30);

/// A Huffman-coded string that is not a valid one: EOS inside, a code past 30 bits, or padding
/// longer than 7 bits or not all ones (RFC 7541 §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadHuffman;

/// Per code length: the first code, how many codes, where their symbols start.
struct Canon {
    first: [u32; 31],
    count: [u32; 31],
    offset: [u16; 31],
    symbols: [u16; 257],
}

fn canon() -> &'static Canon {
    static CANON: OnceLock<Canon> = OnceLock::new();
    CANON.get_or_init(|| {
        let mut codes: Vec<(u8, u32, u16)> = (0..256)
            .map(|s| (ENCODE_CODE_LENGTHS[s], ENCODE_CODES[s], s as u16))
            .collect();
        codes.push((EOS.1, EOS.0, 256));
        codes.sort_unstable();
        let mut c = Canon {
            first: [0; 31],
            count: [0; 31],
            offset: [0; 31],
            symbols: [0; 257],
        };
        for (i, &(len, code, sym)) in codes.iter().enumerate() {
            let l = usize::from(len);
            if c.count[l] == 0 {
                c.first[l] = code;
                c.offset[l] = i as u16;
            }
            c.count[l] += 1;
            c.symbols[i] = sym;
        }
        c
    })
}

/// Appends the decoded bytes of `src` to `out`.
pub fn decode(src: &[u8], out: &mut Vec<u8>) -> Result<(), BadHuffman> {
    let c = canon();
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in src {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            if len > 30 {
                return Err(BadHuffman);
            }
            let k = code.wrapping_sub(c.first[len]);
            if k < c.count[len] {
                match c.symbols[usize::from(c.offset[len]) + k as usize] {
                    256 => return Err(BadHuffman),
                    sym => out.push(sym as u8),
                }
                code = 0;
                len = 0;
            }
        }
    }
    // What is left is padding: fewer than 8 bits, all ones.
    if len > 7 || code != (1 << len) - 1 {
        return Err(BadHuffman);
    }
    Ok(())
}

/// Encodes `src` as a client does: codes packed, the last byte padded with ones. The encoding of a
/// string is unique, so a header value can be compared with a constant in its coded form, without
/// decoding it.
pub fn encode(src: &[u8]) -> Vec<u8> {
    let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
    for &b in src {
        acc = (acc << ENCODE_CODE_LENGTHS[usize::from(b)]) | u64::from(ENCODE_CODES[usize::from(b)]);
        bits += u32::from(ENCODE_CODE_LENGTHS[usize::from(b)]);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_is_canonical() {
        // Codes of each length are consecutive: the decoder's range test is exact.
        let c = canon();
        for len in 1..=30 {
            for k in 0..c.count[len] {
                let sym = c.symbols[usize::from(c.offset[len]) + k as usize];
                let code = if sym == 256 {
                    EOS.0
                } else {
                    ENCODE_CODES[usize::from(sym)]
                };
                assert_eq!(code, c.first[len] + k, "length {len}");
            }
        }
    }

    #[test]
    fn rfc_7541_examples_and_every_byte_round_trip() {
        // C.4.1: "www.example.com".
        let www = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        let mut out = Vec::new();
        decode(&www, &mut out).unwrap();
        assert_eq!(out, b"www.example.com");
        assert_eq!(encode(b"www.example.com"), www);
        let all: Vec<u8> = (0..=255).collect();
        out.clear();
        decode(&encode(&all), &mut out).unwrap();
        assert_eq!(out, all);
    }

    #[test]
    fn bad_padding_and_eos_are_refused() {
        let mut out = Vec::new();
        // '0' is 00000 (5 bits): padding 000 is not all ones.
        assert_eq!(decode(&[0x00], &mut out), Err(BadHuffman));
        // A whole byte of padding.
        assert_eq!(decode(&[0x07, 0xff], &mut out), Err(BadHuffman));
        // EOS itself, then padding.
        assert_eq!(decode(&[0xff, 0xff, 0xff, 0xff], &mut out), Err(BadHuffman));
    }
}
