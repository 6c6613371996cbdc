//! A sandbox's veth pair, made over rtnetlink from this process: the host
//! end `cn-N` with the gateway address, the other end created straight
//! inside the sandbox's network namespace as `eth0` with the sandbox's MAC.
//! (Starting iproute2's `ip` for this took more of an egress sandbox's
//! start than the kernel's work, and the start waits for it.) Killing the
//! sandbox's last process destroys its namespace and with it both ends;
//! [`delete`] is for a dead owner's leftovers.

use std::io;
use std::net::IpAddr;
use std::path::Path;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::{NetError, NetPlan};

/// Whether a route netlink socket opens and binds here (what `cairn
/// doctor` checks for `--network egress`); nothing is sent.
pub fn probe() -> io::Result<()> {
    Rtnl::open().map(drop)
}

/// A route netlink socket for a few requests, each acknowledged.
struct Rtnl {
    socket: Socket,
    seq: u32,
    /// Answers are read here. An error echoes the request (a few hundred
    /// bytes at most here).
    rx: Vec<u8>,
}

impl Rtnl {
    fn open() -> io::Result<Rtnl> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Rtnl {
            socket,
            seq: 0,
            rx: vec![0u8; 16 << 10],
        })
    }

    /// Sends `msg` and waits for the kernel's answer to it: `Ok` for an
    /// acknowledgement, its errno otherwise.
    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        packet.finalize();
        let mut buf = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let rx = &mut self.rx;
        loop {
            let n = self.socket.recv(&mut &mut rx[..], 0)?;
            let mut at = 0;
            while at < n {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rx[at..n])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink answer: {e}")))?;
                let len = reply.header.length as usize;
                if reply.header.sequence_number == self.seq {
                    if let NetlinkPayload::Error(e) = reply.payload {
                        return match e.code {
                            None => Ok(()),
                            Some(_) => Err(e.to_io()),
                        };
                    }
                }
                if len == 0 {
                    break;
                }
                at += (len + 3) & !3;
            }
        }
    }
}

fn link_error(e: io::Error) -> NetError {
    NetError::host("set up the sandbox's network link", e)
}

/// Creates the pair for the sandbox whose init is `pid` (in its namespace).
pub fn create(plan: &NetPlan, pid: i32) -> Result<(), NetError> {
    let name = &plan.ifname;
    let mut rtnl = Rtnl::open().map_err(link_error)?;
    // Nothing runs in the sandbox yet: init waits for our go-ahead.
    let mut peer = LinkMessage::default();
    peer.attributes = vec![
        LinkAttribute::IfName("eth0".into()),
        LinkAttribute::Address(plan.mac.to_vec()),
        LinkAttribute::NetNsPid(pid as u32),
    ];
    let mut link = LinkMessage::default();
    link.attributes = vec![
        LinkAttribute::IfName(name.clone()),
        LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
        ]),
    ];
    rtnl.request(RouteNetlinkMessage::NewLink(link), NLM_F_CREATE | NLM_F_EXCL)
        .map_err(link_error)?;
    let index = nix::net::if_::if_nametoindex(name.as_str()).map_err(|e| link_error(e.into()))?;
    let mut addr = AddressMessage::default();
    addr.header.family = AddressFamily::Inet;
    addr.header.prefix_len = plan.prefix_len;
    addr.header.index = index;
    addr.attributes = vec![
        AddressAttribute::Local(IpAddr::V4(plan.gateway)),
        AddressAttribute::Address(IpAddr::V4(plan.gateway)),
    ];
    rtnl.request(RouteNetlinkMessage::NewAddress(addr), NLM_F_CREATE | NLM_F_EXCL)
        .map_err(link_error)?;
    let mut up = LinkMessage::default();
    up.header.index = index;
    up.header.flags = LinkFlags::Up;
    up.header.change_mask = LinkFlags::Up;
    rtnl.request(RouteNetlinkMessage::SetLink(up), 0).map_err(link_error)?;
    // The host end takes no IPv6 address and drops packets whose source is
    // not the sandbox's own (strict reverse-path filtering); a published
    // port reached through the host's loopback needs `route_localnet`.
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
    let mut link = LinkMessage::default();
    link.attributes = vec![LinkAttribute::IfName(ifname.to_string())];
    let deleted = Rtnl::open().and_then(|mut rtnl| rtnl.request(RouteNetlinkMessage::DelLink(link), 0));
    match deleted {
        Err(_) if !exists(ifname) => Ok(()),
        other => other.map_err(|e| NetError::host(format!("delete the network link {ifname}"), e)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// `ip -o link show eth0` in the network namespace of `pid` (asked
    /// over netlink: the host's /sys shows the host's namespace).
    fn eth0_in(pid: u32) -> String {
        let out = Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-n", "ip", "-o", "link", "show", "eth0"])
            .output()
            .expect("run nsenter (util-linux) and ip (iproute2)");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[test]
    fn a_pair_is_made_into_the_sandboxs_namespace_up_and_addressed_then_deleted_by_name() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var_os("CI").is_none(), "CI runs the tests as root");
            eprintln!("SKIPPED: making a veth pair needs root; run the tests as root");
            return;
        }
        // A process in a network namespace of its own stands for init.
        let mut init = Command::new("unshare").args(["-n", "sleep", "60"]).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        // Not `cn-N`: gc running elsewhere must not take it for a sandbox's.
        let name = format!("cn-t{}", std::process::id() % 100_000);
        let plan = NetPlan {
            ifname: name.clone(),
            address: "10.254.3.2".parse().unwrap(),
            gateway: "10.254.3.1".parse().unwrap(),
            prefix_len: 30,
            mac: [0x02, 0xca, 0x1e, 0x00, 0x00, 0x07],
            resolv_conf: "/dev/null".into(),
            hosts: None,
        };
        let made = create(&plan, init.id() as i32);
        let seen = (
            exists(&name),
            std::fs::read_to_string(format!("/sys/class/net/{name}/flags")).unwrap_or_default(),
            Command::new("ip")
                .args(["-4", "-o", "addr", "show", "dev", &name])
                .output(),
            eth0_in(init.id()),
            std::fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6")).unwrap_or_default(),
        );
        // A second pair of the same name is refused, saying what failed.
        let again = create(&plan, init.id() as i32).unwrap_err().to_string();
        let deleted = delete(&name);
        let _ = init.kill();
        let _ = init.wait();
        made.unwrap();
        let (present, flags, addrs, eth0, no_ipv6) = seen;
        assert!(present);
        let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).unwrap();
        assert_eq!(flags & libc::IFF_UP as u32, libc::IFF_UP as u32, "{name} is not up");
        let addrs = String::from_utf8_lossy(&addrs.expect("run ip (iproute2)").stdout).to_string();
        assert!(addrs.contains("inet 10.254.3.1/30"), "{addrs}");
        assert!(eth0.contains("link/ether 02:ca:1e:00:00:07"), "{eth0}");
        assert_eq!(no_ipv6.trim(), "1");
        assert!(
            again.contains("set up the sandbox's network link") && again.contains("exists"),
            "{again}"
        );
        deleted.unwrap();
        assert!(!exists(&name));
        // Deleting what is gone is not an error.
        delete(&name).unwrap();
    }
}
