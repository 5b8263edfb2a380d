//! The per-case database of the store's tests: a fresh SQLite file and,
//! when `SHOAL_TEST_DATABASE_URL` names a PostgreSQL server (see
//! `scripts/with-postgres`), a fresh database of its own there. Under CI
//! the PostgreSQL variants fail rather than skip when no server is given.
//! `cases!(a, b)` makes each case `sqlite::a` and `postgres::a`.
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use rand::Rng;
use shoal_store::Store;
use sqlx::{Connection, Executor, PgConnection, Row};

/// One case's database.
pub struct Db {
    pub store: Store,
    /// What `Store::connect` was given, to reopen it.
    pub url: String,
    pub kind: Kind,
}

pub enum Kind {
    /// `path` is the database file, in the case's own `dir`.
    Sqlite {
        dir: PathBuf,
        path: PathBuf,
    },
    Postgres {
        admin_url: String,
        name: String,
    },
}

impl Db {
    pub async fn reopen(&self) -> Store {
        Store::connect(&self.url).await.expect("reopen the store")
    }

    /// The store as host `host` of a fleet opens it: with the role a front
    /// makes for it (migrations/postgres/0009). `None` on SQLite, which has
    /// no roles.
    pub async fn as_host(&self, host: &str) -> Option<Store> {
        let password = format!("{host}-password-0123456789abcdef0123456789").replace('-', "");
        let role = self
            .store
            .ensure_host_role(host, &password)
            .await
            .unwrap()?;
        let url = shoal_store::host_database_url(&self.url, &role, &password).unwrap();
        Some(
            Store::connect_as_host(&url)
                .await
                .expect("open the store as a host"),
        )
    }

    /// Every value of one text column, read around the store.
    pub async fn raw_texts(&self, sql: &str) -> Vec<String> {
        match &self.kind {
            Kind::Sqlite { path, .. } => {
                let mut conn =
                    sqlx::SqliteConnection::connect(&format!("sqlite:{}", path.display()))
                        .await
                        .unwrap();
                let rows = sqlx::query(sql).fetch_all(&mut conn).await.unwrap();
                rows.iter().map(|r| r.get::<String, _>(0)).collect()
            }
            Kind::Postgres { .. } => {
                let mut conn = PgConnection::connect(&self.url).await.unwrap();
                let rows = sqlx::query(sql).fetch_all(&mut conn).await.unwrap();
                rows.iter().map(|r| r.get::<String, _>(0)).collect()
            }
        }
    }

    pub async fn cleanup(&self) {
        self.store.close().await;
        match &self.kind {
            Kind::Sqlite { dir, .. } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Kind::Postgres { admin_url, name } => {
                let mut admin = PgConnection::connect(admin_url).await.unwrap();
                admin
                    .execute(&*format!("DROP DATABASE {name} WITH (FORCE)"))
                    .await
                    .unwrap();
            }
        }
    }
}

pub fn random_suffix() -> String {
    format!(
        "{}_{:016x}",
        std::process::id(),
        rand::thread_rng().gen::<u64>()
    )
}

pub async fn sqlite_db() -> Db {
    let dir = std::env::temp_dir().join(format!("shoal-store-test-{}", random_suffix()));
    // A directory that does not exist yet: connect must create it.
    let path = dir.join("state").join("shoal.db");
    let url = format!("sqlite:{}", path.display());
    let store = Store::connect(&url).await.expect("open SQLite store");
    assert_eq!(store.backend(), "sqlite");
    Db {
        store,
        url,
        kind: Kind::Sqlite { dir, path },
    }
}

/// A fresh database on the server `SHOAL_TEST_DATABASE_URL` names, or None
/// (outside CI) when it names none.
pub async fn postgres_db() -> Option<Db> {
    let Ok(admin_url) = std::env::var("SHOAL_TEST_DATABASE_URL") else {
        if std::env::var_os("CI").is_some() {
            panic!("SHOAL_TEST_DATABASE_URL is not set: under CI the PostgreSQL tests must run (scripts/with-postgres)");
        }
        eprintln!("skipping the PostgreSQL variant: SHOAL_TEST_DATABASE_URL is not set (use scripts/with-postgres)");
        return None;
    };
    let name = format!("shoal_test_{}", random_suffix());
    let mut admin = PgConnection::connect(&admin_url)
        .await
        .expect("connect to SHOAL_TEST_DATABASE_URL");
    admin
        .execute(&*format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    admin.close().await.unwrap();
    let url = with_database(&admin_url, &name);
    let store = Store::connect(&url).await.expect("open PostgreSQL store");
    assert_eq!(store.backend(), "postgres");
    Some(Db {
        store,
        url,
        kind: Kind::Postgres { admin_url, name },
    })
}

/// `url` with its database path replaced by `name`.
pub fn with_database(url: &str, name: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, q)) => (u, Some(q)),
        None => (url, None),
    };
    let authority_start = url.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match url[authority_start..].find('/') {
        Some(slash) => &url[..authority_start + slash],
        None => url,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

pub async fn run_sqlite<F, Fut>(case: F)
where
    F: FnOnce(Arc<Db>) -> Fut,
    Fut: Future<Output = ()>,
{
    run(sqlite_db().await, case).await;
}

pub async fn run_postgres<F, Fut>(case: F)
where
    F: FnOnce(Arc<Db>) -> Fut,
    Fut: Future<Output = ()>,
{
    if let Some(db) = postgres_db().await {
        run(db, case).await;
    }
}

/// Runs the case, then drops its database (only when it passed, so a failed
/// one can be inspected).
pub async fn run<F, Fut>(db: Db, case: F)
where
    F: FnOnce(Arc<Db>) -> Fut,
    Fut: Future<Output = ()>,
{
    let db = Arc::new(db);
    case(db.clone()).await;
    db.cleanup().await;
}

/// Each case as `sqlite::NAME` and `postgres::NAME`.
#[macro_export]
macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::common::run_sqlite(super::$name).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::common::run_postgres(super::$name).await;
                }
            )*
        }
    };
}
