//! The closed loop: C clients, each with D checks in flight, measured after a warm-up.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::targets::Target;

const WARMUP: u8 = 0;
const MEASURE: u8 = 1;
const STOP: u8 = 2;

/// What a closed-loop run measured.
pub struct LoopResult {
    /// Round-trip latencies in ns (per batch of D; per check when D = 1).
    pub hist: Histogram<u64>,
    /// Checks answered while measuring.
    pub checks: u64,
    /// How long the measuring phase lasted.
    pub elapsed: Duration,
    /// Checks answered in all, warm-up included (what Redis counters are divided by).
    pub all_checks: u64,
    /// Checks (measured) the agent answered from its fail mode because the store was late or away.
    pub fallbacks: u64,
    /// The latencies of those fail-mode answers alone, ns (open loop only; empty otherwise).
    pub fallback_hist: Histogram<u64>,
}

/// Runs `clients` connections with `pipeline` checks in flight each, over `keys` keys.
pub async fn run(
    target: &Target,
    clients: usize,
    pipeline: usize,
    keys: usize,
    measure: Duration,
) -> anyhow::Result<LoopResult> {
    let phase = Arc::new(AtomicU8::new(WARMUP));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mut conn = target.connect().await?;
        let phase = phase.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
            let mut checks = 0u64;
            let mut all = 0u64;
            let mut fallbacks = 0u64;
            let mut k = c * 7919 % keys.max(1);
            let mut batch = vec![0; pipeline.max(1)];
            loop {
                let p = phase.load(Ordering::Relaxed);
                if p == STOP {
                    break;
                }
                for slot in batch.iter_mut() {
                    *slot = k;
                    k = (k + 1) % keys.max(1);
                }
                let t = Instant::now();
                let fell_back = conn.round_trip(&batch).await?;
                all += batch.len() as u64;
                if p == MEASURE {
                    fallbacks += fell_back;
                    hist.saturating_record(t.elapsed().as_nanos() as u64);
                    checks += batch.len() as u64;
                }
            }
            anyhow::Ok((hist, checks, all, fallbacks))
        }));
    }
    tokio::time::sleep(measure / 4).await;
    phase.store(MEASURE, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(measure).await;
    phase.store(STOP, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let (mut checks, mut all_checks, mut fallbacks) = (0, 0, 0);
    for t in tasks {
        let (h, n, a, f) = t.await??;
        hist.add(&h)?;
        checks += n;
        all_checks += a;
        fallbacks += f;
    }
    Ok(LoopResult {
        hist,
        checks,
        elapsed,
        all_checks,
        fallbacks,
        fallback_hist: Histogram::new(3)?,
    })
}
