//! The shape of `/v1/me/tokens` on the wire, shared by every process that
//! answers it: a host's control plane (one-host installs) and the fleet's
//! front (whose agents' database roles cannot read tokens). What a create
//! body may ask for, checked, and what a token looks like to its owner.

use crate::{TokenInfo, MAX_TOKEN_LABEL};
use serde_json::{json, Map, Value};

/// The longest life a token may be given.
pub const MAX_TOKEN_DAYS: u64 = 3650;

/// A checked `POST /v1/me/tokens` body.
#[derive(Debug, PartialEq)]
pub struct TokenRequest {
    pub label: String,
    pub expires_at: Option<f64>,
}

impl TokenRequest {
    /// `label` (or PandaStack's `name`), at most [`MAX_TOKEN_LABEL`]
    /// printable characters, and `expires_in_days` (1 to
    /// [`MAX_TOKEN_DAYS`]) counted from `now`. The error is the message of
    /// a 400.
    pub fn parse(body: &Map<String, Value>, now: f64) -> Result<TokenRequest, String> {
        let text = |key: &str| match body.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("{key} must be a string")),
        };
        let label = match text("label")? {
            Some(label) => label,
            None => text("name")?.unwrap_or_default(),
        };
        if label.chars().count() > MAX_TOKEN_LABEL || label.chars().any(char::is_control) {
            return Err(format!(
                "label must be at most {MAX_TOKEN_LABEL} printable characters"
            ));
        }
        let days = match body.get("expires_in_days") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(d) if (1..=MAX_TOKEN_DAYS).contains(&d) => Some(d),
                _ => {
                    return Err(format!(
                        "expires_in_days must be an integer from 1 to {MAX_TOKEN_DAYS}"
                    ))
                }
            },
        };
        Ok(TokenRequest {
            label,
            expires_at: days.map(|d| now + d as f64 * 86_400.0),
        })
    }
}

impl TokenInfo {
    /// The token as its owner sees it (never the secret): `name` repeats
    /// `label` for PandaStack's CLI.
    pub fn view(&self) -> Value {
        json!({
            "prefix": self.prefix,
            "label": self.label,
            "name": self.label,
            "created_at": rfc3339(self.created_at),
            "expires_at": self.expires_at.map(rfc3339),
        })
    }
}

/// `GET /v1/me/tokens`'s answer: `{"items": [...]}`, as PandaStack's server.
pub fn token_list_view(tokens: &[TokenInfo]) -> Value {
    json!({ "items": tokens.iter().map(TokenInfo::view).collect::<Vec<_>>() })
}

fn rfc3339(seconds: f64) -> String {
    chrono::DateTime::from_timestamp_millis((seconds * 1000.0) as i64)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_token_request_takes_label_or_name_and_a_bounded_life() {
        let r = TokenRequest::parse(&body(json!({"name": "ci", "expires_in_days": 2})), 100.0);
        assert_eq!(
            r,
            Ok(TokenRequest {
                label: "ci".into(),
                expires_at: Some(100.0 + 2.0 * 86_400.0)
            })
        );
        let r = TokenRequest::parse(&body(json!({"label": "a", "name": "b"})), 0.0).unwrap();
        assert_eq!(r.label, "a");
        assert_eq!(TokenRequest::parse(&Map::new(), 0.0).unwrap().label, "");
        for bad in [
            json!({"label": 3}),
            json!({"label": "x".repeat(MAX_TOKEN_LABEL + 1)}),
            json!({"label": "a\nb"}),
            json!({"expires_in_days": 0}),
            json!({"expires_in_days": MAX_TOKEN_DAYS + 1}),
            json!({"expires_in_days": -1}),
            json!({"expires_in_days": 1.5}),
            json!({"expires_in_days": "7"}),
        ] {
            assert!(
                TokenRequest::parse(&body(bad.clone()), 0.0).is_err(),
                "{bad}"
            );
        }
    }
}
