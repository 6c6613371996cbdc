//! Capabilities kept by native sandboxes: Docker's default set minus
//! CAP_MKNOD (there is no device cgroup to stop a block-device node for the
//! host disk). Notably absent: SYS_ADMIN (mount), SYS_MODULE, SYS_TIME,
//! SYS_PTRACE, NET_ADMIN, SYS_RESOURCE.

use caps::{CapSet, Capability, CapsHashSet};

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

/// Drops every other capability from the bounding, inheritable, effective,
/// permitted and ambient sets of the calling thread.
pub fn drop_to_safe_set() -> Result<(), String> {
    let keep: CapsHashSet = KEEP.into_iter().collect();
    for cap in caps::all() {
        if !keep.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap).map_err(|e| format!("drop {cap} from the bounding set: {e}"))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|e| format!("clear ambient capabilities: {e}"))?;
    caps::set(None, CapSet::Inheritable, &CapsHashSet::new()).map_err(|e| format!("set inheritable: {e}"))?;
    caps::set(None, CapSet::Effective, &keep).map_err(|e| format!("set effective: {e}"))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(|e| format!("set permitted: {e}"))?;
    Ok(())
}
