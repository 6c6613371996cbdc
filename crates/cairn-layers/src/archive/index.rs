//! The layer index: one typed record per entry of an overlay upper
//! directory, in depth-first pre-order (a directory before its children,
//! siblings sorted by name bytes).

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use cairn_store::{ChunkHash, FileContent, Framed, ParseChunkHashError};
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
}

impl EntryKind {
    pub fn is_whiteout(&self) -> bool {
        matches!(self, EntryKind::CharDevice { major: 0, minor: 0 })
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

impl Framed for LayerIndex {
    const MAGIC: [u8; 8] = *b"CAIRNLIX";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 512 << 20;
    const NAME: &'static str = "layer index";
}

impl LayerIndex {
    /// Every chunk the layer's files reference (the index object itself is
    /// [`LayerId::as_hash`]); what GC must mark for a live layer.
    pub fn referenced_chunks(&self) -> impl Iterator<Item = ChunkHash> + '_ {
        self.entries
            .iter()
            .flat_map(|e| match &e.kind {
                EntryKind::File(content) => content.chunks.as_slice(),
                _ => &[],
            })
            .map(|c| c.hash)
    }

    /// Total file bytes (apparent size) in the layer; saturates, as a
    /// hostile index can declare sizes that overflow a sum.
    pub fn file_bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| match &e.kind {
                EntryKind::File(c) => c.size,
                _ => 0,
            })
            .fold(0, u64::saturating_add)
    }

    /// Structural checks a reader makes before trusting the index: a root
    /// directory first, valid unique paths, every parent an earlier
    /// directory, hard links pointing at earlier non-directories, file
    /// records consistent. (Pre-order is checked while materialising.)
    pub fn validate(&self) -> Result<(), String> {
        let first = self.entries.first().ok_or("it has no root entry")?;
        if !first.path.is_root() || first.kind != EntryKind::Directory {
            return Err("its first entry is not the root directory".into());
        }
        let mut seen: HashMap<&LayerPath, &EntryKind> = HashMap::with_capacity(self.entries.len());
        seen.insert(&first.path, &first.kind);
        for e in &self.entries[1..] {
            e.path.validate()?;
            let (parent, _) = e.path.split_last().ok_or("the root appears twice")?;
            match seen.get(&LayerPath(parent.to_vec())) {
                Some(EntryKind::Directory) => {}
                _ => {
                    return Err(format!(
                        "{:?} comes before its parent directory or its parent is not a directory",
                        e.path
                    ))
                }
            }
            match &e.kind {
                EntryKind::HardLink { target } => match seen.get(target) {
                    Some(EntryKind::Directory | EntryKind::HardLink { .. }) | None => {
                        return Err(format!(
                            "hard link {:?} points at {:?}, which is not an earlier file",
                            e.path, target
                        ))
                    }
                    Some(_) => {}
                },
                EntryKind::File(content) => content.validate().map_err(|r| format!("file {:?}: {r}", e.path))?,
                _ => {}
            }
            if seen.insert(&e.path, &e.kind).is_some() {
                return Err(format!("{:?} appears twice", e.path));
            }
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

    #[test]
    fn index_round_trips_through_its_frame() {
        let bytes = cairn_store::frame::encode(&sample()).unwrap();
        assert_eq!(&bytes[..8], b"CAIRNLIX");
        let back: LayerIndex = cairn_store::frame::decode(&bytes).unwrap();
        assert_eq!(back, sample());
        back.validate().unwrap();
    }

    #[test]
    fn an_index_from_a_future_version_is_refused() {
        let mut bytes = cairn_store::frame::encode(&sample()).unwrap();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        let err = cairn_store::frame::decode::<LayerIndex>(&bytes).unwrap_err();
        assert!(err.to_string().contains("layer index has format version 2"), "{err}");
    }

    #[test]
    fn escaping_paths_and_dangling_links_are_invalid() {
        for bad in [&b"../etc"[..], b"d/./f", b"d//f", b"/abs"] {
            let mut idx = sample();
            idx.entries.push(entry(bad, EntryKind::Fifo));
            assert!(idx.validate().is_err(), "{bad:?} accepted");
        }
        let mut idx = sample();
        idx.entries.push(entry(
            b"l2",
            EntryKind::HardLink {
                target: LayerPath(b"d".to_vec()),
            },
        ));
        assert!(idx.validate().unwrap_err().contains("not an earlier file"));
        let mut idx = sample();
        idx.entries.push(entry(b"x/y", EntryKind::Fifo));
        assert!(idx.validate().is_err());
        let mut idx = sample();
        idx.entries.push(entry(b"d/f", EntryKind::Fifo));
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
