//! [`ReadAhead`]: fetching, in order and a bounded distance ahead, the
//! objects a reader is about to read one after another.
//!
//! A far backend answers one GET in a round trip; a reader asking for one
//! object at a time waits that long per object. The read-ahead keeps
//! `streams` fetches running over the reader's list, never more than
//! `lookahead` objects past the last one the reader reported read, so
//! what is fetched and not yet read stays bounded (fetched objects land in
//! the backend's cache, not in memory; each stream holds one object while
//! it writes it there).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::hash::ChunkHash;

/// Fetches one object into the backend's cache; false stops this stream
/// (the reader's own read then reports the failure).
pub(crate) type Fetch = dyn Fn(&ChunkHash) -> bool + Send + Sync;

#[derive(Debug, Default)]
struct Position {
    /// Objects the reader has read.
    read: usize,
    /// The next object a stream takes.
    next: usize,
    /// Fetch everything left, whatever the reader's position.
    finishing: bool,
    stop: bool,
}

struct Shared {
    keys: Vec<ChunkHash>,
    lookahead: usize,
    position: Mutex<Position>,
    /// Signalled when the reader moves on or the read-ahead stops.
    moved: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Position> {
        self.position.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next object to fetch, waiting while the streams are
    /// `lookahead` ahead of the reader; `None` at the end or when stopped.
    fn take(&self) -> Option<ChunkHash> {
        let mut p = self.lock();
        loop {
            if p.stop || p.next >= self.keys.len() {
                return None;
            }
            if p.finishing {
                let key = self.keys[p.next];
                p.next += 1;
                return Some(key);
            }
            // The reader may have passed this one already (it read it itself).
            p.next = p.next.max(p.read);
            if p.next >= self.keys.len() {
                return None;
            }
            if p.next < p.read.saturating_add(self.lookahead) {
                let key = self.keys[p.next];
                p.next += 1;
                return Some(key);
            }
            p = self.moved.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A running read-ahead; the reader reports its progress with
/// [`advance`](ReadAhead::advance). Dropping it stops the fetches (those
/// in flight finish first).
#[must_use = "dropping a read-ahead stops it"]
pub struct ReadAhead {
    shared: Option<Arc<Shared>>,
    streams: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead")
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl ReadAhead {
    /// A read-ahead that fetches nothing (a backend whose reads are near).
    pub fn none() -> ReadAhead {
        ReadAhead {
            shared: None,
            streams: Vec::new(),
        }
    }

    /// Starts `streams` threads fetching `keys` in order with `fetch`, at
    /// most `lookahead` past the reader.
    pub(crate) fn start(keys: Vec<ChunkHash>, streams: usize, lookahead: usize, fetch: Arc<Fetch>) -> ReadAhead {
        if keys.is_empty() {
            return ReadAhead::none();
        }
        let shared = Arc::new(Shared {
            keys,
            lookahead: lookahead.max(1),
            position: Mutex::new(Position::default()),
            moved: Condvar::new(),
        });
        let count = streams.clamp(1, shared.keys.len());
        let mut handles = Vec::with_capacity(count);
        for i in 0..count {
            let (shared, fetch) = (shared.clone(), fetch.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("cairn-fetch-{i}"))
                .spawn(move || {
                    while let Some(key) = shared.take() {
                        if !fetch(&key) {
                            break;
                        }
                    }
                });
            // Without threads the reader still reads, one object at a time.
            if let Ok(handle) = spawned {
                handles.push(handle);
            }
        }
        ReadAhead {
            shared: Some(shared),
            streams: handles,
        }
    }

    /// The reader has read `n` more of the objects, in order.
    pub fn advance(&self, n: usize) {
        if let Some(shared) = &self.shared {
            let mut p = shared.lock();
            p.read = p.read.saturating_add(n);
            drop(p);
            shared.moved.notify_all();
        }
    }

    /// Waits until every object has been fetched (or a stream gave up),
    /// as a reader that wants them all in the cache before it starts.
    pub fn finish(mut self) {
        if let Some(shared) = &self.shared {
            shared.lock().finishing = true;
            shared.moved.notify_all();
        }
        for stream in self.streams.drain(..) {
            let _ = stream.join();
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            shared.lock().stop = true;
            shared.moved.notify_all();
        }
        for stream in self.streams.drain(..) {
            let _ = stream.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn keys(n: usize) -> Vec<ChunkHash> {
        (0..n).map(|i| ChunkHash::of(&i.to_le_bytes())).collect()
    }

    #[test]
    fn a_read_ahead_stays_within_its_lookahead_of_the_reader() {
        let fetched = Arc::new(AtomicUsize::new(0));
        let counter = fetched.clone();
        let ahead = ReadAhead::start(
            keys(100),
            4,
            10,
            Arc::new(move |_| {
                counter.fetch_add(1, Ordering::SeqCst);
                true
            }),
        );
        // The streams stop at 10 fetched; wait until they get there.
        while fetched.load(Ordering::SeqCst) < 10 {
            std::thread::yield_now();
        }
        ahead.advance(5);
        while fetched.load(Ordering::SeqCst) < 15 {
            std::thread::yield_now();
        }
        {
            // Nothing past read + lookahead is ever taken.
            let shared = ahead.shared.as_ref().unwrap();
            let p = shared.lock();
            assert!(p.next <= p.read + 10, "next {} read {}", p.next, p.read);
        }
        ahead.finish();
        assert_eq!(fetched.load(Ordering::SeqCst), 100);
    }

    #[test]
    fn a_failed_fetch_stops_its_stream_and_dropping_stops_the_rest() {
        let ahead = ReadAhead::start(keys(1000), 2, 1000, Arc::new(|_| false));
        drop(ahead); // returns: every stream ended
        let ahead = ReadAhead::start(keys(1000), 2, 1, Arc::new(|_| true));
        drop(ahead); // streams waiting on the reader are woken and end
    }
}
