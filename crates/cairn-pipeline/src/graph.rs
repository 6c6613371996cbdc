//! A run's stages as a graph: which stage each one forks the output of.
//!
//! No table holds the edges: every run stores the pipeline file it was
//! started with, and the edges are read from it, so runs recorded before
//! the graph was shown have one too. The orchestrator decides a stage's
//! input the same way: the output of the stage its `after` names (a
//! branch group's winner), or, for a stage without `after`, the pipeline's
//! `snapshot` or a fresh sandbox of its `image`, never the stage listed
//! before it.

use serde::Serialize;

use crate::records::RunRecord;
use crate::steps::*;
use crate::Pipeline;
use cairn_engine::Engine;

/// One stage of a run's pipeline and what its sandbox starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StageEdges {
    pub stage: String,
    /// The stages whose output this one forks: one at most (a pipeline
    /// file's `after` names a single stage); none when it starts from the
    /// pipeline's snapshot or image.
    pub after: Vec<String>,
}

/// The pipeline's stages with their edges, in the order the orchestrator
/// runs them (every stage after the stages it comes after).
pub fn edges(pipeline: &Pipeline) -> Vec<StageEdges> {
    pipeline
        .stages
        .iter()
        .map(|s| StageEdges {
            stage: s.name.clone(),
            after: s.after.clone(),
        })
        .collect()
}

/// A run's stages with the stage each one comes after.
pub trait RunGraph {
    /// The edges of a run's stages, read from the pipeline file the run
    /// stored; `None` when that file no longer parses (a run recorded by a
    /// release whose files this one refuses, or one written by hand).
    fn run_graph(&self, run: &RunRecord) -> Option<Vec<StageEdges>>;
}

impl RunGraph for Engine {
    fn run_graph(&self, run: &RunRecord) -> Option<Vec<StageEdges>> {
        self.parsed_run(run).ok().map(|p| edges(&p))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn two_stages_after_one_share_their_parent_and_a_stage_without_after_is_a_root() {
        let text = r#"
[pipeline]
name = "tree"
image = "busybox"

[[stage]]
name = "left"
after = "prepare"
key = "l"
run = ["true"]

[[stage]]
name = "prepare"
key = "p"
run = ["true"]

[[stage]]
name = "right"
after = "prepare"
key = "r"
run = ["true"]

[[stage]]
name = "alone"
key = "a"
run = ["true"]
"#;
        let p = super::super::parse("tree.toml", text, &BTreeMap::new()).unwrap();
        let got = edges(&p);
        let after = |name: &str| got.iter().find(|e| e.stage == name).map(|e| e.after.clone()).unwrap();
        assert_eq!(after("left"), ["prepare"]);
        assert_eq!(after("right"), ["prepare"]);
        assert!(after("prepare").is_empty() && after("alone").is_empty());
        // Run order puts a parent first, whatever the file's order.
        let at = |name: &str| got.iter().position(|e| e.stage == name).unwrap();
        assert!(at("prepare") < at("left") && at("prepare") < at("right"));
    }
}
