//! The E2B-compatible gateway (`cairn serve --e2b ADDR`): code written
//! against the `e2b` Python SDK runs against Cairn by pointing
//! `E2B_API_URL` and `E2B_SANDBOX_URL` at this listener. One listener
//! serves both the control plane (`/v2/sandboxes`, `/sandboxes/...`,
//! `/snapshots`; `X-API-KEY` is a Cairn API token) and envd (`/health`,
//! `/files`, `/process.Process/*`, `/filesystem.Filesystem/*`; the sandbox
//! is named by `E2b-Sandbox-Id` and proven by the `X-Access-Token` this
//! gateway issued). See `docs/e2b.md`.
//!
//! An E2B sandbox keeps its id across pause and resume while the Cairn
//! sandbox under it changes: [`book`] keeps that mapping, durable in the
//! state directory.

mod book;
mod control;
mod envd;
mod files;
mod rpc;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use cairn_sandbox::client::ExecControl;
use tokio::sync::broadcast;

use crate::app::App;
use crate::error::ApiError;

pub use book::{Book, Entry, Life};

/// The envd version reported: ≥ 0.5.2 so the SDK allows `close_stdin`,
/// ≥ 0.4.0 so it sends no user unless asked.
pub const ENVD_VERSION: &str = "0.5.7";
/// A sandbox's lifetime when create names none (E2B's default).
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// The longest lifetime accepted (E2B's limit is 24 hours).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

/// A process started through `Process/Start`, for `Connect`, `List`,
/// `SendInput`, `SendSignal` and `CloseStdin`.
pub(crate) struct Proc {
    pub control: ExecControl,
    /// The `ProcessInfo` JSON `Process/List` answers.
    pub info: serde_json::Value,
    /// Every event after `start`, framed, for reattached streams.
    pub events: broadcast::Sender<bytes::Bytes>,
}

/// The gateway's shared state.
pub struct Gateway {
    pub(crate) app: Arc<App>,
    pub(crate) book: Mutex<Book>,
    /// Running processes by (E2B sandbox id, pid).
    pub(crate) procs: Mutex<HashMap<(String, i32), Proc>>,
    /// Whether a Cairn sandbox has `/bin/bash` (the SDK runs every
    /// command through it).
    pub(crate) bash: Mutex<HashMap<String, bool>>,
}

impl Gateway {
    pub(crate) fn entry(&self, id: &str) -> Option<Entry> {
        self.book.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    /// Changes the book and writes it down.
    pub(crate) fn update<T>(&self, f: impl FnOnce(&mut Book) -> T) -> Result<T, ApiError> {
        let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut book);
        book.save(&self.app.home)
            .map_err(|e| ApiError::internal(format!("cannot record E2B sandboxes: {e}")))?;
        Ok(out)
    }

    /// Forgets the processes of a sandbox that stopped or paused.
    pub(crate) fn drop_procs(&self, id: &str) {
        let mut p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|(sid, _), _| sid != id);
    }
}

/// A control-plane error: `{"code": <status>, "message"}`, as the SDK
/// parses it.
#[derive(Debug)]
pub struct RestError {
    pub status: StatusCode,
    pub message: String,
}

impl RestError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> RestError {
        RestError {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> RestError {
        RestError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(id: &str) -> RestError {
        RestError::new(
            StatusCode::NOT_FOUND,
            format!("sandbox {id:?} doesn't exist or you don't have access to it"),
        )
    }
}

impl From<ApiError> for RestError {
    fn from(e: ApiError) -> RestError {
        RestError::new(e.status, e.message)
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = %self.status, "e2b: {}", self.message);
        }
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        let mut resp = (self.status, axum::Json(body)).into_response();
        // Nothing here gets better by retrying at once.
        resp.headers_mut()
            .insert("should-retry", axum::http::HeaderValue::from_static("false"));
        resp
    }
}

/// Every route the E2B SDK calls: the control plane and envd.
pub fn router(app: Arc<App>) -> Router {
    let book = Book::load(&app.home).unwrap_or_else(|e| {
        tracing::error!("e2b: cannot read the E2B sandbox book, starting empty: {e}");
        Book::default()
    });
    let gw = Arc::new(Gateway {
        app,
        book: Mutex::new(book),
        procs: Mutex::new(HashMap::new()),
        bash: Mutex::new(HashMap::new()),
    });
    control::spawn_reaper(Arc::clone(&gw));
    let api = Router::new()
        .route("/v2/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes", get(control::list))
        .route("/sandboxes/{id}", get(control::info).delete(control::kill))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/snapshots", post(control::create_snapshot))
        .route("/sandboxes/{id}/fork", post(control::fork))
        .route("/snapshots", get(control::snapshots))
        .route("/templates/{id}", delete(control::delete_snapshot))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&gw),
            control::require_api_key,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20));
    let envd = Router::new()
        .route("/health", get(envd::health))
        .route(
            "/files",
            get(files::read)
                .post(files::write)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/process.Process/{method}", post(rpc::process))
        .route("/filesystem.Filesystem/{method}", post(rpc::filesystem));
    api.merge(envd)
        .fallback(|req: axum::extract::Request| async move {
            RestError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "{} {} is not part of the E2B API Cairn serves; see docs/e2b.md",
                    req.method(),
                    req.uri().path()
                ),
            )
        })
        .with_state(gw)
}
