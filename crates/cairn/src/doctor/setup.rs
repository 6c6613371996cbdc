//! What Cairn was installed and configured with: runsc for the gvisor
//! driver, nftables and route netlink for egress, the state directory, and
//! the state and chunk stores `--state` and `--store` name.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};

use cairn_engine::state::postgresql;
use cairn_engine::{Home, StateError, StateLocation};
use cairn_sandbox::gvisor::{GvisorError, Runsc, CHECKPOINT_FLAGS};
use cairn_sandbox::net::NetError;
use cairn_store::{S3Config, S3Prefix, S3Store};

use super::host::existing_ancestor;
use super::Line;

/// Below this much free space on the state directory's file system, a
/// warning: images, layers and snapshots soon fill it.
const LOW_DISK: u64 = 2 << 30;

pub fn lines(home: &Home) -> Vec<Line> {
    let mut lines = runsc(home);
    lines.push(nftables());
    lines.push(netlink());
    lines.push(state_dir(home.root()));
    lines.push(disk(home.root()));
    lines.push(state_store(home).configured());
    lines.push(chunk_store(home).configured());
    lines
}

const RUNSC_REMEDY: &str = "apt-get install runsc, or set CAIRN_RUNSC to its path (only --driver gvisor needs it)";

/// The global flags every runsc command Cairn runs carries.
const RUNSC_GLOBAL_FLAGS: [&str; 4] = ["platform", "network", "host-uds", "ignore-cgroups"];

/// Whether runsc's `flags` (or `--help`) text lists `-name`.
fn lists_flag(text: &str, name: &str) -> bool {
    text.lines().any(|l| {
        l.trim_start()
            .trim_start_matches('-')
            .strip_prefix(name)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '=', '\t']))
    })
}

/// What `binary ARGS` printed, stdout then stderr.
fn output_of(binary: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    Ok(String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned())
}

fn runsc(home: &Home) -> Vec<Line> {
    // The cache the gvisor driver keeps its answers about runsc in; a
    // directory not made yet is not made here (the answers are then asked
    // afresh and not kept).
    let runsc = match Runsc::find(&home.root().join("gvisor")) {
        Ok(r) => r,
        Err(GvisorError::RunscMissing) => {
            let detail = match std::env::var_os("CAIRN_RUNSC") {
                Some(p) => format!("CAIRN_RUNSC={} is not a file", Path::new(&p).display()),
                None => "not on PATH".to_string(),
            };
            return vec![Line::warn("runsc", detail, RUNSC_REMEDY)];
        }
        Err(e) => return vec![Line::warn("runsc", e.to_string(), RUNSC_REMEDY)],
    };
    let version = match output_of(&runsc.binary, &["--version"]) {
        Ok(v) => v.lines().next().unwrap_or("").trim().to_string(),
        Err(e) => return vec![Line::warn("runsc", e, RUNSC_REMEDY)],
    };
    let found = Line::ok(
        "runsc",
        format!("{version} at {}, platform {}", runsc.binary.display(), runsc.platform),
    );
    let flags = output_of(&runsc.binary, &["flags"]).unwrap_or_default();
    let missing: Vec<&str> = RUNSC_GLOBAL_FLAGS
        .into_iter()
        .filter(|f| !lists_flag(&flags, f))
        .collect();
    let checkpoint: Vec<&str> = CHECKPOINT_FLAGS
        .iter()
        .filter(|(_, flag)| runsc.checkpoint_flags.contains(flag))
        .map(|(_, flag)| *flag)
        .collect();
    let lacking: Vec<&str> = CHECKPOINT_FLAGS
        .iter()
        .filter(|(_, flag)| !runsc.checkpoint_flags.contains(flag))
        .map(|(name, _)| *name)
        .collect();
    let flags_line = if !missing.is_empty() {
        Line::warn(
            "runsc-flags",
            format!(
                "this runsc does not list --{} (from `runsc flags`)",
                missing.join(", --")
            ),
            "install a newer runsc (gVisor's release 2023 or later), or point CAIRN_RUNSC at one",
        )
    } else {
        let globals = RUNSC_GLOBAL_FLAGS.map(|f| format!("--{f}")).join(", ");
        let extra = if lacking.is_empty() {
            format!("; checkpoint with {}", checkpoint.join(" "))
        } else {
            format!(
                "; checkpoint without {} (older runsc: memory images are larger)",
                lacking.join(", ")
            )
        };
        Line::ok("runsc-flags", format!("{globals} known{extra}"))
    };
    let snapshots = if runsc.leave_running {
        Line::ok(
            "memory-snapshots",
            "fast: runsc checkpoints with --leave-running and writes raw pages, stored as they are written; \
             no restore after a snapshot; a paused E2B sandbox resumes into a sandbox created ahead (this runsc \
             restores into a created one)",
        )
    } else {
        Line::warn(
            "memory-snapshots",
            "slow: this runsc cannot checkpoint a sandbox and leave it running (it lacks --leave-running with \
             --compression, or its --leave-running is the old restore that hangs), so every memory snapshot \
             stops the sandbox and restores it, and the whole image is stored after runsc wrote it; a resume \
             creates its sandbox then (this runsc refuses to restore into a created one)",
            "install gVisor's release 2024 or later (Debian 13's runsc), or point CAIRN_RUNSC at one",
        )
    };
    vec![found, flags_line, snapshots]
}

const EGRESS_ONLY: &str = "only --network egress, --allow and --publish need it";

fn nftables() -> Line {
    match cairn_sandbox::net::nft::probe() {
        Ok(version) => Line::ok("nftables", version),
        Err(NetError::MissingTool { .. }) => Line::warn(
            "nftables",
            "nft is not installed",
            format!("apt-get install nftables; {EGRESS_ONLY}"),
        ),
        Err(e) => Line::warn(
            "nftables",
            e.to_string(),
            format!("load nf_tables (modprobe nf_tables) and run as root; {EGRESS_ONLY}"),
        ),
    }
}

fn netlink() -> Line {
    match cairn_sandbox::net::link::probe() {
        Ok(()) => Line::ok("netlink", "a route netlink socket opens"),
        Err(e) => Line::warn(
            "netlink",
            format!("cannot open a route netlink socket: {e}"),
            format!("allow AF_NETLINK sockets (a container's seccomp profile may refuse them); {EGRESS_ONLY}"),
        ),
    }
}

fn state_dir(dir: &Path) -> Line {
    let shown = dir.display();
    let choose = "or choose another state directory with --home or CAIRN_HOME";
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let above = existing_ancestor(dir);
            return match nix::unistd::access(&above, nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK) {
                Ok(()) => Line::ok(
                    "state-dir",
                    format!("{shown} does not exist yet; Cairn makes it (mode 0700) at first use"),
                ),
                Err(e) => Line::fail(
                    "state-dir",
                    format!("{shown} does not exist and {} is not writable ({e})", above.display()),
                    format!("mkdir -m 700 -p {shown}, {choose}"),
                ),
            };
        }
        Err(e) => {
            return Line::fail(
                "state-dir",
                format!("cannot read {shown}: {e}"),
                format!("make it readable by this user, {choose}"),
            )
        }
    };
    if !meta.is_dir() {
        return Line::fail(
            "state-dir",
            format!("{shown} is not a directory"),
            format!("move it away, {choose}"),
        );
    }
    let me = nix::unistd::geteuid().as_raw();
    let mode = meta.mode() & 0o7777;
    if meta.uid() != me {
        return Line::fail(
            "state-dir",
            format!("{shown} is owned by uid {}, not this user (uid {me})", meta.uid()),
            format!("chown {me} {shown}, {choose}"),
        );
    }
    if mode != 0o700 {
        return Line::fail(
            "state-dir",
            format!("{shown} has mode {mode:04o}: other users can reach sandboxes' files and sockets"),
            format!("chmod 700 {shown}"),
        );
    }
    Line::ok("state-dir", format!("{shown}, owned by uid {me}, mode 0700"))
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn disk(dir: &Path) -> Line {
    let at = existing_ancestor(dir);
    match nix::sys::statvfs::statvfs(&at) {
        Ok(s) => {
            let free = s.blocks_available() * s.fragment_size();
            let size = s.blocks() * s.fragment_size();
            let detail = format!("{} free of {} at {}", gib(free), gib(size), at.display());
            if free < LOW_DISK {
                Line::warn(
                    "disk",
                    detail,
                    format!(
                        "free space there (cairn gc releases unused layers and chunks) or move the state \
                         directory to a larger file system; below {} images and snapshots soon fail",
                        gib(LOW_DISK)
                    ),
                )
            } else {
                Line::ok("disk", detail)
            }
        }
        Err(e) => Line::warn(
            "disk",
            format!("cannot read free space at {}: {e}", at.display()),
            "check that the state directory's file system is mounted and readable",
        ),
    }
}

fn state_store(home: &Home) -> Line {
    let unset = "or unset --state/CAIRN_STATE to use the embedded SQLite store";
    match StateLocation::parse(home.state_url(), home) {
        Err(e) => Line::fail(
            "state-store",
            e.to_string(),
            format!("correct --state/CAIRN_STATE, {unset}"),
        ),
        Ok(StateLocation::Sqlite(path)) => {
            let made = if path.exists() { "" } else { " (made at first use)" };
            Line::ok("state-store", format!("SQLite at {}{made}", path.display()))
        }
        Ok(StateLocation::Postgres(target)) => match postgresql::server_version(&target) {
            Ok(version) => Line::ok("state-store", format!("PostgreSQL {version} at {}", target.shown())),
            Err(StateError::Connect { target, reason }) => Line::fail(
                "state-store",
                format!("cannot connect to PostgreSQL at {target}: {reason}"),
                format!("start PostgreSQL there or correct --state/CAIRN_STATE, {unset}"),
            ),
            Err(e) => Line::fail(
                "state-store",
                e.to_string(),
                format!("correct --state/CAIRN_STATE, {unset}"),
            ),
        },
    }
}

fn chunk_store(home: &Home) -> Line {
    let Some(url) = home.store_url() else {
        return Line::ok("chunk-store", format!("local, in {}", home.store().display()));
    };
    let unset = "or unset --store/CAIRN_STORE to keep chunks in the state directory";
    let config = match S3Config::from_url(url) {
        Ok(c) => c,
        Err(e) => {
            return Line::fail(
                "chunk-store",
                e.to_string(),
                format!(
                    "give --store/CAIRN_STORE as s3://BUCKET/PREFIX?endpoint=URL&region=REGION with \
                     AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set, {unset}"
                ),
            )
        }
    };
    let (shown, endpoint) = (config.to_string(), config.endpoint_name());
    match S3Store::inspect(config) {
        Ok(S3Prefix::Store) => Line::ok(
            "chunk-store",
            format!("{shown}: {endpoint} answered; a Cairn chunk store"),
        ),
        Ok(S3Prefix::Empty) => Line::ok(
            "chunk-store",
            format!("{shown}: {endpoint} answered; empty, made a Cairn chunk store at first use"),
        ),
        Err(e) => Line::fail(
            "chunk-store",
            e.to_string(),
            format!("fix what the message names, {unset}"),
        ),
    }
}
