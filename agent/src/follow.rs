//! How an agent follows the rules service: a pull with the version it holds (304 when unchanged)
//! every poll interval, and a long-poll watch in between so that a change arrives in well under a
//! second. A new set is validated whole and swapped atomically; a bad answer or an unreachable
//! service leaves the last good set in force, also across a restart (the cache file).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use floodgate_core::engine::{Engine, RefusedRules};
use floodgate_core::rules::{Rule, RuleSet};
use floodgate_rules_service::http;

/// Where and how to follow.
#[derive(Debug, Clone)]
pub struct FollowConfig {
    /// The rules service, `http://host:port`.
    pub url: String,
    /// Bearer token, if the service wants one.
    pub token: Option<String>,
    /// Pull interval (and the retry interval after a failure).
    pub poll: Duration,
    /// How long each watch request may be held by the service (0: no watch, pull only).
    pub watch: Duration,
    /// The last good set, kept across restarts.
    pub cache: Option<PathBuf>,
}

/// The wire shape of `GET /v1/rules` (and of the cache file).
#[derive(Debug, Serialize, Deserialize)]
pub struct Snapshot {
    /// Global version.
    pub version: u64,
    /// Every rule.
    pub rules: Vec<Rule>,
}

/// Loads the cache file, if there is a valid one.
pub fn load_cache(path: &Path) -> Option<RuleSet> {
    let text = std::fs::read_to_string(path).ok()?;
    let snap: Snapshot = serde_json::from_str(&text).ok()?;
    RuleSet::new(snap.rules)
        .ok()
        .map(|s| s.with_version(snap.version))
}

fn save_cache(path: &Path, snap: &Snapshot) {
    let tmp = path.with_extension("tmp");
    let ok = serde_json::to_vec(snap)
        .ok()
        .and_then(|bytes| std::fs::write(&tmp, bytes).ok())
        .and_then(|_| std::fs::rename(&tmp, path).ok());
    if ok.is_none() {
        tracing::warn!(path = %path.display(), "could not write the rules cache file");
    }
}

/// Applies a snapshot if it is valid and another version than the engine holds; returns whether it
/// did. An older version is followed too, with a warning: the service is the truth, and it answers
/// with an older set only when its store went back (restored from a backup, or a new service) or the
/// agent's cache came from elsewhere; refusing it would leave the agent on rules nobody can change.
pub fn apply(engine: &Engine, snap: Snapshot, cache: Option<&Path>) -> bool {
    let held = engine.rules().version();
    if snap.version == held && held != 0 {
        return false;
    }
    if snap.version < held {
        tracing::warn!(
            version = snap.version,
            held,
            "the rules service holds an older version than this agent (store restored or replaced?); following it"
        );
    }
    let count = snap.rules.len();
    match RuleSet::new(snap.rules.clone()) {
        Ok(set) => {
            engine.swap_rules(set.with_version(snap.version));
            if let Some(path) = cache {
                save_cache(path, &snap);
            }
            tracing::info!(version = snap.version, rules = count, "rule set updated");
            true
        }
        Err(e) => {
            let empty = held == 0 && engine.rules().iter().next().is_none();
            if empty {
                // Nothing in force to keep (a first start with no cache): the largest valid part of
                // the set beats no rule at all, under which every check would be refused as unknown.
                let (set, left_out) = RuleSet::salvage(snap.rules);
                tracing::error!(version = snap.version, error = %e, ?left_out, "refused a rule set; no set was in force, so starting on its valid part");
                engine.swap_rules(set.with_version(snap.version));
            } else {
                tracing::error!(version = snap.version, error = %e, held, "refused a rule set; keeping the one in force");
            }
            engine.refuse_rules(RefusedRules {
                version: snap.version,
                error: e.to_string(),
            });
            empty
        }
    }
}

/// Follows the service until `shutdown`.
pub async fn follow(engine: Arc<Engine>, config: FollowConfig, mut shutdown: watch::Receiver<bool>) {
    let mut failures = 0u32;
    loop {
        let held = engine.rules().version();
        let watch_s = config.watch.as_secs();
        let path = if watch_s > 0 {
            format!("/v1/rules?version={held}&watch={watch_s}")
        } else {
            format!("/v1/rules?version={held}")
        };
        let Some(outcome) = pull(&config, &path, &mut shutdown).await else {
            return;
        };
        let wait = match outcome {
            Ok(r) if r.status == 200 => match serde_json::from_slice::<Snapshot>(&r.body) {
                Ok(snap) => {
                    failures = 0;
                    // A set refused (invalid, or the version held) is answered again at once by a
                    // watch: wait a poll interval rather than ask in a tight loop.
                    (!apply(&engine, snap, config.cache.as_deref())).then_some(config.poll)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the rules service sent an unreadable rule set; keeping the one in force");
                    Some(config.poll)
                }
            },
            Ok(r) if r.status == 304 => {
                failures = 0;
                None
            }
            Ok(r) => {
                failures += 1;
                tracing::warn!(status = r.status, body = %String::from_utf8_lossy(&r.body), "the rules service refused the pull; keeping the rule set in force");
                Some(config.poll)
            }
            Err(e) => Some(unreachable(&config, &mut failures, &e, "the rule set")),
        };
        let wait = match (wait, watch_s) {
            (Some(w), _) => w,
            // Without a watch, pull again after the poll interval.
            (None, 0) => config.poll,
            (None, _) => Duration::ZERO,
        };
        if !pause(wait, &mut shutdown).await {
            return;
        }
    }
}

/// One `GET path` from the service, held up to the watch time; none once `shutdown` turns.
pub(crate) async fn pull(
    config: &FollowConfig,
    path: &str,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Result<http::Response, String>> {
    let call = http::request(
        &config.url,
        "GET",
        path,
        config.token.as_deref(),
        &[],
        None,
        config.watch + Duration::from_secs(5),
    );
    tokio::select! {
        r = call => Some(r),
        _ = floodgate_core::tasks::stopped(shutdown) => None,
    }
}

/// Waits `wait` (nothing for zero); false once `shutdown` turns.
pub(crate) async fn pause(wait: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    if wait.is_zero() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(wait) => true,
        _ = floodgate_core::tasks::stopped(shutdown) => false,
    }
}

/// The wait after the service could not be reached (counted in `failures`; warned about the first
/// time and every 30th, keeping `what` in force): soon at first, then the poll interval.
pub(crate) fn unreachable(config: &FollowConfig, failures: &mut u32, error: &str, what: &str) -> Duration {
    *failures += 1;
    if *failures == 1 || (*failures).is_multiple_of(30) {
        tracing::warn!(error = %error, failures = *failures, "rules service unreachable; keeping {what} in force");
    }
    config.poll.min(Duration::from_millis(200) * (*failures).min(50))
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::engine::Store;
    use floodgate_core::store::MemoryStore;

    fn rule(id: &str, limit: u64) -> Rule {
        floodgate_core::rules::fields::rule_from_body(
            id,
            format!(r#"{{"dimension":"user","limit":{limit},"windowSeconds":60}}"#).as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn a_bad_set_leaves_the_last_good_one_in_force_and_an_older_one_is_followed() {
        let engine = Engine::new(
            RuleSet::default(),
            Store::Memory(Arc::new(MemoryStore::default())),
        );
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache.json");
        assert!(apply(
            &engine,
            Snapshot {
                version: 3,
                rules: vec![rule("a", 5)]
            },
            Some(&cache)
        ));
        assert_eq!(engine.rules().version(), 3);
        // Two rules with one id: refused whole; the set in force stays.
        let bad = Snapshot {
            version: 4,
            rules: vec![rule("a", 1), rule("a", 2)],
        };
        assert!(!apply(&engine, bad, Some(&cache)));
        assert_eq!(engine.rules().get("a").unwrap().limit.get(), 5);
        // The same version again is no change.
        assert!(!apply(
            &engine,
            Snapshot {
                version: 3,
                rules: vec![]
            },
            Some(&cache)
        ));
        assert_eq!(engine.rules().len(), 1);
        // The cache holds the last good set.
        let cached = load_cache(&cache).unwrap();
        assert_eq!((cached.version(), cached.get("a").unwrap().limit.get()), (3, 5));
        // A service whose store went back (restored from a backup) is followed: it is the truth.
        assert!(apply(
            &engine,
            Snapshot {
                version: 2,
                rules: vec![rule("b", 9)]
            },
            Some(&cache)
        ));
        assert_eq!((engine.rules().version(), engine.rules().len()), (2, 1));
        assert_eq!(load_cache(&cache).unwrap().version(), 2);
    }
}
