//! The Floodgate agent: a per-host daemon that answers "may this request pass?" over a Unix socket
//! (also TCP and Envoy's gRPC), deciding with the core's engine over Redis (`floodgate-redis`) or its
//! embedded in-memory store; and the `floodgate` binary's commands.
//!
//! # Map
//! - [`daemon`]: the agent run until shutdown: store, guard, engine, rules source, listeners, loops.
//! - [`config`]: the agent's flags and environment variables.
//! - [`settings`]: the config file (TOML keys onto the flags), its generated table, reloads.
//! - [`server`]: the socket and TCP listeners (safe binding, pipelined connections, connection cap).
//! - [`envoy`]: Envoy's RateLimitService over gRPC, answered by the engine.
//! - [`admin`]: the admin HTTP router (health, readiness, status, dry runs, `/metrics`).
//! - [`exporter`]: the Prometheus exporter and the gauges read at scrape time.
//! - [`follow`]: following a rules service (pull, watch, the last good set cached on disk).
//! - [`cli`]: `floodgate rules …`, the operators' command line for the rules API.
//! - [`ops`]: `floodgate check` and `floodgate status`, the operators' look at a running agent.
//!
//! The engine, rules and algorithms are `floodgate-core`'s; the rules service is
//! `floodgate-rules-service`'s.

pub mod admin;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod envoy;
pub mod exporter;
pub mod follow;
pub mod ops;
pub mod server;
pub mod settings;

pub use daemon::{run, run_with_reloads, Reload};
