//! Packs: a batch of new objects written as one file.
//!
//! A memory image's first snapshot stores thousands of new chunks (7,000
//! of about 77 KB for 512 MiB). One file, one fsync and one rename each
//! cost six times what the same bytes cost written as one file, so a
//! batch with many new objects ([`MIN_PACKED`]) is written as a pack:
//!
//! ```text
//! <root>/packs/<writer>-<n>-<nanos>.pack   the objects' bytes, one after another
//! <root>/packs/<writer>-<n>-<nanos>.idx    framed PackIndex: key, offset and length of each
//! ```
//!
//! Both are written in `tmp/` and fsynced; the pack is renamed into place
//! first, then its index, then `packs/` is fsynced. The index is the
//! commit point: a pack without one is an interrupted write, removed once
//! its writer (named in the file name, [`crate::process`]) is dead, and
//! never read. A packed object is read with one `pread`; removing one
//! (garbage collection, a corrupt copy replaced) first writes the pack's
//! other objects as ordinary files, then removes the index and the pack.
//! Every reader learns of packs other processes wrote when a lookup
//! misses and `packs/` changed since it last listed it.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::blob::BlobError;
use crate::frame::{self, Framed};
use crate::hash::ChunkHash;

pub(crate) const PACKS_DIR: &str = "packs";
pub(crate) const PACK_SUFFIX: &str = ".pack";
pub(crate) const INDEX_SUFFIX: &str = ".idx";
/// A batch writes its new objects as a pack when it has at least this
/// many; fewer are written as files of their own (a snapshot after a small
/// change has a few new chunks per batch, and a pack of two would only add
/// a file to read).
pub(crate) const MIN_PACKED: usize = 16;

/// A pack's index: where each of its objects is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PackIndex {
    /// The pack's length: an index whose pack is shorter is not used.
    pub pack_len: u64,
    pub entries: Vec<PackEntry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PackEntry {
    pub key: ChunkHash,
    pub offset: u64,
    pub len: u32,
}

impl Framed for PackIndex {
    const MAGIC: [u8; 8] = *b"CAIRNPKI";
    const VERSION: u32 = 1;
    /// 64 MiB of 4 KiB objects, at about 45 bytes an entry.
    const MAX_PAYLOAD: u64 = 1 << 20;
    const NAME: &'static str = "pack index";
}

/// Where a packed object is.
#[derive(Debug, Clone)]
pub(crate) struct Located {
    pub pack: Arc<str>,
    pub offset: u64,
    pub len: u32,
}

/// The packs a store has loaded the indexes of.
#[derive(Debug, Default)]
pub(crate) struct Packs {
    /// Where each packed object is: usually one pack, more when two
    /// writers packed the same new object at once.
    objects: HashMap<ChunkHash, Vec<Located>>,
    /// Each pack's objects, by pack name.
    members: HashMap<Arc<str>, Vec<ChunkHash>>,
    /// `packs/`'s modification time when it was last listed.
    listed: Option<SystemTime>,
}

impl Packs {
    pub fn locate(&self, key: &ChunkHash) -> Option<Located> {
        self.objects.get(key).and_then(|at| at.first()).cloned()
    }

    /// Every packed object, with its pack.
    pub fn all(&self) -> impl Iterator<Item = (&ChunkHash, &Located)> {
        self.objects.iter().filter_map(|(key, at)| Some((key, at.first()?)))
    }

    pub fn add(&mut self, name: &str, index: &PackIndex) {
        let pack: Arc<str> = Arc::from(name);
        for e in &index.entries {
            self.objects.entry(e.key).or_default().push(Located {
                pack: pack.clone(),
                offset: e.offset,
                len: e.len,
            });
        }
        self.members.insert(pack, index.entries.iter().map(|e| e.key).collect());
    }

    pub fn forget(&mut self, name: &str) {
        let Some(keys) = self.members.remove(name) else { return };
        for key in keys {
            if let Some(at) = self.objects.get_mut(&key) {
                at.retain(|l| &*l.pack != name);
                if at.is_empty() {
                    self.objects.remove(&key);
                }
            }
        }
    }

    /// Whether `packs/` is as it was when last listed.
    pub fn is_current(&self, dir: &Path) -> bool {
        self.listed.is_some() && fs::metadata(dir).and_then(|m| m.modified()).ok() == self.listed
    }

    /// Brings the loaded indexes up to `packs/`: new packs are added, gone
    /// ones forgotten. Skipped when `packs/` has not changed since the last
    /// listing, unless `force`.
    pub fn reload(&mut self, dir: &Path, force: bool) -> Result<(), BlobError> {
        let mtime = match fs::metadata(dir) {
            Ok(m) => m.modified().ok(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(BlobError::io("stat", dir, e)),
        };
        if !force && mtime.is_some() && mtime == self.listed {
            return Ok(());
        }
        let mut present = Vec::new();
        for (name, path) in read_dir(dir)? {
            let Some(stem) = name.strip_suffix(INDEX_SUFFIX) else {
                continue;
            };
            present.push(stem.to_string());
            if self.members.contains_key(stem) {
                continue;
            }
            match read_index(&path, &dir.join(format!("{stem}{PACK_SUFFIX}"))) {
                Ok(Some(index)) => self.add(stem, &index),
                Ok(None) => {}
                Err(e) => tracing::warn!(pack = stem, "a pack index cannot be read, its objects are skipped: {e}"),
            }
        }
        let gone: Vec<Arc<str>> = self
            .members
            .keys()
            .filter(|k| !present.iter().any(|p| p == &***k))
            .cloned()
            .collect();
        for name in gone {
            self.forget(&name);
        }
        self.listed = mtime;
        Ok(())
    }
}

/// The index at `idx`, if it decodes and its pack is whole; `None` when
/// either file is gone (removed meanwhile).
pub(crate) fn read_index(idx: &Path, pack: &Path) -> Result<Option<PackIndex>, BlobError> {
    let bytes = match fs::read(idx) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(BlobError::io("read pack index", idx, e)),
    };
    let index: PackIndex = frame::decode(&bytes).map_err(|source| BlobError::Layout {
        path: idx.to_path_buf(),
        source,
    })?;
    let len = match fs::metadata(pack) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(BlobError::io("stat pack", pack, e)),
    };
    let fits = index.pack_len == len
        && index
            .entries
            .iter()
            .all(|e| e.offset.checked_add(e.len as u64).is_some_and(|end| end <= len));
    if !fits {
        return Err(BlobError::io(
            "use pack",
            pack,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("its index names {} bytes and the pack has {len}", index.pack_len),
            ),
        ));
    }
    Ok(Some(index))
}

/// One packed object's bytes.
pub(crate) fn read_packed(pack: &Path, at: &Located) -> io::Result<Vec<u8>> {
    let f = File::open(pack)?;
    let mut buf = vec![0u8; at.len as usize];
    f.read_exact_at(&mut buf, at.offset)?;
    Ok(buf)
}

pub(crate) fn read_dir(dir: &Path) -> Result<Vec<(String, PathBuf)>, BlobError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(BlobError::io("list directory", dir, e)),
    };
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| BlobError::io("list directory", dir, e))?;
        if let Ok(name) = entry.file_name().into_string() {
            out.push((name, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}
