//! The open loop: checks sent at a fixed rate whatever the answers do, each latency measured from
//! the request's intended send time (no coordinated omission). Blocking threads, not tasks, so that
//! send times are not at the mercy of a 1 ms timer wheel.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_protocol::{decode, Body, DecodeError, Source};
use hdrhistogram::Histogram;

use crate::closed::LoopResult;
use crate::targets::check_frame;

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
    let measure_from = t0 + warmup;
    let end = measure_from + measure;
    let interval_ns = 1e9 / rate as f64;
    let mut handles = Vec::new();
    for c in 0..connections {
        let stream = UnixStream::connect(socket)?;
        let mut reader = stream.try_clone()?;
        let mut writer = stream;
        let sent = Arc::new(AtomicU64::new(0));
        let done_sending = Arc::new(AtomicU64::new(u64::MAX));
        // Request i of connection c is intended at t0 + (i × connections + c) × interval.
        let intended = move |i: u64| {
            t0 + Duration::from_nanos(((i * connections as u64 + c as u64) as f64 * interval_ns) as u64)
        };
        let (sent_w, done_w) = (sent.clone(), done_sending.clone());
        let sender = std::thread::spawn(move || -> anyhow::Result<()> {
            let mut i = 0u64;
            let mut out = Vec::with_capacity(4096);
            loop {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                let next = intended(i);
                if next > now {
                    let wait = next - now;
                    if wait > Duration::from_micros(200) {
                        std::thread::sleep(wait - Duration::from_micros(100));
                    } else {
                        std::thread::yield_now();
                    }
                    continue;
                }
                out.clear();
                while intended(i) <= now && intended(i) < end {
                    check_frame(
                        (i + 1) as u32,
                        (i as usize * connections + c) % keys.max(1),
                        &mut out,
                    );
                    i += 1;
                }
                writer.write_all(&out)?;
                sent_w.store(i, Ordering::Release);
            }
            done_w.store(i, Ordering::Release);
            Ok(())
        });
        let receiver = std::thread::spawn(move || -> anyhow::Result<(Histogram<u64>, u64, u64)> {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
            let mut buf = vec![0u8; 64 * 1024];
            let mut filled = 0;
            let mut received = 0u64;
            let mut measured = 0u64;
            let mut fallbacks = 0u64;
            reader.set_read_timeout(Some(Duration::from_millis(100)))?;
            let give_up = end + Duration::from_secs(5);
            loop {
                let total = done_sending.load(Ordering::Acquire);
                if received >= total || Instant::now() > give_up {
                    break;
                }
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
                            received += 1;
                            let i = u64::from(frame.request_id).saturating_sub(1);
                            let fell_back = matches!(&frame.body, Body::Decision(d) if d.combined.source == Source::Fallback);
                            let at = intended(i);
                            if at >= measure_from {
                                hist.saturating_record(now.saturating_duration_since(at).as_nanos() as u64);
                                measured += 1;
                                fallbacks += u64::from(fell_back);
                            }
                        }
                        Err(DecodeError::Incomplete) => break,
                        Err(e) => anyhow::bail!("bad frame: {e}"),
                    }
                }
                buf.copy_within(pos..filled, 0);
                filled -= pos;
            }
            let _ = sent.load(Ordering::Relaxed);
            Ok((hist, measured, fallbacks))
        });
        handles.push((sender, receiver));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let (mut checks, mut fallbacks) = (0, 0);
    for (s, r) in handles {
        s.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        let (h, n, f) = r.join().map_err(|_| anyhow::anyhow!("receiver panicked"))??;
        hist.add(&h)?;
        checks += n;
        fallbacks += f;
    }
    Ok(LoopResult {
        hist,
        checks,
        elapsed: measure,
        all_checks: checks,
        fallbacks,
    })
}
