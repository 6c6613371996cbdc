//! How a native sandbox's layers reach overlayfs, chosen by what the
//! running kernel accepts, never by its version number.
//!
//! Three ways, best first ([`Mechanism`]): idmapped layers handed to
//! overlayfs as file descriptors (Linux 6.13); idmapped layer mounts
//! attached in init's private mount namespace and named by relative path
//! (overlayfs has taken idmapped lower layers since 5.19); and, where the
//! state directory's filesystem has no idmapped mounts or overlayfs takes
//! none, copies of the layers whose ids are shifted into the sandboxes'
//! range, made once per layer under `shifted/` and removed by `gc` with
//! their layer. Each keeps the same promises (docs/security.md).
//!
//! `cairn-init --probe-layers` tries each way on the state directory's
//! filesystem; the answer is kept in the state directory's
//! `layer-mount.json`, keyed by the kernel release, so a host probes once
//! per kernel. `CAIRN_LAYER_MOUNT=fd|path|shifted` asks for one way; a way
//! the kernel refused is refused with the probe's reason.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use cairn_protocol::LayerMount;
use serde::{Deserialize, Serialize};

use super::HOST_IDS;

/// The environment variable that asks for one way.
pub const OVERRIDE_VAR: &str = "CAIRN_LAYER_MOUNT";
/// The cache file in the state directory.
const CACHE: &str = "layer-mount.json";

/// A way to give layers to overlayfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mechanism {
    /// Idmapped layers as file descriptors (`lowerdir+`).
    Fd,
    /// Idmapped layer mounts named by relative path.
    Path,
    /// Copies of the layers with shifted ids.
    Shifted,
}

impl Mechanism {
    pub const ALL: [Mechanism; 3] = [Mechanism::Fd, Mechanism::Path, Mechanism::Shifted];

    pub fn name(&self) -> &'static str {
        match self {
            Mechanism::Fd => "fd",
            Mechanism::Path => "path",
            Mechanism::Shifted => "shifted",
        }
    }

    /// What the way is, in a few words.
    pub fn describe(&self) -> &'static str {
        match self {
            Mechanism::Fd => "idmapped layers given to overlayfs as file descriptors",
            Mechanism::Path => "idmapped layer mounts given to overlayfs by path",
            Mechanism::Shifted => "layers copied once with their ids shifted into the sandboxes' range",
        }
    }

    /// The probe's check that says whether this way works.
    fn check_name(&self) -> &'static str {
        match self {
            Mechanism::Fd => "overlay fd",
            Mechanism::Path => "overlay path",
            Mechanism::Shifted => "overlay shifted",
        }
    }

    pub fn layer_mount(&self) -> LayerMount {
        match self {
            Mechanism::Fd => LayerMount::Descriptors,
            Mechanism::Path => LayerMount::IdmappedPaths,
            Mechanism::Shifted => LayerMount::ShiftedPaths,
        }
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mechanism {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mechanism::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("{OVERRIDE_VAR}={s:?} names no layer mechanism; use fd, path or shifted"))
    }
}

/// One thing the probe checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeCheck {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// What the probe found on this kernel and state directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    /// The kernel release the probe ran on.
    pub kernel: String,
    /// The best way that worked; none when overlayfs took no way at all.
    pub mechanism: Option<Mechanism>,
    pub checks: Vec<ProbeCheck>,
}

impl Probe {
    /// Whether `way` worked in the probe.
    pub fn works(&self, way: Mechanism) -> bool {
        self.check(way.check_name()).is_some_and(|c| c.ok)
    }

    fn check(&self, name: &str) -> Option<&ProbeCheck> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// Why `way` did not work, as the probe said.
    fn why_not(&self, way: Mechanism) -> String {
        match self.check(way.check_name()) {
            Some(c) => c.detail.clone(),
            None => self
                .checks
                .iter()
                .find(|c| !c.ok)
                .map(|c| format!("{}: {}", c.name, c.detail))
                .unwrap_or_else(|| "the probe did not get that far".into()),
        }
    }

    /// The way to use: `wanted` when given (refused, with the probe's
    /// reason, if it did not work), else the best that worked.
    pub fn choose(&self, wanted: Option<Mechanism>) -> Result<Mechanism, String> {
        match (wanted, self.mechanism) {
            (Some(way), _) if self.works(way) => Ok(way),
            (Some(way), _) => Err(format!(
                "{OVERRIDE_VAR}={way} asks for {}, which this kernel (Linux {}) refused: {}; unset {OVERRIDE_VAR} to let Cairn choose",
                way.describe(),
                self.kernel,
                self.why_not(way)
            )),
            (None, Some(way)) => Ok(way),
            (None, None) => {
                let lacking: Vec<String> = self
                    .checks
                    .iter()
                    .filter(|c| !c.ok)
                    .map(|c| format!("{}: {}", c.name, c.detail))
                    .collect();
                Err(format!(
                    "native sandboxes cannot run on this kernel (Linux {}): overlayfs took the layers no way ({}); \
                     run `cairn doctor` for what the host lacks, or use --driver gvisor",
                    self.kernel,
                    lacking.join("; ")
                ))
            }
        }
    }
}

/// The way `CAIRN_LAYER_MOUNT` asks for, if it is set.
pub fn wanted() -> Result<Option<Mechanism>, String> {
    match std::env::var(OVERRIDE_VAR) {
        Ok(s) if !s.is_empty() => s.parse().map(Some),
        _ => Ok(None),
    }
}

/// The running kernel's release.
pub fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Runs `cairn-init --probe-layers` in a scratch directory of the state
/// directory `home` (on the filesystem the layers live on), whatever is
/// cached.
pub fn probe(home: &Path, init_binary: &Path) -> Result<Probe, String> {
    let writer = cairn_store::process::WriterId::current();
    // Starts in one process (a run's parallel branches) may probe at once.
    let scratch = home.join("tmp").join(format!("{writer}-layer-probe-{}", unique()));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch).map_err(|e| format!("create {}: {e}", scratch.display()))?;
    let mut cmd = Command::new(init_binary);
    cmd.arg("--probe-layers")
        .arg(&scratch)
        .arg(format!("{}:{}", HOST_IDS.base, HOST_IDS.count));
    // A just installed init may be busy for one spawn (ETXTBSY).
    let output = super::while_busy(|| cmd.output());
    let _ = fs::remove_dir_all(&scratch);
    let output = output.map_err(|e| format!("run {} --probe-layers: {e}", init_binary.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} --probe-layers failed ({}): {}",
            init_binary.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    parse(&String::from_utf8_lossy(&output.stdout))
}

/// A number no other call in this process gets.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Reads the probe's lines (`NAME\tok|no\tDETAIL`, then `mechanism\tWAY`).
fn parse(text: &str) -> Result<Probe, String> {
    let mut probe = Probe {
        kernel: kernel_release(),
        mechanism: None,
        checks: Vec::new(),
    };
    let mut ended = false;
    for line in text.lines() {
        let mut fields = line.splitn(3, '\t');
        match (fields.next(), fields.next(), fields.next()) {
            (Some("mechanism"), Some(way), None) => {
                probe.mechanism = if way == "none" { None } else { Some(way.parse()?) };
                ended = true;
            }
            (Some(name), Some(state @ ("ok" | "no")), Some(detail)) => {
                if name == "kernel" && state == "ok" {
                    probe.kernel = detail.to_string();
                }
                probe.checks.push(ProbeCheck {
                    name: name.to_string(),
                    ok: state == "ok",
                    detail: detail.to_string(),
                });
            }
            _ => return Err(format!("the layer probe printed an unexpected line {line:?}")),
        }
    }
    if !ended {
        return Err("the layer probe ended without naming a mechanism".into());
    }
    Ok(probe)
}

/// The probe's answer for this kernel: the state directory's cached one
/// when it was made on this kernel release, else a new probe (cached when
/// some way worked, so that a host fixed later is probed again). Failed
/// checks are logged when the probe runs, once per kernel.
pub fn cached_probe(home: &Path, init_binary: &Path) -> Result<Probe, String> {
    let cache = home.join(CACHE);
    let release = kernel_release();
    if let Some(probe) = fs::read(&cache)
        .ok()
        .and_then(|b| serde_json::from_slice::<Probe>(&b).ok())
        .filter(|p| p.kernel == release)
    {
        return Ok(probe);
    }
    let probe = probe(home, init_binary)?;
    for c in probe.checks.iter().filter(|c| !c.ok) {
        tracing::info!(check = %c.name, "layer probe: not available on Linux {release}: {}", c.detail);
    }
    if let Some(way) = probe.mechanism {
        tracing::info!("native sandboxes on Linux {release} use {}", way.describe());
        let tmp = home.join(format!(".{CACHE}.{}-{}", std::process::id(), unique()));
        let json = serde_json::to_vec_pretty(&probe).map_err(|e| e.to_string())?;
        // A cache that cannot be written costs a probe next time, no more.
        if fs::write(&tmp, json).and_then(|()| fs::rename(&tmp, &cache)).is_err() {
            let _ = fs::remove_file(&tmp);
        }
    }
    Ok(probe)
}

/// Where the shifted copy of the layer directory `layer` lives: under
/// `home/shifted/`, by the layer directory's name (layers are immutable
/// and named by their content).
pub fn shifted_path(home: &Path, layer: &Path) -> Result<PathBuf, String> {
    let name = layer
        .file_name()
        .filter(|n| !n.as_encoded_bytes().starts_with(b"."))
        .ok_or_else(|| format!("layer path {} has no name a shifted copy can take", layer.display()))?;
    Ok(shifted_dir(home).join(name))
}

/// The directory of shifted copies in the state directory `home`.
pub fn shifted_dir(home: &Path) -> PathBuf {
    home.join("shifted")
}

/// Shifted copies whose seal this process checked (or wrote).
static CHECKED: std::sync::Mutex<Option<std::collections::HashSet<PathBuf>>> = std::sync::Mutex::new(None);

fn checked(copy: &Path) -> bool {
    CHECKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|c| c.contains(copy))
}

fn mark_checked(copy: &Path) {
    CHECKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(Default::default)
        .insert(copy.to_path_buf());
}

/// The shifted copy of `layer`, made now if it does not exist. A copy is
/// sealed when made, like a layer (`shifted/.seal-<id>`, see
/// [`cairn_layers::seal`]), and its seal checked the first time a process
/// uses it: a copy changed behind Cairn's back is set aside as
/// `shifted/.changed-<id>-<time>/` (sandboxes already running on it keep
/// it) and made again from the layer. A copy from before seals is sealed
/// as it is.
pub fn ensure_shifted(home: &Path, layer: &Path) -> Result<PathBuf, String> {
    let dest = shifted_path(home, layer)?;
    if dest.is_dir() {
        if checked(&dest) {
            return Ok(dest);
        }
        let now = cairn_layers::seal::compute(&dest).map_err(|e| format!("seal {}: {e}", dest.display()))?;
        match cairn_layers::seal::recorded(&dest) {
            Some(recorded) if recorded != now => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let name = dest.file_name().unwrap_or_default().to_string_lossy().into_owned();
                let aside = shifted_dir(home).join(format!(".changed-{name}-{nanos}"));
                match fs::rename(&dest, &aside) {
                    Ok(()) => tracing::warn!(
                        layer = %layer.display(),
                        aside = %aside.display(),
                        "a shifted copy of a layer changed after Cairn made it; making it again"
                    ),
                    // Another start set it aside first.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(format!("set aside the changed shifted copy {}: {e}", dest.display())),
                }
                return make_shifted(layer, &dest);
            }
            Some(_) => {}
            None => {
                cairn_layers::seal::write(&dest).map_err(|e| format!("seal {}: {e}", dest.display()))?;
            }
        }
        mark_checked(&dest);
        return Ok(dest);
    }
    make_shifted(layer, &dest)
}

/// Makes the shifted copy of `layer` at `dest` and seals it.
fn make_shifted(layer: &Path, dest: &Path) -> Result<PathBuf, String> {
    let dest = dest.to_path_buf();
    let started = std::time::Instant::now();
    let copy = cairn_layers::archive::shifted_copy(layer, &dest, HOST_IDS).map_err(|e| e.to_string())?;
    // A copy another process placed first is sealed by it, or checked on
    // its next use.
    if !copy.existed {
        cairn_layers::seal::write(&dest).map_err(|e| format!("seal {}: {e}", dest.display()))?;
        mark_checked(&dest);
        tracing::info!(
            layer = %layer.display(),
            "made a shifted copy: {} entries, {} bytes ({} reflinked) in {:.0?}",
            copy.entries,
            copy.bytes,
            copy.reflinked,
            started.elapsed()
        );
    }
    Ok(dest)
}

/// Removes the shifted copies in `home` whose layer directory (by name,
/// under `layers`) is gone, and the temporaries of copies whose process
/// died. Returns how many went.
pub fn collect_shifted(home: &Path, layers: &Path) -> Result<u64, String> {
    let dir = shifted_dir(home);
    if !dir.is_dir() {
        return Ok(0);
    }
    let mut removed = cairn_layers::archive::remove_abandoned_materialisations(&dir).map_err(|e| e.to_string())?;
    for entry in fs::read_dir(&dir).map_err(|e| format!("list {}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| format!("list {}: {e}", dir.display()))?;
        let name = entry.file_name();
        // A seal goes with its copy.
        if let Some(sealed) = name.to_str().and_then(|n| n.strip_prefix(".seal-")) {
            // `.seal-<id>.tmp-<pid>` is one being written.
            if !sealed.contains('.') && !dir.join(sealed).exists() {
                let _ = fs::remove_file(entry.path());
            }
            continue;
        }
        if name.as_encoded_bytes().starts_with(b".") || layers.join(&name).exists() {
            continue;
        }
        match fs::remove_dir_all(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("remove {}: {e}", entry.path().display())),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_of(text: &str) -> Probe {
        parse(text).unwrap()
    }

    #[test]
    fn the_probe_s_lines_are_read_and_the_best_way_chosen() {
        let p = probe_of(
            "kernel\tok\t6.1.0-28-amd64\nuser namespace\tok\tids\nidmapped mounts\tok\text4\n\
             overlay fd\tno\tlowerdir+: Operation not supported\noverlay path\tok\tby path\n\
             overlay shifted\tok\tshifted\nmechanism\tpath\n",
        );
        assert_eq!(p.kernel, "6.1.0-28-amd64");
        assert_eq!(p.mechanism, Some(Mechanism::Path));
        assert!(!p.works(Mechanism::Fd) && p.works(Mechanism::Path) && p.works(Mechanism::Shifted));
        assert_eq!(p.choose(None), Ok(Mechanism::Path));
        assert_eq!(p.choose(Some(Mechanism::Shifted)), Ok(Mechanism::Shifted));
        let refused = p.choose(Some(Mechanism::Fd)).unwrap_err();
        assert!(
            refused.contains("Operation not supported") && refused.contains("CAIRN_LAYER_MOUNT"),
            "{refused}"
        );
    }

    #[test]
    fn no_way_at_all_is_refused_naming_what_failed() {
        let p = probe_of("kernel\tok\t5.4.0\nuser namespace\tno\tcreate a user namespace: EPERM\nmechanism\tnone\n");
        let e = p.choose(None).unwrap_err();
        assert!(
            e.contains("user namespace: create a user namespace: EPERM") && e.contains("cairn doctor"),
            "{e}"
        );
        let e = p.choose(Some(Mechanism::Shifted)).unwrap_err();
        assert!(e.contains("EPERM"), "{e}");
    }

    #[test]
    fn probes_at_once_in_one_process_each_get_an_answer() {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "the layer probe needs root"
            );
            eprintln!("SKIPPED: the layer probe needs root; run the tests as root");
            return;
        }
        let home = tempfile::tempdir_in("/tmp").unwrap();
        let init = crate::init_binary::install(&home.path().join("lib")).unwrap();
        let answers: Vec<Result<Probe, String>> = std::thread::scope(|s| {
            let probes: Vec<_> = (0..6).map(|_| s.spawn(|| cached_probe(home.path(), &init))).collect();
            probes.into_iter().map(|p| p.join().unwrap()).collect()
        });
        for answer in answers {
            let probe = answer.unwrap();
            assert!(probe.mechanism.is_some(), "{probe:?}");
        }
        let cached: Probe = serde_json::from_slice(&fs::read(home.path().join(CACHE)).unwrap()).unwrap();
        assert!(cached.mechanism.is_some());
        let left: Vec<_> = fs::read_dir(home.path().join("tmp")).unwrap().collect();
        assert!(left.is_empty(), "probes left {left:?}");
        let temporaries = fs::read_dir(home.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
            .count();
        assert_eq!(temporaries, 0, "a cache temporary was left");
    }

    #[test]
    fn odd_output_is_an_error_not_a_choice() {
        assert!(parse("kernel\tok\t6.1\n").is_err());
        assert!(parse("garbage\nmechanism\tfd\n").is_err());
        assert!(parse("mechanism\tsideways\n").is_err());
        assert!("sideways".parse::<Mechanism>().is_err());
    }
}
