//! End-to-end property: `cairn gc` never deletes a chunk that a live
//! snapshot references, over random snapshot trees and deletions.
//!
//! Each case grows a random tree of snapshots (new sandboxes from the image,
//! forks and restores of random snapshots, further snapshots of the same
//! sandbox), writing, overwriting and deleting files under /data, some small
//! (one chunk each, reused across branches) and some of a few MB made from
//! one blob with local changes (content-defined chunks shared across
//! snapshots). A model records every snapshot's files. Then a random subset
//! goes with `cairn snapshot rm` (which forgets only the snapshots named:
//! their children keep the whole layer chain), the sandboxes go, `cairn gc`
//! runs, the local layer cache is dropped, and every listed snapshot must
//! restore from the store to exactly its model's files, while what gc
//! removed must be exactly what nothing live references any more.
//!
//! `CAIRN_GC_SEED=0x...` runs one case with that seed.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use common::{init_pid, skip, Home};

/// Seeds of the cases run by default.
/// (0x444 takes a snapshot with no change right after another, which stacked
/// the same layer twice before that was fixed.)
const SEEDS: [u64; 4] = [0x5eed_0001, 0xc0ff_ee42, 0x444, 0x7e57_ab1e];
/// Snapshots per case.
const SNAPSHOTS: std::ops::RangeInclusive<usize> = 12..=15;
/// Below the store's smallest chunk a file is exactly one chunk, keyed by
/// the BLAKE3 hash of its content (cairn_store::MIN_CHUNK is 64 KiB).
const SMALL_MAX: usize = 60_000;
/// Files up to this size are held in the layer's index, not the store
/// (`cairn_layers::archive::SMALL_FILE_MAX`).
const INDEX_FILE_MAX: usize = 4096;
/// The blob the large files are variations of.
const BIG_LEN: usize = 3 << 20;
/// Sandboxes kept running while the tree grows.
const MAX_SANDBOXES: usize = 4;

/// xorshift64*, seeded through splitmix64.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn percent(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

/// A file as the model knows it: BLAKE3 hex of its content, and its length.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Content {
    hash: String,
    len: usize,
}

impl Content {
    fn of(bytes: &[u8]) -> Content {
        Content {
            hash: blake3::hash(bytes).to_hex().to_string(),
            len: bytes.len(),
        }
    }

    /// Stored as exactly one chunk whose key is `hash` (smaller files are
    /// held in the layer's index).
    fn one_chunk(&self) -> bool {
        (INDEX_FILE_MAX + 1..=SMALL_MAX).contains(&self.len)
    }
}

/// The files under /data, by name.
type Files = BTreeMap<String, Content>;

struct Snap {
    id: String,
    files: Files,
    layers: Vec<String>,
    /// Its own layer (the first of `layers`) when the snapshot had changes.
    own_layer: Option<String>,
    /// One-chunk contents its own layer holds.
    small: BTreeSet<String>,
}

struct Sandbox {
    id: String,
    pid: i32,
    files: Files,
    /// What a snapshot of it stacks its changes on.
    layers: Vec<String>,
    /// The model index of the snapshot a snapshot of it names as parent.
    parent: Option<usize>,
    /// Whether it has been snapshotted (a first snapshot captures all its changes).
    snapshotted: bool,
}

struct Case {
    seed: u64,
    rng: Rng,
    home: Home,
    image_layers: Vec<String>,
    /// A few MB of random bytes the large files are variations of.
    big: Vec<u8>,
    /// Small contents written so far, for reuse across branches.
    pool: Vec<Vec<u8>>,
    snaps: Vec<Snap>,
    sandboxes: Vec<Sandbox>,
}

#[test]
fn gc_never_deletes_a_chunk_a_live_snapshot_references() {
    if skip("gc_never_deletes_a_chunk_a_live_snapshot_references") {
        return;
    }
    let seeds: Vec<u64> = match std::env::var("CAIRN_GC_SEED") {
        Ok(s) => vec![u64::from_str_radix(s.trim_start_matches("0x"), 16).expect("CAIRN_GC_SEED is hex")],
        Err(_) => SEEDS.to_vec(),
    };
    let mut kept_for_children = 0;
    for &seed in &seeds {
        eprintln!("snapshot gc property: seed {seed:#x}");
        match std::panic::catch_unwind(|| Case::new(seed).run()) {
            Ok(kept) => kept_for_children += kept,
            Err(panic) => {
                eprintln!(
                    "snapshot gc property FAILED with seed {seed:#x}; rerun it alone with CAIRN_GC_SEED={seed:#x}"
                );
                std::panic::resume_unwind(panic);
            }
        }
    }
    if seeds == SEEDS {
        // The case this property is about: a deleted snapshot whose layer
        // surviving descendants still stack on.
        assert!(
            kept_for_children > 0,
            "no seed deleted a snapshot whose layer its children need"
        );
    }
}

impl Case {
    fn new(seed: u64) -> Case {
        let mut rng = Rng::new(seed);
        let home = Home::new();
        let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
        let image_layers = strings(&images[0]["layers"]);
        assert!(!image_layers.is_empty(), "{images}");
        let big = rng.bytes(BIG_LEN);
        Case {
            seed,
            rng,
            home,
            image_layers,
            big,
            pool: Vec::new(),
            snaps: Vec::new(),
            sandboxes: Vec::new(),
        }
    }

    /// Runs the case; returns how many deleted snapshots' layers gc had to
    /// keep for their surviving descendants.
    fn run(mut self) -> usize {
        let count = SNAPSHOTS.start() + self.rng.below(SNAPSHOTS.end() - SNAPSHOTS.start() + 1);
        while self.snaps.len() < count {
            self.grow();
        }
        self.check_listing(&(0..self.snaps.len()).collect::<Vec<_>>(), "before any deletion");
        let survivors = self.delete_some();
        self.collect_and_verify(&survivors)
    }

    /// One more snapshot: of a running sandbox, or of a new one started from
    /// the image or from a random snapshot.
    fn grow(&mut self) {
        let roll = self.rng.below(100);
        let at = if self.snaps.is_empty() || roll < 10 {
            self.start(None, "create")
        } else if roll < 40 && !self.sandboxes.is_empty() {
            self.rng.below(self.sandboxes.len())
        } else {
            let from = self.rng.below(self.snaps.len());
            self.start(Some(from), if roll < 70 { "fork" } else { "restore" })
        };
        let fresh = !self.sandboxes[at].snapshotted;
        let ops = if !fresh && self.rng.percent(10) {
            0
        } else {
            1 + self.rng.below(4)
        };
        let mut touched = BTreeSet::new();
        for _ in 0..ops {
            self.change(at, &mut touched);
        }
        let sandbox = &self.sandboxes[at];
        let rec: serde_json::Value = serde_json::from_str(&self.home.ok(&["snapshot", &sandbox.id, "--json"])).unwrap();
        let id = rec["id"].as_str().unwrap().to_string();
        let layers = strings(&rec["layers"]);
        let parent = sandbox.parent.map(|p| self.snaps[p].id.clone());
        assert_eq!(rec["parent_id"].as_str(), parent.as_deref(), "parent of {id}: {rec}");
        // A snapshot with changes stacks one new layer on what the sandbox
        // had. One without usually adds none, but entries changed within a
        // second of the previous capture are read again ("racily clean"), so
        // it may add a layer of those (the same layer again when the whole
        // previous layer was that recent): the contents of such a layer are
        // in the layers below it too.
        let changed = fresh || ops > 0 || layers.len() > sandbox.layers.len();
        assert!(
            layers.len() > usize::from(changed) && layers[usize::from(changed)..] == sandbox.layers[..],
            "layers of {id} (changed: {changed}) do not stack on the sandbox's {:?}: {rec}",
            sandbox.layers
        );
        // Not even a layer that is all recent entries read again stacks on
        // itself: overlayfs refuses a directory given twice.
        let distinct: BTreeSet<&String> = layers.iter().collect();
        assert_eq!(distinct.len(), layers.len(), "{id} lists a layer twice: {rec}");
        let small = touched
            .iter()
            .filter_map(|name| sandbox.files.get(name))
            .filter(|c| c.one_chunk())
            .map(|c| c.hash.clone())
            .collect();
        self.snaps.push(Snap {
            id,
            files: sandbox.files.clone(),
            own_layer: changed.then(|| layers[0].clone()),
            layers: layers.clone(),
            small,
        });
        let sandbox = &mut self.sandboxes[at];
        sandbox.layers = layers;
        sandbox.parent = Some(self.snaps.len() - 1);
        sandbox.snapshotted = true;
    }

    /// A new sandbox from the image (None) or a snapshot; returns its index.
    fn start(&mut self, from: Option<usize>, how: &str) -> usize {
        if self.sandboxes.len() >= MAX_SANDBOXES {
            let old = self.sandboxes.remove(0);
            self.home.ok(&["rm", "-f", &old.id]);
        }
        let (id, files, layers) = match from {
            None => (self.home.ok(&["create"]), Files::new(), self.image_layers.clone()),
            Some(s) => {
                let snap = &self.snaps[s];
                (self.home.ok(&[how, &snap.id]), snap.files.clone(), snap.layers.clone())
            }
        };
        let pid = init_pid(&self.home, &id);
        if from.is_none() {
            std::fs::create_dir(root(pid).join("data")).unwrap();
        }
        self.sandboxes.push(Sandbox {
            id,
            pid,
            files,
            layers,
            parent: from,
            snapshotted: false,
        });
        self.sandboxes.len() - 1
    }

    /// Writes, overwrites or deletes one file under the sandbox's /data.
    fn change(&mut self, at: usize, touched: &mut BTreeSet<String>) {
        let existing: Vec<String> = self.sandboxes[at].files.keys().cloned().collect();
        let roll = self.rng.below(100);
        if roll < 20 && !existing.is_empty() {
            let name = &existing[self.rng.below(existing.len())];
            std::fs::remove_file(root(self.sandboxes[at].pid).join("data").join(name)).unwrap();
            self.sandboxes[at].files.remove(name);
            return;
        }
        let (name, bytes) = if roll < 45 {
            // A variation of the large blob: a few changed 4 KiB runs, so
            // most of its content-defined chunks are shared with others.
            let mut bytes = self.big.clone();
            for _ in 0..1 + self.rng.below(3) {
                let at = self.rng.below(BIG_LEN - 4096);
                let run = self.rng.bytes(4096);
                bytes[at..at + 4096].copy_from_slice(&run);
            }
            (format!("big{}", self.rng.below(2)), bytes)
        } else {
            let bytes = if !self.pool.is_empty() && self.rng.percent(30) {
                self.pool[self.rng.below(self.pool.len())].clone()
            } else if self.rng.percent(5) {
                Vec::new()
            } else {
                let len = 1 + self.rng.below(SMALL_MAX);
                let bytes = self.rng.bytes(len);
                self.pool.push(bytes.clone());
                bytes
            };
            (format!("f{}", self.rng.below(6)), bytes)
        };
        std::fs::write(root(self.sandboxes[at].pid).join("data").join(&name), &bytes).unwrap();
        self.sandboxes[at].files.insert(name.clone(), Content::of(&bytes));
        touched.insert(name);
    }

    /// `cairn snapshot rm` on a random subset (at least one, not all);
    /// returns the model indexes of the survivors.
    fn delete_some(&mut self) -> Vec<usize> {
        let n = self.snaps.len();
        let mut deleted: BTreeSet<usize> = (0..n).filter(|_| self.rng.percent(45)).collect();
        if deleted.is_empty() {
            deleted.insert(self.rng.below(n));
        }
        if deleted.len() == n {
            let keep = self.rng.below(n);
            deleted.remove(&keep);
        }
        let ids: Vec<&str> = deleted.iter().map(|&i| self.snaps[i].id.as_str()).collect();
        let mut args = vec!["snapshot", "rm"];
        args.extend(&ids);
        let out = self.home.ok(&args);
        assert_eq!(out.lines().collect::<Vec<_>>(), ids, "what snapshot rm says it removed");
        let survivors: Vec<usize> = (0..n).filter(|i| !deleted.contains(i)).collect();
        // Only the snapshots named go: no refusal, no cascade to children.
        self.check_listing(&survivors, "after snapshot rm");
        survivors
    }

    fn collect_and_verify(&mut self, survivors: &[usize]) -> usize {
        for s in std::mem::take(&mut self.sandboxes) {
            self.home.ok(&["rm", "-f", &s.id]);
        }
        let live_layers: BTreeSet<&String> = survivors
            .iter()
            .flat_map(|&i| &self.snaps[i].layers)
            .chain(&self.image_layers)
            .collect();
        let dead_layers: BTreeSet<&String> = self
            .snaps
            .iter()
            .flat_map(|s| &s.layers)
            .filter(|l| !live_layers.contains(l))
            .collect();
        // A one-chunk content is live while a live layer holds it: a deleted
        // parent's layer stays live through its surviving descendants.
        let live_small: BTreeSet<&String> = self
            .snaps
            .iter()
            .filter(|s| s.own_layer.as_ref().is_some_and(|l| live_layers.contains(l)))
            .flat_map(|s| &s.small)
            .collect();
        let dead_small: BTreeSet<&String> = self
            .snaps
            .iter()
            .flat_map(|s| &s.small)
            .filter(|h| !live_small.contains(h))
            .collect();
        for h in self.snaps.iter().flat_map(|s| &s.small) {
            assert!(self.object(h).is_file(), "content {h} is not one stored chunk");
        }
        for l in &dead_layers {
            assert!(self.object(l).is_file(), "layer {l} is not in the store");
        }
        let before = self.objects();
        let report: serde_json::Value = serde_json::from_str(&self.home.ok(&["gc", "--json"])).unwrap();
        let after = self.objects();
        let removed = report["chunks_removed"].as_u64().unwrap();
        assert_eq!(
            before,
            after + removed,
            "objects in the store before and after gc: {report}"
        );
        let layers_removed: BTreeSet<&str> = report["layers_removed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap())
            .collect();
        assert_eq!(
            layers_removed,
            dead_layers.iter().map(|l| l.as_str()).collect(),
            "gc must remove exactly the layers no live snapshot or image uses"
        );
        for h in &live_small {
            assert!(
                self.object(h).is_file(),
                "gc deleted chunk {h}, which a live layer holds"
            );
        }
        for h in &dead_small {
            assert!(!self.object(h).exists(), "gc kept chunk {h}, which nothing live holds");
        }
        for l in &dead_layers {
            assert!(!self.object(l).exists(), "gc kept the index of dead layer {l}");
        }
        // The manifests of the deleted snapshots, the dead layers' indexes
        // and the one-chunk contents only they held, at least.
        let deleted = (self.snaps.len() - survivors.len()) as u64;
        let kept_for_children = (0..self.snaps.len())
            .filter(|i| !survivors.contains(i))
            .filter(|&i| {
                self.snaps[i]
                    .own_layer
                    .as_ref()
                    .is_some_and(|l| live_layers.contains(l))
            })
            .count();
        let floor = deleted + dead_layers.len() as u64 + dead_small.len() as u64;
        assert!(
            removed >= floor,
            "gc removed {removed} objects, fewer than the {floor} known dead: {report}"
        );
        self.check_listing(survivors, "after gc");

        // Another host: nothing materialised locally, every restore reads
        // its layers' chunks from the store.
        std::fs::remove_dir_all(self.home.path().join("layers")).unwrap();
        for &i in survivors {
            let snap = &self.snaps[i];
            let fork = self.home.ok(&["restore", &snap.id]);
            let seen = files_in(&root(init_pid(&self.home, &fork)).join("data"));
            assert_eq!(
                seen, snap.files,
                "snapshot {} restored with other files than it was taken with",
                snap.id
            );
            self.home.ok(&["rm", "-f", &fork]);
        }
        // Restores write nothing to the store: a second gc finds nothing.
        let again: serde_json::Value = serde_json::from_str(&self.home.ok(&["gc", "--json"])).unwrap();
        assert_eq!(again["chunks_removed"], 0, "a second gc still found garbage: {again}");
        eprintln!(
            "seed {:#x}: {} snapshots, {} deleted ({kept_for_children} of whose layers live on in children); \
             gc removed {} layers, {removed} objects ({} bytes)",
            self.seed,
            self.snaps.len(),
            deleted,
            dead_layers.len(),
            report["bytes_freed"]
        );
        kept_for_children
    }

    /// `cairn snapshots --json` lists exactly these model snapshots.
    fn check_listing(&self, expected: &[usize], when: &str) {
        let listed: serde_json::Value = serde_json::from_str(&self.home.ok(&["snapshots", "--json"])).unwrap();
        let listed: BTreeMap<String, Vec<String>> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["id"].as_str().unwrap().to_string(), strings(&s["layers"])))
            .collect();
        let model: BTreeMap<String, Vec<String>> = expected
            .iter()
            .map(|&i| (self.snaps[i].id.clone(), self.snaps[i].layers.clone()))
            .collect();
        assert_eq!(listed, model, "listed snapshots and their layers {when}");
    }

    /// Where the local store keeps an object.
    fn object(&self, hash: &str) -> PathBuf {
        self.home
            .path()
            .join("store/objects")
            .join(&hash[..2])
            .join(&hash[2..4])
            .join(hash)
    }

    /// Objects in the local store.
    fn objects(&self) -> u64 {
        let mut count = 0;
        let mut stack = vec![self.home.path().join("store/objects")];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else {
                    count += 1;
                }
            }
        }
        count
    }
}

/// A sandbox's root as the host sees it.
fn root(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root"))
}

/// The regular files directly under `dir`.
fn files_in(dir: &Path) -> Files {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| {
            assert!(e.file_type().unwrap().is_file(), "{:?} is not a file", e.path());
            let bytes = std::fs::read(e.path()).unwrap();
            (e.file_name().to_string_lossy().into_owned(), Content::of(&bytes))
        })
        .collect()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}
