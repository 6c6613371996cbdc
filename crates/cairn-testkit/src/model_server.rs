//! A scripted model server on loopback for the agent loop's tests: it
//! answers Anthropic's Messages API (`POST /v1/messages`) and OpenAI's Chat
//! Completions (`POST /v1/chat/completions`) from a provider-neutral script,
//! in the exact shapes the official SDKs parse, and checks every request the
//! way the real APIs would (and a little more), recording what it finds.
//!
//! The script (JSON) is a list of turns; the reply to a request is the turn
//! whose index is the number of assistant messages the request carries, so
//! a client killed and restarted that asks again gets the same reply, with
//! the same ids:
//!
//! ```json
//! {"turns": [
//!   {"text": "I will plan first.", "tool_calls": [{"name": "plan_stage", "arguments": {"reason": "r"}}]},
//!   {"tool_calls": [{"name": "run_stage", "arguments": {"snapshot_id": "{{results[-1].snapshots[0].id}}"}}],
//!    "fail": [{"status": 429, "retry_after": 1}, {"status": 503}, {"delay_ms": 3000}]},
//!   {"tool_calls": [{"name": "run_stage", "raw_arguments": "{not json"}]},
//!   {"text": "Done.", "stop": "end_turn", "usage": {"input": 120, "output": 30}}
//! ]}
//! ```
//!
//! - `fail` is consumed in order, one entry per request for that turn, before
//!   the reply is served: `{"status": S, "retry_after": secs?}` answers S
//!   with the provider's error body (and a `retry-after` header);
//!   `{"delay_ms": N}` sleeps N ms, then answers the reply (a client that
//!   timed out and retried meanwhile gets the next entry). What has been
//!   consumed is kept for the server's life.
//! - `stop` defaults to `tool_use`/`tool_calls` when there are tool calls,
//!   else `end_turn`/`stop`; `end_turn`↔`stop`, `tool_use`↔`tool_calls`,
//!   `max_tokens`↔`length`. `usage` defaults to a token per four bytes of
//!   the request and of the reply.
//! - Ids: `msg_t{turn}` and `toolu_t{turn}_{k}` (Anthropic),
//!   `chatcmpl-t{turn}` and `call_t{turn}_{k}` (OpenAI).
//! - `{{results[i].a.b[0]}}` in an argument string is filled from the i-th
//!   tool result of the conversation (negative from the end), parsed as
//!   JSON when it is JSON; a string that is exactly one placeholder becomes
//!   the value itself. One that cannot be filled is a 400 and a violation.
//! - `raw_arguments` is sent verbatim as OpenAI's `arguments` string; an
//!   Anthropic `tool_use` input must be an object, so there it is sent as
//!   `input: {"_raw": "<text>"}`.
//!
//! A request that breaks the protocol (see `validate`) is a violation,
//! recorded, and answered 400 in the provider's error shape. Bodies over
//! [`BODY_MAX`] are answered 413. `GET /_requests` returns
//! `{"requests": [...], "violations": [...]}`.

mod placeholders;
mod render;
mod script;
mod validate;

pub use script::{Script, ScriptError};

use axum::body::{to_bytes, Body};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use render::{Call, Provider, Reply};
use script::{Arguments, Failure};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use tokio::sync::oneshot;

/// The largest request body read; a larger one is answered 413.
pub const BODY_MAX: usize = 8 << 20;
/// Requests kept, the newest; older ones are dropped.
pub const RECORDED_MAX: usize = 10_000;
/// Request bytes kept, at most; the oldest requests go first.
pub const RECORDED_BYTES_MAX: usize = 256 << 20;
/// Violations kept, the first ones (the first is usually the cause).
pub const VIOLATIONS_MAX: usize = 10_000;

/// One request the server received, and how it was answered.
#[derive(Debug, Clone, Serialize)]
pub struct Recorded {
    /// "anthropic" or "openai": which endpoint was called.
    pub provider: &'static str,
    /// The turn the request asked for (its number of assistant messages).
    pub turn: usize,
    /// The request body (null when it was too large or not JSON).
    pub body: Value,
    /// The status it was answered with; 0 while it is being answered (a
    /// scripted delay), and for good when the client left before the answer.
    pub answered: u16,
}

/// A scripted model serving on its own thread, with its own tokio runtime,
/// until dropped.
pub struct ScriptedModel {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    script: Script,
    state: Mutex<Log>,
}

#[derive(Default)]
struct Log {
    received: u64,
    /// Per turn, how many of its `fail` entries were served.
    consumed: Vec<usize>,
    /// Each with its request number and body size.
    recorded: VecDeque<(u64, Recorded, usize)>,
    recorded_bytes: usize,
    violations: Vec<String>,
}

impl ScriptedModel {
    /// Serves `script` on an ephemeral loopback port. Panics, saying why,
    /// when the script is malformed or the port cannot be had.
    pub fn start(script: Value) -> ScriptedModel {
        let script = Script::from_json(script).unwrap_or_else(|e| panic!("ScriptedModel::start: bad script: {e}"));
        let any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        ScriptedModel::bind(script, any_port).unwrap_or_else(|e| panic!("ScriptedModel::start: cannot serve: {e}"))
    }

    /// Serves `script` on `listen`.
    pub fn bind(script: Script, listen: SocketAddr) -> std::io::Result<ScriptedModel> {
        let consumed = vec![0; script.turns.len()];
        let shared = Arc::new(Shared {
            script,
            state: Mutex::new(Log {
                consumed,
                ..Log::default()
            }),
        });
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = {
            let _in_runtime = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let app = Router::new()
            .route("/v1/messages", post(anthropic))
            .route("/v1/chat/completions", post(openai))
            .route("/_requests", get(recorded))
            .with_state(shared.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("scripted-model".into())
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::select! {
                        served = axum::serve(listener, app) => {
                            if let Err(e) = served {
                                eprintln!("scripted model on {addr}: serving stopped: {e}");
                            }
                        }
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime here cancels the connections still open.
            })?;
        Ok(ScriptedModel {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`: Anthropic's base URL; OpenAI's is this
    /// followed by `/v1`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received (the newest [`RECORDED_MAX`]), in the order
    /// they arrived.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.log().recorded.iter().map(|(_, r, _)| r.clone()).collect()
    }

    /// The protocol violations found in requests; a test asserts none.
    pub fn violations(&self) -> Vec<String> {
        self.shared.log().violations.clone()
    }
}

impl Drop for ScriptedModel {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Shared {
    fn log(&self) -> MutexGuard<'_, Log> {
        // A panic while holding the lock leaves the log consistent (every
        // change is one push), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next scripted failure of `turn`, consumed.
    fn next_failure(&self, turn: usize) -> Option<(usize, Failure)> {
        let fail = &self.script.turns[turn].fail;
        let mut log = self.log();
        let k = log.consumed[turn];
        let failure = *fail.get(k)?;
        log.consumed[turn] = k + 1;
        Some((k, failure))
    }
}

impl Log {
    fn record(&mut self, number: u64, recorded: Recorded, bytes: usize) {
        self.recorded_bytes += bytes;
        self.recorded.push_back((number, recorded, bytes));
        while self.recorded.len() > RECORDED_MAX || self.recorded_bytes > RECORDED_BYTES_MAX {
            let Some((_, _, dropped)) = self.recorded.pop_front() else {
                break;
            };
            self.recorded_bytes -= dropped;
        }
    }

    fn violation(&mut self, violation: String) {
        if self.violations.len() < VIOLATIONS_MAX {
            self.violations.push(violation);
        }
    }
}

async fn anthropic(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    answer(&shared, Provider::Anthropic, &headers, body).await
}

async fn openai(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    answer(&shared, Provider::OpenAi, &headers, body).await
}

async fn recorded(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let log = shared.log();
    let requests: Vec<&Recorded> = log.recorded.iter().map(|(_, r, _)| r).collect();
    Json(json!({"requests": requests, "violations": log.violations}))
}

/// One request, from its bytes to its answer, recorded.
struct Exchange<'a> {
    shared: &'a Shared,
    provider: Provider,
    number: u64,
    turn: usize,
    body: Value,
    bytes: usize,
    /// Recorded already (answered 0), to be updated with its status.
    recorded: bool,
}

impl Exchange<'_> {
    fn recorded(&self, answered: u16) -> Recorded {
        Recorded {
            provider: self.provider.name(),
            turn: self.turn,
            body: self.body.clone(),
            answered,
        }
    }

    /// Records the request before a scripted delay, so a client that leaves
    /// meanwhile still finds it (answered 0).
    fn received(&mut self) {
        self.shared.log().record(self.number, self.recorded(0), self.bytes);
        self.recorded = true;
    }

    fn finish(self, status: u16, answer: &Value, retry_after: Option<u64>) -> Response {
        {
            let mut log = self.shared.log();
            let earlier = log.recorded.iter_mut().rev().find(|(n, _, _)| *n == self.number);
            match earlier {
                Some((_, recorded, _)) if self.recorded => recorded.answered = status,
                // Dropped meanwhile, as the oldest of too many.
                None if self.recorded => {}
                _ => log.record(self.number, self.recorded(status), self.bytes),
            }
        }
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (code, Json(answer)).into_response();
        if let Some(secs) = retry_after {
            response.headers_mut().insert("retry-after", HeaderValue::from(secs));
        }
        response
    }

    /// A protocol violation: recorded, and answered `status`.
    fn refuse(self, status: u16, problems: &[String]) -> Response {
        {
            let mut log = self.shared.log();
            for problem in problems {
                let who = self.provider.name();
                log.violation(format!("{who} request {} (turn {}): {problem}", self.number, self.turn));
            }
        }
        let answer = self.provider.error(status, &problems.join("; "));
        self.finish(status, &answer, None)
    }
}

async fn answer(shared: &Shared, provider: Provider, headers: &HeaderMap, body: Body) -> Response {
    let number = {
        let mut log = shared.log();
        log.received += 1;
        log.received
    };
    let mut exchange = Exchange {
        shared,
        provider,
        number,
        turn: 0,
        body: Value::Null,
        bytes: 0,
        recorded: false,
    };
    let Ok(bytes) = to_bytes(body, BODY_MAX).await else {
        return exchange.refuse(
            413,
            &[format!(
                "the body is over {BODY_MAX} bytes: send a shorter conversation"
            )],
        );
    };
    exchange.bytes = bytes.len();
    exchange.body = match serde_json::from_slice(&bytes) {
        Ok(body) => body,
        Err(e) => return exchange.refuse(400, &[format!("the body is not JSON: {e}")]),
    };
    let empty = Vec::new();
    let messages = exchange.body["messages"].as_array().unwrap_or(&empty).clone();
    exchange.turn = messages.iter().filter(|m| m["role"] == "assistant").count();
    let problems = match provider {
        Provider::Anthropic => validate::anthropic(headers, &exchange.body),
        Provider::OpenAi => validate::openai(headers, &exchange.body),
    };
    if !problems.is_empty() {
        return exchange.refuse(400, &problems);
    }
    let turns = shared.script.turns.len();
    let turn = exchange.turn;
    let Some(scripted) = shared.script.turns.get(turn) else {
        return exchange.refuse(400, &[format!(
            "the script has no turn {turn}: the request carries {turn} assistant messages and the script has {turns} turns (0..={})",
            turns - 1
        )]);
    };
    match shared.next_failure(turn) {
        Some((k, Failure::Status { status, retry_after })) => {
            let message = format!(
                "scripted failure {} of {} for turn {turn}: status {status}",
                k + 1,
                scripted.fail.len()
            );
            let answer = provider.error(status, &message);
            return exchange.finish(status, &answer, retry_after);
        }
        Some((_, Failure::Delay { ms })) => {
            exchange.received();
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await
        }
        None => {}
    }
    let results = match provider {
        Provider::Anthropic => placeholders::anthropic_results(&messages),
        Provider::OpenAi => placeholders::openai_results(&messages),
    };
    let mut calls = Vec::with_capacity(scripted.tool_calls.len());
    for call in &scripted.tool_calls {
        let name = call.name.clone();
        calls.push(match &call.arguments {
            Arguments::Json(arguments) => match placeholders::fill(arguments, &results) {
                Ok(arguments) => Call::Json { name, arguments },
                Err(e) => return exchange.refuse(400, &[format!("tool call {name:?}: {e}")]),
            },
            Arguments::Raw(text) => Call::Raw {
                name,
                text: text.clone(),
            },
        });
    }
    let model = exchange.body["model"].as_str().unwrap_or_default().to_owned();
    let reply = Reply {
        turn,
        model: &model,
        text: scripted.text.as_deref(),
        calls,
        stop: scripted.stop,
        usage: scripted.usage,
        request_bytes: exchange.bytes,
    };
    let answer = provider.reply(&reply);
    exchange.finish(200, &answer, None)
}

#[cfg(test)]
mod tests;
