//! Sandbox networking on real VMs: a namespace per sandbox with the same
//! guest address, egress through NAT to a stand-in "outside" host (a
//! network namespace this test makes, 198.51.100.1: this machine has no
//! route to the internet), `allow_internet: false`, isolation from other
//! sandboxes and from the host, a connection into the guest from its
//! namespace (what the HTTP proxy uses), and no leftovers after a kill or a
//! SIGKILL'd engine.

use shoal_engine::{CreateOptions, Engine, EngineConfig};
use shoal_proto::client::{AgentClient, ExecRequest};
use shoal_testkit::{block_on, wait_until, Sandbox};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TEMPLATE: &str = "base";
/// Has the whole Python standard library (`base` has python3-minimal, no
/// `http.server`).
const FULL_PYTHON: &str = "code-interpreter";
const OUTSIDE_NS: &str = "snt-outside";
const OUTSIDE_HOST_VETH: &str = "snt-host";
const OUTSIDE_IP: &str = "198.51.100.1";
const OUTSIDE_HOST_IP: &str = "198.51.100.254";
const OUTSIDE_PORT: u16 = 8080;
/// The stand-in for the host's resolver: a private address (as a real
/// host's usually is), in the outside namespace, answering every A query
/// with [`RESOLVED_IP`].
const RESOLVER_IP: &str = "10.254.53.1";
const RESOLVER_HOST_IP: &str = "10.254.53.254";
const RESOLVED_IP: [u8; 4] = [198, 51, 100, 77];

fn engine() -> &'static Engine {
    shoal_testkit::engine_with("vm_net", &[TEMPLATE, FULL_PYTHON], |config| {
        config.dns_upstream = Some(RESOLVER_IP.parse().unwrap());
    })
}

fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("running ip");
    assert!(status.success(), "ip {args:?} failed");
}

/// The stand-in for the internet: a namespace behind a veth, with a TCP
/// service that answers "outside <peer address>".
fn outside() {
    static OUTSIDE: OnceLock<()> = OnceLock::new();
    OUTSIDE.get_or_init(|| {
        let _ = Command::new("ip")
            .args(["netns", "delete", OUTSIDE_NS])
            .status();
        let _ = Command::new("ip")
            .args(["link", "delete", OUTSIDE_HOST_VETH])
            .status();
        ip(&["netns", "add", OUTSIDE_NS]);
        ip(&[
            "link",
            "add",
            OUTSIDE_HOST_VETH,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            OUTSIDE_NS,
        ]);
        ip(&[
            "addr",
            "add",
            &format!("{OUTSIDE_HOST_IP}/24"),
            "dev",
            OUTSIDE_HOST_VETH,
        ]);
        ip(&[
            "addr",
            "add",
            &format!("{RESOLVER_HOST_IP}/24"),
            "dev",
            OUTSIDE_HOST_VETH,
        ]);
        ip(&["link", "set", OUTSIDE_HOST_VETH, "up"]);
        for args in [
            vec!["link", "set", "lo", "up"],
            vec!["addr", "add", "198.51.100.1/24", "dev", "eth0"],
            vec!["addr", "add", "10.254.53.1/24", "dev", "eth0"],
            vec!["link", "set", "eth0", "up"],
            vec!["route", "add", "default", "via", OUTSIDE_HOST_IP],
        ] {
            let mut all = vec!["-n", OUTSIDE_NS];
            all.extend(args);
            ip(&all);
        }
        let ns = std::fs::File::open(format!("/run/netns/{OUTSIDE_NS}")).unwrap();
        let (listener, resolver) = std::thread::spawn(move || {
            // SAFETY: setns on this fresh thread only.
            let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(entered, 0);
            (
                // Every address: the private one must still be out of reach.
                std::net::TcpListener::bind(("0.0.0.0", OUTSIDE_PORT)).unwrap(),
                std::net::UdpSocket::bind((RESOLVER_IP, 53)).unwrap(),
            )
        })
        .join()
        .unwrap();
        std::thread::spawn(move || {
            let mut query = [0u8; 512];
            while let Ok((n, peer)) = resolver.recv_from(&mut query) {
                if let Some(answer) = dns_answer(&query[..n], RESOLVED_IP) {
                    let _ = resolver.send_to(&answer, peer);
                }
            }
        });
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut stream = stream;
                let peer = stream
                    .peer_addr()
                    .map(|a| a.ip().to_string())
                    .unwrap_or_default();
                let _ = stream.write_all(format!("outside {peer}\n").as_bytes());
            }
        });
    });
}

/// The reply to a one-question DNS query: `ip` for an A question, no
/// records (but no error) for anything else (glibc asks AAAA too).
fn dns_answer(query: &[u8], ip: [u8; 4]) -> Option<Vec<u8>> {
    if query.len() < 12 || query[4..6] != [0, 1] {
        return None;
    }
    let mut end = 12;
    while *query.get(end)? != 0 {
        end += 1 + usize::from(query[end]);
    }
    let question = query.get(12..end + 5)?;
    let is_a = question[question.len() - 4..] == [0, 1, 0, 1];
    let mut reply = query[..2].to_vec();
    reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, u8::from(is_a), 0, 0, 0, 0]);
    reply.extend_from_slice(question);
    if is_a {
        // The name by pointer to the question, A, IN, TTL 60, 4 bytes.
        reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        reply.extend_from_slice(&ip);
    }
    Some(reply)
}

async fn sh(agent: &AgentClient, cmd: &str) -> (i32, String) {
    let out = agent
        .exec_collect(ExecRequest {
            cmd: cmd.to_string(),
            timeout: Some(Duration::from_secs(60)),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code.unwrap_or(-1), text.trim().to_string())
}

/// A TCP connect from the guest: its first line, or the error.
async fn guest_connect(agent: &AgentClient, host: &str, port: u16) -> (i32, String) {
    sh(
        agent,
        &format!(
            "python3 -c \"import socket; s = socket.create_connection(('{host}', {port}), timeout=3); print(s.recv(100).decode().strip())\""
        ),
    )
    .await
}

async fn create_sandbox(allow_internet: bool) -> Sandbox {
    create_sandbox_from(TEMPLATE, allow_internet).await
}

async fn create_sandbox_from(template: &str, allow_internet: bool) -> Sandbox {
    let options = CreateOptions {
        allow_internet,
        ..CreateOptions::default()
    };
    Sandbox::create(engine(), template, options).await
}

fn netns_of(pid: u32) -> std::path::PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap()
}

#[test]
fn each_sandbox_has_its_own_namespace_and_the_same_guest_address() {
    block_on(async {
        let a = create_sandbox(true).await;
        let b = create_sandbox(true).await;
        let (na, nb) = (netns_of(a.pid().await), netns_of(b.pid().await));
        let own = netns_of(std::process::id());
        assert_ne!(na, nb);
        assert_ne!(na, own);
        assert_ne!(nb, own);
        for sandbox in [&a, &b] {
            let (code, out) = sh(&sandbox.agent().await, "ip -4 -o addr show eth0; ip route").await;
            assert_eq!(code, 0, "{out}");
            assert!(out.contains("inet 10.0.0.2/30"), "{out}");
            assert!(out.contains("default via 10.0.0.1"), "{out}");
            assert_eq!(
                engine().get(&sandbox.id).await.unwrap().guest_ip,
                "10.0.0.2"
            );
        }
    });
}

#[test]
fn egress_reaches_the_outside_only_when_allowed() {
    outside();
    block_on(async {
        let open = create_sandbox(true).await;
        let (code, out) = guest_connect(&open.agent().await, OUTSIDE_IP, OUTSIDE_PORT).await;
        assert_eq!(code, 0, "{out}");
        // Masqueraded twice: the outside sees the host's address on its link.
        assert_eq!(out, format!("outside {OUTSIDE_HOST_IP}"));

        let closed = create_sandbox(false).await;
        let (code, out) = guest_connect(&closed.agent().await, OUTSIDE_IP, OUTSIDE_PORT).await;
        assert_ne!(
            code, 0,
            "allow_internet false still reached the outside: {out}"
        );

        // A fork child keeps its parent's choice, in a namespace of its own.
        let fork = engine().fork(&closed.id, 1).await.expect("fork");
        let child = Sandbox::adopt(engine(), fork.children[0].id.clone());
        assert!(!fork.children[0].allow_internet);
        assert_ne!(netns_of(child.pid().await), netns_of(closed.pid().await));
        let (code, _) = guest_connect(&child.agent().await, OUTSIDE_IP, OUTSIDE_PORT).await;
        assert_ne!(code, 0);
    });
}

#[test]
fn guests_resolve_names_through_the_host_s_resolver_only_with_egress() {
    outside();
    block_on(async {
        let expected = RESOLVED_IP.map(|o| o.to_string()).join(".");
        let open = create_sandbox(true).await;
        let agent = open.agent().await;
        let (code, conf) = sh(&agent, "cat /etc/resolv.conf").await;
        assert_eq!(code, 0, "{conf}");
        assert!(conf.contains("nameserver 10.0.0.1"), "{conf}");
        let (code, out) = sh(&agent, "getent ahostsv4 files-know-nothing.example").await;
        assert_eq!(code, 0, "{out}");
        assert!(out.starts_with(&expected), "{out}");
        // Port 53 of the resolver, nothing else of its private address.
        let (code, out) = guest_connect(&agent, RESOLVER_IP, OUTSIDE_PORT).await;
        assert_ne!(code, 0, "reached {RESOLVER_IP}:{OUTSIDE_PORT}: {out}");

        let closed = create_sandbox(false).await;
        let (code, out) = sh(
            &closed.agent().await,
            "getent ahostsv4 files-know-nothing.example",
        )
        .await;
        assert_ne!(code, 0, "resolved without egress: {out}");
    });
}

#[test]
fn sandboxes_reach_neither_each_other_nor_the_host() {
    outside();
    block_on(async {
        let host_service = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let host_port = host_service.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in host_service.incoming().flatten() {
                let mut stream = stream;
                let _ = stream.write_all(b"host\n");
            }
        });
        // The same listener answers from here, so a refusal below is the
        // sandbox's network, not a dead service.
        let mut probe = std::net::TcpStream::connect(("127.0.0.1", host_port)).unwrap();
        let mut line = String::new();
        probe.read_to_string(&mut line).ok();
        assert_eq!(line, "host\n");

        let server = create_sandbox(true).await;
        let server_agent = server.agent().await;
        let (code, out) = sh(
            &server_agent,
            "nohup python3 -c \"import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 7000)); s.listen(); [c.sendall(b'sandbox\\n') or c.close() for c, _ in iter(s.accept, None)]\" >/dev/null 2>&1 & for i in $(seq 300); do grep -q ':1B58 ' /proc/net/tcp && break; sleep 0.1; done",
        )
        .await;
        assert_eq!(code, 0, "{out}");
        let (code, out) = guest_connect(&server_agent, "127.0.0.1", 7000).await;
        assert_eq!((code, out.as_str()), (0, "sandbox"));
        let server_info = engine().get(&server.id).await.unwrap();
        let server_veth = server_info.host_veth.clone().unwrap();
        let server_index: u32 = server_veth.trim_start_matches("shoalh").parse().unwrap();
        let server_egress = format!(
            "10.200.{}.{}",
            server_index / 64,
            (server_index % 64) * 4 + 2
        );

        let client = create_sandbox(true).await;
        let agent = client.agent().await;
        let veth = engine().get(&client.id).await.unwrap().host_veth.unwrap();
        let index: u32 = veth.trim_start_matches("shoalh").parse().unwrap();
        let own_host_end = format!("10.200.{}.{}", index / 64, (index % 64) * 4 + 1);
        for (host, port) in [
            (server_egress.as_str(), 7000),
            (own_host_end.as_str(), host_port),
            (OUTSIDE_HOST_IP, host_port),
        ] {
            let (code, out) = guest_connect(&agent, host, port).await;
            assert_ne!(code, 0, "a sandbox reached {host}:{port}: {out}");
        }
        // The client does have a network: the outside answers it.
        let (code, out) = guest_connect(&agent, OUTSIDE_IP, OUTSIDE_PORT).await;
        assert_eq!(code, 0, "{out}");
    });
}

#[test]
fn a_guest_service_is_reached_from_its_namespace() {
    block_on(async {
        let sandbox = create_sandbox_from(FULL_PYTHON, false).await;
        let agent = sandbox.agent().await;
        let (code, out) = sh(
            &agent,
            "cd /etc && nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 &",
        )
        .await;
        assert_eq!(code, 0, "{out}");
        // The server takes a moment to listen: retried until it answers.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut response = String::new();
        let mut served = false;
        while std::time::Instant::now() < deadline {
            let connected = engine().connect(&sandbox.id, 8000).await;
            if let Err(e) = &connected {
                response = shoal_engine::error::chain(e);
            }
            if let Ok(mut stream) = connected {
                stream
                    .write_all(b"GET / HTTP/1.0\r\nHost: sandbox\r\n\r\n")
                    .await
                    .unwrap();
                let mut bytes = Vec::new();
                stream.read_to_end(&mut bytes).await.unwrap();
                response = String::from_utf8_lossy(&bytes).into_owned();
                served = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !served {
            let (_, log) = sh(&agent, "cat /tmp/http.log").await;
            panic!("nothing answered on port 8000: {response}; server log: {log}");
        }
        assert!(response.starts_with("HTTP/1.0 200"), "{response}");
        assert!(response.contains("Directory listing for /"), "{response}");
        assert!(response.contains("hostname"), "{response}");
        assert!(engine().connect(&sandbox.id, 8001).await.is_err());
    });
}

#[test]
fn a_killed_sandbox_leaves_no_network_behind() {
    block_on(async {
        let sandbox = create_sandbox(true).await;
        let veth = engine().get(&sandbox.id).await.unwrap().host_veth.unwrap();
        assert!(shoal_engine::net::shoal_veths().contains(&veth));
        engine().kill(&sandbox.id).await.unwrap();
        let gone = wait_until(Duration::from_secs(10), || async {
            !shoal_engine::net::shoal_veths().contains(&veth)
        })
        .await;
        assert!(gone, "{veth} outlived its sandbox");
    });
}

/// Run only as a child of the test below: opens an engine, creates two
/// sandboxes, prints their veths and waits to be SIGKILLed.
#[test]
fn crash_helper() {
    let Ok(state) = std::env::var("SHOAL_NET_CRASH_STATE") else {
        return;
    };
    block_on(async {
        let mut config = EngineConfig::new(&state);
        config.cache_dir = shoal_testkit::cache_dir();
        config.net_pool_size = 2;
        let engine = Engine::open(config).await.unwrap();
        for _ in 0..2 {
            let info = engine.create(TEMPLATE, None).await.unwrap();
            println!("VETH {} PID {}", info.host_veth.unwrap(), info.pid.unwrap());
        }
        println!("READY");
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

#[test]
fn a_sigkilled_engine_s_networks_are_reaped_at_restart() {
    engine();
    let state = std::env::temp_dir()
        .join("shoal-tests")
        .join("vm_net-crash");
    let _ = std::fs::create_dir_all(&state);
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_helper", "--nocapture", "--test-threads=1"])
        .env("SHOAL_NET_CRASH_STATE", &state)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut child = KillOnDrop(child);
    let mut output = String::new();
    let mut buffer = [0u8; 4096];
    while !output.contains("READY") {
        let n = stdout.read(&mut buffer).unwrap();
        assert!(n > 0, "the helper ended early: {output}");
        output.push_str(&String::from_utf8_lossy(&buffer[..n]));
    }
    let veths: Vec<String> = output
        .lines()
        .filter_map(|l| l.split_once("VETH ").map(|(_, rest)| rest))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect();
    assert_eq!(veths.len(), 2, "{output}");
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) };
    child.0.wait().unwrap();
    // The helper's QEMUs outlive it and hold their namespaces.
    for veth in &veths {
        assert!(shoal_engine::net::shoal_veths().contains(veth));
    }
    block_on(async {
        let mut config = EngineConfig::new(&state);
        config.cache_dir = shoal_testkit::cache_dir();
        config.net_pool_size = 0;
        let restarted = Engine::open(config).await.unwrap();
        let gone = wait_until(Duration::from_secs(10), || async {
            let left = shoal_engine::net::shoal_veths();
            veths.iter().all(|v| !left.contains(v))
        })
        .await;
        assert!(gone, "leftover veths {veths:?} after restart");
        assert!(restarted.list().await.is_empty());
        assert!(shoal_testkit::processes_mentioning(&format!("{}/", state.display())).is_empty());
    });
}

/// Run in the guest by [`the_reachability_table`]: one connection attempt
/// per line of `$SHOAL_TARGETS` (`name<TAB>kind<TAB>host<TAB>port`), all at
/// once, each with a 3 s deadline; prints `name<TAB>result`, where result
/// is `ok`, `timeout`, `refused`, `unreachable` or another errno's name.
/// Kinds: `tcp`; `icmp6` (an echo request, identified by `port`, which
/// must differ between them; `ok` is a reply from an address not the
/// guest's own); `self6` (a listener of its own on `[::]`, reached
/// at the guest's own eth0 link-local address: the proof that the guest
/// speaks IPv6 and that the probe would see a reachable IPv6 target).
const PROBE: &str = r#"
import errno, os, socket, threading, time
T = 3.0
def own_link_local():
    try:
        for line in open('/proc/net/if_inet6'):
            f = line.split()
            # Not while tentative (0x40): duplicate address detection
            # runs again after a restore, and the address is unusable.
            if f[5] == 'eth0' and f[0].startswith('fe80') and not int(f[4], 16) & 0x40:
                return ':'.join(f[0][i:i + 4] for i in range(0, 32, 4))
    except OSError:
        pass
    return None
for _ in range(100):
    OWN = own_link_local()
    if OWN or not os.path.exists('/proc/net/if_inet6'):
        break
    time.sleep(0.1)
def packed(address):
    return socket.inet_pton(socket.AF_INET6, address.split('%')[0])
def tcp(host, port):
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(T)
    try:
        s.connect(address)
        return 'ok'
    finally:
        s.close()
def self6(host, port):
    if OWN is None:
        return 'no IPv6 link-local on eth0'
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    listener.bind(('::', 0))
    listener.listen()
    try:
        return tcp(OWN + '%eth0', listener.getsockname()[1])
    finally:
        listener.close()
def icmp6(host, port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
    s.settimeout(T)
    address = socket.getaddrinfo(host, None, socket.AF_INET6, socket.SOCK_RAW)[0][4]
    # Every raw ICMPv6 socket sees every echo reply: each probe has an
    # identifier of its own (its "port"), and the guest's own replies (to
    # a multicast echo) do not count.
    ident = bytes([0x53, port])
    s.sendto(b'\x80\x00\x00\x00' + ident + b'\x00\x01shoal', address)
    deadline = time.time() + T
    while True:
        s.settimeout(max(deadline - time.time(), 0.01))
        data, peer = s.recvfrom(2048)
        if data[:1] == b'\x81' and data[4:6] == ident and (OWN is None or packed(peer[0]) != packed(OWN)):
            return 'ok (reply from %s)' % peer[0]
KINDS = {'tcp': tcp, 'self6': self6, 'icmp6': icmp6}
NAMES = {errno.ECONNREFUSED: 'refused', errno.ETIMEDOUT: 'timeout',
         errno.EHOSTUNREACH: 'unreachable', errno.ENETUNREACH: 'unreachable'}
results = {}
def run(name, kind, host, port):
    try:
        result = KINDS[kind](host, int(port))
    except socket.timeout:
        result = 'timeout'
    except OSError as e:
        result = NAMES.get(e.errno) or errno.errorcode.get(e.errno or 0) or str(e)
    except Exception as e:
        result = '%s: %s' % (type(e).__name__, e)
    results[name] = result
threads = []
for line in os.environ['SHOAL_TARGETS'].splitlines():
    if line.strip():
        thread = threading.Thread(target=run, args=line.split('\t'))
        thread.start()
        threads.append(thread)
for thread in threads:
    thread.join()
for name, result in sorted(results.items()):
    print('%s\t%s' % (name, result))
"#;

/// tap0's IPv6 link-local address (EUI-64 of [`shoal_engine::net::TAP_MAC`]),
/// which the guest would reach on its eth0 if the slot spoke IPv6.
const TAP_LINK_LOCAL: &str = "fe80::53:48ff:fe00:1";

/// The EUI-64 link-local address of a MAC (`aa:bb:...`).
fn link_local_of(mac: &str) -> String {
    let b: Vec<u8> = mac
        .trim()
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).unwrap())
        .collect();
    format!(
        "fe80::{:x}:{:x}:{:x}:{:x}",
        u16::from_be_bytes([b[0] ^ 2, b[1]]),
        u16::from_be_bytes([b[2], 0xff]),
        u16::from_be_bytes([0xfe, b[3]]),
        u16::from_be_bytes([b[4], b[5]])
    )
}

/// Slot `index`'s /30 in 10.200.0.0/16: `host` 1 is the engine's end of
/// the veth pair, 2 the namespace's.
fn slot_address(index: u32, host: u32) -> String {
    let ip = u32::from(std::net::Ipv4Addr::new(10, 200, 0, 0)) + index * 4 + host;
    std::net::Ipv4Addr::from(ip).to_string()
}

/// The host's own addresses a sandbox must not reach: every global
/// address of every interface but loopback and the sandboxes' veths, and
/// the link-local addresses of interfaces that have a global one.
fn host_addresses() -> Vec<(String, String)> {
    let out = Command::new("ip")
        .args(["-o", "addr", "show"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut global = Vec::new();
    let mut link_local = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(ifname), Some(address)) = (fields.get(1), fields.get(3)) else {
            continue;
        };
        let ifname = ifname.trim_end_matches(':').split('@').next().unwrap();
        if ifname == "lo" || ifname.starts_with("shoalh") {
            continue;
        }
        let address = address.split('/').next().unwrap().to_string();
        if address.starts_with("fe80:") {
            link_local.push((ifname.to_string(), address));
        } else {
            global.push((ifname.to_string(), address));
        }
    }
    link_local.retain(|(ifname, _)| global.iter().any(|(i, _)| i == ifname));
    global.extend(link_local);
    global
}

/// A TCP connection from this (the host's) namespace: whether it opened.
fn host_reaches(host: &str, port: u16) -> bool {
    let Ok(mut addresses) = std::net::ToSocketAddrs::to_socket_addrs(&(host, port)) else {
        return false;
    };
    addresses
        .next()
        .is_some_and(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
}

/// A dual-stack TCP listener on every address (IPv4 and IPv6) of the
/// namespace it is made in; connections complete in the backlog, nobody
/// accepts them. Dropped, it lets its namespace go.
fn any_address_listener(port: u16) -> std::io::Result<std::net::TcpListener> {
    std::net::TcpListener::bind(("::", port))
        .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", port)))
}

/// A listener inside the network namespace of process `pid` (a sandbox's
/// QEMU: its slot), checked from inside the slot itself.
fn slot_listener(pid: u32) -> std::net::TcpListener {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
    std::thread::spawn(move || {
        // SAFETY: setns on this fresh thread only.
        let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "{}", std::io::Error::last_os_error());
        let listener = any_address_listener(0).unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(
            std::net::TcpStream::connect(("10.0.0.1", port)).is_ok(),
            "the slot's listener does not answer inside the slot"
        );
        listener
    })
    .join()
    .unwrap()
}

/// The slot's IPv6 addresses, as `/proc/<pid>/net/if_inet6` of a process
/// in it lists them.
fn slot_ipv6_addresses(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/net/if_inet6")).unwrap_or_default()
}

/// One row of the table: what the guest tries, and whether it must work.
struct Target {
    name: String,
    kind: &'static str,
    host: String,
    port: u16,
    /// `Some(true)`: a control, must be reached when the sandbox has
    /// egress (and not without); `Some(false)`: a control that must always
    /// be reached; `None`: must never be reached.
    control: Option<bool>,
}

fn target(name: impl Into<String>, kind: &'static str, host: &str, port: u16) -> Target {
    Target {
        name: name.into(),
        kind,
        host: host.to_string(),
        port,
        control: None,
    }
}

/// Runs [`PROBE`] in the guest: each target's result by name.
async fn probe(
    agent: &AgentClient,
    targets: &[Target],
) -> std::collections::BTreeMap<String, String> {
    let lines: String = targets
        .iter()
        .map(|t| format!("{}\t{}\t{}\t{}\n", t.name, t.kind, t.host, t.port))
        .collect();
    // The guest is root: it gives itself an IPv6 default route through
    // its link (which a slot speaking IPv6 would answer), so the host's
    // global IPv6 addresses are tried as well as link-local ones.
    let cmd = format!(
        "ip -6 route replace default via {TAP_LINK_LOCAL} dev eth0 >/dev/null 2>&1; exec python3 -c \"$SHOAL_PROBE\""
    );
    let out = agent
        .exec_collect(
            ExecRequest::new(cmd)
                .env("SHOAL_PROBE", PROBE)
                .env("SHOAL_TARGETS", lines),
        )
        .await
        .expect("exec of the probe");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code,
        Some(0),
        "probe: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(name, result)| (name.to_string(), result.to_string()))
        .collect()
}

/// Issue 19's reachability table: from a sandbox with and one without
/// `allow_internet`, nothing of the host (services standing in for the
/// API, a host agent and PostgreSQL, on every host address, IPv4 and
/// IPv6), nothing of the slot itself or the other sandbox's, and not the
/// metadata address is reached; the controls (the outside service and DNS
/// with egress, the guest's own IPv6) are, so the probe can fail. Prints
/// the table.
#[test]
fn the_reachability_table() {
    outside();
    block_on(async {
        // Stand-ins, on every address of the host: a control plane's API,
        // a host agent, PostgreSQL (the real one if it already listens).
        let api = any_address_listener(0).unwrap();
        let host_agent = any_address_listener(0).unwrap();
        let postgres = any_address_listener(5432).ok();
        let services = [
            ("api", api.local_addr().unwrap().port()),
            ("host agent", host_agent.local_addr().unwrap().port()),
            ("postgres", 5432),
        ];
        let mut ours = vec![services[0].1, services[1].1];
        if postgres.is_some() {
            ours.push(5432);
        }
        assert!(
            postgres.is_some() || host_reaches("127.0.0.1", 5432),
            "port 5432 is taken but does not answer"
        );

        let open = create_sandbox(true).await;
        let closed = create_sandbox(false).await;
        struct Slot {
            pid: u32,
            index: u32,
            veth: String,
            listener: std::net::TcpListener,
        }
        let mut slots = Vec::new();
        for sandbox in [&open, &closed] {
            let info = engine().get(&sandbox.id).await.unwrap();
            let veth = info.host_veth.unwrap();
            let pid = info.pid.unwrap();
            slots.push(Slot {
                pid,
                index: veth.trim_start_matches("shoalh").parse().unwrap(),
                listener: slot_listener(pid),
                veth,
            });
        }

        let host = host_addresses();
        let mut table: Vec<(String, [String; 2])> = Vec::new();
        let mut failures = Vec::new();
        let mut notes = Vec::new();
        for (column, sandbox, own, other, allow) in [
            (0, &closed, &slots[1], &slots[0], false),
            (1, &open, &slots[0], &slots[1], true),
        ] {
            let own_end = slot_address(own.index, 1);
            let own_veth_mac =
                std::fs::read_to_string(format!("/sys/class/net/{}/address", own.veth)).unwrap();
            let own_end_link_local = link_local_of(&own_veth_mac);
            let slot_port = own.listener.local_addr().unwrap().port();
            let other_port = other.listener.local_addr().unwrap().port();
            let mut targets = vec![
                Target {
                    control: Some(true),
                    ..target(
                        format!("control: outside {OUTSIDE_IP}:{OUTSIDE_PORT}"),
                        "tcp",
                        OUTSIDE_IP,
                        OUTSIDE_PORT,
                    )
                },
                Target {
                    control: Some(false),
                    ..target("control: guest's own IPv6 link-local", "self6", "", 0)
                },
                target("metadata 169.254.169.254:80", "tcp", "169.254.169.254", 80),
                target(
                    "metadata ::ffff:169.254.169.254:80",
                    "tcp",
                    "::ffff:169.254.169.254",
                    80,
                ),
                target("slot: gateway 10.0.0.1", "tcp", "10.0.0.1", slot_port),
                target(
                    "slot: tap0 link-local",
                    "tcp",
                    &format!("{TAP_LINK_LOCAL}%eth0"),
                    slot_port,
                ),
                target(
                    "slot: veth0 (own egress address)",
                    "tcp",
                    &slot_address(own.index, 2),
                    slot_port,
                ),
                target(
                    "slot: ICMPv6 echo to tap0 link-local",
                    "icmp6",
                    &format!("{TAP_LINK_LOCAL}%eth0"),
                    1,
                ),
                target(
                    "slot: ICMPv6 echo to ff02::1 (all nodes)",
                    "icmp6",
                    "ff02::1%eth0",
                    2,
                ),
                target(
                    "other sandbox: its veth0 (egress address)",
                    "tcp",
                    &slot_address(other.index, 2),
                    other_port,
                ),
            ];
            for (service, port) in services {
                let mut places: Vec<(String, String)> = vec![
                    ("own veth end".into(), own_end.clone()),
                    (
                        "own veth end, v4-mapped".into(),
                        format!("::ffff:{own_end}"),
                    ),
                    (
                        "own veth end link-local".into(),
                        format!("{own_end_link_local}%eth0"),
                    ),
                    (
                        "other sandbox's veth end".into(),
                        slot_address(other.index, 1),
                    ),
                ];
                for (ifname, address) in &host {
                    let scoped = if address.starts_with("fe80:") {
                        format!("{address}%eth0")
                    } else {
                        address.clone()
                    };
                    places.push((format!("host {ifname} {address}"), scoped));
                    if !address.contains(':') {
                        places.push((
                            format!("host {ifname} ::ffff:{address}"),
                            format!("::ffff:{address}"),
                        ));
                    }
                }
                for (place, address) in places {
                    targets.push(target(
                        format!("{service} on {place}"),
                        "tcp",
                        &address,
                        port,
                    ));
                }
            }
            let agent = sandbox.agent().await;
            let mut results = probe(&agent, &targets).await;
            let (code, out) = sh(&agent, "getent ahostsv4 files-know-nothing.example").await;
            results.insert(
                "control: DNS through the gateway".into(),
                if code == 0 {
                    "ok".into()
                } else {
                    format!("failed: {out}")
                },
            );
            targets.push(Target {
                control: Some(true),
                ..target("control: DNS through the gateway", "dns", "", 0)
            });
            for t in &targets {
                let result = results
                    .get(&t.name)
                    .cloned()
                    .unwrap_or_else(|| "no result".into());
                let reached = result.starts_with("ok");
                let must = match t.control {
                    Some(true) => allow,
                    Some(false) => true,
                    None => false,
                };
                if must != reached {
                    failures.push(format!(
                        "allow_internet {allow}: {} ({}:{}): {result}",
                        t.name, t.host, t.port
                    ));
                }
                // Each forbidden host target (on a listener of this test:
                // a real PostgreSQL may listen on loopback only) answers
                // the host itself, so a failure from the guest is the
                // network's doing.
                if t.control.is_none()
                    && t.kind == "tcp"
                    && ours.contains(&t.port)
                    && !t.host.starts_with("fe80:")
                    && !t.host.starts_with("::ffff:")
                    && !host_reaches(&t.host, t.port)
                {
                    failures.push(format!(
                        "the host itself does not reach {}:{}",
                        t.host, t.port
                    ));
                }
                match table.iter_mut().find(|(name, _)| *name == t.name) {
                    Some((_, row)) => row[column] = result,
                    None => {
                        let mut row = [String::from("-"), String::from("-")];
                        row[column] = result;
                        table.push((t.name.clone(), row));
                    }
                }
            }
            notes.push(format!(
                "allow_internet {allow}: {} has IPv6 disabled: {}; its slot's IPv6 addresses: [{}]",
                own.veth,
                std::fs::read_to_string(format!(
                    "/proc/sys/net/ipv6/conf/{}/disable_ipv6",
                    own.veth
                ))
                .unwrap_or_default()
                .trim(),
                slot_ipv6_addresses(own.pid).trim().replace('\n', "; ")
            ));
        }
        let width = table.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        let mut text = format!(
            "{:width$} | {:36} | {}\n",
            "target", "allow_internet false", "allow_internet true"
        );
        for (name, [closed_result, open_result]) in &table {
            text.push_str(&format!(
                "{name:width$} | {closed_result:36} | {open_result}\n"
            ));
        }
        for note in &notes {
            text.push_str(&format!("note: {note}\n"));
        }
        println!("{text}");
        assert!(failures.is_empty(), "{}\n{text}", failures.join("\n"));
        // The slots and the host ends of their veths speak no IPv6 at all.
        for slot in &slots {
            assert_eq!(slot_ipv6_addresses(slot.pid).trim(), "", "{text}");
            let disabled = std::fs::read_to_string(format!(
                "/proc/sys/net/ipv6/conf/{}/disable_ipv6",
                slot.veth
            ))
            .unwrap_or_else(|_| "1".into());
            assert_eq!(disabled.trim(), "1", "{} speaks IPv6\n{text}", slot.veth);
        }
        drop((api, host_agent, postgres, slots));
    });
}
