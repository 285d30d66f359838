//! The rules service as a real process over SQLite and over PostgreSQL (a database of its own): auth,
//! field-by-field validation, versions and If-Match, 304 and the long-poll watch, delete, audit.

use std::time::{Duration, Instant};

use floodgate_rules_service::http::{request, Response};
use floodgate_tests::{PgDatabase, RulesServer};

const T: Duration = Duration::from_secs(10);

async fn call(
    s: &RulesServer,
    method: &str,
    path: &str,
    token: Option<&str>,
    extra: &[(&str, String)],
    body: Option<&str>,
) -> Response {
    request(&s.url(), method, path, token, extra, body.map(str::as_bytes), T)
        .await
        .unwrap()
}

fn json(r: &Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
}

async fn the_api_holds(db: &str) {
    let s = RulesServer::start(db, &["ops:s3cret"]).await;
    let tok = Some("s3cret");
    // Auth: none → 401, wrong → 403.
    assert_eq!(call(&s, "GET", "/v1/rules", None, &[], None).await.status, 401);
    assert_eq!(
        call(&s, "GET", "/v1/rules", Some("nope"), &[], None).await.status,
        403
    );

    // Validation names every bad field.
    let r = call(
        &s,
        "PUT",
        "/v1/rules/api",
        tok,
        &[],
        Some(r#"{"dimension":"planet","limit":0,"windowSeconds":60,"colour":1}"#),
    )
    .await;
    assert_eq!(r.status, 400);
    let fields = json(&r)["fields"].clone();
    for f in ["dimension", "limit", "colour"] {
        assert!(fields.get(f).is_some(), "{f} in {fields}");
    }

    // Create, then replace with If-Match; a stale If-Match is a conflict.
    let body = r#"{"dimension":"user","match":{"endpoint":"/api/*"},"limit":100,"windowSeconds":60}"#;
    let r = call(&s, "PUT", "/v1/rules/api", tok, &[], Some(body)).await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(json(&r)["version"], 1);
    assert_eq!(r.header("etag"), Some("\"1\""));
    let body2 = r#"{"dimension":"user","match":{"endpoint":"/api/*"},"limit":200,"windowSeconds":60}"#;
    let r = call(
        &s,
        "PUT",
        "/v1/rules/api",
        tok,
        &[("If-Match", "\"1\"".into())],
        Some(body2),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(json(&r)["version"], 2);
    let r = call(
        &s,
        "PUT",
        "/v1/rules/api",
        tok,
        &[("If-Match", "\"1\"".into())],
        Some(body),
    )
    .await;
    assert_eq!(r.status, 412, "{}", String::from_utf8_lossy(&r.body));
    let r = call(
        &s,
        "PUT",
        "/v1/rules/login",
        tok,
        &[("If-Match", "\"0\"".into())],
        Some(r#"{"dimension":"ip","limit":5,"windowSeconds":600,"failMode":"closed"}"#),
    )
    .await;
    assert_eq!(r.status, 201, "If-Match 0: create only");

    // The set, its version, 304 when unchanged.
    let r = call(&s, "GET", "/v1/rules", tok, &[], None).await;
    assert_eq!(r.status, 200);
    let set = json(&r);
    let version = set["version"].as_u64().unwrap();
    assert_eq!(version, 3, "three writes made it");
    assert_eq!(set["rules"].as_array().unwrap().len(), 2);
    assert_eq!(
        call(&s, "GET", &format!("/v1/rules?version={version}"), tok, &[], None)
            .await
            .status,
        304
    );
    let r = call(&s, "GET", "/v1/rules/api", tok, &[], None).await;
    assert_eq!(json(&r)["limit"], 200);

    // A watch wakes up on a change: a PUT 200 ms into a 20 s watch answers the watch at once.
    let url = s.url();
    let watch = tokio::spawn(async move {
        let t = Instant::now();
        let r = request(
            &url,
            "GET",
            &format!("/v1/rules?version={version}&watch=20"),
            Some("s3cret"),
            &[],
            None,
            T * 3,
        )
        .await
        .unwrap();
        (r.status, json(&r)["version"].as_u64(), t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        call(&s, "DELETE", "/v1/rules/login", tok, &[], None).await.status,
        204
    );
    let (status, new_version, waited) = watch.await.unwrap();
    assert_eq!((status, new_version), (200, Some(version + 1)));
    assert!(
        waited < Duration::from_secs(15),
        "the watch returned on the change, not at its end: {waited:?}"
    );
    assert_eq!(
        call(&s, "GET", "/v1/rules/login", tok, &[], None).await.status,
        404
    );
    assert_eq!(
        call(&s, "DELETE", "/v1/rules/login", tok, &[], None).await.status,
        404
    );

    // The audit: who, what, old and new.
    let r = call(&s, "GET", "/v1/audit?limit=10", tok, &[], None).await;
    let audit = json(&r)["audit"].as_array().unwrap().clone();
    assert_eq!(audit.len(), 4);
    assert_eq!(audit[0]["action"], "delete");
    assert!(audit.iter().all(|a| a["actor"] == "ops"));
    assert!(audit[2]["old"].as_str().unwrap().contains("\"limit\":100"));
    assert!(audit[2]["new"].as_str().unwrap().contains("\"limit\":200"));

    // Deleted and created again, login gets a version it never had (the global one), so an If-Match
    // held from before the delete (3) cannot match the new rule.
    let login = r#"{"dimension":"ip","limit":9,"windowSeconds":600}"#;
    let r = call(
        &s,
        "PUT",
        "/v1/rules/login",
        tok,
        &[("If-Match", "\"0\"".into())],
        Some(login),
    )
    .await;
    assert_eq!((r.status, json(&r)["version"].as_u64()), (201, Some(version + 2)));
    let r = call(
        &s,
        "PUT",
        "/v1/rules/login",
        tok,
        &[("If-Match", "\"3\"".into())],
        Some(login),
    )
    .await;
    assert_eq!(r.status, 412, "{}", String::from_utf8_lossy(&r.body));
    // The Bearer scheme is case-insensitive (RFC 9110).
    let r = request(
        &s.url(),
        "GET",
        "/v1/rules",
        None,
        &[("Authorization", "bearer s3cret".into())],
        None,
        T,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_over_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    the_api_holds(&format!("sqlite://{}", dir.path().join("rules.db").display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_over_postgres() {
    let db = PgDatabase::create();
    the_api_holds(&db.url()).await;
    // Same database, a second service: it sees what the first wrote (the store is the truth).
    let s = RulesServer::start(&db.url(), &["ops:s3cret"]).await;
    let r = call(&s, "GET", "/v1/rules", Some("s3cret"), &[], None).await;
    assert_eq!(json(&r)["rules"].as_array().unwrap().len(), 2);
    let held = json(&r)["version"].as_u64().unwrap();
    // A watch on the second for the version it holds is held, also right after a write through the
    // first that it has not announced yet: it asks the store and holds the watch for the next
    // version instead of answering 304 at once (which made agents ask again in a loop).
    let s1 = RulesServer::start(&db.url(), &["ops:s3cret"]).await;
    let body = r#"{"dimension":"user","limit":7,"windowSeconds":60}"#;
    let r = call(&s1, "PUT", "/v1/rules/other", Some("s3cret"), &[], Some(body)).await;
    assert_eq!(r.status, 201);
    let t = Instant::now();
    let path = format!("/v1/rules?version={}&watch=2", held + 1);
    let r = call(&s, "GET", &path, Some("s3cret"), &[], None).await;
    // A timeout never fires early, so ≥ 2 s here means the watch was held to its end.
    assert_eq!(r.status, 304);
    assert!(t.elapsed() >= Duration::from_secs(2), "held {:?}", t.elapsed());
}

/// Two PUTs racing for one Envoy descriptor, each valid against the set it would have read: the
/// store validates the whole set inside the write's serialized transaction, so exactly one lands and
/// the other is a 409, every round; the stored set stays one agents accept. (Before: both could be
/// stored, and every agent then refused every later set.) Two services over one PostgreSQL race
/// through two processes.
async fn racing_writes_never_store_an_invalid_set(a: &RulesServer, b: &RulesServer) {
    let tok = Some("s3cret");
    for round in 0..20 {
        let body = format!(
            r#"{{"dimension":"descriptor","limit":5,"windowSeconds":60,"envoy":{{"domain":"race","descriptors":[{{"key":"k{round}"}}]}}}}"#
        );
        let (pa, pb) = (format!("/v1/rules/a{round}"), format!("/v1/rules/b{round}"));
        let (ra, rb) = tokio::join!(
            call(a, "PUT", &pa, tok, &[], Some(&body)),
            call(b, "PUT", &pb, tok, &[], Some(&body)),
        );
        let mut statuses = [ra.status, rb.status];
        statuses.sort();
        assert_eq!(
            statuses,
            [201, 409],
            "round {round}: {} / {}",
            json(&ra),
            json(&rb)
        );
        let refused = if ra.status == 409 { &ra } else { &rb };
        assert!(
            json(refused)["error"]
                .as_str()
                .unwrap()
                .contains("the rule set would be invalid"),
            "{}",
            json(refused)
        );
    }
    let r = call(a, "GET", "/v1/rules", tok, &[], None).await;
    let rules: Vec<floodgate_core::rules::Rule> = serde_json::from_value(json(&r)["rules"].clone()).unwrap();
    assert_eq!(rules.len(), 20);
    floodgate_core::rules::RuleSet::new(rules).expect("the stored set is valid");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writes_over_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let s = RulesServer::start(
        &format!("sqlite://{}", dir.path().join("rules.db").display()),
        &["ops:s3cret"],
    )
    .await;
    racing_writes_never_store_an_invalid_set(&s, &s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writes_over_postgres_through_two_services() {
    let db = PgDatabase::create();
    let a = RulesServer::start(&db.url(), &["ops:s3cret"]).await;
    let b = RulesServer::start(&db.url(), &["ops:s3cret"]).await;
    racing_writes_never_store_an_invalid_set(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_services_migrate_a_fresh_postgres_database_at_once() {
    // Both create the tables of an empty database at the same moment; the advisory lock makes one
    // wait for the other, where both racing `CREATE TABLE IF NOT EXISTS` failed most of the time.
    for _ in 0..3 {
        let db = PgDatabase::create();
        let url = db.url();
        let (a, b) = tokio::join!(
            floodgate_rules_service::store::RulesStore::open(&url),
            floodgate_rules_service::store::RulesStore::open(&url)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!((a.version().await.unwrap(), b.version().await.unwrap()), (0, 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_held_watches_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = RulesServer::start(
        &format!("sqlite://{}", dir.path().join("rules.db").display()),
        &["ops:s3cret"],
    )
    .await;
    let url = s.url();
    let watch = tokio::spawn(async move {
        request(
            &url,
            "GET",
            "/v1/rules?version=0&watch=50",
            Some("s3cret"),
            &[],
            None,
            T * 10,
        )
        .await
    });
    // The server gives no sign that it holds a watch; 300 ms is ample for a loopback request to be
    // accepted and parsed (a request not yet accepted would fail below rather than pass).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    assert_eq!(s.terminate().await, Some(0));
    // The watch's 50 s are far longer than `terminate`'s 10 s: the server stopped without waiting.
    let r = watch.await.unwrap().unwrap();
    assert_eq!(r.status, 304);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

#[tokio::test]
async fn an_empty_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(floodgate_tests::floodgate_bin())
        .args([
            "rules-server",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "ops:",
            "--db",
        ])
        .arg(format!("sqlite://{}", dir.path().join("r.db").display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("neither empty"), "{err}");
}

#[tokio::test]
async fn without_a_token_it_listens_on_loopback_only() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(floodgate_tests::floodgate_bin())
        .args(["rules-server", "--listen", "0.0.0.0:0", "--db"])
        .arg(format!("sqlite://{}", dir.path().join("r.db").display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback"), "{err}");
}
