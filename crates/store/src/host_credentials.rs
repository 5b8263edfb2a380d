//! Each host's own identity: one-time join tokens and the per-host
//! credentials agents get for them.
//!
//! An operator issues a join token (`shoal host join-token`); an agent
//! spends it once, naming its host id, and gets a secret bound to that id.
//! Only SHA-256 hashes of either are stored, so a copy of the database
//! authenticates no host. Revoking a host turns its credential off and
//! makes its sandboxes `lost`; a new join token brings the name back.

use crate::accounts::token_hash;
use crate::row::Column;
use crate::{on_reader, on_writer, Result, Store, StoreError};
use rand::distributions::Alphanumeric;
use rand::Rng;

const JOIN_TOKEN_PREFIX: &str = "sj_";
const HOST_SECRET_PREFIX: &str = "sh_";

const INSERT_JOIN_TOKEN: &str =
    "INSERT INTO join_tokens (hash, created_at, expires_at) VALUES ($1, $2, $3)";
/// Spends a join token: only one that is unused and unexpired, once.
const SPEND_JOIN_TOKEN: &str = "UPDATE join_tokens SET used_by = $2, used_at = $3 \
     WHERE hash = $1 AND used_at IS NULL AND expires_at > $3";
const LIVE_HOST: &str = "SELECT h.id FROM hosts h JOIN host_credentials c ON c.host_id = h.id \
     WHERE h.id = $1 AND h.heartbeat_at >= $2 AND c.revoked_at IS NULL";
const UPSERT_CREDENTIAL: &str = "INSERT INTO host_credentials (host_id, secret_hash, joined_at) \
     VALUES ($1, $2, $3) ON CONFLICT (host_id) DO UPDATE SET secret_hash = excluded.secret_hash, \
     joined_at = excluded.joined_at, revoked_at = NULL";
const HOST_OF_SECRET: &str =
    "SELECT host_id FROM host_credentials WHERE secret_hash = $1 AND revoked_at IS NULL";
const REVOKE: &str =
    "UPDATE host_credentials SET revoked_at = $2 WHERE host_id = $1 AND revoked_at IS NULL";
/// A revoked host is stale at once: nothing is placed on or routed to it.
const FORGET_HEARTBEAT: &str = "UPDATE hosts SET heartbeat_at = 0 WHERE id = $1";
const LOSE_SANDBOXES_OF_HOST: &str = "UPDATE sandboxes SET status = 'lost' \
     WHERE host = $1 AND status NOT IN ('deleted', 'failed', 'lost') RETURNING id";

/// Why a join was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum JoinRefusal {
    /// Unknown, already spent or expired.
    BadToken,
    /// A live host already answers to this name.
    NameLive,
}

impl Store {
    /// Issues a join token valid for `ttl_seconds` from `now`; returns the
    /// plaintext, which is not kept anywhere.
    pub async fn create_join_token(&self, now: f64, ttl_seconds: f64) -> Result<String> {
        let token = secret(JOIN_TOKEN_PREFIX);
        on_writer!(self, pool => {
            sqlx::query(INSERT_JOIN_TOKEN)
                .bind(token_hash(&token))
                .bind(now)
                .bind(now + ttl_seconds)
                .execute(pool)
                .await?;
        });
        Ok(token)
    }

    /// Spends `join_token` for host `host_id` and issues that host a new
    /// credential (replacing a revoked or older one). A host whose last
    /// heartbeat is at or after `live_since` and whose credential stands
    /// keeps its name: the join is refused and the token stays unspent.
    /// Returns the host's secret.
    pub async fn join_host(
        &self,
        join_token: &str,
        host_id: &str,
        now: f64,
        live_since: f64,
    ) -> Result<std::result::Result<String, JoinRefusal>> {
        let host_secret = secret(HOST_SECRET_PREFIX);
        on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            let live = sqlx::query(LIVE_HOST)
                .bind(host_id)
                .bind(live_since)
                .fetch_optional(&mut *tx)
                .await?;
            if live.is_some() {
                return Ok(Err(JoinRefusal::NameLive));
            }
            let spent = sqlx::query(SPEND_JOIN_TOKEN)
                .bind(token_hash(join_token))
                .bind(host_id)
                .bind(now)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if spent != 1 {
                return Ok(Err(JoinRefusal::BadToken));
            }
            sqlx::query(UPSERT_CREDENTIAL)
                .bind(host_id)
                .bind(token_hash(&host_secret))
                .bind(now)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        });
        Ok(Ok(host_secret))
    }

    /// The host a secret speaks for, if it is a standing credential.
    pub async fn host_of_secret(&self, host_secret: &str) -> Result<Option<String>> {
        on_reader!(self, pool => {
            sqlx::query(HOST_OF_SECRET)
                .bind(token_hash(host_secret))
                .fetch_optional(pool)
                .await?
                .map(|r| r.text("host_id"))
                .transpose()
                .map_err(StoreError::from)
        })
    }

    /// Cuts a host off: its credential stops authenticating, it is stale at
    /// once and its live sandboxes are `lost`. Returns their ids, or `None`
    /// when the host has no standing credential. Its database role, if it
    /// has one, is disabled and its sessions ended.
    pub async fn revoke_host(&self, host_id: &str, now: f64) -> Result<Option<Vec<String>>> {
        let lost = self.revoke_credential(host_id, now).await?;
        if lost.is_some() {
            self.disable_host_role(host_id).await?;
        }
        Ok(lost)
    }

    async fn revoke_credential(&self, host_id: &str, now: f64) -> Result<Option<Vec<String>>> {
        on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            let revoked = sqlx::query(REVOKE)
                .bind(host_id)
                .bind(now)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if revoked == 0 {
                return Ok(None);
            }
            sqlx::query(FORGET_HEARTBEAT).bind(host_id).execute(&mut *tx).await?;
            let lost = sqlx::query(LOSE_SANDBOXES_OF_HOST)
                .bind(host_id)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| r.text("id"))
                .collect::<sqlx::Result<Vec<String>>>()?;
            tx.commit().await?;
            Ok(Some(lost))
        })
    }
}

/// A prefix and 43 random alphanumerics (about 256 bits).
fn secret(prefix: &str) -> String {
    let random: String = rand::rngs::OsRng
        .sample_iter(&Alphanumeric)
        .take(43)
        .map(char::from)
        .collect();
    format!("{prefix}{random}")
}
