//! Where the agent's rules come from: a rules file, a rules service it follows, or the embedded
//! default (the rules API served by the agent itself over a SQLite file).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use floodgate_core::engine::{Engine, RefusedRules};
use floodgate_core::rules::{self, RuleSet};
use floodgate_core::store::Clock;
use floodgate_core::tasks::{every, stopped};
use floodgate_rules_service::browser::BrowserGuard;
use floodgate_rules_service::service::{self, ServiceState};
use floodgate_rules_service::{http, store::RulesStore};
use tokio::sync::watch;

use crate::config::{Admin, AgentConfig};
use crate::follow;

/// Where the agent's rules come from.
pub(super) enum RulesSource {
    /// A file read at start.
    File(std::path::PathBuf),
    /// A rules service the agent follows.
    Service(follow::FollowConfig),
    /// The embedded default: the agent serves the rules API itself over a SQLite file, on its
    /// listener (bound when the source is opened; none with `--rules-listen off`).
    Embedded(Arc<ServiceState>, Option<tokio::net::TcpListener>),
}

impl RulesSource {
    pub(super) async fn open(config: &AgentConfig) -> anyhow::Result<Self> {
        if let Some(path) = &config.rules {
            return Ok(RulesSource::File(path.clone()));
        }
        if let Some(url) = &config.rules_url {
            let cache = config.rules_cache();
            return Ok(RulesSource::Service(follow::FollowConfig {
                url: url.clone(),
                token: config.rules_token()?,
                poll: Duration::from_millis(config.rules_poll_ms),
                watch: Duration::from_secs(config.rules_watch_s),
                cache: Some(cache),
            }));
        }
        let db = config.rules_db();
        let store = RulesStore::open(&db).await.with_context(|| {
            format!("cannot open the rules store {db}; name a writable file with --rules-db")
        })?;
        let state = ServiceState::new(store, Vec::new()).await?;
        let example: Vec<rules::Rule> = RuleSet::parse(rules::EXAMPLE_RULES)?
            .iter()
            .map(|r| (**r).clone())
            .collect();
        state.seed(&example).await?;
        let listener = match config.rules_listen {
            Admin::At(addr) => {
                anyhow::ensure!(
                    addr.ip().is_loopback(),
                    "the embedded rules API has no token, so it listens on loopback only, not {addr}; run `floodgate rules-server --token …` to serve it further"
                );
                let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
                    format!("cannot serve the rules API on {addr} (another agent on this host? give this one --rules-listen off or another address, and its own --rules-db)")
                })?;
                Some(listener)
            }
            Admin::Off => None,
        };
        Ok(RulesSource::Embedded(state, listener))
    }

    /// The rule set to start with, where it came from (for the log), and the set refused if the
    /// stored one was invalid (the agent still starts, on its valid part).
    pub(super) async fn initial(&self) -> anyhow::Result<(RuleSet, String, Option<RefusedRules>)> {
        let mut refused = None;
        let (set, from) = match self {
            RulesSource::File(path) => (RuleSet::load(path)?, path.display().to_string()),
            RulesSource::Service(f) => match f.cache.as_deref().and_then(follow::load_cache) {
                Some(set) => {
                    let from = format!("the cache of {} (version {})", f.url, set.version());
                    (set, from)
                }
                None => {
                    tracing::warn!(url = %f.url, "no cached rule set: no rule is known until the rules service answers");
                    (RuleSet::default(), format!("{} (not reached yet)", f.url))
                }
            },
            RulesSource::Embedded(state, _) => {
                let (version, rules) = state.store.snapshot().await?;
                let from = format!(
                    "the embedded rules store {} (version {version})",
                    state.store.describe()
                );
                match RuleSet::new(rules.clone()) {
                    Ok(set) => (set.with_version(version), from),
                    // A store written before writes were validated as a set: start on its valid
                    // part (the refusal is shown in /v1/status once the engine exists).
                    Err(e) => {
                        let (set, left_out) = RuleSet::salvage(rules);
                        tracing::error!(version, error = %e, ?left_out, "the stored rule set is invalid; starting on its valid part");
                        refused = Some(RefusedRules {
                            version,
                            error: e.to_string(),
                        });
                        (set.with_version(version), format!("{from}, its valid part"))
                    }
                }
            }
        };
        Ok((set, from, refused))
    }

    /// Starts following the source (service or embedded store); serves the embedded API.
    pub(super) fn start(self, engine: &Arc<Engine>, config: &AgentConfig, shutdown: watch::Receiver<bool>) {
        match self {
            RulesSource::File(_) => {
                // No service to report the dry run to: its tally starts over every 5 s, as a
                // reported one does, so each key's next would-be rejection is news (an event) again.
                let engine = engine.clone();
                tokio::spawn(every(Duration::from_secs(5), shutdown, move || {
                    drop(engine.dry_run().take());
                    std::future::ready(())
                }));
            }
            RulesSource::Service(f) => {
                tracing::info!(url = %f.url, poll_ms = f.poll.as_millis() as u64, watch_s = f.watch.as_secs(), "following the rules service");
                tokio::spawn(follow::follow(engine.clone(), f.clone(), shutdown.clone()));
                tokio::spawn(crate::follow_overrides::follow(
                    engine.clone(),
                    f.clone(),
                    shutdown.clone(),
                ));
                // Log mode's would-be rejections go to the service every 5 s.
                let (engine, f) = (engine.clone(), f.clone());
                tokio::spawn(every(Duration::from_secs(5), shutdown, move || {
                    let (engine, f) = (engine.clone(), f.clone());
                    async move {
                        for (rule, tally) in engine.dry_run().take() {
                            let body = serde_json::to_vec(&tally).unwrap_or_default();
                            let path = format!("/v1/rules/{rule}/dry-run");
                            let sent = http::request(
                                &f.url,
                                "POST",
                                &path,
                                f.token.as_deref(),
                                &[],
                                Some(&body),
                                Duration::from_secs(5),
                            )
                            .await;
                            match sent {
                                Ok(r) if r.status < 300 => {}
                                // The rule is gone or moved on: its report has nowhere to go.
                                Ok(r) if r.status == 404 || r.status == 409 => {}
                                Ok(r) => {
                                    tracing::debug!(
                                        status = r.status,
                                        rule,
                                        "the dry-run report was refused; it goes with the next one"
                                    );
                                    engine.dry_run().give_back(&rule, tally);
                                }
                                Err(e) => {
                                    tracing::debug!(error = %e, rule, "could not report the dry run; it goes with the next one");
                                    engine.dry_run().give_back(&rule, tally);
                                }
                            }
                        }
                    }
                }));
            }
            RulesSource::Embedded(state, listener) => {
                if let Some(listener) = listener {
                    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::info!(addr = %addr, store = %state.store.describe(), max_connections = config.http_max_connections, "rules API listening (embedded, loopback only, no token)");
                    // No token: anyone who reaches loopback may write, so web pages must not.
                    let guard = BrowserGuard {
                        loopback_host: true,
                        json_bodies: true,
                    };
                    let mut app = guard.layer(service::app(state.clone()));
                    if crate::otel::enabled() {
                        app = crate::otel::wrap_router(app);
                    }
                    let (mut stop, closing) = (shutdown.clone(), state.clone());
                    let limits = config.http_limits();
                    tokio::spawn(async move {
                        let stop = async move {
                            stopped(&mut stop).await;
                            closing.close();
                        };
                        floodgate_rules_service::listen::serve(listener, app, None, limits, "rules", stop)
                            .await;
                    });
                }
                // Log mode's would-be rejections go to the embedded service every second.
                let (e, s) = (engine.clone(), state.clone());
                tokio::spawn(every(Duration::from_secs(1), shutdown.clone(), move || {
                    for (rule, tally) in e.dry_run().take() {
                        s.dry_run.add(&rule, tally, Clock::System.now_ms());
                    }
                    std::future::ready(())
                }));
                tokio::spawn(crate::follow_overrides::follow_embedded(
                    engine.clone(),
                    state.clone(),
                    shutdown.clone(),
                ));
                // Follow the embedded store: every write announces its version.
                let (engine, state) = (engine.clone(), state.clone());
                let mut changes = state.subscribe();
                let mut stop = shutdown;
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            changed = changes.changed() => if changed.is_err() { break },
                            _ = stopped(&mut stop) => break,
                        }
                        match state.store.snapshot().await {
                            Ok((version, rules)) => {
                                follow::apply(&engine, follow::Snapshot { version, rules }, None);
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "could not read the rules store; keeping the rule set in force")
                            }
                        }
                    }
                });
            }
        }
    }
}
