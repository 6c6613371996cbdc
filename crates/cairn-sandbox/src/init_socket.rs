//! Connecting to init's socket in the directory the sandbox shares with the
//! host.
//!
//! Under gVisor, init binds its socket itself in `<dir>/uds`, which is
//! bind-mounted read-write into the sandbox (`/run/cairn`): every process in
//! the sandbox can put anything there, a symlink to a host socket included.
//! So the host never resolves a name in that directory by path. It reads at
//! most [`MAX_ENTRIES`] names, keeps those init uses (`init.sock`, then
//! `init.sock.<n>` after the n-th re-listen), opens each with `O_PATH |
//! O_NOFOLLOW`, keeps only sockets, and connects through the open handle
//! (`/proc/self/fd/<fd>`), so a rename between the check and the connect
//! cannot send it elsewhere.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

/// How many directory entries are looked at. Init keeps one socket there;
/// anything beyond this many entries is the sandbox's doing.
pub const MAX_ENTRIES: usize = 1024;

/// The generation a socket name stands for: `init.sock` is 0,
/// `init.sock.<n>` is n (digits only, no leading zero, at most
/// [`u32::MAX`]). Any other name is not init's.
pub fn generation(name: &[u8]) -> Option<u32> {
    let rest = name.strip_prefix(b"init.sock")?;
    if rest.is_empty() {
        return Some(0);
    }
    let digits = rest.strip_prefix(b".")?;
    if digits.is_empty() || digits.len() > 10 || digits[0] == b'0' || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Connects to the newest of init's sockets in `dir` that accepts.
/// `NotFound` when there is none (init is not listening, or the sandbox is
/// gone).
pub fn connect(dir: &Path) -> io::Result<UnixStream> {
    let dir = open_directory(dir)?;
    let mut names: Vec<(u32, Vec<u8>)> = list_names(&dir)?
        .into_iter()
        .filter_map(|name| generation(&name).map(|g| (g, name)))
        .collect();
    names.sort_unstable_by_key(|(generation, _)| std::cmp::Reverse(*generation));
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        "no init socket in the sandbox's socket directory",
    );
    for (_, name) in names {
        let Some(socket) = open_socket(&dir, &name)? else {
            continue;
        };
        // Connecting through the handle reaches the inode checked above.
        match UnixStream::connect(format!("/proc/self/fd/{}", socket.as_raw_fd())) {
            Ok(stream) => return Ok(stream),
            // A socket nobody listens on any more (an earlier generation).
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn open_directory(path: &Path) -> io::Result<File> {
    let fd = openat(
        None,
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: `fd` was just returned by a successful openat and is owned by
    // nothing else; the File becomes its only owner.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Up to [`MAX_ENTRIES`] names in `dir`.
fn list_names(dir: &File) -> io::Result<Vec<Vec<u8>>> {
    let mut d = nix::dir::Dir::openat(
        Some(dir.as_raw_fd()),
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in d.iter().take(MAX_ENTRIES) {
        names.push(entry?.file_name().to_bytes().to_vec());
    }
    Ok(names)
}

/// A handle on `name` in `dir` when it is a socket (not a symlink to one).
fn open_socket(dir: &File, name: &[u8]) -> io::Result<Option<OwnedFd>> {
    let fd = match openat(
        Some(dir.as_raw_fd()),
        name,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        // Gone since it was listed.
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // SAFETY: `fd` was just returned by a successful openat and is owned by
    // nothing else; the OwnedFd becomes its only owner.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = fstat(fd.as_raw_fd())?;
    let is_socket = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFSOCK;
    Ok(is_socket.then_some(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    #[test]
    fn only_init_socket_names_have_a_generation() {
        assert_eq!(generation(b"init.sock"), Some(0));
        assert_eq!(generation(b"init.sock.1"), Some(1));
        assert_eq!(generation(b"init.sock.4294967295"), Some(u32::MAX));
        for bad in [
            &b"init.sock."[..],
            b"init.sock.01",
            b"init.sock.4294967296",
            b"init.sock.99999999999999999999",
            b"init.sock.+1",
            b"init.sock.1 ",
            b"init.sockx",
            b".init.sock",
            b"other",
        ] {
            assert_eq!(generation(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    fn answers(stream: &mut UnixStream, listener: &UnixListener) -> bool {
        stream.write_all(b"?").unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        let mut byte = [0u8];
        peer.read_exact(&mut byte).unwrap();
        byte == *b"?"
    }

    #[test]
    fn the_newest_socket_is_used_and_planted_links_and_files_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let foreign = UnixListener::bind(elsewhere.path().join("host.sock")).unwrap();
        foreign.set_nonblocking(true).unwrap();
        let init = UnixListener::bind(dir.path().join("init.sock.3")).unwrap();
        // Newer generations that are not sockets: a link to a host socket,
        // a link to the directory, a regular file.
        std::os::unix::fs::symlink(elsewhere.path().join("host.sock"), dir.path().join("init.sock.99")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join("init.sock.98")).unwrap();
        std::fs::write(dir.path().join("init.sock.97"), b"").unwrap();
        let mut stream = connect(dir.path()).unwrap();
        assert!(answers(&mut stream, &init));
        assert!(foreign.accept().is_err(), "the planted link was followed");
    }

    #[test]
    fn a_stale_socket_falls_back_to_the_one_listening_and_none_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(connect(dir.path()).unwrap_err().kind(), io::ErrorKind::NotFound);
        let init = UnixListener::bind(dir.path().join("init.sock")).unwrap();
        drop(UnixListener::bind(dir.path().join("init.sock.2")).unwrap());
        let mut stream = connect(dir.path()).unwrap();
        assert!(answers(&mut stream, &init));
    }

    #[test]
    fn a_symlink_in_place_of_the_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("real")).unwrap();
        let _init = UnixListener::bind(dir.path().join("real/init.sock")).unwrap();
        std::os::unix::fs::symlink("real", dir.path().join("uds")).unwrap();
        assert!(connect(&dir.path().join("uds")).is_err());
    }
}
