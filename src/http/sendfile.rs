//! Static files with `sendfile(2)`: the bytes go from the page cache to the socket
//! without passing through pxed, as nginx sends them. Kernels, initrds and disk images
//! are almost all the bytes of a boot storm; through hyper each of them was read into
//! a buffer and written out again (two copies and a blocking-pool hop per 64 KiB).
//!
//! hyper has no way to hand a response to `sendfile`, so [`serve`](super::serve) looks
//! at each request head on a connection before hyper does (with `peek`, which
//! consumes nothing). A plain GET or HEAD of a regular file under `/ipxe/` or
//! `/images/` (no `Range`, no conditional headers, no body) is answered here; the
//! connection stays here for the next request while they keep being such requests.
//! Anything else, and any head that is not whole in the first segment, goes to hyper
//! untouched, which keeps the connection from then on. Range requests (the deploy
//! agent resuming) and conditional ones are therefore still served by tower-http's
//! `ServeDir`, with the same checks.
//!
//! Hand-written because no maintained crate puts `sendfile` under hyper or axum
//! (hyper's body is a stream of owned buffers by design); the HTTP here is only a
//! status line and five headers, parsed with `httparse` (hyper's own parser).

use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::io::{AsyncReadExt, Interest};
use tokio::net::TcpStream;

/// The largest request head looked at here; longer ones go to hyper.
pub const PEEK: usize = 8 * 1024;

/// Bytes handed to one `sendfile` call: large enough to amortise the call, small
/// enough that a connection does not hog a worker thread.
const CHUNK: usize = 4 << 20;

/// `[pacing] transfer_nice`, set by [`serve`](super::serve) before the first transfer
/// builds [`files_runtime`].
static TRANSFER_NICE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Sets how many nice steps below the rest of pxed the transfer threads run; read once,
/// when the first file goes out.
pub fn set_transfer_nice(steps: u32) {
    TRANSFER_NICE.store(steps, std::sync::atomic::Ordering::Relaxed);
}

/// The calling thread's nice value.
fn thread_nice() -> std::io::Result<i32> {
    use nix::errno::Errno;
    // `getpriority` answers -1 both for an error and for a nice value of -1: errno
    // tells them apart.
    Errno::clear();
    // SAFETY: reads the calling thread's nice value (`who` 0); no memory is passed.
    let v = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    match Errno::last() {
        e if v == -1 && e != Errno::UnknownErrno => Err(e.into()),
        _ => Ok(v),
    }
}

/// Sets the calling thread's nice value. On Linux it belongs to the thread, so the
/// rest of the process keeps its own; raising it needs no privilege.
fn set_thread_nice(v: i32) -> std::io::Result<()> {
    // SAFETY: `setpriority` with `who` 0 changes only the calling thread.
    nix::errno::Errno::result(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, v) })?;
    Ok(())
}

/// The runtime file transfers run on, apart from the one that answers DHCP, TFTP,
/// scripts, callbacks and the API. A transfer is a loop of `sendfile` calls that each
/// copy megabytes; with a hundred of them on the same worker threads, every other task
/// waited behind them for its turn, and so did the store's one writer connection,
/// which a write holds across several turns: in a 1,000-node storm the writer finished
/// 64 writes a second with 400 queued, and callbacks took seconds. On threads of
/// their own, transfers share the CPU through the kernel's scheduler, which runs a
/// woken DHCP or store task within a time slice. They also run `transfer_nice` steps
/// below the rest of pxed (10 by default): with the cores full, CFS then gives a woken
/// DHCP, callback or store task most of a core at once instead of an equal share with
/// a hundred transfers. In 1,000-node storms on 2 cores that cut the time the store's
/// writer was held by a fifth and the finish from 1.36× to 1.25× the byte floor
/// (medians of six alternated pairs; bench/RESULTS.md, "The writer's hold, and the
/// transfers' priority"); the bytes still go out at the machine's full rate, as nothing
/// else wants the CPU most of the time. `bench/http.sh` runs them at nice 0, since there
/// the load generator shares the cores. `None` if it could not be built (then transfers
/// run where they are accepted).
fn files_runtime() -> Option<&'static tokio::runtime::Runtime> {
    static FILES: std::sync::OnceLock<Option<tokio::runtime::Runtime>> = std::sync::OnceLock::new();
    FILES
        .get_or_init(|| {
            let threads = std::thread::available_parallelism().map_or(2, usize::from);
            // Every thread of the runtime gets the same value, its blocking threads too
            // (which inherit their spawner's): the builder's own plus the steps.
            let steps = TRANSFER_NICE.load(std::sync::atomic::Ordering::Relaxed);
            let target = match thread_nice() {
                Ok(own) if steps > 0 => Some(own.saturating_add(steps.min(19) as i32).min(19)),
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(error = %e, steps, "file transfers keep pxed's priority");
                    None
                }
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("pxed-files")
                .on_thread_start(move || {
                    if let Some(v) = target
                        && let Err(e) = set_thread_nice(v)
                    {
                        // Once, not per thread (a seccomp filter without setpriority).
                        static WARNED: std::sync::Once = std::sync::Once::new();
                        WARNED.call_once(|| {
                            tracing::warn!(error = %e, steps, "file transfers keep pxed's priority");
                        });
                    }
                })
                .enable_all()
                .build()
                .inspect_err(
                    |e| tracing::warn!(error = %e, "no runtime of its own for file transfers"),
                )
                .ok()
        })
        .as_ref()
}

/// A request this module answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRequest {
    /// Length of the request head (the bytes to consume).
    pub head_len: usize,
    /// HEAD: headers only.
    pub head_only: bool,
    /// Which tree: `ipxe` or `images`.
    pub tree: Tree,
    /// The path inside the tree, percent-decoded, without a leading `/`.
    pub rel: String,
    /// The path as requested (without the query), for stage tracking.
    pub path: String,
    /// Whether the connection stays open after the response.
    pub keep_alive: bool,
}

/// The static trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tree {
    Ipxe,
    Images,
}

/// What a peeked head is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// A plain file GET/HEAD: answered here.
    File(FileRequest),
    /// Anything else, or not whole yet: hyper's.
    Other,
}

/// Decides from the peeked bytes, purely: see the module docs for what qualifies.
pub fn classify(buf: &[u8]) -> Head {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(head_len)) = req.parse(buf) else {
        return Head::Other;
    };
    let head_only = match req.method {
        Some("GET") => false,
        Some("HEAD") => true,
        _ => return Head::Other,
    };
    let Some(target) = req.path else {
        return Head::Other;
    };
    let path = target.split(['?', '#']).next().unwrap_or_default();
    let (tree, rest) = if let Some(r) = path.strip_prefix("/ipxe/") {
        (Tree::Ipxe, r)
    } else if let Some(r) = path.strip_prefix("/images/") {
        (Tree::Images, r)
    } else {
        return Head::Other;
    };
    let Ok(rel) = percent_encoding::percent_decode_str(rest).decode_utf8() else {
        return Head::Other;
    };
    if rel.is_empty() || rel.contains('\0') {
        return Head::Other;
    }
    // HTTP/1.0 closes unless it asks otherwise; 1.1 stays open unless it asks to close.
    let mut keep_alive = req.version == Some(1);
    for h in req.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        match name.as_str() {
            "range"
            | "if-range"
            | "if-match"
            | "if-none-match"
            | "if-modified-since"
            | "if-unmodified-since"
            | "transfer-encoding"
            | "expect"
            | "upgrade" => {
                return Head::Other;
            }
            "content-length" if h.value.trim_ascii() != b"0" => return Head::Other,
            "connection" => {
                let v = String::from_utf8_lossy(h.value).to_ascii_lowercase();
                if v.split(',').any(|t| t.trim() == "close") {
                    keep_alive = false;
                } else if v.split(',').any(|t| t.trim() == "keep-alive") {
                    keep_alive = true;
                }
            }
            _ => {}
        }
    }
    Head::File(FileRequest {
        head_len,
        head_only,
        tree,
        rel: rel.into_owned(),
        path: path.to_string(),
        keep_alive,
    })
}

/// The response head for a file of `len` bytes last modified at `modified`.
pub fn response_head(
    rel: &str,
    len: u64,
    modified: Option<SystemTime>,
    keep_alive: bool,
) -> String {
    let mime = mime_guess::from_path(rel).first_or_octet_stream();
    let mut h = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {mime}\r\ncontent-length: {len}\r\naccept-ranges: bytes\r\n"
    );
    if let Some(m) = modified {
        h.push_str(&format!(
            "last-modified: {}\r\n",
            httpdate::fmt_http_date(m)
        ));
    }
    h.push_str(&format!(
        "date: {}\r\n",
        httpdate::fmt_http_date(SystemTime::now())
    ));
    if !keep_alive {
        h.push_str("connection: close\r\n");
    }
    h.push_str("\r\n");
    h
}

/// The open file behind a request, or `None` when it is not a regular file inside
/// `root` (then hyper answers, with the same 404 as every other way in).
fn open_inside(root: &Path, rel: &str) -> Option<(std::fs::File, std::fs::Metadata)> {
    use std::os::unix::fs::OpenOptionsExt;
    // A FIFO must not even be opened (that blocks until a writer comes): the check
    // comes first, and O_NONBLOCK covers one swapped in between the two calls.
    let real = super::regular_file_inside(root, rel)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&real)
        .ok()?;
    let meta = file.metadata().ok()?;
    meta.is_file().then_some((file, meta))
}

/// How one answered request went.
#[derive(Debug)]
pub enum Served {
    /// The whole response went out; `bytes` of file data.
    Whole { bytes: u64, keep_alive: bool },
    /// Not a file this module serves: hyper must answer (nothing was consumed).
    NotHere,
}

/// Answers `req` on `stream`: consumes its head, writes the response head, then the
/// file with `sendfile`.
pub async fn answer(
    stream: &mut TcpStream,
    req: &FileRequest,
    roots: (&Path, &Path),
) -> std::io::Result<Served> {
    let root: PathBuf = match req.tree {
        Tree::Ipxe => roots.0.to_owned(),
        Tree::Images => roots.1.to_owned(),
    };
    let rel = req.rel.clone();
    // canonicalize and open may touch the disk: off the async threads.
    let Some((file, meta)) = tokio::task::spawn_blocking(move || open_inside(&root, &rel))
        .await
        .ok()
        .flatten()
    else {
        return Ok(Served::NotHere);
    };
    let mut head = vec![0; req.head_len];
    stream.read_exact(&mut head).await?;
    let len = meta.len();
    let out = response_head(&req.rel, len, meta.modified().ok(), req.keep_alive);
    // MSG_MORE: the head waits for the first file bytes, one segment instead of two.
    let more = if req.head_only || len == 0 {
        nix::sys::socket::MsgFlags::empty()
    } else {
        nix::sys::socket::MsgFlags::from_bits_retain(libc::MSG_MORE)
    };
    let mut sent = 0;
    while sent < out.len() {
        sent += stream
            .async_io(Interest::WRITABLE, || {
                nix::sys::socket::send(stream.as_raw_fd(), &out.as_bytes()[sent..], more)
                    .map_err(std::io::Error::from)
            })
            .await?;
    }
    if req.head_only {
        return Ok(Served::Whole {
            bytes: 0,
            keep_alive: req.keep_alive,
        });
    }
    let mut offset: i64 = 0;
    while (offset as u64) < len {
        let want = ((len - offset as u64) as usize).min(CHUNK);
        let n = stream
            .async_io(Interest::WRITABLE, || {
                nix::sys::sendfile::sendfile(stream.as_fd(), file.as_fd(), Some(&mut offset), want)
                    .map_err(std::io::Error::from)
            })
            .await?;
        if n == 0 {
            // The file shrank under us: the promised length cannot be kept.
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "file shrank while being sent",
            ));
        }
    }
    Ok(Served::Whole {
        bytes: len,
        keep_alive: req.keep_alive,
    })
}

/// Answers plain file requests on a fresh connection for as long as they come (see the
/// module docs). Returns the stream when hyper must take over (the next request is not
/// one of ours, nothing of it consumed), or `None` when the connection is done.
///
/// The first head is looked at where the connection was accepted; a connection whose
/// first request is a file moves to [`files_runtime`] for as long as it asks for files
/// and comes back for hyper.
pub async fn files_first(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    st: &Arc<crate::state::AppState>,
    stats: &Arc<super::ConnStats>,
    cancel: &tokio_util::sync::CancellationToken,
) -> Option<TcpStream> {
    let mut buf = vec![0; PEEK];
    let n = peek_head(&stream, &mut buf, cancel).await?;
    if !matches!(classify(&buf[..n]), Head::File(_)) {
        return Some(stream);
    }
    let Some(rt) = files_runtime() else {
        return files_loop(stream, peer, st, stats, cancel).await;
    };
    let plain = stream.into_std().ok()?;
    let (st, stats, cancel) = (st.clone(), stats.clone(), cancel.clone());
    let job = rt.spawn(async move {
        let stream = TcpStream::from_std(plain).ok()?;
        let back = files_loop(stream, peer, &st, &stats, &cancel).await?;
        back.into_std().ok()
    });
    let back = job.await.ok()??;
    TcpStream::from_std(back).ok()
}

/// The bytes of the next request head there are so far, without consuming them; `None`
/// when the connection is done (closed, cancelled, or idle past the header timeout,
/// which an idle keep-alive connection gets as under hyper).
async fn peek_head(
    stream: &TcpStream,
    buf: &mut [u8],
    cancel: &tokio_util::sync::CancellationToken,
) -> Option<usize> {
    let n = tokio::select! {
        _ = cancel.cancelled() => return None,
        r = tokio::time::timeout(super::HEADER_TIMEOUT, stream.peek(buf)) => match r {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return None,
        },
    };
    (n > 0).then_some(n)
}

async fn files_loop(
    mut stream: TcpStream,
    peer: std::net::SocketAddr,
    st: &crate::state::AppState,
    stats: &super::ConnStats,
    cancel: &tokio_util::sync::CancellationToken,
) -> Option<TcpStream> {
    let client: IpAddr = crate::credential::canonical(peer.ip());
    let mut buf = vec![0; PEEK];
    loop {
        let n = peek_head(&stream, &mut buf, cancel).await?;
        let Head::File(req) = classify(&buf[..n]) else {
            return Some(stream);
        };
        let began = Instant::now();
        let roots = (st.cfg.ipxe_dir.as_path(), st.cfg.images_dir.as_path());
        // A GET holds its pacing slot while the file goes out (DHCP offers wait on it).
        let _slot = (!req.head_only).then(|| {
            st.slots.acquire(match req.tree {
                Tree::Ipxe => crate::pacing::Slot::FirstStage,
                Tree::Images => crate::pacing::Slot::Stream,
            })
        });
        match answer(&mut stream, &req, roots).await {
            Ok(Served::NotHere) => return Some(stream),
            Ok(Served::Whole { bytes, keep_alive }) => {
                stats.sendfile_responses.inc();
                stats.sendfile_bytes.add(bytes);
                if !req.head_only {
                    crate::stages::http::saw_file(&st.stages, client, &req.path, bytes, began);
                }
                if !keep_alive {
                    return None;
                }
            }
            Err(e) => {
                tracing::debug!(%peer, path = %req.path, error = %e, "file transfer ended early");
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(buf: &str) -> FileRequest {
        match classify(buf.as_bytes()) {
            Head::File(f) => f,
            Head::Other => panic!("not a file request: {buf:?}"),
        }
    }

    #[test]
    fn plain_gets_and_heads_of_the_trees_are_files() {
        let head = "GET /images/debian/kernel HTTP/1.1\r\nHost: x\r\n\r\n";
        let f = file(&format!("{head}GET /images/next HTTP/1.1\r\n"));
        assert_eq!(f.tree, Tree::Images);
        assert_eq!(f.rel, "debian/kernel");
        assert_eq!(f.path, "/images/debian/kernel");
        assert!(f.keep_alive && !f.head_only);
        assert_eq!(
            f.head_len,
            head.len(),
            "a pipelined request behind is not consumed"
        );
        let f = file("HEAD /ipxe/snp%6Fnly.efi?x=1 HTTP/1.0\r\n\r\n");
        assert_eq!((f.tree, f.rel.as_str()), (Tree::Ipxe, "snponly.efi"));
        assert!(f.head_only && !f.keep_alive);
        assert!(file("GET /ipxe/a HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive);
        assert!(!file("GET /ipxe/a HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive);
        assert!(file("GET /ipxe/a HTTP/1.1\r\nContent-Length: 0\r\n\r\n").keep_alive);
    }

    #[test]
    fn everything_else_is_hypers() {
        for head in [
            "GET /ipxe/a HTTP/1.1\r\nHost: x\r\n",
            "GET /ipxe/a HTTP/1.1\r\nRange: bytes=0-1\r\n\r\n",
            "GET /ipxe/a HTTP/1.1\r\nIf-None-Match: \"x\"\r\n\r\n",
            "GET /ipxe/a HTTP/1.1\r\nIf-Modified-Since: Sat, 1 Jan 2000 00:00:00 GMT\r\n\r\n",
            "GET /ipxe/a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
            "GET /ipxe/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST /ipxe/a HTTP/1.1\r\n\r\n",
            "GET /boot/aa.ipxe HTTP/1.1\r\n\r\n",
            "GET /api/v1/nodes HTTP/1.1\r\n\r\n",
            "GET /ipxe/ HTTP/1.1\r\n\r\n",
            "GET /ipxe/%ff HTTP/1.1\r\n\r\n",
            "GET /ipxe/a%00b HTTP/1.1\r\n\r\n",
            "\x16\x03\x01\x02\x00",
            "",
        ] {
            assert_eq!(classify(head.as_bytes()), Head::Other, "{head:?}");
        }
    }

    #[test]
    fn the_response_head_names_type_length_and_date() {
        let h = response_head("snponly.efi", 42, Some(SystemTime::UNIX_EPOCH), false);
        assert!(h.starts_with("HTTP/1.1 200 OK\r\n"), "{h}");
        assert!(h.contains("content-length: 42\r\n"), "{h}");
        assert!(
            h.contains("last-modified: Thu, 01 Jan 1970 00:00:00 GMT\r\n"),
            "{h}"
        );
        assert!(
            h.contains("connection: close\r\n") && h.ends_with("\r\n\r\n"),
            "{h}"
        );
        let h = response_head("kernel", 1, None, true);
        assert!(
            h.contains("content-type: application/octet-stream\r\n"),
            "{h}"
        );
        assert!(!h.contains("connection:"), "{h}");
    }

    #[test]
    fn only_regular_files_inside_the_root_open() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("f"), b"x").unwrap();
        std::fs::create_dir(t.path().join("d")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", t.path().join("out")).unwrap();
        std::os::unix::fs::symlink("f", t.path().join("in")).unwrap();
        assert!(open_inside(t.path(), "f").is_some());
        assert!(open_inside(t.path(), "in").is_some());
        for no in ["d", "out", "../etc/passwd", "missing"] {
            assert!(open_inside(t.path(), no).is_none(), "{no}");
        }
    }

    /// The transfer threads' priority: set on that thread only.
    #[test]
    fn thread_nice_is_per_thread() {
        let own = thread_nice().unwrap();
        let (base, after, inherited) = std::thread::spawn(|| {
            let base = thread_nice().unwrap();
            set_thread_nice((base + 3).min(19)).unwrap();
            let after = thread_nice().unwrap();
            let inherited = std::thread::spawn(|| {
                set_thread_nice(thread_nice().unwrap()).unwrap();
                thread_nice().unwrap()
            })
            .join()
            .unwrap();
            (base, after, inherited)
        })
        .join()
        .unwrap();
        assert_eq!(after, (base + 3).min(19));
        assert_eq!(inherited, after);
        assert_eq!(thread_nice().unwrap(), own);
    }
}
