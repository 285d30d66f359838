//! The embedded store and Redis give the same answers for the same sequence: the Lua scripts and the
//! Rust algorithms are the same maths.

use floodgate_protocol::Item;
use floodgate_tests::{patient_client, Agent, RedisServer};

// Hour-long windows: the sequence runs in well under a second, so both stores see the same window
// (the odds of an hour boundary falling inside the run are ~1 in 10,000, and the test then still
// holds for allowed/remaining unless the boundary splits the two agents' runs).
const RULES: &str = r#"{"rules":[
  {"id":"sw","dimension":"user","limit":7,"windowSeconds":3600},
  {"id":"tb","dimension":"user","limit":6,"windowSeconds":3600,"burst":4,"algorithm":"token_bucket"},
  {"id":"dry","dimension":"user","limit":2,"windowSeconds":3600,"mode":"log"},
  {"id":"cc","dimension":"user","limit":4,"algorithm":"concurrency","leaseSeconds":3600},
  {"id":"qm","dimension":"user","limit":9,"algorithm":"quota","period":"month","timezone":"Pacific/Auckland"}
]}"#;

fn sequence() -> Vec<Vec<Item>> {
    let mut seq = Vec::new();
    for i in 0..40u32 {
        let key = format!("user:{}", i % 3);
        let item = match i % 5 {
            0 => vec![Item::new(&key, "sw", 1 + i % 3)],
            1 => vec![Item::new(&key, "tb", 1 + i % 2)],
            2 => vec![Item::new(&key, "sw", 1), Item::new(&key, "dry", 1)],
            3 => vec![Item::new(&key, "sw", 2), Item::new(&key, "tb", 1)],
            _ => vec![Item::new(&key, "dry", 1), Item::new(&key, "tb", 3)],
        };
        seq.push(item);
    }
    seq
}

/// Peeks, charges past the limit and consumes after them, alone and mixed in one check.
fn sequence_with_modes() -> Vec<Vec<Item>> {
    let mut seq = Vec::new();
    for i in 0..30u32 {
        let key = format!("user:m{}", i % 2);
        let item = match i % 6 {
            0 => vec![Item::new(&key, "sw", 2), Item::peek(&key, "tb", 0)],
            1 => vec![Item::charge(&key, "sw", 3 + i % 4), Item::charge(&key, "tb", 2)],
            2 => vec![Item::peek(&key, "sw", 1), Item::peek(&key, "tb", 2)],
            3 => vec![Item::new(&key, "tb", 1), Item::peek(&key, "sw", 0)],
            4 => vec![Item::charge(&key, "dry", 1), Item::new(&key, "sw", 1)],
            _ => vec![Item::peek(&key, "sw", 3)],
        };
        seq.push(item);
    }
    // A debt no bucket could refill in a century is capped where it could (and Redis can still
    // hold the key's expiry): both stores answer the same, and later checks are answered.
    seq.push(vec![Item::charge("user:big", "tb", u32::MAX)]);
    seq.push(vec![
        Item::new("user:big", "tb", 1),
        Item::peek("user:big", "sw", 0),
    ]);
    seq
}

/// Leases: acquires past the limit, renewals, releases by lease and by count, peeks, and acquires
/// all or nothing with a rate item.
fn sequence_with_leases() -> Vec<Vec<Item>> {
    let mut seq = Vec::new();
    for i in 0..36u32 {
        let key = format!("user:l{}", i % 2);
        let lease = u64::from(i % 5) * 0x1_0000_0001;
        let item = match i % 6 {
            0 => vec![Item::acquire(&key, "cc", 1 + i % 3, lease)],
            1 => vec![Item::acquire(&key, "cc", 2, lease), Item::new(&key, "sw", 1)],
            2 => vec![Item::release(&key, "cc", 1 + i % 3, Some(lease))],
            3 => vec![Item::peek(&key, "cc", 2), Item::new("user:l9", "cc", 1)],
            4 => vec![Item::release(&key, "cc", 2, None)],
            _ => vec![Item::acquire(&key, "cc", 1, u64::MAX - lease)],
        };
        seq.push(item);
    }
    seq
}

/// A monthly quota: consumes, peeks, charges past it, and all or nothing with a rate item.
fn sequence_with_quotas() -> Vec<Vec<Item>> {
    let mut seq = Vec::new();
    for i in 0..24u32 {
        let key = format!("user:q{}", i % 2);
        let item = match i % 4 {
            0 => vec![Item::new(&key, "qm", 1 + i % 3)],
            1 => vec![Item::new(&key, "qm", 2), Item::new(&key, "sw", 1)],
            2 => vec![Item::peek(&key, "qm", 3)],
            _ => vec![Item::charge(&key, "qm", 1 + i % 2)],
        };
        seq.push(item);
    }
    seq
}

type Figures = (bool, u64, u64, u64, u64);

fn figures(d: &floodgate_sdk::Decision) -> Vec<Figures> {
    d.items
        .iter()
        .map(|i| {
            let v = i.verdict;
            (v.allowed, v.limit, v.remaining, v.reset_at_ms, v.retry_after_ms)
        })
        // Whether a lease is held is part of the answer too.
        .chain(d.items.iter().map(|i| (i.verdict.holds_lease, 0, 0, 0, 0)))
        .collect()
}

/// Runs the sequence against both agents step by step (one step to one, the same step to the other),
/// so that both read their clocks a few ms apart at every step.
async fn run_both(a: &Agent, b: &Agent, sequence: Vec<Vec<Item>>) -> Vec<(Vec<Figures>, Vec<Figures>)> {
    let (ca, cb) = (patient_client(a.socket()).await, patient_client(b.socket()).await);
    let mut out = Vec::new();
    for items in sequence {
        let x = ca.check(items.clone()).await.unwrap();
        let y = cb.check(items).await.unwrap();
        assert!(x.from_agent_answer() && y.from_agent_answer());
        out.push((figures(&x), figures(&y)));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_agree() {
    let redis = RedisServer::start();
    // The algorithms are compared, so the Redis agent's rejection cache is off: a cached rejection
    // answers a whole check without evaluating its other items (tests/tests/fleet.rs covers it).
    let on_redis = Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--rejection-cache")
        .arg("0")
        .start()
        .await;
    let embedded = Agent::builder().rules(RULES).start().await;
    let mut steps = run_both(&on_redis, &embedded, sequence()).await;
    steps.extend(run_both(&on_redis, &embedded, sequence_with_modes()).await);
    steps.extend(run_both(&on_redis, &embedded, sequence_with_leases()).await);
    steps.extend(run_both(&on_redis, &embedded, sequence_with_quotas()).await);
    let mut denials = 0;
    for (n, (x, y)) in steps.iter().enumerate() {
        assert_eq!(x.len(), y.len());
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            // Decisions and counts are exact.
            assert_eq!(
                (p.0, p.1, p.2),
                (q.0, q.1, q.2),
                "step {n} item {i}: redis {p:?} vs embedded {q:?}"
            );
            // Times come from two clocks of this one machine (Redis TIME, the agent's clock) read one
            // round trip apart: equal within 1 s, a bound a loaded machine meets (token-bucket resets
            // and sliding-window retries move with the read time; window resets are window-aligned).
            assert!(
                p.3.abs_diff(q.3) < 1_000,
                "step {n} item {i}: reset {} vs {}",
                p.3,
                q.3
            );
            assert!(
                p.4.abs_diff(q.4) < 1_000,
                "step {n} item {i}: retry {} vs {}",
                p.4,
                q.4
            );
            if !p.0 {
                denials += 1;
            }
        }
    }
    assert!(denials >= 10, "the sequence exercises denials too ({denials})");
}
