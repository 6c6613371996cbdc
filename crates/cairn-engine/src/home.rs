//! The state directory (`$CAIRN_HOME`, default `~/.local/share/cairn`).
//!
//! ```text
//! state.db            SQLite state (WAL)
//! lib/                the installed cairn-init executable
//! layers/<id>/        read-only layer directories
//! sandboxes/<id>/     upper/, work/, rootfs/, init.sock, console.log
//! ```

use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Home {
    root: PathBuf,
}

impl Home {
    /// `$CAIRN_HOME`, else `$XDG_DATA_HOME/cairn`, else `~/.local/share/cairn`.
    pub fn from_env() -> Home {
        if let Some(h) = std::env::var_os("CAIRN_HOME").filter(|h| !h.is_empty()) {
            return Home::at(h);
        }
        if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|h| !h.is_empty()) {
            return Home::at(PathBuf::from(x).join("cairn"));
        }
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/root"));
        Home::at(home.join(".local/share/cairn"))
    }

    pub fn at(root: impl Into<PathBuf>) -> Home {
        let root: PathBuf = root.into();
        // Overlay options and socket paths want an absolute, clean path.
        let root = std::path::absolute(&root).unwrap_or(root);
        Home { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn db(&self) -> PathBuf {
        self.root.join("state.db")
    }
    pub fn lib(&self) -> PathBuf {
        self.root.join("lib")
    }
    pub fn layers(&self) -> PathBuf {
        self.root.join("layers")
    }
    pub fn sandboxes(&self) -> PathBuf {
        self.root.join("sandboxes")
    }
    pub fn sandbox(&self, id: &str) -> PathBuf {
        self.sandboxes().join(id)
    }
    pub fn scratch(&self) -> PathBuf {
        self.root.join("tmp")
    }
}
