//! What a run's operations answer when they cannot go on.

use std::path::PathBuf;

use crate::output::METRIC_FILE_MAX;
use crate::spec;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Spec(#[from] spec::PipelineError),
    #[error("cannot read {0}: {1}")]
    Read(PathBuf, std::io::Error),
    #[error("no run matches {0:?}; `cairn pipeline ls` lists them")]
    NoSuchRun(String),
    #[error("invalid run id {0:?}: a run id is 12 lowercase hex digits")]
    BadRunId(String),
    #[error("run {0} already completed")]
    Completed(String),
    #[error("no dead letter matches {0:?}; `cairn dlq ls` lists them")]
    NoSuchDeadLetter(String),
    #[error("dead letter {0} was already retried")]
    AlreadyRetried(String),
    #[error("no artifact matches {0:?}; `cairn pipeline show RUN` lists a run's artifacts")]
    NoSuchArtifact(String),
    #[error("--param takes KEY=VALUE, got {0:?}")]
    BadParam(String),
    #[error("{0}")]
    Lost(String),
    /// A stage name that is not in the run's pipeline; lists the ones that are.
    #[error("{0}")]
    NoSuchStage(String),
    /// An approval or rejection the stage's state does not allow; says why and what to do.
    #[error("{0}")]
    NotAwaitingApproval(String),
    /// A decide stage's model cannot be asked: none named, an unknown
    /// provider, no API key. Nothing was recorded or run.
    #[error("{0}")]
    NoModel(String),
    /// A decide stage's model did not answer (an outage, a refused request);
    /// the run is left interrupted and resumable.
    #[error("{0}")]
    Model(String),
    /// A verdict's reason that is missing or too long.
    #[error("{0}")]
    BadReason(String),
    /// A stage or branch name that cannot become a path (`names::RULE`).
    #[error("{0}")]
    BadName(String),
    #[error(
        "metric file {0} holds more than {limit} MiB, the most a metric file may hold; write the number alone \
         (or a short summary) to it, and keep larger results as artifacts",
        limit = METRIC_FILE_MAX >> 20
    )]
    MetricTooLarge(String),
    #[error(
        "run {run} is being executed by another cairn process{}; wait for it to end, or stop it and \
         run `cairn pipeline resume {run}`",
        .pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Busy { run: String, pid: Option<u32> },
    #[error(
        "run {run} is queued for `cairn worker`s (held by {worker}); follow it with `cairn pipeline show {run}`; \
         a worker that stops or dies loses it to another once its lease expires"
    )]
    Queued { run: String, worker: String },
}
