//! gVisor state files are hostile bytes: a checkpoint image is written by
//! the sandbox's sentry, and the header packed back for a restore comes
//! from a snapshot manifest in the store. Arbitrary bytes and mutations of
//! valid state files are unpacked or left alone (never an error, never a
//! panic), and nothing allocated is larger than one chunk (at most 64 MiB).

use cairn_testkit::{alloc_meter, mutation};

use std::io::{self, Cursor, Write};

use cairn_sandbox::gvisor::statefile::{pack, unpack_from};
use flate2::write::DeflateEncoder;
use flate2::Compression;
use proptest::prelude::*;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// The largest chunk a state file may declare, and the buffers around it.
const MAX_CHUNK: usize = 64 << 20;
const BUFFERS: usize = 2 << 20;

/// A state file as runsc writes it: magic, JSON metadata, optionally a MAC,
/// the chunk size, then DEFLATE chunks.
fn state_file(stream: &[u8], chunk_size: u32, mac: bool) -> Vec<u8> {
    let json = br#"{"_timestamp":"2026-11-30 03:37:45 +0000 UTC"}"#;
    let mut f = b"gVisorSF".to_vec();
    f.extend_from_slice(&(json.len() as u64).to_be_bytes());
    f.extend_from_slice(json);
    if mac {
        f.extend_from_slice(&[0xAB; 32]);
    }
    f.extend_from_slice(&chunk_size.to_be_bytes());
    for piece in stream.chunks(chunk_size as usize) {
        let mut e = DeflateEncoder::new(Vec::new(), Compression::fast());
        e.write_all(piece).unwrap();
        let c = e.finish().unwrap();
        f.extend_from_slice(&(c.len() as u32).to_be_bytes());
        f.extend_from_slice(&c);
    }
    f
}

fn stream(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 / 13) as u8) ^ seed).collect()
}

/// Unpacks `image`; what unpacks packs again and unpacks to the same
/// stream. Checks what that allocates.
fn unpack_checked(image: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut raw = Vec::new();
    let (result, usage) = alloc_meter::measure(|| unpack_from(&mut Cursor::new(image), image.len() as u64, &mut raw));
    assert!(usage.largest <= MAX_CHUNK, "{usage:?}");
    // The inflated stream is the caller's (a file in production); beyond
    // it, one chunk and the buffers.
    assert!(usage.peak <= 2 * raw.capacity() + MAX_CHUNK + BUFFERS, "{usage:?}");
    let header = result.expect("a hostile image is left alone, not an error")?;
    assert!(header.len() <= image.len() && header.starts_with(b"gVisorSF"));
    let mut packed = Vec::new();
    pack(&header, &mut &raw[..], &mut packed).expect("an unpacked header packs");
    let mut again = Vec::new();
    let header_again = unpack_from(&mut Cursor::new(&packed), packed.len() as u64, &mut again)
        .unwrap()
        .expect("a packed file unpacks");
    assert_eq!((header_again, &again), (header.clone(), &raw));
    Some((header, raw))
}

#[test]
fn valid_state_files_unpack_to_their_stream() {
    for mac in [true, false] {
        let s = stream(3, 10_000);
        let (_, raw) = unpack_checked(&state_file(&s, 4096, mac)).unwrap();
        assert_eq!(raw, s);
    }
}

#[test]
fn a_chunk_inflating_past_its_size_is_not_unpacked() {
    // One chunk that inflates to 1 MiB under a declared 4 KiB chunk size.
    let mut image = state_file(&[], 4096, true);
    let mut e = DeflateEncoder::new(Vec::new(), Compression::best());
    e.write_all(&vec![0; 1 << 20]).unwrap();
    let c = e.finish().unwrap();
    image.extend_from_slice(&(c.len() as u32).to_be_bytes());
    image.extend_from_slice(&c);
    let (result, usage) =
        alloc_meter::measure(|| unpack_from(&mut Cursor::new(&image), image.len() as u64, &mut Vec::new()).unwrap());
    assert!(result.is_none());
    assert!(usage.largest <= BUFFERS, "{usage:?}");
}

#[test]
fn a_header_naming_a_chunk_size_past_the_cap_is_refused() {
    let mut header = state_file(&[], 4096, true);
    let n = header.len();
    header[n - 4..].copy_from_slice(&(128u32 << 20).to_be_bytes());
    let (err, usage) = alloc_meter::measure(|| pack(&header, &mut &b"x"[..], &mut io::sink()).unwrap_err());
    assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    assert!(err.to_string().contains("chunk size"), "{err}");
    assert!(usage.largest < 4096, "{usage:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn arbitrary_bytes_are_left_alone(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        unpack_checked(&bytes);
        let mut image = b"gVisorSF".to_vec();
        image.extend_from_slice(&bytes);
        unpack_checked(&image);
    }

    #[test]
    fn mutated_state_files_are_unpacked_or_left_alone(
        seed in any::<u8>(),
        len in 0usize..12_000,
        mac in any::<bool>(),
        muts in mutation::mutations(),
    ) {
        let mut image = state_file(&stream(seed, len), 4096, mac);
        mutation::apply(&mut image, &muts);
        unpack_checked(&image);
    }

    #[test]
    fn hostile_headers_are_packed_or_refused(
        header in proptest::collection::vec(any::<u8>(), 0..64),
        chunk_size in prop_oneof![any::<u32>(), 4096u32..=(64 << 20)],
        stream_len in 0usize..10_000,
    ) {
        let mut header = [b"gVisorSF".to_vec(), header].concat();
        header.extend_from_slice(&chunk_size.to_be_bytes());
        let s = stream(1, stream_len);
        let (result, usage) = alloc_meter::measure(|| pack(&header, &mut &s[..], &mut io::sink()));
        if let Err(e) = result {
            prop_assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
        prop_assert!(usage.largest <= MAX_CHUNK + MAX_CHUNK / 1024 + 64, "{:?}", usage);
    }
}
