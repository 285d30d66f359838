//! One default socket for the agent and the SDKs: an agent started with no `--socket` serves where
//! `Client::connect_default()` looks, never in world-writable /tmp; a client whose agent is missing
//! says so in `health()`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use floodgate_sdk::{Client, ClientConfig, Origin, Source};
use floodgate_tests::{eventually, floodgate_bin};

/// Whether this process runs as root (it owns /proc/self then): the agent then serves
/// /run/floodgate, else $XDG_RUNTIME_DIR/floodgate.
fn root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").unwrap().uid() == 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_no_socket_flag_serves_where_the_sdks_look() {
    let runtime = tempfile::tempdir().unwrap();
    let expected = if root() {
        PathBuf::from(floodgate_sdk::DEFAULT_SOCKET)
    } else {
        runtime.path().join("floodgate/floodgate.sock")
    };
    assert!(
        !expected.exists(),
        "{} is served already (an agent on this machine?)",
        expected.display()
    );
    let state = tempfile::tempdir().unwrap();
    let rules = state.path().join("rules.toml");
    std::fs::write(&rules, floodgate_core::rules::EXAMPLE_RULES).unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            // SIGTERM: the agent removes its socket, leaving /run/floodgate as it was.
            floodgate_tests::signal(self.0.id(), 15);
            let _ = self.0.wait();
        }
    }
    let _agent = Kill(
        Command::new(floodgate_bin())
            .args(["agent", "--admin", "off", "--rules"])
            .arg(&rules)
            .env_remove("FLOODGATE_SOCKET")
            .env("XDG_RUNTIME_DIR", runtime.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually(
        "the agent serves its default socket",
        Duration::from_secs(10),
        || async { expected.exists().then_some(()) },
    )
    .await;
    // What the SDKs resolve with the same environment (no FLOODGATE_SOCKET; this test's own
    // XDG_RUNTIME_DIR is the agent's).
    std::env::remove_var("FLOODGATE_SOCKET");
    std::env::set_var("XDG_RUNTIME_DIR", runtime.path());
    assert_eq!(floodgate_sdk::default_socket_path(), expected);
    let client = Client::connect_default().await;
    let d = client.allow("user:u", "api-per-user", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Local));
    let h = client.health();
    assert!(h.connected);
    assert_eq!(h.path, expected);
    assert_eq!((h.failed_attempts, h.fail_policy_answers), (0, 0));
    // Its directory is the agent's alone to write: nobody can bind the path first.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(expected.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o022,
        0,
        "{} is {mode:o}",
        expected.parent().unwrap().display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_its_agent_says_so_in_health() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.sock");
    let client = Client::with_config(
        &missing,
        ClientConfig {
            reconnect_min: Duration::from_millis(5),
            reconnect_max: Duration::from_millis(20),
            ..Default::default()
        },
    )
    .await;
    for _ in 0..3 {
        let d = client.allow("user:u", "api-per-user", 1).await.unwrap();
        assert!(d.allowed, "fail open by default");
        assert!(!matches!(d.origin, Origin::Agent(_)));
    }
    let h = eventually("attempts are counted", Duration::from_secs(10), || async {
        let h = client.health();
        (h.failed_attempts >= 2).then_some(h)
    })
    .await;
    assert!(!h.connected);
    assert_eq!(h.path, missing);
    assert_eq!(h.fail_policy_answers, 3);
    assert!(h.last_error.unwrap().contains("No such file"));
}
