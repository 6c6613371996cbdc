//! A session bundle's manifest and entry batches, as `cairn session import`
//! reads them from a file someone else wrote. The input is decoded as a
//! whole frame and, sealed with a right CRC, as the payload of each.
#![no_main]

use cairn_session::bundle::{BundleManifest, EntryBatch};
use cairn_session::Entry;
use cairn_store::frame::{decode, seal};
use cairn_store::Framed;
use libfuzzer_sys::fuzz_target;

fn both(bytes: &[u8]) {
    let _ = decode::<BundleManifest>(bytes);
    if let Ok(batch) = decode::<EntryBatch>(bytes) {
        let entries: Vec<Entry> = batch.entries.into_iter().map(Entry::from).collect();
        for e in &entries {
            let _ = e.chain(cairn_session::GENESIS);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    both(data);
    both(&seal::<BundleManifest>(BundleManifest::VERSION, data));
    both(&seal::<EntryBatch>(EntryBatch::VERSION, data));
});
