//! What the server asks of the application: a [`Service`] that answers each unary call, and the
//! [`Config`] that names its methods and the connection's timeouts.

use std::future::Future;
use std::time::Duration;

use crate::huffman;

/// A call's failure: a gRPC status code other than OK and its message (sent as Trailers-Only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The gRPC status code.
    pub code: i32,
    /// Why, percent-encoded into `grpc-message` (at most 1 KiB of it).
    pub message: String,
}

impl Status {
    /// A status of `code` saying `message`.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Status {
            code,
            message: message.into(),
        }
    }
}

/// The application behind the server: each complete unary call's message goes to [`call`], whose
/// future is polled once at once (an answer ready then is written in the same turn) and else in
/// the connection's task until it is ready. Nothing is spawned.
///
/// [`call`]: Service::call
pub trait Service: Send + Sync + 'static {
    /// The answer: the response message's bytes (without gRPC's 5-byte prefix), or a status.
    type Future: Future<Output = Result<Vec<u8>, Status>> + Send + Unpin;

    /// Answers one call: `method` is the index of its path in [`Config::methods`], `message` the
    /// request message (uncompressed, prefix removed), `traceparent` the header's value when
    /// [`read_traceparent`](Service::read_traceparent) asked for it and the request had one.
    fn call(&self, method: usize, message: &[u8], traceparent: Option<&[u8]>) -> Self::Future;

    /// Whether calls want their `traceparent` header (a copy per request that carries one).
    fn read_traceparent(&self) -> bool {
        false
    }
}

/// A server's methods and timeouts, shared by its connections.
#[derive(Debug, Clone)]
pub struct Config {
    methods: Vec<(&'static [u8], Vec<u8>)>,
    health: Vec<&'static [u8]>,
    /// A frame, a header block or a request started, or an answer waiting for window, is dropped
    /// when this has passed since it started (a frame or header block: the connection).
    pub frame_timeout: Duration,
    /// A write the peer does not take within this closes the connection.
    pub write_timeout: Duration,
    /// A connection with no call for this long is sent GOAWAY `NO_ERROR` and closed.
    pub idle_timeout: Duration,
}

impl Config {
    /// Serves the unary methods at `paths` (e.g. `/pkg.Service/Method`), and grpc.health.v1 Check
    /// for the whole server (`""`) and each of `health_services`.
    pub fn new(paths: &[&'static [u8]], health_services: &[&'static [u8]]) -> Self {
        Config {
            // Each path's Huffman code too: hyper's h2 sends `:path` unindexed and Huffman-coded on
            // every request, and comparing codes is a memcmp where decoding is ~10 instructions a bit.
            methods: paths.iter().map(|p| (*p, huffman::encode(p))).collect(),
            health: std::iter::once(&b""[..])
                .chain(health_services.iter().copied())
                .collect(),
            frame_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(300),
        }
    }

    /// The same with these timeouts.
    pub fn timeouts(mut self, frame_timeout: Duration, write_timeout: Duration) -> Self {
        self.frame_timeout = frame_timeout;
        self.write_timeout = write_timeout;
        self
    }

    /// The same with this idle timeout.
    pub fn idle(mut self, idle_timeout: Duration) -> Self {
        self.idle_timeout = idle_timeout;
        self
    }

    /// The method whose path is `value` (plain, or its Huffman code).
    pub(crate) fn method(&self, value: &crate::hpack::Value<'_>) -> Option<usize> {
        self.methods
            .iter()
            .position(|(plain, coded)| value.is(plain, coded))
    }

    /// Whether health checks of `service` are answered.
    pub(crate) fn has_health(&self, service: &[u8]) -> bool {
        self.health.contains(&service)
    }
}
