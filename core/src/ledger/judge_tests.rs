//! The checker's tests: key-windows, spans over edges, allowances, quotas.
use super::*;

fn header(agent: &str, store: &str) -> Header {
    Header {
        ledger: 1,
        agent: agent.into(),
        store: store.into(),
    }
}

fn admit(key: &str, at: u64, source: &str) -> Record {
    Record {
        recv: at,
        done: at + 1,
        off: 0,
        rule: "r".into(),
        ver: 1,
        alg: Algorithm::SlidingWindow,
        window_ms: 1_000,
        limit: 10,
        burst: 10,
        enforced: true,
        key: key.into(),
        cost: 1,
        mode: "consume".into(),
        allowed: true,
        source: source.into(),
        n: 2,
        lease: None,
        period: None,
        from: None,
    }
}

fn file(agent: &str, store: &str, records: Vec<Record>) -> LedgerFile {
    LedgerFile {
        header: header(agent, store),
        records,
        dropped: 0,
        closed: true,
    }
}

#[test]
fn a_fleet_window_past_its_limit_is_a_breach_and_one_within_is_not() {
    // Two agents, 6 admissions each of key a in window [1000, 2000): 12 > 10. Key b: 5 + 5.
    let mut one: Vec<Record> = (0..6).map(|i| admit("a", 1_100 + i * 10, "redis")).collect();
    let mut two: Vec<Record> = (0..6).map(|i| admit("a", 1_500 + i * 10, "redis")).collect();
    one.extend((0..5).map(|i| admit("b", 1_100 + i, "redis")));
    two.extend((0..5).map(|i| admit("b", 1_200 + i, "redis")));
    let j = judge(
        &[file("x", "shared", one), file("y", "shared", two)],
        &Options::contract(),
    );
    assert_eq!(j.breaches.len(), 1, "{j:?}");
    let b = &j.breaches[0];
    assert_eq!(
        (b.key.as_str(), b.admitted, b.bound, b.window_start_ms),
        ("a", 12, 10, 1_000)
    );
    assert_eq!(j.rules[0].worst_ratio, 1.2);
}

#[test]
fn a_quota_is_judged_per_period_as_the_agents_named_it() {
    // A quota of 10 a "day" [10_000, 20_000): 6 + 6 admitted in it by two agents is a breach;
    // 10 in it and 10 in the next day are not; one read before the period began is a maybe.
    let quota = |key: &str, at: u64, period: [u64; 2]| Record {
        alg: Algorithm::Quota,
        window_ms: 10_000,
        period: Some(period),
        ..admit(key, at, "redis")
    };
    let (day, next) = ([10_000, 20_000], [20_000, 30_000]);
    let one: Vec<Record> = (0..6).map(|i| quota("a", 12_000 + i, day)).collect();
    let mut two: Vec<Record> = (0..6).map(|i| quota("a", 19_000 + i, day)).collect();
    two.extend((0..10).map(|i| quota("b", 11_000 + i, day)));
    two.extend((0..10).map(|i| quota("b", 21_000 + i, next)));
    let mut late = quota("b", 19_999, next);
    late.done = 20_001;
    two.push(late);
    let j = judge(
        &[file("x", "shared", one), file("y", "shared", two)],
        &Options::contract(),
    );
    assert_eq!(j.breaches.len(), 1, "{j:?}");
    let b = &j.breaches[0];
    assert_eq!(
        (b.key.as_str(), b.admitted, b.bound, b.window_start_ms),
        ("a", 12, 10, 10_000)
    );
    assert_eq!(j.rules[0].not_judged, None);
    assert_eq!(j.rules[0].admitted, 33);
    // Redis restarted empty within the day: its count before (≤ 10) may be admitted again.
    let restart = Options {
        faults: vec![FaultSpan {
            kind: FaultKind::RestartEmpty,
            from_ms: 15_000,
            to_ms: 15_500,
        }],
        ..Options::contract()
    };
    let one: Vec<Record> = (0..12).map(|i| quota("a", 12_000 + i * 500, day)).collect();
    assert!(judge(&[file("x", "shared", one)], &restart).breaches.is_empty());
}

#[test]
fn the_embedded_store_is_judged_per_agent() {
    let one: Vec<Record> = (0..10).map(|i| admit("a", 1_100 + i, "local")).collect();
    let two = one.clone();
    let j = judge(
        &[file("x", "memory", one), file("y", "memory", two)],
        &Options::contract(),
    );
    assert!(j.breaches.is_empty(), "each agent's own limit held: {j:?}");
}

#[test]
fn a_decision_spanning_a_window_edge_is_never_a_breach_by_itself() {
    // 10 surely in [1000, 2000) and 5 whose spans cross into the next window.
    let mut records: Vec<Record> = (0..10).map(|i| admit("a", 1_100 + i, "redis")).collect();
    for _ in 0..5 {
        let mut r = admit("a", 1_995, "redis");
        r.done = 2_005;
        records.push(r);
    }
    let j = judge(&[file("x", "shared", records)], &Options::contract());
    assert!(j.breaches.is_empty(), "{j:?}");
    assert_eq!(j.rules[0].admitted, 15);
}

#[test]
fn fallback_and_batched_windows_get_the_contracts_allowance() {
    // Fail open: Redis counted 10 before it went away; two agents then admitted 5 each at
    // limit / 2: 20 ≤ 10 + Φ (5 + 5). Batched, one agent, 60 ms apart (no half slot holds two):
    // 10 + the larger of 1 % of 10 rounded up and N·c + P = 1 + 1: 12.
    let mut one: Vec<Record> = (0..10).map(|i| admit("a", 1_100 + i, "redis")).collect();
    one.extend((0..5).map(|i| admit("a", 1_300 + i, "fallback")));
    let two: Vec<Record> = (0..5).map(|i| admit("a", 1_300 + i, "fallback")).collect();
    let mut batched: Vec<Record> = (0..12).map(|i| admit("b", 1_000 + 60 * i, "local")).collect();
    let j = judge(
        &[file("x", "shared", one.clone()), file("y", "shared", two.clone())],
        &Options::contract(),
    );
    assert!(j.breaches.is_empty(), "{j:?}");
    // One more than the agents' shares: a breach.
    let mut over = two.clone();
    over.push(admit("a", 1_400, "fallback"));
    let j = judge(
        &[
            file("x", "shared", one.clone()),
            file("y", "shared", over.clone()),
        ],
        &Options::contract(),
    );
    assert_eq!(j.breaches.len(), 1, "21 > 10 + 5 + 5: {j:?}");
    // An agent that counted itself alone (cold, no heartbeat yet) has the whole limit.
    for r in &mut over {
        r.n = 1;
    }
    let j = judge(
        &[file("x", "shared", one.clone()), file("y", "shared", over)],
        &Options::contract(),
    );
    assert!(j.breaches.is_empty(), "21 <= 10 + 5 + 10: {j:?}");
    let j = judge(&[file("x", "shared", batched.clone())], &Options::contract());
    assert!(j.breaches.is_empty(), "{j:?}");
    batched.push(admit("b", 1_990, "local"));
    let j = judge(&[file("x", "shared", batched)], &Options::contract());
    assert_eq!(j.breaches.len(), 1, "13 batched units pass 10 + 2: {j:?}");
}

#[test]
fn a_batched_window_may_pass_by_what_its_agents_admitted_in_half_a_slot() {
    // Two agents: 10 units spread out, then 3 more each, `gap` ms apart.
    let run = |gap: u64| {
        let ledger = |name: &str, first: u64| {
            let mut r: Vec<Record> = (0..5).map(|i| admit("b", first + 60 * i, "local")).collect();
            r.extend((0..3).map(|i| admit("b", first + 600 + gap * i, "local")));
            file(name, "shared", r)
        };
        judge(&[ledger("x", 1_000), ledger("y", 1_005)], &Options::contract())
    };
    // 10 ms apart, a half slot of 100 ms holds all 6: 16 ≤ 10 + N·c + P = 10 + 2 + 6.
    let j = run(10);
    assert!(j.breaches.is_empty(), "{j:?}");
    // 100 ms apart, at most 2 in any half slot: 16 > 10 + 2 + 2.
    let j = run(100);
    assert_eq!(j.breaches.len(), 1, "{j:?}");
}

#[test]
fn a_stated_fault_widens_only_the_windows_it_overlaps() {
    // 20 admitted in [1000, 2000) and in [3000, 4000): a restart empty at 1500 explains the
    // first (10 + L), not the second.
    let records: Vec<Record> = (0..20)
        .map(|i| admit("a", 1_100 + i, "redis"))
        .chain((0..20).map(|i| admit("a", 3_100 + i, "redis")))
        .collect();
    let mut opts = Options::contract();
    opts.faults.push(FaultSpan {
        kind: FaultKind::RestartEmpty,
        from_ms: 1_500,
        to_ms: 1_600,
    });
    let j = judge(&[file("x", "shared", records.clone())], &opts);
    assert_eq!(j.breaches.len(), 1, "{j:?}");
    assert_eq!(j.breaches[0].window_start_ms, 3_000);
    // A failover's stated loss is replication lag's: one unit of a limit of 10.
    opts.faults[0].kind = FaultKind::Failover;
    let j = judge(&[file("x", "shared", records)], &opts);
    assert_eq!(j.breaches.len(), 2, "{j:?}");
    assert_eq!(j.breaches.iter().map(|b| b.bound).max(), Some(11));
}

#[test]
fn peeks_rejections_and_log_mode_admit_nothing() {
    let mut records = Vec::new();
    for i in 0..20 {
        let mut peek = admit("a", 1_100 + i, "redis");
        peek.mode = "peek".into();
        let mut refused = admit("a", 1_100 + i, "cache");
        refused.allowed = false;
        let mut logged = admit("a", 1_100 + i, "redis");
        logged.enforced = false;
        records.extend([peek, refused, logged]);
    }
    let j = judge(&[file("x", "shared", records)], &Options::contract());
    assert!(j.breaches.is_empty());
    assert_eq!(j.rules[0].admitted, 0);
}

#[test]
fn a_ledger_reads_back_what_was_written_and_says_what_it_lacks() {
    let rec = serde_json::to_string(&admit("a", 1_100, "redis")).unwrap();
    let text = format!(
        "{}\n{rec}\n{{\"dropped\":3}}\n{rec}\n{{\"closed\":true,\"records\":2,\"dropped\":3}}\n",
        serde_json::to_string(&header("x", "shared")).unwrap()
    );
    let f = LedgerFile::parse(&text).unwrap();
    assert_eq!((f.records.len(), f.dropped, f.closed), (2, 3, true));
    // A killed agent: no closing line, its last line cut short.
    let cut = format!(
        "{}\n{rec}\n{}",
        serde_json::to_string(&header("x", "shared")).unwrap(),
        &rec[..20]
    );
    let f = LedgerFile::parse(&cut).unwrap();
    assert_eq!((f.records.len(), f.closed), (1, false));
    assert!(LedgerFile::parse("{\"ledger\":2,\"agent\":\"x\",\"store\":\"shared\"}").is_err());
    assert!(LedgerFile::parse(&format!(
        "{}\nnot json\n{rec}",
        serde_json::to_string(&header("x", "shared")).unwrap()
    ))
    .is_err());
}

#[test]
fn units_a_reservation_gave_back_come_off_their_window() {
    // A reserve of 8 in window [1000, 2000) of a limit of 10, 6 of it given back, then 7 more
    // admitted: 8 - 6 + 7 = 9, within the limit; without the return, 15 is a breach.
    let reserve = Record {
        cost: 8,
        mode: "reserve".into(),
        ..admit("a", 1_100, "redis")
    };
    let back = Record {
        cost: 6,
        mode: "return".into(),
        from: Some(1),
        ..admit("a", 1_200, "redis")
    };
    let later: Vec<Record> = (0..7).map(|i| admit("a", 1_300 + i, "redis")).collect();
    let mut with = vec![reserve.clone(), back];
    with.extend(later.clone());
    let j = judge(&[file("x", "shared", with)], &Options::contract());
    assert!(j.breaches.is_empty(), "{j:?}");
    assert_eq!(j.rules[0].admitted, 9);
    let mut without = vec![reserve];
    without.extend(later);
    let j = judge(&[file("x", "shared", without)], &Options::contract());
    assert_eq!(j.breaches.len(), 1, "{j:?}");
    assert_eq!(j.breaches[0].admitted, 15);
}
