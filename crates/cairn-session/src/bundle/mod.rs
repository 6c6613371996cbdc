//! Session export and import: one file holding a session's whole log (the
//! hash chain `verify` walks, its lineage's entries up to each fork point,
//! abandoned entries included, and the rewinds that apply), its large
//! payloads, and every snapshot its log names with every chunk-store object
//! a restore reads. Another state directory imports it as a root session,
//! suspended, that shows the same live log (seqs and hashes) and resumes.
//!
//! The file (docs/formats.md, "Session bundle"): `CAIRNSES`, a u32 format
//! version, then a tar stream of `manifest` (a framed [`BundleManifest`]),
//! `entries/NNNNNN` (framed [`EntryBatch`]es) and `objects/<hash>` (each a
//! chunk as the store keeps it: one zstd frame of content hashing to its
//! name), in that order. Import treats it as hostile: every length is
//! capped, every object is checked against its hash before it is stored,
//! the chain is verified before anything is stored, and the rows go in in
//! one transaction only once every object a restore needs is in the store.

mod format;
mod read;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use cairn_store::{BlobStore, ChunkHash, ReadContext, MAX_OBJECT};
use serde::Serialize;

use self::format::{check_chain, io_err, BATCH_ENTRIES, BATCH_TEXT};
pub use self::format::{
    BundleEntry, BundleError, BundleImage, BundleManifest, BundleRewind, BundleSession, BundleSnapshot, EntryBatch,
    BUNDLE_MAGIC, BUNDLE_VERSION, MAX_ENTRIES, MAX_LOG_BYTES, MAX_OBJECTS, MAX_REWINDS, MAX_SNAPSHOTS,
};
use self::read::{check_entries, read_entries, read_header, read_manifest, Members};
use super::log::Segment;
use super::ops::{new_session_id, valid_name};
use super::{Entry, EntryKind, Rewind, SessionError, SessionRecord, SessionState};
use crate::prelude::*;
use crate::steps::*;
use cairn_engine::sandboxes::me;
use cairn_engine::state::StateError;
use cairn_engine::{Engine, EngineError, ImageRecord, Progress, SandboxState, SnapshotManifest, SnapshotRecord};

/// What an export wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportSummary {
    pub session: String,
    /// The snapshot taken of an active session's sandbox first.
    pub snapshot_taken: Option<String>,
    pub entries: u64,
    pub snapshots: usize,
    pub objects: usize,
    /// Bytes of objects (compressed, as stored).
    pub object_bytes: u64,
}

/// What an import recorded.
#[derive(Debug, Clone, Serialize)]
pub struct ImportSummary {
    pub session: SessionRecord,
    /// The session's id where it was exported.
    pub source_id: String,
    pub entries: u64,
    pub snapshots: usize,
    pub objects: usize,
    /// Objects this store did not hold yet.
    pub objects_new: usize,
    /// Why the bundle's image was not recorded, if it was not.
    pub image_note: Option<String>,
}

/// Progress at most once a second.
struct Ticker<'a> {
    progress: &'a dyn Progress,
    last: Option<Instant>,
}

impl Ticker<'_> {
    fn tick(&mut self, message: impl FnOnce() -> String) {
        if self.last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            self.progress.step(&message());
            self.last = Some(Instant::now());
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn append_member(
    tar: &mut tar::Builder<&mut dyn Write>,
    name: &str,
    data: &[u8],
    mtime: u64,
) -> Result<(), BundleError> {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(mtime);
    tar.append_data(&mut header, name, data)
        .map_err(io_err("write the bundle"))
}

/// Sessions exported to a bundle and imported from one.
pub trait SessionBundles {
    /// Writes a session as one bundle (module docs). An active session's
    /// sandbox is snapshotted first and the snapshot recorded in its log (a
    /// `note`), so the bundle holds the machine as it is now.
    fn export_session(
        &mut self,
        key: &str,
        out: &mut dyn Write,
        progress: &dyn Progress,
    ) -> Result<ExportSummary, EngineError>;

    /// Records the session a bundle holds as a new root session, suspended,
    /// named `name` or as it was. Nothing is recorded unless all of it is:
    /// objects are stored (under the shared store lock, so the collector
    /// leaves them) only after the chain verified, and the rows go in in
    /// one transaction once every object a restore needs is in the store.
    /// A failed import can leave objects no row names; `cairn gc` removes
    /// them.
    fn import_session(
        &mut self,
        input: &mut dyn Read,
        name: Option<String>,
        progress: &dyn Progress,
    ) -> Result<ImportSummary, EngineError>;
}

impl SessionBundles for Engine {
    fn export_session(
        &mut self,
        key: &str,
        out: &mut dyn Write,
        progress: &dyn Progress,
    ) -> Result<ExportSummary, EngineError> {
        let id = self.session(key)?.id;
        // Held shared: the session is not suspended or closed while its
        // sandbox is snapshotted and its log read.
        let _held = self
            .lock_session(&id, false, true)?
            .ok_or_else(|| SessionError::Busy(id.clone()))?;
        let mut s = self.session(&id)?;
        if matches!(s.state, SessionState::Suspending | SessionState::Resuming) {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "another command is moving it; wait for it (or `cairn session resume` it if that command died)",
            }
            .into());
        }
        let snapshot_taken = self.snapshot_for_export(&s, progress)?;
        if snapshot_taken.is_some() {
            s = self.session(&s.id)?;
        }
        progress.step(&format!("reading session {}'s log", s.id));
        let (manifest, entries) = self.bundle_contents(&s)?;
        let object_bytes = self.write_bundle(&manifest, &entries, out, progress)?;
        Ok(ExportSummary {
            session: s.id,
            snapshot_taken,
            entries: manifest.entries,
            snapshots: manifest.snapshots.len(),
            objects: manifest.objects.len(),
            object_bytes,
        })
    }

    fn import_session(
        &mut self,
        input: &mut dyn Read,
        name: Option<String>,
        progress: &dyn Progress,
    ) -> Result<ImportSummary, EngineError> {
        read_header(input)?;
        let mut archive = tar::Archive::new(input);
        // Raw: GNU long names and pax headers are not merged into the next
        // member (the writer never makes them), so they are refused as
        // members of the wrong type instead of being read whole.
        let mut members = Members {
            inner: archive
                .entries()
                .map_err(|e| BundleError::Malformed(e.to_string()))?
                .raw(true),
        };
        progress.step("reading the bundle's manifest and log");
        let m = read_manifest(&mut members)?;
        let name = self.qualified(name.unwrap_or_else(|| m.session.name.clone()));
        if !valid_name(&name) {
            return Err(SessionError::BadName(name).into());
        }
        if self.db().find_sessions(&name)?.iter().any(|r| r.name == name) {
            return Err(SessionError::NameTaken(name).into());
        }
        let entries = read_entries(&mut members, &m)?;
        let payloads = check_entries(&m, &entries)?;

        // The shared store lock keeps the collector off the objects until
        // the rows that name them are committed.
        let _lock = self.lock_store(false)?;
        let objects_new = self.store_objects(&mut members, &m.objects, progress)?;
        members.end()?;
        progress.step("checking every snapshot and payload is whole");
        let snapshots = self.imported_snapshots(&m)?;
        let image = m.image.as_ref().map(|i| ImageRecord {
            name: i.name.clone(),
            source: i.source.clone(),
            size_bytes: i.size_bytes,
            created_at: i.created_at,
            layers: i.layers.iter().map(ToString::to_string).collect(),
            config: None,
        });
        self.check_whole(&m.objects, &snapshots, image.as_ref(), &payloads)?;

        progress.step("recording the session");
        let s = &m.session;
        let owner = me();
        let rec = SessionRecord {
            id: new_session_id(),
            name,
            state: SessionState::Suspended,
            image: s.image.clone(),
            driver: s.driver.clone(),
            // A bundle carries no network: what a session may reach is the
            // importing host's to grant.
            network: None,
            sandbox_id: None,
            snapshot_id: s.snapshot_id.clone(),
            snapshot_seq: s.snapshot_seq,
            idle_timeout_ms: s.idle_timeout_ms,
            parent_id: None,
            fork_seq: None,
            fork_reason: None,
            fork_rewinds: 0,
            head_seq: s.head_seq,
            head_hash: s.head_hash.clone(),
            rewinds: m.rewinds.len() as u64,
            owner_pid: owner.0,
            owner_start: owner.1,
            error: None,
            created_at: s.created_at,
            updated_at: cairn_engine::now_ms(),
        };
        let rewinds: Vec<Rewind> = (m.rewinds.iter().enumerate())
            .map(|(n, r)| Rewind {
                n: n as u64 + 1,
                to_seq: r.to_seq,
                head_seq: r.head_seq,
                created_at: r.created_at,
            })
            .collect();
        let image_added = self
            .db()
            .import_session_rows(&rec, &entries, &rewinds, &snapshots, image.as_ref())
            .map_err(|e| match e {
                StateError::NameTaken(n) => EngineError::from(SessionError::NameTaken(n)),
                other => other.into(),
            })?;
        let image_note = match (&image, image_added) {
            (None, _) => Some(format!(
                "the bundle holds no image {:?}; a fork before the first snapshot needs one here",
                s.image
            )),
            (Some(i), false) if self.db().image(&i.name)?.is_some_and(|here| here.layers != i.layers) => Some(format!(
                "image {:?} here differs from the exported one; kept this one (snapshots carry their own layers)",
                i.name
            )),
            _ => None,
        };
        Ok(ImportSummary {
            session: rec,
            source_id: s.source_id.clone(),
            entries: m.entries,
            snapshots: snapshots.len(),
            objects: m.objects.len(),
            objects_new,
            image_note,
        })
    }
}

pub(crate) trait BundleSteps {
    /// Snapshots an active session's sandbox and records the snapshot in
    /// its log, as suspend does; None when it has no sandbox to snapshot.
    fn snapshot_for_export(
        &mut self,
        s: &SessionRecord,
        progress: &dyn Progress,
    ) -> Result<Option<String>, EngineError>;

    /// The manifest and the entries of a session's bundle: the whole chain,
    /// the rewinds its live log applies, every snapshot it names, its image
    /// and every object those reach.
    fn bundle_contents(&self, s: &SessionRecord) -> Result<(BundleManifest, Vec<Entry>), EngineError>;

    /// Writes the header and the members; returns the objects' bytes.
    fn write_bundle(
        &self,
        manifest: &BundleManifest,
        entries: &[Entry],
        out: &mut dyn Write,
        progress: &dyn Progress,
    ) -> Result<u64, EngineError>;

    /// Every row of the chain `verify_session` walks, in order.
    fn chain_entries(&self, segments: &[Segment]) -> Result<Vec<Entry>, EngineError>;

    /// Stores the objects the manifest lists, each checked against its
    /// name first; returns how many the store did not hold.
    fn store_objects(
        &self,
        members: &mut Members<'_, &mut dyn Read>,
        objects: &[ChunkHash],
        progress: &dyn Progress,
    ) -> Result<usize, EngineError>;

    /// The bundle's snapshots as records made from their stored manifests
    /// (content-addressed), not from the bundle's word.
    fn imported_snapshots(&self, m: &BundleManifest) -> Result<Vec<SnapshotRecord>, EngineError>;

    /// Every object the snapshots, the image and the payloads reach (the
    /// collector's walk) is in the store.
    fn check_whole(
        &self,
        listed: &[ChunkHash],
        snapshots: &[SnapshotRecord],
        image: Option<&ImageRecord>,
        payloads: &HashSet<String>,
    ) -> Result<(), EngineError>;
}

impl BundleSteps for Engine {
    fn snapshot_for_export(
        &mut self,
        s: &SessionRecord,
        progress: &dyn Progress,
    ) -> Result<Option<String>, EngineError> {
        if s.state != SessionState::Active {
            return Ok(None);
        }
        let sandbox = s
            .sandbox_id
            .as_deref()
            .and_then(|id| self.sandbox(id).ok().filter(|r| r.id == id))
            .filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Exited));
        let Some(sandbox) = sandbox else { return Ok(None) };
        progress.step(&format!("snapshotting session {}'s sandbox {}", s.id, sandbox.id));
        let snap = self.snapshot(&sandbox, None)?;
        let mut note = Entry::new(EntryKind::Note);
        note.content = Some(format!("exported: snapshot {}", snap.id));
        note.snapshot_id = Some(snap.id.clone());
        self.session_append(s, note)?;
        Ok(Some(snap.id))
    }

    fn bundle_contents(&self, s: &SessionRecord) -> Result<(BundleManifest, Vec<Entry>), EngineError> {
        let (segments, hidden) = self.lineage(s)?;
        let entries = self.chain_entries(&segments)?;
        check_chain(&entries, s.head_seq, &s.head_hash).map_err(|reason| BundleError::SourceLog {
            id: s.id.clone(),
            reason,
        })?;
        // The ranges the live log hides, each dated by the rewind it came from.
        let mut recorded = Vec::new();
        for seg in &segments {
            recorded.extend(self.db().rewinds(&seg.session)?);
        }
        let mut rewinds: Vec<BundleRewind> = hidden
            .iter()
            .map(|&(to_seq, head_seq)| BundleRewind {
                to_seq,
                head_seq,
                created_at: recorded
                    .iter()
                    .find(|r| r.to_seq == to_seq && r.head_seq >= head_seq)
                    .map_or(s.updated_at, |r| r.created_at),
            })
            .collect();
        rewinds.sort_by_key(|r| (r.created_at, r.to_seq));

        let mut snapshots: Vec<SnapshotRecord> = Vec::new();
        for id in entries
            .iter()
            .filter_map(|e| e.snapshot_id.as_ref())
            .chain(s.snapshot_id.as_ref())
        {
            if snapshots.iter().any(|r| r.id == *id) {
                continue;
            }
            let missing = || BundleError::SourceSnapshot {
                id: s.id.clone(),
                snapshot: id.clone(),
            };
            let found = self.db().find_snapshots(id)?.into_iter().find(|r| r.id == *id);
            let found = found
                .filter(|r| r.id.parse::<ChunkHash>().is_ok())
                .ok_or_else(missing)?;
            snapshots.push(found);
        }
        let image = self.db().image(&s.image)?;
        let mut layers: HashSet<String> = snapshots.iter().flat_map(|r| r.layers.iter().cloned()).collect();
        layers.extend(image.iter().flat_map(|i| i.layers.iter().cloned()));
        let payloads: HashSet<String> = entries
            .iter()
            .flat_map(|e| [e.content_ref.clone(), e.result_ref.clone()])
            .flatten()
            .collect();
        let mut seen = HashSet::new();
        let objects: Vec<ChunkHash> = self
            .reachable_objects(&layers, &snapshots, &payloads)?
            .into_iter()
            .filter(|h| seen.insert(*h))
            .collect();
        let image = match image {
            None => None,
            Some(i) => Some(BundleImage {
                layers: i
                    .layers
                    .iter()
                    .map(|l| cairn_engine::layer_id(l))
                    .collect::<Result<_, _>>()?,
                name: i.name,
                source: i.source,
                size_bytes: i.size_bytes,
                created_at: i.created_at,
            }),
        };
        let manifest = BundleManifest {
            exported_at: cairn_engine::now_ms(),
            session: BundleSession {
                source_id: s.id.clone(),
                name: s.name.clone(),
                image: s.image.clone(),
                driver: s.driver.clone(),
                snapshot_id: s.snapshot_id.clone(),
                snapshot_seq: s.snapshot_seq,
                idle_timeout_ms: s.idle_timeout_ms,
                head_seq: s.head_seq,
                head_hash: s.head_hash.clone(),
                created_at: s.created_at,
            },
            entries: entries.len() as u64,
            rewinds,
            snapshots: snapshots
                .iter()
                .filter_map(|r| {
                    Some(BundleSnapshot {
                        id: r.id.parse().ok()?,
                        new_bytes: r.new_bytes,
                        stored_bytes: r.stored_bytes,
                    })
                })
                .collect(),
            image,
            objects,
        };
        Ok((manifest, entries))
    }

    fn write_bundle(
        &self,
        manifest: &BundleManifest,
        entries: &[Entry],
        out: &mut dyn Write,
        progress: &dyn Progress,
    ) -> Result<u64, EngineError> {
        let mtime = (manifest.exported_at / 1000).max(0) as u64;
        out.write_all(&BUNDLE_MAGIC)
            .and_then(|()| out.write_all(&BUNDLE_VERSION.to_le_bytes()))
            .map_err(io_err("write the bundle"))?;
        let mut tar = tar::Builder::new(out);
        let framed =
            cairn_store::frame::encode(manifest).map_err(|e| BundleError::OverCap(format!("the manifest: {e}")))?;
        append_member(&mut tar, "manifest", &framed, mtime)?;
        for (n, batch) in batches(entries).into_iter().enumerate() {
            let batch = EntryBatch {
                entries: batch.iter().map(BundleEntry::from).collect(),
            };
            let framed =
                cairn_store::frame::encode(&batch).map_err(|e| BundleError::OverCap(format!("entries: {e}")))?;
            append_member(&mut tar, &format!("entries/{:06}", n + 1), &framed, mtime)?;
        }
        let mut ticker = Ticker { progress, last: None };
        let mut bytes = 0u64;
        let total = manifest.objects.len();
        for (i, hash) in manifest.objects.iter().enumerate() {
            ticker.tick(|| format!("writing objects: {i} of {total} ({})", mib(bytes)));
            let stored = self
                .store()
                .backend()
                .get(hash)
                .map_err(cairn_engine::SnapshotError::from)?;
            // A chunk corrupt here would be refused by the import: say so now.
            cairn_store::decode_chunk(hash, &stored, MAX_OBJECT).map_err(|e| {
                cairn_engine::SnapshotError::from(cairn_store::StoreError::ChunkCorrupt {
                    hash: *hash,
                    context: Box::new(ReadContext::new()),
                    reason: e.to_string(),
                })
            })?;
            bytes += stored.len() as u64;
            append_member(&mut tar, &format!("objects/{hash}"), &stored, mtime)?;
        }
        tar.into_inner()
            .and_then(|out| out.flush())
            .map_err(io_err("write the bundle"))?;
        Ok(bytes)
    }

    fn chain_entries(&self, segments: &[Segment]) -> Result<Vec<Entry>, EngineError> {
        let mut out = Vec::new();
        let mut next = 1u64;
        for seg in segments {
            loop {
                let rows = self.db().raw_entries(seg, next, 1000)?;
                let Some(last) = rows.last() else { break };
                next = last.seq + 1;
                out.extend(rows);
            }
        }
        Ok(out)
    }

    fn store_objects(
        &self,
        members: &mut Members<'_, &mut dyn Read>,
        objects: &[ChunkHash],
        progress: &dyn Progress,
    ) -> Result<usize, EngineError> {
        let total = objects.len();
        let mut ticker = Ticker { progress, last: None };
        let (mut bytes, mut new) = (0u64, 0usize);
        for (i, hash) in objects.iter().enumerate() {
            ticker.tick(|| format!("storing objects: {i} of {total} ({})", mib(bytes)));
            let what = format!("object {} of {total} ({hash})", i + 1);
            let stored = members.next(&what, &format!("objects/{hash}"), MAX_OBJECT)?;
            cairn_store::decode_chunk(hash, &stored, MAX_OBJECT).map_err(|e| BundleError::Corrupt {
                hash: *hash,
                reason: e.to_string(),
            })?;
            bytes += stored.len() as u64;
            let outcome = self
                .store()
                .backend()
                .put(hash, &stored)
                .map_err(cairn_engine::SnapshotError::from)?;
            new += usize::from(outcome == cairn_store::PutOutcome::Stored);
        }
        Ok(new)
    }

    fn imported_snapshots(&self, m: &BundleManifest) -> Result<Vec<SnapshotRecord>, EngineError> {
        let mut out = Vec::with_capacity(m.snapshots.len());
        for b in &m.snapshots {
            let context = ReadContext::new().owner("snapshot", b.id);
            let manifest: SnapshotManifest = self.store().get_object(&b.id, &context).map_err(|e| match e {
                cairn_store::StoreError::ChunkMissing { .. } => BundleError::Missing {
                    hash: b.id,
                    owner: format!("snapshot {}", b.id),
                },
                other => BundleError::Malformed(format!("snapshot {}: {other}", b.id)),
            })?;
            manifest
                .validate()
                .map_err(|reason| BundleError::Malformed(format!("snapshot {}: {reason}", b.id)))?;
            out.push(SnapshotRecord {
                id: b.id.to_string(),
                parent_id: manifest.parent.map(|p| p.to_string()),
                sandbox_id: manifest.sandbox.clone(),
                image: manifest.image.clone(),
                driver: manifest.driver.clone(),
                label: manifest.label.clone(),
                created_at: manifest.created_at_ms,
                new_bytes: b.new_bytes,
                stored_bytes: b.stored_bytes,
                layers: manifest.layers.iter().map(ToString::to_string).collect(),
            });
        }
        Ok(out)
    }

    fn check_whole(
        &self,
        listed: &[ChunkHash],
        snapshots: &[SnapshotRecord],
        image: Option<&ImageRecord>,
        payloads: &HashSet<String>,
    ) -> Result<(), EngineError> {
        let mut layers: HashSet<String> = snapshots.iter().flat_map(|r| r.layers.iter().cloned()).collect();
        layers.extend(image.iter().flat_map(|i| i.layers.iter().cloned()));
        let listed: HashSet<ChunkHash> = listed.iter().copied().collect();
        let reachable = self.reachable_objects(&layers, snapshots, payloads).map_err(|e| {
            BundleError::Malformed(format!("a snapshot, layer or payload it holds cannot be read: {e}"))
        })?;
        for hash in reachable {
            if !listed.contains(&hash)
                && !self
                    .store()
                    .backend()
                    .contains(&hash)
                    .map_err(cairn_engine::SnapshotError::from)?
            {
                return Err(BundleError::Missing {
                    hash,
                    owner: "a snapshot or payload".into(),
                }
                .into());
            }
        }
        Ok(())
    }
}

/// The entries cut into batches of at most [`BATCH_ENTRIES`] entries and
/// about [`BATCH_TEXT`] bytes of text (a longer entry goes alone).
fn batches(entries: &[Entry]) -> Vec<&[Entry]> {
    let text = |e: &Entry| {
        [&e.role, &e.content, &e.tool, &e.arguments, &e.result]
            .into_iter()
            .flatten()
            .map(String::len)
            .sum::<usize>()
    };
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, e) in entries.iter().enumerate() {
        if i > start && (i - start == BATCH_ENTRIES || bytes + text(e) > BATCH_TEXT) {
            out.push(&entries[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += text(e);
    }
    if start < entries.len() {
        out.push(&entries[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: usize) -> Entry {
        let mut e = Entry::new(EntryKind::User);
        e.content = Some("x".repeat(text));
        e
    }

    #[test]
    fn batches_hold_at_most_their_count_and_about_their_bytes() {
        let small: Vec<Entry> = (0..1200).map(|_| entry(10)).collect();
        let sizes: Vec<usize> = batches(&small).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, [512, 512, 176]);
        let large: Vec<Entry> = (0..3).map(|_| entry(BATCH_TEXT / 2 + 1)).collect();
        let sizes: Vec<usize> = batches(&large).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, [1, 1, 1]);
        let huge = vec![entry(10), entry(BATCH_TEXT * 2), entry(10)];
        let sizes: Vec<usize> = batches(&huge).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, [1, 1, 1], "an entry over the bytes goes alone");
        assert!(batches(&[]).is_empty());
    }
}
