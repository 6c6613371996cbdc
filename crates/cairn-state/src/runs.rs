//! Rows of runs, stages, checkpoints, artifacts, dead letters and events.

use serde::Serialize;

use crate::lineage::EventData;
use crate::{params, Backend, Db, Row, StateError};

#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    pub id: String,
    pub pipeline: String,
    pub file: String,
    #[serde(skip)]
    pub spec: String,
    pub params: String,
    pub status: String,
    pub created_at: i64,
    pub ended_at: Option<i64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StageRecord {
    pub run_id: String,
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

impl StageRecord {
    /// A stage (or branch) about to run for the first time in `run`.
    pub fn pending(run: &str, stage: &str, branch: &str, key: &str, input: Option<&str>) -> StageRecord {
        StageRecord {
            run_id: run.to_string(),
            stage: stage.to_string(),
            branch: branch.to_string(),
            stage_key: key.to_string(),
            status: "pending".into(),
            attempts: 0,
            input_snapshot: input.map(str::to_string),
            output_snapshot: None,
            sandbox_id: None,
            started_at: Some(crate::now_ms()),
            ended_at: None,
            error: None,
            metric: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EventRecord {
    pub seq: i64,
    pub stage: Option<String>,
    pub branch: Option<String>,
    pub kind: String,
    /// The sentence, rendered from `data` when the event has typed fields.
    pub detail: String,
    pub snapshot_id: Option<String>,
    pub created_at: i64,
    /// The typed fields (docs/formats.md "Run events"); none for kinds
    /// that have only a sentence, and for events older than the fields.
    pub data: Option<EventData>,
}

/// An event to record with a row: its kind, sentence, snapshot and, when
/// it has them, typed fields (from which kind and sentence are made).
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub kind: &'a str,
    pub detail: String,
    pub snapshot: Option<&'a str>,
    pub data: Option<EventData>,
}

impl<'a> NewEvent<'a> {
    /// An event with only a sentence.
    pub fn text(kind: &'a str, detail: &str, snapshot: Option<&'a str>) -> NewEvent<'a> {
        NewEvent {
            kind,
            detail: detail.to_string(),
            snapshot,
            data: None,
        }
    }

    /// An event with typed fields; its kind and sentence come from them.
    pub fn typed(data: EventData, snapshot: Option<&'a str>) -> NewEvent<'a> {
        NewEvent {
            kind: data.kind(),
            detail: data.sentence(),
            snapshot,
            data: Some(data),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ArtifactRecord {
    pub id: String,
    pub run_id: String,
    pub stage: String,
    pub branch: String,
    pub path: String,
    pub size_bytes: u64,
    pub content_hash: String,
    pub snapshot_id: String,
}

/// One decision of a decide stage (`decisions`, docs/formats.md).
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    pub run_id: String,
    pub stage: String,
    /// 1, 2, …: a retry the decision asks for makes the stage decide again.
    pub round: u32,
    pub stage_key: String,
    /// `provider/model` that answered.
    pub model: String,
    /// The checked answer in its stored form (`{"v": 1, "answer": {...}}`).
    pub answer: String,
    pub reason: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Model calls it took: invalid answers are asked again.
    pub calls: u32,
    pub created_at: i64,
}

/// What recording a decision does besides completing (or resetting) its stage.
pub enum DecisionEffect<'a> {
    /// The decide stage completed; its output is its input.
    Complete,
    /// The stage before runs again (its row reset, its key forgotten), then
    /// the decide stage decides again.
    Retry { previous: &'a StageRecord },
    /// The stage before goes to the dead letters (its key forgotten) and the
    /// run fails.
    Dlq {
        previous: &'a StageRecord,
        dead_letter: &'a DeadLetter,
        run_error: &'a str,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
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

fn run_row(r: &Row) -> Result<RunRecord, StateError> {
    Ok(RunRecord {
        id: r.get(0)?,
        pipeline: r.get(1)?,
        file: r.get(2)?,
        spec: r.get(3)?,
        params: r.get(4)?,
        status: r.get(5)?,
        created_at: r.get(6)?,
        ended_at: r.get(7)?,
        error: r.get(8)?,
    })
}

fn stage_row(r: &Row) -> Result<StageRecord, StateError> {
    Ok(StageRecord {
        run_id: r.get(0)?,
        stage: r.get(1)?,
        branch: r.get(2)?,
        stage_key: r.get(3)?,
        status: r.get(4)?,
        attempts: r.get(5)?,
        input_snapshot: r.get(6)?,
        output_snapshot: r.get(7)?,
        sandbox_id: r.get(8)?,
        started_at: r.get(9)?,
        ended_at: r.get(10)?,
        error: r.get(11)?,
        metric: r.get(12)?,
    })
}

const DECISION_COLUMNS: &str = "run_id, stage, round, stage_key, model, answer, reason, input_tokens, \
     output_tokens, calls, created_at";

fn decision_row(r: &Row) -> Result<DecisionRecord, StateError> {
    Ok(DecisionRecord {
        run_id: r.get(0)?,
        stage: r.get(1)?,
        round: r.get(2)?,
        stage_key: r.get(3)?,
        model: r.get(4)?,
        answer: r.get(5)?,
        reason: r.get(6)?,
        input_tokens: r.get::<i64>(7)? as u64,
        output_tokens: r.get::<i64>(8)? as u64,
        calls: r.get(9)?,
        created_at: r.get(10)?,
    })
}

fn rows<T>(rows: Vec<Row>, f: impl Fn(&Row) -> Result<T, StateError>) -> Result<Vec<T>, StateError> {
    rows.iter().map(f).collect()
}

const RUN_COLUMNS: &str = "id, pipeline, file, spec, params, status, created_at, ended_at, error";
const STAGE_COLUMNS: &str = "run_id, stage, branch, stage_key, status, attempts, input_snapshot, output_snapshot, \
     sandbox_id, started_at, ended_at, error, metric";

/// Records a completed stage key; the first completion of a key stays.
const INSERT_STAGE_KEY: &str =
    "INSERT INTO stage_keys (stage_key, output_snapshot, run_id, stage, completed_at, metric)
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (stage_key) DO NOTHING";

impl Db {
    pub fn insert_run(&self, r: &RunRecord) -> Result<(), StateError> {
        self.transaction(|b| {
            b.execute(
                &format!("INSERT INTO runs ({RUN_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"),
                params![
                    &r.id,
                    &r.pipeline,
                    &r.file,
                    &r.spec,
                    &r.params,
                    &r.status,
                    r.created_at,
                    r.ended_at,
                    &r.error
                ],
            )?;
            self.stamp(b, crate::tenants::Owned::Run, &r.id)
        })
    }

    pub fn runs(&self) -> Result<Vec<RunRecord>, StateError> {
        self.with(|b| {
            rows(
                b.query(&format!("SELECT {RUN_COLUMNS} FROM runs ORDER BY created_at"), &[])?,
                run_row,
            )
        })
    }

    pub fn find_runs(&self, key: &str) -> Result<Vec<RunRecord>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    &format!(
                        "SELECT {RUN_COLUMNS} FROM runs WHERE (id = $1 OR (length($1) >= 3 AND substr(id, 1, length($1)) = $1))
                         AND (CAST($2 AS TEXT) IS NULL OR tenant = $2)"
                    ),
                    // A connection acting for a tenant finds that tenant's only.
                    params![key, self.acting_for()],
                )?,
                run_row,
            )
        })
    }

    /// Deletes a run with its stages, keys, checkpoints, artifacts, dead
    /// letters and events.
    pub fn delete_run(&mut self, id: &str) -> Result<(), StateError> {
        self.transaction(|b| {
            for table in [
                "stage_keys",
                "checkpoints",
                "artifacts",
                "dead_letters",
                "events",
                "stages",
                "decisions",
            ] {
                b.execute(&format!("DELETE FROM {table} WHERE run_id = $1"), params![id])?;
            }
            b.execute("DELETE FROM runs WHERE id = $1", params![id])?;
            Ok(())
        })
    }

    pub fn finish_run(&self, id: &str, status: &str, error: Option<&str>, at: i64) -> Result<(), StateError> {
        self.fenced(|b| {
            b.execute(
                "UPDATE runs SET status = $2, error = $3, ended_at = $4 WHERE id = $1",
                params![id, status, error, at],
            )?;
            Ok(())
        })
    }

    /// How many stage rows each run has in each status: run id, status, count.
    pub fn stage_counts(&self) -> Result<Vec<(String, String, u64)>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    "SELECT run_id, status, COUNT(*) FROM stages GROUP BY run_id, status ORDER BY run_id, status",
                    &[],
                )?,
                |r| Ok((r.get(0)?, r.get(1)?, r.get::<i64>(2)?.max(0) as u64)),
            )
        })
    }

    pub fn stage(&self, run: &str, stage: &str, branch: &str) -> Result<Option<StageRecord>, StateError> {
        self.with(|b| {
            b.query_opt(
                &format!("SELECT {STAGE_COLUMNS} FROM stages WHERE run_id = $1 AND stage = $2 AND branch = $3"),
                params![run, stage, branch],
            )?
            .as_ref()
            .map(stage_row)
            .transpose()
        })
    }

    pub fn stages_of(&self, run: &str) -> Result<Vec<StageRecord>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    &format!("SELECT {STAGE_COLUMNS} FROM stages WHERE run_id = $1 ORDER BY started_at, stage, branch"),
                    params![run],
                )?,
                stage_row,
            )
        })
    }

    /// Writes a stage's row (insert or replace) with an event, in one transaction.
    pub fn put_stage(&mut self, s: &StageRecord, event: Option<(&str, &str, Option<&str>)>) -> Result<(), StateError> {
        self.put_stage_releasing(s, event.map(|(k, d, snap)| NewEvent::text(k, d, snap)), None)
    }

    /// [`put_stage`](Self::put_stage) with a typed event.
    pub fn put_stage_event(&mut self, s: &StageRecord, event: NewEvent) -> Result<(), StateError> {
        self.put_stage_releasing(s, Some(event), None)
    }

    /// [`put_stage`](Self::put_stage) for an attempt's outcome, in the same
    /// transaction handing its sandbox back to `owner` to remove: the
    /// outcome is recorded before the sandbox can go, and a sandbox whose
    /// remover dies is removed by the next Cairn command.
    pub fn put_stage_releasing(
        &mut self,
        s: &StageRecord,
        event: Option<NewEvent>,
        release: Option<(&str, (i32, u64))>,
    ) -> Result<(), StateError> {
        let (job, epoch) = claim_of(&self.fence());
        self.fenced(|b| {
            // The attempt's end: its artifacts are committed with a
            // completion (those of this claim only), and dropped otherwise.
            if s.status != "running" {
                if s.status == "completed" {
                    b.execute(
                        &format!(
                            "INSERT INTO artifacts ({ARTIFACT_COLUMNS}) SELECT {ARTIFACT_COLUMNS}
                             FROM pending_artifacts
                             WHERE run_id = $1 AND stage = $2 AND branch = $3 AND job_id = $4 AND epoch = $5
                             {ARTIFACT_UPSERT}"
                        ),
                        params![&s.run_id, &s.stage, &s.branch, &job, epoch],
                    )?;
                }
                b.execute(
                    "DELETE FROM pending_artifacts WHERE run_id = $1 AND stage = $2 AND branch = $3",
                    params![&s.run_id, &s.stage, &s.branch],
                )?;
            }
            if let Some((sandbox, (pid, start))) = release {
                b.execute(
                    "UPDATE sandboxes SET auto_remove = $2, owner_pid = $3, owner_start = $4 WHERE id = $1",
                    params![sandbox, true, pid, start],
                )?;
            }
            upsert_stage(b, s)?;
            if let Some(e) = &event {
                let branch = e.data.as_ref().and_then(EventData::branch).unwrap_or(&s.branch);
                insert_new_event(b, &s.run_id, Some(&s.stage), Some(branch), e)?;
            }
            if s.status == "completed" && s.branch.is_empty() {
                if let Some(out) = &s.output_snapshot {
                    b.execute(
                        INSERT_STAGE_KEY,
                        params![
                            &s.stage_key,
                            out,
                            &s.run_id,
                            &s.stage,
                            s.ended_at.unwrap_or(0),
                            s.metric
                        ],
                    )?;
                }
            }
            Ok(())
        })
    }

    /// Writes a stage's row with its event and sets the run's status, in one
    /// transaction: a pause for approval, an approval or a rejection is
    /// recorded whole or not at all.
    pub fn put_stage_and_run(
        &mut self,
        s: &StageRecord,
        event: NewEvent,
        run_status: &str,
        run_error: Option<&str>,
        ended_at: Option<i64>,
    ) -> Result<(), StateError> {
        self.fenced(|b| {
            upsert_stage(b, s)?;
            insert_new_event(b, &s.run_id, Some(&s.stage), Some(&s.branch), &event)?;
            b.execute(
                "UPDATE runs SET status = $2, error = $3, ended_at = $4 WHERE id = $1",
                params![&s.run_id, run_status, run_error, ended_at],
            )?;
            Ok(())
        })
    }

    /// Records a decision, the decide stage's row and event, and what the
    /// decision does to the stage before it, in one transaction: a decision
    /// recorded is never asked for again, and is never half applied.
    pub fn record_decision(
        &mut self,
        d: &DecisionRecord,
        stage: &StageRecord,
        event: NewEvent,
        effect: DecisionEffect,
    ) -> Result<(), StateError> {
        self.fenced(|b| {
            b.execute(
                &format!(
                    "INSERT INTO decisions ({DECISION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
                ),
                params![
                    &d.run_id,
                    &d.stage,
                    d.round,
                    &d.stage_key,
                    &d.model,
                    &d.answer,
                    &d.reason,
                    d.input_tokens as i64,
                    d.output_tokens as i64,
                    d.calls,
                    d.created_at
                ],
            )?;
            upsert_stage(b, stage)?;
            insert_new_event(b, &stage.run_id, Some(&stage.stage), Some(""), &event)?;
            let forget = |b: &mut dyn Backend, previous: &StageRecord| {
                b.execute(
                    "DELETE FROM stage_keys WHERE stage_key = $1",
                    params![&previous.stage_key],
                )
            };
            match effect {
                DecisionEffect::Complete => {
                    if let Some(out) = &stage.output_snapshot {
                        b.execute(
                            INSERT_STAGE_KEY,
                            params![
                                &stage.stage_key,
                                out,
                                &stage.run_id,
                                &stage.stage,
                                stage.ended_at.unwrap_or(0),
                                stage.metric
                            ],
                        )?;
                    }
                }
                DecisionEffect::Retry { previous } => {
                    upsert_stage(b, previous)?;
                    forget(b, previous)?;
                }
                DecisionEffect::Dlq {
                    previous,
                    dead_letter,
                    run_error,
                } => {
                    upsert_stage(b, previous)?;
                    forget(b, previous)?;
                    insert_dead_letter(b, dead_letter)?;
                    b.execute(
                        "UPDATE runs SET status = 'failed', error = $2, ended_at = $3 WHERE id = $1",
                        params![&stage.run_id, run_error, crate::now_ms()],
                    )?;
                }
            }
            Ok(())
        })
    }

    pub fn decisions_of(&self, run: &str) -> Result<Vec<DecisionRecord>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    &format!(
                        "SELECT {DECISION_COLUMNS} FROM decisions WHERE run_id = $1 ORDER BY created_at, stage, round"
                    ),
                    params![run],
                )?,
                decision_row,
            )
        })
    }

    /// The decision that completed a decide stage's key, in any run.
    pub fn decision_by_key(&self, key: &str) -> Result<Option<DecisionRecord>, StateError> {
        self.with(|b| {
            b.query_opt(
                "SELECT d.run_id, d.stage, d.round, d.stage_key, d.model, d.answer, d.reason, d.input_tokens,
                 d.output_tokens, d.calls, d.created_at FROM decisions d JOIN stage_keys k
                 ON k.stage_key = d.stage_key AND k.run_id = d.run_id AND k.stage = d.stage
                 WHERE d.stage_key = $1 ORDER BY d.round DESC LIMIT 1",
                params![key],
            )?
            .as_ref()
            .map(decision_row)
            .transpose()
        })
    }

    /// The output snapshot, run and metric of a completed stage key, from any run.
    pub fn completed_key(&self, key: &str) -> Result<Option<(String, String, Option<f64>)>, StateError> {
        self.with(|b| {
            let row = b.query_opt(
                "SELECT output_snapshot, run_id, metric FROM stage_keys WHERE stage_key = $1",
                params![key],
            )?;
            Ok(match row {
                Some(r) => Some((r.get(0)?, r.get(1)?, r.get(2)?)),
                None => None,
            })
        })
    }

    /// Records a completed branch's key (branch winners and losers alike keep
    /// their work: re-running the group reuses them).
    pub fn complete_key(&self, s: &StageRecord, at: i64) -> Result<(), StateError> {
        self.fenced(|b| {
            b.execute(
                INSERT_STAGE_KEY,
                params![&s.stage_key, &s.output_snapshot, &s.run_id, &s.stage, at, s.metric],
            )?;
            Ok(())
        })
    }

    pub fn event(
        &self,
        run: &str,
        stage: Option<&str>,
        branch: Option<&str>,
        kind: &str,
        detail: &str,
        snapshot: Option<&str>,
    ) -> Result<(), StateError> {
        self.with(|b| insert_event(b, run, stage, branch, kind, detail, snapshot))
    }

    /// Records an event with typed fields outside any other write.
    pub fn event_typed(
        &self,
        run: &str,
        stage: Option<&str>,
        branch: Option<&str>,
        event: &NewEvent,
    ) -> Result<(), StateError> {
        self.with(|b| insert_new_event(b, run, stage, branch, event))
    }

    pub fn events_of(&self, run: &str) -> Result<Vec<EventRecord>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    "SELECT seq, stage, branch, kind, detail, snapshot_id, created_at, data FROM events
                     WHERE run_id = $1 ORDER BY seq",
                    params![run],
                )?,
                |r| {
                    let seq: i64 = r.get(0)?;
                    let data = r
                        .get::<Option<String>>(7)?
                        .map(|text| EventData::from_stored(&text))
                        .transpose()
                        .map_err(|reason| StateError::EventData {
                            run: run.to_string(),
                            seq,
                            reason,
                        })?;
                    Ok(EventRecord {
                        seq,
                        stage: r.get(1)?,
                        branch: r.get(2)?,
                        kind: r.get(3)?,
                        detail: r.get(4)?,
                        snapshot_id: r.get(5)?,
                        created_at: r.get(6)?,
                        data,
                    })
                },
            )
        })
    }

    pub fn add_checkpoint(
        &self,
        run: &str,
        stage: &str,
        branch: &str,
        snapshot: &str,
        at: i64,
    ) -> Result<(), StateError> {
        self.add_checkpoint_noted(
            run,
            stage,
            branch,
            snapshot,
            at,
            "periodic checkpoint of the running stage",
        )
    }

    /// [`add_checkpoint`](Self::add_checkpoint) with the event's detail
    /// (what the checkpoint cost, and the share of the stage it took).
    pub fn add_checkpoint_noted(
        &self,
        run: &str,
        stage: &str,
        branch: &str,
        snapshot: &str,
        at: i64,
        detail: &str,
    ) -> Result<(), StateError> {
        self.add_checkpoint_event(
            run,
            stage,
            branch,
            snapshot,
            at,
            &NewEvent::text("checkpoint", detail, None),
        )
    }

    /// Records a checkpoint with its event (typed: what it cost).
    pub fn add_checkpoint_event(
        &self,
        run: &str,
        stage: &str,
        branch: &str,
        snapshot: &str,
        at: i64,
        event: &NewEvent,
    ) -> Result<(), StateError> {
        self.fenced(|b| {
            b.execute(
                "INSERT INTO checkpoints (run_id, stage, branch, snapshot_id, created_at) VALUES ($1, $2, $3, $4, $5)",
                params![run, stage, branch, snapshot, at],
            )?;
            let e = NewEvent {
                snapshot: Some(snapshot),
                ..event.clone()
            };
            insert_new_event(b, run, Some(stage), Some(branch), &e)
        })
    }

    /// Every checkpoint snapshot of a stage or branch, oldest first.
    pub fn checkpoint_snapshots(&self, run: &str, stage: &str, branch: &str) -> Result<Vec<String>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT snapshot_id FROM checkpoints WHERE run_id = $1 AND stage = $2 AND branch = $3
                 ORDER BY created_at, rowid",
                params![run, stage, branch],
            )?
            .iter()
            .map(|r| Ok(r.get(0)?))
            .collect()
        })
    }

    /// Snapshots dead letters keep (their failures and inputs).
    pub fn dead_letter_snapshots(&self) -> Result<std::collections::HashSet<String>, StateError> {
        self.strings(&[
            "SELECT failure_snapshot FROM dead_letters WHERE failure_snapshot IS NOT NULL",
            "SELECT input_snapshot FROM dead_letters WHERE input_snapshot IS NOT NULL",
        ])
    }

    pub fn newest_checkpoint(&self, run: &str, stage: &str, branch: &str) -> Result<Option<String>, StateError> {
        self.with(|b| {
            let row = b.query_opt(
                "SELECT snapshot_id FROM checkpoints WHERE run_id = $1 AND stage = $2 AND branch = $3
                 ORDER BY created_at DESC, rowid DESC LIMIT 1",
                params![run, stage, branch],
            )?;
            Ok(row.map(|r| r.get(0)).transpose()?)
        })
    }

    pub fn insert_artifact(&self, a: &ArtifactRecord) -> Result<(), StateError> {
        self.fenced(|b| {
            b.execute(
                &format!(
                    "INSERT INTO artifacts ({ARTIFACT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) {ARTIFACT_UPSERT}"
                ),
                params![
                    &a.id,
                    &a.run_id,
                    &a.stage,
                    &a.branch,
                    &a.path,
                    a.size_bytes,
                    &a.content_hash,
                    &a.snapshot_id
                ],
            )?;
            Ok(())
        })
    }

    /// Records an artifact an attempt collected, under this connection's
    /// claim: pending, invisible, until the stage's completion commits it
    /// ([`Db::put_stage_releasing`]).
    pub fn insert_pending_artifact(&self, a: &ArtifactRecord) -> Result<(), StateError> {
        let (job, epoch) = claim_of(&self.fence());
        self.fenced(|b| {
            b.execute(
                &format!(
                    "INSERT INTO pending_artifacts ({ARTIFACT_COLUMNS}, job_id, epoch)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
                 ON CONFLICT (run_id, stage, branch, path, job_id, epoch) DO UPDATE SET id = excluded.id,
                 size_bytes = excluded.size_bytes, content_hash = excluded.content_hash,
                 snapshot_id = excluded.snapshot_id"
                ),
                params![
                    &a.id,
                    &a.run_id,
                    &a.stage,
                    &a.branch,
                    &a.path,
                    a.size_bytes,
                    &a.content_hash,
                    &a.snapshot_id,
                    &job,
                    epoch
                ],
            )?;
            Ok(())
        })
    }

    /// The artifacts this connection's claim has pending for a stage.
    pub fn pending_artifacts(&self, run: &str, stage: &str, branch: &str) -> Result<Vec<ArtifactRecord>, StateError> {
        let (job, epoch) = claim_of(&self.fence());
        self.with(|b| {
            rows(
                b.query(
                    &format!(
                        "SELECT {ARTIFACT_COLUMNS} FROM pending_artifacts
                         WHERE run_id = $1 AND stage = $2 AND branch = $3 AND job_id = $4 AND epoch = $5
                         ORDER BY path"
                    ),
                    params![run, stage, branch, &job, epoch],
                )?,
                artifact_from_row,
            )
        })
    }

    /// Every pending artifact that may still be committed (its claim held,
    /// or outside the queue its stage still running), after dropping the
    /// rest, each with an `artifact-dropped` event on its run: what `gc`
    /// keeps, and what it lets go.
    pub fn live_pending_artifacts(&self) -> Result<Vec<ArtifactRecord>, StateError> {
        self.transaction(|b| {
            // Those that can no longer be committed, each said on its run.
            let stale = rows(
                b.query(
                    "SELECT p.run_id, p.stage, p.branch, p.path, p.job_id, p.epoch,
                       (SELECT count(*) FROM runs r WHERE r.id = p.run_id)
                     FROM pending_artifacts p
                     WHERE (p.job_id <> '' AND NOT EXISTS (
                             SELECT 1 FROM stage_jobs j WHERE j.id = p.job_id
                               AND j.epoch = p.epoch AND j.status = 'claimed'))
                        OR (p.job_id = '' AND NOT EXISTS (
                             SELECT 1 FROM stages s WHERE s.run_id = p.run_id AND s.stage = p.stage
                               AND s.branch = p.branch AND s.status = 'running'))",
                    &[],
                )?,
                |r| {
                    Ok((
                        [r.get::<String>(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?],
                        r.get::<i64>(5)?,
                        r.get::<i64>(6)? > 0,
                    ))
                },
            )?;
            for ([run, stage, branch, path, job], epoch, run_exists) in stale {
                if run_exists {
                    let claim = if job.is_empty() {
                        "outside the queue".to_string()
                    } else {
                        format!("under claim {epoch}")
                    };
                    insert_event(
                        b,
                        &run,
                        Some(&stage),
                        (!branch.is_empty()).then_some(branch.as_str()),
                        "artifact-dropped",
                        &format!(
                            "artifact {path}, collected {claim}, was never committed (the claim moved on or \
                             its attempt ended): dropped, its bytes go with the garbage"
                        ),
                        None,
                    )?;
                }
                b.execute(
                    "DELETE FROM pending_artifacts WHERE run_id = $1 AND stage = $2 AND branch = $3
                       AND path = $4 AND job_id = $5 AND epoch = $6",
                    params![&run, &stage, &branch, &path, &job, epoch],
                )?;
            }
            rows(
                b.query(
                    &format!("SELECT {ARTIFACT_COLUMNS} FROM pending_artifacts ORDER BY run_id, stage, path"),
                    &[],
                )?,
                artifact_from_row,
            )
        })
    }

    pub fn artifacts(&self, run: Option<&str>) -> Result<Vec<ArtifactRecord>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    &format!(
                        "SELECT {ARTIFACT_COLUMNS} FROM artifacts
                         WHERE CAST($1 AS TEXT) IS NULL OR run_id = $1 ORDER BY run_id, stage, path"
                    ),
                    params![run],
                )?,
                artifact_from_row,
            )
        })
    }

    pub fn insert_dead_letter(&self, d: &DeadLetter) -> Result<(), StateError> {
        self.fenced(|b| insert_dead_letter(b, d))
    }

    pub fn dead_letters(&self) -> Result<Vec<DeadLetter>, StateError> {
        self.with(|b| {
            rows(
                b.query(
                    "SELECT id, run_id, stage, branch, error, failure_snapshot, input_snapshot, created_at, retried_at
                     FROM dead_letters ORDER BY created_at",
                    &[],
                )?,
                |r| {
                    Ok(DeadLetter {
                        id: r.get(0)?,
                        run_id: r.get(1)?,
                        stage: r.get(2)?,
                        branch: r.get(3)?,
                        error: r.get(4)?,
                        failure_snapshot: r.get(5)?,
                        input_snapshot: r.get(6)?,
                        created_at: r.get(7)?,
                        retried_at: r.get(8)?,
                    })
                },
            )
        })
    }

    pub fn mark_dead_letter_retried(&self, id: &str, at: i64) -> Result<(), StateError> {
        self.with(|b| {
            b.execute("UPDATE dead_letters SET retried_at = $2 WHERE id = $1", params![id, at])?;
            Ok(())
        })
    }

    /// Snapshot ids the pipeline records need (stage outputs that keys
    /// return, checkpoints retries restore, dead letters' snapshots).
    pub fn pipeline_snapshots(&self) -> Result<std::collections::HashSet<String>, StateError> {
        self.strings(&[
            "SELECT output_snapshot FROM stage_keys",
            "SELECT snapshot_id FROM checkpoints",
            "SELECT failure_snapshot FROM dead_letters WHERE failure_snapshot IS NOT NULL",
            "SELECT input_snapshot FROM dead_letters WHERE input_snapshot IS NOT NULL",
        ])
    }
}

fn upsert_stage(b: &mut dyn Backend, s: &StageRecord) -> Result<(), StateError> {
    b.execute(
        &format!(
            "INSERT INTO stages ({STAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
                     ON CONFLICT (run_id, stage, branch) DO UPDATE SET stage_key = excluded.stage_key,
                     status = excluded.status, attempts = excluded.attempts,
                     input_snapshot = excluded.input_snapshot, output_snapshot = excluded.output_snapshot,
                     sandbox_id = excluded.sandbox_id, started_at = excluded.started_at,
                     ended_at = excluded.ended_at, error = excluded.error, metric = excluded.metric"
        ),
        params![
            &s.run_id,
            &s.stage,
            &s.branch,
            &s.stage_key,
            &s.status,
            s.attempts,
            &s.input_snapshot,
            &s.output_snapshot,
            &s.sandbox_id,
            s.started_at,
            s.ended_at,
            &s.error,
            s.metric
        ],
    )?;
    Ok(())
}

fn insert_dead_letter(b: &mut dyn Backend, d: &DeadLetter) -> Result<(), StateError> {
    b.execute(
        "INSERT INTO dead_letters (id, run_id, stage, branch, error, failure_snapshot, input_snapshot,
                 created_at, retried_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        params![
            &d.id,
            &d.run_id,
            &d.stage,
            &d.branch,
            &d.error,
            &d.failure_snapshot,
            &d.input_snapshot,
            d.created_at,
            d.retried_at
        ],
    )?;
    Ok(())
}

pub fn insert_event(
    b: &mut dyn Backend,
    run: &str,
    stage: Option<&str>,
    branch: Option<&str>,
    kind: &str,
    detail: &str,
    snapshot: Option<&str>,
) -> Result<(), StateError> {
    insert_new_event(b, run, stage, branch, &NewEvent::text(kind, detail, snapshot))
}

pub fn insert_new_event(
    b: &mut dyn Backend,
    run: &str,
    stage: Option<&str>,
    branch: Option<&str>,
    e: &NewEvent,
) -> Result<(), StateError> {
    let data = e.data.as_ref().map(EventData::to_stored);
    b.execute(
        "INSERT INTO events (run_id, stage, branch, kind, detail, snapshot_id, created_at, data)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        params![run, stage, branch, e.kind, &e.detail, e.snapshot, crate::now_ms(), data],
    )?;
    Ok(())
}

/// An artifact's columns, in the order [`artifact_from_row`] reads them.
const ARTIFACT_COLUMNS: &str = "id, run_id, stage, branch, path, size_bytes, content_hash, snapshot_id";

/// An artifact recorded again under its id replaces the row whole.
const ARTIFACT_UPSERT: &str = "ON CONFLICT (id) DO UPDATE SET run_id = excluded.run_id, stage = excluded.stage, \
     branch = excluded.branch, path = excluded.path, size_bytes = excluded.size_bytes, \
     content_hash = excluded.content_hash, snapshot_id = excluded.snapshot_id";

fn artifact_from_row(r: &crate::Row) -> Result<ArtifactRecord, StateError> {
    Ok(ArtifactRecord {
        id: r.get(0)?,
        run_id: r.get(1)?,
        stage: r.get(2)?,
        branch: r.get(3)?,
        path: r.get(4)?,
        size_bytes: r.get(5)?,
        content_hash: r.get(6)?,
        snapshot_id: r.get(7)?,
    })
}

/// The claim a pending artifact is recorded under: the queue's job and
/// epoch, or ('', 0) outside the queue.
fn claim_of(fence: &Option<crate::Fence>) -> (String, i64) {
    fence
        .as_ref()
        .map(|f| (f.job.clone(), f.epoch))
        .unwrap_or_else(|| (String::new(), 0))
}

/// One losing branch whose snapshots went (a run's retention, `gc`).
#[derive(Debug, Clone, Serialize)]
pub struct CollectedBranch {
    pub run_id: String,
    pub stage: String,
    pub branch: String,
    pub snapshots: Vec<String>,
}
