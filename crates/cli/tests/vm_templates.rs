//! An account's own templates on real VMs, over HTTP against a real
//! `shoal up` (issue 21): a running sandbox named as a template; sandboxes
//! created with it have its files and its running processes; a Slurm job
//! whose `--partition` names it runs there; it is the
//! account's alone (404 to another, whose create with that name fails);
//! names are unique and first-party names refused; the snapshot under it
//! cannot be deleted while it stands; deleting it leaves the sandboxes made
//! from it running, and a first-party template cannot be deleted. A
//! template that starts a server and waits for it to answer: its sandboxes
//! serve with no exec; a ready command that never succeeds is 422 and
//! leaves nothing.
//!
//! `shoal up` runs in its own process group and is stopped by its id.

use reqwest::Method;
use serde_json::{json, Value};
use shoal_testkit::ApiClient;
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

    async fn exec(&self, sandbox: &str, cmd: &str) -> Value {
        let (status, body) = self
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{sandbox}/exec"),
                Some(json!({ "cmd": cmd })),
            )
            .await;
        assert_eq!(status, 200, "{cmd}: {body}");
        body
    }
}

#[test]
fn a_running_sandbox_becomes_an_accounts_template() {
    shoal_testkit::block_on(async {
        let state = shoal_testkit::state_dir("vm_templates");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .args(["--memory-reserve-mib", "0"])
            .ready_within(Duration::from_secs(900))
            .start()
            .await;
        let alice = up.token_of_tier("alice", "pro");
        let api = Api(ApiClient::new(up.base(), alice.clone()));
        let stranger = Api(ApiClient::new(
            up.base(),
            up.token_of_tier("mallory", "pro"),
        ));

        // Tools installed by hand, and a process left running.
        let source = api
            .sandbox(json!({"template": "base", "ttl_seconds": 3600}))
            .await;
        api.exec(
            &source,
            "mkdir -p /opt/tools && printf 'echo tooled\\n' > /opt/tools/hello.sh && \
             (setsid sleep 100000 >/dev/null 2>&1 &)",
        )
        .await;
        let (status, made) = api
            .call(
                Method::POST,
                "/v1/templates",
                Some(json!({"name": "tools", "from_sandbox": source})),
            )
            .await;
        assert_eq!(status, 201, "{made}");
        assert_eq!(
            (
                made["name"].as_str(),
                made["is_global"].as_bool(),
                made["base"].as_str()
            ),
            (Some("tools"), Some(false), Some("base")),
            "{made}"
        );
        let snapshot = made["meta"]["snapshot_id"].as_str().unwrap().to_owned();

        let (status, listed) = api.call(Method::GET, "/v1/templates", None).await;
        assert_eq!(status, 200, "{listed}");
        let names: Vec<&str> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert!(
            names.contains(&"base")
                && names.contains(&"code-interpreter")
                && names.contains(&"tools"),
            "{names:?}"
        );

        // A sandbox of the template has the files and the process.
        let started = std::time::Instant::now();
        let (status, child) = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "tools", "ttl_seconds": 3600})),
            )
            .await;
        let create_ms = started.elapsed().as_millis();
        assert_eq!(status, 201, "{child}");
        assert_eq!(child["template"], "tools", "{child}");
        let child = child["id"].as_str().unwrap().to_owned();
        eprintln!("FIGURE create from an account template: {create_ms} ms (client side)");
        let ran = api
            .exec(
                &child,
                "sh /opt/tools/hello.sh && cat /proc/[0-9]*/comm | grep -cx sleep",
            )
            .await;
        let stdout = ran["stdout"].as_str().unwrap();
        assert!(stdout.starts_with("tooled\n"), "{ran}");
        let sleeping: u32 = stdout
            .lines()
            .nth(1)
            .unwrap_or("0")
            .trim()
            .parse()
            .unwrap_or(0);
        assert!(sleeping >= 1, "the sleep did not come along: {ran}");

        // A Slurm job names it as its partition (no mapping needed): every
        // task runs in it.
        let submit = state.join("submit");
        std::fs::create_dir_all(&submit).unwrap();
        std::fs::write(
            submit.join("job.sh"),
            "#!/bin/sh\n#SBATCH --partition=tools\n#SBATCH --array=0-1\nsh /opt/tools/hello.sh\n",
        )
        .unwrap();
        let job = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
            .args(["sbatch", "--wait", "job.sh"])
            .current_dir(&submit)
            .env("SHOAL_API", up.base())
            .env("SHOAL_API_KEY", &alice)
            .env("SHOAL_SLURM_CONFIG", submit.join("no-config.json"))
            .env_remove("SHOAL_PARTITIONS")
            .output()
            .unwrap();
        assert!(
            job.status.success(),
            "{}{}",
            String::from_utf8_lossy(&job.stdout),
            String::from_utf8_lossy(&job.stderr)
        );
        let outputs: Vec<String> = std::fs::read_dir(&submit)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("slurm-"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap())
            .collect();
        assert_eq!(outputs.len(), 2, "{outputs:?}");
        assert!(outputs.iter().all(|o| o == "tooled\n"), "{outputs:?}");

        // The account's alone.
        let (status, _) = stranger
            .call(Method::GET, "/v1/templates/tools", None)
            .await;
        assert_eq!(status, 404);
        let (status, body) = stranger
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "tools"})),
            )
            .await;
        assert!((400..500).contains(&status), "{status}: {body}");
        let (status, body) = api.call(Method::GET, "/v1/templates/tools", None).await;
        assert_eq!(
            (status, body["name"].as_str()),
            (200, Some("tools")),
            "{body}"
        );

        // Names: unique per account, never a first-party one; one source.
        for (body, want) in [
            (json!({"name": "tools", "from_snapshot": snapshot}), 409),
            (json!({"name": "base", "from_snapshot": snapshot}), 409),
            (json!({"name": "Bad Name", "from_snapshot": snapshot}), 400),
            (json!({"name": "other"}), 400),
            (json!({"name": "other", "from_snapshot": "snap-nope"}), 404),
            (json!({"name": "other", "from_sandbox": "sb-nope"}), 404),
        ] {
            let (status, answer) = api
                .call(Method::POST, "/v1/templates", Some(body.clone()))
                .await;
            assert_eq!(status, want, "{body}: {answer}");
        }
        // Another account cannot name alice's snapshot.
        let (status, _) = stranger
            .call(
                Method::POST,
                "/v1/templates",
                Some(json!({"name": "stolen", "from_snapshot": snapshot})),
            )
            .await;
        assert_eq!(status, 404);

        // The snapshot stays while the template names it.
        let (status, body) = api
            .call(Method::DELETE, &format!("/v1/snapshots/{snapshot}"), None)
            .await;
        assert_eq!(status, 409, "{body}");
        let (status, _) = api.call(Method::DELETE, "/v1/templates/base", None).await;
        assert_eq!(status, 403);
        let (status, _) = stranger
            .call(Method::DELETE, "/v1/templates/tools", None)
            .await;
        assert_eq!(status, 404);
        let (status, _) = api.call(Method::DELETE, "/v1/templates/tools", None).await;
        assert_eq!(status, 204);
        let (status, _) = api.call(Method::GET, "/v1/templates/tools", None).await;
        assert_eq!(status, 404);
        // Sandboxes made from it go on.
        let ran = api.exec(&child, "sh /opt/tools/hello.sh").await;
        assert_eq!(ran["stdout"], "tooled\n", "{ran}");
        let (status, body) = api
            .call(Method::DELETE, &format!("/v1/snapshots/{snapshot}"), None)
            .await;
        assert_eq!(status, 204, "{body}");

        // A template that starts a server and waits for it: its sandboxes
        // answer on the port with no exec of their own.
        let server = api
            .sandbox(json!({"template": "code-interpreter", "ttl_seconds": 3600}))
            .await;
        let fetch = "python3 -c \"import urllib.request; \
                     print(urllib.request.urlopen('http://127.0.0.1:8000/ready.txt').read().decode().strip())\"";
        api.exec(&server, "mkdir -p /srv/www && echo up > /srv/www/ready.txt")
            .await;
        let (status, made) = api
            .call(
                Method::POST,
                "/v1/templates",
                Some(json!({
                    "name": "served",
                    "from_sandbox": server,
                    "start_cmd": "exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv/www",
                    "ready_cmd": fetch,
                })),
            )
            .await;
        assert_eq!(status, 201, "{made}");
        assert!(made["meta"]["start_cmd"]
            .as_str()
            .unwrap()
            .contains("http.server"));
        let started = std::time::Instant::now();
        let served = api
            .sandbox(json!({"template": "served", "ttl_seconds": 600}))
            .await;
        let create_ms = started.elapsed().as_millis();
        eprintln!(
            "FIGURE create from a template with a running server: {create_ms} ms (client side)"
        );
        let answer = api.exec(&served, fetch).await;
        assert_eq!(answer["stdout"], "up\n", "{answer}");
        // A ready command that never succeeds: 422 naming its output, and
        // no template, no snapshot.
        let (_, before) = api.call(Method::GET, "/v1/snapshots", None).await;
        let (status, body) = api
            .call(
                Method::POST,
                "/v1/templates",
                Some(json!({
                    "name": "never",
                    "from_sandbox": server,
                    "start_cmd": "sleep 1000",
                    "ready_cmd": "echo not yet; false",
                    "ready_timeout_seconds": 2,
                })),
            )
            .await;
        assert_eq!(status, 422, "{body}");
        assert!(
            body["error"].as_str().unwrap().contains("not yet"),
            "{body}"
        );
        let (status, _) = api.call(Method::GET, "/v1/templates/never", None).await;
        assert_eq!(status, 404);
        let (_, after) = api.call(Method::GET, "/v1/snapshots", None).await;
        assert_eq!(before, after);
        let (status, _) = api
            .call(
                Method::POST,
                "/v1/templates",
                Some(json!({"name": "nope", "from_snapshot": snapshot, "start_cmd": "true"})),
            )
            .await;
        assert_eq!(status, 400);

        drop(up);
        let _ = std::fs::remove_dir_all(&state);
    });
}
