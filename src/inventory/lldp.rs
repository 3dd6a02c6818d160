//! LLDP (IEEE 802.1AB): the switch port a NIC is cabled to, from one LLDPDU.
//!
//! Pure parsing of an Ethernet frame (ethertype 0x88cc, optionally behind one 802.1Q
//! tag) into a [`Neighbor`]. The mandatory TLVs (chassis ID, port ID, TTL) must be
//! there; the optional ones the inventory shows (port description, system name and
//! description, management address) are read when present; organisationally specific
//! TLVs (802.1, 802.3, LLDP-MED) are skipped. Malformed frames are errors, never
//! panics.
//!
//! Hand-written: the LLDP decoders on crates.io are either a 0.1 hobby crate
//! (`rust_lldp`) or a module inside a much larger program (erbium-core, a home-network
//! daemon; flowscope, a flow tracker; netget-tool), none worth the dependency for one
//! TLV walk. The tests run it over real captures and over every truncation of them.

use std::net::{Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The LLDP ethertype.
pub const ETHERTYPE: u16 = 0x88cc;
const ETHERTYPE_VLAN: u16 = 0x8100;

/// TLV types (802.1AB-2016 table 8-1).
const TLV_END: u8 = 0;
const TLV_CHASSIS_ID: u8 = 1;
const TLV_PORT_ID: u8 = 2;
const TLV_TTL: u8 = 3;
const TLV_PORT_DESCRIPTION: u8 = 4;
const TLV_SYSTEM_NAME: u8 = 5;
const TLV_SYSTEM_DESCRIPTION: u8 = 6;
const TLV_MANAGEMENT_ADDRESS: u8 = 8;

/// The switch (or host) at the other end of a NIC's cable, as its LLDPDU describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Neighbor {
    /// A MAC as `aa:bb:cc:dd:ee:ff`, a network address as text, else the ID as text
    /// (interface name, locally assigned) or hex when it is not printable.
    pub chassis_id: String,
    /// Same rendering as `chassis_id` (`Gi1/0/2`, a MAC, ...).
    pub port_id: String,
    /// Seconds the neighbour's information stays valid; 0 announces a shutdown.
    pub ttl_secs: u16,
    pub port_description: Option<String>,
    pub system_name: Option<String>,
    pub system_description: Option<String>,
    /// The first management address (IPv4 or IPv6 as text, a MAC, else hex).
    pub management_address: Option<String>,
}

/// Why a frame is not a usable LLDPDU.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LldpError {
    #[error("frame of {len} bytes is too short for an Ethernet header")]
    ShortFrame { len: usize },
    #[error("ethertype {ethertype:#06x} is not LLDP")]
    NotLldp { ethertype: u16 },
    #[error("TLV type {tlv_type} at offset {offset} claims {length} bytes, {left} left")]
    Truncated {
        offset: usize,
        tlv_type: u8,
        length: usize,
        left: usize,
    },
    #[error("{what} TLV has an invalid length {length}")]
    BadLength { what: &'static str, length: usize },
    #[error("mandatory {0} TLV missing")]
    Missing(&'static str),
    #[error("{0} TLV appears twice")]
    Duplicate(&'static str),
}

/// Parses an Ethernet frame carrying an LLDPDU (one 802.1Q tag is skipped).
pub fn parse_frame(frame: &[u8]) -> Result<Neighbor, LldpError> {
    let ethertype_at = |at: usize| -> Result<u16, LldpError> {
        match frame.get(at..at + 2) {
            Some(b) => Ok(u16::from_be_bytes([b[0], b[1]])),
            None => Err(LldpError::ShortFrame { len: frame.len() }),
        }
    };
    let mut at = 12;
    let mut ethertype = ethertype_at(at)?;
    if ethertype == ETHERTYPE_VLAN {
        at += 4;
        ethertype = ethertype_at(at)?;
    }
    if ethertype != ETHERTYPE {
        return Err(LldpError::NotLldp { ethertype });
    }
    parse_lldpdu(&frame[at + 2..])
}

/// Parses an LLDPDU (the frame's payload). Stops at the End TLV; bytes after it are
/// Ethernet padding. A PDU that runs out exactly on a TLV boundary without an End TLV
/// is accepted (some senders leave it out).
pub fn parse_lldpdu(pdu: &[u8]) -> Result<Neighbor, LldpError> {
    let mut n = Neighbor::default();
    let (mut chassis, mut port, mut ttl) = (false, false, false);
    let mut at = 0;
    while at < pdu.len() {
        let Some(h) = pdu.get(at..at + 2) else {
            return Err(LldpError::Truncated {
                offset: at,
                tlv_type: pdu[at] >> 1,
                length: 0,
                left: pdu.len() - at,
            });
        };
        let tlv_type = h[0] >> 1;
        let length = (usize::from(h[0] & 1) << 8) | usize::from(h[1]);
        let start = at + 2;
        let Some(value) = pdu.get(start..start + length) else {
            return Err(LldpError::Truncated {
                offset: at,
                tlv_type,
                length,
                left: pdu.len() - start,
            });
        };
        at = start + length;
        match tlv_type {
            TLV_END => break,
            TLV_CHASSIS_ID => {
                once(&mut chassis, "chassis ID")?;
                n.chassis_id = id(value, "chassis ID", |s| s == 4, |s| s == 5)?;
            }
            TLV_PORT_ID => {
                once(&mut port, "port ID")?;
                n.port_id = id(value, "port ID", |s| s == 3, |s| s == 4)?;
            }
            TLV_TTL => {
                once(&mut ttl, "TTL")?;
                let [a, b] = value else {
                    return Err(LldpError::BadLength {
                        what: "TTL",
                        length,
                    });
                };
                n.ttl_secs = u16::from_be_bytes([*a, *b]);
            }
            TLV_PORT_DESCRIPTION => n.port_description = Some(text(value)),
            TLV_SYSTEM_NAME => n.system_name = Some(text(value)),
            TLV_SYSTEM_DESCRIPTION => n.system_description = Some(text(value)),
            TLV_MANAGEMENT_ADDRESS if n.management_address.is_none() => {
                n.management_address = Some(management_address(value)?);
            }
            _ => {}
        }
    }
    for (seen, what) in [(chassis, "chassis ID"), (port, "port ID"), (ttl, "TTL")] {
        if !seen {
            return Err(LldpError::Missing(what));
        }
    }
    Ok(n)
}

fn once(seen: &mut bool, what: &'static str) -> Result<(), LldpError> {
    if std::mem::replace(seen, true) {
        return Err(LldpError::Duplicate(what));
    }
    Ok(())
}

/// A chassis or port ID: subtype byte, then 1..=255 bytes rendered by subtype.
fn id(
    value: &[u8],
    what: &'static str,
    is_mac: impl Fn(u8) -> bool,
    is_network_address: impl Fn(u8) -> bool,
) -> Result<String, LldpError> {
    let [subtype, rest @ ..] = value else {
        return Err(LldpError::BadLength { what, length: 0 });
    };
    if rest.is_empty() || rest.len() > 255 {
        return Err(LldpError::BadLength {
            what,
            length: value.len(),
        });
    }
    Ok(if is_mac(*subtype) && rest.len() == 6 {
        mac(rest)
    } else if is_network_address(*subtype) {
        address(rest)
    } else {
        text(rest)
    })
}

/// Management address TLV: string length, address family, address, then interface
/// numbering and an OID we do not need.
fn management_address(value: &[u8]) -> Result<String, LldpError> {
    let bad = || LldpError::BadLength {
        what: "management address",
        length: value.len(),
    };
    let (&len, rest) = value.split_first().ok_or_else(bad)?;
    let len = usize::from(len);
    if !(2..=32).contains(&len) {
        return Err(bad());
    }
    rest.get(..len).map(address).ok_or_else(bad)
}

/// An IANA address family number followed by the address.
fn address(b: &[u8]) -> String {
    match b {
        [1, a, b, c, d] => Ipv4Addr::new(*a, *b, *c, *d).to_string(),
        [2, rest @ ..] if rest.len() == 16 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(rest);
            Ipv6Addr::from(o).to_string()
        }
        [6, rest @ ..] if rest.len() == 6 => mac(rest),
        _ => hex::encode(b),
    }
}

fn mac(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Printable UTF-8 as is (trailing NULs some switches pad with removed), anything else
/// as hex.
fn text(b: &[u8]) -> String {
    let trimmed = b.strip_suffix(&[0]).unwrap_or(b);
    match std::str::from_utf8(trimmed) {
        Ok(s) if !s.chars().any(|c| c.is_control() && !c.is_whitespace()) => s.to_string(),
        _ => hex::encode(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames of a classic little-endian pcap file (the only kind the fixtures are).
    fn pcap_frames(bytes: &[u8]) -> Vec<&[u8]> {
        assert_eq!(&bytes[..4], &[0xd4, 0xc3, 0xb2, 0xa1], "little-endian pcap");
        let u32le = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        assert_eq!(u32le(20), 1, "linktype Ethernet");
        let mut out = Vec::new();
        let mut at = 24;
        while at + 16 <= bytes.len() {
            let caplen = u32le(at + 8) as usize;
            out.push(&bytes[at + 16..at + 16 + caplen]);
            at += 16 + caplen;
        }
        out
    }

    fn fixture(name: &str) -> Vec<u8> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/lldp")
            .join(name);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn cisco_catalyst_9k_full_neighbour() {
        let bytes = fixture("cisco-c9k-8023bt.pcap");
        let frames = pcap_frames(&bytes);
        assert_eq!(frames.len(), 1);
        let n = parse_frame(frames[0]).unwrap();
        assert_eq!(n.chassis_id, "c0:64:e4:a9:9b:80");
        assert_eq!(n.port_id, "Gi1/0/2");
        assert_eq!(n.ttl_secs, 120);
        assert_eq!(n.system_name.as_deref(), Some("cisco-bt-switch"));
        assert_eq!(n.port_description.as_deref(), Some("GigabitEthernet1/0/2"));
        let descr = n.system_description.unwrap();
        assert!(
            descr.starts_with("Cisco IOS Software [Gibraltar], Catalyst L3 Switch"),
            "{descr}"
        );
        assert!(descr.contains("Version 16.12.1"), "{descr}");
        assert_eq!(n.management_address.as_deref(), Some("192.168.1.1"));
    }

    #[test]
    fn cisco_sg200_with_med_tlvs_and_padding() {
        let bytes = fixture("cisco-sg200.pcap");
        let n = parse_frame(pcap_frames(&bytes)[0]).unwrap();
        // What lldpd's own test_pcap.py expects of this capture.
        assert_eq!(n.chassis_id, "00:35:35:35:35:35");
        assert_eq!(n.port_id, "g1");
        assert_eq!(n.ttl_secs, 120);
        assert_eq!(n.system_name, None);
        assert_eq!(n.management_address, None);
    }

    #[test]
    fn connectx_nic_minimal_frame() {
        let bytes = fixture("mellanox-connectx4lx.pcap");
        let n = parse_frame(pcap_frames(&bytes)[0]).unwrap();
        assert_eq!(n.chassis_id, "50:6b:4b:f6:1e:b3");
        assert_eq!(n.port_id, "50:6b:4b:f6:1e:b1");
        assert_eq!(n.ttl_secs, 48);
        assert_eq!(
            n.port_description.as_deref(),
            Some("ConnectX-4 Lx, 25G/10G/1G SFP")
        );
        assert_eq!(n.system_name, None);
    }

    #[test]
    fn every_truncation_of_a_real_frame_is_an_error_or_a_prefix_parse() {
        for name in [
            "cisco-c9k-8023bt.pcap",
            "cisco-sg200.pcap",
            "mellanox-connectx4lx.pcap",
        ] {
            let bytes = fixture(name);
            let frame = pcap_frames(&bytes)[0];
            for len in 0..frame.len() {
                // Must not panic; a cut inside the mandatory TLVs must fail.
                let r = parse_frame(&frame[..len]);
                if len < 14 + 9 {
                    assert!(r.is_err(), "{name} cut at {len}: {r:?}");
                }
            }
        }
    }

    #[test]
    fn malformed_frames() {
        let bytes = fixture("cisco-c9k-8023bt.pcap");
        let good = pcap_frames(&bytes)[0].to_vec();
        let cases: Vec<(&str, Vec<u8>, LldpError)> = vec![
            ("empty", vec![], LldpError::ShortFrame { len: 0 }),
            (
                "IPv4 ethertype",
                {
                    let mut f = good.clone();
                    f[12..14].copy_from_slice(&[0x08, 0x00]);
                    f
                },
                LldpError::NotLldp { ethertype: 0x0800 },
            ),
            (
                "chassis ID claims 511 bytes",
                {
                    let mut f = good.clone();
                    f[14] |= 1;
                    f[15] = 0xff;
                    f
                },
                LldpError::Truncated {
                    offset: 0,
                    tlv_type: 1,
                    length: 511,
                    left: good.len() - 16,
                },
            ),
            (
                "TTL of 3 bytes",
                [
                    &good[..14],
                    &[0x02, 0x02, 0x04, 0xaa, 0x06, 0x03, 0, 0, 120, 0, 0][..],
                ]
                .concat(),
                LldpError::BadLength {
                    what: "TTL",
                    length: 3,
                },
            ),
            (
                "no port ID",
                [
                    &good[..14],
                    &[0x02, 0x02, 0x07, b'x', 0x06, 0x02, 0, 120, 0, 0][..],
                ]
                .concat(),
                LldpError::Missing("port ID"),
            ),
            (
                "empty chassis ID",
                [&good[..14], &[0x02, 0x01, 0x04, 0, 0][..]].concat(),
                LldpError::BadLength {
                    what: "chassis ID",
                    length: 1,
                },
            ),
            (
                "two chassis IDs",
                [
                    &good[..14],
                    &[0x02, 0x02, 0x07, b'x', 0x02, 0x02, 0x07, b'y'][..],
                ]
                .concat(),
                LldpError::Duplicate("chassis ID"),
            ),
        ];
        for (what, frame, want) in cases {
            assert_eq!(parse_frame(&frame), Err(want), "{what}");
        }
    }

    #[test]
    fn vlan_tagged_frame() {
        let bytes = fixture("mellanox-connectx4lx.pcap");
        let frame = pcap_frames(&bytes)[0];
        let tagged = [&frame[..12], &[0x81, 0x00, 0x00, 0x0a], &frame[12..]].concat();
        assert_eq!(parse_frame(&tagged), parse_frame(frame));
        assert!(parse_frame(&tagged).is_ok());
    }
}
