//! Root filesystems that Shoal did not bootstrap: a tenant's root filesystem
//! tarball, or an OCI image archive (`docker save` output or an OCI image
//! layout, as a tar or a directory), made into a bootable ext4 image with
//! the guest agent installed.
//!
//! Every byte here comes from a tenant. Entries are unpacked only inside
//! the work directory (`..` and absolute names are refused, no entry is
//! written through a symlink that leaves it; whiteouts remove only inside
//! it), device nodes are skipped (the guest's `/dev` is devtmpfs), and the
//! unpacked size and entry count are bounded before the disk is made, so
//! an archive that would not fit is an error naming the limit, not a full
//! host disk.
//!
//! The agent must be static: it runs as PID 1 on whatever libc (or none)
//! the image has. [`require_static`] says so before anything is unpacked.
//!
//! Owns: archive reading, whiteouts, the agent's place and the image's exec
//! defaults (`/etc/shoal/exec.json`, from an OCI config's `Env`,
//! `WorkingDir` and `User`). Does not own: booting or snapshotting the
//! result (the engine's).

use crate::error::{ImageError, IoContext};
use crate::rootfs::{install_agent, make_ext4_image};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

/// The most entries one import unpacks (all layers together).
pub const MAX_ENTRIES: u64 = 500_000;
/// Of the disk, the share the unpacked files may take: ext4's own
/// metadata and the guest's first writes need the rest.
const FILL_PERCENT: u64 = 85;
/// The largest JSON document (index, manifest, config) read from an archive.
const MAX_JSON_BYTES: u64 = 4 << 20;

fn bad(why: impl Into<String>) -> ImageError {
    ImageError::Import(why.into())
}

/// What an imported image says its processes start with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
}

/// What an import did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportReport {
    pub layers: usize,
    pub entries: u64,
    pub bytes: u64,
    /// Device nodes and FIFOs left out.
    pub skipped: u64,
    pub config: ImageConfig,
}

/// Fails unless `agent` is a static ELF executable (no program
/// interpreter), the only kind that runs on any root filesystem.
pub fn require_static(agent: &Path) -> Result<(), ImageError> {
    let bytes = fs::read(agent).map_err(|_| ImageError::AgentMissing(agent.to_owned()))?;
    match elf_interpreter(&bytes) {
        Some(false) => Ok(()),
        Some(true) => Err(ImageError::Host(format!(
            "the guest agent {} is dynamically linked, so it cannot run on a root filesystem \
             Shoal did not build; build it static: cargo build --release -p shoal-guest-agent \
             --target x86_64-unknown-linux-musl",
            agent.display()
        ))),
        None => Err(ImageError::Host(format!(
            "the guest agent {} is not a 64-bit ELF executable",
            agent.display()
        ))),
    }
}

/// `Some(true)` when the 64-bit little-endian ELF file has a PT_INTERP
/// program header, `Some(false)` when it has none, `None` when it is not
/// such a file.
fn elf_interpreter(bytes: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if bytes.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let u16_at = |at: usize| Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 4 {
        return None;
    }
    for i in 0..phnum {
        let at = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let kind = u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?);
        if kind == PT_INTERP {
            return Some(true);
        }
    }
    Some(false)
}

/// Makes `image` (a sparse ext4 of `disk_mib` MiB) from the root
/// filesystem tarball `tar` (plain or gzip), with `agent` installed.
/// `work` is an empty directory the caller removes afterwards.
pub fn image_from_rootfs_tar(
    tar: &Path,
    agent: &Path,
    image: &Path,
    disk_mib: u32,
    work: &Path,
) -> Result<ImportReport, ImageError> {
    require_static(agent)?;
    let layers = [(tar.to_owned(), "the root filesystem tarball".to_owned())];
    image_from_layers(
        &layers,
        ImageConfig::default(),
        agent,
        image,
        disk_mib,
        work,
    )
}

/// Makes `image` from an OCI image archive: `docker save` output or an
/// OCI image layout, either a tar file or an unpacked directory. The
/// image's `Env`, `WorkingDir` and `User` become its exec defaults.
pub fn image_from_oci_archive(
    archive: &Path,
    agent: &Path,
    image: &Path,
    disk_mib: u32,
    work: &Path,
) -> Result<ImportReport, ImageError> {
    require_static(agent)?;
    let meta = fs::metadata(archive).map_err(|e| bad(format!("{}: {e}", archive.display())))?;
    let layout = if meta.is_dir() {
        archive.to_owned()
    } else {
        let outer = work.join("archive");
        fs::create_dir_all(&outer).ctx(|| format!("creating {}", outer.display()))?;
        // The outer archive holds the compressed layers: the same bound.
        let mut budget = Budget::for_disk(disk_mib);
        apply_layer(&outer, archive, "the image archive", &mut budget)?;
        outer
    };
    let (layers, config) = image_layers(&layout)?;
    let layers: Vec<(PathBuf, String)> = layers
        .into_iter()
        .enumerate()
        .map(|(index, layer)| (layer, format!("layer {}", index + 1)))
        .collect();
    image_from_layers(&layers, config, agent, image, disk_mib, work)
}

/// Unpacks `layers` (bottom first, each with how messages name it) into
/// `work/root`, installs the agent and `config`, and makes the disk.
fn image_from_layers(
    layers: &[(PathBuf, String)],
    config: ImageConfig,
    agent: &Path,
    image: &Path,
    disk_mib: u32,
    work: &Path,
) -> Result<ImportReport, ImageError> {
    let root = work.join("root");
    fs::create_dir_all(&root).ctx(|| format!("creating {}", root.display()))?;
    let mut budget = Budget::for_disk(disk_mib);
    for (layer, what) in layers {
        apply_layer(&root, layer, what, &mut budget)?;
    }
    let report = ImportReport {
        layers: layers.len(),
        entries: budget.entries,
        bytes: budget.bytes,
        skipped: budget.skipped,
        config,
    };
    finish(&root, agent, image, disk_mib, &report.config)?;
    Ok(report)
}

/// The layer files (bottom first) and config of the image in `layout`.
fn image_layers(layout: &Path) -> Result<(Vec<PathBuf>, ImageConfig), ImageError> {
    let inside = |name: &str| -> Result<PathBuf, ImageError> {
        let rel = clean_relative(Path::new(name))
            .ok_or_else(|| bad(format!("the image names a file outside it: {name}")))?;
        let path = layout.join(rel);
        let canonical = path
            .canonicalize()
            .map_err(|_| bad(format!("the image names {name}, which it does not hold")))?;
        let top = layout
            .canonicalize()
            .ctx(|| format!("resolving {}", layout.display()))?;
        if !canonical.starts_with(&top) || !canonical.is_file() {
            return Err(bad(format!(
                "the image names {name}, which it does not hold"
            )));
        }
        Ok(canonical)
    };
    let blob = |digest: &str| -> Result<PathBuf, ImageError> {
        let (algorithm, hex) = digest
            .split_once(':')
            .ok_or_else(|| bad(format!("bad digest {digest:?}")))?;
        if algorithm != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!("unsupported digest {digest:?}")));
        }
        inside(&format!("blobs/sha256/{hex}"))
    };
    if layout.join("manifest.json").is_file() && !layout.join("index.json").is_file() {
        // `docker save`: [{"Config": "...json", "Layers": [".../layer.tar", ...]}].
        let manifest = read_json(&inside("manifest.json")?)?;
        let first = manifest
            .as_array()
            .and_then(|images| images.first())
            .ok_or_else(|| bad("manifest.json lists no image"))?;
        let layers = first
            .get("Layers")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("manifest.json's image has no Layers"))?
            .iter()
            .map(|l| {
                l.as_str()
                    .ok_or_else(|| bad("a layer name is not a string"))
                    .and_then(inside)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let config = match first.get("Config").and_then(Value::as_str) {
            Some(name) => image_config(&read_json(&inside(name)?)?),
            None => ImageConfig::default(),
        };
        return Ok((layers, config));
    }
    let index = read_json(&inside("index.json")?).map_err(|_| {
        bad("not an image archive: neither an OCI layout (index.json) nor `docker save` output (manifest.json)")
    })?;
    let mut manifest = index;
    // An index may point at another index (multi-platform images): follow
    // to the first linux/amd64 manifest, or the only one.
    for _ in 0..4 {
        let Some(entries) = manifest.get("manifests").and_then(Value::as_array) else {
            break;
        };
        let chosen = entries
            .iter()
            .find(|m| {
                let platform = m.get("platform");
                platform.is_none_or(|p| {
                    p.get("os").and_then(Value::as_str) == Some("linux")
                        && p.get("architecture").and_then(Value::as_str) == Some("amd64")
                })
            })
            .ok_or_else(|| bad("the image has no linux/amd64 manifest"))?;
        let digest = chosen
            .get("digest")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("a manifest entry has no digest"))?;
        manifest = read_json(&blob(digest)?)?;
    }
    let layers = manifest
        .get("layers")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("the image manifest has no layers"))?
        .iter()
        .map(|l| {
            let digest = l
                .get("digest")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("a layer has no digest"))?;
            blob(digest)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let config = match manifest
        .get("config")
        .and_then(|c| c.get("digest"))
        .and_then(Value::as_str)
    {
        Some(digest) => image_config(&read_json(&blob(digest)?)?),
        None => ImageConfig::default(),
    };
    Ok((layers, config))
}

fn read_json(path: &Path) -> Result<Value, ImageError> {
    let mut text = Vec::new();
    fs::File::open(path)
        .and_then(|f| f.take(MAX_JSON_BYTES + 1).read_to_end(&mut text))
        .ctx(|| format!("reading {}", path.display()))?;
    if text.len() as u64 > MAX_JSON_BYTES {
        return Err(bad(format!(
            "{} is over {MAX_JSON_BYTES} bytes",
            path.display()
        )));
    }
    serde_json::from_slice(&text).map_err(|e| bad(format!("{}: {e}", path.display())))
}

/// The exec defaults an OCI image config gives.
fn image_config(config: &Value) -> ImageConfig {
    let inner = config.get("config").unwrap_or(&Value::Null);
    let env = inner
        .get("Env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let text = |key: &str| {
        inner
            .get(key)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    ImageConfig {
        env,
        cwd: text("WorkingDir"),
        user: text("User"),
    }
}

/// Limits on what one import unpacks, and what it has so far.
struct Budget {
    max_bytes: u64,
    bytes: u64,
    entries: u64,
    skipped: u64,
}

impl Budget {
    fn for_disk(disk_mib: u32) -> Budget {
        Budget {
            max_bytes: (u64::from(disk_mib) << 20) * FILL_PERCENT / 100,
            bytes: 0,
            entries: 0,
            skipped: 0,
        }
    }

    fn take(&mut self, size: u64, what: &str) -> Result<(), ImageError> {
        self.entries += 1;
        self.bytes = self.bytes.saturating_add(size);
        if self.entries > MAX_ENTRIES {
            return Err(bad(format!("{what}: more than {MAX_ENTRIES} entries")));
        }
        if self.bytes > self.max_bytes {
            return Err(bad(format!(
                "{what}: the files come to more than {} MiB, {FILL_PERCENT}% of the template's \
                 disk (size_mb); ask for a larger one",
                self.max_bytes >> 20
            )));
        }
        Ok(())
    }
}

/// A reader of `layer`, decompressed when it is gzip.
fn open_layer(layer: &Path, what: &str) -> Result<Box<dyn Read>, ImageError> {
    let mut file = fs::File::open(layer).ctx(|| format!("opening {}", layer.display()))?;
    let mut magic = [0u8; 4];
    let n = file
        .read(&mut magic)
        .ctx(|| format!("reading {}", layer.display()))?;
    let file =
        BufReader::new(fs::File::open(layer).ctx(|| format!("opening {}", layer.display()))?);
    match &magic[..n] {
        [0x1f, 0x8b, ..] => Ok(Box::new(flate2::read::GzDecoder::new(file))),
        [0x28, 0xb5, 0x2f, 0xfd] => Err(bad(format!(
            "{what} is zstd-compressed; send it as a plain or gzip tar"
        ))),
        _ => Ok(Box::new(file)),
    }
}

/// `path` without `.`, a leading `/`, or any `..` (`None` then).
fn clean_relative(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Where `rel` is under `root` when every directory above it resolves
/// inside `root` (a symlink planted by an earlier entry may not lead
/// out); `None` when its parent does not exist or leaves.
fn resolved_inside(root: &Path, rel: &Path) -> Option<PathBuf> {
    let name = rel.file_name()?;
    let parent = root.join(rel.parent()?).canonicalize().ok()?;
    let top = root.canonicalize().ok()?;
    parent.starts_with(&top).then(|| parent.join(name))
}

fn remove_any(path: &Path) -> Result<(), ImageError> {
    match fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(meta) if meta.is_dir() => {
            fs::remove_dir_all(path).ctx(|| format!("removing {}", path.display()))
        }
        Ok(_) => fs::remove_file(path).ctx(|| format!("removing {}", path.display())),
    }
}

/// Unpacks one layer over `root`, applying its whiteouts first.
fn apply_layer(
    root: &Path,
    layer: &Path,
    what: &str,
    budget: &mut Budget,
) -> Result<(), ImageError> {
    let unreadable = |e: std::io::Error| bad(format!("{what} is not a readable tar archive: {e}"));
    // Pass 1: whiteouts hide what lower layers put there, wherever they
    // sit in this layer's stream.
    let mut archive = tar::Archive::new(open_layer(layer, what)?);
    for entry in archive.entries().map_err(unreadable)? {
        let entry = entry.map_err(unreadable)?;
        let raw = entry.path().map_err(unreadable)?.into_owned();
        let Some(name) = raw.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(hidden) = name.strip_prefix(".wh.") else {
            continue;
        };
        let rel = clean_relative(&raw)
            .ok_or_else(|| bad(format!("{what}: {} leaves the root", raw.display())))?;
        let dir = rel.parent().unwrap_or(Path::new(""));
        if hidden == ".wh..opq" {
            if let Some(dir) =
                resolved_inside(root, &dir.join("x")).and_then(|p| p.parent().map(Path::to_owned))
            {
                if let Ok(children) = fs::read_dir(&dir) {
                    for child in children.flatten() {
                        remove_any(&child.path())?;
                    }
                }
            }
        } else if let Some(target) = resolved_inside(root, &dir.join(hidden)) {
            remove_any(&target)?;
        }
    }
    // Pass 2: everything else.
    let mut archive = tar::Archive::new(open_layer(layer, what)?);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    for entry in archive.entries().map_err(unreadable)? {
        let mut entry = entry.map_err(unreadable)?;
        let raw = entry.path().map_err(unreadable)?.into_owned();
        if raw
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(".wh."))
        {
            continue;
        }
        let rel = clean_relative(&raw)
            .ok_or_else(|| bad(format!("{what}: {} leaves the root", raw.display())))?;
        if rel.as_os_str().is_empty() {
            continue;
        }
        let kind = entry.header().entry_type();
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            budget.skipped += 1;
            continue;
        }
        budget.take(entry.header().size().unwrap_or(0), what)?;
        // A file where a directory was (or the other way round) replaces it.
        if let Some(existing) = resolved_inside(root, &rel) {
            if let Ok(meta) = fs::symlink_metadata(&existing) {
                if meta.is_dir() != kind.is_dir() {
                    remove_any(&existing)?;
                }
            }
        }
        let unpacked = entry.unpack_in(root).map_err(|e| {
            let cause = std::error::Error::source(&e)
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            bad(format!("{what}: unpacking {}: {e}{cause}", rel.display()))
        })?;
        if !unpacked {
            return Err(bad(format!("{what}: {} leaves the root", raw.display())));
        }
    }
    Ok(())
}

/// Installs the agent and what the initramfs and agent need, writes the
/// exec defaults, and makes the disk.
fn finish(
    root: &Path,
    agent: &Path,
    image: &Path,
    disk_mib: u32,
    config: &ImageConfig,
) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt as _;
    // The initramfs moves /dev, /proc and /sys into these; the agent
    // writes /etc/resolv.conf and runs commands with /tmp.
    for dir in ["dev", "proc", "sys", "etc", "tmp", "run", "root"] {
        let path = root.join(dir);
        if fs::symlink_metadata(&path).is_ok_and(|m| !m.is_dir()) {
            remove_any(&path)?;
        }
        fs::create_dir_all(&path).ctx(|| format!("creating {}", path.display()))?;
    }
    fs::set_permissions(root.join("tmp"), fs::Permissions::from_mode(0o1777))
        .ctx(|| "chmod /tmp".into())?;
    for link in ["usr/local/sbin", "usr/local"] {
        let path = root.join(link);
        if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            remove_any(&path)?;
        }
    }
    install_agent(root, agent)?;
    if config != &ImageConfig::default() {
        let mut defaults = serde_json::json!({ "env": config.env });
        if let Some(cwd) = &config.cwd {
            defaults["cwd"] = cwd.clone().into();
        }
        if let Some(user) = &config.user {
            defaults["user"] = user.clone().into();
        }
        let dir = root.join("etc/shoal");
        if fs::symlink_metadata(&dir).is_ok_and(|m| !m.is_dir()) {
            remove_any(&dir)?;
        }
        fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let path = dir.join("exec.json");
        remove_any(&path)?;
        fs::write(&path, defaults.to_string()).ctx(|| format!("writing {}", path.display()))?;
    }
    make_ext4_image(root, image, disk_mib)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, data) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            header.set_entry_type(tar::EntryType::Regular);
            builder.append_data(&mut header, name, *data).unwrap();
        }
        builder.into_inner().unwrap()
    }

    #[test]
    fn the_agent_must_be_static() {
        let dir = tempfile::tempdir().unwrap();
        // This test binary links glibc dynamically.
        let me = std::env::current_exe().unwrap();
        let err = require_static(&me).unwrap_err().to_string();
        assert!(err.contains("dynamically linked"), "{err}");
        let text = dir.path().join("text");
        fs::write(&text, "#!/bin/sh\n").unwrap();
        assert!(require_static(&text)
            .unwrap_err()
            .to_string()
            .contains("not a 64-bit ELF"));
        assert_eq!(
            elf_interpreter(b"\x7fELF\x02\x01"),
            None,
            "truncated header"
        );
    }

    #[test]
    fn whiteouts_remove_lower_files_and_opaque_dirs_empty_them() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let lower = dir.path().join("lower.tar");
        fs::write(
            &lower,
            tar_of(&[("a/keep", b"1"), ("a/gone", b"2"), ("b/x", b"3")]),
        )
        .unwrap();
        let upper = dir.path().join("upper.tar");
        fs::write(
            &upper,
            tar_of(&[("a/.wh.gone", b""), ("b/.wh..wh..opq", b""), ("b/y", b"4")]),
        )
        .unwrap();
        let mut budget = Budget::for_disk(64);
        apply_layer(&root, &lower, "lower", &mut budget).unwrap();
        apply_layer(&root, &upper, "upper", &mut budget).unwrap();
        assert!(root.join("a/keep").exists());
        assert!(!root.join("a/gone").exists());
        assert!(!root.join("b/x").exists());
        assert_eq!(fs::read(root.join("b/y")).unwrap(), b"4");
        assert!(!root.join("a/.wh.gone").exists());
    }

    #[test]
    fn nothing_is_written_or_removed_outside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("victim"), "safe").unwrap();
        // A symlink to outside, then a write and a whiteout through it.
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        header.set_mode(0o777);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        builder
            .append_link(&mut header, "escape", &outside)
            .unwrap();
        let layer = dir.path().join("evil.tar");
        fs::write(&layer, builder.into_inner().unwrap()).unwrap();
        let mut budget = Budget::for_disk(64);
        apply_layer(&root, &layer, "evil", &mut budget).unwrap();
        let through = dir.path().join("through.tar");
        fs::write(&through, tar_of(&[("escape/.wh.victim", b"")])).unwrap();
        apply_layer(&root, &through, "whiteout", &mut budget).unwrap();
        assert_eq!(fs::read_to_string(outside.join("victim")).unwrap(), "safe");
        let write = dir.path().join("write.tar");
        fs::write(&write, tar_of(&[("escape/new", b"x")])).unwrap();
        assert!(apply_layer(&root, &write, "write", &mut budget).is_err());
        assert!(!outside.join("new").exists());
        // `..` in a name is refused outright.
        let mut raw = tar_of(&[("placeholder-name", b"x")]);
        raw[..16].copy_from_slice(b"../../etc/passwd");
        raw[16..20].fill(0);
        // Fix the header checksum after editing the name.
        let mut header = tar::Header::from_byte_slice(&raw[..512]).clone();
        header.set_cksum();
        raw[..512].copy_from_slice(header.as_bytes());
        let dotdot = dir.path().join("dotdot.tar");
        fs::write(&dotdot, raw).unwrap();
        let err = apply_layer(&root, &dotdot, "dotdot", &mut budget)
            .unwrap_err()
            .to_string();
        assert!(err.contains("leaves the root"), "{err}");
    }

    #[test]
    fn an_archive_larger_than_the_disk_is_refused_naming_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let big = vec![0u8; 2 << 20];
        let layer = dir.path().join("big.tar");
        fs::write(&layer, tar_of(&[("big", &big)])).unwrap();
        let mut budget = Budget::for_disk(2);
        let err = apply_layer(&root, &layer, "layer 1", &mut budget)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("more than 1 MiB") && err.contains("size_mb"),
            "{err}"
        );
    }

    #[test]
    fn oci_layout_and_docker_save_give_layers_and_config() {
        let dir = tempfile::tempdir().unwrap();
        let oci = dir.path().join("oci");
        fs::create_dir_all(oci.join("blobs/sha256")).unwrap();
        let put = |text: &str, name: &str| {
            fs::write(oci.join("blobs/sha256").join(name), text).unwrap();
        };
        let hex = |c: char| std::iter::repeat_n(c, 64).collect::<String>();
        put(
            r#"{"config":{"Env":["A=1","PATH=/bin"],"WorkingDir":"/w","User":"nobody"}}"#,
            &hex('c'),
        );
        put("layer", &hex('1'));
        put(
            &format!(
                r#"{{"config":{{"digest":"sha256:{}"}},"layers":[{{"digest":"sha256:{}"}}]}}"#,
                hex('c'),
                hex('1')
            ),
            &hex('f'),
        );
        fs::write(
            oci.join("index.json"),
            format!(r#"{{"manifests":[{{"digest":"sha256:{}","platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#, hex('f')),
        )
        .unwrap();
        let (layers, config) = image_layers(&oci).unwrap();
        assert_eq!(layers.len(), 1);
        assert!(layers[0].ends_with(hex('1')));
        assert_eq!(config.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(config.cwd.as_deref(), Some("/w"));
        assert_eq!(config.user.as_deref(), Some("nobody"));
        // A digest that is not a plain sha256 cannot name a path.
        fs::write(
            oci.join("index.json"),
            r#"{"manifests":[{"digest":"sha256:../../etc/passwd"}]}"#,
        )
        .unwrap();
        assert!(image_layers(&oci)
            .unwrap_err()
            .to_string()
            .contains("unsupported digest"));

        let saved = dir.path().join("saved");
        fs::create_dir_all(saved.join("abc")).unwrap();
        fs::write(saved.join("abc/layer.tar"), "x").unwrap();
        fs::write(saved.join("cfg.json"), r#"{"config":{"Env":["B=2"]}}"#).unwrap();
        fs::write(
            saved.join("manifest.json"),
            r#"[{"Config":"cfg.json","Layers":["abc/layer.tar"]}]"#,
        )
        .unwrap();
        let (layers, config) = image_layers(&saved).unwrap();
        assert!(layers[0].ends_with("abc/layer.tar"));
        assert_eq!(config.env.get("B").map(String::as_str), Some("2"));
        fs::write(
            saved.join("manifest.json"),
            r#"[{"Layers":["../../../etc/passwd"]}]"#,
        )
        .unwrap();
        assert!(image_layers(&saved).is_err());
    }
}
