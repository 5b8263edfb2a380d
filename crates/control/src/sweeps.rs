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
    Account, CellFilter, CellRow, CellState, Metadata, NewSweep, SweepRow, SweepState, SweepSummary,
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
            _ => {}
        }
    }
    let cells = cp.store.list_cells(account.id, &row.id, &filter).await?;
    let summary = cp.store.sweep_summary(account.id, &row.id).await?;
    let total = match filter.state {
        Some(state) => summary.counts.get(state),
        None => summary.counts.total(),
    };
    let cells: Vec<Value> = cells.iter().map(|c| cell_json(&row, c, false)).collect();
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
