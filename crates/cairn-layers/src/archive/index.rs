//! The layer index: one typed record per entry of an overlay upper
//! directory, in depth-first pre-order (a directory before its children,
//! siblings sorted by name bytes).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use cairn_store::{ChunkHash, FileContent, ParseChunkHashError};
use serde::{Deserialize, Serialize};

/// Identifies a captured layer: the BLAKE3 hash of its framed index bytes,
/// which is also the key the index is stored under.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayerId(ChunkHash);

impl LayerId {
    pub const fn from_hash(hash: ChunkHash) -> Self {
        Self(hash)
    }

    /// The chunk-store key of the index; a GC root for the layer.
    pub const fn as_hash(&self) -> &ChunkHash {
        &self.0
    }
}

impl fmt::Display for LayerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for LayerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LayerId({})", self.0.short())
    }
}

impl FromStr for LayerId {
    type Err = ParseChunkHashError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Self)
    }
}

/// A path inside a layer, relative to its root, as raw bytes (Linux names
/// need not be UTF-8). The root itself is the empty path.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayerPath(#[serde(with = "serde_bytes")] Vec<u8>);

impl LayerPath {
    pub fn root() -> Self {
        Self(Vec::new())
    }

    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self(bytes.to_vec())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// `self/name`.
    pub fn join(&self, name: &[u8]) -> Self {
        let mut v = self.0.clone();
        if !v.is_empty() {
            v.push(b'/');
        }
        v.extend_from_slice(name);
        Self(v)
    }

    /// Parent path and last component; `None` for the root.
    pub fn split_last(&self) -> Option<(&[u8], &[u8])> {
        if self.0.is_empty() {
            return None;
        }
        Some(match self.0.iter().rposition(|&b| b == b'/') {
            Some(i) => (&self.0[..i], &self.0[i + 1..]),
            None => (&[][..], &self.0[..]),
        })
    }

    pub fn components(&self) -> impl Iterator<Item = &[u8]> {
        self.0.split(|&b| b == b'/').filter(|c| !c.is_empty())
    }

    /// Absolute-looking form for messages and [`cairn_store::ReadContext`].
    pub fn display_path(&self) -> PathBuf {
        use std::os::unix::ffi::OsStrExt;
        let mut v = b"/".to_vec();
        v.extend_from_slice(&self.0);
        PathBuf::from(std::ffi::OsStr::from_bytes(&v))
    }

    /// Refuses anything that could escape the layer root or that the
    /// kernel would refuse: empty, `.`, `..`, over-long components, NUL.
    fn validate(&self) -> Result<(), String> {
        if self.0.is_empty() {
            return Ok(());
        }
        for c in self.0.split(|&b| b == b'/') {
            if c.is_empty() || c == b"." || c == b".." || c.len() > 255 || c.contains(&0) {
                return Err(format!("path {:?} has an invalid component", self.display_path()));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for LayerPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.display_path())
    }
}

/// Nanosecond-precision timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

/// One extended attribute, name and value as raw bytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Xattr {
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub value: Vec<u8>,
}

/// Inode metadata kept for every entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    /// Permission bits including setuid, setgid and sticky (`mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: Timestamp,
    /// All xattrs, sorted by name, including `trusted.overlay.*`.
    pub xattrs: Vec<Xattr>,
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EntryKind {
    Directory,
    File(FileContent),
    /// Another name for an earlier non-directory entry of this layer.
    HardLink {
        target: LayerPath,
    },
    Symlink {
        #[serde(with = "serde_bytes")]
        target: Vec<u8>,
    },
    Fifo,
    Socket,
    /// Character device; 0:0 is an overlayfs whiteout.
    CharDevice {
        major: u32,
        minor: u32,
    },
    BlockDevice {
        major: u32,
        minor: u32,
    },
    /// A regular file of at most [`SMALL_FILE_MAX`] bytes, held in the
    /// index itself: a tree of many small files costs index bytes, not one
    /// store object each.
    SmallFile {
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
}

/// The largest file capture keeps in the index ([`EntryKind::SmallFile`]).
pub const SMALL_FILE_MAX: usize = 4096;

impl EntryKind {
    pub fn is_whiteout(&self) -> bool {
        matches!(self, EntryKind::CharDevice { major: 0, minor: 0 })
    }

    /// Whether this is a regular file, in the store or in the index.
    pub fn is_file(&self) -> bool {
        matches!(self, EntryKind::File(_) | EntryKind::SmallFile { .. })
    }

    /// A regular file's size (0 for everything else).
    pub fn file_size(&self) -> u64 {
        match self {
            EntryKind::File(c) => c.size,
            EntryKind::SmallFile { data } => data.len() as u64,
            _ => 0,
        }
    }

    /// The store chunks a file's content is in.
    pub fn chunks(&self) -> &[cairn_store::ChunkRef] {
        match self {
            EntryKind::File(content) => &content.chunks,
            _ => &[],
        }
    }
}

/// One entry of a layer. For a hard link the metadata mirrors its target's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub path: LayerPath,
    pub kind: EntryKind,
    pub meta: Metadata,
}

/// Everything a captured upper directory held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerIndex {
    /// Pre-order: the root first, each directory before its children.
    pub entries: Vec<Entry>,
}

impl LayerIndex {
    /// Every chunk the layer's files reference (not the index's own
    /// objects: see [`super::stored::layer_objects`]).
    pub fn referenced_chunks(&self) -> impl Iterator<Item = ChunkHash> + '_ {
        self.entries.iter().flat_map(|e| e.kind.chunks()).map(|c| c.hash)
    }

    /// Total file bytes (apparent size) in the layer; saturates, as a
    /// hostile index can declare sizes that overflow a sum.
    pub fn file_bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| e.kind.file_size())
            .fold(0, u64::saturating_add)
    }

    /// Structural checks a reader makes before trusting the index (see
    /// [`EntryChecker`]).
    pub fn validate(&self) -> Result<(), String> {
        let mut checker = EntryChecker::default();
        for e in &self.entries {
            checker.check(e)?;
        }
        checker.finish()
    }
}

/// Checks a layer's entries one at a time, in order, in memory that grows
/// with the tree's depth and its count of files (8 bytes each), not with
/// its paths: a root directory first; valid paths; depth-first pre-order
/// with siblings in strictly increasing name order (so no path appears
/// twice); every parent a directory; hard links pointing at earlier files,
/// symlinks or special files; file records consistent.
#[derive(Default)]
pub struct EntryChecker {
    /// The directories from the root to the one entered last, with the
    /// name of the last child seen in each.
    open: Vec<(LayerPath, Option<Vec<u8>>)>,
    /// Keyed hashes of the paths a hard link may point at.
    linkable: std::collections::HashSet<u64>,
    hasher: std::hash::RandomState,
    seen: u64,
}

impl EntryChecker {
    pub fn check(&mut self, e: &Entry) -> Result<(), String> {
        use std::hash::BuildHasher;
        self.seen += 1;
        if self.seen == 1 {
            if !e.path.is_root() || e.kind != EntryKind::Directory {
                return Err("its first entry is not the root directory".into());
            }
            self.open.push((e.path.clone(), None));
            return Ok(());
        }
        e.path.validate()?;
        let (parent, name) = e.path.split_last().ok_or("the root appears twice")?;
        while self.open.last().is_some_and(|(dir, _)| dir.as_bytes() != parent) {
            self.open.pop();
        }
        let Some((_, last)) = self.open.last_mut() else {
            return Err(format!(
                "{:?} is not in depth-first order after its parent, or its parent is not a directory",
                e.path
            ));
        };
        match last.as_deref() {
            Some(prev) if prev == name => return Err(format!("{:?} appears twice", e.path)),
            Some(prev) if prev > name => {
                return Err(format!("{:?} comes after a sibling whose name sorts after it", e.path))
            }
            _ => *last = Some(name.to_vec()),
        }
        match &e.kind {
            EntryKind::Directory => self.open.push((e.path.clone(), None)),
            EntryKind::HardLink { target } => {
                if !self.linkable.contains(&self.hasher.hash_one(target.as_bytes())) {
                    return Err(format!(
                        "hard link {:?} points at {:?}, which is not an earlier file",
                        e.path, target
                    ));
                }
            }
            kind => {
                match kind {
                    EntryKind::File(content) => content.validate().map_err(|r| format!("file {:?}: {r}", e.path))?,
                    EntryKind::SmallFile { data } if data.len() > SMALL_FILE_MAX => {
                        return Err(format!(
                            "file {:?} holds {} bytes in the index, over the {SMALL_FILE_MAX} allowed",
                            e.path,
                            data.len()
                        ))
                    }
                    _ => {}
                }
                self.linkable.insert(self.hasher.hash_one(e.path.as_bytes()));
            }
        }
        Ok(())
    }

    /// Checks what only the end can tell: that there was a root.
    pub fn finish(&self) -> Result<(), String> {
        if self.seen == 0 {
            return Err("it has no root entry".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Metadata {
        Metadata {
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: Timestamp { sec: 1, nsec: 2 },
            xattrs: vec![Xattr {
                name: b"trusted.overlay.opaque".to_vec(),
                value: b"y".to_vec(),
            }],
        }
    }

    fn entry(path: &[u8], kind: EntryKind) -> Entry {
        Entry {
            path: LayerPath(path.to_vec()),
            kind,
            meta: meta(),
        }
    }

    fn sample() -> LayerIndex {
        LayerIndex {
            entries: vec![
                entry(b"", EntryKind::Directory),
                entry(b"d", EntryKind::Directory),
                entry(b"d/f", EntryKind::File(FileContent::default())),
                entry(b"d/wh", EntryKind::CharDevice { major: 0, minor: 0 }),
                entry(
                    b"link",
                    EntryKind::HardLink {
                        target: LayerPath(b"d/f".to_vec()),
                    },
                ),
                entry(b"\xff\xfe", EntryKind::Symlink { target: b"/x".to_vec() }),
            ],
        }
    }

    fn root(entries: Vec<Entry>) -> crate::archive::IndexRoot {
        crate::archive::IndexRoot {
            entries,
            segments: Vec::new(),
        }
    }

    #[test]
    fn index_round_trips_through_its_frame() {
        let bytes = cairn_store::frame::encode(&root(sample().entries)).unwrap();
        assert_eq!(&bytes[..8], b"CAIRNLIX");
        assert_eq!(&bytes[8..12], &2u32.to_le_bytes());
        let back: crate::archive::IndexRoot = cairn_store::frame::decode(&bytes).unwrap();
        assert_eq!(back, root(sample().entries));
        sample().validate().unwrap();
    }

    #[test]
    fn a_version_1_index_is_read_as_one_run() {
        #[derive(Serialize)]
        struct V1 {
            entries: Vec<Entry>,
        }
        use bincode::Options;
        let payload = bincode::DefaultOptions::new()
            .with_varint_encoding()
            .with_little_endian()
            .serialize(&V1 {
                entries: sample().entries,
            })
            .unwrap();
        let bytes = cairn_store::frame::seal::<crate::archive::IndexRoot>(1, &payload);
        let back: crate::archive::IndexRoot = cairn_store::frame::decode(&bytes).unwrap();
        assert_eq!(back, root(sample().entries));
    }

    #[test]
    fn an_index_from_a_future_version_is_refused() {
        let mut bytes = cairn_store::frame::encode(&root(sample().entries)).unwrap();
        bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
        let err = cairn_store::frame::decode::<crate::archive::IndexRoot>(&bytes).unwrap_err();
        assert!(err.to_string().contains("layer index has format version 3"), "{err}");
    }

    #[test]
    fn siblings_out_of_order_and_small_files_over_the_limit_are_invalid() {
        let mut idx = sample();
        idx.entries.push(entry(b"a", EntryKind::Fifo));
        assert!(
            idx.validate().unwrap_err().contains("sorts after"),
            "{:?}",
            idx.validate()
        );
        let mut idx = sample();
        idx.entries.push(entry(
            b"\xff\xff",
            EntryKind::SmallFile {
                data: vec![0; SMALL_FILE_MAX + 1],
            },
        ));
        assert!(idx.validate().unwrap_err().contains("over the"));
    }

    #[test]
    fn escaping_paths_and_dangling_links_are_invalid() {
        for bad in [&b"../etc"[..], b"d/./f", b"d//f", b"/abs"] {
            let mut idx = sample();
            idx.entries.push(entry(bad, EntryKind::Fifo));
            assert!(idx.validate().is_err(), "{bad:?} accepted");
        }
        let mut idx = sample();
        idx.entries.insert(
            5,
            entry(
                b"m2",
                EntryKind::HardLink {
                    target: LayerPath(b"d".to_vec()),
                },
            ),
        );
        assert!(idx.validate().unwrap_err().contains("not an earlier file"));
        let mut idx = sample();
        idx.entries.push(entry(b"x/y", EntryKind::Fifo));
        assert!(idx.validate().is_err());
        let mut idx = sample();
        idx.entries.insert(3, entry(b"d/f", EntryKind::Fifo));
        assert!(idx.validate().unwrap_err().contains("twice"));
    }

    #[test]
    fn layer_paths_split_and_join() {
        let p = LayerPath::root().join(b"a").join(b"b");
        assert_eq!(p.as_bytes(), b"a/b");
        assert_eq!(p.split_last(), Some((&b"a"[..], &b"b"[..])));
        assert_eq!(LayerPath::root().join(b"a").split_last(), Some((&b""[..], &b"a"[..])));
        assert_eq!(p.components().count(), 2);
    }
}
