//! Command line: `pxed serve`, `pxed check-config`, `pxed migrate`, `pxed export`,
//! `pxed import`, and the client subcommands.

use std::process::ExitCode;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Flags};
use crate::store::Store;

#[derive(Parser, Debug)]
#[command(
    name = "pxed",
    version,
    about = "PXE/iPXE boot and reinstall appliance"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run DHCP, TFTP, HTTP and the lifecycle worker.
    #[command(after_help = ENV_HELP)]
    Serve(Flags),
    /// Print the validated configuration (secrets masked) and exit.
    #[command(after_help = ENV_HELP)]
    CheckConfig(Flags),
    /// Nodes, through the HTTP API.
    #[command(subcommand)]
    Node(crate::client::NodeCmd),
    /// Images: import from the catalog into the images dir (runs on the pxed host).
    #[command(subcommand)]
    Image(crate::client::ImageCmd),
    /// BMCs: what a BMC advertises and whether its credentials work.
    #[command(subcommand)]
    Bmc(crate::client::BmcCmd),
    /// Hardware profiles: list them, and match a node's inventory against them.
    #[command(subcommand)]
    Profile(crate::client::ProfileCmd),
    /// Reinstalls over a period: count, p50/p95 duration, failures by stage, leftovers.
    Report(crate::client::ReportArgs),
    /// Apply the database schema migrations and exit (`serve` applies them too).
    #[command(after_help = ENV_HELP)]
    Migrate(Flags),
    /// Write the whole store as JSON: nodes, leases, audit log, BMC passwords (sealed).
    #[command(after_help = ENV_HELP)]
    Export(ExportArgs),
    /// Load an export into an empty store (a new data dir; pxed not running on it).
    #[command(after_help = ENV_HELP)]
    Import(ImportArgs),
    /// The deploy agent, run on the node inside the deploy ramdisk.
    #[command(subcommand)]
    Agent(crate::agent::AgentCmd),
}

#[derive(clap::Args, Debug)]
struct ExportArgs {
    #[command(flatten)]
    flags: Flags,
    /// Write to this file (mode 0600) instead of standard output.
    #[arg(long, short)]
    out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct ImportArgs {
    #[command(flatten)]
    flags: Flags,
    /// The export (`-` for standard input).
    file: PathBuf,
    /// The exporting pxed's secret key file (its <data_dir>/secret-key), when this
    /// data dir has another key: its BMC passwords are sealed anew under this one.
    #[arg(long)]
    secret_key: Option<PathBuf>,
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    // PostgreSQL's notices (e.g. "relation _sqlx_migrations already exists, skipping"
    // when several instances migrate at once) are not news to an operator.
    let filter = EnvFilter::try_from_env("PXED_LOG")
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

const ENV_HELP: &str = "Configuration: defaults < config file < PXED_* environment < flags.\n\
The environment layer reads only config keys, `__` between section and key\n\
(PXED_DATA_DIR, PXED_DHCP__MODE, PXED_LIFECYCLE__DEADLINES__INSTALLING, ...).\n\
Other PXED_* variables (the CLI's PXED_URL, PXED_TOKEN_FILE and PXED_BMC_PASSWORD,\n\
a wrapper's own) are left alone; a misspelled key inside a known section is an error.";

/// Entry point used by `main.rs`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Serve(_) | Cmd::Agent(_)) {
        default_sigpipe();
    }
    init_tracing();
    crate::net::install_crypto_provider();
    match cli.cmd {
        Cmd::CheckConfig(a) => match a.load() {
            Ok(c) => {
                for w in c.warnings() {
                    eprintln!("warning: {w}");
                }
                match toml::to_string_pretty(&c) {
                    Ok(s) => print!("{s}"),
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::FAILURE;
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Node(c) => crate::client::run_node(c),
        Cmd::Image(c) => crate::client::run_image(c),
        Cmd::Bmc(c) => crate::client::run_bmc(c),
        Cmd::Report(a) => crate::client::run_report(a),
        Cmd::Profile(c) => crate::client::run_profile(c),
        Cmd::Agent(c) => crate::agent::run(c),
        Cmd::Migrate(flags) => with_config(&flags, migrate),
        Cmd::Export(a) => with_config(&a.flags, |cfg| export(cfg, a.out)),
        Cmd::Import(a) => with_config(&a.flags, |cfg| import(cfg, a.file, a.secret_key)),
        Cmd::Serve(a) => {
            let cfg = match a.load() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve(cfg, a)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {}", chain(&e));
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// An error and its causes on one line, each cause once: most of our error types
/// already print their source in their own message (`DHCP lease store: {0}`), so
/// anyhow's `{:#}` would repeat the innermost reason once per level.
fn chain(e: &anyhow::Error) -> String {
    crate::error_chain(e.as_ref())
}

/// A command whose output goes to a pipe ends quietly when the reader goes away
/// (`pxed node list | head`), as `ls` does, instead of panicking in `println!`: Rust
/// ignores SIGPIPE for every program, so the write fails with EPIPE instead. Only
/// the commands that print: the daemon and the agent keep SIGPIPE ignored (a
/// socket's peer gone is an error they handle, not a reason to die).
fn default_sigpipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: called first thing on the main thread, before any other thread exists
    // and before any handler is installed; SIG_DFL runs no code of ours.
    if let Err(e) = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) } {
        eprintln!("warning: cannot restore SIGPIPE: {e}");
    }
}

/// Loads the configuration and runs `job` with it on a new runtime.
fn with_config<F, Fut>(flags: &Flags, job: F) -> ExitCode
where
    F: FnOnce(config::Config) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let cfg = match flags.load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let run = job(cfg);
    let result = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(run));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Applies the migrations to the configured store: the SQLite file in `data_dir`, or
/// the PostgreSQL database `database_url` names.
async fn migrate(cfg: config::Config) -> anyhow::Result<()> {
    match &cfg.database_url {
        None => {
            let store = Store::open(&cfg.data_dir).await?;
            let version = store.schema_version().await;
            store.close().await;
            eprintln!("schema version {}", version?);
        }
        Some(url) => {
            let store = store_pg::PgStore::connect(url, 1).await?;
            let done = async {
                let version = store.migrate().await?;
                Ok::<_, store_pg::PgError>((version, store.describe().await?))
            }
            .await;
            store.close().await;
            let (version, about) = done?;
            eprintln!("schema version {version} ({about})");
        }
    }
    Ok(())
}

/// Connects to the PostgreSQL database `url` names (two connections at most).
async fn postgres(url: &str) -> anyhow::Result<store_pg::PgStore> {
    Ok(store_pg::PgStore::connect(url, 2).await?)
}

async fn export(cfg: config::Config, out: Option<PathBuf>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let export = match &cfg.database_url {
        Some(url) => {
            let pg = postgres(url).await?;
            let export = crate::store::dump::export_pg(&pg).await;
            pg.close().await;
            export?
        }
        None => {
            let store = Store::open(&cfg.data_dir).await?;
            let export = store.export().await;
            store.close().await;
            export?
        }
    };
    let summary = summary(&export.tables);
    match &out {
        Some(path) => {
            use std::os::unix::fs::OpenOptionsExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            let mut w = std::io::BufWriter::new(file);
            serde_json::to_writer(&mut w, &export)?;
            w.flush()?;
            w.into_inner()?.sync_all()?;
        }
        None => {
            let mut w = std::io::BufWriter::new(std::io::stdout().lock());
            serde_json::to_writer(&mut w, &export)?;
            writeln!(w)?;
            w.flush()?;
        }
    }
    eprintln!("exported schema {}: {summary}", export.schema);
    Ok(())
}

async fn import(
    cfg: config::Config,
    file: PathBuf,
    secret_key: Option<PathBuf>,
) -> anyhow::Result<()> {
    use crate::store::dump::Export;
    let text = if file.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?
    };
    let export: Export = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a pxed export", file.display()))?;
    let key = secret_key
        .map(|p| crate::store::secrets::SecretKey::read(&p))
        .transpose()?;
    let done = match &cfg.database_url {
        Some(url) => {
            // Every instance on this database seals and opens BMC passwords with the
            // key in its data dir (or its credential): they must all have this one.
            std::fs::create_dir_all(&cfg.data_dir)
                .with_context(|| format!("cannot create {}", cfg.data_dir.display()))?;
            let ours = crate::store::secrets::SecretKey::load(&cfg.data_dir)?;
            let pg = postgres(url).await?;
            let done = crate::store::dump::import_pg(&pg, &ours, &export, key.as_ref()).await;
            pg.close().await;
            done?
        }
        None => {
            let store = Store::open(&cfg.data_dir).await?;
            let done = store.import(&export, key.as_ref()).await;
            store.close().await;
            done?
        }
    };
    let rows: usize = done.rows.values().sum();
    eprintln!(
        "imported {rows} rows of schema {}: {}; {} BMC passwords sealed under this data dir's key",
        export.schema,
        summary(&export.tables),
        done.resealed
    );
    Ok(())
}

/// "2 nodes, 1 leases, 5 node_events" for the tables with rows.
fn summary(tables: &std::collections::BTreeMap<String, crate::store::dump::Table>) -> String {
    let parts: Vec<String> = ["nodes", "leases", "node_events", "bmc_secrets"]
        .iter()
        .map(|t| format!("{} {t}", tables.get(*t).map_or(0, |t| t.rows.len())))
        .collect();
    parts.join(", ")
}

/// Runs the daemon: SIGTERM and SIGINT drain and stop it; SIGHUP re-reads the
/// configuration (an invalid one is reported and the running one kept).
async fn serve(cfg: config::Config, flags: config::Flags) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int, mut hup) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
        signal(SignalKind::hangup())?,
    );
    tokio::spawn(async move {
        loop {
            tokio::select! {
                // CANCEL-SAFETY: signal recv is cancel-safe.
                _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); break; }
                // CANCEL-SAFETY: signal recv is cancel-safe.
                _ = int.recv() => { tracing::info!("SIGINT: shutting down"); break; }
                // CANCEL-SAFETY: signal recv is cancel-safe.
                _ = hup.recv() => match flags.load() {
                    Ok(new) => {
                        let _ = tx.send(new).await;
                    }
                    Err(e) => tracing::error!(error = %e, "SIGHUP: the configuration is invalid; keeping the running one"),
                },
            }
        }
        c.cancel();
    });
    crate::app::run(cfg, cancel, rx).await
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    #[error("UNIQUE constraint failed: reservations.mac")]
    struct Db;

    #[derive(Debug, thiserror::Error)]
    #[error("DHCP lease store: {0}")]
    struct Store(#[from] Db);

    /// A cause its parent already prints is not printed again; one it does not is.
    #[test]
    fn each_cause_is_printed_once() {
        let e = anyhow::Error::from(Store(Db)).context("starting DHCP");
        assert_eq!(
            chain(&e),
            "starting DHCP: DHCP lease store: UNIQUE constraint failed: reservations.mac"
        );
        assert_eq!(format!("{e:#}").matches("UNIQUE").count(), 2);
    }
}
