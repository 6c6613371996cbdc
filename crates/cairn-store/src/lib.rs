//! cairn-store: Cairn's content-addressed chunk store.
//!
//! - [`ChunkHash`]: BLAKE3 content address.
//! - [`BlobStore`]: object-store-shaped backend trait; [`LocalStore`] keeps
//!   objects in a directory with a two-level hex fan-out.
//! - [`S3Store`]: objects in an S3-compatible bucket; [`TieredStore`]: a
//!   local cache in front of it, uploads written behind through a journal,
//!   reads fetched ahead of the reader ([`ReadAhead`]).
//! - [`ChunkStore`]: zstd compression, hash verification on every read,
//!   framed metadata objects, and the file API ([`FileContent`]) with
//!   FastCDC content-defined chunking and sparse-file support;
//!   [`ChunkStore::store_stream`] stores a long stream (a memory image)
//!   hashing and compressing on every core, new chunks written in batches.
//! - [`frame`]: the magic/version/length/CRC32 envelope for metadata.
//! - [`collect_garbage`]: mark-and-sweep from caller-supplied live roots.
//! - [`process`]: processes told apart by start time; the writer named in
//!   a temporary's name, which decides when a sweeper may remove it.
//!
//! The store knows nothing of sandboxes; callers attach their own context
//! to reads with [`ReadContext`] so errors name the snapshot and file.

mod backend;
mod blob;
mod chunk;
mod file;
pub mod frame;
mod gc;
mod hash;
mod local;
mod pack;
pub mod process;
mod read_ahead;
mod s3;
mod stream;
mod tiered;
mod verify;

pub use backend::StoreBackend;
pub use blob::{BlobError, BlobStore, IncompleteWrites, ObjectInfo, PutOutcome, MAX_OBJECT};
pub use chunk::{decode_chunk, ChunkDecodeError, ChunkStore, PutChunk, ReadContext, StoreError, MAX_WINDOW_LOG};
pub use file::{ChunkRef, ChunkSizes, FileContent, AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
pub use frame::{FrameError, Framed};
pub use gc::{collect_garbage, GcReport};
pub use hash::{ChunkHash, ParseChunkHashError};
pub use local::LocalStore;
pub use read_ahead::ReadAhead;
pub use s3::{S3Config, S3Prefix, S3Store, MULTIPART_THRESHOLD, REFRESH_WINDOW};
pub use stream::{Cutting, StreamStats};
pub use tiered::{TieredOptions, TieredStore};
pub use verify::{CopyState, ObjectCheck};
