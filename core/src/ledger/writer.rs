//! The engine's side of the ledger: each decision's items go on a bounded queue with a `try_send`
//! (never a wait, never I/O on the request path), and one thread of its own writes them to the file
//! as JSON lines. A full queue drops the decision and counts it; the file then says how many were
//! dropped, so the checker knows the ledger is incomplete instead of judging it as whole.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_protocol::{CompactString, Decision, ItemMode};

use super::record::{Header, Record};
use crate::guard::LedgerEntry;
use crate::rules::{Algorithm, Rule};
use crate::store::Planned;

/// Decisions the queue holds before new ones are dropped (counted): at 100K checks/s, 0.65 s of
/// them, ~100 B each while queued.
pub const QUEUE_CAP: usize = 65_536;

/// How often the writer writes the file out: what a killed agent can lose at most, besides what
/// was queued.
const IDLE_FLUSH: Duration = Duration::from_millis(50);

/// One decided item, as the request path hands it over (no formatting there).
struct Item {
    rule: Arc<Rule>,
    key: CompactString,
    cost: u64,
    mode: ItemMode,
    allowed: bool,
    source: &'static str,
    lease: Option<u64>,
}

enum Msg {
    Decided {
        recv: u64,
        done: u64,
        off: i64,
        n: u64,
        items: Vec<Item>,
    },
    /// Units given back of reservations, at `done` (the agent's clock).
    Returned {
        done: u64,
        off: i64,
        n: u64,
        entries: Vec<LedgerEntry>,
    },
    /// Flush and answer: the agent is stopping.
    Close(SyncSender<()>),
}

/// When and under what a decision was made, as the ledger records it.
#[derive(Debug, Clone, Copy)]
pub struct Decided {
    /// When the check's frame was read, Unix ms (the agent's clock).
    pub recv: u64,
    /// When it was decided.
    pub done: u64,
    /// How far the store's clock is ahead of the agent's, ms, as learned.
    pub off: i64,
    /// Live agents counted (the fallback's N).
    pub n: u64,
}

/// An open ledger: where the engine records every decision while it is on.
pub struct Ledger {
    tx: Mutex<Option<SyncSender<Msg>>>,
    /// Decisions dropped because the queue was full.
    dropped: Arc<AtomicU64>,
    /// Records written.
    written: Arc<AtomicU64>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("written", &self.written())
            .field("dropped", &self.dropped())
            .finish()
    }
}

impl Ledger {
    /// Creates (truncates) `path`, writes its header and starts the writer thread.
    pub fn create(path: &Path, agent: &str, shared: bool) -> std::io::Result<Self> {
        let mut file = std::io::BufWriter::with_capacity(256 * 1024, std::fs::File::create(path)?);
        let header = Header {
            ledger: 1,
            agent: agent.to_string(),
            store: if shared { "shared" } else { "memory" }.into(),
        };
        serde_json::to_writer(&mut file, &header)?;
        file.write_all(b"\n")?;
        file.flush()?;
        let (tx, rx) = sync_channel(QUEUE_CAP);
        let dropped = Arc::new(AtomicU64::new(0));
        let written = Arc::new(AtomicU64::new(0));
        let (d, w) = (dropped.clone(), written.clone());
        std::thread::Builder::new()
            .name("floodgate-ledger".into())
            .spawn(move || write_loop(rx, file, d, w))?;
        Ok(Ledger {
            tx: Mutex::new(Some(tx)),
            dropped,
            written,
        })
    }

    /// Queues a decision's items (the plan it decided and the decision, item by item), read at
    /// `recv` and decided at `done` (Unix ms, the agent's clock), the store's clock `off` ms ahead,
    /// `n` live agents counted.
    pub fn record(&self, plan: &[Planned], decision: &Decision, at: Decided) {
        let items = plan
            .iter()
            .zip(&decision.items)
            .map(|(p, d)| Item {
                rule: p.rule.clone(),
                key: p.key.clone(),
                cost: p.cost,
                mode: p.mode,
                allowed: d.verdict.allowed,
                source: d.verdict.source.as_str(),
                lease: p.lease.id(),
            })
            .collect();
        let Decided { recv, done, off, n } = at;
        self.send(Msg::Decided {
            recv,
            done,
            off,
            n,
            items,
        });
    }

    /// Queues units given back of reservations (a commit's unused units, an expiry's under
    /// `reservationExpiry = "release"`), each out of the window it names, at `at.done`.
    pub fn returned(&self, entries: Vec<LedgerEntry>, at: Decided) {
        if entries.is_empty() {
            return;
        }
        self.send(Msg::Returned {
            done: at.done,
            off: at.off,
            n: at.n,
            entries,
        });
    }

    fn send(&self, msg: Msg) {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        match tx.as_ref().map(|tx| tx.try_send(msg)) {
            Some(Ok(())) => {}
            Some(Err(TrySendError::Full(_))) | Some(Err(TrySendError::Disconnected(_))) | None => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Decisions dropped so far (the queue was full, or the ledger closed).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Records written so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Writes what is queued, a closing line and flushes, waiting at most `within`; decisions
    /// after this are dropped (counted).
    pub fn close(&self, within: Duration) {
        let Some(tx) = self.tx.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let (done_tx, done_rx) = sync_channel(1);
        // A full queue is written out first; the close waits behind it, within the bound.
        let deadline = std::time::Instant::now() + within;
        let mut msg = Msg::Close(done_tx);
        loop {
            match tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if std::time::Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return,
            }
        }
        let _ = done_rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
    }
}

fn write_loop(
    rx: Receiver<Msg>,
    mut file: std::io::BufWriter<std::fs::File>,
    dropped: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
) {
    let mut told_dropped = 0;
    let mut line = Vec::with_capacity(512);
    let mut flushed = std::time::Instant::now();
    loop {
        // Written out at least every IDLE_FLUSH, busy or not: a killed agent loses at most that
        // much (a 256 KiB buffer filled only by load held ~1,000 decisions).
        if flushed.elapsed() >= IDLE_FLUSH {
            note_dropped(&mut file, &dropped, &mut told_dropped);
            let _ = file.flush();
            flushed = std::time::Instant::now();
        }
        let msg = match rx.recv_timeout(IDLE_FLUSH) {
            Ok(msg) => msg,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => {
                close(&mut file, &dropped, &written);
                return;
            }
        };
        match msg {
            Msg::Decided {
                recv,
                done,
                off,
                n,
                items,
            } => {
                for it in items {
                    let record = Record {
                        recv,
                        done,
                        off,
                        rule: it.rule.id.clone(),
                        ver: it.rule.version,
                        alg: it.rule.algorithm,
                        window_ms: it.rule.window_ms(),
                        limit: it.rule.limit.get(),
                        burst: it.rule.burst.map_or(it.rule.limit.get(), |b| b.get()),
                        enforced: it.rule.enforced(),
                        key: it.key.to_string(),
                        cost: it.cost,
                        mode: it.mode.as_str().into(),
                        allowed: it.allowed,
                        source: it.source.into(),
                        n,
                        lease: it.lease,
                        period: match it.rule.algorithm {
                            Algorithm::Quota => {
                                let (start, end) = it.rule.quota_period(done);
                                Some([start, end])
                            }
                            Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {
                                None
                            }
                        },
                        from: None,
                    };
                    line.clear();
                    if serde_json::to_writer(&mut line, &record).is_ok() {
                        line.push(b'\n');
                        if file.write_all(&line).is_err() {
                            dropped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        written.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Msg::Returned {
                done,
                off,
                n,
                entries,
            } => {
                for e in entries {
                    let rule = &e.rule;
                    let (from, period) = match rule.algorithm {
                        Algorithm::SlidingWindow => (Some(e.window), None),
                        Algorithm::Quota => {
                            let (start, end) = rule.quota_period(e.window);
                            (Some(e.window), Some([start, end]))
                        }
                        Algorithm::TokenBucket | Algorithm::Concurrency => (None, None),
                    };
                    let record = Record {
                        recv: done,
                        done,
                        off,
                        rule: rule.id.clone(),
                        ver: rule.version,
                        alg: rule.algorithm,
                        window_ms: rule.window_ms(),
                        limit: rule.limit.get(),
                        burst: rule.burst.map_or(rule.limit.get(), |b| b.get()),
                        enforced: rule.enforced(),
                        key: e.key.to_string(),
                        cost: e.units,
                        mode: "return".into(),
                        allowed: true,
                        source: "redis".into(),
                        n,
                        lease: None,
                        period,
                        from,
                    };
                    line.clear();
                    if serde_json::to_writer(&mut line, &record).is_ok() {
                        line.push(b'\n');
                        if file.write_all(&line).is_err() {
                            dropped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        written.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Msg::Close(ack) => {
                close(&mut file, &dropped, &written);
                let _ = ack.send(());
                return;
            }
        }
    }
}

/// A line saying how many decisions were dropped so far, when that changed.
fn note_dropped(file: &mut impl Write, dropped: &AtomicU64, told: &mut u64) {
    let now = dropped.load(Ordering::Relaxed);
    if now != *told {
        *told = now;
        let _ = writeln!(file, "{{\"dropped\":{now}}}");
    }
}

/// The closing line: records written and decisions dropped in all.
fn close(file: &mut impl Write, dropped: &AtomicU64, written: &AtomicU64) {
    let _ = writeln!(
        file,
        "{{\"closed\":true,\"records\":{},\"dropped\":{}}}",
        written.load(Ordering::Relaxed),
        dropped.load(Ordering::Relaxed)
    );
    let _ = file.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Answer, Engine, EngineOptions, Store};
    use crate::ledger::{judge, LedgerFile, Options};
    use crate::rules::RuleSet;
    use crate::store::MemoryStore;
    use floodgate_protocol::{Check, Item};

    #[test]
    fn an_engine_records_every_item_it_decides_and_the_checker_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        let ledger = Arc::new(Ledger::create(&path, "test", false).unwrap());
        let rules =
            RuleSet::parse(r#"{"rules":[{"id":"r","dimension":"user","limit":3,"windowSeconds":60}]}"#)
                .unwrap();
        let options = EngineOptions {
            ledger: Some(ledger.clone()),
            ..Default::default()
        };
        let engine = Engine::with_guard(
            rules,
            Store::Memory(Arc::new(MemoryStore::default())),
            None,
            options,
        );
        let mut allowed = 0;
        for _ in 0..5 {
            let Answer::Ready(Ok(d)) = engine.check(Check::Items(vec![Item::new("user:1", "r", 1)])) else {
                panic!("the embedded store answers at once")
            };
            allowed += usize::from(d.combined.allowed);
        }
        assert_eq!(allowed, 3);
        ledger.close(Duration::from_secs(5));
        let file = LedgerFile::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(file.closed);
        assert_eq!(file.records.len(), 5);
        assert_eq!(file.records.iter().filter(|r| r.allowed).count(), 3);
        assert_eq!(
            (file.records[0].source.as_str(), file.records[0].limit),
            ("local", 3)
        );
        let j = judge(&[file], &Options::contract());
        assert!(j.breaches.is_empty(), "{j:?}");
        assert_eq!(j.rules[0].admitted, 3);
        // Closed: later decisions are dropped and counted, never block.
        engine.check(Check::Items(vec![Item::new("user:1", "r", 1)]));
        assert_eq!(ledger.dropped(), 1);
    }
}
