//! Hosts' own PostgreSQL roles, so that no host holds the fronts'
//! database credentials.
//!
//! The front makes one LOGIN role per host when it joins or fetches its
//! configuration, a member of `shoal_hosts`, whose rights
//! `migrations/postgres/0009_host_roles.sql` sets: no credential table
//! (tokens, join tokens, host credentials), and writes to sandbox,
//! snapshot, volume, usage and attachment rows of its own host only (row
//! level security, keyed on `host_roles`). Revoking a host disables its
//! role and ends its sessions.
//!
//! Roles belong to the cluster and the map to the database, so the role's
//! name is derived from both (two databases of one cluster, such as test
//! databases, never share a host's role). SQLite has no roles: there the
//! calls do nothing and a host opens the same file as its front.

use crate::{Backend, Result, Store};
use sha2::{Digest, Sha256};

/// Most sessions one host's role may hold at once: a host cannot take the
/// database's connections from the others (its pool uses 4).
const HOST_CONNECTION_LIMIT: u32 = 16;

/// Serialises role changes of all fronts (CREATE ROLE is not idempotent).
const LOCK_ROLES: &str = "SELECT pg_advisory_xact_lock(hashtextextended('shoal host roles', 0))";
const MAP_ROLE: &str = "INSERT INTO host_roles (role_name, host_id) VALUES ($1, $2) \
     ON CONFLICT (role_name) DO UPDATE SET host_id = excluded.host_id";
const ROLE_OF_HOST: &str = "SELECT role_name FROM host_roles WHERE host_id = $1";

impl Store {
    /// Makes, or enables again with `password`, the role host `host_id`
    /// logs in as, and returns its name; `None` on SQLite. `password` must
    /// be letters and digits (it is written into the statement: PostgreSQL
    /// takes no parameters in `ALTER ROLE`).
    pub async fn ensure_host_role(&self, host_id: &str, password: &str) -> Result<Option<String>> {
        let Backend::Postgres(pool) = &*self.inner else {
            return Ok(None);
        };
        if password.len() < 32 || !password.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(crate::StoreError::Corrupt(
                "a host role's password must be 32 or more letters and digits".into(),
            ));
        }
        let database: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(pool)
            .await?;
        let role = role_name(&database, host_id);
        let mut tx = pool.begin().await?;
        sqlx::query(LOCK_ROLES).execute(&mut *tx).await?;
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
                .bind(&role)
                .fetch_one(&mut *tx)
                .await?;
        let verb = if exists { "ALTER" } else { "CREATE" };
        sqlx::query(&format!(
            "{verb} ROLE \"{role}\" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE INHERIT \
             CONNECTION LIMIT {HOST_CONNECTION_LIMIT} PASSWORD '{password}'"
        ))
        .execute(&mut *tx)
        .await?;
        sqlx::query(&format!("GRANT shoal_hosts TO \"{role}\""))
            .execute(&mut *tx)
            .await?;
        sqlx::query(MAP_ROLE)
            .bind(&role)
            .bind(host_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(role))
    }

    /// Disables host `host_id`'s role, if it has one, and ends its open
    /// sessions: a revoked host's pool can no longer write anything.
    pub async fn disable_host_role(&self, host_id: &str) -> Result<()> {
        let Backend::Postgres(pool) = &*self.inner else {
            return Ok(());
        };
        let role: Option<String> = sqlx::query_scalar(ROLE_OF_HOST)
            .bind(host_id)
            .fetch_optional(pool)
            .await?;
        let Some(role) = role else {
            return Ok(());
        };
        let mut tx = pool.begin().await?;
        sqlx::query(LOCK_ROLES).execute(&mut *tx).await?;
        sqlx::query(&format!("ALTER ROLE \"{role}\" NOLOGIN"))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
            .bind(&role)
            .execute(pool)
            .await?;
        Ok(())
    }
}

/// `database_url` (a PostgreSQL URL) with `role` and `password` as its
/// user: what a host is given in place of the fronts' own URL. Host, port,
/// database and parameters (`sslmode`) stay.
pub fn host_database_url(database_url: &str, role: &str, password: &str) -> Result<String> {
    let bad = || crate::StoreError::BadUrl(database_url.to_owned());
    let mut url = url::Url::parse(database_url).map_err(|_| bad())?;
    url.set_username(role).map_err(|()| bad())?;
    url.set_password(Some(password)).map_err(|()| bad())?;
    Ok(url.into())
}

/// `shoal_host_` and 24 hex digits of SHA-256 over the database and host
/// names: within PostgreSQL's 63 bytes whatever the host's name, and only
/// characters that need no quoting.
fn role_name(database: &str, host_id: &str) -> String {
    let digest = Sha256::digest(format!("{database}\0{host_id}").as_bytes());
    format!("shoal_host_{}", &hex::encode(digest)[..24])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_url_keeps_the_server_and_parameters_and_replaces_the_user() {
        let url = host_database_url(
            "postgres://shoal:front-secret@db.example:5433/fleet?sslmode=require",
            "shoal_host_0123",
            "abc123",
        )
        .unwrap();
        assert_eq!(
            url,
            "postgres://shoal_host_0123:abc123@db.example:5433/fleet?sslmode=require"
        );
        assert!(host_database_url("not a url", "r", "p").is_err());
    }

    #[test]
    fn role_names_are_short_plain_and_per_database() {
        let a = role_name("fleet", "host-a");
        assert!(a.len() <= 63);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
        assert_ne!(a, role_name("other", "host-a"));
        assert_ne!(a, role_name("fleet", "host-b"));
        assert_eq!(a, role_name("fleet", "host-a"));
    }
}
