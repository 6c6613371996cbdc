//! Watching a directory ([`cairn_protocol::ToInit::Watch`]): inotify on
//! the directory and, when recursive, on every directory below it, those
//! made later too. Each directory is opened as file operations open paths
//! (from the sandbox's root, no symbolic link followed, init's own `/proc`
//! refused) and watched through its descriptor, so a name swapped
//! meanwhile cannot aim a watch elsewhere. The watch lasts until the host
//! closes the connection or the directory goes.

use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};

use cairn_protocol::{write_frame, FrameError, FromInit, FsErrorKind, WatchEvent, WatchKind, WATCH_BATCH_MAX};
use nix::errno::Errno;
use nix::fcntl::OFlag;

use crate::resolve::{self, Refusal, SandboxPath, Unresolved};

/// Watches a sandbox may hold at once (each is a connection and a thread).
const MAX_WATCHES: usize = 64;
/// Directories one recursive watch follows.
const MAX_DIRS: usize = 8192;
/// Names a directory made after the watch started may report as created
/// (what it held when its own watch was added).
const FOUND_MAX: usize = 10_000;

static WATCHES: AtomicUsize = AtomicUsize::new(0);

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_EXCL_UNLINK;

/// One watch's inotify instance and what each of its watches stands for.
struct Watcher {
    inotify: OwnedFd,
    /// Watch descriptor to the directory's path relative to the watched
    /// one ("" for itself).
    dirs: HashMap<i32, String>,
    /// The watched directory, as the host named it.
    root: String,
    recursive: bool,
}

impl Watcher {
    /// Adds a watch on the directory `rel` below the root (and, when
    /// recursive, on the directories below it). With `found`, every name
    /// below it goes there too: for a directory made after the watch
    /// started, what was made in it before its own watch was added.
    fn add(&mut self, rel: &str, mut found: Option<&mut Vec<String>>) -> Result<(), Refusal> {
        // Depth first with a stack of its own: a deep tree cannot exhaust
        // the thread's.
        let mut pending = vec![rel.to_string()];
        let mut first = true;
        while let Some(rel) = pending.pop() {
            let dir = match self.add_one(&rel) {
                Ok(dir) => dir,
                // A directory below that went meanwhile is not watched.
                Err(r) if !first && r.kind == FsErrorKind::NotFound => continue,
                Err(r) => return Err(r),
            };
            first = false;
            if !self.recursive {
                break;
            }
            let names = crate::tree::children(dir).map_err(|e| Refusal::errno(e, format!("cannot watch {rel}")))?;
            for (name, is_dir) in names.into_iter().rev() {
                let sub = if rel.is_empty() { name } else { format!("{rel}/{name}") };
                if let Some(found) = found.as_deref_mut() {
                    if found.len() < FOUND_MAX {
                        found.push(sub.clone());
                    }
                }
                if is_dir {
                    pending.push(sub);
                }
            }
        }
        Ok(())
    }

    /// Adds a watch on the directory `rel` alone; returns it, open for
    /// listing.
    fn add_one(&mut self, rel: &str) -> Result<OwnedFd, Refusal> {
        let path = if rel.is_empty() {
            self.root.clone()
        } else {
            format!("{}/{rel}", self.root.trim_end_matches('/'))
        };
        let what = format!("cannot watch {path}");
        let parsed = SandboxPath::parse(&path)?;
        let dir = resolve::open(&parsed, OFlag::O_RDONLY | OFlag::O_DIRECTORY).map_err(|e| match e {
            Unresolved::Errno(Errno::ENOTDIR) => Refusal::new(
                FsErrorKind::NotADirectory,
                format!("{what}: it is not a directory; only directories are watched"),
            ),
            e => e.refusal(&what),
        })?;
        if self.dirs.len() >= MAX_DIRS {
            return Err(Refusal::new(
                FsErrorKind::Invalid,
                format!("{what}: a watch follows at most {MAX_DIRS} directories; watch a smaller tree"),
            ));
        }
        let by_fd = std::ffi::CString::new(format!("/proc/self/fd/{}", dir.as_raw_fd())).expect("no NUL");
        // SAFETY: a valid descriptor and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.inotify.as_raw_fd(), by_fd.as_ptr(), MASK) };
        if wd < 0 {
            return Err(Refusal::errno(Errno::last(), what));
        }
        self.dirs.insert(wd, rel.to_string());
        Ok(dir)
    }
}

/// Answers [`cairn_protocol::ToInit::Watch`] on `stream`.
pub fn watch(path: &str, recursive: bool, stream: UnixStream) -> Result<(), FrameError> {
    let mut writer = BufWriter::new(stream.try_clone()?);
    if WATCHES.fetch_add(1, Ordering::SeqCst) >= MAX_WATCHES {
        WATCHES.fetch_sub(1, Ordering::SeqCst);
        let refusal = Refusal::new(
            FsErrorKind::Invalid,
            format!("cannot watch {path}: the sandbox already has {MAX_WATCHES} watches; end one first"),
        );
        return resolve::answer(&mut writer, Err(refusal));
    }
    let result = serve(path, recursive, &stream, &mut writer);
    WATCHES.fetch_sub(1, Ordering::SeqCst);
    result
}

fn serve(path: &str, recursive: bool, stream: &UnixStream, writer: &mut impl Write) -> Result<(), FrameError> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if fd < 0 {
        let refusal = Refusal::errno(Errno::last(), format!("cannot watch {path}"));
        return resolve::answer(writer, Err(refusal));
    }
    let mut w = Watcher {
        // SAFETY: a descriptor just returned, owned by nothing else.
        inotify: unsafe { OwnedFd::from_raw_fd(fd) },
        dirs: HashMap::new(),
        root: path.to_string(),
        recursive,
    };
    if let Err(refusal) = w.add("", None) {
        return resolve::answer(writer, Err(refusal));
    }
    resolve::answer(writer, Ok(FromInit::Watching))?;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if !wait(w.inotify.as_raw_fd(), stream.as_raw_fd()) {
            // The host closed the connection (or sent something, which it
            // never does on a watch): the watch ends.
            return Ok(());
        }
        // SAFETY: reading into a buffer we own, no longer than it.
        let n = unsafe { libc::read(w.inotify.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            match Errno::last() {
                Errno::EAGAIN | Errno::EINTR => continue,
                e => return Err(FrameError::Io(e.into())),
            }
        }
        let (events, ended) = decode(&mut w, &buf[..n as usize]);
        for batch in events.chunks(WATCH_BATCH_MAX) {
            write_frame(writer, &FromInit::Events(batch.to_vec()))?;
        }
        if ended {
            write_frame(writer, &FromInit::End)?;
        }
        writer.flush()?;
        if ended {
            return Ok(());
        }
    }
}

/// Waits until inotify has events (true) or the connection is readable or
/// closed (false).
fn wait(inotify: RawFd, conn: RawFd) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: inotify,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: conn,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two valid pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if Errno::last() == Errno::EINTR {
                continue;
            }
            return false;
        }
        if fds[1].revents != 0 {
            return false;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            return true;
        }
        if fds[0].revents != 0 {
            return false;
        }
    }
}

/// The events in `bytes` (whole `inotify_event` records), and whether the
/// watched directory itself went.
fn decode(w: &mut Watcher, bytes: &[u8]) -> (Vec<WatchEvent>, bool) {
    const HEAD: usize = std::mem::size_of::<libc::inotify_event>();
    let mut events = Vec::new();
    let mut ended = false;
    let mut at = 0;
    while at + HEAD <= bytes.len() {
        let field = |o: usize| u32::from_ne_bytes(bytes[at + o..at + o + 4].try_into().expect("4 bytes"));
        let (wd, mask, len) = (field(0) as i32, field(4), field(12) as usize);
        let end = (at + HEAD + len).min(bytes.len());
        let raw = &bytes[at + HEAD..end];
        let name = String::from_utf8_lossy(&raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())]).into_owned();
        at = end;
        if mask & libc::IN_Q_OVERFLOW != 0 {
            eprintln!("cairn-init: a directory watch's event queue overflowed; some events were lost");
            continue;
        }
        let Some(dir) = w.dirs.get(&wd).cloned() else { continue };
        if mask & libc::IN_IGNORED != 0 {
            w.dirs.remove(&wd);
            ended |= dir.is_empty();
            continue;
        }
        let rel = match (dir.is_empty(), name.is_empty()) {
            (_, true) => dir.clone(),
            (true, false) => name.clone(),
            (false, false) => format!("{dir}/{name}"),
        };
        if mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0 {
            // Reported by the parent's watch as a remove or rename, except
            // for the watched directory itself.
            if dir.is_empty() {
                let kind = if mask & libc::IN_DELETE_SELF != 0 {
                    WatchKind::Remove
                } else {
                    WatchKind::Rename
                };
                events.push(WatchEvent {
                    name: String::new(),
                    kind,
                });
                ended = true;
            }
            continue;
        }
        let kind = if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
            WatchKind::Create
        } else if mask & libc::IN_MODIFY != 0 {
            WatchKind::Write
        } else if mask & libc::IN_DELETE != 0 {
            WatchKind::Remove
        } else if mask & libc::IN_MOVED_FROM != 0 {
            WatchKind::Rename
        } else if mask & libc::IN_ATTRIB != 0 {
            WatchKind::Chmod
        } else {
            continue;
        };
        events.push(WatchEvent {
            name: rel.clone(),
            kind,
        });
        if w.recursive && kind == WatchKind::Create && mask & libc::IN_ISDIR != 0 {
            // Its own events come from now on; what was made in it before
            // its watch was added is reported as created (some may then
            // come twice).
            let mut found = Vec::new();
            match w.add(&rel, Some(&mut found)) {
                Ok(()) => events.extend(found.into_iter().map(|name| WatchEvent {
                    name,
                    kind: WatchKind::Create,
                })),
                Err(r) if r.kind == FsErrorKind::NotFound => {}
                Err(r) => eprintln!("cairn-init: a recursive watch does not follow {rel}: {}", r.message),
            }
        }
    }
    (events, ended)
}
