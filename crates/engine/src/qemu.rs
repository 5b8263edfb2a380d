//! QEMU command lines and processes: the one place that knows QEMU's flags.
//!
//! Owns: the `microvm` machine layout (which devices, in which order), the
//! accelerator flags, the seccomp sandbox, the disk chain as `-blockdev`
//! nodes, the volume slots (virtio-blk devices baked into every template,
//! since `microvm` has no hotplug), and starting QEMU in its own process
//! group inside the VM's
//! directory, confined (`-chroot`, `-runas`, the seccomp sandbox, its
//! cgroup: see `jail.rs`). Does not decide what to run: the engine hands it a
//! [`LaunchSpec`]. Device order is part of every baked snapshot, so changing
//! it must bump [`MACHINE_LAYOUT_VERSION`].

use crate::accel::Accel;
use crate::error::{IoContext, Result};
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tokio::process::Command as AsyncCommand;

/// Bumped whenever the device layout or anything else that a snapshot's
/// device state depends on changes; it is part of every bake's input hash.
pub const MACHINE_LAYOUT_VERSION: u32 = 3;

/// Volume slots of every VM: virtio-blk devices after the NIC, each backed
/// by a placeholder file unless a volume is attached to it. The guest finds
/// slot N by its serial, [`volume_slot_serial`].
pub const VOLUME_SLOTS: usize = 2;

/// The virtio-blk serial of volume slot `index`, as the guest reads it in
/// `/sys/block/vdX/serial`.
pub fn volume_slot_serial(index: usize) -> String {
    format!("shoal-vol{index}")
}

/// The descriptor number the device state file is handed to QEMU on.
pub const INCOMING_FD: i32 = 3;

/// Size of the TCG translation cache per VM. It is allocated lazily, so an
/// idle clone only pays for what it translated; much smaller and heavy work
/// (importing pandas) thrashes it.
const TCG_TB_SIZE_MIB: u32 = 64;

/// How one VM is started: a cold boot (baking a template) or a restore.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub qemu: PathBuf,
    pub accel: Accel,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// The guest RAM file: mapped shared while baking (the bake writes the
    /// template's memory), private (copy-on-write) for every restore.
    pub memory_file: PathBuf,
    pub memory_shared: bool,
    /// Read-only layers, bottom first: a raw image, then qcow2 layers.
    pub disk_layers: Vec<PathBuf>,
    /// The VM's own writable qcow2 layer on top of `disk_layers`.
    pub disk_top: PathBuf,
    /// Per-VM directory: sockets, console log, QEMU's own log.
    pub dir: PathBuf,
    pub boot: Boot,
    /// The network namespace QEMU joins before exec (see `net.rs`); its
    /// `tap0` backs the guest's virtio-net device.
    pub net_namespace: RawFd,
    /// What backs each of the [`VOLUME_SLOTS`] slots, in slot order.
    pub volume_slots: Vec<SlotBacking>,
    /// Who QEMU becomes once it has opened its files.
    pub confinement: Confinement,
}

/// The jail QEMU enters after set-up (see `jail.rs`): this uid and gid,
/// this root, these cgroups (their `cgroup.procs`, open for writing).
#[derive(Debug, Clone)]
pub struct Confinement {
    pub uid: u32,
    pub gid: u32,
    pub root: PathBuf,
    pub cgroup_procs: Vec<RawFd>,
}

impl Confinement {
    /// Stands in until the VM's slot, and so its uid, is known: a spec
    /// with it is refused by [`LaunchSpec::spawn`].
    pub fn pending() -> Confinement {
        Confinement {
            uid: 0,
            gid: 0,
            root: PathBuf::new(),
            cgroup_procs: Vec::new(),
        }
    }

    pub fn of(jail: &crate::jail::VmJail) -> Confinement {
        Confinement {
            uid: jail.uid,
            gid: jail.gid,
            root: jail.root.clone(),
            cgroup_procs: jail.cgroup.attach_fds(),
        }
    }
}

/// The raw file behind one volume slot: a volume's ext4 image, or the
/// placeholder of an unused slot.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotBacking {
    pub file: PathBuf,
    pub read_only: bool,
}

#[derive(Debug, Clone)]
pub enum Boot {
    /// Boot a kernel (only when baking).
    Kernel {
        kernel: PathBuf,
        initramfs: PathBuf,
        cmdline: String,
    },
    /// Restore device state from the file given as descriptor
    /// [`INCOMING_FD`]; guest RAM is already in `memory_file`.
    Restore,
}

pub fn qmp_socket(dir: &Path) -> PathBuf {
    dir.join("qmp.sock")
}

pub fn agent_socket(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}

pub fn console_log(dir: &Path) -> PathBuf {
    dir.join("console.log")
}

/// A console log longer than this is cut to its last [`CONSOLE_LOG_KEEP`]
/// bytes: the guest writes it, so without a cap it could fill the disk.
pub const CONSOLE_LOG_CAP: u64 = 2 << 20;
/// What a cut keeps: as much as `GET .../logs` answers with.
pub const CONSOLE_LOG_KEEP: u64 = 1 << 20;

/// Cuts the console log at `path` to its last [`CONSOLE_LOG_KEEP`] bytes
/// when it is over [`CONSOLE_LOG_CAP`]. QEMU appends (`append=on`), so it
/// goes on writing at the new end; what it writes during the cut (a few
/// microseconds) may be lost or land before the kept tail.
pub fn cap_console_log(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let len = file.metadata()?.len();
    if len <= CONSOLE_LOG_CAP {
        return Ok(false);
    }
    file.seek(SeekFrom::Start(len - CONSOLE_LOG_KEEP))?;
    let mut tail = Vec::with_capacity(CONSOLE_LOG_KEEP as usize);
    (&mut file).take(CONSOLE_LOG_KEEP).read_to_end(&mut tail)?;
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(b"[shoal: console log cut to its last MiB]\n")?;
    file.write_all(&tail)?;
    Ok(true)
}

pub fn qemu_log(dir: &Path) -> PathBuf {
    dir.join("qemu.log")
}

impl LaunchSpec {
    /// The full argument list (without the program name).
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |s: &str| args.push(s.into());
        push("-name");
        push("shoal");
        // PIT, PIC and RTC stay on: the guest kernel calibrates its clocks
        // with them, and option ROMs stay on because microvm loads the kernel
        // through one.
        push("-M");
        push("microvm");
        match self.accel {
            Accel::Kvm => {
                push("-accel");
                push("kvm");
                push("-cpu");
                push("host");
            }
            Accel::Tcg => {
                push("-accel");
                push(&format!("tcg,tb-size={TCG_TB_SIZE_MIB}"));
                push("-cpu");
                push("max");
            }
        }
        push("-smp");
        push(&self.vcpus.to_string());
        push("-m");
        push(&format!("{}M", self.memory_mib));
        push("-object");
        push(&format!(
            "memory-backend-file,id=ram,size={}M,mem-path={},share={},prealloc=off",
            self.memory_mib,
            self.memory_file.display(),
            if self.memory_shared { "on" } else { "off" }
        ));
        push("-machine");
        push("memory-backend=ram");
        for flag in ["-nodefaults", "-no-user-config", "-nographic"] {
            push(flag);
        }
        push("-display");
        push("none");
        // Appended, so that [`cap_console_log`] can cut it under QEMU.
        push("-chardev");
        push(&format!(
            "file,id=console,path={},append=on",
            console_log(&self.dir).display()
        ));
        push("-serial");
        push("chardev:console");
        // Once machine set-up is done (every file below opened, every socket
        // bound), QEMU chroots into the empty jail and becomes the VM's own
        // uid; what it must open later comes as a descriptor.
        push("-chroot");
        push(&self.confinement.root.display().to_string());
        push("-runas");
        push(&format!(
            "{}:{}",
            self.confinement.uid, self.confinement.gid
        ));
        // The seccomp sandbox forbids QEMU to spawn processes or touch
        // resource controls. `elevateprivileges=allow` only because -runas
        // itself calls setgid/setuid after the filter is in place (QEMU is
        // killed by SIGSYS with `deny`); after the drop it holds no
        // capability, and no_new_privs is set, so no set*id regains root.
        push("-sandbox");
        push("on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny");
        push("-qmp");
        push(&format!(
            "unix:{},server=on,wait=off",
            qmp_socket(&self.dir).display()
        ));
        // Devices, in a fixed order (see MACHINE_LAYOUT_VERSION).
        push("-device");
        push("virtio-serial-device");
        push("-chardev");
        push(&format!(
            "socket,id=agent,path={},server=on,wait=off",
            agent_socket(&self.dir).display()
        ));
        push("-device");
        push(&format!(
            "virtserialport,chardev=agent,name={}",
            shoal_proto::AGENT_PORT_NAME
        ));
        push("-device");
        push("virtio-rng-device");
        for blockdev in self.blockdevs() {
            push("-blockdev");
            push(&blockdev);
        }
        push("-device");
        push("virtio-blk-device,drive=root");
        // Last, so the devices before it keep the numbers they had.
        push("-netdev");
        push(&format!(
            "tap,id=net0,ifname={},script=no,downscript=no,vnet_hdr=on",
            crate::net::TAP
        ));
        push("-device");
        push(&format!(
            "virtio-net-device,netdev=net0,mac={}",
            crate::net::GUEST_MAC
        ));
        // The volume slots, after everything that existed before them. The
        // backing file is not part of the migration stream, so a restore may
        // put a volume of any size behind a slot baked with a placeholder.
        for (index, slot) in self.volume_slots.iter().enumerate() {
            let read_only = if slot.read_only { ",read-only=on" } else { "" };
            push("-blockdev");
            push(&format!(
                "driver=file,filename={},node-name=fvol{index}{read_only}",
                slot.file.display()
            ));
            push("-blockdev");
            push(&format!(
                "driver=raw,file=fvol{index},node-name=vol{index}{read_only}"
            ));
            push("-device");
            push(&format!(
                "virtio-blk-device,drive=vol{index},serial={}",
                volume_slot_serial(index)
            ));
        }
        match &self.boot {
            Boot::Kernel {
                kernel,
                initramfs,
                cmdline,
            } => {
                push("-kernel");
                push(&kernel.display().to_string());
                push("-initrd");
                push(&initramfs.display().to_string());
                push("-append");
                push(cmdline);
            }
            Boot::Restore => {
                // Device state is saved without the configuration section
                // (xen-save-devices-state), so the restoring side must not
                // expect one. No -kernel here: it would hold a copy of the
                // kernel in every clone's heap for nothing.
                push("-global");
                push("migration.send-configuration=off");
                // After an incoming migration QEMU asks the guest to announce
                // itself (virtio-net's guest announce, five rounds over half a
                // second): gratuitous ARP, unsolicited neighbour adverts, MLD
                // reports and netlink notices, about a sixth of all the guest
                // code a restore runs, translated afresh in every clone. A
                // sandbox never moves between links, so nobody needs to hear.
                push("-global");
                push("migration.announce-rounds=0");
                push("-incoming");
                push("defer");
            }
        }
        args
    }

    fn blockdevs(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut below: Option<String> = None;
        for (index, layer) in self.disk_layers.iter().enumerate() {
            let file_node = format!("f{index}");
            let node = format!("l{index}");
            out.push(format!(
                "driver=file,filename={},node-name={file_node},read-only=on",
                layer.display()
            ));
            let format = if is_qcow2(layer) { "qcow2" } else { "raw" };
            let backing = match (&below, format) {
                (Some(b), "qcow2") => format!(",backing={b}"),
                (None, "qcow2") => ",backing=null".to_string(),
                _ => String::new(),
            };
            out.push(format!(
                "driver={format},file={file_node},node-name={node},read-only=on{backing}"
            ));
            below = Some(node);
        }
        out.push(format!(
            "driver=file,filename={},node-name=ftop",
            self.disk_top.display()
        ));
        let backing = match &below {
            Some(b) => format!(",backing={b}"),
            None => ",backing=null".to_string(),
        };
        out.push(format!("driver=qcow2,file=ftop,node-name=root{backing}"));
        out
    }

    /// Starts QEMU in its own process group with the VM directory as its
    /// working directory; `incoming` becomes descriptor [`INCOMING_FD`].
    pub fn spawn(&self, incoming: Option<OwnedFd>) -> Result<tokio::process::Child> {
        if self.confinement.uid == 0
            || self.confinement.gid == 0
            || !self.confinement.root.is_absolute()
        {
            return Err(crate::error::EngineError::Qemu {
                message: format!("refusing to start QEMU unconfined ({:?})", self.confinement),
            });
        }
        let log = std::fs::File::create(qemu_log(&self.dir))
            .io_context(|| format!("creating {}", qemu_log(&self.dir).display()))?;
        let mut command = AsyncCommand::new(&self.qemu);
        command
            .args(self.args())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().io_context(|| "cloning log handle".into())?)
            .stderr(log)
            .env_clear()
            .process_group(0)
            .kill_on_drop(false);
        let incoming_raw = incoming.as_ref().map(|fd| fd.as_raw_fd());
        let namespace = self.net_namespace;
        let cgroup_procs = self.confinement.cgroup_procs.clone();
        // SAFETY: between fork and exec only async-signal-safe calls are
        // made (setns, write, open, setrlimit, close_range, dup2, fcntl);
        // `incoming` stays open in the parent until spawn returns because
        // it is moved into this closure, the namespace descriptor is held by
        // the caller's slot and the cgroup descriptors by its `VmJail`.
        unsafe {
            command.pre_exec(move || {
                let _keep = &incoming;
                if libc::setns(namespace, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                crate::jail::in_child(&cgroup_procs, INCOMING_FD + 1)?;
                if let Some(raw) = incoming_raw {
                    if raw == INCOMING_FD {
                        let flags = libc::fcntl(raw, libc::F_GETFD);
                        libc::fcntl(raw, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
                    } else if libc::dup2(raw, INCOMING_FD) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        command
            .spawn()
            .io_context(|| format!("starting {}", self.qemu.display()))
    }
}

/// Saves the device state of a stopped VM into a new file at `path`. QEMU
/// cannot open host paths once jailed, so the engine opens the file and
/// hands it over (`add-fd`, `/dev/fdset/N`).
pub(crate) async fn save_device_state(qmp: &shoal_qmp::Qmp, path: &Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .io_context(|| format!("creating {}", path.display()))?;
    let fdset = qmp.add_fd(&file).await?;
    let saved = qmp
        .execute_value(
            "xen-save-devices-state",
            Some(serde_json::json!({"filename": format!("/dev/fdset/{fdset}"), "live": true})),
        )
        .await;
    let removed = qmp.remove_fd(fdset).await;
    saved?;
    removed?;
    Ok(())
}

pub fn is_qcow2(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "qcow2")
}

/// Identifies the QEMU build: its `--version` banner, compared as an opaque
/// string (a snapshot is only restored by the very build that made it).
pub fn version_id(qemu: &Path) -> Result<String> {
    let output = Command::new(qemu)
        .arg("--version")
        .output()
        .io_context(|| format!("running {} --version", qemu.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_console_log_over_its_cap_keeps_its_last_mib() {
        let dir = std::env::temp_dir().join(format!("shoal-console-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("console.log");
        std::fs::write(&path, vec![b'a'; CONSOLE_LOG_CAP as usize]).unwrap();
        assert!(!cap_console_log(&path).unwrap(), "at the cap: kept whole");
        let mut text = vec![b'a'; CONSOLE_LOG_CAP as usize];
        text.extend_from_slice(b"the end\n");
        std::fs::write(&path, &text).unwrap();
        assert!(cap_console_log(&path).unwrap());
        let kept = std::fs::read(&path).unwrap();
        assert!(kept.starts_with(b"[shoal: console log cut"));
        assert!(kept.ends_with(b"aaathe end\n"));
        assert!(kept.len() as u64 <= CONSOLE_LOG_KEEP + 64);
        // A writer that appends goes on at the new end.
        use std::io::Write;
        let mut appender = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        appender.write_all(b"after\n").unwrap();
        assert!(std::fs::read(&path).unwrap().ends_with(b"the end\nafter\n"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn spec(boot: Boot) -> LaunchSpec {
        LaunchSpec {
            qemu: "qemu-system-x86_64".into(),
            accel: Accel::Tcg,
            vcpus: 8,
            memory_mib: 2048,
            memory_file: "/t/memory".into(),
            memory_shared: false,
            disk_layers: vec!["/i/rootfs.img".into(), "/t/disk.qcow2".into()],
            disk_top: "/v/disk.qcow2".into(),
            dir: "/v".into(),
            boot,
            net_namespace: -1,
            volume_slots: vec![
                SlotBacking {
                    file: "/c/placeholder".into(),
                    read_only: true,
                },
                SlotBacking {
                    file: "/s/volumes/7/data.ext4".into(),
                    read_only: false,
                },
            ],
            confinement: Confinement {
                uid: 1_900_000_007,
                gid: 1_900_000_007,
                root: "/run/shoal/jail".into(),
                cgroup_procs: Vec::new(),
            },
        }
    }

    fn joined(spec: &LaunchSpec) -> String {
        spec.args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn restore_maps_memory_privately_and_defers_incoming() {
        let args = joined(&spec(Boot::Restore));
        assert!(args.contains("mem-path=/t/memory,share=off"));
        assert!(args.contains("-incoming defer"));
        assert!(args.contains("migration.send-configuration=off"));
        assert!(args.contains("migration.announce-rounds=0"));
        assert!(!args.contains("-kernel"));
        assert!(args.contains("spawn=deny"));
        assert!(args.contains("-chroot /run/shoal/jail -runas 1900000007:1900000007"));
        assert!(args.contains("elevateprivileges=allow"));
        assert!(args.contains("-netdev tap,id=net0,ifname=tap0,script=no"));
        assert!(args.contains("virtio-net-device,netdev=net0,mac=02:53:48:00:00:02"));
    }

    #[test]
    fn disk_chain_links_each_layer_to_the_one_below() {
        let args = joined(&spec(Boot::Restore));
        assert!(args.contains("driver=raw,file=f0,node-name=l0,read-only=on "));
        assert!(args.contains("driver=qcow2,file=f1,node-name=l1,read-only=on,backing=l0"));
        assert!(args.contains("driver=qcow2,file=ftop,node-name=root,backing=l1"));
    }

    #[test]
    fn volume_slots_follow_the_nic_with_their_own_backing() {
        let args = joined(&spec(Boot::Restore));
        let nic = args.find("virtio-net-device").unwrap();
        let slot0 = args
            .find("virtio-blk-device,drive=vol0,serial=shoal-vol0")
            .unwrap();
        let slot1 = args
            .find("virtio-blk-device,drive=vol1,serial=shoal-vol1")
            .unwrap();
        assert!(nic < slot0 && slot0 < slot1);
        assert!(args.contains("driver=file,filename=/c/placeholder,node-name=fvol0,read-only=on "));
        assert!(args.contains("driver=raw,file=fvol0,node-name=vol0,read-only=on "));
        assert!(args.contains("driver=file,filename=/s/volumes/7/data.ext4,node-name=fvol1 "));
        assert!(args.contains("driver=raw,file=fvol1,node-name=vol1 "));
    }

    #[test]
    fn baking_boots_the_kernel_on_shared_memory() {
        let mut s = spec(Boot::Kernel {
            kernel: "/k".into(),
            initramfs: "/i".into(),
            cmdline: "console=ttyS0".into(),
        });
        s.memory_shared = true;
        let args = joined(&s);
        assert!(args.contains("share=on"));
        assert!(args.contains("-kernel /k -initrd /i -append console=ttyS0"));
        assert!(!args.contains("-incoming"));
    }
}
