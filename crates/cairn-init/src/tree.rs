//! The file tree: list a directory, make directories, rename, remove.
//!
//! Listings and recursive removes work on open directory handles with the
//! `*at` calls and `O_NOFOLLOW`, so neither follows a symlink, whatever a
//! process in the sandbox swaps in meanwhile. Paths are absolute paths in
//! the sandbox, resolved from init's root as the other file operations do.

use std::ffi::CStr;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use cairn_protocol::{
    write_frame, DirEntry, FileKind, FileMeta, FrameError, FromInit, FsErrorKind, LIST_BYTES_MAX, LIST_DEPTH_MAX,
    LIST_ENTRIES_MAX,
};
use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{openat, readlinkat, renameat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

/// Deepest directory tree a recursive remove descends: each level holds a
/// directory handle open.
const REMOVE_DEPTH_MAX: u32 = 256;

/// A file operation refused, as sent to the host.
#[derive(Debug)]
pub struct Refusal {
    kind: FsErrorKind,
    message: String,
}

impl Refusal {
    fn new(kind: FsErrorKind, message: String) -> Refusal {
        Refusal { kind, message }
    }

    fn errno(e: Errno, what: String) -> Refusal {
        Refusal::new(kind_of(e), format!("{what}: {}", e.desc()))
    }

    fn into_frame(self) -> FromInit {
        FromInit::FsError {
            kind: self.kind,
            message: self.message,
        }
    }
}

fn kind_of(e: Errno) -> FsErrorKind {
    match e {
        Errno::ENOENT => FsErrorKind::NotFound,
        Errno::EEXIST => FsErrorKind::Exists,
        Errno::ENOTDIR => FsErrorKind::NotADirectory,
        Errno::EISDIR => FsErrorKind::IsADirectory,
        Errno::ENOTEMPTY => FsErrorKind::NotEmpty,
        Errno::EACCES | Errno::EPERM | Errno::EROFS => FsErrorKind::PermissionDenied,
        Errno::EINVAL | Errno::ENAMETOOLONG => FsErrorKind::Invalid,
        _ => FsErrorKind::Other,
    }
}

/// Writes `reply` (the operation's answer or its refusal) and flushes.
pub fn answer<W: Write>(writer: &mut W, reply: Result<FromInit, Refusal>) -> Result<(), FrameError> {
    write_frame(writer, &reply.unwrap_or_else(Refusal::into_frame))?;
    writer.flush()?;
    Ok(())
}

/// `path` without its trailing slashes, refused unless absolute; `""` is
/// the root.
fn absolute(path: &str) -> Result<&str, Refusal> {
    if !path.starts_with('/') {
        return Err(Refusal::new(
            FsErrorKind::Invalid,
            format!("{path:?} is not an absolute path in the sandbox"),
        ));
    }
    if path.contains('\0') {
        return Err(Refusal::new(
            FsErrorKind::Invalid,
            format!("{path:?} contains a NUL byte"),
        ));
    }
    Ok(path.trim_end_matches('/'))
}

/// `path` as its parent directory and its last name, which is neither `.`
/// nor `..`; the root has neither.
fn split(path: &str) -> Result<(&str, &str), Refusal> {
    let trimmed = absolute(path)?;
    let Some((parent, name)) = trimmed.rsplit_once('/') else {
        return Err(Refusal::new(
            FsErrorKind::Invalid,
            format!("{path} is the sandbox's root; the operation needs a path below it"),
        ));
    };
    if name == "." || name == ".." {
        return Err(Refusal::new(
            FsErrorKind::Invalid,
            format!("{path:?} ends in {name:?}; name the file itself"),
        ));
    }
    Ok((if parent.is_empty() { "/" } else { parent }, name))
}

fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned by a successful openat and nothing else
    // owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The directory at `path` as a handle for `*at` calls (the path's own
/// symlinks followed, as any path lookup in the sandbox does).
fn open_parent(path: &str) -> Result<OwnedFd, Refusal> {
    openat(
        None,
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(owned)
    .map_err(|e| Refusal::errno(e, format!("cannot open the directory {path}")))
}

/// Opens `name` in `dir` for reading its entries, refusing a symlink.
fn open_dir_nofollow<P: ?Sized + nix::NixPath>(dir: Option<RawFd>, name: &P) -> nix::Result<Dir> {
    Dir::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

fn kind_of_mode(mode: u32) -> FileKind {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => FileKind::File,
        SFlag::S_IFDIR => FileKind::Dir,
        SFlag::S_IFLNK => FileKind::Symlink,
        _ => FileKind::Other,
    }
}

fn meta_of_stat(path: String, st: &FileStat) -> FileMeta {
    FileMeta {
        path,
        kind: kind_of_mode(st.st_mode),
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        size: st.st_size.max(0) as u64,
        mtime_ns: st.st_mtime as i128 * 1_000_000_000 + st.st_mtime_nsec as i128,
    }
}

fn is_dot(name: &CStr) -> bool {
    matches!(name.to_bytes(), b"." | b"..")
}

/// Answers [`cairn_protocol::ToInit::ListDir`]: entry frames as they are
/// read (never the whole directory in memory), then the end.
pub fn list<W: Write>(path: &str, depth: u32, max_entries: u32, writer: &mut W) -> Result<(), FrameError> {
    let mut lister = Lister {
        writer,
        left: max_entries,
        bytes: 0,
        truncated: false,
    };
    let reply = match lister.list(path, depth, max_entries) {
        Ok(()) => Ok(FromInit::EntriesEnd {
            truncated: lister.truncated,
        }),
        Err(Failure::Frame(e)) => return Err(e),
        Err(Failure::Refused(r)) => Err(r),
    };
    answer(lister.writer, reply)
}

enum Failure {
    Frame(FrameError),
    Refused(Refusal),
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Failure {
        Failure::Refused(r)
    }
}

struct Lister<'a, W> {
    writer: &'a mut W,
    /// Entries still allowed.
    left: u32,
    /// Bytes of paths and targets sent.
    bytes: usize,
    truncated: bool,
}

impl<W: Write> Lister<'_, W> {
    fn list(&mut self, path: &str, depth: u32, max_entries: u32) -> Result<(), Failure> {
        if !(1..=LIST_DEPTH_MAX).contains(&depth) {
            return Err(Refusal::new(
                FsErrorKind::Invalid,
                format!("a listing's depth is 1 to {LIST_DEPTH_MAX}, not {depth}"),
            )
            .into());
        }
        if !(1..=LIST_ENTRIES_MAX).contains(&max_entries) {
            return Err(Refusal::new(
                FsErrorKind::Invalid,
                format!("a listing returns 1 to {LIST_ENTRIES_MAX} entries, not {max_entries}"),
            )
            .into());
        }
        let trimmed = absolute(path)?;
        let top = if trimmed.is_empty() { "/" } else { trimmed };
        let dir = open_dir_nofollow(None, top).map_err(|e| match fstatat(None, top, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) if kind_of_mode(st.st_mode) == FileKind::Symlink => Refusal::new(
                FsErrorKind::NotADirectory,
                format!("{path} is a symbolic link, which a listing does not follow"),
            ),
            Ok(st) if kind_of_mode(st.st_mode) != FileKind::Dir => {
                Refusal::new(FsErrorKind::NotADirectory, format!("{path} is not a directory"))
            }
            _ => Refusal::errno(e, format!("cannot list {path}")),
        })?;
        self.walk(dir, trimmed, depth)
    }

    /// Sends the entries of `dir` (whose path is `prefix`), and those below
    /// them down to `depth` levels.
    fn walk(&mut self, mut dir: Dir, prefix: &str, depth: u32) -> Result<(), Failure> {
        let fd = dir.as_raw_fd();
        for entry in dir.iter() {
            let entry = entry.map_err(|e| Refusal::errno(e, format!("cannot read the directory {prefix}/")))?;
            let name = entry.file_name();
            if is_dot(name) {
                continue;
            }
            let path = format!("{prefix}/{}", String::from_utf8_lossy(name.to_bytes()));
            let st = match fstatat(Some(fd), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed since the directory was read.
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(Refusal::errno(e, format!("cannot stat {path}")).into()),
            };
            let meta = meta_of_stat(path, &st);
            let symlink_target = match meta.kind {
                FileKind::Symlink => readlinkat(Some(fd), name)
                    .ok()
                    .map(|t| t.to_string_lossy().into_owned()),
                _ => None,
            };
            let size = meta.path.len() + symlink_target.as_ref().map_or(0, String::len);
            if self.left == 0 || self.bytes + size > LIST_BYTES_MAX {
                self.truncated = true;
                return Ok(());
            }
            self.left -= 1;
            self.bytes += size;
            let below = (meta.kind == FileKind::Dir && depth > 1).then(|| meta.path.clone());
            let entry = FromInit::Entry(DirEntry { meta, symlink_target });
            write_frame(self.writer, &entry).map_err(Failure::Frame)?;
            if let Some(below) = below {
                match open_dir_nofollow(Some(fd), name) {
                    Ok(child) => self.walk(child, &below, depth - 1)?,
                    // Removed, or swapped for something else, since read.
                    Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => {}
                    Err(e) => return Err(Refusal::errno(e, format!("cannot list {below}")).into()),
                }
                if self.truncated {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// Makes the directory `path`; whether it was created (false: a directory
/// was already there).
pub fn make_dir(path: &str, parents: bool) -> Result<FromInit, Refusal> {
    let trimmed = absolute(path)?;
    if trimmed.is_empty() {
        return Ok(FromInit::Made { created: false });
    }
    let (parent, _) = split(path)?;
    let mode = Mode::from_bits_truncate(0o755);
    if parents {
        let mut at = String::new();
        for name in parent.split('/').filter(|n| !n.is_empty()) {
            if name == "." || name == ".." {
                return Err(Refusal::new(
                    FsErrorKind::Invalid,
                    format!("{path:?} has a {name:?} in it; name the directories themselves"),
                ));
            }
            at.push('/');
            at.push_str(name);
            match mkdirat(None, at.as_str(), mode) {
                Ok(()) => {}
                // A directory, or a symlink to one, as `mkdir -p` accepts.
                Err(Errno::EEXIST) if std::path::Path::new(&at).is_dir() => {}
                Err(Errno::EEXIST) => {
                    return Err(Refusal::new(
                        FsErrorKind::NotADirectory,
                        format!("cannot make {path}: {at} is in the way and is not a directory"),
                    ))
                }
                Err(e) => return Err(Refusal::errno(e, format!("cannot make the directory {at}"))),
            }
        }
    }
    match mkdirat(None, trimmed, mode) {
        Ok(()) => Ok(FromInit::Made { created: true }),
        Err(Errno::EEXIST) => match fstatat(None, trimmed, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) if kind_of_mode(st.st_mode) == FileKind::Dir => Ok(FromInit::Made { created: false }),
            _ => Err(Refusal::new(
                FsErrorKind::Exists,
                format!("cannot make the directory {path}: something that is not a directory is there"),
            )),
        },
        Err(Errno::ENOENT) => Err(Refusal::new(
            FsErrorKind::NotFound,
            format!("cannot make the directory {path}: {parent} does not exist (ask for parents to make it)"),
        )),
        Err(e) => Err(Refusal::errno(e, format!("cannot make the directory {path}"))),
    }
}

/// Renames `from` to `to` as rename(2) does.
pub fn rename(from: &str, to: &str) -> Result<FromInit, Refusal> {
    split(from)?;
    split(to)?;
    match renameat(None, from, None, to) {
        Ok(()) => Ok(FromInit::Done),
        // rename(2) answers either for a directory that is not empty.
        Err(Errno::ENOTEMPTY | Errno::EEXIST) => Err(Refusal::new(
            FsErrorKind::NotEmpty,
            format!("cannot rename {from} to {to}: {to} is a directory that is not empty"),
        )),
        Err(e) => Err(Refusal::errno(e, format!("cannot rename {from} to {to}"))),
    }
}

/// Removes `path`: a file or symlink, an empty directory, or with
/// `recursive` a whole tree on `path`'s file system.
pub fn remove(path: &str, recursive: bool) -> Result<FromInit, Refusal> {
    let (parent, name) = split(path)?;
    let parent_fd = open_parent(parent)?;
    let pfd = parent_fd.as_raw_fd();
    match unlinkat(Some(pfd), name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) => return Ok(FromInit::Done),
        // Linux answers EISDIR for a directory, POSIX allows EPERM.
        Err(Errno::EISDIR | Errno::EPERM) if is_directory(pfd, name) => {}
        Err(e) => return Err(Refusal::errno(e, format!("cannot remove {path}"))),
    }
    if recursive {
        let dir = open_dir_nofollow(Some(pfd), name).map_err(|e| Refusal::errno(e, format!("cannot open {path}")))?;
        let device = fstat(dir.as_raw_fd())
            .map_err(|e| Refusal::errno(e, format!("cannot stat {path}")))?
            .st_dev;
        let parent_device = fstat(pfd)
            .map_err(|e| Refusal::errno(e, format!("cannot stat {parent}")))?
            .st_dev;
        if device != parent_device {
            return Err(mount_point(path));
        }
        empty(dir, path.trim_end_matches('/'), device, 1)?;
    }
    match unlinkat(Some(pfd), name, UnlinkatFlags::RemoveDir) {
        Ok(()) => Ok(FromInit::Done),
        Err(Errno::ENOTEMPTY | Errno::EEXIST) => Err(Refusal::new(
            FsErrorKind::NotEmpty,
            format!("cannot remove {path}: it is a directory that is not empty (ask for a recursive remove)"),
        )),
        Err(e) => Err(Refusal::errno(e, format!("cannot remove the directory {path}"))),
    }
}

fn is_directory(dir: RawFd, name: &str) -> bool {
    fstatat(Some(dir), name, AtFlags::AT_SYMLINK_NOFOLLOW).is_ok_and(|st| kind_of_mode(st.st_mode) == FileKind::Dir)
}

fn mount_point(path: &str) -> Refusal {
    Refusal::new(
        FsErrorKind::Invalid,
        format!("{path} is a mount point; a remove does not cross into another file system"),
    )
}

/// Removes everything in `dir` (whose path is `path`): symlinks are removed
/// themselves, directories emptied through handles opened without following
/// a symlink, and a directory on another device (a mount) is refused.
fn empty(mut dir: Dir, path: &str, device: u64, level: u32) -> Result<(), Refusal> {
    if level > REMOVE_DEPTH_MAX {
        return Err(Refusal::new(
            FsErrorKind::Invalid,
            format!("{path} is more than {REMOVE_DEPTH_MAX} directories deep; a remove stops there"),
        ));
    }
    let fd = dir.as_raw_fd();
    for entry in dir.iter() {
        let entry = entry.map_err(|e| Refusal::errno(e, format!("cannot read the directory {path}")))?;
        let name = entry.file_name();
        if is_dot(name) {
            continue;
        }
        let child_path = format!("{path}/{}", String::from_utf8_lossy(name.to_bytes()));
        let unlinked = match unlinkat(Some(fd), name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => continue,
            Err(e) => e,
        };
        let child = match open_dir_nofollow(Some(fd), name) {
            Ok(child) => child,
            // Not a directory after all: the unlink's answer stands.
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                return Err(Refusal::errno(unlinked, format!("cannot remove {child_path}")))
            }
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(Refusal::errno(e, format!("cannot open {child_path}"))),
        };
        let child_device = fstat(child.as_raw_fd())
            .map_err(|e| Refusal::errno(e, format!("cannot stat {child_path}")))?
            .st_dev;
        if child_device != device {
            return Err(mount_point(&child_path));
        }
        empty(child, &child_path, device, level + 1)?;
        match unlinkat(Some(fd), name, UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => return Err(Refusal::errno(e, format!("cannot remove the directory {child_path}"))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_parent_and_name_and_bad_ones_are_invalid() {
        assert_eq!(split("/a/b/").unwrap(), ("/a", "b"));
        assert_eq!(split("/a").unwrap(), ("/", "a"));
        for bad in ["a/b", "", "/", "//", "/a/..", "/a/.", "/a\0b"] {
            let refusal = split(bad).unwrap_err();
            assert_eq!(refusal.kind, FsErrorKind::Invalid, "{bad:?}: {}", refusal.message);
        }
    }
}
