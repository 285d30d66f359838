//! Log mode's dry run: what a rule in log mode would have rejected, counted per rule version and
//! client key (bounded), logged (at most 10 a second per rule), streamed as events (a key's first
//! would-be rejection since the last report; see [`DryRun::record`]), and reported to the rules
//! service, which adds up every agent's reports (`GET /v1/rules/{id}/dry-run`).

use std::collections::HashMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Distinct keys counted per rule between two reports; past it, only the total grows.
pub const KEYS_CAP: usize = 1_000;

/// Keys a report and a summary carry.
pub const TOP_KEYS: usize = 10;

/// Would-be rejections of one rule version.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tally {
    /// The rule's version.
    pub version: u64,
    /// Would-be rejections.
    pub count: u64,
    /// The keys with the most, most first.
    pub top_keys: Vec<(String, u64)>,
}

#[derive(Default)]
struct Pending {
    version: u64,
    count: u64,
    keys: HashMap<String, u64>,
    logged_second: u64,
    logged: u32,
}

/// The agent's side: counts since the last report.
#[derive(Default)]
pub struct DryRun {
    rules: Mutex<HashMap<String, Pending>>,
}

impl DryRun {
    /// Counts one would-be rejection of (rule, version) for `key` at `now_ms`. Returns whether it is
    /// worth an event: the key's first since the last report (or, past the tracked keys, one of the
    /// rule's 10 logged a second), so a busy key in a tight dry run cannot flood the stream.
    pub fn record(&self, rule: &str, version: u64, key: &str, now_ms: u64) -> bool {
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let p = rules.entry(rule.to_string()).or_default();
        if version < p.version {
            // A check still in flight under the rule's older version.
            return false;
        }
        if p.version != version {
            *p = Pending {
                version,
                ..Default::default()
            };
        }
        p.count += 1;
        let len = p.keys.len();
        let first = match p.keys.get_mut(key) {
            Some(n) => {
                *n += 1;
                false
            }
            None if len < KEYS_CAP => {
                p.keys.insert(key.to_string(), 1);
                true
            }
            None => false,
        };
        let second = now_ms / 1_000;
        if p.logged_second != second {
            p.logged_second = second;
            p.logged = 0;
        }
        let logged = p.logged < 10;
        if logged {
            p.logged += 1;
            tracing::info!(target: "floodgate::dry_run", rule, version, key, "log mode: would reject");
        }
        first || (logged && len >= KEYS_CAP)
    }

    /// Puts back a report that could not be sent, to go with the next one (dropped if the rule has
    /// moved to a newer version meanwhile).
    pub fn give_back(&self, rule: &str, tally: Tally) {
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let p = rules.entry(rule.to_string()).or_default();
        if tally.version < p.version {
            return;
        }
        if tally.version > p.version {
            p.version = tally.version;
            p.count = 0;
            p.keys.clear();
        }
        p.count = p.count.saturating_add(tally.count);
        for (k, n) in tally.top_keys {
            let len = p.keys.len();
            match p.keys.get_mut(&k) {
                Some(c) => *c = c.saturating_add(n),
                None if len < KEYS_CAP => {
                    p.keys.insert(k, n);
                }
                None => {}
            }
        }
    }

    /// Takes what was counted since the last call, per rule.
    pub fn take(&self) -> Vec<(String, Tally)> {
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        rules
            .drain()
            .filter(|(_, p)| p.count > 0)
            .map(|(rule, p)| {
                (
                    rule,
                    Tally {
                        version: p.version,
                        count: p.count,
                        top_keys: top(p.keys.into_iter().collect(), KEYS_CAP),
                    },
                )
            })
            .collect()
    }
}

fn top(mut keys: Vec<(String, u64)>, n: usize) -> Vec<(String, u64)> {
    keys.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    keys.truncate(n);
    keys
}

/// One rule's totals: the tally, since when (Unix ms), and the count per key.
type Totals = (Tally, u64, HashMap<String, u64>);

/// The rules service's side: every agent's reports added up, per rule, since its current version.
#[derive(Default)]
pub struct DryRunTotals {
    rules: Mutex<HashMap<String, Totals>>,
}

impl DryRunTotals {
    /// Adds an agent's report (a report for an older version than the one counted is dropped; a
    /// newer version starts the count over).
    pub fn add(&self, rule: &str, report: Tally, now_ms: u64) {
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let entry = rules.entry(rule.to_string()).or_insert_with(|| {
            (
                Tally {
                    version: report.version,
                    ..Default::default()
                },
                now_ms,
                HashMap::new(),
            )
        });
        if report.version < entry.0.version {
            return;
        }
        if report.version > entry.0.version {
            *entry = (
                Tally {
                    version: report.version,
                    ..Default::default()
                },
                now_ms,
                HashMap::new(),
            );
        }
        entry.0.count = entry.0.count.saturating_add(report.count);
        for (k, n) in report.top_keys {
            let len = entry.2.len();
            match entry.2.get_mut(&k) {
                Some(c) => *c = c.saturating_add(n),
                None if len < KEYS_CAP => {
                    entry.2.insert(k, n);
                }
                None => {}
            }
        }
    }

    /// A rule's totals: the version counted, since when (Unix ms), the count and the top keys.
    pub fn get(&self, rule: &str) -> Option<(Tally, u64)> {
        let rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let (t, since, keys) = rules.get(rule)?;
        let mut t = t.clone();
        t.top_keys = top(keys.iter().map(|(k, n)| (k.clone(), *n)).collect(), TOP_KEYS);
        Some((t, *since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_news_once_per_report() {
        let d = DryRun::default();
        assert!(d.record("r", 1, "user:1", 0), "the key's first");
        assert!(!d.record("r", 1, "user:1", 0), "a repeat");
        assert!(d.record("r", 1, "user:2", 0), "another key");
        assert!(d.record("r", 2, "user:1", 0), "a new version starts over");
        assert!(!d.record("r", 1, "user:3", 0), "an older version counts nothing");
        drop(d.take());
        assert!(d.record("r", 2, "user:1", 0), "news again after a report");
        // Past the tracked keys: at most the rule's 10 logged a second.
        let d = DryRun::default();
        for i in 0..KEYS_CAP {
            d.record("r", 1, &format!("k{i}"), 0);
        }
        let news = (0..100)
            .filter(|i| d.record("r", 1, &format!("x{i}"), 1_000))
            .count();
        assert_eq!(news, 10);
    }

    #[test]
    fn counts_per_version_and_adds_up_across_agents() {
        let (a, b) = (DryRun::default(), DryRun::default());
        for _ in 0..3 {
            a.record("r", 2, "user:1", 0);
        }
        b.record("r", 2, "user:2", 0);
        b.record("r", 1, "user:3", 0);
        b.record("r", 2, "user:1", 0);
        let totals = DryRunTotals::default();
        for (rule, t) in a.take().into_iter().chain(b.take()) {
            totals.add(&rule, t, 5);
        }
        let (t, since) = totals.get("r").unwrap();
        assert_eq!((t.version, t.count, since), (2, 5, 5));
        assert_eq!(t.top_keys[0], ("user:1".to_string(), 4));
        assert!(a.take().is_empty(), "taken once");
        // A report that could not be sent goes with the next one.
        a.record("r", 2, "user:1", 0);
        let unsent = a.take();
        a.record("r", 2, "user:2", 0);
        for (rule, t) in unsent {
            a.give_back(&rule, t);
        }
        let next = a.take();
        assert_eq!((next.len(), next[0].1.count), (1, 2));
        // Totals saturate rather than overflow on a hostile report.
        let big = Tally {
            version: 2,
            count: u64::MAX,
            top_keys: vec![("user:1".into(), u64::MAX)],
        };
        totals.add("r", big, 6);
        assert_eq!(totals.get("r").unwrap().0.count, u64::MAX);
        totals.add(
            "r",
            Tally {
                version: 3,
                count: 1,
                top_keys: vec![("user:9".into(), 1)],
            },
            9,
        );
        assert_eq!(totals.get("r").unwrap().0.count, 1, "a new version starts over");
    }
}
