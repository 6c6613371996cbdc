//! gzip on envd's `/files`, as `files.write(gzip=True)` and
//! `files.read(gzip=True)` use it: an upload with `Content-Encoding: gzip`
//! is inflated as it arrives, a few KiB of it at a time (so a small body
//! that inflates enormously never sits in memory whole; the upload limit
//! counts inflated bytes), and a download asked for with
//! `Accept-Encoding: gzip` alone is deflated as it streams out.

use std::io::Write;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use flate2::write::{GzEncoder, MultiGzDecoder};
use futures_util::Stream;

/// The most compressed bytes inflated at once: deflate's ratio is at most
/// about 1:1032, so one step makes at most ~4 MiB.
const STEP: usize = 4 << 10;

/// A request body, inflated when it came gzip-compressed.
pub struct Inflated<S> {
    raw: S,
    gz: Option<MultiGzDecoder<Vec<u8>>>,
    pending: Bytes,
    done: bool,
}

impl<S> Inflated<S> {
    /// `raw` as it is (`gzip` false) or inflated.
    pub fn new(raw: S, gzip: bool) -> Inflated<S> {
        Inflated {
            raw,
            gz: gzip.then(|| MultiGzDecoder::new(Vec::new())),
            pending: Bytes::new(),
            done: false,
        }
    }

    /// The body as it arrives, to discard what is left of it.
    pub fn raw_mut(&mut self) -> &mut S {
        &mut self.raw
    }
}

fn bad(e: std::io::Error) -> String {
    format!("the gzip-compressed upload is not valid gzip: {e}")
}

impl<S, E> Stream for Inflated<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    type Item = Result<Bytes, String>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let Some(gz) = this.gz.as_mut() else {
            return Pin::new(&mut this.raw)
                .poll_next(cx)
                .map(|o| o.map(|r| r.map_err(|e| format!("the upload was cut short: {e}"))));
        };
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if !this.pending.is_empty() {
                let step = this.pending.split_to(STEP.min(this.pending.len()));
                if let Err(e) = gz.write_all(&step) {
                    this.done = true;
                    return Poll::Ready(Some(Err(bad(e))));
                }
                let out = std::mem::take(gz.get_mut());
                if !out.is_empty() {
                    return Poll::Ready(Some(Ok(Bytes::from(out))));
                }
                continue;
            }
            match Pin::new(&mut this.raw).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => this.pending = chunk,
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(format!("the upload was cut short: {e}"))));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    if let Err(e) = gz.try_finish() {
                        return Poll::Ready(Some(Err(bad(e))));
                    }
                    let out = std::mem::take(gz.get_mut());
                    return Poll::Ready((!out.is_empty()).then(|| Ok(Bytes::from(out))));
                }
            }
        }
    }
}

/// Whether a request's `Accept-Encoding` asks for gzip alone (what
/// `read(gzip=True)` sends). A client's default list (`gzip, deflate`)
/// gets the bytes as they are: deflating costs more than loopback or a LAN
/// saves.
pub fn asks_for_gzip(accept: Option<&str>) -> bool {
    accept.is_some_and(|v| {
        let codings: Vec<&str> = v.split(',').map(|c| c.split(';').next().unwrap_or("").trim()).collect();
        codings.len() == 1 && codings[0].eq_ignore_ascii_case("gzip")
    })
}

/// A response body deflated as it streams.
pub struct Deflated<S> {
    raw: S,
    gz: Option<GzEncoder<Vec<u8>>>,
}

impl<S> Deflated<S> {
    pub fn new(raw: S) -> Deflated<S> {
        Deflated {
            raw,
            gz: Some(GzEncoder::new(Vec::new(), flate2::Compression::fast())),
        }
    }
}

impl<S, E> Stream for Deflated<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Into<axum::BoxError>,
{
    type Item = Result<Bytes, axum::BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            let Some(gz) = this.gz.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(&mut this.raw).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    if let Err(e) = gz.write_all(&chunk) {
                        this.gz = None;
                        return Poll::Ready(Some(Err(e.into())));
                    }
                    let out = std::mem::take(gz.get_mut());
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Bytes::from(out))));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.gz = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Ready(None) => {
                    let Some(gz) = this.gz.take() else {
                        return Poll::Ready(None);
                    };
                    return Poll::Ready(Some(gz.finish().map(Bytes::from).map_err(Into::into)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn pieces(data: &[u8], size: usize) -> impl Stream<Item = Result<Bytes, String>> + Unpin {
        let v: Vec<Result<Bytes, String>> = data.chunks(size).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        futures_util::stream::iter(v)
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    async fn inflate(body: &[u8], piece: usize) -> Result<Vec<u8>, String> {
        let mut s = Inflated::new(pieces(body, piece), true);
        let mut out = Vec::new();
        while let Some(c) = s.next().await {
            let c = c?;
            assert!(c.len() <= 5 << 20, "one step inflated {} bytes", c.len());
            out.extend_from_slice(&c);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn uploads_inflate_in_bounded_steps_however_they_are_cut() {
        let text: Vec<u8> = (0..200_000u32)
            .flat_map(|i| format!("line {i}\n").into_bytes())
            .collect();
        let body = gzip(&text);
        for piece in [1, 7, 4096, 100_000, body.len()] {
            assert_eq!(inflate(&body, piece).await.unwrap(), text, "piece {piece}");
        }
        // Two members, as `cat a.gz b.gz` makes.
        let two = [gzip(b"first "), gzip(b"second")].concat();
        assert_eq!(inflate(&two, 3).await.unwrap(), b"first second");
        // 16 MiB of zeros from ~16 KiB: never more than a step's worth held.
        let bomb = gzip(&vec![0u8; 16 << 20]);
        assert_eq!(inflate(&bomb, 1 << 20).await.unwrap().len(), 16 << 20);
    }

    #[tokio::test]
    async fn bad_and_cut_gzip_are_refused() {
        assert!(inflate(b"not gzip at all", 4)
            .await
            .unwrap_err()
            .contains("not valid gzip"));
        let body = gzip(b"hello hello hello");
        assert!(inflate(&body[..body.len() - 5], 4).await.is_err());
    }

    #[tokio::test]
    async fn downloads_deflate_to_what_inflates_back() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut s = Deflated::new(pieces(&data, 10_000).map(|r| r.map_err(axum::BoxError::from)));
        let mut gz = Vec::new();
        while let Some(c) = s.next().await {
            gz.extend_from_slice(&c.unwrap());
        }
        assert_eq!(inflate(&gz, 999).await.unwrap(), data);
        assert!(gz.len() < data.len() / 4);
    }

    #[test]
    fn only_gzip_alone_is_asked_for() {
        assert!(asks_for_gzip(Some("gzip")));
        assert!(asks_for_gzip(Some(" GZIP ;q=1")));
        assert!(!asks_for_gzip(Some("gzip, deflate")));
        assert!(!asks_for_gzip(Some("identity")));
        assert!(!asks_for_gzip(None));
    }
}
