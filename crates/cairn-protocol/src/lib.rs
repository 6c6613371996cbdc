//! The protocol between the host and `cairn-init`, PID 1 of every sandbox.
//!
//! A connection carries frames: a 4-byte little-endian length followed by a
//! bincode-encoded [`ToInit`] or [`FromInit`]. The first frame a client sends
//! is [`ToInit::Hello`] carrying [`MAGIC`] and [`PROTOCOL_VERSION`]; the
//! client may pipeline its request right behind it, so a round trip costs one
//! exchange. One connection carries one operation (an exec, a file transfer,
//! a ping), which keeps both ends free of multiplexing state.
//!
//! Readers never trust a length they have not checked: frames above
//! [`MAX_FRAME_LEN`] are refused before any allocation.

use std::io::{self, Read, Write};

use bincode::Options;
use serde::{Deserialize, Serialize};

/// Identifies a Cairn init connection ("CRNI").
pub const MAGIC: u32 = 0x4352_4e49;
/// Bumped whenever a message changes shape. See `docs/formats.md`.
pub const PROTOCOL_VERSION: u16 = 1;
/// The byte that carries the listening socket and the console log to
/// `cairn-init --native-setup` (`SCM_RIGHTS`), just before its setup frame.
pub const SETUP_FDS_MARKER: u8 = b'F';
/// Largest frame either side accepts (payload bytes).
pub const MAX_FRAME_LEN: u32 = 8 << 20;
/// Size of the data chunks senders put in one frame.
pub const DATA_CHUNK: usize = 256 << 10;
/// The file descriptor on which cairn-init receives its listening socket.
pub const LISTEN_FD: i32 = 3;
/// Deepest listing [`ToInit::ListDir`] accepts (1: the directory's children).
pub const LIST_DEPTH_MAX: u32 = 16;
/// Most entries one listing returns; past it the listing is cut short and
/// says so.
pub const LIST_ENTRIES_MAX: u32 = 10_000;
/// Most bytes of paths and symlink targets one listing returns; past it the
/// listing is cut short and says so.
pub const LIST_BYTES_MAX: usize = 8 << 20;
/// Longest path or symlink target in a listing (Linux's `PATH_MAX`).
pub const PATH_MAX: usize = 4096;

/// A request or stream item sent by the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToInit {
    /// First frame of every connection.
    Hello { magic: u32, version: u16 },
    /// Liveness check; answered with [`FromInit::Pong`].
    Ping,
    /// Run a process.
    Exec(ExecRequest),
    /// Bytes for the running process's stdin.
    Stdin(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Close the running process's stdin.
    StdinEof,
    /// Deliver a signal to the running process's group (the exec on this
    /// connection).
    Signal(i32),
    /// Deliver a signal to any process of the sandbox (e.g. one started with
    /// `detach`).
    Kill { pid: i32, signal: i32 },
    /// Describe a path.
    Stat { path: String },
    /// Write a file: followed by [`ToInit::Data`] frames and [`ToInit::End`].
    PutFile(FileMeta),
    /// Read a file: answered with [`FromInit::File`], data frames and
    /// [`FromInit::End`].
    GetFile { path: String },
    /// A chunk of file content.
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    /// End of a data stream.
    End,
    /// The sandbox was just restored or forked from a snapshot: set the wall
    /// clock (where the driver owns it) and mix fresh entropy into the RNG.
    Restored {
        unix_time_ns: u128,
        #[serde(with = "serde_bytes")]
        entropy: Vec<u8>,
    },
    /// Before a memory checkpoint: stop listening, end every other
    /// connection, answer [`FromInit::Done`] once none is left, then close
    /// this one. Init listens again on SIGUSR2. Only an init that binds its
    /// own socket (`CAIRN_INIT_LISTEN_PATH`, the gVisor driver) can do this.
    Quiesce,
    /// Start a named job: a process whose output init keeps and whose end
    /// any later connection can wait for ([`ToInit::AttachJob`]). Answered
    /// with [`FromInit::Started`], [`FromInit::SpawnFailed`] or an error when
    /// the name is taken. `request.stdin` and `request.detach` are ignored.
    StartJob { name: String, request: ExecRequest },
    /// Follow a job: [`FromInit::Started`], then its stdout and stderr from
    /// these byte offsets as they come, then [`FromInit::Exited`]. An error
    /// when init has no job of that name.
    AttachJob {
        name: String,
        stdout_from: u64,
        stderr_from: u64,
    },
    /// List a directory, never following a symlink (the directory itself
    /// included): [`FromInit::Entry`] frames, at most `max_entries` (at most
    /// [`LIST_ENTRIES_MAX`]), then [`FromInit::EntriesEnd`]; or
    /// [`FromInit::FsError`]. `depth` 1 lists the children, up to
    /// [`LIST_DEPTH_MAX`] descends that many levels.
    ListDir { path: String, depth: u32, max_entries: u32 },
    /// Make a directory (and, with `parents`, its missing ancestors):
    /// answered with [`FromInit::Made`] or [`FromInit::FsError`].
    MakeDir { path: String, parents: bool },
    /// Rename as rename(2) does (replacing a file or an empty directory):
    /// answered with [`FromInit::Done`] or [`FromInit::FsError`].
    Rename { from: String, to: String },
    /// Remove a file, a symlink (not what it points to), an empty directory,
    /// or with `recursive` a directory tree, never following a symlink out
    /// of it nor crossing into another mount: answered with
    /// [`FromInit::Done`] or [`FromInit::FsError`].
    Remove { path: String, recursive: bool },
    /// Watch the directory `path` (with `recursive`, the directories below
    /// it too, those made later included): answered with
    /// [`FromInit::Watching`] or [`FromInit::FsError`], then
    /// [`FromInit::Events`] as changes happen, until the host closes the
    /// connection or the directory goes ([`FromInit::End`]).
    Watch { path: String, recursive: bool },
    /// Run a process on a new pseudo-terminal of this size: the process
    /// leads a new session with the terminal as its controlling one and
    /// as its stdin, stdout and stderr. Answered as [`ToInit::Exec`]; all
    /// output comes as [`FromInit::Stdout`] (`request.stdin` and
    /// `request.detach` are ignored: stdin is always the host's, and
    /// [`ToInit::StdinEof`] types the terminal's end-of-file character).
    ExecPty { request: ExecRequest, size: PtySize },
    /// New size for the terminal of the exec on this connection (its
    /// foreground process group gets SIGWINCH); ignored without one.
    Resize(PtySize),
    /// Connect to TCP `port` on the sandbox's loopback (127.0.0.1, else
    /// ::1): answered with [`FromInit::Done`], after which the connection
    /// carries the TCP stream's bytes both ways, unframed, until either
    /// side closes; or with [`FromInit::Error`] when nothing answers.
    ConnectPort { port: u16 },
    /// A process request ([`ToInit::Exec`], [`ToInit::ExecPty`] or
    /// [`ToInit::StartJob`]) whose process runs as `ids` rather than as
    /// the sandbox's root: what [`ExecRequest::user`] becomes on the wire
    /// ([`ToInit::on_wire`]), so a request without a user is encoded as
    /// before and an older init refuses only what it cannot do.
    AsUser { ids: Ids, request: Box<ToInit> },
    /// [`ToInit::MakeDir`], each directory it makes owned by `owner`
    /// (what a user's own `mkdir` would leave).
    MakeDirAs { path: String, parents: bool, owner: Ids },
    /// Set extended attributes of the file or directory `path` (never
    /// through a link): each name is under [`XATTR_PREFIX`]. Answered with
    /// [`FromInit::Done`] or [`FromInit::FsError`].
    SetXattrs { path: String, attrs: Vec<(String, String)> },
    /// The [`XATTR_PREFIX`] attributes of each path (at most
    /// [`XATTR_PATHS_MAX`]), names without the prefix: answered with
    /// [`FromInit::Xattrs`], an empty list for a path that has none, is
    /// gone, or is not a file or directory.
    GetXattrs { paths: Vec<String> },
}

/// The extended attributes the file operations read and write: E2B's
/// file metadata (`user.e2b.KEY`).
pub const XATTR_PREFIX: &str = "user.e2b.";
/// The most paths one [`ToInit::GetXattrs`] names.
pub const XATTR_PATHS_MAX: usize = 4096;
/// The most attributes a file answers, and the longest name and value.
pub const XATTRS_MAX: usize = 64;
pub const XATTR_NAME_MAX: usize = 200;
pub const XATTR_VALUE_MAX: usize = 4096;

/// A user and group of the sandbox (ids as the sandbox sees them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
}

impl ToInit {
    /// The process request inside, if this is one.
    fn exec_request(&mut self) -> Option<&mut ExecRequest> {
        match self {
            ToInit::Exec(r) | ToInit::ExecPty { request: r, .. } | ToInit::StartJob { request: r, .. } => Some(r),
            _ => None,
        }
    }

    /// What goes on the wire: a process request whose [`ExecRequest::user`]
    /// is set, wrapped in [`ToInit::AsUser`]; anything else as it is.
    pub fn on_wire(&self) -> std::borrow::Cow<'_, ToInit> {
        let user = match self {
            ToInit::Exec(r) | ToInit::ExecPty { request: r, .. } | ToInit::StartJob { request: r, .. } => r.user,
            _ => None,
        };
        match user {
            None => std::borrow::Cow::Borrowed(self),
            Some(ids) => std::borrow::Cow::Owned(ToInit::AsUser {
                ids,
                request: Box::new(self.clone()),
            }),
        }
    }

    /// What init serves: [`ToInit::AsUser`] unwrapped into its process
    /// request with [`ExecRequest::user`] set; an error when it wraps
    /// anything else.
    pub fn from_wire(self) -> Result<ToInit, String> {
        match self {
            ToInit::AsUser { ids, request } => {
                let mut inner = *request;
                match inner.exec_request() {
                    Some(r) => {
                        r.user = Some(ids);
                        Ok(inner)
                    }
                    None => Err("AsUser wraps only Exec, ExecPty or StartJob".to_string()),
                }
            }
            other => Ok(other),
        }
    }
}

/// A terminal's size in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// The most events one [`FromInit::Events`] frame carries.
pub const WATCH_BATCH_MAX: usize = 256;

/// What happened to a name in a watched directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WatchKind {
    Create,
    Write,
    Remove,
    /// Moved away (its new name, if still watched, comes as a `Create`).
    Rename,
    /// Mode, owner or times changed.
    Chmod,
}

/// One change in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// Relative to the watched directory (`sub/file` below it when
    /// recursive).
    pub name: String,
    pub kind: WatchKind,
}

/// A reply or stream item sent by cairn-init.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromInit {
    /// The hello was accepted.
    Welcome {
        version: u16,
        init_pid: i32,
    },
    Pong,
    /// The process was started.
    Started {
        pid: i32,
    },
    Stdout(#[serde(with = "serde_bytes")] Vec<u8>),
    Stderr(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The process ended; its output streams are complete.
    Exited(ExitStatus),
    /// The process could not be started.
    SpawnFailed {
        kind: SpawnErrorKind,
        message: String,
    },
    /// Answer to [`ToInit::Stat`].
    Stat(Option<FileMeta>),
    /// Header of a file sent by [`ToInit::GetFile`].
    File(FileMeta),
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    End,
    /// The operation succeeded with nothing to report.
    Done,
    /// The operation failed; the message says why.
    Error(String),
    /// One entry of a listing ([`ToInit::ListDir`]).
    Entry(DirEntry),
    /// The listing is complete, or was cut short at a cap (`truncated`).
    EntriesEnd {
        truncated: bool,
    },
    /// Answer to [`ToInit::MakeDir`]: whether the directory was created
    /// (false: it was already there).
    Made {
        created: bool,
    },
    /// A file operation failed; the kind says how, the message says why.
    FsError {
        kind: FsErrorKind,
        message: String,
    },
    /// [`ToInit::Watch`] is set up: events follow.
    Watching,
    /// Changes in a watched directory, in the order they happened (at most
    /// [`WATCH_BATCH_MAX`]).
    Events(Vec<WatchEvent>),
    /// Answer to [`ToInit::GetXattrs`]: each path's attributes, in order.
    Xattrs(Vec<Vec<(String, String)>>),
}

/// How to run a process inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    /// Added to the default environment (PATH, HOME, TERM); later entries win.
    pub env: Vec<(String, String)>,
    /// Working directory; `/` when absent.
    pub cwd: Option<String>,
    /// Whether the host will stream stdin; otherwise stdin is `/dev/null`.
    pub stdin: bool,
    /// Kill the process group after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Start in the background and answer at once with [`FromInit::Started`];
    /// output goes to the sandbox log.
    pub detach: bool,
    /// Run as this user and group (no supplementary groups, no
    /// capabilities) instead of the sandbox's root. Not encoded in this
    /// struct: [`ToInit::on_wire`] carries it as [`ToInit::AsUser`].
    #[serde(skip)]
    pub user: Option<Ids>,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code when the process exited normally.
    pub code: Option<i32>,
    /// Signal number when it was killed by a signal.
    pub signal: Option<i32>,
    /// Whether Cairn killed it because its timeout expired.
    pub timed_out: bool,
}

impl ExitStatus {
    /// The shell convention: the exit code, or 128 + the signal number.
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(code), _) => code,
            (None, Some(sig)) => 128 + sig,
            (None, None) => 255,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpawnErrorKind {
    /// The program does not exist (shell code 127).
    NotFound,
    /// The program exists but cannot be executed (shell code 126).
    PermissionDenied,
    /// Anything else, e.g. a bad working directory.
    Other,
}

impl SpawnErrorKind {
    pub fn shell_code(self) -> i32 {
        match self {
            SpawnErrorKind::NotFound => 127,
            SpawnErrorKind::PermissionDenied => 126,
            SpawnErrorKind::Other => 125,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// A file's path and metadata as sent over the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub path: String,
    pub kind: FileKind,
    /// Permission bits (including setuid/setgid/sticky).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// The entry itself, never what a symlink points to; `meta.path` is the
    /// listed directory's path joined with the names below it.
    pub meta: FileMeta,
    /// For a symlink, what it points to (read, not followed).
    pub symlink_target: Option<String>,
}

/// How a file operation failed, for the host to map (to an HTTP status, an
/// errno).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsErrorKind {
    NotFound,
    /// Something is already at the path.
    Exists,
    /// A directory was needed and something else is there.
    NotADirectory,
    /// A directory is where something else was needed.
    IsADirectory,
    /// A directory that had to be empty is not.
    NotEmpty,
    PermissionDenied,
    /// The request itself is wrong (a relative path, a depth out of range).
    Invalid,
    Other,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection to cairn-init failed: {0}")]
    Io(#[from] io::Error),
    #[error("cairn-init sent a frame of {0} bytes, above the {MAX_FRAME_LEN}-byte limit; the peer is not speaking the Cairn protocol")]
    TooLarge(u32),
    #[error("cannot decode a frame from cairn-init ({0}); host and init versions may differ, rebuild both from one checkout")]
    Decode(String),
    #[error("cannot encode a frame: {0}")]
    Encode(String),
    #[error("the peer closed the connection")]
    Closed,
}

/// The payload encoding: bincode 1.3's default layout (fixed-width little
/// endian integers), no trailing bytes, and no length inside a payload
/// beyond [`MAX_FRAME_LEN`].
fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .with_limit(u64::from(MAX_FRAME_LEN))
        .reject_trailing_bytes()
}

/// Encodes `msg` as one frame into `buf` (cleared first), ready for one write.
pub fn encode_frame<T: Serialize>(msg: &T, buf: &mut Vec<u8>) -> Result<(), FrameError> {
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    options()
        .serialize_into(&mut *buf, msg)
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = u32::try_from(buf.len() - 4).map_err(|_| FrameError::TooLarge(u32::MAX))?;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    buf[..4].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// Writes one frame.
pub fn write_frame<T: Serialize, W: Write>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    let mut buf = Vec::new();
    encode_frame(msg, &mut buf)?;
    w.write_all(&buf)?;
    Ok(())
}

/// Reads one frame; [`FrameError::Closed`] on a clean end of stream.
pub fn read_frame<T: for<'de> Deserialize<'de>, R: Read>(r: &mut R) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    // Grown as bytes arrive: a peer that declares 8 MiB and sends nothing
    // costs no more than what it sent.
    let mut payload = Vec::with_capacity((len as usize).min(64 * 1024));
    r.take(u64::from(len)).read_to_end(&mut payload)?;
    if payload.len() < len as usize {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    decode_payload(&payload)
}

/// Decodes one frame's payload (the bytes after its length). A payload is
/// hostile: the host decodes what a sandbox sends, init what a host
/// process sends. Lengths inside it are checked against the bytes that are
/// there before anything is allocated for them, and a payload with bytes
/// left over is refused.
pub fn decode_payload<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> Result<T, FrameError> {
    options()
        .deserialize(payload)
        .map_err(|e| FrameError::Decode(e.to_string()))
}

/// The hello every client sends first.
pub fn hello() -> ToInit {
    ToInit::Hello {
        magic: MAGIC,
        version: PROTOCOL_VERSION,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let msgs = vec![
            hello(),
            ToInit::Exec(ExecRequest {
                argv: vec!["echo".into(), "hi".into()],
                env: vec![("A".into(), "b".into())],
                cwd: Some("/tmp".into()),
                stdin: true,
                timeout_ms: Some(5),
                detach: false,
                user: None,
            }),
            ToInit::Data(vec![7; 1000]),
            ToInit::Restored {
                unix_time_ns: 1,
                entropy: vec![1, 2, 3],
            },
            ToInit::Quiesce,
            ToInit::ListDir {
                path: "/work".into(),
                depth: 2,
                max_entries: 100,
            },
            ToInit::Remove {
                path: "/work/x".into(),
                recursive: true,
            },
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            write_frame(&mut wire, m).unwrap();
        }
        let mut r = &wire[..];
        for m in &msgs {
            let got: ToInit = read_frame(&mut r).unwrap();
            assert_eq!(&got, m);
        }
        assert!(matches!(read_frame::<ToInit, _>(&mut r), Err(FrameError::Closed)));
    }

    #[test]
    fn oversized_length_is_refused_before_allocating() {
        let wire = (MAX_FRAME_LEN + 1).to_le_bytes();
        let err = read_frame::<ToInit, _>(&mut &wire[..]).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge(_)), "{err}");
    }

    #[test]
    fn garbage_payload_is_a_decode_error() {
        let mut wire = 3u32.to_le_bytes().to_vec();
        wire.extend_from_slice(&[0xff, 0xff, 0xff]);
        let err = read_frame::<ToInit, _>(&mut &wire[..]).unwrap_err();
        assert!(matches!(err, FrameError::Decode(_)), "{err}");
    }

    #[test]
    fn trailing_bytes_after_a_message_are_refused() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &ToInit::Ping).unwrap();
        wire[0] += 1;
        wire.push(0);
        let err = read_frame::<ToInit, _>(&mut &wire[..]).unwrap_err();
        assert!(matches!(err, FrameError::Decode(_)), "{err}");
    }

    #[test]
    fn a_user_travels_as_as_user_and_a_request_without_one_is_encoded_as_before() {
        let plain = ExecRequest {
            argv: vec!["id".into()],
            ..ExecRequest::default()
        };
        let as_user = ExecRequest {
            user: Some(Ids { uid: 1000, gid: 1000 }),
            ..plain.clone()
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        encode_frame(ToInit::Exec(plain.clone()).on_wire().as_ref(), &mut a).unwrap();
        encode_frame(&ToInit::Exec(plain.clone()), &mut b).unwrap();
        assert_eq!(a, b, "no user: the frame an older init reads");
        for request in [
            ToInit::Exec(as_user.clone()),
            ToInit::ExecPty {
                request: as_user.clone(),
                size: PtySize { cols: 80, rows: 24 },
            },
            ToInit::StartJob {
                name: "j".into(),
                request: as_user.clone(),
            },
        ] {
            let mut frame = Vec::new();
            encode_frame(request.on_wire().as_ref(), &mut frame).unwrap();
            let decoded: ToInit = read_frame(&mut frame.as_slice()).unwrap();
            assert!(matches!(decoded, ToInit::AsUser { .. }));
            assert_eq!(decoded.from_wire().unwrap(), request, "the user survives the wire");
        }
        let bad = ToInit::AsUser {
            ids: Ids::default(),
            request: Box::new(ToInit::Ping),
        };
        assert!(bad.from_wire().is_err());
    }

    #[test]
    fn the_encoding_is_bincode_default_layout() {
        // The wire format: a u32 variant index, then fixed-width fields.
        let mut wire = Vec::new();
        write_frame(&mut wire, &hello()).unwrap();
        let mut expected = 10u32.to_le_bytes().to_vec();
        expected.extend_from_slice(&0u32.to_le_bytes());
        expected.extend_from_slice(&MAGIC.to_le_bytes());
        expected.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(wire, expected);
    }

    #[test]
    fn truncated_frame_is_an_io_error() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &ToInit::Ping).unwrap();
        wire.extend_from_slice(&100u32.to_le_bytes());
        wire.extend_from_slice(&[1, 2]);
        let mut r = &wire[..];
        let _: ToInit = read_frame(&mut r).unwrap();
        assert!(matches!(read_frame::<ToInit, _>(&mut r), Err(FrameError::Io(_))));
    }

    #[test]
    fn shell_codes_follow_convention() {
        let killed = ExitStatus {
            code: None,
            signal: Some(9),
            timed_out: false,
        };
        assert_eq!(killed.shell_code(), 137);
        assert_eq!(SpawnErrorKind::NotFound.shell_code(), 127);
    }
}

/// How `cairn-init --native-setup` builds a native sandbox around itself
/// before it serves: the host's driver decides the policy (layers, limits,
/// capabilities, seccomp filter) and passes it here; init carries it out in
/// a small, fresh, single-threaded process, which is what makes starting a
/// sandbox cheap (no fork of a large host process).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NativeSetup {
    /// Must equal [`PROTOCOL_VERSION`].
    pub version: u16,
    /// cgroup files (v1 `tasks`, v2 `cgroup.procs`) to write `0` to, joining
    /// the sandbox's cgroups (PID 1 is single-threaded then). The host makes
    /// them while PID 1 builds the root and says `G` once they exist.
    pub cgroup_procs: Vec<String>,
    /// Where to mount the overlay root (a host path).
    pub rootfs: String,
    /// Read-only layers, topmost first (host paths).
    pub lower_dirs: Vec<String>,
    /// How the layers reach overlayfs: the host probes which way the
    /// running kernel accepts ([`LayerMount`]).
    #[serde(default)]
    pub layer_mount: LayerMount,
    /// The sandbox's private upper directory and overlayfs' work directory.
    pub upper_dir: String,
    pub work_dir: String,
    /// The size of the sandbox's `/dev/shm` tmpfs in bytes; 0: 64 MiB.
    #[serde(default)]
    pub shm_bytes: u64,
    pub hostname: String,
    /// The sandbox's user namespace maps its ids `0..id_count` to host ids
    /// `host_id_base..host_id_base + id_count` (uids and gids alike): the
    /// sandbox's root is an unprivileged host id.
    pub host_id_base: u32,
    pub id_count: u32,
    /// Bit mask of the capabilities to keep; all others are dropped from
    /// every set, the bounding set included.
    pub keep_capabilities: u64,
    /// Seccomp filters to install, each a classic BPF program.
    pub seccomp: Vec<Vec<BpfInstruction>>,
    /// The sandbox's network beyond loopback (`--network egress`): the
    /// host moves a veth end named `eth0` into the namespace after `P`,
    /// then writes `G\n` (see `cgroup_procs`); PID 1 configures it before reporting `R`.
    #[serde(default)]
    pub network: Option<NetSetup>,
}

/// How a native sandbox's read-only layers are given to overlayfs. Layers
/// are stored with the sandbox's own ids (root is 0); the sandbox must see
/// them as the host ids its user namespace maps those to, without any host
/// path showing in its mount table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerMount {
    /// Each layer an idmapped, detached mount handed to overlayfs as a file
    /// descriptor (`lowerdir+`; Linux 6.13).
    #[default]
    Descriptors,
    /// Each layer an idmapped mount attached under a private directory of
    /// init's mount namespace and named there by a relative path, in a
    /// classic overlay mount (idmapped lower layers: Linux 5.19).
    IdmappedPaths,
    /// The layers given are copies whose ids are already shifted into the
    /// sandbox's host range: plain read-only mounts, named as
    /// [`LayerMount::IdmappedPaths`] names them (any overlayfs).
    ShiftedPaths,
}

/// The address of a sandbox's `eth0` and the files its resolver reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetSetup {
    pub address: [u8; 4],
    pub prefix_len: u8,
    pub gateway: [u8; 4],
    /// Host files bound read-only over `/etc/resolv.conf` and `/etc/hosts`.
    pub resolv_conf: String,
    pub hosts: Option<String>,
}

/// One classic BPF instruction: (code, jt, jf, k).
pub type BpfInstruction = (u16, u8, u8, u32);

#[cfg(test)]
mod setup_tests {
    use super::*;

    #[test]
    fn native_setup_round_trips_as_a_frame() {
        let s = NativeSetup {
            version: PROTOCOL_VERSION,
            cgroup_procs: vec!["/sys/fs/cgroup/x/cgroup.procs".into()],
            rootfs: "/r".into(),
            lower_dirs: vec!["/a".into()],
            layer_mount: LayerMount::default(),
            upper_dir: "/u".into(),
            work_dir: "/w".into(),
            shm_bytes: 32 << 20,
            hostname: "h".into(),
            host_id_base: 0x7000_0000,
            id_count: 65536,
            keep_capabilities: 0xff,
            seccomp: vec![vec![(6, 0, 0, 0x7fff0000)]],
            network: None,
        };
        let mut wire = Vec::new();
        write_frame(&mut wire, &s).unwrap();
        assert_eq!(read_frame::<NativeSetup, _>(&mut &wire[..]).unwrap(), s);
    }
}
