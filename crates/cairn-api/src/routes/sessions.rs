//! Agent sessions: create, list, get, close; the context log (read,
//! append, verify); exec, collected or streamed (server-sent events);
//! suspend, resume, fork, rewind.
//!
//! An exec, suspend, resume, rewind or close claims the session for its
//! length: a second one arriving meanwhile gets 409 (it does not wait); a
//! suspend or close, which remove the sandbox, claim it too. Appends,
//! reads, verifies and forks need no claim: the engine orders appends, and
//! a fork reads only what the log already records.

use std::convert::Infallible;
use std::io::Write;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::Response;
use axum::Json;
use base64::Engine as _;
use cairn_engine::{Engine, Silent};
use cairn_protocol::ExecRequest;
use cairn_session::prelude::*;
use cairn_session::{Entry, EntryKind, LogRange, SessionOptions, SessionRecord, SessionState};
use futures_util::stream::Stream;
use tokio::sync::mpsc;

use super::exec::Collect;
use super::{idempotent, json, parse};
use crate::app::{App, Busy};
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;

/// The largest request body a session route takes (an entry with its
/// content, result and arguments); 413 above it.
pub const BODY_MAX: usize = 4 << 20;
/// The most entries one log read answers.
const LOG_MAX: usize = 1000;
/// The longest idle timeout: 30 days.
const IDLE_MAX_MS: u64 = 30 * 24 * 3_600_000;
/// Token counts stay exact in every JSON reader (2^53 - 1).
const TOKENS_MAX: u64 = (1 << 53) - 1;

/// The body, or the one error shape when it could not be read (413 above
/// [`BODY_MAX`]).
fn body_of(body: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    body.map_err(|r| {
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                status,
                format!(
                    "the request body is larger than {} MiB; put large outputs in a file in the sandbox and record its path",
                    BODY_MAX >> 20
                ),
            )
        } else {
            ApiError::new(status, format!("the request body could not be read: {}", r.body_text()))
        }
    })
}

/// Refuses text the state store cannot keep (NUL) or that is too long.
fn text(field: &str, value: &str, max: usize) -> ApiResult<()> {
    if value.contains('\0') {
        return Err(ApiError::bad_request(format!("{field} must not contain NUL bytes")));
    }
    if value.len() > max {
        return Err(ApiError::bad_request(format!(
            "{field} is {} bytes; at most {max} are accepted",
            value.len()
        )));
    }
    Ok(())
}

/// A session key from a path: an id, a unique id prefix or a name.
fn key(id: String) -> ApiResult<String> {
    if id.contains('\0') || id.len() > 255 {
        return Err(ApiError::not_found(
            "no session matches that id; GET /v1/sessions lists them",
        ));
    }
    Ok(id)
}

/// Claims the session's sandbox too for what removes it (suspend, close),
/// so that a snapshot, fork or reset of it through the sandbox routes does
/// not overlap.
fn claim_sandbox(app: &Arc<App>, s: &SessionRecord, what: &str) -> ApiResult<Option<Busy>> {
    s.sandbox_id
        .as_deref()
        .map(|id| app.claim(id, &format!("session {what}")))
        .transpose()
}

async fn session(app: &Arc<App>, id: String) -> ApiResult<SessionRecord> {
    let id = key(id)?;
    app.engine(move |e| Ok(e.session(&id)?)).await
}

/// Creates a session and its sandbox.
#[utoipa::path(operation_id = "create_session", post, path = "/v1/sessions", tag = "sessions",
    request_body = CreateSession,
    params(("Idempotency-Key" = Option<String>, Header, description = "A retried request with this key answers what the first did")),
    responses((status = 201, body = Session), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The name is taken, or a request with this Idempotency-Key is in progress"),
        (status = 413, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used with another body"),
        (status = 503, body = ErrorBody, description = "The driver is not available here")))]
pub async fn create(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_of(body)?;
    let req: CreateSession = parse(&body)?;
    for (field, value) in [("name", &req.name), ("image", &req.image), ("driver", &req.driver)] {
        if let Some(v) = value {
            text(field, v, 255)?;
        }
    }
    if let Some(ms) = req.idle_timeout_ms {
        if !(1000..=IDLE_MAX_MS).contains(&ms) {
            return Err(ApiError::bad_request(format!(
                "idle_timeout_ms must be 1000 (1 s) to {IDLE_MAX_MS} (30 days), got {ms}"
            )));
        }
    }
    let network = req
        .network
        .as_ref()
        .map(|n| n.policy())
        .transpose()
        .map_err(ApiError::bad_request)?;
    let opts = SessionOptions {
        name: req.name,
        image: req.image,
        driver: req.driver,
        idle_timeout_ms: req.idle_timeout_ms,
        network,
    };
    let a = Arc::clone(&app);
    idempotent(&app, &headers, "sessions.create", &body, || async move {
        let s = a.engine(move |e| Ok(e.create_session(&opts, &Silent)?)).await?;
        a.emit(
            "session.created",
            &s.id,
            format!("{} in sandbox {}", s.name, s.sandbox_id.as_deref().unwrap_or("-")),
        );
        Ok((
            StatusCode::CREATED,
            serde_json::to_value(Session::from(s)).expect("serialisable"),
        ))
    })
    .await
}

const STATES: [&str; 6] = ["active", "suspending", "suspended", "resuming", "failed", "closed"];

/// Lists sessions, oldest first, a page at a time.
#[utoipa::path(operation_id = "list_sessions", get, path = "/v1/sessions", tag = "sessions", params(SessionQuery),
    responses((status = 200, body = SessionPage), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(app): State<Arc<App>>,
    q: Result<Query<SessionQuery>, QueryRejection>,
) -> ApiResult<Json<SessionPage>> {
    let Query(q) = q?;
    if let Some(s) = &q.state {
        if !STATES.contains(&s.as_str()) {
            return Err(ApiError::bad_request(format!(
                "state must be one of {}, got {s:?}",
                STATES.join(", ")
            )));
        }
    }
    let mut all = app.engine(|e| Ok(e.sessions()?)).await?;
    if let Some(mine) = crate::tenancy::owned(&app, cairn_engine::tenants::Owned::Session).await? {
        all.retain(|s| mine.contains(&s.id));
    }
    all.retain(|s| q.state.as_ref().is_none_or(|st| s.state.as_str() == st));
    all.retain(|s| q.image.as_ref().is_none_or(|i| s.image == *i));
    let items: Vec<Session> = all.into_iter().map(Session::from).collect();
    let (items, next) = crate::model::page(items, |s| &s.id, q.after.as_deref(), q.limit);
    Ok(Json(SessionPage { items, next }))
}

/// One session, by id, unique id prefix or name.
#[utoipa::path(operation_id = "get_session", get, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    responses((status = 200, body = Session), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<Session>> {
    Ok(Json(session(&app, id).await?.into()))
}

/// Closes a session: its sandbox goes; its log stays (readable,
/// verifiable, forkable) unless `purge`.
#[utoipa::path(operation_id = "close_session", delete, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name"), CloseQuery),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Busy with another operation, or (purge) it has forks")))]
pub async fn remove(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: Result<Query<CloseQuery>, QueryRejection>,
) -> ApiResult<StatusCode> {
    let Query(q) = q?;
    let s = session(&app, id).await?;
    let busy = (
        app.claim_session(&s.id, "removal")?,
        claim_sandbox(&app, &s, "removal")?,
    );
    let id = s.id.clone();
    app.engine(move |e| {
        let _busy = busy;
        Ok(e.close_session(&id, q.purge)?)
    })
    .await?;
    app.emit("session.closed", &s.id, if q.purge { "log purged" } else { "log kept" });
    Ok(StatusCode::NO_CONTENT)
}

/// Reads the live log: `limit` entries from `from`, the last `tail`, or
/// the last `limit` before `before` (paging back from a tail).
#[utoipa::path(operation_id = "session_log", get, path = "/v1/sessions/{id}/log", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name"), LogQuery),
    responses((status = 200, body = LogPage), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn log(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: Result<Query<LogQuery>, QueryRejection>,
) -> ApiResult<Json<LogPage>> {
    let Query(q) = q?;
    let bounded = |name: &str, n: usize| {
        if (1..=LOG_MAX).contains(&n) {
            Ok(n)
        } else {
            Err(ApiError::bad_request(format!("{name} must be 1 to {LOG_MAX}, got {n}")))
        }
    };
    // One more than asked says whether there is a page beyond: after the
    // last entry (`from`), or before the first (`tail`, `before`).
    let (range, read) = match (q.tail, q.from, q.before, q.limit) {
        (Some(_), Some(_), _, _) | (Some(_), _, Some(_), _) | (Some(_), _, _, Some(_)) | (None, Some(_), Some(_), _) => {
            return Err(ApiError::bad_request(
                "give tail alone, from and limit, or before and limit: tail reads the end of the log, before pages back from it",
            ))
        }
        (Some(n), None, None, None) => {
            let n = bounded("tail", n)?;
            (LogRange::Tail(n + 1), Read::Back(n))
        }
        (None, None, Some(before), limit) => {
            if before == 0 {
                return Err(ApiError::bad_request("before counts entries from 1"));
            }
            let limit = bounded("limit", limit.unwrap_or(100))?;
            (LogRange::Before { before, count: limit + 1 }, Read::Back(limit))
        }
        (None, from, None, limit) => {
            let from = from.unwrap_or(1);
            if from == 0 {
                return Err(ApiError::bad_request("from counts entries from 1"));
            }
            let limit = bounded("limit", limit.unwrap_or(100))?;
            (LogRange::From { from, count: limit + 1 }, Read::On(limit))
        }
    };
    let s = session(&app, id).await?;
    let mut entries = app.engine(move |e| Ok(e.session_log(&s, range)?)).await?;
    let (mut next, mut prev) = (None, None);
    match read {
        Read::On(limit) if entries.len() > limit => {
            next = Some(entries[limit].seq);
            entries.truncate(limit);
        }
        Read::Back(limit) if entries.len() > limit => {
            entries.drain(..entries.len() - limit);
            prev = Some(entries[0].seq);
        }
        _ => {}
    }
    Ok(Json(LogPage {
        entries: entries.into_iter().map(LogEntry::from).collect(),
        next,
        prev,
    }))
}

/// Which way a log read goes, and how many entries it answers.
enum Read {
    /// From `from` on: `next` names the entry after them.
    On(usize),
    /// Back from the end or from `before`: `prev` names the first of them.
    Back(usize),
}

/// Refuses what Cairn assigns, with a sentence rather than "unknown field".
fn refuse_assigned(body: &[u8]) -> ApiResult<()> {
    if let Ok(serde_json::Value::Object(fields)) = serde_json::from_slice::<serde_json::Value>(body) {
        const ASSIGNED: [&str; 7] = [
            "seq",
            "hash",
            "version",
            "created_at",
            "snapshot_id",
            "content_ref",
            "result_ref",
        ];
        if let Some(f) = ASSIGNED.iter().find(|f| fields.contains_key(**f)) {
            return Err(ApiError::bad_request(format!(
                "{f} is Cairn's to assign; leave it out of the entry"
            )));
        }
    }
    Ok(())
}

fn entry_of(req: AppendEntry) -> ApiResult<Entry> {
    let kind: EntryKind = req.kind.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "kind must be system, user, assistant, tool_call, tool_result or note, got {:?}",
            req.kind
        ))
    })?;
    if kind == EntryKind::Recovered {
        return Err(ApiError::bad_request(
            "recovered entries are Cairn's, written when it restores a session's dead sandbox",
        ));
    }
    if let Some(r) = &req.role {
        if !["system", "user", "assistant", "tool"].contains(&r.as_str()) {
            return Err(ApiError::bad_request(format!(
                "role must be system, user, assistant or tool, got {r:?}"
            )));
        }
    }
    if let Some(t) = &req.tool {
        if t.is_empty() || t.chars().count() > 128 || t.chars().any(char::is_control) {
            return Err(ApiError::bad_request(
                "tool must be 1 to 128 characters with no control characters",
            ));
        }
    }
    for (field, value) in [("content", &req.content), ("result", &req.result)] {
        if let Some(v) = value {
            text(field, v, BODY_MAX)?;
        }
    }
    for (field, value) in [("tokens_in", req.tokens_in), ("tokens_out", req.tokens_out)] {
        if value.is_some_and(|t| t > TOKENS_MAX) {
            return Err(ApiError::bad_request(format!("{field} must be at most {TOKENS_MAX}")));
        }
    }
    let arguments = match req.arguments {
        Some(v) => {
            let t = v.to_string();
            text("arguments", &t, BODY_MAX)?;
            Some(t)
        }
        None => None,
    };
    let mut e = Entry::new(kind);
    e.role = req.role;
    e.content = req.content;
    e.tool = req.tool;
    e.arguments = arguments;
    e.result = req.result;
    e.exit_status = req.exit_status;
    e.tokens_in = req.tokens_in;
    e.tokens_out = req.tokens_out;
    Ok(e)
}

/// Appends one entry to the log; answers it with its seq and hash.
#[utoipa::path(operation_id = "append_session_entry", post, path = "/v1/sessions/{id}/entries", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    request_body = AppendEntry,
    responses((status = 201, body = LogEntry), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The session is closed"),
        (status = 413, body = ErrorBody, description = "The body is above 4 MiB")))]
pub async fn append(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_of(body)?;
    refuse_assigned(&body)?;
    let entry = entry_of(parse(&body)?)?;
    let s = session(&app, id).await?;
    let wakes = entry.kind == EntryKind::User && s.state == SessionState::Suspended;
    let sid = s.id.clone();
    // A user message to a suspended session resumes it, after recording it.
    let e = app.engine(move |e| Ok(e.append_entry(&sid, entry)?)).await?;
    if wakes {
        app.emit("session.resumed", &s.id, "by a user message");
    }
    Ok(json(StatusCode::CREATED, &LogEntry::from(e)))
}

/// Walks the log's hash chain (abandoned entries included) and names the
/// first entry that was changed or is missing.
#[utoipa::path(operation_id = "verify_session", get, path = "/v1/sessions/{id}/verify", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    responses((status = 200, body = VerifyResult, description = "The walk's outcome; `ok` false names the first bad entry"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn verify(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<VerifyResult>> {
    let s = session(&app, id).await?;
    Ok(Json(app.engine(move |e| Ok(e.verify_session(&s)?)).await?.into()))
}

fn request_of(body: &[u8]) -> ApiResult<ExecRequest> {
    let b: SessionExecBody = parse(body)?;
    super::exec::request(
        &ExecBody {
            argv: b.argv,
            env: b.env,
            cwd: b.cwd,
            user: None,
            timeout_secs: b.timeout_secs,
            stdin: None,
            stdin_open: false,
            detach: false,
            on_disconnect: None,
        },
        false,
    )
}

/// Runs the command in the session, then reads back the result entry's
/// `error` (why the command did not run or was cut short).
fn run(
    e: &mut Engine,
    id: &str,
    req: ExecRequest,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> ApiResult<SessionExecResult> {
    let outcome = e.session_exec_request(id, req, out, err)?;
    let s = e.session(id)?;
    let error = e
        .session_log(
            &s,
            LogRange::From {
                from: outcome.result_seq,
                count: 1,
            },
        )?
        .into_iter()
        .find(|r| r.seq == outcome.result_seq)
        .and_then(|r| r.result)
        .and_then(|r| serde_json::from_str::<serde_json::Value>(&r).ok())
        .and_then(|v| v["error"].as_str().map(str::to_string));
    Ok(SessionExecResult {
        exit_code: outcome.status,
        stdout: String::new(),
        stderr: String::new(),
        stdout_truncated: false,
        stderr_truncated: false,
        error,
        call_seq: outcome.call_seq,
        result_seq: outcome.result_seq,
        recovered: outcome.recovered.map(LogEntry::from),
    })
}

/// Publishes an exec's end (and the resume it made, if the session was suspended).
fn executed(app: &App, id: &str, was: SessionState, r: &SessionExecResult) {
    if was == SessionState::Suspended {
        app.emit("session.resumed", id, "by an exec");
    }
    app.emit(
        "session.exec",
        id,
        format!("exit {} (entries {} and {})", r.exit_code, r.call_seq, r.result_seq),
    );
}

/// Runs a command in the session's sandbox (resuming a suspended session
/// first) and records a `tool_call` and a `tool_result` entry; answers when
/// it ends. A client that leaves does not stop it: its result is recorded.
#[utoipa::path(operation_id = "session_exec", post, path = "/v1/sessions/{id}/exec", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    request_body = SessionExecBody,
    responses((status = 200, body = SessionExecResult, description = "The command ended (any exit code)"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Closed, or busy with another exec, suspend, resume, rewind or removal"),
        (status = 413, body = ErrorBody)))]
pub async fn exec(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<SessionExecResult>> {
    let req = request_of(&body_of(body)?)?;
    let s = session(&app, id).await?;
    let busy = app.claim_session(&s.id, "exec")?;
    let id = s.id.clone();
    let result = app
        .engine(move |e| {
            // Held to the command's end, even when the client has gone.
            let _busy = busy;
            let (mut out, mut err) = (Collect::default(), Collect::default());
            let mut r = run(e, &id, req, &mut out, &mut err)?;
            r.stdout = String::from_utf8_lossy(&out.bytes).into_owned();
            r.stderr = String::from_utf8_lossy(&err.bytes).into_owned();
            r.stdout_truncated = out.over;
            r.stderr_truncated = err.over;
            Ok(r)
        })
        .await?;
    executed(&app, &s.id, s.state, &result);
    Ok(Json(result))
}

/// What a streamed session exec sends, one server-sent event each.
enum Piece {
    Out(Vec<u8>),
    Err(Vec<u8>),
    Exit(Box<SessionExecResult>),
    Failed(ApiError),
}

impl Piece {
    fn event(self) -> Event {
        let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
        match self {
            Piece::Out(d) => Event::default()
                .event("stdout")
                .data(serde_json::json!({ "data": b64(&d) }).to_string()),
            Piece::Err(d) => Event::default()
                .event("stderr")
                .data(serde_json::json!({ "data": b64(&d) }).to_string()),
            Piece::Exit(r) => Event::default()
                .event("exit")
                .data(serde_json::to_string(&r).expect("serialisable")),
            Piece::Failed(e) => Event::default()
                .event("error")
                .data(serde_json::json!({ "error": { "code": e.code(), "message": e.message } }).to_string()),
        }
    }
}

/// Forwards output into the stream. Once the client has gone the output
/// is dropped and the command runs on: the log must get its result.
struct Forward {
    tx: mpsc::Sender<Piece>,
    stderr: bool,
}

impl Write for Forward {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.tx.is_closed() {
            let piece = if self.stderr {
                Piece::Err(buf.to_vec())
            } else {
                Piece::Out(buf.to_vec())
            };
            let _ = self.tx.blocking_send(piece);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs a command in the session as `POST .../exec` does, streaming
/// `stdout` and `stderr` (base64 in `data`) as they happen, then `exit` (a
/// SessionExecResult without output) or one `error`. A client that leaves
/// does not stop the command: it runs to its end and its result is recorded.
#[utoipa::path(operation_id = "session_exec_stream", post, path = "/v1/sessions/{id}/exec/stream", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    request_body = SessionExecBody,
    responses((status = 200, content_type = "text/event-stream", description = "Events: stdout {data}, stderr {data}, exit (a SessionExecResult without output), error {error}"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Busy with another exec, suspend, resume, rewind or removal"),
        (status = 413, body = ErrorBody)))]
pub async fn exec_stream(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let req = request_of(&body_of(body)?)?;
    let s = session(&app, id).await?;
    let busy = app.claim_session(&s.id, "exec")?;
    let (tx, rx) = mpsc::channel::<Piece>(64);
    let a = Arc::clone(&app);
    let tenant = crate::tenancy::current();
    tokio::task::spawn_blocking(move || {
        let _busy = busy;
        let result = a.take_engine_for(tenant).and_then(|mut engine| {
            let mut out = Forward {
                tx: tx.clone(),
                stderr: false,
            };
            let mut err = Forward {
                tx: tx.clone(),
                stderr: true,
            };
            let r = run(&mut engine, &s.id, req, &mut out, &mut err);
            a.give_back(engine);
            r
        });
        if let Ok(r) = &result {
            executed(&a, &s.id, s.state, r);
        }
        let _ = tx.blocking_send(match result {
            Ok(r) => Piece::Exit(Box::new(r)),
            Err(e) => Piece::Failed(e),
        });
    });
    // The stream ends with the exit (or error) event, or when the server
    // stops (the command then runs on as on a disconnect).
    let stopped = Box::pin(app.stopped());
    let stream = futures_util::stream::unfold(Some((rx, stopped)), |state| async move {
        let (mut rx, mut stopped) = state?;
        let piece = tokio::select! {
            p = rx.recv() => p?,
            () = &mut stopped => Piece::Failed(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is stopping; the command runs on and its result is recorded (GET .../log)",
            )),
        };
        let last = matches!(piece, Piece::Exit(_) | Piece::Failed(_));
        Some((Ok(piece.event()), (!last).then_some((rx, stopped))))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// Restores a session whose sandbox died (as its next call would), and
/// with `replay` runs again the exec calls the restore lost, in order,
/// stopping at the first whose exit status differs from the log's.
#[utoipa::path(operation_id = "recover_session", post, path = "/v1/sessions/{id}/recover", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    request_body = RecoverBody,
    responses((status = 200, body = RecoverResult, description = "Done; `stopped` says why a replay ended early"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Closed, busy, or nothing to replay"),
        (status = 413, body = ErrorBody)))]
pub async fn recover(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<RecoverResult>> {
    let body = body_of(body)?;
    let req: RecoverBody = if body.is_empty() {
        RecoverBody::default()
    } else {
        parse(&body)?
    };
    let s = session(&app, id).await?;
    let busy = app.claim_session(&s.id, "recover")?;
    let sid = s.id.clone();
    let r = app
        .engine(move |e| {
            let _busy = busy;
            let (mut out, mut err) = (Collect::default(), Collect::default());
            let report = e.recover_session(&sid, req.replay, &mut out, &mut err)?;
            Ok(RecoverResult {
                recovered: report.recovered.map(LogEntry::from),
                replayed: report
                    .replayed
                    .into_iter()
                    .map(|r| ReplayedCall {
                        call: r.call,
                        expected: r.expected,
                        status: r.status,
                        call_seq: r.call_seq,
                    })
                    .collect(),
                stopped: report.stopped,
                stdout: String::from_utf8_lossy(&out.bytes).into_owned(),
                stderr: String::from_utf8_lossy(&err.bytes).into_owned(),
            })
        })
        .await?;
    if r.recovered.is_some() {
        app.emit("session.recovered", &s.id, "sandbox restored from the newest snapshot");
    }
    Ok(Json(r))
}

/// Snapshots the session's sandbox, records the snapshot in the log and
/// removes the sandbox.
#[utoipa::path(operation_id = "suspend_session", post, path = "/v1/sessions/{id}/suspend", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    responses((status = 200, body = Session), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Not active, or busy with another operation")))]
pub async fn suspend(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<Session>> {
    let s = session(&app, id).await?;
    let busy = (
        app.claim_session(&s.id, "suspend")?,
        claim_sandbox(&app, &s, "suspend")?,
    );
    let s = app
        .engine(move |e| {
            let _busy = busy;
            Ok(e.suspend_session(&s.id)?)
        })
        .await?;
    app.emit(
        "session.suspended",
        &s.id,
        format!("in snapshot {}", s.snapshot_id.as_deref().unwrap_or("-")),
    );
    app.warm_session(s.id.clone());
    Ok(Json(s.into()))
}

/// Gives a suspended (or failed, or interrupted) session a sandbox again,
/// restored from its newest snapshot.
#[utoipa::path(operation_id = "resume_session", post, path = "/v1/sessions/{id}/resume", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    responses((status = 200, body = Session), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "Already active, closed, or busy with another operation")))]
pub async fn resume(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<Session>> {
    let s = session(&app, id).await?;
    let busy = app.claim_session(&s.id, "resume")?;
    let s = app
        .engine(move |e| {
            let _busy = busy;
            Ok(e.resume_session(&s.id)?)
        })
        .await?;
    app.emit(
        "session.resumed",
        &s.id,
        format!("in sandbox {}", s.sandbox_id.as_deref().unwrap_or("-")),
    );
    Ok(Json(s.into()))
}

/// A new session whose log is this one's live log up to entry `at`
/// (shared, not copied) and whose sandbox is a restore of the snapshot
/// recorded at or before it (a fresh sandbox from the image if none was).
#[utoipa::path(operation_id = "fork_session", post, path = "/v1/sessions/{id}/fork", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name"),
        ("Idempotency-Key" = Option<String>, Header, description = "A retried request with this key answers what the first did")),
    request_body = SessionForkBody,
    responses((status = 201, body = Session, description = "The fork"), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such session, or no entry `at` on its live log"),
        (status = 409, body = ErrorBody, description = "The name is taken, or a request with this Idempotency-Key is in progress"),
        (status = 413, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used with another body")))]
pub async fn fork(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_of(body)?;
    let req: SessionForkBody = parse(&body)?;
    if req.reason.trim().is_empty() {
        return Err(ApiError::bad_request(
            "reason must say why the fork is made (1 to 1024 bytes)",
        ));
    }
    text("reason", &req.reason, 1024)?;
    if let Some(n) = &req.name {
        text("name", n, 255)?;
    }
    let parent = session(&app, id).await?;
    let a = Arc::clone(&app);
    let scope = format!("session-fork:{}", parent.id);
    idempotent(&app, &headers, &scope, &body, || async move {
        let (pid, at) = (parent.id.clone(), req.at);
        let f = a
            .engine(move |e| Ok(e.fork_session(&pid, at, &req.reason, req.name)?))
            .await?;
        a.emit(
            "session.forked",
            &f.id,
            format!("from session {} at entry {at}", parent.id),
        );
        Ok((
            StatusCode::CREATED,
            serde_json::to_value(Session::from(f)).expect("serialisable"),
        ))
    })
    .await
}

/// Moves the live log back to entry `to`: later entries are abandoned
/// (kept and chained); new ones follow them. The machine does not move:
/// fork at `to` for the machine as it was there.
#[utoipa::path(operation_id = "rewind_session", post, path = "/v1/sessions/{id}/rewind", tag = "sessions",
    params(("id" = String, Path, description = "Session id, unique prefix or name")),
    request_body = RewindBody,
    responses((status = 200, body = RewindResult), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such session, or no entry `to` on its live log"),
        (status = 409, body = ErrorBody, description = "Closed, nothing after `to`, or busy with another operation"),
        (status = 413, body = ErrorBody)))]
pub async fn rewind(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<RewindResult>> {
    let req: RewindBody = parse(&body_of(body)?)?;
    let s = session(&app, id).await?;
    let busy = app.claim_session(&s.id, "rewind")?;
    let id = s.id.clone();
    let r = app
        .engine(move |e| {
            let _busy = busy;
            Ok(e.rewind_session(&id, req.to)?)
        })
        .await?;
    app.emit(
        "session.rewound",
        &s.id,
        format!(
            "to entry {}; entries {}..={} abandoned",
            r.to_seq,
            r.to_seq + 1,
            r.head_seq
        ),
    );
    Ok(Json(r.into()))
}
