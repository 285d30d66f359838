//! The checker: reads the ledgers of a run (one per agent), puts every admitted unit in its
//! key-window by the store's clock, and judges each key-window's admitted units against the bound
//! the accuracy contract states for how it was decided (`docs/accuracy.md`). It trusts nothing the
//! agents concluded: only what each said it admitted, and when.
//!
//! A decision is known only to have been made between its frame's read and its answer; one whose
//! span crosses a window's edge is counted in neither window surely (it is "maybe" in both), so a
//! breach is reported only where the units surely in one window pass its bound: no false alarm
//! from timing, at the price of missing an over-admission hidden in the uncertain spans (their
//! total is reported).
//!
//! What is judged: consume and charge items admitted by enforced rules of the sliding-window,
//! token-bucket and calendar-quota algorithms. Per key-window (aligned windows of the rule's length
//! on the store's clock; a quota's period as the agent named it, from the ledger):
//! - decided by the shared store (and its rejection cache) only: the limit (a token bucket: its
//!   burst plus one window's refill);
//! - with admissions of the limit/N fallback (fail open while the store was away): plus Φ, each
//!   such agent's share max(1, ⌊L / n⌋) summed, n the live agents it counted (a token bucket's
//!   share adds ⌊B / n⌋);
//! - with admissions from batched local counters: plus the larger of `batched_allowance` of the
//!   limit and N·c + P: N the agents that admitted locally in it, c the largest cost, P the most
//!   units they admitted locally in any half flush slot of it (an agent that spent more than its
//!   new share between a slot's write and its learn cannot give it back; docs/accuracy.md).
//!
//! Concurrency rules are judged by units held at once (`held.rs`).

use std::collections::HashMap;

use serde::Serialize;

use super::record::{Header, Record};
use crate::rules::Algorithm;

/// How the checker judges.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// What batched rules may admit over their limit in a key-window, as a fraction of it (the
    /// contract's batched target: 0.01; `Options::contract()` sets it).
    pub batched_allowance: f64,
    /// The batched rules' flush interval, ms (the half slot between a write and its learn is
    /// what P is taken over).
    pub flush_ms: u64,
    /// Faults a run injected whose loss the contract states: each key-window they overlap may admit
    /// that much more (a fault runner knows when it injected them; a ledger does not).
    pub faults: Vec<FaultSpan>,
}

impl Options {
    /// The contract's defaults: a batched allowance of 1 %, the default 100 ms flush interval, no
    /// faults.
    pub fn contract() -> Self {
        Options {
            batched_allowance: 0.01,
            flush_ms: crate::batch::DEFAULT_FLUSH_MS,
            faults: Vec::new(),
        }
    }
}

/// A fault the contract gives a stated loss for, and when it happened (Unix ms, store clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FaultSpan {
    /// Which fault.
    pub kind: FaultKind,
    /// From when.
    pub from_ms: u64,
    /// Until when (the store answers again).
    pub to_ms: u64,
}

/// Faults with a stated loss (docs/accuracy.md, "Faults").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// Redis restarted without its data: the window's count before it (A_0 ≤ L; a token bucket: a
    /// full bucket, B) is lost.
    RestartEmpty,
    /// A primary replaced by its replica: what it had not replicated is lost. The contract's target
    /// is replication lag's share only, ≤ 0.1 % of the limit (at least one unit).
    Failover,
}

impl FaultKind {
    /// What a key-window it overlaps may admit more, for a rule of `limit` (a bucket's `burst`).
    fn allowance(self, alg: Option<Algorithm>, limit: u64, burst: u64) -> u64 {
        match (self, alg) {
            (FaultKind::RestartEmpty, Some(Algorithm::TokenBucket)) => burst,
            (FaultKind::RestartEmpty, _) => limit,
            (FaultKind::Failover, _) => (limit / 1_000).max(1),
        }
    }
}

/// One agent's ledger, read.
#[derive(Debug, Clone)]
pub struct LedgerFile {
    /// Its first line.
    pub header: Header,
    /// Its records.
    pub records: Vec<Record>,
    /// Decisions the agent dropped (its queue was full): the ledger is incomplete when not 0.
    pub dropped: u64,
    /// Whether it ends with the agent's closing line (a killed agent's does not).
    pub closed: bool,
}

impl LedgerFile {
    /// Reads a ledger's text; the error names the line.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        let (_, first) = lines.next().ok_or("empty ledger: no header line")?;
        let header: Header =
            serde_json::from_str(first).map_err(|e| format!("line 1 is not a ledger header: {e}"))?;
        if header.ledger != 1 {
            return Err(format!("ledger format {} is not known (1 is)", header.ledger));
        }
        let mut file = LedgerFile {
            header,
            records: Vec::new(),
            dropped: 0,
            closed: false,
        };
        for (n, line) in lines {
            if line.starts_with("{\"dropped\":") || line.starts_with("{\"closed\":") {
                let v: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| format!("line {}: {e}", n + 1))?;
                file.dropped = file.dropped.max(v["dropped"].as_u64().unwrap_or(0));
                file.closed |= v["closed"].as_bool() == Some(true);
                continue;
            }
            match serde_json::from_str::<Record>(line) {
                Ok(r) => file.records.push(r),
                // A killed agent's last line may be cut short; anywhere else it is an error.
                Err(_) if !file.closed && n + 1 == text.lines().count() => {}
                Err(e) => return Err(format!("line {}: {e}", n + 1)),
            }
        }
        Ok(file)
    }
}

/// A key-window past its bound.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Breach {
    /// The rule.
    pub rule: String,
    /// The client key.
    pub key: String,
    /// The agent, where the limit is one agent's (the embedded store); none for the fleet's.
    pub agent: Option<String>,
    /// The window's start, Unix ms by the store's clock.
    pub window_start_ms: u64,
    /// Units surely admitted in it.
    pub admitted: u64,
    /// Units whose decision spans its edge (maybe in it).
    pub maybe: u64,
    /// The rule's limit.
    pub limit: u64,
    /// The contract's bound for how it was decided.
    pub bound: u64,
    /// How its units were decided (`redis`, `local`, `cache`, `fallback`).
    pub sources: Vec<String>,
}

/// One rule's key-windows, judged.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RuleSummary {
    /// The rule.
    pub rule: String,
    /// Key-windows with admitted units.
    pub key_windows: u64,
    /// Units admitted in all (surely in a window, and maybe).
    pub admitted: u64,
    /// The largest admitted ÷ limit of any key-window (units surely in it).
    pub worst_ratio: f64,
    /// Key-windows past their bound.
    pub breaches: u64,
    /// Why it was not judged (its algorithm), if it was not.
    pub not_judged: Option<String>,
}

/// The checker's verdict on a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Judgement {
    /// Agents (ledgers) read.
    pub agents: usize,
    /// Records read.
    pub records: u64,
    /// Decisions the agents dropped from their ledgers: the run is judged incomplete if not 0.
    pub dropped: u64,
    /// Agents whose ledger has no closing line (killed: their last ~50 ms may be missing).
    pub unclosed: Vec<String>,
    /// Per rule.
    pub rules: Vec<RuleSummary>,
    /// Every key-window past its bound, worst first.
    pub breaches: Vec<Breach>,
}

#[derive(Default)]
struct Window<'a> {
    sure: u64,
    maybe: u64,
    limit: u64,
    burst: u64,
    alg: Option<Algorithm>,
    sources: u8,
    /// Per agent whose fallback admitted here: the fewest live agents it counted (its largest share).
    fallback_n: HashMap<&'a str, u64>,
    /// A quota period's start and end (its key-window is not `w` ms long).
    span: Option<(u64, u64)>,
    /// Units admitted from batched local counters, (when, cost), and by which agents.
    local: Vec<(u64, u64)>,
    local_agents: Vec<&'a str>,
}

const SOURCES: [&str; 4] = ["redis", "local", "cache", "fallback"];

fn source_bit(s: &str) -> u8 {
    SOURCES.iter().position(|x| *x == s).map_or(0, |i| 1 << i)
}

/// A key-window: (rule, key, agent for a per-agent limit, window length, window index).
type WindowKey<'a> = (&'a str, &'a str, Option<&'a str>, u64, u64);

/// What the records admitted by key-window, the rules' summaries, and the records read.
type Admitted<'a> = (
    HashMap<WindowKey<'a>, Window<'a>>,
    HashMap<&'a str, RuleSummary>,
    u64,
);

/// Judges the ledgers of one run.
pub fn judge(ledgers: &[LedgerFile], opts: &Options) -> Judgement {
    let (windows, mut summaries, records) = admitted(ledgers);
    let mut breaches = breaches(windows, &mut summaries, opts);
    breaches.extend(super::held::breaches(ledgers, opts, &mut summaries));
    breaches.sort_by(|a, b| {
        let ratio = |x: &Breach| x.admitted as f64 / x.limit as f64;
        ratio(b).total_cmp(&ratio(a)).then_with(|| a.key.cmp(&b.key))
    });
    let mut rules: Vec<RuleSummary> = summaries.into_values().collect();
    rules.sort_by(|a, b| a.rule.cmp(&b.rule));
    Judgement {
        agents: ledgers.len(),
        records,
        dropped: ledgers.iter().map(|f| f.dropped).sum(),
        unclosed: ledgers
            .iter()
            .filter(|f| !f.closed)
            .map(|f| f.header.agent.clone())
            .collect(),
        rules,
        breaches,
    }
}

/// What the ledgers' counted records admitted, by key-window (a record whose check spans several
/// windows is a maybe in each), the rules' summaries so far, and how many records were read.
fn admitted(ledgers: &[LedgerFile]) -> Admitted<'_> {
    let mut windows: HashMap<WindowKey, Window> = HashMap::new();
    let mut summaries: HashMap<&str, RuleSummary> = HashMap::new();
    let mut records = 0;
    for file in ledgers {
        let agent = (file.header.store == "memory").then_some(file.header.agent.as_str());
        for r in &file.records {
            records += 1;
            let s = summaries.entry(&r.rule).or_insert_with(|| RuleSummary {
                rule: r.rule.clone(),
                key_windows: 0,
                admitted: 0,
                worst_ratio: 0.0,
                breaches: 0,
                not_judged: None,
            });
            if r.mode == "return" {
                if r.enforced {
                    give_back(&mut windows, s, r, agent);
                }
                continue;
            }
            let counts =
                r.enforced && r.allowed && matches!(r.mode.as_str(), "consume" | "reserve" | "charge");
            if !counts {
                continue;
            }
            // Windows of `w` ms numbered `first..=last` (a quota: its period, keyed by its start
            // with `w` 1), whether the decision is surely in one, and a quota period's span.
            let (w, first, last, sure, span) = match (r.alg, r.period) {
                (Algorithm::SlidingWindow | Algorithm::TokenBucket, _) => {
                    let w = r.window_ms.max(1);
                    let at = |t: u64| (t as i64 + r.off).max(0) as u64 / w;
                    let (first, last) = (at(r.recv), at(r.done.max(r.recv)));
                    (w, first, last, first == last, None)
                }
                // Units held at once: `held.rs`.
                (Algorithm::Concurrency, _) => continue,
                // The period the agent named when it decided (the contract's key-window: "as the
                // agents' clocks name it"); a check read before that period began may have been
                // counted in the one before: a maybe.
                (Algorithm::Quota, Some([start, end])) => {
                    (1, start, start, r.recv >= start, Some((start, end)))
                }
                (Algorithm::Quota, None) => {
                    s.not_judged = Some(
                        "quota: the ledger names no periods (written by an agent that did not record them)"
                            .into(),
                    );
                    continue;
                }
            };
            s.admitted += r.cost;
            // A span over more than a few windows says nothing of any of them.
            for k in first..=last.min(first + 3) {
                let win = windows.entry((&r.rule, &r.key, agent, w, k)).or_default();
                win.span = win.span.or(span);
                if sure {
                    win.sure += r.cost;
                } else {
                    win.maybe += r.cost;
                }
                win.limit = win.limit.max(r.limit);
                win.burst = win.burst.max(r.burst);
                win.alg = Some(r.alg);
                win.sources |= source_bit(&r.source);
                if r.source == "fallback" {
                    let n = win.fallback_n.entry(&file.header.agent).or_insert(u64::MAX);
                    *n = (*n).min(r.n.max(1));
                }
                if r.source == "local" && sure {
                    win.local.push(((r.recv as i64 + r.off).max(0) as u64, r.cost));
                    if !win.local_agents.contains(&file.header.agent.as_str()) {
                        win.local_agents.push(&file.header.agent);
                    }
                }
            }
        }
    }
    (windows, summaries, records)
}

/// A `return` record: the units a reservation gave back come off the key-window they were counted
/// in (a sliding window's by its index, a quota's by its period, a token bucket's at the return's
/// time), sure units first.
fn give_back<'a>(
    windows: &mut HashMap<WindowKey<'a>, Window<'a>>,
    s: &mut RuleSummary,
    r: &'a Record,
    agent: Option<&'a str>,
) {
    let (w, k) = match (r.alg, r.from) {
        (Algorithm::SlidingWindow, Some(k)) => (r.window_ms.max(1), k),
        (Algorithm::TokenBucket, _) => {
            let w = r.window_ms.max(1);
            (w, (r.done as i64 + r.off).max(0) as u64 / w)
        }
        (Algorithm::Quota, Some(start)) => (1, start),
        (Algorithm::SlidingWindow | Algorithm::Quota | Algorithm::Concurrency, _) => return,
    };
    let Some(win) = windows.get_mut(&(r.rule.as_str(), r.key.as_str(), agent, w, k)) else {
        return;
    };
    let sure = r.cost.min(win.sure);
    win.sure -= sure;
    win.maybe -= (r.cost - sure).min(win.maybe);
    s.admitted = s.admitted.saturating_sub(r.cost);
}

/// Every key-window judged against its bound: the rules' summaries completed, the breaches found.
fn breaches(
    windows: HashMap<WindowKey<'_>, Window<'_>>,
    summaries: &mut HashMap<&str, RuleSummary>,
    opts: &Options,
) -> Vec<Breach> {
    let mut breaches = Vec::new();
    for ((rule, key, agent, w, k), win) in windows {
        let Some(s) = summaries.get_mut(rule) else {
            continue;
        };
        let limit = win.limit.max(1);
        let bound = bound(&win, limit, agent, w, k, opts);
        s.key_windows += 1;
        s.worst_ratio = s.worst_ratio.max(win.sure as f64 / limit as f64);
        if win.sure > bound {
            s.breaches += 1;
            breaches.push(Breach {
                rule: rule.to_string(),
                key: key.to_string(),
                agent: agent.map(str::to_string),
                window_start_ms: k * w,
                admitted: win.sure,
                maybe: win.maybe,
                limit,
                bound,
                sources: SOURCES
                    .iter()
                    .filter(|x| win.sources & source_bit(x) != 0)
                    .map(|x| x.to_string())
                    .collect(),
            });
        }
    }
    breaches
}

/// A key-window's bound (docs/accuracy.md): its limit (a token bucket's burst too), plus each
/// fallback's share, the batched allowance, and what the faults that overlap it allow.
fn bound(win: &Window, limit: u64, agent: Option<&str>, w: u64, k: u64, opts: &Options) -> u64 {
    let mut bound = match win.alg {
        Some(Algorithm::TokenBucket) => win.burst + limit,
        Some(Algorithm::SlidingWindow | Algorithm::Concurrency | Algorithm::Quota) | None => limit,
    };
    // Φ: each agent whose fallback admitted here, its share of the limit (docs/accuracy.md).
    for n in win.fallback_n.values() {
        let share = |x: u64| (x / n).max(1);
        bound += match win.alg {
            Some(Algorithm::TokenBucket) => share(win.burst) + share(limit),
            Some(Algorithm::SlidingWindow | Algorithm::Concurrency | Algorithm::Quota) | None => share(limit),
        };
    }
    if win.sources & source_bit("local") != 0 && agent.is_none() {
        let fraction = (limit as f64 * opts.batched_allowance).ceil() as u64;
        bound += fraction.max(batched_over(win, opts.flush_ms));
    }
    let (start, end) = win.span.unwrap_or((k * w, (k + 1) * w));
    for f in &opts.faults {
        if f.from_ms < end && f.to_ms >= start {
            bound += f.kind.allowance(win.alg, limit, win.burst);
        }
    }
    bound
}

/// N·c + P for a key-window's local admissions (docs/accuracy.md, "Batched"): N the agents that
/// admitted locally, c the largest cost, P the most units admitted locally in any span of half a
/// flush interval.
fn batched_over(win: &Window, flush_ms: u64) -> u64 {
    let half = (flush_ms / 2).max(1);
    let mut local = win.local.clone();
    local.sort_unstable();
    let (mut p, mut sum, mut from) = (0, 0, 0);
    for (i, &(t, cost)) in local.iter().enumerate() {
        sum += cost;
        while local[from].0 + half <= t {
            sum -= local[from].1;
            from += 1;
        }
        debug_assert!(from <= i);
        p = p.max(sum);
    }
    let c = local.iter().map(|&(_, cost)| cost).max().unwrap_or(0);
    win.local_agents.len() as u64 * c + p
}

#[cfg(test)]
#[path = "judge_tests.rs"]
mod tests;
