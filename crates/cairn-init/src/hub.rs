//! The serving loop's connections: one thread (the accept loop of
//! [`crate::listen`]) polls the listener, every connection still sending
//! its request, and every foreground exec's pipes and connection.
//!
//! A connection sends a hello and one request. Execs and pings are served
//! here, without a thread: starting a thread per exec cost more than the
//! rest of init's work for a short command, and a sandbox at its process
//! limit has none to give. The other requests (files, listings, jobs,
//! quiesce) block on the filesystem or on other connections, so each gets
//! a thread of its own; when none can start, it runs on this one (see
//! `spawn_or_run` in main.rs).

use std::io::{BufReader, Cursor, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use cairn_protocol::{decode_payload, ExecRequest, FromInit, PtySize, ToInit, DATA_CHUNK, MAGIC, PROTOCOL_VERSION};

use crate::conns::Live;
use crate::exec::{self, Begun, Exec, Interest};
use crate::reaper::Reaper;

/// What a request that is not served here is handed: the request, the
/// connection's reader (holding whatever the host sent past the request)
/// and writer, the welcome already sent.
pub type HostReader = BufReader<std::io::Chain<Cursor<Vec<u8>>, UnixStream>>;

/// Serves a request on a thread of its own (see the module docs).
pub type Handoff = Box<dyn Fn(ToInit, HostReader, UnixStream, Arc<Live>)>;

/// A connection whose hello and request are still arriving.
struct Greeting {
    stream: UnixStream,
    live: Arc<Live>,
    buf: Vec<u8>,
    /// The hello came and was answered.
    welcomed: bool,
}

/// Which connection (or the reaper's pipe) a polled descriptor stands for.
#[derive(Clone, Copy)]
enum Slot {
    Exits,
    Greeting(usize),
    Exec(usize, Interest),
}

pub struct Hub {
    reaper: Arc<Reaper>,
    /// The reaper writes a byte here once a status for an exec is in.
    exits: OwnedFd,
    handoff: Handoff,
    greetings: Vec<Greeting>,
    execs: Vec<Exec>,
    /// What each descriptor handed to the poll stands for, in order.
    slots: Vec<Slot>,
    /// Scratch space for reads (pipes, host frames).
    buf: Vec<u8>,
}

impl Hub {
    /// `exits` is the read end of the pipe the reaper was started with.
    pub fn new(reaper: Arc<Reaper>, exits: OwnedFd, handoff: Handoff) -> Hub {
        exec::nonblocking(exits.as_raw_fd());
        Hub {
            reaper,
            exits,
            handoff,
            greetings: Vec::new(),
            execs: Vec::new(),
            slots: Vec::new(),
            buf: vec![0u8; DATA_CHUNK],
        }
    }

    /// A new connection, registered for quiescing.
    pub fn admit(&mut self, stream: UnixStream, live: Arc<Live>) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let greeting = Greeting {
            stream,
            live,
            buf: Vec::new(),
            welcomed: false,
        };
        // The hello and the request usually came with the connection.
        if let Some(waiting) = self.greet(greeting) {
            self.greetings.push(waiting);
        }
    }

    /// Adds what to poll to `fds`; returns when a timer (a timeout, the
    /// drain grace) next needs the loop.
    pub fn interests(&mut self, fds: &mut Vec<libc::pollfd>) -> Option<Instant> {
        self.slots.clear();
        let mut add = |slots: &mut Vec<Slot>, fd: RawFd, write: bool, slot: Slot| {
            fds.push(libc::pollfd {
                fd,
                events: if write { libc::POLLOUT } else { libc::POLLIN },
                revents: 0,
            });
            slots.push(slot);
        };
        add(&mut self.slots, self.exits.as_raw_fd(), false, Slot::Exits);
        for (i, g) in self.greetings.iter().enumerate() {
            add(&mut self.slots, g.stream.as_raw_fd(), false, Slot::Greeting(i));
        }
        let mut next: Option<Instant> = None;
        for (i, e) in self.execs.iter().enumerate() {
            let slots = &mut self.slots;
            let timer = e.interests(|fd, write, which| add(slots, fd, write, Slot::Exec(i, which)));
            next = match (next, timer) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        next
    }

    /// Handles what the poll found ready; `fds` are the ones
    /// [`interests`](Self::interests) added, with their revents.
    pub fn ready(&mut self, fds: &[libc::pollfd]) {
        let mut exits = false;
        let mut greetings = Vec::new();
        let mut execs: Vec<(usize, Interest)> = Vec::new();
        for (fd, slot) in fds.iter().zip(&self.slots) {
            if fd.revents == 0 {
                continue;
            }
            match *slot {
                Slot::Exits => exits = true,
                Slot::Greeting(i) => greetings.push(i),
                Slot::Exec(i, which) => execs.push((i, which)),
            }
        }
        if exits {
            while matches!(nix::unistd::read(self.exits.as_raw_fd(), &mut self.buf[..64]), Ok(n) if n > 0) {}
        }
        // Every exec whose descriptors are ready, whose status may be in (the
        // reaper woke the loop) or whose timer is due.
        let now = Instant::now();
        let mut which = Vec::new();
        let mut next = execs.iter().peekable();
        let mut i = 0;
        self.execs.retain_mut(|e| {
            which.clear();
            while let Some((_, w)) = next.next_if(|(at, _)| *at == i) {
                which.push(*w);
            }
            i += 1;
            let due = exits || !which.is_empty() || e.interests(|_, _, _| {}).is_some_and(|t| t <= now);
            !due || e.advance(&which, &mut self.buf)
        });
        if !greetings.is_empty() {
            let ready: Vec<Greeting> = greetings.iter().rev().map(|&i| self.greetings.swap_remove(i)).collect();
            for g in ready {
                if let Some(waiting) = self.greet(g) {
                    self.greetings.push(waiting);
                }
            }
        }
    }

    /// Drops the connections still sending their request: init stops
    /// listening for a checkpoint, and they were already shut down.
    pub fn drop_greetings(&mut self) {
        self.greetings.clear();
    }

    /// Reads what the host sent; serves the request once it is whole.
    /// Returns the connection while it is still incomplete.
    fn greet(&mut self, mut g: Greeting) -> Option<Greeting> {
        match (&g.stream).read(&mut self.buf[..exec::HOST_READ]) {
            Ok(0) => return None,
            Ok(n) => g.buf.extend_from_slice(&self.buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {}
            Err(_) => return None,
        }
        let mut welcome = Vec::new();
        if !g.welcomed {
            let len = match exec::whole_frame(&g.buf) {
                None => return Some(g),
                Some(Ok(len)) => len,
                Some(Err(e)) => {
                    eprintln!("cairn-init: connection ended: {e}");
                    return None;
                }
            };
            let hello = decode_payload::<ToInit>(&g.buf[4..4 + len]);
            g.buf.drain(..4 + len);
            let refusal = match hello {
                Ok(ToInit::Hello { magic, version }) if magic == MAGIC && version == PROTOCOL_VERSION => None,
                Ok(ToInit::Hello { magic, version }) if magic == MAGIC => Some(format!(
                    "protocol version {version} is not supported by this cairn-init (version {PROTOCOL_VERSION}); recreate the sandbox with the same Cairn build"
                )),
                Ok(ToInit::Hello { .. }) => Some("not a Cairn client (bad magic)".to_string()),
                Ok(other) => Some(format!("expected Hello, got {}", crate::name(&other))),
                Err(e) => {
                    eprintln!("cairn-init: connection ended: {e}");
                    return None;
                }
            };
            if let Some(refusal) = refusal {
                let mut out = Vec::new();
                exec::append(&mut out, &FromInit::Error(refusal));
                let _ = (&g.stream).write(&out);
                return None;
            }
            g.welcomed = true;
            exec::append(
                &mut welcome,
                &FromInit::Welcome {
                    version: PROTOCOL_VERSION,
                    init_pid: std::process::id() as i32,
                },
            );
        }
        let len = match exec::whole_frame(&g.buf) {
            Some(Ok(len)) => len,
            Some(Err(e)) => {
                eprintln!("cairn-init: connection ended: {e}");
                return None;
            }
            None => {
                // The client may wait for the welcome before sending more.
                // A connection's first write always fits its socket buffer.
                if !welcome.is_empty() && (&g.stream).write(&welcome).ok() != Some(welcome.len()) {
                    return None;
                }
                return Some(g);
            }
        };
        let request = decode_payload::<ToInit>(&g.buf[4..4 + len]);
        g.buf.drain(..4 + len);
        let request = match request.map_err(|e| e.to_string()).and_then(ToInit::from_wire) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cairn-init: connection ended: {e}");
                return None;
            }
        };
        self.serve(request, g, welcome);
        None
    }

    /// Starts an exec (on a terminal of size `pty`, when given) and
    /// follows it from the serving loop.
    fn begin(&mut self, req: ExecRequest, pty: Option<PtySize>, g: Greeting, welcome: Vec<u8>) {
        match exec::begin(req, pty, g.stream, g.buf, welcome, &self.reaper, g.live) {
            Begun::Running(mut e) => {
                // Started goes out now, without waiting for a poll.
                if e.advance(&[], &mut self.buf) {
                    self.execs.push(*e);
                }
            }
            Begun::Answered((stream, out)) => {
                let _ = (&stream).write(&out);
            }
        }
    }

    /// Serves `request`; `welcome` is the welcome, if not sent yet.
    fn serve(&mut self, request: ToInit, g: Greeting, mut welcome: Vec<u8>) {
        match request {
            ToInit::Exec(_) | ToInit::ExecPty { .. } => {
                let (req, pty) = match request {
                    ToInit::ExecPty { request, size } => (request, Some(size)),
                    ToInit::Exec(request) => (request, None),
                    _ => unreachable!("matched above"),
                };
                self.begin(req, pty, g, welcome)
            }
            ToInit::Ping => {
                exec::append(&mut welcome, &FromInit::Pong);
                let _ = (&g.stream).write(&welcome);
            }
            other => {
                if !welcome.is_empty() && (&g.stream).write(&welcome).ok() != Some(welcome.len()) {
                    return;
                }
                let (Ok(()), Ok(read_half)) = (g.stream.set_nonblocking(false), g.stream.try_clone()) else {
                    return;
                };
                let reader = BufReader::new(Cursor::new(g.buf).chain(read_half));
                (self.handoff)(other, reader, g.stream, g.live);
            }
        }
    }
}
