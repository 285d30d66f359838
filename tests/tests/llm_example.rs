//! The README's LLM endpoint, in Rust (`llm`, examples/gateway/src/bin/llm.rs) and in Python
//! (examples/llm/app.py), against an agent on examples/llm/rules.toml, as the README's curl lines
//! use them: two requests in flight per API key at most, the third refused with Retry-After: 1; and
//! 10,000 tokens a minute, charged from each response's x-usage-tokens.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use floodgate_tests::{eventually, floodgate_bin, free_port, Agent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `llm` binary beside `floodgate`, built if missing.
fn llm_bin() -> PathBuf {
    let bin = floodgate_bin().with_file_name("llm");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .args(["build", "-p", "floodgate-gateway-example", "--bin", "llm"])
            .current_dir(repo())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok && bin.exists(),
            "cannot build the llm example at {}",
            bin.display()
        );
    }
    bin
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One POST /v1/chat: the status and the Retry-After header, if any.
async fn chat(addr: SocketAddr, key: &str, ms: u64, tokens: u64) -> (u16, Option<String>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {key}\r\nx-demo-ms: {ms}\r\n\
         x-demo-tokens: {tokens}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).to_lowercase();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let retry = text
        .lines()
        .find_map(|l| l.strip_prefix("retry-after:"))
        .map(|v| v.trim().to_string());
    (status, retry)
}

async fn the_readme_story(addr: SocketAddr) {
    eventually("the example answers", Duration::from_secs(20), || async {
        tokio::net::TcpStream::connect(addr).await.ok().map(|_| ())
    })
    .await;
    // Three at once for one key, each held 5 s: two in flight, the third refused.
    let calls: Vec<_> = (0..3)
        .map(|_| tokio::spawn(chat(addr, "k1", 5_000, 10)))
        .collect();
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await.unwrap());
    }
    let refused: Vec<_> = answers.iter().filter(|(s, _)| *s == 429).collect();
    assert_eq!(
        answers.iter().filter(|(s, _)| *s == 200).count(),
        2,
        "{answers:?}"
    );
    assert_eq!(refused.len(), 1, "{answers:?}");
    assert_eq!(refused[0].1.as_deref(), Some("1"));
    // Their units came back: one more passes.
    eventually("the slots are released", Duration::from_secs(10), || async {
        (chat(addr, "k1", 1, 1).await.0 == 200).then_some(())
    })
    .await;
    // 6,000 tokens twice: the key is then past its 10,000 a minute.
    assert_eq!(chat(addr, "k2", 1, 6_000).await.0, 200);
    eventually("the first charge lands", Duration::from_secs(10), || async {
        // Each passing request is charged 6,000 more; once past the budget, the key is refused.
        let (status, retry) = chat(addr, "k2", 1, 6_000).await;
        (status == 429).then_some(retry)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_example_in_rust() {
    let agent = Agent::builder()
        .rules(&std::fs::read_to_string(repo().join("examples/llm/rules.toml")).unwrap())
        .start()
        .await;
    let port = free_port();
    let _llm = Killed(
        Command::new(llm_bin())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--socket"])
            .arg(agent.socket())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    the_readme_story(SocketAddr::from(([127, 0, 0, 1], port))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_example_in_python() {
    let agent = Agent::builder()
        .rules(&std::fs::read_to_string(repo().join("examples/llm/rules.toml")).unwrap())
        .start()
        .await;
    let port = free_port();
    let _app = Killed(
        Command::new("python3")
            .arg(repo().join("examples/llm/app.py"))
            .env("PYTHONPATH", repo().join("sdk-python/src"))
            .env("PORT", port.to_string())
            .env("FLOODGATE_SOCKET", agent.socket())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    the_readme_story(SocketAddr::from(([127, 0, 0, 1], port))).await;
}
