//! How an agent follows the per-client overrides: the changes after the overrides version it holds
//! (`GET /v1/overrides?since=V`), a page at a time, in a long poll between changes, so that an
//! override reaches every agent in well under a second and a million of them are sent once, then
//! only as they change. The embedded default reads its own store the same way.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;

use floodgate_core::engine::Engine;
use floodgate_core::overrides::OverrideChange;
use floodgate_rules_service::service::ServiceState;

use crate::follow::{pause, pull, unreachable, FollowConfig};

/// The wire shape of `GET /v1/overrides`.
#[derive(Debug, Deserialize)]
pub struct Changes {
    /// The overrides version the agent holds once these are applied.
    pub version: u64,
    /// The changes, oldest first.
    pub changes: Vec<OverrideChange>,
    /// A full page: more follow at once.
    #[serde(default)]
    pub more: bool,
}

/// Applies a page of changes; a service behind the version the agent holds (its store replaced)
/// sends everything again from 0. Returns whether to ask again at once.
pub fn apply(engine: &Engine, page: Changes) -> bool {
    let o = engine.overrides();
    if page.version < o.version() {
        tracing::warn!(
            version = page.version,
            held = o.version(),
            "the rules service holds older overrides than this agent (store restored or replaced?); taking them all again"
        );
        o.clear();
        return true;
    }
    let n = page.changes.len();
    if n > 0 {
        o.apply(page.changes, page.version);
        tracing::debug!(
            changes = n,
            version = page.version,
            held = o.len(),
            "overrides updated"
        );
    }
    page.more
}

/// Follows the service's overrides until `shutdown`.
pub async fn follow(engine: Arc<Engine>, config: FollowConfig, mut shutdown: watch::Receiver<bool>) {
    let mut failures = 0u32;
    loop {
        let held = engine.overrides().version();
        let watch_s = config.watch.as_secs();
        let path = format!("/v1/overrides?since={held}&watch={watch_s}");
        let Some(outcome) = pull(&config, &path, &mut shutdown).await else {
            return;
        };
        let wait = match outcome {
            Ok(r) if r.status == 200 => match serde_json::from_slice::<Changes>(&r.body) {
                Ok(page) => {
                    failures = 0;
                    let again = apply(&engine, page);
                    // Without a watch, ask again after the poll interval unless a page follows.
                    if again || watch_s > 0 {
                        Duration::ZERO
                    } else {
                        config.poll
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the rules service sent unreadable overrides; keeping those in force");
                    config.poll
                }
            },
            // An older service without overrides: nothing to follow, asked again now and then.
            Ok(r) if r.status == 404 => config.poll.max(Duration::from_secs(30)),
            Ok(r) => {
                failures += 1;
                tracing::warn!(
                    status = r.status,
                    "the rules service refused the overrides pull; keeping those in force"
                );
                config.poll
            }
            Err(e) => unreachable(&config, &mut failures, &e, "the overrides"),
        };
        if !pause(wait, &mut shutdown).await {
            return;
        }
    }
}

/// Follows the embedded store's overrides: every override write announces its version.
pub async fn follow_embedded(
    engine: Arc<Engine>,
    state: Arc<ServiceState>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut changes = state.subscribe_overrides();
    loop {
        // Everything after what the agent holds, page by page.
        loop {
            let held = engine.overrides().version();
            match state
                .store
                .override_changes(held, floodgate_rules_service::overrides::MAX_PAGE)
                .await
            {
                Ok((changes, current)) => {
                    let more = changes.len() == floodgate_rules_service::overrides::MAX_PAGE as usize;
                    let version = if more {
                        changes.last().map_or(current, |c| c.version)
                    } else {
                        current
                    };
                    if !apply(
                        &engine,
                        Changes {
                            version,
                            changes,
                            more,
                        },
                    ) {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the overrides; keeping those in force");
                    break;
                }
            }
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = floodgate_core::tasks::stopped(&mut shutdown) => return,
        }
    }
}
