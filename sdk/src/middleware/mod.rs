//! A tower [`Layer`](tower_layer::Layer) that asks the agent once per request and answers for the
//! limiter: `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (epoch seconds) on
//! every response a rule applied to, and on a rejection a 429 with `Retry-After` (whole seconds,
//! rounded up, at least 1) and the body `{"error":"rate_limited","retryAfter":N}`. Optionally the
//! IETF draft's `RateLimit-Policy` and `RateLimit` headers too.
//!
//! What the request is checked as comes from extractors, each replaceable: the endpoint (axum's
//! matched route with the `axum` feature, its `{id}` written `:id`, else the path) and the client IP
//! by default; the tier, the user id and the API key only when configured (`*_header` reads a header
//! an authenticating hop set; the closures can read what your auth layer put in the extensions) —
//! a header the client writes itself would let it pick its tier or spend someone else's quota. The
//! client IP, the user id and the API key
//! is the peer address, or the `X-Forwarded-For` entry a configured proxy added — the header is
//! believed only as far as it was written by trusted proxies. The cost is 1 unless a route says
//! otherwise. A value the wire refuses (over 256 bytes, braces, control characters) is replaced by a
//! stable hash of it, so no header can make a check invalid and slip past the limiter.
//!
//! Rules in log mode never block (the agent never rejects for them) and never show in the headers:
//! a dry run is invisible to clients. A request no rule applies to gets no headers. When the agent
//! cannot answer, the route's own policy decides if [`RateLimitLayer::fail_for`] set one; else a
//! request a fail-closed rule applies to gets a 429 (the client learned those rules from the agent);
//! else the client's fail policy (open by default: the request passes without headers; closed: 429).
//!
//! ```no_run
//! # async fn demo() {
//! use floodgate_sdk::middleware::RateLimitLayer;
//! use floodgate_sdk::Client;
//!
//! let client = Client::connect_default().await;
//! let layer = RateLimitLayer::new(client)
//!     .user_header("x-authenticated-user")
//!     .cost("/search", 5)
//!     .fail_for("/health", floodgate_sdk::FailPolicy::Open)
//!     .trust_proxies(["10.0.0.0/8"])
//!     .unwrap()
//!     .ietf_headers(true);
//! let app: axum::Router = axum::Router::new()
//!     .route("/search", axum::routing::get(|| async { "results" }))
//!     .layer(layer);
//! # }
//! ```

mod extractors;
mod headers;
mod layer;
mod lease;
mod service;

pub use extractors::{client_ip, route_name, wire_safe, Cidr, CidrError, Extractor, PeerAddr};
pub use headers::{rate_limit_headers, retry_after_seconds};
pub use layer::RateLimitLayer;
pub use lease::Released;
pub use service::{OverQuota, RateLimit, OVER_QUOTA_HEADER};
