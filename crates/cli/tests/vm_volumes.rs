//! Durable volumes end to end on real VMs, over HTTP against a real
//! `shoal up`: a volume is made; a sandbox mounts it read-write at
//! `/mnt/volumes/<name>` (seeing the image's size, not the baked
//! placeholder's) and writes a file; once that sandbox is deleted, two
//! read-only sandboxes at once see the file and cannot write; one writer
//! or many readers (409 otherwise); forks and snapshots of a sandbox with
//! a volume are refused; hibernate and wake keep what was written; an
//! unknown volume at create leaves no row and no VM; a volume is deleted
//! only when nothing holds it, and its image goes with it; the free tier's
//! quotas answer 429.
//!
//! `shoal up` runs in its own process group and is stopped by its id.

use serde_json::{json, Value};
use shoal_testkit::ApiClient;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The API client, answers as (status, JSON), with this test's helpers.
struct Api(ApiClient);

impl Api {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let answer = self.0.call(method, path, body).await;
        (answer.status.as_u16(), answer.json)
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    async fn delete(&self, path: &str) -> u16 {
        self.call(reqwest::Method::DELETE, path, None).await.0
    }

    /// A sandbox with `volumes`, which must be made; its id.
    async fn sandbox(&self, volumes: Value) -> String {
        let (status, body) = self
            .post(
                "/v1/sandboxes",
                json!({"template": "base", "ttl_seconds": 3600, "volumes": volumes}),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_owned()
    }

    /// Runs `cmd` in sandbox `id`: (exit code, stdout, stderr).
    async fn exec(&self, id: &str, cmd: &str) -> (i64, String, String) {
        let (status, body) = self
            .post(&format!("/v1/sandboxes/{id}/exec"), json!({"cmd": cmd}))
            .await;
        assert_eq!(status, 200, "{body}");
        (
            body["exit_code"].as_i64().unwrap(),
            body["stdout"].as_str().unwrap().to_owned(),
            body["stderr"].as_str().unwrap().to_owned(),
        )
    }

    async fn live_sandboxes(&self) -> Vec<String> {
        let (status, body) = self.get("/v1/sandboxes").await;
        assert_eq!(status, 200);
        body.as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// Shell printing the size (512-byte sectors) and read-only flag of the
/// disk mounted at `mount`.
fn disk_of(mount: &str) -> String {
    format!(
        "dev=$(awk '$2 == \"{mount}\" {{print $1}}' /proc/mounts); dev=${{dev#/dev/}}; \
         echo $(cat /sys/block/$dev/size) $(cat /sys/block/$dev/ro)"
    )
}

/// The volume images under `state`, as absolute paths.
fn images(state: &Path) -> Vec<PathBuf> {
    let dir = state.join("volumes");
    shoal_testkit::files_under(&dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "ext4"))
        .map(|p| dir.join(p))
        .collect()
}

#[test]
fn volumes_outlive_sandboxes_with_one_writer_or_many_readers() {
    shoal_testkit::block_on(async {
        let state = shoal_testkit::state_dir("vm_volumes");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        // SQLite in the state directory, the product's default database.
        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .args(["--memory-reserve-mib", "0"])
            .ready_within(Duration::from_secs(900))
            .start()
            .await;
        let api = Api(ApiClient::new(up.base(), up.token("team")));

        // Create: validation, then the image.
        for bad in [
            json!({"name": "Data", "size_mb": 64}),
            json!({"name": "../x", "size_mb": 64}),
            json!({"name": "data", "size_mb": 0}),
            json!({"name": "data", "size_mb": 65537}),
            json!({"size_mb": 64}),
        ] {
            let (status, body) = api.post("/v1/volumes", bad.clone()).await;
            assert_eq!(status, 400, "{bad} gave {body}");
            assert!(body["error"].is_string());
        }
        let (status, volume) = api
            .post("/v1/volumes", json!({"name": "data", "size_mb": 64}))
            .await;
        assert_eq!(status, 201, "{volume}");
        assert_eq!(volume["name"], "data");
        assert_eq!(volume["size_mb"], 64);
        assert_eq!(volume["attached_to"], json!([]));
        let (status, body) = api
            .post("/v1/volumes", json!({"name": "data", "size_mb": 8}))
            .await;
        assert_eq!(
            (status, body["error"].as_str().unwrap()),
            (409, "volume data already exists")
        );
        let image = images(&state);
        assert_eq!(image.len(), 1, "{image:?}");
        let image = image[0].clone();
        assert!(image.ends_with("data.ext4"));
        let meta = std::fs::metadata(&image).unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(
            std::os::unix::fs::MetadataExt::blocks(&meta) * 512 < 32 << 20,
            "the image is sparse"
        );

        // One writer: it sees the image's size, not the placeholder's.
        let writer = api
            .sandbox(json!([{"name": "data", "read_only": false}]))
            .await;
        let (code, out, err) = api.exec(&writer, &disk_of("/mnt/volumes/data")).await;
        assert_eq!(code, 0, "{err}");
        assert_eq!(out.trim(), format!("{} 0", (64u64 << 20) / 512));
        let (code, _, err) = api
            .exec(
                &writer,
                "echo kept > /mnt/volumes/data/greeting && mkdir /mnt/volumes/data/dir",
            )
            .await;
        assert_eq!(code, 0, "{err}");
        let (_, body) = api.get("/v1/volumes/data").await;
        assert_eq!(body["attached_to"], json!([writer]));

        // While it lives: no second writer, no reader, no delete, no fork
        // or snapshot; a refused create leaves no sandbox behind.
        for read_only in [false, true] {
            let (status, body) = api
                .post(
                    "/v1/sandboxes",
                    json!({"template": "base", "volumes": [{"name": "data", "read_only": read_only}]}),
                )
                .await;
            assert_eq!(status, 409, "{body}");
            assert!(
                body["error"].as_str().unwrap().starts_with("volume in use"),
                "{body}"
            );
        }
        assert_eq!(api.live_sandboxes().await, std::slice::from_ref(&writer));
        assert_eq!(api.delete("/v1/volumes/data").await, 409);
        let (status, body) = api
            .post(&format!("/v1/sandboxes/{writer}/fork"), json!({}))
            .await;
        assert_eq!(status, 409, "{body}");
        let (status, body) = api
            .post(&format!("/v1/sandboxes/{writer}/snapshots"), json!({}))
            .await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(api.live_sandboxes().await, std::slice::from_ref(&writer));

        // Hibernate and wake keep the mount and what was written.
        let (status, body) = api
            .post(&format!("/v1/sandboxes/{writer}/hibernate"), json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = api
            .post(&format!("/v1/sandboxes/{writer}/wake"), json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
        let (code, out, err) = api
            .exec(
                &writer,
                "cat /mnt/volumes/data/greeting && echo more >> /mnt/volumes/data/greeting",
            )
            .await;
        assert_eq!((code, out.as_str()), (0, "kept\n"), "{err}");

        // The writer goes (without unmounting by itself); readers see its
        // writes, two at once, and cannot write.
        assert_eq!(api.delete(&format!("/v1/sandboxes/{writer}")).await, 204);
        let readers = [
            api.sandbox(json!([{"name": "data", "read_only": true}]))
                .await,
            api.sandbox(json!([{"name": "data", "read_only": true}]))
                .await,
        ];
        for reader in &readers {
            let (code, out, err) = api.exec(reader, "cat /mnt/volumes/data/greeting").await;
            assert_eq!((code, out.as_str()), (0, "kept\nmore\n"), "{err}");
            let (_, out, _) = api.exec(reader, &disk_of("/mnt/volumes/data")).await;
            assert_eq!(out.trim(), format!("{} 1", (64u64 << 20) / 512));
            let (code, _, err) = api
                .exec(reader, "echo no > /mnt/volumes/data/greeting")
                .await;
            assert_ne!(code, 0);
            assert!(err.contains("Read-only file system"), "{err}");
        }
        let (_, body) = api.get("/v1/volumes").await;
        assert_eq!(body["items"][0]["attached_to"], json!(readers));
        let (status, body) = api
            .post(
                "/v1/sandboxes",
                json!({"template": "base", "volumes": [{"name": "data"}]}),
            )
            .await;
        assert_eq!(status, 409, "a writer beside readers: {body}");

        // An unknown volume: 404, no row, no VM.
        let qemus = shoal_testkit::processes_mentioning(&state.display().to_string()).len();
        let (status, body) = api
            .post(
                "/v1/sandboxes",
                json!({"template": "base", "volumes": [{"name": "nope", "read_only": true}]}),
            )
            .await;
        assert_eq!(
            (status, body["error"].as_str().unwrap()),
            (404, "volume not found: nope")
        );
        assert_eq!(api.live_sandboxes().await.len(), 2);
        assert_eq!(
            shoal_testkit::processes_mentioning(&state.display().to_string()).len(),
            qemus
        );

        // Deleted only once nothing holds it; the image goes with it.
        assert_eq!(api.delete("/v1/volumes/data").await, 409);
        for reader in &readers {
            assert_eq!(api.delete(&format!("/v1/sandboxes/{reader}")).await, 204);
        }
        assert_eq!(api.delete("/v1/volumes/data").await, 204);
        assert!(!image.exists(), "the image was left");
        assert_eq!(api.get("/v1/volumes/data").await.0, 404);
        assert_eq!(api.delete("/v1/volumes/data").await, 404);

        // The free tier: one volume of at most 1 GiB.
        let free = Api(ApiClient::new(up.base(), up.token_of_tier("free", "free")));
        let (_, me) = free.get("/v1/me").await;
        assert_eq!(me["limits"]["max_volumes"], 1);
        assert_eq!(me["limits"]["max_volume_size_mb"], 1024);
        let (status, body) = free
            .post("/v1/volumes", json!({"name": "big", "size_mb": 1025}))
            .await;
        assert_eq!(
            (status, body["error"].as_str().unwrap()),
            (
                429,
                "quota exceeded: the free tier allows volumes of at most 1024 MB"
            )
        );
        let (status, _) = free
            .post("/v1/volumes", json!({"name": "first", "size_mb": 16}))
            .await;
        assert_eq!(status, 201);
        let (status, body) = free
            .post("/v1/volumes", json!({"name": "second", "size_mb": 16}))
            .await;
        assert_eq!(
            (status, body["error"].as_str().unwrap()),
            (429, "quota exceeded: the free tier allows 1 volume")
        );
        assert_eq!(free.delete("/v1/volumes/first").await, 204);
        assert!(images(&state).is_empty(), "{:?}", images(&state));
    });
}
