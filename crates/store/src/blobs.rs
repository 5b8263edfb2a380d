//! A job's data path (issue 22): an account's content-addressed blobs (a
//! submit directory's inputs, a task's results) kept as chunks, and the
//! output of a running task as it is printed. Every read of a blob names
//! its account.
//!
//! A blob is written under a staging name, chunk by chunk, and becomes
//! itself in [`Store::commit_blob`] once the writer has checked its digest:
//! a reader never sees half a blob, and two writers of the same content end
//! with one copy.

use sqlx::Row as _;

use crate::row::{signed, unsigned, Column};
use crate::{on_reader, on_writer, Backend, Flavoured, Result, Store};

/// The most bytes one chunk of a blob holds.
pub const BLOB_CHUNK: usize = 1 << 20;
/// Digests per `IN (...)` of [`Store::missing_blobs`].
const DIGEST_BATCH: usize = 500;

/// Serialises commits of one (account, digest) on PostgreSQL (SQLite's
/// one writer already does).
const LOCK_DIGEST: Flavoured = Flavoured {
    sqlite: "SELECT $1 AS locked",
    postgres: "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))::text AS locked",
};

/// One flush of a running task's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    pub seq: u64,
    /// `stdout` or `stderr`.
    pub stream: String,
    pub data: Vec<u8>,
}

/// The staging name of a blob being written at `now` (sortable by time,
/// so [`Store::collect_garbage`] can drop abandoned ones).
pub fn staging_key(now: f64) -> String {
    let random: u64 = rand::random();
    format!("staging:{:012}:{random:016x}", now.max(0.0) as u64)
}

impl Store {
    /// The digests of `digests` the account has no blob of.
    pub async fn missing_blobs(&self, account_id: i64, digests: &[String]) -> Result<Vec<String>> {
        let mut present = std::collections::BTreeSet::new();
        for batch in digests.chunks(DIGEST_BATCH) {
            let marks: Vec<String> = (0..batch.len()).map(|i| format!("${}", i + 2)).collect();
            let sql = format!(
                "SELECT digest FROM blobs WHERE account_id = $1 AND digest IN ({})",
                marks.join(", ")
            );
            on_reader!(self, pool => {
                let mut query = sqlx::query(&sql).bind(account_id);
                for d in batch {
                    query = query.bind(d);
                }
                for row in query.fetch_all(pool).await? {
                    present.insert(row.text("digest")?);
                }
            });
        }
        let mut missing: Vec<String> = digests
            .iter()
            .filter(|d| !present.contains(*d))
            .cloned()
            .collect();
        missing.sort();
        missing.dedup();
        Ok(missing)
    }

    /// The size of the account's blob, if it has it.
    pub async fn blob_size(&self, account_id: i64, digest: &str) -> Result<Option<u64>> {
        on_reader!(self, pool => {
            sqlx::query("SELECT size FROM blobs WHERE account_id = $1 AND digest = $2")
                .bind(account_id)
                .bind(digest)
                .fetch_optional(pool)
                .await?
                .map(|r| unsigned(r.int("size")?, "size"))
                .transpose()
        })
    }

    /// Bytes of every blob the account holds.
    pub async fn account_blob_bytes(&self, account_id: i64) -> Result<u64> {
        // SUM of a BIGINT is NUMERIC on PostgreSQL: cast back.
        on_reader!(self, pool => {
            let total = sqlx::query(
                "SELECT CAST(COALESCE(SUM(size), 0) AS BIGINT) AS total FROM blobs \
                 WHERE account_id = $1",
            )
            .bind(account_id)
            .fetch_one(pool)
            .await?
            .int("total")?;
            unsigned(total, "total")
        })
    }

    /// Stores chunk `seq` of the blob staged as `staging`.
    pub async fn put_blob_chunk(
        &self,
        account_id: i64,
        staging: &str,
        seq: u64,
        data: &[u8],
    ) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(
                "INSERT INTO blob_chunks (account_id, digest, seq, data) VALUES ($1, $2, $3, $4)",
            )
            .bind(account_id)
            .bind(staging)
            .bind(signed(seq))
            .bind(data)
            .execute(pool)
            .await?;
        });
        Ok(())
    }

    /// Makes the chunks staged as `staging` the blob `digest` of `size`
    /// bytes (the caller has checked both), or drops them when the account
    /// has that blob already; either way the blob counts as used now.
    pub async fn commit_blob(
        &self,
        account_id: i64,
        staging: &str,
        digest: &str,
        size: u64,
        now: f64,
    ) -> Result<()> {
        let begin = match &*self.inner {
            Backend::Sqlite { .. } => "BEGIN IMMEDIATE",
            Backend::Postgres(_) => "BEGIN",
        };
        let lock_name = format!("shoal blob {account_id} {digest}");
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            sqlx::query(LOCK_DIGEST.on(pool)).bind(&lock_name).fetch_one(&mut *tx).await?;
            let exists = sqlx::query("SELECT size FROM blobs WHERE account_id = $1 AND digest = $2")
                .bind(account_id)
                .bind(digest)
                .fetch_optional(&mut *tx)
                .await?
                .is_some();
            if exists {
                sqlx::query("DELETE FROM blob_chunks WHERE account_id = $1 AND digest = $2")
                    .bind(account_id)
                    .bind(staging)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("UPDATE blobs SET used_at = $3 WHERE account_id = $1 AND digest = $2")
                    .bind(account_id)
                    .bind(digest)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            } else {
                sqlx::query(
                    "UPDATE blob_chunks SET digest = $3 WHERE account_id = $1 AND digest = $2",
                )
                .bind(account_id)
                .bind(staging)
                .bind(digest)
                .execute(&mut *tx)
                .await?;
                sqlx::query(
                    "INSERT INTO blobs (account_id, digest, size, created_at, used_at) \
                     VALUES ($1, $2, $3, $4, $4)",
                )
                .bind(account_id)
                .bind(digest)
                .bind(signed(size))
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// Drops the chunks of a blob that will not be committed.
    pub async fn discard_staged_blob(&self, account_id: i64, staging: &str) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query("DELETE FROM blob_chunks WHERE account_id = $1 AND digest = $2")
                .bind(account_id)
                .bind(staging)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    /// Chunk `seq` of the account's blob; `None` past its end (or if the
    /// account has no such blob).
    pub async fn blob_chunk(
        &self,
        account_id: i64,
        digest: &str,
        seq: u64,
    ) -> Result<Option<Vec<u8>>> {
        on_reader!(self, pool => {
            Ok(sqlx::query(
                "SELECT c.data AS data FROM blob_chunks c JOIN blobs b \
                 ON b.account_id = c.account_id AND b.digest = c.digest \
                 WHERE c.account_id = $1 AND c.digest = $2 AND c.seq = $3",
            )
            .bind(account_id)
            .bind(digest)
            .bind(signed(seq))
            .fetch_optional(pool)
            .await?
            .map(|r| r.try_get::<Vec<u8>, _>("data"))
            .transpose()?)
        })
    }

    /// Marks the account's blobs as used now (a job names them).
    pub async fn touch_blobs(&self, account_id: i64, digests: &[String], now: f64) -> Result<()> {
        for batch in digests.chunks(DIGEST_BATCH) {
            let marks: Vec<String> = (0..batch.len()).map(|i| format!("${}", i + 3)).collect();
            let sql = format!(
                "UPDATE blobs SET used_at = $2 WHERE account_id = $1 AND digest IN ({})",
                marks.join(", ")
            );
            on_writer!(self, pool => {
                let mut query = sqlx::query(&sql).bind(account_id).bind(now);
                for d in batch {
                    query = query.bind(d);
                }
                query.execute(pool).await?;
            });
        }
        Ok(())
    }

    /// Adds one flush of a task's output. The first flush of an attempt
    /// (`seq` 0) drops what earlier attempts of the cell printed.
    pub async fn append_cell_output(
        &self,
        sweep_id: &str,
        idx: u32,
        epoch: u64,
        seq: u64,
        stream: &str,
        data: &[u8],
    ) -> Result<()> {
        on_writer!(self, pool => {
            if seq == 0 {
                sqlx::query("DELETE FROM cell_output WHERE sweep_id = $1 AND idx = $2 AND epoch < $3")
                    .bind(sweep_id)
                    .bind(i64::from(idx))
                    .bind(signed(epoch))
                    .execute(pool)
                    .await?;
            }
            sqlx::query(
                "INSERT INTO cell_output (sweep_id, idx, epoch, seq, stream, data) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(sweep_id)
            .bind(i64::from(idx))
            .bind(signed(epoch))
            .bind(signed(seq))
            .bind(stream)
            .bind(data)
            .execute(pool)
            .await?;
        });
        Ok(())
    }

    /// What the cell's latest attempt printed from flush `from_seq` on, in
    /// order, at least one flush and then no more than `max_bytes`: its
    /// epoch and the flushes. `None` when it printed nothing yet.
    pub async fn cell_output(
        &self,
        sweep_id: &str,
        idx: u32,
        from_seq: u64,
        max_bytes: usize,
    ) -> Result<Option<(u64, Vec<OutputChunk>)>> {
        on_reader!(self, pool => {
            let epoch: Option<i64> = sqlx::query(
                "SELECT MAX(epoch) AS epoch FROM cell_output WHERE sweep_id = $1 AND idx = $2",
            )
            .bind(sweep_id)
            .bind(i64::from(idx))
            .fetch_one(pool)
            .await?
            .opt_int("epoch")?;
            let Some(epoch) = epoch else {
                return Ok(None);
            };
            let rows = sqlx::query(
                "SELECT seq, stream, data FROM cell_output \
                 WHERE sweep_id = $1 AND idx = $2 AND epoch = $3 AND seq >= $4 \
                 ORDER BY seq LIMIT 64",
            )
            .bind(sweep_id)
            .bind(i64::from(idx))
            .bind(epoch)
            .bind(signed(from_seq))
            .fetch_all(pool)
            .await?;
            let mut chunks = Vec::new();
            let mut bytes = 0;
            for row in rows {
                let data: Vec<u8> = row.try_get("data")?;
                if !chunks.is_empty() && bytes + data.len() > max_bytes {
                    break;
                }
                bytes += data.len();
                chunks.push(OutputChunk {
                    seq: unsigned(row.int("seq")?, "seq")?,
                    stream: row.text("stream")?,
                    data,
                });
            }
            Ok(Some((unsigned(epoch, "epoch")?, chunks)))
        })
    }

    /// Drops blobs no job has named since `unused_since`, staged chunks
    /// begun before `staged_before`, and the output of sweeps finished
    /// before `finished_before`. Returns the blobs dropped.
    pub async fn collect_garbage(
        &self,
        unused_since: f64,
        staged_before: f64,
        finished_before: f64,
    ) -> Result<u64> {
        let staging_cutoff = format!("staging:{:012}", staged_before.max(0.0) as u64);
        on_writer!(self, pool => {
            sqlx::query(
                "DELETE FROM blob_chunks WHERE EXISTS (SELECT 1 FROM blobs b \
                 WHERE b.account_id = blob_chunks.account_id AND b.digest = blob_chunks.digest \
                 AND b.used_at < $1)",
            )
            .bind(unused_since)
            .execute(pool)
            .await?;
            let dropped = sqlx::query("DELETE FROM blobs WHERE used_at < $1")
                .bind(unused_since)
                .execute(pool)
                .await?
                .rows_affected();
            sqlx::query("DELETE FROM blob_chunks WHERE digest LIKE 'staging:%' AND digest < $1")
                .bind(&staging_cutoff)
                .execute(pool)
                .await?;
            sqlx::query(
                "DELETE FROM cell_output WHERE sweep_id IN \
                 (SELECT id FROM sweeps WHERE finished_at < $1)",
            )
            .bind(finished_before)
            .execute(pool)
            .await?;
            Ok(dropped)
        })
    }
}
