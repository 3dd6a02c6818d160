//! Outgoing webhooks from the real binary to a receiver in the test: every state change
//! once, in order per node, signed; also across a pxed restart while the receiver was
//! down. And `pxed node wait` against the real daemon.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};

use crate::common::{Api, Daemon, poll, pxed_bin, repo, write_file};

const TOKEN: &str = "hooks-token";
const SECRET: &str = "hook-secret-5f1d2c";

/// What the receiver got: (event id header, signature header, body).
type Got = Arc<Mutex<Vec<(String, String, String)>>>;

/// A webhook receiver on a fixed loopback port that can be stopped and started again.
struct Receiver {
    port: u16,
    got: Got,
    /// When each request arrived.
    times: Arc<Mutex<Vec<std::time::Instant>>>,
    stop: Option<tokio_util::sync::CancellationToken>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut r = Receiver {
            port: l.local_addr().unwrap().port(),
            got: Got::default(),
            times: Arc::default(),
            stop: None,
            task: None,
        };
        r.serve(l);
        r
    }

    fn serve(&mut self, l: tokio::net::TcpListener) {
        let (got, times) = (self.got.clone(), self.times.clone());
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let (got, times) = (got.clone(), times.clone());
                    async move {
                        times.lock().unwrap().push(std::time::Instant::now());
                        let h = |k: &str| {
                            headers
                                .get(k)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string()
                        };
                        got.lock().unwrap().push((
                            h("x-pxed-event-id"),
                            h("x-pxed-signature"),
                            String::from_utf8(body.to_vec()).unwrap(),
                        ));
                        "ok"
                    }
                },
            ),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        self.task = Some(tokio::spawn(async move {
            axum::serve(l, app)
                .with_graceful_shutdown(async move { s.cancelled().await })
                .await
                .unwrap();
        }));
        self.stop = Some(stop);
    }

    /// Stops listening: connections are refused until [`Receiver::restart`].
    async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            s.cancel();
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }

    async fn restart(&mut self) {
        let l = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        self.serve(l);
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }
}

/// HMAC-SHA256 with ring (not pxed's code), as a receiver in another stack would.
fn signature_ok(body: &str, header: &str) -> bool {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET.as_bytes());
    let Some(hex_sig) = header.strip_prefix("sha256=") else {
        return false;
    };
    let Ok(sig) = hex::decode(hex_sig) else {
        return false;
    };
    ring::hmac::verify(&key, body.as_bytes(), &sig).is_ok()
}

fn config(dir: &Path, url: &str) -> String {
    let p = write_file(
        dir,
        "pxed.toml",
        format!(
            r#"[webhooks]
backoff = "50ms"
max_backoff = "400ms"
timeout = "2s"

[[webhooks.targets]]
url = "{url}"
secret = "{SECRET}"
"#
        )
        .as_bytes(),
    );
    p.display().to_string()
}

const ENV: &[(&str, &str)] = &[
    ("PXED_API_TOKEN", TOKEN),
    // A node without a BMC fails its reinstall at once: a real worker-driven change.
    ("PXED_LIFECYCLE__MAX_ATTEMPTS", "0"),
    // Named, never imported: the reinstall fails at the BMC before it is needed.
    ("PXED_DEFAULT_IMAGE", "rocky-9"),
];

async fn post(api: &Api, d: &Daemon, path: &str, body: Value) -> Value {
    let (s, v) = api.call(d, reqwest::Method::POST, path, Some(body)).await;
    assert!((200..300).contains(&s), "{path}: {s} {v}");
    v
}

async fn add_node(api: &Api, d: &Daemon, name: &str, mac: &str) -> i64 {
    post(
        api,
        d,
        "/api/v1/nodes",
        json!({"macs": [mac], "name": name}),
    )
    .await["id"]
        .as_i64()
        .unwrap()
}

async fn act(api: &Api, d: &Daemon, id: i64, action: &str) {
    post(
        api,
        d,
        &format!("/api/v1/nodes/{id}/actions/{action}"),
        json!({"reason": format!("test {action}")}),
    )
    .await;
}

/// Reinstall a BMC-less node and wait for it to fail (reclaiming -> failed).
async fn failed_reinstall(api: &Api, d: &Daemon, id: i64) -> i64 {
    let op = post(api, d, &format!("/api/v1/nodes/{id}/reinstall"), json!({})).await;
    api.wait_state(d, id, "failed", Duration::from_secs(30))
        .await;
    op["generation"].as_i64().unwrap()
}

/// The state changes in a node's audit log: (event, generation, from, to).
async fn changes(api: &Api, d: &Daemon, id: i64) -> Vec<(String, i64, String, String)> {
    api.node(d, id).await["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| !e["from_state"].is_null() && e["from_state"] != e["to_state"])
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_string(),
                e["generation"].as_i64().unwrap(),
                e["from_state"].as_str().unwrap().to_string(),
                e["to_state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Checks everything received: each signature, each id once (header = body), ids rising,
/// and per node exactly the audit log's state changes in order. Returns the count.
async fn check_received(r: &Receiver, api: &Api, d: &Daemon, nodes: &[i64]) -> usize {
    let got = r.got.lock().unwrap().clone();
    let mut per_node: HashMap<i64, Vec<(String, i64, String, String)>> = HashMap::new();
    let mut last_id = 0;
    for (id_header, sig, body) in &got {
        assert!(signature_ok(body, sig), "bad signature {sig} for {body}");
        let v: Value = serde_json::from_str(body).unwrap();
        let id = v["id"].as_i64().unwrap();
        assert_eq!(id_header, &id.to_string());
        assert!(
            id > last_id,
            "ids out of order or repeated: {id} after {last_id}"
        );
        last_id = id;
        assert!(!v["at"].as_str().unwrap().is_empty());
        assert!(
            v["node"]["macs"].as_array().is_some_and(|m| m.len() == 1),
            "{v}"
        );
        per_node
            .entry(v["node"]["id"].as_i64().unwrap())
            .or_default()
            .push((
                v["event"].as_str().unwrap().to_string(),
                v["generation"].as_i64().unwrap(),
                v["from"].as_str().unwrap().to_string(),
                v["to"].as_str().unwrap().to_string(),
            ));
        if v["to"] == "failed" {
            assert!(
                v["reason"].as_str().is_some_and(|s| !s.is_empty()),
                "a failure without its reason: {v}"
            );
        }
    }
    for id in nodes {
        assert_eq!(
            per_node.remove(id).unwrap_or_default(),
            changes(api, d, *id).await,
            "node {id}: received vs audit log"
        );
    }
    assert!(
        per_node.is_empty(),
        "events for unknown nodes: {per_node:?}"
    );
    got.len()
}

async fn wait_count(r: &Receiver, d: &Daemon, n: usize) {
    let reached = async || (r.count() >= n).then_some(());
    if poll(Duration::from_secs(30), reached).await.is_none() {
        panic!("receiver got {} of {n} events\n{}", r.count(), d.log_text());
    }
}

fn metric(text: &str, line_prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Polls `d`'s `/metrics` for up to 20 s until the sample `line_prefix` is at least
/// `at_least`; else fails with `why` and the daemon's log.
async fn metric_reaches(api: &Api, d: &Daemon, line_prefix: &str, at_least: f64, why: &str) {
    let reached = async || {
        let m = api.text(d, "/metrics").await;
        (metric(&m, line_prefix) >= at_least).then_some(())
    };
    assert!(
        poll(Duration::from_secs(20), reached).await.is_some(),
        "{why}\n{}",
        d.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_change_arrives_once_in_order_signed_across_a_restart() {
    pxed::net::install_crypto_provider();
    let mut r = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &r.url());
    let args = ["--config", cfg.as_str()];
    let mut d = Daemon::start_in(dir, &args, ENV);
    let api = Api::new(TOKEN);
    let a = add_node(&api, &d, "hook-a", "52:54:00:00:31:01").await;
    let b = add_node(&api, &d, "hook-b", "52:54:00:00:31:02").await;

    // Receiver up: operator actions on a, a worker-driven failure on b.
    for action in ["allocate", "release", "quarantine", "restore"] {
        act(&api, &d, a, action).await;
    }
    failed_reinstall(&api, &d, b).await;
    wait_count(&r, &d, 6).await;
    assert_eq!(check_received(&r, &api, &d, &[a, b]).await, 6);

    // Receiver down; changes before and after a SIGKILL of pxed are all kept.
    r.stop().await;
    act(&api, &d, a, "allocate").await;
    act(&api, &d, a, "fail").await;
    failed_reinstall(&api, &d, b).await;
    // Attempts against the stopped receiver are counted. Read before the kill: the
    // counters are this process's, and the next one may find the receiver back
    // before its first attempt.
    metric_reaches(
        &api,
        &d,
        "pxed_webhook_deliveries_total{result=\"unreachable\"}",
        1.0,
        "no attempt against the stopped receiver was counted",
    )
    .await;
    let dir = d.kill_keep_dir(Signal::SIGKILL);
    d = Daemon::start_in(dir, &args, ENV);
    failed_reinstall(&api, &d, a).await;
    // The gauge is refreshed by the pruner (after each queued event): poll it.
    metric_reaches(
        &api,
        &d,
        "pxed_webhook_queue_depth{target=\"0\"}",
        6.0,
        "queue depth never showed the 6 waiting events",
    )
    .await;
    assert_eq!(r.count(), 6, "nothing can have arrived while down");

    // Receiver back: the 4 + 2 changes queued while it was down arrive, in order, once.
    r.restart().await;
    wait_count(&r, &d, 12).await;
    // Nothing more than that comes (no duplicate from a retry or the restart).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(check_received(&r, &api, &d, &[a, b]).await, 12);
    let m = api.text(&d, "/metrics").await;
    assert!(
        metric(&m, "pxed_webhook_deliveries_total{result=\"delivered\"}") >= 6.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "pxed_webhook_dropped_total{target=\"0\"}"),
        0.0,
        "{m}"
    );
    assert!(
        !d.log_text().contains(SECRET),
        "the webhook secret reached the log"
    );
    r.stop().await;
}

/// `pxed check-config` masks the webhook secret.
#[test]
fn check_config_masks_the_webhook_secret() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "https://hooks.example/pxed");
    let (ok, out, err) = crate::common::run(Command::new(pxed_bin()).current_dir(repo()).args([
        "check-config",
        "--demo",
        "--config",
        &cfg,
    ]));
    assert!(ok, "{err}");
    assert!(out.contains("https://hooks.example/pxed"), "{out}");
    assert!(!out.contains(SECRET), "{out}");
}

/// Runs `pxed node wait` against `d`; returns (exit code, stdout, stderr).
fn wait_cmd(d: &Daemon, args: &[&str]) -> std::process::Child {
    Command::new(pxed_bin())
        .args(["node", "wait"])
        .args(args)
        .args(["--interval", "100ms"])
        .env("PXED_URL", d.url(""))
        .env("PXED_API_TOKEN", TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish(c: std::process::Child) -> (i32, String, String) {
    let out = c.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn node_wait_exits_by_outcome() {
    pxed::net::install_crypto_provider();
    let d = Daemon::start_in(tempfile::tempdir().unwrap(), &[], ENV);
    let api = Api::new(TOKEN);
    let n = add_node(&api, &d, "wait-me", "52:54:00:00:32:01").await;

    // Allocated; the wait returns 0 once it is released to available.
    act(&api, &d, n, "allocate").await;
    let w = wait_cmd(&d, &["wait-me", "--state", "available", "--timeout", "30s"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    act(&api, &d, n, "release").await;
    let (code, out, err) = finish(w);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("available"), "{out}");

    // Available at generation 0: a wait for generation 1 does not take it (timeout, 5).
    let (code, _, err) = finish(wait_cmd(
        &d,
        &["wait-me", "--generation", "1", "--timeout", "1s"],
    ));
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("did not reach available"), "{err}");

    // The reinstall fails (no BMC): exit 3 with pxed's reason.
    let op = post(&api, &d, &format!("/api/v1/nodes/{n}/reinstall"), json!({})).await;
    let g = op["generation"].as_i64().unwrap().to_string();
    let (code, _, err) = finish(wait_cmd(
        &d,
        &["wait-me", "--generation", &g, "--timeout", "30s"],
    ));
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("failed"), "{err}");
    assert!(err.contains("no BMC is configured"), "{err}");

    // Quarantined: exit 4 with the operator's reason.
    act(&api, &d, n, "quarantine").await;
    let (code, _, err) = finish(wait_cmd(&d, &["wait-me", "--timeout", "30s"]));
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("test quarantine"), "{err}");

    // An unknown node is an error (1), not a wait.
    let (code, _, err) = finish(wait_cmd(&d, &["no-such-node", "--timeout", "30s"]));
    assert_eq!(code, 1, "{err}");
}

struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// contrib/webhook/pxed-webhook-receiver between pxed and a scheduler: it runs the
/// command for the state a node entered, with the event in its environment, once per
/// event; a bad signature runs nothing.
#[tokio::test(flavor = "multi_thread")]
async fn the_contrib_receiver_runs_the_command_of_each_state_once() {
    use std::io::BufRead;
    crate::common::need("python3");
    pxed::net::install_crypto_provider();
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("out");
    let mut child = Command::new("python3")
        .arg(repo().join("contrib/webhook/pxed-webhook-receiver"))
        .args(["--listen", "127.0.0.1:0", "--state-file"])
        .arg(work.path().join("state"))
        .arg(format!(
            "--on=available=echo \"$PXED_NODE_NAME $PXED_GENERATION $PXED_FROM $PXED_NODE_MACS\" >> {}",
            out.display()
        ))
        .arg(format!(
            "--on=failed=echo \"$PXED_NODE_NAME failed: $PXED_REASON\" >> {}",
            out.display()
        ))
        .env("PXED_WEBHOOK_SECRET", SECRET)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let _rx = Proc(child);
    let addr = first
        .trim()
        .strip_prefix("listening on ")
        .expect(&first)
        .to_string();
    let url = format!("http://{addr}/");

    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &url);
    let d = Daemon::start_in(dir, &["--config", cfg.as_str()], ENV);
    let api = Api::new(TOKEN);
    let n = add_node(&api, &d, "rx-a", "52:54:00:00:33:01").await;
    act(&api, &d, n, "allocate").await;
    act(&api, &d, n, "release").await;
    failed_reinstall(&api, &d, n).await;
    let lines = async || {
        let t = std::fs::read_to_string(&out).unwrap_or_default();
        (t.lines().count() >= 2).then_some(t)
    };
    let text = match poll(Duration::from_secs(30), lines).await {
        Some(t) => t,
        None => panic!("commands did not run\n{}", d.log_text()),
    };
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "rx-a 0 allocated 52:54:00:00:33:01", "{text}");
    assert!(lines[1].starts_with("rx-a failed: "), "{text}");
    assert!(lines[1].contains("no BMC is configured"), "{text}");

    // A forged event runs nothing; a repeated one is acknowledged and skipped.
    let http = reqwest::Client::new();
    let forged = r#"{"id":999,"to":"available","node":{"id":1,"name":"evil"}}"#;
    let r = http
        .post(&url)
        .header("X-Pxed-Signature", "sha256=00")
        .body(forged)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let replay = r#"{"id":1,"to":"available","node":{"id":1,"name":"again"}}"#;
    let r = http
        .post(&url)
        .header(
            "X-Pxed-Signature",
            pxed::webhook::sign(SECRET.as_bytes(), replay.as_bytes()),
        )
        .body(replay)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        text,
        "a replay ran again"
    );
}

/// 100 state changes through the API, one after the other: each arrives, once and in
/// order. It prints (never asserts) the time from the API's answer to the receiver's
/// receipt: `cargo test --test integration webhooks::a_hundred -- --nocapture`.
#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_changes_arrive_in_order() {
    pxed::net::install_crypto_provider();
    let r = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &r.url());
    let d = Daemon::start_in(dir, &["--config", cfg.as_str()], ENV);
    let api = Api::new(TOKEN);
    let n = add_node(&api, &d, "lat", "52:54:00:00:34:01").await;
    let mut lat = Vec::new();
    let start = std::time::Instant::now();
    for i in 0..100 {
        act(&api, &d, n, if i % 2 == 0 { "allocate" } else { "release" }).await;
        let t = std::time::Instant::now();
        wait_count(&r, &d, i + 1).await;
        lat.push(r.times.lock().unwrap()[i].saturating_duration_since(t));
    }
    let total = start.elapsed();
    assert_eq!(check_received(&r, &api, &d, &[n]).await, 100);
    lat.sort();
    eprintln!(
        "webhook latency (API answer -> receiver), 100 changes: p50 {:?}, p95 {:?}, max {:?}; {:.0} changes/s end to end",
        lat[49],
        lat[94],
        lat[99],
        100.0 / total.as_secs_f64()
    );
}
