//! `GET /v1/usage` and `GET /v1/sandboxes/{id}/usage`: metered CPU-seconds,
//! GiB-seconds and cost, per sandbox, deleted ones included.

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, RawQuery, State};
use axum::Json;
use serde_json::{json, Value};
use shoal_store::{Account, UsageQuery};
use std::sync::Arc;

const DEFAULT_WINDOW_SECONDS: f64 = 30.0 * 86400.0;

type St = State<Arc<ControlPlane>>;

fn parse_time(name: &str, text: &str) -> ApiResult<f64> {
    if let Ok(seconds) = text.parse::<f64>() {
        // "NaN" and "inf" parse too, and compare as nothing else does.
        if !seconds.is_finite() {
            return Err(ApiError::bad_request(format!(
                "{name} must be a finite number of seconds: {text:?}"
            )));
        }
        return Ok(seconds);
    }
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.timestamp_millis() as f64 / 1000.0)
        .map_err(|_| {
            ApiError::bad_request(format!("{name} must be RFC 3339 or Unix seconds: {text:?}"))
        })
}

fn parse_query(raw: Option<String>) -> ApiResult<UsageQuery> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(format!("bad query string: {e}")))?;
    let mut query = UsageQuery::default();
    for (key, value) in pairs {
        match key.as_str() {
            "from" => query.from = Some(parse_time("from", &value)?),
            "to" => query.to = Some(parse_time("to", &value)?),
            "metadata" => {
                let (k, v) = value.split_once('=').ok_or_else(|| {
                    ApiError::bad_request(format!("metadata filter must be key=value: {value:?}"))
                })?;
                query.metadata.push((k.to_string(), v.to_string()));
            }
            _ => {}
        }
    }
    if let (Some(from), Some(to)) = (query.from, query.to) {
        if from > to {
            return Err(ApiError::bad_request("from is after to"));
        }
    }
    Ok(query)
}

/// Rows and totals for `query`; an open `to` means now, after a fresh
/// sample, and an open `from` the 30 days before it.
async fn report(
    cp: &ControlPlane,
    account: &Account,
    query: &mut UsageQuery,
) -> ApiResult<(Vec<Value>, Value)> {
    cp.meter.sample_account(cp, account).await;
    let to = *query.to.get_or_insert_with(now);
    query.from.get_or_insert(to - DEFAULT_WINDOW_SECONDS);
    let report = cp.store.usage(account.id, query).await?;
    let mut items = Vec::new();
    let mut wall_total = 0.0;
    for row in &report.rows {
        let sandbox = cp.store.sandbox_by_id(&row.sandbox_id).await?;
        let (status, created, ended) = sandbox
            .as_ref()
            .map(|s| (s.status.clone(), s.created_at, s.deleted_at))
            .unwrap_or_else(|| ("deleted".into(), 0.0, None));
        let wall = (ended.unwrap_or_else(now).min(query.to.unwrap_or(f64::MAX))
            - created.max(query.from.unwrap_or(0.0)))
        .max(0.0);
        wall_total += wall;
        items.push(json!({
            "sandbox_id": row.sandbox_id,
            "template": row.template,
            "metadata": row.metadata,
            "status": status,
            "created_at": rfc3339(created),
            "ended_at": ended.map(rfc3339),
            "wall_seconds": wall,
            "cpu_seconds": row.cpu_seconds,
            "gib_seconds": row.gib_seconds,
            "cost": row.cost_usd,
        }));
    }
    let totals = json!({
        "sandboxes": items.len(),
        "wall_seconds": wall_total,
        "cpu_seconds": report.total.cpu_seconds,
        "gib_seconds": report.total.gib_seconds,
        "cost": report.total.cost_usd,
    });
    Ok((items, totals))
}

pub async fn account_usage(
    State(cp): St,
    Caller(account): Caller,
    RawQuery(q): RawQuery,
) -> ApiResult<Json<Value>> {
    let mut query = parse_query(q)?;
    let (items, totals) = report(&cp, &account, &mut query).await?;
    Ok(Json(json!({
        "account": account.name,
        "from": rfc3339(query.from.unwrap_or(0.0)),
        "to": rfc3339(query.to.unwrap_or(0.0)),
        "currency": "USD",
        "items": items,
        "totals": totals,
    })))
}

pub async fn sandbox_usage(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let Some(sandbox) = cp.store.get_sandbox(account.id, &id).await? else {
        return Err(ApiError::sandbox_not_found());
    };
    let mut query = UsageQuery {
        from: Some(0.0),
        sandbox_id: Some(id.clone()),
        ..UsageQuery::default()
    };
    let (items, _) = report(&cp, &account, &mut query).await?;
    let item = items.into_iter().next().unwrap_or_else(|| {
        json!({
            "sandbox_id": id,
            "template": sandbox.template,
            "metadata": sandbox.metadata,
            "status": sandbox.status,
            "created_at": rfc3339(sandbox.created_at),
            "ended_at": sandbox.deleted_at.map(rfc3339),
            "wall_seconds": 0.0,
            "cpu_seconds": 0.0,
            "gib_seconds": 0.0,
            "cost": 0.0,
        })
    });
    Ok(Json(item))
}
