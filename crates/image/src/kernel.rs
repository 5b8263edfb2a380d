//! The kernel layer: Debian's cloud kernel, downloaded with apt and cut down
//! to what a Shoal guest boots from.
//!
//! Owns: resolving `linux-image-cloud-amd64` to the real package, fetching
//! and unpacking it, and keeping `vmlinuz` plus the (decompressed) virtio
//! modules the initramfs loads, with their load order. Cached under
//! `images/kernel/<package>_<version>/`. Does not build the initramfs.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::MultiProgress;
use serde::{Deserialize, Serialize};

use crate::cache::{self, KeyBuilder};
use crate::cmd;
use crate::error::{ImageError, IoContext};
use crate::host::{self, apt_command};
use crate::modules::{self, canonical_name, ModulesDep};
use crate::progress::{Step, StepReport};

/// The Debian meta-package whose dependency is the current cloud kernel.
pub const KERNEL_META_PACKAGE: &str = "linux-image-cloud-amd64";

/// Modules the guest needs, by name, in the order they should load. Names
/// that are built into the kernel (rng_core is, in Debian's cloud kernel)
/// are skipped; dependencies are added from modules.dep.
pub const GUEST_MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "rng_core",
    "virtio_rng",
    "failover",
    "net_failover",
    "virtio_net",
];

/// Bump when what this layer contains changes for the same package.
const KERNEL_LAYER_VERSION: &str = "1";
const LAYER: &str = "kernel";

/// A resolved kernel package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelPackage {
    pub name: String,
    pub version: String,
}

/// What `artifacts.json` of a kernel layer records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KernelInfo {
    pub package: KernelPackage,
    /// `uname -r` of the guest, e.g. `6.1.0-57-cloud-amd64`.
    pub kernel_version: String,
    /// Module file names under `modules/`, in load order.
    pub modules: Vec<String>,
}

/// A finished kernel layer.
#[derive(Debug, Clone)]
pub struct KernelLayer {
    pub dir: PathBuf,
    pub key: String,
    pub info: KernelInfo,
}

impl KernelLayer {
    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }
    pub fn modules_dir(&self) -> PathBuf {
        self.dir.join("modules")
    }
}

/// The cache key of a kernel layer.
pub fn kernel_key(pkg: &KernelPackage) -> String {
    KeyBuilder::new(LAYER)
        .field("layer-version", KERNEL_LAYER_VERSION)
        .field("package", &pkg.name)
        .field("package-version", &pkg.version)
        .field("modules", GUEST_MODULES.join(","))
        .finish()
}

/// Picks the `linux-image-*` dependency out of `apt-cache depends` output.
pub(crate) fn parse_depends(output: &str) -> Option<String> {
    output.lines().find_map(|l| {
        let l = l.trim().trim_start_matches('|');
        let dep = l.strip_prefix("Depends:")?.trim();
        (dep.starts_with("linux-image-") && !dep.starts_with('<')).then(|| dep.to_string())
    })
}

/// Picks `Version:` out of `apt-cache show` output.
pub(crate) fn parse_version(output: &str) -> Option<String> {
    output
        .lines()
        .find_map(|l| l.strip_prefix("Version:").map(|v| v.trim().to_string()))
}

fn lookup_kernel_package() -> Result<KernelPackage, ImageError> {
    let depends = cmd::run(apt_command("apt-cache").args(["depends", KERNEL_META_PACKAGE]))?;
    let name = parse_depends(&depends).ok_or_else(|| {
        ImageError::Kernel(format!(
            "`apt-cache depends {KERNEL_META_PACKAGE}` names no linux-image package"
        ))
    })?;
    let show = cmd::run(apt_command("apt-cache").args(["show", "--no-all-versions", &name]))?;
    let version = parse_version(&show)
        .ok_or_else(|| ImageError::Kernel(format!("`apt-cache show {name}` gives no Version")))?;
    Ok(KernelPackage { name, version })
}

/// The real kernel package behind `linux-image-cloud-amd64` and its
/// candidate version. Runs `apt-get update` only if the lookup fails (a
/// fresh host with empty package lists).
pub fn resolve_kernel_package() -> Result<KernelPackage, ImageError> {
    host::ensure_tools(host::APT_TOOLS, false)?;
    match lookup_kernel_package() {
        Ok(p) => Ok(p),
        Err(first) => {
            tracing::warn!(error = %first, "kernel lookup failed; running apt-get update");
            cmd::run(apt_command("apt-get").arg("update"))?;
            lookup_kernel_package()
        }
    }
}

/// What apt's answer depends on: name, size and mtime of every package
/// list and apt source/preference file. Equal fingerprints mean
/// `apt-cache` would resolve the kernel the same way.
fn apt_fingerprint() -> String {
    let mut files = Vec::new();
    for dir in [
        "/var/lib/apt/lists",
        "/etc/apt/sources.list.d",
        "/etc/apt/preferences.d",
    ] {
        if let Ok(entries) = fs::read_dir(dir) {
            files.extend(entries.flatten().map(|e| e.path()));
        }
    }
    files.extend(["/etc/apt/sources.list", "/etc/apt/preferences"].map(PathBuf::from));
    files.sort();
    let mut key = KeyBuilder::new("apt-lists");
    for f in files {
        if let Ok(m) = fs::metadata(&f) {
            if m.is_file() {
                use std::os::unix::fs::MetadataExt;
                let stamp = format!("{} {} {}", m.len(), m.mtime(), m.mtime_nsec());
                key = key.field(&f.to_string_lossy(), stamp);
            }
        }
    }
    key.finish()
}

#[derive(Serialize, Deserialize)]
struct Resolved {
    apt_fingerprint: String,
    package: KernelPackage,
}

/// [`resolve_kernel_package`], remembered under `images/kernel/resolved.json`
/// until apt's package lists or sources change. Each `apt-cache` call takes
/// about a second on hosts whose apt keeps no binary cache (Docker-derived
/// images disable it), which would make a no-op build slow.
pub fn resolve_kernel_package_cached(images_dir: &Path) -> Result<KernelPackage, ImageError> {
    let memo = images_dir.join(LAYER).join("resolved.json");
    let fingerprint = apt_fingerprint();
    if let Some(r) = fs::read_to_string(&memo)
        .ok()
        .and_then(|t| serde_json::from_str::<Resolved>(&t).ok())
    {
        if r.apt_fingerprint == fingerprint {
            return Ok(r.package);
        }
    }
    let package = resolve_kernel_package()?;
    // Re-read: resolving may have run apt-get update.
    let resolved = Resolved {
        apt_fingerprint: apt_fingerprint(),
        package: package.clone(),
    };
    fs::create_dir_all(images_dir.join(LAYER)).ctx(|| "creating the kernel cache dir".into())?;
    cache::write_json_atomic(&memo, &resolved)?;
    Ok(package)
}

/// Returns the cached kernel layer for `pkg`, building it if needed.
pub fn build_kernel(
    images_dir: &Path,
    pkg: &KernelPackage,
    progress: &MultiProgress,
) -> Result<(KernelLayer, StepReport), ImageError> {
    let key = kernel_key(pkg);
    let dir = images_dir
        .join(LAYER)
        .join(format!("{}_{}", pkg.name, pkg.version));
    let step = Step::start(progress, "kernel", format!("{} {}", pkg.name, pkg.version));
    let detail =
        |info: &KernelInfo| format!("{} ({} modules)", info.kernel_version, info.modules.len());
    if let Some(rec) = cache::read_record::<KernelInfo>(&dir, LAYER, &key) {
        let report = step.finish(true, detail(&rec.info));
        return Ok((
            KernelLayer {
                dir,
                key,
                info: rec.info,
            },
            report,
        ));
    }
    let rec = cache::build_layer(&dir, LAYER, &key, |tmp| fill_kernel_layer(tmp, pkg, &step))?;
    let report = step.finish(false, detail(&rec.info));
    Ok((
        KernelLayer {
            dir,
            key,
            info: rec.info,
        },
        report,
    ))
}

fn fill_kernel_layer(
    tmp: &Path,
    pkg: &KernelPackage,
    step: &Step,
) -> Result<KernelInfo, ImageError> {
    use std::os::unix::fs::PermissionsExt;

    // apt drops privileges to `_apt` for downloads; a world-writable
    // directory avoids its "unsandboxed as root" warning (harmless anyway).
    let download = tmp.join("download");
    fs::create_dir(&download).ctx(|| format!("creating {}", download.display()))?;
    fs::set_permissions(&download, fs::Permissions::from_mode(0o777))
        .ctx(|| format!("chmod {}", download.display()))?;
    step.message(format!("apt-get download {}={}", pkg.name, pkg.version));
    cmd::run(
        apt_command("apt-get")
            .current_dir(&download)
            .args(["download", &format!("{}={}", pkg.name, pkg.version)]),
    )?;
    let deb = fs::read_dir(&download)
        .ctx(|| format!("listing {}", download.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .ok_or_else(|| {
            ImageError::Kernel(format!("apt-get download of {} left no .deb", pkg.name))
        })?;

    step.message("dpkg-deb -x");
    let extract = tmp.join("extract");
    cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&extract))?;

    let kernel_version = pkg
        .name
        .strip_prefix("linux-image-")
        .ok_or_else(|| ImageError::Kernel(format!("{} is not a linux-image package", pkg.name)))?
        .to_string();
    let vmlinuz = extract
        .join("boot")
        .join(format!("vmlinuz-{kernel_version}"));
    fs::copy(&vmlinuz, tmp.join("vmlinuz")).ctx(|| format!("copying {}", vmlinuz.display()))?;
    let config = extract
        .join("boot")
        .join(format!("config-{kernel_version}"));
    if config.exists() {
        fs::copy(&config, tmp.join("config")).ctx(|| format!("copying {}", config.display()))?;
    }

    let moddir = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| extract.join(d).join(&kernel_version))
        .find(|d| d.is_dir())
        .ok_or_else(|| ImageError::Kernel(format!("{} ships no modules directory", pkg.name)))?;

    step.message("resolving module dependencies");
    let builtin = builtin_modules(&moddir)?;
    let dep = modules_dep(&moddir)?;
    let order = dep.load_order(GUEST_MODULES, &builtin)?;

    let out = tmp.join("modules");
    fs::create_dir(&out).ctx(|| format!("creating {}", out.display()))?;
    let mut names = Vec::new();
    for rel in &order {
        let file = format!("{}.ko", canonical_name(rel));
        let bytes = read_module(&moddir.join(rel))?;
        fs::write(out.join(&file), bytes).ctx(|| format!("writing module {file}"))?;
        names.push(file);
    }
    fs::write(tmp.join("modules.dep"), dep.to_text()).ctx(|| "writing modules.dep".into())?;

    step.message("removing the unpacked package");
    cache::remove_path(&download)?;
    cache::remove_path(&extract)?;
    Ok(KernelInfo {
        package: pkg.clone(),
        kernel_version,
        modules: names,
    })
}

/// Canonical names listed in `modules.builtin` (empty if absent).
fn builtin_modules(moddir: &Path) -> Result<HashSet<String>, ImageError> {
    match fs::read_to_string(moddir.join("modules.builtin")) {
        Ok(t) => Ok(t
            .lines()
            .filter(|l| !l.is_empty())
            .map(canonical_name)
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashSet::new()),
        Err(e) => Err(ImageError::io("reading modules.builtin", e)),
    }
}

/// The package's `modules.dep` if it ships one; otherwise one generated
/// from the `depends=` of each module reachable from [`GUEST_MODULES`]
/// (what depmod would compute, restricted to what we need).
fn modules_dep(moddir: &Path) -> Result<ModulesDep, ImageError> {
    if let Ok(text) = fs::read_to_string(moddir.join("modules.dep")) {
        return ModulesDep::parse(&text);
    }
    let mut by_name = BTreeMap::new();
    index_modules(moddir, moddir, &mut by_name)?;
    let mut dep = ModulesDep::default();
    let mut queue: VecDeque<String> = GUEST_MODULES.iter().map(|s| s.to_string()).collect();
    let mut seen = HashSet::new();
    while let Some(name) = queue.pop_front() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let Some(rel) = by_name.get(&name) else {
            continue; // built in, or missing: load_order decides which.
        };
        let depends = modules::declared_depends(&read_module(&moddir.join(rel))?)
            .map_err(|e| ImageError::Module(format!("{rel}: {e}")))?;
        let mut paths = Vec::new();
        for d in depends {
            let path = by_name.get(&d).ok_or_else(|| {
                ImageError::Module(format!("{rel} depends on {d}, which the package lacks"))
            })?;
            paths.push(path.clone());
            queue.push_back(d);
        }
        dep.insert(rel.clone(), paths);
    }
    Ok(dep)
}

/// Maps canonical module name to path relative to `moddir`.
fn index_modules(
    moddir: &Path,
    dir: &Path,
    out: &mut BTreeMap<String, String>,
) -> Result<(), ImageError> {
    for entry in fs::read_dir(dir).ctx(|| format!("listing {}", dir.display()))? {
        let path = entry.ctx(|| format!("listing {}", dir.display()))?.path();
        if path.is_dir() {
            index_modules(moddir, &path, out)?;
        } else if path.to_string_lossy().contains(".ko") {
            let rel = path
                .strip_prefix(moddir)
                .expect("walked from moddir")
                .to_string_lossy()
                .into_owned();
            out.insert(canonical_name(&rel), rel);
        }
    }
    Ok(())
}

/// A module's bytes, decompressed if the kernel was built with compressed
/// modules (insmod from busybox cannot load compressed ones).
fn read_module(path: &Path) -> Result<Vec<u8>, ImageError> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        Some("xz")
    } else if name.ends_with(".ko.zst") {
        Some("zstd")
    } else if name.ends_with(".ko.gz") {
        Some("gzip")
    } else {
        None
    };
    match tool {
        None => fs::read(path).ctx(|| format!("reading {}", path.display())),
        Some(tool) => cmd::run_bytes(Command::new(tool).arg("-dc").arg(path)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_output_is_parsed() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(
            parse_depends(out).unwrap(),
            "linux-image-6.1.0-57-cloud-amd64"
        );
        assert!(parse_depends("x\n  Depends: <linux-image-virtual>\n").is_none());
        assert!(parse_depends("linux-image-cloud-amd64\n").is_none());
    }

    #[test]
    fn version_is_parsed() {
        let out = "Package: linux-image-6.1.0-57-cloud-amd64\nSource: linux-signed-amd64 (6.1.192+3)\nVersion: 6.1.192-3\n";
        assert_eq!(parse_version(out).unwrap(), "6.1.192-3");
    }

    #[test]
    fn kernel_key_depends_on_name_and_version() {
        let p = |n: &str, v: &str| KernelPackage {
            name: n.into(),
            version: v.into(),
        };
        assert_eq!(kernel_key(&p("a", "1")), kernel_key(&p("a", "1")));
        assert_ne!(kernel_key(&p("a", "1")), kernel_key(&p("a", "2")));
        assert_ne!(kernel_key(&p("a", "1")), kernel_key(&p("b", "1")));
    }
}
