//! Which checks a store call served, for traces: with traces on, the agent installs a reporter;
//! the check being polled names its span (`Traced`), a store that coalesces checks into one call
//! picks that name up when it queues the check (`current`), and reports each call with the names of
//! the traced checks it served (`report`). Off, `enabled` is one atomic load and nothing else runs.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Instant;

/// A check's span: its trace id and span id.
pub type SpanName = ([u8; 16], [u8; 8]);

/// One store call and the traced checks it served.
#[derive(Debug, Clone)]
pub struct CallReport {
    /// The call group (shard) it went to.
    pub shard: usize,
    /// Checks coalesced into the call, traced or not.
    pub checks: usize,
    /// Items of all of them.
    pub items: usize,
    /// When it was sent and when its reply was read.
    pub sent: Instant,
    /// When its reply was read.
    pub answered: Instant,
    /// Whether Redis answered it (else it failed or timed out).
    pub ok: bool,
    /// The spans of its traced checks, in the order they were queued.
    pub served: Vec<SpanName>,
    /// The node it went to: its host (or Unix socket path) and TCP port.
    pub server: (String, Option<u16>),
}

static REPORTER: OnceLock<fn(CallReport)> = OnceLock::new();

thread_local! {
    static CURRENT: Cell<Option<SpanName>> = const { Cell::new(None) };
}

/// Installs the reporter (the first call wins).
pub fn install(reporter: fn(CallReport)) {
    let _ = REPORTER.set(reporter);
}

/// Whether calls are reported (one atomic load).
#[inline]
pub fn enabled() -> bool {
    REPORTER.get().is_some()
}

/// The span of the check being polled on this thread, if it is traced.
#[inline]
pub fn current() -> Option<SpanName> {
    if enabled() {
        CURRENT.with(Cell::get)
    } else {
        None
    }
}

/// Reports a call (when a reporter is installed and it served a traced check).
pub fn report(call: CallReport) {
    if let Some(r) = REPORTER.get() {
        if !call.served.is_empty() {
            r(call);
        }
    }
}

/// A future polled with its check's span as the thread's current one.
pub struct Traced<F> {
    span: SpanName,
    inner: F,
}

impl<F: Future + Unpin> Traced<F> {
    /// `inner` (a boxed future, say), named `span` while it is polled.
    pub fn new(span: SpanName, inner: F) -> Self {
        Traced { span, inner }
    }
}

impl<F: Future + Unpin> Future for Traced<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let span = self.span;
        poll_named(span, || Pin::new(&mut self.inner).poll(cx))
    }
}

/// Runs `f` with `span` as the thread's current check span; the one before is put back however `f`
/// ends (a panic too), so no later check on this thread is named after this one.
pub fn poll_named<R>(span: SpanName, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<SpanName>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(span))));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_is_put_back_after_a_panic() {
        let a: SpanName = ([1; 16], [2; 8]);
        let caught = std::panic::catch_unwind(|| poll_named(a, || panic!("a check panicked")));
        assert!(caught.is_err());
        assert_eq!(CURRENT.with(Cell::get), None);
        assert_eq!(poll_named(a, || CURRENT.with(Cell::get)), Some(a));
    }
}
