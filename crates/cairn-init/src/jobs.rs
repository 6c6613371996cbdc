//! Named jobs: commands that outlive the connection that started them.
//!
//! A pipeline stage's commands run for hours; the orchestrator that started
//! them may die and come back. A job is started with a name, runs with its
//! output kept by init (the newest [`KEEP`] bytes of each stream), and any
//! later connection attaches to it by name from byte offsets, receiving the
//! output it has not seen yet and, once the job ended, its exit status.
//! While a host is attached, none of the output is dropped: a job writing
//! faster than the host takes it waits for it, as on a pipe; so it does from
//! its start until the first host attaches (the one that started it, on its
//! next connection). With none attached after that, the oldest bytes go.
//! Jobs live as long as init.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cairn_protocol::{encode_frame, write_frame, ExecRequest, ExitStatus, FrameError, FromInit, DATA_CHUNK};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::reaper::Reaper;
use crate::spawn;

/// Bytes of each output stream a job keeps for attaching clients.
pub const KEEP: usize = 8 << 20;

/// Init's jobs.
pub static JOBS: std::sync::LazyLock<Jobs> = std::sync::LazyLock::new(Jobs::default);

#[derive(Default)]
pub struct Jobs {
    table: Mutex<HashMap<String, Arc<Job>>>,
}

struct Job {
    pid: i32,
    state: Mutex<JobState>,
    changed: Condvar,
}

#[derive(Default)]
struct JobState {
    streams: [Stream; 2],
    /// Output pipes still open.
    open: usize,
    status: Option<ExitStatus>,
    /// Set once the exit is followed by a grace period with no output: a
    /// background grandchild may hold the pipes for ever, and the job is
    /// over all the same.
    drained: bool,
    /// How far each attached host has taken each stream: the pumps wait for
    /// the slowest rather than drop bytes it has not taken.
    readers: HashMap<u64, [u64; 2]>,
    next_reader: u64,
    /// Pumps holding output until a reader takes what it would push out.
    held: usize,
}

/// The tail of one output stream: `data` holds bytes `[start, start+len)`,
/// in a ring, so dropping the oldest bytes moves none of the others.
#[derive(Default)]
struct Stream {
    start: u64,
    data: VecDeque<u8>,
}

impl Stream {
    fn end(&self) -> u64 {
        self.start + self.data.len() as u64
    }

    fn push(&mut self, bytes: &[u8]) {
        self.data.extend(bytes);
        if self.data.len() > KEEP {
            let drop = self.data.len() - KEEP;
            self.data.drain(..drop);
            self.start += drop as u64;
        }
    }

    /// The kept bytes from offset `at` on, in pieces of at most [`DATA_CHUNK`].
    fn since(&self, at: u64) -> impl Iterator<Item = &[u8]> {
        let skip = at.saturating_sub(self.start).min(self.data.len() as u64) as usize;
        let (front, back) = self.data.as_slices();
        let (front, back) = match front.get(skip..) {
            Some(rest) => (rest, back),
            None => (&front[..0], &back[skip - front.len()..]),
        };
        front.chunks(DATA_CHUNK).chain(back.chunks(DATA_CHUNK))
    }
}

impl JobState {
    fn finished(&self) -> bool {
        self.status.is_some() && (self.open == 0 || self.drained)
    }

    /// Bytes the job has written so far, on both streams.
    fn written(&self) -> u64 {
        self.streams.iter().map(Stream::end).sum()
    }
}

/// An attached host, known to the pumps until its connection ends.
struct Reader<'a> {
    job: &'a Job,
    id: u64,
}

impl<'a> Reader<'a> {
    fn new(job: &'a Job, from: [u64; 2]) -> Reader<'a> {
        let mut state = job.state.lock().unwrap_or_else(|e| e.into_inner());
        let id = state.next_reader;
        state.next_reader += 1;
        state.readers.insert(id, from);
        // The first host to attach takes over from the one that started it.
        state.readers.remove(&STARTER);
        job.changed.notify_all();
        Reader { job, id }
    }
}

/// The reader a new job holds its output for until a host attaches.
const STARTER: u64 = 0;

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        let mut state = self.job.state.lock().unwrap_or_else(|e| e.into_inner());
        state.readers.remove(&self.id);
        self.job.changed.notify_all();
    }
}

impl Jobs {
    /// Starts job `name`; answers `Started`, `SpawnFailed` or an error when
    /// the name is taken.
    pub fn start(
        &self,
        name: String,
        req: ExecRequest,
        reaper: &Reaper,
        writer: &mut UnixStream,
    ) -> Result<(), FrameError> {
        let reply = self.start_job(name, req, reaper);
        write_frame(writer, &reply)
    }

    fn start_job(&self, name: String, req: ExecRequest, reaper: &Reaper) -> FromInit {
        if req.argv.is_empty() {
            return FromInit::Error("no command given".into());
        }
        if name.is_empty() || name.len() > 200 {
            return FromInit::Error("a job name has 1 to 200 bytes".into());
        }
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if table.contains_key(&name) {
            return FromInit::Error(format!("a job named {name:?} exists; attach to it instead"));
        }
        let cwd = req.cwd.clone().unwrap_or_else(|| "/".into());
        let started = reaper.spawn(|| {
            spawn::spawn(
                &req.argv,
                &req.env,
                &cwd,
                req.user,
                spawn::Stdio::Piped { stdin: false },
            )
            .map(|c| (c.pid, c))
        });
        let (mut child, pid, exited) = match started {
            Ok(x) => x,
            Err(e) => return crate::exec::spawn_failed(&req.argv[0], &e),
        };
        let job = Arc::new(Job {
            pid,
            state: Mutex::new(JobState {
                open: 2,
                readers: HashMap::from([(STARTER, [0, 0])]),
                next_reader: STARTER + 1,
                ..JobState::default()
            }),
            changed: Condvar::new(),
        });
        let pipes = [child.stdout.take(), child.stderr.take()];
        for (i, pipe) in pipes.into_iter().enumerate() {
            let job = Arc::clone(&job);
            let pumped = std::thread::Builder::new().spawn(move || pump(pipe, &job, i));
            if pumped.is_err() {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                return FromInit::Error(
                    "the sandbox is at its process limit (--pids): init cannot start a thread for this job".into(),
                );
            }
        }
        let waiter = Arc::clone(&job);
        let timeout = req.timeout_ms.map(Duration::from_millis);
        let watched = std::thread::Builder::new().spawn(move || {
            let status = match timeout {
                None => exited.recv().ok(),
                Some(t) => match exited.recv_timeout(t) {
                    Ok(s) => Some(s),
                    Err(_) => {
                        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                        exited.recv().ok().map(|mut s| {
                            s.timed_out = true;
                            s
                        })
                    }
                },
            };
            let mut state = waiter.state.lock().unwrap_or_else(|e| e.into_inner());
            state.status = Some(status.unwrap_or(ExitStatus {
                code: None,
                signal: None,
                timed_out: false,
            }));
            waiter.changed.notify_all();
            // Drained when the pipes close, or once they stayed quiet for the
            // grace period with nothing held for a slow reader.
            while state.open > 0 {
                let written = state.written();
                let (s, waited) = waiter
                    .changed
                    .wait_timeout_while(state, crate::exec::DRAIN_GRACE, |s| {
                        s.open > 0 && s.written() == written
                    })
                    .unwrap_or_else(|e| e.into_inner());
                state = s;
                if waited.timed_out() && state.held == 0 {
                    break;
                }
            }
            state.drained = true;
            waiter.changed.notify_all();
        });
        if watched.is_err() {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            return FromInit::Error("init cannot start a thread for this job".into());
        }
        table.insert(name, job);
        FromInit::Started { pid }
    }

    /// Streams job `name`'s output from the given offsets, then its exit
    /// status; follows a running job until it ends or the host hangs up.
    pub fn attach(&self, name: &str, from: [u64; 2], writer: &mut UnixStream) -> Result<(), FrameError> {
        let job = self.table.lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned();
        let Some(job) = job else {
            return write_frame(writer, &FromInit::Error(format!("no job named {name:?}")));
        };
        write_frame(writer, &FromInit::Started { pid: job.pid })?;
        let reader = Reader::new(&job, from);
        let mut sent = from;
        let mut buf = Vec::new();
        loop {
            let (chunks, status) = {
                let mut state = job.state.lock().unwrap_or_else(|e| e.into_inner());
                while !state.finished() && state.streams.iter().zip(sent).all(|(s, at)| s.end() <= at) {
                    let (s, _) = job
                        .changed
                        .wait_timeout(state, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner());
                    state = s;
                    if host_gone(writer) {
                        return Ok(());
                    }
                }
                let mut chunks = Vec::new();
                for (i, s) in state.streams.iter().enumerate() {
                    if sent[i] < s.start {
                        let note = format!("[cairn: {} bytes of output were not kept]\n", s.start - sent[i]);
                        chunks.push((i, note.into_bytes()));
                        sent[i] = s.start;
                    }
                    for piece in s.since(sent[i]) {
                        chunks.push((i, piece.to_vec()));
                    }
                    sent[i] = s.end();
                }
                state.readers.insert(reader.id, sent);
                job.changed.notify_all();
                (chunks, state.finished().then_some(state.status).flatten())
            };
            for (i, data) in chunks {
                let msg = if i == 0 {
                    FromInit::Stdout(data)
                } else {
                    FromInit::Stderr(data)
                };
                buf.clear();
                encode_frame(&msg, &mut buf)?;
                writer.write_all(&buf)?;
            }
            if let Some(status) = status {
                return write_frame(writer, &FromInit::Exited(status));
            }
        }
    }
}

/// Whether the host closed (or shut down) its end: it sends nothing after
/// `AttachJob` or `Quiesce`, so anything readable is the end.
pub(crate) fn host_gone(stream: &UnixStream) -> bool {
    let mut fds = [PollFd::new(
        stream.as_fd(),
        PollFlags::POLLIN | PollFlags::from_bits_retain(libc::POLLRDHUP),
    )];
    let polled = match poll(&mut fds, PollTimeout::ZERO) {
        Ok(0) => false,
        Ok(_) => fds[0].revents().is_some_and(|r| !r.is_empty()),
        Err(_) => true,
    };
    // gVisor's zero-timeout poll of a host socket misses bytes the host
    // sent and a quiesce's shutdown; a peek that does not wait sees both.
    polled || peer_sent_or_ended(stream)
}

fn peer_sent_or_ended(stream: &UnixStream) -> bool {
    let mut byte = [0u8; 1];
    // SAFETY: `byte` is a valid buffer of 1 byte for the duration of the
    // call, and the descriptor is the open socket `stream` borrows.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return true;
    }
    let e = std::io::Error::last_os_error().kind();
    !matches!(e, ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

fn pump(pipe: Option<File>, job: &Job, stream: usize) {
    if let Some(mut src) = pipe {
        let mut buf = vec![0u8; DATA_CHUNK];
        loop {
            match src.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let mut state = job.state.lock().unwrap_or_else(|e| e.into_inner());
                    // Hold the bytes while the push would drop ones an
                    // attached reader has not taken yet.
                    loop {
                        let kept_from = (state.streams[stream].end() + n as u64).saturating_sub(KEEP as u64);
                        if state.readers.values().all(|at| at[stream] >= kept_from) {
                            break;
                        }
                        state.held += 1;
                        state = job.changed.wait(state).unwrap_or_else(|e| e.into_inner());
                        state.held -= 1;
                    }
                    state.streams[stream].push(&buf[..n]);
                    job.changed.notify_all();
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }
    let mut state = job.state.lock().unwrap_or_else(|e| e.into_inner());
    state.open -= 1;
    job.changed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_keeps_its_newest_bytes_and_counts_the_rest() {
        let mut s = Stream::default();
        s.push(&vec![1u8; KEEP - 10]);
        s.push(&[2u8; 30]);
        assert_eq!(s.data.len(), KEEP);
        assert_eq!(s.start, 20);
        assert_eq!(s.end(), (KEEP + 20) as u64);
        assert_eq!(*s.data.back().unwrap(), 2);
        // Read back from any offset, across the ring's two halves.
        for at in [
            0,
            20,
            21,
            KEEP as u64,
            KEEP as u64 + 19,
            KEEP as u64 + 20,
            KEEP as u64 + 99,
        ] {
            let read: Vec<u8> = s.since(at).flatten().copied().collect();
            let from = at.clamp(20, KEEP as u64 + 20);
            assert_eq!(read.len() as u64, KEEP as u64 + 20 - from, "from {at}");
            assert!(read.iter().rev().take(30.min(read.len())).all(|&b| b == 2), "from {at}");
        }
        // Many pushes wrap the ring: what is read back is still the newest bytes in order.
        let mut all = Vec::new();
        for i in 0..300u32 {
            let piece: Vec<u8> = (0..100_003u32).map(|j| (i * 7 + j) as u8).collect();
            s.push(&piece);
            all.extend_from_slice(&piece);
        }
        let newest = &all[all.len() - KEEP..];
        let read: Vec<u8> = s.since(s.start).flatten().copied().collect();
        assert!(read == newest, "the ring reads back out of order");
        assert!(s.since(s.start).all(|piece| piece.len() <= DATA_CHUNK));
    }
}
