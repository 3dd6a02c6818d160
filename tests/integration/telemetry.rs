//! Installer telemetry with real peers: the real binary, a real Redfish emulator to get a
//! node to `installing`, and util-linux `logger` sending syslog over UDP and TCP (RFC
//! 3164 and 5424, newline and octet-counted framing) from the address the installer was
//! served to. Lines are stored and shown (API, CLI, node page), milestones land on the
//! timeline, and a debian-installer fatal line fails the node at `installing` with the
//! installer's own words; the same failure in the next generation is named a repeat.

use std::net::UdpSocket;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::bmc::{NODE1, PASSWORD, Sushy};
use crate::common::{Api, Daemon, need, pxed_bin, repo, run, write_file};

const TOKEN: &str = "telemetry-token";
const MAC: &str = "52:54:00:12:34:56";

/// How long a telemetry test waits for a node's state.
const WAIT: Duration = Duration::from_secs(60);

impl Api {
    /// Reinstall, let the emulated BMC power-cycle, fetch the boot script from
    /// 127.0.0.1 (the installer is bound to it): the node is `installing`. Returns the
    /// script.
    async fn install(&self, d: &Daemon, id: i64) -> String {
        let (s, v) = self
            .call(
                d,
                reqwest::Method::POST,
                &format!("/api/v1/nodes/{id}/reinstall"),
                Some(json!({"image": "debian-13"})),
            )
            .await;
        assert_eq!(s, 202, "{v}");
        self.wait_state(d, id, "netbooting", WAIT).await;
        let script = self.text(d, &format!("/boot/{MAC}.ipxe")).await;
        self.wait_state(d, id, "installing", WAIT).await;
        script
    }

    async fn log_lines(&self, d: &Daemon, id: i64) -> Vec<String> {
        self.get(d, &format!("/api/v1/nodes/{id}/log")).await["lines"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(|l| l["line"].as_str().map(String::from))
            .collect()
    }

    async fn metric(&self, d: &Daemon, name: &str) -> u64 {
        let text = self.text(d, "/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// `logger` to pxed's receiver; `proto` is `--udp` or `--tcp`, `extra` more flags.
fn logger(port: u16, proto: &str, extra: &[&str], tag: &str, msg: &str) {
    let (ok, out, err) = run(Command::new("logger")
        .args(["--server", "127.0.0.1", "--port", &port.to_string(), proto])
        .args(extra)
        .args(["-t", tag, "--", msg]));
    assert!(ok, "logger: {out}{err}");
}

fn events(n: &Value) -> Vec<(String, Option<String>)> {
    n["events"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap_or("").to_string(),
                e["detail"].as_str().map(String::from),
            )
        })
        .collect()
}

fn start() -> (Sushy, Daemon, u16, tempfile::TempDir) {
    need("logger");
    let sushy = Sushy::start();
    let work = tempfile::tempdir().unwrap();
    // A local "mirror" with the layout the debian-13 catalog entry expects.
    let mirror = work.path().join("mirror");
    crate::image_check::debian_mirror(&mirror, "trixie", &["amd64", "arm64"]);
    for arch in ["amd64", "arm64"] {
        let p = format!(
            "debian/dists/trixie/main/installer-{arch}/current/images/netboot/debian-installer/{arch}"
        );
        write_file(
            &mirror,
            &format!("{p}/linux"),
            format!("kernel {arch}").as_bytes(),
        );
        write_file(
            &mirror,
            &format!("{p}/initrd.gz"),
            format!("initrd {arch}").as_bytes(),
        );
    }
    let mirror_env = format!("{}/", mirror.display());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (ok, out, err) = run(crate::common::pxed_on(dir.path())
        .current_dir(repo())
        .args(["image", "add", "debian-13", "--demo", "--data-dir"])
        .arg(&data)
        .env("PXED_MIRROR_BASE", &mirror_env));
    assert!(ok, "image add: {out}{err}");
    let env: Vec<(&str, &str)> = vec![
        ("PXED_API_TOKEN", TOKEN),
        ("PXED_MIRROR_BASE", &mirror_env),
        ("PXED_LIFECYCLE__MAX_ATTEMPTS", "0"),
        ("PXED_SYSLOG__LINES_PER_NODE", "20"),
    ];
    let mut d = Daemon::start_in(dir, &[], &env);
    let addr = d.wait_log_addr("syslog listening");
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    pxed::net::install_crypto_provider();
    (sushy, d, port, work)
}

#[tokio::test(flavor = "multi_thread")]
async fn installer_syslog_is_stored_shown_and_fails_the_install() {
    let (sushy, d, port, _work) = start();
    let api = Api::new(TOKEN);
    let (s, v) = api
        .call(
            &d,
            reqwest::Method::POST,
            "/api/v1/nodes",
            Some(json!({"macs": [MAC], "arch": "x86_64", "bmc": {
            "driver": "redfish", "address": sushy.url(), "username": "admin",
            "password": PASSWORD, "system_id": NODE1}})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_i64().unwrap();

    let script = api.install(&d, id).await;
    // debian-installer is pointed at pxed's receiver, with cdebconf's trace on.
    for want in [
        "log_host=127.0.0.1",
        &format!("log_port={port}"),
        "DEBCONF_DEBUG=developer",
    ] {
        assert!(script.contains(want), "{want} not in\n{script}");
    }

    // What d-i sends, over each transport and format logger speaks.
    let url = "http://127.0.0.1/cfg/abcdefgh12345678/preseed";
    logger(
        port,
        "--udp",
        &["--rfc3164"],
        "preseed",
        &format!("successfully loaded preseed file from {url}"),
    );
    logger(
        port,
        "--tcp",
        &["--rfc5424"],
        "main-menu",
        "INFO: Menu item 'partman-base' selected",
    );
    logger(
        port,
        "--tcp",
        &["--rfc5424", "--octet-count", "--id=2143"],
        "anna",
        "DEBUG: retrieving libgpg-error0-udeb 1.46-1",
    );
    // The debconf trace is recognised but not worth a stored line.
    logger(
        port,
        "--udp",
        &["--rfc3164"],
        "debconf",
        "--> GET netcfg/get_hostname",
    );
    let lines = api
        .wait("three stored lines", &d, async || {
            Some(api.log_lines(&d, id).await).filter(|l| l.len() >= 3)
        })
        .await;
    // Sent over UDP and TCP: the order they arrive in is not the order sent.
    let mut lines = lines;
    lines.sort();
    assert_eq!(
        lines,
        [
            "anna[2143]: DEBUG: retrieving libgpg-error0-udeb 1.46-1".to_string(),
            "main-menu: INFO: Menu item 'partman-base' selected".into(),
            // The token in a URL the installer echoes is never stored.
            "preseed: successfully loaded preseed file from http://127.0.0.1/cfg/<redacted>/preseed".into(),
        ]
    );
    // Milestones on the timeline, once each (written beside the lines: wait for them).
    let n = api
        .wait("the milestones", &d, async || {
            let n = api.get(&d, &format!("/api/v1/nodes/{id}")).await;
            let ev = events(&n);
            ev.iter()
                .any(|(e, _)| e == "installer_partitioning")
                .then_some(n)
        })
        .await;
    let ev = events(&n);
    for m in [
        "installer_kernel_booted",
        "installer_config_loaded",
        "installer_partitioning",
    ] {
        assert_eq!(
            ev.iter().filter(|(e, _)| e == m).count(),
            1,
            "{m} in {ev:#?}"
        );
    }
    assert_eq!(
        n["state"], "installing",
        "a DEBUG retrieving line is not fatal"
    );

    // Shown: `pxed node show --log` and the node page.
    let (ok, out, err) = run(Command::new(pxed_bin())
        .args(["node", "show", &id.to_string(), "--log"])
        .env("PXED_URL", d.url(""))
        .env("PXED_API_TOKEN", TOKEN));
    assert!(ok, "{out}{err}");
    assert!(
        out.contains(&format!("node {id} generation 1: 3 lines")),
        "{out}"
    );
    assert!(
        out.contains("anna[2143]: DEBUG: retrieving libgpg-error0-udeb"),
        "{out}"
    );
    let page = api.text(&d, &format!("/nodes/{id}")).await;
    assert!(
        page.contains("Menu item &#x27;partman-base&#x27; selected")
            || page.contains("Menu item &#39;partman-base&#39; selected"),
        "{page}"
    );
    assert!(!page.contains("abcdefgh12345678"), "{page}");

    // Bounded: a chatty installer keeps only the last lines_per_node (20).
    for i in 0..30 {
        logger(
            port,
            "--udp",
            &["--rfc3164"],
            "in-target",
            &format!("Unpacking package-{i:02} ..."),
        );
    }
    let lines = api
        .wait("the newest chatty line", &d, async || {
            Some(api.log_lines(&d, id).await)
                .filter(|l| l.last().is_some_and(|l| l.contains("package-29")))
        })
        .await;
    assert_eq!(lines.len(), 20, "{lines:#?}");

    // The dialog an unattended d-i would wait at until the deadline: failed at once.
    logger(
        port,
        "--udp",
        &["--rfc3164", "--id=278"],
        "main-menu",
        "WARNING **: Menu item 'download-installer' failed.",
    );
    let n = api.wait_state(&d, id, "failed", WAIT).await;
    assert_eq!(n["failed_step"], "installing", "{n:#}");
    let reason = n["failed_reason"].as_str().unwrap();
    assert_eq!(
        reason,
        "installing: main-menu[278]: WARNING **: Menu item 'download-installer' failed."
    );

    // The next generation stops at the same wall: said so.
    api.install(&d, id).await;
    logger(
        port,
        "--udp",
        &["--rfc3164", "--id=301"],
        "main-menu",
        "WARNING **: Menu item 'download-installer' failed.",
    );
    let n = api.wait_state(&d, id, "failed", WAIT).await;
    let reason = n["failed_reason"].as_str().unwrap();
    assert_eq!(
        reason,
        "installing: repeated failure (as in generation 1): main-menu[301]: WARNING **: Menu item 'download-installer' failed.",
        "{n:#}"
    );
    assert_eq!(n["generation"], 2);
    // The log shown is the current generation's.
    let lines = api.log_lines(&d, id).await;
    assert_eq!(
        lines,
        ["main-menu[301]: WARNING **: Menu item 'download-installer' failed."]
    );

    // A question cdebconf says it will ask, in an unattended install: a dialog nobody
    // will answer (named from cdebconf's trace), not a wait for the deadline.
    api.install(&d, id).await;
    logger(
        port,
        "--udp",
        &["--rfc3164"],
        "debconf",
        "--> INPUT critical partman/choose_partition",
    );
    logger(
        port,
        "--udp",
        &["--rfc3164"],
        "debconf",
        "<-- 0 question will be asked",
    );
    let n = api.wait_state(&d, id, "failed", WAIT).await;
    assert_eq!(
        n["failed_reason"],
        "installing: the installer waits for an answer to partman/choose_partition (priority critical): a dialog nobody will answer",
        "{n:#}"
    );
    assert_eq!(
        api.log_lines(&d, id).await,
        ["debconf: --> INPUT critical partman/choose_partition"],
        "the INPUT is kept, cdebconf's answer is trace"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_and_unattributed_input_is_counted_and_the_receiver_lives_on() {
    let (_sushy, d, port, _work) = start();
    let api = Api::new(TOKEN);
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let garbage: [&[u8]; 5] = [
        b"",
        b"\xff\xfe\xfd",
        b"no pri at all",
        b"<99999999>x",
        &[b'<'; 9000],
    ];
    for g in garbage {
        s.send_to(g, ("127.0.0.1", port)).unwrap();
    }
    // A TCP sender that breaks framing is disconnected and counted.
    let mut t = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::io::Write::write_all(&mut t, b"99999999 x").unwrap();
    drop(t);
    let malformed = api
        .wait("malformed input counted", &d, async || {
            Some(api.metric(&d, "pxed_syslog_malformed_total").await).filter(|n| *n >= 5)
        })
        .await;
    assert!(malformed >= 5, "{malformed}");
    // Well-formed, but from no node being installed: counted and dropped.
    logger(
        port,
        "--udp",
        &["--rfc3164"],
        "anna",
        "DEBUG: retrieving foo 1",
    );
    api.wait("an unattributed line counted", &d, async || {
        (api.metric(&d, "pxed_syslog_unattributed_total").await >= 1).then_some(())
    })
    .await;
    // Still serving both ways.
    logger(
        port,
        "--tcp",
        &["--rfc5424"],
        "anna",
        "DEBUG: retrieving bar 1",
    );
    api.wait("the TCP line counted", &d, async || {
        (api.metric(&d, "pxed_syslog_unattributed_total").await >= 2).then_some(())
    })
    .await;
    let health = api.text(&d, "/healthz").await;
    assert!(health.starts_with("ok"), "{health}");
    assert!(
        health.contains(&format!("syslog: listening on 127.0.0.1:{port}\n")),
        "{health}"
    );
}

/// With port 0 (the demo's syslog address), the UDP port the kernel picks may be
/// taken for TCP by another process; pxed then tries another port rather than start
/// without a receiver (a CI run once started one without it). In a namespace of its
/// own whose ephemeral range is two ports, with TCP held on the first, the receiver
/// must come up on the second every time, whichever UDP port it was handed first.
#[test]
fn syslog_on_port_zero_gets_a_port_free_for_both_udp_and_tcp() {
    let ns = crate::netns::Netns::new("syslog");
    crate::netns::run(ns.std_command("sysctl").args([
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=40000 40001",
    ]));
    let _held = ns.enter(|| std::net::TcpListener::bind("127.0.0.1:40000").expect("TCP 40000"));
    for round in 0..4 {
        let dir = tempfile::tempdir().expect("tempdir");
        // HTTP and TFTP on fixed ports outside the two-port range; SQLite whatever the
        // run (the namespace cannot reach the host's PostgreSQL).
        let mut cmd = Command::new(pxed_bin());
        cmd.current_dir(repo())
            .args(["serve", "--demo", "--http", "127.0.0.1:8080"])
            .args(["--tftp", "127.0.0.1:6969", "--data-dir"])
            .arg(dir.path().join("data"))
            .env("PXED_LOG", "info")
            .env("PXED_API_TOKEN", TOKEN)
            .env_remove("PXED_DATABASE_URL");
        // Spawned from a thread inside the namespace, the daemon lives there.
        let mut d = ns.enter(move || Daemon::spawn(cmd, dir));
        let addr = d.wait_log_addr("syslog listening");
        assert_eq!(addr, "127.0.0.1:40001", "round {round}:\n{}", d.log_text());
    }
}
