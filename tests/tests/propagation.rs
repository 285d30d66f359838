//! Agents following a real rules service: a change reaches every agent, a raised limit unblocks a
//! cached rejection at once, the last good set survives the service going away and an agent restart,
//! and pulling without a watch still converges.

use std::time::Duration;

use floodgate_rules_service::http::request;
use floodgate_sdk::{Origin, Source};
use floodgate_tests::{
    eventually, patient_client, rejection_events, rules_version, wait_rules_version as wait_version, Agent,
    Fleet, OPERATOR_TOKEN as TOKEN,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_reaches_every_agent_and_a_raised_limit_unblocks_at_once() {
    let fleet = Fleet::start().await;
    let (a, b) = (fleet.agent().start().await, fleet.agent().start().await);
    let v1 = fleet
        .put_rule("p", r#"{"dimension":"user","limit":1,"windowSeconds":60}"#)
        .await;
    wait_version(&a, v1).await;
    wait_version(&b, v1).await;
    let client = patient_client(a.socket()).await;
    assert!(client.allow("user:u", "p", 1).await.unwrap().allowed);
    let denied = client.allow("user:u", "p", 1).await.unwrap();
    assert!(!denied.allowed);
    let cached = client.allow("user:u", "p", 1).await.unwrap();
    assert_eq!(
        cached.origin,
        Origin::Agent(Source::Cache),
        "the rejection is cached"
    );
    // Raising the limit unblocks at once: the cached rejection was made under the old rule.
    let v2 = fleet
        .put_rule("p", r#"{"dimension":"user","limit":3,"windowSeconds":60}"#)
        .await;
    wait_version(&a, v2).await;
    let d = client.allow("user:u", "p", 1).await.unwrap();
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.origin, Origin::Agent(Source::Redis));
    assert_eq!(d.limit, 3);
    // The other agent shares the count in Redis: one left.
    let other = patient_client(b.socket()).await;
    wait_version(&b, v2).await;
    assert!(other.allow("user:u", "p", 1).await.unwrap().allowed);
    assert!(!other.allow("user:u", "p", 1).await.unwrap().allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_good_set_survives_the_service_and_an_agent_restart() {
    let mut fleet = Fleet::start().await;
    let socket = fleet.path("agent.sock");
    let cache = fleet.path("rules-cache.json");
    let builder = |fleet: &Fleet| {
        fleet
            .agent()
            .socket(&socket)
            .arg("--rules-cache")
            .arg(cache.to_str().unwrap())
    };
    let mut a = builder(&fleet).start().await;
    let v = fleet
        .put_rule("kept", r#"{"dimension":"user","limit":2,"windowSeconds":60}"#)
        .await;
    wait_version(&a, v).await;
    fleet.rules.kill();
    // The service is gone: the agent keeps enforcing what it has.
    let client = patient_client(&socket).await;
    assert!(client.allow("user:k", "kept", 1).await.unwrap().allowed);
    // And across a restart, from the cache file.
    assert_eq!(a.terminate().await, Some(0));
    let a = builder(&fleet).start().await;
    assert!(a.log().contains("cache"), "{}", a.log());
    assert_eq!(rules_version(&a).await, v);
    let client = patient_client(&socket).await;
    assert!(client.allow("user:k", "kept", 1).await.unwrap().allowed);
    assert!(
        !client.allow("user:k", "kept", 1).await.unwrap().allowed,
        "limit 2: the count survived in Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_watch_the_poll_still_converges() {
    let fleet = Fleet::start().await;
    let a = fleet
        .agent()
        .arg("--rules-watch-s")
        .arg("0")
        .arg("--rules-poll-ms")
        .arg("300")
        .start()
        .await;
    let v = fleet
        .put_rule("polled", r#"{"dimension":"ip","limit":9,"windowSeconds":1}"#)
        .await;
    wait_version(&a, v).await;
    let d = patient_client(a.socket())
        .await
        .allow("ip:1.2.3.4", "polled", 1)
        .await
        .unwrap();
    assert_eq!(d.limit, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_default_serves_the_rules_api_itself() {
    let agent = Agent::builder().start().await;
    let api = format!("http://{}", agent.rules_addr().await);
    let r = request(&api, "GET", "/v1/rules", None, &[], None, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let set: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert!(
        set["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["id"] == "api-per-user"),
        "seeded with the example rules"
    );
    let r = request(
        &api,
        "PUT",
        "/v1/rules/new",
        None,
        &[],
        Some(br#"{"dimension":"user","limit":1,"windowSeconds":60}"#),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201);
    let client = patient_client(agent.socket()).await;
    let d = eventually("the agent enforces the new rule", Duration::from_secs(10), || {
        let client = client.clone();
        async move { client.allow("user:z", "new", 1).await.ok() }
    })
    .await;
    assert!(d.allowed);
    assert!(!client.allow("user:z", "new", 1).await.unwrap().allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_mode_reports_what_it_would_have_rejected() {
    let fleet = Fleet::start().await;
    let a = fleet.agent().start().await;
    let v = fleet
        .put_rule(
            "dry",
            r#"{"dimension":"user","limit":1,"windowSeconds":60,"mode":"log"}"#,
        )
        .await;
    wait_version(&a, v).await;
    let client = patient_client(a.socket()).await;
    for key in [
        "user:noisy",
        "user:noisy",
        "user:noisy",
        "user:noisy",
        "user:quiet",
    ] {
        let d = client.allow(key, "dry", 1).await.unwrap();
        assert!(d.allowed, "log mode never rejects: {d:?}");
    }
    // Agents report every 5 s.
    let report = eventually(
        "the service has the agent's dry-run report",
        Duration::from_secs(20),
        || async {
            let r = fleet.call("GET", "/v1/rules/dry/dry-run", None).await;
            let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
            // Reports come every 5 s: one may carry only part of the five checks.
            (v["wouldReject"].as_u64()? >= 3).then_some(v)
        },
    )
    .await;
    assert_eq!(report["wouldReject"], 3, "{report}");
    assert_eq!(report["mode"], "log");
    assert_eq!(report["topKeys"][0]["key"], "user:noisy");
    assert_eq!(report["topKeys"][0]["count"], 3);
    // The CLI reads it too, readable by default.
    let out = std::process::Command::new(floodgate_tests::floodgate_bin())
        .args([
            "rules",
            "--server",
            &fleet.rules.url(),
            "--token",
            TOKEN,
            "dry-run",
            "dry",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("would have rejected 3"),
        "{text}"
    );
}

/// A rule in log mode never rejects; its would-be rejections are stream events tagged `mode=log`
/// and the version of the rule that made them, so an operator can tell which limit the dry run
/// tried. A key is news once per dry-run report (every 5 s to a service): its repeats are counted in
/// the dry run, not streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_mode_would_be_rejections_are_events_with_the_rule_version() {
    let fleet = Fleet::start().await;
    let a = fleet.agent().start().await;
    let client = patient_client(a.socket()).await;
    let mut conn = fleet.redis.conn();
    for (limit, key) in [(1, "user:l1"), (2, "user:l2")] {
        let v = fleet
            .put_rule(
                "watch",
                &format!(r#"{{"dimension":"user","limit":{limit},"windowSeconds":60,"mode":"log"}}"#),
            )
            .await;
        wait_version(&a, v).await;
        for i in 0..4 {
            let d = client.allow(key, "watch", 1).await.unwrap();
            assert!(d.allowed, "log mode never rejects (limit {limit}, check {i})");
        }
        let mine = eventually("the key's would-be rejection", Duration::from_secs(10), || {
            let mine: Vec<_> = rejection_events(&mut conn)
                .into_iter()
                .filter(|e| e.get("key").map(String::as_str) == Some(key))
                .collect();
            async move { (!mine.is_empty()).then_some(mine) }
        })
        .await;
        // Four checks against a limit of `limit`: 4 − limit would-be rejections, of which at least
        // the first is news (more only if a report went out in between).
        assert!(mine.len() <= 4 - limit, "{mine:?}");
        for e in &mine {
            assert_eq!(e["mode"], "log");
            assert_eq!(e["ruleId"], "watch");
            assert_eq!(e["version"], v.to_string(), "the version that made it");
        }
    }
}
