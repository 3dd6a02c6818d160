//! TFTP server against real clients (atftp, curl, tftp-hpa) and a raw UDP client.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::common::poll;
use pxed::config::TftpSettings;
use pxed::metrics::Render;
use pxed::tftp::{TftpError, TftpStats, serve};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_millis(200);

fn settings(retries: u32, max_transfers: usize) -> TftpSettings {
    TftpSettings {
        max_transfers,
        timeout: TIMEOUT,
        retries,
    }
}

struct Tftp {
    addr: SocketAddr,
    root: tempfile::TempDir,
    stats: Arc<TftpStats>,
    cancel: CancellationToken,
    task: Option<JoinHandle<Result<(), TftpError>>>,
}

impl Tftp {
    async fn start(s: TftpSettings) -> Self {
        Self::start_on("127.0.0.1:0", s).await
    }

    async fn start_on(bind: &str, s: TftpSettings) -> Self {
        let sock = pxed::net::bind_udp(bind.parse().unwrap(), None, false).unwrap();
        let addr = sock.local_addr().unwrap();
        let root = tempfile::tempdir().unwrap();
        let stats = Arc::new(TftpStats::default());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(
            sock,
            root.path().to_path_buf(),
            s,
            stats.clone(),
            cancel.clone(),
        ));
        Tftp {
            addr,
            root,
            stats,
            cancel,
            task: Some(task),
        }
    }

    fn port(&self) -> u16 {
        self.addr.port()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    /// Writes `len` random bytes to `name` under the root and returns them.
    fn random_file(&self, name: &str, len: usize) -> Vec<u8> {
        let mut data = vec![0u8; len];
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut data)
            .unwrap();
        std::fs::write(self.path(name), &data).unwrap();
        data
    }

    /// Polls until no transfer is in flight.
    async fn idle(&self) {
        let idle = async || (self.stats.active.get() == 0).then_some(());
        if poll(Duration::from_secs(5), idle).await.is_none() {
            panic!("transfers still active: {}", self.stats.active.get());
        }
    }

    fn metrics(&self) -> String {
        let mut s = String::new();
        self.stats.render(&mut s);
        s
    }
}

impl Drop for Tftp {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn tool(name: &str) -> &str {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false);
    assert!(found, "{name} is not installed (see .ci/install.sh)");
    name
}

async fn run(cmd: &str, args: &[&str]) -> std::process::Output {
    let out = tokio::process::Command::new(tool(cmd))
        .args(args)
        .kill_on_drop(true)
        .output();
    timeout(Duration::from_secs(120), out)
        .await
        .unwrap_or_else(|_| panic!("{cmd} {args:?} hung"))
        .unwrap()
}

async fn atftp(port: u16, remote: &str, local: &Path, options: &[&str]) {
    let mut args = Vec::new();
    for o in options {
        args.extend(["--option", o]);
    }
    let p = port.to_string();
    let l = local.to_str().unwrap();
    args.extend(["-g", "-r", remote, "-l", l, "127.0.0.1", &p]);
    let out = run("atftp", &args).await;
    assert!(out.status.success(), "atftp {args:?}: {out:?}");
}

async fn curl(port: u16, remote: &str, local: &Path, blksize: u32) {
    let url = format!("tftp://127.0.0.1:{port}/{remote}");
    let b = blksize.to_string();
    let out = run(
        "curl",
        &[
            "-sS",
            "--tftp-blksize",
            &b,
            "-o",
            local.to_str().unwrap(),
            &url,
        ],
    )
    .await;
    assert!(out.status.success(), "curl {url}: {out:?}");
}

async fn tftp_hpa(port: u16, mode: &str, remote: &str, local: &Path) {
    let p = port.to_string();
    let out = run(
        "tftp",
        &[
            "-m",
            mode,
            "127.0.0.1",
            &p,
            "-c",
            "get",
            remote,
            local.to_str().unwrap(),
        ],
    )
    .await;
    assert!(out.status.success(), "tftp-hpa {remote}: {out:?}");
}

fn same(got: &Path, want: &[u8], what: &str) {
    let got = std::fs::read(got).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(got == want, "{what}: content differs");
}

/// A raw client on its own UDP port.
struct Raw {
    sock: UdpSocket,
}

impl Raw {
    async fn new() -> Self {
        Self::new_on("127.0.0.1:0").await
    }

    async fn new_on(addr: &str) -> Self {
        Raw {
            sock: UdpSocket::bind(addr).await.unwrap(),
        }
    }

    async fn send_req(&self, to: SocketAddr, op: u16, name: &[u8], opts: &[(&str, &str)]) {
        let mut p = op.to_be_bytes().to_vec();
        p.extend_from_slice(name);
        p.extend_from_slice(b"\0octet\0");
        for (k, v) in opts {
            p.extend_from_slice(k.as_bytes());
            p.push(0);
            p.extend_from_slice(v.as_bytes());
            p.push(0);
        }
        self.sock.send_to(&p, to).await.unwrap();
    }

    async fn rrq(&self, to: SocketAddr, name: &str, opts: &[(&str, &str)]) {
        self.send_req(to, 1, name.as_bytes(), opts).await;
    }

    async fn recv(&self, within: Duration) -> Option<(Vec<u8>, SocketAddr)> {
        let mut buf = vec![0u8; 70000];
        match timeout(within, self.sock.recv_from(&mut buf)).await {
            Ok(Ok((n, from))) => Some((buf[..n].to_vec(), from)),
            Ok(Err(e)) => panic!("recv: {e}"),
            Err(_) => None,
        }
    }

    async fn expect(&self, what: &str) -> (Vec<u8>, SocketAddr) {
        self.recv(Duration::from_secs(3))
            .await
            .unwrap_or_else(|| panic!("no packet: expected {what}"))
    }

    async fn ack(&self, to: SocketAddr, block: u16) {
        let mut p = vec![0, 4];
        p.extend_from_slice(&block.to_be_bytes());
        self.sock.send_to(&p, to).await.unwrap();
    }
}

fn opcode(p: &[u8]) -> u16 {
    u16::from_be_bytes([p[0], p[1]])
}

fn arg(p: &[u8]) -> u16 {
    u16::from_be_bytes([p[2], p[3]])
}

fn assert_data(p: &[u8], block: u16) {
    assert_eq!(
        (opcode(p), arg(p)),
        (3, block),
        "expected DATA {block}, got {p:?}"
    );
}

fn assert_error(p: &[u8], code: u16) {
    assert_eq!(
        opcode(p),
        5,
        "expected ERROR {code}, got {:?}",
        &p[..p.len().min(40)]
    );
    assert_eq!(arg(p), code, "error {:?}", String::from_utf8_lossy(&p[4..]));
}

fn oack_options(p: &[u8]) -> Vec<(String, String)> {
    assert_eq!(opcode(p), 6, "expected OACK, got {p:?}");
    let fields: Vec<String> = p[2..]
        .split(|&b| b == 0)
        .map(|f| String::from_utf8(f.to_vec()).unwrap())
        .collect();
    fields
        .chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].clone(), c[1].clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_fetch_byte_identical() {
    let t = Tftp::start(settings(5, 64)).await;
    let out = tempfile::tempdir().unwrap();
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for (name, len) in [
        ("empty", 0),
        ("one", 1),
        ("b512", 512),
        ("b1536", 1536),
        ("w16", 1468 * 16),
        ("odd", 1468 * 16 + 7),
        ("mib", 1 << 20),
    ] {
        files.push((name.into(), t.random_file(name, len)));
    }
    std::fs::create_dir(t.path("sub")).unwrap();
    files.push(("sub/deep.bin".into(), t.random_file("sub/deep.bin", 3000)));
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("ipxe/bin");
    for name in [
        "snponly.efi",
        "undionly.kpxe",
        "ipxe-amd64.efi",
        "ipxe-arm64.efi",
    ] {
        let data = std::fs::read(bin.join(name)).unwrap();
        std::fs::write(t.path(name), &data).unwrap();
        files.push((name.into(), data));
    }
    let uefi = ["blksize 1468", "windowsize 16", "tsize 0"];
    for (i, (name, data)) in files.iter().enumerate() {
        let a = out.path().join(format!("a{i}"));
        atftp(t.port(), name, &a, &uefi).await;
        same(&a, data, &format!("atftp {name}"));
        // curl 7.88 fails on an empty file with any server (tftpd-hpa too):
        // "getpeername() failed with errno 107".
        if !data.is_empty() {
            let c = out.path().join(format!("c{i}"));
            curl(t.port(), name, &c, 1468).await;
            same(&c, data, &format!("curl {name}"));
        }
        let h = out.path().join(format!("h{i}"));
        tftp_hpa(t.port(), "binary", name, &h).await;
        same(&h, data, &format!("tftp-hpa {name}"));
    }
    // A leading slash, as many PXE ROMs send it.
    let s = out.path().join("slash");
    tftp_hpa(t.port(), "binary", "/snponly.efi", &s).await;
    same(
        &s,
        &std::fs::read(bin.join("snponly.efi")).unwrap(),
        "leading slash",
    );
    t.idle().await;
    let n = files.len() as u64 * 3;
    assert_eq!(t.stats.completed.get(), n, "{}", t.metrics());
    assert_eq!(t.stats.failed.get(), 0);
    assert_eq!(t.stats.requests.get(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netascii_round_trips_through_tftp_hpa() {
    let t = Tftp::start(settings(5, 8)).await;
    let text = b"#!ipxe\nchain http://x/y\r\nbare\rcr\n".to_vec();
    std::fs::write(t.path("boot.ipxe"), &text).unwrap();
    let out = tempfile::tempdir().unwrap();
    let h = out.path().join("h");
    tftp_hpa(t.port(), "netascii", "boot.ipxe", &h).await;
    same(&h, &text, "netascii");
    // The same file in octet mode is untouched.
    tftp_hpa(t.port(), "binary", "boot.ipxe", &h).await;
    same(&h, &text, "octet");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_numbers_roll_over() {
    let t = Tftp::start(settings(5, 8)).await;
    let out = tempfile::tempdir().unwrap();
    // blksize 16: 1.1 MB is ~69k blocks, past 65535.
    let data = t.random_file("roll", 1_100_000);
    let a = out.path().join("a");
    atftp(
        t.port(),
        "roll",
        &a,
        &["blksize 16", "windowsize 8", "tsize 0"],
    )
    .await;
    same(&a, &data, "atftp blksize 16");
    // curl with blksize 8 and no window: ~73k lock-step blocks.
    let small = t.random_file("roll8", 590_000);
    let c = out.path().join("c");
    curl(t.port(), "roll8", &c, 8).await;
    same(&c, &small, "curl blksize 8");
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 2);
}

#[tokio::test]
async fn error_after_oack_ends_the_transfer() {
    let t = Tftp::start(settings(3, 8)).await;
    let data = t.random_file("snponly.efi", 284_672);
    let c = Raw::new().await;
    // What UEFI firmware sends first: a size probe.
    c.rrq(
        t.addr,
        "snponly.efi",
        &[("tsize", "0"), ("blksize", "1468")],
    )
    .await;
    let (p, tid) = c.expect("OACK").await;
    assert_eq!(
        oack_options(&p),
        vec![
            ("tsize".to_string(), data.len().to_string()),
            ("blksize".to_string(), "1468".to_string())
        ]
    );
    assert_ne!(tid, t.addr, "the transfer must use a new TID");
    assert_eq!(t.stats.active.get(), 1);
    c.sock
        .send_to(b"\0\x05\0\x08TFTP Aborted\0", tid)
        .await
        .unwrap();
    // Nothing more: no OACK retransmission, no DATA, for several timeouts.
    let more = c.recv(TIMEOUT * 5).await;
    assert!(more.is_none(), "packet after the client's ERROR: {more:?}");
    t.idle().await;
    assert_eq!(t.stats.client_aborts.get(), 1);
    assert_eq!(t.stats.failed.get(), 0);
    assert_eq!(t.stats.completed.get(), 0);
}

#[tokio::test]
async fn no_options_start_with_data_1_and_foreign_tids_get_error_5() {
    let t = Tftp::start(settings(3, 8)).await;
    let data = t.random_file("f", 1000);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[("unknown", "1")]).await;
    let (p, tid) = c.expect("DATA 1").await;
    assert_data(&p, 1);
    assert_eq!(&p[4..], &data[..512]);
    assert_eq!(tid.ip(), t.addr.ip(), "reply from the contacted address");

    let stranger = Raw::new().await;
    stranger.ack(tid, 1).await;
    let (e, from) = stranger.expect("ERROR 5").await;
    assert_error(&e, 5);
    assert_eq!(from, tid);

    c.ack(tid, 1).await;
    let (p, _) = c.expect("DATA 2").await;
    assert_data(&p, 2);
    assert_eq!(&p[4..], &data[512..]);
    c.ack(tid, 2).await;
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 1);
    assert_eq!(t.stats.unknown_tid.get(), 1);
}

#[tokio::test]
async fn refusals_get_error_packets() {
    let t = Tftp::start(settings(3, 8)).await;
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"no").unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), t.path("escape")).unwrap();
    std::fs::create_dir(t.path("a")).unwrap();
    t.random_file("x", 10);
    let c = Raw::new().await;
    let cases: &[(&[u8], u16)] = &[
        (b"../x", 2),
        (b"/../../etc/passwd", 2),
        (b"a/../../x", 2),
        (b"a/../x", 2),
        (b"escape", 2),
        (b"a", 2),
        (b"missing", 1),
        (b"", 1),
    ];
    for (name, code) in cases {
        c.send_req(t.addr, 1, name, &[]).await;
        let (p, _) = c.expect("ERROR").await;
        assert_error(&p, *code);
    }
    c.send_req(t.addr, 2, b"x", &[]).await;
    let (p, _) = c.expect("ERROR 2 for WRQ").await;
    assert_error(&p, 2);
    c.sock.send_to(b"\0\x01x\0mail\0", t.addr).await.unwrap();
    let (p, _) = c.expect("ERROR 4 for mode mail").await;
    assert_error(&p, 4);
    t.idle().await;
    assert_eq!(t.stats.refused.get(), cases.len() as u64 + 2);
    assert_eq!(t.stats.completed.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_flood_does_not_stop_the_listener() {
    let t = Tftp::start(settings(3, 8)).await;
    let data = t.random_file("f", 100_000);
    let c = Raw::new().await;
    let crafted: Vec<Vec<u8>> = vec![
        vec![],
        vec![0],
        vec![0, 1],
        b"\0\x01noterminator".to_vec(),
        b"\0\x01file\0".to_vec(),
        b"\0\x01file\0octet".to_vec(),
        b"\0\x01file\0\0".to_vec(),
        b"\0\x03\0\x01data".to_vec(),
        b"\0\x04\0\x01".to_vec(),
        b"\0\x05\0\x01err\0".to_vec(),
        b"\0\x06blksize\x008\0".to_vec(),
        b"\x07\x07".to_vec(),
        [b"\0\x01".as_slice(), &[b'a'; 3000], b"\0octet\0"].concat(),
        vec![0xff; 65000],
    ];
    // In batches, waiting for each to be counted: the kernel would drop a burst
    // larger than the socket's receive buffer, and the count would be short.
    let mut want = 0;
    for _ in 0..10 {
        for p in &crafted {
            c.sock.send_to(p, t.addr).await.unwrap();
        }
        want += crafted.len() as u64;
        dropped(&t, want).await;
    }
    let mut rng = std::fs::File::open("/dev/urandom").unwrap();
    let mut buf = [0u8; 600];
    for i in 0..300 {
        let len = 1 + i % 600;
        rng.read_exact(&mut buf[..len]).unwrap();
        // Keep the opcode invalid so no random packet is a valid request.
        buf[0] = 0x80;
        c.sock.send_to(&buf[..len], t.addr).await.unwrap();
        if i % 50 == 49 {
            dropped(&t, want + i as u64 + 1).await;
        }
    }
    want += 300;
    dropped(&t, want).await;
    assert_eq!(t.stats.malformed_dropped.get(), want);
    assert_eq!(t.stats.requests.get(), 0);
    let out = tempfile::tempdir().unwrap();
    let a = out.path().join("a");
    atftp(
        t.port(),
        "f",
        &a,
        &["blksize 1468", "windowsize 16", "tsize 0"],
    )
    .await;
    same(&a, &data, "after the flood");
    assert!(
        t.metrics()
            .contains(&format!("pxed_tftp_malformed_dropped_total {want}\n"))
    );
}

/// Polls until `n` malformed packets were counted.
async fn dropped(t: &Tftp, n: u64) {
    let counted = async || (t.stats.malformed_dropped.get() >= n).then_some(());
    if poll(Duration::from_secs(5), counted).await.is_none() {
        panic!("malformed: {} of {n}", t.stats.malformed_dropped.get());
    }
}

#[tokio::test]
async fn a_lost_ack_gets_the_data_again() {
    let t = Tftp::start(settings(3, 8)).await;
    let data = t.random_file("f", 700);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[]).await;
    let (p, tid) = c.expect("DATA 1").await;
    assert_data(&p, 1);
    // Not acknowledged: the server resends after its timeout.
    let started = Instant::now();
    let (again, _) = c.expect("DATA 1 again").await;
    assert_data(&again, 1);
    assert!(started.elapsed() >= TIMEOUT / 2, "resent too early");
    assert_eq!(again, p);
    c.ack(tid, 1).await;
    let (p2, _) = c.expect("DATA 2").await;
    assert_data(&p2, 2);
    assert_eq!(&p2[4..], &data[512..]);
    // A duplicate ACK 1 does not trigger another DATA 2 (Sorcerer's Apprentice).
    c.ack(tid, 1).await;
    c.ack(tid, 1).await;
    let (p3, _) = c.expect("DATA 2 only by timeout").await;
    assert_data(&p3, 2);
    assert!(started.elapsed() >= TIMEOUT * 2 - TIMEOUT / 4);
    c.ack(tid, 2).await;
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 1);
}

#[tokio::test]
async fn a_silent_client_gets_retries_plus_one_copies() {
    let retries = 3;
    let t = Tftp::start(settings(retries, 8)).await;
    t.random_file("f", 5000);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[]).await;
    let (p, tid) = c.expect("DATA 1").await;
    assert_data(&p, 1);
    c.ack(tid, 1).await;
    let mut copies = 0;
    while let Some((p, _)) = c.recv(TIMEOUT * 3).await {
        assert_data(&p, 2);
        copies += 1;
    }
    assert_eq!(copies, retries + 1);
    t.idle().await;
    assert_eq!(t.stats.failed.get(), 1);
    // After the OACK the same.
    c.rrq(t.addr, "f", &[("blksize", "1024")]).await;
    let (p, tid) = c.expect("OACK").await;
    oack_options(&p);
    c.ack(tid, 0).await;
    let mut copies = 0;
    while let Some((p, _)) = c.recv(TIMEOUT * 3).await {
        assert_data(&p, 1);
        copies += 1;
    }
    assert_eq!(copies, retries + 1);
    t.idle().await;
    assert_eq!(t.stats.failed.get(), 2);
    assert_eq!(t.stats.first_ack_timeouts.get(), 0);
}

/// A client that never acknowledges the first packet (OACK or DATA 1) gets it
/// twice, not `retries` + 1 times (a forged request is not amplified); the transfer
/// listens for a late ACK for the timeout × (retries + 1), then frees its slot.
#[tokio::test]
async fn a_client_that_never_answers_gets_the_first_packet_twice() {
    let t = Tftp::start(TftpSettings {
        max_transfers: 8,
        timeout: Duration::from_millis(200),
        retries: 4,
    })
    .await;
    t.random_file("f", 5000);
    for opts in [&[][..], &[("tsize", "0"), ("blksize", "1468")]] {
        let c = Raw::new().await;
        let started = Instant::now();
        c.rrq(t.addr, "f", opts).await;
        let (first, _) = c.expect("the first packet").await;
        let (again, _) = c.expect("the first packet again").await;
        assert_eq!(again, first);
        assert!(c.recv(Duration::from_millis(500)).await.is_none());
        t.idle().await;
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(1000) && took < Duration::from_millis(1800),
            "slot held {took:?}, for 1 s of listening"
        );
        assert!(c.recv(Duration::from_millis(300)).await.is_none());
    }
    assert_eq!(t.stats.first_ack_timeouts.get(), 2);
    assert_eq!(t.stats.retransmits.get(), 2);
    assert_eq!(t.stats.failed.get(), 0);
    assert!(
        t.metrics()
            .contains("pxed_tftp_first_ack_timeouts_total 2\n")
    );
}

/// A firmware that got the OACK but whose ACK was lost resends only the ACK, after
/// its own timeout (OVMF: 4 s), never the request: the transfer must still be
/// there to take it. Here the ACK comes after both OACKs, 1.5 s in, within the 2 s
/// (timeout × (retries + 1)) the transfer listens.
#[tokio::test]
async fn a_late_first_ack_after_both_copies_still_gets_the_file() {
    let t = Tftp::start(TftpSettings {
        max_transfers: 8,
        timeout: Duration::from_millis(500),
        retries: 3,
    })
    .await;
    let data = t.random_file("f", 5000);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[("tsize", "0"), ("blksize", "1468")])
        .await;
    let (oack, tid) = c.expect("OACK").await;
    assert_eq!(opcode(&oack), 6);
    let (again, _) = c.expect("OACK again").await;
    assert_eq!(again, oack);
    assert!(c.recv(Duration::from_millis(900)).await.is_none());
    c.ack(tid, 0).await;
    let mut got = Vec::new();
    let mut block = 1u16;
    loop {
        let (p, _) = c.expect("DATA after the late ACK").await;
        assert_data(&p, block);
        got.extend_from_slice(&p[4..]);
        c.ack(tid, block).await;
        if p.len() - 4 < 1468 {
            break;
        }
        block += 1;
    }
    assert_eq!(got, data);
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 1);
    assert_eq!(t.stats.first_ack_timeouts.get(), 0);
}

#[tokio::test]
async fn a_client_whose_port_closed_ends_the_transfer_at_once() {
    // With 20 retries a silent client holds its slot for 20 timeouts (4 s) once it
    // has answered; a client whose port is closed answers the first resend with
    // ICMP port unreachable, and that ends the transfer.
    let t = Tftp::start(settings(20, 8)).await;
    t.random_file("f", 5000);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[]).await;
    let (p, tid) = c.expect("DATA 1").await;
    assert_data(&p, 1);
    c.ack(tid, 1).await;
    assert_data(&c.expect("DATA 2").await.0, 2);
    let started = Instant::now();
    drop(c);
    t.idle().await;
    assert!(
        started.elapsed() < TIMEOUT * 10,
        "transfer lingered {:?} after the client went away",
        started.elapsed()
    );
    assert_eq!(t.stats.client_aborts.get(), 1);
    assert_eq!(t.stats.failed.get(), 0);
    assert_eq!(t.stats.retransmits.get(), 1);
}

#[tokio::test]
async fn window_resumes_after_a_partial_ack() {
    let t = Tftp::start(settings(3, 8)).await;
    let data = t.random_file("f", 100 * 10 + 5);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[("blksize", "100"), ("windowsize", "4")])
        .await;
    let (p, tid) = c.expect("OACK").await;
    assert_eq!(oack_options(&p).len(), 2);
    c.ack(tid, 0).await;
    for b in 1..=4 {
        assert_data(&c.expect("window 1").await.0, b);
    }
    // Pretend block 3 was lost: ACK 2; the next window starts at 3.
    c.ack(tid, 2).await;
    for b in 3..=6 {
        let (p, _) = c.expect("window from 3").await;
        assert_data(&p, b);
        let off = (b as usize - 1) * 100;
        assert_eq!(&p[4..], &data[off..off + 100]);
    }
    c.ack(tid, 6).await;
    for b in 7..=10 {
        assert_data(&c.expect("window from 7").await.0, b);
    }
    c.ack(tid, 10).await;
    let (p, _) = c.expect("last block").await;
    assert_data(&p, 11);
    assert_eq!(&p[4..], &data[1000..]);
    c.ack(tid, 11).await;
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 1);
}

/// Over the limit a request gets no answer (an ERROR would end the firmware's boot);
/// its retransmission is served once a slot is free.
#[tokio::test]
async fn over_the_limit_waits_for_the_retransmission() {
    let t = Tftp::start(settings(50, 1)).await;
    t.random_file("f", 5000);
    let a = Raw::new().await;
    a.rrq(t.addr, "f", &[]).await;
    let (p, tid) = a.expect("DATA 1").await;
    assert_data(&p, 1);
    // Answered, so not a transfer a newcomer can take the slot of.
    a.ack(tid, 1).await;
    assert_data(&a.expect("DATA 2").await.0, 2);
    let b = Raw::new_on("127.0.0.2:0").await;
    b.rrq(t.addr, "f", &[]).await;
    assert!(b.recv(Duration::from_millis(300)).await.is_none());
    assert_eq!(t.stats.busy.get(), 1);
    // The first transfer ends; the retransmitted request is served.
    drop(a);
    t.idle().await;
    b.rrq(t.addr, "f", &[]).await;
    let (p, _) = b.expect("DATA 1 for the retransmission").await;
    assert_data(&p, 1);
    assert_eq!(t.stats.busy.get(), 1);
}

#[tokio::test]
async fn cancel_ends_listener_and_transfers() {
    let mut t = Tftp::start(settings(50, 8)).await;
    t.random_file("f", 5000);
    let c = Raw::new().await;
    c.rrq(t.addr, "f", &[]).await;
    let (_, tid) = c.expect("DATA 1").await;
    assert_eq!(t.stats.active.get(), 1);
    let started = Instant::now();
    t.cancel.cancel();
    let task = t.task.take().unwrap();
    timeout(Duration::from_secs(1), task)
        .await
        .expect("serve did not return within 1 s")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(1));
    // The client hears about it instead of timing out. (A DATA 1 retransmit may
    // come first if the timeout raced the cancel.)
    loop {
        let (p, from) = c.expect("ERROR on shutdown").await;
        assert_eq!(from, tid);
        if opcode(&p) == 5 {
            assert_error(&p, 0);
            break;
        }
        assert_data(&p, 1);
    }
    assert_eq!(t.stats.active.get(), 0);
}

#[tokio::test]
async fn ipv6_transfers_and_strays() {
    let t = Tftp::start_on("[::1]:0", settings(3, 8)).await;
    let data = t.random_file("f", 3000);
    let out = tempfile::tempdir().unwrap();
    let got = out.path().join("f");
    let url = format!("tftp://[::1]:{}/f", t.port());
    let r = run("curl", &["-sS", "-o", got.to_str().unwrap(), &url]).await;
    assert!(r.status.success(), "curl {url}: {r:?}");
    same(&got, &data, "curl over IPv6");
    // The stray-sender socket works over IPv6 too.
    let c = Raw::new_on("[::1]:0").await;
    c.rrq(t.addr, "f", &[]).await;
    let (p, tid) = c.expect("DATA 1").await;
    assert_data(&p, 1);
    let stranger = Raw::new_on("[::1]:0").await;
    stranger.ack(tid, 1).await;
    let (e, from) = stranger.expect("ERROR 5").await;
    assert_error(&e, 5);
    assert_eq!(from, tid);
    drop(c);
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 1);
    assert_eq!(t.stats.unknown_tid.get(), 1);
}

#[tokio::test]
async fn wildcard_listener_replies_from_the_contacted_address() {
    let t = Tftp::start_on("0.0.0.0:0", settings(3, 8)).await;
    t.random_file("f", 10);
    for ip in ["127.0.0.1", "127.0.0.2"] {
        let to: SocketAddr = format!("{ip}:{}", t.port()).parse().unwrap();
        let c = Raw::new().await;
        c.rrq(to, "f", &[]).await;
        let (p, from) = c.expect("DATA 1").await;
        assert_data(&p, 1);
        assert_eq!(from.ip().to_string(), ip);
        assert_ne!(from.port(), t.port());
        c.ack(from, 1).await;
    }
    t.idle().await;
    assert_eq!(t.stats.completed.get(), 2);
}

/// Threads of this process (the test binary: the server runs in it).
fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Samples `threads()` every few milliseconds until dropped; keeps the highest.
struct ThreadPeak {
    peak: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl ThreadPeak {
    fn start() -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let peak = Arc::new(AtomicUsize::new(threads()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(threads(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        ThreadPeak { peak, stop }
    }

    fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for ThreadPeak {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Issue 10, finding 6: 300 requests that never acknowledge, from 100 addresses
/// (under the per-client limit, as forged addresses would be), more than the
/// default 256 slots. A real client is still served at once, and the half-open
/// transfers hold no thread each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_flood_does_not_delay_a_real_client() {
    let t = Tftp::start(TftpSettings {
        max_transfers: 256,
        timeout: Duration::from_secs(1),
        retries: 1,
    })
    .await;
    let data = t.random_file("snponly.efi", 200_000);
    let before = threads();
    let peak = ThreadPeak::start();
    let mut flood = Vec::new();
    for i in 0..300u32 {
        let c = Raw::new_on(&format!("127.0.0.{}:0", 10 + i / 3)).await;
        // Half ask for options (OACK first), half not (DATA 1 first).
        let opts: &[(&str, &str)] = if i % 2 == 0 {
            &[("tsize", "0"), ("blksize", "1468")]
        } else {
            &[]
        };
        c.rrq(t.addr, "snponly.efi", opts).await;
        // Kept open: a closed port would end its transfer at once.
        flood.push(c);
    }
    let all = async || (t.stats.requests.get() == 300).then_some(());
    assert!(poll(Duration::from_secs(5), all).await.is_some());
    // A half-open transfer is ended for a newcomer once older than the grace (10 ms
    // while no client has answered): a flood must fill 256 slots faster than that.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let out = tempfile::tempdir().unwrap();
    let got = out.path().join("got");
    let started = Instant::now();
    curl(t.port(), "snponly.efi", &got, 1468).await;
    let took = started.elapsed();
    same(&got, &data, "during the flood");
    assert!(took < Duration::from_secs(1), "served after {took:?}");
    // Every half-open transfer ends: evicted, or after the timeout × (retries + 1).
    let done = async || (t.stats.active.get() == 0).then_some(());
    assert!(
        poll(Duration::from_secs(4), done).await.is_some(),
        "{}",
        t.metrics()
    );
    let peak = peak.peak();
    assert!(
        peak < before + 40,
        "threads: {before} before the flood, {peak} at its peak"
    );
    let s = &t.stats;
    assert_eq!(s.completed.get(), 1);
    // A flood request that found only younger half-open transfers was left unanswered.
    assert_eq!(
        s.evicted.get() + s.first_ack_timeouts.get() + s.busy.get(),
        300
    );
    assert!(
        s.evicted.get() + s.busy.get() >= 300 - 256,
        "{}",
        t.metrics()
    );
    eprintln!("threads: {before} before the flood, {peak} at its peak; curl took {took:?}");
}

/// One address gets `MAX_PER_CLIENT` (4) transfers; beyond that it is told busy,
/// while another address is served.
#[tokio::test]
async fn one_client_address_gets_at_most_four_transfers() {
    // A timeout of 1 s keeps the half-open transfers for a second.
    let t = Tftp::start(TftpSettings {
        max_transfers: 64,
        timeout: Duration::from_secs(1),
        retries: 3,
    })
    .await;
    t.random_file("f", 5000);
    let mut held = Vec::new();
    for _ in 0..4 {
        let c = Raw::new_on("127.0.0.2:0").await;
        c.rrq(t.addr, "f", &[]).await;
        let (p, tid) = c.expect("DATA 1").await;
        assert_data(&p, 1);
        held.push((c, tid));
    }
    let fifth = Raw::new_on("127.0.0.2:0").await;
    fifth.rrq(t.addr, "f", &[]).await;
    let (p, from) = fifth.expect("busy").await;
    assert_error(&p, 0);
    assert_eq!(&p[4..p.len() - 1], b"server busy (per-client limit)");
    assert_eq!(from, t.addr);
    let other = Raw::new_on("127.0.0.3:0").await;
    other.rrq(t.addr, "f", &[]).await;
    assert_data(&other.expect("DATA 1 for another address").await.0, 1);
    // A transfer of the first address ends: it may start another.
    let (c, tid) = held.pop().unwrap();
    c.sock.send_to(b"\0\x05\0\x00done\0", tid).await.unwrap();
    let again = async || {
        fifth.rrq(t.addr, "f", &[]).await;
        let (p, _) = fifth.expect("an answer").await;
        (opcode(&p) == 3).then_some(())
    };
    assert!(poll(Duration::from_secs(2), again).await.is_some());
    assert!(t.stats.busy_client.get() >= 1);
    assert_eq!(t.stats.busy.get(), 0);
    assert!(t.metrics().contains(&format!(
        "pxed_tftp_busy_client_total {}\n",
        t.stats.busy_client.get()
    )));
}

/// With every slot taken, a newcomer ends the oldest half-open transfer (whose
/// client is told busy), never one whose client has answered.
#[tokio::test]
async fn a_newcomer_takes_the_slot_of_the_oldest_half_open_transfer() {
    // A timeout of 1 s keeps the half-open transfers for a second.
    let t = Tftp::start(TftpSettings {
        max_transfers: 3,
        timeout: Duration::from_secs(1),
        retries: 3,
    })
    .await;
    t.random_file("f", 5000);
    let answered = Raw::new_on("127.0.0.2:0").await;
    answered.rrq(t.addr, "f", &[]).await;
    let (p, tid) = answered.expect("DATA 1").await;
    assert_data(&p, 1);
    answered.ack(tid, 1).await;
    assert_data(&answered.expect("DATA 2").await.0, 2);
    let old = Raw::new_on("127.0.0.3:0").await;
    old.rrq(t.addr, "f", &[]).await;
    assert_data(&old.expect("DATA 1").await.0, 1);
    let young = Raw::new_on("127.0.0.4:0").await;
    young.rrq(t.addr, "f", &[("blksize", "1024")]).await;
    let (p, young_tid) = young.expect("OACK").await;
    oack_options(&p);
    // Half-open transfers are spared for 4 × the answer time clients have shown (a few
    // ms here, 10 ms at least): the oldest is past that after 150 ms, not past its 1 s
    // timeout.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = Raw::new_on("127.0.0.5:0").await;
    new.rrq(t.addr, "f", &[]).await;
    let (p, tid) = new.expect("DATA 1 for the newcomer").await;
    assert_data(&p, 1);
    let (p, _) = old.expect("busy for the oldest half-open").await;
    assert_error(&p, 0);
    assert_eq!(t.stats.evicted.get(), 1);
    // Once the newcomer has answered, nobody half-open is left to end.
    new.ack(tid, 1).await;
    assert_data(&new.expect("DATA 2").await.0, 2);
    young.ack(young_tid, 0).await;
    let p = loop {
        let (p, _) = young.expect("DATA 1 after the OACK").await;
        // Skip a resent OACK.
        if opcode(&p) != 6 {
            break p;
        }
    };
    assert_data(&p, 1);
    // Full of answered transfers: no answer, left for the client's retransmission.
    let late = Raw::new_on("127.0.0.6:0").await;
    late.rrq(t.addr, "f", &[]).await;
    assert!(late.recv(Duration::from_millis(300)).await.is_none());
    assert_eq!(t.stats.busy.get(), 1);
    assert_eq!(t.stats.evicted.get(), 1);
}

/// Opens the FIFO for writing without waiting, which releases a reader blocked in
/// `open` (today's bug) so the test runtime can shut down after a failure.
struct FifoRelease(PathBuf);

impl Drop for FifoRelease {
    fn drop(&mut self) {
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.0);
    }
}

/// Issue 10, finding 8: a FIFO in the served tree is refused at once, and neither
/// holds a slot nor blocks shutdown; only regular files inside the root are served
/// (a symlink is followed while it stays inside the root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_regular_files_inside_the_root_are_served() {
    let mut t = Tftp::start(settings(3, 8)).await;
    let data = t.random_file("real", 3000);
    let fifo = t.path("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let _release = FifoRelease(fifo);
    std::fs::create_dir(t.path("dir")).unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"no").unwrap();
    let link = |to: &Path, name: &str| std::os::unix::fs::symlink(to, t.path(name)).unwrap();
    link(Path::new("fifo"), "to-fifo");
    link(Path::new("/dev/zero"), "to-dev");
    link(&outside.path().join("secret"), "to-outside");
    link(outside.path(), "outdir");
    link(Path::new("real"), "to-real");
    link(Path::new("dir/../real"), "to-real-dotdot");
    let c = Raw::new().await;
    let cases: &[(&str, u16)] = &[
        ("fifo", 2),
        ("to-fifo", 2),
        ("dir", 2),
        ("to-dev", 2),
        ("to-outside", 2),
        ("outdir/secret", 2),
    ];
    for (name, code) in cases {
        let started = Instant::now();
        c.rrq(t.addr, name, &[]).await;
        let (p, _) = c
            .recv(Duration::from_millis(500))
            .await
            .unwrap_or_else(|| panic!("{name}: no answer within 500 ms"));
        assert_error(&p, *code);
        assert!(started.elapsed() < Duration::from_millis(500), "{name}");
    }
    t.idle().await;
    assert_eq!(t.stats.not_regular.get(), 3);
    assert_eq!(t.stats.refused.get(), cases.len() as u64);
    // Symlinks that stay inside the root are served.
    let out = tempfile::tempdir().unwrap();
    for name in ["to-real", "to-real-dotdot"] {
        let got = out.path().join(name);
        tftp_hpa(t.port(), "binary", name, &got).await;
        same(&got, &data, name);
    }
    // A request for the FIFO in flight does not hold up shutdown.
    c.rrq(t.addr, "fifo", &[]).await;
    t.cancel.cancel();
    timeout(Duration::from_secs(1), t.task.take().unwrap())
        .await
        .expect("serve did not return within 1 s")
        .unwrap()
        .unwrap();
    assert!(t.metrics().contains("pxed_tftp_not_regular_total "));
}
