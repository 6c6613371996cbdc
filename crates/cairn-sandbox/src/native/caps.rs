//! Capabilities kept by native sandboxes: Docker's default set minus
//! CAP_MKNOD (there is no device cgroup to stop a block-device node for the
//! host disk). Notably absent: SYS_ADMIN (mount), SYS_MODULE, SYS_TIME,
//! SYS_PTRACE, NET_ADMIN, SYS_RESOURCE.

use caps::Capability;

const KEEP: [Capability; 13] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// The capabilities a native sandbox keeps, as a bit mask by capability
/// number (what `cairn-init` applies).
pub fn keep_mask() -> u64 {
    KEEP.iter().fold(0, |mask, cap| mask | (1u64 << cap.index()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_mask_keeps_chown_and_drops_sys_admin() {
        let mask = super::keep_mask();
        assert_ne!(mask & (1 << 0), 0, "CAP_CHOWN");
        assert_eq!(mask & (1 << 21), 0, "CAP_SYS_ADMIN");
        assert_eq!(mask & (1 << 27), 0, "CAP_MKNOD");
    }
}
