//! The decision ledger and its checker against real processes: two agents on one `redis-server`,
//! each writing a ledger (`--ledger`), judged by `floodgate ledger check`. A sync sliding window
//! under concurrent load holds its limit in every key-window (exit 0); a Redis emptied mid-window
//! (the contract's "restarted empty" fault, whose loss it states) lets a key-window admit twice its
//! limit, and the checker says so (exit 1) from the ledgers alone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate_sdk::{Client, ClientConfig, Origin};
use floodgate_tests::{floodgate_bin, sleep_until_window_offset, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"api","dimension":"user","limit":20,"windowSeconds":1},
  {"id":"slow","dimension":"user","limit":20,"windowSeconds":10},
  {"id":"budget","dimension":"api_key","limit":20000,"algorithm":"quota","period":"year"}
]}"#;

/// A client that waits for the agent (2 s) rather than answer by its own fail policy: every
/// answer it gets is one the agent decided, and wrote down.
async fn client(agent: &Agent) -> Client {
    let config = ClientConfig {
        timeout: Duration::from_secs(2),
        ..Default::default()
    };
    Client::with_config(agent.socket(), config).await
}

async fn agent_with_ledger(redis: &RedisServer, ledger: &Path) -> Agent {
    Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--ledger")
        .arg(ledger.to_str().unwrap())
        .start()
        .await
}

/// `floodgate ledger check FILES…`: its exit code and what it printed.
fn check(files: &[PathBuf]) -> (i32, String) {
    let out = std::process::Command::new(floodgate_bin())
        .arg("ledger")
        .arg("check")
        .args(files)
        .output()
        .expect("floodgate ledger check runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_limit_under_concurrent_load_holds_in_every_key_window() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let files = [dir.path().join("a.jsonl"), dir.path().join("b.jsonl")];
    let mut agents = Vec::new();
    for f in &files {
        agents.push(agent_with_ledger(&redis, f).await);
    }
    // 8 clients per agent over 5 keys for ~2.5 windows: far more than 20 a window each.
    let mut tasks = Vec::new();
    for agent in &agents {
        let client = client(agent).await;
        for c in 0..8 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let (mut allowed, end) = (0u64, std::time::Instant::now() + Duration::from_millis(2_500));
                let mut i = c;
                while std::time::Instant::now() < end {
                    let key = format!("user:{}", i % 5);
                    let d = client.allow(&key, "api", 1).await.unwrap();
                    assert!(matches!(d.origin, Origin::Agent(_)), "{d:?}");
                    allowed += u64::from(d.allowed);
                    i += 1;
                }
                allowed
            }));
        }
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += t.await.unwrap();
    }
    for agent in &mut agents {
        assert_eq!(agent.terminate().await, Some(0));
    }
    assert!(allowed >= 5 * 20, "the load was admitted ({allowed} units)");
    let (code, out) = check(&files);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("every key-window within its bound"), "{out}");
    assert!(out.contains("ledgers: 2 agents"), "{out}");
    assert!(out.contains("0 decisions dropped"), "{out}");
    assert!(
        out.contains("rule api: ") && out.contains(&format!("{allowed} units admitted")),
        "the ledgers hold every admission the clients saw ({allowed}): {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_reservations_gave_back_is_judged_off_their_budget() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let files = [dir.path().join("a.jsonl"), dir.path().join("b.jsonl")];
    let mut agents = Vec::new();
    for f in &files {
        agents.push(agent_with_ledger(&redis, f).await);
    }
    let clients = [client(&agents[0]).await, client(&agents[1]).await];
    // 300 requests together, each reserving 200 of a budget of 20,000 and using 1 to 200 of it.
    let tasks: Vec<_> = (0..300u64)
        .map(|n| {
            let c = clients[n as usize % 2].clone();
            tokio::spawn(async move {
                let (_, r) = c.reserve("apikey:l", "budget", 200).await.unwrap();
                let Some(r) = r else { return 0 };
                tokio::task::yield_now().await;
                let used = (n * 37 % 200 + 1) as u32;
                c.commit(&r, &[used]).await.unwrap();
                u64::from(used)
            })
        })
        .collect();
    let mut spent = 0;
    for t in tasks {
        spent += t.await.unwrap();
    }
    for agent in &mut agents {
        assert_eq!(agent.terminate().await, Some(0));
    }
    assert!(spent > 0 && spent <= 20_000, "{spent}");
    let (code, out) = check(&files);
    assert_eq!(code, 0, "{out}");
    // Reserves counted, what their commits gave back taken off: the ledgers hold what was used.
    assert!(
        out.contains("rule budget: ") && out.contains(&format!("{spent} units admitted")),
        "the ledgers hold what the requests used ({spent}): {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_emptied_mid_window_is_a_breach_the_checker_finds() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let files = [dir.path().join("a.jsonl"), dir.path().join("b.jsonl")];
    let mut a = agent_with_ledger(&redis, &files[0]).await;
    let mut b = agent_with_ledger(&redis, &files[1]).await;
    let (ca, cb) = (client(&a).await, client(&b).await);
    // Early in a 10 s window (Redis's clock), so that both halves land in it.
    sleep_until_window_offset(&mut redis.conn(), 10_000, 200);
    for i in 0..20 {
        let client = if i % 2 == 0 { &ca } else { &cb };
        assert!(client.allow("user:x", "slow", 1).await.unwrap().allowed);
    }
    assert!(
        !ca.allow("user:x", "slow", 1).await.unwrap().allowed,
        "the limit holds"
    );
    // Redis loses its data (a restart without persistence): the window's count is gone.
    let _: () = redis::cmd("FLUSHALL").query(&mut redis.conn()).unwrap();
    let mut again = 0;
    for i in 0..20 {
        let client = if i % 2 == 0 { &ca } else { &cb };
        again += u64::from(client.allow("user:x", "slow", 1).await.unwrap().allowed);
    }
    assert!(again > 0, "the emptied Redis admits the key again");
    assert_eq!(a.terminate().await, Some(0));
    assert_eq!(b.terminate().await, Some(0));
    let (code, out) = check(&files);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("breach: rule slow key user:x") && out.contains(&format!("{} admitted", 20 + again)),
        "{out}"
    );
}

#[test]
fn a_ledger_that_cannot_be_read_is_not_judged() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "not a ledger\n").unwrap();
    let (code, out) = check(&[bad]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("not a ledger header"), "{out}");
}
