//! Mark-and-sweep garbage collection.
//!
//! The caller marks: it supplies every chunk hash reachable from a live
//! root (snapshot manifests, layer indexes and the file chunks they list).
//! The sweep deletes every other object older than the grace period and
//! removes temp files of interrupted writes whose writer is dead (see
//! [`crate::process`]). The grace period protects a concurrent writer
//! whose chunks are stored but not yet referenced by a committed root; a
//! caller whose writers all exclude the collector until their root is
//! committed (a lock) may pass zero.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use crate::blob::{BlobError, BlobStore};
use crate::hash::ChunkHash;

/// What a collection did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Objects listed by the backend.
    pub examined: u64,
    /// Objects kept because a live root references them.
    pub kept_live: u64,
    /// Unreferenced objects kept because they are younger than the grace
    /// period.
    pub kept_young: u64,
    pub deleted: u64,
    pub bytes_freed: u64,
    /// Temp files of interrupted writes (their writer dead) that were removed.
    pub incomplete_writes_removed: u64,
}

/// Sweeps `backend`, keeping every object in `live`, every object
/// touched within `grace`, and every write in progress.
pub fn collect_garbage<B: BlobStore + ?Sized>(
    backend: &B,
    live: impl IntoIterator<Item = ChunkHash>,
    grace: Duration,
) -> Result<GcReport, BlobError> {
    let live: HashSet<ChunkHash> = live.into_iter().collect();
    let now = SystemTime::now();
    let mut report = GcReport::default();
    let mut doomed = Vec::new();
    for object in backend.list()? {
        report.examined += 1;
        if live.contains(&object.key) {
            report.kept_live += 1;
            continue;
        }
        // A modification time in the future (clock step) counts as young.
        let old = now
            .duration_since(object.modified)
            .map(|age| age >= grace)
            .unwrap_or(false);
        if !old {
            report.kept_young += 1;
            continue;
        }
        doomed.push(object);
    }
    let keys: Vec<ChunkHash> = doomed.iter().map(|o| o.key).collect();
    for (object, deleted) in doomed.iter().zip(backend.delete_many(&keys)?) {
        if deleted {
            report.deleted += 1;
            report.bytes_freed += object.size;
        }
    }
    report.incomplete_writes_removed = backend.remove_incomplete_writes()?.removed;
    Ok(report)
}
