//! Layer indexes and capture baselines, as read back from the chunk store
//! and the state directory: the frame, the payload, and the structural
//! checks a reader makes before materialising. The input is decoded as a
//! whole frame and, sealed with a right CRC, as a payload.
#![no_main]

use cairn_store::frame::seal;
use cairn_layers::archive::{Baseline, LayerIndex};
use cairn_store::frame::decode;
use cairn_store::Framed;
use libfuzzer_sys::fuzz_target;

fn index(bytes: &[u8]) {
    if let Ok(index) = decode::<LayerIndex>(bytes) {
        if index.validate().is_ok() {
            let _ = index.referenced_chunks().count();
            let _ = index.file_bytes();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    index(data);
    let _ = decode::<Baseline>(data);
    index(&seal::<LayerIndex>(LayerIndex::VERSION, data));
    for version in 1..=Baseline::VERSION {
        let _ = decode::<Baseline>(&seal::<Baseline>(version, data));
    }
});
