//! A small axum service behind Floodgate's tower Layer. Every response a rule applies to carries
//! `X-RateLimit-Limit/Remaining/Reset`; past the limit it answers 429 with `Retry-After` and
//! `{"error":"rate_limited","retryAfter":N}`. With the agent's embedded default rules, `/api/...`
//! is limited per user (`X-User-Id`) and `/login` per client IP; see the README for curl.
//!
//! `cargo run --release --bin gateway -- --listen 127.0.0.1:8080 --socket /tmp/floodgate.sock`

use std::net::SocketAddr;

use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use floodgate_sdk::middleware::RateLimitLayer;
use floodgate_sdk::{Client, ClientConfig};
use serde_json::json;

#[derive(Parser)]
#[command(about = "An axum service behind Floodgate's rate-limit Layer")]
struct Args {
    /// Where the gateway listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The agent's socket.
    #[arg(long, default_value = "/tmp/floodgate.sock")]
    socket: std::path::PathBuf,
    /// Proxies whose X-Forwarded-For entries are believed (CIDR, repeatable).
    #[arg(long)]
    trust_proxy: Vec<String>,
    /// Also send the IETF draft's RateLimit-Policy and RateLimit headers.
    #[arg(long)]
    ietf: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_target(false).init();
    let args = Args::parse();
    let client = Client::with_config(&args.socket, ClientConfig::default()).await;
    let layer = RateLimitLayer::new(client)
        // The user id comes from X-User-Id. Only for this demo: in production an authenticating hop
        // sets (and strips) such a header, or `.user(...)` reads your auth layer's extensions; a
        // header clients write themselves would let them spend someone else's quota.
        .user_header("x-user-id")
        .api_key_header("x-api-key")
        // A search costs 5 units of the caller's budget.
        .cost("/api/search", 5)
        .trust_proxies(&args.trust_proxy)
        .map_err(anyhow::Error::msg)?
        .ietf_headers(args.ietf);
    let app = Router::new()
        .route("/api/hello", get(|| async { Json(json!({ "hello": "world" })) }))
        .route("/api/search", get(|| async { Json(json!({ "results": [] })) }))
        .route("/login", post(|| async { Json(json!({ "ok": true })) }))
        .route("/healthz", get(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, socket = %args.socket.display(), "gateway listening");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
