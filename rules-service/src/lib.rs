//! Floodgate's rules service and the HTTP client that reaches it.
//!
//! # Map
//! - [`service`]: the API (`PUT/GET/DELETE /v1/rules`, watches, dry-run reports, tokens, audit).
//! - [`tokens`]: tokens and their scopes (write, read), from flags and token files.
//! - [`store`]: the rules store over SQLite or PostgreSQL (versions, migrations, the audit log).
//! - [`store_overrides`]: per-client overrides in that store (their versions, changes, audit).
//! - [`overrides`]: the overrides API (`/v1/rules/{id}/overrides/{key}`, `/v1/overrides?since=`).
//! - [`server`]: `floodgate rules-server`: the API served until shutdown, over HTTP or TLS.
//! - [`http`]: the client agents and the CLI use (reqwest over rustls), and the server's TLS settings.
//! - [`browser`]: keeping web pages out of the APIs that ask for no token (foreign Hosts,
//!   cross-site writes, form posts).
//! - [`listen`]: serving a router with a connection cap, a per-peer share and timeouts (the rules
//!   service's listener, and the agent's admin and embedded rules APIs).

pub mod browser;
pub mod http;
pub mod listen;
pub mod overrides;
pub mod server;
pub mod service;
pub mod store;
pub mod store_overrides;
pub mod tokens;

pub use server::{run, ServeOptions};
