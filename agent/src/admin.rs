//! The admin HTTP API (loopback by default): health and readiness for now.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use crate::engine::Engine;
use crate::store::Store;
use std::sync::atomic::Ordering::Relaxed;

/// The admin router; tests call it without a socket.
pub fn app(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/status", get(status))
        .with_state(engine)
}

/// The agent's state: store, breaker, fallback, live agents.
async fn status(State(engine): State<Arc<Engine>>) -> axum::Json<serde_json::Value> {
    let rules: Vec<String> = engine.rules().iter().map(|r| r.id.clone()).collect();
    let mut body = serde_json::json!({
        "store": engine.store().describe(),
        "storeErrors": engine.store_errors(),
        "rules": rules,
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
            "pendingWriteBack": g.fallback.pending(),
            "writtenBackUnits": g.fallback.written_back.load(Relaxed),
            "ledgerDropped": g.fallback.ledger_dropped.load(Relaxed),
            "storeFull": g.fallback.store_full.load(Relaxed),
        });
        body["liveAgents"] = g.membership.live().into();
        body["agentId"] = g.membership.config().id.clone().into();
    }
    axum::Json(body)
}

/// Ready when the store answers: always for the embedded store, a PING for Redis.
async fn readyz(State(engine): State<Arc<Engine>>) -> (StatusCode, String) {
    match engine.store() {
        Store::Memory(_) => (StatusCode::OK, "ready: embedded store\n".into()),
        Store::Redis(r) => match r.ping().await {
            Ok(()) => (StatusCode::OK, "ready: redis answers\n".into()),
            Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
        },
    }
}
