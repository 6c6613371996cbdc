//! `cairn doctor`: what Cairn needs on this host, one line per check, each
//! problem with the remedy that fixes it.
//!
//! Every check is a probe that changes nothing lasting: a user namespace is
//! made by a child that exits, an idmapped mount is a detached copy that
//! vanishes with its descriptor, the state and chunk stores are read, never
//! written. A probe that fails oddly (EPERM from a host's own seccomp
//! filter, EINVAL) is reported with its error, never a panic.
//!
//! The rule for the exit status: 1 when any line is `fail`, else 0. A line
//! fails when the native driver cannot run here (the host lines) or when
//! Cairn cannot run as configured (a `--state` or `--store` it cannot
//! reach). What only an optional feature needs (runsc for `--driver
//! gvisor`, nftables and route netlink for `--network egress`, room on
//! disk) is a warning and leaves the status 0.

mod host;
mod setup;

use anyhow::Result;
use cairn_engine::Home;
use serde::Serialize;

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Something optional is missing or degraded; Cairn runs without it.
    Warn,
    /// Cairn cannot run here as configured until the remedy is applied.
    Fail,
}

impl Status {
    fn mark(self) -> &'static str {
        match self {
            Status::Ok => "✓",
            Status::Warn => "!",
            Status::Fail => "✗",
        }
    }
}

/// What the native driver needs, as against what Cairn was configured to
/// use (a remote state or chunk store): the last line tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Host,
    Configured,
}

/// One check: its name, how it came out, what was found and, unless it is
/// ok, what to do.
#[derive(Debug, Serialize)]
pub struct Line {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
    /// What fixes it; None for an ok line.
    pub remedy: Option<String>,
    #[serde(skip)]
    scope: Scope,
}

impl Line {
    pub fn ok(name: &'static str, detail: impl Into<String>) -> Line {
        Line {
            name,
            status: Status::Ok,
            detail: detail.into(),
            remedy: None,
            scope: Scope::Host,
        }
    }

    pub fn warn(name: &'static str, detail: impl Into<String>, remedy: impl Into<String>) -> Line {
        Line {
            status: Status::Warn,
            remedy: Some(remedy.into()),
            ..Line::ok(name, detail)
        }
    }

    pub fn fail(name: &'static str, detail: impl Into<String>, remedy: impl Into<String>) -> Line {
        Line {
            status: Status::Fail,
            remedy: Some(remedy.into()),
            ..Line::ok(name, detail)
        }
    }

    /// This line is about what Cairn was configured to use, not the host.
    fn configured(self) -> Line {
        Line {
            scope: Scope::Configured,
            ..self
        }
    }
}

/// Everything `cairn doctor --json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    /// No check failed: the native driver runs here, as configured.
    pub ok: bool,
    pub checks: Vec<Line>,
}

impl Report {
    /// Runs every check for the state directory and stores `home` names.
    pub fn of(home: &Home) -> Report {
        let mut checks = host::lines(home);
        checks.extend(layer_lines(home));
        checks.extend(setup::lines(home));
        Report {
            ok: checks.iter().all(|l| l.status != Status::Fail),
            checks,
        }
    }

    /// One line per check, then the verdict.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for line in &self.checks {
            out.push_str(&format!("{} {}: {}", line.status.mark(), line.name, line.detail));
            if let Some(remedy) = &line.remedy {
                out.push_str(&format!(" — {remedy}"));
            }
            out.push('\n');
        }
        let failed = |scope| self.checks.iter().any(|l| l.status == Status::Fail && l.scope == scope);
        let warned = self.checks.iter().filter(|l| l.status == Status::Warn).count();
        let verdict = if failed(Scope::Host) {
            "The native driver cannot run here: fix the ✗ lines above.".to_string()
        } else if failed(Scope::Configured) {
            "The native driver can run here, but Cairn cannot as configured: fix the ✗ lines above.".to_string()
        } else if warned > 0 {
            format!("The native driver can run here; the ! lines name what only optional features need ({warned}).")
        } else {
            "The native driver can run here.".to_string()
        };
        out.push_str(&verdict);
        out.push('\n');
        out
    }
}

/// Which mechanism the native driver gives image layers to overlayfs with
/// (idmapped layer descriptors, idmapped layer mounts by path, or layers
/// copied with shifted ids), and the kernel features that decided it.
fn layer_lines(home: &Home) -> Vec<Line> {
    use cairn_sandbox::native::layers;
    let remedy = "native sandboxes need overlayfs and user namespaces: check the lines above, or use --driver gvisor";
    // The probe runs where the state directory's layers live: in a scratch
    // directory beside it (nothing of it is left), with this build's init.
    let dir = host::existing_ancestor(home.root());
    let probed = tempfile::Builder::new()
        .prefix(".cairn-doctor-")
        .tempdir_in(&dir)
        .map_err(|e| format!("make a scratch directory in {}: {e}", dir.display()))
        .and_then(|scratch| {
            let init = cairn_sandbox::init_binary::install(&scratch.path().join("lib"))
                .map_err(|e| format!("install cairn-init in {}: {e}", scratch.path().display()))?;
            layers::probe(scratch.path(), &init)
        });
    let probe = match probed {
        Ok(p) => p,
        Err(e) => {
            return vec![Line::fail(
                "layers",
                format!("the layer probe did not run: {e}"),
                remedy,
            )]
        }
    };
    let mut lines = Vec::new();
    for way in layers::Mechanism::ALL {
        let name = match way {
            layers::Mechanism::Fd => "layers-fd",
            layers::Mechanism::Path => "layers-path",
            layers::Mechanism::Shifted => "layers-shifted",
        };
        let check = probe.checks.iter().find(|c| c.name == format!("overlay {way}"));
        lines.push(match check {
            Some(c) if c.ok => Line::ok(name, way.describe()),
            Some(c) => Line::warn(
                name,
                format!("{}: not available: {}", way.describe(), c.detail),
                "none needed while another way works",
            ),
            None => Line::warn(name, format!("{}: not tried", way.describe()), "see the layers line"),
        });
    }
    let wanted = layers::wanted();
    lines.push(match wanted.clone().and_then(|w| probe.choose(w)) {
        Ok(way) => {
            let asked = if matches!(wanted, Ok(Some(_))) {
                ", as CAIRN_LAYER_MOUNT asks"
            } else {
                ""
            };
            Line::ok(
                "layers",
                format!("native sandboxes use {way} ({}){asked}", way.describe()),
            )
        }
        Err(e) => Line::fail("layers", e, remedy),
    });
    lines
}

/// `cairn doctor`: prints the report; 1 when a check failed, else 0.
pub fn doctor(home: &Home, json: bool) -> Result<i32> {
    let report = Report::of(home);
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(if report.ok { 0 } else { 1 })
}
