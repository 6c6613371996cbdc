//! Memory images kept on this host (`$CAIRN_HOME/memory/<snapshot>/`, root's
//! alone), as the driver wrote them, so a restore here reads them directly,
//! and their seals (`memory/.seal-<snapshot>`), checked before each restore
//! that would use the image.
//!
//! A seal says what each file's bytes are: for a file the snapshot stores
//! as written (a gVisor `pages.img`, most of the image), the stored content
//! itself, whose chunks name their BLAKE3 hashes, so sealing it reads
//! nothing; for the rest (small state files, stored inflated), the BLAKE3 of
//! the file, hashed in [`SEGMENT`]-byte pieces on every core. It also says
//! which boot wrote it and each file's inode and modification time. In the
//! boot that sealed it, a file with the same inode, size and modification
//! time is the file sealed, and nothing is read: only root can write it, a
//! write moves its modification time, and the page cache holds what was
//! written. After a reboot (an unsynced copy may be torn by a crash) every
//! byte is checked: the pieces hashed again, the stored content's chunks
//! compared with the file's bytes on every core, and the seal is renewed
//! for the new boot. Files are hard links shared between snapshots (a
//! flattened snapshot links its parent's), so a link's count and change
//! time are not part of the seal; its inode and modification time are.
//!
//! The format, one line each: `cairn-memory-seal 2`, `boot <boot id>`, then
//! per file `<hash or -> <size> <inode> <mtime ns> <name>`, sorted by name
//! (see `docs/formats.md`).

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use crate::images::ScratchDir;
use crate::memory_image::{MemoryForm, MemoryImage};
use crate::Engine;

/// The first line of a seal; another version is not understood, so the
/// image it seals is rebuilt from the store.
const HEADER: &str = "cairn-memory-seal 2";

/// How much of a file one core hashes at a time.
const SEGMENT: u64 = 32 << 20;

/// Where the seal of the image directory `image` is kept: beside it, as
/// a layer's is.
pub use cairn_layers::seal::path_of;

/// This boot's identity (the kernel's random boot id).
pub(crate) fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// One file as a seal records it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sealed {
    name: String,
    /// The file's hash, or `None` for a file that is the snapshot's stored
    /// content.
    hash: Option<String>,
    size: u64,
    inode: u64,
    mtime_ns: i128,
}

/// A parsed seal.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seal {
    boot: String,
    files: Vec<Sealed>,
}

impl Seal {
    fn render(&self) -> String {
        let mut out = format!("{HEADER}\nboot {}\n", self.boot);
        for f in &self.files {
            out.push_str(&format!(
                "{} {} {} {} {}\n",
                f.hash.as_deref().unwrap_or("-"),
                f.size,
                f.inode,
                f.mtime_ns,
                f.name
            ));
        }
        out
    }

    fn parse(text: &str) -> Option<Seal> {
        let mut lines = text.lines();
        if lines.next() != Some(HEADER) {
            return None;
        }
        let boot = lines.next()?.strip_prefix("boot ")?.to_string();
        let files = lines
            .map(|l| {
                let mut parts = l.splitn(5, ' ');
                let hash = parts.next()?;
                let size = parts.next()?.parse().ok()?;
                let inode = parts.next()?.parse().ok()?;
                let mtime_ns = parts.next()?.parse().ok()?;
                let name = parts.next()?.to_string();
                let hash = (hash != "-").then(|| hash.to_string());
                Some(Sealed {
                    name,
                    hash,
                    size,
                    inode,
                    mtime_ns,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Seal { boot, files })
    }
}

/// The regular files of `dir` as they are now, sorted by name, with no
/// hash yet (anything else in it, a directory or a link, is refused: runsc
/// writes none).
fn files_of(dir: &Path) -> io::Result<Vec<Sealed>> {
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
        files.push(Sealed {
            name,
            hash: None,
            size: md.len(),
            inode: md.ino(),
            mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
        });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(files)
}

/// The stored content of file `name` of `memory` when the snapshot keeps
/// its bytes as written and as long as `size`: then those are the bytes a
/// seal can name without hashing them.
fn as_written<'a>(memory: &'a MemoryImage, name: &str, size: u64) -> Option<&'a cairn_store::FileContent> {
    memory
        .files
        .iter()
        .find(|f| f.name == name && f.form == MemoryForm::AsWritten && f.content.size == size)
        .map(|f| &f.content)
}

/// The seal of the regular files in `dir`, as written by snapshot `memory`
/// in boot `boot`: files stored as written are named by their content,
/// the rest hashed.
fn compute(dir: &Path, memory: &MemoryImage, boot: &str) -> io::Result<Seal> {
    let mut files = files_of(dir)?;
    let hashed: Vec<usize> = (0..files.len())
        .filter(|&i| as_written(memory, &files[i].name, files[i].size).is_none())
        .collect();
    let hashes = hashed
        .iter()
        .map(|&i| hash_file(&dir.join(&files[i].name), files[i].size))
        .collect::<io::Result<Vec<_>>>()?;
    for (i, h) in hashed.into_iter().zip(hashes) {
        files[i].hash = Some(h);
    }
    Ok(Seal {
        boot: boot.to_string(),
        files,
    })
}

/// The hex BLAKE3 of the BLAKE3 hashes of a file's [`SEGMENT`]-byte pieces,
/// hashed on every core.
fn hash_file(path: &Path, len: u64) -> io::Result<String> {
    let pieces: Vec<u64> = (0..len.div_ceil(SEGMENT).max(1)).map(|s| s * SEGMENT).collect();
    let hashes = pieces
        .par_iter()
        .map(|&offset| hash_piece(path, offset, len))
        .collect::<io::Result<Vec<_>>>()?;
    let mut h = blake3::Hasher::new();
    for piece in &hashes {
        h.update(piece.as_bytes());
    }
    Ok(h.finalize().to_hex().to_string())
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

/// Whether the file at `path` holds exactly `content`: every chunk's bytes
/// hash to the chunk's hash and the bytes between chunks are zeros; checked
/// on every core.
fn matches_content(path: &Path, content: &cairn_store::FileContent) -> io::Result<bool> {
    let f = File::open(path)?;
    if f.metadata()?.len() != content.size {
        return Ok(false);
    }
    // The ranges to check: each chunk, and each gap (zeros).
    let mut ranges = Vec::with_capacity(content.chunks.len() * 2 + 1);
    let mut end = 0u64;
    for c in &content.chunks {
        if c.offset > end {
            ranges.push((end, c.offset - end, None));
        }
        ranges.push((c.offset, c.len as u64, Some(c.hash)));
        end = c.offset + c.len as u64;
    }
    if content.size > end {
        ranges.push((end, content.size - end, None));
    }
    let bad = ranges
        .par_iter()
        .map_init(Vec::new, |buf: &mut Vec<u8>, &(offset, len, hash)| {
            let mut at = 0u64;
            let mut hasher = blake3::Hasher::new();
            while at < len {
                let want = (len - at).min(1 << 20) as usize;
                buf.resize(want, 0);
                f.read_exact_at(buf, offset + at)?;
                match hash {
                    Some(_) => {
                        hasher.update(buf);
                    }
                    None if buf.iter().any(|&b| b != 0) => return Ok(true),
                    None => {}
                }
                at += want as u64;
            }
            Ok(hash.is_some_and(|h| *hasher.finalize().as_bytes() != *h.as_bytes()))
        });
    let bad: Vec<bool> = bad.collect::<io::Result<_>>()?;
    Ok(!bad.into_iter().any(|b| b))
}

/// Records `seal` for the image directory `image` (written whole, then
/// renamed into place).
fn write(image: &Path, seal: &Seal) -> io::Result<()> {
    let path = path_of(image);
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, seal.render())?;
    fs::rename(&tmp, &path)
}

/// The seal recorded for `image`, if any, and if it is one this version
/// reads.
fn recorded(image: &Path) -> Option<Seal> {
    fs::read_to_string(path_of(image)).ok().and_then(|s| Seal::parse(&s))
}

/// Why the image at `image`, kept for snapshot `memory`, cannot be used as
/// it is, or `None` when its files are those sealed (see the module's
/// documentation for what is read; `boot` is this boot's id). An image
/// checked in full in another boot than its seal's is sealed again for
/// this one.
fn check(image: &Path, memory: &MemoryImage, boot: &str) -> Option<String> {
    let Some(sealed) = recorded(image) else {
        return Some(format!(
            "it has no seal this version reads at {}",
            path_of(image).display()
        ));
    };
    let now = match files_of(image) {
        Ok(f) => f,
        Err(e) => return Some(format!("cannot read it: {e}")),
    };
    let name = |f: &Sealed| f.name.clone();
    let gone: Vec<String> = sealed
        .files
        .iter()
        .filter(|s| !now.iter().any(|n| n.name == s.name))
        .map(name)
        .collect();
    let added: Vec<String> = now
        .iter()
        .filter(|n| !sealed.files.iter().any(|s| s.name == n.name))
        .map(name)
        .collect();
    let same_boot = !boot.is_empty() && sealed.boot == boot;
    let mut changed = Vec::new();
    for s in &sealed.files {
        let Some(n) = now.iter().find(|n| n.name == s.name) else {
            continue;
        };
        let path = image.join(&s.name);
        let same = if n.size != s.size {
            false
        } else if same_boot {
            n.inode == s.inode && n.mtime_ns == s.mtime_ns
        } else {
            match &s.hash {
                Some(h) => hash_file(&path, s.size).is_ok_and(|now| now == *h),
                None => as_written(memory, &s.name, s.size).is_some_and(|c| matches_content(&path, c).unwrap_or(false)),
            }
        };
        if !same {
            changed.push(s.name.clone());
        }
    }
    let mut parts = Vec::new();
    if !changed.is_empty() {
        parts.push(format!("changed since it was sealed: {}", changed.join(", ")));
    }
    if !gone.is_empty() {
        parts.push(format!("gone: {}", gone.join(", ")));
    }
    if !added.is_empty() {
        parts.push(format!("not sealed: {}", added.join(", ")));
    }
    if !parts.is_empty() {
        return Some(parts.join("; "));
    }
    if !same_boot {
        // Checked byte for byte: sealed again for this boot, with the
        // files as they are (their hashes unchanged).
        let renewed = Seal {
            boot: boot.to_string(),
            files: sealed
                .files
                .iter()
                .zip(&now)
                .map(|(s, n)| Sealed {
                    hash: s.hash.clone(),
                    ..n.clone()
                })
                .collect(),
        };
        if let Err(e) = write(image, &renewed) {
            tracing::debug!("cannot renew the seal of {}: {e}", image.display());
        }
    }
    None
}

impl Engine {
    /// Keeps the image the driver wrote for snapshot `snap`, sealed, for
    /// restores on this host; without it a restore rebuilds the image from
    /// the store. Best effort: a snapshot is whole without it.
    pub(crate) fn keep_memory_image(&self, snap: &str, image: ScratchDir, memory: &MemoryImage) {
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
            let seal = compute(image.path(), memory, &boot_id())?;
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

    /// Removes the local image of snapshot `id`, if there is one; a
    /// restore of it rebuilds the image from the store. One a restore has
    /// linked stays with that restore until it is done. A sandbox's next
    /// memory snapshot drops its previous one's before runsc writes, so a
    /// sandbox keeps the image of its newest memory snapshot only: one
    /// image's room per sandbox, not one per snapshot.
    pub(crate) fn drop_memory_image(&self, id: &str) {
        let image = self.home.memory_image(id);
        if !image.exists() {
            return;
        }
        // The seal first: an image without one is never used. Renamed, then
        // removed beside what follows (unlinking half a gigabyte and its
        // cached pages takes a while); one left behind by a process that
        // ended first is an unknown name, which gc removes.
        let _ = fs::remove_file(path_of(&image));
        let nanos = crate::now_nanos();
        let gone = self.home.memory_images().join(format!(".retired-{id}-{nanos}"));
        if fs::rename(&image, &gone).is_ok() {
            std::thread::spawn(move || {
                if let Err(e) = fs::remove_dir_all(&gone) {
                    tracing::debug!("cannot remove {}: {e}; gc removes it", gone.display());
                }
            });
        }
    }

    /// A scratch directory of hard links to the checked local image
    /// `cached`, which a restore reads: the image may be retired or
    /// removed meanwhile without the restore losing its files. `None`
    /// (rebuild from the store) when it cannot be linked.
    pub(crate) fn linked_memory_image(&self, cached: &Path) -> Option<ScratchDir> {
        let linked = (|| {
            let scratch = ScratchDir::new(&self.home.scratch())?;
            fs::set_permissions(scratch.path(), fs::Permissions::from_mode(0o700))?;
            for e in fs::read_dir(cached)? {
                let e = e?;
                fs::hard_link(e.path(), scratch.path().join(e.file_name()))?;
            }
            Ok::<_, io::Error>(scratch)
        })();
        linked
            .map_err(|e| tracing::debug!("cannot link the memory image {}: {e}", cached.display()))
            .ok()
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
            check(&cached, memory, &boot_id())
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
        let nanos = crate::now_nanos();
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
    use crate::memory_image::MemoryFile;
    use cairn_store::{ChunkHash, ChunkRef, FileContent};

    /// A snapshot's image whose `pages.img` is stored as written, in chunks
    /// of 1 MiB with a hole (zeros) between the first two, and whose
    /// `checkpoint.img` is stored inflated (so only its hash can seal it).
    fn image_of(pages: &[u8]) -> MemoryImage {
        let mut chunks = Vec::new();
        let mut offset = 0u64;
        for (i, piece) in pages.chunks(1 << 20).enumerate() {
            if i != 1 {
                chunks.push(ChunkRef {
                    offset,
                    len: piece.len() as u32,
                    hash: ChunkHash::of(piece),
                });
            }
            offset += piece.len() as u64;
        }
        MemoryImage {
            driver: "gvisor".into(),
            host: None,
            files: vec![
                MemoryFile {
                    name: "checkpoint.img".into(),
                    form: MemoryForm::GvisorStateStream { header: Vec::new() },
                    content: FileContent::default(),
                },
                MemoryFile {
                    name: "pages.img".into(),
                    form: MemoryForm::AsWritten,
                    content: FileContent {
                        size: pages.len() as u64,
                        chunks,
                    },
                },
            ],
        }
    }

    /// A kept image directory (`snap` under a temporary root): a 3 MiB
    /// `checkpoint.img` and the pages of [`pages`], with its snapshot's
    /// record of them.
    fn kept_image() -> (tempfile::TempDir, PathBuf, Vec<u8>, MemoryImage) {
        let root = tempfile::tempdir().unwrap();
        let image = root.path().join("snap");
        fs::create_dir(&image).unwrap();
        fs::write(image.join("checkpoint.img"), vec![7u8; 3 << 20]).unwrap();
        let pages = pages();
        fs::write(image.join("pages.img"), &pages).unwrap();
        let memory = image_of(&pages);
        (root, image, pages, memory)
    }

    fn pages() -> Vec<u8> {
        let mut pages: Vec<u8> = (0..(3u32 << 20) + 5).map(|i| (i % 251) as u8).collect();
        pages[1 << 20..2 << 20].fill(0);
        pages
    }

    /// Sets a file's modification time back to what it was, as a writer
    /// hiding a change would.
    fn set_mtime(path: &Path, ns: i128) {
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns as u64);
        fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(time)
            .unwrap();
    }

    #[test]
    fn a_seal_names_stored_pages_by_their_content_and_hashes_the_rest() {
        let (root, image, pages, memory) = kept_image();
        let seal = compute(&image, &memory, "boot-a").unwrap();
        let rendered = seal.render();
        let lines: Vec<&str> = rendered.lines().collect();
        assert_eq!(lines[..2], [HEADER, "boot boot-a"]);
        assert!(lines[2].starts_with(&format!(
            "{} {} ",
            hash_file(&image.join("checkpoint.img"), 3 << 20).unwrap(),
            3 << 20
        )));
        assert!(lines[2].ends_with(" checkpoint.img"), "{}", lines[2]);
        assert!(lines[3].starts_with(&format!("- {} ", pages.len())) && lines[3].ends_with(" pages.img"));
        assert_eq!(Seal::parse(&seal.render()), Some(seal.clone()));
        // A file of another size than the stored one is hashed instead.
        let mut shorter = memory.clone();
        shorter.files[1].content.size -= 1;
        assert!(compute(&image, &shorter, "boot-a").unwrap().files[1].hash.is_some());

        // A file hashed in pieces: two pieces and a bit, the last short.
        let big: Vec<u8> = (0..(2 * SEGMENT + 5)).map(|i| (i % 251) as u8).collect();
        fs::write(root.path().join("big"), &big).unwrap();
        let mut pieces = blake3::Hasher::new();
        for piece in big.chunks(SEGMENT as usize) {
            pieces.update(blake3::hash(piece).as_bytes());
        }
        assert_eq!(
            hash_file(&root.path().join("big"), big.len() as u64).unwrap(),
            pieces.finalize().to_hex().to_string()
        );
    }

    #[test]
    fn after_a_reboot_every_byte_is_checked_and_in_the_same_boot_a_write_is_seen() {
        let (_root, image, _, memory) = kept_image();
        let seal = compute(&image, &memory, "boot-a").unwrap();
        write(&image, &seal).unwrap();
        assert_eq!(check(&image, &memory, "boot-a"), None);
        // Another boot checks the bytes, finds them whole and seals them
        // for itself.
        assert_eq!(check(&image, &memory, "boot-b"), None);
        assert_eq!(recorded(&image).unwrap().boot, "boot-b");
        assert_eq!(recorded(&image).unwrap().files, seal.files);

        // A byte changed in a stored chunk, in a hole and in a hashed file,
        // each with its modification time set back: another boot finds it.
        for (name, at, value) in [
            ("pages.img", (2u64 << 20) + 9, 1u8),
            ("pages.img", (1 << 20) + 3, 1),
            ("checkpoint.img", 2 << 20, 8),
        ] {
            let path = image.join(name);
            let f = fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
            let mut was = [0u8];
            f.read_exact_at(&mut was, at).unwrap();
            f.write_all_at(&[value], at).unwrap();
            let mtime = seal.files.iter().find(|s| s.name == name).unwrap().mtime_ns;
            set_mtime(&path, mtime);
            let why = check(&image, &memory, "boot-c").unwrap();
            assert!(
                why.contains(name) && why.contains("changed since it was sealed"),
                "{why}"
            );
            // In the boot that sealed it, the same write with its time moved
            // is seen without reading.
            set_mtime(&path, mtime + 1);
            let why = check(&image, &memory, "boot-b").unwrap();
            assert!(why.contains(name), "{why}");
            f.write_all_at(&was, at).unwrap();
            set_mtime(&path, mtime);
            assert_eq!(check(&image, &memory, "boot-b"), None, "{name} is whole again");
        }

        // A file gone, one added, no seal.
        fs::write(image.join("extra.img"), b"x").unwrap();
        assert!(check(&image, &memory, "boot-b")
            .unwrap()
            .contains("not sealed: extra.img"));
        fs::remove_file(image.join("extra.img")).unwrap();
        fs::remove_file(image.join("pages.img")).unwrap();
        assert!(check(&image, &memory, "boot-b").unwrap().contains("gone: pages.img"));
        fs::remove_file(path_of(&image)).unwrap();
        assert!(check(&image, &memory, "boot-b").unwrap().contains("no seal"));
    }
}
