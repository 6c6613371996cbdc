//! `cairn exec -t`: a command on a terminal of its own in the sandbox,
//! driven from this one. This terminal goes raw (every key, Ctrl-C
//! included, goes to the sandbox's terminal, whose line discipline makes
//! the signals), its size is the sandbox terminal's and follows it on
//! SIGWINCH, and its modes come back however the command ends.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use anyhow::Result;
use cairn_engine::{Engine, SandboxRecord};
use cairn_protocol::PtySize;
use cairn_sandbox::client::ExecControl;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::termios::{self, SetArg, Termios};

use crate::cli::ProcessArgs;

/// The size given when this side is no terminal (input from a pipe).
const DEFAULT_SIZE: PtySize = PtySize { cols: 80, rows: 24 };

/// Runs `argv` on a new terminal in `rec` and returns its exit status.
pub fn exec(engine: &Engine, rec: &SandboxRecord, process: &ProcessArgs, argv: Vec<String>) -> Result<i32> {
    let process = ProcessArgs {
        interactive: true,
        ..process.clone()
    };
    let req = engine.with_user(
        rec,
        crate::process::request(&process, argv, false)?,
        process.user.as_deref(),
    )?;
    let size = window_size().unwrap_or(DEFAULT_SIZE);
    // Blocked before any thread starts, so only the watcher takes it.
    let mut winch = SigSet::empty();
    winch.add(Signal::SIGWINCH);
    winch.thread_block()?;
    let start = engine.exec_on(rec, req, Some(size))?;
    let _raw = match &start {
        Ok(s) => {
            follow_window(s.session.control(), winch);
            Raw::enter()
        }
        Err(_) => None,
    };
    crate::process::follow(engine, rec, &process, start, false)
}

/// This terminal in raw mode until dropped, when its modes come back.
struct Raw {
    saved: Termios,
}

impl Raw {
    /// Raw mode on stdin, when it is a terminal.
    fn enter() -> Option<Raw> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd()).ok()?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).ok()?;
        Some(Raw { saved })
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSADRAIN, &self.saved);
    }
}

/// The size of the terminal on stdout (or stdin), if either is one.
fn window_size() -> Option<PtySize> {
    size_of(std::io::stdout().as_fd()).or_else(|| size_of(std::io::stdin().as_fd()))
}

fn size_of(fd: BorrowedFd<'_>) -> Option<PtySize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes a winsize to the pointer, which is valid.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0 && ws.ws_row > 0).then_some(PtySize {
        cols: ws.ws_col,
        rows: ws.ws_row,
    })
}

/// Sends this window's new size to the sandbox's terminal at each
/// SIGWINCH (blocked in `set` by the caller).
fn follow_window(control: ExecControl, set: SigSet) {
    std::thread::spawn(move || {
        while set.wait().is_ok() {
            if let Some(size) = window_size() {
                if control.resize(size).is_err() {
                    return;
                }
            }
        }
    });
}
