//! Node hostnames: a configured prefix plus the last hex digits of the boot NIC's MAC.
//!
//! Pure: the caller passes a `taken` predicate backed by the store, so uniqueness is
//! checked where the names live and this stays testable without a database.

/// Longest DNS label (RFC 1123 / RFC 1035).
const MAX_LABEL: usize = 63;
/// Room kept for the longest MAC suffix (12 digits) plus a `-NNNNN` collision counter,
/// so a node's prefix never changes between candidates.
const MAX_PREFIX: usize = MAX_LABEL - 12 - 6;

/// Lower-cases `prefix` and replaces anything outside `[a-z0-9-]` by `-`; drops leading
/// hyphens (a label may not start with one) and cuts it to leave room for the suffix.
pub fn sanitize_prefix(prefix: &str) -> String {
    let mapped: String = prefix
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let trimmed = mapped.trim_start_matches('-');
    trimmed.chars().take(MAX_PREFIX).collect()
}

/// The last 12 hex digits of `mac`, lower-case, left-padded with `0`. Separators and
/// any other non-hex characters are ignored, so `52:54:00:3A:4B:5C`, `5254.003a.4b5c`
/// and `52-54-00-3a-4b-5c` agree; longer hardware addresses (InfiniBand) keep their tail.
fn mac_digits(mac: &str) -> String {
    let hex: Vec<char> = mac
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let tail: String = hex[hex.len().saturating_sub(12)..].iter().collect();
    format!("{tail:0>12}")
}

/// The hostname for a node booting from `boot_mac`: the sanitized `prefix` plus the
/// last 6 hex digits of the MAC (`node-3a4b5c`). While `taken` says a candidate is in
/// use, the suffix grows to 8, 10 and 12 digits, then `-2`, `-3`, ... is appended to
/// the 12-digit form. The result is always a valid lower-case RFC 1123 label of at most
/// 63 characters. `taken` must eventually say no (it is backed by a finite table).
pub fn hostname_for(prefix: &str, boot_mac: &str, taken: impl Fn(&str) -> bool) -> String {
    let prefix = sanitize_prefix(prefix);
    let digits = mac_digits(boot_mac);
    for candidate in candidates(&prefix, &digits) {
        if !taken(&candidate) {
            return candidate;
        }
    }
    (2u64..)
        .map(|n| format!("{prefix}{digits}-{n}"))
        .find(|c| !taken(c))
        .expect("an unbounded counter always yields a free name")
}

fn candidates(prefix: &str, digits: &str) -> [String; 4] {
    [6, 8, 10, 12].map(|len| format!("{prefix}{}", &digits[12 - len..]))
}

/// Every name [`hostname_for`] can try for this MAC: the first three candidates, and
/// the 12-digit one, which every later candidate (`-2`, `-3`, ...) starts with. The
/// store reads only the names in use among these instead of every hostname.
pub fn hostname_candidates(prefix: &str, boot_mac: &str) -> ([String; 3], String) {
    let [a, b, c, d] = candidates(&sanitize_prefix(prefix), &mac_digits(boot_mac));
    ([a, b, c], d)
}

/// Whether `s` is a valid RFC 1123 host label in the form pxed generates (lower-case).
pub fn is_valid_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_LABEL
        && !s.starts_with('-')
        && !s.ends_with('-')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const MAC: &str = "52:54:00:3A:4B:5C";

    #[test]
    fn last_six_digits() {
        let h = hostname_for("node-", MAC, |_| false);
        assert_eq!(h, "node-3a4b5c");
        assert!(is_valid_label(&h));
    }

    #[test]
    fn separators_do_not_matter() {
        for mac in ["52-54-00-3a-4b-5c", "5254.003a.4b5c", "5254003A4B5C"] {
            assert_eq!(
                hostname_for("node-", mac, |_| false),
                "node-3a4b5c",
                "{mac}"
            );
        }
    }

    #[test]
    fn collisions_extend_then_count() {
        let taken: HashSet<&str> = [
            "node-3a4b5c",
            "node-003a4b5c",
            "node-54003a4b5c",
            "node-5254003a4b5c",
            "node-5254003a4b5c-2",
        ]
        .into();
        let steps: Vec<String> = (0..=taken.len())
            .map(|n| {
                let first_n: Vec<&str> = [
                    "node-3a4b5c",
                    "node-003a4b5c",
                    "node-54003a4b5c",
                    "node-5254003a4b5c",
                    "node-5254003a4b5c-2",
                ][..n]
                    .to_vec();
                hostname_for("node-", MAC, |c| first_n.contains(&c))
            })
            .collect();
        assert_eq!(
            steps,
            [
                "node-3a4b5c",
                "node-003a4b5c",
                "node-54003a4b5c",
                "node-5254003a4b5c",
                "node-5254003a4b5c-2",
                "node-5254003a4b5c-3",
            ]
        );
        assert_eq!(
            hostname_for("node-", MAC, |c| taken.contains(c)),
            "node-5254003a4b5c-3"
        );
    }

    #[test]
    fn prefix_is_sanitized() {
        assert_eq!(
            hostname_for("GPU_Rack 7.", MAC, |_| false),
            "gpu-rack-7-3a4b5c"
        );
        assert_eq!(hostname_for("--x", MAC, |_| false), "x3a4b5c");
        let (short, long) = hostname_candidates("GPU_Rack 7.", MAC);
        assert_eq!(short[0], hostname_for("GPU_Rack 7.", MAC, |_| false));
        assert_eq!(long, "gpu-rack-7-5254003a4b5c");
        assert_eq!(hostname_for("", MAC, |_| false), "3a4b5c");
        assert_eq!(hostname_for("Ünïcode-", MAC, |_| false), "n-code-3a4b5c");
    }

    #[test]
    fn long_prefix_stays_within_63() {
        let long = "a".repeat(200);
        let checked = std::cell::Cell::new(0);
        // Everything is taken until the counter reaches five digits.
        let h = hostname_for(&long, MAC, |c| {
            assert!(is_valid_label(c), "{c}");
            checked.set(checked.get() + 1);
            !c.ends_with("-10000")
        });
        assert!(h.ends_with("-10000"), "{h}");
        assert_eq!(h.len(), 63, "{h}");
        assert!(is_valid_label(&h));
        assert_eq!(checked.get(), 4 + 9999);
    }

    #[test]
    fn short_or_odd_macs_are_padded() {
        assert_eq!(hostname_for("n", "0:1", |_| false), "n000001");
        assert_eq!(hostname_for("n", "", |_| false), "n000000");
        // 20-byte InfiniBand address: the tail is the port GUID's end.
        let ib = "80:00:02:08:fe:80:00:00:00:00:00:00:00:02:c9:03:00:1f:aa:bb";
        assert_eq!(hostname_for("ib-", ib, |_| false), "ib-1faabb");
    }

    #[test]
    fn label_validation() {
        assert!(is_valid_label("a"));
        assert!(!is_valid_label(""));
        assert!(!is_valid_label("-a"));
        assert!(!is_valid_label("a-"));
        assert!(!is_valid_label("A"));
        assert!(!is_valid_label(&"a".repeat(64)));
    }
}
