//! What the agent does first when it is the guest's PID 1 (`--init`): the
//! mounts a userland expects, a sane environment, the loopback interface,
//! eth0 (the fixed address every sandbox has, see
//! `shoal_proto::GUEST_ADDRESS`; the template is baked with it set) and
//! `/etc/resolv.conf` (the gateway).
//! Every step logs and carries on when it fails: PID 1 must never exit.
//!
//! Does not own: /dev, /proc and /sys (the initramfs mounted them and moved
//! them into the new root) or reaping orphans (see `reaper`).

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Runs before any thread starts (it sets environment variables).
pub fn setup() {
    std::env::set_var("PATH", PATH);
    std::env::set_var("HOME", "/root");
    let nodev = libc::MS_NOSUID | libc::MS_NODEV;
    let mounts: [(&str, &str, &str, libc::c_ulong, &str); 4] = [
        (
            "devpts",
            "/dev/pts",
            "devpts",
            libc::MS_NOSUID | libc::MS_NOEXEC,
            "ptmxmode=0666,mode=0620,gid=5",
        ),
        ("shm", "/dev/shm", "tmpfs", nodev, "mode=1777"),
        ("tmpfs", "/run", "tmpfs", nodev, "mode=0755"),
        ("tmpfs", "/tmp", "tmpfs", nodev, "mode=1777"),
    ];
    for (source, target, fstype, flags, data) in mounts {
        if let Err(err) = mount(source, target, fstype, flags, data) {
            crate::log(&format!("mounting {target} failed: {err}"));
        }
    }
    if let Err(err) = make_ptmx_usable() {
        crate::log(&format!("/dev/ptmx: {err}"));
    }
    if let Err(err) = interface_up("lo") {
        crate::log(&format!("bringing up lo failed: {err}"));
    }
    if let Err(err) = eth0_up() {
        crate::log(&format!("configuring eth0 failed: {err}"));
    }
    if let Err(err) = std::fs::write("/etc/resolv.conf", resolv_conf()) {
        crate::log(&format!("writing /etc/resolv.conf failed: {err}"));
    }
}

/// The guest asks its gateway, which the host forwards to its resolver
/// (only when the sandbox may reach the internet).
fn resolv_conf() -> String {
    let [a, b, c, d] = shoal_proto::GUEST_GATEWAY;
    format!("nameserver {a}.{b}.{c}.{d}\noptions timeout:2 attempts:2\n")
}

fn is_mount_point(target: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|info| {
            info.lines()
                .any(|line| line.split(' ').nth(4) == Some(target))
        })
        .unwrap_or(false)
}

fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> io::Result<()> {
    if is_mount_point(target) {
        return Ok(());
    }
    std::fs::create_dir_all(target)?;
    let c = |s: &str| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let (source, target, fstype, data) = (c(source)?, c(target)?, c(fstype)?, c(data)?);
    // SAFETY: all pointers are valid NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// /dev/ptmx must open the devpts instance at /dev/pts with mode 0666.
fn make_ptmx_usable() -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::symlink_metadata("/dev/ptmx") {
        Err(_) => std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx"),
        Ok(meta) if meta.file_type().is_symlink() => Ok(()),
        Ok(_) => std::fs::set_permissions("/dev/ptmx", std::fs::Permissions::from_mode(0o666)),
    }
}

/// `struct ifreq` with the flags member of its union (the union is 24
/// bytes on every Linux ABI we run on).
#[repr(C)]
struct IfreqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

const SIOCGIFFLAGS: libc::c_ulong = 0x8913;
const SIOCSIFFLAGS: libc::c_ulong = 0x8914;

/// `struct ifreq` with a `sockaddr` in its union.
#[repr(C)]
struct IfreqAddr {
    name: [libc::c_char; libc::IFNAMSIZ],
    addr: libc::sockaddr_in,
    _pad: [u8; 8],
}

const SIOCSIFADDR: libc::c_ulong = 0x8916;
const SIOCSIFNETMASK: libc::c_ulong = 0x891c;

fn ifname(name: &str) -> [libc::c_char; libc::IFNAMSIZ] {
    let mut out = [0; libc::IFNAMSIZ];
    for (dst, src) in out.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *dst = src as libc::c_char;
    }
    out
}

fn sockaddr_in(octets: [u8; 4]) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes(octets).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn inet_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket takes no pointers; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// eth0 gets the sandbox address and a default route via its gateway.
fn eth0_up() -> io::Result<()> {
    use std::os::fd::AsRawFd;
    if !std::path::Path::new("/sys/class/net/eth0").exists() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "no eth0"));
    }
    let socket = inet_socket()?;
    for (request, octets) in [
        (SIOCSIFADDR, shoal_proto::GUEST_ADDRESS),
        (SIOCSIFNETMASK, shoal_proto::GUEST_NETMASK),
    ] {
        let req = IfreqAddr {
            name: ifname("eth0"),
            addr: sockaddr_in(octets),
            _pad: [0; 8],
        };
        // SAFETY: the ioctl reads an ifreq-sized struct we own.
        if unsafe { libc::ioctl(socket.as_raw_fd(), request as _, &req) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    interface_up("eth0")?;
    let as_sockaddr = |octets| {
        // SAFETY: sockaddr_in and sockaddr have the same size and any bit
        // pattern is a valid sockaddr.
        unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sockaddr_in(octets)) }
    };
    // SAFETY: rtentry is plain data; zero is its empty value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = as_sockaddr([0; 4]);
    route.rt_genmask = as_sockaddr([0; 4]);
    route.rt_gateway = as_sockaddr(shoal_proto::GUEST_GATEWAY);
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: SIOCADDRT reads an rtentry we own.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCADDRT as _, &route) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn interface_up(name: &str) -> io::Result<()> {
    let socket = inet_socket()?;
    let mut req = IfreqFlags {
        name: ifname(name),
        flags: 0,
        _pad: [0; 22],
    };
    use std::os::fd::AsRawFd;
    // SAFETY: the ioctl reads and writes an ifreq-sized struct we own.
    if unsafe { libc::ioctl(socket.as_raw_fd(), SIOCGIFFLAGS as _, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    req.flags |= libc::IFF_UP as libc::c_short;
    // SAFETY: as above.
    if unsafe { libc::ioctl(socket.as_raw_fd(), SIOCSIFFLAGS as _, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
