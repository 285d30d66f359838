//! The exporter: spans from the tracer's queue, in batches of at most [`BATCH`] or every
//! [`INTERVAL`], handed to `opentelemetry-otlp`'s span exporter: OTLP/HTTP (JSON or protobuf) to
//! `<endpoint>/v1/traces`, or OTLP/gRPC to `<endpoint>`, gzip-compressed when configured.
//!
//! The crate retries what OTLP names retryable (HTTP 429, 502, 503, 504 or no answer; gRPC
//! UNAVAILABLE and the like): up to [`RETRIES`] times, after a backoff that doubles from
//! [`FIRST_BACKOFF`] (plus up to [`JITTER`]) to at most [`MAX_BACKOFF`], or after the collector's
//! `Retry-After` (HTTP) or `RetryInfo` (gRPC), all within the export's timeout. While it waits new
//! spans queue in the tracer's bounded queue (past it they are dropped and counted, as always). A
//! batch refused for good, or not sent within the timeout, is logged (once per minute at most) and
//! dropped and counted: the collector's outage never holds spans, memory or requests back for long.
//!
//! Our own here: the queue and the batching (no SDK tracer provider: a span is recorded on the
//! request path as a plain struct, `span`), and the conversion of a span into the SDK's `SpanData`.

use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};

use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind as OtelKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_otlp::{
    Compression, Protocol, RetryPolicy, WithExportConfig, WithHttpConfig, WithTonicConfig,
};
use opentelemetry_sdk::trace::{SpanExporter, SpanLinks};
use opentelemetry_sdk::Resource;
use tokio::sync::{mpsc, watch};

use super::span::{Attr, SpanData, SpanKind};

/// Most spans in one export.
pub const BATCH: usize = 512;

/// Longest a span waits for its batch.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Longest one batch's export may take, its retries included (`OTEL_EXPORTER_OTLP_TIMEOUT`).
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Most times one batch is sent again after a retryable failure.
pub const RETRIES: usize = 3;

/// The wait before a batch's first retry, doubled for each next one.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// At most this much is added to each wait, at random.
pub const JITTER: Duration = Duration::from_millis(250);

/// The longest wait before one retry the backoff reaches (a collector's `Retry-After` may ask
/// longer, within the export's timeout).
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How a batch travels (`OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `http/json`: OTLP/HTTP, JSON.
    Json,
    /// `http/protobuf`: OTLP/HTTP, protobuf.
    Protobuf,
    /// `grpc`: OTLP/gRPC.
    Grpc,
}

/// The exporter, waiting to be run.
pub struct Exporter {
    rx: mpsc::Receiver<SpanData>,
    endpoint: String,
    timeout: Duration,
    otlp: opentelemetry_otlp::SpanExporter,
    scope: InstrumentationScope,
}

impl Exporter {
    /// The exporter of `config`'s spans to `endpoint`; an error names what cannot be set up.
    pub(super) fn new(
        rx: mpsc::Receiver<SpanData>,
        endpoint: &str,
        config: &super::Config,
    ) -> Result<Self, String> {
        let base = endpoint.trim_end_matches('/');
        let retry = RetryPolicy::default()
            .with_max_retries(RETRIES)
            .with_initial_delay(FIRST_BACKOFF)
            .with_max_delay(MAX_BACKOFF)
            .with_max_jitter(JITTER);
        let compression = config.gzip.then_some(Compression::Gzip);
        let builder = opentelemetry_otlp::SpanExporter::builder();
        let built = match config.encoding {
            Encoding::Json | Encoding::Protobuf => {
                let client = match &config.certificate {
                    Some(ca) => floodgate_rules_service::http::client_with_ca(ca)
                        .map_err(|e| format!("OTEL_EXPORTER_OTLP_CERTIFICATE: {e}"))?,
                    None => floodgate_rules_service::http::shared_client()?,
                };
                let mut http = builder
                    .with_http()
                    .with_http_client(client)
                    .with_protocol(match config.encoding {
                        Encoding::Json => Protocol::HttpJson,
                        _ => Protocol::HttpBinary,
                    })
                    .with_endpoint(format!("{base}/v1/traces"))
                    .with_timeout(config.timeout)
                    .with_headers(config.headers.iter().cloned().collect::<HashMap<_, _>>())
                    .with_retry_policy(retry);
                if let Some(c) = compression {
                    http = http.with_compression(c);
                }
                http.build()
            }
            Encoding::Grpc => {
                let mut metadata = tonic::metadata::MetadataMap::new();
                for (k, v) in &config.headers {
                    let key = tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
                        .map_err(|_| format!("OTLP header {k:?}: not a gRPC metadata key"))?;
                    let value = v
                        .parse()
                        .map_err(|_| format!("OTLP header {k:?}: not a gRPC metadata value"))?;
                    metadata.insert(key, value);
                }
                let mut grpc = builder
                    .with_tonic()
                    .with_protocol(Protocol::Grpc)
                    .with_endpoint(base)
                    .with_timeout(config.timeout)
                    .with_metadata(metadata)
                    .with_retry_policy(retry);
                if base.starts_with("https://") {
                    let mut tls = tonic::transport::ClientTlsConfig::new().with_native_roots();
                    if let Some(ca) = &config.certificate {
                        let pem = std::fs::read(ca).map_err(|e| {
                            format!(
                                "OTEL_EXPORTER_OTLP_CERTIFICATE: cannot read {}: {e}",
                                ca.display()
                            )
                        })?;
                        floodgate_rules_service::http::pem_certs(&pem)
                            .map_err(|e| format!("OTEL_EXPORTER_OTLP_CERTIFICATE: {}: {e}", ca.display()))?;
                        tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(pem));
                    }
                    grpc = grpc.with_tls_config(tls);
                }
                if let Some(c) = compression {
                    grpc = grpc.with_compression(c);
                }
                grpc.build()
            }
        };
        let mut otlp = built.map_err(|e| format!("cannot set up the OTLP exporter: {e}"))?;
        otlp.set_resource(&resource(&config.service_name, &config.resource));
        Ok(Exporter {
            rx,
            endpoint: base.to_string(),
            timeout: config.timeout,
            otlp,
            scope: InstrumentationScope::builder("floodgate")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        })
    }
}

/// The resource: `service.name`, `service.version`, then `OTEL_RESOURCE_ATTRIBUTES`' others.
fn resource(service: &str, others: &[(String, String)]) -> Resource {
    let mut attributes = vec![
        KeyValue::new("service.name", service.to_string()),
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
    ];
    attributes.extend(
        others
            .iter()
            .filter(|(k, _)| k != "service.name" && k != "service.version")
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
    );
    Resource::builder_empty().with_attributes(attributes).build()
}

/// One of our spans as the SDK's: a sampled context, the parent remote when a caller sent it (a
/// server span's), the attributes, links and an error status.
fn sdk_span(s: SpanData, scope: &InstrumentationScope) -> opentelemetry_sdk::trace::SpanData {
    let context = |trace: [u8; 16], span: [u8; 8]| {
        SpanContext::new(
            TraceId::from_bytes(trace),
            SpanId::from_bytes(span),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        )
    };
    let at = |ns: u64| UNIX_EPOCH + Duration::from_nanos(ns);
    let mut links = SpanLinks::default();
    links.links = s
        .links
        .iter()
        .map(|&(t, sp)| Link::with_context(context(t, sp)))
        .collect();
    opentelemetry_sdk::trace::SpanData {
        span_context: context(s.trace_id, s.span_id),
        parent_span_id: s.parent.map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: s.parent.is_some() && s.kind == SpanKind::Server,
        span_kind: match s.kind {
            SpanKind::Server => OtelKind::Server,
            SpanKind::Client => OtelKind::Client,
        },
        name: s.name.into(),
        start_time: at(s.start_ns),
        end_time: at(s.end_ns),
        attributes: s
            .attributes
            .into_iter()
            .map(|(k, v)| {
                KeyValue::new(
                    k,
                    match v {
                        Attr::Str(x) => Value::from(x),
                        Attr::Int(x) => Value::I64(x),
                        Attr::Bool(x) => Value::Bool(x),
                    },
                )
            })
            .collect(),
        dropped_attributes_count: 0,
        events: Default::default(),
        links,
        status: if s.error { Status::error("") } else { Status::Unset },
        instrumentation_scope: scope.clone(),
    }
}

/// Sends one batch (the crate retries within the timeout); the failure that drops it, if any. A
/// shutdown does not cut it short: the agent's drain gives the exporter more than the timeout.
async fn export(e: &Exporter, batch: Vec<SpanData>) -> Option<String> {
    let spans = batch.into_iter().map(|s| sdk_span(s, &e.scope)).collect();
    // A request that hangs is not the crate's to end (it stops retrying at the timeout, but does
    // not cut a call short): the timeout, and a little for the last attempt's answer, bound it.
    match tokio::time::timeout(e.timeout + Duration::from_millis(250), e.otlp.export(spans)).await {
        Ok(Ok(())) => None,
        Ok(Err(why)) => Some(why.to_string()),
        Err(_) => Some(format!("not sent within {:?}", e.timeout)),
    }
}

/// Sends spans until `shutdown`, then what is queued, and returns.
pub async fn run_exporter(mut e: Exporter, mut shutdown: watch::Receiver<bool>) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut last_warning: Option<std::time::Instant> = None;
    let mut stopping = false;
    loop {
        if !stopping {
            tokio::select! {
                n = e.rx.recv_many(&mut batch, BATCH) => if n == 0 { stopping = true },
                _ = floodgate_core::tasks::stopped(&mut shutdown) => stopping = true,
            }
            // A first span waits up to INTERVAL for company.
            let deadline = tokio::time::Instant::now() + INTERVAL;
            while !stopping && batch.len() < BATCH {
                let room = BATCH - batch.len();
                tokio::select! {
                    n = e.rx.recv_many(&mut batch, room) => if n == 0 { stopping = true },
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = floodgate_core::tasks::stopped(&mut shutdown) => stopping = true,
                }
            }
        }
        if stopping {
            while batch.len() < BATCH {
                match e.rx.try_recv() {
                    Ok(s) => batch.push(s),
                    Err(_) => break,
                }
            }
        }
        if !batch.is_empty() {
            let spans = batch.len();
            let failure = export(&e, std::mem::take(&mut batch)).await;
            if let Some(why) = failure {
                for _ in 0..spans {
                    floodgate_core::metrics::trace_span_dropped();
                }
                if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(endpoint = %e.endpoint, error = %why, spans, "could not export spans; dropped");
                    last_warning = Some(std::time::Instant::now());
                }
            }
        }
        if stopping && e.rx.is_empty() {
            return;
        }
    }
}
