//! Rules as code: `floodgate rules validate FILE…` (offline, the rules API's own checks, every error
//! with its rule and field), `diff FILE… --server URL` (what `apply` would do) and `apply FILE…
//! --server URL [--prune]` (idempotent: only what differs is written, each write conditional on the
//! version the diff saw, so a second apply writes nothing and a rule changed meanwhile is not
//! overwritten). Files are TOML (`[[rules]]`), JSON (`{"rules": […]}`) or envoyproxy/ratelimit YAML
//! (`.yaml`, `.yml`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::Value;

use floodgate_core::rules::fields::rule_from_body;
use floodgate_core::rules::{Rule, RuleSet};

/// Every error of one file: `(rule id or "", field or "", why)`.
type Problems = Vec<(String, String, String)>;

/// The rules of every file, each checked as the rules API checks a PUT body, then all of them as one
/// set (an id twice, two rules answering one Envoy descriptor). Every problem is named.
pub fn load(files: &[PathBuf]) -> Result<Vec<Rule>, Vec<(String, Problems)>> {
    let mut rules = Vec::new();
    let mut problems: Vec<(String, Problems)> = Vec::new();
    if files.is_empty() {
        problems.push((
            String::new(),
            vec![(
                String::new(),
                String::new(),
                "name at least one rules file".into(),
            )],
        ));
        return Err(problems);
    }
    for f in files {
        match load_file(f) {
            Ok(r) => rules.extend(r),
            Err(p) => problems.push((f.display().to_string(), p)),
        }
    }
    if problems.is_empty() {
        if let Err(e) = RuleSet::new(rules.clone()) {
            problems.push((
                "(all files)".into(),
                vec![(String::new(), String::new(), e.to_string())],
            ));
        }
    }
    if problems.is_empty() {
        Ok(rules)
    } else {
        Err(problems)
    }
}

fn load_file(path: &Path) -> Result<Vec<Rule>, Problems> {
    let one = |why: String| vec![(String::new(), String::new(), why)];
    let text = std::fs::read_to_string(path).map_err(|e| one(format!("cannot read: {e}")))?;
    if matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
        return floodgate_core::rules::envoy_config::rules_from_yaml(&text).map_err(|e| one(e.0));
    }
    let doc: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(&text).map_err(|e| one(format!("not JSON: {e}")))?
    } else {
        let t: toml::Value = toml::from_str(&text).map_err(|e| one(format!("not TOML: {e}")))?;
        serde_json::to_value(t).map_err(|e| one(e.to_string()))?
    };
    let Some(obj) = doc.as_object() else {
        return Err(one(
            "a rules file is {\"rules\": [...]} (JSON) or [[rules]] tables (TOML)".into(),
        ));
    };
    if let Some(other) = obj.keys().find(|k| *k != "rules") {
        return Err(one(format!(
            "unknown top-level field {other:?}; the file holds rules only"
        )));
    }
    let mut rules = Vec::new();
    let mut problems = Problems::new();
    for (i, r) in obj
        .get("rules")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let Some(id) = r.get("id").and_then(Value::as_str) else {
            problems.push((format!("#{}", i + 1), "id".into(), "is required".into()));
            continue;
        };
        match rule_from_body(id, r.to_string().as_bytes()) {
            Ok(rule) => rules.push(rule),
            Err(fields) => {
                for (field, why) in fields {
                    problems.push((id.to_string(), field, why));
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(rules)
    } else {
        Err(problems)
    }
}

/// Prints the problems, one line each: `file: rule id: field: why`.
pub fn report(problems: &[(String, Problems)]) {
    for (file, list) in problems {
        for (rule, field, why) in list {
            let mut line = file.clone();
            for part in [rule, field] {
                if !part.is_empty() {
                    line.push_str(": ");
                    line.push_str(part);
                }
            }
            eprintln!("{line}: {why}");
        }
    }
}

/// What `apply` would do to the server's rules.
#[derive(Debug, Default)]
pub struct Plan {
    /// Rules to create (`If-Match: "0"`).
    pub create: Vec<Rule>,
    /// Rules to replace, with the version the server holds and the fields that change.
    pub change: Vec<(Rule, u64, Vec<String>)>,
    /// Rules the server holds and the files do not (deleted with `--prune`), with their version.
    pub extra: Vec<(String, u64)>,
}

/// Compares the files' rules with the server's.
pub fn plan(files: Vec<Rule>, server: Vec<Rule>) -> Plan {
    let held: BTreeMap<String, Rule> = server.into_iter().map(|r| (r.id.clone(), r)).collect();
    let mut plan = Plan::default();
    for rule in &files {
        match held.get(&rule.id) {
            None => plan.create.push(rule.clone()),
            Some(h) => {
                let changed = changed_fields(rule, h);
                if !changed.is_empty() {
                    plan.change.push((rule.clone(), h.version, changed));
                }
            }
        }
    }
    for (id, h) in &held {
        if !files.iter().any(|r| &r.id == id) {
            plan.extra.push((id.clone(), h.version));
        }
    }
    plan
}

/// The fields in which two rules differ (their versions and times aside).
fn changed_fields(a: &Rule, b: &Rule) -> Vec<String> {
    let strip = |r: &Rule| {
        let mut r = r.clone();
        r.version = 0;
        r.updated_at = 0;
        serde_json::to_value(r).unwrap_or_default()
    };
    let (va, vb) = (strip(a), strip(b));
    let (Some(oa), Some(ob)) = (va.as_object(), vb.as_object()) else {
        return vec!["rule".into()];
    };
    let mut keys: Vec<&String> = oa.keys().chain(ob.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| oa.get(*k) != ob.get(*k))
        .map(|k| k.to_string())
        .collect()
}

/// The plan as text, one line per rule: `+ id` created, `~ id (fields)` changed, `- id` deleted with
/// `--prune` (else `? id` only on the server).
pub fn print(plan: &Plan, prune: bool) {
    for r in &plan.create {
        println!("+ {}", r.id);
    }
    for (r, _, fields) in &plan.change {
        println!("~ {} ({})", r.id, fields.join(", "));
    }
    for (id, _) in &plan.extra {
        if prune {
            println!("- {id}");
        } else {
            println!("? {id} (only on the server; --prune deletes it)");
        }
    }
    if plan.create.is_empty() && plan.change.is_empty() && (plan.extra.is_empty() || !prune) {
        println!("no changes");
    }
}

/// The body of a PUT: the rule's fields without its id, version and time.
pub fn body(rule: &Rule) -> anyhow::Result<Vec<u8>> {
    let mut v = serde_json::to_value(rule).context("a rule as JSON")?;
    if let Some(o) = v.as_object_mut() {
        for k in ["id", "version", "updatedAt"] {
            o.remove(k);
        }
    }
    Ok(v.to_string().into_bytes())
}

/// The server's rules from a `GET /v1/rules` body.
pub fn server_rules(body: &[u8]) -> anyhow::Result<Vec<Rule>> {
    let v: Value = serde_json::from_slice(body).context("the rules service's answer is not JSON")?;
    let Some(rules) = v.get("rules") else {
        bail!("the rules service's answer has no rules");
    };
    serde_json::from_value(rules.clone()).context("the rules service answered rules this CLI cannot read")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bad_field_is_named_with_its_rule_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.toml");
        std::fs::write(
            &good,
            "[[rules]]\nid = \"a\"\ndimension = \"user\"\nlimit = 5\nwindowSeconds = 60\n",
        )
        .unwrap();
        let bad = dir.path().join("bad.json");
        std::fs::write(
            &bad,
            r#"{"rules":[{"id":"b","dimension":"planet","limit":0,"windowSeconds":60},{"limit":1}]}"#,
        )
        .unwrap();
        let problems = load(&[good.clone(), bad]).unwrap_err();
        let (file, list) = &problems[0];
        assert!(file.ends_with("bad.json"), "{file}");
        let fields: Vec<(&str, &str)> = list.iter().map(|(r, f, _)| (r.as_str(), f.as_str())).collect();
        assert!(
            fields.contains(&("b", "dimension")) && fields.contains(&("b", "limit")),
            "{fields:?}"
        );
        assert!(fields.contains(&("#2", "id")), "{fields:?}");
        // The same id in two files: the set is refused.
        let again = dir.path().join("again.toml");
        std::fs::copy(&good, &again).unwrap();
        let problems = load(&[good.clone(), again]).unwrap_err();
        assert!(problems[0].1[0].2.contains("twice"), "{problems:?}");
        assert_eq!(load(&[good]).unwrap().len(), 1);
    }

    #[test]
    fn the_plan_writes_only_what_differs() {
        let rule = |id: &str, limit: u64, version: u64| {
            let mut r = rule_from_body(
                id,
                format!(r#"{{"dimension":"user","limit":{limit},"windowSeconds":60}}"#).as_bytes(),
            )
            .unwrap();
            r.version = version;
            r
        };
        let p = plan(
            vec![rule("same", 5, 0), rule("changed", 9, 0), rule("new", 1, 0)],
            vec![rule("same", 5, 3), rule("changed", 8, 4), rule("old", 1, 2)],
        );
        assert_eq!(
            p.create.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["new"]
        );
        assert_eq!(p.change.len(), 1);
        assert_eq!(
            (p.change[0].1, p.change[0].2.clone()),
            (4, vec!["limit".to_string()])
        );
        assert_eq!(p.extra, vec![("old".to_string(), 2)]);
    }
}
