//! The exporter: spans from the tracer's queue, in batches of at most [`BATCH`] or every
//! [`INTERVAL`], as one OTLP `ExportTraceServiceRequest` (JSON or protobuf: `encode`) POSTed to
//! `<endpoint>/v1/traces`, gzip-compressed when configured (`Content-Encoding: gzip`).
//!
//! A POST the collector refuses for now (429, 502, 503, 504, as OTLP/HTTP names them) or that
//! cannot reach it is sent again, up to [`RETRIES`] times, after a backoff that doubles from
//! [`FIRST_BACKOFF`] with jitter, or after the collector's `Retry-After` (seconds) where it gives
//! one, never waiting more than [`MAX_BACKOFF`] at once. While it waits new spans queue in the
//! tracer's bounded queue (past it they are dropped and counted, as always); a shutdown ends the
//! wait. A batch refused for good (any other status), or still refused after its retries, is
//! logged (once per minute at most) and dropped and counted: the collector's outage never holds
//! spans, memory or requests back for long.

use std::time::Duration;

use tokio::sync::{mpsc, watch};

use super::span::SpanData;

/// Most spans in one POST.
pub const BATCH: usize = 512;

/// Longest a span waits for its batch.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Longest one POST may take.
pub const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// Most times one batch is sent again after a retryable failure.
pub const RETRIES: u32 = 3;

/// The wait before a batch's first retry, doubled for each next one (±25 % jitter).
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// The longest wait before one retry, whatever the collector's `Retry-After` asks.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The exporter, waiting to be run.
pub struct Exporter {
    rx: mpsc::Receiver<SpanData>,
    endpoint: String,
    service: String,
    headers: Vec<(String, String)>,
    timeout: Duration,
    gzip: bool,
    encoding: super::Encoding,
    resource: Vec<(String, String)>,
}

impl Exporter {
    pub(super) fn new(rx: mpsc::Receiver<SpanData>, endpoint: &str, config: &super::Config) -> Self {
        Exporter {
            rx,
            endpoint: endpoint.trim_end_matches('/').to_string(),
            service: config.service_name.clone(),
            headers: config.headers.clone(),
            timeout: config.timeout,
            gzip: config.gzip,
            encoding: config.encoding,
            resource: config.resource.clone(),
        }
    }
}

/// `body` gzip-compressed (flate2, the default level).
fn gzip(body: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut z =
        flate2::write::GzEncoder::new(Vec::with_capacity(body.len() / 4), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    z.write_all(body).expect("gzip into memory");
    z.finish().expect("gzip into memory")
}

/// What one POST came to.
enum Sent {
    Done,
    /// Refused for good (a status OTLP/HTTP does not retry).
    Refused(String),
    /// Refused for now, or the collector not reached; the wait it asked for, if it did.
    Retry(String, Option<Duration>),
}

async fn post(e: &Exporter, headers: &[(&str, String)], body: &[u8]) -> Sent {
    let sent = floodgate_rules_service::http::request(
        &e.endpoint,
        "POST",
        "/v1/traces",
        None,
        headers,
        Some(body),
        e.timeout,
    )
    .await;
    match sent {
        Ok(r) if (200..300).contains(&r.status) => Sent::Done,
        Ok(r) if matches!(r.status, 429 | 502 | 503 | 504) => {
            let after = r
                .header("retry-after")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            Sent::Retry(format!("HTTP {}", r.status), after)
        }
        Ok(r) => Sent::Refused(format!("HTTP {}", r.status)),
        Err(why) => Sent::Retry(why, None),
    }
}

/// The wait before retry `n` (0-based): the collector's ask, or the doubling backoff with ±25 %
/// jitter from `seed`; at most [`MAX_BACKOFF`].
fn backoff(n: u32, asked: Option<Duration>, seed: u64) -> Duration {
    let wait = asked.unwrap_or_else(|| {
        let base = FIRST_BACKOFF * 2u32.saturating_pow(n);
        // 75 % to 125 % of the base.
        base.mul_f64(0.75 + (seed % 1_000) as f64 / 2_000.0)
    });
    wait.min(MAX_BACKOFF)
}

/// Sends one batch, retrying what may succeed later; the failure that drops it, if any. No retry
/// once `stopping` (the agent is shutting down), and a shutdown ends a wait.
async fn export(
    e: &Exporter,
    headers: &[(&str, String)],
    body: &[u8],
    shutdown: &mut watch::Receiver<bool>,
    mut stopping: bool,
) -> Option<String> {
    let mut n = 0;
    loop {
        match post(e, headers, body).await {
            Sent::Done => return None,
            Sent::Refused(why) => return Some(why),
            Sent::Retry(why, _) if stopping || n >= RETRIES => return Some(why),
            Sent::Retry(why, asked) => {
                let seed =
                    std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), n);
                let wait = backoff(n, asked, seed);
                tracing::debug!(error = %why, retry_in_ms = wait.as_millis() as u64, "span export refused for now; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = floodgate_core::tasks::stopped(shutdown) => stopping = true,
                }
                n += 1;
            }
        }
    }
}

/// Sends spans until `shutdown`, then what is queued, and returns.
pub async fn run_exporter(mut e: Exporter, mut shutdown: watch::Receiver<bool>) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut last_warning: Option<std::time::Instant> = None;
    let mut stopping = false;
    loop {
        if !stopping {
            tokio::select! {
                n = e.rx.recv_many(&mut batch, BATCH) => if n == 0 { stopping = true },
                _ = floodgate_core::tasks::stopped(&mut shutdown) => stopping = true,
            }
            // A first span waits up to INTERVAL for company.
            let deadline = tokio::time::Instant::now() + INTERVAL;
            while !stopping && batch.len() < BATCH {
                let room = BATCH - batch.len();
                tokio::select! {
                    n = e.rx.recv_many(&mut batch, room) => if n == 0 { stopping = true },
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = floodgate_core::tasks::stopped(&mut shutdown) => stopping = true,
                }
            }
        }
        if stopping {
            while batch.len() < BATCH {
                match e.rx.try_recv() {
                    Ok(s) => batch.push(s),
                    Err(_) => break,
                }
            }
        }
        if !batch.is_empty() {
            let body = e.encoding.body(&e.service, &e.resource, &batch);
            let mut headers: Vec<(&str, String)> =
                e.headers.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            headers.push(("content-type", e.encoding.content_type().into()));
            let body = if e.gzip {
                headers.push(("content-encoding", "gzip".into()));
                gzip(&body)
            } else {
                body
            };
            let failure = export(&e, &headers, &body, &mut shutdown, stopping).await;
            if let Some(why) = failure {
                for _ in 0..batch.len() {
                    floodgate_core::metrics::trace_span_dropped();
                }
                if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(endpoint = %e.endpoint, error = %why, spans = batch.len(), "could not export spans; dropped");
                    last_warning = Some(std::time::Instant::now());
                }
            }
            batch.clear();
        }
        if stopping && e.rx.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_with_jitter_and_honours_retry_after_up_to_its_cap() {
        for seed in [0, 499, 999, 12_345] {
            let first = backoff(0, None, seed);
            assert!(
                first >= FIRST_BACKOFF.mul_f64(0.75) && first <= FIRST_BACKOFF.mul_f64(1.25),
                "{first:?}"
            );
            let third = backoff(2, None, seed);
            assert!(third >= (FIRST_BACKOFF * 4).mul_f64(0.75), "{third:?}");
        }
        assert_eq!(backoff(30, None, 7), MAX_BACKOFF);
        assert_eq!(
            backoff(0, Some(Duration::from_secs(2)), 7),
            Duration::from_secs(2)
        );
        assert_eq!(backoff(0, Some(Duration::from_secs(3_600)), 7), MAX_BACKOFF);
    }
}
