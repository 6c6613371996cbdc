//! What a sandbox's network may reach and what it publishes, as users
//! write it: `--allow HOST[:PORT]`, `--allow ADDR[/LEN][:PORT]`,
//! `--publish [ADDR:]HOSTPORT:PORT`. Parsed strictly; stored as written.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::NetError;

/// A sandbox's network: `none` (loopback only) or `egress`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetPolicy {
    /// `egress`: its own namespace with a route out; `none`: loopback only.
    pub egress: bool,
    /// With any entry, everything else is refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<Allow>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub publish: Vec<Publish>,
    /// Networks refused (E2B's `deny_out`), the allows excepted: with any
    /// entry, the allows are exceptions to it rather than the only ways
    /// out, and `0.0.0.0/0` among them refuses all but the allows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<Deny>,
}

/// A network a sandbox may not reach unless an allow says otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deny {
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

impl Deny {
    /// `ADDRESS` or `ADDRESS/LEN` (IPv4); `0.0.0.0/0` is all traffic.
    pub fn parse(text: &str) -> Result<Deny, NetError> {
        let bad = || NetError::Invalid(format!("deny {text:?}: give ADDRESS or ADDRESS/LEN (IPv4)"));
        let (addr, prefix_len) = match text.split_once('/') {
            Some((a, l)) => (a.parse().map_err(|_| bad())?, l.parse().map_err(|_| bad())?),
            None => (text.parse().map_err(|_| bad())?, 32),
        };
        let deny = Deny { addr, prefix_len };
        deny.check()?;
        Ok(deny)
    }

    fn check(&self) -> Result<(), NetError> {
        Allow::Net {
            addr: self.addr,
            prefix_len: self.prefix_len,
            port: None,
        }
        .check()
    }

    /// Whether this is all traffic (`0.0.0.0/0`).
    pub fn all(&self) -> bool {
        self.prefix_len == 0
    }
}

impl std::fmt::Display for Deny {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// One destination a restricted sandbox may reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Allow {
    /// An address or network, any port or one port (TCP and UDP).
    Net {
        addr: Ipv4Addr,
        prefix_len: u8,
        port: Option<u16>,
    },
    /// A name, resolved by Cairn when the sandbox starts: reachable only at
    /// the addresses it resolved to, which the sandbox's `/etc/hosts` pins.
    Host { host: String, port: Option<u16> },
}

/// A sandbox TCP port reachable at a host port: on one host address, or
/// on all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publish {
    /// The host address it is published on; `None`: every address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<Ipv4Addr>,
    pub host_port: u16,
    pub port: u16,
}

impl NetPolicy {
    pub const NONE: &'static str = "none";
    pub const EGRESS: &'static str = "egress";

    /// `--network MODE --allow … --publish …`: allows and publishes imply
    /// `egress`; `none` with either is refused.
    pub fn parse(mode: Option<&str>, allow: &[String], publish: &[String]) -> Result<NetPolicy, NetError> {
        let egress = match mode {
            None => !allow.is_empty() || !publish.is_empty(),
            Some(Self::EGRESS) => true,
            Some(Self::NONE) if allow.is_empty() && publish.is_empty() => false,
            Some(Self::NONE) => {
                return Err(NetError::Invalid(
                    "--allow and --publish need a network: drop --network none, or give --network egress".into(),
                ))
            }
            Some(other) => {
                return Err(NetError::Invalid(format!(
                    "unknown network {other:?}: give `none` (loopback only) or `egress`"
                )))
            }
        };
        let policy = NetPolicy {
            egress,
            allow: allow.iter().map(|a| Allow::parse(a)).collect::<Result<_, _>>()?,
            publish: publish.iter().map(|p| Publish::parse(p)).collect::<Result<_, _>>()?,
            deny: Vec::new(),
        };
        policy.check()?;
        Ok(policy)
    }

    /// Bounds that hold however the policy arrived (CLI, API, pipeline
    /// file, a stored row).
    pub fn check(&self) -> Result<(), NetError> {
        if !self.egress && (!self.allow.is_empty() || !self.publish.is_empty() || !self.deny.is_empty()) {
            return Err(NetError::Invalid(
                "allows, denies and published ports need `egress`".into(),
            ));
        }
        if self.deny.len() > 64 {
            return Err(NetError::Invalid(format!(
                "{} denied networks; at most 64 (deny a wider network instead)",
                self.deny.len()
            )));
        }
        for d in &self.deny {
            d.check()?;
        }
        if self.allow.len() > 64 {
            return Err(NetError::Invalid(format!(
                "{} --allow entries; at most 64 (allow a network instead of its addresses)",
                self.allow.len()
            )));
        }
        if self.publish.len() > 16 {
            return Err(NetError::Invalid(format!(
                "{} published ports; at most 16",
                self.publish.len()
            )));
        }
        for a in &self.allow {
            a.check()?;
        }
        for (i, p) in self.publish.iter().enumerate() {
            p.check()?;
            // The same port on two addresses is two publishes; on one
            // address, or on every address and one, it is one twice.
            let overlaps =
                |q: &Publish| q.host_port == p.host_port && (q.addr.is_none() || p.addr.is_none() || q.addr == p.addr);
            if self.publish[..i].iter().any(overlaps) {
                return Err(NetError::Invalid(format!(
                    "host port {} is published twice",
                    p.host_port
                )));
            }
        }
        Ok(())
    }

    pub fn mode(&self) -> &'static str {
        if self.egress {
            Self::EGRESS
        } else {
            Self::NONE
        }
    }

    /// Whether everything but the allows is refused: any allow, unless
    /// denies are given, when only a denial of all traffic does.
    pub fn restricted(&self) -> bool {
        if self.deny.is_empty() {
            !self.allow.is_empty()
        } else {
            self.deny.iter().any(Deny::all)
        }
    }
}

fn port(text: &str, what: &str) -> Result<u16, NetError> {
    match text.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(NetError::Invalid(format!("{what}: {text:?} is not a port (1-65535)"))),
    }
}

impl Allow {
    pub fn parse(text: &str) -> Result<Allow, NetError> {
        let bad = || {
            NetError::Invalid(format!(
                "--allow {text:?}: give HOST[:PORT], ADDRESS[:PORT] or ADDRESS/LEN[:PORT] (IPv4)"
            ))
        };
        let (target, port) = match text.rsplit_once(':') {
            Some((t, p)) => (t, Some(port(p, &format!("--allow {text:?}"))?)),
            None => (text, None),
        };
        if target.is_empty() {
            return Err(bad());
        }
        let allow = if let Some((addr, len)) = target.split_once('/') {
            let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
            let prefix_len: u8 = len.parse().map_err(|_| bad())?;
            Allow::Net { addr, prefix_len, port }
        } else if let Ok(addr) = target.parse::<Ipv4Addr>() {
            Allow::Net {
                addr,
                prefix_len: 32,
                port,
            }
        } else if target.bytes().all(|b| b.is_ascii_digit() || b == b'.') || target.contains(':') {
            return Err(bad());
        } else {
            Allow::Host {
                host: target.to_ascii_lowercase(),
                port,
            }
        };
        allow.check()?;
        Ok(allow)
    }

    fn check(&self) -> Result<(), NetError> {
        match self {
            Allow::Net { addr, prefix_len, .. } => {
                if *prefix_len > 32 {
                    return Err(NetError::Invalid(format!("{addr}/{prefix_len}: a prefix is 0-32")));
                }
                let mask = if *prefix_len == 0 {
                    0
                } else {
                    u32::MAX << (32 - prefix_len)
                };
                if u32::from(*addr) & !mask != 0 {
                    return Err(NetError::Invalid(format!(
                        "{addr}/{prefix_len} has host bits set; write {}/{prefix_len}",
                        Ipv4Addr::from(u32::from(*addr) & mask)
                    )));
                }
            }
            Allow::Host { host, .. } => {
                let label_ok = |l: &str| {
                    !l.is_empty()
                        && l.len() <= 63
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                        && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                };
                if host.len() > 253 || !host.split('.').all(label_ok) {
                    return Err(NetError::Invalid(format!("--allow {host:?} is not a host name")));
                }
            }
        }
        Ok(())
    }

    pub fn port(&self) -> Option<u16> {
        match self {
            Allow::Net { port, .. } | Allow::Host { port, .. } => *port,
        }
    }
}

impl std::fmt::Display for Allow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Allow::Net { addr, prefix_len, .. } if *prefix_len == 32 => write!(f, "{addr}")?,
            Allow::Net { addr, prefix_len, .. } => write!(f, "{addr}/{prefix_len}")?,
            Allow::Host { host, .. } => f.write_str(host)?,
        }
        match self.port() {
            Some(p) => write!(f, ":{p}"),
            None => Ok(()),
        }
    }
}

impl Publish {
    pub fn parse(text: &str) -> Result<Publish, NetError> {
        let what = format!("--publish {text:?} ([ADDR:]HOSTPORT:PORT)");
        if text.contains('[') || text.matches(':').count() > 2 {
            return Err(NetError::Invalid(format!(
                "{what}: sandboxes are published on IPv4 only; give an IPv4 address, or none for every address"
            )));
        }
        let (addr, h, p) = match text.splitn(3, ':').collect::<Vec<_>>()[..] {
            [h, p] => (None, h, p),
            [a, h, p] => {
                let addr: Ipv4Addr = a
                    .parse()
                    .map_err(|_| NetError::Invalid(format!("{what}: {a:?} is not an IPv4 address")))?;
                (Some(addr), h, p)
            }
            _ => {
                return Err(NetError::Invalid(format!(
                    "{what}: give the host port and the sandbox's, as 8080:8000 or 127.0.0.1:8080:8000"
                )))
            }
        };
        let publish = Publish {
            addr,
            host_port: port(h, &what)?,
            port: port(p, &what)?,
        };
        publish.check()?;
        Ok(publish)
    }

    fn check(&self) -> Result<(), NetError> {
        if self.host_port == 0 || self.port == 0 {
            return Err(NetError::Invalid("a published port is 1-65535".into()));
        }
        if let Some(a) = self.addr {
            if a.is_unspecified() || a.is_multicast() || a.is_broadcast() {
                return Err(NetError::Invalid(format!(
                    "--publish on {a}: give an address of this host, or no address to publish on every one"
                )));
            }
        }
        if self.host_port == 53 {
            return Err(NetError::Invalid(
                "host port 53 carries the sandboxes' DNS; publish another".into(),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for Publish {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(a) = self.addr {
            write!(f, "{a}:")?;
        }
        write!(f, "{}:{}", self.host_port, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_parse_as_hosts_addresses_and_networks() {
        assert_eq!(
            Allow::parse("PyPI.org:443").unwrap(),
            Allow::Host {
                host: "pypi.org".into(),
                port: Some(443)
            }
        );
        assert_eq!(
            Allow::parse("10.1.0.0/16").unwrap(),
            Allow::Net {
                addr: "10.1.0.0".parse().unwrap(),
                prefix_len: 16,
                port: None
            }
        );
        assert_eq!(Allow::parse("1.2.3.4:53").unwrap().to_string(), "1.2.3.4:53");
        for bad in [
            "",
            ":80",
            "a..b",
            "1.2.3.4/33",
            "10.1.0.1/16",
            "host:0",
            "host:99999",
            "1.2.3",
            "-x.org",
            "::1",
        ] {
            assert!(Allow::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn denies_make_allows_exceptions_and_all_traffic_restricts() {
        let deny = |d: &[&str]| d.iter().map(|t| Deny::parse(t).unwrap()).collect::<Vec<_>>();
        let mut p = NetPolicy {
            egress: true,
            allow: vec![Allow::parse("8.8.8.8").unwrap()],
            deny: deny(&["8.8.0.0/16"]),
            ..NetPolicy::default()
        };
        p.check().unwrap();
        assert!(!p.restricted(), "an allow beside a deny is an exception to it");
        p.deny = deny(&["0.0.0.0/0"]);
        assert!(p.restricted());
        p.allow.clear();
        assert!(p.restricted(), "all traffic denied and nothing allowed");
        assert_eq!(Deny::parse("1.2.3.4").unwrap().to_string(), "1.2.3.4/32");
        for bad in ["", "pypi.org", "1.2.3.4/33", "10.1.0.1/16", "1.2.3.4:80"] {
            assert!(Deny::parse(bad).is_err(), "{bad} accepted");
        }
        p.egress = false;
        assert!(p.check().is_err());
    }

    #[test]
    fn policies_imply_egress_and_refuse_contradictions() {
        let p = NetPolicy::parse(None, &["pypi.org".into()], &[]).unwrap();
        assert!(p.egress && p.restricted());
        assert!(!NetPolicy::parse(None, &[], &[]).unwrap().egress);
        assert!(NetPolicy::parse(Some("none"), &[], &["8080:80".into()]).is_err());
        assert!(NetPolicy::parse(Some("bridge"), &[], &[]).is_err());
        assert!(NetPolicy::parse(Some("egress"), &[], &["8080:80".into(), "8080:81".into()]).is_err());
        assert!(Publish::parse("8080").is_err());
        assert!(Publish::parse("53:53").is_err());
        let many: Vec<String> = (0..65).map(|i| format!("10.0.0.{i}")).collect();
        assert!(NetPolicy::parse(None, &many, &[]).is_err());
    }
}
