//! The Floodgate agent: a per-host daemon that answers "may this request pass?" over a Unix socket
//! (also TCP and Envoy's gRPC), deciding with the core's engine over Redis (`floodgate-redis`) or its
//! embedded in-memory store; and the `floodgate` binary's commands.
//!
//! # Map
//! - [`commands`]: the `floodgate` binary's commands, one file each (`agent`, `rules-server`,
//!   `rules …`, `check`, `status`, and the printed command line: completions, man, config table).
//! - [`daemon`]: the agent: built (everything made and bound), spawned, drained after shutdown.
//! - [`config`]: the agent's flags and environment variables, validated as they are parsed.
//! - [`settings`]: the config file's keys onto the flags, its generated table, what a reload changed.
//! - [`reload`]: the config file applied to the command line, and SIGHUP's reload of the agent.
//! - [`server`]: the socket and TCP listeners (safe binding, pipelined connections, connection cap).
//! - [`envoy`]: Envoy's RateLimitService over gRPC, answered by the engine.
//! - [`admin`]: the admin HTTP router (health, readiness, status, dry runs, `/metrics`).
//! - [`exporter`]: the Prometheus exporter and the gauges read at scrape time.
//! - [`follow`]: following a rules service (pull, watch, the last good set cached on disk).
//! - [`follow_overrides`]: following the per-client overrides' changes (service or embedded).
//! - [`otel`]: OpenTelemetry traces, opt-in: spans of checks and rules-API requests, OTLP export.
//!
//! The engine, rules and algorithms are `floodgate-core`'s; the rules service is
//! `floodgate-rules-service`'s.

pub mod admin;
pub mod commands;
pub mod config;
pub mod daemon;
pub mod envoy;
pub mod exporter;
pub mod follow;
pub mod follow_overrides;
pub mod otel;
pub mod reload;
pub mod server;
pub mod settings;

pub use daemon::{run, run_with_reloads};
pub use reload::Reload;
