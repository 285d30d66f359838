//! The rule: its fields, defaults and validation (its kinds in `kinds.rs`, the set of rules and
//! the rules file in `set.rs`).

use std::num::NonZeroU64;

use serde::{Deserialize, Serialize};

pub use super::kinds::*;
pub use super::set::{RuleError, RuleSet};

/// The rules `floodgate agent` loads when no `--rules` file is given.
pub const EXAMPLE_RULES: &str = include_str!("example-rules.toml");

/// A year in milliseconds (365 days), for the bound below.
const YEAR_MS: f64 = 31_536_000_000.0;

/// The longest a token bucket may take to fill from empty: 100 years. The scripts add such times to
/// Redis `TIME` (~1.8e12 ms) and hand the sum to `PEXPIREAT`; kept under ~5e12 they stay exact
/// integers, far below 2^53 and below the 1e17 from which Redis prints a Lua number as `1.26e+17`,
/// which `PEXPIREAT` refuses (a rule of burst 4e6 at 1 per year did that and failed every check
/// with a large cost). A debt written back after a fallback period adds at most the outage's length.
pub const MAX_BUCKET_FILL_MS: f64 = 100.0 * YEAR_MS;

/// One rule, as written in a rules file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    /// The rule id clients name in checks.
    pub id: String,
    /// The attribute keys are built from (for attribute checks).
    pub dimension: Dimension,
    /// Which requests it applies to.
    #[serde(default, rename = "match")]
    pub matches: Match,
    /// Units per window (sliding window) or refill per window (token bucket).
    pub limit: NonZeroU64,
    /// The window in seconds; fractions allowed down to one millisecond. Required, except for a
    /// concurrency rule, which has none.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub window_seconds: f64,
    /// How long a concurrency rule's lease lasts unless released, in seconds (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_seconds: Option<f64>,
    /// How long a reservation (protocol version 6) is held before it expires uncommitted, in
    /// seconds (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_seconds: Option<f64>,
    /// What an expired reservation leaves counted: its reserved units (`charge`, the default) or
    /// nothing (`release`).
    #[serde(default, skip_serializing_if = "is_charge")]
    pub reservation_expiry: ReservationExpiry,
    /// A quota's calendar period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<crate::algo::Period>,
    /// A quota's time zone, an IANA name (default `UTC`): where its periods begin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// Token-bucket capacity; defaults to `limit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<NonZeroU64>,
    /// The algorithm.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// Enforce or only log.
    #[serde(default)]
    pub mode: Mode,
    /// What to do when the store is unavailable.
    #[serde(default)]
    pub fail_mode: FailMode,
    /// What an Envoy request past the limit does to the counter (gRPC path only).
    #[serde(default, skip_serializing_if = "is_deny")]
    pub over_limit: OverLimit,
    /// Where counting happens.
    #[serde(default)]
    pub execution: Execution,
    /// Flush interval of a batched rule in milliseconds (default: the agent's, 100 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_interval_ms: Option<NonZeroU64>,
    /// Build keys with the endpoint too (`apikey:abc:endpoint:/search`), so each endpoint counts apart.
    #[serde(default)]
    pub per_endpoint: bool,
    /// The Envoy descriptors this rule answers over gRPC (`dimension` must be `descriptor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envoy: Option<EnvoyMatch>,
    /// The rule's version in the rules service (0 for a rules file); bumped by every write. Local
    /// state follows it: a rejection cached under another version is dropped.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub version: u64,
    /// When the rules service last wrote the rule (Unix ms; 0 for a rules file).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub updated_at: u64,
}

fn is_deny(o: &OverLimit) -> bool {
    *o == OverLimit::Deny
}

fn is_charge(e: &ReservationExpiry) -> bool {
    *e == ReservationExpiry::Charge
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// How long a reservation is held when its rule names no `reservationSeconds`: 5 minutes, longer
/// than an LLM completion streams, so a live request's reservation does not run out under it.
pub const DEFAULT_RESERVATION_SECONDS: f64 = 300.0;

/// A concurrency rule's lease time when it names none.
pub const DEFAULT_LEASE_SECONDS: f64 = 60.0;

/// The longest lease a concurrency rule may have: a day.
pub const MAX_LEASE_SECONDS: f64 = 86_400.0;

impl Rule {
    /// The window in milliseconds (at least 1); a concurrency rule's lease time.
    pub fn window_ms(&self) -> u64 {
        let seconds = match self.algorithm {
            Algorithm::Concurrency => self.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS),
            Algorithm::Quota => return self.period.map_or(1, |p| p.nominal_ms()),
            Algorithm::SlidingWindow | Algorithm::TokenBucket => self.window_seconds,
        };
        ((seconds * 1000.0).round() as u64).max(1)
    }

    /// Whether the rule limits units in flight (leases) rather than a rate.
    pub fn is_concurrency(&self) -> bool {
        match self.algorithm {
            Algorithm::Concurrency => true,
            Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Quota => false,
        }
    }

    /// A quota's time zone (UTC when it names none, or, never after validation, a bad name).
    pub fn zone(&self) -> chrono_tz::Tz {
        self.timezone
            .as_deref()
            .and_then(|z| z.parse().ok())
            .unwrap_or(chrono_tz::UTC)
    }

    /// A quota's period holding `now_ms`: start and end, Unix ms (a rule of another algorithm: the
    /// whole time).
    pub fn quota_period(&self, now_ms: u64) -> (u64, u64) {
        match self.period {
            Some(p) => crate::algo::period_bounds(now_ms, p, self.zone()),
            None => (0, u64::MAX),
        }
    }

    /// The window a decision names (`RateLimit-Policy`'s `w`), in ms: `windowSeconds`; a quota's
    /// period that ends at `reset_at_ms` (its answers reset at their period's end), so a month is 28
    /// to 31 days and a day across a DST change 23 or 25 hours; 0 for a concurrency rule.
    pub fn policy_window_ms(&self, reset_at_ms: u64) -> u64 {
        match self.algorithm {
            Algorithm::SlidingWindow | Algorithm::TokenBucket => self.window_ms(),
            Algorithm::Concurrency => 0,
            Algorithm::Quota => {
                let (start, end) = self.quota_period(reset_at_ms.saturating_sub(1));
                end.saturating_sub(start)
            }
        }
    }

    /// The token-bucket capacity.
    pub fn burst(&self) -> u64 {
        self.burst.unwrap_or(self.limit).get()
    }

    /// The limit a client is told (`X-RateLimit-Limit`): the window's limit, or the bucket's capacity.
    pub fn display_limit(&self) -> u64 {
        match self.algorithm {
            Algorithm::SlidingWindow | Algorithm::Concurrency | Algorithm::Quota => self.limit.get(),
            Algorithm::TokenBucket => self.burst(),
        }
    }

    /// Whether its denials refuse a check: a rule in `enforce` mode, unless its `overLimit` is
    /// `flag` (quota mode: past the limit the request passes, flagged). Every store, the batcher,
    /// the fallback, the cache and the checker read this.
    pub fn enforced(&self) -> bool {
        self.mode == Mode::Enforce && self.over_limit != OverLimit::Flag
    }

    /// Whether it only logs (`mode = "log"`): its verdicts are reported, marked log-only, and its
    /// would-be rejections are the dry run's to count.
    pub fn logs_only(&self) -> bool {
        self.mode == Mode::Log
    }

    /// Whether a request past its limit passes flagged instead (`overLimit = "flag"`, enforce mode).
    pub fn flags_over_quota(&self) -> bool {
        self.mode == Mode::Enforce && self.over_limit == OverLimit::Flag
    }

    /// How long a reservation of this rule is held before it expires, in ms.
    pub fn reservation_ms(&self) -> u64 {
        (self.reservation_seconds.unwrap_or(DEFAULT_RESERVATION_SECONDS) * 1000.0) as u64
    }

    pub(super) fn validate(&self) -> Result<(), String> {
        floodgate_protocol::validate_rule_id(&self.id).map_err(|e| e.to_string())?;
        if let Some(r) = self.reservation_seconds {
            if !(r.is_finite() && (0.1..=MAX_LEASE_SECONDS).contains(&r)) {
                return Err(format!(
                    "rule {}: reservationSeconds must be from 0.1 to {MAX_LEASE_SECONDS}, not {r}",
                    self.id
                ));
            }
        }
        match self.algorithm {
            Algorithm::Concurrency => return self.validate_concurrency(),
            Algorithm::Quota => return self.validate_quota(),
            Algorithm::SlidingWindow | Algorithm::TokenBucket => {}
        }
        if self.period.is_some() || self.timezone.is_some() {
            return Err(format!(
                "rule {}: period and timezone are for algorithm \"quota\" only",
                self.id
            ));
        }
        if self.lease_seconds.is_some() {
            return Err(format!(
                "rule {}: leaseSeconds is for algorithm \"concurrency\" only",
                self.id
            ));
        }
        if self.window_seconds == 0.0 {
            return Err(format!("rule {}: windowSeconds is required", self.id));
        }
        if !(self.window_seconds.is_finite() && self.window_seconds >= 0.001) {
            return Err(format!(
                "rule {}: windowSeconds must be at least 0.001, not {}",
                self.id, self.window_seconds
            ));
        }
        if self.window_seconds > 31_536_000.0 {
            return Err(format!("rule {}: windowSeconds is over a year", self.id));
        }
        if self.limit.get() > 1 << 50 {
            return Err(format!("rule {}: limit {} is too large", self.id, self.limit));
        }
        if let Some(b) = self.burst {
            if b.get() > 1 << 50 {
                return Err(format!("rule {}: burst {b} is too large", self.id));
            }
        }
        if self.algorithm.has_burst() {
            // The time to fill an empty bucket, burst / (limit / window).
            let fill_ms = self.burst() as f64 * self.window_ms() as f64 / self.limit.get() as f64;
            if fill_ms > MAX_BUCKET_FILL_MS {
                return Err(format!(
                    "rule {}: a token bucket of burst {} refilled at {} per {} s takes {:.0} years \
                     to fill, over the {} years the scripts' times can hold exactly (lower burst or \
                     windowSeconds, or raise limit)",
                    self.id,
                    self.burst(),
                    self.limit,
                    self.window_seconds,
                    fill_ms / YEAR_MS,
                    MAX_BUCKET_FILL_MS / YEAR_MS,
                ));
            }
        }
        self.validate_common()
    }

    /// What a concurrency rule must hold: a lease time, no window, burst or batching.
    fn validate_concurrency(&self) -> Result<(), String> {
        let id = &self.id;
        if self.window_seconds != 0.0 {
            return Err(format!(
                "rule {id}: a concurrency rule has leaseSeconds (how long a held unit lasts), not windowSeconds"
            ));
        }
        if let Some(l) = self.lease_seconds {
            if !(l.is_finite() && (0.1..=MAX_LEASE_SECONDS).contains(&l)) {
                return Err(format!(
                    "rule {id}: leaseSeconds must be from 0.1 to {MAX_LEASE_SECONDS}, not {l}"
                ));
            }
        }
        if self.burst.is_some() || self.period.is_some() || self.timezone.is_some() {
            return Err(format!(
                "rule {id}: a concurrency rule has no burst, period or timezone"
            ));
        }
        if self.execution == Execution::Batched {
            return Err(format!(
                "rule {id}: a concurrency rule runs sync (its units are held, not counted): execution \"batched\" is refused"
            ));
        }
        if self.over_limit == OverLimit::Charge {
            return Err(format!(
                "rule {id}: overLimit \"charge\" counts a rate; a concurrency rule holds units"
            ));
        }
        if self.limit.get() > 1 << 32 {
            return Err(format!(
                "rule {id}: a concurrency limit is at most 2^32, not {}",
                self.limit
            ));
        }
        self.validate_common()
    }

    /// What a quota must hold: a period, a known time zone, no window, burst, lease or batching.
    fn validate_quota(&self) -> Result<(), String> {
        let id = &self.id;
        if self.period.is_none() {
            return Err(format!(
                "rule {id}: a quota needs a period: \"day\", \"week\", \"month\" or \"year\""
            ));
        }
        if let Some(z) = &self.timezone {
            if z.parse::<chrono_tz::Tz>().is_err() {
                return Err(format!(
                    "rule {id}: timezone {z:?} is not an IANA time zone name (e.g. \"Europe/Paris\", \"UTC\")"
                ));
            }
        }
        if self.window_seconds != 0.0 || self.lease_seconds.is_some() || self.burst.is_some() {
            return Err(format!(
                "rule {id}: a quota counts per calendar period: no windowSeconds, leaseSeconds or burst"
            ));
        }
        if self.execution == Execution::Batched {
            return Err(format!(
                "rule {id}: a quota is exact, one atomic counter per period: execution \"batched\" is refused"
            ));
        }
        self.validate_common()
    }

    /// What every rule must hold, whatever its algorithm.
    fn validate_common(&self) -> Result<(), String> {
        if let Some(f) = self.flush_interval_ms {
            if f.get() > 60_000 {
                return Err(format!("rule {}: flushIntervalMs {f} is over a minute", self.id));
            }
        }
        if let Some(p) = &self.matches.endpoint {
            validate_endpoint_pattern(p).map_err(|e| format!("rule {}: {e}", self.id))?;
        }
        if let Some(envoy) = &self.envoy {
            envoy.validate().map_err(|e| format!("rule {}: {e}", self.id))?;
            if self.dimension != Dimension::Descriptor {
                return Err(format!(
                    "rule {}: a rule with envoy descriptors must have dimension \"descriptor\"",
                    self.id
                ));
            }
        }
        Ok(())
    }

    /// Checks the rule alone (the rules service validates each PUT with it).
    pub fn check(&self) -> Result<(), InvalidRule> {
        self.validate().map_err(InvalidRule)
    }
}

/// Why a rule, or one of its fields, is refused: the message names the rule and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRule(pub String);

/// An endpoint pattern: exact (`/login`), a glob whose `*` matches one path segment (`/users/*/posts`),
/// or ending in `/*` … any `*` at the very end matches the rest (`/api/*`).
pub fn validate_endpoint_pattern(p: &str) -> Result<(), InvalidRule> {
    if p.is_empty() || !p.starts_with('/') {
        return Err(InvalidRule(format!("endpoint pattern {p:?} must start with '/'")));
    }
    if p.len() > 256 {
        return Err(InvalidRule(format!(
            "endpoint pattern is {} bytes, over 256",
            p.len()
        )));
    }
    if let Some(bad) = p.split('/').find(|seg| seg.contains('*') && *seg != "*") {
        return Err(InvalidRule(format!(
            "endpoint pattern {p:?}: '*' must be a whole segment, not part of {bad:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_rules_load() {
        let set = RuleSet::parse(EXAMPLE_RULES).unwrap();
        assert!(set.len() >= 3);
        assert!(set.get("api-per-user").is_some());
    }

    #[test]
    fn json_and_toml_agree() {
        let toml = "[[rules]]\nid = \"a\"\ndimension = \"ip\"\nlimit = 5\nwindowSeconds = 1\n";
        let json = r#"{"rules":[{"id":"a","dimension":"ip","limit":5,"windowSeconds":1}]}"#;
        let (a, b) = (RuleSet::parse(toml).unwrap(), RuleSet::parse(json).unwrap());
        assert_eq!(a.get("a"), b.get("a"));
        assert_eq!(a.get("a").unwrap().window_ms(), 1000);
    }

    #[test]
    fn a_decision_names_its_window_and_a_quota_its_own_period() {
        let set = RuleSet::parse(
            r#"{"rules":[
              {"id":"w","dimension":"ip","limit":5,"windowSeconds":0.5},
              {"id":"c","dimension":"ip","limit":5,"algorithm":"concurrency","leaseSeconds":30},
              {"id":"d","dimension":"ip","limit":5,"algorithm":"quota","period":"day","timezone":"America/New_York"},
              {"id":"m","dimension":"ip","limit":5,"algorithm":"quota","period":"month"}
            ]}"#,
        )
        .unwrap();
        let window = |id: &str, reset: &str| {
            let reset = chrono::DateTime::parse_from_rfc3339(reset)
                .unwrap()
                .timestamp_millis() as u64;
            set.get(id).unwrap().policy_window_ms(reset)
        };
        const HOUR: u64 = 3_600_000;
        assert_eq!(window("w", "2024-03-10T12:00:00Z"), 500);
        assert_eq!(
            window("c", "2024-03-10T12:00:00Z"),
            0,
            "a concurrency rule has no window"
        );
        // New York's 10 March 2024 lost an hour, its 3 November gained one; the answers of a day
        // reset at its end (local midnight).
        assert_eq!(window("d", "2024-03-11T00:00:00-04:00"), 23 * HOUR);
        assert_eq!(window("d", "2024-11-04T00:00:00-05:00"), 25 * HOUR);
        assert_eq!(window("d", "2024-06-02T00:00:00-04:00"), 24 * HOUR);
        assert_eq!(
            window("m", "2024-03-01T00:00:00Z"),
            29 * 24 * HOUR,
            "February of a leap year"
        );
        assert_eq!(window("m", "2024-01-01T00:00:00Z"), 31 * 24 * HOUR);
    }

    #[test]
    fn salvage_keeps_the_older_of_two_rules_answering_one_descriptor() {
        let rule = |id: &str, version: u64| {
            let mut r: Rule = serde_json::from_str(&format!(
                r#"{{"id":"{id}","dimension":"descriptor","limit":5,"windowSeconds":60,"envoy":{{"domain":"d","descriptors":[{{"key":"k"}}]}}}}"#
            ))
            .unwrap();
            r.version = version;
            r
        };
        let rules = vec![rule("late", 9), rule("early", 3)];
        assert!(RuleSet::new(rules.clone()).is_err());
        let (set, left_out) = RuleSet::salvage(rules);
        assert!(set.get("early").is_some());
        assert!(set.get("late").is_none());
        assert_eq!(left_out.len(), 1);
        assert_eq!(left_out[0].0, "late");
        assert!(left_out[0].1.contains("both answer"), "{}", left_out[0].1);
    }

    #[test]
    fn a_bucket_that_fills_within_a_century_is_valid() {
        let rule = |burst: u64| {
            format!(
                r#"{{"rules":[{{"id":"a","dimension":"ip","limit":1,"windowSeconds":31536000,"burst":{burst},"algorithm":"token_bucket"}}]}}"#
            )
        };
        assert!(RuleSet::parse(&rule(100)).is_ok());
        assert!(RuleSet::parse(&rule(101)).is_err());
    }

    #[test]
    fn bad_rules_are_refused_with_a_reason() {
        for (text, needle) in [
            (
                r#"{"rules":[{"id":"a","dimension":"ip","limit":0,"windowSeconds":1}]}"#,
                "nonzero",
            ),
            (
                r#"{"rules":[{"id":"a","dimension":"ip","limit":5,"windowSeconds":0}]}"#,
                "windowSeconds",
            ),
            (
                r#"{"rules":[{"id":"a b","dimension":"ip","limit":5,"windowSeconds":1}]}"#,
                "rule id",
            ),
            (
                r#"{"rules":[{"id":"a","dimension":"ip","limit":5,"windowSeconds":1,"execution":"eventually"}]}"#,
                "eventually",
            ),
            (
                r#"{"rules":[{"id":"a","dimension":"ip","limit":5,"windowSeconds":1,"flushIntervalMs":0}]}"#,
                "nonzero",
            ),
            (
                r#"{"rules":[{"id":"a","dimension":"planet","limit":5,"windowSeconds":1}]}"#,
                "planet",
            ),
            // Fills in 4e6 years: the times the script computes would not be exact integers.
            (
                r#"{"rules":[{"id":"a","dimension":"ip","limit":1,"windowSeconds":31536000,"burst":4000000,"algorithm":"token_bucket"}]}"#,
                "4000000 years to fill",
            ),
            (
                r#"{"rules":[{"id":"a","dimension":"ip","limit":5,"windowSeconds":1},{"id":"a","dimension":"ip","limit":5,"windowSeconds":1}]}"#,
                "twice",
            ),
        ] {
            let err = RuleSet::parse(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }
}
