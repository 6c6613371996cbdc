//! File operations with the capabilities of the sandbox's root user, not
//! init's. Under gVisor init keeps `CAP_SYS_ADMIN` in its effective set
//! (to remount `/proc` when quiescing) while no command it starts can have
//! it (it is out of the bounding set); a file operation requested by the
//! host runs with its thread's effective set cut to the bounding set for
//! its duration, so it can do exactly what the sandbox's own root could.
//! Capabilities are per thread on Linux (and in gVisor): other threads,
//! the quiescing one included, keep theirs. Under the native driver the
//! two sets are the same and nothing changes.

#[repr(C)]
struct Header {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const VERSION_3: u32 = 0x2008_0522;

fn get() -> Option<[Data; 2]> {
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes one header and two data structs (version 3),
    // both laid out as the kernel expects and alive for the call.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()) };
    (rc == 0).then_some(data)
}

fn set(data: &[Data; 2]) -> bool {
    let header = Header {
        version: VERSION_3,
        pid: 0,
    };
    // SAFETY: capset reads one header and two data structs, as above; with
    // pid 0 it changes the calling thread only.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) };
    rc == 0
}

/// The capabilities in the bounding set (what a command can ever have).
fn bounding() -> u64 {
    let mut set = 0u64;
    for cap in 0..64u64 {
        // SAFETY: prctl with integer arguments only; it reads.
        match unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) } {
            1 => set |= 1 << cap,
            0 => {}
            _ => break,
        }
    }
    set
}

/// The calling thread's effective set cut to the bounding set until
/// dropped.
pub struct AsSandboxRoot {
    restore: Option<[Data; 2]>,
}

impl AsSandboxRoot {
    pub fn enter() -> AsSandboxRoot {
        let Some(now) = get() else {
            return AsSandboxRoot { restore: None };
        };
        let effective = u64::from(now[0].effective) | (u64::from(now[1].effective) << 32);
        let allowed = effective & bounding();
        if allowed == effective {
            return AsSandboxRoot { restore: None };
        }
        let mut cut = now;
        cut[0].effective = allowed as u32;
        cut[1].effective = (allowed >> 32) as u32;
        if set(&cut) {
            AsSandboxRoot { restore: Some(now) }
        } else {
            AsSandboxRoot { restore: None }
        }
    }

    /// The calling thread's effective set, for tests.
    #[cfg(test)]
    fn effective() -> u64 {
        get().map_or(0, |d| u64::from(d[0].effective) | (u64::from(d[1].effective) << 32))
    }
}

impl Drop for AsSandboxRoot {
    fn drop(&mut self) {
        if let Some(before) = self.restore.take() {
            // Raising back within the permitted set needs no privilege.
            if !set(&before) {
                eprintln!("cairn-init: cannot restore this thread's capabilities after a file operation");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run as root (tests are): in a thread of its own, a capability
    /// dropped from the bounding set is cut from the effective set inside
    /// the guard and back after it; other threads keep theirs.
    #[test]
    fn a_capability_out_of_the_bounding_set_is_cut_for_the_operation_only() {
        const CAP_SYS_ADMIN: u64 = 21;
        if AsSandboxRoot::effective() & (1 << CAP_SYS_ADMIN) == 0 {
            eprintln!("skipped: needs CAP_SYS_ADMIN (run as root)");
            return;
        }
        // The bounding set is per thread too; the drop stays in a process
        // of its own so that no other test sees it.
        // SAFETY: the child calls only prctl/capget/capset and exits.
        match unsafe { libc::fork() } {
            0 => {
                // SAFETY: prctl with integer arguments; the guard calls
                // capget and capset only.
                let code = unsafe {
                    libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_ADMIN as libc::c_ulong, 0, 0, 0);
                    let before = AsSandboxRoot::effective() & (1 << CAP_SYS_ADMIN) != 0;
                    let inside = {
                        let _g = AsSandboxRoot::enter();
                        AsSandboxRoot::effective() & (1 << CAP_SYS_ADMIN) != 0
                    };
                    let after = AsSandboxRoot::effective() & (1 << CAP_SYS_ADMIN) != 0;
                    if before && !inside && after {
                        0
                    } else {
                        1
                    }
                };
                // SAFETY: ends the forked child without running anything of
                // the parent's.
                unsafe { libc::_exit(code) };
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for the child forked above, into a local.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "status {status:#x}"
                );
            }
        }
    }
}
