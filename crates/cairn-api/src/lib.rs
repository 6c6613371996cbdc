//! Cairn's HTTP API (`cairn serve`): the engine over HTTP/JSON, a thin
//! shell. Each handler parses its request, calls one engine service and
//! maps the result; errors have one shape and one status mapping
//! ([`error`]); the OpenAPI document is generated from the handlers'
//! types ([`openapi_json`]) and checked in at `docs/openapi.json`.
//!
//! The server listens on a Unix socket in the state directory (mode
//! 0600: whoever can reach it owns the state directory anyway) and, with
//! `--listen`, on TCP, where every request needs a bearer token made with
//! `cairn token create`. [`ui`] is the lineage page at `/ui/`.

pub mod acting;
pub mod admission;
pub mod app;
pub mod audit;
pub mod e2b;
pub mod error;
pub mod hosts;
pub mod init_pool;
pub mod listen;
pub mod mcp;
pub mod metrics;
pub mod model;
pub mod routes;
pub mod serve;
pub mod tenancy;
pub mod ui;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::Router;
use utoipa::OpenApi;

pub use app::{App, Settings};
pub use listen::Limits;
pub use serve::{serve, ServeOptions};

use crate::error::ApiError;
use crate::routes::{exec, files, proxy, runs, sandboxes, session_files, sessions, system};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Cairn",
        description = "Durable, forkable execution environments for AI agents: sandboxes, snapshots, forks, \
                       restores, durable pipelines and agent sessions. Errors are {\"error\": {\"code\", \"message\"}}.",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    paths(
        system::healthz, system::metrics, system::openapi, system::events,
        sandboxes::create, sandboxes::list, sandboxes::get, sandboxes::remove, sandboxes::port,
        exec::exec, exec::exec_stream, exec::stdin, exec::signal,
        files::stat, files::download, files::upload, files::list, files::mkdir, files::rename, files::remove,
        sandboxes::snapshot, sandboxes::fork_sandbox, sandboxes::reset,
        sandboxes::snapshots, sandboxes::diff, sandboxes::verify, sandboxes::get_snapshot, sandboxes::remove_snapshot,
        sandboxes::fork_snapshot, sandboxes::restore,
        system::images, system::build_image, system::import_image, system::remove_image,
        runs::start, runs::list, runs::get, runs::audit, runs::resume, runs::approve, runs::reject, runs::log, runs::artifact,
        runs::dlq, runs::dlq_get, runs::dlq_retry,
        sessions::create, sessions::list, sessions::get, sessions::remove,
        sessions::log, sessions::append, sessions::verify, sessions::exec, sessions::exec_stream,
        sessions::suspend, sessions::resume, sessions::fork, sessions::rewind, sessions::recover,
        session_files::download, session_files::upload, session_files::export, session_files::import,
    ),
    components(schemas(app::Event)),
    modifiers(&Security),
    security(("bearer" = [])),
)]
struct ApiDoc;

struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Needed on TCP listeners (`cairn token create`); the Unix socket needs none",
                    ))
                    .build(),
            ),
        );
    }
}

/// The OpenAPI 3.1 document, as checked in at `docs/openapi.json`.
pub fn openapi_json() -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc.to_pretty_json().expect("the document serialises") + "\n"
}

/// Every route of the native API.
pub fn router(app: Arc<App>) -> Router {
    let no_limit = axum::extract::DefaultBodyLimit::disable();
    // MCP streams end when the server stops, or graceful shutdown waits on them.
    let mcp_stop = tokio_util::sync::CancellationToken::new();
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        let (stopped, stop) = (app.stopped(), mcp_stop.clone());
        rt.spawn(async move {
            stopped.await;
            stop.cancel();
        });
    }
    Router::new()
        .nest_service("/mcp", mcp::http_service(app.home.clone(), mcp_stop))
        .route("/ui", get(ui::root))
        .route("/ui/", get(ui::index))
        .route("/ui/{file}", get(ui::asset))
        .route("/healthz", get(system::healthz))
        .route("/metrics", get(system::metrics))
        .route("/v1/openapi.json", get(system::openapi))
        .route("/v1/events", get(system::events))
        .route("/v1/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route("/v1/sandboxes/{id}", get(sandboxes::get).delete(sandboxes::remove))
        .route("/v1/sandboxes/{id}/ports/{port}", get(sandboxes::port))
        .route("/v1/sandboxes/{id}/ports/{port}/http", any(proxy::root).layer(no_limit))
        .route(
            "/v1/sandboxes/{id}/ports/{port}/http/",
            any(proxy::root).layer(no_limit),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/http/{*path}",
            any(proxy::path).layer(no_limit),
        )
        .route("/v1/sandboxes/{id}/exec", post(exec::exec))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec::exec_stream))
        .route("/v1/sandboxes/{id}/processes/{pid}/stdin", post(exec::stdin))
        .route("/v1/sandboxes/{id}/processes/{pid}/signal", post(exec::signal))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::download)
                .merge(put(files::upload).layer(no_limit))
                .delete(files::remove),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route("/v1/sandboxes/{id}/files/move", post(files::rename))
        .route("/v1/sandboxes/{id}/snapshots", post(sandboxes::snapshot))
        .route("/v1/sandboxes/{id}/fork", post(sandboxes::fork_sandbox))
        .route("/v1/sandboxes/{id}/reset", post(sandboxes::reset))
        .route("/v1/snapshots", get(sandboxes::snapshots))
        .route("/v1/diff", get(sandboxes::diff))
        .route("/v1/snapshots/{id}/verify", post(sandboxes::verify))
        .route(
            "/v1/snapshots/{id}",
            get(sandboxes::get_snapshot).delete(sandboxes::remove_snapshot),
        )
        .route("/v1/snapshots/{id}/fork", post(sandboxes::fork_snapshot))
        .route("/v1/snapshots/{id}/restore", post(sandboxes::restore))
        .route("/v1/images", get(system::images).post(system::build_image))
        .route("/v1/images/import", post(system::import_image).layer(no_limit))
        .route("/v1/images/{name}", axum::routing::delete(system::remove_image))
        .route("/v1/runs", post(runs::start).get(runs::list))
        .route("/v1/runs/{id}", get(runs::get))
        .route("/v1/runs/{id}/audit", get(runs::audit))
        .route("/v1/runs/{id}/resume", post(runs::resume))
        .route("/v1/runs/{id}/stages/{stage}/approve", post(runs::approve))
        .route("/v1/runs/{id}/stages/{stage}/reject", post(runs::reject))
        .route("/v1/runs/{id}/logs/{stage}", get(runs::log))
        .route("/v1/artifacts/{id}", get(runs::artifact))
        .route("/v1/dlq", get(runs::dlq))
        .route("/v1/dlq/{id}", get(runs::dlq_get))
        .route("/v1/dlq/{id}/retry", post(runs::dlq_retry))
        .route("/v1/sessions", post(sessions::create).get(sessions::list))
        .route("/v1/sessions/{id}", get(sessions::get).delete(sessions::remove))
        .route("/v1/sessions/{id}/log", get(sessions::log))
        .route(
            "/v1/sessions/{id}/entries",
            post(sessions::append).layer(axum::extract::DefaultBodyLimit::max(sessions::BODY_MAX)),
        )
        .route("/v1/sessions/{id}/verify", get(sessions::verify))
        .route("/v1/sessions/{id}/exec", post(sessions::exec))
        .route("/v1/sessions/{id}/exec/stream", post(sessions::exec_stream))
        .route("/v1/sessions/{id}/suspend", post(sessions::suspend))
        .route("/v1/sessions/{id}/recover", post(sessions::recover))
        .route("/v1/sessions/{id}/export", get(session_files::export))
        .route("/v1/sessions/import", post(session_files::import).layer(no_limit))
        .route(
            "/v1/sessions/{id}/files",
            get(session_files::download).put(session_files::upload).layer(no_limit),
        )
        .route("/v1/sessions/{id}/resume", post(sessions::resume))
        .route("/v1/sessions/{id}/fork", post(sessions::fork))
        .route("/v1/sessions/{id}/rewind", post(sessions::rewind))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(4 << 20))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&app), tenancy::own))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&app), observe))
        .with_state(app)
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route {} {}; GET /v1/openapi.json lists them",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} is not allowed on {}; GET /v1/openapi.json lists the routes",
            req.method(),
            req.uri().path()
        ),
    )
}

/// A structured log line and a metric per request.
async fn observe(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let caller = req.extensions().get::<admission::Caller>().cloned();
    let t = std::time::Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    tracing::info!(%method, path, status, ms = t.elapsed().as_secs_f64() * 1e3, "request");
    app.metrics.request(method.as_str(), status);
    // Who did what: requests a token made. The Unix socket's are its
    // owner's (root, who owns the state directory too), not recorded.
    if let Some(c) = caller.filter(|_| !ui::is_page(&path)) {
        let surface = if path == "/mcp" || path.starts_with("/mcp/") {
            "mcp"
        } else {
            "api"
        };
        app.audit.record(
            Some(&c.token),
            c.tenant.as_deref(),
            surface,
            method.as_str(),
            &path,
            status,
        );
    }
    resp
}

/// Refuses requests without a valid `Authorization: Bearer` token (TCP),
/// but for the page's own files, which hold no data.
/// The credentials of an `Authorization: Bearer` value; the scheme is
/// matched without regard to case (RFC 9110, 11.1).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

pub async fn require_token(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    if req.method() == axum::http::Method::GET && ui::is_page(req.uri().path()) {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .map(str::to_string);
    let Some(secret) = presented else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this listener needs Authorization: Bearer TOKEN; make one with `cairn token create NAME`",
        )
        .into_response();
    };
    match app.check_token(secret).await {
        Ok(Some(t)) => {
            let tenant = t.tenant.clone();
            req.extensions_mut().insert(admission::Caller {
                token: t.id,
                tenant: t.tenant,
            });
            tenancy::acting(tenant, next.run(req)).await
        }
        Ok(None) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "the bearer token is not valid (revoked or mistyped)",
        )
        .into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::bearer;

    #[test]
    fn the_bearer_scheme_is_matched_without_regard_to_case() {
        for value in ["Bearer t", "bearer t", "BEARER t", "  Bearer   t  "] {
            assert_eq!(bearer(value), Some("t"), "{value:?}");
        }
        for value in ["Basic t", "Bearer", "Bearer ", "Bearert", "Token t"] {
            assert_eq!(bearer(value), None, "{value:?}");
        }
    }
}
