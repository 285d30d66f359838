//! One fixture for "a Redis, a rules service and agents following both": what the propagation and
//! overrides tests each built for themselves (a SQLite-backed `floodgate rules-server` with an
//! operator token, agents on one Redis with `--rules-url` and `--rules-token`, calls to the rules
//! API, and waiting for an agent to hold a rules version).

use std::path::PathBuf;
use std::time::Duration;

use floodgate_rules_service::http::{request, Response};

use crate::{eventually, http_get, Agent, AgentBuilder, RedisServer, RulesServer};

/// The operator token the fixture's rules service accepts (registered as `ops:s3cret`).
pub const OPERATOR_TOKEN: &str = "s3cret";

/// A Redis and a rules service over a SQLite file of its own; agents are built with [`agent`].
///
/// [`agent`]: Fleet::agent
pub struct Fleet {
    /// The Redis every agent counts in.
    pub redis: RedisServer,
    /// The rules service every agent follows.
    pub rules: RulesServer,
    dir: tempfile::TempDir,
}

impl Fleet {
    /// A fresh Redis and rules service (no rules yet).
    pub async fn start() -> Fleet {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = format!("sqlite://{}", dir.path().join("rules.db").display());
        let rules = RulesServer::start(&db, &["ops:s3cret"]).await;
        Fleet {
            redis: RedisServer::start(),
            rules,
            dir,
        }
    }

    /// An agent on the fleet's Redis following its rules service (more arguments may be added).
    pub fn agent(&self) -> AgentBuilder {
        Agent::builder()
            .redis(&self.redis.url())
            .arg("--rules-url")
            .arg(&self.rules.url())
            .arg("--rules-token")
            .arg(OPERATOR_TOKEN)
    }

    /// `n` agents started as [`agent`](Self::agent) builds them.
    pub async fn agents(&self, n: usize) -> Vec<Agent> {
        let mut agents = Vec::with_capacity(n);
        for _ in 0..n {
            agents.push(self.agent().start().await);
        }
        agents
    }

    /// A path in the fixture's own temporary directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// One call to the rules API with the operator token.
    pub async fn call(&self, method: &str, path: &str, body: Option<&str>) -> Response {
        rules_call(&self.rules, method, path, body).await
    }

    /// Puts rule `id` (its JSON); answers the rule set's version after it.
    pub async fn put_rule(&self, id: &str, body: &str) -> u64 {
        let r = self.call("PUT", &format!("/v1/rules/{id}"), Some(body)).await;
        assert!(
            r.status == 200 || r.status == 201,
            "PUT /v1/rules/{id}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let set = self.call("GET", "/v1/rules", None).await;
        serde_json::from_slice::<serde_json::Value>(&set.body).expect("a rule set")["version"]
            .as_u64()
            .expect("a version")
    }
}

/// One call to `server`'s rules API with the operator token (a service started with `ops:s3cret`).
pub async fn rules_call(server: &RulesServer, method: &str, path: &str, body: Option<&str>) -> Response {
    request(
        &server.url(),
        method,
        path,
        Some(OPERATOR_TOKEN),
        &[],
        body.map(str::as_bytes),
        Duration::from_secs(10),
    )
    .await
    .expect("the rules service answers")
}

/// The rules version an agent holds (`rulesVersion` in its `/v1/status`; 0 before any).
pub async fn rules_version(a: &Agent) -> u64 {
    let (_, body) = http_get(a.admin_addr().await, "/v1/status").await;
    serde_json::from_str::<serde_json::Value>(&body)
        .map(|v| v["rulesVersion"].as_u64().unwrap_or(0))
        .unwrap_or(0)
}

/// Waits until `a` holds rules version `v` or a newer one.
pub async fn wait_rules_version(a: &Agent, v: u64) {
    eventually(
        &format!("the agent holds rules version {v}"),
        Duration::from_secs(10),
        || async { (rules_version(a).await >= v).then_some(()) },
    )
    .await;
}
