//! Running a process for the host: streamed output, stdin, signals, timeout.

use std::io::{self, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, RecvTimeoutError};
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
const DRAIN_GRACE: Duration = Duration::from_millis(250);

pub fn run(
    req: ExecRequest,
    mut reader: BufReader<UnixStream>,
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

    let stdio = spawn::Stdio::Piped { stdin: req.stdin };
    let (mut child, pid, exited) =
        match reaper.spawn(|| spawn::spawn(&req.argv, &req.env, cwd, stdio).map(|c| (c.pid, c))) {
            Ok(x) => x,
            Err(e) => return write_frame(&mut writer, &spawn_failed(&req.argv[0], &e)),
        };
    let out = Arc::new(Mutex::new(Output {
        stream: Some(writer),
        live: Some(Arc::clone(&live)),
        closed: false,
        buf: Vec::new(),
    }));
    out.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(&FromInit::Started { pid })?;

    let (done_tx, done_rx) = channel::<()>();
    let mut pumps = 0;
    if let Some(stdout) = child.stdout.take() {
        pumps += 1;
        pump(stdout, Arc::clone(&out), FromInit::Stdout, done_tx.clone());
    }
    if let Some(stderr) = child.stderr.take() {
        pumps += 1;
        pump(stderr, Arc::clone(&out), FromInit::Stderr, done_tx.clone());
    }
    drop(done_tx);

    // Frames from the host: stdin data and signals, until the host hangs up.
    let mut stdin = child.stdin.take();
    std::thread::spawn(move || loop {
        // Holds the connection live (for quiescing) as long as it reads.
        let _live = &live;
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
    });

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

fn pump<R: Read + Send + 'static>(
    mut src: R,
    out: Arc<Mutex<Output>>,
    wrap: fn(Vec<u8>) -> FromInit,
    done: std::sync::mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; DATA_CHUNK];
        let mut host_gone = false;
        loop {
            match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    // Keep draining after the host hung up, so the process
                    // never blocks on a full pipe.
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
    });
}

fn spawn_failed(program: &str, e: &io::Error) -> FromInit {
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
