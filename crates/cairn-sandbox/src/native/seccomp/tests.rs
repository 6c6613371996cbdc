//! The compiled program run on synthetic calls by a small classic-BPF
//! interpreter, so every listed call's answer is checked without a kernel.

use super::*;

const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
const AUDIT_ARCH_I386: u32 = 0x4000_0003;

/// A call as seccomp sees it.
struct Call {
    nr: u32,
    arch: u32,
    args: [u64; 6],
}

impl Call {
    fn new(nr: i64, args: &[u64]) -> Call {
        let mut all = [0; 6];
        all[..args.len()].copy_from_slice(args);
        Call {
            nr: nr as u32,
            arch: AUDIT_ARCH_X86_64,
            args: all,
        }
    }

    /// The 32-bit word at `offset` of `struct seccomp_data`.
    fn word(&self, offset: u32) -> u32 {
        match offset {
            0 => self.nr,
            4 => self.arch,
            16..=63 if offset.is_multiple_of(4) => {
                let arg = self.args[(offset as usize - 16) / 8];
                if offset.is_multiple_of(8) {
                    arg as u32
                } else {
                    (arg >> 32) as u32
                }
            }
            _ => panic!("the program loads seccomp_data offset {offset}"),
        }
    }
}

/// Runs `program` on `call` as the kernel would; returns the action.
fn run(program: &[BpfInstruction], call: &Call) -> u32 {
    let mut a = 0u32;
    let mut pc = 0usize;
    loop {
        let (code, jt, jf, k) = program[pc];
        pc += 1;
        let code = u32::from(code);
        let jump = |taken: bool| usize::from(if taken { jt } else { jf });
        match code {
            c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => a = call.word(k),
            c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => a &= k,
            c if c == libc::BPF_JMP | libc::BPF_JA => pc += k as usize,
            c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => pc += jump(a == k),
            c if c == libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K => pc += jump(a > k),
            c if c == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K => pc += jump(a >= k),
            c if c == libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K => pc += jump(a & k != 0),
            c if c == libc::BPF_RET | libc::BPF_K => return k,
            other => panic!("instruction {other:#x} at {} is not interpreted", pc - 1),
        }
    }
}

fn the_program() -> Vec<BpfInstruction> {
    let mut programs = programs();
    assert_eq!(programs.len(), 1, "one program holds the whole filter");
    programs.pop().unwrap()
}

#[test]
fn the_embedded_program_is_the_policy_compiled() {
    assert_eq!(the_program(), program(&[]).unwrap());
}

fn answer(program: &[BpfInstruction], nr: i64, args: &[u64]) -> u32 {
    run(program, &Call::new(nr, args))
}

#[test]
fn every_listed_call_is_allowed_and_every_refused_one_answers_eperm() {
    let p = the_program();
    assert!(
        p.len() < 4096,
        "{} instructions are more than the kernel takes",
        p.len()
    );
    for &nr in ALLOWED {
        assert_eq!(answer(&p, nr, &[]), ALLOW, "call {nr}");
    }
    for &nr in REFUSED {
        assert_eq!(answer(&p, nr, &[]), RET_EPERM, "call {nr}");
    }
}

#[test]
fn the_lists_are_disjoint_and_within_the_known_numbers() {
    let checked = [
        libc::SYS_clone,
        libc::SYS_clone3,
        libc::SYS_socket,
        libc::SYS_socketpair,
        libc::SYS_personality,
        libc::SYS_ioctl,
    ];
    let mut seen = std::collections::BTreeSet::new();
    for &nr in ALLOWED.iter().chain(REFUSED).chain(&checked) {
        assert!(seen.insert(nr), "call {nr} is listed twice");
        assert!((0..=NEWEST_KNOWN).contains(&nr), "call {nr}");
    }
}

#[test]
fn x32_numbers_and_other_architectures_are_refused() {
    let p = the_program();
    for nr in [
        libc::SYS_getpid,
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_execve,
        512,
        547,
    ] {
        let x32 = nr | i64::from(X32_SYSCALL_BIT);
        assert_eq!(answer(&p, x32, &[]), RET_EPERM, "x32 call {x32:#x}");
    }
    assert_eq!(answer(&p, -1, &[]), RET_EPERM);
    // i386's getpid (20) is x86_64's writev: numbers of another
    // architecture mean other calls, so the process dies.
    let i386 = Call {
        nr: 20,
        arch: AUDIT_ARCH_I386,
        args: [0; 6],
    };
    assert_eq!(run(&p, &i386), RET_KILL_PROCESS);
}

#[test]
fn calls_newer_than_the_list_and_clone3_answer_enosys() {
    let p = the_program();
    for nr in [
        NEWEST_KNOWN + 1,
        NEWEST_KNOWN + 40,
        1000,
        i64::from(X32_SYSCALL_BIT) - 1,
    ] {
        assert_eq!(answer(&p, nr, &[]), RET_ENOSYS, "call {nr}");
    }
    assert_eq!(answer(&p, libc::SYS_clone3, &[]), RET_ENOSYS);
}

#[test]
fn clone_is_allowed_only_without_namespace_flags() {
    let p = the_program();
    let thread = (libc::CLONE_VM
        | libc::CLONE_FS
        | libc::CLONE_FILES
        | libc::CLONE_SIGHAND
        | libc::CLONE_THREAD
        | libc::CLONE_SYSVSEM
        | libc::CLONE_SETTLS
        | libc::CLONE_PARENT_SETTID
        | libc::CLONE_CHILD_CLEARTID) as u64;
    let fork = libc::SIGCHLD as u64 | libc::CLONE_CHILD_SETTID as u64 | libc::CLONE_CHILD_CLEARTID as u64;
    assert_eq!(answer(&p, libc::SYS_clone, &[thread]), ALLOW);
    assert_eq!(answer(&p, libc::SYS_clone, &[fork]), ALLOW);
    for flag in [
        libc::CLONE_NEWNS,
        libc::CLONE_NEWUTS,
        libc::CLONE_NEWIPC,
        libc::CLONE_NEWUSER,
        libc::CLONE_NEWPID,
        libc::CLONE_NEWNET,
        libc::CLONE_NEWCGROUP,
    ] {
        assert_eq!(
            answer(&p, libc::SYS_clone, &[fork | flag as u64]),
            RET_EPERM,
            "flag {flag:#x}"
        );
    }
}

#[test]
fn sockets_are_allowed_for_local_ip_and_some_netlink_only() {
    let p = the_program();
    let socket = |family: i32, protocol: i32| answer(&p, libc::SYS_socket, &[family as u64, 1, protocol as u64]);
    assert_eq!(socket(libc::AF_UNIX, 0), ALLOW);
    for family in [libc::AF_INET, libc::AF_INET6] {
        assert_eq!(socket(family, libc::IPPROTO_TCP), ALLOW, "family {family}");
    }
    for protocol in [libc::NETLINK_ROUTE, libc::NETLINK_SOCK_DIAG, libc::NETLINK_AUDIT] {
        assert_eq!(socket(libc::AF_NETLINK, protocol), ALLOW, "netlink {protocol}");
    }
    for protocol in [
        libc::NETLINK_GENERIC,
        libc::NETLINK_NETFILTER,
        libc::NETLINK_KOBJECT_UEVENT,
    ] {
        assert_eq!(socket(libc::AF_NETLINK, protocol), RET_EPERM, "netlink {protocol}");
    }
    for family in [
        libc::AF_VSOCK,
        libc::AF_PACKET,
        libc::AF_ALG,
        libc::AF_TIPC,
        libc::AF_BLUETOOTH,
        46,
    ] {
        assert_eq!(socket(family, 0), RET_EPERM, "family {family}");
    }
    // The kernel reads an int: high bits do not make AF_VSOCK another family.
    let vsock_high = (1u64 << 32) | libc::AF_VSOCK as u64;
    assert_eq!(answer(&p, libc::SYS_socket, &[vsock_high, 1, 0]), RET_EPERM);
    let pair = |family: i32| answer(&p, libc::SYS_socketpair, &[family as u64, 1, 0]);
    assert_eq!(pair(libc::AF_UNIX), ALLOW);
    assert_eq!(pair(libc::AF_TIPC), RET_EPERM);
}

#[test]
fn ip_sockets_are_allowed_for_tcp_udp_and_ping_only_whatever_their_flags() {
    let p = the_program();
    let socket = |family: i32, kind: i32, protocol: i32| {
        answer(&p, libc::SYS_socket, &[family as u64, kind as u64, protocol as u64])
    };
    let flags = [
        0,
        libc::SOCK_NONBLOCK,
        libc::SOCK_CLOEXEC,
        libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
    ];
    for (family, icmp) in [
        (libc::AF_INET, libc::IPPROTO_ICMP),
        (libc::AF_INET6, libc::IPPROTO_ICMPV6),
    ] {
        for flag in flags {
            for (kind, protocol) in [
                (libc::SOCK_STREAM, 0),
                (libc::SOCK_STREAM, libc::IPPROTO_TCP),
                (libc::SOCK_DGRAM, 0),
                (libc::SOCK_DGRAM, libc::IPPROTO_UDP),
                (libc::SOCK_DGRAM, icmp),
            ] {
                assert_eq!(
                    socket(family, kind | flag, protocol),
                    ALLOW,
                    "{family} {kind:#x}|{flag:#x} {protocol}"
                );
            }
            for (kind, protocol) in [
                (libc::SOCK_STREAM, libc::IPPROTO_MPTCP),
                (libc::SOCK_STREAM, libc::IPPROTO_SCTP),
                (libc::SOCK_STREAM, libc::IPPROTO_UDP),
                (libc::SOCK_DGRAM, libc::IPPROTO_UDPLITE),
                (libc::SOCK_DGRAM, libc::IPPROTO_TCP),
                (libc::SOCK_SEQPACKET, 0),
                (libc::SOCK_SEQPACKET, libc::IPPROTO_SCTP),
                (libc::SOCK_RAW, 0),
                (libc::SOCK_RAW, icmp),
                (libc::SOCK_RAW, libc::IPPROTO_RAW),
                (libc::SOCK_RAW, libc::IPPROTO_TCP),
                (libc::SOCK_RDM, 0),
                (10, 0), // SOCK_PACKET
            ] {
                assert_eq!(
                    socket(family, kind | flag, protocol),
                    RET_EPERM,
                    "{family} {kind:#x}|{flag:#x} {protocol}"
                );
            }
        }
    }
    // The kernel reads ints: high bits do not make MPTCP protocol 0, nor a
    // raw socket a stream.
    let high = 1u64 << 32;
    let mptcp = [
        libc::AF_INET as u64,
        libc::SOCK_STREAM as u64,
        high | libc::IPPROTO_MPTCP as u64,
    ];
    assert_eq!(answer(&p, libc::SYS_socket, &mptcp), RET_EPERM);
    let raw = [libc::AF_INET as u64, high | libc::SOCK_RAW as u64, 0];
    assert_eq!(answer(&p, libc::SYS_socket, &raw), RET_EPERM);
    // Local sockets of every type, and local pairs, stay allowed.
    for kind in [
        libc::SOCK_STREAM,
        libc::SOCK_DGRAM,
        libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
    ] {
        assert_eq!(socket(libc::AF_UNIX, kind, 0), ALLOW, "{kind:#x}");
        let pair = answer(&p, libc::SYS_socketpair, &[libc::AF_UNIX as u64, kind as u64, 0]);
        assert_eq!(pair, ALLOW, "{kind:#x}");
    }
}

#[test]
fn personality_takes_only_the_plain_linux_values() {
    let p = the_program();
    for persona in [0u64, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff] {
        assert_eq!(answer(&p, libc::SYS_personality, &[persona]), ALLOW, "{persona:#x}");
    }
    let read_implies_exec = 0x0040_0000;
    let addr_no_randomize = 0x0004_0000;
    for persona in [read_implies_exec, addr_no_randomize, (1 << 32) | read_implies_exec] {
        assert_eq!(answer(&p, libc::SYS_personality, &[persona]), RET_EPERM, "{persona:#x}");
    }
}

#[test]
fn ioctl_refuses_terminal_injection_only() {
    let p = the_program();
    let ioctl = |request: u64| answer(&p, libc::SYS_ioctl, &[0, request]);
    assert_eq!(ioctl(libc::TIOCSTI), RET_EPERM);
    assert_eq!(ioctl((1 << 32) | libc::TIOCSTI), RET_EPERM);
    assert_eq!(ioctl(0x541c), RET_EPERM, "TIOCLINUX");
    for request in [libc::TCGETS, libc::FIONREAD, libc::TIOCGWINSZ, libc::FIONBIO] {
        assert_eq!(ioctl(request), ALLOW, "{request:#x}");
    }
}

#[test]
fn a_call_allowed_for_a_test_is_allowed_and_the_rest_stay_as_they_were() {
    let p = the_program();
    let loosened = programs_also_allowing(&[libc::SYS_kcmp, libc::SYS_socket])
        .unwrap()
        .remove(0);
    assert_eq!(answer(&loosened, libc::SYS_kcmp, &[]), ALLOW);
    assert_eq!(answer(&loosened, libc::SYS_socket, &[libc::AF_VSOCK as u64]), ALLOW);
    for nr in [
        libc::SYS_ptrace,
        libc::SYS_pidfd_getfd,
        libc::SYS_clone3,
        NEWEST_KNOWN + 1,
    ] {
        assert_eq!(answer(&loosened, nr, &[]), answer(&p, nr, &[]), "call {nr}");
    }
}

/// The filter as one seccompiler chain compiles it: what the ranges of
/// plain calls replaced, kept here as the reference they must answer like.
fn one_chain(also_allowed: &[i64]) -> Vec<BpfInstruction> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().chain(also_allowed).map(|&nr| (nr, Vec::new())).collect();
    rules.extend(argument_rules(also_allowed).unwrap());
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .unwrap();
    let body: BpfProgram = filter.try_into().unwrap();
    let mut program = head(also_allowed);
    program.extend(body.into_iter().map(|i| (i.code, i.jt, i.jf, i.k)));
    program
}

#[test]
fn the_ranges_answer_every_call_as_the_one_chain_does_in_a_quarter_of_its_length() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut argument_sets: Vec<Vec<u64>> = vec![
        vec![],
        vec![libc::CLONE_NEWUSER as u64],
        vec![libc::AF_INET as u64, 0, 0],
        vec![libc::AF_INET as u64, libc::SOCK_STREAM as u64, 0],
        vec![
            libc::AF_INET6 as u64,
            (libc::SOCK_DGRAM | libc::SOCK_NONBLOCK) as u64,
            0,
        ],
        vec![
            libc::AF_INET as u64,
            libc::SOCK_STREAM as u64,
            libc::IPPROTO_MPTCP as u64,
        ],
        vec![libc::AF_INET as u64, libc::SOCK_RAW as u64, libc::IPPROTO_ICMP as u64],
        vec![libc::AF_NETLINK as u64, 0, libc::NETLINK_ROUTE as u64],
        vec![libc::AF_NETLINK as u64, 0, 99],
        vec![libc::AF_PACKET as u64],
        vec![0, libc::TIOCSTI],
        vec![0, 0x541c],
        vec![0x0008],
        vec![u64::MAX; 6],
    ];
    argument_sets.extend((0..20).map(|_| (0..6).map(|_| random()).collect()));
    for also in [
        &[][..],
        &[libc::SYS_mount, libc::SYS_clone][..],
        &[libc::SYS_clone3][..],
    ] {
        let (new, reference) = (program(also).unwrap(), one_chain(also));
        assert!(
            new.len() * 4 <= reference.len(),
            "{} instructions against the chain's {}",
            new.len(),
            reference.len()
        );
        for nr in (0..=NEWEST_KNOWN + 4).chain([X32_SYSCALL_BIT as i64, X32_SYSCALL_BIT as i64 + 1, u32::MAX as i64]) {
            for args in &argument_sets {
                assert_eq!(
                    answer(&new, nr, args),
                    answer(&reference, nr, args),
                    "call {nr} with {args:x?} (also allowed: {also:?})"
                );
            }
        }
    }
}
