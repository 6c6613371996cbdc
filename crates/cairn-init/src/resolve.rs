//! Paths in the sandbox, opened from its root without following a symbolic
//! link, for the file operations the host asks for; and how those
//! operations are refused.
//!
//! A process in the sandbox may rename, exchange or replace any name while
//! init works, so a path is never checked and then opened by name: it is
//! opened once, and what was opened is checked through its descriptor.
//! Where the kernel has `openat2` the whole path is opened in one call with
//! `RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`; where it
//! has not (gVisor's kernel may answer ENOSYS) each name is opened from the
//! previous directory's descriptor with `O_PATH | O_NOFOLLOW`, and a
//! symbolic link anywhere but at the end is refused. `.` and `..` are taken
//! as names of the path (`/a/b/../c` is `/a/c`, as `filepath.Clean` and
//! envd take it), never given to the kernel, so nothing climbs above the
//! root whatever is renamed meanwhile.
//!
//! Init serves these operations as itself, and a thread of init may read
//! init's own `/proc` entries, which no process in the sandbox may (init is
//! non-dumpable): its memory map, its descriptors (the host path of the
//! console log among them), its environment. So `/proc/<pid>` of init and
//! of each of its threads, and everything below them, are refused, and left
//! out of listings; `/proc/self` and `/proc/thread-self` are symbolic links
//! and refused as such. The check is made on the opened `/proc/<n>`
//! directory, which stays bound to its task, so a pid reused meanwhile
//! cannot slip through.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use cairn_protocol::{write_frame, FrameError, FromInit, FsErrorKind};
use nix::errno::Errno;
use nix::fcntl::{openat, openat2, AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode, SFlag};
use nix::sys::statfs::{fstatfs, PROC_SUPER_MAGIC};

/// A file operation refused, as sent to the host.
#[derive(Debug)]
pub struct Refusal {
    pub(crate) kind: FsErrorKind,
    pub(crate) message: String,
}

impl Refusal {
    pub(crate) fn new(kind: FsErrorKind, message: String) -> Refusal {
        Refusal { kind, message }
    }

    pub(crate) fn errno(e: Errno, what: String) -> Refusal {
        Refusal::new(kind_of(e), format!("{what}: {}", e.desc()))
    }

    pub(crate) fn into_frame(self) -> FromInit {
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

/// An absolute path in the sandbox, checked: its names, with `.` and `..`
/// taken (a `..` at the root stays there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPath<'a> {
    names: Vec<&'a str>,
}

impl<'a> SandboxPath<'a> {
    /// `path`, refused unless absolute and free of NUL bytes.
    pub fn parse(path: &'a str) -> Result<SandboxPath<'a>, Refusal> {
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
        let mut names = Vec::new();
        for name in path.split('/') {
            match name {
                "" | "." => {}
                ".." => {
                    names.pop();
                }
                _ => names.push(name),
            }
        }
        Ok(SandboxPath { names })
    }

    /// `path`, which must name something below the root and not end in `.`
    /// or `..` (as `rm` and `mv` refuse them), as its directory and its
    /// last name.
    pub fn parse_named(path: &'a str) -> Result<(SandboxPath<'a>, &'a str), Refusal> {
        let mut parsed = SandboxPath::parse(path)?;
        let last = path.trim_end_matches('/').rsplit('/').next().unwrap_or("");
        if last == "." || last == ".." {
            return Err(Refusal::new(
                FsErrorKind::Invalid,
                format!("{path:?} ends in {last:?}; name the file itself"),
            ));
        }
        let Some(name) = parsed.names.pop() else {
            return Err(Refusal::new(
                FsErrorKind::Invalid,
                format!("{path} is the sandbox's root; the operation needs a path below it"),
            ));
        };
        Ok((parsed, name))
    }

    pub fn names(&self) -> &[&'a str] {
        &self.names
    }

    /// The path of its first `count` names.
    pub fn first(&self, count: usize) -> SandboxPath<'a> {
        SandboxPath {
            names: self.names[..count].to_vec(),
        }
    }
}

/// The path as it resolves (`/a/c` for `/a/b/../c`), `/` for the root.
impl std::fmt::Display for SandboxPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.names.is_empty() {
            return f.write_str("/");
        }
        for name in &self.names {
            write!(f, "/{name}")?;
        }
        Ok(())
    }
}

/// Why a path could not be opened.
#[derive(Debug, PartialEq, Eq)]
pub enum Unresolved {
    /// This name on the way (or at the end, where the operation does not
    /// take a symbolic link) is a symbolic link.
    Symlink(String),
    /// This name is init's own `/proc` entry.
    InitsOwn(String),
    Errno(Errno),
}

impl Unresolved {
    /// The refusal of the operation `what` ("cannot read /tmp/x").
    pub fn refusal(self, what: &str) -> Refusal {
        match self {
            Unresolved::Symlink(link) => Refusal::new(
                FsErrorKind::Invalid,
                format!("{what}: {link} is a symbolic link, and file operations never follow one"),
            ),
            Unresolved::InitsOwn(entry) => Refusal::new(
                FsErrorKind::PermissionDenied,
                format!(
                    "{what}: {entry} is the /proc entry of the sandbox's init (PID 1, which serves file \
                     operations), which file operations do not reach"
                ),
            ),
            Unresolved::Errno(e) => Refusal::errno(e, what.to_string()),
        }
    }
}

impl From<Errno> for Unresolved {
    fn from(e: Errno) -> Unresolved {
        Unresolved::Errno(e)
    }
}

/// How a path is opened: the whole of it by `openat2`, or name by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Openat2,
    Walk,
}

/// False once `openat2` answered ENOSYS: this kernel (gVisor's, or Linux
/// before 5.6) has none, and every later path is walked.
static HAS_OPENAT2: AtomicBool = AtomicBool::new(true);

fn way() -> Way {
    if HAS_OPENAT2.load(Ordering::Relaxed) {
        Way::Openat2
    } else {
        Way::Walk
    }
}

/// Opens `path` with `flags` (`O_NOFOLLOW` and `O_CLOEXEC` added): nothing
/// on the way is a symbolic link, and with `O_PATH` the last name may be
/// one (opened itself), otherwise it may not.
pub fn open(path: &SandboxPath, flags: OFlag) -> Result<OwnedFd, Unresolved> {
    open_in(&root()?, path, flags, way())
}

/// Opens the directory `dir` (`O_PATH`) for the `*at` calls on `name`, a
/// name in it, refusing `name` when it is init's own `/proc` entry.
pub fn open_parent(dir: &SandboxPath, name: &str) -> Result<OwnedFd, Unresolved> {
    parent_in(&root()?, dir, name, way())
}

fn root() -> Result<OwnedFd, Unresolved> {
    Ok(owned(openat(
        None,
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?))
}

fn parent_in(root: &OwnedFd, dir: &SandboxPath, name: &str, way: Way) -> Result<OwnedFd, Unresolved> {
    let parent = open_in(root, dir, OFlag::O_PATH | OFlag::O_DIRECTORY, way)?;
    if is_pid_name(name) && on_procfs(&parent) {
        if let Ok(entry) = openat_nofollow(&parent, name, OFlag::O_PATH) {
            if is_init_task(&entry) {
                return Err(Unresolved::InitsOwn(format!(
                    "{}/{name}",
                    dir.to_string().trim_end_matches('/')
                )));
            }
        }
    }
    Ok(parent)
}

fn open_in(root: &OwnedFd, path: &SandboxPath, flags: OFlag, way: Way) -> Result<OwnedFd, Unresolved> {
    if way == Way::Openat2 {
        let how = OpenHow::new()
            .flags(flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS,
            );
        let relative = if path.names.is_empty() {
            ".".to_string()
        } else {
            path.names.join("/")
        };
        match openat2(root.as_raw_fd(), relative.as_str(), how).map(owned) {
            // A /proc path is walked again, to check each pid on the way.
            Ok(fd) if !on_procfs(&fd) => return Ok(fd),
            Ok(_) => {}
            Err(Errno::ENOSYS) => HAS_OPENAT2.store(false, Ordering::Relaxed),
            // A failure is walked again too, to say why in the sandbox's
            // terms: which name is a link, or init's (openat2 answers ELOOP
            // or ENOTDIR for a link, EACCES for some of init's entries).
            Err(_) => {}
        }
    }
    walk(root, path, flags)
}

/// Opens `path` name by name from `root`.
fn walk(root: &OwnedFd, path: &SandboxPath, flags: OFlag) -> Result<OwnedFd, Unresolved> {
    if path.names.is_empty() {
        return Ok(openat_nofollow(root, ".", flags)?);
    }
    let mut opened: Option<OwnedFd> = None;
    for (i, name) in path.names.iter().enumerate() {
        let dir = opened.as_ref().unwrap_or(root);
        let is_last = i + 1 == path.names.len();
        let guarded = is_pid_name(name) && on_procfs(dir);
        let fd = match openat_nofollow(dir, name, if is_last { flags } else { OFlag::O_PATH }) {
            Ok(fd) => fd,
            // Only the last name is opened without O_PATH (or with
            // O_DIRECTORY), where a symbolic link answers ELOOP (ENOTDIR).
            Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
                let link = fstatat(Some(dir.as_raw_fd()), *name, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| file_type(&st) == SFlag::S_IFLNK);
                return Err(if link {
                    Unresolved::Symlink(path.first(i + 1).to_string())
                } else {
                    e.into()
                });
            }
            Err(e) => return Err(e.into()),
        };
        if guarded && is_init_task(&fd) {
            return Err(Unresolved::InitsOwn(path.first(i + 1).to_string()));
        }
        if !is_last {
            match file_type(&fstat(fd.as_raw_fd())?) {
                SFlag::S_IFDIR => {}
                SFlag::S_IFLNK => return Err(Unresolved::Symlink(path.first(i + 1).to_string())),
                _ => return Err(Errno::ENOTDIR.into()),
            }
        }
        opened = Some(fd);
    }
    Ok(opened.expect("a path with names opened its last"))
}

fn openat_nofollow(dir: &OwnedFd, name: &str, flags: OFlag) -> nix::Result<OwnedFd> {
    openat(
        Some(dir.as_raw_fd()),
        name,
        flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map(owned)
}

pub(crate) fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned by a successful open and nothing else
    // owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

pub(crate) fn file_type(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

/// What a file that is not a regular file is, for a refusal naming it.
pub(crate) fn type_name(st: &FileStat) -> &'static str {
    match file_type(st) {
        SFlag::S_IFDIR => "a directory",
        SFlag::S_IFLNK => "a symbolic link",
        SFlag::S_IFIFO => "a FIFO",
        SFlag::S_IFSOCK => "a socket",
        SFlag::S_IFCHR => "a character device",
        SFlag::S_IFBLK => "a block device",
        SFlag::S_IFREG => "a regular file",
        _ => "a file of unknown type",
    }
}

/// A name `/proc` gives a process or thread.
pub(crate) fn is_pid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 10 && name.bytes().all(|b| b.is_ascii_digit())
}

pub(crate) fn on_procfs(fd: &OwnedFd) -> bool {
    fstatfs(fd).is_ok_and(|s| s.filesystem_type() == PROC_SUPER_MAGIC)
}

/// Whether `dir`, opened as `/proc/<n>`, is the directory of init or of
/// one of its threads: its `status` names init's pid as the thread group.
/// The descriptor stays bound to the task it was opened for (a dead one's
/// entries answer ENOENT), so the answer holds for what is opened through
/// it. Anything else in /proc with a numeric name has no `status`.
pub(crate) fn is_init_task(dir: &OwnedFd) -> bool {
    let Ok(status) = openat_nofollow(dir, "status", OFlag::O_RDONLY | OFlag::O_NONBLOCK) else {
        return false;
    };
    let mut text = Vec::with_capacity(1024);
    if std::fs::File::from(status).take(4096).read_to_end(&mut text).is_err() {
        return false;
    }
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|line| line.strip_prefix("Tgid:"))
        .and_then(|tgid| tgid.trim().parse::<u32>().ok())
        .is_some_and(|tgid| tgid == std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const WAYS: [Way; 2] = [Way::Openat2, Way::Walk];

    fn opened_in(root: &OwnedFd, path: &str, flags: OFlag, way: Way) -> Result<FileStat, Unresolved> {
        let fd = open_in(root, &SandboxPath::parse(path).unwrap(), flags, way)?;
        Ok(fstat(fd.as_raw_fd()).unwrap())
    }

    fn dir_fd(path: &std::path::Path) -> OwnedFd {
        owned(
            openat(
                None,
                path,
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .unwrap(),
        )
    }

    #[test]
    fn paths_take_dot_and_dot_dot_as_names_and_bad_ones_are_invalid() {
        let names = |p| SandboxPath::parse(p).unwrap().names;
        assert_eq!(names("/a/./b//c/"), ["a", "b", "c"]);
        assert_eq!(names("/a/b/../c"), ["a", "c"]);
        assert_eq!(names("/../../etc"), ["etc"]);
        assert!(names("/").is_empty());
        for bad in ["a/b", "", "/a\0b"] {
            assert_eq!(
                SandboxPath::parse(bad).unwrap_err().kind,
                FsErrorKind::Invalid,
                "{bad:?}"
            );
        }
        let (dir, name) = SandboxPath::parse_named("/a/b/").unwrap();
        assert_eq!((dir.names.as_slice(), name), (&["a"][..], "b"));
        assert_eq!(SandboxPath::parse_named("/a").unwrap().1, "a");
        for bad in ["a/b", "", "/", "//", "/a/..", "/a/.", "/a\0b", "/a/../"] {
            let refusal = SandboxPath::parse_named(bad).unwrap_err();
            assert_eq!(refusal.kind, FsErrorKind::Invalid, "{bad:?}: {}", refusal.message);
        }
    }

    #[test]
    fn no_symlink_on_the_way_is_followed_and_the_link_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path();
        std::fs::create_dir_all(top.join("d/e")).unwrap();
        std::fs::write(top.join("d/e/f"), "f").unwrap();
        symlink("d", top.join("link")).unwrap();
        symlink("/", top.join("d/up")).unwrap();
        symlink("e/f", top.join("d/to-file")).unwrap();
        nix::unistd::mkfifo(&top.join("d/fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        let root = dir_fd(top);
        for way in WAYS {
            let st = opened_in(&root, "/d/e/f", OFlag::O_RDONLY, way).unwrap();
            assert_eq!(file_type(&st), SFlag::S_IFREG, "{way:?}");
            assert_eq!(
                opened_in(&root, "/link/e/f", OFlag::O_RDONLY, way).unwrap_err(),
                Unresolved::Symlink("/link".into()),
                "{way:?}"
            );
            assert_eq!(
                opened_in(&root, "/d/up/etc", OFlag::O_PATH, way).unwrap_err(),
                Unresolved::Symlink("/d/up".into()),
                "{way:?}"
            );
            // The last name: a link itself with O_PATH, refused otherwise.
            let st = opened_in(&root, "/d/to-file", OFlag::O_PATH, way).unwrap();
            assert_eq!(file_type(&st), SFlag::S_IFLNK, "{way:?}");
            assert_eq!(
                opened_in(&root, "/d/to-file", OFlag::O_RDONLY, way).unwrap_err(),
                Unresolved::Symlink("/d/to-file".into()),
                "{way:?}"
            );
            // A directory is asked for where a link is.
            assert_eq!(
                opened_in(&root, "/link", OFlag::O_PATH | OFlag::O_DIRECTORY, way).unwrap_err(),
                Unresolved::Symlink("/link".into()),
                "{way:?}"
            );
            // `..` never leaves the root.
            let st = opened_in(&root, "/../../d/e/../e/f", OFlag::O_RDONLY, way).unwrap();
            assert_eq!(file_type(&st), SFlag::S_IFREG, "{way:?}");
            assert_eq!(
                opened_in(&root, "/d/e/f/g", OFlag::O_RDONLY, way).unwrap_err(),
                Unresolved::Errno(Errno::ENOTDIR),
                "{way:?}"
            );
            assert_eq!(
                opened_in(&root, "/d/none", OFlag::O_RDONLY, way).unwrap_err(),
                Unresolved::Errno(Errno::ENOENT),
                "{way:?}"
            );
            // A FIFO opened without blocking, its type on the descriptor.
            let st = opened_in(&root, "/d/fifo", OFlag::O_RDONLY | OFlag::O_NONBLOCK, way).unwrap();
            assert_eq!(file_type(&st), SFlag::S_IFIFO, "{way:?}");
            let st = opened_in(&root, "/", OFlag::O_RDONLY | OFlag::O_DIRECTORY, way).unwrap();
            assert_eq!(file_type(&st), SFlag::S_IFDIR, "{way:?}");
        }
    }

    /// This test process stands for init: its own /proc entries and its
    /// threads' are refused, another process's are not.
    #[test]
    fn the_proc_entries_of_init_and_its_threads_are_refused() {
        let root = dir_fd(std::path::Path::new("/"));
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            tid_tx.send(nix::unistd::gettid().as_raw()).unwrap();
            let _ = done_rx.recv();
        });
        let tid = tid_rx.recv().unwrap();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = std::process::id();
        for way in WAYS {
            for own in [
                format!("/proc/{pid}/maps"),
                format!("/proc/{pid}"),
                format!("/proc/{pid}/fd"),
                format!("/proc/{tid}/environ"),
                format!("/proc/{pid}/task/{tid}/maps"),
                format!("/proc/../proc/{pid}/status"),
            ] {
                let err = opened_in(&root, &own, OFlag::O_RDONLY, way).unwrap_err();
                assert!(matches!(err, Unresolved::InitsOwn(_)), "{way:?} {own}: {err:?}");
            }
            assert_eq!(
                opened_in(&root, "/proc/self/maps", OFlag::O_RDONLY, way).unwrap_err(),
                Unresolved::Symlink("/proc/self".into())
            );
            assert_eq!(
                opened_in(&root, "/proc/thread-self/fd", OFlag::O_PATH, way).unwrap_err(),
                Unresolved::Symlink("/proc/thread-self".into())
            );
            let st = opened_in(&root, &format!("/proc/{}/status", child.id()), OFlag::O_RDONLY, way).unwrap();
            assert_eq!(file_type(&st), SFlag::S_IFREG, "{way:?}");
            assert!(opened_in(&root, "/proc/meminfo", OFlag::O_RDONLY, way).is_ok());

            let proc = SandboxPath::parse("/proc").unwrap();
            let err = parent_in(&root, &proc, &pid.to_string(), way).unwrap_err();
            assert!(matches!(err, Unresolved::InitsOwn(_)), "{way:?}: {err:?}");
            assert!(parent_in(&root, &proc, &child.id().to_string(), way).is_ok());
        }
        child.kill().unwrap();
        child.wait().unwrap();
        done_tx.send(()).unwrap();
        thread.join().unwrap();
    }
}
