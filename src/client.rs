//! Client subcommands: `pxed node ...` and `pxed bmc check <node>` talk to the HTTP
//! API (the server checks the BMC: its secrets never leave it); `pxed image ...` runs
//! on the pxed host against its store.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand};

mod hw;
use serde_json::Value;

use crate::wire::{
    ApiErrorBody, BmcCheck, CreateBmc, CreateNode, NodeDetail, NodeView, Operation,
    ReinstallRequest,
};

use crate::config::Flags as ServerArgs;
use crate::model::{Driver, Mac, NodeArch};

/// Where the API is and how to authenticate.
#[derive(Args, Debug, Clone)]
pub struct ApiArgs {
    /// Base URL of pxed's HTTP server.
    #[arg(long, env = "PXED_URL", default_value = "http://127.0.0.1")]
    url: String,
    /// File holding the API token (else PXED_API_TOKEN).
    #[arg(long, env = "PXED_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// `pxed node ...`.
#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// List nodes, filtered as the board is (`--state failed --label rack=r12`).
    List(ListArgs),
    /// Show one node with its events (id, name, hostname or MAC).
    Show {
        /// Node (id, name, hostname or MAC).
        node: String,
        /// Print the last lines the node's installer sent to pxed (syslog or reporting
        /// webhook) instead of the node and its events.
        #[arg(long)]
        log: bool,
        /// With --log: that generation's (default: the current one).
        #[arg(long, requires = "log")]
        generation: Option<i64>,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Register a node.
    Add {
        /// MAC addresses (the first is the boot NIC).
        #[arg(long = "mac", required = true)]
        macs: Vec<Mac>,
        /// A name to find it by (`pxed node show NAME`), unique, not a number or a MAC
        /// (its hostname is derived from its MAC).
        #[arg(long)]
        name: Option<String>,
        /// x86_64, arm64 or unknown (the default: learnt from DHCP or the agent).
        #[arg(long)]
        arch: Option<NodeArch>,
        /// A label the board filters on, `KEY=VALUE` (e.g. `rack=r12`); repeatable.
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// BMC driver: redfish or ipmi.
        #[arg(long, requires = "bmc_address")]
        bmc_driver: Option<Driver>,
        /// Redfish: `host[:port]` (HTTPS) or an `http(s)://` URL; IPMI: `host[:port]`
        /// (port 623 by default).
        #[arg(long)]
        bmc_address: Option<String>,
        /// The BMC user.
        #[arg(long)]
        bmc_user: Option<String>,
        /// Environment variable holding the BMC password (never a flag: flags show in `ps`).
        #[arg(long, default_value = "PXED_BMC_PASSWORD")]
        bmc_password_env: String,
        /// Redfish: the system's id (`1`, `System.Embedded.1`) or its path, when the BMC
        /// has several (default: its only system, or the one with this node's MAC).
        #[arg(long)]
        bmc_system_id: Option<String>,
        /// Accept any TLS certificate from this BMC (labs only).
        #[arg(long)]
        bmc_tls_insecure: bool,
        /// A file of OpenSSH public keys (one per line, `#` comments skipped) for root
        /// on this node's installed systems; `-` reads standard input.
        #[arg(long)]
        ssh_keys: Option<PathBuf>,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Show or replace a node's own SSH authorized keys (added to the config's and the
    /// image's at its next install).
    SshKeys {
        node: String,
        /// Replace them with the keys in this file (one per line; `-` for stdin).
        #[arg(long, conflicts_with = "clear")]
        set: Option<PathBuf>,
        /// Remove them all.
        #[arg(long)]
        clear: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Delete a node (its audit log stays).
    #[command(visible_aliases = ["delete", "remove"])]
    Rm {
        node: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Reinstall a node (idempotent with --idempotency-key).
    Reinstall {
        /// Node (id, name, hostname or MAC).
        node: String,
        /// The image to install (`pxed image list`; default: the config's
        /// `default_image`, else the node's last image).
        #[arg(long)]
        image: Option<String>,
        /// A key naming this request (e.g. `slurm-job123-node17`): the same key again
        /// answers with the same reinstall instead of starting another.
        #[arg(long)]
        idempotency_key: Option<String>,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Wait until a node reaches a state (exit 0), or say why not: it went failed (3)
    /// or quarantined (4), with pxed's reason, or the timeout passed (5).
    Wait(WaitArgs),
    /// Enroll a discovered node: it becomes available.
    Enroll(ActionArgs),
    /// Mark an available node allocated (handed out; a reclaim hook reinstalls it).
    Allocate(ActionArgs),
    /// Return an allocated node to available without reinstalling it.
    Release(ActionArgs),
    /// Take a node out of service, with the reason technicians will see; a reinstall
    /// in flight stops.
    Quarantine(ReasonArgs),
    /// Return a quarantined node to available.
    Restore(ActionArgs),
    /// Mark a node failed, with the reason technicians will see.
    Fail(ReasonArgs),
    /// Show a node's labels, or replace them (`--set rack=r12 --set row=b`, `--clear`).
    Labels(LabelsArgs),
    /// A node's hardware inventory, its profile, and what changed since its baseline.
    Inventory {
        node: String,
        /// That generation's (default: the newest reported).
        #[arg(long)]
        generation: Option<i64>,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Accept a node's newest (or a given generation's) inventory as its baseline; a
    /// node the acceptance gate quarantined returns to available.
    AcceptInventory {
        node: String,
        #[arg(long)]
        generation: Option<i64>,
        /// Hold the node to this profile from now on.
        #[arg(long, conflicts_with = "no_profile")]
        profile: Option<String>,
        /// Hold the node to no profile (only the baseline diff gates it).
        #[arg(long)]
        no_profile: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Nodes whose newest inventory has the hardware asked for.
    Query(hw::QueryArgs),
}

/// `pxed node list`'s filters: the API's and the board's, applied by the server.
#[derive(Args, Debug)]
pub struct ListArgs {
    /// Only nodes in this state.
    #[arg(long)]
    state: Option<crate::model::State>,
    /// Only nodes of this arch (x86_64, arm64, unknown).
    #[arg(long)]
    arch: Option<NodeArch>,
    /// Only nodes with this label: `KEY` or `KEY=VALUE`.
    #[arg(long)]
    label: Option<String>,
    /// Only nodes with this in a MAC (any notation), the name or the hostname.
    #[arg(long, short = 'q')]
    query: Option<String>,
    #[command(flatten)]
    api: ApiArgs,
}

impl ListArgs {
    /// The filters as the API's query string (`state=failed&label=rack%3Dr12`).
    fn query_string(&self) -> String {
        let pairs = [
            ("state", self.state.map(|s| s.to_string())),
            ("arch", self.arch.map(|a| a.to_string())),
            ("label", self.label.clone()),
            ("q", self.query.clone()),
        ];
        pairs
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", enc(v))))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// A query-string value, percent-encoded.
fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// `pxed node labels`.
#[derive(Args, Debug)]
pub struct LabelsArgs {
    /// Node (id, name, hostname or MAC).
    node: String,
    /// A label `KEY=VALUE`; repeatable. All of them replace the node's labels.
    #[arg(long = "set", value_parser = parse_label, conflicts_with = "clear")]
    set: Vec<(String, String)>,
    /// Remove every label.
    #[arg(long)]
    clear: bool,
    #[command(flatten)]
    api: ApiArgs,
}

impl LabelsArgs {
    /// Reads the node's labels, or replaces them; prints them `KEY=VALUE` a line.
    async fn run(self) -> Result<(), ClientError> {
        use crate::store::board::Labels;
        let api = Api::new(&self.api)?;
        let path = format!("/nodes/{}/labels", self.node);
        let labels: Labels = if self.clear || !self.set.is_empty() {
            let new: Labels = self.set.into_iter().collect();
            let body = serde_json::to_value(new).map_err(|e| ClientError::Other(e.to_string()))?;
            api.call(reqwest::Method::PUT, &path, Some(body), &[])
                .await?
        } else {
            api.call(reqwest::Method::GET, &path, None, &[]).await?
        };
        if self.api.json {
            print_json(&labels);
        } else {
            for (k, v) in &labels {
                println!("{k}={v}");
            }
        }
        Ok(())
    }
}

/// An operator's lifecycle action on one node (`POST /api/v1/nodes/{id}/actions/…`).
#[derive(Args, Debug)]
pub struct ActionArgs {
    /// Node (id, name, hostname or MAC).
    node: String,
    #[command(flatten)]
    api: ApiArgs,
}

/// An operator's action that records why: the board, `node show` and `node wait` say it.
#[derive(Args, Debug)]
pub struct ReasonArgs {
    /// Node (id, name, hostname or MAC).
    node: String,
    /// Why (e.g. `DIMM B2 errors, ticket 4711`).
    #[arg(long)]
    reason: String,
    #[command(flatten)]
    api: ApiArgs,
}

pub use hw::ProfileCmd;

/// Runs `pxed profile ...`.
pub fn run_profile(cmd: ProfileCmd) -> ExitCode {
    finish(rt().block_on(hw::profile(cmd)))
}

/// Exit codes of `pxed node wait` (1 is any other error; clap uses 2 for usage).
pub mod wait_exit {
    /// The node reached the state.
    pub const REACHED: u8 = 0;
    /// The node went `failed` (the reason is printed).
    pub const FAILED: u8 = 3;
    /// The node went `quarantined` (the reason is printed).
    pub const QUARANTINED: u8 = 4;
    /// The timeout passed first.
    pub const TIMEOUT: u8 = 5;
}

/// `pxed node wait`'s arguments.
#[derive(Args, Debug)]
#[command(
    after_help = "Exit status: 0 the node reached the state; 3 it went failed; \
4 it went quarantined (the reason is printed on stderr for both); 5 the timeout passed; \
1 any other error (unknown node, bad token). While pxed cannot be reached the wait goes \
on until the timeout."
)]
pub struct WaitArgs {
    /// Node (id, name, hostname or MAC).
    pub node: String,
    /// The state to wait for.
    #[arg(long, default_value = "available")]
    pub state: crate::model::State,
    /// Give up after this long (`90s`, `30m`, `2h`).
    #[arg(long, default_value = "30m", value_parser = crate::config::parse_duration)]
    pub timeout: std::time::Duration,
    /// Count only states of this generation or a later one: the generation a reinstall
    /// answered with (`pxed node reinstall --json`), so a wait after a reinstall does not
    /// return on the `available` (or `failed`) from before it. Default: the node's
    /// generation when the wait starts.
    #[arg(long)]
    pub generation: Option<i64>,
    /// How often to ask pxed.
    #[arg(long, default_value = "2s", value_parser = crate::config::parse_duration)]
    pub interval: std::time::Duration,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// What a look at the node says to a waiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitVerdict {
    Reached,
    /// `failed` or `quarantined` (not the state waited for), with the reason.
    Stopped {
        state: crate::model::State,
        reason: String,
    },
    Waiting,
}

/// Decides from one view of the node: states count only at `generation` or later;
/// `failed` and `quarantined` end the wait unless they are what it waits for.
pub fn wait_verdict(n: &NodeView, want: crate::model::State, generation: i64) -> WaitVerdict {
    use crate::model::State;
    if n.generation < generation {
        return WaitVerdict::Waiting;
    }
    if n.state == want {
        return WaitVerdict::Reached;
    }
    match n.state {
        State::Failed | State::Quarantined => WaitVerdict::Stopped {
            state: n.state,
            reason: crate::model::failure_text(n.failed_step, n.failed_reason.as_deref())
                .or_else(|| n.failed_reason.clone())
                .unwrap_or_else(|| "no reason recorded".into()),
        },
        _ => WaitVerdict::Waiting,
    }
}

/// Runs `pxed node wait` (see [`wait_exit`]).
pub fn run_wait(a: WaitArgs) -> ExitCode {
    match rt().block_on(wait(&a)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn wait(a: &WaitArgs) -> Result<u8, ClientError> {
    let api = Api::new(&a.api)?;
    let deadline = tokio::time::Instant::now() + a.timeout;
    let path = format!("/nodes/{}", a.node);
    let mut generation = a.generation;
    let mut last: Option<NodeView> = None;
    loop {
        match api
            .call::<NodeDetail>(reqwest::Method::GET, &path, None, &[])
            .await
        {
            Ok(d) => {
                let g = *generation.get_or_insert(d.node.generation);
                match wait_verdict(&d.node, a.state, g) {
                    WaitVerdict::Reached => {
                        if a.api.json {
                            print_json(&d.node);
                        } else {
                            println!(
                                "node {} is {} (generation {})",
                                a.node, d.node.state, d.node.generation
                            );
                        }
                        return Ok(wait_exit::REACHED);
                    }
                    WaitVerdict::Stopped { state, reason } => {
                        if a.api.json {
                            print_json(&d.node);
                        }
                        eprintln!(
                            "node {} is {state} (generation {}): {reason}",
                            a.node, d.node.generation
                        );
                        return Ok(if state == crate::model::State::Failed {
                            wait_exit::FAILED
                        } else {
                            wait_exit::QUARANTINED
                        });
                    }
                    WaitVerdict::Waiting => last = Some(d.node),
                }
            }
            // pxed restarting (or the network) must not end a reclaim hook's wait.
            Err(e @ ClientError::Http { .. }) => eprintln!("warning: {e}; still waiting"),
            Err(e) => return Err(e),
        }
        if tokio::time::Instant::now() + a.interval > deadline {
            let now = last.map_or_else(
                || "unknown".to_string(),
                |n| format!("{} (generation {})", n.state, n.generation),
            );
            eprintln!(
                "timeout: node {} did not reach {} within {}; it is {now}",
                a.node,
                a.state,
                crate::config::fmt_duration(a.timeout)
            );
            return Ok(wait_exit::TIMEOUT);
        }
        tokio::time::sleep(a.interval).await;
    }
}

/// `pxed image ...`.
#[derive(Subcommand, Debug)]
pub enum ImageCmd {
    /// Import an image from the catalog (checks the mirror, downloads, checks SHA-256s).
    Add {
        /// Catalog name (e.g. rocky-9) or path of a definition file.
        image: String,
        /// Import only this architecture (x86_64 or arm64); by default every one the
        /// entry lists must be on the mirror.
        #[arg(long)]
        arch: Option<crate::model::Arch>,
        /// Import even when the mirror lacks what the installer needs (see `check`).
        #[arg(long)]
        no_check: bool,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Check that mirror_base has everything the image's installer will fetch.
    ///
    /// Prints `<arch> ok <url>` or `<arch> MISSING <url>` per item and exits non-zero
    /// when anything is missing.
    Check {
        /// Catalog name (e.g. debian-12-installer) or path of a definition file.
        image: String,
        /// Check only this architecture.
        #[arg(long)]
        arch: Option<crate::model::Arch>,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// List imported images.
    List {
        #[command(flatten)]
        server: ServerArgs,
    },
    /// Remove an imported image and its files.
    Rm {
        image: String,
        #[command(flatten)]
        server: ServerArgs,
    },
}

/// `pxed bmc ...`.
#[derive(Subcommand, Debug)]
pub enum BmcCmd {
    /// Show what a BMC advertises and whether the credentials work: a registered node's
    /// BMC is checked by the running server (through its API), an unregistered one given
    /// with --driver/--address from this host.
    Check {
        /// Node (id, name, hostname or MAC).
        #[arg(required_unless_present = "address", conflicts_with = "address")]
        node: Option<String>,
        #[command(flatten)]
        direct: DirectBmc,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Power-cycle a registered node through its BMC (for a machine that hangs; its
    /// state does not change and the audit log records it; a reinstall power-cycles
    /// by itself).
    PowerCycle {
        /// Node (id, name, hostname or MAC).
        node: String,
        #[command(flatten)]
        api: ApiArgs,
    },
}

/// A BMC that is not registered, checked from this host with the default call policy.
#[derive(Args, Debug)]
pub struct DirectBmc {
    /// BMC driver: redfish or ipmi.
    #[arg(long, requires = "address")]
    driver: Option<String>,
    /// Redfish: `https://host[:port]`; IPMI: `host[:port]`.
    #[arg(long, requires = "driver")]
    address: Option<String>,
    /// BMC user.
    #[arg(long, requires = "address")]
    username: Option<String>,
    /// Environment variable holding the password.
    #[arg(long, default_value = "PXED_BMC_PASSWORD")]
    password_env: String,
    /// Redfish ComputerSystem id.
    #[arg(long, requires = "address")]
    system_id: Option<String>,
    /// Accept any TLS certificate from this BMC (labs only).
    #[arg(long, requires = "address")]
    tls_insecure: bool,
}

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "no API token: set PXED_API_TOKEN, or PXED_TOKEN_FILE or --token-file to a file \
         holding it (pxed serve writes one to <data_dir>/api-token unless api_token_file is set)"
    )]
    NoToken,
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot reach {url}: {}", why_unreachable(.source))]
    Http { url: String, source: reqwest::Error },
    #[error("{status}: {error}: {detail}")]
    Api {
        status: u16,
        error: String,
        detail: String,
    },
    #[error("{0}")]
    Other(String),
}

/// Why a request failed: the HTTP client's causes (connection refused, a TLS failure)
/// without its top line, which repeats the URL.
fn why_unreachable(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    e.source().map_or_else(|| e.to_string(), crate::error_chain)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn finish(r: Result<(), ClientError>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

struct Api {
    url: String,
    token: String,
    http: reqwest::Client,
}

impl Api {
    fn new(a: &ApiArgs) -> Result<Api, ClientError> {
        let token = match &a.token_file {
            Some(p) => std::fs::read_to_string(p)
                .map_err(|source| ClientError::Read {
                    path: p.clone(),
                    source,
                })?
                .trim()
                .to_string(),
            None => std::env::var("PXED_API_TOKEN").map_err(|_| ClientError::NoToken)?,
        };
        crate::net::install_crypto_provider();
        Ok(Api {
            url: a.url.trim_end_matches('/').to_string(),
            token,
            http: reqwest::Client::new(),
        })
    }

    /// Calls the API and reads its answer as the API's own type `T`.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, String)],
    ) -> Result<T, ClientError> {
        let url = format!("{}/api/v1{path}", self.url);
        let mut req = self.http.request(method, &url).bearer_auth(&self.token);
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.map_err(|source| ClientError::Http {
            url: url.clone(),
            source,
        })?;
        let status = resp.status();
        let text = resp.text().await.map_err(|source| ClientError::Http {
            url: url.clone(),
            source,
        })?;
        if !status.is_success() {
            let e: ApiErrorBody = serde_json::from_str(&text).unwrap_or(ApiErrorBody {
                error: "error".into(),
                detail: text,
            });
            return Err(ClientError::Api {
                status: status.as_u16(),
                error: e.error,
                detail: e.detail,
            });
        }
        let text = if text.is_empty() {
            "null"
        } else {
            text.as_str()
        };
        serde_json::from_str(text)
            .map_err(|e| ClientError::Other(format!("{url}: unexpected answer: {e}")))
    }
}

impl Api {
    /// Every node the filters (a query string, `""` for none) let through, page by
    /// page (`GET /api/v1/nodes?after=…`, the largest page).
    async fn all_nodes(&self, filters: &str) -> Result<Vec<NodeView>, ClientError> {
        let mut all: Vec<NodeView> = Vec::new();
        loop {
            let after = all.last().map_or(0, |n| n.id);
            let mut path = format!("/nodes?limit={}&after={after}", crate::http::api::MAX_PAGE);
            if !filters.is_empty() {
                path = format!("{path}&{filters}");
            }
            let page: Vec<NodeView> = self.call(reqwest::Method::GET, &path, None, &[]).await?;
            let full = page.len() == crate::http::api::MAX_PAGE as usize;
            all.extend(page);
            if !full {
                return Ok(all);
            }
        }
    }
}

/// Prints rows as an aligned table.
fn table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
}

fn or_dash<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".into(), ToString::to_string)
}

fn node_row(n: &NodeView) -> Vec<String> {
    vec![
        n.id.to_string(),
        or_dash(&n.name),
        or_dash(&n.hostname),
        n.state.to_string(),
        n.since.clone(),
        n.generation.to_string(),
        n.arch.to_string(),
        n.macs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
        or_dash(&n.site),
        crate::model::failure_text(n.failed_step, n.failed_reason.as_deref()).unwrap_or_default(),
    ]
}

fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

const NODE_HEADERS: &[&str] = &[
    "ID", "NAME", "HOSTNAME", "STATE", "SINCE", "GEN", "ARCH", "MACS", "SITE", "REASON",
];

/// `pxed report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The period: reinstalls requested this long ago or later (`7d`, `12h`, `30m`).
    #[arg(long, default_value = "7d")]
    since: String,
    #[command(flatten)]
    api: ApiArgs,
}

/// Runs `pxed report`.
pub fn run_report(a: ReportArgs) -> ExitCode {
    finish(rt().block_on(report(a)))
}

async fn report(a: ReportArgs) -> Result<(), ClientError> {
    let api = Api::new(&a.api)?;
    let path = format!("/report?since={}", a.since);
    let r: crate::wire::Report = api.call(reqwest::Method::GET, &path, None, &[]).await?;
    if a.api.json {
        print_json(&r);
        return Ok(());
    }
    println!("reinstalls requested {} .. {}", r.since, r.until);
    table(
        &[
            "REINSTALLS",
            "SUCCEEDED",
            "FAILED",
            "UNFINISHED",
            "P50",
            "P95",
        ],
        vec![vec![
            r.reinstalls.to_string(),
            r.succeeded.to_string(),
            r.failed.to_string(),
            r.unfinished.to_string(),
            r.p50_ms.map_or_else(|| "-".into(), fmt_ms),
            r.p95_ms.map_or_else(|| "-".into(), fmt_ms),
        ]],
    );
    if !r.failures.is_empty() {
        println!("\nfailures by stage");
        table(
            &["STAGE", "REASON", "COUNT", "EXAMPLES"],
            r.failures
                .iter()
                .map(|f| {
                    vec![
                        f.stage.clone(),
                        f.reason.clone(),
                        f.count.to_string(),
                        f.examples.join(" | "),
                    ]
                })
                .collect(),
        );
    }
    println!("\nleftovers (failed or stuck now): {}", r.leftovers.len());
    if !r.leftovers.is_empty() {
        table(
            &["ID", "NAME", "STATE", "STAGE", "SINCE", "STUCK", "REASON"],
            r.leftovers
                .iter()
                .map(|l| {
                    vec![
                        l.node_id.to_string(),
                        or_dash(&l.name),
                        l.state.to_string(),
                        or_dash(&l.stage),
                        l.since.clone(),
                        if l.stuck { "yes".into() } else { "-".into() },
                        or_dash(&l.reason),
                    ]
                })
                .collect(),
        );
    }
    Ok(())
}

/// `65_000` → `1m05s`; under a minute with tenths.
fn fmt_ms(ms: u64) -> String {
    if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{}m{:02}s", ms / 60_000, (ms / 1000) % 60)
    } else {
        format!("{}h{:02}m", ms / 3_600_000, (ms / 60_000) % 60)
    }
}

fn print_stages(v: &crate::wire::StagesView) {
    if v.stages.is_empty() {
        println!(
            "\nstages of generation {}: none seen on the wire",
            v.generation
        );
        return;
    }
    println!("\nstages of generation {}:", v.generation);
    if let Some(c) = &v.current {
        println!(
            "  now: {} since {} (expected {}){}",
            c.stage,
            c.since,
            c.expected_ms.map_or_else(|| "-".into(), fmt_ms),
            if c.stuck { " STUCK" } else { "" }
        );
    }
    table(
        &[
            "STAGE", "AT", "LASTED", "EXPECTED", "BYTES", "TOOK", "DETAIL",
        ],
        v.stages
            .iter()
            .map(|s| {
                let over = matches!((s.lasted_ms, s.expected_ms), (Some(l), Some(e)) if l > e);
                vec![
                    s.stage.to_string(),
                    s.at.clone(),
                    s.lasted_ms.map_or_else(|| "-".into(), fmt_ms)
                        + if over { " (over)" } else { "" },
                    s.expected_ms.map_or_else(|| "-".into(), fmt_ms),
                    or_dash(&s.bytes),
                    s.took_ms.map_or_else(|| "-".into(), fmt_ms),
                    or_dash(&s.detail),
                ]
            })
            .collect(),
    );
    for g in &v.previous {
        let parts: Vec<String> = g
            .durations
            .iter()
            .map(|d| format!("{} {}", d.stage, fmt_ms(d.ms)))
            .collect();
        println!(
            "  generation {}: {} total, ended {}: {}",
            g.generation,
            g.total_ms.map_or_else(|| "-".into(), fmt_ms),
            or_dash(&g.last),
            parts.join(", ")
        );
    }
}

/// Runs `pxed node ...`.
pub fn run_node(cmd: NodeCmd) -> ExitCode {
    match cmd {
        NodeCmd::Wait(a) => run_wait(a),
        cmd => finish(rt().block_on(node(cmd))),
    }
}

/// OpenSSH public keys from a file (or stdin for `-`): one per line, blank lines and
/// `#` comments skipped. The server checks each.
fn read_key_file(path: &Path) -> Result<Vec<String>, ClientError> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| ClientError::Other(format!("reading {}: {e}", path.display())))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect())
}

async fn node(cmd: NodeCmd) -> Result<(), ClientError> {
    use reqwest::Method;
    match cmd {
        NodeCmd::Labels(l) => l.run().await?,
        NodeCmd::Inventory {
            node,
            generation,
            api,
        } => hw::node_inventory(&node, generation, &api).await?,
        NodeCmd::AcceptInventory {
            node,
            generation,
            profile,
            no_profile,
            api,
        } => hw::accept(&node, generation, profile, no_profile, &api).await?,
        NodeCmd::Query(q) => hw::query(q).await?,
        NodeCmd::SshKeys {
            node,
            set,
            clear,
            api: a,
        } => {
            let api = Api::new(&a)?;
            let keys: crate::wire::SshKeys = if set.is_some() || clear {
                let body = crate::wire::SshKeys {
                    ssh_authorized_keys: match &set {
                        Some(f) => read_key_file(f)?,
                        None => vec![],
                    },
                };
                let body =
                    serde_json::to_value(&body).map_err(|e| ClientError::Other(e.to_string()))?;
                api.call(
                    Method::PUT,
                    &format!("/nodes/{node}/ssh-keys"),
                    Some(body),
                    &[],
                )
                .await?
            } else {
                let v: NodeDetail = api
                    .call(Method::GET, &format!("/nodes/{node}"), None, &[])
                    .await?;
                crate::wire::SshKeys {
                    ssh_authorized_keys: v.ssh_authorized_keys,
                }
            };
            if a.json {
                print_json(&keys);
            } else {
                for k in &keys.ssh_authorized_keys {
                    println!("{k}");
                }
            }
        }
        NodeCmd::List(l) => {
            let a = &l.api;
            let api = Api::new(a)?;
            let v = api.all_nodes(&l.query_string()).await?;
            if a.json {
                print_json(&v);
            } else {
                table(NODE_HEADERS, v.iter().map(node_row).collect());
            }
        }
        NodeCmd::Show {
            node,
            log: true,
            generation,
            api: a,
        } => {
            let api = Api::new(&a)?;
            let path = match generation {
                Some(g) => format!("/nodes/{node}/log?generation={g}"),
                None => format!("/nodes/{node}/log"),
            };
            let v: crate::wire::InstallLog = api.call(Method::GET, &path, None, &[]).await?;
            if a.json {
                print_json(&v);
            } else {
                println!(
                    "node {} generation {}: {} lines from its installer",
                    v.node_id,
                    v.generation,
                    v.lines.len()
                );
                for l in &v.lines {
                    println!("{} {:7} {}", l.at, l.source, l.line);
                }
            }
        }
        NodeCmd::Show { node, api: a, .. } => {
            let api = Api::new(&a)?;
            let v: NodeDetail = api
                .call(Method::GET, &format!("/nodes/{node}"), None, &[])
                .await?;
            if a.json {
                print_json(&v);
            } else {
                table(NODE_HEADERS, vec![node_row(&v.node)]);
                println!("\nImage: {}", v.node.image.as_deref().unwrap_or("none yet"));
                if let Some(b) = &v.bmc {
                    println!(
                        "\nBMC: {} {} user {} (tls pin {})",
                        b.driver,
                        b.address,
                        b.username,
                        or_dash(&b.tls_pin)
                    );
                }
                if !v.ssh_authorized_keys.is_empty() {
                    println!(
                        "\nSSH keys of its own: {} (pxed node ssh-keys {node})",
                        v.ssh_authorized_keys.len()
                    );
                }
                let inv: crate::http::hardware::NodeInventory = api
                    .call(Method::GET, &format!("/nodes/{node}/inventory"), None, &[])
                    .await?;
                hw::print_hardware(&inv, false);
                let stages: crate::wire::StagesView = api
                    .call(Method::GET, &format!("/nodes/{node}/stages"), None, &[])
                    .await?;
                print_stages(&stages);
                println!();
                table(
                    &["AT", "GEN", "FROM", "EVENT", "TO", "ACTOR", "DETAIL"],
                    v.events
                        .iter()
                        .map(|e| {
                            vec![
                                e.at.clone(),
                                e.generation.to_string(),
                                or_dash(&e.from_state),
                                e.event.clone(),
                                e.to_state.to_string(),
                                e.actor.clone(),
                                or_dash(&e.detail),
                            ]
                        })
                        .collect(),
                );
            }
        }
        NodeCmd::Add {
            macs,
            name,
            arch,
            labels,
            bmc_driver,
            bmc_address,
            bmc_user,
            bmc_password_env,
            bmc_system_id,
            bmc_tls_insecure,
            ssh_keys,
            api: a,
        } => {
            let api = Api::new(&a)?;
            let mut body = CreateNode {
                macs,
                name,
                arch,
                ssh_authorized_keys: match &ssh_keys {
                    Some(f) => read_key_file(f)?,
                    None => vec![],
                },
                labels: labels.into_iter().collect(),
                ..Default::default()
            };
            if let (Some(d), Some(addr)) = (bmc_driver, bmc_address) {
                let password = std::env::var(&bmc_password_env).map_err(|_| {
                    ClientError::Other(format!("set the BMC password in ${bmc_password_env}"))
                })?;
                body.bmc = Some(CreateBmc {
                    driver: d,
                    address: addr,
                    username: bmc_user.unwrap_or_default(),
                    password,
                    system_id: bmc_system_id,
                    tls_insecure: bmc_tls_insecure,
                });
            }
            let body =
                serde_json::to_value(&body).map_err(|e| ClientError::Other(e.to_string()))?;
            let v: NodeView = api.call(Method::POST, "/nodes", Some(body), &[]).await?;
            if a.json {
                print_json(&v);
            } else {
                table(NODE_HEADERS, vec![node_row(&v)]);
            }
        }
        NodeCmd::Rm { node, api: a } => {
            let api = Api::new(&a)?;
            api.call::<serde::de::IgnoredAny>(Method::DELETE, &format!("/nodes/{node}"), None, &[])
                .await?;
            if !a.json {
                println!("deleted {node}");
            }
        }
        NodeCmd::Reinstall {
            node,
            image,
            idempotency_key,
            api: a,
        } => {
            let api = Api::new(&a)?;
            let headers: Vec<(&str, String)> = idempotency_key
                .map(|k| vec![("Idempotency-Key", k)])
                .unwrap_or_default();
            let v: Operation = api
                .call(
                    Method::POST,
                    &format!("/nodes/{node}/reinstall"),
                    Some(serde_json::json!(ReinstallRequest { image })),
                    &headers,
                )
                .await?;
            if a.json {
                print_json(&v);
            } else if v.already_in_progress {
                println!(
                    "node {} is already reinstalling: generation {}, {} since {}",
                    v.node_id, v.generation, v.state, v.since
                );
            } else {
                println!(
                    "node {}: reinstall started, generation {}, state {}",
                    v.node_id, v.generation, v.state
                );
            }
        }
        NodeCmd::Wait(_) => unreachable!("run_node runs wait"),
        NodeCmd::Enroll(a) => node_action("enroll", &a.node, None, &a.api).await?,
        NodeCmd::Allocate(a) => node_action("allocate", &a.node, None, &a.api).await?,
        NodeCmd::Release(a) => node_action("release", &a.node, None, &a.api).await?,
        NodeCmd::Restore(a) => node_action("restore", &a.node, None, &a.api).await?,
        NodeCmd::Quarantine(a) => {
            node_action("quarantine", &a.node, Some(&a.reason), &a.api).await?
        }
        NodeCmd::Fail(a) => node_action("fail", &a.node, Some(&a.reason), &a.api).await?,
    }
    Ok(())
}

/// `POST /api/v1/nodes/{node}/actions/{action}` (with the reason, if any); prints the
/// node as it is after it.
async fn node_action(
    action: &str,
    node: &str,
    reason: Option<&str>,
    a: &ApiArgs,
) -> Result<(), ClientError> {
    let body = reason.map(|r| serde_json::json!({ "reason": r }));
    post_and_show(a, &format!("/nodes/{node}/actions/{action}"), body).await?;
    Ok(())
}

/// POSTs to an API path that answers with the node, and prints the node (a table, or
/// JSON with `--json`).
async fn post_and_show(
    a: &ApiArgs,
    path: &str,
    body: Option<Value>,
) -> Result<NodeView, ClientError> {
    let api = Api::new(a)?;
    let v: NodeView = api.call(reqwest::Method::POST, path, body, &[]).await?;
    if a.json {
        print_json(&v);
    } else {
        table(NODE_HEADERS, vec![node_row(&v)]);
    }
    Ok(v)
}

/// Runs `pxed image ...`.
pub fn run_image(cmd: ImageCmd) -> ExitCode {
    finish(rt().block_on(image(cmd)))
}

async fn image(cmd: ImageCmd) -> Result<(), ClientError> {
    let server = match &cmd {
        ImageCmd::Add { server, .. }
        | ImageCmd::Check { server, .. }
        | ImageCmd::List { server }
        | ImageCmd::Rm { server, .. } => server,
    };
    let cfg = server
        .load()
        .map_err(|e| ClientError::Other(e.to_string()))?;
    let mirror_base = || {
        cfg.mirror_base.clone().ok_or_else(|| {
            ClientError::Other("set mirror_base in the config (the local OS mirror)".into())
        })
    };
    if let ImageCmd::Check { image, arch, .. } = &cmd {
        let def = find_image(&cfg.images_catalog, image)?;
        crate::net::install_crypto_provider();
        let checked = crate::images::check_mirror(&def, *arch, &mirror_base()?)
            .await
            .map_err(|e| ClientError::Other(e.to_string()))?;
        for c in &checked {
            println!("{} {c}", c.arch);
        }
        let missing = checked.iter().filter(|c| !c.present).count();
        if missing > 0 {
            return Err(ClientError::Other(format!(
                "the mirror lacks {missing} item(s) that {} needs",
                def.name
            )));
        }
        return Ok(());
    }
    let store = crate::store::Store::open_configured(&cfg.data_dir, cfg.database_url.as_deref())
        .await
        .map_err(|e| ClientError::Other(e.to_string()))?;
    match cmd {
        ImageCmd::Add {
            image,
            arch,
            no_check,
            ..
        } => {
            let mut def = find_image(&cfg.images_catalog, &image)?;
            if let Some(arch) = arch {
                if !def.arches.contains_key(&arch) {
                    let has: Vec<&str> = def.arches.keys().map(|a| a.as_str()).collect();
                    return Err(ClientError::Other(format!(
                        "image {} has no {arch} (it has {})",
                        def.name,
                        has.join(", ")
                    )));
                }
                def.arches.retain(|a, _| *a == arch);
            }
            let mirror = mirror_base()?;
            crate::net::install_crypto_provider();
            if !no_check {
                let checked = crate::images::check_mirror(&def, None, &mirror)
                    .await
                    .map_err(|e| ClientError::Other(e.to_string()))?;
                let missing: Vec<String> = checked
                    .iter()
                    .filter(|c| !c.present)
                    .map(|c| format!("  {} {c}", c.arch))
                    .collect();
                if !missing.is_empty() {
                    return Err(ClientError::Other(format!(
                        "not importing {}: the mirror lacks what its installer needs \
                         (--no-check to import anyway):\n{}",
                        def.name,
                        missing.join("\n")
                    )));
                }
            }
            let imported = crate::images::import(&def, &mirror, &cfg.images_dir)
                .await
                .map_err(|e| ClientError::Other(e.to_string()))?;
            let family = def.family.as_str();
            let stored = crate::images::StoredImage {
                def,
                imported,
                mirror_checked: (!no_check).then_some(mirror),
            };
            let json =
                serde_json::to_string(&stored).map_err(|e| ClientError::Other(e.to_string()))?;
            store
                .put_image(&stored.def.name, family, &json)
                .await
                .map_err(|e| ClientError::Other(e.to_string()))?;
            for (arch, a) in &stored.imported.arches {
                println!(
                    "{} {arch}: kernel {} bytes sha256 {}, initrd {} bytes sha256 {}",
                    stored.def.name, a.kernel.size, a.kernel.sha256, a.initrd.size, a.initrd.sha256
                );
                if let Some(d) = &a.disk {
                    println!(
                        "{} {arch}: disk image {} bytes ({} raw) sha256 {}, raw sha256 {}",
                        stored.def.name, d.file.size, d.raw_size, d.file.sha256, d.raw_sha256
                    );
                }
            }
        }
        ImageCmd::Check { .. } => unreachable!("handled before the store is opened"),
        ImageCmd::List { .. } => {
            let rows = store
                .images()
                .await
                .map_err(|e| ClientError::Other(e.to_string()))?;
            table(
                &["NAME", "FAMILY", "IMPORTED"],
                rows.into_iter()
                    .map(|r| vec![r.name, r.family, r.imported_at])
                    .collect(),
            );
        }
        ImageCmd::Rm { image, .. } => {
            let removed = store
                .delete_image(&image)
                .await
                .map_err(|e| ClientError::Other(e.to_string()))?;
            if !removed {
                return Err(ClientError::Other(format!("image {image} is not imported")));
            }
            let dir = cfg.images_dir.join(&image);
            if dir.starts_with(&cfg.images_dir) && !image.contains("..") && !image.contains('/') {
                let _ = std::fs::remove_dir_all(&dir);
            }
            println!("removed {image}");
        }
    }
    store.close().await;
    Ok(())
}

/// A catalog entry by name, or a definition file by path.
fn find_image(
    catalog: &std::path::Path,
    image: &str,
) -> Result<crate::images::ImageDef, ClientError> {
    let p = std::path::Path::new(image);
    if p.extension().is_some_and(|e| e == "toml") && p.exists() {
        let text = std::fs::read_to_string(p).map_err(|source| ClientError::Read {
            path: p.to_owned(),
            source,
        })?;
        return crate::images::parse_image(&text, p).map_err(|e| ClientError::Other(e.to_string()));
    }
    let all = crate::images::load_catalog(catalog).map_err(|e| {
        ClientError::Other(format!(
            "the image catalog (images_catalog in the config, or PXED_IMAGES_CATALOG): {e}"
        ))
    })?;
    let names: Vec<String> = all.iter().map(|d| d.name.clone()).collect();
    all.into_iter().find(|d| d.name == image).ok_or_else(|| {
        ClientError::Other(format!(
            "no image {image} in {} (have: {})",
            catalog.display(),
            names.join(", ")
        ))
    })
}

/// Runs `pxed bmc ...`.
pub fn run_bmc(cmd: BmcCmd) -> ExitCode {
    finish(rt().block_on(bmc(cmd)))
}

async fn bmc(cmd: BmcCmd) -> Result<(), ClientError> {
    let (node, direct, a) = match cmd {
        BmcCmd::Check { node, direct, api } => (node, direct, api),
        BmcCmd::PowerCycle { node, api: a } => {
            let v = post_and_show(&a, &format!("/nodes/{node}/bmc/power-cycle"), None).await?;
            if !a.json {
                println!("node {}: power-cycled through its BMC", v.id);
            }
            return Ok(());
        }
    };
    let report = match node {
        Some(node) => {
            let api = Api::new(&a)?;
            let v: BmcCheck = api
                .call(
                    reqwest::Method::POST,
                    &format!("/nodes/{node}/bmc/check"),
                    None,
                    &[],
                )
                .await?;
            if a.json {
                print_json(&v);
            } else {
                let b = &v.bmc;
                println!(
                    "node {}: BMC {} at {} as {}",
                    v.node_id, b.driver, b.address, b.username
                );
                println!("{}", v.report);
            }
            v.report
        }
        None => {
            let report = check_direct(direct).await?;
            if a.json {
                print_json(&report);
            } else {
                println!("{report}");
            }
            report
        }
    };
    match report.credentials {
        crate::bmc::Credentials::Refused { message } => Err(ClientError::Other(format!(
            "the BMC refused the credentials: {message}"
        ))),
        crate::bmc::Credentials::Accepted { .. } => Ok(()),
    }
}

/// Checks an unregistered BMC from this host.
async fn check_direct(d: DirectBmc) -> Result<crate::bmc::CheckReport, ClientError> {
    use crate::bmc::{BmcEndpoint, CallPolicy, Driver, Secret, TlsPolicy};
    let (Some(driver), Some(address)) = (d.driver, d.address) else {
        return Err(ClientError::Other(
            "name a node, or give --driver and --address".into(),
        ));
    };
    let ep = BmcEndpoint {
        driver: driver
            .parse::<Driver>()
            .map_err(|e| ClientError::Other(format!("--driver: {e}")))?,
        address,
        username: d.username.unwrap_or_default(),
        password: Secret::new(std::env::var(&d.password_env).unwrap_or_default()),
        system_id: d.system_id,
        match_mac: None,
        match_uuid: None,
        tls: if d.tls_insecure {
            TlsPolicy::Insecure
        } else {
            TlsPolicy::Pinned(None)
        },
        policy: CallPolicy::default(),
    };
    crate::net::install_crypto_provider();
    crate::bmc::check(&ep)
        .await
        .map_err(|e| ClientError::Other(format!("check failed: {e}")))
}

/// `--label KEY=VALUE`.
fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=VALUE"))?;
    crate::store::board::check_label(k, v)?;
    Ok((k.to_string(), v.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::State;

    fn view(state: State, generation: i64, reason: Option<&str>) -> NodeView {
        NodeView {
            id: 1,
            name: None,
            hostname: None,
            arch: NodeArch::UNKNOWN,
            state,
            since: String::new(),
            generation,
            attempt: 0,
            image: None,
            failed_step: reason.map(|_| crate::model::Step::Stage(State::Netbooting)),
            failed_reason: reason.map(str::to_string),
            macs: Vec::new(),
            facts: None,
            site: None,
        }
    }

    /// States older than the generation waited for never end the wait: the
    /// `available` (or `failed`) from before a reinstall is not its result.
    #[test]
    fn wait_follows_the_generation() {
        use WaitVerdict::*;
        let stopped = |state| Stopped {
            state,
            reason: "netbooting: deadline".into(),
        };
        let rows = [
            (
                view(State::Available, 3, None),
                State::Available,
                3,
                Reached,
            ),
            (
                view(State::Available, 4, None),
                State::Available,
                3,
                Reached,
            ),
            (
                view(State::Available, 2, None),
                State::Available,
                3,
                Waiting,
            ),
            (
                view(State::Failed, 2, Some("old")),
                State::Available,
                3,
                Waiting,
            ),
            (
                view(State::Installing, 3, None),
                State::Available,
                3,
                Waiting,
            ),
            (
                view(State::Failed, 3, Some("deadline")),
                State::Available,
                3,
                stopped(State::Failed),
            ),
            (
                view(State::Quarantined, 3, Some("deadline")),
                State::Available,
                3,
                stopped(State::Quarantined),
            ),
            (view(State::Failed, 3, Some("x")), State::Failed, 3, Reached),
        ];
        for (n, want, g, expect) in rows {
            assert_eq!(
                wait_verdict(&n, want, g),
                expect,
                "{n:?} want {want} gen {g}"
            );
        }
    }
}
