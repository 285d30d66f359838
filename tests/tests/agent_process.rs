//! The agent process itself: its socket (mode, stale file replaced, live one never stolen), its first
//! log lines (plain text off a terminal), its admin endpoints, and a clean SIGTERM.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use floodgate_tests::Agent;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn starts_on_the_embedded_default_and_says_so() {
    let mut agent = Agent::builder().start().await;
    let mode = std::fs::metadata(agent.socket()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "default socket mode");
    let log = agent.log();
    let first: Vec<&str> = log.lines().take(3).collect();
    assert!(
        first[0].contains("floodgate agent listening")
            && first[0].contains(&agent.socket().display().to_string()),
        "{log}"
    );
    assert!(first[1].contains("embedded in-memory store"), "{log}");
    assert!(
        first[2].contains("rules loaded") && first[2].contains("api-per-user"),
        "{log}"
    );

    let addr = agent.admin_addr().await;
    for (path, body) in [("/healthz", "ok"), ("/readyz", "ready")] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).await.unwrap();
        assert!(
            resp.starts_with("HTTP/1.1 200") && resp.contains(body),
            "{path}: {resp}"
        );
    }

    assert_eq!(agent.terminate().await, Some(0), "SIGTERM is a clean exit");
    assert!(!agent.socket().exists(), "the socket is removed on the way out");
}

/// Logs into a file, a pipe or the journal carry no ANSI colour codes, with no NO_COLOR set (the
/// harness sets none): before, the time, level, target and every field name came wrapped in escape
/// codes (`ESC[3msocket ESC[0m ESC[2m= ESC[0m/tmp/…`), so a search for `socket=` missed every line.
#[tokio::test]
async fn logs_off_a_terminal_are_plain_text() {
    let mut agent = Agent::builder().start().await;
    let log = agent.log();
    assert!(!log.contains('\x1b'), "the agent's log has escape codes: {log:?}");
    assert!(
        log.lines()
            .any(|l| l.contains("rules loaded") && l.contains(" count=")),
        "{log}"
    );
    assert_eq!(agent.terminate().await, Some(0));
    // The rules service logs the same way (its start reads `addr=` out of its log).
    let dir = tempfile::tempdir().unwrap();
    let mut rules =
        floodgate_tests::RulesServer::start(&format!("sqlite://{}", dir.path().join("r.db").display()), &[])
            .await;
    let log = rules.log();
    assert!(
        !log.contains('\x1b'),
        "the rules server's log has escape codes: {log:?}"
    );
    assert!(log.contains("rules service listening addr="), "{log}");
    rules.terminate().await;
}

#[tokio::test]
async fn a_stale_socket_is_replaced_and_a_live_one_is_not_stolen() {
    let mut first = Agent::builder().arg("--socket-mode").arg("0600").start().await;
    let socket = first.socket().to_path_buf();
    assert_eq!(
        std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // A second agent on a live socket refuses to start and leaves the first one serving.
    let mut second = Agent::builder().socket(&socket).spawn();
    assert_ne!(second.wait_exit().await, Some(0));
    assert!(
        second.log().contains("served by a live agent"),
        "{}",
        second.log()
    );
    assert!(
        tokio::net::UnixStream::connect(&socket).await.is_ok(),
        "the first agent still serves"
    );

    // A crash leaves the socket file behind; the next agent replaces it.
    first.kill();
    assert!(socket.exists());
    let third = Agent::builder().socket(&socket).start().await;
    assert!(
        third.log().contains("replacing a stale socket file"),
        "{}",
        third.log()
    );

    // A build that fails after binding the socket (its TCP address is taken) leaves no socket.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fresh = dir.path().join("fresh.sock");
    let mut fifth = Agent::builder()
        .socket(&fresh)
        .arg("--listen-tcp")
        .arg(&taken.local_addr().unwrap().to_string())
        .spawn();
    assert_ne!(fifth.wait_exit().await, Some(0));
    assert!(fifth.log().contains("cannot listen on TCP"), "{}", fifth.log());
    assert!(!fresh.exists(), "the failed build removed its socket file");

    // A path that is not a socket is never removed.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("precious");
    std::fs::write(&file, "data").unwrap();
    let mut fourth = Agent::builder().socket(&file).spawn();
    assert_ne!(fourth.wait_exit().await, Some(0));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "data");
}

#[tokio::test]
async fn a_redis_agent_is_not_ready_while_redis_is_away() {
    // Nothing listens on this port: the agent starts (and fails open) but reports not ready.
    let port = floodgate_tests::free_port();
    let agent = Agent::builder()
        .redis(&format!("redis://127.0.0.1:{port}"))
        .start()
        .await;
    let addr = agent.admin_addr().await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET /readyz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut resp = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut resp))
        .await
        .unwrap()
        .unwrap();
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
}
