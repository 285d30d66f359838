//! How the decoder sorts bad input: what closes a connection (Fatal) and what only refuses one
//! request (Rejected), and which request id each names.

use floodgate_protocol::{decode, DecodeError, ErrorCode};

fn check_frame(key: &[u8], cost: u32) -> Vec<u8> {
    let rule = b"api";
    let mut body = vec![1, 3, 0, 0, 0, 42, 0, 1];
    body.extend_from_slice(&(key.len() as u16).to_be_bytes());
    body.extend_from_slice(key);
    body.push(rule.len() as u8);
    body.extend_from_slice(rule);
    body.extend_from_slice(&cost.to_be_bytes());
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

#[test]
fn limits_and_bad_text_refuse_only_the_request() {
    for (key, cost, needle) in [
        (&b"{tag}"[..], 1, "braces"),
        (&b"user:1"[..], 0, "cost"),
        (&b"\xff\xfe"[..], 1, "UTF-8"),
        (&[b'k'; 257][..], 1, "256-byte"),
    ] {
        let frame = check_frame(key, cost);
        match decode(&frame) {
            Err(DecodeError::Rejected {
                code,
                request_id,
                reason,
                frame_len,
            }) => {
                assert_eq!(code, ErrorCode::InvalidItem);
                assert_eq!(request_id, 42);
                assert_eq!(frame_len, frame.len(), "the whole frame is skipped");
                assert!(reason.contains(needle), "{reason:?} should mention {needle:?}");
            }
            other => panic!("{key:?}/{cost}: expected a rejection, got {other:?}"),
        }
    }
}

#[test]
fn an_oversize_frame_names_its_request_when_the_header_is_there() {
    let mut frame = (1u32 << 20).to_be_bytes().to_vec();
    assert!(matches!(
        decode(&frame),
        Err(DecodeError::Fatal {
            code: ErrorCode::FrameTooLarge,
            request_id: None,
            ..
        })
    ));
    frame.extend_from_slice(&[1, 3, 0, 0, 0, 9]);
    assert!(matches!(
        decode(&frame),
        Err(DecodeError::Fatal {
            code: ErrorCode::FrameTooLarge,
            request_id: Some(9),
            ..
        })
    ));
}

#[test]
fn a_body_that_does_not_parse_is_fatal_even_with_bad_text() {
    // Invalid UTF-8 key and one byte too many: malformed wins, the connection must close.
    let mut frame = check_frame(b"\xff", 1);
    frame.push(0);
    let n = frame.len() as u32 - 4;
    frame[..4].copy_from_slice(&n.to_be_bytes());
    assert!(matches!(
        decode(&frame),
        Err(DecodeError::Fatal {
            code: ErrorCode::MalformedFrame,
            request_id: Some(42),
            ..
        })
    ));
}
