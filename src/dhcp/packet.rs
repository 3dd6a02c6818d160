//! Wire format: validating and parsing requests, encoding replies.
//!
//! Every packet is checked by hand before dhcproto sees it: dhcproto 0.15 has
//! `debug_assert!`s and unchecked subtractions on some option lengths (80, 81, 94,
//! 151..155), so a hostile packet could panic a debug build. The raw walk also
//! keeps option 82 byte for byte, so relays get it back unchanged.

use std::net::{Ipv4Addr, SocketAddrV4};

use dhcproto::v4::{DhcpOption, Message, MessageType, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};

use crate::boot::ClientInfo;

/// Largest request we accept (an Ethernet frame's worth, with room for jumbo relays).
pub const MAX_PACKET: usize = 2048;
/// Fixed BOOTP header plus the magic cookie.
const HEADER: usize = 240;
const MAGIC: [u8; 4] = [99, 130, 83, 99];
/// BOOTP relays and old PXE ROMs expect replies of at least 300 bytes.
const MIN_REPLY: usize = 300;

pub use crate::model::Mac;

/// Why a packet was not parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("truncated ({len} bytes)")]
    Truncated { len: usize },
    #[error("oversized ({len} bytes)")]
    Oversized { len: usize },
    #[error("not a BOOTREQUEST (op {op})")]
    WrongOp { op: u8 },
    #[error("not Ethernet (htype {htype}, hlen {hlen})")]
    BadHardware { htype: u8, hlen: u8 },
    #[error("bad magic cookie")]
    BadMagic,
    #[error("option {code} overruns the packet")]
    OptionOverrun { code: u8 },
    #[error("option {code} has a bad length {len}")]
    OptionLength { code: u8, len: usize },
    #[error("no message type (option 53)")]
    NoMessageType,
    #[error("dhcproto could not decode it")]
    Decode,
}

/// Which server port a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// 67: DHCP (full or proxy).
    Dhcp,
    /// 4011: PXE boot server requests (proxy mode).
    PxeBoot,
}

/// A validated client request, with the fields `decide` needs pulled out.
#[derive(Debug, Clone)]
pub struct Request {
    pub msg: Message,
    pub msg_type: MessageType,
    pub mac: Mac,
    pub requested_ip: Option<Ipv4Addr>,
    pub server_id: Option<Ipv4Addr>,
    pub client_id: Option<Vec<u8>>,
    pub hostname: Option<String>,
    /// Option 97 (client machine UUID), echoed to PXE clients.
    pub machine_id: Option<Vec<u8>>,
    /// Option 82 exactly as received (code, length and data of every instance).
    pub relay_info: Option<Vec<u8>>,
    pub client: ClientInfo,
    pub src: SocketAddrV4,
    pub port: Port,
}

impl Request {
    /// `ciaddr` of the request.
    pub fn ciaddr(&self) -> Ipv4Addr {
        self.msg.ciaddr()
    }
    /// `giaddr` of the request (set by relays).
    pub fn giaddr(&self) -> Ipv4Addr {
        self.msg.giaddr()
    }
}

/// Fixed lengths dhcproto relies on; anything else is `Malformed::OptionLength`.
fn length_ok(code: u8, len: usize) -> bool {
    match code {
        53 | 52 => len == 1,
        1 | 16 | 28 | 32 | 50 | 54 | 118 | 150 => len == 4,
        2 | 24 | 35 | 38 | 51 | 58 | 59 | 91 | 106 | 152..=155 => len == 4,
        13 | 22 | 26 | 57 => len == 2,
        93 => len >= 2 && len.is_multiple_of(2),
        94 => len == 3,
        80 => len == 0,
        81 => len >= 3,
        151 => len >= 1,
        19 | 20 | 23 | 27 | 29..=31 | 34 | 36 | 37 | 39 | 46 | 116 | 156 | 157 => len == 1,
        _ => true,
    }
}

/// Checks the header and walks the options; returns the raw option 82 if present.
fn validate(buf: &[u8]) -> Result<Option<Vec<u8>>, Malformed> {
    if buf.len() > MAX_PACKET {
        return Err(Malformed::Oversized { len: buf.len() });
    }
    if buf.len() < HEADER {
        return Err(Malformed::Truncated { len: buf.len() });
    }
    if buf[0] != 1 {
        return Err(Malformed::WrongOp { op: buf[0] });
    }
    if buf[1] != 1 || buf[2] != 6 {
        return Err(Malformed::BadHardware {
            htype: buf[1],
            hlen: buf[2],
        });
    }
    if buf[236..240] != MAGIC {
        return Err(Malformed::BadMagic);
    }
    let mut relay: Option<Vec<u8>> = None;
    let mut seen_type = false;
    // The code and joined length of the current run of consecutive instances.
    let mut run: Option<(u8, usize)> = None;
    let mut i = HEADER;
    while i < buf.len() {
        let code = buf[i];
        match code {
            0 => {
                i += 1;
                run = None;
                continue;
            }
            255 => break,
            _ => {}
        }
        let Some(&len) = buf.get(i + 1) else {
            return Err(Malformed::OptionOverrun { code });
        };
        let len = len as usize;
        let end = i + 2 + len;
        if end > buf.len() {
            return Err(Malformed::OptionOverrun { code });
        }
        // dhcproto joins consecutive instances of a code (RFC 3396) and decodes them
        // as one option: check each piece (a fixed-length one split in two is still
        // wrong) and the joined length (two 3-byte option 94s make one of 6, which
        // trips dhcproto's `debug_assert!`).
        let joined = match run {
            Some((c, total)) if c == code => total + len,
            _ => len,
        };
        for len in [len, joined] {
            if !length_ok(code, len) {
                return Err(Malformed::OptionLength { code, len });
            }
        }
        run = Some((code, joined));
        match code {
            53 => seen_type = true,
            82 => relay
                .get_or_insert_with(Vec::new)
                .extend_from_slice(&buf[i..end]),
            _ => {}
        }
        i = end;
    }
    if !seen_type {
        return Err(Malformed::NoMessageType);
    }
    Ok(relay)
}

/// True if option 77 carries the class `iPXE`: iPXE sends the bare string, RFC 3004
/// clients a list of length-prefixed classes.
fn user_class_is_ipxe(raw: &[u8]) -> bool {
    if raw == b"iPXE" {
        return true;
    }
    let mut rest = raw;
    while let Some((&len, tail)) = rest.split_first() {
        let len = len as usize;
        if len == 0 || len > tail.len() {
            return false;
        }
        if &tail[..len] == b"iPXE" {
            return true;
        }
        rest = &tail[len..];
    }
    false
}

/// Validates and parses one datagram received on `port` from `src`.
pub fn parse(buf: &[u8], src: SocketAddrV4, port: Port) -> Result<Request, Malformed> {
    let relay_info = validate(buf)?;
    // Belt and braces: the checks above cover every panic we know of in dhcproto;
    // an unknown one must still not take the receive loop down.
    let msg = std::panic::catch_unwind(|| Message::decode(&mut Decoder::new(buf)))
        .map_err(|_| Malformed::Decode)?
        .map_err(|_| Malformed::Decode)?;
    let opts = msg.opts();
    let msg_type = opts.msg_type().ok_or(Malformed::NoMessageType)?;
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&msg.chaddr()[..6]);
    let mac = Mac(mac);
    let requested_ip = match opts.get(OptionCode::RequestedIpAddress) {
        Some(DhcpOption::RequestedIpAddress(ip)) => Some(*ip),
        _ => None,
    };
    let server_id = match opts.get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(ip)) => Some(*ip),
        _ => None,
    };
    let client_id = match opts.get(OptionCode::ClientIdentifier) {
        Some(DhcpOption::ClientIdentifier(id)) => Some(id.clone()),
        _ => None,
    };
    let hostname = match opts.get(OptionCode::Hostname) {
        Some(DhcpOption::Hostname(h)) => Some(h.clone()),
        _ => None,
    };
    let machine_id = match opts.get(OptionCode::ClientMachineIdentifier) {
        Some(DhcpOption::ClientMachineIdentifier(id)) => Some(id.clone()),
        _ => None,
    };
    let vendor_class = match opts.get(OptionCode::ClassIdentifier) {
        Some(DhcpOption::ClassIdentifier(v)) => Some(String::from_utf8_lossy(v).into_owned()),
        _ => None,
    };
    let arch = match opts.get(OptionCode::ClientSystemArchitecture) {
        Some(DhcpOption::ClientSystemArchitecture(a)) => Some(a.0),
        _ => None,
    };
    let user_class_ipxe = match opts.get(OptionCode::UserClass) {
        Some(DhcpOption::UserClass(v)) => user_class_is_ipxe(v),
        _ => false,
    };
    let ipxe_options = opts.contains(OptionCode::Unknown(175));
    let client = ClientInfo {
        mac,
        arch,
        vendor_class,
        user_class_ipxe,
        ipxe_options,
    };
    Ok(Request {
        msg_type,
        mac,
        requested_ip,
        server_id,
        client_id,
        hostname,
        machine_id,
        relay_info,
        client,
        src,
        port,
        msg,
    })
}

/// Encodes a reply, appending `relay_info` (raw option 82) unchanged before the end
/// option, and pads to the BOOTP minimum.
pub fn encode(
    msg: &Message,
    relay_info: Option<&[u8]>,
) -> Result<Vec<u8>, dhcproto::error::EncodeError> {
    let mut buf = Vec::with_capacity(576);
    msg.encode(&mut Encoder::new(&mut buf))?;
    if let Some(raw) = relay_info {
        // The encoder always ends with option 255: put option 82 before it.
        if buf.last() == Some(&255) {
            buf.pop();
        }
        buf.extend_from_slice(raw);
        buf.push(255);
    }
    if buf.len() < MIN_REPLY {
        buf.resize(MIN_REPLY, 0);
    }
    Ok(buf)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds a raw client packet with the given options (code, data).
    pub(crate) fn raw(mac: [u8; 6], opts: &[(u8, &[u8])]) -> Vec<u8> {
        let mut b = vec![0u8; HEADER];
        b[0] = 1;
        b[1] = 1;
        b[2] = 6;
        b[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        b[28..34].copy_from_slice(&mac);
        b[236..240].copy_from_slice(&MAGIC);
        for (code, data) in opts {
            b.push(*code);
            b.push(data.len() as u8);
            b.extend_from_slice(data);
        }
        b.push(255);
        b
    }

    fn src() -> SocketAddrV4 {
        "0.0.0.0:68".parse().unwrap()
    }

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

    #[test]
    fn parses_a_pxe_discover() {
        let p = raw(
            MAC,
            &[
                (53, &[1]),
                (93, &[0, 7]),
                (60, b"PXEClient:Arch:00007:UNDI:003016"),
                (77, b"iPXE"),
                (82, &[1, 3, b'a', b'b', b'c']),
            ],
        );
        let r = parse(&p, src(), Port::Dhcp).unwrap();
        assert_eq!(r.msg_type, MessageType::Discover);
        assert_eq!(r.mac.to_string(), "52:54:00:12:34:56");
        assert_eq!(r.client.arch, Some(7));
        assert!(r.client.user_class_ipxe);
        assert!(r.client.is_pxe_client());
        assert_eq!(
            r.relay_info.as_deref(),
            Some(&[82, 5, 1, 3, b'a', b'b', b'c'][..])
        );
    }

    #[test]
    fn malformed_packets_are_refused() {
        let good = raw(MAC, &[(53, &[1])]);
        assert!(parse(&good, src(), Port::Dhcp).is_ok());
        let cases: Vec<(Vec<u8>, Malformed)> = vec![
            (good[..100].to_vec(), Malformed::Truncated { len: 100 }),
            (
                vec![1u8; MAX_PACKET + 1],
                Malformed::Oversized {
                    len: MAX_PACKET + 1,
                },
            ),
            (
                {
                    let mut p = good.clone();
                    p[0] = 2;
                    p
                },
                Malformed::WrongOp { op: 2 },
            ),
            (
                {
                    let mut p = good.clone();
                    p[2] = 17;
                    p
                },
                Malformed::BadHardware { htype: 1, hlen: 17 },
            ),
            (
                {
                    let mut p = good.clone();
                    p[236] = 0;
                    p
                },
                Malformed::BadMagic,
            ),
            (raw(MAC, &[(12, b"host")]), Malformed::NoMessageType),
            (
                raw(MAC, &[(53, &[1]), (94, &[1])]),
                Malformed::OptionLength { code: 94, len: 1 },
            ),
            (
                raw(MAC, &[(53, &[1]), (80, &[1])]),
                Malformed::OptionLength { code: 80, len: 1 },
            ),
            (
                raw(MAC, &[(53, &[1]), (81, &[1])]),
                Malformed::OptionLength { code: 81, len: 1 },
            ),
            (
                raw(MAC, &[(53, &[1]), (151, &[])]),
                Malformed::OptionLength { code: 151, len: 0 },
            ),
            (
                {
                    let mut p = raw(MAC, &[(53, &[1])]);
                    p.pop();
                    p.extend_from_slice(&[12, 40, b'x']);
                    p
                },
                Malformed::OptionOverrun { code: 12 },
            ),
        ];
        for (p, want) in cases {
            assert_eq!(parse(&p, src(), Port::Dhcp).unwrap_err(), want);
        }
    }

    /// Found by the `dhcp_decide` fuzz target: two consecutive option 94s, each of the
    /// right length, were joined by dhcproto into one of 6 bytes and tripped its
    /// `debug_assert!(len == 3)` (a panic in debug builds, caught as `Decode`).
    #[test]
    fn joined_instances_are_checked_as_one_option() {
        let p = raw(MAC, &[(53, &[1]), (94, &[1, 0, 7]), (94, &[1, 3, 10])]);
        assert_eq!(
            parse(&p, src(), Port::Dhcp).unwrap_err(),
            Malformed::OptionLength { code: 94, len: 6 }
        );
        let p = raw(MAC, &[(53, &[1]), (152, &[0; 4]), (152, &[0; 4])]);
        assert_eq!(
            parse(&p, src(), Port::Dhcp).unwrap_err(),
            Malformed::OptionLength { code: 152, len: 8 }
        );
        // Not consecutive (another option, or a pad, between them): decoded one by
        // one, and fine.
        let p = raw(
            MAC,
            &[(53, &[1]), (94, &[1, 0, 7]), (60, b"x"), (94, &[1, 3, 10])],
        );
        assert!(parse(&p, src(), Port::Dhcp).is_ok());
        let mut p = raw(MAC, &[(53, &[1]), (94, &[1, 0, 7])]);
        p.pop();
        p.extend_from_slice(&[0, 94, 3, 1, 3, 10, 255]);
        assert!(parse(&p, src(), Port::Dhcp).is_ok());
    }

    #[test]
    fn random_garbage_never_panics() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let mut p = raw(MAC, &[(53, &[1])]);
            p.pop();
            let n = (next() % 64) as usize;
            for _ in 0..n {
                p.push(next() as u8);
            }
            let _ = parse(&p, src(), Port::Dhcp);
        }
    }

    #[test]
    fn user_class_forms() {
        assert!(user_class_is_ipxe(b"iPXE"));
        assert!(user_class_is_ipxe(b"\x03abc\x04iPXE"));
        assert!(!user_class_is_ipxe(b"\x05iPXE"));
        assert!(!user_class_is_ipxe(b"gPXE"));
    }

    #[test]
    fn option_82_is_put_back_before_end() {
        let mut m = Message::default();
        m.opts_mut()
            .insert(DhcpOption::MessageType(MessageType::Ack));
        let b = encode(&m, Some(&[82, 2, 1, 0])).unwrap();
        assert_eq!(b.len(), MIN_REPLY);
        let opts = &b[HEADER..];
        assert_eq!(&opts[..8], &[53, 1, 5, 82, 2, 1, 0, 255]);
    }
}
