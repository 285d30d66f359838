//! Version 2's fail-mode list: the rules that deny while the agent is away, as the agent sends them
//! and as an SDK matches a check against them. The endpoint matcher here is the agent's own.

use crate::frame::{Check, CompactString};

/// The attribute a rule's keys are built from, as the list carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListedDimension {
    /// `user:<id>`.
    User,
    /// `apikey:<key>`.
    ApiKey,
    /// `ip:<addr>`.
    Ip,
    /// An Envoy descriptor: never matches an attribute check.
    Descriptor,
}

impl ListedDimension {
    /// The byte on the wire.
    pub fn to_u8(self) -> u8 {
        match self {
            ListedDimension::User => 0,
            ListedDimension::ApiKey => 1,
            ListedDimension::Ip => 2,
            ListedDimension::Descriptor => 3,
        }
    }

    /// The dimension for a wire byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => ListedDimension::User,
            1 => ListedDimension::ApiKey,
            2 => ListedDimension::Ip,
            3 => ListedDimension::Descriptor,
            _ => return None,
        })
    }
}

/// One rule that fails closed: what an SDK needs to tell whether a check touches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosedRule {
    /// The rule id items name.
    pub rule_id: CompactString,
    /// The attribute its keys are built from.
    pub dimension: ListedDimension,
    /// Its endpoint pattern; empty: every endpoint.
    pub endpoint: String,
    /// Its tier; empty: every tier.
    pub tier: String,
    /// Its limit (token bucket: capacity), for `X-RateLimit-Limit`.
    pub limit: u64,
}

/// The body of a FailModeList frame: every enforced rule with `failMode = "closed"`, in rule-set order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FailModeList {
    /// The agent's rule set version (0 for a rules file).
    pub rules_version: u64,
    /// More rules than one frame holds: `rules` is a prefix of the list.
    pub truncated: bool,
    /// The rules.
    pub rules: Vec<ClosedRule>,
}

/// Bytes of a FailModeList body before its rules: version, flags, count.
pub const LIST_HEAD: usize = 8 + 1 + 2;

impl ClosedRule {
    /// Bytes this rule takes in a FailModeList body.
    pub fn encoded_len(&self) -> usize {
        1 + self.rule_id.len() + 1 + 2 + self.endpoint.len() + 2 + self.tier.len() + 8
    }

    /// Whether `check` would be checked against this rule by the agent: an item names it, or the
    /// attributes match it as the agent matches them (dimension present, tier, endpoint pattern).
    pub fn touches(&self, check: &Check) -> bool {
        match check {
            Check::Items(items) => items.iter().any(|i| i.rule_id == self.rule_id),
            Check::Attributes(a) => {
                let carried = match self.dimension {
                    ListedDimension::User => &a.user,
                    ListedDimension::ApiKey => &a.api_key,
                    ListedDimension::Ip => &a.ip,
                    ListedDimension::Descriptor => return false,
                };
                if carried.as_deref().is_none_or(str::is_empty) {
                    return false;
                }
                if !self.tier.is_empty() && a.tier.as_deref() != Some(self.tier.as_str()) {
                    return false;
                }
                self.endpoint.is_empty()
                    || a.endpoint
                        .as_deref()
                        .is_some_and(|e| !e.is_empty() && endpoint_matches(&self.endpoint, e))
            }
        }
    }
}

impl FailModeList {
    /// The first listed rule `check` touches, if any: such a check is denied while the agent is away.
    pub fn closing(&self, check: &Check) -> Option<&ClosedRule> {
        self.rules.iter().find(|r| r.touches(check))
    }
}

/// Whether `endpoint` matches a rule's endpoint `pattern`: exactly, or segment by segment where `*`
/// matches one segment and a `*` in the last segment matches that segment and everything after it
/// (`/api/*` matches `/api/a/b`, not `/api`).
pub fn endpoint_matches(pattern: &str, endpoint: &str) -> bool {
    if !pattern.contains('*') {
        return pattern == endpoint;
    }
    let mut want = pattern.split('/').peekable();
    let mut have = endpoint.split('/');
    while let Some(w) = want.next() {
        let last = want.peek().is_none();
        match (w, have.next()) {
            ("*", Some(_)) if last => return true,
            ("*", Some(_)) => {}
            (w, Some(h)) if w == h => {}
            _ => return false,
        }
    }
    have.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Attributes, Item};

    /// PROTOCOL.md's table, which every SDK passes too.
    #[test]
    fn endpoint_patterns_as_the_protocol_page_lists_them() {
        let doc = include_str!("../PROTOCOL.md");
        let mut rows = 0;
        for line in doc.lines().filter(|l| l.starts_with("| `/")) {
            let cells: Vec<&str> = line.split('|').map(|c| c.trim().trim_matches('`')).collect();
            let (pattern, endpoint, want) = (cells[1], cells[2], cells[3] == "yes");
            assert_eq!(
                endpoint_matches(pattern, endpoint),
                want,
                "{pattern} vs {endpoint}"
            );
            rows += 1;
        }
        assert_eq!(rows, 10, "the page's pattern table");
    }

    fn login() -> ClosedRule {
        ClosedRule {
            rule_id: "login-per-ip".into(),
            dimension: ListedDimension::Ip,
            endpoint: "/login".into(),
            tier: String::new(),
            limit: 5,
        }
    }

    #[test]
    fn items_touch_a_rule_they_name() {
        let list = FailModeList {
            rules: vec![login()],
            ..Default::default()
        };
        let named = Check::Items(vec![
            Item::new("a", "api", 1),
            Item::new("ip:1", "login-per-ip", 1),
        ]);
        assert_eq!(list.closing(&named).map(|r| r.limit), Some(5));
        assert!(list
            .closing(&Check::Items(vec![Item::new("a", "api", 1)]))
            .is_none());
    }

    #[test]
    fn attributes_touch_a_rule_the_agent_would_match() {
        let rule = login();
        let a = |endpoint: Option<&str>, ip: Option<&str>| {
            Check::Attributes(Attributes {
                endpoint: endpoint.map(Into::into),
                ip: ip.map(Into::into),
                cost: 1,
                ..Default::default()
            })
        };
        assert!(rule.touches(&a(Some("/login"), Some("203.0.113.5"))));
        assert!(
            !rule.touches(&a(Some("/login"), None)),
            "no IP: the rule would not apply"
        );
        assert!(!rule.touches(&a(Some("/search"), Some("203.0.113.5"))));
        assert!(!rule.touches(&a(None, Some("203.0.113.5"))));
        let staff = ClosedRule {
            tier: "staff".into(),
            endpoint: String::new(),
            ..login()
        };
        assert!(!staff.touches(&a(Some("/x"), Some("1"))), "tier absent");
        let descriptor = ClosedRule {
            dimension: ListedDimension::Descriptor,
            endpoint: String::new(),
            ..login()
        };
        assert!(!descriptor.touches(&a(Some("/login"), Some("1"))));
    }
}
