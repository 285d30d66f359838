//! Per-client overrides through a real rules service to four agents on one Redis: a key gets its own
//! limit on every agent (a cached rejection under the old limit dropped at once), other keys keep
//! the rule's, an expired or deleted override gives the rule's back; the API refuses what its rule
//! would; the CLI sets, lists, gets and deletes.

use std::time::Duration;

use floodgate_protocol::Item;
use floodgate_rules_service::http::{request, Response};
use floodgate_tests::{
    eventually, floodgate_bin, http_get, patient_client, rules_call as call, Agent, Fleet, RulesServer,
    OPERATOR_TOKEN as TOKEN,
};

fn json(r: &Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or_default()
}

async fn overrides_held(a: &Agent) -> (u64, u64) {
    let (_, body) = http_get(a.admin_addr().await, "/v1/status").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    (
        v["overrides"]["held"].as_u64().unwrap_or(0),
        v["overrides"]["version"].as_u64().unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_reaches_every_agent_for_its_key_only() {
    let fleet = Fleet::start().await;
    let service = &fleet.rules;
    let r = call(
        service,
        "PUT",
        "/v1/rules/api",
        Some(r#"{"dimension":"api_key","limit":2,"windowSeconds":3600}"#),
    )
    .await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let agents = fleet.agents(4).await;
    let mut clients = Vec::new();
    for a in &agents {
        clients.push(patient_client(a.socket()).await);
    }
    let check = |i: usize, key: &'static str| {
        let c = clients[i].clone();
        async move { c.check(vec![Item::new(key, "api", 1)]).await.unwrap() }
    };
    // The rule's limit: 2, then a cached rejection on agent 0.
    for expected in [true, true, false, false] {
        assert_eq!(check(0, "apikey:big").await.allowed, expected);
    }

    let r = call(
        service,
        "PUT",
        "/v1/rules/api/overrides/apikey:big",
        Some(r#"{"limit":5,"reason":"enterprise deal #42"}"#),
    )
    .await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let version = json(&r)["version"].as_u64().unwrap();
    for a in &agents {
        eventually(
            "every agent holds the override",
            Duration::from_secs(10),
            || async { (overrides_held(a).await == (1, version)).then_some(()) },
        )
        .await;
    }
    // Agent 0's cached rejection under the limit of 2 is gone: 2 counted, 3 more fit, fleet-wide.
    let d = check(0, "apikey:big").await;
    assert!(d.allowed && d.limit == 5 && d.remaining == 2, "{d:?}");
    for i in [1, 2] {
        assert!(check(i, "apikey:big").await.allowed);
    }
    assert!(!check(3, "apikey:big").await.allowed, "5 across the fleet");
    // Another key keeps the rule's limit.
    let d = check(1, "apikey:small").await;
    assert_eq!(d.limit, 2);

    // Deleted: the rule's limit again everywhere.
    let r = call(service, "DELETE", "/v1/rules/api/overrides/apikey:big", None).await;
    assert_eq!(r.status, 204);
    for a in &agents {
        eventually(
            "every agent dropped the override",
            Duration::from_secs(10),
            || async { (overrides_held(a).await.0 == 0).then_some(()) },
        )
        .await;
    }
    let d = check(2, "apikey:big").await;
    assert!(!d.allowed && d.limit == 2, "{d:?}");

    // One that has expired applies nowhere.
    let r = call(
        service,
        "PUT",
        "/v1/rules/api/overrides/apikey:old",
        Some(r#"{"limit":100,"expiresAt":1,"reason":"a trial that ended"}"#),
    )
    .await;
    assert_eq!(r.status, 201);
    let v = json(&r)["version"].as_u64().unwrap();
    eventually("agent 0 holds it", Duration::from_secs(10), || async {
        (overrides_held(&agents[0]).await.1 == v).then_some(())
    })
    .await;
    assert_eq!(check(0, "apikey:old").await.limit, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_what_the_rule_would_and_pages_the_list() {
    let dir = tempfile::tempdir().unwrap();
    let service = RulesServer::start_with(
        &format!("sqlite://{}", dir.path().join("r.db").display()),
        &["ops:s3cret"],
        &["--read-token", "viewer:r3ad"],
    )
    .await;
    call(
        &service,
        "PUT",
        "/v1/rules/slots",
        Some(r#"{"dimension":"api_key","limit":2,"algorithm":"concurrency"}"#),
    )
    .await;
    for (path, body, status, needle) in [
        (
            "/v1/rules/nope/overrides/k",
            r#"{"limit":1,"reason":"x"}"#,
            404,
            "no rule nope",
        ),
        (
            "/v1/rules/slots/overrides/k",
            r#"{"limit":3,"windowSeconds":5,"reason":"x"}"#,
            400,
            "no window",
        ),
        ("/v1/rules/slots/overrides/k", r#"{"limit":3}"#, 400, "reason"),
        (
            "/v1/rules/slots/overrides/k",
            r#"{"limit":0,"reason":"x"}"#,
            400,
            "nonzero",
        ),
        (
            "/v1/rules/slots/overrides/k",
            r#"{"limit":3,"reason":"x","colour":"red"}"#,
            400,
            "colour",
        ),
        (
            "/v1/rules/slots/overrides/%7Bk%7D",
            r#"{"limit":3,"reason":"x"}"#,
            400,
            "braces",
        ),
    ] {
        let r = call(&service, "PUT", path, Some(body)).await;
        let text = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, status, "{path} {body}: {text}");
        assert!(text.contains(needle), "{path} {body}: {text}");
    }
    // A read token may read, not write.
    let r = request(
        &service.url(),
        "PUT",
        "/v1/rules/slots/overrides/k",
        Some("r3ad"),
        &[],
        Some(br#"{"limit":3,"reason":"x"}"#),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 403);
    // Five set through the CLI, listed two at a time.
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(floodgate_bin())
            .args(["rules", "--server", &service.url(), "--token", TOKEN, "override"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    for i in 0..5 {
        let key = format!("apikey:k{i}:endpoint:/v1/chat");
        let (ok, text) = cli(&[
            "set",
            "slots",
            &key,
            "--limit",
            "4",
            "--reason",
            "plan pro",
            "--expires-in",
            "3600",
        ]);
        assert!(ok && text.contains("written: limit 4"), "{text}");
    }
    let mut seen = Vec::new();
    let mut after = String::new();
    loop {
        let r = call(
            &service,
            "GET",
            &format!(
                "/v1/rules/slots/overrides?limit=2&after={}",
                after.replace('/', "%2F")
            ),
            None,
        )
        .await;
        let page = json(&r);
        for o in page["overrides"].as_array().unwrap() {
            seen.push(o["clientKey"].as_str().unwrap().to_string());
        }
        match page["next"].as_str() {
            Some(n) => after = n.to_string(),
            None => break,
        }
    }
    assert_eq!(seen.len(), 5, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "in key order: {seen:?}");
    let (ok, text) = cli(&["get", "slots", "apikey:k3:endpoint:/v1/chat"]);
    assert!(ok && text.contains("plan pro"), "{text}");
    let (ok, text) = cli(&["delete", "slots", "apikey:k3:endpoint:/v1/chat"]);
    assert!(ok && text.contains("deleted"), "{text}");
    let (ok, _) = cli(&["get", "slots", "apikey:k3:endpoint:/v1/chat"]);
    assert!(!ok, "deleted");
    let (ok, text) = cli(&["list", "slots"]);
    assert!(ok && text.matches("plan pro").count() == 4, "{text}");
    // The audit names who did what.
    let (ok, text) = cli(&["audit"]);
    assert!(ok && text.contains("ops") && text.contains("delete"), "{text}");
    // What agents follow: every change after a version, deletions included.
    let r = call(&service, "GET", "/v1/overrides?since=0", None).await;
    let page = json(&r);
    let changes = page["changes"].as_array().unwrap();
    assert_eq!(
        changes.len(),
        5,
        "one row per key, the deleted one as a tombstone: {page}"
    );
    assert!(changes.iter().any(|c| c["set"].is_null()));
    assert_eq!(page["more"], false);
}

async fn penalties(a: &Agent) -> serde_json::Value {
    let (_, body) = http_get(a.admin_addr().await, "/v1/status").await;
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["penalties"].clone()
}

/// Penalties through the API and the CLI to two agents: a factor scales a key's limits (its
/// per-endpoint keys too), a block refuses it with Retry-After to the penalty's end, the agents'
/// status shows it, it ends by itself or is lifted; a bad penalty is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_penalty_scales_or_blocks_a_key_until_it_ends() {
    let fleet = Fleet::start().await;
    let service = &fleet.rules;
    call(
        service,
        "PUT",
        "/v1/rules/api",
        Some(r#"{"dimension":"api_key","limit":20,"windowSeconds":3600}"#),
    )
    .await;
    let mut agents = Vec::new();
    for _ in 0..2 {
        agents.push(fleet.agent().arg("--rejection-cache").arg("0").start().await);
    }
    let clients = [
        patient_client(agents[0].socket()).await,
        patient_client(agents[1].socket()).await,
    ];
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(floodgate_bin())
            .args(["rules", "--server", &service.url(), "--token", TOKEN, "penalty"])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = cli(&[
        "set",
        "apikey:abuser",
        "--factor",
        "0.1",
        "--for",
        "3600",
        "--reason",
        "abuse score 0.97",
    ]);
    assert!(ok && text.contains("factor 0.1"), "{text}");
    for a in &agents {
        eventually("the agent holds the penalty", Duration::from_secs(10), || async {
            let p = penalties(a).await;
            (p[0]["clientKey"] == "apikey:abuser" && p[0]["factor"] == 0.1).then_some(())
        })
        .await;
    }
    // 20 × 0.1 = 2, across the fleet, its per-endpoint keys scaled too; another key keeps 20.
    let check = |i: usize, key: &'static str| {
        let c = clients[i].clone();
        async move { c.check(vec![Item::new(key, "api", 1)]).await.unwrap() }
    };
    assert!(check(0, "apikey:abuser").await.allowed);
    assert!(check(1, "apikey:abuser").await.allowed);
    let d = check(0, "apikey:abuser").await;
    assert!(!d.allowed && d.limit == 2, "{d:?}");
    assert_eq!(check(1, "apikey:abuser:endpoint:/search").await.limit, 2);
    assert_eq!(check(1, "apikey:fine").await.limit, 20);

    // Blocked: refused at once, Retry-After to the penalty's end.
    let (ok, text) = cli(&[
        "set",
        "apikey:abuser",
        "--block",
        "--for",
        "3600",
        "--reason",
        "incident 7",
    ]);
    assert!(ok && text.contains("blocked"), "{text}");
    for a in &agents {
        eventually("the agent holds the block", Duration::from_secs(10), || async {
            (penalties(a).await[0]["block"] == true).then_some(())
        })
        .await;
    }
    let d = check(1, "apikey:abuser:endpoint:/other").await;
    assert!(!d.allowed, "{d:?}");
    let retry = d.retry_after_ms.unwrap();
    assert!(
        retry > 3_500_000 && retry <= 3_600_000,
        "to the penalty's end: {retry}"
    );
    let (ok, text) = cli(&["list"]);
    assert!(
        ok && text.contains("apikey:abuser") && text.contains("blocked"),
        "{text}"
    );

    // Lifted: the rule's limit again (2 counted of 20).
    let (ok, text) = cli(&["delete", "apikey:abuser"]);
    assert!(ok && text.contains("lifted"), "{text}");
    for a in &agents {
        eventually(
            "the agent dropped the penalty",
            Duration::from_secs(10),
            || async { penalties(a).await.as_array().unwrap().is_empty().then_some(()) },
        )
        .await;
    }
    let d = check(0, "apikey:abuser").await;
    assert!(d.allowed && d.limit == 20, "{d:?}");

    // One that ends by itself.
    let until = floodgate_core::store::Clock::System.now_ms() + 1_500;
    let r = call(
        service,
        "PUT",
        "/v1/penalties/apikey:brief",
        Some(&format!(
            r#"{{"block":true,"until":{until},"reason":"cool-off"}}"#
        )),
    )
    .await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    eventually(
        "it applies, then ends by itself",
        Duration::from_secs(10),
        || async { check(0, "apikey:brief").await.allowed.then_some(()) },
    )
    .await;

    // Refused: a factor of 1 or more, both or neither, an end in the past.
    for body in [
        r#"{"factor":1.5,"until":99999999999999,"reason":"x"}"#.to_string(),
        format!(
            r#"{{"factor":0.5,"block":true,"until":{},"reason":"x"}}"#,
            until + 60_000
        ),
        format!(r#"{{"until":{},"reason":"x"}}"#, until + 60_000),
        r#"{"block":true,"until":1,"reason":"x"}"#.to_string(),
    ] {
        let r = call(service, "PUT", "/v1/penalties/apikey:x", Some(&body)).await;
        assert_eq!(r.status, 400, "{body}: {}", String::from_utf8_lossy(&r.body));
    }
}
