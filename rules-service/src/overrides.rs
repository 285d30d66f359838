//! The overrides API: a client key's own limit under one rule.
//!
//! - `PUT /v1/rules/{id}/overrides/{clientKey}`: `{limit, windowSeconds?, burst?, expiresAt?,
//!   reason}`, checked against the rule; `If-Match` as for rules; 201 new, 200 replaced.
//! - `GET` / `DELETE` of the same path.
//! - `GET /v1/rules/{id}/overrides?after=KEY&limit=N`: a page in client-key order, and the key to
//!   ask after for the next (`next`, absent on the last page).
//! - `GET /v1/overrides?since=V[&watch=S][&limit=N]`: what agents follow: the changes after overrides
//!   version V (an override written, or `set: null` deleted), oldest first, `more` when the page is
//!   full; with `watch`, held up to S seconds until there is one.
//! - `GET /v1/overrides/audit?limit=N`: who changed which override (or penalty) when, newest first.
//! - `PUT /v1/penalties/{clientKey}`: `{factor, until, reason}` or `{block: true, until, reason}`: the
//!   key's limits scaled, or every check refused, until `until` (Unix ms, within 90 days); `GET`,
//!   `DELETE` (lifted early); `GET /v1/penalties?after=KEY&limit=N`: those not ended. Agents follow
//!   them with the overrides' changes (rule `*`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use floodgate_core::overrides::{Override, Penalty};

use crate::service::{
    bad_if_match, error, etag, if_match, query, store_error, Actor, ServiceState, MAX_WATCH_SECONDS,
};

/// Most changes one `GET /v1/overrides` answers (an agent starting against a million overrides
/// takes them in pages).
pub const MAX_PAGE: u32 = 10_000;

/// Whether a client key may be one: what a check's key may be (1 to 256 bytes, no brace, no
/// control character).
fn valid_key(key: &str) -> Result<(), Box<Response>> {
    let ok =
        !key.is_empty() && key.len() <= 256 && !key.chars().any(|c| c == '{' || c == '}' || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "a client key is 1 to 256 bytes, without braces or control characters (as checks send it)",
        )))
    }
}

fn page_limit(uri: &Uri, default: u32) -> u32 {
    query(uri)
        .get("limit")
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        .clamp(1, MAX_PAGE)
}

pub(crate) async fn put(
    State(state): State<Arc<ServiceState>>,
    Path((id, key)): Path<(String, String)>,
    axum::Extension(actor): axum::Extension<Actor>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(expected) = if_match(&headers) else {
        return bad_if_match();
    };
    if let Err(r) = valid_key(&key) {
        return *r;
    }
    let value: Override = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("an override is {{limit, windowSeconds?, burst?, expiresAt?, reason}}: {e}"),
            )
        }
    };
    match state
        .store
        .put_override(&id, &key, &value, expected, &actor.0)
        .await
    {
        Ok((stored, created)) => {
            state.announce_overrides(stored.version);
            tracing::info!(rule = %id, key = %key, limit = stored.limit, version = stored.version, actor = %actor.0, reason = %stored.reason, "override written");
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

pub(crate) async fn get_one(
    State(state): State<Arc<ServiceState>>,
    Path((id, key)): Path<(String, String)>,
) -> Response {
    match state.store.get_override(&id, &key).await {
        Ok(Some(o)) => ([(header::ETAG, etag(o.version))], Json(o)).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            &format!("no override of {key} in rule {id}"),
        ),
        Err(e) => store_error(e),
    }
}

pub(crate) async fn delete(
    State(state): State<Arc<ServiceState>>,
    Path((id, key)): Path<(String, String)>,
    axum::Extension(actor): axum::Extension<Actor>,
    headers: HeaderMap,
) -> Response {
    let Ok(expected) = if_match(&headers) else {
        return bad_if_match();
    };
    match state.store.delete_override(&id, &key, expected, &actor.0).await {
        Ok(version) => {
            state.announce_overrides(version);
            tracing::info!(rule = %id, key = %key, version, actor = %actor.0, "override deleted");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => store_error(e),
    }
}

pub(crate) async fn list_for_rule(
    State(state): State<Arc<ServiceState>>,
    Path(id): Path<String>,
    uri: Uri,
) -> Response {
    let q = query(&uri);
    let after = q.get("after").map(|a| percent_decode(a)).unwrap_or_default();
    let limit = page_limit(&uri, 100);
    match state.store.list_overrides(&id, &after, limit).await {
        Ok(page) => {
            let (items, next) = page_of(page, limit);
            Json(json!({ "ruleId": id, "overrides": items, "next": next })).into_response()
        }
        Err(e) => store_error(e),
    }
}

pub(crate) async fn put_penalty(
    State(state): State<Arc<ServiceState>>,
    Path(key): Path<String>,
    axum::Extension(actor): axum::Extension<Actor>,
    body: Bytes,
) -> Response {
    if let Err(r) = valid_key(&key) {
        return *r;
    }
    let value: Penalty = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("a penalty is {{factor, until, reason}} or {{block: true, until, reason}}: {e}"),
            )
        }
    };
    match state.store.put_penalty(&key, &value, &actor.0).await {
        Ok((stored, created)) => {
            state.announce_overrides(stored.version);
            tracing::warn!(key = %key, factor = ?stored.factor, block = stored.block, until = stored.until, actor = %actor.0, reason = %stored.reason, "penalty set");
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

pub(crate) async fn get_penalty(State(state): State<Arc<ServiceState>>, Path(key): Path<String>) -> Response {
    match state.store.get_penalty(&key).await {
        Ok(Some(p)) => ([(header::ETAG, etag(p.version))], Json(p)).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, &format!("no penalty of {key}")),
        Err(e) => store_error(e),
    }
}

pub(crate) async fn delete_penalty(
    State(state): State<Arc<ServiceState>>,
    Path(key): Path<String>,
    axum::Extension(actor): axum::Extension<Actor>,
) -> Response {
    match state.store.delete_penalty(&key, &actor.0).await {
        Ok(version) => {
            state.announce_overrides(version);
            tracing::info!(key = %key, version, actor = %actor.0, "penalty lifted");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => store_error(e),
    }
}

pub(crate) async fn list_penalties(State(state): State<Arc<ServiceState>>, uri: Uri) -> Response {
    let q = query(&uri);
    let after = q.get("after").map(|a| percent_decode(a)).unwrap_or_default();
    let limit = page_limit(&uri, 100);
    let now = floodgate_core::store::Clock::System.now_ms();
    match state.store.list_penalties(&after, limit, now).await {
        Ok(page) => {
            let (items, next) = page_of(page, limit);
            Json(json!({ "penalties": items, "next": next })).into_response()
        }
        Err(e) => store_error(e),
    }
}

/// A page's entries as JSON, each with its `clientKey`, and the key to ask after for the next page
/// (none when this one was not full).
fn page_of<T: serde::Serialize>(
    page: Vec<(String, T)>,
    limit: u32,
) -> (Vec<serde_json::Value>, Option<String>) {
    let next = (page.len() == limit as usize)
        .then(|| page.last().map(|(k, _)| k.clone()))
        .flatten();
    let items = page
        .into_iter()
        .map(|(k, o)| {
            let mut v = serde_json::to_value(o).unwrap_or_default();
            v["clientKey"] = json!(k);
            v
        })
        .collect();
    (items, next)
}

/// `GET /v1/overrides?since=V[&watch=S][&limit=N]`.
pub(crate) async fn changes(State(state): State<Arc<ServiceState>>, uri: Uri) -> Response {
    let q = query(&uri);
    let since: u64 = q.get("since").and_then(|v| v.parse().ok()).unwrap_or(0);
    let watch_s: u64 = q
        .get("watch")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
        .min(MAX_WATCH_SECONDS);
    let limit = page_limit(&uri, MAX_PAGE);
    if watch_s > 0 {
        let mut rx = state.overrides_changed.subscribe();
        if *rx.borrow() < since {
            if let Ok(v) = state.store.overrides_version().await {
                state.announce_overrides(v);
            }
        }
        state.wait_past(&mut rx, since, watch_s).await;
    }
    match state.store.override_changes(since, limit).await {
        Ok((changes, current)) => {
            let more = changes.len() == limit as usize;
            // A full page: the agent holds the last change's version and asks again at once.
            let version = match (more, changes.last()) {
                (true, Some(c)) => c.version,
                _ => current,
            };
            Json(json!({ "version": version, "changes": changes, "more": more })).into_response()
        }
        Err(e) => store_error(e),
    }
}

pub(crate) async fn audit(State(state): State<Arc<ServiceState>>, uri: Uri) -> Response {
    match state.store.override_audit(page_limit(&uri, 100)).await {
        Ok(entries) => Json(json!({ "audit": entries })).into_response(),
        Err(e) => store_error(e),
    }
}

/// A query value's `%XX` escapes and `+` decoded (a client key may hold `/` and `:`); an escape that
/// is not one, and bytes that are not UTF-8, are kept as they are.
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(&s.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_decoded_without_panicking() {
        assert_eq!(
            percent_decode("apikey%3Aabc%3Aendpoint%3A%2Fsearch"),
            "apikey:abc:endpoint:/search"
        );
        assert_eq!(percent_decode("a+b%2"), "a b%2");
        assert_eq!(percent_decode("%zzé%"), "%zzé%");
    }
}
