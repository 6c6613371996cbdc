//! What the E2B-compatible gateway keeps in the state store: sandboxes by
//! the id the SDK holds (running as a Cairn sandbox, or paused as a
//! snapshot) and the snapshots it made. Schema and durability notes:
//! `migrations/sqlite/0005_e2b.sql`.

pub use cairn_engine::state::e2b::*;

use cairn_engine::{Engine, EngineError};

/// The gateway's book: its sandboxes by the id the SDK holds, and the\nsnapshots it made.
pub trait E2bBook {
    fn put_e2b_sandbox(&self, s: &E2bSandbox) -> Result<(), EngineError>;

    fn e2b_sandboxes(&self) -> Result<Vec<E2bSandbox>, EngineError>;

    fn delete_e2b_sandbox(&self, id: &str) -> Result<bool, EngineError>;

    fn insert_e2b_snapshot(&self, s: &E2bSnapshot) -> Result<(), EngineError>;

    fn e2b_snapshots(&self) -> Result<Vec<E2bSnapshot>, EngineError>;

    fn delete_e2b_snapshot(&self, id: &str) -> Result<bool, EngineError>;
}

impl E2bBook for Engine {
    fn put_e2b_sandbox(&self, s: &E2bSandbox) -> Result<(), EngineError> {
        Ok(self.db().put_e2b_sandbox(s)?)
    }

    fn e2b_sandboxes(&self) -> Result<Vec<E2bSandbox>, EngineError> {
        Ok(self.db().e2b_sandboxes()?)
    }

    fn delete_e2b_sandbox(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db().delete_e2b_sandbox(id)?)
    }

    fn insert_e2b_snapshot(&self, s: &E2bSnapshot) -> Result<(), EngineError> {
        Ok(self.db().insert_e2b_snapshot(s)?)
    }

    fn e2b_snapshots(&self) -> Result<Vec<E2bSnapshot>, EngineError> {
        Ok(self.db().e2b_snapshots()?)
    }

    fn delete_e2b_snapshot(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db().delete_e2b_snapshot(id)?)
    }
}
