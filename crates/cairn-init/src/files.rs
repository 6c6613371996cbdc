//! File transfer and post-restore housekeeping.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{fchown, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use cairn_protocol::{read_frame, write_frame, FileKind, FileMeta, FrameError, FromInit, ToInit, DATA_CHUNK};
use nix::sys::stat::futimens;
use nix::sys::time::TimeSpec;

pub fn stat(path: &str) -> Option<FileMeta> {
    let md = fs::symlink_metadata(path).ok()?;
    Some(meta_of(path, &md))
}

fn meta_of(path: &str, md: &fs::Metadata) -> FileMeta {
    let ft = md.file_type();
    let kind = if ft.is_file() {
        FileKind::File
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    FileMeta {
        path: path.to_string(),
        kind,
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        size: md.size(),
        mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
    }
}

/// Receives a file. The content goes to a temporary file beside the target,
/// renamed into place only once complete, so an interrupted copy never
/// leaves a truncated file behind.
pub fn put<W: Write>(meta: FileMeta, reader: &mut impl Read, writer: &mut W) -> Result<(), FrameError> {
    let reply = match receive(&meta, reader) {
        Ok(()) => FromInit::Done,
        Err(Failure::Protocol(e)) => return Err(e),
        Err(Failure::Refused(msg)) => FromInit::Error(msg),
    };
    write_frame(writer, &reply)?;
    writer.flush()?;
    Ok(())
}

enum Failure {
    Protocol(FrameError),
    Refused(String),
}

fn receive(meta: &FileMeta, reader: &mut impl Read) -> Result<(), Failure> {
    let target = PathBuf::from(&meta.path);
    let refuse = |what: &str, e: std::io::Error| Failure::Refused(format!("cannot write {}: {what}: {e}", meta.path));
    let parent = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("/"));
    if !parent.is_dir() {
        drain(reader).map_err(Failure::Protocol)?;
        return Err(Failure::Refused(format!(
            "cannot write {}: directory {} does not exist in the sandbox",
            meta.path,
            parent.display()
        )));
    }
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (tmp, mut file) = match create_temporary(parent, &name) {
        Ok(created) => created,
        Err(e) => {
            drain(reader).map_err(Failure::Protocol)?;
            return Err(refuse("create", e));
        }
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
                let _ = fs::remove_file(&tmp);
                return Err(Failure::Refused("unexpected frame inside a file transfer".into()));
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(Failure::Protocol(e));
            }
        }
    }
    let finish = || -> Result<(), Failure> {
        if let Some(e) = write_error {
            return Err(refuse("write", e));
        }
        file.sync_data().map_err(|e| refuse("sync", e))?;
        // Through the handle: the name may have been replaced meanwhile.
        fchown(&file, Some(meta.uid), Some(meta.gid)).map_err(|e| refuse("chown", e))?;
        file.set_permissions(fs::Permissions::from_mode(meta.mode))
            .map_err(|e| refuse("chmod", e))?;
        let secs = meta.mtime_ns.div_euclid(1_000_000_000) as i64;
        let nsec = meta.mtime_ns.rem_euclid(1_000_000_000) as i64;
        let ts = TimeSpec::new(secs, nsec);
        futimens(file.as_raw_fd(), &ts, &ts).map_err(|e| refuse("set mtime", e.into()))?;
        if target.is_dir() {
            return Err(Failure::Refused(format!(
                "cannot write {}: it is a directory",
                meta.path
            )));
        }
        fs::rename(&tmp, &target).map_err(|e| refuse("rename", e))
    };
    let result = finish();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// A new file beside the target, created exclusively (never through a
/// symlink another process in the sandbox put at the name) and owner-only
/// until complete.
fn create_temporary(parent: &Path, name: &str) -> std::io::Result<(PathBuf, File)> {
    let mut attempt = 0u32;
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = parent.join(format!(".{name}.cairn-{nanos:08x}{attempt}"));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
        {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 16 => attempt += 1,
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

/// Sends a file: its metadata, then its content.
pub fn get<W: Write>(path: &str, writer: &mut W) -> Result<(), FrameError> {
    // Refuse fifos and devices before opening: opening a fifo blocks.
    if let Ok(md) = fs::metadata(path) {
        if !md.is_file() {
            write_frame(writer, &FromInit::Error(format!("{path} is not a regular file")))?;
            return Ok(writer.flush()?);
        }
    }
    let opened = File::open(path).and_then(|f| f.metadata().map(|m| (f, m)));
    let (mut file, md) = match opened {
        Ok(x) => x,
        Err(e) => {
            write_frame(
                writer,
                &FromInit::Error(format!("cannot read {path} in the sandbox: {e}")),
            )?;
            return Ok(writer.flush()?);
        }
    };
    if !md.is_file() {
        write_frame(writer, &FromInit::Error(format!("{path} is not a regular file")))?;
        return Ok(writer.flush()?);
    }
    write_frame(writer, &FromInit::File(meta_of(path, &md)))?;
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
