//! Who watches a run: its stages' changes of state and their output.

/// Receives progress of a run.
pub trait RunWatcher: Sync {
    /// A stage (or branch) changed state.
    fn stage(&self, stage: &str, branch: &str, status: &str, detail: &str);
    /// Output of a stage's commands.
    fn output(&self, stage: &str, branch: &str, data: &[u8]);
}

pub struct Quiet;

impl RunWatcher for Quiet {
    fn stage(&self, _: &str, _: &str, _: &str, _: &str) {}
    fn output(&self, _: &str, _: &str, _: &[u8]) {}
}
