//! Matching request attributes against the rule set: which rules apply, and the key each one counts.

use std::sync::Arc;

use floodgate_protocol::{endpoint_matches, Attributes};

use super::{Dimension, Rule, RuleSet};

/// The `(rule, key)` pairs that an attribute check must pass, in rule-file order.
///
/// A rule applies when its endpoint pattern and tier match (absent ones match everything) and the
/// request carries its dimension. Keys are `user:<id>`, `apikey:<key>` or `ip:<addr>`, with
/// `:endpoint:<endpoint>` appended for `perEndpoint` rules.
pub fn items_for(rules: &RuleSet, a: &Attributes) -> Vec<(Arc<Rule>, String)> {
    rules
        .iter()
        .filter_map(|rule| {
            if let Some(p) = &rule.matches.endpoint {
                if !endpoint_matches(p, a.endpoint.as_deref()?) {
                    return None;
                }
            }
            if let Some(t) = &rule.matches.tier {
                if a.tier.as_deref() != Some(t.as_str()) {
                    return None;
                }
            }
            let value = match rule.dimension {
                Dimension::User => a.user.as_deref(),
                Dimension::ApiKey => a.api_key.as_deref(),
                Dimension::Ip => a.ip.as_deref(),
                Dimension::Descriptor => None,
            }?;
            let mut key = format!("{}:{value}", rule.dimension.key_prefix());
            if rule.per_endpoint {
                key.push_str(":endpoint:");
                key.push_str(a.endpoint.as_deref().unwrap_or(""));
            }
            Some((rule.clone(), key))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::EXAMPLE_RULES;

    fn attrs(endpoint: &str, tier: Option<&str>) -> Attributes {
        Attributes {
            endpoint: Some(endpoint.into()),
            tier: tier.map(Into::into),
            user: Some("42".into()),
            api_key: Some("abc".into()),
            ip: Some("203.0.113.5".into()),
            cost: 1,
            mode: Default::default(),
            lease: None,
        }
    }

    #[test]
    fn endpoint_patterns_exact_prefix_and_glob() {
        assert!(endpoint_matches("/login", "/login"));
        assert!(!endpoint_matches("/login", "/login/x"));
        assert!(endpoint_matches("/api/*", "/api/search"));
        assert!(endpoint_matches("/api/*", "/api/a/b"));
        assert!(!endpoint_matches("/api/*", "/api"));
        assert!(!endpoint_matches("/api/*", "/apix/y"));
        assert!(endpoint_matches("/users/*/posts", "/users/42/posts"));
        assert!(!endpoint_matches("/users/*/posts", "/users/42/likes"));
        assert!(!endpoint_matches("/users/*/posts", "/users/42/posts/7"));
        assert!(endpoint_matches("/users/*/posts/*", "/users/42/posts/7"));
    }

    #[test]
    fn matches_by_endpoint_tier_and_dimension() {
        let rules = RuleSet::parse(EXAMPLE_RULES).unwrap();
        let got: Vec<_> = items_for(&rules, &attrs("/api/search", Some("free")))
            .into_iter()
            .map(|(r, k)| (r.id.clone(), k))
            .collect();
        assert_eq!(
            got,
            vec![
                ("api-per-user".to_string(), "user:42".to_string()),
                (
                    "free-tier-per-key".to_string(),
                    "apikey:abc:endpoint:/api/search".to_string()
                ),
                ("ip-dry-run".to_string(), "ip:203.0.113.5".to_string()),
            ]
        );
        let login: Vec<_> = items_for(&rules, &attrs("/login", Some("pro")))
            .into_iter()
            .map(|(r, _)| r.id.clone())
            .collect();
        assert_eq!(login, vec!["login-per-ip", "ip-dry-run"]);
    }

    #[test]
    fn a_missing_dimension_skips_the_rule() {
        let rules = RuleSet::parse(EXAMPLE_RULES).unwrap();
        let a = Attributes {
            endpoint: Some("/api/x".into()),
            cost: 1,
            ..Default::default()
        };
        assert!(items_for(&rules, &a).is_empty());
    }
}
