//! The deploy agent's settings, from the kernel command line iPXE booted the ramdisk with:
//! `pxed.url=http://10.98.0.1:8080 pxed.token=<token> [pxed.disk=/dev/vda]`.

/// Why the kernel command line does not say where pxed is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CmdlineError {
    /// A required key is absent.
    #[error("kernel command line has no {key}= (the boot script sets it)")]
    Missing {
        /// The key, e.g. `pxed.url`.
        key: &'static str,
    },
    /// A key is present with a value the agent cannot use.
    #[error("kernel command line: {key}={value:?}: {why}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A `"` opened a value that never closes.
    #[error("kernel command line: unterminated quote")]
    UnterminatedQuote,
}

/// What the agent reads from the kernel command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmdline {
    /// pxed's base URL without a trailing slash (`http://10.98.0.1:8080`).
    pub url: String,
    /// The node's boot token for this generation.
    pub token: String,
    /// Target disk override (`/dev/vda`); the plan's `target_disk` wins over it.
    pub disk: Option<String>,
}

impl Cmdline {
    /// `{url}/cb/{token}`: the base of every callback.
    pub fn callback_base(&self) -> String {
        format!("{}/cb/{}", self.url, self.token)
    }
}

/// Splits a command line into words the way the kernel does: whitespace separates, and
/// double quotes group (and are removed) so `a="b c"` is one word `a=b c`.
fn words(line: &str) -> Result<Vec<String>, CmdlineError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quoted {
        return Err(CmdlineError::UnterminatedQuote);
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// Parses `/proc/cmdline`. The last occurrence of a key wins, as for kernel parameters.
pub fn parse(line: &str) -> Result<Cmdline, CmdlineError> {
    let (mut url, mut token, mut disk) = (None, None, None);
    for w in words(line)? {
        let Some((k, v)) = w.split_once('=') else {
            continue;
        };
        match k {
            "pxed.url" => url = Some(v.to_string()),
            "pxed.token" => token = Some(v.to_string()),
            "pxed.disk" => disk = Some(v.to_string()),
            _ => {}
        }
    }
    let url = url.ok_or(CmdlineError::Missing { key: "pxed.url" })?;
    let token = token.ok_or(CmdlineError::Missing { key: "pxed.token" })?;
    let url = url.trim_end_matches('/').to_string();
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    if rest.is_none_or(str::is_empty) {
        return Err(CmdlineError::Invalid {
            key: "pxed.url",
            value: url,
            why: "not an http:// or https:// URL with a host",
        });
    }
    // The token becomes a path segment: only URL-safe characters, so nothing needs escaping.
    if token.is_empty()
        || !token
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~'))
    {
        return Err(CmdlineError::Invalid {
            key: "pxed.token",
            value: token,
            why: "empty or not URL-safe (A-Z a-z 0-9 - _ . ~)",
        });
    }
    if let Some(d) = &disk
        && !is_dev_path(d)
    {
        return Err(CmdlineError::Invalid {
            key: "pxed.disk",
            value: d.clone(),
            why: "not a /dev/<name> path",
        });
    }
    Ok(Cmdline { url, token, disk })
}

/// `/dev/<name>` with a plain kernel name (no further slashes, no `..`).
pub fn is_dev_path(p: &str) -> bool {
    p.strip_prefix("/dev/").is_some_and(|n| {
        !n.is_empty()
            && !n.contains('/')
            && n != "."
            && n != ".."
            && !n.contains(char::is_whitespace)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_url_token_and_disk() {
        let c = parse(
            "BOOT_IMAGE=/vmlinuz console=ttyS0,115200 pxed.url=http://10.98.0.1:8080/ \
             pxed.token=abc-123_X pxed.disk=/dev/vdb quiet\n",
        )
        .unwrap();
        assert_eq!(c.url, "http://10.98.0.1:8080");
        assert_eq!(c.token, "abc-123_X");
        assert_eq!(c.disk.as_deref(), Some("/dev/vdb"));
        assert_eq!(c.callback_base(), "http://10.98.0.1:8080/cb/abc-123_X");
    }

    #[test]
    fn quotes_group_and_are_removed_and_last_key_wins() {
        let c =
            parse(r#"initrd=x "pxed.url=http://h" pxed.token="t1" pxed.token=t2 x="a b""#).unwrap();
        assert_eq!(c.url, "http://h");
        assert_eq!(c.token, "t2");
        assert_eq!(c.disk, None);
        assert_eq!(
            words(r#"a="b c" d"#).unwrap(),
            vec!["a=b c".to_string(), "d".to_string()]
        );
    }

    #[test]
    fn missing_and_invalid_keys_are_clear_errors() {
        let cases: &[(&str, CmdlineError)] = &[
            ("pxed.token=t", CmdlineError::Missing { key: "pxed.url" }),
            (
                "pxed.url=http://h",
                CmdlineError::Missing { key: "pxed.token" },
            ),
            ("", CmdlineError::Missing { key: "pxed.url" }),
            (
                "pxed.url=\"http://h pxed.token=t",
                CmdlineError::UnterminatedQuote,
            ),
        ];
        for (line, want) in cases {
            assert_eq!(parse(line).unwrap_err(), *want, "{line}");
        }
        for (line, key) in [
            ("pxed.url=ftp://h pxed.token=t", "pxed.url"),
            ("pxed.url=http:// pxed.token=t", "pxed.url"),
            ("pxed.url=http://h pxed.token=", "pxed.token"),
            ("pxed.url=http://h pxed.token=a/b", "pxed.token"),
            ("pxed.url=http://h pxed.token=t pxed.disk=vda", "pxed.disk"),
            (
                "pxed.url=http://h pxed.token=t pxed.disk=/dev/../sda",
                "pxed.disk",
            ),
        ] {
            match parse(line) {
                Err(CmdlineError::Invalid { key: k, .. }) => assert_eq!(k, key, "{line}"),
                other => panic!("{line}: {other:?}"),
            }
        }
        let msg = parse("quiet").unwrap_err().to_string();
        assert!(msg.contains("pxed.url="), "{msg}");
    }
}
