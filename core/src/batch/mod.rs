//! Batched execution: local counters admitted from the agent's view, flushed to Redis every interval
//! with the global totals learned back, and hot-key promotion.

mod batcher;
mod counter;
mod hot;
mod map;

pub use batcher::{BatchStats, Batcher, FlushEntry, Learned, DEFAULT_FLUSH_MS, DEFAULT_MAX_KEYS};
pub use counter::{Counter, Denial};
pub use hot::HotKeys;
