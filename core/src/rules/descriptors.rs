//! Envoy descriptors to rules: envoyproxy/ratelimit's configuration tree, rebuilt from the rules that
//! carry an `envoy` path and walked the way envoyproxy/ratelimit walks it.

use std::collections::HashMap;
use std::sync::Arc;

use super::{EnvoyMatch, Rule};

/// Every domain's tree. Built once per rule set (a set is swapped whole, so is its index).
#[derive(Debug, Default)]
pub struct DescriptorIndex {
    domains: HashMap<String, Node>,
}

#[derive(Debug, Default)]
struct Node {
    /// `key` → `value` → child.
    exact: HashMap<String, HashMap<String, Node>>,
    /// `(key, prefix)` children of values ending in `*`, the longest prefix first (the most specific
    /// wins, whatever order the rules come in: a file's or the rules service's, sorted by id).
    prefixed: Vec<(String, String, Node)>,
    /// `(key, pattern)` children of values with a `*` before their end (`ba*b`: each `*` any run of
    /// characters, as envoyproxy/ratelimit reads them), in rule order, after the prefixes.
    globbed: Vec<(String, String, Node)>,
    /// `key` → child for entries without a value (any value, each counted apart).
    any: HashMap<String, Node>,
    /// The rule whose limit applies when a descriptor's last entry lands here.
    rule: Option<Arc<Rule>>,
}

impl Node {
    fn has_children(&self) -> bool {
        !(self.exact.is_empty() && self.prefixed.is_empty() && self.globbed.is_empty() && self.any.is_empty())
    }

    fn child(&self, key: &str, value: &str) -> Option<&Node> {
        self.exact
            .get(key)
            .and_then(|values| values.get(value))
            .or_else(|| {
                self.prefixed
                    .iter()
                    .find(|(k, prefix, _)| k == key && value.starts_with(prefix.as_str()))
                    .map(|(_, _, n)| n)
            })
            .or_else(|| {
                self.globbed
                    .iter()
                    .find(|(k, pattern, _)| k == key && glob(pattern, value))
                    .map(|(_, _, n)| n)
            })
            .or_else(|| self.any.get(key))
    }
}

impl DescriptorIndex {
    /// Adds `rule` at the end of `path`; two rules at one path are refused, naming both.
    pub fn insert(&mut self, path: &EnvoyMatch, rule: &Arc<Rule>) -> Result<(), String> {
        let mut node = self.domains.entry(path.domain.clone()).or_default();
        for e in &path.descriptors {
            node = match e.value.as_deref() {
                None => node.any.entry(e.key.clone()).or_default(),
                Some(v) if v.strip_suffix('*').unwrap_or(v).contains('*') => {
                    match node.globbed.iter().position(|(k, p, _)| *k == e.key && p == v) {
                        Some(i) => &mut node.globbed[i].2,
                        None => {
                            node.globbed.push((e.key.clone(), v.to_string(), Node::default()));
                            &mut node.globbed.last_mut().expect("just pushed").2
                        }
                    }
                }
                Some(v) if v.ends_with('*') => {
                    let prefix = &v[..v.len() - 1];
                    match node
                        .prefixed
                        .iter()
                        .position(|(k, p, _)| *k == e.key && p == prefix)
                    {
                        Some(i) => &mut node.prefixed[i].2,
                        None => {
                            node.prefixed
                                .push((e.key.clone(), prefix.to_string(), Node::default()));
                            &mut node.prefixed.last_mut().expect("just pushed").2
                        }
                    }
                }
                Some(v) => node
                    .exact
                    .entry(e.key.clone())
                    .or_default()
                    .entry(v.to_string())
                    .or_default(),
            };
        }
        if let Some(other) = &node.rule {
            return Err(format!(
                "rules {} and {} both answer envoy descriptor {}",
                other.id,
                rule.id,
                path.path()
            ));
        }
        node.rule = Some(rule.clone());
        Ok(())
    }

    /// The rule for a request descriptor: each entry steps to the child with its key and value,
    /// else a `*`-prefix value that matches, else a value with a `*` inside that matches, else its
    /// key with any value; the rule of the node the last entry lands on applies. A descriptor that
    /// stops short, or goes past the tree, has none.
    pub fn lookup<'a>(
        &self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<&Arc<Rule>> {
        let mut node = self.domains.get(domain)?;
        let mut entries = entries.into_iter().peekable();
        entries.peek()?;
        while let Some((key, value)) = entries.next() {
            let next = node.child(key, value)?;
            if entries.peek().is_none() {
                return next.rule.as_ref();
            }
            if !next.has_children() {
                return None;
            }
            node = next;
        }
        None
    }
}

/// Whether `value` matches `pattern`, each `*` in it any run of characters (none included).
fn glob(pattern: &str, value: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = value.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod glob_tests {
    use super::glob;

    #[test]
    fn stars_match_any_run_of_characters() {
        assert!(glob("ba*b", "barab"));
        assert!(glob("ba*b", "bab"));
        assert!(!glob("ba*b", "ba"));
        assert!(!glob("ba*b", "barabx"));
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxcyyb"));
        assert!(glob("*x", "yyx"));
        assert!(glob("a**b", "ab"));
    }
}
