//! Rebuilding a layer directory from its index.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use cairn_store::process::{self, WriterId};
use cairn_store::{BlobStore, ChunkStore, ReadAhead, ReadContext};
use nix::fcntl::{renameat2, AtFlags, RenameFlags};
use nix::sys::stat::{
    fchmod, fchmodat, futimens, makedev, mkdirat, mknodat, utimensat, FchmodatFlags, Mode, SFlag, UtimensatFlags,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchown, fchownat, linkat, symlinkat, syncfs, Gid, Uid};

use super::dirfd::{self, create_file_at, open_dir, open_dir_at};
use super::index::{Entry, EntryKind, LayerId, LayerPath, Metadata, Timestamp};
use super::stored::for_each_run;
use super::ArchiveError;

/// Rebuilds layer `layer` from `store` as the new directory `dest`, exactly
/// as captured: whiteouts, opaque and redirect xattrs, ownership, modes,
/// hard links, holes and mtimes; device nodes an index holds are left out
/// (with a warning). The tree is built in a temp directory
/// beside `dest`, flushed, and renamed into place; on failure the temp
/// directory is removed and `dest` is untouched.
pub fn materialise<B: BlobStore>(layer: &LayerId, store: &ChunkStore<B>, dest: &Path) -> Result<u64, ArchiveError> {
    if fs::symlink_metadata(dest).is_ok() {
        return Err(ArchiveError::DestinationExists {
            path: dest.to_path_buf(),
        });
    }

    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dest.file_name().ok_or_else(|| ArchiveError::Materialise {
        path: dest.to_path_buf(),
        action: "naming the destination",
        source: io::Error::new(io::ErrorKind::InvalidInput, "the path has no final component"),
    })?;
    let temp = temp_beside(&parent, name);

    let fail = |action, source| ArchiveError::Materialise {
        path: dest.to_path_buf(),
        action,
        source,
    };
    fs::create_dir(&temp).map_err(|e| fail("creating the temp directory", e))?;
    let mut entries = 0;
    let built = build(layer, store, &temp, dest, &mut entries)
        .and_then(|root| flush(&root, &temp, entries).map_err(|e| fail("flushing the layer to disk", e)));
    let placed = built.and_then(|()| {
        renameat2(None, &temp, None, dest, RenameFlags::RENAME_NOREPLACE)
            .map_err(|e| fail("renaming the finished layer into place", e.into()))?;
        File::open(&parent)
            .and_then(|d| d.sync_all())
            .map_err(|e| fail("flushing the destination's parent directory", e))
    });
    if let Err(e) = placed {
        // Best effort: the temp name is ours alone, and leaving it would
        // only waste space.
        let _ = fs::remove_dir_all(&temp);
        return Err(e);
    }
    Ok(entries)
}

/// The most entries a layer has to be flushed file by file rather than
/// with one `syncfs`.
const FILE_BY_FILE: u64 = 2048;

/// Makes the tree built in `temp` durable before it is renamed into place:
/// a small one file by file (every regular file and every directory,
/// fsynced from several threads at once, which the filesystem commits
/// together), a large one with one `syncfs`. `syncfs` also waits for
/// everything else dirty on the filesystem (a memory image runsc has just
/// written beside the store: 0.35 s for 512 MiB), which the few files of a
/// snapshot's new layer should not.
/// A tree the walk cannot take by path (deeper than `PATH_MAX`) is flushed
/// with `syncfs` too.
fn flush(root: &File, temp: &Path, entries: u64) -> io::Result<()> {
    if entries <= FILE_BY_FILE && flush_file_by_file(temp).is_ok() {
        return Ok(());
    }
    syncfs(root.as_raw_fd()).map_err(io::Error::from)
}

fn flush_file_by_file(temp: &Path) -> io::Result<()> {
    let mut paths = Vec::new();
    let mut dirs = vec![temp.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() {
                paths.push(entry.path());
            }
        }
        paths.push(dir);
    }
    const THREADS: usize = 16;
    let per = paths.len().div_ceil(THREADS).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = paths
            .chunks(per)
            .map(|part| s.spawn(move || part.iter().try_for_each(|p| File::open(p)?.sync_all())))
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
    })
}

const TEMP_MARKER: &str = ".materialising-";

/// The temp directory a materialisation of `name` in `parent` fills:
/// `.<name>.materialising-<writer>-<nanos>`, which
/// [`remove_abandoned_materialisations`] sweeps once its writer is dead.
pub(super) fn temp_beside(parent: &Path, name: &OsStr) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut temp_name = b".".to_vec();
    temp_name.extend_from_slice(name.as_bytes());
    temp_name.extend_from_slice(format!("{TEMP_MARKER}{}-{nanos}", WriterId::current()).as_bytes());
    parent.join(OsStr::from_bytes(&temp_name))
}

/// Removes temp directories that a materialisation into `parent` left when
/// its process died (`.<name>.materialising-<writer>-<nanos>` whose writer,
/// pid and start time, no longer runs; see [`cairn_store::process`]).
/// Returns how many were removed.
pub fn remove_abandoned_materialisations(parent: &Path) -> Result<u64, ArchiveError> {
    let fail = |action, source| ArchiveError::Materialise {
        path: parent.to_path_buf(),
        action,
        source,
    };
    let mut removed = 0;
    for entry in fs::read_dir(parent).map_err(|e| fail("listing the layer directory", e))? {
        let entry = entry.map_err(|e| fail("listing the layer directory", e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with('.') || !name.contains(TEMP_MARKER) {
            continue;
        }
        let modified = match entry.metadata().and_then(|m| m.modified()) {
            Ok(m) => m,
            // Another sweeper got there first.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(fail("reading a temp directory's age", e)),
        };
        if !process::is_abandoned(&name, modified) {
            continue;
        }
        match fs::remove_dir_all(entry.path()) {
            Ok(()) => removed += 1,
            // Another sweeper got there first.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail("removing an abandoned materialisation", e)),
        }
    }
    Ok(removed)
}

/// A directory being filled; its mode and mtime are applied when it is
/// closed, after all its children exist.
struct OpenDir {
    path: LayerPath,
    dir: File,
    meta: Metadata,
}

struct Builder<'a, B> {
    store: &'a ChunkStore<B>,
    layer: &'a LayerId,
    dest: &'a Path,
    stack: Vec<OpenDir>,
    /// Device nodes left out, and hard links to them.
    skipped: HashSet<LayerPath>,
    /// Fetches the chunks of the files of the run being written, in the
    /// order they are written, ahead of the writing (from a far store: many
    /// at once).
    ahead: ReadAhead,
}

fn timespec(t: Timestamp) -> TimeSpec {
    TimeSpec::new(t.sec, i64::from(t.nsec))
}

fn ids(meta: &Metadata) -> (Option<Uid>, Option<Gid>) {
    (Some(Uid::from_raw(meta.uid)), Some(Gid::from_raw(meta.gid)))
}

/// Writes the layer's entries into `temp`, a run of the index at a time
/// (each checked as it is read); returns the root directory's handle and
/// counts the entries into `count`.
fn build<B: BlobStore>(
    layer: &LayerId,
    store: &ChunkStore<B>,
    temp: &Path,
    dest: &Path,
    count: &mut u64,
) -> Result<File, ArchiveError> {
    let mut b = Builder {
        store,
        layer,
        dest,
        stack: Vec::new(),
        skipped: HashSet::new(),
        ahead: ReadAhead::none(),
    };
    let mut root_handle = None;
    for_each_run(store, layer, |run| {
        let chunks = run.iter().flat_map(|e| e.kind.chunks()).map(|c| c.hash).collect();
        b.ahead = store.backend().read_ahead(chunks);
        let mut entries = run.into_iter();
        if root_handle.is_none() {
            let root_entry = entries.next().expect("checked: a root directory comes first");
            let root = open_dir(temp).map_err(|e| b.err(&root_entry.path, "opening the temp directory", e))?;
            b.own_and_label(&root, &root_entry)?;
            root_handle = Some(
                root.try_clone()
                    .map_err(|e| b.err(&root_entry.path, "duplicating a handle", e))?,
            );
            b.stack.push(OpenDir {
                path: LayerPath::root(),
                dir: root,
                meta: root_entry.meta,
            });
            *count += 1;
        }
        for entry in entries {
            *count += 1;
            b.entry(entry)?;
        }
        Ok(())
    })?;
    while !b.stack.is_empty() {
        b.close_top()?;
    }
    if !b.skipped.is_empty() {
        tracing::warn!(
            layer = %layer,
            "left out {} device node(s) the layer's index holds; layers never give a sandbox a device",
            b.skipped.len()
        );
    }
    root_handle.ok_or_else(|| ArchiveError::InvalidIndex {
        layer: *layer,
        reason: "it has no root entry".into(),
    })
}

impl<B: BlobStore> Builder<'_, B> {
    fn entry(&mut self, entry: Entry) -> Result<(), ArchiveError> {
        let (parent, name) = entry
            .path
            .split_last()
            .expect("checked: only the first entry is the root");
        while self.stack.last().is_some_and(|d| d.path.as_bytes() != parent) {
            self.close_top()?;
        }
        if self.stack.is_empty() {
            return Err(ArchiveError::InvalidIndex {
                layer: *self.layer,
                reason: format!("{:?} is not in depth-first order after its parent", entry.path),
            });
        }
        // A device node in an index (written by an older Cairn, or not by
        // Cairn at all) would give the sandbox a host device.
        let device = match &entry.kind {
            EntryKind::CharDevice { .. } => !entry.kind.is_whiteout(),
            EntryKind::BlockDevice { .. } => true,
            EntryKind::HardLink { target } => self.skipped.contains(target),
            _ => false,
        };
        if device {
            self.skipped.insert(entry.path);
            return Ok(());
        }
        let name = name.to_vec();
        self.create(&entry, &name)
    }

    fn err(&self, path: &LayerPath, action: &'static str, source: io::Error) -> ArchiveError {
        let mut p = self.dest.as_os_str().as_bytes().to_vec();
        p.extend_from_slice(path.display_path().as_os_str().as_bytes());
        ArchiveError::Materialise {
            path: PathBuf::from(OsStr::from_bytes(&p)),
            action,
            source,
        }
    }

    /// Ownership, then xattrs: chown would clear security.capability.
    fn own_and_label(&self, file: &File, entry: &Entry) -> Result<(), ArchiveError> {
        let (uid, gid) = ids(&entry.meta);
        fchown(file.as_raw_fd(), uid, gid).map_err(|e| self.err(&entry.path, "chown", e.into()))?;
        dirfd::write_xattrs_fd(file, &entry.meta.xattrs).map_err(|e| self.err(&entry.path, "setting xattrs", e))
    }

    fn close_top(&mut self) -> Result<(), ArchiveError> {
        let top = self.stack.pop().expect("caller checked");
        fchmod(top.dir.as_raw_fd(), Mode::from_bits_truncate(top.meta.mode))
            .map_err(|e| self.err(&top.path, "chmod", e.into()))?;
        let t = timespec(top.meta.mtime);
        futimens(top.dir.as_raw_fd(), &t, &t).map_err(|e| self.err(&top.path, "setting the mtime", e.into()))
    }

    /// Opens the directory holding `target` by walking from the root, for
    /// hard links whose target lives elsewhere in the tree.
    fn parent_of(&self, target: &LayerPath) -> Result<File, ArchiveError> {
        let (parent, _) = target.split_last().expect("validated: targets are not the root");
        let walk = || -> io::Result<File> {
            let mut dir = self.stack[0].dir.try_clone()?;
            for c in parent.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
                dir = open_dir_at(&dir, c)?;
            }
            Ok(dir)
        };
        walk().map_err(|e| self.err(target, "opening the hard link target's directory", e))
    }

    fn create(&mut self, entry: &Entry, name: &[u8]) -> Result<(), ArchiveError> {
        let dir = &self.stack.last().expect("caller checked").dir;
        let meta = &entry.meta;
        let mtime = timespec(meta.mtime);
        let path = &entry.path;
        let node = |kind: SFlag, major: u32, minor: u32| {
            mknodat(
                Some(dir.as_raw_fd()),
                name,
                kind,
                Mode::from_bits_truncate(0o600),
                makedev(u64::from(major), u64::from(minor)),
            )
        };
        match &entry.kind {
            EntryKind::Directory => {
                mkdirat(Some(dir.as_raw_fd()), name, Mode::from_bits_truncate(0o700))
                    .map_err(|e| self.err(path, "mkdir", e.into()))?;
                let sub = open_dir_at(dir, name).map_err(|e| self.err(path, "opening the new directory", e))?;
                self.own_and_label(&sub, entry)?;
                self.stack.push(OpenDir {
                    path: path.clone(),
                    dir: sub,
                    meta: meta.clone(),
                });
                return Ok(());
            }
            EntryKind::File(_) | EntryKind::SmallFile { .. } => {
                let file = create_file_at(dir, name).map_err(|e| self.err(path, "creating the file", e))?;
                match &entry.kind {
                    EntryKind::File(content) => {
                        let context = ReadContext::new()
                            .owner("layer", *self.layer.as_hash())
                            .path(path.display_path());
                        self.store
                            .restore_to_file_read_ahead(content, &file, &context, &self.ahead)?;
                    }
                    EntryKind::SmallFile { data } => {
                        use std::io::Write;
                        (&file)
                            .write_all(data)
                            .map_err(|e| self.err(path, "writing the file", e))?;
                    }
                    _ => unreachable!("matched above"),
                }
                self.own_and_label(&file, entry)?;
                fchmod(file.as_raw_fd(), Mode::from_bits_truncate(meta.mode))
                    .map_err(|e| self.err(path, "chmod", e.into()))?;
                futimens(file.as_raw_fd(), &mtime, &mtime)
                    .map_err(|e| self.err(path, "setting the mtime", e.into()))?;
                return Ok(());
            }
            EntryKind::HardLink { target } => {
                let (_, target_name) = target.split_last().expect("validated");
                let target_dir = self.parent_of(target)?;
                let dir = &self.stack.last().expect("caller checked").dir;
                linkat(
                    Some(target_dir.as_raw_fd()),
                    target_name,
                    Some(dir.as_raw_fd()),
                    name,
                    AtFlags::empty(),
                )
                .map_err(|e| self.err(path, "creating the hard link", e.into()))?;
                return Ok(());
            }
            EntryKind::Symlink { target } => {
                symlinkat(OsStr::from_bytes(target), Some(dir.as_raw_fd()), name)
                    .map_err(|e| self.err(path, "creating the symlink", e.into()))?;
            }
            EntryKind::Fifo => node(SFlag::S_IFIFO, 0, 0).map_err(|e| self.err(path, "mkfifo", e.into()))?,
            EntryKind::Socket => node(SFlag::S_IFSOCK, 0, 0).map_err(|e| self.err(path, "mknod", e.into()))?,
            EntryKind::CharDevice { major, minor } => {
                node(SFlag::S_IFCHR, *major, *minor).map_err(|e| self.err(path, "mknod", e.into()))?
            }
            EntryKind::BlockDevice { major, minor } => {
                node(SFlag::S_IFBLK, *major, *minor).map_err(|e| self.err(path, "mknod", e.into()))?
            }
        }
        // Symlinks and special files: by name, never following.
        let (uid, gid) = ids(meta);
        fchownat(Some(dir.as_raw_fd()), name, uid, gid, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| self.err(path, "chown", e.into()))?;
        dirfd::write_xattrs_at(&dirfd::proc_path(dir, name), &meta.xattrs)
            .map_err(|e| self.err(path, "setting xattrs", e))?;
        if !matches!(entry.kind, EntryKind::Symlink { .. }) {
            // Not a symlink (we just created it), so following is safe;
            // Linux has no mode on symlinks.
            fchmodat(
                Some(dir.as_raw_fd()),
                name,
                Mode::from_bits_truncate(meta.mode),
                FchmodatFlags::FollowSymlink,
            )
            .map_err(|e| self.err(path, "chmod", e.into()))?;
        }
        utimensat(
            Some(dir.as_raw_fd()),
            name,
            &mtime,
            &mtime,
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|e| self.err(path, "setting the mtime", e.into()))
    }
}
