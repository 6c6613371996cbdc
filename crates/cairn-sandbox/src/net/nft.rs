//! The `inet cairn` nftables table, through Debian's `nft` (a batch on
//! stdin: one process, one kernel transaction).
//!
//! The rules are the same for every sandbox and name them by interface
//! (`cn-*`); what differs lives in sets, keyed by the host-side interface:
//! `sandboxes` (forwarding needs membership, so a sandbox whose element
//! could not be added has no route out: fail closed), `restricted` and its
//! allows, `deny_net` (refused unless allowed), `publish` (host port to sandbox address and port) and
//! `publish_at` (host address and port to the same). From a
//! sandbox: established traffic, then its allows, then its denies, then
//! (restricted) refuse,
//! then DNS (DNAT to the host's resolver), then refuse link-local, private,
//! loopback and the host's own networks, then accept. To the host itself,
//! only replies and DNS.

use std::net::Ipv4Addr;
use std::process::Stdio;

use super::NetError;

pub const TABLE: &str = "inet cairn";
/// Bumped whenever the rules below change: the table is replaced (with no
/// sandbox running) when its recorded version differs.
pub const RULES_VERSION: u32 = 3;

/// Ranges no sandbox reaches unless allowed explicitly.
const REFUSED: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/3",
];

/// The table's text: `upstream` is where sandboxes' DNS goes, `host_nets`
/// the host's own addresses and connected networks.
pub fn ruleset(upstream: Ipv4Addr, host_nets: &[String]) -> String {
    let mut refused: Vec<String> = REFUSED.iter().map(|s| s.to_string()).collect();
    refused.extend(host_nets.iter().cloned());
    format!(
        r#"table {TABLE} {{
	set sandboxes {{ type ifname; }}
	set restricted {{ type ifname; }}
	set allow_net {{ type ifname . ipv4_addr; flags interval; }}
	set allow_port {{ type ifname . ipv4_addr . inet_proto . inet_service; flags interval; }}
	set deny_net {{ type ifname . ipv4_addr; flags interval; }}
	set refused {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {refused} }} }}
	map publish {{ type inet_service : ipv4_addr . inet_service; }}
	map publish_at {{ type ipv4_addr . inet_service : ipv4_addr . inet_service; }}
	chain forward {{
		type filter hook forward priority filter; policy accept;
		iifname "cn-*" jump from_sandbox
		oifname "cn-*" ct state established,related accept
		oifname "cn-*" ct status dnat accept
		oifname "cn-*" reject with icmpx admin-prohibited
	}}
	chain from_sandbox {{
		iifname != @sandboxes drop
		ct state established,related accept
		meta nfproto ipv6 reject with icmpx admin-prohibited
		iifname . ip daddr @allow_net accept
		iifname . ip daddr . meta l4proto . th dport @allow_port accept
		iifname . ip daddr @deny_net reject with icmpx admin-prohibited
		iifname @restricted reject with icmpx admin-prohibited
		ct status dnat accept
		ip daddr @refused reject with icmpx admin-prohibited
		accept
	}}
	chain input {{
		type filter hook input priority filter; policy accept;
		iifname "cn-*" ct state established,related accept
		iifname "cn-*" iifname @sandboxes iifname != @restricted ct status dnat accept
		iifname "cn-*" reject with icmpx admin-prohibited
	}}
	chain prerouting {{
		type nat hook prerouting priority dstnat; policy accept;
		iifname "cn-*" iifname != @restricted fib daddr type local meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {upstream}
		fib daddr type local dnat ip to ip daddr . tcp dport map @publish_at
		fib daddr type local dnat ip to tcp dport map @publish
	}}
	chain output {{
		type nat hook output priority -100; policy accept;
		fib daddr type local dnat ip to ip daddr . tcp dport map @publish_at
		fib daddr type local dnat ip to tcp dport map @publish
	}}
	chain postrouting {{
		type nat hook postrouting priority srcnat; policy accept;
		iifname "cn-*" oifname != "cn-*" masquerade
		oifname "cn-*" ip saddr 127.0.0.0/8 masquerade
	}}
}}
"#,
        refused = refused.join(", ")
    )
}

/// Runs `script` as one `nft -f -` transaction.
pub fn apply(script: &str) -> Result<(), NetError> {
    start(script)?.wait()
}

/// An `nft` transaction under way.
pub type Pending = super::Script;

/// Starts `script` as one `nft -f -` transaction; [`Pending::wait`] ends it.
pub fn start(script: &str) -> Result<Pending, NetError> {
    super::start_script(
        "nft",
        "nftables",
        &["-f", "-"],
        script,
        "nftables refused the sandbox's rules",
    )
}

/// `nft`'s version, once it has shown it can talk to the kernel's
/// nftables (one `nft list tables`, which changes nothing): what `cairn
/// doctor` reports for `--network egress`.
pub fn probe() -> Result<String, NetError> {
    let version = super::helper("nft")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| super::spawn_error("nft", "nftables", e))?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    let listed = super::helper("nft")
        .args(["list", "tables"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .map_err(|e| super::spawn_error("nft", "nftables", e))?;
    if !listed.status.success() {
        return Err(NetError::host(
            "nft list tables",
            String::from_utf8_lossy(&listed.stderr).trim(),
        ));
    }
    Ok(version)
}

/// Whether the table exists (one `nft list`).
pub fn table_exists() -> Result<bool, NetError> {
    let out = super::helper("nft")
        .args(["list", "table", "inet", "cairn"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| super::spawn_error("nft", "nftables", e))?;
    Ok(out.success())
}

/// One element of one set, as `nft` writes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Element {
    pub set: String,
    pub value: String,
}

impl Element {
    pub fn new(set: &str, value: String) -> Element {
        Element {
            set: set.to_string(),
            value,
        }
    }

    pub(crate) fn line(&self, verb: &str) -> String {
        // The key of a map element is all `delete` takes.
        let value = match (verb, self.value.split_once(" : ")) {
            ("delete", Some((key, _))) => key,
            _ => &self.value,
        };
        format!("{verb} element {TABLE} {} {{ {value} }}\n", self.set)
    }
}

pub fn add(elements: &[Element]) -> Result<Pending, NetError> {
    start(&elements.iter().map(|e| e.line("add")).collect::<String>())
}

/// Deletes `elements`, one transaction; if that fails (one is already
/// gone), each on its own, ignoring the missing.
pub fn delete(elements: &[Element]) -> Result<(), NetError> {
    if elements.is_empty() || apply(&elements.iter().map(|e| e.line("delete")).collect::<String>()).is_ok() {
        return Ok(());
    }
    if !table_exists()? {
        return Ok(());
    }
    for e in elements {
        let _ = apply(&e.line("delete"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_elements_are_deleted_by_key() {
        let e = Element::new("publish", "8080 : 10.213.0.2 . 8000".into());
        assert_eq!(
            e.line("add"),
            "add element inet cairn publish { 8080 : 10.213.0.2 . 8000 }\n"
        );
        assert_eq!(e.line("delete"), "delete element inet cairn publish { 8080 }\n");
    }

    #[test]
    fn the_ruleset_refuses_the_hosts_networks() {
        let r = ruleset("10.255.255.53".parse().unwrap(), &["192.0.2.0/24".into()]);
        assert!(r.contains("169.254.0.0/16"));
        assert!(r.contains("192.0.2.0/24 }"));
        assert!(r.contains("dnat ip to 10.255.255.53"));
    }
}
