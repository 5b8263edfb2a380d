//! Every failure the API reports, as `{"error": "..."}` with its status.
//!
//! The mapping from store, host and engine errors lives here and nowhere
//! else. Refusals a client may retry (503 with Retry-After, 507) are only
//! made before anything exists (see docs/api/CONTRACT.md 1.8).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use shoal_host::{EngineError, HostError, ReplError};
use shoal_proto::client::AgentError;
use shoal_proto::ErrorKind;
use shoal_store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub retry_after: Option<u32>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
    pub fn sandbox_not_found() -> Self {
        Self::not_found("sandbox not found")
    }
    pub fn no_capacity() -> Self {
        ApiError {
            retry_after: Some(5),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no compute capacity available",
            )
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        crate::metrics::metrics().refused(self.status, &self.message);
        let body = serde_json::json!({ "error": self.message });
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // A body refused part way is left unread, so the connection cannot
        // carry another request: say so, or a client reusing it (requests'
        // pool) fails its next request on a closed socket.
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Quota { message } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("quota exceeded: the {message}"),
            ),
            StoreError::NotFound { message } => Self::not_found(message),
            StoreError::Conflict { message } => Self::conflict(message),
            // The details (a statement's error, a server's address) are
            // for the operator's log, not for the client.
            other => {
                tracing::error!(error = other.chain(), "database");
                Self::internal("database error")
            }
        }
    }
}

impl From<HostError> for ApiError {
    fn from(e: HostError) -> Self {
        match e {
            HostError::Full | HostError::Overcommitted { .. } => Self::no_capacity(),
            HostError::MemoryShort { .. } => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient host memory for sandbox",
            ),
            HostError::Engine(e) => e.into(),
            HostError::Repl(e) => e.into(),
            HostError::NoSuchSession => Self::not_found("session not found"),
            HostError::DiskShort { .. } => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient host storage",
            ),
            HostError::StorageShort { .. } => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient host storage for volume",
            ),
            HostError::Volume(message) => {
                tracing::error!(error = message, "volume image");
                Self::internal(format!("volume image: {message}"))
            }
            HostError::Invalid(message) => Self::conflict(message),
            HostError::Import(message) => Self::new(StatusCode::UNPROCESSABLE_ENTITY, message),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::UnknownTemplate(name) => {
                Self::bad_request(format!("unknown template: {name}"))
            }
            EngineError::NoSuchSandbox(_) => Self::sandbox_not_found(),
            EngineError::NoSuchSnapshot(_) => Self::not_found("snapshot not found"),
            EngineError::WrongState { state, .. } => Self::conflict(format!("sandbox is {state}")),
            EngineError::InvalidInput(message) => Self::bad_request(message),
            e @ (EngineError::HasVolumes(_)
            | EngineError::OutOfMemory(_)
            | EngineError::Failed { .. }) => Self::conflict(e.to_string()),
            EngineError::Agent(e) => e.into(),
            EngineError::Timeout(what) => {
                Self::new(StatusCode::GATEWAY_TIMEOUT, format!("timeout {what}"))
            }
            other => {
                let message = shoal_host::EngineError::to_string(&other);
                tracing::error!(error = %shoal_host::error_chain(&other), "engine");
                Self::internal(format!("engine error: {message}"))
            }
        }
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::Guest { kind, message } => {
                let status = match kind {
                    ErrorKind::NotFound => StatusCode::NOT_FOUND,
                    ErrorKind::PermissionDenied | ErrorKind::ReadOnly => StatusCode::FORBIDDEN,
                    ErrorKind::IsADirectory
                    | ErrorKind::NotADirectory
                    | ErrorKind::AlreadyExists
                    | ErrorKind::NotEmpty
                    | ErrorKind::InvalidInput => StatusCode::BAD_REQUEST,
                    ErrorKind::Io | ErrorKind::Protocol => StatusCode::INTERNAL_SERVER_ERROR,
                };
                Self::new(status, message)
            }
            AgentError::Timeout => Self::new(StatusCode::GATEWAY_TIMEOUT, "guest agent timeout"),
            other => Self::internal(format!("guest agent: {other}")),
        }
    }
}

impl From<ReplError> for ApiError {
    fn from(e: ReplError) -> Self {
        match e {
            ReplError::Timeout { .. } => Self::new(StatusCode::GATEWAY_TIMEOUT, "cell timeout"),
            ReplError::NoPython => Self::bad_request("this template has no python3 for a repl"),
            other => Self::internal(format!("repl: {other}")),
        }
    }
}
