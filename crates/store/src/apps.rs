//! App rows: insert (the name is unique among an account's apps that are not
//! deleted, by a partial unique index), tenancy-checked reads, the
//! reconciler's list of a host's apps, state changes, configuration
//! changes, proxied-request activity and deletion.
//!
//! A state change never touches a deleted app: a deploy that finishes after
//! the app was deleted learns so from the `false` it gets back.

use crate::row::{self, app_columns, signed};
use crate::sandboxes::already_exists;
use crate::{
    app_status, on_reader, on_writer, AppConfigPatch, AppRow, AppState, Flavoured, NewApp, Result,
    Store,
};

const INSERT: &str = "INSERT INTO apps (id, account_id, name, template, start_cmd, port, env, \
     idle_seconds, status, host, attempts, created_at, status_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 0, $11, $11)";

/// `SELECT` of an app row and then `$rest`; on PostgreSQL its env comes
/// through `shoal_app_env`, which shows a host's role only the envs of the
/// apps it drives.
macro_rules! select_app {
    ($rest:literal) => {
        Flavoured {
            sqlite: concat!("SELECT ", app_columns!(), $rest),
            postgres: concat!("SELECT ", app_columns!("shoal_app_env(id) AS env"), $rest),
        }
    };
}

const GET: Flavoured = select_app!(" FROM apps WHERE id = $1 AND account_id = $2");

const BY_ID: Flavoured = select_app!(" FROM apps WHERE id = $1");

const LIST: Flavoured =
    select_app!(" FROM apps WHERE account_id = $1 AND status <> 'deleted' ORDER BY created_at, id");

/// Keep the condition in step with the `apps_host_live` index.
const OF_HOST: Flavoured = select_app!(
    " FROM apps WHERE host = $1 AND status NOT IN ('deleted', 'failed') ORDER BY created_at, id"
);

const SET_STATE: &str = "UPDATE apps SET \
     status_at = CASE WHEN status <> $2 THEN $7 ELSE status_at END, \
     status = $2, sandbox_id = $3, attempts = $4, next_attempt_at = $5, last_error = $6 \
     WHERE id = $1 AND status <> 'deleted'";

const SET_CONFIG: &str = "UPDATE apps SET \
     template = COALESCE($2, template), \
     start_cmd = COALESCE($3, start_cmd), \
     port = COALESCE($4, port), \
     idle_seconds = COALESCE($5, idle_seconds) \
     WHERE id = $1 AND status <> 'deleted'";

/// Apart from [`SET_CONFIG`]: `COALESCE($n, env)` would read the column,
/// which a host's role may not (migrations/postgres/0010).
const SET_ENV: &str = "UPDATE apps SET env = $2 WHERE id = $1 AND status <> 'deleted'";

/// `last_request_at` only moves forward.
const TOUCH: &str = "UPDATE apps SET last_request_at = \
     CASE WHEN last_request_at IS NULL OR $2 > last_request_at THEN $2 ELSE last_request_at END \
     WHERE id = $1";

const DELETE: &str = "UPDATE apps SET status = 'deleted', status_at = $3, deleted_at = $3, \
     next_attempt_at = NULL WHERE id = $1 AND account_id = $2 AND status <> 'deleted'";

impl Store {
    /// Inserts a new app as `deploying`. Refuses with
    /// [`StoreError::AlreadyExists`](crate::StoreError::AlreadyExists), naming
    /// the name, when the account has an app of that name not deleted.
    pub async fn insert_app(&self, account_id: i64, new: &NewApp, now: f64) -> Result<AppRow> {
        let env = row::metadata_to_json(&new.config.env);
        on_writer!(self, pool => {
            sqlx::query(INSERT)
                .bind(&new.id)
                .bind(account_id)
                .bind(&new.name)
                .bind(&new.config.template)
                .bind(&new.config.start_cmd)
                .bind(i64::from(new.config.port))
                .bind(&env)
                .bind(signed(new.config.idle_seconds))
                .bind(app_status::DEPLOYING)
                .bind(&new.host)
                .bind(now)
                .execute(pool)
                .await
                .map_err(|e| already_exists(e, "app", &new.name))?;
        });
        Ok(AppRow {
            id: new.id.clone(),
            account_id,
            name: new.name.clone(),
            config: new.config.clone(),
            state: AppState {
                status: app_status::DEPLOYING.into(),
                ..AppState::default()
            },
            host: new.host.clone(),
            created_at: now,
            status_at: now,
            last_request_at: None,
            deleted_at: None,
        })
    }

    /// The app, in any status, if `account_id` owns it.
    pub async fn get_app(&self, account_id: i64, id: &str) -> Result<Option<AppRow>> {
        on_reader!(self, pool => {
            sqlx::query(GET.on(pool))
                .bind(id)
                .bind(account_id)
                .fetch_optional(pool)
                .await?
                .map(|r| row::app(&r))
                .transpose()
        })
    }

    /// The app, in any status, whoever owns it. For the control plane's own
    /// work, never for a tenant's request.
    pub async fn app_by_id(&self, id: &str) -> Result<Option<AppRow>> {
        on_reader!(self, pool => {
            sqlx::query(BY_ID.on(pool))
                .bind(id)
                .fetch_optional(pool)
                .await?
                .map(|r| row::app(&r))
                .transpose()
        })
    }

    /// The account's apps that are not deleted, oldest first.
    pub async fn list_apps(&self, account_id: i64) -> Result<Vec<AppRow>> {
        on_reader!(self, pool => {
            sqlx::query(LIST.on(pool))
                .bind(account_id)
                .fetch_all(pool)
                .await?
                .iter()
                .map(row::app)
                .collect()
        })
    }

    /// The apps `host` drives: every one neither deleted nor failed.
    pub async fn apps_of_host(&self, host: &str) -> Result<Vec<AppRow>> {
        on_reader!(self, pool => {
            sqlx::query(OF_HOST.on(pool))
                .bind(host)
                .fetch_all(pool)
                .await?
                .iter()
                .map(row::app)
                .collect()
        })
    }

    /// Writes the app's whole state (`status_at` moves when the status
    /// changes). False if there is no such app or it is deleted.
    pub async fn set_app_state(&self, id: &str, state: &AppState, now: f64) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(SET_STATE)
                .bind(id)
                .bind(&state.status)
                .bind(&state.sandbox_id)
                .bind(i64::from(state.attempts))
                .bind(state.next_attempt_at)
                .bind(&state.last_error)
                .bind(now)
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(affected > 0)
    }

    /// Writes the `Some` fields of `patch`. False if there is no such app or
    /// it is deleted.
    pub async fn set_app_config(&self, id: &str, patch: &AppConfigPatch) -> Result<bool> {
        let env = patch.env.as_ref().map(row::metadata_to_json);
        let affected = on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            let affected = sqlx::query(SET_CONFIG)
                .bind(id)
                .bind(&patch.template)
                .bind(&patch.start_cmd)
                .bind(patch.port.map(i64::from))
                .bind(patch.idle_seconds.map(signed))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if let Some(env) = &env {
                sqlx::query(SET_ENV).bind(id).bind(env).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            affected
        });
        Ok(affected > 0)
    }

    /// Records a proxied request at `at` (never moves `last_request_at` back).
    pub async fn touch_app(&self, id: &str, at: f64) -> Result<()> {
        on_writer!(self, pool => {
            sqlx::query(TOUCH).bind(id).bind(at).execute(pool).await?;
        });
        Ok(())
    }

    /// Marks the account's app deleted, freeing its name. False if there is
    /// no such app or it was deleted already. Its sandbox is the caller's
    /// to stop.
    pub async fn delete_app(&self, account_id: i64, id: &str, now: f64) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(DELETE)
                .bind(id)
                .bind(account_id)
                .bind(now)
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(affected > 0)
    }
}
