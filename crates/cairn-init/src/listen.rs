//! Where init listens, and quiescing for memory checkpoints.
//!
//! Under gVisor the socket init listens on is a host Unix socket reached
//! through the gofer (`--host-uds`), and gVisor refuses to checkpoint a
//! sandbox holding any such socket, listening or connected. So, on
//! [`ToInit::Quiesce`](cairn_protocol::ToInit::Quiesce), init closes its
//! listener, removes the socket file, shuts every other connection down and
//! waits until none is left; it listens again on SIGUSR2, which the driver
//! sends (`runsc kill`) once the checkpoint is taken or restored.

use std::io::Write;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};

use crate::conns::{Connections, Live};
use crate::hub::Hub;

/// How long a quiesce waits for connections to end.
const QUIESCE_WAIT: Duration = Duration::from_secs(5);

/// The signal that makes a quiesced init listen again.
pub const RELISTEN_SIGNAL: Signal = Signal::SIGUSR2;

/// Blocks [`RELISTEN_SIGNAL`] in the calling thread; call before any thread
/// starts so that only [`Server::accept_loop`]'s sigwait takes it (and an
/// early one is not fatal). Children start with an empty mask (`spawn` resets it).
pub fn block_relisten_signal() {
    let mut set = SigSet::empty();
    set.add(RELISTEN_SIGNAL);
    set.thread_block().expect("blocking SIGUSR2 cannot fail");
}

impl Connections {
    /// Ends every connection but `own`, then stops listening; returns once
    /// only `own` is left, or an error saying what still holds on, in which
    /// case init keeps listening as before.
    ///
    /// `asker` is `own`'s socket. A host that asked and died before init
    /// got to the request (its checkpoint killed) is not obeyed: the Cairn
    /// process finishing that checkpoint may already have found init
    /// listening and left it so, and nobody would tell a quiesced init to
    /// listen again. Checked once new connections are refused, so a host
    /// that dies later finds init not answering and signals it.
    pub fn quiesce(&self, own: &Live, asker: &UnixStream, wake: &UnixStream) -> Result<(), String> {
        self.quiescing.store(true, Ordering::SeqCst);
        if crate::jobs::host_gone(asker) {
            self.quiescing.store(false, Ordering::SeqCst);
            return Err("the host that asked for the quiesce has gone; init goes on listening".into());
        }
        let stopped = self.end_others(own).and_then(|()| {
            let (tx, rx): (Sender<()>, Receiver<()>) = channel();
            *self.quiesce.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
            // Wake the accept loop, which closes the listener and answers.
            let mut wake = wake;
            let _ = wake.write_all(&[1]);
            rx.recv_timeout(QUIESCE_WAIT)
                .map_err(|_| "init's accept loop did not stop listening".to_string())
        });
        if let Err(e) = stopped {
            self.quiescing.store(false, Ordering::SeqCst);
            return Err(e);
        }
        // Anything accepted in between is being dropped; wait for it.
        self.end_others(own)?;
        fresh_procfs();
        Ok(())
    }

    fn is_quiescing(&self) -> bool {
        self.quiescing.load(Ordering::SeqCst)
    }

    fn end_others(&self, own: &Live) -> Result<(), String> {
        let deadline = Instant::now() + QUIESCE_WAIT;
        loop {
            {
                let streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
                let others: Vec<&UnixStream> = streams
                    .iter()
                    .filter(|(id, _)| **id != own.id)
                    .map(|(_, s)| s)
                    .collect();
                if others.is_empty() {
                    return Ok(());
                }
                for s in others {
                    let _ = s.shutdown(Shutdown::Both);
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "{} connections to init are still open (an attached command still running?); \
                         wait for them to finish or start long commands detached",
                        streams.len() - 1
                    ));
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Where connections come from.
pub enum Source {
    /// A listening socket passed in by the driver (native): cannot be
    /// reopened, so quiescing is refused.
    Inherited(UnixListener),
    /// A path init binds itself (gVisor).
    Path(PathBuf),
}

/// The accept loop with its wake-up pair.
pub struct Server {
    source: Source,
    /// Read end polled by the accept loop; the write end wakes it.
    wake_rx: UnixStream,
    pub wake_tx: UnixStream,
    pub conns: Arc<Connections>,
    /// How many times init has listened (names the socket file).
    generation: AtomicU64,
}

impl Server {
    pub fn new(source: Source) -> Server {
        let (wake_tx, wake_rx) = UnixStream::pair().unwrap_or_else(|e| {
            eprintln!("cairn-init: cannot create a socket pair: {e}");
            std::process::exit(111);
        });
        Server {
            source,
            wake_rx,
            wake_tx,
            conns: Arc::default(),
            generation: AtomicU64::new(0),
        }
    }

    pub fn can_quiesce(&self) -> bool {
        matches!(self.source, Source::Path(_))
    }

    /// Serves connections for ever, handing each to `hub`, whose
    /// descriptors this loop polls too.
    pub fn accept_loop(&self, hub: &mut Hub) {
        loop {
            let listener = match &self.source {
                Source::Inherited(l) => l.try_clone().unwrap_or_else(|e| {
                    eprintln!("cairn-init: cannot use the listening socket: {e}");
                    std::process::exit(111);
                }),
                Source::Path(base) => listen_on_path(base, &self.generation),
            };
            self.accept_until_quiesced(&listener, hub);
            hub.drop_greetings();
            let bound = listener.local_addr().ok();
            drop(listener);
            if let Some(path) = bound.as_ref().and_then(|a| a.as_pathname()) {
                let _ = std::fs::remove_file(path);
            }
            // A relisten signal can only be meant for this quiesce once it is
            // answered; one already pending is a stale repeat.
            drain_relisten_signals();
            let mark = restore_mark();
            if let Some(tx) = self.conns.quiesce.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = tx.send(());
            }
            wait_for_relisten(mark);
            self.conns.quiescing.store(false, Ordering::SeqCst);
        }
    }

    fn accept_until_quiesced(&self, listener: &UnixListener, hub: &mut Hub) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        loop {
            fds.clear();
            for fd in [listener.as_raw_fd(), self.wake_rx.as_raw_fd()] {
                fds.push(libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            let timeout = match hub.interests(&mut fds) {
                // Rounded up: woken early, a timer would find itself not due.
                Some(at) => at
                    .saturating_duration_since(Instant::now())
                    .as_micros()
                    .div_ceil(1000)
                    .min(60_000) as libc::c_int,
                None => -1,
            };
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    eprintln!("cairn-init: poll failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            hub.ready(&fds[2..]);
            let woken = fds[1].revents != 0;
            let incoming = fds[0].revents != 0;
            if woken {
                let mut byte = [0u8; 64];
                let _ = std::io::Read::read(&mut &self.wake_rx, &mut byte);
                if self.can_quiesce() && self.conns.quiesce.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                    return;
                }
            }
            if incoming {
                match listener.accept() {
                    Ok((stream, _)) if self.conns.is_quiescing() => drop(stream),
                    Ok((stream, _)) => {
                        let live = self.conns.register(&stream);
                        hub.admit(stream, live);
                    }
                    Err(e) => eprintln!("cairn-init: accept failed: {e}"),
                }
            }
        }
    }
}

/// Binds and listens at `path` (generation 0) or `path.<generation>`:
/// for runtimes that cannot pass a listening socket in (gVisor's runsc),
/// where the path lies in a directory shared with the host, so the host
/// connects to the same socket file. Each listen after a quiesce takes a new
/// name, because gVisor refuses every operation on the name of a host socket
/// that was bound and removed in the same sandbox (EPERM); the driver
/// connects to the highest generation. std's listener is close-on-exec, so
/// commands never inherit it. Only the first listen may give up (the driver
/// then reports a failed start); later ones retry, since an init that exits
/// takes the sandbox with it.
fn listen_on_path(base: &Path, generation: &AtomicU64) -> UnixListener {
    let mut delay = Duration::from_millis(1);
    loop {
        let g = generation.fetch_add(1, Ordering::Relaxed);
        let path = if g == 0 {
            base.to_path_buf()
        } else {
            let mut p = base.as_os_str().to_owned();
            p.push(format!(".{g}"));
            PathBuf::from(p)
        };
        // A socket file left by an earlier init (a restarted sandbox) would
        // make bind fail; nothing else lives at this path.
        let _ = std::fs::remove_file(&path);
        match UnixListener::bind(&path) {
            Ok(l) => return l,
            Err(e) if g == 0 => {
                eprintln!("cairn-init: cannot listen on {}: {e}", path.display());
                std::process::exit(111);
            }
            Err(e) => {
                eprintln!(
                    "cairn-init: cannot listen on {}: {e}; trying the next name",
                    path.display()
                );
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

fn drain_relisten_signals() {
    let mut set = SigSet::empty();
    set.add(RELISTEN_SIGNAL);
    let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `set` and `zero` are valid for the call; a null siginfo
    // pointer is allowed. The signal is blocked, so this only dequeues it.
    while unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &zero) } > 0 {}
}

/// What init's stdin looks like: under gVisor a host file that the driver
/// grows by one byte before every restore (`None` when stdin is not a file).
fn restore_mark() -> Option<(u64, i64)> {
    let st = nix::sys::stat::fstat(libc::STDIN_FILENO).ok()?;
    (st.st_mode & libc::S_IFMT == libc::S_IFREG).then_some((st.st_ino, st.st_size))
}

/// Returns on the relisten signal, or once the restore mark changed: a
/// restored sandbox's stdin is the restoring runsc's, which the driver
/// marked, so init notices a restore without being told (checked every
/// millisecond; while quiesced, nothing else runs in init).
fn wait_for_relisten(mark: Option<(u64, i64)>) {
    let mut set = SigSet::empty();
    set.add(RELISTEN_SIGNAL);
    let Some(mark) = mark else {
        while set.wait() != Ok(RELISTEN_SIGNAL) {}
        return;
    };
    let tick = libc::timespec {
        tv_sec: 0,
        tv_nsec: 1_000_000,
    };
    loop {
        // SAFETY: `set` and `tick` are valid for the call; a null siginfo
        // pointer is allowed. The signal is blocked, so this only dequeues it.
        if unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &tick) } > 0 {
            return;
        }
        if restore_mark().is_some_and(|now| now != mark) {
            return;
        }
    }
}

/// Replaces `/proc` with a fresh procfs and detaches the old one.
///
/// Every process that looked at `/proc/self` (glibc's `pthread_getattr_np`,
/// busybox running an applet) leaves its `/proc/<pid>` directory in gVisor's
/// procfs dentry cache after it exits (up to 1000 entries), and the cached
/// inodes keep the dead task alive: a checkpoint then saves up to ~1000 dead
/// tasks, seconds of work, however little still runs. A detached procfs
/// that nothing uses is released with its cache, so the checkpoint's cost
/// follows what is alive. Needs CAP_SYS_ADMIN; without it the checkpoint is
/// only slower.
fn fresh_procfs() {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    if let Err(e) = umount2("/proc", MntFlags::MNT_DETACH) {
        eprintln!("cairn-init: cannot detach /proc before a checkpoint: {e}");
        return;
    }
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    if let Err(e) = mount(Some("proc"), "/proc", Some("proc"), flags, None::<&str>) {
        eprintln!("cairn-init: cannot mount a fresh /proc: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiesce_whose_asker_has_gone_is_refused_and_init_keeps_listening() {
        let conns = Arc::new(Connections::default());
        let (asker, host) = UnixStream::pair().unwrap();
        let own = conns.register(&asker);
        let (wake, _wake_rx) = UnixStream::pair().unwrap();
        drop(host);
        let refused = conns.quiesce(&own, &asker, &wake).unwrap_err();
        assert!(refused.contains("has gone"), "{refused}");
        assert!(!conns.is_quiescing(), "new connections would still be refused");
        assert!(
            conns.quiesce.lock().unwrap().is_none(),
            "the accept loop would stop listening"
        );
    }
}
