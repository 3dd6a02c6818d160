//! Fast netboot-failure detection with fallback (issue 12), through the real daemon.
//!
//! Everything runs in one network namespace: sushy-tools (`--fake`) behind
//! `tests/peers/bmc_fault_proxy.py` with a *lying BMC* fault (it takes the one-time
//! override and boots the disk anyway unless the override spells out the boot mode, or
//! unless the reset is a cold boot), and `pxed serve` with full DHCP on the namespace's
//! bridge. When the lying "machine" really netboots, the proxy runs busybox `udhcpc`
//! with the PXE vendor class and arch option from a client namespace whose MAC is the
//! node's boot MAC: pxed sees the DHCP as it would a real firmware's.
//!
//! Each row: the first methods are caught as `netboot_not_observed` within the observe
//! window, the fallback makes the machine netboot, the method is recorded for the BMC
//! model and shown on the node page, and the next reinstall of the node starts with it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::bmc::{FaultProxy, NODE2, PASSWORD, Sushy};
use crate::common::{need, poll, pxed_bin, repo, run, write_file};
use crate::netns::Lan;

const TOKEN: &str = "netboot-test-token";
/// `lifecycle.netboot_observe` of these tests.
const WINDOW: Duration = Duration::from_secs(5);
/// How long the "firmware" takes from the reset to its first DHCP DISCOVER.
const POST_SECS: u32 = 2;

/// pxed in the server namespace of `lan`, on `ip`.
struct Pxed {
    child: Child,
    ip: Ipv4Addr,
    dir: tempfile::TempDir,
}

impl Drop for Pxed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Pxed {
    fn start(lan: &Lan, net: u8) -> Pxed {
        let ip = lan.server_ip;
        let dir = tempfile::tempdir().unwrap();
        let mirror = dir.path().join("mirror");
        crate::image_check::rocky_repo_metadata(&mirror);
        for arch in ["x86_64", "aarch64"] {
            let p = format!("rocky/9/BaseOS/{arch}/os/images/pxeboot");
            write_file(&mirror, &format!("{p}/vmlinuz"), b"kernel");
            write_file(&mirror, &format!("{p}/initrd.img"), b"initrd");
        }
        let mirror = format!("{}/", mirror.display());
        let data = dir.path().join("data");
        let (ok, out, err) = run(Command::new(pxed_bin())
            .current_dir(repo())
            .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
            .arg(&data)
            .env("PXED_MIRROR_BASE", &mirror));
        assert!(ok, "image add: {out}{err}");
        let log = std::fs::File::create(dir.path().join("pxed.log")).unwrap();
        let window = format!("{}s", WINDOW.as_secs());
        let child = lan
            .server
            .std_command(pxed_bin())
            .current_dir(repo())
            .args(["serve", "--interface", "br0", "--dhcp", "full", "--pool"])
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
            .arg(&data)
            .env("PXED_API_TOKEN", TOKEN)
            .env("PXED_MIRROR_BASE", &mirror)
            .env("PXED_LOG", "info,pxed=debug")
            .env("PXED_LIFECYCLE__NETBOOT_OBSERVE", &window)
            .env("PXED_LIFECYCLE__MAX_ATTEMPTS", "1")
            .env("PXED_LIFECYCLE__BACKOFF", "200ms")
            .env("PXED_LIFECYCLE__LEFTOVERS_INTERVAL", "1s")
            .env("PXED_BMC__REQUEST_TIMEOUT", "3s")
            .env("PXED_BMC__RETRIES", "1")
            .env("PXED_BMC__POWER_DEADLINE", "15s")
            .env("PXED_BMC__RESTART_OBSERVE", "500ms")
            .env("PXED_BMC__POLL_INTERVAL", "200ms")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn pxed");
        let mut p = Pxed { child, ip, dir };
        let ns = lan.server.name().to_string();
        let up = crate::common::poll_blocking(Duration::from_secs(20), || {
            if let Ok(Some(st)) = p.child.try_wait() {
                panic!("pxed exited early ({st}):\n{}", p.log());
            }
            p.request(&ns, "GET", "/metrics", None)
                .ok()
                .filter(|(code, _)| *code == 200)
        });
        assert!(up.is_some(), "pxed did not come up:\n{}", p.log());
        p
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pxed.log")).unwrap_or_default()
    }

    /// A plain HTTP/1.0 request from inside namespace `ns`: (status, body).
    fn request(
        &self,
        ns: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> std::io::Result<(u16, String)> {
        let addr = SocketAddr::from((self.ip, 80));
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.0\r\nHost: {}\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.ip,
            body.len()
        );
        let path = format!("/var/run/netns/{ns}");
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let fd = std::fs::File::open(&path)?;
            // SAFETY: setns on a valid namespace fd; affects only this thread.
            if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
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
        .join()
        .expect("request thread")
    }
}

/// A lying BMC, and what must make the machine netboot behind it.
struct Row {
    fault: &'static str,
    /// Methods caught as `netboot_not_observed`, in order.
    not_observed: &'static [&'static str],
    /// The method that made it netboot.
    worked: &'static str,
}

const ROWS: &[Row] = &[
    Row {
        fault: "lie-unless-mode",
        not_observed: &["standard"],
        worked: "uefi_override",
    },
    Row {
        fault: "lie-unless-offon",
        not_observed: &["standard", "uefi_override"],
        worked: "off_on",
    },
];

fn events(node: &Value) -> Vec<Value> {
    node["events"].as_array().cloned().unwrap_or_default()
}

fn at(e: &Value) -> chrono::DateTime<chrono::Utc> {
    e["at"].as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn a_lying_bmc_is_caught_within_the_window_and_the_fallback_recovers() {
    need("busybox");
    for (i, row) in ROWS.iter().enumerate() {
        lying_bmc(row, 93 + u8::try_from(i).unwrap()).await;
    }
}

async fn lying_bmc(row: &Row, net: u8) {
    let lan = Lan::new("nb", &format!("10.{net}.0.1/24"), 1);
    let client = lan.clients[0].name().to_string();
    let mac = lan.clients[0].mac("eth0");
    let sushy = Sushy::start_in(&lan.server);
    let hook = format!(
        "sleep {POST_SECS}; ip netns exec {client} busybox udhcpc -i eth0 -n -q -f -t 3 -T 1 \
         -s /bin/true -V PXEClient:Arch:00007:UNDI:003016 -x 0x5d:0007"
    );
    let proxy = FaultProxy::start_in(&lan.server, &sushy.url(), row.fault, &hook);
    let pxed = Pxed::start(&lan, net);
    let ns = lan.server.name().to_string();
    let api = |method: &'static str, path: String, body: Option<Value>| {
        let (code, text) = pxed.request(&ns, method, &path, body).unwrap();
        (code, text)
    };
    let (code, body) = api(
        "POST",
        "/api/v1/nodes".into(),
        Some(json!({"macs": [mac], "arch": "x86_64", "bmc": {
            "driver": "redfish", "address": proxy.url(), "username": "admin",
            "password": PASSWORD, "system_id": NODE2}})),
    );
    assert_eq!(code, 201, "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_i64()
        .unwrap();
    let node = || {
        serde_json::from_str::<Value>(&api("GET", format!("/api/v1/nodes/{id}"), None).1).unwrap()
    };

    let (code, body) = api(
        "POST",
        format!("/api/v1/nodes/{id}/reinstall"),
        Some(json!({"image": "rocky-9"})),
    );
    assert_eq!(code, 202, "{body}");
    let started = Instant::now();
    // Every method before the right one costs one window (plus the BMC calls).
    let budget = WINDOW * (row.not_observed.len() as u32 + 1) + Duration::from_secs(60);
    let n = poll(budget, async || {
        // Seen (maybe before the BMC reported the reset done) and the reset answered.
        let n = node();
        (n["state"] == "netbooting"
            && events(&n)
                .iter()
                .any(|e| e["event"] == "netboot_method_recorded"))
        .then_some(n)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "{}: never netbooted: {:#}\n{}",
            row.fault,
            node(),
            pxed.log()
        )
    });
    let took = started.elapsed();
    let ev = events(&n);
    let names: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
    eprintln!("{}: netbooted after {took:.1?}: {names:?}", row.fault);
    assert_eq!(n["state"], "netbooting", "{}: {n:#}", row.fault);

    // Each wrong method was caught as netboot_not_observed, within the window of its
    // power cycle (plus scheduling slack), naming the method.
    let cycles: Vec<&Value> = ev.iter().filter(|e| e["event"] == "power_cycled").collect();
    let missed: Vec<&Value> = ev
        .iter()
        .filter(|e| e["event"] == "netboot_not_observed")
        .collect();
    assert_eq!(
        missed.len(),
        row.not_observed.len(),
        "{}: {names:?}",
        row.fault
    );
    assert_eq!(cycles.len(), missed.len() + 1, "{}: {names:?}", row.fault);
    for (k, (m, method)) in missed.iter().zip(row.not_observed).enumerate() {
        let detail = m["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("method {method}")),
            "{}: {detail}",
            row.fault
        );
        assert_eq!(
            (m["from_state"].as_str(), m["to_state"].as_str()),
            (Some("netbooting"), Some("reclaiming"))
        );
        let waited = (at(m) - at(cycles[k])).to_std().unwrap();
        assert!(
            waited >= WINDOW - Duration::from_millis(50)
                && waited < WINDOW + Duration::from_secs(3),
            "{}: caught {waited:?} after the power cycle (window {WINDOW:?})",
            row.fault
        );
    }
    // The fallback made it netboot: observed once, the method recorded for the model.
    let observed: Vec<&Value> = ev
        .iter()
        .filter(|e| e["event"] == "netboot_observed")
        .collect();
    assert_eq!(observed.len(), 1, "{}: {names:?}", row.fault);
    let recorded = ev
        .iter()
        .find(|e| e["event"] == "netboot_method_recorded")
        .unwrap();
    let detail = recorded["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(&format!(
            "{} made it netboot; preferred next time for redfish:",
            row.worked
        )),
        "{}: {detail}",
        row.fault
    );

    // The node page shows it (the audit log, server-rendered).
    let (code, page) = api("GET", format!("/nodes/{id}"), None);
    assert_eq!(code, 200);
    for want in [
        "netboot_not_observed",
        "netboot_observed",
        "netboot_method_recorded",
        row.worked,
    ] {
        assert!(page.contains(want), "{}: node page lacks {want}", row.fault);
    }
    // Counted by method.
    let (_, metrics) = api("GET", "/metrics".into(), None);
    for m in row.not_observed {
        assert!(
            metrics.contains(&format!(
                "pxed_netboot_not_observed_total{{method=\"{m}\"}} 1"
            )),
            "{}: {metrics}",
            row.fault
        );
    }
    assert!(metrics.contains(&format!(
        "pxed_netboot_observed_total{{method=\"{}\"}} 1",
        row.worked
    )));

    // The next reinstall of this model starts with the method that worked: no window
    // is spent on the ones that did not.
    let (code, body) = api(
        "POST",
        format!("/api/v1/nodes/{id}/actions/fail"),
        Some(json!({"reason": "test: next generation"})),
    );
    assert_eq!(code, 200, "{body}");
    let (code, body) = api(
        "POST",
        format!("/api/v1/nodes/{id}/reinstall"),
        Some(json!({})),
    );
    assert_eq!(code, 202, "{body}");
    let gen2 = n["generation"].as_i64().unwrap() + 1;
    let n2 = poll(WINDOW + Duration::from_secs(40), async || {
        let n = node();
        events(&n)
            .iter()
            .any(|e| e["generation"] == gen2 && e["event"] == "netboot_observed")
            .then_some(n)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "{}: generation {gen2} never netbooted: {:#}",
            row.fault,
            node()
        )
    });
    let all2 = events(&n2);
    let gen2_events: Vec<&str> = all2
        .iter()
        .filter(|e| e["generation"] == gen2)
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert!(
        !gen2_events.contains(&"netboot_not_observed"),
        "{}: the recorded method was not tried first: {gen2_events:?}",
        row.fault
    );
    drop(pxed);
    drop(proxy);
}

/// Leftovers through the real daemon: a lease whose node was deleted, a node that
/// netbooted while `available`, a node `available` whose BMC reads Off; each listed by
/// `GET /api/v1/leftovers`, counted in `pxed_leftovers`, and gone after its one action.
#[tokio::test]
async fn leftovers_are_listed_counted_and_resolved() {
    need("busybox");
    let net = 96;
    let lan = Lan::new("lo", &format!("10.{net}.0.1/24"), 1);
    let client = lan.clients[0].name().to_string();
    let mac = lan.clients[0].mac("eth0");
    let sushy = Sushy::start_in(&lan.server);
    let proxy = FaultProxy::start_in(&lan.server, &sushy.url(), "", "");
    let pxed = Pxed::start(&lan, net);
    let ns = lan.server.name().to_string();
    let api = |method: &'static str, path: String, body: Option<Value>| {
        pxed.request(&ns, method, &path, body).unwrap()
    };
    let dhcp = || {
        let (ok, out, err) = run(Command::new("ip").args([
            "netns",
            "exec",
            &client,
            "busybox",
            "udhcpc",
            "-i",
            "eth0",
            "-n",
            "-q",
            "-f",
            "-t",
            "3",
            "-T",
            "1",
            "-s",
            "/bin/true",
            "-V",
            "PXEClient:Arch:00007:UNDI:003016",
            "-x",
            "0x5d:0007",
        ]));
        assert!(ok, "udhcpc: {out}{err}");
    };
    let register = |bmc_system: &str| {
        let (code, body) = api(
            "POST",
            "/api/v1/nodes".into(),
            Some(json!({"macs": [mac], "arch": "x86_64", "bmc": {
                "driver": "redfish", "address": proxy.url(), "username": "admin",
                "password": PASSWORD, "system_id": bmc_system}})),
        );
        assert_eq!(code, 201, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()["id"]
            .as_i64()
            .unwrap()
    };
    // Waits until the leftovers list has (or, with `present` false, lacks) `kind`.
    let wait_kind = async |kind: &str, present: bool| -> Value {
        poll(Duration::from_secs(20), async || {
            let (code, body) = api("GET", "/api/v1/leftovers".into(), None);
            assert_eq!(code, 200, "{body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            let found = v["leftovers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["kind"] == kind)
                .cloned();
            match (found, present) {
                (Some(l), true) => Some(l),
                (None, false) => Some(v),
                _ => None,
            }
        })
        .await
        .unwrap_or_else(|| panic!("leftover {kind} present={present} never seen"))
    };

    // A node that netboots while `available`: something reset it.
    let id = register(crate::bmc::NODE2);
    dhcp();
    let l = wait_kind("netbooted_at_rest", true).await;
    assert_eq!(l["node"], id);
    assert_eq!(l["action"], "acknowledge");
    assert!(
        l["detail"].as_str().unwrap().contains("while available"),
        "{l}"
    );
    let (_, metrics) = api("GET", "/metrics".into(), None);
    assert!(
        metrics.contains("pxed_leftovers{kind=\"netbooted_at_rest\"} 1"),
        "{metrics}"
    );
    let (code, body) = api(
        "POST",
        format!("/api/v1/leftovers/netbooted_at_rest/{id}/resolve"),
        None,
    );
    assert_eq!(code, 200, "{body}");
    wait_kind("netbooted_at_rest", false).await;
    let (code, body) = api(
        "POST",
        format!("/api/v1/leftovers/netbooted_at_rest/{id}/resolve"),
        None,
    );
    assert_eq!((code, body.contains("not_found")), (404, true), "{body}");
    let (_, page) = api("GET", format!("/nodes/{id}"), None);
    assert!(
        page.contains("leftover_resolved"),
        "node page lacks the resolution"
    );

    // Its lease outlives the node: a stale lease, released by the operator.
    let (code, _) = api("DELETE", format!("/api/v1/nodes/{id}"), None);
    assert!(code == 200 || code == 204, "delete: {code}");
    let l = wait_kind("stale_lease", true).await;
    assert_eq!(l["node"], Value::Null);
    let ip = l["subject"].as_str().unwrap().to_string();
    assert!(ip.starts_with(&format!("10.{net}.0.")), "{l}");
    assert!(l["detail"].as_str().unwrap().contains(&mac), "{l}");
    let (code, body) = api(
        "POST",
        format!("/api/v1/leftovers/stale_lease/{ip}/resolve"),
        None,
    );
    assert_eq!(code, 200, "{body}");
    wait_kind("stale_lease", false).await;

    // `available` on a BMC that reads Off (sushy's node1 starts Off): powered on.
    let id = register(crate::bmc::NODE1);
    let l = wait_kind("powered_off", true).await;
    assert_eq!(
        (l["node"].as_i64(), l["action"].as_str()),
        (Some(id), Some("power_on"))
    );
    let (code, body) = api(
        "POST",
        format!("/api/v1/leftovers/powered_off/{id}/resolve"),
        None,
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("powered on"), "{body}");
    // A check after the resolution must find it On (not merely unlisted until then).
    let resolved_at = chrono::Utc::now();
    let v = poll(Duration::from_secs(20), async || {
        let v: Value =
            serde_json::from_str(&api("GET", "/api/v1/leftovers".into(), None).1).unwrap();
        let checked: chrono::DateTime<chrono::Utc> = v["checked_at"].as_str()?.parse().ok()?;
        (checked > resolved_at + chrono::TimeDelta::milliseconds(500)).then_some(v)
    })
    .await
    .expect("a leftovers check after the resolution");
    assert_eq!(v["counts"]["powered_off"], 0, "{v}");
    let (code, body) = api("POST", "/api/v1/leftovers/bogus/1/resolve".into(), None);
    assert_eq!(code, 404, "{body}");
}
