//! The seccomp-bpf deny list of native sandboxes, in the spirit of Docker's
//! default profile: no mounting, no kernel modules, no kexec or reboot, no
//! clock setting, no new namespaces, no keyrings, no BPF or perf, no
//! io_uring. Everything else is allowed; capabilities do the rest.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

const DENIED: &[i64] = &[
    libc::SYS_acct,
    libc::SYS_add_key,
    libc::SYS_bpf,
    libc::SYS_clock_adjtime,
    libc::SYS_clock_settime,
    libc::SYS_settimeofday,
    libc::SYS_delete_module,
    libc::SYS_finit_module,
    libc::SYS_init_module,
    libc::SYS_kexec_file_load,
    libc::SYS_kexec_load,
    libc::SYS_keyctl,
    libc::SYS_request_key,
    libc::SYS_lookup_dcookie,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_perf_event_open,
    libc::SYS_pivot_root,
    libc::SYS_quotactl,
    libc::SYS_reboot,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_syslog,
    libc::SYS_uselib,
    libc::SYS_userfaultfd,
    libc::SYS_ustat,
    libc::SYS_sysfs,
    libc::SYS__sysctl,
    libc::SYS_vhangup,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_nfsservctl,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_fanotify_init,
];

/// `clone` flags that would create namespaces.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// The filters as plain instructions, the form `cairn-init` installs.
pub fn programs() -> Result<Vec<Vec<cairn_protocol::BpfInstruction>>, String> {
    Ok(filters()?
        .into_iter()
        .map(|p| p.into_iter().map(|i| (i.code, i.jt, i.jf, i.k)).collect())
        .collect())
}

/// Compiles the filters. `clone3` answers ENOSYS (its flags sit in memory
/// where seccomp cannot look), so libc falls back to `clone`, whose flags
/// the first filter checks.
pub fn filters() -> Result<Vec<BpfProgram>, String> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| e.to_string())?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|&flag| {
            let cond = SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(flag), flag)
                .map_err(|e| e.to_string())?;
            SeccompRule::new(vec![cond]).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, String>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| e.to_string())?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(|e| e.to_string())?;
    Ok(vec![
        deny.try_into().map_err(|e: seccompiler::BackendError| e.to_string())?,
        clone3
            .try_into()
            .map_err(|e: seccompiler::BackendError| e.to_string())?,
    ])
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile_for_this_architecture() {
        let f = super::filters().unwrap();
        assert_eq!(f.len(), 2);
        assert!(f[0].len() > super::DENIED.len());
    }
}
