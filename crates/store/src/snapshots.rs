//! Snapshot records. Every read and delete names the owning account, so one
//! account never sees another's snapshots.

use crate::row::{self, snapshot_columns};
use crate::sandboxes::already_exists;
use crate::{on_reader, on_writer, Result, SnapshotRow, Store};

const INSERT: &str =
    "INSERT INTO snapshots (id, account_id, sandbox_id, template, size_bytes, host, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)";
const GET: &str = concat!(
    "SELECT ",
    snapshot_columns!(),
    " FROM snapshots WHERE id = $1 AND account_id = $2"
);
const LIST: &str = concat!(
    "SELECT ",
    snapshot_columns!(),
    " FROM snapshots WHERE account_id = $1 ORDER BY created_at DESC, id"
);
const DELETE: &str = "DELETE FROM snapshots WHERE id = $1 AND account_id = $2";

impl Store {
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

    /// Deletes the record if `account_id` owns it; false if there was none.
    pub async fn delete_snapshot(&self, account_id: i64, id: &str) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(DELETE).bind(id).bind(account_id).execute(pool).await?.rows_affected()
        });
        Ok(affected > 0)
    }
}
