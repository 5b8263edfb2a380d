//! Baking a template: build its image, boot it once, wait for the guest
//! agent, warm it, and save memory, device state and disk as the snapshot
//! every create restores.
//!
//! A bake is identified by the hash of all its inputs (the image's input
//! hash, the QEMU build, the accelerator, the machine layout, the kernel
//! command line, vCPUs and memory); a bake whose hash exists is reused, so
//! `shoal template build` is idempotent and a QEMU upgrade rebakes.
//! Everything is written under `<hash>.tmp` and renamed when whole.

use crate::accel::{self, Accel};
use crate::error::{EngineError, IoContext, Result};
use crate::manifest::{now_unix_ms, Kind, Manifest};
use crate::net::NetSlot;
use crate::qemu::{self, Boot, LaunchSpec, MACHINE_LAYOUT_VERSION};
use crate::vm::{connect_unix, kill_process_group, with_qemu_log};
use crate::{lock_file, Engine};
use sha2::{Digest, Sha256};
use shoal_proto::client::{AgentClient, ExecRequest};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a cold boot may take to reach the guest agent (TCG is slow).
const BOOT_DEADLINE: Duration = Duration::from_secs(300);

/// How long a booted guest may take to write its files before the save.
const SYNC_DEADLINE: Duration = Duration::from_secs(60);

/// Where bake progress goes: the CLI passes a `MultiProgress`; tests pass a
/// hidden one.
pub type BakeProgress = indicatif::MultiProgress;

/// Under TCG every clone translates afresh all the guest code it runs, so
/// kernel work nobody in a sandbox asked for is paid in every create:
/// - `psi=0`: pressure accounting on every enqueue and dequeue, and its
///   averaging work every two seconds;
/// - `nowatchdog`: the soft-lockup watchdog's timer on every vCPU every
///   four seconds (an idle clone would wake for it);
/// - `audit=0`: no audit daemon runs, so the syscall audit hooks are idle;
/// - `init_on_alloc=0`: pages are zeroed when the kernel needs them zeroed,
///   not on every allocation (a zeroed page is a written page, which a clone
///   then holds privately);
/// - `cgroup_disable=memory`: no memory cgroups inside the guest (the host
///   bounds the VM); every page and slab allocation skips their charging;
/// - `lsm=landlock`: capabilities and landlock only, without the AppArmor,
///   TOMOYO, BPF and IMA hooks Debian enables on every file operation. The
///   VM is the isolation boundary; nothing in the guest loads their policies.
const LEAN_GUEST_FLAGS: &str =
    " psi=0 nowatchdog audit=0 init_on_alloc=0 cgroup_disable=memory lsm=landlock";

impl Engine {
    /// Builds (or finds) template `name` and returns its manifest.
    pub async fn build_template(
        &self,
        name: &str,
        guest_agent: &Path,
        progress: &BakeProgress,
    ) -> Result<Manifest> {
        let spec = shoal_image::find_template(name)
            .ok_or_else(|| EngineError::UnknownTemplate(name.to_string()))?;
        // One bake of a template at a time, across processes sharing the cache.
        let template_dir = self.config.cache_dir.join("templates").join(name);
        std::fs::create_dir_all(&template_dir)
            .io_context(|| format!("creating {}", template_dir.display()))?;
        let _bake_lock = lock_file(&template_dir.join("bake.lock"), true)?;
        crate::reap::reap_unfinished_bakes(&self.config.proc_root, &template_dir);
        let artifacts = self
            .build_image(&spec, guest_agent, progress.clone())
            .await?;

        let cmdline = self.kernel_cmdline();
        let hash = bake_hash(&[
            &artifacts.input_hash,
            &self.qemu_version,
            self.accel.as_str(),
            &MACHINE_LAYOUT_VERSION.to_string(),
            &cmdline,
            &spec.vcpus.to_string(),
            &spec.memory_mib.to_string(),
            warmup_command(name).unwrap_or(""),
        ]);
        // Directory names stay short: QMP and agent sockets live inside, and
        // a unix socket path must fit in 108 bytes.
        let hash = hash[..16].to_string();
        let final_dir = template_dir.join(&hash);
        if let Ok(manifest) = Manifest::load(&final_dir) {
            set_current(&template_dir, &hash)?;
            return Ok(manifest);
        }
        let bar = progress.add(indicatif::ProgressBar::new_spinner());
        bar.set_style(spinner_style());
        bar.enable_steady_tick(Duration::from_millis(120));
        bar.set_message(format!("{name}: booting the template VM ({})", self.accel));
        let tmp_dir = template_dir.join(format!("{hash}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp_dir);
        std::fs::create_dir_all(&tmp_dir)
            .io_context(|| format!("creating {}", tmp_dir.display()))?;
        let result = self
            .boot_and_save(
                name, &spec, &artifacts, &cmdline, &hash, &tmp_dir, &final_dir, &bar,
            )
            .await;
        let manifest = match result {
            Ok(manifest) => manifest,
            Err(e) => {
                bar.abandon_with_message(format!("{name}: bake failed"));
                let e = with_qemu_log(e, &tmp_dir);
                let _ = std::fs::remove_dir_all(&tmp_dir);
                return Err(e);
            }
        };
        std::fs::rename(&tmp_dir, &final_dir)
            .io_context(|| format!("renaming {}", tmp_dir.display()))?;
        set_current(&template_dir, &hash)?;
        bar.finish_with_message(format!("{name}: baked ({hash:.12})"));
        Ok(manifest)
    }

    /// Builds (or finds in the cache) the image layers of `spec`.
    async fn build_image(
        &self,
        spec: &shoal_image::TemplateSpec,
        guest_agent: &Path,
        progress: BakeProgress,
    ) -> Result<shoal_image::Artifacts> {
        let cache_dir = self.config.cache_dir.clone();
        let agent = guest_agent.to_path_buf();
        let spec = spec.clone();
        let artifacts = tokio::task::spawn_blocking(move || {
            shoal_image::build(
                &spec,
                &shoal_image::BuildOptions {
                    state_dir: &cache_dir,
                    guest_agent: &agent,
                    progress,
                },
            )
        })
        .await
        .expect("image build does not panic")?;
        Ok(artifacts)
    }

    pub(crate) fn kernel_cmdline(&self) -> String {
        let mut cmdline = shoal_image::kernel_cmdline().to_string();
        if self.accel == Accel::Tcg {
            // With several vCPUs under TCG the guest's own TSC calibration
            // can fail and boot hang; TCG's TSC is the host's, so say its
            // rate. Read from cpuinfo rather than measured, so the value
            // (part of the bake hash) is the same on every run.
            if let Some(khz) = accel::host_tsc_khz(&self.config.proc_root.join("cpuinfo")) {
                cmdline.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
            }
            // TCG executes nothing speculatively, so the guest kernel's
            // Spectre mitigations (retpolines, RSB filling, barriers on
            // every user copy) protect nothing and only cost time.
            cmdline.push_str(" mitigations=off");
            cmdline.push_str(LEAN_GUEST_FLAGS);
        }
        cmdline
    }

    #[allow(clippy::too_many_arguments)]
    async fn boot_and_save(
        &self,
        name: &str,
        spec: &shoal_image::TemplateSpec,
        artifacts: &shoal_image::Artifacts,
        cmdline: &str,
        hash: &str,
        dir: &Path,
        final_dir: &Path,
        bar: &indicatif::ProgressBar,
    ) -> Result<Manifest> {
        let launch = self.cold_boot_launch(
            dir,
            vec![artifacts.rootfs.clone()],
            spec.vcpus,
            spec.memory_mib,
            artifacts,
            cmdline,
        )?;
        let base = Manifest {
            id: format!("tpl-{name}"),
            kind: Kind::Template,
            template: name.to_string(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            memory_file: final_dir.join("memory"),
            devices_file: final_dir.join("devices"),
            disk_layers: vec![artifacts.rootfs.clone()],
            depends_on: Vec::new(),
            qemu_version: self.qemu_version.clone(),
            accel: self.accel,
            kernel_version: artifacts.kernel_version.clone(),
            input_hash: hash.to_string(),
            memory_sha256: None,
            created_unix_ms: now_unix_ms(),
        };
        let booted = cold_boot(&launch, self.net.take().await?, &self.jail, BOOT_DEADLINE).await?;
        bar.set_message(format!(
            "{name}: guest agent up after {:.1}s; warming",
            booted.boot_ms / 1000.0
        ));
        if let Some(command) = warmup_command(name) {
            let warmed = booted
                .agent
                .exec_collect(ExecRequest {
                    cmd: command.to_string(),
                    timeout: Some(Duration::from_secs(180)),
                    ..ExecRequest::default()
                })
                .await;
            match warmed {
                // A failed warm-up costs clones speed, not correctness.
                Ok(output) if output.status.code != Some(0) => tracing::warn!(
                    template = name,
                    status = ?output.status,
                    stderr = %String::from_utf8_lossy(&output.stderr).trim(),
                    "template warm-up failed"
                ),
                Ok(_) => {}
                Err(e) => {
                    booted.kill().await;
                    return Err(e.into());
                }
            }
        }
        bar.set_message(format!("{name}: saving the snapshot"));
        booted.save(dir).await?;
        let manifest = Manifest {
            disk_layers: vec![artifacts.rootfs.clone(), final_dir.join("disk.qcow2")],
            created_unix_ms: now_unix_ms(),
            memory_sha256: Some(crate::integrity::memory_sha256(&dir.join("memory"))?),
            ..base
        };
        manifest.store(dir)?;
        Ok(manifest)
    }
}

pub(crate) struct ColdBoot {
    /// Held until QEMU is gone.
    pub(crate) _net: NetSlot,
    pub(crate) _jail: crate::jail::VmJail,
    pub(crate) child: tokio::process::Child,
    pub(crate) pid: u32,
    pub(crate) qmp: shoal_qmp::Qmp,
    pub(crate) agent: AgentClient,
    pub(crate) boot_ms: f64,
}

impl Engine {
    /// What a cold boot of `disk_layers` (bottom first, read-only) needs in
    /// `dir`: a sparse memory file of `memory_mib`, mapped shared so the
    /// boot writes it; an empty top layer; this host's kernel and initramfs.
    pub(crate) fn cold_boot_launch(
        &self,
        dir: &Path,
        disk_layers: Vec<PathBuf>,
        vcpus: u32,
        memory_mib: u32,
        artifacts: &shoal_image::Artifacts,
        cmdline: &str,
    ) -> Result<LaunchSpec> {
        let memory_file = dir.join("memory");
        std::fs::File::create(&memory_file)
            .and_then(|f| f.set_len(u64::from(memory_mib) << 20))
            .io_context(|| format!("creating {}", memory_file.display()))?;
        let bottom = disk_layers
            .first()
            .ok_or_else(|| EngineError::InvalidInput("a boot needs a disk".into()))?;
        let disk_top = dir.join("disk.qcow2");
        std::fs::copy(self.empty_overlay_over(bottom)?, &disk_top)
            .io_context(|| format!("creating {}", disk_top.display()))?;
        Ok(LaunchSpec {
            qemu: self.config.qemu.clone(),
            accel: self.accel,
            vcpus,
            memory_mib,
            memory_file,
            memory_shared: true,
            disk_layers,
            disk_top,
            dir: dir.to_path_buf(),
            boot: Boot::Kernel {
                kernel: artifacts.kernel.clone(),
                initramfs: artifacts.initramfs.clone(),
                cmdline: cmdline.to_string(),
            },
            net_namespace: -1,
            volume_slots: crate::volume::bake_slots(dir)?,
            confinement: qemu::Confinement::pending(),
        })
    }
}

impl ColdBoot {
    /// Writes the guest's files to its disk, stops it, saves its device
    /// state to `dir/devices` and quits QEMU (killing it on any failure),
    /// then removes what only the running VM needed. QEMU has exited when
    /// this returns.
    pub(crate) async fn save(self, dir: &Path) -> Result<()> {
        let saved = async {
            // The guest's agent may be a tenant's (a sized copy boots the
            // disk of a tenant's snapshot): it gets a deadline.
            tokio::time::timeout(SYNC_DEADLINE, self.agent.sync())
                .await
                .map_err(|_| EngineError::Timeout("the guest's sync before the save".into()))??;
            self.qmp.stop().await?;
            qemu::save_device_state(&self.qmp, &dir.join("devices")).await?;
            self.qmp.quit().await?;
            Ok::<(), EngineError>(())
        }
        .await;
        if saved.is_err() {
            kill_process_group(self.pid);
        }
        let mut child = self.child;
        let _ = child.wait().await;
        saved?;
        for leftover in [
            "qmp.sock",
            "agent.sock",
            "qemu.log",
            "volume-slot-0.raw",
            "volume-slot-1.raw",
        ] {
            let _ = std::fs::remove_file(dir.join(leftover));
        }
        Ok(())
    }

    /// Kills QEMU and waits for it.
    pub(crate) async fn kill(self) {
        kill_process_group(self.pid);
        let mut child = self.child;
        let _ = child.wait().await;
    }
}

/// Boots `launch` from its kernel and waits for the guest agent. On failure
/// the QEMU process is killed.
pub(crate) async fn cold_boot(
    launch: &LaunchSpec,
    net: NetSlot,
    jail: &crate::jail::Jail,
    deadline: Duration,
) -> Result<ColdBoot> {
    let started = std::time::Instant::now();
    let mut launch = launch.clone();
    launch.net_namespace = net.ns_fd();
    let vm_jail = jail.for_vm(net.index, launch.vcpus, launch.memory_mib)?;
    launch.confinement = qemu::Confinement::of(&vm_jail);
    let mut child = launch.spawn(None)?;
    let pid = child.id().unwrap_or(0);
    let dir = &launch.dir;
    let connected = async {
        let qmp = shoal_qmp::Qmp::connect_with_deadline(&qemu::qmp_socket(dir), Duration::from_secs(10)).await?;
        let stream = connect_unix(&qemu::agent_socket(dir), Duration::from_secs(10)).await?;
        let agent = tokio::select! {
            agent = tokio::time::timeout(deadline, AgentClient::connect_with_deadline(stream, deadline)) => agent
                .map_err(|_| EngineError::Timeout("waiting for the guest agent to boot".into()))??,
            status = child.wait() => return Err(EngineError::Qemu {
                message: format!("QEMU exited during boot ({})", status.map(|s| s.to_string()).unwrap_or_default()),
            }),
        };
        Ok::<_, EngineError>((qmp, agent))
    }
    .await;
    match connected {
        Ok((qmp, agent)) => Ok(ColdBoot {
            _net: net,
            _jail: vm_jail,
            child,
            pid,
            qmp,
            agent,
            boot_ms: started.elapsed().as_secs_f64() * 1000.0,
        }),
        Err(e) => {
            kill_process_group(pid);
            let _ = child.wait().await;
            Err(e)
        }
    }
}

impl Engine {
    /// Boots template `name` from its kernel, as a bake does, and returns the
    /// milliseconds until its guest agent answered: the cost a restore saves.
    pub async fn measure_cold_boot(&self, name: &str, guest_agent: &Path) -> Result<f64> {
        let spec = shoal_image::find_template(name)
            .ok_or_else(|| EngineError::UnknownTemplate(name.to_string()))?;
        let hidden =
            indicatif::MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden());
        let artifacts = self.build_image(&spec, guest_agent, hidden).await?;
        // Under vms/, so a crash mid-measurement is reaped like any VM.
        let dir = self.vm_dir(&format!("coldboot-{}", &crate::new_sandbox_id()[3..]));
        std::fs::create_dir_all(&dir).io_context(|| format!("creating {}", dir.display()))?;
        let result = async {
            let launch = self.cold_boot_launch(
                &dir,
                vec![artifacts.rootfs.clone()],
                spec.vcpus,
                spec.memory_mib,
                &artifacts,
                &self.kernel_cmdline(),
            )?;
            let mut booted =
                cold_boot(&launch, self.net.take().await?, &self.jail, BOOT_DEADLINE).await?;
            kill_process_group(booted.pid);
            let _ = booted.child.wait().await;
            Ok(booted.boot_ms)
        }
        .await;
        let _ = std::fs::remove_dir_all(&dir);
        result
    }
}

/// Run once in the template before its snapshot, so every clone starts with
/// the work already done (imports compiled and in the page cache).
fn warmup_command(template: &str) -> Option<&'static str> {
    match template {
        "code-interpreter" => Some("python3 -c 'import numpy, pandas'"),
        _ => None,
    }
}

fn bake_hash(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    hex::encode(hasher.finalize())
}

/// Points `current` at bake `hash`; left as it is when it already does, so
/// its time says when the template last changed (see `bake_gc::GRACE`).
fn set_current(template_dir: &Path, hash: &str) -> Result<()> {
    let path: PathBuf = template_dir.join("current");
    if std::fs::read_to_string(&path).is_ok_and(|current| current.trim() == hash) {
        return Ok(());
    }
    let tmp = template_dir.join("current.tmp");
    std::fs::write(&tmp, hash).io_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).io_context(|| format!("writing {}", path.display()))
}

fn spinner_style() -> indicatif::ProgressStyle {
    indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
        .expect("static template")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bake_hash_changes_with_any_input() {
        let a = bake_hash(&["img", "qemu 7.2", "tcg"]);
        assert_eq!(a, bake_hash(&["img", "qemu 7.2", "tcg"]));
        assert_ne!(a, bake_hash(&["img", "qemu 8.0", "tcg"]));
        assert_ne!(a, bake_hash(&["img", "qemu 7.2", "kvm"]));
        assert_ne!(bake_hash(&["ab", "c"]), bake_hash(&["a", "bc"]));
    }
}
