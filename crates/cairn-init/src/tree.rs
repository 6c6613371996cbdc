//! The file tree: list a directory, make directories, rename, remove.
//!
//! Paths are opened as [`resolve`] opens them: from the sandbox's root, no
//! symbolic link followed, init's own `/proc` entries refused. Below that,
//! listings and recursive removes work on open directory handles with the
//! `*at` calls and `O_NOFOLLOW`, so neither follows a symlink, whatever a
//! process in the sandbox swaps in meanwhile.

use std::ffi::CStr;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use cairn_protocol::{
    write_frame, DirEntry, FileKind, FileMeta, FrameError, FromInit, FsErrorKind, LIST_BYTES_MAX, LIST_DEPTH_MAX,
    LIST_ENTRIES_MAX,
};
use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{openat, readlinkat, renameat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

use crate::resolve::{self, answer, Refusal, SandboxPath, Unresolved};

/// Deepest directory tree a recursive remove descends: each level holds a
/// directory handle open.
const REMOVE_DEPTH_MAX: u32 = 256;

/// Opens `name` in `dir` for reading its entries, refusing a symlink.
fn open_dir_nofollow<P: ?Sized + nix::NixPath>(dir: RawFd, name: &P) -> nix::Result<OwnedFd> {
    openat(
        Some(dir),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(resolve::owned)
}

/// `fd`, a directory opened for reading, as a handle on its entries.
fn entries(fd: OwnedFd) -> nix::Result<Dir> {
    Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(fd))
}

fn kind_of_mode(mode: u32) -> FileKind {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => FileKind::File,
        SFlag::S_IFDIR => FileKind::Dir,
        SFlag::S_IFLNK => FileKind::Symlink,
        _ => FileKind::Other,
    }
}

pub(crate) fn meta_of_stat(path: String, st: &FileStat) -> FileMeta {
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

/// Whether `name` in the /proc directory `dir` is init's own entry, which
/// a listing leaves out.
fn is_inits_own(dir: RawFd, name: &CStr) -> bool {
    name.to_str().is_ok_and(resolve::is_pid_name)
        && openat(
            Some(dir),
            name,
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(resolve::owned)
        .is_ok_and(|entry| resolve::is_init_task(&entry))
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
        let parsed = SandboxPath::parse(path)?;
        let what = format!("cannot list {path}");
        let dir = resolve::open(&parsed, OFlag::O_RDONLY | OFlag::O_DIRECTORY).map_err(|e| match e {
            Unresolved::Symlink(link) if link == parsed.to_string() => Refusal::new(
                FsErrorKind::NotADirectory,
                format!("{path} is a symbolic link, which a listing does not follow"),
            ),
            Unresolved::Errno(Errno::ENOTDIR) => {
                Refusal::new(FsErrorKind::NotADirectory, format!("{path} is not a directory"))
            }
            e => e.refusal(&what),
        })?;
        // Entries are named below the path as asked (the host checks that).
        self.walk(dir, path.trim_end_matches('/'), depth)
    }

    /// Sends the entries of `dir` (whose path is `prefix`), and those below
    /// them down to `depth` levels.
    fn walk(&mut self, dir: OwnedFd, prefix: &str, depth: u32) -> Result<(), Failure> {
        let in_proc = resolve::on_procfs(&dir);
        let mut dir = entries(dir).map_err(|e| Refusal::errno(e, format!("cannot read the directory {prefix}/")))?;
        let fd = dir.as_raw_fd();
        for entry in dir.iter() {
            let entry = entry.map_err(|e| Refusal::errno(e, format!("cannot read the directory {prefix}/")))?;
            let name = entry.file_name();
            if is_dot(name) || (in_proc && is_inits_own(fd, name)) {
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
                match open_dir_nofollow(fd, name) {
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
/// was already there). With `parents`, missing directories on the way are
/// made too; a symbolic link on the way is refused, not followed.
/// Each directory made has mode 0755 whatever init's umask, and is owned
/// by `owner` when given.
pub fn make_dir(path: &str, parents: bool, owner: Option<cairn_protocol::Ids>) -> Result<FromInit, Refusal> {
    if SandboxPath::parse(path)?.names().is_empty() {
        return Ok(FromInit::Made { created: false });
    }
    let (dir, name) = SandboxPath::parse_named(path)?;
    if parents {
        for (count, &on_the_way) in dir.names().iter().enumerate() {
            let above = dir.first(count);
            let at = dir.first(count + 1);
            match make_one(&above, on_the_way, path, owner)? {
                Made::Created | Made::There => {}
                Made::Link => {
                    return Err(Unresolved::Symlink(at.to_string()).refusal(&format!("cannot make {path}")));
                }
                Made::Other => {
                    return Err(Refusal::new(
                        FsErrorKind::NotADirectory,
                        format!("cannot make {path}: {at} is in the way and is not a directory"),
                    ))
                }
            }
        }
    }
    match make_one(&dir, name, path, owner)? {
        Made::Created => Ok(FromInit::Made { created: true }),
        Made::There => Ok(FromInit::Made { created: false }),
        Made::Link | Made::Other => Err(Refusal::new(
            FsErrorKind::Exists,
            format!(
                "cannot make the directory {path}: something that is not a directory (a file, or a symbolic \
                 link, which is not followed) is there"
            ),
        )),
    }
}

enum Made {
    Created,
    /// A directory was there already.
    There,
    /// A symbolic link is there (not followed).
    Link,
    /// Something else is there.
    Other,
}

/// Makes `name` in `dir`, a step of making `path`.
fn make_one(dir: &SandboxPath, name: &str, path: &str, owner: Option<cairn_protocol::Ids>) -> Result<Made, Refusal> {
    let parent = resolve::open_parent(dir, name).map_err(|e| match e {
        Unresolved::Errno(Errno::ENOENT) => Refusal::new(
            FsErrorKind::NotFound,
            format!("cannot make the directory {path}: {dir} does not exist (ask for parents to make it)"),
        ),
        e => e.refusal(&format!("cannot make the directory {path}")),
    })?;
    match mkdirat(Some(parent.as_raw_fd()), name, Mode::from_bits_truncate(0o755)) {
        Ok(()) => {
            // Through a handle on what was made (never a link put in its
            // place since): 0755, not what init's umask left, and its owner.
            let made = open_dir_nofollow(parent.as_raw_fd(), name)
                .map_err(|e| Refusal::errno(e, format!("cannot make the directory {path}")))?;
            let set =
                nix::sys::stat::fchmod(made.as_raw_fd(), Mode::from_bits_truncate(0o755)).and_then(|()| match owner {
                    Some(ids) => nix::unistd::fchown(
                        made.as_raw_fd(),
                        Some(nix::unistd::Uid::from_raw(ids.uid)),
                        Some(nix::unistd::Gid::from_raw(ids.gid)),
                    ),
                    None => Ok(()),
                });
            set.map_err(|e| Refusal::errno(e, format!("cannot set the mode and owner of {path}")))?;
            Ok(Made::Created)
        }
        Err(Errno::EEXIST) => Ok(
            match fstatat(Some(parent.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
                .map(|st| resolve::file_type(&st))
            {
                Ok(SFlag::S_IFDIR) => Made::There,
                Ok(SFlag::S_IFLNK) => Made::Link,
                _ => Made::Other,
            },
        ),
        Err(e) => Err(Refusal::errno(e, format!("cannot make the directory {path}"))),
    }
}

/// Renames `from` to `to` as rename(2) does, except that neither path's
/// directories are reached through a symbolic link.
pub fn rename(from: &str, to: &str) -> Result<FromInit, Refusal> {
    let (from_dir, from_name) = SandboxPath::parse_named(from)?;
    let (to_dir, to_name) = SandboxPath::parse_named(to)?;
    let what = format!("cannot rename {from} to {to}");
    let from_fd = resolve::open_parent(&from_dir, from_name).map_err(|e| e.refusal(&what))?;
    let to_fd = resolve::open_parent(&to_dir, to_name).map_err(|e| e.refusal(&what))?;
    match renameat(Some(from_fd.as_raw_fd()), from_name, Some(to_fd.as_raw_fd()), to_name) {
        Ok(()) => Ok(FromInit::Done),
        // rename(2) answers either for a directory that is not empty.
        Err(Errno::ENOTEMPTY | Errno::EEXIST) => Err(Refusal::new(
            FsErrorKind::NotEmpty,
            format!("{what}: {to} is a directory that is not empty"),
        )),
        Err(e) => Err(Refusal::errno(e, what)),
    }
}

/// Removes `path`: a file or symlink, an empty directory, or with
/// `recursive` a whole tree on `path`'s file system.
pub fn remove(path: &str, recursive: bool) -> Result<FromInit, Refusal> {
    let (parent, name) = SandboxPath::parse_named(path)?;
    let parent_fd = resolve::open_parent(&parent, name).map_err(|e| e.refusal(&format!("cannot remove {path}")))?;
    let pfd = parent_fd.as_raw_fd();
    match unlinkat(Some(pfd), name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) => return Ok(FromInit::Done),
        // Linux answers EISDIR for a directory, POSIX allows EPERM.
        Err(Errno::EISDIR | Errno::EPERM) if is_directory(pfd, name) => {}
        Err(e) => return Err(Refusal::errno(e, format!("cannot remove {path}"))),
    }
    if recursive {
        let dir = open_dir_nofollow(pfd, name)
            .and_then(entries)
            .map_err(|e| Refusal::errno(e, format!("cannot open {path}")))?;
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
        let child = match open_dir_nofollow(fd, name).and_then(entries) {
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

/// The names in `fd` (a directory opened for reading), each with whether
/// it is a directory, never following a symlink; names that are not UTF-8
/// are left out.
pub(crate) fn children(fd: OwnedFd) -> nix::Result<Vec<(String, bool)>> {
    use nix::dir::Type;
    let raw = fd.as_raw_fd();
    let mut dir = entries(fd)?;
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry?;
        let Ok(name) = entry.file_name().to_str() else { continue };
        if name == "." || name == ".." {
            continue;
        }
        let is_dir = match entry.file_type() {
            Some(t) => t == Type::Directory,
            None => fstatat(Some(raw), entry.file_name(), AtFlags::AT_SYMLINK_NOFOLLOW)
                .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR),
        };
        names.push((name.to_string(), is_dir));
    }
    Ok(names)
}
