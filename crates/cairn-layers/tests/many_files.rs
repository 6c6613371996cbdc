//! A tree of tens of thousands of small files: captured, changed and
//! captured again, in memory that does not grow with the tree (the index
//! goes out in segments, the baselines are streamed), and rebuilt exactly.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use cairn_layers::archive::{
    capture_since, layer_objects, load_index, materialise, EntryKind, IndexRoot, LayerPath, SMALL_FILE_MAX,
};
use cairn_store::{ChunkStore, LocalStore, ReadContext};
use cairn_testkit::alloc_meter;

#[global_allocator]
static METER: alloc_meter::Meter = alloc_meter::Meter;

/// Directories of the large tree and of the small one (a quarter of it).
const DIRS: usize = 80;
const SMALL_DIRS: usize = 20;
const FILES: usize = 1_000;

fn name(d: usize, f: usize) -> String {
    format!("d{d:03}/f{f:04}")
}

fn make_tree(upper: &Path, dirs: usize) {
    fs::create_dir(upper).unwrap();
    for d in 0..dirs {
        fs::create_dir(upper.join(format!("d{d:03}"))).unwrap();
        for f in 0..FILES {
            fs::write(upper.join(name(d, f)), format!("{d} {f}\n")).unwrap();
        }
    }
    // One file too big for the index, a hard link across segments, a symlink.
    fs::write(upper.join("d000/big"), vec![7u8; SMALL_FILE_MAX + 1]).unwrap();
    fs::hard_link(
        upper.join("d000/f0000"),
        upper.join(format!("d{:03}/zz-link", dirs - 1)),
    )
    .unwrap();
    std::os::unix::fs::symlink("../d000/f0001", upper.join("d001/zz-sym")).unwrap();
}

/// Every path under `root` with what it holds.
fn observe(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let t = e.file_type().unwrap();
            let what = if t.is_dir() {
                stack.push(e.path());
                "dir".to_string()
            } else if std::os::unix::fs::FileTypeExt::is_char_device(&t) {
                "whiteout".to_string()
            } else if t.is_symlink() {
                format!("-> {}", fs::read_link(e.path()).unwrap().display())
            } else {
                let data = fs::read(e.path()).unwrap();
                format!("{} bytes, {}", data.len(), blake3::hash(&data).to_hex())
            };
            out.insert(rel, what);
        }
    }
    out
}

#[test]
fn a_tree_of_many_small_files_is_captured_in_bounded_memory_and_rebuilt_exactly() {
    let s = tempfile::tempdir().unwrap();
    let store = ChunkStore::new(LocalStore::open(s.path().join("store")).unwrap());
    // The same capture and materialisation of a tree and of one four times
    // its size: holding the index (or the baseline) whole, the larger
    // would take four times the memory; a segment at a time, about the same.
    let small = s.path().join("small");
    make_tree(&small, SMALL_DIRS);
    let ((small_layer, _), small_capture) = alloc_meter::measure(|| capture_since(&small, &store, None).unwrap());
    let (_, small_materialise) =
        alloc_meter::measure(|| materialise(&small_layer.id, &store, &s.path().join("small-again")).unwrap());

    let upper = s.path().join("upper");
    make_tree(&upper, DIRS);
    // Past the clock's slack, so the next capture trusts what this one saw.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let ((first, baseline), usage) = alloc_meter::measure(|| capture_since(&upper, &store, None).unwrap());
    let entries = first.entries as usize;
    assert_eq!(entries, 1 + DIRS + DIRS * FILES + 3);
    assert!(
        usage.peak < 2 * small_capture.peak,
        "capture of {entries} entries peaked at {} bytes, of a quarter of them at {}",
        usage.peak,
        small_capture.peak
    );
    // The index is in segments: its root, 4 segments at least, and the one
    // file too big for the index are all reached.
    let context = ReadContext::new();
    let root: IndexRoot = store.get_object(first.id.as_hash(), &context).unwrap();
    assert!(
        root.entries.is_empty() && root.segments.len() >= 4,
        "{} segments",
        root.segments.len()
    );
    let objects = layer_objects(&store, &first.id).unwrap();
    assert_eq!(objects.len(), 1 + root.segments.len() + 1);
    let index = load_index(&store, &first.id).unwrap();
    let find = |p: &str| {
        index
            .entries
            .iter()
            .find(|e| e.path == LayerPath::root().join(p.as_bytes()))
            .map(|e| e.kind.clone())
    };
    assert!(matches!(find("d000/f0000"), Some(EntryKind::SmallFile { .. })));
    assert!(matches!(find("d000/big"), Some(EntryKind::File(_))));
    assert!(matches!(find("d079/zz-link"), Some(EntryKind::HardLink { .. })));

    let (rebuilt_entries, usage) =
        alloc_meter::measure(|| materialise(&first.id, &store, &s.path().join("one")).unwrap());
    assert_eq!(rebuilt_entries as usize, entries);
    assert!(
        usage.peak < 2 * small_materialise.peak,
        "materialise of {entries} entries peaked at {} bytes, of a quarter of them at {}",
        usage.peak,
        small_materialise.peak
    );
    assert_eq!(observe(&s.path().join("one")), observe(&upper));

    // Changes: a directory and some files gone, one file rewritten, one
    // new, a directory replaced by a file.
    fs::remove_dir_all(upper.join("d010")).unwrap();
    for f in [0, 500, 999] {
        fs::remove_file(upper.join(name(20, f))).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(1100));
    fs::write(upper.join(name(30, 7)), "rewritten\n").unwrap();
    fs::write(upper.join("d040/new"), "new\n").unwrap();
    fs::remove_dir_all(upper.join("d050")).unwrap();
    fs::write(upper.join("d050"), "now a file\n").unwrap();

    let ((second, _), usage) = alloc_meter::measure(|| capture_since(&upper, &store, Some(&baseline)).unwrap());
    assert!(
        usage.peak < 2 * small_capture.peak,
        "the second capture peaked at {} bytes",
        usage.peak
    );
    let index = load_index(&store, &second.id).unwrap();
    let kinds: BTreeMap<String, &EntryKind> = index
        .entries
        .iter()
        .map(|e| (String::from_utf8_lossy(e.path.as_bytes()).into_owned(), &e.kind))
        .collect();
    let whiteouts: Vec<&String> = kinds.iter().filter(|(_, k)| k.is_whiteout()).map(|(p, _)| p).collect();
    assert_eq!(whiteouts, ["d010", "d020/f0000", "d020/f0500", "d020/f0999"]);
    assert!(matches!(kinds["d030/f0007"], EntryKind::SmallFile { data } if data == b"rewritten\n"));
    assert!(matches!(kinds["d040/new"], EntryKind::SmallFile { .. }));
    assert!(matches!(kinds["d050"], EntryKind::SmallFile { data } if data == b"now a file\n"));
    // Nothing below the gone or replaced directories, nothing unchanged.
    assert!(!kinds.keys().any(|p| p.starts_with("d010/") || p.starts_with("d050/")));
    assert!(!kinds.contains_key("d030/f0008"));
    assert!(index.entries.len() < 20, "{} entries", index.entries.len());

    // Stacked on the first, the second shows exactly the tree as it is now.
    let two = s.path().join("two");
    materialise(&second.id, &store, &two).unwrap();
    let mut view = observe(&s.path().join("one"));
    for (path, what) in observe(&two) {
        if what == "whiteout" || what != "dir" {
            // Hides the lower entry and everything below it.
            view.retain(|p, _| *p != path && !p.starts_with(&format!("{path}/")));
        }
        if what != "whiteout" {
            view.insert(path, what);
        }
    }
    assert_eq!(view, observe(&upper));
}
