//! Checking every stored copy of an object against its hash, and mending a
//! damaged copy from an intact one: the store's half of `cairn verify`.
//! A local store has one copy of each object; a store in S3 has the
//! bucket's (the durable one) and, perhaps, the cache's.

use crate::backend::StoreBackend;
use crate::blob::MAX_OBJECT;
use crate::blob::{BlobError, BlobStore};
use crate::chunk::decode_chunk;
use crate::hash::ChunkHash;

/// What one copy of an object is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyState {
    /// Present, and its content hashes to its key.
    Intact,
    /// Should be here and is not.
    Missing,
    /// Present and not the content its key names (why).
    Corrupt(String),
    /// A cache that does not hold it (a cache holds what was read lately).
    NotCached,
    /// Not in the bucket yet: its upload is queued, so the cache's copy is
    /// the only one for now.
    Pending,
}

impl CopyState {
    pub fn is_damaged(&self) -> bool {
        matches!(self, CopyState::Missing | CopyState::Corrupt(_))
    }

    /// A word for reports: `intact`, `missing`, `corrupt (…)`, `not cached`,
    /// `upload pending`.
    pub fn describe(&self) -> String {
        match self {
            CopyState::Intact => "intact".into(),
            CopyState::Missing => "missing".into(),
            CopyState::Corrupt(why) => format!("corrupt: {why}"),
            CopyState::NotCached => "not cached".into(),
            CopyState::Pending => "upload pending".into(),
        }
    }
}

/// Every copy of one object, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectCheck {
    /// The local store's copy, or the cache's in front of S3.
    pub local: CopyState,
    /// The bucket's copy; none for a local store.
    pub remote: Option<CopyState>,
    /// Stored bytes read to check it.
    pub bytes_read: u64,
}

impl ObjectCheck {
    pub fn is_damaged(&self) -> bool {
        self.local.is_damaged() || self.remote.as_ref().is_some_and(CopyState::is_damaged)
    }
}

/// A copy read back, judged by its key.
fn judge(key: &ChunkHash, got: Result<Vec<u8>, BlobError>) -> Result<(CopyState, u64), BlobError> {
    match got {
        Ok(bytes) => {
            let state = match decode_chunk(key, &bytes, MAX_OBJECT) {
                Ok(_) => CopyState::Intact,
                Err(e) => CopyState::Corrupt(e.to_string()),
            };
            Ok((state, bytes.len() as u64))
        }
        Err(BlobError::NotFound { .. }) => Ok((CopyState::Missing, 0)),
        Err(e) => Err(e),
    }
}

impl StoreBackend {
    /// Reads every copy of `key` there is and checks each against the key
    /// (decompressed and hashed). An error is a store that could not be
    /// asked (I/O, the network), not a damaged copy.
    pub fn check_object(&self, key: &ChunkHash) -> Result<ObjectCheck, BlobError> {
        match self {
            StoreBackend::Local(s) => {
                let (local, bytes_read) = judge(key, s.get(key))?;
                Ok(ObjectCheck {
                    local,
                    remote: None,
                    bytes_read,
                })
            }
            StoreBackend::S3(t) => {
                let (mut local, mut bytes_read) = judge(key, t.cache().get(key))?;
                let remote = if t.is_pending(key) {
                    // The cache holds the only copy until it is uploaded.
                    CopyState::Pending
                } else {
                    let (remote, n) = judge(key, t.remote().get(key))?;
                    bytes_read += n;
                    if local == CopyState::Missing {
                        local = CopyState::NotCached;
                    }
                    remote
                };
                Ok(ObjectCheck {
                    local,
                    remote: Some(remote),
                    bytes_read,
                })
            }
        }
    }

    /// Mends the damaged copies `check` found from an intact one: a corrupt
    /// cached copy is replaced by the bucket's, a missing or corrupt copy
    /// in the bucket by the cache's. Returns what was done, or `None` when
    /// no intact copy exists (a local store has no other copy).
    pub fn repair_object(&self, key: &ChunkHash, check: &ObjectCheck) -> Result<Option<String>, BlobError> {
        let StoreBackend::S3(t) = self else {
            return Ok(None);
        };
        let remote = check.remote.clone().unwrap_or(CopyState::Missing);
        let mut done = Vec::new();
        if check.local.is_damaged() {
            if remote != CopyState::Intact {
                return Ok(None);
            }
            if matches!(check.local, CopyState::Corrupt(_)) {
                t.drop_corrupt_copy(key);
            }
            // Read through the cache, which keeps the bucket's copy.
            let (state, _) = judge(key, self.get(key))?;
            if state != CopyState::Intact {
                return Ok(None);
            }
            done.push("the cached copy replaced by the bucket's");
        }
        if remote.is_damaged() {
            if check.local != CopyState::Intact {
                return Ok(None);
            }
            let bytes = t.cache().get(key)?;
            t.remote().put_unconditionally(key, &bytes)?;
            done.push("the bucket's copy replaced by the cache's");
        }
        Ok(Some(done.join("; ")))
    }
}
