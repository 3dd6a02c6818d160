//! TFTP wire format (RFC 1350, RFC 2347): parsing of what clients send, encoding of
//! what the server sends. Parsing never panics; anything that does not fit is a
//! [`Malformed`] reason the caller counts and drops.

/// Read request.
pub const RRQ: u16 = 1;
/// Write request.
pub const WRQ: u16 = 2;
/// Data block.
pub const DATA: u16 = 3;
/// Acknowledgement.
pub const ACK: u16 = 4;
/// Error.
pub const ERROR: u16 = 5;
/// Option acknowledgement (RFC 2347).
pub const OACK: u16 = 6;

/// The largest request accepted. RFC 2347 limits requests to 512 octets; we allow
/// twice that because some firmware pads generously, and drop anything larger.
pub const MAX_REQUEST: usize = 1024;

/// TFTP error codes (RFC 1350, RFC 2347).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// Not defined; see the message.
    Undefined = 0,
    /// File not found.
    NotFound = 1,
    /// Access violation.
    AccessViolation = 2,
    /// Illegal TFTP operation.
    IllegalOperation = 4,
    /// Unknown transfer ID.
    UnknownTid = 5,
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("shorter than an opcode")]
    Truncated,
    #[error("larger than {MAX_REQUEST} bytes")]
    Oversized,
    #[error("opcode {0} is not a request")]
    NotARequest(u16),
    #[error("file name is not NUL-terminated")]
    UnterminatedFilename,
    #[error("mode is missing or not NUL-terminated")]
    MissingMode,
    #[error("mode or option is not ASCII")]
    NotAscii,
}

/// Transfer mode of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Bytes as they are.
    Octet,
    /// Text with CR LF line ends (RFC 764).
    Netascii,
    /// Anything else (e.g. the obsolete "mail"), refused.
    Other,
}

/// A parsed RRQ or WRQ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    /// WRQ rather than RRQ.
    pub write: bool,
    /// Raw file name bytes (not necessarily UTF-8).
    pub filename: &'a [u8],
    pub mode: Mode,
    /// Options in the order sent, names as sent (compare case-insensitively).
    pub options: Vec<(&'a str, &'a str)>,
}

/// Splits off one NUL-terminated field.
fn field(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = buf.iter().position(|&b| b == 0)?;
    Some((&buf[..end], &buf[end + 1..]))
}

fn ascii(b: &[u8]) -> Result<&str, Malformed> {
    if b.is_ascii() {
        // ASCII is UTF-8.
        std::str::from_utf8(b).map_err(|_| Malformed::NotAscii)
    } else {
        Err(Malformed::NotAscii)
    }
}

/// Parses a request arriving at the listening port.
///
/// Options are parsed leniently: firmware in the field pads requests with extra
/// NULs or cuts the last option short, so an empty option name or a trailing
/// name without a value is ignored rather than refusing the whole request.
pub fn parse_request(buf: &[u8]) -> Result<Request<'_>, Malformed> {
    if buf.len() > MAX_REQUEST {
        return Err(Malformed::Oversized);
    }
    if buf.len() < 2 {
        return Err(Malformed::Truncated);
    }
    let op = u16::from_be_bytes([buf[0], buf[1]]);
    let write = match op {
        RRQ => false,
        WRQ => true,
        other => return Err(Malformed::NotARequest(other)),
    };
    let (filename, rest) = field(&buf[2..]).ok_or(Malformed::UnterminatedFilename)?;
    let (mode, mut rest) = field(rest).ok_or(Malformed::MissingMode)?;
    let mode = ascii(mode)?;
    if mode.is_empty() {
        return Err(Malformed::MissingMode);
    }
    let mode = if mode.eq_ignore_ascii_case("octet") {
        Mode::Octet
    } else if mode.eq_ignore_ascii_case("netascii") {
        Mode::Netascii
    } else {
        Mode::Other
    };
    let mut options = Vec::new();
    while let Some((name, after)) = field(rest) {
        let Some((value, after)) = field(after) else {
            break;
        };
        rest = after;
        if name.is_empty() {
            continue;
        }
        options.push((ascii(name)?, ascii(value)?));
    }
    Ok(Request {
        write,
        filename,
        mode,
        options,
    })
}

/// What a client sends on a transfer's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientPacket<'a> {
    /// ACK of a (wire) block number.
    Ack(u16),
    /// The client gives up.
    Error { code: u16, message: &'a [u8] },
    /// Anything else: ignored.
    Other,
}

/// Parses a packet on a transfer's socket.
pub fn parse_client(buf: &[u8]) -> ClientPacket<'_> {
    if buf.len() < 4 {
        return ClientPacket::Other;
    }
    let op = u16::from_be_bytes([buf[0], buf[1]]);
    let arg = u16::from_be_bytes([buf[2], buf[3]]);
    match op {
        ACK => ClientPacket::Ack(arg),
        ERROR => {
            let msg = &buf[4..];
            let msg = msg.split(|&b| b == 0).next().unwrap_or(msg);
            ClientPacket::Error {
                code: arg,
                message: msg,
            }
        }
        _ => ClientPacket::Other,
    }
}

/// Encodes an ERROR packet into `out` (cleared first).
pub fn encode_error(out: &mut Vec<u8>, code: ErrorCode, message: &str) {
    out.clear();
    out.extend_from_slice(&ERROR.to_be_bytes());
    out.extend_from_slice(&(code as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out.push(0);
}

/// Encodes an OACK packet into `out` (cleared first).
pub fn encode_oack(out: &mut Vec<u8>, options: &[(&str, String)]) {
    out.clear();
    out.extend_from_slice(&OACK.to_be_bytes());
    for (name, value) in options {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
}

/// Writes the DATA header for wire block `block` into the first 4 bytes of `pkt`.
pub fn put_data_header(pkt: &mut [u8], block: u16) {
    pkt[..2].copy_from_slice(&DATA.to_be_bytes());
    pkt[2..4].copy_from_slice(&block.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(parts: &[&[u8]]) -> Vec<u8> {
        let mut v = RRQ.to_be_bytes().to_vec();
        for p in parts {
            v.extend_from_slice(p);
            v.push(0);
        }
        v
    }

    #[test]
    fn rrq_with_options() {
        let b = req(&[b"a/b.efi", b"OCTET", b"blksize", b"1468", b"tsize", b"0"]);
        let r = parse_request(&b).unwrap();
        assert!(!r.write);
        assert_eq!(r.filename, b"a/b.efi");
        assert_eq!(r.mode, Mode::Octet);
        assert_eq!(r.options, vec![("blksize", "1468"), ("tsize", "0")]);
    }

    #[test]
    fn modes() {
        assert_eq!(
            parse_request(&req(&[b"f", b"NetAscii"])).unwrap().mode,
            Mode::Netascii
        );
        assert_eq!(
            parse_request(&req(&[b"f", b"mail"])).unwrap().mode,
            Mode::Other
        );
        let mut w = req(&[b"f", b"octet"]);
        w[1] = WRQ as u8;
        assert!(parse_request(&w).unwrap().write);
    }

    #[test]
    fn malformed() {
        assert_eq!(parse_request(&[]), Err(Malformed::Truncated));
        assert_eq!(parse_request(&[0]), Err(Malformed::Truncated));
        assert_eq!(parse_request(&[0, 4, 0, 1]), Err(Malformed::NotARequest(4)));
        assert_eq!(parse_request(&[0, 9]), Err(Malformed::NotARequest(9)));
        assert_eq!(
            parse_request(b"\0\x01file"),
            Err(Malformed::UnterminatedFilename)
        );
        assert_eq!(parse_request(b"\0\x01file\0"), Err(Malformed::MissingMode));
        assert_eq!(
            parse_request(b"\0\x01file\0octet"),
            Err(Malformed::MissingMode)
        );
        assert_eq!(
            parse_request(b"\0\x01file\0\0"),
            Err(Malformed::MissingMode)
        );
        assert_eq!(
            parse_request(b"\0\x01f\0oc\xfft\0"),
            Err(Malformed::NotAscii)
        );
        let big = req(&[&[b'a'; 2000], b"octet"]);
        assert_eq!(parse_request(&big), Err(Malformed::Oversized));
    }

    #[test]
    fn lenient_options() {
        // Padding NULs and a trailing name without a value are ignored.
        let mut b = req(&[b"f", b"octet", b"", b"", b"blksize", b"512"]);
        b.extend_from_slice(b"tsize\0");
        let r = parse_request(&b).unwrap();
        assert_eq!(r.options, vec![("blksize", "512")]);
    }

    #[test]
    fn client_packets() {
        assert_eq!(parse_client(&[0, 4, 0xff, 0xfe]), ClientPacket::Ack(0xfffe));
        assert_eq!(
            parse_client(b"\0\x05\0\x08abort\0junk"),
            ClientPacket::Error {
                code: 8,
                message: b"abort"
            }
        );
        assert_eq!(
            parse_client(b"\0\x05\0\x08"),
            ClientPacket::Error {
                code: 8,
                message: b""
            }
        );
        assert_eq!(parse_client(&[0, 4, 0]), ClientPacket::Other);
        assert_eq!(parse_client(&[0, 3, 0, 1, 9]), ClientPacket::Other);
    }

    #[test]
    fn encoders() {
        let mut v = Vec::new();
        encode_error(&mut v, ErrorCode::AccessViolation, "no");
        assert_eq!(v, b"\0\x05\0\x02no\0");
        encode_oack(&mut v, &[("blksize", "1468".into()), ("tsize", "7".into())]);
        assert_eq!(v, b"\0\x06blksize\x001468\0tsize\x007\0");
        let mut p = [9u8; 6];
        put_data_header(&mut p, 0x0102);
        assert_eq!(p, [0, 3, 1, 2, 9, 9]);
    }
}
