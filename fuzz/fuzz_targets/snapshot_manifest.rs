//! Snapshot manifests (every version still read) and artifact objects, as
//! read back from the chunk store, with the checks a restore makes. The
//! input is decoded as a whole frame and, sealed with a right CRC, as the
//! payload of each version.
#![no_main]

use cairn_engine::objects::ArtifactObject;
use cairn_engine::SnapshotManifest;
use cairn_store::frame::seal;
use cairn_store::frame::decode;
use cairn_store::Framed;
use libfuzzer_sys::fuzz_target;

fn manifest(bytes: &[u8]) {
    if let Ok(manifest) = decode::<SnapshotManifest>(bytes) {
        if manifest.validate().is_ok() {
            for file in manifest.memory.iter().flat_map(|m| &m.files) {
                assert!(!file.name.contains('/') && file.name != "..", "{:?}", file.name);
            }
        }
    }
}

fn artifact(bytes: &[u8]) {
    if let Ok(artifact) = decode::<ArtifactObject>(bytes) {
        let _ = artifact.content.validate();
    }
}

fuzz_target!(|data: &[u8]| {
    manifest(data);
    artifact(data);
    for version in 1..=SnapshotManifest::VERSION {
        manifest(&seal::<SnapshotManifest>(version, data));
    }
    artifact(&seal::<ArtifactObject>(ArtifactObject::VERSION, data));
});
