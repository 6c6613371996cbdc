//! File transfer and post-restore housekeeping. Paths are opened as
//! [`resolve`] opens them: from the sandbox's root, no symbolic link
//! followed, init's own `/proc` entries refused.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{fchown, PermissionsExt};

use cairn_protocol::{read_frame, write_frame, FileMeta, FrameError, FromInit, FsErrorKind, ToInit, DATA_CHUNK};
use nix::errno::Errno;
use nix::fcntl::{fcntl, openat, renameat, AtFlags, FcntlArg, OFlag};
use nix::sys::stat::{fstat, fstatat, futimens, FileStat, Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{unlinkat, UnlinkatFlags};

use crate::resolve::{self, answer, Refusal, SandboxPath, Unresolved};
use crate::tree::meta_of_stat;

/// Answers [`cairn_protocol::ToInit::Stat`]: the metadata of `path`, the
/// last name not followed (a symbolic link is described itself), `None`
/// when nothing is there.
pub fn stat<W: Write>(path: &str, writer: &mut W) -> Result<(), FrameError> {
    answer(writer, stat_of(path).map(FromInit::Stat))
}

fn stat_of(path: &str) -> Result<Option<FileMeta>, Refusal> {
    let parsed = SandboxPath::parse(path)?;
    match resolve::open(&parsed, OFlag::O_PATH) {
        Ok(fd) => {
            let st = fstat(fd.as_raw_fd()).map_err(|e| Refusal::errno(e, format!("cannot stat {path}")))?;
            Ok(Some(meta_of_stat(path.to_string(), &st)))
        }
        Err(Unresolved::Errno(Errno::ENOENT | Errno::ENOTDIR)) => Ok(None),
        Err(e) => Err(e.refusal(&format!("cannot stat {path}"))),
    }
}

/// Receives a file. The content goes to a temporary file beside the target,
/// renamed into place only once complete, so an interrupted copy never
/// leaves a truncated file behind.
pub fn put<W: Write>(meta: FileMeta, reader: &mut impl Read, writer: &mut W) -> Result<(), FrameError> {
    let reply = match receive(&meta, reader) {
        Ok(()) => Ok(FromInit::Done),
        Err(Failure::Protocol(e)) => return Err(e),
        Err(Failure::Refused(refusal)) => Err(refusal),
    };
    answer(writer, reply)
}

enum Failure {
    Protocol(FrameError),
    Refused(Refusal),
}

/// The directory a file is received into, and the file's name there.
struct Target {
    dir: OwnedFd,
    name: String,
}

/// Opens the directory of `path` for receiving a file into: every name on
/// the way a directory, none a symbolic link.
fn target_of(path: &str) -> Result<Target, Refusal> {
    let (dir, name) = SandboxPath::parse_named(path)?;
    let what = format!("cannot write {path}");
    let fd = resolve::open_parent(&dir, name).map_err(|e| match e {
        Unresolved::Errno(Errno::ENOENT | Errno::ENOTDIR) => Refusal::new(
            FsErrorKind::NotFound,
            format!("{what}: the directory {dir} does not exist in the sandbox"),
        ),
        e => e.refusal(&what),
    })?;
    Ok(Target {
        dir: fd,
        name: name.to_string(),
    })
}

fn receive(meta: &FileMeta, reader: &mut impl Read) -> Result<(), Failure> {
    let refuse =
        |what: &str, e: Errno| Failure::Refused(Refusal::errno(e, format!("cannot write {}: {what}", meta.path)));
    let target = match target_of(&meta.path) {
        Ok(target) => target,
        Err(refusal) => {
            drain(reader).map_err(Failure::Protocol)?;
            return Err(Failure::Refused(refusal));
        }
    };
    let (tmp, mut file) = match create_temporary(&target) {
        Ok(created) => created,
        Err(e) => {
            drain(reader).map_err(Failure::Protocol)?;
            return Err(refuse("create", e));
        }
    };
    let remove_tmp = || {
        let _ = unlinkat(Some(target.dir.as_raw_fd()), tmp.as_str(), UnlinkatFlags::NoRemoveDir);
    };
    let mut write_error = None;
    loop {
        match read_frame::<ToInit, _>(reader) {
            Ok(ToInit::Data(d)) => {
                if write_error.is_none() {
                    if let Err(e) = file.write_all(&d) {
                        write_error = Some(e);
                    }
                }
            }
            Ok(ToInit::End) => break,
            Ok(_) => {
                remove_tmp();
                return Err(Failure::Refused(Refusal::new(
                    FsErrorKind::Invalid,
                    "unexpected frame inside a file transfer".into(),
                )));
            }
            Err(e) => {
                remove_tmp();
                return Err(Failure::Protocol(e));
            }
        }
    }
    let io_errno = |e: std::io::Error| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
    let finish = || -> Result<(), Failure> {
        if let Some(e) = write_error {
            return Err(refuse("write", io_errno(e)));
        }
        file.sync_data().map_err(|e| refuse("sync", io_errno(e)))?;
        // Through the handle: the name may have been replaced meanwhile.
        fchown(&file, Some(meta.uid), Some(meta.gid)).map_err(|e| refuse("chown", io_errno(e)))?;
        file.set_permissions(fs::Permissions::from_mode(meta.mode))
            .map_err(|e| refuse("chmod", io_errno(e)))?;
        let secs = meta.mtime_ns.div_euclid(1_000_000_000) as i64;
        let nsec = meta.mtime_ns.rem_euclid(1_000_000_000) as i64;
        let ts = TimeSpec::new(secs, nsec);
        futimens(file.as_raw_fd(), &ts, &ts).map_err(|e| refuse("set mtime", e))?;
        let dir = target.dir.as_raw_fd();
        if fstatat(Some(dir), target.name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .is_ok_and(|st| resolve::file_type(&st) == SFlag::S_IFDIR)
        {
            return Err(Failure::Refused(Refusal::new(
                FsErrorKind::IsADirectory,
                format!("cannot write {}: it is a directory", meta.path),
            )));
        }
        // Within the one directory opened above: a symbolic link at the
        // name is replaced, never followed.
        renameat(Some(dir), tmp.as_str(), Some(dir), target.name.as_str()).map_err(|e| refuse("rename", e))
    };
    let result = finish();
    if result.is_err() {
        remove_tmp();
    }
    result
}

/// The longest part of a file's name a temporary's name keeps, so that it
/// stays within NAME_MAX (255 bytes) with its prefix and suffix.
const TEMPORARY_NAME_KEPT: usize = 200;

/// A new file in the target's directory, created exclusively (never through
/// a symlink another process in the sandbox put at the name) and
/// owner-only until complete.
fn create_temporary(target: &Target) -> Result<(String, File), Errno> {
    let mut kept = target.name.len().min(TEMPORARY_NAME_KEPT);
    while !target.name.is_char_boundary(kept) {
        kept -= 1;
    }
    let mut attempt = 0u32;
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = format!(".{}.cairn-{nanos:08x}{attempt}", &target.name[..kept]);
        match openat(
            Some(target.dir.as_raw_fd()),
            tmp.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(fd) => return Ok((tmp, File::from(resolve::owned(fd)))),
            Err(Errno::EEXIST) if attempt < 16 => attempt += 1,
            Err(e) => return Err(e),
        }
    }
}

fn drain(reader: &mut impl Read) -> Result<(), FrameError> {
    loop {
        match read_frame::<ToInit, _>(reader)? {
            ToInit::End => return Ok(()),
            _ => continue,
        }
    }
}

/// Opens `path` for sending: a regular file, opened without blocking
/// (a FIFO swapped in would otherwise hold the open until a writer came)
/// and checked on the descriptor.
fn open_regular(path: &str) -> Result<(File, FileStat), Refusal> {
    let parsed = SandboxPath::parse(path)?;
    let what = format!("cannot read {path}");
    let fd = match resolve::open(&parsed, OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY) {
        Ok(fd) => fd,
        // A socket (or a device without a driver) cannot be opened; say
        // which it is.
        Err(Unresolved::Errno(Errno::ENXIO)) => {
            let fd = resolve::open(&parsed, OFlag::O_PATH).map_err(|e| e.refusal(&what))?;
            let st = fstat(fd.as_raw_fd()).map_err(|e| Refusal::errno(e, what.clone()))?;
            return Err(not_regular(path, &st));
        }
        Err(e) => return Err(e.refusal(&what)),
    };
    let st = fstat(fd.as_raw_fd()).map_err(|e| Refusal::errno(e, what.clone()))?;
    if resolve::file_type(&st) != SFlag::S_IFREG {
        return Err(not_regular(path, &st));
    }
    // Reads of a regular file never block; the flag goes for good measure
    // (some file systems read it).
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_RDONLY)).map_err(|e| Refusal::errno(e, what.clone()))?;
    Ok((File::from(fd), st))
}

fn not_regular(path: &str, st: &FileStat) -> Refusal {
    let kind = match resolve::file_type(st) {
        SFlag::S_IFDIR => FsErrorKind::IsADirectory,
        _ => FsErrorKind::Invalid,
    };
    Refusal::new(
        kind,
        format!(
            "{path} is {}; only regular files can be downloaded",
            resolve::type_name(st)
        ),
    )
}

/// Sends a file: its metadata, then its content.
pub fn get<W: Write>(path: &str, writer: &mut W) -> Result<(), FrameError> {
    let (mut file, st) = match open_regular(path) {
        Ok(opened) => opened,
        Err(refusal) => return answer(writer, Err(refusal)),
    };
    write_frame(writer, &FromInit::File(meta_of_stat(path.to_string(), &st)))?;
    let mut buf = vec![0u8; DATA_CHUNK];
    let mut frame = Vec::with_capacity(DATA_CHUNK + 16);
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                write_frame(writer, &FromInit::Error(format!("reading {path} failed: {e}")))?;
                return Ok(writer.flush()?);
            }
        };
        cairn_protocol::encode_frame(&FromInit::Data(buf[..n].to_vec()), &mut frame)?;
        writer.write_all(&frame)?;
    }
    write_frame(writer, &FromInit::End)?;
    writer.flush()?;
    Ok(())
}

/// After a restore or fork: mix fresh entropy into the kernel RNG and, where
/// the sandbox owns its clock (gVisor), set the wall clock from the host.
pub fn restored(unix_time_ns: u128, entropy: &[u8]) -> Result<(), String> {
    if !entropy.is_empty() {
        let mut urandom = fs::OpenOptions::new()
            .write(true)
            .open("/dev/urandom")
            .map_err(|e| format!("cannot open /dev/urandom to reseed: {e}"))?;
        urandom
            .write_all(entropy)
            .map_err(|e| format!("cannot reseed the RNG: {e}"))?;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    if now.abs_diff(unix_time_ns) > 500_000_000 {
        let ts = TimeSpec::new(
            (unix_time_ns / 1_000_000_000) as i64,
            (unix_time_ns % 1_000_000_000) as i64,
        );
        nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts).map_err(|e| {
            format!(
                "the sandbox clock is off by {} ms and cannot be set: {e}",
                now.abs_diff(unix_time_ns) / 1_000_000
            )
        })?;
    }
    Ok(())
}

/// Opens `path` for its extended attributes: a regular file or a
/// directory, never through a link; `Ok(None)` when it is gone or is
/// something else (a link, a device, a pipe).
fn open_for_xattrs(path: &str) -> Result<Option<OwnedFd>, Refusal> {
    let parsed = SandboxPath::parse(path)?;
    let what = format!("cannot open {path}");
    let kind_of = |fd: &OwnedFd| -> Result<SFlag, Refusal> {
        let st = fstat(fd.as_raw_fd()).map_err(|e| Refusal::errno(e, what.clone()))?;
        Ok(resolve::file_type(&st))
    };
    // Looked at without opening first: opening a device or a pipe could
    // have effects of its own.
    let first = match resolve::open(&parsed, OFlag::O_PATH) {
        Ok(fd) => fd,
        Err(Unresolved::Errno(Errno::ENOENT | Errno::ENOTDIR)) => return Ok(None),
        Err(e) => return Err(e.refusal(&what)),
    };
    if !matches!(kind_of(&first)?, SFlag::S_IFREG | SFlag::S_IFDIR) {
        return Ok(None);
    }
    let fd = match resolve::open(&parsed, OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY) {
        Ok(fd) => fd,
        Err(Unresolved::Errno(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP)) => return Ok(None),
        Err(e) => return Err(e.refusal(&what)),
    };
    // Swapped for something else in between: treated as gone.
    Ok(matches!(kind_of(&fd)?, SFlag::S_IFREG | SFlag::S_IFDIR).then_some(fd))
}

fn c_name(name: &str) -> Result<std::ffi::CString, Refusal> {
    std::ffi::CString::new(name)
        .map_err(|_| Refusal::new(FsErrorKind::Invalid, format!("attribute name {name:?} holds a NUL")))
}

/// Answers [`ToInit::SetXattrs`].
pub fn set_xattrs<W: Write>(path: &str, attrs: &[(String, String)], writer: &mut W) -> Result<(), FrameError> {
    answer(writer, set_xattrs_of(path, attrs).map(|()| FromInit::Done))
}

fn set_xattrs_of(path: &str, attrs: &[(String, String)]) -> Result<(), Refusal> {
    use cairn_protocol::{XATTRS_MAX, XATTR_NAME_MAX, XATTR_PREFIX, XATTR_VALUE_MAX};
    if attrs.len() > XATTRS_MAX {
        return Err(Refusal::new(
            FsErrorKind::Invalid,
            format!("at most {XATTRS_MAX} attributes, got {}", attrs.len()),
        ));
    }
    for (name, value) in attrs {
        if !name.starts_with(XATTR_PREFIX) || name.len() > XATTR_NAME_MAX || value.len() > XATTR_VALUE_MAX {
            return Err(Refusal::new(
                FsErrorKind::Invalid,
                format!(
                    "attribute {name:?}: names are {XATTR_PREFIX}KEY, at most {XATTR_NAME_MAX} bytes, values at most \
                     {XATTR_VALUE_MAX}"
                ),
            ));
        }
    }
    let fd = open_for_xattrs(path)?.ok_or_else(|| {
        Refusal::new(
            FsErrorKind::NotFound,
            format!("cannot set attributes of {path}: no file or directory is there"),
        )
    })?;
    for (name, value) in attrs {
        let c = c_name(name)?;
        // SAFETY: a valid descriptor, a NUL-terminated name, and a value
        // buffer of the length given.
        let rc = unsafe { libc::fsetxattr(fd.as_raw_fd(), c.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        if rc != 0 {
            return Err(Refusal::errno(
                Errno::last(),
                format!("cannot set {name} on {path} (does its file system keep user attributes?)"),
            ));
        }
    }
    Ok(())
}

/// Answers [`ToInit::GetXattrs`].
pub fn get_xattrs<W: Write>(paths: &[String], writer: &mut W) -> Result<(), FrameError> {
    if paths.len() > cairn_protocol::XATTR_PATHS_MAX {
        let refusal = Refusal::new(
            FsErrorKind::Invalid,
            format!("at most {} paths, got {}", cairn_protocol::XATTR_PATHS_MAX, paths.len()),
        );
        return answer(writer, Err(refusal));
    }
    let all = paths.iter().map(|p| xattrs_of(p).unwrap_or_default()).collect();
    write_frame(writer, &FromInit::Xattrs(all))
}

/// The [`cairn_protocol::XATTR_PREFIX`] attributes of `path`, bounded.
fn xattrs_of(path: &str) -> Result<Vec<(String, String)>, Refusal> {
    use cairn_protocol::{XATTRS_MAX, XATTR_PREFIX, XATTR_VALUE_MAX};
    let Some(fd) = open_for_xattrs(path)? else {
        return Ok(Vec::new());
    };
    let mut names = vec![0u8; 64 << 10];
    // SAFETY: a valid descriptor and a buffer of the length given.
    let n = unsafe { libc::flistxattr(fd.as_raw_fd(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for name in names[..n as usize].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(name) = std::str::from_utf8(name) else { continue };
        let Some(key) = name.strip_prefix(XATTR_PREFIX) else {
            continue;
        };
        let mut value = vec![0u8; XATTR_VALUE_MAX];
        let c = c_name(name)?;
        // SAFETY: as above.
        let len = unsafe { libc::fgetxattr(fd.as_raw_fd(), c.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if len < 0 {
            continue;
        }
        value.truncate(len as usize);
        out.push((key.to_string(), String::from_utf8_lossy(&value).into_owned()));
        if out.len() >= XATTRS_MAX {
            break;
        }
    }
    out.sort();
    Ok(out)
}
