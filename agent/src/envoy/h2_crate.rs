//! ShouldRateLimit served by the `h2` crate used directly (`--grpc-server h2`): its server handshake
//! and stream store, every call read and answered in its connection's task (no tonic, no tower, no
//! task per stream), the answer's bytes written by `reply` as the native server writes them.
//!
//! It is here to be measured against the native server (`loadgen grpc --grpc-server h2`,
//! BENCHMARKS.md "Which HTTP/2 server"), with h2's own budgets set to the native server's.

use std::sync::Arc;
use std::time::Duration;

use ::h2::server::{Builder, SendResponse};
use ::h2::RecvStream;
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use prost::Message;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use floodgate_h2::{grpc, CONN_WINDOW, MAX_HEADER_BLOCK, MAX_STREAMS};

use super::native::{HEALTH_SERVICE, SHOULD_RATE_LIMIT};
use super::proto::RateLimitRequest;
use super::EnvoyService;

/// Serves one connection until the client closes it, an error closes it, or `shutdown` (then a
/// GOAWAY, the calls in flight answered, and the close).
pub async fn serve<IO>(
    io: IO,
    service: Arc<EnvoyService>,
    frame_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let mut builder = Builder::new();
    builder
        .max_concurrent_streams(MAX_STREAMS as u32)
        .max_header_list_size(MAX_HEADER_BLOCK as u32)
        .initial_connection_window_size(CONN_WINDOW as u32)
        .max_send_buffer_size(64 * 1024);
    let mut conn = match tokio::time::timeout(frame_timeout, builder.handshake::<_, Bytes>(io)).await {
        Ok(Ok(conn)) => conn,
        _ => return,
    };
    let mut calls = FuturesUnordered::new();
    let stop = floodgate_core::tasks::stopped(&mut shutdown);
    tokio::pin!(stop);
    let mut going_away = false;
    loop {
        tokio::select! {
            accepted = conn.accept() => match accepted {
                Some(Ok((request, respond))) => {
                    calls.push(call(service.clone(), request, respond, frame_timeout));
                }
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "closing a gRPC connection (h2)");
                    return;
                }
                None => return,
            },
            Some(()) = calls.next(), if !calls.is_empty() => {}
            _ = &mut stop, if !going_away => {
                going_away = true;
                conn.graceful_shutdown();
            }
        }
    }
}

/// One unary call: the body read (at most one message), the check decided, the answer sent.
async fn call(
    service: Arc<EnvoyService>,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    frame_timeout: Duration,
) {
    let (parts, mut body) = request.into_parts();
    let is_grpc = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if parts.method != http::Method::POST || !is_grpc {
        let head = http::Response::builder()
            .status(415)
            .body(())
            .expect("a constant response");
        let _ = respond.send_response(head, true);
        return;
    }
    let health = parts.uri.path().as_bytes() == grpc::HEALTH_CHECK;
    if parts.uri.path().as_bytes() != SHOULD_RATE_LIMIT && !health {
        return trailers_only(
            &mut respond,
            grpc::status::UNIMPLEMENTED,
            "this server has only ShouldRateLimit",
        );
    }
    let mut buf: Vec<u8> = Vec::new();
    let read = tokio::time::timeout(frame_timeout, async {
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            let _ = body.flow_control().release_capacity(chunk.len());
            buf.extend_from_slice(&chunk);
            if grpc::declared_len(&buf).is_some_and(|n| n > grpc::MAX_MESSAGE) {
                return Err(format!("a request message past {} bytes", grpc::MAX_MESSAGE));
            }
        }
        Ok(())
    })
    .await;
    match read {
        Ok(Ok(())) => {}
        Ok(Err(why)) => return trailers_only(&mut respond, grpc::status::RESOURCE_EXHAUSTED, &why),
        Err(_) => {
            respond.send_reset(::h2::Reason::CANCEL);
            return;
        }
    }
    if health {
        let answer = match grpc::message(&buf).map(grpc::health_service) {
            Ok(Some(service)) if service.is_empty() || service == HEALTH_SERVICE => {
                grpc::health_response(true)
            }
            Ok(Some(_)) => {
                return trailers_only(&mut respond, grpc::status::NOT_FOUND, "no such service here")
            }
            Ok(None) => {
                return trailers_only(
                    &mut respond,
                    grpc::status::INTERNAL,
                    "the request does not decode",
                )
            }
            Err(bad) => return trailers_only(&mut respond, bad.code, &bad.message),
        };
        return send_answer(respond, &answer);
    }
    let request = match grpc::message(&buf).map(RateLimitRequest::decode) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return trailers_only(
                &mut respond,
                grpc::status::INTERNAL,
                &format!("the request does not decode: {e}"),
            )
        }
        Err(bad) => return trailers_only(&mut respond, bad.code, &bad.message),
    };
    let trace = if crate::otel::enabled() {
        parts
            .headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(floodgate_protocol::TraceContext::parse)
    } else {
        None
    };
    let answer = match service.decide_bytes(request, trace).await {
        Ok(answer) => answer,
        Err(e) => return trailers_only(&mut respond, e.code() as i32, e.message()),
    };
    send_answer(respond, &answer);
}

/// An answer's message, then `grpc-status: 0`.
fn send_answer(mut respond: SendResponse<Bytes>, answer: &[u8]) {
    let head = http::Response::builder()
        .status(200)
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .body(())
        .expect("a constant response");
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    let mut data = Vec::with_capacity(5 + answer.len());
    data.push(0);
    data.extend_from_slice(&(answer.len() as u32).to_be_bytes());
    data.extend_from_slice(answer);
    if send.send_data(Bytes::from(data), false).is_err() {
        return;
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = send.send_trailers(trailers);
}

/// gRPC's Trailers-Only response: a status other than OK, and the stream ends.
fn trailers_only(respond: &mut SendResponse<Bytes>, code: i32, message: &str) {
    let mut head = http::Response::builder()
        .status(200)
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header("grpc-status", code);
    if let Ok(v) = http::HeaderValue::from_bytes(&grpc::percent_encode(message, 1_024)) {
        head = head.header("grpc-message", v);
    }
    if let Ok(head) = head.body(()) {
        let _ = respond.send_response(head, true);
    }
}
