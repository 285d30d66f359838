//! Floodgate's gRPC server: HTTP/2 (RFC 9113) and HPACK (RFC 7541) as far as unary methods need,
//! every stream of a connection read and answered in that connection's task, and a budget with an
//! end for everything a peer can make it hold.
//!
//! The agent serves Envoy's ShouldRateLimit with it. Over tonic a check cost the agent ~69,000
//! instructions (15× the frames protocol's ~4,500: a task per stream, HPACK into header maps, tower
//! layers, h2's locked stream store), and over the `h2` crate used directly 3.1× this server's CPU
//! per check (the agent's BENCHMARKS.md, "Which HTTP/2 server"); this server answers in the
//! connection's task and compares the header fields it reads in their sent form.
//!
//! # Layout
//! - `service`: [`Service`] (the application: one call in, an answer's future out), [`Config`].
//! - `conn`: [`serve`], one connection: its loop, streams, timers, keepalive, shutdown.
//! - `recv`: the frames a client sends, and what each does; `head`: a request's header block read.
//! - `send`: the answers, resets and window credits the server writes.
//! - `budget`: what a connection may make the server hold: parked answers, resets, settings.
//! - `frame`: frame headers, kinds, flags, error codes and the frames a server writes.
//! - `hpack`: the request header block decoder, and `huffman` its string code.
//! - [`grpc`]: message framing, the response's constant header blocks, statuses, health.
//!
//! # Example
//! ```
//! use std::future::{ready, Ready};
//! use std::sync::Arc;
//! use floodgate_h2::{serve, Config, Service, Status};
//!
//! /// Answers `/echo.Echo/Say` with the request's own bytes.
//! struct Echo;
//!
//! impl Service for Echo {
//!     type Future = Ready<Result<Vec<u8>, Status>>;
//!     fn call(&self, _method: usize, message: &[u8], _trace: Option<&[u8]>) -> Self::Future {
//!         ready(Ok(message.to_vec()))
//!     }
//! }
//!
//! # async fn demo(listener: tokio::net::TcpListener, stop: tokio::sync::watch::Receiver<bool>) {
//! let config = Arc::new(Config::new(&[b"/echo.Echo/Say"], &[b"echo.Echo"]));
//! let (socket, _) = listener.accept().await.unwrap();
//! // Until the peer closes, a connection error, or `stop` (then GOAWAY and a drain).
//! let ended = serve(socket, Arc::new(Echo), config, stop).await;
//! # let _ = ended;
//! # }
//! ```

#![forbid(unsafe_code)]

mod budget;
mod conn;
mod frame;
pub mod grpc;
mod head;
mod headers;
mod hpack;
mod huffman;
mod inbound;
mod recv;
mod send;
mod service;
mod stream;

pub use budget::{AGENT_PARKED_BYTES, CALM, MAX_PARKED_BYTES, MAX_PARKED_STREAMS};
pub use conn::{
    serve, serve_reporting, Ended, CONN_WINDOW, KEEPALIVE, MAX_CONTINUATIONS, MAX_HEADER_BLOCK, MAX_STREAMS,
    TURN,
};
pub use service::{Config, Service, Status};

/// Entry points for the fuzz targets (`h2/fuzz`): the decoders on their own. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    /// Decodes `block` with a fresh HPACK decoder; every field is handed to nowhere.
    pub fn hpack(block: &[u8]) -> bool {
        let mut d = crate::hpack::Decoder::default();
        d.decode(block, crate::MAX_HEADER_BLOCK, |_, _, _| {}).is_ok()
    }

    /// Decodes `code` as a Huffman string.
    pub fn huffman(code: &[u8]) -> bool {
        let mut out = Vec::new();
        crate::huffman::decode(code, &mut out).is_ok()
    }

    /// Splits `bytes` into frame headers as the server reads them: how many whole frames.
    pub fn frames(mut bytes: &[u8]) -> usize {
        let mut n = 0;
        while let Some(h) = crate::frame::Head::parse(bytes) {
            let Some(rest) = bytes.get(crate::frame::HEAD + h.len..) else {
                break;
            };
            let _ = crate::frame::unpadded(&h, &bytes[crate::frame::HEAD..crate::frame::HEAD + h.len]);
            bytes = rest;
            n += 1;
        }
        n
    }
}
