//! The Layer: its configuration (extractors, trusted proxies, costs and fail policies per route,
//! IETF headers), built by chained calls, and what a request is checked as.

use std::collections::HashMap;
use std::sync::Arc;

use http::request::Parts;

use super::extractors::{
    client_ip, default_endpoint, header_extractor, route_name, wire_safe, Cidr, CidrError, Extractor,
};
use super::service::RateLimit;
use http::HeaderName;

use crate::{Attributes, Client, FailPolicy, ItemMode};

/// What the Layer and its services share.
pub(super) struct Config {
    pub(super) client: Client,
    endpoint: Extractor,
    tier: Option<Extractor>,
    user: Option<Extractor>,
    api_key: Option<Extractor>,
    ip: Option<Extractor>,
    trusted: Vec<Cidr>,
    costs: HashMap<String, u32>,
    fails: HashMap<String, FailPolicy>,
    /// Endpoint → what says what a request to it cost (charged afterwards).
    charges: HashMap<String, ChargeFrom>,
    pub(super) ietf: bool,
}

/// A response's cost, from the response's status and headers.
pub(super) type ChargeFn = Arc<dyn Fn(http::StatusCode, &http::HeaderMap) -> Option<u32> + Send + Sync>;

/// Where a charge route's cost comes from.
#[derive(Clone)]
pub(super) enum ChargeFrom {
    /// A response header's value.
    Header(HeaderName),
    /// The route's callback.
    With(ChargeFn),
}

/// The Layer; cheap to clone.
#[derive(Clone)]
pub struct RateLimitLayer {
    config: Arc<Config>,
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
                charges: HashMap::new(),
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
                    charges: c.charges.clone(),
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
    pub fn trust_proxies<I, S>(self, blocks: I) -> Result<Self, CidrError>
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

    /// A request to `endpoint` costs what its response's `header` says (LLM tokens, bytes), known
    /// only afterwards: the request is let through unless a rule of it is already past its limit (a
    /// peek of cost 0), and the header's value (a positive integer) is then charged, counted even
    /// past the limit, without delaying the response. Needs an agent of protocol version 2.
    pub fn charge_header(self, endpoint: &str, header: HeaderName) -> Self {
        let endpoint = route_name(endpoint);
        self.edit(|c| {
            c.charges.insert(endpoint, ChargeFrom::Header(header));
        })
    }

    /// As [`charge_header`](Self::charge_header), the cost given by `f` from the response's status
    /// and headers (`None`: nothing charged).
    pub fn charge_with<F>(self, endpoint: &str, f: F) -> Self
    where
        F: Fn(http::StatusCode, &http::HeaderMap) -> Option<u32> + Send + Sync + 'static,
    {
        let endpoint = route_name(endpoint);
        let f: ChargeFn = Arc::new(f);
        self.edit(|c| {
            c.charges.insert(endpoint, ChargeFrom::With(f));
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
        RateLimit::new(inner, self.config.clone())
    }
}

impl Config {
    /// What a request is checked as, its route's fail policy if one was set, and the response header
    /// its cost is charged from if its route has one (the check is then a peek of cost 0).
    pub(super) fn attributes(&self, p: &Parts) -> (Attributes, Option<FailPolicy>, Option<ChargeFrom>) {
        let endpoint = (self.endpoint)(p);
        let cost = endpoint
            .as_deref()
            .and_then(|e| self.costs.get(e))
            .copied()
            .unwrap_or(1);
        let fail = endpoint.as_deref().and_then(|e| self.fails.get(e)).copied();
        let charge = endpoint.as_deref().and_then(|e| self.charges.get(e)).cloned();
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
            cost: if charge.is_some() { 0 } else { cost },
            mode: if charge.is_some() {
                ItemMode::Peek
            } else {
                ItemMode::Consume
            },
            lease: None,
        };
        (attributes, fail, charge)
    }
}

static NO_PEER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
