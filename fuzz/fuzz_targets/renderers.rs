//! Renderers with hostile node data: the per-node iPXE script (`script::render`, with
//! install branches built by `images::kernel_cmdline` as `provision` builds them) and
//! the install configs (`install::render_for`: kickstart, user-data + meta-data,
//! preseed) from an `InstallContext` whose hostname, URLs, token, SSH keys, password
//! hash and time zone come from the fuzzer, for every image of the repo's catalog.
//!
//! Invariants, besides "no panic":
//! - iPXE: the script has the same lines as with a plain reason and plain node data,
//!   and on every command line the same iPXE control tokens (`||`, `&&`, `;`, `#...`)
//!   and `${...}` expansions: nothing from the node or the reason becomes a command, a
//!   branch, a comment or a setting expansion; the reason stays in its comment;
//! - a kernel command line that `kernel_cmdline` accepts has no such token either;
//! - install configs: a config that renders has as many lines as the same config
//!   rendered from plain values, counting every line break a consumer may see
//!   (Python's `str.splitlines`, which Anaconda, cloud-init and debconf tools use:
//!   `\n \r \v \f \x1c-\x1e \x85 U+2028 U+2029`): no value spills onto a line of its own.
#![no_main]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pxed::images::{Arch, ArchDef, Family, ImageDef, kernel_cmdline, parse_image};
use pxed::install::{InstallContext, firstboot_files, render_for};
use pxed::model::Mac;
use pxed::script::{Action, ArchBoot, render};

/// The fuzz input: 9 bytes (MAC, action, image, flags), then UTF-8 fields separated by
/// `\x1f`: reason, host, mirror base, token, hostname, SSH keys (separated by `\x1e`),
/// root password hash, time zone, first-boot agent token. A missing field takes a plain value, so short inputs
/// still reach the renderers rather than stopping at validation.
#[derive(Debug)]
struct Input {
    mac: [u8; 6],
    /// 0: local boot, 1: discovery, else install.
    action: u8,
    image: u8,
    arm64: bool,
    reason: String,
    /// The `Host` the node sent (used as `http::agent::base_url` uses it with
    /// `trust_host_header`: only when it passes that filter).
    host: String,
    mirror_base: String,
    token: String,
    hostname: String,
    ssh_keys: Vec<String>,
    root_hash: Option<String>,
    timezone: String,
    agent_token: String,
}

impl Input {
    fn parse(data: &[u8]) -> Option<Input> {
        let (head, rest) = data.split_at_checked(9)?;
        let text = std::str::from_utf8(rest).ok()?;
        let mut f = text.split('\x1f');
        let mut next = |plain: &str| f.next().unwrap_or(plain).to_string();
        let reason = next("reinstall generation 2 of node 7");
        let host = next("10.0.0.1:8080");
        let mirror_base = next("http://mirror.lab/pub/");
        let token = next("tok123");
        let hostname = next("node-3a4b5c");
        let keys = next("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 ops@lab");
        let hash = next("$6$salt$hash");
        let timezone = next("Europe/Berlin");
        let agent_token = next("agt456");
        Some(Input {
            mac: head[..6].try_into().ok()?,
            action: head[6],
            image: head[7],
            arm64: head[8] & 1 == 1,
            reason,
            host,
            mirror_base,
            token,
            hostname,
            ssh_keys: keys
                .split('\x1e')
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect(),
            root_hash: (head[8] & 2 == 2).then_some(hash),
            timezone,
            agent_token,
        })
    }
}

fn catalog() -> &'static [ImageDef] {
    static C: OnceLock<Vec<ImageDef>> = OnceLock::new();
    C.get_or_init(|| {
        let mut v: Vec<ImageDef> = [
            (
                "debian-12.toml",
                include_str!("../../images/debian-12.toml"),
            ),
            (
                "debian-13.toml",
                include_str!("../../images/debian-13.toml"),
            ),
            ("rocky-9.toml", include_str!("../../images/rocky-9.toml")),
            (
                "ubuntu-24.04.toml",
                include_str!("../../images/ubuntu-24.04.toml"),
            ),
        ]
        .into_iter()
        .map(|(name, text)| parse_image(text, Path::new(name)).expect("catalog image"))
        .collect();
        // A whole-disk image (the deploy agent's family), x86_64 only.
        v.push(ImageDef {
            name: "disk-test".into(),
            description: String::new(),
            family: Family::Disk,
            arches: BTreeMap::from([(
                Arch::X86_64,
                ArchDef {
                    kernel: "deploy/vmlinuz".into(),
                    initrd: "deploy/initrd".into(),
                    cmdline: "quiet".into(),
                    repo: String::new(),
                    disk: Some("disk-test/disk.raw.zst".into()),
                    disk_manifest: Some("disk-test/manifest.json".into()),
                    extra_repos: BTreeMap::new(),
                    sha256_kernel: None,
                    sha256_initrd: None,
                },
            )]),
            ssh_authorized_keys: vec![],
        });
        v
    })
}

/// `http::agent::base_url`'s rule for the `Host` header (with `trust_host_header`),
/// else the configured server.
fn base_url(host: &str) -> String {
    if !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '[' | ']'))
    {
        format!("http://{host}")
    } else {
        "http://10.0.0.1".into()
    }
}

/// What `provision::install_action` builds: one branch per iPXE build arch.
fn install_action(img: &ImageDef, base: &str, mirror: &str, token: &str, host: &str) -> Action {
    let mut arches = Vec::new();
    for arch in Arch::ALL {
        if !img.arches.contains_key(&arch) {
            continue;
        }
        let config_base = format!("{base}/cfg/{token}");
        // The syslog receiver as pxed points installers at it (the server's address).
        let syslog = base.strip_prefix("http://").map(|h| format!("{h}:514"));
        let Ok(cmdline) = kernel_cmdline(img, arch, mirror, &config_base, host, syslog.as_deref())
        else {
            continue;
        };
        for &ipxe_arch in arch.ipxe_buildarches() {
            arches.push(ArchBoot {
                ipxe_arch,
                label: ipxe_arch,
                kernel_url: format!("{base}/images/{}/{}/kernel", img.name, arch.as_str()),
                initrd_url: format!("{base}/images/{}/{}/initrd", img.name, arch.as_str()),
                cmdline: cmdline.clone(),
            });
        }
    }
    Action::Install(arches)
}

/// Per command line (comments skipped): its iPXE control tokens and expansions.
fn ipxe_shape(script: &str) -> Vec<Vec<String>> {
    script
        .split('\n')
        .map(|line| {
            if line.trim_start().starts_with('#') {
                return vec!["<comment>".to_string()];
            }
            let mut shape: Vec<String> = line
                .split_whitespace()
                .filter(|t| matches!(*t, "||" | "&&" | ";") || t.starts_with('#'))
                .map(String::from)
                .collect();
            shape.extend(line.match_indices("${").map(|_| "${".to_string()));
            shape
        })
        .collect()
}

fn check_cmdline(cmdline: &str) {
    assert!(
        !cmdline.contains(['\n', '\r', '"', '\'']),
        "kernel_cmdline accepted {cmdline:?}"
    );
    for t in cmdline.split_whitespace() {
        assert!(
            !(matches!(t, "||" | "&&" | ";") || t.starts_with('#') || t.contains("${")),
            "kernel_cmdline accepted the token {t:?}"
        );
    }
}

fn check_script(inp: &Input, img: &ImageDef) {
    let mac = Mac(inp.mac).to_string();
    let base = base_url(&inp.host);
    let mirror = if inp.mirror_base.is_empty() {
        format!("{base}/images/")
    } else {
        inp.mirror_base.clone()
    };
    let hostile = match inp.action {
        0 => Action::LocalBoot,
        1 => Action::Discovery,
        _ => install_action(img, &base, &mirror, &inp.token, &inp.hostname),
    };
    if let Action::Install(a) = &hostile {
        for b in a {
            check_cmdline(&b.cmdline);
        }
    }
    let plain = match &hostile {
        Action::Install(a) => Action::Install(
            a.iter()
                .map(|b| ArchBoot {
                    kernel_url: "http://s/k".into(),
                    initrd_url: "http://s/i".into(),
                    cmdline: "console=tty0".into(),
                    ..b.clone()
                })
                .collect(),
        ),
        other => other.clone(),
    };
    let got = render(&mac, &hostile, &inp.reason).expect("script renders");
    let want = render(&mac, &plain, "plain reason").expect("script renders");
    assert!(got.starts_with("#!ipxe\n"));
    assert_eq!(
        ipxe_shape(&got),
        ipxe_shape(&want),
        "node data or reason changed the script's structure:\n{got}"
    );
}

/// Line breaks as Python's `str.splitlines` sees them (`\r\n` is one).
fn line_breaks(s: &str) -> usize {
    let n = s
        .chars()
        .filter(|c| {
            matches!(
                c,
                '\n' | '\r'
                    | '\x0b'
                    | '\x0c'
                    | '\x1c'
                    | '\x1d'
                    | '\x1e'
                    | '\u{85}'
                    | '\u{2028}'
                    | '\u{2029}'
            )
        })
        .count();
    n - s.matches("\r\n").count()
}

fn check_install(inp: &Input, img: &ImageDef) {
    let arch = if inp.arm64 { Arch::Arm64 } else { Arch::X86_64 };
    let base = base_url(&inp.host);
    let Ok(mut c) = InstallContext::new(
        img,
        arch,
        &inp.mirror_base,
        &base,
        &inp.token,
        &inp.agent_token,
        &inp.hostname,
    ) else {
        return;
    };
    c.ssh_authorized_keys = inp.ssh_keys.iter().take(4).cloned().collect();
    c.root_password_hash = inp.root_hash.clone();
    c.timezone = inp.timezone.clone();
    let Ok(got) = render_for(&c) else {
        return;
    };
    if got.is_empty() {
        // A disk image: the deploy agent reads a JSON plan, there is no config to render.
        return;
    }
    let agent = firstboot_files(&c).expect("the agent renders when its config does");

    let mut p = InstallContext::new(
        img,
        arch,
        "http://mirror.lab/",
        "http://10.0.0.1",
        "tok",
        "agt",
        "node-1",
    )
    .expect("plain context");
    p.ssh_authorized_keys = (0..c.ssh_authorized_keys.len())
        .map(|i| format!("ssh-ed25519 AAAA{i} ops@lab"))
        .collect();
    p.root_password_hash = c.root_password_hash.as_ref().map(|_| "$6$salt$hash".into());
    p.timezone = "UTC".into();
    let want = render_for(&p).expect("plain config renders");
    let plain_agent = firstboot_files(&p).expect("plain agent renders");

    assert_eq!(
        line_breaks(&agent.script),
        line_breaks(&plain_agent.script),
        "agent script lines:\n{}",
        agent.script
    );
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        assert_eq!(
            line_breaks(g),
            line_breaks(w),
            "{name}: node data added or removed a line:\n{g}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some(inp) = Input::parse(data) else {
        return;
    };
    let cat = catalog();
    let img = &cat[inp.image as usize % cat.len()];
    check_script(&inp, img);
    check_install(&inp, img);
});
