//! envd's `/files`: `GET` streams a file out; `POST` writes files from a
//! multipart form (one part per file, its filename the destination) or an
//! octet-stream body, creating parent directories.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use cairn_protocol::{FileKind, FileMeta};
use serde_json::{json, Value};

use super::envd::{home_of, resolve, sandbox_of, Denied};
use super::{Gateway, RestError};
use crate::app::now_ms;
use crate::routes::files::streamed;

/// The largest upload (a whole multipart form, or one octet-stream file)
/// held in memory.
pub const MAX_UPLOAD: usize = 64 << 20;
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
    let (_, sandbox) = sandbox_of(&gw, headers).map_err(denied)?;
    let raw = q
        .get("path")
        .ok_or_else(|| RestError::bad_request("give the file as ?path=..."))?;
    let path = resolve(raw, home(q)).map_err(RestError::bad_request)?;
    let p = path.clone();
    let (rec, meta) = gw
        .app
        .engine(move |e| {
            let rec = e.sandbox(&sandbox)?;
            let meta = e.client(&rec)?.stat(&p)?;
            Ok((rec, meta))
        })
        .await?;
    let meta = meta.ok_or_else(|| RestError::new(StatusCode::NOT_FOUND, format!("path '{path}' does not exist")))?;
    if meta.kind != FileKind::File {
        return Err(RestError::bad_request(format!("path '{path}' is not a regular file")));
    }
    let mut resp = streamed(&gw.app, move |e, out| {
        Ok(e.client(&rec)?.get_file(&path, out).map(drop)?)
    });
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(meta.size));
    Ok(resp)
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

async fn write_files(gw: Arc<Gateway>, headers: &HeaderMap, q: &HashMap<String, String>, body: Body) -> Files<Value> {
    let (_, sandbox) = sandbox_of(&gw, headers).map_err(denied)?;
    if headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| !v.eq_ignore_ascii_case("identity"))
    {
        return Err(RestError::bad_request(
            "compressed uploads are not supported by Cairn's E2B gateway; write without gzip=True",
        ));
    }
    let body = axum::body::to_bytes(body, MAX_UPLOAD).await.map_err(|_| {
        RestError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("an upload is limited to {MAX_UPLOAD} bytes"),
        )
    })?;
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let home = home(q);
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let boundary = ct
            .split(';')
            .filter_map(|p| p.trim().strip_prefix("boundary="))
            .next()
            .map(|b| b.trim_matches('"'))
            .filter(|b| !b.is_empty() && b.len() <= 200)
            .ok_or_else(|| RestError::bad_request("multipart/form-data without a boundary"))?;
        for (filename, data) in multipart(&body, boundary).map_err(RestError::bad_request)? {
            let target = match (q.get("path"), filename) {
                (Some(p), _) => p.clone(),
                (None, Some(f)) => f,
                (None, None) => return Err(RestError::bad_request("a part names no file: give ?path=")),
            };
            files.push((resolve(&target, home).map_err(RestError::bad_request)?, data));
        }
    } else {
        let p = q
            .get("path")
            .ok_or_else(|| RestError::bad_request("give the destination as ?path=..."))?;
        files.push((resolve(p, home).map_err(RestError::bad_request)?, body));
    }
    if files.is_empty() {
        return Err(RestError::bad_request("the upload holds no file"));
    }
    let written = gw
        .app
        .engine(move |e| {
            let rec = e.sandbox(&sandbox)?;
            let client = e.client(&rec)?;
            let mut out = Vec::with_capacity(files.len());
            for (path, data) in files {
                if let Some((parent, _)) = path.rsplit_once('/') {
                    if !parent.is_empty() {
                        client.make_dir(parent, true)?;
                    }
                }
                let meta = FileMeta {
                    path: path.clone(),
                    kind: FileKind::File,
                    mode: 0o644,
                    uid: 0,
                    gid: 0,
                    size: data.len() as u64,
                    mtime_ns: now_ms() as i128 * 1_000_000,
                };
                client.put_file(meta, &mut &data[..])?;
                let name = path.rsplit('/').next().unwrap_or("").to_string();
                out.push(json!({ "name": name, "type": "file", "path": path }));
            }
            Ok(out)
        })
        .await?;
    Ok(Value::Array(written))
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| hay[i] == needle[0] && hay[i..].starts_with(needle))
}

/// The parts of a multipart body: each part's filename (if any) and data.
fn multipart(body: &Bytes, boundary: &str) -> Result<Vec<(Option<String>, Bytes)>, String> {
    let delim = format!("--{boundary}");
    let mut pos = find(body, delim.as_bytes(), 0).ok_or("the multipart body has no boundary")? + delim.len();
    let sep = format!("\r\n--{boundary}");
    let mut parts = Vec::new();
    loop {
        if body[pos..].starts_with(b"--") {
            return Ok(parts);
        }
        if !body[pos..].starts_with(b"\r\n") {
            return Err("malformed multipart boundary line".into());
        }
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("a multipart part has no header end")?;
        let head = std::str::from_utf8(&body[pos..head_end]).map_err(|_| "multipart headers are not UTF-8")?;
        let filename = head
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .and_then(|l| {
                let i = l.find("filename=\"")? + 10;
                let rest = &l[i..];
                Some(rest[..rest.find('"')?].to_string())
            });
        let data_start = head_end + 4;
        let data_end = find(body, sep.as_bytes(), data_start).ok_or("a multipart part is not closed")?;
        parts.push((filename, body.slice(data_start..data_end)));
        if parts.len() > MAX_PARTS {
            return Err(format!("a form writes at most {MAX_PARTS} files"));
        }
        pos = data_end + sep.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_forms_give_each_file_and_hostile_ones_are_refused() {
        let body = Bytes::from_static(
            b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/a.txt\"\r\n\
              Content-Type: text/plain\r\n\r\nhello\r\n--xx\r\nContent-Disposition: form-data; name=\"file\"; \
              filename=\"b\"\r\n\r\n\r\n--xx--\r\n",
        );
        let parts = multipart(&body, "xx").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].0.as_deref(), Some("/home/user/a.txt"));
        assert_eq!(&parts[0].1[..], b"hello");
        assert_eq!(&parts[1].1[..], b"");
        for bad in [
            &b"--xx\r\nno header end"[..],
            b"--xx\r\n\r\nunclosed",
            b"nothing",
            b"--xxjunk",
        ] {
            assert!(multipart(&Bytes::copy_from_slice(bad), "xx").is_err(), "{bad:?}");
        }
    }
}
