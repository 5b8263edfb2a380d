//! The sweeps routes of `docs/api/SWEEPS.md`: create (validated field by
//! field, every refusal a 400 naming the field), list, get by id or job id,
//! change the throttle, cancel the sweep or some cells, requeue, list cells,
//! one cell. The runner (`runner.rs`) does the work; these routes only
//! write what the caller asked for and wake it.

use crate::error::{ApiError, ApiResult};
use crate::extract::{
    field, integer, json_object, required_string, string, string_map, Body, Caller,
};
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Map, Value};
use shoal_store::{
    Account, CellFilter, CellRow, CellState, DataPath, InputFile, Metadata, NewSweep, SweepRow,
    SweepState, SweepSummary,
};
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

/// Most cells one sweep may have.
pub const MAX_CELLS: usize = 100_000;
/// `files` at most, decoded, in all.
pub const MAX_FILES_BYTES: usize = 8 << 20;
/// A create's body at most (the files travel base64-encoded in it).
const MAX_CREATE_BODY: usize = 16 << 20;
const DEFAULT_THROTTLE: u64 = 10;
const DEFAULT_TIMEOUT_SECONDS: u64 = 3600;
const MAX_TIMEOUT_SECONDS: u64 = 30 * 86400;
const MAX_RETRIES: u64 = 10;
/// What a list of cells shows of stdout and stderr (the end).
const LIST_OUTPUT: usize = 4096;
const DEFAULT_CELL_LIMIT: u32 = 100;
/// A job's input files at most, in number and in bytes (every task's
/// sandbox gets them all on its disk).
pub const MAX_INPUT_FILES: usize = 20_000;
pub const MAX_INPUT_BYTES: u64 = 2 << 30;
/// Directories `results_under` may name.
const MAX_RESULT_DIRS: usize = 16;
/// What one read of a cell's live output returns at most.
const OUTPUT_PAGE: usize = 4 << 20;
const MAX_CELL_LIMIT: u32 = 1000;

fn new_id() -> String {
    format!("sw_{:016x}", rand::random::<u64>())
}

// ---- reading the create body ----

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

fn absolute(name: &str, path: &str) -> ApiResult<()> {
    if path.starts_with('/') && !path.contains('\0') {
        Ok(())
    } else {
        Err(bad(format!("{name}: paths must be absolute: {path:?}")))
    }
}

/// `cells`: a list of strings or numbers, or `{"start","end","step"}`.
fn cells(body: &Map<String, Value>) -> ApiResult<Vec<String>> {
    let values = match field(body, "cells") {
        None => {
            return Err(bad(
                "cells is required (a list, or {\"start\", \"end\", \"step\"})",
            ))
        }
        Some(Value::Array(items)) => {
            if items.len() > MAX_CELLS {
                return Err(bad(format!("cells: at most {MAX_CELLS} cells")));
            }
            items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    _ => Err(bad("cells must be strings or numbers")),
                })
                .collect::<ApiResult<Vec<_>>>()?
        }
        Some(Value::Object(range)) => {
            let bound = |name: &str| -> ApiResult<i64> {
                range
                    .get(name)
                    .and_then(Value::as_i64)
                    .ok_or_else(|| bad(format!("cells.{name} must be an integer")))
            };
            let (start, end) = (bound("start")?, bound("end")?);
            let step = match range.get("step") {
                None | Some(Value::Null) => 1,
                Some(v) => v
                    .as_i64()
                    .filter(|s| *s >= 1)
                    .ok_or_else(|| bad("cells.step must be an integer of at least 1"))?,
            };
            if end < start {
                return Err(bad("cells.end must not be below cells.start"));
            }
            // Wide arithmetic: any two i64 bounds are a valid question.
            let count = (i128::from(end) - i128::from(start)) / i128::from(step) + 1;
            if count > MAX_CELLS as i128 {
                return Err(bad(format!("cells: at most {MAX_CELLS} cells")));
            }
            (0..count)
                .map(|i| (i128::from(start) + i * i128::from(step)).to_string())
                .collect()
        }
        Some(_) => {
            return Err(bad(
                "cells must be a list or {\"start\", \"end\", \"step\"}",
            ))
        }
    };
    if values.is_empty() {
        return Err(bad("cells: at least one cell"));
    }
    Ok(values)
}

/// `inputs` (`[{"path", "digest", "size", "mode"}]`, blobs the account
/// holds) and `results_under` (absolute directories) into a data path;
/// `None` when neither is given. Names the blobs as used now.
async fn data_path(
    cp: &ControlPlane,
    account: &Account,
    body: &Map<String, Value>,
) -> ApiResult<Option<DataPath>> {
    let inputs = field(body, "inputs");
    let results = field(body, "results_under");
    if inputs.is_none() && results.is_none() {
        return Ok(None);
    }
    let mut data = DataPath::default();
    if let Some(items) = inputs {
        let items = items
            .as_array()
            .ok_or_else(|| bad("inputs must be a list of {path, digest, size, mode}"))?;
        if items.len() > MAX_INPUT_FILES {
            return Err(bad(format!("inputs: at most {MAX_INPUT_FILES} files")));
        }
        let mut total = 0u64;
        let mut seen = std::collections::BTreeSet::new();
        for item in items {
            let path = item["path"]
                .as_str()
                .ok_or_else(|| bad("inputs: every input needs a path"))?;
            absolute("inputs", path)?;
            if std::path::Path::new(path)
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(bad(format!("inputs: {path:?} climbs with ..")));
            }
            if !seen.insert(path.to_owned()) {
                return Err(bad(format!("inputs: {path} given twice")));
            }
            let digest = item["digest"]
                .as_str()
                .filter(|d| crate::blobs::is_digest(d))
                .ok_or_else(|| bad(format!("inputs.{path}: digest must be a SHA-256 digest")))?;
            let size = item["size"]
                .as_u64()
                .ok_or_else(|| bad(format!("inputs.{path}: size must be a byte count")))?;
            let mode =
                match &item["mode"] {
                    Value::Null => 0o644,
                    v => v.as_u64().filter(|m| *m <= 0o7777).ok_or_else(|| {
                        bad(format!("inputs.{path}: mode must be permission bits"))
                    })? as u32,
                };
            total += size;
            data.inputs.push(InputFile {
                path: path.to_owned(),
                digest: digest.to_owned(),
                size,
                mode,
            });
        }
        if total > MAX_INPUT_BYTES {
            return Err(bad(format!(
                "inputs: at most {MAX_INPUT_BYTES} bytes in all ({total} given)"
            )));
        }
        let digests: Vec<String> = data.inputs.iter().map(|i| i.digest.clone()).collect();
        let missing = cp.store.missing_blobs(account.id, &digests).await?;
        if !missing.is_empty() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "inputs: {} blob(s) not uploaded (PUT /v1/blobs/{{sha256}} first): {}",
                    missing.len(),
                    missing
                        .iter()
                        .take(5)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        // The sizes are the blobs', not the caller's word.
        for input in &mut data.inputs {
            input.size = cp
                .store
                .blob_size(account.id, &input.digest)
                .await?
                .unwrap_or(input.size);
        }
        cp.store.touch_blobs(account.id, &digests, now()).await?;
    }
    if let Some(dirs) = results {
        let dirs = dirs
            .as_array()
            .ok_or_else(|| bad("results_under must be a list of directories"))?;
        if dirs.len() > MAX_RESULT_DIRS {
            return Err(bad(format!(
                "results_under: at most {MAX_RESULT_DIRS} directories"
            )));
        }
        for dir in dirs {
            let dir = dir
                .as_str()
                .ok_or_else(|| bad("results_under must be a list of directories"))?;
            absolute("results_under", dir)?;
            if dir == "/" {
                return Err(bad("results_under: not the root directory"));
            }
            data.results_under
                .push(dir.trim_end_matches('/').to_owned());
        }
    }
    Ok(Some(data))
}

/// Reads a create body into a sweep, checking every field.
async fn new_sweep(
    cp: &ControlPlane,
    account: &Account,
    body: &Map<String, Value>,
) -> ApiResult<NewSweep> {
    let name = required_string(body, "name")?;
    if name.chars().count() > 128 {
        return Err(bad("name must be 1-128 characters"));
    }
    let template = required_string(body, "template")?;
    // A first-party template this host has, or one of the account's own.
    let known = match cp.template_source(account, &template).await {
        Ok(resolved) => cp.host.engine().template(&resolved.base).is_ok(),
        Err(_) => false,
    };
    if !known {
        return Err(bad(format!("template: unknown template {template}")));
    }
    let command = required_string(body, "command")?;
    let cells = cells(body)?;
    let env: Metadata = string_map(body, "env")?;
    let workdir = string(body, "workdir")?;
    if let Some(dir) = &workdir {
        absolute("workdir", dir)?;
    }
    let throttle = integer(body, "throttle", 1, u64::from(u32::MAX))?.unwrap_or(DEFAULT_THROTTLE);
    let timeout_seconds = integer(body, "timeout_seconds", 1, MAX_TIMEOUT_SECONDS)?
        .unwrap_or(DEFAULT_TIMEOUT_SECONDS);
    let retries = integer(body, "retries", 0, MAX_RETRIES)?.unwrap_or(0);
    let collect = match field(body, "collect") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                let path = item
                    .as_str()
                    .ok_or_else(|| bad("collect must be a list of paths"))?;
                absolute("collect", path)?;
                glob::Pattern::new(path)
                    .map_err(|e| bad(format!("collect: bad pattern {path:?}: {e}")))?;
                Ok(path.to_owned())
            })
            .collect::<ApiResult<Vec<_>>>()?,
        Some(_) => return Err(bad("collect must be a list of paths")),
    };
    let files = string_map(body, "files")?;
    let mut files_bytes = 0;
    for (path, content) in &files {
        absolute("files", path)?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(content)
            .map_err(|_| bad(format!("files.{path} must be base64")))?;
        files_bytes += bytes.len();
    }
    if files_bytes > MAX_FILES_BYTES {
        return Err(bad(format!(
            "files: at most {MAX_FILES_BYTES} bytes in all"
        )));
    }
    let fork_from = match field(body, "fork_from") {
        None => None,
        Some(Value::Object(spec)) => {
            let setup = match spec.get("setup") {
                Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
                _ => return Err(bad("fork_from.setup is required (a non-empty string)")),
            };
            let mut out = json!({ "setup": setup });
            match spec.get("timeout_seconds") {
                None | Some(Value::Null) => {}
                Some(v) => match v.as_u64() {
                    Some(t) if (1..=MAX_TIMEOUT_SECONDS).contains(&t) => out["timeout_seconds"] = json!(t),
                    _ => {
                        return Err(bad(format!(
                            "fork_from.timeout_seconds must be an integer from 1 to {MAX_TIMEOUT_SECONDS}"
                        )))
                    }
                },
            }
            Some(out)
        }
        Some(_) => return Err(bad("fork_from must be an object with setup")),
    };
    let after_ok = match field(body, "after_ok") {
        None => Vec::new(),
        Some(Value::Array(items)) => {
            let mut ids = Vec::new();
            for item in items {
                let reference = match item {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    _ => return Err(bad("after_ok must be a list of sweep ids or job ids")),
                };
                let sweep = find(cp, account, &reference)
                    .await?
                    .ok_or_else(|| bad(format!("after_ok: no sweep {reference}")))?;
                if !ids.contains(&sweep.id) {
                    ids.push(sweep.id);
                }
            }
            ids
        }
        Some(_) => return Err(bad("after_ok must be a list of sweep ids or job ids")),
    };
    let hold = match field(body, "hold") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("hold must be true or false")),
    };
    // Epoch seconds, or an RFC 3339 time.
    let begin_at = match field(body, "begin_at") {
        None => None,
        Some(Value::Number(n)) => Some(
            n.as_f64()
                .filter(|t| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| bad("begin_at must be a time: epoch seconds or RFC 3339"))?,
        ),
        Some(Value::String(t)) => Some(
            chrono::DateTime::parse_from_rfc3339(t)
                .map_err(|e| bad(format!("begin_at {t:?}: {e}")))?
                .timestamp() as f64,
        ),
        Some(_) => return Err(bad("begin_at must be a time: epoch seconds or RFC 3339")),
    };
    let slurm = match field(body, "slurm") {
        None => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(_) => return Err(bad("slurm must be an object")),
    };
    Ok(NewSweep {
        id: new_id(),
        account_id: account.id,
        name,
        template,
        command,
        env,
        cells,
        throttle: throttle as u32,
        timeout_seconds,
        max_attempts: retries as u32 + 1,
        collect,
        fork_from,
        after_ok,
        workdir,
        files,
        slurm,
        data_path: data_path(cp, account, body).await?,
        hold,
        begin_at,
    })
}

// ---- answers ----

/// The sweep JSON of SWEEPS.md.
fn sweep_json(row: &SweepRow, summary: &SweepSummary) -> Value {
    let counts = &summary.counts;
    json!({
        "id": row.id,
        "job_id": row.job_id,
        "name": row.name,
        "template": row.template,
        "command": row.command,
        "state": row.state.as_str(),
        "reason": row.reason,
        "throttle": row.throttle,
        "timeout_seconds": row.timeout_seconds,
        "retries": row.max_attempts.saturating_sub(1),
        "total": row.cells.len(),
        "counts": {
            "pending": counts.pending,
            "running": counts.running,
            "succeeded": counts.succeeded,
            "failed": counts.failed,
            "timeout": counts.timeout,
            "cancelled": counts.cancelled,
        },
        "progress": counts.progress(),
        "cpu_seconds": summary.cpu_seconds,
        "gib_seconds": summary.gib_seconds,
        "cost_usd": summary.cost_usd,
        "created_at": rfc3339(row.created_at),
        "started_at": row.started_at.map(rfc3339),
        "finished_at": row.finished_at.map(rfc3339),
        "env": row.env,
        "workdir": row.workdir,
        "collect": row.collect,
        "fork_from": row.fork_from,
        "after_ok": row.after_ok,
        "slurm": row.slurm,
        "inputs": row.data_path.as_ref().map(|d| d.inputs.len()),
        "hold": row.user_hold,
        "prelude_seconds": row.prelude_seconds,
        "begin_at": row.begin_at.map(rfc3339),
        "results_under": row.data_path.as_ref().map(|d| &d.results_under),
    })
}

/// The end of `text`, at most `max` bytes, on a character boundary.
fn tail(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The cell JSON of SWEEPS.md; `whole` gives the full output and the
/// collected files, else the output's last 4 KiB and no files.
fn cell_json(sweep: &SweepRow, cell: &CellRow, whole: bool) -> Value {
    let output = |text: &Option<String>| {
        let text = text.as_deref().unwrap_or("");
        if whole { text } else { tail(text, LIST_OUTPUT) }.to_owned()
    };
    let mut value = json!({
        "index": cell.idx,
        "value": cell.value,
        "job_id": sweep.job_id + u64::from(cell.idx),
        "state": cell.state.as_str(),
        "attempts": cell.attempts,
        "exit_code": cell.exit_code,
        "signal": cell.signal,
        "elapsed_ms": cell.elapsed_ms,
        "started_at": cell.started_at.map(rfc3339),
        "finished_at": cell.finished_at.map(rfc3339),
        "sandbox_id": cell.sandbox_id,
        "claimed_by": cell.claimed_by,
        "stdout": output(&cell.stdout_tail),
        "stderr": output(&cell.stderr_tail),
        "output_truncated": cell.output_truncated,
        "cpu_seconds": cell.cpu_seconds,
        "gib_seconds": cell.gib_seconds,
        "cost_usd": cell.cost_usd,
        "timings_ms": cell.timings,
        "error": cell.error,
        "max_rss_kib": cell.max_rss_kib,
        "task_cpu_ms": cell.task_cpu_ms,
    });
    if whole {
        value["collected"] = cell.collected.clone().unwrap_or_else(|| json!({}));
    }
    value
}

/// The caller's sweep by id or job id.
async fn find(
    cp: &ControlPlane,
    account: &Account,
    reference: &str,
) -> ApiResult<Option<SweepRow>> {
    if !reference.is_empty() && reference.bytes().all(|b| b.is_ascii_digit()) {
        return match reference.parse::<u64>() {
            Ok(job_id) => Ok(cp.store.sweep_by_job_id(account.id, job_id).await?),
            Err(_) => Ok(None),
        };
    }
    Ok(cp.store.get_sweep(account.id, reference).await?)
}

async fn owned(cp: &ControlPlane, account: &Account, reference: &str) -> ApiResult<SweepRow> {
    find(cp, account, reference)
        .await?
        .ok_or_else(|| ApiError::not_found("sweep not found"))
}

async fn answer(cp: &ControlPlane, account: &Account, id: &str) -> ApiResult<Json<Value>> {
    let row = cp
        .store
        .get_sweep(account.id, id)
        .await?
        .ok_or_else(|| ApiError::not_found("sweep not found"))?;
    let summary = cp.store.sweep_summary(account.id, id).await?;
    Ok(Json(sweep_json(&row, &summary)))
}

fn query_pairs(raw: Option<String>) -> ApiResult<Vec<(String, String)>> {
    serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| bad(format!("bad query string: {e}")))
}

// ---- routes ----

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    request: Request,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let body = json_object(request, MAX_CREATE_BODY).await?;
    let new = new_sweep(&cp, &account, &body).await?;
    let row = cp.store.create_sweep(&new, now()).await?;
    cp.runner.wake();
    let summary = cp.store.sweep_summary(account.id, &row.id).await?;
    Ok((StatusCode::CREATED, Json(sweep_json(&row, &summary))))
}

pub async fn list(
    State(cp): St,
    Caller(account): Caller,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let mut state = None;
    for (key, value) in query_pairs(q)? {
        if key == "state" {
            state = Some(value.parse::<SweepState>().map_err(|_| {
                bad(format!(
                    "state must be held, active, done or cancelled: {value:?}"
                ))
            })?);
        }
    }
    let mut sweeps = Vec::new();
    for row in cp.store.list_sweeps(account.id).await? {
        if state.is_some_and(|s| s != row.state) {
            continue;
        }
        let summary = cp.store.sweep_summary(account.id, &row.id).await?;
        sweeps.push(sweep_json(&row, &summary));
    }
    Ok(Json(json!({ "sweeps": sweeps })))
}

pub async fn get(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    answer(&cp, &account, &row.id).await
}

pub async fn patch(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<Value>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    let Value::Object(body) = body else {
        return Err(bad("the body must be a JSON object with throttle"));
    };
    let throttle = integer(&body, "throttle", 0, u64::from(u32::MAX))?
        .ok_or_else(|| bad("throttle is required (an integer, 0 pauses the sweep)"))?;
    cp.store
        .set_throttle(account.id, &row.id, throttle as u32)
        .await?;
    cp.runner.wake();
    answer(&cp, &account, &row.id).await
}

pub async fn cancel(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<Value>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    let cells = match &body {
        Value::Null => None,
        Value::Object(map) => match field(map, "cells") {
            None => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|item| {
                        item.as_u64()
                            .and_then(|n| u32::try_from(n).ok())
                            .ok_or_else(|| bad("cells must be a list of cell indexes"))
                    })
                    .collect::<ApiResult<Vec<u32>>>()?,
            ),
            Some(_) => return Err(bad("cells must be a list of cell indexes")),
        },
        _ => return Err(bad("the body must be a JSON object")),
    };
    let running = match cells {
        Some(indexes) => {
            cp.store
                .cancel_cells(account.id, &row.id, &indexes, now())
                .await?
        }
        None => cp.store.cancel_sweep(account.id, &row.id, now()).await?,
    }
    .ok_or_else(|| ApiError::not_found("sweep not found"))?;
    cp.runner.cancel(&running);
    answer(&cp, &account, &row.id).await
}

pub async fn requeue(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    cp.store.requeue_failed(account.id, &row.id).await?;
    cp.runner.wake();
    answer(&cp, &account, &row.id).await
}

/// `POST /v1/sweeps/{id}/hold`: no cell starts until released (running
/// ones go on). 409 unless the sweep is active or held.
pub async fn hold(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    if !cp.store.hold_sweep(account.id, &row.id).await? {
        return Err(ApiError::conflict(format!(
            "sweep {} is {}: only an active or held sweep can be held",
            row.id,
            row.state.as_str()
        )));
    }
    answer(&cp, &account, &row.id).await
}

/// `POST /v1/sweeps/{id}/release`: the hold goes; dependencies and
/// `begin_at` still decide. 409 unless the sweep was held by `hold`.
pub async fn release(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    if !cp.store.release_sweep(account.id, &row.id, now()).await? {
        return Err(ApiError::conflict(format!(
            "sweep {} is not held by a hold",
            row.id
        )));
    }
    cp.runner.wake();
    answer(&cp, &account, &row.id).await
}

pub async fn cells_list(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    let mut filter = CellFilter {
        limit: Some(DEFAULT_CELL_LIMIT),
        ..CellFilter::default()
    };
    let mut outputs = true;
    for (key, value) in query_pairs(q)? {
        let number = |name: &str| {
            value
                .parse::<u32>()
                .map_err(|_| bad(format!("{name} must be a non-negative integer: {value:?}")))
        };
        match key.as_str() {
            "state" if !value.is_empty() => {
                filter.state = Some(value.parse::<CellState>().map_err(|_| {
                    bad(format!(
                        "state must be pending, running, succeeded, failed, timeout or cancelled: {value:?}"
                    ))
                })?)
            }
            "offset" => filter.offset = Some(number("offset")?),
            "limit" => {
                let limit = number("limit")?;
                if !(1..=MAX_CELL_LIMIT).contains(&limit) {
                    return Err(bad(format!("limit must be from 1 to {MAX_CELL_LIMIT}")));
                }
                filter.limit = Some(limit);
            }
            "outputs" => {
                outputs = match value.as_str() {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(bad(format!("outputs must be true or false: {value:?}"))),
                }
            }
            _ => {}
        }
    }
    let cells = cp.store.list_cells(account.id, &row.id, &filter).await?;
    let summary = cp.store.sweep_summary(account.id, &row.id).await?;
    let total = match filter.state {
        Some(state) => summary.counts.get(state),
        None => summary.counts.total(),
    };
    let cells: Vec<Value> = cells
        .iter()
        .map(|c| {
            let mut cell = cell_json(&row, c, false);
            // A grid of 10,000 cells needs their states, not 8 KiB of
            // output tails each.
            if !outputs {
                if let Some(fields) = cell.as_object_mut() {
                    fields.remove("stdout");
                    fields.remove("stderr");
                }
            }
            cell
        })
        .collect();
    Ok(Json(json!({ "cells": cells, "total": total })))
}

pub async fn cell(
    State(cp): St,
    Caller(account): Caller,
    Path((id, index)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    let not_found = || ApiError::not_found("cell not found");
    let index: u32 = index.parse().map_err(|_| not_found())?;
    let cell = cp
        .store
        .get_cell(account.id, &row.id, index)
        .await?
        .ok_or_else(not_found)?;
    Ok(Json(cell_json(&row, &cell, true)))
}

/// `GET /v1/sweeps/{id}/cells/{index}/output?from=SEQ`: what the cell's
/// latest attempt printed, flush by flush from `from` (default 0), at most
/// 4 MiB: `{"epoch", "chunks": [{"seq", "stream", "data" (base64)}],
/// "next"}`. `epoch` changes when the cell is tried again (its output
/// starts over).
pub async fn cell_output(
    State(cp): St,
    Caller(account): Caller,
    Path((id, index)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let row = owned(&cp, &account, &id).await?;
    let index: u32 = index
        .parse()
        .ok()
        .filter(|i| (*i as usize) < row.cells.len())
        .ok_or_else(|| ApiError::not_found("cell not found"))?;
    let mut from = 0u64;
    for (key, value) in query_pairs(q)? {
        if key == "from" {
            from = value
                .parse()
                .map_err(|_| bad(format!("from must be a flush number: {value:?}")))?;
        }
    }
    let Some((epoch, chunks)) = cp
        .store
        .cell_output(&row.id, index, from, OUTPUT_PAGE)
        .await?
    else {
        return Ok(Json(json!({ "epoch": null, "chunks": [], "next": from })));
    };
    let next = chunks.last().map_or(from, |c| c.seq + 1);
    let chunks: Vec<Value> = chunks
        .iter()
        .map(|c| {
            json!({
                "seq": c.seq,
                "stream": c.stream,
                "data": base64::engine::general_purpose::STANDARD.encode(&c.data),
            })
        })
        .collect();
    Ok(Json(
        json!({ "epoch": epoch, "chunks": chunks, "next": next }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    #[test]
    fn cells_are_lists_or_ranges() {
        assert_eq!(
            cells(&body(json!({"cells": ["a", 2, 2.5]}))).unwrap(),
            vec!["a", "2", "2.5"]
        );
        assert_eq!(
            cells(&body(json!({"cells": {"start": 0, "end": 10, "step": 5}}))).unwrap(),
            vec!["0", "5", "10"]
        );
        assert_eq!(
            cells(&body(json!({"cells": {"start": 3, "end": 3}}))).unwrap(),
            vec!["3"]
        );
        for bad in [
            json!({}),
            json!({"cells": []}),
            json!({"cells": [true]}),
            json!({"cells": {"start": 5, "end": 1}}),
            json!({"cells": {"start": 0, "end": 10, "step": 0}}),
            json!({"cells": {"start": 0, "end": 100_000}}),
            json!({"cells": "0-9"}),
        ] {
            let error = cells(&body(bad.clone())).unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(error.message.contains("cells"), "{bad}: {}", error.message);
        }
    }

    #[test]
    fn integers_name_their_field() {
        let b = body(json!({"throttle": 0, "retries": 11, "timeout_seconds": "5"}));
        assert!(integer(&b, "throttle", 1, 10)
            .unwrap_err()
            .message
            .starts_with("throttle"));
        assert!(integer(&b, "retries", 0, 10)
            .unwrap_err()
            .message
            .starts_with("retries"));
        assert!(integer(&b, "timeout_seconds", 1, 10)
            .unwrap_err()
            .message
            .starts_with("timeout_seconds"));
        assert_eq!(integer(&b, "missing", 1, 10).unwrap(), None);
    }
}
