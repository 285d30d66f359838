//! The rules store's per-client overrides: written, deleted (a row without a body, so that agents
//! following the changes hear of it), listed by rule with paging, and their changes since a version.
//! Every write is a transaction that bumps the overrides version and appends to their audit.

use floodgate_core::overrides::{Override, OverrideChange, Penalty, PENALTY_RULE};
use sqlx::Row;

use crate::store::{now_ms, row_rule, RulesStore, StoreOpError};

/// One override audit record.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OverrideAudit {
    /// The overrides version the change made.
    pub version: u64,
    /// Unix ms.
    pub at: u64,
    /// Who.
    pub actor: String,
    /// The rule.
    pub rule_id: String,
    /// The client key.
    pub client_key: String,
    /// `put` or `delete`.
    pub action: String,
    /// Before (JSON), if any.
    pub old: Option<String>,
    /// After (JSON), if any.
    pub new: Option<String>,
}

type Tx = sqlx::Transaction<'static, sqlx::Any>;

impl RulesStore {
    /// The overrides version: the last change's.
    pub async fn overrides_version(&self) -> Result<u64, StoreOpError> {
        let v: i64 = sqlx::query("SELECT value FROM floodgate_meta WHERE name = 'overrides'")
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?;
        Ok(v as u64)
    }

    /// Starts an override's write: the transaction (holding the counter's lock), the version it
    /// makes, and the override as stored before (none: absent or deleted).
    async fn begin_override(
        &self,
        rule_id: &str,
        key: &str,
    ) -> Result<(Tx, i64, Option<Override>), StoreOpError> {
        let mut tx = self.pool.begin().await?;
        let version = bump(&mut tx).await?;
        let old = read_body(&mut tx, rule_id, key)
            .await?
            .map(|b| parse(rule_id, &b))
            .transpose()?;
        Ok((tx, version, old))
    }

    /// Writes `key`'s override of rule `rule_id` if `if_match` is none or its current version (0:
    /// it must not exist). Checked against the rule as stored now, in the same transaction. Returns
    /// it as stored and whether it is new.
    pub async fn put_override(
        &self,
        rule_id: &str,
        key: &str,
        value: &Override,
        if_match: Option<u64>,
        actor: &str,
    ) -> Result<(Override, bool), StoreOpError> {
        let (mut tx, version, old) = self.begin_override(rule_id, key).await?;
        let rule = sqlx::query("SELECT id, version, body, updated_at FROM floodgate_rules WHERE id = $1")
            .bind(rule_id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(rule) = rule.as_ref().map(row_rule).transpose()? else {
            tx.rollback().await?;
            return Err(StoreOpError::NotFound(rule_id.into()));
        };
        if let Err(e) = value.check(&rule) {
            tx.rollback().await?;
            return Err(StoreOpError::InvalidOverride(e));
        }
        conflict(rule_id, key, old.as_ref(), if_match)?;
        let mut stored = value.clone();
        stored.version = version as u64;
        stored.updated_at = now_ms();
        let body = serde_json::to_string(&stored).unwrap_or_default();
        write_row(&mut tx, rule_id, key, version, Some(&body)).await?;
        let old_body = old.as_ref().map(|o| serde_json::to_string(o).unwrap_or_default());
        audit(&mut tx, version, actor, rule_id, key, "put", old_body, Some(body)).await?;
        tx.commit().await?;
        Ok((stored, old.is_none()))
    }

    /// Deletes `key`'s override of `rule_id` (if `if_match` is none or its version): a row without a
    /// body is kept, as the change agents follow. Returns the overrides version it made.
    pub async fn delete_override(
        &self,
        rule_id: &str,
        key: &str,
        if_match: Option<u64>,
        actor: &str,
    ) -> Result<u64, StoreOpError> {
        let (mut tx, version, old) = self.begin_override(rule_id, key).await?;
        let Some(old) = old else {
            tx.rollback().await?;
            return Err(StoreOpError::NotFound(format!("{rule_id} override of {key}")));
        };
        conflict(rule_id, key, Some(&old), if_match)?;
        write_row(&mut tx, rule_id, key, version, None).await?;
        let old_body = serde_json::to_string(&old).unwrap_or_default();
        audit(
            &mut tx,
            version,
            actor,
            rule_id,
            key,
            "delete",
            Some(old_body),
            None,
        )
        .await?;
        tx.commit().await?;
        Ok(version as u64)
    }

    /// `key`'s override of `rule_id`, if one is set.
    pub async fn get_override(&self, rule_id: &str, key: &str) -> Result<Option<Override>, StoreOpError> {
        let row = sqlx::query("SELECT body FROM floodgate_overrides WHERE rule_id = $1 AND client_key = $2")
            .bind(rule_id)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(r) => r
                .try_get::<Option<String>, _>(0)?
                .map(|b| parse(rule_id, &b))
                .transpose(),
            None => Ok(None),
        }
    }

    /// Up to `limit` overrides of `rule_id` whose client key sorts after `after`, in key order.
    pub async fn list_overrides(
        &self,
        rule_id: &str,
        after: &str,
        limit: u32,
    ) -> Result<Vec<(String, Override)>, StoreOpError> {
        let rows = sqlx::query(
            "SELECT client_key, body FROM floodgate_overrides WHERE rule_id = $1 AND client_key > $2 \
             AND body IS NOT NULL ORDER BY client_key LIMIT $3",
        )
        .bind(rule_id)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let key: String = r.try_get(0)?;
                let body: String = r.try_get(1)?;
                Ok((key, parse(rule_id, &body)?))
            })
            .collect()
    }

    /// The changes after version `since`, oldest first, at most `limit`, and the overrides version.
    pub async fn override_changes(
        &self,
        since: u64,
        limit: u32,
    ) -> Result<(Vec<OverrideChange>, u64), StoreOpError> {
        let mut tx = self.pool.begin().await?;
        let current: i64 = sqlx::query("SELECT value FROM floodgate_meta WHERE name = 'overrides'")
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
        let rows = sqlx::query(
            "SELECT rule_id, client_key, version, body FROM floodgate_overrides WHERE version > $1 \
             ORDER BY version LIMIT $2",
        )
        .bind(since as i64)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let changes = rows
            .iter()
            .map(|r| {
                let rule_id: String = r.try_get(0)?;
                let body: Option<String> = r.try_get(3)?;
                let (set, penalty) = match (rule_id == PENALTY_RULE, body) {
                    (true, Some(b)) => (None, Some(parse_penalty(&b)?)),
                    (false, Some(b)) => (Some(parse(&rule_id, &b)?), None),
                    (_, None) => (None, None),
                };
                Ok(OverrideChange {
                    client_key: r.try_get(1)?,
                    version: r.try_get::<i64, _>(2)? as u64,
                    set,
                    penalty,
                    rule_id,
                })
            })
            .collect::<Result<Vec<_>, StoreOpError>>()?;
        Ok((changes, current as u64))
    }

    /// Sets a penalty on `key` (replacing its penalty if it has one). Returns it as stored and
    /// whether it is new.
    pub async fn put_penalty(
        &self,
        key: &str,
        value: &Penalty,
        actor: &str,
    ) -> Result<(Penalty, bool), StoreOpError> {
        if let Err(e) = value.check(now_ms()) {
            return Err(StoreOpError::InvalidOverride(e));
        }
        let mut tx = self.pool.begin().await?;
        let version = bump(&mut tx).await?;
        let old = read_body(&mut tx, PENALTY_RULE, key).await?;
        let mut stored = value.clone();
        stored.version = version as u64;
        stored.updated_at = now_ms();
        let body = serde_json::to_string(&stored).unwrap_or_default();
        write_row(&mut tx, PENALTY_RULE, key, version, Some(&body)).await?;
        let created = old.is_none();
        audit(
            &mut tx,
            version,
            actor,
            PENALTY_RULE,
            key,
            "penalize",
            old,
            Some(body),
        )
        .await?;
        tx.commit().await?;
        Ok((stored, created))
    }

    /// Lifts `key`'s penalty (a row without a body stays, as the change agents follow).
    pub async fn delete_penalty(&self, key: &str, actor: &str) -> Result<u64, StoreOpError> {
        let mut tx = self.pool.begin().await?;
        let version = bump(&mut tx).await?;
        let old = read_body(&mut tx, PENALTY_RULE, key).await?;
        let Some(old) = old else {
            return Err(StoreOpError::NotFound(format!("penalty of {key}")));
        };
        write_row(&mut tx, PENALTY_RULE, key, version, None).await?;
        audit(
            &mut tx,
            version,
            actor,
            PENALTY_RULE,
            key,
            "lift",
            Some(old),
            None,
        )
        .await?;
        tx.commit().await?;
        Ok(version as u64)
    }

    /// `key`'s penalty, if one is set (ended or not).
    pub async fn get_penalty(&self, key: &str) -> Result<Option<Penalty>, StoreOpError> {
        let row = sqlx::query("SELECT body FROM floodgate_overrides WHERE rule_id = $1 AND client_key = $2")
            .bind(PENALTY_RULE)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(r) => r
                .try_get::<Option<String>, _>(0)?
                .map(|b| parse_penalty(&b))
                .transpose(),
            None => Ok(None),
        }
    }

    /// Up to `limit` penalties that have not ended at `now_ms`, their keys after `after`.
    pub async fn list_penalties(
        &self,
        after: &str,
        limit: u32,
        now_ms: u64,
    ) -> Result<Vec<(String, Penalty)>, StoreOpError> {
        let rows = sqlx::query(
            "SELECT client_key, body FROM floodgate_overrides WHERE rule_id = $1 AND client_key > $2 \
             AND body IS NOT NULL ORDER BY client_key",
        )
        .bind(PENALTY_RULE)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::new();
        for r in &rows {
            let body: String = r.try_get(1)?;
            let p = parse_penalty(&body)?;
            if p.until > now_ms {
                out.push((r.try_get(0)?, p));
                if out.len() == limit as usize {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// The newest override audit records first, at most `limit`.
    pub async fn override_audit(&self, limit: u32) -> Result<Vec<OverrideAudit>, StoreOpError> {
        let rows = sqlx::query(
            "SELECT version, at, actor, rule_id, client_key, action, old, new FROM floodgate_override_audit \
             ORDER BY version DESC LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(OverrideAudit {
                    version: r.try_get::<i64, _>(0)? as u64,
                    at: r.try_get::<i64, _>(1)? as u64,
                    actor: r.try_get(2)?,
                    rule_id: r.try_get(3)?,
                    client_key: r.try_get(4)?,
                    action: r.try_get(5)?,
                    old: r.try_get(6)?,
                    new: r.try_get(7)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreOpError::from)
    }
}

/// Refuses the write unless `if_match` is none or the stored version (0: none); the caller's
/// transaction, dropped uncommitted, rolls back.
fn conflict(
    rule_id: &str,
    key: &str,
    old: Option<&Override>,
    if_match: Option<u64>,
) -> Result<(), StoreOpError> {
    let current = old.map_or(0, |o| o.version);
    match if_match {
        Some(expected) if expected != current => Err(StoreOpError::Conflict {
            id: format!("{rule_id} override of {key}"),
            expected,
            current,
        }),
        _ => Ok(()),
    }
}

fn parse_penalty(body: &str) -> Result<Penalty, StoreOpError> {
    serde_json::from_str(body).map_err(|e| StoreOpError::Corrupt {
        id: PENALTY_RULE.into(),
        why: e.to_string(),
    })
}

/// A row's body within `tx` (none: no row, or a deleted one).
async fn read_body(tx: &mut Tx, rule_id: &str, key: &str) -> Result<Option<String>, StoreOpError> {
    Ok(
        sqlx::query("SELECT body FROM floodgate_overrides WHERE rule_id = $1 AND client_key = $2")
            .bind(rule_id)
            .bind(key)
            .fetch_optional(&mut **tx)
            .await?
            .map(|r| r.try_get::<Option<String>, _>(0))
            .transpose()?
            .flatten(),
    )
}

/// Writes a row within `tx`: its body, or none (deleted: the row stays, a change agents follow).
async fn write_row(
    tx: &mut Tx,
    rule_id: &str,
    key: &str,
    version: i64,
    body: Option<&str>,
) -> Result<(), StoreOpError> {
    sqlx::query(
        "INSERT INTO floodgate_overrides (rule_id, client_key, version, body, updated_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (rule_id, client_key) DO UPDATE SET \
         version = excluded.version, body = excluded.body, updated_at = excluded.updated_at",
    )
    .bind(rule_id)
    .bind(key)
    .bind(version)
    .bind(body)
    .bind(now_ms() as i64)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Bumps the overrides version within `tx` (taking the counter's lock, which serializes writers):
/// the version this write makes.
async fn bump(tx: &mut Tx) -> Result<i64, StoreOpError> {
    Ok(
        sqlx::query("UPDATE floodgate_meta SET value = value + 1 WHERE name = 'overrides' RETURNING value")
            .fetch_one(&mut **tx)
            .await?
            .try_get(0)?,
    )
}

fn parse(rule_id: &str, body: &str) -> Result<Override, StoreOpError> {
    serde_json::from_str(body).map_err(|e| StoreOpError::Corrupt {
        id: rule_id.into(),
        why: e.to_string(),
    })
}

#[allow(clippy::too_many_arguments)]
async fn audit(
    tx: &mut Tx,
    version: i64,
    actor: &str,
    rule_id: &str,
    key: &str,
    action: &str,
    old: Option<String>,
    new: Option<String>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO floodgate_override_audit (version, at, actor, rule_id, client_key, action, old, new) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(version)
    .bind(now_ms() as i64)
    .bind(actor)
    .bind(rule_id)
    .bind(key)
    .bind(action)
    .bind(old)
    .bind(new)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
