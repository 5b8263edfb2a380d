//! The schema's migrations, compiled into the binary (nothing is read from
//! disk at run time) and applied by sqlx's migrator, which records them in
//! `_sqlx_migrations` and, on PostgreSQL, holds an advisory lock so that
//! control planes starting together migrate once.
//!
//! Each migration exists twice, `migrations/sqlite/NNNN_*.sql` and
//! `migrations/postgres/NNNN_*.sql`, with the same version and the same
//! tables, columns and indexes; only the column types differ. Versions need
//! not be contiguous, and a version missing from a database is applied
//! whatever the versions it already has (sqlx applies every unapplied one),
//! so branches may take numbers independently.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;

use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx::{PgPool, SqlitePool};

use crate::Result;

/// (version, description, SQL) of one migration.
type Embedded = (i64, &'static str, &'static str);

const SQLITE: &[Embedded] = &[
    (
        1,
        "init",
        include_str!("../migrations/sqlite/0001_init.sql"),
    ),
    (
        2,
        "sweeps",
        include_str!("../migrations/sqlite/0002_sweeps.sql"),
    ),
    (
        3,
        "sweep runner",
        include_str!("../migrations/sqlite/0003_sweep_runner.sql"),
    ),
    (
        4,
        "hosts",
        include_str!("../migrations/sqlite/0004_hosts.sql"),
    ),
    (
        5,
        "volumes",
        include_str!("../migrations/sqlite/0005_volumes.sql"),
    ),
    (
        6,
        "apps",
        include_str!("../migrations/sqlite/0006_apps.sql"),
    ),
    (
        7,
        "status reason",
        include_str!("../migrations/sqlite/0007_status_reason.sql"),
    ),
    (
        8,
        "host credentials",
        include_str!("../migrations/sqlite/0008_host_credentials.sql"),
    ),
    (
        9,
        "host roles",
        include_str!("../migrations/sqlite/0009_host_roles.sql"),
    ),
    (
        10,
        "tenant env",
        include_str!("../migrations/sqlite/0010_tenant_env.sql"),
    ),
    (
        11,
        "templates",
        include_str!("../migrations/sqlite/0011_templates.sql"),
    ),
    (
        12,
        "template grants",
        include_str!("../migrations/sqlite/0012_template_grants.sql"),
    ),
    (
        13,
        "template start",
        include_str!("../migrations/sqlite/0013_template_start.sql"),
    ),
    (
        14,
        "template builds",
        include_str!("../migrations/sqlite/0014_template_builds.sql"),
    ),
    (
        15,
        "template published",
        include_str!("../migrations/sqlite/0015_template_published.sql"),
    ),
    (
        16,
        "snapshot size",
        include_str!("../migrations/sqlite/0016_snapshot_size.sql"),
    ),
    (
        17,
        "job data",
        include_str!("../migrations/sqlite/0017_job_data.sql"),
    ),
    (
        18,
        "tokens and events",
        include_str!("../migrations/sqlite/0018_tokens_events.sql"),
    ),
    (
        19,
        "event grants",
        include_str!("../migrations/sqlite/0019_event_grants.sql"),
    ),
    (
        20,
        "host drain",
        include_str!("../migrations/sqlite/0020_host_drain.sql"),
    ),
    (
        21,
        "snapshot removal",
        include_str!("../migrations/sqlite/0021_snapshot_removal.sql"),
    ),
];

const POSTGRES: &[Embedded] = &[
    (
        1,
        "init",
        include_str!("../migrations/postgres/0001_init.sql"),
    ),
    (
        2,
        "sweeps",
        include_str!("../migrations/postgres/0002_sweeps.sql"),
    ),
    (
        3,
        "sweep runner",
        include_str!("../migrations/postgres/0003_sweep_runner.sql"),
    ),
    (
        4,
        "hosts",
        include_str!("../migrations/postgres/0004_hosts.sql"),
    ),
    (
        5,
        "volumes",
        include_str!("../migrations/postgres/0005_volumes.sql"),
    ),
    (
        6,
        "apps",
        include_str!("../migrations/postgres/0006_apps.sql"),
    ),
    (
        7,
        "status reason",
        include_str!("../migrations/postgres/0007_status_reason.sql"),
    ),
    (
        8,
        "host credentials",
        include_str!("../migrations/postgres/0008_host_credentials.sql"),
    ),
    (
        9,
        "host roles",
        include_str!("../migrations/postgres/0009_host_roles.sql"),
    ),
    (
        10,
        "tenant env",
        include_str!("../migrations/postgres/0010_tenant_env.sql"),
    ),
    (
        11,
        "templates",
        include_str!("../migrations/postgres/0011_templates.sql"),
    ),
    (
        12,
        "template grants",
        include_str!("../migrations/postgres/0012_template_grants.sql"),
    ),
    (
        13,
        "template start",
        include_str!("../migrations/postgres/0013_template_start.sql"),
    ),
    (
        14,
        "template builds",
        include_str!("../migrations/postgres/0014_template_builds.sql"),
    ),
    (
        15,
        "template published",
        include_str!("../migrations/postgres/0015_template_published.sql"),
    ),
    (
        16,
        "snapshot size",
        include_str!("../migrations/postgres/0016_snapshot_size.sql"),
    ),
    (
        17,
        "job data",
        include_str!("../migrations/postgres/0017_job_data.sql"),
    ),
    (
        18,
        "tokens and events",
        include_str!("../migrations/postgres/0018_tokens_events.sql"),
    ),
    (
        19,
        "event grants",
        include_str!("../migrations/postgres/0019_event_grants.sql"),
    ),
    (
        20,
        "host drain",
        include_str!("../migrations/postgres/0020_host_drain.sql"),
    ),
    (
        21,
        "snapshot removal",
        include_str!("../migrations/postgres/0021_snapshot_removal.sql"),
    ),
];

#[derive(Debug)]
struct Source(&'static [Embedded]);

impl<'s> MigrationSource<'s> for Source {
    fn resolve(
        self,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<Migration>, BoxDynError>> + Send + 's>> {
        let migrations = self
            .0
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    Cow::Borrowed(sql),
                    false,
                )
            })
            .collect();
        Box::pin(async move { Ok(migrations) })
    }
}

pub(crate) async fn run_sqlite(pool: &SqlitePool) -> Result<()> {
    Migrator::new(Source(SQLITE)).await?.run(pool).await?;
    Ok(())
}

pub(crate) async fn run_postgres(pool: &PgPool) -> Result<()> {
    Migrator::new(Source(POSTGRES)).await?.run(pool).await?;
    Ok(())
}

/// Refuses a database whose schema lacks a migration this binary knows
/// (what a host, which may not migrate, does instead of [`run_postgres`]).
pub(crate) async fn check_postgres(pool: &PgPool) -> Result<()> {
    let found: Option<i64> =
        sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(pool)
            .await?;
    let needed = POSTGRES.iter().map(|m| m.0).max().unwrap_or(0);
    let found = found.unwrap_or(0);
    if found < needed {
        return Err(crate::StoreError::SchemaBehind { found, needed });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Versions that only PostgreSQL gives content (roles and row-level
    /// security, which SQLite has not); SQLite's are no-ops of the same number.
    const POSTGRES_ONLY: &[i64] = &[9, 10, 12, 19];

    /// The two flavours must describe the same schema: same versions, and
    /// the same statements once column types are folded together.
    #[test]
    fn flavours_match() {
        assert_eq!(SQLITE.len(), POSTGRES.len());
        let fold = |sql: &str| {
            sql.lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                // Grants to the hosts' role are PostgreSQL's alone (SQLite
                // has no roles), beside a table both flavours make.
                .filter(|l| !l.trim_start().starts_with("GRANT "))
                .collect::<Vec<_>>()
                .join("\n")
                .replace(
                    "GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
                    "PRIMARY KEY AUTOINCREMENT",
                )
                .replace("DOUBLE PRECISION", "REAL")
                .replace("BIGINT", "INTEGER")
                .replace("BYTEA", "BLOB")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        for (s, p) in SQLITE.iter().zip(POSTGRES) {
            assert_eq!((s.0, s.1), (p.0, p.1));
            if POSTGRES_ONLY.contains(&s.0) {
                assert_eq!(fold(s.2), "SELECT 1;", "migration {} is postgres only", s.0);
                continue;
            }
            assert_eq!(
                fold(s.2),
                fold(p.2),
                "migration {} differs between backends",
                s.0
            );
        }
    }
}
