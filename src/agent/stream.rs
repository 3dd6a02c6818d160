//! Streaming the disk image: an async download (resumed with `Range` when the connection
//! drops) feeds a bounded channel; a blocking thread decompresses (zstd), hashes, counts
//! and writes in large chunks to any [`Write`] — the block device on a node, a buffer in
//! tests.

use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, RANGE};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::wire::{Compression, DeployStage, DiskImageRef};

/// Downloaded chunks in flight between the network and the disk writer.
const CHANNEL_DEPTH: usize = 32;

/// Why streaming the image failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The server answered with a status that retrying will not fix.
    #[error("GET {url}: {status}")]
    Status {
        /// The image URL.
        url: String,
        /// The answer.
        status: StatusCode,
    },
    /// Connection errors, retried until the policy gave up.
    #[error("GET {url}: gave up after {attempts} attempts at offset {offset}: {last}")]
    GaveUp {
        /// The image URL.
        url: String,
        /// Attempts without progress.
        attempts: u32,
        /// Compressed bytes received before giving up.
        offset: u64,
        /// The last error.
        last: String,
    },
    /// A resumed request was answered from the start, but data was already written.
    #[error("GET {url}: server ignored Range (answered 200) when resuming at offset {offset}")]
    RangeIgnored {
        /// The image URL.
        url: String,
        /// Where the download was resumed.
        offset: u64,
    },
    /// A resumed request was answered with the wrong part of the file.
    #[error("GET {url}: asked for bytes {offset}-, got Content-Range {got:?}")]
    BadRange {
        /// The image URL.
        url: String,
        /// Where the download was resumed.
        offset: u64,
        /// What the server sent.
        got: String,
    },
    /// The compressed stream is corrupt or truncated.
    #[error("decompress: {0}")]
    Decompress(#[source] io::Error),
    /// Writing to the destination failed.
    #[error("write: {0}")]
    Write(#[source] io::Error),
    /// The image grew past the plan's size (nothing beyond it is written).
    #[error("size mismatch: image is larger than the expected {expected} bytes")]
    TooLarge {
        /// `image.size`.
        expected: u64,
    },
    /// The image ended at a different size.
    #[error("size mismatch: expected {expected} bytes, wrote {wrote}")]
    SizeMismatch {
        /// `image.size`.
        expected: u64,
        /// Raw bytes written.
        wrote: u64,
    },
    /// The raw image hashes differently.
    #[error("sha256 mismatch: expected {expected}, wrote {wrote}")]
    ShaMismatch {
        /// `image.sha256`.
        expected: String,
        /// SHA-256 of the raw bytes written.
        wrote: String,
    },
    /// The writer thread died.
    #[error("writer thread: {0}")]
    Join(String),
}

impl StreamError {
    /// The deploy stage this error fails: the image's integrity is `verify`, the rest `write`.
    pub fn stage(&self) -> DeployStage {
        match self {
            StreamError::Decompress(_)
            | StreamError::TooLarge { .. }
            | StreamError::SizeMismatch { .. }
            | StreamError::ShaMismatch { .. } => DeployStage::Verify,
            _ => DeployStage::Write,
        }
    }
}

/// How often and how patiently a dropped download is retried.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Consecutive attempts without progress before giving up.
    pub attempts: u32,
    /// First backoff; doubled each time.
    pub first: Duration,
    /// Longest backoff.
    pub max: Duration,
}

impl RetryPolicy {
    /// The wait before retry number `n` (1-based).
    pub fn backoff(&self, n: u32) -> Duration {
        self.first
            .saturating_mul(1 << n.saturating_sub(1).min(16))
            .min(self.max)
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 8,
            first: Duration::from_secs(1),
            max: Duration::from_secs(15),
        }
    }
}

/// What the stream wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Raw (decompressed) bytes.
    pub bytes: u64,
    /// Their SHA-256, lowercase hex.
    pub sha256: String,
}

/// The end of the pipeline: hashes and counts the raw bytes, refuses more than `limit`,
/// and writes to `inner` in chunks of exactly `chunk` bytes (the last one shorter).
/// `progress` holds the bytes handed to `inner` so far.
pub struct Sink<W> {
    inner: W,
    buf: Vec<u8>,
    chunk: usize,
    hasher: Sha256,
    count: u64,
    limit: u64,
    progress: Arc<AtomicU64>,
    /// The real cause when an `io::Error` comes back through the zstd decoder.
    fault: Option<StreamError>,
}

impl<W: Write> Sink<W> {
    /// A sink over `inner`.
    pub fn new(inner: W, limit: u64, chunk: usize, progress: Arc<AtomicU64>) -> Self {
        Sink {
            inner,
            buf: Vec::with_capacity(chunk),
            chunk: chunk.max(1),
            hasher: Sha256::new(),
            count: 0,
            limit,
            progress,
            fault: None,
        }
    }

    fn flush_chunk(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.inner.write_all(&self.buf) {
            let msg = e.to_string();
            self.fault = Some(StreamError::Write(e));
            return Err(io::Error::other(msg));
        }
        self.progress
            .fetch_add(self.buf.len() as u64, Ordering::Relaxed);
        self.buf.clear();
        Ok(())
    }

    /// Writes what is buffered, flushes `inner`, and returns it with what was written.
    pub fn finish(mut self) -> Result<(W, Written), StreamError> {
        self.flush_chunk()
            .and_then(|()| self.inner.flush())
            .map_err(|e| self.fault.take().unwrap_or(StreamError::Write(e)))?;
        let written = Written {
            bytes: self.count,
            sha256: hex::encode(self.hasher.finalize()),
        };
        Ok((self.inner, written))
    }
}

impl<W: Write> Write for Sink<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.count + data.len() as u64 > self.limit {
            self.fault = Some(StreamError::TooLarge {
                expected: self.limit,
            });
            return Err(io::Error::other("image larger than expected"));
        }
        let n = data.len().min(self.chunk - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        self.hasher.update(&data[..n]);
        self.count += n as u64;
        if self.buf.len() == self.chunk {
            self.flush_chunk()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        // Chunks go out whole; `finish` writes the rest.
        Ok(())
    }
}

/// The blocking half: takes compressed chunks from `rx` until it closes, decompresses
/// them into `sink` and finishes it. A truncated zstd frame is an error.
pub fn pump<W: Write>(
    mut rx: mpsc::Receiver<Bytes>,
    compression: Compression,
    mut sink: Sink<W>,
) -> Result<(W, Written), StreamError> {
    match compression {
        Compression::None => {
            while let Some(b) = rx.blocking_recv() {
                if let Err(e) = sink.write_all(&b) {
                    return Err(sink.fault.take().unwrap_or(StreamError::Write(e)));
                }
            }
            sink.finish()
        }
        Compression::Zstd => {
            let mut dec =
                zstd::stream::write::Decoder::new(sink).map_err(StreamError::Decompress)?;
            while let Some(b) = rx.blocking_recv() {
                if let Err(e) = dec.write_all(&b) {
                    return Err(dec
                        .get_mut()
                        .fault
                        .take()
                        .unwrap_or(StreamError::Decompress(e)));
                }
            }
            if let Err(e) = dec.do_finish() {
                return Err(dec
                    .get_mut()
                    .fault
                    .take()
                    .unwrap_or(StreamError::Decompress(e)));
            }
            dec.into_inner().finish()
        }
    }
}

/// Why one attempt ended early.
enum Attempt {
    /// Worth retrying (connection refused or dropped, 5xx).
    Retry(String),
    /// Not worth it.
    Fatal(StreamError),
    /// The writer stopped taking data: its error is the one to report.
    WriterGone,
}

/// Status codes a retry can fix.
fn transient(s: StatusCode) -> bool {
    s.is_server_error() || s == StatusCode::REQUEST_TIMEOUT || s == StatusCode::TOO_MANY_REQUESTS
}

fn content_range(resp: &reqwest::Response) -> Option<&str> {
    resp.headers()
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
}

/// The total length in `Content-Range: bytes a-b/total`.
fn range_total(content_range: &str) -> Option<u64> {
    content_range.rsplit_once('/')?.1.trim().parse().ok()
}

/// One GET from `offset` on, sending chunks into `tx` and advancing `offset`. `total`
/// is the file's length once a response said it.
async fn attempt(
    client: &reqwest::Client,
    url: &str,
    offset: &mut u64,
    total: &mut Option<u64>,
    tx: &mpsc::Sender<Bytes>,
) -> Result<(), Attempt> {
    let mut req = client.get(url);
    if *offset > 0 {
        req = req.header(RANGE, format!("bytes={offset}-"));
    }
    let mut resp = req
        .send()
        .await
        .map_err(|e| Attempt::Retry(format!("{e:#}")))?;
    let status = resp.status();
    match status {
        StatusCode::OK if *offset > 0 => {
            return Err(Attempt::Fatal(StreamError::RangeIgnored {
                url: url.to_string(),
                offset: *offset,
            }));
        }
        StatusCode::OK => *total = resp.content_length().or(*total),
        // The connection dropped after the last byte but before the end was seen.
        StatusCode::RANGE_NOT_SATISFIABLE
            if content_range(&resp).and_then(range_total).or(*total) == Some(*offset) =>
        {
            return Ok(());
        }
        StatusCode::PARTIAL_CONTENT => {
            let got = content_range(&resp).unwrap_or("").to_string();
            if !got.starts_with(&format!("bytes {offset}-")) {
                return Err(Attempt::Fatal(StreamError::BadRange {
                    url: url.to_string(),
                    offset: *offset,
                    got,
                }));
            }
            *total = range_total(&got).or(*total);
        }
        s if transient(s) => return Err(Attempt::Retry(format!("{s}"))),
        s => {
            return Err(Attempt::Fatal(StreamError::Status {
                url: url.to_string(),
                status: s,
            }));
        }
    }
    loop {
        match resp.chunk().await {
            Ok(Some(b)) => {
                let n = b.len() as u64;
                tx.send(b).await.map_err(|_| Attempt::WriterGone)?;
                *offset += n;
            }
            Ok(None) => return Ok(()),
            Err(e) => return Err(Attempt::Retry(format!("{e:#}"))),
        }
    }
}

/// Downloads `url` into `tx`, resuming from the compressed offset reached when the
/// connection drops. Gives up after `retry.attempts` consecutive attempts without
/// progress. Returns the compressed size; `Err(None)` when the writer stopped first.
async fn download(
    client: &reqwest::Client,
    url: &str,
    tx: mpsc::Sender<Bytes>,
    retry: &RetryPolicy,
) -> Result<u64, Option<StreamError>> {
    let mut offset = 0u64;
    let mut total = None;
    let mut failures = 0u32;
    loop {
        let before = offset;
        match attempt(client, url, &mut offset, &mut total, &tx).await {
            Ok(()) => return Ok(offset),
            Err(Attempt::Fatal(e)) => return Err(Some(e)),
            Err(Attempt::WriterGone) => return Err(None),
            Err(Attempt::Retry(why)) => {
                failures = if offset > before { 1 } else { failures + 1 };
                if failures >= retry.attempts {
                    return Err(Some(StreamError::GaveUp {
                        url: url.to_string(),
                        attempts: failures,
                        offset,
                        last: why,
                    }));
                }
                let wait = retry.backoff(failures);
                eprintln!(
                    "pxed-agent: write: GET {url}: {why}; resuming at byte {offset} in {wait:?}"
                );
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// Streams `image` into `dest` and checks its size and SHA-256. `progress` counts raw
/// bytes handed to `dest`. Returns `dest` (to fsync) and what was written.
pub async fn stream_image<W: Write + Send + 'static>(
    client: &reqwest::Client,
    image: &DiskImageRef,
    dest: W,
    chunk: usize,
    progress: Arc<AtomicU64>,
    retry: &RetryPolicy,
) -> Result<(W, Written), StreamError> {
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    let sink = Sink::new(dest, image.size, chunk, progress);
    let compression = image.compression;
    let writer = tokio::task::spawn_blocking(move || pump(rx, compression, sink));
    let downloaded = download(client, &image.url, tx, retry).await;
    // `tx` is gone: the writer sees the end of the stream (or an early stop) and returns.
    let written = writer.await.map_err(|e| StreamError::Join(e.to_string()))?;
    match (downloaded, written) {
        (Err(Some(e)), _) => Err(e),
        (_, Err(e)) => Err(e),
        (Err(None), Ok(_)) => Err(StreamError::Join("writer stopped early".into())),
        (Ok(_), Ok((dest, w))) => {
            if w.bytes != image.size {
                return Err(StreamError::SizeMismatch {
                    expected: image.size,
                    wrote: w.bytes,
                });
            }
            if !w.sha256.eq_ignore_ascii_case(image.sha256.trim()) {
                return Err(StreamError::ShaMismatch {
                    expected: image.sha256.trim().to_ascii_lowercase(),
                    wrote: w.sha256,
                });
            }
            Ok((dest, w))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use axum::Router;
    use axum::body::Body;
    use axum::extract::State;
    use axum::http::{HeaderMap, Response, StatusCode as AxStatus, header};
    use axum::routing::get;

    /// A file server that honours `Range: bytes=N-` and can cut the first response.
    struct Server {
        data: Vec<u8>,
        /// Drop the connection after this many bytes of the first response.
        cut_first_after: Option<usize>,
        /// Answer 200 with the whole file even when asked for a range.
        ignore_range: bool,
        /// The `Range` header of each request, in order.
        ranges: Mutex<Vec<Option<String>>>,
    }

    async fn serve_file(State(s): State<Arc<Server>>, headers: HeaderMap) -> Response<Body> {
        let range = headers
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let first = {
            let mut r = s.ranges.lock().unwrap();
            r.push(range.clone());
            r.len() == 1
        };
        let len = s.data.len();
        if let (Some(r), false) = (&range, s.ignore_range)
            && r == &format!("bytes={len}-")
        {
            return Response::builder()
                .status(AxStatus::RANGE_NOT_SATISFIABLE)
                .header(header::CONTENT_RANGE, format!("bytes */{len}"))
                .body(Body::empty())
                .unwrap();
        }
        let start = match (&range, s.ignore_range) {
            (Some(r), false) => r
                .strip_prefix("bytes=")
                .and_then(|r| r.strip_suffix('-'))
                .and_then(|n| n.parse::<usize>().ok())
                .expect("open-ended range"),
            _ => 0,
        };
        let rest = Bytes::copy_from_slice(&s.data[start..]);
        let cut = s.cut_first_after.filter(|_| first);
        let mut resp = Response::builder();
        if cut.is_none() {
            // A cut response is chunked: the client cannot tell it is complete early.
            resp = resp.header(header::CONTENT_LENGTH, len - start);
        }
        resp = if start > 0 {
            resp.status(AxStatus::PARTIAL_CONTENT).header(
                header::CONTENT_RANGE,
                format!("bytes {start}-{}/{len}", len - 1),
            )
        } else {
            resp.status(AxStatus::OK)
        };
        let body = match cut {
            Some(k) => {
                let head = rest.slice(..k);
                // Send `head`, give it time to reach the client, then break the connection.
                let parts = futures::stream::unfold(0u8, move |step| {
                    let head = head.clone();
                    async move {
                        match step {
                            0 => Some((Ok::<_, io::Error>(head), 1)),
                            1 => {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                Some((Err(io::Error::other("cut")), 2))
                            }
                            _ => None,
                        }
                    }
                });
                Body::from_stream(parts)
            }
            _ => Body::from(rest),
        };
        resp.body(body).unwrap()
    }

    async fn start(server: Server) -> (String, Arc<Server>) {
        let s = Arc::new(server);
        let app = Router::new()
            .route("/img", get(serve_file))
            .with_state(s.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        (format!("http://{addr}"), s)
    }

    fn server(data: Vec<u8>) -> Server {
        Server {
            data,
            cut_first_after: None,
            ignore_range: false,
            ranges: Mutex::new(Vec::new()),
        }
    }

    /// Compressible but not trivial: a few hundred KiB, tens of KiB compressed.
    fn raw_image() -> Vec<u8> {
        let mut x = 0x1234_5678u32;
        (0..300_000)
            .map(|i| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                if i % 3 == 0 {
                    (x >> 24) as u8
                } else {
                    (i % 251) as u8
                }
            })
            .collect()
    }

    fn image(url: &str, raw: &[u8], compression: Compression) -> DiskImageRef {
        DiskImageRef {
            name: "test".into(),
            url: format!("{url}/img"),
            compression,
            size: raw.len() as u64,
            sha256: hex::encode(Sha256::digest(raw)).to_ascii_uppercase(),
            root_partition: 2,
        }
    }

    fn fast() -> RetryPolicy {
        RetryPolicy {
            attempts: 3,
            first: Duration::from_millis(10),
            max: Duration::from_millis(20),
        }
    }

    fn client() -> reqwest::Client {
        super::super::http_client().unwrap()
    }

    async fn run(
        img: &DiskImageRef,
        retry: &RetryPolicy,
    ) -> Result<(Vec<u8>, Written, u64), StreamError> {
        let progress = Arc::new(AtomicU64::new(0));
        let (out, w) = stream_image(
            &client(),
            img,
            Vec::new(),
            64 * 1024,
            progress.clone(),
            retry,
        )
        .await?;
        Ok((out, w, progress.load(Ordering::Relaxed)))
    }

    #[tokio::test]
    async fn zstd_image_is_decompressed_hashed_and_written() {
        let raw = raw_image();
        let z = zstd::encode_all(&raw[..], 3).unwrap();
        assert!(z.len() < raw.len());
        let (url, s) = start(server(z)).await;
        let img = image(&url, &raw, Compression::Zstd);
        let (out, w, progress) = run(&img, &fast()).await.unwrap();
        assert!(out == raw);
        assert_eq!(w.bytes, raw.len() as u64);
        assert_eq!(w.sha256, img.sha256.to_ascii_lowercase());
        assert_eq!(progress, raw.len() as u64);
        assert_eq!(*s.ranges.lock().unwrap(), vec![None]);
    }

    #[tokio::test]
    async fn dropped_connection_resumes_at_the_compressed_offset() {
        let raw = raw_image();
        let z = zstd::encode_all(&raw[..], 3).unwrap();
        let k = z.len() / 3;
        let (url, s) = start(Server {
            cut_first_after: Some(k),
            ..server(z)
        })
        .await;
        let img = image(&url, &raw, Compression::Zstd);
        let (out, w, _) = run(&img, &fast()).await.unwrap();
        assert!(out == raw);
        assert_eq!(w.bytes, raw.len() as u64);
        assert_eq!(
            *s.ranges.lock().unwrap(),
            vec![None, Some(format!("bytes={k}-"))]
        );
    }

    #[tokio::test]
    async fn cut_after_the_last_byte_completes_on_416() {
        let raw = raw_image();
        let (url, s) = start(Server {
            cut_first_after: Some(raw.len()),
            ..server(raw.clone())
        })
        .await;
        let img = image(&url, &raw, Compression::None);
        let (out, _, _) = run(&img, &fast()).await.unwrap();
        assert!(out == raw);
        assert_eq!(
            *s.ranges.lock().unwrap(),
            vec![None, Some(format!("bytes={}-", raw.len()))]
        );
        assert_eq!(range_total("bytes 5-9/10"), Some(10));
        assert_eq!(range_total("bytes */10"), Some(10));
        assert_eq!(range_total("bytes 5-9/*"), None);
    }

    #[tokio::test]
    async fn cut_before_any_byte_restarts_from_zero() {
        let raw = raw_image();
        let (url, s) = start(Server {
            cut_first_after: Some(0),
            ignore_range: true,
            ..server(raw.clone())
        })
        .await;
        let img = image(&url, &raw, Compression::None);
        let (out, _, _) = run(&img, &fast()).await.unwrap();
        assert!(out == raw);
        assert_eq!(*s.ranges.lock().unwrap(), vec![None, None]);
    }

    #[tokio::test]
    async fn range_ignored_after_data_fails() {
        let raw = raw_image();
        let (url, _s) = start(Server {
            cut_first_after: Some(1000),
            ignore_range: true,
            ..server(raw.clone())
        })
        .await;
        let img = image(&url, &raw, Compression::None);
        let e = run(&img, &fast()).await.unwrap_err();
        assert!(
            matches!(e, StreamError::RangeIgnored { offset: 1000, .. }),
            "{e}"
        );
        assert_eq!(e.stage(), DeployStage::Write);
    }

    #[tokio::test]
    async fn integrity_failures_are_verify_errors() {
        let raw = raw_image();
        let z = zstd::encode_all(&raw[..], 3).unwrap();
        let (url, _s) = start(server(z.clone())).await;
        let good = image(&url, &raw, Compression::Zstd);

        let wrong_sha = DiskImageRef {
            sha256: "00".repeat(32),
            ..good.clone()
        };
        let e = run(&wrong_sha, &fast()).await.unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!(
                "sha256 mismatch: expected {}, wrote ",
                "00".repeat(32)
            )),
            "{msg}"
        );
        assert!(msg.ends_with(&good.sha256.to_ascii_lowercase()), "{msg}");
        assert_eq!(e.stage(), DeployStage::Verify);

        let bigger = DiskImageRef {
            size: good.size + 1,
            ..good.clone()
        };
        let e = run(&bigger, &fast()).await.unwrap_err();
        assert!(
            matches!(e, StreamError::SizeMismatch { wrote, .. } if wrote == good.size),
            "{e}"
        );
        assert_eq!(e.stage(), DeployStage::Verify);

        let smaller = DiskImageRef {
            size: good.size - 1,
            ..good.clone()
        };
        let e = run(&smaller, &fast()).await.unwrap_err();
        assert!(matches!(e, StreamError::TooLarge { .. }), "{e}");
        assert_eq!(e.stage(), DeployStage::Verify);

        // Raw bytes served as if they were zstd.
        let (url, _s) = start(server(raw.clone())).await;
        let e = run(&image(&url, &raw, Compression::Zstd), &fast())
            .await
            .unwrap_err();
        assert!(matches!(e, StreamError::Decompress(_)), "{e}");
    }

    #[tokio::test]
    async fn http_errors_name_url_and_status() {
        let (url, _s) = start(server(vec![1, 2, 3])).await;
        let mut img = image(&url, &[1, 2, 3], Compression::None);
        img.url = format!("{url}/missing");
        let e = run(&img, &fast()).await.unwrap_err();
        assert_eq!(e.to_string(), format!("GET {url}/missing: 404 Not Found"));
        assert_eq!(e.stage(), DeployStage::Write);

        // Nothing listens there: retried, then given up.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = format!("http://{}/img", l.local_addr().unwrap());
        drop(l);
        img.url = dead;
        let e = run(&img, &fast()).await.unwrap_err();
        assert!(
            matches!(
                e,
                StreamError::GaveUp {
                    attempts: 3,
                    offset: 0,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn sink_writes_whole_chunks_and_stops_at_the_limit() {
        struct Log(Vec<usize>, Vec<u8>);
        impl Write for Log {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.push(b.len());
                self.1.extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let progress = Arc::new(AtomicU64::new(0));
        let mut s = Sink::new(Log(vec![], vec![]), 25, 10, progress.clone());
        s.write_all(&[7; 3]).unwrap();
        s.write_all(&[8; 19]).unwrap();
        assert_eq!(progress.load(Ordering::Relaxed), 20);
        assert!(s.write_all(&[9; 4]).is_err());
        assert!(matches!(
            s.fault.take(),
            Some(StreamError::TooLarge { expected: 25 })
        ));
        let (log, w) = s.finish().unwrap();
        assert_eq!(log.0, vec![10, 10, 2]);
        assert_eq!(w.bytes, 22);
        assert_eq!(w.sha256, hex::encode(Sha256::digest(&log.1)));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = RetryPolicy::default();
        let secs: Vec<u64> = (1..=6).map(|n| p.backoff(n).as_secs()).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 15, 15]);
    }
}
