//! Behaviour of the chunk store through its public API, on a real
//! directory backend.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

use cairn_store::process::{WriterId, UNIDENTIFIED_GRACE};
use cairn_store::{
    collect_garbage, BlobStore, ChunkHash, ChunkStore, FileContent, LocalStore, ReadContext, StoreError, MIN_CHUNK,
};

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    // xorshift64*: deterministic, incompressible enough for chunking tests.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn open_store() -> (tempfile::TempDir, ChunkStore<LocalStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = ChunkStore::new(LocalStore::open(dir.path().join("store")).unwrap());
    (dir, store)
}

fn stored_bytes(store: &ChunkStore<LocalStore>) -> (usize, u64) {
    let list = store.backend().list().unwrap();
    (list.len(), list.iter().map(|o| o.size).sum())
}

fn read_back(store: &ChunkStore<LocalStore>, content: &FileContent) -> Vec<u8> {
    let mut out = Vec::new();
    store.read_to_writer(content, &mut out, &ReadContext::new()).unwrap();
    out
}

const FIVE_MB: usize = 5 * 1024 * 1024;

#[test]
fn storing_the_same_five_megabytes_twice_adds_nothing() {
    let (_dir, store) = open_store();
    let data = random_bytes(FIVE_MB, 1);
    let first = store.store_reader(&data[..]).unwrap();
    let after_first = stored_bytes(&store);
    assert!(first.chunks.len() > 5, "5 MB should be several chunks");
    assert!(after_first.1 > FIVE_MB as u64 / 2);

    let second = store.store_reader(&data[..]).unwrap();
    assert_eq!(first, second);
    assert_eq!(stored_bytes(&store), after_first);
    assert_eq!(read_back(&store, &second), data);
}

#[test]
fn a_small_change_in_a_large_file_stores_only_a_few_new_chunks() {
    let (_dir, store) = open_store();
    let data = random_bytes(FIVE_MB, 2);
    let original = store.store_reader(&data[..]).unwrap();
    let (count, _) = stored_bytes(&store);

    let mut edited = data.clone();
    edited[FIVE_MB / 2] ^= 0xff;
    let edited_content = store.store_reader(&edited[..]).unwrap();
    let (after_edit, _) = stored_bytes(&store);
    assert!(
        after_edit - count <= 2,
        "{} new chunks for one byte",
        after_edit - count
    );

    // Inserting bytes shifts everything after them; content-defined
    // boundaries resynchronise.
    let mut inserted = data[..1_000_000].to_vec();
    inserted.extend_from_slice(b"a few inserted bytes");
    inserted.extend_from_slice(&data[1_000_000..]);
    let inserted_content = store.store_reader(&inserted[..]).unwrap();
    let (after_insert, _) = stored_bytes(&store);
    assert!(
        after_insert - after_edit <= 3,
        "{} new chunks for an insertion",
        after_insert - after_edit
    );

    assert_eq!(read_back(&store, &original), data);
    assert_eq!(read_back(&store, &edited_content), edited);
    assert_eq!(read_back(&store, &inserted_content), inserted);
}

#[test]
fn small_files_are_one_chunk_and_empty_files_none() {
    let (_dir, store) = open_store();
    let small = random_bytes(MIN_CHUNK as usize - 1, 3);
    let content = store.store_reader(&small[..]).unwrap();
    assert_eq!(content.chunks.len(), 1);
    assert_eq!(content.size, small.len() as u64);
    let empty = store.store_reader(&[][..]).unwrap();
    assert_eq!(empty, FileContent::default());
    assert!(read_back(&store, &empty).is_empty());
}

#[test]
fn a_flipped_byte_in_a_chunk_file_is_a_clear_error() {
    let (_dir, store) = open_store();
    let data = random_bytes(300_000, 4);
    let content = store.store_reader(&data[..]).unwrap();
    let victim = content.chunks[0].hash;
    let path = store.backend().object_path(&victim);
    let mut bytes = fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    fs::write(&path, bytes).unwrap();

    let snapshot = ChunkHash::of(b"snapshot 9c1e");
    let ctx = ReadContext::new().owner("snapshot", snapshot).path("/data/genome.fa");
    let err = store.read_to_writer(&content, std::io::sink(), &ctx).unwrap_err();
    assert!(matches!(err, StoreError::ChunkCorrupt { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "chunk {} of /data/genome.fa in snapshot {} is corrupt: ",
            victim.short(),
            snapshot.short()
        )),
        "{msg}"
    );
}

#[test]
fn a_chunk_whose_content_was_swapped_fails_hash_verification() {
    let (_dir, store) = open_store();
    let a = store.put_chunk(b"the right bytes").unwrap().hash;
    let b = store.put_chunk(b"some other bytes").unwrap().hash;
    // A valid zstd frame under the wrong name: only the hash check catches it.
    fs::copy(store.backend().object_path(&b), store.backend().object_path(&a)).unwrap();
    let err = store.get_chunk(&a, &ReadContext::new()).unwrap_err();
    assert!(err.to_string().contains("its content hashes to"), "{err}");
}

#[test]
fn a_missing_chunk_is_an_error_naming_the_snapshot_and_file() {
    let (_dir, store) = open_store();
    let data = random_bytes(2_000_000, 5);
    let content = store.store_reader(&data[..]).unwrap();
    let victim = content.chunks[1].hash;
    assert!(store.backend().delete(&victim).unwrap());

    let snapshot = ChunkHash::of(b"snap");
    let ctx = ReadContext::new().owner("snapshot", snapshot).path("/data/genome.fa");
    let err = store.read_to_writer(&content, std::io::sink(), &ctx).unwrap_err();
    assert!(matches!(err, StoreError::ChunkMissing { .. }), "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "chunk {} of /data/genome.fa in snapshot {} is missing",
            victim.short(),
            snapshot.short()
        )),
        "{err}"
    );
}

#[test]
fn a_temp_file_is_reclaimed_by_gc_only_when_its_writer_is_dead() {
    let (dir, store) = open_store();
    let live = store.put_chunk(b"committed").unwrap().hash;
    let tmp = store.backend().temp_dir();
    let long_ago = SystemTime::now() - UNIDENTIFIED_GRACE - Duration::from_secs(60);
    let partial = |name: &str, modified: SystemTime| {
        let path = tmp.join(name);
        fs::write(&path, b"half a chu").unwrap();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(modified)
            .unwrap();
        path
    };
    let me = WriterId::current();
    // A write in progress, however long it has taken.
    let running = partial(&format!("{me}-0-1.partial"), long_ago);
    // What a writer killed between create and rename leaves behind.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let killed = WriterId {
        pid: child.id() as i32,
        start_time: 1,
    };
    child.wait().unwrap();
    let dead = partial(&format!("{killed}-0-2.partial"), SystemTime::now());
    // A pid now used by another process than the writer.
    let reused = WriterId {
        start_time: me.start_time + 1,
        ..me
    };
    let reused = partial(&format!("{reused}-0-3.partial"), SystemTime::now());
    // Names from before writers were named: only age tells.
    let unnamed_young = partial("4243-0-2.partial", SystemTime::now());
    let unnamed_old = partial("4242-0-1.partial", long_ago);

    let keys: Vec<_> = store.backend().list().unwrap().into_iter().map(|o| o.key).collect();
    assert_eq!(keys, vec![live]);

    let report = collect_garbage(store.backend(), [live], Duration::ZERO).unwrap();
    assert_eq!(report.incomplete_writes_removed, 3);
    assert_eq!(report.deleted, 0);
    assert!(running.exists(), "a running writer's temp file was removed");
    assert!(!dead.exists(), "a dead writer's temp file was not reclaimed");
    assert!(
        !reused.exists(),
        "the temp file of a writer whose pid was reused was not reclaimed"
    );
    assert!(
        unnamed_young.exists(),
        "a young temp file of an older version was removed"
    );
    assert!(
        !unnamed_old.exists(),
        "an old temp file of an older version was not reclaimed"
    );
    assert!(store.get_chunk(&live, &ReadContext::new()).is_ok());
    drop(dir);
}

#[test]
fn a_writer_killed_mid_stream_leaves_only_complete_chunks() {
    kill_a_writer("a_writer_killed_mid_stream_leaves_only_complete_chunks", |store| {
        for seed in 0..100 {
            store.store_reader(&random_bytes(4_000_000, seed)[..]).unwrap();
        }
    });
}

#[test]
fn a_writer_killed_mid_pack_leaves_only_whole_packs() {
    // Memory pages, stored as a memory image is: batches of many new
    // chunks, each batch one pack.
    kill_a_writer("a_writer_killed_mid_pack_leaves_only_whole_packs", |store| {
        for seed in 0..20 {
            let pages = random_bytes(32 << 20, 100 + seed);
            store.store_stream(&pages[..], cairn_store::Cutting::Pages).unwrap();
        }
    });
}

/// Runs `write` in a child process (this test binary again, test `name`)
/// and SIGKILLs it while it writes; then every object the store shows is
/// whole, and gc with nothing live leaves no object, pack or temp file.
fn kill_a_writer(name: &str, write: impl Fn(&ChunkStore<LocalStore>)) {
    if std::env::var("CAIRN_STORE_KILL_TEST").as_deref() == Ok(name) {
        let root = std::env::var("CAIRN_STORE_KILL_TARGET").unwrap();
        // Bounded so an orphaned child still ends by itself.
        write(&ChunkStore::new(LocalStore::open(root).unwrap()));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    LocalStore::open(&root).unwrap();
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = KillOnDrop(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture"])
            .env("CAIRN_STORE_KILL_TEST", name)
            .env("CAIRN_STORE_KILL_TARGET", &root)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let store = ChunkStore::new(LocalStore::open(&root).unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while store.backend().list().unwrap().len() < 20 {
        assert!(std::time::Instant::now() < deadline, "child wrote nothing");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();

    let objects = store.backend().list().unwrap();
    for o in &objects {
        store
            .get_chunk(&o.key, &ReadContext::new())
            .unwrap_or_else(|e| panic!("a visible object is incomplete: {e}"));
    }
    // Nothing is live: everything visible and every leftover temp file goes.
    collect_garbage(store.backend(), [], Duration::ZERO).unwrap();
    assert!(store.backend().list().unwrap().is_empty());
    assert_eq!(fs::read_dir(store.backend().temp_dir()).unwrap().count(), 0);
    let packs: Vec<_> = fs::read_dir(root.join("packs")).unwrap().collect();
    assert!(packs.is_empty(), "{packs:?}");
}

#[test]
fn sparse_files_keep_their_holes_through_the_store() {
    let (dir, store) = open_store();
    let path = dir.path().join("sparse");
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let size = 64 * 1024 * 1024u64;
    file.set_len(size).unwrap();
    let block = random_bytes(1024 * 1024, 6);
    use std::os::unix::fs::FileExt;
    file.write_all_at(&block[..512 * 1024], 8 * 1024 * 1024).unwrap();
    file.write_all_at(&block[512 * 1024..], 40 * 1024 * 1024).unwrap();
    file.sync_all().unwrap();

    let content = store.store_file(&file).unwrap();
    assert_eq!(content.size, size);
    assert_eq!(content.data_len(), 1024 * 1024, "holes were stored as data");

    let out_path = dir.path().join("restored");
    let out = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&out_path)
        .unwrap();
    store.restore_to_file(&content, &out, &ReadContext::new()).unwrap();
    out.sync_all().unwrap();
    let meta = out.metadata().unwrap();
    assert_eq!(meta.len(), size);
    assert!(
        meta.blocks() * 512 < 4 * 1024 * 1024,
        "restored file is not sparse: {} blocks",
        meta.blocks()
    );

    let mut expected = vec![0u8; size as usize];
    expected[8 << 20..(8 << 20) + (512 << 10)].copy_from_slice(&block[..512 << 10]);
    expected[40 << 20..(40 << 20) + (512 << 10)].copy_from_slice(&block[512 << 10..]);
    assert!(fs::read(&out_path).unwrap() == expected, "restored content differs");
    assert!(read_back(&store, &content) == expected, "streamed content differs");
}

#[test]
fn a_plain_file_stored_from_disk_round_trips() {
    let (dir, store) = open_store();
    let path = dir.path().join("plain");
    let data = random_bytes(3_333_333, 7);
    File::create(&path).unwrap().write_all(&data).unwrap();
    let content = store.store_file(&File::open(&path).unwrap()).unwrap();
    assert_eq!(content, store.store_reader(&data[..]).unwrap());
    assert_eq!(read_back(&store, &content), data);
}

#[test]
fn an_inconsistent_file_record_is_refused_before_writing() {
    let (_dir, store) = open_store();
    let mut content = store.store_reader(&random_bytes(100, 8)[..]).unwrap();
    content.size = 10;
    let mut out = Vec::new();
    let err = store
        .read_to_writer(&content, &mut out, &ReadContext::new().path("/x"))
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidContent { .. }), "{err}");
    assert!(out.is_empty());
}
