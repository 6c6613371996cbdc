//! The seccomp-bpf allow list of native sandboxes, in the spirit of
//! Docker's default profile: the system calls a Debian userland, compilers,
//! interpreters and common servers make are allowed, some only with the
//! arguments they need; every other call is refused. x86_64 only (the
//! numbers are x86_64's).
//!
//! What a call gets:
//! - another architecture (i386 through `int 0x80`): the process is killed,
//!   as the syscall numbers would mean other calls;
//! - an x32 number (bit 30 set): EPERM, whatever the kernel's x32 support;
//! - a number above [`NEWEST_KNOWN`], a call newer than this list: ENOSYS,
//!   so libc falls back to the older call as on an older kernel;
//! - `clone3`: ENOSYS, as its flags sit in memory where seccomp cannot look,
//!   so libc falls back to `clone`, whose flags are checked;
//! - a listed call with the arguments it is allowed: allowed;
//! - anything else, including every call in [`REFUSED`]: EPERM.

use cairn_protocol::BpfInstruction;

include!("seccomp/policy.rs");

/// The filter every native sandbox gets, as plain instructions (the form
/// `cairn-init` installs; the setup carries a list of programs): the
/// policy of `seccomp/policy.rs`, compiled by the build script (compiled
/// here, it took a thread and ~0.06 ms of every start).
pub fn programs() -> Vec<Vec<BpfInstruction>> {
    vec![COMPILED
        .chunks_exact(8)
        .map(|i| {
            (
                u16::from_le_bytes([i[0], i[1]]),
                i[2],
                i[3],
                u32::from_le_bytes([i[4], i[5], i[6], i[7]]),
            )
        })
        .collect()]
}

/// [`program`] with nothing more allowed, as the build script wrote it:
/// `struct sock_filter`s (code, jt, jf, k), little-endian.
static COMPILED: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/seccomp.bpf"));

/// The filter with `also_allowed` allowed whatever their arguments. Tests
/// use it to show that a refusal is what stops a call; sandboxes always
/// get [`programs`].
#[doc(hidden)]
pub fn programs_also_allowing(also_allowed: &[i64]) -> Result<Vec<Vec<BpfInstruction>>, String> {
    Ok(vec![program(also_allowed)?])
}

#[cfg(test)]
mod tests;
