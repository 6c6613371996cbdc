//! Running a process for the host: streamed output, stdin, signals, timeout.

use std::fs::File;
use std::io::{self, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cairn_protocol::{
    encode_frame, read_frame, write_frame, ExecRequest, ExitStatus, FrameError, FromInit, SpawnErrorKind, ToInit,
    DATA_CHUNK,
};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::listen::Live;
use crate::reaper::Reaper;
use crate::spawn;

/// How long output may keep flowing after the process exited (a background
/// grandchild can hold the pipes open forever).
pub(crate) const DRAIN_GRACE: Duration = Duration::from_millis(250);

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

    // Every thread this exec needs starts before the command does: a
    // command that uses up the sandbox's process limit (a fork bomb) must
    // not leave init unable to serve it. The threads receive their pipes
    // once the command runs.
    let out = Arc::new(Mutex::new(Output {
        stream: Some(writer),
        live: Some(Arc::clone(&live)),
        closed: false,
        buf: Vec::new(),
    }));
    let (done_tx, done_rx) = channel::<()>();
    let (stdout_tx, stdout_rx) = channel::<File>();
    let (stderr_tx, stderr_rx) = channel::<File>();
    let (control_tx, control_rx) = channel::<(Option<File>, i32)>();
    let threads_ok = pump(stdout_rx, Arc::clone(&out), FromInit::Stdout, done_tx.clone())
        && pump(stderr_rx, Arc::clone(&out), FromInit::Stderr, done_tx.clone())
        && host_frames(control_rx, reader, live);
    drop(done_tx);
    if !threads_ok {
        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
        let message = "the sandbox is at its process limit (--pids): init cannot start a thread for this command; \
                       wait for processes to end or raise --pids"
            .to_string();
        let sent = out.send(&FromInit::SpawnFailed {
            kind: SpawnErrorKind::Other,
            message,
        });
        out.closed = true;
        out.stream = None;
        return sent;
    }

    let stdio = spawn::Stdio::Piped { stdin: req.stdin };
    let (mut child, pid, exited) =
        match reaper.spawn(|| spawn::spawn(&req.argv, &req.env, cwd, stdio).map(|c| (c.pid, c))) {
            Ok(x) => x,
            Err(e) => {
                let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                let sent = out.send(&spawn_failed(&req.argv[0], &e));
                out.closed = true;
                out.stream = None;
                return sent;
            }
        };
    out.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(&FromInit::Started { pid })?;
    let pumps = [
        child.stdout.take().map(|f| stdout_tx.send(f)),
        child.stderr.take().map(|f| stderr_tx.send(f)),
    ]
    .into_iter()
    .flatten()
    .count();
    let _ = control_tx.send((child.stdin.take(), pid));

    let status = match req.timeout_ms {
        None => exited.recv().unwrap_or(ExitStatus {
            code: None,
            signal: None,
            timed_out: false,
        }),
        Some(ms) => match exited.recv_timeout(Duration::from_millis(ms)) {
            Ok(s) => s,
            Err(RecvTimeoutError::Timeout) => {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                let mut s = exited.recv().unwrap_or(ExitStatus {
                    code: None,
                    signal: None,
                    timed_out: false,
                });
                s.timed_out = true;
                s
            }
            Err(RecvTimeoutError::Disconnected) => ExitStatus {
                code: None,
                signal: None,
                timed_out: false,
            },
        },
    };
    if status.timed_out {
        // Whatever the group left behind goes with it.
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let deadline = Instant::now() + DRAIN_GRACE;
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
    let sent = out.send(&FromInit::Exited(status));
    out.closed = true;
    // A background grandchild may hold the pipes for ever; the connection
    // must not live as long (a quiesce waits for every connection to end).
    out.stream = None;
    out.live = None;
    sent
}

struct Output {
    /// `None` once `Exited` went out.
    stream: Option<UnixStream>,
    live: Option<Arc<Live>>,
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
}

/// Streams the pipe it is sent to the host, on a new thread; false if none
/// could start.
fn pump(
    src: Receiver<File>,
    out: Arc<Mutex<Output>>,
    wrap: fn(Vec<u8>) -> FromInit,
    done: std::sync::mpsc::Sender<()>,
) -> bool {
    std::thread::Builder::new()
        .spawn(move || {
            let Ok(mut src) = src.recv() else { return };
            let mut buf = vec![0u8; DATA_CHUNK];
            let mut host_gone = false;
            loop {
                match src.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        // Keep draining after the host hung up, so the
                        // process never blocks on a full pipe.
                        if !host_gone {
                            let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                            host_gone = out.send(&wrap(buf[..n].to_vec())).is_err();
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = done.send(());
        })
        .is_ok()
}

/// Frames from the host (stdin data and signals) for the command it is sent,
/// until the host hangs up, on a new thread; false if none could start.
fn host_frames(command: Receiver<(Option<File>, i32)>, mut reader: BufReader<UnixStream>, live: Arc<Live>) -> bool {
    std::thread::Builder::new()
        .spawn(move || {
            // Holds the connection live (for quiescing) as long as it reads.
            let _live = live;
            let Ok((mut stdin, pid)) = command.recv() else { return };
            loop {
                match read_frame::<ToInit, _>(&mut reader) {
                    Ok(ToInit::Stdin(data)) => {
                        if let Some(s) = stdin.as_mut() {
                            if s.write_all(&data).is_err() {
                                stdin = None;
                            }
                        }
                    }
                    Ok(ToInit::StdinEof) => stdin = None,
                    Ok(ToInit::Signal(sig)) => {
                        if let Ok(sig) = Signal::try_from(sig) {
                            let _ = killpg(Pid::from_raw(pid), sig);
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        })
        .is_ok()
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
