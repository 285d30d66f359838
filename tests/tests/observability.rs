//! Metrics at the admin port's `/metrics` and rejection events in a Redis Stream, from a real agent
//! on a real Redis: the counts the exposition shows are the checks that were made, every rejection
//! is either in the stream or counted as dropped, and `--metrics false` / `--events false` turn them
//! off.

use std::time::Duration;

use floodgate_sdk::{Origin, Source};
use floodgate_tests::{
    agent_status, eventually, http_get, patient_client, rejection_events, Agent, RedisServer,
};
use redis::Commands;

const RULES: &str = r#"{"rules":[{"id":"two","dimension":"user","limit":2,"windowSeconds":60}]}"#;

/// The value of the series whose line starts with `prefix` (name and labels), summed.
fn value(exposition: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let bare = series.split('{').next().unwrap_or("");
        if bare == name && labels.iter().all(|l| series.contains(l)) {
            *found.get_or_insert(0.0) += v.parse::<f64>().unwrap_or(f64::NAN);
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_checks_and_rejections_reach_the_stream() {
    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    for i in 0..5 {
        let d = client.allow("user:m", "two", 1).await.unwrap();
        assert_eq!(d.allowed, i < 2, "check {i}");
    }
    let admin = agent.admin_addr().await;
    let (status, text) = http_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    // Two allowed from Redis; three rejected (the first from Redis, then from the rejection cache).
    let allowed = value(
        &text,
        "floodgate_checks_total",
        &["rule=\"two\"", "decision=\"allowed\""],
    );
    let rejected = value(
        &text,
        "floodgate_checks_total",
        &["rule=\"two\"", "decision=\"rejected\""],
    );
    assert_eq!((allowed, rejected), (Some(2.0), Some(3.0)), "{text}");
    assert_eq!(
        value(
            &text,
            "floodgate_checks_total",
            &["decision=\"rejected\"", "source=\"cache\""]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(&text, "floodgate_check_duration_seconds_count", &[]),
        Some(5.0)
    );
    assert!(value(&text, "floodgate_redis_calls_total", &["shard=\"0\""]).unwrap() >= 3.0);
    assert_eq!(
        value(&text, "floodgate_redis_errors_total", &["shard=\"0\""]),
        Some(0.0)
    );
    assert_eq!(
        value(&text, "floodgate_breaker_state", &["shard=\"0\""]),
        Some(0.0)
    );
    assert_eq!(value(&text, "floodgate_fallback_active", &[]), Some(0.0));
    assert_eq!(value(&text, "floodgate_rejection_cache_entries", &[]), Some(1.0));
    assert!(
        text.contains("# TYPE floodgate_check_duration_seconds histogram"),
        "{text}"
    );

    // The rejection Redis decided is in the stream with its fields; the two repeats the rejection
    // cache answered are not (they are in floodgate_checks_total{source="cache"}).
    let mut conn = redis.conn();
    let entries = eventually("the rejection event", Duration::from_secs(10), || {
        let r = rejection_events(&mut conn);
        async move { (!r.is_empty()).then_some(r) }
    })
    .await;
    for e in &entries {
        assert_eq!((e["key"].as_str(), e["ruleId"].as_str()), ("user:m", "two"));
        assert!(e["ts"].parse::<u64>().unwrap() > 1_700_000_000_000);
        assert!(!e["agent"].is_empty());
        assert_eq!(e["mode"], "enforce");
        assert!(e["version"].parse::<u64>().is_ok());
    }
    let sent = eventually("the sent counter", Duration::from_secs(10), || async {
        let (_, text) = http_get(admin, "/metrics").await;
        value(&text, "floodgate_events_sent_total", &[]).filter(|v| *v >= 1.0)
    })
    .await;
    assert_eq!((sent, entries.len()), (1.0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_is_sent_or_counted_as_dropped() {
    // A one-event queue under a burst of rejections of 600 keys (3 checks each, limit 2): the writer
    // cannot keep up, so events are dropped, never waited for; sent + dropped must still be every
    // rejection the limiter made (repeats from the rejection cache make no event).
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--events-queue")
        .arg("1")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    let keys: Vec<String> = (0..600).map(|k| format!("user:burst{k}")).collect();
    let checks: Vec<_> = keys
        .iter()
        .flat_map(|k| [k, k, k])
        .map(|k| client.allow(k, "two", 1))
        .collect();
    // Rejections the limiter made (a check the SDK answered by its fail policy after its timeout,
    // on this loaded machine, or one the rejection cache repeated, made no event).
    let rejected = futures::future::join_all(checks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .filter(|d| !d.allowed && matches!(d.origin, Origin::Agent(s) if s != Source::Cache))
        .count() as f64;
    assert!(rejected > 300.0, "{rejected}");
    let admin = agent.admin_addr().await;
    let (sent, dropped) = eventually("every event accounted for", Duration::from_secs(10), || async {
        let (_, text) = http_get(admin, "/metrics").await;
        let sent = value(&text, "floodgate_events_sent_total", &[])?;
        let dropped = value(&text, "floodgate_events_dropped_total", &[])?;
        (sent + dropped == rejected).then_some((sent, dropped))
    })
    .await;
    let mut conn = redis.conn();
    let len: u64 = redis::cmd("XLEN")
        .arg("floodgate:rejections")
        .query(&mut conn)
        .unwrap();
    assert_eq!(len as f64, sent);
    println!("burst of {rejected} rejections: {sent} sent, {dropped} dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_events_can_be_turned_off() {
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .redis(&redis.url())
        .rules(RULES)
        .arg("--metrics")
        .arg("false")
        .arg("--events")
        .arg("false")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    for _ in 0..3 {
        client.allow("user:off", "two", 1).await.unwrap();
    }
    let (status, _) = http_get(agent.admin_addr().await, "/metrics").await;
    assert_eq!(status, 404);
    // The agent logs whether it writes events at start; off, it never says so.
    assert!(!agent.log().contains("rejection events to a Redis stream"));
    let mut conn = redis.conn();
    let exists: bool = conn.exists("floodgate:rejections").unwrap();
    assert!(!exists);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_admission_is_counted_once_across_agents() {
    // A batched rule of limit 1 on two agents: a key neither has learned yet is admitted once by
    // each (a never-learned counter admits one check until its first learn), so the fleet admits 2
    // against a limit of 1. The writes land one at a time in Redis: the second finds the count past
    // the limit, so the agents' counters add up to exactly 1.
    let rules =
        r#"{"rules":[{"id":"b","dimension":"user","limit":1,"windowSeconds":60,"execution":"batched"}]}"#;
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    // Both checks must fall in one 60 s window (Redis clock): not in the last 2 s of one.
    if floodgate_tests::redis_time_ms(&mut conn) % 60_000 > 58_000 {
        floodgate_tests::sleep_until_window_offset(&mut conn, 60_000, 100);
    }
    let a = Agent::builder().redis(&redis.url()).rules(rules).start().await;
    let b = Agent::builder().redis(&redis.url()).rules(rules).start().await;
    for agent in [&a, &b] {
        let client = patient_client(agent.socket()).await;
        assert!(client.allow("user:over", "b", 1).await.unwrap().allowed);
    }
    let admins = [a.admin_addr().await, b.admin_addr().await];
    let total = eventually("both writes counted", Duration::from_secs(10), || async move {
        let mut sum = 0.0;
        for admin in admins {
            let (_, text) = http_get(admin, "/metrics").await;
            sum += value(&text, "floodgate_over_admitted_total", &["rule=\"b\""])?;
        }
        // Both writes are in once Redis holds 2.
        (sum > 0.0).then_some(sum)
    })
    .await;
    assert_eq!(total, 1.0);
}

/// An agent on `redis` whose breaker opens after a few 20 ms timeouts and probes again after
/// 200 ms, with N pinned to `agents` (the fallback's share of a limit is limit / agents).
fn fallback_agent(redis: &RedisServer, rules: &str, agents: u64) -> floodgate_tests::AgentBuilder {
    Agent::builder()
        .redis(&redis.url())
        .rules(rules)
        .arg("--redis-timeout-ms")
        .arg("20")
        .arg("--breaker-cooldown-ms")
        .arg("200")
        .arg("--agents")
        .arg(&agents.to_string())
}

/// Checks `key` while Redis is stopped until the fallback rejects it; returns how many checks the
/// fallback admitted. Checks time out until the breaker opens, and then the fallback answers; the
/// ones that timed out are answered by the fallback too (they count in its share) but are not
/// written back, since their scripts may still run: queued on the agent's connection, they run when
/// Redis wakes, before the write-back sent on the same connection once the breaker closes, and take
/// the count up to the limit, never past it.
async fn fallback_share(client: &floodgate_sdk::Client, key: &str, rule: &str) -> u64 {
    let mut admitted = 0;
    for _ in 0..200 {
        let d = client.allow(key, rule, 1).await.unwrap();
        if d.origin == Origin::Agent(Source::Fallback) {
            if !d.allowed {
                break;
            }
            admitted += 1;
        }
    }
    admitted
}

/// Waits for the agent's breaker to close and its write-back to finish; returns the units it wrote.
async fn written_back(agent: &Agent) -> u64 {
    eventually(
        "the breaker closes and the write-back is done",
        Duration::from_secs(10),
        || async {
            let s = agent_status(agent).await;
            let done = s["breakers"][0]["state"] == "closed" && s["fallback"]["pendingWriteBack"] == 0;
            done.then(|| s["fallback"]["writtenBackUnits"].as_u64())
                .flatten()
                .filter(|w| *w > 0)
        },
    )
    .await
}

/// The agent's `floodgate_over_admitted_total` for `rule` and `source`.
async fn over_admitted(agent: &Agent, rule: &str, source: &str) -> Option<f64> {
    let (_, text) = http_get(agent.admin_addr().await, "/metrics").await;
    value(
        &text,
        "floodgate_over_admitted_total",
        &[&format!("rule=\"{rule}\""), &format!("source=\"{source}\"")],
    )
}

/// What the fallback admitted while Redis was away reaches Redis with the write-back; the units that
/// land past the limit are counted as over-admission (`source="fallback"`), and they are exactly
/// what Redis ends with above the limit: no check can take the count past it, only the write-back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_admission_is_learned_from_the_fallback_write_back() {
    // An hour's window, so the test's few seconds stay in one window (as in faults.rs).
    const TEN: &str = r#"{"rules":[{"id":"ten","dimension":"user","limit":10,"windowSeconds":3600}]}"#;
    let redis = RedisServer::start();
    let agent = fallback_agent(&redis, TEN, 1).start().await;
    let client = patient_client(agent.socket()).await;
    for _ in 0..6 {
        let d = client.allow("user:f", "ten", 1).await.unwrap();
        assert!(d.allowed);
        assert_eq!(d.origin, Origin::Agent(Source::Redis));
    }
    // SIGSTOP, not a kill: Redis keeps the 6 it counted, and answers again on SIGCONT. The fallback
    // admits its own share (10 / 1 agent), knowing nothing of the 6.
    let pid = redis.pid().unwrap();
    floodgate_tests::pause_process(pid);
    assert_eq!(fallback_share(&client, "user:f", "ten").await, 10);
    floodgate_tests::resume_process(pid);
    let written = written_back(&agent).await;
    let mut conn = redis.conn();
    let (count, _) = floodgate_tests::window_count(&mut conn, "ten", "user:f", 3_600_000);
    assert!(
        count > 10,
        "Redis holds the 6, what the timed-out checks took (up to the limit) and the {written} written back: {count}"
    );
    // So the count ends above 10 by exactly what the write-back's adds report.
    assert_eq!(
        over_admitted(&agent, "ten", "fallback").await,
        Some((count - 10) as f64)
    );
    assert!(count - 10 <= written, "only written-back units can be over");
    assert_eq!(
        over_admitted(&agent, "ten", "flush").await,
        Some(0.0),
        "a sync rule has no flushes"
    );
}

/// Two agents' write-backs after one outage: each reports only its own units past the limit, so
/// the sum over agents is exactly what Redis ends with above it, although the first write lands
/// partly under the limit and partly over (the cap at the write's own units is what keeps the two
/// from counting the same units).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_over_admission_sums_exactly_across_agents() {
    // Limit 40, pinned N = 2: each fallback's share is 20. 30 are counted in Redis first, so the
    // checks that time out while Redis is stopped (a handful per agent, answered by the fallback but
    // not written back) can take Redis only up to 40 when it wakes, and each agent still records
    // most of its 20: the count ends well above 40, reached by two writes.
    const FORTY: &str = r#"{"rules":[{"id":"forty","dimension":"user","limit":40,"windowSeconds":3600}]}"#;
    let redis = RedisServer::start();
    let agents = [
        fallback_agent(&redis, FORTY, 2).start().await,
        fallback_agent(&redis, FORTY, 2).start().await,
    ];
    let mut clients = Vec::new();
    for a in &agents {
        clients.push(patient_client(a.socket()).await);
    }
    for _ in 0..30 {
        let d = clients[0].allow("user:g", "forty", 1).await.unwrap();
        assert!(d.allowed);
        assert_eq!(d.origin, Origin::Agent(Source::Redis));
    }
    let pid = redis.pid().unwrap();
    floodgate_tests::pause_process(pid);
    for client in &clients {
        assert_eq!(
            fallback_share(client, "user:g", "forty").await,
            20,
            "each fallback's share (40 / 2 agents)"
        );
    }
    floodgate_tests::resume_process(pid);
    let mut written = 0;
    for a in &agents {
        written += written_back(a).await;
    }
    let mut conn = redis.conn();
    let (count, _) = floodgate_tests::window_count(&mut conn, "forty", "user:g", 3_600_000);
    assert!(count > 40, "{count} (written back: {written})");
    let mut over = 0.0;
    for a in &agents {
        over += over_admitted(a, "forty", "fallback").await.unwrap();
    }
    assert_eq!(over, (count - 40) as f64, "count {count}, written back {written}");
}

/// A charge past the limit is never a rejection: counted as allowed, and no rejection event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_past_the_limit_is_not_counted_as_a_rejection() {
    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    let d = client.charge("user:c", "two", 5).await.unwrap();
    assert!(
        d.allowed && !d.items[0].verdict.allowed,
        "past the limit, never a rejection: {d:?}"
    );
    let peek = client.peek("user:c", "two", 1).await.unwrap();
    assert!(!peek.allowed, "a peek says so");
    let admin = agent.admin_addr().await;
    let (_, text) = http_get(admin, "/metrics").await;
    assert_eq!(
        value(
            &text,
            "floodgate_checks_total",
            &["rule=\"two\"", "decision=\"allowed\""]
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "floodgate_checks_total",
            &["rule=\"two\"", "decision=\"rejected\""]
        ),
        Some(1.0),
        "only the peek's no: {text}"
    );
    // A real rejection after them: once its event is in the stream, theirs would be too.
    for _ in 0..3 {
        client.allow("user:r", "two", 1).await.unwrap();
    }
    let mut conn = redis.conn();
    let events = floodgate_tests::eventually(
        "the rejection's event",
        std::time::Duration::from_secs(10),
        || {
            let e = floodgate_tests::rejection_events(&mut conn);
            async move { (!e.is_empty()).then_some(e) }
        },
    )
    .await;
    assert!(
        events
            .iter()
            .all(|e| e.get("key").map(String::as_str) == Some("user:r")),
        "no rejection event for a charge or a peek: {events:?}"
    );
}
