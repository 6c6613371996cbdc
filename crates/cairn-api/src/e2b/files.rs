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

/// The most metadata entries a file takes.
const METADATA_MAX: usize = 32;

/// E2B's file metadata from `X-Metadata-KEY: VALUE` headers (envd 0.6.2):
/// keys lowercased, HTTP token characters, values printable ASCII; a bad
/// one is a 400 naming it, before anything is written.
fn metadata_of(headers: &HeaderMap) -> Files<std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if key.is_empty() || key.len() > 128 || !key.bytes().all(token) {
            return Err(RestError::bad_request(format!(
                "metadata key {key:?}: use 1 to 128 letters, digits or !#$%&'*+-.^_`|~"
            )));
        }
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.len() <= cairn_protocol::XATTR_VALUE_MAX && v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| {
                RestError::bad_request(format!(
                    "metadata value of {key:?}: printable ASCII, at most {} bytes",
                    cairn_protocol::XATTR_VALUE_MAX
                ))
            })?;
        out.insert(key.to_ascii_lowercase(), value.to_string());
    }
    if out.len() > METADATA_MAX {
        return Err(RestError::bad_request(format!(
            "at most {METADATA_MAX} metadata entries, got {}",
            out.len()
        )));
    }
    Ok(out)
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
    let metadata = metadata_of(headers)?;
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
    let user = q.get("username").map(String::as_str).unwrap_or("user");
    let owner = gw.user_ids(&sandbox, user).await?;
    let (uid, gid) = owner.map_or((0, 0), |ids| (ids.uid, ids.gid));
    let written = gw
        .app
        .init(&sandbox.clone(), move |e| {
            let rec = e.sandbox(&sandbox)?;
            let client = e.client(&rec)?;
            let mut out = Vec::with_capacity(files.len());
            // With metadata, each file is written under a temporary name
            // and given its attributes there, and all are renamed into
            // place only once every one of them took its attributes: a
            // file system that keeps none (gVisor's) refuses the upload
            // with nothing written.
            let attrs: Vec<(String, String)> = metadata
                .iter()
                .map(|(k, v)| (format!("{}{k}", cairn_protocol::XATTR_PREFIX), v.clone()))
                .collect();
            let mut staged: Vec<(String, String)> = Vec::new();
            let unstage = |staged: &[(String, String)]| {
                for (tmp, _) in staged {
                    let _ = client.remove(tmp, false);
                }
            };
            for file in files {
                let path = file.path;
                if let Some((parent, _)) = path.rsplit_once('/') {
                    if !parent.is_empty() {
                        if let Err(e) = client.make_dir_as(parent, true, owner) {
                            unstage(&staged);
                            return Err(e.into());
                        }
                    }
                }
                let name = path.rsplit('/').next().unwrap_or("").to_string();
                let target = if attrs.is_empty() {
                    path.clone()
                } else {
                    let (dir, _) = path.rsplit_once('/').unwrap_or(("", ""));
                    format!("{dir}/.{name}.cairn-upload-{}", cairn_engine::random_hex(6))
                };
                let meta = FileMeta {
                    path: target.clone(),
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
                if let Err(e) = client.put_file(meta, &mut data.take(file.size)) {
                    unstage(&staged);
                    return Err(e.into());
                }
                let mut entry = json!({ "name": name, "type": "file", "path": path });
                if !attrs.is_empty() {
                    staged.push((target.clone(), path.clone()));
                    if let Err(e) = client.set_xattrs(&target, attrs.clone()) {
                        unstage(&staged);
                        return Err(ApiError::bad_request(format!(
                            "file metadata cannot be kept on {path} (nothing was written): {e}; write it without metadata"
                        )));
                    }
                    entry["metadata"] = json!(metadata);
                }
                out.push(entry);
            }
            for (i, (tmp, path)) in staged.iter().enumerate() {
                if let Err(e) = client.rename(tmp, path) {
                    unstage(&staged[i..]);
                    return Err(e.into());
                }
            }
            drop(spool_path);
            Ok(out)
        })
        .await?;
    Ok(Value::Array(written))
}
