//! The check path's own connection to a Redis node (redis/'s `store/node/`): the URL's database and a
//! Unix socket are honoured, replies it cannot use are store errors (the fail mode answers, nothing
//! panics), a Redis 5 gets AUTH without the user name, a Redis that accepts and refuses (maxclients)
//! is a failed connect, and a node that comes back is used again.

use std::time::Duration;

use floodgate_sdk::{Origin, Source};
use floodgate_tests::{eventually, patient_client, Agent, RedisServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str = r#"{"rules":[{"id":"r","dimension":"user","limit":1000,"windowSeconds":60}]}"#;

fn dbsize(conn: &mut redis::Connection, db: i64) -> u64 {
    let _: () = redis::cmd("SELECT").arg(db).query(conn).unwrap();
    redis::cmd("DBSIZE").query(conn).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_urls_database_and_a_unix_socket_are_used() {
    let dir = tempfile::tempdir().unwrap();
    let unix = dir.path().join("redis.sock");
    let redis = RedisServer::start_with(&["--unixsocket", unix.to_str().unwrap(), "--unixsocketperm", "700"]);
    // Database 3 over TCP, database 5 over the Unix socket: each agent's counters land in its own.
    for (url, db) in [
        (format!("{}/3", redis.url()), 3),
        (format!("redis+unix://{}?db=5", unix.display()), 5),
    ] {
        let (_agent, client) = agent_on(&url).await;
        for i in 0..3 {
            let d = client.allow("user:a", "r", 1).await.unwrap();
            assert_eq!(d.origin, Origin::Agent(Source::Redis), "{url}: {d:?}");
            assert_eq!(d.remaining, 1000 - 1 - i, "{url}: {d:?}");
        }
        let mut conn = redis.conn();
        let counters: Vec<String> = {
            let _: () = redis::cmd("SELECT").arg(db).query(&mut conn).unwrap();
            redis::cmd("KEYS").arg("fg:{*").query(&mut conn).unwrap()
        };
        assert!(
            counters.iter().any(|k| k.contains(":r/")),
            "{url}: the counters are in database {db}: {counters:?}"
        );
    }
    let mut conn = redis.conn();
    assert_eq!(dbsize(&mut conn, 0), 0, "nothing was written to database 0");
}

/// A fake Redis that answers every command it reads with `reply`.
async fn fake_redis(reply: &'static [u8]) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 65536];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(reply).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// A fake Redis's answer to a command's arguments: the reply, and whether to close after it.
type Answer = fn(&[Vec<u8>]) -> (Vec<u8>, bool);

/// A fake Redis that reads whole commands (arrays of bulk strings) and answers each with `answer`'s
/// reply, closing the connection after it when `answer` says so.
async fn scripted_redis(answer: Answer) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    while let Some((cmd, used)) = command(&buf) {
                        buf.drain(..used);
                        let (reply, close) = answer(&cmd);
                        if s.write_all(&reply).await.is_err() || close {
                            return;
                        }
                    }
                    let mut more = [0u8; 4096];
                    match s.read(&mut more).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&more[..n]),
                    }
                }
            });
        }
    });
    port
}

/// One whole command at the start of `buf` (the fake's side of RESP), with the bytes it took.
fn command(buf: &[u8]) -> Option<(Vec<Vec<u8>>, usize)> {
    fn line(buf: &[u8], at: &mut usize) -> Option<usize> {
        let end = buf[*at..].windows(2).position(|w| w == b"\r\n")? + *at;
        let n = std::str::from_utf8(&buf[*at + 1..end]).ok()?.parse().ok()?;
        *at = end + 2;
        Some(n)
    }
    let mut at = 0;
    let n = line(buf, &mut at)?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        let len = line(buf, &mut at)?;
        if buf.len() < at + len + 2 {
            return None;
        }
        args.push(buf[at..at + len].to_vec());
        at += len + 2;
    }
    Some((args, at))
}

/// The five figures of one allowed item, as check.lua answers them.
const ONE_ITEM_ALLOWED: &[u8] = b"*5\r\n:1\r\n:1000\r\n:999\r\n:1700000000000\r\n:0\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_5_gets_auth_without_the_user_name() {
    // Redis 5 knows AUTH <password> only; the agent's first AUTH names the URL's user, is refused as
    // Redis 5 refuses it, and the second, without the user, is accepted: checks are answered by
    // "Redis" (this fake, which answers only a signed-in connection's EVALSHA).
    let port = scripted_redis(|cmd| {
        let reply: &[u8] = match (cmd[0].to_ascii_uppercase().as_slice(), cmd.len()) {
            (b"AUTH", 3) => b"-ERR wrong number of arguments for 'auth' command\r\n",
            (b"AUTH", 2) if cmd[1] == b"s3cret" => b"+OK\r\n",
            (b"PING", _) => b"+PONG\r\n",
            // EVALSHA, the hash, the key count, a sliding window's two hashes, nine arguments.
            (b"EVALSHA", 14) => ONE_ITEM_ALLOWED,
            _ => b"-ERR not in this fake\r\n",
        };
        (reply.to_vec(), false)
    })
    .await;
    let (agent, client) = agent_on(&format!("redis://default:s3cret@127.0.0.1:{port}")).await;
    let d = client.allow("user:a", "r", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Redis), "{d:?}\n{}", agent.log());
    assert_eq!((d.limit, d.remaining), (1000, 999), "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_accepts_and_refuses_is_a_failed_connect() {
    // maxclients: Redis accepts, sends its error and closes. The sign-in's PING meets it, so the
    // connect fails (and is retried after a backoff) instead of every check opening a connection.
    let port = scripted_redis(|_| (b"-ERR max number of clients reached\r\n".to_vec(), true)).await;
    let (agent, client) = agent_on(&local(port)).await;
    for _ in 0..3 {
        let d = client.allow("user:a", "r", 1).await.unwrap();
        assert_eq!(d.origin, Origin::Agent(Source::Fallback), "{d:?}");
    }
    let log = agent.log();
    assert!(
        log.contains("Redis refused PING: ERR max number of clients reached"),
        "{log}"
    );
}

/// The URL of a Redis at `port` of loopback.
fn local(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

/// An agent (1 s store timeout) on the Redis at `url`, and a client of it.
async fn agent_on(url: &str) -> (Agent, floodgate_sdk::Client) {
    let agent = Agent::builder().redis(url).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    (agent, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_it_cannot_use_are_store_errors_and_the_fail_mode_answers() {
    for (reply, why) in [
        (&b"%1\r\n+a\r\n+b\r\n"[..], "an unreadable reply"),
        (b"*2\r\n:1\r\n:1\r\n", "script returned 2 values for 1 items"),
        (b"-ERR something broke\r\n", "ERR something broke"),
        (b":7\r\n", "no array of integers"),
    ] {
        let (agent, client) = agent_on(&local(fake_redis(reply).await)).await;
        for _ in 0..3 {
            let d = client.allow("user:a", "r", 1).await.unwrap();
            assert!(d.allowed, "fail open: {d:?}");
            assert_eq!(d.origin, Origin::Agent(Source::Fallback), "{why}: {d:?}");
        }
        let log = agent.log();
        assert!(log.contains(why), "the log says why ({why}):\n{log}");
        assert!(!log.contains("panicked"), "{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_was_never_up_is_used_once_it_is() {
    // The agent starts before its Redis: checks fail fast while connects are refused (a backoff of at
    // most 200 ms between attempts), then come from Redis once it listens.
    let port = floodgate_tests::free_port();
    let (agent, client) = agent_on(&local(port)).await;
    let d = client.allow("user:a", "r", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Fallback), "{d:?}");
    let _redis = RedisServer::start_on(port, &[]);
    eventually(
        "answers come from Redis once it listens",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            async move {
                let d = client.allow("user:a", "r", 1).await.ok()?;
                (d.origin == Origin::Agent(Source::Redis)).then_some(())
            }
        },
    )
    .await;
    assert!(!agent.log().contains("panicked"));
}
