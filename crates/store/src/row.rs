//! Reading columns by name from a row of either backend, and the decoders
//! from rows to the crate's types. The decoders are ordinary generic
//! functions over [`Column`], which both drivers' rows implement.

use sqlx::postgres::PgRow;
use sqlx::sqlite::SqliteRow;
use sqlx::Row;

use crate::{
    Account, AppConfig, AppRow, AppState, Metadata, Result, SandboxRow, SnapshotRow, StoreError,
};

/// Typed column access shared by `SqliteRow` and `PgRow`.
pub(crate) trait Column {
    fn text(&self, name: &str) -> sqlx::Result<String>;
    fn opt_text(&self, name: &str) -> sqlx::Result<Option<String>>;
    fn int(&self, name: &str) -> sqlx::Result<i64>;
    fn opt_int(&self, name: &str) -> sqlx::Result<Option<i64>>;
    fn real(&self, name: &str) -> sqlx::Result<f64>;
    fn opt_real(&self, name: &str) -> sqlx::Result<Option<f64>>;
    fn boolean(&self, name: &str) -> sqlx::Result<bool>;
}

macro_rules! impl_column {
    ($row:ty) => {
        impl Column for $row {
            fn text(&self, name: &str) -> sqlx::Result<String> {
                self.try_get(name)
            }
            fn opt_text(&self, name: &str) -> sqlx::Result<Option<String>> {
                self.try_get(name)
            }
            fn int(&self, name: &str) -> sqlx::Result<i64> {
                self.try_get(name)
            }
            fn opt_int(&self, name: &str) -> sqlx::Result<Option<i64>> {
                self.try_get(name)
            }
            fn real(&self, name: &str) -> sqlx::Result<f64> {
                self.try_get(name)
            }
            fn opt_real(&self, name: &str) -> sqlx::Result<Option<f64>> {
                self.try_get(name)
            }
            fn boolean(&self, name: &str) -> sqlx::Result<bool> {
                self.try_get(name)
            }
        }
    };
}
impl_column!(SqliteRow);
impl_column!(PgRow);

/// The columns [`sandbox`] reads, as a literal for `concat!`.
macro_rules! sandbox_columns {
    () => {
        "id, account_id, template, cpu, memory_mb, metadata, ttl_seconds, persistent, \
         max_lifetime_seconds, from_snapshot, parent_id, tree_id, status, host, guest_ip, \
         created_at, last_activity_at, running_execs, boot_ms, boot_mode, deleted_at, status_reason"
    };
}
pub(crate) use sandbox_columns;

pub(crate) fn sandbox(row: &impl Column) -> Result<SandboxRow> {
    Ok(SandboxRow {
        id: row.text("id")?,
        account_id: row.int("account_id")?,
        template: row.text("template")?,
        cpu: unsigned(row.int("cpu")?, "cpu")?,
        memory_mb: unsigned(row.int("memory_mb")?, "memory_mb")?,
        metadata: metadata_from_json(&row.text("metadata")?)?,
        ttl_seconds: unsigned(row.int("ttl_seconds")?, "ttl_seconds")?,
        persistent: row.boolean("persistent")?,
        max_lifetime_seconds: row
            .opt_int("max_lifetime_seconds")?
            .map(|v| unsigned(v, "max_lifetime_seconds"))
            .transpose()?,
        from_snapshot: row.opt_text("from_snapshot")?,
        parent_id: row.opt_text("parent_id")?,
        tree_id: row.opt_text("tree_id")?,
        status: row.text("status")?,
        host: row.opt_text("host")?,
        guest_ip: row.opt_text("guest_ip")?,
        created_at: row.real("created_at")?,
        last_activity_at: row.real("last_activity_at")?,
        running_execs: row.int("running_execs")?,
        boot_ms: row.opt_real("boot_ms")?,
        boot_mode: row.opt_text("boot_mode")?,
        deleted_at: row.opt_real("deleted_at")?,
        status_reason: row.opt_text("status_reason")?,
    })
}

pub(crate) fn account(row: &impl Column) -> Result<Account> {
    Ok(Account {
        id: row.int("id")?,
        name: row.text("name")?,
        tier: row.text("tier")?.parse()?,
    })
}

/// The columns [`snapshot`] reads, as a literal for `concat!`.
macro_rules! snapshot_columns {
    () => {
        "id, account_id, sandbox_id, template, size_bytes, host, created_at, vcpus, memory_mib"
    };
}
pub(crate) use snapshot_columns;

pub(crate) fn snapshot(row: &impl Column) -> Result<SnapshotRow> {
    Ok(SnapshotRow {
        id: row.text("id")?,
        account_id: row.int("account_id")?,
        sandbox_id: row.opt_text("sandbox_id")?,
        template: row.text("template")?,
        size_bytes: row.opt_int("size_bytes")?,
        host: row.opt_text("host")?,
        created_at: row.real("created_at")?,
        vcpus: row.opt_int("vcpus")?,
        memory_mib: row.opt_int("memory_mib")?,
    })
}

/// The columns [`app`] reads, as a literal for `concat!`.
macro_rules! app_columns {
    () => {
        app_columns!("env")
    };
    ($env:literal) => {
        concat!(
            "id, account_id, name, template, start_cmd, port, ",
            $env,
            ", idle_seconds, status, \
             sandbox_id, host, attempts, next_attempt_at, last_error, created_at, status_at, \
             last_request_at, deleted_at"
        )
    };
}
pub(crate) use app_columns;

pub(crate) fn app(row: &impl Column) -> Result<AppRow> {
    Ok(AppRow {
        id: row.text("id")?,
        account_id: row.int("account_id")?,
        name: row.text("name")?,
        config: AppConfig {
            template: row.text("template")?,
            start_cmd: row.text("start_cmd")?,
            port: unsigned(row.int("port")?, "port")?,
            env: metadata_from_json(&row.text("env")?)?,
            idle_seconds: unsigned(row.int("idle_seconds")?, "idle_seconds")?,
        },
        state: AppState {
            status: row.text("status")?,
            sandbox_id: row.opt_text("sandbox_id")?,
            attempts: unsigned(row.int("attempts")?, "attempts")?,
            next_attempt_at: row.opt_real("next_attempt_at")?,
            last_error: row.opt_text("last_error")?,
        },
        host: row.opt_text("host")?,
        created_at: row.real("created_at")?,
        status_at: row.real("status_at")?,
        last_request_at: row.opt_real("last_request_at")?,
        deleted_at: row.opt_real("deleted_at")?,
    })
}

pub(crate) fn metadata_from_json(json: &str) -> Result<Metadata> {
    serde_json::from_str(json)
        .map_err(|e| StoreError::Corrupt(format!("sandbox metadata {json:?}: {e}")))
}

pub(crate) fn metadata_to_json(metadata: &Metadata) -> String {
    serde_json::to_string(metadata).expect("a map of strings always serialises")
}

/// A count or size the Rust side keeps unsigned; the databases store i64.
pub(crate) fn unsigned<T: TryFrom<i64>>(value: i64, column: &str) -> Result<T> {
    T::try_from(value).map_err(|_| StoreError::Corrupt(format!("{column} = {value}")))
}

/// The i64 the databases store for an unsigned value from the caller.
pub(crate) fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
