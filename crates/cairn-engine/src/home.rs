//! The state directory (`$CAIRN_HOME`, default `~/.local/share/cairn`).
//!
//! ```text
//! state.db            SQLite state (WAL)
//! lib/                the installed cairn-init executable
//! store/              chunk store (layers, manifests, file contents)
//! layers/<id>/        read-only layer directories, materialised from the store
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

    /// A short stable name for this state directory, which keeps its host
    /// resources (cgroups) apart from those of other state directories.
    pub fn scope(&self) -> String {
        blake3::hash(self.root.as_os_str().as_encoded_bytes()).to_hex()[..12].to_string()
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
    /// The chunk store: layers, snapshot manifests, file contents.
    pub fn store(&self) -> PathBuf {
        self.root.join("store")
    }
    /// Held shared by snapshot writers, exclusively by the store's GC.
    pub fn store_lock(&self) -> PathBuf {
        self.root.join("store.lock")
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
    /// Local copies of memory snapshots' checkpoint images, as the driver
    /// wrote them, so a restore on this host reads them directly.
    pub fn memory_images(&self) -> PathBuf {
        self.root.join("memory")
    }
    pub fn memory_image(&self, snapshot: &str) -> PathBuf {
        self.memory_images().join(snapshot)
    }
}
