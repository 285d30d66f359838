//! A call on a node's connection: who waits for its reply (coalesced checks, a raw call, or a
//! script load after NOSCRIPT), its deadline and command; failing it; and writing it with a timeout.

use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;

use floodgate_core::algo::Outcome;
use floodgate_core::store::StoreError;

use super::connect::Io;

/// Where one check's outcomes go.
pub(super) type CheckReply = oneshot::Sender<Result<Vec<Outcome>, StoreError>>;

/// Who waits for a call's reply.
pub(super) enum Waiter {
    /// Coalesced checks: how many items each, and where its outcomes go.
    Checks(Vec<(usize, CheckReply)>),
    /// A raw call.
    Raw(oneshot::Sender<Result<Vec<i64>, StoreError>>),
    /// A `SCRIPT LOAD` sent after NOSCRIPT; the call sent again after it gets the answer.
    Load,
}

/// A call written and not yet answered.
pub(super) struct Pending {
    pub(super) waiter: Waiter,
    pub(super) items: usize,
    pub(super) deadline: Instant,
    /// The command, kept to send once more after NOSCRIPT.
    pub(super) cmd: Vec<u8>,
    /// Whether it was sent again after NOSCRIPT (it is not sent a third time).
    pub(super) resent: bool,
    /// The traced checks it serves (`floodgate_core::call_trace`), and how many checks in all.
    pub(super) traced: Option<
        Box<(
            Vec<floodgate_core::call_trace::SpanName>,
            usize,
            std::time::Instant,
        )>,
    >,
}

/// Fails whoever waits for a call with `e`.
pub(super) fn fail(waiter: Waiter, e: &StoreError) {
    match waiter {
        Waiter::Checks(checks) => {
            for (_, reply) in checks {
                let _ = reply.send(Err(e.clone()));
            }
        }
        Waiter::Raw(reply) => {
            let _ = reply.send(Err(e.clone()));
        }
        Waiter::Load => {}
    }
}

/// Writes `bytes` whole: at once when the socket takes them (the usual case, no timer), else within
/// `timeout` (a write cut short leaves half a command on the socket: the caller drops it).
pub(super) async fn write(io: &mut Box<dyn Io>, bytes: &[u8], timeout: Duration) -> Result<(), StoreError> {
    let mut written = pin!(async {
        io.write_all(bytes).await?;
        io.flush().await
    });
    let result = match futures::poll!(written.as_mut()) {
        Poll::Ready(r) => r,
        Poll::Pending => match tokio::time::timeout(timeout.max(Duration::from_millis(100)), written).await {
            Ok(r) => r,
            Err(_) => return Err(StoreError::Timeout(timeout)),
        },
    };
    result.map_err(|e| StoreError::Connection(e.to_string()))
}
