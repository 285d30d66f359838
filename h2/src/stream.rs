//! A stream as a connection keeps it: its state, request head and body, windows and answer; a call
//! being answered; a header block arriving in CONTINUATIONs.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;

use crate::head::RequestHead;

/// A call being answered, and its stream.
pub(crate) struct Answering<F> {
    pub id: u32,
    pub answer: F,
}

impl<F: Future + Unpin> Future for Answering<F> {
    type Output = (u32, F::Output);
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let id = self.id;
        Pin::new(&mut self.answer).poll(cx).map(|a| (id, a))
    }
}

/// Where a stream is in its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// The request's frames are arriving.
    Receiving,
    /// Decided by the engine; the answer is on its way.
    Answering,
    /// The answer's DATA waits for flow-control window.
    Sending,
}

/// One stream: its call's request and, once decided, its answer.
pub(crate) struct Stream {
    pub state: State,
    pub head: RequestHead,
    pub body: Vec<u8>,
    /// DATA payload bytes received, padding included (the stream's receive window used).
    pub received: usize,
    /// Received bytes not yet credited back to the connection's window.
    pub uncredited: usize,
    pub send_window: i64,
    /// When the stream's present wait began: its request opened (Receiving), or its answer parked
    /// (Sending). Either is dropped once the frame timeout has passed since.
    pub since: Instant,
    /// The answer's DATA payload and how much of it is sent (state Sending).
    pub data: Vec<u8>,
    pub sent: usize,
}

/// A header block arriving in CONTINUATIONs.
pub(crate) struct Continuing {
    pub stream: u32,
    /// Whether its HEADERS ended the stream.
    pub end_stream: bool,
    /// When its HEADERS arrived: the whole block is due within the frame timeout of this.
    pub started: Instant,
    /// CONTINUATION frames so far.
    pub frames: u32,
}
