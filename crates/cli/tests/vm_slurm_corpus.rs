//! The corpus of lab scripts (`tests/slurm-corpus`) on a real Slurm and on
//! Shoal: every case leaves the same files in its submit directory, byte
//! for byte, and the same State and ExitCode per task.
//!
//! The real Slurm is `scripts/with-slurm` (Debian's slurm-wlm, one node on
//! this machine, jobs confined to their `--mem` in cgroups); Shoal is a
//! real `shoal up` with real VMs. Both sides run at once, each in its own
//! process group, stopped by id. `tests/slurm-corpus/run` submits and
//! normalises (job ids, slurmstepd's host and time, bash's pids and script
//! path); this test compares.

use shoal_testkit::Database;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every regular file under `root`, by relative path.
fn tree(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() {
                let rel = entry
                    .path()
                    .strip_prefix(root)
                    .unwrap()
                    .display()
                    .to_string();
                files.insert(rel, std::fs::read(entry.path()).unwrap());
            }
        }
    }
    files
}

/// What differs between two files, for the failure message.
fn difference(a: &[u8], b: &[u8]) -> String {
    let (a, b) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let first = la
        .iter()
        .zip(&lb)
        .position(|(x, y)| x != y)
        .unwrap_or(la.len().min(lb.len()));
    let show = |lines: &[&str]| {
        lines
            .iter()
            .skip(first)
            .take(6)
            .copied()
            .collect::<Vec<_>>()
            .join("\n    ")
    };
    format!(
        "{} vs {} bytes; from line {}:\n  slurm:\n    {}\n  shoal:\n    {}",
        a.len(),
        b.len(),
        first + 1,
        show(&la),
        show(&lb)
    )
}

async fn corpus(database_url: &str, state: PathBuf) {
    let _ = std::fs::remove_dir_all(&state);
    std::fs::create_dir_all(&state).unwrap();
    let root = shoal_testkit::workspace_root();
    let run = root.join("tests/slurm-corpus/run");
    let (slurm_out, shoal_out) = (state.join("slurm"), state.join("shoal"));

    // The real Slurm, beside Shoal: its own process group, stopped by id.
    let mut slurm = Command::new(root.join("scripts/with-slurm"))
        .arg(&run)
        .arg("slurm")
        .arg(&slurm_out)
        .env("SLURM_ENFORCE_MEMORY", "1")
        .process_group(0)
        .spawn()
        .expect("starting scripts/with-slurm");
    struct Group(u32);
    impl Drop for Group {
        fn drop(&mut self) {
            // SAFETY: signals the process group this test started.
            unsafe { libc::kill(-(self.0 as i32), libc::SIGTERM) };
        }
    }
    let group = Group(slurm.id());

    std::fs::create_dir_all(state.join("shoal-state")).unwrap();
    let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), state.join("shoal-state"))
        .database_url(database_url)
        .start()
        .await;
    let token = up.token("lab");
    let shoal = tokio::task::spawn_blocking({
        let (run, shoal_out, base) = (run.clone(), shoal_out.clone(), up.base().to_owned());
        let config = state.join("no-config.json");
        move || {
            Command::new(&run)
                .arg("shoal")
                .arg(&shoal_out)
                .env("SHOAL_BIN", env!("CARGO_BIN_EXE_shoal"))
                .env("SHOAL_API", base)
                .env("SHOAL_API_KEY", token)
                .env("SHOAL_SLURM_CONFIG", config)
                .env_remove("SHOAL_PARTITIONS")
                .output()
                .expect("running the corpus on Shoal")
        }
    })
    .await
    .unwrap();
    let slurm_status = tokio::task::spawn_blocking(move || slurm.wait().unwrap())
        .await
        .unwrap();
    drop(group);
    println!("{}", String::from_utf8_lossy(&shoal.stdout));
    assert!(
        shoal.status.success(),
        "the corpus on Shoal: {}",
        String::from_utf8_lossy(&shoal.stderr)
    );
    assert!(slurm_status.success(), "the corpus on Slurm failed");

    let mut differences = Vec::new();
    let mut cases = 0;
    for entry in std::fs::read_dir(&slurm_out).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        cases += 1;
        let (a, b) = (tree(&slurm_out.join(&name)), tree(&shoal_out.join(&name)));
        println!(
            "{name}: {} files; states on Slurm:\n{}",
            a.len(),
            String::from_utf8_lossy(a.get(".states").map_or(&[][..], Vec::as_slice))
        );
        for path in a
            .keys()
            .chain(b.keys())
            .collect::<std::collections::BTreeSet<_>>()
        {
            match (a.get(path), b.get(path)) {
                (Some(x), Some(y)) if x == y => {}
                (Some(x), Some(y)) => {
                    differences.push(format!("{name}/{path}: {}", difference(x, y)))
                }
                (Some(_), None) => differences.push(format!("{name}/{path}: only on Slurm")),
                (None, _) => differences.push(format!("{name}/{path}: only on Shoal")),
            }
        }
    }
    assert!(cases >= 10, "the corpus has {cases} cases");
    assert!(
        differences.is_empty(),
        "{} difference(s):\n{}",
        differences.len(),
        differences.join("\n")
    );
    drop(up);
}

#[test]
fn lab_scripts_leave_the_same_files_and_states_on_slurm_and_shoal() {
    shoal_testkit::with_database(
        Database::Sqlite,
        "vm_slurm_corpus",
        |url, state| async move { corpus(&url, state).await },
    );
}
