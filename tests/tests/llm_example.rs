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

/// The two examples run one at a time: each holds requests open for seconds on a 2-core machine,
/// and each picks a free port that, released, the other could be handed too.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// One POST /v1/complete: the status, the `x-model` header and the body (its events).
async fn complete(addr: SocketAddr, key: &str, tokens: u32, max_tokens: u32) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/complete HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {key}\r\nx-demo-tokens: {tokens}\r\n\
         x-max-tokens: {max_tokens}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let lower = text.to_lowercase();
    let status = lower
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let model = lower
        .lines()
        .find_map(|l| l.strip_prefix("x-model:"))
        .map(|v| v.trim().to_string())
        .unwrap_or_default();
    (status, model, text)
}

/// The streaming endpoint: output reserved at max_tokens and the unused given back when each
/// stream ends; the large model three times a minute, then the small one (quota mode); a request
/// whose max_tokens the budget cannot hold, refused.
async fn the_streaming_story(addr: SocketAddr, socket: &std::path::Path) {
    // Clear of a minute's edge (the token rules are sliding windows of a minute, on the agent's
    // clock): the figures below are one window's.
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    if ms % 60_000 > 45_000 {
        tokio::time::sleep(Duration::from_millis(60_000 - ms % 60_000 + 100)).await;
    }
    let mut models = Vec::new();
    for _ in 0..4 {
        let (status, model, body) = complete(addr, "k3", 600, 1_000).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body.matches("\"tokens\":100").count(),
            6,
            "600 tokens in 6 events: {body}"
        );
        assert!(body.contains("data: [DONE]"), "{body}");
        models.push(model);
    }
    assert_eq!(
        models,
        ["large", "large", "large", "small"],
        "past 3, the small model answers"
    );
    let client = floodgate_tests::patient_client(socket).await;
    eventually(
        "every stream's unused tokens come back",
        Duration::from_secs(10),
        || async {
            let left = client
                .peek("apikey:k3", "llm-output-tokens", 0)
                .await
                .unwrap()
                .remaining;
            // 4 × 1,000 reserved, 4 × 600 used.
            (left == 40_000 - 2_400).then_some(())
        },
    )
    .await;
    let (status, _, body) = complete(addr, "k3", 10, 50_000).await;
    assert_eq!(status, 429, "max_tokens past the budget: {body}");
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
    let _one = ONE_AT_A_TIME.lock().await;
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
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    the_readme_story(addr).await;
    the_streaming_story(addr, agent.socket()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_example_in_python() {
    let _one = ONE_AT_A_TIME.lock().await;
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
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    the_readme_story(addr).await;
    the_streaming_story(addr, agent.socket()).await;
}
