//! Memory images kept on this host (`$CAIRN_HOME/memory/<snapshot>/`, root's
//! alone), as the driver wrote them, so a restore here reads them directly,
//! and their seals: the BLAKE3 of every file's content, recorded when the image is put in
//! place (`memory/.seal-<snapshot>`) and checked before each restore that
//! would use the image. Its files are hard links shared between snapshots
//! (a flattened snapshot links its parent's), so nothing `lstat` says of
//! them (link count, change time) is stable: the seal is of the bytes.
//!
//! The snapshot's manifest pins the image too, but as the store keeps it
//! (a gVisor state file inflated, then chunked), so checking the bytes
//! runsc reads against it would mean inflating and chunking again; hashing
//! them is cheaper. A file is hashed in [`SEGMENT`]-byte pieces on every
//! core, its hash the BLAKE3 of its pieces' hashes.
//!
//! The format, one line each: `cairn-memory-seal 1`, then per file
//! `<hash> <size> <name>`, sorted by name (see `docs/formats.md`).

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use crate::images::ScratchDir;
use crate::snapshots::MemoryImage;
use crate::Engine;

/// The first line of a seal; another version is not understood, so the
/// image it seals is rebuilt from the store.
const HEADER: &str = "cairn-memory-seal 1";

/// How much of a file one core hashes at a time.
const SEGMENT: u64 = 32 << 20;

/// Where the seal of the image directory `image` is kept: beside it, as
/// a layer's is.
pub use cairn_layers::seal::path_of;

/// The seal of the regular files in `dir` (anything else in it, a
/// directory or a link, is refused: runsc writes none).
pub fn compute(dir: &Path) -> io::Result<String> {
    let mut files = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let md = fs::symlink_metadata(e.path())?;
        if !md.is_file() {
            return Err(io::Error::other(format!(
                "{} is not a regular file",
                e.path().display()
            )));
        }
        let name = e
            .file_name()
            .into_string()
            .map_err(|n| io::Error::other(format!("{} is not a UTF-8 name", Path::new(&n).display())))?;
        files.push((name, md.len()));
    }
    files.sort();
    let pieces: Vec<(usize, u64)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, (_, len))| (0..len.div_ceil(SEGMENT).max(1)).map(move |s| (i, s * SEGMENT)))
        .collect();
    let hashes = pieces
        .par_iter()
        .map(|&(i, offset)| hash_piece(&dir.join(&files[i].0), offset, files[i].1))
        .collect::<io::Result<Vec<_>>>()?;
    let mut out = format!("{HEADER}\n");
    for (i, (name, len)) in files.iter().enumerate() {
        let mut h = blake3::Hasher::new();
        for (_, piece) in pieces.iter().zip(&hashes).filter(|((f, _), _)| *f == i) {
            h.update(piece.as_bytes());
        }
        out.push_str(&format!("{} {len} {name}\n", h.finalize().to_hex()));
    }
    Ok(out)
}

/// The hash of `[offset, offset + SEGMENT)` of the file at `path` whose
/// length was `len`; a file that grew or shrank since fails.
fn hash_piece(path: &Path, offset: u64, len: u64) -> io::Result<blake3::Hash> {
    let f = File::open(path)?;
    if f.metadata()?.len() != len {
        return Err(io::Error::other(format!(
            "{} changed size while hashed",
            path.display()
        )));
    }
    let end = (offset + SEGMENT).min(len);
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = offset;
    while at < end {
        let want = ((end - at) as usize).min(buf.len());
        let n = f.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(io::Error::other(format!("{} ended early while hashed", path.display())));
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.finalize())
}

/// Records `seal` for the image directory `image` (written whole, then
/// renamed into place).
pub fn write(image: &Path, seal: &str) -> io::Result<()> {
    let path = path_of(image);
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, seal)?;
    fs::rename(&tmp, &path)
}

/// The seal recorded for `image`, if any, and if it is one this version
/// reads.
pub fn recorded(image: &Path) -> Option<String> {
    fs::read_to_string(path_of(image))
        .ok()
        .filter(|s| s.lines().next() == Some(HEADER))
}

/// Why the image at `image` cannot be used as it is, or `None` when its
/// files are those sealed.
pub fn check(image: &Path) -> Option<String> {
    let Some(recorded) = recorded(image) else {
        return Some(format!("it has no seal at {}", path_of(image).display()));
    };
    match compute(image) {
        Ok(now) if now == recorded => None,
        Ok(now) => {
            let changed: Vec<&str> = now
                .lines()
                .skip(1)
                .filter(|l| !recorded.lines().any(|r| r == *l))
                .filter_map(|l| l.splitn(3, ' ').nth(2))
                .collect();
            let gone: Vec<&str> = recorded
                .lines()
                .skip(1)
                .filter_map(|l| l.splitn(3, ' ').nth(2))
                .filter(|name| !now.lines().skip(1).any(|l| l.splitn(3, ' ').nth(2) == Some(name)))
                .collect();
            let mut parts = Vec::new();
            if !changed.is_empty() {
                parts.push(format!("changed since it was sealed: {}", changed.join(", ")));
            }
            if !gone.is_empty() {
                parts.push(format!("gone: {}", gone.join(", ")));
            }
            Some(parts.join("; "))
        }
        Err(e) => Some(format!("cannot read it: {e}")),
    }
}

impl Engine {
    /// Keeps the image the driver wrote for snapshot `snap`, sealed, for
    /// restores on this host; without it a restore rebuilds the image from
    /// the store. Best effort: a snapshot is whole without it.
    pub(crate) fn keep_memory_image(&self, snap: &str, image: ScratchDir) {
        let root = self.home.memory_images();
        let cache = self.home.memory_image(snap);
        if fs::create_dir_all(&root).is_err() || cache.exists() {
            return;
        }
        let t = Instant::now();
        let kept = (|| {
            // Memory holds whatever the sandbox held: root's alone.
            fs::set_permissions(&root, fs::Permissions::from_mode(0o700))?;
            fs::set_permissions(image.path(), fs::Permissions::from_mode(0o700))?;
            let seal = compute(image.path())?;
            image.persist(&cache)?;
            write(&cache, &seal)
        })();
        match kept {
            Ok(()) => tracing::debug!(
                "sealed the memory image of {} in {:?}",
                &snap[..12.min(snap.len())],
                t.elapsed()
            ),
            Err(e) => {
                tracing::warn!(
                    "cannot keep the memory image of snapshot {snap} at {}: {e}; restores rebuild it from the store",
                    cache.display()
                );
                let _ = fs::remove_dir_all(&cache);
            }
        }
    }

    /// Gives snapshot `to` the local image of `from` (hard links: the same
    /// files) and its seal.
    pub(crate) fn link_memory_image(&self, from: &str, to: &str) {
        let (from, to) = (self.home.memory_image(from), self.home.memory_image(to));
        let Some(seal) = recorded(&from) else {
            return;
        };
        let linked = (|| {
            fs::create_dir(&to)?;
            fs::set_permissions(&to, fs::Permissions::from_mode(0o700))?;
            for e in fs::read_dir(&from)? {
                let e = e?;
                fs::hard_link(e.path(), to.join(e.file_name()))?;
            }
            write(&to, &seal)
        })();
        if linked.is_err() {
            let _ = fs::remove_dir_all(&to);
        }
    }

    /// The local image of snapshot `snap` when it holds every file of
    /// `memory` and they are the files sealed when it was kept. An image
    /// changed since (or unsealed) is set aside as `.changed-<id>-<time>`
    /// for inspection, and the restore rebuilds it from the store.
    pub(crate) fn cached_memory_image(&self, snap: &str, memory: &MemoryImage) -> Option<PathBuf> {
        let cached = self.home.memory_image(snap);
        if !cached.is_dir() {
            return None;
        }
        let t = Instant::now();
        let why = if memory
            .files
            .iter()
            .all(|f| fs::symlink_metadata(cached.join(&f.name)).is_ok_and(|m| m.is_file() && m.len() > 0))
        {
            check(&cached)
        } else {
            Some("it lacks files the snapshot's image has".to_string())
        };
        let Some(why) = why else {
            tracing::debug!(
                "checked the memory image of {} in {:?}",
                &snap[..12.min(snap.len())],
                t.elapsed()
            );
            return Some(cached);
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let aside = self.home.memory_images().join(format!(".changed-{snap}-{nanos}"));
        // Another restore may have set it aside first.
        if fs::rename(&cached, &aside).is_ok() {
            // Its seal goes inside, to show what changed.
            let _ = fs::rename(path_of(&cached), aside.join(".seal"));
            tracing::warn!(
                snapshot = %snap,
                aside = %aside.display(),
                "the local memory image of snapshot {snap} cannot be used: {why}; it is set aside and the image rebuilt from the store"
            );
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_byte_or_a_missing_file_breaks_the_seal() {
        let root = tempfile::tempdir().unwrap();
        let image = root.path().join("snap");
        fs::create_dir(&image).unwrap();
        fs::write(image.join("checkpoint.img"), vec![7u8; 3 << 20]).unwrap();
        fs::write(image.join("pages.img"), b"pages").unwrap();
        fs::write(image.join("empty.img"), b"").unwrap();
        write(&image, &compute(&image).unwrap()).unwrap();
        assert_eq!(check(&image), None);

        let f = fs::OpenOptions::new()
            .write(true)
            .open(image.join("checkpoint.img"))
            .unwrap();
        f.write_all_at(&[8], 2 << 20).unwrap();
        let why = check(&image).unwrap();
        assert!(why.contains("checkpoint.img") && !why.contains("pages.img"), "{why}");
        f.write_all_at(&[7], 2 << 20).unwrap();
        assert_eq!(check(&image), None, "the same bytes seal the same");

        fs::remove_file(image.join("pages.img")).unwrap();
        assert!(check(&image).unwrap().contains("gone: pages.img"));
        fs::remove_file(path_of(&image)).unwrap();
        assert!(check(&image).unwrap().contains("no seal"));
    }

    #[test]
    fn a_file_is_hashed_in_pieces_the_same_way_every_time() {
        let root = tempfile::tempdir().unwrap();
        let image = root.path().join("snap");
        fs::create_dir(&image).unwrap();
        // Two pieces and a bit: the last piece is short.
        let bytes: Vec<u8> = (0..(2 * SEGMENT + 5)).map(|i| (i % 251) as u8).collect();
        fs::write(image.join("pages.img"), &bytes).unwrap();
        let seal = compute(&image).unwrap();
        assert_eq!(seal, compute(&image).unwrap());
        let mut pieces = blake3::Hasher::new();
        for piece in bytes.chunks(SEGMENT as usize) {
            pieces.update(blake3::hash(piece).as_bytes());
        }
        assert_eq!(
            seal,
            format!("{HEADER}\n{} {} pages.img\n", pieces.finalize().to_hex(), bytes.len())
        );
    }
}
