//! Copies of layer directories whose ids are shifted into a sandbox's host
//! range, for kernels whose overlayfs cannot take idmapped layers (or whose
//! state directory's filesystem has no idmapped mounts): the copy stores
//! what an idmapped mount of the layer would show.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{readlinkat, renameat2, AtFlags, RenameFlags};
use nix::sys::stat::{
    fchmod, fchmodat, futimens, makedev, mkdirat, mknodat, utimensat, FchmodatFlags, FileStat, Mode, SFlag,
    UtimensatFlags,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchown, fchownat, linkat, symlinkat, syncfs, Gid, Uid};

use super::dirfd::{self, create_file_at, list_names, open_dir, open_dir_at, open_file_at, stat_at};
use super::materialise::temp_beside;
use super::{ArchiveError, HostIds, Xattr};

/// What [`shifted_copy`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShiftedCopy {
    /// Entries copied (directories, files, links, special files).
    pub entries: u64,
    /// Bytes of regular files copied.
    pub bytes: u64,
    /// Of those, bytes that share their blocks with the layer (reflinked).
    pub reflinked: u64,
    /// Whether `dest` existed already (made by another process): nothing
    /// was copied.
    pub existed: bool,
}

/// Makes `dest`, a copy of the layer directory `src` whose owners are
/// shifted into `ids` ([`HostIds::host_id`]) and whose file capabilities
/// name the range's root ([`HostIds::host_xattr`]); modes, mtimes, xattrs
/// (overlayfs' whiteouts, opaque and redirect marks among them), symlinks
/// and hard links are kept. File data is reflinked where the filesystem
/// can, copied otherwise. Device nodes other than whiteouts are left out,
/// as a materialised layer never holds one. Nothing in `src` is followed.
///
/// The copy is built in a temp directory beside `dest` (swept by
/// [`super::remove_abandoned_materialisations`] if this process dies),
/// flushed, and renamed into place; if another process placed `dest`
/// first, its copy is kept and this one removed.
pub fn shifted_copy(src: &Path, dest: &Path, ids: HostIds) -> Result<ShiftedCopy, ArchiveError> {
    if dest.exists() {
        return Ok(ShiftedCopy {
            existed: true,
            ..ShiftedCopy::default()
        });
    }
    let fail = |action, source| ArchiveError::Materialise {
        path: dest.to_path_buf(),
        action,
        source,
    };
    let (parent, name) = match (dest.parent(), dest.file_name()) {
        (Some(p), Some(n)) => (p, n),
        _ => {
            return Err(fail(
                "naming the destination",
                io::Error::from(io::ErrorKind::InvalidInput),
            ))
        }
    };
    std::fs::create_dir_all(parent).map_err(|e| fail("creating the shifted layers' directory", e))?;
    let temp = temp_beside(parent, name);
    let mut copier = Copier {
        ids,
        dest,
        temp: &temp,
        links: HashMap::new(),
        done: ShiftedCopy::default(),
    };
    let built = copier.copy_tree(src);
    let built = built.and_then(|root| syncfs(root.as_raw_fd()).map_err(|e| fail("flushing the copy", e.into())));
    let placed = built.and_then(
        |()| match renameat2(None, &temp, None, dest, RenameFlags::RENAME_NOREPLACE) {
            Ok(()) => File::open(parent)
                .and_then(|d| d.sync_all())
                .map(|()| false)
                .map_err(|e| fail("flushing the destination's parent directory", e)),
            // Another start placed the same layer's copy first.
            Err(Errno::EEXIST) | Err(Errno::ENOTEMPTY) => Ok(true),
            Err(e) => Err(fail("renaming the finished copy into place", e.into())),
        },
    );
    match placed {
        Ok(existed) => {
            if existed {
                let _ = std::fs::remove_dir_all(&temp);
            }
            Ok(ShiftedCopy { existed, ..copier.done })
        }
        Err(e) => {
            // The temp name is ours alone.
            let _ = std::fs::remove_dir_all(&temp);
            Err(e)
        }
    }
}

/// A directory being copied: its entries still to copy, and its own
/// metadata, applied once they are in.
struct Frame {
    src: File,
    dst: File,
    rel: Vec<u8>,
    names: std::vec::IntoIter<Vec<u8>>,
    stat: FileStat,
}

struct Copier<'a> {
    ids: HostIds,
    dest: &'a Path,
    temp: &'a Path,
    /// The first copy of each multiply linked file: (device, inode) to its
    /// path under the temp directory.
    links: HashMap<(u64, u64), PathBuf>,
    done: ShiftedCopy,
}

fn timespec(sec: i64, nsec: i64) -> TimeSpec {
    TimeSpec::new(sec, nsec)
}

fn join(rel: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = rel.to_vec();
    if !p.is_empty() {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

impl Copier<'_> {
    fn err(&self, rel: &[u8], action: &'static str, source: impl Into<io::Error>) -> ArchiveError {
        let mut p = self.dest.as_os_str().as_bytes().to_vec();
        if !rel.is_empty() {
            p.push(b'/');
            p.extend_from_slice(rel);
        }
        ArchiveError::Materialise {
            path: PathBuf::from(OsStr::from_bytes(&p)),
            action,
            source: source.into(),
        }
    }

    fn owners(&self, st: &FileStat) -> (Option<Uid>, Option<Gid>) {
        (
            Some(Uid::from_raw(self.ids.host_id(st.st_uid))),
            Some(Gid::from_raw(self.ids.host_id(st.st_gid))),
        )
    }

    fn shifted(&self, xattrs: Vec<Xattr>) -> Vec<Xattr> {
        xattrs
            .into_iter()
            .map(|x| Xattr {
                value: self.ids.host_xattr(&x.name, x.value),
                name: x.name,
            })
            .collect()
    }

    /// Owner, then xattrs (chown clears security.capability), of an open
    /// copy.
    fn label(&self, rel: &[u8], src: &File, dst: &File, st: &FileStat) -> Result<(), ArchiveError> {
        let (uid, gid) = self.owners(st);
        fchown(dst.as_raw_fd(), uid, gid).map_err(|e| self.err(rel, "chown", e))?;
        let xattrs = dirfd::read_xattrs_fd(src).map_err(|e| self.err(rel, "reading xattrs", e))?;
        dirfd::write_xattrs_fd(dst, &self.shifted(xattrs)).map_err(|e| self.err(rel, "setting xattrs", e))
    }

    /// Copies the tree; returns the copy's root, for the flush.
    fn copy_tree(&mut self, src: &Path) -> Result<File, ArchiveError> {
        let src_root = open_dir(src).map_err(|e| self.err(b"", "opening the layer", e))?;
        std::fs::create_dir(self.temp).map_err(|e| self.err(b"", "creating the temp directory", e))?;
        let dst_root = open_dir(self.temp).map_err(|e| self.err(b"", "opening the temp directory", e))?;
        let stat = nix::sys::stat::fstat(src_root.as_raw_fd()).map_err(|e| self.err(b"", "stat", e))?;
        self.label(b"", &src_root, &dst_root, &stat)?;
        let names = list_names(&src_root).map_err(|e| self.err(b"", "listing", e))?;
        let root = dst_root
            .try_clone()
            .map_err(|e| self.err(b"", "duplicating a handle", e))?;
        let mut stack = vec![Frame {
            src: src_root,
            dst: dst_root,
            rel: Vec::new(),
            names: names.into_iter(),
            stat,
        }];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.next() else {
                let done = stack.pop().expect("a frame is on top");
                self.close(&done)?;
                continue;
            };
            let rel = join(&top.rel, &name);
            let st = stat_at(&top.src, &name).map_err(|e| self.err(&rel, "stat", e))?;
            self.done.entries += 1;
            let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            if kind == SFlag::S_IFDIR {
                let top = stack.last().expect("a frame is on top");
                mkdirat(
                    Some(top.dst.as_raw_fd()),
                    name.as_slice(),
                    Mode::from_bits_truncate(0o700),
                )
                .map_err(|e| self.err(&rel, "mkdir", e))?;
                let src = open_dir_at(&top.src, &name).map_err(|e| self.err(&rel, "opening", e))?;
                let dst = open_dir_at(&top.dst, &name).map_err(|e| self.err(&rel, "opening the copy", e))?;
                self.label(&rel, &src, &dst, &st)?;
                let names = list_names(&src).map_err(|e| self.err(&rel, "listing", e))?;
                stack.push(Frame {
                    src,
                    dst,
                    rel,
                    names: names.into_iter(),
                    stat: st,
                });
                continue;
            }
            let top = stack.last().expect("a frame is on top");
            self.copy_entry(top, &name, &rel, &st, kind)?;
        }
        Ok(root)
    }

    /// Applies a copied directory's mode and mtime, once its entries are in.
    fn close(&self, frame: &Frame) -> Result<(), ArchiveError> {
        fchmod(
            frame.dst.as_raw_fd(),
            Mode::from_bits_truncate(frame.stat.st_mode & 0o7777),
        )
        .map_err(|e| self.err(&frame.rel, "chmod", e))?;
        let t = timespec(frame.stat.st_mtime, frame.stat.st_mtime_nsec);
        futimens(frame.dst.as_raw_fd(), &t, &t).map_err(|e| self.err(&frame.rel, "setting the mtime", e))
    }

    fn copy_entry(
        &mut self,
        dir: &Frame,
        name: &[u8],
        rel: &[u8],
        st: &FileStat,
        kind: SFlag,
    ) -> Result<(), ArchiveError> {
        let mtime = timespec(st.st_mtime, st.st_mtime_nsec);
        let mode = Mode::from_bits_truncate(st.st_mode & 0o7777);
        if kind == SFlag::S_IFREG {
            if st.st_nlink > 1 {
                if let Some(first) = self.links.get(&(st.st_dev, st.st_ino)) {
                    let to = self.temp.join(OsStr::from_bytes(rel));
                    return linkat(None, first.as_path(), None, to.as_path(), AtFlags::empty())
                        .map_err(|e| self.err(rel, "creating the hard link", e));
                }
                self.links
                    .insert((st.st_dev, st.st_ino), self.temp.join(OsStr::from_bytes(rel)));
            }
            let mut src = open_file_at(&dir.src, name).map_err(|e| self.err(rel, "opening", e))?;
            let mut dst = create_file_at(&dir.dst, name).map_err(|e| self.err(rel, "creating the copy", e))?;
            let size = st.st_size as u64;
            // SAFETY: FICLONE takes the source descriptor as its argument;
            // both descriptors are open and ours.
            let cloned = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) } == 0;
            if cloned {
                self.done.reflinked += size;
            } else {
                io::copy(&mut src, &mut dst).map_err(|e| self.err(rel, "copying", e))?;
            }
            self.done.bytes += size;
            self.label(rel, &src, &dst, st)?;
            // After chown, which clears set-id bits.
            fchmod(dst.as_raw_fd(), mode).map_err(|e| self.err(rel, "chmod", e))?;
            return futimens(dst.as_raw_fd(), &mtime, &mtime).map_err(|e| self.err(rel, "setting the mtime", e));
        }
        let dst = dir.dst.as_raw_fd();
        match kind {
            SFlag::S_IFLNK => {
                let target = readlinkat(Some(dir.src.as_raw_fd()), name).map_err(|e| self.err(rel, "readlink", e))?;
                symlinkat(target.as_os_str(), Some(dst), name).map_err(|e| self.err(rel, "creating the symlink", e))?;
            }
            // overlayfs' whiteouts; a layer gives a sandbox no other device.
            SFlag::S_IFCHR if st.st_rdev == 0 => mknodat(
                Some(dst),
                name,
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o600),
                makedev(0, 0),
            )
            .map_err(|e| self.err(rel, "mknod", e))?,
            SFlag::S_IFIFO | SFlag::S_IFSOCK => mknodat(Some(dst), name, kind, Mode::from_bits_truncate(0o600), 0)
                .map_err(|e| self.err(rel, "mknod", e))?,
            _ => {
                self.done.entries -= 1;
                return Ok(());
            }
        }
        let (uid, gid) = self.owners(st);
        fchownat(Some(dst), name, uid, gid, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(|e| self.err(rel, "chown", e))?;
        let xattrs =
            dirfd::read_xattrs_at(&dirfd::proc_path(&dir.src, name)).map_err(|e| self.err(rel, "reading xattrs", e))?;
        dirfd::write_xattrs_at(&dirfd::proc_path(&dir.dst, name), &self.shifted(xattrs))
            .map_err(|e| self.err(rel, "setting xattrs", e))?;
        if kind != SFlag::S_IFLNK {
            // Not a symlink (just made), so following is safe.
            fchmodat(Some(dst), name, mode, FchmodatFlags::FollowSymlink).map_err(|e| self.err(rel, "chmod", e))?;
        }
        utimensat(Some(dst), name, &mtime, &mtime, UtimensatFlags::NoFollowSymlink)
            .map_err(|e| self.err(rel, "setting the mtime", e))
    }
}
