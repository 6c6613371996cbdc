//! Snapshots durable in the remote chunk store.
//!
//! With `--store s3://…` chunks land in the local cache and are uploaded
//! behind (`cairn_store::TieredStore`). A snapshot is marked durable
//! (`snapshots.remote_durable_at`) only once every object it reaches is
//! confirmed remote; until then only this host can restore it.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::{Engine, EngineError, SnapshotError};

impl Engine {
    /// Waits up to `wait` for pending uploads, then marks durable every
    /// snapshot whose objects are all remote; returns the ids it marked.
    /// A home without a remote store marks nothing. Uploads still pending
    /// after `wait` are an error once the rest is marked (they stay
    /// queued, and the next process resumes them).
    pub fn mark_remote_durable(&self, wait: Duration) -> Result<Vec<String>, EngineError> {
        self.mark_durable_among(None, wait)
    }

    /// [`mark_remote_durable`](Self::mark_remote_durable) for the snapshots
    /// `ids` alone (a commit under a queue claim checks what it names, not
    /// every snapshot of every host).
    pub fn mark_remote_durable_ids(&self, ids: &[&str], wait: Duration) -> Result<Vec<String>, EngineError> {
        self.mark_durable_among(Some(ids), wait)
    }

    fn mark_durable_among(&self, only: Option<&[&str]>, wait: Duration) -> Result<Vec<String>, EngineError> {
        let backend = self.store.backend();
        if !backend.is_remote() {
            return Ok(Vec::new());
        }
        let flushed = backend.flush(wait);
        let mut pending = self.db.snapshots_not_remote_durable()?;
        if let Some(ids) = only {
            pending.retain(|id| ids.contains(&id.as_str()));
        }
        let mut marked = Vec::new();
        if !pending.is_empty() {
            for snap in self.db.snapshots()?.into_iter().filter(|s| pending.contains(&s.id)) {
                // Another host's snapshot whose objects are still on their
                // way (or never will be: that host died) cannot be read
                // whole: it stays unmarked, and marks nothing else.
                let layers: HashSet<String> = snap.layers.iter().cloned().collect();
                let Ok(objects) = self.reachable_objects(&layers, std::slice::from_ref(&snap), &HashSet::new()) else {
                    continue;
                };
                if backend.not_remote(objects).map_err(SnapshotError::from)?.is_empty() {
                    self.db.mark_snapshot_remote_durable(&snap.id, crate::now_ms())?;
                    marked.push(snap.id);
                }
            }
        }
        flushed.map_err(SnapshotError::from)?;
        Ok(marked)
    }

    /// Of `objects`, those not in the remote store once the uploads pending
    /// have had up to `wait` to finish: the store check of a commit under
    /// a claim (an attempt's artifacts).
    pub fn not_yet_remote(
        &self,
        objects: Vec<cairn_store::ChunkHash>,
        wait: Duration,
    ) -> Result<Vec<cairn_store::ChunkHash>, EngineError> {
        let backend = self.store.backend();
        backend.flush(wait).map_err(SnapshotError::from)?;
        Ok(backend.not_remote(objects).map_err(SnapshotError::from)?)
    }

    /// The store check a commit under a claim makes of an artifact's
    /// objects ([`Self::not_yet_remote`]), made of every object snapshot
    /// `id` reaches (an artifact of the same files holds the same chunks),
    /// for benchmarks. Returns the objects checked, how many of them are
    /// not remote, and the time taken.
    pub fn bench_remote_check(&self, id: &str) -> Result<(usize, usize, Duration), EngineError> {
        let snap = self.snapshot_record(id)?;
        let layers: HashSet<String> = snap.layers.iter().cloned().collect();
        let objects = self.reachable_objects(&layers, std::slice::from_ref(&snap), &HashSet::new())?;
        let count = objects.len();
        let t0 = std::time::Instant::now();
        let missing = self.not_yet_remote(objects, Duration::from_secs(600))?;
        Ok((count, missing.len(), t0.elapsed()))
    }

    /// Reads every object snapshot `id` reaches straight from the remote
    /// store, past the cache, `streams` requests at a time: the store's own
    /// GET rate for this snapshot's objects, which a cold restore is
    /// measured against. Returns the bytes read and the time taken.
    pub fn bench_remote_read(&self, id: &str, streams: usize) -> Result<(u64, Duration), EngineError> {
        let snap = self.snapshot_record(id)?;
        let layers: HashSet<String> = snap.layers.iter().cloned().collect();
        let objects = self.reachable_objects(&layers, std::slice::from_ref(&snap), &HashSet::new())?;
        let backend = self.store.backend();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let bytes = std::sync::atomic::AtomicU64::new(0);
        let t0 = std::time::Instant::now();
        std::thread::scope(|s| -> Result<(), EngineError> {
            let workers: Vec<_> = (0..streams.max(1))
                .map(|_| {
                    s.spawn(|| -> Result<(), EngineError> {
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(key) = objects.get(i) else { return Ok(()) };
                            let Some(got) = backend.remote_get(key) else {
                                return Ok(());
                            };
                            let data = got.map_err(SnapshotError::from)?;
                            bytes.fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join().expect("a reader panicked")?;
            }
            Ok(())
        })?;
        Ok((bytes.into_inner(), t0.elapsed()))
    }

    /// When snapshot `id` became durable in the remote store (ms since the
    /// epoch), if it did.
    pub fn remote_durable_at(&self, id: &str) -> Result<Option<i64>, EngineError> {
        Ok(self.db.snapshot_remote_durable_at(id)?)
    }

    /// When each snapshot became durable in the remote store (ms since
    /// the epoch), by id; a snapshot not yet durable is absent. `None`
    /// for a home without a remote store, where the question does not
    /// arise.
    pub fn remote_durability(&self) -> Result<Option<HashMap<String, i64>>, EngineError> {
        if !self.store.backend().is_remote() {
            return Ok(None);
        }
        Ok(Some(self.db.snapshots_remote_durable_at()?))
    }
}
