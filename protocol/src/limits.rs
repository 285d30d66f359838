//! Protocol constants: the version, frame kinds and the size limits every peer enforces.

/// The highest protocol version this crate speaks (2: the fail-mode list and item modes; 3: leases
/// and releases of concurrency rules; 4: each decided item's rule window; 5: a check's trace
/// context; 6: reservations, reserved and committed).
pub const VERSION: u8 = 6;

/// The lowest protocol version this crate speaks.
pub const MIN_VERSION: u8 = 1;

/// Largest frame on the wire, the 4-byte length prefix included (64 KiB).
pub const MAX_FRAME: usize = 64 * 1024;

/// Bytes of the length prefix.
pub const LEN_PREFIX: usize = 4;

/// Bytes after the length prefix that every frame carries: version, kind, request id.
pub const HEADER: usize = 1 + 1 + 4;

/// Most items one `Check` frame may carry.
pub const MAX_ITEMS: usize = 16;

/// Longest key, in bytes of UTF-8.
pub const MAX_KEY: usize = 256;

/// Longest rule id, in bytes.
pub const MAX_RULE_ID: usize = 128;

/// Longest request attribute (endpoint, tier, user, API key, IP), in bytes of UTF-8.
pub const MAX_ATTRIBUTE: usize = 256;

/// Longest error message an agent sends, in bytes of UTF-8.
pub const MAX_MESSAGE: usize = 1024;

/// Frame kinds (the byte after the version).
pub mod kind {
    /// Client → agent: version negotiation.
    pub const HELLO: u8 = 0x01;
    /// Agent → client: the chosen version.
    pub const HELLO_OK: u8 = 0x02;
    /// Client → agent: a limit check.
    pub const CHECK: u8 = 0x03;
    /// Agent → client: the answer to a check.
    pub const DECISION: u8 = 0x04;
    /// Either way: an error about one request or the connection.
    pub const ERROR: u8 = 0x05;
    /// Client → agent: liveness probe.
    pub const PING: u8 = 0x06;
    /// Agent → client: answer to a ping.
    pub const PONG: u8 = 0x07;
    /// Client → agent (version 2): which rules fail closed.
    pub const FAIL_MODES: u8 = 0x08;
    /// Agent → client (version 2): the rules that fail closed.
    pub const FAIL_MODE_LIST: u8 = 0x09;
}
