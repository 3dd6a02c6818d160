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

/// `pxed migrate` of the database at `url` (a data dir under `dir`).
fn migrate(url: &str, dir: &std::path::Path) {
    let (ok, _, err) = run(Command::new(pxed_bin())
        .args(["migrate", "--data-dir"])
        .arg(dir.join("data"))
        .env("PXED_DATABASE_URL", url));
    assert!(ok, "{err}");
}

#[test]
fn a_postgresql_restart_degrades_health_and_loses_nothing() {
    let cluster = store_pg::cluster::Cluster::start().unwrap();
    let url = cluster.create_database("pxed").unwrap();
    let dir = tempfile::tempdir().unwrap();
    migrate(&url, dir.path());
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

/// PostgreSQL killed (SIGKILL, backends too) three times during one reinstall: while
/// the node is netbooting, installing and at first boot. Meanwhile pxed says so in
/// `/healthz`, keeps serving the first stage, the kernel and a safe script; a callback
/// it cannot store is refused (5xx: the installer and the agent send it again) rather
/// than acknowledged and lost. Each time the database comes back the reinstall goes
/// on from where it was, and finishes with every audit row once.
#[tokio::test(flavor = "multi_thread")]
async fn a_postgresql_restart_during_a_reinstall_loses_nothing_it_acknowledged() {
    use crate::bmc::{NODE1, Sushy};
    use crate::common::{Api, repo};
    use crate::crash::{add_redfish_nodes, assert_rows_once, reinstall, rocky_mirror};

    const TOKEN: &str = "pg-restart-token";
    const MAC: &str = "52:54:00:00:42:01";
    let cluster = store_pg::cluster::Cluster::start().unwrap();
    let url = cluster.create_database("pxed").unwrap();
    let sushy = Sushy::start();
    let work = tempfile::tempdir().unwrap();
    let mirror = rocky_mirror(work.path());
    let dir = tempfile::tempdir().unwrap();
    migrate(&url, dir.path());
    let (ok, out, err) = run(Command::new(pxed_bin())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("PXED_DATABASE_URL", &url)
        .env("PXED_MIRROR_BASE", &mirror));
    assert!(ok, "image add: {out}{err}");
    let mut d = Daemon::start_in(
        dir,
        &[],
        &[
            ("PXED_DATABASE_URL", &url),
            ("PXED_API_TOKEN", TOKEN),
            ("PXED_MIRROR_BASE", &mirror),
            ("PXED_LIFECYCLE__MAX_ATTEMPTS", "0"),
        ],
    );
    let tftp = format!("tftp://{}/snponly.efi", d.wait_log_addr("TFTP listening"));
    let d = d;
    pxed::net::install_crypto_provider();
    let api = Api::new(TOKEN);
    let id = add_redfish_nodes(&api, &d, [(MAC, NODE1, sushy.url())]).await[0];
    reinstall(&api, &d, id).await;
    api.wait_state(&d, id, "netbooting", Duration::from_secs(60))
        .await;
    let script = d.url(&format!("/boot/{MAC}.ipxe"));
    let kernel = d.url("/images/rocky-9/x86_64/kernel");
    let down = || {
        cluster.kill();
        poll_blocking(Duration::from_secs(40), || {
            (healthz(&d).0 == 503).then_some(())
        })
        .unwrap_or_else(|| panic!("healthz never said degraded\n{}", d.log_text()));
        assert_eq!(metric(&d, "pxed_store_writable"), Some(0.0));
    };
    let up = || {
        cluster.restart().unwrap();
        poll_blocking(Duration::from_secs(40), || {
            (healthz(&d).0 == 200).then_some(())
        })
        .unwrap_or_else(|| panic!("healthz never recovered\n{}", d.log_text()));
    };
    let post = async |path: &str, body: serde_json::Value| {
        let r = api.http.post(d.url(path)).json(&body).send().await.unwrap();
        let retry = r.headers().get("retry-after").cloned();
        let status = r.status().as_u16();
        assert_eq!(
            retry.is_some(),
            status == 503,
            "Retry-After on a 503 only: {status}"
        );
        (status, r.text().await.unwrap())
    };

    // 1. netbooting: boot files and a safe script are served meanwhile.
    down();
    let first = tempfile::NamedTempFile::new().unwrap();
    let (ok, _, err) = curl(&[&tftp, "-o", first.path().to_str().unwrap()]);
    assert!(ok, "TFTP during the outage: {err}");
    assert!(std::fs::metadata(first.path()).unwrap().len() > 10_000);
    let (ok, body, err) = curl(&["-f", &kernel]);
    assert!(
        ok && body == "kernel x86_64",
        "kernel during the outage: {body}{err}"
    );
    let (ok, body, _) = curl(&["-f", &script]);
    assert!(
        ok && body.contains("store unavailable: booting local disk"),
        "{body}"
    );
    up();
    let before = api.node(&d, id).await;
    assert_eq!(before["state"], "netbooting", "{before}");
    // The machine netboots again: the installer, with its one-time token.
    let text = api.text(&d, &format!("/boot/{MAC}.ipxe")).await;
    assert!(text.contains("/images/rocky-9/x86_64/kernel"), "{text}");
    let i = text.find("/cfg/").unwrap() + 5;
    let token = text[i..].split('/').next().unwrap().to_string();
    api.wait_state(&d, id, "installing", Duration::from_secs(5))
        .await;
    let agent = cluster
        .psql(
            "pxed",
            &format!("SELECT agent_token FROM nodes WHERE id = {id}"),
        )
        .unwrap();

    // 2. installing: the installer's `installed` is refused while the database is
    //    away, and taken when it is back.
    down();
    let (status, body) = post(&format!("/cb/{token}/installed"), serde_json::json!({})).await;
    assert_eq!(status, 503, "acknowledged without a database: {body}");
    assert!(
        body.contains("\"store_unavailable\""),
        "JSON with a reason: {body}"
    );
    up();
    assert_eq!(api.node(&d, id).await["state"], "installing");
    let (status, body) = post(&format!("/cb/{token}/installed"), serde_json::json!({})).await;
    assert_eq!(status, 200, "{body}");
    api.wait_state(&d, id, "first_boot", Duration::from_secs(5))
        .await;

    // 3. first boot: the agent's report is refused, then taken.
    down();
    let facts = serde_json::json!({"hostname": "node-004201", "arch": "x86_64", "facts": {}});
    let (status, body) = post(&format!("/cb/{agent}/first-boot"), facts.clone()).await;
    assert_eq!(status, 503, "acknowledged without a database: {body}");
    up();
    assert_eq!(api.node(&d, id).await["state"], "first_boot");
    api.first_boot_and_health(&d, &agent, "node-004201").await;
    let after = api
        .wait_state(&d, id, "available", Duration::from_secs(10))
        .await;
    assert_eq!(after["hostname"], "node-004201");
    crate::crash::assert_log_kept(&before, &after);
    assert_rows_once(&after);
    let events = after["events"].as_array().unwrap();
    for e in [
        "installer_served",
        "install_finished",
        "first_boot_reported",
        "health_passed",
    ] {
        let n = events.iter().filter(|r| r["event"] == e).count();
        assert_eq!(n, 1, "{e} once: {events:#?}");
    }
}
