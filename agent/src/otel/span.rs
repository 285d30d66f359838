//! A span from its start to its end: ids, the sampling decision, the attributes, and the handing
//! over to the exporter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use floodgate_protocol::TraceContext;
use tokio::sync::mpsc;

use super::export::Exporter;

/// Spans the exporter's queue holds before new ones are dropped.
pub const QUEUE: usize = 16_384;

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
}

/// A finished span, as the exporter sends it.
#[derive(Debug, Clone)]
pub struct SpanData {
    /// The trace.
    pub trace_id: [u8; 16],
    /// This span.
    pub span_id: [u8; 8],
    /// The caller's span, if it sent a context.
    pub parent: Option<[u8; 8]>,
    /// Its name.
    pub name: String,
    /// Unix ns at its start and end.
    pub start_ns: u64,
    /// Unix ns at its end.
    pub end_ns: u64,
    /// Its attributes.
    pub attributes: Vec<(&'static str, Attr)>,
    /// Whether it ended in an error.
    pub error: bool,
    /// Spans it is linked to (a store call: the checks it served).
    pub links: Vec<([u8; 16], [u8; 8])>,
    /// Whether this process answered it (a check, an API request) or asked it (a Redis call).
    pub kind: SpanKind,
}

/// OTLP's span kinds this process records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// A request this process answered.
    Server,
    /// A request this process sent (a Redis call).
    Client,
}

/// The process's tracer: the sampler and the queue to the exporter.
pub struct Tracer {
    tx: mpsc::Sender<SpanData>,
    /// A root trace is recorded when its id's low 64 bits are below this.
    threshold: u64,
    /// Id generation: a per-process random key and a counter (splitmix64 of their sum).
    key: u64,
    counter: AtomicU64,
}

pub(super) fn pair(endpoint: &str, config: &super::Config) -> Result<(Tracer, Exporter), String> {
    let (tx, rx) = mpsc::channel(QUEUE);
    let ratio = config.sample_ratio.clamp(0.0, 1.0);
    let threshold = if ratio >= 1.0 {
        u64::MAX
    } else {
        (ratio * u64::MAX as f64) as u64
    };
    let key =
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), SystemTime::now());
    let tracer = Tracer {
        tx,
        threshold,
        key,
        counter: AtomicU64::new(0),
    };
    Ok((tracer, Exporter::new(rx, endpoint, config)?))
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(super) fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Tracer {
    pub(super) fn next_id(&self) -> u64 {
        loop {
            let id = splitmix64(
                self.key
                    .wrapping_add(self.counter.fetch_add(1, Ordering::Relaxed)),
            );
            if id != 0 {
                return id;
            }
        }
    }

    /// Starts a span named `name` under `parent`, or None when it is not sampled: a parent's own
    /// flag decides; a new trace is recorded at the sampling ratio.
    pub fn start(&self, parent: Option<TraceContext>, name: &'static str) -> Option<SpanStart> {
        let (trace_id, parent) = match parent {
            Some(p) if p.sampled() => (p.trace_id, Some(p.span_id)),
            Some(_) => return None,
            None => {
                let low = self.next_id();
                if low >= self.threshold && self.threshold != u64::MAX {
                    return None;
                }
                let mut t = [0u8; 16];
                t[..8].copy_from_slice(&self.next_id().to_be_bytes());
                t[8..].copy_from_slice(&low.to_be_bytes());
                (t, None)
            }
        };
        Some(SpanStart {
            trace_id,
            span_id: self.next_id().to_be_bytes(),
            parent,
            name,
            start_ns: unix_ns(),
            started: Instant::now(),
        })
    }

    pub(super) fn send(&self, span: SpanData) {
        if self.tx.try_send(span).is_err() {
            floodgate_core::metrics::trace_span_dropped();
        }
    }
}

/// A recorded span, started.
#[derive(Debug)]
pub struct SpanStart {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    name: &'static str,
    start_ns: u64,
    started: Instant,
}

impl SpanStart {
    /// The context a callee of this span would carry.
    pub fn context(&self) -> TraceContext {
        TraceContext {
            trace_id: self.trace_id,
            span_id: self.span_id,
            flags: 1,
        }
    }

    /// Time since the start.
    pub fn elapsed(&self) -> std::time::Duration {
        self.started.elapsed()
    }

    /// Ends the span (its name replaced by `name` if given) and hands it to the exporter.
    pub fn end(self, name: Option<String>, attributes: Vec<(&'static str, Attr)>, error: bool) {
        let Some(tracer) = super::tracer() else {
            return;
        };
        let end_ns = self.start_ns + self.started.elapsed().as_nanos() as u64;
        tracer.send(SpanData {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent: self.parent,
            name: name.unwrap_or_else(|| self.name.to_string()),
            start_ns: self.start_ns,
            end_ns,
            attributes,
            error,
            links: Vec::new(),
            kind: SpanKind::Server,
        });
    }

    /// This span's trace and span ids (what a store call it waits on names it by).
    pub fn name(&self) -> floodgate_core::call_trace::SpanName {
        (self.trace_id, self.span_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_decide_and_roots_follow_the_ratio() {
        let at = |sample_ratio| {
            pair(
                "http://x",
                &crate::otel::Config {
                    endpoint: Some("http://x".into()),
                    service_name: "s".into(),
                    sample_ratio,
                    headers: Vec::new(),
                    timeout: crate::otel::EXPORT_TIMEOUT,
                    gzip: false,
                    encoding: crate::otel::Encoding::Json,
                    resource: Vec::new(),
                    certificate: None,
                },
            )
            .expect("an exporter")
        };
        let (never, _) = at(0.0);
        let (always, _) = at(1.0);
        let (half, _) = at(0.5);
        let sampled = TraceContext {
            trace_id: [7; 16],
            span_id: [9; 8],
            flags: 1,
        };
        let span = never
            .start(Some(sampled), "check")
            .expect("a sampled parent is followed");
        assert_eq!((span.trace_id, span.parent), ([7; 16], Some([9; 8])));
        assert_ne!(span.span_id, [9; 8]);
        assert!(always
            .start(Some(TraceContext { flags: 0, ..sampled }), "check")
            .is_none());
        assert!((0..1_000).all(|_| never.start(None, "check").is_none()));
        assert!((0..1_000).all(|_| always.start(None, "check").is_some_and(|s| s.parent.is_none())));
        let kept = (0..10_000)
            .filter(|_| half.start(None, "check").is_some())
            .count();
        assert!((4_000..6_000).contains(&kept), "{kept} of 10,000 at 0.5");
    }
}
