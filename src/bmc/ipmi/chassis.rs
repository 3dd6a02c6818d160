//! IPMI 2.0 chassis commands (netfn 0x00) that ipmi-rs 0.6 lacks, as `IpmiCommand`s:
//! Get Chassis Status (0x01), Chassis Control (0x02), Set/Get System Boot Options
//! (0x08/0x09) for parameter 5, the boot flags.

use ipmi_rs::connection::{IpmiCommand, Message, NetFn, NotEnoughData};

/// Set Session Privilege Level (App 0x3B, IPMI 2.0 §22.18). An RMCP+ session starts at
/// User level whatever RAKP asked for; chassis control and boot options need more.
#[derive(Debug, Clone, Copy)]
pub struct SetSessionPrivilege(pub u8);

/// Administrator privilege level.
pub const PRIVILEGE_ADMIN: u8 = 0x04;

impl From<SetSessionPrivilege> for Message {
    fn from(p: SetSessionPrivilege) -> Self {
        Message::new_request(NetFn::App, 0x3B, vec![p.0])
    }
}

impl IpmiCommand for SetSessionPrivilege {
    type Output = u8;
    type Error = NotEnoughData;

    fn parse_success_response(data: &[u8]) -> Result<Self::Output, Self::Error> {
        data.first().map(|p| p & 0x0f).ok_or(NotEnoughData)
    }
}

/// Get Chassis Status (IPMI 2.0 §28.2).
#[derive(Debug, Clone, Copy)]
pub struct GetChassisStatus;

/// Get Chassis Status response (first bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChassisStatus {
    /// System power is on.
    pub power_on: bool,
    /// Power overload.
    pub power_overload: bool,
    /// Power fault.
    pub power_fault: bool,
    /// Power control fault.
    pub power_control_fault: bool,
    /// Last power event byte, raw.
    pub last_power_event: u8,
}

impl From<GetChassisStatus> for Message {
    fn from(_: GetChassisStatus) -> Self {
        Message::new_request(NetFn::Chassis, 0x01, Vec::new())
    }
}

impl IpmiCommand for GetChassisStatus {
    type Output = ChassisStatus;
    type Error = NotEnoughData;

    fn parse_success_response(data: &[u8]) -> Result<Self::Output, Self::Error> {
        if data.len() < 3 {
            return Err(NotEnoughData);
        }
        Ok(ChassisStatus {
            power_on: data[0] & 0x01 != 0,
            power_overload: data[0] & 0x02 != 0,
            power_fault: data[0] & 0x08 != 0,
            power_control_fault: data[0] & 0x10 != 0,
            last_power_event: data[1],
        })
    }
}

/// Chassis Control (IPMI 2.0 §28.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChassisControl {
    /// Power down (forced).
    PowerDown = 0,
    /// Power up.
    PowerUp = 1,
    /// Power cycle (off, ≥1 s, on); BMCs may refuse it while off.
    PowerCycle = 2,
    /// Hard reset.
    HardReset = 3,
    /// Soft shutdown via ACPI.
    SoftShutdown = 5,
}

impl From<ChassisControl> for Message {
    fn from(c: ChassisControl) -> Self {
        Message::new_request(NetFn::Chassis, 0x02, vec![c as u8])
    }
}

impl IpmiCommand for ChassisControl {
    type Output = ();
    type Error = NotEnoughData;

    fn parse_success_response(_: &[u8]) -> Result<Self::Output, Self::Error> {
        Ok(())
    }
}

/// Boot device selector (parameter 5, data byte 2, bits 5:2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootDevice {
    /// No override.
    NoOverride,
    /// Force PXE.
    Pxe,
    /// Force boot from default hard drive.
    Disk,
    /// Force boot from default hard drive, safe mode.
    DiskSafe,
    /// Force diagnostic partition.
    Diagnostic,
    /// Force CD/DVD.
    Cd,
    /// Force BIOS setup.
    BiosSetup,
    /// Any other selector value.
    Other(u8),
}

impl BootDevice {
    fn selector(self) -> u8 {
        match self {
            BootDevice::NoOverride => 0,
            BootDevice::Pxe => 1,
            BootDevice::Disk => 2,
            BootDevice::DiskSafe => 3,
            BootDevice::Diagnostic => 4,
            BootDevice::Cd => 5,
            BootDevice::BiosSetup => 6,
            BootDevice::Other(v) => v & 0x0f,
        }
    }

    fn from_selector(v: u8) -> Self {
        match v & 0x0f {
            0 => BootDevice::NoOverride,
            1 => BootDevice::Pxe,
            2 => BootDevice::Disk,
            3 => BootDevice::DiskSafe,
            4 => BootDevice::Diagnostic,
            5 => BootDevice::Cd,
            6 => BootDevice::BiosSetup,
            o => BootDevice::Other(o),
        }
    }

    /// Name in Redfish's vocabulary, so both drivers read back alike.
    pub fn name(self) -> String {
        match self {
            BootDevice::NoOverride => "None".into(),
            BootDevice::Pxe => "Pxe".into(),
            BootDevice::Disk => "Hdd".into(),
            BootDevice::DiskSafe => "HddSafe".into(),
            BootDevice::Diagnostic => "Diags".into(),
            BootDevice::Cd => "Cd".into(),
            BootDevice::BiosSetup => "BiosSetup".into(),
            BootDevice::Other(v) => format!("selector {v:#x}"),
        }
    }
}

/// Boot flags, System Boot Options parameter 5 (IPMI 2.0 §28.13, table 28-14).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootFlags {
    /// Byte 1 bit 7: the flags are valid.
    pub valid: bool,
    /// Byte 1 bit 6: apply to all future boots (else next boot only).
    pub persistent: bool,
    /// Byte 1 bit 5: EFI boot (else PC-compatible legacy).
    pub efi: bool,
    /// Byte 2 bits 5:2.
    pub device: BootDevice,
}

impl BootFlags {
    /// The five data bytes.
    pub fn to_bytes(self) -> [u8; 5] {
        let b1 = (u8::from(self.valid) << 7)
            | (u8::from(self.persistent) << 6)
            | (u8::from(self.efi) << 5);
        [b1, self.device.selector() << 2, 0, 0, 0]
    }

    /// Parses the data bytes (at least two).
    pub fn from_bytes(d: &[u8]) -> Option<Self> {
        if d.len() < 2 {
            return None;
        }
        Some(BootFlags {
            valid: d[0] & 0x80 != 0,
            persistent: d[0] & 0x40 != 0,
            efi: d[0] & 0x20 != 0,
            device: BootDevice::from_selector(d[1] >> 2),
        })
    }
}

/// Set System Boot Options, parameter 5 (boot flags).
#[derive(Debug, Clone, Copy)]
pub struct SetBootFlags(pub BootFlags);

impl From<SetBootFlags> for Message {
    fn from(s: SetBootFlags) -> Self {
        let mut data = vec![0x05];
        data.extend_from_slice(&s.0.to_bytes());
        Message::new_request(NetFn::Chassis, 0x08, data)
    }
}

impl IpmiCommand for SetBootFlags {
    type Output = ();
    type Error = NotEnoughData;

    fn parse_success_response(_: &[u8]) -> Result<Self::Output, Self::Error> {
        Ok(())
    }
}

/// Get System Boot Options, parameter 5 (boot flags).
#[derive(Debug, Clone, Copy)]
pub struct GetBootFlags;

impl From<GetBootFlags> for Message {
    fn from(_: GetBootFlags) -> Self {
        // parameter selector, set selector, block selector
        Message::new_request(NetFn::Chassis, 0x09, vec![0x05, 0x00, 0x00])
    }
}

impl IpmiCommand for GetBootFlags {
    type Output = BootFlags;
    type Error = NotEnoughData;

    fn parse_success_response(data: &[u8]) -> Result<Self::Output, Self::Error> {
        // [parameter version, parameter valid(bit 7 = invalid/locked) | selector, data...]
        if data.len() < 4 || data[1] & 0x7f != 0x05 {
            return Err(NotEnoughData);
        }
        BootFlags::from_bytes(&data[2..]).ok_or(NotEnoughData)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pxe_once_uefi_encoding() {
        let f = BootFlags {
            valid: true,
            persistent: false,
            efi: true,
            device: BootDevice::Pxe,
        };
        assert_eq!(f.to_bytes(), [0xA0, 0x04, 0, 0, 0]);
        assert_eq!(BootFlags::from_bytes(&f.to_bytes()), Some(f));
        let m: Message = SetBootFlags(f).into();
        assert_eq!((m.netfn_raw(), m.cmd()), (0x00, 0x08));
        assert_eq!(m.data(), &[0x05, 0xA0, 0x04, 0, 0, 0]);
        let legacy = BootFlags { efi: false, ..f };
        assert_eq!(legacy.to_bytes()[0], 0x80);
    }

    #[test]
    fn parses_ipmi_sim_readback() {
        // ipmitool raw 0x00 0x09 0x05 0x00 0x00 against ipmi_sim after bootdev pxe
        let f = GetBootFlags::parse_success_response(&[0x01, 0x05, 0x00, 0x04, 0, 0, 0]).unwrap();
        assert_eq!(f.device, BootDevice::Pxe);
        assert!(!f.valid && !f.efi && !f.persistent);
        assert!(GetBootFlags::parse_success_response(&[0x01, 0x04, 0, 0]).is_err());
        assert!(GetBootFlags::parse_success_response(&[0x01]).is_err());
    }

    #[test]
    fn chassis_status_and_control() {
        let s = GetChassisStatus::parse_success_response(&[0x01, 0x00, 0x00]).unwrap();
        assert!(s.power_on);
        let s = GetChassisStatus::parse_success_response(&[0x00, 0x10, 0x00, 0x00]).unwrap();
        assert!(!s.power_on);
        assert!(GetChassisStatus::parse_success_response(&[0x01]).is_err());
        let m: Message = ChassisControl::PowerCycle.into();
        assert_eq!((m.netfn_raw(), m.cmd(), m.data()), (0x00, 0x02, &[2u8][..]));
    }
}
