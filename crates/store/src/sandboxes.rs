//! Sandbox rows: admission under quota, life-cycle updates, tenancy-checked
//! reads, activity and exec bookkeeping, and the reaper's query.
//!
//! Admission is the one place where the backends differ. SQLite takes the
//! database write lock up front (`BEGIN IMMEDIATE`; in this process the single
//! writer connection already serialises writes, the lock keeps other
//! processes out too). PostgreSQL takes a transaction lock named after the
//! account (an advisory lock: a host's database role may not lock rows of
//! `accounts` for update), so admissions of one account run one at a time
//! and those of different accounts in parallel. Either way the counts read inside the transaction
//! cannot change before the insert commits.

use crate::row::{self, sandbox_columns, signed, Column};
use crate::{
    on_reader, on_writer, status, Account, Backend, NewSandbox, Result, SandboxPatch, SandboxRow,
    Store, StoreError, TierLimits, VolumeRequest,
};

/// The condition for a live sandbox, as a literal for `concat!`. Keep in step
/// with the `sandboxes_live` index, so that the planner can use it.
macro_rules! live {
    () => {
        "status NOT IN ('deleted', 'failed')"
    };
}

const WITHDRAW: &str = "DELETE FROM sandboxes WHERE id = $1 AND status = $2";

/// Length of the window of the hourly create quota, in seconds.
const HOUR: f64 = 3600.0;

const LOCK_ACCOUNT_SQLITE: &str = "SELECT id FROM accounts WHERE id = $1";
const LOCK_ACCOUNT_POSTGRES: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('shoal account ' || $1::BIGINT, 0))";

const INSERT: &str = "INSERT INTO sandboxes (id, account_id, template, cpu, memory_mb, metadata, \
     ttl_seconds, persistent, max_lifetime_seconds, from_snapshot, parent_id, tree_id, status, \
     created_at, last_activity_at, running_execs, host) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $14, 0, $15)";

const UPDATE: &str = "UPDATE sandboxes SET \
     status = COALESCE($2, status), \
     host = COALESCE($3, host), \
     guest_ip = COALESCE($4, guest_ip), \
     boot_ms = COALESCE($5, boot_ms), \
     boot_mode = COALESCE($6, boot_mode), \
     ttl_seconds = COALESCE($7, ttl_seconds), \
     persistent = COALESCE($8, persistent), \
     max_lifetime_seconds = COALESCE($9, max_lifetime_seconds), \
     deleted_at = COALESCE($10, deleted_at), \
     status_reason = NULLIF(COALESCE($12, status_reason), ''), \
     metadata = COALESCE($13, metadata) \
     WHERE id = $1 AND ($11 IS NULL OR status = $11)";

/// `last_activity_at` only moves forward.
const TOUCH: &str = "UPDATE sandboxes SET last_activity_at = \
     CASE WHEN $2 > last_activity_at THEN $2 ELSE last_activity_at END WHERE id = $1";

const EXEC_STARTED: &str = "UPDATE sandboxes SET running_execs = running_execs + 1, \
     last_activity_at = CASE WHEN $2 > last_activity_at THEN $2 ELSE last_activity_at END \
     WHERE id = $1";

const EXEC_FINISHED: &str = "UPDATE sandboxes SET \
     running_execs = CASE WHEN running_execs > 0 THEN running_execs - 1 ELSE 0 END, \
     last_activity_at = CASE WHEN $2 > last_activity_at THEN $2 ELSE last_activity_at END \
     WHERE id = $1";

/// Live sandboxes of an account, and its creates since a time.
const COUNTS: &str = concat!(
    "SELECT (SELECT COUNT(*) FROM sandboxes WHERE account_id = $1 AND ",
    live!(),
    ") AS live, (SELECT COUNT(*) FROM sandboxes WHERE account_id = $1 AND created_at > $2) AS recent"
);

const GET: &str = concat!(
    "SELECT ",
    sandbox_columns!(),
    " FROM sandboxes WHERE id = $1 AND account_id = $2"
);

const BY_ID: &str = concat!(
    "SELECT ",
    sandbox_columns!(),
    " FROM sandboxes WHERE id = $1"
);

const LIST: &str = concat!(
    "SELECT ",
    sandbox_columns!(),
    " FROM sandboxes WHERE account_id = $1 AND ",
    live!(),
    " ORDER BY created_at, id"
);

const LIST_ALL_LIVE: &str = concat!(
    "SELECT ",
    sandbox_columns!(),
    " FROM sandboxes WHERE ",
    live!(),
    " ORDER BY created_at, id"
);

const REAP: &str = concat!(
    "SELECT ",
    sandbox_columns!(),
    " FROM sandboxes WHERE ",
    live!(),
    " AND ((NOT persistent AND running_execs = 0 AND ttl_seconds > 0 AND $1 - last_activity_at > ttl_seconds) \
     OR (max_lifetime_seconds IS NOT NULL AND $1 - created_at > max_lifetime_seconds)) \
     ORDER BY created_at, id"
);

const CLEAR_EXECS: &str = "UPDATE sandboxes SET running_execs = 0 \
     WHERE running_execs <> 0 AND (host = $1 OR host IS NULL)";

/// How a transaction that checks an account's quotas begins, and the
/// statement that takes the account's lock (see the module doc).
pub(crate) fn admission_lock(store: &Store) -> (&'static str, &'static str) {
    match &*store.inner {
        Backend::Sqlite { .. } => ("BEGIN IMMEDIATE", LOCK_ACCOUNT_SQLITE),
        Backend::Postgres(_) => ("BEGIN", LOCK_ACCOUNT_POSTGRES),
    }
}

impl Store {
    /// [`Store::admit_sandbox_with_volumes`] with no volumes.
    pub async fn admit_sandbox(
        &self,
        account: &Account,
        new: &NewSandbox,
        limits: &TierLimits,
        now: f64,
    ) -> Result<SandboxRow> {
        self.admit_sandbox_with_volumes(account, new, limits, &[], now)
            .await
    }

    /// Checks the account's quotas and inserts the sandbox with status
    /// `creating`, atomically: concurrent calls never admit more than the
    /// limits allow. Refuses with [`StoreError::Quota`] when the account has
    /// `limits.concurrent` live sandboxes, or created `limits.creates_per_hour`
    /// sandboxes in the last hour (including ones since deleted or failed).
    ///
    /// Attaches `volumes` (the account's, by name) in the same transaction:
    /// [`StoreError::NotFound`] for a volume the account does not have,
    /// [`StoreError::Conflict`] for one on another host than `new.host` or
    /// held in a way this attachment cannot share (one writer, or any
    /// number of readers). Nothing is written on any refusal.
    pub async fn admit_sandbox_with_volumes(
        &self,
        account: &Account,
        new: &NewSandbox,
        limits: &TierLimits,
        volumes: &[VolumeRequest],
        now: f64,
    ) -> Result<SandboxRow> {
        let (begin, lock) = admission_lock(self);
        let by_name = crate::volumes::by_name();
        let metadata = row::metadata_to_json(&new.metadata);
        on_writer!(self, pool => {
            let mut tx = pool.begin_with(begin).await?;
            sqlx::query(lock).bind(account.id).fetch_optional(&mut *tx).await?;
            let found = sqlx::query(COUNTS)
                .bind(account.id)
                .bind(now - HOUR)
                .fetch_one(&mut *tx)
                .await?;
            let (live, recent) = (found.int("live")?, found.int("recent")?);
            if live >= i64::from(limits.concurrent) {
                return Err(StoreError::Quota {
                    message: format!(
                        "{} tier allows {} concurrent sandboxes",
                        account.tier, limits.concurrent
                    ),
                });
            }
            if recent >= i64::from(limits.creates_per_hour) {
                return Err(StoreError::Quota {
                    message: format!(
                        "{} tier allows {} sandbox creates per hour",
                        account.tier, limits.creates_per_hour
                    ),
                });
            }
            sqlx::query(INSERT)
                .bind(&new.id)
                .bind(account.id)
                .bind(&new.template)
                .bind(i64::from(new.cpu))
                .bind(i64::from(new.memory_mb))
                .bind(&metadata)
                .bind(signed(new.ttl_seconds))
                .bind(new.persistent)
                .bind(new.max_lifetime_seconds.map(signed))
                .bind(&new.from_snapshot)
                .bind(&new.parent_id)
                .bind(&new.tree_id)
                .bind(status::CREATING)
                .bind(now)
                .bind(&new.host)
                .execute(&mut *tx)
                .await
                .map_err(|e| already_exists(e, "sandbox", &new.id))?;
            for request in volumes {
                let found = sqlx::query(&by_name)
                    .bind(account.id)
                    .bind(&request.name)
                    .fetch_optional(&mut *tx)
                    .await?
                    .ok_or_else(|| StoreError::NotFound {
                        message: format!("volume not found: {}", request.name),
                    })?;
                let (volume_id, volume) = crate::volumes::volume(&found)?;
                if new.host.as_deref() != Some(volume.host.as_str()) {
                    return Err(StoreError::Conflict {
                        message: format!(
                            "volume {} lives on host {}, not on {}",
                            request.name,
                            volume.host,
                            new.host.as_deref().unwrap_or("this host")
                        ),
                    });
                }
                let held = sqlx::query(crate::volumes::ATTACHMENTS)
                    .bind(volume_id)
                    .fetch_all(&mut *tx)
                    .await?;
                let mut holders = Vec::new();
                for row in &held {
                    let read_only = row.boolean("read_only")?;
                    if !request.read_only || !read_only {
                        holders.push(row.text("sandbox_id")?);
                    }
                }
                if !holders.is_empty() {
                    return Err(StoreError::Conflict {
                        message: format!(
                            "volume in use: {} is attached to {}",
                            request.name,
                            holders.join(", ")
                        ),
                    });
                }
                sqlx::query(crate::volumes::ATTACH)
                    .bind(volume_id)
                    .bind(&new.id)
                    .bind(request.read_only)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(SandboxRow {
            id: new.id.clone(),
            account_id: account.id,
            template: new.template.clone(),
            cpu: new.cpu,
            memory_mb: new.memory_mb,
            metadata: new.metadata.clone(),
            ttl_seconds: new.ttl_seconds,
            persistent: new.persistent,
            max_lifetime_seconds: new.max_lifetime_seconds,
            from_snapshot: new.from_snapshot.clone(),
            parent_id: new.parent_id.clone(),
            tree_id: new.tree_id.clone(),
            status: status::CREATING.to_owned(),
            host: None,
            guest_ip: None,
            created_at: now,
            last_activity_at: now,
            running_execs: 0,
            boot_ms: None,
            boot_mode: None,
            deleted_at: None,
            status_reason: None,
        })
    }

    /// Takes back admissions that never ran (rows still `creating`, without
    /// volumes): the rows go, so they count against no quota. For a batch
    /// refused part-way (a fork tree), all or nothing.
    pub async fn withdraw_admissions(&self, ids: &[String]) -> Result<()> {
        on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            for id in ids {
                sqlx::query(WITHDRAW).bind(id).bind(status::CREATING).execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// Writes the `Some` fields of `patch`. False if no row changed: no such
    /// sandbox, or its status was not `patch.if_status`.
    pub async fn update_sandbox(&self, id: &str, patch: SandboxPatch) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(UPDATE)
                .bind(id)
                .bind(&patch.status)
                .bind(&patch.host)
                .bind(&patch.guest_ip)
                .bind(patch.boot_ms)
                .bind(&patch.boot_mode)
                .bind(patch.ttl_seconds.map(signed))
                .bind(patch.persistent)
                .bind(patch.max_lifetime_seconds.map(signed))
                .bind(patch.deleted_at)
                .bind(&patch.if_status)
                .bind(&patch.status_reason)
                .bind(patch.metadata.as_ref().map(row::metadata_to_json))
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(affected > 0)
    }

    /// The sandbox, in any status, if `account_id` owns it. One query on the
    /// primary key.
    pub async fn get_sandbox(&self, account_id: i64, id: &str) -> Result<Option<SandboxRow>> {
        on_reader!(self, pool => {
            sqlx::query(GET)
                .bind(id)
                .bind(account_id)
                .fetch_optional(pool)
                .await?
                .map(|r| row::sandbox(&r))
                .transpose()
        })
    }

    /// The sandbox, in any status, whoever owns it. For the control plane's
    /// own work (reaper, metering), never for a tenant's request.
    pub async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRow>> {
        on_reader!(self, pool => {
            sqlx::query(BY_ID)
                .bind(id)
                .fetch_optional(pool)
                .await?
                .map(|r| row::sandbox(&r))
                .transpose()
        })
    }

    /// The account's live sandboxes, oldest first.
    pub async fn list_sandboxes(&self, account_id: i64) -> Result<Vec<SandboxRow>> {
        on_reader!(self, pool => {
            sqlx::query(LIST)
                .bind(account_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(row::sandbox)
                .collect()
        })
    }

    /// Every live sandbox of every account, oldest first.
    pub async fn list_all_live(&self) -> Result<Vec<SandboxRow>> {
        on_reader!(self, pool => {
            sqlx::query(LIST_ALL_LIVE).fetch_all(pool).await?.iter().map(row::sandbox).collect()
        })
    }

    /// Records activity at `now` (never moves `last_activity_at` back).
    pub async fn touch(&self, id: &str, now: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(TOUCH).bind(id).bind(now).execute(pool).await?;
        });
        Ok(())
    }

    /// An exec began: counts it (the reaper leaves the sandbox alone while any
    /// run) and touches.
    pub async fn exec_started(&self, id: &str, now: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(EXEC_STARTED).bind(id).bind(now).execute(pool).await?;
        });
        Ok(())
    }

    /// An exec ended, however: uncounts it and touches.
    pub async fn exec_finished(&self, id: &str, now: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(EXEC_FINISHED).bind(id).bind(now).execute(pool).await?;
        });
        Ok(())
    }

    /// Zeroes every exec counter. For a control plane starting up alone: the
    /// execs a previous run counted died with it, and would otherwise keep
    /// their sandboxes from ever being reaped as idle.
    /// Only `host`'s sandboxes (and rows from before hosts were recorded):
    /// another host's execs are still running.
    pub async fn clear_running_execs(&self, host: &str) -> Result<u64> {
        Ok(on_writer!(self, pool => {
            sqlx::query(CLEAR_EXECS).bind(host).execute(pool).await?.rows_affected()
        }))
    }

    /// Live sandboxes to delete at `now`: idle for longer than their TTL (and
    /// neither persistent nor running an exec), or older than their maximum
    /// lifetime (whatever they are doing).
    pub async fn reap_candidates(&self, now: f64) -> Result<Vec<SandboxRow>> {
        on_reader!(self, pool => {
            sqlx::query(REAP).bind(now).fetch_all(pool).await?.iter().map(row::sandbox).collect()
        })
    }
}

/// Turns a unique violation on insert into [`StoreError::AlreadyExists`].
pub(crate) fn already_exists(error: sqlx::Error, what: &'static str, id: &str) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::AlreadyExists {
            what,
            id: id.to_owned(),
        },
        _ => StoreError::Database(error),
    }
}
