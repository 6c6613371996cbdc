//! Promote and collect: a run whose file says `keep = "winners"` keeps
//! each branch group's winner and everything it reaches; the losing
//! branches' snapshots (their outputs and checkpoints) go once
//! `keep_losers_for` has passed since the run ended, at the next `cairn
//! gc`. Their stage rows and events stay: the lineage still says what was
//! tried and why it lost, and a `collected` event says when the bytes went.

use std::collections::HashSet;

use crate::lineage::EventData;
pub use crate::records::CollectedBranch;
use crate::records::{NewEvent, StageRecord};
use crate::steps::*;
use cairn_engine::state::params;
use cairn_engine::{Engine, EngineError};

pub(crate) trait RetentionSteps {
    /// Collects the losing branches of every ended run whose retention
    /// deadline has passed by `now_ms`. A snapshot anything else still
    /// names (another run's stage, a session, a dead letter) stays.
    fn collect_losers(&mut self, now_ms: i64) -> Result<Vec<CollectedBranch>, EngineError>;

    /// Snapshots something other than `losers` names: any other stage row
    /// of `runs` (every run: a later run may have reused a loser's output as
    /// its winner), a session, a dead letter.
    fn snapshots_kept_besides(
        &self,
        runs: &[(crate::records::RunRecord, Vec<StageRecord>)],
        losers: &[&StageRecord],
    ) -> Result<HashSet<String>, EngineError>;
}

impl RetentionSteps for Engine {
    fn collect_losers(&mut self, now_ms: i64) -> Result<Vec<CollectedBranch>, EngineError> {
        // Every run's stage rows, read once: the losers come from the runs
        // past their deadline, what stays from all of them.
        let mut runs = Vec::new();
        for run in self.db().runs()? {
            let stages = self.db().stages_of(&run.id)?;
            runs.push((run, stages));
        }
        let mut due = Vec::new();
        for (run, stages) in &runs {
            let Some(ended) = run.ended_at else { continue };
            // A file that no longer parses keeps everything.
            let Ok(p) = self.parsed_run(run) else { continue };
            let Some(keep_for) = p.keep_losers_for else { continue };
            if now_ms < ended.saturating_add(keep_for.as_millis() as i64) {
                continue;
            }
            let events = self.db().events_of(&run.id)?;
            let collected = |stage: &str, branch: &str| {
                events.iter().any(|e| {
                    e.kind == "collected" && e.stage.as_deref() == Some(stage) && e.branch.as_deref() == Some(branch)
                })
            };
            let losers: Vec<&StageRecord> = stages
                .iter()
                .filter(|s| !s.branch.is_empty() && !collected(&s.stage, &s.branch))
                .filter(|s| {
                    // A group with a winner: its output is the winner's.
                    let group = stages.iter().find(|g| g.stage == s.stage && g.branch.is_empty());
                    group.is_some_and(|g| g.output_snapshot.is_some() && g.output_snapshot != s.output_snapshot)
                })
                .collect();
            if !losers.is_empty() {
                due.push((run, keep_for, losers));
            }
        }
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let all_losers: Vec<&StageRecord> = due.iter().flat_map(|(_, _, l)| l.iter().copied()).collect();
        let keep = self.snapshots_kept_besides(&runs, &all_losers)?;
        let mut out = Vec::new();
        for (run, keep_for, losers) in due {
            for loser in losers {
                let mut drop: Vec<String> = loser.output_snapshot.iter().cloned().collect();
                drop.extend(self.db().checkpoint_snapshots(&run.id, &loser.stage, &loser.branch)?);
                drop.retain(|s| !keep.contains(s));
                drop.sort();
                drop.dedup();
                if let Some(id) = &loser.sandbox_id {
                    if let Ok(rec) = self.sandbox(id) {
                        self.remove_sandbox(&rec, true)?;
                    }
                }
                let event = NewEvent::typed(
                    EventData::Collected {
                        snapshots: drop.clone(),
                        kept_for_secs: keep_for.as_secs(),
                    },
                    None,
                );
                self.db().transaction(|b| {
                    for s in &drop {
                        b.execute("DELETE FROM stage_keys WHERE output_snapshot = $1", params![s])?;
                        b.execute("DELETE FROM snapshots WHERE id = $1", params![s])?;
                    }
                    b.execute(
                        "DELETE FROM checkpoints WHERE run_id = $1 AND stage = $2 AND branch = $3",
                        params![&run.id, &loser.stage, &loser.branch],
                    )?;
                    crate::records::insert_new_event(b, &run.id, Some(&loser.stage), Some(&loser.branch), &event)
                })?;
                for s in &drop {
                    self.remove_memory_image(s);
                }
                out.push(CollectedBranch {
                    run_id: run.id.clone(),
                    stage: loser.stage.clone(),
                    branch: loser.branch.clone(),
                    snapshots: drop,
                });
            }
        }
        Ok(out)
    }

    fn snapshots_kept_besides(
        &self,
        runs: &[(crate::records::RunRecord, Vec<StageRecord>)],
        losers: &[&StageRecord],
    ) -> Result<HashSet<String>, EngineError> {
        let is_loser = |s: &StageRecord| {
            losers
                .iter()
                .any(|l| l.run_id == s.run_id && l.stage == s.stage && l.branch == s.branch)
        };
        let mut keep = HashSet::new();
        for s in runs.iter().flat_map(|(_, stages)| stages) {
            keep.extend(s.input_snapshot.clone());
            if !is_loser(s) {
                keep.extend(s.output_snapshot.clone());
            }
        }
        keep.extend(self.db().session_snapshots()?);
        keep.extend(self.db().dead_letter_snapshots()?);
        Ok(keep)
    }
}
