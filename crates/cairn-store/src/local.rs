//! [`LocalStore`]: objects as files in a directory.
//!
//! ```text
//! <root>/LAYOUT                      framed StoreLayout marker
//! <root>/objects/3f/2a/3f2a…(64 hex) one file per object
//! <root>/tmp/<pid>+<start>-<n>-<nanos>.partial   writes in progress
//! ```
//!
//! A write goes to `tmp/`, is fsynced, renamed into its fan-out directory
//! and the directory is fsynced, so a crash leaves either a complete
//! object or a temp file that GC removes once its writer (named in the
//! temp file's name, see [`crate::process`]) is dead.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::blob::{BlobError, BlobStore, IncompleteWrites, ObjectInfo, PutOutcome};
use crate::frame::{self, Framed};
use crate::hash::ChunkHash;
use crate::process::{self, WriterId};

const LAYOUT_FILE: &str = "LAYOUT";
const OBJECTS_DIR: &str = "objects";
const TMP_DIR: &str = "tmp";
const TMP_SUFFIX: &str = ".partial";

/// The layout marker at the root of a local store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StoreLayout {
    /// Number of two-hex-digit directory levels above each object.
    fanout_levels: u8,
}

impl Framed for StoreLayout {
    const MAGIC: [u8; 8] = *b"CAIRNSTO";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 4096;
    const NAME: &'static str = "chunk store layout marker";
}

/// A chunk store backend in a local directory.
#[derive(Debug)]
pub struct LocalStore {
    root: PathBuf,
    counter: AtomicU64,
}

impl LocalStore {
    /// Opens the store at `root`, creating it if the directory is absent
    /// or empty.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, BlobError> {
        let root = root.as_ref().to_path_buf();
        let store = Self {
            root: root.clone(),
            counter: AtomicU64::new(0),
        };
        let marker = root.join(LAYOUT_FILE);
        match fs::read(&marker) {
            Ok(bytes) => {
                let layout: StoreLayout = frame::decode(&bytes).map_err(|source| BlobError::Layout {
                    path: root.clone(),
                    source,
                })?;
                if layout.fanout_levels != 2 {
                    return Err(BlobError::NotAStore { path: root });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir_all(&root).map_err(|e| BlobError::io("create the store directory", &root, e))?;
                let empty = fs::read_dir(&root)
                    .map_err(|e| BlobError::io("list the store directory", &root, e))?
                    .next()
                    .is_none();
                if !empty {
                    // Another process opening the same new store may be
                    // writing its marker (its temporary file is already
                    // there): wait for the marker a moment before refusing.
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
                    while !marker.exists() && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                    if !marker.exists() {
                        return Err(BlobError::NotAStore { path: root });
                    }
                    return Self::open(&root);
                }
                let bytes = frame::encode(&StoreLayout { fanout_levels: 2 }).expect("layout marker is tiny");
                store.write_atomically(&bytes, &root, &marker)?;
            }
            Err(e) => return Err(BlobError::io("read the store layout marker", marker, e)),
        }
        for dir in [OBJECTS_DIR, TMP_DIR] {
            let p = root.join(dir);
            fs::create_dir_all(&p).map_err(|e| BlobError::io("create", &p, e))?;
        }
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the object for `key` lives: `objects/3f/2a/3f2a…`.
    pub fn object_path(&self, key: &ChunkHash) -> PathBuf {
        let hex = key.to_hex();
        self.root.join(OBJECTS_DIR).join(&hex[0..2]).join(&hex[2..4]).join(hex)
    }

    /// Directory holding writes in progress.
    pub fn temp_dir(&self) -> PathBuf {
        self.root.join(TMP_DIR)
    }

    fn temp_path(&self) -> PathBuf {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        // The writer in the name tells GC whether this write may still finish.
        self.temp_dir()
            .join(format!("{}-{n}-{nanos}{TMP_SUFFIX}", WriterId::current()))
    }

    /// Stores an object that can be fetched again (a cache fill): written
    /// and renamed into place like [`BlobStore::put`] but not fsynced, so
    /// after a power loss it may be absent or torn. A reader detects a torn
    /// one by its hash and drops it ([`crate::ChunkStore`] does).
    pub fn put_unsynced(&self, key: &ChunkHash, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        if self.contains(key)? {
            return Ok(PutOutcome::AlreadyPresent);
        }
        let path = self.object_path(key);
        let dir = self.ensure_parent(&path)?;
        self.write_atomically_with(bytes, &dir, &path, false)?;
        Ok(PutOutcome::Stored)
    }

    /// temp file, fsync, rename to `dest`, fsync `dest_dir`.
    fn write_atomically(&self, bytes: &[u8], dest_dir: &Path, dest: &Path) -> Result<(), BlobError> {
        self.write_atomically_with(bytes, dest_dir, dest, true)
    }

    /// temp file, rename to `dest`; fsyncs of both when `sync`.
    fn write_atomically_with(&self, bytes: &[u8], dest_dir: &Path, dest: &Path, sync: bool) -> Result<(), BlobError> {
        let tmp_dir = self.temp_dir();
        fs::create_dir_all(&tmp_dir).map_err(|e| BlobError::io("create", &tmp_dir, e))?;
        let tmp = self.temp_path();
        let result = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(|e| BlobError::io("create temp file", &tmp, e))?;
            f.write_all(bytes)
                .map_err(|e| BlobError::io("write temp file", &tmp, e))?;
            if sync {
                f.sync_all().map_err(|e| BlobError::io("fsync temp file", &tmp, e))?;
            }
            drop(f);
            fs::rename(&tmp, dest).map_err(|e| BlobError::io("rename temp file into", dest, e))?;
            if sync {
                sync_dir(dest_dir)?;
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Creates the fan-out directories for `path`, fsyncing each parent
    /// whose entry was created so the object is reachable after a crash.
    fn ensure_parent(&self, path: &Path) -> Result<PathBuf, BlobError> {
        self.make_parent(path, true)
    }

    /// [`ensure_parent`](Self::ensure_parent), fsyncing parents only when
    /// `sync` (a batch syncs the whole filesystem afterwards instead).
    fn make_parent(&self, path: &Path, sync: bool) -> Result<PathBuf, BlobError> {
        let leaf = path.parent().expect("object paths have parents").to_path_buf();
        let mid = leaf.parent().expect("two fan-out levels").to_path_buf();
        for (dir, parent) in [(&mid, self.root.join(OBJECTS_DIR)), (&leaf, mid.clone())] {
            match fs::create_dir(dir) {
                Ok(()) if sync => sync_dir(&parent)?,
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(BlobError::io("create fan-out directory", dir, e)),
            }
        }
        Ok(leaf)
    }
}

/// Runs `f` on every item from up to 16 threads at once (fsyncs: the
/// filesystem commits concurrent ones together); the first error wins.
fn in_parallel<T: Sync>(items: &[T], f: impl Fn(&T) -> Result<(), BlobError> + Sync) -> Result<(), BlobError> {
    const THREADS: usize = 16;
    let per = items.len().div_ceil(THREADS).max(1);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = items
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().try_for_each(f)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect::<Result<Vec<()>, _>>()
            .map(|_| ())
    })
}

fn sync_dir(dir: &Path) -> Result<(), BlobError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| BlobError::io("fsync directory", dir, e))
}

fn is_hex_name(name: &str, len: usize) -> bool {
    name.len() == len && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl BlobStore for LocalStore {
    fn put(&self, key: &ChunkHash, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        if self.refresh(key)? {
            return Ok(PutOutcome::AlreadyPresent);
        }
        let path = self.object_path(key);
        let dir = self.ensure_parent(&path)?;
        self.write_atomically(bytes, &dir, &path)?;
        Ok(PutOutcome::Stored)
    }

    /// Writes every new object to a temp file, makes them durable with
    /// fsyncs issued at once from several threads (the filesystem commits
    /// them together), renames them into place and syncs the directories
    /// that changed the same way. Nothing is renamed before its bytes are
    /// durable, so an object under its name is whole after a crash, as with
    /// [`put`](Self::put). Unlike one `syncfs`, this does not wait for
    /// everything else dirty on the filesystem (a memory image runsc has
    /// just written beside the store: ~0.45 s for 512 MB here).
    fn put_batch(&self, objects: &[(ChunkHash, &[u8])]) -> Result<Vec<PutOutcome>, BlobError> {
        if objects.len() <= 1 {
            return objects.iter().map(|(key, bytes)| self.put(key, bytes)).collect();
        }
        let mut outcomes = Vec::with_capacity(objects.len());
        let mut staged: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut seen = std::collections::HashSet::with_capacity(objects.len());
        let result = (|| {
            for (key, bytes) in objects {
                if !seen.insert(*key) || self.refresh(key)? {
                    outcomes.push(PutOutcome::AlreadyPresent);
                    continue;
                }
                let tmp = self.temp_path();
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&tmp)
                    .and_then(|mut f| f.write_all(bytes))
                    .map_err(|e| BlobError::io("write temp file", &tmp, e))?;
                staged.push((tmp, self.object_path(key)));
                outcomes.push(PutOutcome::Stored);
            }
            if staged.is_empty() {
                return Ok(());
            }
            // Opened again to be synced: a batch holds no descriptors.
            in_parallel(&staged, |(tmp, _)| {
                File::open(tmp)
                    .and_then(|f| f.sync_data())
                    .map_err(|e| BlobError::io("fsync temp file", tmp, e))
            })?;
            let mut dirs = std::collections::BTreeSet::new();
            for (tmp, dest) in &staged {
                let leaf = self.make_parent(dest, false)?;
                fs::rename(tmp, dest).map_err(|e| BlobError::io("rename temp file into", dest, e))?;
                // The leaf holds the new name; its parents, any fan-out
                // directory created just now.
                let mid = leaf.parent().expect("two fan-out levels").to_path_buf();
                dirs.insert(mid.parent().expect("under the store").to_path_buf());
                dirs.insert(mid);
                dirs.insert(leaf);
            }
            let dirs: Vec<PathBuf> = dirs.into_iter().collect();
            in_parallel(&dirs, |dir| sync_dir(dir))
        })();
        if result.is_err() {
            for (tmp, _) in &staged {
                let _ = fs::remove_file(tmp);
            }
        }
        result.map(|()| outcomes)
    }

    fn get(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        let path = self.object_path(key);
        fs::read(&path).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                BlobError::NotFound { key: *key }
            } else {
                BlobError::io("read object", &path, e)
            }
        })
    }

    fn contains(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        let path = self.object_path(key);
        match fs::symlink_metadata(&path) {
            Ok(m) => Ok(m.is_file()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(BlobError::io("stat object", &path, e)),
        }
    }

    fn refresh(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        use nix::sys::stat::{utimensat, UtimensatFlags};
        use nix::sys::time::TimeSpec;
        let path = self.object_path(key);
        // A new mtime puts this writer under GC's grace period. One system
        // call: a memory image looks up tens of thousands of chunks.
        match utimensat(
            None,
            &path,
            &TimeSpec::UTIME_OMIT,
            &TimeSpec::UTIME_NOW,
            UtimensatFlags::FollowSymlink,
        ) {
            Ok(()) => Ok(true),
            Err(nix::errno::Errno::ENOENT) => Ok(false),
            Err(e) => Err(BlobError::io("refresh the modification time of", &path, e.into())),
        }
    }

    fn delete(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        let path = self.object_path(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(BlobError::io("delete object", &path, e)),
        }
    }

    fn list(&self) -> Result<Vec<ObjectInfo>, BlobError> {
        let mut out = Vec::new();
        let objects = self.root.join(OBJECTS_DIR);
        for level1 in read_dir_sorted(&objects)? {
            if !is_hex_name(&level1.0, 2) {
                continue;
            }
            for level2 in read_dir_sorted(&level1.1)? {
                if !is_hex_name(&level2.0, 2) {
                    continue;
                }
                for (name, path) in read_dir_sorted(&level2.1)? {
                    // Only names that are exactly a hash in the right
                    // fan-out directory are objects.
                    if !is_hex_name(&name, 64) || name[0..2] != level1.0 || name[2..4] != level2.0 {
                        continue;
                    }
                    let meta = match fs::symlink_metadata(&path) {
                        Ok(m) if m.is_file() => m,
                        Ok(_) => continue,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(BlobError::io("stat object", &path, e)),
                    };
                    out.push(ObjectInfo {
                        key: name.parse().expect("checked to be 64 hex digits"),
                        size: meta.len(),
                        modified: meta.modified().map_err(|e| BlobError::io("read mtime of", &path, e))?,
                    });
                }
            }
        }
        Ok(out)
    }

    fn remove_incomplete_writes(&self) -> Result<IncompleteWrites, BlobError> {
        let mut report = IncompleteWrites::default();
        for (name, path) in read_dir_sorted(&self.temp_dir())? {
            let meta = match fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(BlobError::io("stat temp file", &path, e)),
            };
            let modified = meta.modified().map_err(|e| BlobError::io("read mtime of", &path, e))?;
            if !process::is_abandoned(&name, modified) {
                continue;
            }
            match fs::remove_file(&path) {
                Ok(()) => {
                    report.removed += 1;
                    report.bytes += meta.len();
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(BlobError::io("remove temp file", &path, e)),
            }
        }
        Ok(report)
    }
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<(String, PathBuf)>, BlobError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_live_in_a_two_level_hex_fanout() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path().join("s")).unwrap();
        let key = ChunkHash::of(b"x");
        assert_eq!(store.put(&key, b"payload").unwrap(), PutOutcome::Stored);
        let hex = key.to_hex();
        let expected = dir.path().join("s/objects").join(&hex[..2]).join(&hex[2..4]).join(&hex);
        assert_eq!(fs::read(expected).unwrap(), b"payload");
        assert_eq!(store.put(&key, b"payload").unwrap(), PutOutcome::AlreadyPresent);
        assert_eq!(store.list().unwrap().len(), 1);
        assert!(store.delete(&key).unwrap());
        assert!(!store.delete(&key).unwrap());
        assert!(matches!(store.get(&key), Err(BlobError::NotFound { .. })));
    }

    #[test]
    fn a_batch_stores_each_new_object_once_and_reports_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let (a, b) = (ChunkHash::of(b"a"), ChunkHash::of(b"b"));
        store.put(&a, b"A").unwrap();
        let outcomes = store.put_batch(&[(a, b"A"), (b, b"B"), (b, b"B")]).unwrap();
        assert_eq!(
            outcomes,
            [
                PutOutcome::AlreadyPresent,
                PutOutcome::Stored,
                PutOutcome::AlreadyPresent
            ]
        );
        assert_eq!(store.get(&b).unwrap(), b"B");
        assert_eq!(store.list().unwrap().len(), 2);
        assert_eq!(
            fs::read_dir(store.temp_dir()).unwrap().count(),
            0,
            "no temp file is left"
        );
    }

    #[test]
    fn a_temp_file_names_its_writer() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let name = store.temp_path().file_name().unwrap().to_str().unwrap().to_string();
        assert_eq!(WriterId::in_name(&name), Some(WriterId::current()), "{name}");
        assert!(name.ends_with(TMP_SUFFIX), "{name}");
    }

    #[test]
    fn reopening_keeps_objects_and_a_foreign_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let key = ChunkHash::of(b"x");
        LocalStore::open(dir.path()).unwrap().put(&key, b"1").unwrap();
        assert!(LocalStore::open(dir.path()).unwrap().contains(&key).unwrap());

        let foreign = tempfile::tempdir().unwrap();
        fs::write(foreign.path().join("notes.txt"), "mine").unwrap();
        let err = LocalStore::open(foreign.path()).unwrap_err();
        assert!(err.to_string().contains("is not a Cairn chunk store"), "{err}");
    }

    #[test]
    fn processes_opening_one_new_store_at_once_all_open_it() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("store");
            let barrier = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        barrier.wait();
                        LocalStore::open(&root).unwrap();
                    });
                }
            });
        }
    }

    #[test]
    fn a_store_from_a_future_layout_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        LocalStore::open(dir.path()).unwrap();
        let marker = dir.path().join(LAYOUT_FILE);
        let mut bytes = fs::read(&marker).unwrap();
        bytes[8..12].copy_from_slice(&9u32.to_le_bytes());
        fs::write(&marker, bytes).unwrap();
        let err = LocalStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("upgrade Cairn"), "{err}");
    }
}
