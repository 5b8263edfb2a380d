//! Volume rows, their attachments and their quotas.
//!
//! A volume is recorded under the same account lock as a sandbox admission
//! (see `sandboxes.rs`), so the count and size quotas hold under concurrent
//! creates. An attachment is written in the admitting transaction of the
//! sandbox that holds it ([`Store::admit_sandbox_with_volumes`]) and counts
//! for as long as that sandbox is live: any way a sandbox ends (deleted,
//! reaped, failed create, reconciled away after a restart) releases its
//! volumes without a statement of its own. A `lost` sandbox is still live:
//! its VM may still run on a partitioned host, writing to the volume.
//!
//! One writer: a read-write attachment needs the volume free of every other
//! live attachment; a read-only one needs it free of a read-write one.

use crate::row::{unsigned, Column};
use crate::sandboxes::admission_lock;
use crate::{
    on_reader, on_writer, Account, NewVolume, Result, Store, StoreError, VolumeLimits, VolumeRow,
};

const VOLUME_COLUMNS: &str = "id, account_id, name, size_mb, host, created_at";

const COUNTS: &str =
    "SELECT COUNT(*) AS volumes, CAST(COALESCE(SUM(size_mb), 0) AS BIGINT) AS total_mb \
     FROM volumes WHERE account_id = $1";
const INSERT: &str = "INSERT INTO volumes (account_id, name, size_mb, host, created_at) \
     VALUES ($1, $2, $3, $4, $5)";
const DELETE: &str = "DELETE FROM volumes WHERE id = $1";
/// The live attachments of one volume, oldest sandbox first.
pub(crate) const ATTACHMENTS: &str = "SELECT a.sandbox_id, a.read_only FROM volume_attachments a \
     JOIN sandboxes s ON s.id = a.sandbox_id \
     WHERE a.volume_id = $1 AND s.status NOT IN ('deleted', 'failed') \
     ORDER BY s.created_at, s.id";
/// The live attachments of every volume of an account.
const ACCOUNT_ATTACHMENTS: &str = "SELECT a.volume_id, a.sandbox_id, a.read_only \
     FROM volume_attachments a JOIN volumes v ON v.id = a.volume_id \
     JOIN sandboxes s ON s.id = a.sandbox_id \
     WHERE v.account_id = $1 AND s.status NOT IN ('deleted', 'failed') \
     ORDER BY s.created_at, s.id";
pub(crate) const ATTACH: &str =
    "INSERT INTO volume_attachments (volume_id, sandbox_id, read_only) VALUES ($1, $2, $3)";

pub(crate) fn by_name() -> String {
    format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE account_id = $1 AND name = $2")
}

fn by_account() -> String {
    format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE account_id = $1 ORDER BY created_at, name")
}

/// A volume row without its attachments, and its id.
pub(crate) fn volume(row: &impl Column) -> Result<(i64, VolumeRow)> {
    Ok((
        row.int("id")?,
        VolumeRow {
            account_id: row.int("account_id")?,
            name: row.text("name")?,
            size_mb: unsigned(row.int("size_mb")?, "size_mb")?,
            host: row.text("host")?,
            created_at: row.real("created_at")?,
            attached_to: Vec::new(),
            attached_read_write: false,
        },
    ))
}

/// Adds one live attachment to the row it belongs to.
fn attach_to(volume: &mut VolumeRow, sandbox: String, read_only: bool) {
    volume.attached_to.push(sandbox);
    volume.attached_read_write |= !read_only;
}

/// "1 volume", "10 volumes".
fn volumes_word(count: u32) -> String {
    if count == 1 {
        "1 volume".into()
    } else {
        format!("{count} volumes")
    }
}

impl Store {
    /// Records a new volume if the account's quotas allow it, atomically
    /// (the account lock of sandbox admission): [`StoreError::Quota`] past
    /// `limits`, [`StoreError::Conflict`] if the account has one by that
    /// name.
    pub async fn create_volume(
        &self,
        account: &Account,
        new: &NewVolume,
        limits: &VolumeLimits,
        now: f64,
    ) -> Result<VolumeRow> {
        let tier = account.tier;
        if new.size_mb > limits.size_mb {
            return Err(StoreError::Quota {
                message: format!(
                    "{tier} tier allows volumes of at most {} MB",
                    limits.size_mb
                ),
            });
        }
        let (begin, lock) = admission_lock(self);
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            sqlx::query(lock).bind(account.id).fetch_optional(&mut *tx).await?;
            let found = sqlx::query(COUNTS).bind(account.id).fetch_one(&mut *tx).await?;
            let (count, total) = (found.int("volumes")?, found.int("total_mb")?);
            if count >= i64::from(limits.count) {
                return Err(StoreError::Quota {
                    message: format!("{tier} tier allows {}", volumes_word(limits.count)),
                });
            }
            if total.saturating_add(crate::row::signed(new.size_mb))
                > crate::row::signed(limits.total_mb)
            {
                return Err(StoreError::Quota {
                    message: format!(
                        "{tier} tier allows {} MB of volumes in all ({total} MB in use)",
                        limits.total_mb
                    ),
                });
            }
            sqlx::query(INSERT)
                .bind(account.id)
                .bind(&new.name)
                .bind(crate::row::signed(new.size_mb))
                .bind(&new.host)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(|e| match crate::sandboxes::already_exists(e, "volume", &new.name) {
                    StoreError::AlreadyExists { .. } => StoreError::Conflict {
                        message: format!("volume {} already exists", new.name),
                    },
                    other => other,
                })?;
            tx.commit().await?;
        });
        Ok(VolumeRow {
            account_id: account.id,
            name: new.name.clone(),
            size_mb: new.size_mb,
            host: new.host.clone(),
            created_at: now,
            attached_to: Vec::new(),
            attached_read_write: false,
        })
    }

    /// The account's volumes, oldest first, with their live attachments.
    pub async fn list_volumes(&self, account_id: i64) -> Result<Vec<VolumeRow>> {
        on_reader!(self, pool => {
            let mut volumes: Vec<(i64, VolumeRow)> = sqlx::query(&by_account())
                .bind(account_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(volume)
                .collect::<Result<_>>()?;
            for row in sqlx::query(ACCOUNT_ATTACHMENTS).bind(account_id).fetch_all(pool).await? {
                let id = row.int("volume_id")?;
                if let Some((_, volume)) = volumes.iter_mut().find(|(v, _)| *v == id) {
                    attach_to(volume, row.text("sandbox_id")?, row.boolean("read_only")?);
                }
            }
            Ok(volumes.into_iter().map(|(_, v)| v).collect())
        })
    }

    /// The account's volume `name`, with its live attachments.
    pub async fn get_volume(&self, account_id: i64, name: &str) -> Result<Option<VolumeRow>> {
        on_reader!(self, pool => {
            let Some(found) = sqlx::query(&by_name())
                .bind(account_id)
                .bind(name)
                .fetch_optional(pool)
                .await?
            else {
                return Ok(None);
            };
            let (id, mut volume) = volume(&found)?;
            for row in sqlx::query(ATTACHMENTS).bind(id).fetch_all(pool).await? {
                attach_to(&mut volume, row.text("sandbox_id")?, row.boolean("read_only")?);
            }
            Ok(Some(volume))
        })
    }

    /// Deletes the account's volume `name` unless a live sandbox holds it
    /// ([`StoreError::Conflict`]). Returns the row deleted, or `None` if
    /// there was none. Under the account lock, so no admission attaches it
    /// between the check and the delete.
    pub async fn delete_volume(&self, account: &Account, name: &str) -> Result<Option<VolumeRow>> {
        let (begin, lock) = admission_lock(self);
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            sqlx::query(lock).bind(account.id).fetch_optional(&mut *tx).await?;
            let Some(found) = sqlx::query(&by_name())
                .bind(account.id)
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?
            else {
                return Ok(None);
            };
            let (id, volume) = volume(&found)?;
            let holders: Vec<String> = sqlx::query(ATTACHMENTS)
                .bind(id)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| r.text("sandbox_id"))
                .collect::<sqlx::Result<_>>()?;
            if !holders.is_empty() {
                return Err(StoreError::Conflict {
                    message: format!("volume in use by {}", holders.join(", ")),
                });
            }
            sqlx::query(DELETE).bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(Some(volume))
        })
    }
}
