//! Chunks as stored: zstd frames, decompressed under a cap and checked
//! against their hash. The first byte picks the cap (a data chunk's exact
//! length, the largest data chunk, a metadata object).
#![no_main]

use cairn_store::{decode_chunk, ChunkHash, MAX_CHUNK};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, compressed)) = data.split_first() else {
        return;
    };
    let cap = match pick % 3 {
        0 => u64::from(pick),
        1 => u64::from(MAX_CHUNK),
        _ => 16 << 20,
    };
    // The hash of the input itself, so a stored chunk of its own bytes
    // (zstd's raw blocks) can pass the check too.
    let hash = ChunkHash::of(compressed);
    if let Ok(bytes) = decode_chunk(&hash, compressed, cap) {
        assert!(bytes.len() as u64 <= cap);
    }
    let _ = decode_chunk(&ChunkHash::of(b""), compressed, cap);
});
