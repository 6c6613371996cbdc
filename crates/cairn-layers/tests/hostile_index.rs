//! Layer indexes (from the chunk store) and capture baselines (from the
//! state directory) are hostile bytes. As arbitrary bytes and as mutations
//! of valid encodings they give a clear error, never a panic, never an
//! allocation past the caps; an index that decodes is then either valid or
//! refused by `validate` with a reason.

use cairn_testkit::{alloc_meter, mutation};

use cairn_layers::archive::{
    Baseline, Entry, EntryKind, IndexRoot, IndexSegment, LayerIndex, LayerPath, Metadata, Timestamp, Xattr,
};
use cairn_store::frame::{self, HEADER_LEN};
use cairn_store::{ChunkHash, ChunkRef, FileContent, FrameError, Framed};
use proptest::prelude::*;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Serde preallocates at most 1 MiB of elements for a sequence or map
/// whatever length it declares; everything else grows with the bytes
/// actually there.
const SEQUENCE_PREALLOCATION: usize = 1 << 20;
/// What decoding may allocate beyond the bytes: a sequence's
/// preallocation, twice (entries and segments).
const PREALLOCATION: usize = 2 * SEQUENCE_PREALLOCATION + (1 << 19);

fn meta(mode: u32) -> Metadata {
    Metadata {
        mode,
        uid: 1000,
        gid: 1000,
        mtime: Timestamp {
            sec: 1_700_000_000,
            nsec: 5,
        },
        xattrs: vec![Xattr {
            name: b"trusted.overlay.opaque".to_vec(),
            value: b"y".to_vec(),
        }],
    }
}

fn entry(path: &[u8], kind: EntryKind) -> Entry {
    Entry {
        path: LayerPath::from_bytes(path),
        kind,
        meta: meta(0o755),
    }
}

fn index() -> LayerIndex {
    let file = FileContent {
        size: 3 << 20,
        chunks: vec![
            ChunkRef {
                offset: 0,
                len: 1 << 20,
                hash: ChunkHash::of(b"a"),
            },
            ChunkRef {
                offset: 2 << 20,
                len: 65536,
                hash: ChunkHash::of(b"b"),
            },
        ],
    };
    LayerIndex {
        entries: vec![
            entry(b"", EntryKind::Directory),
            entry(b"d", EntryKind::Directory),
            entry(b"d/f", EntryKind::File(file)),
            entry(b"d/sda", EntryKind::BlockDevice { major: 8, minor: 0 }),
            entry(b"d/wh", EntryKind::CharDevice { major: 0, minor: 0 }),
            entry(b"fifo", EntryKind::Fifo),
            entry(
                b"link",
                EntryKind::HardLink {
                    target: LayerPath::from_bytes(b"d/f"),
                },
            ),
            entry(b"\xff\xfe", EntryKind::Symlink { target: b"/x".to_vec() }),
        ],
    }
}
fn root() -> IndexRoot {
    IndexRoot {
        entries: index().entries,
        segments: Vec::new(),
    }
}

/// Opens `body` as a capture baseline's compressed part: a clear error or
/// a checked baseline, never a panic.
fn open_baseline(body: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("baseline");
    let mut bytes = b"CAIRNBSL".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(body);
    std::fs::write(&path, &bytes).unwrap();
    if let Err(e) = Baseline::open(&path) {
        assert!(e.contains("capture baseline"), "{e}");
    }
}

/// Decodes `bytes` as a layer index and as a baseline, as the store and the
/// next capture would, and checks what they allocate.
fn decode_both(bytes: &[u8]) {
    let (_, usage) = alloc_meter::measure(|| {
        match frame::decode::<IndexRoot>(bytes) {
            Ok(root) => {
                let index = LayerIndex { entries: root.entries };
                if index.validate().is_ok() {
                    let _ = index.referenced_chunks().count();
                    let _ = index.file_bytes();
                }
            }
            Err(e) => {
                assert!(e.to_string().contains("layer index"), "{e}");
                if let FrameError::TooLarge { len, cap, .. } = e {
                    assert!(len > cap);
                }
            }
        }
        if let Err(e) = frame::decode::<IndexSegment>(bytes) {
            assert!(e.to_string().contains("layer index segment"), "{e}");
        }
    });
    assert!(
        usage.peak <= PREALLOCATION + 16 * bytes.len() + 4096,
        "{} bytes: {usage:?}",
        bytes.len()
    );
}

#[test]
fn a_valid_index_decodes_and_validates() {
    let bytes = frame::encode(&root()).unwrap();
    let back = LayerIndex {
        entries: frame::decode::<IndexRoot>(&bytes).unwrap().entries,
    };
    assert_eq!(back, index());
    back.validate().unwrap();
    assert_eq!(back.referenced_chunks().count(), 2);
}

#[test]
fn an_index_declaring_a_huge_entry_count_allocates_at_most_a_mebibyte() {
    let mut payload = vec![0xFD];
    payload.extend_from_slice(&(1u64 << 50).to_le_bytes());
    let bytes = frame::seal::<IndexRoot>(IndexRoot::VERSION, &payload);
    let (err, usage) = alloc_meter::measure(|| frame::decode::<IndexRoot>(&bytes).unwrap_err());
    assert!(matches!(err, FrameError::Decode { .. }), "{err}");
    assert!(usage.largest <= SEQUENCE_PREALLOCATION, "{usage:?}");
}

#[test]
fn file_sizes_that_overflow_a_sum_saturate() {
    let mut idx = index();
    for name in [&b"x1"[..], b"x2"] {
        let last = idx.entries.len() - 1;
        idx.entries.insert(
            last,
            entry(
                name,
                EntryKind::File(FileContent {
                    size: u64::MAX - 1,
                    chunks: vec![],
                }),
            ),
        );
    }
    idx.validate().unwrap();
    assert_eq!(idx.file_bytes(), u64::MAX);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        decode_both(&bytes);
        decode_both(&frame::seal::<IndexRoot>(IndexRoot::VERSION, &bytes));
        decode_both(&frame::seal::<IndexRoot>(1, &bytes));
        decode_both(&frame::seal::<IndexSegment>(IndexSegment::VERSION, &bytes));
        open_baseline(&bytes);
    }

    #[test]
    fn mutated_indexes_are_refused_or_validated(muts in mutation::mutations(), reseal in any::<bool>()) {
        let mut bytes = frame::encode(&root()).unwrap();
        if reseal {
            let mut payload = bytes.split_off(HEADER_LEN);
            mutation::apply(&mut payload, &muts);
            bytes = frame::seal::<IndexRoot>(IndexRoot::VERSION, &payload);
        } else {
            mutation::apply(&mut bytes, &muts);
        }
        decode_both(&bytes);
    }
}
