//! A small axum service behind Floodgate's tower Layer. Every response a rule applies to carries
//! `X-RateLimit-Limit/Remaining/Reset`; past the limit it answers 429 with `Retry-After` and
//! `{"error":"rate_limited","retryAfter":N}`. With the agent's embedded default rules, `/api/...`
//! is limited per user (`X-User-Id`) and `/login` per client IP; see docs/gateway.md for curl.
//!
//! `cargo run --release --bin gateway -- --listen 127.0.0.1:8080` (the agent at its default socket)

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
    /// The agent's socket (default: where every SDK looks, `$FLOODGATE_SOCKET`, else
    /// `/run/floodgate/floodgate.sock`, else `$XDG_RUNTIME_DIR/floodgate/floodgate.sock`).
    #[arg(long)]
    socket: Option<std::path::PathBuf>,
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
    let client = match &args.socket {
        Some(path) => Client::with_config(path, ClientConfig::default()).await,
        None => Client::with_config_default(ClientConfig::default()).await,
    };
    let socket = client.health().path;
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
    tracing::info!(addr = %listener.local_addr()?, socket = %socket.display(), "gateway listening");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
