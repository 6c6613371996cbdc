//! Processes: run one and collect its output, or stream it as it happens
//! (server-sent events); stdin and signals to running ones.

use std::convert::Infallible;
use std::io::Write;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use cairn_engine::{Engine, OomProbe, SandboxRecord};
use cairn_protocol::{ExecRequest, ExitStatus};
use cairn_sandbox::client::SpawnFailure;
use futures_util::stream::Stream;
use tokio::sync::mpsc;

use super::parse;
use crate::app::App;
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;

/// Output kept per stream by a non-streamed exec.
const COLLECT_MAX: usize = 16 << 20;

pub(crate) fn request(body: &ExecBody, streamed: bool) -> ApiResult<ExecRequest> {
    if body.argv.is_empty() || body.argv[0].is_empty() {
        return Err(ApiError::bad_request(
            "argv must name a program, e.g. [\"sh\", \"-c\", \"echo hi\"]",
        ));
    }
    if body.argv.iter().chain(body.env.values()).any(|a| a.contains('\0')) {
        return Err(ApiError::bad_request("argv and env must not contain NUL bytes"));
    }
    if body
        .env
        .keys()
        .any(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
    {
        return Err(ApiError::bad_request(
            "env names must be non-empty and contain no '=' or NUL",
        ));
    }
    let timeout_ms = match body.timeout_secs {
        Some(t) if t.is_finite() && t > 0.0 && t <= 31_536_000.0 => Some((t * 1000.0).ceil() as u64),
        Some(t) => {
            return Err(ApiError::bad_request(format!(
                "timeout_secs must be positive seconds, got {t}"
            )))
        }
        None => None,
    };
    if let Some(d) = &body.on_disconnect {
        if !streamed {
            return Err(ApiError::bad_request("on_disconnect applies to streamed execs only"));
        }
        if d != "kill" && d != "keep" {
            return Err(ApiError::bad_request(format!(
                "on_disconnect must be kill or keep, got {d:?}"
            )));
        }
    }
    if body.stdin_open && !streamed {
        return Err(ApiError::bad_request(
            "stdin_open applies to streamed execs only; give stdin as text",
        ));
    }
    if body.detach && (body.stdin.is_some() || body.stdin_open) {
        return Err(ApiError::bad_request("a detached process has no stdin"));
    }
    Ok(ExecRequest {
        argv: body.argv.clone(),
        env: body.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        cwd: body.cwd.clone(),
        stdin: body.stdin.is_some() || body.stdin_open,
        timeout_ms,
        detach: body.detach,
        user: None,
    })
}

/// The result of a process that ended with `status` (none: detached or
/// gone quietly, taken as 0), its output left empty.
fn ended(engine: &Engine, probe: &OomProbe, pid: i32, status: Option<ExitStatus>) -> ExecResult {
    let status = status.unwrap_or(ExitStatus {
        code: Some(0),
        signal: None,
        timed_out: false,
    });
    ExecResult {
        pid,
        exit_code: if status.timed_out { 124 } else { status.shell_code() },
        signal: status.signal,
        timed_out: status.timed_out,
        oom_killed: status.signal == Some(libc::SIGKILL) && engine.oom_killed_since(probe),
        stdout: String::new(),
        stderr: String::new(),
        stdout_truncated: false,
        stderr_truncated: false,
    }
}

/// The result of a process that could not start (127 when it does not exist).
fn not_started(failure: &SpawnFailure) -> ExecResult {
    ExecResult {
        pid: 0,
        exit_code: failure.kind.shell_code(),
        signal: None,
        timed_out: false,
        oom_killed: false,
        stdout: String::new(),
        stderr: String::new(),
        stdout_truncated: false,
        stderr_truncated: false,
    }
}

/// Collects at most [`COLLECT_MAX`] bytes, noting whether more came.
#[derive(Default)]
pub(super) struct Collect {
    pub(super) bytes: Vec<u8>,
    pub(super) over: bool,
}

impl Write for Collect {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = COLLECT_MAX - self.bytes.len();
        self.bytes.extend_from_slice(&buf[..buf.len().min(room)]);
        self.over |= buf.len() > room;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn running(app: &Arc<App>, id: String) -> ApiResult<SandboxRecord> {
    app.engine(move |e| Ok(e.sandbox(&id)?)).await
}

/// Runs a process to its end and returns its status and output.
#[utoipa::path(operation_id = "exec", post, path = "/v1/sandboxes/{id}/exec", tag = "processes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = ExecBody,
    responses((status = 200, body = ExecResult, description = "The process ended (any exit code)"),
        (status = 202, body = Detached, description = "Started in the background"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn exec(State(app): State<Arc<App>>, Path(id): Path<String>, body: Bytes) -> ApiResult<Response> {
    let body: ExecBody = parse(&body)?;
    let req = request(&body, false)?;
    let detach = body.detach;
    let stdin = body.stdin.clone();
    let user = body.user.clone();
    let out = app
        .engine(move |e| {
            let rec = e.sandbox(&id)?;
            let req = e.with_user(&rec, req, user.as_deref())?;
            let start = match e.exec(&rec, req)? {
                Ok(s) => s,
                Err(failure) => {
                    let mut result = not_started(&failure);
                    result.stderr = format!("{}\n", failure.message);
                    return Ok(Err(result));
                }
            };
            let pid = start.session.pid;
            if detach {
                return Ok(Ok(pid));
            }
            if let Some(text) = stdin {
                let control = start.session.control();
                std::thread::spawn(move || {
                    let _ = control.stdin(text.as_bytes());
                    let _ = control.close_stdin();
                });
            }
            let (mut out, mut err) = (Collect::default(), Collect::default());
            let status = start.session.wait(&mut out, &mut err)?;
            let mut result = ended(e, &start.probe, pid, status);
            result.stdout = String::from_utf8_lossy(&out.bytes).into_owned();
            result.stderr = String::from_utf8_lossy(&err.bytes).into_owned();
            result.stdout_truncated = out.over;
            result.stderr_truncated = err.over;
            Ok(Err(result))
        })
        .await?;
    Ok(match out {
        Ok(pid) => (StatusCode::ACCEPTED, Json(Detached { pid })).into_response(),
        Err(result) => Json(result).into_response(),
    })
}

/// What a streamed exec sends, one server-sent event each.
enum Chunk {
    Started(i32),
    Out(Vec<u8>),
    Err(Vec<u8>),
    Exit(ExecResult),
    Failed(ApiError),
}

impl Chunk {
    fn event(self) -> Event {
        let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
        match self {
            Chunk::Started(pid) => Event::default().event("started").data(format!("{{\"pid\":{pid}}}")),
            Chunk::Out(d) => Event::default()
                .event("stdout")
                .data(serde_json::json!({ "data": b64(&d) }).to_string()),
            Chunk::Err(d) => Event::default()
                .event("stderr")
                .data(serde_json::json!({ "data": b64(&d) }).to_string()),
            Chunk::Exit(r) => Event::default()
                .event("exit")
                .data(serde_json::to_string(&r).expect("serialisable")),
            Chunk::Failed(e) => Event::default()
                .event("error")
                .data(serde_json::json!({ "error": { "code": e.code(), "message": e.message } }).to_string()),
        }
    }
}

/// Sends output to the client; once the client is gone, either fails
/// (the exec is then killed) or drains (kept running).
struct Sender {
    tx: mpsc::Sender<Chunk>,
    stderr: bool,
    keep: bool,
}

impl Write for Sender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let chunk = if self.stderr {
            Chunk::Err(buf.to_vec())
        } else {
            Chunk::Out(buf.to_vec())
        };
        match self.tx.blocking_send(chunk) {
            Ok(()) => Ok(buf.len()),
            Err(_) if self.keep => Ok(buf.len()),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the client went away",
            )),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs a process and streams `started`, `stdout`, `stderr` (base64 in
/// `data`) and `exit` events as they happen (or one `error` event).
#[utoipa::path(operation_id = "exec_stream", post, path = "/v1/sandboxes/{id}/exec/stream", tag = "processes",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = ExecBody,
    responses((status = 200, content_type = "text/event-stream", description = "Events: started {pid}, stdout {data}, stderr {data}, exit (an ExecResult without output), error {error}"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn exec_stream(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let body: ExecBody = parse(&body)?;
    if body.detach {
        return Err(ApiError::bad_request(
            "a detached exec has nothing to stream; use POST .../exec",
        ));
    }
    let req = request(&body, true)?;
    let user = body.user.clone();
    let rec = running(&app, id).await?;
    let keep = body.on_disconnect.as_deref() == Some("keep");
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    let a = Arc::clone(&app);
    let stdin = body.stdin.clone();
    let stdin_open = body.stdin_open;
    let tenant = crate::tenancy::current();
    tokio::task::spawn_blocking(move || {
        let engine = match a.take_engine_for(tenant) {
            Ok(e) => e,
            Err(e) => return drop(tx.blocking_send(Chunk::Failed(e))),
        };
        let sandbox_id = rec.id.clone();
        let result = (|| -> ApiResult<ExecResult> {
            let req = engine.with_user(&rec, req, user.as_deref())?;
            let start = match engine.exec(&rec, req)? {
                Ok(s) => s,
                Err(failure) => {
                    let _ = tx.blocking_send(Chunk::Err(format!("{}\n", failure.message).into_bytes()));
                    return Ok(not_started(&failure));
                }
            };
            let pid = start.session.pid;
            let control = start.session.control();
            a.register(&sandbox_id, pid, control.clone());
            let _ = tx.blocking_send(Chunk::Started(pid));
            if let Some(text) = stdin {
                let c = control.clone();
                std::thread::spawn(move || {
                    let _ = c.stdin(text.as_bytes());
                    if !stdin_open {
                        let _ = c.close_stdin();
                    }
                });
            }
            // A client that goes away while the process is silent.
            let watcher = (!keep).then(|| {
                let (tx2, c) = (tx.clone(), control.clone());
                tokio::runtime::Handle::current().spawn(async move {
                    tx2.closed().await;
                    let _ = c.signal(libc::SIGKILL);
                })
            });
            let mut out = Sender {
                tx: tx.clone(),
                stderr: false,
                keep,
            };
            let mut err = Sender {
                tx: tx.clone(),
                stderr: true,
                keep,
            };
            let waited = start.session.wait(&mut out, &mut err);
            if let Some(w) = watcher {
                w.abort();
            }
            a.unregister(&sandbox_id, pid);
            let status = match waited {
                Ok(s) => s,
                Err(e) => {
                    // The client went away: the process goes too.
                    let _ = control.signal(libc::SIGKILL);
                    return Err(e.into());
                }
            };
            Ok(ended(&engine, &start.probe, pid, status))
        })();
        a.give_back(engine);
        let _ = tx.blocking_send(match result {
            Ok(r) => Chunk::Exit(r),
            Err(e) => Chunk::Failed(e),
        });
    });
    // The stream ends with the exit (or error) event, or when the server
    // stops (the process then goes as on a disconnect).
    let stopped = Box::pin(app.stopped());
    let stream = futures_util::stream::unfold(Some((rx, stopped)), |state| async move {
        let (mut rx, mut stopped) = state?;
        let chunk = tokio::select! {
            c = rx.recv() => c?,
            () = &mut stopped => Chunk::Failed(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is stopping; the process was handled as on a disconnect (on_disconnect)",
            )),
        };
        let last = matches!(chunk, Chunk::Exit(_) | Chunk::Failed(_));
        Some((Ok(chunk.event()), (!last).then_some((rx, stopped))))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// Writes to the stdin of a process started by a streamed exec with
/// `stdin_open`.
#[utoipa::path(operation_id = "write_stdin", post, path = "/v1/sandboxes/{id}/processes/{pid}/stdin", tag = "processes",
    params(("id" = String, Path, description = "Sandbox id"), ("pid" = i32, Path, description = "Process id")),
    request_body = StdinBody,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn stdin(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let pid = pid_of(&pid)?;
    let body: StdinBody = parse(&body)?;
    let data = match (&body.data, &body.data_base64) {
        (Some(t), None) => t.as_bytes().to_vec(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .map_err(|e| ApiError::bad_request(format!("data_base64: {e}")))?,
        (None, None) => Vec::new(),
        (Some(_), Some(_)) => return Err(ApiError::bad_request("give data or data_base64, not both")),
    };
    let rec = running(&app, id).await?;
    let control = app.control(&rec.id, pid).ok_or_else(|| {
        ApiError::not_found(format!(
            "no process {pid} with open stdin in sandbox {}: start it with a streamed exec and stdin_open",
            rec.id
        ))
    })?;
    tokio::task::spawn_blocking(move || {
        if !data.is_empty() {
            control.stdin(&data)?;
        }
        if body.close {
            control.close_stdin()?;
        }
        Ok::<_, cairn_protocol::FrameError>(())
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
    .map_err(|e| ApiError::new(StatusCode::GONE, format!("the process's stdin is gone: {e}")))?;
    Ok(StatusCode::NO_CONTENT)
}

fn signal_number(v: &Signal) -> ApiResult<i32> {
    let bad = || ApiError::bad_request("signal must be a number (1-64) or a name like KILL or SIGTERM");
    match v {
        Signal::Number(n) => (1..=64).contains(n).then_some(*n as i32).ok_or_else(bad),
        Signal::Name(s) => {
            let name = s.trim_start_matches("SIG").to_ascii_uppercase();
            let n = match name.as_str() {
                "HUP" => libc::SIGHUP,
                "INT" => libc::SIGINT,
                "QUIT" => libc::SIGQUIT,
                "KILL" => libc::SIGKILL,
                "USR1" => libc::SIGUSR1,
                "USR2" => libc::SIGUSR2,
                "TERM" => libc::SIGTERM,
                "CONT" => libc::SIGCONT,
                "STOP" => libc::SIGSTOP,
                _ => return Err(bad()),
            };
            Ok(n)
        }
    }
}

/// A pid from a path: a number above 1.
fn pid_of(s: &str) -> ApiResult<i32> {
    s.parse::<i32>().ok().filter(|p| *p > 1).ok_or_else(|| {
        ApiError::bad_request(format!(
            "pid must be a process the sandbox runs (a number above 1), got {s:?}"
        ))
    })
}

/// Sends a signal to a process (and its process group) in the sandbox.
#[utoipa::path(operation_id = "signal_process", post, path = "/v1/sandboxes/{id}/processes/{pid}/signal", tag = "processes",
    params(("id" = String, Path, description = "Sandbox id"), ("pid" = i32, Path, description = "Process id")),
    request_body = SignalBody,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn signal(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let pid = pid_of(&pid)?;
    let body: SignalBody = parse(&body)?;
    let sig = signal_number(&body.signal)?;
    let rec = running(&app, id).await?;
    app.init(&rec.id.clone(), move |e| Ok(e.client(&rec)?.kill(pid, sig)?))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
