//! Per-client overrides: one client key of one rule gets its own limit (and window, burst), until it
//! expires, without a rule per customer. The rules service stores them and every agent follows its
//! changes (`/v1/overrides?since=`); the engine resolves a check's rule for its key through them.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use floodgate_protocol::CompactString;
use serde::{Deserialize, Serialize};

use crate::rules::Rule;

/// Most overrides an agent holds (each ~100-200 B): past it, new ones are refused and counted.
pub const MAX_OVERRIDES: usize = 4_000_000;

/// One client key's own limit under one rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Override {
    /// The key's limit (sliding window, quota, concurrency: per window, period or in flight; token
    /// bucket: the refill per window).
    pub limit: NonZeroU64,
    /// Its own window, in seconds (sliding window, token bucket); the rule's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_seconds: Option<f64>,
    /// Its own bucket capacity (token bucket); the limit when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<NonZeroU64>,
    /// Unix ms after which it no longer applies (none: until deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// Why (a deal, a plan, an incident): required, audited.
    pub reason: String,
    /// Set by the rules service: the version of its last write.
    #[serde(default)]
    pub version: u64,
    /// Set by the rules service: when it was last written (Unix ms).
    #[serde(default)]
    pub updated_at: u64,
}

impl Override {
    /// Checks the override against its rule, as the rule itself is checked: the rule with the
    /// override's figures must be a valid rule.
    pub fn check(&self, rule: &Rule) -> Result<(), String> {
        if self.reason.trim().is_empty() || self.reason.len() > 512 {
            return Err("reason must be 1 to 512 bytes".into());
        }
        if self.window_seconds.is_some() && !rule.algorithm.has_window() {
            return Err(format!(
                "rule {} has no window (a {:?} rule): windowSeconds is refused",
                rule.id, rule.algorithm
            ));
        }
        if self.burst.is_some() && !rule.algorithm.has_burst() {
            return Err(format!(
                "burst applies to a token bucket; rule {} is not one",
                rule.id
            ));
        }
        let derived = self.apply_to(rule);
        derived.check().map(|_| ()).map_err(|e| e.0)
    }

    /// The rule as this key sees it: the override's figures, a version of its own (so that state
    /// the agent keeps under the rule, such as a cached rejection, is dropped when it changes).
    pub fn apply_to(&self, rule: &Rule) -> Rule {
        let mut r = rule.clone();
        r.limit = self.limit;
        if let Some(w) = self.window_seconds {
            r.window_seconds = w;
        }
        if rule.algorithm.has_burst() {
            r.burst = self.burst.or(Some(self.limit));
        }
        // Distinct from every rule version (the service's versions are far below 2^62).
        r.version = (1 << 62) | self.version;
        r
    }

    /// Whether it applies at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        self.expires_at.is_none_or(|t| now_ms < t)
    }
}

/// The rule id under which the service keeps penalties beside overrides (no rule id has a `*`).
pub const PENALTY_RULE: &str = "*";

/// Most a penalty may last: 90 days.
pub const MAX_PENALTY_MS: u64 = 90 * 86_400_000;

/// A temporary penalty on a client key, over every rule its checks meet: its limits scaled by
/// `factor`, or every check refused (`block`), until `until`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Penalty {
    /// The key's limits times this (above 0, below 1); at least 1 unit is left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// Every check of the key refused until `until`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block: bool,
    /// Unix ms at which it ends by itself.
    pub until: u64,
    /// Why (an abuse score, an incident): required, audited.
    pub reason: String,
    /// Set by the rules service: the version of its last write.
    #[serde(default)]
    pub version: u64,
    /// Set by the rules service: when it was last written (Unix ms).
    #[serde(default)]
    pub updated_at: u64,
}

impl Penalty {
    /// Checks it: exactly one of a factor in (0, 1) or a block, an end in the future and within 90
    /// days of `now_ms`, a reason.
    pub fn check(&self, now_ms: u64) -> Result<(), String> {
        match (self.factor, self.block) {
            (Some(f), false) if f > 0.0 && f < 1.0 => {}
            (Some(_), false) => return Err("factor must be above 0 and below 1".into()),
            (None, true) => {}
            _ => return Err("a penalty is either a factor or a block".into()),
        }
        if self.until <= now_ms || self.until > now_ms + MAX_PENALTY_MS {
            return Err("until must be in the future, within 90 days (Unix ms)".into());
        }
        if self.reason.trim().is_empty() || self.reason.len() > 512 {
            return Err("reason must be 1 to 512 bytes".into());
        }
        Ok(())
    }

    /// `rule` with its limit (and burst) scaled by the factor, at least 1; a version of its own.
    fn apply_to(&self, rule: &Rule) -> Rule {
        let f = self.factor.unwrap_or(1.0);
        let scale = |n: NonZeroU64| NonZeroU64::new((n.get() as f64 * f) as u64).unwrap_or(NonZeroU64::MIN);
        let mut r = rule.clone();
        r.limit = scale(rule.limit);
        r.burst = rule.burst.map(scale);
        r.version = (3 << 62) | self.version;
        r
    }
}

/// One change of the overrides the rules service sends: an override (or, under rule `*`, a
/// penalty) written, or with neither deleted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OverrideChange {
    /// The rule (`*`: a penalty of the key).
    pub rule_id: String,
    /// The client key, as checks build it (`apikey:abc`).
    pub client_key: String,
    /// The override, or none: deleted.
    pub set: Option<Override>,
    /// The penalty (rule `*`), or none: deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub penalty: Option<Penalty>,
    /// The overrides version of this change.
    pub version: u64,
}

/// A rule and the one a penalty or an override made of it.
type Made = (Arc<Rule>, Arc<Rule>);

/// A penalty held by the agent, with the rules it made (built on first use, per rule).
struct HeldPenalty {
    value: Penalty,
    derived: Mutex<HashMap<CompactString, Made>>,
}

/// What a penalty does to one item.
pub enum Penalized {
    /// The item is checked under this rule (scaled).
    Rule(Arc<Rule>),
    /// The item is refused until this Unix ms.
    Blocked(u64),
}

/// An override held by the agent, with the rule it made for the key (built on first use, again
/// when the rule changes).
struct Held {
    value: Override,
    derived: Mutex<Option<Made>>,
}

/// The overrides an agent holds, by rule and client key, and the penalties, by client key.
#[derive(Default)]
pub struct Overrides {
    by_rule: RwLock<HashMap<CompactString, HashMap<CompactString, Held>>>,
    len: AtomicUsize,
    penalties: RwLock<HashMap<CompactString, HeldPenalty>>,
    penalty_len: AtomicUsize,
    version: std::sync::atomic::AtomicU64,
    /// Changes refused because the agent held `MAX_OVERRIDES`.
    pub refused: std::sync::atomic::AtomicU64,
}

impl Overrides {
    /// How many are held.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The overrides version the agent holds (the last change applied).
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    /// Applies changes in order: each written or deleted; `version` becomes what the agent holds.
    /// Returns the (rule id, client key) pairs changed.
    pub fn apply(&self, changes: Vec<OverrideChange>, version: u64) -> Vec<(String, String)> {
        let mut map = self.by_rule.write().unwrap_or_else(|p| p.into_inner());
        let mut touched = Vec::with_capacity(changes.len());
        for c in changes {
            if c.rule_id == PENALTY_RULE {
                self.apply_penalty(c.client_key.as_str(), c.penalty);
                touched.push((c.rule_id, c.client_key));
                continue;
            }
            let rule = map.entry(CompactString::from(c.rule_id.as_str())).or_default();
            let key = CompactString::from(c.client_key.as_str());
            match c.set {
                Some(mut value) => {
                    // The reason is the service's record (its audit, its API): an agent needs only
                    // the figures, so a million overrides do not carry a million reasons.
                    value.reason = String::new();
                    let held = Held {
                        value,
                        derived: Mutex::new(None),
                    };
                    let full = self.len.load(Ordering::Relaxed) >= MAX_OVERRIDES;
                    match rule.entry(key) {
                        std::collections::hash_map::Entry::Occupied(mut e) => {
                            e.insert(held);
                        }
                        std::collections::hash_map::Entry::Vacant(_) if full => {
                            self.refused.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert(held);
                            self.len.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                None => {
                    if rule.remove(&key).is_some() {
                        self.len.fetch_sub(1, Ordering::Relaxed);
                    }
                }
            }
            touched.push((c.rule_id, c.client_key));
        }
        map.retain(|_, keys| !keys.is_empty());
        self.version.store(version, Ordering::Relaxed);
        touched
    }

    fn apply_penalty(&self, key: &str, value: Option<Penalty>) {
        let mut map = self.penalties.write().unwrap_or_else(|p| p.into_inner());
        let key = CompactString::from(key);
        match value {
            Some(mut value) => {
                value.reason = String::new();
                let held = HeldPenalty {
                    value,
                    derived: Mutex::default(),
                };
                if map.insert(key, held).is_none() {
                    self.penalty_len.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                if map.remove(&key).is_some() {
                    self.penalty_len.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// How many penalties are held (live or not yet dropped).
    pub fn penalties(&self) -> usize {
        self.penalty_len.load(Ordering::Relaxed)
    }

    /// Up to `max` penalties live at `now_ms`: (client key, penalty), for the agent's status.
    pub fn live_penalties(&self, now_ms: u64, max: usize) -> Vec<(String, Penalty)> {
        let map = self.penalties.read().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .filter(|(_, h)| h.value.until > now_ms)
            .take(max)
            .map(|(k, h)| (k.to_string(), h.value.clone()))
            .collect()
    }

    /// What a live penalty of `key` (or of the client part of a per-endpoint key,
    /// `apikey:abc:endpoint:/x`) does to an item of `rule`.
    pub fn penalized(&self, rule: &Arc<Rule>, key: &str, now_ms: u64) -> Option<Penalized> {
        if self.penalties() == 0 {
            return None;
        }
        let map = self.penalties.read().unwrap_or_else(|p| p.into_inner());
        let client = key.split_once(":endpoint:").map_or(key, |(c, _)| c);
        let held = map.get(key).or_else(|| map.get(client))?;
        if held.value.until <= now_ms {
            return None;
        }
        if held.value.block {
            return Some(Penalized::Blocked(held.value.until));
        }
        let mut derived = held.derived.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((base, made)) = derived.get(rule.id.as_str()) {
            if Arc::ptr_eq(base, rule) {
                return Some(Penalized::Rule(made.clone()));
            }
        }
        let made = Arc::new(held.value.apply_to(rule));
        derived.insert(
            CompactString::from(rule.id.as_str()),
            (rule.clone(), made.clone()),
        );
        Some(Penalized::Rule(made))
    }

    /// Drops every override (the service's store was replaced: it sends them all again).
    pub fn clear(&self) {
        self.penalties.write().unwrap_or_else(|p| p.into_inner()).clear();
        self.penalty_len.store(0, Ordering::Relaxed);
        self.by_rule.write().unwrap_or_else(|p| p.into_inner()).clear();
        self.len.store(0, Ordering::Relaxed);
        self.version.store(0, Ordering::Relaxed);
    }

    /// The rule `key` is checked under: its override's, if one is live, else `rule` itself.
    pub fn rule_for(&self, rule: &Arc<Rule>, key: &str, now_ms: u64) -> Option<Arc<Rule>> {
        let map = self.by_rule.read().unwrap_or_else(|p| p.into_inner());
        let held = map.get(rule.id.as_str())?.get(key)?;
        if !held.value.live(now_ms) {
            return None;
        }
        let mut derived = held.derived.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((base, made)) = derived.as_ref() {
            if Arc::ptr_eq(base, rule) {
                return Some(made.clone());
            }
        }
        let made = Arc::new(held.value.apply_to(rule));
        *derived = Some((rule.clone(), made.clone()));
        Some(made)
    }

    /// One override, if held (its figures: the reason stays with the service).
    pub fn get(&self, rule_id: &str, key: &str) -> Option<Override> {
        let map = self.by_rule.read().unwrap_or_else(|p| p.into_inner());
        map.get(rule_id)?.get(key).map(|h| h.value.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    fn change(rule: &str, key: &str, limit: Option<u64>, version: u64) -> OverrideChange {
        OverrideChange {
            rule_id: rule.into(),
            client_key: key.into(),
            penalty: None,
            set: limit.map(|l| Override {
                limit: NonZeroU64::new(l).unwrap(),
                window_seconds: None,
                burst: None,
                expires_at: Some(10_000),
                reason: "deal".into(),
                version,
                updated_at: 0,
            }),
            version,
        }
    }

    #[test]
    fn a_key_gets_its_own_limit_until_deleted_or_expired() {
        let set = RuleSet::parse(
            r#"{"rules":[{"id":"api","dimension":"api_key","limit":100,"windowSeconds":60}]}"#,
        )
        .unwrap();
        let rule = set.get("api").unwrap();
        let o = Overrides::default();
        assert!(o.rule_for(rule, "apikey:x", 0).is_none());
        o.apply(vec![change("api", "apikey:x", Some(5000), 7)], 7);
        let r = o.rule_for(rule, "apikey:x", 0).unwrap();
        assert_eq!(r.limit.get(), 5000);
        assert_ne!(
            *r, **rule,
            "a rule of its own: state kept under the old one is dropped"
        );
        assert!(
            Arc::ptr_eq(&r, &o.rule_for(rule, "apikey:x", 1).unwrap()),
            "built once"
        );
        assert!(o.rule_for(rule, "apikey:y", 0).is_none(), "that key only");
        assert!(o.rule_for(rule, "apikey:x", 10_000).is_none(), "expired");
        o.apply(vec![change("api", "apikey:x", None, 8)], 8);
        assert!(o.rule_for(rule, "apikey:x", 0).is_none());
        assert_eq!((o.len(), o.version()), (0, 8));
    }

    #[test]
    fn an_override_is_checked_against_its_rule() {
        let set = RuleSet::parse(
            r#"{"rules":[{"id":"c","dimension":"api_key","limit":2,"algorithm":"concurrency"},
                {"id":"w","dimension":"api_key","limit":2,"windowSeconds":1}]}"#,
        )
        .unwrap();
        let mut o = change("c", "k", Some(3), 1).set.unwrap();
        assert!(o.check(set.get("c").unwrap()).is_ok());
        o.window_seconds = Some(5.0);
        assert!(o.check(set.get("c").unwrap()).unwrap_err().contains("no window"));
        o.window_seconds = Some(0.0);
        assert!(o
            .check(set.get("w").unwrap())
            .unwrap_err()
            .contains("windowSeconds"));
        o.window_seconds = None;
        o.reason = " ".into();
        assert!(o.check(set.get("w").unwrap()).unwrap_err().contains("reason"));
    }
}
