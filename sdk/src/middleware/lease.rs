//! The response body the Layer hands back: the inner body, and the request's concurrency lease,
//! released when the body ends, fails or is dropped (a client that went away, a handler error, a
//! stream abandoned half-way), never before.

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};

use crate::{Attributes, CallOptions, Client, ItemMode};

pin_project_lite::pin_project! {
    /// A response body that releases the request's concurrency lease, if it holds one, once it has
    /// ended or been dropped.
    pub struct Released<B> {
        #[pin]
        inner: B,
        lease: Option<LeaseGuard>,
    }
}

impl<B> Released<B> {
    /// A body holding no lease.
    pub(super) fn plain(inner: B) -> Self {
        Released { inner, lease: None }
    }

    /// A body that releases `lease` when it ends.
    pub(super) fn holding(inner: B, lease: LeaseGuard) -> Self {
        Released {
            inner,
            lease: Some(lease),
        }
    }

    /// The inner body.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: From<String>> From<String> for Released<B> {
    fn from(s: String) -> Self {
        Released::plain(B::from(s))
    }
}

impl<B: Body> Body for Released<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let frame = this.inner.poll_frame(cx);
        if matches!(frame, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            // Ended (or failed): the request is over.
            this.lease.take();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request's lease: dropped, it sends the release (the request's attributes, its cost and lease,
/// mode release) on a task of its own, without holding anything up.
pub(super) struct LeaseGuard {
    pub(super) client: Client,
    pub(super) attributes: Attributes,
    /// Sends the release when dropped.
    pub(super) armed: bool,
    /// The agent said it holds the lease (else the release is a precaution: a failure to send it
    /// is logged at debug, not warned about).
    pub(super) sure: bool,
    /// The request's trace context, sent with the release.
    pub(super) trace: Option<floodgate_protocol::TraceContext>,
}

static RELEASE_FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (it is shutting down): the lease runs out by itself.
            return;
        };
        let check = floodgate_protocol::Check::Attributes(Attributes {
            mode: ItemMode::Release,
            ..std::mem::take(&mut self.attributes)
        });
        let client = self.client.clone();
        let sure = self.sure;
        let options = CallOptions {
            trace: self.trace,
            ..CallOptions::default()
        };
        runtime.spawn(async move {
            match client.check_with(check, options).await {
                Ok(d) if d.from_agent_answer() => {}
                Ok(_) | Err(_) if !sure => {
                    tracing::debug!("floodgate: a precautionary lease release did not reach the agent")
                }
                Ok(d) => super::service::warn_rarely(
                    &RELEASE_FAILED,
                    "floodgate: the agent could not take a lease's release; it runs out by itself",
                    &format!("{:?}", d.origin),
                ),
                Err(e) => super::service::warn_rarely(
                    &RELEASE_FAILED,
                    "floodgate: a lease's release failed; it runs out by itself",
                    &e,
                ),
            }
        });
    }
}
