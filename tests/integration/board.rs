//! The technicians' board in real headless Chromium, driven over the DevTools protocol
//! (tests/peers/cdp.py): nodes in several states with one past its stage's expected
//! duration, a filter, a node's timeline, a change arriving live, and operator
//! actions with the token. Screenshots of each step are kept in
//! `target/screenshots/*.png` (CI keeps them as artifacts).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::bmc::{NODE1, PASSWORD, Sushy};
use crate::common::{Api, Daemon, need, repo, run, write_file};

const TOKEN: &str = "board-token-3a9f";

/// Headless Chromium behind the CDP driver; one JSON command per call.
struct Browser {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn start() -> Browser {
        need("chromium");
        let peers =
            PathBuf::from(std::env::var("PEERS_DIR").unwrap_or_else(|_| "/tmp/pxed-peers".into()));
        let py = peers.join("venv/bin/python3");
        assert!(
            py.exists(),
            "{} missing: run .ci/install.sh (peers' venv with websocket-client)",
            py.display()
        );
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(py)
            .arg(repo().join("tests/peers/cdp.py"))
            .arg(profile.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the CDP driver");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Browser {
            child,
            stdin,
            stdout,
            _profile: profile,
        }
    }

    fn cmd(&mut self, c: Value) -> Value {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("CDP driver answered {line:?} to {c}: {e}"));
        if let Some(e) = v.get("error") {
            panic!("browser: {c}: {e}");
        }
        v["ok"].clone()
    }

    fn goto(&mut self, url: &str) {
        self.cmd(json!({"cmd": "goto", "url": url}));
    }
    fn eval(&mut self, js: &str) -> Value {
        self.cmd(json!({"cmd": "eval", "js": js}))
    }
    fn wait(&mut self, js: &str) -> Value {
        self.cmd(json!({"cmd": "wait", "js": js, "timeout": 30}))
    }
    fn click(&mut self, selector: &str) {
        self.cmd(json!({"cmd": "click", "selector": selector}));
    }
    fn type_in(&mut self, selector: &str, text: &str) {
        self.cmd(json!({"cmd": "type", "selector": selector, "text": text}));
    }
    fn text(&mut self, selector: &str) -> String {
        let js = format!(
            "(document.querySelector({}) || {{}}).innerText || ''",
            json!(selector)
        );
        self.eval(&js).as_str().unwrap_or_default().to_string()
    }
    /// A full-page PNG in `target/screenshots/`.
    fn screenshot(&mut self, name: &str) -> PathBuf {
        let p = repo()
            .join("target/screenshots")
            .join(format!("{name}.png"));
        self.cmd(json!({"cmd": "screenshot", "path": p}));
        let meta = std::fs::metadata(&p).unwrap();
        assert!(meta.len() > 5000, "{} is {} bytes", p.display(), meta.len());
        p
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// A data dir with rocky-9 imported from a local mirror (the kernel and initrd are
/// placeholders: nothing boots them here).
fn data_dir_with_image() -> tempfile::TempDir {
    let work = tempfile::tempdir().unwrap();
    let mirror = work.path().join("mirror");
    crate::image_check::rocky_repo_metadata(&mirror);
    for arch in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{arch}/os/images/pxeboot");
        write_file(&mirror, &format!("{p}/vmlinuz"), b"kernel");
        write_file(&mirror, &format!("{p}/initrd.img"), b"initrd");
    }
    let dir = tempfile::tempdir().unwrap();
    let (ok, out, err) = run(crate::common::pxed_on(dir.path())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("PXED_MIRROR_BASE", format!("{}/", mirror.display())));
    assert!(ok, "image add: {out}{err}");
    dir
}

async fn post(api: &Api, d: &Daemon, path: &str, body: Value) -> Value {
    let (s, v) = api.call(d, reqwest::Method::POST, path, Some(body)).await;
    assert!((200..300).contains(&s), "POST {path}: {s} {v}");
    v
}

async fn register(api: &Api, d: &Daemon, body: Value) -> i64 {
    post(api, d, "/api/v1/nodes", body).await["id"]
        .as_i64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_board_in_a_real_browser() {
    let sushy = Sushy::start();
    let dir = data_dir_with_image();
    let d = Daemon::start_in(
        dir,
        &[],
        &[
            ("PXED_API_TOKEN", TOKEN),
            ("PXED_STATUS_PUBLIC", "false"),
            // The node whose BMC never answers stays `reclaiming` (retries wait 10 min)
            // past the 15 s it is expected to take there (sushy's cycle takes ~6 s).
            ("PXED_LIFECYCLE__DEADLINES__RECLAIMING", "15s"),
            ("PXED_LIFECYCLE__BACKOFF", "10m"),
            ("PXED_DEFAULT_IMAGE", "rocky-9"),
        ],
    );
    pxed::net::install_crypto_provider();
    let api = Api::new(TOKEN);
    let bmc = |address: &str, system: Option<&str>| {
        json!({"driver": "redfish", "address": address, "username": "admin",
               "password": PASSWORD, "system_id": system})
    };
    // A node that will fail during its install, with a timeline to draw.
    let failing = register(
        &api,
        &d,
        json!({"macs": ["52:54:00:77:00:01"], "name": "r12-gpu-01", "arch": "x86_64",
               "labels": {"rack": "r12"}, "bmc": bmc(&sushy.url(), Some(NODE1))}),
    )
    .await;
    // A node whose BMC does not answer: stuck in `reclaiming`.
    let stuck = register(
        &api,
        &d,
        json!({"macs": ["52:54:00:77:00:02"], "name": "r12-cpu-02", "arch": "arm64",
               "labels": {"rack": "r12"}, "bmc": bmc("http://127.0.0.1:9", None)}),
    )
    .await;
    let spare = register(
        &api,
        &d,
        json!({"macs": ["52:54:00:77:00:03"], "name": "r13-cpu-03", "arch": "x86_64",
               "labels": {"rack": "r13"}}),
    )
    .await;
    let quarantined = register(
        &api,
        &d,
        json!({"macs": ["52:54:00:77:00:04"], "name": "r13-gpu-04", "arch": "arm64",
               "labels": {"rack": "r13"}}),
    )
    .await;
    register(
        &api,
        &d,
        json!({"macs": ["aa:bb:cc:77:00:05"], "state": "discovered"}),
    )
    .await;
    post(
        &api,
        &d,
        &format!("/api/v1/nodes/{quarantined}/actions/quarantine"),
        json!({"reason": "GPU 3 fell off the bus"}),
    )
    .await;

    post(
        &api,
        &d,
        &format!("/api/v1/nodes/{stuck}/reinstall"),
        json!({}),
    )
    .await;
    // The failing node: BMC set netboot and cycled (sushy), the script served the
    // installer, the deploy agent reported two steps, then gave up.
    post(
        &api,
        &d,
        &format!("/api/v1/nodes/{failing}/reinstall"),
        json!({}),
    )
    .await;
    api.wait_state(&d, failing, "netbooting", Duration::from_secs(30))
        .await;
    let script = api.text(&d, "/boot/52:54:00:77:00:01.ipxe").await;
    let i = script.find("/cfg/").expect("installer served") + 5;
    let boot_token = script[i..].split('/').next().unwrap().to_string();
    api.wait_state(&d, failing, "installing", Duration::from_secs(10))
        .await;
    for (stage, message) in [("wipe", "wiped /dev/vda"), ("write", "writing")] {
        let r = api
            .http
            .post(d.url(&format!("/cb/{boot_token}/deploy/progress")))
            .json(&json!({"stage": stage, "message": message}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let r = api
        .http
        .post(d.url(&format!("/cb/{boot_token}/failure")))
        .json(&json!({"stage": "verify", "reason": "sha256 mismatch on /dev/vda"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    api.wait_state(&d, failing, "failed", Duration::from_secs(10))
        .await;

    let mut b = Browser::start();
    // Without a credential a browser gets the login form, never the board.
    b.goto(&d.url("/"));
    assert!(b.text("body").contains("needs the API token"));
    assert_eq!(b.eval("document.querySelectorAll('#nodes tr').length"), 0);
    b.type_in("#login-token", TOKEN);
    b.click("#login-form button[type=submit]");
    b.wait("!!document.getElementById('nodes')");
    // The cookie is HttpOnly (scripts cannot read it); the tab keeps the token for the
    // operator buttons.
    assert_eq!(b.eval("document.cookie"), "");
    assert_eq!(b.eval("sessionStorage.getItem('pxed-token')"), TOKEN);

    // The board: counts per state, every node, and the stuck node marked overdue.
    let overdue_row = format!("tr[data-node='{stuck}'].overdue .overdue-mark");
    b.wait(&format!(
        "(() => {{ const m = document.querySelector({}); return m && m.offsetParent !== null; }})()",
        json!(overdue_row)
    ));
    // A fresh render shows it too (server-side, not only by the page's script).
    b.goto(&d.url("/"));
    assert_eq!(
        b.eval(&format!("!!document.querySelector({})", json!(overdue_row))),
        true
    );
    let counts = b.text("#counts");
    for c in [
        "5\nall",
        "1\ndiscovered",
        "1\navailable",
        "1\nreclaiming",
        "1\nfailed",
        "1\nquarantined",
    ] {
        assert!(counts.contains(c), "{c:?} in {counts:?}");
    }
    let row = |b: &mut Browser, id: i64| b.text(&format!("tr[data-node='{id}']"));
    let failed_row = row(&mut b, failing);
    assert!(
        failed_row.contains("installing: verify: sha256 mismatch on /dev/vda"),
        "{failed_row}"
    );
    assert!(failed_row.contains("rack=r12"), "{failed_row}");
    let stuck_row = row(&mut b, stuck);
    assert!(
        stuck_row.contains("reclaiming")
            && stuck_row.contains("of 15 s")
            && stuck_row.contains("overdue"),
        "{stuck_row}"
    );
    assert!(row(&mut b, quarantined).contains("GPU 3 fell off the bus"));
    assert!(!b.text("body").contains(PASSWORD));
    b.screenshot("board");

    // Filters: server-side query parameters, so a plain link works.
    b.goto(&d.url("/?state=&arch=arm64&label=rack%3Dr12&q="));
    let shown =
        b.eval("[...document.querySelectorAll('#nodes tr')].map(r => Number(r.dataset.node))");
    assert_eq!(shown, json!([stuck]));
    // And the form: free text on part of a MAC.
    b.goto(&d.url("/"));
    b.type_in("input[name=q]", "77:00:0");
    b.eval("document.querySelector('select[name=state]').value = 'failed'");
    b.click("form.filters button[type=submit]");
    b.wait("location.search.includes('q=77')");
    b.wait("document.readyState === 'complete'");
    let shown =
        b.eval("[...document.querySelectorAll('#nodes tr')].map(r => Number(r.dataset.node))");
    assert_eq!(shown, json!([failing]));
    assert!(b.text("#paging").contains("in state failed"));
    b.screenshot("board-filter");

    // The failing node's page: identity without secrets, the stages on a time axis
    // with the failing one highlighted, the agent's reports as marks.
    b.goto(&d.url(&format!("/nodes/{failing}")));
    assert_eq!(b.eval("document.title"), "pxed: r12-gpu-01");
    let ident = b.text("dl.ident");
    assert!(
        ident.contains("52:54:00:77:00:01")
            && ident.contains(&sushy.url())
            && ident.contains("rack=r12"),
        "{ident}"
    );
    assert!(!b.text("body").contains(PASSWORD));
    assert!(
        !b.eval("document.body.innerHTML")
            .as_str()
            .unwrap()
            .contains(&boot_token)
    );
    let bars = b.eval(
        "[...document.querySelectorAll('svg.timeline rect.bar')].map(r => r.getAttribute('class'))",
    );
    let bars: Vec<String> = serde_json::from_value(bars).unwrap();
    assert_eq!(bars.len(), 3, "{bars:?}");
    assert!(
        bars[0].contains("st-reclaiming") && bars[1].contains("st-netbooting"),
        "{bars:?}"
    );
    assert!(
        bars[2].contains("st-installing") && bars[2].contains("failing"),
        "{bars:?}"
    );
    assert!(!bars[0].contains("failing") && !bars[1].contains("failing"));
    let marks = b.eval("document.querySelector('svg.timeline').textContent");
    let marks = marks.as_str().unwrap();
    assert!(
        marks.contains("deploy_wipe") && marks.contains("deploy_write"),
        "{marks}"
    );
    assert!(b.text("#stages").contains("failed here"));
    b.screenshot("node-timeline");

    // Live: a change made elsewhere reaches an open board without a reload.
    b.goto(&d.url("/"));
    b.wait("document.getElementById('live').textContent.includes('live')");
    b.eval("window.notReloaded = true");
    post(
        &api,
        &d,
        &format!("/api/v1/nodes/{spare}/actions/allocate"),
        json!({}),
    )
    .await;
    b.wait(&format!(
        "document.querySelector(\"tr[data-node='{spare}']\").dataset.state === 'allocated'"
    ));
    assert_eq!(
        b.eval("window.notReloaded === true"),
        true,
        "the page reloaded"
    );
    assert!(b.text("#counts").contains("1\nallocated"));
    b.screenshot("board-live");

    // Operator actions: without a token the page is read-only.
    b.goto(&d.url(&format!("/nodes/{spare}")));
    b.eval("sessionStorage.clear()");
    b.goto(&d.url(&format!("/nodes/{spare}")));
    assert_eq!(
        b.eval("document.getElementById('op-quarantine').disabled"),
        true
    );
    assert_eq!(
        b.eval("document.getElementById('op-mark-available').disabled"),
        true
    );
    b.type_in("#token-input", "not-the-token");
    b.click("#token-form button[type=submit]");
    b.wait("document.getElementById('op-result').textContent.includes('refused')");
    assert_eq!(
        b.eval("document.getElementById('op-quarantine').disabled"),
        true
    );
    b.eval("document.getElementById('token-input').value = ''");
    b.type_in("#token-input", TOKEN);
    b.click("#token-form button[type=submit]");
    b.wait("!document.getElementById('op-quarantine').disabled");
    // No BMC: power cycle stays off, and says why.
    assert_eq!(
        b.eval("document.getElementById('op-power-cycle').disabled"),
        true
    );
    // Two clicks (arm, confirm): quarantine with a reason.
    b.type_in("#op-reason", "fans at 100%");
    b.click("#op-quarantine");
    b.wait("document.getElementById('op-quarantine').textContent.startsWith('confirm')");
    b.click("#op-quarantine");
    b.wait("document.getElementById('state').textContent === 'quarantined'");
    assert!(b.text("#audit").contains("fans at 100%"));
    let n = api.node(&d, spare).await;
    assert_eq!(n["state"], "quarantined", "{n}");
    // "mark available" lifts it again (restore), and the page follows live.
    b.wait("!document.getElementById('op-mark-available').disabled");
    b.click("#op-mark-available");
    b.click("#op-mark-available");
    b.wait("document.getElementById('state').textContent === 'available'");
    b.screenshot("node-action");
    let n = api.node(&d, spare).await;
    assert_eq!(n["state"], "available", "{n}");
    let by_api = n["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["actor"] == "api")
        .count();
    assert!(by_api >= 4, "{n}");
}

/// The login form trades the token for a session cookie that is HttpOnly,
/// SameSite=Strict and never the token; a wrong token gets the form again, and the
/// cookie opens the board (not the API). With `status_public` nothing is asked.
#[tokio::test]
async fn login_sets_a_session_cookie_that_is_not_the_token() {
    let d = Daemon::start_in(
        tempfile::tempdir().unwrap(),
        &[],
        &[("PXED_API_TOKEN", TOKEN), ("PXED_STATUS_PUBLIC", "false")],
    );
    pxed::net::install_crypto_provider();
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = http
        .get(d.url("/nodes/1?x=1"))
        .header("accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let body = r.text().await.unwrap();
    assert!(
        body.contains("<form") && body.contains("action=\"/login\""),
        "{body}"
    );
    assert!(body.contains("value=\"/nodes/1?x=1\""), "{body}");
    let r = http
        .post(d.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=wrong&next=%2F")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers().get("set-cookie").is_none());
    // A `next` off this server is not followed.
    let r = http
        .post(d.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={TOKEN}&next=%2F%2Fevil.example%2F"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "/");
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        cookie.contains("HttpOnly")
            && cookie.contains("SameSite=Strict")
            && !cookie.contains(TOKEN),
        "{cookie}"
    );
    let pair = cookie.split(';').next().unwrap().to_string();
    let r = http
        .get(d.url("/status.json?label=rack%3Dr1"))
        .header("cookie", &pair)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = http
        .get(d.url("/api/v1/nodes"))
        .header("cookie", &pair)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http.post(d.url("/logout")).send().await.unwrap();
    assert!(
        r.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );

    // The operator opened the board: no credential needed for it (the API still is).
    let open = Daemon::start_in(
        tempfile::tempdir().unwrap(),
        &[],
        &[("PXED_API_TOKEN", TOKEN), ("PXED_STATUS_PUBLIC", "true")],
    );
    let r = http.get(open.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(open.url("/api/v1/nodes")).send().await.unwrap();
    assert_eq!(r.status(), 401);
}
