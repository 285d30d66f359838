//! ShouldRateLimit on Floodgate's own gRPC server (`floodgate-h2`, `--grpc-server native`, the
//! default): the server hands each call's message to [`Calls`], which decodes it and asks the
//! engine; the answer's bytes are the ones `reply` writes.

use std::future::{ready, Future};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use floodgate_h2::{grpc::status, Config, Service, Status};
use prost::Message;

use super::proto::RateLimitRequest;
use super::EnvoyService;

/// The method served.
pub const SHOULD_RATE_LIMIT: &[u8] = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The service grpc.health.v1 Check names besides the server as a whole.
pub const HEALTH_SERVICE: &[u8] = b"envoy.service.ratelimit.v3.RateLimitService";

/// The Envoy service as the native server's [`Service`].
pub struct Calls(pub Arc<EnvoyService>);

impl Service for Calls {
    type Future = Pin<Box<dyn Future<Output = Result<Vec<u8>, Status>> + Send>>;

    fn call(&self, _method: usize, message: &[u8], traceparent: Option<&[u8]>) -> Self::Future {
        let request = match RateLimitRequest::decode(message) {
            Ok(r) => r,
            Err(e) => {
                let why = format!("the request does not decode: {e}");
                return Box::pin(ready(Err(Status::new(status::INTERNAL, why))));
            }
        };
        let trace = traceparent
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(floodgate_protocol::TraceContext::parse);
        let service = self.0.clone();
        Box::pin(async move {
            service
                .decide_bytes(request, trace)
                .await
                .map_err(|e| Status::new(e.code() as i32, e.message()))
        })
    }

    fn read_traceparent(&self) -> bool {
        crate::otel::enabled()
    }
}

/// The server's methods and health names, with these timeouts.
pub fn config(frame_timeout: std::time::Duration, idle_timeout: std::time::Duration) -> Arc<Config> {
    static BASE: OnceLock<Config> = OnceLock::new();
    let base = BASE.get_or_init(|| Config::new(&[SHOULD_RATE_LIMIT], &[HEALTH_SERVICE]));
    Arc::new(
        base.clone()
            .timeouts(frame_timeout, crate::server::WRITE_TIMEOUT)
            .idle(idle_timeout),
    )
}
