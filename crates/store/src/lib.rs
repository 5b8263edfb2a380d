//! The control plane's database: the schema (`migrations/`) and every SQL
//! statement Shoal runs, on SQLite (the embedded default, one file) or
//! PostgreSQL (`postgres://...`).
//!
//! It owns accounts and hashed API tokens, sandbox rows and their life-cycle
//! fields, the atomic quota check at admission, the reaper's query, usage
//! samples and their priced report, snapshot records, sweeps (cells that
//! runners claim under leases, fenced by claim ids: `sweeps.rs`), apps
//! (long-running services and their deploy/wake state: `apps.rs`), and
//! volumes with their attachments and quotas (`volumes.rs`). It knows
//! nothing of HTTP (no status codes: [`StoreError::Quota`] is for the caller
//! to map), and it starts, stops or inspects no VM: a row says what the
//! control plane believes, the engine and host agents make it so.
//!
//! Two backends, one set of statements. A [`Store`] holds native sqlx pools
//! of either backend; each query is written once, with `$N` placeholders that
//! both understand, and a small macro expands its body once per backend so it
//! is type-checked against both drivers. Only the DDL (`migrations/sqlite`,
//! `migrations/postgres`: same tables and names, different column types) and
//! the way [`Store::admit_sandbox`] serialises concurrent admissions differ.
//! Times are unix epoch seconds as `f64`, passed in by the caller, so the
//! store reads no clock for any decision.
//!
//! SQLite runs in WAL mode with one writer connection (writes queue in the
//! pool instead of spinning on the file lock) and several readers, so the hot
//! reads ([`Store::authenticate`], [`Store::get_sandbox`]) are one indexed
//! query each and never wait for a writer. Its writer is at
//! `synchronous=FULL`: a write that returned is on the disk.

mod accounts;
mod apps;
mod blobs;
mod builds;
mod events;
mod host_credentials;
mod host_roles;
mod hosts;
mod migrate;
mod model;
mod row;
mod sandboxes;
mod snapshots;
mod sweeps;
mod templates;
mod token_requests;
mod usage;
mod volumes;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

pub use accounts::{
    bearer_token, request_token, token_hash, TokenInfo, TokenRefusal, MAX_TOKENS_PER_ACCOUNT,
    MAX_TOKEN_LABEL,
};
pub use blobs::{staging_key, OutputChunk, BLOB_CHUNK};
pub use builds::BUILD_LIST_LIMIT;
pub use events::{SandboxEvent, EVENTS_KEPT};
pub use host_credentials::JoinRefusal;
pub use host_roles::host_database_url;
pub use hosts::PLACEMENT_TIMEOUT_SECONDS;
pub use model::*;
pub use sweeps::{measure_claims, ClaimRate};
pub use token_requests::{token_list_view, TokenRequest, MAX_TOKEN_DAYS};

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A quota refused a new sandbox; the message names the limit
    /// ("free tier allows 5 concurrent sandboxes").
    #[error("{message}")]
    Quota { message: String },
    /// Something the request names does not exist ("volume not found: x").
    #[error("{message}")]
    NotFound { message: String },
    /// The request conflicts with what exists ("volume in use", a
    /// duplicate name).
    #[error("{message}")]
    Conflict { message: String },
    #[error("{what} {id} already exists")]
    AlreadyExists { what: &'static str, id: String },
    #[error("unknown tier {0:?} (want free, pro or team)")]
    UnknownTier(String),
    #[error("unsupported database URL {0:?} (want sqlite:PATH, a file path, or postgres://...)")]
    BadUrl(String),
    #[error("cannot create directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt row: {0}")]
    Corrupt(String),
    #[error("database")]
    Database(#[from] sqlx::Error),
    #[error("migrating the schema")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A host opened a database whose schema is older than it needs (hosts
    /// do not migrate: the fronts do).
    #[error("the database's schema is at version {found}, this binary needs {needed}: upgrade and restart the fronts (`shoal server`) first")]
    SchemaBehind { found: i64, needed: i64 },
}

impl StoreError {
    /// The message and each of its sources, `: `-joined: what a log line
    /// says (the database's own words: a permission denied, a connection
    /// lost), where a client is told less.
    pub fn chain(&self) -> String {
        let mut text = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }
}

/// What `shoal_store::Error` names: [`StoreError`].
pub type Error = StoreError;
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A handle on the database; cheap to clone (the pools are shared).
#[derive(Clone)]
pub struct Store {
    inner: Arc<Backend>,
    rate_card: RateCard,
}

enum Backend {
    Sqlite {
        /// Several connections, for reads only.
        read: SqlitePool,
        /// Exactly one connection: every write goes through it.
        write: SqlitePool,
    },
    Postgres(PgPool),
}

/// Runs `$body` with `$pool` bound to the pool that serves reads, expanded
/// once per backend.
macro_rules! on_reader {
    ($store:expr, $pool:ident => $body:expr) => {
        match &*$store.inner {
            $crate::Backend::Sqlite { read: $pool, .. } => $body,
            $crate::Backend::Postgres($pool) => $body,
        }
    };
}

/// Runs `$body` with `$pool` bound to the pool that serves writes, expanded
/// once per backend.
macro_rules! on_writer {
    ($store:expr, $pool:ident => $body:expr) => {
        match &*$store.inner {
            $crate::Backend::Sqlite { write: $pool, .. } => $body,
            $crate::Backend::Postgres($pool) => $body,
        }
    };
}
pub(crate) use {on_reader, on_writer};

/// A statement whose text differs between the backends: where PostgreSQL
/// reads a tenant's environment through the function that confines hosts'
/// roles (migrations/postgres/0010), SQLite reads the column.
pub(crate) struct Flavoured {
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

impl Flavoured {
    /// The text for the backend of `pool` (inside `on_reader!` and
    /// `on_writer!`, whose body is expanded once per backend).
    pub fn on<P: Dialect>(&self, _pool: &P) -> &'static str {
        if P::POSTGRES {
            self.postgres
        } else {
            self.sqlite
        }
    }
}

pub(crate) trait Dialect {
    const POSTGRES: bool;
}

impl Dialect for SqlitePool {
    const POSTGRES: bool = false;
}

impl Dialect for PgPool {
    const POSTGRES: bool = true;
}

/// Read connections of an SQLite store. On 2 cores 4 serve as many
/// `authenticate` + `get_sandbox` pairs as 8 (about 11k pairs/s, release build).
const SQLITE_READERS: u32 = 4;
/// Connections of a PostgreSQL store. Measured with `scripts/bench-api` on
/// 2 cores: 4 serve more `GET /v1/sandboxes/{id}` per second than 16, whose
/// backends only compete for the same cores.
const PG_CONNECTIONS: u32 = 4;
/// How long an SQLite statement waits for another process's write lock.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

impl Store {
    /// Opens the database and brings its schema up to date.
    ///
    /// `postgres://...` (or `postgresql://`) is PostgreSQL. `sqlite:PATH`,
    /// `sqlite://PATH` or a bare path is an SQLite file, created with its
    /// parent directory if missing.
    pub async fn connect(url: &str) -> Result<Store> {
        Store::open(url, Migrate::Yes).await
    }

    /// Opens the database as a fleet's host does: with the role the front
    /// gave it, which may not change the schema, so the schema is checked
    /// instead of migrated. An SQLite file is opened as by [`Store::connect`].
    pub async fn connect_as_host(url: &str) -> Result<Store> {
        Store::open(url, Migrate::No).await
    }

    async fn open(url: &str, migrate: Migrate) -> Result<Store> {
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            connect_postgres(url, migrate).await?
        } else {
            let path = url
                .strip_prefix("sqlite://")
                .or_else(|| url.strip_prefix("sqlite:"))
                .unwrap_or(url);
            // No URL parameters: the store sets every option itself, and a
            // file named "x.db?mode=ro" would be a surprise.
            if path.is_empty()
                || path.contains("://")
                || path.contains('?')
                || path.starts_with(":memory:")
            {
                return Err(StoreError::BadUrl(url.to_owned()));
            }
            connect_sqlite(Path::new(path)).await?
        };
        Ok(Store {
            inner: Arc::new(backend),
            rate_card: RateCard::default(),
        })
    }

    /// "sqlite" or "postgres".
    pub fn backend(&self) -> &'static str {
        match &*self.inner {
            Backend::Sqlite { .. } => "sqlite",
            Backend::Postgres(_) => "postgres",
        }
    }

    /// Whether the store's connections to its database are encrypted
    /// (PostgreSQL with TLS, as `sslmode=require` in the URL asks); an
    /// SQLite file crosses no network and answers false.
    pub async fn encrypted(&self) -> Result<bool> {
        match &*self.inner {
            Backend::Sqlite { .. } => Ok(false),
            Backend::Postgres(pool) => {
                let row = sqlx::query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                    .fetch_one(pool)
                    .await?;
                Ok(row::Column::boolean(&row, "ssl")?)
            }
        }
    }

    /// The same store, pricing usage with `rate_card`.
    pub fn with_rate_card(mut self, rate_card: RateCard) -> Store {
        self.rate_card = rate_card;
        self
    }

    pub fn rate_card(&self) -> RateCard {
        self.rate_card
    }

    /// SQLite's `synchronous` level on the connection that writes (2 is
    /// FULL); `None` on PostgreSQL. Read back so a test holds the setting.
    #[doc(hidden)]
    pub async fn sqlite_synchronous(&self) -> Result<Option<i64>> {
        match &*self.inner {
            Backend::Sqlite { write, .. } => {
                let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                    .fetch_one(write)
                    .await?;
                Ok(Some(level))
            }
            Backend::Postgres(_) => Ok(None),
        }
    }

    /// Closes every connection; other clones of this store stop working.
    pub async fn close(&self) {
        match &*self.inner {
            Backend::Sqlite { read, write } => {
                read.close().await;
                write.close().await;
            }
            Backend::Postgres(pool) => pool.close().await,
        }
    }
}

async fn connect_sqlite(path: &Path) -> Result<Backend> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| StoreError::CreateDir {
            path: parent.to_owned(),
            source,
        })?;
    }
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // FULL: a commit is on the disk before it returns, so what the API
        // acknowledged (a token printed, a 201) survives a power cut. WAL
        // with NORMAL could lose the last commits. The cost is one fsync of
        // the WAL per commit: a quota-checked insert went from p50 ~0.15 ms
        // to ~0.4 ms, and sweep claims (8 claimers) from ~2,700/s to ~1,200/s
        // on the 2-core test machine (2026-12-05).
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(SQLITE_BUSY_TIMEOUT)
        .foreign_keys(true);
    let write = SqlitePoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(options.clone())
        .await?;
    migrate::run_sqlite(&write).await?;
    let read = SqlitePoolOptions::new()
        .max_connections(SQLITE_READERS)
        .min_connections(1)
        // A file cannot drop a connection; the default ping on every
        // acquire is a wasted statement per request.
        .test_before_acquire(false)
        .connect_with(options)
        .await?;
    Ok(Backend::Sqlite { read, write })
}

/// Whether opening a PostgreSQL store brings its schema up to date.
#[derive(Clone, Copy, PartialEq)]
enum Migrate {
    Yes,
    No,
}

async fn connect_postgres(url: &str, migrate: Migrate) -> Result<Backend> {
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(PG_CONNECTIONS)
        .min_connections(1)
        // The default pings the server on every acquire: one more round trip
        // and backend wake-up per request, on the path of every
        // `GET /v1/sandboxes/{id}`. A connection the server dropped fails
        // its next query instead, and sqlx discards it.
        .test_before_acquire(false)
        .connect_with(options)
        .await?;
    match migrate {
        Migrate::Yes => migrate::run_postgres(&pool).await?,
        Migrate::No => migrate::check_postgres(&pool).await?,
    }
    Ok(Backend::Postgres(pool))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_says_what_the_database_said() {
        let e = StoreError::Database(sqlx::Error::PoolTimedOut);
        assert_eq!(e.to_string(), "database");
        assert!(
            e.chain().starts_with("database: pool timed out"),
            "{}",
            e.chain()
        );
    }
}
