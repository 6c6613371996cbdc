//! IP sockets of the protocols a sandbox has no use for (MPTCP, UDP-Lite,
//! SCTP, raw), tried from inside a sandbox by `sockets.c`, run on each
//! driver (seccomp.rs, gvisor.rs), beside those it keeps (TCP, UDP, ping).

use std::collections::BTreeMap;
use std::path::Path;

use cairn_protocol::{ExecRequest, FileKind, FileMeta};
use cairn_sandbox::client::InitClient;

/// Sockets that must not be made.
pub const REFUSED: &[&str] = &[
    "mptcp4",
    "mptcp4_flags",
    "mptcp6",
    "udplite4",
    "udplite6",
    "udplite6_flags",
    "sctp4",
    "sctp4_seqpacket",
    "raw4_icmp",
    "raw4_raw",
    "raw6_icmp",
];

/// Sockets ordinary programs make, which must work, and a byte sent over
/// loopback TCP and UDP.
pub const KEPT: &[&str] = &[
    "tcp4",
    "tcp4_flags",
    "tcp6",
    "udp4",
    "udp4_flags",
    "udp6",
    "unix_seqpacket",
    "socketpair_unix",
    "tcp4_loopback",
    "udp4_loopback",
];

/// Ping sockets: made where `net.ipv4.ping_group_range` covers the
/// caller's group, EACCES elsewhere.
pub const PING: &[&str] = &["ping4", "ping6"];

/// Copies the compiled `sockets` program to the sandbox and runs it;
/// each attempt's errno, 0 when the socket was made.
pub fn attempts(client: &InitClient, program: &Path) -> BTreeMap<String, i32> {
    let bytes = std::fs::read(program).unwrap();
    let meta = FileMeta {
        path: "/sockets".into(),
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
            argv: vec!["/sockets".into()],
            timeout_ms: Some(60_000),
            ..ExecRequest::default()
        })
        .unwrap()
        .unwrap_or_else(|f| panic!("spawn failed: {f:?}"));
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = session.wait(&mut out, &mut err).unwrap().unwrap();
    let (out, err) = (String::from_utf8(out).unwrap(), String::from_utf8_lossy(&err));
    assert_eq!(status.code, Some(0), "the sockets program failed:\n{out}{err}");
    let attempts: BTreeMap<String, i32> = out
        .lines()
        .map(|line| match line.split(' ').collect::<Vec<_>>()[..] {
            [name, "ok"] => (name.to_string(), 0),
            [name, "errno", n] => (name.to_string(), n.parse().unwrap()),
            _ => panic!("the sockets program printed {line:?}"),
        })
        .collect();
    for name in REFUSED.iter().chain(KEPT).chain(PING) {
        assert!(attempts.contains_key(*name), "no line for {name}:\n{out}");
    }
    attempts
}
