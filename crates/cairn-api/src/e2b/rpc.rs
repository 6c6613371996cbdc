//! envd's Connect RPCs with the JSON codec: `process.Process` (Start and
//! Connect as server streams of 5-byte envelopes ending in an
//! end-of-stream frame; List, SendInput, SendSignal, CloseStdin unary) and
//! `filesystem.Filesystem` (Stat, ListDir, MakeDir, Move, Remove, and the
//! watchers of `watch.rs`). A process started with `pty` runs on a
//! terminal init opens (output as `pty` data, input as `pty` input,
//! `Update` resizes it). StreamInput is a client stream. On gVisor
//! sandboxes commands without stdin or terminal run as init's jobs
//! (`jobs.rs`).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use cairn_protocol::{ExecRequest, FileKind, PtySize};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use super::envd::{entry_info, home_of, resolve, sandbox_of, user_of, Denied, Names};
use super::jobs::{self, Job};
use super::watch;
use super::{Gateway, Handle, Proc};
use crate::error::{client_status, ApiError};

/// The largest request message accepted (SendInput carries stdin).
const MAX_MESSAGE: usize = 4 << 20;
/// The most entries one ListDir answers.
const MAX_LIST: u32 = 10_000;
/// Keepalive events on quiet process streams (the SDK asks for ≤ 50 s).
const KEEPALIVE: Duration = Duration::from_secs(30);

/// A Connect error: a code string and a message.
#[derive(Debug)]
pub(crate) struct RpcError {
    code: &'static str,
    message: String,
}

impl RpcError {
    pub(super) fn new(code: &'static str, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }
    fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new("invalid_argument", message)
    }
    fn status(&self) -> StatusCode {
        match self.code {
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" => StatusCode::CONFLICT,
            "invalid_argument" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
    fn json(&self) -> Value {
        json!({ "code": self.code, "message": self.message })
    }
}

fn code_of_status(s: StatusCode) -> &'static str {
    match s {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::CONFLICT => "already_exists",
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_argument",
        StatusCode::FORBIDDEN => "permission_denied",
        StatusCode::UNAUTHORIZED => "unauthenticated",
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::BAD_GATEWAY => "unavailable",
        _ => "internal",
    }
}

impl From<ApiError> for RpcError {
    fn from(e: ApiError) -> RpcError {
        RpcError::new(code_of_status(e.status), e.message)
    }
}

impl From<cairn_sandbox::client::ClientError> for RpcError {
    fn from(e: cairn_sandbox::client::ClientError) -> RpcError {
        RpcError::new(code_of_status(client_status(&e)), e.to_string())
    }
}

impl From<Denied> for RpcError {
    fn from(d: Denied) -> RpcError {
        match d {
            Denied::Token(m) => RpcError::new("unauthenticated", m),
            Denied::NotRunning(m) => RpcError::new("unavailable", m),
        }
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.json())).into_response()
    }
}

pub(super) type Rpc<T> = Result<T, RpcError>;

fn unary(v: Value) -> Response {
    axum::Json(v).into_response()
}

/// One envelope: flags, big-endian length, message.
pub(super) fn frame(flags: u8, v: &Value) -> Bytes {
    let msg = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    let mut out = Vec::with_capacity(5 + msg.len());
    out.push(flags);
    out.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    out.extend_from_slice(&msg);
    Bytes::from(out)
}

pub(super) fn event(v: Value) -> Bytes {
    frame(0, &json!({ "event": v }))
}

pub(super) fn end_of_stream(err: Option<&RpcError>) -> Bytes {
    frame(
        2,
        &err.map(|e| json!({ "error": e.json() })).unwrap_or_else(|| json!({})),
    )
}

/// A stream that is only its end-of-stream error (what envd answers when
/// a stream fails before it starts).
fn stream_error(e: RpcError) -> Response {
    stream_response(Body::from(end_of_stream(Some(&e))))
}

fn stream_response(body: Body) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// The one message of a server-stream request.
fn envelope<T: serde::de::DeserializeOwned>(body: &[u8]) -> Rpc<T> {
    if body.len() < 5 {
        return Err(RpcError::invalid("the request holds no Connect envelope"));
    }
    if body[0] & 1 != 0 {
        return Err(RpcError::invalid("compressed messages are not supported"));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let msg = body
        .get(5..5 + len)
        .ok_or_else(|| RpcError::invalid("the Connect envelope is shorter than its length"))?;
    message(msg)
}

fn message<T: serde::de::DeserializeOwned>(body: &[u8]) -> Rpc<T> {
    let body = if body.is_empty() { &b"{}"[..] } else { body };
    serde_json::from_slice(body).map_err(|e| RpcError::invalid(format!("invalid message: {e}")))
}

async fn read_body(body: Body) -> Rpc<Bytes> {
    axum::body::to_bytes(body, MAX_MESSAGE).await.map_err(|_| {
        RpcError::new(
            "resource_exhausted",
            format!("messages are limited to {MAX_MESSAGE} bytes"),
        )
    })
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: std::collections::BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Value>,
    tag: Option<String>,
    stdin: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SelectorRequest {
    #[serde(default)]
    process: Selector,
    signal: Option<Value>,
    input: Option<Value>,
    pty: Option<Value>,
}

/// The most columns or rows a terminal may have.
const PTY_SIDE_MAX: u64 = 10_000;

/// A `PTY` message's size: `{"size": {"rows": R, "cols": C}}`, each 1 to
/// [`PTY_SIDE_MAX`].
fn pty_size(pty: &Value) -> Rpc<PtySize> {
    let side = |name: &str| -> Rpc<u16> {
        match pty.get("size").and_then(|s| s.get(name)).and_then(Value::as_u64) {
            Some(n @ 1..=PTY_SIDE_MAX) => Ok(n as u16),
            other => Err(RpcError::invalid(format!(
                "pty.size.{name} must be a whole number from 1 to {PTY_SIDE_MAX}, got {}",
                other.map_or("nothing".to_string(), |n| n.to_string())
            ))),
        }
    };
    Ok(PtySize {
        rows: side("rows")?,
        cols: side("cols")?,
    })
}

/// `process.Process/{method}`.
pub async fn process(
    State(gw): State<Arc<Gateway>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let streamed = matches!(method.as_str(), "Start" | "Connect" | "StreamInput");
    let checked = sandbox_of(&gw, &headers).await.map_err(RpcError::from);
    let result = match checked {
        Err(e) => Err(e),
        // A client stream: read as it comes, not whole.
        Ok((entry, _)) if method == "StreamInput" => stream_input(&gw, &entry.id, body).await,
        Ok((entry, sandbox)) => match read_body(body).await {
            Err(e) => Err(e),
            Ok(body) => match method.as_str() {
                "Start" => start(&gw, entry, sandbox, &headers, &body).await,
                "Connect" => reattach(&gw, &entry.id, &body),
                "List" => Ok(list(&gw, &entry.id)),
                "SendSignal" => signal(&gw, &entry.id, &sandbox, &body).await,
                "SendInput" => send_input(&gw, &entry.id, &body),
                "CloseStdin" => close_stdin(&gw, &entry.id, &body),
                "Update" => update(&gw, &entry.id, &body),
                other => Err(RpcError::new(
                    "unimplemented",
                    format!("no method process.Process/{other}"),
                )),
            },
        },
    };
    match result {
        Ok(r) => r,
        Err(e) if streamed => stream_error(e),
        Err(e) => e.into_response(),
    }
}

/// Finds a running process by pid or tag.
fn find(gw: &Gateway, id: &str, sel: &Selector) -> Rpc<i32> {
    let procs = gw.procs.lock().unwrap_or_else(|e| e.into_inner());
    let found = procs.iter().find(|((sid, pid), p)| {
        sid == id
            && match (&sel.pid, &sel.tag) {
                (Some(want), _) => i64::from(*pid) == i64::from(*want),
                (None, Some(tag)) => p.info.get("tag").and_then(Value::as_str) == Some(tag.as_str()),
                (None, None) => false,
            }
    });
    match found {
        Some(((_, pid), _)) => Ok(*pid),
        None => Err(RpcError::new(
            "not_found",
            match (&sel.pid, &sel.tag) {
                (Some(p), _) => format!("process with pid {p} not found"),
                (None, Some(t)) => format!("process with tag {t:?} not found"),
                (None, None) => "give a pid or a tag".into(),
            },
        )),
    }
}

fn handle(gw: &Gateway, id: &str, pid: i32) -> Rpc<Handle> {
    let procs = gw.procs.lock().unwrap_or_else(|e| e.into_inner());
    procs
        .get(&(id.to_string(), pid))
        .map(|p| p.handle.clone())
        .ok_or_else(|| RpcError::new("not_found", format!("process with pid {pid} not found")))
}

/// The connection to a process started with stdin; a job has none.
fn attached(gw: &Gateway, id: &str, pid: i32) -> Rpc<cairn_sandbox::client::ExecControl> {
    match handle(gw, id, pid)? {
        Handle::Attached(c) => Ok(c),
        Handle::Job(_) => Err(RpcError::new(
            "failed_precondition",
            format!("process {pid} was started without stdin: start it with stdin=True to send it input"),
        )),
    }
}

fn list(gw: &Gateway, id: &str) -> Response {
    let procs = gw.procs.lock().unwrap_or_else(|e| e.into_inner());
    let items: Vec<Value> = procs
        .iter()
        .filter(|((sid, _), _)| sid == id)
        .map(|(_, p)| p.info.clone())
        .collect();
    unary(json!({ "processes": items }))
}

async fn signal(gw: &Arc<Gateway>, id: &str, sandbox: &str, body: &[u8]) -> Rpc<Response> {
    let req: SelectorRequest = message(body)?;
    let sig = match req.signal.as_ref() {
        Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
        Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
        Some(Value::Number(n)) if n.as_i64() == Some(9) => libc::SIGKILL,
        Some(Value::Number(n)) if n.as_i64() == Some(15) => libc::SIGTERM,
        other => {
            return Err(RpcError::invalid(format!(
                "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, got {other:?}"
            )))
        }
    };
    let pid = find(gw, id, &req.process)?;
    let gone = |e: String| RpcError::new("not_found", format!("process with pid {pid} is gone: {e}"));
    match handle(gw, id, pid)? {
        Handle::Attached(c) => c.signal(sig).map_err(|e| gone(e.to_string()))?,
        Handle::Job(_) => {
            // A job leads its own process group: the group gets the
            // signal, as an attached command's does.
            let sandbox = sandbox.to_string();
            gw.app
                .init(&sandbox.clone(), move |e| {
                    let rec = e.sandbox(&sandbox)?;
                    Ok(e.client(&rec)?.kill(-pid, sig)?)
                })
                .await
                .map_err(|e| gone(e.message))?;
        }
    }
    Ok(unary(json!({})))
}

/// Whether process `pid` runs on a terminal.
fn on_terminal(gw: &Gateway, id: &str, pid: i32) -> bool {
    let procs = gw.procs.lock().unwrap_or_else(|e| e.into_inner());
    procs.get(&(id.to_string(), pid)).is_some_and(|p| p.terminal)
}

fn send_input(gw: &Gateway, id: &str, body: &[u8]) -> Rpc<Response> {
    let req: SelectorRequest = message(body)?;
    let input = req.input.unwrap_or(Value::Null);
    let (data, pty) = match (input.get("stdin"), input.get("pty")) {
        (Some(Value::String(b)), _) => (decode_bytes(b)?, false),
        (_, Some(Value::String(b))) => (decode_bytes(b)?, true),
        _ => (Vec::new(), false),
    };
    let pid = find(gw, id, &req.process)?;
    if pty && !on_terminal(gw, id, pid) {
        return Err(RpcError::new(
            "failed_precondition",
            format!("process {pid} has no terminal: send it stdin, or start it with pty.create"),
        ));
    }
    let c = attached(gw, id, pid)?;
    if !data.is_empty() {
        c.stdin(&data).map_err(|e| {
            RpcError::new(
                "failed_precondition",
                format!("the stdin of process {pid} is gone: {e}"),
            )
        })?;
    }
    Ok(unary(json!({})))
}

/// Takes the first whole envelope's message off `buf`, if there is one.
fn take_envelope(buf: &mut Vec<u8>) -> Rpc<Option<Vec<u8>>> {
    let Some(head) = buf.get(..5) else { return Ok(None) };
    if head[0] & 1 != 0 {
        return Err(RpcError::invalid("compressed messages are not supported"));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(RpcError::new(
            "resource_exhausted",
            format!("messages are limited to {MAX_MESSAGE} bytes"),
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let msg = buf[5..5 + len].to_vec();
    buf.drain(..5 + len);
    Ok(Some(msg))
}

/// `Process/StreamInput`: a client stream whose first message names the
/// process (`start`), then `data` (stdin or, for a terminal, pty bytes)
/// and `keepalive` messages. Each chunk goes to the process as it comes;
/// the answer comes when the client ends its stream.
async fn stream_input(gw: &Arc<Gateway>, id: &str, body: Body) -> Rpc<Response> {
    use futures_util::StreamExt;
    let mut chunks = body.into_data_stream();
    let mut buf = Vec::new();
    let mut target: Option<(i32, cairn_sandbox::client::ExecControl, bool)> = None;
    loop {
        while let Some(msg) = take_envelope(&mut buf)? {
            let msg: Value = message(&msg)?;
            if let Some(start) = msg.get("start") {
                let sel: Selector = serde_json::from_value(start.get("process").cloned().unwrap_or(Value::Null))
                    .map_err(|e| RpcError::invalid(format!("invalid start: {e}")))?;
                let pid = find(gw, id, &sel)?;
                target = Some((pid, attached(gw, id, pid)?, on_terminal(gw, id, pid)));
            } else if let Some(data) = msg.get("data") {
                let Some((pid, control, terminal)) = &target else {
                    return Err(RpcError::invalid(
                        "the stream must start with a start message naming the process",
                    ));
                };
                let input = data.get("input").unwrap_or(&Value::Null);
                let bytes = match (input.get("stdin"), input.get("pty")) {
                    (Some(Value::String(b)), _) => decode_bytes(b)?,
                    (_, Some(Value::String(b))) if *terminal => decode_bytes(b)?,
                    (_, Some(_)) => {
                        return Err(RpcError::new(
                            "failed_precondition",
                            format!("process {pid} has no terminal: send it stdin, or start it with pty.create"),
                        ))
                    }
                    _ => continue,
                };
                let (pid, control) = (*pid, control.clone());
                // Init may hold the write while the process does not read.
                tokio::task::spawn_blocking(move || control.stdin(&bytes))
                    .await
                    .map_err(|e| RpcError::new("internal", e.to_string()))?
                    .map_err(|e| {
                        RpcError::new(
                            "failed_precondition",
                            format!("the stdin of process {pid} is gone: {e}"),
                        )
                    })?;
            }
        }
        match chunks.next().await {
            Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
            Some(Err(e)) => return Err(RpcError::invalid(format!("the request stream failed: {e}"))),
            None if buf.is_empty() => break,
            None => return Err(RpcError::invalid("the request stream ended inside a message")),
        }
    }
    let mut out = frame(0, &json!({})).to_vec();
    out.extend_from_slice(&end_of_stream(None));
    Ok(stream_response(Body::from(out)))
}

/// `Process/Update`: resizes a process's terminal.
fn update(gw: &Gateway, id: &str, body: &[u8]) -> Rpc<Response> {
    let req: SelectorRequest = message(body)?;
    let Some(pty) = req.pty.as_ref() else {
        return Ok(unary(json!({})));
    };
    let size = pty_size(pty)?;
    let pid = find(gw, id, &req.process)?;
    if !on_terminal(gw, id, pid) {
        return Err(RpcError::new(
            "failed_precondition",
            format!("process {pid} has no terminal to resize: start it with pty.create"),
        ));
    }
    attached(gw, id, pid)?
        .resize(size)
        .map_err(|e| RpcError::new("not_found", format!("process with pid {pid} is gone: {e}")))?;
    Ok(unary(json!({})))
}

fn close_stdin(gw: &Gateway, id: &str, body: &[u8]) -> Rpc<Response> {
    let req: SelectorRequest = message(body)?;
    let pid = find(gw, id, &req.process)?;
    attached(gw, id, pid)?.close_stdin().map_err(|e| {
        RpcError::new(
            "failed_precondition",
            format!("the stdin of process {pid} is gone: {e}"),
        )
    })?;
    Ok(unary(json!({})))
}

/// Proto3 JSON bytes: standard or URL-safe base64, padded or not.
fn decode_bytes(s: &str) -> Rpc<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|e| e.decode(s).ok())
        .ok_or_else(|| RpcError::invalid("stdin is not base64"))
}

/// Output of a started process, sent as `data` events to the stream that
/// started it (while it listens) and to reattached streams. The process
/// keeps running when its client goes.
pub(super) struct Out {
    tx: mpsc::Sender<Bytes>,
    open: bool,
    events: broadcast::Sender<Bytes>,
    key: &'static str,
    /// A job counts what it relayed, to be followed again from there.
    job: Option<Arc<Job>>,
}

impl Out {
    /// The stdout and stderr relays of a process.
    pub(super) fn pair(tx: mpsc::Sender<Bytes>, events: broadcast::Sender<Bytes>, job: Option<Arc<Job>>) -> (Out, Out) {
        let out = Out {
            tx: tx.clone(),
            open: !tx.is_closed(),
            events: events.clone(),
            key: "stdout",
            job: job.clone(),
        };
        let err = Out {
            tx,
            open: out.open,
            events,
            key: "stderr",
            job,
        };
        (out, err)
    }

    /// Where reattached streams listen.
    pub(super) fn events(&self) -> broadcast::Sender<Bytes> {
        self.events.clone()
    }

    pub(super) fn send(&mut self, f: Bytes) {
        if self.open && self.tx.blocking_send(f.clone()).is_err() {
            self.open = false;
        }
        let _ = self.events.send(f);
    }
}

impl Write for Out {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(job) = &self.job {
            job.relayed(usize::from(self.key == "stderr"), buf.len());
        }
        let b64 = base64::engine::general_purpose::STANDARD.encode(buf);
        self.send(event(json!({ "data": { self.key: b64 } })));
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The argv to run: the SDK wraps every command in `/bin/bash -l -c`; a
/// sandbox without bash (the busybox default) runs it with `/bin/sh`.
async fn argv(gw: &Arc<Gateway>, sandbox: &str, cmd: String, args: Vec<String>) -> Rpc<Vec<String>> {
    let mut argv = Vec::with_capacity(args.len() + 1);
    if cmd == "/bin/bash" || cmd == "bash" {
        let cached = gw.bash.lock().unwrap_or_else(|e| e.into_inner()).get(sandbox).copied();
        let has_bash = match cached {
            Some(b) => b,
            None => {
                let s = sandbox.to_string();
                let b = gw
                    .app
                    .init(&s.clone(), move |e| {
                        let rec = e.sandbox(&s)?;
                        let client = e.client(&rec)?;
                        // With a merged /usr (Debian since 12) /bin is a
                        // link to usr/bin, which file operations never
                        // follow: bash is looked for where the link leads.
                        Ok(match client.stat("/bin/bash") {
                            Ok(found) => found.is_some(),
                            Err(_) => client.stat("/usr/bin/bash")?.is_some(),
                        })
                    })
                    .await?;
                gw.bash
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(sandbox.to_string(), b);
                b
            }
        };
        argv.push(if has_bash { cmd } else { "/bin/sh".into() });
    } else {
        argv.push(cmd);
    }
    argv.extend(args);
    Ok(argv)
}

/// The `end` event as envd sends it; when `oom`, its `error` says that the
/// OOM killer ended the process (its `status` stays envd's).
pub(super) fn end_event(status: &cairn_protocol::ExitStatus, oom: bool) -> Value {
    let (code, text) = match (status.code, status.signal) {
        (Some(c), _) => (c, format!("exit status {c}")),
        (None, Some(libc::SIGKILL)) => (-1, "signal: killed".to_string()),
        (None, Some(s)) => (-1, format!("signal: {s}")),
        (None, None) => (-1, "ended".to_string()),
    };
    let mut end = json!({ "exitCode": code, "exited": status.code.is_some(), "status": text });
    if oom {
        end["error"] = json!(format!(
            "{text}: the command was killed by the OOM killer (out of memory); give the sandbox more memory"
        ));
    } else if code != 0 {
        end["error"] = json!(text);
    }
    json!({ "end": end })
}

/// `Process/Start`: runs the command and streams `start`, `data`,
/// `keepalive` and `end` events, then the end-of-stream frame.
async fn start(
    gw: &Arc<Gateway>,
    entry: super::Entry,
    sandbox: String,
    headers: &HeaderMap,
    body: &[u8],
) -> Rpc<Response> {
    let req: StartRequest = envelope(body)?;
    let pty = req.pty.as_ref().map(pty_size).transpose()?;
    let cfg = req.process;
    if cfg.cmd.is_empty() || cfg.cmd.contains('\0') || cfg.args.iter().any(|a| a.contains('\0')) {
        return Err(RpcError::invalid(
            "cmd must be non-empty; cmd and args must not contain NUL",
        ));
    }
    let user = user_of(headers);
    let home = home_of(&user);
    // A built template's WORKDIR is where commands run unless they say.
    let default_cwd = entry.workdir.as_deref().unwrap_or(home);
    let cwd = resolve(cfg.cwd.as_deref().unwrap_or(default_cwd), home).map_err(RpcError::invalid)?;
    let mut env: Vec<(String, String)> = vec![("HOME".into(), home.into()), ("USER".into(), user.clone())];
    env.extend(entry.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    for (k, v) in &cfg.envs {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(RpcError::invalid(format!("invalid environment variable {k:?}")));
        }
        env.push((k.clone(), v.clone()));
    }
    let timeout_ms = headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&t| t > 0);
    let info = json!({
        "config": { "cmd": cfg.cmd, "args": cfg.args, "envs": cfg.envs, "cwd": cwd },
        "tag": req.tag,
    });
    let exec = ExecRequest {
        argv: argv(gw, &sandbox, cfg.cmd.clone(), cfg.args.clone()).await?,
        env,
        cwd: Some(cwd),
        stdin: req.stdin.unwrap_or(false),
        timeout_ms,
        detach: false,
        // As E2B runs them: as the user asked for (`user` by default),
        // where the image has that user.
        user: gw.user_ids(&sandbox, &user).await?,
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Rpc<()>>();
    let g = Arc::clone(gw);
    let id = entry.id.clone();
    let grant = entry.grant.clone();
    let launch = Launch { exec, pty, info };
    tokio::task::spawn_blocking(move || run(g, id, sandbox, launch, tx, ready_tx));
    match ready_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(RpcError::new("internal", "the process could not be started")),
    }
    Ok(stream_response(stream_body(gw, rx, grant)))
}

/// A process to start: what to run, on a terminal of what size if any,
/// and the `ProcessInfo` that `Process/List` answers for it.
struct Launch {
    exec: ExecRequest,
    pty: Option<PtySize>,
    info: Value,
}

/// Starts the process on a blocking thread, reports the start, and
/// relays its output until it ends.
fn run(
    gw: Arc<Gateway>,
    id: String,
    sandbox: String,
    launch: Launch,
    tx: mpsc::Sender<Bytes>,
    ready: tokio::sync::oneshot::Sender<Rpc<()>>,
) {
    let Launch { exec, pty, mut info } = launch;
    let engine = match gw.app.take_engine() {
        Ok(e) => e,
        Err(e) => return drop(ready.send(Err(e.into()))),
    };
    let started = engine
        .sandbox(&sandbox)
        .map_err(ApiError::from)
        .and_then(|rec| jobs::start(&engine, &rec, exec, pty));
    gw.app.give_back(engine);
    let (pid, started) = match started {
        Ok(Ok(s)) => s,
        Ok(Err(message)) => return drop(ready.send(Err(RpcError::invalid(message)))),
        Err(e) => return drop(ready.send(Err(e.into()))),
    };
    info["pid"] = json!(pid);
    let (events, _) = broadcast::channel(256);
    let (handle, job) = match &started {
        jobs::Started::Attached(session, _) => (Handle::Attached(session.control()), None),
        jobs::Started::Job(job) => (Handle::Job(Arc::clone(job)), Some(Arc::clone(job))),
    };
    gw.procs.lock().unwrap_or_else(|e| e.into_inner()).insert(
        (id.clone(), pid),
        Proc {
            handle,
            info,
            events: events.clone(),
            terminal: pty.is_some(),
        },
    );
    if ready.send(Ok(())).is_err() {
        // The client went before the start: the process stays, as in envd.
    }
    let (mut out, mut err) = Out::pair(tx, events, job);
    if pty.is_some() {
        // A terminal's output is one stream, which the SDK takes as `pty`.
        out.key = "pty";
    }
    out.send(event(json!({ "start": { "pid": pid } })));
    match started {
        jobs::Started::Attached(session, probe) => {
            let waited = session.wait(&mut out, &mut err);
            forget_proc(&gw, &id, pid, None);
            match waited {
                Ok(status) => {
                    let killed = status.as_ref().is_some_and(|s| s.signal == Some(libc::SIGKILL));
                    let oom = killed
                        && gw.app.take_engine().is_ok_and(|engine| {
                            let oom = engine.oom_killed_since(&probe);
                            gw.app.give_back(engine);
                            oom
                        });
                    ended(&mut out, status, oom)
                }
                Err(e) => {
                    let e: RpcError = e.into();
                    out.send(end_of_stream(Some(&RpcError::new("unavailable", e.message))));
                }
            }
        }
        jobs::Started::Job(job) => jobs::relay(&gw, &id, pid, &job, &mut out, &mut err),
    }
}

/// Forgets process `pid` of sandbox `id`; with `job`, only if it is still
/// that job's.
pub(super) fn forget_proc(gw: &Gateway, id: &str, pid: i32, job: Option<&Arc<Job>>) {
    let mut procs = gw.procs.lock().unwrap_or_else(|e| e.into_inner());
    let key = (id.to_string(), pid);
    let same = match (procs.get(&key).map(|p| &p.handle), job) {
        (Some(Handle::Job(mine)), Some(job)) => Arc::ptr_eq(mine, job),
        (Some(_), None) => true,
        _ => false,
    };
    if same {
        procs.remove(&key);
    }
}

/// Sends a process's end event and ends its streams.
/// `oom`: the OOM killer ended it (said in the event's `error`).
pub(super) fn ended(out: &mut Out, status: Option<cairn_protocol::ExitStatus>, oom: bool) {
    let status = status.unwrap_or(cairn_protocol::ExitStatus {
        code: Some(0),
        signal: None,
        timed_out: false,
    });
    out.send(event(end_event(&status, oom)));
    let deadline = status
        .timed_out
        .then(|| RpcError::new("deadline_exceeded", "the command ran past its timeout and was killed"));
    out.send(end_of_stream(deadline.as_ref()));
}

/// The response body: frames as they come, a keepalive on quiet streams.
/// When the server stops, the stream ends with `unavailable` (the process
/// keeps running) rather than holding the shutdown until it exits; when the
/// API key the sandbox was granted to is removed (`grant`), it ends with
/// `unauthenticated`.
fn stream_body(gw: &Arc<Gateway>, rx: mpsc::Receiver<Bytes>, grant: Option<String>) -> Body {
    stream_body_with(gw, rx, grant, event(json!({ "keepalive": {} })))
}

/// [`stream_body`] whose quiet stream gets `keepalive` frames.
fn stream_body_with(gw: &Arc<Gateway>, rx: mpsc::Receiver<Bytes>, grant: Option<String>, keepalive: Bytes) -> Body {
    let stopped = Box::pin(gw.app.stopped());
    let gw = Arc::clone(gw);
    let revoked: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
        Box::pin(async move { gw.revoked(grant).await });
    Body::from_stream(futures_util::stream::unfold(
        Some((rx, stopped, revoked)),
        move |state| {
            let keepalive = keepalive.clone();
            async move {
                let (mut rx, mut stopped, mut revoked) = state?;
                enum Next {
                    Frame(Option<Bytes>),
                    Quiet,
                    Stopping,
                    Revoked,
                }
                let next = tokio::select! {
                    f = rx.recv() => Next::Frame(f),
                    _ = tokio::time::sleep(KEEPALIVE) => Next::Quiet,
                    () = &mut stopped => Next::Stopping,
                    () = &mut revoked => Next::Revoked,
                };
                let ended = |e: RpcError| Some((Ok(end_of_stream(Some(&e))), None));
                match next {
                    Next::Frame(f) => {
                        let f = f?;
                        let last = f.first() == Some(&2);
                        Some((Ok::<_, std::io::Error>(f), (!last).then_some((rx, stopped, revoked))))
                    }
                    Next::Quiet => Some((Ok(keepalive.clone()), Some((rx, stopped, revoked)))),
                    Next::Stopping => ended(RpcError::new(
                        "unavailable",
                        "the server is stopping; the process keeps running: reattach with commands.connect(pid)",
                    )),
                    Next::Revoked => ended(RpcError::new(
                        "unauthenticated",
                        "the access token was revoked (its API key was removed); the process keeps running",
                    )),
                }
            }
        },
    ))
}

/// `Process/Connect`: a new stream of a running process's events from now
/// on (earlier output is not replayed, as in envd).
fn reattach(gw: &Arc<Gateway>, id: &str, body: &[u8]) -> Rpc<Response> {
    let req: SelectorRequest = envelope(body)?;
    let pid = find(gw, id, &req.process)?;
    let mut sub = {
        let procs = gw.procs.lock().unwrap_or_else(|e| e.into_inner());
        procs
            .get(&(id.to_string(), pid))
            .map(|p| p.events.subscribe())
            .ok_or_else(|| RpcError::new("not_found", format!("process with pid {pid} not found")))?
    };
    // A job nothing follows (its follower gave up) is followed again.
    gw.refollow(id);
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        if tx.send(event(json!({ "start": { "pid": pid } }))).await.is_err() {
            return;
        }
        loop {
            match sub.recv().await {
                Ok(f) => {
                    let last = f.first() == Some(&2);
                    if tx.send(f).await.is_err() || last {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => {
                    let _ = tx.send(end_of_stream(None)).await;
                    return;
                }
            }
        }
    });
    Ok(stream_response(stream_body(gw, rx, gw.entry(id).and_then(|e| e.grant))))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default)]
    watcher_id: String,
    #[serde(default)]
    depth: u32,
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

/// `filesystem.Filesystem/{method}`.
pub async fn filesystem(
    State(gw): State<Arc<Gateway>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let (entry, sandbox) = sandbox_of(&gw, &headers).await?;
        let body = read_body(body).await?;
        let req: PathRequest = if method == "WatchDir" {
            envelope(&body)?
        } else {
            message(&body)?
        };
        let home = home_of(&user_of(&headers));
        match method.as_str() {
            "GetWatcherEvents" => return Ok(Watched::Unary(gw.watchers().take(&entry.id, &req.watcher_id)?)),
            "RemoveWatcher" => return Ok(Watched::Unary(gw.watchers().remove(&entry.id, &req.watcher_id)?)),
            "WatchDir" | "CreateWatcher" => {
                let path = resolve(&req.path, home).map_err(RpcError::invalid)?;
                let recursive = req.recursive;
                let watch = gw
                    .app
                    .init(&sandbox.clone(), move |e| {
                        let rec = e.sandbox(&sandbox)?;
                        Ok(e.client(&rec)?.watch(&path, recursive))
                    })
                    .await?
                    .map_err(|e| match e {
                        cairn_sandbox::client::ClientError::Fs(f)
                            if f.kind == cairn_protocol::FsErrorKind::NotFound =>
                        {
                            RpcError::new("not_found", f.message)
                        }
                        e => RpcError::from(e),
                    })?;
                if method == "CreateWatcher" {
                    let id = gw.watchers().add(&entry.id, watch)?;
                    return Ok(Watched::Unary(json!({ "watcherId": id })));
                }
                let (tx, rx) = mpsc::channel::<Bytes>(64);
                tokio::task::spawn_blocking(move || watch::relay(watch, tx));
                let keepalive = frame(0, &json!({ "keepalive": {} }));
                return Ok(Watched::Stream(stream_response(stream_body_with(
                    &gw,
                    rx,
                    entry.grant.clone(),
                    keepalive,
                ))));
            }
            _ => {}
        }
        let op = match method.as_str() {
            "Stat" | "ListDir" | "MakeDir" | "Remove" | "Move" => method.clone(),
            other => {
                return Err(RpcError::new(
                    "unimplemented",
                    format!("no method filesystem.Filesystem/{other}"),
                ))
            }
        };
        let (path, to) = if op == "Move" {
            (
                resolve(&req.source, home).map_err(RpcError::invalid)?,
                Some(resolve(&req.destination, home).map_err(RpcError::invalid)?),
            )
        } else {
            (resolve(&req.path, home).map_err(RpcError::invalid)?, None)
        };
        let depth = req.depth.clamp(1, 64);
        // Directories made are the user's, as their own mkdir's would be.
        let owner = if op == "MakeDir" {
            gw.user_ids(&sandbox, &user_of(&headers)).await?
        } else {
            None
        };
        gw.app
            .init(&sandbox.clone(), move |e| {
                let rec = e.sandbox(&sandbox)?;
                let client = e.client(&rec)?;
                Ok(fs_op(&client, &op, &path, to.as_deref(), depth, owner))
            })
            .await?
            .map(Watched::Unary)
    }
    .await;
    match result {
        Ok(Watched::Unary(v)) => unary(v),
        Ok(Watched::Stream(r)) => r,
        Err(e) if method == "WatchDir" => stream_error(e),
        Err(e) => e.into_response(),
    }
}

/// What a filesystem method answers: one message, or a stream (`WatchDir`).
enum Watched {
    Unary(Value),
    Stream(Response),
}

fn missing(path: &str) -> RpcError {
    RpcError::new("not_found", format!("path '{path}' does not exist"))
}

/// A filesystem RPC; directories made are owned by `owner` when given.
fn fs_op(
    client: &cairn_sandbox::client::InitClient,
    op: &str,
    path: &str,
    to: Option<&str>,
    depth: u32,
    owner: Option<cairn_protocol::Ids>,
) -> Rpc<Value> {
    let stat = |p: &str| -> Rpc<cairn_protocol::FileMeta> { client.stat(p)?.ok_or_else(|| missing(p)) };
    let info = |meta: &cairn_protocol::FileMeta, target: Option<&str>| -> Rpc<Value> {
        let attrs = client.get_xattrs(vec![meta.path.clone()])?.pop().unwrap_or_default();
        Ok(entry_info(
            meta,
            target,
            &Names::for_entries(client, std::iter::once(meta)),
            &attrs,
        ))
    };
    match op {
        "Stat" => Ok(json!({ "entry": info(&stat(path)?, None)? })),
        "ListDir" => {
            if stat(path)?.kind != FileKind::Dir {
                return Err(RpcError::invalid(format!("path '{path}' is not a directory")));
            }
            let listing = client.list_dir(path, depth, MAX_LIST)?;
            let names = Names::for_entries(client, listing.entries.iter().map(|d| &d.meta));
            let mut attrs = Vec::with_capacity(listing.entries.len());
            for chunk in listing.entries.chunks(cairn_protocol::XATTR_PATHS_MAX) {
                attrs.extend(client.get_xattrs(chunk.iter().map(|d| d.meta.path.clone()).collect())?);
            }
            let entries: Vec<Value> = listing
                .entries
                .iter()
                .zip(&attrs)
                .map(|(d, a)| entry_info(&d.meta, d.symlink_target.as_deref(), &names, a))
                .collect();
            Ok(json!({ "entries": entries }))
        }
        "MakeDir" => {
            if !client.make_dir_as(path, true, owner)? {
                return Err(RpcError::new(
                    "already_exists",
                    format!("directory '{path}' already exists"),
                ));
            }
            Ok(json!({ "entry": info(&stat(path)?, None)? }))
        }
        "Move" => {
            let to = to.unwrap_or(path);
            stat(path)?;
            client.rename(path, to)?;
            Ok(json!({ "entry": info(&stat(to)?, None)? }))
        }
        "Remove" => {
            stat(path)?;
            client.remove(path, true)?;
            Ok(json!({}))
        }
        _ => Err(RpcError::new("internal", format!("no filesystem operation {op}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_short_ones_are_refused() {
        let f = frame(0, &json!({ "path": "/x" }));
        let back: PathRequest = envelope(&f).unwrap();
        assert_eq!(back.path, "/x");
        assert!(envelope::<PathRequest>(&f[..f.len() - 1]).is_err());
        assert!(envelope::<PathRequest>(&[0, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(envelope::<PathRequest>(&[1, 0, 0, 0, 0]).is_err());
        assert_eq!(end_of_stream(None)[0], 2);
    }

    #[test]
    fn a_killed_process_ends_with_minus_one() {
        let killed = cairn_protocol::ExitStatus {
            code: None,
            signal: Some(libc::SIGKILL),
            timed_out: false,
        };
        assert_eq!(end_event(&killed, false)["end"]["exitCode"], -1);
        let oom = end_event(&killed, true);
        assert_eq!(oom["end"]["status"], "signal: killed");
        assert!(oom["end"]["error"].as_str().unwrap().contains("OOM killer"));
        let three = cairn_protocol::ExitStatus {
            code: Some(3),
            signal: None,
            timed_out: false,
        };
        assert_eq!(end_event(&three, false)["end"]["error"], "exit status 3");
    }
}
