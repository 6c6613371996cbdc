//! Files on the host a command writes or shows: a temporary renamed into
//! place once complete, a log printed whole or by its last lines.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

use anyhow::{Context, Result};

/// A new file in `to`'s directory, to be renamed to `to` once complete:
/// created exclusively under a random name (never through a symlink someone
/// put at a name they guessed), owner-only, removed when dropped unrenamed.
pub(crate) fn temporary_beside(to: &Path) -> Result<tempfile::NamedTempFile> {
    let parent = to
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = to.file_name().context("the destination has no file name")?;
    tempfile::Builder::new()
        .prefix(&format!(".{}.", name.to_string_lossy()))
        .suffix(".cairn")
        .tempfile_in(parent)
        .with_context(|| format!("cannot write in {}", parent.display()))
}

/// Prints a log (written from inside a sandbox, so of any size), or its
/// last `tail` lines, as a stream: a block at a time is in memory.
pub fn print_log(mut log: fs::File, tail: Option<usize>) -> Result<()> {
    let start = match tail {
        Some(n) => tail_start(&mut log, n)?,
        None => 0,
    };
    log.seek(SeekFrom::Start(start))?;
    io::copy(&mut log, &mut io::stdout().lock())?;
    Ok(())
}

/// Where the last `n` lines of `log` begin, scanning back from its end.
fn tail_start(log: &mut (impl Read + Seek), n: usize) -> io::Result<u64> {
    let len = log.seek(SeekFrom::End(0))?;
    if n == 0 {
        return Ok(len);
    }
    let mut block = vec![0; 256 << 10];
    let (mut end, mut newlines) = (len, 0);
    while end > 0 {
        let size = end.min(block.len() as u64) as usize;
        let at = end - size as u64;
        log.seek(SeekFrom::Start(at))?;
        log.read_exact(&mut block[..size])?;
        for i in memchr::memrchr_iter(b'\n', &block[..size]) {
            let after = at + i as u64 + 1;
            // A newline that ends the log ends its last line; it starts none.
            if after == len {
                continue;
            }
            newlines += 1;
            if newlines == n {
                return Ok(after);
            }
        }
        end = at;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_of_a_log_starts_where_its_last_lines_do() {
        // Lines longer than the block read back at a time, and short ones.
        let long = "x".repeat(300 << 10);
        let texts = [
            String::new(),
            "one".into(),
            "one\n".into(),
            "one\ntwo\n\nfour".into(),
            format!("{long}\nshort\n{long}\n{long}"),
            format!("a\n{long}\n"),
        ];
        for text in &texts {
            for n in 0..6 {
                let lines: Vec<&str> = text.split_inclusive('\n').collect();
                let expected: String = lines[lines.len().saturating_sub(n)..].concat();
                let start = tail_start(&mut io::Cursor::new(text.as_bytes()), n).unwrap();
                assert_eq!(
                    &text[start as usize..],
                    expected,
                    "{n} lines of {:?}",
                    &text[..text.len().min(20)]
                );
            }
        }
    }
}
