//! Shared fixtures: the real `pxed` binary started on loopback ports, torn down in Drop.
// Not every test module uses every fixture.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Path of the binary under test.
pub fn pxed_bin() -> &'static str {
    env!("CARGO_BIN_EXE_pxed")
}

/// Repository root (for ipxe/bin, templates, images).
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Polls `f` every 20 ms, blocking the thread, until it returns `Some`; `None` once
/// `timeout` has passed.
pub fn poll_blocking<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() >= timeout {
            return None;
        }
        std::thread::park_timeout(Duration::from_millis(20));
    }
}

/// [`poll_blocking`], failing the test with `what` on timeout.
pub fn wait_for<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    match poll_blocking(timeout, f) {
        Some(v) => v,
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Polls `f` every 10 ms until it returns `Some`; `None` once `timeout` has passed
/// and `f` has had as many tries as `timeout` holds intervals. The second bound is
/// for tests on tokio's paused clock: there virtual time jumps to the next timer
/// (a 60 s deadline, a client's idle timer) whenever the runtime waits, even for a
/// reply from SQLite's thread, so time alone would run out after a few tries.
pub async fn poll<T>(timeout: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    const EVERY: Duration = Duration::from_millis(10);
    let tries = timeout.as_millis() / EVERY.as_millis();
    let end = tokio::time::Instant::now() + timeout;
    for n in 1.. {
        if let Some(v) = f().await {
            return Some(v);
        }
        if n >= tries && tokio::time::Instant::now() >= end {
            break;
        }
        tokio::time::sleep(EVERY).await;
    }
    None
}

/// [`poll`], failing the test with `what` on timeout.
pub async fn until<T>(what: &str, timeout: Duration, f: impl AsyncFnMut() -> Option<T>) -> T {
    match poll(timeout, f).await {
        Some(v) => v,
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// With `TEST_DATABASE=postgresql` (the suite's second run in CI), the PostgreSQL
/// database of the deployment in `dir`: created and migrated on this test binary's
/// private cluster the first time, the same one when a test restarts its daemon on the
/// same dir (its URL is kept in `dir/database-url`). `None` otherwise: SQLite in the
/// data dir.
pub fn test_database(dir: &Path) -> Option<String> {
    if std::env::var("TEST_DATABASE").as_deref() != Ok("postgresql") {
        return None;
    }
    let file = dir.join("database-url");
    if let Ok(url) = std::fs::read_to_string(&file) {
        return Some(url);
    }
    let (_, url) = store_pg::cluster::Cluster::shared()
        .new_database()
        .expect("create a database");
    let (ok, _, err) = run(Command::new(pxed_bin())
        .args(["migrate", "--data-dir"])
        .arg(dir.join("data"))
        .env("PXED_DATABASE_URL", &url));
    assert!(ok, "pxed migrate: {err}");
    std::fs::write(&file, &url).expect("write database-url");
    Some(url)
}

/// A node's agent token, read from the database of the deployment whose data dir is
/// `data` (read-only): its SQLite file, or its PostgreSQL database.
pub async fn agent_token_of(data: &Path, id: i64) -> String {
    if let Some(url) = test_database(data.parent().expect("data dir in a deployment dir")) {
        let path = url.split('?').next().unwrap_or(&url);
        let name = path.rsplit('/').next().unwrap_or(path);
        return store_pg::cluster::Cluster::shared()
            .psql(
                name,
                &format!("SELECT agent_token FROM nodes WHERE id = {id}"),
            )
            .expect("psql");
    }
    let url = format!("sqlite://{}?mode=ro", data.join("pxed.sqlite").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let t: String = sqlx::query_scalar("SELECT agent_token FROM nodes WHERE id = ?")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    t
}

/// `pxed` for a command that opens the store of the deployment in `dir` itself (`image
/// add` before the daemon starts): on its PostgreSQL database when the suite runs on
/// PostgreSQL (see [`test_database`]).
pub fn pxed_on(dir: &Path) -> Command {
    let mut cmd = Command::new(pxed_bin());
    if let Some(url) = test_database(dir) {
        cmd.env("PXED_DATABASE_URL", url);
    }
    cmd
}

/// A running `pxed serve` with its log captured.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub log: Arc<Mutex<Vec<String>>>,
    pub http: String,
    pub tftp: Option<String>,
}

impl Daemon {
    /// Starts `pxed serve --demo` on ephemeral loopback ports with a fresh data dir,
    /// plus `extra` arguments; waits until HTTP (and TFTP when wired) listen.
    pub fn start(extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, extra, &[])
    }

    /// Like [`Daemon::start`] with a given data dir and environment.
    pub fn start_in(dir: tempfile::TempDir, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::start_limited(dir, extra, env, None)
    }

    /// Like [`Daemon::start_in`], with the open-files limit (soft and hard) set to
    /// `nofile` as a service manager would.
    pub fn start_limited(
        dir: tempfile::TempDir,
        extra: &[&str],
        env: &[(&str, &str)],
        nofile: Option<u64>,
    ) -> Daemon {
        let data = dir.path().join("data");
        let mut cmd = Command::new(pxed_bin());
        cmd.current_dir(repo())
            .args([
                "serve",
                "--demo",
                "--http",
                "127.0.0.1:0",
                "--tftp",
                "127.0.0.1:0",
            ])
            .arg("--data-dir")
            .arg(&data)
            .args(extra)
            .env("PXED_LOG", "info,pxed=debug")
            .env_remove("PXED_API_TOKEN");
        for (k, v) in env {
            cmd.env(k, v);
        }
        // A test that needs SQLite whatever the run (a SQLite deployment moved to
        // PostgreSQL) says `TEST_DATABASE=sqlite`.
        let sqlite = env.contains(&("TEST_DATABASE", "sqlite"));
        if !sqlite
            && !env.iter().any(|(k, _)| *k == "PXED_DATABASE_URL")
            && let Some(url) = test_database(dir.path())
        {
            cmd.env("PXED_DATABASE_URL", url);
        }
        if let Some(n) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork
            // and exec.
            unsafe {
                cmd.pre_exec(move || {
                    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, n, n)
                        .map_err(std::io::Error::from)
                });
            }
        }
        Self::spawn(cmd, dir)
    }

    /// Spawns `cmd` (a `pxed serve`, built by the caller) with its log captured, and
    /// waits until HTTP (and TFTP when wired) listen. A command spawned on a thread
    /// inside a network namespace runs in that namespace.
    pub fn spawn(mut cmd: Command, dir: tempfile::TempDir) -> Daemon {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn pxed");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr");
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[pxed] {line}");
                l2.lock().unwrap().push(line);
            }
        });
        let mut d = Daemon {
            child,
            dir,
            log,
            http: String::new(),
            tftp: None,
        };
        d.http = d.wait_log_addr("HTTP listening");
        d.tftp = d.find_log_addr("TFTP listening");
        d
    }

    fn find_log_addr(&self, marker: &str) -> Option<String> {
        let log = self.log.lock().unwrap();
        log.iter()
            .find(|l| l.contains(marker))
            .and_then(|l| l.split("addr=").nth(1))
            .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
    }

    /// Waits for a log line containing `marker` and returns its `addr=` field. The
    /// bound is generous: with the whole suite (QEMU, Chromium, Slurm) on two cores a
    /// debug build has been seen to take over 20 s to start.
    pub fn wait_log_addr(&mut self, marker: &str) -> String {
        wait_for(marker, Duration::from_secs(60), || {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!(
                    "pxed exited early: {st}\n{}",
                    self.log.lock().unwrap().join("\n")
                );
            }
            self.find_log_addr(marker)
        })
    }

    /// Whether any log line contains `s`.
    pub fn logged(&self, s: &str) -> bool {
        self.log.lock().unwrap().iter().any(|l| l.contains(s))
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// `http://127.0.0.1:PORT` + path.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.http, path)
    }

    /// The data dir.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Sends a signal and waits for exit; returns (exit status, time taken).
    pub fn stop_with(
        &mut self,
        sig: nix::sys::signal::Signal,
    ) -> (std::process::ExitStatus, Duration) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let t = Instant::now();
        nix::sys::signal::kill(pid, sig).expect("kill");
        let st = wait_for("pxed to exit", Duration::from_secs(10), || {
            self.child.try_wait().ok().flatten()
        });
        (st, t.elapsed())
    }

    /// Stops the daemon and hands back its data dir (for restart tests).
    pub fn kill_keep_dir(mut self, sig: nix::sys::signal::Signal) -> tempfile::TempDir {
        self.stop_with(sig);
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a command and returns (status ok, stdout, stderr).
pub fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Requires a tool on PATH (CI installs it via .ci/install.sh).
pub fn need(tool: &str) {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "{tool} is not installed: run .ci/install.sh");
}

/// Writes `bytes` under `dir/name`, creating parents.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    p
}

/// The JSON API of a running [`Daemon`], called as a script would (bearer token).
pub struct Api {
    pub http: reqwest::Client,
    pub token: &'static str,
}

impl Api {
    pub fn new(token: &'static str) -> Api {
        Api {
            http: reqwest::Client::new(),
            token,
        }
    }

    /// Status and JSON body (`null` when there is none).
    pub async fn call(
        &self,
        d: &Daemon,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        let mut r = self
            .http
            .request(method, d.url(path))
            .bearer_auth(self.token);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.unwrap();
        let s = resp.status().as_u16();
        (s, resp.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// The body of `GET path` as text (with the token): a page, a boot script,
    /// `/metrics`.
    pub async fn text(&self, d: &Daemon, path: &str) -> String {
        let r = self.http.get(d.url(path)).bearer_auth(self.token);
        r.send().await.unwrap().text().await.unwrap()
    }

    /// The first-boot agent's two reports under its `agent` token, as the installed
    /// system sends them: facts (with `hostname`), then a passing health check.
    pub async fn first_boot_and_health(&self, d: &Daemon, agent: &str, hostname: &str) {
        for (path, body) in [
            (
                "first-boot",
                serde_json::json!({"hostname": hostname, "arch": "x86_64", "facts": {}}),
            ),
            ("health", serde_json::json!({"status": "pass"})),
        ] {
            let url = d.url(&format!("/cb/{agent}/{path}"));
            let r = self.http.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}");
        }
    }

    pub async fn get(&self, d: &Daemon, path: &str) -> serde_json::Value {
        self.call(d, reqwest::Method::GET, path, None).await.1
    }

    pub async fn node(&self, d: &Daemon, id: i64) -> serde_json::Value {
        self.get(d, &format!("/api/v1/nodes/{id}")).await
    }

    /// Polls `f` for up to 60 s; panics with the daemon's log.
    pub async fn wait<T>(&self, what: &str, d: &Daemon, f: impl AsyncFnMut() -> Option<T>) -> T {
        match poll(Duration::from_secs(60), f).await {
            Some(v) => v,
            None => panic!("timed out waiting for {what}\n{}", d.log_text()),
        }
    }

    /// Polls node `id` until it is in `state`; panics with the node and the log.
    pub async fn wait_state(
        &self,
        d: &Daemon,
        id: i64,
        state: &str,
        timeout: Duration,
    ) -> serde_json::Value {
        let reached = async || Some(self.node(d, id).await).filter(|n| n["state"] == state);
        match poll(timeout, reached).await {
            Some(n) => n,
            None => panic!(
                "node {id} never reached {state}: {:#}\n{}",
                self.node(d, id).await,
                d.log_text()
            ),
        }
    }
}
