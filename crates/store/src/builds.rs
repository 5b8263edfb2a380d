//! Template builds (issue 21): their rows, their logs, and the cache that
//! lets an unchanged rebuild reuse the snapshot an earlier build made.
//! Every read names the owning account.

use crate::row::Column;
use crate::{on_reader, on_writer, Result, Store, TemplateBuildRow};

const COLUMNS: &str = "id, account_id, name, status, error, cache_key, snapshot_id, host, \
                       cache_hit, created_at, started_at, ended_at";
const INSERT: &str = "INSERT INTO template_builds \
     (id, account_id, name, status, error, cache_key, snapshot_id, host, cache_hit, created_at, started_at, ended_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";
const UPDATE: &str = "UPDATE template_builds SET status = $2, error = $3, cache_key = $4, \
     snapshot_id = $5, host = $6, cache_hit = $7, started_at = $8, ended_at = $9 WHERE id = $1";
const SET_LOG: &str = "UPDATE template_builds SET log = $2 WHERE id = $1";
const GET_LOG: &str = "SELECT log FROM template_builds WHERE account_id = $1 AND id = $2";
/// A done build's snapshot that still exists, newest first.
const CACHED: &str = "SELECT b.snapshot_id AS snapshot_id FROM template_builds b \
     JOIN snapshots s ON s.id = b.snapshot_id \
     WHERE b.account_id = $1 AND b.cache_key = $2 AND b.status = 'done' \
     ORDER BY b.ended_at DESC LIMIT 1";
/// Whether a build of the account made the snapshot.
const MADE_BY_BUILD: &str = "SELECT COUNT(*) AS n FROM template_builds \
     WHERE account_id = $1 AND snapshot_id = $2";
/// Builds a host left queued or building (it stopped mid-build).
const ABANDONED: &str = "UPDATE template_builds SET status = 'failed', \
     error = 'the host stopped during the build', ended_at = $2 \
     WHERE host = $1 AND status IN ('queued', 'building')";

/// The most builds a listing shows (newest first).
pub const BUILD_LIST_LIMIT: i64 = 100;

fn build(row: &impl Column) -> Result<TemplateBuildRow> {
    Ok(TemplateBuildRow {
        id: row.text("id")?,
        account_id: row.int("account_id")?,
        name: row.text("name")?,
        status: row.text("status")?,
        error: row.opt_text("error")?,
        cache_key: row.opt_text("cache_key")?,
        snapshot_id: row.opt_text("snapshot_id")?,
        host: row.opt_text("host")?,
        cache_hit: row.boolean("cache_hit")?,
        created_at: row.real("created_at")?,
        started_at: row.opt_real("started_at")?,
        ended_at: row.opt_real("ended_at")?,
    })
}

impl Store {
    pub async fn insert_build(&self, b: &TemplateBuildRow) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(INSERT)
                .bind(&b.id)
                .bind(b.account_id)
                .bind(&b.name)
                .bind(&b.status)
                .bind(&b.error)
                .bind(&b.cache_key)
                .bind(&b.snapshot_id)
                .bind(&b.host)
                .bind(b.cache_hit)
                .bind(b.created_at)
                .bind(b.started_at)
                .bind(b.ended_at)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    /// Writes every field of `b` but its id, account, name and creation.
    pub async fn update_build(&self, b: &TemplateBuildRow) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(UPDATE)
                .bind(&b.id)
                .bind(&b.status)
                .bind(&b.error)
                .bind(&b.cache_key)
                .bind(&b.snapshot_id)
                .bind(&b.host)
                .bind(b.cache_hit)
                .bind(b.started_at)
                .bind(b.ended_at)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    /// Replaces the build's stored log (the caller bounds it).
    pub async fn set_build_log(&self, id: &str, log: &str) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(SET_LOG).bind(id).bind(log).execute(pool).await?;
        });
        Ok(())
    }

    pub async fn get_build(&self, account_id: i64, id: &str) -> Result<Option<TemplateBuildRow>> {
        let sql =
            format!("SELECT {COLUMNS} FROM template_builds WHERE account_id = $1 AND id = $2");
        on_reader!(self, pool => {
            sqlx::query(&sql)
                .bind(account_id)
                .bind(id)
                .fetch_optional(pool)
                .await?
                .map(|r| build(&r))
                .transpose()
        })
    }

    /// The build's stored log; `None` if the account has no such build.
    pub async fn build_log(&self, account_id: i64, id: &str) -> Result<Option<String>> {
        on_reader!(self, pool => {
            sqlx::query(GET_LOG)
                .bind(account_id)
                .bind(id)
                .fetch_optional(pool)
                .await?
                .map(|r| r.text("log").map_err(Into::into))
                .transpose()
        })
    }

    /// The account's builds, newest first, at most [`BUILD_LIST_LIMIT`].
    pub async fn list_builds(&self, account_id: i64) -> Result<Vec<TemplateBuildRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM template_builds WHERE account_id = $1 \
             ORDER BY created_at DESC, id LIMIT {BUILD_LIST_LIMIT}"
        );
        on_reader!(self, pool => {
            sqlx::query(&sql).bind(account_id).fetch_all(pool).await?.iter().map(build).collect()
        })
    }

    /// The snapshot a done build of the account with this cache key made,
    /// if it still exists.
    pub async fn cached_build(&self, account_id: i64, cache_key: &str) -> Result<Option<String>> {
        on_reader!(self, pool => {
            sqlx::query(CACHED)
                .bind(account_id)
                .bind(cache_key)
                .fetch_optional(pool)
                .await?
                .map(|r| r.text("snapshot_id").map_err(Into::into))
                .transpose()
        })
    }

    /// Whether a build of the account made `snapshot_id` (so replacing its
    /// template may collect it).
    pub async fn snapshot_made_by_build(&self, account_id: i64, snapshot_id: &str) -> Result<bool> {
        on_reader!(self, pool => {
            let n = sqlx::query(MADE_BY_BUILD)
                .bind(account_id)
                .bind(snapshot_id)
                .fetch_one(pool)
                .await?
                .int("n")?;
            Ok(n > 0)
        })
    }

    /// Fails the builds `host` left unfinished (it restarted); returns how many.
    pub async fn fail_abandoned_builds(&self, host: &str, now: f64) -> Result<u64> {
        Ok(on_writer!(self, pool => {
            sqlx::query(ABANDONED).bind(host).bind(now).execute(pool).await?.rows_affected()
        }))
    }
}
