//! gVisor state files: a checkpoint image written by runsc (unpacked for
//! the chunk store), and a header kept in a snapshot manifest (packed back
//! in front of a state stream for a restore).
#![no_main]

use std::io::{self, Cursor};

use cairn_sandbox::gvisor::statefile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut image = Cursor::new(data);
    let mut raw = Vec::new();
    if let Ok(Some(header)) = statefile::unpack_from(&mut image, data.len() as u64, &mut raw) {
        // What was unpacked packs again.
        statefile::pack(&header, &mut &raw[..], &mut io::sink()).expect("an unpacked header packs");
    }
    // A header from a manifest: the input up to the first "|", then a stream.
    let split = data.iter().position(|&b| b == b'|').unwrap_or(data.len());
    let (header, stream) = data.split_at(split);
    let _ = statefile::pack(header, &mut &stream[..], &mut io::sink());
});
