//! The stage queue that workers on many hosts share (`cairn worker`), as
//! the engine shows it; the table, its claims and fences are
//! [`cairn_state::queue`]'s.

pub use cairn_state::queue::*;

impl crate::Engine {
    /// Every worker that registered on this state store.
    pub fn workers(&self) -> Result<Vec<WorkerRecord>, crate::EngineError> {
        Ok(self.db.workers()?)
    }

    /// The stage queue, oldest first.
    pub fn jobs(&self) -> Result<Vec<Job>, crate::EngineError> {
        Ok(self.db.jobs()?)
    }

    /// Whether anything executes the run now: a local orchestrator, or the
    /// queue's workers (its job queued or claimed).
    pub fn run_executed(&self, run: &str) -> bool {
        self.run_orchestrator(run).is_some() || self.queue_job(run).ok().flatten().is_some_and(|j| j.status != "done")
    }

    /// The queue's job for a run, if the run went through the queue.
    pub fn queue_job(&self, run: &str) -> Result<Option<Job>, crate::EngineError> {
        Ok(self.db.job(run)?)
    }

    /// The state store's clock (ms since the epoch): leases are on it.
    pub fn clock_ms(&self) -> Result<i64, crate::EngineError> {
        Ok(self.db.clock_ms()?)
    }
}
