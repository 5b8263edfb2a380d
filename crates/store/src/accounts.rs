//! Accounts and API tokens. A token is `sk_` and 43 random alphanumerics
//! (about 256 bits); only its SHA-256 is stored, so a copy of the database
//! authenticates no one.

use rand::distributions::Alphanumeric;
use rand::Rng;
use sha2::{Digest, Sha256};

use crate::row::{self, Column};
use crate::{on_reader, on_writer, Account, Result, Store, Tier};

const TOKEN_PREFIX: &str = "sk_";
const TOKEN_RANDOM_CHARS: usize = 43;

/// Creates the account or changes its tier; yields its id.
const UPSERT_ACCOUNT: &str = "INSERT INTO accounts (name, tier, created_at) VALUES ($1, $2, $3) \
     ON CONFLICT (name) DO UPDATE SET tier = excluded.tier RETURNING id";
const INSERT_TOKEN: &str = "INSERT INTO tokens (hash, account_id, created_at) VALUES ($1, $2, $3)";
const AUTHENTICATE: &str = "SELECT a.id, a.name, a.tier FROM tokens t \
     JOIN accounts a ON a.id = t.account_id WHERE t.hash = $1";
const ACCOUNT_BY_NAME: &str = "SELECT id, name, tier FROM accounts WHERE name = $1";
const ACCOUNT_BY_ID: &str = "SELECT id, name, tier FROM accounts WHERE id = $1";
const DELETE_TOKEN: &str = "DELETE FROM tokens WHERE hash = $1";

impl Store {
    /// Issues a new token for `account`, creating the account with `tier` if
    /// it does not exist and setting its tier if it does. Returns the
    /// plaintext token, which is not kept anywhere.
    pub async fn create_token(&self, account: &str, tier: Tier) -> Result<String> {
        let token = new_token();
        let hash = token_hash(&token);
        let now = unix_now();
        on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            let account_id: i64 = sqlx::query(UPSERT_ACCOUNT)
                .bind(account)
                .bind(tier.as_str())
                .bind(now)
                .fetch_one(&mut *tx)
                .await?
                .int("id")?;
            sqlx::query(INSERT_TOKEN).bind(&hash).bind(account_id).bind(now).execute(&mut *tx).await?;
            tx.commit().await?;
        });
        Ok(token)
    }

    /// The account `token` belongs to, if any. One indexed query.
    pub async fn authenticate(&self, token: &str) -> Result<Option<Account>> {
        let hash = token_hash(token);
        on_reader!(self, pool => {
            sqlx::query(AUTHENTICATE)
                .bind(&hash)
                .fetch_optional(pool)
                .await?
                .map(|r| row::account(&r))
                .transpose()
        })
    }

    pub async fn account_by_name(&self, name: &str) -> Result<Option<Account>> {
        on_reader!(self, pool => {
            sqlx::query(ACCOUNT_BY_NAME)
                .bind(name)
                .fetch_optional(pool)
                .await?
                .map(|r| row::account(&r))
                .transpose()
        })
    }

    pub async fn account_by_id(&self, id: i64) -> Result<Option<Account>> {
        on_reader!(self, pool => {
            sqlx::query(ACCOUNT_BY_ID)
                .bind(id)
                .fetch_optional(pool)
                .await?
                .map(|r| row::account(&r))
                .transpose()
        })
    }

    /// Makes `token` stop authenticating; false if it did not.
    pub async fn revoke_token(&self, token: &str) -> Result<bool> {
        let hash = token_hash(token);
        let affected = on_writer!(self, pool => {
            sqlx::query(DELETE_TOKEN).bind(&hash).execute(pool).await?.rows_affected()
        });
        Ok(affected > 0)
    }
}

fn new_token() -> String {
    let random: String = rand::rngs::OsRng
        .sample_iter(&Alphanumeric)
        .take(TOKEN_RANDOM_CHARS)
        .map(char::from)
        .collect();
    format!("{TOKEN_PREFIX}{random}")
}

/// The token of an `Authorization: Bearer <token>` header value, if it
/// holds a non-empty one (the scheme's case does not matter, RFC 7235).
/// One parser for every API that takes tokens.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// What the database stores for a token: lowercase hex of its SHA-256.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Wall-clock time for bookkeeping columns (`created_at` of accounts and
/// tokens) that no decision reads.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_prefixed_random_and_hash_to_hex() {
        let a = new_token();
        let b = new_token();
        assert!(a.starts_with("sk_") && a.len() == 3 + TOKEN_RANDOM_CHARS);
        assert!(a[3..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, b);
        let h = token_hash(&a);
        assert_eq!(h.len(), 64);
        assert!(!h.contains(&a[3..]));
    }

    #[test]
    fn bearer_tokens_are_parsed() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("Bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer    "), None);
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("abc"), None);
    }
}
