//! Pipeline artifacts: files collected from a stage's sandbox into the
//! chunk store, recorded with their size and hash.

use std::fs;
use std::io::Write;

use cairn_store::ChunkHash;

use crate::error::RunError;
use crate::records::{ArtifactRecord, RunRecord};
use crate::spec::Stage;
use cairn_engine::{Engine, EngineError};

pub use cairn_engine::objects::ArtifactObject;

/// A run's artifacts: files collected from stages into the chunk store.
pub trait RunArtifacts {
    /// Writes an artifact's content to `out`, verified chunk by chunk.
    fn artifact_get(&self, key: &str, out: &mut dyn Write) -> Result<ArtifactRecord, EngineError>;
}

impl RunArtifacts for Engine {
    fn artifact_get(&self, key: &str, out: &mut dyn Write) -> Result<ArtifactRecord, EngineError> {
        // A tenant's engine finds its own runs' artifacts only.
        let mut all = self.db().artifacts(None)?;
        self.keep_mine(cairn_engine::tenants::Owned::Run, &mut all, |a| &a.run_id)?;
        let a = all
            .into_iter()
            .find(|a| a.id == key || (key.len() >= 4 && a.id.starts_with(key)))
            .ok_or_else(|| RunError::NoSuchArtifact(key.to_string()))?;
        let hash: ChunkHash = a.id.parse().map_err(|_| RunError::NoSuchArtifact(key.to_string()))?;
        let ctx = cairn_store::ReadContext::new()
            .owner("artifact", hash)
            .path(a.path.clone());
        let object: ArtifactObject = self
            .store()
            .get_object(&hash, &ctx)
            .map_err(cairn_engine::SnapshotError::from)?;
        self.store()
            .read_to_writer(&object.content, out, &ctx)
            .map_err(cairn_engine::SnapshotError::from)?;
        Ok(a)
    }
}

pub(crate) trait ArtifactSteps {
    fn collect_artifact(
        &self,
        client: &cairn_sandbox::client::InitClient,
        run: &RunRecord,
        stage: &Stage,
        branch: &str,
        path: &str,
        snapshot: &str,
    ) -> Result<u64, EngineError>;
}

impl ArtifactSteps for Engine {
    fn collect_artifact(
        &self,
        client: &cairn_sandbox::client::InitClient,
        run: &RunRecord,
        stage: &Stage,
        branch: &str,
        path: &str,
        snapshot: &str,
    ) -> Result<u64, EngineError> {
        let scratch = cairn_engine::images::ScratchDir::new(&self.home().scratch())
            .map_err(|e| RunError::Read(self.home().scratch(), e))?;
        let tmp = scratch.path().join("artifact");
        let mut f = fs::File::create(&tmp).map_err(|e| RunError::Read(tmp.clone(), e))?;
        client.get_file(path, &mut f)?;
        // Streamed: an artifact may be larger than memory.
        let mut hasher = blake3::Hasher::new();
        hasher
            .update_reader(fs::File::open(&tmp).map_err(|e| RunError::Read(tmp.clone(), e))?)
            .map_err(|e| RunError::Read(tmp.clone(), e))?;
        let hash = hasher.finalize().to_hex().to_string();
        let f = fs::File::open(&tmp).map_err(|e| RunError::Read(tmp.clone(), e))?;
        // From the first chunk stored until the row that references them is
        // committed, the chunks are garbage to the collector: it waits for
        // this shared lock (it sweeps with no grace period).
        let _lock = self.lock_store(false)?;
        let content = self.store().store_file(&f).map_err(cairn_engine::SnapshotError::from)?;
        let size = content.size;
        let object = ArtifactObject {
            path: path.to_string(),
            content,
        };
        let id = self
            .store()
            .put_object(&object)
            .map_err(cairn_engine::SnapshotError::from)?;
        // Pending until the stage's completion commits it with the stage.
        self.db().insert_pending_artifact(&ArtifactRecord {
            id: id.to_string(),
            run_id: run.id.clone(),
            stage: stage.name.clone(),
            branch: branch.to_string(),
            path: path.to_string(),
            size_bytes: size,
            content_hash: hash,
            snapshot_id: snapshot.to_string(),
        })?;
        Ok(size)
    }
}
