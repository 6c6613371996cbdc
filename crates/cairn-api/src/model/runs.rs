//! Wire types of the pipeline run routes (runs, stages, events,
//! artifacts, the run graph and audit, decisions, dead letters), mapped from
//! the engine's run records.

use std::collections::BTreeMap;

use cairn_pipeline::records::{ArtifactRecord, DeadLetter, EventRecord, RunRecord, StageRecord};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartRun {
    /// The pipeline file's text (TOML; docs/pipelines.md).
    pub pipeline: String,
    /// `{params.X}` overrides.
    #[serde(default)]
    pub params: BTreeMap<String, String>,
    /// What the run records as its file (default `api`).
    pub file: Option<String>,
    /// Queue the run for `cairn worker`s on any host sharing this state
    /// store (docs/cluster.md) instead of executing it in this server.
    #[serde(default)]
    pub queue: bool,
}

/// A person's verdict on a stage waiting for approval (`approve = true`).
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StageVerdict {
    /// Why; recorded with the verdict (at most 4 KiB). Required to reject.
    pub reason: Option<String>,
    /// Who decides, as recorded in the run's events (default `api`; at most
    /// 128 bytes, letters, digits and `-_.@ `).
    pub by: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Run {
    pub id: String,
    pub pipeline: String,
    pub file: String,
    pub params: BTreeMap<String, String>,
    /// `running`, `completed`, `failed` or `awaiting_approval` (a stage
    /// waits for `POST /v1/runs/{id}/stages/{stage}/approve`); `running`
    /// with no orchestrator means interrupted (resume it).
    pub status: String,
    pub created_at: i64,
    pub ended_at: Option<i64>,
    pub error: Option<String>,
    /// Whether a process is executing the run now: this server, another
    /// local process, or the stage queue's workers (queued or claimed).
    pub orchestrated: bool,
    /// Its stage rows by status (a branch of a group counts as one, and
    /// so does the group's own row): filled by `GET /v1/runs` and
    /// `GET /v1/runs/{id}`, empty in the answers that start or resume a run.
    #[serde(default)]
    pub stage_counts: BTreeMap<String, u64>,
}

impl Run {
    pub fn of(r: RunRecord, orchestrated: bool) -> Run {
        Run {
            params: r
                .params
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            id: r.id,
            pipeline: r.pipeline,
            file: r.file,
            status: r.status,
            created_at: r.created_at,
            ended_at: r.ended_at,
            error: r.error,
            orchestrated,
            stage_counts: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Stage {
    pub stage: String,
    pub branch: String,
    pub stage_key: String,
    pub status: String,
    pub attempts: u32,
    pub input_snapshot: Option<String>,
    pub output_snapshot: Option<String>,
    pub sandbox_id: Option<String>,
    pub started_at: Option<i64>,
    pub ended_at: Option<i64>,
    pub error: Option<String>,
    pub metric: Option<f64>,
}

impl From<StageRecord> for Stage {
    fn from(s: StageRecord) -> Stage {
        Stage {
            stage: s.stage,
            branch: s.branch,
            stage_key: s.stage_key,
            status: s.status,
            attempts: s.attempts,
            input_snapshot: s.input_snapshot,
            output_snapshot: s.output_snapshot,
            sandbox_id: s.sandbox_id,
            started_at: s.started_at,
            ended_at: s.ended_at,
            error: s.error,
            metric: s.metric,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RunEvent {
    pub seq: i64,
    pub stage: Option<String>,
    pub branch: Option<String>,
    pub kind: String,
    /// The sentence, rendered from `data` when the event has typed fields.
    pub detail: String,
    pub snapshot_id: Option<String>,
    pub created_at: i64,
    /// The event's typed fields, `{"type": …, fields…}` (docs/formats.md
    /// "Run events"); null for kinds that carry only a sentence.
    #[schema(value_type = Option<Object>)]
    pub data: Option<serde_json::Value>,
}

impl From<EventRecord> for RunEvent {
    fn from(e: EventRecord) -> RunEvent {
        RunEvent {
            seq: e.seq,
            stage: e.stage,
            branch: e.branch,
            kind: e.kind,
            detail: e.detail,
            snapshot_id: e.snapshot_id,
            created_at: e.created_at,
            data: e.data.map(|d| serde_json::to_value(d).expect("event data serialises")),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Artifact {
    pub id: String,
    pub run_id: String,
    pub stage: String,
    pub branch: String,
    pub path: String,
    pub size_bytes: u64,
    pub content_hash: String,
    pub snapshot_id: String,
}

impl From<ArtifactRecord> for Artifact {
    fn from(a: ArtifactRecord) -> Artifact {
        Artifact {
            id: a.id,
            run_id: a.run_id,
            stage: a.stage,
            branch: a.branch,
            path: a.path,
            size_bytes: a.size_bytes,
            content_hash: a.content_hash,
            snapshot_id: a.snapshot_id,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RunDetail {
    pub run: Run,
    pub stages: Vec<Stage>,
    pub events: Vec<RunEvent>,
    pub artifacts: Vec<Artifact>,
    /// What decide stages' models chose, oldest first.
    pub decisions: Vec<Decision>,
    /// Every stage of the run's pipeline, run or not, with the stage it
    /// comes after, parents first; null when the pipeline file the run
    /// stored no longer parses (the stages then tell only the order they
    /// ran in).
    pub graph: Option<Vec<StageEdges>>,
}

/// A stage of a run's pipeline and what its sandbox starts from.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct StageEdges {
    pub stage: String,
    /// The stages whose output this one forks (a branch group's winner's):
    /// one at most today; empty when it starts from the pipeline's
    /// snapshot or image.
    pub after: Vec<String>,
}

impl From<cairn_pipeline::graph::StageEdges> for StageEdges {
    fn from(e: cairn_pipeline::graph::StageEdges) -> StageEdges {
        StageEdges {
            stage: e.stage,
            after: e.after,
        }
    }
}

/// Where a run's time and bytes went, stage by stage, and the advice that
/// applies (`cairn audit`, docs/pipelines.md "Audit").
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RunAudit {
    pub run: String,
    pub pipeline: String,
    pub status: String,
    /// Each stage, and each branch of a group (not the group's own row).
    pub stages: Vec<StageAudit>,
    pub recommendations: Vec<Recommendation>,
    /// What the audit could not read.
    pub notes: Vec<String>,
}

/// One stage's costs: milliseconds summed over its attempts, null where
/// its events do not say (events recorded before typed fields).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct StageAudit {
    pub stage: String,
    pub branch: String,
    pub status: String,
    pub attempts: u32,
    /// Its output came from a completed stage key.
    pub reused: bool,
    pub wall_ms: Option<u64>,
    /// Making sandboxes and writing edits.
    pub setup_ms: Option<u64>,
    /// The stage's commands.
    pub compute_ms: Option<u64>,
    pub restore_ms: Option<u64>,
    pub snapshot_ms: Option<u64>,
    pub checkpoints: u32,
    pub checkpoint_ms: u64,
    /// Bytes the output snapshot stored anew.
    pub state_bytes: Option<u64>,
    pub checkpoint_bytes: u64,
    pub artifact_bytes: u64,
    pub retries: u32,
    /// Work failed attempts did that no checkpoint kept.
    pub lost_ms: Option<u64>,
    /// Work retries did not redo because they restored a checkpoint.
    pub saved_ms: u64,
}

/// Advice about one stage.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Recommendation {
    pub stage: String,
    /// `checkpoint`, `snapshot-state` or `share-prefix`.
    pub kind: String,
    pub advice: String,
}

impl From<cairn_pipeline::audit::RunAudit> for RunAudit {
    fn from(a: cairn_pipeline::audit::RunAudit) -> RunAudit {
        RunAudit {
            run: a.run,
            pipeline: a.pipeline,
            status: a.status,
            stages: a
                .stages
                .into_iter()
                .map(|s| StageAudit {
                    stage: s.stage,
                    branch: s.branch,
                    status: s.status,
                    attempts: s.attempts,
                    reused: s.reused,
                    wall_ms: s.wall_ms,
                    setup_ms: s.setup_ms,
                    compute_ms: s.compute_ms,
                    restore_ms: s.restore_ms,
                    snapshot_ms: s.snapshot_ms,
                    checkpoints: s.checkpoints,
                    checkpoint_ms: s.checkpoint_ms,
                    state_bytes: s.state_bytes,
                    checkpoint_bytes: s.checkpoint_bytes,
                    artifact_bytes: s.artifact_bytes,
                    retries: s.retries,
                    lost_ms: s.lost_ms,
                    saved_ms: s.saved_ms,
                })
                .collect(),
            recommendations: a
                .recommendations
                .into_iter()
                .map(|r| Recommendation {
                    stage: r.stage,
                    kind: r.kind.to_string(),
                    advice: r.advice,
                })
                .collect(),
            notes: a.notes,
        }
    }
}

/// One decision of a decide stage (docs/pipelines.md).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Decision {
    pub stage: String,
    /// 1, 2, …: a retry a decision asks for makes the stage decide again.
    pub round: u32,
    pub stage_key: String,
    /// `provider/model` that answered.
    pub model: String,
    pub reason: String,
    /// What was chosen: `hypotheses`, `params`, `action`, each when the
    /// stage chooses it.
    #[schema(value_type = Object)]
    pub answer: serde_json::Value,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Model calls it took (an invalid answer is asked again).
    pub calls: u32,
    pub created_at: i64,
}

impl From<cairn_pipeline::records::DecisionRecord> for Decision {
    fn from(d: cairn_pipeline::records::DecisionRecord) -> Decision {
        let answer = cairn_pipeline::decision::Answer::from_stored(&d.answer)
            .map(|a| serde_json::to_value(a).expect("an answer serialises"))
            .unwrap_or(serde_json::Value::String(d.answer));
        Decision {
            stage: d.stage,
            round: d.round,
            stage_key: d.stage_key,
            model: d.model,
            reason: d.reason,
            answer,
            input_tokens: d.input_tokens,
            output_tokens: d.output_tokens,
            calls: d.calls,
            created_at: d.created_at,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RunPage {
    pub items: Vec<Run>,
    pub next: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DeadLetterView {
    pub id: String,
    pub run_id: String,
    pub stage: String,
    pub branch: String,
    pub error: String,
    pub failure_snapshot: Option<String>,
    pub input_snapshot: Option<String>,
    pub created_at: i64,
    pub retried_at: Option<i64>,
}

impl From<DeadLetter> for DeadLetterView {
    fn from(d: DeadLetter) -> DeadLetterView {
        DeadLetterView {
            id: d.id,
            run_id: d.run_id,
            stage: d.stage,
            branch: d.branch,
            error: d.error,
            failure_snapshot: d.failure_snapshot,
            input_snapshot: d.input_snapshot,
            created_at: d.created_at,
            retried_at: d.retried_at,
        }
    }
}
