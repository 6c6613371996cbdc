//! The new mount API's calls, which nix does not wrap.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_SET_FD: libc::c_uint = 5;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;
pub const MOUNT_ATTR_STRICTATIME: u64 = 0x20;

/// `struct mount_attr` from `<linux/mount.h>`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn cstr(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn fd(rc: libc::c_long) -> io::Result<OwnedFd> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

fn unit(rc: libc::c_long) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub fn fsopen(fs_type: &str) -> io::Result<OwnedFd> {
    let name = cstr(OsStr::new(fs_type))?;
    // SAFETY: a NUL-terminated name and flags.
    fd(unsafe { libc::syscall(libc::SYS_fsopen, name.as_ptr(), FSOPEN_CLOEXEC) })
}

/// Sets `key` of the filesystem context `fs` to the string `value`.
pub fn set_str(fs: &OwnedFd, key: &str, value: &str) -> io::Result<()> {
    let (key, value) = (cstr(OsStr::new(key))?, cstr(OsStr::new(value))?);
    // SAFETY: NUL-terminated key and value.
    unit(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_STRING,
            key.as_ptr(),
            value.as_ptr(),
            0,
        )
    })
}

/// Sets the flag `key` of the filesystem context `fs`.
pub fn set_flag(fs: &OwnedFd, key: &str) -> io::Result<()> {
    let key = cstr(OsStr::new(key))?;
    // SAFETY: a NUL-terminated key, no value.
    unit(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_FLAG,
            key.as_ptr(),
            std::ptr::null::<u8>(),
            0,
        )
    })
}

/// Sets `key` of the filesystem context `fs` to the file `value`.
pub fn set_fd(fs: &OwnedFd, key: &str, value: &OwnedFd) -> io::Result<()> {
    let key = cstr(OsStr::new(key))?;
    // SAFETY: a NUL-terminated key, no value pointer, an fd as `aux`.
    unit(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_FD,
            key.as_ptr(),
            std::ptr::null::<u8>(),
            value.as_raw_fd(),
        )
    })
}

/// Creates the filesystem and returns a detached mount of it.
pub fn create(fs: &OwnedFd, attrs: u64) -> io::Result<OwnedFd> {
    // SAFETY: a command with no key or value.
    unit(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<u8>(),
            std::ptr::null::<u8>(),
            0,
        )
    })?;
    // SAFETY: the configured context's fd, flags and mount attributes.
    fd(unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) })
}

/// `open_tree(OPEN_TREE_CLONE)` of `path` under `dir` (`AT_FDCWD` for
/// the working directory; an empty path for `dir`'s own mount).
fn open_tree(dir: libc::c_int, path: &OsStr) -> io::Result<OwnedFd> {
    let p = cstr(path)?;
    let empty = if path.is_empty() {
        libc::AT_EMPTY_PATH as libc::c_uint
    } else {
        0
    };
    // SAFETY: a NUL-terminated path under `dir` (ours, or AT_FDCWD), and flags.
    fd(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            dir,
            p.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | empty,
        )
    })
}

/// A detached copy of the mount at `path` (not of its submounts).
pub fn clone(path: &Path) -> io::Result<OwnedFd> {
    open_tree(libc::AT_FDCWD, path.as_os_str())
}

/// [`clone`] of `name` under `dir`; `""` for `dir`'s own mount, which
/// may be detached.
pub fn clone_at(dir: &OwnedFd, name: &str) -> io::Result<OwnedFd> {
    open_tree(dir.as_raw_fd(), OsStr::new(name))
}

/// A detached, read-only, `nosuid,nodev` copy of the layer directory
/// `path`, whose ids are mapped as `userns` maps them when given.
pub fn layer_clone(path: &str, userns: Option<&OwnedFd>) -> io::Result<OwnedFd> {
    let tree = clone(Path::new(path))?;
    let (idmap, ns) = match userns {
        Some(ns) => (MOUNT_ATTR_IDMAP, ns.as_raw_fd() as u64),
        None => (0, 0),
    };
    set_attrs(
        &tree,
        idmap | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        ns,
    )?;
    Ok(tree)
}

/// An `O_PATH` descriptor of the directory `path`.
pub fn open_path(path: &Path) -> io::Result<OwnedFd> {
    let p = cstr(path.as_os_str())?;
    // SAFETY: a NUL-terminated path.
    fd(unsafe { libc::open(p.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as libc::c_long })
}

/// A detached, read-only, `nosuid,nodev,noexec` copy of the file or
/// directory at `path`.
pub fn readonly_clone(path: &Path) -> io::Result<OwnedFd> {
    read_only(clone(path)?)
}

/// [`readonly_clone`] of the mount at `name` under `dir`.
pub fn readonly_clone_at(dir: &OwnedFd, name: &str) -> io::Result<OwnedFd> {
    read_only(clone_at(dir, name)?)
}

fn read_only(tree: OwnedFd) -> io::Result<OwnedFd> {
    set_attrs(
        &tree,
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        0,
    )?;
    Ok(tree)
}

fn set_attrs(tree: &OwnedFd, attrs: u64, userns_fd: u64) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: attrs,
        attr_clr: 0,
        propagation: 0,
        userns_fd,
    };
    let empty = cstr(OsStr::new(""))?;
    // SAFETY: `attr` is a `struct mount_attr` alive for the call, and
    // its size is passed with it.
    unit(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })
}

/// `move_mount` of the detached mount `mnt` onto `path` under `dir`
/// (`AT_FDCWD` for the working directory; an empty path for `dir`
/// itself).
fn move_mount(mnt: &OwnedFd, dir: libc::c_int, path: &OsStr) -> io::Result<()> {
    let (empty, t) = (cstr(OsStr::new(""))?, cstr(path)?);
    let to_empty = if path.is_empty() { MOVE_MOUNT_T_EMPTY_PATH } else { 0 };
    // SAFETY: NUL-terminated paths; `mnt` is ours, `dir` ours or AT_FDCWD.
    unit(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mnt.as_raw_fd(),
            empty.as_ptr(),
            dir,
            t.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | to_empty,
        )
    })
}

/// Attaches the detached mount `mnt` on the file or directory `target`
/// is an O_PATH descriptor of.
pub fn attach_to_fd(mnt: &OwnedFd, target: &OwnedFd) -> io::Result<()> {
    move_mount(mnt, target.as_raw_fd(), OsStr::new(""))
}

/// Attaches the detached mount `mnt` at `name` under `dir`, which may be
/// a detached tree itself (Linux 6.15).
pub fn attach_at(mnt: &OwnedFd, dir: &OwnedFd, name: &str) -> io::Result<()> {
    move_mount(mnt, dir.as_raw_fd(), OsStr::new(name))
}

/// Attaches the detached mount `mnt` at `target`.
pub fn attach(mnt: &OwnedFd, target: &Path) -> io::Result<()> {
    move_mount(mnt, libc::AT_FDCWD, target.as_os_str())
}

/// Opens the directory `name` under `dir` (which may be a mount's
/// O_PATH root), never following a symlink.
pub fn open_dir_at(dir: &OwnedFd, name: impl AsRef<OsStr>) -> io::Result<OwnedFd> {
    let p = cstr(name.as_ref())?;
    // SAFETY: a NUL-terminated relative path under an fd we own.
    fd(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            p.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        ) as libc::c_long
    })
}
