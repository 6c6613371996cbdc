//! Printing snapshots: a table, a lineage tree, or JSON.

use std::collections::BTreeMap;

use anyhow::Result;
use cairn_engine::SnapshotRecord;

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1}G", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1}M", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1}K", b as f64 / 1024.0),
        b => format!("{b}B"),
    }
}

fn when(ms: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let secs = (now - ms).max(0) / 1000;
    match secs {
        s if s < 60 => format!("{s}s ago"),
        s if s < 3600 => format!("{}m ago", s / 60),
        s if s < 86400 => format!("{}h ago", s / 3600),
        s => format!("{}d ago", s / 86400),
    }
}

fn line(s: &SnapshotRecord) -> String {
    format!(
        "{}  sandbox {}  {}  new {}  stored {}  {} layers{}",
        &s.id[..12],
        s.sandbox_id,
        when(s.created_at),
        size(s.new_bytes),
        size(s.stored_bytes),
        s.layers.len(),
        s.label.as_deref().map(|l| format!("  [{l}]")).unwrap_or_default()
    )
}

pub fn print(snaps: &[SnapshotRecord], tree: bool, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(snaps)?);
        return Ok(());
    }
    if !tree {
        println!(
            "{:<12}  {:<12}  {:<12}  {:>8}  {:>8}  {:<10}  LABEL",
            "ID", "PARENT", "SANDBOX", "NEW", "STORED", "CREATED"
        );
        for s in snaps {
            println!(
                "{:<12}  {:<12}  {:<12}  {:>8}  {:>8}  {:<10}  {}",
                &s.id[..12],
                s.parent_id.as_deref().map(|p| &p[..12]).unwrap_or("-"),
                s.sandbox_id,
                size(s.new_bytes),
                size(s.stored_bytes),
                when(s.created_at),
                s.label.as_deref().unwrap_or("")
            );
        }
        return Ok(());
    }
    print_tree(snaps, |s| &s.id, |s| s.parent_id.as_deref(), line);
    Ok(())
}

/// Prints `items` as a forest: each under its parent, roots (and items
/// whose parent is not among them) at the left.
pub fn print_tree<T>(
    items: &[T],
    id: impl Fn(&T) -> &str,
    parent: impl Fn(&T) -> Option<&str>,
    line: impl Fn(&T) -> String,
) {
    let known: std::collections::HashSet<&str> = items.iter().map(&id).collect();
    let mut children: BTreeMap<Option<&str>, Vec<&T>> = BTreeMap::new();
    for item in items {
        // A parent that was removed makes its children roots.
        let p = parent(item).filter(|p| known.contains(p));
        children.entry(p).or_default().push(item);
    }
    let mut stack: Vec<(&T, String, bool)> = Vec::new();
    let roots = children.get(&None).cloned().unwrap_or_default();
    for (i, r) in roots.iter().enumerate().rev() {
        stack.push((r, String::new(), i + 1 == roots.len()));
    }
    while let Some((node, prefix, last)) = stack.pop() {
        println!("{prefix}{}{}", if last { "└─ " } else { "├─ " }, line(node));
        let kids = children.get(&Some(id(node))).map(Vec::as_slice).unwrap_or(&[]);
        let next = format!("{prefix}{}", if last { "   " } else { "│  " });
        for (i, k) in kids.iter().enumerate().rev() {
            stack.push((k, next.clone(), i + 1 == kids.len()));
        }
    }
}
