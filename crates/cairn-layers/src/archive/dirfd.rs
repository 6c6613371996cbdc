//! Directory-handle-relative file operations (`openat`, `fstatat`, …).
//!
//! Capture and materialise never build full paths for syscalls: a layer
//! may hold paths far longer than PATH_MAX (255-byte names, deep trees),
//! and resolving relative to an open directory also keeps a walk from
//! following a symlink out of the tree. Directory handles are `File`s.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::AtFlags;
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fstatat, FileStat, Mode};

use super::index::Xattr;

fn adopt(fd: RawFd) -> File {
    // SAFETY: `fd` was just returned by a successful openat and is owned by
    // nothing else; the File becomes its only owner and closes it once.
    unsafe { File::from_raw_fd(fd) }
}

/// Opens a directory by path without following a final symlink.
pub(super) fn open_dir(path: &Path) -> io::Result<File> {
    let fd = openat(
        None,
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(adopt(fd))
}

/// Opens the directory `name` inside `parent`, refusing symlinks.
pub(super) fn open_dir_at(parent: &File, name: &[u8]) -> io::Result<File> {
    let fd = openat(
        Some(parent.as_raw_fd()),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(adopt(fd))
}

/// Opens the regular file `name` inside `parent` for reading.
pub(super) fn open_file_at(parent: &File, name: &[u8]) -> io::Result<File> {
    let fd = openat(
        Some(parent.as_raw_fd()),
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK,
        Mode::empty(),
    )?;
    Ok(adopt(fd))
}

/// Creates the new regular file `name` inside `parent` (owner-only until
/// its recorded mode is applied).
pub(super) fn create_file_at(parent: &File, name: &[u8]) -> io::Result<File> {
    let fd = openat(
        Some(parent.as_raw_fd()),
        name,
        OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )?;
    Ok(adopt(fd))
}

/// `lstat` of `name` inside `parent`.
pub(super) fn stat_at(parent: &File, name: &[u8]) -> io::Result<FileStat> {
    Ok(fstatat(Some(parent.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)?)
}

/// Names in a directory except `.` and `..`, sorted bytewise so captures
/// are deterministic.
pub(super) fn list_names(dir: &File) -> io::Result<Vec<Vec<u8>>> {
    let mut d = nix::dir::Dir::openat(
        Some(dir.as_raw_fd()),
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in d.iter() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// A short path naming `name` in `parent` through `/proc/self/fd`, for the
/// few calls that have no `*at` form (`lgetxattr`, `lsetxattr`). The final
/// component is not followed by the `l*` calls.
pub(super) fn proc_path(parent: &File, name: &[u8]) -> PathBuf {
    let mut p = format!("/proc/self/fd/{}/", parent.as_raw_fd()).into_bytes();
    p.extend_from_slice(name);
    PathBuf::from(OsStr::from_bytes(&p))
}

fn sorted(mut xattrs: Vec<Xattr>) -> Vec<Xattr> {
    xattrs.sort();
    xattrs
}

/// All xattrs of an entry that cannot be opened (symlink, device, fifo),
/// by its `proc_path`.
pub(super) fn read_xattrs_at(path: &Path) -> io::Result<Vec<Xattr>> {
    let mut out = Vec::new();
    for name in xattr::list(path)? {
        // Vanishes between list and get only if the tree changes under us.
        if let Some(value) = xattr::get(path, &name)? {
            out.push(Xattr {
                name: name.as_bytes().to_vec(),
                value,
            });
        }
    }
    Ok(sorted(out))
}

/// All xattrs of an open file or directory.
pub(super) fn read_xattrs_fd(file: &File) -> io::Result<Vec<Xattr>> {
    use xattr::FileExt;
    let mut out = Vec::new();
    for name in file.list_xattr()? {
        if let Some(value) = file.get_xattr(&name)? {
            out.push(Xattr {
                name: name.as_bytes().to_vec(),
                value,
            });
        }
    }
    Ok(sorted(out))
}

pub(super) fn write_xattrs_at(path: &Path, xattrs: &[Xattr]) -> io::Result<()> {
    for x in xattrs {
        xattr::set(path, OsStr::from_bytes(&x.name), &x.value)?;
    }
    Ok(())
}

pub(super) fn write_xattrs_fd(file: &File, xattrs: &[Xattr]) -> io::Result<()> {
    use xattr::FileExt;
    for x in xattrs {
        file.set_xattr(OsStr::from_bytes(&x.name), &x.value)?;
    }
    Ok(())
}
