//! PROTOCOL.md's hex vectors, checked both ways: each named frame encodes to exactly its bytes, and
//! the bytes decode back to the frame.

use floodgate_protocol::{
    decode, Attributes, Body, Check, ClosedRule, Decision, ErrorBody, ErrorCode, FailModeList, Frame, Item,
    ItemDecision, ItemMode, ListedDimension, Source, TraceContext, Verdict,
};

const DOC: &str = include_str!("../PROTOCOL.md");

fn vector(name: &str) -> Vec<u8> {
    let marker = format!("<!-- vector: {name} -->");
    let at = DOC
        .find(&marker)
        .unwrap_or_else(|| panic!("PROTOCOL.md has no vector {name}"));
    let rest = &DOC[at + marker.len()..];
    let start = rest.find("```hex").expect("a hex block after the marker") + "```hex".len();
    let end = start + rest[start..].find("```").expect("the block ends");
    rest[start..end]
        .split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).unwrap_or_else(|_| panic!("bad hex {b:?} in vector {name}")))
        .collect()
}

fn verdict(
    allowed: bool,
    log_only: bool,
    source: Source,
    limit: u64,
    remaining: u64,
    reset: u64,
    retry: u64,
) -> Verdict {
    Verdict {
        allowed,
        log_only,
        holds_lease: false,
        over_quota: false,
        source,
        limit,
        remaining,
        reset_at_ms: reset,
        retry_after_ms: retry,
    }
}

fn frames() -> Vec<(&'static str, Frame)> {
    let allowed = verdict(true, false, Source::Redis, 100, 99, 1_700_000_120_000, 0);
    let denied = verdict(false, false, Source::Cache, 5, 0, 1_700_000_060_000, 12_000);
    let dry = verdict(false, true, Source::Local, 600, 0, 1_700_000_030_000, 500);
    let lease = Verdict {
        holds_lease: true,
        ..verdict(true, false, Source::Redis, 4, 2, 1_700_000_060_000, 0)
    };
    let over_quota = Verdict {
        over_quota: true,
        ..verdict(true, false, Source::Redis, 100_000, 0, 1_700_000_120_000, 0)
    };
    let monthly = verdict(
        true,
        false,
        Source::Redis,
        10_000_000,
        9_999_000,
        1_704_067_200_000,
        0,
    );
    vec![
        (
            "hello",
            Frame::new(
                0,
                Body::Hello {
                    min_version: 1,
                    max_version: 1,
                },
            ),
        ),
        ("hello_ok", Frame::new(0, Body::HelloOk { version: 1 })),
        (
            "check_one_item",
            Frame::new(
                7,
                Body::Check(Check::Items(vec![Item::new("user:123", "api", 1)])),
            ),
        ),
        (
            "check_two_items",
            Frame::new(
                8,
                Body::Check(Check::Items(vec![
                    Item::new("user:123", "api", 1),
                    Item::new("ip:203.0.113.5", "login", 3),
                ])),
            ),
        ),
        (
            "check_attributes",
            Frame::new(
                9,
                Body::Check(Check::Attributes(Attributes {
                    endpoint: Some("/search".into()),
                    tier: Some("free".into()),
                    user: None,
                    api_key: Some("abc".into()),
                    ip: None,
                    cost: 2,
                    mode: ItemMode::Consume,
                    lease: None,
                })),
            ),
        ),
        (
            "decision_allowed",
            Frame::new(
                7,
                Body::Decision(Decision {
                    combined: allowed,
                    items: vec![ItemDecision {
                        rule_id: "api".into(),
                        verdict: allowed,
                        window_ms: 0,
                    }],
                }),
            ),
        ),
        (
            "decision_denied",
            Frame::new(
                8,
                Body::Decision(Decision {
                    combined: denied,
                    items: vec![
                        ItemDecision {
                            rule_id: "login".into(),
                            verdict: denied,
                            window_ms: 0,
                        },
                        ItemDecision {
                            rule_id: "ip-dry-run".into(),
                            verdict: dry,
                            window_ms: 0,
                        },
                    ],
                }),
            ),
        ),
        (
            "error_unknown_rule",
            Frame::new(
                7,
                Body::Error(ErrorBody {
                    code: ErrorCode::UnknownRule,
                    message: "unknown rule \"nope\"".into(),
                }),
            ),
        ),
        ("ping", Frame::new(3, Body::Ping)),
        ("pong", Frame::new(3, Body::Pong)),
        (
            "hello_v2",
            Frame::new(
                0,
                Body::Hello {
                    min_version: 1,
                    max_version: 2,
                },
            ),
        ),
        ("hello_ok_v2", Frame::new(0, Body::HelloOk { version: 2 })),
        ("fail_modes", Frame::new(11, Body::FailModes)),
        (
            "check_modes",
            Frame::new(
                12,
                Body::Check(Check::Items(vec![
                    Item::peek("user:123", "tokens", 0),
                    Item::charge("user:123", "llm", 1500),
                ])),
            ),
        ),
        (
            "check_attributes_charge",
            Frame::new(
                13,
                Body::Check(Check::Attributes(Attributes {
                    endpoint: Some("/v1/chat".into()),
                    api_key: Some("abc".into()),
                    cost: 900,
                    mode: ItemMode::Charge,
                    ..Default::default()
                })),
            ),
        ),
        (
            "hello_v3",
            Frame::new(
                0,
                Body::Hello {
                    min_version: 1,
                    max_version: 3,
                },
            ),
        ),
        ("hello_ok_v3", Frame::new(0, Body::HelloOk { version: 3 })),
        (
            "check_acquire",
            Frame::new(
                14,
                Body::Check(Check::Items(vec![Item::acquire(
                    "apikey:abc",
                    "gpu-slots",
                    2,
                    0x0123_4567_89ab_cdef,
                )])),
            ),
        ),
        (
            "decision_lease",
            Frame::new(
                14,
                Body::Decision(Decision {
                    combined: lease,
                    items: vec![ItemDecision {
                        rule_id: "gpu-slots".into(),
                        verdict: lease,
                        window_ms: 0,
                    }],
                }),
            ),
        ),
        (
            "hello_v4",
            Frame::new(
                0,
                Body::Hello {
                    min_version: 1,
                    max_version: 4,
                },
            ),
        ),
        ("hello_ok_v4", Frame::new(0, Body::HelloOk { version: 4 })),
        (
            "decision_windows",
            Frame::new(
                17,
                Body::Decision(Decision {
                    combined: allowed,
                    items: vec![
                        ItemDecision {
                            rule_id: "api".into(),
                            verdict: allowed,
                            window_ms: 60_000,
                        },
                        ItemDecision {
                            rule_id: "monthly".into(),
                            verdict: monthly,
                            // December 2023 in UTC: 31 days.
                            window_ms: 2_678_400_000,
                        },
                    ],
                }),
            ),
        ),
        (
            "hello_v5",
            Frame::new(
                0,
                Body::Hello {
                    min_version: 1,
                    max_version: 5,
                },
            ),
        ),
        ("hello_ok_v5", Frame::new(0, Body::HelloOk { version: 5 })),
        (
            "check_traced",
            Frame {
                trace: Some(TraceContext {
                    trace_id: [
                        0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                        0x47, 0x36,
                    ],
                    span_id: [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7],
                    flags: 1,
                }),
                ..Frame::new(
                    18,
                    Body::Check(Check::Items(vec![Item::new("user:123", "api", 1)])),
                )
            },
        ),
        (
            "check_release",
            Frame::new(
                15,
                Body::Check(Check::Items(vec![
                    Item::release("apikey:abc", "gpu-slots", 2, Some(0x0123_4567_89ab_cdef)),
                    Item::release("apikey:xyz", "gpu-slots", 1, None),
                ])),
            ),
        ),
        (
            "check_attributes_lease",
            Frame::new(
                16,
                Body::Check(Check::Attributes(Attributes {
                    endpoint: Some("/v1/chat".into()),
                    api_key: Some("abc".into()),
                    cost: 1,
                    lease: Some(42),
                    ..Default::default()
                })),
            ),
        ),
        (
            "hello_v6",
            Frame::new(
                0,
                Body::Hello {
                    min_version: 1,
                    max_version: 6,
                },
            ),
        ),
        ("hello_ok_v6", Frame::new(0, Body::HelloOk { version: 6 })),
        (
            "check_reserve",
            Frame::new(
                19,
                Body::Check(Check::Items(vec![
                    Item::reserve("apikey:abc", "output-tokens", 4096, 0x0123_4567_89ab_cdef),
                    Item::reserve("apikey:abc", "in-flight", 1, 0x0123_4567_89ab_cdef),
                ])),
            ),
        ),
        (
            "check_commit",
            Frame::new(
                20,
                Body::Check(Check::Items(vec![
                    Item::commit("apikey:abc", "output-tokens", 612, 0x0123_4567_89ab_cdef),
                    Item::commit("apikey:abc", "in-flight", 0, 0x0123_4567_89ab_cdef),
                ])),
            ),
        ),
        (
            "decision_over_quota",
            Frame::new(
                21,
                Body::Decision(Decision {
                    combined: over_quota,
                    items: vec![ItemDecision {
                        rule_id: "gpt-tokens".into(),
                        verdict: over_quota,
                        window_ms: 0,
                    }],
                }),
            ),
        ),
        (
            "fail_mode_list",
            Frame::new(
                11,
                Body::FailModeList(FailModeList {
                    rules_version: 42,
                    truncated: false,
                    rules: vec![
                        ClosedRule {
                            rule_id: "login-per-ip".into(),
                            dimension: ListedDimension::Ip,
                            endpoint: "/login".into(),
                            tier: String::new(),
                            limit: 5,
                        },
                        ClosedRule {
                            rule_id: "admin-per-user".into(),
                            dimension: ListedDimension::User,
                            endpoint: "/admin/*".into(),
                            tier: "staff".into(),
                            limit: 100,
                        },
                    ],
                }),
            ),
        ),
    ]
}

/// A frame's bytes as the page writes them: 16 to a line.
fn hex(bytes: &[u8]) -> String {
    let lines: Vec<String> = bytes
        .chunks(16)
        .map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" "))
        .collect();
    lines.join("\n")
}

#[test]
fn every_vector_encodes_and_decodes_exactly() {
    if std::env::var_os("PRINT_VECTORS").is_some() {
        for (name, frame) in frames() {
            println!(
                "<!-- vector: {name} -->\n```hex\n{}\n```\n",
                hex(&frame.to_bytes().unwrap())
            );
        }
    }
    for (name, frame) in frames() {
        let bytes = vector(name);
        let encoded = frame.to_bytes().unwrap();
        assert!(
            encoded == bytes,
            "encoding of {name}: the page's block should read\n{}",
            hex(&encoded)
        );
        let (back, used) = decode(&bytes).unwrap_or_else(|e| panic!("decoding {name}: {e}"));
        assert_eq!(back, frame, "decoding of {name}");
        assert_eq!(used, bytes.len());
    }
}

#[test]
fn windows_go_only_to_a_peer_of_version_4() {
    let (_, frame) = frames()
        .into_iter()
        .find(|(n, _)| *n == "decision_windows")
        .expect("the vector");
    let mut old = Vec::new();
    frame.encode_for(&mut old, 3).unwrap();
    assert_eq!(old[4], 1, "a version-3 peer gets version 1's decision");
    let (back, _) = decode(&old).unwrap();
    let Body::Decision(d) = back.body else {
        panic!("a decision")
    };
    assert!(d.items.iter().all(|i| i.window_ms == 0));
    let mut new = Vec::new();
    frame.encode_for(&mut new, 4).unwrap();
    assert_eq!(new, vector("decision_windows"));
    assert_eq!(new.len(), old.len() + 2 * 8, "a u64 per item");
}

#[test]
fn every_vector_in_the_page_is_checked() {
    let named: Vec<&str> = frames().into_iter().map(|(n, _)| n).collect();
    let in_doc = DOC.matches("<!-- vector: ").count();
    assert_eq!(
        in_doc,
        named.len(),
        "PROTOCOL.md has vectors this test does not build"
    );
}

#[test]
fn over_quota_goes_only_to_a_peer_of_version_6() {
    let (_, frame) = frames()
        .into_iter()
        .find(|(n, _)| *n == "decision_over_quota")
        .expect("the vector");
    let mut old = Vec::new();
    frame.encode_for(&mut old, 5).unwrap();
    let (back, _) = decode(&old).unwrap();
    let Body::Decision(d) = back.body else {
        panic!("a decision")
    };
    assert!(
        d.combined.allowed && !d.combined.over_quota,
        "a version-5 peer reads it allowed"
    );
    assert!(d.items.iter().all(|i| i.verdict.allowed && !i.verdict.over_quota));
    let mut new = Vec::new();
    frame.encode_for(&mut new, 6).unwrap();
    assert_eq!(new, vector("decision_over_quota"));
}
