//! A layer directory's seal: a BLAKE3 over what `lstat` says of every
//! entry (path, type and mode with its setuid bits, owner, size, inode,
//! modification and change times, a link's target), written beside the
//! layer when Cairn puts it in place (`.seal-<id>`). Any change to a file's
//! content, mode, owner or extended attributes moves its change time,
//! which no tool sets back, so a walk that finds another seal finds a layer
//! changed behind Cairn's back. A walk is a few milliseconds for an image's
//! thousands of entries, done once per process per layer (see
//! [`crate::LayerStore::ensure`]); the contents themselves were checked
//! against their hashes when the layer was captured or materialised.

use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The seal of the tree at `dir` (not following links).
pub fn compute(dir: &Path) -> io::Result<String> {
    let mut h = blake3::Hasher::new();
    walk(dir, Path::new(""), &mut h)?;
    Ok(h.finalize().to_hex().to_string())
}

fn walk(abs: &Path, rel: &Path, h: &mut blake3::Hasher) -> io::Result<()> {
    let md = fs::symlink_metadata(abs)?;
    h.update(rel.as_os_str().as_bytes());
    h.update(&[0]);
    for n in [
        u64::from(md.mode()),
        u64::from(md.uid()),
        u64::from(md.gid()),
        md.size(),
        md.ino(),
        md.mtime() as u64,
        md.mtime_nsec() as u64,
        md.ctime() as u64,
        md.ctime_nsec() as u64,
    ] {
        h.update(&n.to_le_bytes());
    }
    if md.file_type().is_symlink() {
        h.update(fs::read_link(abs)?.as_os_str().as_bytes());
        h.update(&[0]);
    } else if md.is_dir() {
        let mut names: Vec<_> = fs::read_dir(abs)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        for name in names {
            walk(&abs.join(&name), &rel.join(&name), h)?;
        }
    }
    Ok(())
}

/// Where the seal of the layer directory `layer` is kept: beside it.
pub fn path_of(layer: &Path) -> PathBuf {
    let name = layer
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    layer.with_file_name(format!(".seal-{name}"))
}

/// Seals `layer` as it is now (written whole, then renamed into place).
pub fn write(layer: &Path) -> io::Result<String> {
    let seal = compute(layer)?;
    let path = path_of(layer);
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, &seal)?;
    fs::rename(&tmp, &path)?;
    Ok(seal)
}

/// The seal recorded for `layer`, if any.
pub fn recorded(layer: &Path) -> Option<String> {
    fs::read_to_string(path_of(layer)).ok().map(|s| s.trim().to_string())
}
