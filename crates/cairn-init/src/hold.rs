//! `cairn-init --hold N`, run on the host (not in a sandbox): keeps
//! descriptors 4 to 3 + N (a published port's reserved sockets) open until
//! the process whose pidfd is descriptor 3 exits. It forks once so that it
//! is nobody's child to wait for, prints the holder's pid, and the first
//! process exits.

use std::io::Write;
use std::os::fd::RawFd;

const OWNER: RawFd = 3;

pub fn run(args: &[String]) -> i32 {
    let Some(n) = args
        .first()
        .and_then(|a| a.parse::<u32>().ok())
        .filter(|n| (1..=64).contains(n))
    else {
        eprintln!("cairn-init --hold N: N is the number of descriptors after the pidfd (1-64)");
        return 2;
    };
    // SAFETY: called first thing in main, before any thread starts.
    match unsafe { nix::unistd::fork() } {
        Err(e) => {
            eprintln!("cairn-init --hold: cannot fork: {e}");
            1
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{child}");
            let _ = out.flush();
            0
        }
        Ok(nix::unistd::ForkResult::Child) => {
            let _ = nix::unistd::setsid();
            // Nothing but the owner's pidfd and the held sockets stays open.
            let last = OWNER as u32 + n;
            // SAFETY: close_range on descriptors this process owns.
            unsafe {
                libc::syscall(libc::SYS_close_range, 0u32, (OWNER - 1) as u32, 0u32);
                libc::syscall(libc::SYS_close_range, last + 1, u32::MAX, 0u32);
            }
            let mut owner = libc::pollfd {
                fd: OWNER,
                events: libc::POLLIN,
                revents: 0,
            };
            loop {
                // SAFETY: one pollfd, owned here.
                let ready = unsafe { libc::poll(&mut owner, 1, -1) };
                if ready > 0 || (ready < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)) {
                    return 0;
                }
            }
        }
    }
}
