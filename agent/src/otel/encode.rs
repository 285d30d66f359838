//! A batch of spans as one OTLP `ExportTraceServiceRequest`: in OTLP's JSON mapping, or as protobuf
//! (`opentelemetry-proto`'s messages, encoded by prost), with the resource's `service.name`,
//! `service.version` and the configured resource attributes.

use floodgate_protocol::push_hex;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{span, status, ResourceSpans, ScopeSpans, Span, Status};
use prost::Message;
use serde_json::{json, Value};

use super::span::{Attr, SpanData, SpanKind};

/// How a batch is encoded (`OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `http/json`.
    Json,
    /// `http/protobuf`.
    Protobuf,
}

impl Encoding {
    /// The body's `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Encoding::Json => "application/json",
            Encoding::Protobuf => "application/x-protobuf",
        }
    }

    /// `spans` as one request's body.
    pub fn body(self, service: &str, resource: &[(String, String)], spans: &[SpanData]) -> Vec<u8> {
        match self {
            Encoding::Json => otlp_json(service, resource, spans).to_string().into_bytes(),
            Encoding::Protobuf => otlp_protobuf(service, resource, spans).encode_to_vec(),
        }
    }
}

/// The resource's attributes: `service.name`, `service.version`, then `resource`'s others.
fn resource_attributes<'a>(service: &'a str, resource: &'a [(String, String)]) -> Vec<(&'a str, &'a str)> {
    let mut out = vec![
        ("service.name", service),
        ("service.version", env!("CARGO_PKG_VERSION")),
    ];
    out.extend(
        resource
            .iter()
            .filter(|(k, _)| k != "service.name" && k != "service.version")
            .map(|(k, v)| (k.as_str(), v.as_str())),
    );
    out
}

/// One ExportTraceServiceRequest as prost's messages.
pub fn otlp_protobuf(
    service: &str,
    resource: &[(String, String)],
    spans: &[SpanData],
) -> ExportTraceServiceRequest {
    let string = |k: &str, v: &str| KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.to_string())),
        }),
        ..Default::default()
    };
    let spans = spans
        .iter()
        .map(|s| Span {
            trace_id: s.trace_id.to_vec(),
            span_id: s.span_id.to_vec(),
            parent_span_id: s.parent.map(|p| p.to_vec()).unwrap_or_default(),
            name: s.name.clone(),
            kind: match s.kind {
                SpanKind::Server => span::SpanKind::Server,
                SpanKind::Client => span::SpanKind::Client,
            } as i32,
            start_time_unix_nano: s.start_ns,
            end_time_unix_nano: s.end_ns,
            attributes: s
                .attributes
                .iter()
                .map(|(k, v)| KeyValue {
                    key: k.to_string(),
                    value: Some(AnyValue {
                        value: Some(match v {
                            Attr::Str(x) => any_value::Value::StringValue(x.clone()),
                            Attr::Int(x) => any_value::Value::IntValue(*x),
                            Attr::Bool(x) => any_value::Value::BoolValue(*x),
                        }),
                    }),
                    ..Default::default()
                })
                .collect(),
            links: s
                .links
                .iter()
                .map(|(t, sp)| span::Link {
                    trace_id: t.to_vec(),
                    span_id: sp.to_vec(),
                    ..Default::default()
                })
                .collect(),
            status: s.error.then(|| Status {
                code: status::StatusCode::Error as i32,
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: resource_attributes(service, resource)
                    .into_iter()
                    .map(|(k, v)| string(k, v))
                    .collect(),
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "floodgate".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                spans,
                ..Default::default()
            }],
            ..Default::default()
        }],
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
                "kind": match s.kind { SpanKind::Server => 2, SpanKind::Client => 3 },
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
    let attributes: Vec<Value> = resource_attributes(service, resource)
        .into_iter()
        .map(|(k, v)| json!({ "key": k, "value": { "stringValue": v } }))
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_encodings_carry_the_same_span() {
        let span = SpanData {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: None,
            name: "redis.call".into(),
            start_ns: 10,
            end_ns: 20,
            attributes: vec![("n", Attr::Int(7)), ("ok", Attr::Bool(false))],
            error: true,
            links: vec![([3; 16], [4; 8])],
            kind: SpanKind::Client,
        };
        let resource = [("service.name".to_string(), "ignored".to_string())];
        let p = otlp_protobuf("svc", &resource, std::slice::from_ref(&span));
        let decoded = ExportTraceServiceRequest::decode(
            &Encoding::Protobuf.body("svc", &resource, std::slice::from_ref(&span))[..],
        )
        .unwrap();
        assert_eq!(decoded, p);
        let attrs = &p.resource_spans[0].resource.as_ref().unwrap().attributes;
        assert_eq!((attrs.len(), attrs[0].key.as_str()), (2, "service.name"));
        let s = &p.resource_spans[0].scope_spans[0].spans[0];
        assert_eq!(s.kind, span::SpanKind::Client as i32);
        assert!(s.parent_span_id.is_empty());
        assert_eq!(
            s.status.as_ref().map(|x| x.code),
            Some(status::StatusCode::Error as i32)
        );
        assert_eq!(s.links[0].trace_id, vec![3; 16]);
        assert_eq!(
            s.attributes[0].value.as_ref().unwrap().value,
            Some(any_value::Value::IntValue(7))
        );
        let j = otlp_json("svc", &resource, &[span]);
        let js = &j["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(
            (js["kind"].as_i64(), js["status"]["code"].as_i64()),
            (Some(3), Some(2))
        );
        assert_eq!(js["attributes"][0]["value"]["intValue"], "7");
        assert_eq!(js["links"][0]["spanId"], "0404040404040404");
    }
}
