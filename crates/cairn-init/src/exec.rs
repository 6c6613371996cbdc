//! Running a process for the host: streamed output, stdin, signals, timeout.
//!
//! A foreground exec is a state machine ([`Exec`]) driven by the serving
//! loop ([`crate::hub`]), which polls every exec's pipes and connection in
//! one thread: no thread is started for a command, so a command that uses
//! up the sandbox's process limit (a fork bomb) never leaves init unable to
//! serve it or the next one. Every descriptor here is non-blocking; what the
//! host has not taken yet is held (up to [`OUT_HELD`]), and the command's
//! pipes are not read meanwhile, so a slow host slows its own command as a
//! full pipe would, and nobody else's.

use std::fs::File;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_protocol::{
    decode_payload, encode_frame, ExecRequest, ExitStatus, FrameError, FromInit, PtySize, SpawnErrorKind, ToInit,
    DATA_CHUNK, MAX_FRAME_LEN,
};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::conns::Live;
use crate::reaper::Reaper;
use crate::spawn;

/// How long output may keep flowing after the process exited (a background
/// grandchild can hold the pipes open forever).
pub(crate) const DRAIN_GRACE: Duration = Duration::from_millis(250);

/// Stdin held for a command that is not reading before the host's next
/// frames wait.
const STDIN_HELD: usize = 4 * DATA_CHUNK;

/// Output held for a host that is not reading before the command's pipes
/// wait.
pub(crate) const OUT_HELD: usize = 2 * DATA_CHUNK;

/// The terminal's end-of-file character (^D) in its default settings.
const EOT: u8 = 0x04;

/// The most bytes of frames from the host read in one go.
pub(crate) const HOST_READ: usize = 64 << 10;

/// One foreground exec: its command, and the connection it answers on.
pub struct Exec {
    host: UnixStream,
    /// Frames from the host not yet handled (at most one frame past what is
    /// complete: see [`Exec::wants_host`]).
    host_in: Vec<u8>,
    /// False once the host hung up (or broke the protocol): stdin ends.
    host_open: bool,
    /// Frames for the host not yet written.
    out: Vec<u8>,
    /// Set once a write to the host failed: output is drained and dropped.
    host_gone: bool,
    pid: i32,
    exited: Receiver<ExitStatus>,
    pipes: [Option<File>; 2],
    stdin: Option<File>,
    /// The controlling side of the command's terminal, when it runs on one
    /// (its output comes through `pipes[0]`, its input goes through
    /// `stdin`, both the same terminal).
    terminal: Option<File>,
    /// Stdin the pipe has not taken yet.
    pending: Vec<u8>,
    stdin_eof: bool,
    deadline: Option<Instant>,
    timed_out: bool,
    status: Option<ExitStatus>,
    drain_until: Option<Instant>,
    /// Set once `Exited` is queued: late output is dropped, and the exec is
    /// over once the host has it.
    finished: bool,
    /// Dropped with the exec: the quiesce waits for it.
    _live: Arc<Live>,
}

/// What an exec wants polled; the loop reports back what is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interest {
    Stdout,
    Stderr,
    Stdin,
    HostIn,
    HostOut,
}

/// What became of a request to run a command.
pub enum Begun {
    /// A foreground command is running; follow it.
    Running(Box<Exec>),
    /// Answered at once (detached, refused, failed to start): write these
    /// frames and close.
    Answered((UnixStream, Vec<u8>)),
}

/// Starts `req`, on a new terminal of size `pty` when given. `welcome` is
/// the encoded welcome, sent in the same write as the answer.
pub fn begin(
    req: ExecRequest,
    pty: Option<PtySize>,
    host: UnixStream,
    host_in: Vec<u8>,
    mut welcome: Vec<u8>,
    reaper: &Reaper,
    live: Arc<Live>,
) -> Begun {
    let answer = |host: UnixStream, mut out: Vec<u8>, msg: &FromInit| {
        append(&mut out, msg);
        Begun::Answered((host, out))
    };
    if req.argv.is_empty() {
        return answer(host, welcome, &FromInit::Error("no command given".into()));
    }
    let cwd = req.cwd.as_deref().unwrap_or("/");
    if !std::path::Path::new(cwd).is_dir() {
        let message = format!("working directory {cwd} does not exist in the sandbox");
        let failed = FromInit::SpawnFailed {
            kind: SpawnErrorKind::Other,
            message,
        };
        return answer(host, welcome, &failed);
    }
    if req.detach && pty.is_none() {
        let name = req.argv.join(" ");
        let started = reaper.spawn_detached(name, || {
            spawn::spawn(&req.argv, &req.env, cwd, req.user, spawn::Stdio::Console).map(|c| c.pid)
        });
        let reply = match started {
            Ok(pid) => FromInit::Started { pid },
            Err(e) => spawn_failed(&req.argv[0], &e),
        };
        return answer(host, welcome, &reply);
    }
    let started = match pty {
        Some(size) => start_on_terminal(&req, cwd, size, reaper),
        None => start_piped(&req, cwd, reaper),
    };
    let Running {
        pid,
        exited,
        pipes,
        stdin,
        terminal,
    } = match started {
        Ok(r) => r,
        Err(failed) => return answer(host, welcome, &failed),
    };
    append(&mut welcome, &FromInit::Started { pid });
    Begun::Running(Box::new(Exec {
        host,
        host_in,
        host_open: true,
        out: welcome,
        host_gone: false,
        pid,
        exited,
        pipes,
        stdin,
        terminal,
        pending: Vec::new(),
        stdin_eof: false,
        deadline: req.timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms)),
        timed_out: false,
        status: None,
        drain_until: None,
        finished: false,
        _live: live,
    }))
}

/// A started command's end and the descriptors init follows it by.
struct Running {
    pid: i32,
    exited: Receiver<ExitStatus>,
    pipes: [Option<File>; 2],
    stdin: Option<File>,
    terminal: Option<File>,
}

/// Starts `req` with pipes for its output (and its stdin when asked).
fn start_piped(req: &ExecRequest, cwd: &str, reaper: &Reaper) -> Result<Running, FromInit> {
    let stdio = spawn::Stdio::Piped { stdin: req.stdin };
    let started = reaper.spawn_polled(|| spawn::spawn(&req.argv, &req.env, cwd, req.user, stdio).map(|c| (c.pid, c)));
    let (mut child, pid, exited) = started.map_err(|e| spawn_failed(&req.argv[0], &e))?;
    let pipes = [child.stdout.take(), child.stderr.take()];
    let stdin = child.stdin.take();
    for fd in pipes.iter().flatten().chain(stdin.iter()) {
        nonblocking(fd.as_raw_fd());
    }
    Ok(Running {
        pid,
        exited,
        pipes,
        stdin,
        terminal: None,
    })
}

/// Starts `req` on a new terminal of `size`: the command leads a session
/// whose controlling terminal is its stdin, stdout and stderr; init keeps
/// the controlling side, in three handles (output, input, resizing).
fn start_on_terminal(req: &ExecRequest, cwd: &str, size: PtySize, reaper: &Reaper) -> Result<Running, FromInit> {
    let opened = spawn::open_terminal(size).and_then(|(master, terminal)| {
        let input = master.try_clone()?;
        let output = master.try_clone()?;
        Ok((master, input, output, terminal))
    });
    let (master, input, output, terminal) = opened.map_err(|e| FromInit::SpawnFailed {
        kind: SpawnErrorKind::Other,
        message: format!("cannot open a terminal in the sandbox: {e}"),
    })?;
    let stdio = spawn::Stdio::Terminal(terminal.as_raw_fd());
    let started = reaper.spawn_polled(|| spawn::spawn(&req.argv, &req.env, cwd, req.user, stdio).map(|c| (c.pid, c)));
    // The command has its own copies; init keeps only the controlling side.
    drop(terminal);
    let (_, pid, exited) = started.map_err(|e| spawn_failed(&req.argv[0], &e))?;
    Ok(Running {
        pid,
        exited,
        pipes: [Some(output), None],
        stdin: Some(input),
        terminal: Some(master),
    })
}

/// Appends `msg` as a frame to `out`.
pub(crate) fn append(out: &mut Vec<u8>, msg: &FromInit) {
    let mut frame = Vec::new();
    // Init's own frames always encode: they are small or DATA_CHUNK bounded.
    if encode_frame(msg, &mut frame).is_ok() {
        out.extend_from_slice(&frame);
    }
}

/// Makes `fd`, a pipe end or socket init made with no other status flag
/// (so there is none to keep), non-blocking: one system call.
pub(crate) fn nonblocking(fd: RawFd) {
    let _ = fcntl(fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
}

impl Exec {
    /// The descriptors to poll and for what (`true`: writable), and when
    /// the exec next needs the loop even if nothing is ready.
    pub fn interests(&self, mut add: impl FnMut(RawFd, bool, Interest)) -> Option<Instant> {
        if !self.finished && (self.host_gone || self.out.len() < OUT_HELD) {
            for (pipe, which) in self.pipes.iter().zip([Interest::Stdout, Interest::Stderr]) {
                if let Some(p) = pipe {
                    add(p.as_raw_fd(), false, which);
                }
            }
        }
        if let (Some(s), false) = (&self.stdin, self.pending.is_empty()) {
            add(s.as_raw_fd(), true, Interest::Stdin);
        }
        if self.wants_host() {
            add(self.host.as_raw_fd(), false, Interest::HostIn);
        }
        if !self.out.is_empty() && !self.host_gone {
            add(self.host.as_raw_fd(), true, Interest::HostOut);
        }
        if self.finished {
            return None;
        }
        match self.drain_until {
            Some(d) => Some(d),
            None => self.deadline.filter(|_| !self.timed_out),
        }
    }

    /// Whether to read from the host: it is there, the stdin it sent has
    /// mostly gone into the pipe, and no whole frame waits to be handled.
    fn wants_host(&self) -> bool {
        self.host_open && !self.finished && self.pending.len() < STDIN_HELD && whole_frame(&self.host_in).is_none()
    }

    /// Handles what the poll found ready (`ready`), the command's end, the
    /// host's frames and the timeout; `buf` is scratch space for reads.
    /// Returns false once the exec is over: its `Exited` written (or the
    /// host gone), it can be dropped.
    pub fn advance(&mut self, ready: &[Interest], buf: &mut [u8]) -> bool {
        for which in ready {
            match which {
                Interest::Stdout | Interest::Stderr => self.read_output(*which == Interest::Stderr, buf),
                Interest::Stdin => self.write_stdin(),
                Interest::HostIn => self.read_host(buf),
                Interest::HostOut => {}
            }
        }
        self.host_frames();
        if self.stdin_eof && self.pending.is_empty() {
            self.stdin = None;
        }
        let now = Instant::now();
        if self.status.is_none() {
            if let Ok(s) = self.exited.try_recv() {
                self.status = Some(s);
                self.drain_until = Some(now + DRAIN_GRACE);
                if self.timed_out {
                    // Whatever the group left behind goes with it.
                    let _ = killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
                }
            } else if !self.timed_out && self.deadline.is_some_and(|d| now >= d) {
                self.timed_out = true;
                let _ = killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
            }
        }
        if let Some(status) = self.status.filter(|_| !self.finished) {
            if self.pipes.iter().all(Option::is_none) || self.drain_until.is_some_and(|d| now >= d) {
                let status = ExitStatus {
                    timed_out: self.timed_out,
                    ..status
                };
                self.queue(&FromInit::Exited(status));
                self.finished = true;
                // A background grandchild may hold the pipes for ever; the
                // exec must not live as long (a quiesce waits for it).
                self.pipes = [None, None];
                self.stdin = None;
                self.terminal = None;
                self.pending = Vec::new();
            }
        }
        self.flush();
        !(self.finished && (self.out.is_empty() || self.host_gone))
    }

    fn queue(&mut self, msg: &FromInit) {
        if !self.host_gone {
            append(&mut self.out, msg);
        }
    }

    /// Writes what the host has not taken, as far as its socket takes it.
    fn flush(&mut self) {
        // The host gone, output is drained and dropped from now.
        if !self.host_gone && write_nonblocking(&self.host, &mut self.out).is_err() {
            self.host_gone = true;
            self.out = Vec::new();
        }
    }

    fn read_output(&mut self, stderr: bool, buf: &mut [u8]) {
        let i = usize::from(stderr);
        let Some(p) = self.pipes[i].as_mut() else { return };
        let n = buf.len().min(DATA_CHUNK);
        match p.read(&mut buf[..n]) {
            Ok(0) => self.pipes[i] = None,
            Ok(n) => {
                let data = buf[..n].to_vec();
                self.queue(&if stderr {
                    FromInit::Stderr(data)
                } else {
                    FromInit::Stdout(data)
                });
            }
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {}
            Err(_) => self.pipes[i] = None,
        }
    }

    /// Writes what the host sent for stdin as far as the pipe takes it.
    fn write_stdin(&mut self) {
        let Some(s) = self.stdin.as_mut() else {
            self.pending.clear();
            return;
        };
        // The command closed its stdin: the rest is dropped.
        if write_nonblocking(s, &mut self.pending).is_err() {
            self.stdin = None;
            self.pending.clear();
        }
    }

    fn read_host(&mut self, buf: &mut [u8]) {
        let n = buf.len().min(HOST_READ);
        match (&self.host).read(&mut buf[..n]) {
            Ok(0) => self.host_hung_up(),
            Ok(n) => self.host_in.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {}
            Err(_) => self.host_hung_up(),
        }
    }

    /// The host hung up (or broke the protocol): the command's stdin ends
    /// with it. A terminal is hung up, as a closed ssh connection hangs up
    /// its own: its controlling side is closed, and every process of the
    /// command's session gets SIGHUP (background jobs included; one that
    /// ignores it, as `nohup` makes it, lives on).
    fn host_hung_up(&mut self) {
        self.host_open = false;
        self.host_in = Vec::new();
        self.stdin_eof = true;
        if self.terminal.take().is_some() {
            self.pipes = [None, None];
            self.stdin = None;
            self.pending = Vec::new();
            hang_up_session(self.pid);
        }
    }

    /// Handles the host's whole frames (stdin data, its end, a signal) while
    /// the stdin held stays under [`STDIN_HELD`]: stdin waits in `pending`
    /// until the pipe takes it, so a command that does not read never stops
    /// its output from flowing.
    fn host_frames(&mut self) {
        while self.host_open && self.pending.len() < STDIN_HELD {
            let frame = match whole_frame(&self.host_in) {
                None => return,
                Some(Err(_)) => return self.host_hung_up(),
                Some(Ok(len)) => len,
            };
            let msg = decode_payload::<ToInit>(&self.host_in[4..4 + frame]);
            self.host_in.drain(..4 + frame);
            match msg {
                Ok(ToInit::Stdin(data)) => {
                    if self.stdin.is_some() {
                        self.pending.extend_from_slice(&data);
                        self.write_stdin();
                    }
                }
                // A terminal's input has no end: the end-of-file character
                // (^D) is typed instead, which a shell at its prompt
                // takes as exit.
                Ok(ToInit::StdinEof) if self.terminal.is_some() => {
                    if self.stdin.is_some() {
                        self.pending.push(EOT);
                        self.write_stdin();
                    }
                }
                Ok(ToInit::StdinEof) => self.stdin_eof = true,
                Ok(ToInit::Resize(size)) => {
                    if let Some(t) = &self.terminal {
                        let _ = spawn::resize_terminal(t.as_raw_fd(), size);
                    }
                }
                Ok(ToInit::Signal(sig)) => {
                    if let Ok(sig) = Signal::try_from(sig) {
                        let _ = killpg(Pid::from_raw(self.pid), sig);
                    }
                }
                Ok(_) => {}
                Err(_) => return self.host_hung_up(),
            }
        }
    }
}

/// Sends SIGHUP to every process whose session is `sid`.
fn hang_up_session(sid: i32) {
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    for entry in procs.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if session_of(pid) == Some(sid) {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGHUP);
        }
    }
}

/// The session of process `pid`, from `/proc/PID/stat`: the fourth field
/// after the command name (which is in parentheses and may hold any byte).
fn session_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
    let fields = std::str::from_utf8(after).ok()?;
    fields.split_ascii_whitespace().nth(3)?.parse().ok()
}

/// The payload length of the whole frame at the start of `buf`: `None`
/// while it is incomplete, an error when its length is over the limit.
pub(crate) fn whole_frame(buf: &[u8]) -> Option<Result<usize, FrameError>> {
    let len = u32::from_le_bytes(buf.get(..4)?.try_into().ok()?);
    if len > MAX_FRAME_LEN {
        return Some(Err(FrameError::TooLarge(len)));
    }
    (buf.len() >= 4 + len as usize).then_some(Ok(len as usize))
}

pub(crate) fn spawn_failed(program: &str, e: &io::Error) -> FromInit {
    let (kind, message) = match e.kind() {
        ErrorKind::NotFound => (SpawnErrorKind::NotFound, format!("{program}: command not found")),
        ErrorKind::PermissionDenied => (
            SpawnErrorKind::PermissionDenied,
            format!("{program}: permission denied"),
        ),
        _ => (SpawnErrorKind::Other, format!("{program}: cannot start: {e}")),
    };
    FromInit::SpawnFailed { kind, message }
}

/// Writes `buf` to the non-blocking `w` as far as it takes it, draining
/// what went; an error other than "would block" is `w` gone for good.
fn write_nonblocking(mut w: impl Write, buf: &mut Vec<u8>) -> io::Result<()> {
    while !buf.is_empty() {
        match w.write(buf) {
            Ok(n) => {
                buf.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
