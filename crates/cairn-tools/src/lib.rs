//! The tools a model drives Cairn with (plan, run, fork, select, inspect),
//! one implementation shared by the MCP server and the agent loop.
//!
//! A stage a model starts is a pipeline run of one stage, made from the
//! arguments: it forks the given snapshot, writes the edits, runs the
//! commands durably (stage keys, checkpoints, the dead-letter queue and
//! `cairn pipeline resume` all apply) and ends with an output snapshot.
//! Its handle is the run's id. Who asked and the reason the model gave
//! go into the run's events, which `cairn pipeline show` prints. fork_from's
//! `hypotheses` are one run whose stage is a branch group (group.rs); the
//! session lifecycle tools are in lifecycle.rs.

mod args;
mod group;
mod lifecycle;
pub mod schema;

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cairn_engine::{Engine, EngineError, Home};
use cairn_pipeline::lineage::EventData;
use cairn_pipeline::prelude::*;
use cairn_pipeline::run::Quiet;
use cairn_session::prelude::*;
use serde::Serialize;
use serde_json::{json, Value};

pub use args::{Choice, Edit, Metric, ToolArgs};
pub use schema::{document, tools, ToolSpec, TOOLS_VERSION};

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("unknown tool {0:?}; list the tools to see their names")]
    UnknownTool(String),
    #[error("invalid arguments for {tool}: {message}")]
    InvalidArguments { tool: String, message: String },
    /// The tool ran and failed in a way the model can act on.
    #[error("{0}")]
    Failed(String),
}

impl From<EngineError> for ToolError {
    fn from(e: EngineError) -> ToolError {
        ToolError::Failed(e.to_string())
    }
}

/// Reports how long a waiting tool has waited, for MCP progress.
pub trait ToolProgress: Sync {
    fn progress(&self, done: f64, total: Option<f64>, message: &str);
}

impl ToolProgress for () {
    fn progress(&self, _: f64, _: Option<f64>, _: &str) {}
}

/// The stage's pipeline: its name says which tool made it.
const RUN_STAGE: &str = "stage";
const FORK_STAGE: &str = "fork";
/// The most `inspect` returns of a file.
const INSPECT_FILE_MAX: u64 = 256 << 10;
/// The most entries `inspect` lists.
const INSPECT_ENTRIES_MAX: u32 = 1000;
/// `diff`: unified diffs for text files of at most this size, and together
/// at most this much text; at most this many changes listed.
const DIFF_TEXT_MAX: u64 = 64 << 10;
const DIFF_CHANGES_MAX: usize = 500;
/// The most of a log's end `inspect_logs` reads.
const LOG_TAIL_BYTES: u64 = 1 << 20;
const LOG_LINE_MAX: usize = 4096;
const DEFAULT_WAIT_SECS: u64 = 5;

thread_local! {
    /// The tenant the call on this thread acts for ([`Tools::call_for`]).
    static TENANT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

fn acting() -> Option<String> {
    TENANT.with(|t| t.borrow().clone())
}

/// The ids of the acting tenant's `kind` objects; `None` for an administrator.
fn mine(
    e: &Engine,
    kind: cairn_engine::tenants::Owned,
) -> Result<Option<std::collections::HashSet<String>>, ToolError> {
    match acting() {
        Some(t) => Ok(Some(e.owned(kind, &t)?)),
        None => Ok(None),
    }
}

pub struct Tools {
    home: Home,
    pool: Mutex<Vec<Engine>>,
    /// Runs whose orchestrator thread ended with an error, and the error.
    failed: std::sync::Arc<Mutex<HashMap<String, String>>>,
}

impl Tools {
    pub fn new(home: Home) -> Tools {
        Tools {
            home,
            pool: Mutex::new(Vec::new()),
            failed: Default::default(),
        }
    }

    fn with_engine<T>(&self, f: impl FnOnce(&mut Engine) -> Result<T, ToolError>) -> Result<T, ToolError> {
        let pooled = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut engine = match pooled {
            Some(e) => e,
            None => Engine::open(self.home.clone())?,
        };
        engine.act_for(acting());
        let out = f(&mut engine);
        engine.act_for(None);
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < 4 {
            pool.push(engine);
        }
        out
    }

    /// [`Self::call`] for a tenant's token (`None`: an administrator): the
    /// call sees and makes that tenant's runs, snapshots and dead letters
    /// only (`cairn_engine::tenants`).
    pub fn call_for(
        &self,
        tenant: Option<&str>,
        name: &str,
        arguments: Value,
        caller: &str,
        progress: &dyn ToolProgress,
    ) -> Result<Value, ToolError> {
        let before = TENANT.replace(tenant.map(str::to_string));
        let out = self.call(name, arguments, caller, progress);
        TENANT.set(before);
        out
    }

    /// Calls tool `name` for `caller` (who asked: recorded with the reason).
    /// Blocking: waits up to the call's `wait_secs`, reporting progress.
    pub fn call(
        &self,
        name: &str,
        arguments: Value,
        caller: &str,
        progress: &dyn ToolProgress,
    ) -> Result<Value, ToolError> {
        let args = args::parse(name, arguments)?;
        let caller = clip(caller, 256);
        match args {
            ToolArgs::PlanStage {
                context,
                constraints,
                handle,
                reason,
            } => self.plan_stage(&context, constraints.as_deref(), handle.as_deref(), &reason, &caller),
            ToolArgs::RunStage(s) => {
                let detail = format!("run_stage asked by {caller}: {}", s.reason);
                let handle = self.start(RUN_STAGE, &s, None, &detail, None)?;
                self.wait(&handle, s.wait_secs, progress)
            }
            ToolArgs::ForkFrom(s) => {
                let detail = format!("fork_from asked by {caller}: {}", s.reason);
                let handle = match &s.hypotheses {
                    Some(group) => self.start_group(&s, group, &detail, None)?,
                    None => {
                        let hypothesis = s.hypothesis.clone().unwrap_or_default();
                        self.start(FORK_STAGE, &s, Some(&hypothesis), &detail, None)?
                    }
                };
                self.wait(&handle, s.wait_secs, progress)
            }
            ToolArgs::StageStatus { handle, wait_secs } => self.wait(&handle, wait_secs, progress),
            ToolArgs::Select {
                group: Some(handle),
                choice,
                reason,
                ..
            } => self.select_group(&handle, &choice, &reason, &caller),
            ToolArgs::Select {
                branches,
                group: None,
                choice,
                reason,
            } => self.select(&branches, &choice, &reason, &caller),
            ToolArgs::InspectLogs {
                stage,
                branch,
                tail_lines,
            } => self.inspect_logs(&stage, branch.as_deref(), tail_lines),
            ToolArgs::SessionCreate {
                image,
                snapshot_id,
                name,
                reason,
            } => self.session_create(image, snapshot_id.as_deref(), name, &reason, &caller),
            ToolArgs::SessionLifecycle {
                action,
                session,
                reason,
            } => self.session_lifecycle(action, &session, &reason, &caller),
            ToolArgs::SessionFork { session, name, reason } => self.session_fork(&session, name, &reason, &caller),
            ToolArgs::Inspect { snapshot_id, path } => self.inspect(&snapshot_id, &path),
            ToolArgs::Diff { from, to, text } => self.diff(&from, &to, text),
            ToolArgs::Dlq { retry: None, .. } => self.dlq_list(),
            ToolArgs::Dlq {
                retry: Some(id),
                reason,
            } => self.dlq_retry(&id, reason.as_deref().unwrap_or(""), &caller),
            ToolArgs::Exec {
                session,
                argv,
                cwd,
                timeout_secs,
                reason,
            } => self.exec(&session, argv, cwd, timeout_secs, notes(&caller, &reason)),
            ToolArgs::ReadFile { session, path } => self.read_file(&session, &path),
            ToolArgs::Restore {
                snapshot_id,
                name,
                reason,
            } => self.with_engine(|e| {
                let snap = e.snapshot_record(&snapshot_id)?;
                let opts = cairn_session::SessionOptions {
                    name,
                    image: None,
                    driver: None,
                    idle_timeout_ms: None,
                    network: None,
                };
                let s = e.create_session_from(&opts, &snap, &format!("asked by {caller}: {reason}"))?;
                Ok(json!({"session": s.id, "name": s.name, "snapshot_id": snap.id}))
            }),
            ToolArgs::Snapshot { session, label, reason } => self.with_engine(|e| {
                let note = format!("asked by {caller}: {reason}");
                let snap = e.snapshot_session(&session, label.as_deref(), &note)?;
                Ok(json!({"snapshot_id": snap.id, "label": snap.label}))
            }),
            ToolArgs::WriteFile {
                session,
                path,
                content,
                mode,
                reason,
            } => self.with_engine(|e| {
                let bytes = content.as_bytes();
                let meta = e.session_write_file_noted(
                    &session,
                    &path,
                    mode.unwrap_or(0o644),
                    bytes.len() as u64,
                    &mut &bytes[..],
                    notes(&caller, &reason),
                )?;
                Ok(json!({"path": meta.path, "size": meta.size}))
            }),
        }
    }

    fn plan_stage(
        &self,
        context: &str,
        constraints: Option<&str>,
        handle: Option<&str>,
        reason: &str,
        caller: &str,
    ) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            let mut snaps = e.snapshots()?;
            if let Some(mine) = mine(e, cairn_engine::tenants::Owned::Snapshot)? {
                snaps.retain(|s| mine.contains(&s.id));
            }
            snaps.sort_by_key(|s| std::cmp::Reverse(s.created_at));
            snaps.truncate(50);
            let recorded = match handle {
                Some(h) => {
                    let run = e.run_record(h)?;
                    let plan = EventData::Plan {
                        by: caller.to_string(),
                        context: format!(
                            "{context}{}",
                            constraints.map(|c| format!(" (constraints: {c})")).unwrap_or_default()
                        ),
                        reason: reason.to_string(),
                    };
                    e.record_typed_event(&run.id, Some(stage_of(&run.pipeline)), None, plan, None)?;
                    true
                }
                None => false,
            };
            let snapshots: Vec<Value> = snaps
                .iter()
                .map(|s| json!({"id": s.id, "label": s.label, "parent_id": s.parent_id, "created_at": s.created_at}))
                .collect();
            Ok(json!({"recorded": recorded, "snapshots": snapshots}))
        })
    }

    /// For a caller that drives many calls and must survive its own
    /// death (the agent loop): starts a stage tool (`run_stage`,
    /// `fork_from`) as run `run_id` and returns its handle without waiting.
    /// When that run exists already (the caller was killed after starting
    /// it), this returns it, and continues it on a thread of its own if no
    /// process executes it: a stage is never started twice for one call.
    pub fn start_stage(&self, name: &str, arguments: Value, caller: &str, run_id: &str) -> Result<String, ToolError> {
        let existing = self.with_engine(|e| match e.run_record(run_id) {
            Ok(run) => Ok(Some((
                run.status == "running" && e.run_orchestrator(&run.id).is_none(),
                run.id,
            ))),
            Err(e) if matches!(e.domain(), Some(cairn_pipeline::run::RunError::NoSuchRun(_))) => Ok(None),
            Err(other) => Err(other.into()),
        })?;
        if let Some((orphaned, id)) = existing {
            if orphaned {
                self.execute_in_background(&id)?;
            }
            return Ok(id);
        }
        let caller = clip(caller, 256);
        match args::parse(name, arguments)? {
            ToolArgs::RunStage(s) => {
                let detail = format!("run_stage asked by {caller}: {}", s.reason);
                self.start(RUN_STAGE, &s, None, &detail, Some(run_id))
            }
            ToolArgs::ForkFrom(s) => {
                let detail = format!("fork_from asked by {caller}: {}", s.reason);
                match &s.hypotheses {
                    Some(group) => self.start_group(&s, group, &detail, Some(run_id)),
                    None => {
                        let hypothesis = s.hypothesis.clone().unwrap_or_default();
                        self.start(FORK_STAGE, &s, Some(&hypothesis), &detail, Some(run_id))
                    }
                }
            }
            _ => Err(ToolError::Failed(format!("{name} does not start a stage"))),
        }
    }

    /// Whether tool `name` starts a stage (see [`Tools::start_stage`]).
    pub fn starts_stage(name: &str) -> bool {
        name == "run_stage" || name == "fork_from"
    }

    /// Records a one-stage run (as `run_id` when given) and starts its
    /// orchestrator on a thread of its own; returns the run id.
    fn start(
        &self,
        stage: &str,
        s: &args::StageArgs,
        hypothesis: Option<&str>,
        detail: &str,
        run_id: Option<&str>,
    ) -> Result<String, ToolError> {
        let run = self.with_engine(|e| {
            let snap = e.snapshot_record(&s.snapshot_id)?;
            let text = pipeline_text(stage, &snap.id, s)?;
            let file = format!("tool {stage}");
            let run = match run_id {
                Some(id) => e.start_run_text_as(id, &file, text, &Default::default())?,
                None => e.start_run_text(&file, text, &Default::default())?,
            };
            if let Some(h) = hypothesis {
                e.record_run_event(&run.id, Some(stage), "hypothesis", h, None)?;
            }
            e.record_run_event(&run.id, Some(stage), "asked", detail, Some(&snap.id))?;
            Ok(run)
        })?;
        self.execute_in_background(&run.id)?;
        Ok(run.id)
    }

    /// Executes run `id` on a thread of its own (an orchestrator with its
    /// own engine); an error it ends with is kept for stage_status.
    fn execute_in_background(&self, id: &str) -> Result<(), ToolError> {
        let (home, id, failed) = (self.home.clone(), id.to_string(), std::sync::Arc::clone(&self.failed));
        std::thread::Builder::new()
            .name(format!("run-{}", &id[..8.min(id.len())]))
            .spawn(move || {
                let result = Engine::open(home).and_then(|mut e| e.execute_run(&id, &Quiet));
                if let Err(err) = result {
                    tracing::warn!(run = %id, "run ended with an error: {err}");
                    failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, err.to_string());
                }
            })
            .map_err(|e| ToolError::Failed(format!("cannot start the run's thread: {e}; try again")))?;
        Ok(())
    }

    /// The stage's state, waiting up to `wait_secs` for it to end.
    fn wait(&self, handle: &str, wait_secs: Option<u64>, progress: &dyn ToolProgress) -> Result<Value, ToolError> {
        let limit = Duration::from_secs(wait_secs.unwrap_or(DEFAULT_WAIT_SECS));
        let began = Instant::now();
        loop {
            let state = self.stage_state(handle)?;
            if state.status != "running" || began.elapsed() >= limit {
                return Ok(serde_json::to_value(state).expect("serialisable"));
            }
            let waited = began.elapsed().as_secs_f64();
            progress.progress(
                waited,
                Some(limit.as_secs_f64()),
                &format!("stage {} is running", state.handle),
            );
            std::thread::sleep(Duration::from_millis(250).min(limit.saturating_sub(began.elapsed())));
        }
    }

    fn stage_state(&self, handle: &str) -> Result<StageState, ToolError> {
        let thread_error = |id: &str| self.failed.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned();
        self.with_engine(|e| {
            let run = e.run_record(handle)?;
            if !run.pipeline.starts_with("tool-") {
                return Err(ToolError::Failed(format!(
                    "run {} is a pipeline run, not a stage a tool started; `cairn pipeline show {}` shows it",
                    run.id, run.id
                )));
            }
            let stage = e.run_stages(&run.id)?.into_iter().find(|s| s.branch.is_empty());
            let events = e.run_events(&run.id)?;
            let cached = events.iter().any(|ev| ev.kind == "reused");
            let hypothesis = events
                .iter()
                .find(|ev| ev.kind == "hypothesis")
                .map(|ev| ev.detail.clone());
            let mut status = match run.status.as_str() {
                "completed" => "completed",
                "running" => "running",
                _ => "failed",
            };
            let mut error = run
                .error
                .clone()
                .or_else(|| stage.as_ref().and_then(|s| s.error.clone()));
            if status == "running" {
                if let Some(err) = thread_error(&run.id) {
                    status = "failed";
                    error = Some(err);
                }
            }
            let branches = match run.pipeline == group::GROUP_PIPELINE {
                true => Some(group::branch_states(e, &run)?),
                false => None,
            };
            Ok(StageState {
                handle: run.id.clone(),
                ended_at: stage.as_ref().and_then(|s| s.ended_at),
                branches,
                stage: stage_of(&run.pipeline).to_string(),
                status: status.into(),
                stage_key: stage.as_ref().map(|s| s.stage_key.clone()).unwrap_or_default(),
                cached,
                hypothesis,
                input_snapshot: stage.as_ref().and_then(|s| s.input_snapshot.clone()),
                output_snapshot: stage.as_ref().and_then(|s| s.output_snapshot.clone()),
                error,
            })
        })
    }

    fn select(&self, branches: &[String], choice: &Choice, reason: &str, caller: &str) -> Result<Value, ToolError> {
        let states: Vec<StageState> = branches.iter().map(|b| self.stage_state(b)).collect::<Result<_, _>>()?;
        if let Some(g) = states.iter().find(|s| s.branches.is_some()) {
            return Err(ToolError::Failed(format!(
                "{} is a fork_from group: choose among its branches with select's handle, not branches",
                g.handle
            )));
        }
        let mut metrics = serde_json::Map::new();
        let (won, how) = match choice {
            Choice::Winner(w) => (self.stage_state(w)?, String::new()),
            Choice::FirstSuccess => {
                let completed = states.iter().filter(|s| s.status == "completed");
                let Some(first) = completed.min_by_key(|s| s.ended_at.unwrap_or(i64::MAX)) else {
                    return Err(ToolError::Failed(
                        "no branch has completed yet; poll the branches with stage_status".into(),
                    ));
                };
                (self.stage_state(&first.handle)?, " by first_success".to_string())
            }
            Choice::Rule { max, metric } => {
                let mut best: Option<(f64, &StageState)> = None;
                for s in states.iter().filter(|s| s.status == "completed") {
                    let Some(v) = self.metric(&s.handle, None, s.output_snapshot.as_deref(), metric)? else {
                        continue;
                    };
                    metrics.insert(s.handle.clone(), v.into());
                    let better = best.is_none_or(|(b, _)| if *max { v > b } else { v < b });
                    if better {
                        best = Some((v, s));
                    }
                }
                let Some((v, s)) = best else {
                    return Err(ToolError::Failed(
                        "no completed branch has a number for this metric; poll the branches with stage_status, \
                         check their output with inspect_logs, or choose a winner by name"
                            .into(),
                    ));
                };
                let rule = if *max { "max" } else { "min" };
                let what = group::metric_name(metric);
                (self.stage_state(&s.handle)?, format!(" by {rule} of {what} ({v})"))
            }
        };
        if !states.iter().any(|s| s.handle == won.handle) {
            return Err(ToolError::Failed(format!(
                "the winner {} is not one of the branches; name it in `branches` too",
                won.handle
            )));
        }
        let Some(output) = won.output_snapshot.clone().filter(|_| won.status == "completed") else {
            return Err(ToolError::Failed(format!(
                "branch {} is {}, not completed; poll it with stage_status, or choose a completed branch",
                won.handle, won.status
            )));
        };
        let lost: std::collections::BTreeMap<String, String> = states
            .iter()
            .filter(|s| s.handle != won.handle)
            .map(|s| (s.handle.clone(), s.stage.clone()))
            .collect();
        self.with_engine(|e| {
            let others = if lost.is_empty() {
                "no other branch".to_string()
            } else {
                lost.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
            };
            let rule = match how.trim() {
                "" => "by name".to_string(),
                h => h.to_string(),
            };
            let chosen = EventData::Won {
                branch: won.handle.clone(),
                rule: rule.clone(),
                metric: metrics.get(&won.handle).and_then(Value::as_f64),
                runner_up: None,
                runner_up_metric: None,
                chosen_by: Some(caller.to_string()),
                reason: Some(format!("over {others}: {reason}")),
            };
            e.record_typed_event(&won.handle, Some(&won.stage), None, chosen, Some(&output))?;
            for (l, stage) in &lost {
                let lost = EventData::Lost {
                    branch: l.clone(),
                    winner: won.handle.clone(),
                    rule: rule.clone(),
                    ended: states
                        .iter()
                        .find(|s| &s.handle == l)
                        .map(|s| s.status.clone())
                        .unwrap_or_default(),
                    metric: metrics.get(l).and_then(Value::as_f64),
                    winner_metric: metrics.get(&won.handle).and_then(Value::as_f64),
                    chosen_by: Some(caller.to_string()),
                    reason: Some(reason.to_string()),
                };
                e.record_typed_event(l, Some(stage), None, lost, None)?;
            }
            Ok(())
        })?;
        let mut out = json!({"winner": won.handle, "output_snapshot": output, "lost": lost.keys().collect::<Vec<_>>()});
        if !metrics.is_empty() {
            out["metrics"] = Value::Object(metrics);
        }
        Ok(out)
    }

    /// A completed branch's number: the last one its log printed (run
    /// `run`, branch `branch` of a group), or the first in a file of its
    /// output snapshot; `None` when there is none.
    fn metric(
        &self,
        run: &str,
        branch: Option<&str>,
        output: Option<&str>,
        metric: &Metric,
    ) -> Result<Option<f64>, ToolError> {
        match metric {
            Metric::Output => {
                let lines = self.inspect_logs(run, branch, Some(2000))?;
                let text: Vec<&str> = lines["lines"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                Ok(text.iter().rev().find_map(|l| numbers(l).last()))
            }
            Metric::File(path) => {
                let Some(snap) = output else {
                    return Ok(None);
                };
                match self.inspect(snap, path) {
                    Ok(v) => Ok(v["content"].as_str().and_then(|t| numbers(t).next())),
                    Err(ToolError::Failed(_)) => Ok(None),
                    Err(e) => Err(e),
                }
            }
        }
    }

    fn inspect_logs(&self, handle: &str, branch: Option<&str>, tail_lines: Option<u32>) -> Result<Value, ToolError> {
        let (id, path) = self.with_engine(|e| {
            let run = e.run_record(handle)?;
            let stage = stage_of(&run.pipeline);
            let name = match branch {
                Some(b) => format!("{stage}.{b}.log"),
                None => format!("{stage}.log"),
            };
            Ok((run.id.clone(), e.run_dir(&run.id).join(name)))
        })?;
        let n = tail_lines.unwrap_or(100) as usize;
        let mut file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(json!({"handle": id, "lines": [], "truncated": false}))
            }
            Err(e) => {
                return Err(ToolError::Failed(format!(
                    "cannot read the log {}: {e}",
                    path.display()
                )))
            }
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let from = len.saturating_sub(LOG_TAIL_BYTES);
        let mut bytes = Vec::new();
        file.seek(SeekFrom::Start(from))
            .and_then(|_| file.take(LOG_TAIL_BYTES).read_to_end(&mut bytes))
            .map_err(|e| ToolError::Failed(format!("cannot read the log {}: {e}", path.display())))?;
        let text = String::from_utf8_lossy(&bytes);
        let mut lines: Vec<&str> = text.lines().collect();
        if from > 0 && !lines.is_empty() {
            lines.remove(0); // cut mid-line
        }
        let truncated = from > 0 || lines.len() > n;
        let tail: Vec<String> = lines[lines.len().saturating_sub(n)..]
            .iter()
            .map(|l| clip(l, LOG_LINE_MAX))
            .collect();
        Ok(json!({"handle": id, "lines": tail, "truncated": truncated}))
    }

    fn dlq_list(&self) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            let mut all = e.dead_letters()?;
            if let Some(mine) = mine(e, cairn_engine::tenants::Owned::Run)? {
                all.retain(|d| mine.contains(&d.run_id));
            }
            all.sort_by_key(|d| std::cmp::Reverse(d.created_at));
            all.truncate(100);
            let listed: Vec<Value> = all
                .iter()
                .map(|d| {
                    json!({"id": d.id, "handle": d.run_id, "stage": d.stage, "branch": d.branch,
                           "error": clip(&d.error, LOG_LINE_MAX), "failure_snapshot": d.failure_snapshot,
                           "input_snapshot": d.input_snapshot, "retried": d.retried_at.is_some()})
                })
                .collect();
            Ok(json!({"dead_letters": listed}))
        })
    }

    /// Retries a dead letter on a thread of its own, as a stage starts;
    /// returns once the run is running again (or the retry failed).
    fn dlq_retry(&self, id: &str, reason: &str, caller: &str) -> Result<Value, ToolError> {
        let dead = self.with_engine(|e| {
            let mine = mine(e, cairn_engine::tenants::Owned::Run)?;
            let found: Vec<_> = e
                .dead_letters()?
                .into_iter()
                .filter(|d| mine.as_ref().is_none_or(|m| m.contains(&d.run_id)))
                .filter(|d| d.id.starts_with(id))
                .collect();
            match found.as_slice() {
                [one] => {
                    let detail = format!("dlq retry asked by {caller}: {reason}");
                    e.record_run_event(&one.run_id, Some(&one.stage), "asked", &detail, None)?;
                    Ok(one.clone())
                }
                [] => Err(ToolError::Failed(format!(
                    "no dead letter {id}; dlq with action list names them"
                ))),
                _ => Err(ToolError::Failed(format!(
                    "{id} names several dead letters; give more of the id"
                ))),
            }
        })?;
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&dead.run_id);
        let (home, key, run, failed) = (
            self.home.clone(),
            dead.id.clone(),
            dead.run_id.clone(),
            std::sync::Arc::clone(&self.failed),
        );
        std::thread::Builder::new()
            .name(format!("retry-{}", &key[..8.min(key.len())]))
            .spawn(move || {
                let result = Engine::open(home).and_then(|mut e| e.retry_dead_letter(&key, &Quiet));
                if let Err(err) = result {
                    tracing::warn!(run = %run, "dead letter retry ended with an error: {err}");
                    failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(run, err.to_string());
                }
            })
            .map_err(|e| ToolError::Failed(format!("cannot start the retry's thread: {e}; try again")))?;
        let began = Instant::now();
        while began.elapsed() < Duration::from_secs(10) {
            let running = self.with_engine(|e| Ok(e.run_record(&dead.run_id)?.status == "running"))?;
            let failed = self
                .failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&dead.run_id);
            if running || failed {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(json!({"handle": dead.run_id}))
    }

    fn exec(
        &self,
        session: &str,
        argv: Vec<String>,
        cwd: Option<String>,
        timeout_secs: Option<u64>,
        notes: serde_json::Map<String, Value>,
    ) -> Result<Value, ToolError> {
        let req = cairn_protocol::ExecRequest {
            argv,
            env: Vec::new(),
            cwd,
            stdin: false,
            timeout_ms: Some(timeout_secs.unwrap_or(300) * 1000),
            detach: false,
            user: None,
        };
        let (mut out, mut err) = (Tail::default(), Tail::default());
        let outcome = self.with_engine(|e| Ok(e.session_exec_noted(session, req, notes, &mut out, &mut err)?))?;
        Ok(
            json!({"status": outcome.status, "stdout": out.text(), "stderr": err.text(),
                  "truncated": out.cut || err.cut, "call_seq": outcome.call_seq}),
        )
    }

    fn read_file(&self, session: &str, path: &str) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            let Some(meta) = e.session_stat(session, path)? else {
                return Err(ToolError::Failed(format!("{path} does not exist in session {session}")));
            };
            if meta.kind != cairn_protocol::FileKind::File {
                return Err(ToolError::Failed(format!(
                    "{path} is a {}, not a file; list directories with exec (ls)",
                    kind_name(&meta.kind)
                )));
            }
            if meta.size > INSPECT_FILE_MAX {
                return Err(ToolError::Failed(format!(
                    "{path} is {} bytes; read_file reads at most {INSPECT_FILE_MAX}: use exec with head or tail",
                    meta.size
                )));
            }
            let mut buf = Vec::new();
            let meta = e.session_read_file(session, path, &mut Bounded(&mut buf))?;
            Ok(json!({"path": path, "size": meta.size, "content": String::from_utf8_lossy(&buf)}))
        })
    }

    /// Reads a file or lists a directory of a snapshot straight from its
    /// layers (the engine's `read_snapshot_path`): no sandbox starts, and a
    /// symlink is reported with its target, never followed.
    fn inspect(&self, snapshot: &str, path: &str) -> Result<Value, ToolError> {
        use cairn_engine::snapshot_view::SnapshotItem;
        self.with_engine(|e| {
            let snap = e.snapshot_record(snapshot)?;
            let item = e.read_snapshot_path(&snap, path, INSPECT_FILE_MAX, INSPECT_ENTRIES_MAX as usize)?;
            let id = &snap.id;
            Ok(match item {
                SnapshotItem::File { size, content, .. } => json!({"snapshot_id": id, "path": path, "kind": "file",
                    "size": size, "content": String::from_utf8_lossy(&content)}),
                SnapshotItem::Directory { entries, truncated } => {
                    let entries: Vec<Value> = entries
                        .iter()
                        .map(|d| {
                            let mut entry = json!({"name": d.name, "kind": d.kind, "size": d.size});
                            if let Some(t) = &d.symlink_target {
                                entry["target"] = t.as_str().into();
                            }
                            entry
                        })
                        .collect();
                    json!({"snapshot_id": id, "path": path, "kind": "directory", "entries": entries,
                           "truncated": truncated})
                }
                SnapshotItem::Symlink { target } => {
                    json!({"snapshot_id": id, "path": path, "kind": "symlink", "target": target})
                }
                SnapshotItem::Other { kind } => json!({"snapshot_id": id, "path": path, "kind": kind}),
            })
        })
    }
}

impl Tools {
    /// How snapshot `to` differs from snapshot `from`, from their layers
    /// (the engine's `diff`), in a size a model's context can take.
    fn diff(&self, from: &str, to: &str, text: bool) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            // Snapshots only: a model names what it forked and ran, never a
            // sandbox's moving files.
            let (a, b) = (e.snapshot_record(from)?, e.snapshot_record(to)?);
            let opts = cairn_engine::DiffOptions {
                text_max: if text { DIFF_TEXT_MAX } else { 0 },
                max_changes: DIFF_CHANGES_MAX,
                text_budget: DIFF_TEXT_MAX as usize,
            };
            let d = e.diff(&a.id, &b.id, &opts)?;
            let changes: Vec<Value> = d
                .changes
                .iter()
                .map(|c| {
                    let side = c.after.as_ref().or(c.before.as_ref());
                    let mut v = json!({"path": c.path, "change": c.change});
                    if let Some(s) = side {
                        v["kind"] = s.kind.into();
                        v["size"] = s.size.into();
                    }
                    if !c.what.is_empty() {
                        v["what"] = c.what.clone().into();
                    }
                    if let Some(t) = &c.diff {
                        v["diff"] = t.as_str().into();
                    }
                    v
                })
                .collect();
            Ok(
                json!({"from_snapshot_id": a.id, "to_snapshot_id": b.id, "added": d.added, "removed": d.removed,
                      "changed": d.changed, "changes": changes, "truncated": d.truncated}),
            )
        })
    }
}

fn kind_name(k: &cairn_protocol::FileKind) -> &'static str {
    use cairn_protocol::FileKind;
    match k {
        FileKind::File => "file",
        FileKind::Dir => "directory",
        FileKind::Symlink => "symlink",
        FileKind::Other => "other",
    }
}

/// The stage's name in a tool-made run's pipeline (`tool-stage`, `tool-fork`).
fn stage_of(pipeline: &str) -> &str {
    pipeline.strip_prefix("tool-").unwrap_or(pipeline)
}

#[derive(Debug, Serialize)]
struct StageState {
    handle: String,
    /// A fork_from group's branches.
    #[serde(skip_serializing_if = "Option::is_none")]
    branches: Option<Vec<group::BranchState>>,
    #[serde(skip)]
    ended_at: Option<i64>,
    /// The stage's name in its run (`stage` or `fork`), for events.
    #[serde(skip)]
    stage: String,
    status: String,
    stage_key: String,
    cached: bool,
    hypothesis: Option<String>,
    input_snapshot: Option<String>,
    output_snapshot: Option<String>,
    error: Option<String>,
}

/// A one-stage pipeline file forking `snapshot`, made with a TOML
/// serialiser (no text of the model's is spliced into TOML); braces in
/// commands and contents are doubled so the pipeline's placeholders leave
/// them as written.
fn pipeline_text(stage: &str, snapshot: &str, s: &args::StageArgs) -> Result<String, ToolError> {
    #[derive(Serialize)]
    struct File<'a> {
        pipeline: Header<'a>,
        stage: Vec<StageOut<'a>>,
    }
    #[derive(Serialize)]
    struct Header<'a> {
        name: String,
        snapshot: &'a str,
    }
    #[derive(Serialize)]
    struct StageOut<'a> {
        name: &'a str,
        key: String,
        run: Vec<String>,
        edits: Vec<EditOut>,
        #[serde(skip_serializing_if = "Option::is_none")]
        timeout: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        checkpoint_every: Option<&'a str>,
    }
    #[derive(Serialize)]
    struct EditOut {
        path: String,
        content: String,
        mode: u32,
    }
    let brace = |t: &str| t.replace('{', "{{").replace('}', "}}");
    let key = match &s.stage_key {
        Some(k) => k.clone(),
        None => format!("tool-{}", random_hex(8)),
    };
    let file = File {
        pipeline: Header {
            name: format!("tool-{stage}"),
            snapshot,
        },
        stage: vec![StageOut {
            name: stage,
            key,
            run: s.commands.iter().map(|c| brace(c)).collect(),
            edits: s
                .edits
                .iter()
                .map(|e| EditOut {
                    path: brace(&e.path),
                    content: brace(&e.content),
                    mode: e.mode.unwrap_or(0o644),
                })
                .collect(),
            timeout: s.timeout.as_deref(),
            checkpoint_every: s.checkpoint_every.as_deref(),
        }],
    };
    toml::to_string(&file).map_err(|e| ToolError::Failed(format!("cannot write the stage's pipeline: {e}")))
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    let mut f = std::fs::File::open("/dev/urandom").expect("/dev/urandom is readable");
    f.read_exact(&mut b).expect("/dev/urandom gives bytes");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The finite numbers in `text`, in order (words split at whitespace and
/// common punctuation).
fn numbers(text: &str) -> impl DoubleEndedIterator<Item = f64> + '_ {
    text.split(|c: char| c.is_whitespace() || ",;:()[]{}=\"'".contains(c))
        .filter_map(|w| w.parse::<f64>().ok())
        .filter(|v| v.is_finite())
}

/// Who asked and why, for a session log entry's arguments.
fn notes(caller: &str, reason: &str) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("asked_by".into(), caller.into());
    m.insert("reason".into(), reason.into());
    m
}

/// The last [`EXEC_TAIL`] bytes written to it.
#[derive(Default)]
struct Tail {
    buf: std::collections::VecDeque<u8>,
    cut: bool,
}

const EXEC_TAIL: usize = 64 << 10;

impl Tail {
    fn text(&mut self) -> String {
        String::from_utf8_lossy(self.buf.make_contiguous()).into_owned()
    }
}

impl std::io::Write for Tail {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend(data);
        let over = self.buf.len().saturating_sub(EXEC_TAIL);
        if over > 0 {
            self.buf.drain(..over);
            self.cut = true;
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Refuses writes past [`INSPECT_FILE_MAX`]: a file that grew after its
/// size was read cannot fill memory.
struct Bounded<'a>(&'a mut Vec<u8>);

impl std::io::Write for Bounded<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + data.len() > INSPECT_FILE_MAX as usize {
            return Err(std::io::Error::other("the file grew past 256 KiB while it was read"));
        }
        self.0.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn clip(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::numbers;

    #[test]
    fn numbers_are_found_between_words_and_punctuation() {
        let found: Vec<f64> = numbers("energy=-12.5 kcal, rmsd: 0.8 (n=3) NaN inf x1").collect();
        assert_eq!(found, vec![-12.5, 0.8, 3.0]);
    }
}
