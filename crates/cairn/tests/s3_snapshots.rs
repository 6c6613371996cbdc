//! End-to-end: snapshots kept in S3 (a real Garage on loopback). A home
//! whose chunks go to S3 marks a snapshot durable once it is uploaded; a
//! fresh home with an empty cache, sharing the state and the bucket,
//! restores it with identical files.

mod common;

#[allow(dead_code)]
#[path = "../../cairn-store/tests/support/garage.rs"]
mod garage;

use common::{skip, stderr, Home};
use garage::Garage;

/// Every regular file under /data with its checksum, sorted.
const CHECKSUMS: &str = "cd /data && find . -type f | sort | xargs md5sum";

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
