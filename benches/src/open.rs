//! The open loop: checks sent at a fixed rate whatever the answers do, each latency measured from
//! the request's intended send time (no coordinated omission). Blocking threads, not tasks, so that
//! send times are not at the mercy of a 1 ms timer wheel; the senders sleep between sends rather than
//! spin, so that they do not take the cores from what they measure (a late send still counts: latency
//! is measured from the intended time).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use floodgate_protocol::{decode, Body, DecodeError, Source};
use hdrhistogram::Histogram;

use crate::closed::LoopResult;
use crate::targets::check_frame;

/// One answered request.
#[derive(Clone, Copy, Debug)]
pub struct Answer {
    /// Intended send time, from the loop's start.
    pub at: Duration,
    /// From the intended send time to the answer.
    pub latency: Duration,
    /// Where the agent's decision came from (None for an error or a non-agent answer).
    pub source: Option<Source>,
    /// Whether the check was allowed.
    pub allowed: bool,
}

/// Drives one connection: request i is intended at `t0 + offset + i / rate` and checks key `key(i)`;
/// sending stops at `t0 + end`. Returns every answer (waiting up to 5 s after the end for the last).
pub fn drive(
    socket: &Path,
    rate: f64,
    offset: Duration,
    t0: Instant,
    end: Duration,
    key: impl Fn(u64) -> usize + Send + 'static,
) -> anyhow::Result<JoinHandle<anyhow::Result<Vec<Answer>>>> {
    let stream = UnixStream::connect(socket)?;
    let mut reader = stream.try_clone()?;
    let mut writer = stream;
    let interval = 1e9 / rate;
    let intended = move |i: u64| offset + Duration::from_nanos((i as f64 * interval) as u64);
    let total = ((end.saturating_sub(offset)).as_secs_f64() * rate).ceil() as u64;
    Ok(std::thread::spawn(move || {
        let sender = std::thread::spawn(move || -> anyhow::Result<()> {
            let mut i = 0u64;
            let mut out = Vec::with_capacity(4096);
            while i < total {
                let now = Instant::now();
                let next = t0 + intended(i);
                if next > now {
                    std::thread::sleep(next - now);
                    continue;
                }
                out.clear();
                while i < total && t0 + intended(i) <= now {
                    check_frame((i + 1) as u32, key(i), "bench", &mut out);
                    i += 1;
                }
                writer.write_all(&out)?;
            }
            Ok(())
        });
        let mut answers = Vec::with_capacity(total as usize);
        let mut buf = vec![0u8; 64 * 1024];
        let mut filled = 0;
        reader.set_read_timeout(Some(Duration::from_millis(100)))?;
        let give_up = t0 + end + Duration::from_secs(5);
        while (answers.len() as u64) < total && Instant::now() < give_up {
            match reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(e.into()),
            }
            let now = Instant::now();
            let mut pos = 0;
            loop {
                match decode(&buf[pos..filled]) {
                    Ok((frame, used)) => {
                        pos += used;
                        let at = intended(u64::from(frame.request_id).saturating_sub(1));
                        let (source, allowed) = match &frame.body {
                            Body::Decision(d) => (Some(d.combined.source), d.combined.allowed),
                            _ => (None, false),
                        };
                        answers.push(Answer {
                            at,
                            latency: now.saturating_duration_since(t0 + at),
                            source,
                            allowed,
                        });
                    }
                    Err(DecodeError::Incomplete) => break,
                    Err(e) => anyhow::bail!("bad frame: {e}"),
                }
            }
            buf.copy_within(pos..filled, 0);
            filled -= pos;
        }
        sender.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        Ok(answers)
    }))
}

/// Sends `rate` checks/s spread over `connections` for a warm-up (a quarter of `measure`) and then
/// `measure`; records answers to requests intended during `measure`.
pub fn run(
    socket: &Path,
    rate: u64,
    connections: usize,
    keys: usize,
    measure: Duration,
) -> anyhow::Result<LoopResult> {
    let connections = connections.max(1);
    let warmup = measure / 4;
    let t0 = Instant::now() + Duration::from_millis(20);
    let per_connection = rate as f64 / connections as f64;
    let mut handles = Vec::new();
    for c in 0..connections {
        // Connections interleave: connection c starts c / rate after the others.
        let offset = Duration::from_nanos((c as f64 * 1e9 / rate as f64) as u64);
        let key = move |i: u64| (i as usize * connections + c) % keys.max(1);
        handles.push(drive(socket, per_connection, offset, t0, warmup + measure, key)?);
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut fallback_hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let (mut checks, mut fallbacks, mut all_checks) = (0, 0, 0);
    for h in handles {
        let answers = h.join().map_err(|_| anyhow::anyhow!("load thread panicked"))??;
        all_checks += answers.len() as u64;
        for a in answers.into_iter().filter(|a| a.at >= warmup) {
            hist.saturating_record(a.latency.as_nanos() as u64);
            checks += 1;
            if a.source == Some(Source::Fallback) {
                fallbacks += 1;
                fallback_hist.saturating_record(a.latency.as_nanos() as u64);
            }
        }
    }
    Ok(LoopResult {
        hist,
        checks,
        elapsed: measure,
        all_checks,
        fallbacks,
        fallback_hist,
    })
}
