//! Networking of one host's sandboxes: a network namespace per VM, a pool of
//! them prepared ahead of creates, and the host's own filter and NAT table.
//!
//! Every guest has the same address ([`GUEST_IP`] on eth0, MAC
//! [`GUEST_MAC`], gateway [`GATEWAY_IP`]), baked into the template: clones
//! and fork children never need reconfiguring because identical addresses
//! never meet. Each VM's QEMU runs inside a namespace of its own ("slot")
//! holding:
//!
//! - `tap0` ([`GATEWAY_IP`]/30, MAC [`TAP_MAC`], a static neighbour entry
//!   for the guest), the QEMU netdev;
//! - `veth0`, one end of a veth pair whose other end, `shoalh<N>`, is in the
//!   engine's own namespace; slot N owns `10.200.0.0/16`'s N-th /30
//!   (host end `.1`, namespace end `.2`);
//! - nftables table `ip shoal`: masquerade of the guest to `veth0`'s
//!   address, `input` and `forward` policies of drop (replies to what the
//!   guest or the proxy opened pass; new traffic only from `tap0` out of
//!   `veth0`, and never to private, shared, loopback or link-local
//!   addresses, so not to other sandboxes, the host or the control plane).
//!
//! IPv6 is off on every sandbox link, three times over: the namespace is
//! made with `disable_ipv6` on all its interfaces (so `tap0` and `veth0`
//! never get an address, and the guest's link-local traffic meets no
//! IPv6 stack), the host end `shoalh<N>` gets it before it is up, and
//! tables `ip6 shoal` (in the slot and on the host) drop whatever IPv6
//! would still come through; `tap0`'s ingress (`netdev shoal`) takes only
//! IPv4 and ARP from the guest at all. A sandbox has no IPv6 egress.
//!
//! A slot is prepared without a default route: egress is off until
//! [`NetSlot::allow_internet`] adds it, so a failure leaves a sandbox cut
//! off rather than open. The guest's resolver is its gateway: the
//! namespace rewrites DNS to it (port 53, UDP and TCP) to the host's own
//! upstream resolver ([`host_resolver`]), the one private address a
//! sandbox may reach, and only on port 53 (so only with egress on, since
//! the upstream is reached through the default route). The host's table ([`HOST_TABLE`]) drops whatever
//! reaches the host itself from a `shoalh*` interface, forwarding between
//! them, and forwarding to private ranges; it masquerades sandboxes out.
//!
//! Lifetimes: a namespace is never named in `/run/netns`; the engine holds
//! it by descriptor and QEMU by membership, so it (with its tap, veth pair
//! and table) is gone as soon as both let go, crash or not. Slot numbers
//! are claimed host-wide by `flock` on `/run/shoal/net/slot-<N>.lock`, so
//! several engines (a test beside `shoal up`) never collide, and a
//! `shoalh<N>` whose lock is free is a leftover that start-up deletes.
//!
//! Does not own: which sandbox gets which options (the engine's callers),
//! QEMU's flags (`qemu.rs`), or the guest's side (the guest agent sets
//! eth0 up when it boots, before the template is baked).

use crate::error::{EngineError, IoContext, Result};
use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

/// The guest's address, the same in every sandbox.
pub const GUEST_IP: Ipv4Addr = ipv4(shoal_proto::GUEST_ADDRESS);
/// The guest's MAC, given to QEMU's virtio-net device.
pub const GUEST_MAC: &str = "02:53:48:00:00:02";
/// The namespace's side of the tap: the guest's gateway.
pub const GATEWAY_IP: Ipv4Addr = ipv4(shoal_proto::GUEST_GATEWAY);
/// Fixed, so the neighbour entry the guest was baked with stays right.
pub const TAP_MAC: &str = "02:53:48:00:00:01";
/// The tap device inside every slot's namespace.
pub const TAP: &str = "tap0";
/// The nftables tables (`ip` and `ip6`) in the engine's namespace.
pub const HOST_TABLE: &str = "shoal";
/// Host ends of the veth pairs are `shoalh<N>`.
pub const HOST_VETH_PREFIX: &str = "shoalh";

const NS_VETH: &str = "veth0";
const SLOT_NET: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);
pub const SLOT_COUNT: u32 = 1 << 14;
/// Destinations no sandbox may open anything to.
const DENIED: &str = "10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, 192.168.0.0/16, 224.0.0.0/3";

const fn ipv4(octets: [u8; 4]) -> Ipv4Addr {
    Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3])
}

/// Where slot locks live (host-wide; `/run` is cleared at boot).
pub fn lock_dir() -> PathBuf {
    PathBuf::from("/run/shoal/net")
}

/// One prepared namespace, held for one QEMU process.
pub struct NetSlot {
    pub index: u32,
    ns: OwnedFd,
    /// An AF_INET socket created inside the namespace: routes are changed
    /// through it without entering the namespace again.
    control: OwnedFd,
    _lock: File,
}

impl std::fmt::Debug for NetSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetSlot")
            .field("index", &self.index)
            .finish()
    }
}

impl NetSlot {
    /// The namespace, for QEMU to `setns` into before exec.
    pub fn ns_fd(&self) -> RawFd {
        self.ns.as_raw_fd()
    }

    pub fn host_veth(&self) -> String {
        host_veth(self.index)
    }

    /// The address the guest's traffic leaves its namespace with.
    pub fn egress_ip(&self) -> Ipv4Addr {
        slot_ip(self.index, 2)
    }

    /// Adds the namespace's default route: the guest reaches the internet
    /// (still never private addresses: the namespace's table drops them).
    pub fn allow_internet(&self) -> Result<()> {
        add_default_route(self.control.as_raw_fd(), slot_ip(self.index, 1))
            .io_context(|| format!("adding the default route of slot {}", self.index))
    }

    /// A TCP socket of the namespace, not yet connected: what reaches the
    /// guest (the proxy) without any route from the host.
    pub fn tcp_socket(&self) -> Result<std::net::TcpStream> {
        let ns = self.ns.as_raw_fd();
        let fd = in_namespace(ns, || {
            // SAFETY: socket(2) takes no pointers; the result is checked.
            let fd = unsafe {
                libc::socket(
                    libc::AF_INET,
                    libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    0,
                )
            };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: fd is fresh and owned by nobody else.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })
        .io_context(|| format!("opening a socket in slot {}", self.index))?;
        Ok(std::net::TcpStream::from(fd))
    }
}

pub fn host_veth(index: u32) -> String {
    format!("{HOST_VETH_PREFIX}{index}")
}

fn slot_ip(index: u32, host: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(SLOT_NET) + index * 4 + host)
}

/// Prepared slots, refilled in the background so a create only pops one.
pub struct NetPool {
    ready: Mutex<Vec<NetSlot>>,
    target: usize,
    /// Where guests' DNS queries go (see [`host_resolver`]).
    dns: Ipv4Addr,
    refill: tokio::sync::Notify,
    /// Held shared while the engine runs; whoever gets it exclusively is
    /// the last engine and may remove the host table.
    host_lock: Mutex<Option<File>>,
}

impl NetPool {
    /// Sets up the host side (reaping what dead engines left), and starts
    /// filling a pool of `target` slots.
    pub fn open(target: usize, dns: Ipv4Addr) -> Result<Arc<NetPool>> {
        std::fs::create_dir_all(lock_dir())
            .io_context(|| format!("creating {}", lock_dir().display()))?;
        let host_lock_path = lock_dir().join("host.lock");
        let host_lock = open_lock(&host_lock_path)?;
        if try_flock(&host_lock, libc::LOCK_EX) {
            // No other engine runs: everything Shoal-named is a leftover.
            reap_host_veths();
            delete_host_tables();
        } else {
            reap_host_veths();
        }
        flock_wait(&host_lock, libc::LOCK_SH)?;
        install_host_table(dns)?;
        let pool = Arc::new(NetPool {
            ready: Mutex::new(Vec::new()),
            target,
            dns,
            refill: tokio::sync::Notify::new(),
            host_lock: Mutex::new(Some(host_lock)),
        });
        if target > 0 {
            tokio::spawn(refill_loop(pool.clone()));
        }
        Ok(pool)
    }

    /// A prepared slot: from the pool, or made now when it is empty.
    pub async fn take(&self) -> Result<NetSlot> {
        let ready = self.ready.lock().unwrap().pop();
        self.refill.notify_one();
        match ready {
            Some(slot) => Ok(slot),
            None => {
                let dns = self.dns;
                tokio::task::spawn_blocking(move || prepare_slot(dns))
                    .await
                    .expect("slot preparation does not panic")
            }
        }
    }

    pub fn ready_count(&self) -> usize {
        self.ready.lock().unwrap().len()
    }

    /// Drops the pool's slots, stops refilling and, if this is the last
    /// engine on the host, removes the host table. Called when the engine
    /// is dropped.
    pub fn close(&self) {
        let Some(lock) = self.host_lock.lock().unwrap().take() else {
            return;
        };
        self.refill.notify_one();
        self.ready.lock().unwrap().clear();
        if try_flock(&lock, libc::LOCK_EX) {
            delete_host_tables();
            restore_forwarding();
        }
    }
}

/// Removes the host's tables, one at a time: an engine of an older version
/// made only the `ip` one, and a batch fails whole.
fn delete_host_tables() {
    for family in ["ip", "ip6"] {
        let _ = run_nft(None, &format!("delete table {family} {HOST_TABLE}\n"));
    }
}

async fn refill_loop(pool: Arc<NetPool>) {
    loop {
        if pool.host_lock.lock().unwrap().is_none() {
            return;
        }
        if pool.ready_count() >= pool.target {
            pool.refill.notified().await;
            continue;
        }
        let dns = pool.dns;
        match tokio::task::spawn_blocking(move || prepare_slot(dns)).await {
            Ok(Ok(slot)) => {
                if pool.host_lock.lock().unwrap().is_none() {
                    return;
                }
                pool.ready.lock().unwrap().push(slot);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::error::chain(&e), "preparing a network slot failed");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            Err(_) => return,
        }
    }
}

/// Takes over slot `index` of QEMU `pid`, which an engine that died left
/// running: the slot's lock (free since that engine died) is claimed, and
/// the namespace is reached through the process, which still holds it.
/// Called before [`NetPool::open`], which would otherwise reap the slot's
/// `shoalh<N>` as a leftover.
pub fn adopt_slot(index: u32, pid: u32) -> Result<NetSlot> {
    let unadoptable = |why: String| EngineError::Qemu {
        message: format!("cannot adopt network slot {index} of QEMU {pid}: {why}"),
    };
    if index >= SLOT_COUNT {
        return Err(unadoptable("no such slot".into()));
    }
    std::fs::create_dir_all(lock_dir())
        .io_context(|| format!("creating {}", lock_dir().display()))?;
    let lock = open_lock(&slot_lock_path(index))?;
    if !try_flock(&lock, libc::LOCK_EX) {
        return Err(unadoptable("another engine holds it".into()));
    }
    let ns = File::open(format!("/proc/{pid}/ns/net"))
        .io_context(|| format!("opening the network namespace of QEMU {pid}"))?;
    let own = std::fs::metadata("/proc/self/ns/net")
        .io_context(|| "reading this process's network namespace".into())?;
    let theirs = ns
        .metadata()
        .io_context(|| format!("reading the network namespace of QEMU {pid}"))?;
    use std::os::unix::fs::MetadataExt;
    if (own.dev(), own.ino()) == (theirs.dev(), theirs.ino()) {
        return Err(unadoptable("it runs in the host's namespace".into()));
    }
    if !Path::new("/sys/class/net").join(host_veth(index)).exists() {
        return Err(unadoptable(format!("{} is gone", host_veth(index))));
    }
    let ns = OwnedFd::from(ns);
    let control = in_namespace(ns.as_raw_fd(), control_socket)
        .io_context(|| format!("opening a socket in slot {index}"))?;
    Ok(NetSlot {
        index,
        ns,
        control,
        _lock: lock,
    })
}

/// Claims a free slot number and builds its namespace, whose guest's DNS
/// goes to `dns`.
pub fn prepare_slot(dns: Ipv4Addr) -> Result<NetSlot> {
    let (index, lock) = claim_index()?;
    let veth = host_veth(index);
    // A leftover of a dead engine (its lock was free): gone first.
    if Path::new("/sys/class/net").join(&veth).exists() {
        let _ = run_ip(None, &format!("link del {veth}\n"));
    }
    let (ns, control) = new_namespace()?;
    let ns_ip = slot_ip(index, 2);
    let host_ip = slot_ip(index, 1);
    let inside = format!(
        "link set lo up\n\
         link add {NS_VETH} type veth peer name {veth} netns {pid}\n\
         addr add {ns_ip}/30 dev {NS_VETH}\n\
         link set {NS_VETH} up\n\
         tuntap add dev {TAP} mode tap vnet_hdr\n\
         link set {TAP} address {TAP_MAC} up\n\
         addr add {GATEWAY_IP}/30 dev {TAP}\n\
         neigh replace {GUEST_IP} lladdr {GUEST_MAC} dev {TAP} nud permanent\n",
        pid = std::process::id()
    );
    run_ip(Some(ns.as_raw_fd()), &inside)?;
    // Before it is up, so it never gets even a link-local address.
    disable_ipv6(&veth)?;
    run_ip(
        None,
        &format!("addr add {host_ip}/30 dev {veth}\nlink set {veth} up\n"),
    )?;
    run_nft(Some(ns.as_raw_fd()), &namespace_table(dns))?;
    Ok(NetSlot {
        index,
        ns,
        control,
        _lock: lock,
    })
}

fn namespace_table(dns: Ipv4Addr) -> String {
    format!(
        "table ip shoal {{\n\
         \tchain prerouting {{ type nat hook prerouting priority dstnat;\n\
         \t\tiifname \"{TAP}\" ip daddr {GATEWAY_IP} meta l4proto {{ tcp, udp }} th dport 53 dnat to {dns}\n\
         \t}}\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; oifname \"{NS_VETH}\" masquerade; }}\n\
         \tchain input {{ type filter hook input priority filter; policy drop;\n\
         \t\tct state established,related accept\n\
         \t\tiifname \"lo\" accept\n\
         \t}}\n\
         \tchain forward {{ type filter hook forward priority filter; policy drop;\n\
         \t\tct state established,related accept\n\
         \t\tiifname \"{TAP}\" oifname \"{NS_VETH}\" ip daddr {dns} meta l4proto {{ tcp, udp }} th dport 53 accept\n\
         \t\tiifname \"{TAP}\" oifname \"{NS_VETH}\" ip daddr != {{ {DENIED} }} accept\n\
         \t}}\n\
         }}\n\
         table ip6 shoal {{\n\
         \tchain input {{ type filter hook input priority filter; policy drop; }}\n\
         \tchain forward {{ type filter hook forward priority filter; policy drop; }}\n\
         \tchain output {{ type filter hook output priority filter; policy drop; }}\n\
         }}\n\
         table netdev shoal {{\n\
         \tchain guest {{ type filter hook ingress device \"{TAP}\" priority filter;\n\
         \t\tether type != {{ ip, arp }} drop\n\
         \t}}\n\
         }}\n"
    )
}

/// The host's tables: nothing from a sandbox reaches the host itself or
/// another sandbox or a private address (but its DNS upstream on port 53);
/// sandboxes are masqueraded out; no IPv6 comes from or goes to one. Every engine on the host runs this script
/// when it opens: the chains are rebuilt, and the set of DNS upstreams only
/// grows, so engines with different upstreams do not undo each other.
fn host_table(drop_other_forwarding: bool, dns: Ipv4Addr) -> String {
    let p = HOST_VETH_PREFIX;
    let others = if drop_other_forwarding {
        // This engine turned forwarding on: forward nothing else.
        format!("\t\tiifname != \"{p}*\" oifname != \"{p}*\" drop\n")
    } else {
        String::new()
    };
    let to_dns = format!("ip daddr @{DNS_SET} meta l4proto {{ tcp, udp }} th dport 53 accept");
    format!(
        "table ip {HOST_TABLE} {{\n\
         \tset {DNS_SET} {{ type ipv4_addr; }}\n\
         \tchain input {{ type filter hook input priority filter - 1; }}\n\
         \tchain forward {{ type filter hook forward priority filter - 1; }}\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; }}\n\
         }}\n\
         flush chain ip {HOST_TABLE} input\n\
         flush chain ip {HOST_TABLE} forward\n\
         flush chain ip {HOST_TABLE} postrouting\n\
         add element ip {HOST_TABLE} {DNS_SET} {{ {dns} }}\n\
         table ip {HOST_TABLE} {{\n\
         \tchain input {{\n\
         \t\tiifname \"{p}*\" {to_dns}\n\
         \t\tiifname \"{p}*\" drop\n\
         \t}}\n\
         \tchain forward {{\n\
         {others}\
         \t\tiifname \"{p}*\" oifname \"{p}*\" drop\n\
         \t\tiifname \"{p}*\" {to_dns}\n\
         \t\tiifname \"{p}*\" ip daddr {{ {DENIED} }} drop\n\
         \t\toifname \"{p}*\" ct state established,related accept\n\
         \t\toifname \"{p}*\" drop\n\
         \t}}\n\
         \tchain postrouting {{\n\
         \t\tip saddr {SLOT_NET}/16 oifname != \"{p}*\" masquerade\n\
         \t}}\n\
         }}\n\
         table ip6 {HOST_TABLE} {{\n\
         \tchain input {{ type filter hook input priority filter - 1; }}\n\
         \tchain forward {{ type filter hook forward priority filter - 1; }}\n\
         }}\n\
         flush chain ip6 {HOST_TABLE} input\n\
         flush chain ip6 {HOST_TABLE} forward\n\
         table ip6 {HOST_TABLE} {{\n\
         \tchain input {{\n\
         \t\tiifname \"{p}*\" drop\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\tiifname \"{p}*\" drop\n\
         \t\toifname \"{p}*\" drop\n\
         \t}}\n\
         }}\n"
    )
}

/// The host table's set of guests' DNS upstreams.
const DNS_SET: &str = "dns_upstreams";

fn forwarding_marker() -> PathBuf {
    lock_dir().join("forwarding-enabled-by-shoal")
}

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

fn install_host_table(dns: Ipv4Addr) -> Result<()> {
    let forward = Path::new(IP_FORWARD);
    let marker = forwarding_marker();
    let on = std::fs::read_to_string(forward).unwrap_or_default().trim() == "1";
    if !on {
        std::fs::write(forward, "1").io_context(|| "turning IPv4 forwarding on".into())?;
        std::fs::write(&marker, "").io_context(|| format!("writing {}", marker.display()))?;
    }
    run_nft(None, &host_table(marker.exists(), dns))
}

/// The last engine on the host leaves IPv4 forwarding as it found it.
fn restore_forwarding() {
    let marker = forwarding_marker();
    if marker.exists() {
        if let Err(e) = std::fs::write(IP_FORWARD, "0") {
            tracing::warn!(error = %e, "turning IPv4 forwarding back off failed");
            return;
        }
        let _ = std::fs::remove_file(marker);
    }
}

/// Public resolvers, for a host whose own resolver a sandbox cannot use
/// (a loopback stub such as systemd-resolved's 127.0.0.53).
const FALLBACK_RESOLVER: Ipv4Addr = Ipv4Addr::new(1, 1, 1, 1);

/// The upstream DNS server for guests: the host's first IPv4 nameserver
/// that is not a loopback stub (`/etc/resolv.conf`, then systemd-resolved's
/// upstream list), else [`FALLBACK_RESOLVER`].
pub fn host_resolver() -> Ipv4Addr {
    ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .find_map(|text| first_usable_nameserver(&text))
        .unwrap_or(FALLBACK_RESOLVER)
}

fn first_usable_nameserver(resolv_conf: &str) -> Option<Ipv4Addr> {
    resolv_conf.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some("nameserver"))
            .then(|| words.next()?.parse::<Ipv4Addr>().ok())
            .flatten()
            .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
    })
}

/// Deletes every `shoalh<N>` in this namespace whose slot no engine holds.
pub fn reap_host_veths() {
    for name in shoal_veths() {
        let Some(index) = name
            .strip_prefix(HOST_VETH_PREFIX)
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(lock) = open_lock(&slot_lock_path(index)) else {
            continue;
        };
        if try_flock(&lock, libc::LOCK_EX) {
            tracing::info!(veth = name, "reaping leftover sandbox network");
            let _ = run_ip(None, &format!("link del {name}\n"));
        }
    }
}

/// Names of the `shoalh<N>` interfaces in this namespace.
pub fn shoal_veths() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix(HOST_VETH_PREFIX)
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect()
}

fn slot_lock_path(index: u32) -> PathBuf {
    lock_dir().join(format!("slot-{index}.lock"))
}

fn claim_index() -> Result<(u32, File)> {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Where the last search ended, so claims do not rescan held slots.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = NEXT.load(Ordering::Relaxed);
    for offset in 0..SLOT_COUNT {
        let index = (start + offset) % SLOT_COUNT;
        let lock = open_lock(&slot_lock_path(index))?;
        if try_flock(&lock, libc::LOCK_EX) {
            NEXT.store((index + 1) % SLOT_COUNT, Ordering::Relaxed);
            return Ok((index, lock));
        }
    }
    Err(EngineError::Io {
        context: "claiming a network slot".into(),
        source: std::io::Error::other("all network slots are in use"),
    })
}

fn open_lock(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .io_context(|| format!("opening {}", path.display()))
}

fn try_flock(file: &File, mode: libc::c_int) -> bool {
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) == 0 }
}

fn flock_wait(file: &File, mode: libc::c_int) -> Result<()> {
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), mode) } != 0 {
        return Err(std::io::Error::last_os_error()).io_context(|| "locking host.lock".into());
    }
    Ok(())
}

/// Runs `f` on a short-lived thread that has entered namespace `ns`, so no
/// thread of the engine's pools ever changes namespace.
fn in_namespace<T: Send + 'static>(
    ns: RawFd,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    std::thread::spawn(move || {
        // SAFETY: setns on a namespace descriptor the caller keeps open
        // until this thread is joined; it changes only this thread.
        if unsafe { libc::setns(ns, libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        f()
    })
    .join()
    .expect("namespace thread does not panic")
}

/// A new network namespace (by descriptor) with forwarding on, and a
/// control socket inside it.
fn new_namespace() -> Result<(OwnedFd, OwnedFd)> {
    std::thread::spawn(|| -> std::io::Result<(OwnedFd, OwnedFd)> {
        // SAFETY: unshare changes only this thread's network namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ns = File::open("/proc/thread-self/ns/net")?;
        // Per-namespace sysctls: written from inside the namespace. `all`
        // covers `lo`, already there; `default` the tap and veth to come.
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
        for conf in ["all", "default"] {
            write_ipv6_conf(conf, "disable_ipv6", "1")?;
        }
        Ok((ns.into(), control_socket()?))
    })
    .join()
    .expect("namespace thread does not panic")
    .io_context(|| "creating a network namespace".into())
}

/// An AF_INET datagram socket of the calling thread's namespace: routes
/// of that namespace are changed through it (see [`NetSlot`]).
fn control_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Turns IPv6 off on `ifname` of the engine's namespace.
fn disable_ipv6(ifname: &str) -> Result<()> {
    write_ipv6_conf(ifname, "disable_ipv6", "1")
        .io_context(|| format!("turning IPv6 off on {ifname}"))
}

/// Writes `/proc/sys/net/ipv6/conf/<conf>/<key>` of the calling thread's
/// namespace; a kernel without IPv6 (no such directory) has nothing to
/// turn off.
fn write_ipv6_conf(conf: &str, key: &str, value: &str) -> std::io::Result<()> {
    if !Path::new("/proc/sys/net/ipv6").exists() {
        return Ok(());
    }
    std::fs::write(format!("/proc/sys/net/ipv6/conf/{conf}/{key}"), value)
}

fn add_default_route(control: RawFd, gateway: Ipv4Addr) -> std::io::Result<()> {
    fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: sockaddr_in and sockaddr have the same size on Linux and
        // any bit pattern is a valid sockaddr.
        unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
    }
    // SAFETY: rtentry is plain data; zero is its documented empty value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr(gateway);
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: SIOCADDRT reads an rtentry we own.
    if unsafe { libc::ioctl(control, libc::SIOCADDRT as _, &route) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `ip -batch -`, inside namespace `ns` when given.
fn run_ip(ns: Option<RawFd>, batch: &str) -> Result<()> {
    run_tool("ip", &["-batch", "-"], ns, batch)
}

/// `nft -f -`, inside namespace `ns` when given.
fn run_nft(ns: Option<RawFd>, script: &str) -> Result<()> {
    run_tool("nft", &["-f", "-"], ns, script)
}

fn run_tool(program: &str, args: &[&str], ns: Option<RawFd>, input: &str) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(ns) = ns {
        // SAFETY: setns is async-signal-safe; `ns` stays open in the parent
        // until the child has exec'd (spawn returns after that).
        unsafe {
            command.pre_exec(move || {
                if libc::setns(ns, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = command
        .spawn()
        .io_context(|| format!("running {program}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(input.as_bytes());
    }
    let output = child
        .wait_with_output()
        .io_context(|| format!("running {program}"))?;
    if !output.status.success() {
        return Err(EngineError::Io {
            context: format!("{program} {}", args.join(" ")),
            source: std::io::Error::other(format!(
                "{}; input: {}",
                String::from_utf8_lossy(&output.stderr).trim(),
                input.trim().replace('\n', "; ")
            )),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_get_their_own_slash_30() {
        assert_eq!(slot_ip(0, 1), Ipv4Addr::new(10, 200, 0, 1));
        assert_eq!(slot_ip(0, 2), Ipv4Addr::new(10, 200, 0, 2));
        assert_eq!(slot_ip(64, 1), Ipv4Addr::new(10, 200, 1, 1));
        assert_eq!(slot_ip(SLOT_COUNT - 1, 2), Ipv4Addr::new(10, 200, 255, 254));
        assert!(host_veth(SLOT_COUNT - 1).len() <= 15);
    }

    #[test]
    fn host_table_drops_other_forwarding_only_when_shoal_turned_it_on() {
        let dns = Ipv4Addr::new(10, 255, 255, 53);
        assert!(
            host_table(true, dns).contains("iifname != \"shoalh*\" oifname != \"shoalh*\" drop")
        );
        assert!(!host_table(false, dns).contains("iifname != "));
    }

    #[test]
    fn the_dns_upstream_is_the_one_private_address_let_through_and_only_on_port_53() {
        let dns = Ipv4Addr::new(10, 255, 255, 53);
        let host = host_table(false, dns);
        assert!(
            host.contains("add element ip shoal dns_upstreams { 10.255.255.53 }"),
            "{host}"
        );
        let ip4 = &host[..host.find("table ip6").unwrap()];
        let forward = &ip4[ip4.rfind("chain forward").unwrap()..];
        let accept =
            forward.find("ip daddr @dns_upstreams meta l4proto { tcp, udp } th dport 53 accept");
        let deny = forward.find("ip daddr { 10.0.0.0/8");
        assert!(
            accept.is_some() && deny.is_some() && accept < deny,
            "{host}"
        );
        let ns = namespace_table(dns);
        assert!(
            ns.contains(
                "ip daddr 10.0.0.1 meta l4proto { tcp, udp } th dport 53 dnat to 10.255.255.53"
            ),
            "{ns}"
        );
    }

    #[test]
    fn no_ipv6_passes_the_slot_or_the_host_and_the_tap_takes_only_ipv4_and_arp() {
        let dns = Ipv4Addr::new(10, 255, 255, 53);
        let ns = namespace_table(dns);
        let ip6 = &ns[ns.find("table ip6 shoal").expect(&ns)..];
        for hook in ["input", "forward", "output"] {
            assert!(
                ip6.contains(&format!(
                    "chain {hook} {{ type filter hook {hook} priority filter; policy drop; }}"
                )),
                "{ns}"
            );
        }
        assert!(
            ns.contains(
                "hook ingress device \"tap0\" priority filter;\n\t\tether type != { ip, arp } drop"
            ),
            "{ns}"
        );
        let host = host_table(false, dns);
        let ip6 = &host[host.rfind("table ip6 shoal").expect(&host)..];
        assert!(
            ip6.contains("chain input {\n\t\tiifname \"shoalh*\" drop"),
            "{host}"
        );
        assert!(
            ip6.contains("iifname \"shoalh*\" drop\n\t\toifname \"shoalh*\" drop"),
            "{host}"
        );
    }

    #[test]
    fn the_host_resolver_skips_loopback_stubs() {
        assert_eq!(
            first_usable_nameserver("# x\nsearch a\nnameserver 127.0.0.53\nnameserver 10.1.2.3\n"),
            Some(Ipv4Addr::new(10, 1, 2, 3))
        );
        assert_eq!(
            first_usable_nameserver("nameserver ::1\nnameserver 127.0.0.1\n"),
            None
        );
        assert_eq!(
            first_usable_nameserver("nameserver 192.0.2.1 \n"),
            Some(Ipv4Addr::new(192, 0, 2, 1))
        );
    }
}
