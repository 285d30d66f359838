//! The commands that take rules files: `validate` (offline), `diff` and `apply` (rules as code,
//! through `code`), and `import-envoy` (a domain's rules made what its envoyproxy/ratelimit files
//! say).

use std::collections::HashSet;
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::Value;

use floodgate_core::rules::Rule;

use super::api::{if_match, Api};
use super::code;

/// `validate`: the files checked as the rules API would; an error if any is refused.
pub fn validate(files: &[PathBuf]) -> anyhow::Result<()> {
    match code::load(files) {
        Ok(rules) => {
            println!("{} rules valid", rules.len());
            Ok(())
        }
        Err(problems) => {
            code::report(&problems);
            bail!("rules refused")
        }
    }
}

/// `diff` (`apply` false: the plan printed, exit 2 with `exit_code` if it changes anything) and
/// `apply` (the plan printed, then written).
pub async fn diff_or_apply(
    api: &Api<'_>,
    files: &[PathBuf],
    prune: bool,
    apply: bool,
    exit_code: bool,
) -> anyhow::Result<()> {
    let rules = code::load(files).map_err(|p| {
        code::report(&p);
        anyhow::anyhow!("rules refused")
    })?;
    let held = server_rules(api).await?;
    let plan = code::plan(rules, code::server_rules(&held)?);
    code::print(&plan, prune);
    let changes = plan.create.len() + plan.change.len() + if prune { plan.extra.len() } else { 0 };
    if !apply {
        if exit_code && changes > 0 {
            std::process::exit(2);
        }
        return Ok(());
    }
    write_plan(api, &plan, prune).await?;
    println!("{changes} changes applied");
    Ok(())
}

/// The plan's creations and changes, each conditional on the version the plan saw, then with
/// `prune` its deletions; the first refusal stops it.
async fn write_plan(api: &Api<'_>, plan: &code::Plan, prune: bool) -> anyhow::Result<()> {
    let writes = plan
        .create
        .iter()
        .map(|r| (r, 0))
        .chain(plan.change.iter().map(|(r, v, _)| (r, *v)));
    for (rule, version) in writes {
        let body = code::body(rule)?;
        let path = format!("/v1/rules/{}", rule.id);
        let r = api
            .call("PUT", &path, &if_match(Some(version)), Some(&body))
            .await?;
        if !(200..300).contains(&r.status) {
            bail!(
                "{} writing rule {}: {}",
                r.status,
                rule.id,
                String::from_utf8_lossy(&r.body)
            );
        }
    }
    if prune {
        for (id, version) in &plan.extra {
            let path = format!("/v1/rules/{id}");
            let r = api.call("DELETE", &path, &if_match(Some(*version)), None).await?;
            if !(200..300).contains(&r.status) {
                bail!(
                    "{} deleting rule {id}: {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                );
            }
        }
    }
    Ok(())
}

/// The body of `GET /v1/rules`; an error unless it answered 200.
async fn server_rules(api: &Api<'_>) -> anyhow::Result<Vec<u8>> {
    let r = api.call("GET", "/v1/rules", &[], None).await?;
    if r.status != 200 {
        bail!(
            "{} from GET /v1/rules: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    Ok(r.body)
}

/// `import-envoy`: the files' rules printed (`dry_run`), or written, with the service's rules of
/// their domains that the files no longer have deleted.
pub async fn import_envoy(
    api: &Api<'_>,
    files: &[PathBuf],
    dry_run: bool,
    json_out: bool,
) -> anyhow::Result<()> {
    let rules = envoy_rules(files)?;
    if dry_run {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "rules": rules }))?
        );
        return Ok(());
    }
    // The import makes each domain what the files say: a rule the service holds for one of
    // their domains and the files no longer have is deleted (first, so that a descriptor that
    // moved to another id does not meet its old rule); a rule id the files want that the
    // service holds for something else than Envoy is not overwritten.
    let body = server_rules(api).await?;
    let held: Vec<Rule> = serde_json::from_value(serde_json::from_slice::<Value>(&body)?["rules"].clone())
        .context("the rules service answered rules this CLI cannot read")?;
    for h in &held {
        if h.envoy.is_none() && rules.iter().any(|r| r.id == h.id) {
            bail!("rule {} exists and is not an Envoy rule; refusing to overwrite it (name the descriptor with rate_limit.name)", h.id);
        }
    }
    let deleted = delete_stale(api, &held, &rules, json_out).await?;
    write_envoy_rules(api, &rules, json_out).await?;
    if json_out {
        println!(
            "{}",
            serde_json::json!({ "written": rules.len(), "deleted": deleted })
        );
    } else {
        println!("{} rules imported, {deleted} deleted", rules.len());
    }
    Ok(())
}

/// Deletes the held rules of the files' domains that the files no longer have; how many.
async fn delete_stale(api: &Api<'_>, held: &[Rule], rules: &[Rule], json_out: bool) -> anyhow::Result<usize> {
    let domains: HashSet<&str> = rules
        .iter()
        .filter_map(|r| r.envoy.as_ref())
        .map(|e| e.domain.as_str())
        .collect();
    let mut deleted = 0;
    for h in held {
        let stale = h
            .envoy
            .as_ref()
            .is_some_and(|e| domains.contains(e.domain.as_str()))
            && !rules.iter().any(|r| r.id == h.id);
        if !stale {
            continue;
        }
        let r = api
            .call("DELETE", &format!("/v1/rules/{}", h.id), &[], None)
            .await?;
        if !(200..300).contains(&r.status) && r.status != 404 {
            bail!(
                "{} deleting stale rule {}: {}",
                r.status,
                h.id,
                String::from_utf8_lossy(&r.body)
            );
        }
        deleted += 1;
        if !json_out {
            println!("rule {} deleted (no longer in the files)", h.id);
        }
    }
    Ok(deleted)
}

/// PUTs every rule of the files, unconditionally; the first refusal stops it.
async fn write_envoy_rules(api: &Api<'_>, rules: &[Rule], json_out: bool) -> anyhow::Result<()> {
    for rule in rules {
        let mut body = serde_json::to_value(rule)?;
        if let Some(o) = body.as_object_mut() {
            o.remove("id");
        }
        let body = body.to_string().into_bytes();
        let r = api
            .call("PUT", &format!("/v1/rules/{}", rule.id), &[], Some(&body))
            .await?;
        if !(200..300).contains(&r.status) {
            bail!(
                "{} refused rule {} ({}): {}",
                r.status,
                rule.id,
                rule.envoy.as_ref().map(|e| e.path()).unwrap_or_default(),
                String::from_utf8_lossy(&r.body)
            );
        }
        if !json_out {
            let path = rule.envoy.as_ref().map(|e| e.path()).unwrap_or_default();
            println!("rule {} written for descriptor {path}", rule.id);
        }
    }
    Ok(())
}

/// Every file's rules, checked together as one set (so two files cannot give one id twice).
fn envoy_rules(files: &[PathBuf]) -> anyhow::Result<Vec<Rule>> {
    if files.is_empty() {
        bail!("name at least one envoyproxy/ratelimit YAML file");
    }
    let mut rules = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?;
        rules.extend(
            floodgate_core::rules::envoy_config::rules_from_yaml(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?,
        );
    }
    floodgate_core::rules::RuleSet::new(rules.clone())?;
    Ok(rules)
}
