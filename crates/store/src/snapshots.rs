//! Snapshot records and their quota. Every read and delete names the owning
//! account, so one account never sees another's snapshots.
//!
//! A snapshot is recorded under the same account lock as a sandbox
//! admission (see `sandboxes.rs`), so the count and byte quotas
//! ([`SnapshotLimits`]) hold under concurrent snapshots of one account.

use crate::row::{self, snapshot_columns, Column};
use crate::sandboxes::{admission_lock, already_exists};
use crate::{
    on_reader, on_writer, Account, Result, SnapshotLimits, SnapshotRow, Store, StoreError,
};

const INSERT: &str =
    "INSERT INTO snapshots (id, account_id, sandbox_id, template, size_bytes, host, created_at, \
     vcpus, memory_mib) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";
const GET: &str = concat!(
    "SELECT ",
    snapshot_columns!(),
    " FROM snapshots WHERE id = $1 AND account_id = $2 AND removal_requested_at IS NULL"
);
const LIST: &str = concat!(
    "SELECT ",
    snapshot_columns!(),
    " FROM snapshots WHERE account_id = $1 AND removal_requested_at IS NULL \
     ORDER BY created_at DESC, id"
);
const LIST_ALL: &str = concat!(
    "SELECT ",
    snapshot_columns!(),
    ", removal_requested_at FROM snapshots ORDER BY created_at DESC, id"
);
const REQUEST_REMOVAL: &str = "UPDATE snapshots SET removal_requested_at = $2 \
     WHERE id = $1 AND removal_requested_at IS NULL";
const TO_REMOVE: &str = concat!(
    "SELECT ",
    snapshot_columns!(),
    " FROM snapshots WHERE removal_requested_at IS NOT NULL AND (host = $1 OR host IS NULL) \
     ORDER BY id"
);
const DELETE: &str = "DELETE FROM snapshots WHERE id = $1 AND account_id = $2";
const COUNTS: &str =
    "SELECT COUNT(*) AS snapshots, CAST(COALESCE(SUM(size_bytes), 0) AS BIGINT) AS total_bytes \
     FROM snapshots WHERE account_id = $1";

/// "1 snapshot", "10 snapshots".
fn snapshots_word(count: u32) -> String {
    if count == 1 {
        "1 snapshot".into()
    } else {
        format!("{count} snapshots")
    }
}

/// Whether an account holding `count` snapshots of `total` bytes may add
/// one of `adding` bytes.
fn within(
    account: &Account,
    limits: &SnapshotLimits,
    count: i64,
    total: i64,
    adding: i64,
) -> Result<()> {
    let tier = account.tier;
    if count >= i64::from(limits.count) {
        return Err(StoreError::Quota {
            message: format!(
                "{tier} tier allows {}; delete one to take another",
                snapshots_word(limits.count)
            ),
        });
    }
    let allowed = row::signed(limits.total_bytes);
    if total.saturating_add(adding.max(0)) > allowed {
        return Err(StoreError::Quota {
            message: format!(
                "{tier} tier allows {} MiB of snapshots in all ({} MiB in use)",
                limits.total_bytes >> 20,
                total.max(0) >> 20
            ),
        });
    }
    Ok(())
}

impl Store {
    /// Refuses with [`StoreError::Quota`] when the account already holds as
    /// many snapshots, or as many bytes of them, as `limits` allow. Not a
    /// reservation: a caller checks before the costly capture, and
    /// [`Store::record_snapshot`] checks again atomically.
    pub async fn check_snapshot_quota(
        &self,
        account: &Account,
        limits: &SnapshotLimits,
    ) -> Result<()> {
        let (count, total) = on_reader!(self, pool => {
            let found = sqlx::query(COUNTS).bind(account.id).fetch_one(pool).await?;
            (found.int("snapshots")?, found.int("total_bytes")?)
        });
        // Any snapshot takes at least a byte: an account at its byte limit
        // is refused before the capture.
        within(account, limits, count, total, 1)
    }

    /// Records a snapshot of `account` if its quotas allow it, atomically
    /// (the account lock of sandbox admission): [`StoreError::Quota`] past
    /// `limits`, counting the new snapshot's `size_bytes`.
    pub async fn record_snapshot(
        &self,
        account: &Account,
        snapshot: &SnapshotRow,
        limits: &SnapshotLimits,
    ) -> Result<()> {
        let (begin, lock) = admission_lock(self);
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            sqlx::query(lock).bind(account.id).fetch_optional(&mut *tx).await?;
            let found = sqlx::query(COUNTS).bind(account.id).fetch_one(&mut *tx).await?;
            within(
                account,
                limits,
                found.int("snapshots")?,
                found.int("total_bytes")?,
                snapshot.size_bytes.unwrap_or(0),
            )?;
            sqlx::query(INSERT)
                .bind(&snapshot.id)
                .bind(account.id)
                .bind(&snapshot.sandbox_id)
                .bind(&snapshot.template)
                .bind(snapshot.size_bytes)
                .bind(&snapshot.host)
                .bind(snapshot.created_at)
                .bind(snapshot.vcpus)
                .bind(snapshot.memory_mib)
                .execute(&mut *tx)
                .await
                .map_err(|e| already_exists(e, "snapshot", &snapshot.id))?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// Records a snapshot without a quota (the account's own is not
    /// checked); [`Store::record_snapshot`] is the API's way.
    pub async fn insert_snapshot(&self, snapshot: &SnapshotRow) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(INSERT)
                .bind(&snapshot.id)
                .bind(snapshot.account_id)
                .bind(&snapshot.sandbox_id)
                .bind(&snapshot.template)
                .bind(snapshot.size_bytes)
                .bind(&snapshot.host)
                .bind(snapshot.created_at)
                .bind(snapshot.vcpus)
                .bind(snapshot.memory_mib)
                .execute(pool)
                .await
                .map_err(|e| already_exists(e, "snapshot", &snapshot.id))?;
        });
        Ok(())
    }

    /// The snapshot if `account_id` owns it.
    pub async fn get_snapshot(&self, account_id: i64, id: &str) -> Result<Option<SnapshotRow>> {
        on_reader!(self, pool => {
            sqlx::query(GET)
                .bind(id)
                .bind(account_id)
                .fetch_optional(pool)
                .await?
                .map(|r| row::snapshot(&r))
                .transpose()
        })
    }

    /// The account's snapshots, newest first.
    pub async fn list_snapshots(&self, account_id: i64) -> Result<Vec<SnapshotRow>> {
        on_reader!(self, pool => {
            sqlx::query(LIST).bind(account_id).fetch_all(pool).await?.iter().map(row::snapshot).collect()
        })
    }

    /// Every account's snapshots, newest first, each with when an
    /// operator asked for its removal (if one did).
    pub async fn list_all_snapshots(&self) -> Result<Vec<(SnapshotRow, Option<f64>)>> {
        on_reader!(self, pool => {
            sqlx::query(LIST_ALL)
                .fetch_all(pool)
                .await?
                .iter()
                .map(|r| Ok((row::snapshot(r)?, r.opt_real("removal_requested_at")?)))
                .collect()
        })
    }

    /// An operator's removal of snapshot `id` (any account's): its account
    /// no longer sees it, and its host removes its files and then the
    /// record ([`Store::snapshots_to_remove`]). False when there is no
    /// such snapshot or its removal was asked already.
    pub async fn request_snapshot_removal(&self, id: &str, now: f64) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(REQUEST_REMOVAL).bind(id).bind(now).execute(pool).await?.rows_affected()
        });
        Ok(affected > 0)
    }

    /// The snapshots on `host` (or on no host named: a single host's)
    /// whose removal an operator asked for.
    pub async fn snapshots_to_remove(&self, host: &str) -> Result<Vec<SnapshotRow>> {
        on_reader!(self, pool => {
            sqlx::query(TO_REMOVE).bind(host).fetch_all(pool).await?.iter().map(row::snapshot).collect()
        })
    }

    /// Deletes the record if `account_id` owns it; false if there was none.
    pub async fn delete_snapshot(&self, account_id: i64, id: &str) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(DELETE).bind(id).bind(account_id).execute(pool).await?.rows_affected()
        });
        Ok(affected > 0)
    }
}
