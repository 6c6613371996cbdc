//! A sandbox's veth pair, through iproute2's `ip` (one batch, one process):
//! the host end `cn-N` with the gateway address, the other end created
//! straight inside the sandbox's network namespace as `eth0` with the
//! sandbox's MAC. Killing the sandbox's last process destroys its namespace
//! and with it both ends; [`delete`] is for a dead owner's leftovers.

use std::path::Path;

use super::{mac_text, NetError, NetPlan};

fn ip(batch: &str) -> Result<(), NetError> {
    super::start_script(
        "ip",
        "iproute2",
        &["-batch", "-"],
        batch,
        "set up the sandbox's network link",
    )?
    .wait()
}

/// Creates the pair for the sandbox whose init is `pid` (in its namespace).
pub fn create(plan: &NetPlan, pid: i32) -> Result<(), NetError> {
    let name = &plan.ifname;
    // The host end takes no IPv6 address and drops packets whose source is
    // not the sandbox's own (strict reverse-path filtering); a published
    // port reached through the host's loopback needs `route_localnet`.
    // Nothing runs in the sandbox yet: init waits for our go-ahead.
    ip(&format!(
        "link add {name} type veth peer name eth0 address {mac} netns {pid}\n\
         addr add {gw}/{len} dev {name}\n\
         link set {name} up\n",
        mac = mac_text(&plan.mac),
        gw = plan.gateway,
        len = plan.prefix_len,
    ))?;
    for (key, value) in [
        ("ipv6/conf/{}/disable_ipv6", "1"),
        ("ipv4/conf/{}/rp_filter", "1"),
        ("ipv4/conf/{}/route_localnet", "1"),
    ] {
        sysctl(&key.replace("{}", name), value)?;
    }
    Ok(())
}

pub fn sysctl(key: &str, value: &str) -> Result<(), NetError> {
    let path = Path::new("/proc/sys/net").join(key);
    std::fs::write(&path, value).map_err(|e| NetError::host(format!("set {}", path.display()), e))
}

pub fn exists(ifname: &str) -> bool {
    Path::new("/sys/class/net").join(ifname).exists()
}

/// Deletes the interface if it is still there.
pub fn delete(ifname: &str) -> Result<(), NetError> {
    if !exists(ifname) {
        return Ok(());
    }
    match ip(&format!("link del {ifname}\n")) {
        Err(_) if !exists(ifname) => Ok(()),
        other => other,
    }
}

/// Host interfaces named like a sandbox's (`cn-N`).
pub fn sandbox_interfaces() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.strip_prefix("cn-").is_some_and(|s| s.parse::<u32>().is_ok()))
        .collect()
}
