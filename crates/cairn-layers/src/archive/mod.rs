//! Capture an overlayfs upper directory into an immutable layer in the
//! chunk store, and materialise a layer back into a directory that works
//! as an overlayfs lowerdir.
//!
//! - [`capture`] walks only the upper directory (cost proportional to the
//!   changes, not the lower layers) and records every entry: files (their
//!   content chunked into the store, holes kept), directories, symlinks,
//!   fifos, sockets and whiteouts (char 0:0), hard-link groups,
//!   mode, ownership, nanosecond mtimes and every xattr, including
//!   `trusted.overlay.*` (opaque directories, redirects). Block and
//!   character devices are left out: a layer never gives a sandbox a host
//!   device, and [`materialise`] skips any an index holds.
//! - The [`LayerIndex`] is stored as one framed object; its hash is the
//!   [`LayerId`].
//! - [`materialise`] rebuilds the directory in a temp directory beside the
//!   destination and renames it into place, so a crash never leaves a
//!   half-built layer; [`remove_abandoned_materialisations`] clears the
//!   temp directories of processes that died mid-way.
//!
//! Both need root: reading and writing `trusted.*` xattrs, device nodes
//! and ownership are privileged. The overlay the upper came from must be
//! mounted with `metacopy=off` (data lives in the upper), which capture
//! checks.

mod capture;
mod dirfd;
mod index;
mod materialise;

use std::io;
use std::path::PathBuf;

use cairn_store::StoreError;

pub use capture::{capture, capture_since, capture_since_mapped, remove_device_nodes, Baseline, CapturedLayer};
pub use index::{Entry, EntryKind, LayerId, LayerIndex, LayerPath, Metadata, Timestamp, Xattr};
pub use materialise::{materialise, remove_abandoned_materialisations};

/// The host ids a user namespace maps a sandbox's ids `0..count` to:
/// `base..base + count`, uids and gids alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostIds {
    pub base: u32,
    pub count: u32,
}

impl HostIds {
    /// The sandbox id a host id stands for. Ids outside the range (the
    /// upper directory's own root, whiteouts, made by the host) are kept.
    pub fn sandbox_id(self, host: u32) -> u32 {
        match host.checked_sub(self.base) {
            Some(id) if id < self.count => id,
            _ => host,
        }
    }
}

/// Why a capture or materialisation failed. Nothing is left half-done: a
/// failed capture stores no index, a failed materialisation removes its
/// temp directory.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("cannot capture {path:?}: {action} failed ({source}); capture runs as root on a frozen sandbox's upper directory, so check that both hold")]
    Capture {
        path: PathBuf,
        action: &'static str,
        source: io::Error,
    },
    #[error("cannot capture {path:?}: it is a metacopy-only file whose data is in a lower layer; mount the sandbox overlay with metacopy=off")]
    Metacopy { path: PathBuf },
    #[error(
        "cannot capture {path:?}: it has unknown file type {mode:#o}; remove it from the sandbox before snapshotting"
    )]
    UnknownFileType { path: PathBuf, mode: u32 },
    #[error("cannot materialise {path:?}: {action} failed ({source}); materialising needs root (device nodes, ownership, trusted.* xattrs) and free space at the destination")]
    Materialise {
        path: PathBuf,
        action: &'static str,
        source: io::Error,
    },
    #[error("cannot materialise into {path:?}: it already exists; a layer is materialised into a new directory, so remove it or choose another path")]
    DestinationExists { path: PathBuf },
    #[error("layer {} has an invalid index: {reason}; the index is corrupt or was written by a faulty Cairn, so recapture the layer", layer.as_hash().short())]
    InvalidIndex { layer: LayerId, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}
