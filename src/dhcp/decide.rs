//! The pure DHCP decision: (request, lease table, policy, interface, now) → what to do.

use std::net::{Ipv4Addr, SocketAddrV4};

use dhcproto::v4::{DhcpOption, Flags, HType, Message, MessageType, Opcode, OptionCode};

use crate::boot::{self, BootDecision, BootReply, VendorClass};
use crate::config::{BootConfig, Config, DhcpMode, Subnet};
use crate::net::Interface;

use super::packet::{Port, Request};
use super::table::{Change, LeaseTable};

/// PXE vendor options (option 43): discovery control (6) = 8, "the boot file is in
/// this packet, skip boot server discovery", then end.
pub const PXE_VENDOR_OPTS: [u8; 4] = [6, 1, 8, 255];

/// Everything `decide` needs from the configuration, resolved once at start.
#[derive(Debug, Clone)]
pub struct Policy {
    pub mode: DhcpMode,
    pub local: Option<Subnet>,
    pub relay_subnets: Vec<Subnet>,
    pub domain: Option<String>,
    /// Lease time, seconds.
    pub lease_time: u32,
    /// How long an offered address is held for its client, seconds.
    pub offer_hold: u32,
    /// How long a declined address stays out of the pool, seconds.
    pub decline_hold: u32,
    pub boot: BootConfig,
    /// The address clients fetch boot files from; the interface address if `None`.
    pub server_ip: Option<Ipv4Addr>,
    /// HTTP listen port (for boot URLs).
    pub http_port: u16,
}

impl Policy {
    /// Resolves the DHCP policy from the daemon config.
    pub fn from_config(cfg: &Config) -> Policy {
        Policy {
            mode: cfg.dhcp.mode,
            local: cfg.dhcp.local.clone(),
            relay_subnets: cfg.dhcp.relay_subnets.clone(),
            domain: cfg.dhcp.domain.clone(),
            lease_time: cfg.dhcp.lease_time.as_secs().min(u32::MAX as u64) as u32,
            offer_hold: 10,
            decline_hold: 600,
            boot: cfg.boot.clone(),
            server_ip: cfg.server_ip,
            http_port: cfg.http.port(),
        }
    }
}

/// The kind of reply, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    Offer,
    Ack,
    Nak,
}

/// A reply ready to encode and send.
#[derive(Debug, Clone)]
pub struct Reply {
    pub kind: ReplyKind,
    pub msg: Message,
    pub dest: SocketAddrV4,
}

/// Why nothing is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Proxy mode: not a network-boot client.
    NotNetboot,
    /// Proxy mode: a boot client of an architecture we have nothing for.
    UnknownArch(Option<u16>),
    /// The client talks to another server (server identifier is not ours).
    OtherServer,
    /// No subnet for this client (unknown relay, or no local pool).
    NoSubnet,
    /// No free address.
    PoolExhausted,
    /// A message type a server does not answer, or not in this mode.
    Unexpected(MessageType),
    /// A REQUEST that fits none of RFC 2131 §4.3.2's cases.
    BadRequest,
    /// RELEASE/DECLINE of an address this client does not hold.
    NotHeld,
}

/// What to do with a request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Send `reply`; if `change` persists anything, only after the commit.
    Reply {
        reply: Reply,
        change: Option<Change>,
    },
    /// No reply, but the lease table changes (RELEASE, DECLINE).
    Record(Change),
    /// Nothing to do.
    Drop(DropReason),
}

/// The decision and, for counting, what the boot table said.
#[derive(Debug, Clone)]
pub struct Decision {
    pub action: Action,
    pub boot: BootDecision,
}

const BROADCAST: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::BROADCAST, 68);

/// Decides the answer to `req`, which arrived on `iface`. Pure: `now` is Unix seconds.
pub fn decide(
    req: &Request,
    table: &LeaseTable,
    policy: &Policy,
    iface: &Interface,
    now: u64,
) -> Decision {
    let server_ip = policy.server_ip.unwrap_or(iface.addr);
    let base = boot::http_base(
        server_ip,
        SocketAddrV4::new(server_ip, policy.http_port).into(),
    );
    let boot = boot::choose(&req.client, &policy.boot, server_ip, &base);
    let action = match policy.mode {
        DhcpMode::Proxy => proxy(req, &boot, iface),
        DhcpMode::Full => full(req, table, policy, iface, &boot, now),
        DhcpMode::Off => Action::Drop(DropReason::Unexpected(req.msg_type)),
    };
    Decision { action, boot }
}

fn proxy(req: &Request, boot: &BootDecision, iface: &Interface) -> Action {
    let b = match boot {
        BootDecision::Boot(b) => b,
        BootDecision::NotNetboot => return Action::Drop(DropReason::NotNetboot),
        BootDecision::UnknownArch(a) => return Action::Drop(DropReason::UnknownArch(*a)),
    };
    let kind = match (req.port, req.msg_type) {
        (Port::Dhcp, MessageType::Discover) => ReplyKind::Offer,
        (Port::Dhcp, MessageType::Request) if req.server_id == Some(iface.addr) => ReplyKind::Ack,
        (Port::Dhcp, MessageType::Request) => return Action::Drop(DropReason::OtherServer),
        (Port::PxeBoot, MessageType::Request | MessageType::Inform) => ReplyKind::Ack,
        (_, t) => return Action::Drop(DropReason::Unexpected(t)),
    };
    let mut msg = skeleton(req, kind, iface.addr);
    add_boot(&mut msg, b, req);
    let dest = if req.giaddr() != Ipv4Addr::UNSPECIFIED {
        SocketAddrV4::new(req.giaddr(), 67)
    } else if req.port == Port::PxeBoot && !req.src.ip().is_unspecified() {
        req.src
    } else {
        BROADCAST
    };
    Action::Reply {
        reply: Reply { kind, msg, dest },
        change: None,
    }
}

/// The subnet a request belongs to: the relay's (by giaddr) or the local one.
fn subnet_for<'a>(req: &Request, policy: &'a Policy) -> Option<&'a Subnet> {
    let gi = req.giaddr();
    if gi.is_unspecified() {
        policy.local.as_ref()
    } else {
        policy
            .relay_subnets
            .iter()
            .chain(policy.local.as_ref())
            .find(|s| s.contains(gi))
    }
}

fn full(
    req: &Request,
    table: &LeaseTable,
    policy: &Policy,
    iface: &Interface,
    boot: &BootDecision,
    now: u64,
) -> Action {
    let mac = req.mac;
    let cx = Cx {
        req,
        table,
        policy,
        boot,
    };
    let ours = |sid: Option<Ipv4Addr>| sid.is_none_or(|s| s == iface.addr);
    match req.msg_type {
        MessageType::Discover => {
            let Some(subnet) = subnet_for(req, policy) else {
                return Action::Drop(DropReason::NoSubnet);
            };
            let usable = |ip: Ipv4Addr| {
                ip != iface.addr && subnet.contains(ip) && table.available(ip, mac, now)
            };
            let in_pool = |ip: Ipv4Addr| subnet.pool.contains(ip) && usable(ip);
            // Reservations win over the pool; then the client's own lease, then the
            // address it asks for, then the next free one. A reserved address another
            // client still holds (its lease predates the reservation) is not offered:
            // the client gets a pool address until that lease ends.
            let ip = table
                .reservation(mac)
                .map(|(ip, _)| ip)
                .filter(|ip| usable(*ip))
                .or_else(|| table.by_mac(mac).map(|l| l.ip).filter(|ip| in_pool(*ip)))
                .or_else(|| req.requested_ip.filter(|ip| in_pool(*ip)))
                .or_else(|| table.find_free(&subnet.pool, mac, iface.addr, now));
            let Some(ip) = ip else {
                return Action::Drop(DropReason::PoolExhausted);
            };
            let change = Change::Offer {
                ip,
                mac,
                until: now + policy.offer_hold as u64,
            };
            let mut msg = skeleton(req, ReplyKind::Offer, iface.addr);
            msg.set_yiaddr(ip);
            answer(msg, ReplyKind::Offer, &cx, subnet, true, Some(change))
        }
        MessageType::Request => {
            let ciaddr = req.ciaddr();
            // RFC 2131 §4.3.2: selecting (server id), init-reboot (option 50, no
            // ciaddr), renewing/rebinding (ciaddr, no option 50).
            let ip = match (req.server_id, req.requested_ip, ciaddr.is_unspecified()) {
                (Some(sid), _, _) if sid != iface.addr => {
                    return Action::Drop(DropReason::OtherServer);
                }
                (Some(_), Some(ip), _) => ip,
                (Some(_), None, false) => ciaddr,
                (None, Some(ip), true) => ip,
                (None, None, false) => ciaddr,
                (None, Some(ip), false) => ip,
                _ => return Action::Drop(DropReason::BadRequest),
            };
            let selecting = req.server_id.is_some();
            let subnet = subnet_for(req, policy);
            let nak = |why: &'static str| {
                tracing::debug!(%mac, %ip, why, "DHCPNAK");
                let mut msg = skeleton(req, ReplyKind::Nak, iface.addr);
                msg.opts_mut().insert(DhcpOption::Message(why.into()));
                reply(req, ReplyKind::Nak, msg, None)
            };
            let Some(subnet) = subnet.filter(|s| s.contains(ip)) else {
                if subnet.is_none() && !selecting {
                    // Not a network we serve at all: another server's client.
                    return Action::Drop(DropReason::NoSubnet);
                }
                return nak("wrong subnet");
            };
            if let Some((reserved, _)) = table.reservation(mac)
                && reserved != ip
                && subnet.contains(reserved)
                && table.available(reserved, mac, now)
            {
                return nak("address is reserved elsewhere for this client");
            }
            if !table.available(ip, mac, now) || ip == iface.addr {
                return nak("address taken");
            }
            let reserved = table.reservation(mac).is_some_and(|(r, _)| r == ip);
            let held = table.by_ip(ip).is_some_and(|l| l.mac == mac);
            if !reserved && !held && !subnet.pool.contains(ip) {
                return nak("address not ours");
            }
            let change = Change::Bind {
                ip,
                mac,
                client_id: req.client_id.clone(),
                hostname: req.hostname.clone(),
                expires: now + policy.lease_time as u64,
            };
            let mut msg = skeleton(req, ReplyKind::Ack, iface.addr);
            msg.set_yiaddr(ip);
            if !ciaddr.is_unspecified() {
                msg.set_ciaddr(ciaddr);
            }
            answer(msg, ReplyKind::Ack, &cx, subnet, true, Some(change))
        }
        MessageType::Decline => {
            let Some(ip) = req.requested_ip else {
                return Action::Drop(DropReason::BadRequest);
            };
            if !ours(req.server_id) {
                return Action::Drop(DropReason::OtherServer);
            }
            if table.by_ip(ip).is_none_or(|l| l.mac != mac) {
                return Action::Drop(DropReason::NotHeld);
            }
            Action::Record(Change::Decline {
                ip,
                mac,
                until: now + policy.decline_hold as u64,
            })
        }
        MessageType::Release => {
            let ip = req.ciaddr();
            if !ours(req.server_id) {
                return Action::Drop(DropReason::OtherServer);
            }
            if table.by_ip(ip).is_none_or(|l| l.mac != mac) {
                return Action::Drop(DropReason::NotHeld);
            }
            Action::Record(Change::Release { ip, mac })
        }
        MessageType::Inform => {
            let ciaddr = req.ciaddr();
            let Some(subnet) = subnet_for(req, policy).filter(|s| {
                ciaddr.is_unspecified() || s.contains(ciaddr) || !req.giaddr().is_unspecified()
            }) else {
                return Action::Drop(DropReason::NoSubnet);
            };
            let mut msg = skeleton(req, ReplyKind::Ack, iface.addr);
            msg.set_ciaddr(ciaddr);
            answer(msg, ReplyKind::Ack, &cx, subnet, false, None)
        }
        t => Action::Drop(DropReason::Unexpected(t)),
    }
}

/// RFC 2131 §4.1. Without giaddr or ciaddr we broadcast rather than unicast to
/// yiaddr: the client has no ARP entry yet, and RFC 2131 allows broadcasting.
/// What every answer of [`full`] is built from.
struct Cx<'a> {
    req: &'a Request,
    table: &'a LeaseTable,
    policy: &'a Policy,
    boot: &'a BootDecision,
}

/// An OFFER or ACK: `msg` (the skeleton with its addresses set) plus the subnet's
/// options, the lease times when `lease` (not for INFORM) and the boot options.
fn answer(
    mut msg: Message,
    kind: ReplyKind,
    cx: &Cx<'_>,
    subnet: &Subnet,
    lease: bool,
    change: Option<Change>,
) -> Action {
    lease_options(&mut msg, subnet, cx.policy, cx.table, cx.req, lease);
    boot_options(&mut msg, cx.boot, cx.req);
    reply(cx.req, kind, msg, change)
}

/// Sends `msg` where RFC 2131 §4.1 says a reply of this kind goes.
fn reply(req: &Request, kind: ReplyKind, msg: Message, change: Option<Change>) -> Action {
    Action::Reply {
        reply: Reply {
            kind,
            dest: destination(req, kind),
            msg,
        },
        change,
    }
}

fn destination(req: &Request, kind: ReplyKind) -> SocketAddrV4 {
    let gi = req.giaddr();
    let ci = req.ciaddr();
    if !gi.is_unspecified() {
        SocketAddrV4::new(gi, 67)
    } else if kind == ReplyKind::Nak {
        BROADCAST
    } else if !ci.is_unspecified() {
        SocketAddrV4::new(ci, 68)
    } else {
        BROADCAST
    }
}

/// A reply with the request's xid, flags, giaddr and chaddr, message type and server id.
fn skeleton(req: &Request, kind: ReplyKind, server_id: Ipv4Addr) -> Message {
    let mut msg = Message::default();
    let mut flags = req.msg.flags();
    if kind == ReplyKind::Nak && !req.giaddr().is_unspecified() {
        // RFC 2131 §4.3.2: a relayed NAK must be broadcast by the relay.
        flags = flags.set_broadcast();
    }
    msg.set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_xid(req.msg.xid())
        .set_flags(Flags::new(u16::from(flags)))
        .set_giaddr(req.giaddr())
        .set_chaddr(&req.mac.0);
    let t = match kind {
        ReplyKind::Offer => MessageType::Offer,
        ReplyKind::Ack => MessageType::Ack,
        ReplyKind::Nak => MessageType::Nak,
    };
    let o = msg.opts_mut();
    o.insert(DhcpOption::MessageType(t));
    o.insert(DhcpOption::ServerIdentifier(server_id));
    msg
}

fn lease_options(
    msg: &mut Message,
    subnet: &Subnet,
    policy: &Policy,
    table: &LeaseTable,
    req: &Request,
    lease: bool,
) {
    let o = msg.opts_mut();
    o.insert(DhcpOption::SubnetMask(subnet.netmask));
    if let Some(r) = subnet.router {
        o.insert(DhcpOption::Router(vec![r]));
    }
    if !subnet.dns.is_empty() {
        o.insert(DhcpOption::DomainNameServer(subnet.dns.clone()));
    }
    if let Some(d) = &policy.domain {
        o.insert(DhcpOption::DomainName(d.clone()));
    }
    if let Some((_, Some(h))) = table.reservation(req.mac) {
        o.insert(DhcpOption::Hostname(h.to_string()));
    }
    if lease {
        let t = policy.lease_time;
        o.insert(DhcpOption::AddressLeaseTime(t));
        o.insert(DhcpOption::Renewal(t / 2));
        o.insert(DhcpOption::Rebinding((t as u64 * 7 / 8) as u32));
    }
}

/// Boot information for boot clients; other clients get none.
fn boot_options(msg: &mut Message, boot: &BootDecision, req: &Request) {
    match boot {
        BootDecision::Boot(b) => add_boot(msg, b, req),
        BootDecision::UnknownArch(arch) => {
            tracing::debug!(mac = %req.mac, ?arch, "no boot file for this architecture");
        }
        BootDecision::NotNetboot => {}
    }
}

fn add_boot(msg: &mut Message, b: &BootReply, req: &Request) {
    msg.set_siaddr(b.next_server);
    if b.file.len() < 128 {
        msg.set_fname_str(&b.file);
    }
    let o = msg.opts_mut();
    o.insert(DhcpOption::BootfileName(b.file.as_bytes().to_vec()));
    o.insert(DhcpOption::ClassIdentifier(
        b.vendor_class.as_str().as_bytes().to_vec(),
    ));
    if b.kind == boot::BootKind::Tftp {
        o.insert(DhcpOption::TFTPServerName(
            b.next_server.to_string().into_bytes(),
        ));
    }
    if b.vendor_class == VendorClass::PxeClient {
        o.insert(DhcpOption::VendorExtensions(PXE_VENDOR_OPTS.to_vec()));
    }
    if let Some(id) = &req.machine_id {
        o.insert(DhcpOption::ClientMachineIdentifier(id.clone()));
    }
    debug_assert!(o.contains(OptionCode::BootfileName));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Pool, Reservation};
    use crate::dhcp::packet::{Mac, parse, tests::raw};
    use std::collections::BTreeMap;

    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const MAC1: [u8; 6] = [0x52, 0x54, 0, 0, 0, 1];
    const MAC2: [u8; 6] = [0x52, 0x54, 0, 0, 0, 2];

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
            local: Some(subnet(0, 10, 12)),
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
                per_mac: BTreeMap::new(),
            },
            server_ip: None,
            http_port: 80,
        }
    }

    fn iface() -> Interface {
        Interface {
            name: "br0".into(),
            addr: SERVER,
            netmask: Ipv4Addr::new(255, 255, 255, 0),
        }
    }

    struct Pkt {
        mac: [u8; 6],
        opts: Vec<(u8, Vec<u8>)>,
        ciaddr: Ipv4Addr,
        giaddr: Ipv4Addr,
        port: Port,
    }

    fn pkt(t: u8, mac: [u8; 6]) -> Pkt {
        Pkt {
            mac,
            opts: vec![(53, vec![t])],
            ciaddr: Ipv4Addr::UNSPECIFIED,
            giaddr: Ipv4Addr::UNSPECIFIED,
            port: Port::Dhcp,
        }
    }

    impl Pkt {
        fn opt(mut self, code: u8, data: &[u8]) -> Pkt {
            self.opts.push((code, data.to_vec()));
            self
        }
        fn ip(self, code: u8, ip: Ipv4Addr) -> Pkt {
            self.opt(code, &ip.octets())
        }
        fn pxe(self, arch: u16) -> Pkt {
            self.opt(93, &arch.to_be_bytes()).opt(
                60,
                format!("PXEClient:Arch:{arch:05}:UNDI:003016").as_bytes(),
            )
        }
        fn req(&self) -> Request {
            let opts: Vec<(u8, &[u8])> = self.opts.iter().map(|(c, d)| (*c, &d[..])).collect();
            let mut b = raw(self.mac, &opts);
            b[12..16].copy_from_slice(&self.ciaddr.octets());
            b[24..28].copy_from_slice(&self.giaddr.octets());
            parse(&b, "0.0.0.0:68".parse().unwrap(), self.port).unwrap()
        }
    }

    fn run(p: &Pkt, t: &LeaseTable, pol: &Policy) -> Decision {
        decide(&p.req(), t, pol, &iface(), 1000)
    }

    fn reply(d: &Decision) -> (&Reply, Option<&Change>) {
        match &d.action {
            Action::Reply { reply, change } => (reply, change.as_ref()),
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    fn opt(m: &Message, c: OptionCode) -> Option<&DhcpOption> {
        m.opts().get(c)
    }

    /// Runs DISCOVER then REQUEST(selecting) for `mac`, applying both changes.
    fn dora(t: &mut LeaseTable, pol: &Policy, mac: [u8; 6]) -> Ipv4Addr {
        let d = run(&pkt(1, mac), t, pol);
        let (r, c) = reply(&d);
        let ip = r.msg.yiaddr();
        t.apply(c.unwrap());
        let d = run(&pkt(3, mac).ip(54, SERVER).ip(50, ip), t, pol);
        let (r, c) = reply(&d);
        assert_eq!(r.kind, ReplyKind::Ack);
        t.apply(c.unwrap());
        ip
    }

    #[test]
    fn discover_offers_with_lease_options_and_no_boot_for_plain_clients() {
        let t = LeaseTable::default();
        let d = run(&pkt(1, MAC1), &t, &policy(DhcpMode::Full));
        let (r, c) = reply(&d);
        assert_eq!(r.kind, ReplyKind::Offer);
        assert_eq!(r.msg.yiaddr(), Ipv4Addr::new(10, 0, 0, 10));
        assert_eq!(r.dest, BROADCAST);
        assert_eq!(
            opt(&r.msg, OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(SERVER))
        );
        assert_eq!(
            opt(&r.msg, OptionCode::AddressLeaseTime),
            Some(&DhcpOption::AddressLeaseTime(3600))
        );
        assert_eq!(
            opt(&r.msg, OptionCode::Renewal),
            Some(&DhcpOption::Renewal(1800))
        );
        assert_eq!(
            opt(&r.msg, OptionCode::Rebinding),
            Some(&DhcpOption::Rebinding(3150))
        );
        assert!(opt(&r.msg, OptionCode::Router).is_some());
        assert!(opt(&r.msg, OptionCode::DomainName).is_some());
        assert!(opt(&r.msg, OptionCode::BootfileName).is_none());
        assert!(matches!(c, Some(Change::Offer { until: 1010, .. })));
    }

    #[test]
    fn pxe_clients_get_boot_info_in_full_mode() {
        let t = LeaseTable::default();
        let d = run(&pkt(1, MAC1).pxe(7), &t, &policy(DhcpMode::Full));
        let (r, _) = reply(&d);
        assert_eq!(r.msg.siaddr(), SERVER);
        assert_eq!(r.msg.fname_str().unwrap().unwrap(), "snponly.efi");
        assert_eq!(
            opt(&r.msg, OptionCode::ClassIdentifier),
            Some(&DhcpOption::ClassIdentifier(b"PXEClient".to_vec()))
        );
        assert_eq!(
            opt(&r.msg, OptionCode::VendorExtensions),
            Some(&DhcpOption::VendorExtensions(PXE_VENDOR_OPTS.to_vec()))
        );
        // Unknown arch: an address, no boot file.
        let d = run(&pkt(1, MAC1).pxe(10), &t, &policy(DhcpMode::Full));
        assert_eq!(d.boot, BootDecision::UnknownArch(Some(10)));
        let (r, _) = reply(&d);
        assert!(opt(&r.msg, OptionCode::BootfileName).is_none());
        assert_ne!(r.msg.yiaddr(), Ipv4Addr::UNSPECIFIED);
    }

    #[test]
    fn full_dora_renew_and_nak_cases() {
        let pol = policy(DhcpMode::Full);
        let mut t = LeaseTable::default();
        let ip = dora(&mut t, &pol, MAC1);
        // Renewing: unicast to ciaddr.
        let mut p = pkt(3, MAC1);
        p.ciaddr = ip;
        let d = run(&p, &t, &pol);
        let (r, c) = reply(&d);
        assert_eq!(
            (r.kind, r.dest),
            (ReplyKind::Ack, SocketAddrV4::new(ip, 68))
        );
        assert!(matches!(c, Some(Change::Bind { expires: 4600, .. })));
        // Another client asking for the same address (init-reboot): taken.
        let d = run(&pkt(3, MAC2).ip(50, ip), &t, &pol);
        assert_eq!(reply(&d).0.kind, ReplyKind::Nak);
        assert_eq!(reply(&d).0.dest, BROADCAST);
        // Init-reboot into another subnet: wrong subnet.
        let d = run(&pkt(3, MAC1).ip(50, Ipv4Addr::new(10, 0, 9, 10)), &t, &pol);
        assert_eq!(reply(&d).0.kind, ReplyKind::Nak);
        // In the subnet but outside the pool: not ours.
        let d = run(&pkt(3, MAC2).ip(50, Ipv4Addr::new(10, 0, 0, 100)), &t, &pol);
        assert_eq!(reply(&d).0.kind, ReplyKind::Nak);
        // Selecting another server: silence.
        let d = run(
            &pkt(3, MAC2).ip(54, Ipv4Addr::new(10, 0, 0, 2)).ip(50, ip),
            &t,
            &pol,
        );
        assert!(matches!(d.action, Action::Drop(DropReason::OtherServer)));
        // A second DISCOVER re-offers the client's own lease.
        let d = run(&pkt(1, MAC1), &t, &pol);
        assert_eq!(reply(&d).0.msg.yiaddr(), ip);
    }

    #[test]
    fn two_discovers_get_different_addresses_and_pool_runs_out() {
        let pol = policy(DhcpMode::Full);
        let mut t = LeaseTable::default();
        let mut seen = Vec::new();
        for n in 1..=3u8 {
            let d = run(&pkt(1, [0x52, 0, 0, 0, 0, n]), &t, &pol);
            let (r, c) = reply(&d);
            seen.push(r.msg.yiaddr());
            t.apply(c.unwrap());
        }
        seen.dedup();
        assert_eq!(seen.len(), 3);
        let d = run(&pkt(1, [0x52, 0, 0, 0, 0, 9]), &t, &pol);
        assert!(matches!(d.action, Action::Drop(DropReason::PoolExhausted)));
    }

    #[test]
    fn reservations_win() {
        let pol = policy(DhcpMode::Full);
        let res = [Reservation {
            mac: Mac(MAC1).to_string(),
            ip: Ipv4Addr::new(10, 0, 0, 50),
            hostname: Some("node-1".into()),
        }];
        let mut t = LeaseTable::new(&res, []);
        let ip = dora(&mut t, &pol, MAC1);
        assert_eq!(ip, Ipv4Addr::new(10, 0, 0, 50));
        let d = run(&pkt(1, MAC1), &t, &pol);
        assert_eq!(
            opt(&reply(&d).0.msg, OptionCode::Hostname),
            Some(&DhcpOption::Hostname("node-1".into()))
        );
        // Nobody else gets it, and its owner is told to go there.
        let d = run(&pkt(3, MAC2).ip(50, ip), &t, &pol);
        assert_eq!(reply(&d).0.kind, ReplyKind::Nak);
        let d = run(&pkt(3, MAC1).ip(50, Ipv4Addr::new(10, 0, 0, 10)), &t, &pol);
        assert_eq!(reply(&d).0.kind, ReplyKind::Nak);
    }

    /// Found by the `dhcp_decide` fuzz target (a plain DISCOVER from the reserved MAC):
    /// a reservation added while another client held that address was offered anyway,
    /// then NAKed as taken, so its owner got no address until the other lease ended.
    #[test]
    fn reserved_address_held_by_another_client_is_not_offered() {
        let pol = policy(DhcpMode::Full);
        let reserved = Ipv4Addr::new(10, 0, 0, 11);
        let res = [Reservation {
            mac: Mac(MAC1).to_string(),
            ip: reserved,
            hostname: None,
        }];
        let stale = crate::dhcp::Lease {
            ip: reserved,
            mac: Mac(MAC2),
            client_id: None,
            hostname: None,
            state: crate::dhcp::LeaseState::Bound,
            expires: 5000,
        };
        let mut t = LeaseTable::new(&res, [stale]);
        // Meanwhile: a pool address, offered and ACKed.
        let ip = dora(&mut t, &pol, MAC1);
        assert_ne!(ip, reserved);
        assert_eq!(t.by_ip(reserved).unwrap().mac, Mac(MAC2));
        // Once the other client's lease is gone, the reservation wins again.
        let d = decide(&pkt(1, MAC1).req(), &t, &pol, &iface(), 5000);
        assert_eq!(reply(&d).0.msg.yiaddr(), reserved);
        let mut p = pkt(3, MAC1);
        p.ciaddr = ip;
        let d = decide(&p.req(), &t, &pol, &iface(), 5000);
        assert_eq!(reply(&d).0.kind, ReplyKind::Nak, "renewing the stopgap");
    }

    #[test]
    fn relayed_requests_use_the_relay_subnet() {
        let pol = policy(DhcpMode::Full);
        let t = LeaseTable::default();
        let mut p = pkt(1, MAC1).opt(82, &[1, 2, 0xab, 0xcd]);
        p.giaddr = Ipv4Addr::new(10, 0, 5, 1);
        let d = run(&p, &t, &pol);
        let (r, _) = reply(&d);
        assert_eq!(r.msg.yiaddr(), Ipv4Addr::new(10, 0, 5, 10));
        assert_eq!(r.msg.giaddr(), p.giaddr);
        assert_eq!(r.dest, SocketAddrV4::new(p.giaddr, 67));
        p.giaddr = Ipv4Addr::new(192, 168, 1, 1);
        assert!(matches!(
            run(&p, &t, &pol).action,
            Action::Drop(DropReason::NoSubnet)
        ));
    }

    #[test]
    fn decline_release_inform() {
        let pol = policy(DhcpMode::Full);
        let mut t = LeaseTable::default();
        let ip = dora(&mut t, &pol, MAC1);
        let d = run(&pkt(4, MAC2).ip(50, ip).ip(54, SERVER), &t, &pol);
        assert!(matches!(d.action, Action::Drop(DropReason::NotHeld)));
        let d = run(&pkt(4, MAC1).ip(50, ip).ip(54, SERVER), &t, &pol);
        let Action::Record(c) = d.action else {
            panic!()
        };
        t.apply(&c);
        let d = run(&pkt(1, MAC1), &t, &pol);
        assert_ne!(reply(&d).0.msg.yiaddr(), ip);
        let ip2 = dora(&mut t, &pol, MAC1);
        let mut p = pkt(7, MAC1).ip(54, SERVER);
        p.ciaddr = ip2;
        let Action::Record(c) = run(&p, &t, &pol).action else {
            panic!()
        };
        assert_eq!(
            c,
            Change::Release {
                ip: ip2,
                mac: Mac(MAC1)
            }
        );
        let mut p = pkt(8, MAC2).pxe(0);
        p.ciaddr = Ipv4Addr::new(10, 0, 0, 99);
        let d = run(&p, &t, &pol);
        let (r, c) = reply(&d);
        assert_eq!(r.kind, ReplyKind::Ack);
        assert!(c.is_none());
        assert_eq!(r.msg.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(r.dest, SocketAddrV4::new(p.ciaddr, 68));
        assert!(opt(&r.msg, OptionCode::AddressLeaseTime).is_none());
        assert_eq!(r.msg.fname_str().unwrap().unwrap(), "undionly.kpxe");
    }

    #[test]
    fn proxy_mode() {
        let pol = policy(DhcpMode::Proxy);
        let t = LeaseTable::default();
        let d = run(&pkt(1, MAC1), &t, &pol);
        assert!(matches!(d.action, Action::Drop(DropReason::NotNetboot)));
        let d = run(&pkt(1, MAC1).pxe(12), &t, &pol);
        assert!(matches!(
            d.action,
            Action::Drop(DropReason::UnknownArch(Some(12)))
        ));
        let d = run(&pkt(1, MAC1).pxe(0).opt(97, &[0; 17]), &t, &pol);
        let (r, c) = reply(&d);
        assert!(c.is_none());
        assert_eq!(r.kind, ReplyKind::Offer);
        assert_eq!(r.msg.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert!(opt(&r.msg, OptionCode::AddressLeaseTime).is_none());
        assert!(opt(&r.msg, OptionCode::SubnetMask).is_none());
        assert!(opt(&r.msg, OptionCode::ClientMachineIdentifier).is_some());
        assert_eq!(r.msg.fname_str().unwrap().unwrap(), "undionly.kpxe");
        assert_eq!(r.dest, BROADCAST);
        // Port 4011: answered to the sender.
        let mut p = pkt(3, MAC1).pxe(7);
        p.port = Port::PxeBoot;
        let mut req = p.req();
        req.src = "10.0.0.77:4011".parse().unwrap();
        let d = decide(&req, &t, &pol, &iface(), 0);
        let (r, _) = reply(&d);
        assert_eq!((r.kind, r.dest), (ReplyKind::Ack, req.src));
        // A REQUEST for the real DHCP server is not ours.
        let d = run(
            &pkt(3, MAC1).pxe(7).ip(54, Ipv4Addr::new(10, 0, 0, 2)),
            &t,
            &pol,
        );
        assert!(matches!(d.action, Action::Drop(DropReason::OtherServer)));
    }

    #[test]
    fn http_boot_and_ipxe_urls() {
        let mut pol = policy(DhcpMode::Full);
        pol.http_port = 8080;
        let t = LeaseTable::default();
        let d = run(
            &pkt(1, MAC1)
                .opt(60, b"HTTPClient:Arch:00016:UNDI:003001")
                .opt(93, &[0, 16]),
            &t,
            &pol,
        );
        let (r, _) = reply(&d);
        assert_eq!(
            r.msg.fname_str().unwrap().unwrap(),
            "http://10.0.0.1:8080/ipxe/snponly.efi"
        );
        assert_eq!(
            opt(&r.msg, OptionCode::ClassIdentifier),
            Some(&DhcpOption::ClassIdentifier(b"HTTPClient".to_vec()))
        );
        let d = run(&pkt(1, MAC1).pxe(7).opt(77, b"iPXE"), &t, &pol);
        assert_eq!(
            reply(&d).0.msg.fname_str().unwrap().unwrap(),
            "http://10.0.0.1:8080/boot/52:54:00:00:00:01.ipxe"
        );
    }
}
