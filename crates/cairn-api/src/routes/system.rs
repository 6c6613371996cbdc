//! Health, metrics, the OpenAPI document, the event stream, images.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cairn_engine::{Progress, SandboxState};
use futures_util::stream::Stream;
use futures_util::StreamExt;
use tokio::sync::{broadcast, mpsc};

use super::parse;
use crate::app::App;
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;

/// Whether the server answers.
#[utoipa::path(get, path = "/healthz", tag = "system", security(()),
    responses((status = 200, body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

/// Prometheus metrics: sandboxes by state, operation latency histograms,
/// stage outcomes, store bytes, requests.
#[utoipa::path(get, path = "/metrics", tag = "system",
    responses((status = 200, content_type = "application/openmetrics-text", body = String)))]
pub async fn metrics(State(app): State<Arc<App>>) -> ApiResult<Response> {
    let store = app.home.store();
    let (states, bytes) = app
        .engine(move |e| {
            let all = e.list_sandboxes()?;
            let count = |s: SandboxState| all.iter().filter(|r| r.state == s).count() as i64;
            let states = vec![
                ("creating", count(SandboxState::Creating)),
                ("running", count(SandboxState::Running)),
                ("exited", count(SandboxState::Exited)),
                ("removing", count(SandboxState::Removing)),
            ];
            Ok((states, crate::metrics::dir_bytes(&store)))
        })
        .await?;
    let text = app.metrics.render(&states, bytes);
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "system",
    responses((status = 200, content_type = "application/json", body = Object)))]
pub async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], crate::openapi_json()).into_response()
}

/// Everything that happens through this server (sandboxes created and
/// removed, snapshots, resets, run stages), as server-sent events named by
/// their kind, each an `Event`.
#[utoipa::path(get, path = "/v1/events", tag = "system",
    responses((status = 200, content_type = "text/event-stream", description = "One event per change; data is an Event")))]
pub async fn events(State(app): State<Arc<App>>) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let rx = app.events.subscribe();
    let stopped = Box::pin(app.stopped());
    let tenant = crate::tenancy::current();
    let state = (rx, stopped, app, tenant);
    let stream = futures_util::stream::unfold(state, |(mut rx, mut stopped, app, tenant)| async move {
        let next = loop {
            let next = tokio::select! {
                e = rx.recv() => e,
                () = &mut stopped => return None,
            };
            match (&next, &tenant) {
                (Ok(e), Some(t)) if !theirs(&app, e, t).await => continue,
                _ => break next,
            }
        };
        let ev = match next {
            Ok(e) => SseEvent::default()
                .event(e.kind.clone())
                .data(serde_json::to_string(&e).expect("serialisable")),
            Err(broadcast::error::RecvError::Lagged(n)) => {
                SseEvent::default().event("lagged").data(format!("{{\"missed\":{n}}}"))
            }
            Err(broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok(ev), (rx, stopped, app, tenant)))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Whether event `e` belongs in tenant `t`'s stream: caused by its request,
/// or about an object it owns.
async fn theirs(app: &Arc<App>, e: &crate::app::Event, t: &str) -> bool {
    if let Some(owner) = &e.tenant {
        return owner == t;
    }
    let Some(kind) = e.object() else { return false };
    let (t, id) = (t.to_string(), e.id.clone());
    app.engine(move |en| Ok(en.owns(kind, &t, &id)?)).await.unwrap_or(false)
}

/// Lists images.
#[utoipa::path(get, path = "/v1/images", tag = "images",
    responses((status = 200, body = Vec<Image>)))]
pub async fn images(State(app): State<Arc<App>>) -> ApiResult<Json<Vec<Image>>> {
    let all = app.engine(|e| Ok(e.images()?)).await?;
    Ok(Json(all.into_iter().map(Image::from).collect()))
}

/// Removes an image (sandboxes and snapshots made from it keep its layers).
#[utoipa::path(delete, path = "/v1/images/{name}", tag = "images",
    params(("name" = String, Path, description = "Image name")),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn remove_image(State(app): State<Arc<App>>, Path(name): Path<String>) -> ApiResult<StatusCode> {
    app.engine(move |e| Ok(e.remove_image(&name)?)).await?;
    Ok(StatusCode::NO_CONTENT)
}

struct Steps(mpsc::UnboundedSender<String>);

impl Progress for Steps {
    fn step(&self, message: &str) {
        let _ = self.0.send(message.to_string());
    }
}

/// Builds an image, streaming its progress: `step` events with a
/// message, then `image` (an Image) or `error`.
#[utoipa::path(post, path = "/v1/images", tag = "images",
    request_body = BuildImage,
    responses((status = 200, content_type = "text/event-stream", description = "Events: step {message}, image (an Image), error {error}"),
        (status = 400, body = ErrorBody)))]
pub async fn build_image(
    State(app): State<Arc<App>>,
    body: Bytes,
) -> ApiResult<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>> {
    let req: BuildImage = parse(&body)?;
    if !cairn_engine::images::valid_image_name(&req.name) {
        return Err(ApiError::bad_request(format!(
            "invalid image name {:?}: letters, digits, '-', '_', '.'",
            req.name
        )));
    }
    if req.kind != "busybox" && req.kind != "debian" {
        return Err(ApiError::bad_request(format!(
            "kind must be busybox or debian, got {:?}",
            req.kind
        )));
    }
    let (tx, rx) = mpsc::unbounded_channel::<String>();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<ApiResult<Image>>();
    let a = Arc::clone(&app);
    // A tenant's image is its own, named in its namespace.
    let tenant = crate::tenancy::current();
    let name = crate::tenancy::qualify(req.name.clone());
    tokio::task::spawn_blocking(move || {
        let steps = Steps(tx);
        let out = a.take_engine_for(tenant).and_then(|mut e| {
            let r = match req.kind.as_str() {
                "busybox" => e.build_busybox(&name, &steps),
                _ => e.build_debian(&name, req.suite.as_deref(), &req.packages, &steps),
            };
            a.give_back(e);
            Ok(Image::from(r?))
        });
        if let Ok(i) = &out {
            a.emit("image.built", &i.name, i.source.clone());
        }
        let _ = done_tx.send(out);
    });
    let steps = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|m| {
        Ok(SseEvent::default()
            .event("step")
            .data(serde_json::json!({ "message": m }).to_string()))
    });
    let done = futures_util::stream::once(async move {
        let ev = match done_rx.await {
            Ok(Ok(image)) => SseEvent::default()
                .event("image")
                .data(serde_json::to_string(&image).expect("serialisable")),
            Ok(Err(e)) => SseEvent::default()
                .event("error")
                .data(serde_json::json!({ "error": { "code": e.code(), "message": e.message } }).to_string()),
            Err(_) => SseEvent::default().event("error").data(
                serde_json::json!({ "error": { "code": "internal", "message": "the build stopped" } }).to_string(),
            ),
        };
        Ok(ev)
    });
    Ok(Sse::new(steps.chain(done)).keep_alive(KeepAlive::default()))
}

/// Imports an image from a root filesystem tar archive (the body).
#[utoipa::path(post, path = "/v1/images/import", tag = "images",
    params(ImportQuery),
    request_body(content = Binary, content_type = "application/x-tar"),
    responses((status = 201, body = Image), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn import_image(
    State(app): State<Arc<App>>,
    q: Result<Query<ImportQuery>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> ApiResult<(StatusCode, Json<Image>)> {
    let Query(q) = q?;
    if !cairn_engine::images::valid_image_name(&q.name) {
        return Err(ApiError::bad_request(format!("invalid image name {:?}", q.name)));
    }
    let (file, path, _) = super::files::spool(&app, body, "archive", ".tar").await?;
    drop(file);
    let name = crate::tenancy::qualify(q.name.clone());
    let image = app
        .engine(move |e| {
            let r = e.import_image(&path, &name, &cairn_engine::Silent);
            drop(path);
            Ok(r?)
        })
        .await?;
    app.emit("image.built", &image.name, image.source.clone());
    Ok((StatusCode::CREATED, Json(image.into())))
}
