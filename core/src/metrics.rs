//! Metrics recorded where things happen, through the `metrics` facade (the agent installs the
//! Prometheus exporter and renders it at the admin port's `/metrics`). Names follow Prometheus conventions: units in names, `_total` for counters.
//!
//! Off (`--metrics false`) nothing is recorded: every function here returns at once on one relaxed
//! load, so the request path pays nothing for metrics it does not export.
//!
//! Counters and histograms are recorded where things happen; gauges that mirror state the agent
//! keeps anyway (breakers, fallback, live agents, rule-set version, rejection-cache size) are read
//! from the engine when Prometheus scrapes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use floodgate_protocol::{Check, Decision, Source};
use metrics::{counter, histogram};

use crate::rules::Rule;

static ON: AtomicBool = AtomicBool::new(false);

/// Every metric the agent exports, with its help text (the dashboard test checks against the
/// exposition itself, not this list).
pub const METRICS: &[(&str, &str)] = &[
    ("floodgate_checks_total", "Check items decided, by rule, decision (allowed, rejected, logged = a log-mode rule's would-be rejection, over_quota = allowed past the limit of a rule with overLimit flag) and source (redis, local, cache, fallback)"),
    ("floodgate_check_errors_total", "Checks answered with an error (invalid input, no such rule, internal)"),
    ("floodgate_check_duration_seconds", "Time from a check's frame read to its answer, in the agent"),
    ("floodgate_redis_calls_total", "Redis script calls, by shard"),
    ("floodgate_redis_errors_total", "Redis script calls that failed or timed out, by shard"),
    ("floodgate_flush_batches_total", "Flush calls (batched counts written and learned)"),
    ("floodgate_flush_batch_keys", "Entries per flush call"),
    ("floodgate_breaker_state", "Circuit breaker per shard: 0 closed, 1 half-open, 2 open"),
    ("floodgate_fallback_active", "1 while some shard's breaker is not closed (the limit/N fallback decides there)"),
    ("floodgate_live_agents", "N: agents with a live heartbeat"),
    ("floodgate_rules_version", "The rule set's global version (0 for a rules file)"),
    ("floodgate_rules_refused", "1 while the newest rule set handed to the agent was refused as invalid (the set in force stayed; /v1/status says why), else 0"),
    ("floodgate_rejection_cache_entries", "Rejections cached until their reset"),
    ("floodgate_events_sent_total", "Rejection events written to the Redis stream"),
    ("floodgate_events_dropped_total", "Rejection events dropped: queue full, or the stream write failed"),
    ("floodgate_connections_refused_total", "Connections refused because their listener held its cap, or their peer its share of it: unix, tcp, grpc past --max-connections or --max-connections-per-peer (a uid on the socket, an address on TCP and gRPC); admin, rules (the HTTP APIs) past --http-max-connections or the peer address's quarter of it"),
    ("floodgate_connections_closed_total", "Frames connections the agent closed, by reason: idle (nothing in flight for --idle-timeout-ms), frame_timeout (a frame not completed within --frame-timeout-ms), buffers (the read-buffer budget for frames still arriving was spent)"),
    ("floodgate_grpc_requests_total", "Envoy ShouldRateLimit requests, by code: ok, over_limit, unmatched (no descriptor had a rule), error"),
    ("floodgate_checks_shed_total", "Checks (their call groups toward one store shard) the agent answered by their rules' fail modes without asking the store, because its queue there already waited longer than a check's budget (the store timeout from the frame's read): load past capacity, not a Redis failure"),
    ("floodgate_script_errors_total", "Script calls and entries Redis answered with an error of the script itself (a key of another type, a number Redis refuses), by op: check (the check answered by its rules' fail modes; the shard's breaker stays closed, Redis being there), write_back and take_back (the entry dropped, never retried; the call's other entries applied)"),
    ("floodgate_over_admitted_total", "Units admitted over a rule's limit, learned when what agents admitted locally reaches Redis: source=flush for a batched rule's flush writes, source=fallback for the write-back after a fallback period; each write's units past the limit in the count Redis answers (writes apply one at a time, so this sums across agents without counting a unit twice; the previous window's weight not counted; sliding-window rules in enforce mode only)"),
];

/// Turns recording on (the exporter's installer calls it once its recorder is in place).
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// Whether metrics are recorded.
#[inline]
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

fn source(s: Source) -> &'static str {
    match s {
        Source::Redis => "redis",
        Source::Local => "local",
        Source::Cache => "cache",
        Source::Fallback => "fallback",
    }
}

const DECISIONS: [&str; 4] = ["allowed", "rejected", "logged", "over_quota"];
const SOURCES: [Source; 4] = [Source::Redis, Source::Local, Source::Cache, Source::Fallback];

/// Handles of one rule's `floodgate_checks_total` series, by decision × source. The request path
/// looks them up by the rule id (a `&str`, no allocation) instead of building a labelled key and
/// asking the registry for every item of every check.
type RuleCounters = Box<[metrics::Counter; 16]>;

fn rule_counters(rule: &str) -> RuleCounters {
    Box::new(std::array::from_fn(|i| {
        counter!(
            "floodgate_checks_total",
            "rule" => rule.to_string(),
            "decision" => DECISIONS[i / 4],
            "source" => source(SOURCES[i % 4])
        )
    }))
}

/// The counters of each rule id, looked up once per checked item: ids are the rules' (a decision
/// only carries ids of rules in force), so foldhash instead of SipHash, as `RuleSet` does.
static CHECKS: OnceLock<dashmap::DashMap<String, RuleCounters, foldhash::fast::RandomState>> =
    OnceLock::new();
static LATENCY: OnceLock<metrics::Histogram> = OnceLock::new();

/// A check answered: one count per item, and its latency.
pub fn check(result: &Result<Decision, floodgate_protocol::ErrorBody>, took: Duration) {
    check_charged(result, took, 0);
}

/// Which items of a check are charges, for [`check_charged`]: bit `i` for item `i` (a check has at
/// most 16), every bit for an attribute check's charge; 0 for nearly every check.
pub fn charges(check: &Check) -> u32 {
    match check {
        Check::Items(items) => items
            .iter()
            .enumerate()
            .filter(|(_, i)| i.mode.always_takes())
            .fold(0, |mask, (n, _)| mask | 1 << (n % 32)),
        Check::Attributes(a) if a.mode.always_takes() => u32::MAX,
        Check::Attributes(_) => 0,
    }
}

/// [`check`] of a check with charges: a charge is never a rejection, whatever its verdict says of
/// the key past its limit, so it counts as allowed.
pub fn check_charged(result: &Result<Decision, floodgate_protocol::ErrorBody>, took: Duration, charges: u32) {
    if !on() {
        return;
    }
    LATENCY
        .get_or_init(|| histogram!("floodgate_check_duration_seconds"))
        .record(took.as_secs_f64());
    match result {
        Ok(d) => {
            let checks = CHECKS.get_or_init(Default::default);
            for (n, item) in d.items.iter().enumerate() {
                let v = &item.verdict;
                let charge = charges & 1 << (n % 32) != 0;
                let decision = match (v.allowed || charge, v.log_only) {
                    // Quota mode: allowed past the limit, flagged.
                    (true, _) if v.over_quota => 3,
                    (true, _) => 0,
                    (false, false) => 1,
                    (false, true) => 2,
                };
                let i = decision * 4 + v.source.to_u8() as usize % 4;
                match checks.get(item.rule_id.as_str()) {
                    Some(c) => c[i].increment(1),
                    None => {
                        let c = rule_counters(&item.rule_id);
                        c[i].increment(1);
                        checks.insert(item.rule_id.to_string(), c);
                    }
                }
            }
        }
        Err(_) => check_error(),
    }
}

/// A check refused with an error (invalid input decoded but refused, no such rule, internal).
pub fn check_error() {
    if on() {
        counter!("floodgate_check_errors_total").increment(1);
    }
}

/// Per shard, the handles of its `floodgate_redis_calls_total` and `floodgate_redis_errors_total`
/// series: made once, so a call does not format its shard label and look the series up again.
static REDIS_CALLS: OnceLock<std::sync::RwLock<Vec<[metrics::Counter; 2]>>> = OnceLock::new();

/// A Redis call to `shard` ended.
pub fn redis_call(shard: usize, ok: bool) {
    if !on() {
        return;
    }
    let calls = REDIS_CALLS.get_or_init(Default::default);
    let count = |c: &[metrics::Counter; 2]| {
        c[0].increment(1);
        if !ok {
            c[1].increment(1);
        }
    };
    if let Some(c) = calls.read().unwrap_or_else(|e| e.into_inner()).get(shard) {
        return count(c);
    }
    let mut all = calls.write().unwrap_or_else(|e| e.into_inner());
    while all.len() <= shard {
        let label = all.len().to_string();
        all.push([
            counter!("floodgate_redis_calls_total", "shard" => label.clone()),
            counter!("floodgate_redis_errors_total", "shard" => label),
        ]);
    }
    count(&all[shard]);
}

/// A flush call carried `entries` entries.
pub fn flush_batch(entries: usize) {
    if !on() {
        return;
    }
    counter!("floodgate_flush_batches_total").increment(1);
    histogram!("floodgate_flush_batch_keys").record(entries as f64);
}

/// Where over-admission was learned: a batched rule's flush, or the write-back after a fallback.
#[derive(Debug, Clone, Copy)]
pub enum OverSource {
    /// A batched rule's flush write.
    Flush,
    /// The write-back of what the fallback admitted while Redis was away.
    Fallback,
}

impl OverSource {
    /// The `source` label.
    pub fn label(self) -> &'static str {
        match self {
            OverSource::Flush => "flush",
            OverSource::Fallback => "fallback",
        }
    }
}

/// What a write of `units` locally admitted units that left the client's window count at `count`
/// teaches: the write's own units past `rule`'s limit (one window alone never passes it through
/// checks, so only such writes do; Redis applies writes one at a time, so these add up across
/// agents without counting a unit twice, and the previous window's weight is not counted). Counted
/// and returned; none for a rule in log mode, which admits everything by design.
pub fn over_admitted(rule: &Rule, source: OverSource, count: u64, units: u64) -> u64 {
    if !rule.enforced() {
        return 0;
    }
    let over = count.saturating_sub(rule.limit.get()).min(units);
    if on() && over > 0 {
        counter!("floodgate_over_admitted_total", "rule" => rule.id.clone(), "source" => source.label())
            .increment(over);
    }
    over
}

/// Rejection events written and dropped.
pub fn events(sent: u64, dropped: u64) {
    if !on() {
        return;
    }
    if sent > 0 {
        counter!("floodgate_events_sent_total").increment(sent);
    }
    if dropped > 0 {
        counter!("floodgate_events_dropped_total").increment(dropped);
    }
}

/// A check's call group shed (answered by its fail modes without asking the store).
pub fn shed() {
    if on() {
        counter!("floodgate_checks_shed_total").increment(1);
    }
}

/// Script errors: `op` is `check`, `write_back` or `take_back`; `n` calls or entries.
pub fn script_errors(op: &'static str, n: u64) {
    if on() && n > 0 {
        counter!("floodgate_script_errors_total", "op" => op).increment(n);
    }
}

/// A connection refused because its listener holds its cap already (`--max-connections`, or
/// `--http-max-connections` and a peer's share of it for `admin` and `rules`).
pub fn connection_refused(listener: &'static str) {
    if on() {
        counter!("floodgate_connections_refused_total", "listener" => listener).increment(1);
    }
}

/// A trace span dropped: the exporter's queue was full, or its batch could not be sent.
pub fn trace_span_dropped() {
    if on() {
        counter!("floodgate_trace_spans_dropped_total").increment(1);
    }
}

/// A connection the agent closed: `reason` is `idle`, `frame_timeout` or `buffers` (frames), or
/// `grpc_idle` or `grpc_calm` (a gRPC peer idle, or past a budget).
pub fn connection_closed(reason: &'static str) {
    if on() {
        counter!("floodgate_connections_closed_total", "reason" => reason).increment(1);
    }
}

/// A ShouldRateLimit answered: `code` is `ok`, `over_limit`, `unmatched` (no descriptor had a rule)
/// or `error`.
pub fn grpc_request(code: &'static str) {
    if !on() {
        return;
    }
    // The series' handles, made once (as `check`'s are): no registry lookup per request.
    let counters = GRPC.get_or_init(|| {
        std::array::from_fn(|i| counter!("floodgate_grpc_requests_total", "code" => GRPC_CODES[i]))
    });
    match GRPC_CODES.iter().position(|&c| c == code) {
        Some(i) => counters[i].increment(1),
        None => counter!("floodgate_grpc_requests_total", "code" => code).increment(1),
    }
}

const GRPC_CODES: [&str; 4] = ["ok", "over_limit", "unmatched", "error"];
static GRPC: OnceLock<[metrics::Counter; GRPC_CODES.len()]> = OnceLock::new();
