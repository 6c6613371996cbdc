//! Stored bytes are hostile: anyone who can write the store directory can
//! change them. Chunks (zstd frames) and framed metadata objects, as
//! arbitrary bytes and as mutations of valid encodings, give a clear error,
//! never a panic, and never make a reader allocate past the caps.

use cairn_testkit::{alloc_meter, mutation};

use std::collections::BTreeMap;

use cairn_store::frame::{self, HEADER_LEN};
use cairn_store::{decode_chunk, ChunkDecodeError, ChunkHash, FileContent, FrameError, Framed, MAX_CHUNK};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Serde preallocates at most 1 MiB for a sequence or map whatever length
/// it declares; everything else grows with the bytes actually there.
const SEQUENCE_PREALLOCATION: usize = 1 << 20;

/// A metadata object with every shape real ones have: nested sequences,
/// maps, strings, byte strings, options, enums and chunk lists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Object {
    name: String,
    sizes: BTreeMap<String, u64>,
    children: Vec<Object>,
    #[serde(with = "serde_bytes")]
    blob: Vec<u8>,
    content: Option<FileContent>,
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Kind {
    Plain,
    Link { target: String },
    Device { major: u32, minor: u32 },
}

impl Framed for Object {
    const MAGIC: [u8; 8] = *b"CAIRNTST";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 64 << 20;
    const NAME: &'static str = "test object";
}

fn object() -> Object {
    let content = FileContent {
        size: 1 << 20,
        chunks: vec![cairn_store::ChunkRef {
            offset: 4096,
            len: 65536,
            hash: ChunkHash::of(b"chunk"),
        }],
    };
    Object {
        name: "root".into(),
        sizes: [("a".to_string(), 1), ("b".to_string(), u64::MAX)]
            .into_iter()
            .collect(),
        children: vec![Object {
            name: "child".into(),
            sizes: BTreeMap::new(),
            children: vec![],
            blob: vec![0, 255, 7],
            content: None,
            kind: Kind::Link { target: "../x".into() },
        }],
        blob: vec![1; 40],
        content: Some(content),
        kind: Kind::Device { major: 0, minor: 0 },
    }
}

/// Decodes `bytes` as an object, checking the error is one of the frame's
/// own and the allocations stay within what the input can justify.
fn decode_object(bytes: &[u8]) {
    let (result, usage) = alloc_meter::measure(|| frame::decode::<Object>(bytes));
    assert!(
        usage.peak <= SEQUENCE_PREALLOCATION + 8 * bytes.len() + 4096,
        "{} bytes: {usage:?}",
        bytes.len()
    );
    if let Err(e) = result {
        let message = e.to_string();
        assert!(message.contains("test object"), "{message}");
        if let FrameError::TooLarge { len, cap, .. } = e {
            assert!(len > cap);
        }
    }
}

fn compressed(data: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(data, 3).unwrap()
}

/// Decodes a chunk under `cap` and checks the outcome and the allocations.
fn decode_chunk_under(hash: &ChunkHash, bytes: &[u8], cap: u64) {
    let (result, usage) = alloc_meter::measure(|| decode_chunk(hash, bytes, cap));
    // The output grows by doubling, so it may hold twice what it keeps.
    assert!(
        usage.largest as u64 <= 2 * (cap + 1) + 64 * 1024,
        "cap {cap}: {usage:?}"
    );
    match result {
        Ok(data) => {
            assert!(data.len() as u64 <= cap);
            assert_eq!(ChunkHash::of(&data), *hash);
        }
        Err(ChunkDecodeError::TooLarge { cap: c }) => assert_eq!(c, cap),
        Err(ChunkDecodeError::Decompress(_) | ChunkDecodeError::HashMismatch { .. }) => {}
    }
}

#[test]
fn a_valid_object_and_chunk_decode() {
    let bytes = frame::encode(&object()).unwrap();
    assert_eq!(frame::decode::<Object>(&bytes).unwrap(), object());
    let data = b"ACGT".repeat(1000);
    let got = decode_chunk(&ChunkHash::of(&data), &compressed(&data), data.len() as u64).unwrap();
    assert_eq!(got, data);
}

#[test]
fn a_chunk_that_inflates_past_its_cap_is_refused_once_past_it() {
    // 64 MiB of zeros compress to a few KiB: a decompression bomb for a
    // reader expecting a 1 MiB data chunk.
    let data = vec![0u8; 64 << 20];
    let bomb = compressed(&data);
    assert!(bomb.len() < 64 << 10);
    let cap = u64::from(MAX_CHUNK);
    let (err, usage) = alloc_meter::measure(|| decode_chunk(&ChunkHash::of(&data), &bomb, cap).unwrap_err());
    assert!(
        matches!(err, ChunkDecodeError::TooLarge { cap: c } if c == cap),
        "{err}"
    );
    assert!(err.to_string().contains("more than 1048576 bytes"), "{err}");
    assert!(usage.largest as u64 <= 2 * (cap + 1), "{usage:?}");
}

/// A zstd frame of one raw byte whose header asks for a 2^`window_log`
/// byte window.
fn frame_with_window(window_log: u32, byte: u8) -> Vec<u8> {
    let mut f = 0xFD2F_B528u32.to_le_bytes().to_vec();
    f.push(0x00); // no content size, not single-segment, no checksum
    f.push(((window_log - 10) << 3) as u8); // exponent, mantissa 0
    f.extend_from_slice(&[0x09, 0x00, 0x00]); // last block, raw, 1 byte
    f.push(byte);
    f
}

#[test]
fn a_chunk_asking_for_a_huge_window_is_refused_before_it_is_allocated() {
    let hash = ChunkHash::of(b"x");
    assert_eq!(
        decode_chunk(&hash, &frame_with_window(cairn_store::MAX_WINDOW_LOG, b'x'), 1).unwrap(),
        b"x"
    );
    // zstd would allocate the 128 MiB window this frame asks for.
    let err = decode_chunk(&hash, &frame_with_window(27, b'x'), 1).unwrap_err();
    assert!(matches!(err, ChunkDecodeError::Decompress(_)), "{err}");
    assert!(err.to_string().contains("does not decompress"), "{err}");
}

#[test]
fn a_payload_declaring_huge_lengths_allocates_little() {
    // name: a string of 2^60 bytes.
    let mut payload = vec![0xFD];
    payload.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let bytes = frame::seal::<Object>(Object::VERSION, &payload);
    let (err, usage) = alloc_meter::measure(|| frame::decode::<Object>(&bytes).unwrap_err());
    assert!(matches!(err, FrameError::Decode { .. }), "{err}");
    assert!(usage.largest < 4096, "{usage:?}");
    // children: a sequence of 2^40 objects after an empty name and map.
    let mut payload = vec![0, 0, 0xFD];
    payload.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let bytes = frame::seal::<Object>(Object::VERSION, &payload);
    let (err, usage) = alloc_meter::measure(|| frame::decode::<Object>(&bytes).unwrap_err());
    assert!(matches!(err, FrameError::Decode { .. }), "{err}");
    assert!(usage.largest <= SEQUENCE_PREALLOCATION, "{usage:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn arbitrary_bytes_are_refused_as_objects(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        decode_object(&bytes);
        decode_object(&frame::seal::<Object>(Object::VERSION, &bytes));
    }

    #[test]
    fn mutated_objects_are_refused_cleanly(muts in mutation::mutations(), reseal in any::<bool>()) {
        let mut bytes = frame::encode(&object()).unwrap();
        if reseal {
            let mut payload = bytes.split_off(HEADER_LEN);
            mutation::apply(&mut payload, &muts);
            bytes = frame::seal::<Object>(Object::VERSION, &payload);
        } else {
            mutation::apply(&mut bytes, &muts);
        }
        decode_object(&bytes);
    }

    #[test]
    fn arbitrary_bytes_are_refused_as_chunks(bytes in proptest::collection::vec(any::<u8>(), 0..1024), cap in 0u64..4096) {
        decode_chunk_under(&ChunkHash::of(&bytes), &bytes, cap);
        decode_chunk_under(&ChunkHash::of(&bytes), &bytes, u64::from(MAX_CHUNK));
    }

    #[test]
    fn mutated_chunks_are_refused_or_give_their_content(
        seed in any::<u8>(),
        len in 0usize..20_000,
        muts in mutation::mutations(),
        cap_slack in -2i64..2,
    ) {
        let data: Vec<u8> = (0..len).map(|i| (i / 7) as u8 ^ seed).collect();
        let mut bytes = compressed(&data);
        mutation::apply(&mut bytes, &muts);
        let cap = (len as i64 + cap_slack).max(0) as u64;
        decode_chunk_under(&ChunkHash::of(&data), &bytes, cap);
    }
}
