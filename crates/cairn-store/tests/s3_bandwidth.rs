//! Figures, not assertions: PUT and GET bandwidth to a loopback Garage for
//! 1 GiB of 1 MiB chunks, one stream and eight, the same data as one file
//! (its own chunks fetched 16 at a time), and a cold read of the
//! same data as a file through the cache. Run with
//! `cargo test -p cairn-store --release --test s3_bandwidth -- --ignored --nocapture`.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use cairn_store::{BlobStore, ChunkHash, ChunkStore, ReadContext, S3Store, TieredOptions, TieredStore};
use support::garage::Garage;
use support::random_bytes;

const CHUNK: usize = 1 << 20;

/// 1 GiB, or `CAIRN_BW_MIB` MiB.
fn total() -> usize {
    std::env::var("CAIRN_BW_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
        << 20
}

fn parallel(store: &S3Store, keys: &[ChunkHash], threads: usize, op: impl Fn(&S3Store, usize) + Sync) -> f64 {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= keys.len() {
                    break;
                }
                op(store, i);
            });
        }
    });
    (keys.len() * CHUNK) as f64 / started.elapsed().as_secs_f64() / (1 << 20) as f64
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn put_and_get_bandwidth_to_loopback_s3() {
    let Some(garage) = Garage::start("put_and_get_bandwidth_to_loopback_s3") else {
        return;
    };
    let chunks: Vec<Vec<u8>> = (0..total() / CHUNK).map(|i| random_bytes(CHUNK, i as u64)).collect();
    let keys: Vec<ChunkHash> = chunks.iter().map(|c| ChunkHash::of(c)).collect();
    for threads in [1, 8] {
        let store = garage.open(&format!("bw{threads}"));
        let cpu_before = process_cpu_seconds(garage.pid());
        let put = parallel(&store, &keys, threads, |s, i| {
            s.put_unconditionally(&keys[i], &chunks[i]).unwrap();
        });
        let garage_cpu = process_cpu_seconds(garage.pid()) - cpu_before;
        let get = parallel(&store, &keys, threads, |s, i| {
            assert_eq!(s.get(&keys[i]).unwrap().len(), CHUNK);
        });
        println!(
            "S3 {threads} stream(s), {} MiB in 1 MiB objects: PUT {put:.0} MiB/s (Garage used {garage_cpu:.0} s of CPU), GET {get:.0} MiB/s",
            total() >> 20
        );
    }

    // The same gigabyte as one file through the cache: stored, uploaded,
    // then read back with an empty cache (a cold restore reads this way).
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = chunks.concat();
    drop(chunks);
    let open = |cache: &std::path::Path| {
        let identity = format!("s3://{}/file", garage.bucket);
        ChunkStore::new(TieredStore::open(cache, garage.open("file"), &identity, TieredOptions::default()).unwrap())
    };
    let started = Instant::now();
    let content = {
        let store = open(&dir.path().join("warm"));
        let content = store.store_reader(&data[..]).unwrap();
        store.backend().flush(std::time::Duration::from_secs(600)).unwrap();
        content
    };
    let mib = (total() >> 20) as f64;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{mib} MiB file stored and uploaded through the cache: {:.0} MiB/s",
        mib / secs
    );
    // The file's own objects (about a quarter of a MiB each) straight
    // from S3, as many at once as a read-ahead runs: the bound for the
    // reads below.
    {
        let s3 = garage.open("file");
        let keys: Vec<ChunkHash> = content.chunks.iter().map(|c| c.hash).collect();
        let next = AtomicUsize::new(0);
        let bytes = std::sync::atomic::AtomicU64::new(0);
        let started = Instant::now();
        std::thread::scope(|scope| {
            for _ in 0..16 {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= keys.len() {
                        break;
                    }
                    let got = s3.get(&keys[i]).unwrap().len() as u64;
                    bytes.fetch_add(got, Ordering::Relaxed);
                });
            }
        });
        let bytes = bytes.into_inner();
        println!(
            "the file's {} objects ({:.0} KiB on average) from S3, 16 at a time: GET {:.0} MiB/s",
            keys.len(),
            bytes as f64 / keys.len() as f64 / 1024.0,
            bytes as f64 / started.elapsed().as_secs_f64() / (1 << 20) as f64
        );
    }
    // Fetching alone: every chunk into an empty cache by a read-ahead.
    let fetch_only = open(&dir.path().join("fetch"));
    let keys: Vec<ChunkHash> = content.chunks.iter().map(|c| c.hash).collect();
    let started = Instant::now();
    fetch_only.backend().read_ahead(keys).finish();
    println!(
        "the same {} chunks into an empty cache by a read-ahead: {:.0} MiB/s",
        content.chunks.len(),
        mib / started.elapsed().as_secs_f64()
    );
    drop(fetch_only);
    let store = open(&dir.path().join("cold"));
    let started = Instant::now();
    let mut sink = std::io::sink();
    store.read_to_writer(&content, &mut sink, &ReadContext::new()).unwrap();
    let cold = mib / started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut back = Vec::with_capacity(total());
    store.read_to_writer(&content, &mut back, &ReadContext::new()).unwrap();
    let warm = mib / started.elapsed().as_secs_f64();
    assert!(back == data);
    println!("{mib} MiB file read through the cache: cold {cold:.0} MiB/s, warm {warm:.0} MiB/s");
}

/// User plus system CPU time of a process, from /proc.
fn process_cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}
