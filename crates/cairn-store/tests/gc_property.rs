//! Property: GC keeps exactly what live snapshots reference.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use cairn_store::{collect_garbage, BlobStore, ChunkHash, ChunkStore, FileContent, LocalStore, ReadContext};
use proptest::prelude::*;

/// A snapshot: files by name, built from its parent by edits.
#[derive(Debug, Clone)]
struct Snapshot {
    files: BTreeMap<u8, FileContent>,
}

#[derive(Debug, Clone)]
struct Step {
    parent: prop::sample::Index,
    edits: Vec<(u8, Option<(u8, u16)>)>, // file name -> None (delete) or (content seed, length)
}

fn content(seed: u8, len: u16) -> Vec<u8> {
    // Few seeds and lengths so snapshots share files and chunks.
    let len = usize::from(len) * 97;
    (0..len)
        .map(|i| (i as u8).wrapping_mul(seed | 1) ^ (i >> 8) as u8)
        .collect()
}

fn step() -> impl Strategy<Value = Step> {
    (
        any::<prop::sample::Index>(),
        prop::collection::vec((0u8..6, prop::option::weighted(0.8, (0u8..4, 0u16..2500))), 0..4),
    )
        .prop_map(|(parent, edits)| Step { parent, edits })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn gc_never_deletes_a_live_chunk_and_reclaims_all_others(
        steps in prop::collection::vec(step(), 1..8),
        deleted in prop::collection::vec(any::<bool>(), 8),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        let mut snapshots = vec![Snapshot { files: BTreeMap::new() }];
        for s in &steps {
            let parent = s.parent.get(&snapshots).clone();
            let mut files = parent.files;
            for (name, edit) in &s.edits {
                match edit {
                    None => { files.remove(name); }
                    Some((seed, len)) => {
                        let c = store.store_reader(&content(*seed, *len)[..]).unwrap();
                        files.insert(*name, c);
                    }
                }
            }
            snapshots.push(Snapshot { files });
        }
        let live: Vec<&Snapshot> = snapshots
            .iter()
            .enumerate()
            .filter(|(i, _)| !deleted[*i % deleted.len()])
            .map(|(_, s)| s)
            .collect();
        let live_chunks: HashSet<ChunkHash> = live
            .iter()
            .flat_map(|s| s.files.values())
            .flat_map(|f| f.chunk_hashes())
            .collect();

        let report = collect_garbage(store.backend(), live_chunks.iter().copied(), Duration::ZERO).unwrap();

        let remaining: HashSet<ChunkHash> = store.backend().list().unwrap().into_iter().map(|o| o.key).collect();
        prop_assert_eq!(&remaining, &live_chunks);
        prop_assert_eq!(report.kept_live as usize, live_chunks.len());
        for s in live {
            for f in s.files.values() {
                let mut out = Vec::new();
                store.read_to_writer(f, &mut out, &ReadContext::new()).unwrap();
                prop_assert_eq!(out.len() as u64, f.size);
            }
        }
    }
}

#[test]
fn gc_spares_unreferenced_chunks_younger_than_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
    let orphan = store
        .put_chunk(b"written by a writer that has not committed yet")
        .unwrap()
        .hash;
    let report = collect_garbage(store.backend(), [], Duration::from_secs(3600)).unwrap();
    assert_eq!(report.kept_young, 1);
    assert!(store.backend().contains(&orphan).unwrap());
    let report = collect_garbage(store.backend(), [], Duration::ZERO).unwrap();
    assert_eq!(report.deleted, 1);
    assert!(!store.backend().contains(&orphan).unwrap());

    // A writer that deduplicates against an old unreferenced chunk renews
    // it, so the grace period protects it again.
    let path = store.backend().object_path(&orphan);
    store
        .put_chunk(b"written by a writer that has not committed yet")
        .unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(7200);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let again = store
        .put_chunk(b"written by a writer that has not committed yet")
        .unwrap();
    assert!(!again.new);
    let report = collect_garbage(store.backend(), [], Duration::from_secs(3600)).unwrap();
    assert_eq!(report.kept_young, 1, "a deduplicated chunk was not renewed");
    let report = collect_garbage(store.backend(), [], Duration::ZERO).unwrap();
    assert_eq!(report.deleted, 1);
    assert!(!store.backend().contains(&orphan).unwrap());
}
