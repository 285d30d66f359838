//! A validated set of rules, swapped whole, and the rules file (TOML or JSON) it is read from.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use super::model::Rule;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    #[serde(default)]
    rules: Vec<Rule>,
}

/// Why a rule set could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// The file could not be read.
    #[error("cannot read rules file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not a valid rules document.
    #[error("invalid rules: {0}")]
    Parse(String),
    /// A rule breaks a constraint.
    #[error("invalid rule: {0}")]
    Invalid(String),
}

/// A validated, immutable set of rules, shared by `Arc` and swapped whole.
#[derive(Debug, Default)]
pub struct RuleSet {
    /// Every check looks its rules up here. Rule ids are the operators', not the clients' (an
    /// unknown id only misses), so no hash flooding can reach this map: foldhash instead of SipHash
    /// (about a third of the instructions for an id of a few bytes).
    by_id: HashMap<String, Arc<Rule>, foldhash::fast::RandomState>,
    ordered: Vec<Arc<Rule>>,
    version: u64,
    descriptors: super::descriptors::DescriptorIndex,
}

impl RuleSet {
    /// Builds a set, refusing duplicates and invalid rules.
    pub fn new(rules: Vec<Rule>) -> Result<Self, RuleError> {
        let mut set = RuleSet::default();
        for rule in rules {
            rule.validate().map_err(RuleError::Invalid)?;
            let rule = Arc::new(rule);
            if set.by_id.insert(rule.id.clone(), rule.clone()).is_some() {
                return Err(RuleError::Invalid(format!("rule id {} appears twice", rule.id)));
            }
            if let Some(envoy) = &rule.envoy {
                set.descriptors.insert(envoy, &rule).map_err(RuleError::Invalid)?;
            }
            set.ordered.push(rule);
        }
        Ok(set)
    }

    /// The largest valid set that can be made of `rules` when [`new`](Self::new) refuses them
    /// whole, and what was left out with why: rules are taken oldest version first, and a rule that
    /// is invalid, or conflicts with one already taken (an id twice, an Envoy descriptor answered
    /// twice), is left out. That is the set the rules service would hold had the later of two
    /// racing writes been refused; an agent with no set in force starts on it rather than on none.
    pub fn salvage(mut rules: Vec<Rule>) -> (Self, Vec<(String, String)>) {
        rules.sort_by(|a, b| (a.version, &a.id).cmp(&(b.version, &b.id)));
        let mut set = RuleSet::default();
        let mut left_out = Vec::new();
        for rule in rules {
            if let Err(e) = rule.validate() {
                left_out.push((rule.id.clone(), e));
                continue;
            }
            if set.by_id.contains_key(&rule.id) {
                left_out.push((rule.id.clone(), format!("rule id {} appears twice", rule.id)));
                continue;
            }
            let rule = Arc::new(rule);
            if let Some(envoy) = &rule.envoy {
                if let Err(e) = set.descriptors.insert(envoy, &rule) {
                    left_out.push((rule.id.clone(), e));
                    continue;
                }
            }
            set.by_id.insert(rule.id.clone(), rule.clone());
            set.ordered.push(rule);
        }
        (set, left_out)
    }

    /// The rules service's global version this set is (0 for a rules file).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The same set marked with the rules service's global version.
    pub fn with_version(mut self, version: u64) -> Self {
        self.version = version;
        self
    }

    /// Parses a TOML (`[[rules]]`) or JSON (`{"rules": [...]}`) document; JSON if it starts with `{`.
    pub fn parse(text: &str) -> Result<Self, RuleError> {
        let file: RulesFile = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| RuleError::Parse(e.to_string()))?
        } else {
            toml::from_str(text).map_err(|e| RuleError::Parse(e.to_string()))?
        };
        Self::new(file.rules)
    }

    /// Loads a rules file: TOML or JSON, or envoyproxy/ratelimit's YAML when it ends in `.yaml` or
    /// `.yml`.
    pub fn load(path: &Path) -> Result<Self, RuleError> {
        let text = std::fs::read_to_string(path).map_err(|source| RuleError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let yaml = matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"));
        if yaml {
            let rules = super::envoy_config::rules_from_yaml(&text).map_err(|e| RuleError::Parse(e.0))?;
            return Self::new(rules);
        }
        Self::parse(&text)
    }

    /// The rule with this id.
    pub fn get(&self, id: &str) -> Option<&Arc<Rule>> {
        self.by_id.get(id)
    }

    /// The rule answering an Envoy descriptor of `domain` with these `(key, value)` entries, walked
    /// as envoyproxy/ratelimit walks its configuration tree (an `unlimited` rule's descriptor is
    /// not to be counted).
    pub fn for_descriptor<'a>(
        &self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<&Arc<Rule>> {
        self.descriptors.lookup(domain, entries)
    }

    /// All rules, in file order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Rule>> {
        self.ordered.iter()
    }

    /// How many rules.
    pub fn len(&self) -> usize {
        self.ordered.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ordered.is_empty()
    }
}
