//! Pipelines: a file of stages that run in sandboxes forked from snapshots,
//! over the engine's sandboxes and snapshots; the stage queue that workers
//! on many hosts share (`queue`, `worker`).
//!
//! `spec` parses and checks the file; `run` is the orchestrator (stage keys,
//! attempts, checkpoints, retries, dead letters); `branches` runs branch
//! groups and picks winners; `artifacts` collects files into the chunk
//! store; `output` takes stage output in with bounded memory; `records`
//! (the state store's [`cairn_state::runs`]) holds the rows all of it
//! writes, `lineage` ([`cairn_state::lineage`]) the typed fields of its
//! events; `approval` pauses a run before a stage until a person approves
//! it; `decide` asks a model at a decide
//! stage and records its answer, which `decision` checks; `queued` is a
//! run through the shared stage queue (a worker's side and the enqueuer's);
//! `audit` reads a run's events back as where its time and bytes went;
//! `graph` gives a run's stages with the stage each one comes after.
//! `error`, `watch` and `render` are what `run` shares with the others (a
//! run's errors, who watches it, a stage's text); `gc` is `cairn gc` with
//! the pipelines' part; `attempts` the attempts this process runs under
//! queue claims.
//!
//! The operations are methods of [`cairn_engine::Engine`] through this
//! crate's traits: `use cairn_pipeline::prelude::*` brings them in.

pub mod approval;
pub mod artifacts;
mod attempts;
pub mod audit;
mod branches;
mod decide;
pub mod decision;
mod error;
pub mod gc;
pub mod graph;
pub use cairn_state::lineage;
mod output;
pub mod queue;
mod queued;
mod render;
pub use cairn_state::runs as records;
pub mod retention;
pub mod run;
pub mod spec;
mod watch;
pub mod worker;

pub use output::{METRIC_FILE_MAX, OUTPUT_TAIL};
pub use spec::{parse, Pipeline, PipelineError, Selection, Stage};

use cairn_engine::EngineError;

/// The traits that make pipelines' operations methods of [`cairn_engine::Engine`].
pub mod prelude {
    pub use crate::approval::RunApprovals;
    pub use crate::artifacts::RunArtifacts;
    pub use crate::audit::RunAudits;
    pub use crate::decide::RunDecisions;
    pub use crate::gc::Gc;
    pub use crate::graph::RunGraph;
    pub use crate::queue::StageQueue;
    pub use crate::queued::QueuedRuns;
    pub use crate::run::Runs;
    pub use crate::worker::Workers;
}

/// The steps the crate's modules share, methods of [`cairn_engine::Engine`] too.
mod steps {
    pub(crate) use crate::approval::ApprovalSteps;
    pub(crate) use crate::artifacts::ArtifactSteps;
    pub(crate) use crate::branches::BranchSteps;
    pub(crate) use crate::decide::DecideSteps;
    pub(crate) use crate::queued::QueuedSteps;
    pub(crate) use crate::run::RunSteps;
}

impl From<run::RunError> for EngineError {
    fn from(e: run::RunError) -> EngineError {
        EngineError::Domain(Box::new(e))
    }
}
