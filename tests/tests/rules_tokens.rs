//! The rules service's token scopes and token files, against real processes: a read token reads,
//! watches and reports dry runs but cannot write; a token file gives both kinds; a token file
//! other users can read (or with a bad line) stops the service at start; an agent and the CLI read
//! their token from a file.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate_rules_service::http::{request, Response};
use floodgate_tests::{agent_status, eventually, floodgate_bin, patient_client, Agent, RulesServer};

const T: Duration = Duration::from_secs(10);
const RULE: &str = r#"{"dimension":"user","limit":1,"windowSeconds":60,"mode":"log"}"#;

async fn call(s: &RulesServer, method: &str, path: &str, token: &str, body: Option<&str>) -> Response {
    request(
        &s.url(),
        method,
        path,
        Some(token),
        &[],
        body.map(str::as_bytes),
        T,
    )
    .await
    .unwrap()
}

fn text(r: &Response) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

/// Writes `text` to `dir/name` with `mode`.
fn secret_file(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

fn db(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("r.db").display())
}

async fn version(s: &RulesServer, token: &str) -> u64 {
    let r = call(s, "GET", "/v1/rules", token, None).await;
    assert_eq!(r.status, 200, "{}", text(&r));
    serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()["version"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_token_reads_watches_and_reports_but_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let s = RulesServer::start_with(&db(&dir), &["ops:w5ecret"], &["--read-token", "agents:r5ecret"]).await;
    let (w, r) = ("w5ecret", "r5ecret");
    let put = call(&s, "PUT", "/v1/rules/p", w, Some(RULE)).await;
    assert_eq!(put.status, 201, "{}", text(&put));

    // Reads.
    let held = version(&s, r).await;
    assert_eq!(call(&s, "GET", "/v1/rules/p", r, None).await.status, 200);
    assert_eq!(call(&s, "GET", "/v1/rules/p/dry-run", r, None).await.status, 200);
    // A dry-run report, as agents send it.
    let report = format!(r#"{{"version":{held},"count":3,"topKeys":[["user:u",3]]}}"#);
    let sent = call(&s, "POST", "/v1/rules/p/dry-run", r, Some(&report)).await;
    assert_eq!(sent.status, 204, "{}", text(&sent));
    let tally = call(&s, "GET", "/v1/rules/p/dry-run", r, None).await;
    assert!(text(&tally).contains("\"wouldReject\":3"), "{}", text(&tally));

    // A watch with the read token sees the next write.
    let (url, path) = (s.url(), format!("/v1/rules?version={held}&watch=30"));
    let watch =
        tokio::spawn(async move { request(&url, "GET", &path, Some("r5ecret"), &[], None, T * 4).await });
    let put = call(&s, "PUT", "/v1/rules/q", w, Some(RULE)).await;
    assert_eq!(put.status, 201, "{}", text(&put));
    let seen = watch.await.unwrap().unwrap();
    assert_eq!(seen.status, 200, "{}", text(&seen));
    assert!(text(&seen).contains("\"q\""), "{}", text(&seen));

    // Anything else: 403, saying why; the write token still may.
    for (method, path, body) in [
        ("PUT", "/v1/rules/p", Some(RULE)),
        ("DELETE", "/v1/rules/p", None),
        ("GET", "/v1/audit", None),
    ] {
        let refused = call(&s, method, path, r, body).await;
        assert_eq!(refused.status, 403, "{method} {path}");
        assert!(
            text(&refused).contains("this token may only read"),
            "{}",
            text(&refused)
        );
    }
    assert_eq!(call(&s, "GET", "/v1/audit", w, None).await.status, 200);
    assert_eq!(call(&s, "DELETE", "/v1/rules/p", w, None).await.status, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_gives_both_scopes() {
    let dir = tempfile::tempdir().unwrap();
    let file = secret_file(
        dir.path(),
        "tokens",
        "# operators write, agents read\n\nwrite ops:w5ecret\nread agents:r5ecret\n",
        0o600,
    );
    let s = RulesServer::start_with(&db(&dir), &[], &["--token-file", file.to_str().unwrap()]).await;
    assert!(s.log().contains("tokens=1 read_tokens=1"), "{}", s.log());
    let put = call(&s, "PUT", "/v1/rules/p", "w5ecret", Some(RULE)).await;
    assert_eq!(put.status, 201, "{}", text(&put));
    assert_eq!(version(&s, "r5ecret").await, 1);
    let refused = call(&s, "PUT", "/v1/rules/p", "r5ecret", Some(RULE)).await;
    assert_eq!(refused.status, 403);
    assert_eq!(call(&s, "GET", "/v1/rules", "nope", None).await.status, 403);
    let audit = call(&s, "GET", "/v1/audit", "w5ecret", None).await;
    assert!(text(&audit).contains("\"actor\":\"ops\""), "{}", text(&audit));
}

/// `floodgate rules-server` with these arguments fails at start; its stderr.
fn refused_start(dir: &tempfile::TempDir, args: &[&str]) -> String {
    let out = std::process::Command::new(floodgate_bin())
        .args(["rules-server", "--listen", "127.0.0.1:0", "--db", &db(dir)])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started: {err}");
    err
}

#[tokio::test]
async fn a_token_file_others_can_read_or_with_a_bad_line_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let open = secret_file(dir.path(), "open", "write ops:w5ecret\n", 0o644);
    let err = refused_start(&dir, &["--token-file", open.to_str().unwrap()]);
    assert!(err.contains("readable by other users"), "{err}");
    let bad = secret_file(
        dir.path(),
        "bad",
        "write ops:w5ecret\n\nadmin root:hunter2\n",
        0o600,
    );
    let err = refused_start(&dir, &["--token-file", bad.to_str().unwrap()]);
    assert!(
        err.contains("line 3") && err.contains("`write` or `read`"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "the error shows no secret: {err}");
    let err = refused_start(&dir, &["--token", "ops:same", "--read-token", "agents:same"]);
    assert!(err.contains("same secret"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_and_the_cli_read_their_token_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = secret_file(
        dir.path(),
        "tokens",
        "write ops:w5ecret\nread agents:r5ecret\n",
        0o600,
    );
    let s = RulesServer::start_with(&db(&dir), &[], &["--token-file", file.to_str().unwrap()]).await;
    // Trimmed: a file written by `echo` ends in a newline.
    let ops = secret_file(dir.path(), "ops-token", "w5ecret\n", 0o600);
    let agents = secret_file(dir.path(), "agent-token", "  r5ecret\n", 0o600);
    let rule = secret_file(dir.path(), "rule.json", RULE, 0o600);
    let cli = |token: &Path, args: &[&str]| {
        std::process::Command::new(floodgate_bin())
            .args(["rules", "--server", &s.url(), "--token-file"])
            .arg(token)
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&ops, &["put", "p", "--file", rule.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = cli(&agents, &["put", "p", "--file", rule.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("403 this token may only read"),
        "{err}"
    );

    // The agent follows with the read token from its file, and reports its log-mode rule's
    // would-be rejections with it.
    let agent = Agent::builder()
        .arg("--rules-url")
        .arg(&s.url())
        .arg("--rules-token-file")
        .arg(agents.to_str().unwrap())
        .start()
        .await;
    eventually("the agent holds the rule", T, || async {
        (agent_status(&agent).await["rules"] == serde_json::json!(["p"])).then_some(())
    })
    .await;
    let client = patient_client(agent.socket()).await;
    for _ in 0..3 {
        assert!(client.allow("user:u", "p", 1).await.unwrap().allowed, "log mode");
    }
    eventually(
        "the agent's dry run reaches the service",
        Duration::from_secs(15),
        || async {
            let r = call(&s, "GET", "/v1/rules/p/dry-run", "r5ecret", None).await;
            let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
            (v["wouldReject"].as_u64()? >= 2).then_some(())
        },
    )
    .await;
}
