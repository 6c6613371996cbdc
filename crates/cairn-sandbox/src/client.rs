//! The host side of the init protocol: one connection per operation.

use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cairn_protocol::{
    encode_frame, hello, read_frame, write_frame, DirEntry, ExecRequest, ExitStatus, FileKind, FileMeta, FrameError,
    FromInit, FsErrorKind, Ids, PtySize, SpawnErrorKind, ToInit, WatchEvent, DATA_CHUNK, LIST_BYTES_MAX,
    LIST_DEPTH_MAX, LIST_ENTRIES_MAX, PATH_MAX, PROTOCOL_VERSION, WATCH_BATCH_MAX,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the sandbox is not running (nothing answers on {0}); `cairn ps` shows its state, `cairn rm` removes it")]
    NotRunning(PathBuf),
    #[error("lost the connection to the sandbox's init: {0}")]
    Frame(#[from] FrameError),
    #[error("the sandbox's init refused the request: {0}")]
    Refused(String),
    #[error("the sandbox's init answered {0} where it should not; host and init versions may differ")]
    Unexpected(String),
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Init sent nothing within the request's deadline
    /// ([`REQUEST_DEADLINE`] for a file or control request).
    #[error("the sandbox's init stopped answering (nothing within the request's deadline); it may be stopped or overloaded: `cairn ps` shows its state")]
    TimedOut,
    /// A file operation failed in the sandbox (or was refused before it was
    /// sent); its kind says how.
    #[error(transparent)]
    Fs(#[from] FsFailure),
}

/// A file operation that failed, with a kind a caller can map (to an HTTP
/// status, an errno) and init's message, cut to [`MESSAGE_MAX`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FsFailure {
    pub kind: FsErrorKind,
    pub message: String,
}

/// A directory watch from [`InitClient::watch`]: its events as they come.
/// Dropping it (or shutting down [`DirWatch::stopper`]'s socket) ends it.
#[derive(Debug)]
pub struct DirWatch {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    socket: PathBuf,
}

impl DirWatch {
    /// The next events, waiting as long as it takes; `None` once the
    /// watched directory is gone (its removal is the last event) or the
    /// watch was stopped.
    pub fn next_events(&mut self) -> Result<Option<Vec<WatchEvent>>, ClientError> {
        let msg = match read_frame(&mut self.reader) {
            Ok(m) => m,
            Err(FrameError::Closed) => return Ok(None),
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(ClientError::NotRunning(self.socket.clone()))
            }
            Err(FrameError::Io(e)) => return Err(ClientError::Io(e)),
            Err(e) => return Err(ClientError::Frame(e)),
        };
        match msg {
            FromInit::Events(events) => {
                if events.len() > WATCH_BATCH_MAX || events.iter().any(|e| e.name.len() > PATH_MAX) {
                    return Err(invalid(format!(
                        "init sent {} watch events (at most {WATCH_BATCH_MAX}, names of at most {PATH_MAX} bytes)",
                        events.len()
                    )));
                }
                Ok(Some(events))
            }
            FromInit::End => Ok(None),
            other => Err(refusal(other)),
        }
    }

    /// A handle on the watch's connection: shutting it down from another
    /// thread ends the watch, and a [`DirWatch::next_events`] waiting returns `None`.
    pub fn stopper(&self) -> io::Result<UnixStream> {
        self.stream.try_clone()
    }
}

/// A directory listing from [`InitClient::list_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirListing {
    /// Sorted by path; never more than were asked for.
    pub entries: Vec<DirEntry>,
    /// The listing stopped at the entry cap asked for, or at
    /// [`LIST_BYTES_MAX`] bytes of paths and targets; more entries exist.
    pub truncated: bool,
}

/// The most of a message from init (an error, a spawn failure) the host
/// keeps: init is inside the sandbox, and its messages end up in errors,
/// pipeline events and the state store.
pub const MESSAGE_MAX: usize = 4 << 10;

/// How long a file or control request waits for init to send anything
/// (a reply, the next piece of a download) before it gives up.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);

/// `message` cut to [`MESSAGE_MAX`] bytes, saying how much was cut.
fn bounded(mut message: String) -> String {
    if message.len() > MESSAGE_MAX {
        let end = (0..=MESSAGE_MAX)
            .rev()
            .find(|&i| message.is_char_boundary(i))
            .unwrap_or(0);
        let cut = message.len() - end;
        message.truncate(end);
        message.push_str(&format!(" [{cut} more bytes cut]"));
    }
    message
}

fn unexpected(msg: &FromInit) -> ClientError {
    ClientError::Unexpected(bounded(format!("{msg:?}")))
}

/// A process could not be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnFailure {
    pub kind: SpawnErrorKind,
    pub message: String,
}

/// Talks to one sandbox's init.
#[derive(Debug, Clone)]
pub struct InitClient {
    socket: PathBuf,
    /// `socket` is a directory the sandbox can write, holding init's
    /// socket among its generations (gVisor; see [`crate::init_socket`]).
    shared_directory: bool,
    /// How long a file or control request waits for init to send anything.
    deadline: Duration,
}

impl InitClient {
    /// A client for the socket at `socket`, which the host made.
    pub fn new(socket: impl Into<PathBuf>) -> InitClient {
        InitClient {
            socket: socket.into(),
            shared_directory: false,
            deadline: REQUEST_DEADLINE,
        }
    }

    /// A client for init's socket inside `dir`, a directory the sandbox can
    /// write: nothing there is followed, only init's sockets are used.
    pub fn in_shared_directory(dir: impl Into<PathBuf>) -> InitClient {
        InitClient {
            socket: dir.into(),
            shared_directory: true,
            deadline: REQUEST_DEADLINE,
        }
    }

    /// The same client, its file and control requests giving up after
    /// `deadline` without a byte from init (default [`REQUEST_DEADLINE`]).
    pub fn with_deadline(mut self, deadline: Duration) -> InitClient {
        self.deadline = deadline;
        self
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn connect(&self) -> io::Result<UnixStream> {
        if self.shared_directory {
            crate::init_socket::connect(&self.socket)
        } else {
            UnixStream::connect(&self.socket)
        }
    }

    /// Connects and sends `request` right behind the hello (one write), then
    /// checks the welcome. Every read on the connection gives up after the
    /// client's deadline without a byte: a file or control request never
    /// holds a host thread for ever on an init that stopped answering.
    fn open(&self, request: &ToInit) -> Result<(UnixStream, BufReader<UnixStream>), ClientError> {
        self.open_within(request, Some(self.deadline))
    }

    /// [`Self::open`], every read on the connection (the welcome included)
    /// giving up after `timeout`: a peer that accepts and never answers
    /// cannot hold the host.
    fn open_within(
        &self,
        request: &ToInit,
        timeout: Option<Duration>,
    ) -> Result<(UnixStream, BufReader<UnixStream>), ClientError> {
        let stream = self.send(request, timeout)?;
        self.welcomed(stream)
    }

    /// Connects and sends the hello and `request` in one write; nothing is
    /// read yet, so this may run before init accepts (its socket is bound
    /// by the host before init starts).
    fn send(&self, request: &ToInit, timeout: Option<Duration>) -> Result<UnixStream, ClientError> {
        let mut stream = self.connect().map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ClientError::NotRunning(self.socket.clone()),
            _ => ClientError::Io(e),
        })?;
        stream.set_read_timeout(timeout)?;
        let mut buf = Vec::new();
        let mut frame = Vec::new();
        encode_frame(&hello(), &mut frame)?;
        buf.extend_from_slice(&frame);
        encode_frame(request.on_wire().as_ref(), &mut frame)?;
        buf.extend_from_slice(&frame);
        stream.write_all(&buf).map_err(|e| self.lost(e))?;
        Ok(stream)
    }

    /// Reads and checks the welcome on a connection [`Self::send`] opened.
    fn welcomed(&self, stream: UnixStream) -> Result<(UnixStream, BufReader<UnixStream>), ClientError> {
        let mut reader = BufReader::with_capacity(DATA_CHUNK + 64, stream.try_clone()?);
        match self.read(&mut reader)? {
            FromInit::Welcome { version, .. } if version == PROTOCOL_VERSION => Ok((stream, reader)),
            FromInit::Error(e) => Err(ClientError::Refused(e)),
            other => Err(unexpected(&other)),
        }
    }

    fn lost(&self, e: io::Error) -> ClientError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::TimedOut,
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => ClientError::NotRunning(self.socket.clone()),
            _ => ClientError::Io(e),
        }
    }

    fn read(&self, reader: &mut BufReader<UnixStream>) -> Result<FromInit, ClientError> {
        let msg = read_frame(reader).map_err(|e| match e {
            FrameError::Closed => ClientError::NotRunning(self.socket.clone()),
            FrameError::Io(io) => self.lost(io),
            other => ClientError::Frame(other),
        })?;
        Ok(match msg {
            FromInit::Error(e) => FromInit::Error(bounded(e)),
            FromInit::SpawnFailed { kind, message } => FromInit::SpawnFailed {
                kind,
                message: bounded(message),
            },
            FromInit::FsError { kind, message } => FromInit::FsError {
                kind,
                message: bounded(message),
            },
            other => other,
        })
    }

    /// Checks that init answers within `timeout`.
    pub fn ping(&self, timeout: Duration) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open_within(&ToInit::Ping, Some(timeout))?;
        match self.read(&mut reader)? {
            FromInit::Pong => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Starts a process; output is collected with [`ExecSession::wait`].
    pub fn exec(&self, req: ExecRequest) -> Result<Result<ExecSession, SpawnFailure>, ClientError> {
        self.send_exec(req)?.started()
    }

    /// Starts a process on a new terminal of `size` in the sandbox (see
    /// [`ToInit::ExecPty`]): all its output comes as stdout, and its input
    /// goes through [`ExecControl::stdin`].
    pub fn exec_pty(&self, req: ExecRequest, size: PtySize) -> Result<Result<ExecSession, SpawnFailure>, ClientError> {
        let stream = self.send(&ToInit::ExecPty { request: req, size }, None)?;
        self.exec_started(stream, false)
    }

    /// Connects to TCP `port` on the sandbox's loopback through init (see
    /// [`ToInit::ConnectPort`]): the stream returned carries that
    /// connection's bytes both ways. `Ok(Err(message))` when nothing
    /// answers there. The answer is read without buffering, so no byte of
    /// the port's stream is taken from the stream returned.
    pub fn connect_port(&self, port: u16) -> Result<Result<UnixStream, String>, ClientError> {
        let mut stream = self.send(&ToInit::ConnectPort { port }, Some(self.deadline))?;
        let mut next = || -> Result<FromInit, ClientError> {
            read_frame(&mut stream).map_err(|e| match e {
                FrameError::Closed => ClientError::NotRunning(self.socket.clone()),
                FrameError::Io(io) => self.lost(io),
                other => ClientError::Frame(other),
            })
        };
        match next()? {
            FromInit::Welcome { version, .. } if version == PROTOCOL_VERSION => {}
            FromInit::Error(e) => return Err(ClientError::Refused(bounded(e))),
            other => return Err(unexpected(&other)),
        }
        match next()? {
            FromInit::Done => {
                stream.set_read_timeout(None)?;
                Ok(Ok(stream))
            }
            FromInit::Error(e) => Ok(Err(bounded(e))),
            other => Err(unexpected(&other)),
        }
    }

    /// Sends an exec request without waiting for any answer: the native
    /// driver sends a sandbox's first command while init is still building
    /// the sandbox, and init starts it as soon as it serves.
    pub fn send_exec(&self, req: ExecRequest) -> Result<PendingExec, ClientError> {
        let detach = req.detach;
        let stream = self.send(&ToInit::Exec(req), None)?;
        Ok(PendingExec {
            client: self.clone(),
            stream,
            detach,
        })
    }

    /// The answer to a request [`Self::send_exec`] sent.
    fn exec_started(&self, stream: UnixStream, detach: bool) -> Result<Result<ExecSession, SpawnFailure>, ClientError> {
        let (stream, mut reader) = self.welcomed(stream)?;
        match self.read(&mut reader)? {
            FromInit::Started { pid } => Ok(Ok(ExecSession {
                pid,
                detached: detach,
                writer: Arc::new(Mutex::new(stream)),
                reader,
                client: self.clone(),
            })),
            FromInit::SpawnFailed { kind, message } => Ok(Err(SpawnFailure { kind, message })),
            FromInit::Error(e) => Err(ClientError::Refused(e)),
            other => Err(unexpected(&other)),
        }
    }

    /// Starts a named job (see [`ToInit::StartJob`]); returns its pid.
    pub fn start_job(&self, name: &str, request: ExecRequest) -> Result<Result<i32, SpawnFailure>, ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::StartJob {
            name: name.to_string(),
            request,
        })?;
        match self.read(&mut reader)? {
            FromInit::Started { pid } => Ok(Ok(pid)),
            FromInit::SpawnFailed { kind, message } => Ok(Err(SpawnFailure { kind, message })),
            FromInit::Error(e) => Err(ClientError::Refused(e)),
            other => Err(unexpected(&other)),
        }
    }

    /// Follows job `name` from the given output offsets: `None` when init
    /// has no such job, else a session whose `wait` streams the rest of its
    /// output and returns its exit status.
    pub fn attach_job(
        &self,
        name: &str,
        stdout_from: u64,
        stderr_from: u64,
    ) -> Result<Option<ExecSession>, ClientError> {
        let (stream, mut reader) = self.open_within(
            &ToInit::AttachJob {
                name: name.to_string(),
                stdout_from,
                stderr_from,
            },
            None,
        )?;
        match self.read(&mut reader)? {
            FromInit::Started { pid } => Ok(Some(ExecSession {
                pid,
                detached: false,
                writer: Arc::new(Mutex::new(stream)),
                reader,
                client: self.clone(),
            })),
            FromInit::Error(e) if e.starts_with("no job named") => Ok(None),
            FromInit::Error(e) => Err(ClientError::Refused(e)),
            other => Err(unexpected(&other)),
        }
    }

    /// Signals any process in the sandbox by its pid there.
    pub fn kill(&self, pid: i32, signal: i32) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::Kill { pid, signal })?;
        self.expect_done(&mut reader)
    }

    /// The metadata of `path` (absolute in the sandbox), its last name not
    /// followed (a symbolic link is described itself); `None` when nothing
    /// is there. A symbolic link on the way, or the sandbox init's own
    /// `/proc` entries, are refused ([`ClientError::Fs`]).
    pub fn stat(&self, path: &str) -> Result<Option<FileMeta>, ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::Stat { path: path.to_string() })?;
        match self.read(&mut reader)? {
            FromInit::Stat(meta) => Ok(meta),
            other => Err(refusal(other)),
        }
    }

    /// Streams `src` into a file in the sandbox described by `meta`. The
    /// file's directory must exist, reached without a symbolic link; the
    /// file is written under a temporary name and renamed into place, so
    /// a refused or cut transfer leaves nothing.
    pub fn put_file(&self, meta: FileMeta, src: &mut dyn Read) -> Result<u64, ClientError> {
        let (mut stream, mut reader) = self.open(&ToInit::PutFile(meta))?;
        let mut buf = vec![0u8; DATA_CHUNK];
        let mut frame = Vec::with_capacity(DATA_CHUNK + 16);
        let mut total = 0u64;
        loop {
            let n = match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ClientError::Io(e)),
            };
            total += n as u64;
            encode_frame(&ToInit::Data(buf[..n].to_vec()), &mut frame)?;
            stream.write_all(&frame).map_err(|e| self.lost(e))?;
        }
        write_frame(&mut stream, &ToInit::End).map_err(ClientError::Frame)?;
        self.expect_done(&mut reader)?;
        Ok(total)
    }

    /// Streams a file out of the sandbox into `dst`; returns its metadata.
    pub fn get_file(&self, path: &str, dst: &mut dyn Write) -> Result<FileMeta, ClientError> {
        self.open_file(path)?.copy_to(dst)
    }

    /// Starts a download of `path` (absolute in the sandbox): init has
    /// opened it and sent its metadata; its bytes follow. A path through a
    /// symbolic link, a file that is not a regular file (a FIFO, a socket,
    /// a device, a directory) and the sandbox init's own `/proc` entries are
    /// refused here ([`ClientError::Fs`]), before any byte.
    pub fn open_file(&self, path: &str) -> Result<FileDownload, ClientError> {
        let (stream, mut reader) = self.open(&ToInit::GetFile { path: path.to_string() })?;
        match self.read(&mut reader)? {
            FromInit::File(meta) => Ok(FileDownload {
                client: self.clone(),
                meta,
                _stream: stream,
                reader,
            }),
            other => Err(refusal(other)),
        }
    }

    /// Lists the directory `path` (absolute in the sandbox) without following
    /// a symlink, `path` itself included: its children at `depth` 1, down to
    /// `depth` levels (1 to [`LIST_DEPTH_MAX`]), at most `max_entries` of
    /// them (1 to [`LIST_ENTRIES_MAX`]). What init sends is checked: no more
    /// entries than asked, each inside `path` and within `depth`, paths and
    /// targets at most [`PATH_MAX`] bytes.
    pub fn list_dir(&self, path: &str, depth: u32, max_entries: u32) -> Result<DirListing, ClientError> {
        if !(1..=LIST_DEPTH_MAX).contains(&depth) {
            return Err(invalid(format!(
                "a listing's depth is 1 to {LIST_DEPTH_MAX}, not {depth}"
            )));
        }
        if !(1..=LIST_ENTRIES_MAX).contains(&max_entries) {
            return Err(invalid(format!(
                "a listing returns 1 to {LIST_ENTRIES_MAX} entries, not {max_entries}"
            )));
        }
        let (_stream, mut reader) = self.open(&ToInit::ListDir {
            path: path.to_string(),
            depth,
            max_entries,
        })?;
        let mut check = ListingCheck::new(path, depth, max_entries);
        let mut entries = Vec::new();
        loop {
            match self.read(&mut reader)? {
                FromInit::Entry(entry) => {
                    check.admit(&entry)?;
                    entries.push(entry);
                }
                FromInit::EntriesEnd { truncated } => {
                    entries.sort_by(|a, b| a.meta.path.cmp(&b.meta.path));
                    return Ok(DirListing { entries, truncated });
                }
                other => return Err(refusal(other)),
            }
        }
    }

    /// Watches the directory `path` (absolute in the sandbox; with
    /// `recursive`, the directories below it too). Init answers within the
    /// client's deadline; events then come whenever they happen.
    pub fn watch(&self, path: &str, recursive: bool) -> Result<DirWatch, ClientError> {
        let (stream, mut reader) = self.open(&ToInit::Watch {
            path: path.to_string(),
            recursive,
        })?;
        match self.read(&mut reader)? {
            FromInit::Watching => {}
            other => return Err(refusal(other)),
        }
        stream.set_read_timeout(None)?;
        Ok(DirWatch {
            stream,
            reader,
            socket: self.socket.clone(),
        })
    }

    /// Makes the directory `path` (absolute in the sandbox), with `parents`
    /// its missing ancestors too; whether it was created (false: a directory
    /// was already there). Something else at `path` is
    /// [`FsErrorKind::Exists`].
    pub fn make_dir(&self, path: &str, parents: bool) -> Result<bool, ClientError> {
        self.make_dir_as(path, parents, None)
    }

    /// [`Self::make_dir`], each directory it makes owned by `owner` when
    /// given (see [`ToInit::MakeDirAs`]).
    pub fn make_dir_as(&self, path: &str, parents: bool, owner: Option<Ids>) -> Result<bool, ClientError> {
        let request = match owner {
            None => ToInit::MakeDir {
                path: path.to_string(),
                parents,
            },
            Some(owner) => ToInit::MakeDirAs {
                path: path.to_string(),
                parents,
                owner,
            },
        };
        let (_stream, mut reader) = self.open(&request)?;
        match self.read(&mut reader)? {
            FromInit::Made { created } => Ok(created),
            other => Err(refusal(other)),
        }
    }

    /// Sets extended attributes of the file or directory `path` (see
    /// [`ToInit::SetXattrs`]).
    pub fn set_xattrs(&self, path: &str, attrs: Vec<(String, String)>) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::SetXattrs {
            path: path.to_string(),
            attrs,
        })?;
        self.expect_done(&mut reader)
    }

    /// The E2B metadata attributes of each of `paths` (see
    /// [`ToInit::GetXattrs`]); a reply that does not match the request is
    /// refused.
    pub fn get_xattrs(&self, paths: Vec<String>) -> Result<Vec<Vec<(String, String)>>, ClientError> {
        let count = paths.len();
        let (_stream, mut reader) = self.open(&ToInit::GetXattrs { paths })?;
        match self.read(&mut reader)? {
            FromInit::Xattrs(all) => {
                let bounded = all.len() == count
                    && all.iter().all(|attrs| {
                        attrs.len() <= cairn_protocol::XATTRS_MAX
                            && attrs.iter().all(|(k, v)| {
                                k.len() <= cairn_protocol::XATTR_NAME_MAX && v.len() <= cairn_protocol::XATTR_VALUE_MAX
                            })
                    });
                if bounded {
                    Ok(all)
                } else {
                    Err(ClientError::Refused(
                        "init answered attributes that do not match the request".into(),
                    ))
                }
            }
            other => Err(refusal(other)),
        }
    }

    /// Renames `from` to `to` in the sandbox as rename(2) does: a file or an
    /// empty directory at `to` is replaced, a directory that is not empty is
    /// [`FsErrorKind::NotEmpty`].
    pub fn rename(&self, from: &str, to: &str) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::Rename {
            from: from.to_string(),
            to: to.to_string(),
        })?;
        self.expect_done(&mut reader)
    }

    /// Removes `path` in the sandbox: a file, a symlink (never what it points
    /// to), an empty directory, or with `recursive` a directory tree. A
    /// recursive remove never follows a symlink out of the tree and refuses
    /// to cross into another mount.
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::Remove {
            path: path.to_string(),
            recursive,
        })?;
        self.expect_done(&mut reader)
    }

    /// Tells init the sandbox was restored: new wall clock, new entropy.
    pub fn restored(&self, unix_time_ns: u128, entropy: Vec<u8>) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::Restored { unix_time_ns, entropy })?;
        self.expect_done(&mut reader)
    }

    /// Asks init to stop listening and end every connection before a memory
    /// checkpoint (gVisor cannot save host sockets); returns once init has
    /// closed this last connection too. Init listens again on SIGUSR2.
    pub fn quiesce(&self, timeout: Duration) -> Result<(), ClientError> {
        let (_stream, mut reader) = self.open_within(&ToInit::Quiesce, Some(timeout))?;
        self.expect_done(&mut reader)?;
        // End of file: init dropped its side of the last host socket.
        io::copy(&mut reader, &mut io::sink())?;
        Ok(())
    }

    fn expect_done(&self, reader: &mut BufReader<UnixStream>) -> Result<(), ClientError> {
        match self.read(reader)? {
            FromInit::Done => Ok(()),
            other => Err(refusal(other)),
        }
    }
}

/// A file init is sending ([`InitClient::open_file`]).
#[derive(Debug)]
pub struct FileDownload {
    client: InitClient,
    meta: FileMeta,
    _stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl FileDownload {
    /// The file's metadata, from the descriptor init reads.
    pub fn meta(&self) -> &FileMeta {
        &self.meta
    }

    /// Copies the file's bytes into `dst`; returns its metadata.
    pub fn copy_to(mut self, dst: &mut dyn Write) -> Result<FileMeta, ClientError> {
        loop {
            match self.client.read(&mut self.reader)? {
                FromInit::Data(d) => dst.write_all(&d)?,
                FromInit::End => return Ok(self.meta),
                other => return Err(refusal(other)),
            }
        }
    }
}

fn invalid(message: String) -> ClientError {
    ClientError::Fs(FsFailure {
        kind: FsErrorKind::Invalid,
        message,
    })
}

/// The error an answer other than the one expected stands for.
fn refusal(msg: FromInit) -> ClientError {
    match msg {
        FromInit::FsError { kind, message } => ClientError::Fs(FsFailure { kind, message }),
        FromInit::Error(e) => ClientError::Refused(e),
        other => unexpected(&other),
    }
}

/// Checks each entry of a listing against the request, as it arrives:
/// init is inside the sandbox, and a listing is held in host memory.
struct ListingCheck {
    /// The listed directory's path without trailing slashes (`""`: root).
    prefix: String,
    depth: u32,
    left: u32,
    bytes: usize,
}

impl ListingCheck {
    fn new(path: &str, depth: u32, max_entries: u32) -> ListingCheck {
        ListingCheck {
            prefix: path.trim_end_matches('/').to_string(),
            depth,
            left: max_entries,
            bytes: 0,
        }
    }

    fn admit(&mut self, entry: &DirEntry) -> Result<(), ClientError> {
        let path = &entry.meta.path;
        let target = entry.symlink_target.as_deref().unwrap_or("");
        let wrong = |why: &str| {
            ClientError::Unexpected(bounded(format!(
                "a listing entry {why}: {:?} ({:?})",
                path.chars().take(256).collect::<String>(),
                entry.meta.kind
            )))
        };
        if self.left == 0 {
            return Err(wrong("past the number of entries asked for"));
        }
        if path.len() > PATH_MAX || target.len() > PATH_MAX {
            return Err(wrong(&format!("longer than {PATH_MAX} bytes")));
        }
        if self.bytes + path.len() + target.len() > LIST_BYTES_MAX {
            return Err(wrong(&format!("past {LIST_BYTES_MAX} bytes of paths")));
        }
        let below = path
            .strip_prefix(self.prefix.as_str())
            .and_then(|rest| rest.strip_prefix('/'))
            .ok_or_else(|| wrong("outside the listed directory"))?;
        let mut levels = 0u32;
        for name in below.split('/') {
            levels += 1;
            if name.is_empty() || name == "." || name == ".." {
                return Err(wrong("with an empty, . or .. name"));
            }
        }
        if levels > self.depth {
            return Err(wrong("deeper than asked for"));
        }
        if entry.symlink_target.is_some() && entry.meta.kind != FileKind::Symlink {
            return Err(wrong("with a target but not a symlink"));
        }
        self.left -= 1;
        self.bytes += path.len() + target.len();
        Ok(())
    }
}

/// A started process.
pub struct ExecSession {
    pub pid: i32,
    detached: bool,
    writer: Arc<Mutex<UnixStream>>,
    reader: BufReader<UnixStream>,
    client: InitClient,
}

/// An exec request sent, its answer not yet read ([`InitClient::send_exec`]).
#[derive(Debug)]
pub struct PendingExec {
    client: InitClient,
    stream: UnixStream,
    detach: bool,
}

impl PendingExec {
    /// Waits for init to start the process (or refuse it).
    pub fn started(self) -> Result<Result<ExecSession, SpawnFailure>, ClientError> {
        self.client.exec_started(self.stream, self.detach)
    }
}

/// Sends stdin and signals to a running process from any thread.
#[derive(Clone)]
pub struct ExecControl {
    writer: Arc<Mutex<UnixStream>>,
}

impl ExecControl {
    fn send(&self, msg: &ToInit) -> Result<(), FrameError> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *w, msg)
    }
    pub fn stdin(&self, data: &[u8]) -> Result<(), FrameError> {
        self.send(&ToInit::Stdin(data.to_vec()))
    }
    pub fn close_stdin(&self) -> Result<(), FrameError> {
        self.send(&ToInit::StdinEof)
    }
    pub fn signal(&self, signal: i32) -> Result<(), FrameError> {
        self.send(&ToInit::Signal(signal))
    }
    /// Resizes the terminal of a process started with
    /// [`InitClient::exec_pty`] (nothing for one without).
    pub fn resize(&self, size: PtySize) -> Result<(), FrameError> {
        self.send(&ToInit::Resize(size))
    }
}

impl ExecSession {
    pub fn control(&self) -> ExecControl {
        ExecControl {
            writer: Arc::clone(&self.writer),
        }
    }

    /// Streams output into `stdout` and `stderr` as it comes until the
    /// process ends. A detached process returns at once with no status.
    pub fn wait(mut self, stdout: &mut dyn Write, stderr: &mut dyn Write) -> Result<Option<ExitStatus>, ClientError> {
        if self.detached {
            return Ok(None);
        }
        loop {
            match self.client.read(&mut self.reader)? {
                FromInit::Stdout(d) => {
                    stdout.write_all(&d)?;
                    stdout.flush()?;
                }
                FromInit::Stderr(d) => {
                    stderr.write_all(&d)?;
                    stderr.flush()?;
                }
                FromInit::Exited(status) => return Ok(Some(status)),
                FromInit::Error(e) => return Err(ClientError::Refused(e)),
                other => return Err(unexpected(&other)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_from_init_is_cut_on_a_character_boundary() {
        let long = "é".repeat(MESSAGE_MAX);
        let cut = bounded(long.clone());
        assert!(cut.len() < MESSAGE_MAX + 40, "{} bytes kept", cut.len());
        assert!(cut.starts_with(&long[..MESSAGE_MAX]));
        assert!(cut.ends_with(&format!(" [{} more bytes cut]", long.len() - MESSAGE_MAX)));
        assert_eq!(bounded("short".into()), "short");
        let frame = unexpected(&FromInit::Stdout(vec![0; 1 << 20])).to_string();
        assert!(frame.len() < 2 * MESSAGE_MAX, "{} bytes kept", frame.len());
    }

    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;

    #[test]
    fn a_peer_that_accepts_and_never_answers_fails_a_ping_rather_than_holding_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silent.sock");
        // Connections wait in its backlog; nothing ever answers.
        let _silent = UnixListener::bind(&path).unwrap();
        let client = InitClient::new(&path);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(client.ping(Duration::from_millis(50)).is_err()));
        // Only a guard against hanging the test run, not a speed check.
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(120)),
            Ok(true),
            "ping waited for the welcome for ever"
        );
    }

    #[test]
    fn file_and_control_requests_to_an_init_that_stopped_answering_give_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stopped.sock");
        let _stopped = UnixListener::bind(&path).unwrap();
        let client = InitClient::new(&path).with_deadline(Duration::from_millis(200));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let outcomes = [
                client.stat("/etc/passwd").err(),
                client.list_dir("/", 1, 10).err(),
                client.kill(1, 15).err(),
                client.get_file("/etc/passwd", &mut std::io::sink()).err(),
            ];
            tx.send(outcomes.map(|e| matches!(e, Some(ClientError::TimedOut))))
        });
        // Only a guard against hanging the test run, not a speed check.
        assert_eq!(rx.recv_timeout(Duration::from_secs(120)), Ok([true; 4]));
    }

    /// A peer that welcomes one connection, reads its request and sends
    /// `frames`, as a hostile init could.
    fn forging_init(frames: Vec<FromInit>) -> (tempfile::TempDir, InitClient) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("forging.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let _: ToInit = read_frame(&mut stream).unwrap();
            let _: ToInit = read_frame(&mut stream).unwrap();
            let mut wire = Vec::new();
            write_frame(
                &mut wire,
                &FromInit::Welcome {
                    version: PROTOCOL_VERSION,
                    init_pid: 1,
                },
            )
            .unwrap();
            for f in &frames {
                write_frame(&mut wire, f).unwrap();
            }
            let _ = stream.write_all(&wire);
        });
        (dir, InitClient::new(&path))
    }

    fn entry(path: &str, kind: FileKind, target: Option<&str>) -> FromInit {
        FromInit::Entry(DirEntry {
            meta: FileMeta {
                path: path.into(),
                kind,
                mode: 0o644,
                uid: 0,
                gid: 0,
                size: 0,
                mtime_ns: 0,
            },
            symlink_target: target.map(String::from),
        })
    }

    #[test]
    fn a_listing_init_answers_within_the_request_is_sorted() {
        let (_dir, client) = forging_init(vec![
            entry("/w/b", FileKind::Dir, None),
            entry("/w/b/c", FileKind::Symlink, Some("/etc")),
            entry("/w/a", FileKind::File, None),
            FromInit::EntriesEnd { truncated: true },
        ]);
        let listing = client.list_dir("/w/", 2, 3).unwrap();
        let paths: Vec<_> = listing.entries.iter().map(|e| e.meta.path.as_str()).collect();
        assert_eq!(paths, ["/w/a", "/w/b", "/w/b/c"]);
        assert!(listing.truncated);
    }

    #[test]
    fn a_listing_that_strays_from_the_request_is_refused() {
        let long = format!("/w/{}", "x".repeat(PATH_MAX));
        let forged = [
            (
                vec![entry("/w/a", FileKind::File, None), entry("/w/b", FileKind::File, None)],
                "past the number",
            ),
            (vec![entry("/etc/passwd", FileKind::File, None)], "outside"),
            (vec![entry("/wx", FileKind::File, None)], "outside"),
            (vec![entry("/w", FileKind::Dir, None)], "outside"),
            (vec![entry("/w/a/b/c", FileKind::File, None)], "deeper"),
            (vec![entry("/w/../etc", FileKind::File, None)], ". or .."),
            (vec![entry("/w//a", FileKind::File, None)], "empty"),
            (vec![entry(&long, FileKind::File, None)], "longer than"),
            (vec![entry("/w/l", FileKind::Symlink, Some(&long[1..]))], "longer than"),
            (vec![entry("/w/f", FileKind::File, Some("/etc"))], "not a symlink"),
            (vec![FromInit::Pong], "Pong"),
        ];
        for (frames, why) in forged {
            let (_dir, client) = forging_init(frames);
            let err = client.list_dir("/w", 2, 1).unwrap_err();
            assert!(
                matches!(&err, ClientError::Unexpected(m) if m.contains(why)),
                "{why}: {err}"
            );
            assert!(err.to_string().len() < 2 * MESSAGE_MAX, "{err}");
        }
    }

    #[test]
    fn a_file_operation_refused_by_init_keeps_its_kind_and_a_bounded_message() {
        let (_dir, client) = forging_init(vec![FromInit::FsError {
            kind: FsErrorKind::NotEmpty,
            message: "x".repeat(1 << 20),
        }]);
        match client.remove("/w", false).unwrap_err() {
            ClientError::Fs(FsFailure { kind, message }) => {
                assert_eq!(kind, FsErrorKind::NotEmpty);
                assert!(message.len() < MESSAGE_MAX + 40, "{} bytes kept", message.len());
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_listing_out_of_range_is_refused_before_it_is_sent() {
        let client = InitClient::new("/nonexistent/init.sock");
        for (depth, max) in [(0, 1), (LIST_DEPTH_MAX + 1, 1), (1, 0), (1, LIST_ENTRIES_MAX + 1)] {
            let err = client.list_dir("/", depth, max).unwrap_err();
            assert!(
                matches!(
                    &err,
                    ClientError::Fs(FsFailure {
                        kind: FsErrorKind::Invalid,
                        ..
                    })
                ),
                "{depth} {max}: {err}"
            );
        }
    }
}
