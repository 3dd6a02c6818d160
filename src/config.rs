//! Configuration: defaults < TOML file < `PXED_*` environment < command-line flags.
//!
//! All layers are merged as TOML values first and deserialized once into the wire
//! structs (`deny_unknown_fields`), so a misspelled key is an error whichever layer it
//! came from. The wire form is then validated into [`Config`].

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::State;

/// Everything that can go wrong while reading or validating configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config: {0}")]
    Parse(String),
    #[error("unknown environment variable {var} (no config key `{key}`)")]
    UnknownEnv { var: String, key: String },
    #[error("invalid value for {key}: {reason}")]
    Invalid { key: String, reason: String },
    #[error("{key}: must be between {min} and {max} (got {got})")]
    OutOfRange {
        key: String,
        min: String,
        max: String,
        got: String,
    },
    /// A pxed bug, caught by the unit tests: validation asked for a key that
    /// [`BOUNDS`] does not list (or lists with the other kind of range).
    #[error("{key}: no range declared for this key")]
    NoRange { key: String },
    #[error("cannot read API token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How DHCP is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DhcpMode {
    /// A full server: addresses from the pool and reservations, plus boot options.
    Full,
    /// proxyDHCP beside an existing DHCP server: boot options only, no addresses.
    Proxy,
    /// No DHCP at all (HTTP and TFTP only).
    Off,
}

impl DhcpMode {
    /// The name the config file and `--dhcp` use.
    pub fn as_str(self) -> &'static str {
        match self {
            DhcpMode::Full => "full",
            DhcpMode::Proxy => "proxy",
            DhcpMode::Off => "off",
        }
    }
}

/// The wire form of the config file. Every field is optional so layers can be merged.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Wire {
    pub interfaces: Option<Vec<String>>,
    pub server_ip: Option<Ipv4Addr>,
    pub data_dir: Option<PathBuf>,
    /// PostgreSQL instead of the SQLite file in `data_dir`: `postgres://USER:PASSWORD@HOST[:PORT]/DATABASE`
    /// (`?host=/run/postgresql` for a Unix socket).
    pub database_url: Option<String>,
    /// The site this instance serves (a provisioning VLAN or room; letters, digits,
    /// `-`, `_`, `.`, at most 64). Instances of several sites may share one
    /// PostgreSQL database: the API and the status page show each node with the site
    /// whose instance last saw it netboot. Unset: nodes are shown with no site.
    pub site: Option<String>,
    pub ipxe_dir: Option<PathBuf>,
    pub images_dir: Option<PathBuf>,
    pub images_catalog: Option<PathBuf>,
    #[serde(default, deserialize_with = "listen_addr")]
    pub http: Option<SocketAddr>,
    #[serde(default, deserialize_with = "listen_addr")]
    pub tftp: Option<SocketAddr>,
    /// Build the URLs in scripts and configs from the request's `Host` header instead
    /// of `server_ip` (only behind a reverse proxy that sets it: any client can send one).
    pub trust_host_header: Option<bool>,
    /// Base URL of the local OS mirror; image paths are relative to it.
    pub mirror_base: Option<String>,
    pub default_image: Option<String>,
    pub hostname_prefix: Option<String>,
    /// Serve the status page (`/`, `/status.json`, `/nodes/…`, `/events`) without
    /// the API token. Off by default: it lists every node's MACs and state.
    pub status_public: Option<bool>,
    /// OpenSSH public keys for root on every installed or deployed system (images may
    /// add their own).
    pub ssh_authorized_keys: Option<Vec<String>>,
    /// The site's NTP servers for installed systems (host names or addresses, at most
    /// 8). Unset: installs use no NTP (every public pool is unreachable from an
    /// isolated provisioning network).
    pub ntp_servers: Option<Vec<String>>,
    pub api_token: Option<String>,
    pub api_token_file: Option<PathBuf>,
    pub dhcp: Option<DhcpWire>,
    pub boot: Option<BootWire>,
    pub tftp_server: Option<TftpWire>,
    pub lifecycle: Option<LifecycleWire>,
    pub bmc: Option<BmcWire>,
    pub discovery: Option<DiscoveryWire>,
    pub syslog: Option<SyslogWire>,
    pub webhooks: Option<WebhooksWire>,
    pub stages: Option<StagesWire>,
    pub pacing: Option<PacingWire>,
    /// `[[profiles]]`: hardware classes every reinstall is checked against
    /// (`crate::inventory::profile`). Config file only.
    pub profiles: Option<Vec<crate::inventory::profile::Profile>>,
}

/// One address per MAC and one MAC per address (the store holds both as unique keys),
/// and, when pxed hands out addresses, each inside a subnet it serves (else the client
/// would be offered an address its network cannot route).
fn check_reservations<'a>(
    reservations: &[Reservation],
    full: bool,
    subnets: impl Iterator<Item = &'a Subnet> + Clone,
) -> Result<(), ConfigError> {
    let mut macs = BTreeMap::new();
    let mut ips = BTreeMap::new();
    for r in reservations {
        if let Some(ip) = macs.insert(&r.mac, r.ip) {
            return Err(invalid(
                "dhcp.reservations",
                format!("{} is reserved twice ({ip} and {})", r.mac, r.ip),
            ));
        }
        if let Some(mac) = ips.insert(r.ip, &r.mac) {
            return Err(invalid(
                "dhcp.reservations",
                format!("{} is reserved for two MACs ({mac} and {})", r.ip, r.mac),
            ));
        }
        if full && !subnets.clone().any(|s| s.contains(r.ip)) {
            return Err(invalid(
                "dhcp.reservations",
                format!(
                    "{} (for {}) is in no subnet pxed serves (dhcp.pool with dhcp.netmask, \
                     or dhcp.relay_subnets)",
                    r.ip, r.mac
                ),
            ));
        }
    }
    Ok(())
}

/// A mistake in the config file as one line, `FILE: line L, column C: what` (the
/// SIGHUP reload logs it, and a log line must not span several).
fn file_error(path: &Path, text: &str, e: &toml::de::Error) -> ConfigError {
    let at = match e.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
            format!(" line {line}, column {column}:")
        }
        None => String::new(),
    };
    let what = e.message().trim().replace('\n', " ");
    ConfigError::Parse(format!("{}:{at} {what}", path.display()))
}

/// `http` / `tftp`: an address and port to listen on. The error for anything else
/// shows the form, since `[http]` with `port = 80` is the usual first guess.
fn listen_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    struct Visitor;
    const EG: &str = "such as \"0.0.0.0:80\"";
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Option<SocketAddr>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(
                f,
                "an address and port to listen on, {EG} (a key at the top of the file, not a table)"
            )
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            v.parse()
                .map(Some)
                .map_err(|_| E::custom(format!("`{v}` is not an address and port, {EG}")))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Err(E::custom(format!(
                "`{v}` is a port alone; write the address too, such as \"0.0.0.0:{v}\""
            )))
        }
    }
    d.deserialize_any(Visitor)
}

/// `[webhooks]`: outgoing webhooks on node state changes (issue 12).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhooksWire {
    /// Events kept on disk for URLs that are behind; past it the oldest are dropped.
    pub queue_cap: Option<i64>,
    /// First retry delay; doubles per failed attempt up to `max_backoff`.
    pub backoff: Option<String>,
    pub max_backoff: Option<String>,
    /// Bound on one delivery (connect, send, answer).
    pub timeout: Option<String>,
    /// `[[webhooks.targets]]`: config file only.
    pub targets: Option<Vec<WebhookTargetWire>>,
}

/// `[[webhooks.targets]]`: one URL that gets every state change (or those it filters).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookTargetWire {
    pub url: String,
    /// HMAC-SHA256 key for `X-Pxed-Signature` (or `secret_file`).
    pub secret: Option<String>,
    pub secret_file: Option<PathBuf>,
    /// Only changes into these states (default: every change).
    pub states: Option<Vec<String>>,
}

/// `[stages]`: how long each stage of a reinstall may last before its node is called
/// stuck (`expected = { power = "5m", installer_packages = "1h" }`; `installer` and
/// `deploy` set every installer or deploy-agent milestone at once), and how many
/// generations of stages a node keeps.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StagesWire {
    pub expected: Option<BTreeMap<String, String>>,
    pub keep_generations: Option<i64>,
}

/// `[syslog]`: pxed's receiver for installer logs (issue 11).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyslogWire {
    pub enabled: Option<bool>,
    pub address: Option<SocketAddr>,
    pub lines_per_node: Option<i64>,
    pub max_connections: Option<i64>,
    pub idle_timeout: Option<String>,
    pub max_line: Option<i64>,
}

/// `[discovery]`: how many unknown netboot clients DHCP may register.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryWire {
    pub max_pending: Option<i64>,
    pub per_minute: Option<i64>,
}

/// `[dhcp]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DhcpWire {
    pub mode: Option<DhcpMode>,
    pub pool: Option<String>,
    pub netmask: Option<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
    pub dns: Option<Vec<Ipv4Addr>>,
    pub domain: Option<String>,
    pub lease_time: Option<String>,
    /// Extra subnets served through relays (matched by giaddr).
    pub relay_subnets: Option<Vec<SubnetWire>>,
    /// Static MAC → IP reservations (stored in SQLite on start).
    pub reservations: Option<Vec<Reservation>>,
}

/// A subnet reached through a DHCP relay.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubnetWire {
    pub pool: String,
    pub netmask: Ipv4Addr,
    pub router: Option<Ipv4Addr>,
    pub dns: Option<Vec<Ipv4Addr>>,
}

/// A static address for one MAC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reservation {
    pub mac: String,
    pub ip: Ipv4Addr,
    pub hostname: Option<String>,
}

/// `[boot]`: per-architecture boot file names (relative to the iPXE dir).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootWire {
    pub bios: Option<String>,
    pub uefi_x64: Option<String>,
    pub uefi_arm64: Option<String>,
    pub http_x64: Option<String>,
    pub http_arm64: Option<String>,
    /// Per-MAC overrides of the boot file (e.g. an operator-built arm64 snponly.efi).
    pub per_mac: Option<BTreeMap<String, String>>,
}

/// `[tftp_server]`. Counts here and in the other sections are `i64`, TOML's integer,
/// so a negative or huge value gets the range error of [`BOUNDS`], not a type error.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TftpWire {
    pub max_transfers: Option<i64>,
    pub timeout: Option<String>,
    pub retries: Option<i64>,
}

/// `[lifecycle]`: deadline per state, retries.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleWire {
    pub deadlines: Option<BTreeMap<String, String>>,
    pub max_attempts: Option<i64>,
    pub backoff: Option<String>,
    pub netboot_observe: Option<String>,
    pub leftovers_interval: Option<String>,
    pub owner_ttl: Option<String>,
}

/// `[bmc]`: bounds on the BMC calls the lifecycle makes while reclaiming a node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BmcWire {
    pub request_timeout: Option<String>,
    pub retries: Option<i64>,
    pub power_deadline: Option<String>,
    pub restart_observe: Option<String>,
    pub poll_interval: Option<String>,
}

/// `[pacing]`: how fast pxed lets a fleet boot. DHCP offers to new netboot clients wait
/// while transfer slots are full (see [`crate::pacing`]); reinstalls power machines on
/// in waves (see [`crate::lifecycle::pacing`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PacingWire {
    pub max_first_stage: Option<i64>,
    pub max_streams: Option<i64>,
    pub offer_delay_max_ms: Option<i64>,
    /// Power-ons (the power cycle of a reinstall) per wave; 0: no waves.
    pub power_on_wave_size: Option<i64>,
    /// Seconds from the start of one wave to the start of the next.
    pub power_on_wave_interval_secs: Option<i64>,
    /// A label key (`rack`): each of its values has its own waves; nodes without the
    /// label share one.
    pub power_on_wave_by_label: Option<String>,
    /// Nodes a reinstall has powered on that have not fetched their installer yet,
    /// before further power-ons wait; 0: no limit.
    pub max_booting: Option<i64>,
    /// How much lower the file-transfer threads run than the rest of pxed (nice steps).
    pub transfer_nice: Option<i64>,
}

/// A pool: an inclusive address range inside a subnet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Pool {
    pub start: Ipv4Addr,
    pub end: Ipv4Addr,
}

impl Pool {
    /// Parses `START-END`.
    pub fn parse(s: &str) -> Result<Pool, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("`{s}` is not START-END"))?;
        let start: Ipv4Addr = a.trim().parse().map_err(|e| format!("`{a}`: {e}"))?;
        let end: Ipv4Addr = b.trim().parse().map_err(|e| format!("`{b}`: {e}"))?;
        if u32::from(start) > u32::from(end) {
            return Err(format!("pool start {start} is after end {end}"));
        }
        Ok(Pool { start, end })
    }

    /// Whether `ip` is inside the range.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        (u32::from(self.start)..=u32::from(self.end)).contains(&u32::from(ip))
    }

    /// Number of addresses.
    pub fn len(&self) -> u32 {
        u32::from(self.end) - u32::from(self.start) + 1
    }

    /// Never true: a pool has at least one address.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// A validated subnet with its pool and options.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Subnet {
    pub pool: Pool,
    pub netmask: Ipv4Addr,
    pub router: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
}

impl Subnet {
    /// The network address of the subnet.
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.pool.start) & u32::from(self.netmask))
    }

    /// Whether `ip` is inside the subnet (not only the pool).
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & u32::from(self.netmask) == u32::from(self.network())
    }
}

/// Validated DHCP settings.
#[derive(Debug, Clone, Serialize)]
pub struct DhcpConfig {
    pub mode: DhcpMode,
    /// The subnet of the served interfaces (full mode).
    pub local: Option<Subnet>,
    pub relay_subnets: Vec<Subnet>,
    pub domain: Option<String>,
    #[serde(with = "secs")]
    pub lease_time: Duration,
    pub reservations: Vec<Reservation>,
}

impl DhcpConfig {
    /// Settings that the mode makes pxed ignore, in words for a startup warning: a
    /// pool under `proxy` or `off` is never served, which an operator who set one
    /// would not guess from a daemon that starts cleanly.
    pub fn ignored(&self) -> Vec<String> {
        let why = match self.mode {
            DhcpMode::Full => return Vec::new(),
            DhcpMode::Proxy => "proxy mode hands out no addresses (the site's DHCP server does)",
            DhcpMode::Off => "DHCP is off",
        };
        let mut set = Vec::new();
        if let Some(s) = &self.local {
            set.push(format!("dhcp.pool ({}-{})", s.pool.start, s.pool.end));
        }
        if !self.relay_subnets.is_empty() {
            set.push(format!("dhcp.relay_subnets ({})", self.relay_subnets.len()));
        }
        if !self.reservations.is_empty() {
            set.push(format!("dhcp.reservations ({})", self.reservations.len()));
        }
        set.into_iter()
            .map(|k| {
                format!(
                    "{k} is not used: {why}; set dhcp.mode = \"full\" (--dhcp full) to serve it"
                )
            })
            .collect()
    }
}

/// Validated boot file names.
#[derive(Debug, Clone, Serialize)]
pub struct BootConfig {
    pub bios: String,
    pub uefi_x64: String,
    pub uefi_arm64: String,
    pub http_x64: String,
    pub http_arm64: String,
    pub per_mac: BTreeMap<crate::model::Mac, String>,
}

/// Validated TFTP server settings.
#[derive(Debug, Clone, Serialize)]
pub struct TftpSettings {
    pub max_transfers: usize,
    #[serde(with = "secs")]
    pub timeout: Duration,
    pub retries: u32,
}

impl Pacing {
    /// The longest an offer is held.
    pub fn offer_delay_max(&self) -> Duration {
        Duration::from_millis(self.offer_delay_max_ms.into())
    }

    /// `max_booting` as the lifecycle uses it: at most half of the HTTP connections
    /// pxed holds (each booting node is about one; the rest serve installers, agents
    /// and the API). 0 stays 0: no limit.
    pub fn max_booting_within(&self, http: crate::net::ConnLimits) -> u32 {
        match self.max_booting {
            0 => 0,
            n => n
                .min(u32::try_from(http.max / 2).unwrap_or(u32::MAX))
                .max(1),
        }
    }
}

/// Validated discovery bounds: anyone on the VLAN can send PXE DISCOVERs with made-up
/// MACs, so registering them is capped and rate-limited; beyond either bound unknown
/// clients are counted, not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DiscoverySettings {
    /// Most `discovered` (not yet enrolled) nodes kept; 0 turns discovery off.
    pub max_pending: u32,
    /// Most registrations per minute.
    pub per_minute: u32,
}

impl Default for DiscoverySettings {
    fn default() -> Self {
        DiscoverySettings {
            max_pending: 1024,
            per_minute: 600,
        }
    }
}

/// Validated `[syslog]` settings: where installers send their logs (UDP and TCP on one
/// address) and how much of them pxed keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SyslogSettings {
    /// Run the receiver (and point the installers at it).
    pub enabled: bool,
    /// UDP and TCP address; default `server_ip:514`, or `0.0.0.0:514` without one.
    pub address: SocketAddr,
    /// Lines kept per node generation.
    pub lines_per_node: u32,
    /// TCP connections open at once.
    pub max_connections: u32,
    /// A TCP sender silent for this long is disconnected.
    #[serde(with = "secs")]
    pub idle_timeout: Duration,
    /// Longest message, in bytes.
    pub max_line: u32,
}

/// Validated lifecycle settings.
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleConfig {
    /// Deadline per state name; states absent here have no deadline.
    #[serde(with = "secs_map")]
    pub deadlines: BTreeMap<State, Duration>,
    pub max_attempts: u32,
    #[serde(with = "secs")]
    pub backoff: Duration,
    /// How long after a power action a DHCP packet from a boot MAC must arrive before
    /// the next netboot method is tried (`netboot_not_observed`).
    #[serde(with = "secs")]
    pub netboot_observe: Duration,
    /// How often the leftovers check runs (`GET /api/v1/leftovers`).
    #[serde(with = "secs")]
    pub leftovers_interval: Duration,
    /// With several pxed on one PostgreSQL database: how long an instance's claim on
    /// a node it is reinstalling lasts without renewal (renewed every third of it), so
    /// how soon another instance takes over the node when its holder dies.
    #[serde(with = "secs")]
    pub owner_ttl: Duration,
}

/// Validated BMC call bounds (see [`crate::bmc::CallPolicy`]). A reclaim step that
/// cannot finish inside these fails with the driver's reason; keep their sum below the
/// `reclaiming` deadline or a stuck BMC surfaces as a plain deadline instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BmcSettings {
    /// Bound on one request (one HTTP exchange, one IPMI command).
    #[serde(with = "secs")]
    pub request_timeout: Duration,
    /// Extra attempts after a retryable failure (unreachable, timeout, 5xx).
    pub retries: u32,
    /// How long a power action may take to show in the power state.
    #[serde(with = "secs")]
    pub power_deadline: Duration,
    /// How long to look for a transition after a restart-style reset.
    #[serde(with = "secs")]
    pub restart_observe: Duration,
    /// Interval between power-state polls.
    #[serde(with = "secs")]
    pub poll_interval: Duration,
}

/// Validated `[pacing]`: when DHCP offers to new netboot clients wait for a free
/// transfer slot, and how reinstalls' power-ons go in waves. Read through
/// [`PacingWire`] so that every key gets its range check from [`BOUNDS`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pacing {
    /// First-stage transfers (TFTP, HTTP under `/ipxe/`) in flight before offers to
    /// PXE firmware are held.
    pub max_first_stage: u32,
    /// HTTP GETs under `/images/` in flight before offers to iPXE are held.
    pub max_streams: u32,
    /// The longest an offer is held, milliseconds; 0 turns pacing off.
    pub offer_delay_max_ms: u32,
    /// Power-ons granted per wave and group; 0: unlimited (no waves).
    pub power_on_wave_size: u32,
    /// Seconds between the starts of two waves of one group.
    pub power_on_wave_interval_secs: u64,
    /// The label whose values are the groups (`None`: one group for all nodes).
    pub power_on_wave_by_label: Option<String>,
    /// Nodes powered on by a reinstall and still booting (not yet at their installer's
    /// configuration or their deploy agent's plan) before a further power-on waits for
    /// one to get there; 0: no limit. Never above half the HTTP connection cap
    /// (`net::ConnLimits`), since each booting node holds about one connection.
    pub max_booting: u32,
    /// Nice steps the threads that send kernels, initrds and images run below the rest
    /// of pxed (DHCP, TFTP, callbacks, the store's writer); 0: the same priority. Read
    /// when the first file goes out.
    pub transfer_nice: u32,
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            max_first_stage: 64,
            max_streams: 128,
            offer_delay_max_ms: 3000,
            power_on_wave_size: 50,
            power_on_wave_interval_secs: 10,
            power_on_wave_by_label: None,
            max_booting: 1024,
            transfer_nice: 10,
        }
    }
}

impl Default for BmcSettings {
    fn default() -> Self {
        let p = crate::bmc::CallPolicy::default();
        BmcSettings {
            request_timeout: p.request_timeout,
            retries: p.retries,
            power_deadline: p.power_deadline,
            restart_observe: p.restart_observe,
            poll_interval: p.poll_interval,
        }
    }
}

impl BmcSettings {
    /// The driver policy; backoff and override attempts keep the driver defaults.
    pub fn call_policy(&self) -> crate::bmc::CallPolicy {
        crate::bmc::CallPolicy {
            request_timeout: self.request_timeout,
            retries: self.retries,
            power_deadline: self.power_deadline,
            restart_observe: self.restart_observe,
            poll_interval: self.poll_interval,
            ..crate::bmc::CallPolicy::default()
        }
    }
}

/// The validated configuration `pxed serve` runs with.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    pub interfaces: Vec<String>,
    pub server_ip: Option<Ipv4Addr>,
    pub data_dir: PathBuf,
    /// PostgreSQL (see [`Wire::database_url`]); shown without its password.
    #[serde(serialize_with = "redact_url")]
    pub database_url: Option<String>,
    /// See [`Wire::site`].
    pub site: Option<String>,
    pub ipxe_dir: PathBuf,
    pub images_dir: PathBuf,
    pub images_catalog: PathBuf,
    pub http: SocketAddr,
    pub tftp: SocketAddr,
    /// URLs in scripts and configs from the request's `Host` header (default: no, from
    /// `server_ip` or the address the client connected to).
    pub trust_host_header: bool,
    pub mirror_base: Option<String>,
    pub default_image: Option<String>,
    pub hostname_prefix: String,
    /// The status page needs no token (see [`Wire::status_public`]).
    pub status_public: bool,
    /// OpenSSH public keys for root on every installed or deployed system.
    pub ssh_authorized_keys: Vec<String>,
    /// NTP servers for installer-installed systems (see [`Wire::ntp_servers`]).
    pub ntp_servers: Vec<String>,
    #[serde(serialize_with = "mask")]
    pub api_token: Option<String>,
    pub dhcp: DhcpConfig,
    pub boot: BootConfig,
    pub tftp_server: TftpSettings,
    pub lifecycle: LifecycleConfig,
    pub bmc: BmcSettings,
    pub discovery: DiscoverySettings,
    pub syslog: SyslogSettings,
    pub webhooks: WebhookSettings,
    pub stages: StagesSettings,
    pub pacing: Pacing,
    pub profiles: Vec<crate::inventory::profile::Profile>,
}

/// Validated `[webhooks]`.
#[derive(Debug, Clone, Serialize)]
pub struct WebhookSettings {
    pub queue_cap: u32,
    #[serde(with = "secs")]
    pub backoff: Duration,
    #[serde(with = "secs")]
    pub max_backoff: Duration,
    #[serde(with = "secs")]
    pub timeout: Duration,
    pub targets: Vec<WebhookTarget>,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            queue_cap: 10_000,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            timeout: Duration::from_secs(10),
            targets: Vec::new(),
        }
    }
}

/// Validated `[stages]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StagesSettings {
    /// Expected duration of every stage that is not final.
    #[serde(serialize_with = "stage_secs_map")]
    pub expected: BTreeMap<crate::model::Stage, Duration>,
    /// Generations of stages kept per node.
    pub keep_generations: u32,
}

impl Default for StagesSettings {
    fn default() -> Self {
        StagesSettings {
            expected: crate::model::Stage::ALL
                .into_iter()
                .filter_map(|s| Some((s, s.default_expected()?)))
                .collect(),
            keep_generations: 5,
        }
    }
}

/// One webhook URL. The secret is masked in `check-config` and in `Debug`.
#[derive(Clone, Serialize)]
pub struct WebhookTarget {
    pub url: String,
    #[serde(serialize_with = "mask_str")]
    pub secret: String,
    /// Empty: every state.
    pub states: Vec<State>,
}

impl std::fmt::Debug for WebhookTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookTarget")
            .field("url", &self.url)
            .field("secret", &"********")
            .field("states", &self.states)
            .finish()
    }
}

fn mask_str<S: serde::Serializer>(_: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("********")
}

fn stage_secs_map<S: serde::Serializer>(
    m: &BTreeMap<crate::model::Stage, Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(m.len()))?;
    for (k, v) in m {
        map.serialize_entry(k.as_str(), &fmt_duration(*v))?;
    }
    map.end()
}

/// A database URL as `postgres://user@host:port/database`: never its password.
fn redact_url<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match v.as_deref().map(store_pg::parse_url) {
        Some(Ok(opts)) => s.serialize_str(&store_pg::redacted(&opts)),
        Some(Err(_)) => s.serialize_str("********"),
        None => s.serialize_none(),
    }
}

fn mask<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(_) => s.serialize_str("********"),
        None => s.serialize_none(),
    }
}

mod secs {
    use std::time::Duration;
    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::fmt_duration(*d))
    }
}

mod secs_map {
    use std::collections::BTreeMap;
    use std::time::Duration;
    pub fn serialize<S: serde::Serializer>(
        m: &BTreeMap<crate::model::State, Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(m.len()))?;
        for (k, v) in m {
            map.serialize_entry(k.as_str(), &super::fmt_duration(*v))?;
        }
        map.end()
    }
}

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// Units a duration may carry, largest first, with their length in nanoseconds.
const UNITS: [(&str, u128); 5] = [
    ("d", 86_400 * NANOS_PER_SEC),
    ("h", 3_600 * NANOS_PER_SEC),
    ("m", 60 * NANOS_PER_SEC),
    ("s", NANOS_PER_SEC),
    ("ms", 1_000_000),
];

/// Parses `90`, `90s`, `5m`, `2h`, `1d`, `250ms` or a decimal such as `1.5h` into a
/// duration. Exact decimal arithmetic, no floating point: a signed, non-finite or
/// exponent form is not a duration, and one too large to represent is an error, never a
/// panic.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let n = duration_nanos(s)?;
    let secs =
        u64::try_from(n / NANOS_PER_SEC).map_err(|_| format!("`{}` is too large", s.trim()))?;
    Ok(Duration::new(secs, (n % NANOS_PER_SEC) as u32))
}

/// The nanoseconds `s` stands for, saturating at `u128::MAX` (far beyond any range).
fn duration_nanos(s: &str) -> Result<u128, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(format!(
            "`{s}` is not a duration (a number with ms, s, m, h or d)"
        ));
    }
    let per = match unit {
        "" => NANOS_PER_SEC,
        u => UNITS
            .iter()
            .find(|(name, _)| *name == u)
            .map(|(_, per)| *per)
            .ok_or_else(|| format!("`{s}`: unknown unit `{u}` (ms, s, m, h, d)"))?,
    };
    // Both parts hold ASCII digits only (split above). Past 15 decimals even a day
    // is below a nanosecond, so the fraction is cut there and cannot overflow.
    let digits = |d: &str| {
        d.bytes().fold(0u128, |acc, b| {
            acc.saturating_mul(10).saturating_add(u128::from(b - b'0'))
        })
    };
    let frac = &frac[..frac.len().min(15)];
    let part = digits(frac) * per / 10u128.pow(frac.len() as u32);
    Ok(digits(int).saturating_mul(per).saturating_add(part))
}

/// Formats a duration so that [`parse_duration`] reads it back exactly, in the
/// largest unit that divides it (`1h`, `90m`, `250ms`, else decimal seconds).
pub fn fmt_duration(d: Duration) -> String {
    let n = d.as_nanos();
    if n == 0 {
        return "0s".into();
    }
    if let Some((unit, per)) = UNITS.iter().find(|(_, per)| n.is_multiple_of(*per)) {
        return format!("{}{unit}", n / per);
    }
    let s = format!("{}.{:09}", d.as_secs(), d.subsec_nanos());
    format!("{}s", s.trim_end_matches('0'))
}

/// The inclusive range of one duration or count in the config schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    Duration { min: Duration, max: Duration },
    Count { min: i64, max: i64 },
}

impl Range {
    const fn ms(min: u64, max: u64) -> Range {
        Range::Duration {
            min: Duration::from_millis(min),
            max: Duration::from_millis(max),
        }
    }

    const fn secs(min: u64, max: u64) -> Range {
        Range::Duration {
            min: Duration::from_secs(min),
            max: Duration::from_secs(max),
        }
    }

    const fn count(min: i64, max: i64) -> Range {
        Range::Count { min, max }
    }

    /// The bounds as the operator writes them (`60s` as `1m`).
    pub fn show(&self) -> (String, String) {
        match *self {
            Range::Duration { min, max } => (fmt_duration(min), fmt_duration(max)),
            Range::Count { min, max } => (min.to_string(), max.to_string()),
        }
    }
}

const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

/// Every duration and count of the schema with its inclusive range, as
/// `section.key` (`*`: any key of that map). Validation reads these values only
/// through [`duration`] and [`count`], which look the key up here, so a key missing
/// from this table fails every load (the defaults test catches it), and the property
/// test checks any loaded config against it. Ranges are what a production site could
/// want, not what the code could survive: anything outside is a typo or an attack.
pub const BOUNDS: &[(&str, Range)] = &[
    // A lease shorter than a minute is renewal traffic; longer than a year, a leak.
    ("dhcp.lease_time", Range::secs(MINUTE, 365 * DAY)),
    // One slot is one socket and one blocking reader; 64 Ki covers any rack.
    ("tftp_server.max_transfers", Range::count(1, 65_536)),
    // Per packet; 255 s is the most the RFC 2349 `timeout` option can ask for.
    ("tftp_server.timeout", Range::ms(100, 255_000)),
    ("tftp_server.retries", Range::count(0, 20)),
    // Per in-progress state: long enough for a slow install, short enough to notice.
    ("lifecycle.deadlines.*", Range::secs(5, 7 * DAY)),
    ("lifecycle.max_attempts", Range::count(0, 20)),
    // Doubles per retry (capped at 10 min or itself); tests use tens of ms.
    ("lifecycle.backoff", Range::ms(10, HOUR * 1000)),
    // Firmware POST to the first DHCP DISCOVER: seconds on VMs, minutes on big servers.
    ("lifecycle.netboot_observe", Range::ms(100, DAY * 1000)),
    ("lifecycle.leftovers_interval", Range::ms(100, DAY * 1000)),
    ("lifecycle.owner_ttl", Range::ms(300, 10 * MINUTE * 1000)),
    ("bmc.request_timeout", Range::ms(100, 5 * MINUTE * 1000)),
    ("bmc.retries", Range::count(0, 10)),
    ("bmc.power_deadline", Range::secs(1, HOUR)),
    ("bmc.restart_observe", Range::ms(100, HOUR * 1000)),
    ("bmc.poll_interval", Range::ms(50, 5 * MINUTE * 1000)),
    // Unenrolled machines kept, and registrations a minute: a rack at once fits.
    ("discovery.max_pending", Range::count(0, 100_000)),
    ("discovery.per_minute", Range::count(1, 100_000)),
    // Installer lines kept per node generation: a failing d-i says why in its last few.
    ("syslog.lines_per_node", Range::count(10, 100_000)),
    ("syslog.max_connections", Range::count(1, 65_536)),
    ("syslog.idle_timeout", Range::secs(1, DAY)),
    // RFC 5426 asks receivers to take 2048 bytes; 64 KiB is the largest UDP datagram.
    ("syslog.max_line", Range::count(480, 65_535)),
    // Events waiting on disk for a URL that is down: a day of a busy fleet's changes.
    ("webhooks.queue_cap", Range::count(10, 10_000_000)),
    ("webhooks.backoff", Range::ms(10, HOUR * 1000)),
    ("webhooks.max_backoff", Range::ms(10, DAY * 1000)),
    ("webhooks.timeout", Range::ms(100, 5 * MINUTE * 1000)),
    // A DHCP exchange takes seconds; a slow mirror's package stage hours.
    ("stages.expected.*", Range::secs(1, DAY)),
    ("stages.keep_generations", Range::count(1, 100)),
    // Slots before offers wait: 1 serialises a lab, 64 Ki is past any one server.
    ("pacing.max_first_stage", Range::count(1, 65_536)),
    ("pacing.max_streams", Range::count(1, 65_536)),
    // Firmware retransmits DISCOVER at ~4 s, 8 s, 16 s; an offered address is kept
    // for its client 10 s (`dhcp::Policy::offer_hold`), so no offer waits longer.
    // 0 turns pacing off.
    ("pacing.offer_delay_max_ms", Range::count(0, 10_000)),
    // Power-ons per wave (0: unlimited): a whole hall at once is a choice, not a typo.
    ("pacing.power_on_wave_size", Range::count(0, 100_000)),
    // A BMC power-on draws its inrush in seconds; an hour apart is a reclaim by hand.
    ("pacing.power_on_wave_interval_secs", Range::count(1, 3_600)),
    // 0: no limit; past 1 Mi nodes booting at once is no limit either.
    ("pacing.max_booting", Range::count(0, 1_048_576)),
    // Nice values end at 19: 19 steps below is as low as a thread goes.
    ("pacing.transfer_nice", Range::count(0, 19)),
];

/// The range [`BOUNDS`] declares for `key` (`lifecycle.deadlines.installing` matches
/// `lifecycle.deadlines.*`).
pub fn range_of(key: &str) -> Option<Range> {
    BOUNDS.iter().find_map(|(pattern, range)| {
        let (p, k): (Vec<&str>, Vec<&str>) =
            (pattern.split('.').collect(), key.split('.').collect());
        (p.len() == k.len() && p.iter().zip(&k).all(|(p, k)| *p == "*" || p == k)).then_some(*range)
    })
}

/// `raw` (or `default`) as a duration inside the range of `key`.
fn duration(key: &str, raw: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
    let Some(range @ Range::Duration { min, max }) = range_of(key) else {
        return Err(ConfigError::NoRange { key: key.into() });
    };
    let nanos = match raw {
        Some(s) => duration_nanos(s).map_err(|e| invalid(key, e))?,
        None => default.as_nanos(),
    };
    if !(min.as_nanos()..=max.as_nanos()).contains(&nanos) {
        let got = raw.map_or_else(|| fmt_duration(default), |s| s.trim().to_string());
        return Err(out_of_range(key, range, got));
    }
    // In range, so below `max` and representable.
    Ok(Duration::new(
        (nanos / NANOS_PER_SEC) as u64,
        (nanos % NANOS_PER_SEC) as u32,
    ))
}

/// `raw` (or `default`) as a count inside the range of `key`.
fn count<T: TryFrom<i64>>(key: &str, raw: Option<i64>, default: i64) -> Result<T, ConfigError> {
    let Some(range @ Range::Count { min, max }) = range_of(key) else {
        return Err(ConfigError::NoRange { key: key.into() });
    };
    let v = raw.unwrap_or(default);
    if !(min..=max).contains(&v) {
        return Err(out_of_range(key, range, v.to_string()));
    }
    T::try_from(v).map_err(|_| out_of_range(key, range, v.to_string()))
}

fn out_of_range(key: &str, range: Range, mut got: String) -> ConfigError {
    // The value is echoed back; a megabyte of digits need not be.
    if got.len() > 40 {
        let cut = (0..=40)
            .rev()
            .find(|i| got.is_char_boundary(*i))
            .unwrap_or(0);
        got.truncate(cut);
        got.push('…');
    }
    let (min, max) = range.show();
    ConfigError::OutOfRange {
        key: key.into(),
        min,
        max,
        got,
    }
}

/// The server's command-line flags: parsed by clap (`pxed serve`, `pxed check-config`)
/// and serialized as the last config layer. A flag that was not given serializes to
/// nothing (TOML drops `None`, empty lists are skipped), so only given flags override.
#[derive(Debug, Clone, Default, Serialize, clap::Args)]
pub struct Flags {
    /// TOML config file.
    #[arg(long, env = "PXED_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Run on loopback with a local data dir and the repo's image catalog (no DHCP).
    #[arg(long)]
    #[serde(skip)]
    pub demo: bool,
    /// Interface to answer DHCP on (repeatable). DHCP is served only there.
    #[arg(long = "interface", value_name = "IFACE")]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<String>,
    /// The address clients are told to use for TFTP and HTTP.
    #[arg(long)]
    pub server_ip: Option<Ipv4Addr>,
    /// SQLite file and state.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// PostgreSQL URL instead of SQLite (postgres://USER:PASSWORD@HOST/DATABASE). A
    /// password here is visible in `ps`: prefer PXED_DATABASE_URL or the config file.
    #[arg(long = "database", value_name = "URL")]
    pub database_url: Option<String>,
    /// iPXE binaries (undionly.kpxe, snponly.efi, ipxe-arm64.efi).
    #[arg(long)]
    pub ipxe_dir: Option<PathBuf>,
    /// Imported image files.
    #[arg(long)]
    pub images_dir: Option<PathBuf>,
    /// HTTP listen address.
    #[arg(long)]
    pub http: Option<SocketAddr>,
    /// TFTP listen address.
    #[arg(long)]
    pub tftp: Option<SocketAddr>,
    /// File holding the API bearer token.
    #[arg(long)]
    pub api_token_file: Option<PathBuf>,
    #[command(flatten)]
    #[serde(skip_serializing_if = "DhcpFlags::is_empty")]
    pub dhcp: DhcpFlags,
}

/// The `[dhcp]` part of [`Flags`].
#[derive(Debug, Clone, Default, Serialize, clap::Args)]
pub struct DhcpFlags {
    /// DHCP mode.
    #[arg(long = "dhcp", value_enum)]
    pub mode: Option<DhcpMode>,
    /// Address pool, START-END (full mode).
    #[arg(long)]
    pub pool: Option<String>,
    #[arg(long)]
    pub netmask: Option<Ipv4Addr>,
    #[arg(long)]
    pub router: Option<Ipv4Addr>,
    /// DNS server (repeatable).
    #[arg(long)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<Ipv4Addr>,
    /// Lease time (e.g. 3600, 1h).
    #[arg(long)]
    pub lease_time: Option<String>,
}

impl DhcpFlags {
    fn is_empty(&self) -> bool {
        self.mode.is_none()
            && self.pool.is_none()
            && self.netmask.is_none()
            && self.router.is_none()
            && self.dns.is_empty()
            && self.lease_time.is_none()
    }
}

/// `PXED_*` variables that are not config keys but are pxed's own: the CLI's
/// (`PXED_URL`, `PXED_TOKEN_FILE`, `PXED_BMC_PASSWORD`, which the README has operators export;
/// `PXED_API_TOKEN` is the config key `api_token` as well) and the process's
/// (`PXED_CONFIG`, `PXED_LOG`). Leaving them alone is not news, so [`Flags::load`]
/// does not log them; any other name may be a typo and is.
const OWN_VARIABLES: [&str; 5] = [
    "PXED_CONFIG",
    "PXED_LOG",
    "PXED_URL",
    "PXED_TOKEN_FILE",
    "PXED_BMC_PASSWORD",
];

impl Config {
    /// What a valid config still gets wrong in a way the operator should hear about:
    /// settings the DHCP mode leaves unused, overlapping profiles, a BMC power deadline
    /// that the reclaiming deadline would hide. `serve` logs them; `check-config`
    /// prints them.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = self.dhcp.ignored();
        w.extend(
            crate::inventory::profile::overlaps(&self.profiles)
                .into_iter()
                .map(|o| format!("profiles overlap: {o}")),
        );
        if let Some(reclaim) = self.lifecycle.deadlines.get(&State::Reclaiming)
            && self.bmc.power_deadline >= *reclaim
        {
            w.push(format!(
                "bmc.power_deadline ({:?}) is not shorter than the reclaiming deadline ({reclaim:?}): a stuck power action will show as a deadline, not as the BMC's error",
                self.bmc.power_deadline
            ));
        }
        let p = &self.pacing;
        if p.max_booting != 0 && p.max_booting <= p.max_streams {
            w.push(format!(
                "pacing.max_booting ({}) is not above pacing.max_streams ({}): a booting place frees only when its installer fetches its configuration, and the machine powered on next spends its power cycle and POST before it asks for a byte, so a reclaim never fills the stream slots and runs slower (see the README's \"Booting places\")",
                p.max_booting, p.max_streams
            ));
        }
        w
    }
}

impl Flags {
    /// Loads the configuration these flags point at, with the process environment,
    /// and logs which `PXED_*` variables it left alone.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let (cfg, ignored) = self.load_with_env(std::env::vars())?;
        let ignored: Vec<String> = ignored
            .into_iter()
            .filter(|v| !OWN_VARIABLES.contains(&v.as_str()))
            .collect();
        if !ignored.is_empty() {
            tracing::info!(
                variables = %ignored.join(", "),
                "environment variables that are not config keys were left alone"
            );
        }
        Ok(cfg)
    }

    /// Loads with `env` as the environment; also returns the `PXED_*` variables that
    /// were ignored because they name no config key (client variables such as
    /// `PXED_URL` or `PXED_BMC_PASSWORD`).
    pub fn load_with_env(
        &self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Config, Vec<String>), ConfigError> {
        let file = self.config.clone().or_else(|| {
            let p = PathBuf::from("/etc/pxed/pxed.toml");
            (!self.demo && p.exists()).then_some(p)
        });
        load_layers(file.as_deref(), env, self)
    }
}

/// Reads all layers and validates the result.
pub fn load(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    flags: &Flags,
) -> Result<Config, ConfigError> {
    Ok(load_layers(file, env, flags)?.0)
}

/// [`load`], also returning the names of `PXED_*` variables that were left alone
/// (they name no config key or section).
pub fn load_layers(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    flags: &Flags,
) -> Result<(Config, Vec<String>), ConfigError> {
    let mut merged = toml::Table::new();
    if flags.demo {
        merge(&mut merged, demo_defaults());
    }
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let parse_err = |e: toml::de::Error| file_error(path, &text, &e);
        // The file alone is read as the typed form first, so a mistake in it is reported
        // with its line and column (the merged layers below have no positions).
        toml::from_str::<Wire>(&text).map_err(parse_err)?;
        let t: toml::Table = toml::from_str(&text).map_err(parse_err)?;
        merge(&mut merged, t);
    }
    let (env_table, ignored) = env_layer(env)?;
    merge(&mut merged, env_table);
    merge(&mut merged, flag_layer(flags)?);
    // The file (if any) passed its own check above: a mistake here came from the
    // environment or a flag.
    let wire: Wire = merged.try_into().map_err(|e: toml::de::Error| {
        ConfigError::Parse(format!(
            "{} (set by a PXED_* variable or a flag)",
            e.to_string().trim_end()
        ))
    })?;
    Ok((validate(wire)?, ignored))
}

fn demo_defaults() -> toml::Table {
    toml::toml! {
        data_dir = "./pxed-demo"
        ipxe_dir = "./ipxe/bin"
        images_catalog = "./images"
        http = "127.0.0.1:8080"
        tftp = "127.0.0.1:6969"
        server_ip = "127.0.0.1"
        mirror_base = "http://127.0.0.1:8080/images/"
        // Loopback only: the board opens without a token.
        status_public = true
        // Any free port (logged; the installers are pointed at the real one).
        [syslog]
        address = "127.0.0.1:0"
    }
}

/// Deep-merges `top` into `base` (tables recurse, anything else replaces).
fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Every config key the environment may set, as `section.key`; `section.*` is a map
/// whose keys are the operator's (deadline per state, boot file per MAC). Lists of
/// tables (`dhcp.reservations`, `dhcp.relay_subnets`) are config-file only.
pub const ENV_KEYS: &[&str] = &[
    "interfaces",
    "server_ip",
    "data_dir",
    "database_url",
    "site",
    "ipxe_dir",
    "images_dir",
    "images_catalog",
    "http",
    "tftp",
    "trust_host_header",
    "mirror_base",
    "default_image",
    "hostname_prefix",
    "status_public",
    "ssh_authorized_keys",
    "ntp_servers",
    "api_token",
    "api_token_file",
    "dhcp.mode",
    "dhcp.pool",
    "dhcp.netmask",
    "dhcp.router",
    "dhcp.dns",
    "dhcp.domain",
    "dhcp.lease_time",
    "boot.bios",
    "boot.uefi_x64",
    "boot.uefi_arm64",
    "boot.http_x64",
    "boot.http_arm64",
    "boot.per_mac.*",
    "tftp_server.max_transfers",
    "tftp_server.timeout",
    "tftp_server.retries",
    "lifecycle.deadlines.*",
    "lifecycle.max_attempts",
    "lifecycle.backoff",
    "lifecycle.netboot_observe",
    "lifecycle.leftovers_interval",
    "lifecycle.owner_ttl",
    "bmc.request_timeout",
    "bmc.retries",
    "bmc.power_deadline",
    "bmc.restart_observe",
    "bmc.poll_interval",
    "discovery.max_pending",
    "discovery.per_minute",
    "syslog.enabled",
    "syslog.address",
    "syslog.lines_per_node",
    "syslog.max_connections",
    "syslog.idle_timeout",
    "syslog.max_line",
    "webhooks.queue_cap",
    "webhooks.backoff",
    "webhooks.max_backoff",
    "webhooks.timeout",
    "stages.expected.*",
    "stages.keep_generations",
    "pacing.max_first_stage",
    "pacing.max_streams",
    "pacing.offer_delay_max_ms",
    "pacing.power_on_wave_size",
    "pacing.power_on_wave_interval_secs",
    "pacing.power_on_wave_by_label",
    "pacing.max_booting",
    "pacing.transfer_nice",
];

/// Whether `path` is an [`ENV_KEYS`] key; `Err` carries the keys of its section when
/// the first component names a section or key but the rest does not match.
fn env_key(path: &[String]) -> Option<Result<(), Vec<&'static str>>> {
    let first = path.first()?;
    let in_section: Vec<&'static str> = ENV_KEYS
        .iter()
        .copied()
        .filter(|k| k.split('.').next() == Some(first.as_str()))
        .collect();
    if in_section.is_empty() {
        return None;
    }
    let matches = |k: &str| {
        let parts: Vec<&str> = k.split('.').collect();
        parts.len() == path.len()
            && parts
                .iter()
                .zip(path)
                .all(|(p, q)| *p == "*" || *p == q.as_str())
    };
    Some(if in_section.iter().any(|k| matches(k)) {
        Ok(())
    } else {
        Err(in_section)
    })
}

/// `PXED_DHCP__POOL=...` → `dhcp.pool`. Values are parsed as TOML where they can be,
/// comma lists become arrays, anything else is a string. A variable without `__` that
/// names no config key is not config (`PXED_URL`, `PXED_BMC_PASSWORD`, a wrapper
/// script's own): it is skipped and returned. One with `__`, or one that names a
/// section but no key in it, is an error.
fn env_layer(
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(toml::Table, Vec<String>), ConfigError> {
    let mut t = toml::Table::new();
    let mut ignored = Vec::new();
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("PXED_"))
        .collect();
    vars.sort();
    for (var, val) in vars {
        let rest = &var["PXED_".len()..];
        let path: Vec<String> = rest.split("__").map(|p| p.to_ascii_lowercase()).collect();
        match env_key(&path) {
            // `__` is the config layer's own syntax: a misspelled section is an error.
            None if path.len() > 1 => {
                return Err(ConfigError::UnknownEnv {
                    key: path.join("."),
                    var,
                });
            }
            None => {
                ignored.push(var);
                continue;
            }
            Some(Err(keys)) => {
                let hint = keys
                    .iter()
                    .map(|k| format!("PXED_{}", k.replace('.', "__").to_ascii_uppercase()))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(ConfigError::UnknownEnv {
                    key: format!("{} (did you mean one of: {hint})", path.join(".")),
                    var,
                });
            }
            Some(Ok(())) => {}
        }
        let value = env_value(&path, &val);
        let mut cur = &mut t;
        for p in &path[..path.len() - 1] {
            let entry = cur
                .entry(p.clone())
                .or_insert_with(|| toml::Value::Table(Default::default()));
            // Keys are leaves or sections by ENV_KEYS, so a section is always a table.
            let toml::Value::Table(next) = entry else {
                return Err(ConfigError::UnknownEnv {
                    key: path.join("."),
                    var,
                });
            };
            cur = next;
        }
        cur.insert(path[path.len() - 1].clone(), value);
    }
    Ok((t, ignored))
}

const LIST_KEYS: &[&str] = &["interfaces", "dns", "ssh_authorized_keys", "ntp_servers"];

fn env_value(path: &[String], val: &str) -> toml::Value {
    let last = path.last().map(String::as_str).unwrap_or("");
    if LIST_KEYS.contains(&last) {
        return toml::Value::Array(
            val.split(',')
                .map(|s| toml::Value::String(s.trim().to_string()))
                .filter(|v| v.as_str() != Some(""))
                .collect(),
        );
    }
    // A bare number is seconds to a duration key (`PXED_DHCP__LEASE_TIME=3600`), which
    // the wire form reads as text.
    if matches!(range_of(&path.join(".")), Some(Range::Duration { .. })) {
        return toml::Value::String(val.to_string());
    }
    if let Ok(v) = val.parse::<i64>() {
        return toml::Value::Integer(v);
    }
    if let Ok(v) = val.parse::<bool>() {
        return toml::Value::Boolean(v);
    }
    toml::Value::String(val.to_string())
}

fn flag_layer(f: &Flags) -> Result<toml::Table, ConfigError> {
    toml::Table::try_from(f).map_err(|e| ConfigError::Parse(e.to_string()))
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

fn validate(w: Wire) -> Result<Config, ConfigError> {
    let d = w.dhcp.unwrap_or_default();
    let mode = d.mode.unwrap_or(DhcpMode::Off);
    let interfaces = w.interfaces.unwrap_or_default();
    if mode != DhcpMode::Off && interfaces.is_empty() {
        return Err(invalid(
            "interfaces",
            "DHCP is on but no --interface was named; pxed answers DHCP only on interfaces the operator names",
        ));
    }
    let lease_time = duration(
        "dhcp.lease_time",
        d.lease_time.as_deref(),
        Duration::from_secs(3600),
    )?;
    let local = match (&d.pool, mode) {
        (Some(p), _) => {
            let pool = Pool::parse(p).map_err(|e| invalid("dhcp.pool", e))?;
            let netmask = d.netmask.unwrap_or(Ipv4Addr::new(255, 255, 255, 0));
            check_netmask(netmask).map_err(|e| invalid("dhcp.netmask", e))?;
            let s = Subnet {
                pool,
                netmask,
                router: d.router,
                dns: d.dns.clone().unwrap_or_default(),
            };
            if !s.contains(pool.end) {
                return Err(invalid(
                    "dhcp.pool",
                    format!("{p} does not fit in one subnet with netmask {netmask}"),
                ));
            }
            Some(s)
        }
        (None, DhcpMode::Full) => {
            return Err(invalid(
                "dhcp.pool",
                "full DHCP mode needs --pool START-END",
            ));
        }
        (None, _) => None,
    };
    let mut relay_subnets = Vec::new();
    for s in d.relay_subnets.unwrap_or_default() {
        let pool = Pool::parse(&s.pool).map_err(|e| invalid("dhcp.relay_subnets", e))?;
        check_netmask(s.netmask).map_err(|e| invalid("dhcp.relay_subnets", e))?;
        let sub = Subnet {
            pool,
            netmask: s.netmask,
            router: s.router,
            dns: s.dns.unwrap_or_default(),
        };
        if !sub.contains(pool.end) {
            return Err(invalid(
                "dhcp.relay_subnets",
                format!("{} does not fit in one subnet", s.pool),
            ));
        }
        relay_subnets.push(sub);
    }
    let mut reservations = d.reservations.unwrap_or_default();
    for r in &mut reservations {
        r.mac = normalize_mac(&r.mac).ok_or_else(|| {
            invalid(
                "dhcp.reservations",
                format!("`{}` is not a MAC address", r.mac),
            )
        })?;
    }
    check_reservations(
        &reservations,
        mode == DhcpMode::Full,
        local.iter().chain(&relay_subnets),
    )?;
    let b = w.boot.unwrap_or_default();
    let mut per_mac = BTreeMap::new();
    for (k, v) in b.per_mac.unwrap_or_default() {
        let mac = k
            .parse::<crate::model::Mac>()
            .map_err(|e| invalid("boot.per_mac", e.to_string()))?;
        per_mac.insert(mac, v);
    }
    let boot = BootConfig {
        bios: b.bios.unwrap_or_else(|| "undionly.kpxe".into()),
        uefi_x64: b.uefi_x64.unwrap_or_else(|| "snponly.efi".into()),
        uefi_arm64: b.uefi_arm64.unwrap_or_else(|| "ipxe-arm64.efi".into()),
        http_x64: b.http_x64.unwrap_or_else(|| "snponly.efi".into()),
        http_arm64: b.http_arm64.unwrap_or_else(|| "ipxe-arm64.efi".into()),
        per_mac,
    };
    for name in [
        &boot.bios,
        &boot.uefi_x64,
        &boot.uefi_arm64,
        &boot.http_x64,
        &boot.http_arm64,
    ] {
        if name.is_empty() || name.contains("..") || name.starts_with('/') {
            return Err(invalid(
                "boot",
                format!("`{name}` must be a file name inside the iPXE dir"),
            ));
        }
    }
    let t = w.tftp_server.unwrap_or_default();
    let tftp_server = TftpSettings {
        max_transfers: count("tftp_server.max_transfers", t.max_transfers, 256)?,
        timeout: duration(
            "tftp_server.timeout",
            t.timeout.as_deref(),
            Duration::from_secs(1),
        )?,
        retries: count("tftp_server.retries", t.retries, 5)?,
    };
    let l = w.lifecycle.unwrap_or_default();
    let deadline_key = |s: State| format!("lifecycle.deadlines.{s}");
    let mut deadlines = BTreeMap::new();
    for s in State::ALL {
        if let Some(d) = s.default_deadline() {
            deadlines.insert(s, duration(&deadline_key(s), None, d)?);
        }
    }
    for (k, v) in l.deadlines.unwrap_or_default() {
        let state = k.parse::<State>().ok().filter(|s| s.in_progress());
        let Some(state) = state else {
            let what = if k.parse::<State>().is_ok() {
                "is a resting state: it has nothing to retry, so no deadline"
            } else {
                "is not a state"
            };
            let names: Vec<&str> = deadlines.keys().map(|s| s.as_str()).collect();
            return Err(invalid(
                "lifecycle.deadlines",
                format!("`{k}` {what} (deadlines: {})", names.join(", ")),
            ));
        };
        let d = duration(&deadline_key(state), Some(&v), Duration::ZERO)?;
        deadlines.insert(state, d);
    }
    let lifecycle = LifecycleConfig {
        deadlines,
        max_attempts: count("lifecycle.max_attempts", l.max_attempts, 3)?,
        backoff: duration(
            "lifecycle.backoff",
            l.backoff.as_deref(),
            Duration::from_secs(10),
        )?,
        netboot_observe: duration(
            "lifecycle.netboot_observe",
            l.netboot_observe.as_deref(),
            crate::lifecycle::transition::DEFAULT_NETBOOT_OBSERVE,
        )?,
        leftovers_interval: duration(
            "lifecycle.leftovers_interval",
            l.leftovers_interval.as_deref(),
            Duration::from_secs(60),
        )?,
        owner_ttl: duration(
            "lifecycle.owner_ttl",
            l.owner_ttl.as_deref(),
            Duration::from_secs(10),
        )?,
    };
    let bmc = validate_bmc(w.bmc.unwrap_or_default())?;
    let dw = w.discovery.unwrap_or_default();
    let def = DiscoverySettings::default();
    let discovery = DiscoverySettings {
        max_pending: count(
            "discovery.max_pending",
            dw.max_pending,
            def.max_pending.into(),
        )?,
        per_minute: count("discovery.per_minute", dw.per_minute, def.per_minute.into())?,
    };
    let sw = w.syslog.unwrap_or_default();
    let syslog = SyslogSettings {
        enabled: sw.enabled.unwrap_or(true),
        address: sw.address.unwrap_or_else(|| {
            SocketAddr::new(w.server_ip.unwrap_or(Ipv4Addr::UNSPECIFIED).into(), 514)
        }),
        lines_per_node: count("syslog.lines_per_node", sw.lines_per_node, 500)?,
        max_connections: count("syslog.max_connections", sw.max_connections, 64)?,
        idle_timeout: duration(
            "syslog.idle_timeout",
            sw.idle_timeout.as_deref(),
            Duration::from_secs(300),
        )?,
        max_line: count("syslog.max_line", sw.max_line, 8192)?,
    };
    let stages = validate_stages(w.stages.unwrap_or_default())?;
    let api_token = match (w.api_token, &w.api_token_file) {
        (Some(t), _) => Some(t),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|source| ConfigError::TokenFile {
                    path: path.clone(),
                    source,
                })?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    if api_token.as_deref() == Some("") {
        return Err(invalid("api_token", "the API token is empty"));
    }
    let ssh_authorized_keys = w.ssh_authorized_keys.unwrap_or_default();
    for k in &ssh_authorized_keys {
        crate::model::check_authorized_key(k).map_err(|e| invalid("ssh_authorized_keys", e))?;
    }
    let ntp_servers = w.ntp_servers.unwrap_or_default();
    if ntp_servers.len() > 8 {
        return Err(invalid("ntp_servers", "at most 8 servers"));
    }
    // They reach kickstart, preseed and YAML verbatim: host names and addresses only.
    if let Some(bad) = ntp_servers.iter().find(|h| {
        h.is_empty()
            || h.len() > 253
            || h.starts_with('-')
            || !h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'))
    }) {
        return Err(invalid(
            "ntp_servers",
            format!("{bad:?} is not a host name or an IP address"),
        ));
    }
    let webhooks = validate_webhooks(w.webhooks.unwrap_or_default())?;
    let pacing = validate_pacing(w.pacing.unwrap_or_default())?;
    let profiles = validate_profiles(w.profiles.unwrap_or_default())?;
    let data_dir = w.data_dir.unwrap_or_else(|| "/var/lib/pxed".into());
    if let Some(url) = &w.database_url {
        store_pg::parse_url(url).map_err(|e| invalid("database_url", e.to_string()))?;
    }
    let database_url = w.database_url;
    let site = w.site.map(|s| s.trim().to_string());
    if let Some(bad) = &site
        && (bad.is_empty()
            || bad.len() > 64
            || !bad
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
    {
        return Err(invalid(
            "site",
            format!("{bad:?}: 1 to 64 letters, digits, `-`, `_` or `.`"),
        ));
    }
    Ok(Config {
        interfaces,
        server_ip: w.server_ip,
        images_dir: w.images_dir.unwrap_or_else(|| data_dir.join("images")),
        data_dir,
        database_url,
        site,
        ipxe_dir: w.ipxe_dir.unwrap_or_else(|| "/usr/lib/pxed/ipxe".into()),
        images_catalog: w
            .images_catalog
            .unwrap_or_else(|| "/usr/share/pxed/images".into()),
        http: w
            .http
            .unwrap_or_else(|| "0.0.0.0:80".parse().expect("literal")),
        tftp: w
            .tftp
            .unwrap_or_else(|| "0.0.0.0:69".parse().expect("literal")),
        trust_host_header: w.trust_host_header.unwrap_or(false),
        mirror_base: w.mirror_base,
        default_image: w.default_image,
        hostname_prefix: w.hostname_prefix.unwrap_or_else(|| "node-".into()),
        status_public: w.status_public.unwrap_or(false),
        ssh_authorized_keys,
        ntp_servers,
        api_token,
        dhcp: DhcpConfig {
            mode,
            local,
            relay_subnets,
            domain: d.domain,
            lease_time,
            reservations,
        },
        boot,
        tftp_server,
        lifecycle,
        bmc,
        discovery,
        syslog,
        webhooks,
        stages,
        pacing,
        profiles,
    })
}

/// Most profiles in one config; each is checked against every inventory.
const MAX_PROFILES: usize = 256;

fn validate_profiles(
    ps: Vec<crate::inventory::profile::Profile>,
) -> Result<Vec<crate::inventory::profile::Profile>, ConfigError> {
    if ps.len() > MAX_PROFILES {
        return Err(invalid(
            "profiles",
            format!("{} profiles; at most {MAX_PROFILES}", ps.len()),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for p in &ps {
        let ok = !p.name.is_empty()
            && p.name.len() <= 64
            && p.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(invalid(
                "profiles",
                format!("name {:?}: 1-64 letters, digits, '-', '_' or '.'", p.name),
            ));
        }
        if !seen.insert(p.name.as_str()) {
            return Err(invalid("profiles", format!("{} is defined twice", p.name)));
        }
        let mut checks = std::collections::BTreeSet::new();
        for h in &p.health {
            if let Some(why) = h.problem() {
                return Err(invalid("profiles", format!("{}: {why}", p.name)));
            }
            if !checks.insert(h.name.as_str()) {
                return Err(invalid(
                    "profiles",
                    format!("{}: health check {} is defined twice", p.name, h.name),
                ));
            }
        }
    }
    Ok(ps)
}

fn validate_webhooks(w: WebhooksWire) -> Result<WebhookSettings, ConfigError> {
    let def = WebhookSettings::default();
    let s = WebhookSettings {
        queue_cap: count("webhooks.queue_cap", w.queue_cap, def.queue_cap.into())?,
        backoff: duration("webhooks.backoff", w.backoff.as_deref(), def.backoff)?,
        max_backoff: duration(
            "webhooks.max_backoff",
            w.max_backoff.as_deref(),
            def.max_backoff,
        )?,
        timeout: duration("webhooks.timeout", w.timeout.as_deref(), def.timeout)?,
        targets: Vec::new(),
    };
    if s.max_backoff < s.backoff {
        return Err(invalid(
            "webhooks.max_backoff",
            format!(
                "{} is shorter than webhooks.backoff ({})",
                fmt_duration(s.max_backoff),
                fmt_duration(s.backoff)
            ),
        ));
    }
    let mut targets: Vec<WebhookTarget> = Vec::new();
    for t in w.targets.unwrap_or_default() {
        let key = "webhooks.targets";
        match reqwest::Url::parse(&t.url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
            _ => return Err(invalid(key, format!("{:?} is not an http(s) URL", t.url))),
        }
        if targets.iter().any(|o| o.url == t.url) {
            return Err(invalid(key, format!("{} is listed twice", t.url)));
        }
        let secret = match (t.secret, &t.secret_file) {
            (Some(s), None) => s,
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?
                .trim()
                .to_string(),
            _ => {
                return Err(invalid(
                    key,
                    format!("{}: set one of secret or secret_file", t.url),
                ));
            }
        };
        if secret.is_empty() {
            return Err(invalid(key, format!("{}: the secret is empty", t.url)));
        }
        let states = t
            .states
            .unwrap_or_default()
            .iter()
            .map(|s| {
                s.parse::<State>()
                    .map_err(|_| invalid(key, format!("{}: {s:?} is not a state", t.url)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        targets.push(WebhookTarget {
            url: t.url,
            secret,
            states,
        });
    }
    Ok(WebhookSettings { targets, ..s })
}

fn validate_stages(w: StagesWire) -> Result<StagesSettings, ConfigError> {
    use crate::model::Stage;
    let mut s = StagesSettings::default();
    for (k, d) in &mut s.expected {
        *d = duration(&format!("stages.expected.{k}"), None, *d)?;
    }
    // Groups first, so a single milestone named beside its group wins.
    let mut entries: Vec<(String, String)> = w.expected.unwrap_or_default().into_iter().collect();
    entries.sort_by_key(|(k, _)| !matches!(k.as_str(), "installer" | "deploy"));
    for (k, v) in entries {
        let d = duration(&format!("stages.expected.{k}"), Some(&v), Duration::ZERO)?;
        let targets: Vec<Stage> = match k.as_str() {
            "installer" | "deploy" => Stage::ALL
                .into_iter()
                .filter(|s| s.as_str().starts_with(&format!("{k}_")))
                .collect(),
            _ => match k.parse::<Stage>() {
                Ok(st) if !st.is_final() => vec![st],
                _ => {
                    let names: Vec<&str> = s.expected.keys().map(|s| s.as_str()).collect();
                    return Err(invalid(
                        "stages.expected",
                        format!(
                            "`{k}` is not a stage with a duration (stages: installer, deploy, {})",
                            names.join(", ")
                        ),
                    ));
                }
            },
        };
        for t in targets {
            s.expected.insert(t, d);
        }
    }
    s.keep_generations = count(
        "stages.keep_generations",
        w.keep_generations,
        s.keep_generations.into(),
    )?;
    Ok(s)
}

fn validate_bmc(b: BmcWire) -> Result<BmcSettings, ConfigError> {
    let def = BmcSettings::default();
    let s = BmcSettings {
        request_timeout: duration(
            "bmc.request_timeout",
            b.request_timeout.as_deref(),
            def.request_timeout,
        )?,
        retries: count("bmc.retries", b.retries, def.retries.into())?,
        power_deadline: duration(
            "bmc.power_deadline",
            b.power_deadline.as_deref(),
            def.power_deadline,
        )?,
        restart_observe: duration(
            "bmc.restart_observe",
            b.restart_observe.as_deref(),
            def.restart_observe,
        )?,
        poll_interval: duration(
            "bmc.poll_interval",
            b.poll_interval.as_deref(),
            def.poll_interval,
        )?,
    };
    if s.restart_observe > s.power_deadline {
        return Err(invalid(
            "bmc.restart_observe",
            format!(
                "{} is longer than bmc.power_deadline ({})",
                fmt_duration(s.restart_observe),
                fmt_duration(s.power_deadline)
            ),
        ));
    }
    if s.poll_interval > s.power_deadline {
        return Err(invalid(
            "bmc.poll_interval",
            format!(
                "{} is longer than bmc.power_deadline ({})",
                fmt_duration(s.poll_interval),
                fmt_duration(s.power_deadline)
            ),
        ));
    }
    Ok(s)
}

fn validate_pacing(p: PacingWire) -> Result<Pacing, ConfigError> {
    let def = Pacing::default();
    let by_label = match p.power_on_wave_by_label.map(|k| k.trim().to_string()) {
        Some(k) if k.is_empty() => None,
        Some(k) => {
            crate::store::board::check_label(&k, "")
                .map_err(|e| invalid("pacing.power_on_wave_by_label", e))?;
            Some(k)
        }
        None => None,
    };
    Ok(Pacing {
        max_first_stage: count(
            "pacing.max_first_stage",
            p.max_first_stage,
            def.max_first_stage.into(),
        )?,
        max_streams: count("pacing.max_streams", p.max_streams, def.max_streams.into())?,
        offer_delay_max_ms: count(
            "pacing.offer_delay_max_ms",
            p.offer_delay_max_ms,
            def.offer_delay_max_ms.into(),
        )?,
        power_on_wave_size: count(
            "pacing.power_on_wave_size",
            p.power_on_wave_size,
            def.power_on_wave_size.into(),
        )?,
        power_on_wave_interval_secs: count(
            "pacing.power_on_wave_interval_secs",
            p.power_on_wave_interval_secs,
            def.power_on_wave_interval_secs as i64,
        )?,
        power_on_wave_by_label: by_label,
        max_booting: count("pacing.max_booting", p.max_booting, def.max_booting.into())?,
        transfer_nice: count(
            "pacing.transfer_nice",
            p.transfer_nice,
            def.transfer_nice.into(),
        )?,
    })
}

fn check_netmask(m: Ipv4Addr) -> Result<(), String> {
    let v = u32::from(m);
    if v == 0 || v.leading_ones() + v.trailing_zeros() != 32 {
        return Err(format!("{m} is not a contiguous netmask"));
    }
    Ok(())
}

pub use crate::model::normalize_mac;

#[cfg(test)]
mod tests {
    use super::*;

    fn env(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn defaults_are_safe() {
        let c = load(None, env(&[]), &Flags::default()).unwrap();
        assert_eq!(c.dhcp.mode, DhcpMode::Off);
        assert!(c.interfaces.is_empty());
        assert_eq!(c.http.port(), 80);
        assert_eq!(c.tftp.port(), 69);
    }

    #[test]
    fn dhcp_without_interface_is_refused() {
        let f = Flags {
            dhcp: DhcpFlags {
                mode: Some(DhcpMode::Full),
                pool: Some("10.0.0.10-10.0.0.20".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = load(None, env(&[]), &f).unwrap_err().to_string();
        assert!(e.contains("no --interface"), "{e}");
    }

    /// `[pacing]` power-on waves: defaults, the file and the environment, a bad label
    /// key and a value out of range.
    #[test]
    fn pacing_power_on_waves() {
        let c = load(None, env(&[]), &Flags::default()).unwrap();
        assert_eq!(c.pacing, Pacing::default());
        assert_eq!(
            (
                c.pacing.power_on_wave_size,
                c.pacing.power_on_wave_interval_secs
            ),
            (50, 10)
        );
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        std::fs::write(
            &p,
            "[pacing]\npower_on_wave_size = 0\npower_on_wave_by_label = \"rack\"\n",
        )
        .unwrap();
        let c = load(
            Some(&p),
            env(&[("PXED_PACING__POWER_ON_WAVE_INTERVAL_SECS", "30")]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(
            c.pacing,
            Pacing {
                power_on_wave_size: 0,
                power_on_wave_interval_secs: 30,
                power_on_wave_by_label: Some("rack".into()),
                ..Pacing::default()
            }
        );
        let e = load(
            None,
            env(&[("PXED_PACING__POWER_ON_WAVE_BY_LABEL", "rack row")]),
            &Flags::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("invalid value for pacing.power_on_wave_by_label: label key"),
            "{e}"
        );
        let e = load(
            None,
            env(&[("PXED_PACING__POWER_ON_WAVE_INTERVAL_SECS", "0")]),
            &Flags::default(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "pacing.power_on_wave_interval_secs: must be between 1 and 3600 (got 0)"
        );
    }

    #[test]
    fn precedence_file_env_flags() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        std::fs::write(
            &p,
            "hostname_prefix = \"file-\"\ndata_dir = \"/file\"\n[dhcp]\nlease_time = \"2h\"\n",
        )
        .unwrap();
        let e = env(&[("PXED_DATA_DIR", "/env"), ("PXED_DHCP__LEASE_TIME", "30m")]);
        let f = Flags {
            data_dir: Some("/flag".into()),
            ..Default::default()
        };
        let c = load(Some(&p), e.clone(), &f).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/flag"));
        assert_eq!(c.dhcp.lease_time, Duration::from_secs(1800));
        assert_eq!(c.hostname_prefix, "file-");
        let c = load(Some(&p), e, &Flags::default()).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/env"));
    }

    #[test]
    fn unknown_keys_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        std::fs::write(&p, "[dhcp]\npoool = \"x\"\n").unwrap();
        let e = load(Some(&p), env(&[]), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("poool"), "{e}");
        // A key misspelled inside a known section is an error that names the keys.
        let e = load(None, env(&[("PXED_DHCP__POOOL", "1")]), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("dhcp.poool"), "{e}");
        assert!(e.contains("PXED_DHCP__POOL"), "{e}");
    }

    /// A mistake in the file is reported with its file, line and column; `[http]` with a
    /// port (the usual first guess) and a bare port say what `http` takes. A bad value
    /// from the environment says where it came from.
    #[test]
    fn file_errors_have_a_line_and_listen_addresses_a_form() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        let load_file = |text: &str| {
            std::fs::write(&p, text).unwrap();
            load(Some(&p), env(&[]), &Flags::default())
                .unwrap_err()
                .to_string()
        };
        let e = load_file("server_ip = \"10.0.0.2\"\n[dhcp]\nmode = \"ful\"\n");
        assert!(e.contains("pxed.toml") && e.contains("line 3"), "{e}");
        assert!(e.contains("`full`, `proxy`, `off`"), "{e}");
        let e = load_file("[dhcp]\nmode = \"full\"\n\n[http]\nport = 80\n");
        assert!(e.contains("line 4") && e.contains("\"0.0.0.0:80\""), "{e}");
        assert!(e.contains("not a table"), "{e}");
        let e = load_file("tftp = 6969\n");
        assert!(
            e.contains("port alone") && e.contains("\"0.0.0.0:6969\""),
            "{e}"
        );
        std::fs::write(&p, "http = \"127.0.0.1:8080\"\n").unwrap();
        let ok = load(Some(&p), env(&[]), &Flags::default()).unwrap();
        assert_eq!(ok.http, "127.0.0.1:8080".parse().unwrap());
        let e = load(Some(&p), env(&[("PXED_HTTP", "eighty")]), &Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`eighty`") && e.contains("PXED_* variable"),
            "{e}"
        );
    }

    /// Reservations the store could not hold (a MAC or an address twice) or a client
    /// could not use (outside every served subnet) are refused when the config is read,
    /// not by a constraint error when `serve` starts.
    /// A config that loads can still be wrong in ways an operator should hear about;
    /// a plain one has nothing to say.
    #[test]
    fn warnings_name_what_a_valid_config_gets_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        std::fs::write(
            &p,
            "[bmc]\npower_deadline = \"20m\"\n[lifecycle.deadlines]\nreclaiming = \"10m\"\n",
        )
        .unwrap();
        let w = load(Some(&p), env(&[]), &Flags::default())
            .unwrap()
            .warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with(
                "bmc.power_deadline (1200s) is not shorter than the reclaiming deadline (600s)"
            ),
            "{w:?}"
        );
        assert!(
            load(None, env(&[]), &Flags::default())
                .unwrap()
                .warnings()
                .is_empty()
        );
        // Booting places no more than the stream slots: the slots never fill.
        let paced = |booting: &str| {
            load(
                None,
                env(&[
                    ("PXED_PACING__MAX_BOOTING", booting),
                    ("PXED_PACING__MAX_STREAMS", "128"),
                ]),
                &Flags::default(),
            )
            .unwrap()
            .warnings()
        };
        let w = paced("128");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("pacing.max_booting (128) is not above pacing.max_streams (128)"),
            "{w:?}"
        );
        assert!(paced("129").is_empty());
        assert!(paced("0").is_empty(), "0 is no limit");
    }

    #[test]
    fn reservations_are_unique_and_inside_a_served_subnet() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        let load_with = |mode: &str, list: &str| {
            let text = format!(
                "interfaces = [\"eth1\"]\n[dhcp]\nmode = \"{mode}\"\npool = \"10.0.0.100-10.0.0.200\"\n\
                 relay_subnets = [{{ pool = \"10.20.0.100-10.20.0.200\", netmask = \"255.255.255.0\" }}]\n\
                 reservations = [{list}]\n"
            );
            std::fs::write(&p, text).unwrap();
            load(Some(&p), env(&[]), &Flags::default())
        };
        let a = r#"{ mac = "52:54:00:00:00:01", ip = "10.0.0.50" }"#;
        let relayed = r#"{ mac = "52:54:00:00:00:02", ip = "10.20.0.7" }"#;
        let ok = load_with("full", &format!("{a}, {relayed}")).unwrap();
        assert_eq!(ok.dhcp.reservations.len(), 2);
        for (list, want) in [
            (
                r#"{ mac = "52:54:00:00:00:01", ip = "10.0.0.50" }, { mac = "52-54-00-00-00-01", ip = "10.0.0.51" }"#,
                "52:54:00:00:00:01 is reserved twice (10.0.0.50 and 10.0.0.51)",
            ),
            (
                r#"{ mac = "52:54:00:00:00:01", ip = "10.0.0.50" }, { mac = "52:54:00:00:00:03", ip = "10.0.0.50" }"#,
                "10.0.0.50 is reserved for two MACs",
            ),
            (
                r#"{ mac = "52:54:00:00:00:01", ip = "10.9.0.50" }"#,
                "10.9.0.50 (for 52:54:00:00:00:01) is in no subnet",
            ),
        ] {
            let e = load_with("full", list).unwrap_err().to_string();
            assert!(e.contains("dhcp.reservations") && e.contains(want), "{e}");
        }
        // Proxy mode hands out no addresses: only uniqueness is checked, and what it
        // does not use is named for the startup warning.
        let proxy = load_with(
            "proxy",
            r#"{ mac = "52:54:00:00:00:01", ip = "10.9.0.50" }"#,
        )
        .unwrap();
        let ignored = proxy.dhcp.ignored();
        assert_eq!(ignored.len(), 3, "{ignored:?}");
        assert!(
            ignored[0].starts_with("dhcp.pool (10.0.0.100-10.0.0.200) is not used: proxy mode"),
            "{ignored:?}"
        );
        assert!(ignored[2].contains("dhcp.reservations (1)"), "{ignored:?}");
        assert!(ok.dhcp.ignored().is_empty());
    }

    /// NTP servers and SSH keys reach installer configs verbatim: anything but a host
    /// name or address, or one OpenSSH key line, is refused with the key's name.
    #[test]
    fn a_site_is_a_short_name() {
        let ok = load(None, env(&[("PXED_SITE", " room-2.b ")]), &Flags::default()).unwrap();
        assert_eq!(ok.site.as_deref(), Some("room-2.b"));
        assert_eq!(load(None, env(&[]), &Flags::default()).unwrap().site, None);
        for bad in ["", "a b", "x;y", &"r".repeat(65)] {
            let e = load(None, env(&[("PXED_SITE", bad)]), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("site"), "{bad}: {e}");
        }
    }

    #[test]
    fn ntp_servers_and_ssh_keys_are_checked() {
        let ok = load(
            None,
            env(&[("PXED_NTP_SERVERS", "ntp1.site, 10.0.0.5")]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(ok.ntp_servers, ["ntp1.site", "10.0.0.5"]);
        for bad in ["ntp1 --foo", "a\"b", "-x"] {
            let e = load(None, env(&[("PXED_NTP_SERVERS", bad)]), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("ntp_servers"), "{bad}: {e}");
        }
        let e = load(
            None,
            env(&[("PXED_SSH_AUTHORIZED_KEYS", "not-a-key")]),
            &Flags::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("ssh_authorized_keys") && e.contains("key type"),
            "{e}"
        );
    }

    /// Client and wrapper variables share the `PXED_` prefix; they must never stop the
    /// server (the README tells operators to export `PXED_BMC_PASSWORD`).
    #[test]
    fn foreign_pxed_variables_are_left_alone() {
        let vars = env(&[
            ("PXED_BMC_PASSWORD", "s3cret"),
            ("PXED_URL", "http://10.0.0.2"),
            ("PXED_WRAPPER_MODE", "x"),
            ("PXED_DATA_DIR", "/env"),
            ("HOME", "/root"),
        ]);
        let (c, ignored) = load_layers(None, vars, &Flags::default()).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/env"));
        assert_eq!(
            ignored,
            ["PXED_BMC_PASSWORD", "PXED_URL", "PXED_WRAPPER_MODE"]
        );
    }

    /// `PXED_DHCP` names a section, not a key: an error, never a panic, and never
    /// silently ignored (it once was, because the flag layer always wrote `[dhcp]`).
    #[test]
    fn a_section_set_as_a_value_is_an_error() {
        for vars in [
            env(&[("PXED_DHCP", "full")]),
            env(&[("PXED_DHCP", "x"), ("PXED_DHCP__MODE", "full")]),
            env(&[("PXED_DHCP__MODE", "full"), ("PXED_DHCP", "x")]),
            env(&[("PXED_LIFECYCLE__DEADLINES", "1h")]),
        ] {
            let e = load(None, vars.clone(), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("PXED_DHCP__MODE") || e.contains("deadlines"),
                "{vars:?}: {e}"
            );
        }
    }

    /// A flag that was not given does not override the environment or the file.
    #[test]
    fn only_given_flags_override() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        std::fs::write(&p, "[dhcp]\nlease_time = \"2h\"\n").unwrap();
        let c = load(
            Some(&p),
            env(&[("PXED_DHCP__MODE", "proxy"), ("PXED_INTERFACES", "lo")]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(c.dhcp.mode, DhcpMode::Proxy);
        assert_eq!(c.dhcp.lease_time, Duration::from_secs(7200));
        let f = Flags {
            dhcp: DhcpFlags {
                lease_time: Some("3h".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let c = load(
            Some(&p),
            env(&[("PXED_DHCP__MODE", "proxy"), ("PXED_INTERFACES", "lo")]),
            &f,
        )
        .unwrap();
        assert_eq!(c.dhcp.mode, DhcpMode::Proxy);
        assert_eq!(c.dhcp.lease_time, Duration::from_secs(3 * 3600));
    }

    /// Every key the environment may set is a key of the config file.
    #[test]
    fn env_keys_are_config_keys() {
        for key in ENV_KEYS {
            let var = format!(
                "PXED_{}",
                key.replace(".*", "__x")
                    .replace('.', "__")
                    .to_ascii_uppercase()
            );
            if let Err(e) = load(None, env(&[(&var, "1")]), &Flags::default()) {
                let e = e.to_string();
                assert!(!e.contains("unknown field"), "{var}: {e}");
                assert!(!e.contains("unknown environment"), "{var}: {e}");
            }
        }
    }

    #[test]
    fn pool_outside_subnet_is_refused() {
        let f = Flags {
            interfaces: vec!["eth0".into()],
            dhcp: DhcpFlags {
                mode: Some(DhcpMode::Full),
                pool: Some("10.0.0.10-10.0.1.20".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(load(None, env(&[]), &f).is_err());
    }

    #[test]
    fn deadlines_only_for_in_progress_states() {
        let ok = load(
            None,
            env(&[("PXED_LIFECYCLE__DEADLINES__INSTALLING", "2h")]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(
            ok.lifecycle.deadlines[&State::Installing],
            Duration::from_secs(7200)
        );
        for (k, msg) in [("AVAILABLE", "resting state"), ("BOGUS", "not a state")] {
            let e = load(
                None,
                env(&[(&format!("PXED_LIFECYCLE__DEADLINES__{k}"), "1h")]),
                &Flags::default(),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(msg), "{e}");
        }
    }

    #[test]
    fn token_is_masked() {
        let c = load(
            None,
            env(&[("PXED_API_TOKEN", "s3cret")]),
            &Flags::default(),
        )
        .unwrap();
        let s = toml::to_string(&c).unwrap();
        assert!(!s.contains("s3cret"));
        assert!(s.contains("********"));
    }

    /// `[[webhooks.targets]]`: a secret from the file or `secret_file`, states by name,
    /// each URL once; the secret shows neither in `check-config` nor in `Debug`.
    #[test]
    fn webhook_targets_are_validated_and_their_secrets_masked() {
        let dir = tempfile::tempdir().unwrap();
        let secret_file = dir.path().join("hook.secret");
        std::fs::write(&secret_file, "from-file-s3cret\n").unwrap();
        let load_text = |text: &str| {
            let p = dir.path().join("pxed.toml");
            std::fs::write(&p, text).unwrap();
            load(Some(&p), env(&[]), &Flags::default())
        };
        let c = load_text(&format!(
            r#"[webhooks]
backoff = "2s"
[[webhooks.targets]]
url = "https://a.example/hook"
secret = "inline-s3cret"
states = ["available", "failed"]
[[webhooks.targets]]
url = "http://b.example:8088/"
secret_file = "{}"
"#,
            secret_file.display()
        ))
        .unwrap();
        let w = &c.webhooks;
        assert_eq!(w.backoff, Duration::from_secs(2));
        assert_eq!(w.targets[0].states, [State::Available, State::Failed]);
        assert_eq!(w.targets[1].secret, "from-file-s3cret");
        assert!(w.targets[1].states.is_empty());
        let shown = format!("{}{c:?}", toml::to_string(&c).unwrap());
        assert!(!shown.contains("s3cret"), "{shown}");
        for (bad, why) in [
            ("url = \"ftp://x/\"\nsecret = \"k\"", "not an http(s) URL"),
            ("url = \"http://x/\"", "set one of secret or secret_file"),
            ("url = \"http://x/\"\nsecret = \"\"", "the secret is empty"),
            (
                "url = \"http://x/\"\nsecret = \"k\"\nstates = [\"done\"]",
                "is not a state",
            ),
        ] {
            let e = load_text(&format!("[[webhooks.targets]]\n{bad}\n")).unwrap_err();
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
        let twice = "[[webhooks.targets]]\nurl = \"http://x/\"\nsecret = \"k\"\n";
        let e = load_text(&format!("{twice}{twice}")).unwrap_err();
        assert!(e.to_string().contains("listed twice"), "{e}");
        let e = load_text("[webhooks]\nbackoff = \"10m\"\nmax_backoff = \"1m\"\n").unwrap_err();
        assert!(
            e.to_string().contains("shorter than webhooks.backoff"),
            "{e}"
        );
    }

    #[test]
    fn durations_and_macs() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("5x").is_err());
        assert_eq!(
            normalize_mac("52-54-00-AB-cd-EF").as_deref(),
            Some("52:54:00:ab:cd:ef")
        );
        assert!(normalize_mac("52:54:00").is_none());
    }

    /// Issue 10, finding 7: `99999999999999999999d` panicked in `Duration::from_secs_f64`.
    #[test]
    fn hostile_durations_are_errors_not_panics() {
        for s in [
            "99999999999999999999d",
            "18446744073709551616s",
            "213503982334602d",
            "99999999999999999999999999999999999999999999999999ms",
            "NaN",
            "inf",
            "-inf",
            "-1s",
            "+5s",
            "1e400",
            "1e9s",
            "",
            ".",
            "1.2.3s",
            "5 m",
            "5y",
            "\u{0663}s",
        ] {
            let r = std::panic::catch_unwind(|| parse_duration(s));
            assert!(matches!(r, Ok(Err(_))), "{s:?}: {r:?}");
        }
        let r = std::panic::catch_unwind(|| {
            load(
                None,
                env(&[("PXED_DHCP__LEASE_TIME", "99999999999999999999d")]),
                &Flags::default(),
            )
        });
        let e = r.expect("no panic").unwrap_err().to_string();
        assert!(e.contains("dhcp.lease_time"), "{e}");
    }

    /// Issue 10, finding 7: accepted by `check-config`, then tokio's semaphore panicked
    /// at `serve` (its limit is `usize::MAX >> 3`).
    #[test]
    fn pacing_keys_from_file_and_env_with_ranges() {
        let c = load(None, env(&[]), &Flags::default()).unwrap();
        assert_eq!(c.pacing, Pacing::default());
        assert_eq!(c.pacing.offer_delay_max(), Duration::from_secs(3));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        std::fs::write(
            &p,
            "[pacing]\nmax_first_stage = 5\nmax_streams = 7\ntransfer_nice = 0\nmax_booting = 0\n",
        )
        .unwrap();
        let c = load(
            Some(&p),
            env(&[("PXED_PACING__OFFER_DELAY_MAX_MS", "0")]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(
            c.pacing,
            Pacing {
                max_first_stage: 5,
                max_streams: 7,
                offer_delay_max_ms: 0,
                transfer_nice: 0,
                max_booting: 0,
                ..Pacing::default()
            }
        );
        for (var, v, want) in [
            (
                "PXED_PACING__OFFER_DELAY_MAX_MS",
                "20000",
                "pacing.offer_delay_max_ms: must be between 0 and 10000 (got 20000)",
            ),
            (
                "PXED_PACING__MAX_FIRST_STAGE",
                "0",
                "pacing.max_first_stage: must be between 1 and 65536 (got 0)",
            ),
            (
                "PXED_PACING__MAX_STREAMS",
                "-1",
                "pacing.max_streams: must be between 1 and 65536 (got -1)",
            ),
            (
                "PXED_PACING__TRANSFER_NICE",
                "20",
                "pacing.transfer_nice: must be between 0 and 19 (got 20)",
            ),
        ] {
            let e = load(None, env(&[(var, v)]), &Flags::default()).unwrap_err();
            assert_eq!(e.to_string(), want);
        }
        std::fs::write(&p, "[pacing]\nmax_first_stages = 5\n").unwrap();
        assert!(load(Some(&p), env(&[]), &Flags::default()).is_err());
    }

    #[test]
    fn huge_max_transfers_is_refused() {
        let e = load(
            None,
            env(&[("PXED_TFTP_SERVER__MAX_TRANSFERS", "4611686018427387904")]),
            &Flags::default(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "tftp_server.max_transfers: must be between 1 and 65536 (got 4611686018427387904)"
        );
        let Some(Range::Count { max, .. }) = range_of("tftp_server.max_transfers") else {
            panic!("max_transfers has no count range");
        };
        assert!(max as usize <= tokio::sync::Semaphore::MAX_PERMITS);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pxed.toml");
        for (v, ok) in [("-1", false), ("0", false), ("1", true), ("65536", true)] {
            std::fs::write(&p, format!("[tftp_server]\nmax_transfers = {v}\n")).unwrap();
            let r = load(Some(&p), env(&[]), &Flags::default());
            assert_eq!(r.is_ok(), ok, "{v}: {r:?}");
        }
    }

    /// Issue 10, finding 7: a zero TFTP timeout was accepted and every transfer failed.
    #[test]
    fn zero_tftp_timeout_is_refused() {
        for (v, ok) in [
            ("0s", false),
            ("0", false),
            ("99ms", false),
            ("100ms", true),
        ] {
            let r = load(
                None,
                env(&[("PXED_TFTP_SERVER__TIMEOUT", v)]),
                &Flags::default(),
            );
            match r {
                Ok(c) => assert!(ok && c.tftp_server.timeout == parse_duration(v).unwrap()),
                Err(e) => assert!(
                    !ok && e
                        .to_string()
                        .starts_with("tftp_server.timeout: must be between 100ms and"),
                    "{v}: {e}"
                ),
            }
        }
    }

    /// A huge lease time names the key and its range, from each layer.
    #[test]
    fn huge_lease_time_names_its_range() {
        let want = "dhcp.lease_time: must be between 1m and 365d (got 99999999999999999999d)";
        let e = load(
            None,
            env(&[("PXED_DHCP__LEASE_TIME", "99999999999999999999d")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), want);
        let f = Flags {
            dhcp: DhcpFlags {
                lease_time: Some("99999999999999999999d".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(load(None, env(&[]), &f).unwrap_err().to_string(), want);
        // A bare number from the environment is seconds (it once was a type error).
        let c = load(
            None,
            env(&[("PXED_DHCP__LEASE_TIME", "3600")]),
            &Flags::default(),
        )
        .unwrap();
        assert_eq!(c.dhcp.lease_time, Duration::from_secs(3600));
    }

    /// Each row of [`BOUNDS`] is enforced at both ends, through the environment: the
    /// bound itself is not refused as out of range, one step past it is.
    #[test]
    fn every_range_is_enforced_at_both_ends() {
        for (pattern, range) in BOUNDS {
            // A map key stands for any of its keys: take one that validation accepts.
            let key = pattern.replace('*', State::Installing.as_str());
            let var = format!("PXED_{}", key.replace('.', "__").to_ascii_uppercase());
            let (inside, outside) = match *range {
                Range::Duration { min, max } => {
                    let ns = Duration::from_nanos(1);
                    (
                        [fmt_duration(min), fmt_duration(max)],
                        [fmt_duration(min - ns), fmt_duration(max + ns)],
                    )
                }
                Range::Count { min, max } => (
                    [min.to_string(), max.to_string()],
                    [(min - 1).to_string(), (max + 1).to_string()],
                ),
            };
            let refusal = format!("{key}: must be between");
            for v in inside {
                if let Err(e) = load(None, env(&[(&var, &v)]), &Flags::default()) {
                    assert!(!e.to_string().contains(&refusal), "{var}={v}: {e}");
                }
            }
            for v in outside {
                let e = load(None, env(&[(&var, &v)]), &Flags::default()).unwrap_err();
                assert!(e.to_string().starts_with(&refusal), "{var}={v}: {e}");
            }
        }
    }

    /// Every number `check-config` prints has a row in [`BOUNDS`], every row is a key the
    /// environment can set (so the property test reaches it), and the defaults are in
    /// range. A key added without a range fails here.
    #[test]
    fn every_number_in_the_schema_has_a_range() {
        for flags in [
            Flags::default(),
            Flags {
                demo: true,
                ..Default::default()
            },
        ] {
            let c = load(None, env(&[]), &flags).unwrap();
            let mut seen = Vec::new();
            walk_leaves(&toml::Table::try_from(&c).unwrap(), "", &mut |key, v| {
                let numeric = v.is_integer()
                    || v.is_float()
                    || v.as_str().is_some_and(|s| parse_duration(s).is_ok());
                if numeric {
                    assert!(
                        range_of(key).is_some(),
                        "{key} = {v} has no range in BOUNDS"
                    );
                    seen.push(key.to_string());
                }
            });
            assert_bounds(&c);
            for (pattern, _) in BOUNDS {
                assert!(ENV_KEYS.contains(pattern), "{pattern} is not in ENV_KEYS");
                assert!(
                    seen.iter().any(|k| range_of(k)
                        == range_of(&pattern.replace('*', State::Installing.as_str()))),
                    "{pattern} is not in the config"
                );
            }
        }
    }

    /// Arbitrary values for arbitrary keys of the schema, through the file, the
    /// environment and the `--lease-time` flag: the loader answers `Ok` or `Err` and
    /// never panics, and an `Ok` config is inside [`BOUNDS`]. Keys come from
    /// [`ENV_KEYS`], so a key added later is covered without touching this test.
    mod schema_property {
        use super::*;
        use proptest::prelude::*;

        /// Keys set only in the file (lists of tables).
        const FILE_ONLY_KEYS: &[&str] = &[
            "dhcp.reservations",
            "dhcp.relay_subnets",
            "webhooks.targets",
            "profiles",
        ];

        /// A map key for `*`: a state, a MAC or anything.
        fn map_key() -> impl Strategy<Value = String> {
            let states: Vec<String> = State::ALL.iter().map(|s| s.to_string()).collect();
            prop_oneof![
                prop::sample::select(states),
                "52:54:00:[0-9a-f]{2}:[0-9a-f]{2}:[0-9a-f]{2}",
                "[a-z_]{1,12}",
            ]
        }

        fn key(keys: Vec<&'static str>) -> impl Strategy<Value = String> {
            (prop::sample::select(keys), map_key()).prop_map(|(k, m)| k.replace('*', &m))
        }

        /// Text as an operator, a script or an attacker might write it.
        fn text() -> BoxedStrategy<String> {
            let odd = [
                "NaN",
                "inf",
                "-inf",
                "-0",
                "1e400",
                "",
                "  ",
                ".",
                "0",
                "0s",
                "99999999999999999999d",
                "18446744073709551616s",
                "213503982334602d",
                "4611686018427387904",
                "-9223372036854775808",
                "9223372036854775807",
                "true",
                "[1, 2]",
                "{ a = 1 }",
                "\u{0663}s",
                "1_000s",
                "full",
                "proxy",
                "10.0.0.10-10.0.0.20",
                "255.255.255.0",
            ];
            prop_oneof![
                2 => "[-+]?[0-9]{0,24}(\\.[0-9]{0,20})?( )?(ms|s|m|h|d|us|ns|y|w|e9|E|)",
                6 => "[0-9]{1,4}(ms|s|m|h|d)?",
                2 => prop::sample::select(odd.to_vec()).prop_map(String::from),
                1 => any::<i64>().prop_map(|n| n.to_string()),
                1 => (0i64..100_000).prop_map(|n| n.to_string()),
                1 => any::<f64>().prop_map(|f| f.to_string()),
                1 => ".{0,24}",
            ]
            .boxed()
        }

        /// Any TOML value, right type or wrong, nested a little.
        fn value() -> impl Strategy<Value = toml::Value> {
            let leaf = prop_oneof![
                6 => text().prop_map(toml::Value::String),
                1 => any::<i64>().prop_map(toml::Value::Integer),
                2 => (0i64..100_000).prop_map(toml::Value::Integer),
                1 => any::<f64>().prop_map(toml::Value::Float),
                1 => any::<bool>().prop_map(toml::Value::Boolean),
            ];
            leaf.prop_recursive(2, 8, 3, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..3).prop_map(toml::Value::Array),
                    prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                        .prop_map(|m| toml::Value::Table(m.into_iter().collect())),
                ]
            })
        }

        fn insert(t: &mut toml::Table, key: &str, v: toml::Value) {
            let mut parts: Vec<&str> = key.split('.').collect();
            let last = parts.pop().unwrap_or_default();
            let mut cur = t;
            for p in parts {
                let e = cur
                    .entry(p)
                    .or_insert_with(|| toml::Value::Table(Default::default()));
                if !e.is_table() {
                    *e = toml::Value::Table(Default::default());
                }
                let toml::Value::Table(next) = e else {
                    unreachable!("made a table above")
                };
                cur = next;
            }
            cur.insert(last.to_string(), v);
        }

        fn env_var(key: &str) -> String {
            format!("PXED_{}", key.replace('.', "__").to_ascii_uppercase())
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 512,
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            #[test]
            fn any_value_for_any_key_loads_or_errs_never_panics(
                file in prop::collection::vec(
                    (key([ENV_KEYS, FILE_ONLY_KEYS].concat()), value()),
                    0..4,
                ),
                vars in prop::collection::vec((key(ENV_KEYS.to_vec()), text()), 0..4),
                lease_flag in prop::option::of(text()),
            ) {
                let mut table = toml::Table::new();
                for (k, v) in &file {
                    insert(&mut table, k, v.clone());
                }
                let text = toml::to_string(&table);
                prop_assume!(text.is_ok(), "not TOML: {:?}", table);
                let text = text.unwrap_or_default();
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("pxed.toml");
                std::fs::write(&path, &text).unwrap();
                let vars: Vec<(String, String)> =
                    vars.iter().map(|(k, v)| (env_var(k), v.clone())).collect();
                let flags = Flags {
                    dhcp: DhcpFlags {
                        lease_time: lease_flag,
                        ..Default::default()
                    },
                    ..Default::default()
                };
                for (file, vars, flags) in [
                    (Some(path.as_path()), vec![], Flags::default()),
                    (None, vars.clone(), Flags::default()),
                    (Some(path.as_path()), vars.clone(), flags),
                ] {
                    let r = std::panic::catch_unwind(|| load(file, vars.clone(), &flags));
                    prop_assert!(
                        r.is_ok(),
                        "load panicked\nfile:\n{text}\nenv: {vars:?}\nflags: {flags:?}"
                    );
                    if let Ok(Ok(c)) = r {
                        assert_bounds(&c);
                    }
                }
            }
        }
    }

    /// Calls `f` with the dotted path and value of every leaf (arrays count as leaves).
    fn walk_leaves(t: &toml::Table, prefix: &str, f: &mut dyn FnMut(&str, &toml::Value)) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => walk_leaves(t, &key, f),
                v => f(&key, v),
            }
        }
    }

    /// Panics unless every value of `c` that [`BOUNDS`] names is inside its range and
    /// every integer has a row there.
    fn assert_bounds(c: &Config) {
        walk_leaves(&toml::Table::try_from(c).unwrap(), "", &mut |key, v| {
            let ok = match (range_of(key), v) {
                // Integers are counts: each needs a row.
                (None, toml::Value::Integer(_)) => false,
                (None, _) => return,
                (Some(Range::Count { min, max }), toml::Value::Integer(n)) => {
                    (min..=max).contains(n)
                }
                (Some(Range::Duration { min, max }), toml::Value::String(s)) => {
                    parse_duration(s).is_ok_and(|d| (min..=max).contains(&d))
                }
                _ => false,
            };
            assert!(ok, "{key} = {v} is outside {:?}", range_of(key));
        });
    }

    /// Decimals are exact, and what `check-config` prints reads back to the same value.
    #[test]
    fn durations_are_exact_and_round_trip() {
        for (s, d) in [
            ("1.5h", Duration::from_secs(5400)),
            ("0.1s", Duration::from_millis(100)),
            (".5m", Duration::from_secs(30)),
            ("2.", Duration::from_secs(2)),
            ("0.000000001s", Duration::from_nanos(1)),
            ("0.0000000001s", Duration::ZERO),
            ("18446744073709551615s", Duration::from_secs(u64::MAX)),
        ] {
            assert_eq!(parse_duration(s), Ok(d), "{s}");
        }
        for (d, s) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(5400), "90m"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_nanos(1_000_000_001), "1.000000001s"),
            (Duration::from_secs(u64::MAX), "18446744073709551615s"),
        ] {
            assert_eq!(fmt_duration(d), s);
            assert_eq!(parse_duration(s), Ok(d), "{s}");
        }
    }

    #[test]
    fn bmc_section_from_env_and_file() {
        let c = load(None, env(&[]), &Flags::default()).unwrap();
        assert_eq!(c.bmc.call_policy(), crate::bmc::CallPolicy::default());
        let c = load(
            None,
            env(&[
                ("PXED_BMC__POWER_DEADLINE", "3s"),
                ("PXED_BMC__RESTART_OBSERVE", "500ms"),
                ("PXED_BMC__RETRIES", "0"),
            ]),
            &Flags::default(),
        )
        .unwrap();
        let p = c.bmc.call_policy();
        assert_eq!(p.power_deadline, Duration::from_secs(3));
        assert_eq!(p.restart_observe, Duration::from_millis(500));
        assert_eq!(p.retries, 0);
        assert_eq!(p.request_timeout, Duration::from_secs(20));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pxed.toml");
        std::fs::write(
            &f,
            "[bmc]\nrequest_timeout = \"2s\"\npoll_interval = \"100ms\"\n",
        )
        .unwrap();
        let c = load(Some(&f), env(&[]), &Flags::default()).unwrap();
        assert_eq!(c.bmc.request_timeout, Duration::from_secs(2));
        assert_eq!(c.bmc.poll_interval, Duration::from_millis(100));
    }

    #[test]
    fn bmc_section_refuses_nonsense() {
        for (var, val, key) in [
            ("PXED_BMC__TIMEOUT", "1s", "timeout"),
            ("PXED_BMC__POLL_INTERVAL", "0s", "bmc.poll_interval"),
            ("PXED_BMC__POWER_DEADLINE", "soon", "bmc.power_deadline"),
            ("PXED_BMC__RESTART_OBSERVE", "1h", "bmc.restart_observe"),
        ] {
            let e = load(None, env(&[(var, val)]), &Flags::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{var}={val}: {e}");
        }
    }
}
