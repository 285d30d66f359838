//! Fault tests against real processes under load: Redis killed (kill -9), paused (SIGSTOP, slow not
//! dead), slowed by a proxy the test owns, restarted empty. Each asserts that no check errors out, no
//! call waits past its timeout plus a stated margin, the fallback engages at limit / N, service
//! resumes by itself, what the fallback admitted is written back, and nothing panics.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use floodgate_sdk::{Client, ClientConfig, Origin, Source};
use floodgate_tests::{
    agent_status, eventually, pause_process, resume_process, window_count, Agent, Proxy, RedisServer,
};

/// One sliding-window rule for the load (fail open) and one fail-closed login rule.
const RULES: &str = r#"{"rules":[
  {"id":"fleet","dimension":"user","limit":200,"windowSeconds":1},
  {"id":"login","dimension":"ip","limit":5,"windowSeconds":60,"failMode":"closed"}
]}"#;

/// The SDK timeout of the load: far above the agent's store timeout (20 ms here), so every answer in
/// these tests is the agent's own, and the bound a call must meet.
const CALL_TIMEOUT: Duration = Duration::from_millis(100);
/// What a call may take beyond its timeout on a loaded 2-core CI machine (scheduler wake-ups).
const MARGIN: Duration = Duration::from_millis(250);

fn agent(redis_url: &str) -> floodgate_tests::AgentBuilder {
    Agent::builder()
        .redis(redis_url)
        .rules(RULES)
        // A short store timeout and cool-down, and fast heartbeats, keep the test's phases short.
        .arg("--redis-timeout-ms")
        .arg("20")
        .arg("--breaker-cooldown-ms")
        .arg("300")
        .arg("--heartbeat-ms")
        .arg("100")
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Instant,
    took: Duration,
    allowed: bool,
    origin: Origin,
}

/// Clients hammering one key through both agents until stopped; every answer is recorded.
struct Load {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), floodgate_sdk::Error>>>,
}

impl Load {
    async fn start(sockets: &[&std::path::Path], per_agent: usize) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for socket in sockets {
            let client = client(socket).await;
            for _ in 0..per_agent {
                let (client, samples, stop) = (client.clone(), samples.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let at = Instant::now();
                        let d = client.allow("user:hot", "fleet", 1).await?;
                        samples.lock().unwrap().push(Sample {
                            at,
                            took: at.elapsed(),
                            allowed: d.allowed,
                            origin: d.origin,
                        });
                        // ~2,000 checks/s per task at most: offered load well over the limit.
                        tokio::time::sleep(Duration::from_micros(500)).await;
                    }
                    Ok(())
                }));
            }
        }
        Load { samples, stop, tasks }
    }

    /// Stops the load; asserts that no call errored and none took longer than its timeout + margin.
    async fn finish(self) -> Vec<Sample> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap().expect("no check errors out to the caller");
        }
        let samples = self.samples.lock().unwrap().clone();
        let slowest = samples.iter().map(|s| s.took).max().unwrap_or_default();
        assert!(
            slowest < CALL_TIMEOUT + MARGIN,
            "a call took {slowest:?}, past {CALL_TIMEOUT:?} + {MARGIN:?}"
        );
        samples
    }
}

async fn wait_live_agents(agent: &Agent, n: u64) {
    wait_live_agents_within(agent, n, Duration::from_secs(10)).await;
}

async fn wait_live_agents_within(agent: &Agent, n: u64, patience: Duration) {
    eventually(&format!("the agent counts {n} live agents"), patience, || async {
        (agent_status(agent).await["liveAgents"] == n).then_some(())
    })
    .await;
}

/// While Redis is away no answer comes from Redis, and the agents' fallback answers nearly all (or
/// their rejection cache, for a key Redis rejected just before it went away): an agent answer later
/// than the SDK's 100 ms timeout on a loaded 2-core machine becomes the SDK's own fail-open answer,
/// which is allowed here (that is the SDK doing its job) up to 5 %.
fn assert_fallback_answered(during: &[&Sample]) {
    assert!(
        during.iter().all(|s| s.origin != Origin::Agent(Source::Redis)),
        "no answer came from Redis while it was away"
    );
    let from_fallback = during
        .iter()
        .filter(|s| matches!(s.origin, Origin::Agent(Source::Fallback | Source::Cache)))
        .count();
    assert!(
        from_fallback * 100 >= during.len() * 95,
        "the agents' fallback answered {from_fallback} of {} checks",
        during.len()
    );
}

/// An SDK client with the load's timeout.
async fn client(socket: &std::path::Path) -> Client {
    Client::with_config(
        socket,
        ClientConfig {
            timeout: CALL_TIMEOUT,
            ..Default::default()
        },
    )
    .await
}

/// Waits until a check on `key` is answered by Redis again (the breaker closed, the store back).
async fn redis_answers(client: &Client, key: &str, rule: &str, what: &str) {
    eventually(what, Duration::from_secs(10), || {
        let client = client.clone();
        async move {
            let d = client.allow(key, rule, 1).await.ok()?;
            (d.origin == Origin::Agent(Source::Redis)).then_some(())
        }
    })
    .await;
}

fn no_panics(agents: &[&Agent]) {
    for a in agents {
        assert!(
            !a.log().contains("panicked"),
            "agent log shows a panic:\n{}",
            a.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_falls_back_to_limit_over_n_and_recovers() {
    let mut redis = RedisServer::start();
    let a = agent(&redis.url()).start().await;
    let b = agent(&redis.url()).start().await;
    wait_live_agents(&a, 2).await;
    wait_live_agents(&b, 2).await;

    let load = Load::start(&[a.socket(), b.socket()], 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // some traffic on Redis first
    redis.kill();
    let down_at = Instant::now();
    // The outage lasts 2 s of wall clock: there is no event to await, the point is traffic during it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let up_at = Instant::now();
    redis.restart();
    let client = client(a.socket()).await;
    redis_answers(&client, "user:other", "fleet", "answers come from Redis again").await;
    let recovered_in = up_at.elapsed();
    let samples = load.finish().await;

    // Skip the first 100 ms of the outage (in-flight calls, the breaker's first 5 failures).
    let during: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at > down_at + Duration::from_millis(100) && s.at < up_at)
        .collect();
    assert!(
        during.len() > 200,
        "load kept flowing during the outage ({} checks)",
        during.len()
    );
    assert_fallback_answered(&during);
    // Two agents, N = 2: each enforces 200 / 2 = 100 per 1 s window locally, so the fleet admits
    // ~200 per window. Over the ~1.9 s measured that is ~380; a sliding window may admit up to
    // 100 × (1 + elapsed share) per agent across an edge, so 2 × 100 × 3 = 600 bounds it, and the
    // fallback being engaged at all (not failing closed) means well over 100.
    let admitted = during.iter().filter(|s| s.allowed).count();
    assert!(
        (100..=600).contains(&admitted),
        "admitted {admitted} during a 1.9 s outage, limit 200/s over 2 agents"
    );
    assert!(
        during.iter().any(|s| !s.allowed),
        "the fallback limits, it does not just allow"
    );

    // Recovery: no operator action, breaker closed, the fallback's admissions written back.
    assert!(
        recovered_in < Duration::from_secs(5),
        "recovered in {recovered_in:?}"
    );
    for agent in [&a, &b] {
        eventually("the breaker closes", Duration::from_secs(10), || async {
            (agent_status(agent).await["breakers"][0]["state"] == "closed").then_some(())
        })
        .await;
    }
    // Agent a recovered while the load still ran: what its fallback admitted in the last two windows
    // (1 s each) was still current, and was written back.
    eventually(
        "agent a wrote back its fallback admissions",
        Duration::from_secs(10),
        || async {
            (agent_status(&a).await["fallback"]["writtenBackUnits"].as_u64() > Some(0)).then_some(())
        },
    )
    .await;
    no_panics(&[&a, &b]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_is_slow_not_dead_and_calls_stay_bounded() {
    let redis = RedisServer::start();
    let a = agent(&redis.url()).start().await;
    wait_live_agents(&a, 1).await;
    let load = Load::start(&[a.socket()], 4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = redis.pid().unwrap();
    pause_process(pid);
    let paused_at = Instant::now();
    eventually(
        "the breaker opens on timeouts",
        Duration::from_secs(5),
        || async { (agent_status(&a).await["breakers"][0]["state"] != "closed").then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await; // traffic while Redis is stopped
    resume_process(pid);
    let resumed_at = Instant::now();
    let client = client(a.socket()).await;
    redis_answers(
        &client,
        "user:x",
        "fleet",
        "answers come from Redis again after SIGCONT",
    )
    .await;
    let samples = load.finish().await; // asserts no error and no call past timeout + margin
    let during: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at > paused_at + Duration::from_millis(200) && s.at < resumed_at)
        .collect();
    assert!(!during.is_empty());
    assert_fallback_answered(&during);
    // With the breaker open, answers do not wait for the store timeout at all.
    let open_answers: Vec<Duration> = during.iter().map(|s| s.took).collect();
    let median = {
        let mut v = open_answers.clone();
        v.sort();
        v[v.len() / 2]
    };
    assert!(
        median < Duration::from_millis(20),
        "median answer {median:?} while the breaker is open"
    );
    no_panics(&[&a]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_injected_between_agent_and_redis_opens_the_breaker_and_recovers() {
    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port());
    let a = agent(&proxy.url()).start().await;
    let client = client(a.socket()).await;
    redis_answers(&client, "user:p", "fleet", "answers from Redis through the proxy").await;

    // 50 ms per answer against a 20 ms store timeout: every check times out, the breaker opens.
    proxy.set_delay(Duration::from_millis(50));
    for _ in 0..10 {
        let started = Instant::now();
        let d = client.allow("user:p", "fleet", 1).await.unwrap();
        assert_eq!(d.origin, Origin::Agent(Source::Fallback));
        assert!(started.elapsed() < CALL_TIMEOUT + MARGIN);
    }
    assert_ne!(agent_status(&a).await["breakers"][0]["state"], "closed");

    proxy.set_delay(Duration::ZERO);
    redis_answers(
        &client,
        "user:p",
        "fleet",
        "answers from Redis once the latency is gone",
    )
    .await;
    no_panics(&[&a]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_rules_reject_with_retry_after_while_redis_is_away() {
    let mut redis = RedisServer::start();
    let a = agent(&redis.url()).start().await;
    let client = client(a.socket()).await;
    eventually("login checks answered by Redis", Duration::from_secs(10), || {
        let client = client.clone();
        async move {
            let d = client.allow("ip:203.0.113.5", "login", 1).await.ok()?;
            (d.origin == Origin::Agent(Source::Redis) && d.allowed).then_some(())
        }
    })
    .await;
    redis.kill();
    for _ in 0..10 {
        let d = client.allow("ip:203.0.113.5", "login", 1).await.unwrap();
        assert!(
            !d.allowed,
            "a fail-closed rule rejects while its store is away: {d:?}"
        );
        assert_eq!(d.origin, Origin::Agent(Source::Fallback));
        assert!(
            d.retry_after_ms.unwrap() >= 1_000,
            "with a Retry-After of at least 1 s"
        );
    }
    // A fail-open rule in the same agent keeps admitting (locally).
    assert!(client.allow("user:1", "fleet", 1).await.unwrap().allowed);
    no_panics(&[&a]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_count_live_agents_and_the_last_count_survives_an_outage() {
    let mut redis = RedisServer::start();
    // 1 s heartbeats counting for 5 s: only an explicit leave can drop an agent within 2.5 s.
    let slow = |url: &str| {
        Agent::builder()
            .redis(url)
            .rules(RULES)
            .arg("--heartbeat-ms")
            .arg("1000")
    };
    let a = slow(&redis.url()).start().await;
    let mut b = slow(&redis.url()).start().await;
    let c = slow(&redis.url()).start().await;
    wait_live_agents(&a, 3).await;
    // A clean stop leaves the set at once (seen at the others' next heartbeat, ≤ 1 s).
    b.terminate().await;
    wait_live_agents_within(&a, 2, Duration::from_millis(2_500)).await;
    wait_live_agents_within(&c, 2, Duration::from_millis(2_500)).await;
    // While Redis is away the last known count stays in force.
    redis.kill();
    // Two missed heartbeats: time has to pass for them to be missed.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    assert_eq!(
        agent_status(&a).await["liveAgents"],
        2,
        "the last known count stays in force"
    );
    no_panics(&[&a, &c]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_fallback_admitted_is_written_back_to_redis() {
    const LONG: &str = r#"{"rules":[{"id":"hour","dimension":"user","limit":1000,"windowSeconds":3600}]}"#;
    let mut redis = RedisServer::start();
    let port = redis.port();
    let a = Agent::builder()
        .redis(&redis.url())
        .rules(LONG)
        .arg("--redis-timeout-ms")
        .arg("20")
        .arg("--breaker-cooldown-ms")
        .arg("200")
        .arg("--agents")
        .arg("1")
        .start()
        .await;
    let client = client(a.socket()).await;
    for _ in 0..10 {
        assert_eq!(
            client.allow("user:w", "hour", 1).await.unwrap().origin,
            Origin::Agent(Source::Redis)
        );
    }
    redis.kill();
    let mut local = 0;
    for _ in 0..30 {
        let d = client.allow("user:w", "hour", 1).await.unwrap();
        assert_eq!(d.origin, Origin::Agent(Source::Fallback));
        local += u64::from(d.allowed);
    }
    assert_eq!(
        local, 30,
        "the fallback admits within its own share (1,000 / 1 agent)"
    );
    redis.restart();
    assert_eq!(redis.port(), port);
    // The write-back: checks that timed out while Redis went away (at most the 5 before the breaker
    // opened) are not recorded, since a timed-out script may have run; everything else is.
    let written = eventually(
        "the breaker closes and the write-back is done",
        Duration::from_secs(10),
        || {
            let client = client.clone();
            let a = &a;
            async move {
                // Traffic is not needed to recover (the guard probes), but it does no harm.
                let _ = client.allow("user:other", "hour", 1).await;
                let s = agent_status(a).await;
                let done = s["breakers"][0]["state"] == "closed" && s["fallback"]["pendingWriteBack"] == 0;
                done.then(|| s["fallback"]["writtenBackUnits"].as_u64())
                    .flatten()
                    .filter(|w| *w > 0)
            }
        },
    )
    .await;
    let mut conn = redis.conn();
    let (c, _) = window_count(&mut conn, "hour", "user:w", 3_600_000);
    assert!(
        (25..=30).contains(&c),
        "the restarted Redis holds the outage's admissions: {c}"
    );
    assert!(
        written >= c,
        "status counts what was written back ({written} ≥ {c})"
    );
    // The limit now counts the outage: 1,000 − c − 1 left, not a fresh 1,000.
    let d = client.allow("user:w", "hour", 1).await.unwrap();
    assert_eq!(d.origin, Origin::Agent(Source::Redis));
    assert_eq!(d.remaining, 1_000 - c - 1);
    no_panics(&[&a]);
}
