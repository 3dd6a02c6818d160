//! Real firmware booting from the real `pxed` binary in QEMU (TCG), from power-on to
//! the per-node iPXE script: OVMF's own EDK2 PXE (client-arch 7) and its UEFI HTTP
//! boot (arch 16), AAVMF's PXE (arch 11) and SeaBIOS with the iPXE NIC ROM.
//!
//! Needs root and the packages qemu-system-x86, ovmf, qemu-system-arm,
//! qemu-efi-aarch64 and ipxe-qemu. pxed runs in a server namespace on bridge `br0`;
//! QEMU's NIC is `tap0` on that bridge. One guest runs at a time (see [`ONE_GUEST`]);
//! each boot takes ~12-20 s under TCG here and has a hard deadline of [`DEADLINE`].

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::common::{poll_blocking, pxed_bin, repo};
use super::netns::Lan;

pub(super) const TOKEN: &str = "qemu-boot-test-token";
/// Power-on to the script took 12-20 s on a shared 2-core machine; the rest is headroom.
const DEADLINE: Duration = Duration::from_secs(90);

/// One guest at a time: TCG guests racing for two cores only make each other late.
static ONE_GUEST: Mutex<()> = Mutex::new(());

/// Kills the child if the test process dies without unwinding (e.g. SIGKILL on timeout).
fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec.
    // `ip netns exec` execs the real program, which keeps the death signal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    }
}

/// Kills and reaps a child.
pub(super) fn reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Serial console text made readable: ANSI escapes, carriage returns, backspaced
/// characters and blank lines removed.
fn readable(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                // CSI: ESC [ params final-letter; anything else: drop ESC + one char.
                if chars.next() == Some('[') {
                    for p in chars.by_ref() {
                        if p.is_ascii_alphabetic() {
                            break;
                        }
                    }
                }
            }
            '\x08' => {
                out.pop();
            }
            '\r' => {}
            c => out.push(c),
        }
    }
    let mut lines = out
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    // Keep the mark of a finished last line.
    if out.ends_with('\n') {
        lines.push('\n');
    }
    lines
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Adds tap device `name` (no carrier until QEMU opens it) to the Lan's bridge.
/// It lives in the server namespace and goes away with it.
fn add_tap(lan: &Lan, name: &str) {
    lan.server
        .ip(&["tuntap", "add", "dev", name, "mode", "tap"]);
    lan.server.ip(&["link", "set", name, "master", "br0"]);
    lan.server.ip(&["link", "set", name, "up"]);
}

/// Unsolicited router advertisements on `br0` every 300 ms. iPXE waits for IPv6
/// autoconfiguration (up to 15 s in the BIOS ROM's iPXE) unless a router answers;
/// an RA with neither M nor O set ends that wait at once. Router lifetime 0: not a
/// default router, no prefixes: nothing else changes on the segment.
struct RouterAdverts {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RouterAdverts {
    fn start(lan: &Lan) -> RouterAdverts {
        let (sock, ifindex) = lan.server.enter(|| {
            use socket2::{Domain, Protocol, Socket, Type};
            let s = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))
                .expect("raw ICMPv6 socket (root?)");
            let name = std::ffi::CString::new("br0").unwrap();
            // SAFETY: a valid NUL-terminated name.
            let idx = unsafe { libc::if_nametoindex(name.as_ptr()) };
            assert_ne!(idx, 0, "br0 in the server namespace");
            s.set_multicast_if_v6(idx).unwrap();
            // Receivers drop neighbour discovery that did not arrive with hop limit 255.
            s.set_multicast_hops_v6(255).unwrap();
            (s, idx)
        });
        // type 134, code 0, checksum (the kernel fills it in for ICMPv6 raw sockets),
        // cur hop limit 64, flags 0, router lifetime 0, reachable 0, retrans 0.
        const RA: [u8; 16] = [134, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let all_nodes =
            SocketAddrV6::new(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1), 0, 0, ifindex);
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                // Fails until br0 has a carrier and a link-local address: keep trying.
                let _ = sock.send_to(&RA, &all_nodes.into());
                std::thread::park_timeout(Duration::from_millis(300));
            }
        });
        RouterAdverts {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for RouterAdverts {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// `pxed serve` with full DHCP on `br0` of a fresh namespace that also holds `tap0`
/// for QEMU and sends router advertisements.
struct Appliance {
    child: Child,
    ip: Ipv4Addr,
    dir: tempfile::TempDir,
    _ra: RouterAdverts,
    // Last: the namespace (and tap0 with it) goes after pxed is gone.
    lan: Lan,
}

/// Spawns `pxed serve` with full DHCP on `iface` of `ns` at `ip`, logging to
/// `dir/pxed.log`, its data in `dir/data`; extra environment `env`.
pub(super) fn spawn_pxed(
    ns: &super::netns::Netns,
    iface: &str,
    ip: Ipv4Addr,
    net: u8,
    dir: &Path,
    env: &[(&str, &str)],
) -> Child {
    let log = std::fs::File::create(dir.join("pxed.log")).unwrap();
    let mut cmd = ns.std_command(pxed_bin());
    cmd.current_dir(repo())
        .args(["serve", "--interface", iface, "--dhcp", "full", "--pool"])
        .arg(format!("10.{net}.0.100-10.{net}.0.150"))
        .arg("--server-ip")
        .arg(ip.to_string())
        .arg("--http")
        .arg(format!("{ip}:80"))
        .arg("--tftp")
        .arg(format!("{ip}:69"))
        .arg("--ipxe-dir")
        .arg(repo().join("ipxe/bin"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("PXED_API_TOKEN", TOKEN)
        .env("PXED_LOG", "info,pxed=debug")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    die_with_parent(&mut cmd).spawn().expect("spawn pxed")
}

/// A plain HTTP/1.0 GET to `ip:80` from inside `ns`: (status, body).
pub(super) fn http_get(
    ns: &super::netns::Netns,
    ip: Ipv4Addr,
    path: &str,
) -> std::io::Result<(u16, String)> {
    let addr = SocketAddr::from((ip, 80));
    let req = format!("GET {path} HTTP/1.0\r\nHost: {ip}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n");
    ns.enter(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(req.as_bytes())?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)?;
        let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        Ok((code, body.to_string()))
    })
}

impl Appliance {
    /// `net` picks the /24 (10.<net>.0.0), so a leaked namespace never shares a subnet.
    fn start(tag: &str, net: u8) -> Appliance {
        Self::start_with(tag, net, &[])
    }

    /// [`Appliance::start`] with extra environment for pxed.
    fn start_with(tag: &str, net: u8, env: &[(&str, &str)]) -> Appliance {
        let ip = Ipv4Addr::new(10, net, 0, 1);
        let lan = Lan::new(tag, &format!("{ip}/24"), 0);
        add_tap(&lan, "tap0");
        let dir = tempfile::tempdir().unwrap();
        let child = spawn_pxed(&lan.server, "br0", ip, net, dir.path(), env);
        let ra = RouterAdverts::start(&lan);
        let mut app = Appliance {
            child,
            ip,
            dir,
            _ra: ra,
            lan,
        };
        let up = poll_blocking(Duration::from_secs(20), || {
            if let Ok(Some(st)) = app.child.try_wait() {
                panic!("pxed exited early ({st}):\n{}", app.log());
            }
            // TFTP and DHCP bind before HTTP starts answering.
            app.get("/metrics").ok().filter(|(code, _)| *code == 200)
        });
        assert!(up.is_some(), "pxed did not come up:\n{}", app.log());
        app
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pxed.log")).unwrap_or_default()
    }

    /// A plain HTTP/1.0 GET from inside the server namespace: (status, body).
    fn get(&self, path: &str) -> std::io::Result<(u16, String)> {
        http_get(&self.lan.server, self.ip, path)
    }

    /// The value of an unlabelled metric.
    fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics").ok()?;
        body.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .find_map(|v| v.trim().parse().ok())
    }

    /// The node holding `mac`, as `GET /api/v1/nodes` shows it.
    fn node(&self, mac: &str) -> Option<serde_json::Value> {
        let (code, body) = self.get("/api/v1/nodes").expect("GET /api/v1/nodes");
        assert_eq!(code, 200, "GET /api/v1/nodes: {body}");
        let nodes: Vec<serde_json::Value> = serde_json::from_str(&body).expect("node list JSON");
        nodes.into_iter().find(|n| {
            n["macs"]
                .as_array()
                .is_some_and(|m| m.iter().any(|x| x == mac))
        })
    }
}

impl Drop for Appliance {
    fn drop(&mut self) {
        // SAFETY: signalling our own child; SIGTERM lets pxed close SQLite cleanly.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let gone = poll_blocking(Duration::from_secs(5), || {
            self.child.try_wait().ok().flatten()
        });
        if gone.is_none() {
            reap(&mut self.child);
        }
        if std::thread::panicking() {
            eprintln!("---- pxed log (tail) ----\n{}", tail(&self.log(), 60));
        }
    }
}

/// The firmware a guest starts with.
#[derive(Debug, Clone, Copy)]
enum Firmware {
    /// OVMF, virtio-net without an option ROM: EDK2's own PXE, client-arch 7.
    OvmfPxe,
    /// OVMF with PXE switched off via fw_cfg: UEFI HTTP boot, arch 16.
    OvmfHttp,
    /// AAVMF on `virt`, virtio-net: EDK2 PXE, client-arch 11.
    AavmfPxe,
    /// SeaBIOS with QEMU's e1000 iPXE ROM (from ipxe-qemu).
    SeaBios,
}

fn need(path: &str, package: &str) -> String {
    assert!(
        Path::new(path).exists(),
        "{path} is missing: install the Debian package {package}"
    );
    path.to_string()
}

/// A QEMU guest on `tap0`, serial console in a file; killed on drop, and its console
/// printed when the test is failing.
struct Guest {
    child: Child,
    serial: PathBuf,
    qemu_log: PathBuf,
    started: Instant,
    _guard: std::sync::MutexGuard<'static, ()>,
}

impl Guest {
    fn boot(app: &Appliance, fw: Firmware, mac: &str) -> Guest {
        let guard = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
        let dir = app.dir.path();
        let serial = dir.join(format!("serial-{fw:?}.log"));
        let copy_vars = |src: &str, package: &str| {
            let dst = dir.join(format!("vars-{fw:?}.fd"));
            std::fs::copy(need(src, package), &dst).unwrap();
            format!("if=pflash,format=raw,file={}", dst.display())
        };
        let (program, mut args): (&str, Vec<String>) = match fw {
            Firmware::OvmfPxe | Firmware::OvmfHttp => {
                let code = need("/usr/share/OVMF/OVMF_CODE_4M.fd", "ovmf");
                let mut a = vec![
                    "-accel".into(),
                    "tcg".into(),
                    "-machine".into(),
                    "q35".into(),
                    "-m".into(),
                    "512".into(),
                    "-drive".into(),
                    format!("if=pflash,format=raw,readonly=on,file={code}"),
                    "-drive".into(),
                    copy_vars("/usr/share/OVMF/OVMF_VARS_4M.fd", "ovmf"),
                ];
                if let Firmware::OvmfHttp = fw {
                    for opt in ["IPv4PXESupport", "IPv6PXESupport"] {
                        a.push("-fw_cfg".into());
                        a.push(format!("name=opt/org.tianocore/{opt},string=no"));
                    }
                }
                a.push("-device".into());
                a.push(format!("virtio-net-pci,netdev=n0,mac={mac},romfile="));
                ("qemu-system-x86_64", a)
            }
            Firmware::AavmfPxe => {
                let code = need("/usr/share/AAVMF/AAVMF_CODE.fd", "qemu-efi-aarch64");
                (
                    "qemu-system-aarch64",
                    vec![
                        "-accel".into(),
                        "tcg".into(),
                        "-machine".into(),
                        "virt".into(),
                        "-cpu".into(),
                        "cortex-a57".into(),
                        "-m".into(),
                        "1024".into(),
                        "-drive".into(),
                        format!("if=pflash,format=raw,readonly=on,file={code}"),
                        "-drive".into(),
                        copy_vars("/usr/share/AAVMF/AAVMF_VARS.fd", "qemu-efi-aarch64"),
                        "-device".into(),
                        format!("virtio-net-pci,netdev=n0,mac={mac},romfile="),
                    ],
                )
            }
            Firmware::SeaBios => {
                need("/usr/lib/ipxe/qemu/efi-e1000.rom", "ipxe-qemu");
                (
                    "qemu-system-x86_64",
                    vec![
                        "-accel".into(),
                        "tcg".into(),
                        "-m".into(),
                        "512".into(),
                        "-boot".into(),
                        "order=n".into(),
                        "-device".into(),
                        format!("e1000,netdev=n0,mac={mac}"),
                    ],
                )
            }
        };
        // -nographic: SeaBIOS (and the iPXE ROM through it) then writes to the serial
        // port; the serial port goes to a file, the monitor nowhere.
        args.extend(
            [
                "-nographic",
                "-monitor",
                "none",
                "-no-reboot",
                "-netdev",
                "tap,id=n0,ifname=tap0,script=no,downscript=no",
                "-serial",
            ]
            .map(String::from),
        );
        args.push(format!("file:{}", serial.display()));
        let qemu_log = dir.join(format!("qemu-{fw:?}.log"));
        let qlog = std::fs::File::create(&qemu_log).unwrap();
        let mut cmd = app.lan.server.std_command(program);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(qlog.try_clone().unwrap())
            .stderr(qlog);
        let child = die_with_parent(&mut cmd).spawn().unwrap_or_else(|e| {
            panic!("cannot run {program}: {e} (install qemu-system-x86 / qemu-system-arm)")
        });
        Guest {
            child,
            serial,
            qemu_log,
            started: Instant::now(),
            _guard: guard,
        }
    }

    fn console(&self) -> String {
        readable(&std::fs::read(&self.serial).unwrap_or_default())
    }

    /// Waits until the console shows a whole line with `needle`; returns the console and the time
    /// since power-on. Panics (console shown by Drop) if QEMU exits or the deadline passes.
    fn wait_for(&mut self, needle: &str) -> (String, Duration) {
        let deadline = self.started + DEADLINE;
        let found = poll_blocking(deadline.saturating_duration_since(Instant::now()), || {
            if let Ok(Some(st)) = self.child.try_wait() {
                let qlog = std::fs::read_to_string(&self.qemu_log).unwrap_or_default();
                panic!("QEMU exited ({st}) before {needle:?}: {qlog}");
            }
            // The whole line: the console may be read mid-write.
            let c = self.console();
            let done = c.find(needle).is_some_and(|i| c[i..].contains('\n'));
            done.then_some(c)
        });
        let console = found
            .unwrap_or_else(|| panic!("no {needle:?} on the serial console within {DEADLINE:?}"));
        (console, self.started.elapsed())
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        reap(&mut self.child);
        if std::thread::panicking() {
            eprintln!(
                "---- serial console {} (tail) ----\n{}",
                self.serial.display(),
                tail(&self.console(), 80)
            );
        }
    }
}

/// Boots `fw` with `mac` until pxed's per-node script runs; checks the node pxed
/// registered and returns the console.
fn boot_to_script(app: &Appliance, fw: Firmware, mac: &str, arch: &str) -> String {
    let mut guest = Guest::boot(app, fw, mac);
    // iPXE came up, DHCPed as iPXE and was pointed at its per-node script...
    let url = format!("http://{}/boot/{mac}.ipxe", app.ip);
    let (_, at_dhcp) = guest.wait_for(&format!("Filename: {url}"));
    // ...which it ran.
    let (console, at_script) = guest.wait_for(&format!("pxed: {mac} "));
    eprintln!(
        "{fw:?}: iPXE got its script URL at {at_dhcp:.1?}, ran the script at {at_script:.1?}"
    );

    let node = app
        .node(mac)
        .unwrap_or_else(|| panic!("no node with {mac} in the API"));
    assert_eq!(node["state"], "discovered", "{node}");
    assert_eq!(node["arch"], arch, "{node}");
    // Registered as discovered (by DHCP or by the script fetch, whichever came first),
    // the script tells it so and exits to the next boot device.
    let said = console
        .lines()
        .find(|l| l.starts_with(&format!("pxed: {mac} ")))
        .unwrap();
    assert_eq!(
        said,
        format!("pxed: {mac} is known to pxed; no install is scheduled"),
        "script said {said:?}"
    );
    console
}

#[test]
fn ovmf_pxe_reaches_the_script_via_tftp_and_http() {
    let app = Appliance::start("qpxe", 93);
    let mac = "52:54:00:93:00:07";
    let console = boot_to_script(&app, Firmware::OvmfPxe, mac, "x86_64");
    assert!(
        console.contains("NBP filename is snponly.efi"),
        "{}",
        tail(&console, 60)
    );
    // EDK2 asks for tsize first and aborts (error 8); that transfer must not linger.
    let done = poll_blocking(Duration::from_secs(5), || {
        (app.metric("pxed_tftp_active_transfers") == Some(0.0)).then_some(())
    });
    assert!(
        done.is_some(),
        "a TFTP transfer is still active:\n{}",
        app.log()
    );
    assert!(app.metric("pxed_tftp_client_aborts_total") >= Some(1.0));
    assert_eq!(app.metric("pxed_tftp_completed_total"), Some(1.0));
}

#[test]
fn ovmf_http_boot_reaches_the_script() {
    let app = Appliance::start("qhttp", 94);
    let mac = "52:54:00:94:00:10";
    let console = boot_to_script(&app, Firmware::OvmfHttp, mac, "x86_64");
    // The firmware used the answer: option 60 HTTPClient echoed, full URL in option 67.
    let uri = format!("URI: http://{}/ipxe/snponly.efi", app.ip);
    assert!(console.contains(&uri), "{}", tail(&console, 60));
    assert!(!console.contains("Start PXE"), "{}", tail(&console, 60));
    assert_eq!(app.metric("pxed_tftp_requests_total"), Some(0.0));
}

#[test]
fn aavmf_arm64_pxe_reaches_the_script() {
    let app = Appliance::start("qarm", 95);
    let mac = "52:54:00:95:00:0b";
    let console = boot_to_script(&app, Firmware::AavmfPxe, mac, "arm64");
    assert!(
        console.contains("NBP filename is ipxe-arm64.efi"),
        "{}",
        tail(&console, 60)
    );
    let done = poll_blocking(Duration::from_secs(5), || {
        (app.metric("pxed_tftp_active_transfers") == Some(0.0)).then_some(())
    });
    assert!(done.is_some(), "a TFTP transfer is still active");
}

#[test]
fn seabios_ipxe_rom_reaches_the_script() {
    let app = Appliance::start("qbios", 96);
    let mac = "52:54:00:96:00:00";
    let console = boot_to_script(&app, Firmware::SeaBios, mac, "x86_64");
    // This ROM's iPXE (1.0.0 in bookworm) percent-encodes the colons of ${mac} in the
    // path; pxed must still find the node.
    let encoded = mac.replace(':', "%3A");
    let fetched = console
        .lines()
        .any(|l| l.ends_with(".ipxe... ok") && (l.contains(&encoded) || l.contains(mac)));
    assert!(fetched, "{}", tail(&console, 60));
    // The ROM is iPXE already: it goes straight to HTTP, no TFTP at all.
    assert_eq!(app.metric("pxed_tftp_requests_total"), Some(0.0));
}

/// Two pxed on one PostgreSQL database, both answering DHCP on the guest's LAN (A on
/// the bridge, B on a veth into it): OVMF boots to its script through whichever
/// answers first; that instance is killed with SIGKILL, and the same machine boots
/// again through the other, which knows it (one inventory).
#[test]
fn ovmf_pxe_boots_through_either_of_two_instances() {
    let cluster = store_pg::cluster::Cluster::shared();
    let (_, url) = cluster.new_database().unwrap();
    let migrate_dir = tempfile::tempdir().unwrap();
    let (ok, _, err) = super::common::run(
        Command::new(pxed_bin())
            .args(["migrate", "--data-dir"])
            .arg(migrate_dir.path())
            .env("PXED_DATABASE_URL", &url),
    );
    assert!(ok, "{err}");
    let env = [("PXED_DATABASE_URL", url.as_str())];
    let net = 97;
    let mut app = Appliance::start_with("qtwo", net, &env);
    let b_ip = Ipv4Addr::new(10, net, 0, 2);
    let i = app.lan.add_client("qtwob");
    let b_ns = &app.lan.clients[i];
    b_ns.ip(&["addr", "add", &format!("{b_ip}/24"), "dev", "eth0"]);
    let b_dir = tempfile::tempdir().unwrap();
    let mut b = spawn_pxed(b_ns, "eth0", b_ip, net, b_dir.path(), &env);
    let b_log = || std::fs::read_to_string(b_dir.path().join("pxed.log")).unwrap_or_default();
    let up = poll_blocking(Duration::from_secs(20), || {
        http_get(b_ns, b_ip, "/metrics")
            .ok()
            .filter(|(code, _)| *code == 200)
    });
    assert!(up.is_some(), "instance B did not come up:\n{}", b_log());

    let mac = "52:54:00:97:00:07";
    // The instance whose HTTP address iPXE was given, and the script it ran.
    let boot = |app: &Appliance| -> Ipv4Addr {
        // A fresh console: the second boot must not read the first one's lines.
        let _ = std::fs::remove_file(app.dir.path().join("serial-OvmfPxe.log"));
        let mut guest = Guest::boot(app, Firmware::OvmfPxe, mac);
        let (console, _) = guest.wait_for(&format!("/boot/{mac}.ipxe"));
        let url = console
            .lines()
            .find_map(|l| l.split("Filename: http://").nth(1))
            .unwrap_or_else(|| panic!("no script URL from DHCP:\n{}", tail(&console, 40)));
        let server: Ipv4Addr = url.split('/').next().unwrap().parse().unwrap();
        let (console, _) = guest.wait_for(&format!("pxed: {mac} "));
        assert!(
            console.contains(&format!(
                "pxed: {mac} is known to pxed; no install is scheduled"
            )),
            "{}",
            tail(&console, 40)
        );
        server
    };
    let first = boot(&app);
    eprintln!("first boot through {first}");
    // The one that served is killed; the other serves the second boot.
    let survivor = if first == app.ip {
        reap(&mut app.child);
        b_ip
    } else {
        assert_eq!(first, b_ip);
        reap(&mut b);
        app.ip
    };
    let second = boot(&app);
    assert_eq!(
        second, survivor,
        "the second boot went through the survivor"
    );
    let ns = if survivor == app.ip {
        &app.lan.server
    } else {
        &app.lan.clients[i]
    };
    let (code, body) = http_get(ns, survivor, "/api/v1/nodes").unwrap();
    assert_eq!(code, 200, "{body}");
    let nodes: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
    let with_mac: Vec<_> = nodes
        .iter()
        .filter(|n| {
            n["macs"]
                .as_array()
                .is_some_and(|m| m.iter().any(|x| x == mac))
        })
        .collect();
    assert_eq!(with_mac.len(), 1, "one node for the machine: {body}");
    assert_eq!(with_mac[0]["state"], "discovered");
    reap(&mut b);
}
