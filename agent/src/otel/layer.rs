//! The rules service's HTTP requests as spans: an axum middleware (`from_fn`) reading the request's
//! `traceparent`, named `<METHOD> <matched route>`.

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use floodgate_protocol::TraceContext;

use super::span::Attr;

/// Records a span for each request when traces are on (else passes it through untouched).
pub async fn http_spans(request: Request, next: Next) -> Response {
    let Some(tracer) = super::tracer() else {
        return next.run(request).await;
    };
    let parent = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse);
    let Some(span) = tracer.start(parent, "http") else {
        return next.run(request).await;
    };
    let method = request.method().as_str().to_string();
    // The route's template (`/v1/rules/{id}`); a path no route matched is not named (it is the
    // client's to choose, and span names must stay few).
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "(unmatched)".to_string(), |m| m.as_str().to_string());
    let response = next.run(request).await;
    let status = response.status().as_u16();
    span.end(
        Some(format!("{method} {route}")),
        vec![
            ("http.request.method", Attr::Str(method)),
            ("http.route", Attr::Str(route)),
            ("http.response.status_code", Attr::Int(i64::from(status))),
        ],
        status >= 500,
    );
    response
}
