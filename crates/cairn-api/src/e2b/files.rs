//! envd's `/files`: `GET` streams a file out; `POST` writes files from a
//! multipart form (one part per file, its filename the destination) or an
//! octet-stream body, creating parent directories. Uploads are spooled to
//! the state directory's `scratch/` as they arrive (at most `cairn serve
//! --max-upload` bytes of files, else 413 and nothing written), downloads
//! streamed with a few pieces held, whatever the file's size.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use cairn_protocol::{FileKind, FileMeta};
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::envd::{home_of, resolve, sandbox_of, Denied};
use super::form::Form;
use super::gzip;
use super::{Gateway, RestError};
use crate::app::now_ms;
use crate::error::ApiError;
use crate::routes::files::{drain, streamed_file, Spool};

/// The most files one multipart form writes.
const MAX_PARTS: usize = 1000;

type Files<T> = Result<T, RestError>;

fn denied(d: Denied) -> RestError {
    match d {
        Denied::Token(m) => RestError::new(StatusCode::UNAUTHORIZED, m),
        Denied::NotRunning(m) => RestError::new(StatusCode::BAD_GATEWAY, m),
    }
}

fn home(q: &HashMap<String, String>) -> &'static str {
    home_of(q.get("username").map(String::as_str).unwrap_or("user"))
}

/// `GET /files?path=...`: the file's bytes, streamed.
pub async fn read(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    match read_file(gw, &headers, &q).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn read_file(gw: Arc<Gateway>, headers: &HeaderMap, q: &HashMap<String, String>) -> Files<Response> {
    let (_, sandbox) = sandbox_of(&gw, headers).await.map_err(denied)?;
    let raw = q
        .get("path")
        .ok_or_else(|| RestError::bad_request("give the file as ?path=..."))?;
    let path = resolve(raw, home(q)).map_err(RestError::bad_request)?;
    let (meta, resp) = streamed_file(&gw.app, sandbox, path).await?;
    let accept = headers.get(header::ACCEPT_ENCODING).and_then(|v| v.to_str().ok());
    if !gzip::asks_for_gzip(accept) {
        let mut resp = resp;
        resp.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(meta.size));
        return Ok(resp);
    }
    let (mut parts, body) = resp.into_parts();
    parts
        .headers
        .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    parts
        .headers
        .insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    let deflated = gzip::Deflated::new(body.into_data_stream());
    Ok(Response::from_parts(parts, Body::from_stream(deflated)))
}

/// `POST /files`: `[{"name","type":"file","path"}]`, one per file written.
pub async fn write(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
    body: Body,
) -> Response {
    match write_files(gw, &headers, &q, body).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A file of an upload, spooled: where it goes, and where its bytes are in
/// the spool.
struct Spooled {
    path: String,
    offset: u64,
    size: u64,
}

async fn write_files(gw: Arc<Gateway>, headers: &HeaderMap, q: &HashMap<String, String>, body: Body) -> Files<Value> {
    let (_, sandbox) = sandbox_of(&gw, headers).await.map_err(denied)?;
    let compressed = match headers.get(header::CONTENT_ENCODING).map(|v| v.to_str()) {
        None => false,
        Some(Ok(v)) if v.trim().eq_ignore_ascii_case("identity") => false,
        Some(Ok(v)) if v.trim().eq_ignore_ascii_case("gzip") => true,
        Some(v) => {
            return Err(RestError::bad_request(format!(
                "Content-Encoding {:?} is not supported: send the upload as it is or gzip-compressed",
                v.unwrap_or("?")
            )))
        }
    };
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let home = home(q);
    // Spooled whole before anything is written, in bounded memory: an
    // upload refused midway (too large, malformed, cut) writes no file.
    let mut spool = Spool::new(&gw.app, "upload", "").await?;
    let mut files = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let boundary = ct
            .split(';')
            .filter_map(|p| p.trim().strip_prefix("boundary="))
            .next()
            .map(|b| b.trim_matches('"'))
            .filter(|b| !b.is_empty() && b.len() <= 200)
            .ok_or_else(|| RestError::bad_request("multipart/form-data without a boundary"))?;
        let mut form = Form::new(gzip::Inflated::new(body.into_data_stream(), compressed), boundary);
        let read: Files<()> = async {
            while let Some(filename) = form.next_part().await.map_err(RestError::bad_request)? {
                if files.len() == MAX_PARTS {
                    return Err(RestError::bad_request(format!(
                        "a form writes at most {MAX_PARTS} files"
                    )));
                }
                let target = match (q.get("path"), filename) {
                    (Some(p), _) => p.clone(),
                    (None, Some(f)) => f,
                    (None, None) => return Err(RestError::bad_request("a part names no file: give ?path=")),
                };
                let path = resolve(&target, home).map_err(RestError::bad_request)?;
                let offset = spool.size();
                while let Some(chunk) = form.chunk().await.map_err(RestError::bad_request)? {
                    spool.write(&chunk).await?;
                }
                files.push(Spooled {
                    path,
                    offset,
                    size: spool.size() - offset,
                });
            }
            Ok(())
        }
        .await;
        if let Err(e) = read {
            drain(form.body_mut().raw_mut()).await;
            return Err(e);
        }
    } else {
        let p = q
            .get("path")
            .ok_or_else(|| RestError::bad_request("give the destination as ?path=..."))?;
        let path = resolve(p, home).map_err(RestError::bad_request)?;
        let mut stream = gzip::Inflated::new(body.into_data_stream(), compressed);
        while let Some(chunk) = stream.next().await {
            let written = match chunk {
                Ok(chunk) => spool.write(&chunk).await.map_err(RestError::from),
                Err(why) => Err(RestError::bad_request(why)),
            };
            if let Err(e) = written {
                drain(stream.raw_mut()).await;
                return Err(e);
            }
        }
        files.push(Spooled {
            path,
            offset: 0,
            size: spool.size(),
        });
    }
    if files.is_empty() {
        return Err(RestError::bad_request("the upload holds no file"));
    }
    let (spooled, spool_path, _) = spool.finish().await?;
    // Written as the user's own, as E2B's envd writes them.
    let owner = gw.user_ids(&sandbox, &super::envd::user_of(headers)).await?;
    let (uid, gid) = owner.map_or((0, 0), |ids| (ids.uid, ids.gid));
    let written = gw
        .app
        .init(&sandbox.clone(), move |e| {
            let rec = e.sandbox(&sandbox)?;
            let client = e.client(&rec)?;
            let mut out = Vec::with_capacity(files.len());
            for file in files {
                let path = file.path;
                if let Some((parent, _)) = path.rsplit_once('/') {
                    if !parent.is_empty() {
                        client.make_dir_as(parent, true, owner)?;
                    }
                }
                let meta = FileMeta {
                    path: path.clone(),
                    kind: FileKind::File,
                    mode: 0o644,
                    uid,
                    gid,
                    size: file.size,
                    mtime_ns: now_ms() as i128 * 1_000_000,
                };
                let mut data = &spooled;
                data.seek(SeekFrom::Start(file.offset))
                    .map_err(|e| ApiError::internal(format!("reading back the spooled upload: {e}")))?;
                client.put_file(meta, &mut data.take(file.size))?;
                let name = path.rsplit('/').next().unwrap_or("").to_string();
                out.push(json!({ "name": name, "type": "file", "path": path }));
            }
            drop(spool_path);
            Ok(out)
        })
        .await?;
    Ok(Value::Array(written))
}
