//! The frames a client sends, handled in the order they arrive: what each does to the streams, the
//! windows and the budgets, and which are connection errors (RFC 9113 §5 and §6). A header block
//! (HEADERS, CONTINUATION) and the stream it opens are `headers.rs`'.

use crate::budget::Closed;
use crate::conn::{conn_error, Conn, ConnError, State, STREAM_WINDOW};
use crate::frame::{self, code, flag, kind, setting, Head, HEAD, MAX_PAYLOAD, MAX_WINDOW};
use crate::grpc::{self, status};
use crate::service::Service;

impl<S: Service> Conn<S> {
    /// Handles every complete frame in `buf`: the bytes used.
    pub(crate) fn process(&mut self, buf: &[u8]) -> Result<usize, ConnError> {
        let mut pos = 0;
        while let Some(h) = Head::parse(&buf[pos..]) {
            if h.len > MAX_PAYLOAD {
                return conn_error(
                    code::FRAME_SIZE_ERROR,
                    format!("a frame of {} bytes; at most {MAX_PAYLOAD}", h.len),
                );
            }
            let Some(payload) = buf.get(pos + HEAD..pos + HEAD + h.len) else {
                break;
            };
            pos += HEAD + h.len;
            self.frame(h, payload)?;
        }
        Ok(pos)
    }

    fn frame(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if let Some(b) = &self.continuing {
            if h.kind != kind::CONTINUATION || h.stream != b.stream {
                return conn_error(code::PROTOCOL_ERROR, "a header block interrupted");
            }
        }
        match h.kind {
            kind::DATA => self.data(h, payload),
            kind::HEADERS => self.headers(h, payload),
            kind::CONTINUATION => self.continuation(h, payload),
            kind::RST_STREAM => {
                if h.len != 4 {
                    return conn_error(code::FRAME_SIZE_ERROR, "RST_STREAM of a length other than 4");
                }
                if h.stream == 0 || h.stream > self.last_stream {
                    return conn_error(code::PROTOCOL_ERROR, "RST_STREAM of an idle stream");
                }
                // A stream reset before its answer was written: work the client did not wait for.
                if self.remove(h.stream, Closed::Done) {
                    self.spend_calm();
                }
                Ok(())
            }
            kind::SETTINGS => self.settings(h, payload),
            kind::PING => {
                if h.len != 8 {
                    return conn_error(code::FRAME_SIZE_ERROR, "PING of a length other than 8");
                }
                if h.stream != 0 {
                    return conn_error(code::PROTOCOL_ERROR, "PING on a stream");
                }
                if !h.has(flag::ACK) {
                    let mut p = [0; 8];
                    p.copy_from_slice(payload);
                    frame::ping(&mut self.out, p, true);
                }
                Ok(())
            }
            kind::GOAWAY => {
                self.peer_gone = true;
                Ok(())
            }
            kind::WINDOW_UPDATE => self.window_update(h, payload),
            kind::PUSH_PROMISE => conn_error(code::PROTOCOL_ERROR, "a client sent PUSH_PROMISE"),
            kind::PRIORITY => self.priority(h, payload),
            // Unknown kinds: ignored (§5.5).
            _ => Ok(()),
        }
    }

    /// PRIORITY: read for its faults only (this server does not prioritize; §5.3.2 deprecates it).
    fn priority(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream == 0 {
            return conn_error(code::PROTOCOL_ERROR, "PRIORITY on stream 0");
        }
        if h.len != 5 {
            frame::rst_stream(&mut self.out, h.stream, code::FRAME_SIZE_ERROR);
            self.remove(h.stream, Closed::ByUs);
            return Ok(());
        }
        if depends_on_itself(h.stream, payload) {
            self.reset_any(h.stream, code::PROTOCOL_ERROR);
        }
        Ok(())
    }

    /// A stream error on `id`, open or not.
    pub(crate) fn reset_any(&mut self, id: u32, code: u32) {
        if self.streams.contains_key(&id) {
            self.reset(id, code);
        } else {
            frame::rst_stream(&mut self.out, id, code);
            self.closed.push(id, Closed::ByUs);
        }
    }

    /// A HEADERS or DATA frame on stream `id`, which is not open and not idle: ignored if this
    /// server reset it (the client may have sent it before it knew), else a connection error.
    pub(crate) fn on_closed(&mut self, id: u32, what: &str) -> Result<(), ConnError> {
        match self.closed.get(id) {
            Some(Closed::ByUs) => Ok(()),
            Some(Closed::Done) => conn_error(
                code::STREAM_CLOSED,
                format!("{what} on stream {id}, which is closed"),
            ),
            // Never opened (skipped over), or closed too long ago to tell (§5.1.1).
            None => conn_error(
                code::PROTOCOL_ERROR,
                format!(
                    "{what} on stream {id}, lower than stream {} already opened",
                    self.last_stream
                ),
            ),
        }
    }

    fn data(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream == 0 || h.stream > self.last_stream {
            return conn_error(code::PROTOCOL_ERROR, "DATA on stream 0 or an idle stream");
        }
        self.recv_window -= h.len as i64;
        if self.recv_window < 0 {
            return conn_error(code::FLOW_CONTROL_ERROR, "DATA past the connection's window");
        }
        let Some(range) = frame::unpadded(&h, payload) else {
            return conn_error(code::PROTOCOL_ERROR, "padding longer than its frame");
        };
        // Bytes of a stream not receiving are credited back at once.
        match self.streams.get(&h.stream).map(|s| s.state) {
            Some(State::Receiving) => {}
            Some(State::Answering | State::Sending) => {
                self.uncredited += h.len as i64;
                self.reset(h.stream, code::STREAM_CLOSED);
                return Ok(());
            }
            None => {
                self.uncredited += h.len as i64;
                return self.on_closed(h.stream, "DATA");
            }
        }
        let Some(s) = self.streams.get_mut(&h.stream) else {
            return Ok(());
        };
        s.received += h.len;
        s.uncredited += h.len;
        if s.received > STREAM_WINDOW {
            self.reset(h.stream, code::FLOW_CONTROL_ERROR);
            return Ok(());
        }
        let chunk = &payload[range];
        // A request in one DATA frame (the usual) is decoded from the frame; else it is gathered.
        let whole = s.body.is_empty() && h.has(flag::END_STREAM);
        if !whole {
            if s.body.is_empty() {
                s.body
                    .reserve(grpc::declared_len(chunk).map_or(0, |n| 5 + n.min(grpc::MAX_MESSAGE)));
            }
            s.body.extend_from_slice(chunk);
        }
        let declared = grpc::declared_len(if whole { chunk } else { &s.body }).unwrap_or(0);
        if declared > grpc::MAX_MESSAGE {
            let why = format!(
                "a request message of {declared} bytes; at most {}",
                grpc::MAX_MESSAGE
            );
            self.trailers_only(h.stream, status::RESOURCE_EXHAUSTED, &why);
            // Answered: the client may stop sending.
            frame::rst_stream(&mut self.out, h.stream, code::NO_ERROR);
            self.closed.push(h.stream, Closed::ByUs);
            return Ok(());
        }
        if h.has(flag::END_STREAM) {
            self.dispatch(h.stream, whole.then_some(chunk));
        }
        Ok(())
    }

    /// A SETTINGS frame: its entries read in order, a new initial window applied to the streams
    /// once (its last value), the acknowledgement queued. Each costs the client a unit of calm.
    fn settings(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream != 0 {
            return conn_error(code::PROTOCOL_ERROR, "SETTINGS on a stream");
        }
        if h.has(flag::ACK) {
            return if h.len == 0 {
                Ok(())
            } else {
                conn_error(
                    code::FRAME_SIZE_ERROR,
                    "a SETTINGS acknowledgement with a payload",
                )
            };
        }
        if !h.len.is_multiple_of(6) {
            return conn_error(code::FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6");
        }
        let mut initial = None;
        for entry in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let v = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::INITIAL_WINDOW_SIZE => {
                    if i64::from(v) > MAX_WINDOW {
                        return conn_error(code::FLOW_CONTROL_ERROR, "an initial window past 2^31-1");
                    }
                    initial = Some(i64::from(v));
                }
                setting::ENABLE_PUSH if v > 1 => {
                    return conn_error(code::PROTOCOL_ERROR, "ENABLE_PUSH other than 0 or 1")
                }
                setting::MAX_FRAME_SIZE if !(16_384..=16_777_215).contains(&v) => {
                    return conn_error(code::PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                }
                // The rest change nothing here: this server never pushes, sends frames of at most
                // 16 KiB, and encodes without the dynamic table.
                _ => {}
            }
        }
        // The first SETTINGS is the client's preface, and costs nothing.
        if self.settled {
            self.spend_calm();
        }
        self.settled = true;
        if let Some(v) = initial.filter(|v| *v != self.peer_initial) {
            let delta = v - self.peer_initial;
            self.peer_initial = v;
            for s in self.streams.values_mut() {
                s.send_window += delta;
                if s.send_window > MAX_WINDOW {
                    return conn_error(code::FLOW_CONTROL_ERROR, "a stream's window past 2^31-1");
                }
            }
            self.window_changed |= delta > 0;
        }
        frame::settings_ack(&mut self.out);
        Ok(())
    }

    fn window_update(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.len != 4 {
            return conn_error(code::FRAME_SIZE_ERROR, "WINDOW_UPDATE of a length other than 4");
        }
        let inc =
            i64::from(u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) & 0x7fff_ffff);
        if h.stream == 0 {
            if inc == 0 {
                return conn_error(code::PROTOCOL_ERROR, "a connection window update of 0");
            }
            self.send_window += inc;
            if self.send_window > MAX_WINDOW {
                return conn_error(
                    code::FLOW_CONTROL_ERROR,
                    "a connection window update of 0 or past 2^31-1",
                );
            }
            self.window_changed = true;
        } else if let Some(s) = self.streams.get_mut(&h.stream) {
            s.send_window += inc;
            if inc == 0 {
                self.reset(h.stream, code::PROTOCOL_ERROR);
            } else if s.send_window > MAX_WINDOW {
                self.reset(h.stream, code::FLOW_CONTROL_ERROR);
            } else {
                self.window_changed |= s.state == State::Sending;
            }
        } else if h.stream > self.last_stream {
            return conn_error(code::PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream");
        }
        Ok(())
    }
}

/// Whether a priority block (stream dependency, weight) names its own stream (§5.3.1: a stream error).
pub(crate) fn depends_on_itself(stream: u32, priority: &[u8]) -> bool {
    priority.len() >= 4
        && u32::from_be_bytes([priority[0], priority[1], priority[2], priority[3]]) & 0x7fff_ffff == stream
}
