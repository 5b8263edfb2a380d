//! Template builds from a Dockerfile (issue 21): `POST /v1/templates/build`
//! (multipart, as the `pandastack` SDK's `build_from_dockerfile` sends it),
//! `GET /v1/templates/builds[/{id}]` and the build's log as SSE
//! (`/v1/templates/builds/{id}/logs`, `follow=1` tails it to its end).
//!
//! A build is tenant code: every `RUN` runs in a builder sandbox of the
//! account's, restored from the `FROM` template like any other sandbox (so
//! it is jailed, in a cgroup, counted against the account's quota, and may
//! reach what any sandbox may). `COPY`/`ADD` write the context's files
//! through the guest agent; `ENV`, `WORKDIR` and `USER` go to the image's
//! exec defaults (`/etc/shoal/exec.json`, read by the guest agent at each
//! exec), which the snapshot keeps; `CMD`/`ENTRYPOINT` is started and
//! `HEALTHCHECK` awaited before the capture, as for `POST /v1/templates`.
//! The capture is then named as the account's template (replacing an
//! earlier one of that name, whose build-made snapshot is collected).
//!
//! Everything that can be checked before a VM exists (the Dockerfile, the
//! names, the context and every `COPY` source) is a 4xx at submission that
//! leaves nothing; a failure during the build fails the build, names the
//! Dockerfile's line, and leaves no template, snapshot or sandbox.
//!
//! An unchanged rebuild is a cache hit: the key digests the base (the
//! snapshot or first-party bake it restores), the Dockerfile and the
//! context, and a done build with that key whose snapshot still exists is
//! reused without starting a VM.
//!
//! Owns: the build routes, the build task, and the live logs (held in
//! memory while a build runs, bounded, then stored with its row). Does not
//! own: Dockerfile parsing (`shoal_image::dockerfile`), the rows (the
//! store's), sandbox creation and capture (`sandboxes`).

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::sandboxes::{create_sandbox, CreateBody, VmSize};
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use shoal_host::Source;
use shoal_image::dockerfile::{self, Action, Base, Dockerfile};
use shoal_proto::client::{ExecEvent, ExecRequest};
use shoal_store::{build_status, Account, TemplateBuildRow, TemplateRow};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};

type St = State<Arc<ControlPlane>>;

/// The most a build's context may hold (the SDK documents 50 MB).
pub const MAX_CONTEXT_BYTES: u64 = 50 << 20;
/// The most files a context may hold.
const MAX_CONTEXT_FILES: usize = 10_000;
/// The most context bytes held in memory for queued and running builds on
/// this host; past it a submission is refused with a 503 to retry.
const MAX_HELD_CONTEXT_BYTES: u64 = 256 << 20;
/// Builds running at once on this host; more wait, `queued`.
const CONCURRENT_BUILDS: usize = 2;
/// Unfinished builds an account may have.
const MAX_UNFINISHED_PER_ACCOUNT: usize = 4;
/// The longest one `RUN` may take, and a whole build (its builder VM's
/// lifetime).
const RUN_TIMEOUT: Duration = Duration::from_secs(30 * 60);
const BUILD_LIFETIME_SECONDS: i64 = 2 * 3600;
/// How long past a `RUN`'s own timeout the host waits for the guest.
const GUEST_MARGIN: Duration = Duration::from_secs(15);
/// How long a `HEALTHCHECK` may take to pass during the bake.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a guest file write or housekeeping command may take.
const FILE_DEADLINE: Duration = Duration::from_secs(120);
/// A build's log: its last 256 KiB, lines cut at 4 KiB.
const MAX_LOG_BYTES: usize = 256 << 10;
const MAX_LINE_BYTES: usize = 4096;
/// The Debian release of this host's `base` template; other releases are
/// `shoal_image::release_template`s, baked when a build first asks.
const BOOTSTRAPPED_RELEASE: &str = shoal_image::SUITE;
/// Where the guest agent reads the image's exec defaults.
const EXEC_DEFAULTS: &str = "/etc/shoal/exec.json";

/// Builds of this host: the live logs and the limits on what they hold.
pub(crate) struct Builds {
    live: Mutex<HashMap<String, Arc<LiveLog>>>,
    held_bytes: AtomicU64,
    slots: Semaphore,
}

impl Default for Builds {
    fn default() -> Self {
        Builds {
            live: Mutex::default(),
            held_bytes: AtomicU64::new(0),
            slots: Semaphore::new(CONCURRENT_BUILDS),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running build's log, as lines: bounded (the oldest go first), with
/// waiters woken at each line and at the end.
#[derive(Default)]
pub(crate) struct LiveLog {
    state: Mutex<LogState>,
    changed: Notify,
}

#[derive(Default)]
struct LogState {
    lines: VecDeque<String>,
    /// The index (since the build began) of `lines[0]`.
    first: u64,
    bytes: usize,
    ended: bool,
}

impl LiveLog {
    pub(crate) fn line(&self, text: &str) {
        let mut text: String = text.trim_end_matches(['\r', '\n']).replace('\r', "");
        if text.len() > MAX_LINE_BYTES {
            let mut cut = MAX_LINE_BYTES;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push_str(" [line cut]");
        }
        let mut state = lock(&self.state);
        state.bytes += text.len() + 1;
        state.lines.push_back(text);
        while state.bytes > MAX_LOG_BYTES {
            let Some(old) = state.lines.pop_front() else {
                break;
            };
            state.bytes -= old.len() + 1;
            state.first += 1;
        }
        drop(state);
        self.changed.notify_waiters();
    }

    fn end(&self) {
        lock(&self.state).ended = true;
        self.changed.notify_waiters();
    }

    fn text(&self) -> String {
        let state = lock(&self.state);
        let mut out = String::with_capacity(state.bytes);
        for line in &state.lines {
            out.push_str(line);
            out.push('\n');
        }
        out
    }

    /// The line at `index` (or the oldest kept after it), or whether the
    /// log has ended.
    fn next(&self, index: u64) -> Next {
        let state = lock(&self.state);
        let index = index.max(state.first);
        match state.lines.get((index - state.first) as usize) {
            Some(line) => Next::Line(index, line.clone()),
            None if state.ended => Next::End,
            None => Next::Wait,
        }
    }
}

enum Next {
    Line(u64, String),
    Wait,
    End,
}

/// Splits a stream of output chunks into lines for the log.
#[derive(Default)]
struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    fn feed(&mut self, chunk: &[u8], log: &LiveLog) {
        for &byte in chunk {
            if byte == b'\n' {
                log.line(&String::from_utf8_lossy(&self.partial));
                self.partial.clear();
            } else if self.partial.len() < MAX_LINE_BYTES {
                self.partial.push(byte);
            }
        }
    }

    fn flush(&mut self, log: &LiveLog) {
        if !self.partial.is_empty() {
            log.line(&String::from_utf8_lossy(&self.partial));
            self.partial.clear();
        }
    }
}

/// A build as the SDK reads it (`TemplateBuild.from_dict`).
fn build_json(row: &TemplateBuildRow) -> Value {
    json!({
        "id": row.id,
        "name": row.name,
        "status": row.status,
        "error": row.error,
        "created_at": rfc3339(row.created_at),
        "started_at": row.started_at.map(rfc3339),
        "ended_at": row.ended_at.map(rfc3339),
        "snapshot_id": row.snapshot_id,
        "cache_hit": row.cache_hit,
    })
}

fn new_build_id() -> String {
    format!("bld-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// The build's context: files by their path relative to its root.
#[derive(Default)]
struct Context {
    files: BTreeMap<String, Vec<u8>>,
    bytes: u64,
}

/// What a submission asked for.
#[derive(Default)]
struct Submission {
    name: Option<String>,
    dockerfile: Option<String>,
    /// The sizes asked for; a template runs at its base's (checked against
    /// it, never ignored).
    cpu: Option<u32>,
    memory_mb: Option<u32>,
    /// The disk of an imported template (a Dockerfile's template keeps its
    /// base's disk, whose overlay grows as it is written).
    size_mb: Option<u32>,
    context: Context,
    /// A root filesystem tarball (`rootfs`), streamed to disk.
    rootfs: Option<crate::imports::Upload>,
    image_ref: Option<String>,
}

fn multipart_error(e: axum::extract::multipart::MultipartError) -> ApiError {
    ApiError::new(
        e.status(),
        format!("reading the multipart body: {}", e.body_text()),
    )
}

fn context_too_big() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "the build context is over {} MiB: keep data out of it and fetch it in a RUN",
            MAX_CONTEXT_BYTES >> 20
        ),
    )
}

/// Whether `path` is a plain relative path inside the context.
fn valid_context_path(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= 1024
        && !path.starts_with('/')
        && !path.contains('\0')
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

const TEXT_FIELDS: &[&str] = &[
    "name",
    "dockerfile",
    "image_ref",
    "size_mb",
    "cpu",
    "memory_mb",
    "kernel",
];

fn text_limit(field: &str) -> usize {
    if field == "dockerfile" {
        dockerfile::MAX_DOCKERFILE_BYTES
    } else {
        4096
    }
}

impl Submission {
    /// Takes one of [`TEXT_FIELDS`].
    fn take_text(&mut self, field: &str, text: String) -> ApiResult<()> {
        if text.len() > text_limit(field) {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("field {field} is over {} bytes", text_limit(field)),
            ));
        }
        match field {
            "name" => self.name = Some(text),
            "dockerfile" => self.dockerfile = Some(text),
            "image_ref" => self.image_ref = Some(text),
            "kernel" => {}
            _ => {
                let number = text.trim().parse::<u32>().map_err(|_| {
                    ApiError::bad_request(format!("{field} must be a whole number"))
                })?;
                match field {
                    "cpu" => self.cpu = Some(number),
                    "memory_mb" => self.memory_mb = Some(number),
                    _ => self.size_mb = Some(number),
                }
            }
        }
        Ok(())
    }
}

/// The submission, from a multipart form (with context files, as the SDK
/// sends one with a context) or a urlencoded one (without, as the SDK
/// sends one without).
async fn read_form(request: axum::extract::Request, uploads: &Uploads) -> ApiResult<Submission> {
    use axum::extract::FromRequest;
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    if content_type.starts_with("multipart/form-data") {
        let multipart = Multipart::from_request(request, &())
            .await
            .map_err(|e| ApiError::bad_request(e.body_text()))?;
        return read_submission(multipart, uploads).await;
    }
    if !content_type.starts_with("application/x-www-form-urlencoded") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "send a multipart/form-data or application/x-www-form-urlencoded form",
        ));
    }
    let limit = dockerfile::MAX_DOCKERFILE_BYTES * 3 + 64 * 1024;
    let bytes = axum::body::to_bytes(request.into_body(), limit)
        .await
        .map_err(|_| ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "the form is too large"))?;
    let pairs: Vec<(String, String)> = serde_urlencoded::from_bytes(&bytes)
        .map_err(|e| ApiError::bad_request(format!("reading the form: {e}")))?;
    let mut submission = Submission::default();
    for (field, value) in pairs {
        if !TEXT_FIELDS.contains(&field.as_str()) {
            return Err(ApiError::bad_request(format!(
                "unknown field {field}: context files need a multipart form"
            )));
        }
        submission.take_text(&field, value)?;
    }
    Ok(submission)
}

/// Where a root filesystem upload goes, and its most bytes.
struct Uploads {
    dir: std::path::PathBuf,
    limit: u64,
}

async fn read_submission(mut multipart: Multipart, uploads: &Uploads) -> ApiResult<Submission> {
    let mut submission = Submission::default();
    while let Some(mut field) = multipart.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or_default().to_owned();
        let is_file = field.file_name().is_some();
        if !is_file && TEXT_FIELDS.contains(&name.as_str()) {
            let limit = text_limit(&name);
            let mut text = Vec::new();
            while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
                if text.len() + chunk.len() > limit {
                    return Err(ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("field {name} is over {limit} bytes"),
                    ));
                }
                text.extend_from_slice(&chunk);
            }
            let text = String::from_utf8(text)
                .map_err(|_| ApiError::bad_request(format!("field {name} is not UTF-8")))?;
            submission.take_text(&name, text)?;
            continue;
        }
        if name == "rootfs" && is_file {
            if submission.rootfs.is_some() {
                return Err(ApiError::bad_request("send one rootfs"));
            }
            submission.rootfs =
                Some(crate::imports::receive(&mut field, &uploads.dir, uploads.limit).await?);
            continue;
        }
        if !valid_context_path(&name) {
            return Err(ApiError::bad_request(format!(
                "context file {name:?}: give a relative path without '.' or '..' parts"
            )));
        }
        if submission.context.files.len() >= MAX_CONTEXT_FILES {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the build context holds over {MAX_CONTEXT_FILES} files"),
            ));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
            submission.context.bytes += chunk.len() as u64;
            if submission.context.bytes > MAX_CONTEXT_BYTES {
                return Err(context_too_big());
            }
            bytes.extend_from_slice(&chunk);
        }
        submission.context.files.insert(name, bytes);
    }
    Ok(submission)
}

/// One file a `COPY`/`ADD` writes: its context path and where it goes.
#[derive(Debug, Clone, PartialEq)]
struct Placement {
    source: String,
    dest: String,
}

fn wildcard(pattern: &str, name: &str) -> bool {
    glob::Pattern::new(pattern).is_ok_and(|p| p.matches(name))
}

/// Where each context file of a `COPY`/`ADD` goes, as Docker places them:
/// a file to `dest` (or into it when it is a directory), a directory's
/// contents (and `.`, the whole context) under `dest`.
fn placements(
    line: usize,
    sources: &[String],
    dest: &str,
    context: &Context,
) -> ApiResult<Vec<Placement>> {
    let into_dir = dest.ends_with('/') || sources.len() > 1;
    let dir_dest = dest.trim_end_matches('/');
    let join = |base: &str, rel: &str| {
        if base.is_empty() {
            format!("/{rel}")
        } else {
            format!("{base}/{rel}")
        }
    };
    let mut out = Vec::new();
    for source in sources {
        let source = source.trim_start_matches("./").trim_end_matches('/');
        let before = out.len();
        if source.is_empty() || source == "." {
            for path in context.files.keys() {
                out.push(Placement {
                    source: path.clone(),
                    dest: join(dir_dest, path),
                });
            }
        } else if source.contains(['*', '?', '[']) {
            let (dir, pattern) = source.rsplit_once('/').unwrap_or(("", source));
            for path in context.files.keys() {
                let (path_dir, file) = path.rsplit_once('/').unwrap_or(("", path));
                if path_dir == dir && wildcard(pattern, file) {
                    out.push(Placement {
                        source: path.clone(),
                        dest: join(dir_dest, file),
                    });
                }
            }
        } else if context.files.contains_key(source) {
            let file = source.rsplit('/').next().unwrap_or(source);
            out.push(Placement {
                source: source.to_owned(),
                dest: if into_dir {
                    join(dir_dest, file)
                } else {
                    dest.to_owned()
                },
            });
        } else {
            let prefix = format!("{source}/");
            for path in context.files.keys() {
                if let Some(rel) = path.strip_prefix(&prefix) {
                    out.push(Placement {
                        source: path.clone(),
                        dest: join(dir_dest, rel),
                    });
                }
            }
        }
        if out.len() == before {
            return Err(ApiError::bad_request(format!(
                "Dockerfile line {line}: {source} is not in the build context"
            )));
        }
    }
    Ok(out)
}

fn is_archive(path: &str) -> bool {
    [
        ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz",
    ]
    .iter()
    .any(|ext| path.ends_with(ext))
}

/// The digest that says two builds would make the same template.
fn cache_key(base_identity: &str, dockerfile_text: &str, context: &Context) -> String {
    let mut hash = Sha256::new();
    hash.update(b"shoal-template-build-v1\0");
    hash.update(base_identity.as_bytes());
    hash.update(b"\0");
    hash.update(dockerfile_text.as_bytes());
    hash.update(b"\0");
    for (path, bytes) in &context.files {
        hash.update(path.as_bytes());
        hash.update(b"\0");
        hash.update(Sha256::digest(bytes));
    }
    format!("{:x}", hash.finalize())
}

/// The first line of the Dockerfile that is a `FROM`, for messages.
fn from_line(text: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().to_ascii_uppercase().starts_with("FROM"))
        .map_or(1, |i| i + 1)
}

/// What a build restores its builder from, and the digest of it.
struct ResolvedBase {
    template: String,
    identity: String,
    vcpus: u32,
    memory_mib: u64,
    /// Another Debian release's template this host has not baked yet: the
    /// build bakes it first, then knows its identity.
    unbaked_release: bool,
}

/// The identity of a first-party (or release) template as baked here.
fn baked_identity(name: &str, manifest: &shoal_host::Manifest) -> String {
    format!("template:{name}:{}:{}", manifest.id, manifest.input_hash)
}

async fn resolve_base(
    cp: &ControlPlane,
    account: &Account,
    parsed: &Dockerfile,
    text: &str,
) -> ApiResult<ResolvedBase> {
    let line = from_line(text);
    let template = match &parsed.base {
        Base::Template(name) => name.clone(),
        Base::Debian(release) if release == BOOTSTRAPPED_RELEASE => "base".to_owned(),
        Base::Debian(release) => match shoal_image::release_template(release) {
            Some(spec) => {
                if cp.host.engine().template(&spec.name).is_err() {
                    return Ok(ResolvedBase {
                        identity: format!("unbaked:{}", spec.name),
                        template: spec.name,
                        vcpus: spec.vcpus,
                        memory_mib: u64::from(spec.memory_mib),
                        unbaked_release: true,
                    });
                }
                spec.name
            }
            None => {
                return Err(ApiError::bad_request(format!(
                    "Dockerfile line {line}: FROM debian:{release}: this host bootstraps Debian \
                     {BOOTSTRAPPED_RELEASE}, {}",
                    shoal_image::OTHER_DEBIAN_RELEASES.join(" and ")
                )))
            }
        },
    };
    let unknown = || {
        ApiError::bad_request(format!(
            "Dockerfile line {line}: FROM {template}: no such template"
        ))
    };
    let resolved = cp
        .template_source(account, &template)
        .await
        .map_err(|_| unknown())?;
    let (identity, manifest_size) = match &resolved.source {
        Source::Snapshot(id) => {
            let manifest = cp
                .host
                .engine()
                .snapshot_manifest(id)
                .map_err(|_| unknown())?;
            (
                format!("snapshot:{id}"),
                (manifest.vcpus, manifest.memory_mib),
            )
        }
        Source::Template(name) => {
            let manifest = cp.host.engine().template(name).map_err(|_| unknown())?;
            (
                baked_identity(name, &manifest),
                (manifest.vcpus, manifest.memory_mib),
            )
        }
    };
    Ok(ResolvedBase {
        template,
        identity,
        vcpus: manifest_size.0,
        memory_mib: u64::from(manifest_size.1),
        unbaked_release: false,
    })
}

/// The size of the template's VM: its base's, or less where the
/// submission asked for less (the builder then runs at that size, so the
/// snapshot has it); more is a 422 naming the base's size.
fn template_size(
    cpu: Option<u32>,
    memory_mb: Option<u32>,
    base: &ResolvedBase,
) -> ApiResult<VmSize> {
    let size = VmSize {
        vcpus: cpu.unwrap_or(base.vcpus),
        memory_mib: memory_mb.unwrap_or(base.memory_mib as u32),
    };
    let min = shoal_host::imports::MIN_SIZED_MEMORY_MIB;
    let fits = (1..=base.vcpus).contains(&size.vcpus)
        && (u64::from(size.memory_mib) == base.memory_mib
            || (min..=base.memory_mib as u32).contains(&size.memory_mib));
    if !fits {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "a template is at most its base's size: {} has {} vCPUs and {} MiB (cpu from 1 to \
                 {}, memory_mb from {min} to {})",
                base.template, base.vcpus, base.memory_mib, base.vcpus, base.memory_mib
            ),
        ));
    }
    Ok(size)
}

/// A build the submission checked, ready to run.
pub(crate) struct Job {
    pub(crate) row: TemplateBuildRow,
    pub(crate) recipe: Recipe,
}

/// What a build makes its template from.
pub(crate) enum Recipe {
    Dockerfile(DockerfileRecipe),
    Import(crate::imports::ImportRecipe),
}

pub(crate) struct DockerfileRecipe {
    text: String,
    parsed: Dockerfile,
    context: Context,
    base: ResolvedBase,
    /// The builder's size, and so the template's.
    size: VmSize,
}

/// What a template row says besides its snapshot.
pub(crate) struct Naming {
    pub(crate) base: String,
    pub(crate) start_cmd: Option<String>,
    pub(crate) ready_cmd: Option<String>,
}

impl Job {
    fn naming(&self) -> Naming {
        match &self.recipe {
            Recipe::Dockerfile(recipe) => Naming {
                base: recipe.base.template.clone(),
                start_cmd: recipe.parsed.start.as_ref().map(|argv| shell_words(argv)),
                ready_cmd: recipe.parsed.ready.as_ref().map(|argv| shell_words(argv)),
            },
            Recipe::Import(_) => Naming {
                base: "base".into(),
                start_cmd: None,
                ready_cmd: None,
            },
        }
    }
}

impl Recipe {
    /// Bytes of the submission this host holds in memory until the build ends.
    fn held_bytes(&self) -> u64 {
        match self {
            Recipe::Dockerfile(recipe) => recipe.context.bytes,
            Recipe::Import(_) => 0,
        }
    }
}

pub async fn submit(
    State(cp): St,
    Caller(account): Caller,
    request: axum::extract::Request,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let uploads = Uploads {
        dir: crate::imports::uploads_dir(&cp),
        limit: u64::from(cp.snapshot_limits(account.tier).template_disk_mib) << 20,
    };
    let mut submission = read_form(request, &uploads).await?;
    let name = submission
        .name
        .take()
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    if !shoal_image::valid_template_name(&name) {
        return Err(ApiError::bad_request(format!(
            "invalid template name {name:?}: 1-63 of a-z, 0-9 and '-', not starting with '-'"
        )));
    }
    if shoal_image::find_template(&name).is_some() {
        return Err(ApiError::conflict(format!(
            "{name} is a first-party template's name"
        )));
    }
    let (recipe, cache_key) = match submission.dockerfile.take() {
        Some(_) if submission.rootfs.is_some() || submission.image_ref.is_some() => {
            return Err(ApiError::bad_request(
                "send one of dockerfile, rootfs and image_ref",
            ))
        }
        Some(text) => dockerfile_recipe(&cp, &account, text, submission).await?,
        None => {
            let (recipe, key) = crate::imports::recipe(
                &cp,
                &account,
                crate::imports::ImportRequest {
                    rootfs: submission.rootfs,
                    image_ref: submission.image_ref,
                    size_mb: submission.size_mb,
                    cpu: submission.cpu,
                    memory_mb: submission.memory_mb,
                },
            )
            .await?;
            (Recipe::Import(recipe), key)
        }
    };
    start(cp, account, name, recipe, cache_key).await
}

/// Checks a Dockerfile submission (everything that can be checked before a
/// VM exists) and returns its recipe and cache key.
async fn dockerfile_recipe(
    cp: &ControlPlane,
    account: &Account,
    text: String,
    submission: Submission,
) -> ApiResult<(Recipe, String)> {
    let parsed = dockerfile::parse(&text).map_err(|e| ApiError::bad_request(e.to_string()))?;
    for step in &parsed.steps {
        if let Action::Copy { sources, dest, .. } = &step.action {
            placements(step.line, sources, dest, &submission.context)?;
        }
    }
    let base = resolve_base(cp, account, &parsed, &text).await?;
    let size = template_size(submission.cpu, submission.memory_mb, &base)?;
    let recipe = DockerfileRecipe {
        text,
        parsed,
        context: submission.context,
        base,
        size,
    };
    let key = recipe.cache_key();
    Ok((Recipe::Dockerfile(recipe), key))
}

impl DockerfileRecipe {
    /// The base (as baked here), the size, the Dockerfile and the context.
    fn cache_key(&self) -> String {
        let identity = format!(
            "{}:{}:{}",
            self.base.identity, self.size.vcpus, self.size.memory_mib
        );
        cache_key(&identity, &self.text, &self.context)
    }
}

/// Bakes the Debian release the build's `FROM` names when this host has
/// not yet (once per host: debootstrap and a bake, minutes), and gives the
/// build the cache key of the baked base, which later builds will compute.
async fn bake_release_base(cp: &ControlPlane, job: &mut Job, log: &LiveLog) -> Result<(), Failure> {
    let Recipe::Dockerfile(recipe) = &mut job.recipe else {
        return Ok(());
    };
    if !recipe.base.unbaked_release {
        return Ok(());
    }
    let name = recipe.base.template.clone();
    log.line(&format!(
        "bootstrapping {name} on this host (once: debootstrap, then a bake; minutes)"
    ));
    let started = std::time::Instant::now();
    let manifest = cp.host.bake_release_template(&name).await.map_err(|e| {
        Failure(format!(
            "bootstrapping {name}: {}",
            ApiError::from(e).message
        ))
    })?;
    log.line(&format!(
        "{name} is baked ({} vCPUs, {} MiB) in {:.0} s",
        manifest.vcpus,
        manifest.memory_mib,
        started.elapsed().as_secs_f64()
    ));
    recipe.base.identity = baked_identity(&name, &manifest);
    recipe.base.unbaked_release = false;
    job.row.cache_key = Some(recipe.cache_key());
    Ok(())
}

/// Records a checked build as queued and starts it (it waits for one of
/// this host's build slots).
async fn start(
    cp: Arc<ControlPlane>,
    account: Account,
    name: String,
    recipe: Recipe,
    cache_key: String,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let unfinished = cp
        .store
        .list_builds(account.id)
        .await?
        .iter()
        .filter(|b| b.status == build_status::QUEUED || b.status == build_status::BUILDING)
        .count();
    if unfinished >= MAX_UNFINISHED_PER_ACCOUNT {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{MAX_UNFINISHED_PER_ACCOUNT} builds are already queued or running"),
        ));
    }
    let held = recipe.held_bytes();
    if cp.builds.held_bytes.fetch_add(held, Ordering::SeqCst) + held > MAX_HELD_CONTEXT_BYTES {
        cp.builds.held_bytes.fetch_sub(held, Ordering::SeqCst);
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this host holds as many build contexts as it may; retry shortly",
        );
        e.retry_after = Some(15);
        return Err(e);
    }
    let row = TemplateBuildRow {
        id: new_build_id(),
        account_id: account.id,
        name,
        status: build_status::QUEUED.into(),
        error: None,
        cache_key: Some(cache_key),
        snapshot_id: None,
        // This process holds the live log and runs it (a fleet's front
        // sends the build's reads here).
        host: Some(cp.config.host_name.clone()),
        cache_hit: false,
        created_at: now(),
        started_at: None,
        ended_at: None,
    };
    if let Err(e) = cp.store.insert_build(&row).await {
        cp.builds.held_bytes.fetch_sub(held, Ordering::SeqCst);
        return Err(e.into());
    }
    let log = Arc::new(LiveLog::default());
    lock(&cp.builds.live).insert(row.id.clone(), log.clone());
    let answer = build_json(&row);
    let job = Job { row, recipe };
    tokio::spawn(run(cp, account, job, log));
    Ok((StatusCode::ACCEPTED, Json(answer)))
}

/// Why a build failed, for its `error`.
pub(crate) struct Failure(pub(crate) String);

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Failure(e.message)
    }
}

pub(crate) async fn run(cp: Arc<ControlPlane>, account: Account, mut job: Job, log: Arc<LiveLog>) {
    let held = job.recipe.held_bytes();
    let permit = cp.builds.slots.acquire().await;
    job.row.status = build_status::BUILDING.into();
    job.row.started_at = Some(now());
    if let Err(e) = cp.store.update_build(&job.row).await {
        tracing::error!(build = job.row.id, error = %e, "recording a build's start");
    }
    let hit = match bake_release_base(&cp, &mut job, &log).await {
        Ok(()) => cached(&cp, &account, &job, &log).await,
        Err(e) => Err(e),
    };
    let outcome = match hit {
        Ok(Some(snapshot)) => {
            job.row.cache_hit = true;
            Ok(snapshot)
        }
        Ok(None) => match &job.recipe {
            Recipe::Dockerfile(recipe) => build(&cp, &account, &job, recipe, &log).await,
            Recipe::Import(recipe) => {
                crate::imports::build(&cp, &account, &job, recipe, &log).await
            }
        },
        Err(e) => Err(e),
    };
    drop(permit);
    cp.builds.held_bytes.fetch_sub(held, Ordering::SeqCst);
    job.row.ended_at = Some(now());
    match outcome {
        Ok(snapshot) => {
            job.row.status = build_status::DONE.into();
            job.row.snapshot_id = Some(snapshot);
            log.line(&format!("template {} is ready", job.row.name));
        }
        Err(Failure(why)) => {
            job.row.status = build_status::FAILED.into();
            log.line(&format!("build failed: {why}"));
            job.row.error = Some(why);
        }
    }
    if let Err(e) = cp.store.set_build_log(&job.row.id, &log.text()).await {
        tracing::error!(build = job.row.id, error = %e, "storing a build's log");
    }
    if let Err(e) = cp.store.update_build(&job.row).await {
        tracing::error!(build = job.row.id, error = %e, "recording a build's end");
    }
    log.end();
    lock(&cp.builds.live).remove(&job.row.id);
}

/// A cache hit: the snapshot an identical earlier build made, named again.
async fn cached(
    cp: &Arc<ControlPlane>,
    account: &Account,
    job: &Job,
    log: &LiveLog,
) -> Result<Option<String>, Failure> {
    let Some(key) = &job.row.cache_key else {
        return Ok(None);
    };
    let Some(snapshot) = cp
        .store
        .cached_build(account.id, key)
        .await
        .map_err(ApiError::from)?
    else {
        return Ok(None);
    };
    log.line(&format!(
        "cache hit: the base, the Dockerfile and the context are those of an earlier build; reusing its snapshot {snapshot}"
    ));
    name_template(cp, account, job, &snapshot).await?;
    Ok(Some(snapshot))
}

/// Names `snapshot` as the build's template, replacing an earlier template
/// of that name; the earlier one's snapshot is collected if a build made it
/// and nothing else names it.
async fn name_template(
    cp: &Arc<ControlPlane>,
    account: &Account,
    job: &Job,
    snapshot: &str,
) -> Result<(), Failure> {
    let name = &job.row.name;
    let naming = job.naming();
    let previous = cp
        .store
        .get_template(account.id, name)
        .await
        .map_err(ApiError::from)?;
    if previous.as_ref().is_some_and(|p| p.snapshot_id == snapshot) {
        return Ok(());
    }
    if previous.is_some() {
        cp.store
            .delete_template(account.id, name)
            .await
            .map_err(ApiError::from)?;
    }
    let row = TemplateRow {
        account_id: account.id,
        name: name.clone(),
        snapshot_id: snapshot.to_owned(),
        base: cp
            .store
            .get_snapshot(account.id, snapshot)
            .await
            .map_err(ApiError::from)?
            .map_or_else(|| naming.base.clone(), |s| s.template),
        start_cmd: naming.start_cmd.clone(),
        ready_cmd: naming.ready_cmd.clone(),
        published: false,
        created_at: now(),
    };
    let limit = cp.snapshot_limits(account.tier).count;
    cp.store
        .insert_template(account, &row, limit)
        .await
        .map_err(ApiError::from)?;
    if let Some(previous) = previous {
        collect_snapshot(cp, account, &previous.snapshot_id).await;
    }
    Ok(())
}

/// Deletes a snapshot a build made once no template names it (the engine
/// keeps its files while sandboxes restored from it run). Only on the host
/// that holds it: elsewhere it stays listed, for a delete there.
pub(crate) async fn collect_snapshot(cp: &ControlPlane, account: &Account, snapshot: &str) {
    let named = cp.store.templates_of_snapshot(snapshot).await;
    let built = cp.store.snapshot_made_by_build(account.id, snapshot).await;
    if !matches!((named, built), (Ok(names), Ok(true)) if names.is_empty()) {
        return;
    }
    let here = cp
        .store
        .get_snapshot(account.id, snapshot)
        .await
        .ok()
        .flatten()
        .is_some_and(|row| row.host.as_deref().is_none_or(|h| h == cp.config.host_name));
    if !here {
        return;
    }
    if let Err(e) = cp.host.delete_snapshot(snapshot).await {
        tracing::warn!(snapshot, error = %e, "collecting a replaced build's snapshot");
        return;
    }
    if let Err(e) = cp.store.delete_snapshot(account.id, snapshot).await {
        tracing::warn!(snapshot, error = %e, "collecting a replaced build's snapshot row");
    }
}

/// `argv` as one shell command line.
fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|w| crate::templates::shell_quoted(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The instruction's text as the log shows it: its first line, shortened.
fn instruction_text(text: &str, line: usize) -> String {
    let first = text
        .lines()
        .nth(line.saturating_sub(1))
        .unwrap_or("")
        .trim();
    let mut shown: String = first.chars().take(200).collect();
    if shown.len() < first.len() {
        shown.push_str(" ...");
    }
    shown
}

/// Runs the build in a builder sandbox and captures it; the sandbox is
/// gone afterwards whatever happened.
async fn build(
    cp: &Arc<ControlPlane>,
    account: &Account,
    job: &Job,
    recipe: &DockerfileRecipe,
    log: &LiveLog,
) -> Result<String, Failure> {
    let layer_keys = crate::build_layers::keys(
        account.id,
        &format!(
            "{}:{}:{}",
            recipe.base.identity, recipe.size.vcpus, recipe.size.memory_mib
        ),
        &recipe.parsed.steps,
        |index| copied_files(recipe, index),
    );
    let (layer, done) = match crate::build_layers::deepest(cp, &layer_keys) {
        Some((done, snapshot)) => {
            log.line(&format!(
                "FROM {}: steps 1-{done} are those of an earlier build; starting the builder from \
                 their cached layer",
                recipe.base.template
            ));
            (Some(snapshot), done)
        }
        None => {
            log.line(&format!(
                "FROM {}: starting the builder",
                recipe.base.template
            ));
            (None, 0)
        }
    };
    let body = CreateBody::builder(
        &recipe.base.template,
        layer,
        recipe.size,
        &job.row.id,
        BUILD_LIFETIME_SECONDS,
    );
    let sandbox = create_sandbox(cp, account, body)
        .await
        .map_err(|e| Failure(format!("starting the builder VM: {}", e.message)))?;
    let layers = Layers {
        keys: &layer_keys,
        done,
    };
    let result = build_in(cp, account, recipe, log, &sandbox.id, layers).await;
    if let Err(e) = cp.destroy(&sandbox.id).await {
        tracing::warn!(sandbox = sandbox.id, error = %e.message, "removing a build's builder VM");
    }
    let snapshot = result?;
    name_or_discard(cp, account, job, &snapshot.id).await?;
    Ok(snapshot.id)
}

/// Names the snapshot a build made as its template; if that fails, the
/// snapshot (files and row) goes, so a failed build leaves nothing.
pub(crate) async fn name_or_discard(
    cp: &Arc<ControlPlane>,
    account: &Account,
    job: &Job,
    snapshot: &str,
) -> Result<(), Failure> {
    let Err(failure) = name_template(cp, account, job, snapshot).await else {
        return Ok(());
    };
    if let Err(e) = cp.host.delete_snapshot(snapshot).await {
        tracing::warn!(snapshot, error = %e, "removing a failed build's snapshot");
    }
    let _ = cp.store.delete_snapshot(account.id, snapshot).await;
    Err(failure)
}

/// The (destination, content) of every file step `index` copies: part of
/// its layer's key.
fn copied_files(recipe: &DockerfileRecipe, index: usize) -> Vec<(String, Vec<u8>)> {
    let Some(step) = recipe.parsed.steps.get(index) else {
        return Vec::new();
    };
    let Action::Copy { sources, dest, .. } = &step.action else {
        return Vec::new();
    };
    placements(step.line, sources, dest, &recipe.context)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| Some((p.dest, recipe.context.files.get(&p.source)?.clone())))
        .collect()
}

/// The build's layer keys (one per step) and how many steps the layer the
/// builder restored already holds.
struct Layers<'a> {
    keys: &'a [String],
    done: usize,
}

/// What the image's execs start with so far.
#[derive(Clone, PartialEq, Default)]
struct Settings {
    env: BTreeMap<String, String>,
    cwd: String,
    user: Option<String>,
}

impl Settings {
    fn json(&self) -> Vec<u8> {
        let mut value = json!({ "env": self.env, "cwd": self.cwd });
        if let Some(user) = &self.user {
            value["user"] = json!(user);
        }
        serde_json::to_vec(&value).unwrap_or_default()
    }
}

async fn build_in(
    cp: &Arc<ControlPlane>,
    account: &Account,
    job: &DockerfileRecipe,
    log: &LiveLog,
    sandbox: &str,
    layers: Layers<'_>,
) -> Result<shoal_store::SnapshotRow, Failure> {
    let agent = cp
        .host
        .engine()
        .agent(sandbox)
        .await
        .map_err(ApiError::from)?;
    let mut settings = Settings {
        cwd: "/".into(),
        ..Settings::default()
    };
    // What the guest's exec defaults say now (`None`: nothing written, so
    // housekeeping runs as root).
    let mut written: Option<Settings> = None;
    let total = job.parsed.steps.len();
    for (index, step) in job.parsed.steps.iter().enumerate() {
        let line = step.line;
        log.line(&format!(
            "Step {}/{total} : {}",
            index + 1,
            instruction_text(&job.text, line)
        ));
        let at = |why: String| Failure(format!("Dockerfile line {line}: {why}"));
        if index < layers.done {
            // In the restored layer already: only what it says of the
            // image's settings is needed again.
            match &step.action {
                Action::Env { vars } => settings.env.extend(vars.clone()),
                Action::Workdir { path } => settings.cwd = path.clone(),
                Action::User { user } => settings.user = Some(user.clone()),
                Action::Run { .. } | Action::Copy { .. } => {}
            }
            log.line("  (cached)");
            continue;
        }
        match &step.action {
            Action::Run { argv, args } => {
                if written.as_ref() != Some(&settings) {
                    write_defaults(&agent, &settings).await.map_err(at)?;
                    written = Some(settings.clone());
                }
                let mut request = ExecRequest::new(shell_words(argv));
                request.env = args.clone();
                request.timeout = Some(RUN_TIMEOUT);
                let code = stream_exec(&agent, request, RUN_TIMEOUT + GUEST_MARGIN, log)
                    .await
                    .map_err(at)?;
                if code != 0 {
                    return Err(at(format!("RUN exited with status {code}")));
                }
                if let Some(key) = layers.keys.get(index) {
                    crate::build_layers::checkpoint(cp, sandbox, key).await;
                }
            }
            Action::Copy {
                sources,
                dest,
                chown,
                chmod,
                unpack_archives,
            } => {
                if written.as_ref().is_some_and(|w| w.user.is_some()) {
                    // COPY's own work (chown, unpacking) runs as root.
                    write_defaults(&agent, &Settings::default())
                        .await
                        .map_err(at)?;
                    written = None;
                }
                let files = placements(line, sources, dest, &job.context)
                    .map_err(|e| Failure(e.message))?;
                copy(
                    &agent,
                    &job.context,
                    &files,
                    chown,
                    chmod,
                    *unpack_archives,
                    log,
                )
                .await
                .map_err(at)?;
            }
            Action::Env { vars } => {
                for (key, value) in vars {
                    settings.env.insert(key.clone(), value.clone());
                }
            }
            Action::Workdir { path } => {
                guest(agent.make_dir(path)).await.map_err(at)?;
                settings.cwd = path.clone();
            }
            Action::User { user } => settings.user = Some(user.clone()),
        }
    }
    let image = Settings {
        env: job.parsed.env.clone(),
        cwd: job.parsed.workdir.clone(),
        user: job.parsed.user.clone(),
    };
    write_defaults(&agent, &image)
        .await
        .map_err(|e| Failure(format!("writing the image's settings: {e}")))?;
    if let Some(start) = &job.parsed.start {
        let command = shell_words(start);
        log.line(&format!("starting: {command}"));
        crate::templates::start_detached(cp, sandbox, &command).await?;
    }
    if let Some(ready) = &job.parsed.ready {
        let command = shell_words(ready);
        log.line(&format!("waiting until this succeeds: {command}"));
        crate::templates::wait_ready(cp, sandbox, &command, READY_TIMEOUT).await?;
    }
    log.line("baking the snapshot");
    Ok(cp.take_snapshot(account, sandbox).await?)
}

/// A guest call under a host-side deadline.
async fn guest<T>(
    call: impl std::future::Future<Output = Result<T, shoal_proto::client::AgentError>>,
) -> Result<T, String> {
    match tokio::time::timeout(FILE_DEADLINE, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the guest did not answer in time".into()),
    }
}

async fn write_defaults(
    agent: &shoal_proto::client::AgentClient,
    settings: &Settings,
) -> Result<(), String> {
    let bytes = settings.json();
    guest(agent.write_file(EXEC_DEFAULTS, Some(0o644), &bytes[..]))
        .await
        .map(|_| ())
}

/// Runs a command, its output to the log, and returns its exit code
/// (128 + signal when killed).
async fn stream_exec(
    agent: &shoal_proto::client::AgentClient,
    request: ExecRequest,
    deadline: Duration,
    log: &LiveLog,
) -> Result<i32, String> {
    let mut out = LineSplitter::default();
    let mut err = LineSplitter::default();
    let work = async {
        let mut handle = agent.exec(request).await.map_err(|e| e.to_string())?;
        loop {
            match handle.next_event().await.map_err(|e| e.to_string())? {
                ExecEvent::Stdout(chunk) => out.feed(&chunk, log),
                ExecEvent::Stderr(chunk) => err.feed(&chunk, log),
                ExecEvent::Exit(status) => {
                    if status.timed_out {
                        return Err(format!("timed out after {} s", RUN_TIMEOUT.as_secs()));
                    }
                    return Ok(status
                        .code
                        .unwrap_or_else(|| 128 + status.signal.unwrap_or(0)));
                }
            }
        }
    };
    let result = match tokio::time::timeout(deadline, work).await {
        Ok(result) => result,
        Err(_) => Err("the guest did not answer in time".into()),
    };
    out.flush(log);
    err.flush(log);
    result
}

/// Writes the placed files into the guest, then applies `--chown`,
/// `--chmod` and (for `ADD`) unpacks local archives.
async fn copy(
    agent: &shoal_proto::client::AgentClient,
    context: &Context,
    files: &[Placement],
    chown: &Option<String>,
    chmod: &Option<String>,
    unpack_archives: bool,
    log: &LiveLog,
) -> Result<(), String> {
    let mode = match chmod {
        Some(octal) => {
            Some(u32::from_str_radix(octal, 8).map_err(|_| format!("bad --chmod {octal}"))?)
        }
        None => None,
    };
    let mut written = Vec::new();
    for placement in files {
        let bytes = &context.files[&placement.source];
        if unpack_archives && is_archive(&placement.source) {
            let dir = placement.dest.trim_end_matches('/');
            let dir = if files.len() == 1 && !placement.dest.ends_with('/') {
                // `ADD x.tar.gz /dir` unpacks into /dir.
                placement.dest.as_str()
            } else {
                dir.rsplit_once('/').map_or(
                    "/",
                    |(parent, _)| if parent.is_empty() { "/" } else { parent },
                )
            };
            let scratch = format!("/tmp/.shoal-add-{:08x}", rand::random::<u32>());
            guest(agent.write_file(&scratch, Some(0o600), &bytes[..])).await?;
            let command = format!(
                "mkdir -p -- {dir} && tar -xf {scratch} -C {dir}; status=$?; rm -f -- {scratch}; exit $status",
                dir = crate::templates::shell_quoted(dir),
                scratch = crate::templates::shell_quoted(&scratch),
            );
            housekeeping(agent, command, log).await?;
            continue;
        }
        guest(agent.write_file(&placement.dest, mode.or(Some(0o644)), &bytes[..])).await?;
        written.push(placement.dest.clone());
    }
    if let Some(owner) = chown {
        for chunk in written.chunks(200) {
            let paths: Vec<String> = chunk
                .iter()
                .map(|p| crate::templates::shell_quoted(p))
                .collect();
            let command = format!(
                "chown -- {} {}",
                crate::templates::shell_quoted(owner),
                paths.join(" ")
            );
            housekeeping(agent, command, log).await?;
        }
    }
    log.line(&format!("copied {} file(s)", files.len()));
    Ok(())
}

async fn housekeeping(
    agent: &shoal_proto::client::AgentClient,
    command: String,
    log: &LiveLog,
) -> Result<(), String> {
    let mut request = ExecRequest::new(command);
    request.timeout = Some(FILE_DEADLINE);
    match stream_exec(agent, request, FILE_DEADLINE + GUEST_MARGIN, log).await? {
        0 => Ok(()),
        code => Err(format!("exited with status {code}")),
    }
}

fn not_found() -> ApiError {
    ApiError::not_found("build not found")
}

pub async fn list(State(cp): St, Caller(account): Caller) -> ApiResult<Json<Value>> {
    let items: Vec<Value> = cp
        .store
        .list_builds(account.id)
        .await?
        .iter()
        .map(build_json)
        .collect();
    Ok(Json(json!({ "items": items })))
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = cp
        .store
        .get_build(account.id, &id)
        .await?
        .ok_or_else(not_found)?;
    Ok(Json(build_json(&row)))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct LogsQuery {
    follow: Option<String>,
}

/// The build's log as SSE, one `data:` per line, ending with `data: end`;
/// with `follow`, a running build's lines as they come until it ends.
pub async fn logs(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Query(query): Query<LogsQuery>,
) -> ApiResult<Response> {
    let row = cp
        .store
        .get_build(account.id, &id)
        .await?
        .ok_or_else(not_found)?;
    let follow = matches!(query.follow.as_deref(), Some("1" | "true" | "yes"));
    let live = lock(&cp.builds.live).get(&row.id).cloned();
    let log = match live {
        Some(live) => live,
        None => {
            // Ended (or run by another process): its stored log, whole.
            let stored = cp
                .store
                .build_log(account.id, &id)
                .await?
                .unwrap_or_default();
            let log = LiveLog::default();
            for line in stored.lines() {
                log.line(line);
            }
            log.end();
            Arc::new(log)
        }
    };
    let events =
        futures::stream::unfold((log, 0u64, false), move |(log, index, done)| async move {
            if done {
                return None;
            }
            loop {
                let next = {
                    let changed = log.changed.notified();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    match log.next(index) {
                        Next::Wait if follow => {
                            changed.await;
                            continue;
                        }
                        other => other,
                    }
                };
                let (event, state) = match next {
                    Next::Line(at, line) => (Event::default().data(line), (log, at + 1, false)),
                    // Not following: what there is so far, then the end.
                    Next::End | Next::Wait => (Event::default().data("end"), (log, index, true)),
                };
                return Some((Ok::<_, std::convert::Infallible>(event), state));
            }
        });
    let mut response = Sse::new(events)
        .keep_alive(
            KeepAlive::new()
                .interval(Duration::from_secs(15))
                .text("keep-alive"),
        )
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(response)
}

/// Fails the builds this host left unfinished when it stopped.
pub(crate) async fn fail_abandoned(cp: &ControlPlane) {
    match cp
        .store
        .fail_abandoned_builds(&cp.config.host_name, now())
        .await
    {
        Ok(0) => {}
        Ok(n) => tracing::warn!(builds = n, "failed the builds a restart interrupted"),
        Err(e) => tracing::error!(error = %e, "failing interrupted builds"),
    }
    // Their uploads, pulled layouts and half-made import disks have no
    // build left to use them.
    for dir in [
        crate::imports::uploads_dir(cp),
        crate::imports::pulls_dir(cp),
        cp.host.engine().state_dir().join("imports"),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(paths: &[&str]) -> Context {
        let mut c = Context::default();
        for p in paths {
            c.files.insert((*p).to_owned(), p.as_bytes().to_vec());
        }
        c
    }

    fn dests(sources: &[&str], dest: &str, c: &Context) -> Vec<String> {
        let sources: Vec<String> = sources.iter().map(|s| (*s).to_owned()).collect();
        placements(7, &sources, dest, c)
            .unwrap()
            .into_iter()
            .map(|p| p.dest)
            .collect()
    }

    #[test]
    fn copies_land_where_docker_puts_them() {
        let c = context(&["a.txt", "b.txt", "src/x.py", "src/lib/y.py"]);
        assert_eq!(dests(&["a.txt"], "/opt/a", &c), ["/opt/a"]);
        assert_eq!(dests(&["a.txt"], "/opt/", &c), ["/opt/a.txt"]);
        assert_eq!(
            dests(&["a.txt", "b.txt"], "/opt", &c),
            ["/opt/a.txt", "/opt/b.txt"]
        );
        assert_eq!(dests(&["*.txt"], "/d/", &c), ["/d/a.txt", "/d/b.txt"]);
        assert_eq!(dests(&["src"], "/app", &c), ["/app/lib/y.py", "/app/x.py"]);
        assert_eq!(
            dests(&["./src/"], "/app/", &c),
            ["/app/lib/y.py", "/app/x.py"]
        );
        assert_eq!(dests(&["."], "/", &c).len(), 4);
        assert!(dests(&["."], "/", &c).contains(&"/src/lib/y.py".to_owned()));
        let missing = placements(7, &["nope.txt".into()], "/x", &c).unwrap_err();
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert!(
            missing.message.starts_with("Dockerfile line 7: nope.txt"),
            "{}",
            missing.message
        );
    }

    #[test]
    fn context_paths_stay_inside_the_context() {
        for ok in ["a", "dir/b.txt", ".hidden"] {
            assert!(valid_context_path(ok), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "a//b", "./a"] {
            assert!(!valid_context_path(bad), "{bad}");
        }
    }

    #[test]
    fn the_cache_key_changes_with_any_input() {
        let c = context(&["a.txt"]);
        let key = cache_key("template:base:1:h", "FROM base\n", &c);
        assert_eq!(key, cache_key("template:base:1:h", "FROM base\n", &c));
        assert_ne!(key, cache_key("template:base:2:h", "FROM base\n", &c));
        assert_ne!(
            key,
            cache_key("template:base:1:h", "FROM base\nRUN true\n", &c)
        );
        let mut changed = context(&["a.txt"]);
        changed.files.insert("a.txt".into(), b"other".to_vec());
        assert_ne!(key, cache_key("template:base:1:h", "FROM base\n", &changed));
    }

    #[test]
    fn the_log_keeps_its_tail_and_cuts_long_lines() {
        let log = LiveLog::default();
        log.line(&"x".repeat(MAX_LINE_BYTES * 2));
        assert!(log.text().len() < MAX_LINE_BYTES + 20);
        for i in 0..200_000 {
            log.line(&format!("line {i}"));
        }
        let text = log.text();
        assert!(text.len() <= MAX_LOG_BYTES);
        assert!(text.ends_with("line 199999\n"));
        assert!(matches!(log.next(0), Next::Line(at, _) if at > 0));
        let mut split = LineSplitter::default();
        split.feed(b"a\nb", &log);
        split.flush(&log);
        assert!(log.text().ends_with("a\nb\n"));
    }
}
