//! The decoder against arbitrary input (property-based fuzzing): it never panics, never reads past
//! what it was given, and everything it encodes it decodes back unchanged.
//!
//! The default case counts keep `cargo test` quick; BENCHMARKS.md records a long run
//! (`PROPTEST_CASES=1000000 cargo test --release -p floodgate-protocol --test decode_fuzz`).

use floodgate_protocol::{
    decode, Attributes, Body, Check, ClosedRule, Decision, DecodeError, ErrorBody, ErrorCode, FailModeList,
    Frame, Item, ItemDecision, ItemMode, ListedDimension, Source, Verdict, MAX_FRAME,
};
use proptest::prelude::*;

fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[a-zA-Z0-9:/._ -]{{1,{max}}}")).unwrap()
}

fn rule_id() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-zA-Z0-9_.:-]{1,128}").unwrap()
}

fn verdict() -> impl Strategy<Value = Verdict> {
    (
        any::<bool>(),
        any::<bool>(),
        0u8..4,
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(allowed, log_only, s, limit, remaining, reset_at_ms, retry_after_ms)| Verdict {
                allowed,
                log_only,
                holds_lease: allowed && !log_only && remaining % 3 == 0,
                over_quota: false,
                source: Source::from_u8(s).unwrap(),
                limit,
                remaining,
                reset_at_ms,
                retry_after_ms,
            },
        )
}

fn body() -> impl Strategy<Value = Body> {
    let item = (
        text(256),
        rule_id(),
        1u32..,
        0u8..4,
        proptest::option::of(any::<u64>()),
    )
        .prop_map(|(k, r, c, m, lease)| Item {
            mode: ItemMode::from_u8(m).unwrap(),
            lease,
            ..Item::new(k, r, c)
        });
    let attr = || proptest::option::of(text(256));
    prop_oneof![
        (any::<u8>(), any::<u8>()).prop_map(|(min_version, max_version)| Body::Hello {
            min_version,
            max_version
        }),
        any::<u8>().prop_map(|version| Body::HelloOk { version }),
        proptest::collection::vec(item, 1..=16).prop_map(|items| Body::Check(Check::Items(items))),
        (
            (attr(), attr(), attr(), attr(), attr()),
            1u32..,
            0u8..4,
            proptest::option::of(any::<u64>())
        )
            .prop_map(
                |((endpoint, tier, user, api_key, ip), cost, m, lease)| Body::Check(Check::Attributes(
                    Attributes {
                        endpoint,
                        tier,
                        user,
                        api_key,
                        ip,
                        cost,
                        mode: ItemMode::from_u8(m).unwrap(),
                        lease,
                    }
                ))
            ),
        (
            verdict(),
            proptest::collection::vec((rule_id(), verdict(), any::<u64>()), 0..=16)
        )
            .prop_map(|(combined, items)| {
                Body::Decision(Decision {
                    combined,
                    items: items
                        .into_iter()
                        .map(|(rule_id, verdict, window_ms): (String, _, _)| ItemDecision {
                            rule_id: rule_id.into(),
                            verdict,
                            window_ms,
                        })
                        .collect(),
                })
            }),
        (1u16..12, text(200)).prop_map(|(c, message)| Body::Error(ErrorBody {
            code: ErrorCode::from_u16(c),
            message
        })),
        Just(Body::Ping),
        Just(Body::Pong),
        Just(Body::FailModes),
        (
            any::<u64>(),
            any::<bool>(),
            proptest::collection::vec(
                (
                    rule_id(),
                    0u8..4,
                    proptest::option::of(text(256)),
                    proptest::option::of(text(256)),
                    any::<u64>()
                ),
                0..40
            )
        )
            .prop_map(
                |(rules_version, truncated, rules)| Body::FailModeList(FailModeList {
                    rules_version,
                    truncated,
                    rules: rules
                        .into_iter()
                        .map(|(id, d, endpoint, tier, limit)| ClosedRule {
                            rule_id: id.as_str().into(),
                            dimension: ListedDimension::from_u8(d).unwrap(),
                            endpoint: endpoint.unwrap_or_default(),
                            tier: tier.unwrap_or_default(),
                            limit,
                        })
                        .collect(),
                })
            ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// Arbitrary bytes: decode returns, and a success never claims more bytes than it was given.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        match decode(&bytes) {
            Ok((_, used)) => prop_assert!(used <= bytes.len() && used <= MAX_FRAME),
            Err(DecodeError::Rejected { frame_len, .. }) => prop_assert!(frame_len <= bytes.len()),
            Err(_) => {}
        }
    }

    /// Bytes that start like a real frame (valid prefix and header, random body) reach deeper code.
    #[test]
    fn plausible_frames_never_panic(kind in 1u8..11, version in 1u8..3, id in any::<u32>(), body in proptest::collection::vec(any::<u8>(), 0..600)) {
        let mut bytes = ((body.len() + 6) as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&[version, kind]);
        bytes.extend_from_slice(&id.to_be_bytes());
        bytes.extend_from_slice(&body);
        let _ = decode(&bytes);
    }

    /// Every valid frame round-trips, and every strict prefix of it is Incomplete.
    #[test]
    fn valid_frames_round_trip(id in any::<u32>(), body in body()) {
        let frame = Frame::new(id, body);
        let bytes = frame.to_bytes().unwrap();
        let (back, used) = decode(&bytes).unwrap();
        prop_assert_eq!(used, bytes.len());
        if !matches!(frame.body, Body::Hello { .. }) {
            prop_assert_eq!(back, frame);
        }
        for cut in [0, 3, 4, 9, bytes.len() / 2, bytes.len() - 1] {
            prop_assert_eq!(decode(&bytes[..cut.min(bytes.len() - 1)]), Err(DecodeError::Incomplete));
        }
    }

    /// Flipping any one byte of a valid frame never panics the decoder.
    #[test]
    fn corrupted_frames_never_panic(body in body(), at in any::<usize>(), to in any::<u8>()) {
        let mut bytes = Frame::new(1, body).to_bytes().unwrap();
        let i = at % bytes.len();
        bytes[i] = to;
        let _ = decode(&bytes);
    }
}
