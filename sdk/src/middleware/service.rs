//! The service the Layer wraps around yours: one check per request, the rate-limit headers on the
//! response, a 429 with `Retry-After` and a JSON body on a denial.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};

use super::headers::{rate_limit_headers, retry_after_seconds};
use super::layer::{ChargeFrom, Config};
use super::lease::{LeaseGuard, Released};
use crate::CallOptions;

/// The service the layer wraps around yours.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> RateLimit<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        RateLimit { inner, config }
    }
}

/// Logs at most one warning a minute per `last`, one per kind of warning (a bad request per request
/// must not flood the log).
pub(super) fn warn_rarely(last: &std::sync::atomic::AtomicU64, message: &str, error: &dyn std::fmt::Display) {
    let now = now_ms() / 60_000;
    if last.swap(now, std::sync::atomic::Ordering::Relaxed) != now {
        tracing::warn!(error = %error, "{message}");
    }
}

static CHECK_FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl<S, B, RB> tower_service::Service<Request<B>> for RateLimit<S>
where
    S: tower_service::Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
    RB: From<String> + Send + 'static,
{
    type Response = Response<Released<RB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Released<RB>>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The clone is ready-polled later; the one polled ready now serves this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let (mut attributes, fail, charge) = config.attributes(&parts);
            // A lease for the concurrency rules the request may match (an agent of version 3).
            attributes.lease = config.client.lease_for_requests();
            // Charged after the response, with the request's attributes.
            let charge = charge.map(|h| (h, attributes.clone()));
            let req = Request::from_parts(parts, body);
            // The caller's trace context: the agent's span of this check becomes its child.
            let trace = req
                .headers()
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .and_then(floodgate_protocol::TraceContext::parse);
            let options = CallOptions {
                fail,
                trace,
                ..CallOptions::default()
            };
            // Armed before the check is sent: if the request goes away mid-check, or the answer is
            // not the agent's (a timeout), the agent may still have taken the lease, and it is
            // released (a release of a lease not held changes nothing).
            let pending = attributes.lease.map(|_| LeaseGuard {
                client: config.client.clone(),
                attributes: floodgate_protocol::Attributes {
                    cost: attributes.cost.max(1),
                    ..attributes.clone()
                },
                armed: true,
                sure: false,
                trace,
            });
            let check = floodgate_protocol::Check::Attributes(attributes);
            let decision = match config.client.check_with(check, options).await {
                Ok(d) => d,
                Err(e) => {
                    // Attributes are made wire-safe above, so this is a bug or a mismatch between
                    // SDK and agent, not something a client can cause: the request passes (the
                    // agent-unreachable case is the client's fail policy, decided before here).
                    warn_rarely(
                        &CHECK_FAILED,
                        "floodgate: the check failed; the request passes",
                        &e,
                    );
                    return Ok(inner.call(req).await?.map(Released::plain));
                }
            };
            // Held while the request runs, released when its response ends (or it fails); the agent
            // answered that nothing is held: nothing to release.
            let held = decision.items.iter().any(|i| i.verdict.holds_lease);
            let lease = match pending {
                Some(mut guard) if held => {
                    guard.sure = true;
                    Some(guard)
                }
                Some(mut guard) if decision.from_agent_answer() => {
                    guard.armed = false;
                    None
                }
                other => other,
            };
            let mut headers = rate_limit_headers(&decision, config.ietf, now_ms());
            // Quota mode: let through past a rule's limit; the handler finds which rules in the
            // request's extensions (to route it: a cheaper model, a fallback), the client in the
            // response's `X-RateLimit-Over-Quota`.
            let over = decision.over_quota_rules();
            let mut req = req;
            if decision.allowed && !over.is_empty() {
                if let Ok(v) = HeaderValue::try_from(over.join(",")) {
                    headers.push((http::header::HeaderName::from_static(OVER_QUOTA_HEADER), v));
                }
                req.extensions_mut().insert(OverQuota { rules: over });
            }
            let mut response = if decision.allowed {
                let response = inner.call(req).await?;
                if let Some((from, attributes)) = charge {
                    charge_after(&config.client, &response, &from, attributes, trace);
                }
                response.map(|body| match lease {
                    Some(lease) => Released::holding(body, lease),
                    None => Released::plain(body),
                })
            } else {
                let secs = retry_after_seconds(&decision);
                let mut r = Response::new(Released::plain(RB::from(format!(
                    "{{\"error\":\"rate_limited\",\"retryAfter\":{secs}}}"
                ))));
                *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
                r.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                r
            };
            for (name, value) in headers {
                response.headers_mut().insert(name, value);
            }
            Ok(response)
        })
    }
}

/// The response header naming the rules a request was let through past (quota mode).
pub const OVER_QUOTA_HEADER: &str = "x-ratelimit-over-quota";

/// In a request's extensions when it passed past the limit of rules with `overLimit = "flag"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverQuota {
    /// The rules' ids.
    pub rules: Vec<String>,
}

static CHARGE_FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Charges what the response says the request cost (its header's value, or the route's callback's
/// answer), off the response's path (a task of its own, bounded by the client's timeout). No
/// header, not a positive integer, or no answer: nothing.
fn charge_after<RB>(
    client: &crate::Client,
    response: &Response<RB>,
    from: &ChargeFrom,
    attributes: crate::Attributes,
    trace: Option<floodgate_protocol::TraceContext>,
) {
    let cost = match from {
        ChargeFrom::Header(header) => {
            let Some(value) = response.headers().get(header) else {
                return;
            };
            match value
                .to_str()
                .ok()
                .map(str::trim)
                .and_then(|v| v.parse::<u32>().ok())
            {
                Some(n) => n,
                None => {
                    warn_rarely(
                        &CHARGE_FAILED,
                        "floodgate: a response's cost header is not a whole number of units; nothing charged",
                        &format!("{header}: {value:?}"),
                    );
                    return;
                }
            }
        }
        ChargeFrom::With(f) => match f(response.status(), response.headers()) {
            Some(n) => n,
            None => return,
        },
    };
    if cost == 0 {
        return;
    }
    let check = floodgate_protocol::Check::Attributes(crate::Attributes {
        cost,
        mode: crate::ItemMode::Charge,
        lease: None,
        ..attributes
    });
    let client = client.clone();
    let options = CallOptions {
        trace,
        ..CallOptions::default()
    };
    tokio::spawn(async move {
        match client.check_with(check, options).await {
            Ok(d) if d.from_agent_answer() => {}
            Ok(d) => warn_rarely(
                &CHARGE_FAILED,
                "floodgate: the agent could not take a response's charge; it is not counted",
                &format!("{:?}", d.origin),
            ),
            Err(e) => warn_rarely(
                &CHARGE_FAILED,
                "floodgate: a response's charge failed; it is not counted",
                &e,
            ),
        }
    });
}
