//! A header block from a client: HEADERS and its CONTINUATIONs gathered (at most
//! `MAX_HEADER_BLOCK` bytes in at most `MAX_CONTINUATIONS` frames), then decoded by `end_headers`:
//! a new request, a request's trailers, or a reset stream's block dropped.

use tokio::time::Instant;

use crate::budget::{Closed, MAX_PARKED_STREAMS};
use crate::conn::{
    conn_error, Conn, ConnError, Continuing, State, Stream, MAX_CONTINUATIONS, MAX_HEADER_BLOCK, MAX_STREAMS,
};
use crate::frame::{self, code, flag, Head};
use crate::head::RequestHead;
use crate::recv::depends_on_itself;
use crate::service::Service;

impl<S: Service> Conn<S> {
    /// HEADERS: its fragment gathered (padding and priority stripped; a stream that depends on
    /// itself is a stream error, its block still decoded), then the block ends or continues.
    pub(crate) fn headers(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream == 0 || h.stream.is_multiple_of(2) {
            return conn_error(code::PROTOCOL_ERROR, "HEADERS on stream 0 or a server's stream");
        }
        let Some(mut range) = frame::unpadded(&h, payload) else {
            return conn_error(code::PROTOCOL_ERROR, "padding longer than its frame");
        };
        if h.has(flag::PRIORITY) {
            range.start += 5;
            if range.start > range.end {
                return conn_error(code::FRAME_SIZE_ERROR, "HEADERS too short for its priority");
            }
            if depends_on_itself(h.stream, &payload[range.start - 5..]) {
                // A stream error, though the block is still decoded for the HPACK table's sake.
                self.block.clear();
                self.fragment(&payload[range])?;
                self.self_dependent = Some(h.stream);
                return self.headers_end_or_continue(h);
            }
        }
        self.block.clear();
        self.fragment(&payload[range])?;
        self.headers_end_or_continue(h)
    }

    /// A HEADERS frame's fragment is in `block`: the block ends here or CONTINUATIONs follow.
    fn headers_end_or_continue(&mut self, h: Head) -> Result<(), ConnError> {
        let end_stream = h.has(flag::END_STREAM);
        if h.has(flag::END_HEADERS) {
            self.end_headers(h.stream, end_stream)
        } else {
            self.continuing = Some(Continuing {
                stream: h.stream,
                end_stream,
                started: Instant::now(),
                frames: 0,
            });
            Ok(())
        }
    }

    pub(crate) fn continuation(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        let Some(b) = &mut self.continuing else {
            return conn_error(code::PROTOCOL_ERROR, "CONTINUATION without HEADERS");
        };
        b.frames += 1;
        if b.frames > MAX_CONTINUATIONS {
            return conn_error(
                code::ENHANCE_YOUR_CALM,
                format!("a header block in more than {MAX_CONTINUATIONS} CONTINUATION frames"),
            );
        }
        let (stream, end_stream) = (b.stream, b.end_stream);
        self.fragment(payload)?;
        if h.has(flag::END_HEADERS) {
            self.continuing = None;
            self.end_headers(stream, end_stream)?;
        }
        Ok(())
    }

    fn fragment(&mut self, bytes: &[u8]) -> Result<(), ConnError> {
        if self.block.len() + bytes.len() > MAX_HEADER_BLOCK {
            return conn_error(
                code::ENHANCE_YOUR_CALM,
                format!("a header block past {MAX_HEADER_BLOCK} bytes"),
            );
        }
        self.block.extend_from_slice(bytes);
        Ok(())
    }

    /// A whole header block: a new request, a request's trailers, or (decoded, for the HPACK
    /// table's sake, and dropped) one of a stream this server reset.
    fn end_headers(&mut self, id: u32, end_stream: bool) -> Result<(), ConnError> {
        let mut head = RequestHead::default();
        let block = std::mem::take(&mut self.block);
        let mut buf = std::mem::take(&mut self.scratch);
        let (config, trace) = (&*self.config, self.trace);
        let decoded = self.hpack.decode(&block, MAX_HEADER_BLOCK, |n, v, upper| {
            head.field(n, v, upper, &mut buf, config, trace)
        });
        self.scratch = buf;
        self.block = block;
        if let Err(e) = decoded {
            let code = match e {
                crate::hpack::HpackError::ListTooLarge(_) => code::ENHANCE_YOUR_CALM,
                _ => code::COMPRESSION_ERROR,
            };
            return conn_error(code, e.to_string());
        }
        if self.self_dependent.take() == Some(id) {
            self.last_stream = self.last_stream.max(id);
            self.reset_any(id, code::PROTOCOL_ERROR);
            return Ok(());
        }
        if id > self.last_stream {
            self.last_stream = id;
            // Checks still being decided count too: a stream reset while its check runs (the rapid
            // reset pattern) leaves the stream map, not the store.
            // So do answers waiting for window: a client that reads none gets no more work done.
            let parked_full = self.blocked.len() >= MAX_PARKED_STREAMS;
            if self.going_away || parked_full || self.streams.len().max(self.pending.len()) >= MAX_STREAMS {
                if !self.going_away {
                    self.spend_calm();
                }
                frame::rst_stream(&mut self.out, id, code::REFUSED_STREAM);
                self.closed.push(id, Closed::ByUs);
                return Ok(());
            }
            // A malformed request (RFC 9113 §8.1.1): a stream error, and a unit of calm.
            if head.request_fault().is_some() {
                frame::rst_stream(&mut self.out, id, code::PROTOCOL_ERROR);
                self.closed.push(id, Closed::ByUs);
                self.spend_calm();
                return Ok(());
            }
            self.last_call = Instant::now();
            self.streams.insert(
                id,
                Stream {
                    state: State::Receiving,
                    head,
                    body: Vec::new(),
                    received: 0,
                    uncredited: 0,
                    send_window: self.peer_initial,
                    since: Instant::now(),
                    data: Vec::new(),
                    sent: 0,
                },
            );
            self.receiving += 1;
            if end_stream {
                self.dispatch(id, None);
            }
            return Ok(());
        }
        match self.streams.get(&id).map(|s| s.state) {
            // Trailers end a request; they carry no pseudo-header field.
            Some(State::Receiving) if end_stream && head.trailers_fault().is_none() => {
                self.dispatch(id, None)
            }
            Some(State::Receiving) => self.reset(id, code::PROTOCOL_ERROR),
            // The client ended its side already (half-closed, §5.1).
            Some(State::Answering | State::Sending) => self.reset(id, code::STREAM_CLOSED),
            None => return self.on_closed(id, "HEADERS"),
        }
        Ok(())
    }
}
