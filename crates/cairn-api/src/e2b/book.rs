//! The E2B sandboxes the gateway knows, by the id the SDK holds: which
//! Cairn sandbox runs each one now, or which snapshot holds it while
//! paused; its access token, lifetime, metadata and environment.
//!
//! Durable in `$CAIRN_HOME/e2b.json` (version 1, written to a temporary
//! and renamed, mode 0600 as it holds access tokens): a paused sandbox
//! must survive a server restart, or its files are unreachable by the id
//! the client keeps.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use cairn_engine::Home;
use serde::{Deserialize, Serialize};

const FORMAT_VERSION: u32 = 1;
/// A book larger than this is refused rather than read.
const MAX_BYTES: u64 = 64 << 20;

/// Where an E2B sandbox is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Life {
    /// Running as this Cairn sandbox.
    Running { sandbox: String },
    /// Paused: its files are this snapshot; nothing runs.
    Paused { snapshot: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub id: String,
    pub template: String,
    pub token: String,
    pub life: Life,
    pub started_ms: i64,
    /// When the sandbox times out (it is then removed, or paused with
    /// `auto_pause`).
    pub end_ms: i64,
    pub auto_pause: bool,
    pub metadata: BTreeMap<String, String>,
    /// Environment for every process.
    pub env: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u64,
}

impl Entry {
    pub fn running(&self) -> Option<&str> {
        match &self.life {
            Life::Running { sandbox } => Some(sandbox),
            Life::Paused { .. } => None,
        }
    }
}

/// A snapshot made through `create_snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotEntry {
    pub id: String,
    pub name: String,
    /// The E2B sandbox it was taken of.
    pub sandbox: String,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Book {
    version: u32,
    sandboxes: BTreeMap<String, Entry>,
    snapshots: Vec<SnapshotEntry>,
}

fn path(home: &Home) -> PathBuf {
    home.root().join("e2b.json")
}

impl Book {
    pub fn load(home: &Home) -> Result<Book, String> {
        let p = path(home);
        let meta = match std::fs::metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Book::default()),
            Err(e) => return Err(format!("{}: {e}", p.display())),
        };
        if meta.len() > MAX_BYTES {
            return Err(format!("{} is larger than {MAX_BYTES} bytes", p.display()));
        }
        let bytes = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let book: Book = serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", p.display()))?;
        if book.version != FORMAT_VERSION {
            return Err(format!(
                "{} has format version {}, this Cairn reads {FORMAT_VERSION}",
                p.display(),
                book.version
            ));
        }
        Ok(book)
    }

    pub fn save(&mut self, home: &Home) -> std::io::Result<()> {
        self.version = FORMAT_VERSION;
        let p = path(home);
        let mut tmp = tempfile::NamedTempFile::new_in(home.root())?;
        // NamedTempFile creates it 0600.
        tmp.write_all(&serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        tmp.as_file().sync_all()?;
        tmp.persist(&p).map_err(|e| e.error)?;
        Ok(())
    }

    pub fn get(&self, id: &str) -> Option<&Entry> {
        self.sandboxes.get(id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Entry> {
        self.sandboxes.get_mut(id)
    }

    pub fn insert(&mut self, e: Entry) {
        self.sandboxes.insert(e.id.clone(), e);
    }

    pub fn remove(&mut self, id: &str) -> Option<Entry> {
        self.sandboxes.remove(id)
    }

    pub fn all(&self) -> impl Iterator<Item = &Entry> {
        self.sandboxes.values()
    }

    pub fn snapshots(&self) -> &[SnapshotEntry] {
        &self.snapshots
    }

    pub fn add_snapshot(&mut self, s: SnapshotEntry) {
        self.snapshots.push(s);
    }

    pub fn remove_snapshot(&mut self, id: &str) -> Option<SnapshotEntry> {
        let i = self.snapshots.iter().position(|s| s.id == id)?;
        Some(self.snapshots.remove(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_book_round_trips_and_a_future_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::at(dir.path().to_path_buf());
        let mut b = Book::default();
        b.insert(Entry {
            id: "abc".into(),
            template: "base".into(),
            token: "t".into(),
            life: Life::Paused { snapshot: "s1".into() },
            started_ms: 1,
            end_ms: 2,
            auto_pause: false,
            metadata: BTreeMap::new(),
            env: BTreeMap::new(),
            cpu_count: 1,
            memory_mb: 0,
        });
        b.save(&home).unwrap();
        let back = Book::load(&home).unwrap();
        assert_eq!(back.get("abc").unwrap().life, Life::Paused { snapshot: "s1".into() });
        std::fs::write(path(&home), br#"{"version":9,"sandboxes":{},"snapshots":[]}"#).unwrap();
        assert!(Book::load(&home).unwrap_err().contains("format version 9"));
    }
}
