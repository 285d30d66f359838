//! Encoding frames to bytes (`encode.rs`) and decoding them back (`decode.rs`); the decoder never
//! panics on any input. Here: the constants both sides read the wire with.

mod decode;
mod encode;

pub use decode::decode;

/// Bytes of one encoded [`Verdict`].
pub const VERDICT_LEN: usize = 2 + 4 * 8;

pub(super) const FLAG_ALLOWED: u8 = 0b01;
pub(super) const FLAG_LOG_ONLY: u8 = 0b10;
pub(super) const FLAG_HOLDS_LEASE: u8 = 0b100;
/// Version 6: allowed past the limit of a rule with `overLimit = "flag"`, counting nothing.
pub(super) const FLAG_OVER_QUOTA: u8 = 0b1000;
/// The version that introduced the over-quota flag: never set for an older peer.
pub(super) const OVER_QUOTA: u8 = 6;
/// In a mode byte (version 3): a `lease u64` follows.
pub(super) const MODE_LEASE: u8 = 0x80;
pub(super) const FORM_ITEMS: u8 = 0;
pub(super) const FORM_ATTRIBUTES: u8 = 1;
pub(super) const FORM_ITEMS_MODES: u8 = 2;
pub(super) const FORM_ATTRIBUTES_MODE: u8 = 3;
/// Version 5: a trace context, then another form.
pub(super) const FORM_TRACED: u8 = 4;
pub(super) const LIST_TRUNCATED: u8 = 0b01;
/// The version whose Decision carries each item's rule window.
pub(super) const WINDOWS: u8 = 4;
