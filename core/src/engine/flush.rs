//! One flush pass of the batched counters: the entries of every due rule, sent per shard, the
//! replies applied (the agent's flush loop runs it every few ms; the model test on its own clock).

use std::sync::Arc;

use super::Engine;
use crate::rules::Rule;
use crate::shared_store::SharedStore;
use crate::store::StoreError;

impl Engine {
    /// One flush: the entries of every due rule (all when `force`), sent per shard, the replies
    /// applied. Returns the number of entries sent.
    pub async fn flush_batched(&self, store: &dyn SharedStore, force: bool) -> usize {
        let batcher = self.batcher();
        if batcher.keys() == 0 {
            return 0;
        }
        let rules: Vec<Arc<Rule>> = self.rules().iter().cloned().collect();
        let entries = batcher.take_due(&rules, self.live_agents(), force);
        let sent = entries.len();
        if sent == 0 {
            return 0;
        }
        for (chunk, reply) in store.flush(entries).await {
            match reply {
                Ok(r) => {
                    batcher.learn_clock(r.now_ms, r.sent_ms, r.answered_ms);
                    batcher.apply(&chunk, Ok(&r.learned));
                }
                Err(e) => {
                    tracing::debug!(error = %e, entries = chunk.len(), "flush failed");
                    let surely = !matches!(e, StoreError::Timeout(_));
                    batcher.apply(&chunk, Err(surely));
                }
            }
        }
        sent
    }
}
