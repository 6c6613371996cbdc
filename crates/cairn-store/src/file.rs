//! Files as ordered chunk lists: streamed in with content-defined
//! chunking, streamed out to a writer or (keeping holes) to a file.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use fastcdc::v2020::StreamCDC;
use nix::unistd::{lseek, Whence};
use serde::{Deserialize, Serialize};

use crate::blob::BlobStore;
use crate::chunk::{ChunkStore, ReadContext, StoreError};
use crate::hash::ChunkHash;
use crate::read_ahead::ReadAhead;

/// FastCDC bounds. Data shorter than `MIN_CHUNK` is always one chunk.
pub const MIN_CHUNK: u32 = 64 * 1024;
pub const AVG_CHUNK: u32 = 256 * 1024;
pub const MAX_CHUNK: u32 = 1024 * 1024;

/// FastCDC bounds for one kind of data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSizes {
    pub min: u32,
    pub avg: u32,
    pub max: u32,
}

impl ChunkSizes {
    /// Files in layers: large chunks, few objects.
    pub const FILES: ChunkSizes = ChunkSizes {
        min: MIN_CHUNK,
        avg: AVG_CHUNK,
        max: MAX_CHUNK,
    };
    /// Memory images, whose changes between two checkpoints are scattered
    /// and small: chunks a few pages long, so unchanged pages are shared.
    pub const FINE: ChunkSizes = ChunkSizes {
        min: 4 * 1024,
        avg: 16 * 1024,
        max: 64 * 1024,
    };
}

/// One chunk of a file and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub offset: u64,
    pub len: u32,
    pub hash: ChunkHash,
}

/// A stored file: its chunks in offset order and its total size. Bytes not
/// covered by a chunk are zeros (holes in a sparse file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileContent {
    pub size: u64,
    pub chunks: Vec<ChunkRef>,
}

impl FileContent {
    /// Checks that chunks are non-empty, ordered, disjoint and inside
    /// `size`; a record from storage is checked before it is trusted.
    pub fn validate(&self) -> Result<(), String> {
        let mut end = 0u64;
        for (i, c) in self.chunks.iter().enumerate() {
            if c.len == 0 || c.len > MAX_CHUNK {
                return Err(format!("chunk #{i} has length {}", c.len));
            }
            if c.offset < end {
                return Err(format!("chunk #{i} at offset {} overlaps the previous one", c.offset));
            }
            end = c
                .offset
                .checked_add(u64::from(c.len))
                .ok_or_else(|| format!("chunk #{i} ends past 2^64"))?;
        }
        if end > self.size {
            return Err(format!("chunks end at {end}, past the file size {}", self.size));
        }
        Ok(())
    }

    /// Bytes of data held in chunks (the size minus holes).
    pub fn data_len(&self) -> u64 {
        self.chunks.iter().map(|c| u64::from(c.len)).sum()
    }

    pub fn chunk_hashes(&self) -> impl Iterator<Item = ChunkHash> + '_ {
        self.chunks.iter().map(|c| c.hash)
    }
}

/// Reads `[pos, end)` of a file with pread, leaving its cursor alone.
struct RangeReader<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for RangeReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = (self.end - self.pos).min(buf.len() as u64) as usize;
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<B: BlobStore> ChunkStore<B> {
    /// Stores everything `reader` yields, holding at most one chunk buffer
    /// in memory.
    pub fn store_reader(&self, reader: impl Read) -> Result<FileContent, StoreError> {
        let mut content = FileContent::default();
        self.store_region(reader, 0, ChunkSizes::FILES, &mut content)?;
        content.size = content.chunks.last().map_or(0, |c| c.offset + u64::from(c.len));
        Ok(content)
    }

    /// Stores a regular file, skipping holes found with SEEK_DATA/SEEK_HOLE
    /// (on filesystems without them the whole file is data).
    pub fn store_file(&self, file: &File) -> Result<FileContent, StoreError> {
        self.store_file_chunked(file, ChunkSizes::FILES)
    }

    /// [`ChunkStore::store_file`] with chunks of the given sizes.
    pub fn store_file_chunked(&self, file: &File, sizes: ChunkSizes) -> Result<FileContent, StoreError> {
        let read_err = |source| StoreError::ReadSource {
            context: Box::default(),
            source,
        };
        let size = file.metadata().map_err(read_err)?.len();
        let mut content = FileContent {
            size,
            chunks: Vec::new(),
        };
        let mut pos = 0u64;
        while pos < size {
            let data = match lseek(file.as_raw_fd(), pos as i64, Whence::SeekData) {
                Ok(off) => off as u64,
                // No data past `pos`: the rest is a hole.
                Err(nix::errno::Errno::ENXIO) => break,
                Err(nix::errno::Errno::EINVAL) if pos == 0 => 0,
                Err(e) => return Err(read_err(e.into())),
            };
            if data >= size {
                break;
            }
            let hole = match lseek(file.as_raw_fd(), data as i64, Whence::SeekHole) {
                Ok(off) => (off as u64).min(size),
                Err(nix::errno::Errno::EINVAL) => size,
                Err(e) => return Err(read_err(e.into())),
            };
            let reader = RangeReader {
                file,
                pos: data,
                end: hole,
            };
            self.store_region(reader, data, sizes, &mut content)?;
            pos = hole.max(data + 1);
        }
        Ok(content)
    }

    fn store_region(
        &self,
        reader: impl Read,
        base: u64,
        sizes: ChunkSizes,
        content: &mut FileContent,
    ) -> Result<(), StoreError> {
        for chunk in StreamCDC::new(reader, sizes.min, sizes.avg, sizes.max) {
            let chunk = chunk.map_err(|e| StoreError::ReadSource {
                context: Box::default(),
                source: match e {
                    fastcdc::v2020::Error::IoError(io) => io,
                    other => io::Error::other(other.to_string()),
                },
            })?;
            let put = self.put_chunk(&chunk.data)?;
            content.chunks.push(ChunkRef {
                offset: base + chunk.offset,
                len: chunk.length as u32,
                hash: put.hash,
            });
        }
        Ok(())
    }

    /// Calls `f` on each chunk in order while the backend fetches the
    /// ones after it ([`BlobStore::read_ahead`]), so a far backend's
    /// fetches overlap each other and the reader's work.
    fn for_each_chunk(
        &self,
        content: &FileContent,
        mut f: impl FnMut(&ChunkRef) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let chunks = &content.chunks;
        if chunks.len() <= 1 {
            return chunks.iter().try_for_each(&mut f);
        }
        let ahead = self.backend().read_ahead(chunks.iter().map(|c| c.hash).collect());
        Self::each_chunk_advancing(content, &ahead, f)
    }

    fn each_chunk_advancing(
        content: &FileContent,
        ahead: &ReadAhead,
        mut f: impl FnMut(&ChunkRef) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        for c in &content.chunks {
            f(c)?;
            ahead.advance(1);
        }
        Ok(())
    }

    fn checked_chunk(&self, c: &ChunkRef, context: &ReadContext) -> Result<Vec<u8>, StoreError> {
        // The record says how long the chunk is (validated: at most
        // MAX_CHUNK); one byte more is already corrupt.
        let data = self.get_chunk_capped(&c.hash, u64::from(c.len), context)?;
        if data.len() != c.len as usize {
            return Err(StoreError::ChunkCorrupt {
                hash: c.hash,
                context: Box::new(context.clone()),
                reason: format!("it holds {} bytes where the file record says {}", data.len(), c.len),
            });
        }
        Ok(data)
    }

    /// Writes the whole file, holes as zeros, to `out`; returns bytes
    /// written. Every chunk is verified before its bytes are written.
    pub fn read_to_writer(
        &self,
        content: &FileContent,
        mut out: impl Write,
        context: &ReadContext,
    ) -> Result<u64, StoreError> {
        content.validate().map_err(|reason| StoreError::InvalidContent {
            context: Box::new(context.clone()),
            reason,
        })?;
        let write_err = |source| StoreError::WriteDestination {
            context: Box::new(context.clone()),
            source,
        };
        let zeros = [0u8; 64 * 1024];
        let mut pos = 0u64;
        let write_zeros = |pos: &mut u64, until: u64, out: &mut dyn Write| -> io::Result<()> {
            while *pos < until {
                let n = (until - *pos).min(zeros.len() as u64) as usize;
                out.write_all(&zeros[..n])?;
                *pos += n as u64;
            }
            Ok(())
        };
        self.for_each_chunk(content, |c| {
            write_zeros(&mut pos, c.offset, &mut out).map_err(write_err)?;
            let data = self.checked_chunk(c, context)?;
            out.write_all(&data).map_err(write_err)?;
            pos += data.len() as u64;
            Ok(())
        })?;
        write_zeros(&mut pos, content.size, &mut out).map_err(write_err)?;
        out.flush().map_err(write_err)?;
        Ok(pos)
    }

    /// Restores the file into `file` (truncated first), leaving holes
    /// where no chunk covers the range, so sparse files stay sparse.
    pub fn restore_to_file(&self, content: &FileContent, file: &File, context: &ReadContext) -> Result<(), StoreError> {
        self.restore_to_file_inner(content, file, context, None)
    }

    /// [`restore_to_file`](Self::restore_to_file) for a reader restoring
    /// many files whose chunks, all files' in order, `ahead` fetches: it
    /// is advanced one per chunk of this file, and no read-ahead of the
    /// file's own is started.
    pub fn restore_to_file_read_ahead(
        &self,
        content: &FileContent,
        file: &File,
        context: &ReadContext,
        ahead: &ReadAhead,
    ) -> Result<(), StoreError> {
        self.restore_to_file_inner(content, file, context, Some(ahead))
    }

    fn restore_to_file_inner(
        &self,
        content: &FileContent,
        file: &File,
        context: &ReadContext,
        ahead: Option<&ReadAhead>,
    ) -> Result<(), StoreError> {
        content.validate().map_err(|reason| StoreError::InvalidContent {
            context: Box::new(context.clone()),
            reason,
        })?;
        let write_err = |source| StoreError::WriteDestination {
            context: Box::new(context.clone()),
            source,
        };
        file.set_len(0).map_err(write_err)?;
        let write = |c: &ChunkRef| {
            let data = self.checked_chunk(c, context)?;
            file.write_all_at(&data, c.offset).map_err(write_err)
        };
        match ahead {
            Some(ahead) => Self::each_chunk_advancing(content, ahead, write)?,
            None => self.for_each_chunk(content, write)?,
        }
        file.set_len(content.size).map_err(write_err)?;
        Ok(())
    }
}
