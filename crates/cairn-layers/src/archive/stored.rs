//! How a layer index is stored: a root object (the [`LayerId`]) that holds
//! a small layer's entries itself and a large layer's as a list of segment
//! objects, so that writing or reading a layer of millions of entries holds
//! one segment at a time.

use cairn_store::{BlobStore, ChunkHash, ChunkStore, FrameError, Framed, ReadContext, StoreError};
use serde::{Deserialize, Serialize};

use super::index::{Entry, EntryChecker, LayerId, LayerIndex};
use super::ArchiveError;

/// A stored layer index (`CAIRNLIX` version 2): the entries of a layer
/// that fits in one segment, or the segments of a larger one, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexRoot {
    pub entries: Vec<Entry>,
    pub segments: Vec<SegmentRef>,
}

/// One segment of a large layer's index: its object and how many entries
/// it holds (checked when it is read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    pub hash: ChunkHash,
    pub entries: u32,
}

/// A run of a large layer's entries (`CAIRNLIS`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSegment {
    pub entries: Vec<Entry>,
}

/// Version 1 held every entry in the one object.
#[derive(Deserialize)]
struct IndexV1 {
    entries: Vec<Entry>,
}

impl Framed for IndexRoot {
    const MAGIC: [u8; 8] = *b"CAIRNLIX";
    const VERSION: u32 = 2;
    const MAX_PAYLOAD: u64 = 512 << 20;
    const NAME: &'static str = "layer index";

    fn decode_older(version: u32, payload: &[u8]) -> Result<Self, FrameError> {
        if version != 1 {
            return Err(FrameError::UnsupportedOldVersion {
                what: Self::NAME,
                found: version,
                supported: Self::VERSION,
            });
        }
        let v1: IndexV1 = cairn_store::frame::decode_payload(Self::NAME, Self::MAX_PAYLOAD, payload)?;
        Ok(IndexRoot {
            entries: v1.entries,
            segments: Vec::new(),
        })
    }
}

impl Framed for IndexSegment {
    const MAGIC: [u8; 8] = *b"CAIRNLIS";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 512 << 20;
    const NAME: &'static str = "layer index segment";
}

/// A segment is written once it holds this many entries…
pub const SEGMENT_ENTRIES: usize = 16 * 1024;
/// …or about this many bytes of paths, inline data, xattrs and chunk lists.
pub const SEGMENT_BYTES: usize = 4 << 20;

/// What a written index holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexSummary {
    pub id: LayerId,
    pub entries: u64,
    /// Apparent size of every file, saturating.
    pub file_bytes: u64,
}

/// Writes a layer index entry by entry, in order, holding at most one
/// segment's entries.
pub struct IndexWriter<'a, B> {
    store: &'a ChunkStore<B>,
    buffer: Vec<Entry>,
    buffered_bytes: usize,
    segments: Vec<SegmentRef>,
    entries: u64,
    file_bytes: u64,
    max_entries: usize,
    max_bytes: usize,
}

fn weight(e: &Entry) -> usize {
    let kind = match &e.kind {
        super::EntryKind::File(c) => c.chunks.len() * 48,
        super::EntryKind::SmallFile { data } => data.len(),
        super::EntryKind::Symlink { target } => target.len(),
        super::EntryKind::HardLink { target } => target.as_bytes().len(),
        _ => 0,
    };
    let xattrs: usize = e.meta.xattrs.iter().map(|x| x.name.len() + x.value.len()).sum();
    32 + e.path.as_bytes().len() + kind + xattrs
}

impl<'a, B: BlobStore> IndexWriter<'a, B> {
    pub fn new(store: &'a ChunkStore<B>) -> Self {
        Self::with_segments(store, SEGMENT_ENTRIES, SEGMENT_BYTES)
    }

    /// A writer that cuts segments at other sizes (small ones let tests
    /// make many-segment layers from a few files).
    pub fn with_segments(store: &'a ChunkStore<B>, max_entries: usize, max_bytes: usize) -> Self {
        Self {
            store,
            buffer: Vec::new(),
            buffered_bytes: 0,
            segments: Vec::new(),
            entries: 0,
            file_bytes: 0,
            max_entries: max_entries.max(1),
            max_bytes,
        }
    }

    pub fn push(&mut self, entry: Entry) -> Result<(), StoreError> {
        self.entries += 1;
        self.file_bytes = self.file_bytes.saturating_add(entry.kind.file_size());
        self.buffered_bytes += weight(&entry);
        self.buffer.push(entry);
        if self.buffer.len() >= self.max_entries || self.buffered_bytes >= self.max_bytes {
            self.flush()?;
        }
        Ok(())
    }

    /// Entries pushed so far.
    pub fn len(&self) -> u64 {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let segment = IndexSegment {
            entries: std::mem::take(&mut self.buffer),
        };
        let hash = self.store.put_object(&segment)?;
        self.segments.push(SegmentRef {
            hash,
            entries: segment.entries.len() as u32,
        });
        self.buffered_bytes = 0;
        Ok(())
    }

    /// Stores the root and returns the layer's id: the entries themselves
    /// when no segment was cut, else the segments.
    pub fn finish(mut self) -> Result<IndexSummary, StoreError> {
        let root = if self.segments.is_empty() {
            IndexRoot {
                entries: std::mem::take(&mut self.buffer),
                segments: Vec::new(),
            }
        } else {
            self.flush()?;
            IndexRoot {
                entries: Vec::new(),
                segments: std::mem::take(&mut self.segments),
            }
        };
        let id = LayerId::from_hash(self.store.put_object(&root)?);
        Ok(IndexSummary {
            id,
            entries: self.entries,
            file_bytes: self.file_bytes,
        })
    }
}

/// Stores `entries` as a layer index.
pub fn write_index<B: BlobStore>(
    store: &ChunkStore<B>,
    entries: impl IntoIterator<Item = Entry>,
) -> Result<IndexSummary, StoreError> {
    let mut writer = IndexWriter::new(store);
    for e in entries {
        writer.push(e)?;
    }
    writer.finish()
}

/// Reads layer `layer`'s entries a segment at a time, checking each entry
/// as it goes (see [`EntryChecker`]), and hands each run to `each`.
pub fn for_each_run<B: BlobStore>(
    store: &ChunkStore<B>,
    layer: &LayerId,
    each: impl FnMut(Vec<Entry>) -> Result<(), ArchiveError>,
) -> Result<(), ArchiveError> {
    let context = ReadContext::new().owner("layer", *layer.as_hash());
    let root: IndexRoot = store.get_object(layer.as_hash(), &context)?;
    runs_of(store, layer, root, each)
}

/// [`for_each_run`] of a root already read.
fn runs_of<B: BlobStore>(
    store: &ChunkStore<B>,
    layer: &LayerId,
    root: IndexRoot,
    mut each: impl FnMut(Vec<Entry>) -> Result<(), ArchiveError>,
) -> Result<(), ArchiveError> {
    let context = ReadContext::new().owner("layer", *layer.as_hash());
    let mut checker = EntryChecker::default();
    let invalid = |reason| ArchiveError::InvalidIndex { layer: *layer, reason };
    if !root.entries.is_empty() && !root.segments.is_empty() {
        return Err(invalid("it holds entries and segments both".into()));
    }
    let mut check = |entries: &[Entry]| -> Result<(), ArchiveError> {
        for e in entries {
            checker.check(e).map_err(invalid)?;
        }
        Ok(())
    };
    if root.segments.is_empty() {
        check(&root.entries)?;
        each(root.entries)?;
    } else {
        for (i, s) in root.segments.iter().enumerate() {
            let segment: IndexSegment = store.get_object(&s.hash, &context)?;
            if segment.entries.len() != s.entries as usize || segment.entries.is_empty() {
                return Err(invalid(format!(
                    "segment #{i} holds {} entries where the root says {}",
                    segment.entries.len(),
                    s.entries
                )));
            }
            check(&segment.entries)?;
            each(segment.entries)?;
        }
    }
    checker.finish().map_err(invalid)
}

/// Reads and checks layer `layer`'s whole index into memory (for the
/// operations that need every entry at once: views, flattening).
pub fn load_index<B: BlobStore>(store: &ChunkStore<B>, layer: &LayerId) -> Result<LayerIndex, ArchiveError> {
    let mut entries = Vec::new();
    for_each_run(store, layer, |run| {
        entries.extend(run);
        Ok(())
    })?;
    Ok(LayerIndex { entries })
}

/// Every store object layer `layer` reaches: its root, its segments and
/// every chunk its files reference (what a collector keeps and an export
/// copies). Reads the index a segment at a time.
pub fn layer_objects<B: BlobStore>(store: &ChunkStore<B>, layer: &LayerId) -> Result<Vec<ChunkHash>, ArchiveError> {
    let context = ReadContext::new().owner("layer", *layer.as_hash());
    let root: IndexRoot = store.get_object(layer.as_hash(), &context)?;
    let mut objects = vec![*layer.as_hash()];
    objects.extend(root.segments.iter().map(|s| s.hash));
    runs_of(store, layer, root, |run| {
        objects.extend(run.iter().flat_map(|e| e.kind.chunks()).map(|c| c.hash));
        Ok(())
    })?;
    Ok(objects)
}
