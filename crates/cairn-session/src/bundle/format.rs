//! The session bundle's format (docs/formats.md, "Session bundle"): its
//! header, caps, the typed records inside, and the chain check both sides
//! run.

use std::io;

use cairn_layers::LayerId;
use cairn_store::{ChunkHash, Framed};
use serde::{Deserialize, Serialize};

use crate::{Entry, EntryKind, ENTRY_VERSION, GENESIS};

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
/// The writer starts a new batch after this many entries or this many
/// bytes of text, well under the batch frame's cap.
pub(super) const BATCH_ENTRIES: usize = 512;
pub(super) const BATCH_TEXT: usize = 8 << 20;

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

pub(super) fn io_err(action: &'static str) -> impl FnOnce(io::Error) -> BundleError {
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

/// The chain from genesis: seqs 1, 2, … with no gap, each hash the link
/// after the previous, ending at the head.
pub(super) fn check_chain(entries: &[Entry], head_seq: u64, head_hash: &str) -> Result<(), String> {
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
