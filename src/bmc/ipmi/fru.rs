//! IPMI FRU inventory (Platform Management FRU Information Storage Definition v1.0
//! rev 1.3): the Storage commands that read it (Get FRU Inventory Area Info 0x10,
//! Read FRU Data 0x11; ipmi-rs 0.6 has neither) and a pure parser for the chassis,
//! board and product areas, which is all a BMC with only IPMI says about the machine.
//!
//! Hand-written: ipmi-rs has no FRU support and no maintained Rust crate parses FRU
//! areas; the format is small (a common header, then type/length-prefixed fields).

use ipmi_rs::connection::{IpmiCommand, Message, NetFn, NotEnoughData};

use crate::inventory::System;

/// Why FRU data could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FruError {
    /// Fewer bytes than the common header.
    #[error("FRU data too short: {0} bytes")]
    TooShort(usize),
    /// Not format version 1, or a header checksum that does not add up: not FRU data.
    #[error("FRU common header invalid (version {version:#04x}, checksum ok: {checksum_ok})")]
    BadHeader {
        /// Format version byte.
        version: u8,
        /// Whether the header bytes sum to 0.
        checksum_ok: bool,
    },
}

/// Get FRU Inventory Area Info (Storage 0x10, IPMI 2.0 §34.1): the size in bytes.
#[derive(Debug, Clone, Copy)]
pub struct GetFruAreaInfo(pub u8);

impl From<GetFruAreaInfo> for Message {
    fn from(c: GetFruAreaInfo) -> Self {
        Message::new_request(NetFn::Storage, 0x10, vec![c.0])
    }
}

impl IpmiCommand for GetFruAreaInfo {
    type Output = u16;
    type Error = NotEnoughData;

    fn parse_success_response(data: &[u8]) -> Result<Self::Output, Self::Error> {
        match data {
            [lo, hi, ..] => Ok(u16::from_le_bytes([*lo, *hi])),
            _ => Err(NotEnoughData),
        }
    }
}

/// Read FRU Data (Storage 0x11, IPMI 2.0 §34.2): `count` bytes from `offset`.
#[derive(Debug, Clone, Copy)]
pub struct ReadFruData {
    /// FRU device id (0: the one on the BMC, the system's).
    pub device: u8,
    /// Byte offset.
    pub offset: u16,
    /// Bytes wanted (the BMC may return fewer).
    pub count: u8,
}

impl From<ReadFruData> for Message {
    fn from(c: ReadFruData) -> Self {
        let [lo, hi] = c.offset.to_le_bytes();
        Message::new_request(NetFn::Storage, 0x11, vec![c.device, lo, hi, c.count])
    }
}

impl IpmiCommand for ReadFruData {
    type Output = Vec<u8>;
    type Error = NotEnoughData;

    fn parse_success_response(data: &[u8]) -> Result<Self::Output, Self::Error> {
        let (n, rest) = data.split_first().ok_or(NotEnoughData)?;
        rest.get(..usize::from(*n))
            .map(<[u8]>::to_vec)
            .ok_or(NotEnoughData)
    }
}

/// Bytes per Read FRU Data: small enough for every BMC's IPMB buffer.
pub const READ_CHUNK: u8 = 16;

/// The fields of the chassis, board and product areas pxed uses; empty where absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fru {
    /// Chassis part number.
    pub chassis_part: String,
    /// Chassis serial number.
    pub chassis_serial: String,
    /// Board manufacturer.
    pub board_manufacturer: String,
    /// Board product name.
    pub board_product: String,
    /// Board serial number.
    pub board_serial: String,
    /// Board part number.
    pub board_part: String,
    /// Product manufacturer.
    pub product_manufacturer: String,
    /// Product name.
    pub product_name: String,
    /// Product part/model number.
    pub product_part: String,
    /// Product serial number.
    pub product_serial: String,
    /// Areas whose checksum did not add up (read anyway: some BMCs get it wrong).
    pub bad_checksums: Vec<&'static str>,
}

impl Fru {
    /// What the machine says it is: the product area first (it describes the system),
    /// the board's where the product area leaves a field empty, the chassis serial last.
    pub fn system(&self) -> System {
        let first = |a: &str, b: &str| if a.is_empty() { b } else { a }.to_string();
        System {
            vendor: first(&self.product_manufacturer, &self.board_manufacturer),
            model: first(&self.product_name, &self.board_product),
            serial: first(
                &self.product_serial,
                first(&self.board_serial, &self.chassis_serial).as_str(),
            ),
        }
    }
}

/// The byte ranges a reader needs: the header, then each area's first two bytes give
/// its length. Offsets and lengths are in multiples of 8.
pub fn area_offsets(header: &[u8]) -> Result<[Option<usize>; 3], FruError> {
    let h = header.get(..8).ok_or(FruError::TooShort(header.len()))?;
    let checksum_ok = h.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0;
    if h[0] & 0x0f != 1 || !checksum_ok {
        return Err(FruError::BadHeader {
            version: h[0],
            checksum_ok,
        });
    }
    let at = |i: usize| (h[i] != 0).then(|| usize::from(h[i]) * 8);
    Ok([at(2), at(3), at(4)])
}

/// Decodes one type/length field; `None` at the end marker (0xC1) or past the data.
fn field(data: &[u8], pos: &mut usize) -> Option<String> {
    let tl = *data.get(*pos)?;
    if tl == 0xc1 {
        return None;
    }
    let len = usize::from(tl & 0x3f);
    let bytes = data.get(*pos + 1..*pos + 1 + len)?;
    *pos += 1 + len;
    let s = match tl >> 6 {
        // 8-bit ASCII + Latin-1.
        3 => bytes.iter().map(|b| char::from(*b)).collect::<String>(),
        // 6-bit packed ASCII: four characters in three bytes, little-endian.
        2 => {
            let mut out = String::new();
            for c in bytes.chunks(3) {
                let v = c.iter().rev().fold(0u32, |a, b| (a << 8) | u32::from(*b));
                for i in 0..(c.len() * 8 / 6) {
                    out.push(char::from(((v >> (6 * i)) & 0x3f) as u8 + 0x20));
                }
            }
            out
        }
        // BCD plus: digits, space, dash, dot.
        1 => bytes
            .iter()
            .flat_map(|b| [b >> 4, b & 0x0f])
            .map(|n| match n {
                0..=9 => char::from(b'0' + n),
                0xa => ' ',
                0xb => '-',
                0xc => '.',
                _ => '?',
            })
            .collect(),
        // Binary: not a name.
        _ => String::new(),
    };
    Some(
        s.trim_matches(|c: char| c.is_whitespace() || c == '\0')
            .to_string(),
    )
}

/// The fields of the area at `off` after its fixed bytes (`skip`), up to `n` of them.
fn area(
    data: &[u8],
    off: usize,
    skip: usize,
    n: usize,
    name: &'static str,
    bad: &mut Vec<&'static str>,
) -> Vec<String> {
    let len = data.get(off + 1).map_or(0, |l| usize::from(*l) * 8);
    if let Some(a) = data.get(off..off + len)
        && a.iter().fold(0u8, |s, b| s.wrapping_add(*b)) != 0
    {
        bad.push(name);
    }
    let mut pos = off + skip;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        match field(data, &mut pos) {
            Some(s) => out.push(s),
            None => break,
        }
    }
    out.resize(n, String::new());
    out
}

/// Parses FRU data (as read from offset 0). Area checksums that do not add up are
/// noted, not fatal; a bad common header is.
pub fn parse(data: &[u8]) -> Result<Fru, FruError> {
    let [chassis, board, product] = area_offsets(data)?;
    let mut f = Fru::default();
    let mut bad = vec![];
    if let Some(o) = chassis {
        // version, length, chassis type; part number, serial.
        let v = area(data, o, 3, 2, "chassis", &mut bad);
        [f.chassis_part, f.chassis_serial] = [v[0].clone(), v[1].clone()];
    }
    if let Some(o) = board {
        // version, length, language, 3 bytes manufacturing date.
        let v = area(data, o, 6, 4, "board", &mut bad);
        [
            f.board_manufacturer,
            f.board_product,
            f.board_serial,
            f.board_part,
        ] = [v[0].clone(), v[1].clone(), v[2].clone(), v[3].clone()];
    }
    if let Some(o) = product {
        // version, length, language; manufacturer, name, part/model, version, serial.
        let v = area(data, o, 3, 5, "product", &mut bad);
        [
            f.product_manufacturer,
            f.product_name,
            f.product_part,
            f.product_serial,
        ] = [v[0].clone(), v[1].clone(), v[2].clone(), v[4].clone()];
    }
    f.bad_checksums = bad;
    Ok(f)
}

/// Reads what [`parse`] needs through `read(offset, count)` (one Read FRU Data each):
/// the header, then each area's length and body, into an image of `size` bytes.
pub fn read_image<E>(
    size: u16,
    mut read: impl FnMut(u16, u8) -> Result<Vec<u8>, E>,
) -> Result<Result<Vec<u8>, FruError>, E> {
    let size = usize::from(size);
    let mut image = vec![0u8; size];
    let mut fill = |image: &mut Vec<u8>, from: usize, to: usize| -> Result<(), E> {
        let mut at = from;
        while at < to.min(size) {
            let want = (to.min(size) - at).min(usize::from(READ_CHUNK));
            // Offsets fit: `size` came from a u16.
            let got = read(at as u16, want as u8)?;
            if got.is_empty() {
                break;
            }
            let n = got.len().min(want);
            image[at..at + n].copy_from_slice(&got[..n]);
            at += n;
        }
        Ok(())
    };
    fill(&mut image, 0, 8)?;
    let offsets = match area_offsets(&image) {
        Ok(o) => o,
        Err(e) => return Ok(Err(e)),
    };
    for o in offsets.into_iter().flatten() {
        fill(&mut image, o, o + 2)?;
        let len = image.get(o + 1).map_or(0, |l| usize::from(*l) * 8);
        fill(&mut image, o + 2, o + len)?;
    }
    Ok(Ok(image))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hex fixture under `tests/fixtures/ipmi/` (`#` lines are its header).
    fn fixture(name: &str) -> Vec<u8> {
        let p = format!("{}/tests/fixtures/ipmi/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .flat_map(str::split_whitespace)
            .map(|h| u8::from_str_radix(h, 16).unwrap())
            .collect()
    }

    #[test]
    fn quanta_board_in_a_qumulo_server() {
        let d = fixture("quanta-qct-sd1q-1ulh.fru.hex");
        let f = parse(&d).unwrap();
        assert_eq!(f.chassis_part, "1S1QUZZ0STW");
        assert_eq!(f.chassis_serial, "QTFCPY823000A");
        assert_eq!(f.board_manufacturer, "Quanta Cloud Technology Inc.");
        assert_eq!(f.board_product, "SD1Q-1ULH-6 cores MB");
        assert_eq!(f.board_serial, "GPY82000008");
        assert_eq!(f.board_part, "31S1QMB0060");
        assert_eq!(f.product_part, "95-10B01-01 rev01");
        assert!(f.bad_checksums.is_empty());
        assert_eq!(
            f.system(),
            System {
                vendor: "Qumulo".into(),
                model: "QK-Series 1U".into(),
                serial: "S0501825Q007".into(),
            }
        );
    }

    #[test]
    fn asrock_rack_board_with_a_bad_board_checksum() {
        let f = parse(&fixture("asrockrack.fru.hex")).unwrap();
        assert_eq!(f.bad_checksums, ["board"]);
        assert_eq!(
            f.system(),
            System {
                vendor: "ASRockRack".into(),
                model: String::new(),
                serial: String::new(),
            }
        );
    }

    #[test]
    fn reads_only_the_header_and_the_areas() {
        let d = fixture("quanta-qct-sd1q-1ulh.fru.hex");
        let mut reads = vec![];
        let image = read_image::<()>(2048, |off, n| {
            reads.push((off, n));
            let from = usize::from(off);
            Ok(d.get(from..(from + usize::from(n)).min(d.len()))
                .unwrap_or_default()
                .to_vec())
        })
        .unwrap()
        .unwrap();
        assert_eq!(parse(&image).unwrap(), parse(&d).unwrap());
        assert!(reads.iter().all(|(_, n)| *n <= READ_CHUNK));
        // 8 header bytes + 40 + 112 + 88 area bytes in chunks of 16, not 2048 bytes.
        assert!(reads.len() < 25, "{} reads", reads.len());
        assert_eq!(reads[0], (0, 8));
    }

    #[test]
    fn garbage_is_an_error_or_empty_never_a_panic() {
        assert_eq!(parse(&[1, 2]), Err(FruError::TooShort(2)));
        assert!(matches!(
            parse(&[0x23, 0x11, 0x0c, 1, 0x84, 0x21, 0, 8]),
            Err(FruError::BadHeader { version: 0x23, .. })
        ));
        // A valid header whose areas point past the data.
        let f = parse(&[1, 0, 0x10, 0x20, 0x30, 0, 0, 0x9f]).unwrap();
        assert_eq!(f.system(), System::default());
        // Fields running off the end of an area.
        let mut d = vec![1, 0, 0, 1, 0, 0, 0, 0xfe, 1, 0xff, 0, 0, 0, 0, 0xff];
        d.extend([0x41; 8]);
        assert_eq!(parse(&d).unwrap().board_manufacturer, "");
        let r = read_image::<()>(4, |_, _| Ok(vec![9; 16])).unwrap();
        assert_eq!(r, Err(FruError::TooShort(4)));
        let r = read_image::<()>(64, |_, n| Ok(vec![0; usize::from(n)])).unwrap();
        assert!(matches!(r, Err(FruError::BadHeader { .. })));
    }

    #[test]
    fn six_bit_ascii_and_bcd_plus() {
        // "IPMI" in 6-bit ASCII (FRU spec §13.1 example: 29 DC A6).
        let mut pos = 0;
        assert_eq!(
            field(&[0x83, 0x29, 0xdc, 0xa6], &mut pos).as_deref(),
            Some("IPMI")
        );
        let mut pos = 0;
        assert_eq!(
            field(&[0x42, 0x12, 0xb3], &mut pos).as_deref(),
            Some("12-3")
        );
    }
}
