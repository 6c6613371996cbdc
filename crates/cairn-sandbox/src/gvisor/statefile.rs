//! runsc's state file, unpacked for the chunk store and packed again for a
//! restore.
//!
//! runsc writes its checkpoint (`checkpoint.img`) as gVisor's state file:
//!
//! ```text
//! magic "gVisorSF" (8) | metadata length N (u64 BE) | metadata (N bytes of JSON)
//! | [HMAC-SHA256 of the above (32), in runsc releases before 2023]
//! | chunk size C (u32 BE) | { length L (u32 BE) | L bytes of raw DEFLATE }*
//! ```
//!
//! where every DEFLATE chunk inflates to C bytes of the state stream (the
//! last to at most C). Compressed that way, two checkpoints of one sandbox
//! share almost no bytes even when its memory barely changed: one changed
//! byte changes its whole 1 MiB chunk's output. Unpacked, the state stream
//! is the kernel's objects and memory pages as they are, and the chunk
//! store's content-defined chunks find what two checkpoints share.
//!
//! [`open_stream`] keeps the header (everything before the first chunk)
//! verbatim and reads the inflated stream, chunks inflated in parallel, so
//! it can be chunked into the store as it is inflated; [`unpack`] writes
//! the stream out; [`pack`] writes the header back and
//! re-frames the stream in stored (uncompressed) DEFLATE blocks, which runsc
//! reads at copying speed. A file in any other form (a keyed stream, an
//! uncompressed one from a newer runsc, a different file) is not unpacked;
//! the caller keeps it as it is.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};

use flate2::write::DeflateEncoder;
use flate2::{Compression, Decompress, FlushDecompress, Status};
use rayon::prelude::*;

const MAGIC: &[u8; 8] = b"gVisorSF";
const MAX_METADATA: u64 = 16 << 20;
const MAC_LEN: u64 = 32;
const MIN_CHUNK: u32 = 4 << 10;
const MAX_CHUNK: u32 = 64 << 20;

/// Unpacks the state file `image` into `raw` and returns its header, or
/// `None` (and nothing useful in `raw`) when `image` is not a state file
/// this module knows. I/O errors on either side are errors.
pub fn unpack(image: &mut File, raw: &mut File) -> io::Result<Option<Vec<u8>>> {
    let len = image.metadata()?.len();
    unpack_from(image, len, raw)
}

/// Where [`unpack_from`] writes the state stream. It starts again from
/// nothing when the file turns out not to be a state file after all.
pub trait StreamOut: Write {
    /// Discards everything written so far.
    fn restart(&mut self) -> io::Result<()>;
}

impl StreamOut for File {
    fn restart(&mut self) -> io::Result<()> {
        self.set_len(0)?;
        self.seek(SeekFrom::Start(0)).map(drop)
    }
}

impl StreamOut for Vec<u8> {
    fn restart(&mut self) -> io::Result<()> {
        self.clear();
        Ok(())
    }
}

/// [`unpack`] over any seekable input of `len` bytes. The input is hostile
/// (a sandbox's gVisor sentry wrote it): nothing is allocated for a length
/// it declares before that length is checked against the input and a cap
/// (16 MiB of metadata, chunks of 4 KiB to 64 MiB).
pub fn unpack_from<R: Read + Seek, W: StreamOut>(image: &mut R, len: u64, raw: &mut W) -> io::Result<Option<Vec<u8>>> {
    raw.restart()?;
    let Some((header, mut stream)) = open_stream(image, len)? else {
        return Ok(None);
    };
    loop {
        match stream.next_chunk() {
            Ok(Some(chunk)) => raw.write_all(&chunk)?,
            Ok(None) => break,
            Err(e) if is_not_unpackable(&e) => {
                raw.restart()?;
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    }
    raw.flush()?;
    Ok(Some(header))
}

/// A state file found not to be one this module can unpack, part-way
/// through (an error of kind `InvalidData` carrying this); the caller
/// keeps the file as written instead.
#[derive(Debug, thiserror::Error)]
#[error("{0}: the checkpoint image is not a gVisor state file Cairn can unpack")]
pub struct NotUnpackable(String);

/// Whether `e` is a [`StateStream`] finding its file not unpackable (as
/// opposed to failing to read it).
pub fn is_not_unpackable(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<NotUnpackable>())
}

fn not_unpackable(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, NotUnpackable(why))
}

/// Opens a state file for streaming: its header and a reader of its
/// inflated state stream, or `None` when the header or the first chunk is
/// not a layout this module knows (nothing else read). A later chunk that
/// does not inflate as it must ends the stream with an error for which
/// [`is_not_unpackable`] holds. Chunks are inflated several at a time on
/// rayon's pool, at most 16 MiB of them at once.
pub fn open_stream<R: Read + Seek>(mut image: R, len: u64) -> io::Result<Option<(Vec<u8>, StateStream<R>)>> {
    let Some(metadata_end) = metadata_end(&mut image, len)? else {
        return Ok(None);
    };
    // Releases before 2023 always follow the metadata with its MAC; later
    // ones only when keyed. The first chunk tells which layout this is.
    for mac in [MAC_LEN, 0] {
        let header_len = metadata_end + mac + 4;
        if header_len > len {
            continue;
        }
        image.seek(SeekFrom::Start(metadata_end + mac))?;
        let chunk_size = read_u32(&mut image)?;
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk_size) {
            continue;
        }
        image.seek(SeekFrom::Start(0))?;
        let mut header = vec![0; header_len as usize];
        image.read_exact(&mut header)?;
        let mut stream = StateStream {
            image,
            offset: header_len,
            len,
            chunk_size,
            ready: VecDeque::new(),
            pos: 0,
            short: false,
        };
        match stream.fill() {
            Ok(_) => return Ok(Some((header, stream))),
            Err(e) if is_not_unpackable(&e) => image = stream.image,
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// The inflated state stream of a state file (see [`open_stream`]).
pub struct StateStream<R> {
    image: R,
    /// Where the next chunk's length is, and the file's end.
    offset: u64,
    len: u64,
    chunk_size: u32,
    /// Inflated chunks not yet read, and how far into the first.
    ready: VecDeque<Vec<u8>>,
    pos: usize,
    /// A chunk shorter than the chunk size was seen: it must be the last.
    short: bool,
}

/// The most state stream inflated at once.
const INFLATE_AHEAD: usize = 16 << 20;

impl<R: Read> StateStream<R> {
    /// The next inflated chunk, `None` at the end.
    pub fn next_chunk(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.ready.is_empty() && !self.fill()? {
            return Ok(None);
        }
        self.pos = 0;
        Ok(self.ready.pop_front())
    }

    /// Reads and inflates the next chunks; false at the end of the file.
    fn fill(&mut self) -> io::Result<bool> {
        let chunk_size = self.chunk_size as usize;
        // DEFLATE's worst expansion is far below this; more is not ours.
        let max_compressed = (chunk_size + chunk_size / 8 + 1024) as u64;
        let most = (INFLATE_AHEAD / chunk_size).clamp(1, 2 * rayon::current_num_threads());
        let mut inputs = Vec::new();
        while inputs.len() < most && self.offset < self.len {
            let at = self.offset;
            if self.offset + 4 > self.len {
                return Err(not_unpackable(format!("a chunk length at offset {at} is cut short")));
            }
            let l = u64::from(read_u32(&mut self.image)?);
            self.offset += 4;
            if l > max_compressed || self.offset + l > self.len {
                return Err(not_unpackable(format!(
                    "the chunk at offset {at} declares {l} bytes, past the file or its chunk size"
                )));
            }
            let mut input = vec![0; l as usize];
            self.image.read_exact(&mut input)?;
            self.offset += l;
            inputs.push((at, input));
        }
        if inputs.is_empty() {
            return Ok(false);
        }
        let inflated: Vec<_> = if inputs.len() == 1 {
            vec![inflate(&inputs[0].1, chunk_size)]
        } else {
            inputs.par_iter().map(|(_, input)| inflate(input, chunk_size)).collect()
        };
        for ((at, _), chunk) in inputs.iter().zip(inflated) {
            let Some(chunk) = chunk else {
                return Err(not_unpackable(format!(
                    "the chunk at offset {at} is not DEFLATE data inflating to at most {chunk_size} bytes"
                )));
            };
            if self.short {
                return Err(not_unpackable(format!("the chunk at offset {at} follows a short one")));
            }
            self.short = chunk.len() < chunk_size;
            self.ready.push_back(chunk);
        }
        Ok(true)
    }
}

impl<R: Read> Read for StateStream<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(front) = self.ready.front() {
                if self.pos < front.len() {
                    let n = buf.len().min(front.len() - self.pos);
                    buf[..n].copy_from_slice(&front[self.pos..self.pos + n]);
                    self.pos += n;
                    return Ok(n);
                }
                self.ready.pop_front();
                self.pos = 0;
                continue;
            }
            if !self.fill()? {
                return Ok(0);
            }
        }
    }
}

/// Inflates one raw DEFLATE chunk that must fill `input` exactly and
/// produce between 1 and `chunk_size` bytes; `None` otherwise. Nothing is
/// allocated past `chunk_size` bytes, whatever the input says.
fn inflate(input: &[u8], chunk_size: usize) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(chunk_size);
    let mut d = Decompress::new(false);
    let mut status = d.decompress_vec(input, &mut out, FlushDecompress::Finish).ok()?;
    if status != Status::StreamEnd && out.len() == chunk_size {
        // Full: only the end of the stream may be left, no more bytes.
        let mut more = Vec::with_capacity(1);
        let rest = &input[usize::try_from(d.total_in()).ok()?..];
        status = d.decompress_vec(rest, &mut more, FlushDecompress::Finish).ok()?;
        if !more.is_empty() {
            return None;
        }
    }
    let whole = status == Status::StreamEnd && d.total_in() == input.len() as u64;
    (whole && !out.is_empty()).then_some(out)
}

/// Writes a state file runsc can restore from: `header` as [`unpack`]
/// returned it, then the stream from `raw` in stored DEFLATE chunks.
pub fn pack(header: &[u8], raw: &mut impl Read, out: &mut impl Write) -> io::Result<()> {
    if header.len() < 4 + 16 || &header[..8] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a gVisor state file header",
        ));
    }
    let chunk_size = u32::from_be_bytes(header[header.len() - 4..].try_into().expect("4 bytes"));
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk_size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("state file header names a chunk size of {chunk_size} bytes"),
        ));
    }
    let mut out = BufWriter::with_capacity(1 << 20, out);
    out.write_all(header)?;
    let mut chunk = vec![0; chunk_size as usize];
    let mut framed = Vec::with_capacity(chunk_size as usize + chunk_size as usize / 1024 + 64);
    loop {
        let n = read_full(raw, &mut chunk)?;
        if n == 0 {
            break;
        }
        framed.clear();
        let mut encoder = DeflateEncoder::new(&mut framed, Compression::none());
        encoder.write_all(&chunk[..n])?;
        encoder.finish()?;
        out.write_all(&(framed.len() as u32).to_be_bytes())?;
        out.write_all(&framed)?;
        if n < chunk.len() {
            break;
        }
    }
    out.flush()
}

/// The offset just past the metadata, if `image` starts like a state file.
fn metadata_end(image: &mut (impl Read + Seek), len: u64) -> io::Result<Option<u64>> {
    if len < 16 {
        return Ok(None);
    }
    image.seek(SeekFrom::Start(0))?;
    let mut start = [0; 16];
    image.read_exact(&mut start)?;
    if &start[..8] != MAGIC {
        return Ok(None);
    }
    let n = u64::from_be_bytes(start[8..].try_into().expect("8 bytes"));
    if n > MAX_METADATA || 16 + n > len {
        return Ok(None);
    }
    let mut json = vec![0; n as usize];
    image.read_exact(&mut json)?;
    let Ok(metadata) = serde_json::from_slice::<std::collections::BTreeMap<String, String>>(&json) else {
        return Ok(None);
    };
    // Newer releases name the compression; only DEFLATE chunks are ours.
    if metadata.get("compression").is_some_and(|c| c != "flate-best-speed") {
        return Ok(None);
    }
    Ok(Some(16 + n))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state file as runsc 2022 writes it: MAC after the metadata,
    /// DEFLATE chunks at level 1.
    fn state_file(stream: &[u8], chunk_size: u32, mac: bool) -> Vec<u8> {
        let mut f = Vec::new();
        let json = br#"{"_timestamp":"2026-11-30 03:37:45 +0000 UTC"}"#;
        f.extend_from_slice(MAGIC);
        f.extend_from_slice(&(json.len() as u64).to_be_bytes());
        f.extend_from_slice(json);
        if mac {
            f.extend_from_slice(&[0xAB; 32]);
        }
        f.extend_from_slice(&chunk_size.to_be_bytes());
        for piece in stream.chunks(chunk_size as usize) {
            let mut e = DeflateEncoder::new(Vec::new(), Compression::fast());
            e.write_all(piece).unwrap();
            let c = e.finish().unwrap();
            f.extend_from_slice(&(c.len() as u32).to_be_bytes());
            f.extend_from_slice(&c);
        }
        f
    }

    fn stream(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 / 13 % 251) as u8).collect()
    }

    fn file_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        f
    }

    fn unpacked(image: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
        let mut raw = tempfile::tempfile().unwrap();
        let header = unpack(&mut file_with(image), &mut raw).unwrap()?;
        raw.seek(SeekFrom::Start(0)).unwrap();
        let mut bytes = Vec::new();
        raw.read_to_end(&mut bytes).unwrap();
        Some((header, bytes))
    }

    #[test]
    fn unpack_then_pack_gives_the_same_stream_in_stored_chunks() {
        for (len, mac) in [
            (0, true),
            (1, true),
            (4096, true),
            (3 * 4096 + 17, true),
            (10_000, false),
        ] {
            let s = stream(len);
            let image = state_file(&s, 4096, mac);
            let (header, raw) = unpacked(&image).unwrap_or_else(|| panic!("len {len} mac {mac}"));
            assert_eq!(raw, s);
            assert_eq!(header, image[..header.len()]);
            let mut packed = Vec::new();
            pack(&header, &mut &raw[..], &mut packed).unwrap();
            assert_eq!(packed[..header.len()], header[..]);
            // Unpacking the packed file gives the stream once more.
            let (h2, raw2) = unpacked(&packed).unwrap();
            assert_eq!((h2, raw2), (header, s));
        }
    }

    #[test]
    fn other_files_are_left_alone() {
        assert!(unpacked(b"").is_none());
        assert!(unpacked(b"not a state file at all, just bytes").is_none());
        let mut image = state_file(&stream(9000), 4096, true);
        // A corrupted chunk is not ours to reinterpret.
        let n = image.len();
        image[n - 10] ^= 0xFF;
        image.truncate(n - 3);
        assert!(unpacked(&image).is_none());
        // A newer runsc's uncompressed stream.
        let json = br#"{"compression":"none"}"#;
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&(json.len() as u64).to_be_bytes());
        f.extend_from_slice(json);
        f.extend_from_slice(&4096u32.to_be_bytes());
        assert!(unpacked(&f).is_none());
    }

    #[test]
    fn a_chunk_cut_short_within_its_length_is_left_alone() {
        // The last chunk's DEFLATE data ends before its final block.
        let mut image = state_file(&stream(9000), 4096, true);
        let n = image.len();
        image.truncate(n - 2);
        let last_len_at = {
            let mut at = 16 + 46 + 32 + 4;
            let mut last = at;
            while at + 4 <= image.len() {
                last = at;
                at += 4 + u32::from_be_bytes(image[at..at + 4].try_into().unwrap()) as usize;
            }
            last
        };
        let shorter = u32::from_be_bytes(image[last_len_at..last_len_at + 4].try_into().unwrap()) - 2;
        image[last_len_at..last_len_at + 4].copy_from_slice(&shorter.to_be_bytes());
        assert!(unpacked(&image).is_none());
    }

    #[test]
    fn a_stream_of_many_chunks_reads_in_order_and_a_late_bad_chunk_says_so() {
        let s = stream(100 * 4096 + 5);
        let image = state_file(&s, 4096, true);
        let (header, mut reader) = open_stream(io::Cursor::new(&image), image.len() as u64)
            .unwrap()
            .unwrap();
        assert_eq!(header, image[..header.len()]);
        let mut back = Vec::new();
        reader.read_to_end(&mut back).unwrap();
        assert!(back == s, "the stream reads back in order");

        // The header and first chunk are fine; chunk 60 is not DEFLATE.
        let mut image = image;
        let mut at = header.len();
        for _ in 0..60 {
            at += 4 + u32::from_be_bytes(image[at..at + 4].try_into().unwrap()) as usize;
        }
        image[at + 4] = 0xFF;
        image[at + 5] = 0xFF;
        let (_, mut reader) = open_stream(io::Cursor::new(&image), image.len() as u64)
            .unwrap()
            .unwrap();
        let err = reader.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(is_not_unpackable(&err), "{err}");
        assert!(unpacked(&image).is_none(), "unpack leaves it alone");
    }

    #[test]
    fn a_header_that_is_not_one_is_refused() {
        let err = pack(b"short", &mut &b""[..], &mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
