//! Redis over TLS with AUTH: a real `redis-server` serving TLS with a certificate made here (its own
//! CA), a password required, and agents that trust the CA (`--redis-ca`) and read the password from
//! a file (`--redis-password-file`) — or do not, and fall back.

use std::time::Duration;

use floodgate_sdk::{Origin, Source};
use floodgate_tests::{eventually, free_port, patient_client, Agent, RedisServer, TestCa};

const RULES: &str = r#"{"rules":[{"id":"api","dimension":"user","limit":1000,"windowSeconds":60}]}"#;

/// A CA, and a certificate it signed for 127.0.0.1 and localhost (`server.pem`, `server.key`).
fn make_tls() -> TestCa {
    let ca = TestCa::new("floodgate test CA");
    ca.issue("server", &["127.0.0.1", "localhost"]);
    ca
}

/// Answers come from Redis (not the fallback) within the patience.
async fn answered_by_redis(agent: &Agent) -> bool {
    let client = patient_client(agent.socket()).await;
    let mut tries = 0;
    loop {
        let d = client.allow("user:1", "api", 1).await.unwrap();
        if d.origin == Origin::Agent(Source::Redis) {
            return true;
        }
        tries += 1;
        if tries > 20 {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_and_a_password_file() {
    let tls = make_tls();
    let tls_port = free_port();
    let redis = RedisServer::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &tls.path("server.pem"),
        "--tls-key-file",
        &tls.path("server.key"),
        "--tls-ca-cert-file",
        &tls.path("ca.pem"),
        "--tls-auth-clients",
        "no",
    ]);
    // The password is set once the server answers (the support code pings without one).
    let mut conn = redis.conn();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("s3cret")
        .query(&mut conn)
        .unwrap();
    let password = tls.dir().join("password");
    std::fs::write(&password, "s3cret\n").unwrap();
    let url = format!("rediss://127.0.0.1:{tls_port}");

    let agent = Agent::builder()
        .redis(&url)
        .rules(RULES)
        .arg("--redis-ca")
        .arg(&tls.path("ca.pem"))
        .arg("--redis-password-file")
        .arg(password.to_str().unwrap())
        .start()
        .await;
    eventually(
        "checks answered by Redis over TLS",
        Duration::from_secs(10),
        || async { answered_by_redis(&agent).await.then_some(()) },
    )
    .await;
    // The counts are on the TLS server: read back over its plain port with the password.
    let mut conn = redis::Client::open(format!("redis://:s3cret@127.0.0.1:{}", redis.port()))
        .unwrap()
        .get_connection()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert!(!keys.is_empty(), "the agent's counters are in Redis");

    // Without the CA, the system's store does not trust the certificate; with a wrong password,
    // Redis refuses the AUTH: either way no answer comes from Redis (the fail mode answers), and the
    // agent's log says which. Patient (1 s store timeout, as above): the cause is the certificate or
    // the password, not a handshake slower than the 5 ms default.
    let wrong = tls.dir().join("wrong");
    std::fs::write(&wrong, "nope").unwrap();
    for (args, why) in [
        (
            vec!["--redis-password-file", password.to_str().unwrap()],
            "certificate",
        ),
        (
            vec![
                "--redis-ca",
                &tls.path("ca.pem"),
                "--redis-password-file",
                wrong.to_str().unwrap(),
            ],
            // Redis's own error code, whichever client the agent's call went through.
            "WRONGPASS",
        ),
    ] {
        let mut b = Agent::builder().redis(&url).rules(RULES);
        for a in &args {
            b = b.arg(a);
        }
        let refused = b.start().await;
        let client = patient_client(refused.socket()).await;
        for _ in 0..5 {
            let d = client.allow("user:2", "api", 1).await.unwrap();
            assert!(d.allowed, "fail open while Redis cannot be reached: {d:?}");
            assert_eq!(d.origin, Origin::Agent(Source::Fallback), "{args:?}: {d:?}");
        }
        assert!(
            refused.log().contains(why),
            "{args:?}: the log names the cause ({why}):\n{}",
            refused.log()
        );
    }
}

/// The rules service over TLS: the CLI writes a rule through https, an agent follows the service
/// through https (trusting the private CA) and enforces the rule; without the CA nothing connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_service_over_https() {
    let tls = make_tls();
    let db = format!("sqlite://{}", tls.dir().join("rules.db").display());
    let server = floodgate_tests::RulesServer::start_with(
        &db,
        &["ops:t0ken"],
        &[
            "--tls-cert",
            &tls.path("server.pem"),
            "--tls-key",
            &tls.path("server.key"),
        ],
    )
    .await;
    let url = server.url();
    assert!(url.starts_with("https://"), "{url}");
    let rule = tls.dir().join("rule.json");
    std::fs::write(&rule, r#"{"dimension":"user","limit":2,"windowSeconds":60}"#).unwrap();
    let cli = |ca: bool| {
        let mut cmd = std::process::Command::new(floodgate_tests::floodgate_bin());
        cmd.args(["rules", "--server", &url, "--token", "t0ken"]);
        if ca {
            cmd.args(["--ca", &tls.path("ca.pem")]);
        }
        cmd.args(["put", "tls-rule", "--file", rule.to_str().unwrap()]);
        cmd.env_remove("FLOODGATE_RULES_CA").output().unwrap()
    };
    let refused = cli(false);
    assert!(
        !refused.status.success(),
        "the system's store does not trust the private CA"
    );
    let written = cli(true);
    assert!(
        written.status.success(),
        "{}{}",
        String::from_utf8_lossy(&written.stdout),
        String::from_utf8_lossy(&written.stderr)
    );
    // A one-minute window: the checks take milliseconds of it.
    let agent = Agent::builder()
        .arg("--rules-url")
        .arg(&url)
        .arg("--rules-token")
        .arg("t0ken")
        .arg("--rules-ca")
        .arg(&tls.path("ca.pem"))
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let d = eventually(
        "the agent follows the https service",
        Duration::from_secs(10),
        || async { client.allow("user:1", "tls-rule", 1).await.ok() },
    )
    .await;
    assert!(d.allowed && d.limit == 2, "{d:?}");
    assert!(client.allow("user:1", "tls-rule", 1).await.unwrap().allowed);
    assert!(!client.allow("user:1", "tls-rule", 1).await.unwrap().allowed);
}
