//! Files of a session's sandbox — a read or a write resumes a suspended
//! session (or recovers a dead sandbox) like an exec does; a write is
//! recorded in the log as a `write_file` call and its result — and whole
//! sessions as bundle files (export, import).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use axum::Json;
use cairn_session::prelude::*;

use super::files::{check_path, mode_of, spool, streamed, QueryResult};
use crate::app::App;
use crate::error::{ApiResult, ErrorBody};
use crate::model::*;

/// Downloads a regular file of the session's sandbox, streamed (resuming
/// the session first if it is suspended). `X-Cairn-Mode` gives its
/// permission bits in octal. Reads are not logged.
#[utoipa::path(operation_id = "download_session_file", get, path = "/v1/sessions/{id}/files", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name"), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Binary), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody, description = "Closed, failed, or being moved")))]
pub async fn download(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<PathQuery>,
) -> ApiResult<Response> {
    let Query(q) = q?;
    check_path(&q.path)?;
    // Opened and checked in the sandbox before the answer starts (a FIFO,
    // a link on the way or init's /proc is an error answer), never looked
    // up first and opened after.
    let path = q.path.clone();
    let (meta, mut resp) =
        super::files::streamed_download(&app, None, move |e| Ok(e.session_open_file(&id, &path)?)).await?;
    let h = resp.headers_mut();
    h.insert(
        "x-cairn-mode",
        HeaderValue::from_str(&format!("{:o}", meta.mode & 0o7777)).expect("ascii"),
    );
    Ok(resp)
}

/// Uploads a file into the session's sandbox (resuming the session first
/// if it is suspended): the body is the content; its directory must exist;
/// an existing file is replaced. Recorded in the log as a `write_file` call
/// (path, mode, size) and its result (bytes, BLAKE3 hash).
#[utoipa::path(operation_id = "upload_session_file", put, path = "/v1/sessions/{id}/files", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name"), UploadQuery),
    request_body(content = Binary, content_type = "application/octet-stream"),
    responses((status = 201, body = FileStat), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Closed, failed, or being moved"), (status = 413, body = ErrorBody)))]
pub async fn upload(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<UploadQuery>,
    body: Body,
) -> ApiResult<(StatusCode, Json<FileStat>)> {
    let Query(q) = q?;
    check_path(&q.path)?;
    let mode = mode_of(q.mode.as_deref())?;
    // Spooled first: init needs the size before the bytes, and a client
    // that stops half-way must leave no half-written file (nor a log entry).
    let (file, spool_path, size) = spool(&app, body, "upload", "").await?;
    let meta = app
        .engine(move |e| {
            let mut file = file;
            let meta = e.session_write_file(&id, &q.path, mode, size, &mut file)?;
            drop(spool_path);
            Ok(meta)
        })
        .await?;
    Ok((StatusCode::CREATED, Json(meta.into())))
}

/// Exports the session (its whole log chain, the rewinds that apply and
/// every snapshot its log names with what a restore reads) as one bundle,
/// streamed (docs/formats.md, "Session bundle"). An active session's
/// sandbox is snapshotted first and the snapshot recorded in its log.
#[utoipa::path(operation_id = "export_session", get, path = "/v1/sessions/{id}/export", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    responses((status = 200, content_type = "application/octet-stream", body = Binary, description = "The bundle"),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody, description = "Being moved, or its log does not verify")))]
pub async fn export(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Response> {
    // Looked up first, so an unknown session is a 404 rather than a cut stream.
    let key = id.clone();
    let s = app.engine(move |e| Ok(e.session(&key)?)).await?;
    let resp = streamed(&app, move |e, out| {
        Ok(e.export_session(&s.id, out, &cairn_engine::Silent).map(drop)?)
    });
    Ok(resp)
}

/// Imports a bundle `export` wrote (the body) as a new root session,
/// suspended. The file is checked whole (hashes, the log's chain, caps)
/// before anything is recorded; a refused import records nothing.
#[utoipa::path(operation_id = "import_session", post, path = "/v1/sessions/import", tag = "sessions",
    params(SessionImportQuery),
    request_body(content = Binary, content_type = "application/octet-stream"),
    responses((status = 201, body = ImportResult), (status = 400, body = ErrorBody, description = "Not a bundle, damaged or truncated"),
        (status = 409, body = ErrorBody, description = "The name is taken"), (status = 413, body = ErrorBody)))]
pub async fn import(
    State(app): State<Arc<App>>,
    q: QueryResult<SessionImportQuery>,
    body: Body,
) -> ApiResult<(StatusCode, Json<ImportResult>)> {
    let Query(q) = q?;
    let (file, spool_path, _) = spool(&app, body, "bundle", ".cairnses").await?;
    let done = app
        .engine(move |e| {
            let mut file = std::io::BufReader::new(file);
            let r = e.import_session(&mut file, q.name, &cairn_engine::Silent)?;
            drop(spool_path);
            Ok(r)
        })
        .await?;
    app.emit(
        "session.created",
        &done.session.id,
        format!("imported from {}", done.source_id),
    );
    Ok((
        StatusCode::CREATED,
        Json(ImportResult {
            session: done.session.into(),
            source_id: done.source_id,
            entries: done.entries,
            snapshots: done.snapshots,
            objects: done.objects,
            objects_new: done.objects_new,
            image_note: done.image_note,
        }),
    ))
}
