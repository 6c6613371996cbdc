//! The state directory (`$CAIRN_HOME`, default `~/.local/share/cairn`).
//!
//! ```text
//! state.db            SQLite state (WAL), unless --state names a PostgreSQL database
//! home-id             this directory's identity, which a PostgreSQL state store records
//! lib/                the installed cairn-init executable
//! store/              chunk store (layers, manifests, file contents)
//! layers/<id>/        read-only layer directories, materialised from the store
//! shifted/<id>/       copies of layers with shifted ids, where the kernel takes no idmapped layers
//! layer-mount.json    how this kernel takes layers (the layer probe's answer)
//! sandboxes/<id>/     upper/, work/, rootfs/, init.sock (native) or uds/ (gvisor), console.log
//! tmp/<writer>-…/     scratch, named after its process; gc removes it once that process is dead
//! ```

use std::io::{self, Write};
use std::path::{Path, PathBuf};

#[derive(Clone)]
pub struct Home {
    root: PathBuf,
    /// `--state`/`CAIRN_STATE`: where the state store is (None: `state.db`).
    state: Option<String>,
    /// `--store`/`CAIRN_STORE`: the S3 store chunks go to, the directory's
    /// `store` its cache (None: the directory's `store` alone).
    store: Option<String>,
}

impl std::fmt::Debug for Home {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The state URL may hold a password.
        f.debug_struct("Home")
            .field("root", &self.root)
            .field("state", &self.state.as_deref().map(crate::postgresql::redact))
            .finish()
    }
}

impl Home {
    /// `$CAIRN_HOME`, else `$XDG_DATA_HOME/cairn`, else `~/.local/share/cairn`;
    /// the state store `$CAIRN_STATE` names, else the directory's `state.db`.
    pub fn from_env() -> Home {
        let home = if let Some(h) = std::env::var_os("CAIRN_HOME").filter(|h| !h.is_empty()) {
            Home::at(h)
        } else if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|h| !h.is_empty()) {
            Home::at(PathBuf::from(x).join("cairn"))
        } else {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/root"));
            Home::at(home.join(".local/share/cairn"))
        };
        let home = match std::env::var("CAIRN_STATE") {
            Ok(url) if !url.is_empty() => home.with_state(url),
            _ => home,
        };
        match std::env::var("CAIRN_STORE") {
            Ok(url) if !url.is_empty() => home.with_store(url),
            _ => home,
        }
    }

    pub fn at(root: impl Into<PathBuf>) -> Home {
        let root: PathBuf = root.into();
        // Overlay options and socket paths want an absolute, clean path.
        let root = std::path::absolute(&root).unwrap_or(root);
        Home {
            root,
            state: None,
            store: None,
        }
    }

    /// Keeps the state in the store `url` names (`postgres://…`,
    /// `sqlite:PATH`) instead of the directory's `state.db`.
    pub fn with_state(mut self, url: impl Into<String>) -> Home {
        self.state = Some(url.into()).filter(|u| !u.is_empty());
        self
    }

    /// Keeps chunks in the S3 store `url` names (`s3://BUCKET/PREFIX?…`),
    /// with the directory's `store` as its cache.
    pub fn with_store(mut self, url: impl Into<String>) -> Home {
        self.store = Some(url.into()).filter(|u| !u.is_empty());
        self
    }

    /// The remote chunk store's URL, when there is one.
    pub fn store_url(&self) -> Option<&str> {
        self.store.as_deref()
    }

    /// The state store's URL, when it is not the directory's `state.db`.
    pub fn state_url(&self) -> Option<&str> {
        self.state.as_deref()
    }

    /// This directory's identity: a random id made on first use and kept in
    /// `home-id`, so a shared state store can tell state directories apart
    /// (paths are not unique across hosts).
    pub fn identity(&self) -> io::Result<String> {
        let path = self.identity_file();
        match std::fs::read_to_string(&path) {
            Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let mut bytes = [0u8; 16];
        getrandom::getrandom(&mut bytes).map_err(|e| io::Error::other(e.to_string()))?;
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        // Written whole under a private name, then linked into place: of two
        // processes racing here, one id wins and both read it.
        std::fs::create_dir_all(&self.root)?;
        // Named by the id itself: unique to this caller, thread or process.
        let tmp = self.root.join(format!("home-id.{id}.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(format!("{id}\n").as_bytes())?;
        f.sync_all()?;
        drop(f);
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(id),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                Ok(std::fs::read_to_string(&path)?.trim().to_string())
            }
            Err(e) => Err(e),
        }
    }

    pub fn identity_file(&self) -> PathBuf {
        self.root.join("home-id")
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
    /// One lock file per session: shared by calls on its sandbox,
    /// exclusive for suspend, resume, recovery and close.
    pub fn session_lock(&self, id: &str) -> PathBuf {
        self.root.join("sessions").join(format!("{id}.lock"))
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
