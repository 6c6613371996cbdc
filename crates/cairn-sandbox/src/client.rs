//! The host side of the init protocol: one connection per operation.

use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cairn_protocol::{
    encode_frame, hello, read_frame, write_frame, ExecRequest, ExitStatus, FileMeta, FrameError, FromInit,
    SpawnErrorKind, ToInit, DATA_CHUNK, PROTOCOL_VERSION,
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
}

/// The most of a message from init (an error, a spawn failure) the host
/// keeps: init is inside the sandbox, and its messages end up in errors,
/// pipeline events and the state store.
pub const MESSAGE_MAX: usize = 4 << 10;

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
    /// socket among its generations (gVisor; see [`crate::gvisor::sockets`]).
    shared_directory: bool,
}

impl InitClient {
    /// A client for the socket at `socket`, which the host made.
    pub fn new(socket: impl Into<PathBuf>) -> InitClient {
        InitClient {
            socket: socket.into(),
            shared_directory: false,
        }
    }

    /// A client for init's socket inside `dir`, a directory the sandbox can
    /// write: nothing there is followed, only init's sockets are used.
    pub fn in_shared_directory(dir: impl Into<PathBuf>) -> InitClient {
        InitClient {
            socket: dir.into(),
            shared_directory: true,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn connect(&self) -> io::Result<UnixStream> {
        if self.shared_directory {
            crate::gvisor::sockets::connect(&self.socket)
        } else {
            UnixStream::connect(&self.socket)
        }
    }

    /// Connects and sends `request` right behind the hello (one write), then
    /// checks the welcome.
    fn open(&self, request: &ToInit) -> Result<(UnixStream, BufReader<UnixStream>), ClientError> {
        self.open_within(request, None)
    }

    /// [`Self::open`], every read on the connection (the welcome included)
    /// giving up after `timeout`: a peer that accepts and never answers
    /// cannot hold the host.
    fn open_within(
        &self,
        request: &ToInit,
        timeout: Option<Duration>,
    ) -> Result<(UnixStream, BufReader<UnixStream>), ClientError> {
        let mut stream = self.connect().map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ClientError::NotRunning(self.socket.clone()),
            _ => ClientError::Io(e),
        })?;
        stream.set_read_timeout(timeout)?;
        let mut buf = Vec::new();
        let mut frame = Vec::new();
        encode_frame(&hello(), &mut frame)?;
        buf.extend_from_slice(&frame);
        encode_frame(request, &mut frame)?;
        buf.extend_from_slice(&frame);
        stream.write_all(&buf).map_err(|e| self.lost(e))?;
        let mut reader = BufReader::with_capacity(DATA_CHUNK + 64, stream.try_clone()?);
        match self.read(&mut reader)? {
            FromInit::Welcome { version, .. } if version == PROTOCOL_VERSION => Ok((stream, reader)),
            FromInit::Error(e) => Err(ClientError::Refused(e)),
            other => Err(unexpected(&other)),
        }
    }

    fn lost(&self, e: io::Error) -> ClientError {
        match e.kind() {
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
        let detach = req.detach;
        let (stream, mut reader) = self.open(&ToInit::Exec(req))?;
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
        let (stream, mut reader) = self.open(&ToInit::AttachJob {
            name: name.to_string(),
            stdout_from,
            stderr_from,
        })?;
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

    pub fn stat(&self, path: &str) -> Result<Option<FileMeta>, ClientError> {
        let (_stream, mut reader) = self.open(&ToInit::Stat { path: path.to_string() })?;
        match self.read(&mut reader)? {
            FromInit::Stat(meta) => Ok(meta),
            other => Err(unexpected(&other)),
        }
    }

    /// Streams `src` into a file in the sandbox described by `meta`.
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
        let (_stream, mut reader) = self.open(&ToInit::GetFile { path: path.to_string() })?;
        let meta = match self.read(&mut reader)? {
            FromInit::File(meta) => meta,
            FromInit::Error(e) => return Err(ClientError::Refused(e)),
            other => return Err(unexpected(&other)),
        };
        loop {
            match self.read(&mut reader)? {
                FromInit::Data(d) => dst.write_all(&d)?,
                FromInit::End => return Ok(meta),
                FromInit::Error(e) => return Err(ClientError::Refused(e)),
                other => return Err(unexpected(&other)),
            }
        }
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
            FromInit::Error(e) => Err(ClientError::Refused(e)),
            other => Err(unexpected(&other)),
        }
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
}
