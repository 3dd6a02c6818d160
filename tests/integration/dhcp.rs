//! DHCP against real clients (busybox udhcpc, ISC dhclient, dhcpcd) and raw-packet
//! peers, in network namespaces. Needs root and those clients.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use pxed::config::{self, Config, DhcpMode, Flags as CfgFlags};
use pxed::dhcp::{self, DhcpContext, DhcpError, DhcpSeen, DhcpStats};
use pxed::store::{Store, leases};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::common::until;
use super::netns::{Lan, Netns};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/udhcpc-env.sh");
pub(super) const DEADLINE: Duration = Duration::from_secs(30);

pub(super) fn load_config(dir: &Path, mode: DhcpMode, pool: Option<&str>, toml: &str) -> Config {
    let file = dir.join("pxed.toml");
    std::fs::write(&file, toml).unwrap();
    let flags = CfgFlags {
        interfaces: vec!["br0".into()],
        dhcp: config::DhcpFlags {
            mode: Some(mode),
            pool: pool.map(Into::into),
            ..Default::default()
        },
        data_dir: Some(dir.join("data")),
        http: Some("10.77.0.1:80".parse().unwrap()),
        ..Default::default()
    };
    config::load(Some(&file), Vec::<(String, String)>::new(), &flags).unwrap()
}

/// pxed's DHCP server running in-process, its sockets opened inside the server netns.
struct Server {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), DhcpError>>,
    stats: Arc<DhcpStats>,
    store: Store,
    seen: mpsc::Receiver<DhcpSeen>,
}

impl Server {
    async fn start(lan: &Lan, cfg: &Config) -> Server {
        let h = tokio::runtime::Handle::current();
        let c = cfg.clone();
        let sockets = lan
            .server
            .enter(move || {
                let _g = h.enter();
                dhcp::bind(&c)
            })
            .expect("binding DHCP in the server netns");
        let store = Store::open(&cfg.data_dir).await.unwrap();
        let stats = Arc::new(DhcpStats::default());
        let (tx, seen) = mpsc::channel(4096);
        let ctx = DhcpContext::new(cfg, store.clone(), tx, stats.clone());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(dhcp::serve(sockets, ctx, cancel.clone()));
        Server {
            cancel,
            task,
            stats,
            store,
            seen,
        }
    }

    async fn stop(self) -> Store {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), self.task)
            .await
            .expect("DHCP shutdown within 2 s")
            .unwrap()
            .unwrap();
        self.store
    }

    async fn lease_of(&self, mac: &str) -> Option<leases::LeaseRow> {
        self.store
            .load_leases(0)
            .await
            .unwrap()
            .into_iter()
            .find(|l| l.mac == mac)
    }
}

/// Runs `busybox udhcpc` once in `ns`; returns the environment of its `bound` event.
pub(super) async fn udhcpc(ns: &Netns, extra: &[&str]) -> HashMap<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("env");
    let mut cmd = ns.command("env");
    cmd.arg(format!("UDHCPC_OUT={}", out.display()))
        .args([
            "busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "5", "-T", "1", "-s", SCRIPT,
        ])
        .args(extra);
    let o = tokio::time::timeout(DEADLINE, cmd.output())
        .await
        .expect("udhcpc timed out")
        .expect("busybox udhcpc must be installed");
    assert!(
        o.status.success(),
        "udhcpc {extra:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::read_to_string(&out)
        .expect("udhcpc ran its script")
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn in_pool(ip: &str, lo: u8, hi: u8) -> bool {
    let ip: Ipv4Addr = ip.parse().unwrap();
    let o = ip.octets();
    o[..3] == [10, 77, 0] && (lo..=hi).contains(&o[3])
}

/// A raw DHCP peer: a UDP socket inside a client netns.
pub(super) struct Peer {
    pub(super) sock: UdpSocket,
}

impl Peer {
    pub(super) async fn bind(ns: &Netns, addr: &str) -> Peer {
        let h = tokio::runtime::Handle::current();
        let addr: SocketAddr = addr.parse().unwrap();
        let sock = ns.enter(move || {
            let _g = h.enter();
            pxed::net::bind_udp(addr, Some("eth0"), true).unwrap()
        });
        Peer { sock }
    }

    pub(super) async fn send(&self, m: &Message, to: &str) {
        let mut b = Vec::new();
        m.encode(&mut Encoder::new(&mut b)).unwrap();
        self.sock.send_to(&b, to).await.unwrap();
    }

    /// The next reply for `xid` (others are skipped); panics at the deadline.
    async fn recv(&self, xid: u32) -> (Message, SocketAddr, Vec<u8>) {
        self.recv_within(xid, DEADLINE)
            .await
            .expect("no reply from pxed")
    }

    /// The next reply for `xid` within `within`, if any (others are skipped).
    pub(super) async fn recv_within(
        &self,
        xid: u32,
        within: std::time::Duration,
    ) -> Option<(Message, SocketAddr, Vec<u8>)> {
        let mut buf = vec![0u8; 2048];
        tokio::time::timeout(within, async {
            loop {
                let (n, from) = self.sock.recv_from(&mut buf).await.unwrap();
                if let Ok(m) = Message::decode(&mut Decoder::new(&buf[..n]))
                    && m.xid() == xid
                    && m.opcode() == Opcode::BootReply
                {
                    return (m, from, buf[..n].to_vec());
                }
            }
        })
        .await
        .ok()
    }
}

pub(super) fn request(t: MessageType, mac: [u8; 6], xid: u32) -> Message {
    let mut m = Message::new_with_id(
        xid,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &mac,
    );
    m.set_flags(Flags::default().set_broadcast());
    m.opts_mut().insert(DhcpOption::MessageType(t));
    m
}

pub(super) fn pxe(mut m: Message, arch: u16) -> Message {
    let o = m.opts_mut();
    o.insert(DhcpOption::ClientSystemArchitecture(arch.into()));
    o.insert(DhcpOption::ClassIdentifier(
        format!("PXEClient:Arch:{arch:05}:UNDI:003016").into_bytes(),
    ));
    m
}

fn opt(m: &Message, c: OptionCode) -> Option<&DhcpOption> {
    m.opts().get(c)
}

pub(super) const FULL_POOL: &str = "10.77.0.100-10.77.0.150";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_get_leases_that_are_stored() {
    let lan = Lan::new("dhcpcl", "10.77.0.1/24", 3);
    let dir = tempfile::tempdir().unwrap();
    let cfg = load_config(dir.path(), DhcpMode::Full, Some(FULL_POOL), "");
    let mut srv = Server::start(&lan, &cfg).await;

    // busybox udhcpc
    let env = udhcpc(&lan.clients[0], &[]).await;
    assert!(in_pool(&env["ip"], 100, 150), "{env:?}");
    assert_eq!(env["serverid"], "10.77.0.1");
    assert!(
        !env.contains_key("boot_file"),
        "a plain client gets no boot file"
    );
    let mac0 = lan.clients[0].mac("eth0");
    let l = srv.lease_of(&mac0).await.expect("udhcpc lease stored");
    assert_eq!(l.ip.to_string(), env["ip"]);
    // Only netboot clients are reported for discovery: a plain client is not inventory.
    assert!(
        srv.seen.try_recv().is_err(),
        "plain client reported for discovery"
    );

    // ISC dhclient: backgrounds itself once bound (or fails after -1's single try).
    let rd = tempfile::tempdir().unwrap();
    let pidf = rd.path().join("dhclient.pid");
    let leasef = rd.path().join("dhclient.leases");
    let st = lan.clients[1]
        .command("dhclient")
        .args(["-4", "-1", "-sf", "/bin/true", "-pf"])
        .arg(&pidf)
        .arg("-lf")
        .arg(&leasef)
        .arg("eth0")
        .status()
        .await
        .expect("isc dhclient must be installed");
    assert!(st.success(), "dhclient got no lease");
    let _ = lan.clients[1]
        .command("dhclient")
        .args(["-x", "-pf"])
        .arg(&pidf)
        .status()
        .await;
    let mac1 = lan.clients[1].mac("eth0");
    let l1 = srv.lease_of(&mac1).await.expect("dhclient lease stored");
    assert!(in_pool(&l1.ip.to_string(), 100, 150));
    let text = std::fs::read_to_string(&leasef).unwrap();
    assert!(
        text.contains(&format!("fixed-address {};", l1.ip)),
        "{text}"
    );

    // dhcpcd, one shot, no background.
    let o = lan.clients[2]
        .command("dhcpcd")
        .args([
            "-4",
            "-1",
            "-B",
            "--noipv4ll",
            "-t",
            "20",
            "-c",
            "/bin/true",
            "eth0",
        ])
        .output()
        .await
        .expect("dhcpcd must be installed");
    assert!(
        o.status.success(),
        "dhcpcd: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mac2 = lan.clients[2].mac("eth0");
    let l2 = srv.lease_of(&mac2).await.expect("dhcpcd lease stored");
    assert!(in_pool(&l2.ip.to_string(), 100, 150));
    let _ = lan.clients[2]
        .command("dhcpcd")
        .args(["-k", "eth0"])
        .status()
        .await;

    let ips = [l.ip, l1.ip, l2.ip];
    assert!(
        ips[0] != ips[1] && ips[1] != ips[2] && ips[0] != ips[2],
        "{ips:?}"
    );
    assert!(srv.stats.acks.get() >= 3);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_survive_a_restart_of_the_binary() {
    let lan = Lan::new("dhcprs", "10.77.0.1/24", 1);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let start = || {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("pxed.log"))
            .unwrap();
        lan.server
            .command(env!("CARGO_BIN_EXE_pxed"))
            .args([
                "serve",
                "--dhcp",
                "full",
                "--interface",
                "br0",
                "--pool",
                FULL_POOL,
            ])
            .args([
                "--http",
                "10.77.0.1:80",
                "--tftp",
                "10.77.0.1:69",
                "--data-dir",
            ])
            .arg(&data)
            .arg("--ipxe-dir")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/ipxe/bin"))
            .env("PXED_LOG", "info")
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let stop = |child: &tokio::process::Child| {
        let pid = child.id().expect("pxed running") as i32;
        // SAFETY: signalling our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    };
    let mut child = start();
    // An arm64 UEFI PXE client nobody registered.
    let env = udhcpc(
        &lan.clients[0],
        &["-x", "0x5d:000b", "-V", "PXEClient:Arch:00011:UNDI:003016"],
    )
    .await;
    let ip = env["ip"].clone();
    assert!(in_pool(&ip, 100, 150));
    stop(&child);
    let st = tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .expect("pxed exits on SIGTERM")
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("pxed.log")).unwrap_or_default();
    assert!(st.success(), "{st:?}: {log}");

    let store = Store::open(&data).await.unwrap();
    let mac = lan.clients[0].mac("eth0");
    let rows = store.load_leases(0).await.unwrap();
    assert!(
        rows.iter().any(|r| r.mac == mac && r.ip.to_string() == ip),
        "{rows:?}"
    );
    // Discovery: the unknown MAC is a `discovered` node with the arch it sent.
    let node = store
        .node_by_mac(mac.parse().unwrap())
        .await
        .unwrap()
        .expect("discovered node");
    assert_eq!(
        (node.state.as_str(), node.arch.as_str()),
        ("discovered", "arm64")
    );
    let events = store.events(node.id).await.unwrap();
    assert_eq!(events[0].actor, "discovery");
    store.close().await;

    // A fresh DISCOVER after the restart is offered the stored lease.
    let mut child = start();
    let env = udhcpc(&lan.clients[0], &[]).await;
    assert_eq!(env["ip"], ip);
    stop(&child);
    child.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_files_follow_the_table_over_the_wire() {
    let lan = Lan::new("dhcpbt", "10.77.0.1/24", 1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = load_config(dir.path(), DhcpMode::Full, Some(FULL_POOL), "");
    let srv = Server::start(&lan, &cfg).await;
    let ns = &lan.clients[0];
    let mac = ns.mac("eth0");
    let pxe = |arch: u16| {
        vec![
            "-x".to_string(),
            format!("0x5d:{arch:04x}"),
            "-V".to_string(),
            format!("PXEClient:Arch:{arch:05}:UNDI:003016"),
        ]
    };
    let http16 = vec![
        "-x".to_string(),
        "0x5d:0010".to_string(),
        "-V".to_string(),
        "HTTPClient:Arch:00016:UNDI:003001".to_string(),
    ];
    let mut ipxe_uc = pxe(7);
    ipxe_uc.extend(["-x".into(), "0x4d:69505845".into()]);
    let mut ipxe_175 = pxe(0);
    ipxe_175.extend(["-x".into(), "0xaf:150101".into()]);
    let script = format!("http://10.77.0.1/boot/{mac}.ipxe");
    let cases: Vec<(&str, Vec<String>, String)> = vec![
        ("BIOS", pxe(0), "undionly.kpxe".into()),
        ("x64 UEFI", pxe(7), "snponly.efi".into()),
        ("EFI BC", pxe(9), "snponly.efi".into()),
        ("arm64 UEFI", pxe(11), "ipxe-arm64.efi".into()),
        (
            "HTTP boot x64",
            http16,
            "http://10.77.0.1/ipxe/snponly.efi".into(),
        ),
        ("iPXE user class", ipxe_uc, script.clone()),
        ("iPXE option 175", ipxe_175, script),
    ];
    for (name, args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env = udhcpc(ns, &args).await;
        assert_eq!(env.get("boot_file"), Some(&want), "{name}: {env:?}");
        assert_eq!(
            env.get("siaddr").map(String::as_str),
            Some("10.77.0.1"),
            "{name}"
        );
    }
    // An architecture with no boot file still gets an address, and is counted.
    let args = pxe(10);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env = udhcpc(ns, &args).await;
    assert!(in_pool(&env["ip"], 100, 150));
    assert!(!env.contains_key("boot_file"));
    assert!(srv.stats.unknown_arch(Some(10)) >= 1);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_gives_boot_info_and_no_address() {
    let lan = Lan::new("dhcppx", "10.77.0.1/24", 1);
    let ns = &lan.clients[0];
    ns.ip(&["addr", "add", "10.77.0.50/24", "dev", "eth0"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = load_config(dir.path(), DhcpMode::Proxy, None, "");
    let srv = Server::start(&lan, &cfg).await;
    let peer = Peer::bind(ns, "0.0.0.0:68").await;
    let mac = [0x52, 0x54, 0, 0xaa, 0, 1];

    // A non-PXE client is ignored.
    peer.send(
        &request(MessageType::Discover, mac, 1),
        "255.255.255.255:67",
    )
    .await;
    until("the plain DISCOVER to be ignored", DEADLINE, async || {
        (srv.stats.ignored.get() >= 1).then_some(())
    })
    .await;
    assert_eq!(srv.stats.offers.get(), 0);

    let mut d = pxe(request(MessageType::Discover, mac, 2), 7);
    d.opts_mut()
        .insert(DhcpOption::ClientMachineIdentifier(vec![0; 17]));
    peer.send(&d, "255.255.255.255:67").await;
    let (m, from, _) = peer.recv(2).await;
    assert_eq!(from.ip(), "10.77.0.1".parse::<std::net::IpAddr>().unwrap());
    assert_eq!(m.opts().msg_type(), Some(MessageType::Offer));
    assert_eq!(m.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(m.siaddr(), Ipv4Addr::new(10, 77, 0, 1));
    assert_eq!(fname(&m), "snponly.efi");
    assert!(opt(&m, OptionCode::AddressLeaseTime).is_none());
    assert!(opt(&m, OptionCode::SubnetMask).is_none());
    assert_eq!(
        opt(&m, OptionCode::ClassIdentifier),
        Some(&DhcpOption::ClassIdentifier(b"PXEClient".to_vec()))
    );
    assert_eq!(
        opt(&m, OptionCode::VendorExtensions),
        Some(&DhcpOption::VendorExtensions(vec![6, 1, 8, 255]))
    );
    assert!(opt(&m, OptionCode::ClientMachineIdentifier).is_some());

    // Port 4011: a unicast REQUEST from the client's address, answered to its port.
    let boot = Peer::bind(ns, "10.77.0.50:4011").await;
    let mut r = pxe(request(MessageType::Request, mac, 3), 11);
    r.set_ciaddr(Ipv4Addr::new(10, 77, 0, 50));
    r.set_flags(Flags::default());
    boot.send(&r, "10.77.0.1:4011").await;
    let (m, _, _) = boot.recv(3).await;
    assert_eq!(m.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(m.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(fname(&m), "ipxe-arm64.efi");
    assert!(srv.store.load_leases(0).await.unwrap().is_empty());

    // The site server's DORA, overheard: the broadcast REQUEST names the address the
    // node will have (option 50), which proxy mode binds its boot token to.
    let mut r = pxe(request(MessageType::Request, mac, 4), 7);
    r.opts_mut()
        .insert(DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 77, 0, 51)));
    r.opts_mut()
        .insert(DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 77, 0, 254)));
    peer.send(&r, "255.255.255.255:67").await;
    let mut srv = srv;
    let mut addresses = Vec::new();
    until("the REQUEST to be seen", DEADLINE, async || {
        while let Ok(s) = srv.seen.try_recv() {
            addresses.push(s.address);
        }
        addresses
            .contains(&Some(Ipv4Addr::new(10, 77, 0, 51)))
            .then_some(())
    })
    .await;
    // The DISCOVER asked for nothing; the 4011 REQUEST came from 10.77.0.50 (ciaddr).
    assert_eq!(
        addresses,
        vec![
            None,
            Some(Ipv4Addr::new(10, 77, 0, 50)),
            Some(Ipv4Addr::new(10, 77, 0, 51))
        ]
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_requests_are_answered_to_the_relay() {
    let lan = Lan::new("dhcprl", "10.77.0.1/24", 1);
    let relay = &lan.clients[0];
    // The relay: 10.77.0.2 on the server's LAN, 10.78.0.1 on the client subnet it serves.
    relay.ip(&["addr", "add", "10.77.0.2/24", "dev", "eth0"]);
    relay.ip(&["addr", "add", "10.78.0.1/32", "dev", "lo"]);
    lan.server
        .ip(&["route", "add", "10.78.0.0/24", "via", "10.77.0.2"]);
    let dir = tempfile::tempdir().unwrap();
    let toml = "[[dhcp.relay_subnets]]\npool = \"10.78.0.10-10.78.0.50\"\nnetmask = \"255.255.255.0\"\nrouter = \"10.78.0.1\"\n";
    let cfg = load_config(dir.path(), DhcpMode::Full, Some(FULL_POOL), toml);
    let srv = Server::start(&lan, &cfg).await;
    let h = tokio::runtime::Handle::current();
    let sock = relay.enter(move || {
        let _g = h.enter();
        pxed::net::bind_udp("0.0.0.0:67".parse().unwrap(), None, true).unwrap()
    });
    let peer = Peer { sock };
    let mac = [0x52, 0x54, 0, 0xbb, 0, 1];
    let agent_info = [82u8, 8, 1, 2, 0xab, 0xcd, 2, 2, 0x12, 0x34];
    let mut d = request(MessageType::Discover, mac, 7);
    d.set_giaddr(Ipv4Addr::new(10, 78, 0, 1)).set_hops(1);
    let mut bytes = Vec::new();
    d.encode(&mut Encoder::new(&mut bytes)).unwrap();
    // Option 82 goes last, before the end option, as relays append it.
    assert_eq!(bytes.pop(), Some(255));
    bytes.extend_from_slice(&agent_info);
    bytes.push(255);
    peer.sock.send_to(&bytes, "10.77.0.1:67").await.unwrap();
    let (m, from, raw) = peer.recv(7).await;
    assert_eq!(from, "10.77.0.1:67".parse().unwrap());
    assert_eq!(m.opts().msg_type(), Some(MessageType::Offer));
    assert_eq!(m.giaddr(), Ipv4Addr::new(10, 78, 0, 1));
    let o = m.yiaddr().octets();
    assert!(o[..3] == [10, 78, 0] && (10..=50).contains(&o[3]), "{m:?}");
    assert_eq!(
        opt(&m, OptionCode::Router),
        Some(&DhcpOption::Router(vec![Ipv4Addr::new(10, 78, 0, 1)]))
    );
    assert!(
        raw.windows(agent_info.len()).any(|w| w == agent_info),
        "option 82 echoed byte for byte"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_flood_then_a_normal_lease() {
    let lan = Lan::new("dhcpmf", "10.77.0.1/24", 1);
    let ns = &lan.clients[0];
    ns.ip(&["addr", "add", "10.77.0.60/24", "dev", "eth0"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = load_config(dir.path(), DhcpMode::Full, Some(FULL_POOL), "");
    let srv = Server::start(&lan, &cfg).await;
    {
        let peer = Peer::bind(ns, "10.77.0.60:6800").await;
        let mut good = Vec::new();
        request(MessageType::Discover, [2, 0, 0, 0, 0, 1], 9)
            .encode(&mut Encoder::new(&mut good))
            .unwrap();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut sent = 0u64;
        for i in 0..400 {
            let p: Vec<u8> = match i % 8 {
                0 => (0..(rnd() % 600) as usize).map(|_| rnd() as u8).collect(),
                1 => good[..(rnd() % 240) as usize].to_vec(),
                2 => {
                    let mut p = good.clone();
                    p[0] = 2;
                    p
                }
                3 => {
                    let mut p = good.clone();
                    p[2] = 200;
                    p
                }
                4 => good[..good.len() - 4]
                    .iter()
                    .copied()
                    .chain([12, 200, 1])
                    .collect(),
                5 => {
                    let mut p = good[..240].to_vec();
                    p.extend_from_slice(&[12, 3, b'a', b'b', b'c', 255]);
                    p
                }
                6 => vec![1u8; 3000],
                _ => {
                    let mut p = good[..240].to_vec();
                    p.extend([53, 1, 1, 94, 1, 1, 255]);
                    p
                }
            };
            peer.sock.send_to(&p, "10.77.0.1:67").await.unwrap();
            sent += 1;
        }
        until("the flood to be received", DEADLINE, async || {
            (srv.stats.received.get() >= sent).then_some(())
        })
        .await;
    }
    assert!(
        srv.stats.malformed.get() >= 350,
        "malformed {}",
        srv.stats.malformed.get()
    );
    ns.ip(&["addr", "flush", "dev", "eth0"]);
    let env = udhcpc(ns, &[]).await;
    assert!(in_pool(&env["ip"], 100, 150));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservation_decline_and_release() {
    let lan = Lan::new("dhcprv", "10.77.0.1/24", 2);
    let mac = lan.clients[0].mac("eth0");
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[[dhcp.reservations]]\nmac = \"{mac}\"\nip = \"10.77.0.20\"\nhostname = \"fixed\"\n"
    );
    let cfg = load_config(dir.path(), DhcpMode::Full, Some(FULL_POOL), &toml);
    let srv = Server::start(&lan, &cfg).await;
    let env = udhcpc(&lan.clients[0], &[]).await;
    assert_eq!(env["ip"], "10.77.0.20", "{env:?}");
    assert_eq!(env.get("hostname").map(String::as_str), Some("fixed"));
    let stored = srv.store.reservations().await.unwrap();
    assert_eq!(stored.len(), 1);

    let ns = &lan.clients[1];
    ns.ip(&["addr", "add", "10.77.0.61/24", "dev", "eth0"]);
    let peer = Peer::bind(ns, "0.0.0.0:68").await;
    let m = [0x52, 0x54, 0, 0xcc, 0, 1];
    let macs = "52:54:00:cc:00:01";
    let sid = DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 77, 0, 1));
    let dora = |xid: u32| {
        let peer = &peer;
        let sid = sid.clone();
        async move {
            peer.send(
                &request(MessageType::Discover, m, xid),
                "255.255.255.255:67",
            )
            .await;
            let (offer, _, _) = peer.recv(xid).await;
            let mut r = request(MessageType::Request, m, xid + 1);
            r.opts_mut().insert(sid);
            r.opts_mut()
                .insert(DhcpOption::RequestedIpAddress(offer.yiaddr()));
            peer.send(&r, "255.255.255.255:67").await;
            let (ack, _, _) = peer.recv(xid + 1).await;
            assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
            ack.yiaddr()
        }
    };
    let first = dora(100).await;
    assert_ne!(
        first,
        Ipv4Addr::new(10, 77, 0, 20),
        "the reserved address is not pooled"
    );
    assert_eq!(srv.lease_of(macs).await.unwrap().ip, first);

    let mut decline = request(MessageType::Decline, m, 200);
    decline.opts_mut().insert(sid.clone());
    decline
        .opts_mut()
        .insert(DhcpOption::RequestedIpAddress(first));
    peer.send(&decline, "255.255.255.255:67").await;
    let row = until("the decline to be stored", DEADLINE, async || {
        srv.store
            .load_leases(0)
            .await
            .unwrap()
            .into_iter()
            .find(|l| l.ip == first && l.state == "declined")
    })
    .await;
    assert_eq!(row.mac, macs);
    let second = dora(300).await;
    assert_ne!(second, first, "a declined address is not offered again");

    let mut release = request(MessageType::Release, m, 400);
    release.set_flags(Flags::default());
    release.set_ciaddr(second);
    release.opts_mut().insert(sid);
    peer.send(&release, "10.77.0.1:67").await;
    until("the release to be stored", DEADLINE, async || {
        let rows = srv.store.load_leases(0).await.unwrap();
        (!rows.iter().any(|l| l.ip == second)).then_some(())
    })
    .await;
    srv.stop().await;
}

/// The file field without its NUL padding (dhcproto keeps the first NUL).
fn fname(m: &Message) -> String {
    m.fname_str()
        .and_then(Result::ok)
        .unwrap_or_default()
        .trim_end_matches('\0')
        .to_string()
}
