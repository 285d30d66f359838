//! Envoy's RateLimitService (`envoy.service.ratelimit.v3`), served by the agent over gRPC, so Envoy,
//! Istio, Envoy Gateway and Contour use the agent as their external rate-limit service.
//!
//! - `proto`: the vendored messages, the tonic server and a client.
//! - `service`: ShouldRateLimit answered by the engine.
//! - `serve`: the gRPC listeners (TCP, Unix socket) under the agent's connection cap.

pub mod proto;
mod serve;
mod service;

pub use serve::{serve_tcp, serve_unix};
pub use service::{descriptor_key, EnvoyService, GrpcHeaders};
