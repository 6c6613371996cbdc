//! `cairn audit`: where a run's time and bytes went, stage by stage, read
//! from its typed lineage events, and the snapshot advice that applies.
//!
//! The heuristics are the seed's ("start with a snapshot audit of your
//! longest-running tool call"): a stage over 5 minutes wants periodic
//! checkpoints; state over 10 GB belongs in snapshots, not artifacts; a
//! prefix every branch of a group runs alike belongs in a stage before the
//! group, whose snapshot every branch forks.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde::Serialize;

use crate::lineage::EventData;
use crate::prelude::*;
use crate::records::{EventRecord, RunRecord, StageRecord};
use crate::render::{parse_params, render};
use crate::spec::{self, Pipeline};
use cairn_engine::{Engine, EngineError};

/// Where the advice starts. The defaults are the seed's.
#[derive(Debug, Clone, Copy)]
pub struct AuditLimits {
    /// Time worth a snapshot: a stage computing longer wants
    /// `checkpoint_every`, a prefix re-run this much in all wants a stage
    /// of its own.
    pub long: Duration,
    /// State this large belongs in snapshots rather than artifacts.
    pub large_bytes: u64,
}

impl Default for AuditLimits {
    fn default() -> AuditLimits {
        AuditLimits {
            long: Duration::from_secs(5 * 60),
            large_bytes: 10 << 30,
        }
    }
}

/// One stage (or one branch of a group), as `cairn audit` reports it.
/// Times are milliseconds, summed over the stage's attempts; `None` where
/// the run's events do not say (events recorded before typed fields).
#[derive(Debug, Clone, Serialize, Default)]
pub struct StageAudit {
    pub stage: String,
    /// '' outside branch groups.
    pub branch: String,
    pub status: String,
    pub attempts: u32,
    /// Its output came from a completed stage key: nothing ran.
    pub reused: bool,
    /// From the first attempt's start to the stage's end.
    pub wall_ms: Option<u64>,
    /// Making sandboxes (restoring snapshots) and writing edits.
    pub setup_ms: Option<u64>,
    /// The stage's commands.
    pub compute_ms: Option<u64>,
    /// Restoring the snapshot each attempt started from.
    pub restore_ms: Option<u64>,
    /// The output snapshot.
    pub snapshot_ms: Option<u64>,
    pub checkpoints: u32,
    pub checkpoint_ms: u64,
    /// Bytes the output snapshot stored anew, and the checkpoints'.
    pub state_bytes: Option<u64>,
    pub checkpoint_bytes: u64,
    pub artifact_bytes: u64,
    /// Attempts after the first.
    pub retries: u32,
    /// Work the failed attempts did that was thrown away (their setup and
    /// compute, less what a checkpoint kept).
    pub lost_ms: Option<u64>,
    /// Work the retries did not redo because they restored a checkpoint
    /// (for each retry, the work done before the checkpoint it restored).
    pub saved_ms: u64,
}

/// The audit of a run: each stage and the advice that applies.
#[derive(Debug, Clone, Serialize)]
pub struct RunAudit {
    pub run: String,
    pub pipeline: String,
    pub status: String,
    pub stages: Vec<StageAudit>,
    pub recommendations: Vec<Recommendation>,
    /// What the audit could not read (a pipeline file that no longer parses).
    pub notes: Vec<String>,
}

/// A plain piece of advice about one stage.
#[derive(Debug, Clone, Serialize)]
pub struct Recommendation {
    pub stage: String,
    /// `checkpoint`, `snapshot-state`, or `share-prefix`.
    pub kind: &'static str,
    pub advice: String,
}

/// `1h02m`, `4m05s`, `12.3s`, `850ms`.
pub fn duration_words(ms: u64) -> String {
    match ms {
        m if m >= 3_600_000 => format!("{}h{:02}m", m / 3_600_000, (m / 60_000) % 60),
        m if m >= 60_000 => format!("{}m{:02}s", m / 60_000, (m / 1000) % 60),
        m if m >= 1000 => format!("{:.1}s", m as f64 / 1000.0),
        m => format!("{m}ms"),
    }
}

/// `12.0 GiB`, `3.4 MiB`, `512 B`.
pub fn bytes_words(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

fn add(a: &mut Option<u64>, b: u64) {
    *a = Some(a.unwrap_or(0) + b);
}

/// A stage's numbers from its row and its events (in `seq` order).
fn stage_audit(row: &StageRecord, events: &[&EventRecord]) -> StageAudit {
    let mut a = StageAudit {
        stage: row.stage.clone(),
        branch: row.branch.clone(),
        status: row.status.clone(),
        attempts: row.attempts,
        retries: row.attempts.saturating_sub(1),
        wall_ms: row.started_at.zip(row.ended_at).map(|(s, e)| (e - s).max(0) as u64),
        ..StageAudit::default()
    };
    // When the current attempt began, and how much earlier work it kept
    // (the work before the checkpoint it restored).
    let mut attempt_began: Option<i64> = None;
    let mut attempt_kept: u64 = 0;
    // Checkpoint snapshot -> (work before it in all, the part done before
    // the attempt that took it).
    let mut checkpoint_at: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    // Work the failed attempts did that a restored checkpoint kept.
    let mut kept_of_failed: u64 = 0;
    for e in events {
        match &e.data {
            Some(EventData::Reused { .. }) => a.reused = true,
            Some(EventData::Attempt {
                restore_ms, checkpoint, ..
            }) => {
                add(&mut a.restore_ms, *restore_ms);
                add(&mut a.setup_ms, *restore_ms);
                // A retry from a checkpoint does not redo the work before it.
                attempt_kept = 0;
                if let Some(&(before, base)) = checkpoint.as_deref().and_then(|c| checkpoint_at.get(c)) {
                    a.saved_ms += before;
                    kept_of_failed += before - base;
                    attempt_kept = before;
                }
                attempt_began = Some(e.created_at);
            }
            Some(EventData::Checkpoint {
                snapshot,
                took_ms,
                state_bytes,
                ..
            }) => {
                a.checkpoints += 1;
                a.checkpoint_ms += took_ms;
                a.checkpoint_bytes += state_bytes;
                if let Some(began) = attempt_began {
                    let into = (e.created_at - began).max(0) as u64;
                    checkpoint_at.insert(snapshot, (attempt_kept + into, attempt_kept));
                }
            }
            Some(EventData::StageCompleted {
                setup_ms,
                compute_ms,
                snapshot_ms,
                state_bytes,
                artifact_bytes,
                ..
            }) => {
                add(&mut a.setup_ms, *setup_ms);
                add(&mut a.compute_ms, *compute_ms);
                add(&mut a.snapshot_ms, *snapshot_ms);
                add(&mut a.state_bytes, *state_bytes);
                a.artifact_bytes += artifact_bytes;
            }
            Some(EventData::StageFailed {
                setup_ms, compute_ms, ..
            }) => {
                add(&mut a.setup_ms, *setup_ms);
                add(&mut a.compute_ms, *compute_ms);
                add(&mut a.lost_ms, setup_ms + compute_ms);
            }
            _ => {}
        }
    }
    // What a checkpoint kept of a failed attempt was not lost.
    if let Some(lost) = a.lost_ms.as_mut() {
        *lost = lost.saturating_sub(kept_of_failed);
    }
    a
}

/// The pipeline a run ran, as it was checked when it started.
fn pipeline_of(run: &RunRecord) -> Result<Pipeline, String> {
    let params: Vec<String> = run.params.lines().map(str::to_string).collect();
    let params = parse_params(&params).map_err(|e| e.to_string())?;
    spec::parse(&run.file, &run.spec, &params).map_err(|e| e.to_string())
}

/// The longest compute of one attempt: the completed one's, else the
/// longest failed one.
fn longest_compute(events: &[&EventRecord]) -> u64 {
    events
        .iter()
        .filter_map(|e| match &e.data {
            Some(EventData::StageCompleted { compute_ms, .. }) | Some(EventData::StageFailed { compute_ms, .. }) => {
                Some(*compute_ms)
            }
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// A run's events by stage, and by stage and branch ('' outside groups),
/// in `seq` order: one pass, however many stages.
type ByStage<'a> = (
    HashMap<&'a str, Vec<&'a EventRecord>>,
    HashMap<(&'a str, &'a str), Vec<&'a EventRecord>>,
);

fn by_stage(events: &[EventRecord]) -> ByStage<'_> {
    let (mut stages, mut branches): ByStage = Default::default();
    for e in events {
        let Some(stage) = e.stage.as_deref() else { continue };
        stages.entry(stage).or_default().push(e);
        branches
            .entry((stage, e.branch.as_deref().unwrap_or("")))
            .or_default()
            .push(e);
    }
    (stages, branches)
}

fn advise(p: &Pipeline, stages: &[StageAudit], events: &ByStage, limits: &AuditLimits) -> Vec<Recommendation> {
    let long = limits.long.as_millis() as u64;
    let mut out = Vec::new();
    // Artifact bytes of a stage: the most any of its rows collected.
    let mut artifact_bytes: HashMap<&str, u64> = HashMap::new();
    for s in stages {
        let b = artifact_bytes.entry(s.stage.as_str()).or_default();
        *b = (*b).max(s.artifact_bytes);
    }
    for stage in &p.stages {
        let mine: &[&EventRecord] = events.0.get(stage.name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
        // A long stage (or branch) without periodic checkpoints.
        let longest = longest_compute(mine);
        if stage.checkpoint_every.is_none() && stage.decide.is_none() && longest > long {
            out.push(Recommendation {
                stage: stage.name.clone(),
                kind: "checkpoint",
                advice: format!(
                    "stage {} computed for {} in one attempt without checkpoint_every: a crash or a failure \
                     there starts it over. Set checkpoint_every (e.g. checkpoint_every = \"{}s\", a tenth of \
                     that) so a retry restores the newest checkpoint instead.",
                    stage.name,
                    duration_words(longest),
                    (longest / 10_000).clamp(1, 1800)
                ),
            });
        }
        // Large state carried as artifacts.
        let artifacts = artifact_bytes.get(stage.name.as_str()).copied().unwrap_or(0);
        if artifacts > limits.large_bytes {
            out.push(Recommendation {
                stage: stage.name.clone(),
                kind: "snapshot-state",
                advice: format!(
                    "stage {} collects {} as artifacts: every byte is read out of the sandbox and stored again. \
                     State that large belongs in the stage's output snapshot: let the stages after it read \
                     it there (they fork that snapshot, sharing its files), and keep artifacts for results \
                     people download.",
                    stage.name,
                    bytes_words(artifacts)
                ),
            });
        }
        // A prefix every branch runs alike.
        let Some(group) = &stage.branches else { continue };
        if group.hypotheses.len() < 2 {
            continue;
        }
        let alike = |template: &str| {
            let first = render(template, p, stage, group.hypotheses.first());
            group
                .hypotheses
                .iter()
                .all(|h| render(template, p, stage, Some(h)) == first)
        };
        if !stage.edits.iter().all(|e| alike(&e.path) && alike(&e.content)) {
            continue;
        }
        let shared = stage.run.iter().take_while(|c| alike(c)).count();
        if shared == 0 {
            continue;
        }
        // What each branch spent on those commands, from its completed attempt.
        let per_branch: Vec<u64> = mine
            .iter()
            .filter_map(|e| match &e.data {
                Some(EventData::StageCompleted { command_ms, .. }) if command_ms.len() >= shared => {
                    Some(command_ms[..shared].iter().sum())
                }
                _ => None,
            })
            .collect();
        if per_branch.len() < 2 {
            continue;
        }
        let each = per_branch.iter().sum::<u64>() / per_branch.len() as u64;
        let repeated = each * (per_branch.len() as u64 - 1);
        if repeated > long {
            out.push(Recommendation {
                stage: stage.name.clone(),
                kind: "share-prefix",
                advice: format!(
                    "the first {shared} command(s) of stage {} are the same in each of its {} branches and took \
                     about {} in each: {} in all was the same work again. Move them into a stage before the \
                     group; every branch then forks its output snapshot and starts where it ended.",
                    stage.name,
                    per_branch.len(),
                    duration_words(each),
                    duration_words(repeated)
                ),
            });
        }
    }
    out
}

/// A run's events read back as where its time and bytes went.
pub trait RunAudits {
    /// The audit of a run (id or unique prefix).
    fn audit_run(&self, key: &str, limits: &AuditLimits) -> Result<RunAudit, EngineError>;
}

impl RunAudits for Engine {
    fn audit_run(&self, key: &str, limits: &AuditLimits) -> Result<RunAudit, EngineError> {
        let run = self.run_record(key)?;
        let rows = self.db().stages_of(&run.id)?;
        let events = self.db().events_of(&run.id)?;
        let grouped = by_stage(&events);
        // A group's own row holds no work: its branches do.
        let groups: HashSet<&str> = rows
            .iter()
            .filter(|r| !r.branch.is_empty())
            .map(|r| r.stage.as_str())
            .collect();
        let stages: Vec<StageAudit> = rows
            .iter()
            .filter(|r| !(r.branch.is_empty() && groups.contains(r.stage.as_str())))
            .map(|r| {
                let mine = grouped
                    .1
                    .get(&(r.stage.as_str(), r.branch.as_str()))
                    .map(Vec::as_slice)
                    .unwrap_or(&[]);
                stage_audit(r, mine)
            })
            .collect();
        let mut notes = Vec::new();
        if events.iter().any(|e| {
            e.data.is_none() && matches!(e.kind.as_str(), "forked" | "completed" | "failed") && e.stage.is_some()
        }) {
            notes.push(
                "some events were recorded before events carried typed fields; their times are not counted".into(),
            );
        }
        let recommendations = match pipeline_of(&run) {
            Ok(p) => advise(&p, &stages, &grouped, limits),
            Err(e) => {
                notes.push(format!("the run's pipeline no longer parses ({e}); no advice is given"));
                Vec::new()
            }
        };
        Ok(RunAudit {
            run: run.id,
            pipeline: run.pipeline,
            status: run.status,
            stages,
            recommendations,
            notes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(at: i64, data: EventData) -> EventRecord {
        EventRecord {
            seq: at,
            stage: Some("s".into()),
            branch: Some(String::new()),
            kind: data.kind().into(),
            detail: data.sentence(),
            snapshot_id: None,
            created_at: at,
            data: Some(data),
        }
    }

    fn attempt(n: u32, checkpoint: Option<&str>) -> EventData {
        EventData::Attempt {
            attempt: n,
            parent_snapshot: checkpoint.map(str::to_string),
            checkpoint: checkpoint.map(str::to_string),
            image: None,
            restore_ms: 10,
        }
    }

    fn checkpoint(id: &str) -> EventData {
        EventData::Checkpoint {
            snapshot: id.into(),
            took_ms: 100,
            state_bytes: 1000,
            share_percent: 1.0,
            limit_percent: 10.0,
            next_in_ms: 1000,
        }
    }

    fn failed(n: u32, compute_ms: u64) -> EventData {
        EventData::StageFailed {
            attempt: n,
            error: "exit 1".into(),
            failure_snapshot: None,
            setup_ms: 0,
            compute_ms,
        }
    }

    #[test]
    fn retries_from_checkpoints_count_what_they_kept_once() {
        // Attempt 1 checkpoints 8 s in and fails at 10 s; attempt 2 goes on
        // from there, checkpoints 4 s later and fails at 5 s; attempt 3 goes
        // on from that checkpoint and completes.
        let events = [
            event(0, attempt(1, None)),
            event(8_000, checkpoint("a")),
            event(10_000, failed(1, 10_000)),
            event(10_000, attempt(2, Some("a"))),
            event(14_000, checkpoint("b")),
            event(15_000, failed(2, 5_000)),
            event(15_000, attempt(3, Some("b"))),
            event(
                16_000,
                EventData::StageCompleted {
                    attempt: 3,
                    output_snapshot: "out".into(),
                    setup_ms: 0,
                    compute_ms: 1_000,
                    snapshot_ms: 50,
                    artifacts_ms: 0,
                    state_bytes: 7,
                    artifact_bytes: 0,
                    command_ms: vec![1_000],
                    metric: None,
                },
            ),
        ];
        let refs: Vec<&EventRecord> = events.iter().collect();
        let mut row = StageRecord::pending("r", "s", "", "k", None);
        row.attempts = 3;
        let a = stage_audit(&row, &refs);
        assert_eq!(a.retries, 2);
        assert_eq!(a.compute_ms, Some(16_000));
        assert_eq!(a.restore_ms, Some(30));
        assert_eq!((a.checkpoints, a.checkpoint_ms, a.checkpoint_bytes), (2, 200, 2000));
        // The retries did not redo 8 s, then 12 s.
        assert_eq!(a.saved_ms, 20_000);
        // Thrown away: 2 s of attempt 1 and 1 s of attempt 2.
        assert_eq!(a.lost_ms, Some(3_000));
        assert_eq!(a.state_bytes, Some(7));
    }

    #[test]
    fn durations_and_sizes_read_as_words() {
        assert_eq!(duration_words(850), "850ms");
        assert_eq!(duration_words(12_340), "12.3s");
        assert_eq!(duration_words(245_000), "4m05s");
        assert_eq!(duration_words(3_720_000), "1h02m");
        assert_eq!(bytes_words(512), "512 B");
        assert_eq!(bytes_words(12 << 30), "12.0 GiB");
    }
}
