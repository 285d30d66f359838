//! What one call of the check script carries: its items, and the EVALSHA built from them (the
//! checks' and the breaker probe's: check.lua's argument layout lives here only).

use floodgate_core::rules::{Algorithm, Rule};
use floodgate_core::store::Layout;
use redis::Cmd;

/// One item of a check-script call: what it counts, and how (`mode` 1 enforce, 0 log, 2 add and 3
/// take back into window `target`); `last` closes a check (all or nothing up to it).
pub(super) struct CallItem<'a> {
    pub(super) rule: &'a Rule,
    pub(super) key: &'a str,
    pub(super) cost: u64,
    pub(super) mode: u8,
    pub(super) target: u64,
    pub(super) last: bool,
}

/// The EVALSHA of the check script for `items`, built straight into one command buffer: their
/// state keys (one reused `String`), then nine arguments each (check.lua's ARGV), numbers written in
/// place. (A `ScriptInvocation` allocates a `Vec` for every key and argument, and a `format!` per key.)
/// A layout with each rule's parameters once per call was measured and not kept (BENCHMARKS.md,
/// issue 14, item 4): fewer Redis instructions per item in a many-item call, more in a one-item call,
/// the common one on a fleet's agents.
pub(super) fn check_cmd(script_hash: &str, layout: &Layout, items: &[CallItem<'_>]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script_hash).arg(items.len());
    let mut key = String::with_capacity(64);
    for it in items {
        key.clear();
        layout.write_state_key(&mut key, it.rule, it.key);
        cmd.arg(key.as_str());
    }
    for it in items {
        let r = it.rule;
        let algorithm = match r.algorithm {
            Algorithm::SlidingWindow => 1,
            Algorithm::TokenBucket => 2,
        };
        cmd.arg(algorithm)
            .arg(r.limit.get())
            .arg(r.window_ms())
            .arg(r.burst())
            .arg(it.cost)
            .arg(it.mode)
            .arg(it.target)
            .arg(it.key)
            .arg(if it.last { 1 } else { 0 });
    }
    cmd
}

/// The breaker's probe: one log-mode sliding-window item on `fg:{probe}:probe` with a limit no probe
/// reaches, in the same argument layout as every check.
pub(super) fn probe_cmd(script_hash: &str) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script_hash)
        .arg(1)
        .arg("fg:{probe}:probe")
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
