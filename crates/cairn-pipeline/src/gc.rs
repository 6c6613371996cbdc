//! `cairn gc` with the pipelines' part: the engine's collection
//! ([`Engine::gc_with`]), with the stage sandboxes whose queue claim moved
//! on reaped before exited sandboxes go, and the losing branches past their
//! run's retention collected before layers and chunks are swept.

use cairn_engine::sandboxes::CollectAbove;
use cairn_engine::state::queue::Orphan;
use cairn_engine::state::runs::CollectedBranch;
use cairn_engine::{Engine, EngineError};

use crate::retention::RetentionSteps;
use crate::worker::Workers;

/// What `cairn gc` released: the engine's collection, and the pipelines'
/// part (in `--json`, its fields follow the engine's in one object).
#[derive(Debug, Default, serde::Serialize)]
pub struct GcReport {
    #[serde(flatten)]
    pub engine: cairn_engine::GcReport,
    /// Stage sandboxes whose queue claim had moved on (see
    /// [`Workers::reap_orphans`]), recorded on their run and removed.
    pub orphans_reaped: Vec<Orphan>,
    /// Losing branches whose snapshots went under their run's retention
    /// (`keep = "winners"`, docs/pipelines.md).
    pub losers_collected: Vec<CollectedBranch>,
}

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
        let mut pipelines = Pipelines::default();
        let engine = self.gc_with(&mut pipelines)?;
        Ok(GcReport {
            engine,
            orphans_reaped: pipelines.orphans_reaped,
            losers_collected: pipelines.losers_collected,
        })
    }
}

/// The pipelines' part of a collection, and what it collected.
#[derive(Default)]
struct Pipelines {
    orphans_reaped: Vec<Orphan>,
    losers_collected: Vec<CollectedBranch>,
}

impl CollectAbove for Pipelines {
    fn before_sandboxes(
        &mut self,
        engine: &mut Engine,
        report: &mut cairn_engine::GcReport,
    ) -> Result<(), EngineError> {
        let orphans = engine.reap_orphans()?;
        report
            .sandboxes_removed
            .extend(orphans.iter().map(|o| o.sandbox_id.clone()));
        self.orphans_reaped = orphans;
        Ok(())
    }

    fn before_chunks(&mut self, engine: &mut Engine) -> Result<(), EngineError> {
        self.losers_collected = engine.collect_losers(cairn_engine::now_ms())?;
        Ok(())
    }
}
