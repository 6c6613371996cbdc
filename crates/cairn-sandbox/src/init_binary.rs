//! The static `cairn-init` executable, embedded at build time, and its
//! installation on the host where drivers can execute it.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Short BLAKE3 of the embedded executable; names the installed copy, so
/// sandboxes of different Cairn builds never share an init.
pub const INIT_HASH: &str = env!("CAIRN_INIT_HASH");
static INIT: &[u8] = include_bytes!(env!("CAIRN_INIT_PATH"));

/// The embedded executable itself (`cairn bench exec` copies it into a
/// sandbox as a probe: see `cairn-init --time-spawn`).
pub fn bytes() -> &'static [u8] {
    INIT
}

/// Writes the embedded init into `dir` (once per build) and returns its path.
/// The write is atomic: a concurrent or interrupted install never exposes a
/// partial executable.
pub fn install(dir: &Path) -> io::Result<PathBuf> {
    let path = path_in(dir);
    if path.exists() {
        return Ok(path);
    }
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".cairn-init-{INIT_HASH}.{}", std::process::id()));
    let mut f = fs::File::create(&tmp)?;
    f.write_all(INIT)?;
    f.sync_all()?;
    // Closed before it can be executed: a file open for writing cannot be
    // (ETXTBSY).
    drop(f);
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o555))?;
    fs::rename(&tmp, &path)?;
    Ok(path)
}

/// This build's init in `dir`, if [`install`] put it there.
pub fn installed(dir: &Path) -> Option<PathBuf> {
    Some(path_in(dir)).filter(|path| path.exists())
}

/// Where [`install`] puts this build's init in `dir`.
fn path_in(dir: &Path) -> PathBuf {
    dir.join(format!("cairn-init-{INIT_HASH}"))
}
