//! A check's routes to Redis: on independent nodes, straight to the node's own connection (`node`);
//! on a Cluster or a Sentinel-named master, through a call group's coalescing worker (`coalesce`) or,
//! with coalescing off, one call of its own through redis-rs. Also the check script's raw calls
//! (adjustments, the breaker's probe), which take the same connections.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{Cmd, ErrorKind, ServerErrorKind};

use floodgate_core::algo::Outcome;
use floodgate_core::metrics;
use floodgate_core::store::{Planned, StoreError};

use super::call::{self, CallItem};
use super::errors::classify;
use super::{answer, ask, coalesce, node, RedisStore};

impl RedisStore {
    /// Checks the items of one check atomically (all or nothing); outcomes come back in item order.
    /// Every item must have the same route (the engine groups them). With coalescing on, checks that
    /// arrive together for one call group share a script call (`coalesce`), each still all or
    /// nothing; the wait is bounded by the store timeout either way.
    pub async fn check(
        self: &Arc<Self>,
        items: Vec<Planned>,
        received: Instant,
    ) -> Result<Vec<Outcome>, StoreError> {
        let items = match self.check_on_pipe(items, received) {
            Ok(answer) => return answer.await,
            Err(items) => items,
        };
        let Some(first) = items.first() else {
            return Ok(Vec::new());
        };
        let route = self.route(&first.key);
        if self.coalesce <= 1 {
            let mut reply = self.call_direct(route.shard, vec![items]).await?;
            return Ok(reply.pop().unwrap_or_default());
        }
        let workers = self.workers.get_or_init(|| {
            let calls = if self.shards.is_cluster() {
                self.layout.tags() as usize
            } else {
                self.shards.len()
            };
            (0..calls)
                .map(|call| {
                    let shard = if self.shards.is_cluster() { 0 } else { call };
                    coalesce::spawn(Arc::downgrade(self), shard, self.coalesce)
                })
                .collect()
        });
        let worker = &workers[route.call as usize % workers.len()];
        let deadline = received + self.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(StoreError::Shed);
        }
        ask(left, |reply| {
            worker
                .send(coalesce::Job {
                    items,
                    reply,
                    deadline,
                    // The Cluster's and Sentinel's calls (redis-rs) are not reported.
                    span: None,
                    seq: 0,
                })
                .is_ok()
        })
        .await
    }

    /// Hands a check to its node's own connection (`node/`) at once and returns the wait for its
    /// answer: a oneshot and a timer, 168 bytes, where `check`'s whole future (which also holds the
    /// redis-rs paths' calls) is 1,152 bytes, past glibc's per-thread cache of small blocks (1,032
    /// bytes): boxed on its own, the common path's future no longer takes malloc's slow path.
    /// `Err` gives the items back: no node connections (a Cluster, Sentinel), or nothing to check.
    pub(super) fn check_on_pipe(
        &self,
        items: Vec<Planned>,
        received: Instant,
    ) -> Result<impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send + 'static, Vec<Planned>> {
        let (Some(pipes), Some(first)) = (self.pipes(), items.first()) else {
            return Err(items);
        };
        let pipe = &pipes[self.route(&first.key).shard % pipes.len()];
        // The budget runs from the frame's read. Past capacity (the node's queue already waits
        // longer than a check may: its task says so), or with no time left, the check is shed at
        // once: answered by its rules' fail modes without a queue, a timer or a call.
        let deadline = received + self.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        let (reply, rx) = tokio::sync::oneshot::channel();
        let job = coalesce::Job {
            items,
            reply,
            deadline,
            span: floodgate_core::call_trace::current(),
            seq: 0,
        };
        let queued = pipe.send_check(job, left).ok();
        let closed = queued.is_none() && pipe.tx.is_closed();
        Ok(async move {
            if closed {
                return Err(StoreError::Connection("store is shutting down".into()));
            }
            let Some(queued) = queued else {
                return Err(StoreError::Shed);
            };
            match answer(true, rx, left).await {
                // Its budget ran out while it still waited in the agent's own queue (both of the
                // node's calls busy): it never reached Redis, so it is a shed check, which the
                // breaker does not count, not a Redis timeout. Counted as one, an agent that is
                // only behind opened its breaker on a Redis that answered every call.
                Err(StoreError::Timeout(_)) if !queued.sent() => Err(StoreError::Shed),
                answered => answered,
            }
        })
    }

    /// Runs queued checks of one call group as one script call and answers each.
    pub(crate) async fn run_coalesced(&self, shard: usize, jobs: Vec<coalesce::Job>) {
        // A check whose caller gave up (its timeout passed) is not sent: nobody would learn whether
        // it counted.
        let jobs: Vec<coalesce::Job> = jobs.into_iter().filter(|j| !j.reply.is_closed()).collect();
        if jobs.is_empty() {
            return;
        }
        let (checks, replies): (Vec<Vec<Planned>>, Vec<_>) =
            jobs.into_iter().map(|j| (j.items, j.reply)).unzip();
        match self.call_direct(shard, checks).await {
            Ok(outcomes) => {
                for (reply, o) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(o));
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// One script call for several checks (each all or nothing): outcomes per check, in order.
    async fn call_direct(
        &self,
        shard: usize,
        checks: Vec<Vec<Planned>>,
    ) -> Result<Vec<Vec<Outcome>>, StoreError> {
        let items = call::check_items(checks.iter().map(Vec::as_slice));
        let reply = self
            .invoke(&self.check_cmd(&items), shard, items.len(), self.timeout)
            .await?;
        let mut outcomes = reply.chunks_exact(5).map(call::outcome);
        Ok(checks
            .iter()
            .map(|items| outcomes.by_ref().take(items.len()).collect())
            .collect())
    }

    /// The check script's EVALSHA for `items`, as a redis-rs command.
    pub(super) fn check_cmd(&self, items: &[CallItem<'_>]) -> Cmd {
        call::check_cmd(self.script.get_hash(), &self.layout, items)
    }

    /// Runs a check-script command on `shard` within `timeout`; a Redis that lost the script
    /// (NOSCRIPT: restarted, or flushed) gets it loaded and the command again.
    pub(super) async fn invoke(
        &self,
        cmd: &Cmd,
        shard: usize,
        items: usize,
        timeout: Duration,
    ) -> Result<Vec<i64>, StoreError> {
        if let Some(pipes) = self.pipes() {
            // The node's own connection (it answers only with `items` × 5 integers, and counts the call).
            let pipe = &pipes[shard % pipes.len()];
            return ask(timeout, |reply| {
                let cmd = cmd.get_packed_command();
                pipe.tx
                    .send(node::Request::Raw {
                        cmd,
                        items,
                        timeout,
                        reply,
                    })
                    .is_ok()
            })
            .await;
        }
        let call = async {
            let mut conn = self.shards.conn(shard).await?;
            match cmd.query_async::<Vec<i64>>(&mut conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    self.script.load_async(&mut conn).await.map_err(classify)?;
                    cmd.query_async::<Vec<i64>>(&mut conn).await.map_err(classify)
                }
                reply => reply.map_err(classify),
            }
        };
        let reply = tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| StoreError::Timeout(timeout))
            .and_then(|r| r)
            .and_then(|reply| {
                if reply.len() == items * 5 {
                    Ok(reply)
                } else {
                    Err(StoreError::Script(format!(
                        "script returned {} values for {items} items",
                        reply.len()
                    )))
                }
            });
        metrics::redis_call(shard, reply.is_ok());
        reply
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RedisConfig;
    use floodgate_core::rules::RuleSet;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A node that signs in (answers the PING) and then takes every call without answering; the
    /// watch counts the script calls it has read.
    async fn silent_node() -> (u16, tokio::sync::watch::Receiver<usize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (calls, seen) = tokio::sync::watch::channel(0);
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut read = Vec::new();
            let mut buf = [0u8; 4096];
            let mut answered_ping = false;
            loop {
                let n = s.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    return;
                }
                read.extend_from_slice(&buf[..n]);
                if !answered_ping && read.windows(4).any(|w| w == b"PING") {
                    s.write_all(b"+PONG\r\n").await.unwrap();
                    answered_ping = true;
                }
                let _ = calls.send(read.windows(7).filter(|w| w == b"EVALSHA").count());
            }
        });
        (port, seen)
    }

    #[tokio::test]
    async fn a_check_whose_budget_ends_in_the_agents_own_queue_is_shed_not_a_timeout() {
        let (port, mut seen) = silent_node().await;
        let timeout = Duration::from_secs(2);
        let mut config = RedisConfig::single(&format!("redis://127.0.0.1:{port}"), timeout);
        config.coalesce = 1; // one check per call: two checks hold both of the node's calls
        let store = RedisStore::new(&config).unwrap();
        let rules =
            RuleSet::parse(r#"{"rules":[{"id":"r","dimension":"user","limit":5,"windowSeconds":60}]}"#)
                .unwrap();
        let check = |received| {
            let items = vec![Planned::consume(rules.get("r").unwrap().clone(), "user:a", 1)];
            store.check_on_pipe(items, received).ok().unwrap()
        };
        let first = tokio::spawn(check(Instant::now()));
        let second = tokio::spawn(check(Instant::now()));
        seen.wait_for(|&calls| calls >= 2).await.unwrap();
        // Both calls are on the wire and unanswered; this check waits behind them in the agent's
        // queue, and its budget (0.5 s left) ends long before theirs (2 s) free a call.
        let queued = check(Instant::now() - Duration::from_millis(1_500)).await;
        assert!(
            matches!(queued, Err(StoreError::Shed)),
            "a check that never left the agent's queue is shed, not Redis's timeout: {queued:?}"
        );
        for sent in [first.await.unwrap(), second.await.unwrap()] {
            assert!(
                matches!(sent, Err(StoreError::Timeout(_))),
                "a call Redis took and never answered is Redis's timeout: {sent:?}"
            );
        }
    }
}
