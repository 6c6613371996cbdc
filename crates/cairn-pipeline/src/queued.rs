//! Runs through the shared stage queue: a worker's side of a run (the
//! orchestration under the run's claim, each branch of a group as a job any
//! worker takes) and the enqueuing host's side (queue, then follow).
//!
//! A stage's outputs and checkpoints cross hosts through the remote chunk
//! store, so under a claim nothing is committed that another host could
//! not read: the snapshots a commit names are confirmed remote first.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::error::RunError;
use crate::prelude::*;
use crate::queue::Job;
use crate::records::{RunRecord, StageRecord};
use crate::render::render;
use crate::spec::{self, Branches, Pipeline, Stage};
use crate::steps::*;
use crate::watch::RunWatcher;
use cairn_engine::state::StateError;
use cairn_engine::{Engine, EngineError};

/// What a branch job carries: the hypothesis and the params it runs with
/// (a decide stage before the group may have chosen either).
#[derive(serde::Serialize, serde::Deserialize)]
struct BranchPayload {
    params: BTreeMap<String, String>,
    hypothesis: BTreeMap<String, String>,
}

/// How long a commit under a claim waits for its snapshots to be remote.
const DURABLE_WAIT: Duration = Duration::from_secs(600);

/// Runs through the shared stage queue: a worker's side and the enqueuer's.
pub trait QueuedRuns {
    /// Queues a run for `cairn worker`s (any host on this state store).
    fn enqueue_run(&self, run: &str) -> Result<RunRecord, EngineError>;

    /// A worker's side of a run job: the run orchestrated under its claim.
    fn execute_queued_run(&mut self, run: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError>;

    /// A worker's side of a branch job: the branch run as one stage,
    /// fenced by the job's claim.
    fn run_branch_job(&mut self, job: &Job, watch: &dyn RunWatcher) -> Result<Option<String>, EngineError>;

    /// Follows a queued run from any host: its events as they are recorded,
    /// until it ends (completed, failed, or waiting for approval) or
    /// `timeout` passes. Returns the run's record then.
    fn follow_run(
        &self,
        run: &str,
        timeout: Option<Duration>,
        each: impl FnMut(&crate::records::EventRecord),
    ) -> Result<RunRecord, EngineError>;
}

impl QueuedRuns for Engine {
    fn enqueue_run(&self, run: &str) -> Result<RunRecord, EngineError> {
        let rec = self.run_record(run)?;
        if rec.status == "completed" {
            return Err(RunError::Completed(rec.id).into());
        }
        self.db().enqueue_run(&rec.id)?;
        self.db()
            .event(&rec.id, None, None, "queued", "queued for any worker", None)?;
        Ok(rec)
    }

    fn execute_queued_run(&mut self, run: &str, watch: &dyn RunWatcher) -> Result<RunRecord, EngineError> {
        let rec = self.run_record(run)?;
        if rec.status == "completed" {
            return Ok(rec);
        }
        let _orchestrating = self.lock_run(&rec.id)?;
        self.execute_locked_run(&rec.id, watch)
    }

    fn run_branch_job(&mut self, job: &Job, watch: &dyn RunWatcher) -> Result<Option<String>, EngineError> {
        self.as_owner_of(cairn_engine::tenants::Owned::Run, &job.run_id, |e| {
            e.run_owned_branch_job(job, watch)
        })
    }

    fn follow_run(
        &self,
        run: &str,
        timeout: Option<Duration>,
        mut each: impl FnMut(&crate::records::EventRecord),
    ) -> Result<RunRecord, EngineError> {
        let started = Instant::now();
        let mut seen = 0;
        loop {
            let events = self.db().events_of(run)?;
            let last = seen;
            for e in events.iter().filter(|e| e.seq > last) {
                each(e);
                seen = e.seq;
            }
            // The job is read first: a worker records the run's end before
            // the job's, so a job ended with its run still open is one the
            // worker gave up on (an error it reported); `resume` queues it again.
            let job_ended = self.db().job(run)?.is_some_and(|j| j.status == "done");
            let rec = self.run_record(run)?;
            let done = matches!(rec.status.as_str(), "completed" | "failed" | "awaiting_approval");
            let abandoned = !done && job_ended;
            if done || abandoned || timeout.is_some_and(|t| started.elapsed() >= t) {
                return Ok(rec);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

pub(crate) trait QueuedSteps {
    /// The queue's hold on a run another worker executes now, as the
    /// refusal a local `resume` gets; `None` when no live claim holds it.
    fn claimed_elsewhere(&self, run: &str) -> Result<Option<RunError>, EngineError>;

    /// Under a claim, waits until every snapshot `ids` names is in the
    /// remote store (a home without one has nothing to wait for).
    fn durable_for_queue(&self, ids: &[&str]) -> Result<(), EngineError>;

    /// Under a claim on a remote store: waits until every object the
    /// attempt's pending artifacts need (each artifact's chunk list and its
    /// chunks) is in the remote store, so that their commit with the stage
    /// never names bytes another host cannot read; else the stage is lost
    /// here, as for its snapshots.
    fn artifacts_durable_for_queue(&self, run: &str, stage: &str, branch: &str) -> Result<(), EngineError>;

    /// A branch group under a claim: each open branch becomes a job any
    /// worker takes, and this run waits (lending its slot) until each has
    /// completed or dead-lettered.
    #[allow(clippy::too_many_arguments)]
    fn run_each_branch_queued(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError>;

    fn run_owned_branch_job(&mut self, job: &Job, watch: &dyn RunWatcher) -> Result<Option<String>, EngineError>;

    /// The run's pipeline, parsed again with the run's params.
    fn parsed_run(&self, run: &RunRecord) -> Result<Pipeline, EngineError>;
}

impl QueuedSteps for Engine {
    fn claimed_elsewhere(&self, run: &str) -> Result<Option<RunError>, EngineError> {
        if self.db().fence().is_some() {
            return Ok(None);
        }
        // A job not ended belongs to the workers: queued, held, or held
        // under an expired lease that the next worker's claim takes over.
        Ok(self
            .db()
            .job(run)?
            .filter(|j| j.status != "done")
            .map(|j| RunError::Queued {
                run: run.to_string(),
                worker: match (j.status.as_str(), j.worker) {
                    ("claimed", Some(w)) => format!("worker {w}"),
                    _ => "no worker yet".to_string(),
                },
            }))
    }

    fn durable_for_queue(&self, ids: &[&str]) -> Result<(), EngineError> {
        if self.db().fence().is_none() || !self.store().backend().is_remote() {
            return Ok(());
        }
        self.mark_remote_durable_ids(ids, DURABLE_WAIT)?;
        for id in ids {
            if self.remote_durable_at(id)?.is_none() {
                return Err(RunError::Lost(format!(
                    "snapshot {id} is not in the remote store yet, so no other host could use it; \
                     check the store's reachability (the stage resumes from its newest checkpoint)"
                ))
                .into());
            }
        }
        Ok(())
    }

    fn artifacts_durable_for_queue(&self, run: &str, stage: &str, branch: &str) -> Result<(), EngineError> {
        let backend = self.store().backend();
        if self.db().fence().is_none() || !backend.is_remote() {
            return Ok(());
        }
        let mut needed = Vec::new();
        for a in self.db().pending_artifacts(run, stage, branch)? {
            let hash: cairn_store::ChunkHash = a.id.parse().map_err(|_| RunError::NoSuchArtifact(a.id.clone()))?;
            let context = cairn_store::ReadContext::new()
                .owner("artifact", hash)
                .path(a.path.clone());
            let object: crate::artifacts::ArtifactObject = self
                .store()
                .get_object(&hash, &context)
                .map_err(cairn_engine::SnapshotError::from)?;
            needed.push(hash);
            needed.extend(object.content.chunk_hashes());
        }
        if needed.is_empty() {
            return Ok(());
        }
        let missing = self.not_yet_remote(needed, DURABLE_WAIT)?;
        if !missing.is_empty() {
            return Err(RunError::Lost(format!(
                "{} objects of stage {stage}'s artifacts are not in the remote store yet, so no other host \
                 could read them; check the store's reachability (the stage resumes from its newest checkpoint)",
                missing.len()
            ))
            .into());
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run_each_branch_queued(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError> {
        let fence = self.db().fence().expect("called under a claim");
        let ended = |s: &StageRecord| s.status == "completed" || s.status == "dead";
        let mut open = Vec::new();
        for h in &branches.hypotheses {
            let name = h.get("name").cloned().unwrap_or_default();
            let row = self.db().stage(&run.id, &stage.name, &name)?;
            if row.as_ref().is_some_and(ended) {
                continue;
            }
            if row.is_none() {
                let key = render(&stage.key, p, stage, Some(h));
                self.db_mut()
                    .put_stage(&StageRecord::pending(&run.id, &stage.name, &name, &key, input), None)?;
            }
            let payload = serde_json::to_string(&BranchPayload {
                params: p.params.clone(),
                hypothesis: h.clone(),
            })
            .expect("maps of strings serialise");
            self.db().enqueue_branch(&run.id, &stage.name, &name, &payload)?;
            watch.stage(&stage.name, &name, "queued", "queued for any worker");
            open.push(name);
        }
        let _lent = self
            .extension::<std::sync::Arc<crate::worker::Slots>>()
            .map(|s| s.lend());
        while !open.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            let rows = self.db().stages_of(&run.id)?;
            open.retain(|b| !rows.iter().any(|s| s.stage == stage.name && &s.branch == b && ended(s)));
            match self.db().job(&fence.job)? {
                Some(j) if j.epoch == fence.epoch && j.status == "claimed" => {}
                _ => {
                    return Err(StateError::Fenced {
                        job: fence.job,
                        epoch: fence.epoch,
                    }
                    .into())
                }
            }
        }
        Ok(())
    }

    fn run_owned_branch_job(&mut self, job: &Job, watch: &dyn RunWatcher) -> Result<Option<String>, EngineError> {
        let run = self.run_record(&job.run_id)?;
        let mut pipeline = self.parsed_run(&run)?;
        // Its log goes beside the run's on this host.
        let dir = self.run_dir(&run.id);
        std::fs::create_dir_all(&dir).map_err(|e| RunError::Read(dir.clone(), e))?;
        let payload: BranchPayload = serde_json::from_str(&job.payload)
            .map_err(|e| RunError::Lost(format!("branch job {} carries no valid hypothesis: {e}", job.id)))?;
        pipeline.params = payload.params;
        let stage = pipeline
            .stages
            .iter()
            .find(|s| s.name == job.stage)
            .cloned()
            .ok_or_else(|| RunError::NoSuchStage(format!("run {} has no stage {}", run.id, job.stage)))?;
        let input = self
            .db()
            .stage(&run.id, &job.stage, &job.branch)?
            .and_then(|s| s.input_snapshot);
        self.run_stage(
            &run,
            &pipeline,
            &stage,
            &job.branch,
            Some(&payload.hypothesis),
            input.as_deref(),
            watch,
        )
    }

    fn parsed_run(&self, run: &RunRecord) -> Result<Pipeline, EngineError> {
        let overrides = run
            .params
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        Ok(spec::parse(&run.file, &run.spec, &overrides).map_err(RunError::from)?)
    }
}
