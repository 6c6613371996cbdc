//! Helpers for end-to-end tests that drive the real `cairn` binary against
//! real namespaces, cgroups and overlay mounts.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

pub const CAIRN: &str = env!("CARGO_BIN_EXE_cairn");

/// Why end-to-end tests cannot run here, if they cannot.
pub fn missing_prerequisite() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root: sandboxes need root for namespaces, cgroups and mounts".into());
    }
    if cairn_sandbox::cgroup::Hierarchy::detect("probe").is_err() {
        return Some("no usable cgroup hierarchy".into());
    }
    None
}

/// Says loudly that a test is skipped, and why (with the command that
/// installs what is missing); under CI (`CI=true`) a missing part fails the
/// test instead.
pub fn skipped(message: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{message} (CI=true: a missing part fails the test)");
    }
    eprintln!("SKIPPED {message}");
}

/// Returns true (after saying so loudly) when the test must be skipped.
pub fn skip(test: &str) -> bool {
    match missing_prerequisite() {
        Some(why) => {
            skipped(&format!("{test}: {why}"));
            true
        }
        None => false,
    }
}

/// [`skip`], and also when the host cannot give sandboxes disks (`--disk`:
/// loop devices and mkfs.ext4).
pub fn skip_without_disks(test: &str) -> bool {
    if skip(test) {
        return true;
    }
    match cairn_sandbox::disk::available() {
        Ok(_) => false,
        Err(why) => {
            skipped(&format!(
                "{test}: {why}; --disk needs loop devices (modprobe loop) and e2fsprogs (apt-get install e2fsprogs)"
            ));
            true
        }
    }
}

/// [`skip`], and also when runsc (gVisor) is missing.
pub fn skip_without_runsc(test: &str) -> bool {
    if skip(test) {
        return true;
    }
    // The runsc Cairn uses: $CAIRN_RUNSC when set (an older build under
    // test, say), else the one on PATH.
    let runsc = std::env::var_os("CAIRN_RUNSC").unwrap_or_else(|| "runsc".into());
    if Command::new(&runsc).arg("--version").output().is_err() {
        skipped(&format!(
            "{test}: runsc (gVisor) {} cannot run; apt-get install runsc, or set CAIRN_RUNSC to a runsc binary",
            runsc.to_string_lossy()
        ));
        return true;
    }
    false
}

/// A fresh state directory with the busybox image, removed (after a gc) on drop.
pub struct Home {
    pub dir: tempfile::TempDir,
    /// The state store's URL (`CAIRN_STATE`); None: the embedded store.
    pub state: Option<String>,
    /// More environment for every command (e.g. `CAIRN_STORE` and its
    /// credentials).
    pub env: Vec<(String, String)>,
}

/// One busybox build for the whole test binary; each home imports it.
pub fn busybox_layer() -> &'static Path {
    static LAYER: OnceLock<PathBuf> = OnceLock::new();
    LAYER.get_or_init(|| {
        // Kept between runs under the target directory; rebuilt when missing
        // or written by an older build.
        let shared = Path::new(env!("CARGO_TARGET_TMPDIR")).join("busybox-home");
        let layer_of = || -> Option<PathBuf> {
            let out = Command::new(CAIRN)
                .args(["image", "ls", "--json"])
                .env("CAIRN_HOME", &shared)
                .output()
                .ok()?;
            let images: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let layer = images.as_array()?.iter().find(|i| i["name"] == "busybox")?["layers"][0]
                .as_str()?
                .to_string();
            Some(shared.join("layers").join(layer)).filter(|p| p.is_dir())
        };
        if let Some(layer) = layer_of() {
            return layer;
        }
        let _ = std::fs::remove_dir_all(&shared);
        let out = Command::new(CAIRN)
            .args(["image", "build", "busybox"])
            .env("CAIRN_HOME", &shared)
            .stderr(Stdio::inherit())
            .output()
            .expect("run cairn");
        assert!(out.status.success(), "building busybox failed");
        layer_of().expect("the busybox image just built")
    })
}

impl Home {
    pub fn new() -> Home {
        Home::with_state(None)
    }

    /// A fresh state directory with no image at all.
    pub fn empty() -> Home {
        let dir = tempfile::Builder::new().prefix("cairn-e2e").tempdir_in("/tmp").unwrap();
        Home {
            dir,
            state: None,
            env: Vec::new(),
        }
    }

    /// A home whose state is in the store `state` names (e.g. a PostgreSQL URL).
    pub fn with_state(state: Option<String>) -> Home {
        Home::with_state_and_env(state, Vec::new())
    }

    /// A fresh directory with no image of its own, on the state `state`
    /// names, its commands run with `env` added.
    pub fn bare(state: Option<String>, env: Vec<(String, String)>) -> Home {
        let dir = tempfile::Builder::new().prefix("cairn-e2e").tempdir_in("/tmp").unwrap();
        Home { dir, state, env }
    }

    /// A home whose commands all run with `env` added, the busybox image
    /// imported with it.
    pub fn with_state_and_env(state: Option<String>, env: Vec<(String, String)>) -> Home {
        let dir = tempfile::Builder::new().prefix("cairn-e2e").tempdir_in("/tmp").unwrap();
        Home::importing(Home { dir, state, env })
    }

    /// A home with the busybox image in a new directory under `parent`
    /// (on the filesystem a test chose).
    pub fn in_dir(parent: &Path) -> Home {
        let dir = tempfile::Builder::new().prefix("cairn-e2e").tempdir_in(parent).unwrap();
        Home::importing(Home {
            dir,
            state: None,
            env: Vec::new(),
        })
    }

    fn importing(home: Home) -> Home {
        let out = home.cairn(&[
            "image",
            "import",
            busybox_layer().to_str().unwrap(),
            "--name",
            "busybox",
        ]);
        assert!(
            out.status.success(),
            "import failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        home
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The chunk store's file for object `hash` (the local store, or the
    /// cache in front of S3): two levels of fan-out by its first bytes.
    pub fn store_object(&self, hash: &str) -> PathBuf {
        self.path()
            .join("store/objects")
            .join(&hash[..2])
            .join(&hash[2..4])
            .join(hash)
    }

    /// The layer ids of snapshot `id`, as `cairn snapshots --json` lists them.
    pub fn snapshot_layers(&self, id: &str) -> Vec<String> {
        let listed: serde_json::Value = serde_json::from_str(&self.ok(&["snapshots", "--json"])).unwrap();
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id)
            .unwrap_or_else(|| panic!("snapshot {id} is not listed: {listed}"))["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap().to_string())
            .collect()
    }

    /// The directory of the busybox image's layer in this home.
    pub fn busybox_layer(&self) -> PathBuf {
        let images: serde_json::Value = serde_json::from_str(&self.ok(&["image", "ls", "--json"])).unwrap();
        let image = images
            .as_array()
            .and_then(|all| all.iter().find(|i| i["name"] == "busybox"))
            .expect("the busybox image");
        self.path().join("layers").join(image["layers"][0].as_str().unwrap())
    }

    /// The cgroup directories a sandbox of this home would have.
    pub fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        let scope = cairn_engine::Home::at(self.path()).scope();
        cairn_sandbox::cgroup::Hierarchy::detect(&scope).unwrap().dirs(id)
    }

    /// This home's cgroup hierarchy (v1 or v2) under its scope.
    pub fn cgroups(&self) -> cairn_sandbox::cgroup::Hierarchy {
        cairn_sandbox::cgroup::Hierarchy::detect(&cairn_engine::Home::at(self.path()).scope()).unwrap()
    }

    /// Ids of this home's sandboxes that have cgroups on the host (emptied
    /// cgroups waiting in the pool are not sandboxes').
    pub fn sandbox_cgroups_left(&self) -> Vec<String> {
        self.cgroups().sandbox_ids()
    }

    /// Runs `cairn gc` (which drains the pool of emptied cgroups), then
    /// gives [`Home::cgroup_scopes_left`]: a pooled cgroup is only not a
    /// leak if gc removes it.
    pub fn cgroup_scopes_after_gc(&self) -> Vec<PathBuf> {
        self.ok(&["gc"]);
        self.cgroup_scopes_left()
    }

    /// This home's cgroup scope directories that exist: any sandbox cgroup
    /// left behind keeps its scope, and so does a pooled one until `gc`
    /// (the scope goes with its last cgroup).
    pub fn cgroup_scopes_left(&self) -> Vec<PathBuf> {
        self.cgroup_dirs("x")
            .iter()
            .filter_map(|d| d.parent())
            .filter(|scope| scope.exists())
            .map(Path::to_path_buf)
            .collect()
    }

    /// The content of a sandbox's cgroup file (`cpu.max`, `pids.max`, ...),
    /// from whichever of its cgroup directories holds it.
    pub fn cgroup_file(&self, id: &str, file: &str) -> String {
        self.cgroup_dirs(id)
            .iter()
            .find_map(|d| std::fs::read_to_string(d.join(file)).ok())
            .unwrap_or_else(|| panic!("no cgroup of {id} has {file}"))
            .trim()
            .to_string()
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(CAIRN);
        c.args(args).env("CAIRN_HOME", self.path()).stdin(Stdio::null());
        match &self.state {
            Some(url) => c.env("CAIRN_STATE", url),
            None => c.env_remove("CAIRN_STATE"),
        };
        c.env_remove("CAIRN_STORE");
        // The test's commands are the administrator's unless a test says.
        c.env_remove("CAIRN_TOKEN");
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    pub fn cairn(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run cairn")
    }

    /// Runs cairn, asserts success, returns trimmed stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cairn(args);
        assert!(
            out.status.success(),
            "cairn {args:?} failed with {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Runs a shell script in a sandbox, asserts success, returns its output.
    pub fn sh(&self, id: &str, script: &str) -> String {
        self.ok(&["exec", id, "--", "sh", "-c", script])
    }

    /// Starts a shell script in the background in a sandbox.
    pub fn sh_detached(&self, id: &str, script: &str) -> String {
        self.ok(&["exec", "-d", id, "--", "sh", "-c", script])
    }

    /// The number in a file a background process keeps rewriting (a read can
    /// land between its truncate and its write).
    pub fn read_number(&self, id: &str, path: &str) -> u64 {
        (0..100)
            .find_map(|_| self.ok(&["exec", id, "--", "cat", path]).parse().ok())
            .unwrap_or_else(|| panic!("{path} never held a number"))
    }

    /// Sandboxes as `cairn ps --json` reports them.
    pub fn ps(&self) -> Vec<serde_json::Value> {
        serde_json::from_str(&self.ok(&["ps", "--json"])).unwrap()
    }

    /// Mounts that mention this home (there must be none on the host).
    pub fn host_mounts(&self) -> Vec<String> {
        let home = self.path().to_string_lossy().into_owned();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(&home))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        // Leave nothing running whatever the test did.
        let ids = self.cairn(&["ps", "-q"]);
        for id in String::from_utf8_lossy(&ids.stdout).lines() {
            let _ = self.cairn(&["rm", "-f", id]);
        }
        // Drains the pool of emptied cgroups the removals filled.
        let _ = self.cairn(&["gc"]);
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// One entry of a sandbox's file tree as the host sees it through
/// `/proc/PID/root`: everything a snapshot must keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u64,
    pub mtime: (i64, i64),
    pub target: Option<PathBuf>,
    pub content: Option<String>,
    pub xattrs: Vec<(String, Vec<u8>)>,
}

/// The sandbox's tree (without /proc, /sys, /dev), keyed by path.
pub fn tree(init_pid: i32) -> std::collections::BTreeMap<String, Seen> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let root = PathBuf::from(format!("/proc/{init_pid}/root"));
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = e.path();
            let rel = path.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
            if ["proc", "sys", "dev"].contains(&rel.as_str()) {
                continue;
            }
            let md = std::fs::symlink_metadata(&path).unwrap();
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                stack.push(path.clone());
                "dir"
            } else if ft.is_symlink() {
                "symlink"
            } else if ft.is_fifo() {
                "fifo"
            } else if ft.is_file() {
                "file"
            } else {
                "other"
            };
            let content = ft
                .is_file()
                .then(|| blake3::hash(&std::fs::read(&path).unwrap()).to_hex().to_string());
            let mut xattrs: Vec<(String, Vec<u8>)> = if ft.is_symlink() {
                Vec::new()
            } else {
                xattr::list(&path)
                    .map(|names| {
                        names
                            .filter_map(|n| {
                                let n = n.to_string_lossy().into_owned();
                                n.starts_with("user.")
                                    .then(|| (n.clone(), xattr::get(&path, &n).ok().flatten().unwrap_or_default()))
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            };
            xattrs.sort();
            out.insert(
                rel,
                Seen {
                    kind,
                    mode: md.mode(),
                    uid: md.uid(),
                    gid: md.gid(),
                    size: if ft.is_dir() { 0 } else { md.size() },
                    nlink: if ft.is_dir() { 0 } else { md.nlink() },
                    mtime: (md.mtime(), md.mtime_nsec()),
                    target: ft.is_symlink().then(|| std::fs::read_link(&path).unwrap()),
                    content,
                    xattrs,
                },
            );
        }
    }
    out
}

/// cairn-init's host pid for a sandbox.
pub fn init_pid(home: &Home, id: &str) -> i32 {
    home.ps()
        .iter()
        .find(|s| s["id"] == id)
        .and_then(|s| s["pid"].as_i64())
        .expect("a running sandbox") as i32
}
