//! Capture an overlay upper directory, materialise it, and check that the
//! overlay over the materialised layer looks exactly like the original.

mod overlay;

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use cairn_layers::archive::{
    capture, capture_since, flatten, load_index, materialise, remove_abandoned_materialisations, write_index, Entry,
    EntryKind, LayerIndex, LayerPath, Metadata, Timestamp,
};
use cairn_store::process::{WriterId, UNIDENTIFIED_GRACE};
use cairn_store::{collect_garbage, BlobStore, ChunkStore, LocalStore};
use nix::sys::stat::{makedev, mknod, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::mkfifo;

use overlay::{allocated, assert_same_tree, mounts_under, observe, Mount};

const MB: u64 = 1024 * 1024;

struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    fn mkdir(&self, name: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        fs::create_dir_all(&p).unwrap();
        p
    }
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let leaked = mounts_under(self.dir.path());
        if !leaked.is_empty() && !std::thread::panicking() {
            panic!("mounts leaked: {leaked:?}");
        }
    }
}

fn write(path: &Path, data: &[u8]) {
    File::create(path).unwrap().write_all(data).unwrap();
}

fn set_mtime(path: &Path, sec: i64, nsec: i64) {
    let t = TimeSpec::new(sec, nsec);
    utimensat(None, path, &t, &t, UtimensatFlags::NoFollowSymlink).unwrap();
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The read-only base image every sandbox starts from.
fn build_base(lower: &Path) {
    write(&lower.join("keep.txt"), b"unchanged\n");
    write(&lower.join("delete-me.txt"), b"doomed\n");
    fs::create_dir_all(lower.join("replace-dir/sub")).unwrap();
    write(&lower.join("replace-dir/a"), b"a");
    write(&lower.join("replace-dir/sub/c"), b"c");
    write(&lower.join("rename-me.txt"), b"moving\n");
    fs::create_dir_all(lower.join("rename-dir/y")).unwrap();
    write(&lower.join("rename-dir/x"), b"x");
    write(&lower.join("rename-dir/y/z"), b"z");
    fs::create_dir_all(lower.join("dir-becomes-file")).unwrap();
    write(&lower.join("dir-becomes-file/f"), b"f");
    write(&lower.join("file-becomes-dir"), b"i was a file");
    write(&lower.join("chmod-me"), b"mode");
    write(&lower.join("chown-me"), b"owner");
    write(&lower.join("xattr-me"), b"labels");
    write(&lower.join("touch-me"), b"time");
    write(&lower.join("link-src"), b"linked from lower");
    fs::create_dir_all(lower.join("merged-dir")).unwrap();
    write(&lower.join("merged-dir/from-lower"), b"lower");
    set_mtime(&lower.join("merged-dir"), 1_000_000_000, 0);
}

/// Everything a sandbox might do, through the merged mount.
fn mutate(m: &Path) {
    // Deletions and replacements: whiteouts and opaque directories.
    fs::remove_file(m.join("delete-me.txt")).unwrap();
    fs::remove_dir_all(m.join("replace-dir")).unwrap();
    fs::create_dir(m.join("replace-dir")).unwrap();
    write(&m.join("replace-dir/new"), b"fresh");
    fs::rename(m.join("rename-me.txt"), m.join("renamed.txt")).unwrap();
    fs::rename(m.join("rename-dir"), m.join("renamed-dir")).unwrap();
    fs::remove_dir_all(m.join("dir-becomes-file")).unwrap();
    write(&m.join("dir-becomes-file"), b"now a file");
    fs::remove_file(m.join("file-becomes-dir")).unwrap();
    fs::create_dir(m.join("file-becomes-dir")).unwrap();
    write(&m.join("file-becomes-dir/child"), b"child");

    // Metadata changes on lower files (copy-up).
    fs::set_permissions(m.join("chmod-me"), fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(m.join("chown-me"), Some(1234), Some(5678)).unwrap();
    xattr::set(m.join("xattr-me"), "user.color", b"blue").unwrap();
    set_mtime(&m.join("touch-me"), 981_173_106, 123_456_789);
    fs::hard_link(m.join("link-src"), m.join("link-dst")).unwrap();
    write(&m.join("merged-dir/from-upper"), b"upper");

    // New content of every kind.
    let n = m.join("new");
    fs::create_dir(&n).unwrap();
    write(&n.join("hello.txt"), b"hello, world\n");
    write(&n.join("empty"), b"");
    write(&n.join("big-a"), &pseudo_random(3 * MB as usize, 7));
    write(&n.join("big-b"), &pseudo_random(3 * MB as usize, 7));
    write(&n.join("group-1"), b"three names, one inode");
    fs::hard_link(n.join("group-1"), n.join("group-2")).unwrap();
    fs::create_dir(n.join("elsewhere")).unwrap();
    fs::hard_link(n.join("group-1"), n.join("elsewhere/group-3")).unwrap();
    symlink("hello.txt", n.join("rel-link")).unwrap();
    symlink("/etc/passwd", n.join("abs-link")).unwrap();
    symlink("does/not/exist", n.join("dangling-link")).unwrap();
    mkfifo(&n.join("fifo"), Mode::from_bits_truncate(0o640)).unwrap();
    mknod(
        &n.join("null"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(1, 3),
    )
    .unwrap();
    write(&n.join("setuid"), b"#!/bin/true\n");
    std::os::unix::fs::chown(n.join("setuid"), Some(1000), Some(1000)).unwrap();
    fs::set_permissions(n.join("setuid"), fs::Permissions::from_mode(0o4755)).unwrap();
    xattr::set(n.join("hello.txt"), "user.a", b"1").unwrap();
    xattr::set(n.join("hello.txt"), "user.empty", b"").unwrap();
    xattr::set(n.join("elsewhere"), "user.dir-label", b"\x00\xffbinary").unwrap();
    write(&n.join("naïve-日本語-🪨.txt"), "unicode ✓".as_bytes());
    write(&n.join(OsStr::from_bytes(b"not-utf8-\xff\xfe")), b"raw bytes name");
    drop(UnixListener::bind(n.join("socket")).unwrap());
    mknod(
        &n.join("loop-dev"),
        SFlag::S_IFBLK,
        Mode::from_bits_truncate(0o660),
        makedev(7, 200),
    )
    .unwrap();
    write(&n.join("n".repeat(255)), b"longest name");
    overlay::create_deep(&n, 24, 200, b"deep down");

    // 100 MB sparse file with 1 MB of data.
    let sparse = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(n.join("sparse"))
        .unwrap();
    sparse.set_len(100 * MB).unwrap();
    let data = pseudo_random(MB as usize, 9);
    sparse.write_all_at(&data[..(MB / 2) as usize], 10 * MB).unwrap();
    sparse.write_all_at(&data[(MB / 2) as usize..], 70 * MB).unwrap();
    drop(sparse);

    // Old mtimes, set last so later writes do not bump them.
    set_mtime(&n.join("hello.txt"), 981_173_106, 5);
    set_mtime(&n.join("rel-link"), 1_234_567_890, 42);
    set_mtime(&n.join("elsewhere"), 946_684_800, 999_999_999);
    set_mtime(&n, 1_500_000_000, 1);
}

fn store_in(s: &Scratch) -> ChunkStore<LocalStore> {
    ChunkStore::new(LocalStore::open(s.path("store")).unwrap())
}

#[test]
fn a_materialised_layer_reproduces_the_merged_view_exactly() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let (lower, upper, work) = (s.mkdir("lower"), s.mkdir("upper"), s.mkdir("work"));
    build_base(&lower);
    {
        let m = Mount::overlay(&[&lower], Some((&upper, &work)), &s.path("merged"), false).unwrap();
        mutate(m.path());
    }

    let store = store_in(&s);
    let layer = capture(&upper, &store).unwrap();
    let index = &load_index(&store, &layer.id).unwrap();
    let find = |p: &str| {
        index
            .entries
            .iter()
            .find(|e| e.path == LayerPath::root().join(p.as_bytes()))
            .unwrap_or_else(|| panic!("{p} not captured"))
    };
    // The overlay bookkeeping is in the index, not just the data.
    assert!(find("delete-me.txt").kind.is_whiteout());
    assert!(find("replace-dir")
        .meta
        .xattrs
        .iter()
        .any(|x| x.name == b"trusted.overlay.opaque" && x.value == b"y"));
    assert!(find("renamed-dir")
        .meta
        .xattrs
        .iter()
        .any(|x| x.name == b"trusted.overlay.redirect"));
    assert!(matches!(find("new/group-2").kind, EntryKind::HardLink { .. }));
    // Capture reads only the upper: untouched lower files are absent.
    assert!(index.entries.iter().all(|e| e.path.as_bytes() != b"keep.txt"));
    // Device nodes are left out; the fifo and the socket stay.
    assert_eq!(layer.dropped_devices, 2);
    for device in ["new/null", "new/loop-dev"] {
        let path = LayerPath::root().join(device.as_bytes());
        assert!(index.entries.iter().all(|e| e.path != path), "{device} captured");
    }
    assert!(matches!(find("new/fifo").kind, EntryKind::Fifo));
    assert!(matches!(find("new/socket").kind, EntryKind::Socket));
    // The sparse file's holes were not stored.
    match &find("new/sparse").kind {
        EntryKind::File(c) => {
            assert_eq!(c.size, 100 * MB);
            assert_eq!(c.data_len(), MB);
        }
        other => panic!("sparse file captured as {other:?}"),
    }

    let rebuilt = s.path("layer");
    materialise(&layer.id, &store, &rebuilt).unwrap();
    assert!(allocated(&rebuilt.join("new/sparse")) < 4 * MB, "holes were filled in");

    let original = Mount::overlay(&[&lower], Some((&upper, &work)), &s.path("view-original"), true).unwrap();
    let restored = Mount::overlay(&[&rebuilt, &lower], None, &s.path("view-restored"), true).unwrap();
    let mut expected = observe(original.path());
    let actual = observe(restored.path());
    assert!(expected.len() > 40, "the comparison saw too little: {}", expected.len());
    let devices: [&[u8]; 2] = [b"new/null", b"new/loop-dev"];
    for device in devices {
        assert!(expected.remove(device).is_some() && !actual.contains_key(device));
    }
    assert!(!expected.contains_key(&b"delete-me.txt"[..]));
    assert!(
        !expected.contains_key(&b"replace-dir/a"[..]),
        "opaque dir leaked lower entries"
    );
    assert_same_tree(&expected, &actual);

    // And the materialised directory itself matches the upper it came from.
    let mut upper_view = observe(&upper);
    let rebuilt_view = observe(&rebuilt);
    for device in devices {
        upper_view.remove(device);
    }
    assert_same_tree(&upper_view, &rebuilt_view);
}

#[test]
fn materialised_layers_stack_like_the_uppers_they_came_from() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let base = s.mkdir("base");
    build_base(&base);
    let store = store_in(&s);

    // Session 1 on the base image.
    let (upper1, work1) = (s.mkdir("upper1"), s.mkdir("work1"));
    {
        let m = Mount::overlay(&[&base], Some((&upper1, &work1)), &s.path("m1"), false).unwrap();
        mutate(m.path());
    }
    let l1 = capture(&upper1, &store).unwrap();
    let m1 = s.path("L1");
    materialise(&l1.id, &store, &m1).unwrap();

    // Session 2 restored from the snapshot: lower = L1 over the base.
    let (upper2, work2) = (s.mkdir("upper2"), s.mkdir("work2"));
    {
        let m = Mount::overlay(&[&m1, &base], Some((&upper2, &work2)), &s.path("m2"), false).unwrap();
        let p = m.path();
        fs::remove_file(p.join("new/hello.txt")).unwrap(); // a file born in L1
        fs::remove_file(p.join("keep.txt")).unwrap(); // a file of the base
        fs::remove_dir_all(p.join("new/elsewhere")).unwrap(); // L1 dir, recreated
        fs::create_dir(p.join("new/elsewhere")).unwrap();
        write(&p.join("new/elsewhere/only"), b"only me");
        write(&p.join("renamed.txt"), b"rewritten in session 2");
        write(&p.join("replace-dir/second"), b"second session");
        fs::rename(p.join("file-becomes-dir"), p.join("dir-moved-again")).unwrap();
        fs::set_permissions(p.join("new/setuid"), fs::Permissions::from_mode(0o700)).unwrap();
    }
    let l2 = capture(&upper2, &store).unwrap();
    assert_ne!(l1.id, l2.id);
    // Capture is proportional to what changed: L2 is much smaller.
    assert!(l2.entries * 3 < l1.entries);
    let m2 = s.path("L2");
    materialise(&l2.id, &store, &m2).unwrap();

    let reference = Mount::overlay(&[&m1, &base], Some((&upper2, &work2)), &s.path("ref"), true).unwrap();
    let stacked = Mount::overlay(&[&m2, &m1, &base], None, &s.path("stacked"), true).unwrap();
    let expected = observe(reference.path());
    assert!(!expected.contains_key(&b"new/hello.txt"[..]));
    assert!(!expected.contains_key(&b"keep.txt"[..]));
    assert!(!expected.contains_key(&b"new/elsewhere/group-3"[..]));
    assert_same_tree(&expected, &observe(stacked.path()));
}

#[test]
fn a_flattened_stack_shows_the_tree_the_stacked_overlay_shows() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let base = s.mkdir("base");
    build_base(&base);
    let store = store_in(&s);
    let base_layer = capture(&base, &store).unwrap();
    // Layer 1: every kind of change (whiteouts, opaque and renamed
    // directories, hard links, a file that becomes a directory).
    let (upper1, work1) = (s.mkdir("upper1"), s.mkdir("work1"));
    {
        let m = Mount::overlay(&[&base], Some((&upper1, &work1)), &s.path("m1"), false).unwrap();
        mutate(m.path());
    }
    let l1 = capture(&upper1, &store).unwrap();
    let m1 = s.path("L1");
    materialise(&l1.id, &store, &m1).unwrap();
    // Layer 2 on top: deletions of files from both layers below, a
    // directory renamed again, a directory recreated.
    let (upper2, work2) = (s.mkdir("upper2"), s.mkdir("work2"));
    {
        let m = Mount::overlay(&[&m1, &base], Some((&upper2, &work2)), &s.path("m2"), false).unwrap();
        let p = m.path();
        fs::remove_file(p.join("new/hello.txt")).unwrap();
        fs::remove_file(p.join("keep.txt")).unwrap();
        fs::remove_dir_all(p.join("new/elsewhere")).unwrap();
        fs::create_dir(p.join("new/elsewhere")).unwrap();
        write(&p.join("new/elsewhere/only"), b"only me");
        fs::rename(p.join("renamed-dir"), p.join("renamed-twice")).unwrap();
        fs::rename(p.join("file-becomes-dir"), p.join("dir-moved-again")).unwrap();
    }
    let l2 = capture(&upper2, &store).unwrap();
    let reference = Mount::overlay(&[&m1, &base], Some((&upper2, &work2)), &s.path("ref"), true).unwrap();
    let expected = observe(reference.path());

    let (i2, i1, i0) = (
        load_index(&store, &l2.id).unwrap(),
        load_index(&store, &l1.id).unwrap(),
        load_index(&store, &base_layer.id).unwrap(),
    );
    let flat = flatten(&[&i2, &i1, &i0]).unwrap();
    flat.validate().unwrap();
    let id = write_index(&store, flat.entries).unwrap().id;
    let rebuilt = s.path("flat");
    materialise(&id, &store, &rebuilt).unwrap();
    let mut actual = observe(&rebuilt);
    // The materialised root is a fresh directory: compare what is in it.
    actual.remove(&b""[..]);
    let mut expected = expected;
    expected.remove(&b""[..]);
    for device in [&b"new/null"[..], &b"new/loop-dev"[..]] {
        expected.remove(device);
    }
    // Link counts differ by design: overlayfs counts a merged directory's
    // links its own way, and hard links come out as copies sharing chunks.
    for o in expected.values_mut().chain(actual.values_mut()) {
        o.nlink = 0;
    }
    assert!(
        expected.contains_key(&b"renamed-twice"[..]),
        "the renamed directory is there"
    );
    assert!(!expected.contains_key(&b"keep.txt"[..]));
    assert_same_tree(&expected, &actual);
}

#[test]
fn device_nodes_in_a_layer_index_are_not_materialised() {
    let s = Scratch::new();
    let store = store_in(&s);
    let meta = |mode| Metadata {
        mode,
        uid: 0,
        gid: 0,
        mtime: Timestamp { sec: 1, nsec: 0 },
        xattrs: Vec::new(),
    };
    let entry = |path: &str, kind, mode| Entry {
        path: LayerPath::root().join(path.as_bytes()),
        kind,
        meta: meta(mode),
    };
    // As an older Cairn wrote them, or anyone with write access to the store.
    let index = LayerIndex {
        entries: vec![
            Entry {
                path: LayerPath::root(),
                kind: EntryKind::Directory,
                meta: meta(0o755),
            },
            entry("disk", EntryKind::BlockDevice { major: 7, minor: 0 }, 0o666),
            entry(
                "disk-too",
                EntryKind::HardLink {
                    target: LayerPath::root().join(b"disk"),
                },
                0o666,
            ),
            entry("gone", EntryKind::CharDevice { major: 0, minor: 0 }, 0),
            entry("mem", EntryKind::CharDevice { major: 1, minor: 1 }, 0o666),
            entry("pipe", EntryKind::Fifo, 0o600),
        ],
    };
    let id = write_index(&store, index.entries).unwrap().id;
    let dest = s.path("out");
    materialise(&id, &store, &dest).unwrap();
    let mut names: Vec<String> = fs::read_dir(&dest)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["gone", "pipe"], "device nodes were made");
}

#[test]
fn capturing_the_same_upper_twice_gives_the_same_layer_id() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let (lower, upper, work) = (s.mkdir("lower"), s.mkdir("upper"), s.mkdir("work"));
    build_base(&lower);
    {
        let m = Mount::overlay(&[&lower], Some((&upper, &work)), &s.path("merged"), false).unwrap();
        mutate(m.path());
    }
    let store = store_in(&s);
    let first = capture(&upper, &store).unwrap();
    let objects = store.backend().list().unwrap().len();
    let second = capture(&upper, &store).unwrap();
    assert_eq!(first.id, second.id);
    // Nothing new stored: content and index deduplicate.
    assert_eq!(store.backend().list().unwrap().len(), objects);
    // Two identical 3 MB files share all their chunks.
    let first_index = load_index(&store, &first.id).unwrap();
    let chunks = |name: &str| match &first_index
        .entries
        .iter()
        .find(|e| e.path == LayerPath::root().join(b"new").join(name.as_bytes()))
        .unwrap()
        .kind
    {
        EntryKind::File(c) => c.chunks.clone(),
        _ => unreachable!(),
    };
    assert_eq!(chunks("big-a"), chunks("big-b"));
}

#[test]
fn a_failed_materialisation_leaves_nothing_behind_and_names_the_file() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let upper = s.mkdir("upper");
    fs::create_dir(upper.join("data")).unwrap();
    write(&upper.join("data/genome.fa"), &pseudo_random(200_000, 3));
    write(&upper.join("data/other"), b"fine");
    let store = store_in(&s);
    let layer = capture(&upper, &store).unwrap();
    let index = load_index(&store, &layer.id).unwrap();
    let EntryKind::File(content) = &index
        .entries
        .iter()
        .find(|e| e.path.as_bytes() == b"data/genome.fa")
        .unwrap()
        .kind
    else {
        panic!("not a file");
    };
    let victim = content.chunks[0].hash;
    let object = store.backend().object_path(&victim);
    let mut bytes = fs::read(&object).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    fs::write(&object, bytes).unwrap();

    let out = s.mkdir("out");
    let dest = out.join("layer");
    let err = materialise(&layer.id, &store, &dest).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&format!(
            "of /data/genome.fa in layer {} is corrupt",
            layer.id.as_hash().short()
        )),
        "{msg}"
    );
    assert!(!dest.exists());
    assert_eq!(fs::read_dir(&out).unwrap().count(), 0, "temp directory left behind");

    fs::create_dir(&dest).unwrap();
    let err = materialise(&layer.id, &store, &dest).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
}

#[test]
fn a_metacopy_only_upper_file_is_refused() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let upper = s.mkdir("upper");
    write(&upper.join("meta-only"), b"");
    xattr::set(upper.join("meta-only"), "trusted.overlay.metacopy", b"").unwrap();
    let err = capture(&upper, &store_in(&s)).unwrap_err();
    assert!(err.to_string().contains("metacopy=off"), "{err}");
}

#[test]
fn mtimes_survive_with_nanosecond_precision_on_every_kind() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let upper = s.mkdir("upper");
    fs::create_dir(upper.join("d")).unwrap();
    write(&upper.join("d/f"), b"x");
    symlink("f", upper.join("d/l")).unwrap();
    mkfifo(&upper.join("d/p"), Mode::from_bits_truncate(0o600)).unwrap();
    let times = [
        ("d/f", 1, 1),
        ("d/l", 2, 2),
        ("d/p", 3, 999_999_999),
        ("d", 4, 4),
        ("", 5, 5),
    ];
    for (p, sec, nsec) in times {
        set_mtime(&upper.join(p), sec, nsec);
    }
    let store = store_in(&s);
    let layer = capture(&upper, &store).unwrap();
    let dest = s.path("out");
    materialise(&layer.id, &store, &dest).unwrap();
    for (p, sec, nsec) in times {
        let m = fs::symlink_metadata(dest.join(p)).unwrap().modified().unwrap();
        assert_eq!(m, UNIX_EPOCH + Duration::new(sec as u64, nsec as u32), "mtime of {p:?}");
    }
}

#[test]
fn gc_rooted_at_a_layer_keeps_it_whole_and_frees_a_dropped_layer() {
    if !overlay::overlay_available() {
        return;
    }
    let s = Scratch::new();
    let (kept_upper, dropped_upper) = (s.mkdir("kept"), s.mkdir("dropped"));
    let shared = pseudo_random(500_000, 11);
    write(&kept_upper.join("shared"), &shared);
    write(&kept_upper.join("only-kept"), &pseudo_random(300_000, 21));
    write(&dropped_upper.join("shared"), &shared);
    write(&dropped_upper.join("only-dropped"), &pseudo_random(300_000, 41));
    let store = store_in(&s);
    let kept = capture(&kept_upper, &store).unwrap();
    let dropped = capture(&dropped_upper, &store).unwrap();

    let (kept_index, dropped_index) = (
        load_index(&store, &kept.id).unwrap(),
        load_index(&store, &dropped.id).unwrap(),
    );
    let roots = std::iter::once(*kept.id.as_hash()).chain(kept_index.referenced_chunks());
    let report = collect_garbage(store.backend(), roots, Duration::ZERO).unwrap();
    assert!(report.deleted >= 2, "{report:?}");
    assert!(!store.backend().contains(dropped.id.as_hash()).unwrap());
    for chunk in dropped_index.referenced_chunks() {
        let in_kept = kept_index.referenced_chunks().any(|c| c == chunk);
        assert_eq!(store.backend().contains(&chunk).unwrap(), in_kept);
    }

    let dest = s.path("kept-layer");
    materialise(&kept.id, &store, &dest).unwrap();
    assert_eq!(fs::read(dest.join("shared")).unwrap(), shared);
    let err = materialise(&dropped.id, &store, &s.path("dropped-layer")).unwrap_err();
    assert!(err.to_string().contains("is missing from the store"), "{err}");
}

#[test]
fn temp_directories_of_dead_materialisations_are_removed_and_live_ones_kept() {
    let s = Scratch::new();
    let layers = s.mkdir("layers");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = WriterId {
        pid: child.id() as i32,
        start_time: 1,
    };
    child.wait().unwrap();
    let abandoned = layers.join(format!(".abc.materialising-{dead}-17"));
    fs::create_dir_all(abandoned.join("half/built")).unwrap();
    write(&abandoned.join("half/built/file"), b"partial");
    let me = WriterId::current();
    let reused = WriterId {
        start_time: me.start_time + 1,
        ..me
    };
    let reused = layers.join(format!(".abd.materialising-{reused}-17"));
    fs::create_dir(&reused).unwrap();
    // A running materialisation is kept however long it has taken.
    let running = layers.join(format!(".def.materialising-{me}-18"));
    fs::create_dir(&running).unwrap();
    let long_ago = std::time::SystemTime::now() - UNIDENTIFIED_GRACE - Duration::from_secs(60);
    fs::File::open(&running).unwrap().set_modified(long_ago).unwrap();
    // Names from before writers were named: only age tells.
    let unnamed_young = layers.join(format!(".ghi.materialising-{}-19", std::process::id()));
    fs::create_dir(&unnamed_young).unwrap();
    let finished = layers.join("finished-layer");
    fs::create_dir(&finished).unwrap();

    assert_eq!(remove_abandoned_materialisations(&layers).unwrap(), 2);
    assert!(!abandoned.exists());
    assert!(
        !reused.exists(),
        "the temp dir of a materialisation whose pid was reused was kept"
    );
    assert!(running.exists(), "a running materialisation's temp dir was removed");
    assert!(
        unnamed_young.exists(),
        "a young temp dir of an older version was removed"
    );
    assert!(finished.exists());
    fs::File::open(&unnamed_young).unwrap().set_modified(long_ago).unwrap();
    assert_eq!(remove_abandoned_materialisations(&layers).unwrap(), 1);
    assert!(!unnamed_young.exists());
}

#[test]
fn a_rewrite_in_the_same_clock_tick_as_the_capture_is_seen_by_the_next_capture() {
    if !overlay::overlay_available() {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let s = Scratch::new();
    let fs_root = Mount::ext4_with_second_timestamps(&s.path("seconds.img"), &s.path("seconds")).unwrap();
    let upper = fs_root.path().join("upper");
    fs::create_dir(&upper).unwrap();
    let file = upper.join("counter");
    let store = store_in(&s);
    let ctime = |p: &Path| {
        let md = fs::metadata(p).unwrap();
        (md.ctime(), md.ctime_nsec())
    };
    // The rewrite must keep the ctime the capture saw (the race under test);
    // a try that crosses a second boundary is not that case and is retried.
    let (layer, before, after) = (0..20)
        .find_map(|round| {
            let before = format!("first {round:03}");
            let after = format!("later {round:03}");
            write(&file, before.as_bytes());
            let written = ctime(&file);
            let (_, baseline) = capture_since(&upper, &store, None).unwrap();
            OpenOptions::new()
                .write(true)
                .open(&file)
                .unwrap()
                .write_all_at(after.as_bytes(), 0)
                .unwrap();
            if ctime(&file) != written {
                return None;
            }
            let (layer, _) = capture_since(&upper, &store, Some(&baseline)).unwrap();
            Some((layer, before, after))
        })
        .expect("every rewrite crossed a second boundary");
    assert_eq!(before.len(), after.len());
    let index = load_index(&store, &layer.id).unwrap();
    assert!(
        index
            .entries
            .iter()
            .any(|e| e.path == LayerPath::root().join(b"counter")),
        "the rewrite was missed: {:?}",
        index.entries
    );
    let rebuilt = s.path("layer");
    materialise(&layer.id, &store, &rebuilt).unwrap();
    assert_eq!(fs::read_to_string(rebuilt.join("counter")).unwrap(), after);
}
