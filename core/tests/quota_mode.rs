//! Quota mode (`overLimit = "flag"`) on the embedded store: past its limit a request passes,
//! flagged `over_quota`, counting nothing, and never refuses the check's other items.

use std::sync::Arc;

use floodgate_core::engine::{Answer, Engine};
use floodgate_core::rules::RuleSet;
use floodgate_core::store::MemoryStore;
use floodgate_protocol::{Check, Decision, Item};

const RULES: &str = r#"{"rules":[
  {"id":"premium","dimension":"user","limit":2,"windowSeconds":3600,"overLimit":"flag"},
  {"id":"api","dimension":"user","limit":5,"windowSeconds":3600}
]}"#;

fn check(e: &Arc<Engine>, items: Vec<Item>) -> Decision {
    match e.check(Check::Items(items)) {
        Answer::Ready(Ok(d)) => d,
        _ => panic!("the embedded store answers at once"),
    }
}

#[test]
fn past_its_limit_a_request_passes_flagged_and_counts_nothing() {
    let e = Engine::new(
        RuleSet::parse(RULES).unwrap(),
        floodgate_core::engine::Store::Memory(Arc::new(MemoryStore::default())),
    );
    let both = || vec![Item::new("user:1", "premium", 1), Item::new("user:1", "api", 1)];
    for _ in 0..2 {
        let d = check(&e, both());
        assert!(d.combined.allowed && !d.combined.over_quota, "{d:?}");
    }
    let d = check(&e, both());
    assert!(d.combined.allowed && d.combined.over_quota, "{d:?}");
    let premium = d.items[0].verdict;
    assert!(
        premium.allowed && premium.over_quota && premium.retry_after_ms == 0,
        "{premium:?}"
    );
    assert!(!premium.log_only);
    // The other item of the check was decided as if the flagged one passed: it counted.
    assert_eq!(d.items[1].verdict.remaining, 2, "api: 3 of 5 taken");
    // The flagged request counted nothing on its rule: still 2 of 2.
    let peek = check(&e, vec![Item::peek("user:1", "premium", 0)]);
    assert_eq!(peek.items[0].verdict.remaining, 0);
    // An enforced rule still refuses, flag or not: api runs out after 5.
    for _ in 0..2 {
        assert!(check(&e, both()).combined.allowed);
    }
    let d = check(&e, both());
    assert!(!d.combined.allowed && !d.combined.over_quota, "{d:?}");
}
