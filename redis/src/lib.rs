//! Redis as the fleet's shared counter store: the [`SharedStore`](floodgate_core::shared_store::SharedStore)
//! the agent's engine asks, and the rejection events' stream writer.
//!
//! # Map
//! - [`store`]: [`RedisStore`]: one atomic Lua script call per check (per shard), EVALSHA with a
//!   reload on NOSCRIPT, bounded timeouts, errors classified for the rule's fail mode. In `store/`:
//!   `routes.rs`, a check's way to Redis; `upkeep.rs`, flushes of batched counts, adjustments
//!   (write-back, take-back), probes, preloads and heartbeats; `scripts.rs`; `errors.rs`; `call.rs`,
//!   check.lua's arguments; `resp.rs`, RESP written and read; `node/`: on independent nodes, the
//!   check path's own connection per node (one task writes the coalesced EVALSHA as RESP and answers
//!   each check from the reply); `coalesce.rs`: the same coalescing for a Cluster or a
//!   Sentinel-named master, through redis-rs.
//! - [`shards`]: independent nodes, a Redis Cluster or a Sentinel-named master; TLS and AUTH.
//! - `sentinel`: the master the sentinels name, asked again after a failed call.
//! - `cluster_watch`: a Cluster's failovers, from its slot map.
//! - [`events`]: the rejection events' writer (`XADD … MAXLEN ~`).

mod cluster_watch;
pub mod events;
mod sentinel;
pub mod shards;
pub mod store;

pub use store::{
    RedisConfig, RedisStore, ADJUST_CHUNK, AGENTS_KEY, CHECK_LUA, DEFAULT_COALESCE, FLUSH_CHUNK, FLUSH_LUA,
    HEARTBEAT_LUA,
};
