//! `cairn session export` and `cairn session import`: a session as one file.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, IsTerminal, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use cairn_engine::Engine;
use cairn_session::prelude::*;

use crate::progress::Steps;

/// Writes the bundle to `output` (a file, written whole under a temporary
/// name and renamed into place) or to standard output.
pub fn export(engine: &mut Engine, id: &str, output: Option<&Path>) -> Result<()> {
    let progress = Steps::new();
    let summary = match output.filter(|p| *p != Path::new("-")) {
        Some(path) => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            let tmp = tempfile::Builder::new()
                .prefix(".cairn-export-")
                .tempfile_in(dir)
                .with_context(|| format!("cannot write in {}", dir.display()))?;
            let mut out = BufWriter::new(tmp);
            let summary = engine.export_session(id, &mut out, &progress)?;
            let tmp = out.into_inner().map_err(|e| e.into_error())?;
            tmp.as_file().sync_all()?;
            tmp.persist(path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            summary
        }
        None => {
            let stdout = io::stdout();
            if stdout.is_terminal() {
                bail!(
                    "refusing to write a binary session bundle to a terminal; give -o FILE or redirect standard output"
                );
            }
            let mut out = BufWriter::new(stdout.lock());
            let summary = engine.export_session(id, &mut out, &progress)?;
            out.flush()?;
            summary
        }
    };
    drop(progress);
    if let Some(snap) = &summary.snapshot_taken {
        eprintln!("cairn: snapshotted the running session first: snapshot {snap}");
    }
    eprintln!(
        "cairn: exported session {}: {} entries, {} snapshots, {} objects ({:.1} MiB)",
        summary.session,
        summary.entries,
        summary.snapshots,
        summary.objects,
        summary.object_bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// Imports the bundle in `file` (`-`: standard input).
pub fn import(engine: &mut Engine, file: &str, name: Option<String>, json: bool) -> Result<()> {
    let progress = Steps::new();
    let summary = if file == "-" {
        engine.import_session(&mut BufReader::new(io::stdin().lock()), name, &progress)?
    } else {
        let f = File::open(file).with_context(|| format!("cannot open {file}"))?;
        engine.import_session(&mut BufReader::new(f), name, &progress)?
    };
    drop(progress);
    if let Some(note) = &summary.image_note {
        eprintln!("cairn: note: {note}");
    }
    let s = &summary.session;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        eprintln!(
            "cairn: imported session {} as {} ({}): {} entries, {} snapshots, {} objects ({} new); \
             `cairn session resume {}` or `cairn session exec {} -- CMD` continues it",
            summary.source_id,
            s.id,
            s.name,
            summary.entries,
            summary.snapshots,
            summary.objects,
            summary.objects_new,
            s.id,
            s.id
        );
        println!("{}", s.id);
    }
    Ok(())
}
