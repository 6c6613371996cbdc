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

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use cairn_layers::LayerId;
use cairn_store::{BlobStore, ChunkHash, Framed, ReadContext, MAX_OBJECT};
use serde::{Deserialize, Serialize};

use super::log::{insert_entry_row, Segment};
use super::ops::{new_session_id, valid_name};
use super::{insert_session_row, Entry, EntryKind, SessionError, SessionRecord, SessionState, ENTRY_VERSION, GENESIS};
use crate::sandboxes::me;
use crate::state::{insert_image_rows, insert_snapshot_rows, params, BackendError, Db, StateError};
use crate::{Engine, EngineError, ImageRecord, Progress, SandboxState, SnapshotManifest, SnapshotRecord};

/// The first bytes of every session bundle.
pub const BUNDLE_MAGIC: [u8; 8] = *b"CAIRNSES";
/// The bundle layout's version, independent of the frames inside it.
pub const BUNDLE_VERSION: u32 = 1;
/// At most this many entries (the whole chain).
pub const MAX_ENTRIES: u64 = 4 << 20;
/// At most this many bytes of entry batches in all (payloads above 64 KiB
/// are objects, not entry bytes).
pub const MAX_LOG_BYTES: u64 = 1 << 30;
/// At most this many chunk-store objects.
pub const MAX_OBJECTS: usize = 4 << 20;
/// At most this many snapshots and rewinds.
pub const MAX_SNAPSHOTS: usize = 1 << 16;
pub const MAX_REWINDS: usize = 1 << 20;
/// Entries per batch the writer puts in one member.
const BATCH: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot {action}: {source}")]
    Io {
        action: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("this is not a Cairn session bundle (it does not start with CAIRNSES); give a file `cairn session export` wrote")]
    NotABundle,
    #[error("the bundle is format version {found}; this build reads version {known}: upgrade Cairn")]
    FutureVersion { found: u32, known: u32 },
    #[error("the bundle is format version {0}, which no Cairn wrote; the file is damaged, export it again")]
    UnknownVersion(u32),
    #[error("the bundle ends before {0}: it is truncated; copy or export it again (nothing was imported)")]
    Truncated(String),
    #[error("the bundle is malformed: {0}; it is damaged or was not written by Cairn, so export it again (nothing was imported)")]
    Malformed(String),
    #[error("the bundle is over a cap: {0} (docs/formats.md, \"Session bundle\"); nothing was imported")]
    OverCap(String),
    #[error("object {hash} in the bundle is corrupt: {reason}; the file was damaged after export, so copy or export it again (nothing was imported)")]
    Corrupt { hash: ChunkHash, reason: String },
    #[error("the bundle's log does not verify: {0}; it was changed after export, so nothing was imported")]
    Chain(String),
    #[error("the bundle lacks object {hash}, which {owner} needs; it is incomplete, so export it again (nothing was imported)")]
    Missing { hash: ChunkHash, owner: String },
    #[error("session {id}'s log does not verify ({reason}); `cairn session verify {id}` names the entry, and a bundle of it would not import")]
    SourceLog { id: String, reason: String },
    #[error("snapshot {snapshot} that session {id}'s log names is not in this state directory; the session cannot be exported whole")]
    SourceSnapshot { id: String, snapshot: String },
}

fn io_err(action: &'static str) -> impl FnOnce(io::Error) -> BundleError {
    move |source| BundleError::Io { action, source }
}

/// What the bundle says about the session, besides its log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BundleSession {
    /// Its id where it was exported (the import gets a new one).
    pub source_id: String,
    pub name: String,
    pub image: String,
    pub driver: String,
    pub snapshot_id: Option<String>,
    pub snapshot_seq: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub head_seq: u64,
    pub head_hash: String,
    pub created_at: i64,
}

/// A branch point: entries `to_seq < seq <= head_seq` are off the live log.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct BundleRewind {
    pub to_seq: u64,
    pub head_seq: u64,
    pub created_at: i64,
}

/// A snapshot: its manifest (an object in the bundle) says the rest.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct BundleSnapshot {
    pub id: ChunkHash,
    pub new_bytes: u64,
    pub stored_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BundleImage {
    pub name: String,
    pub source: String,
    pub size_bytes: u64,
    pub created_at: i64,
    /// Topmost first.
    pub layers: Vec<LayerId>,
}

/// The bundle's first member.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BundleManifest {
    pub exported_at: i64,
    pub session: BundleSession,
    /// How many entries the `entries/` members hold: seqs 1 to `head_seq`.
    pub entries: u64,
    pub rewinds: Vec<BundleRewind>,
    pub snapshots: Vec<BundleSnapshot>,
    /// The session's image, for a fork or resume before its first snapshot.
    pub image: Option<BundleImage>,
    /// The `objects/` members, in order.
    pub objects: Vec<ChunkHash>,
}

impl Framed for BundleManifest {
    const MAGIC: [u8; 8] = *b"CAIRNSBM";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 256 << 20;
    const NAME: &'static str = "session bundle manifest";
}

/// An entry as the bundle holds it: every field of [`Entry`], always present.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BundleEntry {
    pub seq: u64,
    pub version: u32,
    pub kind: EntryKind,
    pub role: Option<String>,
    pub content: Option<String>,
    pub content_ref: Option<String>,
    pub tool: Option<String>,
    pub arguments: Option<String>,
    pub result: Option<String>,
    pub result_ref: Option<String>,
    pub exit_status: Option<i32>,
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    pub snapshot_id: Option<String>,
    pub created_at: i64,
    pub hash: String,
}

impl From<&Entry> for BundleEntry {
    fn from(e: &Entry) -> BundleEntry {
        let e = e.clone();
        BundleEntry {
            seq: e.seq,
            version: e.version,
            kind: e.kind,
            role: e.role,
            content: e.content,
            content_ref: e.content_ref,
            tool: e.tool,
            arguments: e.arguments,
            result: e.result,
            result_ref: e.result_ref,
            exit_status: e.exit_status,
            tokens_in: e.tokens_in,
            tokens_out: e.tokens_out,
            snapshot_id: e.snapshot_id,
            created_at: e.created_at,
            hash: e.hash,
        }
    }
}

impl From<BundleEntry> for Entry {
    fn from(e: BundleEntry) -> Entry {
        Entry {
            seq: e.seq,
            version: e.version,
            kind: e.kind,
            role: e.role,
            content: e.content,
            content_ref: e.content_ref,
            tool: e.tool,
            arguments: e.arguments,
            result: e.result,
            result_ref: e.result_ref,
            exit_status: e.exit_status,
            tokens_in: e.tokens_in,
            tokens_out: e.tokens_out,
            snapshot_id: e.snapshot_id,
            created_at: e.created_at,
            hash: e.hash,
        }
    }
}

/// Consecutive entries of the chain.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EntryBatch {
    pub entries: Vec<BundleEntry>,
}

impl Framed for EntryBatch {
    const MAGIC: [u8; 8] = *b"CAIRNSBE";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 64 << 20;
    const NAME: &'static str = "session bundle entries";
}

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

/// The chain from genesis: seqs 1, 2, … with no gap, each hash the link
/// after the previous, ending at the head.
fn check_chain(entries: &[Entry], head_seq: u64, head_hash: &str) -> Result<(), String> {
    let mut previous = GENESIS.to_string();
    for (i, e) in entries.iter().enumerate() {
        let expected = i as u64 + 1;
        if e.seq != expected {
            return Err(format!("entry {expected} is missing (the next is {})", e.seq));
        }
        if e.version != ENTRY_VERSION {
            return Err(format!("entry {expected} has entry version {}", e.version));
        }
        let hash = e.chain(&previous);
        if hash != e.hash {
            return Err(format!("entry {expected} is tampered (its hash should be {hash})"));
        }
        previous = hash;
    }
    if entries.len() as u64 != head_seq || previous != head_hash {
        return Err(format!(
            "the head is entry {head_seq} ({head_hash}), the chain ends at {} ({previous})",
            entries.len()
        ));
    }
    Ok(())
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

impl Engine {
    /// Writes a session as one bundle (module docs). An active session's
    /// sandbox is snapshotted first and the snapshot recorded in its log (a
    /// `note`), so the bundle holds the machine as it is now.
    pub fn export_session(
        &mut self,
        key: &str,
        out: &mut dyn Write,
        progress: &dyn Progress,
    ) -> Result<ExportSummary, EngineError> {
        let mut s = self.session(key)?;
        if matches!(s.state, SessionState::Suspending | SessionState::Resuming) {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "another command is moving it; wait for it (or `cairn session resume` it if that command died)",
            }
            .into());
        }
        let mut snapshot_taken = None;
        if s.state == SessionState::Active {
            let sandbox = s
                .sandbox_id
                .as_deref()
                .and_then(|id| self.sandbox(id).ok().filter(|r| r.id == id))
                .filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Exited));
            if let Some(sandbox) = sandbox {
                progress.step(&format!("snapshotting session {}'s sandbox {}", s.id, sandbox.id));
                let snap = self.snapshot(&sandbox, None)?;
                let mut note = Entry::new(EntryKind::Note);
                note.content = Some(format!("exported: snapshot {}", snap.id));
                note.snapshot_id = Some(snap.id.clone());
                self.session_append(&s, note)?;
                snapshot_taken = Some(snap.id);
                s = self.session(&s.id)?;
            }
        }
        progress.step(&format!("reading session {}'s log", s.id));
        let (segments, hidden) = self.lineage(&s)?;
        let entries = self.chain_entries(&segments)?;
        check_chain(&entries, s.head_seq, &s.head_hash).map_err(|reason| BundleError::SourceLog {
            id: s.id.clone(),
            reason,
        })?;
        let mut rewinds_seen = Vec::new();
        for seg in &segments {
            rewinds_seen.extend(self.db.rewinds(&seg.session)?);
        }
        let mut rewinds: Vec<BundleRewind> = hidden
            .iter()
            .map(|&(to_seq, head_seq)| BundleRewind {
                to_seq,
                head_seq,
                created_at: rewinds_seen
                    .iter()
                    .find(|r| r.to_seq == to_seq && r.head_seq >= head_seq)
                    .map_or(s.updated_at, |r| r.created_at),
            })
            .collect();
        rewinds.sort_by_key(|r| (r.created_at, r.to_seq));

        let mut snapshot_ids: Vec<String> = Vec::new();
        for id in entries
            .iter()
            .filter_map(|e| e.snapshot_id.clone())
            .chain(s.snapshot_id.clone())
        {
            if !snapshot_ids.contains(&id) {
                snapshot_ids.push(id);
            }
        }
        let mut snapshots = Vec::new();
        for id in &snapshot_ids {
            let found = self.db.find_snapshots(id)?.into_iter().find(|r| r.id == *id);
            snapshots.push(found.ok_or_else(|| BundleError::SourceSnapshot {
                id: s.id.clone(),
                snapshot: id.clone(),
            })?);
        }
        let image = self.db.image(&s.image)?;
        let mut layers: HashSet<String> = snapshots.iter().flat_map(|r| r.layers.iter().cloned()).collect();
        layers.extend(image.iter().flat_map(|i| i.layers.iter().cloned()));
        let payloads: HashSet<String> = entries
            .iter()
            .flat_map(|e| [e.content_ref.clone(), e.result_ref.clone()])
            .flatten()
            .collect();
        progress.step("finding the objects its snapshots and payloads reach");
        let mut seen = HashSet::new();
        let objects: Vec<ChunkHash> = self
            .reachable_objects(&layers, &snapshots, &payloads)?
            .into_iter()
            .filter(|h| seen.insert(*h))
            .collect();

        let manifest = BundleManifest {
            exported_at: crate::now_ms(),
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
                .map(|r| {
                    Ok(BundleSnapshot {
                        id: r.id.parse().map_err(|_| BundleError::SourceSnapshot {
                            id: s.id.clone(),
                            snapshot: r.id.clone(),
                        })?,
                        new_bytes: r.new_bytes,
                        stored_bytes: r.stored_bytes,
                    })
                })
                .collect::<Result<_, BundleError>>()?,
            image: image
                .map(|i| {
                    Ok::<_, EngineError>(BundleImage {
                        layers: i.layers.iter().map(|l| crate::layer_id(l)).collect::<Result<_, _>>()?,
                        name: i.name,
                        source: i.source,
                        size_bytes: i.size_bytes,
                        created_at: i.created_at,
                    })
                })
                .transpose()?,
            objects,
        };
        let mtime = (manifest.exported_at / 1000).max(0) as u64;
        out.write_all(&BUNDLE_MAGIC)
            .and_then(|()| out.write_all(&BUNDLE_VERSION.to_le_bytes()))
            .map_err(io_err("write the bundle"))?;
        let mut tar = tar::Builder::new(out);
        let framed =
            cairn_store::frame::encode(&manifest).map_err(|e| BundleError::OverCap(format!("the manifest: {e}")))?;
        append_member(&mut tar, "manifest", &framed, mtime)?;
        for (n, batch) in entries.chunks(BATCH).enumerate() {
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
            let stored = self.store.backend().get(hash).map_err(crate::SnapshotError::from)?;
            // A chunk corrupt here would be refused by the import: say so now.
            cairn_store::decode_chunk(hash, &stored, MAX_OBJECT).map_err(|e| {
                crate::SnapshotError::from(cairn_store::StoreError::ChunkCorrupt {
                    hash: *hash,
                    context: Box::new(ReadContext::new().owner("session", *hash)),
                    reason: e.to_string(),
                })
            })?;
            bytes += stored.len() as u64;
            append_member(&mut tar, &format!("objects/{hash}"), &stored, mtime)?;
        }
        tar.into_inner()
            .and_then(|out| out.flush())
            .map_err(io_err("write the bundle"))?;
        Ok(ExportSummary {
            session: s.id,
            snapshot_taken,
            entries: manifest.entries,
            snapshots: manifest.snapshots.len(),
            objects: total,
            object_bytes: bytes,
        })
    }

    /// Every row of the chain `verify_session` walks, in order.
    fn chain_entries(&self, segments: &[Segment]) -> Result<Vec<Entry>, EngineError> {
        let mut out = Vec::new();
        let mut next = 1u64;
        for seg in segments {
            loop {
                let rows = self.db.raw_entries(seg, next, 1000)?;
                let Some(last) = rows.last() else { break };
                next = last.seq + 1;
                out.extend(rows);
            }
        }
        Ok(out)
    }

    /// Records the session a bundle holds as a new root session, suspended,
    /// named `name` or as it was. Nothing is recorded unless all of it is:
    /// objects are stored (under the shared store lock, so the collector
    /// leaves them) only after the chain verified, and the rows go in in
    /// one transaction once every object a restore needs is in the store.
    /// A failed import can leave objects no row names; `cairn gc` removes
    /// them.
    pub fn import_session(
        &mut self,
        input: &mut dyn Read,
        name: Option<String>,
        progress: &dyn Progress,
    ) -> Result<ImportSummary, EngineError> {
        let mut header = [0u8; 12];
        read_full(input, &mut header, "its header")?;
        if header[..8] != BUNDLE_MAGIC {
            return Err(BundleError::NotABundle.into());
        }
        let version = u32::from_le_bytes(header[8..12].try_into().unwrap_or_default());
        if version > BUNDLE_VERSION {
            return Err(BundleError::FutureVersion {
                found: version,
                known: BUNDLE_VERSION,
            }
            .into());
        }
        if version != BUNDLE_VERSION {
            return Err(BundleError::UnknownVersion(version).into());
        }
        let mut archive = tar::Archive::new(input);
        let mut members = archive.entries().map_err(|e| BundleError::Malformed(e.to_string()))?;
        let mut next = |what: &str, name: &str, cap: u64| -> Result<Vec<u8>, BundleError> {
            let member = match members.next() {
                None => return Err(BundleError::Truncated(what.to_string())),
                Some(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return Err(BundleError::Truncated(what.to_string()))
                }
                Some(Err(e)) => return Err(BundleError::Malformed(format!("before {what}: {e}"))),
                Some(Ok(m)) => m,
            };
            let path = member.path_bytes().into_owned();
            if path != name.as_bytes() || member.header().entry_type() != tar::EntryType::Regular {
                return Err(BundleError::Malformed(format!(
                    "expected {what} as {name:?}, found {:?}",
                    String::from_utf8_lossy(&path)
                )));
            }
            let size = member
                .header()
                .size()
                .map_err(|e| BundleError::Malformed(e.to_string()))?;
            if size > cap {
                return Err(BundleError::OverCap(format!("{what} is {size} bytes, over {cap}")));
            }
            let mut data = Vec::new();
            member.take(size).read_to_end(&mut data).map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => BundleError::Truncated(what.to_string()),
                _ => BundleError::Io {
                    action: "read the bundle",
                    source: e,
                },
            })?;
            if data.len() as u64 != size {
                return Err(BundleError::Truncated(format!("the end of {what}")));
            }
            Ok(data)
        };

        progress.step("reading the bundle's manifest and log");
        let bytes = next(
            "its manifest",
            "manifest",
            cairn_store::frame::HEADER_LEN as u64 + BundleManifest::MAX_PAYLOAD,
        )?;
        let m: BundleManifest =
            cairn_store::frame::decode(&bytes).map_err(|e| BundleError::Malformed(format!("its manifest: {e}")))?;
        drop(bytes);
        let s = &m.session;
        if m.entries > MAX_ENTRIES || m.objects.len() > MAX_OBJECTS {
            return Err(BundleError::OverCap(format!(
                "{} entries and {} objects (at most {MAX_ENTRIES} and {MAX_OBJECTS})",
                m.entries,
                m.objects.len()
            ))
            .into());
        }
        if m.snapshots.len() > MAX_SNAPSHOTS || m.rewinds.len() > MAX_REWINDS {
            return Err(BundleError::OverCap(format!(
                "{} snapshots and {} rewinds (at most {MAX_SNAPSHOTS} and {MAX_REWINDS})",
                m.snapshots.len(),
                m.rewinds.len()
            ))
            .into());
        }
        if !matches!(s.driver.as_str(), "native" | "gvisor") {
            return Err(BundleError::Malformed(format!("unknown driver {:?}", s.driver)).into());
        }
        if m.entries != s.head_seq {
            return Err(BundleError::Malformed(format!(
                "{} entries for a log whose head is {}",
                m.entries, s.head_seq
            ))
            .into());
        }
        if let Some(r) = m
            .rewinds
            .iter()
            .find(|r| r.to_seq >= r.head_seq || r.head_seq > s.head_seq)
        {
            return Err(BundleError::Malformed(format!(
                "a rewind from entry {} to {} in a log of {}",
                r.head_seq, r.to_seq, s.head_seq
            ))
            .into());
        }
        let name = name.unwrap_or_else(|| s.name.clone());
        if !valid_name(&name) {
            return Err(SessionError::BadName(name).into());
        }
        if self.db.find_sessions(&name)?.iter().any(|r| r.name == name) {
            return Err(SessionError::NameTaken(name).into());
        }

        let mut entries: Vec<Entry> = Vec::with_capacity(m.entries.min(1 << 16) as usize);
        let mut log_bytes = 0u64;
        let mut batch = 0;
        while (entries.len() as u64) < m.entries {
            batch += 1;
            let bytes = next(
                &format!("entry batch {batch}"),
                &format!("entries/{batch:06}"),
                cairn_store::frame::HEADER_LEN as u64 + EntryBatch::MAX_PAYLOAD,
            )?;
            log_bytes += bytes.len() as u64;
            if log_bytes > MAX_LOG_BYTES {
                return Err(BundleError::OverCap(format!("more than {MAX_LOG_BYTES} bytes of entries")).into());
            }
            let b: EntryBatch = cairn_store::frame::decode(&bytes)
                .map_err(|e| BundleError::Malformed(format!("entry batch {batch}: {e}")))?;
            if b.entries.is_empty() || entries.len() as u64 + b.entries.len() as u64 > m.entries {
                return Err(BundleError::Malformed(format!(
                    "entry batch {batch} holds {} entries, the manifest says {} in all",
                    b.entries.len(),
                    m.entries
                ))
                .into());
            }
            entries.extend(b.entries.into_iter().map(Entry::from));
        }
        check_chain(&entries, s.head_seq, &s.head_hash).map_err(BundleError::Chain)?;
        let snapshot_ids: HashSet<String> = m.snapshots.iter().map(|r| r.id.to_string()).collect();
        let mut payloads = HashSet::new();
        for e in &entries {
            let bad = |why: String| BundleError::Malformed(format!("entry {}: {why}", e.seq));
            if let Some(a) = &e.arguments {
                serde_json::from_str::<serde_json::Value>(a)
                    .map_err(|err| bad(format!("arguments are not JSON: {err}")))?;
            }
            for r in [&e.content_ref, &e.result_ref].into_iter().flatten() {
                r.parse::<ChunkHash>().map_err(|err| bad(err.to_string()))?;
                payloads.insert(r.clone());
            }
            if let Some(id) = e.snapshot_id.as_ref().filter(|id| !snapshot_ids.contains(*id)) {
                return Err(bad(format!("it names snapshot {id}, which the bundle does not hold")).into());
            }
        }
        match (&s.snapshot_id, s.snapshot_seq) {
            (None, None) => {}
            (Some(id), Some(seq))
                if snapshot_ids.contains(id)
                    && entries
                        .get((seq as usize).wrapping_sub(1))
                        .and_then(|e| e.snapshot_id.as_ref())
                        == Some(id) => {}
            _ => {
                return Err(BundleError::Malformed(format!(
                    "the session's snapshot {:?} is not the one its entry {:?} records",
                    s.snapshot_id, s.snapshot_seq
                ))
                .into())
            }
        }

        // Objects: each checked against its name before it is stored. The
        // shared store lock keeps the collector off them until the rows
        // that name them are committed.
        let _lock = self.lock_store(false)?;
        let total = m.objects.len();
        let mut ticker = Ticker { progress, last: None };
        let (mut stored_bytes, mut objects_new) = (0u64, 0usize);
        for (i, hash) in m.objects.iter().enumerate() {
            ticker.tick(|| format!("storing objects: {i} of {total} ({})", mib(stored_bytes)));
            let what = format!("object {} of {total} ({hash})", i + 1);
            let bytes = next(&what, &format!("objects/{hash}"), MAX_OBJECT)?;
            cairn_store::decode_chunk(hash, &bytes, MAX_OBJECT).map_err(|e| BundleError::Corrupt {
                hash: *hash,
                reason: e.to_string(),
            })?;
            stored_bytes += bytes.len() as u64;
            let outcome = self
                .store
                .backend()
                .put(hash, &bytes)
                .map_err(crate::SnapshotError::from)?;
            objects_new += usize::from(outcome == cairn_store::PutOutcome::Stored);
        }
        match members.next() {
            None => {}
            Some(Ok(extra)) => {
                return Err(BundleError::Malformed(format!(
                    "an extra member {:?} after the last object",
                    String::from_utf8_lossy(&extra.path_bytes())
                ))
                .into())
            }
            Some(Err(e)) => return Err(BundleError::Malformed(format!("after the last object: {e}")).into()),
        }

        // Every object a restore reads is now here: snapshot records are
        // made from their manifests (content-addressed), not from the
        // bundle's word.
        progress.step("checking every snapshot and payload is whole");
        let mut snapshots = Vec::with_capacity(m.snapshots.len());
        for b in &m.snapshots {
            let context = ReadContext::new().owner("snapshot", b.id);
            let manifest: SnapshotManifest = self.store.get_object(&b.id, &context).map_err(|e| match e {
                cairn_store::StoreError::ChunkMissing { .. } => BundleError::Missing {
                    hash: b.id,
                    owner: format!("snapshot {}", b.id),
                },
                other => BundleError::Malformed(format!("snapshot {}: {other}", b.id)),
            })?;
            manifest
                .validate()
                .map_err(|reason| BundleError::Malformed(format!("snapshot {}: {reason}", b.id)))?;
            snapshots.push(SnapshotRecord {
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
        let image = m.image.as_ref().map(|i| ImageRecord {
            name: i.name.clone(),
            source: i.source.clone(),
            size_bytes: i.size_bytes,
            created_at: i.created_at,
            layers: i.layers.iter().map(ToString::to_string).collect(),
        });
        let mut layers: HashSet<String> = snapshots.iter().flat_map(|r| r.layers.iter().cloned()).collect();
        layers.extend(image.iter().flat_map(|i| i.layers.iter().cloned()));
        let listed: HashSet<ChunkHash> = m.objects.iter().copied().collect();
        let reachable = self.reachable_objects(&layers, &snapshots, &payloads).map_err(|e| {
            BundleError::Malformed(format!("a snapshot, layer or payload it holds cannot be read: {e}"))
        })?;
        for hash in reachable {
            if !listed.contains(&hash)
                && !self
                    .store
                    .backend()
                    .contains(&hash)
                    .map_err(crate::SnapshotError::from)?
            {
                return Err(BundleError::Missing {
                    hash,
                    owner: "a snapshot or payload".into(),
                }
                .into());
            }
        }

        progress.step("recording the session");
        let now = crate::now_ms();
        let owner = me();
        let rec = SessionRecord {
            id: new_session_id(),
            name,
            state: SessionState::Suspended,
            image: s.image.clone(),
            driver: s.driver.clone(),
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
            updated_at: now,
        };
        let image_added = self
            .db
            .import_session_rows(&rec, &entries, &m.rewinds, &snapshots, image.as_ref())
            .map_err(|e| match e {
                StateError::NameTaken(n) => EngineError::from(SessionError::NameTaken(n)),
                other => other.into(),
            })?;
        let image_note = match (&image, image_added) {
            (None, _) => Some(format!(
                "the bundle holds no image {:?}; a fork before the first snapshot needs one here",
                s.image
            )),
            (Some(i), false) if self.db.image(&i.name)?.is_some_and(|here| here.layers != i.layers) => Some(format!(
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
            objects: total,
            objects_new,
            image_note,
        })
    }
}

/// Fills `buf`, or says the bundle ends before `what`.
fn read_full(input: &mut dyn Read, buf: &mut [u8], what: &str) -> Result<(), BundleError> {
    input.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => BundleError::Truncated(what.to_string()),
        _ => BundleError::Io {
            action: "read the bundle",
            source: e,
        },
    })
}

impl Db {
    /// Records an imported session whole, in one transaction: its row, its
    /// entries as they are (seqs, hashes, times), its rewinds, its
    /// snapshots (kept if already recorded: the id is the manifest's hash)
    /// and its image when none of that name exists. True when the image was
    /// added.
    fn import_session_rows(
        &self,
        s: &SessionRecord,
        entries: &[Entry],
        rewinds: &[BundleRewind],
        snapshots: &[SnapshotRecord],
        image: Option<&ImageRecord>,
    ) -> Result<bool, StateError> {
        self.transaction(|b| {
            match insert_session_row(b, s) {
                Err(BackendError::Unique { target }) if target == "sessions.name" => {
                    return Err(StateError::NameTaken(s.name.clone()))
                }
                other => other?,
            };
            for e in entries {
                insert_entry_row(b, &s.id, e)?;
            }
            for (n, r) in rewinds.iter().enumerate() {
                b.execute(
                    "INSERT INTO session_rewinds (session_id, n, to_seq, head_seq, created_at) VALUES ($1, $2, $3, $4, $5)",
                    params![&s.id, n as u64 + 1, r.to_seq, r.head_seq, r.created_at],
                )?;
            }
            for snap in snapshots {
                insert_snapshot_rows(b, snap)?;
            }
            let Some(image) = image else { return Ok(false) };
            if b.query_opt("SELECT name FROM images WHERE name = $1", params![&image.name])?
                .is_some()
            {
                return Ok(false);
            }
            insert_image_rows(b, image)?;
            Ok(true)
        })
    }
}

#[cfg(test)]
mod tests {
    use cairn_store::frame::{decode, encode, FrameError};

    use super::*;

    fn chain(n: u64) -> Vec<Entry> {
        let mut previous = GENESIS.to_string();
        (1..=n)
            .map(|seq| {
                let mut e = Entry::new(EntryKind::User);
                e.seq = seq;
                e.content = Some(format!("message {seq}"));
                e.created_at = seq as i64;
                e.hash = e.chain(&previous);
                previous = e.hash.clone();
                e
            })
            .collect()
    }

    #[test]
    fn a_chain_verifies_only_whole_and_unchanged() {
        let entries = chain(3);
        let head = entries[2].hash.clone();
        assert!(check_chain(&entries, 3, &head).is_ok());
        assert!(check_chain(&[], 0, GENESIS).is_ok());
        let mut changed = entries.clone();
        changed[1].content = Some("changed".into());
        assert!(check_chain(&changed, 3, &head)
            .unwrap_err()
            .contains("entry 2 is tampered"));
        let gap = vec![entries[0].clone(), entries[2].clone()];
        assert!(check_chain(&gap, 3, &head).unwrap_err().contains("entry 2 is missing"));
        assert!(check_chain(&entries[..2], 3, &head).unwrap_err().contains("head"));
    }

    #[test]
    fn entry_batches_round_trip_and_refuse_corrupt_or_future_frames() {
        let batch = EntryBatch {
            entries: chain(2).iter().map(BundleEntry::from).collect(),
        };
        let bytes = encode(&batch).unwrap();
        let back: EntryBatch = decode(&bytes).unwrap();
        let entries: Vec<Entry> = back.entries.into_iter().map(Entry::from).collect();
        assert_eq!(entries, chain(2));
        let mut corrupt = bytes.clone();
        *corrupt.last_mut().unwrap() ^= 1;
        assert!(decode::<EntryBatch>(&corrupt).is_err());
        let mut future = bytes.clone();
        future[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            decode::<EntryBatch>(&future),
            Err(FrameError::FutureVersion { .. })
        ));
        assert!(decode::<EntryBatch>(&bytes[..bytes.len() - 1]).is_err());
    }
}
