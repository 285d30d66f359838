//! What one call of the check script carries: its items, and the EVALSHA built from them.

use floodgate_core::rules::{Algorithm, Rule};
use floodgate_core::store::Layout;
use redis::Cmd;
use smallvec::SmallVec;

/// A rule's parameters as check.lua reads them, sent once per call for all its items.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Spec {
    algorithm: u8,
    limit: u64,
    window_ms: u64,
    burst: u64,
}

impl Spec {
    fn of(r: &Rule) -> Spec {
        Spec {
            algorithm: match r.algorithm {
                Algorithm::SlidingWindow => 1,
                Algorithm::TokenBucket => 2,
            },
            limit: r.limit.get(),
            window_ms: r.window_ms(),
            burst: r.burst(),
        }
    }
}

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
/// state keys (one reused `String`), then each distinct rule's parameters once and four
/// arguments per item (check.lua's ARGV), numbers written in place. (A `ScriptInvocation`
/// allocates a `Vec` for every key and argument, and a `format!` per key.)
pub(super) fn check_cmd(script_hash: &str, layout: &Layout, items: &[CallItem<'_>]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script_hash).arg(items.len());
    let mut key = String::with_capacity(64);
    for it in items {
        key.clear();
        layout.write_state_key(&mut key, it.rule, it.key);
        cmd.arg(key.as_str());
    }
    // A call's items mostly share one or two rules: a linear scan over a few inline specs (no
    // allocation below five distinct rules) finds each item's.
    let mut specs: SmallVec<[Spec; 4]> = SmallVec::new();
    for it in items {
        let spec = Spec::of(it.rule);
        if !specs.contains(&spec) {
            specs.push(spec);
        }
    }
    cmd.arg(specs.len());
    for s in &specs {
        cmd.arg(s.algorithm).arg(s.limit).arg(s.window_ms).arg(s.burst);
    }
    for it in items {
        let spec = Spec::of(it.rule);
        let index = specs.iter().position(|s| *s == spec).unwrap_or(0) as u64;
        let code = (index + 1) * 8 + u64::from(it.mode) * 2 + u64::from(it.last);
        cmd.arg(code).arg(it.cost).arg(it.target).arg(it.key);
    }
    cmd
}

/// The breaker's probe: one log-mode sliding-window item on `fg:{probe}:probe` with a limit no probe
/// reaches (spec 1, mode 0, last: code 9), in the same argument layout as every check.
pub(super) fn probe_cmd(script_hash: &str) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script_hash)
        .arg(1)
        .arg("fg:{probe}:probe")
        .arg(1)
        .arg(1)
        .arg(1u64 << 50)
        .arg(1_000)
        .arg(1u64 << 50)
        .arg(9)
        .arg(1)
        .arg(0)
        .arg("probe");
    cmd
}
