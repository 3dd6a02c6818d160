//! BMC drivers against real emulators: sushy-tools (`--fake`) for Redfish, OpenIPMI
//! `ipmi_sim` over lanplus for IPMI, and `tests/peers/bmc_fault_proxy.py` in front of
//! sushy to inject the faults real BMCs show. Each test starts its own emulators on free
//! loopback ports and kills them in Drop.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{poll, poll_blocking};
use pxed::bmc::{
    self, BmcEndpoint, BmcError, BootMode, BootTarget, CallPolicy, Credentials, Driver, NextBoot,
    OverrideEnabled, PowerState, Secret, TlsPolicy,
};

pub(crate) const PASSWORD: &str = "s3cret-Pa55word";
pub(crate) const NODE1: &str = "11111111-2222-3333-4444-555555555501"; // starts Off
pub(crate) const NODE2: &str = "11111111-2222-3333-4444-555555555502"; // starts On
const NODE2_MAC: &str = "52-54-00-12-34-57";

fn peers_dir() -> PathBuf {
    PathBuf::from(std::env::var("PEERS_DIR").unwrap_or_else(|_| "/tmp/pxed-peers".into()))
}

fn venv_bin(name: &str) -> PathBuf {
    let p = peers_dir().join("venv/bin").join(name);
    assert!(
        p.exists(),
        "{} missing: run .ci/install.sh (sushy-tools venv)",
        p.display()
    );
    p
}

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

pub(crate) fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_tcp(port: u16, what: &str, log: &Path) {
    let listening = || std::net::TcpStream::connect(("127.0.0.1", port)).ok();
    if poll_blocking(Duration::from_secs(30), listening).is_none() {
        panic!(
            "{what} did not listen on {port}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// sushy-emulator --fake with basic auth, two systems, its own state dir.
pub(crate) struct Sushy {
    _proc: Proc,
    port: u16,
    _dir: tempfile::TempDir,
    /// SHA-256 of the TLS certificate (lowercase hex) when started with TLS.
    fingerprint: Option<String>,
}

impl Sushy {
    pub(crate) fn start() -> Sushy {
        Self::start_with(false)
    }

    fn start_with(tls: bool) -> Sushy {
        Self::start_full(tls, None)
    }

    /// sushy-emulator inside network namespace `ns` (its loopback), for tests whose
    /// pxed runs there too.
    pub(crate) fn start_in(ns: &crate::netns::Netns) -> Sushy {
        Self::start_full(false, Some(ns))
    }

    fn start_full(tls: bool, ns: Option<&crate::netns::Netns>) -> Sushy {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let py = venv_bin("python3");
        let out = Command::new(&py)
            .args([
                "-c",
                &format!(
                    "import bcrypt;print('admin:'+bcrypt.hashpw(b'{PASSWORD}',bcrypt.gensalt(rounds=4)).decode())"
                ),
            ])
            .output()
            .expect("venv python");
        assert!(out.status.success(), "bcrypt: {out:?}");
        std::fs::write(d.join("htpasswd"), &out.stdout).unwrap();
        std::fs::create_dir_all(d.join("state")).unwrap();
        let port = free_tcp_port();
        let conf = format!(
            r#"SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'
SUSHY_EMULATOR_LISTEN_PORT = {port}
SUSHY_EMULATOR_AUTH_FILE = '{d}/htpasswd'
SUSHY_EMULATOR_STATE_DIR = '{d}/state'
SUSHY_EMULATOR_FAKE_SYSTEMS = [
    {{'uuid': '{NODE1}', 'name': 'node1', 'power_state': 'Off',
     'nics': [{{'mac': '52:54:00:12:34:56', 'ip': '10.99.0.150'}}]}},
    {{'uuid': '{NODE2}', 'name': 'node2', 'power_state': 'On',
     'nics': [{{'mac': '52:54:00:12:34:57', 'ip': '10.99.0.151'}}]}},
]
"#,
            d = d.display()
        );
        let mut conf = conf;
        let mut fingerprint = None;
        if tls {
            let st = Command::new("openssl")
                .args([
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                ])
                .args(["-nodes", "-days", "2", "-subj", "/CN=bmc.test", "-keyout"])
                .arg(d.join("key.pem"))
                .arg("-out")
                .arg(d.join("cert.pem"))
                .stderr(Stdio::null())
                .status()
                .expect("openssl");
            assert!(st.success());
            let out = Command::new("openssl")
                .args(["x509", "-noout", "-fingerprint", "-sha256", "-in"])
                .arg(d.join("cert.pem"))
                .output()
                .unwrap();
            let line = String::from_utf8(out.stdout).unwrap();
            let hex = line.split('=').nth(1).unwrap().trim().replace(':', "");
            fingerprint = Some(hex.to_ascii_lowercase());
            conf.push_str(&format!(
                "SUSHY_EMULATOR_SSL_CERT = '{}'\nSUSHY_EMULATOR_SSL_KEY = '{}'\n",
                d.join("cert.pem").display(),
                d.join("key.pem").display()
            ));
        }
        std::fs::write(d.join("sushy.conf"), conf).unwrap();
        let log = d.join("sushy.log");
        let mut cmd = match ns {
            Some(ns) => ns.std_command(venv_bin("sushy-emulator").to_str().unwrap()),
            None => Command::new(venv_bin("sushy-emulator")),
        };
        let child = cmd
            .arg("--config")
            .arg(d.join("sushy.conf"))
            .arg("--fake")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(d.join("sushy.err")).unwrap())
            .spawn()
            .expect("sushy-emulator");
        let proc = Proc(child);
        match ns {
            Some(ns) => {
                let err = d.join("sushy.err");
                ns.enter(move || wait_tcp(port, "sushy-emulator", &err));
            }
            None => wait_tcp(port, "sushy-emulator", &d.join("sushy.err")),
        }
        Sushy {
            _proc: proc,
            port,
            _dir: dir,
            fingerprint,
        }
    }

    /// The port it listens on (127.0.0.1).
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn url(&self) -> String {
        let scheme = if self.fingerprint.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }
}

/// tests/peers/bmc_fault_proxy.py in front of an upstream.
pub(crate) struct FaultProxy {
    _proc: Proc,
    port: u16,
}

impl FaultProxy {
    pub(crate) fn start(upstream: &str, faults: &str) -> FaultProxy {
        Self::start_full(upstream, faults, None, "")
    }

    /// The proxy inside network namespace `ns`; `on_netboot` is its `--on-netboot`.
    pub(crate) fn start_in(
        ns: &crate::netns::Netns,
        upstream: &str,
        faults: &str,
        on_netboot: &str,
    ) -> FaultProxy {
        Self::start_full(upstream, faults, Some(ns), on_netboot)
    }

    fn start_full(
        upstream: &str,
        faults: &str,
        ns: Option<&crate::netns::Netns>,
        on_netboot: &str,
    ) -> FaultProxy {
        let mut cmd = match ns {
            Some(ns) => ns.std_command(venv_bin("python3").to_str().unwrap()),
            None => Command::new(venv_bin("python3")),
        };
        let mut child = cmd
            .arg(repo_file("tests/peers/bmc_fault_proxy.py"))
            .args(["--upstream", upstream, "--faults", faults])
            .args(["--on-netboot", on_netboot])
            .stdout(Stdio::piped())
            // The namespace tests' lying BMC says what it booted (the test's output).
            .stderr(if ns.is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("fault proxy");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("proxy said {line:?}"));
        FaultProxy {
            _proc: Proc(child),
            port,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub(crate) fn stats(&self) -> serde_json::Value {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            s,
            "GET /_proxy/stats HTTP/1.0\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        let body = buf.split("\r\n\r\n").nth(1).unwrap();
        serde_json::from_str(body).unwrap()
    }
}

/// OpenIPMI ipmi_sim on a free UDP port, lanplus, admin/PASSWORD, hook-driven chassis.
pub(crate) struct IpmiSim {
    _proc: Proc,
    pub(crate) port: u16,
    dir: tempfile::TempDir,
}

impl IpmiSim {
    pub(crate) fn start() -> IpmiSim {
        Self::start_with_fru(None)
    }

    /// ipmi_sim whose FRU device 0 holds `fru` (its bytes, zero-padded to 256).
    fn start_with_fru(fru: Option<&[u8]>) -> IpmiSim {
        assert!(
            Command::new("ipmi_sim").arg("--version").output().is_ok(),
            "ipmi_sim missing: apt-get install openipmi"
        );
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let port = free_udp_port();
        let hook = repo_file("tests/peers/bmc_ipmi_chassis_hook.sh");
        std::fs::create_dir_all(d.join("state")).unwrap();
        std::fs::create_dir_all(d.join("chassis")).unwrap();
        let conf = format!(
            r#"name "pxebmc"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 {port}
    priv_limit admin
    allowed_auths_callback none md2 md5 straight
    allowed_auths_user none md2 md5 straight
    allowed_auths_operator none md2 md5 straight
    allowed_auths_admin none md2 md5 straight
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "{hook} {chassis} 0x20"
  user 1 true  ""      "test"     user  10 none md2 md5 straight
  user 2 true  "admin" "{PASSWORD}" admin 10 none md2 md5 straight
"#,
            hook = hook.display(),
            chassis = d.join("chassis").display()
        );
        std::fs::write(d.join("lan.conf"), conf).unwrap();
        let mut emu = String::from(
            "mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr\nsel_enable 0x20 1000 0x0a\n",
        );
        if let Some(fru) = fru {
            let mut image = fru.to_vec();
            image.resize(256, 0);
            std::fs::write(d.join("fru0.bin"), image).unwrap();
            emu.push_str(&format!(
                "mc_add_fru_data 0x20 0 256 file 0 \"{}\"\n",
                d.join("fru0.bin").display()
            ));
        }
        emu.push_str("mc_enable 0x20\n");
        std::fs::write(d.join("bmc.emu"), emu).unwrap();
        let child = Command::new("ipmi_sim")
            .arg("-c")
            .arg(d.join("lan.conf"))
            .arg("-f")
            .arg(d.join("bmc.emu"))
            .arg("-s")
            .arg(d.join("state"))
            .arg("-n")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(d.join("sim.log")).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("ipmi_sim");
        IpmiSim {
            _proc: Proc(child),
            port,
            dir,
        }
    }

    pub(crate) fn dir_path(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn chassis_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("chassis/chassis.log")).unwrap_or_default()
    }

    fn fault(&self, name: &str) {
        std::fs::write(self.dir.path().join("chassis").join(name), "").unwrap();
    }

    fn power_file(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("chassis/power"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    fn endpoint(&self, password: &str, policy: CallPolicy) -> BmcEndpoint {
        endpoint(
            Driver::Ipmi,
            format!("127.0.0.1:{}", self.port),
            password,
            policy,
        )
    }

    /// Waits until the simulator answers a session (it takes a moment to bind).
    pub(crate) async fn ready(&self) {
        let ep = self.endpoint(PASSWORD, fault_policy());
        let mut last = None;
        let answered = async || match bmc::connect(&ep).unwrap().power_state().await {
            Ok(_) => Some(()),
            Err(e) => {
                last = Some(e);
                None
            }
        };
        if poll(Duration::from_secs(15), answered).await.is_none() {
            panic!("ipmi_sim never answered: {last:?}");
        }
    }
}

fn endpoint(driver: Driver, address: String, password: &str, policy: CallPolicy) -> BmcEndpoint {
    BmcEndpoint {
        driver,
        address,
        username: "admin".into(),
        password: Secret::new(password),
        system_id: None,
        match_mac: None,
        match_uuid: None,
        tls: TlsPolicy::Pinned(None),
        policy,
    }
}

/// Long enough for sushy (power lands 1–11 s late) and ipmi_sim.
fn real_policy() -> CallPolicy {
    CallPolicy {
        request_timeout: Duration::from_secs(5),
        retries: 1,
        backoff: Duration::from_millis(100),
        override_attempts: 2,
        power_deadline: Duration::from_secs(40),
        restart_observe: Duration::from_secs(15),
        poll_interval: Duration::from_millis(300),
    }
}

/// Small bounds so faults end fast; tests assert the error arrives within them.
fn fault_policy() -> CallPolicy {
    CallPolicy {
        request_timeout: Duration::from_millis(800),
        retries: 1,
        backoff: Duration::from_millis(50),
        override_attempts: 2,
        power_deadline: Duration::from_secs(3),
        restart_observe: Duration::from_secs(1),
        poll_interval: Duration::from_millis(200),
    }
}

/// Upper bound on how long a failing call may take under `fault_policy`.
const FAULT_BUDGET: Duration = Duration::from_secs(8);

fn assert_no_secret(s: &str) {
    assert!(!s.contains(PASSWORD), "password leaked: {s}");
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_happy_path_find_by_mac_set_pxe_and_cycle() {
    let sushy = Sushy::start();
    let mut ep = endpoint(Driver::Redfish, sushy.url(), PASSWORD, real_policy());
    ep.match_mac = Some(NODE2_MAC.into());
    let b = bmc::connect(&ep).unwrap();
    assert_eq!(b.power_state().await.unwrap(), PowerState::On);
    let got = b.set_next_boot(NextBoot::pxe_once()).await.unwrap();
    assert_eq!(got.target, "Pxe");
    assert_ne!(got.enabled, OverrideEnabled::Disabled);
    assert_eq!(got.mode, Some(BootMode::Uefi));
    let read = b.boot_override().await.unwrap();
    assert_eq!(read.target, "Pxe");
    let t = Instant::now();
    b.power_cycle().await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(41));
    assert_eq!(b.power_state().await.unwrap(), PowerState::On);
    // sushy keeps every override (reads it back Continuous): after the netboot pxed
    // takes it away; `Enabled: Disabled` alone is refused (400), so with a disk target.
    let kept = b.boot_override().await.unwrap();
    assert!(kept.boots_network(), "{kept}");
    let cleared = b.clear_boot_override().await.unwrap();
    assert!(!cleared.boots_network(), "{cleared}");
    assert_eq!(b.boot_override().await.unwrap().target, "Hdd");
    // Nothing left to clear: only read.
    assert_eq!(b.clear_boot_override().await.unwrap(), cleared);
    // node1 was not touched: the MAC picked node2
    let mut ep1 = endpoint(Driver::Redfish, sushy.url(), PASSWORD, real_policy());
    ep1.system_id = Some(NODE1.into());
    let b1 = bmc::connect(&ep1).unwrap();
    assert_eq!(b1.boot_override().await.unwrap().target, "Hdd");
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_sessions_etag_and_powercycle_501_fallback() {
    let sushy = Sushy::start();
    let proxy = FaultProxy::start(&sushy.url(), "sessions,etag,advertise-powercycle");
    let mut ep = endpoint(Driver::Redfish, proxy.url(), PASSWORD, real_policy());
    ep.match_uuid = Some(NODE2.to_uppercase());
    let b = bmc::connect(&ep).unwrap();
    // sushy --fake cannot store HttpBootUri: a field the BMC rejects fails loudly, typed
    let e = b
        .set_next_boot(NextBoot {
            target: BootTarget::UefiHttp {
                url: format!("{}/_proxy/stats", proxy.url()),
            },
            mode: BootMode::Uefi,
            once: true,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(e, BmcError::Protocol { status: Some(400), ref message, .. } if message.contains("HttpBootUri")),
        "{e:?}"
    );
    let got = b.set_next_boot(NextBoot::pxe_once()).await.unwrap();
    assert_eq!(got.target, "Pxe");
    b.power_cycle().await.unwrap();
    b.close().await;
    let s = proxy.stats();
    assert_eq!(s["logins"], 1, "{s}");
    assert_eq!(s["logouts"], 1, "{s}");
    // every PATCH carried the ETag of the GET before it
    let im = s["if_match"].as_array().unwrap();
    assert_eq!(im.len(), 2, "{s}");
    // (the proxy answers 412 to a PATCH whose If-Match is not the current ETag)
    assert!(
        im.iter()
            .all(|t| t.as_str().is_some_and(|t| t.starts_with("W/"))),
        "{s}"
    );
    // PowerCycle advertised, sushy answers 501, the driver falls back to ForceRestart
    assert_eq!(
        s["resets"],
        serde_json::json!(["PowerCycle", "ForceRestart"]),
        "{s}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_off_node_is_powered_on_and_power_off_observed() {
    let sushy = Sushy::start();
    let mut ep = endpoint(Driver::Redfish, sushy.url(), PASSWORD, real_policy());
    ep.system_id = Some(NODE1.into());
    let b = bmc::connect(&ep).unwrap();
    assert_eq!(b.power_state().await.unwrap(), PowerState::Off);
    b.power_cycle().await.unwrap();
    assert_eq!(b.power_state().await.unwrap(), PowerState::On);
    b.power_off().await.unwrap();
    assert_eq!(b.power_state().await.unwrap(), PowerState::Off);
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_check_report() {
    let sushy = Sushy::start();
    let mut ep = endpoint(Driver::Redfish, sushy.url(), PASSWORD, real_policy());
    ep.system_id = Some(NODE2.into());
    let r = bmc::check(&ep).await.unwrap();
    assert!(matches!(r.credentials, Credentials::Accepted { ref how } if how.contains("basic")));
    for t in ["On", "ForceOff", "ForceRestart"] {
        assert!(r.reset_types.iter().any(|x| x == t), "{r:?}");
    }
    assert!(!r.reset_types.iter().any(|x| x == "PowerCycle"));
    assert_eq!(r.boot_targets, ["Pxe", "Cd", "Hdd", "UefiHttp"]);
    assert_eq!(r.power, Some(PowerState::On));
    let text = r.to_string();
    assert!(text.contains("credentials:  OK"), "{text}");
    assert!(
        text.contains("boot targets: Pxe, Cd, Hdd, UefiHttp"),
        "{text}"
    );
    assert!(text.contains("power cycle:  ForceRestart"), "{text}");
    assert!(text.contains("PowerCycle not offered"), "{text}");
    println!("{text}");

    let mut bad = ep.clone();
    bad.password = Secret::new("wrong-password");
    let r = bmc::check(&bad).await.unwrap();
    assert!(
        matches!(r.credentials, Credentials::Refused { .. }),
        "{r:?}"
    );
    let text = r.to_string();
    assert!(text.contains("REFUSED"), "{text}");
    assert!(!text.contains("boot targets"), "{text}");

    let proxy = FaultProxy::start(&sushy.url(), "sessions");
    let mut ep2 = ep.clone();
    ep2.address = proxy.url();
    let r = bmc::check(&ep2).await.unwrap();
    assert!(r.to_string().contains("credentials:  OK (session"), "{r}");
    let mut bad2 = ep2.clone();
    bad2.password = Secret::new("wrong-password");
    let r = bmc::check(&bad2).await.unwrap();
    assert!(
        matches!(r.credentials, Credentials::Refused { ref message } if message.contains("Invalid username")),
        "{r:?}"
    );
}

/// The out-of-band inventory walk against sushy-tools: what its fake driver serves
/// (system, chassis, Ethernet interfaces) is read; what it lacks (Processors 501,
/// Storage 500, Memory and FirmwareInventory 404) is "not reported", not an error.
#[tokio::test(flavor = "multi_thread")]
async fn redfish_inventory_from_sushy() {
    let sushy = Sushy::start();
    let mut ep = endpoint(Driver::Redfish, sushy.url(), PASSWORD, real_policy());
    ep.match_mac = Some(NODE2_MAC.into());
    let b = bmc::connect(&ep).unwrap();
    let started = Instant::now();
    let inv = b
        .inventory()
        .await
        .unwrap()
        .expect("the Redfish driver reports an inventory");
    b.close().await;
    println!("sushy inventory in {:?}: {inv:?}", started.elapsed());
    assert_eq!(inv.system.vendor, "Sushy Emulator");
    // No Model or SerialNumber on sushy's system: taken from its chassis.
    assert_eq!(inv.system.model, "3500RX");
    assert_eq!(inv.system.serial, "437XR1138R2");
    assert_eq!(inv.nics.len(), 1, "{:?}", inv.nics);
    assert_eq!(inv.nics[0].mac, "52:54:00:12:34:57");
    assert_eq!(inv.nics[0].name, "52:54:00:12:34:57");
    assert_eq!(inv.cpu, Default::default());
    assert_eq!((inv.memory_mib, inv.arch), (0, None));
    assert!(inv.pci.is_empty() && inv.disks.is_empty() && inv.firmware.is_empty());
    // Against a baseline with more in it, what sushy does not report is no change.
    let mut baseline = inv.clone();
    baseline.memory_mib = 4096;
    baseline.firmware.insert("bios".into(), "1.0".into());
    assert!(pxed::inventory::diff(&baseline, &inv).is_empty());
}

/// The real FRU dump of a Quanta-built Qumulo server (`tests/fixtures/ipmi/`), served
/// by ipmi_sim as FRU device 0 and read over lanplus with Get FRU Inventory Area Info
/// and Read FRU Data; a simulator without FRU data gives no inventory, not an error.
#[tokio::test(flavor = "multi_thread")]
async fn ipmi_inventory_from_fru() {
    let hex = std::fs::read_to_string(repo_file(
        "tests/fixtures/ipmi/quanta-qct-sd1q-1ulh.fru.hex",
    ))
    .unwrap();
    let fru: Vec<u8> = hex
        .lines()
        .filter(|l| !l.starts_with('#'))
        .flat_map(str::split_whitespace)
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    let sim = IpmiSim::start_with_fru(Some(&fru));
    sim.ready().await;
    let b = bmc::connect(&sim.endpoint(PASSWORD, real_policy())).unwrap();
    let started = Instant::now();
    let inv = b.inventory().await.unwrap().expect("FRU inventory");
    println!("FRU inventory in {:?}: {:?}", started.elapsed(), inv.system);
    assert_eq!(inv.system.vendor, "Qumulo");
    assert_eq!(inv.system.model, "QK-Series 1U");
    assert_eq!(inv.system.serial, "S0501825Q007");
    assert!(inv.pci.is_empty() && inv.firmware.is_empty() && inv.memory_mib == 0);
    b.close().await;

    let bare = IpmiSim::start();
    bare.ready().await;
    let b = bmc::connect(&bare.endpoint(PASSWORD, real_policy())).unwrap();
    assert_eq!(b.inventory().await.unwrap(), None);
    b.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_tls_pinned_on_first_use_then_enforced() {
    let sushy = Sushy::start_with(true);
    let want = sushy.fingerprint.clone().unwrap();
    let mut ep = endpoint(Driver::Redfish, sushy.url(), PASSWORD, fault_policy());
    ep.system_id = Some(NODE2.into());
    // first use: accepted, fingerprint reported for the caller to store
    let b = bmc::connect(&ep).unwrap();
    assert_eq!(b.power_state().await.unwrap(), PowerState::On);
    assert_eq!(b.tls_fingerprint().as_deref(), Some(want.as_str()));
    let r = bmc::check(&ep).await.unwrap();
    assert!(
        r.to_string().contains(&format!("tls sha256:   {want}")),
        "{r}"
    );
    // pinned (in openssl's colon format): accepted
    let colons: Vec<String> = want
        .as_bytes()
        .chunks(2)
        .map(|c| String::from_utf8(c.to_vec()).unwrap().to_uppercase())
        .collect();
    ep.tls = TlsPolicy::Pinned(Some(colons.join(":")));
    assert_eq!(
        bmc::connect(&ep).unwrap().power_state().await.unwrap(),
        PowerState::On
    );
    // another pin: refused, naming both fingerprints, not retried into a timeout
    let other = "ab".repeat(32);
    ep.tls = TlsPolicy::Pinned(Some(other.clone()));
    let t = Instant::now();
    let e = bmc::connect(&ep).unwrap().power_state().await.unwrap_err();
    match &e {
        BmcError::CertificateMismatch {
            pinned, presented, ..
        } => {
            assert_eq!(pinned, &other);
            assert_eq!(presented, &want);
        }
        e => panic!("{e:?}"),
    }
    assert!(e.to_string().contains(&want) && e.to_string().contains(&other));
    assert!(t.elapsed() < FAULT_BUDGET);
    // explicit lab opt-out
    ep.tls = TlsPolicy::Insecure;
    let r = bmc::check(&ep).await.unwrap();
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("TLS verification disabled")),
        "{r}"
    );
}

/// The BMC a fault case talks to.
#[derive(Clone, Copy)]
pub(crate) enum Peer {
    /// Nothing listens at the address (a free port).
    Silent(Driver),
    /// sushy-tools itself.
    Sushy,
    /// sushy-tools behind `bmc_fault_proxy.py` with these faults.
    Proxy(&'static str),
    /// ipmi_sim, with this fault file dropped in its chassis dir.
    IpmiSim(Option<&'static str>),
}

/// A started [`Peer`]: its address, and the processes that must outlive its use.
pub(crate) struct Running {
    pub(crate) driver: Driver,
    pub(crate) address: String,
    pub(crate) proxy: Option<FaultProxy>,
    _sim: Option<IpmiSim>,
}

impl Peer {
    /// Starts the peer (`sushy` is the upstream of `Sushy` and `Proxy`).
    pub(crate) async fn start(self, sushy: Option<&Sushy>) -> Running {
        let sushy_url = || sushy.expect("this peer needs sushy").url();
        let (mut proxy, mut sim) = (None, None);
        let (driver, address) = match self {
            Peer::Silent(Driver::Redfish) => (
                Driver::Redfish,
                format!("http://127.0.0.1:{}", free_tcp_port()),
            ),
            Peer::Silent(Driver::Ipmi) => (Driver::Ipmi, format!("127.0.0.1:{}", free_udp_port())),
            Peer::Sushy => (Driver::Redfish, sushy_url()),
            Peer::Proxy(faults) => {
                let p = proxy.insert(FaultProxy::start(&sushy_url(), faults));
                (Driver::Redfish, p.url())
            }
            Peer::IpmiSim(fault) => {
                let s = sim.insert(IpmiSim::start());
                s.ready().await;
                if let Some(f) = fault {
                    s.fault(f);
                }
                (Driver::Ipmi, format!("127.0.0.1:{}", s.port))
            }
        };
        Running {
            driver,
            address,
            proxy,
            _sim: sim,
        }
    }

    /// Whether it runs in front of (or is) sushy.
    pub(crate) fn needs_sushy(self) -> bool {
        matches!(self, Peer::Sushy | Peer::Proxy(_))
    }
}

/// Which Redfish system the endpoint selects.
#[derive(Clone, Copy)]
enum Select {
    Any,
    Id(&'static str),
    Mac(&'static str),
}

/// The driver call a fault case makes.
#[derive(Clone, Copy, Debug)]
enum Call {
    PowerState,
    SetPxe,
    SetUefiHttp,
    PowerCycle,
}

/// One fault: where, what is called, and the typed error it must end in, under
/// `fault_policy()` and within `FAULT_BUDGET`, with no password in its text or Debug.
struct Fault {
    name: &'static str,
    peer: Peer,
    password: &'static str,
    select: Select,
    call: Call,
    /// `BmcError::kind()`.
    kind: &'static str,
    /// Substrings of the error's text.
    says: &'static [&'static str],
    /// Substrings the error's text must not have.
    never_says: &'static [&'static str],
    /// What the fault proxy saw: PATCHes and the resets it was sent.
    proxy_saw: Option<(u64, &'static [&'static str])>,
}

/// What a case does not say otherwise: sushy, the right password, any system.
const BASE: Fault = Fault {
    name: "",
    peer: Peer::Sushy,
    password: PASSWORD,
    select: Select::Any,
    call: Call::PowerState,
    kind: "",
    says: &[],
    never_says: &[],
    proxy_saw: None,
};

const REDFISH_FAULTS: &[Fault] = &[
    Fault {
        name: "not listening",
        peer: Peer::Silent(Driver::Redfish),
        call: Call::SetPxe,
        kind: "unreachable",
        says: &["unreachable during login", "Connection refused"],
        ..BASE
    },
    Fault {
        name: "wrong password",
        peer: Peer::Sushy,
        password: "wrong-password",
        call: Call::PowerCycle,
        kind: "auth_refused",
        says: &["refused the credentials", "HTTP 401"],
        ..BASE
    },
    // A 500 is retried (retries = 1), then reported with the BMC's message.
    Fault {
        name: "PATCH answers 500",
        peer: Peer::Proxy("patch500"),
        select: Select::Id(NODE2),
        call: Call::SetPxe,
        kind: "protocol",
        says: &["(status 500)", "Internal error while applying"],
        proxy_saw: Some((2, &[])),
        ..BASE
    },
    // 2xx and ignored: read back, written again, then named with what reads back.
    Fault {
        name: "PATCH ignored",
        peer: Peer::Proxy("ignore-patch"),
        select: Select::Id(NODE2),
        call: Call::SetPxe,
        kind: "override_not_applied",
        says: &["after 2 attempts", "reads back target=Hdd"],
        proxy_saw: Some((2, &[])),
        ..BASE
    },
    // NODE1 is Off: power_cycle powers it on, and the dropped reset leaves it Off.
    Fault {
        name: "reset acknowledged, never lands",
        peer: Peer::Proxy("reset-noop"),
        select: Select::Id(NODE1),
        call: Call::PowerCycle,
        kind: "power_did_not_change",
        says: &["acknowledged On but power stayed Off"],
        proxy_saw: Some((0, &["On"])),
        ..BASE
    },
    Fault {
        name: "no system has the MAC",
        peer: Peer::Sushy,
        select: Select::Mac("02:00:00:00:00:99"),
        call: Call::PowerState,
        kind: "system_not_found",
        says: &["02:00:00:00:00:99", NODE1, NODE2],
        ..BASE
    },
    Fault {
        name: "two systems, none chosen",
        peer: Peer::Sushy,
        select: Select::Any,
        call: Call::PowerState,
        kind: "system_ambiguous",
        says: &["lists 2 systems", "--system-id", NODE1, NODE2],
        ..BASE
    },
];

const IPMI_FAULTS: &[Fault] = &[
    Fault {
        name: "not listening",
        peer: Peer::Silent(Driver::Ipmi),
        call: Call::PowerState,
        kind: "unreachable",
        says: &["unreachable during"],
        ..BASE
    },
    Fault {
        name: "wrong password",
        peer: Peer::IpmiSim(None),
        password: "wrong-password",
        call: Call::PowerCycle,
        kind: "auth_refused",
        says: &["refused the credentials"],
        ..BASE
    },
    Fault {
        name: "chassis control never lands",
        peer: Peer::IpmiSim(Some("fault-power-stuck")),
        call: Call::PowerCycle,
        kind: "power_did_not_change",
        says: &["power stayed Off"],
        ..BASE
    },
    Fault {
        name: "boot flags ignored",
        peer: Peer::IpmiSim(Some("fault-boot-ignored")),
        call: Call::SetPxe,
        kind: "override_not_applied",
        says: &[
            "after 2 attempts",
            "wanted target=Pxe",
            "reads back target=",
        ],
        never_says: &["reads back target=Pxe"],
        ..BASE
    },
    // Refused before any I/O: IPMI has no HTTP boot device.
    Fault {
        name: "UEFI HTTP boot",
        peer: Peer::Silent(Driver::Ipmi),
        call: Call::SetUefiHttp,
        kind: "not_supported",
        says: &["UEFI HTTP boot"],
        ..BASE
    },
];

/// Runs every case against its own peer (one sushy shared: no case changes its state).
async fn run_faults(cases: &[Fault]) {
    let sushy = cases
        .iter()
        .any(|c| c.peer.needs_sushy())
        .then(Sushy::start);
    for c in cases {
        let name = c.name;
        let peer = c.peer.start(sushy.as_ref()).await;
        let driver = peer.driver;
        let mut ep = endpoint(driver, peer.address.clone(), c.password, fault_policy());
        match c.select {
            Select::Any => {}
            Select::Id(id) => ep.system_id = Some(id.into()),
            Select::Mac(mac) => ep.match_mac = Some(mac.into()),
        }
        let b = bmc::connect(&ep).unwrap();
        let t = Instant::now();
        let r = match c.call {
            Call::PowerState => b.power_state().await.map(|_| ()),
            Call::SetPxe => b.set_next_boot(NextBoot::pxe_once()).await.map(|_| ()),
            Call::SetUefiHttp => b
                .set_next_boot(NextBoot {
                    target: BootTarget::UefiHttp {
                        url: "http://x/".into(),
                    },
                    mode: BootMode::Uefi,
                    once: true,
                })
                .await
                .map(|_| ()),
            Call::PowerCycle => b.power_cycle().await,
        };
        let took = t.elapsed();
        let e = r.expect_err(name);
        let text = e.to_string();
        println!(
            "{driver} {name}: {:?} -> [{}] {text} ({took:?})",
            c.call,
            e.kind()
        );
        assert_eq!(e.kind(), c.kind, "{name}: {e:?}");
        assert_eq!(e.driver(), driver, "{name}: {e:?}");
        for s in c.says {
            assert!(text.contains(s), "{name}: {text:?} lacks {s:?}");
        }
        for s in c.never_says {
            assert!(!text.contains(s), "{name}: {text:?} has {s:?}");
        }
        assert!(took < FAULT_BUDGET, "{name}: took {took:?}");
        for secret in [PASSWORD, c.password] {
            assert!(!format!("{e} {e:?}").contains(secret), "{name}: {e:?}");
        }
        if let Some((patches, resets)) = c.proxy_saw {
            let s = peer.proxy.as_ref().unwrap().stats();
            assert_eq!(s["patches"], patches, "{name}: {s}");
            assert_eq!(s["resets"], serde_json::json!(resets), "{name}: {s}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_faults_end_typed() {
    run_faults(REDFISH_FAULTS).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ipmi_faults_end_typed() {
    run_faults(IPMI_FAULTS).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets_never_in_debug_or_errors() {
    let ep = endpoint(
        Driver::Redfish,
        format!("http://127.0.0.1:{}", free_tcp_port()),
        PASSWORD,
        fault_policy(),
    );
    assert_no_secret(&format!("{ep:?}"));
    let b = bmc::connect(&ep).unwrap();
    assert_no_secret(&format!("{b:?}"));
    let e = b.power_state().await.unwrap_err();
    assert_no_secret(&format!("{e} {e:?}"));
    let mut ip = ep.clone();
    ip.driver = Driver::Ipmi;
    ip.address = format!("127.0.0.1:{}", free_udp_port());
    let b = bmc::connect(&ip).unwrap();
    assert_no_secret(&format!("{b:?}"));
    let e = b.power_state().await.unwrap_err();
    assert_no_secret(&format!("{e} {e:?}"));
}

#[tokio::test(flavor = "multi_thread")]
async fn ipmi_happy_path_set_pxe_and_cycle() {
    let sim = IpmiSim::start();
    sim.ready().await;
    let b = bmc::connect(&sim.endpoint(PASSWORD, real_policy())).unwrap();
    assert_eq!(b.power_state().await.unwrap(), PowerState::Off);
    let got = b.set_next_boot(NextBoot::pxe_once()).await.unwrap();
    assert_eq!(got.target, "Pxe");
    assert_eq!(b.boot_override().await.unwrap().target, "Pxe");
    // Cleared (valid bit off, no device), read back, and set again for the cycle.
    let cleared = b.clear_boot_override().await.unwrap();
    assert!(!cleared.boots_network(), "{cleared}");
    b.set_next_boot(NextBoot::pxe_once()).await.unwrap();
    b.power_on().await.unwrap();
    assert_eq!(sim.power_file(), "1");
    let t = Instant::now();
    b.power_cycle().await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(41));
    assert_eq!(b.power_state().await.unwrap(), PowerState::On);
    let log = std::fs::read_to_string(sim.dir.path().join("chassis/chassis.log")).unwrap();
    // ipmi_sim cycles asynchronously: off, then on about a second later
    let sets: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("set power"))
        .map(|l| l.rsplit(' ').next().unwrap())
        .collect();
    assert_eq!(sets, ["1", "0", "1"], "{log}");
    b.power_off().await.unwrap();
    assert_eq!(sim.power_file(), "0");
}

#[tokio::test(flavor = "multi_thread")]
async fn ipmi_check_report() {
    let sim = IpmiSim::start();
    sim.ready().await;
    let r = bmc::check(&sim.endpoint(PASSWORD, real_policy()))
        .await
        .unwrap();
    assert!(
        matches!(r.credentials, Credentials::Accepted { ref how } if how.contains("cipher suite 3"))
    );
    assert!(r.reset_types.iter().any(|x| x == "PowerCycle"));
    assert_eq!(r.boot_targets, ["Pxe"]);
    assert_eq!(r.power, Some(PowerState::Off));
    let text = r.to_string();
    assert!(text.contains("identity:     IPMI 2.0"), "{text}");
    assert!(text.contains("credentials:  OK"), "{text}");
    println!("{text}");
    let r = bmc::check(&sim.endpoint("wrong-password", fault_policy()))
        .await
        .unwrap();
    assert!(
        matches!(r.credentials, Credentials::Refused { .. }),
        "{r:?}"
    );
    assert!(r.to_string().contains("REFUSED"));
}

/// `pxed bmc check <node>` from anywhere, knowing only the server's URL and token: the
/// running server checks the BMC it has registered (against both emulators) and
/// answers with what the BMC advertises, never the password; a refusal exits non-zero.
#[tokio::test(flavor = "multi_thread")]
async fn cli_bmc_check_through_the_api() {
    use crate::common::{Daemon, pxed_bin, run};
    let sushy = Sushy::start();
    let sim = IpmiSim::start();
    sim.ready().await;
    let d = Daemon::start_in(
        tempfile::tempdir().unwrap(),
        &[],
        &[("PXED_API_TOKEN", "cli-token")],
    );
    let register = |name: &str, bmc: serde_json::Value, mac: &str| {
        let body = serde_json::json!({"name": name, "macs": [mac], "bmc": bmc}).to_string();
        let (ok, out, err) = run(Command::new("curl").args([
            "-sSf",
            "-H",
            "Authorization: Bearer cli-token",
            "-H",
            "Content-Type: application/json",
            "-d",
            &body,
            &d.url("/api/v1/nodes"),
        ]));
        assert!(ok, "{out}{err}");
        assert!(
            !out.contains(PASSWORD),
            "the API never returns the BMC password: {out}"
        );
    };
    register(
        "rf1",
        serde_json::json!({"driver": "redfish", "address": sushy.url(), "username": "admin",
                           "password": PASSWORD, "system_id": NODE2}),
        "52:54:00:00:10:01",
    );
    register(
        "ipmi1",
        serde_json::json!({"driver": "ipmi", "address": format!("127.0.0.1:{}", sim.port),
                           "username": "admin", "password": PASSWORD}),
        "52:54:00:00:10:02",
    );
    register(
        "rf-bad",
        serde_json::json!({"driver": "redfish", "address": sushy.url(), "username": "admin",
                           "password": "wrong-password", "system_id": NODE2}),
        "52:54:00:00:10:03",
    );
    // Somewhere with no config and no data dir: only --url and the token file lead
    // to the node.
    let elsewhere = tempfile::tempdir().unwrap();
    let token = elsewhere.path().join("token");
    std::fs::write(&token, "cli-token\n").unwrap();
    let check = |args: &[&str]| {
        let (ok, out, err) = run(Command::new(pxed_bin())
            .current_dir(elsewhere.path())
            .args(["bmc", "check"])
            .args(args)
            .arg("--url")
            .arg(d.url(""))
            .arg("--token-file")
            .arg(&token)
            .env_remove("PXED_URL")
            .env_remove("PXED_API_TOKEN"));
        let all = format!("{out}{err}");
        assert!(
            !all.contains(PASSWORD) && !all.contains("wrong-password"),
            "{all}"
        );
        (ok, out, err)
    };

    let (ok, out, err) = check(&["rf1"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("BMC redfish at http://127.0.0.1:"), "{out}");
    assert!(out.contains("as admin"), "{out}");
    assert!(out.contains("credentials:  OK (basic"), "{out}");
    assert!(
        out.contains(&format!("system:       /redfish/v1/Systems/{NODE2}")),
        "{out}"
    );
    assert!(out.contains("power:        On"), "{out}");
    assert!(
        out.contains("boot targets: Pxe, Cd, Hdd, UefiHttp"),
        "{out}"
    );
    assert!(out.contains("power cycle:  ForceRestart"), "{out}");

    // --json is the API's own type.
    let (ok, out, err) = check(&["52-54-00-00-10-01", "--json"]);
    assert!(ok, "{out}{err}");
    let v: pxed::wire::BmcCheck = serde_json::from_str(&out).unwrap();
    assert_eq!(v.bmc.username, "admin");
    assert_eq!(v.report.driver, Driver::Redfish);
    assert_eq!(v.report.power, Some(PowerState::On));
    assert_eq!(v.report.boot_targets, ["Pxe", "Cd", "Hdd", "UefiHttp"]);
    assert!(v.report.reset_types.iter().any(|r| r == "ForceRestart"));

    let (ok, out, err) = check(&["ipmi1"]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("credentials:  OK (RMCP+ cipher suite 3"),
        "{out}"
    );
    assert!(out.contains("identity:     IPMI 2.0"), "{out}");
    assert!(out.contains("power:        Off"), "{out}");
    assert!(out.contains("PowerCycle"), "{out}");

    let (ok, out, err) = check(&["rf-bad"]);
    assert!(!ok, "{out}{err}");
    assert!(out.contains("REFUSED"), "{out}");
    assert!(err.contains("refused the credentials"), "{err}");
}
