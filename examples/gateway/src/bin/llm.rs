//! An LLM-style endpoint behind Floodgate's Layer: per API key (`X-API-Key`), at most 10,000 tokens
//! a minute, counted after each response from its `x-usage-tokens` header, and at most 2 requests in
//! flight, released when each response ends. And a streaming one, `/v1/complete`, that reserves its
//! input and output tokens before the model runs and commits what the stream used once it ends,
//! answering with the small model past the key's quota of the large one. The rules are
//! `examples/llm/rules.toml`:
//!
//! ```sh
//! cargo run --release --bin floodgate -- agent --rules examples/llm/rules.toml
//! cargo run --release --bin llm      # another terminal; then curl (README.md)
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use floodgate_sdk::middleware::RateLimitLayer;
use floodgate_sdk::{Client, ClientConfig, Meter, Reservation};
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

/// What a `/v1/complete` stream used so far; when the stream ends (or the client goes away) the
/// reservation is committed at that, off the response's path.
struct Settle {
    client: Client,
    reservation: Option<Reservation>,
    input: u32,
    output: u32,
}

impl Drop for Settle {
    fn drop(&mut self) {
        if let Some(r) = self.reservation.take() {
            let (client, used) = (self.client.clone(), [self.input, self.output, 1]);
            tokio::spawn(async move {
                let _ = client.commit(&r, &used).await;
            });
        }
    }
}

/// A streamed completion (server-sent events): its input (`x-demo-prompt-tokens`, default 200) and
/// its `max_tokens` of output (`x-max-tokens`, default 1,000) reserved at once, all or nothing,
/// with a request on the large model; past the key's quota of the large model (quota mode) the
/// small one answers. It streams `x-demo-tokens` tokens (default 600, at most `max_tokens`) in
/// chunks of 100, and what it used is committed as the stream ends.
async fn complete(State(client): State<Client>, headers: HeaderMap) -> Response {
    let number = |name: &str, default: u32| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(default)
    };
    let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) else {
        return (StatusCode::UNAUTHORIZED, "x-api-key is required\n").into_response();
    };
    let key = format!("apikey:{}", floodgate_sdk::middleware::wire_safe(key.to_string()));
    let (input, max_tokens) = (number("x-demo-prompt-tokens", 200), number("x-max-tokens", 1_000));
    let meters = vec![
        Meter::new(&key, "llm-input-tokens", input),
        Meter::new(&key, "llm-output-tokens", max_tokens),
        Meter::new(&key, "llm-large-model", 1),
    ];
    let (decision, reservation) = match client.reserve_meters(meters).await {
        Ok(answer) => answer,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    };
    if !decision.allowed {
        let secs = floodgate_sdk::middleware::retry_after_seconds(&decision);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", secs.to_string())],
            "tokens exhausted\n",
        )
            .into_response();
    }
    // Quota mode: past its quota of the large model, the key is answered by the small one.
    let model = if decision.over_quota() { "small" } else { "large" };
    let tokens = number("x-demo-tokens", 600).min(max_tokens);
    let mut settle = Settle {
        client,
        reservation,
        input,
        output: 0,
    };
    let chunks = futures::stream::iter((0..tokens.div_ceil(100)).map(move |i| {
        let n = (tokens - i * 100).min(100);
        // The whole `Settle` moves into the stream (not just its field), so that it drops, and
        // commits, when the stream does.
        let settle = &mut settle;
        settle.output += n;
        let event = json!({ "model": model, "tokens": n });
        Ok::<_, std::convert::Infallible>(format!("data: {event}\n\n"))
    }));
    let done = futures::stream::once(async { Ok("data: [DONE]\n\n".to_string()) });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-model", model)
        .body(Body::from_stream(futures::StreamExt::chain(chunks, done)))
        .unwrap_or_default()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_target(false).init();
    let args = Args::parse();
    let client = match &args.socket {
        Some(path) => Client::with_config(path, ClientConfig::default()).await,
        None => Client::with_config_default(ClientConfig::default()).await,
    };
    let layer = RateLimitLayer::new(client.clone())
        // Only for this demo: in production an authenticating hop sets the key.
        .api_key_header("x-api-key")
        // The request is let in unless its key is past its tokens; the response's count is
        // charged afterwards. The concurrency rule holds a slot until the response ends.
        .charge_header("/v1/chat", axum::http::HeaderName::from_static("x-usage-tokens"));
    // `/v1/complete` reserves and commits through the SDK itself: it is outside the Layer.
    let app = Router::new()
        .route("/v1/chat", post(chat).layer(layer))
        .route("/v1/complete", post(complete))
        .with_state(client);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "llm example listening");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
