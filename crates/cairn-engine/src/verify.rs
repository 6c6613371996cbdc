//! `cairn verify`: every object a snapshot reaches, read back from each
//! place it is stored and hashed again. A snapshot's id is the BLAKE3 of
//! its manifest object, which names its layers by the hash of their index
//! roots, which name their segments and every file chunk by hash, as the
//! manifest names its memory image's chunks: the id is the root of a hash
//! tree over everything the snapshot holds, so checking every object
//! against its own hash checks the snapshot against its id.

use std::collections::HashMap;
use std::time::Instant;

use cairn_layers::archive::{EntryKind, IndexRoot, IndexSegment, LayerId};
use cairn_store::{ChunkHash, CopyState, ObjectCheck, ReadContext};
use rayon::prelude::*;
use serde::Serialize;

use crate::snapshots::SnapshotError;
use crate::state::SnapshotRecord;
use crate::{Engine, EngineError};

/// One object found damaged.
#[derive(Debug, Clone, Serialize)]
pub struct Damage {
    pub hash: String,
    /// What it is: the manifest, a layer's index, a file's chunk (with the
    /// path and offset), a memory image file's chunk.
    pub what: String,
    /// The local store's copy (or the cache's, in front of S3).
    pub local: String,
    /// The bucket's copy, with a store in S3.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    /// With `--repair`: what was done, or why nothing could be.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repair: Option<String>,
    /// Whether an intact copy exists now.
    pub recoverable: bool,
    /// Whether `--repair` mended every damaged copy.
    #[serde(skip)]
    pub repaired: bool,
}

/// One snapshot's check.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    pub snapshot_id: String,
    /// The root hash: the snapshot id, which every object below hashes up to.
    pub root_hash: String,
    /// Objects checked (each counted once per snapshot).
    pub objects: u64,
    /// Stored bytes read back, every copy counted.
    pub bytes_read: u64,
    pub damaged: Vec<Damage>,
    /// Parts whose own objects could not be read, so what they reach was
    /// not listed (a layer whose index is lost, say).
    pub unreadable: Vec<String>,
    /// No object damaged (after `--repair`: every damaged copy mended) and
    /// nothing unreadable.
    pub ok: bool,
    pub took_ms: f64,
}

/// Objects already checked in this verification (shared between snapshots).
/// Each object's check and, with `--repair` on a damaged one, what was
/// done (`Ok`) or why nothing could be (`Err`).
type Repair = Option<Result<String, String>>;
type Checked = HashMap<ChunkHash, (ObjectCheck, Repair)>;

impl Engine {
    /// Checks the snapshots `keys` (every snapshot when empty): each object
    /// each reaches, from every place it is stored; with `repair`, mends
    /// damaged copies from intact ones (with a store in S3). `done` hears
    /// of each snapshot as it is finished (its index, the count, its report).
    pub fn verify_snapshots(
        &self,
        keys: &[String],
        repair: bool,
        done: &dyn Fn(usize, usize, &Verification),
    ) -> Result<Vec<Verification>, EngineError> {
        // Shared: a collection waits, so nothing goes while it is read.
        let _lock = self.lock_store(false)?;
        let snaps: Vec<SnapshotRecord> = if keys.is_empty() {
            self.snapshots()?
        } else {
            keys.iter().map(|k| self.snapshot_record(k)).collect::<Result<_, _>>()?
        };
        let mut checked = Checked::new();
        let mut out = Vec::with_capacity(snaps.len());
        for (i, snap) in snaps.iter().enumerate() {
            let v = self.verify_one(snap, repair, &mut checked)?;
            done(i, snaps.len(), &v);
            out.push(v);
        }
        Ok(out)
    }

    fn verify_one(
        &self,
        snap: &SnapshotRecord,
        repair: bool,
        checked: &mut Checked,
    ) -> Result<Verification, EngineError> {
        let started = Instant::now();
        let root: ChunkHash = snap.id.parse().map_err(|_| SnapshotError::NotFound(snap.id.clone()))?;
        let mut report = Verification {
            snapshot_id: snap.id.clone(),
            root_hash: snap.id.clone(),
            objects: 0,
            bytes_read: 0,
            damaged: Vec::new(),
            unreadable: Vec::new(),
            ok: true,
            took_ms: 0.0,
        };
        let mut names: Vec<(ChunkHash, String)> = Vec::new();
        // The tree, level by level: each object is checked (and mended)
        // before it is read for what it names.
        if self.check_level(
            &[(root, "the snapshot's manifest".into())],
            repair,
            checked,
            &mut report,
        )? {
            let manifest = self.manifest(snap)?;
            let mut roots = Vec::new();
            for l in &manifest.layers {
                roots.push((*l.as_hash(), format!("layer {}: its index", l.as_hash().short())));
            }
            self.check_level(&roots, repair, checked, &mut report)?;
            for l in &manifest.layers {
                if checked.get(l.as_hash()).is_some_and(|(c, _)| !intact_somewhere(c)) {
                    report
                        .unreadable
                        .push(format!("layer {}: its index is lost", l.as_hash().short()));
                } else {
                    self.layer_names(l, repair, checked, &mut report, &mut names)?;
                }
            }
            if let Some(memory) = &manifest.memory {
                for f in &memory.files {
                    for c in &f.content.chunks {
                        names.push((c.hash, format!("memory image {}: chunk at {}", f.name, c.offset)));
                    }
                }
            }
        } else {
            report
                .unreadable
                .push("the manifest is lost: nothing below it could be listed".into());
        }
        self.check_level(&names, repair, checked, &mut report)?;
        report.damaged.sort_by(|a, b| a.what.cmp(&b.what));
        report.ok = report.unreadable.is_empty() && report.damaged.iter().all(|d| d.repaired);
        report.took_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(report)
    }

    /// The objects of layer `l` below its root (its segments, checked) and
    /// each file chunk its entries name, into `names`.
    fn layer_names(
        &self,
        l: &LayerId,
        repair: bool,
        checked: &mut Checked,
        report: &mut Verification,
        names: &mut Vec<(ChunkHash, String)>,
    ) -> Result<(), EngineError> {
        let context = ReadContext::new().owner("layer", *l.as_hash());
        let root: IndexRoot = match self.store.get_object(l.as_hash(), &context) {
            Ok(r) => r,
            Err(e) => {
                report
                    .unreadable
                    .push(format!("layer {}: its index cannot be read: {e}", l.as_hash().short()));
                return Ok(());
            }
        };
        let mut entries = root.entries;
        let segments: Vec<(ChunkHash, String)> = root
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (
                    s.hash,
                    format!("layer {}: index segment {}", l.as_hash().short(), i + 1),
                )
            })
            .collect();
        self.check_level(&segments, repair, checked, report)?;
        for (hash, what) in &segments {
            match self.store.get_object::<IndexSegment>(hash, &context) {
                Ok(s) => entries.extend(s.entries),
                Err(e) => report.unreadable.push(format!("{what} cannot be read: {e}")),
            }
        }
        for e in &entries {
            if let EntryKind::File(content) = &e.kind {
                for c in &content.chunks {
                    names.push((
                        c.hash,
                        format!(
                            "layer {}: {} at {}",
                            l.as_hash().short(),
                            e.path.display_path().display(),
                            c.offset
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks each object of `objects` not checked yet, on every core,
    /// mending with `repair`; records the damaged ones. True when every one
    /// has an intact copy (its parent can be read for what it names).
    fn check_level(
        &self,
        objects: &[(ChunkHash, String)],
        repair: bool,
        checked: &mut Checked,
        report: &mut Verification,
    ) -> Result<bool, EngineError> {
        let mut first: HashMap<ChunkHash, &str> = HashMap::new();
        for (h, what) in objects {
            first.entry(*h).or_insert(what);
        }
        let todo: Vec<ChunkHash> = first.keys().filter(|h| !checked.contains_key(h)).copied().collect();
        let backend = self.store.backend();
        let results: Vec<(ChunkHash, ObjectCheck, Repair)> = todo
            .par_iter()
            .map(|h| {
                let check = backend.check_object(h)?;
                let mut done = None;
                if repair && check.is_damaged() {
                    done = Some(
                        backend
                            .repair_object(h, &check)?
                            .ok_or_else(|| "not repaired: no intact copy".to_string()),
                    );
                }
                Ok((*h, check, done))
            })
            .collect::<Result<_, cairn_store::BlobError>>()
            .map_err(|e| EngineError::from(SnapshotError::from(cairn_store::StoreError::from(e))))?;
        for (h, check, done) in results {
            report.bytes_read += check.bytes_read;
            checked.insert(h, (check, done));
        }
        let mut all_readable = true;
        for (h, what) in first {
            report.objects += 1;
            let (check, done) = &checked[&h];
            if !intact_somewhere(check) {
                all_readable = false;
            }
            if check.is_damaged() {
                report.damaged.push(Damage {
                    hash: h.to_hex(),
                    what: what.to_string(),
                    local: check.local.describe(),
                    remote: check.remote.as_ref().map(CopyState::describe),
                    repair: done.clone().map(|r| r.unwrap_or_else(|why| why)),
                    repaired: matches!(done, Some(Ok(_))),
                    recoverable: intact_somewhere(check),
                });
            }
        }
        Ok(all_readable)
    }
}

/// Whether some copy of the object is intact.
fn intact_somewhere(c: &ObjectCheck) -> bool {
    c.local == CopyState::Intact || c.remote == Some(CopyState::Intact)
}
