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
//! - A layer's index is written as the walk goes ([`IndexWriter`]): one
//!   root object, whose hash is the [`LayerId`], holding a small layer's
//!   entries or a large one's segments; files of up to [`SMALL_FILE_MAX`]
//!   bytes are kept in the index itself. Capture and materialise hold one
//!   segment at a time, so a tree of millions of files costs bounded memory.
//! - [`materialise`] rebuilds the directory in a temp directory beside the
//!   destination and renames it into place, so a crash never leaves a
//!   half-built layer; [`remove_abandoned_materialisations`] clears the
//!   temp directories of processes that died mid-way.
//!
//! Both need root: reading and writing `trusted.*` xattrs, device nodes
//! and ownership are privileged. The overlay the upper came from must be
//! mounted with `metacopy=off` (data lives in the upper), which capture
//! checks.

mod baseline;
mod capture;
mod diff;
mod dirfd;
mod flatten;
mod index;
mod materialise;
mod shift;
mod stored;
mod view;

use std::io;
use std::path::PathBuf;

use cairn_store::StoreError;

pub use baseline::Baseline;
pub use capture::{
    capture, capture_mapped, capture_since, capture_since_mapped, capture_since_with, remove_device_nodes,
    CapturedLayer,
};
pub use diff::{diff_trees, kind_name, Change, ChangeKind};
pub use flatten::{flatten, FlattenError};
pub use index::{
    Entry, EntryChecker, EntryKind, LayerId, LayerIndex, LayerPath, Metadata, Timestamp, Xattr, SMALL_FILE_MAX,
};
pub use materialise::{materialise, remove_abandoned_materialisations};
pub use shift::{shifted_copy, ShiftedCopy};
pub use stored::{
    for_each_run, layer_objects, load_index, write_index, IndexRoot, IndexSegment, IndexSummary, IndexWriter,
    SegmentRef,
};
pub use view::{lookup, merged_view, Lookup};

/// The host ids a user namespace maps a sandbox's ids `0..count` to:
/// `base..base + count`, uids and gids alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostIds {
    pub base: u32,
    pub count: u32,
}

/// `security.capability`'s revision field (`<linux/capability.h>`).
const REVISION_MASK: u32 = 0xff00_0000;
const REVISION_2: u32 = 0x0200_0000;
const REVISION_3: u32 = 0x0300_0000;

impl HostIds {
    /// The sandbox id a host id stands for. Ids outside the range (the
    /// upper directory's own root, whiteouts, made by the host) are kept.
    pub fn sandbox_id(self, host: u32) -> u32 {
        match host.checked_sub(self.base) {
            Some(id) if id < self.count => id,
            _ => host,
        }
    }

    /// An xattr as the sandbox saw it. A file capability set inside the
    /// namespace is stored in version 3, naming the namespace's root as a
    /// host id; it is recorded in the plain version 2 form, which the next
    /// sandbox's idmapped mount shows as its own root's. Anything else is
    /// kept as it is.
    pub fn sandbox_xattr(self, name: &[u8], value: Vec<u8>) -> Vec<u8> {
        if name != b"security.capability" || value.len() != 24 {
            return value;
        }
        let word = |at: usize| u32::from_le_bytes([value[at], value[at + 1], value[at + 2], value[at + 3]]);
        let (magic, root) = (word(0), word(20));
        if magic & REVISION_MASK != REVISION_3 || root != self.base {
            return value;
        }
        let mut v2 = value[..20].to_vec();
        v2[..4].copy_from_slice(&((magic & !REVISION_MASK) | REVISION_2).to_le_bytes());
        v2
    }

    /// The host id a sandbox id is stored as in a copy of a layer whose ids
    /// are shifted into this range; an id outside `0..count` is stored as
    /// the range's overflow id (65534), as an idmapped mount would show it.
    pub fn host_id(self, sandbox: u32) -> u32 {
        const OVERFLOW: u32 = 65534;
        let id = if sandbox < self.count {
            sandbox
        } else {
            OVERFLOW.min(self.count.saturating_sub(1))
        };
        self.base + id
    }

    /// An xattr of a layer as a shifted copy stores it: a plain version 2
    /// file capability (the namespace's root, as layers record it) becomes
    /// version 3 naming the range's root, as the kernel stores one set
    /// inside the sandbox; anything else is kept as it is.
    pub fn host_xattr(self, name: &[u8], value: Vec<u8>) -> Vec<u8> {
        if name != b"security.capability" || value.len() != 20 {
            return value;
        }
        let magic = u32::from_le_bytes([value[0], value[1], value[2], value[3]]);
        if magic & REVISION_MASK != REVISION_2 {
            return value;
        }
        let mut v3 = value;
        v3[..4].copy_from_slice(&((magic & !REVISION_MASK) | REVISION_3).to_le_bytes());
        v3.extend_from_slice(&self.base.to_le_bytes());
        v3
    }
}

#[cfg(test)]
mod host_ids_tests {
    use super::HostIds;

    const IDS: HostIds = HostIds {
        base: 0x7000_0000,
        count: 65536,
    };

    #[test]
    fn host_ids_in_the_range_become_sandbox_ids_and_others_stay() {
        assert_eq!(IDS.sandbox_id(0x7000_0000), 0);
        assert_eq!(IDS.sandbox_id(0x7000_0000 + 1000), 1000);
        assert_eq!(IDS.sandbox_id(0x7000_0000 + 65536), 0x7000_0000 + 65536);
        assert_eq!(IDS.sandbox_id(0), 0);
        assert_eq!(IDS.sandbox_id(5), 5);
    }

    #[test]
    fn a_capability_naming_the_namespace_root_is_recorded_in_version_2() {
        // cap_net_raw permitted and effective, root = the namespace's root.
        let mut v3 = (0x0300_0000u32 | 1).to_le_bytes().to_vec();
        v3.extend_from_slice(&(1u32 << 13).to_le_bytes());
        v3.extend_from_slice(&[0; 12]);
        v3.extend_from_slice(&0x7000_0000u32.to_le_bytes());
        let v2 = IDS.sandbox_xattr(b"security.capability", v3.clone());
        assert_eq!(v2.len(), 20);
        assert_eq!(&v2[..4], &(0x0200_0000u32 | 1).to_le_bytes());
        assert_eq!(&v2[4..20], &v3[4..20]);
        // Another root, another xattr, or a version 2 value: unchanged.
        let mut other = v3.clone();
        other[20..].copy_from_slice(&5u32.to_le_bytes());
        assert_eq!(IDS.sandbox_xattr(b"security.capability", other.clone()), other);
        assert_eq!(IDS.sandbox_xattr(b"user.x", v3.clone()), v3);
        assert_eq!(IDS.sandbox_xattr(b"security.capability", v2.clone()), v2);
    }

    #[test]
    fn a_shifted_copy_stores_ids_in_the_range_and_capabilities_in_version_3() {
        assert_eq!(IDS.host_id(0), 0x7000_0000);
        assert_eq!(IDS.host_id(1000), 0x7000_0000 + 1000);
        assert_eq!(IDS.host_id(70_000), 0x7000_0000 + 65534);
        let mut v3 = (0x0300_0000u32 | 1).to_le_bytes().to_vec();
        v3.extend_from_slice(&(1u32 << 13).to_le_bytes());
        v3.extend_from_slice(&[0; 12]);
        v3.extend_from_slice(&0x7000_0000u32.to_le_bytes());
        let v2 = IDS.sandbox_xattr(b"security.capability", v3.clone());
        // The two forms round-trip; other xattrs and values stay.
        assert_eq!(IDS.host_xattr(b"security.capability", v2.clone()), v3);
        assert_eq!(IDS.host_xattr(b"security.capability", v3.clone()), v3);
        assert_eq!(IDS.host_xattr(b"user.x", v2.clone()), v2);
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
