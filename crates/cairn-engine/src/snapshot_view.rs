//! A snapshot's files, read straight from its layer indexes in the chunk
//! store: no sandbox starts and no layer directory is opened, so a path is
//! resolved by the indexes' records alone and a symlink a sandbox left is
//! reported, never followed (`cairn_layers::archive::view`).

use cairn_layers::archive::{kind_name, load_index, lookup, merged_view, EntryKind, LayerPath, Lookup};
use cairn_store::ReadContext;

use crate::snapshots::SnapshotError;
use crate::state::SnapshotRecord;
use crate::{Engine, EngineError};

/// What a snapshot holds at a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotItem {
    File {
        size: u64,
        mode: u32,
        content: Vec<u8>,
    },
    Directory {
        entries: Vec<SnapshotDirEntry>,
        truncated: bool,
    },
    Symlink {
        target: String,
    },
    /// A fifo, socket or device node.
    Other {
        kind: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotDirEntry {
    pub name: String,
    pub kind: &'static str,
    /// A file's size; 0 for the rest.
    pub size: u64,
    pub symlink_target: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("{0:?} is not an absolute path without . or .. components; give one such as /work/out.txt")]
    BadPath(String),
    #[error("{path} does not exist in snapshot {snapshot}; list its parent directory")]
    Missing { path: String, snapshot: String },
    #[error(
        "{path} is below {at}, a symlink to {target}; symlinks are not followed: read the path under {target} instead"
    )]
    BelowSymlink { path: String, at: String, target: String },
    #[error("{path} is below {at}, which is not a directory")]
    BelowNonDirectory { path: String, at: String },
    #[error("{path} is {size} bytes; at most {max} are read: copy the part you need with a stage (head -c, tail)")]
    TooLarge { path: String, size: u64, max: u64 },
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl Engine {
    /// Reads the file (at most `file_max` bytes) or lists the directory (at
    /// most `entries_max` entries) at `path` in `snap`, as a sandbox
    /// restored from it would see it, without starting one.
    pub fn read_snapshot_path(
        &self,
        snap: &SnapshotRecord,
        path: &str,
        file_max: u64,
        entries_max: usize,
    ) -> Result<SnapshotItem, EngineError> {
        let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
        if !path.starts_with('/') || components.iter().any(|c| *c == "." || *c == ".." || c.contains('\0')) {
            return Err(ViewError::BadPath(path.into()).into());
        }
        let wanted = components.iter().fold(LayerPath::root(), |p, c| p.join(c.as_bytes()));
        // Shared with other readers; a collection waits, so no chunk goes
        // while it is read.
        let _lock = self.lock_store(false)?;
        let manifest = self.manifest(snap)?;
        let indexes = manifest
            .layers
            .iter()
            .map(|id| load_index(&self.store, id).map_err(|e| EngineError::from(SnapshotError::from(e))))
            .collect::<Result<Vec<_>, _>>()?;
        let tree = merged_view(&indexes.iter().collect::<Vec<_>>()).map_err(|source| SnapshotError::Flatten {
            id: snap.id.clone(),
            source,
        })?;
        let shown = |p: &LayerPath| p.display_path().display().to_string();
        let (entry, children, more) = match lookup(&tree, &wanted, entries_max) {
            Lookup::Found { entry, children, more } => (entry, children, more),
            Lookup::Missing => {
                return Err(ViewError::Missing {
                    path: path.into(),
                    snapshot: snap.id.clone(),
                }
                .into());
            }
            Lookup::BelowSymlink { at, target } => {
                let (at, target) = (shown(&at), text(target));
                return Err(ViewError::BelowSymlink {
                    path: path.into(),
                    at,
                    target,
                }
                .into());
            }
            Lookup::BelowNonDirectory { at } => {
                return Err(ViewError::BelowNonDirectory {
                    path: path.into(),
                    at: shown(&at),
                }
                .into());
            }
        };
        Ok(match &entry.kind {
            EntryKind::Directory => SnapshotItem::Directory {
                entries: children
                    .iter()
                    .map(|c| SnapshotDirEntry {
                        name: c.path.split_last().map(|(_, name)| text(name)).unwrap_or_default(),
                        kind: kind_name(&c.kind),
                        size: c.kind.file_size(),
                        symlink_target: match &c.kind {
                            EntryKind::Symlink { target } => Some(text(target)),
                            _ => None,
                        },
                    })
                    .collect(),
                truncated: more,
            },
            kind if kind.is_file() && kind.file_size() > file_max => {
                return Err(ViewError::TooLarge {
                    path: path.into(),
                    size: kind.file_size(),
                    max: file_max,
                }
                .into());
            }
            EntryKind::SmallFile { data } => SnapshotItem::File {
                size: data.len() as u64,
                mode: entry.meta.mode,
                content: data.clone(),
            },
            EntryKind::File(content) => {
                let mut bytes = Vec::with_capacity(content.size as usize);
                let context = ReadContext::new().path(entry.path.display_path());
                self.store
                    .read_to_writer(content, &mut bytes, &context)
                    .map_err(|e| EngineError::from(SnapshotError::from(e)))?;
                SnapshotItem::File {
                    size: content.size,
                    mode: entry.meta.mode,
                    content: bytes,
                }
            }
            EntryKind::Symlink { target } => SnapshotItem::Symlink { target: text(target) },
            other => SnapshotItem::Other { kind: kind_name(other) },
        })
    }
}
