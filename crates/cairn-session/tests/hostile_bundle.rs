//! A session bundle's manifest and entry batches come from a file someone
//! else wrote. As arbitrary bytes and as mutations of valid encodings they
//! give a clear error, never a panic, never an allocation past the caps.

use cairn_testkit::{alloc_meter, mutation};

use cairn_layers::LayerId;
use cairn_session::bundle::{
    BundleEntry, BundleImage, BundleManifest, BundleRewind, BundleSession, BundleSnapshot, EntryBatch,
};
use cairn_session::{Entry, EntryKind, GENESIS};
use cairn_store::frame::{self, HEADER_LEN};
use cairn_store::{ChunkHash, Framed};
use proptest::prelude::*;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Serde preallocates at most 1 MiB of elements for a sequence whatever
/// length it declares; everything else grows with the bytes there.
const SEQUENCE_PREALLOCATION: usize = 1 << 20;

fn manifest() -> BundleManifest {
    BundleManifest {
        exported_at: 1_764_500_000_000,
        session: BundleSession {
            source_id: "0123456789ab".into(),
            name: "travel".into(),
            image: "busybox".into(),
            driver: "native".into(),
            snapshot_id: Some(ChunkHash::of(b"snap").to_string()),
            snapshot_seq: Some(2),
            idle_timeout_ms: Some(300_000),
            head_seq: 2,
            head_hash: GENESIS.into(),
            created_at: 1_764_400_000_000,
        },
        entries: 2,
        rewinds: vec![BundleRewind {
            to_seq: 1,
            head_seq: 2,
            created_at: 1_764_450_000_000,
        }],
        snapshots: vec![BundleSnapshot {
            id: ChunkHash::of(b"snap"),
            new_bytes: 10,
            stored_bytes: 20,
        }],
        image: Some(BundleImage {
            name: "busybox".into(),
            source: "build".into(),
            size_bytes: 1 << 20,
            created_at: 1_764_000_000_000,
            layers: vec![LayerId::from_hash(ChunkHash::of(b"image"))],
        }),
        objects: vec![ChunkHash::of(b"a"), ChunkHash::of(b"b")],
    }
}

fn batch() -> EntryBatch {
    let mut call = Entry::new(EntryKind::ToolCall);
    call.seq = 1;
    call.tool = Some("exec".into());
    call.arguments = Some(r#"{"argv":["ls"]}"#.into());
    let mut big = Entry::new(EntryKind::User);
    big.seq = 2;
    big.content_ref = Some(ChunkHash::of(b"payload").to_string());
    big.snapshot_id = Some(ChunkHash::of(b"snap").to_string());
    EntryBatch {
        entries: vec![BundleEntry::from(&call), BundleEntry::from(&big)],
    }
}

/// Decodes `bytes` as both frames, as an import does, and checks what
/// that allocates.
fn decode_both(bytes: &[u8]) {
    let (_, usage) = alloc_meter::measure(|| {
        if let Err(e) = frame::decode::<BundleManifest>(bytes) {
            assert!(e.to_string().contains("session bundle manifest"), "{e}");
        }
        match frame::decode::<EntryBatch>(bytes) {
            Ok(b) => drop(b.entries.into_iter().map(Entry::from).collect::<Vec<_>>()),
            Err(e) => assert!(e.to_string().contains("session bundle entries"), "{e}"),
        }
    });
    assert!(
        usage.peak <= SEQUENCE_PREALLOCATION + 16 * bytes.len() + 4096,
        "{} bytes: {usage:?}",
        bytes.len()
    );
}

#[test]
fn valid_frames_round_trip() {
    let m = frame::decode::<BundleManifest>(&frame::encode(&manifest()).unwrap()).unwrap();
    assert_eq!(m.session.name, "travel");
    assert_eq!(m.objects, manifest().objects);
    assert_eq!(m.image.unwrap().layers, manifest().image.unwrap().layers);
    let b = frame::decode::<EntryBatch>(&frame::encode(&batch()).unwrap()).unwrap();
    let entries: Vec<Entry> = b.entries.into_iter().map(Entry::from).collect();
    let expected: Vec<Entry> = batch().entries.into_iter().map(Entry::from).collect();
    assert_eq!(entries, expected);
}

#[test]
fn a_future_frame_version_is_refused_saying_to_upgrade() {
    let mut bytes = frame::encode(&manifest()).unwrap();
    bytes[8..12].copy_from_slice(&(BundleManifest::VERSION + 1).to_le_bytes());
    let err = frame::decode::<BundleManifest>(&bytes).unwrap_err();
    assert!(err.to_string().contains("upgrade Cairn"), "{err}");
}

#[test]
fn a_manifest_declaring_a_huge_object_count_preallocates_at_most_a_mebibyte() {
    let mut payload = frame::encode(&manifest()).unwrap().split_off(HEADER_LEN);
    // The object list is last: its length, then 32 bytes per hash. Say 2^50.
    let list = payload.len() - 2 * 32 - 1;
    payload.truncate(list);
    payload.push(0xFD);
    payload.extend_from_slice(&(1u64 << 50).to_le_bytes());
    let bytes = frame::seal::<BundleManifest>(BundleManifest::VERSION, &payload);
    let (err, usage) = alloc_meter::measure(|| frame::decode::<BundleManifest>(&bytes).unwrap_err());
    assert!(err.to_string().contains("does not decode"), "{err}");
    assert!(usage.largest <= SEQUENCE_PREALLOCATION, "{usage:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        version in 0u32..3,
    ) {
        decode_both(&bytes);
        decode_both(&frame::seal::<BundleManifest>(version, &bytes));
        decode_both(&frame::seal::<EntryBatch>(version, &bytes));
    }

    #[test]
    fn mutated_frames_are_refused_cleanly(muts in mutation::mutations(), manifest_frame in any::<bool>()) {
        let bytes = if manifest_frame {
            frame::encode(&manifest()).unwrap()
        } else {
            frame::encode(&batch()).unwrap()
        };
        let mut payload = bytes.clone().split_off(HEADER_LEN);
        mutation::apply(&mut payload, &muts);
        decode_both(&frame::seal::<BundleManifest>(1, &payload));
        decode_both(&frame::seal::<EntryBatch>(1, &payload));
        let mut whole = bytes;
        mutation::apply(&mut whole, &muts);
        decode_both(&whole);
    }
}
