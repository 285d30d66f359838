//! The gRPC server of the Envoy path: HTTP/2 (RFC 9113) and HPACK (RFC 7541) as far as one unary
//! method needs, written for ShouldRateLimit's cost instead of tonic's generality.
//!
//! A check over tonic cost the agent ~69,000 instructions (15× the frames protocol's ~4,500: a task
//! per stream, HPACK into header maps, tower layers, h2's locked stream store); this server reads and
//! answers every stream in the connection's own task (BENCHMARKS.md, "The Envoy path's cost").
//! `--grpc-server tonic` keeps the tonic server.
//!
//! - `frame`: frame headers, kinds, flags, error codes and the frames a server writes.
//! - `hpack`: the request header block decoder, and `huffman` its string code.
//! - `grpc`: the request's message framing, the response's constant header blocks and statuses.
//! - `conn`: one connection: its loop, streams, timers, keepalive, shutdown.
//! - `recv`: the frames a client sends, and what each does.
//! - `send`: the answers, resets and window credits the server writes.
//! - `budget`: what a connection may make the agent hold: parked answers, resets, settings.

mod budget;
mod conn;
mod frame;
pub(crate) mod grpc;
mod hpack;
mod huffman;
mod recv;
mod send;

pub use conn::{serve, CONN_WINDOW, MAX_HEADER_BLOCK, MAX_STREAMS};
