//! Image pulls from the registries this host's operator trusts (issue 21):
//! `templates.register(name, "REGISTRY/REPOSITORY:TAG")` pulls the image
//! with the OCI distribution API into an OCI image layout, which the import
//! then unpacks like a local archive (`imports.rs`).
//!
//! Only the registries named with `shoal up --registry` are reached: the
//! pull runs on the host, on the host's network, so a tenant naming any
//! address would make the host a proxy into it. Everything a registry sends
//! is bounded all the same: manifests and configs at most 4 MiB, at most
//! 128 layers, each blob at most the size its manifest declares and all of
//! them together at most the template's disk, each checked against its
//! digest as it streams to a file; every request has a deadline, a blob
//! that stalls for a minute fails the pull, and no lock is held across one.
//!
//! Owns: image references, the distribution API client (anonymous bearer
//! tokens, as Docker Hub and GHCR ask for public images) and the layout it
//! writes. Does not own: unpacking (`shoal_image::import`), build rows.

use futures::StreamExt as _;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;
use tokio::io::AsyncWriteExt as _;

/// The most bytes of a manifest, an index or an image config.
const MAX_JSON_BYTES: usize = 4 << 20;
/// The most layers an image may have (Docker's own limit is 127).
const MAX_LAYERS: usize = 128;
/// A manifest or token request, whole.
const REQUEST_DEADLINE: Duration = Duration::from_secs(30);
/// The longest a blob's download may go without a byte.
const STALL_DEADLINE: Duration = Duration::from_secs(60);
/// Redirects followed (registries send blobs from object storage).
const MAX_REDIRECTS: usize = 5;

const INDEX_TYPES: [&str; 2] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];
const MANIFEST_TYPES: [&str; 2] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// A registry the operator lets this host pull from: `--registry
/// registry.example.com` (HTTPS), `--registry http://127.0.0.1:5000` (a
/// registry on the host's own network, plain HTTP), `--registry docker.io`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registry {
    /// How image references name it: `host[:port]`, `docker.io` for Docker Hub.
    pub name: String,
    /// Where its API is: `scheme://host[:port]`.
    pub base: String,
}

impl FromStr for Registry {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let trimmed = s.trim().trim_end_matches('/');
        let (scheme, host) = if let Some(host) = trimmed.strip_prefix("https://") {
            ("https", host)
        } else if let Some(host) = trimmed.strip_prefix("http://") {
            ("http", host)
        } else if trimmed.contains("://") {
            return Err(format!("{s:?}: a registry is https:// or http://"));
        } else {
            ("https", trimmed)
        };
        let host = host.to_ascii_lowercase();
        let valid = !host.is_empty()
            && host.len() <= 255
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
        if !valid {
            return Err(format!(
                "{s:?}: a registry is a host name or address, with a port if not the default"
            ));
        }
        if matches!(
            host.as_str(),
            "docker.io" | "index.docker.io" | "registry-1.docker.io"
        ) {
            return Ok(Registry {
                name: "docker.io".into(),
                base: "https://registry-1.docker.io".into(),
            });
        }
        Ok(Registry {
            base: format!("{scheme}://{host}"),
            name: host,
        })
    }
}

/// A registry image reference: `[registry/]repository[:tag][@digest]`,
/// Docker's grammar (no registry: Docker Hub, one component: `library/`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageRef {
    pub registry: String,
    pub repository: String,
    /// The tag, or the manifest's digest when one was named.
    pub reference: String,
}

impl ImageRef {
    /// `None` for anything that is not a well-formed reference.
    pub fn parse(s: &str) -> Option<ImageRef> {
        let s = s.strip_prefix("docker://").unwrap_or(s);
        if s.is_empty() || s.len() > 512 {
            return None;
        }
        let (rest, digest) = match s.split_once('@') {
            Some((rest, digest)) => (rest, Some(digest)),
            None => (s, None),
        };
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        let mut parts: Vec<&str> = name.split('/').collect();
        let explicit_registry = parts.len() > 1
            && (parts[0].contains('.') || parts[0].contains(':') || parts[0] == "localhost");
        let registry = if explicit_registry {
            parts.remove(0).to_ascii_lowercase()
        } else {
            "docker.io".to_owned()
        };
        let registry = if registry == "index.docker.io" {
            "docker.io".to_owned()
        } else {
            registry
        };
        if !parts.iter().all(|p| valid_path_component(p)) {
            return None;
        }
        let mut repository = parts.join("/");
        if registry == "docker.io" && parts.len() == 1 {
            repository = format!("library/{repository}");
        }
        let reference = match (tag, digest) {
            (_, Some(digest)) => {
                valid_digest(digest).then_some(())?;
                digest.to_owned()
            }
            (Some(tag), None) => {
                let ok = (1..=128).contains(&tag.len())
                    && !tag.starts_with(['.', '-'])
                    && tag
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
                ok.then_some(())?;
                tag.to_owned()
            }
            (None, None) => "latest".to_owned(),
        };
        Some(ImageRef {
            registry,
            repository,
            reference,
        })
    }
}

fn valid_path_component(part: &str) -> bool {
    let bytes = part.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 128
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(b))
}

fn valid_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// Why a pull failed. `Refused`: the reference or the image is not one
/// this host can use (the tenant's to fix); `Registry`: the registry failed
/// or misbehaved.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Registry(String),
}

/// A blob an image names: its digest and declared size.
#[derive(Clone, Debug)]
pub struct Blob {
    pub digest: String,
    pub size: u64,
}

/// An image resolved to its linux/amd64 manifest.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The digest of the manifest: what the image is, whatever its tag says later.
    pub digest: String,
    manifest: Vec<u8>,
    media_type: String,
    pub config: Blob,
    pub layers: Vec<Blob>,
}

impl Resolved {
    /// The bytes the blobs (config and layers) declare.
    pub fn declared_bytes(&self) -> u64 {
        self.layers
            .iter()
            .chain(std::iter::once(&self.config))
            .map(|b| b.size)
            .fold(0u64, u64::saturating_add)
    }
}

/// One repository of one registry, with the bearer token it handed out.
pub struct Puller {
    http: reqwest::Client,
    registry: Registry,
    repository: String,
    token: Option<String>,
    stall: Duration,
}

impl Puller {
    pub fn new(registry: &Registry, repository: &str) -> Result<Puller, PullError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::limited(MAX_REDIRECTS))
            .user_agent(concat!("shoal/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| PullError::Registry(format!("an HTTP client: {e}")))?;
        Ok(Puller {
            http,
            registry: registry.clone(),
            repository: repository.to_owned(),
            token: None,
            stall: STALL_DEADLINE,
        })
    }

    #[cfg(test)]
    fn with_stall(mut self, stall: Duration) -> Self {
        self.stall = stall;
        self
    }

    fn what(&self) -> String {
        format!("{}/{}", self.registry.name, self.repository)
    }

    /// `GET /v2/<repository>/<path>`, answering a bearer challenge once
    /// with an anonymous token. A 404 is `Refused`.
    async fn get(
        &mut self,
        path: &str,
        accept: Option<String>,
        deadline: Option<Duration>,
    ) -> Result<reqwest::Response, PullError> {
        let url = format!("{}/v2/{}/{path}", self.registry.base, self.repository);
        for attempt in 0..2 {
            let mut request = self.http.get(&url);
            if let Some(accept) = &accept {
                request = request.header(reqwest::header::ACCEPT, accept);
            }
            if let Some(token) = &self.token {
                request = request.bearer_auth(token);
            }
            if let Some(deadline) = deadline {
                request = request.timeout(deadline);
            }
            let response = request.send().await.map_err(|e| {
                PullError::Registry(format!("{}: {}", self.registry.name, plain(&e)))
            })?;
            let status = response.status();
            if status == reqwest::StatusCode::UNAUTHORIZED && attempt == 0 && self.token.is_none() {
                let challenge = response
                    .headers()
                    .get(reqwest::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                self.token = Some(self.anonymous_token(&challenge).await?);
                continue;
            }
            if status.is_success() {
                return Ok(response);
            }
            let message = error_message(response).await;
            return Err(match status {
                reqwest::StatusCode::NOT_FOUND => {
                    PullError::Refused(format!("{} has no {path}{message}", self.what()))
                }
                reqwest::StatusCode::UNAUTHORIZED | reqwest::StatusCode::FORBIDDEN => {
                    PullError::Refused(format!(
                        "{} refuses an anonymous pull of {} ({status}{message}); only public \
                         images can be pulled",
                        self.registry.name, self.repository
                    ))
                }
                _ => PullError::Registry(format!(
                    "{} answered {status} for {path}{message}",
                    self.registry.name
                )),
            });
        }
        Err(PullError::Registry(format!(
            "{} asked for credentials again after handing out a token",
            self.registry.name
        )))
    }

    /// The token a `Bearer realm=...,service=...` challenge hands to anyone.
    async fn anonymous_token(&self, challenge: &str) -> Result<String, PullError> {
        let Some(params) = challenge.strip_prefix("Bearer ") else {
            return Err(PullError::Refused(format!(
                "{} asks for credentials ({challenge:?}); only public images can be pulled",
                self.registry.name
            )));
        };
        let field = |name: &str| -> Option<String> {
            params.split(',').find_map(|kv| {
                let (k, v) = kv.trim().split_once('=')?;
                (k == name).then(|| v.trim_matches('"').to_owned())
            })
        };
        let realm = field("realm").ok_or_else(|| {
            PullError::Registry(format!(
                "{}: a bearer challenge with no realm",
                self.registry.name
            ))
        })?;
        if !(realm.starts_with("https://") || realm.starts_with("http://")) {
            return Err(PullError::Registry(format!(
                "{}: a token realm that is not HTTP: {realm:?}",
                self.registry.name
            )));
        }
        let mut query = vec![(
            "scope".to_owned(),
            field("scope").unwrap_or_else(|| format!("repository:{}:pull", self.repository)),
        )];
        if let Some(service) = field("service") {
            query.push(("service".to_owned(), service));
        }
        let response = self
            .http
            .get(&realm)
            .query(&query)
            .timeout(REQUEST_DEADLINE)
            .send()
            .await
            .map_err(|e| PullError::Registry(format!("{realm}: {}", plain(&e))))?;
        if !response.status().is_success() {
            return Err(PullError::Refused(format!(
                "{} gives no anonymous token for {} ({}); only public images can be pulled",
                self.registry.name,
                self.repository,
                response.status()
            )));
        }
        let body = bounded_body(response, MAX_JSON_BYTES, "the token").await?;
        let json: Value = serde_json::from_slice(&body)
            .map_err(|e| PullError::Registry(format!("{realm}: a token that is not JSON: {e}")))?;
        json.get("token")
            .or_else(|| json.get("access_token"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| PullError::Registry(format!("{realm}: a token answer with no token")))
    }

    async fn manifest(&mut self, reference: &str) -> Result<(Vec<u8>, String), PullError> {
        let accept = INDEX_TYPES
            .iter()
            .chain(MANIFEST_TYPES.iter())
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        let response = self
            .get(
                &format!("manifests/{reference}"),
                Some(accept),
                Some(REQUEST_DEADLINE),
            )
            .await?;
        let header_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_owned());
        let body = bounded_body(response, MAX_JSON_BYTES, "the manifest").await?;
        if reference.starts_with("sha256:") && sha256_digest(&body) != reference {
            return Err(PullError::Registry(format!(
                "{}: the manifest it sent for {reference} has another digest",
                self.what()
            )));
        }
        let json: Value = serde_json::from_slice(&body).map_err(|e| {
            PullError::Registry(format!("{}: a manifest that is not JSON: {e}", self.what()))
        })?;
        let media_type = json
            .get("mediaType")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or(header_type)
            .unwrap_or_default();
        Ok((body, media_type))
    }

    /// The image's linux/amd64 manifest and what it names, checked: the
    /// layer types this host unpacks, at most 128 layers.
    pub async fn resolve(&mut self, reference: &str) -> Result<Resolved, PullError> {
        let (mut body, mut media_type) = self.manifest(reference).await?;
        let mut digest = sha256_digest(&body);
        let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let is_index = INDEX_TYPES.contains(&media_type.as_str())
            || (media_type.is_empty() && json.get("manifests").is_some());
        if is_index {
            let chosen = json
                .get("manifests")
                .and_then(Value::as_array)
                .and_then(|entries| {
                    entries.iter().find(|m| {
                        let platform = m.get("platform");
                        platform.is_none_or(|p| {
                            p.get("os").and_then(Value::as_str) == Some("linux")
                                && p.get("architecture").and_then(Value::as_str) == Some("amd64")
                        })
                    })
                })
                .and_then(|m| m.get("digest"))
                .and_then(Value::as_str)
                .filter(|d| valid_digest(d))
                .ok_or_else(|| {
                    PullError::Refused(format!("{} has no linux/amd64 image", self.what()))
                })?
                .to_owned();
            (body, media_type) = self.manifest(&chosen).await?;
            digest = chosen;
        }
        let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if media_type.contains("v1+prettyjws") || json.get("schemaVersion") == Some(&Value::from(1))
        {
            return Err(PullError::Refused(format!(
                "{} is a Docker schema 1 image, which no current tool writes; push it again",
                self.what()
            )));
        }
        let blob = |v: &Value, what: &str| -> Result<Blob, PullError> {
            let digest = v
                .get("digest")
                .and_then(Value::as_str)
                .filter(|d| valid_digest(d))
                .ok_or_else(|| {
                    PullError::Refused(format!("{}: {what} has no sha256 digest", self.what()))
                })?;
            let size = v.get("size").and_then(Value::as_u64).ok_or_else(|| {
                PullError::Refused(format!("{}: {what} has no size", self.what()))
            })?;
            if v.get("urls").is_some() {
                return Err(PullError::Refused(format!(
                    "{}: {what} lives outside the registry (a foreign layer)",
                    self.what()
                )));
            }
            Ok(Blob {
                digest: digest.to_owned(),
                size,
            })
        };
        let config = blob(
            json.get("config").unwrap_or(&Value::Null),
            "the image config",
        )?;
        if config.size > MAX_JSON_BYTES as u64 {
            return Err(PullError::Refused(format!(
                "{}: the image config is over {MAX_JSON_BYTES} bytes",
                self.what()
            )));
        }
        let entries = json
            .get("layers")
            .and_then(Value::as_array)
            .ok_or_else(|| {
                PullError::Refused(format!("{}: a manifest with no layers", self.what()))
            })?;
        if entries.len() > MAX_LAYERS {
            return Err(PullError::Refused(format!(
                "{} has {} layers; at most {MAX_LAYERS}",
                self.what(),
                entries.len()
            )));
        }
        let mut layers = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().enumerate() {
            let what = format!("layer {}", i + 1);
            let kind = entry.get("mediaType").and_then(Value::as_str).unwrap_or("");
            if kind.contains("zstd") {
                return Err(PullError::Refused(format!(
                    "{}: {what} is zstd-compressed; this host unpacks plain and gzip layers",
                    self.what()
                )));
            }
            layers.push(blob(entry, &what)?);
        }
        Ok(Resolved {
            digest,
            manifest: body,
            media_type,
            config,
            layers,
        })
    }

    /// Downloads `image` into an OCI image layout at `layout` (a new
    /// directory), at most `budget` bytes of blobs; `progress` hears of
    /// each layer. Every blob is checked against its digest and size.
    pub async fn pull(
        &mut self,
        image: &Resolved,
        layout: &Path,
        budget: u64,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<u64, PullError> {
        let declared = image.declared_bytes();
        if declared > budget {
            return Err(PullError::Refused(format!(
                "{} is {} MiB of layers, over the template's {} MiB disk",
                self.what(),
                declared >> 20,
                budget >> 20
            )));
        }
        let blobs = layout.join("blobs").join("sha256");
        let local =
            |e: std::io::Error| PullError::Registry(format!("writing {}: {e}", layout.display()));
        tokio::fs::create_dir_all(&blobs).await.map_err(local)?;
        let hex = |digest: &str| digest.trim_start_matches("sha256:").to_owned();
        tokio::fs::write(blobs.join(hex(&image.digest)), &image.manifest)
            .await
            .map_err(local)?;
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": if image.media_type.is_empty() { MANIFEST_TYPES[0] } else { &image.media_type },
                "digest": image.digest,
                "size": image.manifest.len(),
                "platform": {"os": "linux", "architecture": "amd64"},
            }],
        });
        tokio::fs::write(layout.join("index.json"), index.to_string())
            .await
            .map_err(local)?;
        tokio::fs::write(
            layout.join("oci-layout"),
            r#"{"imageLayoutVersion":"1.0.0"}"#,
        )
        .await
        .map_err(local)?;
        self.fetch_blob(&image.config, &blobs.join(hex(&image.config.digest)))
            .await?;
        let mut total = image.config.size;
        for (i, layer) in image.layers.iter().enumerate() {
            let path = blobs.join(hex(&layer.digest));
            if tokio::fs::try_exists(&path).await.unwrap_or(false) {
                continue; // the same layer twice in one image
            }
            progress(format!(
                "pulling layer {}/{} ({} KiB) of {}",
                i + 1,
                image.layers.len(),
                layer.size.div_ceil(1024),
                self.what()
            ));
            self.fetch_blob(layer, &path).await?;
            total += layer.size;
        }
        Ok(total)
    }

    /// One blob into `dest`, streamed: no more than its declared size, no
    /// minute without a byte, its digest checked before it is named.
    async fn fetch_blob(&mut self, blob: &Blob, dest: &Path) -> Result<(), PullError> {
        let response = self
            .get(&format!("blobs/{}", blob.digest), None, None)
            .await?;
        let partial = dest.with_extension("partial");
        let local =
            |e: std::io::Error| PullError::Registry(format!("writing {}: {e}", partial.display()));
        let mut file = tokio::fs::File::create(&partial).await.map_err(local)?;
        let mut hasher = Sha256::new();
        let mut received = 0u64;
        let mut stream = response.bytes_stream();
        let outcome = async {
            loop {
                let chunk = match tokio::time::timeout(self.stall, stream.next()).await {
                    Err(_) => {
                        return Err(PullError::Registry(format!(
                            "{}: {} stalled for {} s",
                            self.what(),
                            blob.digest,
                            self.stall.as_secs()
                        )))
                    }
                    Ok(None) => break,
                    Ok(Some(Err(e))) => {
                        return Err(PullError::Registry(format!(
                            "{}: reading {}: {}",
                            self.what(),
                            blob.digest,
                            plain(&e)
                        )))
                    }
                    Ok(Some(Ok(chunk))) => chunk,
                };
                received += chunk.len() as u64;
                if received > blob.size {
                    return Err(PullError::Registry(format!(
                        "{}: {} is longer than the {} bytes its manifest declares",
                        self.what(),
                        blob.digest,
                        blob.size
                    )));
                }
                hasher.update(&chunk);
                file.write_all(&chunk).await.map_err(local)?;
            }
            file.flush().await.map_err(local)?;
            if received != blob.size {
                return Err(PullError::Registry(format!(
                    "{}: {} ended after {received} of its {} bytes",
                    self.what(),
                    blob.digest,
                    blob.size
                )));
            }
            if format!("sha256:{:x}", hasher.finalize()) != blob.digest {
                return Err(PullError::Registry(format!(
                    "{}: the bytes sent for {} have another digest",
                    self.what(),
                    blob.digest
                )));
            }
            Ok(())
        }
        .await;
        match outcome {
            Ok(()) => tokio::fs::rename(&partial, dest).await.map_err(local),
            Err(e) => {
                let _ = tokio::fs::remove_file(&partial).await;
                Err(e)
            }
        }
    }
}

/// A reqwest error's chain, without the URL repeated.
fn plain(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut text = if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        "could not connect".to_owned()
    } else if e.is_body() || e.is_decode() {
        "reading the answer".to_owned()
    } else {
        "the request failed".to_owned()
    };
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// At most `limit` bytes of a response's body (an error past it).
async fn bounded_body(
    response: reqwest::Response,
    limit: usize,
    what: &str,
) -> Result<Vec<u8>, PullError> {
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| PullError::Registry(format!("reading {what}: {}", plain(&e))))?;
        if body.len() + chunk.len() > limit {
            return Err(PullError::Registry(format!("{what} is over {limit} bytes")));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// `: <message>` from a registry's JSON error body, if it has one.
async fn error_message(response: reqwest::Response) -> String {
    let Ok(body) = tokio::time::timeout(
        Duration::from_secs(5),
        bounded_body(response, 16 << 10, "an error"),
    )
    .await
    else {
        return String::new();
    };
    let message = body
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|json| {
            json.get("errors")?
                .get(0)?
                .get("message")?
                .as_str()
                .map(|m| m.chars().take(200).collect::<String>())
        });
    message.map(|m| format!(": {m}")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::{Path as UrlPath, State};
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    #[test]
    fn references_parse_as_docker_names_them() {
        let parse = |s| ImageRef::parse(s).map(|r| (r.registry, r.repository, r.reference));
        let own = |a: &str, b: &str, c: &str| Some((a.to_owned(), b.to_owned(), c.to_owned()));
        assert_eq!(
            parse("busybox"),
            own("docker.io", "library/busybox", "latest")
        );
        assert_eq!(
            parse("busybox:1.36"),
            own("docker.io", "library/busybox", "1.36")
        );
        assert_eq!(parse("user/tool:v2"), own("docker.io", "user/tool", "v2"));
        assert_eq!(
            parse("127.0.0.1:5000/lab/tiny:v1"),
            own("127.0.0.1:5000", "lab/tiny", "v1")
        );
        assert_eq!(parse("localhost/tiny"), own("localhost", "tiny", "latest"));
        let digest = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            parse(&format!("ghcr.io/o/r@{digest}")),
            own("ghcr.io", "o/r", &digest)
        );
        for bad in [
            "",
            "UPPER/case",
            "a//b",
            "ghcr.io/o/r@sha256:short",
            "a:b:c",
            "x/../y",
            "tag:-bad",
            "-x",
        ] {
            assert_eq!(ImageRef::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn registries_are_https_unless_named_http() {
        let r: Registry = "registry.example.com".parse().unwrap();
        assert_eq!(r.base, "https://registry.example.com");
        let r: Registry = "http://127.0.0.1:5000/".parse().unwrap();
        assert_eq!(
            (r.name.as_str(), r.base.as_str()),
            ("127.0.0.1:5000", "http://127.0.0.1:5000")
        );
        let r: Registry = "docker.io".parse().unwrap();
        assert_eq!(r.base, "https://registry-1.docker.io");
        assert!("ftp://x".parse::<Registry>().is_err());
        assert!("a b".parse::<Registry>().is_err());
        assert!("host/path".parse::<Registry>().is_err());
    }

    /// What a test registry serves, and how it misbehaves.
    #[derive(Default)]
    struct Served {
        manifests: HashMap<String, (String, Vec<u8>)>,
        blobs: HashMap<String, Vec<u8>>,
        /// Digests whose blob is sent with these bytes instead.
        tampered: HashMap<String, Vec<u8>>,
        /// Digests whose blob never finishes.
        stalled: Vec<String>,
        /// A bearer token it demands (and hands out at /token).
        token: Option<String>,
        /// Its own address, for the challenge's realm.
        base: String,
        requests: Vec<String>,
    }

    type Shared = Arc<Mutex<Served>>;

    fn authorized(served: &Served, headers: &HeaderMap) -> Option<Response> {
        let token = served.token.as_ref()?;
        let sent = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        (sent != format!("Bearer {token}")).then(|| {
            let challenge = format!(
                "Bearer realm=\"{}/token\",service=\"test\",scope=\"repository:lab/tiny:pull\"",
                served.base
            );
            (
                StatusCode::UNAUTHORIZED,
                [("www-authenticate", challenge)],
                r#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#,
            )
                .into_response()
        })
    }

    async fn serve(served: Shared) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        served.lock().unwrap().base = base.clone();
        let app = axum::Router::new()
            .route(
                "/v2/lab/tiny/manifests/{reference}",
                axum::routing::get(
                    move |State(s): State<Shared>, UrlPath(reference): UrlPath<String>, headers: HeaderMap| async move {
                        let mut served = s.lock().unwrap();
                        served.requests.push(format!("manifest {reference}"));
                        if let Some(denied) = authorized(&served, &headers) {
                            return denied;
                        }
                        match served.manifests.get(&reference) {
                            Some((kind, body)) => ([("content-type", kind.clone())], body.clone()).into_response(),
                            None => (StatusCode::NOT_FOUND, r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#).into_response(),
                        }
                    },
                ),
            )
            .route(
                "/v2/lab/tiny/blobs/{digest}",
                axum::routing::get(
                    |State(s): State<Shared>, UrlPath(digest): UrlPath<String>, headers: HeaderMap| async move {
                        let (body, stalled) = {
                            let mut served = s.lock().unwrap();
                            served.requests.push(format!("blob {digest}"));
                            if let Some(denied) = authorized(&served, &headers) {
                                return denied;
                            }
                            let body = served.tampered.get(&digest).or(served.blobs.get(&digest)).cloned();
                            (body, served.stalled.contains(&digest))
                        };
                        let Some(body) = body else {
                            return StatusCode::NOT_FOUND.into_response();
                        };
                        if stalled {
                            let head = body[..1].to_vec();
                            let stream = futures::stream::once(async move { Ok::<_, std::io::Error>(head) })
                                .chain(futures::stream::pending());
                            return axum::body::Body::from_stream(stream).into_response();
                        }
                        body.into_response()
                    },
                ),
            )
            .route(
                "/token",
                axum::routing::get(|State(s): State<Shared>, query: axum::extract::Query<HashMap<String, String>>| async move {
                    let served = s.lock().unwrap();
                    assert_eq!(query.get("service").map(String::as_str), Some("test"));
                    assert_eq!(query.get("scope").map(String::as_str), Some("repository:lab/tiny:pull"));
                    axum::Json(serde_json::json!({"token": served.token}))
                }),
            )
            .with_state(served.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        base
    }

    fn blob_of(served: &mut Served, bytes: &[u8]) -> Value {
        let digest = sha256_digest(bytes);
        served.blobs.insert(digest.clone(), bytes.to_vec());
        serde_json::json!({"digest": digest, "size": bytes.len(), "mediaType": "application/vnd.oci.image.layer.v1.tar"})
    }

    /// An image of two layers behind an index, tagged `v1`.
    fn two_layer_image(served: &mut Served) -> (Value, Value) {
        let config = blob_of(
            served,
            br#"{"architecture":"amd64","os":"linux","config":{}}"#,
        );
        let lower = blob_of(served, &vec![7u8; 5000]);
        let upper = blob_of(served, b"upper layer bytes");
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPES[0],
            "config": config,
            "layers": [lower, upper],
        });
        let manifest_bytes = manifest.to_string().into_bytes();
        let manifest_digest = sha256_digest(&manifest_bytes);
        served.manifests.insert(
            manifest_digest.clone(),
            (MANIFEST_TYPES[0].into(), manifest_bytes.clone()),
        );
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": INDEX_TYPES[0],
            "manifests": [
                {"digest": sha256_digest(b"arm"), "size": 3, "platform": {"os": "linux", "architecture": "arm64"}},
                {"digest": manifest_digest, "size": manifest_bytes.len(), "platform": {"os": "linux", "architecture": "amd64"}},
            ],
        });
        served.manifests.insert(
            "v1".into(),
            (INDEX_TYPES[0].into(), index.to_string().into_bytes()),
        );
        (manifest, Value::String(manifest_digest))
    }

    async fn registry_with(fill: impl FnOnce(&mut Served)) -> (Registry, Shared) {
        let shared: Shared = Arc::default();
        fill(&mut shared.lock().unwrap());
        let base = serve(shared.clone()).await;
        (base.parse().unwrap(), shared)
    }

    #[tokio::test]
    async fn an_index_resolves_to_its_amd64_manifest_and_pulls_into_a_layout() {
        let mut expected = (Value::Null, Value::Null);
        let (registry, _served) = registry_with(|s| expected = two_layer_image(s)).await;
        let mut puller = Puller::new(&registry, "lab/tiny").unwrap();
        let image = puller.resolve("v1").await.unwrap();
        assert_eq!(Value::String(image.digest.clone()), expected.1);
        assert_eq!(image.layers.len(), 2);
        let dir = tempfile::tempdir().unwrap();
        let layout = dir.path().join("layout");
        let heard = Mutex::new(Vec::new());
        let bytes = puller
            .pull(&image, &layout, 1 << 20, &|line| {
                heard.lock().unwrap().push(line)
            })
            .await
            .unwrap();
        assert_eq!(bytes, image.declared_bytes());
        assert_eq!(heard.lock().unwrap().len(), 2);
        let index: Value =
            serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
        assert_eq!(index["manifests"][0]["digest"], expected.1);
        for blob in image.layers.iter().chain([&image.config]) {
            let hex = blob.digest.trim_start_matches("sha256:");
            let bytes = std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
            assert_eq!(sha256_digest(&bytes), blob.digest);
        }
    }

    #[tokio::test]
    async fn a_bearer_challenge_is_answered_with_an_anonymous_token() {
        let (registry, served) = registry_with(|s| {
            two_layer_image(s);
            s.token = Some("anonymous-pull".into());
        })
        .await;
        let mut puller = Puller::new(&registry, "lab/tiny").unwrap();
        let image = puller.resolve("v1").await.unwrap();
        assert_eq!(image.layers.len(), 2);
        assert_eq!(puller.token.as_deref(), Some("anonymous-pull"));
        let dir = tempfile::tempdir().unwrap();
        puller
            .pull(&image, dir.path(), 1 << 20, &|_| {})
            .await
            .unwrap();
        // One challenge, then the token on every request.
        let requests = served.lock().unwrap().requests.clone();
        assert_eq!(
            requests.iter().filter(|r| *r == "manifest v1").count(),
            2,
            "{requests:?}"
        );
    }

    /// Resolves tag v1 of a registry `fill` makes and pulls it into a fresh
    /// layout under `dir` with `budget`: the pull's error, the registry.
    async fn failed_pull(
        fill: impl FnOnce(&mut Served),
        dir: &Path,
        budget: u64,
    ) -> (PullError, Shared, Resolved) {
        let (registry, served) = registry_with(fill).await;
        let mut puller = Puller::new(&registry, "lab/tiny")
            .unwrap()
            .with_stall(Duration::from_millis(300));
        let image = puller.resolve("v1").await.unwrap();
        let layout = dir.join(format!("{:x}", rand::random::<u64>()));
        let err = puller
            .pull(&image, &layout, budget, &|_| {})
            .await
            .unwrap_err();
        (err, served, image)
    }

    /// `fill`, with the blob of layer `index` of the image marked by `mark`.
    fn with_layer(index: usize, mark: fn(&mut Served, String)) -> impl FnOnce(&mut Served) {
        move |s: &mut Served| {
            let (manifest, _) = two_layer_image(s);
            let digest = manifest["layers"][index]["digest"]
                .as_str()
                .unwrap()
                .to_owned();
            mark(s, digest);
        }
    }

    #[tokio::test]
    async fn a_hostile_registry_fails_the_pull_and_leaves_no_blob_named() {
        let dir = tempfile::tempdir().unwrap();
        // A blob whose bytes are not its digest's.
        let tampered = with_layer(1, |s, d| {
            s.tampered.insert(d, b"other layer bytes".to_vec());
        });
        let (err, _, image) = failed_pull(tampered, dir.path(), 1 << 20).await;
        assert!(err.to_string().contains("another digest"), "{err}");
        let upper = image.layers[1].digest.trim_start_matches("sha256:");
        assert!(!std::fs::read_dir(dir.path()).unwrap().any(|layout| layout
            .unwrap()
            .path()
            .join("blobs/sha256")
            .join(upper)
            .exists()));

        // A blob longer than it was declared.
        let long = with_layer(1, |s, d| {
            s.tampered.insert(d, vec![0u8; 1 << 16]);
        });
        let (err, _, _) = failed_pull(long, dir.path(), 1 << 20).await;
        assert!(err.to_string().contains("longer than"), "{err}");

        // Layers over the disk are refused before a byte of them is fetched.
        let (err, served, _) = failed_pull(
            |s| {
                two_layer_image(s);
            },
            dir.path(),
            1000,
        )
        .await;
        assert!(matches!(err, PullError::Refused(_)), "{err}");
        let requests = served.lock().unwrap().requests.clone();
        assert!(
            !requests.iter().any(|r| r.starts_with("blob")),
            "{requests:?}"
        );

        // A blob that stops sending.
        let stalled = with_layer(0, |s, d| s.stalled.push(d));
        let (err, _, _) = failed_pull(stalled, dir.path(), 1 << 20).await;
        assert!(err.to_string().contains("stalled"), "{err}");

        // An unknown tag names itself.
        let (registry, _served) = registry_with(|s| {
            two_layer_image(s);
        })
        .await;
        let err = Puller::new(&registry, "lab/tiny")
            .unwrap()
            .resolve("v2")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, PullError::Refused(m) if m.contains("manifests/v2") && m.contains("manifest unknown")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_oversized_manifest_is_refused_without_holding_it() {
        let (registry, _served) = registry_with(|s| {
            s.manifests.insert(
                "big".into(),
                (MANIFEST_TYPES[0].into(), vec![b' '; MAX_JSON_BYTES + 10]),
            );
        })
        .await;
        let mut puller = Puller::new(&registry, "lab/tiny").unwrap();
        let err = puller.resolve("big").await.unwrap_err().to_string();
        assert!(err.contains("over"), "{err}");
    }
}
