//! Floodgate's wire protocol: the frames a service (through the SDK) and its local agent exchange over
//! a Unix socket. This crate knows nothing about Redis, tokio or sockets: it turns frames into bytes and
//! bytes into frames, and enforces the limits. `PROTOCOL.md` beside this crate documents every byte.
//!
//! # Layout
//! - [`limits`]: the version, frame kinds and size limits.
//! - `frame`: the frames as Rust values ([`Frame`], [`Body`], [`Check`], [`Item`], …).
//! - `decision`: what a check is answered with ([`Decision`], [`Verdict`], [`Source`], [`ErrorBody`]).
//! - `codec`: [`Frame::encode`] and [`decode`]; decoding never panics on any input.
//! - `error`: [`DecodeError`], [`EncodeError`] and the wire [`ErrorCode`]s.
//! - `fail_modes`: version 2's [`FailModeList`], which checks it closes, and [`endpoint_matches`].
//! - `trace`: version 5's [`TraceContext`] (W3C `traceparent`), carried by a check.
//! - [`http`]: what a decision means at HTTP (the rate-limit headers, `Retry-After`, [`http::wire_safe`]).
//!
//! # Example
//! ```
//! use floodgate_protocol::{decode, Body, Check, Frame, Item};
//!
//! let frame = Frame::new(7, Body::Check(Check::Items(vec![Item::new("user:123", "api", 1)])));
//! let bytes = frame.to_bytes().unwrap();
//! let (back, used) = decode(&bytes).unwrap();
//! assert_eq!(back, frame);
//! assert_eq!(used, bytes.len());
//! ```

mod codec;
mod decision;
mod error;
mod fail_modes;
mod frame;
pub mod http;
pub mod limits;
mod trace;

pub use codec::{decode, VERDICT_LEN};
pub use error::{DecodeError, EncodeError, ErrorCode, InvalidValue};
pub use fail_modes::{endpoint_matches, ClosedRule, FailModeList, ListedDimension, LIST_HEAD};
pub use frame::{
    validate_rule_id, Attributes, Body, Check, CompactString, Decision, ErrorBody, Frame, Item, ItemDecision,
    ItemMode, Source, Verdict,
};
pub use limits::{MAX_ATTRIBUTE, MAX_FRAME, MAX_ITEMS, MAX_KEY, MAX_RULE_ID, MIN_VERSION, VERSION};
pub use trace::{push_hex, TraceContext};
