//! Storing a long stream fast: a memory image, hundreds of MiB of which a
//! few change between two checkpoints.
//!
//! One thread reads ahead (for a gVisor image the reader inflates it, so
//! nothing is written out and read back; a file still being written is read
//! behind its writer), another cuts chunks from what it read: content-defined
//! ones anywhere in the stream, or, for raw memory pages, cut only between
//! pages ([`Cutting::Pages`]); batches of chunks go to a pool that hashes each, looks it up and
//! compresses only the new ones; a batch's new chunks are then written
//! together and made durable together ([`BlobStore::put_batch`]: a local
//! store packs many into one file), up to three batches at once so that
//! their flushes overlap. While one batch is cut, the one before it is
//! hashed and the ones before that written.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastcdc::v2020::StreamCDC;
use rayon::prelude::*;

use crate::blob::{BlobStore, PutOutcome};
use crate::chunk::{compress_chunk, ChunkStore, StoreError};
use crate::file::{ChunkRef, ChunkSizes, FileContent};
use crate::hash::ChunkHash;

/// Bytes of chunks handed to the pool at a time: the memory a stream holds
/// is about three batches (one being cut, one queued, one stored).
const BATCH_BYTES: usize = 8 << 20;

/// How a stream is cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cutting {
    /// Content-defined chunks (FastCDC) of these sizes, cut anywhere.
    Content(ChunkSizes),
    /// Raw memory pages (a gVisor `pages.img`): chunks are whole 4 KiB
    /// pages, 4 to 64 of them, cut after a page whose sampled fingerprint
    /// says so (1 page in 16). Deciding costs 32 bytes read per page instead
    /// of a rolling hash over every byte, and since what moves between two
    /// images of one memory moves by whole pages, the cuts move with it.
    Pages,
}

impl From<ChunkSizes> for Cutting {
    fn from(sizes: ChunkSizes) -> Cutting {
        Cutting::Content(sizes)
    }
}

/// The page size [`Cutting::Pages`] cuts between.
pub const PAGE: usize = 4096;
const MIN_PAGES: usize = 4;
const MAX_PAGES: usize = 64;

/// Whether a page ends a chunk: a fingerprint of four words spread over it,
/// one page in 16 on varied contents.
fn ends_chunk(page: &[u8; PAGE]) -> bool {
    let word = |at: usize| {
        let mut w = [0; 8];
        w.copy_from_slice(&page[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mixed = word(0) ^ word(1352).rotate_left(17) ^ word(2704).rotate_left(31) ^ word(PAGE - 8).rotate_left(47);
    mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60 == 0
}

/// What storing a stream did and where its time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bytes the reader yielded, and the chunks they were cut into.
    pub bytes: u64,
    pub chunks: u64,
    /// Chunks this stream added to the store (a chunk repeated within it
    /// counts once), their bytes, and what they take stored (compressed).
    pub new_chunks: u64,
    pub new_bytes: u64,
    pub stored_bytes: u64,
    /// From the first read to the last write being durable.
    pub wall: Duration,
    /// The read-ahead thread in the reader (for a gVisor image: reading
    /// and inflating it), beside the chunking.
    pub read: Duration,
    /// The chunking thread finding cut points and copying chunks.
    pub chunking: Duration,
    /// BLAKE3, summed over the pool's threads.
    pub hash: Duration,
    /// Asking the store whether it holds a chunk (and refreshing it if so),
    /// summed over the pool's threads.
    pub lookup: Duration,
    /// zstd of the new chunks, summed over the pool's threads.
    pub compress: Duration,
    /// Writing the new chunks and making them durable, summed over the
    /// batches written at once.
    pub write: Duration,
}

impl std::ops::AddAssign for StreamStats {
    fn add_assign(&mut self, o: StreamStats) {
        self.bytes += o.bytes;
        self.chunks += o.chunks;
        self.new_chunks += o.new_chunks;
        self.new_bytes += o.new_bytes;
        self.stored_bytes += o.stored_bytes;
        self.wall += o.wall;
        self.read += o.read;
        self.chunking += o.chunking;
        self.hash += o.hash;
        self.lookup += o.lookup;
        self.compress += o.compress;
        self.write += o.write;
    }
}

/// One chunk cut from the stream.
struct Piece {
    offset: u64,
    data: Data,
}

/// A chunk's bytes: its own, or a part of a block read ahead (pages cut
/// inside one block are not copied).
enum Data {
    Owned(Vec<u8>),
    Shared(Arc<Vec<u8>>, std::ops::Range<usize>),
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Owned(v) => v,
            Data::Shared(block, range) => &block[range.clone()],
        }
    }
}

/// A chunk hashed, looked up and, when new, compressed.
struct Prepared {
    hash: ChunkHash,
    compressed: Option<Vec<u8>>,
    hash_time: Duration,
    lookup_time: Duration,
    compress_time: Duration,
}

impl<B: BlobStore> ChunkStore<B> {
    /// Stores everything `reader` yields as one file, cut as `cutting`
    /// says, hashing and compressing on all cores. Returns the
    /// file and what storing it cost. A read error ends it with
    /// [`StoreError::ReadSource`] (chunks stored until then stay, for GC).
    pub fn store_stream<R: Read + Send>(
        &self,
        reader: R,
        cutting: impl Into<Cutting>,
    ) -> Result<(FileContent, StreamStats), StoreError> {
        let cutting = cutting.into();
        let started = Instant::now();
        let (tx, rx) = mpsc::sync_channel::<Vec<Piece>>(1);
        let (blocks_tx, blocks_rx) = mpsc::sync_channel(2);
        let (read, chunking, (mut content, mut stats)) = std::thread::scope(|s| {
            let reading = s.spawn(move || read_ahead(reader, blocks_tx));
            let blocks = Blocks {
                rx: blocks_rx,
                block: Vec::new(),
                pos: 0,
            };
            let cutter = s.spawn(move || match cutting {
                Cutting::Content(sizes) => cut(blocks, sizes, tx),
                Cutting::Pages => cut_pages(blocks, tx),
            });
            // A batch is written (and made durable) while the next one is
            // hashed; on an error either side's receiver is dropped, which
            // stops the cutter and the reader.
            let (prepared_tx, prepared_rx) = mpsc::sync_channel::<(Vec<Piece>, Vec<Prepared>)>(1);
            let writer = s.spawn(move || {
                let mut content = FileContent::default();
                let mut stats = StreamStats::default();
                // Up to WRITES_IN_FLIGHT batches are written at once, each
                // made durable on its own, so that one's flush overlaps the
                // next one's writing (a disk flushes faster with more than
                // one request queued); they join the file in stream order.
                std::thread::scope(|w| {
                    let mut finish = |write: std::thread::ScopedJoinHandle<'_, Result<Written, StoreError>>| {
                        let written = write.join().unwrap_or_else(|e| std::panic::resume_unwind(e))?;
                        record_batch(written, &mut content, &mut stats);
                        Ok::<_, StoreError>(())
                    };
                    let mut in_flight = VecDeque::with_capacity(WRITES_IN_FLIGHT);
                    for (batch, prepared) in prepared_rx {
                        if in_flight.len() == WRITES_IN_FLIGHT {
                            if let Some(oldest) = in_flight.pop_front() {
                                finish(oldest)?;
                            }
                        }
                        in_flight.push_back(w.spawn(move || self.write_batch(batch, prepared)));
                    }
                    while let Some(oldest) = in_flight.pop_front() {
                        finish(oldest)?;
                    }
                    Ok::<_, StoreError>(())
                })?;
                Ok::<_, StoreError>((content, stats))
            });
            let mut failed = None;
            for batch in rx {
                match batch.par_iter().map(|piece| self.prepare(&piece.data)).collect() {
                    Ok(prepared) => {
                        if prepared_tx.send((batch, prepared)).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            drop(prepared_tx);
            let written = writer.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            if let Some(e) = failed {
                return Err(e);
            }
            let written = written?;
            let chunking = cutter
                .join()
                .unwrap_or_else(|e| std::panic::resume_unwind(e))
                .map_err(|source| StoreError::ReadSource {
                    context: Box::default(),
                    source,
                })?;
            let read = reading.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            Ok::<_, StoreError>((read, chunking, written))
        })?;
        content.size = stats.bytes;
        stats.read = read;
        stats.chunking = chunking;
        stats.wall = started.elapsed();
        Ok((content, stats))
    }

    /// Writes a prepared batch's new chunks; once they are durable, the
    /// batch is ready to join the file ([`record_batch`]).
    fn write_batch(&self, batch: Vec<Piece>, prepared: Vec<Prepared>) -> Result<Written, StoreError> {
        let (at, new): (Vec<usize>, Vec<(ChunkHash, &[u8])>) = prepared
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i, (p.hash, p.compressed.as_deref()?))))
            .unzip();
        let t = Instant::now();
        let outcomes = self.backend().put_batch(&new)?;
        let took = t.elapsed();
        let mut stored = vec![None; batch.len()];
        for ((i, (_, bytes)), outcome) in at.iter().zip(&new).zip(&outcomes) {
            if *outcome == PutOutcome::Stored {
                stored[*i] = Some(bytes.len() as u64);
                self.written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
        }
        Ok(Written {
            batch,
            prepared,
            stored,
            took,
        })
    }

    /// Hashes a chunk and compresses it only if the store lacks it.
    fn prepare(&self, data: &[u8]) -> Result<Prepared, StoreError> {
        let t = Instant::now();
        let hash = ChunkHash::of(data);
        let hash_time = t.elapsed();
        let t = Instant::now();
        let present = self.backend().refresh(&hash)?;
        let lookup_time = t.elapsed();
        let t = Instant::now();
        let compressed = match present {
            true => None,
            false => Some(compress_chunk(data).map_err(StoreError::Compress)?),
        };
        Ok(Prepared {
            hash,
            compressed,
            hash_time,
            lookup_time,
            compress_time: t.elapsed(),
        })
    }
}

/// Batches written at once by one stream.
const WRITES_IN_FLIGHT: usize = 3;

/// A batch whose new chunks are durable, with what storing them took.
struct Written {
    batch: Vec<Piece>,
    prepared: Vec<Prepared>,
    /// For each chunk, its stored (compressed) size if this batch stored it.
    stored: Vec<Option<u64>>,
    took: Duration,
}

/// Adds a written batch to `content`, in stream order, and its figures to
/// `stats`.
fn record_batch(written: Written, content: &mut FileContent, stats: &mut StreamStats) {
    let Written {
        batch,
        prepared,
        stored,
        took,
    } = written;
    stats.write += took;
    for ((piece, p), stored) in batch.iter().zip(&prepared).zip(stored) {
        stats.bytes += piece.data.len() as u64;
        stats.chunks += 1;
        stats.hash += p.hash_time;
        stats.lookup += p.lookup_time;
        stats.compress += p.compress_time;
        if let Some(size) = stored {
            stats.new_chunks += 1;
            stats.new_bytes += piece.data.len() as u64;
            stats.stored_bytes += size;
        }
        content.chunks.push(ChunkRef {
            offset: piece.offset,
            len: piece.data.len() as u32,
            hash: p.hash,
        });
    }
}

/// Bytes read ahead of the chunking thread at a time.
const READ_BLOCK: usize = 4 << 20;

/// Reads `reader` to its end in blocks, ahead of the chunking thread (for
/// a gVisor image, inflating overlaps chunking); returns the time spent in
/// the reader. A read error is passed on; nobody receiving stops it.
fn read_ahead(mut reader: impl Read, tx: SyncSender<io::Result<Vec<u8>>>) -> Duration {
    let mut spent = Duration::ZERO;
    loop {
        // Not zeroed first: `read_to_end` reads into the spare capacity.
        let mut block = Vec::with_capacity(READ_BLOCK);
        let t = Instant::now();
        let read = (&mut reader).take(READ_BLOCK as u64).read_to_end(&mut block);
        spent += t.elapsed();
        let sent = match read {
            Ok(0) => break,
            Ok(_) => tx.send(Ok(block)),
            Err(e) => {
                let _ = tx.send(Err(e));
                break;
            }
        };
        if sent.is_err() {
            break;
        }
    }
    spent
}

/// The blocks [`read_ahead`] sends, as a reader.
struct Blocks {
    rx: Receiver<io::Result<Vec<u8>>>,
    block: Vec<u8>,
    pos: usize,
}

impl Read for Blocks {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.block.len() {
            match self.rx.recv() {
                Ok(block) => {
                    self.block = block?;
                    self.pos = 0;
                }
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.block.len() - self.pos);
        buf[..n].copy_from_slice(&self.block[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Counts the time spent waiting for input.
struct TimedReader<R> {
    inner: R,
    spent: Duration,
}

impl<R: Read> Read for TimedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let t = Instant::now();
        let n = self.inner.read(buf);
        self.spent += t.elapsed();
        n
    }
}

/// Cuts `reader` into chunks and sends them in batches; returns the time
/// spent cutting (waiting for input or for the pool is not counted).
/// Stops early, without an error, once nobody receives.
fn cut(reader: impl Read, sizes: ChunkSizes, tx: SyncSender<Vec<Piece>>) -> io::Result<Duration> {
    let started = Instant::now();
    let mut waited = Duration::ZERO;
    let mut reader = TimedReader {
        inner: reader,
        spent: Duration::ZERO,
    };
    let mut batch = Vec::new();
    let mut batch_bytes = 0;
    let mut send = |batch: Vec<Piece>| {
        let t = Instant::now();
        let sent = tx.send(batch).is_ok();
        waited += t.elapsed();
        sent
    };
    for chunk in StreamCDC::new(&mut reader, sizes.min, sizes.avg, sizes.max) {
        let chunk = chunk.map_err(|e| match e {
            fastcdc::v2020::Error::IoError(io) => io,
            other => io::Error::other(other.to_string()),
        })?;
        batch_bytes += chunk.data.len();
        batch.push(Piece {
            offset: chunk.offset,
            data: Data::Owned(chunk.data),
        });
        if batch_bytes >= BATCH_BYTES {
            batch_bytes = 0;
            if !send(std::mem::take(&mut batch)) {
                break;
            }
        }
    }
    if !batch.is_empty() {
        send(batch);
    }
    let input = reader.spent;
    Ok(started.elapsed().saturating_sub(waited).saturating_sub(input))
}

/// [`cut`] for [`Cutting::Pages`]: chunks of whole pages (the stream's
/// last chunk ends where the stream does), cut straight from the blocks
/// read ahead; a chunk inside one block is not copied, one that spans two
/// blocks is.
fn cut_pages(blocks: Blocks, tx: SyncSender<Vec<Piece>>) -> io::Result<Duration> {
    let started = Instant::now();
    let mut waited = Duration::ZERO;
    let send = |batch: Vec<Piece>, waited: &mut Duration| {
        let t = Instant::now();
        let sent = tx.send(batch).is_ok();
        *waited += t.elapsed();
        sent
    };
    let mut batch = Vec::new();
    let mut batch_bytes = 0;
    let mut offset = 0u64;
    // The start of a chunk begun in an earlier block.
    let mut carried: Vec<u8> = Vec::new();
    loop {
        let t = Instant::now();
        let block = match blocks.rx.recv() {
            Ok(block) => Arc::new(block?),
            Err(_) => break,
        };
        waited += t.elapsed();
        let mut from = 0;
        let mut at = 0;
        while at < block.len() {
            let end = (at + PAGE).min(block.len());
            let page = &block[at..end];
            at = end;
            let pages = (carried.len() + (at - from)) / PAGE;
            let cut = match <&[u8; PAGE]>::try_from(page) {
                Err(_) => true,
                Ok(page) => pages >= MAX_PAGES || (pages >= MIN_PAGES && ends_chunk(page)),
            };
            if !cut {
                continue;
            }
            let data = if carried.is_empty() {
                Data::Shared(block.clone(), from..at)
            } else {
                let mut whole = std::mem::take(&mut carried);
                whole.extend_from_slice(&block[from..at]);
                Data::Owned(whole)
            };
            from = at;
            let len = data.len();
            batch.push(Piece { offset, data });
            offset += len as u64;
            batch_bytes += len;
            if batch_bytes >= BATCH_BYTES {
                batch_bytes = 0;
                if !send(std::mem::take(&mut batch), &mut waited) {
                    return Ok(started.elapsed().saturating_sub(waited));
                }
            }
        }
        carried.extend_from_slice(&block[from..]);
    }
    if !carried.is_empty() {
        batch.push(Piece {
            offset,
            data: Data::Owned(carried),
        });
    }
    if !batch.is_empty() {
        send(batch, &mut waited);
    }
    Ok(started.elapsed().saturating_sub(waited))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalStore, ReadContext};

    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_stream_reads_back_as_written_and_a_second_store_adds_only_the_change() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        // More batches than are written at once, some of it repetitive
        // (zero pages).
        let mut data = noise(40 << 20, 7);
        data[3 << 20..5 << 20].fill(0);
        let (content, stats) = store.store_stream(&data[..], ChunkSizes::FINE).unwrap();
        assert_eq!(content.size, data.len() as u64);
        assert_eq!(stats.bytes, data.len() as u64);
        assert_eq!(stats.chunks, content.chunks.len() as u64);
        assert!(stats.new_chunks < stats.chunks, "zero pages are stored once");
        assert_eq!(stats.stored_bytes, store.bytes_written());
        let mut back = Vec::new();
        store.read_to_writer(&content, &mut back, &ReadContext::new()).unwrap();
        assert!(back == data, "the stream reads back as written");

        // 64 KiB changed in the middle: a few chunks are new, the rest found.
        data[10 << 20..(10 << 20) + (64 << 10)].copy_from_slice(&noise(64 << 10, 9));
        let before = store.bytes_written();
        let (again, stats) = store.store_stream(&data[..], ChunkSizes::FINE).unwrap();
        assert!(stats.new_bytes < 512 << 10, "{stats:?}");
        assert_eq!(store.bytes_written() - before, stats.stored_bytes);
        let mut back = Vec::new();
        store.read_to_writer(&again, &mut back, &ReadContext::new()).unwrap();
        assert!(back == data);
    }

    #[test]
    fn pages_are_cut_between_pages_and_a_shift_by_whole_pages_is_found_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        // 24 MiB of pages and a partial page at the end; a run of zero pages.
        let mut data = noise((24 << 20) + 100, 3);
        data[2 << 20..3 << 20].fill(0);
        let (content, stats) = store.store_stream(&data[..], Cutting::Pages).unwrap();
        assert_eq!(content.size, data.len() as u64);
        let (last, whole) = content.chunks.split_last().unwrap();
        for c in whole {
            assert_eq!(c.offset % PAGE as u64, 0);
            assert_eq!(c.len as usize % PAGE, 0, "{c:?}");
            assert!(
                (MIN_PAGES * PAGE..=MAX_PAGES * PAGE).contains(&(c.len as usize)),
                "{c:?}"
            );
        }
        assert_eq!(last.offset + u64::from(last.len), data.len() as u64);
        let avg = data.len() / content.chunks.len();
        assert!((40 << 10..=128 << 10).contains(&avg), "average chunk {avg}");
        assert!(stats.new_chunks < stats.chunks, "zero pages are stored once");
        let mut back = Vec::new();
        store.read_to_writer(&content, &mut back, &ReadContext::new()).unwrap();
        assert!(back == data);

        // Three pages inserted near the front and 8 MiB rewritten further
        // on: what did not change is found again.
        let mut moved = data[..PAGE * 10].to_vec();
        moved.extend_from_slice(&noise(3 * PAGE, 11));
        moved.extend_from_slice(&data[PAGE * 10..]);
        moved[12 << 20..20 << 20].copy_from_slice(&noise(8 << 20, 12));
        let (again, stats) = store.store_stream(&moved[..], Cutting::Pages).unwrap();
        assert!(stats.new_bytes < (8 << 20) + (1 << 20), "{stats:?}");
        let mut back = Vec::new();
        store.read_to_writer(&again, &mut back, &ReadContext::new()).unwrap();
        assert!(back == moved);
        // An empty stream is an empty file.
        let (empty, _) = store.store_stream(&[][..], Cutting::Pages).unwrap();
        assert_eq!((empty.size, empty.chunks.len()), (0, 0));
    }

    #[test]
    fn a_read_error_ends_the_stream_with_it() {
        struct Failing(usize);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "chunk 3 does not inflate"));
                }
                let n = buf.len().min(self.0);
                buf[..n].fill(1);
                self.0 -= n;
                Ok(n)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::new(LocalStore::open(dir.path()).unwrap());
        let err = store.store_stream(Failing(12 << 20), ChunkSizes::FINE).unwrap_err();
        assert!(
            matches!(&err, StoreError::ReadSource { source, .. } if source.kind() == io::ErrorKind::InvalidData),
            "{err}"
        );
    }
}
