//! The listener loop and the per-transfer state machine.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::admission::{Admission, Refused, Ticket};
use super::options::{Negotiated, negotiate};
use super::packet::{self, ClientPacket, ErrorCode, MAX_REQUEST, Mode};
use super::path::Refusal;
use super::{TftpError, TftpStats};
use crate::config::TftpSettings;

/// Netascii files are converted in memory when opened, before the client has
/// answered; larger ones are refused, so a flood of half-open netascii requests
/// holds at most this (about twice) per transfer slot. Netascii is a relic (boot
/// loaders ask for octet): this covers iPXE scripts and boot-loader menus.
const MAX_NETASCII: u64 = 64 << 10;

/// Transfers one client address may have in flight. UEFI firmware has two at most
/// (its tsize probe ends with an ERROR as the real request comes), iPXE and BIOS
/// ROMs one; the cap keeps one address (or one forged address) from taking the
/// slots of the others. Clients behind one NAT address share it.
const MAX_PER_CLIENT: usize = 4;

/// Files opened at once on the blocking pool. An open never waits (see
/// `path::open`), so a few suffice; unbounded, a burst of requests starts a pool
/// thread for each open still running when the next comes (a 600-request burst
/// started about 60, idle for 10 s after).
const OPENS: usize = 4;

/// How long a half-open transfer waits for the client's first ACK (of the OACK or
/// DATA 1) before sending it again; at most the transfer's timeout.
const FIRST_ACK_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Sends of the OACK or DATA 1 to a silent client: one loss is covered, and a
/// forged request is answered with two packets, not `retries` + 1 (a client that
/// lost both copies asks again, as PXE ROMs do).
///
/// After the last send the transfer still listens for the ACK as long as an
/// answered one waits (the timeout × (retries + 1)): a firmware that got the OACK
/// resends only its ACK, never the request, and OVMF does so after 4 s
/// (`PXEBC_MTFTP_TIMEOUT`). A transfer that gave up sooner turned one lost ACK into
/// a failed boot: the storm bench lost 77 of 1,000 nodes so when its clients
/// answered late. The slot is not held against newcomers meanwhile: past the grace
/// a newcomer takes it (see [`super::admission`]).
const FIRST_ACK_TRIES: u32 = 2;

/// Serves files under `root` over TFTP on `socket` until `cancel` fires.
///
/// On cancellation the listener stops at once and in-flight transfers send the
/// client an ERROR and end; the function returns when they have.
///
/// The reply source address: each transfer's socket is bound to the address the
/// request was sent to, so replies come from the address the client contacted
/// (clients and firewalls insist). If `socket` is bound to a specific address that
/// is the address; if it is bound to `0.0.0.0`, IP_PKTINFO on the listening socket
/// tells us per request. (An IPv6 wildcard listener leaves the choice to the kernel.)
pub async fn serve(
    socket: UdpSocket,
    root: PathBuf,
    settings: TftpSettings,
    stats: Arc<TftpStats>,
    cancel: CancellationToken,
) -> Result<(), TftpError> {
    let root = tokio::fs::canonicalize(&root)
        .await
        .map_err(|source| TftpError::Root { path: root, source })?;
    let local = socket
        .local_addr()
        .map_err(|source| TftpError::Socket { source })?;
    let pktinfo = matches!(local.ip(), IpAddr::V4(ip) if ip.is_unspecified());
    if pktinfo {
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv4PacketInfo, &true)
            .map_err(|e| TftpError::Socket { source: e.into() })?;
    }
    tracing::info!(addr = %local, root = %root.display(), "TFTP listening");

    let ctx = Arc::new(Ctx {
        root,
        settings: settings.clone(),
        stats: stats.clone(),
        opens: tokio::sync::Semaphore::new(OPENS),
    });
    let admission = Admission::new(settings.max_transfers, MAX_PER_CLIENT);
    let transfers = TaskTracker::new();
    let mut buf = vec![0u8; MAX_REQUEST + 1];
    let mut cmsg = nix::cmsg_space!(libc::in_pktinfo);
    let mut out = Vec::with_capacity(64);

    let result = loop {
        let received = tokio::select! {
            biased;
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => break Ok(()),
            // CANCEL-SAFETY: both receive paths take a datagram only when it is
            // returned; a dropped future leaves it queued.
            r = recv(&socket, pktinfo, &mut buf, &mut cmsg) => r,
        };
        let (n, peer, dst) = match received {
            Ok(r) => r,
            Err(e) => {
                if !crate::net::after_recv_error("tftp", &e).await {
                    stats.recv_errors.inc();
                }
                continue;
            }
        };
        let req = match packet::parse_request(&buf[..n]) {
            Ok(r) if peer.port() != 0 => r,
            Ok(_) => {
                stats.malformed_dropped.inc();
                continue;
            }
            Err(reason) => {
                stats.malformed_dropped.inc();
                tracing::debug!(%peer, %reason, "malformed TFTP packet dropped");
                continue;
            }
        };
        stats.requests.inc();
        let name = String::from_utf8_lossy(req.filename);
        if req.write {
            stats.refused.inc();
            tracing::info!(%peer, file = %name, "TFTP write request refused");
            packet::encode_error(&mut out, ErrorCode::AccessViolation, "read-only server");
            let _ = socket.send_to(&out, peer).await;
            continue;
        }
        if req.mode == Mode::Other {
            stats.refused.inc();
            tracing::info!(%peer, file = %name, "TFTP mode not supported");
            packet::encode_error(&mut out, ErrorCode::IllegalOperation, "mode not supported");
            let _ = socket.send_to(&out, peer).await;
            continue;
        }
        let ticket = match admission.admit(peer.ip()) {
            Ok(ticket) => ticket,
            Err(Refused::Client) => {
                // Counted; logged at debug, as a flood would log a line per packet.
                stats.busy_client.inc();
                tracing::debug!(%peer, file = %name, max = MAX_PER_CLIENT, "TFTP client at its transfer limit");
                packet::encode_error(
                    &mut out,
                    ErrorCode::Undefined,
                    "server busy (per-client limit)",
                );
                let _ = socket.send_to(&out, peer).await;
                continue;
            }
            Err(Refused::Full) => {
                // Not answered: firmware gives up the whole boot on an ERROR, but
                // sends its RRQ again after its timeout (OVMF and PXE ROMs: a few
                // seconds, several times), and that one is served once a slot is
                // free. Seen in the boot storm: 1,000 machines powered on at once
                // got 186 "server busy" errors, each a failed boot.
                stats.busy.inc();
                tracing::debug!(%peer, file = %name, max = settings.max_transfers, "TFTP full: request left for the client to retransmit");
                continue;
            }
        };
        let local_ip = dst.unwrap_or(local.ip());
        let owned = OwnedRequest {
            filename: req.filename.to_vec(),
            netascii: req.mode == Mode::Netascii,
            options: req
                .options
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let (ctx, cancel) = (ctx.clone(), cancel.clone());
        stats.active.inc();
        let active = ActiveGuard(stats.clone());
        // Counted from admission to the end of the task, as `active` is: a half-open
        // transfer holds a slot too, until it is answered or given up.
        let slot = stats
            .slots
            .get()
            .map(|s| s.acquire(crate::pacing::Slot::FirstStage));
        transfers.spawn(async move {
            let _active = active;
            let _slot = slot;
            transfer(&ctx, peer, local_ip, owned, ticket, cancel).await;
        });
    };
    transfers.close();
    if result.is_err() {
        // Our transfers share the caller's token; they end on their own timeouts.
        tracing::warn!("TFTP listener failed; waiting for in-flight transfers");
    }
    transfers.wait().await;
    result
}

struct Ctx {
    root: PathBuf,
    settings: TftpSettings,
    stats: Arc<TftpStats>,
    /// Opens on the blocking pool at once (see `OPENS`).
    opens: tokio::sync::Semaphore,
}

struct OwnedRequest {
    filename: Vec<u8>,
    netascii: bool,
    options: Vec<(String, String)>,
}

/// Decrements the active gauge however the transfer task ends, even if it is
/// dropped unpolled.
struct ActiveGuard(Arc<TftpStats>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.dec();
    }
}

fn transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    ) || e.raw_os_error() == Some(libc::ENOBUFS)
}

/// Receives one datagram: its length, its sender, and (with IP_PKTINFO) the local
/// address it was sent to.
async fn recv(
    socket: &UdpSocket,
    pktinfo: bool,
    buf: &mut [u8],
    cmsg: &mut [u8],
) -> io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    if !pktinfo {
        let (n, peer) = socket.recv_from(buf).await?;
        return Ok((n, peer, None));
    }
    socket
        .async_io(Interest::READABLE, || recv_pktinfo(socket, buf, cmsg))
        .await
}

fn recv_pktinfo(
    socket: &UdpSocket,
    buf: &mut [u8],
    cmsg: &mut [u8],
) -> io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg};
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrIn>(
        socket.as_raw_fd(),
        &mut iov,
        Some(cmsg),
        MsgFlags::MSG_DONTWAIT,
    )
    .map_err(io::Error::from)?;
    let peer = msg
        .address
        .map(|a| SocketAddr::from((a.ip(), a.port())))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no sender address"))?;
    let mut dst = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::Ipv4PacketInfo(pi) = c {
                let addr = Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr));
                let spec = Ipv4Addr::from(u32::from_be(pi.ipi_spec_dst.s_addr));
                // A request to a broadcast address is answered from the
                // interface's own address.
                let ip = if addr.is_broadcast() || addr.is_multicast() || addr.is_unspecified() {
                    spec
                } else {
                    addr
                };
                dst = Some(IpAddr::V4(ip));
            }
        }
    }
    Ok((msg.bytes, peer, dst))
}

/// A transfer's two sockets, both on one fresh ephemeral port (the server's TID)
/// on the address the client contacted.
///
/// `data` is connected to the client, as tftpd-hpa's transfer socket is: the kernel
/// delivers only the client's packets to it and skips a route lookup per block, and
/// if the client's port closes, the ICMP error ends the transfer at once instead of
/// after every retry. Lock-step transfers (curl, BIOS PXE ROMs) measured about 3–5%
/// faster connected (`bench/tftp.sh`). `strays` is unconnected and gets everything else that reaches
/// the port, so a stray sender can still be told ERROR 5 (RFC 1350 section 4);
/// Linux hands a datagram to the socket whose binding matches it most closely.
struct TransferSockets {
    data: UdpSocket,
    strays: UdpSocket,
}

fn bind_transfer(local: IpAddr, peer: SocketAddr) -> io::Result<TransferSockets> {
    let any = SocketAddr::new(local, 0);
    let new = || Socket::new(Domain::for_address(any), Type::DGRAM, Some(Protocol::UDP));
    // Bound without SO_REUSEADDR, so the kernel picks a port no socket holds.
    let strays = new()?;
    strays.set_nonblocking(true)?;
    strays.bind(&any.into())?;
    let port = strays.local_addr()?;
    // SO_REUSEADDR on both lets `data` join the port; cleared once it has, so no
    // third socket can.
    strays.set_reuse_address(true)?;
    let data = new()?;
    data.set_reuse_address(true)?;
    // A window of large blocks is sent back to back.
    let _ = data.set_send_buffer_size(1 << 20);
    data.bind(&port)?;
    data.connect(&peer.into())?;
    strays.set_reuse_address(false)?;
    data.set_reuse_address(false)?;
    data.set_nonblocking(true)?;
    Ok(TransferSockets {
        data: UdpSocket::from_std(data.into())?,
        strays: UdpSocket::from_std(strays.into())?,
    })
}

/// Answers whatever reaches a transfer's port from anyone but its client with ERROR
/// 5, until the transfer ends (the caller drops this future). Returns only if the
/// socket fails.
async fn answer_strays(strays: &UdpSocket, stats: &TftpStats) {
    let mut buf = [0u8; 64];
    let mut out = Vec::new();
    packet::encode_error(&mut out, ErrorCode::UnknownTid, "unknown transfer ID");
    loop {
        match strays.recv_from(&mut buf).await {
            Ok((_, from)) => {
                stats.unknown_tid.inc();
                let _ = strays.send_to(&out, from).await;
            }
            Err(e) if transient(&e) => {}
            Err(e) => {
                tracing::debug!(error = %e, "TFTP stray-sender socket failed");
                return;
            }
        }
    }
}

/// What a transfer reads from.
enum Source {
    File(std::fs::File),
    /// Netascii-converted contents.
    Memory(Vec<u8>),
}

impl Source {
    /// Fills `buf` from `offset`; fewer bytes only at the end.
    ///
    /// Blocking, but a positioned read of one block (at most 64 KiB) from a local,
    /// usually page-cached file: cheaper here than a hop to the blocking pool per
    /// block, which would halve throughput.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        match self {
            Source::File(f) => {
                let mut done = 0;
                while done < buf.len() {
                    match f.read_at(&mut buf[done..], offset + done as u64) {
                        Ok(0) => break,
                        Ok(n) => done += n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(done)
            }
            Source::Memory(v) => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX).min(v.len());
                let n = buf.len().min(v.len() - start);
                buf[..n].copy_from_slice(&v[start..start + n]);
                Ok(n)
            }
        }
    }
}

/// Why a file was not opened, as the ERROR the client gets.
struct OpenFailure {
    code: ErrorCode,
    message: &'static str,
    /// Counted as refused (else as failed).
    refused: bool,
    /// A directory, FIFO, socket or device.
    not_regular: bool,
}

fn open(root: &Path, name: &[u8], netascii: bool) -> Result<(Source, u64), OpenFailure> {
    let refuse = |code, message| OpenFailure {
        code,
        message,
        refused: true,
        not_regular: false,
    };
    let (file, meta) = super::path::open(root, name).map_err(|r| match r {
        Refusal::NotFound => refuse(ErrorCode::NotFound, "file not found"),
        Refusal::Forbidden => refuse(ErrorCode::AccessViolation, "access violation"),
        Refusal::NotRegular => OpenFailure {
            not_regular: true,
            ..refuse(ErrorCode::AccessViolation, "not a regular file")
        },
    })?;
    if !netascii {
        return Ok((Source::File(file), meta.len()));
    }
    if meta.len() > MAX_NETASCII {
        return Err(refuse(ErrorCode::Undefined, "file too large for netascii"));
    }
    let mut raw = Vec::with_capacity(meta.len() as usize);
    io::Read::read_to_end(&mut io::Read::take(&file, MAX_NETASCII + 1), &mut raw).map_err(
        |_| OpenFailure {
            code: ErrorCode::Undefined,
            message: "read error",
            refused: false,
            not_regular: false,
        },
    )?;
    if raw.len() as u64 > MAX_NETASCII {
        // It grew since the look at its size.
        return Err(refuse(ErrorCode::Undefined, "file too large for netascii"));
    }
    let text = to_netascii(&raw);
    let len = text.len() as u64;
    Ok((Source::Memory(text), len))
}

/// LF → CR LF and CR → CR NUL, as RFC 764 and tftpd-hpa do.
fn to_netascii(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() + raw.len() / 16);
    for &b in raw {
        match b {
            b'\n' => out.extend_from_slice(b"\r\n"),
            b'\r' => out.extend_from_slice(b"\r\0"),
            _ => out.push(b),
        }
    }
    out
}

/// How a transfer ended.
#[derive(Debug)]
enum End {
    Completed,
    ClientError {
        code: u16,
        message: String,
    },
    /// The client's port is closed (an ICMP port unreachable came back).
    ClientGone,
    /// The client never acknowledged the OACK or DATA 1.
    FirstAckTimeout,
    /// Half-open, and a newcomer took the slot (see `admission`).
    Evicted,
    TimedOut,
    Cancelled,
    Io(io::Error),
}

impl End {
    /// A failed send: on a connected socket, ECONNREFUSED reports an ICMP port
    /// unreachable for an earlier packet.
    fn from_send(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::ConnectionRefused {
            End::ClientGone
        } else {
            End::Io(e)
        }
    }

    /// Counts and logs how the transfer ended; returns the ERROR message the
    /// client is sent when we end it.
    fn report(
        self,
        stats: &TftpStats,
        peer: SocketAddr,
        name: &str,
        size: u64,
        retries: u32,
    ) -> Option<&'static str> {
        match self {
            End::Completed => {
                stats.completed.inc();
                tracing::info!(%peer, file = %name, size, "TFTP transfer completed");
            }
            End::ClientError { code, message } => {
                stats.client_aborts.inc();
                tracing::info!(%peer, file = %name, code, %message, "TFTP transfer ended by the client");
            }
            End::ClientGone => {
                stats.client_aborts.inc();
                tracing::info!(%peer, file = %name, "TFTP client went away (port unreachable)");
            }
            End::FirstAckTimeout => {
                // Counted; at debug, as a flood of forged requests would log a
                // line each.
                stats.first_ack_timeouts.inc();
                tracing::debug!(%peer, file = %name, "TFTP client never answered");
            }
            End::Evicted => {
                stats.evicted.inc();
                tracing::debug!(%peer, file = %name, "half-open TFTP transfer ended for a newcomer");
                return Some("server busy");
            }
            End::TimedOut => {
                stats.failed.inc();
                tracing::warn!(%peer, file = %name, retries, "TFTP transfer timed out");
            }
            End::Cancelled => {
                stats.failed.inc();
                tracing::info!(%peer, file = %name, "TFTP transfer cut by shutdown");
                return Some("server shutting down");
            }
            End::Io(e) => {
                stats.failed.inc();
                tracing::warn!(%peer, file = %name, error = %e, "TFTP transfer failed");
                return Some("server error");
            }
        }
        None
    }
}

async fn transfer(
    ctx: &Ctx,
    peer: SocketAddr,
    local: IpAddr,
    req: OwnedRequest,
    ticket: Ticket,
    cancel: CancellationToken,
) {
    let stats = &ctx.stats;
    let name = String::from_utf8_lossy(&req.filename).into_owned();
    let TransferSockets { data, strays } = match bind_transfer(local, peer) {
        Ok(s) => s,
        Err(e) => {
            stats.failed.inc();
            tracing::warn!(%peer, file = %name, %local, error = %e, "cannot bind a TFTP transfer socket");
            return;
        }
    };
    let root = ctx.root.clone();
    let filename = req.filename;
    let netascii = req.netascii;
    let opened = {
        // The semaphore is never closed.
        let _permit = ctx.opens.acquire().await;
        tokio::task::spawn_blocking(move || open(&root, &filename, netascii)).await
    };
    let (source, size) = match opened {
        Ok(Ok(s)) => s,
        Ok(Err(f)) => {
            if f.refused {
                stats.refused.inc();
            } else {
                stats.failed.inc();
            }
            if f.not_regular {
                stats.not_regular.inc();
            }
            tracing::info!(%peer, file = %name, reason = f.message, "TFTP request refused");
            let mut out = Vec::new();
            packet::encode_error(&mut out, f.code, f.message);
            let _ = strays.send_to(&out, peer).await;
            return;
        }
        Err(e) => {
            stats.failed.inc();
            tracing::warn!(%peer, file = %name, error = %e, "TFTP open task failed");
            return;
        }
    };
    let options: Vec<(&str, &str)> = req
        .options
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let neg = negotiate(&options, size, ctx.settings.timeout);
    tracing::debug!(%peer, file = %name, size, blksize = neg.blksize, windowsize = neg.windowsize, "TFTP transfer starts");
    let job = Job {
        ctx,
        peer,
        name,
        size,
        source,
        neg,
        cancel,
    };
    let mut run = std::pin::pin!(job.run(data, &ticket));
    tokio::select! {
        // CANCEL-SAFETY: `run` is pinned and polled again below if strays end first.
        () = &mut run => {}
        // CANCEL-SAFETY: returns only if the socket fails; the transfer goes on.
        () = answer_strays(&strays, stats) => run.await,
    }
}

/// Tells the observer, if any, of a completed transfer.
fn observe(stats: &TftpStats, peer: SocketAddr, name: &str, size: u64, began: std::time::Instant) {
    if let Some(o) = stats.observer.get() {
        o.completed(peer.ip(), name, size, began.elapsed());
    }
}

/// A transfer whose file is open, from the first packet to the last ACK.
struct Job<'a> {
    ctx: &'a Ctx,
    peer: SocketAddr,
    name: String,
    size: u64,
    source: Source,
    neg: Negotiated,
    cancel: CancellationToken,
}

/// Where the data phase starts, once the client has answered.
enum Answered {
    /// ACK 0 of the OACK: the data phase sends from block 1.
    Oack,
    /// ACK 1 of a full DATA 1: the data phase sends from block 2.
    Data1,
    /// ACK 1 of a short DATA 1: that was the whole file.
    Done,
}

impl Job<'_> {
    /// Waits for the client's first ACK on this task, then runs the data phase on
    /// a blocking thread. Until the client has answered a transfer costs a task,
    /// two sockets and an open file, never a thread: requests from forged addresses
    /// must be cheap to hold and to end.
    async fn run(self, data: UdpSocket, ticket: &Ticket) {
        let (stats, peer) = (self.ctx.stats.clone(), self.peer);
        let retries = self.ctx.settings.retries;
        let began = std::time::Instant::now();
        let answered = match self.first_ack(&data, ticket).await {
            Ok(Answered::Done) => Err(End::Completed),
            // The newcomer's eviction raced the ACK: the slot is gone.
            Ok(_) if !ticket.answered() => Err(End::Evicted),
            other => other,
        };
        let start = match answered {
            Ok(a) => a,
            Err(end) => {
                if matches!(end, End::Completed) {
                    observe(&stats, peer, &self.name, self.size, began);
                }
                if let Some(msg) = end.report(&stats, peer, &self.name, self.size, retries) {
                    let mut out = Vec::new();
                    packet::encode_error(&mut out, ErrorCode::Undefined, msg);
                    let _ = data.send(&out).await;
                }
                return;
            }
        };
        // The data phase runs on a blocking thread with blocking socket calls, one
        // thread per transfer as tftpd-hpa has one process per transfer. In
        // lock-step transfers (window 1: BIOS PXE ROMs, curl) every block waits for
        // an ACK, and a blocking recv wakes the thread directly, while an async wait
        // costs a wake-up of another worker thread per block: about 8% of
        // throughput against tftpd-hpa.
        let slice = SLICE.min(self.neg.timeout);
        let sock = match data.into_std().and_then(|s| {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(slice))?;
            Ok(s)
        }) {
            Ok(s) => s,
            Err(e) => {
                let _ = End::Io(e).report(&stats, peer, &self.name, self.size, retries);
                return;
            }
        };
        let acked = match start {
            Answered::Oack => 0,
            _ => 1,
        };
        let Job {
            name,
            size,
            source,
            neg,
            cancel,
            ..
        } = self;
        let stats2 = stats.clone();
        let job = tokio::task::spawn_blocking(move || {
            let mut t = Transfer {
                sock,
                peer,
                stats: &stats2,
                rbuf: vec![0u8; 1024],
                retries,
                cancel,
                slice,
            };
            let end = t.run(&source, &neg, acked);
            if matches!(end, End::Completed) {
                observe(&stats2, peer, &name, size, began);
            }
            if let Some(msg) = end.report(&stats2, peer, &name, size, retries) {
                t.send_error(ErrorCode::Undefined, msg);
            }
        });
        if let Err(e) = job.await {
            stats.failed.inc();
            tracing::warn!(%peer, error = %e, "TFTP transfer thread failed");
        }
    }

    /// Sends the OACK, or DATA 1 without options, and waits for its ACK:
    /// `FIRST_ACK_TRIES` sends, `FIRST_ACK_WAIT` (at most the transfer's timeout)
    /// apart, then listens until the timeout × (retries + 1) from the first.
    async fn first_ack(&self, sock: &UdpSocket, ticket: &Ticket) -> Result<Answered, End> {
        let mut first = Vec::new();
        let (want, answered) = if self.neg.oack.is_empty() {
            // One block of at most 512 bytes, read on this task: see
            // `Source::read_at`.
            first.resize(4 + self.neg.blksize, 0);
            let n = self.source.read_at(&mut first[4..], 0).map_err(End::Io)?;
            first.truncate(4 + n);
            packet::put_data_header(&mut first, 1);
            let a = if n < self.neg.blksize {
                Answered::Done
            } else {
                Answered::Data1
            };
            (1, a)
        } else {
            packet::encode_oack(&mut first, &self.neg.oack);
            (0, Answered::Oack)
        };
        let stats = &self.ctx.stats;
        let wait = FIRST_ACK_WAIT.min(self.neg.timeout);
        let began = tokio::time::Instant::now();
        let listen =
            (self.neg.timeout * (self.ctx.settings.retries + 1)).max(wait * FIRST_ACK_TRIES);
        let mut buf = [0u8; 1024];
        for attempt in 0..FIRST_ACK_TRIES {
            if attempt > 0 {
                stats.retransmits.inc();
            }
            sock.send(&first).await.map_err(End::from_send)?;
            if want == 1 {
                stats.bytes_sent.add(first.len() as u64 - 4);
            }
            let deadline = if attempt + 1 == FIRST_ACK_TRIES {
                began + listen
            } else {
                tokio::time::Instant::now() + wait
            };
            loop {
                let received = tokio::select! {
                    biased;
                    // CANCEL-SAFETY: only waits.
                    () = self.cancel.cancelled() => return Err(End::Cancelled),
                    // CANCEL-SAFETY: only waits.
                    () = ticket.evicted().cancelled() => return Err(End::Evicted),
                    // CANCEL-SAFETY: only waits.
                    () = tokio::time::sleep_until(deadline) => break,
                    // CANCEL-SAFETY: recv takes a datagram only when it returns it.
                    r = sock.recv(&mut buf) => r,
                };
                match received {
                    Ok(n) => match packet::parse_client(&buf[..n]) {
                        ClientPacket::Ack(b) if b == want => return Ok(answered),
                        ClientPacket::Error { code, message } => {
                            return Err(End::ClientError {
                                code,
                                message: String::from_utf8_lossy(message).into_owned(),
                            });
                        }
                        ClientPacket::Ack(_) | ClientPacket::Other => {}
                    },
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        return Err(End::ClientGone);
                    }
                    Err(e) if transient(&e) => {}
                    Err(e) => return Err(End::Io(e)),
                }
            }
        }
        Err(End::FirstAckTimeout)
    }
}

/// How often a waiting transfer looks at the cancellation token.
const SLICE: std::time::Duration = std::time::Duration::from_millis(100);

/// What waiting for the client produced.
enum Wait {
    Ack(u16),
    Timeout,
    End(End),
}

/// One transfer's data phase, run on a blocking thread.
struct Transfer<'a> {
    /// Connected to the client; blocking, with a read timeout of `slice`.
    sock: std::net::UdpSocket,
    peer: SocketAddr,
    stats: &'a TftpStats,
    rbuf: Vec<u8>,
    retries: u32,
    cancel: CancellationToken,
    /// The socket's current read timeout.
    slice: std::time::Duration,
}

impl Transfer<'_> {
    fn send_error(&self, code: ErrorCode, message: &str) {
        let mut out = Vec::new();
        packet::encode_error(&mut out, code, message);
        let _ = self.sock.send(&out);
    }

    /// Sends from block `acked + 1` until the last block is acknowledged.
    fn run(&mut self, source: &Source, neg: &Negotiated, acked: u64) -> End {
        let blksize = neg.blksize;
        let window = u64::from(neg.windowsize);
        let mut pkt = vec![0u8; 4 + blksize];
        // Absolute block numbers: the first block is 1; the wire carries the low
        // 16 bits, so 65535 is followed by 0 (as tftpd-hpa, curl and atftp expect).
        let mut acked = acked;
        let mut last: Option<u64> = None;
        let mut tries = 0;
        loop {
            let mut sent = acked;
            while sent < acked + window && last.is_none_or(|l| sent < l) {
                let block = sent + 1;
                let n = match source.read_at(&mut pkt[4..], (block - 1) * blksize as u64) {
                    Ok(n) => n,
                    Err(e) => return End::Io(e),
                };
                packet::put_data_header(&mut pkt, block as u16);
                if let Err(e) = self.sock.send(&pkt[..4 + n]) {
                    return End::from_send(e);
                }
                self.stats.bytes_sent.add(n as u64);
                sent = block;
                if n < blksize {
                    last = Some(block);
                }
            }
            let deadline = std::time::Instant::now() + neg.timeout;
            loop {
                match self.wait(deadline) {
                    Wait::Ack(wire) => {
                        let ahead = u64::from(wire.wrapping_sub(acked as u16));
                        if ahead == 0 || ahead > sent - acked {
                            // A duplicate or stale ACK: resending on it would
                            // double the traffic for the rest of the transfer
                            // (Sorcerer's Apprentice). Only the timeout resends.
                            continue;
                        }
                        acked += ahead;
                        tries = 0;
                        if last == Some(acked) {
                            return End::Completed;
                        }
                        // An ACK inside the window means the client lost the
                        // block after it: the next window starts there.
                        break;
                    }
                    Wait::Timeout => {
                        tries += 1;
                        if tries > self.retries {
                            return End::TimedOut;
                        }
                        self.stats.retransmits.inc();
                        tracing::debug!(peer = %self.peer, block = acked + 1, tries, "TFTP timeout; resending");
                        break;
                    }
                    Wait::End(e) => return e,
                }
            }
        }
    }

    /// Waits for the client's next ACK or ERROR until `deadline`, ignoring anything
    /// else. Looks at the cancellation token at least every `SLICE`.
    fn wait(&mut self, deadline: std::time::Instant) -> Wait {
        loop {
            if self.cancel.is_cancelled() {
                return Wait::End(End::Cancelled);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Wait::Timeout;
            }
            // Only near the deadline does the read timeout change (a syscall): in the
            // common case the ACK comes long before.
            let want = left.min(SLICE);
            if want < self.slice || (self.slice < SLICE && want > self.slice) {
                if let Err(e) = self.sock.set_read_timeout(Some(want)) {
                    return Wait::End(End::Io(e));
                }
                self.slice = want;
            }
            let n = match self.sock.recv(&mut self.rbuf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    return Wait::End(End::ClientGone);
                }
                Err(e) if transient(&e) || e.kind() == io::ErrorKind::TimedOut => continue,
                Err(e) => return Wait::End(End::Io(e)),
            };
            match packet::parse_client(&self.rbuf[..n]) {
                ClientPacket::Ack(b) => return Wait::Ack(b),
                ClientPacket::Error { code, message } => {
                    return Wait::End(End::ClientError {
                        code,
                        message: String::from_utf8_lossy(message).into_owned(),
                    });
                }
                ClientPacket::Other => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netascii() {
        assert_eq!(to_netascii(b"a\nb\rc\r\n"), b"a\r\nb\r\0c\r\0\r\n");
    }

    #[test]
    fn memory_source_reads() {
        let s = Source::Memory(b"hello".to_vec());
        let mut b = [0u8; 3];
        assert_eq!(s.read_at(&mut b, 0).unwrap(), 3);
        assert_eq!(s.read_at(&mut b, 3).unwrap(), 2);
        assert_eq!(&b[..2], b"lo");
        assert_eq!(s.read_at(&mut b, 5).unwrap(), 0);
        assert_eq!(s.read_at(&mut b, 99).unwrap(), 0);
    }
}
