//! Several pxed on one PostgreSQL database.
//!
//! DHCP: two servers on one bridge, perfdhcp (Kea's load generator) against both, every
//! reply on the wire captured (tcpdump): no address ACKed to two MACs, every ACK
//! stored; a stale lease table is corrected by the database at commit, and a table
//! that follows the database's announcements offers nothing the other bound; a real
//! client (busybox udhcpc) gets its lease through either instance.
//! Reinstalls: two daemons, the one running a node killed in each state; the other
//! finishes.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, Message, MessageType, OptionCode};
use dhcproto::{Decodable, Decoder};
use pxed::config::{self, Config, DhcpMode, Flags as CfgFlags};
use pxed::dhcp::{self, DhcpContext, DhcpStats};
use pxed::store::Store;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::common::need;
use super::netns::{Lan, Netns};

/// Both instances allocate from one pool.
const POOL: &str = "10.79.0.20-10.79.0.250";

fn config(dir: &Path, iface: &str, ip: &str, pool: &str) -> Config {
    let flags = CfgFlags {
        interfaces: vec![iface.into()],
        dhcp: config::DhcpFlags {
            mode: Some(DhcpMode::Full),
            pool: Some(pool.into()),
            ..Default::default()
        },
        data_dir: Some(dir.to_path_buf()),
        http: Some(format!("{ip}:80").parse().unwrap()),
        ..Default::default()
    };
    config::load(None, Vec::<(String, String)>::new(), &flags).unwrap()
}

/// Applies pxed's migrations to the database at `url`.
async fn migrate(url: &str) {
    store_pg::PgStore::connect(url, 1)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
}

struct Instance {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), dhcp::DhcpError>>,
    stats: Arc<DhcpStats>,
    _seen: mpsc::Receiver<dhcp::DhcpSeen>,
}

impl Instance {
    /// Stops the server; it must end within 5 s, cleanly.
    async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("DHCP shutdown")
            .unwrap()
            .unwrap();
    }
}

async fn start(ns: &Netns, cfg: Config, url: &str) -> Instance {
    let h = tokio::runtime::Handle::current();
    let c = cfg.clone();
    let sockets = ns
        .enter(move || {
            let _g = h.enter();
            dhcp::bind(&c)
        })
        .expect("binding DHCP in its namespace");
    let store = Store::open_postgres(url, &cfg.data_dir).await.unwrap();
    let stats = Arc::new(DhcpStats::default());
    let (tx, seen) = mpsc::channel(4096);
    let ctx = DhcpContext::new(&cfg, store, tx, stats.clone());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(dhcp::serve(sockets, ctx, cancel.clone()));
    Instance {
        cancel,
        task,
        stats,
        _seen: seen,
    }
}

/// The DHCP replies in a pcap file: (message type, address, client MAC, server id).
fn replies(pcap: &[u8]) -> Vec<Reply> {
    let mut out = Vec::new();
    let mut at = 24; // the global header
    while at + 16 <= pcap.len() {
        let caplen = u32::from_le_bytes(pcap[at + 8..at + 12].try_into().unwrap()) as usize;
        let frame = &pcap[at + 16..(at + 16 + caplen).min(pcap.len())];
        at += 16 + caplen;
        // Ethernet, IPv4 (its header length), UDP: the BOOTP message after them.
        if frame.len() < 14 + 20 + 8 || frame[12..14] != [0x08, 0x00] {
            continue;
        }
        let ihl = usize::from(frame[14] & 0x0f) * 4;
        let Some(payload) = frame.get(14 + ihl + 8..) else {
            continue;
        };
        let Ok(m) = Message::decode(&mut Decoder::new(payload)) else {
            continue;
        };
        let Some(DhcpOption::MessageType(t)) = m.opts().get(OptionCode::MessageType) else {
            continue;
        };
        let server = match m.opts().get(OptionCode::ServerIdentifier) {
            Some(DhcpOption::ServerIdentifier(s)) => Some(*s),
            _ => None,
        };
        let mac = m.chaddr()[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":");
        out.push((*t, m.yiaddr(), mac, server));
    }
    out
}

/// A DHCP reply seen on the wire: (message type, address, client MAC, server id).
type Reply = (MessageType, Ipv4Addr, String, Option<Ipv4Addr>);

/// tcpdump capturing the DHCP replies that reach `eth0` in a namespace.
struct Capture {
    child: std::process::Child,
    _dir: tempfile::TempDir,
    file: std::path::PathBuf,
    hear: tokio::sync::mpsc::UnboundedReceiver<String>,
    words: Vec<String>,
}

impl Capture {
    /// Starts tcpdump and waits until it captures.
    async fn start(ns: &Netns) -> Capture {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("replies.pcap");
        let mut child = ns
            .std_command("tcpdump")
            .args(["-i", "eth0", "-U", "-s", "1500", "-w"])
            .arg(&file)
            .arg("udp src port 67")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // tcpdump says "listening on" once capturing, and how many packets it captured
        // at the end: its stderr is read to the end (a closed pipe would kill it).
        let err = child.stderr.take().unwrap();
        let (said, mut hear) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let _ = said.send(line);
            }
        });
        let mut words = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(l) = hear.recv().await {
                let started = l.contains("listening on");
                words.push(l);
                if started {
                    return;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("tcpdump did not start: {words:?}"));
        Capture {
            child,
            _dir: dir,
            file,
            hear,
            words,
        }
    }

    /// Stops it: the replies captured, and what tcpdump said.
    async fn stop(mut self) -> (Vec<Reply>, Vec<String>) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        self.child.wait().unwrap();
        while let Ok(l) = self.hear.try_recv() {
            self.words.push(l);
        }
        (replies(&std::fs::read(&self.file).unwrap()), self.words)
    }
}

/// perfdhcp in `ns`: DORA at 400/s from `clients` MACs counted up from `base`, for
/// `secs` seconds; its report.
fn perfdhcp(ns: &Netns, clients: usize, base: &str, secs: &str) -> String {
    let out = ns
        .std_command("perfdhcp")
        .args(["-4", "-l", "eth0", "-r", "400", "-R"])
        .arg(clients.to_string())
        .args(["-b", &format!("mac={base}"), "-p", secs])
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Each address ACKed went to one MAC, and the last ACK of each address is the
/// lease stored in `db`.
fn assert_acks_unique_and_stored(
    cluster: &store_pg::cluster::Cluster,
    db: &str,
    acks: &[&Reply],
) -> HashMap<Ipv4Addr, HashSet<String>> {
    let mut holders: HashMap<Ipv4Addr, HashSet<String>> = HashMap::new();
    let mut last: HashMap<Ipv4Addr, &str> = HashMap::new();
    for (_, ip, mac, _) in acks {
        holders.entry(*ip).or_default().insert(mac.clone());
        last.insert(*ip, mac);
    }
    let shared: Vec<_> = holders.iter().filter(|(_, m)| m.len() > 1).collect();
    assert!(shared.is_empty(), "addresses ACKed to two MACs: {shared:?}");
    let rows = cluster
        .psql(
            db,
            "SELECT ip || ' ' || mac FROM leases WHERE state = 'bound'",
        )
        .unwrap();
    let stored: HashSet<&str> = rows.lines().collect();
    for (ip, mac) in &last {
        assert!(
            stored.contains(format!("{ip} {mac}").as_str()),
            "ACKed {ip} to {mac}, not in the database"
        );
    }
    holders
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_database_never_ack_one_address_to_two_macs() {
    need("perfdhcp");
    need("tcpdump");
    let cluster = store_pg::cluster::Cluster::shared();
    let (db, url) = cluster.new_database().unwrap();
    migrate(&url).await;

    // Instances A and B and the load generator, each on a veth into one bridge.
    let mut lan = Lan::new("inst", "10.79.0.254/24", 0);
    let a = lan.add_client("insta");
    let b = lan.add_client("instb");
    let c = lan.add_client("instc");
    // Two more for real clients (udhcpc), addressed by DHCP.
    let d = lan.add_client("instd");
    let e = lan.add_client("inste");
    for (i, ip) in [
        (a, "10.79.0.1/24"),
        (b, "10.79.0.2/24"),
        (c, "10.79.0.3/24"),
    ] {
        // perfdhcp sends from the address of its interface.
        lan.clients[i].ip(&["addr", "add", ip, "dev", "eth0"]);
    }
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let a_srv = start(
        &lan.clients[a],
        config(dirs[0].path(), "eth0", "10.79.0.1", POOL),
        &url,
    )
    .await;
    let b_srv = start(
        &lan.clients[b],
        config(dirs[1].path(), "eth0", "10.79.0.2", POOL),
        &url,
    )
    .await;

    let capture = Capture::start(&lan.clients[c]).await;

    let perfdhcp =
        |clients: usize, base: &str, secs: &str| perfdhcp(&lan.clients[c], clients, base, secs);
    let link = |i: usize, up: &str| lan.clients[i].ip(&["link", "set", "eth0", up]);
    let announce = |on: &str| {
        cluster
            .psql(
                &db,
                &format!("ALTER TABLE leases {on} TRIGGER leases_notify"),
            )
            .unwrap()
    };
    // 1. A binds 30 clients while B is off the LAN and, the database's announcements
    //    switched off, B's lease table cannot hear of them: a stale cache.
    announce("DISABLE");
    link(b, "down");
    let mut report = perfdhcp(30, "02:00:00:00:01:00", "2");
    link(b, "up");
    announce("ENABLE");
    tokio::time::sleep(Duration::from_secs(1)).await;
    // 2. B alone (A off the LAN) serves 10 new clients: it offers the addresses A
    //    bound in 1, and the database refuses each; B learns the holder's lease and
    //    offers the next address.
    link(a, "down");
    report += &perfdhcp(10, "02:00:00:00:02:00", "1");
    link(a, "up");
    let refused_stale = b_srv.stats.lease_conflicts.get();
    // 3. Both on the LAN: 40 other clients do DORA again and again for 6 s at 400/s,
    //    each through whichever offer arrives first.
    report += &perfdhcp(40, "02:00:00:00:03:00", "6");
    // 4. A binds 20 more while B is off the LAN; this time B hears of them.
    link(b, "down");
    report += &perfdhcp(20, "02:00:00:00:04:00", "2");
    link(b, "up");
    // 5. B alone serves 20 new clients: it offers none of the addresses A bound in 4.
    link(a, "down");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b_before = b_srv.stats.lease_conflicts.get();
    report += &perfdhcp(20, "02:00:00:00:05:00", "2");
    let refused_followed = b_srv.stats.lease_conflicts.get() - b_before;
    // 6. A real client (busybox udhcpc) gets its lease through B while A is off the
    //    LAN, and another through A while B is.
    let via_b = crate::dhcp::udhcpc(&lan.clients[d], &[]).await;
    link(a, "up");
    link(b, "down");
    let via_a = crate::dhcp::udhcpc(&lan.clients[e], &[]).await;
    link(b, "up");
    assert_eq!(via_b["serverid"], "10.79.0.2", "{via_b:?}");
    assert_eq!(via_a["serverid"], "10.79.0.1", "{via_a:?}");
    for (i, got) in [(d, &via_b), (e, &via_a)] {
        let mac = lan.clients[i].mac("eth0");
        let row = cluster
            .psql(&db, &format!("SELECT ip FROM leases WHERE mac = '{mac}'"))
            .unwrap();
        assert_eq!(row, got["ip"], "{mac}'s lease is stored");
    }
    let (replies, words) = capture.stop().await;
    let acks: Vec<_> = replies.iter().filter(|r| r.0 == MessageType::Ack).collect();
    let by_server = |ip: Ipv4Addr| acks.iter().filter(|r| r.3 == Some(ip)).count();
    let (from_a, from_b) = (
        by_server("10.79.0.1".parse().unwrap()),
        by_server("10.79.0.2".parse().unwrap()),
    );
    assert!(
        from_a > 50 && from_b > 50,
        "both instances ACK: {from_a} from A, {from_b} from B ({} replies captured; tcpdump: {words:?})\n{report}",
        replies.len()
    );

    // No address ever ACKed to two MACs (the lease time is far longer than the run),
    // and every ACK's lease is in the database.
    let holders = assert_acks_unique_and_stored(cluster, &db, &acks);

    // The database refused what B's stale table offered (2), and B, following the
    // database's announcements, offered none of what A bound while it was away (5).
    let phase = |r: &&Reply, p: &str| r.2.starts_with(&format!("02:00:00:00:0{p}:"));
    let bound_in_4: HashSet<Ipv4Addr> =
        acks.iter().filter(|r| phase(r, "4")).map(|r| r.1).collect();
    let offered_in_5: HashSet<Ipv4Addr> = replies
        .iter()
        .filter(|r| r.0 == MessageType::Offer && phase(r, "5"))
        .map(|r| r.1)
        .collect();
    eprintln!(
        "{} ACKs ({from_a} from A, {from_b} from B), {} addresses; refused by the database: {refused_stale} (stale table), {refused_followed} (following)\n{report}",
        acks.len(),
        holders.len()
    );
    assert!(
        refused_stale > 0,
        "B never offered an address A had bound: the commit's check was not exercised"
    );
    assert!(!bound_in_4.is_empty() && !offered_in_5.is_empty());
    let stale: Vec<_> = bound_in_4.intersection(&offered_in_5).collect();
    assert!(
        stale.is_empty() && refused_followed == 0,
        "B offered addresses A had bound while it was away: {stale:?} ({refused_followed} refused)"
    );

    a_srv.stop().await;
    b_srv.stop().await;
}

/// PostgreSQL killed (with its backends) for 2 s and started again while perfdhcp runs
/// DORA against a pxed DHCP server on it: no ACK goes out while the database is down
/// (a reply waits for its lease's commit), the server serves again once the database
/// is back, and every lease it ACKed, before or after, is in the database (crash
/// recovery keeps what was committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_restart_under_dhcp_load_loses_no_acked_lease() {
    need("perfdhcp");
    need("tcpdump");
    // Its own server: it is killed below.
    let cluster = store_pg::cluster::Cluster::start().unwrap();
    let url = cluster.create_database("dhcp").unwrap();
    migrate(&url).await;
    let mut lan = Lan::new("pgr", "10.80.0.254/24", 0);
    let a = lan.add_client("pgra");
    let c = lan.add_client("pgrc");
    lan.clients[a].ip(&["addr", "add", "10.80.0.1/24", "dev", "eth0"]);
    lan.clients[c].ip(&["addr", "add", "10.80.0.3/24", "dev", "eth0"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "eth0", "10.80.0.1", "10.80.0.20-10.80.0.250");
    let srv = start(&lan.clients[a], cfg, &url).await;
    let capture = Capture::start(&lan.clients[c]).await;

    // 8 s of load; the database is killed after 2 s and is back 2 s later.
    let ns = lan.clients[c].name().to_string();
    let load = std::thread::spawn(move || {
        let out = std::process::Command::new("ip")
            .args([
                "netns", "exec", &ns, "perfdhcp", "-4", "-l", "eth0", "-r", "300",
            ])
            .args(["-R", "60", "-b", "mac=02:00:00:00:06:00", "-p", "8"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let acks_before = srv.stats.acks.get();
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.kill();
        cluster
    })
    .await
    .unwrap();
    // While the database is down no lease commits, so no ACK goes out (a commit in
    // flight at the kill may still have been answered).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let acks_down = srv.stats.acks.get();
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let acks_still_down = srv.stats.acks.get();
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.restart().unwrap();
        cluster
    })
    .await
    .unwrap();
    let report = tokio::task::spawn_blocking(move || load.join().unwrap())
        .await
        .unwrap();
    let acks_during = srv.stats.acks.get();
    // Then 2 s more, the database up all along: the server answers again.
    let after = perfdhcp(&lan.clients[c], 20, "02:00:00:00:07:00", "2");
    let (replies, words) = capture.stop().await;
    let acks: Vec<_> = replies.iter().filter(|r| r.0 == MessageType::Ack).collect();
    let late = acks
        .iter()
        .filter(|r| r.2.starts_with("02:00:00:00:07:"))
        .count();
    eprintln!(
        "{} ACKs ({acks_before} before the kill, {} while it was down, {late} after the load), {} commits failed\n{report}\n{after}",
        acks.len(),
        acks_still_down - acks_down,
        srv.stats.commit_errors.get()
    );
    assert!(
        acks_before > 100 && acks_during > acks_still_down,
        "{report}"
    );
    assert_eq!(
        acks_down, acks_still_down,
        "ACKs went out while the database was down\n{words:?}"
    );
    assert!(late > 50, "no service after the restart:\n{after}");
    assert_acks_unique_and_stored(&cluster, "dhcp", &acks);
    srv.stop().await;
}

/// Two daemons on one database; whichever instance answers for a node in each
/// in-progress state is killed with SIGKILL, and the other one finishes the
/// reinstall: the BMC is reset once, netboot set once, and the audit log has each row
/// once. The BMC is a real Redfish emulator (sushy-tools) behind a counting proxy.
#[tokio::test(flavor = "multi_thread")]
async fn a_survivor_finishes_each_reinstall_when_its_instance_is_killed() {
    use crate::bmc::{FaultProxy, NODE1, NODE2, Sushy};
    use crate::common::{Api, Daemon, pxed_bin, repo, run};
    use crate::crash::{
        add_redfish_nodes, assert_log_kept, assert_rows_once, reinstall, rocky_mirror,
    };
    use nix::sys::signal::Signal;

    const TOKEN: &str = "instances-token";
    let cluster = store_pg::cluster::Cluster::shared();
    let (db, url) = cluster.new_database().unwrap();
    migrate(&url).await;
    let sushy = Sushy::start();
    let proxy = FaultProxy::start(&sushy.url(), "slow-reset");
    let work = tempfile::tempdir().unwrap();
    let mirror_env = rocky_mirror(work.path());
    let env: Vec<(&str, &str)> = vec![
        ("PXED_API_TOKEN", TOKEN),
        ("PXED_MIRROR_BASE", &mirror_env),
        ("PXED_DATABASE_URL", &url),
        ("PXED_LIFECYCLE__MAX_ATTEMPTS", "0"),
        ("PXED_LIFECYCLE__DEADLINES__NETBOOTING", "8s"),
        ("PXED_LIFECYCLE__OWNER_TTL", "2s"),
    ];
    // Instance A's data dir gets the image; B's is a copy (the same secret key, the
    // same image files).
    let dir_a = tempfile::tempdir().unwrap();
    let (ok, out, err) = run(std::process::Command::new(pxed_bin())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(dir_a.path().join("data"))
        .env("PXED_DATABASE_URL", &url)
        .env("PXED_MIRROR_BASE", &mirror_env));
    assert!(ok, "image add: {out}{err}");
    let dir_b = tempfile::tempdir().unwrap();
    let (ok, _, err) = run(std::process::Command::new("cp")
        .arg("-a")
        .arg(dir_a.path().join("data"))
        .arg(dir_b.path()));
    assert!(ok, "{err}");
    let start = |dir: tempfile::TempDir| Daemon::start_in(dir, &[], &env);
    let mut x = start(dir_a);
    let mut y = start(dir_b);
    pxed::net::install_crypto_provider();
    let api = Api::new(TOKEN);
    let ids = add_redfish_nodes(
        &api,
        &x,
        [
            ("52:54:00:12:35:56", NODE1, proxy.url()),
            ("52:54:00:12:35:57", NODE2, sushy.url()),
        ],
    )
    .await;
    let (a, b) = (ids[0], ids[1]);
    // Kills `d` and starts it again on its data dir (it comes back as a new instance).
    let kill = |d: Daemon| d.kill_keep_dir(Signal::SIGKILL);

    // reclaiming: X is killed with the reset sent and unanswered. Y takes the node over
    // once X's claim lapses and checks the machine: no second reset, no second
    // netboot override.
    reinstall(&api, &x, a).await;
    crate::common::wait_for(
        "the reset to reach the BMC",
        Duration::from_secs(20),
        || (proxy.stats()["resets"].as_array().unwrap().len() == 1).then_some(()),
    );
    let before = api.node(&x, a).await;
    assert_eq!(before["state"], "reclaiming");
    let dir_x = kill(x);
    let after = api
        .wait_state(&y, a, "netbooting", Duration::from_secs(60))
        .await;
    assert_log_kept(&before, &after);
    assert!(y.logged("took over nodes"), "{}", y.log_text());
    let stats = proxy.stats();
    assert_eq!(stats["resets"].as_array().unwrap().len(), 1, "{stats}");
    assert_eq!(stats["patches"], 1, "netboot not set again: {stats}");
    x = start(dir_x);

    // netbooting -> installing through X (the restarted one): X answers for the node.
    let script = api.text(&x, "/boot/52:54:00:12:35:56.ipxe").await;
    assert!(script.contains("/images/rocky-9/x86_64/kernel"), "{script}");
    let i = script.find("/cfg/").unwrap() + 5;
    let token = script[i..].split('/').next().unwrap().to_string();
    let before = api
        .wait_state(&x, a, "installing", Duration::from_secs(5))
        .await;
    let agent = cluster
        .psql(
            &db,
            &format!("SELECT agent_token FROM nodes WHERE id = {a}"),
        )
        .unwrap();

    // installing: X killed; the installer's callback reaches Y.
    let dir_x = kill(x);
    let r = api
        .http
        .post(y.url(&format!("/cb/{token}/installed")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let after = api
        .wait_state(&y, a, "first_boot", Duration::from_secs(5))
        .await;
    assert_log_kept(&before, &after);
    x = start(dir_x);

    // first_boot: Y (which applied `installed`) killed; the agent reports to X.
    let before = after;
    let dir_y = kill(y);
    api.first_boot_and_health(&x, &agent, "node-123556").await;
    let after = api
        .wait_state(&x, a, "available", Duration::from_secs(5))
        .await;
    assert_log_kept(&before, &after);
    assert_rows_once(&after);
    assert_eq!(after["hostname"], "node-123556");
    y = start(dir_y);

    // netbooting: the node never fetches its script and X, which runs its deadline,
    // is killed: Y takes the node over, and the deadline fails it naming the stage.
    reinstall(&api, &x, b).await;
    let before = api
        .wait_state(&x, b, "netbooting", Duration::from_secs(60))
        .await;
    let _dir_x = kill(x);
    let after = api
        .wait_state(&y, b, "failed", Duration::from_secs(30))
        .await;
    assert_eq!(after["failed_step"], "netbooting");
    let reason = after["failed_reason"].as_str().unwrap();
    assert!(reason.starts_with("deadline: never netbooted"), "{reason}");
    assert_log_kept(&before, &after);
    assert_rows_once(&after);
    assert!(y.logged("took over nodes"), "{}", y.log_text());
}

/// Two sites, one control plane: instance A serves room-a's VLAN (10.88.0.0/24), B
/// serves room-b's (10.89.0.0/24), both on one PostgreSQL database. A machine that
/// netboots in a room gets that room's address and is shown, through either
/// instance's API and board, with the site that served it; a machine moved to the
/// other room is the same node, now shown with the new site.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_of_two_sites_share_one_inventory_and_show_each_nodes_site() {
    use crate::common::poll_blocking;
    use crate::qemu::{http_get, reap, spawn_pxed};

    let cluster = store_pg::cluster::Cluster::shared();
    let (_db, url) = cluster.new_database().unwrap();
    migrate(&url).await;
    let room_a = Lan::new("sita", "10.88.0.1/24", 2);
    let room_b = Lan::new("sitb", "10.89.0.1/24", 1);
    let (ip_a, ip_b) = (Ipv4Addr::new(10, 88, 0, 1), Ipv4Addr::new(10, 89, 0, 1));
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut a = spawn_pxed(
        &room_a.server,
        "br0",
        ip_a,
        88,
        dir_a.path(),
        &[("PXED_DATABASE_URL", &url), ("PXED_SITE", "room-a")],
    );
    let mut b = spawn_pxed(
        &room_b.server,
        "br0",
        ip_b,
        89,
        dir_b.path(),
        &[("PXED_DATABASE_URL", &url), ("PXED_SITE", "room-b")],
    );
    let logs = || {
        let read = |d: &tempfile::TempDir| {
            std::fs::read_to_string(d.path().join("pxed.log")).unwrap_or_default()
        };
        format!(
            "---- A ----\n{}\n---- B ----\n{}",
            read(&dir_a),
            read(&dir_b)
        )
    };
    for (ns, ip) in [(&room_a.server, ip_a), (&room_b.server, ip_b)] {
        let up = poll_blocking(Duration::from_secs(20), || {
            http_get(ns, ip, "/metrics").ok().filter(|(c, _)| *c == 200)
        });
        assert!(up.is_some(), "{ip} did not come up:\n{}", logs());
    }
    let get = |ns: &Netns, ip: Ipv4Addr, path: &str| -> String {
        let (code, body) = http_get(ns, ip, path).unwrap();
        assert_eq!(code, 200, "GET {path} from {ip}: {body}");
        body
    };
    let nodes = |ns: &Netns, ip: Ipv4Addr, query: &str| -> Vec<(String, Option<String>)> {
        let body = get(ns, ip, &format!("/api/v1/nodes{query}"));
        let v: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        v.iter()
            .map(|n| {
                (
                    n["macs"][0].as_str().unwrap_or_default().to_string(),
                    n["site"].as_str().map(str::to_string),
                )
            })
            .collect()
    };
    let site_of = |mac: &str| {
        nodes(&room_b.server, ip_b, "")
            .into_iter()
            .find(|(m, _)| m == mac)
            .and_then(|(_, s)| s)
    };
    // The firmware's PXE DHCP (x86-64 UEFI).
    let pxe = ["-x", "0x5d:0007", "-V", "PXEClient:Arch:00007:UNDI:003016"];

    // One machine in each room netboots: each gets its room's address.
    let in_a = room_a.clients[0].mac("eth0");
    let in_b = room_b.clients[0].mac("eth0");
    let lease_a = crate::dhcp::udhcpc(&room_a.clients[0], &pxe).await;
    let lease_b = crate::dhcp::udhcpc(&room_b.clients[0], &pxe).await;
    assert!(lease_a["ip"].starts_with("10.88.0."), "{lease_a:?}");
    assert_eq!(lease_a["serverid"], ip_a.to_string());
    assert!(lease_b["ip"].starts_with("10.89.0."), "{lease_b:?}");
    assert_eq!(lease_b["serverid"], ip_b.to_string());
    // Both are in the one inventory, each with its site, whichever instance is asked.
    let seen = poll_blocking(Duration::from_secs(15), || {
        (site_of(&in_a).as_deref() == Some("room-a") && site_of(&in_b).as_deref() == Some("room-b"))
            .then_some(())
    });
    assert!(
        seen.is_some(),
        "sites: {:?}\n{}",
        nodes(&room_b.server, ip_b, ""),
        logs()
    );
    let mut from_a = nodes(&room_a.server, ip_a, "");
    let mut from_b = nodes(&room_b.server, ip_b, "");
    from_a.sort();
    from_b.sort();
    assert_eq!(from_a, from_b, "one inventory");
    assert_eq!(from_a.len(), 2, "{from_a:?}");
    // Filtered by site.
    assert_eq!(
        nodes(&room_a.server, ip_a, "?site=room-b"),
        [(in_b.clone(), Some("room-b".to_string()))]
    );
    assert!(nodes(&room_a.server, ip_a, "?site=room-c").is_empty());
    // The board of room-b's instance shows room-a's machine with its site.
    let board = get(&room_b.server, ip_b, "/?site=room-a");
    assert!(board.contains("<th>site</th>"), "{board}");
    assert!(board.contains(&in_a), "{board}");
    assert!(board.contains("<td class=\"site\">room-a</td>"), "{board}");
    assert!(!board.contains(&in_b), "filtered out: {board}");

    // The machine of room-b is moved to room-a (its NIC, its MAC): the same node, an
    // address of room-a, now served by room-a.
    let moved = &room_a.clients[1];
    moved.ip(&["link", "set", "eth0", "down"]);
    moved.ip(&["link", "set", "eth0", "address", &in_b]);
    moved.ip(&["link", "set", "eth0", "up"]);
    let lease = crate::dhcp::udhcpc(moved, &pxe).await;
    assert!(lease["ip"].starts_with("10.88.0."), "{lease:?}");
    assert_eq!(lease["serverid"], ip_a.to_string());
    let now_a = poll_blocking(Duration::from_secs(15), || {
        (site_of(&in_b).as_deref() == Some("room-a")).then_some(())
    });
    assert!(
        now_a.is_some(),
        "{:?}\n{}",
        nodes(&room_b.server, ip_b, ""),
        logs()
    );
    assert_eq!(nodes(&room_a.server, ip_a, "").len(), 2, "still two nodes");
    assert!(nodes(&room_b.server, ip_b, "?site=room-b").is_empty());
    reap(&mut a);
    reap(&mut b);
}
