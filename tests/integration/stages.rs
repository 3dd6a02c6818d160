//! Stages from the wire, end to end: the real `pxed` binary with full DHCP on `br0` of
//! a namespace, its node's BMC a real sushy-tools Redfish emulator, and the node itself
//! real clients in its own namespace doing what a netbooting machine does in order:
//! busybox udhcpc as the firmware's PXE DHCP, curl's TFTP client fetching the first
//! stage, udhcpc again as iPXE (user class `iPXE`), curl fetching the script, kernel and
//! initrd from the leased address, util-linux `logger` as the installer's syslog, and
//! the installed system's callbacks. Every stage must be stored, in order; `/metrics`,
//! parsed by `prometheus_client`'s text-format parser, must show the stage histograms
//! moved; `pxed report` and `pxed node show` must say so too.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::bmc::{NODE1, PASSWORD, Sushy};
use crate::common::{poll_blocking, pxed_bin, repo, run, write_file};
use crate::netns::{Lan, Netns};

const TOKEN: &str = "stages-test-token";
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 93, 0, 1);
const UDHCPC_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/udhcpc-env.sh");

/// A local mirror with the files the rocky-9 catalog entry expects (kernel and initrd
/// of distinct sizes, so the bytes recorded can be checked).
fn mirror(dir: &Path) -> String {
    let mirror = dir.join("mirror");
    crate::image_check::rocky_repo_metadata(&mirror);
    for arch in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{arch}/os/images/pxeboot");
        write_file(&mirror, &format!("{p}/vmlinuz"), &[7u8; 3000]);
        write_file(&mirror, &format!("{p}/initrd.img"), &[9u8; 5000]);
    }
    format!("{}/", mirror.display())
}

/// Forwards TCP connections to `127.0.0.1:<port>` inside `ns` to `upstream` in this
/// namespace (sushy-tools listens on the host's loopback; pxed runs in `ns`). Returns
/// the port in `ns`. The listener lives as long as the test process.
fn forward_into(ns: &Netns, upstream: u16) -> u16 {
    let listener = ns.enter(|| TcpListener::bind("127.0.0.1:0").expect("bind in namespace"));
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(down) = conn else { continue };
            let Ok(up) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream| {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            };
            pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
            pipe(up, down);
        }
    });
    port
}

/// `curl` inside `ns`: (HTTP status, body).
fn curl(ns: &Netns, args: &[&str]) -> (u16, String) {
    let out = ns
        .std_command("curl")
        .args(["-s", "--max-time", "20", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// `pxed serve` in the server namespace of `lan`; stopped with SIGTERM on drop.
struct Pxed {
    child: Child,
    log: std::path::PathBuf,
}

impl Pxed {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Pxed {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        if poll_blocking(Duration::from_secs(5), || {
            self.child.try_wait().ok().flatten()
        })
        .is_none()
        {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(80).collect();
            eprintln!("---- pxed log (tail) ----");
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

/// The API, called from inside the server namespace.
struct Api<'a> {
    ns: &'a Netns,
}

impl Api<'_> {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let url = format!("http://{SERVER}/api/v1{path}");
        let auth = format!("Authorization: Bearer {TOKEN}");
        let mut args = vec!["-X", method, "-H", &auth];
        let body = body.map(|b| b.to_string());
        if let Some(b) = &body {
            args.extend(["-H", "Content-Type: application/json", "--data", b]);
        }
        args.push(&url);
        let (s, text) = curl(self.ns, &args);
        (
            s,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn get(&self, path: &str) -> Value {
        let (s, v) = self.call("GET", path, None);
        assert_eq!(s, 200, "GET {path}: {v}");
        v
    }
}

/// busybox udhcpc once in `ns` with `extra` options; the `bound` environment.
fn udhcpc(ns: &Netns, extra: &[&str]) -> std::collections::HashMap<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("env");
    let o = ns
        .std_command("env")
        .arg(format!("UDHCPC_OUT={}", out.display()))
        .args(["busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f"])
        .args(["-t", "5", "-T", "1", "-s", UDHCPC_SCRIPT])
        .args(extra)
        .output()
        .expect("busybox udhcpc");
    assert!(o.status.success(), "udhcpc {extra:?}: {o:?}");
    std::fs::read_to_string(&out)
        .expect("udhcpc ran its script")
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `/metrics` through `prometheus_client.parser.text_string_to_metric_families`: every
/// sample as `name{labels} value`, sorted label names, one per line.
fn parse_metrics(text: &str) -> std::collections::BTreeMap<String, f64> {
    let peers = std::env::var("PEERS_DIR").unwrap_or_else(|_| "/tmp/pxed-peers".into());
    let py = Path::new(&peers).join("venv/bin/python3");
    let script = r#"
import sys, json
from prometheus_client.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        out[f"{s.name}{{{labels}}}"] = s.value
print(json.dumps(out))
"#;
    let mut child = Command::new(py)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("venv python (run .ci/install.sh)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client rejected /metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn metrics(ns: &Netns) -> (String, std::collections::BTreeMap<String, f64>) {
    let (s, text) = curl(ns, &[&format!("http://{SERVER}/metrics")]);
    assert_eq!(s, 200);
    let parsed = parse_metrics(&text);
    (text, parsed)
}

fn sample(m: &std::collections::BTreeMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

#[test]
fn a_reinstall_over_the_wire_records_every_stage_in_order() {
    let sushy = Sushy::start();
    let lan = Lan::new("stg", &format!("{SERVER}/24"), 1);
    let node_ns = &lan.clients[0];
    let mac = node_ns.mac("eth0");
    let bmc_port = forward_into(&lan.server, sushy.port());

    // rocky-9 imported from a local mirror, then pxed serving br0.
    let work = tempfile::tempdir().unwrap();
    let mirror_base = mirror(work.path());
    let data = work.path().join("data");
    let (ok, out, err) = run(Command::new(pxed_bin())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(&data)
        .env("PXED_MIRROR_BASE", &mirror_base));
    assert!(ok, "image add: {out}{err}");
    let log = work.path().join("pxed.log");
    let mut cmd = lan.server.std_command(pxed_bin());
    cmd.current_dir(repo())
        .args(["serve", "--interface", "br0", "--dhcp", "full"])
        .args(["--pool", "10.93.0.100-10.93.0.150", "--server-ip"])
        .arg(SERVER.to_string())
        .args([
            "--http",
            "10.93.0.1:80",
            "--tftp",
            "10.93.0.1:69",
            "--ipxe-dir",
        ])
        .arg(repo().join("ipxe/bin"))
        .arg("--data-dir")
        .arg(&data)
        .env("PXED_API_TOKEN", TOKEN)
        // What the installer would fetch packages from (nothing here does).
        .env("PXED_MIRROR_BASE", "http://10.93.0.1/mirror/")
        .env("PXED_LOG", "info,pxed=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let pxed = Pxed {
        child: cmd.spawn().expect("spawn pxed"),
        log,
    };
    let api = Api { ns: &lan.server };
    let up = poll_blocking(Duration::from_secs(20), || {
        (curl(&lan.server, &[&format!("http://{SERVER}/healthz")]).0 == 200).then_some(())
    });
    assert!(up.is_some(), "pxed did not come up:\n{}", pxed.log());

    // Before any reinstall: the families exist, nothing observed.
    let (_, before) = metrics(&lan.server);
    assert_eq!(
        sample(&before, "pxed_reinstall_duration_seconds_count{}"),
        0.0
    );

    let (s, n) = api.call(
        "POST",
        "/nodes",
        Some(json!({"macs": [mac], "arch": "x86_64", "name": "stg-1",
                    "bmc": {"driver": "redfish", "address": format!("http://127.0.0.1:{bmc_port}"),
                            "username": "admin", "password": PASSWORD, "system_id": NODE1}})),
    );
    assert_eq!(s, 201, "{n}");
    let id = n["id"].as_i64().unwrap();
    let (s, op) = api.call(
        "POST",
        &format!("/nodes/{id}/reinstall"),
        Some(json!({"image": "rocky-9"})),
    );
    assert_eq!(s, 202, "{op}");
    let netbooting = poll_blocking(Duration::from_secs(30), || {
        let n = api.get(&format!("/nodes/{id}"));
        (n["state"] == "netbooting").then_some(n)
    });
    assert!(
        netbooting.is_some(),
        "never netbooting: {}\n{}",
        api.get(&format!("/nodes/{id}")),
        pxed.log()
    );

    // The firmware's PXE DHCP (arch 7, x86-64 UEFI): DISCOVER, then REQUEST.
    let pxe = ["-x", "0x5d:0007", "-V", "PXEClient:Arch:00007:UNDI:003016"];
    let lease = udhcpc(node_ns, &pxe);
    let ip = lease["ip"].clone();
    assert_eq!(lease["boot_file"], "snponly.efi", "{lease:?}");
    node_ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
    // The first stage over TFTP.
    let fetched = work.path().join("snponly.efi");
    let fetched_arg = fetched.display().to_string();
    curl(
        node_ns,
        &[&format!("tftp://{SERVER}/snponly.efi"), "-o", &fetched_arg],
    );
    let efi_size = std::fs::metadata(repo().join("ipxe/bin/snponly.efi"))
        .unwrap()
        .len();
    assert_eq!(
        std::fs::metadata(&fetched).map(|m| m.len()).ok(),
        Some(efi_size),
        "TFTP fetch of snponly.efi"
    );
    // iPXE's own DHCP: user class "iPXE".
    let mut ipxe = pxe.to_vec();
    ipxe.extend(["-x", "0x4d:69505845"]);
    let again = udhcpc(node_ns, &ipxe);
    assert!(
        again["boot_file"].ends_with(&format!("/boot/{mac}.ipxe")),
        "{again:?}"
    );
    // The script, the kernel and the initrd, from the leased address.
    let (s, script) = curl(node_ns, &[&format!("http://{SERVER}/boot/{mac}.ipxe")]);
    assert_eq!(s, 200);
    assert!(script.contains("inst.ks="), "{script}");
    let token = {
        let i = script.find("/cfg/").expect("config URL") + 5;
        script[i..].split('/').next().unwrap().to_string()
    };
    for f in ["kernel", "initrd"] {
        let (s, _) = curl(
            node_ns,
            &[
                &format!("http://{SERVER}/images/rocky-9/x86_64/{f}"),
                "-o",
                "/dev/null",
            ],
        );
        assert_eq!(s, 200, "{f}");
    }
    let (s, ks) = curl(
        node_ns,
        &[&format!("http://{SERVER}/cfg/{token}/kickstart")],
    );
    assert_eq!(s, 200, "{ks}");
    let agent = {
        let i = ks.find("CB='").expect("agent callback in kickstart") + 4;
        let base = ks[i..].split('\'').next().unwrap();
        base.rsplit('/').next().unwrap().to_string()
    };
    // The installer's kernel is up: its syslog reaches pxed.
    let (ok, out, err) = run(node_ns.std_command("logger").args([
        "--server",
        &SERVER.to_string(),
        "--port",
        "514",
        "--udp",
        "-t",
        "anaconda",
        "--",
        "Starting installer, one moment...",
    ]));
    assert!(ok, "logger: {out}{err}");
    let booted = poll_blocking(Duration::from_secs(10), || {
        let v = api.get(&format!("/nodes/{id}/stages"));
        v["stages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["stage"] == "installer_kernel_booted")
            .then_some(())
    });
    assert!(
        booted.is_some(),
        "{}",
        api.get(&format!("/nodes/{id}/stages"))
    );
    let cb = |token: &str, call: &str, body: Value| {
        let b = body.to_string();
        curl(
            node_ns,
            &[
                "-X",
                "POST",
                "-H",
                "Content-Type: application/json",
                "--data",
                &b,
                &format!("http://{SERVER}/cb/{token}/{call}"),
            ],
        )
    };
    let (s, v) = cb(&token, "installed", json!({}));
    assert_eq!(s, 200, "{v}");
    // The installed system reboots: local boot, first boot, health.
    let (s, local) = curl(node_ns, &[&format!("http://{SERVER}/boot/{mac}.ipxe")]);
    assert_eq!(s, 200);
    assert!(
        local.contains("sanboot") || local.contains("exit"),
        "{local}"
    );
    let (s, v) = cb(
        &agent,
        "first-boot",
        json!({"hostname": "stg-1", "arch": "x86_64", "facts": {"cpus": 1}}),
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = cb(&agent, "health", json!({"status": "pass"}));
    assert_eq!(s, 200, "{v}");
    assert!(v.contains("available"), "{v}");

    // Every stage, once, in the order of a reinstall, with non-decreasing times.
    let want = [
        "reinstall",
        "power",
        "dhcp_discover",
        "lease",
        "first_stage",
        "ipxe_dhcp",
        "script",
        "kernel",
        "initrd",
        "installer_kernel_booted",
        "installed",
        "local_boot",
        "first_boot",
        "health",
        "available",
    ];
    let v = poll_blocking(Duration::from_secs(10), || {
        let v = api.get(&format!("/nodes/{id}/stages"));
        (v["stages"].as_array().unwrap().len() >= want.len()).then_some(v)
    })
    .unwrap_or_else(|| {
        panic!(
            "stages missing: {:#}\n{}",
            api.get(&format!("/nodes/{id}/stages")),
            pxed.log()
        )
    });
    let stages = v["stages"].as_array().unwrap();
    let got: Vec<&str> = stages
        .iter()
        .map(|s| s["stage"].as_str().unwrap())
        .collect();
    assert_eq!(got, want, "{v:#}");
    let times: Vec<chrono::DateTime<chrono::Utc>> = stages
        .iter()
        .map(|s| s["at"].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{v:#}");
    let by = |name: &str| stages.iter().find(|s| s["stage"] == name).unwrap();
    assert_eq!(by("first_stage")["bytes"], efi_size, "{v:#}");
    assert_eq!(by("first_stage")["detail"], "tftp snponly.efi");
    assert!(by("first_stage")["took_ms"].is_u64());
    assert_eq!(by("kernel")["bytes"], 3000);
    assert_eq!(by("initrd")["bytes"], 5000);
    assert_eq!(by("script")["detail"], "installer");
    assert!(by("reinstall")["lasted_ms"].is_u64());
    assert_eq!(v["current"]["stage"], "available");
    assert_eq!(v["current"]["stuck"], false);
    let n = api.get(&format!("/nodes/{id}"));
    assert_eq!(n["stage"]["stage"], "available", "{n}");

    // /metrics through a real parser: the stage histograms moved.
    let settled = poll_blocking(Duration::from_secs(15), || {
        let (text, m) = metrics(&lan.server);
        (sample(&m, "pxed_reinstall_duration_seconds_count{}") == 1.0
            && sample(&m, "pxed_nodes{state=\"available\"}") == 1.0)
            .then_some((text, m))
    });
    let (text, m) = settled.unwrap_or_else(|| panic!("{}", metrics(&lan.server).0));
    for stage in &want[..want.len() - 1] {
        let key = format!("pxed_stage_duration_seconds_count{{stage=\"{stage}\"}}");
        assert_eq!(sample(&m, &key), 1.0, "{key}\n{text}");
        let inf = format!("pxed_stage_duration_seconds_bucket{{le=\"+Inf\",stage=\"{stage}\"}}");
        assert_eq!(sample(&m, &inf), 1.0, "{inf}\n{text}");
    }
    assert_eq!(
        sample(
            &before,
            "pxed_stage_duration_seconds_count{stage=\"power\"}"
        ),
        0.0
    );
    assert!(sample(&m, "pxed_reinstall_duration_seconds_sum{}") > 0.0);
    assert_eq!(sample(&m, "pxed_nodes_stuck{}"), 0.0);
    assert!(!text.contains(PASSWORD));

    // The report and the CLI.
    let r = api.get("/report?since=1h");
    assert_eq!(
        (&r["reinstalls"], &r["succeeded"], &r["failed"]),
        (&json!(1), &json!(1), &json!(0)),
        "{r:#}"
    );
    assert!(r["p50_ms"].as_u64().unwrap() > 0, "{r:#}");
    assert_eq!(r["leftovers"], json!([]));
    let (s, bad) = api.call("GET", "/report?since=yesterday", None);
    assert_eq!(
        (s, bad["error"].as_str()),
        (400, Some("bad_request")),
        "{bad}"
    );
    let token_file = work.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let cli = |args: &[&str]| {
        let (ok, out, err) = run(lan
            .server
            .std_command(pxed_bin())
            .args(args)
            .args(["--url", &format!("http://{SERVER}"), "--token-file"])
            .arg(&token_file));
        assert!(ok, "pxed {args:?}: {out}{err}");
        out
    };
    let shown = cli(&["node", "show", "stg-1"]);
    for stage in want {
        assert!(shown.contains(stage), "{stage} not in:\n{shown}");
    }
    assert!(shown.contains("stages of generation 1"), "{shown}");
    // The node page lists what the wire saw, with the bytes of each file served.
    let auth = format!("Authorization: Bearer {TOKEN}");
    let (s, page) = curl(
        &lan.server,
        &["-H", &auth, &format!("http://{SERVER}/nodes/{id}")],
    );
    assert_eq!(s, 200, "{page}");
    let wire = &page[page.find("seen on the wire").expect("wire section")..];
    for w in [
        "dhcp_discover",
        "first_stage",
        "kernel",
        "3000 bytes",
        "initrd",
        "5000 bytes",
    ] {
        assert!(wire.contains(w), "{w} not on the node page:\n{wire}");
    }
    let report = cli(&["report", "--since", "1h"]);
    assert!(report.contains("REINSTALLS"), "{report}");
    let row = report
        .lines()
        .skip_while(|l| !l.starts_with("REINSTALLS"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        row.split_whitespace().take(3).eq(["1", "1", "0"]),
        "{report}"
    );
    drop(pxed);
}
