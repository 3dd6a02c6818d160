//! BMC faults through the real daemon: a node registered over the API is reinstalled,
//! the lifecycle worker drives the real drivers against sushy-tools (behind
//! `tests/peers/bmc_fault_proxy.py` for injected faults) or OpenIPMI `ipmi_sim`, and the
//! node must end `failed` naming the step and the BMC's message, inside the configured
//! `reclaiming` deadline, with every attempt in the audit log and no password anywhere.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::bmc::{FaultProxy, IpmiSim, NODE1, NODE2, PASSWORD, Sushy};
use crate::common::{Daemon, poll, pxed_bin, repo, run, write_file};

const TOKEN: &str = "bmc-lifecycle-token";
/// The `reclaiming` deadline every test runs with; each fault must end before it.
const RECLAIM_DEADLINE: Duration = Duration::from_secs(20);
/// Lifecycle retries: every fault is tried `MAX_ATTEMPTS + 1` times.
const MAX_ATTEMPTS: usize = 1;

/// A local mirror with the files the rocky-9 catalog entry expects.
fn mirror(dir: &Path) -> String {
    let mirror = dir.join("mirror");
    for arch in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{arch}/os/images/pxeboot");
        write_file(&mirror, &format!("{p}/vmlinuz"), b"kernel");
        write_file(&mirror, &format!("{p}/initrd.img"), b"initrd");
    }
    format!("{}/", mirror.display())
}

/// The daemon with rocky-9 imported, short lifecycle bounds, and `bmc_env` on top.
struct Lab {
    d: Daemon,
    http: reqwest::Client,
    _work: tempfile::TempDir,
}

impl Lab {
    fn start(bmc_env: &[(&str, &str)]) -> Lab {
        pxed::net::install_crypto_provider();
        let work = tempfile::tempdir().unwrap();
        let mirror_env = mirror(work.path());
        let dir = tempfile::tempdir().unwrap();
        let (ok, out, err) = run(Command::new(pxed_bin())
            .current_dir(repo())
            .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
            .arg(dir.path().join("data"))
            .env("PXED_MIRROR_BASE", &mirror_env));
        assert!(ok, "image add: {out}{err}");
        let max_attempts = MAX_ATTEMPTS.to_string();
        let deadline = format!("{}s", RECLAIM_DEADLINE.as_secs());
        let mut env: Vec<(&str, &str)> = vec![
            ("PXED_API_TOKEN", TOKEN),
            ("PXED_MIRROR_BASE", &mirror_env),
            ("PXED_LIFECYCLE__MAX_ATTEMPTS", &max_attempts),
            ("PXED_LIFECYCLE__BACKOFF", "200ms"),
            ("PXED_LIFECYCLE__DEADLINES__RECLAIMING", &deadline),
            ("PXED_BMC__REQUEST_TIMEOUT", "2s"),
            ("PXED_BMC__RETRIES", "1"),
        ];
        env.extend_from_slice(bmc_env);
        Lab {
            d: Daemon::start_in(dir, &[], &env),
            http: reqwest::Client::new(),
            _work: work,
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, String) {
        let mut r = self
            .http
            .request(method, self.d.url(path))
            .bearer_auth(TOKEN);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// Registers a node with `bmc` and returns its id.
    async fn register(&self, mac: &str, bmc: Value) -> i64 {
        let (s, body) = self
            .call(
                reqwest::Method::POST,
                "/api/v1/nodes",
                Some(json!({"macs": [mac], "arch": "x86_64", "bmc": bmc})),
            )
            .await;
        assert_eq!(s, 201, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()["id"]
            .as_i64()
            .unwrap()
    }

    /// `POST /reinstall`, returning when it was sent.
    async fn reinstall(&self, id: i64) -> Instant {
        let t = Instant::now();
        let (s, body) = self
            .call(
                reqwest::Method::POST,
                &format!("/api/v1/nodes/{id}/reinstall"),
                Some(json!({"image": "rocky-9"})),
            )
            .await;
        assert_eq!(s, 202, "{body}");
        t
    }

    async fn node_text(&self, id: i64) -> String {
        let (s, body) = self
            .call(reqwest::Method::GET, &format!("/api/v1/nodes/{id}"), None)
            .await;
        assert_eq!(s, 200, "{body}");
        body
    }

    /// Polls until the node leaves `reclaiming`; returns it and the time since `since`.
    async fn settled(&self, id: i64, since: Instant, timeout: Duration) -> (Value, Duration) {
        let node = async || serde_json::from_str::<Value>(&self.node_text(id).await).unwrap();
        let left = async || Some(node().await).filter(|n| n["state"] != "reclaiming");
        match poll(timeout.saturating_sub(since.elapsed()), left).await {
            Some(n) => (n, since.elapsed()),
            None => panic!(
                "node {id} still reclaiming after {timeout:?}: {:#}\n{}",
                node().await,
                self.d.log_text()
            ),
        }
    }

    /// No secret in the daemon's log, the node's detail or the node list.
    async fn assert_no_secret(&self, id: i64, secrets: &[&str]) {
        let (s, list) = self.call(reqwest::Method::GET, "/api/v1/nodes", None).await;
        assert_eq!(s, 200);
        let detail = self.node_text(id).await;
        let log = self.d.log_text();
        assert!(!log.is_empty());
        for secret in secrets {
            assert!(
                !log.contains(secret),
                "BMC password in the daemon log:\n{log}"
            );
            assert!(
                !detail.contains(secret),
                "BMC password in GET node: {detail}"
            );
            assert!(!list.contains(secret), "BMC password in GET nodes: {list}");
        }
    }
}

fn redfish(address: &str, password: &str, system: &str) -> Value {
    json!({"driver": "redfish", "address": address, "username": "admin",
           "password": password, "system_id": system})
}

/// Asserts the node failed at `step` before the reclaim deadline with a reason
/// containing every one of `reason`, and that each attempt left a `bmc_step_failed`
/// row naming the step and the same message.
fn assert_failed(n: &Value, elapsed: Duration, step: &str, reason: &[&str]) {
    assert_eq!(n["state"], "failed", "{n:#}");
    assert_eq!(n["failed_step"], step, "{n:#}");
    assert!(
        elapsed < RECLAIM_DEADLINE,
        "took {elapsed:?}, deadline {RECLAIM_DEADLINE:?}"
    );
    let why = n["failed_reason"].as_str().unwrap();
    for r in reason {
        assert!(why.contains(r), "failed_reason {why:?} lacks {r:?}");
    }
    let events = n["events"].as_array().unwrap();
    let failures: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "bmc_step_failed")
        .map(|e| e["detail"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(failures.len(), MAX_ATTEMPTS + 1, "{events:#?}");
    for (i, detail) in failures.iter().enumerate() {
        assert!(
            detail.starts_with(&format!("{step} (attempt {i}): ")),
            "{detail}"
        );
        for r in reason {
            assert!(detail.contains(r), "event detail {detail:?} lacks {r:?}");
        }
    }
    let last = events.last().unwrap();
    assert_eq!(last["event"], "bmc_step_failed", "{events:#?}");
    assert_eq!(last["to_state"], "failed");
    println!("failed after {elapsed:?}: {step}: {why}");
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_not_listening_fails_set_netboot_unreachable() {
    let lab = Lab::start(&[]);
    let addr = format!("http://127.0.0.1:{}", crate::bmc::free_tcp_port());
    let id = lab
        .register("52:54:00:20:00:01", redfish(&addr, PASSWORD, NODE2))
        .await;
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE * 2).await;
    assert_failed(
        &n,
        elapsed,
        "set_netboot",
        &["redfish set_netboot", "unreachable", &addr],
    );
    lab.assert_no_secret(id, &[PASSWORD]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_wrong_password_fails_set_netboot_auth_refused() {
    const WRONG: &str = "wr0ng-Pa55word-7f3a";
    let sushy = Sushy::start();
    let lab = Lab::start(&[]);
    let id = lab
        .register("52:54:00:20:00:02", redfish(&sushy.url(), WRONG, NODE2))
        .await;
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE * 2).await;
    assert_failed(
        &n,
        elapsed,
        "set_netboot",
        &["redfish set_netboot", "refused the credentials"],
    );
    lab.assert_no_secret(id, &[WRONG, PASSWORD]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_patch_500_fails_set_netboot_with_status() {
    let sushy = Sushy::start();
    let proxy = FaultProxy::start(&sushy.url(), "patch500");
    let lab = Lab::start(&[]);
    let id = lab
        .register("52:54:00:20:00:03", redfish(&proxy.url(), PASSWORD, NODE2))
        .await;
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE * 2).await;
    assert_failed(
        &n,
        elapsed,
        "set_netboot",
        &[
            "redfish set_netboot",
            "status 500",
            "Internal error while applying boot settings",
        ],
    );
    // A 500 is retried once by the driver ([bmc] retries = 1) on each lifecycle attempt.
    assert_eq!(proxy.stats()["patches"], 2 * (MAX_ATTEMPTS + 1));
    lab.assert_no_secret(id, &[PASSWORD]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redfish_ignored_patch_fails_set_netboot_override_not_applied() {
    let sushy = Sushy::start();
    let proxy = FaultProxy::start(&sushy.url(), "ignore-patch");
    let lab = Lab::start(&[]);
    let id = lab
        .register("52:54:00:20:00:04", redfish(&proxy.url(), PASSWORD, NODE2))
        .await;
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE * 2).await;
    assert_failed(
        &n,
        elapsed,
        "set_netboot",
        &[
            "redfish set_netboot",
            "did not apply the boot override",
            "reads back target=Hdd",
        ],
    );
    let per_call = pxed::bmc::CallPolicy::default().override_attempts as usize;
    assert_eq!(proxy.stats()["patches"], per_call * (MAX_ATTEMPTS + 1));
    // Never power-cycled into the disk.
    assert_eq!(proxy.stats()["resets"], json!([]));
    lab.assert_no_secret(id, &[PASSWORD]).await;
}

/// With the default 180 s power deadline the reclaim deadline would fire first and the
/// node would fail as `reclaiming`; `[bmc] power_deadline` from the environment makes
/// the driver give up in time and name the power step.
#[tokio::test(flavor = "multi_thread")]
async fn redfish_reset_that_never_lands_fails_power_cycle() {
    const POWER_DEADLINE: Duration = Duration::from_secs(3);
    const POLL: Duration = Duration::from_millis(200);
    let sushy = Sushy::start();
    let proxy = FaultProxy::start(&sushy.url(), "reset-noop");
    let lab = Lab::start(&[
        ("PXED_BMC__POWER_DEADLINE", "3s"),
        ("PXED_BMC__RESTART_OBSERVE", "1s"),
        ("PXED_BMC__POLL_INTERVAL", "200ms"),
    ]);
    // NODE1 is Off: power_cycle must power it on, and the dropped reset leaves it Off.
    let id = lab
        .register("52:54:00:20:00:05", redfish(&proxy.url(), PASSWORD, NODE1))
        .await;
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE * 2).await;
    assert_failed(
        &n,
        elapsed,
        "power_cycle",
        &[
            "redfish power_cycle",
            "acknowledged On",
            "power stayed Off for ",
        ],
    );
    // The driver polled for the configured deadline: its last poll starts at most one
    // interval short of it (and its answer may land a little after).
    let why = n["failed_reason"].as_str().unwrap();
    let waited: f64 = why
        .rsplit("for ")
        .next()
        .and_then(|w| w.strip_suffix('s'))
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no wait in {why:?}"));
    let waited = Duration::from_secs_f64(waited);
    assert!(
        waited > POWER_DEADLINE - POLL && waited < POWER_DEADLINE + Duration::from_secs(1),
        "waited {waited:?}"
    );
    assert!(
        elapsed >= (POWER_DEADLINE - POLL) * (MAX_ATTEMPTS as u32 + 1),
        "{elapsed:?}"
    );
    // The boot override was set once; the power step alone was retried.
    let s = proxy.stats();
    assert_eq!(s["resets"], json!(["On", "On"]), "{s}");
    assert_eq!(s["patches"], 1, "{s}");
    lab.assert_no_secret(id, &[PASSWORD]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ipmi_reinstall_reaches_netbooting() {
    let sim = IpmiSim::start();
    sim.ready().await;
    let lab = Lab::start(&[]);
    let id = lab
        .register(
            "52:54:00:20:00:06",
            json!({"driver": "ipmi", "address": format!("127.0.0.1:{}", sim.port),
                   "username": "admin", "password": PASSWORD}),
        )
        .await;
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE).await;
    assert_eq!(n["state"], "netbooting", "{n:#}\n{}", lab.d.log_text());
    let events: Vec<&str> = n["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert!(!events.contains(&"bmc_step_failed"), "{events:?}");
    assert_eq!(
        &events[events.len() - 3..],
        ["reinstall_requested", "netboot_set", "power_cycled"],
        "{events:?}"
    );
    let log = sim.chassis_log();
    let sets: Vec<&str> = log.lines().filter(|l| l.contains(" set ")).collect();
    let boot = sets
        .iter()
        .position(|l| l.ends_with("set boot pxe"))
        .unwrap_or_else(|| panic!("no PXE boot device set:\n{log}"));
    let power_on = sets
        .iter()
        .rposition(|l| l.ends_with("set power 1"))
        .unwrap_or_else(|| panic!("no power on:\n{log}"));
    assert!(boot < power_on, "boot device set after power:\n{log}");
    assert_eq!(
        std::fs::read_to_string(sim.dir_path().join("chassis/power"))
            .unwrap()
            .trim(),
        "1"
    );
    println!("ipmi reinstall reached netbooting after {elapsed:?}\n{log}");

    // Again, now that the node is On: marked failed, reinstalled, and this time the
    // BMC power-cycles it (off, then on) after setting PXE again.
    let (s, body) = lab
        .call(
            reqwest::Method::POST,
            &format!("/api/v1/nodes/{id}/actions/fail"),
            Some(json!({"reason": "test: reinstall again"})),
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let before = sets.len();
    let t = lab.reinstall(id).await;
    let (n, elapsed) = lab.settled(id, t, RECLAIM_DEADLINE).await;
    assert_eq!(n["state"], "netbooting", "{n:#}\n{}", lab.d.log_text());
    let log = sim.chassis_log();
    let again: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" set "))
        .skip(before)
        .map(|l| l.split_once(" 0x20 ").map(|x| x.1).unwrap_or(l))
        .collect();
    assert_eq!(
        again,
        ["set boot pxe", "set power 0", "set power 1"],
        "{log}"
    );
    println!("ipmi power-cycle reinstall reached netbooting after {elapsed:?}\n{log}");
    lab.assert_no_secret(id, &[PASSWORD]).await;
}
