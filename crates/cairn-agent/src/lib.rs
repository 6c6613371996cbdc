//! The built-in agent loop (`cairn agent run`): a model plans a goal once
//! per stage boundary through Cairn's tools (`cairn-tools`), and the
//! durable engine does the work.
//!
//! Each round asks the model once, with the goal, the conversation so far
//! and a compact lineage of the stages it ran; the tool calls of its reply
//! run through the tools (stages in parallel, each awaited to its end);
//! their results go back in the next round. The loop ends when the model
//! replies without a tool call (its summary is the answer), at the stage
//! limit, or at the budget.
//!
//! An agent is a session: its context log records the configuration, every
//! reply (with tokens and cost) and every result (see `record`), and the
//! session's sandbox is the model's scratch machine. A reply is recorded
//! before any of its calls runs, and a stage a call starts is a run whose
//! id derives from the agent and the call, so `cairn agent resume` after a
//! kill -9 neither asks the model again for a reply it recorded nor starts
//! a stage twice: it re-attaches to the stage's run.

pub mod record;

use std::fs::File;
use std::time::Duration;

use cairn_engine::{Engine, EngineError, Home};
use cairn_llm::{LlmError, ModelConfig, Reply, Stop, ToolCall, ToolDef};
use cairn_session::prelude::*;
use cairn_session::{EntryKind, LogRange, SessionOptions, SessionRecord};
use cairn_tools::{ToolError, ToolProgress, Tools};
use nix::fcntl::{Flock, FlockArg};
use serde_json::{json, Value};

use cairn_pipeline::prelude::*;
use record::{entry, event, Recorded, ResultMeta, AGENT_ROLE, MODEL_ROLE};
pub use record::{AgentConfig, AgentState, Event, PipelineStart, Status};

/// The most of a tool result the model is given.
const RESULT_MAX: usize = 32 << 10;
/// How long one wait on a running stage lasts before it reports again.
const STAGE_POLL_SECS: u64 = 30;
/// Rounds the model still gets once the stage limit is reached, to select,
/// inspect and summarise; stage calls in them are refused.
const WRAP_UP_ROUNDS: u32 = 2;
/// The most stages the lineage note lists.
const LINEAGE_STAGES: usize = 24;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Model(#[from] LlmError),
    #[error("no agent matches {0:?}; `cairn agent ls` lists them")]
    NotFound(String),
    #[error("session {0} is not an agent's; `cairn agent ls` lists the agents")]
    NotAnAgent(String),
    #[error("agent {0}'s log cannot be read: {1}")]
    Damaged(String, String),
    #[error("agent {0} is running in another process; wait for it, or stop that process first")]
    Busy(String),
    #[error("agent {0} is completed; start a new one with `cairn agent run`")]
    Completed(String),
    #[error("{0}")]
    Invalid(String),
}

/// What a loop reports as it goes (the CLI prints it).
pub trait Watch: Sync {
    fn say(&self, line: &str);
}

impl Watch for () {
    fn say(&self, _: &str) {}
}

/// Where a new agent starts.
pub enum Start {
    /// A snapshot of a fresh sandbox of this image (`None`: the default).
    Image(Option<String>),
    Snapshot(String),
    /// A pipeline file run to its end first; its stages' outputs are the
    /// handles the model plans against.
    Pipeline(PipelineStart),
}

/// A new agent's parameters.
pub struct NewAgent {
    pub goal: String,
    pub model: ModelConfig,
    pub max_stages: u32,
    pub budget_usd: Option<f64>,
    pub price: Option<cairn_llm::Price>,
    pub start: Start,
}

/// How a loop ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub agent: String,
    pub session: String,
    pub status: Status,
    pub detail: String,
    pub stages: u32,
    pub model_calls: u32,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_usd: Option<f64>,
}

/// Records a new agent (a session holding its configuration), ready for
/// [`drive`]. Checks what can be checked before anything is made.
pub fn create(engine: &mut Engine, new: NewAgent) -> Result<SessionRecord, AgentError> {
    if new.goal.trim().is_empty() || new.goal.len() > 64 << 10 {
        return Err(AgentError::Invalid(
            "the goal is empty or larger than 64 KiB; say what to achieve with --goal".into(),
        ));
    }
    new.model.check()?;
    if new.max_stages == 0 || new.max_stages > 10_000 {
        return Err(AgentError::Invalid("--max-stages must be between 1 and 10000".into()));
    }
    if let Some(b) = new.budget_usd {
        if !(b.is_finite() && b > 0.0) {
            return Err(AgentError::Invalid(
                "--budget-usd must be a positive number of dollars".into(),
            ));
        }
        if new.price.is_none() {
            return Err(AgentError::Invalid(format!(
                "the price of {} is not known, so a budget cannot be kept: give --price-in and --price-out \
                 (dollars per million tokens; 0 for a local model)",
                new.model.model
            )));
        }
    }
    let (image, snapshot, pipeline) = match new.start {
        Start::Image(i) => (i, None, None),
        Start::Snapshot(s) => (None, Some(engine.snapshot_record(&s)?), None),
        Start::Pipeline(p) => {
            // Checked now, so that a bad file is refused before anything starts.
            cairn_pipeline::parse(&p.file, &p.text, &Default::default())
                .map_err(|e| AgentError::Invalid(e.to_string()))?;
            (None, None, Some(p))
        }
    };
    let name = format!(
        "agent-{}",
        &blake3::hash(format!("{:?}{}", std::time::SystemTime::now(), std::process::id()).as_bytes()).to_hex()[..10]
    );
    let opts = SessionOptions {
        name: Some(name),
        image,
        driver: None,
        idle_timeout_ms: None,
        network: None,
    };
    let session = match &snapshot {
        Some(snap) => engine.create_session_from(&opts, snap, "the agent's starting point")?,
        None => engine.create_session(&opts, &cairn_engine::Silent)?,
    };
    let config = AgentConfig {
        version: record::CONFIG_VERSION,
        goal: new.goal,
        model: new.model,
        max_stages: new.max_stages,
        budget_usd: new.budget_usd,
        price: new.price,
        pipeline,
        snapshot: snapshot.map(|s| s.id),
    };
    let mut first = entry(EntryKind::System, AGENT_ROLE);
    first.content = Some(system_prompt(&config, &session.name));
    first.arguments = Some(serde_json::to_string(&config).expect("serialisable"));
    if let Err(e) = engine.session_append(&session, first) {
        let _ = engine.close_session(&session.id, true);
        return Err(e.into());
    }
    Ok(engine.session(&session.id)?)
}

/// The agents (sessions whose log is an agent's), newest first.
pub fn list(engine: &Engine) -> Result<Vec<(SessionRecord, AgentState)>, AgentError> {
    let mut out = Vec::new();
    for s in engine.sessions()? {
        if !s.name.starts_with("agent-") {
            continue;
        }
        if let Ok(Some(st)) = read(engine, &s) {
            out.push((s, st));
        }
    }
    out.sort_by_key(|(s, _)| std::cmp::Reverse(s.created_at));
    Ok(out)
}

/// An agent by session name, id or id prefix, and its state.
pub fn find(engine: &Engine, key: &str) -> Result<(SessionRecord, AgentState), AgentError> {
    let s = match engine.session(key) {
        Ok(s) => s,
        Err(e) if matches!(e.domain(), Some(cairn_session::SessionError::NotFound(_))) => {
            return Err(AgentError::NotFound(key.to_string()))
        }
        Err(e) => return Err(e.into()),
    };
    let st = read(engine, &s)?.ok_or_else(|| AgentError::NotAnAgent(s.name.clone()))?;
    Ok((s, st))
}

fn read(engine: &Engine, s: &SessionRecord) -> Result<Option<AgentState>, AgentError> {
    let entries = engine.session_log(
        s,
        LogRange::From {
            from: 1,
            count: usize::MAX,
        },
    )?;
    AgentState::from_log(&entries).map_err(|e| AgentError::Damaged(s.name.clone(), e))
}

/// Raises an agent's limits before a resume (recorded in its log).
pub fn raise_limits(
    engine: &mut Engine,
    key: &str,
    max_stages: Option<u32>,
    budget_usd: Option<f64>,
) -> Result<(), AgentError> {
    let (s, st) = find(engine, key)?;
    if max_stages.is_none() && budget_usd.is_none() {
        return Ok(());
    }
    if let Some(b) = budget_usd {
        if !(b.is_finite() && b > 0.0) {
            return Err(AgentError::Invalid(
                "--budget-usd must be a positive number of dollars".into(),
            ));
        }
        if st.config.price.is_none() {
            return Err(AgentError::Invalid(
                "this agent's model has no known price, so it cannot keep a budget".into(),
            ));
        }
    }
    let ev = Event::Limits {
        max_stages: max_stages.unwrap_or(st.max_stages),
        budget_usd: budget_usd.or(st.budget_usd),
    };
    engine.session_append(&s, event(&ev))?;
    Ok(())
}

/// Runs (or resumes) agent `key`'s loop until it completes, pauses or
/// stops. One process drives an agent at a time.
pub fn drive(home: &Home, key: &str, watch: &dyn Watch) -> Result<Outcome, AgentError> {
    let mut engine = Engine::open(home.clone())?;
    let (session, st) = find(&engine, key)?;
    if st.status == Status::Completed {
        return Err(AgentError::Completed(session.name.clone()));
    }
    let _lock = lock(home, &session.id)?;
    let mut agent = Loop {
        tools: Tools::new(home.clone()),
        caller: format!(
            "agent {} ({}/{})",
            session.name, st.config.model.provider, st.config.model.model
        ),
        session,
        watch,
    };
    let out = agent.run(&mut engine);
    // The scratch sandbox does not outlive the loop; the next use resumes it.
    if let Err(e) = engine.suspend_session(&agent.session.id) {
        tracing::debug!("the agent's session was not suspended: {e}");
    }
    out
}

fn lock_path(home: &Home, id: &str) -> std::path::PathBuf {
    home.root().join("agents").join(format!("{id}.lock"))
}

/// The pid of the process driving agent session `id` now, if one does. An
/// agent recorded as running that no process drives was interrupted:
/// `cairn agent resume` continues it.
pub fn driven_by(home: &Home, id: &str) -> Option<u32> {
    cairn_engine::flock_holder(&lock_path(home, id))
}

/// The status to show: `interrupted` for a running agent no process drives.
pub fn shown_status(home: &Home, session: &SessionRecord, st: &AgentState) -> &'static str {
    match st.status {
        Status::Running if driven_by(home, &session.id).is_none() => "interrupted",
        other => other.as_str(),
    }
}

fn lock(home: &Home, id: &str) -> Result<Flock<File>, AgentError> {
    let path = lock_path(home, id);
    let dir = path.parent().expect("agents/").to_path_buf();
    let io = |e: std::io::Error| AgentError::Invalid(format!("cannot lock {}: {e}", path.display()));
    std::fs::create_dir_all(&dir).map_err(io)?;
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io)?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|_| AgentError::Busy(id.to_string()))
}

struct Loop<'w> {
    tools: Tools,
    caller: String,
    session: SessionRecord,
    watch: &'w dyn Watch,
}

impl Loop<'_> {
    fn state(&self, engine: &Engine) -> Result<AgentState, AgentError> {
        let s = engine.session(&self.session.id)?;
        read(engine, &s)?.ok_or_else(|| AgentError::NotAnAgent(s.name.clone()))
    }

    fn append(&self, engine: &Engine, e: cairn_session::Entry) -> Result<(), AgentError> {
        let s = engine.session(&self.session.id)?;
        engine.session_append(&s, e)?;
        Ok(())
    }

    fn set_status(&self, engine: &Engine, status: Status, detail: &str) -> Result<(), AgentError> {
        self.append(
            engine,
            event(&Event::Status {
                status,
                detail: detail.to_string(),
            }),
        )
    }

    fn outcome(&self, engine: &Engine) -> Result<Outcome, AgentError> {
        let st = self.state(engine)?;
        Ok(Outcome {
            agent: self.session.name.clone(),
            session: self.session.id.clone(),
            status: st.status,
            detail: st.detail.clone(),
            stages: st.stages_used(),
            model_calls: st.model_calls,
            input_tokens: st.usage.input_tokens,
            output_tokens: st.usage.output_tokens,
            cost_usd: st.cost_usd,
        })
    }

    fn run(&mut self, engine: &mut Engine) -> Result<Outcome, AgentError> {
        let st = self.state(engine)?;
        if st.status != Status::Running {
            self.set_status(engine, Status::Running, "resumed")?;
        }
        self.prepare(engine)?;
        loop {
            let st = self.state(engine)?;
            let cost = st.cost_usd.unwrap_or(0.0);
            let over_budget = st.budget_usd.is_some_and(|b| cost >= b);
            if let Some(round) = st.rounds.last() {
                let pending = round.pending();
                if !pending.is_empty() {
                    if over_budget {
                        return self.stop(engine, &st, "budget");
                    }
                    self.execute(engine, &st, round, &pending)?;
                    let st = self.state(engine)?;
                    let note = lineage(&self.tools, &st, &self.caller);
                    self.append(engine, event(&Event::Lineage { text: note }))?;
                    continue;
                }
                if round.recorded.reply.calls.is_empty() {
                    return self.finish(engine, &round.recorded.reply);
                }
            }
            if over_budget {
                return self.stop(engine, &st, "budget");
            }
            if st.stages_used() >= st.max_stages && st.rounds_at_limit() >= WRAP_UP_ROUNDS {
                return self.stop(engine, &st, "stage limit");
            }
            let conv = st.conversation();
            let tools = tool_defs();
            self.watch.say(&format!(
                "asking {} (round {})",
                st.config.model.model,
                st.model_calls + 1
            ));
            let reply = cairn_llm::complete_with(&st.config.model, &conv, &tools, &mut |r| {
                self.watch.say(&format!(
                    "the model is unavailable (attempt {}: {}); retrying in {:.1}s",
                    r.attempt,
                    r.error,
                    r.wait.as_secs_f64()
                ))
            });
            let reply = match reply {
                Ok(r) => r,
                Err(LlmError::Unavailable { attempts, last }) => {
                    let detail = format!(
                        "the model was unavailable after {attempts} attempts ({last}); `cairn agent resume {}` continues",
                        self.session.name
                    );
                    self.set_status(engine, Status::Paused, &detail)?;
                    return self.outcome(engine);
                }
                Err(e) => {
                    self.set_status(engine, Status::Failed, &e.to_string())?;
                    return self.outcome(engine);
                }
            };
            self.record_reply(engine, &st, reply)?;
        }
    }

    /// Runs the starting pipeline, or snapshots the scratch sandbox, once:
    /// the base the model plans against.
    fn prepare(&self, engine: &mut Engine) -> Result<(), AgentError> {
        let st = self.state(engine)?;
        if st.first_message.is_some() {
            return Ok(());
        }
        let mut base = Vec::new();
        let mut described = Vec::new();
        if let Some(p) = &st.config.pipeline {
            let run = match &st.pipeline_run {
                Some(r) => engine.run_record(r)?,
                None => {
                    let run = engine.start_run_text(&p.file, p.text.clone(), &Default::default())?;
                    self.append(engine, event(&Event::Pipeline { run: run.id.clone() }))?;
                    run
                }
            };
            self.watch
                .say(&format!("running pipeline {} (run {})", run.pipeline, run.id));
            let done = match run.status.as_str() {
                "running" => engine.execute_run(&run.id, &cairn_pipeline::run::Quiet)?,
                _ => run,
            };
            if done.status != "completed" {
                let detail = format!(
                    "the starting pipeline's run {} {}: {}; `cairn pipeline show {}` shows why",
                    done.id,
                    done.status,
                    done.error.clone().unwrap_or_default(),
                    done.id
                );
                self.set_status(engine, Status::Failed, &detail)?;
                return Err(AgentError::Invalid(detail));
            }
            for s in engine.run_stages(&done.id)? {
                if let Some(out) = &s.output_snapshot {
                    let name = if s.branch.is_empty() {
                        s.stage.clone()
                    } else {
                        format!("{}.{}", s.stage, s.branch)
                    };
                    described.push(format!("- stage {name} of run {}: output snapshot {out}", done.id));
                    base.push(out.clone());
                }
            }
        } else if let Some(snap) = &st.config.snapshot {
            described.push(format!("- snapshot {snap} (the one given)"));
            base.push(snap.clone());
        } else {
            let snap = engine.snapshot_session(&self.session.id, Some("agent-base"), "the agent's starting point")?;
            described.push(format!("- snapshot {} (a fresh {} machine)", snap.id, snap.image));
            base.push(snap.id);
        }
        self.append(engine, event(&Event::Base { snapshots: base }))?;
        let mut first = entry(EntryKind::User, AGENT_ROLE);
        first.content = Some(format!(
            "Goal: {}\n\nSnapshots to plan against:\n{}\n\nLimits: at most {} stages{}.",
            st.config.goal,
            described.join("\n"),
            st.max_stages,
            st.budget_usd
                .map(|b| format!(", a budget of ${b:.2} for model calls"))
                .unwrap_or_default()
        ));
        self.append(engine, first)
    }

    fn record_reply(&self, engine: &Engine, st: &AgentState, reply: Reply) -> Result<(), AgentError> {
        let cost = st.config.price.map(|p| p.cost(&reply.usage));
        let mut e = entry(EntryKind::Assistant, MODEL_ROLE);
        e.content = Some(reply.text.clone());
        e.tokens_in = Some(reply.usage.input_tokens);
        e.tokens_out = Some(reply.usage.output_tokens);
        if !reply.text.is_empty() {
            self.watch
                .say(&format!("model: {}", cairn_llm::clip(reply.text.trim(), 400)));
        }
        for c in &reply.calls {
            let reason = c.arguments.get("reason").and_then(Value::as_str).unwrap_or("");
            self.watch
                .say(&format!("  → {} {}", c.name, cairn_llm::clip(reason, 200)));
        }
        e.arguments = Some(serde_json::to_string(&Recorded { reply, cost_usd: cost }).expect("serialisable"));
        self.append(engine, e)
    }

    fn finish(&self, engine: &Engine, reply: &Reply) -> Result<Outcome, AgentError> {
        let (status, detail) = match reply.stop {
            Stop::Refusal => (Status::Stopped, format!("the model declined: {}", reply.text)),
            Stop::MaxTokens => (
                Status::Stopped,
                "the model's reply was cut at max_tokens; resume with a larger --max-tokens".to_string(),
            ),
            _ => (Status::Completed, reply.text.clone()),
        };
        let st = self.state(engine)?;
        if st.status != status {
            self.set_status(engine, status, &detail)?;
        }
        self.outcome(engine)
    }

    fn stop(&self, engine: &Engine, st: &AgentState, why: &str) -> Result<Outcome, AgentError> {
        let detail = match why {
            "budget" => format!(
                "the budget of ${:.4} is spent (${:.4}); `cairn agent resume {} --budget-usd X` continues",
                st.budget_usd.unwrap_or(0.0),
                st.cost_usd.unwrap_or(0.0),
                self.session.name
            ),
            _ => format!(
                "the stage limit ({}) is reached; `cairn agent resume {} --max-stages N` continues",
                st.max_stages, self.session.name
            ),
        };
        self.set_status(engine, Status::Stopped, &detail)?;
        self.outcome(engine)
    }

    /// Runs a reply's calls that have no result yet: every stage first (in
    /// parallel), then each call's result in the reply's order, each
    /// recorded as it is known.
    fn execute(
        &self,
        engine: &Engine,
        st: &AgentState,
        round: &record::Round,
        pending: &[ToolCall],
    ) -> Result<(), AgentError> {
        let mut used = st.stages_used();
        let mut started: Vec<(String, Result<String, String>)> = Vec::new();
        for call in pending.iter().filter(|c| Tools::starts_stage(&c.name)) {
            let run_id = stage_run_id(&self.session.id, round.seq, &call.id);
            let exists = engine.run_record(&run_id).is_ok();
            let outcome = if !exists && used >= st.max_stages {
                Err(format!(
                    "not started: the stage limit ({}) is reached; select among what ran, summarise and end your turn",
                    st.max_stages
                ))
            } else {
                match arguments(call) {
                    Err(e) => Err(e),
                    Ok(args) => match self.tools.start_stage(&call.name, args, &self.caller, &run_id) {
                        Ok(handle) => {
                            used += 1;
                            self.watch.say(&format!("stage {handle} started ({})", call.name));
                            Ok(handle)
                        }
                        Err(e) => Err(describe(&e)),
                    },
                }
            };
            started.push((call.id.clone(), outcome));
        }
        for call in pending {
            let (content, is_error, stage_run) = match started.iter().find(|(id, _)| *id == call.id) {
                Some((_, Ok(handle))) => {
                    let state = self.await_stage(handle)?;
                    (state.to_string(), false, Some(handle.clone()))
                }
                Some((_, Err(e))) => (json!({"error": e}).to_string(), true, None),
                None => match arguments(call).and_then(|a| {
                    self.tools
                        .call(&call.name, a, &self.caller, &())
                        .map_err(|e| describe(&e))
                }) {
                    Ok(v) => (v.to_string(), false, None),
                    Err(e) => (json!({"error": e}).to_string(), true, None),
                },
            };
            if is_error {
                self.watch
                    .say(&format!("  {} failed: {}", call.name, cairn_llm::clip(&content, 300)));
            }
            let mut e = entry(EntryKind::ToolResult, AGENT_ROLE);
            e.tool = Some(call.name.clone());
            e.arguments = Some(
                serde_json::to_string(&ResultMeta {
                    call_id: call.id.clone(),
                    stage_run,
                })
                .expect("serialisable"),
            );
            e.result = Some(cairn_llm::clip(&content, RESULT_MAX));
            e.exit_status = Some(is_error as i32);
            self.append(engine, e)?;
        }
        Ok(())
    }

    /// Waits for a stage to end; returns its state.
    fn await_stage(&self, handle: &str) -> Result<Value, AgentError> {
        struct Say<'a>(&'a dyn Watch, std::sync::Mutex<std::time::Instant>);
        impl ToolProgress for Say<'_> {
            fn progress(&self, _: f64, _: Option<f64>, message: &str) {
                let mut last = self.1.lock().unwrap_or_else(|e| e.into_inner());
                if last.elapsed() >= Duration::from_secs(10) {
                    *last = std::time::Instant::now();
                    self.0.say(message);
                }
            }
        }
        let say = Say(self.watch, std::sync::Mutex::new(std::time::Instant::now()));
        loop {
            let args = json!({"handle": handle, "wait_secs": STAGE_POLL_SECS});
            let state = match self.tools.call("stage_status", args, &self.caller, &say) {
                Ok(v) => v,
                Err(e) => return Ok(json!({"handle": handle, "status": "failed", "error": describe(&e)})),
            };
            if state["status"] != "running" {
                self.watch.say(&format!(
                    "stage {handle} {}{}",
                    state["status"].as_str().unwrap_or("?"),
                    state["output_snapshot"]
                        .as_str()
                        .map(|s| format!(" → snapshot {s}"))
                        .unwrap_or_default()
                ));
                return Ok(state);
            }
        }
    }
}

/// A call's arguments, or the error the model is told when they are not JSON.
fn arguments(call: &ToolCall) -> Result<Value, String> {
    match &call.raw {
        Some(raw) => Err(format!(
            "the arguments of {} are not JSON ({}); call it again with a JSON object matching its input schema",
            call.name,
            cairn_llm::clip(raw, 200)
        )),
        None => Ok(call.arguments.clone()),
    }
}

/// A tool error as the model reads it: what was wrong and what to do.
fn describe(e: &ToolError) -> String {
    match e {
        ToolError::InvalidArguments { .. } => {
            format!("{e}; call it again with arguments matching the tool's input schema")
        }
        other => other.to_string(),
    }
}

/// The run id a stage call starts: the same for the same agent, reply and
/// call, whichever process starts it.
fn stage_run_id(session: &str, reply_seq: u64, call: &str) -> String {
    blake3::hash(format!("cairn-agent-stage\0{session}\0{reply_seq}\0{call}").as_bytes()).to_hex()[..12].to_string()
}

fn tool_defs() -> Vec<ToolDef> {
    cairn_tools::tools()
        .into_iter()
        .map(|t| ToolDef {
            name: t.name.to_string(),
            description: t.description.to_string(),
            input_schema: t.input,
        })
        .collect()
}

/// The compact lineage sent after each round: every stage this agent ran,
/// its hypothesis, outcome and snapshots, winners and losers, and what is
/// left of the limits.
fn lineage(tools: &Tools, st: &AgentState, caller: &str) -> String {
    let handles: Vec<&str> = st
        .rounds
        .iter()
        .flat_map(|r| &r.results)
        .filter_map(|(_, m, _)| m.stage_run.as_deref())
        .collect();
    let mut lines = Vec::new();
    let skipped = handles.len().saturating_sub(LINEAGE_STAGES);
    if skipped > 0 {
        lines.push(format!("({skipped} earlier stages not listed)"));
    }
    for h in &handles[skipped..] {
        let args = json!({"handle": h, "wait_secs": 0});
        let Ok(s) = tools.call("stage_status", args, caller, &()) else {
            continue;
        };
        let mut line = format!(
            "- {} {} {}: {} → {}",
            s["stage"].as_str().unwrap_or("stage"),
            h,
            s["hypothesis"].as_str().map(|h| format!("[{h}]")).unwrap_or_default(),
            s["input_snapshot"].as_str().unwrap_or("?"),
            s["output_snapshot"].as_str().unwrap_or("-"),
        );
        line.push_str(&format!(" {}", s["status"].as_str().unwrap_or("?")));
        if s["cached"] == true {
            line.push_str(" (cached)");
        }
        lines.push(line);
    }
    let spent = match (st.cost_usd, st.budget_usd) {
        (Some(c), Some(b)) => format!("; ${c:.4} of ${b:.2} spent"),
        (Some(c), None) => format!("; ${c:.4} spent"),
        _ => String::new(),
    };
    let limit = if st.stages_used() >= st.max_stages {
        " The stage limit is reached: start no more stages; compare, select and summarise, then end your turn."
    } else {
        ""
    };
    format!(
        "Lineage so far:\n{}\nStages used: {} of {}{spent}.{limit}",
        if lines.is_empty() {
            "(no stage yet)".to_string()
        } else {
            lines.join("\n")
        },
        st.stages_used(),
        st.max_stages
    )
}

fn system_prompt(config: &AgentConfig, session: &str) -> String {
    format!(
        "You plan and drive work in Cairn, a runtime of durable, forkable sandboxes, toward the user's goal. \
         You work in stages, not in keystrokes: run_stage forks a snapshot into a sandbox, writes the edits, runs \
         the commands durably and ends with an output snapshot; fork_from does the same for one hypothesis, and \
         several fork_from calls in one reply run in parallel. You are called once per stage boundary: when \
         the stages you started have ended, their results come back to you. Record your plan with plan_stage \
         before a stage when the next step is not obvious; compare parallel branches with select and say why \
         the winner won; read results with inspect_logs and inspect. Every call takes a short `reason`: it is \
         recorded in the lineage beside the branch. Session {session} is your scratch machine for exec, \
         read_file and write_file. You may start at most {} stages in total. When the goal is met, or cannot \
         be met, reply without any tool call, with a short summary of the outcome and the snapshot that holds \
         it: that ends the work.",
        config.max_stages
    )
}
