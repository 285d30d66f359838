//! ShouldRateLimit answered by the engine: descriptors to `(key, rule, cost)` items, one all-or-nothing
//! check, and the verdicts back as Envoy's statuses and headers.

use std::sync::Arc;
use std::time::Instant;

use floodgate_core::algo::Period;
use floodgate_core::rules::{Algorithm, OverLimit, Rule, RuleSet};
use floodgate_protocol::{Check, ErrorCode, Item, ItemMode, TraceContext, MAX_ITEMS};
use prost::Message;
use tonic::{Request, Response, Status};

use super::proto::{Entry, RateLimitOverride, RateLimitRequest, RateLimitResponse, RateLimitService, Unit};
use super::reply::{self, GrpcHeaders, Slot};
use floodgate_core::engine::{Answer, Engine};
use floodgate_core::store::Clock;

/// A request's descriptors as a check: what each became, the items, and those under their own limit.
type Described = (Vec<Slot>, Vec<Item>, Vec<(usize, Arc<Rule>)>);

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

    /// Decides one request: its RateLimitResponse as protobuf bytes (what the native server sends). A
    /// rule set swapped between the descriptor lookup and the check (a rule removed) is answered from
    /// the new set: one retry.
    /// `trace` is the caller's trace context (`traceparent` metadata): with traces on, the request's
    /// span is its child.
    pub async fn decide_bytes(
        &self,
        req: RateLimitRequest,
        trace: Option<TraceContext>,
    ) -> Result<Vec<u8>, Status> {
        // Off, one atomic load and an empty Option carried along.
        let mut span = if crate::otel::enabled() {
            crate::otel::start_check(trace)
        } else {
            None
        };
        let mut out = Vec::with_capacity(256);
        let result = match self.decide_into(&req, &mut out, &mut span).await {
            Err(e) if e.code() == tonic::Code::Unavailable => {
                out.clear();
                self.decide_into(&req, &mut out, &mut span).await
            }
            other => other,
        };
        if let (Some(span), Err(e)) = (span, &result) {
            crate::otel::end_check(
                *span,
                crate::otel::Via::Grpc(e.code() as i32),
                Err(e.message()),
                None,
            );
        }
        result.map(|()| out)
    }

    /// [`decide_bytes`](Self::decide_bytes) as the message (what the tonic server sends).
    pub async fn decide(
        &self,
        req: RateLimitRequest,
        trace: Option<TraceContext>,
    ) -> Result<RateLimitResponse, Status> {
        let bytes = self.decide_bytes(req, trace).await?;
        RateLimitResponse::decode(&bytes[..]).map_err(|e| Status::internal(e.to_string()))
    }

    /// Writes the answer into `out`, and ends `span` (if traced) with the decision.
    async fn decide_into(
        &self,
        req: &RateLimitRequest,
        out: &mut Vec<u8>,
        span: &mut Option<Box<crate::otel::SpanStart>>,
    ) -> Result<(), Status> {
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
        let (slots, mut items, under) = self.items(req, &rules)?;
        if items.is_empty() {
            floodgate_core::metrics::grpc_request("unmatched");
            reply::write_unlimited(out, &slots);
            if let Some(span) = span.take() {
                crate::otel::end_check(*span, crate::otel::Via::Grpc(0), Ok(None), None);
            }
            return Ok(());
        }
        let start = Instant::now();
        self.looks_first(&mut items, &under).await;
        let check = Check::Items(items);
        let charges = floodgate_core::metrics::charges(&check);
        // How long the check waited on the store (None: answered at once), for its span.
        let mut waited = None;
        let result = match self.engine.check_under(check, &under, Instant::now()) {
            Answer::Ready(r) => r,
            Answer::Pending(f) => {
                let asked = Instant::now();
                // A traced check names its span to the store call it may join (`call_trace`).
                let r = match span.as_ref().map(|s| s.name()) {
                    Some(name) => floodgate_core::call_trace::Traced::new(name, f).await,
                    None => f.await,
                };
                waited = Some(asked.elapsed());
                r
            }
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
        // The descriptor's own limit's unit, if it brought one; else its rule's.
        let window_ms = |i: usize, item: &floodgate_protocol::ItemDecision| {
            under
                .iter()
                .find(|(u, _)| *u == i)
                .map(|(_, r)| r.window_ms())
                .unwrap_or_else(|| rules.get(&item.rule_id).map_or(0, |r| r.window_ms()))
        };
        let now = Clock::System.now_ms();
        let allowed = reply::write(out, &decision, &slots, window_ms, self.headers, now);
        floodgate_core::metrics::grpc_request(if allowed { "ok" } else { "over_limit" });
        if let Some(span) = span.take() {
            crate::otel::end_check(*span, crate::otel::Via::Grpc(0), Ok(Some(&decision)), waited);
        }
        Ok(())
    }

    /// The request's descriptors as a check's items (the same counter twice is one item, its
    /// costs added), what each descriptor became, and the items checked under a descriptor's own
    /// limit (a rule with `limitOverride`); refused if a counter both gives back and takes, or past
    /// `MAX_ITEMS`.
    fn items(&self, req: &RateLimitRequest, rules: &RuleSet) -> Result<Described, Status> {
        // What each descriptor became: an item of the check, or answered without one.
        let mut slots: Vec<Slot> = Vec::with_capacity(req.descriptors.len());
        let mut items: Vec<Item> = Vec::with_capacity(req.descriptors.len());
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
                // Quota mode: consumed within the limit; past it the engine lets it through flagged.
                (_, OverLimit::Deny | OverLimit::Flag) => (ItemMode::Consume, cost),
            };
            // The same counter twice in one request is one item with the costs added (the wire
            // refuses a duplicate item; both descriptors get its verdict); it counts if either does.
            match items.iter().position(|i| i.key == key && i.rule_id == rule.id) {
                // A release and a count of the same counter cannot be one item: refused.
                Some(i) if items[i].mode.gives_back() != mode.gives_back() => {
                    return Err(Status::invalid_argument(format!(
                        "descriptor {key:?} both gives units back and takes them in one request"
                    )))
                }
                Some(i) => {
                    items[i].cost = items[i].cost.saturating_add(cost);
                    if !mode.only_looks() {
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
        Ok((slots, items, under))
    }

    /// A descriptor that only looks (hits_addend 0) and is already past its limit refuses the
    /// request, as envoyproxy/ratelimit answers it; the others must then count nothing: the looks
    /// go first, and if one is over, the whole request is answered as looks.
    async fn looks_first(&self, items: &mut [Item], under: &[(usize, Arc<Rule>)]) {
        let peeks = items.iter().filter(|i| i.mode.only_looks()).count();
        if peeks > 0 && peeks < items.len() {
            let looking: Vec<usize> = (0..items.len()).filter(|&i| items[i].mode.only_looks()).collect();
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
                for item in items.iter_mut().filter(|i| !i.mode.gives_back()) {
                    item.mode = ItemMode::Peek;
                }
            }
        }
    }
}

#[tonic::async_trait]
impl RateLimitService for EnvoyService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let trace = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(TraceContext::parse);
        self.decide(request.into_inner(), trace).await.map(Response::new)
    }
}

/// Most descriptors one request may carry (Envoy sends a handful; this bounds the work one request
/// can ask for).
pub const MAX_DESCRIPTORS: usize = 64;

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
    if !rule.is_concurrency() {
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
            match r.algorithm {
                Algorithm::Quota => {
                    r.algorithm = Algorithm::SlidingWindow;
                    r.period = None;
                    r.timezone = None;
                }
                Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {}
            }
            r.window_seconds = seconds;
            if r.algorithm.has_burst() {
                r.burst = Some(limit);
            }
        }
    }
    // A version of its own: a rejection cached under another limit is not this one's.
    r.version = (1 << 61) | (u64::from(o.requests_per_unit) << 3) | (o.unit as u64 & 7);
    r.check().ok()?;
    Some(Arc::new(r))
}

/// The client key of a descriptor: its entries as `key=value` joined by `|`, with `%`, `|`, `=`,
/// braces and control characters percent-encoded (so no two descriptors share a key, and no
/// client-written value picks a Redis hash tag); over the wire's 256 bytes, `h:` and its FNV-1a hash.
pub fn descriptor_key(entries: &[Entry]) -> String {
    let mut key = String::with_capacity(entries.iter().map(|e| e.key.len() + e.value.len() + 2).sum());
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
    // Most values need no escape: copied whole.
    if !s
        .bytes()
        .any(|b| matches!(b, b'%' | b'|' | b'=' | b'{' | b'}') || b.is_ascii_control() || b >= 0x80)
    {
        out.push_str(s);
        return;
    }
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
    use crate::envoy::proto::Duration;

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
    }
}
