//! Command line: `pxed serve`, `pxed check-config`, and the client subcommands.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{self, DhcpMode, Flags};

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
    Serve(ServerArgs),
    /// Print the validated configuration (secrets masked) and exit.
    CheckConfig(ServerArgs),
    /// Nodes, through the HTTP API.
    #[command(subcommand)]
    Node(crate::client::NodeCmd),
    /// Images: import from the catalog into the images dir (runs on the pxed host).
    #[command(subcommand)]
    Image(crate::client::ImageCmd),
    /// BMCs: what a BMC advertises and whether its credentials work.
    #[command(subcommand)]
    Bmc(crate::client::BmcCmd),
    /// The deploy agent, run on the node inside the deploy ramdisk.
    #[command(subcommand)]
    Agent(crate::agent::AgentCmd),
}

/// Flags shared by `serve` and `check-config`.
#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// TOML config file.
    #[arg(long, env = "PXED_CONFIG")]
    config: Option<PathBuf>,
    /// Run on loopback with a local data dir and the repo's image catalog (no DHCP).
    #[arg(long)]
    demo: bool,
    /// Interface to answer DHCP on (repeatable). DHCP is served only there.
    #[arg(long = "interface", value_name = "IFACE")]
    interfaces: Vec<String>,
    /// The address clients are told to use for TFTP and HTTP.
    #[arg(long)]
    server_ip: Option<Ipv4Addr>,
    /// DHCP mode.
    #[arg(long, value_enum)]
    dhcp: Option<DhcpMode>,
    /// Address pool, START-END (full mode).
    #[arg(long)]
    pool: Option<String>,
    #[arg(long)]
    netmask: Option<Ipv4Addr>,
    #[arg(long)]
    router: Option<Ipv4Addr>,
    /// DNS server (repeatable).
    #[arg(long)]
    dns: Vec<Ipv4Addr>,
    /// Lease time (e.g. 3600, 1h).
    #[arg(long)]
    lease_time: Option<String>,
    /// SQLite file and state.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// iPXE binaries (undionly.kpxe, snponly.efi, ipxe-arm64.efi).
    #[arg(long)]
    ipxe_dir: Option<PathBuf>,
    /// Imported image files.
    #[arg(long)]
    images_dir: Option<PathBuf>,
    /// HTTP listen address.
    #[arg(long)]
    http: Option<SocketAddr>,
    /// TFTP listen address.
    #[arg(long)]
    tftp: Option<SocketAddr>,
    /// File holding the API bearer token.
    #[arg(long)]
    api_token_file: Option<PathBuf>,
}

impl ServerArgs {
    fn flags(&self) -> Flags {
        Flags {
            interfaces: self.interfaces.clone(),
            server_ip: self.server_ip,
            dhcp: self.dhcp,
            pool: self.pool.clone(),
            netmask: self.netmask,
            router: self.router,
            dns: self.dns.clone(),
            lease_time: self.lease_time.clone(),
            data_dir: self.data_dir.clone(),
            ipxe_dir: self.ipxe_dir.clone(),
            images_dir: self.images_dir.clone(),
            http: self.http,
            tftp: self.tftp,
            api_token_file: self.api_token_file.clone(),
            demo: self.demo,
        }
    }

    /// Loads the configuration these flags point at.
    pub fn load(&self) -> Result<config::Config, config::ConfigError> {
        let file = self.config.clone().or_else(|| {
            let p = PathBuf::from("/etc/pxed/pxed.toml");
            (!self.demo && p.exists()).then_some(p)
        });
        config::load(file.as_deref(), std::env::vars(), &self.flags())
    }
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

/// Entry point used by `main.rs`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    crate::net::install_crypto_provider();
    match cli.cmd {
        Cmd::CheckConfig(a) => match a.load() {
            Ok(c) => {
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
            match rt.block_on(serve(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn serve(cfg: config::Config) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            // CANCEL-SAFETY: signal recv is cancel-safe.
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            // CANCEL-SAFETY: signal recv is cancel-safe.
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        c.cancel();
    });
    crate::app::run(cfg, cancel).await
}
