//! The S3 backend against a real S3 server (Garage on loopback).

mod support;

use std::time::Duration;

use cairn_store::{BlobError, BlobStore, ChunkHash, PutOutcome, S3Config, S3Store, MULTIPART_THRESHOLD};
use support::garage::Garage;
use support::random_bytes;

#[test]
fn objects_round_trip_through_s3() {
    let Some(garage) = Garage::start("objects_round_trip_through_s3") else {
        return;
    };
    let store = garage.open("round-trip");
    let a = random_bytes(300_000, 1);
    let key = ChunkHash::of(&a);
    assert!(!store.contains(&key).unwrap());
    assert!(!store.refresh(&key).unwrap());
    assert!(matches!(store.get(&key), Err(BlobError::NotFound { .. })));
    assert_eq!(store.put(&key, &a).unwrap(), PutOutcome::Stored);
    assert_eq!(store.put(&key, &a).unwrap(), PutOutcome::AlreadyPresent);
    assert!(store.contains(&key).unwrap());
    assert!(store.refresh(&key).unwrap());
    assert_eq!(store.get(&key).unwrap(), a);

    let b = random_bytes(10, 2);
    let key_b = ChunkHash::of(&b);
    store.put(&key_b, &b).unwrap();
    let mut listed: Vec<_> = store.list().unwrap().into_iter().map(|o| (o.key, o.size)).collect();
    listed.sort();
    let mut expected = vec![(key, a.len() as u64), (key_b, 10)];
    expected.sort();
    assert_eq!(listed, expected);

    // Another prefix of the same bucket is another store.
    assert!(garage.open("elsewhere").list().unwrap().is_empty());
    // Reopening finds the objects.
    assert_eq!(garage.open("round-trip").get(&key_b).unwrap(), b);

    assert!(store.delete(&key).unwrap());
    assert!(!store.delete(&key).unwrap());
    assert!(matches!(store.get(&key), Err(BlobError::NotFound { .. })));
    assert_eq!(store.list().unwrap().len(), 1);
}

#[test]
fn an_object_past_the_multipart_threshold_is_uploaded_in_parts_and_read_back() {
    let Some(garage) = Garage::start("an_object_past_the_multipart_threshold_is_uploaded_in_parts_and_read_back")
    else {
        return;
    };
    let store = garage.open("big");
    let data = random_bytes(MULTIPART_THRESHOLD + 5 * 1024 * 1024 + 17, 3);
    let key = ChunkHash::of(&data);
    assert_eq!(store.put(&key, &data).unwrap(), PutOutcome::Stored);
    let back = store.get(&key).unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "the multipart object reads back different bytes");
    assert_eq!(store.list().unwrap()[0].size, data.len() as u64);
}

fn with_credentials(garage: &Garage, url: &str, id: &str, secret: &str) -> S3Config {
    let mut config = S3Config::from_url_with_env(url, |name| match name {
        "AWS_ACCESS_KEY_ID" => Some(id.to_string()),
        "AWS_SECRET_ACCESS_KEY" => Some(secret.to_string()),
        _ => None,
    })
    .unwrap();
    config.request_timeout = Duration::from_secs(5);
    let _ = garage;
    config
}

#[test]
fn bad_credentials_a_missing_bucket_and_an_unreachable_endpoint_are_refused_at_open() {
    let Some(mut garage) =
        Garage::start("bad_credentials_a_missing_bucket_and_an_unreachable_endpoint_are_refused_at_open")
    else {
        return;
    };
    let url = format!("s3://{}/p?endpoint={}&region=garage", garage.bucket, garage.endpoint);

    let wrong_secret = with_credentials(&garage, &url, &garage.key_id, &"0".repeat(64));
    let err = S3Store::open(wrong_secret).unwrap_err();
    eprintln!("{err}");
    assert!(matches!(err, BlobError::S3Denied { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        "{err}"
    );

    let unknown_key = with_credentials(&garage, &url, "GK000000000000000000000000", &garage.secret);
    let err = S3Store::open(unknown_key).unwrap_err();
    assert!(matches!(err, BlobError::S3Denied { .. }), "{err:?}");

    let no_bucket_url = format!("s3://no-such-bucket/p?endpoint={}&region=garage", garage.endpoint);
    let err = S3Store::open(with_credentials(
        &garage,
        &no_bucket_url,
        &garage.key_id,
        &garage.secret,
    ))
    .unwrap_err();
    assert!(matches!(err, BlobError::S3NoBucket { .. }), "{err:?}");
    assert!(err.to_string().contains("create it"), "{err}");
    eprintln!("{err}");

    // A prefix already used by something else is not taken over.
    let other = garage.open("foreign");
    other.put(&ChunkHash::of(b"x"), b"x").unwrap();
    let foreign = with_credentials(
        &garage,
        &url.replace("/p?", "/foreign/objects?"),
        &garage.key_id,
        &garage.secret,
    );
    let err = S3Store::open(foreign).unwrap_err();
    assert!(matches!(err, BlobError::S3NotAStore { .. }), "{err:?}");

    let good = with_credentials(&garage, &url, &garage.key_id, &garage.secret);
    garage.kill();
    let started = std::time::Instant::now();
    let err = S3Store::open(good).unwrap_err();
    assert!(matches!(err, BlobError::S3Unreachable { .. }), "{err:?}");
    assert!(err.to_string().contains("that the server is running"), "{err}");
    eprintln!("{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the probe took {:?}",
        started.elapsed()
    );
}
