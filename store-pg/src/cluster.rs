//! A private PostgreSQL cluster for tests and benches: Debian's own server binaries
//! (`initdb`, `postgres` from the `postgresql` package), in a new directory under the
//! temp dir, listening only on a Unix socket there. Nothing of the machine's own
//! PostgreSQL (if any) is touched.
//!
//! As root, the server runs as the `postgres` user (PostgreSQL refuses root). It gets
//! SIGQUIT (immediate shutdown) when the thread that started it ends — a dedicated
//! thread that lives as long as the process — so a test binary that exits, panics or is
//! killed leaves no server behind; [`Cluster::start`] also removes the directories
//! that such earlier runs left.

use std::ffi::OsStr;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Cluster errors.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "no PostgreSQL server binaries: install Debian's `postgresql` package (.ci/install.sh does), or set PXED_PG_BINDIR"
    )]
    NoBinaries,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{what} failed: {detail}")]
    Failed { what: String, detail: String },
    #[error("the server did not accept connections within {0:?}; its log: {1}")]
    NotReady(Duration, String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// How long the server may take to accept connections after a start.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The user the server runs as when this process is root.
const SERVER_USER: &str = "postgres";

/// A running private cluster. Dropping it stops the server and removes its directory.
#[derive(Debug)]
pub struct Cluster {
    root: PathBuf,
    bin: PathBuf,
    server: Arc<Mutex<Option<Child>>>,
    /// Asks the server thread to start a server (a restart).
    spawn: mpsc::Sender<mpsc::Sender<io::Result<()>>>,
}

impl Cluster {
    /// `initdb` and start. Takes a second or two.
    pub fn start() -> Result<Cluster, ClusterError> {
        let bin = bindir().ok_or(ClusterError::NoBinaries)?;
        remove_stale();
        let (root, run_as) = new_root()?;
        let data = root.join("data");
        run(
            command(&bin.join("initdb"), run_as)
                .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"])
                .args(["--locale=C", "--no-instructions", "-D"])
                .arg(&data),
            "initdb",
        )?;
        Cluster::boot(bin, root, run_as)
    }

    /// A hot standby of this cluster (`pg_basebackup -R`: streaming replication from
    /// it), started and accepting read-only connections.
    pub fn start_replica(&self) -> Result<Cluster, ClusterError> {
        let (root, run_as) = new_root()?;
        run(
            command(&self.bin.join("pg_basebackup"), run_as)
                .args(["-R", "-X", "stream", "-c", "fast", "-U", "postgres", "-h"])
                .arg(&self.root)
                .arg("-D")
                .arg(root.join("data")),
            "pg_basebackup",
        )?;
        Cluster::boot(self.bin.clone(), root, run_as)
    }

    /// Makes this standby a primary (what a failover manager does) and waits until
    /// it takes writes.
    pub fn promote(&self) -> Result<(), ClusterError> {
        let done = self.psql("postgres", "SELECT pg_promote(true, 30)")?;
        if done != "t" {
            return Err(ClusterError::Failed {
                what: "pg_promote".into(),
                detail: format!("returned {done:?}"),
            });
        }
        Ok(())
    }

    fn boot(
        bin: PathBuf,
        root: PathBuf,
        run_as: Option<(u32, u32)>,
    ) -> Result<Cluster, ClusterError> {
        let server = Arc::new(Mutex::new(None));
        let spawn = server_thread(bin.clone(), root.clone(), run_as, server.clone());
        let cluster = Cluster {
            root,
            bin,
            server,
            spawn,
        };
        cluster.launch()?;
        Ok(cluster)
    }

    /// The directory of the server's socket.
    pub fn socket_dir(&self) -> &Path {
        &self.root
    }

    /// A URL for `database` as the superuser `postgres` (no password: trust over the
    /// socket, which only this process's user and `postgres` can reach).
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@localhost/{database}?host={}",
            self.root.display()
        )
    }

    /// The cluster shared by the tests of one test binary, started on first use (its
    /// server ends with the process, see the module documentation).
    pub fn shared() -> &'static Cluster {
        static SHARED: std::sync::OnceLock<Cluster> = std::sync::OnceLock::new();
        SHARED.get_or_init(|| Cluster::start().expect("start a private PostgreSQL"))
    }

    /// Creates an empty database with a name not used before in this process; returns
    /// its name and URL.
    pub fn new_database(&self) -> Result<(String, String), ClusterError> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!("t{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let url = self.create_database(&name)?;
        Ok((name, url))
    }

    /// Creates an empty database and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String, ClusterError> {
        self.psql("postgres", &format!("CREATE DATABASE \"{name}\""))?;
        Ok(self.url(name))
    }

    /// Runs SQL through `psql` (stops at the first error).
    pub fn psql(&self, database: &str, sql: &str) -> Result<String, ClusterError> {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-X",
                "-q",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
                "-U",
                "postgres",
                "-h",
            ])
            .arg(&self.root)
            .args(["-d", database, "-c", sql])
            .stdin(Stdio::null())
            .output()
            .map_err(io_err("psql"))?;
        if !out.status.success() {
            return Err(ClusterError::Failed {
                what: format!("psql {sql:?}"),
                detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Kills the server at once (SIGKILL to the postmaster and every process it
    /// started, as a host crash would): clients see their connections drop. (A
    /// postmaster killed alone leaves its backends serving the connections they have.)
    pub fn kill(&self) {
        if let Some(mut child) = self.server.lock().expect("lock").take() {
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again after [`Cluster::kill`] (crash recovery runs first).
    pub fn restart(&self) -> Result<(), ClusterError> {
        self.kill();
        // A killed postmaster leaves backends that finish on their own; the new one
        // waits for the shared memory they hold.
        self.launch()
    }

    fn launch(&self) -> Result<(), ClusterError> {
        let (tx, rx) = mpsc::channel();
        self.spawn.send(tx).map_err(|_| ClusterError::Failed {
            what: "start".into(),
            detail: "the server thread is gone".into(),
        })?;
        rx.recv()
            .map_err(|_| ClusterError::Failed {
                what: "start".into(),
                detail: "the server thread is gone".into(),
            })?
            .map_err(io_err("postgres"))?;
        self.wait_ready()
    }

    fn wait_ready(&self) -> Result<(), ClusterError> {
        let started = Instant::now();
        while started.elapsed() < READY_TIMEOUT {
            let ok = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-U", "postgres", "-d", "postgres", "-h"])
                .arg(&self.root)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if let Some(child) = self.server.lock().expect("lock").as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(ClusterError::Failed {
                    what: "postgres".into(),
                    detail: format!("exited ({status}); its log: {}", self.log_tail()),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(ClusterError::NotReady(READY_TIMEOUT, self.log_tail()))
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.root.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(10)..].join(" | ")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.lock().expect("lock").take() {
            // SIGQUIT: immediate shutdown, the postmaster takes its backends along.
            // SAFETY: a plain system call on our own child's pid (not yet reaped).
            unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A new directory for one server (mode 0700, owned by the user it runs as) and that
/// user (as root: `postgres`).
fn new_root() -> Result<(PathBuf, Option<(u32, u32)>), ClusterError> {
    let root = std::env::temp_dir().join(format!(
        "pxed-pg-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir(&root).map_err(io_err(format!("mkdir {}", root.display())))?;
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))
        .map_err(io_err("chmod"))?;
    let run_as = if is_root() {
        let (uid, gid) = lookup_user(SERVER_USER).ok_or_else(|| ClusterError::Failed {
            what: "running as root".into(),
            detail: format!("no `{SERVER_USER}` user to run the server as"),
        })?;
        std::os::unix::fs::chown(&root, Some(uid), Some(gid)).map_err(io_err("chown"))?;
        Some((uid, gid))
    } else {
        None
    };
    Ok((root, run_as))
}

/// Runs a setup command to its end; its stderr is the error if it fails.
fn run(cmd: &mut Command, what: &str) -> Result<(), ClusterError> {
    let out = cmd.stdin(Stdio::null()).output().map_err(io_err(what))?;
    if !out.status.success() {
        return Err(ClusterError::Failed {
            what: what.into(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// The thread that starts the server (and any restart): the server's parent-death
/// signal fires when this thread ends, which is when the process ends.
fn server_thread(
    bin: PathBuf,
    root: PathBuf,
    run_as: Option<(u32, u32)>,
    server: Arc<Mutex<Option<Child>>>,
) -> mpsc::Sender<mpsc::Sender<io::Result<()>>> {
    let (tx, rx) = mpsc::channel::<mpsc::Sender<io::Result<()>>>();
    std::thread::Builder::new()
        .name("pxed-pg-cluster".into())
        .spawn(move || {
            for reply in rx {
                let result = std::fs::File::create(root.join("server.log"))
                    .and_then(|log| {
                        if let Some((uid, gid)) = run_as {
                            std::os::unix::fs::chown(
                                root.join("server.log"),
                                Some(uid),
                                Some(gid),
                            )?;
                        }
                        let err = log.try_clone()?;
                        command(&bin.join("postgres"), run_as)
                            .arg("-D")
                            .arg(root.join("data"))
                            .args(["-c", "listen_addresses="])
                            .arg("-c")
                            .arg(format!("unix_socket_directories={}", root.display()))
                            .args(["-c", "max_connections=200"])
                            .stdin(Stdio::null())
                            .stdout(log)
                            .stderr(err)
                            .spawn()
                    })
                    .map(|child| {
                        *server.lock().expect("lock") = Some(child);
                    });
                let _ = reply.send(result);
            }
            // Every Cluster handle is gone: nothing more to start. Park, so the
            // server's parent-death signal fires only when the process ends.
            loop {
                std::thread::park();
            }
        })
        .expect("spawn the cluster thread");
    tx
}

/// A command that runs as `run_as` (if given) and gets SIGQUIT when its parent thread
/// ends. The credentials are changed before the signal is set: the kernel clears the
/// parent-death signal on a change of credentials.
fn command(program: &Path, run_as: Option<(u32, u32)>) -> Command {
    let mut cmd = Command::new(program);
    if run_as.is_some() {
        cmd.env("HOME", "/var/lib/postgresql");
    }
    // SAFETY: between fork and exec the closure makes only async-signal-safe system
    // calls (setgroups, setgid, setuid, prctl) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if let Some((uid, gid)) = run_as
                && (libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0)
            {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// The newest `/usr/lib/postgresql/N/bin` with a server, or `PXED_PG_BINDIR`.
fn bindir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("PXED_PG_BINDIR") {
        return Some(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// Removes the directories of earlier clusters whose process is gone.
fn remove_stale() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = stale_pid(&name) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn stale_pid(name: &OsStr) -> Option<u32> {
    let rest = name.to_str()?.strip_prefix("pxed-pg-")?;
    rest.split('-').next()?.parse().ok()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// uid and gid of `name`, from the passwd database.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() > 3 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}
