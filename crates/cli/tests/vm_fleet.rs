//! The fleet on one machine: three hosts as three network namespaces with
//! addresses of their own on a bridge, each running `shoal agent`; one
//! PostgreSQL; one `shoal server` on the bridge's host side. Everything the
//! issue asks of a fleet, against real VMs:
//!
//! - 30 creates through the front spread over the three hosts, none holding
//!   more than 15; requests about a sandbox reach its host, and a fork goes
//!   to its parent's host;
//! - `kill -9` of one agent: its sandboxes are `lost` within 40 s, a fork of
//!   one is refused (503 `sandbox host unavailable`, Retry-After 15), new
//!   creates go to the other two, and no row of theirs changes;
//! - with every host full, a create is a 503 with Retry-After, and the
//!   `pandastack` SDK's own retry succeeds once a sandbox is deleted;
//! - trust: each host joins with a one-time token; a heartbeat for another
//!   host's id is 403; a second agent under a live name is refused; a
//!   tenant request straight to an agent is 401; a sandbox reaches no
//!   agent port and not PostgreSQL; `shoal host revoke` makes the host's
//!   sandboxes `lost`, refuses its next heartbeat, and its VMs go; the
//!   database URL a host is handed logs in as a role of its own, which
//!   cannot read the token table nor write another host's sandbox;
//! - all of it over HTTPS (front and agents, certificates made by the test,
//!   the CA pinned by the front, the agents, the test and the SDK).
//!
//! Needs PostgreSQL (`scripts/with-postgres`); the agents in their
//! namespaces reach it through a relay the test runs on the bridge address.
//! Every process, namespace and link is the test's own and is removed by
//! it.

use serde_json::{json, Value};
use shoal_testkit::ApiClient;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const HOSTS: usize = 3;
/// Slots per host: 30 creates fit in three hosts, and two hosts fill up.
const SLOTS: usize = 14;
const FLEET_TOKEN: &str = "fleet-test-token-0123456789";

fn run(args: &[&str]) {
    let status = Command::new(args[0]).args(&args[1..]).status().unwrap();
    assert!(status.success(), "{args:?} failed");
}

/// The namespaces, the bridge and the veths, removed on drop.
struct Network {
    bridge: String,
    namespaces: Vec<String>,
    /// `10.<a>.<b>`: the /24 of this run.
    prefix: String,
}

impl Network {
    fn new() -> Network {
        let tag = std::process::id() % 100_000;
        let prefix = format!("10.{}.{}", 180 + tag % 50, tag % 250);
        let bridge = format!("sfbr{tag}");
        run(&["ip", "link", "add", &bridge, "type", "bridge"]);
        let mut network = Network {
            bridge: bridge.clone(),
            namespaces: Vec::new(),
            prefix: prefix.clone(),
        };
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{prefix}.1/24"),
            "dev",
            &bridge,
        ]);
        run(&["ip", "link", "set", &bridge, "up"]);
        for n in 0..HOSTS {
            let ns = format!("sf{tag}h{n}");
            run(&["ip", "netns", "add", &ns]);
            network.namespaces.push(ns.clone());
            let outside = format!("sf{tag}v{n}");
            run(&[
                "ip", "link", "add", &outside, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            run(&["ip", "link", "set", &outside, "master", &bridge]);
            run(&["ip", "link", "set", &outside, "up"]);
            let inside = |args: &[&str]| {
                let mut all = vec!["ip", "netns", "exec", &ns];
                all.extend_from_slice(args);
                run(&all);
            };
            inside(&[
                "ip",
                "addr",
                "add",
                &format!("{}/24", network.host_address(n)),
                "dev",
                "eth0",
            ]);
            inside(&["ip", "link", "set", "eth0", "up"]);
            inside(&["ip", "link", "set", "lo", "up"]);
        }
        network
    }

    fn gateway(&self) -> String {
        format!("{}.1", self.prefix)
    }

    fn host_address(&self, n: usize) -> String {
        format!("{}.{}", self.prefix, 10 + n)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "delete", &self.bridge])
            .status();
    }
}

/// Relays TCP connections from the bridge to PostgreSQL on 127.0.0.1: the
/// agents in their namespaces cannot reach the host's loopback.
async fn relay(listen: &str, to: String) -> u16 {
    let listener = tokio::net::TcpListener::bind((listen, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                continue;
            };
            let to = to.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    port
}

/// `postgres://user@host:port/db` → (`host:port`, the URL with another
/// host and port).
fn rehost(url: &str, host: &str, port: u16) -> (String, String) {
    let rest = url.strip_prefix("postgres://").unwrap();
    let (user, rest) = rest.split_once('@').unwrap();
    let (address, path) = rest.split_once('/').unwrap();
    (
        address.to_owned(),
        format!("postgres://{user}@{host}:{port}/{path}"),
    )
}

/// The front's API client, answers as (status, Retry-After, JSON).
struct Api(ApiClient);

impl Api {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Option<String>, Value) {
        let answer = self.0.call(method, path, body).await;
        (answer.status.as_u16(), answer.retry_after, answer.json)
    }

    async fn create(&self) -> (u16, Option<String>, Value) {
        self.call(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "code-interpreter", "ttl_seconds": 3600})),
        )
        .await
    }
}

/// The host of each sandbox, from the database.
async fn homes(store: &shoal_store::Store, ids: &[String]) -> BTreeMap<String, String> {
    let mut homes = BTreeMap::new();
    for id in ids {
        let row = store.sandbox_by_id(id).await.unwrap().unwrap();
        homes.insert(id.clone(), row.host.unwrap_or_default());
    }
    homes
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn per_host(homes: &BTreeMap<String, String>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for host in homes.values() {
        *counts.entry(host.clone()).or_default() += 1;
    }
    counts
}

#[test]
fn three_hosts_spread_lose_one_and_fill_up() {
    shoal_testkit::block_on(async {
        let Some(db) = shoal_testkit::TestDb::postgres().await else {
            return;
        };
        let network = Network::new();
        let work = shoal_testkit::state_dir("vm_fleet");
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).unwrap();
        let shoal = env!("CARGO_BIN_EXE_shoal");

        let gateway = network.gateway();
        let (pg_address, _) = rehost(&db.url, "x", 0);
        let relay_port = relay(&gateway, pg_address).await;
        let (_, agent_db) = rehost(&db.url, &gateway, relay_port);

        // The schema exists before anyone reads it.
        let store = shoal_store::Store::connect(&db.url).await.unwrap();
        // Everything crossing the bridge is HTTPS under the test's own CA.
        let ca = shoal_testkit::tls::TestCa::new(&work.join("tls"));
        let front_tls = ca.issue("front", &[&gateway]);
        let front_port = shoal_testkit::free_port();
        let front_url = format!("https://{gateway}:{front_port}");
        let _front = shoal_testkit::Process::spawn(
            Command::new(shoal)
                .args([
                    "server",
                    "--database-url",
                    &db.url,
                    "--fleet-token",
                    FLEET_TOKEN,
                ])
                .args(["--listen", &format!("{gateway}:{front_port}")])
                .args(["--agent-database-url", &agent_db])
                .arg("--tls-cert")
                .arg(&front_tls.cert)
                .arg("--tls-key")
                .arg(&front_tls.key)
                .arg("--agent-ca")
                .arg(ca.pem()),
            &work.join("server.log"),
        );
        let mut join_tokens = Vec::new();
        for _ in 0..HOSTS {
            join_tokens.push(store.create_join_token(now(), 3600.0).await.unwrap());
        }
        let mut agents: Vec<shoal_testkit::Process> = (0..HOSTS)
            .map(|n| {
                let state = work.join(format!("host-{n}"));
                let tls = ca.issue(&format!("host-{n}"), &[&network.host_address(n)]);
                shoal_testkit::Process::spawn(
                    Command::new("ip")
                        .args(["netns", "exec", &network.namespaces[n], shoal, "agent"])
                        .args([
                            "--control-plane",
                            &front_url,
                            "--join-token",
                            &join_tokens[n],
                        ])
                        .args(["--listen", &format!("{}:8081", network.host_address(n))])
                        .args(["--name", &format!("host-{n}")])
                        .arg("--ca-file")
                        .arg(ca.pem())
                        .arg("--tls-cert")
                        .arg(&tls.cert)
                        .arg("--tls-key")
                        .arg(&tls.key)
                        .arg("--state-dir")
                        .arg(&state)
                        .arg("--cache-dir")
                        .arg(shoal_testkit::cache_dir())
                        .arg("--guest-agent")
                        .arg(shoal_testkit::guest_agent())
                        .args([
                            "--max-sandboxes",
                            &SLOTS.to_string(),
                            "--memory-reserve-mib",
                            "0",
                        ]),
                    &work.join(format!("agent-{n}.log")),
                )
            })
            .collect();

        let http = shoal_fleet::tls::client(Some(&ca.pem())).unwrap();
        let live_hosts = || {
            let http = http.clone();
            let url = format!("{front_url}/v1/fleet/hosts");
            async move {
                let Ok(answer) = http.get(&url).bearer_auth(FLEET_TOKEN).send().await else {
                    return Vec::new();
                };
                let hosts: Value = answer.json().await.unwrap_or(Value::Null);
                hosts["hosts"]
                    .as_array()
                    .map(|hosts| {
                        hosts
                            .iter()
                            .filter(|h| h["live"] == true)
                            .map(|h| h["id"].as_str().unwrap().to_owned())
                            .collect()
                    })
                    .unwrap_or_default()
            }
        };
        let all_up = shoal_testkit::wait_until(Duration::from_secs(300), || async {
            live_hosts().await.len() == HOSTS
        })
        .await;
        assert!(
            all_up,
            "the three agents did not register; see {}",
            work.display()
        );

        let token = shoal_testkit::api_token(Path::new(shoal), &db.url, "fleet", None);
        let api = Api(ApiClient {
            http: http.clone(),
            base: front_url.clone(),
            token: token.clone(),
        });

        // Trust: tenants reach agents only through a front.
        let agent_url = |n: usize| format!("https://{}:8081", network.host_address(n));
        // The certificates are real: a client without the fleet's CA is
        // refused, and plain HTTP gets no API.
        let stranger = reqwest::Client::new();
        assert!(stranger
            .get(format!("{front_url}/healthz"))
            .send()
            .await
            .is_err());
        let plain = stranger
            .get(format!("http://{gateway}:{front_port}/healthz"))
            .send()
            .await;
        assert!(plain.is_err() || !plain.unwrap().status().is_success());
        let straight = http
            .get(format!("{}/v1/sandboxes", agent_url(1)))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(
            straight.status(),
            401,
            "a tenant request straight to an agent"
        );
        let health = http
            .get(format!("{}/healthz", agent_url(1)))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        // A host speaks only for itself, with its own credential.
        let credential: Value =
            serde_json::from_slice(&std::fs::read(work.join("host-1/fleet-host.json")).unwrap())
                .unwrap();
        let host_secret = credential["host_secret"].as_str().unwrap().to_owned();
        let heartbeat = |bearer: String, id: &str| {
            let http = http.clone();
            let url = format!("{front_url}/v1/fleet/heartbeat");
            let report = json!({
                "id": id, "url": "http://203.0.113.9:8081", "vcpus": 64, "cpu_busy": 0.0,
                "memory_mib": 1 << 20, "available_mib": 1 << 20, "reserve_mib": 0,
                "sandboxes": 0, "max_sandboxes": null, "pss_mib": 0, "draining": false,
            });
            async move {
                let answer = http
                    .post(url)
                    .bearer_auth(bearer)
                    .json(&report)
                    .send()
                    .await
                    .unwrap();
                answer.status().as_u16()
            }
        };
        assert_eq!(
            heartbeat(host_secret.clone(), "host-2").await,
            403,
            "a forged heartbeat"
        );
        assert_eq!(
            heartbeat(FLEET_TOKEN.into(), "host-2").await,
            401,
            "the fronts' secret is no host credential"
        );
        assert_eq!(
            heartbeat(join_tokens[2].clone(), "host-2").await,
            401,
            "a spent join token"
        );
        let hosts = store.hosts(now()).await.unwrap();
        let host_2 = hosts.iter().find(|h| h.report.id == "host-2").unwrap();
        assert_eq!(host_2.report.url, agent_url(2), "host-2's row is its own");
        // A second agent under a live name is refused before it opens anything.
        let second_token = store.create_join_token(now(), 3600.0).await.unwrap();
        let second = Command::new(shoal)
            .args([
                "agent",
                "--control-plane",
                &front_url,
                "--join-token",
                &second_token,
            ])
            .args(["--name", "host-1", "--listen", "127.0.0.1:0"])
            .arg("--ca-file")
            .arg(ca.pem())
            .arg("--state-dir")
            .arg(work.join("impostor"))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&second.stderr);
        assert!(
            !second.status.success() && said.contains("already called host-1"),
            "{said}"
        );

        // 30 creates, six at a time.
        let mut ids = Vec::new();
        for _ in 0..5 {
            let batch = futures::future::join_all((0..6).map(|_| api.create())).await;
            for (status, _, body) in batch {
                assert_eq!(status, 201, "{body}");
                ids.push(body["id"].as_str().unwrap().to_owned());
            }
        }
        let placed = homes(&store, &ids).await;
        let spread = per_host(&placed);
        eprintln!("FIGURE 30 creates over three hosts: {spread:?}");
        assert_eq!(spread.len(), HOSTS, "{spread:?}");
        assert!(spread.values().all(|&n| n <= 15), "{spread:?}");
        // A host holds no database credential of the fronts': the one it
        // is handed logs in as its own role, which reads no token and
        // writes no other host's row.
        let config: Value = http
            .get(format!("{front_url}/v1/fleet/config"))
            .bearer_auth(&host_secret)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let host_db = config["database_url"].as_str().unwrap();
        assert!(
            host_db.starts_with("postgres://shoal_host_") && !host_db.contains(FLEET_TOKEN),
            "{host_db}"
        );
        let as_host_1 = shoal_store::Store::connect_as_host(host_db).await.unwrap();
        let read_tokens = as_host_1.authenticate(&token).await;
        assert!(
            read_tokens.is_err(),
            "host-1's database role read the token table: {read_tokens:?}"
        );
        let (elsewhere, _) = placed.iter().find(|(_, h)| *h != "host-1").unwrap();
        let closed = shoal_store::SandboxPatch {
            status: Some("deleted".into()),
            ..Default::default()
        };
        assert!(
            !as_host_1.update_sandbox(elsewhere, closed).await.unwrap(),
            "host-1's role wrote another host's sandbox"
        );
        assert_eq!(
            store
                .sandbox_by_id(elsewhere)
                .await
                .unwrap()
                .unwrap()
                .status,
            "running"
        );
        as_host_1.close().await;
        // Requests about a sandbox reach its host.
        let (status, _, answer) = api
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{}/exec", ids[0]),
                Some(json!({"cmd": "hostname"})),
            )
            .await;
        assert_eq!(
            (status, answer["stdout"].as_str()),
            (200, Some(&*format!("{}\n", ids[0])))
        );

        // A fork goes to its parent's host.
        let (status, _, child) = api
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{}/fork", ids[0]),
                None,
            )
            .await;
        assert_eq!(status, 201, "{child}");
        let child = child["id"].as_str().unwrap().to_owned();
        let child_home = homes(&store, std::slice::from_ref(&child)).await;
        assert_eq!(
            child_home.get(&child),
            placed.get(&ids[0]),
            "{child_home:?}"
        );
        let (status, _, _) = api
            .call(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{child}"),
                None,
            )
            .await;
        assert_eq!(status, 204);

        // A sandbox reaches no agent (its own host's included) and not the
        // database, with egress to the internet allowed.
        let prober = &ids[0];
        let targets: Vec<String> = (0..HOSTS)
            .map(|n| format!("{}:8081", network.host_address(n)))
            .chain([
                format!("{gateway}:{relay_port}"),
                format!("{gateway}:{front_port}"),
            ])
            .collect();
        let probe = format!(
            "import socket\nfor t in {targets:?}:\n    h, p = t.rsplit(':', 1)\n    s = socket.socket(); s.settimeout(2)\n    try:\n        s.connect((h, int(p))); print(t, 'open')\n    except OSError as e:\n        print(t, 'closed', type(e).__name__)\n"
        );
        let (status, _, answer) = api
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{prober}/exec"),
                Some(json!({"cmd": format!("python3 -c \"{}\"", probe.replace('"', "\\\"")), "timeout_seconds": 60})),
            )
            .await;
        let printed = answer["stdout"].as_str().unwrap_or_default().to_owned();
        eprintln!(
            "FIGURE reachability from a sandbox on {}: {printed}",
            placed[prober]
        );
        assert_eq!(status, 200, "{answer}");
        assert_eq!(printed.lines().count(), targets.len(), "{answer}");
        assert!(printed.lines().all(|l| l.contains("closed")), "{printed}");

        // kill -9 of host-0's agent.
        let victim = "host-0";
        let lost_ids: Vec<String> = placed
            .iter()
            .filter(|(_, h)| *h == victim)
            .map(|(id, _)| id.clone())
            .collect();
        let survivors: Vec<String> = placed
            .iter()
            .filter(|(_, h)| *h != victim)
            .map(|(id, _)| id.clone())
            .collect();
        // Agents write activity out every 5 s (and an exec's end just after
        // its answer): take the picture once what the creates and the exec
        // did has landed, that is once no survivor's row has changed for
        // longer than one flush and no exec is in flight. A fixed wait
        // would break on a flush that comes late.
        const SETTLED: Duration = Duration::from_secs(6);
        let rows = |ids: Vec<String>| {
            let store = &store;
            async move {
                let mut rows = Vec::new();
                for id in &ids {
                    rows.push(store.sandbox_by_id(id).await.unwrap().unwrap());
                }
                rows
            }
        };
        let last_seen = std::cell::RefCell::new((Vec::new(), Instant::now()));
        let settled = shoal_testkit::wait_until(Duration::from_secs(60), || {
            let (last_seen, current) = (&last_seen, rows(survivors.clone()));
            async move {
                // A few reads a second are enough, and spare the database.
                tokio::time::sleep(Duration::from_millis(250)).await;
                let current = current.await;
                let mut last_seen = last_seen.borrow_mut();
                if current != last_seen.0 || current.iter().any(|r| r.running_execs != 0) {
                    *last_seen = (current, Instant::now());
                    return false;
                }
                last_seen.1.elapsed() > SETTLED
            }
        })
        .await;
        let before = last_seen.into_inner().0;
        assert!(
            settled,
            "the survivors' rows did not settle within 60 s: {before:?}"
        );
        agents[0].signal(shoal_testkit::SIGKILL);
        let killed = Instant::now();
        let all_lost = shoal_testkit::wait_until(Duration::from_secs(40), || async {
            for id in &lost_ids {
                let row = store.sandbox_by_id(id).await.unwrap().unwrap();
                if row.status != "lost" {
                    return false;
                }
            }
            true
        })
        .await;
        eprintln!("FIGURE lost after {:.1} s", killed.elapsed().as_secs_f64());
        assert!(
            all_lost,
            "host-0's sandboxes were not marked lost within 40 s"
        );
        let (status, retry_after, answer) = api
            .call(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{}/fork", lost_ids[0]),
                None,
            )
            .await;
        assert_eq!(
            (status, retry_after.as_deref(), answer["error"].as_str()),
            (503, Some("15"), Some("sandbox host unavailable"))
        );
        let (status, _, answer) = api
            .call(
                reqwest::Method::GET,
                &format!("/v1/sandboxes/{}", lost_ids[0]),
                None,
            )
            .await;
        assert_eq!(
            (status, answer["status"].as_str()),
            (200, Some("lost")),
            "{answer}"
        );
        let mut fresh = Vec::new();
        for _ in 0..4 {
            let (status, _, body) = api.create().await;
            assert_eq!(status, 201, "{body}");
            fresh.push(body["id"].as_str().unwrap().to_owned());
        }
        let fresh_homes = homes(&store, &fresh).await;
        assert!(fresh_homes.values().all(|h| h != victim), "{fresh_homes:?}");
        for (id, row) in survivors.iter().zip(&before) {
            let now = store.sandbox_by_id(id).await.unwrap().unwrap();
            assert_eq!(&now, row, "a survivor's row changed");
        }

        // Fill the two live hosts, then one more create is refused.
        let mut filled = fresh.clone();
        loop {
            let (status, retry_after, body) = api.create().await;
            if status == 503 {
                assert_eq!(retry_after.as_deref(), Some("5"), "{body}");
                assert_eq!(body["error"], "no compute capacity available");
                break;
            }
            assert_eq!(status, 201, "{body}");
            filled.push(body["id"].as_str().unwrap().to_owned());
            assert!(filled.len() <= 2 * SLOTS, "the hosts never filled");
        }
        // The SDK's own retry: it waits on the 503 until a delete frees a slot
        // and the next heartbeat shows it.
        let python = {
            let out = Command::new(shoal_testkit::workspace_root().join("tests/sdk/venv"))
                .stderr(Stdio::inherit())
                .output()
                .unwrap();
            assert!(out.status.success());
            PathBuf::from(
                String::from_utf8(out.stdout)
                    .unwrap()
                    .trim()
                    .lines()
                    .last()
                    .unwrap(),
            )
        };
        let mut sdk = Command::new(python)
            .args(["-c", SDK_RETRY])
            .env("PANDASTACK_API", &front_url)
            .env("REQUESTS_CA_BUNDLE", ca.pem())
            .env("PANDASTACK_API_KEY", &token)
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            sdk.try_wait().unwrap().is_none(),
            "the SDK's create should still be waiting"
        );
        let victim_sandbox = survivors[0].clone();
        let (status, _, _) = api
            .call(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{victim_sandbox}"),
                None,
            )
            .await;
        assert_eq!(status, 204);
        let output = tokio::task::spawn_blocking(move || sdk.wait_with_output().unwrap())
            .await
            .unwrap();
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{printed}");
        let report: Value = serde_json::from_str(printed.trim()).unwrap();
        assert!(report["retries"].as_u64().unwrap() >= 1, "{report}");
        assert!(
            report["statuses"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s == 503),
            "{report}"
        );
        eprintln!("FIGURE sdk retry: {report}");

        // Revoking host-1: its sandboxes are lost at once, its next
        // heartbeat is refused, and its agent stops their VMs.
        let on_host_1: Vec<String> = homes(&store, &filled)
            .await
            .into_iter()
            .filter(|(_, h)| h == "host-1")
            .map(|(id, _)| id)
            .collect();
        assert!(!on_host_1.is_empty());
        let revoked = Command::new(shoal)
            .args(["host", "revoke", "host-1", "--database-url", &db.url])
            .output()
            .unwrap();
        assert!(
            revoked.status.success(),
            "{}",
            String::from_utf8_lossy(&revoked.stderr)
        );
        for id in &on_host_1 {
            let row = store.sandbox_by_id(id).await.unwrap().unwrap();
            assert_eq!(row.status, "lost", "{id}");
        }
        // QEMU's command line names files under the state dir; the agent's
        // names the dir itself.
        let host_1_dir = format!("{}/", work.join("host-1").display());
        let vms_gone = shoal_testkit::wait_until(Duration::from_secs(30), || async {
            shoal_testkit::processes_mentioning(&host_1_dir).is_empty()
        })
        .await;
        assert!(
            vms_gone,
            "host-1's agent did not stop the VMs of its lost sandboxes"
        );
        let refused = shoal_testkit::wait_until(Duration::from_secs(25), || async {
            std::fs::read_to_string(work.join("agent-1.log"))
                .is_ok_and(|log| log.contains("unknown or revoked host credential"))
        })
        .await;
        assert!(refused, "host-1's next heartbeat was not refused");
        assert!(!live_hosts().await.contains(&"host-1".to_string()));

        for agent in agents.iter_mut().skip(1) {
            agent.signal(shoal_testkit::SIGTERM);
        }
        // host-0's VMs outlived its agent: they are the test's to stop.
        for pid in shoal_testkit::processes_mentioning(&work.join("host-0").display().to_string()) {
            shoal_testkit::signal_pid(pid, shoal_testkit::SIGKILL);
        }
        drop(agents);
        store.close().await;
        db.cleanup().await;
        drop(network);
        let _ = std::fs::remove_dir_all(&work);
    });
}

/// Creates one sandbox with the SDK's default capacity retry and prints
/// how many retries it took.
const SDK_RETRY: &str = r#"
import json, os
from pandastack import Client
retries = []
client = Client(api_url=os.environ["PANDASTACK_API"], api_key=os.environ["PANDASTACK_API_KEY"],
                max_create_retry_seconds=90, on_create_retry=retries.append)
sandbox = client.sandboxes.create(template="code-interpreter")
assert sandbox.exec("echo ok").stdout == "ok\n"
print(json.dumps({"id": sandbox.id, "retries": len(retries), "statuses": [r.status_code for r in retries]}))
sandbox.kill()
"#;
