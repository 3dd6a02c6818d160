//! DHCP offer pacing against a real TFTP transfer: with one first-stage slot and a
//! TFTP client holding it (it acknowledged DATA 1, then went silent), a PXE
//! DISCOVER's OFFER waits until the transfer ends, while a plain DISCOVER is answered
//! at once. DHCP runs in a network namespace (needs root), TFTP on loopback; both
//! in-process, sharing one `Slots`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dhcproto::v4::{Message, MessageType};
use pxed::config::{DhcpMode, TftpSettings};
use pxed::dhcp::{self, DhcpContext, DhcpStats};
use pxed::metrics::Render;
use pxed::pacing::Slots;
use pxed::store::Store;
use pxed::tftp::TftpStats;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::common::until;
use super::dhcp::{DEADLINE, FULL_POOL, Peer, load_config, pxe, request};
use super::netns::Lan;

/// The next reply for `xid` within `within`, if any (replies for other xids are
/// skipped).
async fn reply(peer: &Peer, xid: u32, within: Duration) -> Option<Message> {
    peer.recv_within(xid, within).await.map(|(m, _, _)| m)
}

fn metric(slots: &Slots, name: &str) -> u64 {
    let mut out = String::new();
    slots.render(&mut out);
    out.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pxe_offer_waits_for_the_first_stage_slot_a_plain_one_does_not() {
    let slots = Slots::new();

    // TFTP on loopback, its transfers counted as first-stage slots. A silent client
    // is given up after timeout × (retries + 1) = 2 s.
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("snponly.efi"), vec![7u8; 64 << 10]).unwrap();
    let tftp_sock = pxed::net::bind_udp("127.0.0.1:0".parse().unwrap(), None, false).unwrap();
    let tftp_addr = tftp_sock.local_addr().unwrap();
    let tftp_stats = Arc::new(TftpStats::default());
    tftp_stats.slots.set(slots.clone()).unwrap();
    let cancel = CancellationToken::new();
    let tftp = tokio::spawn(pxed::tftp::serve(
        tftp_sock,
        root.path().to_path_buf(),
        TftpSettings {
            max_transfers: 16,
            timeout: Duration::from_secs(1),
            retries: 1,
        },
        tftp_stats.clone(),
        cancel.clone(),
    ));

    // DHCP in the server netns with one first-stage slot; offers wait at most 10 s,
    // far longer than the transfer lasts.
    let lan = Lan::new("pacing", "10.77.0.1/24", 1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = load_config(
        dir.path(),
        DhcpMode::Full,
        Some(FULL_POOL),
        "[pacing]\nmax_first_stage = 1\noffer_delay_max_ms = 10000\n",
    );
    assert_eq!(cfg.pacing.max_first_stage, 1);
    let (stats, _seen, server) = dhcp_server(&lan, &cfg, &slots, &cancel).await;
    let peer = Peer::bind(&lan.clients[0], "0.0.0.0:68").await;

    // Start a transfer, acknowledge DATA 1 (the client has answered: the transfer is
    // no longer half-open), then go silent.
    let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    client
        .send_to(b"\x00\x01snponly.efi\x00octet\x00", tftp_addr)
        .await
        .unwrap();
    let mut buf = vec![0u8; 1024];
    let (n, tid): (usize, SocketAddr) = tokio::time::timeout(DEADLINE, client.recv_from(&mut buf))
        .await
        .expect("DATA 1")
        .unwrap();
    assert_eq!(
        &buf[..4],
        b"\x00\x03\x00\x01",
        "DATA 1, got {:?}",
        &buf[..n]
    );
    client.send_to(b"\x00\x04\x00\x01", tid).await.unwrap();
    until("the transfer to take the slot", DEADLINE, async || {
        (slots.in_use().first_stage == 1).then_some(())
    })
    .await;
    assert_eq!(metric(&slots, "pxed_first_stage_in_flight"), 1);

    // A PXE DISCOVER is held; a plain one is answered at once.
    let sent = Instant::now();
    let pxe_mac = [0x52, 0x54, 0, 0xbb, 0, 1];
    peer.send(
        &pxe(request(MessageType::Discover, pxe_mac, 0x100), 7),
        "255.255.255.255:67",
    )
    .await;
    peer.send(
        &request(MessageType::Discover, [0x52, 0x54, 0, 0xbb, 0, 2], 0x200),
        "255.255.255.255:67",
    )
    .await;
    let plain = reply(&peer, 0x200, Duration::from_secs(2))
        .await
        .expect("the plain DISCOVER answered at once");
    assert_eq!(plain.opts().msg_type(), Some(MessageType::Offer));
    assert!(
        sent.elapsed() < Duration::from_millis(900),
        "{:?}",
        sent.elapsed()
    );
    until("the PXE offer to be held", DEADLINE, async || {
        (metric(&slots, "pxed_dhcp_offers_held_now") == 1).then_some(())
    })
    .await;
    assert_eq!(metric(&slots, "pxed_dhcp_offers_held_total"), 1);

    // The firmware retries with a new xid: no second held offer; the held one
    // answers the retry.
    peer.send(
        &pxe(request(MessageType::Discover, pxe_mac, 0x101), 7),
        "255.255.255.255:67",
    )
    .await;
    until("the retry to be seen", DEADLINE, async || {
        (metric(&slots, "pxed_dhcp_offers_held_duplicates_total") == 1).then_some(())
    })
    .await;
    assert_eq!(metric(&slots, "pxed_dhcp_offers_held_total"), 1);
    assert_eq!(metric(&slots, "pxed_dhcp_offers_held_now"), 1);
    assert_eq!(stats.offers.get(), 1, "only the plain offer went out");

    // The transfer times out (~2 s after its last ACK): the slot frees, the offer goes.
    let held = reply(&peer, 0x101, Duration::from_secs(8))
        .await
        .expect("the held offer, once the slot freed");
    let waited = sent.elapsed();
    assert_eq!(held.opts().msg_type(), Some(MessageType::Offer));
    assert_eq!(
        held.fname().map(|f| String::from_utf8_lossy(f)
            .trim_end_matches('\0')
            .to_string()),
        Some("snponly.efi".into())
    );
    assert_eq!(slots.in_use().first_stage, 0, "sent before the slot freed");
    assert!(tftp_stats.failed.get() >= 1, "the silent transfer ended");
    assert!(
        waited >= Duration::from_millis(1000) && waited < Duration::from_secs(8),
        "{waited:?}"
    );
    until("the held gauge to fall", DEADLINE, async || {
        (metric(&slots, "pxed_dhcp_offers_held_now") == 0).then_some(())
    })
    .await;
    assert!(metric(&slots, "pxed_dhcp_offers_held_ms_total") >= 1000);
    assert_eq!(metric(&slots, "pxed_dhcp_offers_held_total"), 1);
    assert_eq!(
        metric(&slots, "pxed_dhcp_offers_held_expired_total"),
        0,
        "it went for the freed slot"
    );
    // Counted once `send_to` returned, which can be after the datagram arrived.
    until("the held offer to be counted", DEADLINE, async || {
        (stats.offers.get() == 2).then_some(())
    })
    .await;
    // No second copy of the held offer comes (its first xid gets nothing).
    assert!(
        reply(&peer, 0x100, Duration::from_millis(300))
            .await
            .is_none()
    );

    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("DHCP shutdown within 2 s")
        .unwrap()
        .expect("DHCP server");
    tokio::time::timeout(Duration::from_secs(2), tftp)
        .await
        .expect("TFTP shutdown within 2 s")
        .unwrap()
        .expect("TFTP server");
}

/// An HTTP GET under `/images/` holds a stream slot for as long as its body is being
/// sent, not just while the handler runs: while a client reads slowly the slot is
/// taken, and it is given back when the client goes away mid-file. `/ipxe/` GETs
/// count as first-stage; HEAD and refused paths count nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_file_holds_its_slot_until_the_body_is_gone() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dir = tempfile::tempdir().unwrap();
    let flags = pxed::config::Flags {
        data_dir: Some(dir.path().join("data")),
        ..Default::default()
    };
    let mut cfg = pxed::config::load(None, Vec::<(String, String)>::new(), &flags).unwrap();
    cfg.images_dir = dir.path().join("images");
    cfg.ipxe_dir = dir.path().join("ipxe");
    std::fs::create_dir_all(&cfg.images_dir).unwrap();
    std::fs::create_dir_all(&cfg.ipxe_dir).unwrap();
    // Far more than the socket buffers hold: a client that stops reading leaves the
    // body half sent.
    std::fs::write(cfg.images_dir.join("initrd"), vec![1u8; 64 << 20]).unwrap();
    const IPXE_LEN: usize = 32 << 20;
    std::fs::write(cfg.ipxe_dir.join("snponly.efi"), vec![2u8; IPXE_LEN]).unwrap();
    let store = Store::open(&cfg.data_dir).await.unwrap();
    let bmcs = Arc::new(pxed::lifecycle::worker::StoreBmcs::new(
        cfg.bmc.call_policy(),
    ));
    let cancel = CancellationToken::new();
    let st = pxed::state::AppState::new(Arc::new(cfg), store, bmcs, "t".into(), cancel.clone());
    let slots = st.slots.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(pxed::http::serve(listener, st, cancel.clone()));

    let get = async |method: &str, path: &str| {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(format!("{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut head = [0u8; 512];
        let n = c.read(&mut head).await.unwrap();
        let head = String::from_utf8_lossy(&head[..n]).to_string();
        (c, head)
    };

    // A slow reader of an initrd: one stream slot, held while it does not read.
    let (slow, head) = get("GET", "/images/initrd").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-length: 67108864"), "{head}");
    until("the stream slot to be taken", DEADLINE, async || {
        (slots.in_use().streams == 1).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(slots.in_use().streams, 1, "the slot went with the handler");
    assert_eq!(metric(&slots, "pxed_streams_in_flight"), 1);

    // The iPXE binary: a first-stage slot while it is sent, given back once the
    // last byte went out although the connection stays open (keep-alive).
    let (mut c, head) = get("GET", "/ipxe/snponly.efi").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    until("the first-stage slot to be taken", DEADLINE, async || {
        (slots.in_use().first_stage == 1).then_some(())
    })
    .await;
    let mut got = head.len() - head.find("\r\n\r\n").unwrap() - 4;
    let mut buf = vec![0u8; 1 << 20];
    while got < IPXE_LEN {
        got += c.read(&mut buf).await.unwrap();
    }
    until(
        "the first-stage slot to be given back",
        DEADLINE,
        async || (slots.in_use().first_stage == 0).then_some(()),
    )
    .await;
    assert_eq!(metric(&slots, "pxed_first_stage_in_flight"), 0);
    // HEAD and a missing file take no slot.
    let (_h, head) = get("HEAD", "/images/initrd").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (_m, head) = get("GET", "/images/nope").await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert_eq!(slots.in_use().streams, 1);
    assert_eq!(slots.in_use().first_stage, 0);

    // The slow client goes away mid-file: the body is dropped, the slot given back.
    drop(slow);
    until("the stream slot to be given back", DEADLINE, async || {
        (slots.in_use().streams == 0).then_some(())
    })
    .await;

    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
}

/// With the first-stage slot still taken, a held offer goes when `offer_delay_max_ms`
/// passes; meanwhile iPXE (stream slots free) and the client's REQUEST are answered
/// at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_offer_goes_at_the_delay_max_and_requests_are_never_held() {
    use dhcproto::v4::DhcpOption;

    let slots = Slots::new();
    let lan = Lan::new("pacmax", "10.77.0.1/24", 1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = load_config(
        dir.path(),
        DhcpMode::Full,
        Some(FULL_POOL),
        "[pacing]\nmax_first_stage = 1\nmax_streams = 1\noffer_delay_max_ms = 1000\n",
    );
    let cancel = CancellationToken::new();
    let (_stats, _seen, server) = dhcp_server(&lan, &cfg, &slots, &cancel).await;
    let peer = Peer::bind(&lan.clients[0], "0.0.0.0:68").await;

    // The one first-stage slot stays taken for the whole test (the counter TFTP and
    // HTTP take theirs from).
    let _transfer = slots.acquire(pxed::pacing::Slot::FirstStage);

    let mac = [0x52, 0x54, 0, 0xdd, 0, 1];
    let sent = Instant::now();
    peer.send(
        &pxe(request(MessageType::Discover, mac, 0x300), 7),
        "255.255.255.255:67",
    )
    .await;
    // iPXE asking at the same time: its kind (streams) is free, so no wait.
    let mut ipxe = pxe(
        request(MessageType::Discover, [0x52, 0x54, 0, 0xdd, 0, 2], 0x400),
        7,
    );
    ipxe.opts_mut()
        .insert(DhcpOption::UserClass(b"iPXE".to_vec()));
    peer.send(&ipxe, "255.255.255.255:67").await;
    let m = reply(&peer, 0x400, Duration::from_secs(2))
        .await
        .expect("iPXE answered at once");
    assert!(
        sent.elapsed() < Duration::from_millis(900),
        "{:?}",
        sent.elapsed()
    );
    assert!(
        m.fname()
            .is_some_and(|f| String::from_utf8_lossy(f).contains(".ipxe")),
        "{m:?}"
    );

    let offer = reply(&peer, 0x300, Duration::from_secs(5))
        .await
        .expect("the held offer at the delay max");
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(950) && waited < Duration::from_millis(3000),
        "{waited:?}"
    );
    assert_eq!(slots.in_use().first_stage, 1, "the slot is still taken");
    assert_eq!(metric(&slots, "pxed_dhcp_offers_held_total"), 1);
    assert_eq!(
        metric(&slots, "pxed_dhcp_offers_held_expired_total"),
        1,
        "it went because the hold ran out, not for a slot"
    );

    // Its REQUEST is answered at once although the slot is still taken.
    let mut r = pxe(request(MessageType::Request, mac, 0x301), 7);
    r.opts_mut()
        .insert(DhcpOption::ServerIdentifier("10.77.0.1".parse().unwrap()));
    r.opts_mut()
        .insert(DhcpOption::RequestedIpAddress(offer.yiaddr()));
    let asked = Instant::now();
    peer.send(&r, "255.255.255.255:67").await;
    let ack = reply(&peer, 0x301, Duration::from_secs(2))
        .await
        .expect("the REQUEST answered");
    assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
    assert!(
        asked.elapsed() < Duration::from_millis(900),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(metric(&slots, "pxed_dhcp_offers_held_total"), 1);

    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("DHCP shutdown within 2 s")
        .unwrap()
        .expect("DHCP server");
}

/// Runs the DHCP server in `lan`'s server netns, counting `slots`; returns its stats,
/// the sightings' receiver (kept by the caller while the server runs) and its task.
async fn dhcp_server(
    lan: &Lan,
    cfg: &pxed::config::Config,
    slots: &Arc<Slots>,
    cancel: &CancellationToken,
) -> (
    Arc<DhcpStats>,
    mpsc::Receiver<pxed::dhcp::DhcpSeen>,
    tokio::task::JoinHandle<Result<(), pxed::dhcp::DhcpError>>,
) {
    let h = tokio::runtime::Handle::current();
    let c = cfg.clone();
    let sockets = lan
        .server
        .enter(move || {
            let _g = h.enter();
            dhcp::bind(&c)
        })
        .unwrap();
    let store = Store::open(&cfg.data_dir).await.unwrap();
    let stats = Arc::new(DhcpStats::default());
    let (tx, seen) = mpsc::channel(64);
    let ctx = DhcpContext::new(cfg, store, tx, stats.clone()).with_slots(slots.clone());
    let server = tokio::spawn(dhcp::serve(sockets, ctx, cancel.clone()));
    (stats, seen, server)
}
