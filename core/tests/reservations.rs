//! Reservations on the embedded store, time driven by hand: a reserve takes its units at once, a
//! commit gives back what was not used (or charges a use past it), a second commit finds nothing,
//! and an uncommitted reservation expires as its rule says.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use floodgate_core::engine::{Answer, Engine, EngineOptions, Store};
use floodgate_core::rules::RuleSet;
use floodgate_core::store::{Clock, MemoryStore};
use floodgate_protocol::{Check, Decision, Item};

const RULES: &str = r#"{"rules":[
  {"id":"tokens","dimension":"user","limit":1000,"windowSeconds":60},
  {"id":"spend","dimension":"user","limit":1000,"windowSeconds":60,"reservationSeconds":10,"reservationExpiry":"release"},
  {"id":"bucket","dimension":"user","limit":1000,"windowSeconds":60,"algorithm":"token_bucket"},
  {"id":"month","dimension":"user","limit":1000,"algorithm":"quota","period":"month"},
  {"id":"inflight","dimension":"user","limit":2,"algorithm":"concurrency"}
]}"#;

fn engine(max: usize) -> (Arc<Engine>, Arc<AtomicU64>) {
    let now = Arc::new(AtomicU64::new(1_800_000_000_000));
    let clock = Clock::Manual(now.clone());
    let options = EngineOptions {
        clock: clock.clone(),
        max_reservations: max,
        ..EngineOptions::default()
    };
    let store = Store::Memory(Arc::new(MemoryStore::new(clock)));
    (
        Engine::with_guard(RuleSet::parse(RULES).unwrap(), store, None, options),
        now,
    )
}

fn check(e: &Arc<Engine>, items: Vec<Item>) -> Decision {
    match e.check(Check::Items(items)) {
        Answer::Ready(Ok(d)) => d,
        Answer::Ready(Err(err)) => panic!("error {err:?}"),
        Answer::Pending(_) => panic!("the embedded store answers at once"),
    }
}

fn remaining(e: &Arc<Engine>, rule: &str) -> u64 {
    check(e, vec![Item::peek("user:1", rule, 0)]).combined.remaining
}

#[test]
fn a_commit_gives_back_what_was_not_used_on_every_algorithm() {
    let (e, _) = engine(100);
    for rule in ["tokens", "bucket", "month"] {
        let d = check(&e, vec![Item::reserve("user:1", rule, 400, 7)]);
        assert!(
            d.combined.allowed && d.items[0].verdict.holds_lease,
            "{rule}: {d:?}"
        );
        assert_eq!(
            remaining(&e, rule),
            600,
            "{rule}: the reservation is counted at once"
        );
        let d = check(&e, vec![Item::commit("user:1", rule, 150, 7)]);
        assert!(d.combined.allowed, "{rule}: a commit is never a rejection");
        assert_eq!(remaining(&e, rule), 850, "{rule}: 250 unused units came back");
        // A second commit (a retry) finds nothing and changes nothing.
        check(&e, vec![Item::commit("user:1", rule, 150, 7)]);
        assert_eq!(remaining(&e, rule), 850, "{rule}: nothing given back twice");
    }
    let stats = &e.reservations().stats;
    assert_eq!(stats.committed.load(Ordering::Relaxed), 3);
    assert_eq!(stats.unknown.load(Ordering::Relaxed), 3);
    assert_eq!(stats.returned_units.load(Ordering::Relaxed), 750);
}

#[test]
fn a_use_past_the_reservation_is_charged_and_the_budget_then_refuses() {
    let (e, _) = engine(100);
    check(&e, vec![Item::reserve("user:1", "tokens", 500, 1)]);
    check(&e, vec![Item::commit("user:1", "tokens", 700, 1)]);
    assert_eq!(remaining(&e, "tokens"), 300);
    // Reserved units are what later reserves compete for: 300 left, 400 refused, nothing held.
    let d = check(&e, vec![Item::reserve("user:1", "tokens", 400, 2)]);
    assert!(!d.combined.allowed && !d.items[0].verdict.holds_lease, "{d:?}");
    assert!(e.reservations().is_empty());
}

#[test]
fn several_meters_are_reserved_all_or_nothing() {
    let (e, _) = engine(100);
    let meters = |id, tokens| {
        vec![
            Item::reserve("user:1", "tokens", tokens, id),
            Item::reserve("user:1", "inflight", 1, id),
        ]
    };
    assert!(check(&e, meters(1, 100)).combined.allowed);
    // Too many tokens: refused, and the unit in flight is not taken either.
    assert!(!check(&e, meters(2, 950)).combined.allowed);
    assert!(
        check(&e, meters(3, 100)).combined.allowed,
        "the second unit in flight was free"
    );
    assert!(
        !check(&e, meters(4, 1)).combined.allowed,
        "two in flight: the limit"
    );
    // Committing the first frees its unit in flight and its unused tokens.
    check(
        &e,
        vec![
            Item::commit("user:1", "tokens", 10, 1),
            Item::commit("user:1", "inflight", 1, 1),
        ],
    );
    assert_eq!(remaining(&e, "tokens"), 890);
    assert!(check(&e, meters(5, 1)).combined.allowed);
}

#[test]
fn an_expired_reservation_is_kept_or_released_as_its_rule_says() {
    let (e, now) = engine(100);
    check(&e, vec![Item::reserve("user:1", "tokens", 300, 1)]);
    check(&e, vec![Item::reserve("user:1", "spend", 300, 1)]);
    now.fetch_add(10_000, Ordering::Relaxed);
    assert_eq!(
        e.expire_reservations(),
        1,
        "spend's 10 s are over, tokens' 300 s are not"
    );
    assert_eq!(remaining(&e, "spend"), 1000, "released: the units went back");
    now.fetch_add(290_000, Ordering::Relaxed);
    let before = remaining(&e, "tokens");
    assert_eq!(e.expire_reservations(), 1);
    assert_eq!(remaining(&e, "tokens"), before, "charged: the units stay counted");
    // A late commit: under `charge` nothing more is counted, under `release` the use in full.
    check(&e, vec![Item::commit("user:1", "tokens", 50, 1)]);
    assert_eq!(remaining(&e, "tokens"), before);
    check(&e, vec![Item::commit("user:1", "spend", 50, 1)]);
    assert_eq!(remaining(&e, "spend"), 950);
}

#[test]
fn the_book_is_bounded() {
    let (e, _) = engine(2);
    for id in [1, 2] {
        assert!(
            check(&e, vec![Item::reserve("user:1", "tokens", 1, id)])
                .combined
                .allowed
        );
    }
    let Answer::Ready(Err(err)) = e.check(Check::Items(vec![Item::reserve("user:1", "tokens", 1, 3)])) else {
        panic!("a full book refuses a new reservation");
    };
    assert_eq!(err.code, floodgate_protocol::ErrorCode::Overloaded);
    assert!(err.message.contains("--max-reservations"), "{}", err.message);
    check(&e, vec![Item::commit("user:1", "tokens", 1, 1)]);
    assert!(
        check(&e, vec![Item::reserve("user:1", "tokens", 1, 3)])
            .combined
            .allowed
    );
}
