//! Reaping: PID 1 collects the exit status of every process in the sandbox.
//!
//! Exit statuses are routed to whoever started the process. Spawning happens
//! under the same lock the reaper takes before it calls `waitpid`, so a
//! process can never exit (and be reaped) before its waiter is registered,
//! and std's own `waitpid` after a failed exec never races the reaper.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use cairn_protocol::ExitStatus;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

enum Waiter {
    /// A foreground exec waiting for the status.
    Channel(Sender<ExitStatus>),
    /// The same for the serving loop, woken by a byte on its pipe.
    Polled(Sender<ExitStatus>),
    /// A background process: its end is written to the sandbox log.
    Log(String),
}

pub struct Reaper {
    waiters: Arc<Mutex<HashMap<i32, Waiter>>>,
}

/// The write end of the serving loop's wake-up pipe (non-blocking: a byte
/// already there wakes it as well).
struct LoopWake(OwnedFd);

impl Reaper {
    /// Blocks SIGCHLD in the calling thread (call before starting any other
    /// thread, so all inherit the mask) and starts the reaper thread, which
    /// writes a byte to `loop_wake` whenever a status for the serving loop
    /// is in.
    pub fn start(loop_wake: OwnedFd) -> Reaper {
        let mut set = SigSet::empty();
        set.add(Signal::SIGCHLD);
        set.thread_block().expect("blocking SIGCHLD cannot fail");
        let waiters: Arc<Mutex<HashMap<i32, Waiter>>> = Arc::default();
        let table = Arc::clone(&waiters);
        let loop_wake = LoopWake(loop_wake);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || loop {
                if set.wait().is_err() {
                    continue;
                }
                let mut table = table.lock().unwrap_or_else(|e| e.into_inner());
                reap_all(&mut table, &loop_wake);
            })
            .expect("cannot start the reaper thread");
        Reaper { waiters }
    }

    /// Runs `spawn` (which starts one process and returns its pid with
    /// whatever else it made) under the reaper's lock; the receiver yields
    /// the process's exit status.
    pub fn spawn<T>(&self, spawn: impl FnOnce() -> io::Result<(i32, T)>) -> io::Result<(T, i32, Receiver<ExitStatus>)> {
        let mut table = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let (pid, extra) = spawn()?;
        let (tx, rx) = channel();
        table.insert(pid, Waiter::Channel(tx));
        Ok((extra, pid, rx))
    }

    /// [`spawn`](Self::spawn) for the serving loop: its wake-up pipe gets a
    /// byte once the status is in the receiver.
    pub fn spawn_polled<T>(
        &self,
        spawn: impl FnOnce() -> io::Result<(i32, T)>,
    ) -> io::Result<(T, i32, Receiver<ExitStatus>)> {
        let mut table = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let (pid, extra) = spawn()?;
        let (tx, rx) = channel();
        table.insert(pid, Waiter::Polled(tx));
        Ok((extra, pid, rx))
    }

    /// Starts a background process whose end is logged.
    pub fn spawn_detached(&self, name: String, spawn: impl FnOnce() -> io::Result<i32>) -> io::Result<i32> {
        let mut table = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let pid = spawn()?;
        table.insert(pid, Waiter::Log(name));
        Ok(pid)
    }
}

fn reap_all(table: &mut HashMap<i32, Waiter>, loop_wake: &LoopWake) {
    loop {
        let status = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(s) => s,
        };
        let (pid, exit) = match status {
            WaitStatus::Exited(pid, code) => (
                pid,
                ExitStatus {
                    code: Some(code),
                    signal: None,
                    timed_out: false,
                },
            ),
            WaitStatus::Signaled(pid, sig, _) => (
                pid,
                ExitStatus {
                    code: None,
                    signal: Some(sig as i32),
                    timed_out: false,
                },
            ),
            _ => continue,
        };
        match table.remove(&pid.as_raw()) {
            Some(Waiter::Channel(tx)) => {
                let _ = tx.send(exit);
            }
            Some(Waiter::Polled(tx)) => {
                let _ = tx.send(exit);
                let _ = nix::unistd::write(&loop_wake.0, &[1]);
            }
            Some(Waiter::Log(name)) => {
                eprintln!(
                    "cairn-init: background process {pid} ({name}) ended with status {}",
                    exit.shell_code()
                );
            }
            // An orphan re-parented to PID 1: reaping it is all we owe it.
            None => {}
        }
    }
}
