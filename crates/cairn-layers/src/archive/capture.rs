//! Walking an upper directory into a [`LayerIndex`].

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use cairn_store::{BlobStore, ChunkStore};
use nix::fcntl::readlinkat;
use nix::sys::stat::{fstat, major, minor, FileStat, SFlag};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;

use super::dirfd::{self, open_dir, open_dir_at, open_file_at, stat_at};
use super::index::{Entry, EntryKind, LayerId, LayerIndex, LayerPath, Metadata, Timestamp, Xattr};
use super::{ArchiveError, HostIds};

/// A layer that was captured and stored.
#[derive(Debug, Clone)]
pub struct CapturedLayer {
    pub id: LayerId,
    pub index: LayerIndex,
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
    capture_since(upper, store, None).map(|(layer, _)| layer)
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
    // Taken before anything is looked at: see [`Seen::settled`].
    let settled_before = settled_before(std::time::SystemTime::now());
    let root = open_dir(upper).map_err(|source| ArchiveError::Capture {
        path: upper.to_path_buf(),
        action: "opening the upper directory",
        source,
    })?;
    let mut walk = Walk {
        upper,
        store,
        ids,
        entries: Vec::new(),
        links: HashMap::new(),
        previous,
        seen: Baseline::default(),
        settled_before,
        dropped_devices: 0,
    };
    let st = fstat(root.as_raw_fd()).map_err(|e| walk.err(&LayerPath::root(), "stat", e.into()))?;
    let xattrs = dirfd::read_xattrs_fd(&root).map_err(|e| walk.err(&LayerPath::root(), "reading xattrs", e))?;
    walk.entries.push(Entry {
        path: LayerPath::root(),
        kind: EntryKind::Directory,
        meta: metadata(&st, xattrs, ids),
    });
    walk.seen
        .entries
        .insert(LayerPath::root(), Seen::of(&st, settled_before));
    walk.directory(&root, &LayerPath::root())?;
    if previous.is_some() {
        walk.whiteout_vanished()?;
    }
    let index = LayerIndex { entries: walk.entries };
    let id = LayerId::from_hash(store.put_object(&index)?);
    Ok((
        CapturedLayer {
            id,
            index,
            dropped_devices: walk.dropped_devices,
        },
        walk.seen,
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

/// The state of an upper directory at its last capture.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Baseline {
    entries: HashMap<LayerPath, Seen>,
}

/// Version 1 entries had no size and no settled mark.
#[derive(serde::Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
struct SeenV1 {
    dev: u64,
    ino: u64,
    ctime_sec: i64,
    ctime_nsec: i64,
    is_dir: bool,
}

#[derive(serde::Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
struct BaselineV1 {
    entries: HashMap<LayerPath, SeenV1>,
}

impl cairn_store::Framed for Baseline {
    const MAGIC: [u8; 8] = *b"CAIRNBSL";
    const VERSION: u32 = 2;
    const MAX_PAYLOAD: u64 = 1 << 30;
    const NAME: &'static str = "capture baseline";

    /// A version 1 baseline cannot tell racily clean entries from the
    /// others, so every entry counts as unsettled: the next capture reads
    /// each file once more (the store keeps only what changed) and still
    /// whites out what vanished.
    fn decode_older(version: u32, payload: &[u8]) -> Result<Self, cairn_store::FrameError> {
        if version != 1 {
            return Err(cairn_store::FrameError::UnsupportedOldVersion {
                what: Self::NAME,
                found: version,
                supported: Self::VERSION,
            });
        }
        let v1: BaselineV1 = cairn_store::frame::decode_payload(Self::NAME, Self::MAX_PAYLOAD, payload)?;
        Ok(Baseline {
            entries: v1
                .entries
                .into_iter()
                .map(|(path, s)| {
                    let seen = Seen {
                        dev: s.dev,
                        ino: s.ino,
                        ctime_sec: s.ctime_sec,
                        ctime_nsec: s.ctime_nsec,
                        size: 0,
                        is_dir: s.is_dir,
                        settled: false,
                    };
                    (path, seen)
                })
                .collect(),
        })
    }
}

const OPAQUE: [&[u8]; 2] = [b"trusted.overlay.opaque", b"user.overlay.opaque"];

struct Walk<'a, B> {
    upper: &'a Path,
    store: &'a ChunkStore<B>,
    ids: Option<HostIds>,
    entries: Vec<Entry>,
    /// Entry index of the first path seen for each multiply-linked inode.
    links: HashMap<(u64, u64), usize>,
    previous: Option<&'a Baseline>,
    seen: Baseline,
    /// See [`Seen::settled`].
    settled_before: (i64, i64),
    dropped_devices: usize,
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

    /// Whether `path` changed since the previous capture (always, without one).
    fn changed(&self, path: &LayerPath, seen: &Seen) -> bool {
        self.previous
            .is_none_or(|p| !p.entries.get(path).is_some_and(|old| old.unchanged_at(seen)))
    }

    /// Whether `path` is a different inode than at the previous capture.
    fn new_inode(&self, path: &LayerPath, seen: &Seen) -> bool {
        self.previous
            .is_none_or(|p| p.entries.get(path).map(|s| (s.dev, s.ino)) != Some((seen.dev, seen.ino)))
    }

    /// Records the directory's entries; returns whether any was recorded.
    fn directory(&mut self, dir: &File, path: &LayerPath) -> Result<bool, ArchiveError> {
        let names = dirfd::list_names(dir).map_err(|e| self.err(path, "listing the directory", e))?;
        let mut any = false;
        for name in names {
            let child = path.join(&name);
            let st = stat_at(dir, &name).map_err(|e| self.err(&child, "stat", e))?;
            let file_type = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            if is_device(file_type, st.st_rdev) {
                // Left unseen: if it replaced an entry of the previous
                // capture, that entry is whited out.
                self.dropped_devices += 1;
                continue;
            }
            let is_dir = file_type == SFlag::S_IFDIR;
            let is_whiteout = file_type == SFlag::S_IFCHR && st.st_rdev == 0;
            let seen = Seen::of(&st, self.settled_before);
            self.seen.entries.insert(child.clone(), seen);
            let changed = self.changed(&child, &seen);
            if !changed && !is_dir {
                continue;
            }

            // Whiteouts may share one inode (overlayfs links them to a
            // single whiteout); they carry no data, so each stands alone.
            if !is_dir && !is_whiteout && st.st_nlink > 1 {
                let key = (st.st_dev, st.st_ino);
                if let Some(&first) = self.links.get(&key) {
                    let target = &self.entries[first];
                    let entry = Entry {
                        path: child,
                        kind: EntryKind::HardLink {
                            target: target.path.clone(),
                        },
                        meta: target.meta.clone(),
                    };
                    self.entries.push(entry);
                    any = true;
                    continue;
                }
                // Non-directories push exactly one entry below.
                self.links.insert(key, self.entries.len());
            }

            if is_dir {
                let sub = open_dir_at(dir, &name).map_err(|e| self.err(&child, "opening the directory", e))?;
                let mut xattrs = dirfd::read_xattrs_fd(&sub).map_err(|e| self.err(&child, "reading xattrs", e))?;
                // An opaque mark hides everything below this layer; it is
                // carried only by the capture that first sees the directory,
                // or a later layer would hide unchanged entries of earlier ones.
                if !self.new_inode(&child, &seen) {
                    xattrs.retain(|x| !OPAQUE.contains(&x.name.as_slice()));
                }
                let mark = self.entries.len();
                self.entries.push(Entry {
                    path: child.clone(),
                    kind: EntryKind::Directory,
                    meta: metadata(&st, xattrs, self.ids),
                });
                let below = self.directory(&sub, &child)?;
                if changed || below {
                    any = true;
                } else {
                    self.entries.truncate(mark);
                }
                continue;
            }

            let (kind, xattrs) = if file_type == SFlag::S_IFREG {
                let file = open_file_at(dir, &name).map_err(|e| self.err(&child, "opening the file", e))?;
                let opened = fstat(file.as_raw_fd()).map_err(|e| self.err(&child, "stat", e.into()))?;
                if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) {
                    return Err(self.err(
                        &child,
                        "opening the file",
                        std::io::Error::other("it was replaced during capture"),
                    ));
                }
                let xattrs = dirfd::read_xattrs_fd(&file).map_err(|e| self.err(&child, "reading xattrs", e))?;
                if is_metacopy(&xattrs) {
                    return Err(ArchiveError::Metacopy {
                        path: self.full_path(&child),
                    });
                }
                let content = self.store.store_file(&file).map_err(|e| match e {
                    cairn_store::StoreError::ReadSource { source, .. } => self.err(&child, "reading the file", source),
                    other => other.into(),
                })?;
                (EntryKind::File(content), xattrs)
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
            any = true;
            self.entries.push(Entry {
                path: child,
                kind,
                meta: metadata(&st, xattrs, self.ids),
            });
        }
        Ok(any)
    }

    /// Adds whiteouts for paths the previous capture saw that are gone now,
    /// with the directories leading to them, then restores the index order
    /// (parents first, siblings by name, hard-link targets before links).
    fn whiteout_vanished(&mut self) -> Result<(), ArchiveError> {
        let Some(previous) = self.previous else { return Ok(()) };
        let mut gone: Vec<&LayerPath> = previous
            .entries
            .keys()
            .filter(|p| !self.seen.entries.contains_key(*p))
            // A vanished path under another vanished path, or under what is
            // no longer a directory, is hidden by that one.
            .filter(|p| {
                p.split_last().is_some_and(|(parent, _)| {
                    self.seen
                        .entries
                        .get(&LayerPath::from_bytes(parent))
                        .is_some_and(|s| s.is_dir)
                })
            })
            .collect();
        if gone.is_empty() {
            return Ok(());
        }
        gone.sort();
        let mut present: std::collections::HashSet<LayerPath> = self.entries.iter().map(|e| e.path.clone()).collect();
        for path in gone {
            // The directories above the whiteout, as they are now.
            let mut ancestors = Vec::new();
            let mut cur = path.clone();
            while let Some((parent, _)) = cur.split_last() {
                let parent = LayerPath::from_bytes(parent);
                if present.contains(&parent) {
                    break;
                }
                ancestors.push(parent.clone());
                cur = parent;
            }
            for dir in ancestors.into_iter().rev() {
                let full = self.full_path(&dir);
                let st = nix::sys::stat::lstat(&full).map_err(|e| self.err(&dir, "stat", e.into()))?;
                let mut xattrs = dirfd::read_xattrs_at(&full).map_err(|e| self.err(&dir, "reading xattrs", e))?;
                xattrs.retain(|x| !OPAQUE.contains(&x.name.as_slice()));
                present.insert(dir.clone());
                self.entries.push(Entry {
                    path: dir,
                    kind: EntryKind::Directory,
                    meta: metadata(&st, xattrs, self.ids),
                });
            }
            present.insert(path.clone());
            self.entries.push(Entry {
                path: path.clone(),
                kind: EntryKind::CharDevice { major: 0, minor: 0 },
                meta: Metadata {
                    mode: 0,
                    uid: 0,
                    gid: 0,
                    mtime: Timestamp { sec: 0, nsec: 0 },
                    xattrs: Vec::new(),
                },
            });
        }
        self.entries
            .sort_by(|a, b| a.path.components().cmp(b.path.components()));
        reorder_links(&mut self.entries);
        Ok(())
    }
}

/// After sorting, makes the first path of each hard-link group hold the
/// content and every other path link to it.
fn reorder_links(entries: &mut [Entry]) {
    let mut first_of: HashMap<LayerPath, LayerPath> = HashMap::new();
    let mut position: HashMap<LayerPath, usize> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        position.insert(e.path.clone(), i);
    }
    for i in 0..entries.len() {
        let EntryKind::HardLink { target } = &entries[i].kind else {
            continue;
        };
        let target = target.clone();
        let Some(&t) = position.get(&target) else { continue };
        if t > i {
            // This link comes first: it takes the content.
            let content = std::mem::replace(
                &mut entries[t].kind,
                EntryKind::HardLink {
                    target: entries[i].path.clone(),
                },
            );
            entries[i].kind = content;
            first_of.insert(target, entries[i].path.clone());
        } else if let Some(first) = first_of.get(&target) {
            entries[i].kind = EntryKind::HardLink { target: first.clone() };
        }
    }
    // Links that pointed at a demoted target now point at the new first.
    for e in entries.iter_mut() {
        if let EntryKind::HardLink { target } = &mut e.kind {
            if let Some(first) = first_of.get(target) {
                if *first != e.path {
                    *target = first.clone();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes version 1 baselines, as older Cairn did.
    impl cairn_store::Framed for BaselineV1 {
        const MAGIC: [u8; 8] = *b"CAIRNBSL";
        const VERSION: u32 = 1;
        const MAX_PAYLOAD: u64 = 1 << 30;
        const NAME: &'static str = "capture baseline";
    }

    #[test]
    fn a_version_1_baseline_is_read_with_every_entry_unsettled() {
        let path = LayerPath::root().join(b"f");
        let old = BaselineV1 {
            entries: HashMap::from([(
                path.clone(),
                SeenV1 {
                    dev: 1,
                    ino: 2,
                    ctime_sec: 3,
                    ctime_nsec: 4,
                    is_dir: false,
                },
            )]),
        };
        let bytes = cairn_store::frame::encode(&old).unwrap();
        let read: Baseline = cairn_store::frame::decode(&bytes).unwrap();
        let seen = read.entries[&path];
        assert_eq!((seen.dev, seen.ino, seen.ctime_sec, seen.ctime_nsec), (1, 2, 3, 4));
        assert!(!seen.settled);
        // Unsettled: the same stat still counts as a change.
        assert!(!seen.unchanged_at(&seen));
        let again: Baseline = cairn_store::frame::decode(&cairn_store::frame::encode(&read).unwrap()).unwrap();
        assert_eq!(again.entries, read.entries);
    }

    #[test]
    fn only_a_ctime_older_than_the_clock_slack_is_settled() {
        let start = std::time::UNIX_EPOCH + std::time::Duration::new(100, 500);
        assert_eq!(settled_before(start), (99, 500));
    }
}
