//! The operator's database commands through the real binary on a throwaway
//! SQLite database: tokens made, listed (never the secret) and revoked by
//! prefix; an account's tier changed; refusals for unknown accounts,
//! prefixes and tiers; a fleet host listed, drained and resumed. (`shoal
//! sandbox kill` and `shoal snapshot rm` on a live host are held by
//! `vm_restarts`.)

use std::process::Command;

fn shoal(db: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(args)
        .args(["--database-url", db])
        .env_remove("SHOAL_CONFIG")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn tokens_and_tiers_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("shoal.db").display());
    let (ok, token, err) = shoal(
        &db,
        &["token", "create", "--account", "ada", "--tier", "pro"],
    );
    assert!(ok, "{err}");
    let token = token.trim().to_string();
    let (ok, listed, err) = shoal(&db, &["token", "list", "--account", "ada"]);
    assert!(ok, "{err}");
    let prefix = &token[..11];
    assert!(listed.contains(prefix), "{listed}");
    assert!(
        !listed.contains(&token),
        "a list showed the secret: {listed}"
    );
    let (ok, _, err) = shoal(&db, &["token", "list", "--account", "nobody"]);
    assert!(!ok && err.contains("no account nobody"), "{err}");

    let (ok, _, err) = shoal(&db, &["account", "set-tier", "ada", "team"]);
    assert!(ok, "{err}");
    let (ok, _, err) = shoal(&db, &["account", "set-tier", "ada", "gold"]);
    assert!(!ok && err.contains("free, pro or team"), "{err}");
    let (ok, _, err) = shoal(&db, &["account", "set-tier", "nobody", "free"]);
    assert!(!ok && err.contains("no account nobody"), "{err}");
    let tier = shoal_testkit::block_on(async {
        let store = shoal_store::Store::connect(&db).await.unwrap();
        let account = store
            .authenticate(&token)
            .await
            .unwrap()
            .expect("the token works");
        store.close().await;
        account.tier
    });
    assert_eq!(tier, shoal_store::Tier::Team);

    let (ok, _, err) = shoal(&db, &["token", "revoke", "--account", "ada", "sk_nothing"]);
    assert!(!ok && err.contains("has no token"), "{err}");
    let (ok, _, err) = shoal(&db, &["token", "revoke", "--account", "ada", prefix]);
    assert!(ok, "{err}");
    let still = shoal_testkit::block_on(async {
        let store = shoal_store::Store::connect(&db).await.unwrap();
        let still = store.authenticate(&token).await.unwrap();
        store.close().await;
        still
    });
    assert!(still.is_none(), "a revoked token still authenticates");

    let (ok, listed, err) = shoal(&db, &["sandbox", "list"]);
    assert!(ok, "{err}");
    assert_eq!(listed.lines().count(), 1, "only the header: {listed}");
    let (ok, _, err) = shoal(&db, &["sandbox", "kill", "sb-000000000000"]);
    assert!(
        !ok && err.contains("no live sandbox sb-000000000000"),
        "{err}"
    );
}

/// Completion scripts and manual pages come from the same command tree.
#[test]
fn completions_and_manual_pages() {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(
        script.contains("_shoal()") && script.contains("--state-dir"),
        "{script}"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("man")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let up = std::fs::read_to_string(dir.path().join("shoal-up.1")).unwrap();
    assert!(
        up.contains(".TH shoal-up") && up.contains("reap\\-interval"),
        "{up}"
    );
    assert!(dir.path().join("shoal-token-revoke.1").exists());
    assert!(!dir.path().join("shoal-help.1").exists());
}

#[test]
fn hosts_are_listed_drained_and_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("shoal.db").display());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    runtime.block_on(async {
        let store = shoal_store::Store::connect(&db).await.unwrap();
        for (id, heard) in [("edge-1", now), ("edge-2", now - 3600.0)] {
            let report = shoal_store::HostReport {
                id: id.into(),
                url: format!("https://{id}:8081"),
                vcpus: 8,
                cpu_busy: 0.0,
                memory_mib: 32_000,
                available_mib: 30_000,
                reserve_mib: 1_024,
                sandboxes: 2,
                max_sandboxes: None,
                pss_mib: 0,
                draining: false,
            };
            store.report_host(&report, heard).await.unwrap();
        }
        store.close().await;
    });
    let state_of = |listed: &str, host: &str| {
        listed
            .lines()
            .find(|l| l.starts_with(host))
            .and_then(|l| l.split_whitespace().nth(2))
            .map(str::to_owned)
    };
    let (ok, listed, err) = shoal(&db, &["host", "list"]);
    assert!(ok, "{err}");
    assert_eq!(
        state_of(&listed, "edge-1").as_deref(),
        Some("up"),
        "{listed}"
    );
    assert_eq!(
        state_of(&listed, "edge-2").as_deref(),
        Some("silent"),
        "{listed}"
    );
    let (ok, _, err) = shoal(&db, &["host", "drain", "edge-1"]);
    assert!(ok, "{err}");
    let (_, listed, _) = shoal(&db, &["host", "list"]);
    assert_eq!(
        state_of(&listed, "edge-1").as_deref(),
        Some("drained"),
        "{listed}"
    );
    let (ok, _, err) = shoal(&db, &["host", "resume", "edge-1"]);
    assert!(ok, "{err}");
    let (_, listed, _) = shoal(&db, &["host", "list"]);
    assert_eq!(
        state_of(&listed, "edge-1").as_deref(),
        Some("up"),
        "{listed}"
    );
    let (ok, _, err) = shoal(&db, &["host", "drain", "nowhere"]);
    assert!(!ok);
    assert!(err.contains("no host nowhere"), "{err}");
}
