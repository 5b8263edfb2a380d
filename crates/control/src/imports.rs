//! Template builds from something other than a Dockerfile (issue 21): a
//! root filesystem tarball uploaded as the SDK's `templates.build(...,
//! rootfs_tar=...)` sends it (the multipart field `rootfs`), or an OCI
//! image named by `image_ref` (`templates.register`): `docker save` output
//! or an OCI image layout, as a tar or a directory, in this host's image
//! archive directory (`<state dir>/image-archives/`, which the operator
//! fills; a tenant may name only what is there), or an image in a registry
//! the operator trusts (`shoal up --registry`), pulled into an OCI layout
//! first (`registry.rs`).
//!
//! The root filesystem can be any distribution: the host makes it into an
//! ext4 disk with the static guest agent installed, boots it with this
//! host's guest kernel, and saves the booted VM as the template's snapshot
//! (`shoal_host::imports`). The build is otherwise a build like any other:
//! queued, building, done or failed, with its log, its cache key and its
//! template row (`builds.rs`).
//!
//! An upload is streamed to a file (never held in memory), bounded by the
//! account's tier (its largest template disk), and removed when the build
//! ends whatever happened.
//!
//! Owns: the upload file, the resolution of `image_ref`, the pull's work
//! directory, the import build step. Does not own: unpacking and the disk (`shoal_image::import`), the
//! boot (`shoal_engine::disk_boot`), build rows and logs (`builds.rs`).

use crate::builds::{name_or_discard, Failure, Job, LiveLog};
use crate::error::{ApiError, ApiResult};
use crate::registry::{ImageRef, PullError, Puller, Registry, Resolved};
use crate::ControlPlane;
use axum::http::StatusCode;
use sha2::{Digest, Sha256};
use shoal_host::imports::{ImportSource, ImportSpec};
use shoal_store::Account;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::AsyncWriteExt as _;

/// The disk an import gets when the request names none (the SDK's default).
const DEFAULT_DISK_MIB: u32 = 1024;
/// The smallest disk an import may ask for.
const MIN_DISK_MIB: u32 = 64;
/// The smallest VM an import may ask for.
const MIN_MEMORY_MIB: u32 = 128;
/// The longest a registry pull may take, whole.
const PULL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// An uploaded root filesystem tarball on this host's disk; removed when
/// dropped.
pub(crate) struct Upload {
    pub(crate) path: PathBuf,
    pub(crate) bytes: u64,
    pub(crate) sha256: String,
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Where uploads wait for their build.
pub(crate) fn uploads_dir(cp: &ControlPlane) -> PathBuf {
    cp.host.engine().state_dir().join("uploads")
}

/// Where registry pulls write their OCI layouts until the import unpacks them.
pub(crate) fn pulls_dir(cp: &ControlPlane) -> PathBuf {
    cp.host.engine().state_dir().join("pulls")
}

/// Where the operator leaves image archives a tenant may name.
pub(crate) fn image_archive_dir(cp: &ControlPlane) -> PathBuf {
    cp.host.engine().state_dir().join("image-archives")
}

/// Streams one multipart file field to a new file under `dir`, at most
/// `limit` bytes (413 past it, and the partial file is gone).
pub(crate) async fn receive(
    field: &mut axum::extract::multipart::Field<'_>,
    dir: &Path,
    limit: u64,
) -> ApiResult<Upload> {
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
    let path = dir.join(format!("{:016x}.upload", rand::random::<u64>()));
    let mut file = tokio::fs::File::create(&path)
        .await
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", path.display())))?;
    let mut upload = Upload {
        path,
        bytes: 0,
        sha256: String::new(),
    };
    let mut hasher = Sha256::new();
    while let Some(chunk) = field
        .chunk()
        .await
        .map_err(|e| ApiError::new(e.status(), format!("reading the upload: {}", e.body_text())))?
    {
        upload.bytes += chunk.len() as u64;
        if upload.bytes > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the root filesystem is over {} MiB, the largest template disk of this \
                     account's tier",
                    limit >> 20
                ),
            ));
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .await
            .map_err(|e| ApiError::internal(format!("writing the upload: {e}")))?;
    }
    file.flush()
        .await
        .map_err(|e| ApiError::internal(format!("writing the upload: {e}")))?;
    upload.sha256 = format!("{:x}", hasher.finalize());
    Ok(upload)
}

/// Where a pull writes its OCI layout; removed when dropped.
struct PullDir(PathBuf);

impl Drop for PullDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What an import unpacks.
enum Origin {
    /// A file on this host: an upload or an operator's archive.
    Local(ImportSource),
    /// An image in a trusted registry, resolved to its manifest at submission.
    Registry {
        registry: Registry,
        repository: String,
        image: Resolved,
    },
}

/// An import, checked and ready to run.
pub(crate) struct ImportRecipe {
    origin: Origin,
    /// Kept (and so on disk) until the build ends.
    _upload: Option<Upload>,
    what: String,
    disk_mib: u32,
    vcpus: u32,
    memory_mib: u32,
}

/// What a submission without a Dockerfile asked for.
pub(crate) struct ImportRequest {
    pub(crate) rootfs: Option<Upload>,
    pub(crate) image_ref: Option<String>,
    pub(crate) size_mb: Option<u32>,
    pub(crate) cpu: Option<u32>,
    pub(crate) memory_mb: Option<u32>,
}

/// Checks an import request (4xx for anything wrong, before anything
/// runs; a registry reference is resolved to its manifest's digest) and
/// returns the recipe and its cache key.
pub(crate) async fn recipe(
    cp: &ControlPlane,
    account: &Account,
    request: ImportRequest,
) -> ApiResult<(ImportRecipe, String)> {
    let unprocessable = |why: String| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, why);
    let limits = cp.snapshot_limits(account.tier);
    let disk_mib = request.size_mb.unwrap_or(DEFAULT_DISK_MIB);
    if !(MIN_DISK_MIB..=limits.template_disk_mib).contains(&disk_mib) {
        return Err(unprocessable(format!(
            "size_mb must be from {MIN_DISK_MIB} to {} (this account's tier's largest template disk)",
            limits.template_disk_mib
        )));
    }
    // The VM is at most the base template's size: what this host bakes
    // its own templates at.
    let base = cp
        .host
        .engine()
        .template("base")
        .map_err(|e| ApiError::internal(format!("the base template: {e}")))?;
    let vcpus = request.cpu.unwrap_or(base.vcpus);
    let memory_mib = request.memory_mb.unwrap_or(base.memory_mib);
    if vcpus == 0
        || vcpus > base.vcpus
        || memory_mib < MIN_MEMORY_MIB
        || memory_mib > base.memory_mib
    {
        return Err(unprocessable(format!(
            "cpu must be from 1 to {} and memory_mb from {MIN_MEMORY_MIB} to {}",
            base.vcpus, base.memory_mib
        )));
    }
    let (origin, upload, what, identity) = match (request.rootfs, request.image_ref) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "send one of rootfs and image_ref, not both",
            ))
        }
        (Some(upload), None) => {
            let what = format!("the uploaded root filesystem ({} bytes)", upload.bytes);
            let identity = format!("rootfs:{}", upload.sha256);
            (
                Origin::Local(ImportSource::RootfsTar(upload.path.clone())),
                Some(upload),
                what,
                identity,
            )
        }
        (None, Some(reference)) => match resolve_image_ref(cp, &reference)? {
            Named::Archive(archive) => {
                let identity = archive_identity(&archive);
                (
                    Origin::Local(ImportSource::OciArchive(archive)),
                    None,
                    format!("the image archive {reference}"),
                    identity,
                )
            }
            Named::Image(registry, image_ref) => {
                let mut puller = Puller::new(&registry, &image_ref.repository)
                    .map_err(|e| pull_error(&reference, e))?;
                let image = puller
                    .resolve(&image_ref.reference)
                    .await
                    .map_err(|e| pull_error(&reference, e))?;
                let identity = format!(
                    "registry:{}/{}@{}",
                    registry.name, image_ref.repository, image.digest
                );
                (
                    Origin::Registry {
                        registry,
                        repository: image_ref.repository,
                        image,
                    },
                    None,
                    format!("the image {reference}"),
                    identity,
                )
            }
        },
        (None, None) => return Err(ApiError::bad_request("dockerfile is required")),
    };
    let mut hasher = Sha256::new();
    for part in [
        "import-v1",
        &identity,
        &disk_mib.to_string(),
        &vcpus.to_string(),
        &memory_mib.to_string(),
        &base.input_hash,
    ] {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    Ok((
        ImportRecipe {
            origin,
            _upload: upload,
            what,
            disk_mib,
            vcpus,
            memory_mib,
        },
        format!("{:x}", hasher.finalize()),
    ))
}

/// What an `image_ref` names.
enum Named {
    Archive(PathBuf),
    Image(Registry, ImageRef),
}

/// A pull's failure as the submission's answer: the tenant's to fix (422)
/// or the registry's (502).
fn pull_error(reference: &str, e: PullError) -> ApiError {
    match e {
        PullError::Refused(why) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("image_ref {reference:?}: {why}"),
        ),
        PullError::Registry(why) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!("image_ref {reference:?}: {why}"),
        ),
    }
}

/// What `reference` names: an archive inside this host's image archive
/// directory (`oci-archive:` and `docker-archive:` prefixes allowed), or
/// an image in one of the registries the operator trusts. Anything else is
/// a 422 that says what works.
fn resolve_image_ref(cp: &ControlPlane, reference: &str) -> ApiResult<Named> {
    let dir = image_archive_dir(cp);
    let prefixed = reference
        .strip_prefix("oci-archive:")
        .or_else(|| reference.strip_prefix("docker-archive:"));
    let path = prefixed.unwrap_or(reference);
    let registries = &cp.config.registries;
    let trusted = || {
        if registries.is_empty() {
            "this host pulls from no registry (its operator names them with `shoal up --registry`)"
                .to_owned()
        } else {
            let names: Vec<&str> = registries.iter().map(|r| r.name.as_str()).collect();
            format!("this host pulls from {}", names.join(", "))
        }
    };
    let not_here = || {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "image_ref {reference:?} names no image archive in this host's archive directory \
                 ({}) and no image in a registry it pulls from: save the image there (`docker \
                 save`, or an OCI layout) and name it by its file name, or name an image in a \
                 registry; {}",
                dir.display(),
                trusted()
            ),
        )
    };
    if path.is_empty() || path.contains('\0') {
        return Err(not_here());
    }
    let candidate = if Path::new(path).is_absolute() {
        PathBuf::from(path)
    } else {
        dir.join(path)
    };
    let archive = candidate.canonicalize().ok().and_then(|resolved| {
        let top = dir.canonicalize().ok()?;
        (resolved.starts_with(&top) && resolved != top).then_some(resolved)
    });
    if let Some(archive) = archive {
        return Ok(Named::Archive(archive));
    }
    if prefixed.is_some() || Path::new(path).is_absolute() {
        return Err(not_here());
    }
    let Some(image) = ImageRef::parse(reference) else {
        return Err(not_here());
    };
    match registries.iter().find(|r| r.name == image.registry) {
        Some(registry) => Ok(Named::Image(registry.clone(), image)),
        None => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "image_ref {reference:?} is in the registry {}, which {}; and no archive of that \
                 name is in this host's archive directory ({})",
                image.registry,
                trusted().replace("this host", "this host does not pull from: it"),
                dir.display()
            ),
        )),
    }
}

/// What identifies an archive's content for the cache: its path, size and
/// modification time (hashing a many-GiB archive at each submission would
/// cost more than the cache saves).
fn archive_identity(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).ok();
    format!(
        "archive:{}:{}:{}:{}",
        path.display(),
        meta.as_ref().map_or(0, |m| m.size()),
        meta.as_ref().map_or(0, |m| m.mtime()),
        meta.as_ref().map_or(0, |m| m.mtime_nsec()),
    )
}

/// Runs an import: the disk, the boot, the snapshot's record and the
/// template's name. On failure nothing is left.
pub(crate) async fn build(
    cp: &Arc<ControlPlane>,
    account: &Account,
    job: &Job,
    recipe: &ImportRecipe,
    log: &LiveLog,
) -> Result<String, Failure> {
    let limits = cp.snapshot_limits(account.tier);
    cp.store
        .check_snapshot_quota(account, &limits)
        .await
        .map_err(ApiError::from)?;
    // Held until the import has unpacked it.
    let mut _pulled = None;
    let source = match &recipe.origin {
        Origin::Local(source) => source.clone(),
        Origin::Registry {
            registry,
            repository,
            image,
        } => {
            let dir = PullDir(pulls_dir(cp).join(format!("{:016x}", rand::random::<u64>())));
            log.line(&format!(
                "pulling {}/{repository}@{} ({} layer(s), {} KiB)",
                registry.name,
                image.digest,
                image.layers.len(),
                image.declared_bytes().div_ceil(1024)
            ));
            let mut puller =
                Puller::new(registry, repository).map_err(|e| Failure(e.to_string()))?;
            let progress = |line: String| log.line(&line);
            tokio::time::timeout(
                PULL_DEADLINE,
                puller.pull(image, &dir.0, u64::from(recipe.disk_mib) << 20, &progress),
            )
            .await
            .map_err(|_| {
                Failure(format!(
                    "the pull took over {} minutes",
                    PULL_DEADLINE.as_secs() / 60
                ))
            })?
            .map_err(|e| Failure(e.to_string()))?;
            let source = ImportSource::OciArchive(dir.0.clone());
            _pulled = Some(dir);
            source
        }
    };
    log.line(&format!(
        "importing {}: unpacking into a {} MiB disk with the guest agent",
        recipe.what, recipe.disk_mib
    ));
    let (manifest, report) = cp
        .host
        .import_snapshot(ImportSpec {
            source,
            disk_mib: recipe.disk_mib,
            vcpus: recipe.vcpus,
            memory_mib: recipe.memory_mib,
        })
        .await
        .map_err(|e| Failure(ApiError::from(e).message))?;
    log.line(&format!(
        "{} layer(s), {} entries, {} MiB unpacked{}; booted with {} vCPUs and {} MiB and saved",
        report.layers,
        report.entries,
        report.bytes >> 20,
        if report.skipped > 0 {
            format!(
                " ({} device nodes and FIFOs left out: /dev is the kernel's)",
                report.skipped
            )
        } else {
            String::new()
        },
        manifest.vcpus,
        manifest.memory_mib,
    ));
    let row = cp
        .record_capture(account, &manifest.id, None, "base")
        .await?;
    name_or_discard(cp, account, job, &row.id).await?;
    Ok(row.id)
}
