//! `pxed agent deploy`: the deploy agent, run by the deploy ramdisk's /init once it has
//! an address. It fetches the node's plan, reports hardware facts, wipes every fixed
//! disk, streams the image to the target, verifies it, grows the root filesystem,
//! configures it and reboots. Any failure after the plan is fetched is reported to pxed
//! at once (`/failure` with the stage and the real reason) and ends the agent non-zero,
//! which leaves /init's shell on the console.
//!
//! Each stage prints one line to stderr (the serial console):
//! `pxed-agent: <stage>: <what>`.

pub mod cmdline;
pub mod disk;
pub mod facts;
pub mod lldp;
pub mod rootfs;
pub mod stream;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::{Args, Subcommand};
use serde::Serialize;

use crate::wire::{
    AgentFacts, DeployPlan, DeployProgress, DeployStage, FailedReport, InstalledReport,
};
use cmdline::Cmdline;
use stream::RetryPolicy;

/// Progress reports during the write stage are at most this frequent.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// Chunk size of writes to the target disk.
const WRITE_CHUNK: usize = 4 << 20;
/// `statfs` magic of the initramfs root (ramfs; tmpfs is the other possibility).
const RAMFS_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x8584_58f6);

/// `pxed agent ...`.
#[derive(Subcommand, Debug)]
pub enum AgentCmd {
    /// Deploy this machine from its pxed plan (runs inside the deploy ramdisk).
    Deploy(DeployArgs),
    /// Stream a (zstd) disk image to a file or block device the way a deploy does
    /// (resume with Range, verify size and SHA-256 while writing, fsync): for
    /// operators, and for `bench/deploy.sh`.
    WriteImage(WriteImageArgs),
    /// Print this machine's hardware inventory as the deploy agent reports it (JSON):
    /// PCI functions with their links, NICs, disks, CPU topology, NUMA, firmware. What
    /// a hardware profile is checked against.
    Inventory {
        /// Read sysfs and procfs under this directory instead of `/`.
        #[arg(long, default_value = "/")]
        root: PathBuf,
    },
}

/// Flags of `pxed agent write-image`.
#[derive(Args, Debug, Clone)]
pub struct WriteImageArgs {
    /// The image URL.
    #[arg(long)]
    pub url: String,
    /// Size in bytes of the raw image.
    #[arg(long)]
    pub size: u64,
    /// SHA-256 (hex) of the raw image.
    #[arg(long)]
    pub sha256: String,
    /// The file or block device to write (a file is created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// The URL is a raw image, not zstd.
    #[arg(long)]
    pub raw: bool,
}

/// `pxed agent write-image`: the deploy's write and verify stages alone.
async fn write_image(a: &WriteImageArgs) -> Result<Done, AgentError> {
    let client = http_client()?;
    let image = crate::wire::DiskImageRef {
        name: "image".into(),
        url: a.url.clone(),
        compression: if a.raw {
            crate::wire::Compression::None
        } else {
            crate::wire::Compression::Zstd
        },
        size: a.size,
        sha256: a.sha256.clone(),
        root_partition: 1,
    };
    let out = a.out.clone();
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&out)
        .map_err(|e| AgentError::at(DeployStage::Write, format!("{}: {e}", out.display())))?;
    let started = std::time::Instant::now();
    let (dev, w) = stream::stream_image(
        &client,
        &image,
        dev,
        WRITE_CHUNK,
        Arc::new(AtomicU64::new(0)),
        &RetryPolicy::default(),
    )
    .await
    .map_err(|e| AgentError::at(e.stage(), e))?;
    dev.sync_all()
        .map_err(|e| AgentError::at(DeployStage::Write, format!("fsync: {e}")))?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{} bytes written and verified (sha256 {}) in {secs:.3} s: {:.1} MB/s",
        w.bytes,
        w.sha256,
        w.bytes as f64 / secs / 1e6
    );
    Ok(Done::Exit)
}

/// Flags of `pxed agent deploy`.
#[derive(Args, Debug, Clone)]
pub struct DeployArgs {
    /// Kernel command line holding pxed.url, pxed.token and optionally pxed.disk.
    #[arg(long, default_value = "/proc/cmdline")]
    pub cmdline: PathBuf,
    /// Fetch the plan, report facts, choose the disk and print what would be done;
    /// write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Report installed, then exit 0 instead of rebooting.
    #[arg(long)]
    pub no_reboot: bool,
    /// Deploy even though / is not a ramdisk. This wipes every fixed disk of the machine
    /// it runs on.
    #[arg(long)]
    pub force: bool,
    /// Where /sys and /proc are read from (tests, debugging).
    #[arg(long, default_value = "/", hide = true)]
    pub sysroot: PathBuf,
}

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The kernel command line does not say where pxed is.
    #[error(transparent)]
    Cmdline(#[from] cmdline::CmdlineError),
    /// The kernel command line could not be read.
    #[error("read {}: {source}", path.display())]
    ReadCmdline {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A real deploy outside a ramdisk would wipe the machine it runs on.
    #[error(
        "refusing to deploy: / is not the ramdisk (this would wipe every disk of this \
         machine); use --dry-run, or --force if that is really meant"
    )]
    NotRamdisk,
    /// An HTTP client could not be built.
    #[error("http client: {0}")]
    Client(#[source] reqwest::Error),
    /// A call to pxed failed.
    #[error("{method} {url}: {reason}")]
    Call {
        /// GET or POST.
        method: &'static str,
        /// The URL, with the token elided.
        url: String,
        /// The server's reason or the transport error.
        reason: String,
    },
    /// A deploy stage failed (and was reported to pxed).
    #[error("failed at {stage}: {reason}")]
    Stage {
        /// The stage.
        stage: DeployStage,
        /// The reason.
        reason: String,
    },
}

impl AgentError {
    fn at(stage: DeployStage, e: impl std::fmt::Display) -> Self {
        AgentError::Stage {
            stage,
            reason: e.to_string(),
        }
    }
}

/// Runs `pxed agent ...`; the exit code is 0 on success (or after a dry run), 2 for a
/// command line without pxed's keys, 1 for any other failure.
pub fn run(cmd: AgentCmd) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pxed-agent: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match &cmd {
        AgentCmd::Inventory { root } => {
            let inv = facts::inventory(root);
            match serde_json::to_string_pretty(&inv) {
                Ok(text) => {
                    println!("{text}");
                    Ok(Done::Exit)
                }
                Err(e) => {
                    eprintln!("pxed-agent: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        AgentCmd::Deploy(args) => rt.block_on(deploy(args)),
        AgentCmd::WriteImage(args) => rt.block_on(write_image(args)),
    };
    match result {
        Ok(Done::Exit) => ExitCode::SUCCESS,
        Ok(Done::Reboot) => {
            drop(rt);
            say(DeployStage::Reboot, "syncing and rebooting");
            nix::unistd::sync();
            let e = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
            eprintln!("pxed-agent: reboot: {e:?}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("pxed-agent: FAILED: {e}");
            match e {
                AgentError::Cmdline(_) | AgentError::ReadCmdline { .. } => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// What to do after a deploy that went well.
#[derive(Debug, PartialEq, Eq)]
pub enum Done {
    /// Exit 0 (dry run, `--no-reboot`).
    Exit,
    /// Reboot into the deployed system.
    Reboot,
}

fn say(stage: DeployStage, msg: impl std::fmt::Display) {
    eprintln!("pxed-agent: {stage}: {msg}");
}

/// An HTTP client for pxed and the image server: bounded connect and per-read waits,
/// no total timeout (an image takes as long as it takes). pxed serves the ramdisk over
/// plain HTTP and the ramdisk has no CA store, so TLS is configured with no roots
/// (reqwest's default, the platform verifier, fails to build without one).
pub fn http_client() -> Result<reqwest::Client, AgentError> {
    crate::net::install_crypto_provider();
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(60))
        .no_proxy()
        .tls_backend_preconfigured(tls)
        .build()
        .map_err(AgentError::Client)
}

/// The server's reason from an error body: `reason`, else `detail`, else `error`, else
/// the body itself.
fn server_reason(body: &str) -> String {
    if let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(body) {
        for k in ["reason", "detail", "error"] {
            if let Some(serde_json::Value::String(s)) = m.get(k) {
                return s.clone();
            }
        }
    }
    let b = body.trim();
    if b.len() > 500 {
        format!("{}...", &b[..b.floor_char_boundary(500)])
    } else {
        b.to_string()
    }
}

/// Calls to pxed under `/cb/{token}`.
#[derive(Clone)]
pub struct Callbacks {
    http: reqwest::Client,
    /// `{url}/cb/{token}`.
    base: String,
    /// `{url}/cb/…` for messages: the token stays off the console.
    shown: String,
    retry: RetryPolicy,
}

/// One call's outcome when it did not succeed.
enum CallFail {
    Retry(String),
    Fatal(String),
}

impl Callbacks {
    /// Callbacks for the node `cmd` names.
    pub fn new(cmd: &Cmdline, retry: RetryPolicy) -> Result<Self, AgentError> {
        Ok(Callbacks {
            http: http_client()?,
            base: cmd.callback_base(),
            shown: format!("{}/cb/…", cmd.url),
            retry,
        })
    }

    async fn once(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, CallFail> {
        let resp = req
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(|e| CallFail::Retry(format!("{e:#}")))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp.text().await.unwrap_or_default();
        let why = format!("{status}: {}", server_reason(&body));
        if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            Err(CallFail::Retry(why))
        } else {
            Err(CallFail::Fatal(why))
        }
    }

    /// One call, retried with backoff on connection errors and 5xx; 4xx is final.
    async fn call(
        &self,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<reqwest::Response, AgentError> {
        let method = if body.is_some() { "POST" } else { "GET" };
        let url = format!("{}/{path}", self.base);
        let shown = format!("{}/{path}", self.shown);
        let mut n = 0;
        loop {
            n += 1;
            let req = match &body {
                None => self.http.get(&url),
                Some(b) => self.http.post(&url).json(b),
            };
            match self.once(req).await {
                Ok(r) => return Ok(r),
                Err(CallFail::Retry(why)) if n < self.retry.attempts => {
                    let wait = self.retry.backoff(n);
                    eprintln!("pxed-agent: {method} {shown}: {why}; retrying in {wait:?}");
                    tokio::time::sleep(wait).await;
                }
                Err(CallFail::Retry(reason) | CallFail::Fatal(reason)) => {
                    return Err(AgentError::Call {
                        method,
                        url: shown,
                        reason,
                    });
                }
            }
        }
    }

    /// `GET /deploy`. A body that is not a plan fails the `plan` stage.
    pub async fn plan(&self) -> Result<DeployPlan, AgentError> {
        let resp = self.call("deploy", None).await?;
        let text = resp
            .text()
            .await
            .map_err(|e| AgentError::at(DeployStage::Plan, format!("read plan: {e}")))?;
        serde_json::from_str(&text)
            .map_err(|e| AgentError::at(DeployStage::Plan, format!("plan is not valid: {e}")))
    }

    /// POSTs `body` to `path`, with retries.
    pub async fn post<T: Serialize>(&self, path: &str, body: &T) -> Result<(), AgentError> {
        let v = serde_json::to_value(body).map_err(|e| AgentError::Call {
            method: "POST",
            url: format!("{}/{path}", self.shown),
            reason: format!("encode body: {e}"),
        })?;
        self.call(path, Some(v)).await.map(drop)
    }

    /// Best-effort progress for the node's timeline: one try, short timeout, errors
    /// only logged.
    pub async fn progress(&self, stage: DeployStage, message: String, bytes: Option<u64>) {
        let body = DeployProgress {
            stage,
            message,
            bytes,
        };
        let req = self
            .http
            .post(format!("{}/deploy/progress", self.base))
            .timeout(Duration::from_secs(5))
            .json(&body);
        if let Err(CallFail::Retry(e) | CallFail::Fatal(e)) = self.once(req).await {
            eprintln!("pxed-agent: progress report not delivered: {e}");
        }
    }
}

/// Runs a blocking step (tools, block devices) off the runtime thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Whether `/` is the initramfs (ramfs or tmpfs), i.e. we run in the deploy ramdisk.
fn root_is_ramdisk() -> bool {
    nix::sys::statfs::statfs("/").is_ok_and(|s| {
        let t = s.filesystem_type();
        t == nix::sys::statfs::TMPFS_MAGIC || t == RAMFS_MAGIC
    })
}

/// The whole deploy. Failures after the plan arrived are reported to pxed before
/// they are returned.
pub async fn deploy(a: &DeployArgs) -> Result<Done, AgentError> {
    let line = std::fs::read_to_string(&a.cmdline).map_err(|source| AgentError::ReadCmdline {
        path: a.cmdline.clone(),
        source,
    })?;
    let cmd = cmdline::parse(&line)?;
    if !a.dry_run && !a.force && !root_is_ramdisk() {
        return Err(AgentError::NotRamdisk);
    }
    let cb = Callbacks::new(
        &cmd,
        RetryPolicy {
            attempts: 6,
            ..RetryPolicy::default()
        },
    )?;
    say(DeployStage::Plan, format!("GET {}/cb/…/deploy", cmd.url));
    let plan = match cb.plan().await {
        Ok(p) => p,
        Err(AgentError::Stage { stage, reason }) => return Err(fail(&cb, stage, reason).await),
        Err(e) => return Err(e),
    };
    say(
        DeployStage::Plan,
        format!(
            "node {} generation {}: {} as {} ({})",
            plan.node_id, plan.generation, plan.image.name, plan.hostname, plan.arch
        ),
    );
    match run_plan(a, &cmd, &cb, &plan).await {
        Ok(d) => Ok(d),
        Err(AgentError::Stage { stage, reason }) => Err(fail(&cb, stage, reason).await),
        Err(e) => {
            // Not a stage error; still the node must not wait for a timeout.
            let reason = e.to_string();
            Err(fail(&cb, DeployStage::Reboot, reason).await)
        }
    }
}

/// Reports a failure to pxed (retried; a report that cannot be delivered is only
/// logged) and returns it as the agent's error.
async fn fail(cb: &Callbacks, stage: DeployStage, reason: String) -> AgentError {
    eprintln!("pxed-agent: {stage}: FAILED: {reason}");
    let report = FailedReport {
        stage: stage.as_str().to_string(),
        reason: reason.clone(),
    };
    if let Err(e) = cb.post("failure", &report).await {
        eprintln!("pxed-agent: could not report the failure: {e}");
    }
    AgentError::Stage { stage, reason }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

async fn run_plan(
    a: &DeployArgs,
    cmd: &Cmdline,
    cb: &Callbacks,
    plan: &DeployPlan,
) -> Result<Done, AgentError> {
    use DeployStage::*;
    let sys = a.sysroot.join("sys");

    // Facts.
    let root = a.sysroot.clone();
    let facts: AgentFacts = blocking(move || {
        let mut f = facts::collect(&root);
        let started = std::time::Instant::now();
        f.inventory = Some(facts::inventory(&root));
        f.inventory_ms = Some(started.elapsed().as_millis() as u64);
        f
    })
    .await;
    say(
        Facts,
        format!(
            "{} cpus, {} MiB, {} {}; disks: {}; nics: {}",
            facts.cpus,
            facts.mem_kb / 1024,
            facts.machine,
            facts.product,
            facts
                .disks
                .iter()
                .map(|d| format!(
                    "{} {}{}",
                    d.name,
                    gib(d.size),
                    if d.removable { " removable" } else { "" }
                ))
                .collect::<Vec<_>>()
                .join(", "),
            facts
                .nics
                .iter()
                .map(|n| format!("{} {}", n.name, n.mac))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    );
    cb.post("deploy/facts", &facts)
        .await
        .map_err(|e| AgentError::at(Facts, e))?;

    // Disk.
    let target = disk::choose_target(
        plan.target_disk.as_deref(),
        cmd.disk.as_deref(),
        &facts.disks,
    )
    .map_err(|e| AgentError::at(Disk, e))?;
    let size = facts
        .disks
        .iter()
        .find(|d| format!("/dev/{}", d.name) == target)
        .map_or(0, |d| d.size);
    if size < plan.image.size {
        return Err(AgentError::at(
            Disk,
            disk::DiskError::TooSmall {
                disk: target,
                size,
                need: plan.image.size,
            },
        ));
    }
    rootfs::check_plan(plan).map_err(|e| AgentError::at(Configure, e))?;
    let wipe = disk::wipe_set(&target, &facts.disks);
    let part = disk::partition_path(&target, plan.image.root_partition);
    say(Disk, format!("target {target} ({})", gib(size)));
    cb.progress(Disk, format!("target {target} ({})", gib(size)), None)
        .await;

    if a.dry_run {
        let list = |v: &[String]| v.join(", ");
        say(
            Wipe,
            format!(
                "dry run: would wipe {} (signatures, first and last MiB)",
                list(&wipe)
            ),
        );
        say(
            Write,
            format!(
                "dry run: would write {} ({:?}, {} raw bytes, sha256 {}) to {target}",
                plan.image.url, plan.image.compression, plan.image.size, plan.image.sha256
            ),
        );
        say(
            Grow,
            format!("dry run: would grow {part} and its filesystem to the end of {target}"),
        );
        say(
            Configure,
            format!(
                "dry run: would set hostname {}, {} ssh keys, {} files, enable [{}]",
                plan.hostname,
                plan.ssh_authorized_keys.len(),
                plan.files.len(),
                list(&plan.enable_units)
            ),
        );
        say(Reboot, "dry run: done, nothing written");
        return Ok(Done::Exit);
    }

    // Wipe.
    say(Wipe, format!("wiping {}", wipe.join(", ")));
    cb.progress(Wipe, format!("wiping {}", wipe.join(", ")), None)
        .await;
    for name in wipe {
        let sys = sys.clone();
        blocking(move || disk::wipe(&sys, &name))
            .await
            .map_err(|e| AgentError::at(Wipe, e))?;
    }

    // Write and verify.
    say(Write, format!("{} -> {target}", plan.image.url));
    cb.progress(
        Write,
        format!("writing {} to {target}", plan.image.name),
        Some(0),
    )
    .await;
    let t = target.clone();
    let need = plan.image.size;
    let dev = blocking(move || disk::open_target(&t, need))
        .await
        .map_err(|e| AgentError::at(Write, e))?;
    let written = Arc::new(AtomicU64::new(0));
    let ticker = {
        let (cb, written, total) = (cb.clone(), written.clone(), plan.image.size);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROGRESS_EVERY).await;
                let n = written.load(Ordering::Relaxed);
                let pct = n * 100 / total.max(1);
                say(Write, format!("{n} of {total} bytes ({pct}%)"));
                cb.progress(Write, format!("{pct}% written"), Some(n)).await;
            }
        })
    };
    let result = stream::stream_image(
        &cb.http,
        &plan.image,
        dev,
        WRITE_CHUNK,
        written.clone(),
        &RetryPolicy::default(),
    )
    .await;
    ticker.abort();
    let (dev, w) = result.map_err(|e| AgentError::at(e.stage(), e))?;
    blocking(move || dev.sync_all())
        .await
        .map_err(|e| AgentError::at(Write, format!("fsync {target}: {e}")))?;
    say(
        Verify,
        format!("{} bytes, sha256 {} as planned", w.bytes, w.sha256),
    );
    cb.progress(
        Verify,
        format!("sha256 {} verified", w.sha256),
        Some(w.bytes),
    )
    .await;

    // Grow.
    say(Grow, format!("growing {part} to the end of {target}"));
    cb.progress(Grow, format!("growing {part}"), None).await;
    let (t, n) = (target.clone(), plan.image.root_partition);
    let part = blocking(move || disk::grow(&t, n))
        .await
        .map_err(|e| AgentError::at(Grow, e))?;

    // Configure.
    say(Configure, format!("hostname {} on {part}", plan.hostname));
    cb.progress(Configure, format!("configuring {part}"), None)
        .await;
    let p = plan.clone();
    blocking(move || configure_on(&part, &p))
        .await
        .map_err(|e| AgentError::at(Configure, e))?;

    // Installed, then reboot.
    cb.post(
        "installed",
        &InstalledReport {
            hostname: plan.hostname.clone(),
            arch: plan.arch,
        },
    )
    .await
    .map_err(|e| AgentError::at(Reboot, e))?;
    say(Reboot, "reported installed");
    if a.no_reboot {
        say(Reboot, "--no-reboot: exiting");
        return Ok(Done::Exit);
    }
    Ok(Done::Reboot)
}

/// Mounts `part` (ext4), configures it from the plan, syncs and unmounts (also when
/// configuring failed, so the error is not hidden behind a busy disk).
fn configure_on(part: &str, plan: &DeployPlan) -> Result<(), String> {
    use nix::mount::{MntFlags, MsFlags};
    let mnt = std::env::temp_dir().join("pxed-root");
    std::fs::create_dir_all(&mnt).map_err(|e| format!("mkdir {}: {e}", mnt.display()))?;
    nix::mount::mount(
        Some(part),
        &mnt,
        Some("ext4"),
        MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .map_err(|e| format!("mount {part} on {}: {e}", mnt.display()))?;
    let configured = rootfs::configure(Path::new(&mnt), plan).map_err(|e| e.to_string());
    nix::unistd::sync();
    let unmounted = nix::mount::umount2(&mnt, MntFlags::empty())
        .map_err(|e| format!("umount {}: {e}", mnt.display()));
    configured.and(unmounted)
}

#[cfg(test)]
mod tests;
