//! Command line: `pxed serve`, `pxed check-config`, and the client subcommands.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Flags};

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
    /// The deploy agent, run on the node inside the deploy ramdisk.
    #[command(subcommand)]
    Agent(crate::agent::AgentCmd),
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("PXED_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

const ENV_HELP: &str = "Configuration: defaults < config file < PXED_* environment < flags.\n\
The environment layer reads only config keys, `__` between section and key\n\
(PXED_DATA_DIR, PXED_DHCP__MODE, PXED_LIFECYCLE__DEADLINES__INSTALLING, ...).\n\
Other PXED_* variables (the CLI's PXED_URL and PXED_BMC_PASSWORD, a wrapper's own)\n\
are left alone; a misspelled key inside a known section is an error.";

/// Entry point used by `main.rs`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    crate::net::install_crypto_provider();
    match cli.cmd {
        Cmd::CheckConfig(a) => match a.load() {
            Ok(c) => {
                for o in crate::inventory::profile::overlaps(&c.profiles) {
                    eprintln!("warning: profiles overlap: {o}");
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
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
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
