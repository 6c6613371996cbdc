//! Pipelines: a file of stages that run in sandboxes forked from snapshots.
//!
//! This module holds the pipeline file format and its validation; the
//! orchestrator that runs stages against the state store builds on it.

pub mod records;
pub mod run;
pub mod spec;

pub use spec::{parse, Pipeline, PipelineError, Selection, Stage};
