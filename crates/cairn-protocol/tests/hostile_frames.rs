//! Init protocol frames from a hostile peer, in both directions: the host
//! decodes `FromInit` from a sandbox, init decodes `ToInit` and
//! `NativeSetup`. Arbitrary bytes and mutations of valid frames give an
//! error, never a panic, and never make a reader allocate past the frame
//! cap.

use cairn_testkit::{alloc_meter, mutation};

use cairn_protocol::{
    decode_payload, hello, read_frame, write_frame, DirEntry, ExecRequest, ExitStatus, FileKind, FileMeta, FrameError,
    FromInit, FsErrorKind, NativeSetup, SpawnErrorKind, ToInit, MAX_FRAME_LEN, PROTOCOL_VERSION,
};
use proptest::prelude::*;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Serde preallocates at most 1 MiB for a sequence whatever length it
/// declares; the rest grows with the bytes actually there.
const SEQUENCE_PREALLOCATION: usize = 1 << 20;

fn meta() -> FileMeta {
    FileMeta {
        path: "/work/out.txt".into(),
        kind: FileKind::File,
        mode: 0o644,
        uid: 1000,
        gid: 1000,
        size: 12,
        mtime_ns: -5,
    }
}

fn to_init() -> Vec<ToInit> {
    vec![
        hello(),
        ToInit::Ping,
        ToInit::Exec(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
            env: vec![("A".into(), "b".into())],
            cwd: Some("/tmp".into()),
            stdin: true,
            timeout_ms: Some(5000),
            detach: false,
            user: None,
        }),
        ToInit::Stdin(b"input".to_vec()),
        ToInit::Kill { pid: 7, signal: 9 },
        ToInit::PutFile(meta()),
        ToInit::Data(vec![0xAB; 300]),
        ToInit::Restored {
            unix_time_ns: 1 << 70,
            entropy: vec![1; 32],
        },
        ToInit::StartJob {
            name: "run.stage.main.0".into(),
            request: ExecRequest::default(),
        },
        ToInit::AttachJob {
            name: "run.stage.main.0".into(),
            stdout_from: 10,
            stderr_from: 0,
        },
        ToInit::ListDir {
            path: "/work".into(),
            depth: 3,
            max_entries: 10_000,
        },
        ToInit::MakeDir {
            path: "/work/a/b".into(),
            parents: true,
        },
        ToInit::Rename {
            from: "/work/a".into(),
            to: "/work/c".into(),
        },
        ToInit::Remove {
            path: "/work/c".into(),
            recursive: true,
        },
    ]
}

fn from_init() -> Vec<FromInit> {
    vec![
        FromInit::Welcome {
            version: PROTOCOL_VERSION,
            init_pid: 1,
        },
        FromInit::Started { pid: 42 },
        FromInit::Stdout(b"out".to_vec()),
        FromInit::Exited(ExitStatus {
            code: Some(3),
            signal: None,
            timed_out: false,
        }),
        FromInit::SpawnFailed {
            kind: SpawnErrorKind::NotFound,
            message: "no such file".into(),
        },
        FromInit::Stat(Some(meta())),
        FromInit::File(meta()),
        FromInit::Error("refused".into()),
        FromInit::Entry(DirEntry {
            meta: FileMeta {
                kind: FileKind::Symlink,
                ..meta()
            },
            symlink_target: Some("../elsewhere".into()),
        }),
        FromInit::Entry(DirEntry {
            meta: meta(),
            symlink_target: None,
        }),
        FromInit::EntriesEnd { truncated: true },
        FromInit::Made { created: false },
        FromInit::FsError {
            kind: FsErrorKind::NotEmpty,
            message: "not empty".into(),
        },
    ]
}

fn native_setup() -> NativeSetup {
    NativeSetup {
        version: PROTOCOL_VERSION,
        cgroup_procs: vec!["/sys/fs/cgroup/cairn/x/cgroup.procs".into()],
        rootfs: "/var/lib/cairn/r".into(),
        lower_dirs: vec!["/a".into(), "/b".into()],
        layer_mount: cairn_protocol::LayerMount::IdmappedPaths,
        upper_dir: "/u".into(),
        work_dir: "/w".into(),
        shm_bytes: 64 << 20,
        hostname: "sandbox".into(),
        host_id_base: 0x7000_0000,
        id_count: 65536,
        keep_capabilities: 0x3ff,
        seccomp: vec![vec![(0x20, 0, 0, 4), (6, 0, 0, 0x7fff_0000)]],
        network: Some(cairn_protocol::NetSetup {
            address: [10, 213, 0, 2],
            prefix_len: 30,
            gateway: [10, 213, 0, 1],
            resolv_conf: "/s/net/resolv.conf".into(),
            hosts: None,
        }),
    }
}

/// A stream of frames of every message kind, as one peer would send them.
fn valid_stream() -> Vec<u8> {
    let mut wire = Vec::new();
    for m in to_init() {
        write_frame(&mut wire, &m).unwrap();
    }
    for m in from_init() {
        write_frame(&mut wire, &m).unwrap();
    }
    write_frame(&mut wire, &native_setup()).unwrap();
    wire
}

/// Reads frames until the first error, as each kind of reader would, and
/// checks every error is one a caller can report.
fn read_all(wire: &[u8]) {
    fn drain<T: for<'de> serde::Deserialize<'de>>(wire: &[u8]) {
        let mut r = wire;
        loop {
            match read_frame::<T, _>(&mut r) {
                Ok(_) => continue,
                Err(FrameError::Closed | FrameError::Io(_) | FrameError::Decode(_)) => break,
                Err(FrameError::TooLarge(len)) => {
                    assert!(len > MAX_FRAME_LEN);
                    break;
                }
                Err(e @ FrameError::Encode(_)) => panic!("a read reported {e}"),
            }
        }
    }
    let (_, usage) = alloc_meter::measure(|| {
        drain::<ToInit>(wire);
        drain::<FromInit>(wire);
        drain::<NativeSetup>(wire);
    });
    assert!(
        usage.largest <= MAX_FRAME_LEN as usize,
        "one allocation of {} bytes",
        usage.largest
    );
    assert!(
        usage.peak <= MAX_FRAME_LEN as usize + SEQUENCE_PREALLOCATION + 4 * wire.len(),
        "{usage:?}"
    );
}

/// Decodes a bare payload as every message type.
fn decode_all(payload: &[u8]) {
    let (_, usage) = alloc_meter::measure(|| {
        let _ = decode_payload::<ToInit>(payload);
        let _ = decode_payload::<FromInit>(payload);
        let _ = decode_payload::<NativeSetup>(payload);
    });
    assert!(
        usage.peak <= SEQUENCE_PREALLOCATION + 4 * payload.len() + 4096,
        "{} payload bytes: {usage:?}",
        payload.len()
    );
}

#[test]
fn valid_frames_round_trip() {
    let wire = valid_stream();
    let mut r = &wire[..];
    for m in to_init() {
        assert_eq!(read_frame::<ToInit, _>(&mut r).unwrap(), m);
    }
    for m in from_init() {
        assert_eq!(read_frame::<FromInit, _>(&mut r).unwrap(), m);
    }
    assert_eq!(read_frame::<NativeSetup, _>(&mut r).unwrap(), native_setup());
    assert!(matches!(read_frame::<ToInit, _>(&mut r), Err(FrameError::Closed)));
}

#[test]
fn a_declared_length_past_the_cap_is_refused_before_allocating() {
    let mut wire = u32::MAX.to_le_bytes().to_vec();
    wire.extend_from_slice(&[0; 16]);
    let (err, usage) = alloc_meter::measure(|| read_frame::<FromInit, _>(&mut &wire[..]).unwrap_err());
    assert!(matches!(err, FrameError::TooLarge(u32::MAX)), "{err}");
    assert!(err.to_string().contains("above the"), "{err}");
    assert!(usage.largest < 4096, "{usage:?}");
}

#[test]
fn a_frame_declaring_the_cap_and_sending_little_costs_what_was_sent() {
    let mut wire = MAX_FRAME_LEN.to_le_bytes().to_vec();
    wire.extend_from_slice(&[0; 16]);
    let (err, usage) = alloc_meter::measure(|| read_frame::<FromInit, _>(&mut &wire[..]).unwrap_err());
    assert!(matches!(err, FrameError::Io(_)), "{err}");
    assert!(usage.largest <= 64 * 1024, "{usage:?}");
}

#[test]
fn a_string_declaring_a_huge_length_allocates_nothing_for_it() {
    // FromInit::Error(String) whose length says 2^62 bytes.
    let mut payload = 12u32.to_le_bytes().to_vec();
    payload.extend_from_slice(&(1u64 << 62).to_le_bytes());
    payload.extend_from_slice(b"short");
    let (err, usage) = alloc_meter::measure(|| decode_payload::<FromInit>(&payload).unwrap_err());
    assert!(matches!(err, FrameError::Decode(_)), "{err}");
    assert!(usage.largest < 4096, "{usage:?}");
}

#[test]
fn a_sequence_declaring_a_huge_length_preallocates_at_most_a_mebibyte() {
    // NativeSetup whose cgroup list says 2^40 entries.
    let mut payload = PROTOCOL_VERSION.to_le_bytes().to_vec();
    payload.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let (err, usage) = alloc_meter::measure(|| decode_payload::<NativeSetup>(&payload).unwrap_err());
    assert!(matches!(err, FrameError::Decode(_)), "{err}");
    assert!(usage.largest <= SEQUENCE_PREALLOCATION, "{usage:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        read_all(&bytes);
        decode_all(&bytes);
    }

    #[test]
    fn arbitrary_payloads_behind_a_right_length_are_refused_cleanly(
        payload in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut wire = (payload.len() as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&payload);
        read_all(&wire);
    }

    #[test]
    fn mutated_frames_are_refused_cleanly(
        muts in mutation::mutations(),
        prefix in any::<u32>(),
        set_prefix in any::<bool>(),
    ) {
        let mut wire = valid_stream();
        if set_prefix {
            wire[..4].copy_from_slice(&prefix.to_le_bytes());
        }
        mutation::apply(&mut wire, &muts);
        read_all(&wire);
        if wire.len() > 4 {
            decode_all(&wire[4..]);
        }
    }
}
