//! A `multipart/form-data` body read as it arrives, in bounded memory: a
//! part's headers (at most [`HEAD_MAX`] bytes), then its data in pieces as
//! they come, never holding more than one piece of the body and the end of
//! the one before (a delimiter may straddle them). A form can be any size;
//! what its files add up to is the caller's to limit.

use std::fmt::Display;

use axum::body::Bytes;
use bytes::{Buf, BytesMut};
use futures_util::{Stream, StreamExt};

/// The most bytes of headers one part may have.
pub const HEAD_MAX: usize = 16 << 10;

/// Where the reader is in the form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Before the first delimiter (a preamble, skipped).
    Preamble,
    /// Just past a delimiter: `--` ends the form, CRLF starts a part.
    Delimited,
    /// In a part's headers.
    Head,
    /// In a part's data.
    Data,
    /// Past the closing delimiter (an epilogue, ignored).
    End,
}

/// A form's body, read part by part.
pub struct Form<S> {
    body: S,
    buf: BytesMut,
    /// CRLF `--` boundary: what ends a part's data.
    delimiter: Vec<u8>,
    stage: Stage,
    eof: bool,
}

impl<S, E> Form<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Display,
{
    pub fn new(body: S, boundary: &str) -> Form<S> {
        let mut buf = BytesMut::new();
        // The first delimiter has no CRLF before it unless there is a
        // preamble; one is supplied, so every delimiter reads alike.
        buf.extend_from_slice(b"\r\n");
        Form {
            body,
            buf,
            delimiter: format!("\r\n--{boundary}").into_bytes(),
            stage: Stage::Preamble,
            eof: false,
        }
    }

    /// Reads the next part's headers; its file name (from its
    /// `Content-Disposition`, `None` when it names none), or `None` past
    /// the last part. Data of the previous part left unread is skipped.
    pub async fn next_part(&mut self) -> Result<Option<Option<String>>, String> {
        loop {
            match self.stage {
                Stage::Preamble => match find(&self.buf, &self.delimiter) {
                    Some(at) => {
                        self.buf.advance(at + self.delimiter.len());
                        self.stage = Stage::Delimited;
                    }
                    None if self.eof => return Err("the multipart body has no boundary".into()),
                    None => {
                        self.keep_tail();
                        self.fill().await?;
                    }
                },
                Stage::Data => while self.chunk().await?.is_some() {},
                Stage::Delimited => {
                    if self.buf.len() < 2 {
                        if self.eof {
                            return Err("the multipart body ends right after a boundary".into());
                        }
                        self.fill().await?;
                        continue;
                    }
                    if self.buf.starts_with(b"--") {
                        self.stage = Stage::End;
                    } else if self.buf.starts_with(b"\r\n") {
                        self.stage = Stage::Head;
                    } else {
                        return Err("malformed multipart boundary line".into());
                    }
                }
                // The CRLF ending the boundary line is still in `buf`, so
                // headers (none, or lines each after a CRLF) end at the
                // first blank line.
                Stage::Head => match find(&self.buf, b"\r\n\r\n") {
                    Some(end) if end > HEAD_MAX => {
                        return Err(format!("a multipart part's headers are longer than {HEAD_MAX} bytes"))
                    }
                    Some(end) => {
                        let head = self.buf.split_to(end + 4);
                        let head = std::str::from_utf8(&head[..end]).map_err(|_| "multipart headers are not UTF-8")?;
                        self.stage = Stage::Data;
                        return Ok(Some(file_name(head)));
                    }
                    None if self.buf.len() > HEAD_MAX => {
                        return Err(format!("a multipart part's headers are longer than {HEAD_MAX} bytes"))
                    }
                    None if self.eof => return Err("a multipart part has no header end".into()),
                    None => self.fill().await?,
                },
                Stage::End => return Ok(None),
            }
        }
    }

    /// The next piece of the current part's data; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, String> {
        while self.stage == Stage::Data {
            if let Some(at) = find(&self.buf, &self.delimiter) {
                let data = self.buf.split_to(at).freeze();
                self.buf.advance(self.delimiter.len());
                self.stage = Stage::Delimited;
                if data.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(data));
            }
            // All but what could be the start of a delimiter is data.
            let safe = self.buf.len().saturating_sub(self.delimiter.len() - 1);
            if safe > 0 {
                return Ok(Some(self.buf.split_to(safe).freeze()));
            }
            if self.eof {
                return Err("a multipart part is not closed".into());
            }
            self.fill().await?;
        }
        Ok(None)
    }

    /// The body the form reads from, to discard what is left of it.
    pub fn body_mut(&mut self) -> &mut S {
        &mut self.body
    }

    /// Drops all of `buf` but what could be the start of a delimiter.
    fn keep_tail(&mut self) {
        let drop = self.buf.len().saturating_sub(self.delimiter.len() - 1);
        self.buf.advance(drop);
    }

    async fn fill(&mut self) -> Result<(), String> {
        match self.body.next().await {
            Some(Ok(bytes)) => self.buf.extend_from_slice(&bytes),
            // The body's own error says what went wrong (cut, bad gzip).
            Some(Err(e)) => return Err(e.to_string()),
            None => self.eof = true,
        }
        Ok(())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The `filename` a part's `Content-Disposition` gives.
fn file_name(head: &str) -> Option<String> {
    head.split("\r\n")
        .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
        .and_then(|l| {
            let i = l.find("filename=\"")? + 10;
            let rest = &l[i..];
            Some(rest[..rest.find('"')?].to_string())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    type Parts = Vec<(Option<String>, Vec<u8>)>;

    /// `body` cut into pieces of `piece` bytes, read whole.
    fn read(body: &[u8], boundary: &str, piece: usize) -> Result<Parts, String> {
        let pieces: Vec<Result<Bytes, String>> = body.chunks(piece).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let mut form = Form::new(futures_util::stream::iter(pieces), boundary);
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut parts = Vec::new();
            while let Some(name) = form.next_part().await? {
                let mut data = Vec::new();
                while let Some(chunk) = form.chunk().await? {
                    assert!(!chunk.is_empty());
                    data.extend_from_slice(&chunk);
                }
                parts.push((name, data));
            }
            Ok(parts)
        })
    }

    #[test]
    fn multipart_forms_give_each_file_however_the_body_is_cut() {
        let body = b"preamble\r\n--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/a.txt\"\r\n\
              Content-Type: text/plain\r\n\r\nhello\r\n--x not yet\r\n--xx\r\nContent-Disposition: form-data; name=\"file\"; \
              filename=\"b\"\r\n\r\n\r\n--xx\r\n\r\nno headers\r\n--xx--\r\nepilogue";
        for piece in 1..=body.len() {
            let parts = read(body, "xx", piece).unwrap();
            assert_eq!(
                parts,
                [
                    (Some("/home/user/a.txt".into()), b"hello\r\n--x not yet".to_vec()),
                    (Some("b".into()), vec![]),
                    (None, b"no headers".to_vec()),
                ],
                "cut every {piece} bytes"
            );
        }
        // Without a preamble.
        assert_eq!(read(b"--b\r\n\r\nx\r\n--b--", "b", 3).unwrap(), [(None, b"x".to_vec())]);
    }

    #[test]
    fn hostile_forms_are_refused() {
        for bad in [
            &b"--xx\r\nno header end"[..],
            b"--xx\r\n\r\nunclosed",
            b"nothing",
            b"--xxjunk",
            b"--xx",
        ] {
            assert!(read(bad, "xx", 4).is_err(), "{bad:?}");
        }
        let mut endless_head = b"--xx\r\nX: ".to_vec();
        endless_head.extend(std::iter::repeat_n(b'a', HEAD_MAX + 10));
        let err = read(&endless_head, "xx", 1000).unwrap_err();
        assert!(err.contains("longer than"), "{err}");
        // Ended, but in one piece longer than allowed.
        endless_head.extend_from_slice(b"\r\n\r\ndata\r\n--xx--");
        let err = read(&endless_head, "xx", endless_head.len()).unwrap_err();
        assert!(err.contains("longer than"), "{err}");
    }
}
