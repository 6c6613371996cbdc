//! Address slots, host-wide: every Cairn home on a host shares the kernel's
//! interfaces and the `inet cairn` table, so the slots are recorded where
//! they all look, `/run/cairn/net/slots/N`, under one lock. A slot is a
//! `/30` of the range (`CAIRN_NET_RANGE`, default 10.213.0.0/16): the
//! host end takes the first address, the sandbox the second. A record names
//! the process that owns the slot (the starting command, then the
//! sandbox's init), the sandbox's directory and every set element added for
//! it, so whoever finds the owner dead (a later lease, `cairn gc`) removes
//! exactly those, and the interface, before the slot is used again.

use std::fs;
use std::io::Write;
use std::net::{Ipv4Addr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::nft::{self, Element};
use super::{hold, link, Allow, NetError, NetPlan, NetPolicy};
use crate::process_alive;

const DEFAULT_RANGE: &str = "10.213.0.0/16";

/// The host's sandbox networking: where slots are recorded, which range
/// they come from, where DNS goes.
#[derive(Debug, Clone)]
pub struct HostNet {
    dir: PathBuf,
    base: u32,
    prefix_len: u8,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SlotRecord {
    owner_pid: i32,
    owner_start: u64,
    sandbox_dir: PathBuf,
    elements: Vec<Element>,
    /// The process keeping the published ports bound (pid, start time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    holder: Option<(i32, u64)>,
}

/// A slot held for one sandbox.
#[derive(Debug)]
pub struct Lease {
    pub slot: u32,
    pub plan: NetPlan,
    /// Addresses each allowed name resolved to, for the record.
    pub resolved: Vec<(String, Vec<Ipv4Addr>)>,
    elements: Vec<Element>,
    /// The `nft` transaction adding the elements, until confirmed.
    pending: Option<nft::Pending>,
    /// The published ports, bound here until the holder takes them.
    reserved: Vec<std::os::fd::OwnedFd>,
}

impl HostNet {
    pub fn new() -> Result<HostNet, NetError> {
        let range = std::env::var("CAIRN_NET_RANGE").unwrap_or_else(|_| DEFAULT_RANGE.into());
        let bad = || {
            NetError::Invalid(format!(
                "CAIRN_NET_RANGE={range:?}: give a private IPv4 network from /8 to /24, as {DEFAULT_RANGE}"
            ))
        };
        let (addr, len) = range.split_once('/').ok_or_else(bad)?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        let prefix_len: u8 = len.parse().map_err(|_| bad())?;
        if !(8..=24).contains(&prefix_len) || !addr.is_private() {
            return Err(bad());
        }
        let base = u32::from(addr) & (u32::MAX << (32 - prefix_len));
        Ok(HostNet {
            dir: PathBuf::from("/run/cairn/net"),
            base,
            prefix_len,
        })
    }

    fn range(&self) -> String {
        format!("{}/{}", Ipv4Addr::from(self.base), self.prefix_len)
    }

    fn slots(&self) -> u32 {
        1 << (32 - u32::from(self.prefix_len) - 2)
    }

    fn slot_path(&self, slot: u32) -> PathBuf {
        self.dir.join("slots").join(slot.to_string())
    }

    fn lock(&self) -> Result<nix::fcntl::Flock<fs::File>, NetError> {
        fs::create_dir_all(self.dir.join("slots")).map_err(|e| NetError::host("create /run/cairn/net", e))?;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("lock"))
            .map_err(|e| NetError::host("open /run/cairn/net/lock", e))?;
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| NetError::host("lock /run/cairn/net", e))
    }

    /// Takes a free slot for the sandbox in `sandbox_dir`, owned by this
    /// process until [`HostNet::bind`] hands it to the sandbox's init;
    /// writes the sandbox's resolver files and adds its set elements.
    pub fn lease(&self, policy: &NetPolicy, sandbox_dir: &Path, hostname: &str) -> Result<Lease, NetError> {
        // Names first, outside the lock: a resolver can be slow.
        let resolved = resolve_allowed(&policy.allow)?;
        // Bound before their rules go in, and kept: a port in use is
        // refused, and no host program can take one while it is published.
        let reserved = hold::reserve(&policy.publish)?;
        let upstream = upstream_dns()?;
        let lock = self.lock()?;
        self.ensure_rules(upstream)?;
        let slot = self.free_slot()?;
        let first = self.base + slot * 4;
        let plan = NetPlan {
            ifname: format!("cn-{slot}"),
            gateway: Ipv4Addr::from(first + 1),
            address: Ipv4Addr::from(first + 2),
            prefix_len: 30,
            mac: random_mac(),
            resolv_conf: sandbox_dir.join("net").join("resolv.conf"),
            // Pinned for every sandbox with a route out, so that a name
            // allowed later ([`HostNet::update`]) resolves as one allowed
            // at the start does.
            hosts: Some(sandbox_dir.join("net").join("hosts")),
        };
        let elements = elements(&plan, policy, &resolved);
        let (pid, start) = me();
        let record = SlotRecord {
            owner_pid: pid,
            owner_start: start,
            sandbox_dir: sandbox_dir.to_path_buf(),
            elements: elements.clone(),
            holder: None,
        };
        self.write_record(slot, &record)?;
        drop(lock);
        let mut lease = Lease {
            slot,
            plan,
            resolved,
            elements,
            pending: None,
            reserved,
        };
        // The elements go in while the sandbox starts; nothing passes
        // before they are all in (forwarding needs the `sandboxes` one),
        // and [`HostNet::confirm`] waits for them before it is handed out.
        let started = write_resolver_files(&lease, hostname).and_then(|()| nft::add(&lease.elements));
        match started {
            Ok(pending) => lease.pending = Some(pending),
            Err(e) => {
                let _ = self.release(slot, sandbox_dir);
                return Err(e);
            }
        }
        Ok(lease)
    }

    /// Waits for the lease's set elements. A table removed behind Cairn's
    /// back (a flushed ruleset) is installed again and the elements retried.
    pub fn confirm(&self, lease: &mut Lease, publish: &[super::Publish]) -> Result<(), NetError> {
        let Some(pending) = lease.pending.take() else {
            return Ok(());
        };
        let taken = |e: NetError| match e {
            NetError::Host { detail, .. } if detail.contains("exists") && !publish.is_empty() => {
                NetError::Invalid(format!(
                    "a published host port is taken by another sandbox ({}); publish another",
                    publish.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
                ))
            }
            other => other,
        };
        match pending.wait() {
            Ok(()) => Ok(()),
            Err(e) if nft::table_exists()? => Err(taken(e)),
            Err(_) => {
                let upstream = upstream_dns()?;
                {
                    let _lock = self.lock()?;
                    let _ = fs::remove_file(self.dir.join("rules"));
                    self.ensure_rules(upstream)?;
                }
                nft::add(&lease.elements)?.wait().map_err(taken)
            }
        }
    }

    /// Hands the slot to the sandbox's init: it stays taken while that
    /// process lives; so do the published ports, held by a process of
    /// their own (`init` run with `--hold`) until init exits.
    pub fn bind(
        &self,
        lease: &mut Lease,
        sandbox_dir: &Path,
        init: &Path,
        pid: i32,
        start: u64,
    ) -> Result<(), NetError> {
        let holder = hold::keep_until_exit(init, std::mem::take(&mut lease.reserved), (pid, start))?;
        let _lock = self.lock()?;
        let stop_holder = || {
            if let Some((hpid, hstart)) = holder {
                kill_holder(hpid, hstart);
            }
        };
        let Some(mut record) = self.read_record(lease.slot) else {
            stop_holder();
            return Err(NetError::host("bind a network slot", "its record is gone"));
        };
        if record.sandbox_dir != sandbox_dir {
            stop_holder();
            return Err(NetError::host("bind a network slot", "it belongs to another sandbox"));
        }
        record.owner_pid = pid;
        record.owner_start = start;
        record.holder = holder;
        self.write_record(lease.slot, &record)
    }

    /// Replaces the allows and denies of the running sandbox in
    /// `sandbox_dir` that holds `slot` with `policy`'s (its published
    /// ports stay): one nftables transaction, so no packet sees half of
    /// either; names are resolved first and pinned in its `/etc/hosts`.
    /// Answers what each allowed name resolved to.
    pub fn update(
        &self,
        slot: u32,
        sandbox_dir: &Path,
        policy: &NetPolicy,
        hostname: &str,
        address: Ipv4Addr,
    ) -> Result<Vec<(String, Vec<Ipv4Addr>)>, NetError> {
        policy.check()?;
        let resolved = resolve_allowed(&policy.allow)?;
        let _lock = self.lock()?;
        let mut record = match self.read_record(slot) {
            Some(r) if r.sandbox_dir == sandbox_dir => r,
            _ => return Err(NetError::host("change a sandbox's network", "its slot record is gone")),
        };
        let ifname = format!("cn-{slot}");
        let kept = |e: &Element| matches!(e.set.as_str(), "sandboxes" | "publish" | "publish_at");
        let plan = NetPlan {
            ifname,
            gateway: Ipv4Addr::from(u32::from(address) - 1),
            address,
            prefix_len: 30,
            mac: [0; 6],
            resolv_conf: sandbox_dir.join("net").join("resolv.conf"),
            hosts: Some(sandbox_dir.join("net").join("hosts")),
        };
        let wanted: Vec<Element> = record
            .elements
            .iter()
            .filter(|e| kept(e))
            .cloned()
            .chain(
                elements(
                    &plan,
                    &NetPolicy {
                        publish: Vec::new(),
                        ..policy.clone()
                    },
                    &resolved,
                )
                .into_iter()
                .filter(|e| !kept(e)),
            )
            .collect();
        let gone: Vec<&Element> = record.elements.iter().filter(|e| !wanted.contains(e)).collect();
        let new: Vec<&Element> = wanted.iter().filter(|e| !record.elements.contains(e)).collect();
        // Names pinned before their addresses are let through; a failed
        // change leaves the pins of the wider set, which nothing uses.
        if sandbox_dir.join("net").join("hosts").exists() {
            write_hosts(&plan, hostname, &resolved)?;
        }
        let script: String = gone
            .iter()
            .map(|e| e.line("delete"))
            .chain(new.iter().map(|e| e.line("add")))
            .collect();
        if !script.is_empty() {
            // Recorded first as old and new together: a process killed
            // before the final record leaves none of either behind when
            // the slot is released (deleting a missing element is skipped).
            let mut both = record.elements.clone();
            both.extend(new.iter().map(|e| (*e).clone()));
            let old = std::mem::replace(&mut record.elements, both);
            self.write_record(slot, &record)?;
            if let Err(e) = nft::apply(&script) {
                record.elements = old;
                self.write_record(slot, &record)?;
                return Err(e);
            }
        }
        record.elements = wanted;
        self.write_record(slot, &record)?;
        Ok(resolved)
    }

    /// Frees the slot if it is this sandbox's: its elements, its
    /// interface, its record. Idempotent.
    pub fn release(&self, slot: u32, sandbox_dir: &Path) -> Result<(), NetError> {
        let _lock = self.lock()?;
        match self.read_record(slot) {
            Some(r) if r.sandbox_dir == sandbox_dir => self.clean(slot, &r),
            _ => Ok(()),
        }
    }

    /// Frees every slot whose owner is dead (`cairn gc`); returns the
    /// interfaces released.
    pub fn release_dead(&self) -> Result<Vec<String>, NetError> {
        if !self.dir.join("slots").exists() {
            return Ok(Vec::new());
        }
        let _lock = self.lock()?;
        let mut released = Vec::new();
        for slot in self.recorded_slots() {
            if let Some(r) = self.read_record(slot) {
                if !process_alive(r.owner_pid, r.owner_start) {
                    self.clean(slot, &r)?;
                    released.push(format!("cn-{slot}"));
                }
            }
        }
        Ok(released)
    }

    fn clean(&self, slot: u32, r: &SlotRecord) -> Result<(), NetError> {
        nft::delete(&r.elements)?;
        // The rules are gone: the ports can be given back.
        if let Some((pid, start)) = r.holder {
            kill_holder(pid, start);
        }
        link::delete(&format!("cn-{slot}"))?;
        match fs::remove_file(self.slot_path(slot)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(NetError::host("remove a slot record", e)),
            _ => Ok(()),
        }
    }

    fn recorded_slots(&self) -> Vec<u32> {
        fs::read_dir(self.dir.join("slots"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect()
    }

    fn read_record(&self, slot: u32) -> Option<SlotRecord> {
        serde_json::from_slice(&fs::read(self.slot_path(slot)).ok()?).ok()
    }

    fn write_record(&self, slot: u32, record: &SlotRecord) -> Result<(), NetError> {
        let path = self.slot_path(slot);
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_vec(record).expect("a slot record serialises");
        fs::write(&tmp, text)
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(|e| NetError::host(format!("record network slot {slot}"), e))
    }

    /// The lowest slot no live process holds; a dead owner's is cleaned.
    fn free_slot(&self) -> Result<u32, NetError> {
        let mut taken = std::collections::BTreeSet::new();
        for slot in self.recorded_slots() {
            match self.read_record(slot) {
                Some(r) if process_alive(r.owner_pid, r.owner_start) => {
                    taken.insert(slot);
                }
                Some(r) => self.clean(slot, &r)?,
                None => {
                    let _ = fs::remove_file(self.slot_path(slot));
                }
            }
        }
        let slot = (0..self.slots())
            .find(|s| !taken.contains(s))
            .ok_or_else(|| NetError::Exhausted { range: self.range() })?;
        // An interface of this name whose record was lost is not ours to keep.
        link::delete(&format!("cn-{slot}"))?;
        Ok(slot)
    }

    /// Installs the table unless the installed one is current. A table
    /// left from before `/run/cairn/net` was lost is replaced, since no
    /// record says what its elements were.
    fn ensure_rules(&self, upstream: Ipv4Addr) -> Result<(), NetError> {
        let marker = self.dir.join("rules");
        // The host's networks are taken as they are at install; links that
        // come and go later (a container bridge) do not replace the table.
        let want = format!("{} {upstream}", nft::RULES_VERSION);
        let have = fs::read_to_string(&marker).ok();
        // Recorded as current: taken as installed. Were the table gone, the
        // sandbox's elements would fail to go in, and [`HostNet::confirm`]
        // installs it again.
        if have.as_deref() == Some(want.as_str()) {
            return Ok(());
        }
        let live = self
            .recorded_slots()
            .into_iter()
            .filter_map(|s| self.read_record(s))
            .any(|r| process_alive(r.owner_pid, r.owner_start));
        let exists = nft::table_exists()?;
        if exists && (have.as_deref() == Some(want.as_str()) || live) {
            if have.as_deref() != Some(want.as_str()) {
                tracing::debug!("the sandbox network rules are from another configuration; they are replaced once no sandbox uses them");
            }
            return Ok(());
        }
        let mut script = String::new();
        if exists {
            script.push_str(&format!("delete table {}\n", nft::TABLE));
        }
        // The host's networks (and the range's overlap with them) are read
        // only here, when the table is made.
        script.push_str(&nft::ruleset(upstream, &self.host_networks()?));
        nft::apply(&script)?;
        link::sysctl("ipv4/ip_forward", "1")?;
        fs::write(&marker, want).map_err(|e| NetError::host("record the network rules", e))
    }

    /// The host's connected IPv4 networks (its LAN, its other links),
    /// refused to sandboxes; one that overlaps the range is an error.
    fn host_networks(&self) -> Result<Vec<String>, NetError> {
        let table = fs::read_to_string("/proc/net/route").map_err(|e| NetError::host("read /proc/net/route", e))?;
        let mask = u32::MAX << (32 - self.prefix_len);
        let mut nets = Vec::new();
        for line in table.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 || f[0].starts_with("cn-") {
                continue;
            }
            // Addresses in network byte order, printed as a host-order word.
            let hex = |s: &str| u32::from_str_radix(s, 16).map(|x| u32::from_be_bytes(x.to_le_bytes()));
            let (Ok(dest), Ok(gw), Ok(m)) = (hex(f[1]), hex(f[2]), hex(f[7])) else {
                continue;
            };
            if dest == 0 || gw != 0 {
                continue;
            }
            let len = m.count_ones();
            let overlap_mask = mask & m;
            if dest & overlap_mask == self.base & overlap_mask {
                return Err(NetError::Invalid(format!(
                    "the sandbox range {} overlaps {}/{len} on {}; set CAIRN_NET_RANGE to a private range this host does not use",
                    self.range(),
                    Ipv4Addr::from(dest),
                    f[0]
                )));
            }
            nets.push(format!("{}/{len}", Ipv4Addr::from(dest & m)));
        }
        nets.sort();
        nets.dedup();
        Ok(nets)
    }

    /// Interfaces, slots and elements left on the host for sandboxes whose
    /// owners are gone, as `cairn gc` would find them (for tests and `--json`).
    pub fn leftovers(&self) -> Vec<String> {
        self.recorded_slots()
            .into_iter()
            .filter(|s| {
                self.read_record(*s)
                    .is_none_or(|r| !process_alive(r.owner_pid, r.owner_start))
            })
            .map(|s| format!("cn-{s}"))
            .collect()
    }
}

/// Ends the process holding a sandbox's published ports, if it is still
/// that process.
fn kill_holder(pid: i32, start: u64) {
    if process_alive(pid, start) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
}

fn me() -> (i32, u64) {
    let pid = std::process::id() as i32;
    (pid, crate::pid_start_time(pid).unwrap_or(0))
}

fn random_mac() -> [u8; 6] {
    let mut mac = [0u8; 6];
    getrandom::getrandom(&mut mac).expect("the kernel RNG is available");
    // Locally administered, unicast.
    mac[0] = (mac[0] & 0xfc) | 0x02;
    mac
}

/// The host's resolver, where sandboxes' DNS is forwarded: `CAIRN_NET_DNS`
/// or the first IPv4 `nameserver` of /etc/resolv.conf.
fn upstream_dns() -> Result<Ipv4Addr, NetError> {
    if let Ok(v) = std::env::var("CAIRN_NET_DNS") {
        return v
            .parse()
            .map_err(|_| NetError::Invalid(format!("CAIRN_NET_DNS={v:?} is not an IPv4 address")));
    }
    let text = fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .ok_or_else(|| {
            NetError::Invalid(
                "no IPv4 nameserver in /etc/resolv.conf for sandboxes' DNS; set CAIRN_NET_DNS to a resolver's address"
                    .into(),
            )
        })
}

fn resolve_allowed(allow: &[Allow]) -> Result<Vec<(String, Vec<Ipv4Addr>)>, NetError> {
    let mut out = Vec::new();
    for a in allow {
        if let Allow::Host { host, .. } = a {
            if out.iter().any(|(h, _): &(String, _)| h == host) {
                continue;
            }
            let addrs: Vec<Ipv4Addr> = (host.as_str(), 0)
                .to_socket_addrs()
                .map_err(|e| NetError::Resolve {
                    name: host.clone(),
                    detail: e.to_string(),
                })?
                .filter_map(|s| match s.ip() {
                    std::net::IpAddr::V4(v4) => Some(v4),
                    std::net::IpAddr::V6(_) => None,
                })
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            if addrs.is_empty() {
                return Err(NetError::Resolve {
                    name: host.clone(),
                    detail: "no IPv4 address".into(),
                });
            }
            out.push((host.clone(), addrs));
        }
    }
    Ok(out)
}

fn elements(plan: &NetPlan, policy: &NetPolicy, resolved: &[(String, Vec<Ipv4Addr>)]) -> Vec<Element> {
    let name = format!("\"{}\"", plan.ifname);
    let mut out = vec![Element::new("sandboxes", name.clone())];
    if policy.restricted() {
        out.push(Element::new("restricted", name.clone()));
    }
    let mut allow = |net: String, port: Option<u16>| match port {
        None => out.push(Element::new("allow_net", format!("{name} . {net}"))),
        Some(p) => {
            for proto in ["tcp", "udp"] {
                out.push(Element::new("allow_port", format!("{name} . {net} . {proto} . {p}")));
            }
        }
    };
    for a in &policy.allow {
        match a {
            Allow::Net { addr, prefix_len, port } => allow(format!("{addr}/{prefix_len}"), *port),
            Allow::Host { host, port } => {
                for addr in resolved.iter().filter(|(h, _)| h == host).flat_map(|(_, a)| a) {
                    allow(format!("{addr}/32"), *port);
                }
            }
        }
    }
    for d in policy.deny.iter().filter(|d| !d.all()) {
        out.push(Element::new("deny_net", format!("{name} . {d}")));
    }
    for p in &policy.publish {
        out.push(match p.addr {
            None => Element::new("publish", format!("{} : {} . {}", p.host_port, plan.address, p.port)),
            Some(a) => Element::new(
                "publish_at",
                format!("{a} . {} : {} . {}", p.host_port, plan.address, p.port),
            ),
        });
    }
    out.dedup();
    out
}

/// `resolv.conf` names the host end (DNS there is forwarded to the host's
/// resolver; a restricted sandbox's is refused); a restricted sandbox's
/// `hosts` pins each allowed name to the addresses Cairn resolved.
fn write_resolver_files(lease: &Lease, hostname: &str) -> Result<(), NetError> {
    let dir = lease.plan.resolv_conf.parent().expect("under the sandbox directory");
    fs::create_dir_all(dir).map_err(|e| NetError::host(format!("create {}", dir.display()), e))?;
    write_file(
        &lease.plan.resolv_conf,
        format!("nameserver {}\noptions timeout:2 attempts:2\n", lease.plan.gateway),
    )?;
    write_hosts(&lease.plan, hostname, &lease.resolved)
}

/// The sandbox's `hosts`: itself, and each allowed name pinned to the
/// addresses Cairn resolved. Written in place (the sandbox's `/etc/hosts`
/// is bound to this file, so it sees the change).
fn write_hosts(plan: &NetPlan, hostname: &str, resolved: &[(String, Vec<Ipv4Addr>)]) -> Result<(), NetError> {
    let Some(hosts) = &plan.hosts else {
        return Ok(());
    };
    let mut text = format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{}\t{hostname}\n",
        plan.address
    );
    for (name, addrs) in resolved {
        for a in addrs {
            text.push_str(&format!("{a}\t{name}\n"));
        }
    }
    write_file(hosts, text)
}

/// Writes `text` over `path` in place (same inode), readable inside the
/// sandbox by its users whatever this umask.
fn write_file(path: &Path, text: String) -> Result<(), NetError> {
    use std::os::unix::fs::PermissionsExt;
    let mut f = fs::File::create(path).map_err(|e| NetError::host(format!("write {}", path.display()), e))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.set_permissions(fs::Permissions::from_mode(0o644)))
        .map_err(|e| NetError::host(format!("write {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_name_the_interface_and_each_allowed_port_twice() {
        let plan = NetPlan {
            ifname: "cn-3".into(),
            address: "10.213.0.14".parse().unwrap(),
            gateway: "10.213.0.13".parse().unwrap(),
            prefix_len: 30,
            mac: [2, 0, 0, 0, 0, 1],
            resolv_conf: "/x".into(),
            hosts: None,
        };
        let policy =
            NetPolicy::parse(None, &["pypi.org:443".into(), "10.0.0.0/8".into()], &["8080:80".into()]).unwrap();
        let resolved = vec![("pypi.org".to_string(), vec!["1.2.3.4".parse().unwrap()])];
        let e = elements(&plan, &policy, &resolved);
        let text: Vec<String> = e.iter().map(|e| format!("{} {}", e.set, e.value)).collect();
        assert_eq!(
            text,
            [
                "sandboxes \"cn-3\"",
                "restricted \"cn-3\"",
                "allow_port \"cn-3\" . 1.2.3.4/32 . tcp . 443",
                "allow_port \"cn-3\" . 1.2.3.4/32 . udp . 443",
                "allow_net \"cn-3\" . 10.0.0.0/8",
                "publish 8080 : 10.213.0.14 . 80",
            ]
        );
    }

    #[test]
    fn ranges_must_be_private_and_sized() {
        for (range, ok) in [
            ("10.213.0.0/16", true),
            ("8.8.0.0/16", false),
            ("10.0.0.0/30", false),
            ("x", false),
        ] {
            std::env::set_var("CAIRN_NET_RANGE", range);
            assert_eq!(HostNet::new().is_ok(), ok, "{range}");
        }
        std::env::remove_var("CAIRN_NET_RANGE");
        assert_eq!(HostNet::new().unwrap().slots(), 16384);
    }
}
