//! End-to-end: snapshots kept in S3 (a real Garage on loopback). A home
//! whose chunks go to S3 marks a snapshot durable once it is uploaded; a
//! fresh home with an empty cache, sharing the state and the bucket,
//! restores it with identical files, also with one node of a three-node
//! cluster lost.

mod common;

#[allow(dead_code)]
#[path = "../../cairn-store/tests/support/garage.rs"]
mod garage;

#[allow(dead_code)]
#[path = "../../cairn-store/tests/support/garage_cluster.rs"]
mod garage_cluster;

use common::{skip, stderr, Home};
use garage::Garage;
use garage_cluster::GarageCluster;

/// Every regular file under /data with its checksum, sorted.
const CHECKSUMS: &str = "cd /data && find . -type f | sort | xargs md5sum";

/// Starts `cairn serve` on `home`, GETs each of `paths` through the HTTP
/// API, stops the server; the JSON answers in order.
fn api_get(home: &Home, paths: &[&str]) -> Vec<serde_json::Value> {
    use std::io::BufRead;
    let token = home.ok(&["token", "create", "tests"]);
    let mut child = home
        .command(&["serve", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let base = loop {
        let line = lines.next().expect("the server prints where it listens").unwrap();
        if let Some(rest) = line.strip_prefix("cairn: serving on http://") {
            break format!("http://{}", rest.split_whitespace().next().unwrap());
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    let answers = paths
        .iter()
        .map(|path| {
            ureq::get(&format!("{base}{path}"))
                .set("Authorization", &format!("Bearer {token}"))
                .call()
                .unwrap()
                .into_json()
                .unwrap()
        })
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    answers
}

#[test]
fn a_fresh_home_with_an_empty_cache_restores_a_snapshot_from_s3_with_identical_files() {
    if skip("a_fresh_home_with_an_empty_cache_restores_a_snapshot_from_s3_with_identical_files") {
        return;
    }
    let Some(garage) = Garage::start("a_fresh_home_with_an_empty_cache_restores_a_snapshot_from_s3") else {
        return;
    };
    let url = format!(
        "s3://{}/homes?endpoint={}&region=garage",
        garage.bucket, garage.endpoint
    );
    let env = vec![
        ("CAIRN_STORE".to_string(), url),
        ("AWS_ACCESS_KEY_ID".to_string(), garage.key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), garage.secret.clone()),
    ];
    let first = Home::with_state_and_env(None, env.clone());
    let id = first.ok(&["create"]);
    first.sh(
        &id,
        "set -e; mkdir -p /data/d; echo hello > /data/small; \
         dd if=/dev/urandom of=/data/random bs=64k count=64 2>/dev/null; \
         echo deep > /data/d/f; ln -s small /data/link",
    );
    let before = first.sh(&id, CHECKSUMS);
    assert!(before.contains("./random"), "{before}");
    let out = first.cairn(&["snapshot", &id, "--label", "shared"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("remote store yet"), "{}", stderr(&out));
    let snap = String::from_utf8_lossy(&out.stdout).trim().to_string();

    let db = rusqlite::Connection::open(first.path().join("state.db")).unwrap();
    let durable: Option<i64> = db
        .query_row("SELECT remote_durable_at FROM snapshots WHERE id = ?1", [&snap], |r| {
            r.get(0)
        })
        .unwrap();
    assert!(
        durable.is_some(),
        "the snapshot was not marked durable after cairn snapshot returned"
    );
    // The mark is shown: in the list, in one snapshot's view, and in JSON.
    let listed: serde_json::Value = serde_json::from_str(&first.ok(&["snapshots", "--json"])).unwrap();
    let entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == snap.as_str())
        .unwrap();
    assert_eq!(entry["remote_durable_at"].as_i64(), durable, "{entry}");
    let table = first.ok(&["snapshots"]);
    assert!(table.contains("REMOTE") && table.contains("durable"), "{table}");
    let shown: serde_json::Value = serde_json::from_str(&first.ok(&["snapshot", "show", &snap, "--json"])).unwrap();
    assert_eq!(shown["remote_durable_at"].as_i64(), durable, "{shown}");
    let shown = first.ok(&["snapshot", "show", "shared"]);
    assert!(shown.contains("remote    durable since"), "{shown}");
    let api = api_get(&first, &[&format!("/v1/snapshots/{snap}"), "/v1/snapshots"]);
    assert_eq!(api[0]["remote_durable_at"].as_i64(), durable, "{}", api[0]);
    let item = api[1]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == snap.as_str())
        .unwrap();
    assert_eq!(item["remote_durable_at"].as_i64(), durable, "{item}");
    first.ok(&["rm", "-f", &id]);
    let journal = std::fs::read_dir(first.path().join("store/pending")).unwrap().count();
    assert_eq!(journal, 0, "uploads left pending");

    // The first host's disk is lost; only the state and the bucket remain.
    std::fs::remove_dir_all(first.path().join("store")).unwrap();
    std::fs::remove_dir_all(first.path().join("layers")).unwrap();

    // Another host: its own empty directory, the same state and bucket.
    let state = format!("sqlite:{}", first.path().join("state.db").display());
    let second = Home::bare(Some(state), env);
    let fork = second.ok(&["fork", &snap]);
    let after = second.sh(&fork, CHECKSUMS);
    assert_eq!(after, before);
    assert_eq!(second.sh(&fork, "readlink /data/link"), "small");
    let cached = std::fs::read_dir(second.path().join("store/objects")).unwrap().count();
    assert!(cached > 0, "the restore read nothing through the cache");
    second.ok(&["rm", "-f", &fork]);
}

#[test]
fn a_bad_store_stops_cairn_at_start_saying_what_to_do() {
    if skip("a_bad_store_stops_cairn_at_start_saying_what_to_do") {
        return;
    }
    let Some(mut garage) = Garage::start("a_bad_store_stops_cairn_at_start_saying_what_to_do") else {
        return;
    };
    let url = |bucket: &str| format!("s3://{bucket}/homes?endpoint={}&region=garage", garage.endpoint);
    let env = |url: String, secret: &str| {
        vec![
            ("CAIRN_STORE".to_string(), url),
            ("AWS_ACCESS_KEY_ID".to_string(), garage.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY".to_string(), secret.to_string()),
        ]
    };
    let fails_saying = |env: Vec<(String, String)>, says: &str| {
        let home = Home::bare(None, env);
        let out = home.cairn(&["ps"]);
        assert!(!out.status.success(), "cairn ps succeeded");
        assert!(stderr(&out).contains(says), "{}", stderr(&out));
    };
    fails_saying(env(url(&garage.bucket), &"0".repeat(64)), "check AWS_ACCESS_KEY_ID");
    fails_saying(env(url("no-such-bucket"), &garage.secret), "does not exist");
    fails_saying(
        env("s3://cairn-test/x?regoin=garage".into(), &garage.secret),
        "unknown parameter",
    );

    // A home that keeps its chunks in S3 is refused without it.
    let home = Home::bare(None, env(url(&garage.bucket), &garage.secret));
    home.ok(&["ps"]);
    let mut alone = home.command(&["ps"]);
    alone.env_remove("CAIRN_STORE");
    let out = alone.output().unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is the cache of s3://cairn-test/homes"),
        "{}",
        stderr(&out)
    );

    garage.kill();
    let out = home.cairn(&["ps"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("that the server is running"), "{}", stderr(&out));
}

#[test]
fn a_home_without_a_remote_store_shows_no_durable_mark() {
    if skip("a_home_without_a_remote_store_shows_no_durable_mark") {
        return;
    }
    let home = Home::new();
    let id = home.ok(&["create"]);
    let snap = home.ok(&["snapshot", &id]);
    let listed: serde_json::Value = serde_json::from_str(&home.ok(&["snapshots", "--json"])).unwrap();
    let entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == snap.as_str())
        .unwrap();
    assert!(entry["remote_durable_at"].is_null(), "{entry}");
    let table = home.ok(&["snapshots"]);
    assert!(!table.contains("REMOTE"), "{table}");
    let shown = home.ok(&["snapshot", "show", &snap]);
    assert!(shown.contains(&snap) && !shown.contains("remote"), "{shown}");
    let api = api_get(&home, &[&format!("/v1/snapshots/{snap}")]);
    assert!(api[0]["remote_durable_at"].is_null(), "{}", api[0]);
    home.ok(&["rm", "-f", &id]);
}

#[test]
fn a_snapshot_in_a_three_node_cluster_restores_with_a_node_lost() {
    let name = "a_snapshot_in_a_three_node_cluster_restores_with_a_node_lost";
    if skip(name) {
        return;
    }
    let Some(mut cluster) = GarageCluster::start(name) else {
        return;
    };
    let env = vec![
        ("CAIRN_STORE".to_string(), cluster.url("homes")),
        ("AWS_ACCESS_KEY_ID".to_string(), cluster.key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), cluster.secret.clone()),
    ];
    let first = Home::with_state_and_env(None, env.clone());
    let id = first.ok(&["create"]);
    first.sh(
        &id,
        "set -e; mkdir -p /data/d; echo hello > /data/small; \
         dd if=/dev/urandom of=/data/random bs=64k count=128 2>/dev/null; \
         echo deep > /data/d/f",
    );
    let before = first.sh(&id, CHECKSUMS);
    let snap = first.ok(&["snapshot", &id]);
    let shown: serde_json::Value = serde_json::from_str(&first.ok(&["snapshot", "show", &snap, "--json"])).unwrap();
    assert!(shown["remote_durable_at"].is_i64(), "{shown}");
    first.ok(&["rm", "-f", &id]);
    std::fs::remove_dir_all(first.path().join("store")).unwrap();
    std::fs::remove_dir_all(first.path().join("layers")).unwrap();

    // One machine of three is lost; every object is on the other two.
    cluster.kill(2);

    let state = format!("sqlite:{}", first.path().join("state.db").display());
    let second = Home::bare(Some(state), env);
    let out = second.cairn(&["fork", &snap]);
    assert!(
        out.status.success(),
        "{}\nnode 0's log:\n{}",
        stderr(&out),
        cluster.log(0)
    );
    let fork = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(second.sh(&fork, CHECKSUMS), before);
    second.ok(&["rm", "-f", &fork]);
}

/// The objects in the bucket under `prefix`.
fn remote_keys(garage: &Garage, prefix: &str) -> std::collections::HashSet<String> {
    use cairn_store::BlobStore;
    garage
        .open(prefix)
        .list()
        .unwrap()
        .into_iter()
        .map(|o| o.key.to_hex())
        .collect()
}

/// The keys the home's upload journal holds (objects not yet remote).
fn journal(home: &Home) -> Vec<String> {
    std::fs::read_dir(home.path().join("store/pending"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

#[test]
fn a_snapshot_whose_uploads_are_cut_off_is_marked_durable_only_once_they_land() {
    let name = "a_snapshot_whose_uploads_are_cut_off_is_marked_durable_only_once_they_land";
    if skip(name) {
        return;
    }
    let Some(mut garage) = Garage::start(name) else {
        return;
    };
    let url = format!("s3://{}/cut?endpoint={}&region=garage", garage.bucket, garage.endpoint);
    let env = vec![
        ("CAIRN_STORE".to_string(), url),
        ("AWS_ACCESS_KEY_ID".to_string(), garage.key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), garage.secret.clone()),
        ("CAIRN_UPLOAD_WAIT".to_string(), "2".to_string()),
    ];
    let home = Home::with_state_and_env(None, env);
    let id = home.ok(&["create"]);
    home.sh(
        &id,
        "mkdir -p /data && dd if=/dev/urandom of=/data/random bs=64k count=64 2>/dev/null",
    );

    // The store stops taking writes (reads still answer): every upload fails.
    let (bucket, key) = (garage.bucket.clone(), garage.key_id.clone());
    garage.admin(&["bucket", "deny", "--write", &bucket, "--key", &key]);
    let out = home.cairn(&["snapshot", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("remote store yet"), "{}", stderr(&out));
    let snap = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let pending = journal(&home);
    assert!(!pending.is_empty(), "nothing waits for upload");
    let remote = remote_keys(&garage, "cut");
    assert!(
        pending.iter().any(|k| !remote.contains(k)),
        "the pending objects are remote already"
    );
    let shown: serde_json::Value = serde_json::from_str(&home.ok(&["snapshot", "show", &snap, "--json"])).unwrap();
    assert!(
        shown["remote_durable_at"].is_null(),
        "marked durable with uploads pending: {shown}"
    );
    assert!(home.ok(&["snapshot", "show", &snap]).contains("remote    pending"));

    // Then the store is cut off altogether, uploads still pending.
    garage.kill();
    let out = home.cairn(&["snapshots"]);
    assert!(!out.status.success(), "cairn ran without its store");
    let db = rusqlite::Connection::open(home.path().join("state.db")).unwrap();
    let durable: Option<i64> = db
        .query_row("SELECT remote_durable_at FROM snapshots WHERE id = ?1", [&snap], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(durable, None);

    // The store is back and takes writes: the next command uploads what
    // waited, and only then marks the snapshot.
    garage.restart();
    garage.admin(&["bucket", "allow", "--write", &bucket, "--key", &key]);
    // (A command prints before it waits for uploads: the mark shows from
    // the next command on.)
    home.ok(&["snapshots"]);
    let shown: serde_json::Value = serde_json::from_str(&home.ok(&["snapshot", "show", &snap, "--json"])).unwrap();
    assert!(
        shown["remote_durable_at"].is_i64(),
        "not marked once the uploads landed: {shown}"
    );
    assert!(journal(&home).is_empty(), "uploads left pending: {:?}", journal(&home));
    let remote = remote_keys(&garage, "cut");
    let missing: Vec<&String> = pending.iter().filter(|k| !remote.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "marked durable with objects missing from the store: {missing:?}"
    );
    home.ok(&["rm", "-f", &id]);
}

#[test]
fn verify_finds_damage_in_the_cache_and_the_bucket_and_repair_mends_each_from_the_other() {
    use cairn_store::BlobStore;
    if skip("verify_finds_damage_in_the_cache_and_the_bucket_and_repair_mends_each_from_the_other") {
        return;
    }
    let Some(garage) = Garage::start("verify_finds_damage_in_the_cache_and_the_bucket") else {
        return;
    };
    let url = format!(
        "s3://{}/verify?endpoint={}&region=garage",
        garage.bucket, garage.endpoint
    );
    let env = vec![
        ("CAIRN_STORE".to_string(), url),
        ("AWS_ACCESS_KEY_ID".to_string(), garage.key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), garage.secret.clone()),
    ];
    let home = Home::with_state_and_env(None, env.clone());
    let id = home.ok(&["create"]);
    let since = std::time::SystemTime::now();
    home.sh(
        &id,
        "mkdir -p /data && dd if=/dev/urandom of=/data/random bs=64k count=64 2>/dev/null && echo hi > /data/small",
    );
    let snap = home.ok(&["snapshot", &id, "--label", "checked"]);
    home.ok(&["rm", "-f", &id]);
    let out = home.cairn(&["verify", &snap]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stderr(&out),
        String::from_utf8_lossy(&out.stdout)
    );

    // The snapshot's own chunks of /data/random: not its manifest, nor any
    // layer's index (the image's is refreshed when it is used again), in
    // the cache and the bucket alike.
    let layers = home.snapshot_layers(&snap);
    let bucket = garage.open("verify");
    let mut chunks: Vec<String> = remote_keys(&garage, "verify")
        .into_iter()
        .filter(|h| !layers.contains(h) && *h != snap)
        .filter(|h| std::fs::metadata(home.store_object(h)).is_ok_and(|m| m.modified().unwrap() > since))
        .collect();
    chunks.sort();
    assert!(chunks.len() >= 3, "{chunks:?}");
    let key = |h: &str| h.parse::<cairn_store::ChunkHash>().unwrap();
    // One corrupt in the cache, one gone from the bucket, one corrupt in both.
    let flip = |path: &std::path::Path| {
        let mut bytes = std::fs::read(path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(path, bytes).unwrap();
    };
    flip(&home.store_object(&chunks[0]));
    assert!(bucket.delete(&key(&chunks[1])).unwrap());
    flip(&home.store_object(&chunks[2]));
    let mut bad = bucket.get(&key(&chunks[2])).unwrap();
    bad[10] ^= 0x01;
    bucket.put_unconditionally(&key(&chunks[2]), &bad).unwrap();

    let out = home.cairn(&["verify", "--all", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let by_hash = |v: &serde_json::Value| -> std::collections::BTreeMap<String, serde_json::Value> {
        v[0]["damaged"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| (d["hash"].as_str().unwrap().to_string(), d.clone()))
            .collect()
    };
    let damaged = by_hash(&v);
    assert_eq!(damaged.len(), 3, "{v}");
    let d0 = &damaged[&chunks[0]];
    assert!(
        d0["local"].as_str().unwrap().starts_with("corrupt") && d0["remote"] == "intact",
        "{d0}"
    );
    let d1 = &damaged[&chunks[1]];
    assert!(d1["local"] == "intact" && d1["remote"] == "missing", "{d1}");
    let d2 = &damaged[&chunks[2]];
    assert!(
        d2["recoverable"] == false && d2["remote"].as_str().unwrap().starts_with("corrupt"),
        "{d2}"
    );
    assert!(
        damaged
            .values()
            .all(|d| d["what"].as_str().unwrap().contains("/data/random")),
        "{damaged:?}"
    );

    // Repair mends the two that have an intact copy and says the third has none.
    let out = home.cairn(&["verify", &snap, "--repair", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "one object has no intact copy: {}",
        stderr(&out)
    );
    let repaired = by_hash(&serde_json::from_slice(&out.stdout).unwrap());
    assert_eq!(
        repaired[&chunks[0]]["repair"],
        "the cached copy replaced by the bucket's"
    );
    assert_eq!(
        repaired[&chunks[1]]["repair"],
        "the bucket's copy replaced by the cache's"
    );
    assert_eq!(repaired[&chunks[2]]["repair"], "not repaired: no intact copy");
    let out = home.cairn(&["verify", &snap, "--json"]);
    let left = by_hash(&serde_json::from_slice(&out.stdout).unwrap());
    assert_eq!(
        left.keys().collect::<Vec<_>>(),
        vec![&chunks[2]],
        "only the lost one is left"
    );

    // A host without the layers materialised meets the lost chunk: the
    // restore fails, naming the snapshot, and starts nothing.
    std::fs::remove_dir_all(home.path().join("layers")).unwrap();
    std::fs::remove_file(home.store_object(&chunks[2])).unwrap();
    let out = home.cairn(&["restore", &snap]);
    assert_eq!(out.status.code(), Some(125), "a lost chunk fails the restore");
    let err = stderr(&out);
    assert!(
        err.contains(&format!("snapshot {snap} cannot be restored")) && err.contains("cairn verify"),
        "{err}"
    );
    assert!(home.ps().is_empty(), "a failed restore left a sandbox");
    // The two mended objects: the cache's copy and the bucket's are the
    // same bytes again.
    for h in &chunks[..2] {
        let cached = std::fs::read(home.store_object(h)).unwrap();
        assert_eq!(cached, bucket.get(&key(h)).unwrap(), "{h}");
    }
}
