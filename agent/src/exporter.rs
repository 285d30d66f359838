//! The Prometheus exporter: installs the recorder the core's metrics go to, keeps it drained, and
//! renders `/metrics` with the gauges read from the engine's state at scrape time.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Duration;

use floodgate_core::engine::Engine;
use floodgate_core::guard::BreakerState;
use floodgate_core::metrics::{OverSource, METRICS};
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the recorder (once per process) and turns recording on; returns the handle that renders.
pub fn install() -> anyhow::Result<PrometheusHandle> {
    if let Some(h) = HANDLE.get() {
        floodgate_core::metrics::enable();
        return Ok(h.clone());
    }
    // Check latency: 10 µs to 1 s, denser below 2 ms where the targets are.
    let latency = [
        0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1.0,
    ];
    let keys = [1.0, 4.0, 16.0, 64.0, 256.0, 512.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full("floodgate_check_duration_seconds".into()), &latency)?
        .set_buckets_for_metric(Matcher::Full("floodgate_flush_batch_keys".into()), &keys)?
        .install_recorder()?;
    for (name, help) in METRICS {
        metrics::describe_counter!(*name, *help);
    }
    let handle = HANDLE.get_or_init(|| handle).clone();
    floodgate_core::metrics::enable();
    // Unlabelled series exist from the start, so a scrape shows them before the first event.
    counter!("floodgate_check_errors_total").increment(0);
    counter!("floodgate_flush_batches_total").increment(0);
    counter!("floodgate_events_sent_total").increment(0);
    counter!("floodgate_events_dropped_total").increment(0);
    let _ = histogram!("floodgate_check_duration_seconds");
    let _ = histogram!("floodgate_flush_batch_keys");
    Ok(handle)
}

/// Keeps the exporter's histograms drained (their samples pile up between renders otherwise).
pub async fn upkeep(handle: PrometheusHandle, stop: tokio::sync::watch::Receiver<bool>) {
    floodgate_core::tasks::every(Duration::from_secs(5), stop, || {
        handle.run_upkeep();
        std::future::ready(())
    })
    .await;
}

/// Sets the gauges from the engine's state and renders the exposition.
pub fn render(engine: &Engine, handle: &PrometheusHandle) -> String {
    gauge!("floodgate_rules_version").set(engine.rules().version() as f64);
    gauge!("floodgate_rules_refused").set(if engine.refused_rules().is_some() {
        1.0
    } else {
        0.0
    });
    gauge!("floodgate_rejection_cache_entries").set(engine.cache().len() as f64);
    gauge!("floodgate_live_agents").set(engine.live_agents() as f64);
    let book = engine.reservations();
    gauge!("floodgate_reservations_held").set(book.len() as f64);
    let r = &book.stats;
    for (outcome, n) in [
        ("reserved", &r.reserved),
        ("committed", &r.committed),
        ("unknown", &r.unknown),
        ("expired", &r.expired),
        ("refused", &r.refused),
    ] {
        counter!("floodgate_reservations_total", "outcome" => outcome).absolute(n.load(Ordering::Relaxed));
    }
    for (way, n) in [("returned", &r.returned_units), ("charged", &r.charged_units)] {
        counter!("floodgate_reservation_units_total", "way" => way).absolute(n.load(Ordering::Relaxed));
    }
    // Series that count rare events exist at 0 from the first scrape, so rate() and alerts see them.
    for rule in engine.rules().iter() {
        for source in [OverSource::Flush, OverSource::Fallback] {
            counter!("floodgate_over_admitted_total", "rule" => rule.id.clone(), "source" => source.label())
                .increment(0);
        }
    }
    match engine.guard() {
        Some(g) => {
            for (shard, b) in g.breakers.iter().enumerate() {
                counter!("floodgate_redis_errors_total", "shard" => shard.to_string()).increment(0);
                counter!("floodgate_redis_calls_total", "shard" => shard.to_string()).increment(0);
                let state = match b.snapshot().state {
                    BreakerState::Closed => 0.0,
                    BreakerState::HalfOpen => 1.0,
                    BreakerState::Open => 2.0,
                };
                gauge!("floodgate_breaker_state", "shard" => shard.to_string()).set(state);
            }
            gauge!("floodgate_fallback_active").set(if g.all_closed() { 0.0 } else { 1.0 });
        }
        None => gauge!("floodgate_fallback_active").set(0.0),
    }
    handle.render()
}
