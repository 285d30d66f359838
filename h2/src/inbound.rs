//! The read side of a connection's loop: the read buffer, the client's preface, and the instants
//! the connection's timer judges (a frame or header block not completed within the frame timeout,
//! the keepalive PING, the idle timeout).

use std::ops::ControlFlow;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::conn::{Conn, ConnError, State, KEEPALIVE, KEEPALIVE_TIMEOUT, TURN};
use crate::frame::{self, code, HEAD, MAX_PAYLOAD, PREFACE};
use crate::service::Service;

/// What a connection has read and when.
pub(crate) struct Inbound {
    /// Bytes read and not yet handled: at most the frame at the head, cut short.
    pub buf: Vec<u8>,
    /// The client's preface has come.
    preface: bool,
    last_read: Instant,
    /// Since when the head of the buffer has been waiting (the preface, from the connection's open).
    partial_since: Option<Instant>,
    /// The keepalive PING sent and not answered by any read.
    ping_sent: Option<Instant>,
    /// When the connection last let other tasks run ([`TURN`]).
    turn: Instant,
}

/// What the connection's timer means when it fires.
pub(crate) enum Tick {
    /// A frame or header block was not completed within the frame timeout: GOAWAY.
    Stuck(ConnError),
    /// The keepalive PING went unanswered: close.
    Dead,
    /// No call within the idle timeout: GOAWAY sent, the connection drains.
    Idle,
    /// Nothing due: look again then.
    Next(Instant),
}

impl Inbound {
    /// A connection opened at `opened`, its preface still to come.
    pub(crate) fn new(opened: Instant) -> Self {
        Inbound {
            buf: Vec::with_capacity(HEAD + MAX_PAYLOAD),
            preface: false,
            last_read: opened,
            partial_since: Some(opened),
            ping_sent: None,
            turn: opened,
        }
    }

    /// Nothing more will arrive: requests still arriving are dropped; those being decided are
    /// answered if the socket still takes it.
    pub(crate) fn closed<S: Service>(&mut self, c: &mut Conn<S>) {
        c.streams.retain(|_, s| s.state == State::Answering);
        c.blocked.clear();
        let parked = c.parked.bytes();
        c.parked.give(parked);
        c.receiving = 0;
        c.continuing = None;
        self.partial_since = None;
    }

    /// Bytes arrived: the client's preface checked (`Break` until it has all come, with the error
    /// if it is not one), then every complete frame handled (`Continue`, with the connection error
    /// a frame made); the timer brought forward if something is left incomplete, and the worker
    /// yielded every [`TURN`].
    pub(crate) async fn on_read<S: Service>(
        &mut self,
        c: &mut Conn<S>,
        mut timer: Pin<&mut Sleep>,
        frame_timeout: Duration,
    ) -> ControlFlow<Option<ConnError>, Option<ConnError>> {
        let now = Instant::now();
        self.last_read = now;
        self.ping_sent = None;
        let mut pos = 0;
        if !self.preface {
            if self.buf.len() < PREFACE.len() {
                if !PREFACE.starts_with(&self.buf) {
                    return ControlFlow::Break(Some(ConnError {
                        code: code::PROTOCOL_ERROR,
                        why: "not an HTTP/2 preface".into(),
                    }));
                }
                return ControlFlow::Break(None);
            }
            if self.buf[..PREFACE.len()] != PREFACE[..] {
                return ControlFlow::Break(Some(ConnError {
                    code: code::PROTOCOL_ERROR,
                    why: "not an HTTP/2 preface".into(),
                }));
            }
            self.preface = true;
            pos = PREFACE.len();
        }
        let mut fatal = None;
        match c.process(&self.buf[pos..]) {
            Ok(used) => pos += used,
            Err(e) => fatal = Some(e),
        }
        self.buf.drain(..pos);
        // Window that came in this read is given to the waiting answers once,
        // however many WINDOW_UPDATE and SETTINGS frames brought it.
        c.flush_if_changed();
        // Since when the head of the buffer has been waiting: a read that completed
        // a frame starts the wait again (a busy connection's reads end mid-frame
        // every time, and that is progress), one that did not keeps it.
        self.partial_since = match (!self.buf.is_empty(), pos > 0) {
            (false, _) => None,
            (true, true) => Some(now),
            (true, false) => self.partial_since.or(Some(now)),
        };
        c.credit();
        // Something incomplete: the timer fires by the time it may be stale.
        if c.incomplete(self.partial_since) && timer.deadline() > now + frame_timeout {
            timer.as_mut().reset(now + frame_timeout);
        }
        if now >= self.turn + TURN {
            tokio::task::yield_now().await;
            self.turn = Instant::now();
        }
        ControlFlow::Continue(fatal)
    }

    /// The timer fired at `now`: a frame or header block stuck, the keepalive PING unanswered, or
    /// no call for the idle timeout; otherwise a PING sent if the connection has been quiet for
    /// [`KEEPALIVE`], stale streams dropped, and when to look again.
    pub(crate) fn on_timer<S: Service>(
        &mut self,
        c: &mut Conn<S>,
        now: Instant,
        frame_timeout: Duration,
        idle_timeout: Duration,
    ) -> Tick {
        // A frame half-sent, or a header block whose CONTINUATIONs keep it open, each from
        // the instant it started.
        let stuck = [self.partial_since, c.continuing.as_ref().map(|b| b.started)];
        if stuck.into_iter().flatten().any(|t| now >= t + frame_timeout) {
            return Tick::Stuck(ConnError {
                code: code::PROTOCOL_ERROR,
                why: format!("a frame or header block was not completed within {frame_timeout:?}"),
            });
        }
        if self.ping_sent.is_some_and(|t| now >= t + KEEPALIVE_TIMEOUT) {
            return Tick::Dead;
        }
        if self.ping_sent.is_none() && now >= self.last_read + KEEPALIVE {
            frame::ping(&mut c.out, [0; 8], false);
            self.ping_sent = Some(now);
        }
        c.drop_stale(now, frame_timeout);
        let quiet = c.streams.is_empty() && c.pending.is_empty();
        if quiet && !c.going_away && now >= c.last_call + idle_timeout {
            // A connection that only answers PINGs holds a slot of the cap: it goes.
            c.going_away = true;
            c.goaway(code::NO_ERROR, "no call within the idle timeout");
            return Tick::Idle;
        }
        let mut next = if c.incomplete(self.partial_since) {
            now + frame_timeout
        } else {
            match self.ping_sent {
                Some(t) => t + KEEPALIVE_TIMEOUT,
                None => (self.last_read + KEEPALIVE).max(now + frame_timeout),
            }
        };
        if quiet && !c.going_away {
            next = next.min(c.last_call + idle_timeout);
        }
        Tick::Next(next)
    }
}
