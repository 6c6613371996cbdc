//! The capture baseline: what one capture saw of every path of an upper
//! directory, in the capture's own order (depth-first pre-order, siblings
//! by name bytes), so the next capture reads it alongside its walk instead
//! of holding it in memory.
//!
//! A local file, never in the store:
//!
//! ```text
//! "CAIRNBSL" u32 LE version (3)
//! zstd stream of:  { u32 LE length, bincode (path bytes, Seen) }*
//!                  u32 LE 0, u64 LE record count, BLAKE3 of every record's bytes
//! ```
//!
//! A baseline that fails any check (older version, torn, edited) is not
//! used: the capture then records the whole upper directory.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::capture::Seen;
use super::index::LayerPath;

const MAGIC: &[u8; 8] = b"CAIRNBSL";
const VERSION: u32 = 3;
/// The longest record a reader accepts (a path of up to 256 components of
/// 255 bytes, with room to spare).
const MAX_RECORD: u32 = 1 << 20;

#[derive(Serialize, Deserialize)]
struct Record {
    #[serde(with = "serde_bytes")]
    path: Vec<u8>,
    seen: Seen,
}

fn bincode_options() -> impl bincode::Options {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_varint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
        .with_limit(u64::from(MAX_RECORD))
}

/// A baseline on disk; deleted when dropped unless [`Baseline::persist`]ed.
#[derive(Debug)]
pub struct Baseline {
    path: PathBuf,
    records: u64,
    owned: bool,
}

impl Baseline {
    /// Opens and checks the baseline at `path` (one streaming pass).
    pub fn open(path: &Path) -> Result<Baseline, String> {
        let mut reader = Reader::open(path)?;
        let mut hasher = blake3::Hasher::new();
        let mut count = 0u64;
        while reader.next_raw(&mut hasher)?.is_some() {
            count += 1;
        }
        reader.finish(hasher, count)?;
        Ok(Baseline {
            path: path.to_path_buf(),
            records: count,
            owned: false,
        })
    }

    /// How many paths the capture saw.
    pub fn len(&self) -> u64 {
        self.records
    }

    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Moves the baseline to `to` (same filesystem), where it stays.
    pub fn persist(mut self, to: &Path) -> io::Result<()> {
        std::fs::rename(&self.path, to)?;
        self.path = to.to_path_buf();
        self.owned = false;
        Ok(())
    }

    pub(super) fn cursor(&self) -> Result<Cursor, String> {
        Ok(Cursor {
            reader: Reader::open(&self.path)?,
            next: None,
            done: false,
        })
    }
}

impl Drop for Baseline {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

struct Reader {
    input: zstd::stream::read::Decoder<'static, BufReader<File>>,
    buf: Vec<u8>,
    path: PathBuf,
}

impl Reader {
    fn open(path: &Path) -> Result<Reader, String> {
        let bad = |why: String| format!("capture baseline {}: {why}", path.display());
        let mut file = File::open(path).map_err(|e| bad(e.to_string()))?;
        let mut head = [0u8; 12];
        file.read_exact(&mut head)
            .map_err(|e| bad(format!("reading its header: {e}")))?;
        if &head[..8] != MAGIC {
            return Err(bad("it is not a capture baseline".into()));
        }
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!(
                "it has format version {version}; this Cairn reads {VERSION}"
            )));
        }
        let mut input = zstd::stream::read::Decoder::new(file).map_err(|e| bad(e.to_string()))?;
        // Writers use level 1 (a 512 KiB window); a frame asking for more
        // than 8 MiB is not one of ours.
        input.window_log_max(23).map_err(|e| bad(e.to_string()))?;
        Ok(Reader {
            input,
            buf: Vec::new(),
            path: path.to_path_buf(),
        })
    }

    fn bad(&self, why: impl std::fmt::Display) -> String {
        format!("capture baseline {}: {why}", self.path.display())
    }

    /// The next record's bytes, fed to `hasher`; `None` at the end marker.
    fn next_raw(&mut self, hasher: &mut blake3::Hasher) -> Result<Option<&[u8]>, String> {
        let mut len = [0u8; 4];
        self.input
            .read_exact(&mut len)
            .map_err(|e| self.bad(format!("it is cut short: {e}")))?;
        let n = u32::from_le_bytes(len);
        if n == 0 {
            return Ok(None);
        }
        if n > MAX_RECORD {
            return Err(self.bad(format!("a record of {n} bytes is over the {MAX_RECORD} allowed")));
        }
        self.buf.resize(n as usize, 0);
        self.input
            .read_exact(&mut self.buf)
            .map_err(|e| self.bad(format!("it is cut short: {e}")))?;
        hasher.update(&len);
        hasher.update(&self.buf);
        Ok(Some(&self.buf))
    }

    fn finish(mut self, hasher: blake3::Hasher, count: u64) -> Result<(), String> {
        let mut tail = [0u8; 40];
        self.input
            .read_exact(&mut tail)
            .map_err(|e| self.bad(format!("its trailer is cut short: {e}")))?;
        if u64::from_le_bytes(tail[..8].try_into().expect("8 bytes")) != count {
            return Err(self.bad("its record count does not match"));
        }
        if tail[8..] != *hasher.finalize().as_bytes() {
            return Err(self.bad("its checksum does not match"));
        }
        let mut rest = [0u8; 1];
        match self.input.read(&mut rest) {
            Ok(0) => Ok(()),
            _ => Err(self.bad("it has bytes after its trailer")),
        }
    }
}

/// Reads a baseline's records in order, one ahead.
pub(super) struct Cursor {
    reader: Reader,
    next: Option<(LayerPath, Seen)>,
    done: bool,
}

impl Cursor {
    fn fill(&mut self) -> Result<(), String> {
        if self.next.is_some() || self.done {
            return Ok(());
        }
        let mut ignore = blake3::Hasher::new();
        match self.reader.next_raw(&mut ignore)? {
            None => self.done = true,
            Some(bytes) => {
                use bincode::Options;
                let r: Record = bincode_options()
                    .deserialize(bytes)
                    .map_err(|e| format!("capture baseline: a record does not decode: {e}"))?;
                self.next = Some((LayerPath::from_bytes(&r.path), r.seen));
            }
        }
        Ok(())
    }

    /// The next record, without taking it.
    pub(super) fn peek(&mut self) -> Result<Option<&(LayerPath, Seen)>, String> {
        self.fill()?;
        Ok(self.next.as_ref())
    }

    pub(super) fn take(&mut self) -> Result<Option<(LayerPath, Seen)>, String> {
        self.fill()?;
        Ok(self.next.take())
    }
}

/// Writes a baseline record by record into a temp file.
pub(super) struct Writer {
    out: Option<zstd::stream::write::Encoder<'static, BufWriter<File>>>,
    hasher: blake3::Hasher,
    count: u64,
    path: PathBuf,
    buf: Vec<u8>,
}

impl Writer {
    /// A new baseline file in `dir` (on the filesystem it will be kept on).
    pub(super) fn create(dir: &Path) -> io::Result<Writer> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = dir.join(format!(".baseline-{}-{nanos}.partial", std::process::id()));
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&path)?;
        let mut out = BufWriter::new(file);
        out.write_all(MAGIC)?;
        out.write_all(&VERSION.to_le_bytes())?;
        let out = zstd::stream::write::Encoder::new(out, 1)?;
        Ok(Writer {
            out: Some(out),
            hasher: blake3::Hasher::new(),
            count: 0,
            path,
            buf: Vec::new(),
        })
    }

    pub(super) fn push(&mut self, path: &LayerPath, seen: &Seen) -> io::Result<()> {
        use bincode::Options;
        self.buf.clear();
        bincode_options()
            .serialize_into(
                &mut self.buf,
                &Record {
                    path: path.as_bytes().to_vec(),
                    seen: *seen,
                },
            )
            .map_err(io::Error::other)?;
        let len = (self.buf.len() as u32).to_le_bytes();
        self.hasher.update(&len);
        self.hasher.update(&self.buf);
        let out = self.out.as_mut().expect("taken only by finish");
        out.write_all(&len)?;
        out.write_all(&self.buf)?;
        self.count += 1;
        Ok(())
    }

    pub(super) fn finish(mut self) -> io::Result<Baseline> {
        let mut out = self.out.take().expect("taken only by finish");
        out.write_all(&0u32.to_le_bytes())?;
        out.write_all(&self.count.to_le_bytes())?;
        out.write_all(self.hasher.finalize().as_bytes())?;
        let inner = out.finish()?;
        inner.into_inner().map_err(|e| e.into_error())?;
        Ok(Baseline {
            path: std::mem::take(&mut self.path),
            records: self.count,
            owned: true,
        })
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // A writer dropped before `finish` leaves no file behind.
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
