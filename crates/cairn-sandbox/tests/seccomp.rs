//! The native sandbox's seccomp filter, by behaviour: a static probe
//! (support/probe.c) copied into a sandbox makes the calls the filter
//! refuses and some it allows, and each must end as designed. The same
//! probe under a filter with one refusal lifted shows that the filter, not
//! only the kernel's own checks, is what stops the call. A second program
//! (support/sockets.c) tries IP sockets of each protocol: TCP, UDP and
//! ping sockets are made, MPTCP, UDP-Lite, SCTP and raw ones refused.
//!
//! Needs root and a C compiler with a static libc (gcc, libc6-dev);
//! otherwise prints `SKIPPED: <reason>` and passes, except under CI=true,
//! where a missing compiler fails.

mod support;

use std::collections::BTreeMap;
use std::path::Path;

use cairn_protocol::{BpfInstruction, ExecRequest, FileKind, FileMeta};
use cairn_sandbox::client::InitClient;
use cairn_sandbox::native::seccomp;
use support::{sockets, Native};

/// How one of the probe's calls ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Errno(i32),
    /// The child that made the call was killed by this signal.
    Signal(i32),
}

/// Calls the filter refuses with EPERM.
const REFUSED: &[&str] = &[
    "pidfd_getfd",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "socket_vsock",
    "socket_packet",
    "socket_netlink_generic",
    "personality_read_implies_exec",
    "ioctl_tiocsti",
    "unshare_user",
    "clone_newns",
    "mount",
    "open_by_handle_at",
    "io_uring_setup",
    "keyctl",
    "bpf",
    "perf_event_open",
    "x32_getpid",
];

/// Calls ordinary programs make, which must work.
const ALLOWED: &[&str] = &[
    "socket_unix",
    "socket_inet",
    "socket_netlink_route",
    "socketpair_unix",
    "ioctl_fionread",
    "personality_query",
    "pidfd_open_self",
    "fork",
    "thread",
];

#[test]
fn the_probe_finds_refused_calls_refused_and_ordinary_ones_working() {
    let Some(report) = probe_report("refusals", seccomp::programs()) else {
        return;
    };
    for &call in REFUSED {
        assert_eq!(report[call], Outcome::Errno(libc::EPERM), "{call}: {report:?}");
    }
    assert_eq!(report["clone3"], Outcome::Errno(libc::ENOSYS), "{report:?}");
    // The filter kills a process making i386 calls; a kernel without i386
    // emulation faults on `int 0x80` before any call is made.
    assert!(
        matches!(report["i386_getpid"], Outcome::Signal(libc::SIGSYS | libc::SIGSEGV)),
        "{report:?}"
    );
    for &call in ALLOWED {
        assert_eq!(report[call], Outcome::Ok, "{call}: {report:?}");
    }
}

#[test]
fn lifting_one_refusal_lets_exactly_that_call_through() {
    // Calls that need no capability and touch only the caller, so they
    // succeed whenever the filter lets them through, whatever else the
    // sandbox's setup refuses (an init that cannot be traced, a user
    // namespace).
    let lifted = [
        ("kcmp", libc::SYS_kcmp),
        ("personality_read_implies_exec", libc::SYS_personality),
        ("socket_netlink_generic", libc::SYS_socket),
        ("clone3", libc::SYS_clone3),
    ];
    for (call, nr) in lifted {
        let programs = seccomp::programs_also_allowing(&[nr]).unwrap();
        let Some(report) = probe_report(&format!("lift{nr}"), programs) else {
            return;
        };
        assert_eq!(report[call], Outcome::Ok, "{call} with its refusal lifted: {report:?}");
        for &other in REFUSED.iter().filter(|&&c| c != call) {
            if nr != libc::SYS_socket || !other.starts_with("socket_") {
                assert_ne!(report[other], Outcome::Ok, "{other} with {call}'s refusal lifted");
            }
        }
    }
}

#[test]
fn ip_sockets_of_other_protocols_than_tcp_udp_and_ping_are_refused() {
    let Some(attempts) = socket_attempts("sockets", seccomp::programs()) else {
        return;
    };
    for &socket in sockets::REFUSED {
        assert_eq!(attempts[socket], libc::EPERM, "{socket}: {attempts:?}");
    }
    // Ping sockets too: the sandbox's `net.ipv4.ping_group_range` covers
    // every group.
    for &socket in sockets::KEPT.iter().chain(sockets::PING) {
        assert_eq!(attempts[socket], 0, "{socket}: {attempts:?}");
    }
}

#[test]
fn mptcp_and_udplite_sockets_are_refused_by_the_filter_not_only_the_kernel() {
    let programs = seccomp::programs_also_allowing(&[libc::SYS_socket]).unwrap();
    let Some(attempts) = socket_attempts("socketslifted", programs) else {
        return;
    };
    // Without the filter's refusal the kernel makes them, or answers that
    // it was built without them: never EPERM.
    for socket in ["mptcp4", "mptcp6", "udplite4", "udplite6"] {
        assert_ne!(attempts[socket], libc::EPERM, "{socket}: {attempts:?}");
    }
}

/// Runs `sockets.c` in a native sandbox whose seccomp filter is
/// `programs`; None (and says why) when it cannot.
fn socket_attempts(test: &str, programs: Vec<Vec<BpfInstruction>>) -> Option<BTreeMap<String, i32>> {
    let tmp = tempfile::Builder::new().prefix("sct").tempdir_in("/tmp").unwrap();
    let program = support::compile("sockets", tmp.path())?;
    let sandbox = Native::start_with(test, |driver| driver.with_seccomp(programs))?;
    let attempts = sockets::attempts(&sandbox.client, &program);
    sandbox.stop();
    Some(attempts)
}

/// Runs the probe in a native sandbox whose seccomp filter is `programs`;
/// returns each call's outcome, or None (and says why) when it cannot.
fn probe_report(test: &str, programs: Vec<Vec<BpfInstruction>>) -> Option<BTreeMap<String, Outcome>> {
    let tmp = tempfile::Builder::new().prefix("sct").tempdir_in("/tmp").unwrap();
    let probe = support::compile("probe", tmp.path())?;
    let sandbox = Native::start_with(test, |driver| driver.with_seccomp(programs))?;
    let output = run_probe(&sandbox.client, &probe);
    sandbox.stop();
    Some(parse(&output))
}

fn run_probe(client: &InitClient, probe: &Path) -> String {
    let bytes = std::fs::read(probe).unwrap();
    let meta = FileMeta {
        path: "/probe".into(),
        kind: FileKind::File,
        mode: 0o755,
        uid: 0,
        gid: 0,
        size: bytes.len() as u64,
        mtime_ns: 0,
    };
    client.put_file(meta, &mut bytes.as_slice()).unwrap();
    let session = client
        .exec(ExecRequest {
            argv: vec!["/probe".into()],
            timeout_ms: Some(60_000),
            ..ExecRequest::default()
        })
        .unwrap()
        .unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = session.wait(&mut out, &mut err).unwrap().unwrap();
    let (out, err) = (String::from_utf8(out).unwrap(), String::from_utf8_lossy(&err));
    assert_eq!(status.code, Some(0), "the probe failed:\n{out}{err}");
    out
}

/// `<name> ok`, `<name> errno <n>`, `<name> signal <n>` lines.
fn parse(output: &str) -> BTreeMap<String, Outcome> {
    output
        .lines()
        .map(|line| {
            let words: Vec<&str> = line.split(' ').collect();
            let number = || words[2].parse::<i32>().unwrap();
            let outcome = match words[1..] {
                ["ok"] => Outcome::Ok,
                ["errno", _] => Outcome::Errno(number()),
                ["signal", _] => Outcome::Signal(number()),
                _ => panic!("the probe printed {line:?}"),
            };
            (words[0].to_string(), outcome)
        })
        .collect()
}
