//! Overlay layer chains.
//!
//! A layer is an immutable directory tree; a sandbox's root is overlayfs
//! over a chain of layers (topmost first) plus a private upper directory.
//! [`LayerStore`] keeps the local layer directories. Layers are created by
//! preparing a directory and committing it, which renames it into place in
//! one step, so a crash never leaves a half-written layer under a layer id.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Names one layer: 32 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerId(String);

impl LayerId {
    /// A fresh random id for a layer built from outside content.
    pub fn random() -> LayerId {
        let mut bytes = [0u8; 16];
        getrandom::getrandom(&mut bytes).expect("the kernel RNG is available");
        LayerId(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LayerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for LayerId {
    type Err = LayerError;
    fn from_str(s: &str) -> Result<Self, LayerError> {
        if s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(LayerId(s.to_string()))
        } else {
            Err(LayerError::BadId(s.to_string()))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("{0:?} is not a layer id (32 hex digits)")]
    BadId(String),
    #[error("layer {0} is missing from {1}; rebuild or re-import the image that uses it")]
    Missing(LayerId, PathBuf),
    #[error("layer store I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> LayerError + '_ {
    move |source| LayerError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The local directory of layers: `<root>/<id>/` for committed layers,
/// `<root>/.tmp-<id>/` while one is being prepared.
#[derive(Debug, Clone)]
pub struct LayerStore {
    root: PathBuf,
}

/// A layer being filled; becomes visible only on [`PendingLayer::commit`].
/// Dropped without committing, it removes what was written.
pub struct PendingLayer {
    id: LayerId,
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl PendingLayer {
    /// Where to write the layer's content.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    pub fn id(&self) -> &LayerId {
        &self.id
    }

    pub fn commit(mut self) -> Result<LayerId, LayerError> {
        fs::rename(&self.tmp, &self.dest).map_err(io_err(&self.dest))?;
        self.committed = true;
        Ok(self.id.clone())
    }
}

impl Drop for PendingLayer {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

impl LayerStore {
    pub fn open(root: impl Into<PathBuf>) -> Result<LayerStore, LayerError> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(io_err(&root))?;
        Ok(LayerStore { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Starts a new layer in a temporary directory.
    pub fn prepare(&self) -> Result<PendingLayer, LayerError> {
        let id = LayerId::random();
        // The pid in the name tells the sweeper whether a builder still runs.
        let tmp = self.root.join(format!(".tmp-{id}-{}", std::process::id()));
        fs::create_dir(&tmp).map_err(io_err(&tmp))?;
        let dest = self.root.join(id.as_str());
        Ok(PendingLayer {
            id,
            tmp,
            dest,
            committed: false,
        })
    }

    /// The directory of a committed layer.
    pub fn path(&self, id: &LayerId) -> Result<PathBuf, LayerError> {
        let p = self.root.join(id.as_str());
        if p.is_dir() {
            Ok(p)
        } else {
            Err(LayerError::Missing(id.clone(), self.root.clone()))
        }
    }

    /// Committed layer ids.
    pub fn list(&self) -> Result<Vec<LayerId>, LayerError> {
        let entries = fs::read_dir(&self.root).map_err(io_err(&self.root))?;
        Ok(entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect())
    }

    /// Deletes a layer (the caller checks nothing uses it).
    pub fn remove(&self, id: &LayerId) -> Result<(), LayerError> {
        let p = self.root.join(id.as_str());
        // Rename first so a crash mid-delete leaves only a temporary.
        let doomed = self.root.join(format!(".tmp-rm-{id}"));
        match fs::rename(&p, &doomed) {
            Ok(()) => fs::remove_dir_all(&doomed).map_err(io_err(&doomed)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&p)(e)),
        }
    }

    /// Removes temporaries left by interrupted builds and deletes.
    pub fn sweep_temporaries(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return 0;
        };
        let mut n = 0;
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") && fs::remove_dir_all(e.path()).is_ok() {
                n += 1;
            }
        }
        n
    }

    /// Bytes used by a layer (apparent sizes of its files).
    pub fn size(&self, id: &LayerId) -> u64 {
        fn walk(p: &Path) -> u64 {
            let Ok(md) = fs::symlink_metadata(p) else {
                return 0;
            };
            if md.is_dir() {
                fs::read_dir(p)
                    .map(|rd| rd.flatten().map(|e| walk(&e.path())).sum())
                    .unwrap_or(0)
            } else {
                md.len()
            }
        }
        walk(&self.root.join(id.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_is_visible_only_after_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = LayerStore::open(dir.path()).unwrap();
        let pending = store.prepare().unwrap();
        let id = pending.id().clone();
        fs::write(pending.path().join("f"), "x").unwrap();
        assert!(store.path(&id).is_err());
        assert!(store.list().unwrap().is_empty());
        let id = pending.commit().unwrap();
        assert_eq!(fs::read_to_string(store.path(&id).unwrap().join("f")).unwrap(), "x");
        assert_eq!(store.list().unwrap(), vec![id.clone()]);
        store.remove(&id).unwrap();
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn an_abandoned_layer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = LayerStore::open(dir.path()).unwrap();
        drop(store.prepare().unwrap());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn layer_ids_are_checked() {
        assert!("xyz".parse::<LayerId>().is_err());
        assert!(LayerId::random().to_string().parse::<LayerId>().is_ok());
    }
}

pub mod archive;
