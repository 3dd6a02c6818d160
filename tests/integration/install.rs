//! Generated install configs checked by the distributions' own tools, the first-boot
//! agent run for real against a local callback server, and image import over HTTP.
//!
//! Tools (installed by .ci/install.sh; a missing one fails the test):
//! ksvalidator (pykickstart venv), cloud-init, debconf-set-selections, bash, shellcheck,
//! systemd-analyze, python3 with yaml and jsonschema, curl, ip.

use axum::Router;
use axum::extract::{Path as AxPath, State};
use axum::http::StatusCode;
use axum::routing::post;
use pxed::images::{self, Arch, Family, ImageDef, ImageError};
use pxed::install::{self, InstallContext};
use pxed::wire::{FirstBootReport, HealthReport, HealthStatus, InstalledReport};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const HOST: &str = "node-3a4b5c";
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFzw0hP0JjpQ3nWq2m8Jt2d5Q2x4J0Lw1r3n8i7o9p0q ops@lab";
const HASH: &str = "$6$rounds=4096$pxedsalt$QmJ3ZbZ6cJ0b0qfY8Y0m3x5Wc3i9o2Y1Qh7m9K2y6j0L3J1n0Zb8e1xk3mJYwq6G9uJp4b7m2z1R5s0t8v9w0";

fn peers_dir() -> PathBuf {
    std::env::var_os("PEERS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/pxed-peers"))
}

/// Finds a tool or fails loudly: CI installs every one of them.
fn tool(name: &str, candidates: &[PathBuf]) -> PathBuf {
    for c in candidates {
        if c.is_file() {
            return c.clone();
        }
    }
    if let Ok(out) = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        && out.status.success()
    {
        return PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    }
    panic!("{name} is not installed: run .ci/install.sh");
}

/// Runs a command, returning (success, stdout+stderr).
fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// System python: cloud-init, yaml and jsonschema come from Debian packages.
fn python() -> PathBuf {
    tool("python3", &[PathBuf::from("/usr/bin/python3")])
}

fn catalog() -> Vec<ImageDef> {
    images::load_catalog(&Path::new(env!("CARGO_MANIFEST_DIR")).join("images")).unwrap()
}

fn ctx<'a>(cat: &'a [ImageDef], family: Family, arch: Arch) -> InstallContext<'a> {
    let img = cat.iter().find(|d| d.family == family).unwrap();
    let mut c = InstallContext::new(
        img,
        arch,
        "http://mirror.lab:8080/pub/",
        "http://10.0.0.1",
        "tok-0123456789abcdef",
        "agent-fedcba9876543210",
        HOST,
    )
    .unwrap();
    c.ssh_authorized_keys = vec![KEY.into()];
    c.root_password_hash = Some(HASH.into());
    c.timezone = "Europe/Berlin".into();
    // One arch with the site's NTP servers and pxed's syslog address, one without:
    // the validators see both branches.
    if arch == Arch::Arm64 {
        c.ntp_servers = vec!["ntp1.lab".into(), "10.0.0.5".into()];
        c.syslog = Some("10.0.0.1:514".into());
    }
    c
}

/// Writes `content` to `dir/name`; with `PXED_INSTALL_DUMP=<dir>` also keeps a copy
/// there (prefixed by the test's temp dir name) for reading the generated configs.
fn write(dir: &Path, name: &str, content: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    if let Some(keep) = std::env::var_os("PXED_INSTALL_DUMP") {
        let tag = dir.file_name().unwrap().to_string_lossy();
        std::fs::create_dir_all(&keep).unwrap();
        std::fs::write(Path::new(&keep).join(format!("{tag}-{name}")), content).unwrap();
    }
    p
}

/// The body of the first `cat > <dest> <<'PXED_EOF'` heredoc in `text`, with
/// `indent` leading spaces stripped from each line.
fn heredoc(text: &str, dest: &str, indent: usize) -> String {
    let start = format!("cat > {dest} <<'PXED_EOF'");
    let mut lines = text.lines().skip_while(|l| l.trim() != start).skip(1);
    let mut out = Vec::new();
    for l in lines.by_ref() {
        if l.trim() == "PXED_EOF" {
            return out.join("\n");
        }
        out.push(l.get(indent..).unwrap_or("").to_string());
    }
    panic!("no heredoc for {dest} in:\n{text}");
}

/// Checks the agent with bash -n, shellcheck and systemd-analyze verify.
fn check_agent(dir: &Path, script: &str, unit: &str) {
    let bash = tool("bash", &[]);
    let shellcheck = tool("shellcheck", &[]);
    let sa = tool("systemd-analyze", &[]);
    let s = write(dir, "pxed-firstboot", &format!("{script}\n"));
    let (ok, out) = run(Command::new(&bash).arg("-n").arg(&s));
    assert!(ok, "bash -n: {out}");
    let (ok, out) = run(Command::new(&shellcheck).args(["-s", "sh"]).arg(&s));
    assert!(ok, "shellcheck:\n{out}\n{script}");

    // verify resolves ExecStart= under --root, so lay the agent out where it goes.
    let root = dir.join("root");
    let sbin = root.join("usr/local/sbin");
    let units = root.join("etc/systemd/system");
    std::fs::create_dir_all(&sbin).unwrap();
    std::fs::create_dir_all(&units).unwrap();
    std::fs::copy(&s, sbin.join("pxed-firstboot")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        sbin.join("pxed-firstboot"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    // verify builds the start transaction, so it needs the stock units under the root.
    let stock = root.join("usr/lib/systemd");
    std::fs::create_dir_all(&stock).unwrap();
    let (ok, out) = run(Command::new("cp")
        .args(["-a", "/usr/lib/systemd/system"])
        .arg(&stock));
    assert!(ok, "copying the stock units: {out}");
    let u = units.join("pxed-firstboot.service");
    std::fs::write(&u, format!("{unit}\n")).unwrap();
    let (ok, out) = run(Command::new(&sa)
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .arg("/etc/systemd/system/pxed-firstboot.service"));
    let ours: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("pxed-firstboot"))
        .collect();
    assert!(ok && ours.is_empty(), "systemd-analyze verify:\n{out}");
    let unit_lines: Vec<&str> = unit.lines().collect();
    for want in [
        "Type=oneshot",
        "After=sysinit.target basic.target network-online.target",
        "ConditionPathExists=!/var/lib/pxed-firstboot.done",
        "WantedBy=multi-user.target",
    ] {
        assert!(unit_lines.contains(&want), "{want} missing:\n{unit}");
    }
}

fn expected_agent(c: &InstallContext<'_>) -> install::FirstBootFiles {
    install::firstboot_files(c).unwrap()
}

const KS_DUMP: &str = r#"
import json, sys
from pykickstart.constants import FIRSTBOOT_SKIP, KS_SCRIPT_POST
from pykickstart.parser import KickstartParser
from pykickstart.version import RHEL9, makeVersion
h = makeVersion(RHEL9)
p = KickstartParser(h)
p.readKickstart(sys.argv[1])
print(json.dumps({
    "hostnames": [n.hostname for n in h.network.network],
    "skipx": bool(h.skipx.skipx),
    "firstboot_disabled": h.firstboot.firstboot == FIRSTBOOT_SKIP,
    "excluded": sorted(h.packages.excludedList),
    "packages": sorted(h.packages.packageList),
    "url": h.url.url,
    "repos": {r.name: r.baseurl for r in h.repo.repoList},
    "append": h.bootloader.appendLine,
    "reqpart": bool(h.reqpart.reqpart),
    "mounts": [p.mountpoint for p in h.partition.partitions],
    "sshkeys": [k.key for k in h.sshkey.sshUserList],
    "rootpw_crypted": bool(h.rootpw.isCrypted),
    "timesources": [[t.ntp_server, t.ntp_pool, bool(t.ntp_disable)] for t in h.timesource.dataList()],
    "post": [s.script for s in h.scripts if s.type == KS_SCRIPT_POST],
}))
"#;

#[test]
fn kickstart_validates_and_parses() {
    let ksvalidator = tool("ksvalidator", &[peers_dir().join("venv/bin/ksvalidator")]);
    let py = ksvalidator.with_file_name("python3");
    let cat = catalog();
    for arch in Arch::ALL {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(&cat, Family::Kickstart, arch);
        let ks = install::render_kickstart(&c).unwrap();
        let f = write(dir.path(), &format!("kickstart-{arch}.ks"), &ks);
        let (ok, out) = run(Command::new(&ksvalidator).args(["-v", "RHEL9"]).arg(&f));
        // It names the file it checks; anything else is an error or a deprecation.
        let complaints: Vec<&str> = out
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("Checking kickstart file"))
            .collect();
        assert!(
            ok && complaints.is_empty(),
            "ksvalidator {arch}:\n{out}\n{ks}"
        );

        let (ok, out) = run(Command::new(&py).arg("-c").arg(KS_DUMP).arg(&f));
        assert!(ok, "{out}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["hostnames"], serde_json::json!([HOST]));
        assert_eq!(v["skipx"], true);
        assert_eq!(v["firstboot_disabled"], true);
        assert_eq!(
            v["excluded"],
            serde_json::json!(["initial-setup", "initial-setup-gui"])
        );
        let pkgs: Vec<&str> = v["packages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            pkgs.contains(&"curl") && pkgs.contains(&"pciutils"),
            "{pkgs:?}"
        );
        assert_eq!(v["url"], c.repo_url.as_str());
        assert_eq!(v["repos"]["appstream"], c.extra_repos["appstream"].as_str());
        assert_eq!(v["sshkeys"], serde_json::json!([KEY]));
        assert_eq!(v["rootpw_crypted"], true);
        if arch == Arch::Arm64 {
            assert!(ks.contains("\ntimesource --ntp-server=ntp1.lab\n"), "{ks}");
            assert!(ks.contains("\ntimesource --ntp-server=10.0.0.5\n"), "{ks}");
            assert!(!ks.contains("--ntp-disable"), "{ks}");
        } else {
            assert!(ks.contains("\ntimesource --ntp-disable\n"), "{ks}");
        }
        // Isolated network: NTP off, no server or pool; or the site's servers only.
        if arch == Arch::Arm64 {
            assert_eq!(
                v["timesources"],
                serde_json::json!([["ntp1.lab", "", false], ["10.0.0.5", "", false]])
            );
        } else {
            assert_eq!(v["timesources"], serde_json::json!([["", "", true]]));
        }
        let append = v["append"].as_str().unwrap();
        let mounts: Vec<&str> = v["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        match arch {
            Arch::X86_64 => {
                assert!(append.split(' ').any(|a| a == "console=ttyS0,115200"));
                assert_eq!(v["reqpart"], true);
                assert_eq!(mounts, ["/boot", "/"]);
            }
            Arch::Arm64 => {
                assert!(append.split(' ').any(|a| a == "console=ttyAMA0,115200"));
                assert_eq!(v["reqpart"], false);
                assert_eq!(mounts, ["/boot/efi", "/boot", "/"]);
            }
        }

        let posts = v["post"].as_array().unwrap();
        assert_eq!(posts.len(), 1);
        let post = posts[0].as_str().unwrap();
        let post_lines: Vec<&str> = post.lines().collect();
        assert!(
            post_lines.contains(&"systemctl set-default multi-user.target"),
            "{post}"
        );
        assert!(post_lines.contains(&"systemctl enable pxed-firstboot.service"));
        assert!(
            post_lines
                .iter()
                .any(|l| l.starts_with("systemctl disable initial-setup.service"))
        );
        check_installed_call(post, &c);

        let agent = expected_agent(&c);
        let script = heredoc(post, "/usr/local/sbin/pxed-firstboot", 0);
        let unit = heredoc(post, "/etc/systemd/system/pxed-firstboot.service", 0);
        assert_eq!(script, agent.script);
        assert_eq!(unit, agent.unit);
        check_agent(dir.path(), &script, &unit);
        assert_eq!(
            heredoc(post, install::SSHD_POLICY_PATH, 0),
            install::SSHD_POLICY.trim_end()
        );
    }
}

/// The installed callback: a curl POST of an [`InstalledReport`] to the callback URL.
fn check_installed_call(text: &str, c: &InstallContext<'_>) {
    let url = format!("'{}/installed'", c.callback_base);
    let line = text
        .lines()
        .find(|l| l.contains("curl ") && l.contains(&url))
        .unwrap_or_else(|| panic!("no installed callback in:\n{text}"));
    let body = line
        .split("--data-binary '")
        .nth(1)
        .and_then(|r| r.split('\'').next())
        .unwrap();
    let r: InstalledReport = serde_json::from_str(body).unwrap();
    assert_eq!(r.hostname, HOST);
    assert_eq!(r.arch, c.arch);
}

/// A structural schema for the autoinstall keys pxed emits (after the Subiquity
/// reference): wrong types or misspelled keys fail.
const AUTOINSTALL_CHECK: &str = r##"
import json, sys, yaml, jsonschema
text = open(sys.argv[1]).read()
assert text.startswith("#cloud-config\n"), "no #cloud-config header"
doc = yaml.safe_load(text)
str_list = {"type": "array", "items": {"type": "string"}}
# Subiquity's `apt` keys (geoip, fallback, preserve_sources_list, primary) and the
# curtin apt keys it passes on (security, disable_suites).
mirrors = {"type": "array", "items": {
    "type": "object", "required": ["arches", "uri"], "additionalProperties": False,
    "properties": {"arches": str_list, "uri": {"type": "string"}}}}
schema = {
  "type": "object", "required": ["autoinstall"], "additionalProperties": False,
  "properties": {"autoinstall": {
    "type": "object", "additionalProperties": False,
    "required": ["version", "identity", "late-commands"],
    "properties": {
      "version": {"const": 1},
      "locale": {"type": "string"},
      "keyboard": {"type": "object", "required": ["layout"]},
      "timezone": {"type": "string"},
      "refresh-installer": {"type": "object", "properties": {"update": {"type": "boolean"}}},
      "reporting": {"type": "object", "additionalProperties": {
          "type": "object", "required": ["type"],
          "properties": {"type": {"enum": ["print", "rsyslog", "webhook", "none"]},
                         "endpoint": {"type": "string"}}}},
      "early-commands": str_list,
      "network": {"type": "object", "required": ["version", "ethernets"]},
      "apt": {"type": "object", "additionalProperties": False, "properties": {
          "primary": mirrors, "security": mirrors,
          "geoip": {"type": "boolean"}, "preserve_sources_list": {"type": "boolean"},
          "fallback": {"enum": ["abort", "continue-anyway", "offline-install"]},
          "disable_suites": str_list}},
      "identity": {"type": "object", "additionalProperties": False,
                   "required": ["hostname", "username", "password"],
                   "properties": {"hostname": {"type": "string"}, "username": {"type": "string"},
                                  "password": {"type": "string"}, "realname": {"type": "string"}}},
      "ssh": {"type": "object", "additionalProperties": False, "properties": {
          "install-server": {"type": "boolean"}, "allow-pw": {"type": "boolean"},
          "authorized-keys": str_list}},
      "storage": {"type": "object", "properties": {"layout": {"type": "object", "required": ["name"],
          "properties": {"name": {"enum": ["direct", "lvm", "zfs"]}}}}},
      "packages": str_list,
      "late-commands": str_list,
      "shutdown": {"enum": ["reboot", "poweroff"]},
    }}}}
jsonschema.validate(doc, schema)
print(json.dumps(doc))
"##;

#[test]
fn user_data_validates_and_parses() {
    let cloud_init = tool("cloud-init", &[PathBuf::from("/usr/bin/cloud-init")]);
    let py = python();
    let cat = catalog();
    for arch in Arch::ALL {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(&cat, Family::Autoinstall, arch);
        let ud = install::render_user_data(&c).unwrap();
        let f = write(dir.path(), &format!("user-data-{arch}.yaml"), &ud);
        let (ok, out) = run(Command::new(&cloud_init)
            .args(["schema", "--config-file"])
            .arg(&f));
        assert!(
            ok && out.contains("Valid cloud-config"),
            "cloud-init schema {arch}:\n{out}\n{ud}"
        );

        let (ok, out) = run(Command::new(&py).arg("-c").arg(AUTOINSTALL_CHECK).arg(&f));
        assert!(ok, "autoinstall schema {arch}:\n{out}\n{ud}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let ai = &v["autoinstall"];
        assert_eq!(ai["identity"]["hostname"], HOST);
        assert_eq!(ai["identity"]["password"], HASH);
        assert_eq!(ai["ssh"]["authorized-keys"], serde_json::json!([KEY]));
        assert_eq!(ai["timezone"], "Europe/Berlin");
        let late = ai["late-commands"].to_string();
        if arch == Arch::Arm64 {
            let early = ai["early-commands"][0].as_str().unwrap();
            assert!(early.contains("\"*.* @10.0.0.1:514\""), "{early}");
            assert!(late.contains("NTP=ntp1.lab 10.0.0.5"), "{late}");
        } else {
            assert!(ai.get("early-commands").is_none(), "{ud}");
            assert!(!late.contains("timesyncd"), "{late}");
        }
        // Progress and errors go to pxed's reporting webhook under the boot token.
        assert_eq!(ai["reporting"]["pxed"]["type"], "webhook");
        assert_eq!(
            ai["reporting"]["pxed"]["endpoint"],
            format!("{}/events", c.callback_base)
        );
        assert_eq!(
            ai["apt"]["primary"][0]["arches"],
            serde_json::json!([arch.debian()])
        );
        let archive = match arch {
            Arch::X86_64 => "http://mirror.lab:8080/pub/ubuntu/",
            Arch::Arm64 => "http://mirror.lab:8080/pub/ubuntu-ports/",
        };
        assert_eq!(ai["apt"]["primary"][0]["uri"], archive);
        // Isolated network: the mirror for security too, no geoip, offline fallback.
        assert_eq!(ai["apt"]["security"][0]["uri"], archive);
        assert_eq!(ai["apt"]["geoip"], false);
        assert_eq!(ai["apt"]["fallback"], "offline-install");
        assert_eq!(
            ai["apt"]["disable_suites"],
            serde_json::json!(["security", "updates", "backports", "proposed"])
        );
        let late: Vec<&str> = ai["late-commands"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(late.contains(
            &"curtin in-target --target=/target -- systemctl set-default multi-user.target"
        ));
        assert!(
            late.iter()
                .any(|l| l.contains("apt-get -y purge gnome-initial-setup"))
        );
        assert!(late.contains(
            &"curtin in-target --target=/target -- systemctl enable pxed-firstboot.service"
        ));
        let all = late.join("\n");
        check_installed_call(&all, &c);
        for cmd in &late {
            let (ok, out) = run(Command::new("sh").args(["-n", "-c", cmd]));
            assert!(ok, "late-command does not parse: {out}\n{cmd}");
        }

        let agent = expected_agent(&c);
        let script = heredoc(&all, "/target/usr/local/sbin/pxed-firstboot", 0);
        let unit = heredoc(&all, "/target/etc/systemd/system/pxed-firstboot.service", 0);
        assert_eq!(script, agent.script);
        assert_eq!(unit, agent.unit);
        check_agent(dir.path(), &script, &unit);

        let md = install::render_meta_data(&c).unwrap();
        let mf = write(dir.path(), &format!("meta-data-{arch}.yaml"), &md);
        let (ok, out) = run(Command::new(&py)
            .arg("-c")
            .arg("import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))")
            .arg(&mf));
        assert!(ok, "{out}");
        let m: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(m["local-hostname"], HOST);
        assert!(
            m["instance-id"]
                .as_str()
                .unwrap()
                .starts_with("pxed-node-3a4b5c-")
        );
    }
}

/// debconf lines joined across `\` continuations: (owner, question) → (type, value).
fn parse_preseed(text: &str) -> BTreeMap<(String, String), (String, String)> {
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        if cur.is_empty() && (line.starts_with('#') || line.trim().is_empty()) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            cur.push_str(head);
            continue;
        }
        cur.push_str(line);
        logical.push(std::mem::take(&mut cur));
    }
    let mut out = BTreeMap::new();
    for l in logical {
        let mut parts = l.splitn(4, [' ', '\t']);
        let owner = parts.next().unwrap().to_string();
        let q = parts
            .next()
            .unwrap_or_else(|| panic!("bad line {l}"))
            .to_string();
        let ty = parts
            .next()
            .unwrap_or_else(|| panic!("bad line {l}"))
            .to_string();
        let val = parts.next().unwrap_or("").trim().to_string();
        assert!(
            out.insert((owner, q), (ty, val)).is_none(),
            "duplicate: {l}"
        );
    }
    out
}

fn b64_decode(s: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", "printf %s \"$1\" | base64 -d", "sh", s])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn preseed_validates_and_parses() {
    let dss = tool(
        "debconf-set-selections",
        &[PathBuf::from("/usr/bin/debconf-set-selections")],
    );
    let cat = catalog();
    for arch in Arch::ALL {
        let dir = tempfile::tempdir().unwrap();
        let c = ctx(&cat, Family::Preseed, arch);
        let ps = install::render_preseed(&c).unwrap();
        let f = write(dir.path(), &format!("preseed-{arch}.cfg"), &ps);
        let (ok, out) = run(Command::new(&dss).arg("--checkonly").arg(&f));
        assert!(
            ok && out.trim().is_empty(),
            "debconf-set-selections {arch}:\n{out}\n{ps}"
        );

        let m = parse_preseed(&ps);
        let get = |q: &str| {
            m.get(&("d-i".to_string(), q.to_string()))
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("{q} missing"))
        };
        assert_eq!(get("netcfg/get_hostname"), HOST);
        assert_eq!(get("netcfg/hostname"), HOST);
        if arch == Arch::Arm64 {
            assert_eq!(get("clock-setup/ntp"), "true");
            assert_eq!(get("clock-setup/ntp-server"), "ntp1.lab");
        } else {
            assert_eq!(get("clock-setup/ntp"), "false");
        }
        assert_eq!(get("mirror/protocol"), "http");
        assert_eq!(get("mirror/http/hostname"), "mirror.lab:8080");
        assert_eq!(get("mirror/http/directory"), "/pub/debian");
        assert_eq!(get("passwd/root-password-crypted"), HASH);
        assert_eq!(get("time/zone"), "Europe/Berlin");
        let tasks = &m[&("tasksel".to_string(), "tasksel/first".to_string())].1;
        assert_eq!(
            tasks, "standard, ssh-server",
            "no desktop task, so no GUI setup"
        );
        assert_eq!(get("pkgsel/include"), "curl pciutils");
        // Isolated network, as debconf reads it: no security/updates suites (an
        // empty multiselect), no NTP (unless the site has one), no unattended upgrades.
        assert_eq!(
            m[&("d-i".to_string(), "apt-setup/services-select".to_string())],
            ("multiselect".to_string(), String::new())
        );
        assert_eq!(get("apt-setup/non-free-firmware"), "false");
        assert_eq!(get("apt-setup/enable-source-repositories"), "false");
        assert_eq!(get("pkgsel/update-policy"), "none");
        let opts = get("debian-installer/add-kernel-opts");
        match arch {
            Arch::X86_64 => {
                assert!(opts.ends_with("console=ttyS0,115200"));
                assert_eq!(get("partman-efi/non_efi_system"), "true");
            }
            Arch::Arm64 => {
                assert!(opts.ends_with("console=ttyAMA0,115200"));
                assert_eq!(get("grub-installer/force-efi-extra-removable"), "true");
                assert!(!m.contains_key(&("d-i".into(), "partman-efi/non_efi_system".into())));
            }
        }

        let late = get("preseed/late_command");
        let (ok, out) = run(Command::new("sh").args(["-n", "-c", late]));
        assert!(ok, "late_command does not parse: {out}\n{late}");
        let cmds: Vec<&str> = late.split("; ").map(str::trim).collect();
        assert!(
            cmds.contains(&"in-target systemctl set-default multi-user.target"),
            "{cmds:#?}"
        );
        assert!(cmds.contains(&"in-target systemctl enable pxed-firstboot.service"));
        assert!(
            cmds.iter()
                .any(|l| l.contains("apt-get -y purge gnome-initial-setup"))
        );
        check_installed_call(&cmds.join("\n"), &c);

        // Each base64 payload decodes to exactly what the other configs embed.
        let payload = |dest: &str| {
            let cmd = cmds
                .iter()
                .find(|l| l.ends_with(&format!("base64 -d > {dest}'")))
                .unwrap_or_else(|| panic!("no payload for {dest}"));
            b64_decode(
                cmd.split("echo ")
                    .nth(1)
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap(),
            )
        };
        let agent = expected_agent(&c);
        let script = payload("/usr/local/sbin/pxed-firstboot");
        let unit = payload("/etc/systemd/system/pxed-firstboot.service");
        assert_eq!(script, format!("{}\n", agent.script));
        assert_eq!(unit, format!("{}\n", agent.unit));
        let keys_cmd = cmds
            .iter()
            .find(|l| l.contains("/root/.ssh/authorized_keys"))
            .unwrap();
        let keys = b64_decode(
            keys_cmd
                .split("echo ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap(),
        );
        assert_eq!(keys, format!("{KEY}\n"));
        check_agent(dir.path(), script.trim_end(), unit.trim_end());
    }
}

/// Without a password hash or keys the configs take other branches (`rootpw --lock`,
/// a locked password, no authorized_keys step): those must validate too.
#[test]
fn configs_without_credentials_validate() {
    let ksvalidator = tool("ksvalidator", &[peers_dir().join("venv/bin/ksvalidator")]);
    let cloud_init = tool("cloud-init", &[PathBuf::from("/usr/bin/cloud-init")]);
    let dss = tool(
        "debconf-set-selections",
        &[PathBuf::from("/usr/bin/debconf-set-selections")],
    );
    let cat = catalog();
    let dir = tempfile::tempdir().unwrap();
    for arch in Arch::ALL {
        for family in [Family::Kickstart, Family::Autoinstall, Family::Preseed] {
            let mut c = ctx(&cat, family, arch);
            c.ssh_authorized_keys.clear();
            c.root_password_hash = None;
            let (name, body) = install::render_for(&c).unwrap().remove(0);
            let f = write(dir.path(), &format!("bare-{name}-{arch}"), &body);
            let (ok, out) = match family {
                Family::Kickstart => {
                    assert!(body.lines().any(|l| l == "rootpw --lock"));
                    run(Command::new(&ksvalidator).args(["-v", "RHEL9"]).arg(&f))
                }
                Family::Autoinstall => run(Command::new(&cloud_init)
                    .args(["schema", "--config-file"])
                    .arg(&f)),
                Family::Preseed => {
                    assert!(!body.contains("authorized_keys"));
                    run(Command::new(&dss).arg("--checkonly").arg(&f))
                }
                Family::Disk => unreachable!("not in this list"),
            };
            assert!(ok, "{name} {arch}:\n{out}\n{body}");
        }
    }
}

#[test]
fn cmdline_has_config_url_and_console() {
    let cat = catalog();
    let cfg = "http://10.0.0.1/cfg/tok";
    for d in &cat {
        for &arch in d.arches.keys() {
            let line =
                images::kernel_cmdline(d, arch, "http://m/pub", cfg, HOST, Some("10.0.0.1:5514"))
                    .unwrap();
            let args: Vec<&str> = line.split(' ').collect();
            let want = match d.family {
                Family::Kickstart => format!("inst.ks={cfg}/kickstart"),
                Family::Autoinstall => format!("ds=nocloud;s={cfg}/"),
                Family::Preseed => format!("url={cfg}/preseed"),
                Family::Disk => "pxed.token=tok".to_string(),
            };
            if d.family == Family::Disk {
                assert!(args.contains(&"pxed.url=http://10.0.0.1"), "{line}");
            }
            assert!(args.contains(&want.as_str()), "{want} not in {line}");
            // Each installer is pointed at pxed's syslog receiver (subiquity reports
            // through the user-data's webhook; pxed's own agent through callbacks).
            let logs: &[&str] = match d.family {
                Family::Kickstart => &["inst.syslog=10.0.0.1:5514"],
                Family::Preseed => &[
                    "log_host=10.0.0.1",
                    "log_port=5514",
                    "DEBCONF_DEBUG=developer",
                ],
                Family::Autoinstall | Family::Disk => &[],
            };
            for l in logs {
                assert!(args.contains(l), "{l} not in {line}");
            }
            assert_eq!(args.last().copied(), Some(arch.serial_console()));
        }
    }
}

/// A callback server that refuses the first first-boot POST with 503, to make the
/// agent back off and retry, and records every body.
#[derive(Clone, Default)]
struct Recorder {
    calls: Arc<Mutex<Vec<(String, u16, String)>>>,
    tokens: Arc<Mutex<Vec<String>>>,
}

async fn record(
    State(r): State<Recorder>,
    AxPath((token, what)): AxPath<(String, String)>,
    body: String,
) -> StatusCode {
    r.tokens.lock().unwrap().push(token);
    let mut calls = r.calls.lock().unwrap();
    let first = !calls.iter().any(|(w, _, _)| w == &what);
    let code = if what == "first-boot" && first {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::NO_CONTENT
    };
    calls.push((what, code.as_u16(), body));
    code
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_reports_to_a_real_server() {
    tool("curl", &[]);
    tool("ip", &[]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rec = Recorder::default();
    let app = Router::new()
        .route("/cb/{token}/{what}", post(record))
        .with_state(rec.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let cat = catalog();
    let img = cat.iter().find(|d| d.family == Family::Kickstart).unwrap();
    let c = InstallContext::new(
        img,
        Arch::X86_64,
        "http://m",
        &format!("http://{addr}"),
        "tok",
        "agent-tok",
        HOST,
    )
    .unwrap();
    // The node's profile checks: one passes, one exits wrong, one is slow, one's output
    // lacks the text; quotes of both kinds survive the shell.
    let check = |name: &str, command: &str, timeout_secs, output: Option<&str>| {
        pxed::inventory::profile::HealthCheck {
            name: name.into(),
            command: command.into(),
            timeout_secs,
            exit: 0,
            output: output.map(str::to_string),
        }
    };
    let mut c = c;
    c.health_checks = vec![
        check("quoted", r#"printf '%s' "it's ok""#, 5, Some("it's ok")),
        check("exits", "exit 3", 5, None),
        check("slow", "sleep 30", 1, None),
        check("lacks", "echo present", 5, Some("absent")),
    ];
    let agent = install::firstboot_files(&c).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = write(dir.path(), "agent", &format!("{}\n", agent.script));
    check_agent(dir.path(), &agent.script, &agent.unit);
    let done = dir.path().join("state/pxed-firstboot.done");
    let mut child = tokio::process::Command::new("sh")
        .arg(&script)
        .env("PXED_FIRSTBOOT_DONE", &done)
        // The callback server is on loopback: never through a proxy.
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("all_proxy")
        .env_remove("ALL_PROXY")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let said = tokio::spawn(async move {
        let mut s = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut s)
            .await
            .unwrap();
        s
    });
    // One 2 s backoff after the 503, then two quick POSTs.
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("agent finished")
        .unwrap();
    assert!(status.success());
    // The agent reports with its own credential, never the installer's boot token,
    // and never prints it (its messages go to the console).
    assert!(
        rec.tokens.lock().unwrap().iter().all(|t| t == "agent-tok"),
        "{:?}",
        rec.tokens
    );
    let said = said.await.unwrap();
    assert!(said.contains("POST first-boot answered 503"), "{said}");
    assert!(!said.contains("agent-tok"), "{said}");
    assert!(done.exists(), "done file not written");
    server.abort();

    let calls = rec.calls.lock().unwrap().clone();
    let order: Vec<(&str, u16)> = calls.iter().map(|(w, c, _)| (w.as_str(), *c)).collect();
    assert_eq!(
        order,
        [("first-boot", 503), ("first-boot", 204), ("health", 204)]
    );
    let fb: FirstBootReport = serde_json::from_str(&calls[1].2).unwrap();
    let uname_n = run(Command::new("uname").arg("-n")).1;
    assert_eq!(fb.hostname, uname_n.trim());
    assert_eq!(fb.arch.as_deref(), Some(std::env::consts::ARCH));
    assert!(fb.facts.cpus >= 1);
    assert!(fb.facts.mem_kb > 1024);
    assert_eq!(
        fb.facts.kernel,
        run(Command::new("uname").arg("-r")).1.trim()
    );
    let h: HealthReport = serde_json::from_str(&calls[2].2).unwrap();
    // The inventory as this machine's sysfs has it: every PCI function, with IDs.
    let inv = fb.inventory.expect("inventory in the first-boot report");
    let functions = std::fs::read_dir("/sys/bus/pci/devices").map_or(0, |d| d.count());
    assert_eq!(inv.pci.len(), functions, "{:?}", inv.pci);
    assert!(
        inv.pci
            .iter()
            .all(|d| d.vendor_id != 0 && d.address.len() == 12),
        "{:?}",
        inv.pci
    );
    assert_eq!(inv.cpu.threads as u64, fb.facts.cpus);
    assert_eq!(inv.memory_mib, fb.facts.mem_kb / 1024);
    // This machine's hostname is not node-3a4b5c, so the name check must fail.
    assert_eq!(h.status, HealthStatus::Fail, "{}", h.detail);
    for want in [
        "exits: exit status 3, expected 0",
        "slow: timed out after 1 s",
        "lacks: output lacks \"absent\"",
    ] {
        assert!(h.detail.contains(want), "{want}: {}", h.detail);
    }
    assert!(!h.detail.contains("quoted"), "{}", h.detail);
    assert!(
        h.detail
            .contains(&format!("name: hostname is {}", fb.hostname)),
        "{}",
        h.detail
    );
}

/// Serves `dir` on 127.0.0.1:0 with tower-http's ServeDir.
async fn serve_dir(dir: PathBuf) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().fallback_service(tower_http::services::ServeDir::new(dir));
    let h = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/mirror/"), h)
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

#[tokio::test]
async fn import_over_http_verifies_checksums() {
    let mirror = tempfile::tempdir().unwrap();
    let root = mirror.path().join("mirror");
    let kernel: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let initrd: Vec<u8> = (0..1_000_000u32).map(|i| (i * 13 % 253) as u8).collect();
    for arch in ["x86_64", "aarch64"] {
        let d = root.join(format!("rocky/9/BaseOS/{arch}/os/images/pxeboot"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("vmlinuz"), &kernel).unwrap();
        std::fs::write(d.join("initrd.img"), &initrd).unwrap();
    }
    let (base, server) = serve_dir(mirror.path().to_path_buf()).await;
    let out = tempfile::tempdir().unwrap();

    let cat = catalog();
    let mut rocky = cat.iter().find(|d| d.name == "rocky-9").unwrap().clone();
    for a in rocky.arches.values_mut() {
        a.sha256_kernel = Some(sha256_hex(&kernel).to_uppercase());
        a.sha256_initrd = Some(sha256_hex(&initrd));
    }
    let got = images::import(&rocky, &base, out.path()).await.unwrap();
    assert_eq!(got.arches.len(), 2);
    for (arch, files) in &got.arches {
        assert_eq!(files.kernel.size, kernel.len() as u64);
        assert_eq!(files.initrd.sha256, sha256_hex(&initrd));
        let on_disk = out.path().join("rocky-9").join(arch.as_str());
        assert_eq!(std::fs::read(on_disk.join("initrd")).unwrap(), initrd);
        assert_eq!(files.kernel.path, on_disk.join("kernel"));
    }
    // Stored as JSON by the caller: it must round-trip.
    let json = serde_json::to_string(&got).unwrap();
    assert_eq!(
        serde_json::from_str::<images::ImportedImage>(&json).unwrap(),
        got
    );

    // A wrong checksum: refused, nothing partial left, the good file untouched.
    let mut bad = rocky.clone();
    bad.arches.get_mut(&Arch::X86_64).unwrap().sha256_initrd = Some("ab".repeat(32));
    let e = images::import(&bad, &base, out.path()).await;
    match e {
        Err(ImageError::ChecksumMismatch {
            expected,
            actual,
            url,
        }) => {
            assert_eq!(expected, "ab".repeat(32));
            assert_eq!(actual, sha256_hex(&initrd));
            assert!(
                url.ends_with("/x86_64/os/images/pxeboot/initrd.img"),
                "{url}"
            );
        }
        other => panic!("{other:?}"),
    }
    let x86 = out.path().join("rocky-9/x86_64");
    let names: Vec<String> = std::fs::read_dir(&x86)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with(".partial")), "{names:?}");
    assert_eq!(std::fs::read(x86.join("initrd")).unwrap(), initrd);

    // A missing file on the mirror is an HTTP error, not an empty image.
    let mut missing = rocky.clone();
    missing.arches.get_mut(&Arch::Arm64).unwrap().initrd = "rocky/9/nope.img".into();
    match images::import(&missing, &base, out.path()).await {
        Err(ImageError::Status { status, .. }) => assert_eq!(status, 404),
        other => panic!("{other:?}"),
    }
    server.abort();
}
