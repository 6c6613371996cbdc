//! Typed lineage: the fields each run event carries beside its sentence.
//!
//! An event's sentence (`detail`) is rendered from its fields when it is
//! recorded; the fields are stored too (`events.data`, JSON with a version,
//! docs/formats.md "Run events"), so the text tree, `--json`, the API and
//! `cairn audit` read one record instead of parsing sentences.

use serde::{Deserialize, Serialize};

/// The version of the stored form of [`EventData`]. A reader refuses any
/// other with an error that says to upgrade Cairn.
pub const EVENT_DATA_VERSION: u32 = 2;

/// The typed fields of one run event. Times are milliseconds; byte counts
/// are what the snapshot stored anew (after deduplication, before
/// compression).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum EventData {
    /// The run was recorded (kind `started`).
    RunStarted { pipeline: String, file: String },
    /// Every stage completed (kind `completed`, no stage).
    RunCompleted { output_snapshot: Option<String> },
    /// A stage went to the dead letters and the run ended (kind `failed`, no branch).
    RunFailed { error: String },
    /// A completed stage key was found and its output reused (kind `reused`).
    Reused {
        stage_key: String,
        from_run: String,
        output_snapshot: String,
    },
    /// An attempt began in a new sandbox (kind `forked` for the first,
    /// `retry` after). `parent_snapshot` is what the sandbox was made from:
    /// `checkpoint` when that was the stage's newest checkpoint, the
    /// stage's input otherwise; neither when it started from `image`.
    Attempt {
        attempt: u32,
        parent_snapshot: Option<String>,
        checkpoint: Option<String>,
        image: Option<String>,
        /// Making the sandbox: restoring the snapshot, or creating it.
        restore_ms: u64,
    },
    /// An attempt succeeded (kind `completed`).
    StageCompleted {
        attempt: u32,
        output_snapshot: String,
        /// Edits written before the commands.
        setup_ms: u64,
        /// The stage's commands.
        compute_ms: u64,
        /// The output snapshot.
        snapshot_ms: u64,
        /// Artifacts collected into the store.
        artifacts_ms: u64,
        state_bytes: u64,
        artifact_bytes: u64,
        /// Each command's time, in order (part of `compute_ms`).
        command_ms: Vec<u64>,
        metric: Option<f64>,
    },
    /// An attempt failed (kind `failed`).
    StageFailed {
        attempt: u32,
        error: String,
        failure_snapshot: Option<String>,
        setup_ms: u64,
        compute_ms: u64,
    },
    /// Retries ran out (kind `dead`).
    Dead {
        attempts: u32,
        dead_letter: String,
        error: String,
        failure_snapshot: Option<String>,
    },
    /// A dead letter was retried (kind `retry`).
    DeadLetterRetried { dead_letter: String },
    /// A periodic checkpoint of a running stage (kind `checkpoint`).
    Checkpoint {
        snapshot: String,
        took_ms: u64,
        state_bytes: u64,
        /// Checkpoints' share of the stage's time so far, and its bound.
        share_percent: f64,
        limit_percent: f64,
        next_in_ms: u64,
    },
    /// The branch that won its group (kind `won`; the event's branch is it).
    Won {
        branch: String,
        /// `first_success`, `min`, `max`, or who chose it for a deferred group.
        rule: String,
        metric: Option<f64>,
        runner_up: Option<String>,
        runner_up_metric: Option<f64>,
        /// The model or person that chose, when the group's rule did not.
        chosen_by: Option<String>,
        /// Why, when a model or a person chose.
        reason: Option<String>,
    },
    /// A branch that did not win (kind `lost`).
    Lost {
        branch: String,
        winner: String,
        rule: String,
        /// How the branch ended: completed, dead, …
        ended: String,
        metric: Option<f64>,
        winner_metric: Option<f64>,
        chosen_by: Option<String>,
        reason: Option<String>,
    },
    /// A decide stage's answer (kind `decided`).
    Decided {
        round: u32,
        model: String,
        /// The answer in brief: hypotheses, parameters, action.
        chose: String,
        reason: String,
        input_tokens: u64,
        output_tokens: u64,
        calls: u32,
        /// At list price, when the model's is known.
        cost_usd: Option<f64>,
        /// What it does to the stage before: it runs again, or its dead letter.
        then: Option<String>,
    },
    /// A planner's or agent's plan for a run (kind `plan`).
    Plan {
        by: String,
        context: String,
        reason: String,
    },
    /// A person's verdict on a stage waiting for approval (kinds
    /// `approved`, `rejected`).
    Verdict {
        approved: bool,
        by: String,
        reason: Option<String>,
    },
    /// A losing branch's snapshots (its output and checkpoints) removed
    /// under the run's retention, `keep = "winners"` (kind `collected`);
    /// its rows and events stay.
    Collected {
        snapshots: Vec<String>,
        /// `keep_losers_for`, in seconds.
        kept_for_secs: u64,
    },
}

fn short(id: &str) -> &str {
    &id[..12.min(id.len())]
}

fn num(m: Option<f64>) -> String {
    m.map(|m| m.to_string()).unwrap_or_else(|| "no metric".into())
}

impl EventData {
    /// The event's kind (the `events.kind` column).
    pub fn kind(&self) -> &'static str {
        match self {
            EventData::RunStarted { .. } => "started",
            EventData::RunCompleted { .. } | EventData::StageCompleted { .. } => "completed",
            EventData::RunFailed { .. } | EventData::StageFailed { .. } => "failed",
            EventData::Reused { .. } => "reused",
            EventData::Attempt { attempt, .. } if *attempt > 1 => "retry",
            EventData::Attempt { .. } => "forked",
            EventData::Dead { .. } => "dead",
            EventData::DeadLetterRetried { .. } => "retry",
            EventData::Checkpoint { .. } => "checkpoint",
            EventData::Won { .. } => "won",
            EventData::Lost { .. } => "lost",
            EventData::Decided { .. } => "decided",
            EventData::Plan { .. } => "plan",
            EventData::Verdict { approved: true, .. } => "approved",
            EventData::Verdict { approved: false, .. } => "rejected",
            EventData::Collected { .. } => "collected",
        }
    }

    /// The branch the event is about when it is not the row's (a group's
    /// `won` is about its winner).
    pub fn branch(&self) -> Option<&str> {
        match self {
            EventData::Won { branch, .. } => Some(branch),
            _ => None,
        }
    }

    /// The sentence people read (`detail`).
    pub fn sentence(&self) -> String {
        match self {
            EventData::Collected {
                snapshots,
                kept_for_secs,
            } => format!(
                "{} snapshot(s) of this losing branch collected {kept_for_secs} s after the run ended \
                 (keep = \"winners\"); what it tried and why it lost stay",
                snapshots.len()
            ),
            EventData::RunStarted { pipeline, file } => format!("pipeline {pipeline} from {file}"),
            EventData::RunCompleted { .. } => "every stage completed".into(),
            EventData::RunFailed { error } => error.clone(),
            EventData::Reused {
                stage_key, from_run, ..
            } => format!("stage key {stage_key} completed in run {from_run}; its output is reused"),
            EventData::Attempt {
                attempt,
                parent_snapshot,
                checkpoint,
                image,
                restore_ms,
            } => match (checkpoint, parent_snapshot) {
                (Some(c), _) => format!("attempt {attempt} restores checkpoint {} ({restore_ms} ms)", short(c)),
                (None, Some(p)) => format!("attempt {attempt} forks {} ({restore_ms} ms)", short(p)),
                (None, None) => format!(
                    "attempt {attempt} starts from image {} ({restore_ms} ms)",
                    image.as_deref().unwrap_or("busybox")
                ),
            },
            EventData::StageCompleted {
                attempt,
                setup_ms,
                compute_ms,
                snapshot_ms,
                state_bytes,
                ..
            } => format!(
                "completed on attempt {attempt}: setup {setup_ms} ms, compute {compute_ms} ms, \
                 snapshot {snapshot_ms} ms of {state_bytes} new bytes"
            ),
            EventData::StageFailed { error, .. } => error.clone(),
            EventData::Dead {
                attempts, dead_letter, ..
            } => format!("retries exhausted after {attempts} attempts; dead letter {dead_letter}"),
            EventData::DeadLetterRetried { dead_letter } => format!("dead letter {dead_letter} retried"),
            EventData::Checkpoint {
                took_ms,
                share_percent,
                limit_percent,
                next_in_ms,
                ..
            } => format!(
                "periodic checkpoint of the running stage: took {took_ms} ms; checkpoints so far \
                 {share_percent:.1}% of the stage's time (at most {limit_percent:.0}%); the next in {:.1} s",
                *next_in_ms as f64 / 1000.0
            ),
            EventData::Won {
                branch,
                rule,
                metric,
                runner_up,
                runner_up_metric,
                chosen_by,
                reason,
            } => {
                let mut s = match chosen_by {
                    Some(by) => format!("{branch} won, chosen {rule} by {by}"),
                    None => format!("{branch} won under {rule}"),
                };
                if let Some(m) = metric {
                    s += &format!(" with {m}");
                }
                if let Some(r) = runner_up {
                    s += &format!("; runner-up {r}");
                    if let Some(m) = runner_up_metric {
                        s += &format!(" with {m}");
                    }
                }
                if let Some(why) = reason {
                    s += &format!(": {why}");
                }
                s
            }
            EventData::Lost {
                winner,
                rule,
                ended,
                metric,
                winner_metric,
                chosen_by,
                reason,
                ..
            } => {
                let mut s = match (ended.as_str(), metric) {
                    (status, _) if chosen_by.is_some() => format!(
                        "lost to {winner} (chosen {rule} by {}; it ended {status})",
                        chosen_by.as_deref().unwrap_or_default()
                    ),
                    ("completed", Some(m)) => {
                        format!(
                            "lost under {rule}: metric {m} against the winner's {}",
                            num(*winner_metric)
                        )
                    }
                    ("completed", None) if rule == "first_success" => {
                        format!("lost under {rule}: finished later than {winner}")
                    }
                    ("completed", None) => format!("lost to {winner} under {rule}"),
                    (status, _) => format!("lost to {winner}: it ended {status}"),
                };
                if let Some(why) = reason {
                    s += &format!(": {why}");
                }
                s
            }
            EventData::Decided {
                model,
                chose,
                reason,
                input_tokens,
                output_tokens,
                calls,
                cost_usd,
                then,
                ..
            } => format!(
                "{model} chose {chose} — {reason} ({input_tokens} tokens in, {output_tokens} out, {calls} call(s){}){}",
                cost_usd.map(|c| format!(", ${c:.4}")).unwrap_or_default(),
                then.as_deref().map(|t| format!("; {t}")).unwrap_or_default()
            ),
            EventData::Plan { by, context, reason } => format!("by {by}: {context} — because {reason}"),
            EventData::Verdict { approved, by, reason } => format!(
                "{} by {by}{}",
                if *approved { "approved" } else { "rejected" },
                reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
            ),
        }
    }

    /// The stored form: `{"v": N, "type": …, fields…}`, N the first
    /// version that has the type (2 for `collected`, 1 for the rest), so a
    /// Cairn that knows only version 1 still reads every event it knows.
    pub fn to_stored(&self) -> String {
        let mut v = serde_json::to_value(self).expect("event data serialises");
        v["v"] = match self {
            EventData::Collected { .. } => 2,
            _ => 1,
        }
        .into();
        v.to_string()
    }

    /// Reads the stored form back, refusing another version, an unknown
    /// type or field, or damaged text with an error saying which.
    pub fn from_stored(text: &str) -> Result<EventData, String> {
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("event data is not JSON ({e})"))?;
        let version = v.as_object_mut().and_then(|o| o.remove("v"));
        match version.as_ref().and_then(|v| v.as_u64()) {
            Some(n) if (1..=u64::from(EVENT_DATA_VERSION)).contains(&n) => {}
            Some(n) if n > u64::from(EVENT_DATA_VERSION) => {
                return Err(format!(
                    "event data version {n} is newer than this Cairn reads ({EVENT_DATA_VERSION}); upgrade Cairn"
                ))
            }
            _ => {
                return Err(format!(
                    "event data has no version this Cairn reads ({EVENT_DATA_VERSION})"
                ))
            }
        }
        serde_json::from_value(v).map_err(|e| format!("event data does not match version {EVENT_DATA_VERSION}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn won() -> EventData {
        EventData::Won {
            branch: "small".into(),
            rule: "min".into(),
            metric: Some(1.5),
            runner_up: Some("large".into()),
            runner_up_metric: Some(2.0),
            chosen_by: None,
            reason: None,
        }
    }

    #[test]
    fn stored_event_data_round_trips() {
        let w = won();
        let text = w.to_stored();
        assert!(text.contains("\"v\":1"), "{text}");
        assert_eq!(EventData::from_stored(&text).unwrap(), w);
        assert_eq!(w.kind(), "won");
        assert_eq!(w.branch(), Some("small"));
        assert_eq!(w.sentence(), "small won under min with 1.5; runner-up large with 2");
    }

    #[test]
    fn future_unknown_or_damaged_event_data_is_refused() {
        let mut v: serde_json::Value = serde_json::from_str(&won().to_stored()).unwrap();
        v["v"] = 3.into();
        assert!(EventData::from_stored(&v.to_string())
            .unwrap_err()
            .contains("upgrade Cairn"));
        v["v"] = 1.into();
        v["extra"] = 1.into();
        assert!(EventData::from_stored(&v.to_string()).unwrap_err().contains("extra"));
        let no_version = serde_json::to_string(&won()).unwrap();
        assert!(EventData::from_stored(&no_version).is_err());
        assert!(EventData::from_stored("{\"v\":1,\"type\":\"nope\"}").is_err());
        assert!(EventData::from_stored("{not json").is_err());
    }

    #[test]
    fn retries_and_first_attempts_have_their_kinds() {
        let a = |attempt| EventData::Attempt {
            attempt,
            parent_snapshot: Some("a".repeat(64)),
            checkpoint: (attempt > 1).then(|| "c".repeat(64)),
            image: None,
            restore_ms: 3,
        };
        assert_eq!(a(1).kind(), "forked");
        assert_eq!(a(2).kind(), "retry");
        assert!(a(2).sentence().contains("restores checkpoint cccccccccccc"));
    }
}
