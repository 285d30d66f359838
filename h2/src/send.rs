//! What the server writes: a complete request dispatched to the engine and its answer framed, the
//! answers waiting for flow-control window, resets, trailers, and the window credited back.

use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;

use crate::budget::{Closed, CALM};
use crate::conn::{Answering, Conn, State, CONN_WINDOW};
use crate::frame::{self, code, flag, kind, MAX_PAYLOAD};
use crate::grpc::{self, status};
use crate::head::Method;
use crate::service::{Service, Status};

impl<S: Service> Conn<S> {
    /// A complete request (its body in `whole`, or gathered in the stream): refused at once, or
    /// its check started (and answered at once when the store answers at once).
    pub(crate) fn dispatch(&mut self, id: u32, whole: Option<&[u8]>) {
        let Some(s) = self.streams.get_mut(&id).filter(|s| s.state == State::Receiving) else {
            return;
        };
        s.state = State::Answering;
        self.receiving -= 1;
        self.uncredited += std::mem::take(&mut s.uncredited) as i64;
        let gathered = std::mem::take(&mut s.body);
        let body = whole.unwrap_or(&gathered);
        let head = std::mem::take(&mut s.head);
        // DATA that does not add up to the request's content-length: malformed (§8.1.1).
        if head.content_length.is_some_and(|n| n != body.len() as u64) {
            return self.reset(id, code::PROTOCOL_ERROR);
        }
        if !(head.post && head.grpc) {
            let mut block = Vec::with_capacity(8);
            block.extend_from_slice(grpc::NOT_GRPC);
            self.header_frame(id, &block, true);
            self.remove(id, Closed::Done);
            return;
        }
        let method = match head.method {
            Method::Call(m) => m,
            Method::HealthCheck => return self.health_check(id, body),
            Method::HealthWatch => {
                let why = "Watch is not served: poll grpc.health.v1.Health/Check";
                return self.trailers_only(id, status::UNIMPLEMENTED, why);
            }
            Method::Other => {
                return self.trailers_only(id, status::UNIMPLEMENTED, "no such method here");
            }
        };
        let message = match grpc::message(body) {
            Ok(m) => m,
            Err(bad) => return self.trailers_only(id, bad.code, &bad.message),
        };
        let mut answer = self.service.call(method, message, head.trace.as_deref());
        match (&mut answer).now_or_never() {
            Some(result) => self.answer(id, result),
            None => self.pending.push(Answering { id, answer }),
        }
    }

    /// grpc.health.v1 Check: SERVING for the server and the rate-limit service while the agent
    /// runs, NOT_SERVING once it is stopping (so a probe sees the drain), NOT_FOUND for another
    /// service.
    fn health_check(&mut self, id: u32, body: &[u8]) {
        let service = match grpc::message(body).map(grpc::health_service) {
            Ok(Some(service)) => service,
            Ok(None) => return self.trailers_only(id, status::INTERNAL, "the request does not decode"),
            Err(bad) => return self.trailers_only(id, bad.code, &bad.message),
        };
        if !self.config.has_health(service) {
            let why = format!("no service {:?} here", String::from_utf8_lossy(service));
            return self.trailers_only(id, status::NOT_FOUND, &why);
        }
        self.answer(id, Ok(grpc::health_response(!self.going_away)));
    }

    /// Writes the answer to stream `id` (if the client has not reset it meanwhile). One that does
    /// not fit the windows waits for them, if the parked budgets have room; else it is dropped and
    /// the stream reset (ENHANCE_YOUR_CALM).
    pub(crate) fn answer(&mut self, id: u32, result: Result<Vec<u8>, Status>) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                self.trailers_only(id, e.code, &e.message);
                return;
            }
        };
        let len = 5 + response.len();
        let fits = len as i64 <= self.send_window.min(s.send_window) && len <= MAX_PAYLOAD;
        if !fits && !self.parked.take(len, self.blocked.len()) {
            self.reset(id, code::ENHANCE_YOUR_CALM);
            self.spend_calm();
            return;
        }
        frame::head(
            &mut self.out,
            grpc::RESPONSE_HEAD.len(),
            kind::HEADERS,
            flag::END_HEADERS,
            id,
        );
        self.out.extend_from_slice(grpc::RESPONSE_HEAD);
        if fits {
            self.send_window -= len as i64;
            frame::head(&mut self.out, len, kind::DATA, 0, id);
            message_into(&mut self.out, &response, len);
            self.ok_trailers(id);
        } else {
            s.data = Vec::with_capacity(len);
            message_into(&mut s.data, &response, len);
            s.state = State::Sending;
            s.since = Instant::now();
            self.blocked.push_back(id);
            self.window_changed = true;
        }
    }

    /// Gives the window that came since the last look to the answers waiting for it.
    pub(crate) fn flush_if_changed(&mut self) {
        if std::mem::take(&mut self.window_changed) {
            self.flush_blocked();
        }
    }

    /// Sends what the windows allow of the answers waiting for them, oldest first; a stream out of
    /// its own window is passed over, not waited on. At most [`crate::budget::MAX_PARKED_STREAMS`]
    /// wait, so a pass is bounded however the client spends its frames.
    fn flush_blocked(&mut self) {
        let mut i = 0;
        while i < self.blocked.len() && self.send_window > 0 {
            let id = self.blocked[i];
            let Some(s) = self.streams.get_mut(&id).filter(|s| s.state == State::Sending) else {
                self.blocked.remove(i);
                continue;
            };
            let before = s.sent;
            while s.sent < s.data.len() {
                let n = (s.data.len() - s.sent)
                    .min(MAX_PAYLOAD)
                    .min(self.send_window.max(0) as usize)
                    .min(s.send_window.max(0) as usize);
                if n == 0 {
                    break;
                }
                frame::head(&mut self.out, n, kind::DATA, 0, id);
                self.out.extend_from_slice(&s.data[s.sent..s.sent + n]);
                s.sent += n;
                self.send_window -= n as i64;
                s.send_window -= n as i64;
            }
            let (sent, done) = (s.sent - before, s.sent == s.data.len());
            self.parked.give(sent);
            if done {
                self.blocked.remove(i);
                self.ok_trailers(id);
            } else {
                i += 1;
            }
        }
    }

    /// A GOAWAY with `code`: the last stream id is the first GOAWAY's, if one was sent.
    pub(crate) fn goaway(&mut self, code: u32, why: &str) {
        let last = *self.goaway_last.get_or_insert(self.last_stream);
        frame::goaway(&mut self.out, last, code, why);
    }

    /// The trailers of an answered call (`grpc-status: 0`), which end its stream; the call gives
    /// the client back a unit of calm.
    fn ok_trailers(&mut self, id: u32) {
        frame::head(
            &mut self.out,
            grpc::OK_TRAILERS.len(),
            kind::HEADERS,
            flag::END_HEADERS | flag::END_STREAM,
            id,
        );
        self.out.extend_from_slice(grpc::OK_TRAILERS);
        self.streams.remove(&id);
        self.closed.push(id, Closed::Done);
        self.calm = (self.calm + 1).min(CALM);
    }

    /// A response of headers only: gRPC's Trailers-Only, with a status other than OK; the stream
    /// is done.
    pub(crate) fn trailers_only(&mut self, id: u32, code: i32, message: &str) {
        let mut block = Vec::with_capacity(64 + message.len());
        block.extend_from_slice(grpc::RESPONSE_HEAD);
        grpc::status_fields(&mut block, code, message);
        self.header_frame(id, &block, true);
        self.remove(id, Closed::Done);
    }

    /// One header block as HEADERS and, past a frame, CONTINUATIONs.
    fn header_frame(&mut self, id: u32, block: &[u8], end_stream: bool) {
        let mut chunks = block.chunks(MAX_PAYLOAD).peekable();
        let mut first = true;
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            let (k, mut flags) = if first {
                (kind::HEADERS, if end_stream { flag::END_STREAM } else { 0 })
            } else {
                (kind::CONTINUATION, 0)
            };
            if last {
                flags |= flag::END_HEADERS;
            }
            frame::head(&mut self.out, chunk.len(), k, flags, id);
            self.out.extend_from_slice(chunk);
            first = false;
        }
    }

    /// Ends a stream with RST_STREAM, for a fault of the client's (a unit of calm) or its own.
    pub(crate) fn reset(&mut self, id: u32, code: u32) {
        frame::rst_stream(&mut self.out, id, code);
        if self.remove(id, Closed::ByUs) && code != code::CANCEL {
            self.spend_calm();
        }
    }

    /// Forgets a stream, crediting back its unused bytes and its parked answer, and remembers how
    /// it closed. Whether it was open.
    pub(crate) fn remove(&mut self, id: u32, how: Closed) -> bool {
        let Some(s) = self.streams.remove(&id) else {
            return false;
        };
        self.closed.push(id, how);
        self.uncredited += s.uncredited as i64;
        match s.state {
            State::Receiving => self.receiving -= 1,
            State::Sending => {
                self.blocked.retain(|&b| b != id);
                self.parked.give(s.data.len() - s.sent);
            }
            State::Answering => {}
        }
        true
    }

    /// One unit of the client's calm spent (at 0 the connection ends).
    pub(crate) fn spend_calm(&mut self) {
        self.calm = self.calm.saturating_sub(1);
    }

    /// Gives the client back the window its used bytes took, once they are a quarter of it or the
    /// window is half gone.
    pub(crate) fn credit(&mut self) {
        if self.uncredited >= CONN_WINDOW / 4 || (self.uncredited > 0 && self.recv_window < CONN_WINDOW / 2) {
            frame::window_update(&mut self.out, 0, self.uncredited as u32);
            self.recv_window += self.uncredited;
            self.uncredited = 0;
        }
    }

    /// Resets the requests that did not arrive whole, and the answers that found no window, within
    /// the frame timeout (CANCEL).
    pub(crate) fn drop_stale(&mut self, now: Instant, frame_timeout: Duration) {
        if self.receiving == 0 && self.blocked.is_empty() {
            return;
        }
        let stale: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| s.state != State::Answering && now >= s.since + frame_timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.reset(id, code::CANCEL);
        }
    }
}

/// A message with its 5-byte gRPC prefix (`len`: the prefix and the message).
fn message_into(out: &mut Vec<u8>, m: &[u8], len: usize) {
    out.push(0);
    out.extend_from_slice(&((len - 5) as u32).to_be_bytes());
    out.extend_from_slice(m);
}
