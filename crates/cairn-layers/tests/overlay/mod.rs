//! Test harness: real overlayfs mounts with unmount-on-drop guards, and a
//! fd-relative tree walker that records everything a user could notice.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{openat, AtFlags, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{fstatat, mkdirat, Mode, SFlag};

/// An overlay mount, unmounted when dropped so a failing test leaks none.
pub struct Mount {
    target: PathBuf,
}

impl Mount {
    /// `lowers` top-first, as in `lowerdir=`.
    pub fn overlay(
        lowers: &[&Path],
        upper_work: Option<(&Path, &Path)>,
        target: &Path,
        read_only: bool,
    ) -> io::Result<Mount> {
        fs::create_dir_all(target)?;
        let lowers: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
        let mut opts = format!("lowerdir={}", lowers.join(":"));
        match upper_work {
            Some((upper, work)) => {
                opts.push_str(&format!(
                    ",upperdir={},workdir={},redirect_dir=on",
                    upper.display(),
                    work.display()
                ));
            }
            None => opts.push_str(",redirect_dir=follow"),
        }
        opts.push_str(",metacopy=off,index=off");
        let flags = if read_only {
            MsFlags::MS_RDONLY
        } else {
            MsFlags::empty()
        };
        mount(Some("overlay"), target, Some("overlay"), flags, Some(opts.as_str()))
            .map_err(|e| io::Error::other(format!("mount overlay {opts} on {}: {e}", target.display())))?;
        Ok(Mount {
            target: target.to_path_buf(),
        })
    }

    /// A fresh ext4 filesystem in `image` whose timestamps have whole
    /// seconds only (128-byte inodes), mounted on `target`: every change
    /// within one second leaves the same ctime, as a coarse clock tick
    /// does on kernels without fine-grained timestamps.
    pub fn ext4_with_second_timestamps(image: &Path, target: &Path) -> io::Result<Mount> {
        fs::create_dir_all(target)?;
        fs::File::create(image)?.set_len(32 << 20)?;
        let run = |cmd: &mut std::process::Command| -> io::Result<()> {
            let out = cmd.output()?;
            if out.status.success() {
                Ok(())
            } else {
                Err(io::Error::other(format!(
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )))
            }
        };
        run(std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-I", "128"])
            .arg(image))?;
        run(std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(image)
            .arg(target))?;
        Ok(Mount {
            target: target.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.target
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if umount2(&self.target, MntFlags::empty()).is_err() {
            let _ = umount2(&self.target, MntFlags::MNT_DETACH);
        }
    }
}

/// Writes straight to the process's stderr, past libtest's capture, so a
/// skip is visible in a normal `cargo test` run.
/// Says loudly why the tests are skipped; under CI (`CI=true`) a missing
/// part fails them instead.
fn shout(msg: &str) {
    use std::io::Write;
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg} (CI=true: a missing part fails the test)");
    }
    let _ = writeln!(io::stderr(), "{msg}");
}

/// True when overlay tests can run; otherwise says loudly why not.
pub fn overlay_available() -> bool {
    if !nix::unistd::geteuid().is_root() {
        shout("SKIPPED: overlay tests need root (mounts, trusted.* xattrs, device nodes)");
        return false;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let [l, u, w, m] = ["l", "u", "w", "m"].map(|n| dir.path().join(n));
    for d in [&l, &u, &w, &m] {
        fs::create_dir(d).unwrap();
    }
    match Mount::overlay(&[&l], Some((&u, &w)), &m, false) {
        Ok(_m) => true,
        Err(e) => {
            shout(&format!("SKIPPED: overlayfs is not usable here: {e}"));
            false
        }
    }
}

/// Mount points under `dir` still listed in /proc/self/mountinfo.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let prefix = dir.display().to_string();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| mp.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

/// What a user can observe about one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u64,
    /// Regular files only (directory sizes are filesystem-specific).
    pub size: u64,
    pub mtime: (i64, i64),
    pub rdev: u64,
    pub user_xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub symlink_target: Option<Vec<u8>>,
    pub content_hash: Option<String>,
}

fn adopt(fd: i32) -> File {
    // SAFETY: `fd` was just returned by a successful openat; the File is
    // its only owner.
    unsafe { File::from_raw_fd(fd) }
}

fn open_at(dir: Option<&File>, name: &[u8], flags: OFlag) -> io::Result<File> {
    let fd = openat(
        dir.map(|d| d.as_raw_fd()),
        name,
        flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(adopt(fd))
}

fn proc_path(dir: &File, name: &[u8]) -> PathBuf {
    let mut p = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
    p.extend_from_slice(name);
    PathBuf::from(OsStr::from_bytes(&p))
}

/// Walks `root` (fd-relative, so paths longer than PATH_MAX work) and
/// records every entry by its relative path.
pub fn observe(root: &Path) -> BTreeMap<Vec<u8>, Observed> {
    let mut out = BTreeMap::new();
    let dir = open_at(None, root.as_os_str().as_bytes(), OFlag::O_RDONLY | OFlag::O_DIRECTORY).unwrap();
    walk(&dir, b"", &mut out);
    out
}

fn walk(dir: &File, prefix: &[u8], out: &mut BTreeMap<Vec<u8>, Observed>) {
    let mut names: Vec<Vec<u8>> = nix::dir::Dir::openat(
        Some(dir.as_raw_fd()),
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        Mode::empty(),
    )
    .unwrap()
    .iter()
    .map(|e| e.unwrap().file_name().to_bytes().to_vec())
    .filter(|n| n != b"." && n != b"..")
    .collect();
    names.sort();
    for name in names {
        let mut path = prefix.to_vec();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(&name);
        let st = fstatat(Some(dir.as_raw_fd()), &name[..], AtFlags::AT_SYMLINK_NOFOLLOW).unwrap();
        let fmt = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        let pp = proc_path(dir, &name);
        let mut user_xattrs: Vec<(Vec<u8>, Vec<u8>)> = xattr::list(&pp)
            .unwrap()
            .filter(|n| n.as_bytes().starts_with(b"user."))
            .map(|n| (n.as_bytes().to_vec(), xattr::get(&pp, &n).unwrap().unwrap_or_default()))
            .collect();
        user_xattrs.sort();
        let kind = match fmt {
            SFlag::S_IFDIR => "dir",
            SFlag::S_IFREG => "file",
            SFlag::S_IFLNK => "symlink",
            SFlag::S_IFIFO => "fifo",
            SFlag::S_IFCHR => "char",
            SFlag::S_IFBLK => "block",
            SFlag::S_IFSOCK => "socket",
            _ => "unknown",
        };
        let mut observed = Observed {
            kind,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            nlink: st.st_nlink,
            size: 0,
            mtime: (st.st_mtime, st.st_mtime_nsec),
            rdev: st.st_rdev,
            user_xattrs,
            symlink_target: None,
            content_hash: None,
        };
        match fmt {
            SFlag::S_IFREG => {
                observed.size = st.st_size as u64;
                let mut f = open_at(Some(dir), &name, OFlag::O_RDONLY).unwrap();
                let mut hasher = blake3::Hasher::new();
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let n = f.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    hasher.update(&buf[..n]);
                }
                observed.content_hash = Some(hasher.finalize().to_hex().to_string());
            }
            SFlag::S_IFLNK => {
                observed.symlink_target = Some(
                    nix::fcntl::readlinkat(Some(dir.as_raw_fd()), &name[..])
                        .unwrap()
                        .as_bytes()
                        .to_vec(),
                );
            }
            _ => {}
        }
        out.insert(path.clone(), observed);
        if fmt == SFlag::S_IFDIR {
            let sub = open_at(Some(dir), &name, OFlag::O_RDONLY | OFlag::O_DIRECTORY).unwrap();
            walk(&sub, &path, out);
        }
    }
}

/// Asserts two observed trees are identical, naming the first difference.
pub fn assert_same_tree(expected: &BTreeMap<Vec<u8>, Observed>, actual: &BTreeMap<Vec<u8>, Observed>) {
    for (path, e) in expected {
        let shown = String::from_utf8_lossy(path);
        let a = actual
            .get(path)
            .unwrap_or_else(|| panic!("{shown} is missing from the rebuilt view"));
        assert_eq!(e, a, "{shown} differs");
    }
    for path in actual.keys() {
        assert!(
            expected.contains_key(path),
            "{} appears in the rebuilt view only",
            String::from_utf8_lossy(path)
        );
    }
}

/// Creates `depth` nested directories with `name_len`-byte names under
/// `base` (fd-relative, so the total may exceed PATH_MAX) and a file with
/// `content` at the bottom; returns the relative path.
pub fn create_deep(base: &Path, depth: usize, name_len: usize, content: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut dir = open_at(None, base.as_os_str().as_bytes(), OFlag::O_RDONLY | OFlag::O_DIRECTORY).unwrap();
    let mut rel = Vec::new();
    for level in 0..depth {
        let name = vec![b'a' + (level % 26) as u8; name_len];
        mkdirat(Some(dir.as_raw_fd()), &name[..], Mode::from_bits_truncate(0o755)).unwrap();
        dir = open_at(Some(&dir), &name, OFlag::O_RDONLY | OFlag::O_DIRECTORY).unwrap();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(&name);
    }
    let fd = openat(
        Some(dir.as_raw_fd()),
        "bottom.txt",
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
        Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    adopt(fd).write_all(content).unwrap();
    rel.extend_from_slice(b"/bottom.txt");
    rel
}

/// Allocated bytes of a file.
pub fn allocated(path: &Path) -> u64 {
    fs::symlink_metadata(path).unwrap().blocks() * 512
}
