//! A client of a running `shoal up` (or fleet front) for the tests that
//! drive the HTTP API: one request builder, every answer read the same way.

use reqwest::{Method, StatusCode};
use serde_json::Value;
use std::time::Duration;

pub struct ApiClient {
    pub http: reqwest::Client,
    /// `http://host:port`, without a trailing slash.
    pub base: String,
    pub token: String,
}

/// An answer: status, Retry-After, the body as text and (if it is) JSON.
pub struct Answer {
    pub status: StatusCode,
    pub retry_after: Option<String>,
    pub text: String,
    /// `Value::Null` when the body is not JSON.
    pub json: Value,
}

impl ApiClient {
    pub fn new(base: impl Into<String>, token: impl Into<String>) -> ApiClient {
        ApiClient {
            http: reqwest::Client::new(),
            base: base.into(),
            token: token.into(),
        }
    }

    /// `method path` with the bearer token and `body` as JSON.
    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Answer {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(120));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("calling the API");
        let status = response.status();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let text = response.text().await.unwrap_or_default();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer {
            status,
            retry_after,
            text,
            json,
        }
    }

    /// [`ApiClient::call`] that must succeed; its JSON body.
    pub async fn ok(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let answer = self.call(method, path, body).await;
        assert!(
            answer.status.is_success(),
            "{path}: {} {}",
            answer.status,
            answer.text
        );
        answer.json
    }
}
