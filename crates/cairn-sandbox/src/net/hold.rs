//! Published host ports held by Cairn for as long as they are published.
//!
//! A publish is a DNAT rule: without more, a host program could still bind
//! the same port (its clients would then reach the sandbox instead of it),
//! and a port another program holds would be published over. So each
//! published port is bound by Cairn before its rule goes in (a port in use,
//! on either family, is refused), and the sockets are then kept, bound and
//! never listening, by a small process of their own that exits when the
//! sandbox's init does. A later host bind of the port fails with
//! EADDRINUSE; connections are rewritten before they could reach the
//! sockets, and nothing is ever accepted on them.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::sys::socket::{bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn, SockaddrIn6};

use super::{NetError, Publish};

/// Binds every published port: `ADDR:PORT` where the publish names an
/// address, else `0.0.0.0:PORT` and `[::]:PORT` (IPv6 only), so that a
/// port in use on either family is refused. Not listening, and with
/// neither `SO_REUSEADDR` nor `SO_REUSEPORT`, so no later bind can share
/// them.
pub fn reserve(publish: &[Publish]) -> Result<Vec<OwnedFd>, NetError> {
    let mut held = Vec::new();
    for p in publish {
        let (addrs, shown): (Vec<SocketAddr>, String) = match p.addr {
            Some(a) => (vec![SocketAddr::from((a, p.host_port))], format!("{a}:{}", p.host_port)),
            None => (
                vec![
                    SocketAddr::from((Ipv4Addr::UNSPECIFIED, p.host_port)),
                    SocketAddr::from((Ipv6Addr::UNSPECIFIED, p.host_port)),
                ],
                format!("port {}", p.host_port),
            ),
        };
        for addr in addrs {
            match bind_tcp(addr) {
                Ok(fd) => held.push(fd),
                Err(nix::errno::Errno::EAFNOSUPPORT) if addr.is_ipv6() => {}
                Err(nix::errno::Errno::EADDRINUSE) => {
                    let family = if addr.is_ipv6() { "IPv6" } else { "IPv4" };
                    return Err(NetError::Invalid(format!(
                        "host {shown} is in use on this host ({family}); publish another (--publish OTHER:{})",
                        p.port
                    )));
                }
                Err(nix::errno::Errno::EADDRNOTAVAIL) => {
                    return Err(NetError::Invalid(format!(
                        "--publish {p}: {} is not an address of this host; give one of its addresses, \
                         or HOSTPORT:PORT for all of them",
                        addr.ip()
                    )));
                }
                Err(e) => return Err(NetError::host(format!("reserve host {shown}"), e)),
            }
        }
    }
    Ok(held)
}

fn bind_tcp(addr: SocketAddr) -> nix::Result<OwnedFd> {
    let family = if addr.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    match addr {
        SocketAddr::V4(a) => bind(fd.as_raw_fd(), &SockaddrIn::from(a))?,
        SocketAddr::V6(a) => {
            setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
            bind(fd.as_raw_fd(), &SockaddrIn6::from(a))?
        }
    }
    Ok(fd)
}

/// Hands `held` to a process of their own (`cairn-init --hold`, the
/// static init run on the host: nothing of this process's memory is kept)
/// that keeps them until the process `owner` (pid, start time) exits;
/// returns its pid and start time. Nothing to hold starts nothing.
pub fn keep_until_exit(init: &Path, held: Vec<OwnedFd>, owner: (i32, u64)) -> Result<Option<(i32, u64)>, NetError> {
    if held.is_empty() {
        return Ok(None);
    }
    let what = "keep the published ports";
    let pidfd = pidfd_open(owner.0).map_err(|e| NetError::host(what, e))?;
    // Opened, then checked: a pid reused before the open is caught here,
    // and the descriptor names this process from now on.
    if !crate::process_alive(owner.0, owner.1) {
        return Err(NetError::host(what, "the sandbox's init is gone"));
    }
    let mut pass: Vec<RawFd> = vec![pidfd.as_raw_fd()];
    pass.extend(held.iter().map(|f| f.as_raw_fd()));
    let mut cmd = Command::new(init);
    cmd.arg("--hold")
        .arg(held.len().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: between fork and exec only fcntl and dup2, which are
    // async-signal-safe, on descriptors this process owns.
    unsafe {
        cmd.pre_exec(move || {
            // Out of the way first (a source may sit on a target number),
            // then to 3, 4, ... without close-on-exec.
            for (i, fd) in pass.iter().enumerate() {
                let moved = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 1024 + i as libc::c_int);
                if moved < 0 || libc::dup2(moved, 3 + i as libc::c_int) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let out = cmd.output().map_err(|e| NetError::host(what, e))?;
    let pid: Option<i32> = String::from_utf8_lossy(&out.stdout).trim().parse().ok();
    let (Some(pid), true) = (pid, out.status.success()) else {
        return Err(NetError::host(
            what,
            format!("cairn-init --hold failed ({})", out.status),
        ));
    };
    let start = crate::pid_start_time(pid).ok_or_else(|| NetError::host(what, "the holder exited at once"))?;
    drop(held);
    Ok(Some((pid, start)))
}

fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new
    // descriptor, owned here.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as RawFd) })
}
