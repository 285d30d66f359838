//! The exporter: spans from the tracer's queue, in batches of at most [`BATCH`] or every
//! [`INTERVAL`], as OTLP/JSON (`ExportTraceServiceRequest`) POSTed to `<endpoint>/v1/traces`.
//!
//! A failed POST is logged (once per minute at most) and its batch dropped and counted: the
//! collector's outage never holds spans, memory or requests back.

use std::time::Duration;

use floodgate_protocol::push_hex;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use super::span::{Attr, SpanData};

/// Most spans in one POST.
pub const BATCH: usize = 512;

/// Longest a span waits for its batch.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Longest one POST may take.
pub const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// The exporter, waiting to be run.
pub struct Exporter {
    rx: mpsc::Receiver<SpanData>,
    endpoint: String,
    service: String,
    headers: Vec<(String, String)>,
    timeout: Duration,
    resource: Vec<(String, String)>,
}

impl Exporter {
    pub(super) fn new(rx: mpsc::Receiver<SpanData>, endpoint: &str, config: &super::Config) -> Self {
        Exporter {
            rx,
            endpoint: endpoint.trim_end_matches('/').to_string(),
            service: config.service_name.clone(),
            headers: config.headers.clone(),
            timeout: config.timeout,
            resource: config.resource.clone(),
        }
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
            let body = otlp_json(&e.service, &e.resource, &batch).to_string();
            let headers: Vec<(&str, String)> =
                e.headers.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let sent = floodgate_rules_service::http::request(
                &e.endpoint,
                "POST",
                "/v1/traces",
                None,
                &headers,
                Some(body.as_bytes()),
                e.timeout,
            )
            .await;
            let failure = match sent {
                Ok(r) if (200..300).contains(&r.status) => None,
                Ok(r) => Some(format!("HTTP {}", r.status)),
                Err(why) => Some(why),
            };
            if let Some(why) = failure {
                for _ in 0..batch.len() {
                    floodgate_core::metrics::trace_span_dropped();
                }
                if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(endpoint = %e.endpoint, error = %why, spans = batch.len(), "could not export spans; dropped");
                    last_warning = Some(std::time::Instant::now());
                }
            }
            batch.clear();
        }
        if stopping && e.rx.is_empty() {
            return;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 * bytes.len());
    push_hex(&mut s, bytes);
    s
}

/// One ExportTraceServiceRequest in OTLP's JSON mapping (ids in hex, 64-bit integers as strings),
/// its resource `service.name`, `service.version` and `resource`'s other attributes.
pub fn otlp_json(service: &str, resource: &[(String, String)], spans: &[SpanData]) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let attributes: Vec<Value> = s
                .attributes
                .iter()
                .map(|(k, v)| {
                    let value = match v {
                        Attr::Str(x) => json!({ "stringValue": x }),
                        Attr::Int(x) => json!({ "intValue": x.to_string() }),
                        Attr::Bool(x) => json!({ "boolValue": x }),
                    };
                    json!({ "key": k, "value": value })
                })
                .collect();
            let mut span = json!({
                "traceId": hex(&s.trace_id),
                "spanId": hex(&s.span_id),
                "name": s.name,
                // SPAN_KIND_SERVER (a request this process answered) or SPAN_KIND_CLIENT (a call
                // it made).
                "kind": match s.kind { super::SpanKind::Server => 2, super::SpanKind::Client => 3 },
                "startTimeUnixNano": s.start_ns.to_string(),
                "endTimeUnixNano": s.end_ns.to_string(),
                "attributes": attributes,
                // STATUS_CODE_ERROR, or unset.
                "status": if s.error { json!({ "code": 2 }) } else { json!({}) },
            });
            if let Some(p) = s.parent {
                span["parentSpanId"] = json!(hex(&p));
            }
            if !s.links.is_empty() {
                let links: Vec<Value> = s
                    .links
                    .iter()
                    .map(|(t, sp)| json!({ "traceId": hex(t), "spanId": hex(sp) }))
                    .collect();
                span["links"] = json!(links);
            }
            span
        })
        .collect();
    let mut attributes = vec![
        json!({ "key": "service.name", "value": { "stringValue": service } }),
        json!({ "key": "service.version", "value": { "stringValue": env!("CARGO_PKG_VERSION") } }),
    ];
    for (k, v) in resource {
        if k != "service.name" && k != "service.version" {
            attributes.push(json!({ "key": k, "value": { "stringValue": v } }));
        }
    }
    json!({
        "resourceSpans": [{
            "resource": { "attributes": attributes },
            "scopeSpans": [{
                "scope": { "name": "floodgate", "version": env!("CARGO_PKG_VERSION") },
                "spans": spans,
            }],
        }]
    })
}
