//! The API's wire types: what clients send and get. The engine's records
//! stay the engine's; these are mapped from them, and the OpenAPI document
//! is generated from these.

mod runs;
mod sessions;

use std::collections::{BTreeMap, HashMap};

use cairn_engine::{ImageRecord, SandboxRecord, SnapshotRecord};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

pub use runs::*;
pub use sessions::*;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Sandbox {
    pub id: String,
    pub name: String,
    pub image: String,
    /// `native` or `gvisor`.
    pub driver: String,
    /// `creating`, `running`, `exited` or `removing`.
    pub state: String,
    pub pid: Option<i32>,
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids_max: u32,
    /// The size of its disk (`limits.disk`); absent: none of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// Processes the OOM killer killed in it for exceeding its memory
    /// limit, while it runs (its cgroup's count).
    pub oom_kills: u64,
    /// Milliseconds since the epoch.
    pub created_at: i64,
    pub ended_reason: Option<String>,
    /// Background commands started after every start, restore, fork and reset.
    pub services: Vec<String>,
    /// The sandbox's newest snapshot, if any.
    pub last_snapshot: Option<String>,
    /// Absent: loopback only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkView>,
}

/// A sandbox's network, as asked for and as held now.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct NetworkView {
    /// `egress`.
    pub mode: String,
    /// What it may reach; empty: anything but link-local, private and this
    /// host's addresses.
    pub allow: Vec<String>,
    /// `[ADDR:]HOSTPORT:PORT`.
    pub publish: Vec<String>,
    /// Its address while it runs.
    pub address: Option<String>,
    pub gateway: Option<String>,
    pub mac: Option<String>,
}

impl From<cairn_engine::network::SandboxNetwork> for NetworkView {
    fn from(n: cairn_engine::network::SandboxNetwork) -> NetworkView {
        NetworkView {
            mode: n.policy.mode().into(),
            allow: n.policy.allow.iter().map(|a| a.to_string()).collect(),
            publish: n.policy.publish.iter().map(|p| p.to_string()).collect(),
            address: n.held.as_ref().map(|h| h.address.to_string()),
            gateway: n.held.as_ref().map(|h| h.gateway.to_string()),
            mac: n.held.map(|h| h.mac),
        }
    }
}

/// The network a new sandbox (or session) gets; absent: loopback only (a
/// fork of a sandbox: the sandbox's). docs/network.md.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// `none` or `egress` (implied by `allow` or `publish`).
    pub mode: Option<String>,
    /// `HOST[:PORT]`, `ADDRESS[:PORT]` or `ADDRESS/LEN[:PORT]`; with any,
    /// everything else is refused. At most 64.
    #[serde(default)]
    pub allow: Vec<String>,
    /// `[ADDR:]HOSTPORT:PORT`: the sandbox's TCP port at this host's port, on
    /// every host address or on ADDR (IPv4) alone. At most 16.
    #[serde(default)]
    pub publish: Vec<String>,
}

impl NetworkRequest {
    pub fn policy(&self) -> Result<cairn_sandbox::net::NetPolicy, String> {
        if self.allow.len() > 64 || self.publish.len() > 16 {
            return Err("network: at most 64 allows and 16 published ports".into());
        }
        for text in self.allow.iter().chain(&self.publish) {
            if text.len() > 300 {
                return Err("network: an entry over 300 bytes".into());
            }
        }
        cairn_sandbox::net::NetPolicy::parse(self.mode.as_deref(), &self.allow, &self.publish)
            .map_err(|e| format!("network: {e}"))
    }
}

/// Where a sandbox's port is reached from this host (E2B's `get_host`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PortHost {
    /// `ADDRESS:PORT` of the sandbox, reachable from this host.
    pub host: String,
    pub port: u16,
    pub url: String,
    /// Host ports published to this port (reachable from other machines too).
    pub published: Vec<u16>,
}

impl From<SandboxRecord> for Sandbox {
    fn from(r: SandboxRecord) -> Sandbox {
        Sandbox {
            id: r.id,
            name: r.name,
            image: r.image,
            driver: r.driver,
            state: r.state.to_string(),
            pid: r.pid,
            memory_bytes: r.memory_bytes,
            cpu_millis: r.cpu_millis,
            pids_max: r.pids_max,
            disk_bytes: r.disk_bytes,
            oom_kills: r.oom_kills,
            created_at: r.created_at,
            ended_reason: r.ended_reason,
            services: r.services,
            last_snapshot: r.last_snapshot,
            network: r.network.map(NetworkView::from),
        }
    }
}

/// Limits of a new sandbox; each defaults as `cairn create` does.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Memory limit, e.g. `512M` or `2G` (default 1G).
    pub memory: Option<String>,
    /// CPU limit in cores, fractions allowed, e.g. `1.5` (default: all).
    pub cpus: Option<String>,
    /// Processes and threads (default 1024).
    #[schema(minimum = 8, maximum = 4194304)]
    pub pids: Option<u32>,
    /// Disk limit, e.g. `10G` (at least 16M): the size of the file system
    /// the sandbox's files go on; a write past it fails with ENOSPC.
    /// Default: the server's `CAIRN_DISK`, else none. A fork of a sandbox
    /// keeps the sandbox's.
    pub disk: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Image to start from (default `busybox`, built on first use).
    pub image: Option<String>,
    /// Start from this snapshot instead of an image (a restore).
    pub snapshot: Option<String>,
    /// `native` (default) or `gvisor`.
    pub driver: Option<String>,
    /// Name, also the host name (letters, digits, '-').
    pub name: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    /// Commands kept running in the background.
    #[serde(default)]
    pub services: Vec<String>,
    pub network: Option<NetworkRequest>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SandboxPage {
    pub items: Vec<Sandbox>,
    /// Pass as `after` for the next page; absent on the last one.
    pub next: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SandboxQuery {
    /// Only sandboxes in this state.
    pub state: Option<String>,
    /// Only sandboxes from this image.
    pub image: Option<String>,
    /// At most this many (default 100, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// The `next` of the previous page.
    pub after: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    /// Remove a running sandbox (its processes are killed).
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// The program and its arguments, e.g. `["sh", "-c", "echo hi"]`.
    #[schema(min_items = 1)]
    pub argv: Vec<String>,
    /// Added to the default environment (PATH, HOME, TERM).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (default `/`, or the WORKDIR of an image built
    /// with `cairn image build --file`).
    pub cwd: Option<String>,
    /// Run as this user of the sandbox: a name from its `/etc/passwd` or
    /// `UID[:GID]` (default root, or the USER of an image built with
    /// `cairn image build --file`).
    pub user: Option<String>,
    /// Kill the process after this many seconds (it then reports `timed_out`).
    pub timeout_secs: Option<f64>,
    /// Text written to the process's stdin, which is then closed. For a
    /// streamed exec, stdin may instead be sent while it runs
    /// (`POST .../processes/{pid}/stdin`) when `stdin_open` is true.
    pub stdin: Option<String>,
    /// Streamed exec only: keep stdin open for `.../stdin` calls.
    #[serde(default)]
    pub stdin_open: bool,
    /// Start in the background and answer at once with the pid; the
    /// output goes to the sandbox log.
    #[serde(default)]
    pub detach: bool,
    /// Streamed exec only: what happens to the process when the client
    /// goes away before it ends: `kill` (default) or `keep`.
    pub on_disconnect: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ExecResult {
    pub pid: i32,
    /// The shell convention: the exit code, or 128 + the signal, 124 on
    /// timeout, 127 when the program does not exist.
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// Killed by the kernel for exceeding the sandbox's memory limit.
    pub oom_killed: bool,
    /// Output as UTF-8 (invalid sequences replaced); stream the exec for
    /// bytes exactly.
    pub stdout: String,
    pub stderr: String,
    /// Output beyond 16 MiB per stream is not kept here.
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Detached {
    pub pid: i32,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinBody {
    /// Text to write (`data`), or bytes in base64 (`data_base64`).
    pub data: Option<String>,
    pub data_base64: Option<String>,
    /// Close stdin after writing.
    #[serde(default)]
    pub close: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    /// A signal number (9) or name (`KILL`, `SIGTERM`).
    pub signal: Signal,
}

/// A signal by number (1 to 64) or name.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Signal {
    Number(i64),
    Name(String),
}

/// Bytes, as an HTTP body.
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
pub struct Binary(#[allow(dead_code)] Vec<u8>);

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct FileStat {
    pub path: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    /// Permission bits, e.g. 420 (0644).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Modification time in nanoseconds since the epoch.
    pub mtime_ns: i64,
}

impl From<cairn_protocol::FileMeta> for FileStat {
    fn from(m: cairn_protocol::FileMeta) -> FileStat {
        FileStat {
            path: m.path,
            kind: match m.kind {
                cairn_protocol::FileKind::File => "file",
                cairn_protocol::FileKind::Dir => "dir",
                cairn_protocol::FileKind::Symlink => "symlink",
                cairn_protocol::FileKind::Other => "other",
            }
            .into(),
            mode: m.mode,
            uid: m.uid,
            gid: m.gid,
            size: m.size,
            mtime_ns: m.mtime_ns.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        }
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// An absolute path inside the sandbox.
    pub path: String,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UploadQuery {
    /// An absolute path inside the sandbox; its directory must exist.
    pub path: String,
    /// Permission bits in octal, e.g. `755` (default `644`).
    pub mode: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Snapshot {
    pub id: String,
    pub parent_id: Option<String>,
    pub sandbox_id: String,
    pub image: String,
    pub driver: String,
    pub label: Option<String>,
    pub created_at: i64,
    /// Bytes this snapshot changed against its parent.
    pub new_bytes: u64,
    /// Bytes it added to the store after deduplication and compression.
    pub stored_bytes: u64,
    /// When every object the snapshot reaches was confirmed in the remote
    /// chunk store (ms since the epoch), so any host sharing the state and
    /// the store can restore it. Null while uploads are pending, and
    /// always for a server whose chunks stay on this host.
    pub remote_durable_at: Option<i64>,
}

impl Snapshot {
    /// The snapshot with its durability looked up in `durable` (from
    /// `Engine::remote_durability`; `None`: no remote store).
    pub fn with_durability(rec: SnapshotRecord, durable: Option<&HashMap<String, i64>>) -> Snapshot {
        let at = durable.and_then(|d| d.get(&rec.id).copied());
        Snapshot {
            remote_durable_at: at,
            ..Snapshot::from(rec)
        }
    }
}

impl From<SnapshotRecord> for Snapshot {
    fn from(s: SnapshotRecord) -> Snapshot {
        Snapshot {
            id: s.id,
            parent_id: s.parent_id,
            sandbox_id: s.sandbox_id,
            image: s.image,
            driver: s.driver,
            label: s.label,
            created_at: s.created_at,
            new_bytes: s.new_bytes,
            stored_bytes: s.stored_bytes,
            remote_durable_at: None,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SnapshotDetail {
    #[serde(flatten)]
    pub snapshot: Snapshot,
    /// Its ancestors, parent first.
    pub lineage: Vec<Snapshot>,
    /// Ids of the snapshots taken from it.
    pub children: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SnapshotPage {
    pub items: Vec<Snapshot>,
    pub next: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// At most this many (default 100, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// The `next` of the previous page.
    pub after: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// 1 to 64 printable characters.
    pub label: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// How many sandboxes (default 1, at most 64).
    pub count: Option<usize>,
    pub driver: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    /// Absent: a fork of a sandbox keeps its network (not its published ports).
    pub network: Option<NetworkRequest>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ForkResult {
    /// The snapshot the forks start from (taken first when forking a sandbox).
    pub snapshot: Snapshot,
    pub sandboxes: Vec<Sandbox>,
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreBody {
    pub driver: Option<String>,
    pub name: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    pub network: Option<NetworkRequest>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetBody {
    /// The snapshot to rewind to.
    pub snapshot: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Image {
    pub name: String,
    pub source: String,
    pub size_bytes: u64,
    pub created_at: i64,
}

impl From<ImageRecord> for Image {
    fn from(i: ImageRecord) -> Image {
        Image {
            name: i.name,
            source: i.source,
            size_bytes: i.size_bytes,
            created_at: i.created_at,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildImage {
    pub name: String,
    /// `busybox` or `debian` (debootstrap).
    pub kind: String,
    /// Debian suite (default: the host's).
    pub suite: Option<String>,
    /// Extra Debian packages.
    #[serde(default)]
    pub packages: Vec<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ImportQuery {
    /// The new image's name.
    pub name: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
    pub version: String,
}

/// Items after the cursor `after` (an id), at most `limit`, and the next cursor.
pub fn page<T>(
    items: Vec<T>,
    id: impl Fn(&T) -> &str,
    after: Option<&str>,
    limit: Option<usize>,
) -> (Vec<T>, Option<String>) {
    let limit = limit.unwrap_or(100).clamp(1, 1000);
    let start = match after {
        Some(a) => items.iter().position(|x| id(x) == a).map_or(items.len(), |i| i + 1),
        None => 0,
    };
    let mut rest: Vec<T> = items.into_iter().skip(start).collect();
    let next = (rest.len() > limit).then(|| id(&rest[limit - 1]).to_string());
    rest.truncate(limit);
    (rest, next)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// An absolute directory path inside the sandbox (not a symlink).
    pub path: String,
    /// 1 lists the directory's children; up to 16 levels (default 1).
    #[param(minimum = 1, maximum = 16)]
    pub depth: Option<u32>,
    /// At most this many entries (default and most 10000); `truncated` says when more were there.
    #[param(minimum = 1, maximum = 10000)]
    pub limit: Option<u32>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DirEntryView {
    #[serde(flatten)]
    pub stat: FileStat,
    /// A symlink's target, as stored (never followed).
    pub symlink_target: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DirListingView {
    pub entries: Vec<DirEntryView>,
    pub truncated: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MakeDirBody {
    pub path: String,
    /// Make missing parents too.
    #[serde(default)]
    pub parents: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct MadeDir {
    /// False when a directory was already there.
    pub created: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveBody {
    pub from: String,
    pub to: String,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RemoveFileQuery {
    pub path: String,
    /// Remove a directory and everything in it (symlinks are removed, never followed).
    #[serde(default)]
    pub recursive: bool,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DiffQuery {
    /// The side compared from: a snapshot (id, prefix or label), a sandbox
    /// (id, prefix or name: its files as they are now) or RUN/STAGE[.BRANCH].
    pub a: String,
    /// The side compared to, named the same ways.
    pub b: String,
    /// Unified diffs for text files of at most this many bytes on each side
    /// (default 262144; 0 for none).
    #[param(minimum = 0, maximum = 4194304)]
    pub text_max: Option<u64>,
    /// List at most this many changes (default 10000, at most 100000); the
    /// counts cover all of them.
    #[param(minimum = 1, maximum = 100000)]
    pub max_changes: Option<usize>,
}

/// How side `b` differs from side `a` (`cairn diff`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SnapshotDiff {
    pub a: DiffSide,
    pub b: DiffSide,
    pub added: u64,
    pub removed: u64,
    pub changed: u64,
    /// Layers both sides share, not compared.
    pub shared_layers: usize,
    /// In path order, a parent before its children.
    pub changes: Vec<FileChange>,
    /// More changes exist than listed (`max_changes`).
    pub truncated: bool,
    /// Milliseconds the comparison took.
    pub took_ms: f64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DiffSide {
    /// What was asked for.
    pub key: String,
    /// `snapshot`, `sandbox` or `stage`.
    pub kind: String,
    /// The snapshot compared (none for a sandbox: its files as they are now).
    pub snapshot_id: Option<String>,
    pub sandbox_id: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct FileChange {
    /// Absolute, as the sandbox sees it.
    pub path: String,
    /// `added`, `removed` or `changed`.
    pub change: String,
    /// For a change: what differs (`type`, `content`, `mode`, `owner`); a
    /// modification time alone is not a change.
    #[serde(default)]
    pub what: Vec<String>,
    pub before: Option<DiffEntry>,
    pub after: Option<DiffEntry>,
    /// A unified diff, for text files under `text_max`.
    pub diff: Option<String>,
    /// Why a file has no unified diff (`binary`, `over N bytes`, `text budget spent`).
    pub no_diff: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DiffEntry {
    /// `file`, `directory`, `symlink`, `fifo`, `socket` or `device`.
    pub kind: String,
    pub size: u64,
    /// Permission bits as octal text (`0644`).
    pub mode: String,
    pub uid: u32,
    pub gid: u32,
    /// A symlink's target (never followed).
    pub target: Option<String>,
}

impl From<cairn_engine::SnapshotDiff> for SnapshotDiff {
    fn from(d: cairn_engine::SnapshotDiff) -> Self {
        // The engine's record serialises to exactly these fields.
        serde_json::to_value(d)
            .and_then(serde_json::from_value)
            .expect("the engine's diff and the API's have the same fields")
    }
}

/// The headers of a create, fork or restore that the admission queue reads
/// (docs/api.md, "Capacity").
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct AdmissionHeaders {
    /// Waiting for capacity, higher goes first (-1000 to 1000, default 0).
    #[serde(rename = "Priority")]
    pub priority: Option<i64>,
    /// Seconds to wait for capacity before a 429 (up to 3600, default 300).
    #[serde(rename = "Request-Timeout")]
    pub request_timeout: Option<f64>,
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VerifyBody {
    /// Replace damaged copies with intact ones (a store in S3).
    #[serde(default)]
    pub repair: bool,
}

/// `cairn verify` of one snapshot: every object it reaches, read back from
/// each copy and hashed again.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SnapshotVerification {
    pub snapshot_id: String,
    /// The root of the hash tree over everything the snapshot holds: its id.
    pub root_hash: String,
    pub objects: u64,
    /// Stored bytes read back, every copy counted.
    pub bytes_read: u64,
    pub damaged: Vec<DamagedObject>,
    /// Parts whose own objects could not be read, so what they reach was not listed.
    pub unreadable: Vec<String>,
    /// Nothing damaged (after `repair`: every damaged copy mended) and nothing unreadable.
    pub ok: bool,
    pub took_ms: f64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DamagedObject {
    pub hash: String,
    /// What it holds: a file's path and offset, a memory image file, a layer's index.
    pub what: String,
    /// The local copy (or the cache's, in front of S3): `missing`, `corrupt: …`.
    pub local: String,
    /// The bucket's copy, with a store in S3.
    pub remote: Option<String>,
    /// With `repair`: what was done, or why nothing could be.
    pub repair: Option<String>,
    /// Whether an intact copy exists.
    pub recoverable: bool,
}

impl From<cairn_engine::verify::Verification> for SnapshotVerification {
    fn from(v: cairn_engine::verify::Verification) -> Self {
        // The engine's record serialises to exactly these fields.
        serde_json::to_value(v)
            .and_then(serde_json::from_value)
            .expect("the engine's verification and the API's have the same fields")
    }
}
