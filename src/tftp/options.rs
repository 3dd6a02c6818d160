//! Option negotiation (RFC 2347 OACK, RFC 2348 blksize, RFC 2349 timeout and tsize,
//! RFC 7440 windowsize) as one pure function.

use std::time::Duration;

/// Block size without options (RFC 1350).
pub const DEFAULT_BLKSIZE: usize = 512;
/// Smallest block size RFC 2348 allows.
pub const MIN_BLKSIZE: usize = 8;
/// Largest block size RFC 2348 allows (a 65535-byte IP datagram less headers).
pub const MAX_BLKSIZE: usize = 65464;
/// Largest window we agree to. RFC 7440 allows 65535; beyond a few dozen blocks a
/// lost packet costs a long resend and buys nothing on a LAN.
pub const MAX_WINDOWSIZE: u16 = 64;

/// What a transfer runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Bytes per DATA block.
    pub blksize: usize,
    /// Blocks sent before waiting for an ACK.
    pub windowsize: u16,
    /// Retransmission timeout.
    pub timeout: Duration,
    /// Options to acknowledge, in the client's order; empty means no OACK and the
    /// transfer starts with DATA 1.
    pub oack: Vec<(&'static str, String)>,
}

/// Decides the transfer parameters for a read request.
///
/// `options` are the client's (name, value) pairs; names compare
/// case-insensitively; the first occurrence of a name wins; unknown options and
/// values out of range are ignored (not acknowledged), as RFC 2347 asks.
/// `size` is what `tsize` reports; `timeout` is the server's default.
pub fn negotiate(options: &[(&str, &str)], size: u64, timeout: Duration) -> Negotiated {
    let mut n = Negotiated {
        blksize: DEFAULT_BLKSIZE,
        windowsize: 1,
        timeout,
        oack: Vec::new(),
    };
    for &(name, value) in options {
        let value = value.trim();
        let key: &'static str = if name.eq_ignore_ascii_case("blksize") {
            "blksize"
        } else if name.eq_ignore_ascii_case("tsize") {
            "tsize"
        } else if name.eq_ignore_ascii_case("timeout") {
            "timeout"
        } else if name.eq_ignore_ascii_case("windowsize") {
            "windowsize"
        } else {
            continue;
        };
        if n.oack.iter().any(|(k, _)| *k == key) {
            continue;
        }
        let reply = match key {
            "blksize" => match value.parse::<u64>() {
                Ok(v) if v >= MIN_BLKSIZE as u64 => {
                    // RFC 2348 lets the server answer with a smaller size.
                    n.blksize = v.min(MAX_BLKSIZE as u64) as usize;
                    n.blksize.to_string()
                }
                _ => continue,
            },
            "tsize" => match value.parse::<u64>() {
                // In an RRQ the client sends 0 and the server answers the real size.
                Ok(_) => size.to_string(),
                Err(_) => continue,
            },
            "timeout" => match value.parse::<u64>() {
                Ok(v @ 1..=255) => {
                    n.timeout = Duration::from_secs(v);
                    v.to_string()
                }
                _ => continue,
            },
            _ => match value.parse::<u64>() {
                Ok(v @ 1..=65535) => {
                    n.windowsize = v.min(MAX_WINDOWSIZE as u64) as u16;
                    n.windowsize.to_string()
                }
                _ => continue,
            },
        };
        n.oack.push((key, reply));
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(700);

    fn oack(n: &Negotiated) -> Vec<(&str, &str)> {
        n.oack.iter().map(|(k, v)| (*k, v.as_str())).collect()
    }

    #[test]
    fn no_options_no_oack() {
        let n = negotiate(&[], 1000, T);
        assert_eq!(
            n,
            Negotiated {
                blksize: 512,
                windowsize: 1,
                timeout: T,
                oack: vec![]
            }
        );
    }

    #[test]
    fn only_unknown_options_no_oack() {
        let n = negotiate(
            &[("multicast", ""), ("blksize2", "9"), ("utimeout", "1")],
            5,
            T,
        );
        assert!(n.oack.is_empty());
        assert_eq!(n.blksize, 512);
    }

    #[test]
    fn uefi_probe() {
        let n = negotiate(
            &[("tsize", "0"), ("blksize", "1468"), ("windowsize", "4")],
            1_058_816,
            T,
        );
        assert_eq!(n.blksize, 1468);
        assert_eq!(n.windowsize, 4);
        assert_eq!(
            oack(&n),
            vec![
                ("tsize", "1058816"),
                ("blksize", "1468"),
                ("windowsize", "4")
            ]
        );
    }

    #[test]
    fn blksize() {
        assert_eq!(negotiate(&[("BLKSIZE", "8")], 0, T).blksize, 8);
        assert_eq!(negotiate(&[("blksize", "65464")], 0, T).blksize, 65464);
        let big = negotiate(&[("blksize", "70000")], 0, T);
        assert_eq!(
            (big.blksize, oack(&big)),
            (65464, vec![("blksize", "65464")])
        );
        for bad in ["7", "0", "-1", "x", "", "99999999999999999999999"] {
            let n = negotiate(&[("blksize", bad)], 0, T);
            assert_eq!((n.blksize, n.oack.len()), (512, 0), "{bad}");
        }
        assert_eq!(negotiate(&[("blksize", " 1024 ")], 0, T).blksize, 1024);
    }

    #[test]
    fn tsize() {
        assert_eq!(
            oack(&negotiate(&[("TSize", "0")], 42, T)),
            vec![("tsize", "42")]
        );
        assert_eq!(
            oack(&negotiate(&[("tsize", "17")], 42, T)),
            vec![("tsize", "42")]
        );
        assert!(negotiate(&[("tsize", "abc")], 42, T).oack.is_empty());
    }

    #[test]
    fn timeout() {
        let n = negotiate(&[("timeout", "3")], 0, T);
        assert_eq!(
            (n.timeout, oack(&n)),
            (Duration::from_secs(3), vec![("timeout", "3")])
        );
        assert_eq!(
            negotiate(&[("timeout", "255")], 0, T).timeout,
            Duration::from_secs(255)
        );
        for bad in ["0", "256", "1.5", "x"] {
            let n = negotiate(&[("timeout", bad)], 0, T);
            assert_eq!((n.timeout, n.oack.len()), (T, 0), "{bad}");
        }
    }

    #[test]
    fn windowsize() {
        assert_eq!(negotiate(&[("windowsize", "1")], 0, T).windowsize, 1);
        assert_eq!(negotiate(&[("windowsize", "16")], 0, T).windowsize, 16);
        let big = negotiate(&[("windowsize", "65535")], 0, T);
        assert_eq!(oack(&big), vec![("windowsize", "64")]);
        for bad in ["0", "65536", "x"] {
            let n = negotiate(&[("windowsize", bad)], 0, T);
            assert_eq!((n.windowsize, n.oack.len()), (1, 0), "{bad}");
        }
    }

    #[test]
    fn first_occurrence_wins_and_bad_ones_mix_with_good() {
        let n = negotiate(
            &[
                ("blksize", "1024"),
                ("blksize", "2048"),
                ("timeout", "0"),
                ("foo", "1"),
                ("tsize", "0"),
            ],
            9,
            T,
        );
        assert_eq!(n.blksize, 1024);
        assert_eq!(oack(&n), vec![("blksize", "1024"), ("tsize", "9")]);
    }
}
