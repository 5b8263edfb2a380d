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
/// How much of a token its owner sees again: `sk_` and 8 characters.
const TOKEN_PREFIX_CHARS: usize = TOKEN_PREFIX.len() + 8;
/// Tokens an account may hold at once (each a row a user makes by asking).
pub const MAX_TOKENS_PER_ACCOUNT: i64 = 100;
/// Longest label a token may carry.
pub const MAX_TOKEN_LABEL: usize = 128;

/// A token as its owner sees it after creating it: never the token itself.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    /// `sk_` and the token's next 8 characters, or, for a token made before
    /// prefixes were kept, the first 12 characters of its hash.
    pub prefix: String,
    pub label: String,
    pub created_at: f64,
    pub expires_at: Option<f64>,
    pub(crate) hash: String,
}

/// Why a user's token was not made or revoked.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenRefusal {
    TooMany,
    NotFound,
    /// More than one of the account's tokens has this prefix.
    Ambiguous,
}

/// Creates the account or changes its tier; yields its id.
const UPSERT_ACCOUNT: &str = "INSERT INTO accounts (name, tier, created_at) VALUES ($1, $2, $3) \
     ON CONFLICT (name) DO UPDATE SET tier = excluded.tier RETURNING id";
const SET_TIER: &str = "UPDATE accounts SET tier = $1 WHERE name = $2";
const INSERT_TOKEN: &str =
    "INSERT INTO tokens (hash, account_id, created_at, prefix, label, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6)";
const AUTHENTICATE: &str = "SELECT a.id, a.name, a.tier FROM tokens t \
     JOIN accounts a ON a.id = t.account_id \
     WHERE t.hash = $1 AND (t.expires_at IS NULL OR t.expires_at > $2)";
const COUNT_TOKENS: &str = "SELECT COUNT(*) AS n FROM tokens WHERE account_id = $1";
const LIST_TOKENS: &str = "SELECT hash, prefix, label, created_at, expires_at FROM tokens \
     WHERE account_id = $1 ORDER BY created_at, hash";
const DELETE_ACCOUNT_TOKEN: &str = "DELETE FROM tokens WHERE account_id = $1 AND hash = $2";
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
            sqlx::query(INSERT_TOKEN)
                .bind(&hash)
                .bind(account_id)
                .bind(now)
                .bind(token_prefix(&token))
                .bind("")
                .bind(None::<f64>)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        });
        Ok(token)
    }

    /// A new token for an existing account, asked for by the account itself
    /// (`POST /v1/me/tokens`): at most [`MAX_TOKENS_PER_ACCOUNT`]. Returns
    /// the plaintext token (shown once, kept nowhere) and what lists show.
    pub async fn create_account_token(
        &self,
        account_id: i64,
        label: &str,
        expires_at: Option<f64>,
    ) -> Result<std::result::Result<(String, TokenInfo), TokenRefusal>> {
        let token = new_token();
        let hash = token_hash(&token);
        let now = unix_now();
        let info = TokenInfo {
            prefix: token_prefix(&token).to_string(),
            label: label.to_string(),
            created_at: now,
            expires_at,
            hash: hash.clone(),
        };
        on_writer!(self, pool => {
            let mut tx = pool.begin().await?;
            let held = sqlx::query(COUNT_TOKENS).bind(account_id).fetch_one(&mut *tx).await?.int("n")?;
            if held >= MAX_TOKENS_PER_ACCOUNT {
                return Ok(Err(TokenRefusal::TooMany));
            }
            sqlx::query(INSERT_TOKEN)
                .bind(&hash)
                .bind(account_id)
                .bind(now)
                .bind(&info.prefix)
                .bind(label)
                .bind(expires_at)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        });
        Ok(Ok((token, info)))
    }

    /// The account's tokens, oldest first (expired ones included, marked by
    /// `expires_at`).
    pub async fn account_tokens(&self, account_id: i64) -> Result<Vec<TokenInfo>> {
        on_reader!(self, pool => {
            let rows = sqlx::query(LIST_TOKENS).bind(account_id).fetch_all(pool).await?;
            rows.iter()
                .map(|r| {
                    let hash = r.text("hash")?;
                    Ok(TokenInfo {
                        prefix: r.opt_text("prefix")?.unwrap_or_else(|| hash[..12].to_string()),
                        label: r.text("label")?,
                        created_at: r.real("created_at")?,
                        expires_at: r.opt_real("expires_at")?,
                        hash,
                    })
                })
                .collect()
        })
    }

    /// Revokes the account's token whose prefix is `prefix`; yields its hash
    /// (the API drops it from its cache). Another account's token is
    /// [`TokenRefusal::NotFound`].
    pub async fn revoke_account_token(
        &self,
        account_id: i64,
        prefix: &str,
    ) -> Result<std::result::Result<String, TokenRefusal>> {
        let matching: Vec<TokenInfo> = self
            .account_tokens(account_id)
            .await?
            .into_iter()
            .filter(|t| t.prefix == prefix)
            .collect();
        let hash = match matching.as_slice() {
            [] => return Ok(Err(TokenRefusal::NotFound)),
            [one] => one.hash.clone(),
            _ => return Ok(Err(TokenRefusal::Ambiguous)),
        };
        let affected = on_writer!(self, pool => {
            sqlx::query(DELETE_ACCOUNT_TOKEN).bind(account_id).bind(&hash).execute(pool).await?.rows_affected()
        });
        Ok(if affected == 1 {
            Ok(hash)
        } else {
            Err(TokenRefusal::NotFound)
        })
    }

    /// The account `token` belongs to, if any. One indexed query.
    pub async fn authenticate(&self, token: &str) -> Result<Option<Account>> {
        let hash = token_hash(token);
        on_reader!(self, pool => {
            sqlx::query(AUTHENTICATE)
                .bind(&hash)
                .bind(unix_now())
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

    /// Moves account `name` to `tier` (an operator's `shoal account
    /// set-tier`); false when there is no such account. Its tokens' cached
    /// accounts keep the old tier until their cache entry expires.
    pub async fn set_account_tier(&self, name: &str, tier: Tier) -> Result<bool> {
        let affected = on_writer!(self, pool => {
            sqlx::query(SET_TIER)
                .bind(tier.as_str())
                .bind(name)
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(affected == 1)
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

/// The API token a request carries, as PandaStack's server reads one:
/// `Authorization: Bearer <token>`, else `X-API-Key: <token>`, else the
/// query's `access_token` (for WebSocket and EventSource clients, which
/// cannot set headers). One reader for the API and the fleet's front.
pub fn request_token(
    authorization: Option<&str>,
    api_key: Option<&str>,
    query: Option<&str>,
) -> Option<String> {
    if let Some(token) = authorization.and_then(bearer_token) {
        return Some(token.to_string());
    }
    if let Some(key) = api_key.map(str::trim).filter(|k| !k.is_empty()) {
        return Some(key.to_string());
    }
    url::form_urlencoded::parse(query?.as_bytes())
        .find(|(name, _)| name == "access_token")
        .map(|(_, value)| value.trim().to_string())
        .filter(|token| !token.is_empty())
}

/// What a token's owner sees of it again.
fn token_prefix(token: &str) -> &str {
    &token[..TOKEN_PREFIX_CHARS.min(token.len())]
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
    fn tokens_come_from_header_key_or_query() {
        assert_eq!(
            request_token(Some("Bearer a"), Some("b"), Some("access_token=c")).as_deref(),
            Some("a")
        );
        assert_eq!(
            request_token(Some("Basic x"), Some(" b "), Some("access_token=c")).as_deref(),
            Some("b")
        );
        assert_eq!(
            request_token(None, Some(""), Some("rows=3&access_token=sk%5Fc")).as_deref(),
            Some("sk_c")
        );
        assert_eq!(request_token(None, None, Some("access_token=")), None);
        assert_eq!(request_token(None, None, Some("token=c")), None);
        assert_eq!(request_token(None, None, None), None);
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
