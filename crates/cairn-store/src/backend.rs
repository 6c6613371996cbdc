//! [`StoreBackend`]: the backend a home's chunk store runs on, chosen at
//! open: a local directory, or S3 behind that directory as its cache.

use std::path::Path;
use std::time::Duration;

use crate::blob::{BlobError, BlobStore, IncompleteWrites, ObjectInfo, PutOutcome};
use crate::hash::ChunkHash;
use crate::local::LocalStore;
use crate::read_ahead::ReadAhead;
use crate::s3::{S3Config, S3Store};
use crate::tiered::{TieredOptions, TieredStore};

/// A local store, or an S3 store with a local cache.
#[derive(Debug)]
pub enum StoreBackend {
    Local(LocalStore),
    S3(TieredStore<S3Store>),
}

impl StoreBackend {
    /// Opens the local store at `dir`, or with `url` (`s3://…`, see
    /// [`S3Config::from_url`]) the S3 store it names with `dir` as its
    /// cache. The S3 store is probed: bad credentials, a missing bucket or
    /// an unreachable endpoint fail here.
    pub fn open(dir: &Path, url: Option<&str>, options: TieredOptions) -> Result<Self, BlobError> {
        match url.filter(|u| !u.is_empty()) {
            None => {
                // A cache holds only some objects: alone it is not the store.
                if let Some(remote) = crate::tiered::bound_remote(dir)? {
                    return Err(BlobError::CacheWithoutItsRemote {
                        cache: dir.to_path_buf(),
                        remote,
                    });
                }
                Ok(Self::Local(LocalStore::open(dir)?))
            }
            Some(url) => {
                let config = S3Config::from_url(url)?;
                let identity = format!("s3://{}/{}", config.bucket, config.prefix);
                let remote = S3Store::open(config)?;
                Ok(Self::S3(TieredStore::open(dir, remote, &identity, options)?))
            }
        }
    }

    /// Whether objects go to a remote store (and so are durable only once
    /// uploaded).
    pub fn is_remote(&self) -> bool {
        matches!(self, Self::S3(_))
    }

    /// The keys among `keys` not yet in the remote store; none for a
    /// local store.
    pub fn not_remote(&self, keys: impl IntoIterator<Item = ChunkHash>) -> Result<Vec<ChunkHash>, BlobError> {
        match self {
            Self::Local(_) => Ok(Vec::new()),
            Self::S3(s) => s.not_remote(keys),
        }
    }

    /// Waits for pending uploads, at most `timeout`.
    pub fn flush(&self, timeout: Duration) -> Result<(), BlobError> {
        match self {
            Self::Local(_) => Ok(()),
            Self::S3(s) => s.flush(timeout),
        }
    }

    /// An object read straight from the remote store, past the cache (a
    /// benchmark's peer figure); `None` for a local store.
    pub fn remote_get(&self, key: &ChunkHash) -> Option<Result<Vec<u8>, BlobError>> {
        match self {
            Self::Local(_) => None,
            Self::S3(s) => Some(s.remote().get(key)),
        }
    }

    fn inner(&self) -> &dyn BlobStore {
        match self {
            Self::Local(s) => s,
            Self::S3(s) => s,
        }
    }
}

impl BlobStore for StoreBackend {
    fn put(&self, key: &ChunkHash, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        self.inner().put(key, bytes)
    }
    fn put_batch(&self, objects: &[(ChunkHash, &[u8])]) -> Result<Vec<PutOutcome>, BlobError> {
        self.inner().put_batch(objects)
    }
    fn get(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        self.inner().get(key)
    }
    fn contains(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        self.inner().contains(key)
    }
    fn refresh(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        self.inner().refresh(key)
    }
    fn delete(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        self.inner().delete(key)
    }
    fn delete_many(&self, keys: &[ChunkHash]) -> Result<Vec<bool>, BlobError> {
        self.inner().delete_many(keys)
    }
    fn list(&self) -> Result<Vec<ObjectInfo>, BlobError> {
        self.inner().list()
    }
    fn remove_incomplete_writes(&self) -> Result<IncompleteWrites, BlobError> {
        self.inner().remove_incomplete_writes()
    }
    fn read_ahead(&self, keys: Vec<ChunkHash>) -> ReadAhead {
        self.inner().read_ahead(keys)
    }
    fn drop_corrupt_copy(&self, key: &ChunkHash) -> bool {
        self.inner().drop_corrupt_copy(key)
    }
}
