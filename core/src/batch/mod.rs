//! Batched execution: local counters admitted from the agent's view, flushed to Redis every interval
//! with the global totals learned back, and hot-key promotion.

mod batcher;
mod counter;
mod flush;
mod hot;
mod map;

pub use batcher::{BatchStats, Batcher, DEFAULT_FLUSH_MS, DEFAULT_MAX_KEYS};
pub use counter::{Counter, Denial};
pub use flush::{FlushEntry, Learned};
pub use hot::HotKeys;
