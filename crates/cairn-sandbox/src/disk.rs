//! A sandbox's disk (`--disk`, either driver): its upper directory on a file
//! system of its own, an ext4 image the size of the limit, so that a
//! sandbox that writes too much fills its own disk (ENOSPC inside), never
//! the host's.
//!
//! In the sandbox's directory: `disk.img`, a sparse file holding the file
//! system (the host's usage is its allocated blocks, at most its size),
//! and `disk/`, where it is mounted on the host through a loop device that
//! goes with the mount, holding `upper/` and `work/`. A sandbox without a
//! limit keeps `upper/` and `work/` in its directory.
//!
//! The mount is the host's, not only the sandbox's, so that snapshots read
//! the upper directory while the sandbox runs or after it stopped; init's
//! mount namespace, copied from the host's when its setup arrives, has it
//! too. A start mounts it (again after a reboot); [`release`] unmounts it
//! before the sandbox's directory is removed, and is what `rm`, reconcile
//! and `gc` run first, so a removal interrupted anywhere is finished by the
//! next one. The file system is mounted `discard`: files deleted inside
//! give their blocks back to the host.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The image file in a sandbox's directory.
pub const IMAGE: &str = "disk.img";
/// Where the image is mounted, in a sandbox's directory.
pub const MOUNT: &str = "disk";
/// An image being made; a crash leaves it for the next start or removal.
const IMAGE_PART: &str = "disk.img.part";

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot make the sandbox's disk {path}: {reason}")]
    Make { path: PathBuf, reason: String },
    #[error(
        "cannot mount the sandbox's disk {path}: {reason}; --disk needs loop devices (/dev/loop-control) and ext4 \
         on this host (`cairn doctor` checks them), or leave out --disk (and CAIRN_DISK)"
    )]
    Mount { path: PathBuf, reason: String },
    #[error("cannot unmount the sandbox's disk {path}: {source}")]
    Unmount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot remove the sandbox's disk {path}: {source}")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The directory holding `upper/` and `work/` of the sandbox whose
/// directory is `dir`.
pub fn writable_dir(dir: &Path) -> PathBuf {
    if dir.join(IMAGE).exists() {
        dir.join(MOUNT)
    } else {
        dir.to_path_buf()
    }
}

/// The upper directory of the sandbox whose directory is `dir`, its disk
/// mounted first if it has one and it is not (after a reboot).
pub fn upper_dir(dir: &Path) -> Result<PathBuf, DiskError> {
    if dir.join(IMAGE).exists() {
        mount(dir)?;
    }
    Ok(writable_dir(dir).join("upper"))
}

/// Gives the sandbox whose directory is `dir` a disk of `bytes` unless it
/// has one, mounts it, and makes `upper/` (the sandbox's `/`, owned by its
/// root `root_id`, 0755) and `work/` in it.
pub fn prepare(dir: &Path, bytes: u64, root_id: u32) -> Result<(), DiskError> {
    fs::create_dir_all(dir).map_err(|e| DiskError::Make {
        path: dir.join(IMAGE),
        reason: format!("create {}: {e}", dir.display()),
    })?;
    if !dir.join(IMAGE).exists() {
        make_image(dir, bytes)?;
    }
    mount(dir)?;
    let top = dir.join(MOUNT);
    let made = |what: &str, e: io::Error| DiskError::Make {
        path: top.clone(),
        reason: format!("{what}: {e}"),
    };
    for sub in ["upper", "work"] {
        let d = top.join(sub);
        if d.is_dir() {
            continue;
        }
        fs::create_dir(&d).map_err(|e| made(&format!("create {sub}/"), e))?;
        if sub == "upper" {
            std::os::unix::fs::chown(&d, Some(root_id), Some(root_id)).map_err(|e| made("chown upper/", e))?;
            fs::set_permissions(&d, fs::Permissions::from_mode(crate::ROOT_MODE))
                .map_err(|e| made("chmod upper/", e))?;
        }
    }
    Ok(())
}

/// Unmounts the sandbox's disk, if mounted, and deletes its image (and an
/// image a crash left half made). Idempotent; nothing is left that would
/// make removing `dir` descend into the sandbox's files.
pub fn release(dir: &Path) -> Result<(), DiskError> {
    let point = dir.join(MOUNT);
    // One unmount per mount stacked there (two starts that raced).
    while is_mounted(dir, &point) {
        // Lazily: a sandbox still dying may hold its overlay on it for a
        // moment; the loop device goes once the last user lets go.
        nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH).map_err(|e| DiskError::Unmount {
            path: point.clone(),
            source: e.into(),
        })?;
    }
    for name in [IMAGE, IMAGE_PART] {
        match fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(DiskError::Remove {
                    path: dir.join(name),
                    source,
                })
            }
        }
    }
    match fs::remove_dir(&point) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DiskError::Remove { path: point, source }),
    }
}

/// The most entries of an upper directory [`usage`] counts.
pub const USAGE_WALK_MAX: usize = 200_000;

/// What the sandbox whose directory is `dir` stores and has room for, in
/// bytes: with a disk of its own (`--disk`), that file system's use and
/// size; else the blocks of its upper directory's files (the first
/// [`USAGE_WALK_MAX`] entries, never following a link) and the size of
/// the host's file system that holds them.
pub fn usage(dir: &Path) -> (u64, u64) {
    let size = |st: &nix::sys::statvfs::Statvfs| st.blocks() * st.fragment_size();
    let point = dir.join(MOUNT);
    if dir.join(IMAGE).exists() && is_mounted(dir, &point) {
        if let Ok(st) = nix::sys::statvfs::statvfs(&point) {
            let free = st.blocks_free() * st.fragment_size();
            return (size(&st).saturating_sub(free), size(&st));
        }
    }
    let total = nix::sys::statvfs::statvfs(dir).map(|st| size(&st)).unwrap_or(0);
    let mut used = 0u64;
    let mut seen = 0usize;
    let mut todo = vec![dir.join("upper")];
    while let Some(d) = todo.pop() {
        let Ok(entries) = fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            seen += 1;
            if seen > USAGE_WALK_MAX {
                return (used, total);
            }
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            used += meta.blocks() * 512;
            if meta.is_dir() {
                todo.push(entry.path());
            }
        }
    }
    (used, total)
}

/// Whether this host can give sandboxes disks: loop devices that open for
/// writing, and `mkfs.ext4`; the answer names what is missing.
pub fn available() -> Result<String, String> {
    let mkfs = mkfs_ext4().ok_or("mkfs.ext4 is not installed")?;
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")
        .map_err(|e| format!("cannot open /dev/loop-control: {e}"))?;
    Ok(format!("/dev/loop-control and {} for --disk", mkfs.display()))
}

/// Whether `point` is a mount of its own (a file system other than `dir`'s).
fn is_mounted(dir: &Path, point: &Path) -> bool {
    match (fs::metadata(dir), fs::symlink_metadata(point)) {
        (Ok(d), Ok(p)) => p.is_dir() && p.dev() != d.dev(),
        _ => false,
    }
}

/// Makes the sparse image and its ext4 file system, under a temporary name
/// renamed into place once whole.
fn make_image(dir: &Path, bytes: u64) -> Result<(), DiskError> {
    let part = dir.join(IMAGE_PART);
    let failed = |reason: String| DiskError::Make {
        path: dir.join(IMAGE),
        reason,
    };
    let _ = fs::remove_file(&part);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&part)
        .map_err(|e| failed(format!("create {}: {e}", part.display())))?;
    file.set_len(bytes)
        .map_err(|e| failed(format!("size the image: {e}")))?;
    drop(file);
    let mut mkfs = Command::new(mkfs_ext4().ok_or_else(|| {
        failed("mkfs.ext4 is not installed: install e2fsprogs (Debian: apt-get install e2fsprogs)".into())
    })?);
    // No blocks reserved for root: every write of the sandbox reaches the
    // file system as the overlay's mounter (host root), so a reserve would
    // only be the sandbox's too. A large disk's journal is capped at
    // 16 MiB, which mkfs writes out in full at once.
    mkfs.args(["-q", "-F", "-m", "0", "-E", "nodiscard"]);
    if bytes >= 1 << 30 {
        mkfs.args(["-J", "size=16"]);
    }
    let out = mkfs
        .arg(&part)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| failed(format!("run mkfs.ext4: {e}")))?;
    if !out.status.success() {
        let _ = fs::remove_file(&part);
        return Err(failed(format!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    fs::File::open(&part)
        .and_then(|f| f.sync_all())
        .and_then(|()| fs::rename(&part, dir.join(IMAGE)))
        .map_err(|e| failed(format!("keep the image: {e}")))
}

fn mkfs_ext4() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
}

/// Mounts the image at `disk/` (nosuid, nodev) unless it is mounted.
fn mount(dir: &Path) -> Result<(), DiskError> {
    let point = dir.join(MOUNT);
    let failed = |reason: String| DiskError::Mount {
        path: dir.join(IMAGE),
        reason,
    };
    match fs::create_dir(&point) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(failed(format!("create {}: {e}", point.display()))),
    }
    if is_mounted(dir, &point) {
        return Ok(());
    }
    let image = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(dir.join(IMAGE))
        .map_err(|e| failed(format!("open the image: {e}")))?;
    let device = loop_device::attach(&image).map_err(|e| failed(format!("attach a loop device: {e}")))?;
    let mounted = nix::mount::mount(
        Some(device.path.as_path()),
        &point,
        Some("ext4"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOATIME,
        Some("discard,errors=remount-ro"),
    );
    // The loop device detaches itself once the mount is gone (or now, if
    // the mount failed): this was its last other user.
    drop(device);
    mounted.map_err(|e| failed(format!("mount {}: {e}", point.display())))
}

/// Loop devices through `/dev/loop-control`, which nix does not wrap.
mod loop_device {
    use std::fs::{File, OpenOptions};
    use std::io;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::path::PathBuf;

    const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
    const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
    const LO_FLAGS_AUTOCLEAR: u32 = 4;
    const LO_FLAGS_DIRECT_IO: u32 = 16;

    /// `struct loop_info64` of `<linux/loop.h>`.
    #[repr(C)]
    struct LoopInfo64 {
        device: u64,
        inode: u64,
        rdevice: u64,
        offset: u64,
        sizelimit: u64,
        number: u32,
        encrypt_type: u32,
        encrypt_key_size: u32,
        flags: u32,
        file_name: [u8; 64],
        crypt_name: [u8; 64],
        encrypt_key: [u8; 32],
        init: [u64; 2],
    }

    /// `struct loop_config` of `<linux/loop.h>` (Linux 5.8).
    #[repr(C)]
    struct LoopConfig {
        fd: u32,
        block_size: u32,
        info: LoopInfo64,
        reserved: [u64; 8],
    }

    /// A configured loop device, held open until dropped; it detaches
    /// itself when its last user (this, then a mount) lets go.
    pub struct Attached {
        pub path: PathBuf,
        _device: File,
    }

    /// A free loop device backed by `backing`, with direct I/O where the
    /// backing file system takes it (the image's pages are then not cached
    /// twice).
    pub fn attach(backing: &File) -> io::Result<Attached> {
        let control = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/loop-control")?;
        // Another process may take the free device first: then it is busy,
        // and the next free one is asked for.
        let mut last = io::Error::from_raw_os_error(libc::EBUSY);
        for _ in 0..64 {
            // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
            let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let path = PathBuf::from(format!("/dev/loop{n}"));
            let device = match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
            {
                Ok(d) => d,
                // udev may not have made the node yet.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    last = e;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(e),
            };
            match configure(&device, backing, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO) {
                Ok(()) => return Ok(Attached { path, _device: device }),
                // A backing file system without direct I/O.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    configure(&device, backing, LO_FLAGS_AUTOCLEAR)?;
                    return Ok(Attached { path, _device: device });
                }
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Backs `device` by `backing` with `flags`.
    fn configure(device: &File, backing: &File, flags: u32) -> io::Result<()> {
        let config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                device: 0,
                inode: 0,
                rdevice: 0,
                offset: 0,
                sizelimit: 0,
                number: 0,
                encrypt_type: 0,
                encrypt_key_size: 0,
                flags,
                file_name: [0; 64],
                crypt_name: [0; 64],
                encrypt_key: [0; 32],
                init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: `config` is a valid, fully initialised loop_config
        // that outlives the call; the kernel only reads it.
        let rc = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config as *const LoopConfig) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn loop_structures_have_the_kernels_sizes() {
            assert_eq!(std::mem::size_of::<super::LoopInfo64>(), 232);
            assert_eq!(std::mem::size_of::<super::LoopConfig>(), 304);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_without_a_disk_keeps_its_upper_directory_in_its_own() {
        let dir = std::env::temp_dir().join(format!("cairn-disk-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(writable_dir(&dir), dir);
        assert_eq!(upper_dir(&dir).unwrap(), dir.join("upper"));
        release(&dir).unwrap();
        fs::write(dir.join(IMAGE), b"").unwrap();
        assert_eq!(writable_dir(&dir), dir.join(MOUNT));
        fs::remove_dir_all(&dir).unwrap();
    }
}
