//! The object-store-shaped backend interface: whole objects by key.
//!
//! Backends know nothing of compression, chunking or hashing; they store
//! opaque bytes under a [`ChunkHash`] key. The local directory backend is
//! [`crate::LocalStore`]; an S3 backend implements the same trait.

use std::io;
use std::path::PathBuf;
use std::time::SystemTime;

use crate::frame::FrameError;
use crate::hash::ChunkHash;
use crate::read_ahead::ReadAhead;

/// What a backend knows about one stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: ChunkHash,
    /// Stored (compressed) size in bytes.
    pub size: u64,
    /// Last time the object was written or re-put; GC spares objects
    /// younger than its grace period.
    pub modified: SystemTime,
}

/// Whether a put wrote new bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Stored,
    AlreadyPresent,
}

/// Incomplete writes removed by [`BlobStore::remove_incomplete_writes`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IncompleteWrites {
    pub removed: u64,
    pub bytes: u64,
}

/// Whole-object storage keyed by content hash.
///
/// Contract every backend keeps:
/// - `put` is atomic: a reader sees either no object or all of it.
/// - `put` of a key that exists may skip the write but must refresh the
///   object's modification time, so a writer that deduplicates against an
///   old unreferenced object is protected by the GC grace period.
/// - `get` of an absent key is [`BlobError::NotFound`].
pub trait BlobStore: Send + Sync {
    fn put(&self, key: &ChunkHash, bytes: &[u8]) -> Result<PutOutcome, BlobError>;
    /// Puts several objects, each as [`put`](Self::put) would, all durable
    /// when it returns; one outcome per object, in order (a key given twice
    /// is stored once). A backend may make them durable together, which
    /// costs far less than one by one: a memory image's new chunks are
    /// written this way.
    fn put_batch(&self, objects: &[(ChunkHash, &[u8])]) -> Result<Vec<PutOutcome>, BlobError> {
        objects.iter().map(|(key, bytes)| self.put(key, bytes)).collect()
    }
    fn get(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError>;
    fn contains(&self, key: &ChunkHash) -> Result<bool, BlobError>;
    /// If the object exists, refreshes its modification time (as a
    /// re-put would) and returns true; lets a writer skip compressing data
    /// that is already stored.
    fn refresh(&self, key: &ChunkHash) -> Result<bool, BlobError>;
    /// Removes the object; `Ok(false)` if it was not there.
    fn delete(&self, key: &ChunkHash) -> Result<bool, BlobError>;
    /// Removes every object of `keys`, as [`delete`](Self::delete) would;
    /// one result per key, in order. A backend that keeps objects together
    /// (packs) removes a whole group at once instead of rewriting what is
    /// left of it after each.
    fn delete_many(&self, keys: &[ChunkHash]) -> Result<Vec<bool>, BlobError> {
        keys.iter().map(|key| self.delete(key)).collect()
    }
    /// Every complete object. Incomplete writes are never listed.
    fn list(&self) -> Result<Vec<ObjectInfo>, BlobError>;
    /// Removes leftovers of interrupted writes (temp files, abandoned
    /// multipart uploads) whose writer is dead; one whose writer cannot be
    /// told only once it is older than
    /// [`UNIDENTIFIED_GRACE`](crate::process::UNIDENTIFIED_GRACE). A write
    /// in progress is never removed, however long it takes.
    fn remove_incomplete_writes(&self) -> Result<IncompleteWrites, BlobError>;
    /// Says these objects are about to be read, in this order, reporting
    /// progress through the returned [`ReadAhead`]. A backend whose reads
    /// are far (a cache in front of S3) fetches the missing ones ahead of
    /// the reader, several at once; errors are left for the reads to
    /// report.
    fn read_ahead(&self, _keys: Vec<ChunkHash>) -> ReadAhead {
        ReadAhead::none()
    }
    /// The object read back was corrupt: a caching backend drops its copy
    /// when another one (remote) exists and returns true, so a second
    /// read fetches that instead of failing on the same bytes forever.
    fn drop_corrupt_copy(&self, _key: &ChunkHash) -> bool {
        false
    }
}

/// Largest uncompressed object the store reads back (data chunks are at
/// most [`crate::MAX_CHUNK`]; metadata objects are capped by their frame).
pub const MAX_OBJECT: u64 = 1 << 30;

/// The form of a store URL in S3 (`CAIRN_STORE`), as errors show it.
pub(crate) const URL_FORM: &str = "s3://BUCKET/PREFIX?endpoint=http://HOST:PORT&region=REGION";

/// A backend operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    #[error("object {key} is not in the store")]
    NotFound { key: ChunkHash },
    #[error("could not {action} {path}: {source}; check that the store directory exists, is writable by this user and that the disk is not full")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("the store at {path} cannot be opened: {source}")]
    Layout { path: PathBuf, source: FrameError },
    #[error("{path} exists but is not a Cairn chunk store (no layout marker); point Cairn at an empty or existing store directory")]
    NotAStore { path: PathBuf },
    #[error("the store URL {url} is not valid: {reason}; the form is {}", URL_FORM)]
    S3Url { url: String, reason: String },
    #[error("no S3 credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials)")]
    S3Credentials { url: String },
    #[error("{store} refused access key {key_id} ({detail}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and that the key may read and write the bucket")]
    S3Denied {
        store: String,
        key_id: String,
        detail: String,
    },
    #[error("the bucket {bucket} does not exist at {endpoint}; create it (`garage bucket create {bucket}`, `aws s3 mb s3://{bucket}`) or fix the bucket in the store URL")]
    S3NoBucket { bucket: String, endpoint: String },
    #[error("cannot reach the S3 endpoint {endpoint} ({detail}); check the endpoint in the store URL and that the server is running")]
    S3Unreachable { endpoint: String, detail: String },
    #[error("the store at {store} cannot be opened: {source}")]
    S3Layout { store: String, source: FrameError },
    #[error(
        "{store} holds objects but no Cairn layout marker; point Cairn at an empty prefix or an existing Cairn store"
    )]
    S3NotAStore { store: String },
    #[error("the cache {cache} fronts {bound}, not {wanted}; give this store its own cache directory")]
    CacheOfAnotherRemote {
        cache: PathBuf,
        bound: String,
        wanted: String,
    },
    #[error("{cache} holds {objects} objects and fronts no remote store; they are not known to be in {wanted}, so it cannot become its cache: give the S3 store an empty cache directory")]
    UnboundCacheHoldsObjects {
        cache: PathBuf,
        objects: usize,
        wanted: String,
    },
    #[error("{cache} is the cache of {remote} and holds only some of its objects; open it with that store URL (--store/CAIRN_STORE {remote}?endpoint=…)")]
    CacheWithoutItsRemote { cache: PathBuf, remote: String },
    #[error("{pending} objects are still not uploaded after {waited:?} (last error: {last_error}); check that the remote store is reachable, they stay queued and are retried")]
    UploadsPending {
        pending: usize,
        waited: std::time::Duration,
        last_error: String,
    },
    #[error("{what} is {size} bytes, more than any object Cairn writes ({cap}); the bucket holds a foreign or corrupt object: delete it")]
    S3ObjectTooLarge { what: String, size: u64, cap: u64 },
    #[error("S3 {action} of {what} failed: {source}; check that the S3 endpoint is reachable and retry")]
    S3 {
        action: &'static str,
        what: String,
        source: Box<object_store::Error>,
    },
}

impl BlobError {
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
