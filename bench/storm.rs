//! Boot-storm simulator: N simulated nodes netbooting at once against a real server.
//!
//! Started by `bench/storm.sh`, inside the client network namespace it creates (the
//! server runs in its own namespace, behind one veth). Each simulated node is a task
//! that does what a UEFI machine and iPXE do, with their retry behaviour:
//!
//! 1. firmware DHCP (DISCOVER with option 93 = 7, x86-64 UEFI; retransmits after 4, 8,
//!    16 and 32 s as the PXE spec's firmware does), REQUEST, ACK;
//! 2. the first stage over TFTP with the options OVMF asks for (tsize, blksize 1468,
//!    windowsize 4); a window that does not arrive within 4 s is asked for again,
//!    6 times at most (OVMF's PXE driver's values);
//! 3. DHCP again as iPXE (user class `iPXE` and option 175);
//! 4. the HTTP boot script, then kernel and initrd, read to the end (an HTTP attempt
//!    that fails is retried 3 times, 1, 2 and 4 s apart, as an iPXE script's retry
//!    loop does);
//! 5. in `pxed` mode: the installer's kickstart fetch and `installed` callback, a
//!    plain DHCP from the installed system, and the first-boot agent's `first-boot`
//!    and `health` callbacks, after which pxed puts the node back in `available`.
//!
//! Every node has its own MAC; after its lease it speaks from its own leased address
//! (the client namespace has a `local` route for the whole pool, so any pool address
//! is a valid source there and answers ARP).
//!
//! In `pxed` mode the simulator also is the nodes' BMCs: a Redfish service (one system
//! per node) on a real HTTP socket. A node starts to boot when its system is powered
//! on or cycled with a one-time network boot override set, as a real machine would.
//! The run registers the nodes, allocates them, then issues every reinstall through
//! the API at t=0 and waits for each node's health callback to answer `available`.
//!
//! In `boot` mode (the side-by-side run against dnsmasq + nginx, which have no
//! lifecycle) every node powers on at t=0 and the run ends at the initrd.
//!
//! The report: per-stage min/p50/p95/p99/max, failures by stage, retries, the server's CPU
//! and RSS over time, and the byte-transfer floor: the bytes of the storm divided by
//! the server's HTTP rate for the same files, measured before and after the storm in the
//! same run (the faster of the two: after the larger storms the rate measured came out
//! lower, which would have flattered the ratio).
use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, UdpSocket};
use tokio::sync::{Semaphore, mpsc};

/// OVMF's TFTP timeout and retries (see `Node::tftp`).
const TFTP_TIMEOUT: Duration = Duration::from_secs(4);
const TFTP_RETRIES: u32 = 6;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// `pxed` (reinstalls through the API, to `available`) or `boot` (power on at t=0,
    /// to the initrd).
    #[arg(long, default_value = "pxed")]
    mode: String,
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// The server's address (DHCP server, TFTP, HTTP).
    #[arg(long)]
    server: Ipv4Addr,
    #[arg(long, default_value_t = 80)]
    http_port: u16,
    /// The client side's own address (BMC double, API calls, floor measurement).
    #[arg(long)]
    local: Ipv4Addr,
    #[arg(long, default_value_t = 8000)]
    bmc_port: u16,
    /// Node i's BMC answers at this address + i (the client side routes the range to
    /// itself): a fleet's BMCs each have their own address. Without it every BMC is
    /// at `local`, and pxed's connections to thousands of BMCs share one destination
    /// (each connect then searches the ephemeral ports past the TIME_WAIT sockets of
    /// the ones before).
    #[arg(long)]
    bmc_net: Option<Ipv4Addr>,
    /// API bearer token (pxed mode).
    #[arg(long, default_value = "")]
    token: String,
    #[arg(long, default_value = "storm")]
    image: String,
    /// Kernel and initrd paths for the floor measurement (and in boot mode when the
    /// script names none).
    #[arg(long, default_value = "/images/storm/x86_64/kernel")]
    kernel_path: String,
    #[arg(long, default_value = "/images/storm/x86_64/initrd")]
    initrd_path: String,
    /// The server's PID, for CPU and RSS.
    #[arg(long)]
    server_pid: Vec<u32>,
    /// Firmware POST time from power-on to the first DHCPDISCOVER (uniform in
    /// [min, 2×min]).
    #[arg(long, default_value_t = 2.0)]
    post_secs: f64,
    /// Give up on the storm after this long.
    #[arg(long, default_value_t = 1800)]
    timeout_secs: u64,
    /// Concurrent streams for the floor measurement.
    #[arg(long, default_value_t = 64)]
    floor_streams: usize,
    /// Kernel+initrd pairs fetched for the floor measurement.
    #[arg(long, default_value_t = 200)]
    floor_pairs: usize,
    /// The client side's interface (DHCP broadcasts go out of it).
    #[arg(long, default_value = "c0")]
    iface: String,
    /// Reinstall calls in flight at once (a reclaim hook's parallelism).
    #[arg(long, default_value_t = 64)]
    api_parallel: usize,
    /// MAC prefix (the last three bytes are the node's number).
    #[arg(long, default_value = "52:54:01")]
    mac_prefix: String,
}

/// Node `i`'s BMC address (see `Args::bmc_net`).
fn bmc_addr(a: &Args, i: usize) -> Ipv4Addr {
    match a.bmc_net {
        Some(net) => Ipv4Addr::from(u32::from(net) + u32::try_from(i).expect("node number")),
        None => a.local,
    }
}

/// A node's stages, in order; each records when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Stage {
    PowerOn,
    Dhcp,
    Tftp,
    DhcpIpxe,
    Script,
    Kernel,
    Initrd,
    Installer,
    DhcpOs,
    FirstBoot,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::PowerOn => "power on",
            Stage::Dhcp => "POST + DHCP (firmware)",
            Stage::Tftp => "TFTP first stage",
            Stage::DhcpIpxe => "DHCP (iPXE)",
            Stage::Script => "HTTP script",
            Stage::Kernel => "kernel",
            Stage::Initrd => "initrd",
            Stage::Installer => "kickstart + installed",
            Stage::DhcpOs => "DHCP (installed OS)",
            Stage::FirstBoot => "first-boot + health",
        }
    }
    const ALL: [Stage; 10] = [
        Stage::PowerOn,
        Stage::Dhcp,
        Stage::Tftp,
        Stage::DhcpIpxe,
        Stage::Script,
        Stage::Kernel,
        Stage::Initrd,
        Stage::Installer,
        Stage::DhcpOs,
        Stage::FirstBoot,
    ];
}

#[derive(Default)]
struct Counters {
    dhcp_retransmits: AtomicU64,
    dhcp_naks: AtomicU64,
    tftp_timeouts: AtomicU64,
    http_retries: AtomicU64,
    extra_power_ons: AtomicU64,
    http_bytes: AtomicU64,
    tftp_bytes: AtomicU64,
}

/// One node's record: when each stage ended, or where it failed and why.
#[derive(Default, Clone)]
struct Timeline {
    ends: BTreeMap<Stage, Instant>,
    failed: Option<(Stage, String)>,
    done: Option<Instant>,
}

struct Sim {
    args: Args,
    t0: Mutex<Option<Instant>>,
    /// CPU seconds (server, simulator, whole machine) at t0.
    cpu0: Mutex<Cpu>,
    /// The server's CPU seconds by thread name at t0.
    threads0: Mutex<BTreeMap<String, f64>>,
    counters: Counters,
    /// Per request kind: (connect, response head, whole exchange) in seconds.
    requests: Mutex<BTreeMap<&'static str, Vec<[f64; 3]>>>,
    timelines: Vec<Mutex<Timeline>>,
    /// DHCP replies by xid.
    waiters: Mutex<HashMap<u32, mpsc::UnboundedSender<Message>>>,
    dhcp: UdpSocket,
    done: tokio::sync::Notify,
    finished: AtomicU64,
}

fn mac_of(prefix: &str, i: usize) -> [u8; 6] {
    let mut m = [0u8; 6];
    for (k, p) in prefix.split(':').take(3).enumerate() {
        m[k] = u8::from_str_radix(p, 16).unwrap_or(0x52);
    }
    m[3] = (i >> 16) as u8;
    m[4] = (i >> 8) as u8;
    m[5] = i as u8;
    m
}

fn mac_str(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[derive(Clone, Copy, PartialEq)]
enum DhcpKind {
    Firmware,
    Ipxe,
    Os,
}

struct Lease {
    ip: Ipv4Addr,
    file: String,
}

impl Sim {
    fn record(&self, i: usize, s: Stage) {
        self.timelines[i]
            .lock()
            .unwrap()
            .ends
            .insert(s, Instant::now());
    }

    fn fail(&self, i: usize, s: Stage, why: String) {
        let mut t = self.timelines[i].lock().unwrap();
        if t.failed.is_none() && t.done.is_none() {
            t.failed = Some((s, why));
            drop(t);
            self.finish();
        }
    }

    fn finish(&self) {
        let n = self.finished.fetch_add(1, Ordering::SeqCst) + 1;
        if n as usize >= self.args.nodes {
            self.done.notify_one();
        }
    }

    async fn send_dhcp(&self, m: &Message) -> Result<()> {
        let mut b = Vec::with_capacity(400);
        m.encode(&mut Encoder::new(&mut b))?;
        self.dhcp
            .send_to(&b, SocketAddrV4::new(Ipv4Addr::BROADCAST, 67))
            .await?;
        Ok(())
    }

    /// One DORA as `kind`, with the firmware's retransmit schedule.
    async fn dora(&self, i: usize, kind: DhcpKind) -> Result<Lease> {
        let mac = mac_of(&self.args.mac_prefix, i);
        let xid: u32 = rand::random();
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.waiters.lock().unwrap().insert(xid, tx);
        // A NAK sends the client back to DISCOVER (RFC 2131's INIT state), as
        // firmware does; four rounds at most.
        let mut r = Err(anyhow!("no DHCP round"));
        for _ in 0..4 {
            r = self.dora_inner(kind, mac, xid, &mut rx).await;
            match &r {
                Err(e) if e.to_string().starts_with("NAK") => {
                    self.counters.dhcp_naks.fetch_add(1, Ordering::Relaxed);
                }
                _ => break,
            }
        }
        self.waiters.lock().unwrap().remove(&xid);
        r
    }

    async fn dora_inner(
        &self,
        kind: DhcpKind,
        mac: [u8; 6],
        xid: u32,
        rx: &mut mpsc::UnboundedReceiver<Message>,
    ) -> Result<Lease> {
        let base = |t: MessageType| {
            let mut m = Message::new_with_id(
                xid,
                Ipv4Addr::UNSPECIFIED,
                Ipv4Addr::UNSPECIFIED,
                Ipv4Addr::UNSPECIFIED,
                Ipv4Addr::UNSPECIFIED,
                &mac,
            );
            m.set_flags(Flags::default().set_broadcast());
            let o = m.opts_mut();
            o.insert(DhcpOption::MessageType(t));
            if kind != DhcpKind::Os {
                o.insert(DhcpOption::ClientSystemArchitecture(7u16.into()));
                o.insert(DhcpOption::ClassIdentifier(
                    b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
                ));
                let mut guid = vec![0u8; 17];
                guid[11..17].copy_from_slice(&mac);
                o.insert(DhcpOption::ClientMachineIdentifier(guid));
            }
            if kind == DhcpKind::Ipxe {
                o.insert(DhcpOption::UserClass(b"iPXE".to_vec()));
                o.insert(DhcpOption::Unknown(dhcproto::v4::UnknownOption::new(
                    OptionCode::Unknown(175),
                    vec![0x13, 0x01, 0x01],
                )));
            }
            m
        };
        // The PXE spec's firmware schedule: 4, 8, 16, 32 s (plus a little jitter).
        let discover = base(MessageType::Discover);
        let offer = self
            .exchange(
                &discover,
                &[4.0, 8.0, 16.0, 32.0],
                rx,
                &[MessageType::Offer],
            )
            .await?
            .ok_or_else(|| anyhow!("no OFFER after 4 DISCOVERs (60 s)"))?;
        let sid = match offer.opts().get(OptionCode::ServerIdentifier) {
            Some(DhcpOption::ServerIdentifier(s)) => *s,
            _ => bail!("OFFER without a server identifier"),
        };
        let mut req = base(MessageType::Request);
        req.opts_mut()
            .insert(DhcpOption::RequestedIpAddress(offer.yiaddr()));
        req.opts_mut().insert(DhcpOption::ServerIdentifier(sid));
        let reply = self
            .exchange(
                &req,
                &[4.0, 8.0, 16.0],
                rx,
                &[MessageType::Ack, MessageType::Nak],
            )
            .await?
            .ok_or_else(|| anyhow!("no ACK after 3 REQUESTs for {}", offer.yiaddr()))?;
        if msg_type(&reply) == Some(MessageType::Nak) {
            bail!("NAK for {}", offer.yiaddr());
        }
        // The offer's file when the ACK has none (some servers).
        let file = Some(boot_file(&reply))
            .filter(|f| !f.is_empty())
            .unwrap_or_else(|| boot_file(&offer));
        Ok(Lease {
            ip: reply.yiaddr(),
            file,
        })
    }

    /// Sends `m`, again after each wait of `schedule` without a reply of a `wanted`
    /// type (each retransmission counted); the reply, if any came.
    async fn exchange(
        &self,
        m: &Message,
        schedule: &[f64],
        rx: &mut mpsc::UnboundedReceiver<Message>,
        wanted: &[MessageType],
    ) -> Result<Option<Message>> {
        for (k, wait) in schedule.iter().enumerate() {
            if k > 0 {
                self.counters
                    .dhcp_retransmits
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.send_dhcp(m).await?;
            let deadline =
                tokio::time::Instant::now() + Duration::from_secs_f64(jitter(*wait, 0.1));
            while let Ok(Some(r)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                if msg_type(&r).is_some_and(|t| wanted.contains(&t)) {
                    return Ok(Some(r));
                }
            }
        }
        Ok(None)
    }

    /// A TFTP read as OVMF asks for it; returns the bytes received. Timeouts as
    /// OVMF's PXE driver sets them (edk2 NetworkPkg/UefiPxeBcDxe/PxeBcImpl.h:
    /// `PXEBC_MTFTP_TIMEOUT` 4 s, `PXEBC_MTFTP_RETRIES` 6): the last packet, RRQ
    /// or ACK, is sent again after each.
    async fn tftp(&self, src: Ipv4Addr, file: &str) -> Result<u64> {
        // What the server accepted in its OACK; without one, RFC 1350's lock-step.
        let mut blk: usize = 512;
        let mut win: u16 = 1;
        let sock = UdpSocket::bind(SocketAddrV4::new(src, 0)).await?;
        let mut rrq = vec![0, 1];
        for part in [
            file,
            "octet",
            "tsize",
            "0",
            "blksize",
            "1468",
            "windowsize",
            "4",
        ] {
            rrq.extend_from_slice(part.as_bytes());
            rrq.push(0);
        }
        let server = SocketAddr::V4(SocketAddrV4::new(self.args.server, 69));
        let mut peer: Option<SocketAddr> = None;
        let mut last_ack: Option<Vec<u8>> = None;
        let mut expected: u16 = 1;
        let mut since_ack: u16 = 0;
        let mut total: u64 = 0;
        let mut tsize: Option<u64> = None;
        let mut timeouts = 0;
        let mut buf = vec![0u8; 2048];
        sock.send_to(&rrq, server).await?;
        loop {
            let got = tokio::time::timeout(TFTP_TIMEOUT, sock.recv_from(&mut buf)).await;
            let (n, from) = match got {
                Ok(r) => r?,
                Err(_) => {
                    timeouts += 1;
                    self.counters.tftp_timeouts.fetch_add(1, Ordering::Relaxed);
                    if timeouts > TFTP_RETRIES {
                        bail!("TFTP: {timeouts} timeouts in a row at block {expected}");
                    }
                    match (&last_ack, peer) {
                        (Some(a), Some(p)) => sock.send_to(a, p).await?,
                        _ => sock.send_to(&rrq, server).await?,
                    };
                    since_ack = 0;
                    continue;
                }
            };
            if n < 4 {
                continue;
            }
            let op = u16::from_be_bytes([buf[0], buf[1]]);
            match op {
                6 => {
                    // OACK: tsize=<n>, blksize, windowsize accepted.
                    let opts: Vec<&[u8]> = buf[2..n].split(|b| *b == 0).collect();
                    for w in opts.chunks(2) {
                        if w.len() != 2 {
                            continue;
                        }
                        let v = std::str::from_utf8(w[1]).ok();
                        if w[0].eq_ignore_ascii_case(b"tsize") {
                            tsize = v.and_then(|s| s.parse().ok());
                        } else if w[0].eq_ignore_ascii_case(b"blksize") {
                            blk = v.and_then(|s| s.parse().ok()).unwrap_or(512);
                        } else if w[0].eq_ignore_ascii_case(b"windowsize") {
                            win = v.and_then(|s| s.parse().ok()).unwrap_or(1);
                        }
                    }
                    peer = Some(from);
                    let ack = vec![0, 4, 0, 0];
                    sock.send_to(&ack, from).await?;
                    last_ack = Some(ack);
                    timeouts = 0;
                }
                3 => {
                    peer.get_or_insert(from);
                    let block = u16::from_be_bytes([buf[2], buf[3]]);
                    if block != expected {
                        // Out of order: ask again from the last block received.
                        if let Some(a) = &last_ack {
                            sock.send_to(a, from).await?;
                        }
                        since_ack = 0;
                        continue;
                    }
                    timeouts = 0;
                    let len = n - 4;
                    total += len as u64;
                    expected = expected.wrapping_add(1);
                    since_ack += 1;
                    let last = len < blk;
                    if last || since_ack >= win {
                        let mut ack = vec![0, 4];
                        ack.extend_from_slice(&block.to_be_bytes());
                        sock.send_to(&ack, from).await?;
                        last_ack = Some(ack);
                        since_ack = 0;
                    }
                    if last {
                        if let Some(t) = tsize
                            && t != total
                        {
                            bail!("TFTP: got {total} bytes, tsize said {t}");
                        }
                        self.counters.tftp_bytes.fetch_add(total, Ordering::Relaxed);
                        return Ok(total);
                    }
                }
                5 => bail!(
                    "TFTP error {}: {}",
                    u16::from_be_bytes([buf[2], buf[3]]),
                    String::from_utf8_lossy(&buf[4..n]).trim_end_matches('\0')
                ),
                _ => {}
            }
        }
    }

    /// An HTTP request as iPXE's script retry loop makes it: 3 retries, 1, 2, 4 s apart.
    async fn http(
        &self,
        src: Ipv4Addr,
        method: &str,
        path: &str,
        body: Option<&Value>,
        keep: bool,
    ) -> Result<(u16, Vec<u8>, u64)> {
        let mut last = anyhow!("no attempt");
        for (k, back) in [0u64, 1, 2, 4].iter().enumerate() {
            if k > 0 {
                self.counters.http_retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(*back)).await;
            }
            let started = Instant::now();
            let server = SocketAddrV4::new(self.args.server, self.args.http_port);
            // Only a body that is dropped (a kernel, an initrd) is read apart.
            let (r, marks) = if keep || method != "GET" || body.is_some() {
                let mut marks = Marks::default();
                let r = http_once(
                    src,
                    server,
                    method,
                    path,
                    body,
                    keep,
                    &self.args.token,
                    &mut marks,
                )
                .await;
                (r, marks)
            } else {
                bulk_get(src, server, path.to_string()).await
            };
            if r.is_ok() {
                self.requests
                    .lock()
                    .unwrap()
                    .entry(request_kind(path))
                    .or_default()
                    .push([
                        marks.connected.map_or(0.0, |t| (t - started).as_secs_f64()),
                        marks.head.map_or(0.0, |t| (t - started).as_secs_f64()),
                        started.elapsed().as_secs_f64(),
                    ]);
            }
            match r {
                Ok((s, b, _)) if s >= 500 => {
                    last = anyhow!("HTTP {s} for {path}: {:.300}", String::from_utf8_lossy(&b))
                }
                Ok(r) => {
                    self.counters.http_bytes.fetch_add(r.2, Ordering::Relaxed);
                    return Ok(r);
                }
                Err(e) => last = e.context(format!("{method} {path}")),
            }
        }
        Err(last)
    }

    async fn get_ok(&self, src: Ipv4Addr, path: &str, keep: bool) -> Result<(Vec<u8>, u64)> {
        let (s, b, n) = self.http(src, "GET", path, None, keep).await?;
        if s != 200 {
            bail!("HTTP {s} for {path}: {}", String::from_utf8_lossy(&b));
        }
        Ok((b, n))
    }

    /// One node's boot from power-on; returns the stage it failed in, if any.
    async fn boot(&self, i: usize) -> Result<(), (Stage, String)> {
        let e = |s: Stage| move |err: anyhow::Error| (s, format!("{err:#}"));
        tokio::time::sleep(Duration::from_secs_f64(jitter(self.args.post_secs, 1.0))).await;
        let lease = self
            .dora(i, DhcpKind::Firmware)
            .await
            .map_err(e(Stage::Dhcp))?;
        self.record(i, Stage::Dhcp);
        if lease.file.is_empty() {
            return Err((Stage::Dhcp, "no boot file in the ACK".into()));
        }
        self.tftp(lease.ip, &lease.file)
            .await
            .map_err(e(Stage::Tftp))?;
        self.record(i, Stage::Tftp);
        let lease = self
            .dora(i, DhcpKind::Ipxe)
            .await
            .map_err(e(Stage::DhcpIpxe))?;
        self.record(i, Stage::DhcpIpxe);
        let script_path = path_of(&lease.file).ok_or_else(|| {
            (
                Stage::DhcpIpxe,
                format!("iPXE got no HTTP script: {:?}", lease.file),
            )
        })?;
        let (script, _) = self
            .get_ok(lease.ip, &script_path, true)
            .await
            .map_err(e(Stage::Script))?;
        let script = String::from_utf8_lossy(&script).to_string();
        self.record(i, Stage::Script);
        let boot_mode = self.args.mode == "boot";
        let kernel = url_after(&script, "kernel")
            .or_else(|| boot_mode.then(|| self.args.kernel_path.clone()))
            .ok_or_else(|| {
                (
                    Stage::Script,
                    format!("no kernel in the script: {script:.200}"),
                )
            })?;
        let initrd = url_after(&script, "initrd")
            .or_else(|| boot_mode.then(|| self.args.initrd_path.clone()))
            .ok_or_else(|| (Stage::Script, "no initrd in the script".into()))?;
        self.get_ok(lease.ip, &kernel, false)
            .await
            .map_err(e(Stage::Kernel))?;
        self.record(i, Stage::Kernel);
        self.get_ok(lease.ip, &initrd, false)
            .await
            .map_err(e(Stage::Initrd))?;
        self.record(i, Stage::Initrd);
        if boot_mode {
            return Ok(());
        }
        // The installer: its config, then `installed` with the boot token.
        let token = script
            .find("/cfg/")
            .map(|k| script[k + 5..].split('/').next().unwrap_or("").to_string())
            .ok_or_else(|| (Stage::Installer, "no /cfg/ URL in the script".into()))?;
        let (ks, _) = self
            .get_ok(lease.ip, &format!("/cfg/{token}/kickstart"), true)
            .await
            .map_err(e(Stage::Installer))?;
        let ks = String::from_utf8_lossy(&ks).to_string();
        let agent = ks
            .find("CB='")
            .map(|k| ks[k + 4..].split('\'').next().unwrap_or(""))
            .and_then(|b| b.rsplit('/').next())
            .map(String::from)
            .ok_or_else(|| {
                (
                    Stage::Installer,
                    "no agent callback in the kickstart".into(),
                )
            })?;
        self.callback(
            lease.ip,
            &format!("/cb/{token}/installed"),
            json!({}),
            "first_boot",
        )
        .await
        .map_err(e(Stage::Installer))?;
        self.record(i, Stage::Installer);
        // The installed system boots from disk and leases again.
        let os = self.dora(i, DhcpKind::Os).await.map_err(e(Stage::DhcpOs))?;
        self.record(i, Stage::DhcpOs);
        let mac = mac_of(&self.args.mac_prefix, i);
        let host = format!("node-{:02x}{:02x}{:02x}", mac[3], mac[4], mac[5]);
        let report = json!({"hostname": host, "arch": "x86_64", "facts": {}});
        self.callback(
            os.ip,
            &format!("/cb/{agent}/first-boot"),
            report,
            "first_boot",
        )
        .await
        .map_err(e(Stage::FirstBoot))?;
        self.callback(
            os.ip,
            &format!("/cb/{agent}/health"),
            json!({"status": "pass"}),
            "available",
        )
        .await
        .map_err(e(Stage::FirstBoot))?;
        self.record(i, Stage::FirstBoot);
        Ok(())
    }

    async fn callback(&self, src: Ipv4Addr, path: &str, body: Value, want: &str) -> Result<()> {
        let (s, b, _) = self.http(src, "POST", path, Some(&body), true).await?;
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        if s != 200 || v["state"] != want {
            bail!(
                "{path}: HTTP {s}, wanted state {want}: {}",
                String::from_utf8_lossy(&b)
            );
        }
        Ok(())
    }

    /// Runs node `i`: waits for power-ons (pxed mode) and boots on each netboot.
    async fn node(self: Arc<Self>, i: usize, mut power: mpsc::UnboundedReceiver<()>) {
        if self.args.mode == "boot" {
            self.record(i, Stage::PowerOn);
            self.run_boot(i).await;
            return;
        }
        let mut booted = false;
        while power.recv().await.is_some() {
            if booted {
                self.counters
                    .extra_power_ons
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            booted = true;
            self.record(i, Stage::PowerOn);
            let me = self.clone();
            tokio::spawn(async move { me.run_boot(i).await });
        }
    }

    async fn run_boot(&self, i: usize) {
        match self.boot(i).await {
            Ok(()) => {
                let mut t = self.timelines[i].lock().unwrap();
                if t.failed.is_none() {
                    t.done = Some(Instant::now());
                    drop(t);
                    self.finish();
                }
            }
            Err((s, why)) => self.fail(i, s, why),
        }
    }
}

fn jitter(base: f64, frac: f64) -> f64 {
    base * (1.0 + frac * rand::random::<f64>())
}

/// The boot file of a reply: the `file` field, else option 67 (NUL padding dropped).
fn boot_file(m: &Message) -> String {
    let field = m.fname_str().and_then(Result::ok).unwrap_or_default();
    let f = field.trim_end_matches('\0');
    if !f.is_empty() {
        return f.to_string();
    }
    match m.opts().get(OptionCode::BootfileName) {
        Some(DhcpOption::BootfileName(b)) => String::from_utf8_lossy(b)
            .trim_end_matches('\0')
            .to_string(),
        _ => String::new(),
    }
}

fn msg_type(m: &Message) -> Option<MessageType> {
    match m.opts().get(OptionCode::MessageType) {
        Some(DhcpOption::MessageType(t)) => Some(*t),
        _ => None,
    }
}

/// The path of an `http://host[:port]/path` URL.
fn path_of(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    Some(rest.find('/').map_or("/".into(), |k| rest[k..].to_string()))
}

/// The URL after `kernel`/`initrd` in an iPXE script (options such as `--name x` skipped).
fn url_after(script: &str, cmd: &str) -> Option<String> {
    script.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        if w.next()? != cmd {
            return None;
        }
        w.find(|t| t.starts_with("http://")).and_then(path_of)
    })
}

/// One HTTP/1.1 exchange from `src`. With `keep` the body is returned, else only
/// counted (kernels and initrds are read to the end and dropped).
/// The runtime kernel and initrd bodies are read on. Each simulated node is a machine
/// of its own; read on the same worker threads as the BMC double, DHCP, TFTP and the
/// firmware's timers, a hundred bodies arriving at gigabytes a second would delay all
/// of those (each read loop runs until its task's budget is spent), and the simulator
/// would report its own queueing as the server's.
fn bulk_runtime() -> &'static tokio::runtime::Runtime {
    static BULK: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    BULK.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(std::thread::available_parallelism().map_or(2, usize::from))
            .thread_name("storm-bulk")
            .enable_all()
            .build()
            .expect("a runtime for bulk reads")
    })
}

/// A GET whose body is counted and dropped, read on [`bulk_runtime`].
async fn bulk_get(
    src: Ipv4Addr,
    server: SocketAddrV4,
    path: String,
) -> (Result<(u16, Vec<u8>, u64)>, Marks) {
    let job = bulk_runtime().spawn(async move {
        let mut marks = Marks::default();
        let r = http_once(src, server, "GET", &path, None, false, "", &mut marks).await;
        (r, marks)
    });
    match job.await {
        Ok(done) => done,
        Err(e) => (Err(anyhow!("the bulk read ended: {e}")), Marks::default()),
    }
}

/// When an exchange connected and when its response head arrived.
#[derive(Default)]
struct Marks {
    connected: Option<Instant>,
    head: Option<Instant>,
}

/// The kind of a request, for the per-request latency table.
fn request_kind(path: &str) -> &'static str {
    let last = path.rsplit('/').next().unwrap_or("");
    if path.starts_with("/boot/") {
        "script (/boot/)"
    } else if path.starts_with("/cfg/") {
        "kickstart (/cfg/)"
    } else if path.starts_with("/cb/") {
        match last {
            "installed" => "installed (/cb/)",
            "first-boot" => "first-boot (/cb/)",
            "health" => "health (/cb/)",
            _ => "other callback (/cb/)",
        }
    } else if path.starts_with("/images/") {
        if last.contains("initrd") {
            "initrd"
        } else {
            "kernel"
        }
    } else {
        "other"
    }
}

#[allow(clippy::too_many_arguments)]
async fn http_once(
    src: Ipv4Addr,
    server: SocketAddrV4,
    method: &str,
    path: &str,
    body: Option<&Value>,
    keep: bool,
    token: &str,
    marks: &mut Marks,
) -> Result<(u16, Vec<u8>, u64)> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::V4(SocketAddrV4::new(src, 0)))?;
    let mut s = tokio::time::timeout(Duration::from_secs(10), sock.connect(server.into()))
        .await
        .context("connect timed out")??;
    marks.connected = Some(Instant::now());
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {server}\r\nUser-Agent: iPXE/1.21.1 (storm)\r\nConnection: close\r\n"
    );
    if path.starts_with("/api/") {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if body.is_some() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            payload.len()
        ));
    }
    head.push_str("\r\n");
    head.push_str(&payload);
    s.write_all(head.as_bytes()).await?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut have = 0;
    // iPXE gives up on a connection idle for about 15 s... keep a margin.
    let idle = Duration::from_secs(30);
    let (status, clen, hlen) = loop {
        let n = tokio::time::timeout(idle, s.read(&mut buf[have..]))
            .await
            .context("idle 30 s in the response head")??;
        if n == 0 {
            bail!("connection closed before the response head");
        }
        have += n;
        let mut hs = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut hs);
        if let httparse::Status::Complete(h) = r.parse(&buf[..have])? {
            let clen = r
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse::<u64>().ok());
            marks.head = Some(Instant::now());
            break (r.code.unwrap_or(0), clen, h);
        }
        if have == buf.len() {
            bail!("response head larger than 256 KiB");
        }
    };
    let mut got = (have - hlen) as u64;
    let mut kept = if keep || status != 200 {
        buf[hlen..have].to_vec()
    } else {
        Vec::new()
    };
    if method == "HEAD" || status == 304 || status == 204 {
        return Ok((status, kept, 0));
    }
    loop {
        if clen.is_some_and(|c| got >= c) {
            break;
        }
        let n = tokio::time::timeout(idle, s.read(&mut buf))
            .await
            .with_context(|| format!("idle 30 s after {got} bytes"))??;
        if n == 0 {
            break;
        }
        got += n as u64;
        if keep || status != 200 {
            kept.extend_from_slice(&buf[..n]);
        }
    }
    if let Some(c) = clen
        && got != c
    {
        bail!("short body: {got} of {c} bytes");
    }
    Ok((status, kept, got))
}

// ---------------------------------------------------------------- Redfish double

#[derive(Clone)]
struct System {
    power_on: bool,
    enabled: String,
    target: String,
}

struct Bmc {
    systems: Mutex<HashMap<String, System>>,
    nodes: HashMap<String, (usize, mpsc::UnboundedSender<()>)>,
    /// Requests by kind (`BMC_KINDS`); `at_t0` is a copy taken when the reinstalls start.
    requests: [AtomicU64; 5],
    at_t0: Mutex<[u64; 5]>,
    resets: AtomicU64,
}

const BMC_KINDS: [&str; 5] = ["root", "systems", "system GET", "PATCH", "reset"];

impl Bmc {
    fn count(&self, kind: usize) {
        self.requests[kind].fetch_add(1, Ordering::Relaxed);
    }

    fn counts(&self) -> [u64; 5] {
        std::array::from_fn(|k| self.requests[k].load(Ordering::Relaxed))
    }
}

fn system_json(id: &str, s: &System) -> Value {
    json!({
        "@odata.id": format!("/redfish/v1/Systems/{id}"),
        "Id": id,
        "Name": id,
        "Manufacturer": "storm",
        "Model": "simulated",
        "BiosVersion": "1.0",
        "PowerState": if s.power_on { "On" } else { "Off" },
        "Boot": {
            "BootSourceOverrideEnabled": s.enabled,
            "BootSourceOverrideTarget": s.target,
            "BootSourceOverrideMode": "UEFI",
            "BootSourceOverrideTarget@Redfish.AllowableValues": ["None", "Pxe", "Hdd", "UefiHttp"],
        },
        "Actions": {"#ComputerSystem.Reset": {
            "target": format!("/redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset"),
            "ResetType@Redfish.AllowableValues": ["On", "ForceOff", "ForceRestart", "PowerCycle"],
        }},
    })
}

async fn rf_root(State(b): State<Arc<Bmc>>) -> Json<Value> {
    b.count(0);
    Json(json!({
        "@odata.id": "/redfish/v1/",
        "RedfishVersion": "1.6.0",
        "Systems": {"@odata.id": "/redfish/v1/Systems"},
    }))
}

async fn rf_systems(State(b): State<Arc<Bmc>>) -> Json<Value> {
    b.count(1);
    let members: Vec<Value> = b
        .systems
        .lock()
        .unwrap()
        .keys()
        .map(|k| json!({"@odata.id": format!("/redfish/v1/Systems/{k}")}))
        .collect();
    Json(json!({"Members@odata.count": members.len(), "Members": members}))
}

async fn rf_system(State(b): State<Arc<Bmc>>, Path(id): Path<String>) -> Response {
    b.count(2);
    match b.systems.lock().unwrap().get(&id) {
        Some(s) => Json(system_json(&id, s)).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn rf_patch(
    State(b): State<Arc<Bmc>>,
    Path(id): Path<String>,
    Json(body): Json<Value>,
) -> Response {
    b.count(3);
    let mut systems = b.systems.lock().unwrap();
    let Some(s) = systems.get_mut(&id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if let Some(e) = body["Boot"]["BootSourceOverrideEnabled"].as_str() {
        s.enabled = e.into();
    }
    if let Some(t) = body["Boot"]["BootSourceOverrideTarget"].as_str() {
        s.target = t.into();
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn rf_reset(
    State(b): State<Arc<Bmc>>,
    Path(id): Path<String>,
    Json(body): Json<Value>,
) -> Response {
    b.count(4);
    b.resets.fetch_add(1, Ordering::Relaxed);
    let kind = body["ResetType"].as_str().unwrap_or("").to_string();
    {
        let mut systems = b.systems.lock().unwrap();
        let Some(s) = systems.get_mut(&id) else {
            return StatusCode::NOT_FOUND.into_response();
        };
        match kind.as_str() {
            "ForceOff" => {
                s.power_on = false;
                return StatusCode::NO_CONTENT.into_response();
            }
            "On" | "ForceOn" if s.power_on => {
                return (StatusCode::CONFLICT, "already on").into_response();
            }
            "On" | "ForceOn" | "PowerCycle" | "ForceRestart" => s.power_on = false,
            _ => return (StatusCode::BAD_REQUEST, "unknown ResetType").into_response(),
        }
    }
    // Off for a second, then on: the machine boots what its override says.
    let b2 = b.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let netboot = {
            let mut systems = b2.systems.lock().unwrap();
            let s = systems.get_mut(&id).expect("system");
            s.power_on = true;
            let net = s.enabled != "Disabled" && (s.target == "Pxe" || s.target == "UefiHttp");
            if s.enabled == "Once" {
                s.enabled = "Disabled".into();
            }
            net
        };
        if netboot && let Some((_, tx)) = b2.nodes.get(&id) {
            let _ = tx.send(());
        }
    });
    StatusCode::NO_CONTENT.into_response()
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let k = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[k.min(v.len() - 1)]
}

/// utime+stime in seconds and RSS in MB of `pid`.
fn proc_sample(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((ticks / 100.0, rss_kb / 1024.0))
}

/// One floor measurement: `floor_pairs` kernel+initrd pairs over `floor_streams`
/// streams, the bytes, the time and the CPU they took.
struct Floor {
    bytes: u64,
    secs: f64,
    cpu: Cpu,
}

async fn measure_floor(args: &Args) -> Result<Floor> {
    let fetched = Arc::new(AtomicU64::new(0));
    let tf = Instant::now();
    let cpu0 = Cpu::now(&args.server_pid);
    {
        let a = args.clone();
        let fetched = fetched.clone();
        each(args.floor_pairs, args.floor_streams, move |_| {
            let a = a.clone();
            let fetched = fetched.clone();
            async move {
                let srv = SocketAddrV4::new(a.server, a.http_port);
                for p in [&a.kernel_path, &a.initrd_path] {
                    let (s, _, got) = bulk_get(a.local, srv, p.to_string()).await.0?;
                    if s != 200 {
                        bail!("floor: HTTP {s} for {p}");
                    }
                    fetched.fetch_add(got, Ordering::Relaxed);
                }
                Ok(())
            }
        })
        .await?;
    }
    Ok(Floor {
        bytes: fetched.load(Ordering::Relaxed),
        secs: tf.elapsed().as_secs_f64(),
        cpu: Cpu::now(&args.server_pid).since(cpu0),
    })
}

/// CPU seconds used so far by the server, by this simulator and by the whole machine
/// (busy time of all cores, from /proc/stat).
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    server: f64,
    sim: f64,
    machine: f64,
}

impl Cpu {
    fn now(server: &[u32]) -> Cpu {
        let busy = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                let l = s.lines().next()?.to_string();
                let f: Vec<f64> = l
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|x| x.parse().ok())
                    .collect();
                // user nice system idle iowait irq softirq steal
                let idle = f.get(3)? + f.get(4)?;
                Some((f.iter().take(8).sum::<f64>() - idle) / 100.0)
            })
            .unwrap_or(f64::NAN);
        Cpu {
            server: proc_total(server).0,
            sim: proc_sample(std::process::id()).map_or(f64::NAN, |s| s.0),
            machine: busy,
        }
    }

    fn since(self, earlier: Cpu) -> Cpu {
        Cpu {
            server: self.server - earlier.server,
            sim: self.sim - earlier.sim,
            machine: self.machine - earlier.machine,
        }
    }
}

/// utime+stime in seconds of every thread of `pids`, summed by thread name (a
/// runtime's workers share theirs).
fn thread_cpu(pids: &[u32]) -> BTreeMap<String, f64> {
    let mut by = BTreeMap::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
            let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
            *by.entry(stat[open + 1..close].to_string()).or_insert(0.0) +=
                (ticks(11) + ticks(12)) / 100.0;
        }
    }
    by
}

fn proc_total(pids: &[u32]) -> (f64, f64) {
    pids.iter()
        .filter_map(|p| proc_sample(*p))
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
}

async fn api(a: &Args, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
    let body = body.unwrap_or(Value::Null);
    let (s, b, _) = http_once(
        a.local,
        SocketAddrV4::new(a.server, a.http_port),
        method,
        &format!("/api/v1{path}"),
        (!body.is_null()).then_some(&body),
        true,
        &a.token,
        &mut Marks::default(),
    )
    .await?;
    let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
    if !(200..300).contains(&s) {
        bail!("{method} {path}: HTTP {s}: {}", String::from_utf8_lossy(&b));
    }
    Ok(v)
}

/// Runs `f(0..n)` with at most `par` at once.
async fn each<F, Fut>(n: usize, par: usize, f: F) -> Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    let sem = Arc::new(Semaphore::new(par));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let fut = f(i);
        set.spawn(async move {
            let r = fut.await;
            drop(permit);
            r
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let n = args.nodes;
    let pxed_mode = args.mode == "pxed";

    let dhcp = {
        let s = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )?;
        s.set_reuse_address(true)?;
        s.set_broadcast(true)?;
        s.bind_device(Some(args.iface.as_bytes()))?;
        s.set_recv_buffer_size(32 << 20)?;
        s.set_send_buffer_size(8 << 20)?;
        s.set_nonblocking(true)?;
        s.bind(&SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68)).into())?;
        UdpSocket::from_std(s.into())?
    };
    let mut txs = Vec::with_capacity(n);
    let mut rxs = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = mpsc::unbounded_channel();
        txs.push(tx);
        rxs.push(rx);
    }
    let sim = Arc::new(Sim {
        args: args.clone(),
        t0: Mutex::new(None),
        cpu0: Mutex::new(Cpu::default()),
        threads0: Mutex::new(BTreeMap::new()),
        counters: Counters::default(),
        requests: Mutex::default(),
        timelines: (0..n).map(|_| Mutex::new(Timeline::default())).collect(),
        waiters: Mutex::new(HashMap::new()),
        dhcp,
        done: tokio::sync::Notify::new(),
        finished: AtomicU64::new(0),
    });

    // DHCP replies, dispatched by xid.
    {
        let sim = sim.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((len, _)) = sim.dhcp.recv_from(&mut buf).await else {
                    continue;
                };
                let Ok(m) = Message::decode(&mut Decoder::new(&buf[..len])) else {
                    continue;
                };
                if m.opcode() != Opcode::BootReply {
                    continue;
                }
                if let Some(tx) = sim.waiters.lock().unwrap().get(&m.xid()) {
                    let _ = tx.send(m);
                }
            }
        });
    }

    let bmc = Arc::new(Bmc {
        systems: Mutex::new(
            (0..n)
                .map(|i| {
                    (
                        format!("s{i}"),
                        System {
                            power_on: true,
                            enabled: "Disabled".into(),
                            target: "None".into(),
                        },
                    )
                })
                .collect(),
        ),
        nodes: txs
            .iter()
            .enumerate()
            .map(|(i, tx)| (format!("s{i}"), (i, tx.clone())))
            .collect(),
        requests: Default::default(),
        at_t0: Mutex::default(),
        resets: AtomicU64::new(0),
    });
    // Sample the server while the storm runs.
    let samples = Arc::new(Mutex::new(Vec::<(f64, f64, f64, u64)>::new()));
    {
        let samples = samples.clone();
        let pids = args.server_pid.clone();
        let sim = sim.clone();
        tokio::spawn(async move {
            let t0 = loop {
                if let Some(t) = *sim.t0.lock().unwrap() {
                    break t;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            loop {
                let (cpu, rss) = proc_total(&pids);
                samples.lock().unwrap().push((
                    t0.elapsed().as_secs_f64(),
                    cpu,
                    rss,
                    sim.finished.load(Ordering::Relaxed),
                ));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    let before = measure_floor(&args).await?;
    if pxed_mode {
        let app = Router::new()
            .route("/redfish/v1/", get(rf_root))
            .route("/redfish/v1", get(rf_root))
            .route("/redfish/v1/Systems", get(rf_systems))
            .route("/redfish/v1/Systems/{id}", get(rf_system).patch(rf_patch))
            .route(
                "/redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset",
                post(rf_reset),
            )
            .with_state(bmc.clone());
        let listen = if args.bmc_net.is_some() {
            Ipv4Addr::UNSPECIFIED
        } else {
            args.local
        };
        let l = tokio::net::TcpListener::bind((listen, args.bmc_port)).await?;
        tokio::spawn(async move { axum::serve(l, app).await });

        let bmc_at = |i| bmc_addr(&args, i);
        eprintln!(
            "registering {n} nodes (BMC: Redfish double at {}..={}:{})",
            bmc_at(0),
            bmc_at(n.saturating_sub(1)),
            args.bmc_port
        );
        let ids: Arc<Mutex<Vec<i64>>> = Arc::new(Mutex::new(vec![0; n]));
        let t = Instant::now();
        {
            let ids = ids.clone();
            let a = args.clone();
            each(n, 16, move |i| {
                let a = a.clone();
                let ids = ids.clone();
                async move {
                    let mac = mac_str(&mac_of(&a.mac_prefix, i));
                    let v = api(
                        &a,
                        "POST",
                        "/nodes",
                        Some(
                            json!({"name": format!("s{i}"), "arch": "x86_64", "macs": [mac],
                            "labels": {"rack": format!("r{}", i / 40)},
                            "bmc": {"driver": "redfish",
                                    "address": format!("http://{}:{}", bmc_addr(&a, i), a.bmc_port),
                                    "username": "admin", "password": "storm-bmc-pw",
                                    "system_id": format!("s{i}")}}),
                        ),
                    )
                    .await?;
                    let id = v["id"].as_i64().ok_or_else(|| anyhow!("no id: {v}"))?;
                    api(&a, "POST", &format!("/nodes/{id}/actions/allocate"), None).await?;
                    ids.lock().unwrap()[i] = id;
                    Ok(())
                }
            })
            .await?;
        }
        eprintln!(
            "registered and allocated in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        for (i, rx) in rxs.into_iter().enumerate() {
            tokio::spawn(sim.clone().node(i, rx));
        }
        *bmc.at_t0.lock().unwrap() = bmc.counts();
        let t0 = Instant::now();
        *sim.t0.lock().unwrap() = Some(t0);
        *sim.cpu0.lock().unwrap() = Cpu::now(&args.server_pid);
        *sim.threads0.lock().unwrap() = thread_cpu(&args.server_pid);
        let ids = ids.lock().unwrap().clone();
        let a = args.clone();
        let img = args.image.clone();
        each(n, args.api_parallel, move |i| {
            let a = a.clone();
            let id = ids[i];
            let img = img.clone();
            async move {
                api(
                    &a,
                    "POST",
                    &format!("/nodes/{id}/reinstall"),
                    Some(json!({"image": img})),
                )
                .await?;
                Ok(())
            }
        })
        .await?;
        eprintln!(
            "{n} reinstall calls answered in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
    } else {
        *sim.t0.lock().unwrap() = Some(Instant::now());
        *sim.cpu0.lock().unwrap() = Cpu::now(&args.server_pid);
        *sim.threads0.lock().unwrap() = thread_cpu(&args.server_pid);
        for (i, rx) in rxs.into_iter().enumerate() {
            tokio::spawn(sim.clone().node(i, rx));
        }
    }
    let t0 = sim.t0.lock().unwrap().expect("t0");

    let cpu0 = *sim.cpu0.lock().unwrap();
    let finished =
        tokio::time::timeout(Duration::from_secs(args.timeout_secs), sim.done.notified())
            .await
            .is_ok();
    let wall = t0.elapsed().as_secs_f64();
    let cpu1 = Cpu::now(&args.server_pid);
    let threads1 = thread_cpu(&args.server_pid);

    // ---- report
    let tls: Vec<Timeline> = sim
        .timelines
        .iter()
        .map(|t| t.lock().unwrap().clone())
        .collect();
    let ok = tls.iter().filter(|t| t.done.is_some()).count();
    let mut by_stage: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (i, t) in tls.iter().enumerate() {
        let (stage, why) = match (&t.failed, t.done) {
            (Some((s, w)), _) => (s.name().to_string(), w.clone()),
            (None, Some(_)) => continue,
            (None, None) => {
                let next = Stage::ALL
                    .iter()
                    .find(|s| !t.ends.contains_key(s))
                    .map_or("?", |s| s.name());
                (format!("{next} (unfinished at the timeout)"), String::new())
            }
        };
        by_stage
            .entry(stage)
            .or_default()
            .push(format!("s{i}: {why}"));
    }
    println!();
    println!(
        "storm: {n} nodes, mode {}, {} ok, {} failed, wall {:.1} s{}",
        args.mode,
        ok,
        n - ok,
        wall,
        if finished { "" } else { " (timed out)" }
    );
    println!(
        "{:<24} {:>8} {:>8} {:>8} {:>8} {:>8}   (seconds, from the previous stage's end)",
        "stage", "min", "p50", "p95", "p99", "max"
    );
    let mut prev_stage: Option<Stage> = None;
    let stages: Vec<Stage> = Stage::ALL
        .iter()
        .copied()
        .filter(|s| pxed_mode || *s <= Stage::Initrd)
        .collect();
    for s in &stages {
        let mut d: Vec<f64> = tls
            .iter()
            .filter_map(|t| {
                let end = t.ends.get(s)?;
                let start = match prev_stage {
                    Some(p) => *t.ends.get(&p)?,
                    None => t0,
                };
                Some(end.duration_since(start).as_secs_f64())
            })
            .collect();
        d.sort_by(f64::total_cmp);
        let label = if *s == Stage::PowerOn && pxed_mode {
            "reinstall call → power on"
        } else {
            s.name()
        };
        println!(
            "{:<24} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}   n={}",
            label,
            pct(&d, 0.0),
            pct(&d, 50.0),
            pct(&d, 95.0),
            pct(&d, 99.0),
            pct(&d, 100.0),
            d.len()
        );
        prev_stage = Some(*s);
    }
    let mut tot: Vec<f64> = tls
        .iter()
        .filter_map(|t| Some(t.done?.duration_since(t0).as_secs_f64()))
        .collect();
    tot.sort_by(f64::total_cmp);
    let end_label = if pxed_mode {
        "total (t0 → available)"
    } else {
        "total (t0 → initrd)"
    };
    println!(
        "{:<24} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}   n={}",
        end_label,
        pct(&tot, 0.0),
        pct(&tot, 50.0),
        pct(&tot, 95.0),
        pct(&tot, 99.0),
        pct(&tot, 100.0),
        tot.len()
    );
    let last_done = tot.last().copied().unwrap_or(f64::NAN);
    // Each HTTP exchange: connected, response head, whole (what a stage's time is made of).
    println!(
        "requests                  connect p50/p95/max    head p50/p95/max     whole p50/p95/max   (seconds)"
    );
    for (kind, v) in sim.requests.lock().unwrap().iter() {
        let col = |k: usize| {
            let mut c: Vec<f64> = v.iter().map(|r| r[k]).collect();
            c.sort_by(f64::total_cmp);
            format!(
                "{:>6.2} {:>6.2} {:>6.2}",
                pct(&c, 50.0),
                pct(&c, 95.0),
                pct(&c, 100.0)
            )
        };
        println!(
            "{kind:<24} {}   {}   {}   n={}",
            col(0),
            col(1),
            col(2),
            v.len()
        );
    }
    let c = &sim.counters;
    println!(
        "retries: DHCP retransmits {}, NAKs {}, TFTP timeouts {}, HTTP retries {}; extra power-ons {}",
        c.dhcp_retransmits.load(Ordering::Relaxed),
        c.dhcp_naks.load(Ordering::Relaxed),
        c.tftp_timeouts.load(Ordering::Relaxed),
        c.http_retries.load(Ordering::Relaxed),
        c.extra_power_ons.load(Ordering::Relaxed)
    );
    if pxed_mode {
        // Every node's state as pxed has it, page by page.
        let mut states: BTreeMap<String, usize> = BTreeMap::new();
        let mut after = 0i64;
        loop {
            let v = api(
                &args,
                "GET",
                &format!("/nodes?limit=1000&after={after}"),
                None,
            )
            .await?;
            let page = v.as_array().cloned().unwrap_or_default();
            for n in &page {
                *states
                    .entry(n["state"].as_str().unwrap_or("?").into())
                    .or_default() += 1;
                after = after.max(n["id"].as_i64().unwrap_or(0));
            }
            if page.len() < 1000 {
                break;
            }
        }
        println!("pxed's node states after the storm: {states:?}");
        let (now, t0) = (bmc.counts(), *bmc.at_t0.lock().unwrap());
        let by_kind = |c: [u64; 5]| {
            let v: Vec<String> = (0..5)
                .map(|k| format!("{} {}", BMC_KINDS[k], c[k]))
                .collect();
            format!("{} ({})", c.iter().sum::<u64>(), v.join(", "))
        };
        println!(
            "BMC double: {} resets; requests before t=0 {}, from t=0 {}",
            bmc.resets.load(Ordering::Relaxed),
            by_kind(t0),
            by_kind(std::array::from_fn(|k| now[k] - t0[k]))
        );
    }
    if by_stage.is_empty() {
        println!("failures by stage: none");
    } else {
        println!("failures by stage:");
        for (s, v) in &by_stage {
            println!(
                "  {s}: {}  e.g. {}",
                v.len(),
                v.iter().take(3).cloned().collect::<Vec<_>>().join(" | ")
            );
        }
    }
    let http_bytes = c.http_bytes.load(Ordering::Relaxed);
    let tftp_bytes = c.tftp_bytes.load(Ordering::Relaxed);
    println!(
        "bytes: HTTP {:.2} GB, TFTP {:.1} MB; server CPU {:.1} s over the storm ({:.0}% of one core)",
        http_bytes as f64 / 1e9,
        tftp_bytes as f64 / 1e6,
        cpu1.server - cpu0.server,
        100.0 * (cpu1.server - cpu0.server) / wall
    );
    {
        let t0 = sim.threads0.lock().unwrap();
        let mut by: Vec<(f64, &String)> = threads1
            .iter()
            .map(|(name, s)| (s - t0.get(name).copied().unwrap_or(0.0), name))
            .filter(|(s, _)| *s >= 0.05)
            .collect();
        by.sort_by(|a, b| b.0.total_cmp(&a.0));
        let by: Vec<String> = by.iter().map(|(s, n)| format!("{n} {s:.1}")).collect();
        println!("server CPU by thread (s): {}", by.join(", "));
    }
    {
        let s = samples.lock().unwrap();
        let peak = s.iter().map(|x| x.2).fold(0.0, f64::max);
        println!(
            "server over time (CPU % of one core over the interval, RSS MB, nodes finished); peak RSS {peak:.0} MB:"
        );
        let step = (s.len() / 12).max(1);
        let mut k = 0;
        while k + step < s.len() {
            let (a, b) = (&s[k], &s[k + step]);
            println!(
                "  t={:>6.1}s  cpu {:>5.0}%  rss {:>6.0} MB  finished {:>5}",
                b.0,
                100.0 * (b.1 - a.1) / (b.0 - a.0),
                b.2,
                b.3
            );
            k += step;
        }
    }

    // ---- the byte-transfer floor: the same files at the server's own HTTP rate,
    // measured before and after the storm; the faster of the two sets the floor (after
    // the larger storms the rate measured came out lower, which would flatter the ratio).
    let after = measure_floor(&args).await?;
    let rate = |f: &Floor| f.bytes as f64 / f.secs;
    let best = if rate(&before) >= rate(&after) {
        &before
    } else {
        &after
    };
    let (ft, fcpu, fetched) = (best.secs, best.cpu, best.bytes);
    let rate = rate(best);
    let floor = (http_bytes + tftp_bytes) as f64 / rate;
    println!(
        "floor: the server's HTTP rate for the same files, {} kernel+initrd pairs over {} streams: {:.0} MB/s before the storm, {:.0} MB/s after; the faster is the floor's",
        args.floor_pairs,
        args.floor_streams,
        before.bytes as f64 / before.secs / 1e6,
        after.bytes as f64 / after.secs / 1e6,
    );
    println!(
        "floor: storm bytes / that rate = {:.1} s; last node finished at {:.1} s = {:.2}× the floor",
        floor,
        last_done,
        last_done / floor
    );
    // What no server could beat with these firmware timings: no kernel byte flows
    // before the first node has powered on, POSTed, leased, fetched its first stage and
    // its script, and the last node still has its installer callback, a DHCP and its
    // first-boot calls to make after its initrd's last byte. The floor between the two
    // is the same bytes at the server's own rate.
    {
        let (mut head, mut tail) = (f64::INFINITY, f64::INFINITY);
        for t in &sim.timelines {
            let t = t.lock().unwrap();
            if let Some(s) = t.ends.get(&Stage::Script) {
                head = head.min((*s - t0).as_secs_f64());
            }
            if let (Some(i), Some(d)) = (t.ends.get(&Stage::Initrd), t.done) {
                tail = tail.min((d - *i).as_secs_f64());
            }
        }
        if head.is_finite() && tail.is_finite() {
            let bound = head + floor + tail;
            println!(
                "bound: first kernel request at {head:.1} s + floor {floor:.1} s + shortest after-initrd {tail:.2} s = {bound:.1} s; last node at {last_done:.1} s = {:.2}× that",
                last_done / bound
            );
        }
    }
    // Where the time went: the storm's CPU (server + simulator) against what its bytes
    // cost at the floor's CPU per GB. On a machine whose cores are all busy, the work
    // besides the bytes (DHCP, TFTP, scripts, callbacks, BMC calls, the simulator's
    // side of all of them) is what stands between the storm and its floor.
    let scpu = cpu1.since(cpu0);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get()) as f64;
    let gb = |b: f64| b / 1e9;
    let fgb = gb(fetched as f64);
    let sgb = gb((http_bytes + tftp_bytes) as f64);
    let per_gb = (fcpu.server + fcpu.sim) / fgb;
    let other = scpu.server + scpu.sim - per_gb * sgb;
    println!(
        "cpu: storm {:.1} s wall, server {:.1} s + simulator {:.1} s, machine {:.0}% of {} cores busy",
        wall,
        scpu.server,
        scpu.sim,
        100.0 * scpu.machine / (wall * cores),
        cores
    );
    println!(
        "cpu: floor {:.1} s wall for {:.1} GB, server {:.1} s + simulator {:.1} s ({:.2} CPU-s per GB), machine {:.0}% busy",
        ft,
        fgb,
        fcpu.server,
        fcpu.sim,
        per_gb,
        100.0 * fcpu.machine / (ft * cores)
    );
    println!(
        "cpu: the storm's {:.1} GB at that cost = {:.1} CPU-s; everything else = {:.1} CPU-s ({:.1} ms per node), {:.1} s of the {} cores",
        sgb,
        per_gb * sgb,
        other,
        1000.0 * other / n as f64,
        other / cores,
        cores
    );
    println!(
        "RESULT mode={} nodes={} ok={} failed={} last={:.1} floor={:.1} ratio={:.2}",
        args.mode,
        n,
        ok,
        n - ok,
        last_done,
        floor,
        last_done / floor
    );
    Ok(())
}
