//! Envoy's RateLimitService against a real agent: a tonic client drives ShouldRateLimit over gRPC,
//! with the agent configured from an envoyproxy/ratelimit YAML file, on the embedded store and on
//! Redis.

use std::time::Duration;

use floodgate_agent::envoy::proto::{
    Code, Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest, RateLimitResponse, UInt64Value, Unit,
};
use floodgate_tests::{Agent, RedisServer};

// Windows of a minute or longer: each test finishes in well under a second of its window, and a
// window boundary inside a test would only reset counts (the day-long rule of the outage test makes
// even that a 1-in-10,000 chance).
const CONFIG: &str = "
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    value: /shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: client
    rate_limit: {unit: day, requests_per_unit: 6}
";

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn grpc_agent(redis: Option<&str>) -> (Agent, RateLimitClient) {
    let mut b = Agent::builder()
        .envoy_config(CONFIG)
        .arg("--grpc")
        .arg("127.0.0.1:0");
    if let Some(url) = redis {
        b = b.redis(url);
    }
    let agent = b.start().await;
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let client = RateLimitClient::connect(format!("http://{addr}"))
        .await
        .expect("gRPC connects");
    (agent, client)
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

async fn allow_then_deny(client: &mut RateLimitClient) {
    let ip = || request("edge", vec![descriptor(&[("remote_address", "203.0.113.5")])]);
    for expected_remaining in [2, 1, 0] {
        let r = client.should_rate_limit(ip()).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
        let s = &r.statuses[0];
        assert_eq!(s.code, Code::Ok as i32);
        let limit = s
            .current_limit
            .as_ref()
            .expect("a limited descriptor names its limit");
        assert_eq!((limit.requests_per_unit, limit.unit), (3, Unit::Minute as i32));
        assert_eq!(limit.name, "edge.remote_address");
        assert_eq!(s.limit_remaining, expected_remaining);
        let reset = s.duration_until_reset.unwrap().as_ms();
        assert!(
            reset > 0 && reset <= 120_000,
            "a sliding window resets within two windows: {reset}"
        );
        assert_eq!(header(&r, "x-ratelimit-limit"), Some("3"));
        assert_eq!(
            header(&r, "x-ratelimit-remaining"),
            Some(expected_remaining.to_string().as_str())
        );
        assert!(header(&r, "x-ratelimit-reset").is_some());
        assert_eq!(header(&r, "retry-after"), None);
    }
    let r = client.should_rate_limit(ip()).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let retry: u64 = header(&r, "retry-after")
        .expect("Retry-After on every over-limit answer")
        .parse()
        .unwrap();
    // A sliding window's count fades out over the window after the one it was made in: at most
    // two windows until a request passes.
    assert!((1..=120).contains(&retry), "retry after {retry} s");
    // Another address has a counter of its own.
    let other = request("edge", vec![descriptor(&[("remote_address", "203.0.113.6")])]);
    assert_eq!(
        client.should_rate_limit(other).await.unwrap().overall_code,
        Code::Ok as i32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_then_deny_with_statuses_and_headers_embedded() {
    let (_agent, mut client) = grpc_agent(None).await;
    allow_then_deny(&mut client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_then_deny_with_statuses_and_headers_on_redis() {
    let redis = RedisServer::start();
    let (_agent, mut client) = grpc_agent(Some(&redis.url())).await;
    allow_then_deny(&mut client).await;
    // The counts are Redis's: a second agent on the same Redis sees the address as over its limit.
    let (_b, mut second) = grpc_agent(Some(&redis.url())).await;
    let r = second
        .should_rate_limit(request(
            "edge",
            vec![descriptor(&[("remote_address", "203.0.113.5")])],
        ))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_reports_but_never_rejects() {
    let (agent, mut client) = grpc_agent(None).await;
    for _ in 0..3 {
        let r = client
            .should_rate_limit(request("edge", vec![descriptor(&[("path", "/shadow")])]))
            .await
            .unwrap();
        assert_eq!(
            r.overall_code,
            Code::Ok as i32,
            "shadow mode never rejects: {r:?}"
        );
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 1);
    }
    // The dry run saw the would-be rejections (the second and third request).
    let admin = agent.admin_addr().await;
    let (_, metrics) = floodgate_tests::http_get(admin, "/metrics").await;
    let logged = metrics
        .lines()
        .find(|l| {
            l.starts_with("floodgate_checks_total")
                && l.contains("rule=\"edge.path_-shadow\"")
                && l.contains("decision=\"logged\"")
                && l.contains("source=\"local\"")
        })
        .unwrap_or_else(|| panic!("no logged series in:\n{metrics}"));
    assert!(logged.ends_with(" 2"), "{logged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_descriptors_count_per_value_and_stop_where_the_tree_does() {
    let (_agent, mut client) = grpc_agent(None).await;
    let user = |u: &str| request("edge", vec![descriptor(&[("tenant", "acme"), ("user", u)])]);
    for code in [Code::Ok, Code::Ok, Code::OverLimit] {
        let r = client.should_rate_limit(user("u1")).await.unwrap();
        assert_eq!(r.overall_code, code as i32, "{r:?}");
    }
    let r = client.should_rate_limit(user("u2")).await.unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32, "each user value counts apart");
    assert_eq!(r.statuses[0].limit_remaining, 1);
    // The tenant alone has no rate_limit, another tenant is not in the tree, and a deeper
    // descriptor goes past it: none is limited.
    for entries in [
        vec![("tenant", "acme")],
        vec![("tenant", "other"), ("user", "u1")],
        vec![("tenant", "acme"), ("user", "u1"), ("device", "d")],
    ] {
        let r = client
            .should_rate_limit(request("edge", vec![descriptor(&entries)]))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32, "{entries:?}: {r:?}");
        assert!(r.statuses[0].current_limit.is_none(), "{entries:?} has no limit");
        assert!(r.response_headers_to_add.is_empty(), "no headers without a limit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_domains_pass_and_bad_requests_are_refused() {
    let (_agent, mut client) = grpc_agent(None).await;
    let r = client
        .should_rate_limit(request(
            "nowhere",
            vec![descriptor(&[("remote_address", "1.2.3.4")])],
        ))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses.len(), 1);
    assert!(r.statuses[0].current_limit.is_none());
    let e = client
        .should_rate_limit(request("", vec![descriptor(&[("remote_address", "1.2.3.4")])]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("domain"), "{e}");
    let e = client
        .should_rate_limit(request("edge", vec![]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // Asked to give units back on a rate rule: nothing is given back, the descriptor only looks, as
    // a hits_addend of 0 reads the real limit and remaining without counting. The request's others
    // are decided.
    let mut negative = descriptor(&[("remote_address", "1.2.3.4")]);
    negative.is_negative_hits = true;
    let look = || {
        let mut d = descriptor(&[("remote_address", "1.2.3.4")]);
        d.hits_addend = Some(UInt64Value { value: 0 });
        d
    };
    let counted = descriptor(&[("api_key", "n")]);
    let r = client
        .should_rate_limit(request("edge", vec![negative, look(), counted]))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 3, "given back: nothing");
    assert_eq!(
        r.statuses[1].current_limit.as_ref().map(|l| l.requests_per_unit),
        Some(3)
    );
    assert_eq!(r.statuses[1].limit_remaining, 3, "a look: the real remaining");
    assert_eq!(r.statuses[2].limit_remaining, 9);
    let again = || request("edge", vec![descriptor(&[("remote_address", "1.2.3.4")])]);
    assert_eq!(
        client.should_rate_limit(again()).await.unwrap().statuses[0].limit_remaining,
        2,
        "neither took a unit of 1.2.3.4's 3"
    );
    client.should_rate_limit(again()).await.unwrap();
    client.should_rate_limit(again()).await.unwrap();
    let over = client.should_rate_limit(again()).await.unwrap();
    assert_eq!(over.overall_code, Code::OverLimit as i32);
    assert_eq!(
        over.statuses[0].limit_remaining, 0,
        "OVER_LIMIT carries remaining 0"
    );
    // At the limit a look is still OK (nothing past it); the key's counts are what the three
    // admitted made them.
    let r = client
        .should_rate_limit(request("edge", vec![look()]))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let many = request(
        "edge",
        (0..65)
            .map(|i| descriptor(&[("api_key", &format!("k{i}"))]))
            .collect(),
    );
    let e = client.should_rate_limit(many).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    // A value with braces cannot pick a Redis hash tag: it is escaped into the key and limited.
    let braces = || request("edge", vec![descriptor(&[("remote_address", "{evil}")])]);
    for code in [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit] {
        assert_eq!(
            client.should_rate_limit(braces()).await.unwrap().overall_code,
            code as i32
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_is_the_cost() {
    let (_agent, mut client) = grpc_agent(None).await;
    let mut r = request("edge", vec![descriptor(&[("api_key", "k")])]);
    r.hits_addend = 4;
    let a = client.should_rate_limit(r).await.unwrap();
    assert_eq!(a.statuses[0].limit_remaining, 6);
    // A descriptor's own hits_addend wins over the request's.
    let mut d = descriptor(&[("api_key", "k")]);
    d.hits_addend = Some(UInt64Value { value: 5 });
    let mut r = request("edge", vec![d]);
    r.hits_addend = 9;
    let b = client.should_rate_limit(r).await.unwrap();
    assert_eq!(b.statuses[0].limit_remaining, 1);
    let mut r = request("edge", vec![descriptor(&[("api_key", "k")])]);
    r.hits_addend = 2;
    let c = client.should_rate_limit(r).await.unwrap();
    assert_eq!(
        c.overall_code,
        Code::OverLimit as i32,
        "2 more than the 1 left: {c:?}"
    );
    let d = client
        .should_rate_limit(request("edge", vec![descriptor(&[("api_key", "k")])]))
        .await
        .unwrap();
    assert_eq!(
        (d.overall_code, d.statuses[0].limit_remaining),
        (Code::Ok as i32, 0),
        "the rejected 2 consumed nothing: the last unit is still there"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_descriptors_are_all_or_nothing() {
    all_or_nothing(None).await;
}

/// On Redis the second rejection is the rejection cache's: the other descriptors are still read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_descriptors_are_all_or_nothing_on_redis() {
    let redis = RedisServer::start();
    all_or_nothing(Some(&redis.url())).await;
}

async fn all_or_nothing(redis: Option<&str>) {
    let (_agent, mut client) = grpc_agent(redis).await;
    let ip = || descriptor(&[("remote_address", "198.51.100.1")]);
    for _ in 0..3 {
        client
            .should_rate_limit(request("edge", vec![ip()]))
            .await
            .unwrap();
    }
    // One of k2's 10 used: a rejected request must report 9, not the limit (what a cached
    // rejection answered for the other descriptors) nor 8 (as if counted).
    client
        .should_rate_limit(request("edge", vec![descriptor(&[("api_key", "k2")])]))
        .await
        .unwrap();
    let both = || {
        request(
            "edge",
            vec![
                descriptor(&[("api_key", "k2")]),
                ip(),
                descriptor(&[("unknown", "x")]),
            ],
        )
    };
    for _ in 0..2 {
        let r = client.should_rate_limit(both()).await.unwrap();
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
        assert_eq!(r.statuses.len(), 3, "one status per descriptor, in order");
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert_eq!(
            r.statuses[0].limit_remaining, 9,
            "the other descriptor says what it holds: nothing was taken"
        );
        assert!(r.statuses[0].duration_until_reset.is_some());
        assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
        assert_eq!(r.statuses[2].code, Code::Ok as i32);
        assert!(r.statuses[2].current_limit.is_none());
    }
    let alone = client
        .should_rate_limit(request("edge", vec![descriptor(&[("api_key", "k2")])]))
        .await
        .unwrap();
    assert_eq!(
        alone.statuses[0].limit_remaining, 8,
        "the rejected requests took nothing from the api key's 9"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_open_at_limit_over_n() {
    let mut redis = RedisServer::start();
    // N pinned to 2: the fallback enforces 6 / 2 = 3 per day-long window on this agent.
    let agent = Agent::builder()
        .envoy_config(CONFIG)
        .redis(&redis.url())
        .arg("--agents")
        .arg("2")
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .start()
        .await;
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut client = RateLimitClient::connect(format!("http://{addr}")).await.unwrap();
    redis.kill();
    let c = || request("edge", vec![descriptor(&[("client", "c1")])]);
    let mut codes = Vec::new();
    for _ in 0..5 {
        let r = tokio::time::timeout(Duration::from_secs(2), client.should_rate_limit(c()))
            .await
            .expect("an answer while Redis is down, not a hang")
            .unwrap();
        codes.push(r.overall_code);
    }
    let ok = Code::Ok as i32;
    let over = Code::OverLimit as i32;
    assert_eq!(
        codes,
        vec![ok, ok, ok, over, over],
        "fail open, enforced at limit / N = 3"
    );
    assert!(!agent.log().contains("panicked"), "{}", agent.log());
}

/// `floodgate rules import-envoy` writes the YAML's rules through the rules API (here the embedded
/// default's), and the agent answers ShouldRateLimit with them once they arrive; a file that cannot
/// be mapped writes nothing and names the descriptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_envoy_writes_rules_through_the_api() {
    let agent = Agent::builder().arg("--grpc").arg("127.0.0.1:0").start().await;
    let rules_api = agent.rules_addr().await;
    let grpc = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "domain: edge\ndescriptors:\n  - key: ok\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: k\n    rate_limit: {unit: month, requests_per_unit: 1, unit_multiplier: 3}\n",
    )
    .unwrap();
    let run = |file: &std::path::Path| {
        std::process::Command::new(floodgate_tests::floodgate_bin())
            .args([
                "rules",
                "--server",
                &format!("http://{rules_api}"),
                "import-envoy",
            ])
            .arg(file)
            .output()
            .unwrap()
    };
    let out = run(&bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("descriptor edge.k: unit \"month\" with unit_multiplier 3"),
        "{err}"
    );
    let good = dir.path().join("edge.yaml");
    std::fs::write(&good, CONFIG).unwrap();
    let out = run(&good);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("5 rules imported"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, listed) = floodgate_tests::http_get(rules_api, "/v1/rules").await;
    assert!(
        !listed.contains("\"edge.ok\""),
        "the refused file wrote nothing: {listed}"
    );
    let mut client = RateLimitClient::connect(format!("http://{grpc}")).await.unwrap();
    let limited = floodgate_tests::eventually("the imported rules answer", Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            let r = client
                .should_rate_limit(request(
                    "edge",
                    vec![descriptor(&[("remote_address", "192.0.2.1")])],
                ))
                .await
                .ok()?;
            r.statuses[0].current_limit.clone()
        }
    })
    .await;
    assert_eq!(
        (limited.name.as_str(), limited.requests_per_unit),
        ("edge.remote_address", 3)
    );
    let r = client
        .should_rate_limit(request(
            "edge",
            vec![descriptor(&[("tenant", "acme"), ("user", "x")])],
        ))
        .await
        .unwrap();
    assert_eq!(
        r.statuses[0].current_limit.as_ref().map(|l| l.requests_per_unit),
        Some(2)
    );
    // A rule written by hand at a path another rule answers would break every agent's set: refused.
    let (status, body) = floodgate_tests::http_request(
        rules_api,
        "PUT",
        "/v1/rules/twin",
        r#"{"dimension":"descriptor","limit":1,"windowSeconds":1,"envoy":{"domain":"edge","descriptors":[{"key":"remote_address"}]}}"#,
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("edge.remote_address"), "{body}");
    // Importing again without a descriptor deletes its rule.
    let fewer = dir.path().join("fewer.yaml");
    std::fs::write(
        &fewer,
        CONFIG.replace(
            "  - key: client\n    rate_limit: {unit: day, requests_per_unit: 6}\n",
            "",
        ),
    )
    .unwrap();
    let out = run(&fewer);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("4 rules imported, 1 deleted"),
        "{text}"
    );
    let (_, listed) = floodgate_tests::http_get(rules_api, "/v1/rules").await;
    assert!(
        !listed.contains("\"edge.client\"") && listed.contains("\"edge.api_key\""),
        "{listed}"
    );
}

/// Envoy Gateway's token recipe: the request phase sends cost 0 (read the quota), the response
/// phase (`apply_on_stream_done`) sends the tokens the response used. With `overLimit = "charge"`
/// the report is counted even past the limit and the next request is refused until the debt is
/// waited out; without it, a report past the limit would count nothing (the tokens free).
async fn token_recipe(redis: Option<&str>) {
    const RULES: &str = r#"{"rules":[
      {"id":"tokens","dimension":"descriptor","limit":1000,"windowSeconds":3600,"overLimit":"charge",
       "envoy":{"domain":"llm","descriptors":[{"key":"user"}]}},
      {"id":"plain","dimension":"descriptor","limit":1000,"windowSeconds":3600,
       "envoy":{"domain":"llm","descriptors":[{"key":"team"}]}}
    ]}"#;
    let mut b = Agent::builder().rules(RULES).arg("--grpc").arg("127.0.0.1:0");
    if let Some(url) = redis {
        b = b.redis(url);
    }
    let agent = b.start().await;
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut client = RateLimitClient::connect(format!("http://{addr}")).await.unwrap();
    let phase = |key: &str, value: &str, cost: u64| {
        let mut d = descriptor(&[(key, value)]);
        d.hits_addend = Some(UInt64Value { value: cost });
        request("llm", vec![d])
    };
    for (key, charged) in [("user", true), ("team", false)] {
        let r = client.should_rate_limit(phase(key, "u1", 0)).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32, "{key}: request phase");
        assert_eq!(r.statuses[0].limit_remaining, 1000, "{key}: the quota, read");
        let r = client.should_rate_limit(phase(key, "u1", 1500)).await.unwrap();
        assert_eq!(
            r.statuses[0].code,
            Code::OverLimit as i32,
            "{key}: the report passes the limit"
        );
        let r = client.should_rate_limit(phase(key, "u1", 0)).await.unwrap();
        if charged {
            assert_eq!(
                r.overall_code,
                Code::OverLimit as i32,
                "the debt refuses the next request"
            );
            assert_eq!(r.statuses[0].limit_remaining, 0);
        } else {
            assert_eq!(
                r.overall_code,
                Code::Ok as i32,
                "without overLimit the report counted nothing"
            );
            assert_eq!(r.statuses[0].limit_remaining, 1000);
        }
    }
    // A look past its limit refuses the request before anything is counted: the other descriptor
    // (team u9, consuming 1) keeps its 1000.
    let mut look = descriptor(&[("user", "u1")]);
    look.hits_addend = Some(UInt64Value { value: 0 });
    let mut take = descriptor(&[("team", "u9")]);
    take.hits_addend = Some(UInt64Value { value: 1 });
    let r = client
        .should_rate_limit(request("llm", vec![look, take]))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
    assert_eq!(
        r.statuses[1].limit_remaining, 1000,
        "nothing counted on a refused request"
    );
    let r = client.should_rate_limit(phase("team", "u9", 0)).await.unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 1000);
    // Within the limit a charged report is OK and counted.
    client.should_rate_limit(phase("user", "u2", 0)).await.unwrap();
    let r = client.should_rate_limit(phase("user", "u2", 400)).await.unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 600);
}

/// Envoy Gateway's concurrency recipe: the request phase takes one unit of a concurrency rule
/// (hits_addend 1), the response phase (`apply_on_stream_done`) gives it back (`is_negative_hits`).
/// At the limit requests are refused with a Retry-After of at most a second; each response frees
/// a unit.
async fn concurrency_recipe(redis: Option<&str>) {
    const RULES: &str = r#"{"rules":[
      {"id":"inflight","dimension":"descriptor","limit":2,"algorithm":"concurrency","leaseSeconds":300,
       "envoy":{"domain":"llm","descriptors":[{"key":"user"}]}}
    ]}"#;
    let mut b = Agent::builder().rules(RULES).arg("--grpc").arg("127.0.0.1:0");
    if let Some(url) = redis {
        b = b.redis(url);
    }
    let agent = b.start().await;
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut client = RateLimitClient::connect(format!("http://{addr}")).await.unwrap();
    let start = || request("llm", vec![descriptor(&[("user", "u1")])]);
    let done = || {
        let mut d = descriptor(&[("user", "u1")]);
        d.is_negative_hits = true;
        d.hits_addend = Some(UInt64Value { value: 1 });
        request("llm", vec![d])
    };
    for left in [1, 0] {
        let r = client.should_rate_limit(start()).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0].limit_remaining, left);
    }
    let r = client.should_rate_limit(start()).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32, "two in flight: {r:?}");
    assert_eq!(header(&r, "retry-after"), Some("1"), "{r:?}");
    let wait = r.statuses[0].duration_until_reset.as_ref().unwrap();
    assert!(
        wait.seconds == 0 || (wait.seconds == 1 && wait.nanos == 0),
        "{wait:?}"
    );
    // One response ends: one request more passes, and no more.
    let r = client.should_rate_limit(done()).await.unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 1, "given back");
    assert_eq!(
        client.should_rate_limit(start()).await.unwrap().overall_code,
        Code::Ok as i32
    );
    assert_eq!(
        client.should_rate_limit(start()).await.unwrap().overall_code,
        Code::OverLimit as i32
    );
    // Every response ends: all free (a give-back with nothing held gives nothing).
    for _ in 0..3 {
        client.should_rate_limit(done()).await.unwrap();
    }
    let r = client.should_rate_limit(start()).await.unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 1, "{r:?}");
}

#[tokio::test]
async fn envoy_gateway_concurrency_recipe_embedded() {
    concurrency_recipe(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_concurrency_recipe_on_redis() {
    let redis = RedisServer::start();
    concurrency_recipe(Some(&redis.url())).await;
}

#[tokio::test]
async fn envoy_gateway_token_recipe_embedded() {
    token_recipe(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateway_token_recipe_on_redis() {
    let redis = RedisServer::start();
    token_recipe(Some(&redis.url())).await;
}

/// A descriptor's own limit (`RateLimitOverride`) replaces its rule's where the rule allows it
/// (`limitOverride`), as envoyproxy/ratelimit honours it; elsewhere the operator's rule decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_limit_override_applies_where_the_rule_allows_it() {
    const RULES: &str = r#"{"rules":[
      {"id":"open","dimension":"descriptor","limit":1000,"windowSeconds":60,
       "envoy":{"domain":"ovr","descriptors":[{"key":"tenant"}],"limitOverride":true}},
      {"id":"fixed","dimension":"descriptor","limit":1000,"windowSeconds":60,
       "envoy":{"domain":"ovr","descriptors":[{"key":"user"}]}}
    ]}"#;
    let agent = Agent::builder()
        .rules(RULES)
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .arg("--grpc-headers")
        .arg("both")
        .start()
        .await;
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut client = RateLimitClient::connect(format!("http://{addr}")).await.unwrap();
    let with_limit = |key: &str, rpu: u32, unit: Unit| {
        let mut d = descriptor(&[(key, "t1")]);
        d.limit = Some(floodgate_agent::envoy::proto::RateLimitOverride {
            requests_per_unit: rpu,
            unit: unit as i32,
        });
        request("ovr", vec![d])
    };
    for left in [1, 0] {
        let r = client
            .should_rate_limit(with_limit("tenant", 2, Unit::Hour))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0].limit_remaining, left);
        let l = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (l.requests_per_unit, l.unit),
            (2, Unit::Hour as i32),
            "the descriptor's own limit"
        );
        assert_eq!(
            header(&r, "ratelimit-policy"),
            Some("\"open\";q=2;w=3600"),
            "the override's window"
        );
    }
    let r = client
        .should_rate_limit(with_limit("tenant", 2, Unit::Hour))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    // A month: a calendar quota of its own.
    let r = client
        .should_rate_limit(with_limit("tenant", 5, Unit::Month))
        .await
        .unwrap();
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 5);
    // Its window is this month's length in UTC (28 to 31 days), as its reset is the month's end.
    let month = floodgate_core::rules::RuleSet::parse(
        r#"{"rules":[{"id":"m","dimension":"user","limit":5,"algorithm":"quota","period":"month"}]}"#,
    )
    .unwrap()
    .get("m")
    .unwrap()
    .quota_period(floodgate_core::store::Clock::System.now_ms());
    assert_eq!(
        header(&r, "ratelimit-policy").map(str::to_string),
        Some(format!("\"open\";q=5;w={}", (month.1 - month.0) / 1_000))
    );
    // The rule without limitOverride keeps its own limit.
    let r = client
        .should_rate_limit(with_limit("user", 2, Unit::Hour))
        .await
        .unwrap();
    let l = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((l.requests_per_unit, r.statuses[0].limit_remaining), (1000, 999));
}

/// grpc.health.v1 Check, as Kubernetes' gRPC probe and Envoy's gRPC health check ask it, from
/// tonic-health's client: SERVING for the server and for the rate-limit service on every server
/// choice, NOT_FOUND for another service; Watch is served by tonic only (the native server refuses
/// it with UNIMPLEMENTED, docs/envoy.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_check_answers_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    for server in ["native", "h2", "tonic"] {
        let agent = Agent::builder()
            .envoy_config(CONFIG)
            .arg("--grpc")
            .arg("127.0.0.1:0")
            .arg("--grpc-server")
            .arg(server)
            .start()
            .await;
        let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel);
        for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
            let r = health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap_or_else(|e| panic!("{server} {service:?}: {e}"));
            assert_eq!(
                r.into_inner().status,
                ServingStatus::Serving as i32,
                "{server} {service:?}"
            );
        }
        let e = health
            .check(HealthCheckRequest {
                service: "no.such.Service".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{server}");
        let watch = health
            .watch(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        match server {
            "tonic" => assert!(watch.is_ok()),
            _ => assert_eq!(watch.unwrap_err().code(), tonic::Code::Unimplemented, "{server}"),
        }
        // ShouldRateLimit on the same connection still answers.
        let mut client = RateLimitClient::connect(format!("http://{addr}")).await.unwrap();
        let r = client
            .should_rate_limit(request(
                "edge",
                vec![descriptor(&[("remote_address", "10.0.0.1")])],
            ))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32, "{server}");
    }
}

/// Quota mode over gRPC: past the limit of an `overLimit = "flag"` rule the request is OK, counts
/// nothing, and carries dynamic metadata and an upstream request header naming the rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_answers_ok_with_metadata_past_the_limit() {
    const RULES: &str = r#"{"rules":[
      {"id":"premium","dimension":"descriptor","limit":2,"windowSeconds":3600,"overLimit":"flag",
       "envoy":{"domain":"llm","descriptors":[{"key":"user"}]}}
    ]}"#;
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .rules(RULES)
        .redis(&redis.url())
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .start()
        .await;
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut client = RateLimitClient::connect(format!("http://{addr}")).await.unwrap();
    let ask = || request("llm", vec![descriptor(&[("user", "u1")])]);
    for _ in 0..2 {
        let r = client.should_rate_limit(ask()).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(
            r.dynamic_metadata.is_none() && r.request_headers_to_add.is_empty(),
            "{r:?}"
        );
    }
    let r = client.should_rate_limit(ask()).await.unwrap();
    assert_eq!(
        r.overall_code,
        Code::Ok as i32,
        "past the limit, let through: {r:?}"
    );
    assert_eq!(r.statuses[0].code, Code::Ok as i32);
    let meta = r.dynamic_metadata.expect("dynamic metadata");
    assert_eq!(meta.fields["over_quota"].bool_value, Some(true));
    assert_eq!(
        meta.fields["over_quota_rules"].string_value.as_deref(),
        Some("premium")
    );
    let h = &r.request_headers_to_add;
    assert!(
        h.iter()
            .any(|h| h.key == "x-ratelimit-over-quota" && h.value == "premium"),
        "{h:?}"
    );
    let (_, metrics) = floodgate_tests::http_get(agent.admin_addr().await, "/metrics").await;
    assert!(
        metrics.lines().any(|l| l.starts_with("floodgate_checks_total")
            && l.contains("rule=\"premium\"")
            && l.contains("decision=\"over_quota\"")
            && l.ends_with(" 1")),
        "{metrics}"
    );
}
