//! ShouldRateLimit answered by the engine: descriptors to `(key, rule, cost)` items, one all-or-nothing
//! check, and the verdicts back as Envoy's statuses and headers.

use std::sync::Arc;
use std::time::Instant;

use floodgate_core::algo::Period;
use floodgate_core::rules::{Algorithm, OverLimit, Rule};
use floodgate_protocol::http::{binding_rule, rate_limit_headers, retry_after_seconds, HeaderFigures};
use floodgate_protocol::{Check, Decision, ErrorCode, Item, ItemMode, MAX_ITEMS};
use tonic::{Request, Response, Status};

use super::proto::{
    Code, DescriptorStatus, Duration, Entry, HeaderValue, RateLimit, RateLimitOverride, RateLimitRequest,
    RateLimitResponse, RateLimitService, Unit,
};
use floodgate_core::engine::{Answer, Engine};
use floodgate_core::store::Clock;

/// Which rate-limit headers go into `response_headers_to_add`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GrpcHeaders {
    /// None: Envoy's own `enable_x_ratelimit_headers` (or nothing) makes them.
    None,
    /// `X-RateLimit-Limit/Remaining/Reset` on every response a rule applied to, `Retry-After` on
    /// every over-limit one (the SDK Layer's headers).
    #[default]
    XRatelimit,
    /// Those and the IETF draft's `RateLimit` and `RateLimit-Policy`.
    Both,
}

/// The agent's `envoy.service.ratelimit.v3.RateLimitService`.
pub struct EnvoyService {
    engine: Arc<Engine>,
    headers: GrpcHeaders,
}

impl EnvoyService {
    /// Answers from `engine`'s rule set and store.
    pub fn new(engine: Arc<Engine>, headers: GrpcHeaders) -> Self {
        EnvoyService { engine, headers }
    }

    /// Decides one request (what the gRPC method calls). A rule set swapped between the descriptor
    /// lookup and the check (a rule removed) is answered from the new set: one retry.
    pub async fn decide(&self, req: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        match self.decide_once(&req).await {
            Err(e) if e.code() == tonic::Code::Unavailable => self.decide_once(&req).await,
            other => other,
        }
    }

    async fn decide_once(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if req.domain.is_empty() {
            return Err(Status::invalid_argument("rate limit domain must not be empty"));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        if req.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "{} descriptors in one request; at most {MAX_DESCRIPTORS}",
                req.descriptors.len()
            )));
        }
        let rules = self.engine.rules();
        // What each descriptor became: an item of the check, or answered without one.
        let mut slots: Vec<Slot> = Vec::with_capacity(req.descriptors.len());
        let mut items: Vec<Item> = Vec::new();
        // Items checked under a descriptor's own limit (a rule with `limitOverride`).
        let mut under: Vec<(usize, Arc<Rule>)> = Vec::new();
        for d in &req.descriptors {
            let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
            let Some(rule) = rules.for_descriptor(&req.domain, entries) else {
                slots.push(Slot::NoRule);
                continue;
            };
            if rule.envoy.as_ref().is_some_and(|e| e.unlimited) {
                slots.push(Slot::Unlimited);
                continue;
            }
            let cost = match d.hits_addend {
                Some(h) => h.value,
                // envoyproxy/ratelimit's rule: an unset (0) request hits_addend is 1.
                None => u64::from(req.hits_addend.max(1)),
            };
            let cost = u32::try_from(cost).unwrap_or(u32::MAX);
            let key = descriptor_key(&d.entries);
            // A hits_addend of 0 reads the descriptor's limit and remaining without counting (a
            // peek of cost 0: OVER_LIMIT only once the key is past its limit), as
            // envoyproxy/ratelimit answers it.
            // A rule with overLimit = "charge" counts every request, past the limit too (as
            // envoyproxy/ratelimit does), so a response-phase report of a cost known afterwards
            // (`apply_on_stream_done`) is counted whatever it comes to.
            // Asked to give units back (`is_negative_hits`, Envoy's concurrency recipe: the
            // response phase of a request whose request phase acquired): a release by count of a
            // concurrency rule; on a rate rule nothing is given back (a look, as a hits_addend of 0).
            let (mode, cost) = match (cost, rule.over_limit) {
                _ if d.is_negative_hits && rule.is_concurrency() => (ItemMode::Release, cost),
                _ if d.is_negative_hits => (ItemMode::Peek, 0),
                (0, _) => (ItemMode::Peek, 0),
                (_, OverLimit::Charge) => (ItemMode::Charge, cost),
                (_, OverLimit::Deny) => (ItemMode::Consume, cost),
            };
            // The same counter twice in one request is one item with the costs added (the wire
            // refuses a duplicate item; both descriptors get its verdict); it counts if either does.
            match items.iter().position(|i| i.key == key && i.rule_id == rule.id) {
                // A release and a count of the same counter cannot be one item: refused.
                Some(i) if (items[i].mode == ItemMode::Release) != (mode == ItemMode::Release) => {
                    return Err(Status::invalid_argument(format!(
                        "descriptor {key:?} both gives units back and takes them in one request"
                    )))
                }
                Some(i) => {
                    items[i].cost = items[i].cost.saturating_add(cost);
                    if mode != ItemMode::Peek {
                        items[i].mode = mode;
                    }
                    slots.push(Slot::Item(i));
                }
                None if items.len() == MAX_ITEMS => {
                    return Err(Status::invalid_argument(format!(
                        "more than {MAX_ITEMS} limited descriptors in one request"
                    )))
                }
                None => {
                    items.push(Item {
                        mode,
                        ..Item::new(key, rule.id.clone(), cost)
                    });
                    if let Some(own) = d.limit.and_then(|o| overridden(rule, o)) {
                        under.push((items.len() - 1, own));
                    }
                    slots.push(Slot::Item(items.len() - 1));
                }
            }
        }
        if items.is_empty() {
            floodgate_core::metrics::grpc_request("unmatched");
            return Ok(RateLimitResponse {
                overall_code: Code::Ok as i32,
                statuses: slots.iter().map(|s| not_limited(*s)).collect(),
                ..Default::default()
            });
        }
        let start = Instant::now();
        // A descriptor that only looks (hits_addend 0) and is already past its limit refuses the
        // request, as envoyproxy/ratelimit answers it; the others must then count nothing: the looks
        // go first, and if one is over, the whole request is answered as looks.
        let peeks = items.iter().filter(|i| i.mode == ItemMode::Peek).count();
        if peeks > 0 && peeks < items.len() {
            let looking: Vec<usize> = (0..items.len())
                .filter(|&i| items[i].mode == ItemMode::Peek)
                .collect();
            let looks: Vec<Item> = looking.iter().map(|&i| items[i].clone()).collect();
            let looks_under: Vec<(usize, Arc<Rule>)> = under
                .iter()
                .filter_map(|(i, r)| Some((looking.iter().position(|l| l == i)?, r.clone())))
                .collect();
            let looked = match self
                .engine
                .check_under(Check::Items(looks), &looks_under, Instant::now())
            {
                Answer::Ready(r) => r,
                Answer::Pending(f) => f.await,
            };
            if looked.is_ok_and(|d| !d.combined.allowed) {
                // A release still gives its units back.
                for item in items.iter_mut().filter(|i| i.mode != ItemMode::Release) {
                    item.mode = ItemMode::Peek;
                }
            }
        }
        let check = Check::Items(items);
        let charges = floodgate_core::metrics::charges(&check);
        let result = match self.engine.check_under(check, &under, Instant::now()) {
            Answer::Ready(r) => r,
            Answer::Pending(f) => f.await,
        };
        floodgate_core::metrics::check_charged(&result, start.elapsed(), charges);
        let decision = result.map_err(|e| {
            floodgate_core::metrics::grpc_request("error");
            match e.code {
                ErrorCode::InvalidItem => Status::invalid_argument(e.message),
                ErrorCode::Overloaded => Status::resource_exhausted(e.message),
                ErrorCode::UnknownRule => {
                    Status::unavailable(format!("rules changed mid-request: {}", e.message))
                }
                _ => Status::internal(e.message),
            }
        })?;
        let response = self.response(&decision, &slots, &rules, &under);
        floodgate_core::metrics::grpc_request(if response.overall_code == Code::Ok as i32 {
            "ok"
        } else {
            "over_limit"
        });
        Ok(response)
    }

    fn response(
        &self,
        d: &Decision,
        slots: &[Slot],
        rules: &floodgate_core::rules::RuleSet,
        under: &[(usize, Arc<Rule>)],
    ) -> RateLimitResponse {
        let now = Clock::System.now_ms();
        let statuses: Vec<DescriptorStatus> = slots
            .iter()
            .map(|slot| {
                let item = match slot {
                    Slot::Item(i) => d.items.get(*i),
                    _ => None,
                };
                let Some(item) = item else {
                    return not_limited(*slot);
                };
                let v = &item.verdict;
                let over = !v.allowed && !v.log_only;
                // The descriptor's own limit's unit, if it brought one.
                let own = match slot {
                    Slot::Item(i) => under.iter().find(|(u, _)| u == i).map(|(_, r)| r.window_ms()),
                    _ => None,
                };
                let window_ms = own.unwrap_or_else(|| rules.get(&item.rule_id).map_or(0, |r| r.window_ms()));
                DescriptorStatus {
                    // Shadow (log) mode answers OK, as envoyproxy/ratelimit's shadow_mode does.
                    code: if over { Code::OverLimit } else { Code::Ok } as i32,
                    current_limit: Some(RateLimit {
                        name: item.rule_id.to_string(),
                        requests_per_unit: u32::try_from(v.limit).unwrap_or(u32::MAX),
                        unit: unit(window_ms) as i32,
                    }),
                    // Over the limit is nothing left, whatever a larger cost would have found.
                    limit_remaining: if over {
                        0
                    } else {
                        u32::try_from(v.remaining).unwrap_or(u32::MAX)
                    },
                    // Over the limit: when this request could pass; else when the key is full again.
                    duration_until_reset: Some(Duration::from_ms(if over {
                        v.retry_after_ms
                    } else {
                        v.reset_at_ms.saturating_sub(now)
                    })),
                }
            })
            .collect();
        // Envoy's overall code is OVER_LIMIT when any descriptor is: a hits_addend-0 descriptor past
        // its limit too, though a peek does not decide the check's consume items.
        let allowed = d.combined.allowed && statuses.iter().all(|s| s.code != Code::OverLimit as i32);
        let mut headers = Vec::new();
        if self.headers != GrpcHeaders::None {
            let c = &d.combined;
            if let Some(binding) = binding_rule(&d.items, c.limit, c.remaining, c.reset_at_ms) {
                let figures = HeaderFigures {
                    rule: &binding.rule_id,
                    window_ms: binding.window_ms,
                    limit: c.limit,
                    remaining: c.remaining,
                    reset_at_ms: c.reset_at_ms,
                };
                for (k, v) in rate_limit_headers(figures, self.headers == GrpcHeaders::Both, now) {
                    headers.push(HeaderValue {
                        key: k.into(),
                        value: v,
                    });
                }
            }
            if !allowed {
                headers.push(HeaderValue {
                    key: "retry-after".into(),
                    // The longest wait among the descriptors over the limit (the combined
                    // verdict's, unless only a peek or a charge is over).
                    value: retry_after_seconds(
                        statuses
                            .iter()
                            .filter(|s| s.code == Code::OverLimit as i32)
                            .filter_map(|s| s.duration_until_reset.as_ref())
                            .map(|d| {
                                u64::try_from(d.seconds).unwrap_or(0) * 1000
                                    + u64::try_from(d.nanos).unwrap_or(0) / 1_000_000
                            })
                            .max()
                            .unwrap_or(0)
                            .max(d.combined.retry_after_ms),
                    )
                    .to_string(),
                });
            }
        }
        RateLimitResponse {
            overall_code: if allowed { Code::Ok } else { Code::OverLimit } as i32,
            statuses,
            response_headers_to_add: headers,
            request_headers_to_add: Vec::new(),
        }
    }
}

#[tonic::async_trait]
impl RateLimitService for EnvoyService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.into_inner()).await.map(Response::new)
    }
}

/// Most descriptors one request may carry (Envoy sends a handful; this bounds the work one request
/// can ask for).
pub const MAX_DESCRIPTORS: usize = 64;

/// What one descriptor of a request became.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// This item of the check.
    Item(usize),
    /// No rule answers it (or it asked for what cannot be done): OK, no limit.
    NoRule,
    /// An unlimited rule answers it: OK, no limit, all remaining.
    Unlimited,
}

/// The status of a descriptor that is not counted, as envoyproxy/ratelimit answers one: OK without
/// a limit, remaining 0 when no rule applies and the largest count when it is unlimited.
fn not_limited(slot: Slot) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining: if matches!(slot, Slot::Unlimited) {
            u32::MAX
        } else {
            0
        },
        ..Default::default()
    }
}

/// The rule a descriptor's own limit makes of `rule`, if the rule allows one (`limitOverride`):
/// `requests_per_unit` per `unit` (a month or a year: a calendar quota; a concurrency rule takes
/// only the number). None when not allowed or not usable (0, an unknown unit).
fn overridden(rule: &Arc<Rule>, o: RateLimitOverride) -> Option<Arc<Rule>> {
    if !rule.envoy.as_ref().is_some_and(|e| e.limit_override) {
        return None;
    }
    let limit = std::num::NonZeroU64::new(u64::from(o.requests_per_unit))?;
    let mut r = (**rule).clone();
    r.limit = limit;
    if rule.algorithm != Algorithm::Concurrency {
        let seconds = match Unit::try_from(o.unit).ok()? {
            Unit::Second => 1.0,
            Unit::Minute => 60.0,
            Unit::Hour => 3_600.0,
            Unit::Day => 86_400.0,
            Unit::Week => 604_800.0,
            Unit::Month | Unit::Year => 0.0,
            Unit::Unknown => return None,
        };
        if seconds == 0.0 {
            r.algorithm = Algorithm::Quota;
            r.period = Some(if o.unit == Unit::Month as i32 {
                Period::Month
            } else {
                Period::Year
            });
            r.window_seconds = 0.0;
            r.burst = None;
            r.execution = Default::default();
        } else {
            if r.algorithm == Algorithm::Quota {
                r.algorithm = Algorithm::SlidingWindow;
                r.period = None;
                r.timezone = None;
            }
            r.window_seconds = seconds;
            if r.algorithm == Algorithm::TokenBucket {
                r.burst = Some(limit);
            }
        }
    }
    // A version of its own: a rejection cached under another limit is not this one's.
    r.version = (1 << 61) | (u64::from(o.requests_per_unit) << 3) | (o.unit as u64 & 7);
    r.check().ok()?;
    Some(Arc::new(r))
}

/// Envoy's unit for a window that is exactly one; any other window is `UNKNOWN`.
fn unit(window_ms: u64) -> Unit {
    match window_ms {
        1_000 => Unit::Second,
        60_000 => Unit::Minute,
        3_600_000 => Unit::Hour,
        86_400_000 => Unit::Day,
        604_800_000 => Unit::Week,
        _ => Unit::Unknown,
    }
}

/// The client key of a descriptor: its entries as `key=value` joined by `|`, with `%`, `|`, `=`,
/// braces and control characters percent-encoded (so no two descriptors share a key, and no
/// client-written value picks a Redis hash tag); over the wire's 256 bytes, `h:` and its FNV-1a hash.
pub fn descriptor_key(entries: &[Entry]) -> String {
    let mut key = String::new();
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            key.push('|');
        }
        escape(&mut key, &e.key);
        key.push('=');
        escape(&mut key, &e.value);
    }
    if key.is_empty() {
        key.push('=');
    }
    floodgate_protocol::http::wire_safe(key)
}

fn escape(out: &mut String, s: &str) {
    for c in s.chars() {
        if matches!(c, '%' | '|' | '=' | '{' | '}') || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                const HEX: &[u8; 16] = b"0123456789ABCDEF";
                out.push('%');
                out.push(HEX[usize::from(b >> 4)] as char);
                out.push(HEX[usize::from(b & 15)] as char);
            }
        } else {
            out.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(k: &str, v: &str) -> Entry {
        Entry {
            key: k.into(),
            value: v.into(),
        }
    }

    #[test]
    fn descriptor_keys_are_injective_and_wire_safe() {
        let a = descriptor_key(&[e("k1", "x|k2=y"), e("k2", "z")]);
        let b = descriptor_key(&[e("k1", "x"), e("k2", "y|k2=z")]);
        assert_ne!(a, b);
        assert_eq!(
            descriptor_key(&[e("remote_address", "10.0.0.1")]),
            "remote_address=10.0.0.1"
        );
        assert_eq!(descriptor_key(&[e("h", "{tag}")]), "h=%7Btag%7D");
        let long = descriptor_key(&[e("k", &"v".repeat(300))]);
        assert!(long.starts_with("h:") && long.len() == 18, "{long}");
    }

    #[test]
    fn durations_and_units() {
        assert_eq!(
            Duration::from_ms(1_500),
            Duration {
                seconds: 1,
                nanos: 500_000_000
            }
        );
        assert_eq!(Duration::from_ms(1_500).as_ms(), 1_500);
        assert_eq!(unit(60_000), Unit::Minute);
        assert_eq!(unit(5_000), Unit::Unknown);
    }
}
