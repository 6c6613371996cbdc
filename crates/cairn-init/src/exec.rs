//! Running a process for the host: streamed output, stdin, signals, timeout.

use std::fs::File;
use std::io::{self, BufReader, ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_protocol::{
    encode_frame, read_frame, write_frame, ExecRequest, ExitStatus, FrameError, FromInit, SpawnErrorKind, ToInit,
    DATA_CHUNK,
};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::listen::Live;
use crate::reaper::Reaper;
use crate::spawn;

/// How long output may keep flowing after the process exited (a background
/// grandchild can hold the pipes open forever).
pub(crate) const DRAIN_GRACE: Duration = Duration::from_millis(250);

/// Stdin held for a command that is not reading before the host's next
/// frames wait.
const STDIN_HELD: usize = 4 * DATA_CHUNK;

pub fn run(
    req: ExecRequest,
    reader: BufReader<UnixStream>,
    mut writer: UnixStream,
    reaper: &Reaper,
    live: Arc<Live>,
) -> Result<(), FrameError> {
    if req.argv.is_empty() {
        write_frame(&mut writer, &FromInit::Error("no command given".into()))?;
        return Ok(());
    }
    let cwd = req.cwd.as_deref().unwrap_or("/");
    if !std::path::Path::new(cwd).is_dir() {
        let message = format!("working directory {cwd} does not exist in the sandbox");
        return write_frame(
            &mut writer,
            &FromInit::SpawnFailed {
                kind: SpawnErrorKind::Other,
                message,
            },
        );
    }
    if req.detach {
        let name = req.argv.join(" ");
        let started = reaper.spawn_detached(name, || {
            spawn::spawn(&req.argv, &req.env, cwd, spawn::Stdio::Console).map(|c| c.pid)
        });
        let reply = match started {
            Ok(pid) => FromInit::Started { pid },
            Err(e) => spawn_failed(&req.argv[0], &e),
        };
        return write_frame(&mut writer, &reply);
    }

    // No thread is started for a foreground command: this connection's
    // thread polls the command's pipes, the host's frames and the command's
    // end in one loop. A command that uses up the sandbox's process limit
    // (a fork bomb) therefore never leaves init unable to serve it.
    let mut out = Output {
        stream: Some(writer),
        closed: false,
        buf: Vec::new(),
    };
    let (exit_rx, exit_tx) = match nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK) {
        Ok(p) => p,
        Err(e) => return out.send(&spawn_failed(&req.argv[0], &io::Error::from(e))),
    };
    let stdio = spawn::Stdio::Piped { stdin: req.stdin };
    let (mut child, pid, exited) = match reaper.spawn_notify(exit_tx, || {
        spawn::spawn(&req.argv, &req.env, cwd, stdio).map(|c| (c.pid, c))
    }) {
        Ok(x) => x,
        Err(e) => {
            let sent = out.send(&spawn_failed(&req.argv[0], &e));
            out.closed = true;
            return sent;
        }
    };
    out.send(&FromInit::Started { pid })?;
    let status = follow(&mut out, &mut child, pid, &exited, &exit_rx, reader, req.timeout_ms);
    let sent = out.send(&FromInit::Exited(status));
    out.closed = true;
    // A background grandchild may hold the pipes for ever; the connection
    // must not live as long (a quiesce waits for every connection to end).
    drop(live);
    sent
}

struct Output {
    /// `None` once the host is gone.
    stream: Option<UnixStream>,
    /// Set once `Exited` went out: late output is dropped.
    closed: bool,
    buf: Vec<u8>,
}

impl Output {
    fn send(&mut self, msg: &FromInit) -> Result<(), FrameError> {
        let Some(stream) = self.stream.as_mut().filter(|_| !self.closed) else {
            return Ok(());
        };
        encode_frame(msg, &mut self.buf)?;
        stream.write_all(&self.buf)?;
        Ok(())
    }

    /// Output for the host; a host that hung up is forgotten, and the pipes
    /// are drained on regardless, so the command never blocks on them.
    fn data(&mut self, msg: &FromInit) {
        if self.send(msg).is_err() {
            self.stream = None;
        }
    }
}

fn nonblocking(fd: &impl AsFd) {
    if let Ok(flags) = fcntl(fd.as_fd().as_raw_fd(), FcntlArg::F_GETFL) {
        let _ = fcntl(
            fd.as_fd().as_raw_fd(),
            FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK),
        );
    }
}

/// Streams the command's output to the host and the host's stdin and
/// signals to the command until it exited and its pipes closed (or
/// [`DRAIN_GRACE`] after its exit), killing its group at the timeout.
fn follow(
    out: &mut Output,
    child: &mut spawn::Child,
    pid: i32,
    exited: &Receiver<ExitStatus>,
    exit_rx: &OwnedFd,
    mut reader: BufReader<UnixStream>,
    timeout_ms: Option<u64>,
) -> ExitStatus {
    let mut pipes: [Option<File>; 2] = [child.stdout.take(), child.stderr.take()];
    for p in pipes.iter().flatten() {
        nonblocking(p);
    }
    let mut stdin = child.stdin.take();
    if let Some(s) = &stdin {
        nonblocking(s);
    }
    let mut pending: Vec<u8> = Vec::new();
    let mut stdin_eof = false;
    let mut host_open = true;
    let deadline = timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
    let mut timed_out = false;
    let mut status: Option<ExitStatus> = None;
    let mut drain_until: Option<Instant> = None;
    let mut buf = vec![0u8; DATA_CHUNK];
    loop {
        if status.is_none() {
            if let Ok(s) = exited.try_recv() {
                status = Some(s);
                drain_until = Some(Instant::now() + DRAIN_GRACE);
                if timed_out {
                    // Whatever the group left behind goes with it.
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
        if status.is_some() && (pipes.iter().all(Option::is_none) || drain_until.is_some_and(|d| Instant::now() >= d)) {
            break;
        }
        // Host frames already buffered are handled before waiting.
        // Stdin the pipe has not taken yet holds the host's frames back.
        let take_frames = host_open && pending.len() < STDIN_HELD;
        if take_frames && !reader.buffer().is_empty() {
            host_open = host_frame(&mut reader, &mut stdin, &mut pending, &mut stdin_eof, pid);
            continue;
        }
        let wait_until = match (drain_until, deadline.filter(|_| !timed_out && status.is_none())) {
            (Some(d), _) => Some(d),
            (None, Some(d)) => Some(d),
            (None, None) => None,
        };
        let timeout = match wait_until {
            Some(t) => {
                let left = t.saturating_duration_since(Instant::now());
                PollTimeout::try_from(left.as_millis().min(60_000) as i32 + 1).unwrap_or(PollTimeout::MAX)
            }
            None => PollTimeout::NONE,
        };
        let (ready, stdin_ready, host_ready, exit_ready) = {
            let mut fds: Vec<PollFd> = Vec::with_capacity(5);
            let mut which = Vec::with_capacity(5);
            for (i, p) in pipes.iter().enumerate() {
                if let Some(p) = p {
                    fds.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
                    which.push(i);
                }
            }
            let stdin_slot = match (&stdin, pending.is_empty()) {
                (Some(s), false) => {
                    fds.push(PollFd::new(s.as_fd(), PollFlags::POLLOUT));
                    Some(fds.len() - 1)
                }
                _ => None,
            };
            let host_slot = take_frames.then(|| {
                fds.push(PollFd::new(reader.get_ref().as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let exit_slot = status.is_none().then(|| {
                fds.push(PollFd::new(exit_rx.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            match poll(&mut fds, timeout) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
            let hit = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
            let ready: Vec<usize> = which
                .iter()
                .enumerate()
                .filter(|(slot, _)| hit(*slot))
                .map(|(_, i)| *i)
                .collect();
            (
                ready,
                stdin_slot.is_some_and(hit),
                host_slot.is_some_and(hit),
                exit_slot.is_some_and(hit),
            )
        };
        if exit_ready {
            let mut byte = [0u8; 8];
            let _ = nix::unistd::read(exit_rx.as_raw_fd(), &mut byte);
        }
        for i in ready {
            let Some(p) = pipes[i].as_mut() else { continue };
            match p.read(&mut buf) {
                Ok(0) => pipes[i] = None,
                Ok(n) => {
                    let data = buf[..n].to_vec();
                    out.data(&if i == 0 {
                        FromInit::Stdout(data)
                    } else {
                        FromInit::Stderr(data)
                    });
                }
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {}
                Err(_) => pipes[i] = None,
            }
        }
        if stdin_ready {
            write_pending(&mut stdin, &mut pending);
        }
        if stdin_eof && pending.is_empty() {
            stdin = None;
        }
        if host_ready {
            host_open = host_frame(&mut reader, &mut stdin, &mut pending, &mut stdin_eof, pid);
        }
        if !timed_out && status.is_none() && deadline.is_some_and(|d| Instant::now() >= d) {
            timed_out = true;
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    let mut status = status.unwrap_or(ExitStatus {
        code: None,
        signal: None,
        timed_out: false,
    });
    status.timed_out = timed_out;
    status
}

/// Writes what the host sent for stdin as far as the pipe takes it.
fn write_pending(stdin: &mut Option<File>, pending: &mut Vec<u8>) {
    let Some(s) = stdin.as_mut() else {
        pending.clear();
        return;
    };
    while !pending.is_empty() {
        match s.write(pending) {
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            // The command closed its stdin: the rest is dropped.
            Err(_) => {
                *stdin = None;
                pending.clear();
                return;
            }
        }
    }
}

/// One frame from the host (stdin data, its end, a signal); false once the
/// host hung up. Stdin is held in `pending` until the pipe takes it, so a
/// command that does not read never stops its output from flowing.
fn host_frame(
    reader: &mut BufReader<UnixStream>,
    stdin: &mut Option<File>,
    pending: &mut Vec<u8>,
    stdin_eof: &mut bool,
    pid: i32,
) -> bool {
    match read_frame::<ToInit, _>(reader) {
        Ok(ToInit::Stdin(data)) => {
            if stdin.is_some() {
                pending.extend_from_slice(&data);
                write_pending(stdin, pending);
            }
            true
        }
        Ok(ToInit::StdinEof) => {
            *stdin_eof = true;
            if pending.is_empty() {
                *stdin = None;
            }
            true
        }
        Ok(ToInit::Signal(sig)) => {
            if let Ok(sig) = Signal::try_from(sig) {
                let _ = killpg(Pid::from_raw(pid), sig);
            }
            true
        }
        Ok(_) => true,
        // The host hung up: the command's stdin ends with it.
        Err(_) => {
            if pending.is_empty() {
                *stdin = None;
            }
            *stdin_eof = true;
            false
        }
    }
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
