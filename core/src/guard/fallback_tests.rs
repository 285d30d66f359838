//! The fallback limiter's tests (kept apart: `fallback.rs` stays a check-path file under 400 lines).
use super::*;
use crate::rules::RuleSet;

#[test]
fn a_flood_of_keys_cannot_grow_the_local_store_past_its_cap() {
    let rules =
        RuleSet::parse(r#"{"rules":[{"id":"r","dimension":"user","limit":1,"windowSeconds":60}]}"#).unwrap();
    let mut f = Fallback::new(Clock::Manual(Arc::new(AtomicU64::new(1_000_000))));
    f.store_cap = 2_000;
    let rule = rules.get("r").unwrap().clone();
    for i in 0..10_000 {
        let item = [Planned {
            rule: rule.clone(),
            key: format!("user:{i}").into(),
            cost: 1,
            mode: Default::default(),
            lease: Default::default(),
        }];
        assert!(f.check(&item, 1, &[true])[0].allowed);
    }
    // Checked every 1,024 checks: the store stops growing within one period of the cap.
    assert!(
        f.store.len() < 2_000 + 1_024,
        "local store holds {}",
        f.store.len()
    );
    assert!(f.store_full.load(Ordering::Relaxed) > 0);
}

#[test]
fn a_drain_takes_only_what_is_ready() {
    let rules = RuleSet::parse(r#"{"rules":[{"id":"r","dimension":"user","limit":100,"windowSeconds":10}]}"#)
        .unwrap();
    let f = Fallback::new(Clock::Manual(Arc::new(AtomicU64::new(1_000_000))));
    let rule = rules.get("r").unwrap().clone();
    for key in ["user:up", "user:away", "user:up2"] {
        f.check(&[Planned::consume(rule.clone(), key, 3)], 1, &[true]);
    }
    // Only the keys of a shard that answers again are taken; the others wait where they are.
    let back = f.drain(10, |e| e.key.starts_with("user:up"));
    let mut keys: Vec<&str> = back.iter().map(|e| e.key.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["user:up", "user:up2"]);
    assert_eq!(f.pending(), 1);
    assert!(f.drain(10, |_| false).is_empty());
    assert_eq!(f.pending(), 1, "what is not ready is left in the ledger");
    let rest = f.drain(1, |_| true);
    assert_eq!(
        (rest.len(), rest[0].key.as_str(), rest[0].units),
        (1, "user:away", 3)
    );
}

#[test]
fn enforces_limit_over_n_and_keeps_a_ledger_of_the_current_window() {
    let rules = RuleSet::parse(r#"{"rules":[{"id":"r","dimension":"user","limit":100,"windowSeconds":10}]}"#)
        .unwrap();
    let t = Arc::new(AtomicU64::new(1_000_000));
    let f = Fallback::new(Clock::Manual(t.clone()));
    let item = || {
        vec![Planned {
            rule: rules.get("r").unwrap().clone(),
            key: "user:1".into(),
            cost: 1,
            mode: Default::default(),
            lease: Default::default(),
        }]
    };
    let admitted = (0..100)
        .filter(|_| f.check(&item(), 4, &[true])[0].allowed)
        .count();
    assert_eq!(admitted, 25, "limit 100 over 4 agents");
    let back = f.drain(10, |_| true);
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].units, 25);
    assert_eq!(f.pending(), 0);

    // Units of the window before still count (a sliding window weighs it); older ones do not.
    t.fetch_add(20_000, Ordering::Relaxed); // a fresh window for this key
    assert!(f.check(&item(), 4, &[true])[0].allowed);
    t.fetch_add(10_000, Ordering::Relaxed);
    assert_eq!(
        f.drain(10, |_| true).len(),
        1,
        "the previous window's units are still written back"
    );
    f.check(&item(), 4, &[true]);
    t.fetch_add(20_000, Ordering::Relaxed);
    assert!(
        f.drain(10, |_| true).is_empty(),
        "units two windows old are dropped"
    );

    // A timed-out check (record = false) admits without a ledger entry.
    f.check(&item(), 4, &[false]);
    assert_eq!(f.pending(), 0);
}
