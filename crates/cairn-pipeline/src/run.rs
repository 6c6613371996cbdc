//! Running a pipeline: stages in sandboxes forked from snapshots, with stage
//! keys, checkpoints, retries that restore the newest checkpoint, a
//! dead-letter queue, branch groups and a lineage of events.
//!
//! Every transition is a row written in one transaction before the next
//! step, so `resume` after a crash (even `kill -9`) continues from the
//! records: completed stages are never run again, a cut-short attempt is
//! discarded with its sandbox and restarted from the stage's newest
//! checkpoint. Nothing is replayed: the records are data, not history.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cairn_protocol::{ExecRequest, FileKind, FileMeta};
use nix::fcntl::{Flock, FlockArg};

use crate::approval::Gate;
use crate::decide::Step;
use crate::lineage::EventData;
use crate::output::{Capped, Tail, Tee};
use crate::records::{ArtifactRecord, DeadLetter, NewEvent, RunRecord, StageRecord};
use crate::spec::{self, Metric, Pipeline, Selection, Stage};
use crate::steps::*;
use cairn_engine::sandboxes::CreateOptions;
use cairn_engine::{now_ms, Engine, EngineError, Home, Silent};

pub use crate::error::RunError;
pub use crate::render::parse_params;
pub(crate) use crate::render::{new_id, render};
pub use crate::watch::{Quiet, RunWatcher};

/// The first number in `text` (metric files), or the last (`output`).
fn number(text: &str, last: bool) -> Option<f64> {
    let mut nums = text
        .split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e' || c == 'E' || c == '+'))
        .filter_map(|w| w.parse::<f64>().ok())
        .filter(|n| n.is_finite());
    if last {
        nums.next_back()
    } else {
        nums.next()
    }
}

/// How one attempt of a stage ended.
pub(crate) enum Outcome {
    Succeeded {
        output: String,
        metric: Option<f64>,
        spent: Spent,
    },
    Failed {
        error: String,
        failure_snapshot: Option<String>,
        spent: Spent,
    },
}

/// Where an attempt's time went (ms) and what it stored, for its event.
#[derive(Default, Clone)]
pub(crate) struct Spent {
    setup_ms: u64,
    compute_ms: u64,
    command_ms: Vec<u64>,
    snapshot_ms: u64,
    artifacts_ms: u64,
    state_bytes: u64,
    artifact_bytes: u64,
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

/// Runs: start, resume, retry, inspect; the orchestrator of stage keys,\nattempts, checkpoints, retries and dead letters.
pub trait Runs {
    /// Checks a pipeline file and records a new run; nothing runs yet.
    fn start_run(&mut self, file: &Path, params: &BTreeMap<String, String>) -> Result<RunRecord, EngineError>;

    /// [`start_run`](Self::start_run) for a pipeline file's text that
    /// came from elsewhere (an API request); `file` names it in messages.
    fn start_run_text(
        &mut self,
        file: &str,
        text: String,
        params: &BTreeMap<String, String>,
    ) -> Result<RunRecord, EngineError>;

    /// [`start_run_text`](Self::start_run_text) under an id the caller
    /// chose (12 lowercase hex digits), so that a caller killed after
    /// starting the run finds it again rather than starting another. An id
    /// taken is an error.
    fn start_run_text_as(
        &mut self,
        id: &str,
        file: &str,
        text: String,
        params: &BTreeMap<String, String>,
    ) -> Result<RunRecord, EngineError>;

    fn run_record(&self, key: &str) -> Result<RunRecord, EngineError>;

    fn runs(&self) -> Result<Vec<RunRecord>, EngineError>;

    /// The pid of the process executing `run` now (holding its orchestrator
    /// lock), read from `/proc/locks` so that looking takes no lock a
    /// starting `resume` could collide with. A run recorded as running with
    /// no orchestrator was interrupted: `cairn pipeline resume` continues it.
    fn run_orchestrator(&self, run: &str) -> Option<u32>;

    /// Each run's stage rows counted by status (branches count one each).
    fn stage_counts(&self) -> Result<std::collections::HashMap<String, BTreeMap<String, u64>>, EngineError>;

    fn run_stages(&self, run: &str) -> Result<Vec<StageRecord>, EngineError>;

    fn run_events(&self, run: &str) -> Result<Vec<crate::records::EventRecord>, EngineError>;

    /// Records an event in a run's lineage from outside the orchestrator:
    /// a planner's plan, a hypothesis, a chosen winner and its reason.
    fn record_run_event(
        &self,
        run: &str,
        stage: Option<&str>,
        kind: &str,
        detail: &str,
        snapshot: Option<&str>,
    ) -> Result<(), EngineError>;

    /// Records an event about one branch of a group from outside the
    /// orchestrator: the winner chosen later for a deferred group, the
    /// branches that lost to it.
    fn record_branch_event(
        &self,
        run: &str,
        stage: &str,
        branch: &str,
        kind: &str,
        detail: &str,
        snapshot: Option<&str>,
    ) -> Result<(), EngineError>;

    /// Records an event with typed fields from outside the orchestrator: a
    /// planner's plan with its reason, a winner a model or person chose.
    fn record_typed_event(
        &self,
        run: &str,
        stage: Option<&str>,
        branch: Option<&str>,
        data: EventData,
        snapshot: Option<&str>,
    ) -> Result<(), EngineError>;

    fn artifacts(&self, run: Option<&str>) -> Result<Vec<ArtifactRecord>, EngineError>;

    fn dead_letters(&self) -> Result<Vec<DeadLetter>, EngineError>;

    /// The directory holding a run's stage logs.
    fn run_dir(&self, run: &str) -> PathBuf;

    /// Runs (or resumes) every stage not completed yet, in order. Returns the
    /// run's final record: completed, or failed with the stage at fault in
    /// the dead-letter queue.
    fn execute_run(&mut self, run_id: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError>;

    /// Retries a dead letter: its stage runs again (from its newest
    /// checkpoint or its input, with fresh retries), then the rest of the run.
    fn retry_dead_letter(&mut self, key: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError>;

    /// Writes `total` stage records (each a transition with its event, as a
    /// running stage does) into one synthetic run and returns the time taken
    /// by the first and the last `window` of them, in milliseconds: the cost
    /// per stage must not grow with the run's length.
    fn bench_stage_records(&mut self, total: usize, window: usize) -> Result<(f64, f64), EngineError>;
}

impl Runs for Engine {
    fn start_run(&mut self, file: &Path, params: &BTreeMap<String, String>) -> Result<RunRecord, EngineError> {
        let text = spec::read_file(file).map_err(|e| RunError::Read(file.to_path_buf(), e))?;
        self.start_run_text(&file.display().to_string(), text, params)
    }

    fn start_run_text(
        &mut self,
        file: &str,
        text: String,
        params: &BTreeMap<String, String>,
    ) -> Result<RunRecord, EngineError> {
        self.start_run_text_as(&new_id(12), file, text, params)
    }

    fn start_run_text_as(
        &mut self,
        id: &str,
        file: &str,
        text: String,
        params: &BTreeMap<String, String>,
    ) -> Result<RunRecord, EngineError> {
        if id.len() != 12 || !id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(RunError::BadRunId(id.to_string()).into());
        }
        let pipeline = spec::parse(file, &text, params).map_err(RunError::from)?;
        self.check_model_for(None, &pipeline)?;
        let run = RunRecord {
            id: id.to_string(),
            pipeline: pipeline.name.clone(),
            file: file.to_string(),
            spec: text,
            params: params.iter().map(|(k, v)| format!("{k}={v}\n")).collect(),
            status: "running".into(),
            created_at: now_ms(),
            ended_at: None,
            error: None,
        };
        self.db().insert_run(&run)?;
        let started = EventData::RunStarted {
            pipeline: pipeline.name.clone(),
            file: run.file.clone(),
        };
        self.db()
            .event_typed(&run.id, None, None, &NewEvent::typed(started, None))?;
        Ok(run)
    }

    fn run_record(&self, key: &str) -> Result<RunRecord, EngineError> {
        let mut found = self.db().find_runs(key)?;
        if found.len() == 1 {
            return Ok(found.remove(0));
        }
        Err(RunError::NoSuchRun(key.to_string()).into())
    }

    fn runs(&self) -> Result<Vec<RunRecord>, EngineError> {
        Ok(self.db().runs()?)
    }

    fn run_orchestrator(&self, run: &str) -> Option<u32> {
        cairn_engine::flock_holder(&self.run_dir(run).join("orchestrator.lock"))
    }

    fn stage_counts(&self) -> Result<std::collections::HashMap<String, BTreeMap<String, u64>>, EngineError> {
        let mut out: std::collections::HashMap<String, BTreeMap<String, u64>> = std::collections::HashMap::new();
        for (run, status, n) in self.db().stage_counts()? {
            out.entry(run).or_default().insert(status, n);
        }
        Ok(out)
    }

    fn run_stages(&self, run: &str) -> Result<Vec<StageRecord>, EngineError> {
        Ok(self.db().stages_of(run)?)
    }

    fn run_events(&self, run: &str) -> Result<Vec<crate::records::EventRecord>, EngineError> {
        Ok(self.db().events_of(run)?)
    }

    fn record_run_event(
        &self,
        run: &str,
        stage: Option<&str>,
        kind: &str,
        detail: &str,
        snapshot: Option<&str>,
    ) -> Result<(), EngineError> {
        let run = self.run_record(run)?;
        Ok(self.db().event(&run.id, stage, None, kind, detail, snapshot)?)
    }

    fn record_branch_event(
        &self,
        run: &str,
        stage: &str,
        branch: &str,
        kind: &str,
        detail: &str,
        snapshot: Option<&str>,
    ) -> Result<(), EngineError> {
        let run = self.run_record(run)?;
        Ok(self
            .db()
            .event(&run.id, Some(stage), Some(branch), kind, detail, snapshot)?)
    }

    fn record_typed_event(
        &self,
        run: &str,
        stage: Option<&str>,
        branch: Option<&str>,
        data: EventData,
        snapshot: Option<&str>,
    ) -> Result<(), EngineError> {
        let run = self.run_record(run)?;
        Ok(self
            .db()
            .event_typed(&run.id, stage, branch, &NewEvent::typed(data, snapshot))?)
    }

    fn artifacts(&self, run: Option<&str>) -> Result<Vec<ArtifactRecord>, EngineError> {
        Ok(self.db().artifacts(run)?)
    }

    fn dead_letters(&self) -> Result<Vec<DeadLetter>, EngineError> {
        Ok(self.db().dead_letters()?)
    }

    fn run_dir(&self, run: &str) -> PathBuf {
        self.home().root().join("runs").join(run)
    }

    fn execute_run(&mut self, run_id: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError> {
        let run = self.run_record(run_id)?;
        if let Some(refusal) = self.claimed_elsewhere(&run.id)? {
            return Err(refusal.into());
        }
        let _orchestrating = self.lock_run(&run.id)?;
        self.execute_locked_run(&run.id, watch)
    }

    fn retry_dead_letter(&mut self, key: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError> {
        // A tenant's engine finds its own runs' dead letters only.
        let mut all = self.db().dead_letters()?;
        self.keep_mine(cairn_engine::tenants::Owned::Run, &mut all, |d| &d.run_id)?;
        let dl = all
            .into_iter()
            .find(|d| d.id == key || (key.len() >= 4 && d.id.starts_with(key)))
            .ok_or_else(|| RunError::NoSuchDeadLetter(key.to_string()))?;
        let _orchestrating = self.lock_run(&dl.run_id)?;
        // Read again under the lock: another retry may have just taken it.
        let dl = self
            .db()
            .dead_letters()?
            .into_iter()
            .find(|d| d.id == dl.id)
            .ok_or_else(|| RunError::NoSuchDeadLetter(key.to_string()))?;
        if dl.retried_at.is_some() {
            return Err(RunError::AlreadyRetried(dl.id).into());
        }
        if let Some(mut rec) = self.db().stage(&dl.run_id, &dl.stage, &dl.branch)? {
            rec.status = "pending".into();
            rec.error = None;
            let retried = EventData::DeadLetterRetried {
                dead_letter: dl.id.clone(),
            };
            self.db_mut().put_stage_event(&rec, NewEvent::typed(retried, None))?;
        }
        self.db().mark_dead_letter_retried(&dl.id, now_ms())?;
        self.execute_locked_run(&dl.run_id, watch)
    }

    fn bench_stage_records(&mut self, total: usize, window: usize) -> Result<(f64, f64), EngineError> {
        let run = RunRecord {
            id: new_id(12),
            pipeline: "bench-records".into(),
            file: "-".into(),
            spec: String::new(),
            params: String::new(),
            status: "completed".into(),
            created_at: now_ms(),
            ended_at: Some(now_ms()),
            error: None,
        };
        self.db().insert_run(&run)?;
        let (mut first, mut last) = (0.0, 0.0);
        let mut t0 = Instant::now();
        for i in 0..total {
            let rec = StageRecord {
                run_id: run.id.clone(),
                stage: format!("s{i}"),
                branch: String::new(),
                stage_key: format!("bench-{}-{i}", run.id),
                status: "completed".into(),
                attempts: 1,
                input_snapshot: None,
                output_snapshot: Some(format!("{:064x}", i)),
                sandbox_id: None,
                started_at: Some(now_ms()),
                ended_at: Some(now_ms()),
                error: None,
                metric: None,
            };
            self.db_mut()
                .put_stage(&rec, Some(("completed", "bench record", None)))?;
            if i + 1 == window {
                first = t0.elapsed().as_secs_f64() * 1e3;
            }
            if i + 1 == total - window {
                t0 = Instant::now();
            }
        }
        last = if total > window {
            t0.elapsed().as_secs_f64() * 1e3
        } else {
            last
        };
        // The synthetic run leaves nothing behind.
        self.db_mut().delete_run(&run.id)?;
        Ok((first, last))
    }
}

pub(crate) trait RunSteps {
    /// Takes a run's orchestrator lock (`runs/<run>/orchestrator.lock`): one
    /// process executes a run at a time, or a second `resume` beside a live
    /// orchestrator would start its stages again. The lock goes with the
    /// process, however it dies; [`Runs::run_orchestrator`] names its holder.
    fn lock_run(&self, run: &str) -> Result<Flock<fs::File>, EngineError>;

    fn execute_locked_run(&mut self, run_id: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError>;

    fn execute_owned_run(&mut self, run_id: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError>;

    fn run_failed(&self, run: &str, stage: &str, msg: &str) -> Result<(), EngineError>;

    /// One stage (or one branch of a group). `Some(output snapshot)` when it
    /// completed (now or before), `None` when it went to the dead letters.
    #[allow(clippy::too_many_arguments)]
    fn run_stage(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branch: &str,
        hypothesis: Option<&BTreeMap<String, String>>,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Option<String>, EngineError>;

    /// One attempt in `sandbox`: edits, commands (with the stage timeout and
    /// periodic checkpoints), then artifacts and the output snapshot.
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branch: &str,
        hypothesis: Option<&BTreeMap<String, String>>,
        sandbox: &cairn_engine::SandboxRecord,
        attempt: Attempt,
        watch: &dyn RunWatcher,
    ) -> Result<Outcome, EngineError>;

    /// After the connection to a stage's init was lost: waits until init
    /// answers again (a gvisor sandbox is checkpointed and restored under a
    /// running stage, its init quiescing meanwhile), or gives up with `lost`.
    fn wait_for_init(
        &self,
        client: &cairn_sandbox::client::InitClient,
        sandbox: &cairn_engine::SandboxRecord,
        lost: cairn_sandbox::client::ClientError,
    ) -> Result<(), EngineError>;

    /// The sandbox if it runs and its init answers.
    fn live_sandbox(&self, id: &str) -> Option<cairn_engine::SandboxRecord>;
}

impl RunSteps for Engine {
    fn lock_run(&self, run: &str) -> Result<Flock<fs::File>, EngineError> {
        let dir = self.run_dir(run);
        fs::create_dir_all(&dir).map_err(|e| RunError::Read(dir.clone(), e))?;
        let path = dir.join("orchestrator.lock");
        let file = fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| RunError::Read(path.clone(), e))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(lock),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(RunError::Busy {
                run: run.to_string(),
                pid: self.run_orchestrator(run),
            }
            .into()),
            Err((_, e)) => Err(RunError::Read(path, e.into()).into()),
        }
    }

    fn execute_locked_run(&mut self, run_id: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError> {
        // The sandboxes, snapshots and images its stages make are the
        // run's tenant's, wherever the run goes on.
        self.as_owner_of(cairn_engine::tenants::Owned::Run, run_id, |e| {
            e.execute_owned_run(run_id, watch)
        })
    }

    fn execute_owned_run(&mut self, run_id: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError> {
        let run = self.run_record(run_id)?;
        if run.status == "completed" {
            return Err(RunError::Completed(run.id).into());
        }
        let parsed = self.parsed_run(&run)?;
        self.check_model_for(Some(&run.id), &parsed)?;
        fs::create_dir_all(self.run_dir(&run.id)).map_err(|e| RunError::Read(self.run_dir(&run.id), e))?;
        if run.status != "running" {
            self.db().finish_run(&run.id, "running", None, 0)?;
        }
        let mut outputs: BTreeMap<String, String> = BTreeMap::new();
        // A retry a decision asks for starts over from the records: stages
        // completed are not run again, and recorded decisions apply again.
        'again: loop {
            let mut pipeline = parsed.clone();
            outputs.clear();
            for i in 0..pipeline.stages.len() {
                let stage = pipeline.stages[i].clone();
                let input = match &stage.after {
                    v if v.is_empty() => pipeline.snapshot.clone(),
                    v => Some(outputs.get(&v[0]).cloned().expect("stages come after their inputs")),
                };
                if stage.approve {
                    match self.approval_gate(&run, &pipeline, &stage, input.as_deref(), watch)? {
                        Gate::Open => {}
                        Gate::Waiting => return self.run_record(&run.id),
                        Gate::Rejected(why) => {
                            let msg = format!("stage {} was {why}", stage.name);
                            self.db().finish_run(&run.id, "failed", Some(&msg), now_ms())?;
                            return self.run_record(&run.id);
                        }
                    }
                }
                if let Some(d) = &stage.decide {
                    match self.decide_stage(&run, &pipeline, &stage, d, input.as_deref(), watch)? {
                        Step::Apply(answer) => {
                            pipeline.params.extend(answer.params.unwrap_or_default());
                            if let (Some(next), Some(hypotheses)) = (&d.next, answer.hypotheses) {
                                if let Some(b) = pipeline
                                    .stages
                                    .iter_mut()
                                    .find(|s| &s.name == next)
                                    .and_then(|s| s.branches.as_mut())
                                {
                                    b.hypotheses = hypotheses;
                                }
                            }
                            outputs.insert(stage.name.clone(), input.unwrap_or_default());
                            continue;
                        }
                        Step::Restart => continue 'again,
                        Step::Stop => {
                            let record = self.run_record(&run.id)?;
                            if record.status != "failed" {
                                let msg = format!("stage {} went to the dead-letter queue", stage.name);
                                self.db().finish_run(&run.id, "failed", Some(&msg), now_ms())?;
                                self.run_failed(&run.id, &stage.name, &msg)?;
                            }
                            return self.run_record(&run.id);
                        }
                    }
                }
                let result = match &stage.branches {
                    None => self.run_stage(&run, &pipeline, &stage, "", None, input.as_deref(), watch)?,
                    Some(b) if b.select == Selection::Deferred => {
                        // Ends the pipeline (the parser checks nothing comes after).
                        self.run_deferred_branches(&run, &pipeline, &stage, b, input.as_deref(), watch)?;
                        continue;
                    }
                    Some(b) => self.run_branches(&run, &pipeline, &stage, b, input.as_deref(), watch)?,
                };
                match result {
                    Some(output) => {
                        outputs.insert(stage.name.clone(), output);
                    }
                    None => {
                        let msg = format!("stage {} went to the dead-letter queue", stage.name);
                        self.db().finish_run(&run.id, "failed", Some(&msg), now_ms())?;
                        self.run_failed(&run.id, &stage.name, &msg)?;
                        return self.run_record(&run.id);
                    }
                }
            }
            break;
        }
        self.db().finish_run(&run.id, "completed", None, now_ms())?;
        let last = outputs.values().last().map(|s| s.as_str());
        let done = EventData::RunCompleted {
            output_snapshot: last.map(str::to_string),
        };
        self.db()
            .event_typed(&run.id, None, None, &NewEvent::typed(done, last))?;
        self.run_record(&run.id)
    }

    fn run_failed(&self, run: &str, stage: &str, msg: &str) -> Result<(), EngineError> {
        let failed = EventData::RunFailed { error: msg.to_string() };
        Ok(self
            .db()
            .event_typed(run, Some(stage), None, &NewEvent::typed(failed, None))?)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_stage(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branch: &str,
        hypothesis: Option<&BTreeMap<String, String>>,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Option<String>, EngineError> {
        let key = render(&stage.key, p, stage, hypothesis);
        // The parser checked both; a run recorded by an older Cairn is
        // checked here, before a sandbox starts or either becomes a path.
        for (what, name) in [("stage name", stage.name.as_str()), ("branch name", branch)] {
            if !name.is_empty() {
                cairn_engine::names::check(what, name).map_err(RunError::BadName)?;
            }
        }
        let existing = self.db().stage(&run.id, &stage.name, branch)?;
        if let Some(done) = existing.as_ref().filter(|s| s.status == "completed") {
            return Ok(done.output_snapshot.clone());
        }
        if existing.as_ref().is_some_and(|s| s.status == "dead") {
            return Ok(None);
        }
        let mut rec = existing
            .clone()
            .unwrap_or_else(|| StageRecord::pending(&run.id, &stage.name, branch, &key, input));
        // A row written before the stage ran (waiting for approval) has no key yet.
        rec.stage_key = key.clone();
        // A completed key returns its recorded output without running anything.
        if let Some((output, from_run, metric)) = self.db().completed_key(&key)? {
            rec.status = "completed".into();
            rec.output_snapshot = Some(output.clone());
            rec.metric = metric;
            rec.ended_at = Some(now_ms());
            let reused = NewEvent::typed(
                EventData::Reused {
                    stage_key: key.clone(),
                    from_run,
                    output_snapshot: output.clone(),
                },
                Some(&output),
            );
            let detail = reused.detail.clone();
            self.db_mut().put_stage_event(&rec, reused)?;
            watch.stage(&stage.name, branch, "reused", &detail);
            return Ok(Some(output));
        }
        // An attempt cut short (the orchestrator died) goes on in its
        // sandbox if that still runs: its commands are init's jobs, which
        // outlived the orchestrator. Otherwise it is discarded with its
        // sandbox and the stage resumes from its newest checkpoint.
        let mut reattach = None;
        if let Some(sandbox) = rec.sandbox_id.take().filter(|_| rec.status == "running") {
            // A memory checkpoint the orchestrator died in is finished first.
            self.settle_window(&run.id, &stage.name, branch, &sandbox)?;
            match self.live_sandbox(&sandbox) {
                Some(sb) => {
                    self.db().event(
                        &run.id,
                        Some(&stage.name),
                        Some(branch),
                        "reattached",
                        &format!("attempt {} goes on in sandbox {sandbox}", rec.attempts),
                        None,
                    )?;
                    watch.stage(&stage.name, branch, "running", "re-attached to its sandbox");
                    rec.sandbox_id = Some(sandbox);
                    reattach = Some(sb);
                }
                None => {
                    // It did not fail: the orchestrator stopped. It costs no retry.
                    rec.attempts = rec.attempts.saturating_sub(1);
                    if let Ok(sb) = self.sandbox(&sandbox) {
                        let _ = self.remove_sandbox(&sb, true);
                    }
                    self.db().event(
                        &run.id,
                        Some(&stage.name),
                        Some(branch),
                        "resumed",
                        &format!("discarded the interrupted attempt in sandbox {sandbox}"),
                        None,
                    )?;
                }
            }
        }
        // A stage gets 1 + retries attempts each time it starts afresh (new,
        // or retried from the dead-letter queue); attempts keep counting.
        let limit = if rec.status == "pending" { rec.attempts } else { 0 } + stage.retries + 1;
        loop {
            // While this attempt runs, this process's worker does not reap
            // its sandbox, even once its claim has moved on: the attempt
            // ends itself (its outcome refused by the fence).
            let mut _attempt: Option<crate::attempts::Attempt> = None;
            let (sandbox, fresh, reattached, began_ms) = match reattach.take() {
                Some(sb) => {
                    let fresh = self.db().newest_checkpoint(&run.id, &stage.name, branch)?.is_none();
                    // The attempt began with its newest `forked` or `retry` event.
                    let began_ms = self
                        .db()
                        .events_of(&run.id)?
                        .iter()
                        .rev()
                        .find(|e| {
                            e.stage.as_deref() == Some(stage.name.as_str())
                                && e.branch.as_deref().unwrap_or("") == branch
                                && (e.kind == "forked" || e.kind == "retry")
                        })
                        .map(|e| e.created_at);
                    (sb, fresh, true, began_ms)
                }
                None => {
                    if rec.attempts >= limit {
                        break;
                    }
                    rec.attempts += 1;
                    let checkpoint = self.db().newest_checkpoint(&run.id, &stage.name, branch)?;
                    let from = checkpoint.clone().or(input.map(str::to_string));
                    // Owned by this process until the stage row names it: if
                    // the process dies before, the next Cairn command removes it.
                    let opts = CreateOptions {
                        image: p.image.clone(),
                        driver: p.driver.clone(),
                        auto_remove: true,
                        network: Some(stage.network.clone().unwrap_or_else(|| p.network.clone())),
                        ..CreateOptions::default()
                    };
                    let making = Instant::now();
                    let sandbox = match &from {
                        Some(snap) => {
                            let snap = self.snapshot_record(snap)?;
                            self.restore(&snap, &opts)?
                        }
                        None => self.create_sandbox(&opts, &Silent)?,
                    };
                    // Under a queue claim, the claim is recorded with the
                    // sandbox: once it moves on (a takeover), the sandbox
                    // is an orphan its home reaps (`Engine::reap_orphans`).
                    if let Some(fence) = self.db().fence() {
                        self.db()
                            .record_claimed_sandbox(&sandbox.id, &fence, &run.id, &stage.name, branch)?;
                        _attempt = Some(crate::attempts::Attempt::start(&fence, &sandbox));
                    }
                    rec.status = "running".into();
                    rec.sandbox_id = Some(sandbox.id.clone());
                    let began = NewEvent::typed(
                        EventData::Attempt {
                            attempt: rec.attempts,
                            parent_snapshot: from.clone(),
                            checkpoint: checkpoint.clone(),
                            image: from
                                .is_none()
                                .then(|| p.image.clone().unwrap_or_else(|| "busybox".into())),
                            restore_ms: ms(making.elapsed()),
                        },
                        from.as_deref(),
                    );
                    let detail = began.detail.clone();
                    self.db_mut().put_stage_event(&rec, began)?;
                    // The stage row owns the sandbox now: it outlives this
                    // process, and a resume re-attaches to it.
                    self.db().set_auto_remove(&sandbox.id, false)?;
                    watch.stage(&stage.name, branch, "running", &detail);
                    (sandbox, checkpoint.is_none(), false, None)
                }
            };
            let outcome = self.attempt(
                run,
                p,
                stage,
                branch,
                hypothesis,
                &sandbox,
                Attempt {
                    fresh,
                    number: rec.attempts,
                    reattached,
                    began_ms,
                },
                watch,
            )?;
            // The outcome is recorded, and in the same transaction this
            // process owns the sandbox again, before it is removed: a resume
            // never finds a finished attempt without its sandbox (it would
            // run the attempt's commands again on its newest checkpoint), and
            // dying before the removal leaves the sandbox to the next Cairn
            // command to remove.
            rec.sandbox_id = None;
            let release = Some((sandbox.id.as_str(), cairn_engine::sandboxes::me()));
            let remove = |engine: &mut Engine| -> Result<(), EngineError> {
                if let Ok(sb) = engine.sandbox(&sandbox.id) {
                    engine.remove_sandbox(&sb, true)?;
                }
                Ok(())
            };
            // Under a queue claim, an outcome that is refused (the claim
            // moved on) leaves nothing: this worker's sandbox goes with it.
            let fenced = |engine: &mut Engine, e: EngineError| -> EngineError {
                if matches!(e, EngineError::State(cairn_engine::state::StateError::Fenced { .. })) {
                    let _ = remove(engine);
                }
                e
            };
            match outcome {
                Outcome::Succeeded { output, metric, spent } => {
                    rec.status = "completed".into();
                    rec.output_snapshot = Some(output.clone());
                    rec.metric = metric;
                    rec.error = None;
                    rec.ended_at = Some(now_ms());
                    let completed = NewEvent::typed(
                        EventData::StageCompleted {
                            attempt: rec.attempts,
                            output_snapshot: output.clone(),
                            setup_ms: spent.setup_ms,
                            compute_ms: spent.compute_ms,
                            snapshot_ms: spent.snapshot_ms,
                            artifacts_ms: spent.artifacts_ms,
                            state_bytes: spent.state_bytes,
                            artifact_bytes: spent.artifact_bytes,
                            command_ms: spent.command_ms,
                            metric,
                        },
                        Some(&output),
                    );
                    let detail = completed.detail.clone();
                    self.durable_for_queue(&[&output])?;
                    self.artifacts_durable_for_queue(&run.id, &stage.name, branch)?;
                    self.db_mut()
                        .put_stage_releasing(&rec, Some(completed), release)
                        .map_err(|e| fenced(self, e.into()))?;
                    remove(self)?;
                    if !branch.is_empty() {
                        self.db().complete_key(&rec, now_ms())?;
                    }
                    watch.stage(&stage.name, branch, "completed", &detail);
                    return Ok(Some(output));
                }
                Outcome::Failed {
                    error,
                    failure_snapshot,
                    spent,
                } => {
                    rec.status = "failed".into();
                    rec.error = Some(error.clone());
                    if let Some(f) = &failure_snapshot {
                        self.durable_for_queue(&[f])?;
                    }
                    let failed = NewEvent::typed(
                        EventData::StageFailed {
                            attempt: rec.attempts,
                            error: error.clone(),
                            failure_snapshot: failure_snapshot.clone(),
                            setup_ms: spent.setup_ms,
                            compute_ms: spent.compute_ms,
                        },
                        failure_snapshot.as_deref(),
                    );
                    self.db_mut()
                        .put_stage_releasing(&rec, Some(failed), release)
                        .map_err(|e| fenced(self, e.into()))?;
                    remove(self)?;
                    watch.stage(&stage.name, branch, "failed", &error);
                    if rec.attempts >= limit {
                        rec.status = "dead".into();
                        rec.ended_at = Some(now_ms());
                        let dl = DeadLetter {
                            id: new_id(12),
                            run_id: run.id.clone(),
                            stage: stage.name.clone(),
                            branch: branch.to_string(),
                            error: error.clone(),
                            failure_snapshot,
                            input_snapshot: input.map(str::to_string),
                            created_at: now_ms(),
                            retried_at: None,
                        };
                        self.db().insert_dead_letter(&dl)?;
                        let dead = NewEvent::typed(
                            EventData::Dead {
                                attempts: rec.attempts,
                                dead_letter: dl.id.clone(),
                                error: error.clone(),
                                failure_snapshot: dl.failure_snapshot.clone(),
                            },
                            dl.failure_snapshot.as_deref(),
                        );
                        let detail = dead.detail.clone();
                        self.db_mut().put_stage_event(&rec, dead)?;
                        watch.stage(&stage.name, branch, "dead", &detail);
                        return Ok(None);
                    }
                }
            }
        }
        Ok(None)
    }

    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branch: &str,
        hypothesis: Option<&BTreeMap<String, String>>,
        sandbox: &cairn_engine::SandboxRecord,
        Attempt {
            fresh,
            number: attempt,
            reattached,
            began_ms,
        }: Attempt,
        watch: &dyn RunWatcher,
    ) -> Result<Outcome, EngineError> {
        let client = self.client(sandbox)?;
        let log_name = if branch.is_empty() {
            format!("{}.log", stage.name)
        } else {
            format!("{}.{branch}.log", stage.name)
        };
        let mut log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.run_dir(&run.id).join(log_name))
            .map_err(|e| RunError::Read(self.run_dir(&run.id), e))?;
        let mut cost = Spent::default();
        let mut clock = Instant::now();
        let fail = |engine: &mut Engine, error: String, cost: Spent| -> Result<Outcome, EngineError> {
            let failure_snapshot = engine
                .sandbox(&sandbox.id)
                .ok()
                .and_then(|sb| engine.snapshot(&sb, None).ok())
                .map(|s| s.id);
            Ok(Outcome::Failed {
                error,
                failure_snapshot,
                spent: cost,
            })
        };
        // Named by stage, not attempt: a retry restored from a memory
        // checkpoint finds the commands that were running in it, and
        // follows them on from where they were.
        let job = |i: usize| format!("{}.{}.{branch}.{i}", run.id, stage.name);
        // Edits go first; a re-attached attempt whose first command started
        // has them already.
        let started = reattached && client.attach_job(&job(0), u64::MAX, u64::MAX)?.is_some();
        if fresh && !started {
            for edit in &stage.edits {
                // A path a hypothesis names; an empty one writes nothing.
                let path = render(&edit.path, p, stage, hypothesis);
                if path.is_empty() {
                    continue;
                }
                if !path.starts_with('/') {
                    return fail(
                        self,
                        format!("edit path {path:?} (from {:?}) is not absolute", edit.path),
                        cost,
                    );
                }
                let parent = Path::new(&path)
                    .parent()
                    .map(|d| d.to_string_lossy().into_owned())
                    .unwrap_or("/".into());
                let mkdir = ExecRequest {
                    argv: vec!["mkdir".into(), "-p".into(), parent],
                    ..ExecRequest::default()
                };
                if let Ok(s) = client.exec(mkdir)? {
                    s.wait(&mut std::io::sink(), &mut std::io::sink())?;
                }
                let content = render(&edit.content, p, stage, hypothesis);
                let meta = FileMeta {
                    path: path.clone(),
                    kind: FileKind::File,
                    mode: edit.mode,
                    uid: 0,
                    gid: 0,
                    size: content.len() as u64,
                    mtime_ns: now_ms() as i128 * 1_000_000,
                };
                if let Err(e) = client.put_file(meta, &mut content.as_bytes()) {
                    return fail(self, format!("edit {path}: {e}"), cost);
                }
            }
        }
        cost.setup_ms = ms(clock.elapsed());
        clock = Instant::now();
        // Periodic checkpoints from a thread with its own engine.
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let checkpointer = stage.checkpoint_every.map(|every| {
            let home = self.home().clone();
            let fence = self.db().fence();
            let (run_id, stage_name, branch, sandbox_id) = (
                run.id.clone(),
                stage.name.clone(),
                branch.to_string(),
                sandbox.id.clone(),
            );
            let share = stage.checkpoint_share;
            std::thread::spawn(move || {
                checkpoint_loop(
                    home,
                    fence,
                    every,
                    share,
                    stop_rx,
                    &run_id,
                    &stage_name,
                    &branch,
                    &sandbox_id,
                )
            })
        });
        // A re-attached attempt keeps the deadline it began with (its running
        // command keeps its own inside init); the rest get what is left.
        let spent = began_ms.map_or(Duration::ZERO, |b| Duration::from_millis((now_ms() - b).max(0) as u64));
        let deadline = stage.timeout.map(|t| Instant::now() + t.saturating_sub(spent));
        let mut output = Tail::default();
        let mut failure = None;
        for (i, cmd) in stage.run.iter().enumerate() {
            let cmd_began = Instant::now();
            let cmd = render(cmd, p, stage, hypothesis);
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                failure = Some(format!(
                    "timed out after {:?} before command {}",
                    stage.timeout.unwrap_or_default(),
                    i + 1
                ));
                break;
            }
            // Each command is a job of init's: it outlives this process (and
            // a memory checkpoint), and a resumed orchestrator follows it
            // from the start of its output. A connection that a checkpoint
            // ends (gvisor quiesces init) is followed again from the bytes
            // already seen.
            let mut err_log = log.try_clone().map_err(|e| RunError::Read(self.run_dir(&run.id), e))?;
            let (mut out_seen, mut err_seen, mut started) = (0, 0, false);
            let status = loop {
                let seen = (out_seen, err_seen);
                let session = match client.attach_job(&job(i), seen.0, seen.1) {
                    Ok(Some(s)) => {
                        if !started && seen == (0, 0) {
                            let note = format!(
                                "[cairn: re-attached to command {}; its output follows from the start]\n",
                                i + 1
                            );
                            let _ = log.write_all(note.as_bytes());
                        }
                        started = true;
                        s
                    }
                    Ok(None) if !started => {
                        let req = ExecRequest {
                            argv: vec!["/bin/sh".into(), "-c".into(), cmd.clone()],
                            env: vec![
                                ("CAIRN_RUN".into(), run.id.clone()),
                                ("CAIRN_STAGE".into(), stage.name.clone()),
                                ("CAIRN_BRANCH".into(), branch.into()),
                                ("CAIRN_ATTEMPT".into(), attempt.to_string()),
                            ],
                            timeout_ms: left.map(|l| l.as_millis() as u64),
                            ..ExecRequest::default()
                        };
                        if let Err(f) = client.start_job(&job(i), req)? {
                            break Err(format!("command {} did not start: {}", i + 1, f.message));
                        }
                        started = true;
                        continue;
                    }
                    Ok(None) => {
                        return Err(RunError::Lost(format!("the sandbox's init lost job {}", job(i))).into());
                    }
                    Err(e) if lost(&e) => {
                        self.wait_for_init(&client, sandbox, e)?;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                let waited = session.wait(
                    &mut Tee {
                        log: &mut log,
                        seen: &mut out_seen,
                        tail: Some(&mut output),
                        watch,
                        stage: &stage.name,
                        branch,
                    },
                    &mut Tee {
                        log: &mut err_log,
                        seen: &mut err_seen,
                        tail: None,
                        watch,
                        stage: &stage.name,
                        branch,
                    },
                );
                match waited {
                    Ok(status) => break Ok(status),
                    Err(e) if lost(&e) => self.wait_for_init(&client, sandbox, e)?,
                    Err(e) => return Err(e.into()),
                }
            };
            let status = match status {
                Ok(status) => status,
                Err(message) => {
                    failure = Some(message);
                    break;
                }
            };
            match status {
                Some(s) if s.code == Some(0) => {}
                Some(s) if s.timed_out => {
                    failure = Some(format!(
                        "command {} timed out after {:?}",
                        i + 1,
                        stage.timeout.unwrap_or_default()
                    ));
                    break;
                }
                Some(s) => {
                    failure = Some(format!(
                        "command {} `{cmd}` exited with status {}",
                        i + 1,
                        s.shell_code()
                    ));
                    break;
                }
                None => {}
            }
            cost.command_ms.push(ms(cmd_began.elapsed()));
        }
        drop(stop_tx);
        if let Some(t) = checkpointer {
            let _ = t.join();
        }
        cost.compute_ms = ms(clock.elapsed());
        if let Some(error) = failure {
            return fail(self, error, cost);
        }
        let metric = match stage.branches.as_ref().map(|b| &b.select) {
            Some(Selection::Min(m)) | Some(Selection::Max(m)) => match m {
                Metric::Output => number(&output.text(), true),
                Metric::File(path) => {
                    let mut file = Capped::default();
                    match client.get_file(path, &mut file) {
                        Ok(_) => number(&String::from_utf8_lossy(&file.bytes), false),
                        Err(_) if file.over => {
                            return fail(self, RunError::MetricTooLarge(path.clone()).to_string(), cost)
                        }
                        // No metric file: the branch has no metric and cannot win on one.
                        Err(_) => None,
                    }
                }
            },
            _ => None,
        };
        let sb = self.sandbox(&sandbox.id)?;
        clock = Instant::now();
        let out = self.snapshot(
            &sb,
            Some(&format!(
                "{}/{}{}",
                run.id,
                stage.name,
                if branch.is_empty() {
                    String::new()
                } else {
                    format!("/{branch}")
                }
            )),
        )?;
        cost.snapshot_ms = ms(clock.elapsed());
        cost.state_bytes = out.new_bytes;
        clock = Instant::now();
        for path in &stage.artifacts {
            match self.collect_artifact(&client, run, stage, branch, path, &out.id) {
                Ok(size) => cost.artifact_bytes += size,
                Err(e) => return fail(self, format!("artifact {path}: {e}"), cost),
            }
        }
        cost.artifacts_ms = ms(clock.elapsed());
        Ok(Outcome::Succeeded {
            output: out.id,
            metric,
            spent: cost,
        })
    }

    fn wait_for_init(
        &self,
        client: &cairn_sandbox::client::InitClient,
        sandbox: &cairn_engine::SandboxRecord,
        lost: cairn_sandbox::client::ClientError,
    ) -> Result<(), EngineError> {
        let patience = if sandbox.driver == "gvisor" {
            Duration::from_secs(120)
        } else {
            Duration::from_secs(5)
        };
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if client.ping(Duration::from_secs(1)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(lost.into())
    }

    fn live_sandbox(&self, id: &str) -> Option<cairn_engine::SandboxRecord> {
        let sb = self.sandbox(id).ok()?;
        let client = self.client(&sb).ok()?;
        client.ping(Duration::from_secs(5)).ok()?;
        Some(sb)
    }
}

/// Takes a checkpoint every `every` until `stop`, but never more often than
/// keeps checkpoints within `share` percent of the stage's time: after one
/// that took `d`, the next waits at least `d * (100 - share) / share`. Each
/// checkpoint's event says what it took and the share so far.
#[allow(clippy::too_many_arguments)]
fn checkpoint_loop(
    home: Home,
    fence: Option<crate::queue::Fence>,
    every: Duration,
    share: u8,
    stop: mpsc::Receiver<()>,
    run: &str,
    stage: &str,
    branch: &str,
    sandbox: &str,
) {
    let began = Instant::now();
    let mut spent = Duration::ZERO;
    let mut wait = every;
    let share = f64::from(share.clamp(1, 50)) / 100.0;
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(wait) {
        let Ok(mut engine) = Engine::open(home.clone()) else {
            return;
        };
        engine.db().set_fence(fence.clone());
        let Ok(sb) = engine.sandbox(sandbox) else { return };
        let started = Instant::now();
        let taken = engine.snapshot(
            &sb,
            Some(&format!(
                "{run}/{stage}{}/checkpoint",
                if branch.is_empty() {
                    String::new()
                } else {
                    format!("/{branch}")
                }
            )),
        );
        let took = started.elapsed();
        spent += took;
        wait = every.max(took.mul_f64((1.0 - share) / share));
        match taken {
            // Under a queue claim, a checkpoint counts once every host can
            // restore it.
            Ok(snap) => match engine.durable_for_queue(&[&snap.id]) {
                Ok(()) => {
                    let event = NewEvent::typed(
                        EventData::Checkpoint {
                            snapshot: snap.id.clone(),
                            took_ms: ms(took),
                            state_bytes: snap.new_bytes,
                            share_percent: 100.0 * spent.as_secs_f64() / began.elapsed().as_secs_f64().max(1e-3),
                            limit_percent: share * 100.0,
                            next_in_ms: ms(wait),
                        },
                        None,
                    );
                    let _ =
                        engine
                            .db()
                            .add_checkpoint_event(run, stage, branch, &snap.id, cairn_engine::now_ms(), &event);
                }
                Err(e) => tracing::warn!(stage, "checkpoint not recorded: {e}"),
            },
            Err(e) => tracing::warn!(stage, "checkpoint failed: {e}"),
        }
    }
}

/// Which attempt of a stage runs, and how.
pub(crate) struct Attempt {
    /// Started from the stage's input (not a checkpoint): edits apply.
    fresh: bool,
    number: u32,
    /// Resumed in the sandbox of an orchestrator that died.
    reattached: bool,
    /// When the attempt began (ms since the epoch), if before this process:
    /// the stage timeout counts from then.
    began_ms: Option<i64>,
}

/// Whether a client error means the connection went away (init quiesced
/// for a checkpoint, or the sandbox died) rather than a refusal.
fn lost(e: &cairn_sandbox::client::ClientError) -> bool {
    use cairn_sandbox::client::ClientError;
    matches!(
        e,
        ClientError::NotRunning(_) | ClientError::Frame(_) | ClientError::Io(_) | ClientError::TimedOut
    )
}
