//! Syslog on the wire: one message per UDP datagram (RFC 5426); on TCP, octet-counted
//! (`LEN SP MSG`, RFC 6587 3.4.1) or newline-terminated frames (3.4.2), told apart by
//! the first byte of each frame. Messages are RFC 5424 or RFC 3164 (BSD, as BusyBox
//! syslogd in debian-installer and rsyslog in Anaconda's environment send them),
//! parsed by `syslog_loose` (Vector's parser).

use chrono::Datelike;

/// Why a message was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("not UTF-8")]
    NotUtf8,
    #[error("empty")]
    Empty,
    #[error("longer than the line limit")]
    TooLong,
    #[error("not a syslog message")]
    NotSyslog,
    #[error("bad octet count")]
    BadFrame,
}

/// The stored form of one syslog message: `tag[pid]: message` (what a syslog daemon
/// prints after the timestamp and host), one line.
pub fn parse(raw: &[u8], max: usize) -> Result<String, Malformed> {
    if raw.len() > max {
        return Err(Malformed::TooLong);
    }
    let text = std::str::from_utf8(raw).map_err(|_| Malformed::NotUtf8)?;
    let text = text.trim_matches(|c: char| c == '\0' || c.is_whitespace());
    if text.is_empty() {
        return Err(Malformed::Empty);
    }
    let year = chrono::Utc::now().year();
    let m =
        syslog_loose::parse_message_with_year_exact(text, |_| year, syslog_loose::Variant::Either)
            .map_err(|_| Malformed::NotSyslog)?;
    // RFC 3164 senders that leave out the host (BusyBox syslogd forwards `tag: msg`)
    // make a tag without `[pid]` look like a host to the parser: a lone "host" is the tag.
    let app = match (m.hostname, m.appname, &m.protocol) {
        (Some(h), None, syslog_loose::Protocol::RFC3164) => Some(h),
        (_, a, _) => a,
    };
    let msg = restore_dashes(text, m.msg, &m.protocol).trim();
    let line = match (app, &m.procid) {
        (Some(app), Some(pid)) => format!("{app}[{pid}]: {msg}"),
        (Some(app), None) => format!("{app}: {msg}"),
        (None, _) => msg.to_string(),
    };
    // Not cut to the stored length here: the recorder redacts secrets first, then cuts.
    let line = super::one_line(&line, max);
    if line.is_empty() {
        return Err(Malformed::Empty);
    }
    Ok(line)
}

/// The RFC 3164 parser takes a message's leading `-` for an empty structured-data
/// field: cdebconf's `--> INPUT critical ...` would arrive as `-> INPUT ...`. The
/// message is a slice of `text`; give it back the dashes between the tag's `:` and it.
fn restore_dashes<'a>(text: &'a str, msg: &'a str, protocol: &syslog_loose::Protocol) -> &'a str {
    if *protocol != syslog_loose::Protocol::RFC3164 {
        return msg;
    }
    let Some(off) = (msg.as_ptr() as usize)
        .checked_sub(text.as_ptr() as usize)
        .filter(|o| *o <= text.len() && text.is_char_boundary(*o))
    else {
        return msg;
    };
    let head = &text[..off];
    let before = head.trim_end_matches([' ', '-']);
    if before.len() < head.len() && before.ends_with(':') && head[before.len()..].contains('-') {
        return text[before.len()..].trim_start_matches(' ');
    }
    msg
}

/// Splits a TCP byte stream into frames. Bounded: a frame longer than `max` is an error
/// (the connection is then closed: the stream cannot be resynchronised reliably).
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    max: usize,
}

impl Framer {
    /// A framer for frames of at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Framer {
            buf: Vec::new(),
            max,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame, `Ok(None)` when more bytes are needed, `Err` when the
    /// stream is broken (the caller closes it).
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, Malformed> {
        // Stray line ends between frames.
        let skip = self
            .buf
            .iter()
            .take_while(|b| matches!(b, b'\n' | b'\r' | b'\0'))
            .count();
        self.buf.drain(..skip);
        let Some(&first) = self.buf.first() else {
            return Ok(None);
        };
        if first.is_ascii_digit() {
            // Octet counting: digits, one space, that many bytes.
            let digits = self.buf.iter().take_while(|b| b.is_ascii_digit()).count();
            if digits > 6 {
                return Err(Malformed::BadFrame);
            }
            let Some(&sep) = self.buf.get(digits) else {
                return Ok(None);
            };
            if sep != b' ' {
                return Err(Malformed::BadFrame);
            }
            let len: usize = std::str::from_utf8(&self.buf[..digits])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or(Malformed::BadFrame)?;
            if len > self.max {
                return Err(Malformed::TooLong);
            }
            let start = digits + 1;
            if self.buf.len() < start + len {
                return Ok(None);
            }
            let frame = self.buf[start..start + len].to_vec();
            self.buf.drain(..start + len);
            return Ok(Some(frame));
        }
        match self.buf.iter().position(|b| matches!(b, b'\n' | b'\0')) {
            Some(end) if end <= self.max => {
                let frame = self.buf[..end].to_vec();
                self.buf.drain(..=end);
                Ok(Some(frame))
            }
            Some(_) => Err(Malformed::TooLong),
            None if self.buf.len() > self.max => Err(Malformed::TooLong),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What real senders put on the wire, and the line pxed stores.
    #[test]
    fn parses_what_installers_send() {
        let rows: &[(&str, &str)] = &[
            // BusyBox syslogd (debian-installer, log_host=): RFC 3164 without a host.
            (
                "<13>Dec  1 03:00:00 anna[2143]: DEBUG: retrieving libgpg-error0-udeb 1.46-1",
                "anna[2143]: DEBUG: retrieving libgpg-error0-udeb 1.46-1",
            ),
            (
                "<13>Jun  5 20:59:47 preseed: successfully loaded preseed file from http://10.0.0.1/cfg/x/preseed",
                "preseed: successfully loaded preseed file from http://10.0.0.1/cfg/x/preseed",
            ),
            (
                "<12>Dec  1 03:00:01 main-menu[278]: WARNING **: Menu item 'download-installer' failed.",
                "main-menu[278]: WARNING **: Menu item 'download-installer' failed.",
            ),
            // util-linux logger --rfc3164 (with a host).
            (
                "<13>Dec  1 03:00:02 node-1 anaconda[1712]: Installing boot loader",
                "anaconda[1712]: Installing boot loader",
            ),
            // RFC 5424 (logger --rfc5424, rsyslog's RSYSLOG_SyslogProtocol23Format).
            (
                "<14>1 2026-12-01T03:00:03.123456+00:00 node-1 anaconda 1712 - [timeQuality tzKnown=\"1\"] Parsing kickstart: /run/install/ks.cfg",
                "anaconda[1712]: Parsing kickstart: /run/install/ks.cfg",
            ),
            // cdebconf's protocol trace keeps its arrows.
            (
                "<13>Dec  1 03:00:04 debconf: --> INPUT critical anna/install_failed",
                "debconf: --> INPUT critical anna/install_failed",
            ),
            (
                "<13>Dec  1 03:00:04 node-1 debconf: <-- 0 question will be asked",
                "debconf: <-- 0 question will be asked",
            ),
            (
                "<13>Dec  1 03:00:04 node-1 app[1]: - a dash",
                "app[1]: - a dash",
            ),
            (
                "<14>1 2026-12-01T03:00:03Z node-1 kernel - - - Linux version 6.1.0",
                "kernel: Linux version 6.1.0",
            ),
        ];
        for (raw, want) in rows {
            assert_eq!(parse(raw.as_bytes(), 8192).as_deref(), Ok(*want), "{raw}");
        }
    }

    #[test]
    fn malformed_is_an_error_never_a_panic() {
        let long = format!("<13>Dec  1 03:00:00 x: {}", "a".repeat(9000));
        let rows: &[(&[u8], Malformed)] = &[
            (b"", Malformed::Empty),
            (b"\0\0\n", Malformed::Empty),
            (b"\xff\xfe<13>", Malformed::NotUtf8),
            (b"hello world", Malformed::NotSyslog),
            (b"<999999>", Malformed::NotSyslog),
            (long.as_bytes(), Malformed::TooLong),
        ];
        for (raw, want) in rows {
            assert_eq!(parse(raw, 8192), Err(*want), "{raw:?}");
        }
        // Arbitrary bytes: Ok or Err, never a panic.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let mut b = Vec::new();
            for _ in 0..(seed % 64) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                b.push(b"<>13 :[]-\n1Dec\xc3\xa9a"[(seed % 17) as usize]);
            }
            let _ = parse(&b, 8192);
        }
    }

    #[test]
    fn frames_octet_counted_and_newline() {
        let mut f = Framer::new(64);
        f.push(b"10 <13>x: a\nb<13>Dec  1 03:00:00 y: two\n\n5 ab");
        assert_eq!(f.next_frame(), Ok(Some(b"<13>x: a\nb".to_vec())));
        assert_eq!(
            f.next_frame(),
            Ok(Some(b"<13>Dec  1 03:00:00 y: two".to_vec()))
        );
        assert_eq!(f.next_frame(), Ok(None));
        f.push(b"cde");
        assert_eq!(f.next_frame(), Ok(Some(b"abcde".to_vec())));
        assert_eq!(f.next_frame(), Ok(None));
        let mut f = Framer::new(8);
        f.push(b"99 abc");
        assert_eq!(f.next_frame(), Err(Malformed::TooLong));
        let mut f = Framer::new(8);
        f.push(b"1234567 ");
        assert_eq!(f.next_frame(), Err(Malformed::BadFrame));
        let mut f = Framer::new(8);
        f.push(b"<13>no newline yet");
        assert_eq!(f.next_frame(), Err(Malformed::TooLong));
        let mut f = Framer::new(8);
        f.push(b"12x");
        assert_eq!(f.next_frame(), Err(Malformed::BadFrame));
    }
}
