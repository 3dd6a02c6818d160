//! pxed serving from a PostgreSQL server that goes away and comes back: the daemon
//! says so in `/healthz` and its metrics, keeps serving boot files meanwhile (and
//! sends a netbooting node to its local disk rather than guess), and serves from the
//! database again once it is back, with nothing lost.

use std::process::Command;
use std::time::Duration;

use crate::common::{Daemon, poll_blocking, pxed_bin, run};

fn curl(args: &[&str]) -> (bool, String, String) {
    run(Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args))
}

/// `/healthz` once: (status code, body).
fn healthz(d: &Daemon) -> (u16, String) {
    let (_, out, _) = curl(&["-w", "\n%{http_code}", &d.url("/healthz")]);
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn metric(d: &Daemon, name: &str) -> Option<f64> {
    let (_, out, _) = curl(&[&d.url("/metrics")]);
    out.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn a_postgresql_restart_degrades_health_and_loses_nothing() {
    let cluster = store_pg::cluster::Cluster::start().unwrap();
    let url = cluster.create_database("pxed").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ok, _, err) = run(Command::new(pxed_bin())
        .args(["migrate", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("PXED_DATABASE_URL", &url));
    assert!(ok, "{err}");
    let mut d = Daemon::start_in(
        dir,
        &[],
        &[("PXED_DATABASE_URL", &url), ("PXED_API_TOKEN", "tok")],
    );
    let tftp = format!("tftp://{}/snponly.efi", d.wait_log_addr("TFTP listening"));
    let cli = |args: &[&str]| {
        run(Command::new(pxed_bin())
            .args(args)
            .env("PXED_URL", d.url(""))
            .env("PXED_API_TOKEN", "tok"))
    };
    let (ok, out, err) = cli(&[
        "node",
        "add",
        "--mac",
        "52:54:00:00:41:01",
        "--name",
        "pg-a",
    ]);
    assert!(ok, "{out}{err}");
    let (code, body) = healthz(&d);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("database: postgresql "), "{body}");
    let script = d.url("/boot/52:54:00:00:41:01.ipxe");

    // The server dies (SIGKILL, as an OOM kill would).
    cluster.kill();
    let body = poll_blocking(Duration::from_secs(20), || {
        let (code, body) = healthz(&d);
        (code == 503).then_some(body)
    })
    .expect("healthz never said degraded");
    assert!(
        body.starts_with("degraded\nstore: not writable: "),
        "{body}"
    );
    assert_eq!(metric(&d, "pxed_store_writable"), Some(0.0));
    assert!(metric(&d, "pxed_store_write_probe_failures_total").unwrap_or(0.0) >= 1.0);
    // Boot files do not need the database: the first stage still goes out.
    let out = tempfile::NamedTempFile::new().unwrap();
    let (ok, _, err) = curl(&[&tftp, "-o", out.path().to_str().unwrap()]);
    assert!(ok, "TFTP during the outage: {err}");
    assert!(std::fs::metadata(out.path()).unwrap().len() > 10_000);
    // A per-node script needs the node: the node is sent to its local disk (never an
    // installer it was not given), and told why.
    let (ok, out, _) = curl(&["-f", &script]);
    assert!(
        ok && out.starts_with("#!ipxe") && out.contains("store unavailable: booting local disk"),
        "{out}"
    );

    // Back: the pool reconnects, health recovers, the node is there.
    cluster.restart().unwrap();
    let body = poll_blocking(Duration::from_secs(30), || {
        let (code, body) = healthz(&d);
        (code == 200).then_some(body)
    })
    .expect("healthz never recovered");
    assert!(body.starts_with("ok\nstore: writable\n"), "{body}");
    let (ok, out, _) = curl(&["-f", &script]);
    assert!(ok && out.starts_with("#!ipxe"), "{out}");
    let (ok, out, err) = cli(&["node", "show", "pg-a", "--json"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("\"registered\""), "{out}");
    // And it writes again: a second node.
    let (ok, out, err) = cli(&["node", "add", "--mac", "52:54:00:00:41:02"]);
    assert!(ok, "{out}{err}");
    assert_eq!(metric(&d, "pxed_store_writable"), Some(1.0));
}
