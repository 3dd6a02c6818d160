//! `lspci -vmm` in its machine-readable form, as a node's first-boot agent sends it
//! when an installer (not pxed's deploy agent) put the system down: `-nn` (names and
//! `[ids]`), `-n` (ids only) or neither, with or without `-D` (the domain).
//!
//! Hand-written: the format is `Key:\tValue` records separated by blank lines, and no
//! maintained crate parses it; the care is in the values (`Name [10de]`).

use super::PciDevice;

/// Why an `lspci -vmm` record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LspciError {
    #[error("lspci record {record} has no Slot")]
    NoSlot { record: usize },
    #[error("lspci record {record}: {slot:?} is not a PCI address")]
    BadSlot { record: usize, slot: String },
}

/// `00:1f.3` or `0000:00:1f.3` -> `0000:00:1f.3`, as sysfs names devices.
pub fn normalize_slot(slot: &str) -> Option<String> {
    super::nvidia::normalize_bus_id(slot)
}

/// `Name [10de]` -> (`Name`, 0x10de); `10de` alone (`-n`) -> ("", 0x10de); a name
/// without an id (no `-n`) -> (name, 0). `digits` is 4 for ids and classes.
fn name_and_id(value: &str, digits: usize) -> (String, u32) {
    let value = value.trim();
    let hex = |s: &str| {
        (s.len() == digits && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    if let Some(id) = hex(value) {
        return (String::new(), id);
    }
    if let Some(open) = value.strip_suffix(']').and_then(|v| v.rfind('['))
        && let Some(id) = hex(&value[open + 1..value.len() - 1])
    {
        return (value[..open].trim_end().to_string(), id);
    }
    (value.to_string(), 0)
}

/// Parses `lspci -vmm` output into PCI functions in the order lspci listed them.
/// Lines that are not `Key:<tab>Value` (lspci's own warnings, such as a libkmod
/// message in the middle of a record) are skipped.
pub fn parse(text: &str) -> Result<Vec<PciDevice>, LspciError> {
    let mut out = Vec::new();
    let mut record: Vec<(&str, &str)> = Vec::new();
    for line in text.lines().chain([""]) {
        if line.trim().is_empty() {
            if !record.is_empty() {
                out.push(device(&record, out.len() + 1)?);
                record.clear();
            }
            continue;
        }
        let Some((key, value)) = line.split_once(":\t") else {
            continue;
        };
        if !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric()) {
            record.push((key, value));
        }
    }
    Ok(out)
}

/// One record (the `n`-th, from 1) as a PCI function.
fn device(record: &[(&str, &str)], n: usize) -> Result<PciDevice, LspciError> {
    let get = |k: &str| record.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
    let slot = get("Slot").ok_or(LspciError::NoSlot { record: n })?;
    let address = normalize_slot(slot).ok_or_else(|| LspciError::BadSlot {
        record: n,
        slot: slot.to_string(),
    })?;
    let id = |k: &str| get(k).map(|v| name_and_id(v, 4)).unwrap_or_default();
    let (_, class) = id("Class");
    let prog_if = get("ProgIf")
        .and_then(|p| u32::from_str_radix(p.trim(), 16).ok())
        .unwrap_or(0);
    let (vendor, vendor_id) = id("Vendor");
    let (device, device_id) = id("Device");
    let (_, subsystem_vendor_id) = id("SVendor");
    let (_, subsystem_device_id) = id("SDevice");
    let short = |v: u32| u16::try_from(v).unwrap_or(0);
    Ok(PciDevice {
        address,
        class: (class << 8) | (prog_if & 0xff),
        vendor_id: short(vendor_id),
        device_id: short(device_id),
        subsystem_vendor_id: short(subsystem_vendor_id),
        subsystem_device_id: short(subsystem_device_id),
        vendor,
        device,
        numa_node: get("NUMANode").and_then(|v| v.trim().parse().ok()),
        revision: get("Rev").and_then(|v| u8::from_str_radix(v.trim(), 16).ok()),
        ..PciDevice::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        crate::inventory::tests::fixture("lspci", name)
    }

    #[test]
    fn values_with_and_without_ids() {
        assert_eq!(
            name_and_id("NVIDIA Corporation [10de]", 4),
            ("NVIDIA Corporation".into(), 0x10de)
        );
        assert_eq!(
            name_and_id("440FX - 82441FX PMC [Natoma] [1237]", 4),
            ("440FX - 82441FX PMC [Natoma]".into(), 0x1237)
        );
        assert_eq!(
            name_and_id("440FX - 82441FX PMC [Natoma]", 4),
            ("440FX - 82441FX PMC [Natoma]".into(), 0)
        );
        assert_eq!(name_and_id("0c03", 4), (String::new(), 0x0c03));
        assert_eq!(normalize_slot("00:0f.0").as_deref(), Some("0000:00:0f.0"));
        assert_eq!(
            normalize_slot("0000:C1:00.0").as_deref(),
            Some("0000:c1:00.0")
        );
    }

    #[test]
    fn vmware_guest_with_names_and_ids() {
        let v = parse(&fixture("ubuntu2010-vmware-lspci-nnmmv.txt")).unwrap();
        assert_eq!(v.len(), 46);
        let vga = v.iter().find(|d| d.address == "0000:00:0f.0").unwrap();
        assert_eq!(vga.class, 0x030000);
        assert_eq!((vga.vendor_id, vga.device_id), (0x15ad, 0x0405));
        assert_eq!(vga.vendor, "VMware");
        assert_eq!(vga.device, "SVGA II Adapter");
        assert_eq!(vga.identifier(), "VMware SVGA II Adapter [15ad:0405]");
        assert!(vga.is_accelerator());
        assert_eq!(vga.revision, None);
        // ProgIf lands in the low byte, as in sysfs `class`.
        let ide = v.iter().find(|d| d.address == "0000:00:07.1").unwrap();
        assert_eq!(ide.class, 0x01018a);
        assert_eq!(ide.revision, Some(1));
        let usb = v.iter().find(|d| d.address == "0000:02:00.0").unwrap();
        assert_eq!(
            (usb.class, usb.subsystem_vendor_id, usb.subsystem_device_id),
            (0x0c0300, 0x15ad, 0x1976)
        );
        assert!(v.iter().all(|d| d.numa_node.is_none() && d.link.is_none()));
    }

    #[test]
    fn numeric_and_named_captures_of_one_machine_agree_on_ids() {
        let named = parse(&fixture("ubuntu2010-vmware-lspci-nnmmv.txt")).unwrap();
        let numeric = parse(&fixture("ubuntu2010-vmware-lspci-nmmv.txt")).unwrap();
        assert_eq!(named.len(), numeric.len());
        for (a, b) in named.iter().zip(&numeric) {
            assert_eq!(
                (a.address.as_str(), a.class, a.vendor_id, a.device_id),
                (b.address.as_str(), b.class, b.vendor_id, b.device_id)
            );
            assert_eq!(
                (a.subsystem_vendor_id, a.subsystem_device_id, a.revision),
                (b.subsystem_vendor_id, b.subsystem_device_id, b.revision)
            );
            assert!(b.vendor.is_empty() && b.device.is_empty());
        }
    }

    #[test]
    fn broken_records_are_errors_and_warnings_are_skipped() {
        let capture = fixture("ubuntu2010-vmware-lspci-nnmmv.txt");
        // lspci prints its own warnings inside records when libkmod fails.
        let warned = capture.replacen(
            "Rev:\t01\n",
            "lspci: Unable to load libkmod resources: error -12\nRev:\t01\n",
            1,
        );
        assert_eq!(parse(&warned).unwrap(), parse(&capture).unwrap());
        let no_slot = capture.replacen("Slot:\t00:07.1\n", "", 1);
        assert!(matches!(
            parse(&no_slot),
            Err(LspciError::NoSlot { record: 4 })
        ));
        let bad = capture.replacen("Slot:\t00:07.1", "Slot:\tbogus", 1);
        assert!(matches!(
            parse(&bad),
            Err(LspciError::BadSlot { record: 4, .. })
        ));
        assert!(parse("").unwrap().is_empty());
    }
}
