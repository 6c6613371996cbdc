//! Walking an upper directory into a [`LayerIndex`].

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use cairn_store::{BlobStore, ChunkStore};
use nix::fcntl::readlinkat;
use nix::sys::stat::{fstat, major, minor, FileStat, SFlag};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;

use super::baseline::{self, Baseline};
use super::dirfd::{self, open_dir, open_dir_at, open_file_at, stat_at};
use super::index::{Entry, EntryKind, LayerId, LayerPath, Metadata, Timestamp, Xattr, SMALL_FILE_MAX};
use super::stored::IndexWriter;
use super::{ArchiveError, HostIds};

/// A layer that was captured and stored.
#[derive(Debug, Clone, Copy)]
pub struct CapturedLayer {
    pub id: LayerId,
    /// Entries in the layer's index (1 when nothing changed: the root).
    pub entries: u64,
    /// Apparent size of the layer's files.
    pub file_bytes: u64,
    /// Block and character devices found and left out (see [`is_device`]).
    pub dropped_devices: usize,
}

/// Whether a file type and device number make a device node, which no layer
/// keeps: opened inside a sandbox it would reach the host's device. A
/// character device 0:0 is an overlayfs whiteout, not a device.
pub(crate) fn is_device(file_type: SFlag, rdev: u64) -> bool {
    file_type == SFlag::S_IFBLK || (file_type == SFlag::S_IFCHR && rdev != 0)
}

/// Records every entry under `upper` but device nodes and stores file
/// contents and the index in `store`. Only the upper directory is read.
pub fn capture<B: BlobStore>(upper: &Path, store: &ChunkStore<B>) -> Result<CapturedLayer, ArchiveError> {
    walk_upper(upper, store, None, None, None).map(|(layer, _)| layer)
}

/// [`capture`] of an upper directory written through a user namespace
/// (see [`capture_since_mapped`]), with no baseline written.
pub fn capture_mapped<B: BlobStore>(
    upper: &Path,
    store: &ChunkStore<B>,
    ids: Option<HostIds>,
) -> Result<CapturedLayer, ArchiveError> {
    walk_upper(upper, store, None, ids, None).map(|(layer, _)| layer)
}

/// Captures what changed in `upper` since the capture that produced
/// `previous` (everything when `None`), as a layer that goes on top of that
/// capture's layer: changed and new entries, the directories leading to
/// them, and whiteouts for entries that disappeared. Unchanged files are
/// neither read nor stored, so the cost follows the change, plus one `stat`
/// per entry. Returns the layer and the baseline for the next capture.
pub fn capture_since<B: BlobStore>(
    upper: &Path,
    store: &ChunkStore<B>,
    previous: Option<&Baseline>,
) -> Result<(CapturedLayer, Baseline), ArchiveError> {
    capture_since_mapped(upper, store, previous, None)
}

/// [`capture_since`] of an upper directory written through a user
/// namespace: owners in `ids`' host range are recorded as the sandbox ids
/// they stand for, so the layer holds the ids its sandbox saw.
pub fn capture_since_mapped<B: BlobStore>(
    upper: &Path,
    store: &ChunkStore<B>,
    previous: Option<&Baseline>,
    ids: Option<HostIds>,
) -> Result<(CapturedLayer, Baseline), ArchiveError> {
    let beside = match upper.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    capture_since_with(upper, store, previous, ids, beside)
}

/// [`capture_since_mapped`] that writes the next baseline in
/// `baseline_dir` (on the filesystem where it will be kept, and not one
/// the sandbox's quota counts), instead of beside `upper`.
pub fn capture_since_with<B: BlobStore>(
    upper: &Path,
    store: &ChunkStore<B>,
    previous: Option<&Baseline>,
    ids: Option<HostIds>,
    baseline_dir: &Path,
) -> Result<(CapturedLayer, Baseline), ArchiveError> {
    let (layer, baseline) = walk_upper(upper, store, previous, ids, Some(baseline_dir))?;
    Ok((layer, baseline.expect("asked for")))
}

/// The capture itself; writes a baseline when given where.
fn walk_upper<B: BlobStore>(
    upper: &Path,
    store: &ChunkStore<B>,
    previous: Option<&Baseline>,
    ids: Option<HostIds>,
    baseline_dir: Option<&Path>,
) -> Result<(CapturedLayer, Option<Baseline>), ArchiveError> {
    // Taken before anything is looked at: see [`Seen::settled`].
    let settled_before = settled_before(std::time::SystemTime::now());
    let fail = |action, source| ArchiveError::Capture {
        path: upper.to_path_buf(),
        action,
        source,
    };
    let root = open_dir(upper).map_err(|e| fail("opening the upper directory", e))?;
    let seen = baseline_dir
        .map(baseline::Writer::create)
        .transpose()
        .map_err(|e| fail("creating the capture baseline", e))?;
    let previous = previous
        .map(|b| b.cursor())
        .transpose()
        .map_err(|e| fail("reading the capture baseline", std::io::Error::other(e)))?;
    let mut walk = Walk {
        upper,
        ids,
        store,
        out: IndexWriter::new(store),
        pending: Vec::new(),
        links: HashMap::new(),
        previous,
        seen,
        settled_before,
        dropped_devices: 0,
    };
    let st = fstat(root.as_raw_fd()).map_err(|e| walk.err(&LayerPath::root(), "stat", e.into()))?;
    let xattrs = dirfd::read_xattrs_fd(&root).map_err(|e| walk.err(&LayerPath::root(), "reading xattrs", e))?;
    let seen = Seen::of(&st, settled_before);
    walk.record_seen(&LayerPath::root(), &seen)?;
    let old_root = walk.take_previous(&LayerPath::root(), None)?;
    walk.out.push(Entry {
        path: LayerPath::root(),
        kind: EntryKind::Directory,
        meta: metadata(&st, xattrs, ids),
    })?;
    walk.directory(&root, &LayerPath::root(), old_root.is_some_and(|o| o.is_dir))?;
    if let Some(cursor) = &mut walk.previous {
        if let Some((path, _)) = cursor
            .peek()
            .map_err(|e| fail("reading the capture baseline", std::io::Error::other(e)))?
        {
            tracing::warn!(path = ?path, "the capture baseline holds paths the walk did not reach; they are left as they were");
        }
    }
    let Walk {
        out,
        seen,
        dropped_devices,
        ..
    } = walk;
    let summary = out.finish()?;
    let baseline = seen
        .map(baseline::Writer::finish)
        .transpose()
        .map_err(|e| fail("writing the capture baseline", e))?;
    Ok((
        CapturedLayer {
            id: summary.id,
            entries: summary.entries,
            file_bytes: summary.file_bytes,
            dropped_devices,
        },
        baseline,
    ))
}

/// Removes every device node under `root` (whiteouts stay; see
/// [`is_device`]), never following a symlink; returns how many went. For a
/// directory that becomes a layer as it is (an imported image), not only
/// its index.
pub fn remove_device_nodes(root: &Path) -> Result<usize, ArchiveError> {
    fn walk(dir: &File, at: &Path) -> Result<usize, ArchiveError> {
        let fail = |action, source| ArchiveError::Capture {
            path: at.to_path_buf(),
            action,
            source,
        };
        let mut removed = 0;
        for name in dirfd::list_names(dir).map_err(|e| fail("listing the directory", e))? {
            let path = at.join(std::ffi::OsStr::from_bytes(&name));
            let st = stat_at(dir, &name).map_err(|e| fail("stat", e))?;
            let file_type = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            if file_type == SFlag::S_IFDIR {
                let sub = open_dir_at(dir, &name).map_err(|e| fail("opening the directory", e))?;
                removed += walk(&sub, &path)?;
            } else if is_device(file_type, st.st_rdev) {
                nix::unistd::unlinkat(
                    Some(dir.as_raw_fd()),
                    &name[..],
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                )
                .map_err(|e| fail("removing a device node", e.into()))?;
                removed += 1;
            }
        }
        Ok(removed)
    }
    let dir = open_dir(root).map_err(|source| ArchiveError::Capture {
        path: root.to_path_buf(),
        action: "opening the directory",
        source,
    })?;
    walk(&dir, root)
}

/// How far behind the clock a ctime may lag: the kernel stamps inodes from
/// a coarse clock (one tick, up to 10 ms) read when the change is made.
/// Generous, since being wrong only costs a file read.
const CLOCK_SLACK: std::time::Duration = std::time::Duration::from_secs(1);

/// The (seconds, nanoseconds) before which a ctime is safely in the past
/// for a capture starting at `start`.
fn settled_before(start: std::time::SystemTime) -> (i64, i64) {
    let t = start
        .checked_sub(CLOCK_SLACK)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .unwrap_or_default();
    (t.as_secs() as i64, i64::from(t.subsec_nanos()))
}

/// What one capture saw of each path: enough to tell, next time, whether
/// the entry changed. ctime moves on every change to content, metadata,
/// xattrs or link count, and cannot be set from user space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Seen {
    dev: u64,
    ino: u64,
    ctime_sec: i64,
    ctime_nsec: i64,
    size: u64,
    is_dir: bool,
    /// Whether the ctime was older than the capture's start (less the
    /// clock's slack). A change made in the same clock tick as the one
    /// before it leaves the ctime as it was, so an entry changed just
    /// before a capture (git's "racily clean" index entries) may change
    /// again after it without its ctime moving: the next capture reads such
    /// an entry again, whatever its stat says.
    settled: bool,
}

impl Seen {
    fn of(st: &FileStat, settled_before: (i64, i64)) -> Seen {
        Seen {
            dev: st.st_dev,
            ino: st.st_ino,
            ctime_sec: st.st_ctime,
            ctime_nsec: st.st_ctime_nsec,
            size: st.st_size as u64,
            is_dir: SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR,
            settled: (st.st_ctime, st.st_ctime_nsec) < settled_before,
        }
    }

    /// Whether `now` is this entry unchanged: settled then, and the same
    /// inode, ctime, size and kind now.
    fn unchanged_at(&self, now: &Seen) -> bool {
        self.settled
            && (
                self.dev,
                self.ino,
                self.ctime_sec,
                self.ctime_nsec,
                self.size,
                self.is_dir,
            ) == (now.dev, now.ino, now.ctime_sec, now.ctime_nsec, now.size, now.is_dir)
    }
}

const OPAQUE: [&[u8]; 2] = [b"trusted.overlay.opaque", b"user.overlay.opaque"];

/// One capture's walk: entries go to the index writer as they are found,
/// and the previous baseline is read alongside, in the same order.
struct Walk<'a, B> {
    upper: &'a Path,
    store: &'a ChunkStore<B>,
    ids: Option<HostIds>,
    out: IndexWriter<'a, B>,
    /// Directories entered whose entry is not written yet: it is written
    /// before the first entry below it, or dropped when nothing below it
    /// changed.
    pending: Vec<Entry>,
    /// The first path and metadata recorded for each multiply-linked inode.
    links: HashMap<(u64, u64), (LayerPath, Metadata)>,
    /// The previous capture's baseline (none: record everything).
    previous: Option<baseline::Cursor>,
    /// The baseline for the next capture, when one is wanted.
    seen: Option<baseline::Writer>,
    /// See [`Seen::settled`].
    settled_before: (i64, i64),
    dropped_devices: usize,
}

/// The name of `path` when its parent is `dir`.
fn child_name<'p>(path: &'p LayerPath, dir: &LayerPath) -> Option<&'p [u8]> {
    path.split_last()
        .and_then(|(parent, name)| (parent == dir.as_bytes()).then_some(name))
}

/// Whether `path` is strictly below `dir`.
fn is_below(path: &LayerPath, dir: &LayerPath) -> bool {
    let (p, d) = (path.as_bytes(), dir.as_bytes());
    if d.is_empty() {
        return !p.is_empty();
    }
    p.len() > d.len() && p.starts_with(d) && p[d.len()] == b'/'
}

fn whiteout(path: LayerPath) -> Entry {
    Entry {
        path,
        kind: EntryKind::CharDevice { major: 0, minor: 0 },
        meta: Metadata {
            mode: 0,
            uid: 0,
            gid: 0,
            mtime: Timestamp { sec: 0, nsec: 0 },
            xattrs: Vec::new(),
        },
    }
}

fn metadata(st: &FileStat, mut xattrs: Vec<Xattr>, ids: Option<HostIds>) -> Metadata {
    let sandbox_id = |id| ids.map_or(id, |ids| ids.sandbox_id(id));
    if let Some(ids) = ids {
        for x in &mut xattrs {
            x.value = ids.sandbox_xattr(&x.name, std::mem::take(&mut x.value));
        }
    }
    Metadata {
        mode: st.st_mode & 0o7777,
        uid: sandbox_id(st.st_uid),
        gid: sandbox_id(st.st_gid),
        mtime: Timestamp {
            sec: st.st_mtime,
            nsec: st.st_mtime_nsec as u32,
        },
        xattrs,
    }
}

fn is_metacopy(xattrs: &[Xattr]) -> bool {
    xattrs
        .iter()
        .any(|x| x.name == b"trusted.overlay.metacopy" || x.name == b"user.overlay.metacopy")
}

impl<B: BlobStore> Walk<'_, B> {
    fn full_path(&self, path: &LayerPath) -> std::path::PathBuf {
        let mut p = self.upper.as_os_str().as_bytes().to_vec();
        p.extend_from_slice(path.display_path().as_os_str().as_bytes());
        std::path::PathBuf::from(std::ffi::OsStr::from_bytes(&p))
    }

    fn err(&self, path: &LayerPath, action: &'static str, source: std::io::Error) -> ArchiveError {
        ArchiveError::Capture {
            path: self.full_path(path),
            action,
            source,
        }
    }

    fn baseline_err(&self, e: String) -> ArchiveError {
        self.err(
            &LayerPath::root(),
            "reading the capture baseline",
            std::io::Error::other(e),
        )
    }

    fn record_seen(&mut self, path: &LayerPath, seen: &Seen) -> Result<(), ArchiveError> {
        match &mut self.seen {
            Some(writer) => writer
                .push(path, seen)
                .map_err(|e| self.err(path, "writing the capture baseline", e)),
            None => Ok(()),
        }
    }

    /// Writes `entry`, after the directories above it that are not written yet.
    fn emit(&mut self, entry: Entry) -> Result<(), ArchiveError> {
        for dir in self.pending.drain(..) {
            self.out.push(dir)?;
        }
        self.out.push(entry)?;
        Ok(())
    }

    /// Takes the previous capture's record of `dir`'s child `name` (of the
    /// root itself, without a name), if it is next.
    fn take_previous(&mut self, dir: &LayerPath, name: Option<&[u8]>) -> Result<Option<Seen>, ArchiveError> {
        let Some(cursor) = &mut self.previous else {
            return Ok(None);
        };
        let hit = match cursor.peek() {
            Err(e) => return Err(self.baseline_err(e)),
            Ok(None) => false,
            Ok(Some((path, _))) => match name {
                None => path.is_root(),
                Some(name) => child_name(path, dir) == Some(name),
            },
        };
        if !hit {
            return Ok(None);
        }
        let cursor = self.previous.as_mut().expect("checked above");
        match cursor.take() {
            Ok(taken) => Ok(taken.map(|(_, seen)| seen)),
            Err(e) => Err(self.baseline_err(e)),
        }
    }

    /// Skips the previous capture's records below `dir`.
    fn skip_below(&mut self, dir: &LayerPath) -> Result<(), ArchiveError> {
        loop {
            let Some(cursor) = &mut self.previous else {
                return Ok(());
            };
            let below = match cursor.peek() {
                Ok(next) => next.is_some_and(|(p, _)| is_below(p, dir)),
                Err(e) => return Err(self.baseline_err(e)),
            };
            if !below {
                return Ok(());
            }
            if let Err(e) = cursor.take() {
                return Err(self.baseline_err(e));
            }
        }
    }

    /// Whites out the previous capture's children of `dir` that sort before
    /// `name` (all that are left, without one): they are gone now. What was
    /// below them is hidden by their whiteouts.
    fn vanish_before(&mut self, dir: &LayerPath, name: Option<&[u8]>) -> Result<(), ArchiveError> {
        loop {
            let Some(cursor) = &mut self.previous else {
                return Ok(());
            };
            let gone = match cursor.peek() {
                Err(e) => return Err(self.baseline_err(e)),
                Ok(Some((path, _))) => child_name(path, dir).is_some_and(|n| name.is_none_or(|name| n < name)),
                Ok(None) => false,
            };
            if !gone {
                return Ok(());
            }
            let (path, seen) = match cursor.take() {
                Ok(taken) => taken.expect("peeked above"),
                Err(e) => return Err(self.baseline_err(e)),
            };
            if seen.is_dir {
                self.skip_below(&path)?;
            }
            self.emit(whiteout(path))?;
        }
    }

    /// Records `dir`'s entries; `with_previous` when the previous capture
    /// saw `dir` as a directory (its children are next in the baseline).
    fn directory(&mut self, dir: &File, path: &LayerPath, with_previous: bool) -> Result<(), ArchiveError> {
        let names = dirfd::list_names(dir).map_err(|e| self.err(path, "listing the directory", e))?;
        for name in names {
            let child = path.join(&name);
            let old = if with_previous {
                self.vanish_before(path, Some(&name))?;
                self.take_previous(path, Some(&name))?
            } else {
                None
            };
            let st = stat_at(dir, &name).map_err(|e| self.err(&child, "stat", e))?;
            let file_type = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            let is_dir = file_type == SFlag::S_IFDIR;
            if old.is_some_and(|o| o.is_dir) && !is_dir {
                // What was below the old directory is hidden by what replaced it.
                self.skip_below(&child)?;
            }
            if is_device(file_type, st.st_rdev) {
                // Left unseen: if it replaced an entry of the previous
                // capture, that entry is whited out.
                self.dropped_devices += 1;
                if old.is_some() {
                    self.emit(whiteout(child))?;
                }
                continue;
            }
            let is_whiteout = file_type == SFlag::S_IFCHR && st.st_rdev == 0;
            let seen = Seen::of(&st, self.settled_before);
            self.record_seen(&child, &seen)?;
            let changed = self.previous.is_none() || !old.is_some_and(|o| o.unchanged_at(&seen));
            let new_inode = old.map(|o| (o.dev, o.ino)) != Some((seen.dev, seen.ino));
            if !changed && !is_dir {
                continue;
            }

            // Whiteouts may share one inode (overlayfs links them to a
            // single whiteout); they carry no data, so each stands alone.
            let link_key = (!is_dir && !is_whiteout && st.st_nlink > 1).then_some((st.st_dev, st.st_ino));
            if let Some((target, meta)) = link_key.and_then(|key| self.links.get(&key)) {
                let entry = Entry {
                    path: child,
                    kind: EntryKind::HardLink { target: target.clone() },
                    meta: meta.clone(),
                };
                self.emit(entry)?;
                continue;
            }

            if is_dir {
                let sub = open_dir_at(dir, &name).map_err(|e| self.err(&child, "opening the directory", e))?;
                let mut xattrs = dirfd::read_xattrs_fd(&sub).map_err(|e| self.err(&child, "reading xattrs", e))?;
                // An opaque mark hides everything below this layer; it is
                // carried only by the capture that first sees the directory,
                // or a later layer would hide unchanged entries of earlier ones.
                if !new_inode {
                    xattrs.retain(|x| !OPAQUE.contains(&x.name.as_slice()));
                }
                let entry = Entry {
                    path: child.clone(),
                    kind: EntryKind::Directory,
                    meta: metadata(&st, xattrs, self.ids),
                };
                let was_dir = old.is_some_and(|o| o.is_dir);
                if changed {
                    self.emit(entry)?;
                    self.directory(&sub, &child, was_dir)?;
                } else {
                    self.pending.push(entry);
                    let depth = self.pending.len();
                    self.directory(&sub, &child, was_dir)?;
                    // Still pending: nothing below changed.
                    self.pending.truncate(depth - 1);
                }
                continue;
            }

            let (kind, xattrs) = if file_type == SFlag::S_IFREG {
                self.file(dir, &name, &child, &st)?
            } else {
                let at = dirfd::proc_path(dir, &name);
                let xattrs = dirfd::read_xattrs_at(&at).map_err(|e| self.err(&child, "reading xattrs", e))?;
                let dev = || (major(st.st_rdev) as u32, minor(st.st_rdev) as u32);
                let kind = match file_type {
                    SFlag::S_IFLNK => {
                        let target = readlinkat(Some(dir.as_raw_fd()), &name[..])
                            .map_err(|e| self.err(&child, "reading the symlink", e.into()))?;
                        EntryKind::Symlink {
                            target: target.as_bytes().to_vec(),
                        }
                    }
                    SFlag::S_IFIFO => EntryKind::Fifo,
                    SFlag::S_IFSOCK => EntryKind::Socket,
                    // Only whiteouts are left (devices were dropped above).
                    SFlag::S_IFCHR => {
                        let (major, minor) = dev();
                        EntryKind::CharDevice { major, minor }
                    }
                    _ => {
                        return Err(ArchiveError::UnknownFileType {
                            path: self.full_path(&child),
                            mode: st.st_mode,
                        })
                    }
                };
                (kind, xattrs)
            };
            let meta = metadata(&st, xattrs, self.ids);
            if let Some(key) = link_key {
                self.links.insert(key, (child.clone(), meta.clone()));
            }
            self.emit(Entry {
                path: child,
                kind,
                meta,
            })?;
        }
        if with_previous {
            self.vanish_before(path, None)?;
        }
        Ok(())
    }

    /// Reads a regular file: into the index when it is small, else into
    /// the store.
    fn file(
        &self,
        dir: &File,
        name: &[u8],
        child: &LayerPath,
        st: &FileStat,
    ) -> Result<(EntryKind, Vec<Xattr>), ArchiveError> {
        let file = open_file_at(dir, name).map_err(|e| self.err(child, "opening the file", e))?;
        let opened = fstat(file.as_raw_fd()).map_err(|e| self.err(child, "stat", e.into()))?;
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) {
            return Err(self.err(
                child,
                "opening the file",
                std::io::Error::other("it was replaced during capture"),
            ));
        }
        let xattrs = dirfd::read_xattrs_fd(&file).map_err(|e| self.err(child, "reading xattrs", e))?;
        if is_metacopy(&xattrs) {
            return Err(ArchiveError::Metacopy {
                path: self.full_path(child),
            });
        }
        if opened.st_size as u64 <= SMALL_FILE_MAX as u64 {
            use std::io::Read;
            let mut data = Vec::with_capacity(opened.st_size as usize);
            (&file)
                .take(SMALL_FILE_MAX as u64 + 1)
                .read_to_end(&mut data)
                .map_err(|e| self.err(child, "reading the file", e))?;
            if data.len() <= SMALL_FILE_MAX {
                return Ok((EntryKind::SmallFile { data }, xattrs));
            }
            // It grew while being read: stored like any large file.
            use std::io::Seek;
            (&file)
                .seek(std::io::SeekFrom::Start(0))
                .map_err(|e| self.err(child, "reading the file", e))?;
        }
        let content = self.store.store_file(&file).map_err(|e| match e {
            cairn_store::StoreError::ReadSource { source, .. } => self.err(child, "reading the file", source),
            other => other.into(),
        })?;
        Ok((EntryKind::File(content), xattrs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_ctime_older_than_the_clock_slack_is_settled() {
        let start = std::time::UNIX_EPOCH + std::time::Duration::new(100, 500);
        assert_eq!(settled_before(start), (99, 500));
    }

    #[test]
    fn children_and_descendants_are_told_apart() {
        let p = |s: &[u8]| LayerPath::from_bytes(s);
        assert_eq!(child_name(&p(b"a/b"), &p(b"a")), Some(&b"b"[..]));
        assert_eq!(child_name(&p(b"a"), &LayerPath::root()), Some(&b"a"[..]));
        assert_eq!(child_name(&p(b"a/b/c"), &p(b"a")), None);
        assert_eq!(child_name(&p(b"ab/c"), &p(b"a")), None);
        assert!(is_below(&p(b"a/b/c"), &p(b"a")));
        assert!(!is_below(&p(b"ab"), &p(b"a")));
        assert!(!is_below(&p(b"a"), &p(b"a")));
        assert!(is_below(&p(b"a"), &LayerPath::root()));
        assert!(!is_below(&LayerPath::root(), &LayerPath::root()));
    }
}
