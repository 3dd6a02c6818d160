//! The acceptance gate: whether a reinstalled machine may return to the pool.
//!
//! Two questions, answered from the inventory its agents reported in this generation:
//! does it still match its hardware profile (every rule of [`profile::check`]), and did
//! it lose anything since the accepted baseline (a [`Change`] that is `degraded`: a
//! device gone, a link narrower, less memory). Either fails the gate and the node is
//! quarantined with the failed rules and the diff; an operator re-baselines (accepts
//! the new inventory, perhaps under another profile) or keeps it out.
//!
//! Pure: the caller loads the inventories and the profiles and applies the verdict.

use serde::{Deserialize, Serialize};

use super::profile::{self, Miss, Profile};
use super::{Change, Inventory};

/// The gate's answer for one generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The profile the machine was held to (`None`: it has none).
    pub profile: Option<String>,
    /// The profile's rules it does not meet.
    pub misses: Vec<Miss>,
    /// Every difference from the baseline, losses and the rest.
    pub changes: Vec<Change>,
    /// The generation the changes are against (`None`: no baseline yet).
    pub baseline_generation: Option<i64>,
    /// A note for the operator that does not fail the gate (no profile matched, two
    /// did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Verdict {
    /// The machine may return to the pool.
    pub fn passed(&self) -> bool {
        self.misses.is_empty() && !self.drifted()
    }

    /// It lost something since its baseline.
    pub fn drifted(&self) -> bool {
        self.changes.iter().any(|c| c.degraded)
    }

    /// Why the gate failed, in one line an operator can act on (starts with
    /// `inventory:` so alerts can match it). Empty when it passed.
    pub fn reason(&self) -> String {
        if self.passed() {
            return String::new();
        }
        let mut parts = Vec::new();
        if !self.misses.is_empty() {
            let p = self.profile.as_deref().unwrap_or("-");
            let m: Vec<String> = self.misses.iter().map(ToString::to_string).collect();
            parts.push(format!("profile {p} not met: {}", m.join("; ")));
        }
        let lost: Vec<String> = self
            .changes
            .iter()
            .filter(|c| c.degraded)
            .map(ToString::to_string)
            .collect();
        if !lost.is_empty() {
            let since = self
                .baseline_generation
                .map_or_else(String::new, |g| format!(" since generation {g}"));
            parts.push(format!("lost{since}: {}", lost.join("; ")));
        }
        format!("inventory: {}", parts.join("; "))
    }
}

/// The profile a machine is held to: the one assigned to it, or else the only one its
/// inventory matches. `Err` names an assigned profile the config no longer has.
pub fn pick<'a>(
    profiles: &'a [Profile],
    assigned: Option<&str>,
    inv: &Inventory,
) -> Result<Pick<'a>, String> {
    if let Some(name) = assigned {
        return profiles
            .iter()
            .find(|p| p.name == name)
            .map(Pick::Assigned)
            .ok_or_else(|| format!("profile {name} is assigned but not configured"));
    }
    let matching: Vec<&Profile> = profiles
        .iter()
        .filter(|p| profile::check(p, inv).is_empty())
        .collect();
    Ok(match matching.as_slice() {
        [] => Pick::None,
        [one] => Pick::Matched(one),
        many => Pick::Ambiguous(many.iter().map(|p| p.name.clone()).collect()),
    })
}

/// What [`pick`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Pick<'a> {
    /// The node's own profile.
    Assigned(&'a Profile),
    /// Not assigned; the only profile the inventory matches (to be assigned).
    Matched(&'a Profile),
    /// Not assigned, and more than one matches: none is assigned.
    Ambiguous(Vec<String>),
    /// Not assigned, and none matches (or none is configured).
    None,
}

/// The gate for `current`, against the node's profile choice and its `baseline`
/// inventory (of `baseline_generation`).
pub fn gate(
    profiles: &[Profile],
    assigned: Option<&str>,
    baseline: Option<(i64, &Inventory)>,
    current: &Inventory,
) -> Verdict {
    let mut v = Verdict {
        baseline_generation: baseline.map(|(g, _)| g),
        changes: baseline.map_or_else(Vec::new, |(_, b)| super::diff(b, current)),
        ..Verdict::default()
    };
    match pick(profiles, assigned, current) {
        Ok(Pick::Assigned(p) | Pick::Matched(p)) => {
            v.profile = Some(p.name.clone());
            v.misses = profile::check(p, current);
        }
        Ok(Pick::Ambiguous(names)) => {
            v.note = Some(format!(
                "matches profiles {}: assign one (pxed node accept-inventory --profile)",
                names.join(", ")
            ));
        }
        Ok(Pick::None) if !profiles.is_empty() => {
            v.note = Some("matches no configured profile".into());
        }
        Ok(Pick::None) => {}
        Err(why) => {
            v.profile = assigned.map(str::to_string);
            v.misses.push(Miss {
                rule: "profile".into(),
                why,
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::tests::h100;

    fn profiles() -> Vec<Profile> {
        toml::from_str::<Wrap>(
            r#"
            [[profiles]]
            name = "hgx"
            gpus = [{ model = "*H100*", count = 2, min_link_width = 16 }]
            [[profiles]]
            name = "small"
            memory_gib = "..64"
            "#,
        )
        .unwrap()
        .profiles
    }

    #[derive(Deserialize)]
    struct Wrap {
        profiles: Vec<Profile>,
    }

    fn two_gpus() -> Inventory {
        Inventory {
            memory_mib: 512 * 1024,
            pci: vec![h100("0000:18:00.0", 16), h100("0000:2a:00.0", 16)],
            ..Inventory::default()
        }
    }

    #[test]
    fn an_unchanged_machine_passes_and_its_only_matching_profile_is_picked() {
        let inv = two_gpus();
        let v = gate(&profiles(), None, Some((1, &inv)), &inv);
        assert!(v.passed(), "{v:?}");
        assert_eq!(v.profile.as_deref(), Some("hgx"));
        assert_eq!(v.reason(), "");
    }

    #[test]
    fn a_lost_gpu_fails_on_the_profile_and_on_the_diff() {
        let base = two_gpus();
        let mut now = base.clone();
        now.pci.remove(1);
        let v = gate(&profiles(), Some("hgx"), Some((3, &base)), &now);
        assert!(!v.passed() && v.drifted());
        let r = v.reason();
        assert!(
            r.starts_with("inventory: profile hgx not met: gpus[0] *H100* x2: 1 match"),
            "{r}"
        );
        assert!(
            r.contains("lost since generation 3: pci 0000:2a:00.0 removed (was NVIDIA"),
            "{r}"
        );
    }

    #[test]
    fn a_narrowed_link_fails_even_without_a_profile() {
        let base = two_gpus();
        let mut now = base.clone();
        now.pci[0] = h100("0000:18:00.0", 8);
        let v = gate(&[], None, Some((1, &base)), &now);
        assert_eq!(v.profile, None);
        assert!(!v.passed());
        assert!(
            v.reason()
                .contains("link changed: 32 GT/s x16 -> 32 GT/s x8"),
            "{}",
            v.reason()
        );
    }

    #[test]
    fn gains_and_firmware_updates_are_reported_not_gated() {
        let mut base = two_gpus();
        base.firmware.insert("bios".into(), "1.0".into());
        let mut now = base.clone();
        now.firmware.insert("bios".into(), "1.1".into());
        now.pci.push(h100("0000:3b:00.0", 16));
        let v = gate(&[], None, Some((1, &base)), &now);
        assert!(v.passed(), "{v:?}");
        assert_eq!(v.changes.len(), 2);
    }

    #[test]
    fn an_assigned_profile_the_config_lost_fails_with_its_name() {
        let inv = two_gpus();
        let v = gate(&profiles(), Some("gone"), None, &inv);
        assert!(!v.passed());
        assert_eq!(
            v.reason(),
            "inventory: profile gone not met: profile: profile gone is assigned but not configured"
        );
    }

    #[test]
    fn two_matching_profiles_assign_none_and_say_so() {
        let mut inv = two_gpus();
        inv.memory_mib = 32 * 1024;
        let v = gate(&profiles(), None, None, &inv);
        assert!(v.passed());
        assert_eq!(v.profile, None);
        assert!(v.note.as_deref().unwrap().contains("hgx, small"), "{v:?}");
    }
}
