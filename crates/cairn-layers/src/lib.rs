//! Overlay layer chains.
//!
//! A layer is an immutable directory tree; a sandbox's root is overlayfs
//! over a chain of layers (topmost first) plus a private upper directory.
//! [`LayerStore`] keeps the local layer directories, named by the content
//! id of the layer ([`LayerId`], the hash of its index in the chunk store,
//! see [`archive`]). Layers are created by preparing a directory, capturing
//! it into the chunk store and committing it under its id, which renames it
//! into place in one step, so a crash never leaves a half-written layer
//! under a layer id. A layer missing locally is materialised from the store.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cairn_store::process::{self, WriterId};
use cairn_store::{BlobStore, ChunkStore};

pub use archive::LayerId;

pub mod seal;

/// Layer directories whose seal this process has checked.
static CHECKED: std::sync::LazyLock<Mutex<HashSet<PathBuf>>> = std::sync::LazyLock::new(Default::default);

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error(transparent)]
    Archive(#[from] archive::ArchiveError),
    #[error("layer {0} is missing from {1}; rebuild or re-import the image that uses it")]
    Missing(LayerId, PathBuf),
    #[error(
        "layer {id} at {path} changed after Cairn put it in place, and it cannot be rebuilt from the store \
         ({reason}); it is not used: rebuild or re-import the image that uses it"
    )]
    Changed { id: LayerId, path: PathBuf, reason: String },
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

fn checked() -> std::sync::MutexGuard<'static, HashSet<PathBuf>> {
    CHECKED.lock().unwrap_or_else(|e| e.into_inner())
}

/// The local directory of layers: `<root>/<id>/` for committed layers;
/// temporaries, each naming its writer (`<pid>+<start time>`, see
/// [`cairn_store::process`]), for work in progress: `.tmp-<nonce>-<writer>/`
/// while a layer is prepared (built, imported, captured),
/// `.tmp-rm-<id>-<writer>/` while one is deleted, and
/// `.<id>.materialising-<writer>-<nanos>/` while one is materialised.
#[derive(Debug, Clone)]
pub struct LayerStore {
    root: PathBuf,
}

/// A layer [`PendingLayer::commit`] put in place.
#[derive(Debug, Clone, Copy)]
pub struct CommittedLayer {
    pub id: LayerId,
    /// Device nodes removed from the directory before it was captured.
    pub dropped_devices: usize,
}

/// A layer being filled; becomes visible only on [`PendingLayer::commit`].
/// Dropped without committing, it removes what was written.
pub struct PendingLayer {
    tmp: PathBuf,
    root: PathBuf,
    committed: bool,
}

impl PendingLayer {
    /// Where to write the layer's content.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Removes device nodes from the directory (a layer never holds one;
    /// see [`archive::remove_device_nodes`]), captures it into `store` and
    /// moves it into place under its content id. A layer with the same
    /// content already present is kept and this copy discarded.
    pub fn commit<B: BlobStore>(mut self, store: &ChunkStore<B>) -> Result<CommittedLayer, LayerError> {
        let dropped_devices = archive::remove_device_nodes(&self.tmp)?;
        let id = archive::capture(&self.tmp, store)?.id;
        let committed = CommittedLayer { id, dropped_devices };
        let dest = self.root.join(id.to_string());
        if dest.is_dir() {
            return Ok(committed);
        }
        fs::rename(&self.tmp, &dest).map_err(io_err(&dest))?;
        self.committed = true;
        seal::write(&dest).map_err(io_err(&dest))?;
        Ok(committed)
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
    /// Opens (or makes) the directory, kept at mode 0700: layers hold
    /// sandboxes' files, setuid ones included, that no other host user
    /// may reach.
    pub fn open(root: impl Into<PathBuf>) -> Result<LayerStore, LayerError> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(io_err(&root))?;
        let md = fs::metadata(&root).map_err(io_err(&root))?;
        if md.permissions().mode() & 0o077 != 0 {
            fs::set_permissions(&root, fs::Permissions::from_mode(0o700)).map_err(io_err(&root))?;
        }
        Ok(LayerStore { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Starts a new layer in a temporary directory.
    pub fn prepare(&self) -> Result<PendingLayer, LayerError> {
        let mut nonce = [0u8; 8];
        getrandom::getrandom(&mut nonce).expect("the kernel RNG is available");
        let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        // The writer in the name tells the sweeper whether the builder still runs.
        let tmp = self.root.join(format!(".tmp-{nonce}-{}", WriterId::current()));
        fs::create_dir(&tmp).map_err(io_err(&tmp))?;
        Ok(PendingLayer {
            tmp,
            root: self.root.clone(),
            committed: false,
        })
    }

    /// The directory of a layer present locally.
    pub fn path(&self, id: &LayerId) -> Result<PathBuf, LayerError> {
        let p = self.root.join(id.to_string());
        if p.is_dir() {
            Ok(p)
        } else {
            Err(LayerError::Missing(*id, self.root.clone()))
        }
    }

    /// The directory of a layer, materialised from `store` first when it is
    /// not present locally (a layer made on another host, or evicted).
    ///
    /// The first time a process uses a layer present locally, its seal is
    /// checked ([`seal`]): a layer changed behind Cairn's back (a file
    /// edited, a mode or owner changed) is set aside as
    /// `.changed-<id>-<time>/` (sandboxes already running on it keep it)
    /// and rebuilt from the store, whose chunks are checked against their
    /// hashes. A layer from before seals is sealed as it is.
    pub fn ensure<B: BlobStore>(&self, id: &LayerId, store: &ChunkStore<B>) -> Result<PathBuf, LayerError> {
        let p = self.root.join(id.to_string());
        if p.is_dir() {
            self.check(id, &p, store)?;
            return Ok(p);
        }
        self.materialise(id, &p, store)?;
        Ok(p)
    }

    fn materialise<B: BlobStore>(&self, id: &LayerId, p: &Path, store: &ChunkStore<B>) -> Result<(), LayerError> {
        match archive::materialise(id, store, p) {
            Ok(_) => {
                seal::write(p).map_err(io_err(p))?;
                checked().insert(p.to_path_buf());
                Ok(())
            }
            // Another process materialised it first.
            Err(archive::ArchiveError::DestinationExists { .. }) if p.is_dir() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Checks the seal of layer `id` at `p` once per process; rebuilds a
    /// changed layer from `store`.
    fn check<B: BlobStore>(&self, id: &LayerId, p: &Path, store: &ChunkStore<B>) -> Result<(), LayerError> {
        if checked().contains(p) {
            return Ok(());
        }
        let now = seal::compute(p).map_err(io_err(p))?;
        match seal::recorded(p) {
            Some(recorded) if recorded == now => {}
            None => {
                seal::write(p).map_err(io_err(p))?;
            }
            Some(_) => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let aside = self.root.join(format!(".changed-{id}-{nanos}"));
                fs::rename(p, &aside).map_err(io_err(p))?;
                tracing::warn!(
                    layer = %id,
                    aside = %aside.display(),
                    "a layer changed after Cairn put it in place; rebuilding it from the store"
                );
                if let Err(e) = self.materialise(id, p, store) {
                    return Err(LayerError::Changed {
                        id: *id,
                        path: p.to_path_buf(),
                        reason: e.to_string(),
                    });
                }
                return Ok(());
            }
        }
        checked().insert(p.to_path_buf());
        Ok(())
    }

    /// Copies of layers set aside because they changed behind Cairn's back
    /// (see [`Self::ensure`]): kept for inspection, and for sandboxes that
    /// started on them before.
    pub fn changed_copies(&self) -> Vec<PathBuf> {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".changed-"))
            .map(|e| e.path())
            .collect()
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
        let p = self.root.join(id.to_string());
        // Rename first so a crash mid-delete leaves only a temporary.
        let doomed = self.root.join(format!(".tmp-rm-{id}-{}", WriterId::current()));
        let _ = fs::remove_file(seal::path_of(&p));
        checked().remove(&p);
        match fs::rename(&p, &doomed) {
            Ok(()) => fs::remove_dir_all(&doomed).map_err(io_err(&doomed)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&p)(e)),
        }
    }

    /// Removes the temporaries of builds and deletes whose process is dead
    /// (see [`cairn_store::process::is_abandoned`]); one whose process
    /// still runs is kept, however long it takes. Materialisations'
    /// temporaries: [`archive::remove_abandoned_materialisations`].
    pub fn sweep_temporaries(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return 0;
        };
        let mut n = 0;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(".tmp-") {
                continue;
            }
            let Ok(modified) = e.metadata().and_then(|m| m.modified()) else {
                continue;
            };
            if process::is_abandoned(&name, modified) && fs::remove_dir_all(e.path()).is_ok() {
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
        walk(&self.root.join(id.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_store::LocalStore;

    #[test]
    fn a_layer_is_visible_only_after_commit_and_comes_back_from_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path().join("store")).unwrap());
        let layers = LayerStore::open(dir.path().join("layers")).unwrap();
        let pending = layers.prepare().unwrap();
        fs::write(pending.path().join("f"), "x").unwrap();
        assert!(layers.list().unwrap().is_empty());
        let id = pending.commit(&store).unwrap().id;
        assert_eq!(fs::read_to_string(layers.path(&id).unwrap().join("f")).unwrap(), "x");
        assert_eq!(layers.list().unwrap(), vec![id]);
        layers.remove(&id).unwrap();
        assert!(layers.list().unwrap().is_empty());
        // Gone locally, it comes back from the store.
        let back = layers.ensure(&id, &store).unwrap();
        assert_eq!(fs::read_to_string(back.join("f")).unwrap(), "x");
    }

    #[test]
    fn a_layer_changed_behind_cairns_back_is_set_aside_and_rebuilt_from_the_store() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path().join("store")).unwrap());
        let layers = LayerStore::open(dir.path().join("layers")).unwrap();
        assert_eq!(fs::metadata(layers.root()).unwrap().permissions().mode() & 0o777, 0o700);
        let pending = layers.prepare().unwrap();
        fs::create_dir(pending.path().join("bin")).unwrap();
        fs::write(pending.path().join("bin/tool"), "#!/bin/sh\necho good\n").unwrap();
        fs::set_permissions(pending.path().join("bin/tool"), fs::Permissions::from_mode(0o755)).unwrap();
        let id = pending.commit(&store).unwrap().id;
        let p = layers.path(&id).unwrap();
        assert!(seal::recorded(&p).is_some(), "a committed layer is sealed");
        // Behind Cairn's back: a setuid bit and an edit.
        let tool = p.join("bin/tool");
        fs::set_permissions(&tool, fs::Permissions::from_mode(0o4755)).unwrap();
        fs::write(&tool, "#!/bin/sh\necho evil\n").unwrap();
        let used = layers.ensure(&id, &store).unwrap();
        assert_eq!(used, p);
        assert_eq!(fs::read_to_string(&tool).unwrap(), "#!/bin/sh\necho good\n");
        assert_eq!(fs::metadata(&tool).unwrap().permissions().mode() & 0o7777, 0o755);
        let aside = layers.changed_copies();
        assert_eq!(aside.len(), 1);
        assert_eq!(
            fs::read_to_string(aside[0].join("bin/tool")).unwrap(),
            "#!/bin/sh\necho evil\n"
        );
        assert_eq!(seal::recorded(&p), Some(seal::compute(&p).unwrap()));
        // A layer from before seals is sealed as it is, on first use.
        fs::remove_file(seal::path_of(&p)).unwrap();
        checked().remove(&p);
        layers.ensure(&id, &store).unwrap();
        assert_eq!(seal::recorded(&p), Some(seal::compute(&p).unwrap()));
        assert_eq!(layers.changed_copies().len(), 1);
        // Removed, its seal goes with it.
        layers.remove(&id).unwrap();
        assert!(!seal::path_of(&p).exists());
    }

    #[test]
    fn sweeping_keeps_a_layer_being_prepared_and_removes_those_of_dead_writers() {
        let dir = tempfile::tempdir().unwrap();
        let layers = LayerStore::open(dir.path()).unwrap();
        let long_ago = std::time::SystemTime::now() - process::UNIDENTIFIED_GRACE - std::time::Duration::from_secs(60);
        let age = |p: &Path| fs::File::open(p).unwrap().set_modified(long_ago).unwrap();
        // A layer this process is still filling, for longer than any grace period.
        let pending = layers.prepare().unwrap();
        fs::write(pending.path().join("f"), "x").unwrap();
        age(pending.path());
        // One whose builder was killed, and one whose builder's pid now
        // belongs to another process.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let killed = WriterId {
            pid: child.id() as i32,
            start_time: 1,
        };
        child.wait().unwrap();
        let me = WriterId::current();
        let reused = WriterId {
            start_time: me.start_time + 1,
            ..me
        };
        let dead = dir.path().join(format!(".tmp-00ff-{killed}"));
        let deleting = dir.path().join(format!(".tmp-rm-{}-{reused}", "ab".repeat(32)));
        for d in [&dead, &deleting] {
            fs::create_dir_all(d.join("sub")).unwrap();
        }
        // Names from before writers were named: only age tells.
        let unnamed_young = dir.path().join(format!(".tmp-00fe-{}", std::process::id()));
        let unnamed_old = dir.path().join(format!(".tmp-00fd-{}", std::process::id()));
        fs::create_dir(&unnamed_young).unwrap();
        fs::create_dir(&unnamed_old).unwrap();
        age(&unnamed_old);

        assert_eq!(layers.sweep_temporaries(), 3);
        assert!(pending.path().join("f").exists(), "a layer being prepared was swept");
        assert!(!dead.exists() && !deleting.exists());
        assert!(
            unnamed_young.exists(),
            "a young temporary of an older version was swept"
        );
        assert!(!unnamed_old.exists());
    }

    #[test]
    fn an_abandoned_layer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let layers = LayerStore::open(dir.path()).unwrap();
        drop(layers.prepare().unwrap());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}

pub mod archive;
