//! Snapshots: capture a sandbox's files as a content-addressed layer on top
//! of what it started from; restore, fork and reset from them.
//!
//! A snapshot is a manifest in the chunk store (its id is the BLAKE3 of the
//! framed manifest): the layer chain, topmost first, the parent snapshot,
//! the image and the services. Capturing freezes the sandbox (cgroup
//! freezer) and records only what changed since the sandbox's previous
//! snapshot (see `cairn_layers::archive::capture_since`): the new layer goes
//! on top of the previous snapshot's chain. Restoring mounts the chain under
//! a fresh upper directory, which costs the same whatever the chain holds.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::Seek;
use std::path::Path;
use std::time::{Duration, Instant};

use cairn_layers::archive::{capture_since_with, layer_objects, load_index, write_index, Baseline};
use cairn_layers::LayerId;
use cairn_store::{BlobError, ChunkHash, Framed, ReadContext, StoreError};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use cairn_sandbox::gvisor::window::Window;

pub use crate::memory_image::{MemoryFile, MemoryForm, MemoryImage};
use crate::sandboxes::{CreateOptions, Origin};
use crate::state::{SandboxRecord, SandboxState, SnapshotRecord};
use crate::{layer_id, now_ms, Engine, EngineError};

/// What a snapshot is, as stored in the chunk store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotManifest {
    pub parent: Option<ChunkHash>,
    /// Topmost first; the last ones are the image's.
    pub layers: Vec<LayerId>,
    pub image: String,
    pub driver: String,
    pub services: Vec<String>,
    pub label: Option<String>,
    pub sandbox: String,
    pub created_at_ms: i64,
    /// Memory and processes, from a driver that can (gvisor): the files of
    /// its checkpoint image, chunked into the store.
    pub memory: Option<MemoryImage>,
}

/// Where the time of a memory snapshot went: logged at debug level, kept
/// for [`Engine::last_memory_phases`] (`cairn bench gvisor` prints it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryPhases {
    /// Whether runsc left the sandbox running (paused around the
    /// checkpoint, no restore: see `cairn_sandbox::gvisor::LiveSave`);
    /// otherwise it stopped and was restored from the image.
    pub left_running: bool,
    /// Init ending its connections before the checkpoint.
    pub quiesce: Duration,
    /// `runsc pause` and `runsc resume` around a checkpoint that leaves the
    /// sandbox running.
    pub runsc_pause: Duration,
    pub runsc_resume: Duration,
    /// `runsc checkpoint`: the sentry saving itself and writing the image.
    pub runsc_checkpoint: Duration,
    /// Removing the stopped sandbox's processes, cgroup and runsc state.
    pub cleanup: Duration,
    /// Capturing the files changed since the previous snapshot.
    pub file_capture: Duration,
    /// `runsc restore` until the sandbox runs again; the image is stored
    /// beside it, on the other cores.
    pub runsc_restore: Duration,
    /// Storing the image in the chunk store, start to end.
    pub store_image: Duration,
    /// What the chunk store did with the image's files (reading and
    /// inflating them, chunking, hashing, lookups, compression, writes),
    /// summed over the files.
    pub store: cairn_store::StreamStats,
    /// The size of runsc's image files and of what was stored of them.
    pub image_bytes: u64,
    pub stored_bytes: u64,
}

/// Versions 2 and 3 of the manifest: version 3 did not record the host a
/// memory image needs (`MemoryImageV3`), version 2 also kept every
/// checkpoint file as written (`MemoryImageV2`).
#[derive(Deserialize)]
struct ManifestBefore4<M> {
    parent: Option<ChunkHash>,
    layers: Vec<LayerId>,
    image: String,
    driver: String,
    services: Vec<String>,
    label: Option<String>,
    sandbox: String,
    created_at_ms: i64,
    memory: Option<M>,
}

impl<M> ManifestBefore4<M> {
    fn current(self, memory: impl FnOnce(M) -> MemoryImage) -> SnapshotManifest {
        SnapshotManifest {
            parent: self.parent,
            layers: self.layers,
            image: self.image,
            driver: self.driver,
            services: self.services,
            label: self.label,
            sandbox: self.sandbox,
            created_at_ms: self.created_at_ms,
            memory: self.memory.map(memory),
        }
    }
}

#[derive(Deserialize)]
struct MemoryImageV3 {
    driver: String,
    files: Vec<MemoryFile>,
}

#[derive(Deserialize)]
struct MemoryImageV2 {
    driver: String,
    files: Vec<(String, cairn_store::FileContent)>,
}

/// Version 1 manifests had no memory image.
#[derive(Deserialize)]
struct ManifestV1 {
    parent: Option<ChunkHash>,
    layers: Vec<LayerId>,
    image: String,
    driver: String,
    services: Vec<String>,
    label: Option<String>,
    sandbox: String,
    created_at_ms: i64,
}

impl Framed for SnapshotManifest {
    const MAGIC: [u8; 8] = *b"CAIRNSNP";
    const VERSION: u32 = 4;
    const MAX_PAYLOAD: u64 = 16 << 20;
    const NAME: &'static str = "snapshot manifest";

    fn decode_older(version: u32, payload: &[u8]) -> Result<Self, cairn_store::FrameError> {
        if version == 3 {
            let v3: ManifestBefore4<MemoryImageV3> =
                cairn_store::frame::decode_payload(Self::NAME, Self::MAX_PAYLOAD, payload)?;
            return Ok(v3.current(|m| MemoryImage {
                driver: m.driver,
                host: None,
                files: m.files,
            }));
        }
        if version == 2 {
            let v2: ManifestBefore4<MemoryImageV2> =
                cairn_store::frame::decode_payload(Self::NAME, Self::MAX_PAYLOAD, payload)?;
            return Ok(v2.current(|m| MemoryImage {
                driver: m.driver,
                host: None,
                files: m
                    .files
                    .into_iter()
                    .map(|(name, content)| MemoryFile {
                        name,
                        form: MemoryForm::AsWritten,
                        content,
                    })
                    .collect(),
            }));
        }
        if version != 1 {
            return Err(cairn_store::FrameError::UnsupportedOldVersion {
                what: Self::NAME,
                found: version,
                supported: 4,
            });
        }
        let v1: ManifestV1 = cairn_store::frame::decode_payload(Self::NAME, Self::MAX_PAYLOAD, payload)?;
        Ok(SnapshotManifest {
            parent: v1.parent,
            layers: v1.layers,
            image: v1.image,
            driver: v1.driver,
            services: v1.services,
            label: v1.label,
            sandbox: v1.sandbox,
            created_at_ms: v1.created_at_ms,
            memory: None,
        })
    }
}

impl SnapshotManifest {
    /// What a restore trusts beyond the frame: every memory file is named
    /// by one plain file name (it becomes a path under the image
    /// directory, so `..`, `/` or an empty name would write elsewhere),
    /// once, and its chunk list is consistent.
    pub fn validate(&self) -> Result<(), String> {
        let Some(memory) = &self.memory else {
            return Ok(());
        };
        let mut names = HashSet::new();
        for file in &memory.files {
            let name = &file.name;
            if name.is_empty() || name == "." || name == ".." || name.len() > 255 || name.contains(['/', '\0']) {
                return Err(format!("memory file {name:?} is not a plain file name"));
            }
            if !names.insert(name.as_str()) {
                return Err(format!("memory file {name:?} appears twice"));
            }
            file.content
                .validate()
                .map_err(|reason| format!("memory file {name:?}: {reason}"))?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("chunk store: {0}")]
    Backend(#[from] BlobError),
    #[error(transparent)]
    Archive(#[from] cairn_layers::archive::ArchiveError),
    #[error("snapshot {id} has an invalid manifest: {reason}; it is corrupt or was not written by Cairn, so remove it with `cairn snapshot rm {id}`")]
    InvalidManifest { id: String, reason: String },
    #[error("no snapshot matches {0:?}; `cairn snapshots` lists them")]
    NotFound(String),
    #[error("{key:?} matches several snapshots ({}); give more of the id", .ids.join(", "))]
    Ambiguous { key: String, ids: Vec<String> },
    #[error("sandbox {id} is {state}; only a running or exited sandbox can be snapshotted")]
    NotSnapshottable { id: String, state: SandboxState },
    #[error("invalid label {0:?}: use 1 to 64 printable characters")]
    BadLabel(String),
    #[error("snapshot {0} is a pipeline stage's output, checkpoint or dead letter; a run or a stage key needs it, so it stays")]
    NeededByPipeline(String),
    #[error("snapshot {0} holds an agent session's machine (its log names it); close the session with `cairn session rm --purge` first")]
    NeededBySession(String),
    #[error("snapshot {id} cannot be flattened: {source}")]
    Flatten {
        id: String,
        #[source]
        source: cairn_layers::archive::FlattenError,
    },
    #[error("fork needs a count of at least 1, got {0}")]
    BadCount(usize),
    #[error(
        "snapshot {id} cannot be restored: {source}. `cairn verify {id}` names every damaged object it reaches \
         (with a store in S3, `cairn verify {id} --repair` mends them from an intact copy)"
    )]
    Damaged {
        id: String,
        #[source]
        source: Box<EngineError>,
    },
    #[error("cannot lock the chunk store ({path}): {source}")]
    Lock {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A restore of a memory snapshot made ready ahead
/// ([`Engine::prepare_restore`]): a sandbox in state `creating` whose
/// runsc sandbox waits for the image, and the image, held until the
/// restore. Finish it ([`Engine::finish_restore`]) or discard it
/// ([`Engine::discard_prepared`]); dropped, the sandbox stays until this
/// process ends and the next Cairn command removes it.
#[derive(Debug)]
pub struct PreparedRestore {
    sandbox: SandboxRecord,
    snapshot: String,
    image: crate::images::ScratchDir,
}

impl PreparedRestore {
    /// The sandbox made for the restore (state `creating`).
    pub fn sandbox(&self) -> &SandboxRecord {
        &self.sandbox
    }

    /// The snapshot it restores.
    pub fn snapshot(&self) -> &str {
        &self.snapshot
    }
}

impl Engine {
    /// Locks the chunk store: shared for writers of snapshots, images and
    /// artifacts (until their rows exist), exclusive for its garbage
    /// collector.
    pub fn lock_store(&self, exclusive: bool) -> Result<Flock<File>, EngineError> {
        let path = self.home.store_lock();
        let lock_err = |source: std::io::Error| SnapshotError::Lock {
            path: path.clone(),
            source,
        };
        let file = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(lock_err)?;
        let arg = if exclusive {
            FlockArg::LockExclusive
        } else {
            FlockArg::LockShared
        };
        Ok(Flock::lock(file, arg).map_err(|(_, e)| lock_err(e.into()))?)
    }

    /// The exclusive store lock if nobody holds it now.
    pub(crate) fn try_lock_store(&self) -> Option<Flock<File>> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(self.home.store_lock())
            .ok()?;
        Flock::lock(file, FlockArg::LockExclusiveNonblock).ok()
    }

    /// Locks a sandbox's lifecycle while its process is replaced (a memory
    /// snapshot stops and restores it): reconciliation, which takes it
    /// without waiting, leaves the sandbox alone meanwhile. `Ok(None)` when
    /// `wait` is false and another process holds it; an error when there is
    /// no sandbox directory to hold the lock. The lock goes with the process
    /// holding it, however it dies. Only the waiting side (the owner) creates
    /// the lock file: a reconciler must never add an entry to a directory its
    /// remover may be emptying (it finds no file, so nobody held the lock).
    pub(crate) fn lock_sandbox(&self, id: &str, wait: bool) -> std::io::Result<Option<Flock<File>>> {
        let file = File::options()
            .create(wait)
            .append(true)
            .open(self.home.sandbox(id).join("lifecycle.lock"))?;
        let arg = if wait {
            FlockArg::LockExclusive
        } else {
            FlockArg::LockExclusiveNonblock
        };
        match Flock::lock(file, arg) {
            Ok(lock) => Ok(Some(lock)),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(e.into()),
        }
    }

    /// Finds a snapshot by id, unique id prefix or label (the newest wins).
    pub fn snapshot_record(&self, key: &str) -> Result<SnapshotRecord, EngineError> {
        let mut found = self.db.find_snapshots(key)?;
        if let Some(i) = found.iter().position(|s| s.id == key) {
            return Ok(found.swap_remove(i));
        }
        let by_label: Vec<usize> = (0..found.len())
            .filter(|&i| found[i].label.as_deref() == Some(key))
            .collect();
        if let Some(&i) = by_label.first() {
            return Ok(found.swap_remove(i));
        }
        match found.len() {
            0 => Err(SnapshotError::NotFound(key.to_string()).into()),
            1 => Ok(found.remove(0)),
            _ => Err(SnapshotError::Ambiguous {
                key: key.into(),
                ids: found.into_iter().map(|s| s.id).collect(),
            }
            .into()),
        }
    }

    pub fn snapshots(&self) -> Result<Vec<SnapshotRecord>, EngineError> {
        Ok(self.db.snapshots()?)
    }

    pub(crate) fn manifest(&self, snap: &SnapshotRecord) -> Result<SnapshotManifest, EngineError> {
        let hash: ChunkHash = snap.id.parse().map_err(|_| SnapshotError::NotFound(snap.id.clone()))?;
        let context = ReadContext::new().owner("snapshot", hash);
        let manifest: SnapshotManifest = self.store.get_object(&hash, &context).map_err(SnapshotError::from)?;
        manifest.validate().map_err(|reason| SnapshotError::InvalidManifest {
            id: snap.id.clone(),
            reason,
        })?;
        Ok(manifest)
    }

    /// How long runsc's own `restore` command took in this engine's last
    /// restore of a gVisor memory image (ordinary, prepared, or finishing a
    /// checkpoint): runsc's part of the restore; the rest is Cairn's.
    pub fn last_runsc_restore(&self) -> Option<std::time::Duration> {
        self.gvisor.get()?.as_ref().ok()?.last_runsc_restore()
    }

    /// Where the time of this engine's last memory snapshot went.
    pub fn last_memory_phases(&self) -> Option<MemoryPhases> {
        self.memory_phases.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Takes a snapshot of a sandbox's files. A running sandbox is frozen
    /// while its changes are captured and keeps running afterwards.
    pub fn snapshot(&mut self, rec: &SandboxRecord, label: Option<&str>) -> Result<SnapshotRecord, EngineError> {
        self.snapshot_then(rec, label, Then::GoOn)
    }

    /// A snapshot of a sandbox about to be removed (a session suspending,
    /// an E2B pause): as [`Self::snapshot`], but a gVisor sandbox is not
    /// brought back after its memory checkpoint, which saves a restore (or
    /// a resume). Its process is gone when this returns; remove the sandbox
    /// next ([`Self::remove_sandbox`]). A failure leaves it running.
    pub fn snapshot_to_stop(
        &mut self,
        rec: &SandboxRecord,
        label: Option<&str>,
    ) -> Result<SnapshotRecord, EngineError> {
        self.snapshot_then(rec, label, Then::Stop)
    }

    fn snapshot_then(
        &mut self,
        rec: &SandboxRecord,
        label: Option<&str>,
        then: Then,
    ) -> Result<SnapshotRecord, EngineError> {
        self.as_owner_of(crate::tenants::Owned::Sandbox, &rec.id, |e| {
            e.snapshot_owned(rec, label, then)
        })
    }

    fn snapshot_owned(
        &mut self,
        rec: &SandboxRecord,
        label: Option<&str>,
        then: Then,
    ) -> Result<SnapshotRecord, EngineError> {
        if let Some(l) = label {
            if l.is_empty() || l.len() > 64 || l.chars().any(char::is_control) {
                return Err(SnapshotError::BadLabel(l.to_string()).into());
            }
        }
        if !matches!(rec.state, SandboxState::Running | SandboxState::Exited) {
            return Err(SnapshotError::NotSnapshottable {
                id: rec.id.clone(),
                state: rec.state,
            }
            .into());
        }
        let started = Instant::now();
        let _lock = self.lock_store(false)?;
        let dir = self.home.sandbox(&rec.id);
        // On the sandbox's disk when it has one, mounted again if the host
        // rebooted since it stopped.
        let upper = cairn_sandbox::disk::upper_dir(&dir).map_err(|source| EngineError::Disk {
            id: rec.id.clone(),
            source,
        })?;
        let previous = rec
            .last_snapshot
            .as_ref()
            .and_then(|s| self.db.find_snapshots(s).ok()?.into_iter().find(|r| r.id == *s));
        // The baseline tells what the previous snapshot already holds; with
        // it the new layer stacks on that snapshot, without it the whole
        // upper directory is captured onto the sandbox's base layers.
        let baseline = previous
            .as_ref()
            .and_then(|p| read_baseline(&dir.join(format!("baseline-{}", p.id))));
        let below: Vec<String> = match (&baseline, &previous) {
            (Some(_), Some(p)) => p.layers.clone(),
            _ => rec.layers.clone(),
        };
        let written_before = self.store.bytes_written();
        let running = rec.state == SandboxState::Running;
        let mut image_dir = None;
        let mut held = None;
        let (captured, memory) = if running && self.driver_of(rec)?.capabilities().memory_snapshots {
            // The sentry writes the image into page cache charged to the
            // sandbox's memory cgroup, where the previous image still is:
            // with both beside the sandbox's memory, the limit is reached and
            // the kernel makes runsc wait while it writes those dirty pages
            // back (runsc's checkpoint took 2-3x as long every other time).
            // So the previous image goes first; a restore of that snapshot
            // rebuilds it from the store.
            if let Some(p) = previous.as_ref().filter(|p| p.sandbox_id == rec.id) {
                self.drop_memory_image(&p.id);
            }
            let (captured, memory, dir, window) = self.capture_with_memory(rec, baseline.as_ref(), then)?;
            image_dir = Some(dir);
            held = window;
            (captured, Some(memory))
        } else {
            let driver = self.driver_of(rec)?;
            if running {
                if let Err(e) = driver.freeze(&rec.id) {
                    // Half frozen is still frozen to some processes: let
                    // them go on, and capture nothing of an unfrozen tree.
                    let _ = driver.thaw(&rec.id);
                    return Err(e.into());
                }
            }
            let ids = driver.capabilities().host_ids;
            let captured = capture_since_with(&upper, &self.store, baseline.as_ref(), ids, &dir);
            if running {
                driver.thaw(&rec.id)?;
            }
            (captured, None)
        };
        let t_captured = started.elapsed();
        let (layer, next_baseline) = captured.map_err(SnapshotError::from)?;
        if layer.dropped_devices > 0 {
            tracing::warn!(
                sandbox = %rec.id,
                "the snapshot leaves out {} device node(s) the sandbox made; snapshots never hold devices",
                layer.dropped_devices
            );
        }
        // A snapshot with no change adds no layer. Entries changed within a
        // second of the previous capture are read again (racily clean): when
        // nothing else changed since, that is the same layer as the one on
        // top, and stacking it twice would make an overlay that cannot mount.
        let unchanged = layer.entries == 1 || below.first().is_some_and(|top| *top == layer.id.to_string());
        let mut layers: Vec<LayerId> = Vec::with_capacity(below.len() + 1);
        if !unchanged {
            layers.push(layer.id);
        }
        // A layer equal to one deeper in the chain (the same re-read entries,
        // a few snapshots later) is kept only at the top: overlayfs refuses a
        // layer twice, and the top-most copy decides every path it touches.
        for l in &below {
            let l = layer_id(l)?;
            if !layers.contains(&l) {
                layers.push(l);
            }
        }
        let manifest = SnapshotManifest {
            parent: previous.as_ref().and_then(|p| p.id.parse().ok()),
            layers: layers.clone(),
            image: rec.image.clone(),
            driver: rec.driver.clone(),
            services: rec.services.clone(),
            label: label.map(str::to_string),
            sandbox: rec.id.clone(),
            created_at_ms: now_ms(),
            memory,
        };
        let id = self.store.put_object(&manifest).map_err(SnapshotError::from)?;
        let t_manifest = started.elapsed();
        if !unchanged && layer.entries <= EAGER_LAYER_ENTRIES {
            // Materialised now, so forks and restores start at once. A
            // larger layer is built by the first fork or restore that needs
            // it, so a snapshot of a big tree costs about what reading the
            // tree does.
            self.layers.ensure(&layer.id, &self.store)?;
        }
        let snap = SnapshotRecord {
            id: id.to_string(),
            parent_id: previous.as_ref().map(|p| p.id.clone()),
            sandbox_id: rec.id.clone(),
            image: rec.image.clone(),
            driver: rec.driver.clone(),
            label: label.map(str::to_string),
            created_at: manifest.created_at_ms,
            new_bytes: if unchanged { 0 } else { layer.file_bytes },
            stored_bytes: self.store.bytes_written() - written_before,
            layers: layers.iter().map(|l| l.to_string()).collect(),
        };
        let t_layer = started.elapsed();
        self.db.insert_snapshot(&snap)?;
        let t_row = started.elapsed();
        // Only once the row exists: a baseline newer than the sandbox's last
        // snapshot would make the next one miss changes.
        write_baseline(&dir, &snap.id, next_baseline);
        if let (Some(image), Some(memory)) = (image_dir, &manifest.memory) {
            // (The previous snapshot's image went before the checkpoint.)
            self.keep_memory_image(&snap.id, image, memory);
        }
        if let Some(held) = held {
            held.close(&rec.id);
        }
        tracing::debug!(
            snapshot = &snap.id[..12],
            ?t_captured,
            ?t_manifest,
            ?t_layer,
            ?t_row,
            done = ?started.elapsed(),
            "snapshot steps, from the start"
        );
        // Marks this and earlier snapshots whose uploads already finished;
        // the rest are marked by a later call (`cairn snapshot` waits).
        if let Err(e) = self.mark_remote_durable(Duration::ZERO) {
            tracing::debug!(
                "snapshot {} is not yet durable in the remote store: {e}",
                &snap.id[..12]
            );
        }
        Ok(snap)
    }

    /// A snapshot holding the same files as `snap` in one layer: the tree
    /// its layers show, merged at the index level (file contents are chunk
    /// references, so no file data is stored again; the new layer is
    /// materialised for restores). Its parent is `snap`; a memory image
    /// comes along unchanged, as the files are the same. Overlayfs stacks at
    /// most 500 layers, so a chain that grows with every snapshot (a
    /// session suspended again and again) is flattened from time to time.
    pub fn flatten_snapshot(&mut self, snap: &SnapshotRecord) -> Result<SnapshotRecord, EngineError> {
        let _lock = self.lock_store(false)?;
        let written_before = self.store.bytes_written();
        let manifest = self.manifest(snap)?;
        let indexes = manifest
            .layers
            .iter()
            .map(|id| load_index(&self.store, id).map_err(|e| EngineError::from(SnapshotError::from(e))))
            .collect::<Result<Vec<_>, _>>()?;
        let flat = cairn_layers::archive::flatten(&indexes.iter().collect::<Vec<_>>()).map_err(|source| {
            SnapshotError::Flatten {
                id: snap.id.clone(),
                source,
            }
        })?;
        let layer = write_index(&self.store, flat.entries).map_err(SnapshotError::from)?.id;
        self.layers.ensure(&layer, &self.store)?;
        let flattened = SnapshotManifest {
            parent: snap.id.parse().ok(),
            layers: vec![layer],
            created_at_ms: now_ms(),
            ..manifest
        };
        let id = self.store.put_object(&flattened).map_err(SnapshotError::from)?;
        let rec = SnapshotRecord {
            id: id.to_string(),
            parent_id: Some(snap.id.clone()),
            sandbox_id: snap.sandbox_id.clone(),
            image: snap.image.clone(),
            driver: snap.driver.clone(),
            label: snap.label.clone(),
            created_at: flattened.created_at_ms,
            new_bytes: 0,
            stored_bytes: self.store.bytes_written() - written_before,
            layers: vec![layer.to_string()],
        };
        self.db.insert_snapshot(&rec)?;
        self.link_memory_image(&snap.id, &rec.id);
        Ok(rec)
    }

    /// Starts a new sandbox from a snapshot.
    pub fn restore(&mut self, snap: &SnapshotRecord, opts: &CreateOptions) -> Result<SandboxRecord, EngineError> {
        self.as_owner_of(crate::tenants::Owned::Snapshot, &snap.id, |e| {
            e.restore_owned(snap, opts)
        })
    }

    fn restore_owned(&mut self, snap: &SnapshotRecord, opts: &CreateOptions) -> Result<SandboxRecord, EngineError> {
        let (origin, _scratch) = self.restore_origin(snap, opts)?;
        self.create_from(origin, opts).map_err(|e| damaged(snap, e))
    }

    /// Makes a restore of memory snapshot `snap` ready ahead of its use: a
    /// sandbox is made as [`Self::restore`] makes it, except that runsc
    /// only creates it (`runsc create`) and it waits, holding no memory
    /// of its own and running nothing. [`Self::finish_restore`] then pays
    /// only for loading the image, not for creating the sandbox (about
    /// 100-140 ms of a restore on this kind of host); this is how a paused
    /// E2B sandbox resumes fast. Until then the sandbox is in state
    /// `creating`, owned by this process: if it dies first, the next Cairn
    /// command removes it, and the snapshot is restored the ordinary way.
    /// A snapshot without memory, or a runsc that cannot restore into a
    /// created sandbox (Debian 12's), is refused
    /// ([`EngineError::CannotPrepare`]).
    pub fn prepare_restore(
        &mut self,
        snap: &SnapshotRecord,
        opts: &CreateOptions,
    ) -> Result<PreparedRestore, EngineError> {
        self.as_owner_of(crate::tenants::Owned::Snapshot, &snap.id, |e| {
            e.prepare_restore_owned(snap, opts)
        })
    }

    fn prepare_restore_owned(
        &mut self,
        snap: &SnapshotRecord,
        opts: &CreateOptions,
    ) -> Result<PreparedRestore, EngineError> {
        let cannot = |why: &str| EngineError::CannotPrepare {
            snapshot: snap.id.clone(),
            why: why.into(),
        };
        // Asked before the image is linked or materialised.
        if !self.gvisor()?.restores_into_created() {
            return Err(cannot("this host's runsc cannot restore into a created sandbox"));
        }
        let (origin, scratch) = self.restore_origin(snap, opts)?;
        let Some(image) = scratch else {
            return Err(cannot("it holds files only; a restore of files starts init afresh"));
        };
        if origin.driver != "gvisor" {
            return Err(cannot("only a gVisor sandbox restores into one created ahead"));
        }
        let sandbox = self
            .create_prepared(&origin, opts, image.path())
            .map_err(|e| damaged(snap, e))?;
        Ok(PreparedRestore {
            sandbox,
            snapshot: snap.id.clone(),
            image,
        })
    }

    /// Restores a prepared snapshot into its sandbox, which runs on from
    /// the image as after [`Self::restore`]. A failure removes the
    /// prepared sandbox; the snapshot can still be restored the ordinary
    /// way.
    pub fn finish_restore(&mut self, prepared: PreparedRestore) -> Result<SandboxRecord, EngineError> {
        let PreparedRestore { sandbox, image, .. } = prepared;
        let id = sandbox.id.clone();
        self.as_owner_of(crate::tenants::Owned::Sandbox, &id, |e| {
            e.finish_prepared(sandbox, image.path())
        })
    }

    /// Removes a prepared sandbox that is not wanted after all.
    pub fn discard_prepared(&mut self, prepared: PreparedRestore) -> Result<(), EngineError> {
        self.remove_sandbox(&prepared.sandbox, true)
    }

    /// The origin of a restore of `snap`, with its memory image linked (or
    /// materialised) into a scratch directory that must outlive the
    /// restore.
    fn restore_origin(
        &mut self,
        snap: &SnapshotRecord,
        opts: &CreateOptions,
    ) -> Result<(Origin, Option<crate::images::ScratchDir>), EngineError> {
        let manifest = self.manifest(snap)?;
        let driver = opts.driver.clone().unwrap_or_else(|| manifest.driver.clone());
        let scratch = match &manifest.memory {
            Some(memory) => {
                if !self.driver(&driver)?.capabilities().memory_snapshots {
                    return Err(EngineError::NoMemorySnapshots {
                        snapshot: snap.id.clone(),
                        driver,
                    });
                }
                self.check_image_host(snap, memory)?;
                match self
                    .cached_memory_image(&snap.id, memory)
                    .and_then(|cached| self.linked_memory_image(&cached))
                {
                    Some(linked) => Some(linked),
                    None => Some(self.materialise_memory(snap, memory).map_err(|e| damaged(snap, e))?),
                }
            }
            None => None,
        };
        let origin = Origin {
            image: manifest.image,
            layers: snap.layers.clone(),
            services: if opts.services.is_empty() {
                manifest.services
            } else {
                opts.services.clone()
            },
            snapshot: Some(snap.id.clone()),
            memory: scratch.as_ref().map(|d| d.path().to_path_buf()),
            driver,
        };
        Ok((origin, scratch))
    }

    /// Refuses, before anything starts, a memory image this host cannot
    /// resume: taken with another runsc or platform, on another CPU
    /// vendor or family, or using CPU features this host lacks; an image
    /// that does not record its host is refused too.
    fn check_image_host(&self, snap: &SnapshotRecord, memory: &MemoryImage) -> Result<(), EngineError> {
        let differences = match &memory.host {
            None => vec![
                "it was taken by a Cairn that did not record the host it needs (snapshot format 3 or older)"
                    .to_string(),
            ],
            Some(taken) => {
                let here = self.gvisor()?.image_host().map_err(cairn_sandbox::SandboxError::from)?;
                taken.differences(&here)
            }
        };
        if differences.is_empty() {
            return Ok(());
        }
        Err(EngineError::IncompatibleMemoryImage {
            snapshot: snap.id.clone(),
            differences: differences.join("; "),
        })
    }

    /// Checkpoints a sandbox whose driver keeps memory: the image and the
    /// files at one stopped instant, then the sandbox goes on from the image
    /// (or, for [`Then::Stop`], stays stopped). Returns the captured files,
    /// the stored image, the image directory and, for a stop, the window
    /// still open under the sandbox's lifecycle lock: until the snapshot's
    /// row exists the window's complete image is the sandbox, which the
    /// next command restores if this one dies or fails first.
    #[allow(clippy::type_complexity)]
    fn capture_with_memory(
        &self,
        rec: &SandboxRecord,
        baseline: Option<&Baseline>,
        then: Then,
    ) -> Result<
        (
            Result<(cairn_layers::archive::CapturedLayer, Baseline), cairn_layers::archive::ArchiveError>,
            MemoryImage,
            crate::images::ScratchDir,
            Option<HeldWindow>,
        ),
        EngineError,
    > {
        let gvisor = self.gvisor()?;
        // Before the checkpoint: a host that cannot say what it is stops
        // the snapshot while the sandbox still runs.
        let host = gvisor.image_host().map_err(cairn_sandbox::SandboxError::from)?;
        let dir = self.home.sandbox(&rec.id);
        // From the checkpoint until the restored process is recorded, the
        // recorded process is gone: reconciliation must not take that for
        // a dead sandbox.
        let lifecycle = self.lock_sandbox(&rec.id, true).map_err(home_err(&dir))?;
        // The window is recorded before init quiesces: if this process dies
        // in it, the next Cairn process finishes it (`finish_window`).
        // The process as recorded now, under the lock (`rec` may be older).
        let process = self
            .db
            .find_sandboxes(&rec.id)?
            .into_iter()
            .find(|r| r.id == rec.id)
            .and_then(|r| crate::sandboxes::process_of(&r));
        let window = Window::open(&dir, &rec.id, process)
            .map_err(|e| cairn_sandbox::SandboxError::from(cairn_sandbox::gvisor::GvisorError::from(e)))?;
        let scratch = crate::images::ScratchDir::at(window.image_dir()).map_err(home_err(&window.image_dir()))?;
        let (captured, files, held) = if then == Then::GoOn && gvisor.can_leave_running() {
            let (captured, files) = self.capture_leaving_running(rec, baseline, &window)?;
            (captured, files, None)
        } else {
            self.capture_stopping(rec, baseline, window, &scratch, then, lifecycle)?
        };
        Ok((
            captured,
            MemoryImage {
                driver: rec.driver.clone(),
                host: Some(host),
                files,
            },
            scratch,
            held,
        ))
    }

    /// [`Self::capture_with_memory`] where the checkpoint stops the
    /// sandbox: the files are captured, then the sandbox goes on from the
    /// image (restored beside the storing) or, for [`Then::Stop`], stays
    /// stopped with its window held (see there).
    #[allow(clippy::type_complexity)]
    fn capture_stopping(
        &self,
        rec: &SandboxRecord,
        baseline: Option<&Baseline>,
        window: Window,
        scratch: &crate::images::ScratchDir,
        then: Then,
        lifecycle: Option<Flock<File>>,
    ) -> Result<
        (
            Result<(cairn_layers::archive::CapturedLayer, Baseline), cairn_layers::archive::ArchiveError>,
            Vec<MemoryFile>,
            Option<HeldWindow>,
        ),
        EngineError,
    > {
        let gvisor = self.gvisor()?;
        let dir = self.home.sandbox(&rec.id);
        let checkpoint = match gvisor.checkpoint_in(&rec.id, &window) {
            Ok(c) => c,
            Err(e) => {
                // The sandbox runs on (init listens again): nothing to finish.
                let _ = window.remove();
                return Err(cairn_sandbox::SandboxError::from(e).into());
            }
        };
        let mut phases = MemoryPhases {
            quiesce: checkpoint.quiesce,
            runsc_checkpoint: checkpoint.save,
            cleanup: checkpoint.cleanup,
            image_bytes: checkpoint.image_bytes,
            ..MemoryPhases::default()
        };
        // Everything is stopped: the files match the memory image exactly.
        // They are captured before the sandbox goes on and writes again.
        let t = Instant::now();
        // Running, so its disk (if it has one) is mounted.
        let captured = capture_since_with(
            &cairn_sandbox::disk::writable_dir(&dir).join("upper"),
            &self.store,
            baseline,
            None,
            &dir,
        );
        phases.file_capture = t.elapsed();
        if then == Then::Stop {
            let t = Instant::now();
            let written_before = self.store.bytes_written();
            let files = self.store_memory_files(scratch.path(), &mut phases);
            phases.store_image = t.elapsed();
            phases.stored_bytes = self.store.bytes_written() - written_before;
            self.keep_phases(&rec.id, phases);
            // Stopped as asked. A failure to store the image brings the
            // sandbox back from it now; the window stays open until the
            // snapshot is recorded.
            let files = match files {
                Ok(f) => f,
                Err(e) => {
                    self.restore_after_failed_store(rec, &window);
                    return Err(e);
                }
            };
            let held = HeldWindow {
                window,
                _lifecycle: lifecycle,
            };
            return Ok((captured, files, Some(held)));
        }
        // The sandbox goes on where it stopped, as after any snapshot, while
        // the image is stored beside it (runsc only reads it); it goes on
        // even when storing fails.
        let spec = self.spec(rec)?;
        let (restored, files) = std::thread::scope(|s| {
            let restore = s.spawn(|| {
                let t = Instant::now();
                (gvisor.restore_in(&spec, &window), t.elapsed())
            });
            let t = Instant::now();
            let written_before = self.store.bytes_written();
            let files = self.store_memory_files(scratch.path(), &mut phases);
            phases.store_image = t.elapsed();
            phases.stored_bytes = self.store.bytes_written() - written_before;
            (restore.join(), files)
        });
        let (restored, restore_time) = restored.unwrap_or_else(|e| std::panic::resume_unwind(e));
        phases.runsc_restore = restore_time;
        self.keep_phases(&rec.id, phases);
        let process = restored.map_err(cairn_sandbox::SandboxError::from)?;
        self.db.set_process(&rec.id, process.pid, process.start_time)?;
        // The restored process is recorded: the window is over (its image
        // stays, for the snapshot's local copy).
        if let Err(e) = window.close() {
            tracing::warn!(sandbox = %rec.id, "cannot close the checkpoint window: {e}");
        }
        drop(lifecycle);
        Ok((captured, files?, None))
    }

    /// Logs where a memory snapshot's time went and keeps it for
    /// [`Self::last_memory_phases`].
    fn keep_phases(&self, sandbox: &str, phases: MemoryPhases) {
        tracing::debug!(sandbox, ?phases, "memory snapshot");
        *self.memory_phases.lock().unwrap_or_else(|e| e.into_inner()) = Some(phases);
    }

    /// runsc's own checkpoint of running gVisor sandbox `rec`, as the plain
    /// command line takes it (init quiesced first; the image discarded),
    /// for benchmarks that set a snapshot beside it. The sandbox runs on.
    /// Returns runsc's time alone.
    pub fn plain_runsc_checkpoint(&self, rec: &SandboxRecord) -> Result<Duration, EngineError> {
        let gvisor = self.gvisor()?;
        let spec = self.spec(rec)?;
        let _lifecycle = self.lock_sandbox(&rec.id, true).map_err(home_err(&spec.dir))?;
        let scratch = crate::images::ScratchDir::new(&self.home.scratch()).map_err(home_err(&self.home.scratch()))?;
        let (took, process) = gvisor
            .plain_checkpoint(&spec, scratch.path())
            .map_err(cairn_sandbox::SandboxError::from)?;
        if let Some(p) = process {
            self.db.set_process(&rec.id, p.pid, p.start_time)?;
        }
        Ok(took)
    }

    /// runsc's own restore of running gVisor sandbox `rec`, as the plain
    /// command line does it, for benchmarks that set Cairn's restore beside
    /// it: `runsc checkpoint` (the sandbox stops) into a scratch image with
    /// the flags Cairn's snapshots use, then `runsc restore` of that image
    /// under the same id. The sandbox runs on from the image. Returns the
    /// restore's time alone, to init listening again.
    pub fn plain_runsc_restore(&self, rec: &SandboxRecord) -> Result<Duration, EngineError> {
        let gvisor = self.gvisor()?;
        let spec = self.spec(rec)?;
        let _lifecycle = self.lock_sandbox(&rec.id, true).map_err(home_err(&spec.dir))?;
        let scratch = crate::images::ScratchDir::new(&self.home.scratch()).map_err(home_err(&self.home.scratch()))?;
        gvisor
            .checkpoint(&rec.id, scratch.path())
            .map_err(cairn_sandbox::SandboxError::from)?;
        let t = Instant::now();
        let process = gvisor
            .restore(&spec, scratch.path())
            .map_err(cairn_sandbox::SandboxError::from)?;
        let took = t.elapsed();
        self.db.set_process(&rec.id, process.pid, process.start_time)?;
        Ok(took)
    }

    /// After a checkpoint that stopped the sandbox for good, storing its
    /// image failed: the sandbox goes on from the image instead, so a
    /// failed snapshot leaves it running.
    fn restore_after_failed_store(&self, rec: &SandboxRecord, window: &Window) {
        let restored = self.spec(rec).and_then(|spec| {
            let process = self
                .gvisor()?
                .restore_in(&spec, window)
                .map_err(cairn_sandbox::SandboxError::from)?;
            Ok(self.db.set_process(&rec.id, process.pid, process.start_time)?)
        });
        match restored {
            Ok(()) => {
                let _ = window.close();
            }
            // The window stays: the next command finishes it.
            Err(e) => tracing::warn!(sandbox = %rec.id, "cannot restore after a failed snapshot: {e}"),
        }
    }

    /// [`Self::capture_with_memory`] where runsc can leave the sandbox
    /// running: quiesce, pause, `runsc checkpoint --leave-running` while
    /// its pages file is stored behind the writer, the files captured while
    /// the sandbox is still paused, then it resumes, and the rest of the
    /// image (kernel objects, page metadata) is stored. No restore, no
    /// second copy of the memory.
    #[allow(clippy::type_complexity)]
    fn capture_leaving_running(
        &self,
        rec: &SandboxRecord,
        baseline: Option<&Baseline>,
        window: &Window,
    ) -> Result<
        (
            Result<(cairn_layers::archive::CapturedLayer, Baseline), cairn_layers::archive::ArchiveError>,
            Vec<MemoryFile>,
        ),
        EngineError,
    > {
        let gvisor = self.gvisor()?;
        let dir = self.home.sandbox(&rec.id);
        let save = match gvisor.start_live(&rec.id, window) {
            Ok(s) => s,
            Err(e) => {
                // The sandbox runs on (init listens again): nothing to finish.
                let _ = window.remove();
                return Err(cairn_sandbox::SandboxError::from(e).into());
            }
        };
        let mut phases = MemoryPhases {
            left_running: true,
            quiesce: save.quiesce,
            runsc_pause: save.pause,
            ..MemoryPhases::default()
        };
        let started = Instant::now();
        let written_before = self.store.bytes_written();
        let mut behind = save.behind(PAGES_FILE);
        let (saved, pages) = std::thread::scope(|s| {
            let follower = s.spawn(move || {
                let stored = self.store.store_stream(&mut behind, cairn_store::Cutting::Pages);
                (stored, behind.appeared())
            });
            let saved = gvisor.finish_live(&rec.id, save);
            (saved, follower.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        });
        let checkpoint = match saved {
            Ok(c) => c,
            Err(e) => {
                // The sandbox runs again; the chunks stored behind the
                // writer are garbage for gc.
                let _ = window.remove();
                return Err(cairn_sandbox::SandboxError::from(e).into());
            }
        };
        phases.runsc_checkpoint = checkpoint.save;
        phases.image_bytes = checkpoint.image_bytes;
        // Paused: the files match the memory image exactly.
        let t = Instant::now();
        // Running, so its disk (if it has one) is mounted.
        let captured = capture_since_with(
            &cairn_sandbox::disk::writable_dir(&dir).join("upper"),
            &self.store,
            baseline,
            None,
            &dir,
        );
        phases.file_capture = t.elapsed();
        // The sandbox goes on, even when storing failed. If it does not
        // listen again, the window stays for the next command to finish.
        phases.runsc_resume = gvisor.resume_live(&rec.id).map_err(cairn_sandbox::SandboxError::from)?;
        let image_dir = window.image_dir();
        let files = (|| {
            let mut files = Vec::new();
            let (pages, appeared) = pages;
            if appeared {
                let (content, stats) = pages.map_err(SnapshotError::from)?;
                phases.store += stats;
                files.push(MemoryFile {
                    name: PAGES_FILE.into(),
                    form: MemoryForm::AsWritten,
                    content,
                });
            }
            for name in image_files(&image_dir)? {
                if !(appeared && name == PAGES_FILE) {
                    files.push(self.store_memory_file(&image_dir, name, &mut phases)?);
                }
            }
            files.sort_by(|a, b| a.name.cmp(&b.name));
            Ok::<_, EngineError>(files)
        })();
        phases.store_image = started.elapsed();
        phases.stored_bytes = self.store.bytes_written() - written_before;
        self.keep_phases(&rec.id, phases);
        // The sandbox runs as the same process: the window is over.
        if let Err(e) = window.close() {
            tracing::warn!(sandbox = %rec.id, "cannot close the checkpoint window: {e}");
        }
        Ok((captured, files?))
    }

    /// Stores every file of a checkpoint image directory, by name.
    fn store_memory_files(&self, dir: &Path, phases: &mut MemoryPhases) -> Result<Vec<MemoryFile>, EngineError> {
        image_files(dir)?
            .into_iter()
            .map(|name| self.store_memory_file(dir, name, phases))
            .collect()
    }

    /// Stores one checkpoint file, a gVisor state file unpacked so that
    /// checkpoints share what did not change. The state stream is chunked
    /// as it is inflated (nothing is written out and read back); a file
    /// found not to be a state file part-way is stored as written.
    fn store_memory_file(
        &self,
        dir: &Path,
        name: String,
        phases: &mut MemoryPhases,
    ) -> Result<MemoryFile, EngineError> {
        use cairn_sandbox::gvisor::statefile;
        let path = dir.join(&name);
        let open = || {
            let f = File::open(&path)?;
            let len = f.metadata()?.len();
            Ok((std::io::BufReader::with_capacity(1 << 20, f), len))
        };
        let (image, len) = open().map_err(home_err(&path))?;
        let t = Instant::now();
        let opened = statefile::open_stream(image, len).map_err(home_err(&path))?;
        phases.store.read += t.elapsed();
        if let Some((header, stream)) = opened {
            match self.store.store_stream(stream, cairn_store::ChunkSizes::FINE) {
                Ok((content, stats)) => {
                    phases.store += stats;
                    return Ok(MemoryFile {
                        name,
                        form: MemoryForm::GvisorStateStream { header },
                        content,
                    });
                }
                Err(StoreError::ReadSource { source, .. }) if statefile::is_not_unpackable(&source) => {
                    tracing::warn!("{}: {source}; it is stored as written", path.display());
                }
                Err(e) => return Err(SnapshotError::from(e).into()),
            }
        }
        let (image, _) = open().map_err(home_err(&path))?;
        let cutting = match name.as_str() {
            PAGES_FILE => cairn_store::Cutting::Pages,
            _ => cairn_store::ChunkSizes::FINE.into(),
        };
        let (content, stats) = self.store.store_stream(image, cutting).map_err(SnapshotError::from)?;
        phases.store += stats;
        Ok(MemoryFile {
            name,
            form: MemoryForm::AsWritten,
            content,
        })
    }

    /// Writes a snapshot's memory image into a scratch directory.
    fn materialise_memory(
        &self,
        snap: &SnapshotRecord,
        memory: &MemoryImage,
    ) -> Result<crate::images::ScratchDir, EngineError> {
        let scratch = crate::images::ScratchDir::new(&self.home.scratch()).map_err(home_err(&self.home.scratch()))?;
        let hash: ChunkHash = snap.id.parse().map_err(|_| SnapshotError::NotFound(snap.id.clone()))?;
        for file in &memory.files {
            let path = scratch.path().join(&file.name);
            let context = ReadContext::new()
                .owner("snapshot", hash)
                .path(format!("memory image {}", file.name));
            match &file.form {
                MemoryForm::AsWritten => {
                    let f = File::create(&path).map_err(home_err(&path))?;
                    self.store
                        .restore_to_file(&file.content, &f, &context)
                        .map_err(SnapshotError::from)?;
                }
                MemoryForm::GvisorStateStream { header } => {
                    let mut raw = scratch_stream(scratch.path())?;
                    self.store
                        .restore_to_file(&file.content, &raw, &context)
                        .map_err(SnapshotError::from)?;
                    raw.seek(std::io::SeekFrom::Start(0)).map_err(home_err(&path))?;
                    let mut out = File::create(&path).map_err(home_err(&path))?;
                    cairn_sandbox::gvisor::statefile::pack(header, &mut std::io::BufReader::new(raw), &mut out)
                        .map_err(home_err(&path))?;
                }
            }
        }
        Ok(scratch)
    }
    /// `count` new sandboxes from a snapshot, or from a sandbox (snapshotted
    /// first). Returns the snapshot used and the new sandboxes.
    pub fn fork(
        &mut self,
        key: &str,
        count: usize,
        opts: &CreateOptions,
    ) -> Result<(SnapshotRecord, Vec<SandboxRecord>), EngineError> {
        if count == 0 {
            return Err(SnapshotError::BadCount(count).into());
        }
        let mut opts = opts.clone();
        let snap = match self.sandbox(key) {
            Ok(rec) => {
                opts.limits = cairn_sandbox::Limits {
                    memory_bytes: rec.memory_bytes,
                    cpu_millis: rec.cpu_millis,
                    pids: rec.pids_max,
                    disk_bytes: rec.disk_bytes,
                };
                // A fork keeps its source's network and allows; a host
                // port is one sandbox's, so published ports stay behind.
                if opts.network.is_none() {
                    opts.network = rec.network.as_ref().map(|n| cairn_sandbox::net::NetPolicy {
                        publish: Vec::new(),
                        ..n.policy.clone()
                    });
                }
                self.snapshot(&rec, None)?
            }
            Err(EngineError::NoSuchSandbox(_)) => self.snapshot_record(key)?,
            Err(e) => return Err(e),
        };
        let mut forks = Vec::with_capacity(count);
        for _ in 0..count {
            match self.restore(&snap, &opts) {
                Ok(rec) => forks.push(rec),
                Err(e) => {
                    // All or nothing.
                    for f in &forks {
                        let _ = self.sandbox(&f.id).and_then(|r| self.remove_sandbox(&r, true));
                    }
                    return Err(e);
                }
            }
        }
        Ok((snap, forks))
    }

    /// Rewinds a sandbox to a snapshot in place: its processes stop, its
    /// files become the snapshot's, it starts again (services too) under
    /// the same id and name.
    pub fn reset(&mut self, rec: &SandboxRecord, snap: &SnapshotRecord) -> Result<SandboxRecord, EngineError> {
        let manifest = self.manifest(snap)?;
        for l in &snap.layers {
            self.layers.ensure(&layer_id(l)?, &self.store)?;
        }
        match rec.state {
            SandboxState::Running => {
                self.db
                    .transition(&rec.id, SandboxState::Running, SandboxState::Exited, Some("reset"))?;
            }
            SandboxState::Exited => {}
            state => {
                return Err(EngineError::NotRunning {
                    id: rec.id.clone(),
                    state,
                    reason: rec.ended_reason.clone(),
                })
            }
        }
        let process = rec
            .pid
            .zip(rec.pid_start)
            .map(|(pid, start_time)| cairn_sandbox::SandboxProcess { pid, start_time });
        self.driver_of(rec)?.stop(&rec.id, process)?;
        self.release_network(rec)?;
        let dir = self.home.sandbox(&rec.id);
        // A fresh disk, made at the start below.
        cairn_sandbox::disk::release(&dir).map_err(|source| EngineError::Disk {
            id: rec.id.clone(),
            source,
        })?;
        for sub in ["upper", "work"] {
            let p = dir.join(sub);
            match fs::remove_dir_all(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(EngineError::Home { path: p, source }),
            }
        }
        remove_baselines(&dir);
        self.db
            .set_sandbox_layers(&rec.id, &snap.layers, &manifest.services, Some(&snap.id))?;
        self.db
            .transition(&rec.id, SandboxState::Exited, SandboxState::Creating, None)?;
        let (pid, start) = crate::sandboxes::me();
        self.db.set_owner(&rec.id, pid, start)?;
        let mut fresh = self.sandbox(&rec.id)?;
        let started = self.lease_network(&mut fresh).and_then(|mut lease| {
            self.db.set_network(&fresh.id, fresh.network.as_ref())?;
            let mut spec = self.spec(&fresh)?;
            spec.network = lease.as_ref().map(|l| l.plan.clone());
            let process = self.driver_of(&fresh)?.start(&spec)?;
            self.network_started(&fresh, lease.as_mut(), process).inspect_err(|_| {
                let _ = self.driver_of(&fresh).map(|d| d.stop(&fresh.id, Some(process)));
            })?;
            Ok(process)
        });
        let process = match started {
            Ok(p) => p,
            Err(e) => {
                let _ = self.release_network(&fresh);
                let _ = self.db.transition(
                    &rec.id,
                    SandboxState::Creating,
                    SandboxState::Exited,
                    Some("reset failed"),
                );
                return Err(e);
            }
        };
        self.db.set_running(&rec.id, process.pid, process.start_time)?;
        fresh.state = SandboxState::Running;
        fresh.pid = Some(process.pid);
        fresh.pid_start = Some(process.start_time);
        self.after_start(&fresh, true, true)?;
        Ok(fresh)
    }

    /// Forgets a snapshot. Its layers and chunks stay while anything else
    /// uses them; `cairn gc` reclaims the rest.
    pub fn remove_snapshot(&mut self, snap: &SnapshotRecord) -> Result<(), EngineError> {
        if self.db.pipeline_snapshots()?.contains(&snap.id) {
            return Err(SnapshotError::NeededByPipeline(snap.id.clone()).into());
        }
        if self.db.session_snapshots()?.contains(&snap.id) {
            return Err(SnapshotError::NeededBySession(snap.id.clone()).into());
        }
        self.db.delete_snapshot(&snap.id)?;
        self.remove_memory_image(&snap.id);
        Ok(())
    }

    /// Removes the local memory image of snapshot `id` (whose row is gone)
    /// and its seal; one left behind is swept by gc.
    pub fn remove_memory_image(&self, id: &str) {
        let image = self.home.memory_image(id);
        let _ = fs::remove_file(crate::memory_cache::path_of(&image));
        let _ = fs::remove_dir_all(image);
    }

    /// Removes local memory images whose snapshot is gone.
    pub(crate) fn sweep_memory_images(&self) -> Result<Vec<String>, EngineError> {
        let known: HashSet<String> = self.db.snapshots()?.into_iter().map(|s| s.id).collect();
        let mut removed = Vec::new();
        if let Ok(entries) = fs::read_dir(self.home.memory_images()) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(sealed) = name.strip_prefix(".seal-") {
                    // A seal goes with its image; `.seal-<id>.tmp-<pid>`
                    // is one being written.
                    if !sealed.contains('.') && !known.contains(sealed) {
                        let _ = fs::remove_file(e.path());
                    }
                    continue;
                }
                // Images set aside because they changed: see `gc`.
                if name.starts_with(".changed-") {
                    continue;
                }
                if !known.contains(&name) && fs::remove_dir_all(e.path()).is_ok() {
                    removed.push(name);
                }
            }
        }
        Ok(removed)
    }

    /// Every chunk-store object that layers, snapshots and session log
    /// payloads reach: each root's own object and every chunk it names
    /// (layer indexes' file chunks, snapshots' memory images, payloads'
    /// chunk lists). Reads each root, so a missing or corrupt one is an
    /// error. The collector keeps these; a session export copies them.
    pub fn reachable_objects(
        &self,
        layers: &HashSet<String>,
        snapshots: &[SnapshotRecord],
        payloads: &HashSet<String>,
    ) -> Result<Vec<ChunkHash>, EngineError> {
        let mut live: Vec<ChunkHash> = Vec::new();
        for l in layers {
            let id = layer_id(l)?;
            live.extend(layer_objects(&self.store, &id).map_err(SnapshotError::from)?);
        }
        for snap in snapshots {
            if let Ok(h) = snap.id.parse() {
                live.push(h);
                if let Some(memory) = self.manifest(snap)?.memory {
                    live.extend(memory.files.iter().flat_map(|f| f.content.chunk_hashes()));
                }
            }
        }
        // Session log payloads too large for their rows.
        for p in payloads {
            let Ok(h) = p.parse::<ChunkHash>() else { continue };
            let context = ReadContext::new().owner("session payload", h);
            let object: crate::objects::PayloadObject =
                self.store.get_object(&h, &context).map_err(SnapshotError::from)?;
            live.push(h);
            live.extend(object.content.chunk_hashes());
        }
        Ok(live)
    }

    /// Sweeps the chunk store (under the exclusive store lock): everything
    /// not reachable from a live layer or snapshot goes, including partial
    /// writes of interrupted snapshots.
    pub(crate) fn collect_chunks(&self, referenced: &HashSet<String>) -> Result<cairn_store::GcReport, EngineError> {
        let mut live = self.reachable_objects(referenced, &self.db.snapshots()?, &self.db.session_payloads()?)?;
        // Pipeline artifacts: their chunk lists and content; those still
        // pending too, unless their attempt can no longer commit them.
        // Pending ones are read first: a completion moves rows from pending
        // to committed (never back) without the store lock, so one that
        // lands between the two reads is in the second. Read the other way
        // round, an artifact committed in between was in neither, and its
        // chunks went as garbage.
        let mut artifacts = self.db.live_pending_artifacts()?;
        artifacts.extend(self.db.artifacts(None)?);
        for a in artifacts {
            let Ok(h) = a.id.parse::<ChunkHash>() else { continue };
            let context = ReadContext::new().owner("artifact", h).path(a.path.clone());
            let object: crate::objects::ArtifactObject =
                self.store.get_object(&h, &context).map_err(SnapshotError::from)?;
            live.push(h);
            live.extend(object.content.chunk_hashes());
        }
        // No grace period: every writer of chunks (snapshots, image builds
        // and imports, pipeline artifacts) holds the store lock shared from
        // its first chunk until the row that references them is committed,
        // and this runs under the exclusive lock, so an unreferenced chunk
        // here is garbage however young. Writes still in progress keep
        // their temp files while their process runs.
        //
        // A remote store is shared with writers on other hosts, which this
        // lock does not reach: there, unreferenced objects younger than
        // REMOTE_GC_GRACE are kept, and pending uploads are never swept.
        let grace = if self.store.backend().is_remote() {
            REMOTE_GC_GRACE
        } else {
            Duration::ZERO
        };
        Ok(cairn_store::collect_garbage(self.store.backend(), live, grace).map_err(SnapshotError::from)?)
    }
}

/// GC's grace period over a remote (S3) store: longer than the window in
/// which S3 counts an object as refreshed (`cairn_store::REFRESH_WINDOW`,
/// 15 minutes) plus the longest a writer on another host takes from
/// storing a chunk to committing the row that references it.
const REMOTE_GC_GRACE: Duration = Duration::from_secs(2 * 3600);

/// The checkpoint window of a sandbox stopped by its snapshot, open under
/// its lifecycle lock until the snapshot is recorded. Dropped without
/// [`HeldWindow::close`] (the snapshot failed), the window stays for the
/// next command, which restores the sandbox from its complete image.
struct HeldWindow {
    window: Window,
    _lifecycle: Option<Flock<File>>,
}

impl HeldWindow {
    fn close(self, sandbox: &str) {
        if let Err(e) = self.window.close() {
            tracing::warn!(sandbox, "cannot close the checkpoint window: {e}");
        }
    }
}

/// What a sandbox does after its snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    GoOn,
    Stop,
}

/// The file of a checkpoint image that holds raw memory pages (runsc
/// releases that write one, with `--compression=none`).
const PAGES_FILE: &str = "pages.img";

/// The plain files of a checkpoint image directory, by name.
fn image_files(dir: &Path) -> Result<Vec<String>, EngineError> {
    let mut names: Vec<_> = fs::read_dir(dir)
        .map_err(home_err(dir))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

/// The most entries a new layer may have and still be materialised by the
/// snapshot that captured it.
const EAGER_LAYER_ENTRIES: u64 = 64 * 1024;

/// The baseline at `path`, when there is one and it passes its checks (a
/// capture without one records the whole upper directory).
fn read_baseline(path: &Path) -> Option<Baseline> {
    if !path.exists() {
        return None;
    }
    Baseline::open(path)
        .inspect_err(|e| tracing::warn!("{e}; the snapshot records every file of the sandbox"))
        .ok()
}

/// Replaces the sandbox's baseline with the one for `snapshot`, atomically.
fn write_baseline(dir: &Path, snapshot: &str, baseline: Baseline) {
    if baseline.persist(&dir.join(format!("baseline-{snapshot}"))).is_ok() {
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("baseline-") && name != format!("baseline-{snapshot}") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }
}

fn remove_baselines(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("baseline-") {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

fn home_err(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError {
    let path = path.to_path_buf();
    move |source| EngineError::Home { path, source }
}

/// A scratch file in `dir` for a gVisor state stream, unlinked at once: it
/// goes when closed, or with the process however it ends.
fn scratch_stream(dir: &Path) -> Result<File, EngineError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!(".stream-{}-{n}", std::process::id()));
    let file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(home_err(&path))?;
    fs::remove_file(&path).map_err(home_err(&path))?;
    Ok(file)
}

/// An error that lost or corrupt stored data caused, named with the
/// snapshot being restored; any other error as it is.
fn damaged(snap: &SnapshotRecord, e: EngineError) -> EngineError {
    use cairn_layers::archive::ArchiveError;
    use cairn_layers::LayerError;
    let store = |s: &StoreError| matches!(s, StoreError::ChunkCorrupt { .. } | StoreError::ChunkMissing { .. });
    let archive = |a: &ArchiveError| matches!(a, ArchiveError::Store(s) if store(s));
    let lost = match &e {
        EngineError::Snapshot(SnapshotError::Store(s)) => store(s),
        EngineError::Snapshot(SnapshotError::Archive(a)) | EngineError::Layer(LayerError::Archive(a)) => archive(a),
        // A layer directory that changed and could not be rebuilt from the store.
        EngineError::Layer(LayerError::Changed { .. }) => true,
        _ => false,
    };
    if !lost {
        return e;
    }
    SnapshotError::Damaged {
        id: snap.id.clone(),
        source: Box::new(e),
    }
    .into()
}
