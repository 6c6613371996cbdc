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
use super::ArchiveError;

/// A layer that was captured and stored.
#[derive(Debug, Clone)]
pub struct CapturedLayer {
    pub id: LayerId,
    pub index: LayerIndex,
}

/// Records every entry under `upper` and stores file contents and the
/// index in `store`. Only the upper directory is read.
pub fn capture<B: BlobStore>(upper: &Path, store: &ChunkStore<B>) -> Result<CapturedLayer, ArchiveError> {
    let root = open_dir(upper).map_err(|source| ArchiveError::Capture {
        path: upper.to_path_buf(),
        action: "opening the upper directory",
        source,
    })?;
    let mut walk = Walk {
        upper,
        store,
        entries: Vec::new(),
        links: HashMap::new(),
    };
    let st = fstat(root.as_raw_fd()).map_err(|e| walk.err(&LayerPath::root(), "stat", e.into()))?;
    let xattrs = dirfd::read_xattrs_fd(&root).map_err(|e| walk.err(&LayerPath::root(), "reading xattrs", e))?;
    walk.entries.push(Entry {
        path: LayerPath::root(),
        kind: EntryKind::Directory,
        meta: metadata(&st, xattrs),
    });
    walk.directory(&root, &LayerPath::root())?;
    let index = LayerIndex { entries: walk.entries };
    let id = LayerId::from_hash(store.put_object(&index)?);
    Ok(CapturedLayer { id, index })
}

struct Walk<'a, B> {
    upper: &'a Path,
    store: &'a ChunkStore<B>,
    entries: Vec<Entry>,
    /// Entry index of the first path seen for each multiply-linked inode.
    links: HashMap<(u64, u64), usize>,
}

fn metadata(st: &FileStat, xattrs: Vec<Xattr>) -> Metadata {
    Metadata {
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
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

    fn directory(&mut self, dir: &File, path: &LayerPath) -> Result<(), ArchiveError> {
        let names = dirfd::list_names(dir).map_err(|e| self.err(path, "listing the directory", e))?;
        for name in names {
            let child = path.join(&name);
            let st = stat_at(dir, &name).map_err(|e| self.err(&child, "stat", e))?;
            let file_type = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            let is_dir = file_type == SFlag::S_IFDIR;
            let is_whiteout = file_type == SFlag::S_IFCHR && st.st_rdev == 0;

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
                    continue;
                }
                // Non-directories push exactly one entry below.
                self.links.insert(key, self.entries.len());
            }

            if is_dir {
                let sub = open_dir_at(dir, &name).map_err(|e| self.err(&child, "opening the directory", e))?;
                let xattrs = dirfd::read_xattrs_fd(&sub).map_err(|e| self.err(&child, "reading xattrs", e))?;
                self.entries.push(Entry {
                    path: child.clone(),
                    kind: EntryKind::Directory,
                    meta: metadata(&st, xattrs),
                });
                self.directory(&sub, &child)?;
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
                    SFlag::S_IFCHR => {
                        let (major, minor) = dev();
                        EntryKind::CharDevice { major, minor }
                    }
                    SFlag::S_IFBLK => {
                        let (major, minor) = dev();
                        EntryKind::BlockDevice { major, minor }
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
            self.entries.push(Entry {
                path: child,
                kind,
                meta: metadata(&st, xattrs),
            });
        }
        Ok(())
    }
}
