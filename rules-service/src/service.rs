//! The rules service's HTTP API: `PUT/GET/DELETE /v1/rules/{id}`, `GET /v1/rules` with a version
//! (304 when unchanged) and an optional long-poll watch, `GET /v1/audit`, bearer-token auth with
//! read and write scopes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::watch;

use floodgate_core::rules::fields::rule_from_body;
use floodgate_core::rules::Rule;
use floodgate_core::tasks::stopped;

use crate::store::{RulesStore, StoreOpError};
use crate::tokens::Token;

/// The longest a watch (long poll) may hold a request, in seconds.
pub const MAX_WATCH_SECONDS: u64 = 55;

/// What the API serves.
pub struct ServiceState {
    /// The durable store.
    pub store: RulesStore,
    /// The tokens and their scopes. Empty: no auth (then the API must listen on loopback).
    tokens: Vec<Token>,
    /// The global version, announced to watchers after every write.
    changed: watch::Sender<u64>,
    /// The overrides version, announced to their watchers after every override write.
    pub(crate) overrides_changed: watch::Sender<u64>,
    /// Turns true when the service stops: held watches answer at once instead of holding shutdown.
    pub(crate) closing: watch::Sender<bool>,
    /// Log mode's would-be rejections, as agents report them.
    pub dry_run: floodgate_core::dryrun::DryRunTotals,
}

impl ServiceState {
    /// A service over `store` with these tokens (none: no auth).
    pub async fn new(store: RulesStore, tokens: Vec<Token>) -> anyhow::Result<Arc<Self>> {
        crate::tokens::check(&tokens)?;
        let version = store.version().await?;
        let overrides = store.overrides_version().await?;
        Ok(Arc::new(ServiceState {
            store,
            tokens,
            changed: watch::channel(version).0,
            overrides_changed: watch::channel(overrides).0,
            closing: watch::channel(false).0,
            dry_run: Default::default(),
        }))
    }

    /// The service is stopping: answers the watches it holds now.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Whether requests must carry a token.
    pub fn authenticated(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Watches the global version (the embedded agent follows the service through this).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Announces a version (after a write here, or one another instance made, seen by polling).
    pub fn announce(&self, version: u64) {
        self.changed.send_if_modified(|v| {
            let newer = version > *v;
            if newer {
                *v = version;
            }
            newer
        });
    }

    /// A watch: while `rx` still says `held`, waits up to `watch_s` seconds for another version (or
    /// for the service to stop).
    pub(crate) async fn wait_past(&self, rx: &mut watch::Receiver<u64>, held: u64, watch_s: u64) {
        if *rx.borrow_and_update() != held {
            return;
        }
        let mut closing = self.closing.subscribe();
        let changed = rx.wait_for(|v| *v != held);
        let stopping = closing.wait_for(|c| *c);
        tokio::select! {
            _ = tokio::time::timeout(Duration::from_secs(watch_s), changed) => {}
            _ = stopping => {}
        }
    }

    /// Watches the overrides version (the embedded agent follows the overrides through this).
    pub fn subscribe_overrides(&self) -> watch::Receiver<u64> {
        self.overrides_changed.subscribe()
    }

    /// Announces an overrides version (after an override write, or one another instance made).
    pub fn announce_overrides(&self, version: u64) {
        self.overrides_changed.send_if_modified(|v| {
            let newer = version > *v;
            if newer {
                *v = version;
            }
            newer
        });
    }

    /// Writes the rules of a file into an empty store (the embedded default's first start). A rule
    /// another process seeded first (two agents starting on one file) counts as seeded.
    pub async fn seed(&self, rules: &[Rule]) -> Result<(), StoreOpError> {
        let (version, existing) = self.store.snapshot().await?;
        if version > 0 || !existing.is_empty() {
            return Ok(());
        }
        for r in rules {
            match self.store.put(r, Some(0), "seed").await {
                Ok((_, v, _)) => self.announce(v),
                Err(StoreOpError::Conflict { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The API's router; tests call it without a socket.
pub fn app(state: Arc<ServiceState>) -> Router {
    Router::new()
        .route("/v1/rules", get(list))
        .route("/v1/rules/{id}", get(get_one).put(put).delete(delete))
        .route("/v1/rules/{id}/dry-run", get(dry_run).post(report_dry_run))
        .route("/v1/audit", get(audit))
        .route("/v1/rules/{id}/overrides", get(crate::overrides::list_for_rule))
        .route(
            "/v1/rules/{id}/overrides/{key}",
            get(crate::overrides::get_one)
                .put(crate::overrides::put)
                .delete(crate::overrides::delete),
        )
        .route("/v1/overrides", get(crate::overrides::changes))
        .route("/v1/overrides/audit", get(crate::overrides::audit))
        .route("/v1/penalties", get(crate::overrides::list_penalties))
        .route(
            "/v1/penalties/{key}",
            get(crate::overrides::get_penalty)
                .put(crate::overrides::put_penalty)
                .delete(crate::overrides::delete_penalty),
        )
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Keeps the announced version in step with the store, for writes made by another instance over the
/// same PostgreSQL database (every second).
pub async fn poll_version(state: Arc<ServiceState>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Ok(v) = state.store.version().await {
                    state.announce(v);
                }
                if let Ok(v) = state.store.overrides_version().await {
                    state.announce_overrides(v);
                }
            }
            _ = stopped(&mut stop) => break,
        }
    }
}

/// The caller, as authenticated.
#[derive(Clone)]
pub(crate) struct Actor(pub(crate) String);

async fn auth(State(state): State<Arc<ServiceState>>, mut req: Request, next: Next) -> Response {
    if !state.authenticated() {
        req.extensions_mut().insert(Actor("local".into()));
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let Some(given) = given else {
        return refused(
            StatusCode::UNAUTHORIZED,
            "a bearer token is required (Authorization: Bearer …)",
        );
    };
    match state
        .tokens
        .iter()
        .find(|t| constant_time_eq(t.secret.as_bytes(), given.as_bytes()))
    {
        Some(t) if !t.scope.allows(req.method(), req.uri().path()) => {
            error(StatusCode::FORBIDDEN, "this token may only read")
        }
        Some(t) => {
            req.extensions_mut().insert(Actor(t.name.clone()));
            next.run(req).await
        }
        None => refused(StatusCode::FORBIDDEN, "this token is not allowed"),
    }
}

/// An answer to a request with no token or an unknown one, which also closes its connection
/// (`Connection: close`): a client that cannot authenticate holds no kept-alive slot of the
/// connection cap, which stays for the agents and operators that can.
fn refused(status: StatusCode, message: &str) -> Response {
    let mut r = error(status, message);
    r.headers_mut()
        .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    r
}

/// Whether two secrets are equal, in a time that does not depend on where they differ (`subtle`:
/// a plain fold the optimiser may turn into an early exit is no such promise). Their lengths are
/// not secret.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(a.ct_eq(b))
}

pub(crate) fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

pub(crate) fn store_error(e: StoreOpError) -> Response {
    match e {
        StoreOpError::Conflict { .. } => error(StatusCode::PRECONDITION_FAILED, &e.to_string()),
        StoreOpError::NotFound(_) => error(StatusCode::NOT_FOUND, &e.to_string()),
        StoreOpError::InvalidSet(_) => error(StatusCode::CONFLICT, &e.to_string()),
        StoreOpError::InvalidOverride(_) => error(StatusCode::BAD_REQUEST, &e.to_string()),
        e => {
            tracing::warn!(error = %e, "rules store failed");
            error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())
        }
    }
}

pub(crate) fn query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub(crate) fn etag(version: u64) -> String {
    format!("\"{version}\"")
}

/// `If-Match: "3"` (or `3`, or `W/"3"`) as a version; `Err(())` for anything else.
pub(crate) fn if_match(headers: &HeaderMap) -> Result<Option<u64>, ()> {
    let Some(v) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .map(|s| s.trim().trim_start_matches("W/").trim_matches('"'))
        .and_then(|s| s.parse().ok())
        .map(Some)
        .ok_or(())
}

pub(crate) fn bad_if_match() -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "If-Match must be a rule version, e.g. \"3\"",
    )
}

/// `GET /v1/rules[?version=N[&watch=S]]`: every rule and the global version; 304 when the caller
/// already holds `version`, after waiting up to S seconds for a change when asked to watch.
async fn list(State(state): State<Arc<ServiceState>>, uri: Uri) -> Response {
    let q = query(&uri);
    let held: Option<u64> = q.get("version").and_then(|v| v.parse().ok());
    let watch_s: u64 = q
        .get("watch")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
        .min(MAX_WATCH_SECONDS);
    if let (Some(held), true) = (held, watch_s > 0) {
        let mut rx = state.subscribe();
        if *rx.borrow() < held {
            // The caller holds a version this instance has not announced yet (another instance over
            // the same database wrote it): ask the store, the truth, rather than answer 304 at once
            // and be asked again in a loop until the next version poll.
            if let Ok(v) = state.store.version().await {
                state.announce(v);
            }
        }
        state.wait_past(&mut rx, held, watch_s).await;
    }
    match state.store.snapshot().await {
        Ok((version, _)) if held == Some(version) => {
            (StatusCode::NOT_MODIFIED, [(header::ETAG, etag(version))]).into_response()
        }
        Ok((version, rules)) => (
            [(header::ETAG, etag(version))],
            Json(json!({ "version": version, "rules": rules })),
        )
            .into_response(),
        Err(e) => store_error(e),
    }
}

async fn get_one(State(state): State<Arc<ServiceState>>, Path(id): Path<String>) -> Response {
    match state.store.get(&id).await {
        Ok(Some(rule)) => ([(header::ETAG, etag(rule.version))], Json(rule)).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, &format!("no rule {id}")),
        Err(e) => store_error(e),
    }
}

async fn put(
    State(state): State<Arc<ServiceState>>,
    Path(id): Path<String>,
    axum::Extension(actor): axum::Extension<Actor>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(expected) = if_match(&headers) else {
        return bad_if_match();
    };
    let rule = match rule_from_body(&id, &body) {
        Ok(r) => r,
        Err(fields) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": "invalid rule", "fields": fields })),
            )
                .into_response()
        }
    };
    // A rule valid alone can still break the set (two rules answering one Envoy descriptor): the
    // store validates the whole set inside the write's transaction and refuses it (409).
    match state.store.put(&rule, expected, &actor.0).await {
        Ok((stored, version, created)) => {
            state.announce(version);
            tracing::info!(rule = %stored.id, rule_version = stored.version, version, actor = %actor.0, "rule written");
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            (status, [(header::ETAG, etag(stored.version))], Json(stored)).into_response()
        }
        Err(e) => store_error(e),
    }
}

async fn delete(
    State(state): State<Arc<ServiceState>>,
    Path(id): Path<String>,
    axum::Extension(actor): axum::Extension<Actor>,
    headers: HeaderMap,
) -> Response {
    let Ok(expected) = if_match(&headers) else {
        return bad_if_match();
    };
    match state.store.delete(&id, expected, &actor.0).await {
        Ok(version) => {
            state.announce(version);
            tracing::info!(rule = %id, version, actor = %actor.0, "rule deleted");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => store_error(e),
    }
}

/// `GET /v1/rules/{id}/dry-run`: what the rule would have rejected since its current version (every
/// agent's reports added up): the count and the top keys.
async fn dry_run(State(state): State<Arc<ServiceState>>, Path(id): Path<String>) -> Response {
    let rule = match state.store.get(&id).await {
        Ok(Some(r)) => r,
        Ok(None) => return error(StatusCode::NOT_FOUND, &format!("no rule {id}")),
        Err(e) => return store_error(e),
    };
    let tally = state
        .dry_run
        .get(&id)
        .map(|(t, _)| t)
        .filter(|t| t.version == rule.version)
        .unwrap_or_else(|| floodgate_core::dryrun::Tally {
            version: rule.version,
            ..Default::default()
        });
    // Counted since the rule's current version was written (e.g. put in log mode).
    let since = rule.updated_at;
    let top: Vec<_> = tally
        .top_keys
        .iter()
        .map(|(k, n)| json!({ "key": k, "count": n }))
        .collect();
    Json(json!({
        "ruleId": id,
        "version": rule.version,
        "mode": rule.mode,
        "since": since,
        "wouldReject": tally.count,
        "topKeys": top,
    }))
    .into_response()
}

/// `POST /v1/rules/{id}/dry-run`: an agent's would-be rejections since its last report. A report for
/// a rule the store does not hold (any more) is refused with 404, one for a version it never had
/// with 409: the service keeps totals only for rules that exist.
async fn report_dry_run(
    State(state): State<Arc<ServiceState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let mut t = match serde_json::from_slice::<floodgate_core::dryrun::Tally>(&body) {
        Ok(t) => t,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("expected {{version, count, topKeys}}: {e}"),
            )
        }
    };
    match state.store.get(&id).await {
        Ok(Some(rule)) if t.version <= rule.version => {
            t.top_keys.truncate(floodgate_core::dryrun::KEYS_CAP);
            state
                .dry_run
                .add(&id, t, floodgate_core::store::Clock::System.now_ms());
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Some(rule)) => error(
            StatusCode::CONFLICT,
            &format!("rule {id} is at version {}, not {}", rule.version, t.version),
        ),
        Ok(None) => error(StatusCode::NOT_FOUND, &format!("no rule {id}")),
        Err(e) => store_error(e),
    }
}

async fn audit(State(state): State<Arc<ServiceState>>, uri: Uri) -> Response {
    let limit = query(&uri)
        .get("limit")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100u32)
        .min(10_000);
    match state.store.audit(limit).await {
        Ok(entries) => Json(json!({ "audit": entries })).into_response(),
        Err(e) => store_error(e),
    }
}
