// The policy of `seccomp.rs`: what the filter allows and how it is
// compiled. Included by that module and by the build script, which
// compiles it once, so that no sandbox start pays for it.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// Calls missing from libc's table, by their x86_64 numbers.
mod nr {
    pub const CREATE_MODULE: i64 = 174;
    pub const GET_KERNEL_SYMS: i64 = 177;
    pub const QUERY_MODULE: i64 = 178;
    pub const IO_PGETEVENTS: i64 = 333;
    pub const CACHESTAT: i64 = 451;
    pub const MAP_SHADOW_STACK: i64 = 453;
    pub const FUTEX_WAKE: i64 = 454;
    pub const FUTEX_WAIT: i64 = 455;
    pub const FUTEX_REQUEUE: i64 = 456;
    pub const STATMOUNT: i64 = 457;
    pub const LISTMOUNT: i64 = 458;
    pub const LSM_GET_SELF_ATTR: i64 = 459;
    pub const LSM_SET_SELF_ATTR: i64 = 460;
    pub const LSM_LIST_MODULES: i64 = 461;
    pub const SETXATTRAT: i64 = 463;
    pub const GETXATTRAT: i64 = 464;
    pub const LISTXATTRAT: i64 = 465;
    pub const REMOVEXATTRAT: i64 = 466;
    pub const OPEN_TREE_ATTR: i64 = 467;
    pub const FILE_GETATTR: i64 = 468;
    pub const FILE_SETATTR: i64 = 469;
    /// The uretprobe trampoline's call (the kernel lets it through anyway).
    pub const URETPROBE: i64 = 335;
}

/// The highest call number this list has weighed (Linux 6.17's
/// `file_setattr`); higher ones answer ENOSYS.
pub const NEWEST_KNOWN: i64 = nr::FILE_SETATTR;

/// Allowed whatever their arguments.
const ALLOWED: &[i64] = &[
    // Files and directories.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_creat,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_stat,
    libc::SYS_fstat,
    libc::SYS_lstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_lseek,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_pipe,
    libc::SYS_pipe2,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_flock,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_sync,
    libc::SYS_syncfs,
    libc::SYS_sync_file_range,
    libc::SYS_truncate,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fadvise64,
    libc::SYS_readahead,
    libc::SYS_getdents,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_chdir,
    libc::SYS_fchdir,
    libc::SYS_chroot,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    // Device nodes need CAP_MKNOD, which sandboxes lack; FIFOs and sockets
    // do not.
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fchmodat2,
    libc::SYS_chown,
    libc::SYS_fchown,
    libc::SYS_lchown,
    libc::SYS_fchownat,
    libc::SYS_umask,
    libc::SYS_utime,
    libc::SYS_utimes,
    libc::SYS_futimesat,
    libc::SYS_utimensat,
    libc::SYS_setxattr,
    libc::SYS_lsetxattr,
    libc::SYS_fsetxattr,
    libc::SYS_getxattr,
    libc::SYS_lgetxattr,
    libc::SYS_fgetxattr,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_flistxattr,
    libc::SYS_removexattr,
    libc::SYS_lremovexattr,
    libc::SYS_fremovexattr,
    nr::SETXATTRAT,
    nr::GETXATTRAT,
    nr::LISTXATTRAT,
    nr::REMOVEXATTRAT,
    nr::FILE_GETATTR,
    nr::FILE_SETATTR,
    nr::CACHESTAT,
    // What is mounted in the caller's own namespace, as /proc/self/mountinfo.
    nr::STATMOUNT,
    nr::LISTMOUNT,
    libc::SYS_sendfile,
    libc::SYS_splice,
    libc::SYS_tee,
    libc::SYS_vmsplice,
    libc::SYS_copy_file_range,
    libc::SYS_memfd_create,
    libc::SYS_inotify_init,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_rm_watch,
    // POSIX asynchronous I/O (not io_uring).
    libc::SYS_io_setup,
    libc::SYS_io_destroy,
    libc::SYS_io_submit,
    libc::SYS_io_cancel,
    libc::SYS_io_getevents,
    nr::IO_PGETEVENTS,
    // Memory.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_msync,
    libc::SYS_mincore,
    libc::SYS_madvise,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_munlock,
    libc::SYS_mlockall,
    libc::SYS_munlockall,
    libc::SYS_remap_file_pages,
    libc::SYS_membarrier,
    libc::SYS_pkey_mprotect,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_mseal,
    nr::MAP_SHADOW_STACK,
    // System V and POSIX IPC (the sandbox has its own IPC namespace).
    libc::SYS_shmget,
    libc::SYS_shmat,
    libc::SYS_shmdt,
    libc::SYS_shmctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_semctl,
    libc::SYS_msgget,
    libc::SYS_msgsnd,
    libc::SYS_msgrcv,
    libc::SYS_msgctl,
    libc::SYS_mq_open,
    libc::SYS_mq_unlink,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_notify,
    libc::SYS_mq_getsetattr,
    // Processes and threads.
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_gettid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getresuid,
    libc::SYS_getresgid,
    libc::SYS_getgroups,
    libc::SYS_setuid,
    libc::SYS_setgid,
    libc::SYS_setreuid,
    libc::SYS_setregid,
    libc::SYS_setresuid,
    libc::SYS_setresgid,
    libc::SYS_setfsuid,
    libc::SYS_setfsgid,
    libc::SYS_setgroups,
    libc::SYS_setpgid,
    libc::SYS_getpgid,
    libc::SYS_getpgrp,
    libc::SYS_setsid,
    libc::SYS_getsid,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_prctl,
    libc::SYS_arch_prctl,
    libc::SYS_set_thread_area,
    libc::SYS_get_thread_area,
    libc::SYS_set_tid_address,
    libc::SYS_set_robust_list,
    libc::SYS_get_robust_list,
    libc::SYS_rseq,
    libc::SYS_futex,
    libc::SYS_futex_waitv,
    nr::FUTEX_WAKE,
    nr::FUTEX_WAIT,
    nr::FUTEX_REQUEUE,
    libc::SYS_sched_yield,
    libc::SYS_sched_setparam,
    libc::SYS_sched_getparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setattr,
    libc::SYS_sched_getattr,
    libc::SYS_getpriority,
    libc::SYS_setpriority,
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_getrlimit,
    libc::SYS_setrlimit,
    libc::SYS_prlimit64,
    libc::SYS_getrusage,
    libc::SYS_times,
    libc::SYS_sysinfo,
    libc::SYS_uname,
    libc::SYS_getcpu,
    libc::SYS_restart_syscall,
    // A pidfd to wait on or signal a process (subprocess libraries use
    // them); taking a descriptor out of one (`pidfd_getfd`) is refused.
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    // Programs that sandbox themselves further.
    libc::SYS_seccomp,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_restrict_self,
    // Signals.
    libc::SYS_kill,
    libc::SYS_tkill,
    libc::SYS_tgkill,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_rt_sigsuspend,
    libc::SYS_sigaltstack,
    libc::SYS_pause,
    libc::SYS_alarm,
    libc::SYS_getitimer,
    libc::SYS_setitimer,
    libc::SYS_signalfd,
    libc::SYS_signalfd4,
    // Time: reading clocks, sleeping, timers. `adjtimex` changes nothing
    // without CAP_SYS_TIME, which sandboxes lack (ntptime reads with it).
    libc::SYS_time,
    libc::SYS_gettimeofday,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_adjtimex,
    libc::SYS_timer_create,
    libc::SYS_timer_settime,
    libc::SYS_timer_gettime,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_delete,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    // Waiting on descriptors.
    libc::SYS_select,
    libc::SYS_pselect6,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_eventfd,
    libc::SYS_eventfd2,
    // Sockets, once made (`socket` and `socketpair` are checked below).
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
    libc::SYS_getrandom,
];

/// Refused calls, by class. Every call not in [`ALLOWED`] (or checked by
/// argument) is refused the same way; this list names the ones weighed, so
/// a test can check each stays refused.
pub const REFUSED: &[i64] = &[
    // Reaching into another process: reading or writing its memory, taking
    // its descriptors, comparing its resources (PID 1 holds the socket the
    // host talks to).
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_kcmp,
    libc::SYS_process_madvise,
    libc::SYS_process_mrelease,
    // Mounts and namespaces.
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_open_tree,
    nr::OPEN_TREE_ATTR,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    // Files by handle, bypassing the mount tree.
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    // Kernel attack surface ordinary programs do without.
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_userfaultfd,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_keyctl,
    libc::SYS_fanotify_init,
    libc::SYS_fanotify_mark,
    libc::SYS_memfd_secret,
    libc::SYS_modify_ldt,
    nr::LSM_GET_SELF_ATTR,
    nr::LSM_SET_SELF_ATTR,
    nr::LSM_LIST_MODULES,
    nr::URETPROBE,
    // NUMA placement (Docker's profile asks CAP_SYS_NICE, which sandboxes
    // lack).
    libc::SYS_mbind,
    libc::SYS_set_mempolicy,
    libc::SYS_get_mempolicy,
    libc::SYS_set_mempolicy_home_node,
    libc::SYS_migrate_pages,
    libc::SYS_move_pages,
    // The machine: modules, kexec, reboot, swap, clocks, accounting,
    // quotas, the kernel log, hardware ports, host and domain names.
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    nr::CREATE_MODULE,
    nr::QUERY_MODULE,
    nr::GET_KERNEL_SYMS,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_quotactl_fd,
    libc::SYS_syslog,
    libc::SYS_vhangup,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_lookup_dcookie,
    // Obsolete or never implemented.
    libc::SYS_uselib,
    libc::SYS_ustat,
    libc::SYS_sysfs,
    libc::SYS__sysctl,
    libc::SYS_nfsservctl,
    libc::SYS_getpmsg,
    libc::SYS_putpmsg,
    libc::SYS_afs_syscall,
    libc::SYS_tuxcall,
    libc::SYS_security,
    libc::SYS_vserver,
    libc::SYS_epoll_ctl_old,
    libc::SYS_epoll_wait_old,
];

/// `clone` flags that would create namespaces.
const NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

/// `personality` values allowed (Docker's): PER_LINUX, PER_LINUX32, the
/// UNAME26 variants of both, and 0xffffffff, which only reads the current
/// one. READ_IMPLIES_EXEC (executable data) and ADDR_NO_RANDOMIZE are not
/// among them.
const PERSONALITIES: &[u64] = &[0, 0x0008, 0x0002_0000, 0x0002_0008, 0xffff_ffff];

/// The bits of `socket`'s type argument that name the type; the rest are
/// SOCK_NONBLOCK and SOCK_CLOEXEC.
const SOCK_TYPE_MASK: u64 = 0xf;

/// Socket families: local (any type), IP with these types and protocols,
/// and netlink with the protocols below. IP: TCP and UDP (protocol 0 picks
/// them), and ICMP echo datagrams (ping sockets, which
/// `net.ipv4.ping_group_range` opens to every group of the sandbox).
/// Refused: raw IP sockets (the kernel refuses them too, the sandbox's root
/// holding no CAP_NET_RAW over its network namespace), MPTCP,
/// UDP-Lite, SCTP and every other IP protocol, parts of the kernel
/// ordinary programs leave alone and sources of kernel bugs; AF_VSOCK (no
/// network namespace confines it; on a VM it reaches the hypervisor),
/// AF_PACKET (link-level capture and a history of kernel bugs reachable
/// with CAP_NET_RAW), AF_ALG, and every other family.
const IP_PROTOCOLS: &[(i32, i32, &[i32])] = &[
    (libc::AF_INET, libc::SOCK_STREAM, &[0, libc::IPPROTO_TCP]),
    (libc::AF_INET, libc::SOCK_DGRAM, &[0, libc::IPPROTO_UDP, libc::IPPROTO_ICMP]),
    (libc::AF_INET6, libc::SOCK_STREAM, &[0, libc::IPPROTO_TCP]),
    (libc::AF_INET6, libc::SOCK_DGRAM, &[0, libc::IPPROTO_UDP, libc::IPPROTO_ICMPV6]),
];

/// Netlink protocols: ROUTE (addresses, links, routes: `ip`, getifaddrs),
/// SOCK_DIAG (`ss`), AUDIT (login, su, sudo and cron write audit records).
/// The others serve privileged tools or other subsystems (netfilter, xfrm,
/// generic netlink families, uevents).
const NETLINK_PROTOCOLS: &[i32] = &[libc::NETLINK_ROUTE, libc::NETLINK_SOCK_DIAG, libc::NETLINK_AUDIT];

/// `ioctl` requests refused: TIOCSTI pushes input into a terminal (typed
/// into whatever reads it next), TIOCLINUX reaches the virtual console.
const REFUSED_IOCTLS: &[u64] = &[libc::TIOCSTI, 0x541c];

/// Seccomp's view of a call (`struct seccomp_data`): offsets of the number
/// and the architecture.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

const BPF_LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const BPF_JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const BPF_JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
const BPF_JGT_K: u16 = (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16;
const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
const BPF_JA: u16 = (libc::BPF_JMP | libc::BPF_JA) as u16;
const RET_KILL_PROCESS: u32 = libc::SECCOMP_RET_KILL_PROCESS;
const RET_EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
const RET_ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;

/// One program: a hand-written head (architecture, x32 numbers, newer
/// calls, `clone3`), the calls allowed whatever their arguments as ranges
/// of numbers, then the calls allowed for some arguments, compiled by
/// seccompiler, which answers EPERM to every call it does not allow.
///
/// The ranges keep the program short: the kernel checks and compiles it on
/// every sandbox start, in time that follows its length (as one
/// seccompiler chain it was 1,574 instructions and took 0.65 ms here; it
/// is 342, 90 of them the IP sockets' types and protocols).
fn program(also_allowed: &[i64]) -> Result<Vec<BpfInstruction>, String> {
    let ruled = argument_rules(also_allowed)?;
    let plain: Vec<i64> = ALLOWED
        .iter()
        .chain(also_allowed)
        .copied()
        .filter(|nr| !ruled.contains_key(nr))
        .collect();
    let filter = SeccompFilter::new(
        ruled,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| e.to_string())?;
    let body: BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    let mut program = head(also_allowed);
    program.extend(allowed_ranges(&plain));
    program.extend(body.into_iter().map(|i| (i.code, i.jt, i.jf, i.k)));
    Ok(program)
}

/// The head: anything but x86-64 is killed, x32 numbers refused, numbers
/// newer than the list and `clone3` answer ENOSYS (so C libraries fall
/// back to what the list allows). Leaves the call's number loaded.
fn head(also_allowed: &[i64]) -> Vec<BpfInstruction> {
    let mut program = vec![
        (BPF_LD_W_ABS, 0, 0, DATA_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        ret(RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, DATA_NR),
        jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
        ret(RET_EPERM),
        jump(BPF_JGT_K, NEWEST_KNOWN as u32, 0, 1),
        ret(RET_ENOSYS),
    ];
    if !also_allowed.contains(&libc::SYS_clone3) {
        program.extend([jump(BPF_JEQ_K, libc::SYS_clone3 as u32, 0, 1), ret(RET_ENOSYS)]);
    }
    program
}

/// Allows the call numbers in `plain` (the number loaded): one block per
/// run of consecutive numbers, in ascending order, so a number below a
/// run's start is in no later run and goes on to what follows the blocks.
fn allowed_ranges(plain: &[i64]) -> Vec<BpfInstruction> {
    let mut numbers: Vec<u32> = plain.iter().map(|&nr| nr as u32).collect();
    numbers.sort_unstable();
    numbers.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for nr in numbers {
        match runs.last_mut() {
            Some((_, hi)) if *hi + 1 == nr => *hi = nr,
            _ => runs.push((nr, nr)),
        }
    }
    let mut blocks = Vec::with_capacity(4 * runs.len());
    for (i, &(lo, hi)) in runs.iter().enumerate() {
        // Instructions after this block's jump-away, to the end of the blocks.
        let rest = (4 * (runs.len() - i - 1)) as u32;
        blocks.extend([
            jump(BPF_JGT_K, hi, 3, 0),
            jump(BPF_JGE_K, lo, 0, 1),
            ret(libc::SECCOMP_RET_ALLOW),
            (BPF_JA, 0, 0, rest),
        ]);
    }
    blocks
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> BpfInstruction {
    (code, jt, jf, k)
}

fn ret(k: u32) -> BpfInstruction {
    (BPF_RET_K, 0, 0, k)
}

/// The calls allowed for some arguments only; one `also_allowed` is
/// allowed whatever its arguments instead.
fn argument_rules(also_allowed: &[i64]) -> Result<BTreeMap<i64, Vec<SeccompRule>>, String> {
    let mut rules = BTreeMap::new();
    rules.insert(
        libc::SYS_clone,
        vec![rule(&[(0, SeccompCmpOp::MaskedEq(NAMESPACE_FLAGS), 0)])?],
    );
    rules.insert(libc::SYS_personality, any_of(0, PERSONALITIES)?);
    let mut socket = any_of(0, &[libc::AF_UNIX as u64])?;
    for &(family, kind, protocols) in IP_PROTOCOLS {
        for &protocol in protocols {
            socket.push(rule(&[
                (0, SeccompCmpOp::Eq, family as u64),
                (1, SeccompCmpOp::MaskedEq(SOCK_TYPE_MASK), kind as u64),
                (2, SeccompCmpOp::Eq, protocol as u64),
            ])?);
        }
    }
    for &protocol in NETLINK_PROTOCOLS {
        socket.push(rule(&[
            (0, SeccompCmpOp::Eq, libc::AF_NETLINK as u64),
            (2, SeccompCmpOp::Eq, protocol as u64),
        ])?);
    }
    rules.insert(libc::SYS_socket, socket);
    rules.insert(libc::SYS_socketpair, any_of(0, &[libc::AF_UNIX as u64])?);
    let ioctl: Vec<_> = REFUSED_IOCTLS.iter().map(|&r| (1, SeccompCmpOp::Ne, r)).collect();
    rules.insert(libc::SYS_ioctl, vec![rule(&ioctl)?]);
    for nr in also_allowed {
        rules.remove(nr);
    }
    Ok(rules)
}

/// One rule: all of `conditions` (argument, comparison, value) hold, each
/// on the argument's low 32 bits (the kernel reads these arguments as
/// 32-bit values, so high bits cannot slip past a check).
fn rule(conditions: &[(u8, SeccompCmpOp, u64)]) -> Result<SeccompRule, String> {
    let conditions = conditions
        .iter()
        .map(|(arg, op, value)| {
            SeccompCondition::new(*arg, SeccompCmpArgLen::Dword, op.clone(), *value).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    SeccompRule::new(conditions).map_err(|e| e.to_string())
}

/// Rules matching when argument `arg` is one of `values`.
fn any_of(arg: u8, values: &[u64]) -> Result<Vec<SeccompRule>, String> {
    values.iter().map(|&v| rule(&[(arg, SeccompCmpOp::Eq, v)])).collect()
}
