//! What differs between two merged trees ([`super::merged_view`]), from
//! their indexes alone: a file's content is its chunk list (or its inline
//! bytes), so two files are equal when their chunks are, and nothing is
//! read. Both trees are in pre-order with siblings sorted by name bytes,
//! so one pass over the two lists in step finds every difference.

use std::cmp::Ordering;

use super::index::{Entry, EntryKind, LayerIndex};

/// How a path differs between the two trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// Only in the second tree.
    Added,
    /// Only in the first tree.
    Removed,
    /// In both, different (see [`Change::what`]).
    Changed,
}

/// One path that differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change<'a> {
    pub kind: ChangeKind,
    /// The entry in the first tree (none when added).
    pub before: Option<&'a Entry>,
    /// The entry in the second tree (none when removed).
    pub after: Option<&'a Entry>,
    /// For a change, what differs, in this order: `type`, `content`
    /// (a file's bytes, a symlink's target, a device's numbers), `mode`,
    /// `owner`. A modification time alone is not a change.
    pub what: Vec<&'static str>,
}

impl Change<'_> {
    /// The entry this change is about (the second tree's where both have one).
    pub fn entry(&self) -> &Entry {
        self.after.or(self.before).expect("a change has an entry")
    }
}

/// Orders two paths as the trees list them: component by component, a
/// parent before its children.
fn path_order(a: &Entry, b: &Entry) -> Ordering {
    a.path.components().cmp(b.path.components())
}

/// Every path where `b` differs from `a`, in `b`'s order (added, removed
/// and changed merged by path). Everything under an added or removed
/// directory is listed too.
pub fn diff_trees<'a>(a: &'a LayerIndex, b: &'a LayerIndex) -> Vec<Change<'a>> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    let (xs, ys) = (&a.entries, &b.entries);
    while i < xs.len() || j < ys.len() {
        let order = match (xs.get(i), ys.get(j)) {
            (Some(x), Some(y)) => path_order(x, y),
            (Some(_), None) => Ordering::Less,
            _ => Ordering::Greater,
        };
        match order {
            Ordering::Less => {
                out.push(Change {
                    kind: ChangeKind::Removed,
                    before: Some(&xs[i]),
                    after: None,
                    what: Vec::new(),
                });
                i += 1;
            }
            Ordering::Greater => {
                out.push(Change {
                    kind: ChangeKind::Added,
                    before: None,
                    after: Some(&ys[j]),
                    what: Vec::new(),
                });
                j += 1;
            }
            Ordering::Equal => {
                let what = differences(&xs[i], &ys[j]);
                if !what.is_empty() {
                    out.push(Change {
                        kind: ChangeKind::Changed,
                        before: Some(&xs[i]),
                        after: Some(&ys[j]),
                        what,
                    });
                }
                i += 1;
                j += 1;
            }
        }
    }
    out
}

/// The name of an entry's type as Cairn reports it.
pub fn kind_name(kind: &EntryKind) -> &'static str {
    match kind {
        EntryKind::Directory => "directory",
        EntryKind::File(_) | EntryKind::SmallFile { .. } | EntryKind::HardLink { .. } => "file",
        EntryKind::Symlink { .. } => "symlink",
        EntryKind::Fifo => "fifo",
        EntryKind::Socket => "socket",
        EntryKind::CharDevice { .. } | EntryKind::BlockDevice { .. } => "device",
    }
}

fn differences(x: &Entry, y: &Entry) -> Vec<&'static str> {
    let mut what = Vec::new();
    if kind_name(&x.kind) != kind_name(&y.kind) {
        what.push("type");
    } else if !same_content(&x.kind, &y.kind) {
        what.push("content");
    }
    if x.meta.mode != y.meta.mode {
        what.push("mode");
    }
    if (x.meta.uid, x.meta.gid) != (y.meta.uid, y.meta.gid) {
        what.push("owner");
    }
    what
}

/// Whether two entries of the same type hold the same content. Chunks are
/// cut by content, so equal bytes give equal chunk lists; a file small
/// enough to be held inline is always held inline.
fn same_content(x: &EntryKind, y: &EntryKind) -> bool {
    match (x, y) {
        (EntryKind::File(a), EntryKind::File(b)) => {
            a.size == b.size
                && a.chunks.len() == b.chunks.len()
                && a.chunks
                    .iter()
                    .zip(&b.chunks)
                    .all(|(p, q)| (p.offset, p.len, p.hash) == (q.offset, q.len, q.hash))
        }
        (EntryKind::SmallFile { data: a }, EntryKind::SmallFile { data: b }) => a == b,
        (EntryKind::File(_), EntryKind::SmallFile { .. }) | (EntryKind::SmallFile { .. }, EntryKind::File(_)) => false,
        (a, b) => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::archive::index::{LayerPath, Metadata, Timestamp};

    fn meta(mode: u32) -> Metadata {
        Metadata {
            mode,
            uid: 0,
            gid: 0,
            mtime: Timestamp { sec: 1, nsec: 0 },
            xattrs: Vec::new(),
        }
    }

    fn entry(path: &str, kind: EntryKind, mode: u32) -> Entry {
        let path = path
            .split('/')
            .filter(|c| !c.is_empty())
            .fold(LayerPath::root(), |p, c| p.join(c.as_bytes()));
        Entry {
            path,
            kind,
            meta: meta(mode),
        }
    }

    fn small(data: &str) -> EntryKind {
        EntryKind::SmallFile {
            data: data.as_bytes().to_vec(),
        }
    }

    fn tree(entries: Vec<Entry>) -> LayerIndex {
        let t = LayerIndex { entries };
        t.validate().unwrap();
        t
    }

    #[test]
    fn added_removed_and_changed_paths_are_found_in_one_pass_in_tree_order() {
        let a = tree(vec![
            entry("", EntryKind::Directory, 0o755),
            entry("a", EntryKind::Directory, 0o755),
            entry("a/gone", small("x"), 0o644),
            entry("a/same", small("same"), 0o644),
            entry("a/text", small("one"), 0o644),
            entry("ab", small("mode"), 0o644),
            entry("link", EntryKind::Symlink { target: b"a".to_vec() }, 0o777),
        ]);
        let mut touched = entry("a/same", small("same"), 0o644);
        touched.meta.mtime.sec = 99;
        let b = tree(vec![
            entry("", EntryKind::Directory, 0o755),
            entry("a", EntryKind::Directory, 0o755),
            entry("a/new", EntryKind::Directory, 0o700),
            entry("a/new/f", small("f"), 0o600),
            touched,
            entry("a/text", small("two"), 0o644),
            entry("ab", small("mode"), 0o755),
            entry("link", small("now a file"), 0o644),
        ]);
        let changes: Vec<(String, ChangeKind, Vec<&str>)> = diff_trees(&a, &b)
            .iter()
            .map(|c| {
                (
                    c.entry().path.display_path().display().to_string(),
                    c.kind,
                    c.what.clone(),
                )
            })
            .collect();
        assert_eq!(
            changes,
            vec![
                ("/a/gone".into(), ChangeKind::Removed, vec![]),
                ("/a/new".into(), ChangeKind::Added, vec![]),
                ("/a/new/f".into(), ChangeKind::Added, vec![]),
                ("/a/text".into(), ChangeKind::Changed, vec!["content"]),
                ("/ab".into(), ChangeKind::Changed, vec!["mode"]),
                ("/link".into(), ChangeKind::Changed, vec!["type", "mode"]),
            ]
        );
        assert!(diff_trees(&a, &a).is_empty(), "a tree does not differ from itself");
        let back: Vec<ChangeKind> = diff_trees(&b, &a).iter().map(|c| c.kind).collect();
        assert_eq!(back.iter().filter(|k| **k == ChangeKind::Added).count(), 1);
        assert_eq!(back.iter().filter(|k| **k == ChangeKind::Removed).count(), 2);
    }

    #[test]
    fn files_are_compared_by_their_chunks_not_their_names_for_them() {
        use cairn_store::{ChunkHash, ChunkRef, FileContent};
        let chunked = |h: u8| {
            EntryKind::File(FileContent {
                size: 10_000,
                chunks: vec![ChunkRef {
                    offset: 0,
                    len: 10_000,
                    hash: ChunkHash::from_bytes([h; 32]),
                }],
            })
        };
        let root = || entry("", EntryKind::Directory, 0o755);
        let a = tree(vec![root(), entry("big", chunked(1), 0o644)]);
        let same = tree(vec![root(), entry("big", chunked(1), 0o644)]);
        let other = tree(vec![root(), entry("big", chunked(2), 0o644)]);
        assert!(diff_trees(&a, &same).is_empty());
        assert_eq!(diff_trees(&a, &other)[0].what, vec!["content"]);
    }
}
