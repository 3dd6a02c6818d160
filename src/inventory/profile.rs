//! Hardware profiles (hardware classes): what a machine of a class must have, checked
//! against its [`Inventory`] at discovery and at every reinstall.
//!
//! Like metal-stack's sizes, a profile bounds CPU cores and memory and asks for
//! devices by a glob over their vendor/model identifier with a count; beyond them it
//! can ask for a minimum PCIe link per matched device, GPUs NUMA-local to a NIC, an
//! NVLink count, and pinned or minimum firmware versions. Every check that fails says
//! which rule and why, in words (`pxed profile match`).
//!
//! ```toml
//! [[profiles]]
//! name = "hgx-h100"
//! arch = "x86_64"
//! cpu_cores = "96.."
//! memory_gib = "1536..2048"
//! gpus = [{ model = "*H100*", count = 8, min_link_width = 16, min_link_speed_gts = 32 }]
//! nics = [{ min_speed_gbps = 400, count = "8.." }]
//! gpu_nic_numa_local = true
//! nvlinks_per_gpu = 18
//! firmware = { bios = ">=2.1.0", "gpu:*" = "=96.00.89.00.01" }
//! ```

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::Inventory;
use crate::model::Arch;

/// A count or size bound: `8` (exactly), `8..` (at least), `..16` (at most), `4..8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub min: u64,
    pub max: Option<u64>,
}

impl Count {
    pub fn contains(&self, n: u64) -> bool {
        n >= self.min && self.max.is_none_or(|m| n <= m)
    }

    /// Whether some value satisfies both.
    pub fn intersects(&self, other: &Count) -> bool {
        let lo = self.min.max(other.min);
        match (self.max, other.max) {
            (Some(a), Some(b)) => lo <= a.min(b),
            (Some(a), None) | (None, Some(a)) => lo <= a,
            (None, None) => true,
        }
    }
}

impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.max {
            Some(m) if m == self.min => write!(f, "{m}"),
            Some(m) if self.min == 0 => write!(f, "..{m}"),
            Some(m) => write!(f, "{}..{m}", self.min),
            None => write!(f, "{}..", self.min),
        }
    }
}

impl FromStr for Count {
    type Err = String;
    fn from_str(s: &str) -> Result<Count, String> {
        let num = |t: &str| {
            t.trim()
                .parse::<u64>()
                .map_err(|_| format!("{s:?} is not a count (8, 8.., ..16 or 4..8)"))
        };
        let c = match s.split_once("..") {
            None => {
                let n = num(s)?;
                Count {
                    min: n,
                    max: Some(n),
                }
            }
            Some((lo, hi)) => Count {
                min: if lo.trim().is_empty() { 0 } else { num(lo)? },
                max: if hi.trim().is_empty() {
                    None
                } else {
                    Some(num(hi)?)
                },
            },
        };
        if c.max.is_some_and(|m| m < c.min) || (c.min == 0 && c.max.is_none()) {
            return Err(format!("{s:?} bounds nothing or is empty"));
        }
        Ok(c)
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Count, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Count {
                min: n,
                max: Some(n),
            }),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for Count {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A case-insensitive glob over an identifier (`*H100*`, `*Mellanox*ConnectX-7*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob(glob::Pattern);

const GLOB: glob::MatchOptions = glob::MatchOptions {
    case_sensitive: false,
    require_literal_separator: false,
    require_literal_leading_dot: false,
};

impl Glob {
    /// `*`: every identifier.
    pub fn any() -> Glob {
        Glob(glob::Pattern::new("*").expect("literal pattern"))
    }

    pub fn matches(&self, s: &str) -> bool {
        self.0.matches_with(s, GLOB)
    }

    /// Whether one identifier could match both: decided on the patterns' text (one
    /// pattern matches the other's), so `*H100*` and `*H100 SXM*` may, `*H100*` and
    /// `*A100*` may not. Patterns that share no text but could both match one name
    /// (`*H100*`, `*80GB*`) are not seen as overlapping.
    pub fn may_intersect(&self, other: &Glob) -> bool {
        self.matches(other.0.as_str()) || other.matches(self.0.as_str())
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_str())
    }
}

impl<'de> Deserialize<'de> for Glob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Glob, D::Error> {
        let s = String::deserialize(d)?;
        glob::Pattern::new(&s)
            .map(Glob)
            .map_err(|e| serde::de::Error::custom(format!("glob {s:?}: {e}")))
    }
}

impl Serialize for Glob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A firmware requirement: `=1.2.3` (pinned) or `>=1.2.3` (at least); a bare version
/// is pinned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Version {
    Exact(String),
    AtLeast(String),
}

/// Compares dotted versions part by part, numerically where both parts are numbers
/// (`1.10` > `1.9`), else as text.
pub fn compare_versions(a: &str, b: &str) -> Ordering {
    let parts = |s: &str| -> Vec<String> {
        s.split(['.', '-', '_'])
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (pa, pb) = (parts(a.trim()), parts(b.trim()));
    for i in 0..pa.len().max(pb.len()) {
        let x = pa.get(i).map_or("0", String::as_str);
        let y = pb.get(i).map_or("0", String::as_str);
        let o = match (x.parse::<u64>(), y.parse::<u64>()) {
            (Ok(m), Ok(n)) => m.cmp(&n),
            _ => x.cmp(y),
        };
        if o != Ordering::Equal {
            return o;
        }
    }
    Ordering::Equal
}

impl Version {
    pub fn accepts(&self, v: &str) -> bool {
        match self {
            Version::Exact(want) => v.trim() == want,
            Version::AtLeast(min) => compare_versions(v, min) != Ordering::Less,
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Version::Exact(v) => write!(f, "={v}"),
            Version::AtLeast(v) => write!(f, ">={v}"),
        }
    }
}

impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Version, D::Error> {
        let s = String::deserialize(d)?;
        let s = s.trim();
        let v = if let Some(v) = s.strip_prefix(">=") {
            Version::AtLeast(v.trim().into())
        } else {
            Version::Exact(s.strip_prefix('=').unwrap_or(s).trim().into())
        };
        match &v {
            Version::Exact(x) | Version::AtLeast(x) if x.is_empty() => {
                Err(serde::de::Error::custom("an empty firmware version"))
            }
            _ => Ok(v),
        }
    }
}

impl Serialize for Version {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// GPUs or accelerators matching `model`, `count` of them, each with at least the
/// given PCIe link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceRule {
    pub model: Glob,
    pub count: Count,
    #[serde(default)]
    pub min_link_width: Option<u32>,
    /// Checked against the link's current speed: GPUs lower it when idle (ASPM), so
    /// on GPUs prefer `min_link_width`, or a profile health check that loads the GPU
    /// and checks its speed under load.
    #[serde(default)]
    pub min_link_speed_gts: Option<f32>,
}

/// `count` NIC ports of at least `min_speed_gbps` with link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicRule {
    pub min_speed_gbps: u64,
    pub count: Count,
}

/// `count` disks of at least `min_size_gb` (10^9 bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskRule {
    pub count: Count,
    #[serde(default)]
    pub min_size_gb: u64,
}

/// One hardware class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    #[serde(default)]
    pub arch: Option<Arch>,
    #[serde(default)]
    pub cpu_cores: Option<Count>,
    #[serde(default)]
    pub memory_gib: Option<Count>,
    #[serde(default)]
    pub gpus: Vec<DeviceRule>,
    #[serde(default)]
    pub nics: Vec<NicRule>,
    #[serde(default)]
    pub disks: Option<DiskRule>,
    /// Component (a glob over the inventory's firmware keys) to version rule; every
    /// component the glob matches must satisfy it, and at least one must exist.
    #[serde(default)]
    pub firmware: BTreeMap<String, Version>,
    /// Every GPU has a NIC on its NUMA node.
    #[serde(default)]
    pub gpu_nic_numa_local: bool,
    /// Each GPU has at least this many active NVLinks.
    #[serde(default)]
    pub nvlinks_per_gpu: Option<u32>,
    /// Checks the first-boot agent runs on machines of this profile, beside its own;
    /// one that fails fails the node's health, and the node does not return to the pool.
    #[serde(default)]
    pub health: Vec<HealthCheck>,
}

/// One profile health check: `command` run by `/bin/sh -c` on the installed system,
/// as root, at first boot. It passes when it exits with `exit` (default 0) within
/// `timeout_secs` (default 60) and, when `output` is set, its standard output
/// contains that text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    pub name: String,
    pub command: String,
    #[serde(default = "HealthCheck::default_timeout")]
    pub timeout_secs: u32,
    #[serde(default)]
    pub exit: i32,
    #[serde(default)]
    pub output: Option<String>,
}

impl HealthCheck {
    fn default_timeout() -> u32 {
        60
    }

    /// Why the check cannot be shipped to a machine: it lands in a shell script, so
    /// one line each, bounded, and a name that is a plain word.
    pub fn problem(&self) -> Option<String> {
        let bad_text = |s: &str| s.is_empty() || s.len() > 2048 || s.chars().any(char::is_control);
        if self.name.is_empty()
            || self.name.len() > 32
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
        {
            return Some(format!(
                "health check name {:?}: 1-32 letters, digits, - or _",
                self.name
            ));
        }
        if bad_text(&self.command) {
            return Some(format!(
                "health check {}: command must be one line of 1-2048 characters",
                self.name
            ));
        }
        if self.output.as_deref().is_some_and(bad_text) {
            return Some(format!(
                "health check {}: output must be one line of 1-2048 characters",
                self.name
            ));
        }
        if !(1..=3600).contains(&self.timeout_secs) {
            return Some(format!(
                "health check {}: timeout_secs must be 1-3600",
                self.name
            ));
        }
        if !(0..=255).contains(&self.exit) {
            return Some(format!("health check {}: exit must be 0-255", self.name));
        }
        None
    }
}

impl Profile {
    /// A profile with no rules (every machine matches it).
    pub fn named(name: &str) -> Profile {
        Profile {
            name: name.to_string(),
            arch: None,
            cpu_cores: None,
            memory_gib: None,
            gpus: Vec::new(),
            nics: Vec::new(),
            disks: None,
            firmware: BTreeMap::new(),
            gpu_nic_numa_local: false,
            nvlinks_per_gpu: None,
            health: Vec::new(),
        }
    }
}

/// How many GPUs or accelerators the inventory shows (the vendor tool's list where it
/// ran, else accelerator-class PCI functions).
pub fn accelerator_count(inv: &Inventory) -> usize {
    accelerators(inv).len()
}

/// A rule a machine did not meet, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Miss {
    /// The rule as written: `gpus[0] *H100* x8`, `memory_gib 1536..2048`.
    pub rule: String,
    pub why: String,
}

impl fmt::Display for Miss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.rule, self.why)
    }
}

/// An accelerator as rules see it: identifier, PCI link, NUMA node, NVLinks.
struct Accel<'a> {
    address: &'a str,
    id: String,
    link: Option<super::Link>,
    numa: Option<u32>,
    nvlinks: Option<u32>,
}

/// GPUs from the vendor tool where it ran (with their PCI function's link), else every
/// accelerator-class PCI function.
fn accelerators(inv: &Inventory) -> Vec<Accel<'_>> {
    let pci = |addr: &str| {
        inv.pci
            .iter()
            .find(|d| d.address.eq_ignore_ascii_case(addr))
    };
    if !inv.gpus.is_empty() {
        return inv
            .gpus
            .iter()
            .map(|g| {
                let d = pci(&g.pci_address);
                Accel {
                    address: &g.pci_address,
                    id: match d {
                        Some(d) => format!("{} {}", g.model, d.identifier()),
                        None => g.model.clone(),
                    },
                    link: d.and_then(|d| d.link),
                    numa: g.numa_node.or(d.and_then(|d| d.numa_node)),
                    nvlinks: g.nvlinks,
                }
            })
            .collect();
    }
    inv.pci
        .iter()
        .filter(|d| d.is_accelerator())
        .map(|d| Accel {
            address: &d.address,
            id: d.identifier(),
            link: d.link,
            numa: d.numa_node,
            nvlinks: None,
        })
        .collect()
}

/// Every rule of `p` that `inv` does not meet; empty when it matches.
pub fn check(p: &Profile, inv: &Inventory) -> Vec<Miss> {
    let mut out = Vec::new();
    let mut miss = |rule: String, why: String| out.push(Miss { rule, why });
    if let Some(a) = p.arch
        && inv.arch != Some(a)
    {
        let has = inv
            .arch
            .map_or("not reported".to_string(), |x| x.to_string());
        miss(format!("arch {a}"), format!("the machine is {has}"));
    }
    if let Some(c) = p.cpu_cores
        && !c.contains(inv.cpu.cores.into())
    {
        miss(
            format!("cpu_cores {c}"),
            format!("it has {} cores", inv.cpu.cores),
        );
    }
    if let Some(m) = p.memory_gib {
        let gib = inv.memory_mib / 1024;
        if !m.contains(gib) {
            miss(format!("memory_gib {m}"), format!("it has {gib} GiB"));
        }
    }
    let accels = accelerators(inv);
    for (i, r) in p.gpus.iter().enumerate() {
        let rule = format!("gpus[{i}] {} x{}", r.model, r.count);
        let matched: Vec<&Accel<'_>> = accels.iter().filter(|a| r.model.matches(&a.id)).collect();
        if !r.count.contains(matched.len() as u64) {
            let seen: Vec<String> = accels
                .iter()
                .map(|a| format!("{} {}", a.address, a.id))
                .collect();
            miss(
                rule.clone(),
                format!(
                    "{} match (accelerators seen: {})",
                    matched.len(),
                    if seen.is_empty() {
                        "none".into()
                    } else {
                        seen.join("; ")
                    }
                ),
            );
        }
        for a in &matched {
            let Some(l) = a.link else {
                if r.min_link_width.is_some() || r.min_link_speed_gts.is_some() {
                    miss(
                        rule.clone(),
                        format!("{}: PCIe link not reported", a.address),
                    );
                }
                continue;
            };
            if let Some(w) = r.min_link_width
                && l.width < w
            {
                miss(
                    rule.clone(),
                    format!("{} runs at x{} (needs x{w})", a.address, l.width),
                );
            }
            if let Some(s) = r.min_link_speed_gts
                && l.speed_gts + 0.01 < s
            {
                miss(
                    rule.clone(),
                    format!(
                        "{} runs at {} GT/s (needs {s} GT/s)",
                        a.address, l.speed_gts
                    ),
                );
            }
        }
    }
    for (i, r) in p.nics.iter().enumerate() {
        let n = inv
            .nics
            .iter()
            .filter(|n| n.link_up && n.speed_mbps.unwrap_or(0) >= r.min_speed_gbps * 1000)
            .count() as u64;
        if !r.count.contains(n) {
            miss(
                format!("nics[{i}] >= {} Gb/s x{}", r.min_speed_gbps, r.count),
                format!("{n} ports with link at that speed (of {})", inv.nics.len()),
            );
        }
    }
    if let Some(r) = &p.disks {
        let n = inv
            .disks
            .iter()
            .filter(|d| d.size_bytes >= r.min_size_gb * 1_000_000_000)
            .count() as u64;
        if !r.count.contains(n) {
            miss(
                format!("disks >= {} GB x{}", r.min_size_gb, r.count),
                format!("{n} disks that large (of {})", inv.disks.len()),
            );
        }
    }
    for (component, want) in &p.firmware {
        let rule = format!("firmware {component} {want}");
        let Ok(g) = glob::Pattern::new(component) else {
            miss(rule, "not a valid glob".into());
            continue;
        };
        let found: Vec<(&String, &String)> = inv
            .firmware
            .iter()
            .filter(|(k, _)| g.matches_with(k, GLOB))
            .collect();
        if found.is_empty() {
            miss(rule, "no such component reported".into());
            continue;
        }
        for (k, v) in found {
            if !want.accepts(v) {
                miss(rule.clone(), format!("{k} is {v}"));
            }
        }
    }
    if p.gpu_nic_numa_local {
        let nic_nodes: Vec<u32> = inv.nics.iter().filter_map(|n| n.numa_node).collect();
        for a in &accels {
            match a.numa {
                None => miss(
                    "gpu_nic_numa_local".into(),
                    format!("{}: NUMA node not reported", a.address),
                ),
                Some(node) if !nic_nodes.contains(&node) => miss(
                    "gpu_nic_numa_local".into(),
                    format!("{} is on NUMA node {node}, which has no NIC", a.address),
                ),
                Some(_) => {}
            }
        }
    }
    if let Some(want) = p.nvlinks_per_gpu {
        for a in &accels {
            match a.nvlinks {
                Some(n) if n >= want => {}
                Some(n) => miss(
                    format!("nvlinks_per_gpu {want}"),
                    format!("{} has {n} active", a.address),
                ),
                None => miss(
                    format!("nvlinks_per_gpu {want}"),
                    format!("{}: NVLinks not reported", a.address),
                ),
            }
        }
    }
    out
}

/// The profiles `inv` matches, and for every other one why not.
pub fn explain<'a>(profiles: &'a [Profile], inv: &Inventory) -> Vec<(&'a str, Vec<Miss>)> {
    profiles
        .iter()
        .map(|p| (p.name.as_str(), check(p, inv)))
        .collect()
}

/// Pairs of profiles one machine could match both of, with the reason; decided on
/// the rules alone (arch, core and memory ranges, GPU patterns and counts).
pub fn overlaps(profiles: &[Profile]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, a) in profiles.iter().enumerate() {
        for b in &profiles[i + 1..] {
            if let (Some(x), Some(y)) = (a.arch, b.arch)
                && x != y
            {
                continue;
            }
            let ranges = |x: Option<Count>, y: Option<Count>| match (x, y) {
                (Some(x), Some(y)) => x.intersects(&y),
                _ => true,
            };
            if !ranges(a.cpu_cores, b.cpu_cores) || !ranges(a.memory_gib, b.memory_gib) {
                continue;
            }
            // Each GPU rule of one must be satisfiable beside the other's: a rule
            // whose pattern may meet one of the other's must agree on the count.
            let gpus_clash = a.gpus.iter().any(|r| {
                b.gpus
                    .iter()
                    .any(|s| r.model.may_intersect(&s.model) && !r.count.intersects(&s.count))
            });
            let disjoint_patterns = !a.gpus.is_empty()
                && !b.gpus.is_empty()
                && a.gpus.iter().all(|r| {
                    r.count.min > 0 && !b.gpus.iter().any(|s| r.model.may_intersect(&s.model))
                })
                && b.gpus
                    .iter()
                    .all(|s| s.count.max == Some(0) || s.count.min > 0);
            if gpus_clash || disjoint_patterns {
                continue;
            }
            out.push(format!(
                "profiles {} and {} overlap: arch, cpu_cores, memory_gib and GPU rules admit one machine for both",
                a.name, b.name
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::tests::h100;
    use super::super::{Gpu, Link, Nic};
    use super::*;

    fn profiles(toml_text: &str) -> Vec<Profile> {
        #[derive(Deserialize)]
        struct F {
            profiles: Vec<Profile>,
        }
        toml::from_str::<F>(toml_text).unwrap().profiles
    }

    const HGX: &str = r#"
[[profiles]]
name = "hgx-h100"
arch = "x86_64"
cpu_cores = "96.."
memory_gib = "1536..2048"
gpus = [{ model = "*H100*", count = 8, min_link_width = 16, min_link_speed_gts = 32 }]
nics = [{ min_speed_gbps = 400, count = "8.." }]
gpu_nic_numa_local = true
firmware = { bios = ">=2.1.0", "gpu:*" = "=96.00.89.00.01" }
"#;

    fn hgx_machine() -> Inventory {
        let mut inv = Inventory {
            arch: Some(Arch::X86_64),
            memory_mib: 2_048 * 1024,
            ..Inventory::default()
        };
        inv.cpu.cores = 112;
        for i in 0..8u32 {
            let addr = format!("0000:{:02x}:00.0", 0x18 + i * 0x10);
            let mut d = h100(&addr, 16);
            d.numa_node = Some(i / 4);
            inv.pci.push(d);
            inv.firmware
                .insert(format!("gpu:{addr}"), "96.00.89.00.01".into());
            inv.nics.push(Nic {
                mac: format!("b8:3f:d2:00:00:{i:02x}"),
                speed_mbps: Some(400_000),
                link_up: true,
                numa_node: Some(i / 4),
                ..Nic::default()
            });
        }
        inv.firmware.insert("bios".into(), "2.10.1".into());
        inv
    }

    #[test]
    fn counts_parse_and_bound() {
        let table = [
            ("8", 8, 8, true),
            ("8..", 8, u64::MAX, true),
            ("..16", 0, 16, true),
            ("4..8", 4, 8, true),
        ];
        for (s, lo, hi, ok) in table {
            let c: Count = s.parse().unwrap();
            assert_eq!(c.contains(lo), ok, "{s}");
            assert_eq!(c.contains(hi), ok, "{s}");
            assert_eq!(c.to_string(), s);
        }
        assert!(!"4..8".parse::<Count>().unwrap().contains(9));
        for bad in ["8..4", "x", "..", "1..2..3"] {
            assert!(bad.parse::<Count>().is_err(), "{bad}");
        }
    }

    #[test]
    fn versions_compare_by_parts() {
        assert_eq!(compare_versions("1.10", "1.9"), Ordering::Greater);
        assert_eq!(compare_versions("2.1", "2.1.0"), Ordering::Equal);
        assert_eq!(compare_versions("2.0.9", "2.1.0"), Ordering::Less);
        assert!(Version::AtLeast("2.1.0".into()).accepts("2.10.1"));
        assert!(!Version::Exact("96.00.89.00.01".into()).accepts("96.00.89.00.02"));
    }

    /// The table: each change to a matching machine and the one miss it must give.
    #[test]
    fn every_rule_says_why_it_did_not_match() {
        let p = &profiles(HGX)[0];
        assert_eq!(check(p, &hgx_machine()), vec![]);
        type Edit = fn(&mut Inventory);
        let table: [(&str, Edit, &str); 9] = [
            (
                "arch",
                |i| i.arch = Some(Arch::Arm64),
                "arch x86_64: the machine is arm64",
            ),
            (
                "cores",
                |i| i.cpu.cores = 64,
                "cpu_cores 96..: it has 64 cores",
            ),
            (
                "memory",
                |i| i.memory_mib = 1024 * 1024,
                "memory_gib 1536..2048: it has 1024 GiB",
            ),
            (
                "a GPU gone",
                |i| {
                    i.pci.remove(3);
                },
                "gpus[0] *H100* x8: 7 match",
            ),
            (
                "a narrowed link",
                |i| {
                    i.pci[2].link = Some(Link {
                        speed_gts: 32.0,
                        width: 4,
                    })
                },
                "gpus[0] *H100* x8: 0000:38:00.0 runs at x4 (needs x16)",
            ),
            (
                "a slow link",
                |i| {
                    i.pci[0].link = Some(Link {
                        speed_gts: 16.0,
                        width: 16,
                    })
                },
                "gpus[0] *H100* x8: 0000:18:00.0 runs at 16 GT/s (needs 32 GT/s)",
            ),
            (
                "a NIC down",
                |i| i.nics[0].link_up = false,
                "nics[0] >= 400 Gb/s x8..: 7 ports with link at that speed (of 8)",
            ),
            (
                "GPU firmware drift",
                |i| {
                    i.firmware
                        .insert("gpu:0000:28:00.0".into(), "96.00.74.00.1c".into());
                },
                "firmware gpu:* =96.00.89.00.01: gpu:0000:28:00.0 is 96.00.74.00.1c",
            ),
            (
                "NICs on one node only",
                |i| i.nics.iter_mut().for_each(|n| n.numa_node = Some(0)),
                "gpu_nic_numa_local: 0000:58:00.0 is on NUMA node 1, which has no NIC",
            ),
        ];
        for (what, edit, want) in table {
            let mut inv = hgx_machine();
            edit(&mut inv);
            let misses: Vec<String> = check(p, &inv).iter().map(ToString::to_string).collect();
            assert!(!misses.is_empty(), "{what}: matched");
            assert!(misses[0].starts_with(want), "{what}: {misses:?}");
        }
        // Old BIOS: at-least rule.
        let mut inv = hgx_machine();
        inv.firmware.insert("bios".into(), "2.0.9".into());
        assert_eq!(
            check(p, &inv)[0].to_string(),
            "firmware bios >=2.1.0: bios is 2.0.9"
        );
    }

    #[test]
    fn vendor_tool_gpus_match_on_their_model_and_nvlinks() {
        let mut p = profiles(HGX).remove(0);
        p.nvlinks_per_gpu = Some(18);
        let mut inv = hgx_machine();
        inv.gpus = inv
            .pci
            .iter()
            .map(|d| Gpu {
                pci_address: d.address.clone(),
                model: "NVIDIA H100 80GB HBM3".into(),
                nvlinks: Some(18),
                ..Gpu::default()
            })
            .collect();
        assert_eq!(check(&p, &inv), vec![]);
        inv.gpus[5].nvlinks = Some(12);
        assert_eq!(
            check(&p, &inv)[0].to_string(),
            "nvlinks_per_gpu 18: 0000:68:00.0 has 12 active"
        );
    }

    #[test]
    fn overlapping_profiles_are_reported() {
        let ps = profiles(
            r#"
[[profiles]]
name = "h100"
gpus = [{ model = "*H100*", count = 8 }]
[[profiles]]
name = "h100-sxm"
gpus = [{ model = "*H100 SXM*", count = "4.." }]
[[profiles]]
name = "a100"
gpus = [{ model = "*A100*", count = 8 }]
[[profiles]]
name = "h100-small"
gpus = [{ model = "*H100*", count = "..4" }]
[[profiles]]
name = "arm"
arch = "arm64"
[[profiles]]
name = "big-x86"
arch = "x86_64"
memory_gib = "1024.."
[[profiles]]
name = "small-x86"
arch = "x86_64"
memory_gib = "..512"
"#,
        );
        let o = overlaps(&ps);
        let pairs: Vec<(&str, &str)> = o
            .iter()
            .map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (w[1], w[3])
            })
            .collect();
        assert!(pairs.contains(&("h100", "h100-sxm")), "{o:?}");
        assert!(!pairs.contains(&("h100", "a100")), "{o:?}");
        assert!(!pairs.contains(&("h100", "h100-small")), "{o:?}");
        assert!(pairs.contains(&("h100-sxm", "h100-small")), "{o:?}");
        assert!(!pairs.contains(&("arm", "big-x86")), "{o:?}");
        assert!(!pairs.contains(&("big-x86", "small-x86")), "{o:?}");
        // A profile without GPU rules admits the GPU machines of another.
        assert!(pairs.contains(&("h100", "arm")), "{o:?}");
    }

    #[test]
    fn unknown_rule_keys_are_refused() {
        #[derive(Deserialize, Debug)]
        #[allow(dead_code)]
        struct F {
            profiles: Vec<Profile>,
        }
        let e = toml::from_str::<F>("[[profiles]]\nname = \"x\"\ngpu = []\n").unwrap_err();
        assert!(e.to_string().contains("unknown field `gpu`"), "{e}");
        let e =
            toml::from_str::<F>("[[profiles]]\nname = \"x\"\ncpu_cores = \"8..4\"\n").unwrap_err();
        assert!(e.to_string().contains("bounds nothing"), "{e}");
    }
}
