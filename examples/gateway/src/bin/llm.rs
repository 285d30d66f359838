//! An LLM-style endpoint behind Floodgate's Layer: per API key (`X-API-Key`), at most 10,000 tokens
//! a minute, counted after each response from its `x-usage-tokens` header, and at most 2 requests in
//! flight, released when each response ends. The rules are `examples/llm/rules.toml`:
//!
//! ```sh
//! cargo run --release --bin floodgate -- agent --rules examples/llm/rules.toml
//! cargo run --release --bin llm      # another terminal; then curl (README.md)
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use floodgate_sdk::middleware::RateLimitLayer;
use floodgate_sdk::{Client, ClientConfig};
use serde_json::json;

#[derive(Parser)]
#[command(about = "An LLM-style endpoint limited in tokens per minute and requests in flight")]
struct Args {
    /// Where the service listens.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// The agent's socket (default: where every SDK looks).
    #[arg(long)]
    socket: Option<std::path::PathBuf>,
}

/// "Generates" for `x-demo-ms` milliseconds (default 2,000) and reports the tokens it used: the
/// `x-demo-tokens` header's number, default 1,500.
async fn chat(headers: HeaderMap) -> impl IntoResponse {
    let number = |name: &str, default: u64| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(default)
    };
    tokio::time::sleep(Duration::from_millis(number("x-demo-ms", 2_000))).await;
    let tokens = number("x-demo-tokens", 1_500);
    let mut out = HeaderMap::new();
    out.insert("x-usage-tokens", HeaderValue::from(tokens));
    (
        out,
        Json(json!({ "answer": "…", "usage": { "total_tokens": tokens } })),
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_target(false).init();
    let args = Args::parse();
    let client = match &args.socket {
        Some(path) => Client::with_config(path, ClientConfig::default()).await,
        None => Client::with_config_default(ClientConfig::default()).await,
    };
    let layer = RateLimitLayer::new(client)
        // Only for this demo: in production an authenticating hop sets the key.
        .api_key_header("x-api-key")
        // The request is let in unless its key is past its tokens; the response's count is
        // charged afterwards. The concurrency rule holds a slot until the response ends.
        .charge_header("/v1/chat", axum::http::HeaderName::from_static("x-usage-tokens"));
    let app = Router::new().route("/v1/chat", post(chat)).layer(layer);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "llm example listening");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
