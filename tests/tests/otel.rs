//! OpenTelemetry traces against OTLP receivers started by the test (HTTP, gRPC): with `--otlp-endpoint`,
//! a check over the frames protocol (the SDK's trace context, the Layer's `traceparent` header, on
//! the request's check and on its lease's release),
//! a ShouldRateLimit over gRPC (`traceparent` metadata) and a rules-API request each become a span
//! whose trace and parent ids are the caller's; a context that says "not sampled" is not recorded,
//! and a check without one starts a trace of its own at the sampling ratio.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use floodgate_agent::envoy::proto::{Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest};
use floodgate_protocol::{Check, Item, TraceContext};
use floodgate_sdk::CallOptions;
use floodgate_tests::{eventually, patient_client, Agent, RulesServer, TestCa};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use serde_json::Value;

const RULES: &str = r#"{"rules":[
  {"id":"api","dimension":"user","limit":100,"windowSeconds":60},
  {"id":"edge-ip","dimension":"descriptor","limit":100,"windowSeconds":60,
   "envoy":{"domain":"edge","descriptors":[{"key":"remote_address"}]}}]}"#;

/// An OTLP/HTTP body as OTLP/JSON: JSON as sent, protobuf (the agent's default) decoded and
/// written in OTLP's JSON mapping by opentelemetry-proto's serde (the mapping its JSON export uses).
fn otlp_json(headers: &axum::http::HeaderMap, body: &[u8]) -> Value {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    let kind = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if kind == "application/x-protobuf" {
        let request = ExportTraceServiceRequest::decode(body).expect("OTLP/protobuf");
        serde_json::to_value(request).expect("OTLP/JSON")
    } else {
        serde_json::from_slice(body).expect("OTLP/JSON")
    }
}

/// Every span the receiver was sent.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Value>>>);

impl Received {
    async fn start() -> (Received, SocketAddr) {
        let got = Received::default();
        let store = got.clone();
        let app = Router::new().route(
            "/v1/traces",
            post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let store = store.clone();
                async move {
                    let v = otlp_json(&headers, &body);
                    let mut spans = store.0.lock().unwrap();
                    for rs in v["resourceSpans"].as_array().unwrap() {
                        // The resource's attributes come in no set order.
                        let service = rs["resource"]["attributes"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .find(|a| a["key"] == "service.name")
                            .map(|a| a["value"]["stringValue"].clone())
                            .unwrap_or_default();
                        for ss in rs["scopeSpans"].as_array().unwrap() {
                            for s in ss["spans"].as_array().unwrap() {
                                let mut s = s.clone();
                                s["service"] = service.clone();
                                spans.push(s);
                            }
                        }
                    }
                    "{}"
                }
            }),
        );
        let addr = serve(app).await;
        (got, addr)
    }

    /// The span of trace `trace` (hex), once it arrives.
    async fn span_of(&self, trace: &str) -> Value {
        let got = self.clone();
        let trace = trace.to_string();
        eventually(
            "the span reaches the receiver",
            Duration::from_secs(10),
            move || {
                let spans = got.0.lock().unwrap();
                // A check's or a request's span, not a store call's.
                std::future::ready(
                    spans
                        .iter()
                        .find(|s| s["traceId"] == trace.as_str() && s["name"] != "redis.call")
                        .cloned(),
                )
            },
        )
        .await
    }

    fn all(&self) -> Vec<Value> {
        self.0.lock().unwrap().clone()
    }
}

/// Serves `app` (a test's OTLP receiver) on a free loopback port.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// An agent exporting every trace to the receiver at `addr`.
fn exporting_to(addr: SocketAddr) -> floodgate_tests::AgentBuilder {
    Agent::builder()
        .rules(RULES)
        .arg("--otlp-endpoint")
        .arg(&format!("http://{addr}"))
        .arg("--otlp-sample-ratio")
        .arg("1")
}

/// One allowed check of `api` under the caller's trace context `t`.
async fn traced_check(client: &floodgate_sdk::Client, t: TraceContext) {
    let options = CallOptions {
        trace: Some(t),
        ..CallOptions::default()
    };
    let check = Check::Items(vec![Item::new("user:1", "api", 1)]);
    assert!(client.check_with(check, options).await.unwrap().allowed);
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    let a = span["attributes"].as_array().unwrap();
    &a.iter()
        .find(|a| a["key"] == key)
        .unwrap_or_else(|| panic!("no {key} in {span}"))["value"]
}

/// Whether an OTLP/JSON span has no parent: `parentSpanId` absent or empty (protobuf's JSON mapping
/// may write an empty bytes field either way).
fn is_root(span: &Value) -> bool {
    span.get("parentSpanId").is_none_or(|p| p == "")
}

fn context(n: u8, sampled: bool) -> TraceContext {
    TraceContext {
        trace_id: [n; 16],
        span_id: [n.wrapping_add(1); 8],
        flags: u8::from(sampled),
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::new();
    floodgate_protocol::push_hex(&mut s, bytes);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_and_rules_api_requests_become_child_spans() {
    let (got, addr) = Received::start().await;
    let endpoint = format!("http://{addr}");
    let agent = Agent::builder()
        .rules(RULES)
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .arg("--otlp-endpoint")
        .arg(&endpoint)
        .arg("--otlp-sample-ratio")
        .arg("1")
        .arg("--otlp-service-name")
        .arg("edge-agent")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;

    // The SDK's context: the agent's span is its child, in its trace.
    let parent = context(0x11, true);
    let check = |t: Option<TraceContext>| {
        let client = client.clone();
        async move {
            client
                .check_with(
                    Check::Items(vec![Item::new("user:1", "api", 1)]),
                    CallOptions {
                        trace: t,
                        ..CallOptions::default()
                    },
                )
                .await
                .unwrap()
        }
    };
    assert!(check(Some(parent)).await.allowed);
    let span = got.span_of(&hex(&parent.trace_id)).await;
    assert_eq!(span["parentSpanId"], hex(&parent.span_id));
    assert_ne!(span["spanId"], hex(&parent.span_id));
    assert_eq!(span["name"], "check");
    assert_eq!(span["service"], "edge-agent");
    assert_eq!(attr(&span, "floodgate.protocol")["stringValue"], "frames");
    assert_eq!(attr(&span, "floodgate.rules")["stringValue"], "api");
    assert_eq!(attr(&span, "floodgate.allowed")["boolValue"], true);
    assert_eq!(attr(&span, "floodgate.source")["stringValue"], "local");
    let (start, end): (u64, u64) = (
        span["startTimeUnixNano"].as_str().unwrap().parse().unwrap(),
        span["endTimeUnixNano"].as_str().unwrap().parse().unwrap(),
    );
    assert!(
        end >= start && start > 1_600_000_000_000_000_000,
        "{start}..{end}"
    );

    // Not sampled by the caller: not recorded. Without a context: a trace of its own (ratio 1).
    let unsampled = context(0x22, false);
    check(Some(unsampled)).await;
    let before = got.all().len();
    check(None).await;
    let root = eventually("a root span arrives", Duration::from_secs(10), || {
        let spans = got.all();
        std::future::ready((spans.len() > before).then(|| spans[before].clone()))
    })
    .await;
    assert!(is_root(&root), "{root}");
    assert_eq!(root["name"], "check");

    // gRPC: the traceparent metadata Envoy forwards.
    let grpc = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut g = RateLimitClient::connect(format!("http://{grpc}")).await.unwrap();
    let via_grpc = context(0x33, true);
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "remote_address".into(),
                value: "203.0.113.1".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    });
    request
        .metadata_mut()
        .insert("traceparent", via_grpc.traceparent().parse().unwrap());
    g.call(request).await.unwrap();
    let span = got.span_of(&hex(&via_grpc.trace_id)).await;
    assert_eq!(span["parentSpanId"], hex(&via_grpc.span_id));
    assert_eq!(attr(&span, "floodgate.protocol")["stringValue"], "grpc");
    assert_eq!(attr(&span, "floodgate.rules")["stringValue"], "edge-ip");
    // OpenTelemetry's RPC conventions.
    assert_eq!(attr(&span, "rpc.system.name")["stringValue"], "grpc");
    assert_eq!(
        attr(&span, "rpc.method")["stringValue"],
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    );
    assert_eq!(attr(&span, "rpc.response.status_code")["stringValue"], "OK");
    // A request the agent refuses: its status, and an error span.
    let refused = context(0x34, true);
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: String::new(),
        descriptors: vec![],
        hits_addend: 1,
    });
    request
        .metadata_mut()
        .insert("traceparent", refused.traceparent().parse().unwrap());
    let status = g.call(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let span = got.span_of(&hex(&refused.trace_id)).await;
    assert_eq!(
        attr(&span, "rpc.response.status_code")["stringValue"],
        "INVALID_ARGUMENT"
    );
    assert_eq!(attr(&span, "error.type")["stringValue"], "INVALID_ARGUMENT");
    assert_eq!(span["status"]["code"], 2, "{span}");

    // A rules-API request, on the rules service run with the same flags.
    let dir = tempfile::tempdir().unwrap();
    let rules = RulesServer::start_with(
        &format!("sqlite://{}", dir.path().join("r.db").display()),
        &[],
        &["--otlp-endpoint", &endpoint, "--otlp-sample-ratio", "0"],
    )
    .await;
    let via_http = context(0x44, true);
    let r = floodgate_rules_service::http::request(
        &rules.url(),
        "GET",
        "/v1/rules",
        None,
        &[("traceparent", via_http.traceparent())],
        None,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    let span = got.span_of(&hex(&via_http.trace_id)).await;
    assert_eq!(span["parentSpanId"], hex(&via_http.span_id));
    assert_eq!(span["name"], "GET /v1/rules");
    assert_eq!(attr(&span, "http.response.status_code")["intValue"], "200");
    assert_eq!(span["service"], "floodgate");

    // The unsampled check never arrived (every span sent after it has).
    assert!(
        got.all()
            .iter()
            .all(|s| s["traceId"] != hex(&unsampled.trace_id).as_str()),
        "a context that says not sampled is not recorded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_forwards_the_request_traceparent() {
    use floodgate_sdk::middleware::{PeerAddr, RateLimitLayer};
    use tower::ServiceExt;
    let (got, addr) = Received::start().await;
    let agent = Agent::builder()
        .rules(
            r#"{"rules":[{"id":"per-ip","dimension":"ip","limit":100,"windowSeconds":60},
                {"id":"in-flight","dimension":"ip","limit":10,"algorithm":"concurrency"}]}"#,
        )
        .arg("--otlp-endpoint")
        .arg(&format!("http://{addr}"))
        .arg("--otlp-sample-ratio")
        .arg("0")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(client));
    let caller = context(0x55, true);
    let req = http::Request::builder()
        .uri("/")
        .header("traceparent", caller.traceparent())
        .extension(PeerAddr("10.0.0.1:5".parse().unwrap()))
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(app.oneshot(req).await.unwrap().status(), 200);
    let span = got.span_of(&hex(&caller.trace_id)).await;
    assert_eq!(span["parentSpanId"], hex(&caller.span_id));
    assert_eq!(attr(&span, "floodgate.rules")["stringValue"], "per-ip,in-flight");
    // The lease the Layer held while the request ran is released with the same context: a second
    // span in the caller's trace, under the caller's span.
    let trace = hex(&caller.trace_id);
    let spans = eventually("the release's span arrives", Duration::from_secs(10), || {
        let spans: Vec<Value> = got
            .all()
            .into_iter()
            .filter(|s| s["traceId"] == trace.as_str())
            .collect();
        std::future::ready((spans.len() >= 2).then_some(spans))
    })
    .await;
    assert!(spans
        .iter()
        .all(|s| s["parentSpanId"] == hex(&caller.span_id).as_str()));
}

/// On Redis, the script call a check waited on is a span too: the child of the first traced check it
/// served, linked to every traced check it served (several when checks were coalesced into it), with
/// how many checks it carried in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_call_a_check_shared_is_a_linked_span() {
    let redis = floodgate_tests::RedisServer::start();
    let (got, addr) = Received::start().await;
    let agent = Agent::builder()
        .rules(RULES)
        .redis(&redis.url())
        .arg("--otlp-endpoint")
        .arg(&format!("http://{addr}"))
        .arg("--otlp-sample-ratio")
        .arg("0")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let callers: Vec<TraceContext> = (0..8).map(|n| context(0x60 + n, true)).collect();
    let checks = callers.iter().map(|t| {
        let client = client.clone();
        let t = *t;
        async move {
            let options = CallOptions {
                trace: Some(t),
                ..CallOptions::default()
            };
            let check = Check::Items(vec![Item::new("user:9", "api", 1)]);
            client.check_with(check, options).await.unwrap()
        }
    });
    for d in futures::future::join_all(checks).await {
        assert!(d.allowed && d.from_agent_answer(), "{d:?}");
    }
    for caller in &callers {
        let check = got.span_of(&hex(&caller.trace_id)).await;
        assert_eq!(attr(&check, "floodgate.source")["stringValue"], "redis");
        let check_id = check["spanId"].as_str().unwrap().to_string();
        let call = eventually("the call that served it arrives", Duration::from_secs(10), || {
            let spans = got.all();
            std::future::ready(spans.into_iter().find(|s| {
                s["name"] == "redis.call"
                    && s["links"]
                        .as_array()
                        .is_some_and(|l| l.iter().any(|l| l["spanId"] == check_id.as_str()))
            }))
        })
        .await;
        let coalesced: u64 = attr(&call, "floodgate.coalesced_checks")["intValue"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let traced = call["links"].as_array().unwrap().len() as u64;
        assert!(coalesced >= traced && traced >= 1, "{call}");
        // A call the agent made: a CLIENT span in OpenTelemetry's database conventions.
        assert_eq!(call["kind"], 3, "{call}");
        assert_eq!(attr(&call, "db.system.name")["stringValue"], "redis");
        assert_eq!(attr(&call, "db.operation.name")["stringValue"], "EVALSHA");
        assert_eq!(attr(&call, "server.address")["stringValue"], "127.0.0.1");
        assert_eq!(attr(&call, "server.port")["intValue"], redis.port().to_string());
        // Its parent is the first check it served: a check span of one of the callers' traces.
        let first = &call["links"][0];
        assert_eq!(call["traceId"], first["traceId"]);
        assert_eq!(call["parentSpanId"], first["spanId"]);
    }
}

/// With no `--otlp-*` flag, OpenTelemetry's own variables configure the export: the endpoint, an
/// auth header on every POST, gzip-compressed bodies, the service name, the resource's attributes and the sampler
/// (`always_on`: a check without a context is recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opentelemetrys_environment_variables_configure_the_export() {
    let posts: Arc<Mutex<Vec<(String, String, Value)>>> = Arc::default();
    let store = posts.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let store = store.clone();
            async move {
                let header = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string()
                };
                let (auth, encoding) = (header("authorization"), header("content-encoding"));
                // The auth header and the encodings, as one string each.
                let encoding = format!("{encoding} {}", header("content-type"));
                let mut json = Vec::new();
                if encoding.starts_with("gzip ") {
                    use std::io::Read;
                    flate2::read::GzDecoder::new(&body[..])
                        .read_to_end(&mut json)
                        .expect("a gzip body");
                } else {
                    json = body.to_vec();
                }
                let body = otlp_json(&headers, &json);
                store.lock().unwrap().push((auth, encoding, body));
                "{}"
            }
        }),
    );
    let addr = serve(app).await;

    let agent = Agent::builder()
        .rules(RULES)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{addr}"))
        .env("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20s3cret")
        .env("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env("OTEL_SERVICE_NAME", "env-agent")
        .env(
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment=test,service.name=ignored",
        )
        .env("OTEL_TRACES_SAMPLER", "always_on")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    assert!(client.allow("user:1", "api", 1).await.unwrap().allowed);
    let (auth, encoding, body) = eventually("a span is exported", Duration::from_secs(10), || {
        std::future::ready(posts.lock().unwrap().first().cloned())
    })
    .await;
    assert_eq!(auth, "Bearer s3cret");
    assert_eq!(encoding, "gzip application/json");
    let resource = &body["resourceSpans"][0]["resource"]["attributes"];
    let value = |key: &str| {
        resource
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["key"] == key)
            .map(|a| a["value"]["stringValue"].clone())
    };
    assert_eq!(value("service.name"), Some("env-agent".into()), "{body}");
    assert_eq!(value("deployment.environment"), Some("test".into()), "{body}");
    let span = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
    assert_eq!(span["name"], "check", "{body}");
    assert!(is_root(span), "a root span: {body}");

    // A variable the agent cannot read stops its start, naming it.
    let out = std::process::Command::new(floodgate_tests::floodgate_bin())
        .args(["agent", "--socket", "/nonexistent/floodgate.sock"])
        .env("OTEL_TRACES_SAMPLER", "jaeger_remote")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("OTEL_TRACES_SAMPLER"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every POST a receiver was sent: when, and the trace ids of its spans.
type Posts = Arc<Mutex<Vec<(std::time::Instant, Vec<String>)>>>;

/// A receiver that answers the POSTs carrying trace `marked` (hex) in turn with `answers`
/// (status, `Retry-After`), and every other POST with 200.
async fn scripted(marked: String, answers: Vec<(u16, Option<&'static str>)>) -> (Posts, SocketAddr) {
    let posts = Posts::default();
    let seen = posts.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let seen = seen.clone();
            let marked = marked.clone();
            let answers = answers.clone();
            async move {
                let v = otlp_json(&headers, &body);
                let traces: Vec<String> = v["resourceSpans"][0]["scopeSpans"][0]["spans"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["traceId"].as_str().unwrap().to_string())
                    .collect();
                let mut posts = seen.lock().unwrap();
                let before = posts.iter().filter(|(_, t)| t.contains(&marked)).count();
                let answer = if traces.contains(&marked) {
                    answers.get(before).copied().unwrap_or((200, None))
                } else {
                    (200, None)
                };
                posts.push((std::time::Instant::now(), traces));
                let mut headers = axum::http::HeaderMap::new();
                if let Some(after) = answer.1 {
                    headers.insert("retry-after", after.parse().unwrap());
                }
                (axum::http::StatusCode::from_u16(answer.0).unwrap(), headers, "{}")
            }
        }),
    );
    let addr = serve(app).await;
    (posts, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_refused_for_now_is_sent_again_and_one_refused_for_good_is_not() {
    let first = context(0x51, true);
    let marked = hex(&first.trace_id);
    // The batch with the first check's span: 503 with Retry-After 1 s, then 400 (for good).
    let (posts, addr) = scripted(marked.clone(), vec![(503, Some("1")), (400, None)]).await;
    let agent = exporting_to(addr).start().await;
    let client = patient_client(agent.socket()).await;
    let carrying = |trace: &str| {
        let posts = posts.lock().unwrap();
        posts
            .iter()
            .filter(|(_, t)| t.iter().any(|x| x == trace))
            .map(|(at, _)| *at)
            .collect::<Vec<_>>()
    };
    traced_check(&client, first).await;
    let p = posts.clone();
    let m = marked.clone();
    eventually(
        "the batch refused for now is sent again",
        Duration::from_secs(15),
        move || {
            let n = p.lock().unwrap().iter().filter(|(_, t)| t.contains(&m)).count();
            std::future::ready((n >= 2).then_some(()))
        },
    )
    .await;
    // A later span's batch arrives after any further try of the first would have (one exporter,
    // one batch at a time).
    let second = context(0x52, true);
    traced_check(&client, second).await;
    let p = posts.clone();
    let later = hex(&second.trace_id);
    eventually("the next batch arrives", Duration::from_secs(15), move || {
        let n = p
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, t)| t.contains(&later))
            .count();
        std::future::ready((n >= 1).then_some(()))
    })
    .await;
    let tries = carrying(&marked);
    assert_eq!(
        tries.len(),
        2,
        "sent once, again after the 503, never after the 400"
    );
    assert!(
        tries[1] - tries[0] >= Duration::from_millis(900),
        "the retry waited for the collector's Retry-After (1 s): {:?}",
        tries[1] - tries[0]
    );
}

/// By default (`OTEL_EXPORTER_OTLP_PROTOCOL` unset, as an OpenTelemetry SDK does) the batch is an
/// `ExportTraceServiceRequest` in protobuf, `Content-Type: application/x-protobuf`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_export_speaks_protobuf_by_default() {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
    use prost::Message;

    let got: Arc<Mutex<Vec<(String, ExportTraceServiceRequest)>>> = Arc::default();
    let store = got.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let store = store.clone();
            async move {
                let kind = headers
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                let request = ExportTraceServiceRequest::decode(&body[..]).expect("OTLP/protobuf");
                store.lock().unwrap().push((kind, request));
                ""
            }
        }),
    );
    let addr = serve(app).await;
    let agent = exporting_to(addr).start().await;
    let client = patient_client(agent.socket()).await;
    let parent = context(0x61, true);
    traced_check(&client, parent).await;
    let (kind, request) = eventually("a batch arrives", Duration::from_secs(10), || {
        std::future::ready(got.lock().unwrap().first().cloned())
    })
    .await;
    assert_eq!(kind, "application/x-protobuf");
    let rs = &request.resource_spans[0];
    let service = rs
        .resource
        .as_ref()
        .unwrap()
        .attributes
        .iter()
        .find(|a| a.key == "service.name");
    assert_eq!(
        service.and_then(|a| a.value.clone()).and_then(|v| v.value),
        Some(Any::StringValue("floodgate".into()))
    );
    let span = rs.scope_spans[0]
        .spans
        .iter()
        .find(|s| s.trace_id == parent.trace_id)
        .expect("the check's span, in its caller's trace");
    assert_eq!(span.name, "check");
    assert_eq!(span.parent_span_id, parent.span_id);
    let protocol = span.attributes.iter().find(|a| a.key == "floodgate.protocol");
    assert_eq!(
        protocol.and_then(|a| a.value.clone()).and_then(|v| v.value),
        Some(Any::StringValue("frames".into()))
    );
}

/// The Export calls an OTLP/gRPC collector was sent: the `authorization` metadata and the request.
type Calls = Arc<Mutex<Vec<(Option<String>, ExportTraceServiceRequest)>>>;

struct Collector(Calls);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        self.0.lock().unwrap().push((auth, request.into_inner()));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC collector on a free loopback port, over TLS with `identity` (PEM certificate and
/// key) when given.
async fn grpc_collector(identity: Option<(String, String)>) -> (Calls, SocketAddr) {
    let calls = Calls::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut server = tonic::transport::Server::builder();
    if let Some((cert, key)) = identity {
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert, key));
        server = server.tls_config(tls).unwrap();
    }
    tokio::spawn(
        server
            .add_service(TraceServiceServer::new(Collector(calls.clone())))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (calls, addr)
}

/// The check's span among an Export call's, in its caller's trace under its caller's span.
fn check_span_of(request: &ExportTraceServiceRequest, parent: TraceContext) {
    let span = request
        .resource_spans
        .iter()
        .flat_map(|rs| rs.scope_spans.iter().flat_map(|ss| ss.spans.iter()))
        .find(|s| s.trace_id == parent.trace_id)
        .expect("the check's span, in its caller's trace");
    assert_eq!(
        (span.name.as_str(), &span.parent_span_id[..]),
        ("check", &parent.span_id[..])
    );
}

/// `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`: the batch is an OTLP/gRPC `TraceService/Export` call to the
/// endpoint, the headers as its metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_export_speaks_otlp_grpc_when_asked() {
    let (calls, addr) = grpc_collector(None).await;
    let agent = Agent::builder()
        .rules(RULES)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{addr}"))
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20s3cret")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let parent = context(0x71, true);
    traced_check(&client, parent).await;
    let (auth, request) = eventually("an Export call arrives", Duration::from_secs(10), || {
        std::future::ready(calls.lock().unwrap().first().cloned())
    })
    .await;
    assert_eq!(auth.as_deref(), Some("Bearer s3cret"));
    check_span_of(&request, parent);
}

/// An `https://` OTLP/gRPC collector signed by a private CA: trusted through
/// `OTEL_EXPORTER_OTLP_CERTIFICATE`, and not without it (the export is refused, nothing arrives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_grpc_collector_is_trusted_through_the_otlp_certificate() {
    let ca = TestCa::new("floodgate otlp test CA");
    let identity = ca.issue("collector", &["127.0.0.1"]);
    let ca_pem = ca.path("ca.pem");
    let (calls, addr) = grpc_collector(Some(identity)).await;
    let start = |certificate: bool| {
        let mut b = Agent::builder()
            .rules(RULES)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("https://{addr}"))
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            .env("OTEL_EXPORTER_OTLP_TIMEOUT", "1000");
        if certificate {
            b = b.env("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca_pem);
        }
        b.start()
    };
    // Without the CA the collector's certificate is unknown: the batch is dropped, and said so.
    let untrusting = start(false).await;
    let client = patient_client(untrusting.socket()).await;
    traced_check(&client, context(0x81, true)).await;
    eventually("the export is refused", Duration::from_secs(15), || {
        std::future::ready(untrusting.log().contains("could not export spans").then_some(()))
    })
    .await;
    assert!(
        calls.lock().unwrap().is_empty(),
        "an untrusted collector got spans"
    );
    let trusting = start(true).await;
    let client = patient_client(trusting.socket()).await;
    let parent = context(0x82, true);
    traced_check(&client, parent).await;
    let (_, request) = eventually("an Export call over TLS arrives", Duration::from_secs(10), || {
        std::future::ready(calls.lock().unwrap().first().cloned())
    })
    .await;
    check_span_of(&request, parent);
}
