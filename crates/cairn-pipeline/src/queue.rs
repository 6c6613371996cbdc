//! The stage queue that workers on many hosts share (`cairn worker`), as
//! the engine shows it; the table, its claims and fences are
//! [`cairn_state::queue`]'s.

pub use cairn_state::queue::*;

use cairn_engine::Engine;

use crate::prelude::*;

/// The shared stage queue as the engine shows it: workers, jobs, the store's clock.
pub trait StageQueue {
    /// Every worker that registered on this state store.
    fn workers(&self) -> Result<Vec<WorkerRecord>, cairn_engine::EngineError>;

    /// The stage queue, oldest first.
    fn jobs(&self) -> Result<Vec<Job>, cairn_engine::EngineError>;

    /// Whether anything executes the run now: a local orchestrator, or the
    /// queue's workers (its job queued or claimed).
    fn run_executed(&self, run: &str) -> bool;

    /// The queue's job for a run, if the run went through the queue.
    fn queue_job(&self, run: &str) -> Result<Option<Job>, cairn_engine::EngineError>;

    /// The state store's clock (ms since the epoch): leases are on it.
    fn clock_ms(&self) -> Result<i64, cairn_engine::EngineError>;
}

impl StageQueue for Engine {
    fn workers(&self) -> Result<Vec<WorkerRecord>, cairn_engine::EngineError> {
        Ok(self.db().workers()?)
    }

    fn jobs(&self) -> Result<Vec<Job>, cairn_engine::EngineError> {
        Ok(self.db().jobs()?)
    }

    fn run_executed(&self, run: &str) -> bool {
        self.run_orchestrator(run).is_some() || self.queue_job(run).ok().flatten().is_some_and(|j| j.status != "done")
    }

    fn queue_job(&self, run: &str) -> Result<Option<Job>, cairn_engine::EngineError> {
        Ok(self.db().job(run)?)
    }

    fn clock_ms(&self) -> Result<i64, cairn_engine::EngineError> {
        Ok(self.db().clock_ms()?)
    }
}
