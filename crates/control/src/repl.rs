//! Repl sessions (the SDK's code contexts) over the host's kernels.

use crate::error::{ApiError, ApiResult};
use crate::extract::{Body, Caller};
use crate::{now, rfc3339, ControlPlane};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

type St = State<Arc<ControlPlane>>;

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CreateBody {
    language: Option<String>,
}

pub async fn create(
    State(cp): St,
    Caller(account): Caller,
    Path(id): Path<String>,
    Body(body): Body<CreateBody>,
) -> ApiResult<impl IntoResponse> {
    let language = body
        .language
        .unwrap_or_else(|| "python".into())
        .to_lowercase();
    if !matches!(language.as_str(), "python" | "python3" | "py") {
        return Err(ApiError::bad_request(format!(
            "unsupported language: {language}"
        )));
    }
    cp.running(&account, &id).await?;
    let session = cp.host.start_session(&id).await?;
    Ok((
        StatusCode::CREATED,
        Json(
            json!({ "id": session, "sandbox_id": id, "language": "python", "created_at": rfc3339(now()) }),
        ),
    ))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct RunBody {
    code: Option<String>,
    timeout_ms: Option<f64>,
}

impl RunBody {
    /// The cell's timeout: 0 or absent for none, a 400 past a week.
    pub(crate) fn timeout(&self) -> ApiResult<Option<std::time::Duration>> {
        crate::exec::timeout_in(
            "timeout_ms",
            self.timeout_ms,
            0.001,
            crate::exec::MAX_TIMEOUT_SECONDS * 1000.0,
        )
    }
}

pub async fn run(
    State(cp): St,
    Caller(account): Caller,
    Path((id, session)): Path<(String, String)>,
    Body(body): Body<RunBody>,
) -> ApiResult<Json<Value>> {
    let timeout = body.timeout()?;
    let code = body
        .code
        .ok_or_else(|| ApiError::bad_request("code must be a string"))?;
    cp.running(&account, &id).await?;
    // A cell in flight is activity: the reaper never takes a sandbox
    // mid-cell, however long the cell outlasts the TTL.
    let _activity = crate::exec::Activity::start(&cp, &id, None).await?;
    let output = cp
        .host
        .run_cell(&id, &session, &code, timeout)
        .await
        .map_err(|e| {
            let mut error = ApiError::from(e);
            if error.status == StatusCode::GATEWAY_TIMEOUT {
                error.message = format!(
                    "cell timeout after {}s",
                    timeout.map_or(0.0, |t| t.as_secs_f64())
                );
            }
            error
        })?;
    let mut value = serde_json::to_value(&output).map_err(|e| ApiError::internal(e.to_string()))?;
    value["exit"] = value["exit_code"].clone();
    Ok(Json(value))
}

pub async fn close(
    State(cp): St,
    Caller(account): Caller,
    Path((id, session)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    cp.owned(&account, &id).await?;
    cp.host.close_session(&id, &session).await?;
    Ok(StatusCode::NO_CONTENT)
}
