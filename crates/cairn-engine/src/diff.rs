//! `cairn diff`: what differs between two snapshots, sandboxes or a run's
//! stages and branches, computed from layer indexes. Each side is a stack
//! of layers merged as a sandbox would see it; files are equal when their
//! chunk lists are, so nothing unchanged is read, and only text files
//! under a size cap are read, for their unified diff.

use std::time::Instant;

use cairn_layers::archive::{capture_mapped, diff_trees, kind_name, load_index, merged_view, ChangeKind, Entry};
use cairn_layers::archive::{EntryKind, LayerId, LayerIndex};
use cairn_store::ReadContext;
use serde::Serialize;

use crate::snapshots::SnapshotError;
use crate::{Engine, EngineError};

/// What to compute beyond the list of changes.
#[derive(Debug, Clone, Copy)]
pub struct DiffOptions {
    /// A unified diff for a changed (or added, or removed) file whose
    /// sides are each valid UTF-8 without NUL bytes and at most this many
    /// bytes; 0 for none.
    pub text_max: u64,
    /// At most this many changes are listed (the counts cover them all).
    pub max_changes: usize,
    /// The unified diffs together hold at most this many bytes; files
    /// past it are listed without one.
    pub text_budget: usize,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions {
            text_max: 256 << 10,
            max_changes: 10_000,
            text_budget: 4 << 20,
        }
    }
}

/// One side of a diff as it was resolved.
#[derive(Debug, Clone, Serialize)]
pub struct DiffSide {
    /// What was asked for.
    pub key: String,
    /// `snapshot`, `sandbox` or `stage`.
    pub kind: &'static str,
    /// The snapshot compared (a sandbox's side has none: its files as they
    /// are now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
}

/// One path that differs.
#[derive(Debug, Clone, Serialize)]
pub struct FileChange {
    /// Absolute, as the sandbox sees it.
    pub path: String,
    /// `added`, `removed` or `changed`.
    pub change: &'static str,
    /// For a change: what differs (`type`, `content`, `mode`, `owner`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub what: Vec<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before: Option<EntryInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after: Option<EntryInfo>,
    /// A unified diff, for text files under the size cap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
    /// Why a file's change has no unified diff (`binary`, `over N bytes`,
    /// `text budget spent`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_diff: Option<String>,
}

/// An entry's type, size, mode and owner on one side.
#[derive(Debug, Clone, Serialize)]
pub struct EntryInfo {
    pub kind: &'static str,
    pub size: u64,
    /// Permission bits, as octal text (`0644`).
    pub mode: String,
    pub uid: u32,
    pub gid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// The answer to `cairn diff A B`: how B differs from A.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotDiff {
    pub a: DiffSide,
    pub b: DiffSide,
    pub added: u64,
    pub removed: u64,
    pub changed: u64,
    /// Layers the two sides share (compared by id, not read twice).
    pub shared_layers: usize,
    pub changes: Vec<FileChange>,
    /// More changes exist than listed (`max_changes`).
    pub truncated: bool,
    /// Time the comparison took, in milliseconds.
    pub took_ms: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    #[error(
        "{0:?} names no snapshot, sandbox or stage: give a snapshot id or label (`cairn snapshots`), a sandbox \
         (`cairn ps`), or RUN/STAGE or RUN/STAGE.BRANCH (`cairn pipeline show RUN`)"
    )]
    Unknown(String),
    #[error("{key}: {reason}")]
    NoSnapshot { key: String, reason: String },
}

/// A side resolved to the layers it shows, topmost first; a sandbox's own
/// files are captured into one index on top of its base layers.
struct Resolved {
    side: DiffSide,
    layers: Vec<String>,
    captured: Option<LayerId>,
}

impl Engine {
    /// How `b` differs from `a`. Each is a snapshot (id, prefix or label), a
    /// sandbox (its files as they are now, read without pausing it), or a
    /// run's stage or branch output (`RUN/STAGE`, `RUN/STAGE.BRANCH`).
    pub fn diff(&self, a: &str, b: &str, opts: &DiffOptions) -> Result<SnapshotDiff, EngineError> {
        let started = Instant::now();
        // Shared with other readers; a collection waits, so no chunk goes
        // while it is read (a sandbox's capture among them).
        let _lock = self.lock_store(false)?;
        let (ra, rb) = (self.resolve_diff_side(a)?, self.resolve_diff_side(b)?);
        let shared = ra
            .layers
            .iter()
            .rev()
            .zip(rb.layers.iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        let ta = self.diff_view(&ra)?;
        let tb = self.diff_view(&rb)?;
        let all = diff_trees(&ta, &tb);
        let count = |k| all.iter().filter(|c| c.kind == k).count() as u64;
        let (added, removed, changed) = (
            count(ChangeKind::Added),
            count(ChangeKind::Removed),
            count(ChangeKind::Changed),
        );
        let truncated = all.len() > opts.max_changes;
        let mut budget = opts.text_budget;
        let mut changes = Vec::with_capacity(all.len().min(opts.max_changes));
        for c in all.iter().take(opts.max_changes) {
            let path = c.entry().path.display_path().display().to_string();
            let (diff, no_diff) = self.text_diff(&path, c.before, c.after, opts, &mut budget);
            changes.push(FileChange {
                path,
                change: match c.kind {
                    ChangeKind::Added => "added",
                    ChangeKind::Removed => "removed",
                    ChangeKind::Changed => "changed",
                },
                what: c.what.clone(),
                before: c.before.map(entry_info),
                after: c.after.map(entry_info),
                diff,
                no_diff,
            });
        }
        Ok(SnapshotDiff {
            a: ra.side,
            b: rb.side,
            added,
            removed,
            changed,
            shared_layers: shared,
            changes,
            truncated,
            took_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn resolve_diff_side(&self, key: &str) -> Result<Resolved, EngineError> {
        if key.is_empty() || key.len() > 512 || key.chars().any(char::is_control) {
            return Err(DiffError::Unknown(key.into()).into());
        }
        if let Some((run, rest)) = key.split_once('/') {
            let (stage, branch) = rest.split_once('.').unwrap_or((rest, ""));
            let run = match self.db.find_runs(run) {
                Ok(mut found) if found.len() == 1 => found.remove(0),
                _ => return Err(DiffError::Unknown(key.into()).into()),
            };
            let row = self
                .db
                .stage(&run.id, stage, branch)?
                .ok_or_else(|| DiffError::Unknown(key.into()))?;
            let Some(snapshot) = row.output_snapshot else {
                return Err(DiffError::NoSnapshot {
                    key: key.into(),
                    reason: format!(
                        "the stage is {} and left no output snapshot; compare its input, {}",
                        row.status,
                        row.input_snapshot.as_deref().unwrap_or("(none)")
                    ),
                }
                .into());
            };
            let snap = match self.snapshot_record(&snapshot) {
                Err(EngineError::Snapshot(SnapshotError::NotFound(_))) => {
                    return Err(DiffError::NoSnapshot {
                        key: key.into(),
                        reason: format!(
                            "its output snapshot {} is gone (a losing branch collected under its run's \
                             keep = \"winners\", or removed); its records stay in `cairn pipeline show {}`",
                            &snapshot[..12.min(snapshot.len())],
                            run.id
                        ),
                    }
                    .into())
                }
                other => other?,
            };
            return Ok(Resolved {
                layers: self.manifest(&snap)?.layers.iter().map(|l| l.to_string()).collect(),
                side: DiffSide {
                    key: key.into(),
                    kind: "stage",
                    snapshot_id: Some(snap.id),
                    sandbox_id: row.sandbox_id,
                },
                captured: None,
            });
        }
        match self.snapshot_record(key) {
            Ok(snap) => {
                return Ok(Resolved {
                    layers: self.manifest(&snap)?.layers.iter().map(|l| l.to_string()).collect(),
                    side: DiffSide {
                        key: key.into(),
                        kind: "snapshot",
                        snapshot_id: Some(snap.id),
                        sandbox_id: None,
                    },
                    captured: None,
                });
            }
            Err(EngineError::Snapshot(SnapshotError::NotFound(_))) => {}
            Err(e) => return Err(e),
        }
        let rec = match self.sandbox(key) {
            Ok(rec) => rec,
            Err(EngineError::NoSuchSandbox(_)) => return Err(DiffError::Unknown(key.into()).into()),
            Err(e) => return Err(e),
        };
        let dir = self.home.sandbox(&rec.id);
        let upper = cairn_sandbox::disk::upper_dir(&dir).map_err(|source| EngineError::Disk {
            id: rec.id.clone(),
            source,
        })?;
        let ids = self.driver_of(&rec)?.capabilities().host_ids;
        let captured = capture_mapped(&upper, &self.store, ids).map_err(SnapshotError::from)?;
        Ok(Resolved {
            layers: rec.layers.clone(),
            side: DiffSide {
                key: key.into(),
                kind: "sandbox",
                snapshot_id: None,
                sandbox_id: Some(rec.id),
            },
            captured: Some(captured.id),
        })
    }

    /// The merged tree a side shows.
    fn diff_view(&self, r: &Resolved) -> Result<LayerIndex, EngineError> {
        let mut ids = Vec::with_capacity(r.layers.len() + 1);
        ids.extend(r.captured);
        for l in &r.layers {
            ids.push(l.parse::<LayerId>().map_err(|_| EngineError::BadLayerId(l.clone()))?);
        }
        let indexes = ids
            .iter()
            .map(|id| load_index(&self.store, id).map_err(|e| EngineError::from(SnapshotError::from(e))))
            .collect::<Result<Vec<_>, _>>()?;
        merged_view(&indexes.iter().collect::<Vec<_>>()).map_err(|source| {
            SnapshotError::Flatten {
                id: r.side.snapshot_id.clone().unwrap_or_else(|| r.side.key.clone()),
                source,
            }
            .into()
        })
    }

    /// A unified diff of a file's two sides (an absent side is empty), or
    /// why there is none.
    fn text_diff(
        &self,
        path: &str,
        before: Option<&Entry>,
        after: Option<&Entry>,
        opts: &DiffOptions,
        budget: &mut usize,
    ) -> (Option<String>, Option<String>) {
        let is_file = |e: Option<&Entry>| e.is_none_or(|e| e.kind.is_file());
        if opts.text_max == 0 || !is_file(before) || !is_file(after) {
            return (None, None);
        }
        let sizes = [before, after].map(|e| e.map_or(0, |e| e.kind.file_size()));
        if sizes.iter().any(|s| *s > opts.text_max) {
            return (None, Some(format!("over {} bytes", opts.text_max)));
        }
        if *budget == 0 {
            return (None, Some("text budget spent".into()));
        }
        let mut sides = Vec::with_capacity(2);
        for e in [before, after] {
            let bytes = match e {
                None => Vec::new(),
                Some(e) => match self.file_bytes(e, opts.text_max) {
                    Ok(b) => b,
                    Err(err) => return (None, Some(format!("not read: {err}"))),
                },
            };
            match String::from_utf8(bytes) {
                Ok(s) if !s.contains('\0') => sides.push(s),
                _ => return (None, Some("binary".into())),
            }
        }
        if sides[0] == sides[1] {
            // Equal bytes under different chunk lists: nothing to show.
            return (None, None);
        }
        let text = similar::TextDiff::from_lines(&sides[0], &sides[1])
            .unified_diff()
            .context_radius(3)
            .header(&format!("a{path}"), &format!("b{path}"))
            .to_string();
        if text.len() > *budget {
            *budget = 0;
            return (None, Some("text budget spent".into()));
        }
        *budget -= text.len();
        (Some(text), None)
    }

    /// A file's bytes, at most `max` of them.
    fn file_bytes(&self, e: &Entry, max: u64) -> Result<Vec<u8>, EngineError> {
        match &e.kind {
            EntryKind::SmallFile { data } => Ok(data.clone()),
            EntryKind::File(content) if content.size <= max => {
                let mut bytes = Vec::with_capacity(content.size as usize);
                let context = ReadContext::new().path(e.path.display_path());
                self.store
                    .read_to_writer(content, &mut bytes, &context)
                    .map_err(|e| EngineError::from(SnapshotError::from(e)))?;
                Ok(bytes)
            }
            _ => Ok(Vec::new()),
        }
    }
}

fn entry_info(e: &Entry) -> EntryInfo {
    EntryInfo {
        kind: kind_name(&e.kind),
        size: e.kind.file_size(),
        mode: format!("{:04o}", e.meta.mode & 0o7777),
        uid: e.meta.uid,
        gid: e.meta.gid,
        target: match &e.kind {
            EntryKind::Symlink { target } => Some(String::from_utf8_lossy(target).into_owned()),
            _ => None,
        },
    }
}
