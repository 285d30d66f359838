//! The APIs that ask for no token (the agent's admin API, its embedded rules API, a rules service
//! without `--token`) refuse what only a web page would send: a foreign `Host` (DNS rebinding), a
//! write with a cross-site `Origin`, a form's body; the CLI, the follower and plain clients still
//! work.

use std::net::SocketAddr;
use std::time::Duration;

use floodgate_tests::raw_http::{connect_from, exchange};
use floodgate_tests::{eventually, floodgate_bin, Agent, RulesServer};

/// Sends one request (`Host` is the address unless `headers` name one); (status, body).
async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    let mut s = connect_from([127, 0, 0, 1].into(), addr).await;
    let (status, _, body) = exchange(&mut s, &head).await;
    (status, body)
}

const JSON: (&str, &str) = ("Content-Type", "application/json");
const RULE: &str = r#"{"dimension":"user","limit":5,"windowSeconds":60}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_answers_loopback_hosts_only_and_refuses_cross_site_writes() {
    let agent = Agent::builder().start().await;
    let admin = agent.admin_addr().await;
    let port = admin.port().to_string();
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "127.0.0.1".to_string(),
        format!("[::1]:{port}"),
    ] {
        let (status, body) = send(admin, "GET", "/v1/status", &[("Host", &host)], "").await;
        assert_eq!(status, 200, "Host {host}: {body}");
    }
    let (status, body) = send(admin, "GET", "/v1/status", &[("Host", "evil.example")], "").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("DNS rebinding"), "{body}");
    let (status, _) = send(
        admin,
        "GET",
        "/metrics",
        &[("Host", &format!("evil.example:{port}"))],
        "",
    )
    .await;
    assert_eq!(status, 403);

    let flush = r#"{"ms":50}"#;
    let (status, body) = send(
        admin,
        "PUT",
        "/v1/batch/flush-interval",
        &[JSON, ("Origin", "http://evil.example")],
        flush,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("another site"), "{body}");
    let (status, body) = send(admin, "PUT", "/v1/batch/flush-interval", &[JSON], flush).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_rules_api_refuses_rebinding_cross_site_writes_and_forms() {
    let agent = Agent::builder().start().await;
    let rules = agent.rules_addr().await;

    let (status, body) = send(rules, "GET", "/v1/rules", &[("Host", "evil.example")], "").await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = send(
        rules,
        "PUT",
        "/v1/rules/web",
        &[("Host", "evil.example:9791"), JSON],
        RULE,
    )
    .await;
    assert_eq!(status, 403, "{body}");

    for (method, path) in [("PUT", "/v1/rules/web"), ("DELETE", "/v1/rules/api-per-user")] {
        let (status, body) = send(
            rules,
            method,
            path,
            &[JSON, ("Origin", "https://evil.example")],
            if method == "PUT" { RULE } else { "" },
        )
        .await;
        assert_eq!(status, 403, "{method} {path}: {body}");
    }
    // What a form can post: the dry-run report is the API's one POST.
    for form in [
        "application/x-www-form-urlencoded",
        "text/plain",
        "multipart/form-data; boundary=x",
    ] {
        let (status, body) = send(
            rules,
            "POST",
            "/v1/rules/api-per-user/dry-run",
            &[("Content-Type", form)],
            r#"{"version":1,"count":1,"topKeys":[]}"#,
        )
        .await;
        assert_eq!(status, 415, "{form}: {body}");
    }
    let (status, body) = send(
        rules,
        "PUT",
        "/v1/rules/web",
        &[("Content-Type", "text/plain")],
        RULE,
    )
    .await;
    assert_eq!(status, 415, "{body}");
    assert!(body.contains("application/json"), "{body}");

    // The normal path: JSON from this host, or from a loopback origin (a local tool's page).
    let (status, body) = send(rules, "PUT", "/v1/rules/web", &[JSON], RULE).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = send(
        rules,
        "PUT",
        "/v1/rules/web",
        &[JSON, ("Origin", "http://localhost:3000")],
        RULE,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = send(rules, "DELETE", "/v1/rules/web", &[], "").await;
    assert_eq!(status, 204);
}

/// `floodgate rules` against the embedded API: what it sends passes the guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_still_writes_the_embedded_rules_api() {
    let agent = Agent::builder().start().await;
    let server = format!("http://{}", agent.rules_addr().await);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rule.json");
    std::fs::write(&file, RULE).unwrap();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(floodgate_bin())
            .args(["rules", "--server", &server])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {text}");
        text
    };
    assert!(cli(&["put", "cli", "--file", file.to_str().unwrap()]).contains("rule cli written"));
    assert!(cli(&["list"]).contains("cli"));
    assert!(cli(&["dry-run", "cli"]).contains("would have rejected 0"));
    assert!(cli(&["delete", "cli"]).contains("rule cli deleted"));
}

/// A rules service without a token takes the same care; an agent following it still pulls its
/// rules and reports its log-mode rule's would-be rejections (a JSON POST).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_service_without_a_token_is_guarded_and_still_followed() {
    let dir = tempfile::tempdir().unwrap();
    let s = RulesServer::start(&format!("sqlite://{}", dir.path().join("r.db").display()), &[]).await;
    let (status, _) = send(s.addr(), "GET", "/v1/rules", &[("Host", "evil.example")], "").await;
    assert_eq!(status, 403);
    let (status, _) = send(
        s.addr(),
        "PUT",
        "/v1/rules/log",
        &[("Content-Type", "application/x-www-form-urlencoded")],
        RULE,
    )
    .await;
    assert_eq!(status, 415);
    let (status, body) = send(
        s.addr(),
        "PUT",
        "/v1/rules/log",
        &[JSON],
        r#"{"dimension":"user","limit":1,"windowSeconds":60,"mode":"log"}"#,
    )
    .await;
    assert_eq!(status, 201, "{body}");

    let agent = Agent::builder().arg("--rules-url").arg(&s.url()).start().await;
    eventually("the follower holds the rule", Duration::from_secs(10), || async {
        let status = floodgate_tests::agent_status(&agent).await;
        (status["rules"] == serde_json::json!(["log"])).then_some(())
    })
    .await;
    let client = floodgate_tests::patient_client(agent.socket()).await;
    assert!(client.allow("user:u", "log", 1).await.unwrap().allowed);
    // Over the limit in log mode: allowed, and reported to the service within its 5 s cycle.
    for _ in 0..3 {
        assert!(client.allow("user:u", "log", 1).await.unwrap().allowed);
    }
    eventually("the dry run is reported", Duration::from_secs(15), || async {
        let (_, body) = send(s.addr(), "GET", "/v1/rules/log/dry-run", &[], "").await;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (v["wouldReject"].as_u64()? >= 2).then_some(())
    })
    .await;
}
