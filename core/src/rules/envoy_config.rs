//! envoyproxy/ratelimit's YAML configuration as Floodgate rules: one `descriptor` rule per descriptor
//! with a `rate_limit`, its `envoy` path the descriptor's place in the tree. What cannot be mapped is
//! refused with an error naming the descriptor (docs/envoy.md has the table).

use std::collections::HashSet;
use std::num::NonZeroU64;

use serde::Deserialize;

use super::{Dimension, EnvoyEntry, EnvoyMatch, Mode, Rule, MAX_ENVOY_DEPTH};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    domain: Option<String>,
    #[serde(default)]
    descriptors: Vec<Descriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Descriptor {
    key: Option<String>,
    value: Option<String>,
    rate_limit: Option<RateLimit>,
    #[serde(default)]
    descriptors: Vec<Descriptor>,
    #[serde(default)]
    shadow_mode: bool,
    // Accepted and without effect: Floodgate's metrics are per rule (docs/envoy.md).
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    #[serde(default)]
    #[allow(dead_code)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    quota_mode: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimit {
    unit: Option<String>,
    requests_per_unit: Option<u64>,
    unit_multiplier: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<yaml_serde::Value>,
}

/// The seconds in one envoyproxy/ratelimit unit (month and year are calendar units, not windows).
fn unit_seconds(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "second" => 1,
        "minute" => 60,
        "hour" => 3_600,
        "day" => 86_400,
        "week" => 604_800,
        _ => return None,
    })
}

/// Why an envoyproxy/ratelimit configuration file cannot be mapped onto rules: the message names
/// the descriptor and what could not be mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UnmappableConfig(pub String);

/// Parses one envoyproxy/ratelimit configuration file into rules (not yet a validated set).
pub fn rules_from_yaml(text: &str) -> Result<Vec<Rule>, UnmappableConfig> {
    parse(text).map_err(UnmappableConfig)
}

fn parse(text: &str) -> Result<Vec<Rule>, String> {
    let file: File = yaml_serde::from_str(text).map_err(|e| format!("envoy ratelimit config: {e}"))?;
    let domain = match file.domain {
        Some(d) if !d.is_empty() => d,
        _ => return Err("envoy ratelimit config: the domain is missing or empty".into()),
    };
    let mut out = Vec::new();
    let mut ids = HashSet::new();
    let mut path = Vec::new();
    walk(&domain, &file.descriptors, &mut path, &mut out, &mut ids)?;
    Ok(out)
}

fn walk(
    domain: &str,
    list: &[Descriptor],
    path: &mut Vec<EnvoyEntry>,
    out: &mut Vec<Rule>,
    ids: &mut HashSet<String>,
) -> Result<(), String> {
    let mut seen = HashSet::new();
    for d in list {
        let key = match &d.key {
            Some(k) if !k.is_empty() => k.clone(),
            _ => {
                let at = EnvoyMatch {
                    limit_override: false,
                    domain: domain.into(),
                    descriptors: path.clone(),
                    unlimited: false,
                };
                return Err(format!(
                    "descriptor under {}: the key is missing or empty",
                    at.path()
                ));
            }
        };
        path.push(EnvoyEntry {
            key,
            value: d.value.clone().filter(|v| !v.is_empty()),
        });
        let here = EnvoyMatch {
            limit_override: false,
            domain: domain.into(),
            descriptors: path.clone(),
            unlimited: false,
        };
        let name = here.path();
        if !seen.insert(name.clone()) {
            return Err(format!("descriptor {name} appears twice"));
        }
        if path.len() > MAX_ENVOY_DEPTH {
            return Err(format!(
                "descriptor {name}: nested deeper than {MAX_ENVOY_DEPTH} levels"
            ));
        }
        let refuse = |why: &str| Err(format!("descriptor {name}: {why}"));
        if d.share_threshold {
            return refuse("share_threshold cannot be mapped (every value is counted apart)");
        }
        if d.quota_mode {
            return refuse("quota_mode cannot be mapped");
        }
        if let Some(rl) = &d.rate_limit {
            if !rl.replaces.is_empty() {
                return refuse(
                    "replaces cannot be mapped: every matching descriptor's rule is checked, all or nothing",
                );
            }
            if rl.unlimited {
                if rl.unit.is_some() || rl.requests_per_unit.is_some() {
                    return refuse("an unlimited rate_limit takes no unit or requests_per_unit");
                }
                out.push(unlimited_rule(&here, &name, rl.name.as_deref(), ids)?);
            } else {
                out.push(rule_for(&here, &name, d, rl, ids)?);
            }
        } else if d.descriptors.is_empty() {
            // Listed without a rate_limit and without children: envoyproxy/ratelimit answers it
            // without a limit even where a sibling without a value would limit it.
            out.push(unlimited_rule(&here, &name, None, ids)?);
        }
        walk(domain, &d.descriptors, path, out, ids)?;
        path.pop();
    }
    Ok(())
}

/// The rule of an unlimited descriptor: never counted (its limit, the largest a rule may have, is not
/// used by ShouldRateLimit).
fn unlimited_rule(
    here: &EnvoyMatch,
    name: &str,
    given: Option<&str>,
    ids: &mut HashSet<String>,
) -> Result<Rule, String> {
    let id = pick_id(name, given, ids)?;
    let mut path = here.clone();
    path.unlimited = true;
    Ok(Rule {
        id,
        dimension: Dimension::Descriptor,
        matches: Default::default(),
        limit: NonZeroU64::new(1 << 50).expect("nonzero"),
        window_seconds: 1.0,
        lease_seconds: None,
        reservation_seconds: None,
        reservation_expiry: Default::default(),
        period: None,
        timezone: None,
        burst: None,
        algorithm: Default::default(),
        mode: Mode::Enforce,
        fail_mode: Default::default(),
        over_limit: Default::default(),
        execution: Default::default(),
        flush_interval_ms: None,
        per_endpoint: false,
        envoy: Some(path),
        version: 0,
        updated_at: 0,
    })
}

/// A rule id: `name` when given (and valid), else from the path; never one already taken.
fn pick_id(path: &str, given: Option<&str>, ids: &mut HashSet<String>) -> Result<String, String> {
    let id = match given {
        Some(n) => {
            floodgate_protocol::validate_rule_id(n)
                .map_err(|e| format!("descriptor {path}: rate_limit name: {e}"))?;
            n.to_string()
        }
        // Two paths that differ only in characters a rule id cannot hold get the hashed form.
        None if ids.contains(&rule_id(path)) => hashed_rule_id(path),
        None => rule_id(path),
    };
    if !ids.insert(id.clone()) {
        return Err(format!(
            "descriptor {path}: rule id {id} is taken by another descriptor"
        ));
    }
    Ok(id)
}

fn rule_for(
    here: &EnvoyMatch,
    name: &str,
    d: &Descriptor,
    rl: &RateLimit,
    ids: &mut HashSet<String>,
) -> Result<Rule, String> {
    let unit = rl
        .unit
        .as_deref()
        .ok_or_else(|| format!("descriptor {name}: rate_limit has no unit"))?;
    let multiplier = rl.unit_multiplier.unwrap_or(1);
    if multiplier == 0 {
        return Err(format!("descriptor {name}: unit_multiplier must be at least 1"));
    }
    // Month and year are calendar periods: a quota (UTC), exact per period.
    let period = match unit.to_ascii_lowercase().as_str() {
        "month" => Some(crate::algo::Period::Month),
        "year" => Some(crate::algo::Period::Year),
        _ => None,
    };
    if period.is_some() && multiplier != 1 {
        return Err(format!(
            "descriptor {name}: unit {unit:?} with unit_multiplier {multiplier} cannot be mapped (a calendar quota is one month or one year)"
        ));
    }
    let seconds = match period {
        Some(_) => 0,
        None => unit_seconds(unit).ok_or_else(|| {
            format!(
                "descriptor {name}: unit {unit:?} cannot be mapped (second, minute, hour, day, week, month or year)"
            )
        })?,
    };
    let window = seconds
        .checked_mul(multiplier)
        .filter(|w| *w <= 31_536_000)
        .ok_or_else(|| format!("descriptor {name}: the window (unit × unit_multiplier) is over a year"))?;
    let limit = match rl.requests_per_unit {
        Some(n) => NonZeroU64::new(n).ok_or_else(|| {
            format!(
                "descriptor {name}: requests_per_unit 0 cannot be mapped (a Floodgate limit is at least 1)"
            )
        })?,
        None => return Err(format!("descriptor {name}: rate_limit has no requests_per_unit")),
    };
    let id = pick_id(name, rl.name.as_deref(), ids)?;
    Ok(Rule {
        id,
        dimension: Dimension::Descriptor,
        matches: Default::default(),
        limit,
        window_seconds: window as f64,
        lease_seconds: None,
        reservation_seconds: None,
        reservation_expiry: Default::default(),
        period,
        timezone: None,
        burst: None,
        algorithm: if period.is_some() {
            crate::rules::Algorithm::Quota
        } else {
            Default::default()
        },
        mode: if d.shadow_mode { Mode::Log } else { Mode::Enforce },
        fail_mode: Default::default(),
        over_limit: Default::default(),
        execution: Default::default(),
        flush_interval_ms: None,
        per_endpoint: false,
        envoy: Some(here.clone()),
        version: 0,
        updated_at: 0,
    })
}

/// A rule id from a descriptor's path: its characters outside `[A-Za-z0-9_.:-]` become `-`; a path
/// over 128 bytes is hashed ([`hashed_rule_id`]).
pub fn rule_id(path: &str) -> String {
    let clean = sanitized(path);
    if clean.len() <= floodgate_protocol::MAX_RULE_ID {
        return clean;
    }
    hashed_rule_id(path)
}

/// The first 100 bytes of the sanitized path and the FNV-1a hash of the whole path.
pub fn hashed_rule_id(path: &str) -> String {
    let hash = floodgate_protocol::http::fnv1a64(path.as_bytes());
    let mut cut = sanitized(path);
    cut.truncate(100);
    format!("{cut}.{hash:016x}")
}

fn sanitized(path: &str) -> String {
    path.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.:-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    // envoyproxy/ratelimit's test/config/basic_config.yaml, as its config tests use it.
    const BASIC: &str = "
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit: {unit: day, requests_per_unit: 25}
  - key: key6
    rate_limit: {unlimited: true}
  - key: key7
    rate_limit: {unit: minute, requests_per_unit: 70}
    detailed_metric: true
  - key: wild
    value: foo*
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: midWildcard
    value: ba*b
    rate_limit: {unit: minute, requests_per_unit: 20}
";

    fn limit(set: &RuleSet, entries: &[(&str, &str)]) -> Option<(u64, u64)> {
        set.for_descriptor("test-domain", entries.iter().copied())
            .filter(|r| !r.envoy.as_ref().is_some_and(|e| e.unlimited))
            .map(|r| (r.limit.get(), r.window_ms() / 1000))
    }

    #[test]
    fn lookups_follow_envoyproxy_ratelimit_basic_config() {
        let set = RuleSet::new(rules_from_yaml(BASIC).unwrap()).unwrap();
        assert_eq!(set.for_descriptor("foo_domain", [("key1", "value1")]), None);
        assert_eq!(limit(&set, &[]), None);
        assert_eq!(limit(&set, &[("key1", "something")]), None);
        assert_eq!(limit(&set, &[("key1", "value1")]), None);
        assert_eq!(limit(&set, &[("key2", "value2"), ("subkey", "subvalue")]), None);
        assert_eq!(limit(&set, &[("key5", "value5"), ("subkey5", "subvalue")]), None);
        assert_eq!(
            limit(&set, &[("key1", "value1"), ("subkey1", "something")]),
            Some((5, 1))
        );
        assert_eq!(
            limit(&set, &[("key1", "value1"), ("subkey1", "subvalue1")]),
            Some((10, 1))
        );
        assert_eq!(limit(&set, &[("key2", "something")]), Some((20, 60)));
        assert_eq!(limit(&set, &[("key2", "value2")]), Some((30, 60)));
        assert_eq!(
            limit(&set, &[("key2", "value3")]),
            None,
            "no rate_limit: not limited"
        );
        assert_eq!(limit(&set, &[("key3", "foo")]), Some((1, 3_600)));
        assert_eq!(limit(&set, &[("key4", "foo")]), Some((1, 86_400)));
        assert_eq!(limit(&set, &[("key5", "value5")]), Some((15, 86_400)));
        assert_eq!(
            limit(&set, &[("key5", "value5"), ("subkey5", "subvalue5")]),
            Some((25, 86_400))
        );
        assert_eq!(limit(&set, &[("key6", "foo")]), None, "unlimited");
        assert_eq!(limit(&set, &[("key7", "unspecified_value")]), Some((70, 60)));
        // wildcard.yaml's cases: a trailing * matches a prefix; a * inside a value is literal.
        assert_eq!(limit(&set, &[("wild", "foo1")]), Some((20, 60)));
        assert_eq!(limit(&set, &[("wild", "foo2")]), Some((20, 60)));
        assert_eq!(limit(&set, &[("wild", "bar")]), None);
        // A '*' inside a value is a wildcard, as envoyproxy/ratelimit reads it since 2026.
        assert_eq!(limit(&set, &[("midWildcard", "barab")]), Some((20, 60)));
        assert_eq!(limit(&set, &[("midWildcard", "barabx")]), None);
    }

    #[test]
    fn shadow_mode_is_log_mode_and_ids_come_from_paths_or_names() {
        let rules = rules_from_yaml(
            "domain: d\ndescriptors:\n  - key: k\n    value: v w\n    shadow_mode: true\n    rate_limit: {unit: SECOND, requests_per_unit: 3, unit_multiplier: 5}\n  - key: n\n    rate_limit: {unit: second, requests_per_unit: 1, name: my-rule}\n",
        )
        .unwrap();
        assert_eq!(rules[0].mode, Mode::Log);
        assert_eq!(rules[0].window_seconds, 5.0);
        assert_eq!(rules[0].id, "d.k_v-w");
        assert_eq!(rules[1].id, "my-rule");
        assert_eq!(rule_id("d.k_v"), "d.k_v");
        assert!(rule_id(&"k".repeat(200)).len() <= 128);
        // Paths that sanitize alike stay apart.
        let rules = rules_from_yaml(
            "domain: d\ndescriptors:\n  - key: p\n    value: /a\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: p\n    value: -a\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .unwrap();
        assert_eq!(rules[0].id, "d.p_-a");
        assert!(
            rules[1].id.starts_with("d.p_-a.") && rules[1].id.len() == 6 + 17,
            "{}",
            rules[1].id
        );
    }

    #[test]
    fn months_and_years_become_calendar_quotas() {
        let rules = rules_from_yaml(
            "domain: d\ndescriptors:\n  - key: m\n    rate_limit: {unit: month, requests_per_unit: 10000000}\n  - key: y\n    rate_limit: {unit: year, requests_per_unit: 5}\n",
        )
        .unwrap();
        assert_eq!(rules[0].algorithm, crate::rules::Algorithm::Quota);
        assert_eq!(rules[0].period, Some(crate::algo::Period::Month));
        assert_eq!(rules[1].period, Some(crate::algo::Period::Year));
        assert!(crate::rules::RuleSet::new(rules).is_ok(), "valid rules");
    }

    #[test]
    fn what_cannot_be_mapped_is_refused_naming_the_descriptor() {
        let base = "domain: test-domain\ndescriptors:\n";
        for (body, needle) in [
            (
                "  - key: key1\n    value: value1\n  - key: key1\n    value: value1\n",
                "test-domain.key1_value1 appears twice",
            ),
            ("  - value: v\n", "key is missing"),
            (
                "  - key: k\n    rate_limit: {unit: foo, requests_per_unit: 1}\n",
                "unit \"foo\"",
            ),
            (
                "  - key: k\n    rate_limit: {unit: month, requests_per_unit: 1, unit_multiplier: 2}\n",
                "test-domain.k: unit \"month\" with unit_multiplier 2",
            ),
            (
                "  - key: k\n    rate_limit: {unlimited: true, unit: day}\n",
                "unlimited",
            ),
            (
                "  - key: k\n    rate_limit: {unit: day, requests_per_unit: 0}\n",
                "requests_per_unit 0",
            ),
            (
                "  - key: k\n    rate_limit: {unit: day, requests_per_unit: 5, replaces: [{name: x}]}\n",
                "replaces",
            ),
            (
                "  - key: k\n    ratelimit: {unit: day, requests_per_unit: 5}\n",
                "ratelimit",
            ),
            (
                "  - key: k\n    rate_limit: {unit: day, requestsperunit: 5}\n",
                "requestsperunit",
            ),
            (
                "  - key: k\n    share_threshold: true\n    rate_limit: {unit: day, requests_per_unit: 5}\n",
                "share_threshold",
            ),
            ("  - a\n", "envoy ratelimit config"),

            ("  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1, unit_multiplier: 307445734561825861}\n", "over a year"),
        ] {
            let err = rules_from_yaml(&format!("{base}{body}")).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
        assert!(rules_from_yaml("descriptors: []\n")
            .unwrap_err()
            .to_string()
            .contains("domain"));
    }
}
