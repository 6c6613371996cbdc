//! [`LocalStore`]: objects as files in a directory.
//!
//! ```text
//! <root>/LAYOUT                      framed StoreLayout marker
//! <root>/objects/3f/2a/3f2a…(64 hex) one file per object
//! <root>/packs/<writer>-<n>-<nanos>.pack, .idx   many new objects at once
//! <root>/tmp/<pid>+<start>-<n>-<nanos>.partial   writes in progress
//! ```
//!
//! A write goes to `tmp/`, is fsynced, renamed into its fan-out directory
//! and the directory is fsynced, so a crash leaves either a complete
//! object or a temp file that GC removes once its writer (named in the
//! temp file's name, see [`crate::process`]) is dead. A batch with many
//! new objects is written as one pack instead ([`crate::pack`]).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::blob::{BlobError, BlobStore, IncompleteWrites, ObjectInfo, PutOutcome};
use crate::frame::{self, Framed};
use crate::hash::ChunkHash;
use crate::pack::{self, Located, PackEntry, PackIndex, Packs, INDEX_SUFFIX, MIN_PACKED, PACKS_DIR, PACK_SUFFIX};
use crate::process::{self, WriterId};

const LAYOUT_FILE: &str = "LAYOUT";
const OBJECTS_DIR: &str = "objects";
const TMP_DIR: &str = "tmp";
const TMP_SUFFIX: &str = ".partial";
/// The most objects one pack holds: its index stays well under
/// [`PackIndex`]'s frame cap.
const MAX_PACKED: usize = 16_384;

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
    packs: RwLock<Packs>,
}

impl LocalStore {
    /// Opens the store at `root`, creating it if the directory is absent
    /// or empty.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, BlobError> {
        let root = root.as_ref().to_path_buf();
        let store = Self {
            root: root.clone(),
            counter: AtomicU64::new(0),
            packs: RwLock::new(Packs::default()),
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
        for dir in [OBJECTS_DIR, PACKS_DIR, TMP_DIR] {
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
        self.temp_dir().join(format!("{}{TMP_SUFFIX}", self.write_name()))
    }

    /// A name no other write uses: `<writer>-<n>-<nanos>`. The writer in
    /// it tells GC whether the write may still finish.
    fn write_name(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!("{}-{n}-{nanos}", WriterId::current())
    }

    fn packs_dir(&self) -> PathBuf {
        self.root.join(PACKS_DIR)
    }

    fn pack_path(&self, name: &str) -> PathBuf {
        self.packs_dir().join(format!("{name}{PACK_SUFFIX}"))
    }

    fn index_path(&self, name: &str) -> PathBuf {
        self.packs_dir().join(format!("{name}{INDEX_SUFFIX}"))
    }

    fn packs_read(&self) -> RwLockReadGuard<'_, Packs> {
        self.packs.read().unwrap_or_else(|e| e.into_inner())
    }

    fn packs_write(&self) -> RwLockWriteGuard<'_, Packs> {
        self.packs.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Where `key` is packed, if it is: from the indexes loaded, else from
    /// `packs/` listed again when it changed since (or always, `force`:
    /// a pack read a moment ago was removed).
    fn locate(&self, key: &ChunkHash, force: bool) -> Result<Option<Located>, BlobError> {
        let dir = self.packs_dir();
        if !force {
            let packs = self.packs_read();
            if let Some(at) = packs.locate(key) {
                return Ok(Some(at));
            }
            if packs.is_current(&dir) {
                return Ok(None);
            }
        }
        let mut packs = self.packs_write();
        packs.reload(&dir, force)?;
        Ok(packs.locate(key))
    }

    /// Whether `key` is an object file of its own.
    fn loose_exists(&self, key: &ChunkHash) -> bool {
        fs::symlink_metadata(self.object_path(key)).is_ok_and(|m| m.is_file())
    }

    /// Writes `objects` (new, each once) as one pack: the pack and its
    /// index in `tmp/`, fsynced, renamed into `packs/` (the index last),
    /// `packs/` fsynced.
    fn write_pack(&self, objects: &[(ChunkHash, &[u8])]) -> Result<(), BlobError> {
        let name = self.write_name();
        let tmp_pack = self.temp_dir().join(format!("{name}{PACK_SUFFIX}{TMP_SUFFIX}"));
        let tmp_index = self.temp_dir().join(format!("{name}{INDEX_SUFFIX}{TMP_SUFFIX}"));
        let (pack, index_path) = (self.pack_path(&name), self.index_path(&name));
        let result = (|| {
            let mut entries = Vec::with_capacity(objects.len());
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp_pack)
                .map_err(|e| BlobError::io("create pack", &tmp_pack, e))?;
            let mut offset = 0u64;
            for (key, bytes) in objects {
                f.write_all(bytes)
                    .map_err(|e| BlobError::io("write pack", &tmp_pack, e))?;
                entries.push(PackEntry {
                    key: *key,
                    offset,
                    len: bytes.len() as u32,
                });
                offset += bytes.len() as u64;
            }
            f.sync_data().map_err(|e| BlobError::io("fsync pack", &tmp_pack, e))?;
            drop(f);
            let index = PackIndex {
                pack_len: offset,
                entries,
            };
            let encoded = frame::encode(&index).map_err(|source| BlobError::Layout {
                path: tmp_index.clone(),
                source,
            })?;
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp_index)
                .map_err(|e| BlobError::io("create pack index", &tmp_index, e))?;
            f.write_all(&encoded)
                .and_then(|()| f.sync_data())
                .map_err(|e| BlobError::io("write pack index", &tmp_index, e))?;
            drop(f);
            fs::rename(&tmp_pack, &pack).map_err(|e| BlobError::io("rename pack into", &pack, e))?;
            fs::rename(&tmp_index, &index_path).map_err(|e| BlobError::io("rename pack index into", &index_path, e))?;
            sync_dir(&self.packs_dir())?;
            self.packs_write().add(&name, &index);
            Ok(())
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp_pack);
            let _ = fs::remove_file(&tmp_index);
            if !index_path.exists() {
                let _ = fs::remove_file(&pack);
            }
        }
        result
    }

    /// Writes pack `name`'s objects, but `except`, as object files of their
    /// own (durable), then removes the pack: how packed objects go.
    fn unpack(&self, name: &str, except: &HashSet<ChunkHash>) -> Result<(), BlobError> {
        let (pack, index_path) = (self.pack_path(name), self.index_path(name));
        let index = match pack::read_index(&index_path, &pack)? {
            Some(index) => index,
            None => {
                self.packs_write().forget(name);
                return Ok(());
            }
        };
        let bytes = match fs::read(&pack) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.packs_write().forget(name);
                return Ok(());
            }
            Err(e) => return Err(BlobError::io("read pack", &pack, e)),
        };
        let keep: Vec<(ChunkHash, &[u8])> = index
            .entries
            .iter()
            .filter(|e| !except.contains(&e.key) && !self.loose_exists(&e.key))
            .map(|e| (e.key, &bytes[e.offset as usize..(e.offset + e.len as u64) as usize]))
            .collect();
        self.write_loose(&keep)?;
        match fs::remove_file(&index_path) {
            Ok(()) => sync_dir(&self.packs_dir())?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(BlobError::io("remove pack index", &index_path, e)),
        }
        match fs::remove_file(&pack) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(BlobError::io("remove pack", &pack, e)),
        }
        self.packs_write().forget(name);
        Ok(())
    }

    /// Writes every object of `objects` (new, each once) to a temp file,
    /// makes them durable with fsyncs issued at once from several threads
    /// (the filesystem commits them together), renames them into place and
    /// syncs the directories that changed the same way. Nothing is renamed
    /// before its bytes are durable, so an object under its name is whole
    /// after a crash, as with [`BlobStore::put`].
    fn write_loose(&self, objects: &[(ChunkHash, &[u8])]) -> Result<(), BlobError> {
        let mut staged: Vec<(PathBuf, PathBuf)> = Vec::new();
        let result = (|| {
            for (key, bytes) in objects {
                let tmp = self.temp_path();
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&tmp)
                    .and_then(|mut f| f.write_all(bytes))
                    .map_err(|e| BlobError::io("write temp file", &tmp, e))?;
                staged.push((tmp, self.object_path(key)));
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
        result
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

    /// Writes the new objects as one pack when there are many
    /// ([`MIN_PACKED`]): one file, one fsync; else each to a file of its own,
    /// made durable by fsyncs issued together from several threads. Either
    /// way nothing is visible before its bytes are durable. Unlike one
    /// `syncfs`, neither waits for everything else dirty on the filesystem
    /// (a memory image runsc has just written beside the store).
    fn put_batch(&self, objects: &[(ChunkHash, &[u8])]) -> Result<Vec<PutOutcome>, BlobError> {
        if objects.len() <= 1 {
            return objects.iter().map(|(key, bytes)| self.put(key, bytes)).collect();
        }
        let mut outcomes = Vec::with_capacity(objects.len());
        let mut new: Vec<(ChunkHash, &[u8])> = Vec::new();
        let mut seen = HashSet::with_capacity(objects.len());
        for (key, bytes) in objects {
            if !seen.insert(*key) || self.refresh(key)? {
                outcomes.push(PutOutcome::AlreadyPresent);
                continue;
            }
            new.push((*key, bytes));
            outcomes.push(PutOutcome::Stored);
        }
        if new.len() >= MIN_PACKED && new.len() <= MAX_PACKED {
            self.write_pack(&new)?;
        } else {
            self.write_loose(&new)?;
        }
        Ok(outcomes)
    }

    fn get(&self, key: &ChunkHash) -> Result<Vec<u8>, BlobError> {
        let path = self.object_path(key);
        let loose = || match fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BlobError::io("read object", &path, e)),
        };
        if let Some(bytes) = loose()? {
            return Ok(bytes);
        }
        // A pack read while another process unpacks it is gone: its
        // objects are files of their own by then. A miss lists `packs/`
        // again even if its mtime did not change: two changes within one
        // tick of the kernel's clock leave the same mtime.
        for force in [false, true] {
            let Some(at) = self.locate(key, force)? else { continue };
            let pack = self.pack_path(&at.pack);
            match pack::read_packed(&pack, &at) {
                Ok(bytes) => return Ok(bytes),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if let Some(bytes) = loose()? {
                        return Ok(bytes);
                    }
                }
                Err(e) => return Err(BlobError::io("read packed object", &pack, e)),
            }
        }
        Err(BlobError::NotFound { key: *key })
    }

    fn contains(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        let path = self.object_path(key);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => Ok(true),
            Ok(_) => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(self.locate(key, false)?.is_some()),
            Err(e) => Err(BlobError::io("stat object", &path, e)),
        }
    }

    fn refresh(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        use nix::sys::stat::{utimensat, UtimensatFlags};
        use nix::sys::time::TimeSpec;
        let path = self.object_path(key);
        // A new mtime puts this writer under GC's grace period. One system
        // call: a memory image looks up tens of thousands of chunks.
        let touch = |path: &Path| match utimensat(
            None,
            path,
            &TimeSpec::UTIME_OMIT,
            &TimeSpec::UTIME_NOW,
            UtimensatFlags::FollowSymlink,
        ) {
            Ok(()) => Ok(true),
            Err(nix::errno::Errno::ENOENT) => Ok(false),
            Err(e) => Err(BlobError::io("refresh the modification time of", path, e.into())),
        };
        // A packed object is refreshed with its pack, which GC removes
        // only when all of it is old. Packs known already are looked in
        // first: no system call to learn an object is not a file.
        let known = self.packs_read().locate(key);
        if let Some(at) = &known {
            if touch(&self.pack_path(&at.pack))? {
                return Ok(true);
            }
        }
        if touch(&path)? {
            return Ok(true);
        }
        // Not a file, not in a known pack: in one written since, if
        // `packs/` changed (listed again in any case if a known pack went).
        match self.locate(key, known.is_some())? {
            Some(at) => Ok(touch(&self.pack_path(&at.pack))? || touch(&path)?),
            None => Ok(false),
        }
    }

    /// A packed object goes with its pack: the pack's other objects are
    /// written as files of their own first.
    fn delete(&self, key: &ChunkHash) -> Result<bool, BlobError> {
        Ok(self.delete_many(std::slice::from_ref(key))?[0])
    }

    /// Loose objects one by one; packed ones pack by pack, each pack's
    /// survivors written as files of their own once (none when all go).
    fn delete_many(&self, keys: &[ChunkHash]) -> Result<Vec<bool>, BlobError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut packs: HashMap<std::sync::Arc<str>, HashSet<ChunkHash>> = HashMap::new();
        for key in keys {
            let path = self.object_path(key);
            let loose = match fs::remove_file(&path) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                Err(e) => return Err(BlobError::io("delete object", &path, e)),
            };
            match self.locate(key, false)? {
                Some(at) => {
                    packs.entry(at.pack).or_default().insert(*key);
                    out.push(true);
                }
                None => out.push(loose),
            }
        }
        for (pack, doomed) in packs {
            self.unpack(&pack, &doomed)?;
        }
        Ok(out)
    }

    fn list(&self) -> Result<Vec<ObjectInfo>, BlobError> {
        let mut out = Vec::new();
        let objects = self.root.join(OBJECTS_DIR);
        for level1 in pack::read_dir(&objects)? {
            if !is_hex_name(&level1.0, 2) {
                continue;
            }
            for level2 in pack::read_dir(&level1.1)? {
                if !is_hex_name(&level2.0, 2) {
                    continue;
                }
                for (name, path) in pack::read_dir(&level2.1)? {
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
        // Packed objects, but those also written as files of their own
        // (a pack being unpacked); each is as old as its pack.
        let loose: HashSet<ChunkHash> = out.iter().map(|o| o.key).collect();
        let mut packs = self.packs_write();
        packs.reload(&self.packs_dir(), true)?;
        let mut modified = HashMap::new();
        for (key, at) in packs.all() {
            if loose.contains(key) {
                continue;
            }
            let m = match modified.get(&at.pack) {
                Some(m) => *m,
                None => {
                    let path = self.pack_path(&at.pack);
                    let m = match fs::metadata(&path) {
                        Ok(meta) => Some(meta.modified().map_err(|e| BlobError::io("read mtime of", &path, e))?),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                        Err(e) => return Err(BlobError::io("stat pack", &path, e)),
                    };
                    modified.insert(at.pack.clone(), m);
                    m
                }
            };
            if let Some(modified) = m {
                out.push(ObjectInfo {
                    key: *key,
                    size: at.len as u64,
                    modified,
                });
            }
        }
        Ok(out)
    }

    fn remove_incomplete_writes(&self) -> Result<IncompleteWrites, BlobError> {
        let mut report = IncompleteWrites::default();
        for (name, path) in pack::read_dir(&self.temp_dir())? {
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
        // A pack without its index is one whose writer died between the
        // two renames; an index without its pack names nothing.
        let listing = pack::read_dir(&self.packs_dir())?;
        let names: HashSet<&str> = listing.iter().map(|(n, _)| n.as_str()).collect();
        let has = |name: &str| names.contains(name);
        for (name, path) in &listing {
            let orphan = if let Some(stem) = name.strip_suffix(PACK_SUFFIX) {
                !has(&format!("{stem}{INDEX_SUFFIX}"))
                    && fs::symlink_metadata(path)
                        .and_then(|m| m.modified())
                        .is_ok_and(|modified| process::is_abandoned(name, modified))
            } else if let Some(stem) = name.strip_suffix(INDEX_SUFFIX) {
                !has(&format!("{stem}{PACK_SUFFIX}"))
            } else {
                false
            };
            if !orphan {
                continue;
            }
            let len = fs::symlink_metadata(path).map(|m| m.len()).unwrap_or(0);
            match fs::remove_file(path) {
                Ok(()) => {
                    report.removed += 1;
                    report.bytes += len;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(BlobError::io("remove an interrupted pack", path, e)),
            }
        }
        Ok(report)
    }
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

    /// `n` distinct objects and the batch that puts them.
    fn objects(n: usize, tag: &str) -> Vec<(ChunkHash, Vec<u8>)> {
        (0..n)
            .map(|i| {
                let data = format!("{tag} object {i} ").repeat(10 + i).into_bytes();
                (ChunkHash::of(&data), data)
            })
            .collect()
    }

    fn batch(objects: &[(ChunkHash, Vec<u8>)]) -> Vec<(ChunkHash, &[u8])> {
        objects.iter().map(|(k, d)| (*k, d.as_slice())).collect()
    }

    fn names(dir: &Path) -> Vec<String> {
        pack::read_dir(dir).unwrap().into_iter().map(|(n, _)| n).collect()
    }

    fn loose_files(root: &Path) -> usize {
        walk(&root.join(OBJECTS_DIR))
    }

    fn walk(dir: &Path) -> usize {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| if p.is_dir() { walk(&p) } else { 1 })
            .sum()
    }

    #[test]
    fn a_batch_of_many_new_objects_is_one_pack_that_every_store_on_the_directory_reads() {
        let dir = tempfile::tempdir().unwrap();
        let a = LocalStore::open(dir.path()).unwrap();
        // Opened before the pack exists, like another process.
        let b = LocalStore::open(dir.path()).unwrap();
        assert!(!b.contains(&ChunkHash::of(b"nothing")).unwrap());
        let objs = objects(40, "packed");
        let outcomes = a.put_batch(&batch(&objs)).unwrap();
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
        assert_eq!(loose_files(dir.path()), 0, "no object file of its own");
        let packs = names(&dir.path().join(PACKS_DIR));
        assert_eq!(packs.len(), 2, "one pack and its index: {packs:?}");
        assert!(packs.iter().any(|n| n.ends_with(PACK_SUFFIX)) && packs.iter().any(|n| n.ends_with(INDEX_SUFFIX)));
        assert_eq!(names(&a.temp_dir()), Vec::<String>::new(), "no temp file is left");
        for store in [&a, &b, &LocalStore::open(dir.path()).unwrap()] {
            for (key, data) in &objs {
                assert_eq!(&store.get(key).unwrap(), data);
                assert!(store.contains(key).unwrap());
                assert!(store.refresh(key).unwrap());
            }
            assert_eq!(store.list().unwrap().len(), 40);
        }
        let again = b.put_batch(&batch(&objs)).unwrap();
        assert!(again.iter().all(|o| *o == PutOutcome::AlreadyPresent));
        // A small batch is written as files of their own.
        let few = objects(3, "loose");
        a.put_batch(&batch(&few)).unwrap();
        assert_eq!(loose_files(dir.path()), 3);
        assert_eq!(names(&dir.path().join(PACKS_DIR)).len(), 2);
    }

    #[test]
    fn removing_packed_objects_keeps_the_others_and_frees_the_pack() {
        let dir = tempfile::tempdir().unwrap();
        let a = LocalStore::open(dir.path()).unwrap();
        let b = LocalStore::open(dir.path()).unwrap();
        let objs = objects(40, "gc");
        a.put_batch(&batch(&objs)).unwrap();
        // b has read the index before a removes the pack.
        assert_eq!(b.get(&objs[0].0).unwrap(), objs[0].1);
        let live: Vec<ChunkHash> = objs[..30].iter().map(|(k, _)| *k).collect();
        let report = crate::collect_garbage(&a, live, std::time::Duration::ZERO).unwrap();
        assert_eq!((report.examined, report.kept_live, report.deleted), (40, 30, 10));
        assert_eq!(
            names(&dir.path().join(PACKS_DIR)),
            Vec::<String>::new(),
            "the pack is gone"
        );
        assert_eq!(loose_files(dir.path()), 30);
        for store in [&a, &b] {
            for (key, data) in &objs[..30] {
                assert_eq!(&store.get(key).unwrap(), data);
            }
            for (key, _) in &objs[30..] {
                assert!(matches!(store.get(key), Err(BlobError::NotFound { .. })));
                assert!(!store.contains(key).unwrap());
            }
            assert_eq!(store.list().unwrap().len(), 30);
        }
        // A pack whose objects all go is removed without writing any of them.
        let more = objects(20, "all gone");
        b.put_batch(&batch(&more)).unwrap();
        let live: Vec<ChunkHash> = objs[..30].iter().map(|(k, _)| *k).collect();
        let report = crate::collect_garbage(&a, live, std::time::Duration::ZERO).unwrap();
        assert_eq!(report.deleted, 20);
        assert_eq!(loose_files(dir.path()), 30);
        assert_eq!(names(&dir.path().join(PACKS_DIR)), Vec::<String>::new());
    }

    #[test]
    fn an_interrupted_or_damaged_pack_is_never_read_and_an_orphan_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let packs = dir.path().join(PACKS_DIR);
        let a = LocalStore::open(dir.path()).unwrap();
        let objs = objects(20, "cut");
        a.put_batch(&batch(&objs)).unwrap();
        let pack = packs.join(names(&packs).into_iter().find(|n| n.ends_with(PACK_SUFFIX)).unwrap());

        // A pack shorter than its index says is not used.
        let whole = fs::read(&pack).unwrap();
        fs::write(&pack, &whole[..whole.len() - 1]).unwrap();
        let fresh = LocalStore::open(dir.path()).unwrap();
        assert!(!fresh.contains(&objs[0].0).unwrap());
        assert!(fresh.list().unwrap().is_empty());
        fs::write(&pack, &whole).unwrap();

        // The writer died between renaming the pack and its index.
        for name in names(&packs) {
            if name.ends_with(INDEX_SUFFIX) {
                fs::remove_file(packs.join(name)).unwrap();
            }
        }
        let dead = packs.join(format!("1+1-0-0{PACK_SUFFIX}"));
        fs::rename(&pack, &dead).unwrap();
        let fresh = LocalStore::open(dir.path()).unwrap();
        assert!(matches!(fresh.get(&objs[0].0), Err(BlobError::NotFound { .. })));
        assert!(fresh.list().unwrap().is_empty());
        let removed = fresh.remove_incomplete_writes().unwrap();
        assert_eq!(removed.removed, 1);
        assert_eq!(names(&packs), Vec::<String>::new());
    }

    #[test]
    fn an_object_in_two_packs_stays_readable_until_both_go() {
        let dir = tempfile::tempdir().unwrap();
        let packs = dir.path().join(PACKS_DIR);
        let a = LocalStore::open(dir.path()).unwrap();
        let objs = objects(20, "twice");
        a.put_batch(&batch(&objs)).unwrap();
        // Two writers packed the same new objects at once.
        for name in names(&packs) {
            fs::copy(
                packs.join(&name),
                packs.join(format!("1+1-9-9{}", &name[name.find('.').unwrap()..])),
            )
            .unwrap();
        }
        let b = LocalStore::open(dir.path()).unwrap();
        assert_eq!(b.list().unwrap().len(), 20);
        let keys: Vec<ChunkHash> = objs.iter().map(|(k, _)| *k).collect();
        assert!(b.delete_many(&keys[..5]).unwrap().iter().all(|d| *d));
        // The other pack still holds them, and they are found there.
        for (key, data) in &objs {
            assert_eq!(&b.get(key).unwrap(), data);
        }
        assert_eq!(b.list().unwrap().len(), 20);
        for _ in 0..3 {
            crate::collect_garbage(&b, [], std::time::Duration::ZERO).unwrap();
        }
        assert!(b.list().unwrap().is_empty());
        assert_eq!(names(&packs), Vec::<String>::new());
    }

    #[test]
    fn a_corrupt_packed_chunk_is_written_again_and_its_pack_mates_stay() {
        use crate::{ChunkStore, ReadContext};
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        let datas: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 10_000 + i as usize]).collect();
        let packed: Vec<(ChunkHash, Vec<u8>)> = datas
            .iter()
            .map(|d| (ChunkHash::of(d), crate::chunk::compress_chunk(d).unwrap()))
            .collect();
        store.backend().put_batch(&batch(&packed)).unwrap();
        assert_eq!(loose_files(dir.path()), 0);
        // Damage the first object inside the pack.
        let packs = dir.path().join(PACKS_DIR);
        let pack = packs.join(names(&packs).into_iter().find(|n| n.ends_with(PACK_SUFFIX)).unwrap());
        let mut bytes = fs::read(&pack).unwrap();
        bytes[packed[0].1.len() / 2] ^= 0x55;
        fs::write(&pack, bytes).unwrap();
        assert!(store.get_chunk(&packed[0].0, &ReadContext::new()).is_err());
        assert!(store.put_chunk(&datas[0]).unwrap().new, "the corrupt copy was trusted");
        for (data, (hash, _)) in datas.iter().zip(&packed) {
            assert_eq!(&store.get_chunk(hash, &ReadContext::new()).unwrap(), data);
        }
        assert_eq!(names(&packs), Vec::<String>::new(), "the pack was replaced by files");
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
