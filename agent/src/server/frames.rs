//! What a frames connection does with the frames it reads: each complete one decoded (`process`)
//! and handled (`handle`: a check answered at once or kept in flight as an `InFlight`, Hello,
//! Ping, FailModes), and answers encoded for the peer's version (`answer`, `error`).

use std::sync::Arc;
use std::time::Instant;

use futures::stream::FuturesUnordered;

use floodgate_core::engine::{Answer, Engine};
use floodgate_protocol::{decode, Body, DecodeError, ErrorBody, ErrorCode, Frame, MIN_VERSION, VERSION};

/// The checks of a connection waiting on the store.
pub(super) type Pending = FuturesUnordered<InFlight>;

/// A check waiting on the store: the engine's future with its request id and start time (no box of
/// its own around the engine's).
pub(super) struct InFlight {
    id: u32,
    start: Option<std::time::Instant>,
    /// Which items are charges (never counted as rejections; `metrics::charges`).
    charges: u32,
    /// The check's trace span, when traces are on and it is sampled.
    span: Option<Box<crate::otel::SpanStart>>,
    answer: std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<floodgate_protocol::Decision, ErrorBody>> + Send>,
    >,
}

impl std::future::Future for InFlight {
    type Output = (u32, Result<floodgate_protocol::Decision, ErrorBody>);

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        // A traced check names its span to the store call it may join (`call_trace`).
        let result = match self.span.as_ref().map(|s| s.name()) {
            Some(name) => std::task::ready!(floodgate_core::call_trace::poll_named(name, || self
                .answer
                .as_mut()
                .poll(cx))),
            None => std::task::ready!(self.answer.as_mut().poll(cx)),
        };
        if let Some(start) = self.start {
            floodgate_core::metrics::check_charged(&result, start.elapsed(), self.charges);
        }
        if let Some(span) = self.span.take() {
            let wait = span.elapsed();
            crate::otel::end_check(
                *span,
                crate::otel::Via::Frames,
                result.as_ref().map(Some).map_err(|e| e.message.as_str()),
                Some(wait),
            );
        }
        std::task::Poll::Ready((self.id, result))
    }
}

/// Handles every complete frame in `inbuf`: the bytes consumed, or the encoded fatal Error when the
/// stream is broken.
pub(super) fn process(
    inbuf: &mut Vec<u8>,
    out: &mut Vec<u8>,
    pending: &mut Pending,
    engine: &Arc<Engine>,
    received: Instant,
    peer: &mut u8,
) -> Result<usize, Vec<u8>> {
    let mut pos = 0;
    let result = loop {
        match decode(&inbuf[pos..]) {
            Ok((frame, used)) => {
                pos += used;
                handle(frame, out, pending, engine, received, peer);
            }
            Err(DecodeError::Incomplete) => break Ok(pos),
            Err(DecodeError::Rejected {
                code,
                request_id,
                reason,
                frame_len,
            }) => {
                pos += frame_len;
                floodgate_core::metrics::check_error();
                error(out, request_id, code, reason);
            }
            Err(DecodeError::Fatal {
                code,
                request_id,
                reason,
            }) => {
                tracing::debug!(%code, %reason, "closing a connection that sent a bad frame");
                let mut bytes = Vec::new();
                error(&mut bytes, request_id.unwrap_or(0), code, reason);
                break Err(bytes);
            }
            Err(other) => {
                let mut bytes = Vec::new();
                error(&mut bytes, 0, ErrorCode::MalformedFrame, other.to_string());
                break Err(bytes);
            }
        }
    };
    inbuf.drain(..pos);
    result
}

/// One frame: a check decided (answered now, or in flight), Hello settled, Ping, FailModes; any
/// other kind gets an Error.
fn handle(
    frame: Frame,
    out: &mut Vec<u8>,
    pending: &mut Pending,
    engine: &Arc<Engine>,
    received: Instant,
    peer: &mut u8,
) {
    let id = frame.request_id;
    let trace = frame.trace;
    match frame.body {
        Body::Check(check) => {
            // Off, one atomic load.
            let span = if crate::otel::enabled() {
                crate::otel::start_check(trace)
            } else {
                None
            };
            // The check's time runs from its frame's read (one clock read per read, not per check):
            // the store's budget and the metric's duration both.
            let start = floodgate_core::metrics::on().then_some(received);
            let charges = if start.is_some() {
                floodgate_core::metrics::charges(&check)
            } else {
                0
            };
            match engine.check_received(check, received) {
                Answer::Ready(result) => {
                    if let Some(start) = start {
                        floodgate_core::metrics::check_charged(&result, start.elapsed(), charges);
                    }
                    if let Some(span) = span {
                        crate::otel::end_check(
                            *span,
                            crate::otel::Via::Frames,
                            result.as_ref().map(Some).map_err(|e| e.message.as_str()),
                            None,
                        );
                    }
                    answer(out, id, result, *peer)
                }
                Answer::Pending(answer) => pending.push(InFlight {
                    id,
                    start,
                    charges,
                    span,
                    answer,
                }),
            }
        }
        Body::Hello {
            min_version,
            max_version,
        } => {
            // The highest version both speak.
            let version = max_version.min(VERSION);
            if version >= min_version.max(MIN_VERSION) {
                *peer = version;
                encode(out, Frame::new(id, Body::HelloOk { version }));
            } else {
                error(
                    out,
                    id,
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "client speaks {min_version}..={max_version}; this agent speaks {MIN_VERSION}..={VERSION}"
                    ),
                );
            }
        }
        Body::Ping => encode(out, Frame::new(id, Body::Pong)),
        Body::FailModes => {
            let list = floodgate_core::rules::fail_mode_list(&engine.rules());
            encode(out, Frame::new(id, Body::FailModeList(list)));
        }
        _ => error(
            out,
            id,
            ErrorCode::UnexpectedFrame,
            "only Hello, Check, Ping and FailModes go to an agent".into(),
        ),
    }
}

/// A check's answer: its Decision for the peer's version, or its Error.
pub(super) fn answer(
    out: &mut Vec<u8>,
    id: u32,
    result: Result<floodgate_protocol::Decision, ErrorBody>,
    peer: u8,
) {
    match result {
        Ok(d) => encode_for(out, Frame::new(id, Body::Decision(d)), peer),
        Err(e) => encode(out, Frame::new(id, Body::Error(e))),
    }
}

/// An Error frame for request `id`.
pub(super) fn error(out: &mut Vec<u8>, id: u32, code: ErrorCode, message: String) {
    encode(out, Frame::new(id, Body::Error(ErrorBody { code, message })));
}

/// Encodes a frame every version reads.
fn encode(out: &mut Vec<u8>, frame: Frame) {
    encode_for(out, frame, 1);
}

/// Encodes a frame in the form a peer of version `peer` reads.
fn encode_for(out: &mut Vec<u8>, frame: Frame, peer: u8) {
    if let Err(e) = frame.encode_for(out, peer) {
        // Only a decision with more items than the protocol allows can fail; the engine caps items
        // at MAX_ITEMS, so this is a bug: say so to the client instead of dropping the request.
        tracing::error!(error = %e, "could not encode an answer");
        let _ = Frame::new(
            frame.request_id,
            Body::Error(ErrorBody {
                code: ErrorCode::Internal,
                message: e.to_string(),
            }),
        )
        .encode(out);
    }
}
