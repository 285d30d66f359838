//! The admin HTTP API (loopback by default): health and readiness for now.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use crate::engine::Engine;
use crate::store::Store;

/// The admin router; tests call it without a socket.
pub fn app(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(engine)
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
