//! The gateway Layer's figures, and the agent path with metrics and events on vs off (BENCHMARKS.md,
//! "the gateway Layer, and metrics and events on the agent path").
//!
//! - `middleware`: an axum handler served bare and the same handler behind the SDK's tower Layer
//!   (asking a real agent on its embedded store), both on loopback TCP in this process, driven in
//!   turn by the same keep-alive HTTP/1.1 clients (on a thread and runtime of their own); the added
//!   latency is the difference of their
//!   percentiles in the same run. Two baselines in the same run split it: the SDK's check alone
//!   (same attributes, same client, no HTTP) and the layered router called in-process (tower
//!   `oneshot`, no HTTP): the SDK check plus the Layer's own work.
//! - `observability`: two agents on one Redis, one with metrics and rejection events on (the
//!   defaults) and one with both off, driven in turn by the closed loop; the p99 ratio on/off, with
//!   the bench rule allowing every check; with a limit of 1 (nearly every check rejected: repeats
//!   answered by the rejection cache, which make no event); and with a limit of 1 and the rejection
//!   cache off, so that every rejection is decided by Redis and becomes an event (the worst case).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use floodgate_sdk::middleware::RateLimitLayer;
use floodgate_tests::{patient_client, Agent, RedisServer};
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::closed;
use crate::targets::Target;

/// One run of the middleware figure (µs).
#[derive(Debug, Clone, Serialize)]
pub struct MiddlewareRun {
    /// Bare handler p50.
    pub bare_p50_us: f64,
    /// Bare handler p99.
    pub bare_p99_us: f64,
    /// Behind the layer p50.
    pub layer_p50_us: f64,
    /// Behind the layer p99.
    pub layer_p99_us: f64,
    /// The SDK's own check (the same attributes, the same client) without HTTP, p50: the part of
    /// the added latency that is the agent round trip.
    pub sdk_p50_us: f64,
    /// The SDK's own check, p99.
    pub sdk_p99_us: f64,
    /// The layered router called in-process (tower `oneshot` from a task, no HTTP), p50: the SDK
    /// check plus the Layer's own work.
    pub inproc_p50_us: f64,
    /// The layered router called in-process, p99.
    pub inproc_p99_us: f64,
    /// Requests per second, bare.
    pub bare_rps: f64,
    /// Requests per second, behind the layer.
    pub layer_rps: f64,
}

/// One run of the metrics/events figure (µs).
#[derive(Debug, Clone, Serialize)]
pub struct ObservabilityRun {
    /// `allowing` (every check allowed) or `rejecting` (nearly every check rejected: an event each).
    pub scenario: String,
    /// Metrics and events on: p50, p99.
    pub on_p50_us: f64,
    /// p99 with both on.
    pub on_p99_us: f64,
    /// Both off: p50.
    pub off_p50_us: f64,
    /// p99 with both off.
    pub off_p99_us: f64,
    /// on p99 / off p99.
    pub p99_ratio: f64,
    /// Checks per second, on and off.
    pub on_rate: f64,
    /// Checks per second with both off.
    pub off_rate: f64,
    /// The agent's CPU per check (µs, from /proc: 10 ms ticks over the whole run), both on.
    pub on_cpu_us: f64,
    /// The agent's CPU per check with both off.
    pub off_cpu_us: f64,
}

pub(crate) fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1_000.0
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

const GATEWAY_RULES: &str = r#"{"rules":[{"id":"api","dimension":"user","match":{"endpoint":"/api/*"},"limit":1000000000000,"windowSeconds":60}]}"#;

async fn serve(app: Router) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await;
    });
    Ok(addr)
}

/// One keep-alive HTTP/1.1 request and its whole response (Content-Length bodies only).
/// Returns the status and whether the response carried `X-RateLimit-Limit`.
async fn get_once(stream: &mut TcpStream, buf: &mut Vec<u8>, user: usize) -> anyhow::Result<(u16, bool)> {
    let req = format!("GET /api/hello HTTP/1.1\r\nHost: bench\r\nX-User-Id: u{user}\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    buf.clear();
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end])?;
            let status: u16 = head.get(9..12).unwrap_or("0").parse()?;
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            let limited = head.lines().any(|l| {
                l.split_once(':')
                    .is_some_and(|(k, _)| k.eq_ignore_ascii_case("x-ratelimit-limit"))
            });
            while buf.len() < end + 4 + len {
                let mut chunk = [0u8; 4096];
                let n = stream.read(&mut chunk).await?;
                anyhow::ensure!(n > 0, "connection closed mid-body");
                buf.extend_from_slice(&chunk[..n]);
            }
            return Ok((status, limited));
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// `checked`: every response must carry the limiter's headers (the Layer really asked the agent and
/// a rule applied), or none may (the bare handler).
async fn drive(
    addr: SocketAddr,
    clients: usize,
    measure: Duration,
    checked: bool,
) -> anyhow::Result<(Histogram<u64>, f64)> {
    // The load comes from a thread and runtime of its own, as remote clients' would: on the
    // servers' runtime a client task and the bare handler's connection task hand each request back
    // and forth on one worker without a wake-up, which no real client gets, and which the layered
    // path (waiting on the agent, another process) cannot do, so the difference would overstate
    // the Layer.
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(drive_here(addr, clients, measure, checked))
    })
    .await?
}

async fn drive_here(
    addr: SocketAddr,
    clients: usize,
    measure: Duration,
    checked: bool,
) -> anyhow::Result<(Histogram<u64>, f64)> {
    let mut tasks = Vec::new();
    let warmup = measure / 4;
    for c in 0..clients {
        tasks.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut buf = Vec::with_capacity(8192);
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
            let start = Instant::now();
            let mut n = 0u64;
            let mut user = c * 7919;
            while start.elapsed() < warmup + measure {
                let t = Instant::now();
                let (status, limited) = get_once(&mut stream, &mut buf, user % 10_000).await?;
                anyhow::ensure!(status == 200, "status {status}");
                anyhow::ensure!(
                    limited == checked,
                    "X-RateLimit-Limit present: {limited}, expected {checked}"
                );
                user += 1;
                if start.elapsed() >= warmup {
                    hist.saturating_record(t.elapsed().as_nanos() as u64);
                    n += 1;
                }
            }
            anyhow::Ok((hist, n))
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut n = 0;
    for t in tasks {
        let (h, k) = t.await??;
        hist.add(&h)?;
        n += k;
    }
    Ok((hist, n as f64 / measure.as_secs_f64()))
}

/// `clients` tasks each making requests back to back for a quarter of `measure` (warm-up, not
/// recorded) and then `measure`: `request(user)` makes one for that user and returns how long it
/// took (its own setup not counted); client c starts at user c × 7919, one more each time.
pub(crate) async fn closed_clients<F, Fut>(
    clients: usize,
    measure: Duration,
    request: F,
) -> anyhow::Result<Histogram<u64>>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Duration>> + Send,
{
    let mut tasks = Vec::new();
    let warmup = measure / 4;
    for c in 0..clients {
        let request = request.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
            let start = Instant::now();
            let mut user = c * 7919;
            while start.elapsed() < warmup + measure {
                let took = request(user % 10_000).await?;
                user += 1;
                if start.elapsed() >= warmup {
                    hist.saturating_record(took.as_nanos() as u64);
                }
            }
            anyhow::Ok(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for t in tasks {
        hist.add(&t.await??)?;
    }
    Ok(hist)
}

/// The same checks the Layer makes (endpoint, user and IP attributes), from `clients` tasks on the
/// same SDK client, without HTTP.
async fn drive_sdk(
    client: &floodgate_sdk::Client,
    clients: usize,
    measure: Duration,
) -> anyhow::Result<Histogram<u64>> {
    let client = client.clone();
    closed_clients(clients, measure, move |user| {
        let client = client.clone();
        async move {
            let attributes = floodgate_sdk::Attributes {
                endpoint: Some("/api/hello".into()),
                user: Some(format!("u{user}")),
                ip: Some("127.0.0.1".into()),
                cost: 1,
                ..Default::default()
            };
            let t = Instant::now();
            let d = client.check_request(attributes).await?;
            let took = t.elapsed();
            anyhow::ensure!(
                d.allowed && matches!(d.origin, floodgate_sdk::Origin::Agent(_)),
                "unexpected decision {d:?}"
            );
            Ok(took)
        }
    })
    .await
}

/// The layered router called in-process from `clients` tasks (no HTTP, no peer address: the
/// user rule applies), each response checked for the limiter's headers.
async fn drive_inproc(app: Router, clients: usize, measure: Duration) -> anyhow::Result<Histogram<u64>> {
    use tower::ServiceExt;
    closed_clients(clients, measure, move |user| {
        let app = app.clone();
        async move {
            let req = axum::http::Request::builder()
                .uri("/api/hello")
                .header("x-user-id", format!("u{user}"))
                .body(axum::body::Body::empty())?;
            let t = Instant::now();
            let response = app.oneshot(req).await?;
            let took = t.elapsed();
            anyhow::ensure!(
                response.status() == 200 && response.headers().contains_key("x-ratelimit-limit"),
                "unexpected response {response:?}"
            );
            Ok(took)
        }
    })
    .await
}

/// The middleware's added latency: bare vs layered, alternating, `runs` times.
pub async fn middleware(runs: usize, clients: usize, seconds: f64) -> anyhow::Result<Vec<MiddlewareRun>> {
    let agent = Agent::builder().rules(GATEWAY_RULES).start().await;
    let client = patient_client(agent.socket()).await;
    let sdk = client.clone();
    let inproc = Router::new()
        .route("/api/hello", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(client.clone()).user_header("x-user-id"));
    let handler = || get(|| async { "hello" });
    let bare = serve(Router::new().route("/api/hello", handler())).await?;
    let layered = serve(
        Router::new()
            .route("/api/hello", handler())
            .layer(RateLimitLayer::new(client).user_header("x-user-id")),
    )
    .await?;
    let measure = Duration::from_secs_f64(seconds);
    let mut out = Vec::new();
    for run in 0..runs.max(1) {
        // Alternate which goes first, so drift in the machine's load falls on both.
        let ((b, b_rps), (l, l_rps)) = if run % 2 == 0 {
            let b = drive(bare, clients, measure, false).await?;
            (b, drive(layered, clients, measure, true).await?)
        } else {
            let l = drive(layered, clients, measure, true).await?;
            (drive(bare, clients, measure, false).await?, l)
        };
        let s = drive_sdk(&sdk, clients, measure).await?;
        let i = drive_inproc(inproc.clone(), clients, measure).await?;
        let r = MiddlewareRun {
            bare_p50_us: us(&b, 0.5),
            bare_p99_us: us(&b, 0.99),
            layer_p50_us: us(&l, 0.5),
            layer_p99_us: us(&l, 0.99),
            sdk_p50_us: us(&s, 0.5),
            sdk_p99_us: us(&s, 0.99),
            inproc_p50_us: us(&i, 0.5),
            inproc_p99_us: us(&i, 0.99),
            bare_rps: b_rps,
            layer_rps: l_rps,
        };
        println!(
            "  run {}: bare p50 {:.0} µs p99 {:.0} µs ({:.0}/s) · layer p50 {:.0} µs p99 {:.0} µs ({:.0}/s) · added p50 {:.0} µs p99 {:.0} µs · SDK check alone p50 {:.0} µs p99 {:.0} µs · Layer in-process p50 {:.0} µs p99 {:.0} µs",
            run + 1,
            r.bare_p50_us,
            r.bare_p99_us,
            r.bare_rps,
            r.layer_p50_us,
            r.layer_p99_us,
            r.layer_rps,
            r.layer_p50_us - r.bare_p50_us,
            r.layer_p99_us - r.bare_p99_us,
            r.sdk_p50_us,
            r.sdk_p99_us,
            r.inproc_p50_us,
            r.inproc_p99_us
        );
        out.push(r);
    }
    let m = |f: fn(&MiddlewareRun) -> f64| median(out.iter().map(f).collect());
    println!(
        "median of {} runs, {clients} clients: added p50 {:.0} µs, p99 {:.0} µs (bare p50 {:.0} / p99 {:.0}; layer p50 {:.0} / p99 {:.0}; SDK check alone p50 {:.0} / p99 {:.0}; Layer in-process p50 {:.0} / p99 {:.0}; added / SDK check: p50 {:.2}, p99 {:.2}; in-process / SDK check: p50 {:.2})",
        out.len(),
        m(|r| r.layer_p50_us - r.bare_p50_us),
        m(|r| r.layer_p99_us - r.bare_p99_us),
        m(|r| r.bare_p50_us),
        m(|r| r.bare_p99_us),
        m(|r| r.layer_p50_us),
        m(|r| r.layer_p99_us),
        m(|r| r.sdk_p50_us),
        m(|r| r.sdk_p99_us),
        m(|r| r.inproc_p50_us),
        m(|r| r.inproc_p99_us),
        m(|r| (r.layer_p50_us - r.bare_p50_us) / r.sdk_p50_us.max(0.001)),
        m(|r| (r.layer_p99_us - r.bare_p99_us) / r.sdk_p99_us.max(0.001)),
        m(|r| r.inproc_p50_us / r.sdk_p50_us.max(0.001))
    );
    Ok(out)
}

/// The agent path with metrics and events on vs off, alternating, `runs` times per scenario.
pub async fn observability(
    runs: usize,
    clients: usize,
    seconds: f64,
    keys: usize,
) -> anyhow::Result<Vec<ObservabilityRun>> {
    let measure = Duration::from_secs_f64(seconds);
    let mut out = Vec::new();
    let scenarios = [
        ("allowing", 1_000_000_000_000u64, true),
        ("rejecting-cached", 1, true),
        ("rejecting-uncached", 1, false),
    ];
    for (scenario, limit, cached) in scenarios {
        let redis = RedisServer::start();
        let rules = format!(
            r#"{{"rules":[{{"id":"bench","dimension":"user","limit":{limit},"windowSeconds":60}}]}}"#
        );
        let cache = if cached { "100000" } else { "0" };
        let on = Agent::builder()
            .redis(&redis.url())
            .shipped_timeout()
            .rules(&rules)
            .arg("--rejection-cache")
            .arg(cache)
            .start()
            .await;
        let off = Agent::builder()
            .redis(&redis.url())
            .shipped_timeout()
            .rules(&rules)
            .arg("--rejection-cache")
            .arg(cache)
            .arg("--metrics")
            .arg("false")
            .arg("--events")
            .arg("false")
            .start()
            .await;
        let (t_on, t_off) = (
            Target::Agent(on.socket().to_path_buf()),
            Target::Agent(off.socket().to_path_buf()),
        );
        let mut rows = Vec::new();
        for run in 0..runs.max(1) {
            // Alternate which goes first, so drift in the machine's load falls on both.
            let on_first = run % 2 == 0;
            let (a, b) = if on_first {
                (&t_on, &t_off)
            } else {
                (&t_off, &t_on)
            };
            let (pa, pb) = if on_first {
                (on.pid(), off.pid())
            } else {
                (off.pid(), on.pid())
            };
            let cpu = |pid: Option<u32>| pid.and_then(crate::cpu_ticks).unwrap_or(0);
            let before = cpu(pa);
            let ra = closed::run(a, clients, 1, keys, measure).await?;
            let ca = cpu(pa).saturating_sub(before);
            let before = cpu(pb);
            let rb = closed::run(b, clients, 1, keys, measure).await?;
            let cb = cpu(pb).saturating_sub(before);
            // Ticks of 10 ms over every check of the run (warm-up included) → µs per check.
            let per_check =
                |ticks: u64, r: &closed::LoopResult| ticks as f64 * 10_000.0 / r.all_checks.max(1) as f64;
            let (ca, cb) = (per_check(ca, &ra), per_check(cb, &rb));
            let (r_on, r_off, on_cpu, off_cpu) = if on_first {
                (ra, rb, ca, cb)
            } else {
                (rb, ra, cb, ca)
            };
            let row = ObservabilityRun {
                scenario: scenario.into(),
                on_p50_us: us(&r_on.hist, 0.5),
                on_p99_us: us(&r_on.hist, 0.99),
                off_p50_us: us(&r_off.hist, 0.5),
                off_p99_us: us(&r_off.hist, 0.99),
                p99_ratio: us(&r_on.hist, 0.99) / us(&r_off.hist, 0.99).max(0.001),
                on_rate: r_on.checks as f64 / r_on.elapsed.as_secs_f64(),
                off_rate: r_off.checks as f64 / r_off.elapsed.as_secs_f64(),
                on_cpu_us: on_cpu,
                off_cpu_us: off_cpu,
            };
            println!(
                "  {scenario} run {}: on p50 {:.0} µs p99 {:.0} µs ({:.0}/s, {:.2} µs CPU/check) · off p50 {:.0} µs p99 {:.0} µs ({:.0}/s, {:.2} µs CPU/check) · p99 on/off {:.3}",
                run + 1,
                row.on_p50_us,
                row.on_p99_us,
                row.on_rate,
                row.on_cpu_us,
                row.off_p50_us,
                row.off_p99_us,
                row.off_rate,
                row.off_cpu_us,
                row.p99_ratio
            );
            rows.push(row);
        }
        println!(
            "{scenario}: median p99 on/off {:.3} over {} runs",
            median(rows.iter().map(|r| r.p99_ratio).collect()),
            rows.len()
        );
        if limit == 1 {
            let (_, text) = floodgate_tests::http_get(on.admin_addr().await, "/metrics").await;
            let pick = |name: &str| {
                text.lines()
                    .find(|l| l.starts_with(name))
                    .and_then(|l| l.rsplit_once(' '))
                    .map(|(_, v)| v.to_string())
                    .unwrap_or_default()
            };
            println!(
                "  events: sent {} dropped {}",
                pick("floodgate_events_sent_total"),
                pick("floodgate_events_dropped_total")
            );
        }
        out.extend(rows);
    }
    Ok(out)
}
