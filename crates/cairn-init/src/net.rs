//! A native sandbox's `eth0` (`--network egress`).
//!
//! Before the pivot, the resolver files the host wrote are cloned as
//! detached read-only mounts (their host paths are reachable only then).
//! After it (the host's `G` came before: the veth end is in this
//! namespace), PID 1 gives `eth0` its address and the default route with the
//! classic ioctls, and binds the files over `/etc/resolv.conf` and
//! `/etc/hosts`, found without leaving the sandbox's root. The namespace is
//! owned by the host's user namespace: the sandbox's root, holding no
//! capability there, cannot change any of it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use cairn_protocol::NetSetup;

use crate::mount_api;

type Step<T> = Result<T, String>;

/// The resolver files, as detached mounts waiting for their targets.
pub struct Files {
    resolv_conf: OwnedFd,
    hosts: Option<OwnedFd>,
}

/// Clones the host's resolver files; runs before the pivot.
pub fn clone_files(net: &NetSetup) -> Step<Files> {
    let ro = |path: &str| {
        mount_api::readonly_clone(Path::new(path)).map_err(|e| format!("bind the resolver file {path}: {e}"))
    };
    Ok(Files {
        resolv_conf: ro(&net.resolv_conf)?,
        hosts: net.hosts.as_deref().map(ro).transpose()?,
    })
}

/// Configures the host's veth (in the namespace once the host said go) and
/// binds the resolver files; runs in PID 1 after the pivot, with every
/// capability still held.
pub fn configure(net: &NetSetup, files: Files, host_id_base: u32) -> Step<()> {
    let sock = Socket::new()?;
    sock.set_addr(libc::SIOCSIFADDR, net.address, "address")?;
    sock.set_addr(libc::SIOCSIFNETMASK, netmask(net.prefix_len), "netmask")?;
    sock.up()?;
    sock.default_route(net.gateway)?;
    bind_over("resolv.conf", &files.resolv_conf, host_id_base)?;
    if let Some(hosts) = &files.hosts {
        bind_over("hosts", hosts, host_id_base)?;
    }
    Ok(())
}

fn netmask(prefix_len: u8) -> [u8; 4] {
    let bits = if prefix_len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix_len.min(32)))
    };
    bits.to_be_bytes()
}

fn sockaddr(addr: [u8; 4]) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; this is the
    // cast the ioctl interface is defined by.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// `struct rtentry` from `<linux/route.h>`.
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

const RTF_UP: libc::c_ushort = 0x1;
const RTF_GATEWAY: libc::c_ushort = 0x2;

struct Socket(OwnedFd);

impl Socket {
    fn new() -> Step<Socket> {
        // SAFETY: a plain socket call; the descriptor is owned from here.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(format!("configure eth0: socket: {}", io::Error::last_os_error()));
        }
        // SAFETY: just returned to us alone.
        Ok(Socket(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn request() -> libc::ifreq {
        // SAFETY: ifreq is plain data; all zeroes is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (i, b) in b"eth0\0".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        req
    }

    fn ioctl<T>(&self, op: libc::c_ulong, arg: &mut T, what: &str) -> Step<()> {
        // SAFETY: `arg` is the structure this request is defined on, alive
        // and correctly sized for the call.
        if unsafe { libc::ioctl(self.0.as_raw_fd(), op as _, arg as *mut T) } != 0 {
            return Err(format!("configure eth0: {what}: {}", io::Error::last_os_error()));
        }
        Ok(())
    }

    fn set_addr(&self, op: libc::c_ulong, addr: [u8; 4], what: &str) -> Step<()> {
        let mut req = Self::request();
        req.ifr_ifru.ifru_addr = sockaddr(addr);
        self.ioctl(op, &mut req, what)
    }

    fn up(&self) -> Step<()> {
        let mut req = Self::request();
        self.ioctl(libc::SIOCGIFFLAGS, &mut req, "read flags")?;
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        self.ioctl(libc::SIOCSIFFLAGS, &mut req, "bring it up")
    }

    fn default_route(&self, gateway: [u8; 4]) -> Step<()> {
        let mut route = RtEntry {
            rt_pad1: 0,
            rt_dst: sockaddr([0; 4]),
            rt_gateway: sockaddr(gateway),
            rt_genmask: sockaddr([0; 4]),
            rt_flags: RTF_UP | RTF_GATEWAY,
            rt_pad2: 0,
            rt_pad3: 0,
            rt_pad4: std::ptr::null_mut(),
            rt_metric: 0,
            rt_dev: std::ptr::null_mut(),
            rt_mtu: 0,
            rt_window: 0,
            rt_irtt: 0,
        };
        self.ioctl(libc::SIOCADDRT, &mut route, "add the default route")
    }
}

/// Binds `file` over `/etc/NAME`. The target is resolved inside the
/// sandbox's root without crossing a mount (an image's symlink cannot point
/// it at /proc or /sys) and must be a regular file; a missing one is made,
/// owned by the sandbox's root. An image without /etc gets no file.
fn bind_over(name: &str, file: &OwnedFd, host_id_base: u32) -> Step<()> {
    let etc = match open_in_root("/etc", libc::O_PATH | libc::O_DIRECTORY) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(format!("find /etc for {name}: {e}")),
    };
    let path = format!("/etc/{name}");
    let target = match open_in_root(&path, libc::O_PATH) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            create_empty(&etc, name, host_id_base).map_err(|e| format!("create {path}: {e}"))?;
            open_in_root(&path, libc::O_PATH).map_err(|e| format!("open {path}: {e}"))?
        }
        Err(e) => return Err(format!("open {path}: {e}")),
    };
    let st = nix::sys::stat::fstat(target.as_raw_fd()).map_err(|e| format!("stat {path}: {e}"))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(format!(
            "the image's {path} is not a regular file; a sandbox with a network binds its own there"
        ));
    }
    mount_api::attach_to_fd(file, &target).map_err(|e| format!("bind {path}: {e}"))
}

/// `struct open_how` from `<linux/openat2.h>`.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

const RESOLVE_NO_XDEV: u64 = 0x01;
const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_IN_ROOT: u64 = 0x10;

fn open_in_root(path: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let root = CString::new("/").expect("no NUL");
    let p = CString::new(path.trim_start_matches('/')).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: NUL-terminated paths; the root fd is closed below.
    let dir = unsafe { libc::open(root.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if dir < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned to us alone.
    let dir = unsafe { OwnedFd::from_raw_fd(dir) };
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: RESOLVE_IN_ROOT | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: `how` is a `struct open_how` alive for the call, its size
    // passed with it; the path is NUL-terminated.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            p.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn create_empty(etc: &OwnedFd, name: &str, host_id_base: u32) -> io::Result<()> {
    let n = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a NUL-terminated name under a directory fd we own.
    let fd = unsafe {
        libc::openat(
            etc.as_raw_fd(),
            n.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o644,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned to us alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    nix::unistd::fchown(fd.as_raw_fd(), Some(host_id_base.into()), Some(host_id_base.into())).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::netmask;

    #[test]
    fn netmasks_follow_the_prefix() {
        assert_eq!(netmask(30), [255, 255, 255, 252]);
        assert_eq!(netmask(24), [255, 255, 255, 0]);
        assert_eq!(netmask(0), [0, 0, 0, 0]);
        assert_eq!(netmask(32), [255, 255, 255, 255]);
    }
}
