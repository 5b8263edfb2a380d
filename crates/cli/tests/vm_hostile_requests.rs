//! Hostile API input against a real `shoal up` (SQLite, real VMs): a few
//! thousand malformed requests (bad JSON, wrong types, huge, negative and
//! NaN-like numbers, oversized fields, bad paths and ids, bad query strings,
//! wrong methods) are each answered with a 4xx, none with a 5xx or a dropped
//! connection, and the server still answers `/healthz` and runs a real exec
//! afterwards. Also: a plain exec of 200 MB of output answers with the first
//! 16 MiB, `stdout_truncated: true`, and grows the server's peak RSS by
//! less than 64 MiB.
//!
//! Every request that reaches the real sandbox carries a field the API must
//! refuse, so nothing here makes VMs, volumes, apps or sweeps.
//!
//! `shoal up` runs in its own process group and is stopped by its id.

use futures::StreamExt;
use reqwest::Method;
use serde_json::{json, Value};
use shoal_testkit::{ApiClient, UpConfig};
use std::time::{Duration, Instant};

/// One request to fire: method, path (with query), body bytes.
#[derive(Clone)]
struct Shot {
    method: Method,
    path: String,
    body: Option<Vec<u8>>,
    /// An Authorization header that names no account (else the test's).
    bad_token: Option<&'static str>,
}

fn shot(method: Method, path: impl Into<String>, body: Option<Vec<u8>>) -> Shot {
    Shot {
        method,
        path: path.into(),
        body,
        bad_token: None,
    }
}

/// Authorization values that name no account.
const BAD_TOKENS: [&str; 4] = [
    "Bearer ",
    "Bearer sk-not-a-token",
    "Basic dXNlcjpwYXNz",
    "bearer sk-a sk-b",
];

/// Bodies no route may accept: not JSON, or JSON that is not an object.
fn broken_bodies() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = [
        "{",
        "[1,2",
        "}",
        "null",
        "[]",
        "[{}]",
        "\"a string\"",
        "123",
        "-1",
        "1e400",
        "NaN",
        "true",
        "{\"a\":",
        "{'single': 'quotes'}",
        "{\"a\" 1}",
        "{\"a\":1,}",
        "{}{}",
        "{\"a\":1}garbage",
        "\u{feff}{}",
        "{\"cmd\": \"true\"",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    out.push(vec![0xff, 0xfe, 0x00, 0x7b]);
    out.push(b"{\"cmd\": \"\xff\xfe\"}".to_vec());
    // Nesting past serde_json's recursion limit.
    out.push(format!("{}{}", "[".repeat(5000), "]".repeat(5000)).into_bytes());
    // Over the 1 MiB JSON body limit: a 413.
    out.push(format!("{{\"cmd\": \"{}\"}}", "x".repeat(2 << 20)).into_bytes());
    out
}

/// Values that break a number field: huge, negative, fractional,
/// non-finite as text, the wrong type.
fn bad_numbers() -> Vec<Value> {
    vec![
        json!(1e30),
        json!(-1e30),
        json!(1e308),
        json!(-1),
        json!(-0.5),
        json!(18446744073709551615u64),
        json!(-9223372036854775808i64),
        json!("NaN"),
        json!("inf"),
        json!("-inf"),
        json!("10"),
        json!(true),
        json!([1]),
        json!({"n": 1}),
    ]
}

/// `{field: bad}` bodies, each with `base` merged in.
fn with_bad(base: &Value, field: &str, values: &[Value]) -> Vec<Vec<u8>> {
    values
        .iter()
        .map(|v| {
            let mut body = base.clone();
            body[field] = v.clone();
            body.to_string().into_bytes()
        })
        .collect()
}

/// Numbers that are wrong for an integer field but fine for a float one
/// are left out where the field takes floats.
fn bad_integers() -> Vec<Value> {
    let mut out = bad_numbers();
    out.push(json!(1.5));
    out
}

fn shots(real: &str) -> Vec<Shot> {
    let missing = "sb-000000000000";
    let mut out = Vec::new();
    // Routes that read a JSON body.
    let sandbox_routes = [
        (Method::POST, "exec"),
        (Method::POST, "exec/stream"),
        (Method::POST, "fork"),
        (Method::POST, "fork-tree"),
        (Method::POST, "repl/sessions"),
        (Method::POST, "repl/sessions/ctx-000000000000/run"),
        (Method::PATCH, "lifecycle"),
    ];
    // Routes that read none (a body is ignored, as the SDK sends none):
    // only on a sandbox that does not exist.
    let bodiless_routes = [
        "promote",
        "pause",
        "resume",
        "hibernate",
        "wake",
        "snapshots",
    ];
    let top_routes = [
        (Method::POST, "/v1/sandboxes"),
        (Method::POST, "/v1/volumes"),
        (Method::POST, "/v1/apps"),
        (Method::POST, "/v1/sweeps"),
        (Method::PATCH, "/v1/sweeps/sw_0000000000000000"),
        (Method::PATCH, "/v1/apps/app-000000000000"),
    ];
    // Broken bodies everywhere a body is read: a missing sandbox, the real
    // one (refused before any guest work), and the top-level creates.
    for body in broken_bodies() {
        for (method, route) in &sandbox_routes {
            for id in [missing, real] {
                out.push(shot(
                    method.clone(),
                    format!("/v1/sandboxes/{id}/{route}"),
                    Some(body.clone()),
                ));
            }
        }
        for (method, path) in &top_routes {
            out.push(shot(method.clone(), *path, Some(body.clone())));
        }
        for route in bodiless_routes {
            out.push(shot(
                Method::POST,
                format!("/v1/sandboxes/{missing}/{route}"),
                Some(body.clone()),
            ));
        }
    }
    // Bad fields on the real sandbox's exec and stream.
    let exec = json!({"cmd": "true"});
    let mut exec_bodies = with_bad(&exec, "timeout_seconds", &bad_numbers());
    exec_bodies.extend(with_bad(
        &json!({}),
        "cmd",
        &[
            json!(5),
            json!(""),
            json!("   "),
            json!(null),
            json!([]),
            json!({}),
        ],
    ));
    exec_bodies.extend(with_bad(
        &exec,
        "env",
        &[json!(5), json!("A=b"), json!({"A": 5}), json!(["A"])],
    ));
    exec_bodies.extend(with_bad(&exec, "cwd", &[json!(5), json!(true)]));
    exec_bodies.push(
        json!({"cmd": "true", "timeout_seconds": 604801})
            .to_string()
            .into_bytes(),
    );
    for body in &exec_bodies {
        for route in ["exec", "exec/stream"] {
            out.push(shot(
                Method::POST,
                format!("/v1/sandboxes/{real}/{route}"),
                Some(body.clone()),
            ));
        }
    }
    // Repl cells: a bad timeout, or a session that does not exist.
    for body in with_bad(&json!({"code": "1"}), "timeout_ms", &bad_numbers()) {
        out.push(shot(
            Method::POST,
            format!("/v1/sandboxes/{real}/repl/sessions/ctx-000000000000/run"),
            Some(body),
        ));
    }
    out.push(shot(
        Method::POST,
        format!("/v1/sandboxes/{real}/repl/sessions"),
        Some(br#"{"language": "cobol"}"#.to_vec()),
    ));
    // Creates with one bad field each.
    let create = json!({"template": "base"});
    let mut creates = Vec::new();
    for field in ["ttl_seconds", "max_lifetime_seconds"] {
        creates.extend(with_bad(&create, field, &bad_integers()));
        creates.extend(with_bad(&create, field, &[json!(315360001)]));
    }
    creates.extend(with_bad(
        &json!({}),
        "template",
        &[
            json!(5),
            json!(""),
            json!("UPPER"),
            json!("../../etc"),
            json!("no-such-template"),
            json!("a".repeat(10_000)),
        ],
    ));
    creates.extend(with_bad(
        &create,
        "metadata",
        &[
            json!(5),
            json!({"k": 5}),
            json!({"": "v"}),
            json!({"k": "v".repeat(2000)}),
            Value::Object((0..100).map(|i| (format!("k{i}"), json!("v"))).collect()),
        ],
    ));
    creates.extend(with_bad(&create, "persistent", &[json!("yes"), json!(1)]));
    creates.extend(with_bad(
        &create,
        "allow_internet",
        &[json!("no"), json!(0)],
    ));
    creates.extend(with_bad(
        &create,
        "volumes",
        &[
            json!("data"),
            json!([{"name": 5}]),
            json!([{}]),
            json!([{"name": "a"}, {"name": "a"}]),
            json!([{"name": "a"}, {"name": "b"}, {"name": "c"}]),
            json!([{"name": "no-such-volume"}]),
        ],
    ));
    creates.extend(with_bad(
        &create,
        "from_snapshot",
        &[json!(5), json!("snap-none")],
    ));
    for body in creates {
        out.push(shot(Method::POST, "/v1/sandboxes", Some(body)));
    }
    // Fork trees of the real sandbox with a bad count.
    for body in with_bad(&json!({}), "count", &bad_integers()) {
        out.push(shot(
            Method::POST,
            format!("/v1/sandboxes/{real}/fork-tree"),
            Some(body),
        ));
    }
    for count in [0, 1_000_000] {
        out.push(shot(
            Method::POST,
            format!("/v1/sandboxes/{real}/fork-tree"),
            Some(json!({ "count": count }).to_string().into_bytes()),
        ));
    }
    // Lifecycle changes of the real sandbox with bad values.
    for field in ["ttl_seconds", "max_lifetime_seconds"] {
        for body in with_bad(&json!({}), field, &bad_integers()) {
            out.push(shot(
                Method::PATCH,
                format!("/v1/sandboxes/{real}/lifecycle"),
                Some(body),
            ));
        }
    }
    // Volumes, apps, sweeps: one bad field each.
    let volume = json!({"name": "fuzz-volume"});
    for body in with_bad(&volume, "size_mb", &bad_integers())
        .into_iter()
        .chain(with_bad(&volume, "size_mb", &[json!(0), json!(1u64 << 40)]))
        .chain(with_bad(
            &json!({"size_mb": 8}),
            "name",
            &[
                json!(5),
                json!(""),
                json!("Bad Name"),
                json!("x".repeat(300)),
            ],
        ))
    {
        out.push(shot(Method::POST, "/v1/volumes", Some(body)));
    }
    let app = json!({"start_cmd": "python3 -m http.server 8000", "port": 8000});
    for (field, values) in [
        ("port", {
            let mut v = bad_integers();
            v.extend([json!(0), json!(65536), json!(1_000_000)]);
            v
        }),
        ("idle_seconds", bad_integers()),
        ("start_cmd", vec![json!(5), json!(""), json!([])]),
        ("env", vec![json!(5), json!({"A": 5}), json!({"1BAD": "x"})]),
        ("template", vec![json!(5), json!("no-such-template")]),
    ] {
        for body in with_bad(&app, field, &values) {
            out.push(shot(Method::POST, "/v1/apps", Some(body)));
        }
    }
    let sweep = json!({"name": "fuzz", "template": "base", "command": "true", "cells": [1, 2]});
    for (field, values) in [
        ("throttle", bad_integers()),
        ("retries", {
            let mut v = bad_integers();
            v.push(json!(11));
            v
        }),
        ("timeout_seconds", {
            let mut v = bad_integers();
            v.push(json!(0));
            v
        }),
        (
            "cells",
            vec![
                json!(5),
                json!([]),
                json!([true]),
                json!({"start": 0}),
                json!({"start": 1e30, "end": 2}),
                json!({"start": 5, "end": 1}),
                json!({"start": 0, "end": 10, "step": 0}),
                json!({"start": 0, "end": 10, "step": -1}),
                json!({"start": -9223372036854775808i64, "end": 9223372036854775807i64}),
                json!({"start": 0, "end": 100_000_000}),
            ],
        ),
        ("command", vec![json!(5), json!(""), json!(null)]),
        (
            "fork_from",
            vec![
                json!(5),
                json!({}),
                json!({"setup": "true", "timeout_seconds": 1e30}),
            ],
        ),
        ("files", vec![json!(5), json!({"relative/path": "x"})]),
        ("env", vec![json!(5), json!({"A": 5})]),
    ] {
        for body in with_bad(&sweep, field, &values) {
            out.push(shot(Method::POST, "/v1/sweeps", Some(body)));
        }
    }
    // Bad query strings.
    let queries = [
        format!("/v1/sandboxes/{real}/fs"),
        format!("/v1/sandboxes/{real}/fs?path=relative"),
        format!("/v1/sandboxes/{real}/fs?path="),
        format!("/v1/sandboxes/{real}/fs?path=%ZZ"),
        format!("/v1/sandboxes/{real}/fs?path=/a&path=/b"),
        format!("/v1/sandboxes/{real}/fs/stat?path=x"),
        format!("/v1/sandboxes/{real}/fs/stat"),
        format!("/v1/sandboxes/{real}/fs/dir?path=rel"),
        format!("/v1/sandboxes/{real}/logs?stream=stdin"),
        format!("/v1/sandboxes/{real}/logs?follow=maybe"),
        format!("/v1/sandboxes/{real}/logs?follow=%ZZ"),
        "/v1/usage?from=NaN".to_string(),
        "/v1/usage?to=inf".to_string(),
        "/v1/usage?from=-inf&to=NaN".to_string(),
        "/v1/usage?from=yesterday".to_string(),
        "/v1/usage?metadata=novalue".to_string(),
        "/v1/usage?from=%ZZ".to_string(),
    ];
    for path in &queries {
        out.push(shot(Method::GET, path.clone(), None));
    }
    for path in [
        format!("/v1/sandboxes/{real}/fs?path=relative"),
        format!("/v1/sandboxes/{real}/fs?path=%ZZ"),
        format!("/v1/sandboxes/{real}/fs"),
    ] {
        out.push(shot(Method::POST, path.clone(), Some(b"data".to_vec())));
        out.push(shot(Method::DELETE, path, None));
    }
    // Bad ids and paths.
    let long = "x".repeat(10_000);
    for id in [
        "..",
        "%2e%2e%2f%2e%2e",
        "sb-%00",
        "sb-%ff%fe",
        "%E2%80%AE",
        long.as_str(),
        "sb-000000000000%0d%0aX-Injected:%201",
    ] {
        out.push(shot(Method::GET, format!("/v1/sandboxes/{id}"), None));
        out.push(shot(Method::DELETE, format!("/v1/sandboxes/{id}"), None));
        out.push(shot(
            Method::POST,
            format!("/v1/sandboxes/{id}/exec"),
            Some(br#"{"cmd":"true"}"#.to_vec()),
        ));
        out.push(shot(Method::GET, format!("/v1/sandboxes/{id}/logs"), None));
        out.push(shot(Method::GET, format!("/v1/volumes/{id}"), None));
        out.push(shot(Method::GET, format!("/v1/sweeps/{id}"), None));
        out.push(shot(Method::GET, format!("/v1/sweeps/{id}/cells/0"), None));
        out.push(shot(Method::GET, format!("/v1/apps/{id}"), None));
        out.push(shot(Method::GET, format!("/v1/snapshots/{id}"), None));
    }
    for port in ["abc", "-1", "0", "65536", "99999999999", "%ZZ"] {
        out.push(shot(
            Method::GET,
            format!("/v1/sandboxes/{real}/proxy/{port}/"),
            None,
        ));
    }
    for index in ["-1", "abc", "99999999999999999999", "4294967296"] {
        out.push(shot(
            Method::GET,
            format!("/v1/sweeps/sw_0000000000000000/cells/{index}"),
            None,
        ));
    }
    for path in [
        "/v1/nothing",
        "/v2/sandboxes",
        "/v1/sandboxes/a/b/c/d",
        "/%ZZ",
        "//",
    ] {
        out.push(shot(Method::GET, path, None));
    }
    // Wrong methods.
    for (method, path) in [
        (Method::PUT, format!("/v1/sandboxes/{real}")),
        (Method::GET, format!("/v1/sandboxes/{real}/exec")),
        (Method::DELETE, format!("/v1/sandboxes/{real}/exec")),
        (Method::PUT, format!("/v1/sandboxes/{real}/exec/stream")),
        (Method::GET, format!("/v1/sandboxes/{real}/fork")),
        (Method::DELETE, "/v1/sandboxes".to_string()),
        (Method::PUT, "/v1/volumes".to_string()),
        (Method::DELETE, "/v1/usage".to_string()),
        (Method::POST, "/v1/me".to_string()),
        (Method::POST, "/healthz".to_string()),
        (Method::PATCH, "/v1/templates".to_string()),
    ] {
        for _ in 0..3 {
            out.push(shot(method.clone(), path.clone(), None));
        }
    }
    out
}

async fn fire(http: &reqwest::Client, base: &str, token: &str, shot: &Shot) -> Result<u16, String> {
    if shot.body.as_ref().is_some_and(|b| b.len() > 1 << 20) {
        return oversized(base, token, shot).await;
    }
    let mut request = http
        .request(shot.method.clone(), format!("{base}{}", shot.path))
        .timeout(Duration::from_secs(30));
    request = match shot.bad_token {
        Some(bad) => request.header("authorization", bad),
        None => request.bearer_auth(token),
    };
    if let Some(body) = &shot.body {
        request = request
            .header("content-type", "application/json")
            .body(body.clone());
    }
    let response = request.send().await.map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    // The whole answer must come, not a connection cut mid-body.
    response.bytes().await.map_err(|e| format!("body: {e:?}"))?;
    Ok(status)
}

/// A body over the server's limit: a server may answer before reading it
/// and close, so the body is written beside reading the answer and a write
/// cut short by that close is no failure (reqwest would report the broken
/// pipe, not the answer). A sweep's larger limit reads it whole first.
async fn oversized(base: &str, token: &str, shot: &Shot) -> Result<u16, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = base.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| e.to_string())?;
    let (mut read, mut write) = stream.into_split();
    let auth = shot
        .bad_token
        .map_or_else(|| format!("Bearer {token}"), str::to_string);
    let body = shot.body.clone().unwrap_or_default();
    let head = format!(
        "{} {} HTTP/1.1\r\nHost: {address}\r\nAuthorization: {auth}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        shot.method,
        shot.path,
        body.len()
    );
    let writer = tokio::spawn(async move {
        let _ = write.write_all(head.as_bytes()).await;
        let _ = write.write_all(&body).await;
        write
    });
    // Read until the end; a reset after the answer (the server closing on
    // the body it did not read) still leaves the answer read.
    let mut answer = Vec::new();
    let reading = async {
        let mut chunk = [0u8; 4096];
        loop {
            match read.read(&mut chunk).await {
                Ok(0) => return Ok(()),
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
                Err(e) if answer.is_empty() => return Err(e.to_string()),
                Err(_) => return Ok(()),
            }
        }
    };
    let read = tokio::time::timeout(Duration::from_secs(30), reading).await;
    writer.abort();
    read.map_err(|_| "no answer in 30 s".to_string())??;
    let text = String::from_utf8_lossy(&answer);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3)?.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {:?}", &text[..text.len().min(80)]))
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap()
}

#[test]
fn malformed_requests_get_4xx_and_big_output_is_bounded() {
    shoal_testkit::block_on(async {
        let state = shoal_testkit::state_dir("vm_hostile_requests");
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let up = UpConfig::new(env!("CARGO_BIN_EXE_shoal"), &state)
            .start()
            .await;
        let token = up.token("hostile");
        let api = ApiClient::new(up.base(), &token);
        let created = api
            .ok(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base", "ttl_seconds": 3600})),
            )
            .await;
        let id = created["id"].as_str().unwrap().to_owned();

        // The issue's own example, first.
        let answer = api
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": "true", "timeout_seconds": 1e30})),
            )
            .await;
        assert_eq!(answer.status, 400, "{}", answer.text);
        assert!(
            answer.json["error"]
                .as_str()
                .unwrap()
                .contains("timeout_seconds"),
            "{}",
            answer.text
        );

        // Each request once as the account, once under a token of nobody's.
        let mut shots = shots(&id);
        let unauthorized: Vec<Shot> = shots
            .iter()
            .enumerate()
            .map(|(i, s)| Shot {
                bad_token: Some(BAD_TOKENS[i % BAD_TOKENS.len()]),
                ..s.clone()
            })
            .collect();
        shots.extend(unauthorized);
        assert!(shots.len() >= 2000, "only {} requests", shots.len());
        let http = reqwest::Client::new();
        let started = Instant::now();
        let results: Vec<(usize, Result<u16, String>)> =
            futures::stream::iter(shots.iter().enumerate())
                .map(|(i, s)| {
                    let (http, base, token) = (&http, up.base(), token.as_str());
                    async move { (i, fire(http, base, token, s).await) }
                })
                .buffer_unordered(16)
                .collect()
                .await;
        let took = started.elapsed();
        let mut bad = Vec::new();
        for (i, result) in &results {
            let shot = &shots[*i];
            let what = format!(
                "{} {} {}",
                shot.method,
                &shot.path[..shot.path.len().min(120)],
                shot.body
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(&b[..b.len().min(120)]).into_owned())
                    .unwrap_or_default()
            );
            match result {
                Ok(status) if (400..500).contains(status) => {}
                Ok(status) => bad.push(format!("{status}: {what}")),
                Err(e) => bad.push(format!("dropped ({e}): {what}")),
            }
        }
        assert!(
            bad.is_empty(),
            "{} of {} requests were not a 4xx:\n{}",
            bad.len(),
            results.len(),
            bad.join("\n")
        );
        eprintln!("{} malformed requests, all 4xx, in {took:?}", results.len());
        assert!(took < Duration::from_secs(60), "took {took:?}");

        // Still alive, and still doing real work.
        api.ok(Method::GET, "/healthz", None).await;
        let out = api
            .ok(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": "echo alive; echo err >&2"})),
            )
            .await;
        assert_eq!(out["stdout"], "alive\n");
        assert_eq!(out["stderr"], "err\n");
        assert_eq!(out["stdout_truncated"], false);
        assert_eq!(out["stderr_truncated"], false);

        // 200 MB of output: the first 16 MiB come back, flagged, and the
        // server's peak RSS grows by less than 64 MiB.
        let pid = server_pid(up.state());
        let before = status_kib(pid, "VmHWM");
        let out = api
            .ok(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": "head -c 200000000 /dev/zero | tr \"\\0\" a; echo done >&2"})),
            )
            .await;
        let after = status_kib(pid, "VmHWM");
        let stdout = out["stdout"].as_str().unwrap();
        assert_eq!(stdout.len(), 16 << 20);
        assert!(stdout.bytes().all(|b| b == b'a'));
        assert_eq!(out["stdout_truncated"], true);
        assert_eq!(out["stderr"], "done\n");
        assert_eq!(out["stderr_truncated"], false);
        assert_eq!(out["exit_code"], 0);
        let growth_mib = (after.saturating_sub(before)) as f64 / 1024.0;
        eprintln!("200 MB exec: peak RSS {before} -> {after} KiB (+{growth_mib:.1} MiB)");
        assert!(growth_mib < 64.0, "peak RSS grew {growth_mib:.1} MiB");

        let gone = api
            .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert_eq!(gone.status, 204);
    });
}

/// The pid of the `shoal up` serving `state`: the process whose command
/// line names that state directory and runs `up`.
fn server_pid(state: &std::path::Path) -> u32 {
    let needle = state.to_string_lossy().into_owned();
    shoal_testkit::processes_mentioning(&needle)
        .into_iter()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
                    args.get(1) == Some(&&b"up"[..])
                })
                .unwrap_or(false)
        })
        .expect("the shoal up of this test")
}
