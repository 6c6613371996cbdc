//! Printing snapshots: a table, a lineage tree, or JSON.

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use cairn_engine::SnapshotRecord;
use serde::Serialize;

pub(crate) fn size(bytes: u64) -> String {
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

/// When each snapshot became durable in the remote store, by id; `None`
/// for a home whose chunks stay on this host.
pub type Durability = Option<HashMap<String, i64>>;

/// A snapshot as `--json` prints it: the record and its remote durability.
#[derive(Serialize)]
struct Listed<'a> {
    #[serde(flatten)]
    record: &'a SnapshotRecord,
    /// Null while uploads are pending, and for a home without a remote store.
    remote_durable_at: Option<i64>,
}

fn durable_at(s: &SnapshotRecord, durable: &Durability) -> Option<i64> {
    durable.as_ref().and_then(|d| d.get(&s.id).copied())
}

/// "durable" or "pending" with a remote store; nothing without one.
fn remote_word(s: &SnapshotRecord, durable: &Durability) -> Option<&'static str> {
    durable
        .as_ref()
        .map(|d| if d.contains_key(&s.id) { "durable" } else { "pending" })
}

fn line(s: &SnapshotRecord, durable: &Durability) -> String {
    format!(
        "{}  sandbox {}  {}  new {}  stored {}  {} layers{}{}",
        &s.id[..12],
        s.sandbox_id,
        when(s.created_at),
        size(s.new_bytes),
        size(s.stored_bytes),
        s.layers.len(),
        remote_word(s, durable)
            .map(|w| format!("  remote {w}"))
            .unwrap_or_default(),
        s.label.as_deref().map(|l| format!("  [{l}]")).unwrap_or_default()
    )
}

pub fn print(snaps: &[SnapshotRecord], durable: &Durability, tree: bool, json: bool) -> Result<()> {
    if json {
        let listed: Vec<Listed> = snaps
            .iter()
            .map(|record| Listed {
                record,
                remote_durable_at: durable_at(record, durable),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(());
    }
    if !tree {
        // The REMOTE column only for a home with a remote store.
        let remote = |s: Option<&SnapshotRecord>| match (durable, s) {
            (None, _) => String::new(),
            (Some(_), None) => format!("  {:<8}", "REMOTE"),
            (Some(_), Some(s)) => format!("  {:<8}", remote_word(s, durable).unwrap_or_default()),
        };
        println!(
            "{:<12}  {:<12}  {:<12}  {:>8}  {:>8}  {:<10}{}  LABEL",
            "ID",
            "PARENT",
            "SANDBOX",
            "NEW",
            "STORED",
            "CREATED",
            remote(None)
        );
        for s in snaps {
            println!(
                "{:<12}  {:<12}  {:<12}  {:>8}  {:>8}  {:<10}{}  {}",
                &s.id[..12],
                s.parent_id.as_deref().map(|p| &p[..12]).unwrap_or("-"),
                s.sandbox_id,
                size(s.new_bytes),
                size(s.stored_bytes),
                when(s.created_at),
                remote(Some(s)),
                s.label.as_deref().unwrap_or("")
            );
        }
        return Ok(());
    }
    print_tree(snaps, |s| &s.id, |s| s.parent_id.as_deref(), |s| line(s, durable));
    Ok(())
}

/// One snapshot, field by field (or as JSON).
pub fn show(s: &SnapshotRecord, durable: &Durability, json: bool) -> Result<()> {
    if json {
        let listed = Listed {
            record: s,
            remote_durable_at: durable_at(s, durable),
        };
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(());
    }
    println!("id        {}", s.id);
    println!("parent    {}", s.parent_id.as_deref().unwrap_or("-"));
    println!("sandbox   {}", s.sandbox_id);
    println!("image     {}", s.image);
    println!("driver    {}", s.driver);
    println!("label     {}", s.label.as_deref().unwrap_or("-"));
    println!("created   {} ({})", when(s.created_at), s.created_at);
    println!("new       {}", size(s.new_bytes));
    println!("stored    {}", size(s.stored_bytes));
    println!("layers    {}", s.layers.len());
    if durable.is_some() {
        match durable_at(s, durable) {
            Some(at) => println!("remote    durable since {} ({at})", when(at)),
            None => println!("remote    pending: only this host can restore it until its uploads finish"),
        }
    }
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
