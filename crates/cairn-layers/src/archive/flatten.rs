//! Flattening a stack of layers into one: the tree an overlay mount of the
//! stack shows, as a single layer index. File contents are chunk
//! references, so nothing is copied; only the index is new.

use std::collections::{BTreeMap, HashMap};

use super::index::{Entry, EntryKind, LayerIndex, LayerPath};

/// Why a stack cannot be flattened.
#[derive(Debug, thiserror::Error)]
pub enum FlattenError {
    #[error("layer {layer} has a directory {path} whose overlayfs redirect names no valid path")]
    Redirect { layer: usize, path: String },
    #[error("layer {layer} links {path} to {target}, which the layer does not hold")]
    DanglingLink { layer: usize, path: String, target: String },
    #[error("layer {0} has no root directory")]
    NoRoot(usize),
}

const OPAQUE: &[u8] = b"trusted.overlay.opaque";
const REDIRECT: &[u8] = b"trusted.overlay.redirect";
const OVERLAY_XATTRS: &[u8] = b"trusted.overlay.";

/// Merges `stack` (topmost first, as snapshots list their layers) into one
/// layer: an upper entry replaces the lower one at its path (a non-directory
/// also hides what was below a directory there), a whiteout removes the
/// path and everything under it, an opaque directory hides the lower
/// directory's children, a renamed directory (a redirect) shows what was
/// below its old path. Hard links become entries of their own with their
/// target's content (the same chunks), since a target may be replaced by a
/// higher layer. Overlayfs bookkeeping xattrs are dropped. The result is in
/// pre-order and passes [`LayerIndex::validate`].
pub fn flatten(stack: &[&LayerIndex]) -> Result<LayerIndex, FlattenError> {
    let mut tree: BTreeMap<Key, Entry> = BTreeMap::new();
    for (depth, index) in stack.iter().enumerate().rev() {
        if index.entries.first().is_none_or(|e| !e.path.is_root()) {
            return Err(FlattenError::NoRoot(depth));
        }
        let by_path: HashMap<_, _> = index.entries.iter().map(|e| (&e.path, e)).collect();
        // A directory renamed in this layer (overlayfs `redirect_dir`) shows
        // what the layers below hold at its old path: taken before this
        // layer's whiteout of the old path applies.
        let mut moved: HashMap<Key, Vec<(Key, Entry)>> = HashMap::new();
        for e in &index.entries {
            if let Some(r) = e.meta.xattrs.iter().find(|x| x.name == REDIRECT) {
                let key = key_of(e);
                let from = redirect_source(&key, &r.value).ok_or_else(|| FlattenError::Redirect {
                    layer: depth,
                    path: e.path.display_path().display().to_string(),
                })?;
                let below: Vec<(Key, Entry)> = tree
                    .range(from.clone()..)
                    .take_while(|(k, _)| k.starts_with(&from))
                    .filter(|(k, _)| k.len() > from.len())
                    .map(|(k, v)| {
                        let mut moved_key = key.clone();
                        moved_key.extend_from_slice(&k[from.len()..]);
                        let mut entry = v.clone();
                        entry.path = moved_key.iter().fold(LayerPath::root(), |p, c| p.join(c));
                        (moved_key, entry)
                    })
                    .collect();
                moved.insert(key, below);
            }
        }
        for e in &index.entries {
            let key = key_of(e);
            if e.kind.is_whiteout() {
                remove_under(&mut tree, &key, true);
                continue;
            }
            let is_dir = e.kind == EntryKind::Directory;
            let was_dir = tree.get(&key).is_some_and(|old| old.kind == EntryKind::Directory);
            let opaque = is_dir && e.meta.xattrs.iter().any(|x| x.name == OPAQUE && x.value == b"y");
            if (was_dir && !is_dir) || opaque || moved.contains_key(&key) {
                remove_under(&mut tree, &key, false);
            }
            if !opaque {
                if let Some(below) = moved.remove(&key) {
                    for (k, v) in below {
                        tree.insert(k, v);
                    }
                }
            }
            let mut entry = e.clone();
            if let EntryKind::HardLink { target } = &e.kind {
                let t = by_path.get(target).ok_or_else(|| FlattenError::DanglingLink {
                    layer: depth,
                    path: e.path.display_path().display().to_string(),
                    target: target.display_path().display().to_string(),
                })?;
                entry.kind = t.kind.clone();
                entry.meta = t.meta.clone();
            }
            entry.meta.xattrs.retain(|x| !x.name.starts_with(OVERLAY_XATTRS));
            tree.insert(key, entry);
        }
    }
    Ok(LayerIndex {
        entries: tree.into_values().collect(),
    })
}

type Key = Vec<Vec<u8>>;

fn key_of(e: &Entry) -> Key {
    e.path.components().map(<[u8]>::to_vec).collect()
}

/// Where a redirected directory came from: an absolute path from the
/// layer's root, or a name in the same parent directory.
fn redirect_source(key: &[Vec<u8>], value: &[u8]) -> Option<Key> {
    let from: Key = if let Some(abs) = value.strip_prefix(b"/") {
        abs.split(|&b| b == b'/')
            .filter(|c| !c.is_empty())
            .map(<[u8]>::to_vec)
            .collect()
    } else {
        let (_, parent) = key.split_last()?;
        let mut k = parent.to_vec();
        k.push(value.to_vec());
        k
    };
    let valid = !from.is_empty()
        && from
            .iter()
            .all(|c| c != b"." && c != b".." && !c.contains(&b'/') && !c.contains(&0));
    valid.then_some(from)
}

/// Removes everything below `key` (and `key` itself when `and_key`).
fn remove_under(tree: &mut BTreeMap<Key, Entry>, key: &[Vec<u8>], and_key: bool) {
    let doomed: Vec<Key> = tree
        .range(key.to_vec()..)
        .take_while(|(k, _)| k.starts_with(key))
        .filter(|(k, _)| and_key || k.len() > key.len())
        .map(|(k, _)| k.clone())
        .collect();
    for k in doomed {
        tree.remove(&k);
    }
}

#[cfg(test)]
mod tests {
    use cairn_store::FileContent;

    use super::*;
    use crate::archive::index::{Metadata, Timestamp, Xattr};

    fn meta() -> Metadata {
        Metadata {
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: Timestamp { sec: 1, nsec: 0 },
            xattrs: Vec::new(),
        }
    }

    fn path(p: &str) -> LayerPath {
        p.split('/')
            .filter(|c| !c.is_empty())
            .fold(LayerPath::root(), |acc, c| acc.join(c.as_bytes()))
    }

    fn dir(p: &str) -> Entry {
        Entry {
            path: path(p),
            kind: EntryKind::Directory,
            meta: meta(),
        }
    }

    fn file(p: &str, size: u64) -> Entry {
        Entry {
            path: path(p),
            kind: EntryKind::File(FileContent {
                size,
                ..FileContent::default()
            }),
            meta: meta(),
        }
    }

    fn whiteout(p: &str) -> Entry {
        Entry {
            path: path(p),
            kind: EntryKind::CharDevice { major: 0, minor: 0 },
            meta: meta(),
        }
    }

    fn layer(entries: Vec<Entry>) -> LayerIndex {
        let mut all = vec![dir("/")];
        all.extend(entries);
        LayerIndex { entries: all }
    }

    fn paths(index: &LayerIndex) -> Vec<String> {
        index
            .entries
            .iter()
            .map(|e| e.path.display_path().display().to_string())
            .collect()
    }

    fn size_of(index: &LayerIndex, p: &str) -> Option<u64> {
        index
            .entries
            .iter()
            .find(|e| e.path == path(p))
            .and_then(|e| match &e.kind {
                EntryKind::File(c) => Some(c.size),
                _ => None,
            })
    }

    #[test]
    fn upper_entries_win_and_whiteouts_and_opaque_directories_hide_what_is_below() {
        let base = layer(vec![
            dir("/bin"),
            file("/bin/sh", 1),
            file("/bin/ls", 2),
            dir("/etc"),
            file("/etc/passwd", 3),
            dir("/var"),
            dir("/var/log"),
            file("/var/log/old", 4),
        ]);
        let middle = layer(vec![
            dir("/bin"),
            whiteout("/bin/ls"),
            dir("/etc"),
            file("/etc/passwd", 30),
            file("/etc/new", 5),
            whiteout("/var"),
        ]);
        let mut opaque_etc = dir("/etc");
        opaque_etc.meta.xattrs.push(Xattr {
            name: OPAQUE.to_vec(),
            value: b"y".to_vec(),
        });
        let top = layer(vec![opaque_etc, file("/etc/hosts", 6), file("/var", 7)]);
        let flat = flatten(&[&top, &middle, &base]).unwrap();
        flat.validate().unwrap();
        assert_eq!(paths(&flat), ["/", "/bin", "/bin/sh", "/etc", "/etc/hosts", "/var"]);
        assert_eq!(size_of(&flat, "/var"), Some(7), "a file where a directory was");
        assert!(
            flat.entries.iter().all(|e| e.meta.xattrs.is_empty()),
            "overlayfs xattrs are dropped"
        );
        // Without the top layer: the middle's replacement and new file show.
        let flat = flatten(&[&middle, &base]).unwrap();
        assert_eq!(
            paths(&flat),
            ["/", "/bin", "/bin/sh", "/etc", "/etc/new", "/etc/passwd"]
        );
        assert_eq!(size_of(&flat, "/etc/passwd"), Some(30));
    }

    #[test]
    fn a_directory_replacing_a_file_and_hard_links_resolve() {
        let base = layer(vec![file("/a", 1), dir("/d"), file("/d/x", 2)]);
        let upper = layer(vec![
            dir("/a"),
            file("/a/inside", 3),
            dir("/d"),
            file("/d/y", 4),
            Entry {
                path: path("/d/z"),
                kind: EntryKind::HardLink { target: path("/d/y") },
                meta: meta(),
            },
        ]);
        let flat = flatten(&[&upper, &base]).unwrap();
        flat.validate().unwrap();
        assert_eq!(paths(&flat), ["/", "/a", "/a/inside", "/d", "/d/x", "/d/y", "/d/z"]);
        assert_eq!(size_of(&flat, "/d/z"), Some(4), "the link is a copy of its target");
    }

    #[test]
    fn a_renamed_directory_shows_what_was_below_its_old_path() {
        let base = layer(vec![
            dir("/old"),
            file("/old/a", 1),
            dir("/old/sub"),
            file("/old/sub/b", 2),
        ]);
        let mut moved = dir("/new");
        moved.meta.xattrs.push(Xattr {
            name: REDIRECT.to_vec(),
            value: b"/old".to_vec(),
        });
        let mut renamed = dir("/also");
        renamed.meta.xattrs.push(Xattr {
            name: REDIRECT.to_vec(),
            value: b"new".to_vec(),
        });
        let upper = layer(vec![moved, file("/new/c", 3), whiteout("/old")]);
        let flat = flatten(&[&upper, &base]).unwrap();
        flat.validate().unwrap();
        assert_eq!(
            paths(&flat),
            ["/", "/new", "/new/a", "/new/c", "/new/sub", "/new/sub/b"]
        );
        // A rename within the same directory names the old entry only.
        let top = layer(vec![renamed, whiteout("/new")]);
        let flat = flatten(&[&top, &upper, &base]).unwrap();
        assert_eq!(
            paths(&flat),
            ["/", "/also", "/also/a", "/also/c", "/also/sub", "/also/sub/b"]
        );
        let mut bad = dir("/x");
        bad.meta.xattrs.push(Xattr {
            name: REDIRECT.to_vec(),
            value: b"/../etc".to_vec(),
        });
        assert!(matches!(
            flatten(&[&layer(vec![bad]), &base]),
            Err(FlattenError::Redirect { .. })
        ));
    }
}
