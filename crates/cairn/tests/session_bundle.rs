//! End-to-end: a session exported to one file and imported into a fresh
//! state directory (its own state database and chunk store, no image).

mod common;

use std::path::{Path, PathBuf};

use common::{skip, skip_without_runsc, stderr, Home};

fn log(home: &Home, id: &str) -> Vec<serde_json::Value> {
    home.ok(&["session", "log", id, "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn show(home: &Home, id: &str) -> serde_json::Value {
    serde_json::from_str(&home.ok(&["session", "show", id, "--json"])).unwrap()
}

fn files(home: &Home, id: &str) -> String {
    home.ok(&[
        "session",
        "exec",
        id,
        "--",
        "sh",
        "-c",
        "ls /a /b /c /c.bin 2>/dev/null; true",
    ])
}

/// Rows of the tables an import writes, in a home's state database.
fn rows(home: &Home) -> Vec<(&'static str, i64)> {
    let db = rusqlite::Connection::open(home.path().join("state.db")).unwrap();
    [
        "sessions",
        "session_entries",
        "session_rewinds",
        "snapshots",
        "snapshot_layers",
        "images",
    ]
    .into_iter()
    .map(|t| {
        let n: i64 = db
            .query_row(&format!("SELECT count(*) FROM {t}"), [], |r| r.get(0))
            .unwrap();
        (t, n)
    })
    .collect()
}

/// Files in a home's chunk store.
fn stored_objects(home: &Home) -> usize {
    fn count(dir: &Path) -> usize {
        std::fs::read_dir(dir).map_or(0, |entries| {
            entries
                .flatten()
                .map(|e| if e.path().is_dir() { count(&e.path()) } else { 1 })
                .sum()
        })
    }
    count(&home.path().join("store/objects"))
}

/// The tar members after the bundle's 12-byte header: (name, data offset, size).
fn members(bundle: &[u8]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let mut off = 12;
    while off + 512 <= bundle.len() && bundle[off..off + 512].iter().any(|&b| b != 0) {
        let h = &bundle[off..off + 512];
        let name = String::from_utf8_lossy(&h[..100]).trim_end_matches('\0').to_string();
        let size_text = String::from_utf8_lossy(&h[124..136]);
        let size = usize::from_str_radix(size_text.trim_matches(|c: char| c == '\0' || c == ' '), 8).unwrap();
        out.push((name, off + 512, size));
        off += 512 + size.div_ceil(512) * 512;
    }
    out
}

fn bundle_path(home: &Home, name: &str) -> PathBuf {
    home.path().join(name)
}

/// A suspended session with files, a large payload and a snapshot, exported.
fn exported(home: &Home) -> (String, Vec<u8>) {
    let id = home.ok(&["session", "create", "--name", "small"]).trim().to_string();
    home.ok(&[
        "session",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "head -c 3000000 /dev/urandom > /c.bin",
    ]);
    home.ok(&[
        "session",
        "append",
        &id,
        "--role",
        "user",
        "--content",
        &"y".repeat(70_000),
    ]);
    home.ok(&["session", "suspend", &id]);
    let path = bundle_path(home, "small.bundle");
    home.ok(&["session", "export", &id, "-o", path.to_str().unwrap()]);
    (id, std::fs::read(&path).unwrap())
}

#[test]
fn export_then_import_on_a_fresh_state_directory_resumes_the_session() {
    if skip("export_then_import_on_a_fresh_state_directory_resumes_the_session") {
        return;
    }
    let home = Home::new();
    let parent = home.ok(&["session", "create", "--name", "origin"]).trim().to_string();
    home.ok(&["session", "exec", &parent, "--", "sh", "-c", "echo a > /a"]); // 1, 2
    home.ok(&["session", "append", &parent, "--role", "user", "--content", "hello"]); // 3
    let big = "x".repeat(100_000);
    home.ok(&["session", "append", &parent, "--role", "user", "--content", &big]); // 4
    home.ok(&[
        "session",
        "append",
        &parent,
        "--role",
        "assistant",
        "--content",
        "dropped",
    ]); // 5
    home.ok(&["session", "rewind", &parent, "--to", "4"]); // 5 abandoned
    home.ok(&["session", "suspend", &parent]); // 6: the snapshot
    home.ok(&["session", "exec", &parent, "--", "sh", "-c", "echo b > /b"]); // 7, 8
                                                                             // The session exported is a fork: its log starts in its parent's.
    let child = home
        .ok(&[
            "session", "fork", &parent, "--at", "8", "--reason", "try c", "--name", "travel",
        ])
        .trim()
        .to_string();
    let md5 = home.ok(&[
        "session",
        "exec",
        &child,
        "--",
        "sh",
        "-c",
        "echo c > /c; head -c 3000000 /dev/urandom > /c.bin; md5sum /c.bin",
    ]); // 9, 10
    home.ok(&["session", "append", &child, "--role", "user", "--content", "abandoned"]); // 11
    home.ok(&["session", "rewind", &child, "--to", "10"]);
    home.ok(&["session", "append", &child, "--role", "user", "--content", "kept"]); // 12
    assert_eq!(show(&home, &child)["state"], "active");

    // Exporting the active fork snapshots it first and says so in its log.
    let path = bundle_path(&home, "travel.bundle");
    home.ok(&["session", "export", &child, "-o", path.to_str().unwrap()]);
    let original = log(&home, &child);
    let last = original.last().unwrap();
    assert_eq!(
        (&last["seq"], &last["kind"]),
        (&serde_json::json!(13), &serde_json::json!("note"))
    );
    assert!(last["snapshot_id"].is_string(), "the export's snapshot is recorded");
    let seqs: Vec<u64> = original.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13]);
    let verified = home.ok(&["session", "verify", &child]);
    assert!(verified.starts_with("ok: 13 entries"), "{verified}");

    let fresh = Home::empty();
    let imported = fresh
        .ok(&["session", "import", path.to_str().unwrap()])
        .trim()
        .to_string();
    assert_ne!(imported, child, "an import gets a new id");
    let s = show(&fresh, &imported);
    assert_eq!(s["name"], "travel");
    assert_eq!(s["state"], "suspended");
    assert_eq!(s["parent_id"], serde_json::Value::Null);
    assert_eq!(s["head_hash"], show(&home, &child)["head_hash"]);
    // The same live log: seqs, hashes, contents (the large one from the store).
    assert_eq!(log(&fresh, &imported), original);
    assert_eq!(log(&fresh, &imported)[3]["content"].as_str().unwrap().len(), 100_000);
    assert_eq!(fresh.ok(&["session", "verify", &imported]), verified);

    // exec resumes it on the machine as exported.
    assert_eq!(files(&fresh, &imported), "/a\n/c\n/c.bin");
    let md5_again = fresh.ok(&["session", "exec", &imported, "--", "md5sum", "/c.bin"]);
    assert_eq!(md5_again, md5);
    // Forks at earlier entries: the parent's suspend snapshot, and before
    // any snapshot (the image, which this home never built).
    let at6 = fresh
        .ok(&["session", "fork", &imported, "--at", "6", "--reason", "back"])
        .trim()
        .to_string();
    assert_eq!(files(&fresh, &at6), "/a");
    assert_eq!(log(&fresh, &at6)[..5], original[..5]);
    let at2 = fresh
        .ok(&["session", "fork", &imported, "--at", "2", "--reason", "start"])
        .trim()
        .to_string();
    assert_eq!(files(&fresh, &at2), "");
    // Its chain: the imported 1 to 6 (5 abandoned, still linked), then its exec.
    assert!(fresh.ok(&["session", "verify", &at6]).starts_with("ok: 8 entries"));
    // An abandoned entry stays off the live log: no fork from it.
    let refused = fresh.cairn(&["session", "fork", &imported, "--at", "11", "--reason", "x"]);
    assert!(!refused.status.success(), "entry 11 was rewound away");
    // The store keeps what the imported session needs.
    fresh.ok(&["gc"]);
    assert_eq!(log(&fresh, &imported)[3]["content"].as_str().unwrap().len(), 100_000);

    // The same file again: a taken name is refused, another name works.
    let sessions_before = fresh.ok(&["session", "ls", "--json"]);
    let taken = fresh.cairn(&["session", "import", path.to_str().unwrap()]);
    assert!(!taken.status.success());
    assert!(stderr(&taken).contains("--name"), "{}", stderr(&taken));
    assert_eq!(fresh.ok(&["session", "ls", "--json"]), sessions_before);
    let second = fresh
        .ok(&["session", "import", path.to_str().unwrap(), "--name", "travel-2"])
        .trim()
        .to_string();
    assert_eq!(log(&fresh, &second), original);
    assert_eq!(files(&fresh, &second), "/a\n/c\n/c.bin");
}

#[test]
fn a_bundle_with_one_flipped_byte_is_refused_and_gc_removes_what_it_stored() {
    if skip("a_bundle_with_one_flipped_byte_is_refused_and_gc_removes_what_it_stored") {
        return;
    }
    let home = Home::new();
    let (_, mut bundle) = exported(&home);
    let (name, data, size) = members(&bundle)
        .into_iter()
        .rev()
        .find(|(name, _, size)| name.starts_with("objects/") && *size > 0)
        .expect("objects in the bundle");
    bundle[data + size / 2] ^= 0x40;
    let fresh = Home::empty();
    let path = bundle_path(&fresh, "flipped.bundle");
    std::fs::write(&path, &bundle).unwrap();
    let out = fresh.cairn(&["session", "import", path.to_str().unwrap()]);
    assert!(!out.status.success());
    let hash = name.trim_start_matches("objects/");
    assert!(
        stderr(&out).contains("corrupt") && stderr(&out).contains(hash),
        "names the corrupt object: {}",
        stderr(&out)
    );
    assert!(rows(&fresh).iter().all(|(_, n)| *n == 0), "{:?}", rows(&fresh));
    assert!(stored_objects(&fresh) > 0, "the objects before the bad one were stored");
    fresh.ok(&["gc"]);
    assert_eq!(stored_objects(&fresh), 0, "gc removes what the refused import stored");
}

#[test]
fn a_truncated_or_foreign_bundle_is_refused_and_records_nothing() {
    if skip("a_truncated_or_foreign_bundle_is_refused_and_records_nothing") {
        return;
    }
    let home = Home::new();
    let (id, bundle) = exported(&home);
    let fresh = Home::empty();
    let path = bundle_path(&fresh, "cut.bundle");
    let last_object = members(&bundle).last().map(|(_, data, _)| *data).unwrap();
    let refused = |bytes: &[u8], says: &str| {
        std::fs::write(&path, bytes).unwrap();
        let out = fresh.cairn(&["session", "import", path.to_str().unwrap()]);
        assert!(!out.status.success(), "{says}: imported");
        assert!(stderr(&out).contains(says), "{says}: {}", stderr(&out));
        assert!(rows(&fresh).iter().all(|(_, n)| *n == 0), "{:?}", rows(&fresh));
    };
    refused(&bundle[..6], "truncated");
    refused(&bundle[..bundle.len() / 2], "truncated");
    refused(&bundle[..last_object + 1], "truncated");
    let mut foreign = bundle.clone();
    foreign[..8].copy_from_slice(b"NOTCAIRN");
    refused(&foreign, "not a Cairn session bundle");
    let mut future = bundle.clone();
    future[8..12].copy_from_slice(&2u32.to_le_bytes());
    refused(&future, "upgrade Cairn");

    // The whole file imports, through standard input too.
    std::fs::write(&path, &bundle).unwrap();
    let out = fresh
        .command(&["session", "import", "-", "--name", "whole"])
        .stdin(std::fs::File::open(&path).unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(log(&fresh, "whole"), log(&home, &id));
    assert_eq!(files(&fresh, "whole"), "/c.bin");
}

#[test]
fn a_gvisor_session_moves_with_its_running_processes() {
    if skip_without_runsc("a_gvisor_session_moves_with_its_running_processes") {
        return;
    }
    let home = Home::new();
    let id = home
        .ok(&["session", "create", "--driver", "gvisor", "--name", "counting"])
        .trim()
        .to_string();
    // A counter that lives only while its shell runs.
    home.ok(&[
        "session",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done) >/dev/null 2>&1 &",
    ]);
    std::thread::sleep(std::time::Duration::from_millis(400));
    let path = bundle_path(&home, "counting.bundle");
    home.ok(&["session", "export", &id, "-o", path.to_str().unwrap()]);

    let fresh = Home::empty();
    let imported = fresh
        .ok(&["session", "import", path.to_str().unwrap()])
        .trim()
        .to_string();
    assert_eq!(log(&fresh, &imported), log(&home, &id));
    let count = |h: &Home| -> u64 {
        (0..100)
            .find_map(|_| {
                h.ok(&["session", "exec", &imported, "--", "cat", "/tmp/count"])
                    .parse()
                    .ok()
            })
            .expect("/tmp/count holds a number")
    };
    let first = count(&fresh);
    assert!(first > 0);
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert!(
        count(&fresh) > first,
        "the counter runs on after the import: the memory image came along"
    );
}

#[test]
fn an_import_into_a_postgres_state_store_records_all_or_nothing() {
    let test = "an_import_into_a_postgres_state_store_records_all_or_nothing";
    if skip(test) {
        return;
    }
    let Some(db) = cairn_engine::testing::postgres_database(test) else {
        return;
    };
    let home = Home::new();
    let (id, bundle) = exported(&home);
    let mut fresh = Home::empty();
    fresh.state = Some(db.url.clone());
    let path = bundle_path(&fresh, "small.bundle");
    std::fs::write(&path, &bundle[..bundle.len() / 2]).unwrap();
    assert!(!fresh
        .cairn(&["session", "import", path.to_str().unwrap()])
        .status
        .success());
    for table in ["sessions", "session_entries", "snapshots", "images"] {
        assert_eq!(db.count(&format!("SELECT count(*) FROM {table}")), 0, "{table}");
    }
    std::fs::write(&path, &bundle).unwrap();
    let imported = fresh
        .ok(&["session", "import", path.to_str().unwrap()])
        .trim()
        .to_string();
    assert_eq!(log(&fresh, &imported), log(&home, &id));
    assert!(fresh.ok(&["session", "verify", &imported]).starts_with("ok: 4 entries"));
    assert_eq!(files(&fresh, &imported), "/c.bin");
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM session_entries WHERE session_id = '{imported}'"
        )),
        6,
        "the 4 imported entries and the exec's 2"
    );
}
