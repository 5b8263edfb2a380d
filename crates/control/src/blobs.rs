//! An account's blobs over HTTP (issue 22's data path): which of a job's
//! inputs the API lacks, uploading one by its SHA-256, downloading one;
//! and [`BlobWriter`], which the routes and the sweep runner's result
//! collection both use to store bytes whose digest is known only at the end.
//!
//! Owns: the limits of a blob (size, an account's total) and the check of
//! an upload against the digest it claims. May not: read blobs of another
//! account (every store call names the caller's).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use shoal_store::{Store, BLOB_CHUNK};

use crate::error::{ApiError, ApiResult};
use crate::extract::{field, json_object, Caller};
use crate::{now, ControlPlane};

/// One blob at most: a job's input file, a task's result file.
pub const MAX_BLOB_BYTES: u64 = 1 << 30;
/// All of an account's blobs at most.
pub const MAX_ACCOUNT_BLOB_BYTES: u64 = 16 << 30;
/// Digests one `missing` request may ask about.
pub const MAX_DIGESTS: usize = 100_000;
/// An upload that sends nothing for this long is dropped.
const UPLOAD_STALL: Duration = Duration::from_secs(60);

type St = State<Arc<ControlPlane>>;

/// Whether `digest` is a SHA-256 as lowercase hex.
pub fn is_digest(digest: &str) -> bool {
    digest.len() == 64
        && digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Writes one blob chunk by chunk under a staging name, hashing as it
/// goes; [`BlobWriter::commit`] names it by its digest. Dropped without a
/// commit, it leaves staged chunks that garbage collection removes (call
/// [`BlobWriter::discard`] to remove them at once).
pub struct BlobWriter {
    store: Store,
    account_id: i64,
    staging: String,
    hasher: Sha256,
    buffer: Vec<u8>,
    next_seq: u64,
    size: u64,
    limit: u64,
}

/// Why bytes could not become a blob.
#[derive(Debug)]
pub enum BlobRefusal {
    /// Past the limit given to [`BlobWriter::new`].
    TooLarge(u64),
    Store(shoal_store::StoreError),
}

impl std::fmt::Display for BlobRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlobRefusal::TooLarge(limit) => write!(f, "larger than {limit} bytes"),
            BlobRefusal::Store(e) => write!(f, "storing it: {e}"),
        }
    }
}

impl From<shoal_store::StoreError> for BlobRefusal {
    fn from(e: shoal_store::StoreError) -> Self {
        BlobRefusal::Store(e)
    }
}

impl BlobWriter {
    pub fn new(store: Store, account_id: i64, limit: u64) -> BlobWriter {
        BlobWriter {
            store,
            account_id,
            staging: shoal_store::staging_key(now()),
            hasher: Sha256::new(),
            buffer: Vec::with_capacity(BLOB_CHUNK),
            next_seq: 0,
            size: 0,
            limit,
        }
    }

    pub async fn write(&mut self, mut bytes: &[u8]) -> Result<(), BlobRefusal> {
        self.size += bytes.len() as u64;
        if self.size > self.limit {
            return Err(BlobRefusal::TooLarge(self.limit));
        }
        self.hasher.update(bytes);
        while !bytes.is_empty() {
            let room = BLOB_CHUNK - self.buffer.len();
            let (now, later) = bytes.split_at(room.min(bytes.len()));
            self.buffer.extend_from_slice(now);
            bytes = later;
            if self.buffer.len() == BLOB_CHUNK {
                self.flush().await?;
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), BlobRefusal> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        self.store
            .put_blob_chunk(self.account_id, &self.staging, self.next_seq, &self.buffer)
            .await?;
        self.next_seq += 1;
        self.buffer.clear();
        Ok(())
    }

    /// The digest of what was written so far.
    pub fn digest(&self) -> String {
        hex::encode(self.hasher.clone().finalize())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Stores the rest and names the blob by its digest; returns it.
    pub async fn commit(mut self) -> Result<String, BlobRefusal> {
        self.flush().await?;
        let digest = self.digest();
        self.store
            .commit_blob(self.account_id, &self.staging, &digest, self.size, now())
            .await?;
        Ok(digest)
    }

    /// Drops what was staged.
    pub async fn discard(self) {
        if let Err(e) = self
            .store
            .discard_staged_blob(self.account_id, &self.staging)
            .await
        {
            tracing::warn!(error = %e, "dropping a staged blob");
        }
    }
}

/// Streams the account's blob, chunk by chunk, as a response body.
pub fn blob_body(store: Store, account_id: i64, digest: String) -> axum::body::Body {
    let chunks = futures::stream::unfold(Some(0u64), move |seq| {
        let store = store.clone();
        let digest = digest.clone();
        async move {
            let seq = seq?;
            match store.blob_chunk(account_id, &digest, seq).await {
                Ok(Some(data)) => Some((Ok(axum::body::Bytes::from(data)), Some(seq + 1))),
                Ok(None) => None,
                Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
            }
        }
    });
    axum::body::Body::from_stream(chunks)
}

// ---- routes ----

/// `POST /v1/blobs/missing` `{"digests": [...]}`: the ones the account
/// lacks, so a client uploads only what changed.
pub async fn missing(
    State(cp): St,
    Caller(account): Caller,
    request: Request,
) -> ApiResult<Json<Value>> {
    let body = json_object(request, 8 << 20).await?;
    let digests = field(&body, "digests")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("digests must be a list of SHA-256 digests"))?;
    if digests.len() > MAX_DIGESTS {
        return Err(ApiError::bad_request(format!(
            "digests: at most {MAX_DIGESTS} at once"
        )));
    }
    let digests = digests
        .iter()
        .map(|d| match d.as_str() {
            Some(d) if is_digest(d) => Ok(d.to_owned()),
            _ => Err(ApiError::bad_request(format!(
                "digests: {d} is not a SHA-256 digest (64 lowercase hex digits)"
            ))),
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let missing = cp.store.missing_blobs(account.id, &digests).await?;
    Ok(Json(json!({ "missing": missing })))
}

/// `PUT /v1/blobs/{sha256}`: stores the body if its SHA-256 is the one
/// named. 201 when stored, 200 when the account had it already.
pub async fn upload(
    State(cp): St,
    Caller(account): Caller,
    Path(digest): Path<String>,
    request: Request,
) -> ApiResult<(StatusCode, Json<Value>)> {
    if !is_digest(&digest) {
        return Err(ApiError::bad_request(format!(
            "{digest:?} is not a SHA-256 digest (64 lowercase hex digits)"
        )));
    }
    if let Some(size) = cp.store.blob_size(account.id, &digest).await? {
        return Ok((
            StatusCode::OK,
            Json(json!({ "digest": digest, "size": size })),
        ));
    }
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a blob is at most {MAX_BLOB_BYTES} bytes"),
        )
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BLOB_BYTES) {
        return Err(too_large());
    }
    let used = cp.store.account_blob_bytes(account.id).await?;
    let room = MAX_ACCOUNT_BLOB_BYTES.saturating_sub(used);
    let over_quota = || {
        ApiError::new(
            StatusCode::INSUFFICIENT_STORAGE,
            format!(
                "the account's stored job data would pass {MAX_ACCOUNT_BLOB_BYTES} bytes \
                 ({used} used); unused data goes 35 days after a job last named it"
            ),
        )
    };
    if declared.is_some_and(|n| n > room) {
        return Err(over_quota());
    }
    let mut writer = BlobWriter::new(cp.store.clone(), account.id, MAX_BLOB_BYTES.min(room));
    let mut body = request.into_body().into_data_stream();
    let outcome: ApiResult<()> = async {
        loop {
            let next = tokio::time::timeout(UPLOAD_STALL, body.next())
                .await
                .map_err(|_| ApiError::bad_request("the upload stalled"))?;
            let Some(chunk) = next else {
                return Ok(());
            };
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("reading the upload: {e}")))?;
            writer.write(&chunk).await.map_err(|e| match e {
                BlobRefusal::TooLarge(_) if room < MAX_BLOB_BYTES => over_quota(),
                BlobRefusal::TooLarge(_) => too_large(),
                BlobRefusal::Store(e) => e.into(),
            })?;
        }
    }
    .await;
    if let Err(e) = outcome {
        writer.discard().await;
        return Err(e);
    }
    if writer.digest() != digest {
        let got = writer.digest();
        writer.discard().await;
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("the upload's SHA-256 is {got}, not {digest}"),
        ));
    }
    let size = writer.size();
    writer.commit().await.map_err(|e| match e {
        BlobRefusal::Store(e) => ApiError::from(e),
        other => ApiError::internal(other.to_string()),
    })?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "digest": digest, "size": size })),
    ))
}

/// `GET /v1/blobs/{sha256}`: the account's blob.
pub async fn download(
    State(cp): St,
    Caller(account): Caller,
    Path(digest): Path<String>,
) -> ApiResult<Response> {
    let size = match is_digest(&digest) {
        true => cp.store.blob_size(account.id, &digest).await?,
        false => None,
    }
    .ok_or_else(|| ApiError::not_found("blob not found"))?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        blob_body(cp.store.clone(), account.id, digest),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_lowercase_sha256_hex() {
        let good = hex::encode(Sha256::digest(b"x"));
        assert!(is_digest(&good));
        assert!(!is_digest(&good.to_uppercase()));
        assert!(!is_digest(&good[1..]));
        assert!(!is_digest("../../etc/passwd"));
    }
}
