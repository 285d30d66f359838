//! A node's replies: read in the order the calls were written, each given to whoever waits for it;
//! NOSCRIPT loads the script and sends the call once more.

use std::sync::atomic::Ordering;
use std::time::Instant;

use floodgate_core::metrics;
use floodgate_core::store::StoreError;

use super::calls::{fail, Pending, Waiter};
use super::task::Node;
use crate::store::call;
use crate::store::coalesce::MAX_IN_FLIGHT;
use crate::store::resp::{self, Reply, RespError, MAX_REPLY};

impl Node {
    /// Answers every reply read so far.
    pub(super) async fn on_data(&mut self) {
        let mut again = Vec::new();
        let broken = loop {
            let (reply, used) = match resp::parse(&self.rbuf[self.rpos..]) {
                Ok(r) => r,
                Err(RespError::Incomplete) if self.rbuf.len() - self.rpos > MAX_REPLY => {
                    break Some("a reply longer than any the check script gives".to_string())
                }
                Err(RespError::Incomplete) => break None,
                Err(e) => break Some(e.to_string()),
            };
            self.rpos += used;
            let Some(mut p) = self.pending.pop_front() else {
                break Some("a reply no call waits for".into());
            };
            if let Reply::Error(e) = &reply {
                if e.starts_with("NOSCRIPT") && !p.resent {
                    p.resent = true;
                    again.push(p);
                    continue;
                }
            }
            self.answer(&mut p, reply);
            if self.spare.len() < MAX_IN_FLIGHT * 2 {
                self.spare.push(std::mem::take(&mut p.cmd));
            }
        };
        if let Some(why) = broken {
            let e = StoreError::Connection(why);
            for p in again {
                metrics::redis_call(self.task.shard, false);
                fail(p.waiter, &e);
            }
            self.drop_conn(e);
            return;
        }
        // What is left is the start of a reply still arriving: moved to the front, so the buffer never
        // grows past the longest reply.
        self.rbuf.drain(..self.rpos);
        self.rpos = 0;
        // NOSCRIPT: load the script, then the same call once more (its reply comes after the load's).
        for p in again {
            let load = Pending {
                waiter: Waiter::Load,
                items: 0,
                deadline: p.deadline,
                cmd: self.load.clone(),
                resent: true,
                traced: None,
            };
            self.send(load).await;
            self.send(p).await;
        }
    }

    /// Gives a call's reply to whoever waits for it.
    fn answer(&self, p: &mut Pending, reply: Reply) {
        if !p.resent && matches!(p.waiter, Waiter::Checks(_)) {
            // A check call's time, sent to answered (its deadline is its send plus the checks'
            // timeout; a raw call has a timeout of its own), in a moving average of 1/8 per call:
            // what a check sent now should expect to wait.
            let took = Instant::now()
                .saturating_duration_since(p.deadline - self.task.timeout)
                .as_micros() as u64;
            let rtt = self.state.rtt_us.load(Ordering::Relaxed);
            // The first call sets it; after that each moves it by an eighth.
            let rtt = if rtt == 0 { took } else { (rtt * 7 + took) / 8 };
            self.state.rtt_us.store(rtt.max(1), Ordering::Relaxed);
        }
        let waiter = std::mem::replace(&mut p.waiter, Waiter::Load);
        let result = match reply {
            Reply::Ints(v) if v.len() == p.items * 5 => Ok(v),
            Reply::Ints(v) => Err(StoreError::Script(format!(
                "script returned {} values for {} items",
                v.len(),
                p.items
            ))),
            Reply::Error(e) => Err(crate::store::errors::reply_error("", e)),
            Reply::Int(_) | Reply::Other => {
                Err(StoreError::Script("script returned no array of integers".into()))
            }
        };
        if !matches!(waiter, Waiter::Load) {
            // A reply past its deadline came too late for its callers: counted as the failure it was.
            metrics::redis_call(self.task.shard, result.is_ok() && Instant::now() <= p.deadline);
        }
        if let Some(t) = p.traced.take() {
            let (served, checks, sent) = *t;
            floodgate_core::call_trace::report(floodgate_core::call_trace::CallReport {
                shard: self.task.shard,
                checks,
                items: p.items,
                sent,
                answered: Instant::now(),
                ok: result.is_ok(),
                served,
                server: self.task.addr.server(),
            });
        }
        match (waiter, result) {
            (Waiter::Load, _) => {}
            (Waiter::Raw(reply), result) => {
                let _ = reply.send(result);
            }
            (Waiter::Checks(checks), Ok(v)) => {
                let mut at = 0;
                for (n, reply) in checks {
                    let outcomes = v[at..at + n * 5].chunks_exact(5).map(call::outcome).collect();
                    at += n * 5;
                    let _ = reply.send(Ok(outcomes));
                }
            }
            (Waiter::Checks(checks), Err(e)) => {
                for (_, reply) in checks {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}
