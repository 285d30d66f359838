//! The admin HTTP API (loopback by default): health, readiness, status, batched execution and its
//! run-time tuning.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, put};
use axum::Router;

use floodgate_core::engine::Engine;
use floodgate_core::engine::Store;
use std::sync::atomic::Ordering::Relaxed;

/// The admin router; tests call it without a socket.
pub fn app(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/status", get(status))
        .route("/v1/batch", get(batch))
        .route("/v1/batch/flush-interval", put(set_flush_interval))
        .route("/metrics", get(metrics))
        .with_state(engine)
}

/// Prometheus text exposition (404 when the agent runs with `--metrics false`).
async fn metrics(
    State(engine): State<Arc<Engine>>,
    ext: Option<axum::Extension<Option<metrics_exporter_prometheus::PrometheusHandle>>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match ext.and_then(|axum::Extension(h)| h) {
        Some(handle) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            crate::exporter::render(&engine, &handle),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are off (--metrics false)\n").into_response(),
    }
}

/// The agent's state: store, breaker, fallback, live agents.
async fn status(State(engine): State<Arc<Engine>>) -> axum::Json<serde_json::Value> {
    let rules: Vec<String> = engine.rules().iter().map(|r| r.id.clone()).collect();
    let mut body = serde_json::json!({
        "store": engine.store().describe(),
        "storeErrors": engine.store_errors(),
        // Checks answered by their fail modes because the agent was past its capacity toward the
        // store (its queue there already waited longer than a check's budget).
        "shed": engine.shed(),
        "rules": rules,
        "rulesVersion": engine.rules().version(),
        // Penalties live now (at most 20 listed; `floodgate rules penalty list` has them all).
        "penalties": engine
            .overrides()
            .live_penalties(floodgate_core::store::Clock::System.now_ms(), 20)
            .into_iter()
            .map(|(key, p)| serde_json::json!({ "clientKey": key, "factor": p.factor, "block": p.block, "until": p.until }))
            .collect::<Vec<_>>(),
        "overrides": {
            "held": engine.overrides().len(),
            "version": engine.overrides().version(),
            "refused": engine.overrides().refused.load(std::sync::atomic::Ordering::Relaxed),
        },
        // The newest set handed to the agent and refused as a whole (the one in force stayed).
        "rulesRefused": engine.refused_rules().map(|r| serde_json::json!({
            "version": r.version,
            "error": r.error,
        })),
    });
    let cache = engine.cache();
    body["rejectionCache"] = serde_json::json!({
        "entries": cache.len(),
        "hits": cache.hits.load(Relaxed),
        "evicted": cache.evicted.load(Relaxed),
    });
    let tb = engine.taken_back();
    body["takenBack"] = serde_json::json!({
        "requestedUnits": tb.requested.load(Relaxed),
        "doneUnits": tb.done.load(Relaxed),
        "failedUnits": tb.failed.load(Relaxed),
    });
    if let Some(g) = engine.guard() {
        let breakers: Vec<serde_json::Value> = g
            .breakers
            .iter()
            .enumerate()
            .map(|(shard, b)| {
                let b = b.snapshot();
                serde_json::json!({
                    "shard": shard,
                    "state": b.state,
                    "consecutiveFailures": b.consecutive_failures,
                    "openedTotal": b.opened_total,
                })
            })
            .collect();
        body["breakers"] = breakers.into();
        body["fallback"] = serde_json::json!({
            "active": !g.all_closed(),
            "decided": g.fallback.decided.load(Relaxed),
            "pendingWriteBack": g.fallback.not_written_back(),
            "writtenBackUnits": g.fallback.written_back.load(Relaxed),
            "writeBackRefusedUnits": g.fallback.write_back_refused.load(Relaxed),
            "ledgerDropped": g.fallback.ledger_dropped.load(Relaxed),
            "storeFull": g.fallback.store_full.load(Relaxed),
        });
        body["liveAgents"] = g.membership.live().into();
        body["agentId"] = g.membership.config().id.clone().into();
    }
    axum::Json(body)
}

/// Batched execution: each rule's mode as configured and as it runs now, flush intervals, tracked
/// keys and pending units, promoted hot keys, and the flush figures.
async fn batch(State(engine): State<Arc<Engine>>) -> axum::Json<serde_json::Value> {
    let b = engine.batcher();
    let n = engine.live_agents();
    let tracked: std::collections::HashMap<String, (usize, u64, u64)> = b
        .snapshot()
        .into_iter()
        .map(|(id, keys, pending, unlearned)| (id, (keys, pending, unlearned)))
        .collect();
    let redis = matches!(engine.store(), Store::Shared(_));
    let rules: Vec<serde_json::Value> = engine
        .rules()
        .iter()
        .map(|r| {
            let (keys, pending, unlearned) = tracked.get(&r.id).copied().unwrap_or_default();
            let effective = if redis && engine.batched_by_rule(r, n) {
                "batched"
            } else {
                "sync"
            };
            serde_json::json!({
                "id": r.id,
                "execution": r.execution,
                "effective": effective,
                "flushIntervalMs": b.flush_ms(r),
                "trackedKeys": keys,
                "pendingUnits": pending,
                "unlearnedUnits": unlearned,
            })
        })
        .collect();
    let hot: Vec<serde_json::Value> = engine
        .hot_keys()
        .promoted()
        .into_iter()
        .map(|(rule, key, rate)| serde_json::json!({"rule": rule, "key": key, "checksPerSecond": rate}))
        .collect();
    let s = &b.stats;
    axum::Json(serde_json::json!({
        "liveAgents": n,
        "defaultFlushIntervalMs": b.default_flush_ms(),
        "rules": rules,
        "hotKeys": hot,
        "hotKeyRate": engine.hot_keys().threshold(),
        "trackedKeys": b.keys(),
        "stats": {
            "admitted": s.admitted.load(Relaxed),
            "deniedLimit": s.denied_limit.load(Relaxed),
            "deniedShare": s.denied_share.load(Relaxed),
            "flushes": s.flushes.load(Relaxed),
            "entries": s.entries.load(Relaxed),
            "units": s.units.load(Relaxed),
            "errors": s.errors.load(Relaxed),
            "uncertainUnits": s.uncertain_units.load(Relaxed),
            "full": s.full.load(Relaxed),
        },
    }))
}

/// `PUT /v1/batch/flush-interval` with `{"ms": 50}` (the default) or `{"ms": 50, "rule": "api"}`
/// (one rule): takes effect at the next flush, without a restart.
async fn set_flush_interval(
    State(engine): State<Arc<Engine>>,
    body: axum::body::Bytes,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        ms: u64,
        #[serde(default)]
        rule: Option<String>,
    }
    let bad = |msg: String| {
        (
            StatusCode::BAD_REQUEST,
            axum::Json(serde_json::json!({ "error": msg })),
        )
    };
    let body: Body = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return bad(format!("expected {{\"ms\": N, \"rule\"?: id}}: {e}")),
    };
    if !(1..=60_000).contains(&body.ms) {
        return bad(format!("ms must be 1 to 60000, not {}", body.ms));
    }
    if let Some(id) = &body.rule {
        if engine.rules().get(id).is_none() {
            return (
                StatusCode::NOT_FOUND,
                axum::Json(serde_json::json!({ "error": format!("unknown rule {id:?}") })),
            );
        }
    }
    engine.batcher().set_flush_ms(body.rule.as_deref(), body.ms);
    tracing::info!(rule = ?body.rule, ms = body.ms, "flush interval changed");
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({ "rule": body.rule, "flushIntervalMs": body.ms })),
    )
}

/// Ready when the store answers: always for the embedded store, a PING for Redis.
async fn readyz(State(engine): State<Arc<Engine>>) -> (StatusCode, String) {
    match engine.store() {
        Store::Memory(_) => (StatusCode::OK, "ready: embedded store\n".into()),
        Store::Shared(r) => match r.ping().await {
            Ok(()) => (StatusCode::OK, "ready: redis answers\n".into()),
            Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
        },
    }
}
