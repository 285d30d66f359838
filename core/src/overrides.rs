//! Per-client overrides: one client key of one rule gets its own limit (and window, burst), until it
//! expires, without a rule per customer. The rules service stores them and every agent follows its
//! changes (`/v1/overrides?since=`); the engine resolves a check's rule for its key through them.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use floodgate_protocol::CompactString;
use serde::{Deserialize, Serialize};

use crate::rules::{Algorithm, Rule};

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
        if self.window_seconds.is_some()
            && matches!(rule.algorithm, Algorithm::Concurrency | Algorithm::Quota)
        {
            return Err(format!(
                "rule {} has no window (a {:?} rule): windowSeconds is refused",
                rule.id, rule.algorithm
            ));
        }
        if self.burst.is_some() && rule.algorithm != Algorithm::TokenBucket {
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
        if rule.algorithm == Algorithm::TokenBucket {
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

/// One change of the overrides the rules service sends: an override written, or (none) deleted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OverrideChange {
    /// The rule.
    pub rule_id: String,
    /// The client key, as checks build it (`apikey:abc`).
    pub client_key: String,
    /// The override, or none: deleted.
    pub set: Option<Override>,
    /// The overrides version of this change.
    pub version: u64,
}

/// An override held by the agent, with the rule it made for the key (built on first use, again
/// when the rule changes).
struct Held {
    value: Override,
    derived: Mutex<Option<(Arc<Rule>, Arc<Rule>)>>,
}

/// The overrides an agent holds, by rule and client key.
#[derive(Default)]
pub struct Overrides {
    by_rule: RwLock<HashMap<CompactString, HashMap<CompactString, Held>>>,
    len: AtomicUsize,
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

    /// Drops every override (the service's store was replaced: it sends them all again).
    pub fn clear(&self) {
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
