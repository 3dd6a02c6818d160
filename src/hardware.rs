//! The acceptance gate at the edge: loads a node's inventories and profile from the
//! store, asks [`crate::inventory::gate`] and records the verdict. The HTTP handlers
//! (health callback, accept-inventory, the node's inventory) call these.

use crate::inventory::gate::{self, Verdict};
use crate::inventory::profile::Profile;
use crate::inventory::{self, Inventory};
use crate::model::InventorySource;
use crate::store::hardware::{Hardware, InventoryRow};
use crate::store::{Store, StoreError};

/// The inventory a generation is judged by: the in-band one (deploy agent first, then
/// the first-boot agent), with what only the BMC knows (firmware versions it lists that
/// the OS does not, the serial) filled in from the out-of-band one.
pub fn of_generation(rows: &[InventoryRow], generation: i64) -> Option<Inventory> {
    let of = |src: InventorySource| {
        rows.iter()
            .find(|r| r.generation == generation && r.source == src)
            .map(|r| &r.inventory)
    };
    let in_band = of(InventorySource::Deploy).or_else(|| of(InventorySource::FirstBoot));
    let oob = of(InventorySource::Redfish).or_else(|| of(InventorySource::Ipmi));
    match (in_band, oob) {
        (Some(i), Some(o)) => Some(inventory::merge_out_of_band(i, o)),
        (Some(i), None) => Some(i.clone()),
        // Only the BMC reported: no gate (nothing in-band to compare links with), but
        // the page still shows it.
        (None, _) => None,
    }
}

/// The generation pages and the API show by default: the newest an agent reported
/// in, else the newest the BMC did.
pub fn newest(rows: &[InventoryRow]) -> Option<i64> {
    rows.iter()
        .find(|r| r.source.in_band())
        .or(rows.first())
        .map(|r| r.generation)
}

/// The inventory shown for `generation`: [`of_generation`], or what the BMC alone
/// reported when no agent did.
pub fn shown(rows: &[InventoryRow], generation: i64) -> Option<Inventory> {
    of_generation(rows, generation).or_else(|| {
        rows.iter()
            .find(|r| r.generation == generation)
            .map(|r| r.inventory.clone())
    })
}

/// What the gate says about the node's `generation`, against its baseline and profile.
/// `None` when no agent reported an inventory in that generation (an old agent, an
/// installer whose first-boot agent does not collect one): the gate does not apply.
pub fn verdict(
    profiles: &[Profile],
    hw: &Hardware,
    rows: &[InventoryRow],
    generation: i64,
) -> Option<Verdict> {
    let current = of_generation(rows, generation)?;
    let baseline = hw
        .baseline_generation
        .filter(|g| *g != generation)
        .and_then(|g| of_generation(rows, g).map(|inv| (g, inv)));
    let mut v = gate::gate(
        profiles,
        hw.profile.as_deref(),
        baseline.as_ref().map(|(g, i)| (*g, i)),
        &current,
    );
    // The BMC's own view against its view of the baseline: reported, never gated. A
    // BMC's collections come and go (one answering 500 for a moment would read as
    // every drive removed); pinned firmware gates through the merged inventory.
    let oob = |g: i64| {
        rows.iter()
            .find(|r| r.generation == g && !r.source.in_band())
            .map(|r| &r.inventory)
    };
    if let Some((bg, _)) = &baseline
        && let (Some(before), Some(now)) = (oob(*bg), oob(generation))
    {
        v.changes
            .extend(inventory::diff(before, now).into_iter().map(|mut c| {
                c.what = format!("bmc: {}", c.what);
                c.degraded = false;
                c
            }));
    }
    Some(v)
}

/// Runs the gate for the node's `generation` and records it. `None`: no inventory.
pub async fn check(
    store: &Store,
    profiles: &[Profile],
    node_id: i64,
    generation: i64,
    state: crate::model::State,
) -> Result<Option<Verdict>, StoreError> {
    let hw = store.hardware(node_id).await?;
    let rows = store.inventories(node_id).await?;
    let Some(v) = verdict(profiles, &hw, &rows, generation) else {
        return Ok(None);
    };
    store.record_gate(node_id, generation, state, &v).await?;
    Ok(Some(v))
}
