//! Stages that wait for a person: `approve = true` pauses a run before the
//! stage, once its input is ready, until `cairn pipeline approve RUN STAGE` (or
//! `reject`). Waiting is a record, not a process: the orchestrator writes
//! the stage as `awaiting_approval`, the run as `awaiting_approval`, and
//! exits. The verdict is recorded (who, why) before anything continues,
//! so a process killed between the two loses nothing: `cairn pipeline
//! resume` continues an approved run.

use crate::error::RunError;
use crate::lineage::EventData;
use crate::prelude::*;
use crate::records::{NewEvent, RunRecord, StageRecord};
use crate::render::render;
use crate::spec::{Pipeline, Stage};
use crate::steps::*;
use crate::watch::RunWatcher;
use cairn_engine::{now_ms, Engine, EngineError};

/// Stage status while a run waits for a person.
pub const AWAITING: &str = "awaiting_approval";
/// Stage status once approved and not yet run.
pub const APPROVED: &str = "approved";
/// Stage status once rejected: the run failed there.
pub const REJECTED: &str = "rejected";

/// The longest reason recorded with a verdict, in bytes.
pub const MAX_REASON: usize = 4096;

/// What a person decided about a stage waiting for approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Approve,
    Reject,
}

/// What the orchestrator does at a stage that must be approved.
pub(super) enum Gate {
    /// Approved (or done already): run the stage.
    Open,
    /// Recorded as waiting; the orchestrator stops here.
    Waiting,
    /// Rejected: the run fails with this message.
    Rejected(String),
}

/// The command that continues a run waiting at `stage`.
pub fn approve_command(run: &str, stage: &str) -> String {
    format!("cairn pipeline approve {run} {stage} [--reason TEXT]")
}

/// Approvals: a run paused before a stage until a person approves it.
pub trait RunApprovals {
    /// Records a person's verdict on a stage waiting for approval, under the
    /// run's orchestrator lock: approved, the stage is `approved` and the run
    /// `running` again (nothing executes it until the caller continues it:
    /// [`crate::run::Runs::execute_run`]); rejected, the stage is `rejected` and the
    /// run `failed`. Returns the run's record after the verdict.
    fn decide_approval(
        &mut self,
        run_key: &str,
        stage: &str,
        verdict: Verdict,
        by: &str,
        reason: Option<&str>,
    ) -> Result<RunRecord, EngineError>;

    /// The stage a run waits at for approval, if it does.
    fn awaiting_approval(&self, run: &str) -> Result<Option<String>, EngineError>;
}

impl RunApprovals for Engine {
    fn decide_approval(
        &mut self,
        run_key: &str,
        stage: &str,
        verdict: Verdict,
        by: &str,
        reason: Option<&str>,
    ) -> Result<RunRecord, EngineError> {
        let run = self.run_record(run_key)?;
        let reason = reason.map(str::trim).filter(|r| !r.is_empty());
        if let Some(r) = reason {
            if r.len() > MAX_REASON {
                return Err(RunError::BadReason(format!(
                    "the reason is {} bytes, over the {MAX_REASON}-byte limit; shorten it",
                    r.len()
                ))
                .into());
            }
        }
        if verdict == Verdict::Reject && reason.is_none() {
            return Err(RunError::BadReason("a rejection needs a reason: add --reason TEXT".into()).into());
        }
        let _orchestrating = self.lock_run(&run.id)?;
        let run = self.run_record(&run.id)?;
        let pipeline = self.parsed_run(&run)?;
        let Some(spec_stage) = pipeline.stages.iter().find(|s| s.name == stage) else {
            let names: Vec<&str> = pipeline.stages.iter().map(|s| s.name.as_str()).collect();
            return Err(RunError::NoSuchStage(format!(
                "run {} has no stage {stage:?}; its stages are {}",
                run.id,
                names.join(", ")
            ))
            .into());
        };
        if !spec_stage.approve {
            return Err(RunError::NotAwaitingApproval(format!(
                "stage {stage} of run {} does not ask for approval (only stages with approve = true do)",
                run.id
            ))
            .into());
        }
        let row = self.db().stage(&run.id, stage, "")?;
        let mut rec = match row {
            Some(r) if r.status == AWAITING => r,
            Some(r) if r.status == REJECTED => {
                return Err(RunError::NotAwaitingApproval(format!(
                    "stage {stage} of run {} was already rejected; start a new run to try again",
                    run.id
                ))
                .into())
            }
            Some(_) => {
                let next = if run.status == "completed" || run.status == "failed" {
                    format!("the run is {}", run.status)
                } else {
                    format!("`cairn pipeline resume {}` continues the run", run.id)
                };
                return Err(RunError::NotAwaitingApproval(format!(
                    "stage {stage} of run {} was already approved; {next}",
                    run.id
                ))
                .into());
            }
            None => {
                return Err(RunError::NotAwaitingApproval(format!(
                    "stage {stage} of run {} is not waiting for approval: the run has not reached it \
                     (`cairn pipeline show {}` shows where it is)",
                    run.id, run.id
                ))
                .into())
            }
        };
        let event = NewEvent::typed(
            EventData::Verdict {
                approved: verdict == Verdict::Approve,
                by: by.to_string(),
                reason: reason.map(str::to_string),
            },
            None,
        );
        match verdict {
            Verdict::Approve => {
                rec.status = APPROVED.into();
                self.db_mut().put_stage_and_run(&rec, event, "running", None, None)?;
            }
            Verdict::Reject => {
                let detail = event.detail.clone();
                rec.status = REJECTED.into();
                rec.error = Some(detail.clone());
                rec.ended_at = Some(now_ms());
                let msg = format!("stage {stage} was {detail}");
                self.db_mut()
                    .put_stage_and_run(&rec, event, "failed", Some(&msg), Some(now_ms()))?;
            }
        }
        self.run_record(&run.id)
    }

    fn awaiting_approval(&self, run: &str) -> Result<Option<String>, EngineError> {
        Ok(self
            .db()
            .stages_of(run)?
            .into_iter()
            .find(|s| s.status == AWAITING)
            .map(|s| s.stage))
    }
}

pub(crate) trait ApprovalSteps {
    /// At a stage with `approve = true`: lets it run once approved, or
    /// records the run as waiting for approval (stage row, event and run
    /// status in one transaction) and tells the orchestrator to stop.
    fn approval_gate(
        &mut self,
        run: &RunRecord,
        pipeline: &Pipeline,
        stage: &Stage,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Gate, EngineError>;
}

impl ApprovalSteps for Engine {
    fn approval_gate(
        &mut self,
        run: &RunRecord,
        pipeline: &Pipeline,
        stage: &Stage,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Gate, EngineError> {
        let row = self.db().stage(&run.id, &stage.name, "")?;
        match row.as_ref().map(|r| r.status.as_str()) {
            Some(REJECTED) => {
                let why = row.and_then(|r| r.error).unwrap_or_default();
                return Ok(Gate::Rejected(why));
            }
            Some(AWAITING) | None => {}
            // Approved, running, completed, failed, dead: past the gate.
            Some(_) => return Ok(Gate::Open),
        }
        // A stage whose key completed before runs nothing (its output is
        // reused): there is nothing for a person to approve.
        if row.is_none() && stage.branches.is_none() {
            let key = render(&stage.key, pipeline, stage, None);
            if self.db().completed_key(&key)?.is_some() {
                return Ok(Gate::Open);
            }
        }
        let rec = row.unwrap_or(StageRecord {
            run_id: run.id.clone(),
            stage: stage.name.clone(),
            branch: String::new(),
            // A branch group's key names its hypothesis once it runs.
            stage_key: render(&stage.key, pipeline, stage, None),
            status: AWAITING.into(),
            attempts: 0,
            input_snapshot: input.map(str::to_string),
            output_snapshot: None,
            sandbox_id: None,
            started_at: Some(now_ms()),
            ended_at: None,
            error: None,
            metric: None,
        });
        let detail = format!(
            "waits for a person: `{}` continues the run, `cairn pipeline reject {} {} --reason TEXT` fails it",
            approve_command(&run.id, &stage.name),
            run.id,
            stage.name
        );
        self.db_mut().put_stage_and_run(
            &rec,
            NewEvent::text("awaiting-approval", &detail, None),
            AWAITING,
            None,
            None,
        )?;
        watch.stage(&stage.name, "", AWAITING, &detail);
        Ok(Gate::Waiting)
    }
}
