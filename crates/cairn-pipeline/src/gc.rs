//! `cairn gc` with the pipelines' part: the engine's collection
//! ([`Engine::gc_with`]), with the stage sandboxes whose queue claim moved
//! on reaped before exited sandboxes go, and the losing branches past their
//! run's retention collected before layers and chunks are swept.

use cairn_engine::sandboxes::CollectAbove;
use cairn_engine::{Engine, EngineError, GcReport};

use crate::retention::RetentionSteps;
use crate::worker::Workers;

/// Garbage collection of a state directory, pipelines' leftovers with it.
pub trait Gc {
    /// Reconciles, then removes exited sandboxes (and stage sandboxes whose
    /// claim moved on), cgroups and directories no row accounts for, losing
    /// branches past retention, unreferenced layers and chunks, and
    /// interrupted temporaries.
    fn gc(&mut self) -> Result<GcReport, EngineError>;
}

impl Gc for Engine {
    fn gc(&mut self) -> Result<GcReport, EngineError> {
        self.gc_with(&mut Pipelines)
    }
}

/// The pipelines' part of a collection.
struct Pipelines;

impl CollectAbove for Pipelines {
    fn before_sandboxes(&mut self, engine: &mut Engine, report: &mut GcReport) -> Result<(), EngineError> {
        let orphans = engine.reap_orphans()?;
        report
            .sandboxes_removed
            .extend(orphans.iter().map(|o| o.sandbox_id.clone()));
        report.orphans_reaped = orphans;
        Ok(())
    }

    fn before_chunks(&mut self, engine: &mut Engine, report: &mut GcReport) -> Result<(), EngineError> {
        report.losers_collected = engine.collect_losers(cairn_engine::now_ms())?;
        Ok(())
    }
}
