//! Branch groups: hypotheses forked from one snapshot in parallel, and the
//! selection rule that keeps one winner.

use crate::lineage::EventData;
use crate::records::{NewEvent, RunRecord, StageRecord};
use crate::spec::{Branches, Pipeline, Selection, Stage};
use crate::steps::*;
use crate::watch::RunWatcher;
use cairn_engine::{now_ms, Engine, EngineError};

pub(crate) trait BranchSteps {
    /// A branch group: every hypothesis forks the input in parallel (each in
    /// a thread with its own engine); the selection rule keeps one winner.
    fn run_branches(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Option<String>, EngineError>;

    /// A deferred group: every hypothesis runs to its end (completed or
    /// dead-lettered), and no winner is chosen; whoever asked chooses later
    /// and records the choice in the run's events.
    fn run_deferred_branches(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError>;

    /// Runs every hypothesis of the group in parallel, each in a thread
    /// with its own engine, until each has completed or dead-lettered.
    fn run_each_branch(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError>;
}

impl BranchSteps for Engine {
    fn run_branches(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<Option<String>, EngineError> {
        if let Some(done) = self
            .db()
            .stage(&run.id, &stage.name, "")?
            .filter(|s| s.status == "completed")
        {
            return Ok(done.output_snapshot);
        }
        self.run_each_branch(run, p, stage, branches, input, watch)?;
        let rows: Vec<StageRecord> = self
            .db()
            .stages_of(&run.id)?
            .into_iter()
            .filter(|s| s.stage == stage.name && !s.branch.is_empty())
            .collect();
        let done: Vec<&StageRecord> = rows.iter().filter(|s| s.status == "completed").collect();
        let winner = match &branches.select {
            Selection::FirstSuccess => done.iter().min_by_key(|s| s.ended_at.unwrap_or(i64::MAX)).copied(),
            Selection::Min(_) => done
                .iter()
                .filter(|s| s.metric.is_some())
                .min_by(|a, b| a.metric.unwrap().total_cmp(&b.metric.unwrap()))
                .copied(),
            Selection::Max(_) => done
                .iter()
                .filter(|s| s.metric.is_some())
                .max_by(|a, b| a.metric.unwrap().total_cmp(&b.metric.unwrap()))
                .copied(),
            Selection::Deferred => None,
        };
        let rule = match &branches.select {
            Selection::FirstSuccess => "first_success".to_string(),
            Selection::Min(_) => "min".into(),
            Selection::Max(_) => "max".into(),
            Selection::Deferred => "deferred".into(),
        };
        let Some(winner) = winner else {
            return Ok(None);
        };
        // The runner-up: the best of the rest under the same rule.
        let rest = done.iter().filter(|s| s.branch != winner.branch);
        let runner_up = match &branches.select {
            Selection::Min(_) => rest
                .filter(|s| s.metric.is_some())
                .min_by(|a, b| a.metric.unwrap().total_cmp(&b.metric.unwrap())),
            Selection::Max(_) => rest
                .filter(|s| s.metric.is_some())
                .max_by(|a, b| a.metric.unwrap().total_cmp(&b.metric.unwrap())),
            _ => rest.min_by_key(|s| s.ended_at.unwrap_or(i64::MAX)),
        };
        for s in &rows {
            if s.branch == winner.branch {
                continue;
            }
            let lost = EventData::Lost {
                branch: s.branch.clone(),
                winner: winner.branch.clone(),
                rule: rule.clone(),
                ended: s.status.clone(),
                metric: s.metric,
                winner_metric: winner.metric,
                chosen_by: None,
                reason: None,
            };
            self.db().event_typed(
                &run.id,
                Some(&stage.name),
                Some(&s.branch),
                &NewEvent::typed(lost, s.output_snapshot.as_deref()),
            )?;
        }
        let rec = StageRecord {
            run_id: run.id.clone(),
            stage: stage.name.clone(),
            branch: String::new(),
            stage_key: format!("{}#{}", stage.name, winner.stage_key),
            status: "completed".into(),
            attempts: 1,
            input_snapshot: input.map(str::to_string),
            output_snapshot: winner.output_snapshot.clone(),
            sandbox_id: None,
            started_at: rows.iter().filter_map(|s| s.started_at).min(),
            ended_at: Some(now_ms()),
            error: None,
            metric: winner.metric,
        };
        let won = NewEvent::typed(
            EventData::Won {
                branch: winner.branch.clone(),
                rule,
                metric: winner.metric,
                runner_up: runner_up.map(|r| r.branch.clone()),
                runner_up_metric: runner_up.and_then(|r| r.metric),
                chosen_by: None,
                reason: None,
            },
            winner.output_snapshot.as_deref(),
        );
        let detail = won.detail.clone();
        self.db_mut().put_stage_event(&rec, won)?;
        watch.stage(&stage.name, &winner.branch, "won", &detail);
        Ok(winner.output_snapshot.clone())
    }

    fn run_deferred_branches(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError> {
        self.run_each_branch(run, p, stage, branches, input, watch)?;
        let rows = self.db().stages_of(&run.id)?;
        let ended: Vec<&StageRecord> = rows
            .iter()
            .filter(|s| s.stage == stage.name && !s.branch.is_empty())
            .collect();
        let completed = ended.iter().filter(|s| s.status == "completed").count();
        let detail = format!(
            "{completed} of {} branches completed; the winner is chosen later (select)",
            ended.len()
        );
        self.db()
            .event(&run.id, Some(&stage.name), None, "ended", &detail, None)?;
        watch.stage(&stage.name, "", "ended", &detail);
        Ok(())
    }

    fn run_each_branch(
        &mut self,
        run: &RunRecord,
        p: &Pipeline,
        stage: &Stage,
        branches: &Branches,
        input: Option<&str>,
        watch: &dyn RunWatcher,
    ) -> Result<(), EngineError> {
        if self.db().fence().is_some() {
            return self.run_each_branch_queued(run, p, stage, branches, input, watch);
        }
        let home = self.home().clone();
        let results: Vec<Result<Option<String>, String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = branches
                .hypotheses
                .iter()
                .map(|h| {
                    let home = home.clone();
                    let name = h.get("name").cloned().unwrap_or_default();
                    scope.spawn(move || -> Result<Option<String>, String> {
                        let mut engine = Engine::open(home).map_err(|e| e.to_string())?;
                        engine
                            .run_stage(run, p, stage, &name, Some(h), input, watch)
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a branch panicked".into())))
                .collect()
        });
        for r in results {
            if let Err(reason) = r {
                return Err(EngineError::Service {
                    command: format!("branch of {}", stage.name),
                    reason,
                });
            }
        }
        Ok(())
    }
}
