//! Floodgate's core: the decision engine and everything it decides with, free of I/O but for the
//! [`shared_store::SharedStore`] trait the Redis store (`floodgate-redis`) implements.
//!
//! # Map
//! - [`engine`]: resolves rules, asks the store, applies fail modes, combines verdicts; its
//!   shared-store path (cache, batching, call groups, fallback, take-back) in `engine/shared_path.rs`,
//!   `engine/groups.rs` and `engine/modes.rs`.
//! - [`shared_store`]: what the engine and the agent's loops ask of the fleet's shared store.
//! - [`store`]: the embedded in-memory store, the store errors, the key layout.
//! - [`algo`]: sliding window and token bucket as pure functions of (state, now).
//! - [`rules`]: the rule model, rules files (TOML/JSON, Envoy YAML), attribute and descriptor matching.
//! - [`batch`]: batched execution (local counters, flushes, hot keys).
//! - [`call_trace`]: which checks a coalesced store call served, for traces.
//! - [`overrides`]: per-client overrides of a rule's limit, as agents follow them.
//! - [`reserve`]: the agent's reservations (reserve, then commit what was used).
//! - [`cache`]: the rejection cache (a rejected key answered locally until it could pass).
//! - [`guard`]: circuit breaker, limit/N fallback with its write-back ledger, membership (N).
//! - [`ledger`]: the opt-in decision ledger, and the checker that judges a run's ledgers.
//! - [`dryrun`]: log mode's would-be rejections, counted, logged and reported.
//! - [`events`]: the rejection events' bounded queue (the writer is the Redis store's).
//! - [`metrics`]: counters and histograms recorded through the `metrics` facade.
//! - [`tasks`]: shutdown helpers for background tasks.
//! - [`admission`]: a listener's connection cap and each peer's share of it (every listener's).
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use floodgate_core::{engine::{Answer, Engine, Store}, rules::RuleSet, store::MemoryStore};
//! use floodgate_protocol::{Check, Item};
//!
//! let rules = RuleSet::parse(r#"{"rules":[{"id":"api","dimension":"user","limit":2,"windowSeconds":60}]}"#).unwrap();
//! let engine = Engine::new(rules, Store::Memory(Arc::new(MemoryStore::default())));
//! let check = || Check::Items(vec![Item::new("user:1", "api", 1)]);
//! for expected in [true, true, false] {
//!     let Answer::Ready(Ok(d)) = engine.check(check()) else { panic!("the embedded store answers at once") };
//!     assert_eq!(d.combined.allowed, expected);
//! }
//! ```

pub mod admission;
pub mod algo;
pub mod batch;
pub mod cache;
pub mod call_trace;
pub mod dryrun;
pub mod engine;
pub mod events;
pub mod guard;
pub mod ledger;
pub mod metrics;
pub mod overrides;
pub mod reserve;
pub mod rules;
pub mod shared_store;
pub mod store;
pub mod tasks;
