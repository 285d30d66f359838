//! The Lua scripts Redis runs, embedded at build time, and the key of the live-agents set.

/// The check script, embedded at build time: the four algorithms' functions and the all-or-nothing
/// driver, as one script with one SHA (see `lua/check.lua`).
pub const CHECK_LUA: &str = concat!(
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/concurrency.lua"),
    include_str!("../../../lua/quota.lua"),
    include_str!("../../../lua/check.lua"),
);

/// The heartbeat script: Redis TIME as the clock, so agents' clocks need not agree.
pub const HEARTBEAT_LUA: &str = include_str!("../../../lua/heartbeat.lua");

/// Key of the live-agents set (its own hash tag, so on a cluster it lives on one slot).
pub const AGENTS_KEY: &str = "fg:{agents}:live";

/// The flush script of batched rules (see `lua/flush.lua`).
pub const FLUSH_LUA: &str = concat!(
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/flush.lua"),
);
