//! Files: download and upload streamed (any size, mode kept), stat.

use std::io::Write;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Json;
use cairn_protocol::{FileKind, FileMeta};
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::app::{now_ms, App};
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;

pub(crate) type QueryResult<T> = Result<Query<T>, axum::extract::rejection::QueryRejection>;

pub(crate) fn check_path(path: &str) -> ApiResult<()> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(ApiError::bad_request(format!(
            "path must be absolute, without NUL, at most 4096 bytes; got {path:?}"
        )));
    }
    Ok(())
}

/// The largest piece of a streamed body handed to the HTTP server at once.
const BODY_PIECE: usize = 64 << 10;
/// Pieces a streamed body holds for a client that reads slowly (or not at
/// all): with [`BODY_PIECE`], at most 256 KiB per download wait here.
const BODY_PIECES_HELD: usize = 4;

/// A blocking writer that sends what it is given to an HTTP body, in
/// pieces of at most [`BODY_PIECE`] bytes, waiting while
/// [`BODY_PIECES_HELD`] are unread.
pub(crate) struct BodyWriter(pub mpsc::Sender<Result<Bytes, std::io::Error>>);

impl Write for BodyWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let piece = &buf[..buf.len().min(BODY_PIECE)];
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(piece)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client went away"))?;
        Ok(piece.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn octet_stream(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Response {
    let mut resp = Response::new(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    resp
}

/// An `application/octet-stream` response whose body `write` produces on
/// an engine from the pool, in the blocking pool, as it goes. An error
/// midway ends the body with that error (the client sees a cut stream),
/// so callers check what they can before answering.
pub(crate) fn streamed(
    app: &Arc<App>,
    write: impl FnOnce(&mut cairn_engine::Engine, &mut BodyWriter) -> ApiResult<()> + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::channel(BODY_PIECES_HELD);
    let a = Arc::clone(app);
    let tenant = crate::tenancy::current();
    tokio::task::spawn_blocking(move || {
        let mut out = BodyWriter(tx.clone());
        let got = a.take_engine_for(tenant).and_then(|mut e| {
            let r = write(&mut e, &mut out);
            a.give_back(e);
            r
        });
        if let Err(e) = got {
            let _ = tx.blocking_send(Err(std::io::Error::other(e.message)));
        }
    });
    octet_stream(rx)
}

/// A regular file of a running sandbox as an `application/octet-stream`
/// response, with its metadata: init opens the file first, so a refusal
/// (not there, not a regular file, a symbolic link on the way) is an
/// error answer rather than a cut stream, and the metadata is the opened
/// file's. Streamed without holding an engine.
/// On the init request pool, as init sends the file.
pub(crate) async fn streamed_file(app: &Arc<App>, sandbox: String, path: String) -> ApiResult<(FileMeta, Response)> {
    let pool = sandbox.clone();
    streamed_download(app, Some(&pool), move |e| {
        let rec = e.sandbox(&sandbox)?;
        Ok(e.client(&rec)?.open_file(&path)?)
    })
    .await
}

/// [`streamed_file`] for a download `open` opens on an engine: on the
/// init request pool, counted against sandbox `init` when given, else on
/// the blocking pool.
pub(crate) async fn streamed_download(
    app: &Arc<App>,
    init: Option<&str>,
    open: impl FnOnce(&mut cairn_engine::Engine) -> ApiResult<cairn_sandbox::client::FileDownload> + Send + 'static,
) -> ApiResult<(FileMeta, Response)> {
    let (tx, rx) = mpsc::channel(BODY_PIECES_HELD);
    let (opened_tx, opened_rx) = tokio::sync::oneshot::channel();
    let tenant = crate::tenancy::current();
    let work = move |a: &Arc<App>| {
        let opened = a.take_engine_for(tenant).and_then(|mut e| {
            let r = open(&mut e);
            a.give_back(e);
            r
        });
        let download = match opened {
            Ok(download) => download,
            Err(e) => {
                let _ = opened_tx.send(Err(e));
                return;
            }
        };
        if opened_tx.send(Ok(download.meta().clone())).is_err() {
            return;
        }
        if let Err(e) = download.copy_to(&mut BodyWriter(tx.clone())) {
            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    };
    match init {
        // The download holds the sandbox's place while it streams.
        Some(sandbox) => app.on_init_pool(sandbox, move |app, _place| work(app))?,
        None => {
            let a = Arc::clone(app);
            drop(tokio::task::spawn_blocking(move || work(&a)));
        }
    }
    let meta = opened_rx
        .await
        .map_err(|_| ApiError::internal("the download's worker thread ended before the file was opened"))??;
    Ok((meta, octet_stream(rx)))
}

/// A file's metadata (a symbolic link at the end is described, not
/// followed; one on the way is refused).
#[utoipa::path(operation_id = "stat_file", get, path = "/v1/sandboxes/{id}/files/stat", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses((status = 200, body = FileStat), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody, description = "The sandbox init's own /proc entries"), (status = 404, body = ErrorBody)))]
pub async fn stat(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<PathQuery>,
) -> ApiResult<Json<FileStat>> {
    let Query(q) = q?;
    check_path(&q.path)?;
    let path = q.path.clone();
    let meta = app
        .init(&id.clone(), move |e| {
            let rec = e.sandbox(&id)?;
            Ok(e.client(&rec)?.stat(&path)?)
        })
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no file {} in the sandbox", q.path)))?;
    Ok(Json(meta.into()))
}

/// Downloads a regular file, streamed. `X-Cairn-Mode` gives its
/// permission bits in octal. A FIFO, socket, device or directory, and a
/// path through a symbolic link, are refused (400) before any byte.
#[utoipa::path(operation_id = "download_file", get, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Binary), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody, description = "The sandbox init's own /proc entries"), (status = 404, body = ErrorBody)))]
pub async fn download(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<PathQuery>,
) -> ApiResult<Response> {
    let Query(q) = q?;
    check_path(&q.path)?;
    let (meta, mut resp) = streamed_file(&app, id, q.path).await?;
    let h = resp.headers_mut();
    h.insert(
        "x-cairn-mode",
        HeaderValue::from_str(&format!("{:o}", meta.mode & 0o7777)).expect("ascii"),
    );
    Ok(resp)
}

/// Uploads a file, streamed: the body is the content. Its directory must
/// exist and be reached without a symbolic link; an existing file (or
/// symbolic link) is replaced.
#[utoipa::path(operation_id = "upload_file", put, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), UploadQuery),
    request_body(content = Binary, content_type = "application/octet-stream"),
    responses((status = 201, body = FileStat), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody, description = "The sandbox init's own /proc entries"), (status = 404, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn upload(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<UploadQuery>,
    body: Body,
) -> ApiResult<(StatusCode, Json<FileStat>)> {
    let Query(q) = q?;
    check_path(&q.path)?;
    let mode = mode_of(q.mode.as_deref())?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    // Spooled first: init needs the size before the bytes, and a client
    // that stops half-way must leave no half-written file in the sandbox.
    let (file, spool_path, size) = spool(&app, body, "upload", "").await?;
    let path = q.path.clone();
    let meta = app
        .init(&rec.id.clone(), move |e| {
            let mut file = file;
            let client = e.client(&rec)?;
            client.put_file(
                FileMeta {
                    path: path.clone(),
                    kind: FileKind::File,
                    mode,
                    uid: 0,
                    gid: 0,
                    size,
                    mtime_ns: now_ms() as i128 * 1_000_000,
                },
                &mut file,
            )?;
            drop(spool_path);
            Ok(client.stat(&path)?)
        })
        .await?
        .ok_or_else(|| ApiError::internal(format!("{} vanished right after the upload", q.path)))?;
    Ok((StatusCode::CREATED, Json(meta.into())))
}

/// Lists a directory (symlinks are listed, never followed, on the way
/// either).
#[utoipa::path(operation_id = "list_files", get, path = "/v1/sandboxes/{id}/files/list", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), ListQuery),
    responses((status = 200, body = DirListingView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody, description = "The sandbox init's own /proc entries"), (status = 404, body = ErrorBody)))]
pub async fn list(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<ListQuery>,
) -> ApiResult<Json<DirListingView>> {
    let Query(q) = q?;
    check_path(&q.path)?;
    let depth = q.depth.unwrap_or(1);
    if !(1..=cairn_protocol::LIST_DEPTH_MAX).contains(&depth) {
        return Err(ApiError::bad_request(format!(
            "depth must be 1 to {}, got {depth}",
            cairn_protocol::LIST_DEPTH_MAX
        )));
    }
    let limit = q.limit.unwrap_or(cairn_protocol::LIST_ENTRIES_MAX);
    if !(1..=cairn_protocol::LIST_ENTRIES_MAX).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be 1 to {}, got {limit}",
            cairn_protocol::LIST_ENTRIES_MAX
        )));
    }
    let listing = app
        .init(&id.clone(), move |e| {
            let rec = e.sandbox(&id)?;
            Ok(e.client(&rec)?.list_dir(&q.path, depth, limit)?)
        })
        .await?;
    Ok(Json(DirListingView {
        entries: listing
            .entries
            .into_iter()
            .map(|d| DirEntryView {
                stat: d.meta.into(),
                symlink_target: d.symlink_target,
            })
            .collect(),
        truncated: listing.truncated,
    }))
}

/// Makes a directory.
#[utoipa::path(operation_id = "make_dir", post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = MakeDirBody,
    responses((status = 200, body = MadeDir), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn mkdir(State(app): State<Arc<App>>, Path(id): Path<String>, body: Bytes) -> ApiResult<Json<MadeDir>> {
    let req: MakeDirBody = super::parse(&body)?;
    check_path(&req.path)?;
    let created = app
        .init(&id.clone(), move |e| {
            let rec = e.sandbox(&id)?;
            Ok(e.client(&rec)?.make_dir(&req.path, req.parents)?)
        })
        .await?;
    Ok(Json(MadeDir { created }))
}

/// Moves (renames) a file or directory, as rename(2) does.
#[utoipa::path(operation_id = "move_file", post, path = "/v1/sandboxes/{id}/files/move", tag = "files",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = MoveBody,
    responses((status = 200, body = FileStat), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn rename(State(app): State<Arc<App>>, Path(id): Path<String>, body: Bytes) -> ApiResult<Json<FileStat>> {
    let req: MoveBody = super::parse(&body)?;
    check_path(&req.from)?;
    check_path(&req.to)?;
    let to = req.to.clone();
    let meta = app
        .init(&id.clone(), move |e| {
            let rec = e.sandbox(&id)?;
            let client = e.client(&rec)?;
            client.rename(&req.from, &req.to)?;
            Ok(client.stat(&req.to)?)
        })
        .await?
        .ok_or_else(|| ApiError::internal(format!("{to} vanished right after the move")))?;
    Ok(Json(meta.into()))
}

/// Removes a file, a symlink, or (with `recursive`) a directory tree.
#[utoipa::path(operation_id = "remove_file", delete, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), RemoveFileQuery),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn remove(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: QueryResult<RemoveFileQuery>,
) -> ApiResult<StatusCode> {
    let Query(q) = q?;
    check_path(&q.path)?;
    app.init(&id.clone(), move |e| {
        let rec = e.sandbox(&id)?;
        Ok(e.client(&rec)?.remove(&q.path, q.recursive)?)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Permission bits given in octal (`644` when not given).
pub(crate) fn mode_of(mode: Option<&str>) -> ApiResult<u32> {
    match mode {
        Some(m) => u32::from_str_radix(m, 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| ApiError::bad_request(format!("mode must be octal permission bits like 644, got {m:?}"))),
        None => Ok(0o644),
    }
}

/// Writes a request body to a temporary file in the state directory's
/// `scratch/` (removed with the returned path), refusing one above the
/// server's upload limit with 413. Answers the file (rewound), its path
/// and its size.
pub(crate) async fn spool(
    app: &App,
    body: Body,
    what: &str,
    suffix: &str,
) -> ApiResult<(std::fs::File, tempfile::TempPath, u64)> {
    let mut spool = Spool::new(app, what, suffix).await?;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("the {what} was cut short: {e}")))?;
        if let Err(e) = spool.write(&chunk).await {
            drain(&mut stream).await;
            return Err(e);
        }
    }
    spool.finish().await
}

/// The most bytes of a refused upload read and discarded before the answer.
const DRAIN_MAX: u64 = 64 << 20;
/// The longest a refused upload is read before the answer.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads and discards what is left of a refused request body (at most
/// [`DRAIN_MAX`] bytes for [`DRAIN_TIME`]), so a client still sending it
/// reads the error answer instead of a connection reset: an answer sent
/// over unread bytes closes the connection under a client that is still
/// writing, and most clients then report a broken pipe, not the 413.
pub(crate) async fn drain<S, E>(stream: &mut S)
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
{
    let mut left = DRAIN_MAX;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while let Some(Ok(chunk)) = stream.next().await {
            left = left.saturating_sub(chunk.len() as u64);
            if left == 0 {
                break;
            }
        }
    })
    .await;
}

/// Bytes written to a temporary file in the state directory's `scratch/`
/// as they arrive, at most the server's upload limit of them (`cairn serve
/// --max-upload`); the file goes when its path is dropped, so a refused
/// upload leaves nothing.
pub(crate) struct Spool {
    file: tokio::fs::File,
    path: tempfile::TempPath,
    size: u64,
    limit: u64,
    what: String,
}

impl Spool {
    /// An empty spool for the `what` ("upload") of a request.
    pub(crate) async fn new(app: &App, what: &str, suffix: &str) -> ApiResult<Spool> {
        let scratch = app.home.scratch();
        tokio::fs::create_dir_all(&scratch)
            .await
            .map_err(|e| ApiError::internal(format!("cannot create {}: {e}", scratch.display())))?;
        let (file, path) = tempfile::Builder::new()
            .suffix(suffix)
            .tempfile_in(&scratch)
            .map_err(|e| ApiError::internal(format!("cannot spool the {what} in {}: {e}", scratch.display())))?
            .into_parts();
        Ok(Spool {
            file: tokio::fs::File::from_std(file),
            path,
            size: 0,
            limit: app.settings.max_upload,
            what: what.to_string(),
        })
    }

    /// Bytes written so far.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Appends `chunk`; 413 once the whole would pass the limit.
    pub(crate) async fn write(&mut self, chunk: &[u8]) -> ApiResult<()> {
        self.size += chunk.len() as u64;
        if self.size > self.limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the {} is larger than this server's limit of {} bytes (cairn serve --max-upload)",
                    self.what, self.limit
                ),
            ));
        }
        self.file
            .write_all(chunk)
            .await
            .map_err(|e| ApiError::internal(format!("spooling the {}: {e}", self.what)))
    }

    /// The spooled file, rewound, its path and its size.
    pub(crate) async fn finish(mut self) -> ApiResult<(std::fs::File, tempfile::TempPath, u64)> {
        self.file.flush().await.map_err(|e| ApiError::internal(e.to_string()))?;
        let mut file = self.file.into_std().await;
        use std::io::Seek;
        file.rewind().map_err(|e| ApiError::internal(e.to_string()))?;
        Ok((file, self.path, self.size))
    }
}
