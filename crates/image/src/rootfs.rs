//! The root filesystem layers: a debootstrapped Debian tree (the "base"
//! layer, slow, shared by every template with the same package list) and
//! the finished ext4 image of one template (base + guest agent + identity
//! files, fast to redo when only the agent changes).
//!
//! Owns: running debootstrap (minbase) against the host's Debian mirror,
//! installing the template's packages with apt inside the tree (apt's
//! resolver, unlike debootstrap's `--include`, honours alternatives that
//! are already satisfied, and it also applies bookworm-security updates),
//! slimming the tree, staging the template's files, and `mkfs.ext4 -d` (no loop
//! mounts, so no privileges beyond file ownership are needed for the
//! image step). The image is a sparse raw file that the engine uses
//! read-only as the backing file of per-sandbox copy-on-write overlays;
//! this module never boots it.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::MultiProgress;
use serde::{Deserialize, Serialize};

use crate::cache::{self, KeyBuilder};
use crate::cmd;
use crate::error::{ImageError, IoContext};
use crate::host;
use crate::progress::{Step, StepReport};
use crate::templates::TemplateSpec;

/// The Debian release the first-party templates run.
pub const SUITE: &str = "bookworm";
/// Where the guest agent lives in the guest (what /init execs).
pub const AGENT_PATH_IN_GUEST: &str = "usr/local/sbin/shoal-guest-agent";
/// ext4 label of every root filesystem.
pub const ROOTFS_LABEL: &str = "shoalroot";
/// File name of the image inside its layer directory.
pub const ROOTFS_FILE: &str = "rootfs.ext4";

/// Bump when the debootstrap invocation or the slimming changes.
const BASE_LAYER_VERSION: &str = "2";
/// Bump when the staged files or mkfs options change.
const IMAGE_LAYER_VERSION: &str = "1";
const BASE: &str = "base";
const IMAGE: &str = "rootfs";

/// What `artifacts.json` of a base layer records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BaseInfo {
    pub suite: String,
    pub mirror: String,
    /// Sorted, de-duplicated `--include` list.
    pub packages: Vec<String>,
    /// Number of Debian packages installed in the tree (list in
    /// `packages.txt` next to `root/`).
    pub installed_packages: usize,
    /// Bytes of file content in the tree after slimming.
    pub tree_bytes: u64,
    pub debootstrap_seconds: f64,
    pub apt_seconds: f64,
}

/// A finished base layer: `root/` is the debootstrapped tree.
#[derive(Debug, Clone)]
pub struct BaseLayer {
    pub root: PathBuf,
    pub key: String,
    pub info: BaseInfo,
}

/// What `artifacts.json` of a rootfs image layer records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageInfo {
    pub template: String,
    pub base_key: String,
    pub agent_sha256: String,
    pub disk_mib: u32,
    /// Bytes the sparse image really occupies on the host.
    pub allocated_bytes: u64,
}

/// A finished rootfs image layer.
#[derive(Debug, Clone)]
pub struct ImageLayer {
    pub path: PathBuf,
    pub key: String,
    pub info: ImageInfo,
}

/// Sorted, de-duplicated package list: the order a template lists its
/// packages in must not change any key.
pub fn normalized_packages(packages: &[String]) -> Vec<String> {
    let mut p: Vec<String> = packages
        .iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    p.sort();
    p.dedup();
    p
}

/// Cache key of the debootstrapped tree: suite, packages, builder version.
/// Deliberately not the mirror (any mirror serves the same archive) and
/// not the guest agent (changing it must not re-run debootstrap).
pub fn base_key(suite: &str, packages: &[String]) -> String {
    KeyBuilder::new(BASE)
        .field("layer-version", BASE_LAYER_VERSION)
        .field("suite", suite)
        .field("variant", "minbase")
        .field("packages", normalized_packages(packages).join(","))
        .finish()
}

/// Cache key of a template's image: its base, the agent binary, and what
/// else is written into it (hostname = template name, disk size).
pub fn image_key(base_key: &str, agent_sha256: &str, spec: &TemplateSpec) -> String {
    KeyBuilder::new(IMAGE)
        .field("layer-version", IMAGE_LAYER_VERSION)
        .field("base", base_key)
        .field("agent", agent_sha256)
        .field("name", &spec.name)
        .field("disk-mib", spec.disk_mib.to_string())
        .finish()
}

/// Returns the cached debootstrapped tree of Debian `suite` with
/// `packages`, building it if needed.
pub fn build_base(
    images_dir: &Path,
    suite: &str,
    packages: &[String],
    progress: &MultiProgress,
) -> Result<(BaseLayer, StepReport), ImageError> {
    let packages = normalized_packages(packages);
    let key = base_key(suite, &packages);
    let dir = images_dir.join(BASE).join(&key[..16]);
    let root = dir.join("root");
    let step = Step::start(
        progress,
        "debootstrap",
        format!("{suite} minbase + {} packages", packages.len()),
    );
    let detail = |i: &BaseInfo| {
        format!(
            "{suite} + {} packages, {} MiB",
            i.packages.len(),
            i.tree_bytes >> 20
        )
    };
    if let Some(rec) = cache::read_record::<BaseInfo>(&dir, BASE, &key) {
        let report = step.finish(true, detail(&rec.info));
        return Ok((
            BaseLayer {
                root,
                key,
                info: rec.info,
            },
            report,
        ));
    }
    host::ensure_tools(host::ROOTFS_TOOLS, false)?;
    let mirror = host::debian_mirror(suite);
    let rec = cache::build_layer(&dir, BASE, &key, |tmp| {
        let root = tmp.join("root");
        let started = std::time::Instant::now();
        debootstrap(&root, suite, &mirror, &step)?;
        let debootstrap_seconds = started.elapsed().as_secs_f64();
        write_apt_sources(&root, suite, &mirror)?;
        let started = std::time::Instant::now();
        apt_install(&root, &packages, &step)?;
        let apt_seconds = started.elapsed().as_secs_f64();
        let installed = cmd::run(&mut chroot_cmd(
            &root,
            &["dpkg-query", "-W", "-f", "${Package} ${Version}\n"],
        ))?;
        fs::write(tmp.join("packages.txt"), &installed).ctx(|| "writing packages.txt".into())?;
        step.message("slimming the tree");
        slim(&root)?;
        Ok(BaseInfo {
            suite: suite.to_string(),
            mirror: mirror.clone(),
            packages: packages.clone(),
            installed_packages: installed.lines().count(),
            tree_bytes: tree_bytes(&root)?,
            debootstrap_seconds,
            apt_seconds,
        })
    })?;
    let report = step.finish(false, detail(&rec.info));
    Ok((
        BaseLayer {
            root,
            key,
            info: rec.info,
        },
        report,
    ))
}

fn debootstrap(root: &Path, suite: &str, mirror: &str, step: &Step) -> Result<(), ImageError> {
    let mut c = Command::new("debootstrap");
    c.env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive");
    c.args(["--variant=minbase", "--components=main"]);
    c.arg(suite).arg(root).arg(mirror);
    let log = root.join("debootstrap/debootstrap.log");
    cmd::run_streaming(
        &mut c,
        |line| {
            // "I: Retrieving libc6 2.36-9+deb12u10" and the like.
            if let Some(msg) = line.strip_prefix("I: ") {
                step.message(format!("debootstrap: {msg}"));
            }
        },
        || fs::read_to_string(&log).ok(),
    )
}

/// A command run inside the tree with a clean, non-interactive environment.
fn chroot_cmd(root: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("chroot");
    c.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .arg(root)
        .args(args);
    c
}

/// `apt-get update`, `upgrade` (security fixes) and `install
/// --no-install-recommends <packages>` inside the tree, then `clean`.
/// Needs no mounts: nothing these packages run at install time reads
/// /proc or /sys, and no mounts means nothing to leak if interrupted.
fn apt_install(root: &Path, packages: &[String], step: &Step) -> Result<(), ImageError> {
    // Name resolution for apt inside the tree; replaced by the image layer.
    let resolv = fs::read("/etc/resolv.conf").ctx(|| "reading /etc/resolv.conf".into())?;
    let guest_resolv = root.join("etc/resolv.conf");
    cache::remove_path(&guest_resolv)?;
    fs::write(&guest_resolv, resolv).ctx(|| format!("writing {}", guest_resolv.display()))?;
    // Keep maintainer scripts from starting daemons in the build tree.
    let policy = root.join("usr/sbin/policy-rc.d");
    fs::write(&policy, "#!/bin/sh\nexit 101\n").ctx(|| format!("writing {}", policy.display()))?;
    fs::set_permissions(&policy, fs::Permissions::from_mode(0o755))
        .ctx(|| format!("chmod {}", policy.display()))?;

    let show = |line: &str| {
        let l = line.trim();
        if ["Get:", "Unpacking ", "Setting up ", "Hit:", "Reading "]
            .iter()
            .any(|p| l.starts_with(p))
        {
            step.message(format!("apt: {l}"));
        }
    };
    step.message("apt-get update");
    cmd::run_streaming(&mut chroot_cmd(root, &["apt-get", "update"]), show, || None)?;
    cmd::run_streaming(
        &mut chroot_cmd(root, &["apt-get", "-y", "upgrade"]),
        show,
        || None,
    )?;
    if !packages.is_empty() {
        let mut args = vec!["apt-get", "install", "-y", "--no-install-recommends"];
        args.extend(packages.iter().map(String::as_str));
        cmd::run_streaming(&mut chroot_cmd(root, &args), show, || None)?;
    }
    cmd::run(&mut chroot_cmd(root, &["apt-get", "clean"]))?;
    cache::remove_path(&policy)
}

/// Points the guest's apt at the same mirror, plus updates and security,
/// so `apt-get install` inside a sandbox sees current packages.
fn write_apt_sources(root: &Path, suite: &str, mirror: &str) -> Result<(), ImageError> {
    let security = {
        let s = host::debian_mirror(&format!("{suite}-security"));
        if s.ends_with("-security") {
            s
        } else {
            "http://deb.debian.org/debian-security".to_string()
        }
    };
    let text = format!(
        "deb {mirror} {suite} main\ndeb {mirror} {suite}-updates main\ndeb {security} {suite}-security main\n"
    );
    let path = root.join("etc/apt/sources.list");
    fs::write(&path, text).ctx(|| format!("writing {}", path.display()))
}

/// Removes what a sandbox never needs (apt's caches and lists, docs but
/// their copyright files, man pages, translations, logs) and tells dpkg to
/// keep it that way for packages installed later inside a sandbox. Image
/// size matters: it is read through every sandbox's overlay.
fn slim(root: &Path) -> Result<(), ImageError> {
    let clear_dir = |rel: &str, keep: &dyn Fn(&Path) -> bool| -> Result<(), ImageError> {
        let dir = root.join(rel);
        let Ok(entries) = fs::read_dir(&dir) else {
            return Ok(());
        };
        for e in entries.flatten() {
            let p = e.path();
            if !keep(&p) {
                cache::remove_path(&p)?;
            }
        }
        Ok(())
    };
    let nothing = |_: &Path| false;
    clear_dir("var/cache/apt/archives", &|p| {
        p.ends_with("partial") || p.ends_with("lock")
    })?;
    clear_dir("var/cache/apt", &|p| p.is_dir())?;
    clear_dir("var/lib/apt/lists", &|p| {
        p.ends_with("partial") || p.ends_with("lock")
    })?;
    clear_dir("usr/share/man", &nothing)?;
    clear_dir("usr/share/info", &nothing)?;
    clear_dir("usr/share/locale", &|p| p.ends_with("locale.alias"))?;
    clear_dir("var/log", &|p| p.is_dir())?;
    // Keep /usr/share/doc/<pkg>/copyright: the licences travel with the image.
    let doc = root.join("usr/share/doc");
    if let Ok(pkgs) = fs::read_dir(&doc) {
        for pkg in pkgs.flatten() {
            let p = pkg.path();
            if p.is_dir() && !p.is_symlink() {
                clear_dir(
                    &format!("usr/share/doc/{}", pkg.file_name().to_string_lossy()),
                    &|f| f.ends_with("copyright"),
                )?;
            }
        }
    }
    let dpkg_cfg = root.join("etc/dpkg/dpkg.cfg.d/01-shoal-slim");
    fs::write(
        &dpkg_cfg,
        "# Written by the Shoal image builder: keep sandbox images small.\n\
         path-exclude=/usr/share/man/*\n\
         path-exclude=/usr/share/info/*\n\
         path-exclude=/usr/share/locale/*\n\
         path-include=/usr/share/locale/locale.alias\n\
         path-exclude=/usr/share/doc/*\n\
         path-include=/usr/share/doc/*/copyright\n",
    )
    .ctx(|| format!("writing {}", dpkg_cfg.display()))
}

/// Sum of regular file sizes under `root` (hard links counted once).
fn tree_bytes(root: &Path) -> Result<u64, ImageError> {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir)
            .ctx(|| format!("listing {}", dir.display()))?
            .flatten()
        {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() && seen.insert((m.dev(), m.ino())) {
                total += m.len();
            }
        }
    }
    Ok(total)
}

/// Returns the cached image of `spec`, building it if needed: a copy of
/// the base tree plus the agent and identity files, made into ext4.
pub fn build_rootfs_image(
    images_dir: &Path,
    spec: &TemplateSpec,
    base: &BaseLayer,
    agent: &Path,
    agent_sha256: &str,
    progress: &MultiProgress,
) -> Result<(ImageLayer, StepReport), ImageError> {
    let key = image_key(&base.key, agent_sha256, spec);
    let dir = images_dir
        .join(IMAGE)
        .join(format!("{}-{}", spec.name, &key[..16]));
    let path = dir.join(ROOTFS_FILE);
    let step = Step::start(
        progress,
        "rootfs image",
        format!("{} ({} MiB)", spec.name, spec.disk_mib),
    );
    let detail = |i: &ImageInfo| {
        format!(
            "{} MiB sparse, {} MiB allocated",
            i.disk_mib,
            i.allocated_bytes >> 20
        )
    };
    if let Some(rec) = cache::read_record::<ImageInfo>(&dir, IMAGE, &key) {
        let report = step.finish(true, detail(&rec.info));
        return Ok((
            ImageLayer {
                path,
                key,
                info: rec.info,
            },
            report,
        ));
    }
    host::ensure_tools(host::ROOTFS_TOOLS, false)?;
    let needed_mib = (base.info.tree_bytes >> 20) * 5 / 4 + 64;
    if u64::from(spec.disk_mib) < needed_mib {
        return Err(ImageError::InvalidTemplate(format!(
            "{}: disk_mib {} is too small for a {} MiB tree (need about {needed_mib})",
            spec.name,
            spec.disk_mib,
            base.info.tree_bytes >> 20
        )));
    }
    let rec = cache::build_layer(&dir, IMAGE, &key, |tmp| {
        let stage = tmp.join("stage");
        step.message("copying the base tree");
        // --reflink=auto makes this nearly free on XFS/btrfs; -a keeps
        // owners, modes, hard links and device nodes.
        cmd::run(
            Command::new("cp")
                .args(["-a", "--reflink=auto"])
                .arg(&base.root)
                .arg(&stage),
        )?;
        step.message("installing the guest agent");
        install_agent(&stage, agent)?;
        write_identity(&stage, &spec.name)?;
        step.message("mkfs.ext4 -d");
        let image = tmp.join(ROOTFS_FILE);
        make_ext4_image(&stage, &image, spec.disk_mib)?;
        step.message("removing the staging tree");
        cache::remove_path(&stage)?;
        Ok(ImageInfo {
            template: spec.name.clone(),
            base_key: base.key.clone(),
            agent_sha256: agent_sha256.to_string(),
            disk_mib: spec.disk_mib,
            allocated_bytes: allocated_bytes(&image)?,
        })
    })?;
    let report = step.finish(false, detail(&rec.info));
    Ok((
        ImageLayer {
            path,
            key,
            info: rec.info,
        },
        report,
    ))
}

/// Copies the agent to its place in the guest, mode 0755.
pub fn install_agent(root: &Path, agent: &Path) -> Result<(), ImageError> {
    let dest = root.join(AGENT_PATH_IN_GUEST);
    let parent = dest.parent().expect("agent path has a parent");
    fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
    fs::copy(agent, &dest).ctx(|| format!("copying {} to {}", agent.display(), dest.display()))?;
    fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))
        .ctx(|| format!("chmod {}", dest.display()))
}

/// Hostname, hosts, a resolv.conf placeholder and an empty machine-id.
/// The engine gives each clone its own identity after restore; these are
/// only the template's defaults.
fn write_identity(root: &Path, hostname: &str) -> Result<(), ImageError> {
    let files = [
        ("etc/hostname", format!("{hostname}\n")),
        (
            "etc/hosts",
            format!(
                "127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
            ),
        ),
        (
            "etc/resolv.conf",
            "# Placeholder: the Shoal guest agent writes the sandbox's resolver here.\n".to_string(),
        ),
        // Empty, not absent: tools then know to generate one per boot.
        ("etc/machine-id", String::new()),
    ];
    for (rel, text) in files {
        let path = root.join(rel);
        // resolv.conf may be a symlink in some package sets; replace it.
        cache::remove_path(&path)?;
        fs::write(&path, text).ctx(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Makes a sparse raw ext4 image of `disk_mib` MiB at `image` holding the
/// tree `src_dir` (owners, modes, links and device nodes preserved), labelled
/// [`ROOTFS_LABEL`]. Replaces `image` if it exists. The lower-level entry
/// point: tests use it to build tiny bootable images without debootstrap.
pub fn make_ext4_image(src_dir: &Path, image: &Path, disk_mib: u32) -> Result<(), ImageError> {
    cache::remove_path(image)?;
    // Create the file sparse ourselves rather than rely on mke2fs doing it.
    let f = fs::File::create(image).ctx(|| format!("creating {}", image.display()))?;
    f.set_len(u64::from(disk_mib) << 20)
        .ctx(|| format!("sizing {}", image.display()))?;
    drop(f);
    cmd::run(
        Command::new("mkfs.ext4")
            .env("LC_ALL", "C")
            .args(["-q", "-F", "-L", ROOTFS_LABEL])
            // No reserved blocks: nothing in a sandbox runs as "other users".
            .args(["-m", "0"])
            // Zero inode tables and journal now (cheap: the file is sparse)
            // so the guest kernel's lazy-init thread never writes them
            // through every sandbox's copy-on-write overlay.
            .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
            .arg("-d")
            .arg(src_dir)
            .arg(image)
            .arg(format!("{disk_mib}M")),
    )?;
    Ok(())
}

/// Bytes a (sparse) file occupies on disk.
pub fn allocated_bytes(path: &Path) -> Result<u64, ImageError> {
    Ok(fs::metadata(path)
        .ctx(|| format!("stat {}", path.display()))?
        .blocks()
        * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, packages: &[&str], disk: u32) -> TemplateSpec {
        TemplateSpec {
            name: name.into(),
            memory_mib: 512,
            vcpus: 1,
            packages: packages.iter().map(|s| s.to_string()).collect(),
            disk_mib: disk,
            suite: SUITE.into(),
        }
    }

    #[test]
    fn base_key_ignores_package_order_and_duplicates() {
        let a = base_key(SUITE, &spec("a", &["procps", "iproute2"], 1).packages);
        let b = base_key(
            SUITE,
            &spec("b", &["iproute2", "procps", "procps", " "], 1).packages,
        );
        assert_eq!(a, b);
        assert_ne!(a, base_key(SUITE, &spec("a", &["procps"], 1).packages));
        assert_ne!(
            a,
            base_key("trixie", &spec("a", &["procps", "iproute2"], 1).packages)
        );
    }

    #[test]
    fn image_key_tracks_agent_base_name_and_size() {
        let s = spec("t", &[], 1024);
        let k = image_key("base", "agent", &s);
        assert_eq!(k, image_key("base", "agent", &s));
        assert_ne!(k, image_key("base", "agent2", &s));
        assert_ne!(k, image_key("base2", "agent", &s));
        assert_ne!(k, image_key("base", "agent", &spec("u", &[], 1024)));
        assert_ne!(k, image_key("base", "agent", &spec("t", &[], 2048)));
        // Packages only reach the image key through the base key.
        assert_eq!(k, image_key("base", "agent", &spec("t", &["x"], 1024)));
    }

    #[test]
    fn ext4_image_from_dir_is_sparse_and_labelled() {
        if !Path::new("/usr/sbin/mkfs.ext4").exists() && !Path::new("/sbin/mkfs.ext4").exists() {
            eprintln!("skipping: no mkfs.ext4");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        fs::create_dir_all(src.join("etc")).unwrap();
        fs::write(src.join("etc/hostname"), "x\n").unwrap();
        let agent = t.path().join("agent");
        fs::write(&agent, "#!/bin/sh\n").unwrap();
        install_agent(&src, &agent).unwrap();
        let mode = fs::metadata(src.join(AGENT_PATH_IN_GUEST))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        let img = t.path().join("img");
        make_ext4_image(&src, &img, 64).unwrap();
        assert_eq!(fs::metadata(&img).unwrap().len(), 64 << 20);
        assert!(
            allocated_bytes(&img).unwrap() < 32 << 20,
            "image is not sparse"
        );
        let out = cmd::run(Command::new("dumpe2fs").arg("-h").arg(&img)).unwrap();
        assert!(out.contains(ROOTFS_LABEL), "{out}");
        let ls = cmd::run(
            Command::new("debugfs")
                .args(["-R", "stat /usr/local/sbin/shoal-guest-agent"])
                .arg(&img),
        )
        .unwrap();
        assert!(ls.contains("0755"), "{ls}");
    }
}
