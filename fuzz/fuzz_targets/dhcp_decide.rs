//! DHCP: datagram bytes → `dhcp::packet::parse` → `dhcp::decide` (full and proxy
//! mode) → `dhcp::packet::encode`, against a small fixed policy and a lease table that
//! carries over from one datagram to the next.
//!
//! Input: one or more raw datagrams separated by `--pxed--` (a corpus file that is a
//! single capture is a one-datagram session). Each datagram's `secs` field advances the
//! clock, so leases and offers expire during a session.
//!
//! Invariants, besides "no panic":
//! - a reply carries the request's xid and chaddr and encodes (≥ 300 bytes, option 82
//!   echoed byte for byte, decodes again with the same message type);
//! - full mode never offers or ACKs the server's own address, an address reserved for
//!   another MAC, or one another MAC holds (offered, bound or declined, unexpired);
//!   the change it asks for names the address in `yiaddr`; a NAK changes nothing;
//! - proxy mode never hands out an address and never changes the lease table.
#![no_main]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};

use libfuzzer_sys::fuzz_target;
use pxed::config::{BootConfig, DhcpMode, Pool, Reservation, Subnet};
use pxed::dhcp::packet::{encode, parse};
use pxed::dhcp::{
    Action, Change, Lease, LeaseState, LeaseTable, Mac, Policy, Port, Reply, ReplyKind, Request,
    decide,
};
use pxed::net::Interface;

const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const SEPARATOR: &[u8] = b"--pxed--";

fn subnet(a: u8, lo: u8, hi: u8) -> Subnet {
    Subnet {
        pool: Pool {
            start: Ipv4Addr::new(10, 0, a, lo),
            end: Ipv4Addr::new(10, 0, a, hi),
        },
        netmask: Ipv4Addr::new(255, 255, 255, 0),
        router: Some(Ipv4Addr::new(10, 0, a, 254)),
        dns: vec![Ipv4Addr::new(10, 0, a, 53)],
    }
}

fn policy(mode: DhcpMode) -> Policy {
    Policy {
        mode,
        // The pool includes the server's own address: it must be skipped.
        local: Some(subnet(0, 1, 4)),
        relay_subnets: vec![subnet(5, 10, 20)],
        domain: Some("lab".into()),
        lease_time: 3600,
        offer_hold: 10,
        decline_hold: 600,
        boot: BootConfig {
            bios: "undionly.kpxe".into(),
            uefi_x64: "snponly.efi".into(),
            uefi_arm64: "ipxe-arm64.efi".into(),
            http_x64: "snponly.efi".into(),
            http_arm64: "ipxe-arm64.efi".into(),
            per_mac: BTreeMap::from([(
                "52:54:00:00:00:05".parse::<Mac>().expect("literal"),
                "special.efi".to_string(),
            )]),
        },
        server_ip: None,
        http_port: 8080,
    }
}

fn iface() -> Interface {
    Interface {
        name: "br0".into(),
        addr: SERVER,
        netmask: Ipv4Addr::new(255, 255, 255, 0),
    }
}

fn mac(n: u8) -> Mac {
    Mac([0x52, 0x54, 0, 0, 0, n])
}

/// Reservations in and out of the pools, and leases loaded "from the store": one of
/// them on an address reserved for another MAC (the reservation was added later).
fn table() -> LeaseTable {
    let reservations = [
        Reservation {
            mac: mac(1).to_string(),
            ip: Ipv4Addr::new(10, 0, 0, 50),
            hostname: Some("node-1".into()),
        },
        Reservation {
            mac: mac(2).to_string(),
            ip: Ipv4Addr::new(10, 0, 0, 3),
            hostname: None,
        },
        Reservation {
            mac: mac(6).to_string(),
            ip: Ipv4Addr::new(10, 0, 5, 15),
            hostname: Some("relayed".into()),
        },
    ];
    let lease = |ip: Ipv4Addr, m: Mac, state, expires| Lease {
        ip,
        mac: m,
        client_id: None,
        hostname: None,
        state,
        expires,
    };
    LeaseTable::new(
        &reservations,
        [
            lease(Ipv4Addr::new(10, 0, 0, 2), mac(3), LeaseState::Bound, 5000),
            lease(Ipv4Addr::new(10, 0, 0, 3), mac(4), LeaseState::Bound, 4000),
            lease(
                Ipv4Addr::new(10, 0, 5, 11),
                mac(7),
                LeaseState::Declined,
                2000,
            ),
        ],
    )
}

fn split(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(data);
    std::iter::from_fn(move || {
        let r = rest?;
        match r.windows(SEPARATOR.len()).position(|w| w == SEPARATOR) {
            Some(i) => {
                rest = Some(&r[i + SEPARATOR.len()..]);
                Some(&r[..i])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

/// What every reply must be, whatever the mode.
fn check_reply(req: &Request, reply: &Reply) {
    let m = &reply.msg;
    assert_eq!(m.xid(), req.msg.xid(), "reply xid");
    assert_eq!(&m.chaddr()[..6], &req.mac.0[..], "reply chaddr");
    assert_eq!(m.giaddr(), req.giaddr(), "reply giaddr");
    let bytes = encode(m, req.relay_info.as_deref()).expect("a reply encodes");
    assert!(bytes.len() >= 300, "reply shorter than BOOTP minimum");
    if let Some(raw) = &req.relay_info {
        assert!(
            bytes.windows(raw.len()).any(|w| w == &raw[..]),
            "option 82 not echoed verbatim"
        );
    }
    use dhcproto::Decodable;
    let back = dhcproto::v4::Message::decode(&mut dhcproto::Decoder::new(&bytes))
        .expect("our own reply decodes");
    let want = match reply.kind {
        ReplyKind::Offer => dhcproto::v4::MessageType::Offer,
        ReplyKind::Ack => dhcproto::v4::MessageType::Ack,
        ReplyKind::Nak => dhcproto::v4::MessageType::Nak,
    };
    assert_eq!(back.opts().msg_type(), Some(want), "encoded message type");
}

/// Whether `ip` may go to `m` now, from the table as it was before the decision.
fn free_for(t: &LeaseTable, ip: Ipv4Addr, m: Mac, now: u64) -> bool {
    t.available(ip, m, now) && ip != SERVER
}

fn full_mode(req: &Request, t: &mut LeaseTable, pol: &Policy, now: u64) {
    let d = decide(req, t, pol, &iface(), now);
    match &d.action {
        Action::Reply { reply, change } => {
            check_reply(req, reply);
            let y = reply.msg.yiaddr();
            match (reply.kind, change) {
                (ReplyKind::Offer, Some(Change::Offer { ip, mac, until })) => {
                    assert_eq!((*ip, *mac), (y, req.mac), "offer change vs reply");
                    assert_eq!(*until, now + u64::from(pol.offer_hold));
                    assert!(
                        free_for(t, *ip, *mac, now),
                        "offered {ip} to {mac}, which is not free for it: {:?}",
                        t.by_ip(*ip)
                    );
                }
                (
                    ReplyKind::Ack,
                    Some(Change::Bind {
                        ip, mac, expires, ..
                    }),
                ) => {
                    assert_eq!((*ip, *mac), (y, req.mac), "bind change vs reply");
                    assert_eq!(*expires, now + u64::from(pol.lease_time));
                    assert!(
                        free_for(t, *ip, *mac, now),
                        "ACKed {ip} to {mac}, which is not free for it: {:?}",
                        t.by_ip(*ip)
                    );
                }
                // INFORM: an ACK without an address or a change.
                (ReplyKind::Ack, None) => assert_eq!(y, Ipv4Addr::UNSPECIFIED),
                (ReplyKind::Nak, None) => assert_eq!(y, Ipv4Addr::UNSPECIFIED),
                (k, c) => panic!("{k:?} with change {c:?}"),
            }
            if let Some(c) = change {
                t.apply(c);
            }
        }
        Action::Record(c) => {
            match c {
                Change::Release { ip, mac } | Change::Decline { ip, mac, .. } => {
                    assert_eq!(*mac, req.mac);
                    assert!(
                        t.by_ip(*ip).is_some_and(|l| l.mac == *mac),
                        "release/decline of {ip} that {mac} does not hold"
                    );
                }
                other => panic!("record of {other:?}"),
            }
            t.apply(c);
        }
        Action::Drop(_) => {}
    }
    if let Action::Reply {
        change: Some(Change::Bind { ip, mac, .. }),
        ..
    } = &d.action
    {
        assert_eq!(t.by_ip(*ip).map(|l| l.mac), Some(*mac), "bind applied");
        assert_eq!(t.by_mac(*mac).map(|l| l.ip), Some(*ip), "bind indexed");
    }
}

fn proxy_mode(req: &Request, t: &LeaseTable, pol: &Policy) {
    let d = decide(req, t, pol, &iface(), 0);
    match &d.action {
        Action::Reply { reply, change } => {
            assert!(change.is_none(), "proxy mode changes leases");
            assert_eq!(reply.msg.yiaddr(), Ipv4Addr::UNSPECIFIED);
            assert_ne!(reply.kind, ReplyKind::Nak);
            check_reply(req, reply);
        }
        Action::Record(c) => panic!("proxy mode records {c:?}"),
        Action::Drop(_) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let full = policy(DhcpMode::Full);
    let proxy = policy(DhcpMode::Proxy);
    let mut t = table();
    let mut now = 1000u64;
    for pkt in split(data).take(16) {
        if pkt.len() >= 10 {
            now += u64::from(u16::from_be_bytes([pkt[8], pkt[9]]));
        }
        for (port, src) in [
            (Port::Dhcp, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68)),
            (
                Port::PxeBoot,
                SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 77), 4011),
            ),
        ] {
            let Ok(req) = parse(pkt, src, port) else {
                continue;
            };
            assert_eq!(req.mac.0[..], req.msg.chaddr()[..6]);
            if port == Port::Dhcp {
                full_mode(&req, &mut t, &full, now);
            }
            proxy_mode(&req, &t, &proxy);
        }
        if pkt.get(3).is_some_and(|h| h & 1 == 1) {
            t.sweep(now);
        }
    }
});
