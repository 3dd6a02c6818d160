//! BMC faults through the real daemon: a node registered over the API is reinstalled,
//! the lifecycle worker drives the real drivers against sushy-tools (behind
//! `tests/peers/bmc_fault_proxy.py` for injected faults) or OpenIPMI `ipmi_sim`, and the
//! node must end `failed` naming the step and the BMC's message, inside the configured
//! `reclaiming` deadline, with every attempt in the audit log and no password anywhere.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::bmc::{IpmiSim, NODE1, NODE2, PASSWORD, Peer, Sushy};
use crate::common::{Daemon, poll, repo, run, write_file};
use pxed::bmc::Driver;

const TOKEN: &str = "bmc-lifecycle-token";
/// The `reclaiming` deadline every test runs with; each fault must end before it.
const RECLAIM_DEADLINE: Duration = Duration::from_secs(20);
/// Lifecycle retries: every fault is tried `MAX_ATTEMPTS + 1` times.
const MAX_ATTEMPTS: usize = 1;
/// `[bmc] power_deadline` and `poll_interval` of the fault lab: with the default 180 s
/// the reclaim deadline would fire first and the node would fail as `reclaiming`.
const POWER_DEADLINE: Duration = Duration::from_secs(3);
const POLL: Duration = Duration::from_millis(200);

/// A local mirror with the files the rocky-9 catalog entry expects.
fn mirror(dir: &Path) -> String {
    let mirror = dir.join("mirror");
    crate::image_check::rocky_repo_metadata(&mirror);
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
        let (ok, out, err) = run(crate::common::pxed_on(dir.path())
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

    async fn metrics(&self) -> String {
        let resp = self.http.get(self.d.url("/metrics")).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap()
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

    /// No secret in the daemon's log, the node's detail, the node list or `/metrics`.
    async fn assert_no_secret(&self, id: i64, secrets: &[&str]) {
        let (s, list) = self.call(reqwest::Method::GET, "/api/v1/nodes", None).await;
        assert_eq!(s, 200);
        let detail = self.node_text(id).await;
        let log = self.d.log_text();
        let metrics = self.metrics().await;
        assert!(!log.is_empty());
        for secret in secrets {
            assert!(!metrics.contains(secret), "BMC password in /metrics");
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

/// A fault of the node's Redfish BMC, and how the reclaim must end on it.
struct Fault {
    name: &'static str,
    peer: Peer,
    password: &'static str,
    system: &'static str,
    /// The step named in `failed_step`.
    step: &'static str,
    /// The `BmcError` kind in the reason and in `pxed_bmc_failures_total`.
    kind: &'static str,
    /// Substrings of `failed_reason` and of every `bmc_step_failed` row.
    says: &'static [&'static str],
    /// What the fault proxy saw over all attempts: PATCHes, and the resets sent.
    proxy_saw: Option<(usize, &'static [&'static str])>,
}

const FAULTS: &[Fault] = &[
    Fault {
        name: "nothing listens",
        peer: Peer::Silent(Driver::Redfish),
        password: PASSWORD,
        system: NODE2,
        step: "set_netboot",
        kind: "unreachable",
        says: &["unreachable during login", "Connection refused"],
        proxy_saw: None,
    },
    Fault {
        name: "wrong password",
        peer: Peer::Sushy,
        password: "wr0ng-Pa55word-7f3a",
        system: NODE2,
        step: "set_netboot",
        kind: "auth_refused",
        says: &["refused the credentials"],
        proxy_saw: None,
    },
    // A 500 is retried once by the driver ([bmc] retries = 1) on each lifecycle attempt.
    Fault {
        name: "PATCH answers 500",
        peer: Peer::Proxy("patch500"),
        password: PASSWORD,
        system: NODE2,
        step: "set_netboot",
        kind: "protocol",
        says: &["status 500", "Internal error while applying boot settings"],
        proxy_saw: Some((2 * (MAX_ATTEMPTS + 1), &[])),
    },
    // Written three times (CallPolicy's default override_attempts) per lifecycle
    // attempt, and never power-cycled into the disk.
    Fault {
        name: "PATCH ignored",
        peer: Peer::Proxy("ignore-patch"),
        password: PASSWORD,
        system: NODE2,
        step: "set_netboot",
        kind: "override_not_applied",
        says: &["did not apply the boot override", "reads back target=Hdd"],
        proxy_saw: Some((3 * (MAX_ATTEMPTS + 1), &[])),
    },
    // NODE1 is Off: power_cycle must power it on, and the dropped reset leaves it Off.
    // The boot override was set once; the power step alone is retried.
    Fault {
        name: "reset never lands",
        peer: Peer::Proxy("reset-noop"),
        password: PASSWORD,
        system: NODE1,
        step: "power_cycle",
        kind: "power_did_not_change",
        says: &["acknowledged On", "power stayed Off for "],
        proxy_saw: Some((1, &["On", "On"])),
    },
];

/// Asserts the node failed at the case's step before the reclaim deadline with a
/// reason that names driver, step and kind and has every one of `says`, and that each
/// attempt left a `bmc_step_failed` row saying the same.
fn assert_failed(c: &Fault, n: &Value, elapsed: Duration) {
    let name = c.name;
    assert_eq!(n["state"], "failed", "{name}: {n:#}");
    assert_eq!(n["failed_step"], c.step, "{name}: {n:#}");
    assert!(
        elapsed < RECLAIM_DEADLINE,
        "{name}: took {elapsed:?}, deadline {RECLAIM_DEADLINE:?}"
    );
    let head = format!("redfish {} [{}]: ", c.step, c.kind);
    let why = n["failed_reason"].as_str().unwrap();
    let events = n["events"].as_array().unwrap();
    let failures: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "bmc_step_failed")
        .map(|e| e["detail"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(failures.len(), MAX_ATTEMPTS + 1, "{name}: {events:#?}");
    for (i, detail) in failures.iter().enumerate() {
        let attempt = format!("{} (attempt {i}): {head}", c.step);
        assert!(detail.starts_with(&attempt), "{name}: {detail}");
    }
    for text in failures.iter().chain([&why]) {
        assert!(text.contains(&head), "{name}: {text:?} lacks {head:?}");
        for s in c.says {
            assert!(text.contains(s), "{name}: {text:?} lacks {s:?}");
        }
    }
    let last = events.last().unwrap();
    assert_eq!(last["event"], "bmc_step_failed", "{name}: {events:#?}");
    assert_eq!(last["to_state"], "failed", "{name}");
    println!("{name}: failed after {elapsed:?}: {why}");
}

/// The driver polled for the configured deadline: its last poll starts at most one
/// interval short of it (and its answer may land a little after); every attempt did.
fn assert_waited_power_deadline(why: &str, elapsed: Duration) {
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
}

/// Every fault on its own node of one daemon, reclaimed at once: each node fails
/// naming step and kind, and `/metrics` counts every attempt by driver, step and kind.
#[tokio::test(flavor = "multi_thread")]
async fn redfish_faults_fail_the_reclaim_named_and_counted() {
    let sushy = Sushy::start();
    let (deadline, poll) = (
        format!("{}s", POWER_DEADLINE.as_secs()),
        format!("{}ms", POLL.as_millis()),
    );
    let lab = Lab::start(&[
        ("PXED_BMC__POWER_DEADLINE", &deadline),
        ("PXED_BMC__RESTART_OBSERVE", "1s"),
        ("PXED_BMC__POLL_INTERVAL", &poll),
    ]);
    let mut nodes = vec![];
    for (i, c) in FAULTS.iter().enumerate() {
        let peer = c.peer.start(Some(&sushy)).await;
        let mac = format!("52:54:00:20:00:{:02x}", i + 1);
        let id = lab
            .register(&mac, redfish(&peer.address, c.password, c.system))
            .await;
        nodes.push((c, peer, id));
    }
    let lab = &lab;
    // Each reclaim is timed from its own request, polled on its own.
    let settled = futures::future::join_all(nodes.iter().map(|&(_, _, id)| async move {
        let t = lab.reinstall(id).await;
        lab.settled(id, t, RECLAIM_DEADLINE * 2).await
    }))
    .await;
    let metrics = lab.metrics().await;
    for ((c, peer, id), (n, elapsed)) in nodes.iter().zip(settled) {
        assert_failed(c, &n, elapsed);
        let why = n["failed_reason"].as_str().unwrap();
        if c.kind == "unreachable" {
            assert!(why.contains(&peer.address), "{}: {why}", c.name);
        }
        if c.kind == "power_did_not_change" {
            assert_waited_power_deadline(why, elapsed);
        }
        if let Some((patches, resets)) = c.proxy_saw {
            let s = peer.proxy.as_ref().unwrap().stats();
            assert_eq!(s["patches"], patches, "{}: {s}", c.name);
            assert_eq!(s["resets"], json!(resets), "{}: {s}", c.name);
        }
        let sample = format!(
            "pxed_bmc_failures_total{{driver=\"redfish\",step=\"{}\",kind=\"{}\"}} {}",
            c.step,
            c.kind,
            MAX_ATTEMPTS + 1
        );
        assert!(
            metrics.lines().any(|l| l == sample),
            "{}: no {sample:?} in\n{metrics}",
            c.name
        );
        lab.assert_no_secret(*id, &[PASSWORD, c.password]).await;
    }
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
    let metrics = lab.metrics().await;
    assert!(
        metrics.contains("# TYPE pxed_bmc_failures_total counter"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("pxed_bmc_failures_total{"),
        "a BMC step that worked was counted as failed:\n{metrics}"
    );
    lab.assert_no_secret(id, &[PASSWORD]).await;
}
