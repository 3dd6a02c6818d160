//! BMC drivers (Redfish, IPMI): set a one-time network boot, read it back, power-cycle.
//!
//! Reclaiming a node only works if it really reboots into the network, and BMCs fail in
//! quiet ways: they answer 200 and ignore the override, reject fields other vendors
//! require, time out, or apply a reset long after they acknowledged it. Every driver
//! therefore reads back what it wrote and observes the power state it asked for, and
//! ends in a typed [`BmcError`] when it cannot prove the action landed.
//!
//! Power rule (both drivers), for `power_cycle`:
//! - node Off: power it on and wait until the BMC reports On.
//! - node On, a restart-style reset (Redfish `PowerCycle`/`ForceRestart`, IPMI chassis
//!   cycle) answered with success: poll. A transition (any state other than On) followed
//!   by On is success. A transition not followed by On before `power_deadline` is
//!   [`BmcError::PowerDidNotChange`]. When no transition is seen within
//!   `restart_observe` and the BMC still says On, the reset is accepted (2xx + final On)
//!   with a warning: a fast restart and an ignored one look the same from outside.
//! - node On, no restart offered: off, wait for Off, on, wait for On; each wait bounded by
//!   `power_deadline`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

/// Implements [`Bmc`] for a driver type from its inherent `async fn`s (`read_power`,
/// `do_set_boot`, `read_override`, `do_cycle`, `do_power`, `do_check`, `do_close`):
/// the trait boxes their futures so that it stays object-safe, and this is the one
/// place that does it. Trait items the driver overrides besides follow the type.
macro_rules! impl_bmc {
    ($t:ty $(, $extra:item)* $(,)?) => {
        impl $crate::bmc::Bmc for $t {
            fn driver(&self) -> Driver {
                D
            }
            fn power_state(&self) -> BoxFuture<'_, Result<PowerState, BmcError>> {
                Box::pin(self.read_power())
            }
            fn set_next_boot(
                &self,
                next: NextBoot,
            ) -> BoxFuture<'_, Result<BootOverride, BmcError>> {
                Box::pin(self.do_set_boot(next))
            }
            fn boot_override(&self) -> BoxFuture<'_, Result<BootOverride, BmcError>> {
                Box::pin(self.read_override())
            }
            fn power_cycle(&self) -> BoxFuture<'_, Result<(), BmcError>> {
                Box::pin(self.do_cycle())
            }
            fn clear_boot_override(&self) -> BoxFuture<'_, Result<BootOverride, BmcError>> {
                Box::pin(self.do_clear_boot())
            }
            fn power_on(&self) -> BoxFuture<'_, Result<(), BmcError>> {
                Box::pin(self.do_power(PowerState::On))
            }
            fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>> {
                Box::pin(self.do_power(PowerState::Off))
            }
            fn check(&self) -> BoxFuture<'_, Result<CheckReport, BmcError>> {
                Box::pin(self.do_check())
            }
            fn close(&self) -> BoxFuture<'_, ()> {
                Box::pin(self.do_close())
            }
            $($extra)*
        }
    };
}

pub mod ipmi;
pub mod pool;
pub mod redfish;

pub use crate::model::Driver;

/// A secret string (BMC password). Debug and Display print `********`; read it with
/// [`Secret::expose`] only where it goes on the wire.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself, for the wire only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("********")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("********")
    }
}

/// How the Redfish driver trusts the BMC's TLS certificate (BMCs use self-signed ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsPolicy {
    /// Pin the SHA-256 of the leaf certificate. `None` = first use: any certificate is
    /// accepted and its fingerprint is reported by [`Bmc::tls_fingerprint`] so the caller
    /// can store it; `Some(hex)` = any other certificate is
    /// [`BmcError::CertificateMismatch`].
    Pinned(Option<String>),
    /// Accept any certificate (labs only; set per node, logged on every connection).
    Insecure,
}

/// Timeouts, retries and deadlines for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallPolicy {
    /// Bound on one request (one HTTP exchange, one IPMI command incl. retransmits).
    pub request_timeout: Duration,
    /// Extra attempts after a retryable failure (unreachable, timeout, 5xx).
    pub retries: u32,
    /// First backoff between attempts; doubles each time.
    pub backoff: Duration,
    /// Attempts to write the boot override before [`BmcError::OverrideNotApplied`].
    pub override_attempts: u32,
    /// How long a power action may take to show in the power state.
    pub power_deadline: Duration,
    /// How long to look for a transition after a restart-style reset (see module docs).
    pub restart_observe: Duration,
    /// Interval between power-state polls.
    pub poll_interval: Duration,
}

impl Default for CallPolicy {
    fn default() -> Self {
        CallPolicy {
            request_timeout: Duration::from_secs(20),
            retries: 3,
            backoff: Duration::from_millis(500),
            override_attempts: 3,
            power_deadline: Duration::from_secs(180),
            restart_observe: Duration::from_secs(15),
            poll_interval: Duration::from_secs(2),
        }
    }
}

/// Everything needed to reach one node's BMC.
#[derive(Debug, Clone)]
pub struct BmcEndpoint {
    /// Protocol.
    pub driver: Driver,
    /// Redfish: `https://host[:port]` (or `http://` for labs/emulators); a bare host means
    /// https. IPMI: `host[:port]` (default port 623).
    pub address: String,
    /// BMC user.
    pub username: String,
    /// BMC password; never logged.
    pub password: Secret,
    /// Redfish ComputerSystem id (or its full `@odata.id` path).
    pub system_id: Option<String>,
    /// Redfish: pick the system that has an EthernetInterface with this MAC.
    pub match_mac: Option<String>,
    /// Redfish: pick the system with this UUID.
    pub match_uuid: Option<String>,
    /// TLS trust (Redfish over https).
    pub tls: TlsPolicy,
    /// Timeouts and retries.
    pub policy: CallPolicy,
}

/// Power state as the BMC reports it. On the wire: its name (`"On"`, `"Paused"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum PowerState {
    /// Powered on.
    On,
    /// Powered off.
    Off,
    /// Redfish `PoweringOn`.
    PoweringOn,
    /// Redfish `PoweringOff`.
    PoweringOff,
    /// Anything else the BMC said (e.g. Redfish `Paused`).
    Other(String),
}

impl PowerState {
    /// The state Redfish (and `Display`) names `name`; any other name is kept as
    /// [`PowerState::Other`].
    pub fn from_name(name: &str) -> Self {
        match name {
            "On" => PowerState::On,
            "Off" => PowerState::Off,
            "PoweringOn" => PowerState::PoweringOn,
            "PoweringOff" => PowerState::PoweringOff,
            o => PowerState::Other(o.into()),
        }
    }
}

impl From<String> for PowerState {
    fn from(name: String) -> Self {
        PowerState::from_name(&name)
    }
}

impl From<PowerState> for String {
    fn from(p: PowerState) -> Self {
        p.to_string()
    }
}

impl fmt::Display for PowerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PowerState::On => f.write_str("On"),
            PowerState::Off => f.write_str("Off"),
            PowerState::PoweringOn => f.write_str("PoweringOn"),
            PowerState::PoweringOff => f.write_str("PoweringOff"),
            PowerState::Other(s) => write!(f, "{s}"),
        }
    }
}

/// Where the next boot should go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootTarget {
    /// Network boot via PXE.
    Pxe,
    /// UEFI HTTP boot; `url` is written to `HttpBootUri` where the BMC has it.
    UefiHttp {
        /// URL of the boot program.
        url: String,
    },
}

/// Firmware boot mode for the override.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BootMode {
    /// UEFI.
    Uefi,
    /// Legacy BIOS.
    Legacy,
}

/// A boot override request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextBoot {
    /// Device.
    pub target: BootTarget,
    /// Firmware mode.
    pub mode: BootMode,
    /// Next boot only (reclaim always uses `true`).
    pub once: bool,
}

impl NextBoot {
    /// One-time UEFI PXE boot, the reclaim default.
    pub fn pxe_once() -> Self {
        NextBoot {
            target: BootTarget::Pxe,
            mode: BootMode::Uefi,
            once: true,
        }
    }
}

/// Whether the override is active, as read back. On the wire: its Redfish name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum OverrideEnabled {
    /// Not active.
    Disabled,
    /// Next boot only.
    Once,
    /// Every boot.
    Continuous,
    /// Something else.
    Other(String),
}

impl OverrideEnabled {
    /// The value Redfish's `BootSourceOverrideEnabled` names `name`; any other name is
    /// kept as [`OverrideEnabled::Other`].
    pub fn from_name(name: &str) -> Self {
        match name {
            "Disabled" => OverrideEnabled::Disabled,
            "Once" => OverrideEnabled::Once,
            "Continuous" => OverrideEnabled::Continuous,
            o => OverrideEnabled::Other(o.into()),
        }
    }

    /// The Redfish name.
    pub fn as_str(&self) -> &str {
        match self {
            OverrideEnabled::Disabled => "Disabled",
            OverrideEnabled::Once => "Once",
            OverrideEnabled::Continuous => "Continuous",
            OverrideEnabled::Other(o) => o,
        }
    }
}

impl From<String> for OverrideEnabled {
    fn from(name: String) -> Self {
        OverrideEnabled::from_name(&name)
    }
}

impl From<OverrideEnabled> for String {
    fn from(e: OverrideEnabled) -> Self {
        e.as_str().to_string()
    }
}

/// The boot override as the BMC reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootOverride {
    /// Target device in the BMC's words (`Pxe`, `Hdd`, `UefiHttp`, `None`, ...).
    pub target: String,
    /// Enabled state.
    pub enabled: OverrideEnabled,
    /// Firmware mode where reported.
    pub mode: Option<BootMode>,
    /// Redfish `HttpBootUri` where reported.
    pub http_uri: Option<String>,
}

impl BootOverride {
    /// Whether this override still sends the next boot to the network.
    pub fn boots_network(&self) -> bool {
        self.enabled != OverrideEnabled::Disabled
            && matches!(self.target.as_str(), "Pxe" | "UefiHttp")
    }
}

impl fmt::Display for BootOverride {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "target={} enabled={:?}", self.target, self.enabled)?;
        if let Some(m) = self.mode {
            write!(f, " mode={m:?}")?;
        }
        if let Some(u) = &self.http_uri {
            write!(f, " uri={u}")?;
        }
        Ok(())
    }
}

/// Whether the configured credentials were accepted. On the wire:
/// `{"result": "accepted", "how": ...}` or `{"result": "refused", "message": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Credentials {
    /// Accepted; `how` says which auth was used (session, basic, RAKP cipher suite).
    Accepted {
        /// Auth method.
        how: String,
    },
    /// Refused, with the BMC's message.
    Refused {
        /// What the BMC said.
        message: String,
    },
}

/// What a BMC advertises, for `pxed bmc check`; the API's answer carries it (see
/// [`crate::wire::BmcCheck`]). It never holds a secret. Fields a peer of another
/// version leaves out read as empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    /// Driver.
    pub driver: Driver,
    /// Address as configured.
    pub address: String,
    /// Credential result.
    pub credentials: Credentials,
    /// Product / firmware / system the BMC describes itself as.
    #[serde(default)]
    pub identity: Option<String>,
    /// Redfish ComputerSystem path that was selected.
    #[serde(default)]
    pub system: Option<String>,
    /// Current power state.
    #[serde(default)]
    pub power: Option<PowerState>,
    /// Reset types offered (Redfish `ResetType@Redfish.AllowableValues`, IPMI chassis control).
    #[serde(default)]
    pub reset_types: Vec<String>,
    /// The reset that `power_cycle` would use first.
    #[serde(default)]
    pub cycle_plan: Option<String>,
    /// Boot override targets offered.
    #[serde(default)]
    pub boot_targets: Vec<String>,
    /// Boot modes offered (empty when the BMC has no mode field).
    #[serde(default)]
    pub boot_modes: Vec<String>,
    /// Current override.
    #[serde(default)]
    pub boot_override: Option<BootOverride>,
    /// SHA-256 of the TLS leaf certificate, when https.
    #[serde(default)]
    pub tls_fingerprint: Option<String>,
    /// Warnings for the technician.
    #[serde(default)]
    pub notes: Vec<String>,
}

impl CheckReport {
    /// A report of credentials accepted (by `how`) and nothing read yet; the driver
    /// fills in what the BMC advertises.
    pub fn new(driver: Driver, address: &str, how: String) -> Self {
        CheckReport {
            driver,
            address: address.to_string(),
            credentials: Credentials::Accepted { how },
            identity: None,
            system: None,
            power: None,
            reset_types: vec![],
            cycle_plan: None,
            boot_targets: vec![],
            boot_modes: vec![],
            boot_override: None,
            tls_fingerprint: None,
            notes: vec![],
        }
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[String]| {
            if v.is_empty() {
                "(none advertised)".to_string()
            } else {
                v.join(", ")
            }
        };
        writeln!(f, "BMC {} ({})", self.address, self.driver)?;
        match &self.credentials {
            Credentials::Accepted { how } => writeln!(f, "  credentials:  OK ({how})")?,
            Credentials::Refused { message } => writeln!(f, "  credentials:  REFUSED: {message}")?,
        }
        if let Some(i) = &self.identity {
            writeln!(f, "  identity:     {i}")?;
        }
        if let Some(s) = &self.system {
            writeln!(f, "  system:       {s}")?;
        }
        if let Some(p) = &self.power {
            writeln!(f, "  power:        {p}")?;
        }
        if let Credentials::Accepted { .. } = self.credentials {
            writeln!(f, "  reset types:  {}", list(&self.reset_types))?;
            if let Some(p) = &self.cycle_plan {
                writeln!(f, "  power cycle:  {p}")?;
            }
            writeln!(f, "  boot targets: {}", list(&self.boot_targets))?;
            writeln!(f, "  boot modes:   {}", list(&self.boot_modes))?;
            if let Some(o) = &self.boot_override {
                writeln!(f, "  override now: {o}")?;
            }
        }
        if let Some(fp) = &self.tls_fingerprint {
            writeln!(f, "  tls sha256:   {fp}")?;
        }
        for n in &self.notes {
            writeln!(f, "  note:         {n}")?;
        }
        Ok(())
    }
}

/// The step a driver was in when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Opening a connection / session.
    Connect,
    /// Authenticating.
    Login,
    /// Locating the ComputerSystem.
    FindSystem,
    /// Reading the power state.
    PowerState,
    /// Writing the boot override.
    SetBoot,
    /// Reading the boot override back.
    ReadBoot,
    /// Sending a power action.
    Power,
    /// Reading what the BMC advertises.
    Check,
    /// Reading the hardware inventory.
    Inventory,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Connect => "connect",
            Step::Login => "login",
            Step::FindSystem => "find system",
            Step::PowerState => "power state",
            Step::SetBoot => "set boot override",
            Step::ReadBoot => "read boot override",
            Step::Power => "power action",
            Step::Check => "check",
            Step::Inventory => "inventory",
        })
    }
}

/// Why a BMC operation failed. Messages never contain the password.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BmcError {
    /// Nothing answered at the address.
    #[error("{driver} BMC {address} unreachable during {step}: {message}")]
    Unreachable {
        /// Driver.
        driver: Driver,
        /// Step.
        step: Step,
        /// Address.
        address: String,
        /// Transport error.
        message: String,
    },
    /// Credentials refused.
    #[error("{driver} BMC refused the credentials during {step}: {message}")]
    AuthRefused {
        /// Driver.
        driver: Driver,
        /// Step.
        step: Step,
        /// BMC's message.
        message: String,
    },
    /// The BMC does not offer what was asked.
    #[error("{driver} BMC does not support {what} ({step})")]
    NotSupported {
        /// Driver.
        driver: Driver,
        /// Step.
        step: Step,
        /// What is missing.
        what: String,
    },
    /// No system matched the configured id / MAC / UUID.
    #[error("{driver} BMC has no system matching {wanted}; found: {found}")]
    SystemNotFound {
        /// Driver.
        driver: Driver,
        /// What was configured.
        wanted: String,
        /// What the BMC lists.
        found: String,
    },
    /// Several systems and nothing to choose one by (no id, MAC or UUID given).
    #[error(
        "{driver} BMC lists {count} systems and none was chosen: give the system id (`system_id`; the CLI's --system-id or --bmc-system-id); found: {found}"
    )]
    SystemAmbiguous {
        /// Driver.
        driver: Driver,
        /// How many systems the BMC lists.
        count: usize,
        /// What the BMC lists.
        found: String,
    },
    /// The override was written but reading it back shows something else.
    #[error(
        "{driver} BMC did not apply the boot override after {attempts} attempts: wanted {wanted}, reads back {got}"
    )]
    OverrideNotApplied {
        /// Driver.
        driver: Driver,
        /// What was written.
        wanted: String,
        /// What was read back.
        got: String,
        /// Attempts made.
        attempts: u32,
    },
    /// A power action was acknowledged but the power state did not follow.
    #[error("{driver} BMC acknowledged {action} but power stayed {last} for {waited:?}")]
    PowerDidNotChange {
        /// Driver.
        driver: Driver,
        /// Action sent.
        action: String,
        /// Last power state seen.
        last: String,
        /// How long we waited.
        waited: Duration,
    },
    /// A request did not complete in time.
    #[error("{driver} BMC timed out after {after:?} during {step}")]
    Timeout {
        /// Driver.
        driver: Driver,
        /// Step.
        step: Step,
        /// Timeout.
        after: Duration,
    },
    /// The BMC's TLS certificate is not the pinned one.
    #[error("{driver} BMC certificate changed: pinned sha256 {pinned}, presented {presented}")]
    CertificateMismatch {
        /// Driver.
        driver: Driver,
        /// Stored pin.
        pinned: String,
        /// What the BMC presented.
        presented: String,
    },
    /// The BMC answered something we could not use.
    #[error("{driver} BMC protocol error during {step}{}: {message}", .status.map(|s| format!(" (status {s})")).unwrap_or_default())]
    Protocol {
        /// Driver.
        driver: Driver,
        /// Step.
        step: Step,
        /// HTTP status or IPMI completion code.
        status: Option<u16>,
        /// BMC's message or the parse error.
        message: String,
    },
}

impl BmcError {
    /// Whether trying again may help (transport trouble, 5xx), as opposed to a definite no.
    pub fn is_retryable(&self) -> bool {
        match self {
            BmcError::Unreachable { .. } | BmcError::Timeout { .. } => true,
            // 501 Not Implemented is a definite answer (sushy's PowerCycle): fall back, don't retry.
            BmcError::Protocol { status, .. } => status.is_none_or(|s| s >= 500 && s != 501),
            _ => false,
        }
    }

    /// The driver that failed.
    pub fn driver(&self) -> Driver {
        match self {
            BmcError::Unreachable { driver, .. }
            | BmcError::AuthRefused { driver, .. }
            | BmcError::NotSupported { driver, .. }
            | BmcError::SystemNotFound { driver, .. }
            | BmcError::SystemAmbiguous { driver, .. }
            | BmcError::OverrideNotApplied { driver, .. }
            | BmcError::PowerDidNotChange { driver, .. }
            | BmcError::Timeout { driver, .. }
            | BmcError::CertificateMismatch { driver, .. }
            | BmcError::Protocol { driver, .. } => *driver,
        }
    }

    /// Short machine-friendly kind, for metrics and the node's failure reason.
    pub fn kind(&self) -> &'static str {
        match self {
            BmcError::Unreachable { .. } => "unreachable",
            BmcError::AuthRefused { .. } => "auth_refused",
            BmcError::NotSupported { .. } => "not_supported",
            BmcError::SystemNotFound { .. } => "system_not_found",
            BmcError::SystemAmbiguous { .. } => "system_ambiguous",
            BmcError::OverrideNotApplied { .. } => "override_not_applied",
            BmcError::PowerDidNotChange { .. } => "power_did_not_change",
            BmcError::Timeout { .. } => "timeout",
            BmcError::CertificateMismatch { .. } => "certificate_mismatch",
            BmcError::Protocol { .. } => "protocol",
        }
    }
}

/// One node's BMC. Every method is bounded by the endpoint's [`CallPolicy`].
pub trait Bmc: fmt::Debug + Send + Sync {
    /// Driver in use.
    fn driver(&self) -> Driver;
    /// Current power state.
    fn power_state(&self) -> BoxFuture<'_, Result<PowerState, BmcError>>;
    /// Writes the boot override, reads it back, retries, or fails with
    /// [`BmcError::OverrideNotApplied`]. Returns what was read back.
    fn set_next_boot(&self, next: NextBoot) -> BoxFuture<'_, Result<BootOverride, BmcError>>;
    /// Reads the boot override.
    fn boot_override(&self) -> BoxFuture<'_, Result<BootOverride, BmcError>>;
    /// Restarts the node (or powers it on when off) and observes it (see module docs).
    fn power_cycle(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Takes away a network boot override that is still in force (a BMC that reads a
    /// one-time override back as `Continuous` keeps it after the netboot), reads it back
    /// and returns what was read. An override that no longer boots the network is left
    /// as it is.
    fn clear_boot_override(&self) -> BoxFuture<'_, Result<BootOverride, BmcError>>;
    /// Powers on and waits for On.
    fn power_on(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Powers off (forced) and waits for Off.
    fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// What the BMC advertises, and whether the credentials work. Credential refusal is
    /// reported in the [`CheckReport`], not as an error.
    fn check(&self) -> BoxFuture<'_, Result<CheckReport, BmcError>>;
    /// [`Bmc::set_next_boot`] with the boot mode written even where the BMC does not
    /// advertise the field (netboot method `uefi_override`). Drivers without a mode
    /// field set the override as `set_next_boot` does.
    fn set_next_boot_with_mode(
        &self,
        next: NextBoot,
    ) -> BoxFuture<'_, Result<BootOverride, BmcError>> {
        self.set_next_boot(next)
    }
    /// What the BMC says the machine is (vendor, model, firmware), as one line: the key
    /// under which the netboot method that worked is remembered. `None` when unknown.
    fn model(&self) -> BoxFuture<'_, Result<Option<String>, BmcError>> {
        Box::pin(async { Ok(None) })
    }
    /// The machine's hardware as the BMC sees it, out of band (before anything boots).
    /// `Ok(None)` where the driver cannot tell; what the BMC does not report stays
    /// "not reported" in the inventory, so [`crate::inventory::diff`] skips it.
    fn inventory(&self) -> BoxFuture<'_, Result<Option<crate::inventory::Inventory>, BmcError>> {
        Box::pin(async { Ok(None) })
    }
    /// SHA-256 (lowercase hex) of the TLS certificate seen, for the caller to pin.
    fn tls_fingerprint(&self) -> Option<String> {
        None
    }
    /// Ends the BMC session, if one was opened (BMCs have few session slots).
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Whether `address` is one the driver can reach, checked when a node is registered
/// rather than on the first power-cycle of a reinstall. Redfish: `host[:port]` (HTTPS)
/// or an `http://` / `https://` URL; IPMI: `host[:port]` (RMCP+, port 623 by default).
pub fn check_address(driver: Driver, address: &str) -> Result<(), String> {
    let a = address.trim();
    if a.is_empty() || a.chars().any(char::is_whitespace) {
        return Err(format!("BMC address `{address}` is empty or has spaces"));
    }
    match driver {
        Driver::Ipmi if a.contains("://") => Err(format!(
            "`{address}` is a URL; an IPMI BMC is `host` or `host:port` (623 by default)"
        )),
        Driver::Ipmi => Ok(()),
        Driver::Redfish => {
            let url = if a.contains("://") {
                a.to_string()
            } else {
                format!("https://{a}")
            };
            match reqwest::Url::parse(&url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Ok(()),
                _ => Err(format!(
                    "`{address}` is not a Redfish BMC address (`host`, `host:port`, or an \
                     http:// or https:// URL)"
                )),
            }
        }
    }
}

/// Builds the driver for an endpoint. Does no I/O: sessions open on first use.
pub fn connect(ep: &BmcEndpoint) -> Result<Arc<dyn Bmc>, BmcError> {
    match ep.driver {
        Driver::Redfish => Ok(Arc::new(redfish::RedfishBmc::new(ep)?)),
        Driver::Ipmi => Ok(Arc::new(ipmi::IpmiBmc::new(ep)?)),
    }
}

/// `pxed bmc check`: connect and report what the BMC offers.
pub async fn check(ep: &BmcEndpoint) -> Result<CheckReport, BmcError> {
    let bmc = connect(ep)?;
    let r = bmc.check().await;
    bmc.close().await;
    r
}

/// The reclaim effect: one-time network boot, read back, then power cycle.
/// Returns the override as read back.
pub async fn netboot_and_cycle(bmc: &dyn Bmc, next: NextBoot) -> Result<BootOverride, BmcError> {
    let got = bmc.set_next_boot(next).await?;
    bmc.power_cycle().await?;
    Ok(got)
}

/// Runs `op` with the per-request timeout, retrying retryable failures with doubling
/// backoff.
pub(crate) async fn with_retries<T, F, Fut>(
    policy: &CallPolicy,
    driver: Driver,
    step: Step,
    mut op: F,
) -> Result<T, BmcError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, BmcError>>,
{
    let mut delay = policy.backoff;
    let mut attempt = 0;
    loop {
        let r = match tokio::time::timeout(policy.request_timeout, op()).await {
            Ok(r) => r,
            Err(_) => Err(BmcError::Timeout {
                driver,
                step,
                after: policy.request_timeout,
            }),
        };
        match r {
            Err(e) if e.is_retryable() && attempt < policy.retries => {
                attempt += 1;
                tracing::debug!(%driver, %step, attempt, error = %e, "BMC call failed, retrying");
                tokio::time::sleep(delay).await;
                delay = delay.saturating_mul(2);
            }
            r => return r,
        }
    }
}

/// What one write of the boot override found when it read the override back.
pub(crate) enum ReadBack {
    /// It landed; the override as read.
    Landed(BootOverride),
    /// It did not: what was written, and what reads back.
    Differs {
        /// What was written, in the driver's words.
        wanted: String,
        /// What the BMC reports now.
        got: BootOverride,
    },
    /// The write was refused in a way that calls for a new attempt at once (a stale
    /// ETag): no backoff, and nothing learned about the override.
    Again,
}

/// The read-back rule both drivers follow: runs `write` (write the override, read it
/// back) until it lands, with doubling backoff between attempts, else
/// [`BmcError::OverrideNotApplied`] naming the last read-back. `write` is told whether
/// another attempt follows, so that it returns its error rather than
/// [`ReadBack::Again`] on the last one.
pub(crate) async fn set_until_read_back<F, Fut>(
    policy: &CallPolicy,
    driver: Driver,
    address: &str,
    mut write: F,
) -> Result<BootOverride, BmcError>
where
    // Not `AsyncFnMut`: its futures cannot be proven `Send` for `Box::pin` in `impl_bmc!`.
    F: FnMut(bool) -> Fut,
    Fut: Future<Output = Result<ReadBack, BmcError>>,
{
    let attempts = policy.override_attempts.max(1);
    let mut delay = policy.backoff;
    let mut last = None;
    for attempt in 1..=attempts {
        let more = attempt < attempts;
        match write(more).await? {
            ReadBack::Landed(got) => return Ok(got),
            ReadBack::Again => {}
            ReadBack::Differs { wanted, got } => {
                tracing::warn!(%driver, bmc = %address, attempt, %wanted, %got, "boot override did not stick");
                last = Some((wanted, got.to_string()));
                if more {
                    tokio::time::sleep(delay).await;
                    delay = delay.saturating_mul(2);
                }
            }
        }
    }
    let (wanted, got) = last.unwrap_or_else(|| ("(not written)".into(), "(nothing read)".into()));
    Err(BmcError::OverrideNotApplied {
        driver,
        wanted,
        got,
        attempts,
    })
}

/// Polls `read` until `done` holds or `deadline` passes; returns the last state and
/// whether it was reached.
pub(crate) async fn poll_power<F, Fut>(
    policy: &CallPolicy,
    deadline: Duration,
    mut read: F,
    mut done: impl FnMut(&PowerState) -> bool,
) -> Result<(PowerState, bool), BmcError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<PowerState, BmcError>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        let s = read().await?;
        if done(&s) {
            return Ok((s, true));
        }
        if tokio::time::Instant::now() + policy.poll_interval > end {
            return Ok((s, false));
        }
        tokio::time::sleep(policy.poll_interval).await;
    }
}

/// After a restart-style action was acknowledged: apply the rule in the module docs.
pub(crate) async fn observe_restart<F, Fut>(
    policy: &CallPolicy,
    driver: Driver,
    action: &str,
    mut read: F,
) -> Result<(), BmcError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<PowerState, BmcError>>,
{
    let start = tokio::time::Instant::now();
    let (s, seen) = poll_power(policy, policy.restart_observe, &mut read, |s| {
        *s != PowerState::On
    })
    .await?;
    if !seen {
        if s == PowerState::On {
            tracing::warn!(%driver, action, "restart not observed (no transition within the observe window); accepting the acknowledged reset and final On");
            return Ok(());
        }
        return Err(did_not_change(driver, action, &s, start));
    }
    power_reaches(policy, driver, action, PowerState::On, start, read).await
}

/// Waits until the power state is `want`, else [`BmcError::PowerDidNotChange`].
pub(crate) async fn await_power<F, Fut>(
    policy: &CallPolicy,
    driver: Driver,
    action: &str,
    want: PowerState,
    read: F,
) -> Result<(), BmcError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<PowerState, BmcError>>,
{
    let start = tokio::time::Instant::now();
    power_reaches(policy, driver, action, want, start, read).await
}

/// Polls until the power state is `want`, at most until `power_deadline` after `since`
/// (when the action was acknowledged).
async fn power_reaches<F, Fut>(
    policy: &CallPolicy,
    driver: Driver,
    action: &str,
    want: PowerState,
    since: tokio::time::Instant,
    read: F,
) -> Result<(), BmcError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<PowerState, BmcError>>,
{
    let left = policy.power_deadline.saturating_sub(since.elapsed());
    match poll_power(policy, left, read, |s| *s == want).await? {
        (_, true) => Ok(()),
        (last, false) => Err(did_not_change(driver, action, &last, since)),
    }
}

fn did_not_change(
    driver: Driver,
    action: &str,
    last: &PowerState,
    since: tokio::time::Instant,
) -> BmcError {
    BmcError::PowerDidNotChange {
        driver,
        action: action.into(),
        last: last.to_string(),
        waited: since.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn addresses_are_checked_per_driver() {
        use super::{Driver, check_address};
        for ok in [
            "10.0.0.5",
            "bmc-r1u1.lab:8443",
            "https://10.0.0.5",
            "http://[fd00::5]:8000/",
        ] {
            check_address(Driver::Redfish, ok).unwrap();
        }
        for ok in ["10.0.0.5", "10.0.0.5:6230", "bmc-r1u1"] {
            check_address(Driver::Ipmi, ok).unwrap();
        }
        for bad in ["", " ", "ftp://10.0.0.5", "https://", "10.0.0.5 x"] {
            let e = check_address(Driver::Redfish, bad).unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
        let e = check_address(Driver::Ipmi, "https://10.0.0.5").unwrap_err();
        assert!(e.contains("an IPMI BMC is `host` or `host:port`"), "{e}");
    }

    use super::*;
    use std::sync::Mutex;

    fn policy() -> CallPolicy {
        CallPolicy {
            request_timeout: Duration::from_millis(100),
            retries: 2,
            backoff: Duration::from_millis(1),
            override_attempts: 2,
            power_deadline: Duration::from_millis(100),
            restart_observe: Duration::from_millis(30),
            poll_interval: Duration::from_millis(10),
        }
    }

    /// A power-state reader that answers `states` in turn (the last one forever) and
    /// counts its calls.
    fn script(
        states: &[&str],
    ) -> (
        Arc<Mutex<usize>>,
        impl FnMut() -> futures::future::Ready<Result<PowerState, BmcError>>,
    ) {
        let v: Vec<PowerState> = states
            .iter()
            .map(|s| match *s {
                "On" => PowerState::On,
                "Off" => PowerState::Off,
                o => PowerState::Other(o.into()),
            })
            .collect();
        let reads = Arc::new(Mutex::new(0usize));
        let n = reads.clone();
        let read = move || {
            let mut i = n.lock().unwrap();
            let s = v[(*i).min(v.len() - 1)].clone();
            *i += 1;
            futures::future::ready(Ok(s))
        };
        (reads, read)
    }

    #[test]
    fn check_report_json() {
        let mut r = CheckReport::new(Driver::Redfish, "https://bmc", "session".into());
        r.power = Some(PowerState::Other("Paused".into()));
        r.boot_override = Some(BootOverride {
            target: "Pxe".into(),
            enabled: OverrideEnabled::Once,
            mode: Some(BootMode::Uefi),
            http_uri: None,
        });
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["driver"], Driver::Redfish.as_str());
        assert_eq!(v["power"], "Paused");
        assert_eq!(
            v["credentials"],
            serde_json::json!({"result": "accepted", "how": "session"})
        );
        assert_eq!(v["boot_override"]["enabled"], "Once");
        assert_eq!(v["boot_override"]["mode"], "Uefi");
        assert_eq!(serde_json::from_value::<CheckReport>(v).unwrap(), r);
        let least: CheckReport = serde_json::from_value(serde_json::json!({
            "driver": Driver::Ipmi, "address": "h",
            "credentials": {"result": "refused", "message": "no"}}))
        .unwrap();
        assert_eq!(
            least.credentials,
            Credentials::Refused {
                message: "no".into()
            }
        );
        assert_eq!((least.power, least.notes.len()), (None, 0));
    }

    #[test]
    fn secret_is_masked() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?} {s}"), "******** ********");
        let ep = BmcEndpoint {
            driver: Driver::Ipmi,
            address: "h".into(),
            username: "u".into(),
            password: s,
            system_id: None,
            match_mac: None,
            match_uuid: None,
            tls: TlsPolicy::Insecure,
            policy: CallPolicy::default(),
        };
        assert!(!format!("{ep:?}").contains("hunter2"));
    }

    // The clock is paused in the tests below: tokio advances it only when every task
    // sleeps, so the elapsed times asserted are exact, not "within some slack".

    /// `observe_restart` under `policy()` (observe 30 ms, deadline 100 ms, poll 10 ms):
    /// a read every 10 ms; once a transition is seen, the wait for On begins with a
    /// second read at the same instant.
    #[tokio::test(start_paused = true)]
    async fn restart_observation_table() {
        enum Want {
            Ok,
            Stuck(&'static str),
        }
        let cases: &[(&str, &[&str], Want, u64)] = &[
            // Transition at 10 ms, On at 20 ms.
            (
                "transition then on",
                &["On", "Off", "Off", "On"],
                Want::Ok,
                20,
            ),
            // Off from 10 ms on: the last poll is at exactly power_deadline.
            (
                "transition, never on",
                &["On", "Off"],
                Want::Stuck("Off"),
                100,
            ),
            // The last read inside the observe window (30 ms) still counts as a transition.
            (
                "transition at the window's edge",
                &["On", "On", "On", "Off"],
                Want::Stuck("Off"),
                100,
            ),
            // No transition within the window and still On: accepted when the window ends.
            ("never left on", &["On"], Want::Ok, 30),
            // The transition comes one poll after the window: not looked for.
            (
                "transition after the window",
                &["On", "On", "On", "On", "Off"],
                Want::Ok,
                30,
            ),
            // Not On at the first read is a transition; On at the deadline is in time.
            (
                "on exactly at the deadline",
                &[
                    "Paused", "Off", "Off", "Off", "Off", "Off", "Off", "Off", "Off", "Off", "Off",
                    "On",
                ],
                Want::Ok,
                100,
            ),
        ];
        for (name, states, want, ms) in cases {
            let start = tokio::time::Instant::now();
            let (_, read) = script(states);
            let r = observe_restart(&policy(), Driver::Redfish, "ForceRestart", read).await;
            let elapsed = start.elapsed();
            assert_eq!(elapsed, Duration::from_millis(*ms), "{name}: {r:?}");
            match (want, &r) {
                (Want::Ok, Ok(())) => {}
                (
                    Want::Stuck(last),
                    Err(BmcError::PowerDidNotChange {
                        last: l, waited, ..
                    }),
                ) => {
                    assert_eq!(l, last, "{name}");
                    assert_eq!(*waited, elapsed, "{name}");
                }
                _ => panic!("{name}: {r:?}"),
            }
        }
    }

    /// `await_power` polls until the state arrives or the next poll would pass the
    /// deadline: the last poll is at or before the deadline, never after.
    #[tokio::test(start_paused = true)]
    async fn await_power_deadline_table() {
        // (power_deadline ms, answers before On (None: never), reads, elapsed ms, Ok?)
        let cases: &[(u64, Option<usize>, usize, u64, bool)] = &[
            (100, None, 11, 100, false),
            // 95 is not a multiple of the poll interval: the poll at 100 ms would be late.
            (95, None, 10, 90, false),
            // On at the 11th read (t = 100 ms), exactly the deadline: in time.
            (100, Some(10), 11, 100, true),
            // On at t = 100 ms, but the deadline was 95 ms: never read.
            (95, Some(10), 10, 90, false),
            (0, None, 1, 0, false),
            (0, Some(0), 1, 0, true),
        ];
        for &(deadline, off_reads, want_reads, ms, ok) in cases {
            let mut p = policy();
            p.power_deadline = Duration::from_millis(deadline);
            let mut states = vec!["Off"; off_reads.unwrap_or(1)];
            if off_reads.is_some() {
                states.push("On");
            }
            let (reads, read) = script(&states);
            let start = tokio::time::Instant::now();
            let r = await_power(&p, Driver::Ipmi, "on", PowerState::On, read).await;
            let case = format!("deadline {deadline} ms, {off_reads:?} Off reads: {r:?}");
            assert_eq!(start.elapsed(), Duration::from_millis(ms), "{case}");
            assert_eq!(*reads.lock().unwrap(), want_reads, "{case}");
            if ok {
                assert!(r.is_ok(), "{case}");
            } else {
                assert!(
                    matches!(&r, Err(BmcError::PowerDidNotChange { last, waited, .. })
                        if last == "Off" && *waited == Duration::from_millis(ms)),
                    "{case}"
                );
            }
        }
    }

    /// What `with_retries` does with each kind of protocol answer under `policy()`
    /// (2 retries, backoff 1 ms doubling).
    #[tokio::test(start_paused = true)]
    async fn retries_table() {
        // (status, calls made, ms spent backing off)
        let cases = [
            // A definite no: no retry, no backoff.
            (Some(400), 1, 0),
            // 501 is definite too (sushy's PowerCycle): the caller falls back instead.
            (Some(501), 1, 0),
            (Some(500), 3, 1 + 2),
            (Some(503), 3, 1 + 2),
            // An unparseable answer may be a proxy's hiccup.
            (None, 3, 1 + 2),
        ];
        for (status, calls, ms) in cases {
            let n = Mutex::new(0);
            let start = tokio::time::Instant::now();
            let r: Result<(), _> = with_retries(&policy(), Driver::Redfish, Step::SetBoot, || {
                *n.lock().unwrap() += 1;
                futures::future::ready(Err(BmcError::Protocol {
                    driver: Driver::Redfish,
                    step: Step::SetBoot,
                    status,
                    message: "no".into(),
                }))
            })
            .await;
            assert!(
                matches!(r, Err(BmcError::Protocol { status: s, .. }) if s == status),
                "{status:?}: {r:?}"
            );
            assert_eq!(*n.lock().unwrap(), calls, "{status:?}");
            assert_eq!(start.elapsed(), Duration::from_millis(ms), "{status:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn timeout_is_typed_and_retried() {
        let start = tokio::time::Instant::now();
        let r: Result<(), _> = with_retries(&policy(), Driver::Ipmi, Step::Power, || {
            futures::future::pending::<Result<(), BmcError>>()
        })
        .await;
        assert!(
            matches!(
                r,
                Err(BmcError::Timeout {
                    step: Step::Power,
                    after,
                    ..
                }) if after == Duration::from_millis(100)
            ),
            "{r:?}"
        );
        // Three attempts of 100 ms with 1 ms and 2 ms of backoff between them.
        assert_eq!(start.elapsed(), Duration::from_millis(303));
    }
}
