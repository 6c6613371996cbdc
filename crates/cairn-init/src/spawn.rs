//! Starting processes with `posix_spawn`, which glibc implements with
//! `clone(CLONE_VM | CLONE_VFORK)`: no copy of init's page tables, so an
//! exec costs the same however much init has mapped.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What the child's stdio is.
pub enum Stdio {
    /// Pipes back to init (foreground exec); stdin piped only when asked.
    Piped { stdin: bool },
    /// stdin from /dev/null, stdout and stderr to init's own (the console
    /// log): background processes.
    Console,
}

pub struct Child {
    pub pid: i32,
    pub stdin: Option<File>,
    pub stdout: Option<File>,
    pub stderr: Option<File>,
}

fn cstring(s: impl AsRef<[u8]>) -> io::Result<CString> {
    CString::new(s.as_ref().to_vec()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in argument"))
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

/// Finds `program` on `path` the way a shell does.
fn resolve(program: &str, path: &str) -> io::Result<PathBuf> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    let mut denied = false;
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(program);
        let Ok(md) = candidate.metadata() else { continue };
        if md.is_file() {
            if nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK).is_ok() {
                return Ok(candidate);
            }
            denied = true;
        }
    }
    Err(if denied {
        io::ErrorKind::PermissionDenied.into()
    } else {
        io::ErrorKind::NotFound.into()
    })
}

struct Actions(libc::posix_spawn_file_actions_t);
struct Attrs(libc::posix_spawnattr_t);

impl Drop for Actions {
    fn drop(&mut self) {
        // SAFETY: initialised in `spawn` before any Actions value exists.
        unsafe { libc::posix_spawn_file_actions_destroy(&mut self.0) };
    }
}

impl Drop for Attrs {
    fn drop(&mut self) {
        // SAFETY: initialised in `spawn` before any Attrs value exists.
        unsafe { libc::posix_spawnattr_destroy(&mut self.0) };
    }
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Starts `argv` in its own process group with `env` on top of the default
/// environment, in `cwd`.
pub fn spawn(argv: &[String], env: &[(String, String)], cwd: &str, stdio: Stdio) -> io::Result<Child> {
    let mut vars: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/root".into()),
        ("TERM".into(), "xterm".into()),
    ];
    for (k, v) in env {
        vars.retain(|(key, _)| key != k);
        vars.push((k.clone(), v.clone()));
    }
    let path = vars
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or(DEFAULT_PATH);
    let program = cstring(resolve(&argv[0], path)?.as_os_str().as_bytes())?;
    let argv_c: Vec<CString> = argv.iter().map(cstring).collect::<io::Result<_>>()?;
    let env_c: Vec<CString> = vars
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}")))
        .collect::<io::Result<_>>()?;
    let mut argv_p: Vec<*mut libc::c_char> = argv_c.iter().map(|c| c.as_ptr() as *mut _).collect();
    argv_p.push(std::ptr::null_mut());
    let mut env_p: Vec<*mut libc::c_char> = env_c.iter().map(|c| c.as_ptr() as *mut _).collect();
    env_p.push(std::ptr::null_mut());
    let cwd_c = cstring(cwd)?;

    // SAFETY: zeroed structs are immediately initialised by their init
    // functions, and destroyed by the Drop impls above.
    let mut actions = Actions(unsafe { std::mem::zeroed() });
    // SAFETY: as above.
    check(unsafe { libc::posix_spawn_file_actions_init(&mut actions.0) })?;
    // SAFETY: as above.
    let mut attrs = Attrs(unsafe { std::mem::zeroed() });
    // SAFETY: as above.
    check(unsafe { libc::posix_spawnattr_init(&mut attrs.0) })?;

    let mut ours = (None, None, None);
    let mut child_ends: Vec<OwnedFd> = Vec::new();
    match stdio {
        Stdio::Piped { stdin } => {
            if stdin {
                let (r, w) = pipe()?;
                // SAFETY: `r` stays open (in child_ends) until after spawn.
                check(unsafe { libc::posix_spawn_file_actions_adddup2(&mut actions.0, r.as_raw_fd(), 0) })?;
                child_ends.push(r);
                ours.0 = Some(File::from(w));
            } else {
                // SAFETY: the path is a static NUL-terminated string.
                check(unsafe {
                    libc::posix_spawn_file_actions_addopen(&mut actions.0, 0, c"/dev/null".as_ptr(), libc::O_RDONLY, 0)
                })?;
            }
            let (r, w) = pipe()?;
            // SAFETY: `w` stays open until after spawn.
            check(unsafe { libc::posix_spawn_file_actions_adddup2(&mut actions.0, w.as_raw_fd(), 1) })?;
            child_ends.push(w);
            ours.1 = Some(File::from(r));
            let (r, w) = pipe()?;
            // SAFETY: `w` stays open until after spawn.
            check(unsafe { libc::posix_spawn_file_actions_adddup2(&mut actions.0, w.as_raw_fd(), 2) })?;
            child_ends.push(w);
            ours.2 = Some(File::from(r));
        }
        Stdio::Console => {
            // SAFETY: the path is a static NUL-terminated string.
            check(unsafe {
                libc::posix_spawn_file_actions_addopen(&mut actions.0, 0, c"/dev/null".as_ptr(), libc::O_RDONLY, 0)
            })?;
        }
    }
    // SAFETY: cwd_c lives until after spawn; glibc copies nothing lazily.
    check(unsafe { libc::posix_spawn_file_actions_addchdir_np(&mut actions.0, cwd_c.as_ptr()) })?;

    let flags = libc::POSIX_SPAWN_SETPGROUP | libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF;
    // SAFETY: plain initialisation calls on an initialised attrs object and
    // local signal sets.
    unsafe {
        check(libc::posix_spawnattr_setflags(&mut attrs.0, flags as libc::c_short))?;
        check(libc::posix_spawnattr_setpgroup(&mut attrs.0, 0))?;
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        check(libc::posix_spawnattr_setsigmask(&mut attrs.0, &empty))?;
        // Init ignores SIGPIPE; its children must not inherit that.
        let mut defaults: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut defaults);
        libc::sigaddset(&mut defaults, libc::SIGPIPE);
        check(libc::posix_spawnattr_setsigdefault(&mut attrs.0, &defaults))?;
    }

    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer refers to a live, NUL-terminated CString or a
    // NULL-terminated array of them, all outliving the call.
    check(unsafe {
        libc::posix_spawn(
            &mut pid,
            program.as_ptr(),
            &actions.0,
            &attrs.0,
            argv_p.as_ptr(),
            env_p.as_ptr(),
        )
    })?;
    drop(child_ends);
    Ok(Child {
        pid,
        stdin: ours.0,
        stdout: ours.1,
        stderr: ours.2,
    })
}
