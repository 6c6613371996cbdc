//! What the E2B-compatible gateway keeps in the state store: sandboxes by
//! the id the SDK holds (running as a Cairn sandbox, or paused as a
//! snapshot) and the snapshots it made. Schema and durability notes:
//! `migrations/sqlite/0005_e2b.sql`.

pub use cairn_state::e2b::*;

use crate::{Engine, EngineError};

impl Engine {
    pub fn put_e2b_sandbox(&self, s: &E2bSandbox) -> Result<(), EngineError> {
        Ok(self.db.put_e2b_sandbox(s)?)
    }

    pub fn e2b_sandboxes(&self) -> Result<Vec<E2bSandbox>, EngineError> {
        Ok(self.db.e2b_sandboxes()?)
    }

    pub fn delete_e2b_sandbox(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db.delete_e2b_sandbox(id)?)
    }

    pub fn insert_e2b_snapshot(&self, s: &E2bSnapshot) -> Result<(), EngineError> {
        Ok(self.db.insert_e2b_snapshot(s)?)
    }

    pub fn e2b_snapshots(&self) -> Result<Vec<E2bSnapshot>, EngineError> {
        Ok(self.db.e2b_snapshots()?)
    }

    pub fn delete_e2b_snapshot(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db.delete_e2b_snapshot(id)?)
    }
}
