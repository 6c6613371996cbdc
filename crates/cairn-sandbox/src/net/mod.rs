//! Sandbox networking (`--network egress`): a veth pair per sandbox, an
//! address from a private range, NAT to the host's default route, DNS
//! forwarded to the host's resolver, and a fence made of nftables rules.
//!
//! - [`policy`]: what a user asks for (`--allow`, `--publish`), checked.
//! - [`lease`]: host-wide address slots (`/run/cairn/net/slots/N`), each
//!   owned by a live process; a dead owner's slot is cleaned and reused.
//! - [`nft`]: the `inet cairn` table (installed once per boot) and each
//!   sandbox's elements in its sets, through Debian's `nft`.
//! - [`link`]: the veth pair, over rtnetlink.
//!
//! Everything host-wide lives under `/run/cairn/net`, so it is gone after a
//! reboot together with the interfaces and rules it describes.

pub mod hold;
pub mod lease;
pub mod link;
pub mod nft;
pub mod policy;

use std::net::Ipv4Addr;

pub use lease::{HostNet, Lease};
pub use policy::{Allow, Deny, NetPolicy, Publish};

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{0}")]
    Invalid(String),
    #[error("sandbox networking needs `{tool}` ({package} package): apt-get install {package}")]
    MissingTool { tool: &'static str, package: &'static str },
    #[error("{what}: {detail}")]
    Host { what: String, detail: String },
    #[error("every address of {range} is in use by a running sandbox; remove some, or set CAIRN_NET_RANGE to a larger private range")]
    Exhausted { range: String },
    #[error("cannot resolve allowed host {name}: {detail}; check the name, or allow its address instead")]
    Resolve { name: String, detail: String },
}

impl NetError {
    pub(crate) fn host(what: impl Into<String>, detail: impl std::fmt::Display) -> NetError {
        NetError::Host {
            what: what.into(),
            detail: detail.to_string(),
        }
    }
}

/// What a driver needs to give a sandbox its network, decided by a
/// [`Lease`]: the host side is `ifname` at `gateway`, the sandbox's `eth0`
/// is `address` with `mac`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetPlan {
    pub ifname: String,
    pub address: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub prefix_len: u8,
    pub mac: [u8; 6],
    /// Host files for the sandbox's `/etc/resolv.conf` and `/etc/hosts`.
    pub resolv_conf: std::path::PathBuf,
    pub hosts: Option<std::path::PathBuf>,
}

/// A helper process (`nft`) that dies with the thread that started
/// it: a command killed mid-start leaves no `nft` to commit elements after
/// whoever frees its slot has deleted them.
pub(crate) fn helper(program: &str) -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(program);
    // SAFETY: prctl is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// A helper given a script on stdin (`nft -f -`), under way: one process
/// and one kernel transaction.
#[derive(Debug)]
pub struct Script {
    child: std::process::Child,
    /// What a non-zero exit means, for the error.
    failed: &'static str,
}

pub(crate) fn spawn_error(tool: &'static str, package: &'static str, e: std::io::Error) -> NetError {
    match e.kind() {
        std::io::ErrorKind::NotFound => NetError::MissingTool { tool, package },
        _ => NetError::host(format!("start {tool}"), e),
    }
}

/// Starts `tool ARGS` with `script` on its stdin; [`Script::wait`] ends it.
pub(crate) fn start_script(
    tool: &'static str,
    package: &'static str,
    args: &[&str],
    script: &str,
    failed: &'static str,
) -> Result<Script, NetError> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = helper(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| spawn_error(tool, package, e))?;
    // A script is far below a pipe's buffer: the write does not block.
    if let Err(e) = child.stdin.take().expect("piped").write_all(script.as_bytes()) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(NetError::host(format!("write to {tool}"), e));
    }
    Ok(Script { child, failed })
}

impl Script {
    pub fn wait(self) -> Result<(), NetError> {
        let out = self
            .child
            .wait_with_output()
            .map_err(|e| NetError::host("wait for a network helper", e))?;
        if !out.status.success() {
            return Err(NetError::host(self.failed, String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(())
    }
}

pub fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}
