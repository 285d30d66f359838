//! The rules service's durable store: SQLite (one file, the embedded default) or PostgreSQL (a URL),
//! one schema with numbered migrations, every write a transaction that bumps the global version and
//! the rule's version and appends to the audit.

use std::sync::Once;

use sqlx::any::AnyPoolOptions;
use sqlx::AnyPool;
use sqlx::Row;

use floodgate_core::rules::{Rule, RuleSet};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreOpError {
    /// The database failed or could not be reached.
    #[error("rules store: {0}")]
    Db(#[from] sqlx::Error),
    /// A stored rule could not be read back (a bug or a hand-edited row).
    #[error("rules store holds an unreadable rule {id}: {why}")]
    Corrupt {
        /// The rule.
        id: String,
        /// Why.
        why: String,
    },
    /// `If-Match` named another version than the stored one (0: the rule does not exist).
    #[error("rule {id} is at version {current}, not {expected}")]
    Conflict {
        /// The rule.
        id: String,
        /// The version the caller expected.
        expected: u64,
        /// The version stored.
        current: u64,
    },
    /// No such rule.
    #[error("no rule {0}")]
    NotFound(String),
    /// An override that its rule refuses (a window for a rule without one, …).
    #[error("invalid override: {0}")]
    InvalidOverride(String),
    /// The rule is valid alone but the set with it is not (two rules answering one Envoy
    /// descriptor): agents would refuse the whole set, so the write is refused instead.
    #[error("the rule set would be invalid: {0}")]
    InvalidSet(String),
}

/// One audit record: who changed which rule when, from what to what.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    /// The global version the change made.
    pub version: u64,
    /// Unix ms.
    pub at: u64,
    /// Who (the token's name, or `local`).
    pub actor: String,
    /// The rule.
    pub rule_id: String,
    /// `put` or `delete`.
    pub action: String,
    /// The rule before (JSON), if any.
    pub old: Option<String>,
    /// The rule after (JSON), if any.
    pub new: Option<String>,
}

/// Schema migrations, applied in order; each one's statements run in one transaction. SQL common to
/// SQLite and PostgreSQL (TEXT, BIGINT, ON CONFLICT, RETURNING).
const MIGRATIONS: &[&[&str]] = &[
    &[
        "CREATE TABLE IF NOT EXISTS floodgate_rules (id TEXT PRIMARY KEY, version BIGINT NOT NULL, \
         body TEXT NOT NULL, updated_at BIGINT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS floodgate_audit (version BIGINT PRIMARY KEY, at BIGINT NOT NULL, \
         actor TEXT NOT NULL, rule_id TEXT NOT NULL, action TEXT NOT NULL, old TEXT, new TEXT)",
        "INSERT INTO floodgate_meta (name, value) VALUES ('version', 0) ON CONFLICT (name) DO NOTHING",
    ],
    // Per-client overrides: their own version counter (agents follow their changes, not the rule
    // set's), a deleted one kept as a row without a body (a change agents must hear of).
    &[
        "CREATE TABLE IF NOT EXISTS floodgate_overrides (rule_id TEXT NOT NULL, client_key TEXT NOT NULL, \
         version BIGINT NOT NULL, body TEXT, updated_at BIGINT NOT NULL, PRIMARY KEY (rule_id, client_key))",
        "CREATE INDEX IF NOT EXISTS floodgate_overrides_by_version ON floodgate_overrides (version)",
        "CREATE TABLE IF NOT EXISTS floodgate_override_audit (version BIGINT PRIMARY KEY, at BIGINT NOT NULL, \
         actor TEXT NOT NULL, rule_id TEXT NOT NULL, client_key TEXT NOT NULL, action TEXT NOT NULL, \
         old TEXT, new TEXT)",
        "INSERT INTO floodgate_meta (name, value) VALUES ('overrides', 0) ON CONFLICT (name) DO NOTHING",
    ],
];

/// The store.
#[derive(Clone)]
pub struct RulesStore {
    pub(crate) pool: AnyPool,
    url: String,
    postgres: bool,
}

/// The advisory lock two services migrating one PostgreSQL database take in turn ("FLOODGTE").
const MIGRATION_LOCK: i64 = 0x464c_4f4f_4447_5445;

pub(crate) fn now_ms() -> u64 {
    floodgate_core::store::Clock::System.now_ms()
}

impl RulesStore {
    /// Opens (and creates, for SQLite) the store at `url` — `sqlite://path` or `postgres://…` — and
    /// applies the migrations it lacks.
    pub async fn open(url: &str) -> Result<Self, StoreOpError> {
        static DRIVERS: Once = Once::new();
        DRIVERS.call_once(sqlx::any::install_default_drivers);
        let connect = if url.starts_with("sqlite:") && !url.contains('?') {
            format!("{url}?mode=rwc")
        } else {
            url.to_string()
        };
        // SQLite allows one writer at a time; one connection avoids lock waits between our own.
        let max = if url.starts_with("sqlite:") { 1 } else { 8 };
        let pool = AnyPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(std::time::Duration::from_secs(5))
            .connect(&connect)
            .await?;
        let store = RulesStore {
            pool,
            url: floodgate_core::store::redact(url),
            postgres: url.starts_with("postgres"),
        };
        store.migrate().await?;
        Ok(store)
    }

    /// The URL without its password, for logs.
    pub fn describe(&self) -> &str {
        &self.url
    }

    /// Applies the migrations the database lacks, all in one transaction. On PostgreSQL an advisory
    /// lock comes first: two services creating the tables of a fresh database at once would otherwise
    /// collide in the catalog (`CREATE TABLE IF NOT EXISTS` is not safe against a concurrent one).
    async fn migrate(&self) -> Result<(), StoreOpError> {
        let mut tx = self.pool.begin().await?;
        if self.postgres {
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(MIGRATION_LOCK)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS floodgate_meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO floodgate_meta (name, value) VALUES ('schema', 0) ON CONFLICT (name) DO NOTHING",
        )
        .execute(&mut *tx)
        .await?;
        // Taking the row's write lock also serializes two services migrating one SQLite file.
        let schema: i64 =
            sqlx::query("UPDATE floodgate_meta SET value = value WHERE name = 'schema' RETURNING value")
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
        for (i, statements) in MIGRATIONS.iter().enumerate() {
            let target = i as i64 + 1;
            if schema >= target {
                continue;
            }
            // Each a `&'static str`: sqlx takes only those (or audited strings) as SQL.
            for &s in statements.iter() {
                sqlx::query(s).execute(&mut *tx).await?;
            }
            sqlx::query("UPDATE floodgate_meta SET value = $1 WHERE name = 'schema'")
                .bind(target)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The global version.
    pub async fn version(&self) -> Result<u64, StoreOpError> {
        let v: i64 = sqlx::query("SELECT value FROM floodgate_meta WHERE name = 'version'")
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        Ok(v as u64)
    }

    /// Every rule and the global version they are at, read in one transaction.
    pub async fn snapshot(&self) -> Result<(u64, Vec<Rule>), StoreOpError> {
        let mut tx = self.pool.begin().await?;
        if self.postgres {
            // One snapshot for both reads (PostgreSQL's default would let a write land between them;
            // SQLite's transactions are serializable already).
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *tx)
                .await?;
        }
        let version: i64 = sqlx::query("SELECT value FROM floodgate_meta WHERE name = 'version'")
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
        let rules = all_rules(&mut tx).await?;
        tx.commit().await?;
        Ok((version as u64, rules))
    }

    /// One rule.
    pub async fn get(&self, id: &str) -> Result<Option<Rule>, StoreOpError> {
        let row = sqlx::query("SELECT id, version, body, updated_at FROM floodgate_rules WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(row_rule).transpose()
    }

    /// Writes a rule (creating or replacing it) if `if_match` is none or its current version (0: it
    /// must not exist yet). Returns the rule as stored (with its new version), the new global version
    /// and whether the rule is new. A rule's version is the global version of its last write, so it
    /// never repeats, even across a delete and a re-create (an old `If-Match` cannot match again).
    pub async fn put(
        &self,
        rule: &Rule,
        if_match: Option<u64>,
        actor: &str,
    ) -> Result<(Rule, u64, bool), StoreOpError> {
        let (mut tx, global, old) = self.begin_write(&rule.id).await?;
        let current = old.as_ref().map_or(0, |r| r.version);
        if let Some(expected) = if_match {
            if expected != current {
                tx.rollback().await?;
                return Err(StoreOpError::Conflict {
                    id: rule.id.clone(),
                    expected,
                    current,
                });
            }
        }
        let mut stored = rule.clone();
        stored.version = global as u64;
        stored.updated_at = now_ms();
        // The whole set with this rule, validated inside the transaction that holds the version
        // row's lock: concurrent writes are serialized there, so two PUTs that are each valid
        // against the set they read can no longer both land and leave a set every agent refuses.
        let mut rules = all_rules(&mut tx).await?;
        rules.retain(|r| r.id != stored.id);
        rules.push(stored.clone());
        if let Err(e) = RuleSet::new(rules) {
            tx.rollback().await?;
            return Err(StoreOpError::InvalidSet(e.to_string()));
        }
        let body = body_json(&stored);
        sqlx::query(
            "INSERT INTO floodgate_rules (id, version, body, updated_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (id) DO UPDATE SET version = excluded.version, body = excluded.body, \
             updated_at = excluded.updated_at",
        )
        .bind(&stored.id)
        .bind(stored.version as i64)
        .bind(&body)
        .bind(stored.updated_at as i64)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            global,
            actor,
            &stored.id,
            "put",
            old.as_ref().map(body_json),
            Some(body),
        )
        .await?;
        tx.commit().await?;
        Ok((stored, global as u64, old.is_none()))
    }

    /// Starts a write: a transaction holding the version row's lock (which serializes writers:
    /// PostgreSQL's row lock, SQLite's write lock), the global version this write makes, and the rule
    /// as stored before it.
    async fn begin_write(
        &self,
        id: &str,
    ) -> Result<(sqlx::Transaction<'static, sqlx::Any>, i64, Option<Rule>), StoreOpError> {
        let mut tx = self.pool.begin().await?;
        let global: i64 =
            sqlx::query("UPDATE floodgate_meta SET value = value + 1 WHERE name = 'version' RETURNING value")
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
        let old = sqlx::query("SELECT id, version, body, updated_at FROM floodgate_rules WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let old = old.as_ref().map(row_rule).transpose()?;
        Ok((tx, global, old))
    }

    /// Deletes a rule if `if_match` is none or its current version. Returns the new global version.
    pub async fn delete(&self, id: &str, if_match: Option<u64>, actor: &str) -> Result<u64, StoreOpError> {
        let (mut tx, global, old) = self.begin_write(id).await?;
        let Some(old) = old else {
            tx.rollback().await?;
            return Err(StoreOpError::NotFound(id.into()));
        };
        if let Some(expected) = if_match {
            if expected != old.version {
                tx.rollback().await?;
                return Err(StoreOpError::Conflict {
                    id: id.into(),
                    expected,
                    current: old.version,
                });
            }
        }
        sqlx::query("DELETE FROM floodgate_rules WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        audit(&mut tx, global, actor, id, "delete", Some(body_json(&old)), None).await?;
        tx.commit().await?;
        Ok(global as u64)
    }

    /// The newest audit records first, at most `limit`.
    pub async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreOpError> {
        let rows = sqlx::query(
            "SELECT version, at, actor, rule_id, action, old, new FROM floodgate_audit ORDER BY version DESC LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditEntry {
                    version: r.try_get::<i64, _>(0)? as u64,
                    at: r.try_get::<i64, _>(1)? as u64,
                    actor: r.try_get(2)?,
                    rule_id: r.try_get(3)?,
                    action: r.try_get(4)?,
                    old: r.try_get(5)?,
                    new: r.try_get(6)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreOpError::from)
    }
}

async fn audit(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    version: i64,
    actor: &str,
    rule_id: &str,
    action: &str,
    old: Option<String>,
    new: Option<String>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO floodgate_audit (version, at, actor, rule_id, action, old, new) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(version)
    .bind(now_ms() as i64)
    .bind(actor)
    .bind(rule_id)
    .bind(action)
    .bind(old)
    .bind(new)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Every stored rule, read within `tx`.
async fn all_rules(tx: &mut sqlx::Transaction<'static, sqlx::Any>) -> Result<Vec<Rule>, StoreOpError> {
    let rows = sqlx::query("SELECT id, version, body, updated_at FROM floodgate_rules ORDER BY id")
        .fetch_all(&mut **tx)
        .await?;
    rows.iter().map(row_rule).collect()
}

fn body_json(rule: &Rule) -> String {
    serde_json::to_string(rule).unwrap_or_default()
}

pub(crate) fn row_rule(row: &sqlx::any::AnyRow) -> Result<Rule, StoreOpError> {
    let id: String = row.try_get(0)?;
    let version: i64 = row.try_get(1)?;
    let body: String = row.try_get(2)?;
    let updated_at: i64 = row.try_get(3)?;
    let mut rule: Rule = serde_json::from_str(&body).map_err(|e| StoreOpError::Corrupt {
        id: id.clone(),
        why: e.to_string(),
    })?;
    rule.version = version as u64;
    rule.updated_at = updated_at as u64;
    Ok(rule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_core::rules::fields::rule_from_body;

    fn rule(id: &str, limit: u64) -> Rule {
        rule_from_body(
            id,
            format!(r#"{{"dimension":"user","limit":{limit},"windowSeconds":60}}"#).as_bytes(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn sqlite_versions_conflicts_and_audit() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("rules.db").display());
        let store = RulesStore::open(&url).await.unwrap();
        assert_eq!(store.version().await.unwrap(), 0);
        let (a1, g1, created) = store.put(&rule("a", 10), None, "ops").await.unwrap();
        assert_eq!((a1.version, g1, created), (1, 1, true));
        let (_, g2, _) = store.put(&rule("b", 5), Some(0), "ops").await.unwrap();
        assert_eq!(g2, 2);
        let err = store.put(&rule("a", 20), Some(7), "ops").await.unwrap_err();
        assert!(matches!(err, StoreOpError::Conflict { current: 1, .. }), "{err}");
        let (a2, g3, created) = store.put(&rule("a", 20), Some(1), "ops").await.unwrap();
        // The rule's version is the global version of its write (the refused write's bump rolled back).
        assert_eq!((a2.version, g3, created), (3, 3, false));
        assert_eq!(store.get("a").await.unwrap().unwrap().limit.get(), 20);
        store.delete("b", None, "ops").await.unwrap();
        assert!(matches!(
            store.delete("b", None, "ops").await,
            Err(StoreOpError::NotFound(_))
        ));
        let (v, rules) = store.snapshot().await.unwrap();
        assert_eq!(rules.len(), 1);
        // Four writes made it; the refused ones were rolled back with their version bump.
        assert_eq!(v, 4);
        let audit = store.audit(10).await.unwrap();
        assert_eq!(audit.len(), 4);
        assert_eq!(audit[0].action, "delete");
        assert!(audit[1].old.as_deref().unwrap().contains("\"limit\":10"));
        // Deleted and created again: a new version, not 1 again, so b's old version 2 cannot match.
        let (b, g5, created) = store.put(&rule("b", 7), Some(0), "ops").await.unwrap();
        assert_eq!((b.version, g5, created), (5, 5, true));
        let err = store.put(&rule("b", 8), Some(2), "ops").await.unwrap_err();
        assert!(matches!(err, StoreOpError::Conflict { current: 5, .. }), "{err}");
        // Reopening runs no migration twice and keeps everything.
        drop(store);
        let again = RulesStore::open(&url).await.unwrap();
        assert_eq!(again.snapshot().await.unwrap().1.len(), 2);
    }
}
