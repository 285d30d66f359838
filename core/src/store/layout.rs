//! Where a (rule, client key) pair lives in Redis: its bucket, its hash tag and its key names.
//!
//! Sliding-window counts are fields of small hashes, one per (rule, bucket, window): at 1 M clients and
//! 16,384 buckets each hash holds ~61 clients, which Redis keeps as one compact listpack (≤ 128
//! entries by default), so a tracked pair costs ~20 B per window instead of ~100 B of per-key
//! overhead (BENCHMARKS.md has the measurement). The hash tag is a bucket group (`tag = bucket %
//! tags`): every key of one client shares it (and its bucket), so a multi-rule check for one client
//! is one script call on one shard, and a flush needs at most one call per tag on a Redis Cluster.
//! Independent nodes place buckets, not tags (finer, so the nodes' shares are even).

use crate::rules::{Algorithm, Rule};

/// Buckets per (rule, window) by default: ~61 clients per hash at 1 M clients.
pub const DEFAULT_BUCKETS: u32 = 16_384;
/// Hash tags (bucket groups) by default: on a Cluster these are the slots Floodgate's keys use, 128
/// of them spread over the masters, and the most script calls one flush needs.
pub const DEFAULT_TAGS: u32 = 128;

/// The suffixes of a sliding window's two window hashes: window `i`'s counts are in
/// `<state key><WINDOW_HASHES[i % 2]>` (lua/sliding_window.lua: each hash expires before the window of
/// its parity comes again).
pub const WINDOW_HASHES: [&str; 2] = [":w0", ":w1"];

/// The bucket and tag counts. Every agent of a fleet must use the same values: a change moves every
/// counter (limits then start over for one window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    buckets: u32,
    tags: u32,
}

impl Default for Layout {
    fn default() -> Self {
        Layout::new(DEFAULT_BUCKETS, DEFAULT_TAGS)
    }
}

impl Layout {
    /// A layout with these counts (each at least 1; tags at most buckets).
    pub fn new(buckets: u32, tags: u32) -> Self {
        let buckets = buckets.max(1);
        Layout {
            buckets,
            tags: tags.clamp(1, buckets),
        }
    }

    /// The number of hash tags.
    pub fn tags(&self) -> u32 {
        self.tags
    }

    /// The number of buckets.
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// The client key's bucket: FNV-1a, stable across agents, builds and platforms.
    pub fn bucket(&self, key: &str) -> u32 {
        (fnv1a(key.as_bytes()) % u64::from(self.buckets)) as u32
    }

    /// The client key's hash tag.
    pub fn tag(&self, key: &str) -> u32 {
        self.bucket(key) % self.tags
    }

    /// Where (rule, client key)'s state lives: for the sliding window and the quota the prefix of
    /// their hashes (`fg:{7}:api/1543`, see [`script_keys`](Self::script_keys)), for the token bucket
    /// the client's own hash (`fg:{7}:login/k/ip:1.2.3.4`), for a concurrency rule the client's
    /// sorted set of leases (`fg:{7}:gpu/c/apikey:abc`). Rule ids cannot contain `/`, so names
    /// never collide.
    pub fn state_key(&self, rule: &Rule, key: &str) -> String {
        let mut out = String::new();
        self.write_state_key(&mut out, rule, key);
        out
    }

    /// [`state_key`](Self::state_key) appended to `out`: a caller building many keys reuses one
    /// buffer instead of formatting a new `String` for each.
    pub fn write_state_key(&self, out: &mut String, rule: &Rule, key: &str) {
        let bucket = self.bucket(key);
        let tag = bucket % self.tags;
        let mut digits = itoa::Buffer::new();
        out.push_str("fg:{");
        out.push_str(digits.format(tag));
        out.push_str("}:");
        out.push_str(&rule.id);
        match rule.algorithm {
            // A quota's counters are fields of the same bucketed hashes, one per period (the
            // script appends `:q<period start>`).
            Algorithm::SlidingWindow | Algorithm::Quota => {
                out.push('/');
                out.push_str(digits.format(bucket));
            }
            Algorithm::TokenBucket => {
                out.push_str("/k/");
                out.push_str(key);
            }
            Algorithm::Concurrency => {
                out.push_str("/c/");
                out.push_str(key);
            }
        }
    }

    /// Every key the scripts touch for (rule, client key), handed to `emit` in the order the scripts
    /// take them, built in `buf` (reused): a sliding window's two window hashes (`fg:{7}:api/1543:w0`
    /// and `:w1`), a quota's hash of the period starting at `period_start` (`fg:{7}:day/1543:q<ms>`), a
    /// token bucket's or a concurrency rule's own key. A script declares every key it touches, so a
    /// Redis Cluster moving the slot routes the call to where they are, and a store that refuses
    /// undeclared keys runs it.
    pub fn script_keys(
        &self,
        buf: &mut String,
        rule: &Rule,
        key: &str,
        period_start: u64,
        mut emit: impl FnMut(&str),
    ) {
        buf.clear();
        self.write_state_key(buf, rule, key);
        match rule.algorithm {
            Algorithm::SlidingWindow => {
                let prefix = buf.len();
                for suffix in WINDOW_HASHES {
                    buf.truncate(prefix);
                    buf.push_str(suffix);
                    emit(buf);
                }
            }
            Algorithm::Quota => {
                buf.push_str(":q");
                buf.push_str(itoa::Buffer::new().format(period_start));
                emit(buf);
            }
            Algorithm::TokenBucket | Algorithm::Concurrency => emit(buf),
        }
    }

    /// How many keys [`script_keys`](Self::script_keys) gives for a rule.
    pub fn script_key_count(rule: &Rule) -> usize {
        match rule.algorithm {
            Algorithm::SlidingWindow => WINDOW_HASHES.len(),
            Algorithm::Quota | Algorithm::TokenBucket | Algorithm::Concurrency => 1,
        }
    }

    /// The hash holding a sliding window's counts of window `index` (tests and tools read it).
    pub fn window_key(&self, rule: &Rule, key: &str, index: u64) -> String {
        let mut out = self.state_key(rule, key);
        out.push_str(WINDOW_HASHES[(index % 2) as usize]);
        out
    }
}

/// 64-bit FNV-1a (the protocol's, the one `wire_safe` hashes with): buckets and hash tags.
pub use floodgate_protocol::http::fnv1a64 as fnv1a;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    #[test]
    fn one_clients_keys_share_a_tag_across_rules() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"a","dimension":"user","limit":1,"windowSeconds":1},
                {"id":"b","dimension":"user","limit":1,"windowSeconds":1,"algorithm":"token_bucket"}]}"#,
        )
        .unwrap();
        let layout = Layout::default();
        let tag = layout.tag("user:42");
        let (a, b) = (
            layout.state_key(rules.get("a").unwrap(), "user:42"),
            layout.state_key(rules.get("b").unwrap(), "user:42"),
        );
        assert!(a.starts_with(&format!("fg:{{{tag}}}:a/")), "{a}");
        assert_eq!(b, format!("fg:{{{tag}}}:b/k/user:42"));
    }

    #[test]
    fn the_scripts_are_given_every_key_they_touch() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"sw","dimension":"user","limit":1,"windowSeconds":1},
                {"id":"q","dimension":"user","limit":1,"algorithm":"quota","period":"day"},
                {"id":"tb","dimension":"user","limit":1,"windowSeconds":1,"algorithm":"token_bucket"}]}"#,
        )
        .unwrap();
        let layout = Layout::default();
        let keys = |id: &str| {
            let rule = rules.get(id).unwrap();
            let mut out = Vec::new();
            layout.script_keys(&mut String::new(), rule, "user:42", 1_700_000_000_000, |k| {
                out.push(k.to_string())
            });
            assert_eq!(out.len(), Layout::script_key_count(rule), "{id}");
            out
        };
        let (tag, bucket) = (layout.tag("user:42"), layout.bucket("user:42"));
        assert_eq!(
            keys("sw"),
            [
                format!("fg:{{{tag}}}:sw/{bucket}:w0"),
                format!("fg:{{{tag}}}:sw/{bucket}:w1")
            ]
        );
        assert_eq!(keys("q"), [format!("fg:{{{tag}}}:q/{bucket}:q1700000000000")]);
        assert_eq!(keys("tb"), [format!("fg:{{{tag}}}:tb/k/user:42")]);
        let sw = rules.get("sw").unwrap();
        assert_eq!(layout.window_key(sw, "user:42", 7), keys("sw")[1]);
    }

    #[test]
    fn buckets_spread_keys_evenly() {
        let layout = Layout::new(64, 8);
        let mut counts = [0u32; 64];
        for i in 0..64_000 {
            counts[layout.bucket(&format!("user:{i}")) as usize] += 1;
        }
        // 1,000 expected per bucket; a binomial's standard deviation is ~31, so ±20 % is > 6 sigma.
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }

    #[test]
    fn fnv_matches_the_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
