//! The real binary killed with SIGKILL while a node is in each in-progress state; after
//! a restart the node continues (or fails with a reason when its deadline fires) and
//! nothing in the audit log is lost. The BMC is a real Redfish emulator (sushy-tools).

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};

use crate::bmc::{FaultProxy, NODE1, NODE2, PASSWORD, Sushy};
use crate::common::{Api, Daemon, repo, run, wait_for, write_file};

const TOKEN: &str = "crash-token";

fn events(n: &Value) -> Vec<Value> {
    n["events"].as_array().cloned().unwrap_or_default()
}

/// Every audit row from before the crash is still there, unchanged and in order.
pub(crate) fn assert_log_kept(before: &Value, after: &Value) {
    let (b, a) = (events(before), events(after));
    assert!(a.len() >= b.len(), "audit rows lost: {b:#?} -> {a:#?}");
    assert_eq!(&a[..b.len()], &b[..], "audit rows changed");
}

/// A local "mirror" under `work` with the layout the rocky-9 catalog entry expects;
/// its base URL (a directory path) for `PXED_MIRROR_BASE`.
pub(crate) fn rocky_mirror(work: &std::path::Path) -> String {
    let mirror = work.join("mirror");
    crate::image_check::rocky_repo_metadata(&mirror);
    for arch in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{arch}/os/images/pxeboot");
        write_file(
            &mirror,
            &format!("{p}/vmlinuz"),
            format!("kernel {arch}").as_bytes(),
        );
        write_file(
            &mirror,
            &format!("{p}/initrd.img"),
            format!("initrd {arch}").as_bytes(),
        );
    }
    format!("{}/", mirror.display())
}

/// Every audit row appears once: ids rise, and no row repeats the one before it
/// (an event applied twice by two instances would).
pub(crate) fn assert_rows_once(n: &Value) {
    let ev = events(n);
    for w in ev.windows(2) {
        assert!(w[0]["id"].as_i64() < w[1]["id"].as_i64(), "{ev:#?}");
        let key = |e: &Value| {
            (
                e["event"].clone(),
                e["from_state"].clone(),
                e["to_state"].clone(),
            )
        };
        assert_ne!(key(&w[0]), key(&w[1]), "an audit row twice: {ev:#?}");
    }
}

/// Registers a node per (MAC, Redfish system, BMC URL) through `d`'s API; their ids.
pub(crate) async fn add_redfish_nodes<const N: usize>(
    api: &Api,
    d: &Daemon,
    nodes: [(&str, &str, String); N],
) -> Vec<i64> {
    let mut ids = Vec::new();
    for (mac, system, bmc) in nodes {
        let (s, v) = api
            .call(
                d,
                reqwest::Method::POST,
                "/api/v1/nodes",
                Some(json!({"macs": [mac], "arch": "x86_64", "bmc": {
                    "driver": "redfish", "address": bmc, "username": "admin",
                    "password": PASSWORD, "system_id": system}})),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        ids.push(v["id"].as_i64().unwrap());
    }
    ids
}

/// Asks `d` to reinstall node `id` with rocky-9; the API's answer must be 202.
pub(crate) async fn reinstall(api: &Api, d: &Daemon, id: i64) {
    let (s, v) = api
        .call(
            d,
            reqwest::Method::POST,
            &format!("/api/v1/nodes/{id}/reinstall"),
            Some(json!({"image": "rocky-9"})),
        )
        .await;
    assert_eq!(s, 202, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_in_every_in_progress_state_resumes() {
    let sushy = Sushy::start();
    // Node a's BMC answers its reset 5 s late, so the daemon can die with the power
    // cycle sent and unanswered; the proxy counts every reset that reaches the BMC.
    let proxy = FaultProxy::start(&sushy.url(), "slow-reset");
    let work = tempfile::tempdir().unwrap();
    let mirror_env = rocky_mirror(work.path());
    let env: Vec<(&str, &str)> = vec![
        ("PXED_API_TOKEN", TOKEN),
        ("PXED_MIRROR_BASE", &mirror_env),
        ("PXED_LIFECYCLE__MAX_ATTEMPTS", "0"),
        ("PXED_LIFECYCLE__DEADLINES__NETBOOTING", "6s"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (ok, out, err) = run(crate::common::pxed_on(dir.path())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(&data)
        .env("PXED_MIRROR_BASE", &mirror_env));
    assert!(ok, "image add: {out}{err}");
    assert!(out.contains("sha256"), "{out}");

    let mut d = Daemon::start_in(dir, &[], &env);
    pxed::net::install_crypto_provider();
    let api = Api::new(TOKEN);
    let ids = add_redfish_nodes(
        &api,
        &d,
        [
            ("52:54:00:12:34:56", NODE1, proxy.url()),
            ("52:54:00:12:34:57", NODE2, sushy.url()),
        ],
    )
    .await;
    let (a, b) = (ids[0], ids[1]);
    let restart = |d: Daemon| {
        let dir = d.kill_keep_dir(Signal::SIGKILL);
        Daemon::start_in(dir, &[], &env)
    };

    // reclaiming: killed while the BMC power action is in flight: the reset reached
    // the BMC and its answer had not come back. After the restart the machine is
    // checked, not reset a second time (issue 10, finding 8: a double reboot).
    reinstall(&api, &d, a).await;
    wait_for(
        "the reset to reach the BMC",
        Duration::from_secs(20),
        || (proxy.stats()["resets"].as_array().unwrap().len() == 1).then_some(()),
    );
    let before = api.node(&d, a).await;
    assert_eq!(before["state"], "reclaiming");
    d = restart(d);
    let after = api
        .wait_state(&d, a, "netbooting", Duration::from_secs(90))
        .await;
    assert_log_kept(&before, &after);
    assert!(d.logged("resumed"), "{}", d.log_text());
    let stats = proxy.stats();
    assert_eq!(stats["resets"].as_array().unwrap().len(), 1, "{stats}");
    assert_eq!(stats["patches"], 1, "netboot not set again: {stats}");
    assert!(
        d.logged("power cycle was sent before a restart"),
        "{}",
        d.log_text()
    );

    // netbooting -> installing: the script serves the installer once.
    let (_, script) = {
        let r = api
            .http
            .get(d.url("/boot/52:54:00:12:34:56.ipxe"))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert!(script.contains("/images/rocky-9/x86_64/kernel"), "{script}");
    let i = script.find("/cfg/").unwrap() + 5;
    let token = script[i..].split('/').next().unwrap().to_string();
    let before = api
        .wait_state(&d, a, "installing", Duration::from_secs(5))
        .await;
    // The first-boot agent's own token (written into the installed system; the
    // config that carries it cannot render against this test's directory mirror).
    let agent = crate::common::agent_token_of(&d.data_dir(), a).await;
    // The installer's kernel is served by pxed from the imported, checksummed copy.
    let k = api
        .http
        .get(d.url("/images/rocky-9/x86_64/kernel"))
        .send()
        .await
        .unwrap();
    assert_eq!(k.text().await.unwrap(), "kernel x86_64");

    // installing: killed, the installer's callback after the restart still counts.
    d = restart(d);
    let r = api
        .http
        .post(d.url(&format!("/cb/{token}/installed")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let after = api
        .wait_state(&d, a, "first_boot", Duration::from_secs(5))
        .await;
    assert_log_kept(&before, &after);

    // first_boot: killed; the agent's reports after the restart finish the job.
    let before = after;
    d = restart(d);
    api.first_boot_and_health(&d, &agent, "node-123456").await;
    let after = api
        .wait_state(&d, a, "available", Duration::from_secs(5))
        .await;
    assert_log_kept(&before, &after);
    assert_eq!(after["hostname"], "node-123456");

    // netbooting: killed and never fetches its script; the deadline armed before the
    // crash fires after the restart and the node fails naming the stage.
    reinstall(&api, &d, b).await;
    let before = api
        .wait_state(&d, b, "netbooting", Duration::from_secs(90))
        .await;
    d = restart(d);
    let after = api
        .wait_state(&d, b, "failed", Duration::from_secs(30))
        .await;
    assert_eq!(after["failed_step"], "netbooting");
    let reason = after["failed_reason"].as_str().unwrap();
    assert!(reason.starts_with("deadline: never netbooted"), "{reason}");
    assert_log_kept(&before, &after);
    assert_eq!(events(&after).last().unwrap()["event"], "deadline_expired");
}
