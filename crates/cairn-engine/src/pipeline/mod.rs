//! Pipelines: a file of stages that run in sandboxes forked from snapshots.
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

pub mod approval;
pub mod artifacts;
pub mod audit;
mod branches;
mod decide;
pub mod decision;
pub mod graph;
pub use cairn_state::lineage;
mod output;
mod queued;
pub use cairn_state::runs as records;
pub mod retention;
pub mod run;
pub mod spec;

pub use output::{METRIC_FILE_MAX, OUTPUT_TAIL};
pub use spec::{parse, Pipeline, PipelineError, Selection, Stage};
