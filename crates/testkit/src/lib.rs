//! The harness every real-VM test shares.
//!
//! Owns: one tokio runtime per test binary (engine tasks must outlive any
//! single test), one engine per test binary on a fixed state directory (so a
//! crashed run's leftovers are reaped by the next), the guest agent build,
//! templates built once into the shared cache, `wait_until`, and leak
//! checks, throwaway databases (SQLite, or PostgreSQL from
//! `SHOAL_TEST_DATABASE_URL`), API tokens, and the processes a test starts
//! (a real `shoal up` among them: [`process`]). Holds no assertions about
//! product behaviour: tests do.

mod api;
mod host;
mod local_agent;
pub mod process;
mod sandbox;
pub mod tls;

pub use api::{Answer, ApiClient};
pub use host::host_agent;
pub use local_agent::LocalAgent;
pub use process::{alive, free_port, signal_pid, Process, ShoalUp, UpConfig, SIGKILL, SIGTERM};
pub use sandbox::Sandbox;

use shoal_engine::{Engine, EngineConfig};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The runtime all of a binary's tests run on.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// Runs a test body on the shared runtime.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    runtime().block_on(future)
}

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/testkit sits two levels below the root")
        .to_path_buf()
}

/// Where templates are cached across runs: `SHOAL_CACHE_DIR`, or the
/// product's own default so a test run and `shoal up` share one bake.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SHOAL_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/shoal"))
}

/// The guest agent the tests bake into templates: `SHOAL_GUEST_AGENT` when
/// set, else the static release build (`scripts/build-agent`), built once
/// per test binary.
///
/// `scripts/test` sets `SHOAL_GUEST_AGENT` to the agent it baked before the
/// suites ran. Building here instead would give another binary:
/// `cargo build -p shoal-guest-agent` resolves the agent's dependency
/// features without the workspace's dev-dependencies, so every CI run baked
/// both templates a second time, in the middle of the first test.
pub fn guest_agent() -> &'static Path {
    static AGENT: OnceLock<PathBuf> = OnceLock::new();
    AGENT.get_or_init(|| {
        if let Some(given) = std::env::var_os("SHOAL_GUEST_AGENT") {
            let given = PathBuf::from(given);
            assert!(
                given.is_file(),
                "SHOAL_GUEST_AGENT names no file: {}",
                given.display()
            );
            return given;
        }
        let root = workspace_root();
        let output = std::process::Command::new(root.join("scripts/build-agent"))
            .current_dir(&root)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("running scripts/build-agent");
        assert!(output.status.success(), "building the guest agent failed");
        PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
    })
}

/// A state directory of this test binary's own, fixed across runs.
pub fn state_dir(binary: &str) -> PathBuf {
    std::env::temp_dir().join("shoal-tests").join(binary)
}

/// The engine of this test binary, with `templates` built (once) first.
pub fn engine(binary: &str, templates: &[&str]) -> &'static Engine {
    engine_with(binary, templates, |_| {})
}

/// [`engine`], with `configure` applied to its configuration first (the
/// first call's `configure` wins: there is one engine per test binary).
pub fn engine_with(
    binary: &str,
    templates: &[&str],
    configure: impl FnOnce(&mut EngineConfig) + Send + 'static,
) -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    let binary = binary.to_string();
    let templates: Vec<String> = templates.iter().map(|t| t.to_string()).collect();
    // Initialised on a thread of its own: callers are usually inside
    // `block_on` already, and a runtime cannot be entered twice.
    ENGINE.get_or_init(move || {
        std::thread::spawn(move || {
            block_on(async {
                let mut config = EngineConfig::new(state_dir(&binary));
                config.cache_dir = cache_dir();
                configure(&mut config);
                let engine = Engine::open(config).await.expect("opening the engine");
                let progress = indicatif::MultiProgress::with_draw_target(
                    indicatif::ProgressDrawTarget::stderr(),
                );
                for name in &templates {
                    engine
                        .build_template(name, guest_agent(), &progress)
                        .await
                        .unwrap_or_else(|e| {
                            panic!(
                                "building template {name}: {}",
                                shoal_engine::error::chain(&e)
                            )
                        });
                }
                engine
            })
        })
        .join()
        .expect("engine set-up panicked")
    })
}

/// Polls `condition` until it holds or `timeout` passes; returns whether it held.
pub async fn wait_until<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pids of live processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != std::process::id())
        .filter(|&pid| alive(pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// A new team-tier API token for `account`, made by `shoal token create`
/// (`shoal` is the binary under test) on `database_url`.
pub fn api_token(shoal: &Path, database_url: &str, account: &str, state: Option<&Path>) -> String {
    api_token_of_tier(shoal, database_url, account, "team", state)
}

/// [`api_token`] for an account of `tier` (free, pro or team).
pub fn api_token_of_tier(
    shoal: &Path,
    database_url: &str,
    account: &str,
    tier: &str,
    state: Option<&Path>,
) -> String {
    let mut command = std::process::Command::new(shoal);
    command
        .args(["token", "create", "--account", account, "--tier", tier])
        .args(["--database-url", database_url]);
    if let Some(state) = state {
        command.arg("--state-dir").arg(state);
    }
    let out = command.output().expect("running shoal token create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .lines()
        .last()
        .unwrap()
        .to_owned()
}

/// Everything under `dir` (recursively), as paths relative to it.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path.clone());
            }
            out.push(path.strip_prefix(dir).unwrap_or(&path).to_path_buf());
        }
    }
    out.sort();
    out
}

/// A database of one test's own: an SQLite file in a fresh directory, or a
/// fresh database on the PostgreSQL server `SHOAL_TEST_DATABASE_URL` names.
pub struct TestDb {
    /// What `Store::connect` takes.
    pub url: String,
    kind: DbKind,
}

enum DbKind {
    Sqlite { dir: PathBuf },
    Postgres { admin_url: String, name: String },
}

fn random_name() -> String {
    format!("{}_{:016x}", std::process::id(), rand::random::<u64>())
}

impl TestDb {
    pub async fn sqlite() -> TestDb {
        let dir = std::env::temp_dir().join(format!("shoal-testdb-{}", random_name()));
        std::fs::create_dir_all(&dir).expect("creating the database directory");
        TestDb {
            url: format!("sqlite:{}", dir.join("shoal.db").display()),
            kind: DbKind::Sqlite { dir },
        }
    }

    /// None when `SHOAL_TEST_DATABASE_URL` is not set, outside CI; under CI
    /// (`CI` set) that is a failure: the PostgreSQL variants must run there.
    pub async fn postgres() -> Option<TestDb> {
        use sqlx::{Connection, Executor};
        let Ok(admin_url) = std::env::var("SHOAL_TEST_DATABASE_URL") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "SHOAL_TEST_DATABASE_URL is not set: under CI the PostgreSQL tests must run (scripts/with-postgres)"
            );
            eprintln!("skipping the PostgreSQL variant: SHOAL_TEST_DATABASE_URL is not set (use scripts/with-postgres)");
            return None;
        };
        let name = format!("shoal_test_{}", random_name());
        let mut admin = sqlx::PgConnection::connect(&admin_url)
            .await
            .expect("connecting to SHOAL_TEST_DATABASE_URL");
        admin
            .execute(&*format!("CREATE DATABASE {name}"))
            .await
            .expect("creating a test database");
        admin.close().await.ok();
        let (base, query) = match admin_url.split_once('?') {
            Some((base, query)) => (base, Some(query)),
            None => (admin_url.as_str(), None),
        };
        let authority = base.find("://").map_or(0, |i| i + 3);
        let server = match base[authority..].find('/') {
            Some(slash) => &base[..authority + slash],
            None => base,
        };
        let url = match query {
            Some(q) => format!("{server}/{name}?{q}"),
            None => format!("{server}/{name}"),
        };
        Some(TestDb {
            url,
            kind: DbKind::Postgres { admin_url, name },
        })
    }

    /// Removes the database (close every store on it first).
    pub async fn cleanup(&self) {
        use sqlx::{Connection, Executor};
        match &self.kind {
            DbKind::Sqlite { dir } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            DbKind::Postgres { admin_url, name } => {
                if let Ok(mut admin) = sqlx::PgConnection::connect(admin_url).await {
                    let _ = admin
                        .execute(&*format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await;
                }
            }
        }
    }
}

/// Which database a test variant runs on (see [`with_database`]).
#[derive(Clone, Copy, Debug)]
pub enum Database {
    Sqlite,
    /// Skipped (with a message) when `SHOAL_TEST_DATABASE_URL` is not set.
    Postgres,
}

/// Runs one variant of a test: `body(database_url, state_dir)` on a fresh
/// `database` and a fresh-named [`state_dir`] (`state`), then removes the
/// database. The variants of a test binary take turns (each wants the
/// cores for its own VMs), even when the harness runs tests in parallel.
pub fn with_database<F, Fut>(database: Database, state: &str, body: F)
where
    F: FnOnce(String, PathBuf) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    block_on(async {
        let db = match database {
            Database::Sqlite => TestDb::sqlite().await,
            Database::Postgres => match TestDb::postgres().await {
                Some(db) => db,
                None => return,
            },
        };
        body(db.url.clone(), state_dir(state)).await;
        db.cleanup().await;
    });
}
