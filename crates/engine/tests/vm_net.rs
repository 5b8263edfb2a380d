//! Sandbox networking on real VMs: a namespace per sandbox with the same
//! guest address, egress through NAT to a stand-in "outside" host (a
//! network namespace this test makes, 198.51.100.1: this machine has no
//! route to the internet), `allow_internet: false`, isolation from other
//! sandboxes and from the host, a connection into the guest from its
//! namespace (what the HTTP proxy uses), and no leftovers after a kill or a
//! SIGKILL'd engine.

use shoal_engine::{CreateOptions, Engine, EngineConfig};
use shoal_proto::client::{AgentClient, ExecRequest};
use shoal_testkit::{block_on, wait_until};
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

struct Sandbox {
    id: String,
}

impl Sandbox {
    async fn create(allow_internet: bool) -> Sandbox {
        Sandbox::create_from(TEMPLATE, allow_internet).await
    }

    async fn create_from(template: &str, allow_internet: bool) -> Sandbox {
        let info = engine()
            .create_with(
                template,
                None,
                CreateOptions {
                    allow_internet,
                    ..CreateOptions::default()
                },
            )
            .await
            .expect("create");
        Sandbox { id: info.id }
    }

    async fn agent(&self) -> AgentClient {
        engine().agent(&self.id).await.expect("agent")
    }

    async fn pid(&self) -> u32 {
        engine().get(&self.id).await.unwrap().pid.unwrap()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let id = self.id.clone();
        std::thread::spawn(move || {
            let _ = shoal_testkit::runtime().block_on(engine().kill(&id));
        })
        .join()
        .ok();
    }
}

fn netns_of(pid: u32) -> std::path::PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap()
}

#[test]
fn each_sandbox_has_its_own_namespace_and_the_same_guest_address() {
    block_on(async {
        let a = Sandbox::create(true).await;
        let b = Sandbox::create(true).await;
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
        let open = Sandbox::create(true).await;
        let (code, out) = guest_connect(&open.agent().await, OUTSIDE_IP, OUTSIDE_PORT).await;
        assert_eq!(code, 0, "{out}");
        // Masqueraded twice: the outside sees the host's address on its link.
        assert_eq!(out, format!("outside {OUTSIDE_HOST_IP}"));

        let closed = Sandbox::create(false).await;
        let (code, out) = guest_connect(&closed.agent().await, OUTSIDE_IP, OUTSIDE_PORT).await;
        assert_ne!(
            code, 0,
            "allow_internet false still reached the outside: {out}"
        );

        // A fork child keeps its parent's choice, in a namespace of its own.
        let fork = engine().fork(&closed.id, 1).await.expect("fork");
        let child = Sandbox {
            id: fork.children[0].id.clone(),
        };
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
        let open = Sandbox::create(true).await;
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

        let closed = Sandbox::create(false).await;
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

        let server = Sandbox::create(true).await;
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

        let client = Sandbox::create(true).await;
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
        let sandbox = Sandbox::create_from(FULL_PYTHON, false).await;
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
        let sandbox = Sandbox::create(true).await;
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
