//! What one call of the check script carries: its items, and the EVALSHA built from them (the
//! checks' and the breaker probe's: check.lua's argument layout lives here only), either as a
//! redis-rs `Cmd` (a Cluster or a Sentinel-named master) or as RESP bytes for the check path's own
//! node connection (`node`).

use floodgate_core::algo::Outcome;
use floodgate_core::rules::{Algorithm, Rule};
use floodgate_core::store::{ItemMode, Layout, Planned};
use redis::Cmd;

use super::resp;

/// One item of a check-script call: what it counts, and how (`mode` 1 enforce, 0 log, 2 add and 3
/// take back into window `target`, 4 peek, 5 charge, 6 release lease `target`, 7 release by count);
/// `last` closes a check (all or nothing up to it).
pub(super) struct CallItem<'a> {
    pub(super) rule: &'a Rule,
    pub(super) key: &'a str,
    pub(super) cost: u64,
    pub(super) mode: u8,
    pub(super) target: u64,
    pub(super) last: bool,
}

/// The items of checks sent as one call, in order, each check closed by its last item.
pub(super) fn check_items<'a>(checks: impl IntoIterator<Item = &'a [Planned]>) -> Vec<CallItem<'a>> {
    let mut items = Vec::new();
    for check in checks {
        for (i, p) in check.iter().enumerate() {
            items.push(CallItem {
                rule: &p.rule,
                key: &p.key,
                cost: p.cost,
                mode: match p.mode {
                    // A reserve takes its cost as a consume does (the agent holds the reservation).
                    ItemMode::Consume | ItemMode::Reserve if p.rule.enforced() => 1,
                    ItemMode::Consume | ItemMode::Reserve => 0,
                    ItemMode::Peek => 4,
                    // A commit reaches the store only as the charge of what its use adds (the
                    // engine settles it into a charge, a look or a release first).
                    ItemMode::Charge | ItemMode::Commit => 5,
                    ItemMode::Release if p.lease.id().is_some() => 6,
                    ItemMode::Release => 7,
                },
                // A concurrency item's lease goes where a write-back's window does (a rate rule's
                // reservation id stays in the agent: its target is the window holding now).
                target: p.lease.id().filter(|_| p.rule.is_concurrency()).unwrap_or(0),
                last: i + 1 == check.len(),
            });
        }
    }
    items
}

/// One item's five figures in the script's reply.
pub(super) fn outcome(v: &[i64]) -> Outcome {
    let u = |x: i64| x.max(0) as u64;
    Outcome {
        allowed: v[0] == 1,
        limit: u(v[1]),
        remaining: u(v[2]),
        reset_at_ms: u(v[3]),
        retry_after_ms: u(v[4]),
    }
}

/// Where a command's arguments go: a redis-rs `Cmd`, or a RESP buffer.
pub(super) trait Args {
    fn text(&mut self, s: &str);
    fn num(&mut self, n: u64);
}

impl Args for Cmd {
    fn text(&mut self, s: &str) {
        self.arg(s);
    }
    fn num(&mut self, n: u64) {
        self.arg(n);
    }
}

/// RESP: each argument a bulk string (`$<len>\r\n<bytes>\r\n`), written by `resp` (a number's whole
/// argument put together on the stack and copied once).
impl Args for Vec<u8> {
    fn text(&mut self, s: &str) {
        resp::bulk(self, s.as_bytes());
    }
    fn num(&mut self, n: u64) {
        resp::bulk_num(self, n);
    }
}

/// The keys of a call's items (`Layout::script_keys`: two for a sliding window, one otherwise).
fn key_count(items: &[CallItem<'_>]) -> usize {
    items.iter().map(|it| Layout::script_key_count(it.rule)).sum()
}

/// The arguments after `EVALSHA`: the script's hash, the key count, every key the items touch (one
/// reused `String`), then nine arguments each (check.lua's ARGV). A layout with each rule's parameters
/// once per call was measured and not kept (BENCHMARKS.md, "Redis's instructions per check-script
/// call: script shapes tried"): fewer Redis instructions per item in a many-item call, more in a
/// one-item call, the common one on a fleet's agents.
fn check_args(out: &mut impl Args, script_hash: &str, layout: &Layout, items: &[CallItem<'_>]) {
    out.text(script_hash);
    out.num(key_count(items) as u64);
    // One reading of the clock for the call: a quota's key and its period's arguments name the same
    // period.
    let dated = |it: &CallItem<'_>| match it.rule.algorithm {
        Algorithm::Quota => true,
        Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => false,
    };
    let now = if items.iter().any(dated) {
        floodgate_core::store::Clock::System.now_ms()
    } else {
        0
    };
    let mut key = String::with_capacity(64);
    for it in items {
        let period_start = match it.rule.algorithm {
            Algorithm::Quota => quota_period(it.rule, it.target, now).0,
            Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => 0,
        };
        layout.script_keys(&mut key, it.rule, it.key, period_start, |k| out.text(k));
    }
    for it in items {
        let r = it.rule;
        let algorithm = match r.algorithm {
            Algorithm::SlidingWindow => 1,
            Algorithm::TokenBucket => 2,
            Algorithm::Concurrency => 3,
            Algorithm::Quota => 4,
        };
        out.num(algorithm);
        out.num(r.limit.get());
        match r.algorithm {
            Algorithm::Quota => {
                // The period (the agent's calendar): a write-back's or take-back's by its start, a
                // check's the one holding now. Its end where the window goes, its start twice.
                let (start, end) = quota_period(r, it.target, now);
                out.num(end);
                out.num(start);
                out.num(it.cost);
                out.num(u64::from(it.mode));
                out.num(start);
            }
            Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {
                out.num(r.window_ms());
                out.num(r.burst());
                out.num(it.cost);
                out.num(u64::from(it.mode));
                out.num(it.target);
            }
        }
        out.text(it.key);
        out.num(u64::from(it.last));
    }
}

/// A quota item's period: the one starting at `start` (a write-back's or take-back's), or with
/// `start` 0 the one holding `now`.
fn quota_period(rule: &Rule, start: u64, now: u64) -> (u64, u64) {
    match (rule.period, start) {
        (Some(p), s) if s != 0 => floodgate_core::algo::period_from_start(s, p, rule.zone()),
        _ => rule.quota_period(now),
    }
}

/// The EVALSHA of the check script for `items` as a redis-rs command, built straight into one
/// command buffer (a `ScriptInvocation` allocates a `Vec` for every key and argument).
pub(super) fn check_cmd(script_hash: &str, layout: &Layout, items: &[CallItem<'_>]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    check_args(&mut cmd, script_hash, layout, items);
    cmd
}

/// The same EVALSHA as RESP, appended to `buf`: the array header (3, the keys, and 9 arguments per
/// item), then the arguments, with no intermediate command.
pub(super) fn write_check(buf: &mut Vec<u8>, script_hash: &str, layout: &Layout, items: &[CallItem<'_>]) {
    resp::evalsha(buf, 3 + key_count(items) + 9 * items.len());
    check_args(buf, script_hash, layout, items);
}

/// The breaker's probe: one log-mode sliding-window item on `fg:{probe}:probe`'s window hashes with
/// a limit no probe reaches, in the same argument layout as every check.
pub(super) fn probe_cmd(script_hash: &str) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script_hash)
        .arg(2)
        .arg("fg:{probe}:probe:w0")
        .arg("fg:{probe}:probe:w1")
        .arg(1)
        .arg(1u64 << 50)
        .arg(1_000)
        .arg(1u64 << 50)
        .arg(1)
        .arg(0)
        .arg(0)
        .arg("probe")
        .arg(1);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::rules::RuleSet;

    #[test]
    fn resp_bytes_are_the_commands_own_packing() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"r","dimension":"user","limit":5,"windowSeconds":60},
                {"id":"t","dimension":"user","limit":3,"windowSeconds":10,"algorithm":"token_bucket","burst":3}]}"#,
        )
        .unwrap();
        let layout = Layout::default();
        let items = [
            CallItem {
                rule: rules.get("r").unwrap(),
                key: "user:a",
                cost: 2,
                mode: 1,
                target: 0,
                last: false,
            },
            CallItem {
                rule: rules.get("t").unwrap(),
                key: "user:é",
                cost: 1,
                mode: 3,
                target: 77,
                last: true,
            },
        ];
        let mut buf = b"leading".to_vec();
        write_check(&mut buf, "abc", &layout, &items);
        assert_eq!(
            &buf[7..],
            &check_cmd("abc", &layout, &items).get_packed_command()[..],
            "the same EVALSHA either way"
        );
        // Numbers of every length, 1 to 20 digits (a two-digit length prefix from 10 on).
        let mut n = 0u64;
        let mut wide = Vec::new();
        let mut cmd = redis::cmd("X");
        for digits in 1..=20u32 {
            n = n * 10 + u64::from(digits % 10);
            wide.num(n);
            cmd.arg(n);
        }
        wide.num(u64::MAX);
        cmd.arg(u64::MAX);
        wide.text("");
        cmd.arg("");
        assert_eq!(
            &cmd.get_packed_command()[b"*23\r\n$1\r\nX\r\n".len()..],
            &wide[..]
        );
    }
}
