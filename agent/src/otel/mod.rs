//! OpenTelemetry traces, opt-in (`--otlp-endpoint`): a span per check (frames and gRPC) and per
//! rules-service request, each a child of the caller's W3C trace context when it sent one, sent in
//! batches to an OTLP collector: OTLP/HTTP (JSON or protobuf) or OTLP/gRPC, by `opentelemetry-otlp`.
//!
//! Off (the default) it costs a check one atomic load (`enabled`). On, a span is recorded when the
//! caller's context says sampled, or, for a request without one, when its new trace id falls under
//! the sampling ratio (OpenTelemetry's parent-based trace-id-ratio sampler); a recorded span is a
//! clock read at each end and a message to the exporter's task, never an await on the request path:
//! when the exporter's queue is full the span is dropped and counted.
//!
//! - `span`: ids, sampling, `SpanStart` and its end.
//! - `export`: the exporter task: batches, each a span of the SDK's handed to `opentelemetry-otlp`.
//! - `layer`: the rules service's HTTP requests as spans.

mod export;
mod layer;
mod span;

use std::sync::OnceLock;

pub use export::{run_exporter, Encoding, Exporter, EXPORT_TIMEOUT};
pub use layer::http_spans;
pub use span::{Attr, SpanData, SpanKind, SpanStart, Tracer};

static TRACER: OnceLock<Tracer> = OnceLock::new();

/// Whether traces are on (one atomic load).
#[inline]
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The process's tracer, when traces are on.
#[inline]
pub fn tracer() -> Option<&'static Tracer> {
    TRACER.get()
}

/// Turns traces on for the process (the first call wins) and returns the exporter to run: None
/// when no endpoint is configured (or traces were on already), an error when the exporter cannot be
/// set up (traces stay off).
pub fn install(config: &Config) -> Result<Option<Exporter>, String> {
    let Some(endpoint) = config.endpoint.as_ref() else {
        return Ok(None);
    };
    let (tracer, exporter) = span::pair(endpoint, config)?;
    if TRACER.set(tracer).is_err() {
        return Ok(None);
    }
    floodgate_core::call_trace::install(report_call);
    Ok(Some(exporter))
}

/// A coalesced Redis script call as a span: the child of the first traced check it served, linked
/// to every traced check it served, with how many checks and items it carried in all.
fn report_call(call: floodgate_core::call_trace::CallReport) {
    let Some(tracer) = tracer() else {
        return;
    };
    let Some(&(trace_id, parent)) = call.served.first() else {
        return;
    };
    let (now_ns, now) = (span::unix_ns(), std::time::Instant::now());
    let ago = |t: std::time::Instant| now.saturating_duration_since(t).as_nanos() as u64;
    tracer.send(SpanData {
        trace_id,
        span_id: tracer.next_id().to_be_bytes(),
        parent: Some(parent),
        name: "redis.call".into(),
        kind: SpanKind::Client,
        start_ns: now_ns.saturating_sub(ago(call.sent)),
        end_ns: now_ns.saturating_sub(ago(call.answered)),
        attributes: vec![
            // OpenTelemetry's database conventions: what was asked of whom.
            ("db.system.name", Attr::Str("redis".into())),
            ("db.operation.name", Attr::Str("EVALSHA".into())),
            ("server.address", Attr::Str(call.server.0)),
            ("server.port", Attr::Int(call.server.1.map_or(0, i64::from))),
            ("floodgate.shard", Attr::Int(call.shard as i64)),
            ("floodgate.coalesced_checks", Attr::Int(call.checks as i64)),
            ("floodgate.traced_checks", Attr::Int(call.served.len() as i64)),
            ("floodgate.items", Attr::Int(call.items as i64)),
        ],
        error: !call.ok,
        links: call.served,
    });
}

/// A router whose requests are recorded as spans.
pub fn wrap_router(router: axum::Router) -> axum::Router {
    router.layer(axum::middleware::from_fn(http_spans))
}

/// What `--otlp-*` say.
#[derive(Debug, Clone)]
pub struct Config {
    /// The collector's base URL (OTLP/HTTP: spans go to `<endpoint>/v1/traces`; OTLP/gRPC: to
    /// `<endpoint>`); None: off.
    pub endpoint: Option<String>,
    /// `service.name` of the spans' resource.
    pub service_name: String,
    /// Share of requests without a sampled parent that start a recorded trace (0 to 1).
    pub sample_ratio: f64,
    /// Headers sent with every export (`OTEL_EXPORTER_OTLP_HEADERS`: a backend's auth, say).
    pub headers: Vec<(String, String)>,
    /// Longest one export may take.
    pub timeout: std::time::Duration,
    /// Whether exports are gzip-compressed (`OTEL_EXPORTER_OTLP_COMPRESSION=gzip`).
    pub gzip: bool,
    /// How a batch travels (`OTEL_EXPORTER_OTLP_PROTOCOL`: `http/json`, the default,
    /// `http/protobuf` or `grpc`).
    pub encoding: Encoding,
    /// The resource's attributes besides `service.name` and `service.version`
    /// (`OTEL_RESOURCE_ATTRIBUTES`).
    pub resource: Vec<(String, String)>,
    /// PEM certificates an `https://` collector may be signed by, besides the system's roots
    /// (`OTEL_EXPORTER_OTLP_CERTIFICATE`).
    pub certificate: Option<std::path::PathBuf>,
}

/// Starts a check's span under the caller's context, if traces are on and it is sampled.
#[inline]
pub fn start_check(parent: Option<floodgate_protocol::TraceContext>) -> Option<Box<SpanStart>> {
    tracer()?.start(parent, "check").map(Box::new)
}

/// How a check came: the frames protocol, or a gRPC ShouldRateLimit answered with this status
/// code (0, OK, for every answer but a refused request, over limit included).
#[derive(Debug, Clone, Copy)]
pub enum Via {
    /// The frames protocol (the SDKs, the Unix socket or TCP).
    Frames,
    /// gRPC, answered with this status code.
    Grpc(i32),
}

/// The gRPC method a ShouldRateLimit span names (`rpc.method`, fully qualified).
pub const RLS_METHOD: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A gRPC status code's name, as `rpc.response.status_code` gives it.
pub fn grpc_status_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("UNKNOWN")
}

/// Ends a check's span: its rules, verdict, source and items (`Ok(None)`: a gRPC request none of
/// whose descriptors has a rule), and how long it waited on the store (`store_wait`: None when the
/// engine answered at once). A gRPC check's span also carries OpenTelemetry's RPC attributes
/// (`rpc.system.name`, `rpc.method`, `rpc.response.status_code`, and `error.type` on an error).
pub fn end_check(
    span: SpanStart,
    via: Via,
    result: Result<Option<&floodgate_protocol::Decision>, &str>,
    store_wait: Option<std::time::Duration>,
) {
    let mut attributes = match via {
        Via::Frames => vec![("floodgate.protocol", Attr::Str("frames".into()))],
        Via::Grpc(code) => {
            let status = grpc_status_name(code);
            let mut a = vec![
                ("floodgate.protocol", Attr::Str("grpc".into())),
                ("rpc.system.name", Attr::Str("grpc".into())),
                ("rpc.method", Attr::Str(RLS_METHOD.into())),
                ("rpc.response.status_code", Attr::Str(status.into())),
            ];
            if code != 0 {
                a.push(("error.type", Attr::Str(status.into())));
            }
            a
        }
    };
    let error = match result {
        // No descriptor had a rule (gRPC): nothing decided, allowed.
        Ok(None) => {
            attributes.push(("floodgate.items", Attr::Int(0)));
            attributes.push(("floodgate.allowed", Attr::Bool(true)));
            false
        }
        Ok(Some(d)) => {
            let rules: Vec<&str> = d.items.iter().map(|i| i.rule_id.as_str()).collect();
            attributes.push(("floodgate.rules", Attr::Str(rules.join(","))));
            attributes.push(("floodgate.items", Attr::Int(d.items.len() as i64)));
            attributes.push(("floodgate.allowed", Attr::Bool(d.combined.allowed)));
            attributes.push(("floodgate.source", Attr::Str(d.combined.source.as_str().into())));
            false
        }
        Err(message) => {
            attributes.push(("floodgate.error", Attr::Str(message.into())));
            true
        }
    };
    if let Some(wait) = store_wait {
        attributes.push((
            "floodgate.store_wait_us",
            Attr::Int(wait.as_micros().min(i64::MAX as u128) as i64),
        ));
    }
    span.end(None, attributes, error);
}
