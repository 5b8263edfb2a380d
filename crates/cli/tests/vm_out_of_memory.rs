//! A VM killed for memory, as the API and the Slurm bridge tell it: a real
//! `shoal up` whose VMs each get a 256 MiB cgroup (`--vm-memory-limit-mib`),
//! a guest that fills its tmpfs far past that, and then: the sandbox is
//! `failed` with `status_reason: "out of memory"`, every call but delete is
//! a 409 saying so, its neighbour answers, a delete clears it; and a Slurm
//! array task that does the same shows `OUT_OF_MEMORY` in `sacct` while its
//! sibling is `COMPLETED`. Admission counts the memory placed VMs may
//! take (`--memory-overcommit` set so that two fit). `shoal up` runs in its own process group and is
//! stopped by its id.

use reqwest::{Method, StatusCode};
use serde_json::json;
use shoal_testkit::{block_on, Answer, ApiClient};
use std::process::Command;
use std::time::{Duration, Instant};

const FILL: &str = "dd if=/dev/zero of=/dev/shm/fill bs=1M count=1500";

async fn create(api: &ApiClient) -> String {
    let body = json!({"template": "base"});
    let created = api.ok(Method::POST, "/v1/sandboxes", Some(body)).await;
    created["id"].as_str().unwrap().to_owned()
}

async fn exec(api: &ApiClient, id: &str, cmd: &str) -> Answer {
    let body = json!({ "cmd": cmd, "timeout_seconds": 120 });
    api.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(body),
    )
    .await
}

#[test]
fn a_vm_killed_for_memory_is_failed_with_the_reason() {
    block_on(async {
        let state = shoal_testkit::state_dir("vm_out_of_memory");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        // Room for two VMs' limits (2.5 x 256 MiB) and not three.
        let total_mib = std::fs::read_to_string("/proc/meminfo")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap()
            / 1024.0;
        let overcommit = 2.5 * 256.0 / (total_mib - 1024.0);
        let up = shoal_testkit::UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .args([
                "--vm-memory-limit-mib",
                "256",
                "--memory-reserve-mib",
                "1024",
            ])
            .args(["--memory-overcommit", &overcommit.to_string()])
            .start()
            .await;
        let api = ApiClient::new(up.base(), up.token("oom"));

        let greedy = create(&api).await;
        let neighbour = create(&api).await;
        // Admission counts the memory the two may take: a third is a 503.
        let Answer {
            status, json: body, ..
        } = api
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base"})),
            )
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        let Answer {
            status, json: body, ..
        } = exec(&api, &greedy, FILL).await;
        assert_eq!(status, StatusCode::CONFLICT, "the fill: {body}");
        assert_eq!(
            body["error"].as_str().unwrap(),
            format!("sandbox {greedy} has failed: out of memory")
        );

        let deadline = Instant::now() + Duration::from_secs(30);
        let row = loop {
            let Answer {
                status, json: row, ..
            } = api
                .call(Method::GET, &format!("/v1/sandboxes/{greedy}"), None)
                .await;
            assert_eq!(status, StatusCode::OK, "{row}");
            if row["status"] == "failed" {
                break row;
            }
            assert!(Instant::now() < deadline, "never failed: {row}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(row["status_reason"], "out of memory", "{row}");

        let Answer {
            status, json: body, ..
        } = exec(&api, &greedy, "true").await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        let message = body["error"].as_str().unwrap();
        assert!(message.contains("out of memory"), "{message}");

        let Answer {
            status, json: body, ..
        } = exec(&api, &neighbour, "echo alive").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["stdout"].as_str().unwrap().trim(), "alive");

        let Answer {
            status, json: _, ..
        } = api
            .call(Method::DELETE, &format!("/v1/sandboxes/{greedy}"), None)
            .await;
        assert_eq!(status, StatusCode::NO_CONTENT);
        let Answer {
            status, json: _, ..
        } = api
            .call(Method::GET, &format!("/v1/sandboxes/{greedy}"), None)
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND);

        let Answer {
            status, json: _, ..
        } = api
            .call(Method::DELETE, &format!("/v1/sandboxes/{neighbour}"), None)
            .await;
        assert_eq!(status, StatusCode::NO_CONTENT);

        // The same through the Slurm bridge: task 1 fills memory, task 2 not.
        let submit = state.join("submit");
        std::fs::create_dir_all(&submit).unwrap();
        std::fs::write(
            submit.join("oom.sh"),
            format!(
                "#!/bin/bash\n#SBATCH --job-name=oom\n#SBATCH --array=1-2\n\
                 if [ \"$SLURM_ARRAY_TASK_ID\" = 1 ]; then {FILL}; fi\necho done $SLURM_ARRAY_TASK_ID\n"
            ),
        )
        .unwrap();
        let shoal = |args: &[&str]| {
            let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
                .args(args)
                .current_dir(&submit)
                .env("SHOAL_API", up.base())
                .env("SHOAL_API_KEY", &api.token)
                .env("USER", "ada")
                .env("SHOAL_SLURM_CONFIG", submit.join("no-config.json"))
                .env_remove("SHOAL_PARTITIONS")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "shoal {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let submitted = shoal(&["sbatch", "oom.sh"]);
        let job = submitted
            .trim()
            .strip_prefix("Submitted batch job ")
            .unwrap_or_else(|| panic!("{submitted}"))
            .to_owned();
        let deadline = Instant::now() + Duration::from_secs(240);
        let states = loop {
            let table = shoal(&["sacct", "-j", &job, "-P", "-n", "--format=JobID,State"]);
            let states: Vec<(String, String)> = table
                .lines()
                .filter_map(|l| l.split_once('|'))
                .map(|(id, state)| (id.to_owned(), state.to_owned()))
                .collect();
            let finished =
                states.len() == 2 && states.iter().all(|(_, s)| s != "PENDING" && s != "RUNNING");
            if finished {
                break states;
            }
            assert!(
                Instant::now() < deadline,
                "job {job} never finished: {table}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert_eq!(
            states,
            [
                (format!("{job}_1"), "OUT_OF_MEMORY".to_owned()),
                (format!("{job}_2"), "COMPLETED".to_owned())
            ]
        );
    });
}
