//! Envoy's RateLimitService (`envoy.service.ratelimit.v3`), served by the agent over gRPC, so Envoy,
//! Istio, Envoy Gateway and Contour use the agent as their external rate-limit service.
//!
//! - `proto`: the vendored messages, the tonic server and a client.
//! - `service`: ShouldRateLimit answered by the engine.
//! - `reply`: its RateLimitResponse written as protobuf bytes.
//! - `serve`: the gRPC listeners (TCP, Unix socket) under the agent's connection cap.
//! - `native`: ShouldRateLimit as a `floodgate-h2` service (the default server; `serve` also runs
//!   tonic's).
//! - `tls`: TLS on the gRPC TCP listener, its files read again on SIGHUP.
//! - `penalty`: peers refused for a while after a connection of theirs spent a budget.
//! - `h2_crate`: the same served by the `h2` crate directly (`--grpc-server h2`), to measure against.

mod h2_crate;
mod native;
mod penalty;
pub mod proto;
mod reply;
mod serve;
mod service;
mod tls;

pub use reply::GrpcHeaders;
pub use serve::{serve_tcp, serve_unix, GrpcServer, GrpcServing};
pub use service::{descriptor_key, EnvoyService};
pub use tls::{GrpcTls, TlsFiles};
