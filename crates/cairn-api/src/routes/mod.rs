//! Handlers: each parses its request, calls one engine service, maps the
//! result.

pub mod exec;
pub mod files;
pub mod proxy;
pub mod runs;
pub mod sandboxes;
pub mod session_files;
pub mod sessions;
pub mod system;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use cairn_engine::access::Claim;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::app::App;
use crate::error::{ApiError, ApiResult};

/// A JSON body, with the field at fault named when it does not parse. An
/// empty body is `{}`.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    (status, axum::Json(value)).into_response()
}

/// Runs `work` once per `Idempotency-Key` (per `scope`): a retried request
/// with the same key and body gets the first answer again, one arriving
/// while the first is in flight gets 409, one with another body 422.
pub async fn idempotent<F, Fut>(
    app: &Arc<App>,
    headers: &HeaderMap,
    scope: &str,
    body: &Bytes,
    work: F,
) -> ApiResult<Response>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ApiResult<(StatusCode, serde_json::Value)>>,
{
    let key = match headers.get("idempotency-key") {
        None => {
            let (status, value) = work().await?;
            return Ok(json(status, &value));
        }
        Some(v) => v
            .to_str()
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= 255)
            .ok_or_else(|| ApiError::bad_request("Idempotency-Key must be 1 to 255 visible ASCII characters"))?
            .to_string(),
    };
    let stale_before = app.started_ms;
    // Each tenant's keys are its own: another's answer is never replayed.
    let scope = match crate::tenancy::current() {
        Some(t) => format!("{scope}@{t}"),
        None => scope.to_string(),
    };
    let (s, k, b) = (scope.clone(), key.clone(), body.clone());
    let claim = app
        .engine(move |e| Ok(e.claim_idempotent(&s, &k, &b, stale_before)?))
        .await?;
    match claim {
        Claim::Answered { status, body } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            let value: serde_json::Value = serde_json::from_str(&body).unwrap_or(serde_json::Value::Null);
            Ok(json(status, &value))
        }
        Claim::InFlight => Err(ApiError::conflict(format!(
            "a request with Idempotency-Key {key:?} is still in progress; retry when it is done"
        ))),
        Claim::Mismatch => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("Idempotency-Key {key:?} was used with another request body; use a new key"),
        )),
        Claim::New => match work().await {
            Ok((status, value)) => {
                let text = value.to_string();
                let (s, k) = (scope.clone(), key.clone());
                app.engine(move |e| Ok(e.answer_idempotent(&s, &k, status.as_u16(), &text)?))
                    .await?;
                Ok(json(status, &value))
            }
            Err(err) => {
                let _ = app.engine(move |e| Ok(e.release_idempotent(&scope, &key)?)).await;
                Err(err)
            }
        },
    }
}
