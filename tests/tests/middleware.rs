//! The SDK's tower Layer in front of an axum router, asking a real agent process: headers on every
//! response a rule applies to, costs per matched route, 429 with Retry-After and the JSON body, log
//! mode invisible, X-Forwarded-For believed only from trusted proxies, IETF headers, fail open.

use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::routing::{get, post};
use axum::Router;
use floodgate_sdk::middleware::{PeerAddr, RateLimitLayer};
use floodgate_tests::{patient_client, Agent};
use http::{Request, Response};
use tower::ServiceExt;

const RULES: &str = r#"
[[rules]]
id = "api"
dimension = "user"
match = { endpoint = "/api/*" }
limit = 6
windowSeconds = 60

[[rules]]
id = "login"
dimension = "ip"
match = { endpoint = "/login" }
limit = 2
windowSeconds = 60

# Would reject every client after its first request, if it were enforced.
[[rules]]
id = "ip-dry-run"
dimension = "ip"
limit = 1
windowSeconds = 60
mode = "log"
"#;

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .route("/api/search/{q}", get(|| async { "results" }))
        .route("/login", post(|| async { "welcome" }))
        .route("/open", get(|| async { "open" }))
        .layer(layer)
}

fn req(method: &str, path: &str, peer: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let mut r = b.body(Body::empty()).unwrap();
    r.extensions_mut().insert(PeerAddr(peer.parse().unwrap()));
    r
}

async fn send(app: &Router, r: Request<Body>) -> (u16, Response<Body>) {
    let resp = app.clone().oneshot(r).await.unwrap();
    (resp.status().as_u16(), resp)
}

fn header(r: &Response<Body>, name: &str) -> Option<String> {
    r.headers().get(name).map(|v| v.to_str().unwrap().to_string())
}

fn num(r: &Response<Body>, name: &str) -> u64 {
    header(r, name)
        .unwrap_or_else(|| panic!("{name} missing: {:?}", r.headers()))
        .parse()
        .unwrap()
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_costs_and_429s() {
    let agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    // Behind an authenticating hop that sets X-User-Id (the layer trusts no identity header unless
    // told to).
    let layer = RateLimitLayer::new(client)
        .user_header("x-user-id")
        .cost("/api/search/{q}", 3)
        .trust_proxies(["10.0.0.0/8"])
        .unwrap();
    let app = app(layer);
    let user = [("x-user-id", "u1")];

    let (status, r) = send(&app, req("GET", "/api/hello", "203.0.113.1:5", &user)).await;
    assert_eq!(status, 200);
    assert_eq!(
        (num(&r, "x-ratelimit-limit"), num(&r, "x-ratelimit-remaining")),
        (6, 5)
    );
    // Reset is epoch seconds: when the key is back to its full limit. A sliding window's count
    // weighs on the estimate until the end of the window after the current one, so at most two
    // 60 s windows ahead (+1 s of rounding up).
    let reset = num(&r, "x-ratelimit-reset");
    assert!((now_s()..=now_s() + 121).contains(&reset), "reset {reset}");
    // The cost comes from the matched route, not the raw path.
    let (_, r) = send(&app, req("GET", "/api/search/cats", "203.0.113.1:5", &user)).await;
    assert_eq!(num(&r, "x-ratelimit-remaining"), 2);
    for left in [1, 0] {
        let (status, r) = send(&app, req("GET", "/api/hello", "203.0.113.1:5", &user)).await;
        assert_eq!((status, num(&r, "x-ratelimit-remaining")), (200, left));
    }
    let (status, r) = send(&app, req("GET", "/api/hello", "203.0.113.1:5", &user)).await;
    assert_eq!(status, 429);
    // Whole seconds, never 0; at most until the key's full reset (two windows, as above).
    let retry = num(&r, "retry-after");
    assert!((1..=121).contains(&retry), "Retry-After {retry}");
    assert!(now_s() + retry <= num(&r, "x-ratelimit-reset") + 1);
    assert_eq!(num(&r, "x-ratelimit-remaining"), 0);
    assert_eq!(header(&r, "content-type").as_deref(), Some("application/json"));
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"error": "rate_limited", "retryAfter": retry})
    );
    // Another user is not affected.
    let (status, _) = send(
        &app,
        req("GET", "/api/hello", "203.0.113.1:5", &[("x-user-id", "u2")]),
    )
    .await;
    assert_eq!(status, 200);
    // A value the wire refuses (a brace, a Redis hash tag) does not make the check invalid and slip
    // past: it is limited under a hash of itself, 6 then 429.
    let odd = [("x-user-id", "{victim}")];
    for _ in 0..6 {
        assert_eq!(
            send(&app, req("GET", "/api/hello", "203.0.113.1:5", &odd))
                .await
                .0,
            200
        );
    }
    let (status, r) = send(&app, req("GET", "/api/hello", "203.0.113.1:5", &odd)).await;
    assert_eq!((status, num(&r, "x-ratelimit-limit")), (429, 6));

    // Log mode (limit 1 per IP) never blocks and never shows in the headers; no enforced rule
    // applies to /open, so it has none.
    for _ in 0..3 {
        let (status, r) = send(&app, req("GET", "/open", "198.51.100.4:5", &[])).await;
        assert_eq!(status, 200);
        assert!(header(&r, "x-ratelimit-limit").is_none(), "{:?}", r.headers());
    }

    // X-Forwarded-For from a trusted proxy names the client; from anyone else it is ignored.
    let via_proxy = |xff: &'static str| req("POST", "/login", "10.1.2.3:5", &[("x-forwarded-for", xff)]);
    for _ in 0..2 {
        assert_eq!(send(&app, via_proxy("9.9.9.9")).await.0, 200);
    }
    assert_eq!(
        send(&app, via_proxy("9.9.9.9")).await.0,
        429,
        "9.9.9.9 is over its 2"
    );
    assert_eq!(
        send(&app, via_proxy("8.8.8.8")).await.0,
        200,
        "another client behind the proxy"
    );
    // A client claiming to be 9.9.9.9 directly is keyed by its own address.
    let spoof = req(
        "POST",
        "/login",
        "203.0.113.50:5",
        &[("x-forwarded-for", "9.9.9.9")],
    );
    assert_eq!(send(&app, spoof).await.0, 200);
    // A client prepending to the header through the proxy does not move the key either.
    assert_eq!(send(&app, via_proxy("1.1.1.1, 9.9.9.9")).await.0, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ietf_headers_peer_address_from_axum_and_fail_open() {
    let agent = Agent::builder().rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    let app = app(RateLimitLayer::new(client).ietf_headers(true));

    // Over a real socket: the client IP is axum's ConnectInfo (127.0.0.1), limit 2 on /login.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
            .await
            .unwrap();
    });
    let url = format!("http://{addr}");
    let t = std::time::Duration::from_secs(5);
    let post = || floodgate_rules_service::http::request(&url, "POST", "/login", None, &[], None, t);
    let first = post().await.unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(first.header("ratelimit-policy"), Some("\"login\";q=2;w=60"));
    let rl = first.header("ratelimit").unwrap_or_default().to_string();
    assert!(rl.starts_with("\"login\";r=1;t="), "{rl}");
    assert_eq!(post().await.unwrap().status, 200);
    let third = post().await.unwrap();
    assert_eq!(third.status, 429);
    assert!(third.header("retry-after").is_some());

    // No agent behind the socket: the client's default policy is fail open, without headers.
    let dir = tempfile::tempdir().unwrap();
    let nobody = floodgate_sdk::Client::connect(dir.path().join("none.sock")).await;
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(nobody));
    let (status, r) = send(
        &app,
        req("GET", "/api/hello", "203.0.113.1:5", &[("x-user-id", "u")]),
    )
    .await;
    assert_eq!(status, 200);
    assert!(header(&r, "x-ratelimit-limit").is_none());
}

/// A cost known only after the response (LLM tokens): the request is let through unless its rule is
/// already past the limit, and the response's header is charged afterwards, past the limit too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_header_is_charged_after_the_response() {
    const CHAT: &str = r#"
[[rules]]
id = "tokens"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 1000
windowSeconds = 3600
"#;
    let agent = Agent::builder().rules(CHAT).start().await;
    let client = patient_client(agent.socket()).await;
    let app = Router::new()
        .route(
            "/v1/chat",
            post(|req: Request<Body>| async move {
                let used = req.headers().get("x-want").cloned();
                let mut r = Response::new(Body::from("answer"));
                if let Some(v) = used {
                    r.headers_mut().insert("x-llm-tokens", v);
                }
                r
            }),
        )
        .layer(
            RateLimitLayer::new(client.clone())
                .user_header("x-user")
                .charge_header("/v1/chat", http::HeaderName::from_static("x-llm-tokens")),
        );
    let chat = |user: &str, tokens: Option<&str>| {
        let mut h = vec![("x-user", user)];
        if let Some(t) = tokens {
            h.push(("x-want", t));
        }
        req("POST", "/v1/chat", "203.0.113.1:5", &h)
    };
    let remaining = |user: &'static str| {
        let client = client.clone();
        async move {
            client
                .peek(&format!("user:{user}"), "tokens", 0)
                .await
                .unwrap()
                .remaining
        }
    };
    let (status, r) = send(&app, chat("alice", Some("1500"))).await;
    assert_eq!(status, 200);
    assert_eq!(
        num(&r, "x-ratelimit-remaining"),
        1000,
        "the request phase only reads"
    );
    floodgate_tests::eventually("the charge lands", std::time::Duration::from_secs(10), || async {
        (remaining("alice").await == 0).then_some(())
    })
    .await;
    let (status, r) = send(&app, chat("alice", None)).await;
    assert_eq!(status, 429, "the debt refuses the next request");
    assert!(header(&r, "retry-after").is_some());

    let (status, _) = send(&app, chat("bob", Some("400"))).await;
    assert_eq!(status, 200);
    floodgate_tests::eventually("the charge lands", std::time::Duration::from_secs(10), || async {
        (remaining("bob").await == 600).then_some(())
    })
    .await;
    // No header, or not a number: nothing charged.
    send(&app, chat("bob", None)).await;
    send(&app, chat("bob", Some("lots"))).await;
    let (_, r) = send(&app, chat("bob", None)).await;
    assert_eq!(num(&r, "x-ratelimit-remaining"), 600);
}

const LLM: &str = r#"
[[rules]]
id = "inflight"
dimension = "user"
match = { endpoint = "/v1/*" }
limit = 2
algorithm = "concurrency"
leaseSeconds = 300

[[rules]]
id = "tokens"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 1000
windowSeconds = 3600
"#;

/// A concurrency rule's lease is held while the request runs and released when its response ends:
/// a finished body, a body dropped half-way, a handler that panicked. A route charged after the
/// response (here by a callback) holds it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_held_until_the_response_ends() {
    use futures::StreamExt;
    let agent = Agent::builder().rules(LLM).start().await;
    let client = patient_client(agent.socket()).await;
    // Each request to /v1/stream gets its body from a channel the test feeds.
    let (bodies_tx, bodies_rx) =
        tokio::sync::mpsc::unbounded_channel::<tokio::sync::mpsc::UnboundedReceiver<&'static str>>();
    let bodies_rx = std::sync::Arc::new(tokio::sync::Mutex::new(bodies_rx));
    let app = Router::new()
        .route(
            "/v1/stream",
            get(move || {
                let bodies_rx = bodies_rx.clone();
                async move {
                    let rx = bodies_rx.lock().await.recv().await.unwrap();
                    let chunks = futures::stream::unfold(rx, |mut rx| async move {
                        let chunk = rx.recv().await?;
                        Some((Ok::<_, std::io::Error>(chunk.to_string()), rx))
                    });
                    Body::from_stream(chunks)
                }
            }),
        )
        .route(
            "/v1/panic",
            get(|| async { panic!("handler failed") as &'static str }),
        )
        .route(
            "/v1/chat",
            post(|| async {
                let mut r = Response::new(Body::from("answer"));
                r.headers_mut()
                    .insert("x-tokens", http::HeaderValue::from_static("300"));
                r
            }),
        )
        .layer(
            RateLimitLayer::new(client.clone())
                .user_header("x-user")
                .charge_with("/v1/chat", |status, headers| {
                    // The callback's own reading: the header, only on success.
                    status
                        .is_success()
                        .then(|| headers.get("x-tokens")?.to_str().ok()?.parse().ok())?
                }),
        );
    let held = || {
        let client = client.clone();
        async move { 2 - client.peek("user:u", "inflight", 0).await.unwrap().remaining }
    };
    let get_as = |path: &str| req("GET", path, "203.0.113.9:1", &[("x-user", "u")]);
    // Two streams started: both leases held while their bodies run.
    let (one_tx, one_rx) = tokio::sync::mpsc::unbounded_channel();
    let (two_tx, two_rx) = tokio::sync::mpsc::unbounded_channel();
    bodies_tx.send(one_rx).unwrap();
    bodies_tx.send(two_rx).unwrap();
    let (status, one) = send(&app, get_as("/v1/stream")).await;
    assert_eq!(status, 200);
    let (status, two) = send(&app, get_as("/v1/stream")).await;
    assert_eq!(status, 200);
    assert_eq!(held().await, 2);
    let (status, r) = send(&app, get_as("/v1/stream")).await;
    assert_eq!(status, 429, "two in flight");
    assert_eq!(header(&r, "retry-after").as_deref(), Some("1"));
    assert_eq!(num(&r, "x-ratelimit-limit"), 2);
    // One body read to its end: its lease is released.
    one_tx.send("part one, ").unwrap();
    one_tx.send("the end").unwrap();
    drop(one_tx);
    let text = axum::body::to_bytes(one.into_body(), 1 << 20).await.unwrap();
    assert_eq!(&text[..], b"part one, the end");
    floodgate_tests::eventually(
        "the finished body's lease is released",
        std::time::Duration::from_secs(10),
        || async { (held().await == 1).then_some(()) },
    )
    .await;
    // The other dropped half-way (the client went away): released too.
    two_tx.send("half").unwrap();
    let mut body = two.into_body().into_data_stream();
    assert_eq!(&body.next().await.unwrap().unwrap()[..], b"half");
    assert_eq!(held().await, 1, "still streaming, still held");
    drop(body);
    floodgate_tests::eventually(
        "the dropped body's lease is released",
        std::time::Duration::from_secs(10),
        || async { (held().await == 0).then_some(()) },
    )
    .await;
    // A handler that panics: the lease goes with it.
    let failed = tokio::spawn({
        let app = app.clone();
        async move { send(&app, get_as("/v1/panic")).await }
    })
    .await;
    assert!(failed.is_err(), "the handler panicked");
    floodgate_tests::eventually(
        "the failed request's lease is released",
        std::time::Duration::from_secs(10),
        || async { (held().await == 0).then_some(()) },
    )
    .await;
    // A charged route: the request phase peeks the tokens and holds a slot; the callback's cost is
    // charged after, and the slot released.
    let (status, r) = send(&app, req("POST", "/v1/chat", "203.0.113.9:1", &[("x-user", "u")])).await;
    assert_eq!(status, 200);
    drop(r);
    floodgate_tests::eventually(
        "charged and released",
        std::time::Duration::from_secs(10),
        || async {
            let tokens = client.peek("user:u", "tokens", 0).await.unwrap().remaining;
            (tokens == 700 && held().await == 0).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_lets_a_request_through_flagged_for_the_handler_to_route() {
    const PREMIUM: &str = r#"
[[rules]]
id = "premium"
dimension = "user"
match = { endpoint = "/v1/chat" }
limit = 1
windowSeconds = 3600
overLimit = "flag"
"#;
    let agent = Agent::builder().rules(PREMIUM).start().await;
    let client = patient_client(agent.socket()).await;
    // The handler routes by the extension: the big model within the quota, a small one past it.
    let app = Router::new()
        .route(
            "/v1/chat",
            post(|req: Request<Body>| async move {
                match req.extensions().get::<floodgate_sdk::middleware::OverQuota>() {
                    Some(o) => format!("small model ({})", o.rules.join(",")),
                    None => "big model".to_string(),
                }
            }),
        )
        .layer(RateLimitLayer::new(client).user_header("x-user-id"));
    let user = [("x-user-id", "u1")];
    let (status, r) = send(&app, req("POST", "/v1/chat", "203.0.113.1:5", &user)).await;
    assert_eq!(status, 200);
    assert_eq!(header(&r, "x-ratelimit-over-quota"), None);
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    assert_eq!(&body[..], b"big model");
    let (status, r) = send(&app, req("POST", "/v1/chat", "203.0.113.1:5", &user)).await;
    assert_eq!(status, 200, "past the quota, let through");
    assert_eq!(header(&r, "x-ratelimit-over-quota").as_deref(), Some("premium"));
    assert_eq!(num(&r, "x-ratelimit-remaining"), 0);
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    assert_eq!(&body[..], b"small model (premium)");
}
