//! [`TieredStore`]: a local directory as a cache in front of a remote
//! store (S3), the remote copy written behind.
//!
//! ```text
//! <cache>/LAYOUT, objects/, tmp/   a LocalStore holding the cached objects
//! <cache>/REMOTE                   framed CacheBinding: the remote this cache fronts
//! <cache>/pending/<64 hex>         upload journal: one empty file per object
//!                                  not yet known to be remote
//! ```
//!
//! The one invariant: **an object in the cache with no journal entry is
//! remote.** A put therefore writes (and fsyncs) its journal entry before
//! the object, and an entry is removed only after the remote PUT
//! succeeded. A process killed at any instant leaves entries for every
//! object not yet remote; the next open uploads them again (a rewrite of
//! an object named by its hash is harmless) and drops the entries of puts
//! that never wrote their object.
//!
//! Reads fill the cache; the cache keeps to a size limit by evicting the
//! least recently used objects that are remote, never one with a journal
//! entry. GC deletes through [`BlobStore::delete`], which refuses an object
//! with a journal entry: an upload in flight is never swept.
//!
//! Writes never wait on the network: `refresh` and `put` look only at the
//! cache, and the uploader asks the remote (a HEAD, then a PUT when the
//! object is missing or too old to count as refreshed).

use std::collections::{HashSet, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::blob::{BlobError, BlobStore, IncompleteWrites, ObjectInfo, PutOutcome};
use crate::frame::{self, Framed};
use crate::hash::ChunkHash;
use crate::local::LocalStore;
use crate::read_ahead::ReadAhead;

const BINDING_FILE: &str = "REMOTE";
const PENDING_DIR: &str = "pending";

/// Fetches a read-ahead keeps running at once.
const READ_AHEAD_STREAMS: usize = 16;
/// How many objects a read-ahead fetches past the reader: at most this
/// many fetched and unread objects (≤ 1 MiB each) sit in the cache.
const READ_AHEAD_OBJECTS: usize = 256;

/// Which remote a cache directory fronts: a cache whose objects are taken
/// as remote must never be put in front of another bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct CacheBinding {
    remote: String,
}

impl Framed for CacheBinding {
    const MAGIC: [u8; 8] = *b"CAIRNCAB";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 4096;
    const NAME: &'static str = "cache binding";
}

/// How a [`TieredStore`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieredOptions {
    /// Bytes of objects the cache keeps; past it, remote objects are
    /// evicted least recently used first down to 90% of it. Objects not
    /// yet remote are never evicted, so the cache may exceed the limit
    /// while uploads lag.
    pub cache_limit: u64,
    /// Uploads running at once.
    pub upload_workers: usize,
}

impl Default for TieredOptions {
    fn default() -> Self {
        Self {
            cache_limit: 20 << 30,
            upload_workers: 8,
        }
    }
}

/// Objects waiting for upload and the uploaders' state.
#[derive(Debug, Default)]
struct Queue {
    waiting: VecDeque<ChunkHash>,
    /// Keys in `waiting` (a key being uploaded may be queued again).
    queued: HashSet<ChunkHash>,
    in_flight: usize,
    paused: bool,
    shutdown: bool,
    /// The most recent failed upload, cleared by the next success.
    last_error: Option<String>,
}

#[derive(Debug)]
struct Shared<R> {
    cache: LocalStore,
    remote: R,
    pending_dir: PathBuf,
    queue: Mutex<Queue>,
    /// Signalled when work is queued, uploads resume or the store closes.
    work: Condvar,
    /// Signalled when an upload ends.
    progress: Condvar,
    evicting: Mutex<()>,
    /// Objects being fetched from the remote: one fetch per object at a
    /// time, so a reader that catches up with its read-ahead waits for
    /// that fetch instead of starting another.
    fetching: Mutex<HashSet<ChunkHash>>,
    /// Signalled when a fetch ends.
    fetched: Condvar,
    cache_bytes: AtomicU64,
    cache_limit: u64,
}

/// A local cache in front of a remote [`BlobStore`], uploads written
/// behind through a durable journal.
#[derive(Debug)]
pub struct TieredStore<R: BlobStore + 'static> {
    shared: Arc<Shared<R>>,
    workers: Vec<JoinHandle<()>>,
}

impl<R: BlobStore + 'static> TieredStore<R> {
    /// Opens the cache at `cache_dir` in front of `remote` (named by
    /// `remote_identity`, e.g. `s3://bucket/prefix`) and resumes the
    /// uploads an earlier process left in the journal.
    pub fn open(
        cache_dir: impl AsRef<Path>,
        remote: R,
        remote_identity: &str,
        options: TieredOptions,
    ) -> Result<Self, BlobError> {
        let cache = LocalStore::open(cache_dir.as_ref())?;
        let root = cache.root().to_path_buf();
        bind(&cache, remote_identity)?;
        let pending_dir = root.join(PENDING_DIR);
        fs::create_dir_all(&pending_dir).map_err(|e| BlobError::io("create", &pending_dir, e))?;

        let mut queue = Queue::default();
        for (name, path) in read_dir_names(&pending_dir)? {
            let Ok(key) = name.parse::<ChunkHash>() else { continue };
            if cache.contains(&key)? {
                queue.queued.insert(key);
                queue.waiting.push_back(key);
            } else {
                // The put that wrote this entry died before its object.
                remove_if_present(&path)?;
            }
        }
        let cache_bytes = cache.list()?.iter().map(|o| o.size).sum();
        let shared = Arc::new(Shared {
            cache,
            remote,
            pending_dir,
            queue: Mutex::new(queue),
            work: Condvar::new(),
            progress: Condvar::new(),
            evicting: Mutex::new(()),
            fetching: Mutex::new(HashSet::new()),
            fetched: Condvar::new(),
            cache_bytes: AtomicU64::new(cache_bytes),
            cache_limit: options.cache_limit,
        });
        let mut workers = Vec::new();
        for i in 0..options.upload_workers.max(1) {
            let shared = shared.clone();
            let worker = std::thread::Builder::new()
                .name(format!("cairn-upload-{i}"))
                .spawn(move || shared.upload_loop())
                .map_err(|e| BlobError::io("start an upload thread", "(threads)", e))?;
            workers.push(worker);
        }
        Ok(Self { shared, workers })
    }

    pub fn cache(&self) -> &LocalStore {
        &self.shared.cache
    }

    pub fn remote(&self) -> &R {
        &self.shared.remote
    }

    /// Bytes of objects in the cache.
    pub fn cache_bytes(&self) -> u64 {
        self.shared.cache_bytes.load(Ordering::Relaxed)
    }

    /// Objects waiting for or in upload.
    /// Whether `key`'s upload is still queued (the cache holds its only
    /// copy).
    pub fn is_pending(&self, key: &ChunkHash) -> bool {
        self.shared.is_pending(key)
    }

    pub fn pending_uploads(&self) -> usize {
        let q = self.shared.lock();
        q.waiting.len() + q.in_flight
    }

    /// Stops starting uploads (those in flight finish); puts still land
    /// in the cache and the journal.
    pub fn pause_uploads(&self) {
        self.shared.lock().paused = true;
    }

    pub fn resume_uploads(&self) {
        self.shared.lock().paused = false;
        self.shared.work.notify_all();
    }

    /// Waits until every object put so far is remote, at most `timeout`.
    pub fn flush(&self, timeout: Duration) -> Result<(), BlobError> {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.lock();
        loop {
            if q.waiting.is_empty() && q.in_flight == 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(BlobError::UploadsPending {
                    pending: q.waiting.len() + q.in_flight,
                    waited: timeout,
                    last_error: q.last_error.clone().unwrap_or_else(|| {
                        if q.paused {
                            "uploads are paused".into()
                        } else {
                            "none yet, uploads are still running".into()
                        }
                    }),
                });
            }
            q = self
                .shared
                .progress
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The keys among `keys` that are not (yet) in the remote store: those
    /// with a journal entry, and those neither cached nor remote. A
    /// snapshot is durable once this is empty for all its objects.
    pub fn not_remote(&self, keys: impl IntoIterator<Item = ChunkHash>) -> Result<Vec<ChunkHash>, BlobError> {
        let mut out = Vec::new();
        for key in keys {
            let remote = if self.shared.is_pending(&key) {
                false
            } else {
                // By the invariant a cached object without an entry is remote.
                self.shared.cache.contains(&key)? || self.shared.remote.contains(&key)?
            };
            if !remote {
                out.push(key);
            }
        }
        Ok(out)
    }
}

impl<R: BlobStore + 'static> Drop for TieredStore<R> {
    /// Uploads in flight finish; queued ones stay in the journal for the
    /// next open.
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl<R: BlobStore> Shared<R> {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panicking uploader leaves the queue consistent: recover it.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pending_path(&self, key: &ChunkHash) -> PathBuf {
        self.pending_dir.join(key.to_hex())
    }

    fn is_pending(&self, key: &ChunkHash) -> bool {
        self.pending_path(key).exists()
    }

    /// Writes the journal entry for `key`, durable before it returns;
    /// true when it was not there.
    fn mark_pending(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        let path = self.pending_path(key);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(f) => {
                drop(f);
                File::open(&self.pending_dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| BlobError::io("fsync the upload journal", &self.pending_dir, e))?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(BlobError::io("write an upload journal entry", path, e)),
        }
    }

    fn enqueue(&self, key: ChunkHash) {
        let mut q = self.lock();
        if q.queued.insert(key) {
            q.waiting.push_back(key);
            drop(q);
            self.work.notify_one();
        }
    }

    fn upload_loop(&self) {
        let mut failures = 0u32;
        loop {
            let key = {
                let mut q = self.lock();
                loop {
                    if q.shutdown {
                        return;
                    }
                    if !q.paused {
                        if let Some(key) = q.waiting.pop_front() {
                            q.queued.remove(&key);
                            q.in_flight += 1;
                            break key;
                        }
                    }
                    q = self.work.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = self.upload(&key);
            let mut q = self.lock();
            q.in_flight -= 1;
            match result {
                Ok(()) => {
                    failures = 0;
                    q.last_error = None;
                }
                Err(e) => {
                    q.last_error = Some(format!("object {}: {e}", key.short()));
                    if q.queued.insert(key) {
                        q.waiting.push_back(key);
                    }
                    failures = failures.saturating_add(1);
                    // Back off (100 ms doubling to 5 s), woken early by close.
                    let pause = Duration::from_millis(100u64 << failures.min(6)).min(Duration::from_secs(5));
                    self.progress.notify_all();
                    if !q.shutdown {
                        q = self.work.wait_timeout(q, pause).unwrap_or_else(|p| p.into_inner()).0;
                    }
                }
            }
            drop(q);
            self.progress.notify_all();
        }
    }

    /// Makes `key` remote and removes its journal entry.
    fn upload(&self, key: &ChunkHash) -> Result<(), BlobError> {
        match self.cache.get(key) {
            Ok(bytes) => {
                self.remote.put(key, &bytes)?;
            }
            Err(BlobError::NotFound { .. }) => {
                // Evicted after this entry was written for a refresh: it
                // was remote then, and nothing is left to upload. (Were it
                // gone from the remote too, something deleted it from
                // both; retrying could not bring it back, and a read
                // reports the loss.)
                self.remote.contains(key)?;
            }
            Err(e) => return Err(e),
        }
        remove_if_present(&self.pending_path(key))
    }

    /// Keeps the cache under its limit, evicting remote objects least
    /// recently used first.
    fn evict_if_over(&self) -> Result<(), BlobError> {
        if self.cache_bytes.load(Ordering::Relaxed) <= self.cache_limit {
            return Ok(());
        }
        let Ok(_evicting) = self.evicting.try_lock() else {
            return Ok(()); // another thread is at it
        };
        let mut objects = self.cache.list()?;
        let mut total: u64 = objects.iter().map(|o| o.size).sum();
        let target = self.cache_limit - self.cache_limit / 10;
        objects.sort_by_key(|o| o.modified);
        for object in objects {
            if total <= target {
                break;
            }
            // An object with a journal entry is not remote: never evicted.
            if self.is_pending(&object.key) {
                continue;
            }
            if self.cache.delete(&object.key)? {
                total = total.saturating_sub(object.size);
            }
        }
        self.cache_bytes.store(total, Ordering::Relaxed);
        Ok(())
    }

    /// The object from the cache, or fetched from the remote into it.
    fn fill(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        if let Some(bytes) = self.cached(key)? {
            return Ok(bytes);
        }
        {
            let mut fetching = self.fetching.lock().unwrap_or_else(|p| p.into_inner());
            if fetching.contains(key) {
                while fetching.contains(key) {
                    fetching = self.fetched.wait(fetching).unwrap_or_else(|p| p.into_inner());
                }
                drop(fetching);
                // Fetched meanwhile (or that fetch failed: try once more).
                if let Some(bytes) = self.cached(key)? {
                    return Ok(bytes);
                }
                fetching = self.fetching.lock().unwrap_or_else(|p| p.into_inner());
            }
            fetching.insert(*key);
        }
        let result = self.fetch(key);
        self.fetching.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
        self.fetched.notify_all();
        result
    }

    fn cached(&self, key: &ChunkHash) -> Result<Option<Vec<u8>>, BlobError> {
        match self.cache.get(key) {
            Ok(bytes) => {
                // The modification time is the cache's recency.
                self.cache.refresh(key)?;
                Ok(Some(bytes))
            }
            Err(BlobError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn fetch(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        let bytes = self.remote.get(key)?;
        // Fetched from the remote, so remote: no journal entry. Not
        // fsynced: a copy torn by a power loss is dropped when read.
        if self.cache.put_unsynced(key, &bytes)? == PutOutcome::Stored {
            self.cache_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        self.evict_if_over()?;
        Ok(bytes)
    }

    fn cached_size(&self, key: &ChunkHash) -> u64 {
        fs::metadata(self.cache.object_path(key)).map(|m| m.len()).unwrap_or(0)
    }
}

impl<R: BlobStore + 'static> BlobStore for TieredStore<R> {
    fn put(&self, key: &ChunkHash, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        let s = &self.shared;
        // Journal first: a cached object without an entry counts as remote.
        let marked = s.mark_pending(key)?;
        let outcome = match s.cache.put(key, bytes) {
            Ok(outcome) => outcome,
            Err(e) => {
                if marked {
                    let _ = remove_if_present(&s.pending_path(key));
                }
                return Err(e);
            }
        };
        if outcome == PutOutcome::Stored {
            s.cache_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        s.enqueue(*key);
        s.evict_if_over()?;
        Ok(outcome)
    }

    fn get(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        self.shared.fill(key)
    }

    fn contains(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        Ok(self.shared.cache.contains(key)? || self.shared.remote.contains(key)?)
    }

    /// Looks only at the cache (a miss makes the caller put, and the
    /// uploader skips the PUT of an object the remote holds). A cached
    /// object is queued so its remote copy is refreshed too.
    fn refresh(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        let s = &self.shared;
        if !s.cache.contains(key)? {
            return Ok(false);
        }
        s.mark_pending(key)?;
        if !s.cache.refresh(key)? {
            // Evicted meanwhile; it was remote, the uploader checks.
            s.enqueue(*key);
            return Ok(false);
        }
        s.enqueue(*key);
        Ok(true)
    }

    /// Refuses (`Ok(false)`) an object whose upload is pending.
    fn delete(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        let s = &self.shared;
        if s.is_pending(key) {
            return Ok(false);
        }
        let remote = s.remote.delete(key)?;
        let size = s.cached_size(key);
        let cached = s.cache.delete(key)?;
        if cached {
            s.cache_bytes
                .fetch_sub(size.min(s.cache_bytes.load(Ordering::Relaxed)), Ordering::Relaxed);
        }
        Ok(remote || cached)
    }

    /// The remote objects, and the cached ones not yet uploaded.
    fn list(&self) -> Result<Vec<ObjectInfo>, BlobError> {
        let s = &self.shared;
        let mut out = s.remote.list()?;
        let listed: HashSet<ChunkHash> = out.iter().map(|o| o.key).collect();
        for (name, _) in read_dir_names(&s.pending_dir)? {
            let Ok(key) = name.parse::<ChunkHash>() else { continue };
            if listed.contains(&key) {
                continue;
            }
            if let Ok(meta) = fs::metadata(s.cache.object_path(&key)) {
                out.push(ObjectInfo {
                    key,
                    size: meta.len(),
                    modified: meta
                        .modified()
                        .map_err(|e| BlobError::io("read mtime of", s.cache.object_path(&key), e))?,
                });
            }
        }
        Ok(out)
    }

    /// Fetches the uncached ones among `keys` into the cache, in order,
    /// [`READ_AHEAD_STREAMS`] at a time and at most [`READ_AHEAD_OBJECTS`]
    /// past the reader.
    fn read_ahead(&self, keys: Vec<ChunkHash>) -> ReadAhead {
        let shared = self.shared.clone();
        ReadAhead::start(
            keys,
            READ_AHEAD_STREAMS,
            READ_AHEAD_OBJECTS,
            Arc::new(move |key: &ChunkHash| {
                // A cached object costs a stat, not a read.
                shared.cache.contains(key).unwrap_or(false) || shared.fill(key).is_ok()
            }),
        )
    }

    /// Drops the cached copy unless it is the only one (upload pending).
    /// A cache fill is not fsynced, so after a power loss this is how a
    /// torn copy is replaced.
    fn drop_corrupt_copy(&self, key: &ChunkHash) -> bool {
        let s = &self.shared;
        if s.is_pending(key) {
            return false;
        }
        let size = s.cached_size(key);
        if s.cache.delete(key).unwrap_or(false) {
            s.cache_bytes
                .fetch_sub(size.min(s.cache_bytes.load(Ordering::Relaxed)), Ordering::Relaxed);
            return true;
        }
        false
    }

    fn remove_incomplete_writes(&self) -> Result<IncompleteWrites, BlobError> {
        let local = self.shared.cache.remove_incomplete_writes()?;
        let remote = self.shared.remote.remove_incomplete_writes()?;
        Ok(IncompleteWrites {
            removed: local.removed + remote.removed,
            bytes: local.bytes + remote.bytes,
        })
    }
}

/// The remote the cache at `dir` fronts, if it is one.
pub(crate) fn bound_remote(dir: &Path) -> Result<Option<String>, BlobError> {
    let path = dir.join(BINDING_FILE);
    match fs::read(&path) {
        Ok(bytes) => {
            let binding: CacheBinding = frame::decode(&bytes).map_err(|source| BlobError::Layout { path, source })?;
            Ok(Some(binding.remote))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(BlobError::io("read the cache binding", path, e)),
    }
}

/// Records the remote this cache fronts, or refuses another one. A store
/// that already holds objects but fronts nothing (a local store) is
/// refused too: its objects would be taken as remote and evicted.
fn bind(cache: &LocalStore, remote: &str) -> Result<(), BlobError> {
    let root = cache.root();
    let path = root.join(BINDING_FILE);
    match fs::read(&path) {
        Ok(bytes) => {
            let binding: CacheBinding = frame::decode(&bytes).map_err(|source| BlobError::Layout {
                path: path.clone(),
                source,
            })?;
            if binding.remote != remote {
                return Err(BlobError::CacheOfAnotherRemote {
                    cache: root.to_path_buf(),
                    bound: binding.remote,
                    wanted: remote.to_string(),
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let held = cache.list()?.len();
            if held > 0 {
                return Err(BlobError::UnboundCacheHoldsObjects {
                    cache: root.to_path_buf(),
                    objects: held,
                    wanted: remote.to_string(),
                });
            }
            let bytes = frame::encode(&CacheBinding {
                remote: remote.to_string(),
            })
            .map_err(|source| BlobError::Layout {
                path: path.clone(),
                source,
            })?;
            let tmp = root.join(format!(
                "{BINDING_FILE}.{}.partial",
                crate::process::WriterId::current()
            ));
            fs::write(&tmp, &bytes)
                .and_then(|()| File::open(&tmp)?.sync_all())
                .and_then(|()| fs::rename(&tmp, &path))
                .and_then(|()| File::open(root)?.sync_all())
                .map_err(|e| BlobError::io("write the cache binding", &path, e))
        }
        Err(e) => Err(BlobError::io("read the cache binding", path, e)),
    }
}

fn remove_if_present(path: &Path) -> Result<(), BlobError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BlobError::io("remove an upload journal entry", path, e)),
    }
}

fn read_dir_names(dir: &Path) -> Result<Vec<(String, PathBuf)>, BlobError> {
    let mut out = Vec::new();
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(BlobError::io("list directory", dir, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| BlobError::io("list directory", dir, e))?;
        if let Ok(name) = entry.file_name().into_string() {
            out.push((name, entry.path()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_refuses_to_front_another_remote() {
        let dir = tempfile::tempdir().unwrap();
        let remote = || LocalStore::open(dir.path().join("remote")).unwrap();
        let cache = dir.path().join("cache");
        drop(TieredStore::open(&cache, remote(), "s3://a/x", TieredOptions::default()).unwrap());
        drop(TieredStore::open(&cache, remote(), "s3://a/x", TieredOptions::default()).unwrap());
        let err = TieredStore::open(&cache, remote(), "s3://b/y", TieredOptions::default()).unwrap_err();
        assert!(err.to_string().contains("fronts s3://a/x"), "{err}");
    }

    #[test]
    fn a_local_store_holding_objects_is_not_taken_as_a_cache() {
        let dir = tempfile::tempdir().unwrap();
        let local = LocalStore::open(dir.path().join("store")).unwrap();
        local.put(&ChunkHash::of(b"x"), b"x").unwrap();
        let remote = LocalStore::open(dir.path().join("remote")).unwrap();
        let err =
            TieredStore::open(dir.path().join("store"), remote, "s3://a/x", TieredOptions::default()).unwrap_err();
        assert!(err.to_string().contains("holds 1 objects"), "{err}");
    }
}
