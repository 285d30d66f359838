//! What the load generator talks to: the bare echo server, an agent, or Redis directly (bare EVALSHA).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use floodgate_core::store::Layout;
use floodgate_protocol::{decode, Body, Check, DecodeError, Frame, Item, Source};
use floodgate_redis::CHECK_LUA;
use floodgate_tests::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// A system under test.
#[derive(Debug, Clone)]
pub enum Target {
    /// The bare Unix-socket echo server: the floor any agent round trip stands on.
    Echo(PathBuf),
    /// A `floodgate agent`, spoken to in raw protocol frames (the same client code as the echo).
    Agent(PathBuf),
    /// Redis itself: EVALSHA of the agent's check script with the same keys and arguments.
    Evalsha(String),
    /// An agent's Envoy RateLimitService (`host:port`): ShouldRateLimit of domain `bench`, one
    /// `user` descriptor per check, over one HTTP/2 channel per connection (a tonic client).
    Grpc(String),
}

/// One client connection to a target.
pub enum Conn {
    /// Unix socket (echo or agent).
    Uds {
        stream: UnixStream,
        out: Vec<u8>,
        buf: Vec<u8>,
        next_id: u32,
    },
    /// Redis.
    Redis {
        conn: redis::aio::MultiplexedConnection,
        script: redis::Script,
    },
    /// One HTTP/2 channel to the agent's gRPC listener.
    Grpc(floodgate_agent::envoy::proto::RateLimitClient),
}

impl Target {
    /// Opens one client connection.
    pub async fn connect(&self) -> anyhow::Result<Conn> {
        Ok(match self {
            Target::Echo(p) | Target::Agent(p) => Conn::Uds {
                stream: UnixStream::connect(p)
                    .await
                    .with_context(|| format!("connect {}", p.display()))?,
                out: Vec::with_capacity(4096),
                buf: Vec::with_capacity(16 * 1024),
                next_id: 1,
            },
            Target::Grpc(addr) => Conn::Grpc(
                floodgate_agent::envoy::proto::RateLimitClient::connect(format!("http://{addr}")).await?,
            ),
            Target::Evalsha(url) => {
                let client = redis::Client::open(url.as_str())?;
                Conn::Redis {
                    conn: client.get_multiplexed_async_connection().await?,
                    script: redis::Script::new(CHECK_LUA),
                }
            }
        })
    }
}

/// The check frame for key number `k` (what the SDK sends for `allow("user:k", rule, 1)`).
pub fn check_frame(id: u32, k: usize, rule: &str, out: &mut Vec<u8>) {
    Frame::new(
        id,
        Body::Check(Check::Items(vec![Item::new(format!("user:{k}"), rule, 1)])),
    )
    .encode(out)
    .expect("a valid bench frame");
}

impl Conn {
    /// Sends `keys.len()` checks of the `bench` rule at once and waits for all their answers; returns
    /// how many of them the agent answered from its fail mode (source `fallback`: the store was late
    /// or away).
    pub async fn round_trip(&mut self, keys: &[usize]) -> anyhow::Result<u64> {
        self.round_trip_on("bench", keys).await
    }

    /// [`round_trip`](Self::round_trip) with checks of `rule` (bare EVALSHA always runs `bench`'s).
    pub async fn round_trip_on(&mut self, rule: &str, keys: &[usize]) -> anyhow::Result<u64> {
        match self {
            Conn::Uds {
                stream,
                out,
                buf,
                next_id,
            } => {
                out.clear();
                for &k in keys {
                    check_frame(*next_id, k, rule, out);
                    *next_id = next_id.wrapping_add(1).max(1);
                }
                stream.write_all(out).await?;
                let mut answered = 0;
                let mut fallbacks = 0;
                while answered < keys.len() {
                    let mut pos = 0;
                    loop {
                        match decode(&buf[pos..]) {
                            Ok((frame, used)) => {
                                pos += used;
                                answered += 1;
                                match frame.body {
                                    Body::Error(e) => {
                                        bail!("target answered an error: {}: {}", e.code, e.message)
                                    }
                                    Body::Decision(d) if d.combined.source == Source::Fallback => {
                                        fallbacks += 1
                                    }
                                    _ => {}
                                }
                            }
                            Err(DecodeError::Incomplete) => break,
                            Err(e) => bail!("bad frame from target: {e}"),
                        }
                    }
                    buf.drain(..pos);
                    if answered < keys.len() && stream.read_buf(buf).await? == 0 {
                        bail!("target closed the connection");
                    }
                }
                Ok(fallbacks)
            }
            Conn::Grpc(client) => {
                use floodgate_agent::envoy::proto::{Code, Entry, RateLimitDescriptor, RateLimitRequest};
                let calls = keys.iter().map(|&k| {
                    let mut client = client.clone();
                    let req = RateLimitRequest {
                        domain: "bench".into(),
                        descriptors: vec![RateLimitDescriptor {
                            entries: vec![Entry {
                                key: "user".into(),
                                value: k.to_string(),
                            }],
                            ..Default::default()
                        }],
                        hits_addend: 1,
                    };
                    async move { client.should_rate_limit(req).await }
                });
                for r in futures::future::join_all(calls).await {
                    let r = r?;
                    if r.overall_code != Code::Ok as i32 {
                        bail!("ShouldRateLimit over the limit or failed: {r:?}");
                    }
                }
                // Envoy's answer does not say where a verdict came from: the scenarios give Redis
                // a patient timeout instead.
                Ok(0)
            }
            Conn::Redis { conn, script } => {
                let calls = keys.iter().map(|&k| {
                    let mut conn = conn.clone();
                    let mut inv = script.prepare_invoke();
                    let key = format!("user:{k}");
                    let layout = Layout::default();
                    for w in floodgate_core::store::WINDOW_HASHES {
                        inv.key(format!(
                            "fg:{{{}}}:bench/{}{w}",
                            layout.tag(&key),
                            layout.bucket(&key)
                        ));
                    }
                    // algorithm, limit, window_ms, burst, cost, enforce, target window, field, last:
                    // as the agent sends them.
                    inv.arg(1)
                        .arg(1_000_000_000_000u64)
                        .arg(60_000)
                        .arg(1_000_000_000_000u64)
                        .arg(1)
                        .arg(1)
                        .arg(0)
                        .arg(key)
                        .arg(1);
                    async move { inv.invoke_async::<Vec<i64>>(&mut conn).await }
                });
                for r in futures::future::join_all(calls).await {
                    let v = r?;
                    if v.first() != Some(&1) {
                        bail!("EVALSHA denied or failed: {v:?}");
                    }
                }
                Ok(0)
            }
        }
    }
}

/// Redis INFO commandstats: calls and CPU µs per command.
#[derive(Debug, Clone, Default)]
pub struct CommandStats(HashMap<String, (u64, u64)>);

/// Redis work between two snapshots, excluding the INFO calls themselves.
///
/// Commandstats counts the commands a script runs too (TIME, HMGET, HSET, PEXPIREAT), and an
/// EVALSHA's µs include theirs: `evalsha` and `evalsha_usec` are the round trips and the Redis CPU
/// they cost; `calls` is every command counted, script-internal ones included.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct RedisDelta {
    /// Commands of every kind, script-internal ones included.
    pub calls: u64,
    /// EVALSHA calls (round trips from clients).
    pub evalsha: u64,
    /// Redis CPU µs spent in EVALSHA, script-internal commands included.
    pub evalsha_usec: u64,
    /// CPU the redis-server process used (user + system, 10 ms ticks, from /proc): its whole cost,
    /// network syscalls included, which `INFO commandstats` does not count.
    pub process_ticks: u64,
}

/// Reads INFO commandstats.
pub fn commandstats(redis: &RedisServer) -> anyhow::Result<CommandStats> {
    let mut conn = redis.conn();
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn)?;
    let mut map = HashMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let mut calls = 0;
        let mut usec = 0;
        for f in fields.split(',') {
            if let Some(v) = f.strip_prefix("calls=") {
                calls = v.parse().unwrap_or(0);
            } else if let Some(v) = f.strip_prefix("usec=") {
                usec = v.parse().unwrap_or(0);
            }
        }
        map.insert(name.to_string(), (calls, usec));
    }
    Ok(CommandStats(map))
}

impl CommandStats {
    /// Every command's (calls, µs) since the server started.
    pub fn entries(&self) -> impl Iterator<Item = (&String, &(u64, u64))> {
        self.0.iter()
    }

    /// What happened since `before`.
    pub fn since(&self, before: &CommandStats) -> RedisDelta {
        let mut d = RedisDelta::default();
        for (name, &(calls, usec)) in &self.0 {
            if name == "info" {
                continue;
            }
            let (c0, u0) = before.0.get(name).copied().unwrap_or((0, 0));
            d.calls += calls.saturating_sub(c0);
            if name == "evalsha" {
                d.evalsha += calls.saturating_sub(c0);
                d.evalsha_usec += usec.saturating_sub(u0);
            }
        }
        d
    }
}
