//! The few API calls the Slurm and template commands make: templates,
//! builds, sweeps, cells, cancel. Answers are kept as JSON; the views and the follower read the
//! fields they need (the contract is docs/api/SWEEPS.md).
//!
//! Owns: HTTP, the bearer token, turning a non-2xx into an error carrying
//! the API's own `error` message, paging through cells.
//! May not: decide anything about jobs.

use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};

use super::config::Config;

/// Cells per page (the API's maximum).
const PAGE: usize = 1000;
/// Digests per `missing` call.
const DIGEST_BATCH: usize = 10_000;
/// A blob's transfer at most (1 GiB at a little over 2 Mbit/s).
const BLOB_TRANSFER: std::time::Duration = std::time::Duration::from_secs(3600);

pub struct Api {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    pub fn new(config: &Config) -> Result<Api> {
        Ok(Api {
            http: shoal_fleet::tls::client_builder(config.ca_file.as_deref())?
                .timeout(std::time::Duration::from_secs(60))
                .build()?,
            base: config.base_url()?,
            token: config.token()?,
        })
    }

    /// The API's address.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// A request to `path` carrying the caller's token.
    pub(crate) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
    }

    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(body);
        }
        self.send(request).await
    }

    /// Sends a request and reads its JSON answer.
    pub(crate) async fn send(&self, request: reqwest::RequestBuilder) -> Result<Value> {
        let response = self.open(request).await?;
        let text = response.text().await.unwrap_or_default();
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// Sends a request and hands back a 2xx response unread (a stream);
    /// any other status is an error carrying the API's own message.
    pub(crate) async fn open(&self, request: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let request = request.build()?;
        let url = request.url().to_string();
        let response = self
            .http
            .execute(request)
            .await
            .with_context(|| format!("calling {url}"))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let message = value["error"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| text.trim().to_owned());
        Err(anyhow!("{status}: {message}"))
    }

    /// `[{name, cpu, memory_mb}...]`, the templates this API can run.
    pub async fn templates(&self) -> Result<Vec<Value>> {
        let v = self
            .call(reqwest::Method::GET, "/v1/templates", None)
            .await?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    pub async fn create_sweep(&self, body: &Value) -> Result<Value> {
        self.call(reqwest::Method::POST, "/v1/sweeps", Some(body))
            .await
    }

    /// One sweep by id or job id; `None` when the API does not know it.
    pub async fn sweep(&self, id: &str) -> Result<Option<Value>> {
        match self
            .call(reqwest::Method::GET, &format!("/v1/sweeps/{id}"), None)
            .await
        {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.to_string().starts_with("404") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every sweep of the caller, newest first.
    pub async fn sweeps(&self) -> Result<Vec<Value>> {
        let v = self.call(reqwest::Method::GET, "/v1/sweeps", None).await?;
        Ok(v["sweeps"].as_array().cloned().unwrap_or_default())
    }

    /// Every cell of a sweep, in index order (outputs cut to their tails).
    pub async fn cells(&self, id: &str) -> Result<Vec<Value>> {
        let mut all = Vec::new();
        loop {
            let v = self
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/sweeps/{id}/cells?offset={}&limit={PAGE}", all.len()),
                    None,
                )
                .await?;
            let page = v["cells"].as_array().cloned().unwrap_or_default();
            let total = v["total"].as_u64().unwrap_or(0) as usize;
            let got = page.len();
            all.extend(page);
            if got == 0 || all.len() >= total {
                return Ok(all);
            }
        }
    }

    /// One cell with its whole output and collected files.
    pub async fn cell(&self, id: &str, index: u64) -> Result<Value> {
        self.call(
            reqwest::Method::GET,
            &format!("/v1/sweeps/{id}/cells/{index}"),
            None,
        )
        .await
    }

    /// Cancels the whole sweep, or only the cells at `indexes`.
    pub async fn cancel(&self, id: &str, indexes: Option<&[u64]>) -> Result<Value> {
        let body = indexes.map(|i| json!({ "cells": i }));
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sweeps/{id}/cancel"),
            body.as_ref(),
        )
        .await
    }

    /// Runs the finished cells of a sweep again (`scontrol requeue`).
    pub async fn requeue(&self, id: &str) -> Result<Value> {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sweeps/{id}/requeue"),
            Some(&json!({})),
        )
        .await
    }

    /// The digests the API holds no blob of for the caller (sorted).
    pub async fn missing_blobs(&self, digests: &[String]) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        for batch in digests.chunks(DIGEST_BATCH) {
            let v = self
                .call(
                    reqwest::Method::POST,
                    "/v1/blobs/missing",
                    Some(&json!({ "digests": batch })),
                )
                .await?;
            missing.extend(
                v["missing"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|d| d.as_str().map(str::to_owned)),
            );
        }
        missing.sort();
        missing.dedup();
        Ok(missing)
    }

    /// Uploads a file as the blob `digest` (the API checks the digest).
    pub async fn put_blob(&self, digest: &str, file: &std::path::Path) -> Result<()> {
        let opened = tokio::fs::File::open(file)
            .await
            .with_context(|| format!("reading {}", file.display()))?;
        let size = opened.metadata().await?.len();
        let request = self
            .request(reqwest::Method::PUT, &format!("/v1/blobs/{digest}"))
            .timeout(BLOB_TRANSFER)
            .header(reqwest::header::CONTENT_LENGTH, size)
            .body(reqwest::Body::from(opened));
        self.open(request).await?;
        Ok(())
    }

    /// Writes the caller's blob `digest` to `to` (through a file beside it,
    /// renamed once whole and checked against the digest).
    pub async fn get_blob(&self, digest: &str, to: &std::path::Path) -> Result<()> {
        use sha2::Digest as _;
        use tokio::io::AsyncWriteExt as _;
        let request = self
            .request(reqwest::Method::GET, &format!("/v1/blobs/{digest}"))
            .timeout(BLOB_TRANSFER);
        let mut response = self.open(request).await?;
        let partial = to.with_file_name(format!(
            ".{}.shoal-part",
            to.file_name().and_then(|n| n.to_str()).unwrap_or("file")
        ));
        let mut out = tokio::fs::File::create(&partial)
            .await
            .with_context(|| format!("writing {}", partial.display()))?;
        let mut hasher = sha2::Sha256::new();
        let written = async {
            while let Some(chunk) = response.chunk().await? {
                hasher.update(&chunk);
                out.write_all(&chunk).await?;
            }
            out.flush().await?;
            anyhow::Ok(())
        }
        .await;
        let got = hex::encode(hasher.finalize());
        if let Err(e) = written.and_then(|()| {
            if got == digest {
                Ok(())
            } else {
                Err(anyhow!("the download's SHA-256 is {got}, not {digest}"))
            }
        }) {
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(e);
        }
        tokio::fs::rename(&partial, to)
            .await
            .with_context(|| format!("writing {}", to.display()))
    }

    /// What a cell's latest attempt printed from flush `from` on.
    pub async fn cell_output(&self, id: &str, index: u64, from: u64) -> Result<Value> {
        self.call(
            reqwest::Method::GET,
            &format!("/v1/sweeps/{id}/cells/{index}/output?from={from}"),
            None,
        )
        .await
    }

    /// `scontrol hold` / `release`: `action` is `hold` or `release`.
    pub async fn hold(&self, id: &str, action: &str) -> Result<Value> {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sweeps/{id}/{action}"),
            Some(&json!({})),
        )
        .await
    }

    /// Sets how many of a sweep's cells run at once (`ArrayTaskThrottle`).
    pub async fn set_throttle(&self, id: &str, throttle: u64) -> Result<Value> {
        self.call(
            reqwest::Method::PATCH,
            &format!("/v1/sweeps/{id}"),
            Some(&json!({ "throttle": throttle })),
        )
        .await
    }
}
