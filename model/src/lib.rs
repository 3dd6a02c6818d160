//! The domain's names, typed once: node states, failed steps, architectures, BMC
//! drivers and MAC addresses. Every module that stores, serves, parses or shows one
//! of these uses the types here; the strings they stand for appear nowhere else (but
//! in the migrations' CHECK constraints and the templates).
//!
//! Each type has `as_str` / `Display` (the stored and shown name), `FromStr` (the
//! only parser), and serde in the same spelling.

pub mod rows;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A name that is not one of the type's values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// What was being parsed (`state`, `step`, `arch`, `driver`, `MAC address`).
    pub kind: &'static str,
    /// The text that was given.
    pub name: String,
    /// What would have been accepted.
    pub expected: String,
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, name, expected) = (self.kind, &self.name, &self.expected);
        // A MAC address is malformed, not unknown: "unknown MAC" reads as "not registered".
        if kind == MAC_KIND {
            write!(f, "`{name}` is not a {kind} (expected {expected})")
        } else {
            write!(f, "unknown {kind} `{name}` (expected {expected})")
        }
    }
}

impl std::error::Error for UnknownName {}

const MAC_KIND: &str = "MAC address";

fn unknown_of(kind: &'static str, name: &str, expected: String) -> UnknownName {
    UnknownName {
        kind,
        name: name.to_string(),
        expected,
    }
}

/// An [`UnknownName`] listing every name of `all`.
fn unknown<T: fmt::Display>(kind: &'static str, name: &str, all: &[T]) -> UnknownName {
    let names: Vec<String> = all.iter().map(ToString::to_string).collect();
    unknown_of(kind, name, names.join(", "))
}

/// Implements `Display` through `as_str`.
macro_rules! as_str_display {
    ($t:ty) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// Declares a fieldless enum whose values have one name each, with `ALL` (declaration
/// order), `as_str`, `Display`, `FromStr` (exactly those names), serde and sqlx.
macro_rules! names {
    (
        $(#[$meta:meta])*
        pub enum $t:ident ($kind:literal) {
            $( $(#[$vmeta:meta])* $v:ident => $name:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $t {
            $( $(#[$vmeta])* $v, )+
        }

        impl $t {
            /// Every value, in declaration order.
            pub const ALL: [$t; [$(stringify!($v)),+].len()] = [$($t::$v),+];

            /// The name stored in the database and used in the API, CLI and config.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($t::$v => $name,)+
                }
            }
        }

        as_str_display!($t);

        impl FromStr for $t {
            type Err = UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                <$t>::ALL
                    .into_iter()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| unknown($kind, s, &<$t>::ALL))
            }
        }

        text!($t);
    };
}

/// Implements serde (a string) and `sqlx::Type`, `Encode` and `Decode` (TEXT) through
/// the type's `Display` and `FromStr`; sqlx for any database whose `String` is TEXT, so
/// a second backend needs nothing here. A stored or sent name the type does not know
/// is an error, never a silent default.
macro_rules! text {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }

        impl<DB: sqlx::Database> sqlx::Type<DB> for $t
        where
            String: sqlx::Type<DB>,
        {
            fn type_info() -> DB::TypeInfo {
                <String as sqlx::Type<DB>>::type_info()
            }

            fn compatible(ty: &DB::TypeInfo) -> bool {
                <String as sqlx::Type<DB>>::compatible(ty)
            }
        }

        impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for $t
        where
            String: sqlx::Encode<'q, DB>,
        {
            fn encode_by_ref(
                &self,
                buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <String as sqlx::Encode<'q, DB>>::encode(self.to_string(), buf)
            }
        }

        impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for $t
        where
            String: sqlx::Decode<'r, DB>,
        {
            fn decode(
                value: <DB as sqlx::Database>::ValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                Ok(<String as sqlx::Decode<'r, DB>>::decode(value)?.parse::<$t>()?)
            }
        }
    };
}

names! {
    /// Who reported a hardware inventory (`node_inventory.source`).
    pub enum InventorySource ("inventory source") {
        /// The BMC, over Redfish, before the machine boots.
        Redfish => "redfish",
        /// The BMC's IPMI FRU data, where that is all there is.
        Ipmi => "ipmi",
        /// The deploy agent in pxed's ramdisk, before it writes the image.
        Deploy => "deploy",
        /// The first-boot agent of the installed system.
        FirstBoot => "first_boot",
    }
}

impl InventorySource {
    /// Whether the machine's own OS saw the hardware (PCI links, NUMA, NICs by MAC).
    pub fn in_band(self) -> bool {
        matches!(self, InventorySource::Deploy | InventorySource::FirstBoot)
    }
}

names! {
    /// A node's lifecycle state, stored as TEXT in `nodes.state`.
    pub enum State ("state") {
        /// Seen on the wire (DHCP/iPXE), not yet accepted by an operator.
        Discovered => "discovered",
        /// Installed, healthy, free to allocate.
        Available => "available",
        /// Handed to a user.
        Allocated => "allocated",
        /// Setting one-time network boot on the BMC and power-cycling.
        Reclaiming => "reclaiming",
        /// Power-cycled; waiting for the node to fetch its iPXE script.
        Netbooting => "netbooting",
        /// The installer has been served; waiting for its `installed` callback.
        Installing => "installing",
        /// Installed; waiting for the first-boot report and the health verdict.
        FirstBoot => "first_boot",
        /// A step failed; `failure` says which and why.
        Failed => "failed",
        /// Held out of service (hardware no longer matches its size).
        Quarantined => "quarantined",
    }
}

impl State {
    /// Position in [`State::ALL`] (declaration order).
    pub fn index(self) -> usize {
        self as usize
    }

    /// States of a reinstall in progress: the only ones with deadlines, a boot token,
    /// and where a second reinstall request answers "already in progress".
    pub fn in_progress(self) -> bool {
        match self {
            State::Reclaiming | State::Netbooting | State::Installing | State::FirstBoot => true,
            State::Discovered
            | State::Available
            | State::Allocated
            | State::Failed
            | State::Quarantined => false,
        }
    }

    /// How long a node may stay in this state before it is retried or failed, by
    /// default; `None` for resting states (nothing to retry).
    pub fn default_deadline(self) -> Option<std::time::Duration> {
        let secs = match self {
            State::Reclaiming => 300,
            State::Netbooting => 900,
            State::Installing => 3600,
            State::FirstBoot => 1200,
            State::Discovered
            | State::Available
            | State::Allocated
            | State::Failed
            | State::Quarantined => return None,
        };
        Some(std::time::Duration::from_secs(secs))
    }

    /// Whether the boot script serves this node its installer (or deploy ramdisk).
    pub fn serves_installer(self) -> bool {
        matches!(self, State::Netbooting | State::Installing)
    }
}

names! {
    /// A stage of a reinstall as pxed sees it (issue 12), in the order a successful
    /// one passes them; stored as TEXT in `node_stages.stage`. A stage lasts from the
    /// moment it is reached until the next one is.
    pub enum Stage ("stage") {
        /// `POST /api/v1/nodes/{id}/reinstall` took effect (a new generation).
        Reinstall => "reinstall",
        /// The BMC power-cycled the machine.
        Power => "power",
        /// The first DHCPDISCOVER from one of the node's MACs.
        DhcpDiscover => "dhcp_discover",
        /// Its lease: the DHCPREQUEST (answered at once in full mode; the site's DHCP
        /// server's in proxy mode).
        Lease => "lease",
        /// iPXE served over TFTP or HTTP (bytes, transfer time).
        FirstStage => "first_stage",
        /// DHCP from iPXE (user-class `iPXE`).
        IpxeDhcp => "ipxe_dhcp",
        /// The per-node script served (detail: install, local or discovery).
        Script => "script",
        /// The installer or deploy kernel served (bytes, transfer time).
        Kernel => "kernel",
        /// The initrd served (bytes, transfer time).
        Initrd => "initrd",
        /// Installer milestones from its syslog or reporting webhook.
        InstallerKernelBooted => "installer_kernel_booted",
        InstallerConfigLoaded => "installer_config_loaded",
        InstallerPartitioning => "installer_partitioning",
        InstallerPackages => "installer_packages",
        InstallerBootloader => "installer_bootloader",
        InstallerFinished => "installer_finished",
        /// Deploy-agent milestones (disk images).
        DeployStarted => "deploy_started",
        DeployDisk => "deploy_disk",
        DeployWipe => "deploy_wipe",
        DeployWrite => "deploy_write",
        DeployVerify => "deploy_verify",
        DeployGrow => "deploy_grow",
        DeployConfigure => "deploy_configure",
        DeployReboot => "deploy_reboot",
        /// Callback `installed`.
        Installed => "installed",
        /// The script served local boot after the install.
        LocalBoot => "local_boot",
        /// Callback `first-boot`.
        FirstBoot => "first_boot",
        /// Callback `health` (pass).
        Health => "health",
        /// The node is `available` again: the reinstall is over.
        Available => "available",
        /// The node failed (detail: the step and the reason).
        Failed => "failed",
    }
}

impl Stage {
    /// Position in [`Stage::ALL`]: the order of a successful reinstall.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Stages that end a generation's reinstall: they have no expected duration.
    pub fn is_final(self) -> bool {
        matches!(self, Stage::Available | Stage::Failed)
    }

    /// The stage a lifecycle event (`node_events.event`) reaches, if any.
    pub fn of_event(event: &str) -> Option<Stage> {
        Some(match event {
            "reinstall_requested" => Stage::Reinstall,
            "power_cycled" => Stage::Power,
            "install_finished" => Stage::Installed,
            "first_boot_reported" => Stage::FirstBoot,
            "health_passed" => Stage::Health,
            "deploy_started" | "deploy_plan" | "deploy_facts" => Stage::DeployStarted,
            e if e.starts_with("installer_") || e.starts_with("deploy_") => {
                e.parse().ok().filter(|s: &Stage| !s.is_final())?
            }
            _ => return None,
        })
    }

    /// How long the stage may last, by default, before the node is called stuck
    /// (`None`: final).
    pub fn default_expected(self) -> Option<std::time::Duration> {
        let secs = match self {
            Stage::Reinstall => 180,
            Stage::Power => 300,
            Stage::DhcpDiscover => 60,
            Stage::Lease => 120,
            Stage::FirstStage => 120,
            Stage::IpxeDhcp => 60,
            Stage::Script => 120,
            Stage::Kernel => 120,
            Stage::Initrd => 300,
            Stage::InstallerKernelBooted
            | Stage::InstallerConfigLoaded
            | Stage::InstallerPartitioning
            | Stage::InstallerBootloader => 900,
            Stage::InstallerPackages => 3600,
            Stage::InstallerFinished => 600,
            Stage::DeployStarted
            | Stage::DeployDisk
            | Stage::DeployWipe
            | Stage::DeployVerify
            | Stage::DeployGrow
            | Stage::DeployConfigure
            | Stage::DeployReboot => 600,
            Stage::DeployWrite => 3600,
            // Until the installed system boots from disk and reports.
            Stage::Installed => 900,
            Stage::LocalBoot => 900,
            Stage::FirstBoot => 900,
            Stage::Health => 300,
            Stage::Available | Stage::Failed => return None,
        };
        Some(std::time::Duration::from_secs(secs))
    }
}

names! {
    /// One BMC operation of the reclaim; its name is stored in `nodes.failed_step`.
    pub enum BmcStep ("BMC step") {
        /// Set one-time network boot and read it back.
        SetNetboot => "set_netboot",
        /// Power-cycle (or power on) the machine.
        PowerCycle => "power_cycle",
    }
}

/// What failed: a BMC operation, or the stage the node was in.
/// Stored in `nodes.failed_step` as `set_netboot`, `power_cycle` or a state name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// A BMC operation gave up after its retries.
    Bmc(BmcStep),
    /// The node was in this state (deadline, health verdict, operator action).
    Stage(State),
}

impl Step {
    /// The name stored in `nodes.failed_step`.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Bmc(b) => b.as_str(),
            Step::Stage(s) => s.as_str(),
        }
    }
}

as_str_display!(Step);

/// Why a node is failed or quarantined, in words, as the CLI and the pages show it:
/// `installing: <reason>` for a step that failed, `while available: <reason>` for one
/// set aside from a resting state (an operator's `fail` or `quarantine`).
pub fn failure_text(step: Option<Step>, reason: Option<&str>) -> Option<String> {
    let reason = reason.unwrap_or("no reason given");
    Some(match step? {
        Step::Stage(s) if !s.in_progress() => format!("while {s}: {reason}"),
        st => format!("{st}: {reason}"),
    })
}

impl FromStr for Step {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(b) = s.parse::<BmcStep>() {
            return Ok(Step::Bmc(b));
        }
        s.parse::<State>().map(Step::Stage).map_err(|_| {
            let mut all: Vec<&str> = BmcStep::ALL.iter().map(|b| b.as_str()).collect();
            all.extend(State::ALL.iter().map(|s| s.as_str()));
            unknown("step", s, &all)
        })
    }
}

text!(Step);

names! {
    /// A CPU architecture pxed installs. Its name is the catalog and directory name,
    /// also iPXE's `${buildarch}`; `FromStr` takes only these names, [`Arch::parse`]
    /// also the aliases.
    pub enum Arch ("arch") {
        /// 64-bit x86 (BIOS or UEFI).
        X86_64 => "x86_64",
        /// 64-bit ARM (UEFI only).
        Arm64 => "arm64",
    }
}

impl Arch {
    /// What a node whose architecture nobody reported yet stores in `nodes.arch`.
    pub const UNKNOWN: &'static str = "unknown";

    /// Parses the catalog name, `uname -m` (`aarch64`) or Debian's name (`amd64`).
    pub fn parse(s: &str) -> Option<Arch> {
        match s {
            "x86_64" | "amd64" | "x64" => Some(Arch::X86_64),
            "arm64" | "aarch64" => Some(Arch::Arm64),
            _ => None,
        }
    }

    /// The `${buildarch}` values of the iPXE builds that boot this architecture's
    /// kernels: on x86_64 BIOS machines `undionly.kpxe` is an i386 build, which loads
    /// a 64-bit kernel just as well.
    pub fn ipxe_buildarches(self) -> &'static [&'static str] {
        match self {
            Arch::X86_64 => &["x86_64", "i386"],
            Arch::Arm64 => &["arm64"],
        }
    }

    /// Debian and Ubuntu's architecture name.
    pub fn debian(self) -> &'static str {
        match self {
            Arch::X86_64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }

    /// The serial console argument for the kernel command line: the usual UART of
    /// x86 servers' SOL and of arm64 (PL011) machines.
    pub fn serial_console(self) -> &'static str {
        match self {
            Arch::X86_64 => "console=ttyS0,115200",
            Arch::Arm64 => "console=ttyAMA0,115200",
        }
    }

    /// The architecture a DHCP client-architecture (option 93) value implies.
    pub fn from_client_arch(code: u16) -> Option<Arch> {
        match code {
            0 | 6 | 7 | 9 | 16 => Some(Arch::X86_64),
            11 | 19 => Some(Arch::Arm64),
            _ => None,
        }
    }

    /// Whether `s` may be stored as a node's architecture (a known one, or unknown).
    pub fn valid_node_arch(s: &str) -> bool {
        s == Arch::UNKNOWN || s.parse::<Arch>().is_ok()
    }
}

/// A node's architecture as stored in `nodes.arch`: known, or not reported yet
/// (stored as `unknown`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NodeArch(pub Option<Arch>);

impl NodeArch {
    /// Nobody reported it yet.
    pub const UNKNOWN: NodeArch = NodeArch(None);

    /// The architecture, if known.
    pub fn known(self) -> Option<Arch> {
        self.0
    }

    /// The stored and shown name (`x86_64`, `arm64`, `unknown`).
    pub fn as_str(self) -> &'static str {
        self.0.map_or(Arch::UNKNOWN, Arch::as_str)
    }
}

impl From<Arch> for NodeArch {
    fn from(a: Arch) -> Self {
        NodeArch(Some(a))
    }
}

as_str_display!(NodeArch);

impl FromStr for NodeArch {
    type Err = UnknownName;

    /// A catalog name or `unknown`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == Arch::UNKNOWN {
            return Ok(NodeArch(None));
        }
        s.parse::<Arch>().map(|a| NodeArch(Some(a))).map_err(|_| {
            let known: Vec<&str> = Arch::ALL.iter().map(|a| a.as_str()).collect();
            unknown_of(
                "arch",
                s,
                format!("{} or {}", known.join(", "), Arch::UNKNOWN),
            )
        })
    }
}

text!(NodeArch);

names! {
    /// How pxed talks to a node's BMC (stored in `bmcs.driver`).
    pub enum Driver ("driver") {
        /// DMTF Redfish over HTTP(S).
        Redfish => "redfish",
        /// IPMI 2.0 over LAN (RMCP+, "lanplus").
        Ipmi => "ipmi",
    }
}

/// Normalizes a MAC to lower-case `aa:bb:cc:dd:ee:ff`; accepts `:`/`-` separators or none.
pub fn normalize_mac(s: &str) -> Option<String> {
    let hex: String = s
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect();
    if hex.len() != 12 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let hex = hex.to_ascii_lowercase();
    Some(
        (0..6)
            .map(|i| &hex[i * 2..i * 2 + 2])
            .collect::<Vec<_>>()
            .join(":"),
    )
}

/// A client hardware (Ethernet) address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl FromStr for Mac {
    type Err = UnknownName;

    /// `aa:bb:cc:dd:ee:ff` in either case, with `:`, `-`, `.` or no separators.
    fn from_str(s: &str) -> Result<Mac, UnknownName> {
        let bad = || unknown_of(MAC_KIND, s, "six hex octets like 52:54:00:ab:cd:ef".into());
        let n = normalize_mac(s).ok_or_else(bad)?;
        let mut m = [0u8; 6];
        for (i, part) in n.split(':').enumerate() {
            m[i] = u8::from_str_radix(part, 16).map_err(|_| bad())?;
        }
        Ok(Mac(m))
    }
}

text!(Mac);

/// A secret handed to a node: no `Display`, a redacted `Debug` (a node or event can be
/// logged without leaking it), the text taken with `as_str` where a URL needs it, and
/// `random()` for a fresh one (256 bits, hex).
macro_rules! secret {
    ($t:ident) => {
        impl $t {
            /// The token text, as stored and used in URLs.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// A fresh random token: 32 bytes from the OS-seeded CSPRNG, as hex.
            pub fn random() -> Self {
                let bytes: [u8; 32] = rand::random();
                $t(hex::encode(bytes))
            }
        }

        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($t), "(..)"))
            }
        }
    };
}

/// A node's one-time boot token (`nodes.boot_token`): authenticates its installer or
/// deploy agent for one generation. It is in the boot script and the kernel command
/// line, so anyone who can fetch the script can read it; pxed therefore accepts it
/// only from the address the installer was served to, and only for installer calls.
#[derive(Clone, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(transparent)]
pub struct BootToken(pub String);

secret!(BootToken);

/// The first-boot agent's credential (`nodes.agent_token`): minted with each
/// generation's boot token, written only into the installed system (by the install
/// config or the deploy plan), accepted only for the first-boot and health reports.
#[derive(Clone, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(transparent)]
pub struct AgentToken(pub String);

secret!(AgentToken);

/// Most authorized keys one node may carry (the config's and the image's come on top).
pub const MAX_NODE_SSH_KEYS: usize = 64;

/// Key types OpenSSH accepts in `authorized_keys`.
const SSH_KEY_TYPES: &[&str] = &[
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "ssh-ed25519-cert-v01@openssh.com",
    "ssh-rsa-cert-v01@openssh.com",
];

/// Checks one `authorized_keys` line: a single line, at most 16 KiB, holding a known
/// key type followed by base64 (options such as `from="…"` may come first). The
/// line reaches installed systems verbatim, so a newline would smuggle a second key.
pub fn check_authorized_key(line: &str) -> Result<(), String> {
    if line.contains(['\n', '\r', '\0']) {
        return Err("an authorized key is one line (no newline or NUL)".into());
    }
    if line.len() > 16 * 1024 {
        return Err("an authorized key is at most 16 KiB".into());
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some(at) = words.iter().position(|w| SSH_KEY_TYPES.contains(w)) else {
        return Err(format!(
            "no OpenSSH key type in {:?} (expected one of {})",
            line.chars().take(40).collect::<String>(),
            SSH_KEY_TYPES.join(", ")
        ));
    };
    let b64 = words.get(at + 1).copied().unwrap_or("");
    let ok = b64.len() >= 16
        && b64
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
    if !ok {
        return Err(format!(
            "the {} key's base64 body is missing or malformed",
            words[at]
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in State::ALL {
            assert_eq!(s.as_str().parse::<State>(), Ok(s));
            assert_eq!(Step::Stage(s).as_str().parse::<Step>(), Ok(Step::Stage(s)));
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
            assert_eq!(s.default_deadline().is_some(), s.in_progress());
        }
        for b in BmcStep::ALL {
            assert_eq!(b.as_str().parse::<Step>(), Ok(Step::Bmc(b)));
        }
        for a in Arch::ALL {
            assert_eq!(a.as_str().parse::<Arch>(), Ok(a));
            assert_eq!(Arch::parse(a.debian()), Some(a));
            assert!(Arch::valid_node_arch(a.as_str()));
        }
        for d in Driver::ALL {
            assert_eq!(d.as_str().parse::<Driver>(), Ok(d));
        }
        assert!(Arch::valid_node_arch(Arch::UNKNOWN));
        assert!(!Arch::valid_node_arch("sparc"));
        let e = "sleeping".parse::<State>().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown state `sleeping` (expected discovered, available,"),
            "{e}"
        );
        assert!("ilo".parse::<Driver>().is_err());
        assert!(serde_json::from_str::<Driver>("\"ilo\"").is_err());
    }

    #[test]
    fn arch_aliases() {
        assert_eq!(Arch::parse("aarch64"), Some(Arch::Arm64));
        assert_eq!(Arch::parse("amd64"), Some(Arch::X86_64));
        assert_eq!(Arch::parse("riscv64"), None);
        assert_eq!(Arch::Arm64.debian(), "arm64");
        assert_eq!("unknown".parse::<NodeArch>(), Ok(NodeArch::UNKNOWN));
        assert_eq!("arm64".parse::<NodeArch>(), Ok(Arch::Arm64.into()));
        let e = "sparc".parse::<NodeArch>().unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown arch `sparc` (expected x86_64, arm64 or unknown)"
        );
        assert_eq!(
            failure_text(Some(Step::Stage(State::Installing)), Some("kernel panic")).as_deref(),
            Some("installing: kernel panic")
        );
        assert_eq!(
            failure_text(Some(Step::Stage(State::Available)), None).as_deref(),
            Some("while available: no reason given")
        );
        assert_eq!(failure_text(None, Some("x")), None);
        let e = "52:54:00".parse::<Mac>().unwrap_err().to_string();
        assert!(e.starts_with("`52:54:00` is not a MAC address"), "{e}");
        let m: Mac = "52-54-00-AB-cd-EF".parse().unwrap();
        assert_eq!(m.to_string(), "52:54:00:ab:cd:ef");
        assert_eq!(serde_json::to_string(&m).unwrap(), "\"52:54:00:ab:cd:ef\"");
    }

    #[test]
    fn client_arch_codes() {
        assert_eq!(Arch::from_client_arch(7), Some(Arch::X86_64));
        assert_eq!(Arch::from_client_arch(11), Some(Arch::Arm64));
        assert_eq!(Arch::from_client_arch(2), None);
    }

    #[test]
    fn authorized_keys_are_one_known_key_per_line() {
        let good = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFoo ops@site";
        assert_eq!(check_authorized_key(good), Ok(()));
        assert_eq!(
            check_authorized_key(&format!("from=\"10.0.0.0/8\" {good}")),
            Ok(())
        );
        let two = format!("{good}\nssh-rsa AAAAB3NzaC1yc2EAAAADAQAB evil");
        assert!(check_authorized_key(&two).unwrap_err().contains("one line"));
        assert!(
            check_authorized_key("hello world")
                .unwrap_err()
                .contains("key type")
        );
        assert!(
            check_authorized_key("ssh-ed25519")
                .unwrap_err()
                .contains("base64")
        );
        assert!(check_authorized_key("ssh-ed25519 not*base64*at*all!!").is_err());
        assert!(check_authorized_key(&format!("ssh-rsa {}", "A".repeat(17_000))).is_err());
    }
}
