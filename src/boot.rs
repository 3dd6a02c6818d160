//! Boot decision: what a PXE client is told to fetch.
//!
//! A pure function of what the client said in its DHCP packet and the boot config,
//! shared by full and proxy DHCP. First match wins:
//!
//! | the client says | it gets |
//! |---|---|
//! | user class `iPXE` or option 175 | `http://<self>/boot/<mac>.ipxe` |
//! | option 60 `HTTPClient`, arch 16 / 19 | `HTTPClient` echoed, full URL of the iPXE EFI binary |
//! | arch 0 | TFTP `bios` (`undionly.kpxe`) |
//! | arch 6 / 7 / 9 | TFTP `uefi_x64` (`snponly.efi`) |
//! | arch 11 | TFTP `uefi_arm64` (`ipxe-arm64.efi`) |
//! | anything else | nothing (counted with its arch) |
//!
//! `boot.per_mac` replaces the file of the firmware rows (TFTP or HTTP boot) for one
//! MAC; it never replaces the iPXE script, or iPXE would chain itself forever.

use std::net::{Ipv4Addr, SocketAddr};

use crate::config::BootConfig;
use crate::model::Mac;

/// What the DHCP packet told us about the client's boot firmware.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientInfo {
    /// The client's hardware address (`chaddr`).
    pub mac: Mac,
    /// Option 93 (client system architecture), or the `Arch:` field of option 60.
    pub arch: Option<u16>,
    /// Option 60 (vendor class identifier), lossily decoded.
    pub vendor_class: Option<String>,
    /// Option 77 holds the class `iPXE`.
    pub user_class_ipxe: bool,
    /// Option 175 (iPXE encapsulated options) is present.
    pub ipxe_options: bool,
}

impl ClientInfo {
    /// Whether option 60 starts with `PXEClient`.
    pub fn is_pxe_client(&self) -> bool {
        self.vendor_class
            .as_deref()
            .is_some_and(|v| v.starts_with("PXEClient"))
    }

    /// Whether option 60 starts with `HTTPClient` (UEFI HTTP boot).
    pub fn is_http_client(&self) -> bool {
        self.vendor_class
            .as_deref()
            .is_some_and(|v| v.starts_with("HTTPClient"))
    }

    /// Whether this is iPXE itself (user class `iPXE` or option 175).
    pub fn is_ipxe(&self) -> bool {
        self.user_class_ipxe || self.ipxe_options
    }

    /// A network-boot client: iPXE, option 60 `PXEClient`/`HTTPClient`, or option 93.
    pub fn is_netboot(&self) -> bool {
        self.is_ipxe() || self.is_pxe_client() || self.is_http_client() || self.arch.is_some()
    }
}

/// The option 60 value echoed back to a boot client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VendorClass {
    /// `PXEClient`: TFTP boot (and iPXE).
    PxeClient,
    /// `HTTPClient`: UEFI HTTP boot.
    HttpClient,
}

impl VendorClass {
    /// The bytes that go in option 60.
    pub fn as_str(self) -> &'static str {
        match self {
            VendorClass::PxeClient => "PXEClient",
            VendorClass::HttpClient => "HTTPClient",
        }
    }
}

/// How the boot file is fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootKind {
    /// iPXE fetches its per-node script over HTTP.
    IpxeScript,
    /// UEFI HTTP boot of an iPXE binary.
    Http,
    /// Firmware PXE loads an iPXE binary over TFTP from `next_server`.
    Tftp,
}

/// Boot information for a client that gets an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootReply {
    pub kind: BootKind,
    /// The file field / option 67: a TFTP file name or a full URL.
    pub file: String,
    /// siaddr (and option 66).
    pub next_server: Ipv4Addr,
    /// Option 60 to echo.
    pub vendor_class: VendorClass,
}

/// The outcome of [`choose`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootDecision {
    /// Tell the client what to boot.
    Boot(BootReply),
    /// Not a network-boot client: no boot information at all.
    NotNetboot,
    /// A boot client of an architecture we have nothing for (`None`: it sent none).
    UnknownArch(Option<u16>),
}

/// The base URL of pxed's HTTP server as seen by clients: `http://ip` or `http://ip:port`.
pub fn http_base(server_ip: Ipv4Addr, http: SocketAddr) -> String {
    match http.port() {
        80 => format!("http://{server_ip}"),
        p => format!("http://{server_ip}:{p}"),
    }
}

/// Reads the architecture from a PXE vendor class (`PXEClient:Arch:00007:UNDI:003016`).
pub fn arch_from_vendor_class(vc: &str) -> Option<u16> {
    let mut parts = vc.split(':');
    while let Some(p) = parts.next() {
        if p == "Arch" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

/// Decides what `client` boots. `http_base` is [`http_base`] for this server.
pub fn choose(
    client: &ClientInfo,
    cfg: &BootConfig,
    server_ip: Ipv4Addr,
    http_base: &str,
) -> BootDecision {
    if client.is_ipxe() {
        return BootDecision::Boot(BootReply {
            kind: BootKind::IpxeScript,
            file: format!("{http_base}/boot/{}.ipxe", client.mac),
            next_server: server_ip,
            vendor_class: VendorClass::PxeClient,
        });
    }
    if !client.is_netboot() {
        return BootDecision::NotNetboot;
    }
    let arch = client.arch.or_else(|| {
        client
            .vendor_class
            .as_deref()
            .and_then(arch_from_vendor_class)
    });
    let per_mac = cfg.per_mac.get(&client.mac);
    if client.is_http_client() {
        let file = match arch {
            Some(16) => &cfg.http_x64,
            Some(19) => &cfg.http_arm64,
            other => return BootDecision::UnknownArch(other),
        };
        let file = per_mac.unwrap_or(file);
        return BootDecision::Boot(BootReply {
            kind: BootKind::Http,
            file: format!("{http_base}/ipxe/{file}"),
            next_server: server_ip,
            vendor_class: VendorClass::HttpClient,
        });
    }
    let file = match arch {
        Some(0) => &cfg.bios,
        Some(6 | 7 | 9) => &cfg.uefi_x64,
        Some(11) => &cfg.uefi_arm64,
        other => return BootDecision::UnknownArch(other),
    };
    BootDecision::Boot(BootReply {
        kind: BootKind::Tftp,
        file: per_mac.unwrap_or(file).clone(),
        next_server: server_ip,
        vendor_class: VendorClass::PxeClient,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const MAC: Mac = Mac([0x52, 0x54, 0, 0x12, 0x34, 0x56]);
    const IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const BASE: &str = "http://10.0.0.1:8080";

    fn cfg() -> BootConfig {
        BootConfig {
            bios: "undionly.kpxe".into(),
            uefi_x64: "snponly.efi".into(),
            uefi_arm64: "ipxe-arm64.efi".into(),
            http_x64: "ipxe-x64-http.efi".into(),
            http_arm64: "ipxe-arm64-http.efi".into(),
            per_mac: BTreeMap::new(),
        }
    }

    fn pxe(arch: u16) -> ClientInfo {
        ClientInfo {
            mac: MAC,
            arch: Some(arch),
            vendor_class: Some(format!("PXEClient:Arch:{arch:05}:UNDI:003016")),
            ..Default::default()
        }
    }

    fn http(arch: u16) -> ClientInfo {
        ClientInfo {
            vendor_class: Some(format!("HTTPClient:Arch:{arch:05}:UNDI:003000")),
            ..pxe(arch)
        }
    }

    fn tftp(file: &str) -> BootDecision {
        BootDecision::Boot(BootReply {
            kind: BootKind::Tftp,
            file: file.into(),
            next_server: IP,
            vendor_class: VendorClass::PxeClient,
        })
    }

    fn script() -> BootDecision {
        BootDecision::Boot(BootReply {
            kind: BootKind::IpxeScript,
            file: format!("{BASE}/boot/{MAC}.ipxe"),
            next_server: IP,
            vendor_class: VendorClass::PxeClient,
        })
    }

    fn http_url(file: &str) -> BootDecision {
        BootDecision::Boot(BootReply {
            kind: BootKind::Http,
            file: format!("{BASE}/ipxe/{file}"),
            next_server: IP,
            vendor_class: VendorClass::HttpClient,
        })
    }

    #[test]
    fn decision_table() {
        let ipxe_uc = ClientInfo {
            user_class_ipxe: true,
            ..pxe(7)
        };
        let ipxe_175 = ClientInfo {
            ipxe_options: true,
            ..pxe(0)
        };
        let ipxe_bare = ClientInfo {
            mac: MAC,
            user_class_ipxe: true,
            ..Default::default()
        };
        let no_93 = ClientInfo {
            arch: None,
            ..pxe(0)
        };
        let plain = ClientInfo {
            mac: MAC,
            vendor_class: Some("udhcp 1.36.1".into()),
            ..Default::default()
        };
        let cases: Vec<(&str, ClientInfo, BootDecision)> = vec![
            ("iPXE user class wins over arch 7", ipxe_uc, script()),
            ("option 175 wins over arch 0", ipxe_175, script()),
            ("iPXE without option 60", ipxe_bare, script()),
            ("HTTP boot x64", http(16), http_url("ipxe-x64-http.efi")),
            ("HTTP boot arm64", http(19), http_url("ipxe-arm64-http.efi")),
            (
                "HTTP boot other arch",
                http(15),
                BootDecision::UnknownArch(Some(15)),
            ),
            ("BIOS", pxe(0), tftp("undionly.kpxe")),
            (
                "arch from option 60 when 93 is missing",
                no_93,
                tftp("undionly.kpxe"),
            ),
            ("x86 UEFI", pxe(6), tftp("snponly.efi")),
            ("x64 UEFI", pxe(7), tftp("snponly.efi")),
            ("EFI BC", pxe(9), tftp("snponly.efi")),
            ("arm64 UEFI", pxe(11), tftp("ipxe-arm64.efi")),
            ("arm32 UEFI", pxe(10), BootDecision::UnknownArch(Some(10))),
            (
                "PXEClient arch 16 is not HTTP boot",
                pxe(16),
                BootDecision::UnknownArch(Some(16)),
            ),
            ("not a boot client", plain, BootDecision::NotNetboot),
            (
                "nothing at all",
                ClientInfo::default(),
                BootDecision::NotNetboot,
            ),
        ];
        for (name, client, want) in cases {
            assert_eq!(choose(&client, &cfg(), IP, BASE), want, "{name}");
        }
    }

    #[test]
    fn option_93_alone_is_a_boot_client() {
        let c = ClientInfo {
            mac: MAC,
            arch: Some(7),
            ..Default::default()
        };
        assert_eq!(choose(&c, &cfg(), IP, BASE), tftp("snponly.efi"));
    }

    #[test]
    fn per_mac_overrides_firmware_rows_only() {
        let mut c = cfg();
        c.per_mac.insert(MAC, "spark-snponly.efi".into());
        assert_eq!(choose(&pxe(11), &c, IP, BASE), tftp("spark-snponly.efi"));
        assert_eq!(choose(&pxe(0), &c, IP, BASE), tftp("spark-snponly.efi"));
        assert_eq!(
            choose(&http(19), &c, IP, BASE),
            http_url("spark-snponly.efi")
        );
        let ipxe = ClientInfo {
            user_class_ipxe: true,
            ..pxe(11)
        };
        assert_eq!(choose(&ipxe, &c, IP, BASE), script());
        let other = ClientInfo {
            mac: Mac([0x52, 0x54, 0, 0, 0, 1]),
            ..pxe(11)
        };
        assert_eq!(choose(&other, &c, IP, BASE), tftp("ipxe-arm64.efi"));
    }

    #[test]
    fn base_url_omits_port_80() {
        assert_eq!(
            http_base(IP, "0.0.0.0:80".parse().unwrap()),
            "http://10.0.0.1"
        );
        assert_eq!(
            http_base(IP, "0.0.0.0:8080".parse().unwrap()),
            "http://10.0.0.1:8080"
        );
        assert_eq!(
            arch_from_vendor_class("PXEClient:Arch:00011:UNDI:003016"),
            Some(11)
        );
        assert_eq!(arch_from_vendor_class("PXEClient"), None);
    }
}
