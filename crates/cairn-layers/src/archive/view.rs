//! What a stack of layers shows at one path, read from the layer indexes
//! alone: no layer directory is opened, so nothing a sandbox wrote (a
//! symlink pointing out of the layer, say) can be followed. The stack is
//! merged as [`flatten`] merges it (whiteouts, opaque directories,
//! redirects), after regular files marked as whiteouts by xattr (the
//! `trusted.overlay.whiteout` files of a directory marked
//! `trusted.overlay.opaque=x`, which overlayfs honours in lower layers
//! since Linux 6.7) are made whiteouts. Cairn's overlays use the
//! `trusted.overlay.*` names; `user.overlay.*` xattrs are a sandbox's own
//! to set and change nothing here.

use std::borrow::Cow;

use super::flatten::{flatten, FlattenError};
use super::index::{Entry, EntryKind, LayerIndex, LayerPath};

const XWHITEOUT: &[u8] = b"trusted.overlay.whiteout";
const OPAQUE: &[u8] = b"trusted.overlay.opaque";
/// The older name of the directory mark (Linux 6.7 and 6.8).
const XWHITEOUTS: &[u8] = b"trusted.overlay.whiteouts";

/// What the merged tree holds at a path.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup<'a> {
    /// The entry; for a directory, its children in name order (at most the
    /// number asked for) and whether there are more.
    Found {
        entry: &'a Entry,
        children: Vec<&'a Entry>,
        more: bool,
    },
    Missing,
    /// A component on the way is a symlink, which is not followed.
    BelowSymlink {
        at: LayerPath,
        target: &'a [u8],
    },
    /// A component on the way is neither a directory nor a symlink.
    BelowNonDirectory {
        at: LayerPath,
    },
}

/// The tree `stack` (topmost first) shows, as one index in pre-order.
pub fn merged_view(stack: &[&LayerIndex]) -> Result<LayerIndex, FlattenError> {
    let marked: Vec<Cow<LayerIndex>> = stack.iter().map(|index| xwhiteouts_as_whiteouts(index)).collect();
    flatten(&marked.iter().map(|index| index.as_ref()).collect::<Vec<_>>())
}

/// The index as it is when no directory is marked (the common case), else
/// a copy with the marked files made whiteouts.
fn xwhiteouts_as_whiteouts(index: &LayerIndex) -> Cow<'_, LayerIndex> {
    let marked_dirs: std::collections::HashSet<&LayerPath> = index
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Directory)
        .filter(|e| {
            e.meta
                .xattrs
                .iter()
                .any(|x| (x.name == OPAQUE && x.value == b"x") || x.name == XWHITEOUTS)
        })
        .map(|e| &e.path)
        .collect();
    if marked_dirs.is_empty() {
        return Cow::Borrowed(index);
    }
    let mut out = index.clone();
    for e in &mut out.entries {
        let in_marked = e
            .path
            .split_last()
            .is_some_and(|(parent, _)| marked_dirs.contains(&LayerPath::from_bytes(parent)));
        let marked = e.kind.is_file() && e.meta.xattrs.iter().any(|x| x.name == XWHITEOUT);
        if in_marked && marked {
            e.kind = EntryKind::CharDevice { major: 0, minor: 0 };
        }
    }
    Cow::Owned(out)
}

/// Looks `path` up in a merged tree (from [`merged_view`]), listing at
/// most `max_children` children of a directory.
pub fn lookup<'a>(tree: &'a LayerIndex, path: &LayerPath, max_children: usize) -> Lookup<'a> {
    // One pass to index the paths: a deep path costs a lookup per
    // component, not a scan of the tree per component.
    let by_path: std::collections::HashMap<&LayerPath, &Entry> = tree.entries.iter().map(|e| (&e.path, e)).collect();
    let find = |p: &LayerPath| by_path.get(p).copied();
    let mut at = LayerPath::root();
    let components: Vec<&[u8]> = path.components().collect();
    for (i, c) in components.iter().enumerate() {
        at = at.join(c);
        let Some(entry) = find(&at) else {
            return Lookup::Missing;
        };
        let last = i + 1 == components.len();
        match &entry.kind {
            _ if last => break,
            EntryKind::Directory => {}
            EntryKind::Symlink { target } => return Lookup::BelowSymlink { at, target },
            _ => return Lookup::BelowNonDirectory { at },
        }
    }
    let Some(entry) = find(&at) else {
        return Lookup::Missing;
    };
    let mut children = Vec::new();
    let mut more = false;
    if entry.kind == EntryKind::Directory {
        let depth = at.components().count() + 1;
        let under = tree.entries.iter().filter(|e| {
            e.path.components().count() == depth
                && e.path.split_last().is_some_and(|(parent, _)| parent == at.as_bytes())
        });
        for child in under {
            if children.len() == max_children {
                more = true;
                break;
            }
            children.push(child);
        }
    }
    Lookup::Found { entry, children, more }
}

#[cfg(test)]
mod tests {
    use cairn_store::FileContent;

    use super::*;
    use crate::archive::index::{Metadata, Timestamp, Xattr};

    fn meta(xattrs: &[(&[u8], &[u8])]) -> Metadata {
        Metadata {
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: Timestamp { sec: 1, nsec: 0 },
            xattrs: xattrs
                .iter()
                .map(|(n, v)| Xattr {
                    name: n.to_vec(),
                    value: v.to_vec(),
                })
                .collect(),
        }
    }

    fn path(p: &str) -> LayerPath {
        p.split('/')
            .filter(|c| !c.is_empty())
            .fold(LayerPath::root(), |acc, c| acc.join(c.as_bytes()))
    }

    fn entry(p: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path(p),
            kind,
            meta: meta(&[]),
        }
    }

    fn file(p: &str, size: u64) -> Entry {
        entry(
            p,
            EntryKind::File(FileContent {
                size,
                ..FileContent::default()
            }),
        )
    }

    fn layer(entries: Vec<Entry>) -> LayerIndex {
        let mut all = vec![entry("/", EntryKind::Directory)];
        all.extend(entries);
        LayerIndex { entries: all }
    }

    fn size(l: &Lookup) -> Option<u64> {
        match l {
            Lookup::Found {
                entry: Entry {
                    kind: EntryKind::File(c),
                    ..
                },
                ..
            } => Some(c.size),
            _ => None,
        }
    }

    fn names(l: &Lookup) -> Vec<String> {
        match l {
            Lookup::Found { children, .. } => children
                .iter()
                .map(|c| String::from_utf8_lossy(c.path.split_last().unwrap().1).into_owned())
                .collect(),
            other => panic!("not found: {other:?}"),
        }
    }

    #[test]
    fn the_top_layer_wins_and_whiteouts_delete() {
        let lower = layer(vec![
            entry("/w", EntryKind::Directory),
            file("/w/keep", 1),
            file("/w/gone", 2),
            file("/w/changed", 3),
        ]);
        let upper = layer(vec![
            entry("/w", EntryKind::Directory),
            file("/w/changed", 30),
            entry("/w/gone", EntryKind::CharDevice { major: 0, minor: 0 }),
            entry(
                "/w/out",
                EntryKind::Symlink {
                    target: b"/etc/shadow".to_vec(),
                },
            ),
        ]);
        let tree = merged_view(&[&upper, &lower]).unwrap();
        assert_eq!(size(&lookup(&tree, &path("/w/changed"), 10)), Some(30));
        assert_eq!(lookup(&tree, &path("/w/gone"), 10), Lookup::Missing);
        assert_eq!(names(&lookup(&tree, &path("/w"), 10)), ["changed", "keep", "out"]);
        let listed = lookup(&tree, &path("/w"), 2);
        assert!(matches!(listed, Lookup::Found { ref children, more: true, .. } if children.len() == 2));
        let link = lookup(&tree, &path("/w/out"), 10);
        assert!(matches!(
            link,
            Lookup::Found {
                entry: Entry {
                    kind: EntryKind::Symlink { .. },
                    ..
                },
                ..
            }
        ));
        let through = lookup(&tree, &path("/w/out/x"), 10);
        assert_eq!(
            through,
            Lookup::BelowSymlink {
                at: path("/w/out"),
                target: b"/etc/shadow"
            }
        );
        assert_eq!(
            lookup(&tree, &path("/w/keep/x"), 10),
            Lookup::BelowNonDirectory { at: path("/w/keep") }
        );
        assert_eq!(names(&lookup(&tree, &LayerPath::root(), 10)), ["w"]);
    }

    #[test]
    fn an_opaque_directory_hides_what_was_below_it() {
        let lower = layer(vec![entry("/d", EntryKind::Directory), file("/d/old", 1)]);
        let mut opaque = entry("/d", EntryKind::Directory);
        opaque.meta = meta(&[(b"trusted.overlay.opaque", b"y")]);
        let upper = layer(vec![opaque, file("/d/new", 2)]);
        let tree = merged_view(&[&upper, &lower]).unwrap();
        assert_eq!(names(&lookup(&tree, &path("/d"), 10)), ["new"]);
    }

    #[test]
    fn xattr_whiteouts_delete_only_in_a_marked_directory_and_only_by_trusted_name() {
        let lower = layer(vec![
            entry("/d", EntryKind::Directory),
            file("/d/a", 1),
            file("/d/b", 1),
            file("/d/c", 1),
        ]);
        let mut marked = entry("/d", EntryKind::Directory);
        marked.meta = meta(&[(b"trusted.overlay.opaque", b"x")]);
        let mut xwhiteout = file("/d/a", 0);
        xwhiteout.meta = meta(&[(b"trusted.overlay.whiteout", b"")]);
        let mut user_marked = file("/d/b", 0);
        user_marked.meta = meta(&[(b"user.overlay.whiteout", b"")]);
        let upper = layer(vec![marked, xwhiteout, user_marked]);
        let tree = merged_view(&[&upper, &lower]).unwrap();
        assert_eq!(names(&lookup(&tree, &path("/d"), 10)), ["b", "c"]);
        assert_eq!(size(&lookup(&tree, &path("/d/b"), 10)), Some(0));
        // Outside a marked directory the xattr is just an xattr.
        let mut unmarked = file("/a", 5);
        unmarked.meta = meta(&[(b"trusted.overlay.whiteout", b"")]);
        let tree = merged_view(&[&layer(vec![unmarked])]).unwrap();
        assert_eq!(size(&lookup(&tree, &path("/a"), 10)), Some(5));
    }
}
