//! Snapshots on real VMs, over HTTP against a real `shoal up`: the free
//! tier's snapshot quota answers 429 without Retry-After and leaves no
//! capture behind; a snapshot is read by id (another account's is a 404);
//! deleting one frees its files (at once, or when the last sandbox restored
//! from it goes) and later creates from it are 404. And a state directory on
//! a small tmpfs: once its free space is below `--disk-reserve-mib`, a
//! create, a snapshot and a hibernation are 507 and write nothing, and they
//! pass again once space is freed.
//!
//! `shoal up` runs in its own process group and is stopped by its id.

use reqwest::Method;
use serde_json::{json, Value};
use shoal_testkit::ApiClient;
use std::path::{Path, PathBuf};
use std::time::Duration;

struct Api(ApiClient);

impl Api {
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let answer = self.0.call(method, path, body).await;
        (answer.status.as_u16(), answer.json)
    }

    async fn sandbox(&self, body: Value) -> String {
        let (status, body) = self.call(Method::POST, "/v1/sandboxes", Some(body)).await;
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_owned()
    }

    async fn snapshot(&self, sandbox: &str) -> (u16, Value) {
        self.call(
            Method::POST,
            &format!("/v1/sandboxes/{sandbox}/snapshots"),
            None,
        )
        .await
    }
}

/// The capture directories under a state dir.
fn captures(state: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(state.join("captures"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn snapshot_quota_get_and_delete() {
    shoal_testkit::block_on(async {
        let state = shoal_testkit::state_dir("vm_snapshots");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .args(["--memory-reserve-mib", "0"])
            .ready_within(Duration::from_secs(900))
            .start()
            .await;
        let api = Api(ApiClient::new(up.base(), up.token_of_tier("alice", "free")));
        let stranger = Api(ApiClient::new(
            up.base(),
            up.token_of_tier("mallory", "free"),
        ));
        let source = api
            .sandbox(json!({"template": "base", "ttl_seconds": 3600}))
            .await;
        let (status, body) = api
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{source}/exec"),
                Some(json!({"cmd": "echo kept > /root/mark"})),
            )
            .await;
        assert_eq!(status, 200, "{body}");

        // The free tier holds 5.
        let mut ids = Vec::new();
        for _ in 0..5 {
            let (status, body) = api.snapshot(&source).await;
            assert_eq!(status, 201, "{body}");
            assert!(body["size_bytes"].as_i64().unwrap() > 0, "{body}");
            ids.push(body["id"].as_str().unwrap().to_owned());
        }
        assert_eq!(captures(&state).len(), 5, "{:?}", captures(&state));
        let refused = api
            .0
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{source}/snapshots"),
                None,
            )
            .await;
        assert_eq!(refused.status.as_u16(), 429, "{}", refused.text);
        assert_eq!(refused.retry_after, None);
        assert_eq!(
            refused.json["error"],
            "quota exceeded: the free tier allows 5 snapshots; delete one to take another"
        );
        assert_eq!(captures(&state).len(), 5, "a refused snapshot left files");

        // Read by id; another account sees nothing and deletes nothing.
        let first = ids[0].clone();
        let (status, body) = api
            .call(Method::GET, &format!("/v1/snapshots/{first}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["id"], first.as_str());
        assert_eq!(body["sandbox_id"], source.as_str());
        assert_eq!(body["template"], "base");
        assert!(body["created_at"].is_string());
        for method in [Method::GET, Method::DELETE] {
            let (status, body) = stranger
                .call(method, &format!("/v1/snapshots/{first}"), None)
                .await;
            assert_eq!(
                (status, body["error"].as_str()),
                (404, Some("snapshot not found"))
            );
        }
        let (status, body) = api.call(Method::GET, "/v1/snapshots/nope", None).await;
        assert_eq!(status, 404, "{body}");
        let dir = state.join("captures").join(&first);
        assert!(dir.is_dir());

        // Deleting one nothing was restored from frees its files at once.
        let (status, body) = api
            .call(Method::DELETE, &format!("/v1/snapshots/{first}"), None)
            .await;
        assert_eq!(status, 204, "{body}");
        assert!(!dir.exists(), "{} is still there", dir.display());
        let (status, _) = api
            .call(Method::GET, &format!("/v1/snapshots/{first}"), None)
            .await;
        assert_eq!(status, 404);
        let (status, _) = api
            .call(Method::DELETE, &format!("/v1/snapshots/{first}"), None)
            .await;
        assert_eq!(status, 404);
        let (status, body) = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"from_snapshot": first})),
            )
            .await;
        assert_eq!(
            (status, body["error"].as_str()),
            (404, Some("snapshot not found"))
        );
        let (status, list) = api.call(Method::GET, "/v1/snapshots", None).await;
        assert_eq!(status, 200);
        let listed: Vec<&str> = list["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        assert_eq!(listed.len(), 4, "{list}");
        assert!(!listed.contains(&first.as_str()));

        // Its place in the quota is free again.
        let (status, body) = api.snapshot(&source).await;
        assert_eq!(status, 201, "{body}");

        // A snapshot with a sandbox restored from it: deleted at once for
        // the API, its files kept while that sandbox runs.
        let second = ids[1].clone();
        let child = api.sandbox(json!({"from_snapshot": second})).await;
        let (status, body) = api
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{child}/exec"),
                Some(json!({"cmd": "cat /root/mark"})),
            )
            .await;
        assert_eq!(
            (status, body["stdout"].as_str()),
            (200, Some("kept\n")),
            "{body}"
        );
        let (status, _) = api
            .call(Method::DELETE, &format!("/v1/snapshots/{second}"), None)
            .await;
        assert_eq!(status, 204);
        let dir = state.join("captures").join(&second);
        assert!(dir.is_dir(), "the files of a snapshot in use went");
        let (status, body) = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"from_snapshot": second})),
            )
            .await;
        assert_eq!(status, 404, "{body}");
        let (status, _) = api
            .call(Method::DELETE, &format!("/v1/sandboxes/{child}"), None)
            .await;
        assert!(status == 200 || status == 204, "{status}");
        assert!(
            shoal_testkit::wait_until(Duration::from_secs(30), || async { !dir.exists() }).await,
            "{} outlived the last sandbox restored from it",
            dir.display()
        );
        drop(up);
        let _ = std::fs::remove_dir_all(&state);
    });
}

/// A tmpfs mounted for the test, unmounted (and its mount point removed)
/// when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: PathBuf, size: &str) -> Tmpfs {
        let _ = std::process::Command::new("umount")
            .arg(&dir)
            .stderr(std::process::Stdio::null())
            .status();
        std::fs::create_dir_all(&dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(status.success(), "mounting a tmpfs on {}", dir.display());
        Tmpfs(dir)
    }

    fn free_mib(&self) -> u64 {
        let out = std::process::Command::new("df")
            .args(["--output=avail", "-B1M"])
            .arg(&self.0)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines().nth(1).unwrap().trim().parse().unwrap()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // QEMU processes of a stopped `shoal up` may take a moment to let go.
        for _ in 0..50 {
            let done = std::process::Command::new("umount")
                .arg(&self.0)
                .status()
                .is_ok_and(|s| s.success());
            if done {
                let _ = std::fs::remove_dir(&self.0);
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_short_state_disk_refuses_with_507() {
    shoal_testkit::block_on(async {
        let disk = Tmpfs::mount(shoal_testkit::state_dir("vm_snapshots-tmpfs"), "1g");
        let state = disk.0.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let reserve_mib = 64;
        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .args(["--memory-reserve-mib", "0"])
            .args(["--disk-reserve-mib", &reserve_mib.to_string()])
            .ready_within(Duration::from_secs(900))
            .start()
            .await;
        let api = Api(ApiClient::new(up.base(), up.token("team")));
        let first = api
            .sandbox(json!({"template": "base", "ttl_seconds": 3600}))
            .await;

        // Leave less than the reserve free.
        let filler = disk.0.join("filler");
        let fill_mib = disk.free_mib() - (reserve_mib - 16);
        let status = std::process::Command::new("fallocate")
            .args(["-l", &format!("{fill_mib}M")])
            .arg(&filler)
            .status()
            .unwrap();
        assert!(status.success());
        let free = disk.free_mib();
        assert!(free < reserve_mib, "{free} MiB free");

        let vms_before = std::fs::read_dir(state.join("vms")).unwrap().count();
        let answer = api
            .0
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base"})),
            )
            .await;
        assert_eq!(answer.status.as_u16(), 507, "{}", answer.text);
        assert_eq!(answer.json["error"], "insufficient host storage");
        let (status, body) = api.snapshot(&first).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (507, Some("insufficient host storage"))
        );
        let (status, body) = api
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{first}/hibernate"),
                None,
            )
            .await;
        assert_eq!(
            (status, body["error"].as_str()),
            (507, Some("insufficient host storage"))
        );
        // Nothing was written: no new VM directory, no capture, the sandbox
        // still running.
        assert_eq!(
            std::fs::read_dir(state.join("vms")).unwrap().count(),
            vms_before
        );
        assert!(captures(&state).is_empty(), "{:?}", captures(&state));
        let (status, body) = api
            .call(Method::GET, &format!("/v1/sandboxes/{first}"), None)
            .await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("running")),
            "{body}"
        );
        let (status, list) = api.call(Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(status, 200);
        assert_eq!(list.as_array().unwrap().len(), 1, "{list}");

        // Space freed: the same requests pass.
        std::fs::remove_file(&filler).unwrap();
        let second = api.sandbox(json!({"template": "base"})).await;
        let (status, body) = api.snapshot(&first).await;
        assert_eq!(status, 201, "{body}");
        for id in [first, second] {
            api.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                .await;
        }
        drop(up);
    });
}
