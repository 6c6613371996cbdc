//! Stage output coming back from a sandbox, which is hostile input: read
//! as a stream into the stage log, with only bounded amounts kept in memory.

use std::collections::VecDeque;
use std::fs;
use std::io::{self, Write};

use crate::watch::RunWatcher;

/// The newest bytes of a stage's output the orchestrator keeps in memory
/// (the `output` metric is the last number in them); the stage log on disk
/// gets everything.
pub const OUTPUT_TAIL: usize = 64 << 10;
/// The most a metric file may hold: it is read back whole from the sandbox.
pub const METRIC_FILE_MAX: usize = 1 << 20;

/// One output stream of a stage command: to the stage log (everything), to
/// the watcher, counted (a re-attach follows on from the bytes seen), and,
/// for stdout, to the bounded tail the `output` metric reads.
pub(super) struct Tee<'a> {
    pub log: &'a mut fs::File,
    pub seen: &'a mut u64,
    pub tail: Option<&'a mut Tail>,
    pub watch: &'a dyn RunWatcher,
    pub stage: &'a str,
    pub branch: &'a str,
}

impl Write for Tee<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.log.write_all(data)?;
        *self.seen += data.len() as u64;
        if let Some(tail) = self.tail.as_deref_mut() {
            tail.push(data);
        }
        self.watch.output(self.stage, self.branch, data);
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.log.flush()
    }
}

/// The newest [`OUTPUT_TAIL`] bytes of a stream.
#[derive(Default)]
pub(super) struct Tail {
    bytes: VecDeque<u8>,
}

impl Tail {
    fn push(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(OUTPUT_TAIL)..];
        let excess = (self.bytes.len() + data.len()).saturating_sub(OUTPUT_TAIL);
        self.bytes.drain(..excess);
        self.bytes.extend(data);
    }

    pub fn text(&mut self) -> String {
        String::from_utf8_lossy(self.bytes.make_contiguous()).into_owned()
    }
}

/// A file read back from a sandbox whole, refused past [`METRIC_FILE_MAX`]
/// bytes (`over` then says why the read failed).
#[derive(Default)]
pub(super) struct Capped {
    pub bytes: Vec<u8>,
    pub over: bool,
}

impl Write for Capped {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.bytes.len() + data.len() > METRIC_FILE_MAX {
            self.over = true;
            return Err(io::Error::other("the file is larger than a metric file may be"));
        }
        self.bytes.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_keeps_only_the_newest_bytes() {
        let mut tail = Tail::default();
        for _ in 0..64 {
            tail.push(&[b'x'; 100_000]);
        }
        tail.push(b"energy -12.5\n");
        let text = tail.text();
        assert_eq!(text.len(), OUTPUT_TAIL);
        assert!(text.ends_with("xenergy -12.5\n"));
        tail.push(&vec![b'y'; 3 * OUTPUT_TAIL]);
        assert_eq!(tail.text(), "y".repeat(OUTPUT_TAIL));
    }

    #[test]
    fn a_metric_file_is_refused_past_its_limit() {
        let mut file = Capped::default();
        file.write_all(&vec![b'1'; METRIC_FILE_MAX]).unwrap();
        assert!(!file.over);
        assert!(file.write_all(b"2").is_err());
        assert!(file.over);
        assert_eq!(file.bytes.len(), METRIC_FILE_MAX);
    }
}
