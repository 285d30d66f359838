//! A tower [`Layer`](tower_layer::Layer) that asks the agent once per request and answers for the
//! limiter: `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (epoch seconds) on
//! every response a rule applied to, and on a rejection a 429 with `Retry-After` (whole seconds,
//! rounded up, at least 1) and the body `{"error":"rate_limited","retryAfter":N}`. Optionally the
//! IETF draft's `RateLimit-Policy` and `RateLimit` headers too.
//!
//! What the request is checked as comes from extractors, each replaceable: the endpoint (axum's
//! matched route with the `axum` feature, its `{id}` written `:id`, else the path) and the client IP
//! by default; the tier, the user id and the API key only when configured (`*_header` reads a header
//! an authenticating hop set; the closures can read what your auth layer put in the extensions) —
//! a header the client writes itself would let it pick its tier or spend someone else's quota. The
//! client IP, the user id and the API key
//! is the peer address, or the `X-Forwarded-For` entry a configured proxy added — the header is
//! believed only as far as it was written by trusted proxies. The cost is 1 unless a route says
//! otherwise. A value the wire refuses (over 256 bytes, braces, control characters) is replaced by a
//! stable hash of it, so no header can make a check invalid and slip past the limiter.
//!
//! Rules in log mode never block (the agent never rejects for them) and never show in the headers:
//! a dry run is invisible to clients. A request no rule applies to gets no headers. When the agent
//! cannot answer, the route's own policy decides if [`RateLimitLayer::fail_for`] set one; else a
//! request a fail-closed rule applies to gets a 429 (the client learned those rules from the agent);
//! else the client's fail policy (open by default: the request passes without headers; closed: 429).
//!
//! ```no_run
//! # async fn demo() {
//! use floodgate_sdk::middleware::RateLimitLayer;
//! use floodgate_sdk::Client;
//!
//! let client = Client::connect_default().await;
//! let layer = RateLimitLayer::new(client)
//!     .user_header("x-authenticated-user")
//!     .cost("/search", 5)
//!     .fail_for("/health", floodgate_sdk::FailPolicy::Open)
//!     .trust_proxies(["10.0.0.0/8"])
//!     .unwrap()
//!     .ietf_headers(true);
//! let app: axum::Router = axum::Router::new()
//!     .route("/search", axum::routing::get(|| async { "results" }))
//!     .layer(layer);
//! # }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::request::Parts;
use http::{Request, Response, StatusCode};

use crate::{Attributes, CallOptions, Client, Decision, FailPolicy};

/// Reads one attribute off a request.
pub type Extractor = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// The peer's address, for servers that are not axum: insert it into the request's extensions
/// (axum's `ConnectInfo<SocketAddr>` is read too, with the `axum` feature).
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// An address block, `10.0.0.0/8` or a single address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `addr/prefix` or `addr`.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (a, p) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or CIDR block"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if p.is_empty() {
            max
        } else {
            p.trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix must be 0..={max}"))?
        };
        // An IPv4-mapped block is the IPv4 block (addresses are compared mapped-to-IPv4 too).
        if let IpAddr::V6(v6) = addr {
            if let (Some(v4), true) = (v6.to_ipv4_mapped(), prefix >= 96) {
                return Ok(Cidr {
                    addr: IpAddr::V4(v4),
                    prefix: prefix - 96,
                });
            }
        }
        Ok(Cidr { addr, prefix })
    }

    /// Whether `ip` is in the block (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

struct Config {
    client: Client,
    endpoint: Extractor,
    tier: Option<Extractor>,
    user: Option<Extractor>,
    api_key: Option<Extractor>,
    ip: Option<Extractor>,
    trusted: Vec<Cidr>,
    costs: HashMap<String, u32>,
    fails: HashMap<String, FailPolicy>,
    ietf: bool,
}

/// The Layer; cheap to clone.
#[derive(Clone)]
pub struct RateLimitLayer {
    config: Arc<Config>,
}

fn header_extractor(name: &'static str) -> Extractor {
    Arc::new(move |p: &Parts| {
        p.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    })
}

fn default_endpoint(p: &Parts) -> Option<String> {
    #[cfg(feature = "axum")]
    if let Some(m) = p.extensions.get::<axum::extract::MatchedPath>() {
        return Some(route_name(m.as_str()));
    }
    Some(p.uri.path().to_string())
}

/// A route as the agent may see it: axum's `{param}` and `{*rest}` become `:param` and `*rest`
/// (braces are refused on the wire, since Redis reads them as hash tags). Rules and
/// [`RateLimitLayer::cost`] name routes either way.
pub fn route_name(route: &str) -> String {
    route
        .split('/')
        .map(
            |seg| match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(inner) if inner.starts_with('*') => inner.to_string(),
                Some(inner) => format!(":{inner}"),
                None => seg.to_string(),
            },
        )
        .collect::<Vec<_>>()
        .join("/")
}

fn peer(p: &Parts) -> Option<IpAddr> {
    if let Some(PeerAddr(a)) = p.extensions.get::<PeerAddr>() {
        return Some(a.ip());
    }
    #[cfg(feature = "axum")]
    if let Some(c) = p.extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(c.0.ip());
    }
    None
}

/// The client's address: the peer, unless the peer is a trusted proxy; then `X-Forwarded-For` read
/// from the right, skipping trusted proxies, up to the first address they did not vouch for. A
/// client can write anything at the left of the header; only what trusted proxies appended counts.
pub fn client_ip(p: &Parts, trusted: &[Cidr]) -> Option<IpAddr> {
    let peer = peer(p)?;
    if !trusted.iter().any(|c| c.contains(peer)) {
        return Some(peer);
    }
    let mut client = peer;
    let hops = p
        .headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for hop in hops.into_iter().rev() {
        let Ok(ip) = hop.parse::<IpAddr>() else {
            // Garbage where an address should be: stop at the last address we could vouch for.
            break;
        };
        client = ip;
        if !trusted.iter().any(|c| c.contains(ip)) {
            break;
        }
    }
    Some(client)
}

impl RateLimitLayer {
    /// A layer asking the agent through `client`, with the default extractors: the endpoint (matched
    /// route or path) and the peer IP (no proxy trusted); no tier, user or API key until configured;
    /// cost 1.
    pub fn new(client: Client) -> Self {
        RateLimitLayer {
            config: Arc::new(Config {
                client,
                endpoint: Arc::new(default_endpoint),
                tier: None,
                user: None,
                api_key: None,
                ip: None,
                trusted: Vec::new(),
                costs: HashMap::new(),
                fails: HashMap::new(),
                ietf: false,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        match Arc::get_mut(&mut self.config) {
            Some(c) => f(c),
            None => {
                let c = &*self.config;
                let mut copy = Config {
                    client: c.client.clone(),
                    endpoint: c.endpoint.clone(),
                    tier: c.tier.clone(),
                    user: c.user.clone(),
                    api_key: c.api_key.clone(),
                    ip: c.ip.clone(),
                    trusted: c.trusted.clone(),
                    costs: c.costs.clone(),
                    fails: c.fails.clone(),
                    ietf: c.ietf,
                };
                f(&mut copy);
                self.config = Arc::new(copy);
            }
        }
        self
    }

    /// Replaces the endpoint extractor.
    pub fn endpoint(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.endpoint = Arc::new(f))
    }

    /// The tier, from what your auth layer knows (e.g. the request's extensions).
    pub fn tier(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.tier = Some(Arc::new(f)))
    }

    /// The user id, e.g. from an authenticated session in the extensions.
    pub fn user(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.user = Some(Arc::new(f)))
    }

    /// The API key (or an id of it).
    pub fn api_key(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.api_key = Some(Arc::new(f)))
    }

    /// The tier from a header that a hop in front of this service sets after authenticating (and
    /// strips from what clients send).
    pub fn tier_header(self, name: &'static str) -> Self {
        self.edit(|c| c.tier = Some(header_extractor(name)))
    }

    /// The user id from a header an authenticating hop sets (see [`RateLimitLayer::tier_header`]).
    pub fn user_header(self, name: &'static str) -> Self {
        self.edit(|c| c.user = Some(header_extractor(name)))
    }

    /// The API key from a header. Unlike a user id, a client does send its own key; rate limiting by
    /// it before the key is verified lets a client spend another key's quota only if it knows that
    /// key.
    pub fn api_key_header(self, name: &'static str) -> Self {
        self.edit(|c| c.api_key = Some(header_extractor(name)))
    }

    /// Replaces the client-IP extractor (the default is [`client_ip`] with the trusted proxies).
    pub fn ip(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.edit(|c| c.ip = Some(Arc::new(f)))
    }

    /// Proxies whose `X-Forwarded-For` entries are believed (CIDR blocks or addresses).
    pub fn trust_proxies<I, S>(self, blocks: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let blocks = blocks
            .into_iter()
            .map(|b| Cidr::parse(b.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.edit(|c| c.trusted = blocks))
    }

    /// What a request to `endpoint` (as the endpoint extractor gives it; axum's `/items/{id}` and
    /// `/items/:id` are the same route) costs; 1 elsewhere.
    pub fn cost(self, endpoint: &str, cost: u32) -> Self {
        let (endpoint, cost) = (route_name(endpoint), cost.max(1));
        self.edit(|c| {
            c.costs.insert(endpoint, cost);
        })
    }

    /// What a request to `endpoint` answers when the agent cannot: `policy` alone decides, over the
    /// fail modes of the rules the client learned from the agent and the client's own policy (a
    /// login route `Closed` even under fail-open rules; a health route `Open` under fail-closed ones).
    pub fn fail_for(self, endpoint: &str, policy: FailPolicy) -> Self {
        let endpoint = route_name(endpoint);
        self.edit(|c| {
            c.fails.insert(endpoint, policy);
        })
    }

    /// Also sets the IETF draft's `RateLimit-Policy` and `RateLimit` headers.
    pub fn ietf_headers(self, on: bool) -> Self {
        self.edit(|c| c.ietf = on)
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service the layer wraps around yours.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: Arc<Config>,
}

impl Config {
    /// What a request is checked as, and its route's fail policy if one was set.
    fn attributes(&self, p: &Parts) -> (Attributes, Option<FailPolicy>) {
        let endpoint = (self.endpoint)(p);
        let cost = endpoint
            .as_deref()
            .and_then(|e| self.costs.get(e))
            .copied()
            .unwrap_or(1);
        let fail = endpoint.as_deref().and_then(|e| self.fails.get(e)).copied();
        let ip = match &self.ip {
            Some(f) => f(p),
            None => {
                let ip = client_ip(p, &self.trusted);
                // Without it, rules on the IP dimension cannot apply: say so once per process (a
                // service on a Unix socket, with no IP rules, need not hear it every minute).
                if ip.is_none() && !NO_PEER.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        "floodgate: no peer address on the request, so IP rules do not apply; serve \
                         with into_make_service_with_connect_info::<SocketAddr>() or insert a PeerAddr \
                         (said once)"
                    );
                }
                ip.map(|ip| ip.to_string())
            }
        };
        let read = |f: &Option<Extractor>| f.as_ref().and_then(|f| f(p)).map(wire_safe);
        let attributes = Attributes {
            endpoint: endpoint.map(wire_safe),
            tier: read(&self.tier),
            user: read(&self.user),
            api_key: read(&self.api_key),
            ip: ip.map(wire_safe),
            cost,
        };
        (attributes, fail)
    }
}

/// A value the agent accepts (see [`floodgate_protocol::http::wire_safe`]: as it is when the wire
/// allows it, else `h:` and its 64-bit FNV-1a hash).
pub fn wire_safe(value: String) -> String {
    floodgate_protocol::http::wire_safe(value)
}

/// Logs at most one warning a minute per `last`, one per kind of warning (a bad request per request
/// must not flood the log).
fn warn_rarely(last: &std::sync::atomic::AtomicU64, message: &str, error: &dyn std::fmt::Display) {
    let now = now_ms() / 60_000;
    if last.swap(now, std::sync::atomic::Ordering::Relaxed) != now {
        tracing::warn!(error = %error, "{message}");
    }
}

static CHECK_FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static NO_PEER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The headers for a decision (none when no enforced rule applied).
pub fn rate_limit_headers(d: &Decision, ietf: bool, now_ms: u64) -> Vec<(HeaderName, HeaderValue)> {
    let Some(rule) = binding_rule(d) else {
        return Vec::new();
    };
    let figures = floodgate_protocol::http::HeaderFigures {
        rule,
        limit: d.limit,
        remaining: d.remaining,
        reset_at_ms: d.reset_at_ms,
    };
    floodgate_protocol::http::rate_limit_headers(figures, ietf, now_ms)
        .into_iter()
        .filter_map(|(name, value)| Some((HeaderName::from_static(name), HeaderValue::try_from(value).ok()?)))
        .collect()
}

/// The enforced rule whose figures the decision carries, if any.
fn binding_rule(d: &Decision) -> Option<&str> {
    floodgate_protocol::http::binding_rule(&d.items, d.limit, d.remaining, d.reset_at_ms)
}

/// `Retry-After` in whole seconds: rounded up, never 0.
pub fn retry_after_seconds(d: &Decision) -> u64 {
    floodgate_protocol::http::retry_after_seconds(d.retry_after_ms.unwrap_or(1_000))
}

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
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RB>, S::Error>> + Send>>;

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
            let (attributes, fail) = config.attributes(&parts);
            let req = Request::from_parts(parts, body);
            let options = CallOptions {
                fail,
                ..CallOptions::default()
            };
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
                    return inner.call(req).await;
                }
            };
            let headers = rate_limit_headers(&decision, config.ietf, now_ms());
            let mut response = if decision.allowed {
                inner.call(req).await?
            } else {
                let secs = retry_after_seconds(&decision);
                let mut r = Response::new(RB::from(format!(
                    "{{\"error\":\"rate_limited\",\"retryAfter\":{secs}}}"
                )));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(peer: &str, xff: &[&str]) -> Parts {
        let mut b = Request::builder().uri("/x");
        for v in xff {
            b = b.header("x-forwarded-for", *v);
        }
        let (mut p, _) = b.body(()).unwrap().into_parts();
        p.extensions.insert(PeerAddr(peer.parse().unwrap()));
        p
    }

    #[test]
    fn forwarded_for_is_believed_only_from_trusted_proxies() {
        let trusted = vec![Cidr::parse("10.0.0.0/8").unwrap(), Cidr::parse("::1").unwrap()];
        let ip = |peer, xff: &[&str]| client_ip(&parts(peer, xff), &trusted).unwrap().to_string();
        // Not from a proxy: the header is the client's own words, ignored.
        assert_eq!(ip("203.0.113.9:1", &["1.2.3.4"]), "203.0.113.9");
        // From a proxy: the rightmost address it did not vouch for.
        assert_eq!(
            ip("10.0.0.2:1", &["6.6.6.6, 198.51.100.7, 10.0.0.5"]),
            "198.51.100.7"
        );
        // Several header lines count as one list, in order.
        assert_eq!(ip("10.0.0.2:1", &["6.6.6.6", "198.51.100.7"]), "198.51.100.7");
        // Garbage stops the walk at the last trusted hop.
        assert_eq!(ip("10.0.0.2:1", &["198.51.100.7, bogus"]), "10.0.0.2");
        // A proxy without the header: the proxy is the client.
        assert_eq!(ip("[::1]:1", &[]), "::1");
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("::ffff:10.1.2.3")
            .unwrap()
            .contains("10.1.2.3".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/8")
            .unwrap()
            .contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
    }

    #[test]
    fn odd_values_become_stable_hashes_the_wire_accepts() {
        assert_eq!(wire_safe("alice".into()), "alice");
        let brace = wire_safe("{".into());
        assert!(brace.starts_with("h:") && brace.len() == 18, "{brace}");
        assert_eq!(brace, wire_safe("{".into()), "stable");
        assert_ne!(brace, wire_safe("}".into()));
        let long = wire_safe("x".repeat(300));
        let a = Attributes {
            user: Some(long),
            tier: Some(wire_safe("a\u{7}b".into())),
            cost: 1,
            ..Default::default()
        };
        assert_eq!(a.validate(), Ok(()));
        // The example's mapped block holds 10.0.0.0/8 addresses however they are written.
        let mapped = Cidr::parse("::ffff:10.0.0.0/104").unwrap();
        assert!(mapped.contains("10.9.9.9".parse().unwrap()));
        assert!(mapped.contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(!mapped.contains("11.0.0.1".parse().unwrap()));
    }

    #[test]
    fn routes_lose_their_braces() {
        assert_eq!(route_name("/items/{id}/parts/{*rest}"), "/items/:id/parts/*rest");
        assert_eq!(route_name("/plain/path"), "/plain/path");
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_never_zero() {
        let d = |ms| Decision {
            allowed: false,
            limit: 5,
            remaining: 0,
            reset_at_ms: 0,
            retry_after_ms: ms,
            origin: crate::Origin::FailClosed(crate::Degraded::Timeout),
            items: Vec::new(),
        };
        assert_eq!(retry_after_seconds(&d(Some(1))), 1);
        assert_eq!(retry_after_seconds(&d(Some(1_000))), 1);
        assert_eq!(retry_after_seconds(&d(Some(1_001))), 2);
        assert_eq!(retry_after_seconds(&d(Some(0))), 1);
        assert_eq!(retry_after_seconds(&d(None)), 1);
    }
}
