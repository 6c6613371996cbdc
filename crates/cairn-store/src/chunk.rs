//! [`ChunkStore`]: hashing, zstd compression and verification on top of a
//! [`BlobStore`] backend.

use std::fmt;
use std::io::Read;
use std::path::PathBuf;

use crate::blob::{BlobError, BlobStore, PutOutcome, MAX_OBJECT};
use crate::frame::{self, FrameError, Framed};
use crate::hash::ChunkHash;

/// zstd level for chunks: fast, still a good ratio on text and binaries.
const ZSTD_LEVEL: i32 = 3;

/// Bytes of each of the three samples tried before a chunk is compressed.
const SAMPLE: usize = 1024;

/// A chunk as it is stored: one zstd frame at [`ZSTD_LEVEL`], unless
/// samples of it (its start, middle and end) do not compress (random or
/// already compressed bytes): then a zstd frame of raw blocks, which is
/// what zstd would write for it after trying, without the cost of trying.
/// Readers decode both alike.
pub(crate) fn compress_chunk(data: &[u8]) -> std::io::Result<Vec<u8>> {
    if data.len() >= 8 * SAMPLE && !samples_compress(data)? {
        return Ok(raw_frame(data));
    }
    zstd::bulk::compress(data, ZSTD_LEVEL)
}

/// Whether zstd saves at least 1/32 of three 1 KiB samples of `data`
/// (which is at least 3 KiB long).
fn samples_compress(data: &[u8]) -> std::io::Result<bool> {
    let mut sample = Vec::with_capacity(3 * SAMPLE);
    for at in [0, data.len() / 2 - SAMPLE / 2, data.len() - SAMPLE] {
        sample.extend_from_slice(&data[at..at + SAMPLE]);
    }
    // One compression context per thread: making one for each chunk cost
    // more than compressing its samples.
    thread_local! {
        static SAMPLER: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    let packed = SAMPLER.with(|cell| {
        let mut cell = cell.borrow_mut();
        let sampler = match cell.as_mut() {
            Some(c) => c,
            None => cell.insert(zstd::bulk::Compressor::new(1)?),
        };
        sampler.compress(&sample)
    })?;
    Ok(packed.len() < sample.len() - sample.len() / 32)
}

/// A zstd frame (RFC 8878) holding `data` (at most 4 GiB) in raw blocks of
/// at most 128 KiB: single segment, content size given, no checksum.
pub(crate) fn raw_frame(data: &[u8]) -> Vec<u8> {
    const MAX_BLOCK: usize = 128 << 10;
    let mut out = Vec::with_capacity(data.len() + 9 + 3 * (data.len() / MAX_BLOCK + 1));
    out.extend_from_slice(&0xFD2F_B528u32.to_le_bytes());
    // Frame header descriptor: a 4-byte content size, single segment.
    out.push(0b1010_0000);
    out.extend_from_slice(&u32::try_from(data.len()).expect("chunks are small").to_le_bytes());
    let blocks: Vec<&[u8]> = if data.is_empty() {
        vec![data]
    } else {
        data.chunks(MAX_BLOCK).collect()
    };
    for (i, block) in blocks.iter().enumerate() {
        // Block header: last-block bit, block type 0 (raw), size.
        let last = u32::from(i + 1 == blocks.len());
        let header = last | (block.len() as u32) << 3;
        out.extend_from_slice(&header.to_le_bytes()[..3]);
        out.extend_from_slice(block);
    }
    out
}

/// Largest zstd window (log2 bytes) a stored chunk may ask its reader to
/// hold: 8 MiB. Level 3 writes windows of at most 2 MiB; a frame asking for
/// more is refused before its window is allocated (zstd's own default
/// would allow 128 MiB).
pub const MAX_WINDOW_LOG: u32 = 23;

/// What a read belongs to, so an error can say which snapshot and file a
/// missing or corrupt chunk breaks. Built by the caller:
/// `ReadContext::new().owner("snapshot", id).path("/data/genome.fa")`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadContext {
    owner: Option<(&'static str, ChunkHash)>,
    path: Option<PathBuf>,
}

impl ReadContext {
    pub fn new() -> Self {
        Self::default()
    }

    /// The object the read is for, e.g. `("snapshot", id)` or
    /// `("layer", id)`.
    pub fn owner(mut self, kind: &'static str, id: ChunkHash) -> Self {
        self.owner = Some((kind, id));
        self
    }

    /// The file inside the owner.
    pub fn path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }
}

/// Renders as " of /data/genome.fa in snapshot 9c1e…" (empty parts left out).
impl fmt::Display for ReadContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(path) = &self.path {
            write!(f, " of {}", path.display())?;
        }
        if let Some((kind, id)) = &self.owner {
            write!(f, " in {kind} {}", id.short())?;
        }
        Ok(())
    }
}

/// A chunk-store operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("chunk {}{context} is missing from the store; the store has lost data: restore the chunk from a replica or backup, or recapture the data", hash.short())]
    ChunkMissing { hash: ChunkHash, context: Box<ReadContext> },
    #[error("chunk {}{context} is corrupt: {reason}; restore the chunk from a replica or backup, or recapture the data", hash.short())]
    ChunkCorrupt {
        hash: ChunkHash,
        context: Box<ReadContext>,
        reason: String,
    },
    #[error("object {}{context} cannot be read: {source}", hash.short())]
    Object {
        hash: ChunkHash,
        context: Box<ReadContext>,
        source: FrameError,
    },
    #[error("cannot encode an object for the store: {0}")]
    Encode(#[source] FrameError),
    #[error("the file record{context} is inconsistent: {reason}; the index or manifest holding it is corrupt")]
    InvalidContent { context: Box<ReadContext>, reason: String },
    #[error("could not read the source data{context}: {source}")]
    ReadSource {
        context: Box<ReadContext>,
        source: std::io::Error,
    },
    #[error(
        "could not write the restored data{context}: {source}; check free space and permissions at the destination"
    )]
    WriteDestination {
        context: Box<ReadContext>,
        source: std::io::Error,
    },
    #[error("zstd could not compress a chunk ({0}); this is a bug or memory exhaustion, so retry with more memory available")]
    Compress(#[source] std::io::Error),
    #[error("chunk store backend failed: {0}")]
    Backend(#[from] BlobError),
}

/// A chunk that was put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutChunk {
    pub hash: ChunkHash,
    /// False when an identical chunk was already stored.
    pub new: bool,
}

/// Content-addressed, compressed, verified chunks over a backend.
#[derive(Debug)]
pub struct ChunkStore<B> {
    backend: B,
    /// Compressed bytes of new chunks written through this handle.
    pub(crate) written: std::sync::atomic::AtomicU64,
}

impl<B: BlobStore> ChunkStore<B> {
    pub fn new(backend: B) -> Self {
        Self {
            backend,
            written: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Compressed bytes this handle added to the store so far (chunks that
    /// were already stored count nothing): what an operation really cost.
    pub fn bytes_written(&self) -> u64 {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Stores `data` (compressed) under its BLAKE3 hash; identical data is
    /// stored once. A copy already stored is read back and checked before
    /// it is trusted: one found corrupt (a disk error, an edit) is written
    /// again from `data`, so a snapshot heals what it would otherwise build
    /// on.
    pub fn put_chunk(&self, data: &[u8]) -> Result<PutChunk, StoreError> {
        let hash = ChunkHash::of(data);
        if self.backend.refresh(&hash)? {
            if self.stored_copy_is_sound(&hash, data.len() as u64)? {
                return Ok(PutChunk { hash, new: false });
            }
            tracing::warn!(chunk = %hash.short(), "a stored chunk was corrupt; writing it again from the data in hand");
            self.backend.delete(&hash)?;
        }
        let compressed = compress_chunk(data).map_err(StoreError::Compress)?;
        let outcome = self.backend.put(&hash, &compressed)?;
        if outcome == PutOutcome::Stored {
            self.written
                .fetch_add(compressed.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(PutChunk {
            hash,
            new: outcome == PutOutcome::Stored,
        })
    }

    /// Whether the stored copy of `hash` decodes to `len` bytes that hash
    /// to it (after a caching backend dropped a corrupt cached copy and
    /// read the other one).
    fn stored_copy_is_sound(&self, hash: &ChunkHash, len: u64) -> Result<bool, StoreError> {
        let mut retried = false;
        loop {
            let compressed = match self.backend.get(hash) {
                Ok(bytes) => bytes,
                Err(BlobError::NotFound { .. }) => return Ok(false),
                Err(e) => return Err(e.into()),
            };
            match decode_chunk(hash, &compressed, len) {
                Ok(data) if data.len() as u64 == len => return Ok(true),
                Ok(_) => return Ok(false),
                Err(_) if self.backend.drop_corrupt_copy(hash) && !retried => retried = true,
                Err(_) => return Ok(false),
            }
        }
    }

    /// Reads, decompresses and verifies one chunk of at most
    /// [`MAX_OBJECT`] bytes.
    pub fn get_chunk(&self, hash: &ChunkHash, context: &ReadContext) -> Result<Vec<u8>, StoreError> {
        self.get_chunk_capped(hash, MAX_OBJECT, context)
    }

    /// [`Self::get_chunk`] for a chunk the caller knows to hold at most
    /// `cap` bytes: a corrupt or hostile object is refused once it
    /// decompresses past that, not at [`MAX_OBJECT`].
    pub(crate) fn get_chunk_capped(
        &self,
        hash: &ChunkHash,
        cap: u64,
        context: &ReadContext,
    ) -> Result<Vec<u8>, StoreError> {
        let mut retried = false;
        loop {
            let compressed = match self.backend.get(hash) {
                Ok(bytes) => bytes,
                Err(BlobError::NotFound { .. }) => {
                    return Err(StoreError::ChunkMissing {
                        hash: *hash,
                        context: Box::new(context.clone()),
                    })
                }
                Err(e) => return Err(e.into()),
            };
            match decode_chunk(hash, &compressed, cap) {
                Ok(data) => return Ok(data),
                // A cached copy was corrupt (torn by a power loss, say) and
                // is dropped: read the other copy, once.
                Err(_) if self.backend.drop_corrupt_copy(hash) && !retried => retried = true,
                Err(e) => {
                    return Err(StoreError::ChunkCorrupt {
                        hash: *hash,
                        context: Box::new(context.clone()),
                        reason: e.to_string(),
                    })
                }
            }
        }
    }

    /// Frames `value` and stores it; the returned hash is the BLAKE3 of the
    /// framed bytes and identifies the object.
    pub fn put_object<T: Framed>(&self, value: &T) -> Result<ChunkHash, StoreError> {
        let bytes = frame::encode(value).map_err(StoreError::Encode)?;
        Ok(self.put_chunk(&bytes)?.hash)
    }

    /// Reads and decodes an object stored by [`Self::put_object`].
    pub fn get_object<T: Framed>(&self, hash: &ChunkHash, context: &ReadContext) -> Result<T, StoreError> {
        let cap = frame::HEADER_LEN as u64 + T::MAX_PAYLOAD;
        let bytes = self.get_chunk_capped(hash, cap, context)?;
        frame::decode(&bytes).map_err(|source| StoreError::Object {
            hash: *hash,
            context: Box::new(context.clone()),
            source,
        })
    }
}

/// Why stored bytes are not the chunk they are stored as.
#[derive(Debug, thiserror::Error)]
pub enum ChunkDecodeError {
    #[error("it does not decompress ({0})")]
    Decompress(#[source] std::io::Error),
    #[error("it decompresses to more than {cap} bytes")]
    TooLarge { cap: u64 },
    #[error("its content hashes to {}", actual.short())]
    HashMismatch { actual: ChunkHash },
}

/// Decompresses a stored chunk (one zstd frame) and checks it is the
/// content `hash` names. The bytes are hostile (anyone who can write the
/// store can change them): decompression stops once past `cap` bytes, a
/// window over 2^[`MAX_WINDOW_LOG`] bytes is refused, and memory grows with
/// the bytes produced, not with any size the frame declares.
pub fn decode_chunk(hash: &ChunkHash, compressed: &[u8], cap: u64) -> Result<Vec<u8>, ChunkDecodeError> {
    let mut data = Vec::new();
    zstd::stream::read::Decoder::with_buffer(compressed)
        .and_then(|mut d| {
            d.window_log_max(MAX_WINDOW_LOG)?;
            d.take(cap.saturating_add(1)).read_to_end(&mut data)
        })
        .map_err(ChunkDecodeError::Decompress)?;
    if data.len() as u64 > cap {
        return Err(ChunkDecodeError::TooLarge { cap });
    }
    let actual = ChunkHash::of(&data);
    if actual != *hash {
        return Err(ChunkDecodeError::HashMismatch { actual });
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalStore;

    #[test]
    fn context_renders_path_and_owner() {
        let id = ChunkHash::of(b"snap");
        let ctx = ReadContext::new().owner("snapshot", id).path("/data/genome.fa");
        assert_eq!(
            ctx.to_string(),
            format!(" of /data/genome.fa in snapshot {}", id.short())
        );
        assert_eq!(ReadContext::new().to_string(), "");
    }

    fn noise(len: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn an_incompressible_chunk_is_stored_raw_in_a_zstd_frame_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        // Raw blocks cut at 128 KiB: sizes on both sides of a cut.
        for len in [8 * 1024, 64 * 1024, 128 * 1024, 300 * 1024, 1 << 20] {
            let data = noise(len);
            let put = store.put_chunk(&data).unwrap();
            let stored = std::fs::read(store.backend().object_path(&put.hash)).unwrap();
            // Header (9 bytes) and 3 bytes per block: nothing was compressed.
            assert_eq!(stored.len(), len + 9 + 3 * len.div_ceil(128 << 10), "{len}");
            assert_eq!(&stored[9 + 3..9 + 3 + 16], &data[..16], "raw bytes follow the headers");
            assert!(store.get_chunk(&put.hash, &ReadContext::new()).unwrap() == data);
            assert!(zstd::decode_all(&stored[..]).unwrap() == data, "zstd itself reads it");
        }
        assert_eq!(zstd::decode_all(&raw_frame(b"")[..]).unwrap(), b"");
    }

    #[test]
    fn a_chunk_that_compresses_in_part_is_compressed() {
        // Random at the start, text from the middle on: a sample compresses.
        let mut data = noise(16 * 1024);
        data.extend(b"ACGT".repeat(4 * 1024));
        assert!(compress_chunk(&data).unwrap().len() < data.len() * 3 / 4);
    }

    #[test]
    fn chunks_are_stored_compressed_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        let data = b"ACGT".repeat(10_000);
        let put = store.put_chunk(&data).unwrap();
        assert!(put.new);
        assert!(!store.put_chunk(&data).unwrap().new);
        let stored = std::fs::metadata(store.backend().object_path(&put.hash)).unwrap();
        assert!(stored.len() < data.len() as u64 / 10, "not compressed");
        assert_eq!(store.get_chunk(&put.hash, &ReadContext::new()).unwrap(), data);
    }

    #[test]
    fn a_corrupt_stored_chunk_is_written_again_by_the_next_put_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        let data = noise(100_000);
        let put = store.put_chunk(&data).unwrap();
        let path = store.backend().object_path(&put.hash);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x55;
        std::fs::write(&path, bytes).unwrap();
        assert!(store.get_chunk(&put.hash, &ReadContext::new()).is_err());
        let again = store.put_chunk(&data).unwrap();
        assert!(again.new, "the corrupt copy was trusted");
        assert!(store.get_chunk(&put.hash, &ReadContext::new()).unwrap() == data);
        // A sound copy is reused as before.
        assert!(!store.put_chunk(&data).unwrap().new);
    }
}
