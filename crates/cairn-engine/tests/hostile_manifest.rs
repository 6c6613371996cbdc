//! Snapshot manifests and artifact objects come back from the chunk store,
//! which anyone who can write the store directory can change. As arbitrary
//! bytes and as mutations of valid encodings (every manifest version still
//! read) they give a clear error, never a panic, never an allocation past
//! the caps; a manifest that decodes is then valid or refused by
//! `validate`, which keeps memory file names from leaving their directory.

use cairn_testkit::{alloc_meter, mutation};

use cairn_engine::objects::ArtifactObject;
use cairn_engine::snapshots::{MemoryFile, MemoryForm, MemoryImage};
use cairn_engine::SnapshotManifest;
use cairn_layers::LayerId;
use cairn_sandbox::gvisor::image_host::ImageHost;
use cairn_store::frame::{self, HEADER_LEN};
use cairn_store::{ChunkHash, ChunkRef, FileContent, Framed};
use proptest::prelude::*;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Serde preallocates at most 1 MiB of elements for a sequence whatever
/// length it declares; everything else grows with the bytes there.
const SEQUENCE_PREALLOCATION: usize = 1 << 20;

fn content() -> FileContent {
    FileContent {
        size: 40_000,
        chunks: vec![ChunkRef {
            offset: 0,
            len: 16_384,
            hash: ChunkHash::of(b"page"),
        }],
    }
}

fn manifest() -> SnapshotManifest {
    SnapshotManifest {
        parent: Some(ChunkHash::of(b"parent")),
        layers: vec![
            LayerId::from_hash(ChunkHash::of(b"top")),
            LayerId::from_hash(ChunkHash::of(b"image")),
        ],
        image: "busybox".into(),
        driver: "gvisor".into(),
        services: vec!["sshd".into()],
        label: Some("indexed".into()),
        sandbox: "s-1".into(),
        created_at_ms: 1_764_500_000_000,
        memory: Some(MemoryImage {
            driver: "gvisor".into(),
            host: Some(ImageHost {
                runsc_version: "runsc version release-20250101.0".into(),
                platform: "systrap".into(),
                arch: "x86_64".into(),
                cpu_vendor: "GenuineIntel".into(),
                cpu_family: "6".into(),
                cpu_model: "167".into(),
                cpu_features: vec!["avx2".into(), "sse2".into()],
                kernel_release: "6.1.0".into(),
            }),
            files: vec![
                MemoryFile {
                    name: "checkpoint.img".into(),
                    form: MemoryForm::GvisorStateStream {
                        header: b"gVisorSF\0\0\0\0\0\0\0\x02{}\0\0\x10\0".to_vec(),
                    },
                    content: content(),
                },
                MemoryFile {
                    name: "pages.img".into(),
                    form: MemoryForm::AsWritten,
                    content: content(),
                },
            ],
        }),
    }
}
/// Decodes `bytes` as a manifest and as an artifact, as restores and the
/// garbage collector do, and checks what that allocates.
fn decode_both(bytes: &[u8]) {
    let (_, usage) = alloc_meter::measure(|| {
        match frame::decode::<SnapshotManifest>(bytes) {
            Ok(m) => {
                if m.validate().is_ok() {
                    for f in m.memory.iter().flat_map(|m| &m.files) {
                        assert!(!f.name.contains('/') && f.name != ".." && f.name != ".");
                    }
                }
            }
            Err(e) => assert!(e.to_string().contains("snapshot manifest"), "{e}"),
        }
        match frame::decode::<ArtifactObject>(bytes) {
            Ok(a) => drop(a.content.validate()),
            Err(e) => assert!(e.to_string().contains("artifact"), "{e}"),
        }
    });
    assert!(
        usage.peak <= SEQUENCE_PREALLOCATION + 16 * bytes.len() + 4096,
        "{} bytes: {usage:?}",
        bytes.len()
    );
}

#[test]
fn a_valid_manifest_decodes_and_validates() {
    let bytes = frame::encode(&manifest()).unwrap();
    let back = frame::decode::<SnapshotManifest>(&bytes).unwrap();
    assert_eq!(back, manifest());
    back.validate().unwrap();
}

/// The version 3 layout: a memory image without the host it needs.
#[derive(serde::Serialize, serde::Deserialize)]
struct ManifestV3 {
    parent: Option<ChunkHash>,
    layers: Vec<LayerId>,
    image: String,
    driver: String,
    services: Vec<String>,
    label: Option<String>,
    sandbox: String,
    created_at_ms: i64,
    memory: Option<(String, Vec<MemoryFile>)>,
}

impl Framed for ManifestV3 {
    const MAGIC: [u8; 8] = *b"CAIRNSNP";
    const VERSION: u32 = 3;
    const MAX_PAYLOAD: u64 = 16 << 20;
    const NAME: &'static str = "snapshot manifest";
}

#[test]
fn a_version_3_manifest_reads_as_a_memory_image_without_its_host() {
    let m = manifest();
    let memory = m.memory.clone().unwrap();
    let v3 = ManifestV3 {
        parent: m.parent,
        layers: m.layers.clone(),
        image: m.image.clone(),
        driver: m.driver.clone(),
        services: m.services.clone(),
        label: m.label.clone(),
        sandbox: m.sandbox.clone(),
        created_at_ms: m.created_at_ms,
        memory: Some((memory.driver.clone(), memory.files.clone())),
    };
    let back = frame::decode::<SnapshotManifest>(&frame::encode(&v3).unwrap()).unwrap();
    let read = back.memory.as_ref().unwrap();
    // A restore refuses an image without its host (fail-closed).
    assert_eq!(read.host, None);
    assert_eq!(read.files, memory.files);
    assert_eq!(back.layers, m.layers);
}

#[test]
fn memory_file_names_that_leave_the_image_directory_are_refused() {
    for name in [
        "",
        ".",
        "..",
        "../../etc/cron.d/evil",
        "/etc/passwd",
        "a/b",
        "nul\0byte",
    ] {
        let mut m = manifest();
        m.memory.as_mut().unwrap().files[1].name = name.into();
        // It survives the frame: the check is the manifest's own.
        let back = frame::decode::<SnapshotManifest>(&frame::encode(&m).unwrap()).unwrap();
        let err = back.validate().unwrap_err();
        assert!(err.contains("not a plain file name"), "{name:?}: {err}");
    }
    let mut m = manifest();
    m.memory.as_mut().unwrap().files[1].name = "checkpoint.img".into();
    assert!(m.validate().unwrap_err().contains("appears twice"));
    let mut m = manifest();
    m.memory.as_mut().unwrap().files[0].content.size = 10;
    assert!(m.validate().unwrap_err().contains("checkpoint.img"));
}

#[test]
fn a_manifest_declaring_a_huge_layer_count_preallocates_at_most_a_mebibyte() {
    // No parent, then 2^50 layers.
    let mut payload = vec![0, 0xFD];
    payload.extend_from_slice(&(1u64 << 50).to_le_bytes());
    let bytes = frame::seal::<SnapshotManifest>(SnapshotManifest::VERSION, &payload);
    let (err, usage) = alloc_meter::measure(|| frame::decode::<SnapshotManifest>(&bytes).unwrap_err());
    assert!(err.to_string().contains("does not decode"), "{err}");
    assert!(usage.largest <= SEQUENCE_PREALLOCATION, "{usage:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn arbitrary_bytes_are_refused_cleanly(
        bytes in proptest::collection::vec(any::<u8>(), 0..1024),
        version in 0u32..6,
    ) {
        decode_both(&bytes);
        decode_both(&frame::seal::<SnapshotManifest>(version, &bytes));
        decode_both(&frame::seal::<ArtifactObject>(version, &bytes));
    }

    #[test]
    fn mutated_manifests_are_refused_or_validated(
        muts in mutation::mutations(),
        reseal in any::<bool>(),
        version in 1u32..=4,
    ) {
        let mut bytes = frame::encode(&manifest()).unwrap();
        if reseal {
            // Read as each version still supported, so the older layouts'
            // decoders see hostile payloads too.
            let mut payload = bytes.split_off(HEADER_LEN);
            mutation::apply(&mut payload, &muts);
            bytes = frame::seal::<SnapshotManifest>(version, &payload);
        } else {
            mutation::apply(&mut bytes, &muts);
        }
        decode_both(&bytes);
    }

    #[test]
    fn mutated_artifacts_are_refused_cleanly(muts in mutation::mutations()) {
        let artifact = ArtifactObject { path: "/work/out".into(), content: content() };
        let mut payload = frame::encode(&artifact).unwrap().split_off(HEADER_LEN);
        mutation::apply(&mut payload, &muts);
        decode_both(&frame::seal::<ArtifactObject>(1, &payload));
    }
}
