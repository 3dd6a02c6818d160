//! Generated install configs: kickstart (Anaconda), Ubuntu autoinstall user-data and
//! NoCloud meta-data, and debian-installer preseed, plus the first-boot agent they all
//! install. Pure: the caller looks up the node, image and token and serves the result.
//!
//! Every config sets the hostname, makes the installed system boot to
//! `multi-user.target` with no first-boot setup screens, calls
//! `<callback_base>/installed` at the end of the install (with the boot token), and
//! installs the same agent (`templates/firstboot/`): a oneshot `pxed-firstboot.service`
//! and the script `/usr/local/sbin/pxed-firstboot` (root only: it holds the agent
//! token), which POSTs a [`FirstBootReport`] to `<agent_base>/first-boot` and a
//! [`HealthReport`] to `<agent_base>/health`. The agent token is in the config's body
//! only, never in a URL the boot script or kernel command line shows.

use crate::hostname::is_valid_label;
use crate::images::{Arch, Family, ImageDef, ImageError, mirror_url};
use crate::wire::InstalledReport;
use askama::Template;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// Everything one node's install config depends on.
#[derive(Debug, Clone)]
pub struct InstallContext<'a> {
    /// The installed system's hostname (a valid RFC 1123 label).
    pub hostname: String,
    /// The node's architecture; selects the image's media and per-arch branches.
    pub arch: Arch,
    /// The catalog entry being installed.
    pub image: &'a ImageDef,
    /// `mirror_base` + the image's `repo` for `arch`.
    pub repo_url: String,
    /// The image's extra repositories for `arch`, as absolute URLs.
    pub extra_repos: BTreeMap<String, String>,
    /// `http://<server>/cb/<boot token>`; the installer appends `installed`.
    pub callback_base: String,
    /// `http://<server>/cb/<agent token>`; the first-boot agent appends `first-boot` and
    /// `health`.
    pub agent_base: String,
    /// `http://<server>/cfg/<token>`; where this config is served from.
    pub config_base: String,
    /// OpenSSH public keys for root (kickstart, preseed) or the `ubuntu` user.
    pub ssh_authorized_keys: Vec<String>,
    /// A crypt(3) hash for root (the `ubuntu` user on Ubuntu); `None` locks the password.
    pub root_password_hash: Option<String>,
    /// An Olson time zone name, e.g. `UTC` or `Europe/Berlin`.
    pub timezone: String,
    /// The site's NTP servers (config `ntp_servers`, checked host names or addresses).
    /// Empty: no NTP at all, since on an isolated network every pool is unreachable.
    pub ntp_servers: Vec<String>,
    /// pxed's syslog receiver as the installer reaches it (`host:port`), for installers
    /// whose kernel command line cannot name one (subiquity's live session forwards
    /// its rsyslog there).
    pub syslog: Option<String>,
    /// The node's profile's health checks, run by the first-boot agent beside its own
    /// (checked by `HealthCheck::problem` when the config was loaded).
    pub health_checks: Vec<crate::inventory::profile::HealthCheck>,
}

impl<'a> InstallContext<'a> {
    /// Builds the context for `hostname` installing `image` on `arch`, with URLs from the
    /// mirror base and the server's own base URL (`http://10.0.0.1`) plus the node's
    /// boot token and agent token. Keys and password default to none, the time zone
    /// to `UTC`.
    pub fn new(
        image: &'a ImageDef,
        arch: Arch,
        mirror_base: &str,
        server_base: &str,
        token: &str,
        agent_token: &str,
        hostname: &str,
    ) -> Result<Self, InstallError> {
        let a = image.arch(arch)?;
        let server = server_base.trim_end_matches('/');
        Ok(InstallContext {
            hostname: hostname.to_string(),
            arch,
            image,
            repo_url: mirror_url(mirror_base, &a.repo),
            extra_repos: a
                .extra_repos
                .iter()
                .map(|(k, v)| (k.clone(), mirror_url(mirror_base, v)))
                .collect(),
            callback_base: format!("{server}/cb/{token}"),
            agent_base: format!("{server}/cb/{agent_token}"),
            config_base: format!("{server}/cfg/{token}"),
            ssh_authorized_keys: Vec::new(),
            root_password_hash: None,
            timezone: "UTC".into(),
            ntp_servers: Vec::new(),
            syslog: None,
            health_checks: Vec::new(),
        })
    }
}

/// Errors from building or rendering a config.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{field}: {reason}")]
    Invalid {
        field: &'static str,
        reason: &'static str,
    },
    #[error("image {image} is installed by {family:?}, not by this config")]
    WrongFamily { image: String, family: Family },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("rendering install config: {0}")]
    Render(#[from] askama::Error),
}

/// The agent's two files, rendered once and embedded by every config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstBootFiles {
    /// `/usr/local/sbin/pxed-firstboot`, a POSIX sh script.
    pub script: String,
    /// `/etc/systemd/system/pxed-firstboot.service`.
    pub unit: String,
}

/// Where the agent's files go on the installed system.
pub const AGENT_SCRIPT_PATH: &str = "/usr/local/sbin/pxed-firstboot";
/// The agent's unit file on the installed system.
pub const AGENT_UNIT_PATH: &str = "/etc/systemd/system/pxed-firstboot.service";

/// pxed's OpenSSH policy on every installed system, whatever the family: the
/// operators' keys (config, image) are the way in. `01-` sorts before the distribution's
/// own drop-ins (`50-redhat.conf`, `50-cloud-init.conf`) and sshd keeps the first value
/// it reads, so this one wins.
pub const SSHD_POLICY_PATH: &str = "/etc/ssh/sshd_config.d/01-pxed.conf";
/// The policy: root by key only, no password logins at all (a root password, when
/// configured, is for the console).
pub const SSHD_POLICY: &str = "# pxed: keys only; a root password is for the console.
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
";

#[derive(Template)]
#[template(path = "firstboot/pxed-firstboot.sh", escape = "none")]
struct AgentScript<'a> {
    hostname: &'a str,
    agent_base: &'a str,
    /// One `run_check NAME TIMEOUT EXIT 'OUTPUT' 'COMMAND'` line per profile check,
    /// every operand shell-quoted.
    checks: Vec<String>,
}

/// `s` as one shell word: single-quoted, with each `'` written as `'\''`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The script line that runs one profile health check.
fn check_line(c: &crate::inventory::profile::HealthCheck) -> Result<String, InstallError> {
    if c.problem().is_some() {
        return Err(invalid(
            "health_checks",
            "a profile health check is not shippable",
        ));
    }
    Ok(format!(
        "run_check {} {} {} {} {}",
        shell_quote(&c.name),
        c.timeout_secs,
        c.exit,
        shell_quote(c.output.as_deref().unwrap_or("")),
        shell_quote(&c.command)
    ))
}

#[derive(Template)]
#[template(path = "firstboot/pxed-firstboot.service", escape = "none")]
struct AgentUnit;

/// Renders the first-boot agent for `ctx`, without a trailing newline on either file
/// (the configs add their own line ends).
pub fn firstboot_files(ctx: &InstallContext<'_>) -> Result<FirstBootFiles, InstallError> {
    check(ctx)?;
    let script = AgentScript {
        hostname: &ctx.hostname,
        agent_base: &ctx.agent_base,
        checks: ctx
            .health_checks
            .iter()
            .map(check_line)
            .collect::<Result<_, _>>()?,
    }
    .render()?;
    let unit = AgentUnit.render()?;
    Ok(FirstBootFiles {
        script: script.trim_end().to_string(),
        unit: unit.trim_end().to_string(),
    })
}

/// Characters that would break out of the shell single quotes, YAML scalars or
/// debconf lines that these values are written into.
fn plain(s: &str) -> bool {
    !s.is_empty()
        && !s.chars().any(|c| {
            c.is_whitespace() || c.is_control() || matches!(c, '\'' | '"' | '\\' | '`' | '$')
        })
}

fn invalid(field: &'static str, reason: &'static str) -> InstallError {
    InstallError::Invalid { field, reason }
}

/// Refuses anything that could inject into a generated config or script.
fn check(ctx: &InstallContext<'_>) -> Result<(), InstallError> {
    if !is_valid_label(&ctx.hostname) {
        return Err(invalid("hostname", "must be a lower-case RFC 1123 label"));
    }
    ctx.image.arch(ctx.arch)?;
    let urls = [
        ("repo_url", &ctx.repo_url),
        ("callback_base", &ctx.callback_base),
        ("agent_base", &ctx.agent_base),
        ("config_base", &ctx.config_base),
    ];
    for (field, url) in urls
        .into_iter()
        .chain(ctx.extra_repos.values().map(|u| ("extra_repos", u)))
    {
        if !(url.starts_with("http://") || url.starts_with("https://")) || !plain(url) {
            return Err(invalid(
                field,
                "must be an http(s) URL without quotes or spaces",
            ));
        }
    }
    for name in ctx.extra_repos.keys() {
        if !plain(name) {
            return Err(invalid("extra_repos", "names must be plain words"));
        }
    }
    for key in &ctx.ssh_authorized_keys {
        // Not only `\n` and `\r` end a line: Anaconda's parser (Python's `splitlines`)
        // also breaks at `\v`, `\f`, `\x1c`..`\x1e`, `\x85`, U+2028 and U+2029.
        let ok = !key.is_empty()
            && !key.contains(['"', '\'', '\\', '`', '$'])
            && !key
                .chars()
                .any(|c| c.is_control() || (c.is_whitespace() && c != ' '))
            && (key.starts_with("ssh-") || key.starts_with("ecdsa-") || key.starts_with("sk-"));
        if !ok {
            return Err(invalid(
                "ssh_authorized_keys",
                "each must be one OpenSSH public key line without quotes",
            ));
        }
    }
    if let Some(h) = &ctx.root_password_hash {
        // A crypt(3) hash has `$` separators: allow them here (it is never in a shell
        // string), but nothing that breaks a line or a quoted word.
        let ok = !h.is_empty()
            && !h.chars().any(|c| {
                c.is_whitespace() || c.is_control() || matches!(c, '\'' | '"' | '\\' | '`')
            });
        if !ok {
            return Err(invalid("root_password_hash", "must be one crypt(3) hash"));
        }
    }
    let tz_ok = !ctx.timezone.is_empty()
        && ctx
            .timezone
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '_' | '+' | '-'));
    if !tz_ok {
        return Err(invalid(
            "timezone",
            "must be an Olson name like Europe/Berlin",
        ));
    }
    Ok(())
}

fn want_family(ctx: &InstallContext<'_>, family: Family) -> Result<(), InstallError> {
    if ctx.image.family != family {
        return Err(InstallError::WrongFamily {
            image: ctx.image.name.clone(),
            family: ctx.image.family,
        });
    }
    Ok(())
}

fn installed_json(ctx: &InstallContext<'_>) -> String {
    serde_json::to_string(&InstalledReport {
        hostname: ctx.hostname.clone(),
        arch: ctx.arch,
    })
    .expect("a struct of strings serializes")
}

/// askama drops the template's final newline; configs are text files and end with one.
fn finish(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

fn json(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

fn b64(s: &str) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(s.len().div_ceil(3) * 4);
    for chunk in s.as_bytes().chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[derive(Template)]
#[template(path = "kickstart.ks", escape = "none")]
struct Kickstart<'a> {
    c: &'a InstallContext<'a>,
    agent: FirstBootFiles,
    sshd_path: &'static str,
    sshd_policy: &'static str,
    arm64: bool,
    console: &'static str,
    installed_json: String,
}

/// The Anaconda kickstart (`/cfg/{token}/kickstart`) for a [`Family::Kickstart`] image.
pub fn render_kickstart(ctx: &InstallContext<'_>) -> Result<String, InstallError> {
    want_family(ctx, Family::Kickstart)?;
    Ok(finish(
        Kickstart {
            c: ctx,
            agent: firstboot_files(ctx)?,
            sshd_path: SSHD_POLICY_PATH,
            sshd_policy: SSHD_POLICY.trim_end(),
            arm64: ctx.arch == Arch::Arm64,
            console: ctx.arch.serial_console(),
            installed_json: installed_json(ctx),
        }
        .render()?,
    ))
}

#[derive(Template)]
#[template(path = "user-data.yaml", escape = "none")]
struct UserData<'a> {
    c: &'a InstallContext<'a>,
    agent: FirstBootFiles,
    sshd_path: &'static str,
    sshd_policy: &'static str,
    arm64: bool,
    debian_arch: &'static str,
    archive_json: Option<String>,
    timezone_json: String,
    password_json: String,
    ssh_keys_json: String,
    installed_json: String,
}

/// Ubuntu autoinstall as `#cloud-config` with an `autoinstall:` key
/// (`/cfg/{token}/user-data`), for a [`Family::Autoinstall`] image. The apt archive is
/// the image's `extra_repos.archive`, when it has one.
pub fn render_user_data(ctx: &InstallContext<'_>) -> Result<String, InstallError> {
    want_family(ctx, Family::Autoinstall)?;
    Ok(finish(
        UserData {
            c: ctx,
            agent: firstboot_files(ctx)?,
            sshd_path: SSHD_POLICY_PATH,
            sshd_policy: SSHD_POLICY.trim_end(),
            arm64: ctx.arch == Arch::Arm64,
            debian_arch: ctx.arch.debian(),
            archive_json: ctx.extra_repos.get("archive").map(|u| json(u)),
            timezone_json: json(&ctx.timezone),
            // `!` is a locked password: key-only login.
            password_json: json(ctx.root_password_hash.as_deref().unwrap_or("!")),
            ssh_keys_json: serde_json::to_string(&ctx.ssh_authorized_keys)
                .expect("strings serialize"),
            installed_json: installed_json(ctx),
        }
        .render()?,
    ))
}

#[derive(Template)]
#[template(path = "meta-data.yaml", escape = "none")]
struct MetaData<'a> {
    c: &'a InstallContext<'a>,
    instance_id: String,
}

/// NoCloud meta-data (`/cfg/{token}/meta-data`). The instance id changes with the
/// token, so cloud-init treats every reinstall as a new instance.
pub fn render_meta_data(ctx: &InstallContext<'_>) -> Result<String, InstallError> {
    check(ctx)?;
    let digest = hex::encode(Sha256::digest(ctx.config_base.as_bytes()));
    Ok(finish(
        MetaData {
            c: ctx,
            instance_id: format!("pxed-{}-{}", ctx.hostname, &digest[..12]),
        }
        .render()?,
    ))
}

/// debian-installer's mirror questions, split out of the repository URL.
struct Mirror {
    protocol: String,
    host: String,
    directory: String,
}

fn mirror_parts(url: &str) -> Result<Mirror, InstallError> {
    let bad = || {
        invalid(
            "repo_url",
            "must be http(s)://host[:port]/path for debian-installer",
        )
    };
    let u = reqwest::Url::parse(url).map_err(|_| bad())?;
    let host = u.host_str().ok_or_else(bad)?;
    let host = match u.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    };
    let dir = u.path().trim_end_matches('/');
    Ok(Mirror {
        protocol: u.scheme().to_string(),
        host,
        directory: if dir.is_empty() {
            "/".into()
        } else {
            dir.into()
        },
    })
}

#[derive(Template)]
#[template(path = "preseed.cfg", escape = "none")]
struct Preseed<'a> {
    c: &'a InstallContext<'a>,
    arm64: bool,
    console: &'static str,
    mirror: Mirror,
    root_hash: &'a str,
    script_b64: String,
    unit_b64: String,
    sshd_path: &'static str,
    sshd_b64: String,
    ssh_keys_b64: Option<String>,
    installed_json: String,
}

/// The debian-installer preseed (`/cfg/{token}/preseed`) for a [`Family::Preseed`]
/// image. debconf values are single lines, so the agent's files travel base64-encoded.
pub fn render_preseed(ctx: &InstallContext<'_>) -> Result<String, InstallError> {
    want_family(ctx, Family::Preseed)?;
    let agent = firstboot_files(ctx)?;
    let keys = ctx
        .ssh_authorized_keys
        .iter()
        .map(|k| format!("{k}\n"))
        .collect::<String>();
    Ok(finish(
        Preseed {
            c: ctx,
            arm64: ctx.arch == Arch::Arm64,
            console: ctx.arch.serial_console(),
            mirror: mirror_parts(&ctx.repo_url)?,
            root_hash: ctx.root_password_hash.as_deref().unwrap_or("!"),
            script_b64: b64(&format!("{}\n", agent.script)),
            unit_b64: b64(&format!("{}\n", agent.unit)),
            sshd_path: SSHD_POLICY_PATH,
            sshd_b64: b64(SSHD_POLICY),
            ssh_keys_b64: (!keys.is_empty()).then(|| b64(&keys)),
            installed_json: installed_json(ctx),
        }
        .render()?,
    ))
}

/// Renders the config(s) the image's family reads, as `(file name, content)` pairs
/// named like the `/cfg/{token}/<name>` routes.
pub fn render_for(ctx: &InstallContext<'_>) -> Result<Vec<(&'static str, String)>, InstallError> {
    Ok(match ctx.image.family {
        Family::Kickstart => vec![("kickstart", render_kickstart(ctx)?)],
        Family::Autoinstall => vec![
            ("user-data", render_user_data(ctx)?),
            ("meta-data", render_meta_data(ctx)?),
        ],
        Family::Preseed => vec![("preseed", render_preseed(ctx)?)],
        // The deploy agent reads a JSON plan, not a config file.
        Family::Disk => vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::load_catalog;
    use std::path::Path;

    fn catalog() -> Vec<ImageDef> {
        load_catalog(&Path::new(env!("CARGO_MANIFEST_DIR")).join("images")).unwrap()
    }

    fn ctx<'a>(cat: &'a [ImageDef], name: &str, arch: Arch) -> InstallContext<'a> {
        let img = cat.iter().find(|d| d.name == name).unwrap();
        let mut c = InstallContext::new(
            img,
            arch,
            "http://mirror.lab:8080/pub",
            "http://10.0.0.1",
            "tok123",
            "agent456",
            "node-3a4b5c",
        )
        .unwrap();
        c.ssh_authorized_keys = vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 ops@lab".into()];
        c
    }

    /// Every `scheme://authority` in a text (the authority up to the path, a quote,
    /// a space or a line end).
    fn authorities(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find("://") {
            let after = &rest[i + 3..];
            let end = after
                .find(|c: char| {
                    matches!(c, '/' | '\'' | '"' | ']' | ',' | ')') || c.is_whitespace()
                })
                .unwrap_or(after.len());
            let auth = &after[..end];
            out.push(auth.rsplit('@').next().unwrap_or(auth).to_string());
            rest = after;
        }
        out
    }

    /// On an isolated network only the mirror and pxed answer: every host a generated
    /// config names must be one of them, and no installer may fall back on a default
    /// that reaches out (Debian's security host and NTP pool, Anaconda's NTP pools and
    /// mirror lists, Subiquity's geoip lookup and Ubuntu archives).
    #[test]
    fn configs_reach_only_the_mirror_and_pxed() {
        let cat = catalog();
        let allowed = ["mirror.lab:8080", "10.0.0.1", "ntp.lab"];
        let outside = [
            "debian.org",
            "ubuntu.com",
            "rockylinux.org",
            "fedoraproject.org",
            "pool.ntp",
            "mirrorlist",
            "metalink",
            "geoip: true",
            "cdrom",
        ];
        for arch in Arch::ALL {
            for (name, render) in [
                ("debian-13", render_preseed as fn(&InstallContext<'_>) -> _),
                ("debian-12-installer", render_preseed),
                ("rocky-9", render_kickstart),
                ("ubuntu-24.04", render_user_data),
            ] {
                let mut c = ctx(&cat, name, arch);
                // The site's NTP server is the one host besides mirror and pxed.
                if arch == Arch::Arm64 {
                    c.ntp_servers = vec!["ntp.lab".into()];
                    c.syslog = Some("10.0.0.1:514".into());
                }
                let text = render(&c).unwrap();
                let hosts = authorities(&text);
                assert!(!hosts.is_empty(), "{name} {arch}: no URL at all?");
                for h in &hosts {
                    assert!(allowed.contains(&h.as_str()), "{name} {arch}: {h}\n{text}");
                }
                for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
                    for word in outside {
                        // `cdrom/set-first false` and `disable-cdrom-entries true`
                        // turn the cdrom source off; any other mention would use it.
                        let off = line.contains("apt-setup/cdrom/set-first boolean false")
                            || line.contains("apt-setup/disable-cdrom-entries boolean true");
                        assert!(
                            off || !line.contains(word),
                            "{name} {arch}: {word} in {line}"
                        );
                    }
                }
                let has = |l: &str| text.lines().any(|x| x.trim_end() == l);
                match c.image.family {
                    Family::Preseed => {
                        // Explicit host questions (the mirror's, `*_host`, the NTP
                        // server; `netcfg/hostname` is the node's own), then the
                        // defaults that would reach security.debian.org and the NTP pool.
                        for l in text.lines().filter(|l| l.starts_with("d-i ")) {
                            let f: Vec<&str> = l.splitn(4, ' ').collect();
                            if f.len() == 4
                                && ((f[1].starts_with("mirror/") && f[1].ends_with("/hostname"))
                                    || f[1].ends_with("_host")
                                    || f[1].ends_with("ntp-server"))
                            {
                                assert!(allowed.contains(&f[3]), "{name} {arch}: {l}");
                            }
                        }
                        assert!(has("d-i apt-setup/services-select multiselect"), "{text}");
                        assert!(
                            has("d-i clock-setup/ntp boolean false") == (arch == Arch::X86_64),
                            "{text}"
                        );
                        assert!(has("d-i apt-setup/disable-cdrom-entries boolean true"));
                        assert!(has("d-i pkgsel/update-policy select none"));
                        assert!(has(
                            "popularity-contest popularity-contest/participate boolean false"
                        ));
                    }
                    Family::Kickstart => {
                        for l in text.lines() {
                            let w = l.split_whitespace().next().unwrap_or("");
                            if matches!(w, "url" | "repo") {
                                assert!(
                                    l.contains("--url=http://mirror.lab:8080/")
                                        || l.contains("--baseurl=http://mirror.lab:8080/"),
                                    "{name} {arch}: {l}"
                                );
                            }
                        }
                        assert_eq!(
                            has("timesource --ntp-disable"),
                            arch == Arch::X86_64,
                            "{text}"
                        );
                        for l in text.lines().filter(|l| l.starts_with("timesource ")) {
                            assert!(
                                l == "timesource --ntp-disable"
                                    || l == "timesource --ntp-server=ntp.lab",
                                "{name} {arch}: {l}"
                            );
                        }
                    }
                    Family::Autoinstall => {
                        for l in [
                            "    geoip: false",
                            "    fallback: offline-install",
                            "    disable_suites: [security, updates, backports, proposed]",
                            "  refresh-installer:",
                            "    update: false",
                        ] {
                            assert!(has(l), "{name} {arch}: no {l:?}\n{text}");
                        }
                        let archive = c.extra_repos["archive"].clone();
                        assert_eq!(
                            text.matches(&format!("        uri: {}", json(&archive)))
                                .count(),
                            2,
                            "primary and security at the mirror: {text}"
                        );
                    }
                    Family::Disk => unreachable!(),
                }
            }
        }
    }

    /// The operators' keys reach root (the `ubuntu` user on Ubuntu) in every family,
    /// and every family installs the same sshd policy: keys only, no passwords.
    #[test]
    fn ssh_keys_and_policy_in_every_family() {
        let cat = catalog();
        let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 ops@lab";
        let image_key = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ image@lab";
        assert!(SSHD_POLICY.contains("\nPermitRootLogin prohibit-password\n"));
        assert!(SSHD_POLICY.contains("\nPasswordAuthentication no\n"));
        for arch in Arch::ALL {
            for name in ["debian-13", "rocky-9", "ubuntu-24.04"] {
                let mut c = ctx(&cat, name, arch);
                c.ssh_authorized_keys = vec![key.into(), image_key.into()];
                c.root_password_hash = Some("$6$salt$hash".into());
                let text = render_for(&c).unwrap().remove(0).1;
                let policy = SSHD_POLICY.trim_end();
                match c.image.family {
                    Family::Kickstart => {
                        for k in [key, image_key] {
                            assert!(text.contains(&format!("\nsshkey --username=root \"{k}\"\n")));
                        }
                        assert!(
                            text.contains(&format!(
                                "cat > {SSHD_POLICY_PATH} <<'PXED_EOF'\n{policy}\nPXED_EOF\n"
                            )),
                            "{text}"
                        );
                    }
                    Family::Preseed => {
                        assert!(text.contains(&b64(&format!("{key}\n{image_key}\n"))));
                        assert!(text.contains("/root/.ssh/authorized_keys"));
                        assert!(
                            text.contains(&format!(
                                "echo {} | base64 -d > {SSHD_POLICY_PATH}",
                                b64(SSHD_POLICY)
                            )),
                            "{text}"
                        );
                    }
                    Family::Autoinstall => {
                        assert!(text.contains(&format!(
                            "    authorized-keys: {}\n",
                            serde_json::to_string(&[key, image_key]).unwrap()
                        )));
                        assert!(text.contains("    allow-pw: false\n"));
                        let indented: String =
                            policy.lines().map(|l| format!("      {l}\n")).collect();
                        assert!(
                            text.contains(&format!(
                                "cat > /target{SSHD_POLICY_PATH} <<'PXED_EOF'\n{indented}      PXED_EOF\n"
                            )),
                            "{text}"
                        );
                    }
                    Family::Disk => unreachable!(),
                }
            }
        }
    }

    #[test]
    fn base64_matches_rfc4648() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(b64(i), o, "{i}");
        }
    }

    #[test]
    fn context_urls() {
        let cat = catalog();
        let c = ctx(&cat, "rocky-9", Arch::Arm64);
        assert_eq!(
            c.repo_url,
            "http://mirror.lab:8080/pub/rocky/9/BaseOS/aarch64/os/"
        );
        assert_eq!(c.callback_base, "http://10.0.0.1/cb/tok123");
        assert_eq!(c.agent_base, "http://10.0.0.1/cb/agent456");
        assert_eq!(c.config_base, "http://10.0.0.1/cfg/tok123");
        assert_eq!(
            c.extra_repos["appstream"],
            "http://mirror.lab:8080/pub/rocky/9/AppStream/aarch64/os/"
        );
    }

    #[test]
    fn kickstart_arch_branches() {
        let cat = catalog();
        let x = render_kickstart(&ctx(&cat, "rocky-9", Arch::X86_64)).unwrap();
        let a = render_kickstart(&ctx(&cat, "rocky-9", Arch::Arm64)).unwrap();
        let lines = |s: &str| s.lines().map(str::to_owned).collect::<Vec<_>>();
        assert!(lines(&x).contains(&"reqpart".to_string()));
        assert!(!lines(&a).contains(&"reqpart".to_string()));
        assert!(lines(&a).contains(&"part /boot/efi --fstype=efi --size=600".to_string()));
        assert!(x.contains("--append=\"console=tty0 console=ttyS0,115200\""));
        assert!(a.contains("--append=\"console=tty0 console=ttyAMA0,115200\""));
        assert!(lines(&x).contains(&"rootpw --lock".to_string()));
    }

    #[test]
    fn wrong_family_is_refused() {
        let cat = catalog();
        let c = ctx(&cat, "rocky-9", Arch::X86_64);
        assert!(matches!(
            render_preseed(&c),
            Err(InstallError::WrongFamily { .. })
        ));
        assert!(matches!(
            render_user_data(&c),
            Err(InstallError::WrongFamily { .. })
        ));
        assert_eq!(render_for(&c).unwrap()[0].0, "kickstart");
    }

    #[test]
    fn injection_is_refused() {
        let cat = catalog();
        let mut c = ctx(&cat, "debian-13", Arch::X86_64);
        c.hostname = "x'; reboot".into();
        assert!(matches!(
            render_preseed(&c),
            Err(InstallError::Invalid {
                field: "hostname",
                ..
            })
        ));
        let mut c = ctx(&cat, "debian-13", Arch::X86_64);
        c.ssh_authorized_keys = vec!["ssh-ed25519 AAAA\nd-i x string y".into()];
        assert!(matches!(
            render_preseed(&c),
            Err(InstallError::Invalid {
                field: "ssh_authorized_keys",
                ..
            })
        ));
        let mut c = ctx(&cat, "debian-13", Arch::X86_64);
        c.callback_base = "http://x/'$(id)'".into();
        assert!(matches!(
            render_preseed(&c),
            Err(InstallError::Invalid {
                field: "callback_base",
                ..
            })
        ));
        let mut c = ctx(&cat, "debian-13", Arch::X86_64);
        c.timezone = "UTC\nd-i".into();
        assert!(render_preseed(&c).is_err());
    }

    /// Found by the `renderers` fuzz target: a key with a line break other than `\n`
    /// or `\r` passed, and split the kickstart's `sshkey` line for Anaconda (pykickstart
    /// then refuses the file: "No closing quotation").
    #[test]
    fn ssh_keys_with_any_line_break_are_refused() {
        let cat = catalog();
        for bad in [
            "\x0b", "\x0c", "\x1c", "\u{85}", "\u{2028}", "\u{2029}", "\t", "\0",
        ] {
            let mut c = ctx(&cat, "rocky-9", Arch::X86_64);
            c.ssh_authorized_keys = vec![format!("ssh-ed25519 AAAA{bad}%pre")];
            assert!(
                matches!(
                    render_kickstart(&c),
                    Err(InstallError::Invalid {
                        field: "ssh_authorized_keys",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn preseed_mirror_split() {
        let m = mirror_parts("http://mirror.lab:8080/pub/debian/").unwrap();
        assert_eq!(
            (m.protocol.as_str(), m.host.as_str(), m.directory.as_str()),
            ("http", "mirror.lab:8080", "/pub/debian")
        );
        let m = mirror_parts("https://deb.example/").unwrap();
        assert_eq!(
            (m.host.as_str(), m.directory.as_str()),
            ("deb.example", "/")
        );
    }

    #[test]
    fn agent_is_identical_in_every_config() {
        let cat = catalog();
        for (name, arch) in [
            ("rocky-9", Arch::X86_64),
            ("ubuntu-24.04", Arch::Arm64),
            ("debian-13", Arch::X86_64),
        ] {
            let c = ctx(&cat, name, arch);
            let agent = firstboot_files(&c).unwrap();
            assert!(agent.script.starts_with("#!/bin/sh\n"));
            assert!(agent.script.contains("CB='http://10.0.0.1/cb/agent456'"));
            // The boot token is the installer's: the installed system never holds it.
            assert!(!agent.script.contains("tok123"), "{}", agent.script);
            assert!(!agent.unit.contains("agent456"), "{}", agent.unit);
            assert!(
                agent
                    .unit
                    .contains("ConditionPathExists=!/var/lib/pxed-firstboot.done")
            );
            let out = render_for(&c).unwrap();
            let body = &out[0].1;
            match c.image.family {
                Family::Preseed => {
                    assert!(body.contains(&b64(&format!("{}\n", agent.script))))
                }
                Family::Kickstart => assert!(body.contains(&agent.script)),
                Family::Autoinstall => {
                    let indented: String = agent
                        .script
                        .lines()
                        .map(|l| {
                            if l.is_empty() {
                                "\n".into()
                            } else {
                                format!("      {l}\n")
                            }
                        })
                        .collect();
                    assert!(body.contains(indented.trim_start()), "{body}");
                }
                Family::Disk => unreachable!("no disk image in this list"),
            }
        }
    }

    #[test]
    fn configs_end_with_newline() {
        let cat = catalog();
        for d in &cat {
            for (name, body) in render_for(&ctx(&cat, &d.name, Arch::X86_64)).unwrap() {
                assert!(body.ends_with('\n') && !body.ends_with("\n\n"), "{name}");
            }
        }
    }

    #[test]
    fn meta_data_changes_with_token() {
        let cat = catalog();
        let a = render_meta_data(&ctx(&cat, "ubuntu-24.04", Arch::X86_64)).unwrap();
        let mut c = ctx(&cat, "ubuntu-24.04", Arch::X86_64);
        c.config_base = "http://10.0.0.1/cfg/other".into();
        let b = render_meta_data(&c).unwrap();
        assert!(a.contains("local-hostname: node-3a4b5c"));
        assert_ne!(a.lines().next(), b.lines().next());
    }
}
