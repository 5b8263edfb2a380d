//! Shoal guest images: builds, from Debian packages, what a template VM
//! boots from (a guest kernel, an initramfs and an ext4 root filesystem)
//! and caches them under `<state_dir>/images/`, rebuilding a layer only
//! when one of its inputs changes.
//!
//! This crate does not know about QEMU snapshots, sandboxes or HTTP:
//! booting the artifacts is the engine's job. It tells the engine the
//! kernel command line to use ([`kernel_cmdline`] under KVM,
//! [`tcg_kernel_cmdline`] under TCG).
//!
//! # Layers and cache layout
//!
//! ```text
//! <state_dir>/images/
//!   .lock                               flock held during a build
//!   file-hashes.json                    sha256 of the agent and busybox by (inode, size, mtime, ctime)
//!   kernel/resolved.json                which package apt resolved, for which package lists
//!   kernel/<package>_<version>/         vmlinuz, config, modules/*.ko, modules.dep, artifacts.json
//!   initramfs/<key16>/                  initramfs.cpio (newc, uncompressed), artifacts.json
//!   base/<key16>/root/                  debootstrap minbase + apt-get install (slow layer),
//!                                       packages.txt (installed versions), artifacts.json
//!   rootfs/<template>-<key16>/          rootfs.ext4 (sparse raw ext4), artifacts.json
//!   templates/<template>.json           the current [`Artifacts`] of a template
//! ```
//!
//! Every layer is built in a `.<name>.partial` sibling and renamed into
//! place only when complete (leftover partials are swept at the next build); its `artifacts.json` records the key it was
//! built from, so a layer is current exactly when its record's key equals
//! the key computed from today's inputs. Keys:
//! - kernel: package name + version (resolved from `linux-image-cloud-amd64`);
//! - initramfs: kernel key, busybox sha256, the `/init` script;
//! - base: suite, sorted package list, builder version (not the agent);
//! - rootfs: base key, agent sha256, template name, disk size.
//!
//! # Guest boot and virtio-mmio discovery
//!
//! The initramfs `/init` loads virtio, virtio_ring, virtio_mmio, virtio_blk,
//! virtio_console, virtio_rng, failover, net_failover and virtio_net (Debian's
//! cloud kernel builds them as modules; rng-core, ext4 and the 8250 console
//! are built in), waits for `/dev/vda`, mounts it read-write and
//! `switch_root`s into `/usr/local/sbin/shoal-guest-agent --init`; any
//! failure prints `shoal-init: FATAL: ...` on ttyS0 and powers off.
//!
//! QEMU's `-M microvm` can describe its virtio-mmio devices either in ACPI
//! (`acpi=on`, the default) or as `virtio_mmio.device=` kernel parameters
//! (`acpi=off`). Only ACPI works with this kernel: it is built without
//! `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`, so virtio_mmio has no `device`
//! parameter (insmod ignores it with a warning) and with `acpi=off` no
//! device is found; `/init` then reports it and, lacking ACPI poweroff,
//! reboots, which `-no-reboot` turns into a QEMU exit (tests/boot.rs checks
//! both). The engine must therefore use microvm with ACPI on (the default)
//! and pass `-no-reboot`. `/init` still forwards any `virtio_mmio.device=`
//! parameters to insmod, so a kernel built with that option would also
//! work with `acpi=off`.
//!
//! In the guest the agent's virtio-serial port is `/dev/vport<N>p1` (N
//! depends on device order; there is no udev, so no
//! `/dev/virtio-ports/<name>`): find it by the port's name in
//! `/sys/class/virtio-ports/vport*/name`.

mod cache;
mod cmd;
pub mod dockerfile;
mod error;
mod host;
pub mod import;
mod initramfs;
mod kernel;
mod modules;
mod progress;
mod rootfs;
mod templates;
mod tsc;

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use indicatif::MultiProgress;
use serde::{Deserialize, Serialize};

pub use cache::{sha256_file, RECORD_FILE};
pub use error::ImageError;
pub use host::debian_mirror;
pub use initramfs::{build_initramfs, init_script, CpioWriter, InitramfsInfo, InitramfsLayer};
pub use kernel::{
    build_kernel, resolve_kernel_package, resolve_kernel_package_cached, KernelInfo, KernelLayer,
    KernelPackage, GUEST_MODULES, KERNEL_META_PACKAGE,
};
pub use modules::ModulesDep;
pub use progress::StepReport;
pub use rootfs::{
    build_base, build_rootfs_image, install_agent, make_ext4_image, BaseInfo, BaseLayer, ImageInfo,
    ImageLayer, AGENT_PATH_IN_GUEST, ROOTFS_LABEL, SUITE,
};
pub use templates::{
    find_template, first_party_templates, release_template, valid_template_name, TemplateSpec,
    OTHER_DEBIAN_RELEASES,
};
pub use tsc::host_tsc_khz;

/// Version of the builder as a whole; part of every template's input hash.
/// Per-layer versions (in each module) decide which layers a change rebuilds.
pub const BUILDER_VERSION: &str = "shoal-image/1";

/// The default state directory of a Shoal host. Always passed in explicitly.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/shoal";

/// The kernel command line the engine must pass with these artifacts
/// under KVM. Under TCG use [`tcg_kernel_cmdline`] instead.
///
/// - `console=ttyS0`: microvm's only console is the ISA serial port.
/// - `reboot=t panic=-1`: on a panic, reboot at once; with QEMU
///   `-no-reboot` that becomes a QEMU exit instead of a hang.
/// - `random.trust_cpu=on`: seed the CRNG from RDRAND at boot so nothing
///   blocks waiting for entropy; clones are reseeded after restore anyway.
/// - `8250.nr_uarts=1`, `i8042.*`: skip probing hardware microvm lacks.
///   (The one remaining complaint, "PCI: Fatal: No config space access
///   function found", is harmless: microvm has no PCI bus.)
/// - `quiet`: serial output is slow under TCG; errors still print.
pub fn kernel_cmdline() -> &'static str {
    "console=ttyS0 reboot=t panic=-1 random.trust_cpu=on 8250.nr_uarts=1 \
     i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd quiet"
}

/// The kernel command line for a guest run under TCG on this host:
/// [`kernel_cmdline`] plus `tsc_early_khz=<host TSC kHz> tsc=reliable`.
///
/// Without it about half of all TCG boots hang: the guest's TSC runs at
/// the host's rate, but the kernel's calibration against microvm's PIT
/// fails when the host is busy, it then marks the TSC unstable and never
/// gets past early boot (measured on this machine, QEMU 7.2, kernel 6.1).
/// `tsc=reliable` keeps a descheduled QEMU from getting the TSC demoted
/// later. Falls back to [`kernel_cmdline`] where the rate is unknown.
pub fn tcg_kernel_cmdline() -> String {
    match host_tsc_khz() {
        Some(khz) => format!("{} tsc_early_khz={khz} tsc=reliable", kernel_cmdline()),
        None => kernel_cmdline().to_string(),
    }
}

/// What a template VM boots from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Artifacts {
    pub template: String,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// Raw ext4 image; use it read-only, as the base of copy-on-write overlays.
    pub rootfs: PathBuf,
    /// `uname -r` of the guest.
    pub kernel_version: String,
    /// sha256 hex over every input: builder version, kernel package and
    /// version, initramfs content, suite and sorted package list, agent
    /// binary, disk size. Equal hashes mean interchangeable artifacts; the
    /// engine can key its baked snapshots on it (plus memory and vCPUs).
    pub input_hash: String,
    /// What each step did this time (not persisted).
    #[serde(skip)]
    pub steps: Vec<StepReport>,
}

/// Equal when they name the same files built from the same inputs; the
/// step reports (how this particular call went) do not count.
impl PartialEq for Artifacts {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.template,
            &self.kernel,
            &self.initramfs,
            &self.rootfs,
            &self.kernel_version,
            &self.input_hash,
        ) == (
            &other.template,
            &other.kernel,
            &other.initramfs,
            &other.rootfs,
            &other.kernel_version,
            &other.input_hash,
        )
    }
}

/// How to build.
#[derive(Clone)]
pub struct BuildOptions<'a> {
    /// Root of Shoal's state; artifacts go to `<state_dir>/images/`.
    pub state_dir: &'a Path,
    /// The shoal-guest-agent binary to install in the root filesystem.
    pub guest_agent: &'a Path,
    /// Where the per-step spinners are drawn. A hidden one for silence.
    pub progress: MultiProgress,
}

impl<'a> BuildOptions<'a> {
    /// Options that draw no progress (tests, daemons).
    pub fn quiet(state_dir: &'a Path, guest_agent: &'a Path) -> Self {
        BuildOptions {
            state_dir,
            guest_agent,
            progress: MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden()),
        }
    }
}

/// `<state_dir>/images`.
pub fn images_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("images")
}

/// The template's input hash (see [`Artifacts::input_hash`]).
pub fn input_hash(
    kernel: &KernelPackage,
    initramfs_sha256: &str,
    spec: &TemplateSpec,
    agent_sha256: &str,
) -> String {
    cache::KeyBuilder::new("template")
        .field("builder", BUILDER_VERSION)
        .field("kernel-package", &kernel.name)
        .field("kernel-version", &kernel.version)
        .field("initramfs", initramfs_sha256)
        .field("suite", &spec.suite)
        .field(
            "packages",
            rootfs::normalized_packages(&spec.packages).join(","),
        )
        .field("agent", agent_sha256)
        .field("disk-mib", spec.disk_mib.to_string())
        .field("name", &spec.name)
        .finish()
}

/// Builds (or finds in the cache) the kernel, initramfs and root filesystem
/// of `spec`. Idempotent: with unchanged inputs it only checks the cache
/// (fingerprinting apt's lists, hashing the agent and busybox) and returns
/// in well under a second. Builds sharing a state dir are serialised by a lock. A new
/// Debian kernel is picked up once apt's package lists change (after an
/// `apt-get update`, which this never runs unless the lookup fails).
pub fn build(spec: &TemplateSpec, opts: &BuildOptions) -> Result<Artifacts, ImageError> {
    spec.validate()?;
    if !opts.guest_agent.is_file() {
        return Err(ImageError::AgentMissing(opts.guest_agent.to_path_buf()));
    }
    let images = images_dir(opts.state_dir);
    let _lock = cache::StateLock::acquire(&images)?;
    let started = Instant::now();
    for debris in cache::sweep_partials(&images)? {
        tracing::warn!(path = %debris.display(), "removed the remains of an interrupted build");
    }

    let pkg = kernel::resolve_kernel_package_cached(&images)?;
    let (kernel, r1) = build_kernel(&images, &pkg, &opts.progress)?;
    let (initramfs, r2) = build_initramfs(&images, &kernel, &opts.progress)?;
    let (base, r3) = build_base(&images, &spec.suite, &spec.packages, &opts.progress)?;
    let agent_sha = cache::sha256_file_cached(&images, opts.guest_agent)?;
    let (image, r4) = build_rootfs_image(
        &images,
        spec,
        &base,
        opts.guest_agent,
        &agent_sha,
        &opts.progress,
    )?;

    let artifacts = Artifacts {
        template: spec.name.clone(),
        kernel: kernel.vmlinuz(),
        initramfs: initramfs.path.clone(),
        rootfs: image.path.clone(),
        kernel_version: kernel.info.kernel_version.clone(),
        input_hash: input_hash(&pkg, &initramfs.info.content_sha256, spec, &agent_sha),
        steps: vec![r1, r2, r3, r4],
    };
    let pointer_dir = images.join("templates");
    std::fs::create_dir_all(&pointer_dir)
        .map_err(|e| ImageError::io(format!("creating {}", pointer_dir.display()), e))?;
    let pointer = pointer_dir.join(format!("{}.json", spec.name));
    if current_artifacts(opts.state_dir, &spec.name).as_ref() != Some(&artifacts) {
        cache::write_json_atomic(&pointer, &artifacts)?;
    }
    tracing::info!(template = %spec.name, input_hash = %artifacts.input_hash, elapsed = ?started.elapsed(), "template artifacts ready");
    Ok(artifacts)
}

/// The artifacts of the last successful [`build`] of template `name`, if
/// they are all still present. Does no building and no apt lookups, so it
/// may be stale against a newer Debian kernel; use [`build`] to refresh.
pub fn current_artifacts(state_dir: &Path, name: &str) -> Option<Artifacts> {
    let path = images_dir(state_dir)
        .join("templates")
        .join(format!("{name}.json"));
    let a: Artifacts = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    (a.kernel.is_file() && a.initramfs.is_file() && a.rootfs.is_file()).then_some(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_hash_changes_with_each_input_only() {
        let pkg = KernelPackage {
            name: "linux-image-x".into(),
            version: "1".into(),
        };
        let spec = find_template("base").unwrap();
        let h = input_hash(&pkg, "initrd", &spec, "agent");
        assert_eq!(h, input_hash(&pkg, "initrd", &spec, "agent"));
        let pkg2 = KernelPackage {
            version: "2".into(),
            ..pkg.clone()
        };
        assert_ne!(h, input_hash(&pkg2, "initrd", &spec, "agent"));
        assert_ne!(h, input_hash(&pkg, "initrd2", &spec, "agent"));
        assert_ne!(h, input_hash(&pkg, "initrd", &spec, "agent2"));
        let mut more = spec.clone();
        more.packages.push("curl".into());
        assert_ne!(h, input_hash(&pkg, "initrd", &more, "agent"));
        // Package order and VM shape are not image inputs.
        let mut shuffled = spec.clone();
        shuffled.packages.reverse();
        shuffled.memory_mib *= 2;
        shuffled.vcpus = 1;
        assert_eq!(h, input_hash(&pkg, "initrd", &shuffled, "agent"));
    }

    #[test]
    fn cmdline_has_console_and_panic_policy() {
        let c = kernel_cmdline();
        assert!(c.contains("console=ttyS0"));
        assert!(c.contains("panic=-1"));
        assert!(!c.contains("  "));
        let t = tcg_kernel_cmdline();
        assert!(t.starts_with(c));
        if cfg!(target_arch = "x86_64") {
            assert!(t.contains("tsc_early_khz="), "{t}");
        }
    }

    #[test]
    fn build_rejects_missing_agent_before_doing_anything() {
        let t = tempfile::tempdir().unwrap();
        let spec = find_template("base").unwrap();
        let missing = t.path().join("no-agent");
        let err = build(&spec, &BuildOptions::quiet(t.path(), &missing)).unwrap_err();
        assert!(matches!(err, ImageError::AgentMissing(_)));
        assert!(!t.path().join("images").exists());
    }
}
