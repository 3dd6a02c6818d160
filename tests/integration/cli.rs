//! `pxed node ...` against the real daemon: human tables, `--json`, errors.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use crate::common::{Daemon, pxed_bin, repo, run};

fn pxed(d: &Daemon, args: &[&str], token: &str) -> (bool, String, String) {
    run(Command::new(pxed_bin())
        .current_dir(repo())
        .args(args)
        .env("PXED_URL", d.url(""))
        .env("PXED_API_TOKEN", token)
        .env("PXED_BMC_PASSWORD", "bmc-secret-pw"))
}

/// A daemon on `dir` whose API token is `tok`, with `env` added.
fn daemon_in(dir: tempfile::TempDir, env: &[(&str, &str)]) -> Daemon {
    let mut all = vec![("PXED_API_TOKEN", "tok")];
    all.extend_from_slice(env);
    Daemon::start_in(dir, &[], &all)
}

#[test]
fn node_commands_tables_and_json() {
    let d = daemon_in(tempfile::tempdir().unwrap(), &[]);
    let (ok, out, err) = pxed(
        &d,
        &[
            "node",
            "add",
            "--mac",
            "52:54:00:00:20:01",
            "--mac",
            "52:54:00:00:20:02",
            "--name",
            "rack1-u1",
            "--arch",
            "arm64",
            "--bmc-driver",
            "redfish",
            "--bmc-address",
            "https://10.0.0.9",
            "--bmc-user",
            "root",
        ],
        "tok",
    );
    assert!(ok, "{out}{err}");
    assert!(out.lines().next().unwrap().starts_with("ID"), "{out}");
    assert!(out.contains("available"), "{out}");

    let (ok, out, _) = pxed(&d, &["node", "list"], "tok");
    assert!(ok);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[1].contains("52:54:00:00:20:01,52:54:00:00:20:02"),
        "{out}"
    );
    assert!(
        lines[0].starts_with("ID  NAME") && lines[1].contains(" rack1-u1 "),
        "{out}"
    );

    let (ok, out, _) = pxed(&d, &["node", "list", "--json"], "tok");
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["name"], "rack1-u1");
    assert_eq!(v[0]["arch"], "arm64");

    let (ok, out, _) = pxed(&d, &["node", "show", "rack1-u1", "--json"], "tok");
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["bmc"]["username"], "root");
    assert_eq!(v["boot_mac"], "52:54:00:00:20:01");
    assert!(!out.contains("bmc-secret-pw"), "BMC password leaked: {out}");

    let (ok, out, _) = pxed(&d, &["node", "show", "52-54-00-00-20-02"], "tok");
    assert!(ok);
    assert!(out.contains("registered"), "{out}");
    assert!(out.contains("\nImage: none yet\n"), "{out}");
    // No server there: the reason is the connection's, not "error sending request".
    let (ok, _, err) = crate::common::run(
        Command::new(pxed_bin())
            .args(["node", "list"])
            .env("PXED_URL", "http://127.0.0.1:9")
            .env("PXED_API_TOKEN", "tok"),
    );
    assert!(
        !ok && err.contains("cannot reach http://127.0.0.1:9/api/v1/nodes")
            && err.contains("Connection refused")
            && !err.contains("error sending request"),
        "{err}"
    );
    assert!(
        out.contains("BMC: redfish https://10.0.0.9 user root"),
        "{out}"
    );

    // A node's own SSH keys from a file (comments and blank lines skipped), then cleared.
    let keys = d.dir.path().join("keys.pub");
    std::fs::write(
        &keys,
        "# rack 1 techs\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIRack1TechKey00 tech\n\n",
    )
    .unwrap();
    let (ok, out, err) = pxed(
        &d,
        &[
            "node",
            "ssh-keys",
            "rack1-u1",
            "--set",
            keys.to_str().unwrap(),
        ],
        "tok",
    );
    assert!(ok, "{out}{err}");
    assert_eq!(
        out,
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIRack1TechKey00 tech\n"
    );
    let (ok, out, _) = pxed(&d, &["node", "ssh-keys", "rack1-u1"], "tok");
    assert!(ok && out.contains("Rack1TechKey00"), "{out}");
    std::fs::write(&keys, "not a key\n").unwrap();
    let (ok, _, err) = pxed(
        &d,
        &[
            "node",
            "ssh-keys",
            "rack1-u1",
            "--set",
            keys.to_str().unwrap(),
        ],
        "tok",
    );
    assert!(!ok && err.contains("no OpenSSH key type"), "{err}");
    let (ok, out, _) = pxed(&d, &["node", "ssh-keys", "rack1-u1", "--clear"], "tok");
    assert!(ok && out.is_empty(), "{out}");

    // No image imported: a clear error, nothing changed.
    let (ok, _, err) = pxed(
        &d,
        &["node", "reinstall", "rack1-u1", "--image", "rocky-9"],
        "tok",
    );
    assert!(!ok);
    assert!(err.contains("unknown_image"), "{err}");

    let (ok, _, err) = pxed(&d, &["node", "list"], "wrong");
    assert!(!ok && err.contains("401"), "{err}");
    // The token from a file named by PXED_TOKEN_FILE (the README's export; the reclaim
    // script's variable too); with none at all, the error names both ways.
    let token_file = d.data_dir().join("cli-token");
    std::fs::write(&token_file, "tok\n").unwrap();
    let cli = |token_file: Option<&std::path::Path>| {
        let mut c = Command::new(pxed_bin());
        c.args(["node", "list"])
            .env("PXED_URL", d.url(""))
            .env_remove("PXED_API_TOKEN");
        match token_file {
            Some(f) => c.env("PXED_TOKEN_FILE", f),
            None => c.env_remove("PXED_TOKEN_FILE"),
        };
        run(&mut c)
    };
    let (ok, out, err) = cli(Some(&token_file));
    assert!(ok && out.contains("rack1-u1"), "{out}{err}");
    let (ok, _, err) = cli(None);
    assert!(!ok, "{err}");
    assert!(
        err.contains("PXED_API_TOKEN") && err.contains("PXED_TOKEN_FILE"),
        "{err}"
    );

    // Its output into a pipe whose reader has gone (`pxed node show r1 | head -1`
    // once head has its line): the command ends on SIGPIPE, as `ls` would, with no
    // panic on the terminal.
    let mut child = Command::new(pxed_bin())
        .args(["node", "show", "rack1-u1"])
        .env("PXED_URL", d.url(""))
        .env("PXED_API_TOKEN", "tok")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let gone = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&gone.stderr);
    assert_eq!(
        gone.status.signal(),
        Some(nix::sys::signal::Signal::SIGPIPE as i32),
        "{:?}: {err}",
        gone.status
    );
    assert!(!err.contains("panicked"), "{err}");

    let (ok, out, _) = pxed(&d, &["node", "rm", "rack1-u1"], "tok");
    assert!(ok, "{out}");
    let (ok, _, err) = pxed(&d, &["node", "show", "rack1-u1"], "tok");
    assert!(!ok && err.contains("404"), "{err}");
    assert!(!d.log_text().contains("bmc-secret-pw"));
    assert!(!d.log_text().contains("tok\""));
    // `delete` is `rm` by the name an operator tries first.
    let (ok, _, _) = pxed(&d, &["node", "add", "--mac", "52:54:00:00:20:09"], "tok");
    assert!(ok);
    let (ok, out, err) = pxed(&d, &["node", "delete", "52:54:00:00:20:09"], "tok");
    assert!(ok, "{out}{err}");
    // A name already taken, and an IPMI BMC given as a URL, are refused in words.
    let (ok, _, _) = pxed(
        &d,
        &["node", "add", "--mac", "52:54:00:00:20:0a", "--name", "r9"],
        "tok",
    );
    assert!(ok);
    let (ok, _, err) = pxed(
        &d,
        &["node", "add", "--mac", "52:54:00:00:20:0b", "--name", "r9"],
        "tok",
    );
    assert!(
        !ok && err.contains("409: conflict: node") && err.contains("already called `r9`"),
        "{err}"
    );
    assert!(!err.contains("UNIQUE"), "{err}");
    let ipmi_url = [
        "node",
        "add",
        "--mac",
        "52:54:00:00:20:0c",
        "--bmc-driver",
        "ipmi",
    ];
    let (ok, _, err) = pxed(
        &d,
        &[
            &ipmi_url[..],
            &["--bmc-address", "https://10.0.0.9", "--bmc-user", "root"],
        ]
        .concat(),
        "tok",
    );
    assert!(
        !ok && err.contains("400") && err.contains("an IPMI BMC is `host`"),
        "{err}"
    );
    let (ok, out, err) = pxed(&d, &["node", "rm", "r9"], "tok");
    assert!(ok, "{out}{err}");
    let (ok, out, _) = pxed(&d, &["node", "list"], "tok");
    assert!(ok && out.lines().count() == 1, "{out}");
}

#[test]
fn image_add_list_rm_with_checksums() {
    use crate::common::write_file;
    let work = tempfile::tempdir().unwrap();
    let mirror = work.path().join("mirror");
    let data = work.path().join("data");
    // Everything `image add` checks for first; the kernels get known contents below.
    crate::image_check::debian_mirror(&mirror, "trixie", &["amd64", "arm64"]);
    let p =
        "debian/dists/trixie/main/installer-amd64/current/images/netboot/debian-installer/amd64";
    write_file(&mirror, &format!("{p}/linux"), b"debian kernel");
    write_file(&mirror, &format!("{p}/initrd.gz"), b"debian initrd");
    let pa =
        "debian/dists/trixie/main/installer-arm64/current/images/netboot/debian-installer/arm64";
    write_file(&mirror, &format!("{pa}/linux"), b"arm kernel");
    write_file(&mirror, &format!("{pa}/initrd.gz"), b"arm initrd");
    let image = |args: &[&str]| {
        run(Command::new(pxed_bin())
            .current_dir(repo())
            .arg("image")
            .args(args)
            .args(["--demo", "--data-dir"])
            .arg(&data)
            .env("PXED_MIRROR_BASE", format!("file://{}/", mirror.display())))
    };
    let (ok, out, err) = image(&["add", "debian-13"]);
    assert!(ok, "{out}{err}");
    // sha256("debian kernel")
    let want = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(b"debian kernel"))
    };
    assert!(out.contains(&want), "{out}");
    let kernel = data.join("images/debian-13/x86_64/kernel");
    assert_eq!(std::fs::read(&kernel).unwrap(), b"debian kernel");
    let (ok, out, _) = image(&["list"]);
    assert!(
        ok && out.contains("debian-13") && out.contains("preseed"),
        "{out}"
    );
    let (ok, _, err) = image(&["add", "no-such-image"]);
    assert!(!ok && err.contains("no image no-such-image"), "{err}");
    let (ok, out, _) = image(&["rm", "debian-13"]);
    assert!(ok, "{out}");
    assert!(!kernel.exists());
    let (ok, out, _) = image(&["list"]);
    assert!(ok && !out.contains("debian-13"), "{out}");
    let (ok, _, err) = image(&["rm", "debian-13"]);
    assert!(!ok && err.contains("not imported"), "{err}");

    // A mirror with one architecture only: the whole entry cannot be imported, the
    // architecture on the mirror can (--arch), and a node of the other one is told.
    std::fs::remove_dir_all(mirror.join(pa)).unwrap();
    let (ok, _, err) = image(&["add", "debian-13"]);
    assert!(!ok && err.contains("arm64/linux"), "{err}");
    let (ok, out, err) = image(&["add", "debian-13", "--arch", "x86_64"]);
    assert!(ok, "{out}{err}");
    assert!(kernel.exists());
    assert!(out.contains("x86_64") && !out.contains("arm64"), "{out}");
    let (ok, _, err) = image(&["add", "debian-13", "--arch", "sparc"]);
    assert!(!ok && err.contains("sparc"), "{err}");
    let (ok, _, err) = image(&["add", "rocky-9", "--arch", "arm64"]);
    assert!(!ok && err.contains("rocky"), "{err}");
}

/// An image imported from a checked mirror is checked again before a reinstall: a
/// mirror that lost a file refuses the reinstall with the file's name, before the node
/// is touched; once the file is back the reinstall starts.
#[test]
fn a_reinstall_is_refused_while_the_mirror_lacks_a_file() {
    use crate::common::write_file;
    let dir = tempfile::tempdir().unwrap();
    let mirror = dir.path().join("mirror");
    let data = dir.path().join("data");
    crate::image_check::rocky_repo_metadata(&mirror);
    for a in ["x86_64", "aarch64"] {
        let p = format!("rocky/9/BaseOS/{a}/os/images/pxeboot");
        write_file(&mirror, &format!("{p}/vmlinuz"), b"kernel");
        write_file(&mirror, &format!("{p}/initrd.img"), b"initrd");
    }
    let base = format!("file://{}/", mirror.display());
    let (ok, out, err) = run(crate::common::pxed_on(dir.path())
        .current_dir(repo())
        .args(["image", "add", "rocky-9", "--demo", "--data-dir"])
        .arg(&data)
        .env("PXED_MIRROR_BASE", &base));
    assert!(ok, "{out}{err}");
    let d = daemon_in(
        dir,
        &[
            ("PXED_MIRROR_BASE", &base),
            ("PXED_DEFAULT_IMAGE", "rocky-9"),
        ],
    );
    let (ok, out, err) = pxed(
        &d,
        &[
            "node",
            "add",
            "--mac",
            "52:54:00:00:21:01",
            "--name",
            "m1",
            "--arch",
            "x86_64",
        ],
        "tok",
    );
    assert!(ok, "{out}{err}");
    let treeinfo = mirror.join("rocky/9/BaseOS/x86_64/os/.treeinfo");
    let keep = std::fs::read(&treeinfo).unwrap();
    std::fs::remove_file(&treeinfo).unwrap();
    let (ok, _, err) = pxed(
        &d,
        &["node", "reinstall", "m1", "--image", "rocky-9"],
        "tok",
    );
    assert!(!ok, "{err}");
    assert!(
        err.contains("mirror_incomplete") && err.contains("x86_64/os/.treeinfo"),
        "{err}"
    );
    // Only the node's architecture counts: the arm64 tree is not named.
    assert!(!err.contains("aarch64"), "{err}");
    // Without --image the reinstall installs `default_image`: that one is checked.
    let (ok, _, err) = pxed(&d, &["node", "reinstall", "m1"], "tok");
    assert!(!ok && err.contains("x86_64/os/.treeinfo"), "{err}");
    let (ok, out, _) = pxed(&d, &["node", "show", "m1", "--json"], "tok");
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "available", "{out}");
    assert_eq!(v["generation"], 0, "{out}");
    std::fs::write(&treeinfo, keep).unwrap();
    let (ok, out, err) = pxed(
        &d,
        &["node", "reinstall", "m1", "--image", "rocky-9"],
        "tok",
    );
    assert!(ok, "{out}{err}");
    let (_, metrics, _) = run(Command::new("curl").args(["-sf", &d.url("/metrics")]));
    assert!(
        metrics.contains("pxed_reinstalls_refused_mirror_total 2\n"),
        "{metrics}"
    );
}

/// The README tells operators to export `PXED_URL`, `PXED_API_TOKEN` and
/// `PXED_BMC_PASSWORD` for the CLI; with all of them in the environment the server
/// still starts and `check-config` still works (once they made both refuse to start).
/// The operator's commands from one shell: labels, the lifecycle actions (a reason
/// required where technicians will read one) and a power cycle through a real Redfish
/// BMC (sushy-tools), each refused with the server's reason where it does not apply.
#[test]
fn operator_actions_labels_and_power_cycle() {
    use crate::bmc::{NODE1, PASSWORD, Sushy};
    crate::common::need("curl");
    let sushy = Sushy::start();
    let d = daemon_in(tempfile::tempdir().unwrap(), &[("PXED_BMC__RETRIES", "0")]);
    let (ok, out, err) = run(Command::new(pxed_bin())
        .current_dir(repo())
        .args([
            "node",
            "add",
            "--mac",
            "52:54:00:00:40:01",
            "--name",
            "r2u1",
        ])
        .args(["--bmc-driver", "redfish", "--bmc-address", &sushy.url()])
        .args(["--bmc-user", "admin", "--bmc-system-id", NODE1])
        .args(["--bmc-password-env", "SUSHY_PW"])
        .env("PXED_URL", d.url(""))
        .env("PXED_API_TOKEN", "tok")
        .env("SUSHY_PW", PASSWORD));
    assert!(ok, "{out}{err}");
    let (ok, out, err) = pxed(&d, &["node", "add", "--mac", "52:54:00:00:40:02"], "tok");
    assert!(ok, "{out}{err}");

    // Labels: set (all replace), read back, the board's filter sees them, cleared.
    let labels = [
        "node", "labels", "r2u1", "--set", "rack=r2", "--set", "row=b",
    ];
    let (ok, out, err) = pxed(&d, &labels, "tok");
    assert!(ok, "{err}");
    assert_eq!(out, "rack=r2\nrow=b\n");
    let (ok, out, _) = pxed(&d, &["node", "labels", "r2u1", "--set", "rack=r3"], "tok");
    assert!(ok && out == "rack=r3\n", "{out}");
    let (ok, out, _) = pxed(&d, &["node", "labels", "r2u1", "--json"], "tok");
    assert!(ok);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap(),
        serde_json::json!({"rack": "r3"})
    );
    // `node list` filters as the board does, in the server.
    let listed = |args: &[&str]| {
        let mut all = vec!["node", "list", "--json"];
        all.extend_from_slice(args);
        let (ok, out, err) = pxed(&d, &all, "tok");
        assert!(ok, "{err}");
        let v: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        v.iter()
            .map(|n| n["macs"][0].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(listed(&["--label", "rack=r3"]), ["52:54:00:00:40:01"]);
    assert_eq!(listed(&["-q", "40:02"]), ["52:54:00:00:40:02"]);
    assert_eq!(listed(&["--label", "rack=r3", "-q", "40:02"]).len(), 0);
    let (ok, _, err) = pxed(&d, &["node", "labels", "r2u1", "--set", "rack"], "tok");
    assert!(!ok && err.contains("expected KEY=VALUE"), "{err}");
    let (ok, out, _) = pxed(&d, &["node", "labels", "r2u1", "--clear"], "tok");
    assert!(ok && out.is_empty(), "{out}");

    // Quarantine needs a reason; with one, `node wait` and `node show` say it.
    let (ok, _, err) = pxed(&d, &["node", "quarantine", "r2u1"], "tok");
    assert!(!ok && err.contains("--reason"), "{err}");
    let q = ["node", "quarantine", "r2u1", "--reason", "DIMM B2 errors"];
    let (ok, out, err) = pxed(&d, &q, "tok");
    assert!(ok, "{err}");
    assert!(
        out.contains("quarantined") && out.contains("DIMM B2 errors"),
        "{out}"
    );
    let (ok, _, err) = pxed(&d, &["node", "wait", "r2u1", "--timeout", "5s"], "tok");
    assert!(
        !ok && err.contains("quarantined") && err.contains("DIMM B2"),
        "{err}"
    );
    assert_eq!(listed(&["--state", "quarantined"]), ["52:54:00:00:40:01"]);
    assert_eq!(listed(&["--state", "available"]), ["52:54:00:00:40:02"]);
    // An action the state does not allow: the server's reason, nothing changed.
    let (ok, _, err) = pxed(&d, &["node", "fail", "r2u1", "--reason", "x"], "tok");
    assert!(
        !ok && err.contains(
            "409: invalid_state: cannot fail a quarantined node (a quarantined node can: restore)"
        ),
        "{err}"
    );
    for (action, state) in [
        ("restore", "available"),
        ("allocate", "allocated"),
        ("release", "available"),
    ] {
        let (ok, out, err) = pxed(&d, &["node", action, "r2u1", "--json"], "tok");
        assert!(ok, "{action}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["state"], state, "{action}: {v}");
    }
    let (ok, _, err) = pxed(&d, &["node", "enroll", "r2u1"], "tok");
    assert!(
        !ok && err.contains(
            "cannot enroll an available node (an available node can: allocate, reinstall, quarantine, fail)"
        ),
        "{err}"
    );

    // A power cycle through the BMC: NODE1 was Off and is On; the audit log says who.
    let power = |want: &str| {
        let url = format!("{}/redfish/v1/Systems/{NODE1}", sushy.url());
        let (ok, out, _) =
            run(Command::new("curl").args(["-sf", "-u", &format!("admin:{PASSWORD}"), &url]));
        assert!(ok);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["PowerState"], want, "{v}");
    };
    power("Off");
    let (ok, out, err) = pxed(&d, &["bmc", "power-cycle", "r2u1"], "tok");
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("power-cycled") && out.contains("available"),
        "{out}"
    );
    power("On");
    let (ok, out, _) = pxed(&d, &["node", "show", "r2u1", "--json"], "tok");
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let last = v["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["event"], "operator_power_cycle", "{v}");
    assert_eq!(last["detail"], "power cycle sent by an operator", "{v}");
    let (ok, _, err) = pxed(&d, &["bmc", "power-cycle", "52:54:00:00:40:02"], "tok");
    assert!(!ok && err.contains("422: no_bmc"), "{err}");
    assert!(!format!("{err}{}", d.log_text()).contains(PASSWORD));
}

#[test]
fn client_variables_never_stop_the_server() {
    let env = [
        ("PXED_API_TOKEN", "tok"),
        ("PXED_URL", "http://127.0.0.1:1"),
        ("PXED_BMC_PASSWORD", "bmc-secret-pw"),
        ("PXED_TOKEN_FILE", "/etc/pxed/api-token"),
        ("PXED_SOMETHING_A_WRAPPER_SETS", "1"),
    ];
    let d = Daemon::start_in(tempfile::tempdir().unwrap(), &[], &env);
    let (ok, out, err) = pxed(&d, &["node", "list"], "tok");
    assert!(ok, "{out}{err}");
    let mut cmd = Command::new(pxed_bin());
    cmd.current_dir(repo()).args(["check-config", "--demo"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (ok, out, err) = run(&mut cmd);
    assert!(ok, "{out}{err}");
    assert!(!out.contains("bmc-secret-pw") && !err.contains("bmc-secret-pw"));
    // A variable pxed does not know is named (it may be a typo); the CLI's own, which
    // the README has operators export, are not news.
    assert!(err.contains("PXED_SOMETHING_A_WRAPPER_SETS"), "{err}");
    assert!(
        !err.contains("PXED_BMC_PASSWORD")
            && !err.contains("PXED_URL")
            && !err.contains("PXED_TOKEN_FILE"),
        "{err}"
    );
    // A section given as a value is refused with the key it should have been.
    let (ok, _, err) = run(Command::new(pxed_bin())
        .current_dir(repo())
        .args(["check-config", "--demo"])
        .env("PXED_DHCP", "full"));
    assert!(!ok);
    assert!(err.contains("PXED_DHCP__MODE"), "{err}");
}

/// `pxed bmc check <node>` failures are the server's JSON reasons: an unknown node, a
/// node without a BMC, a BMC nothing answers at (with its typed kind), a wrong token.
#[test]
fn bmc_check_errors_are_the_servers_reasons() {
    let d = daemon_in(tempfile::tempdir().unwrap(), &[("PXED_BMC__RETRIES", "0")]);
    let silent = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let bmc = format!("http://{silent}");
    for args in [
        vec![
            "node",
            "add",
            "--mac",
            "52:54:00:00:30:01",
            "--name",
            "bare",
        ],
        vec![
            "node",
            "add",
            "--mac",
            "52:54:00:00:30:02",
            "--name",
            "gone",
            "--bmc-driver",
            "redfish",
            "--bmc-address",
            &bmc,
            "--bmc-user",
            "root",
        ],
    ] {
        let (ok, out, err) = pxed(&d, &args, "tok");
        assert!(ok, "{out}{err}");
    }
    let (ok, _, err) = pxed(&d, &["bmc", "check", "nope"], "tok");
    assert!(
        !ok && err.contains("404: not_found: node nope not found"),
        "{err}"
    );
    let (ok, _, err) = pxed(&d, &["bmc", "check", "bare"], "tok");
    assert!(!ok && err.contains("422: no_bmc: node "), "{err}");
    assert!(err.contains("has no BMC"), "{err}");
    let (ok, _, err) = pxed(&d, &["bmc", "check", "gone"], "tok");
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!("502: unreachable: redfish BMC {bmc} unreachable")),
        "{err}"
    );
    let (ok, _, err) = pxed(&d, &["bmc", "check", "gone"], "wrong");
    assert!(!ok && err.contains("401"), "{err}");
    assert!(!format!("{err}{}", d.log_text()).contains("bmc-secret-pw"));
}

/// `pxed export` while the daemon serves, `pxed import` into a new data dir (refused
/// without the old key, then re-sealed with it), and a daemon on the new dir that has
/// the nodes, their audit log and a BMC password that still opens.
#[test]
fn export_while_serving_and_import_into_a_new_data_dir() {
    let d = daemon_in(tempfile::tempdir().unwrap(), &[]);
    // A port nothing listens on: a BMC check gets "unreachable" only after its
    // password opened.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let bmc = format!("http://{gone}");
    for (mac, name) in [
        ("52:54:00:00:30:01", "r2-u1"),
        ("52:54:00:00:30:02", "r2-u2"),
    ] {
        let (ok, out, err) = pxed(
            &d,
            &[
                "node",
                "add",
                "--mac",
                mac,
                "--name",
                name,
                "--bmc-driver",
                "redfish",
                "--bmc-address",
                &bmc,
                "--bmc-user",
                "root",
            ],
            "tok",
        );
        assert!(ok, "{out}{err}");
    }
    let old = d.data_dir();
    let new = tempfile::tempdir().unwrap();
    let file = new.path().join("pxed.json");
    // Each command on the store of the deployment it names (on PostgreSQL when the
    // suite runs there: each deployment its own database).
    let (old_dir, new_dir) = (d.dir.path().to_owned(), new.path().to_owned());
    let cli = |args: &[&str]| {
        let on = if args.contains(&"export") {
            &old_dir
        } else {
            &new_dir
        };
        run(crate::common::pxed_on(on)
            .current_dir(repo())
            .args(args)
            .env_remove("PXED_API_TOKEN"))
    };
    let (ok, _, err) = cli(&[
        "export",
        "--data-dir",
        old.to_str().unwrap(),
        "-o",
        file.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("2 nodes"), "{err}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(!text.contains("bmc-secret-pw"), "a BMC password in clear");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    let target = new.path().join("data");
    let (t, f) = (target.to_str().unwrap(), file.to_str().unwrap());
    let (ok, _, err) = cli(&["import", "--data-dir", t, f]);
    assert!(!ok && err.contains("--secret-key"), "{err}");
    let key = old.join("secret-key");
    let (ok, _, err) = cli(&[
        "import",
        "--data-dir",
        t,
        "--secret-key",
        key.to_str().unwrap(),
        f,
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("2 BMC passwords sealed"), "{err}");
    let (ok, _, err) = cli(&[
        "import",
        "--data-dir",
        t,
        "--secret-key",
        key.to_str().unwrap(),
        f,
    ]);
    assert!(!ok && err.contains("import needs an empty store"), "{err}");

    // A second daemon on the imported dir (the first keeps serving the old one).
    let e = daemon_in(new, &[("PXED_BMC__RETRIES", "0")]);
    let (ok, out, _) = pxed(&e, &["node", "show", "r2-u2", "--json"], "tok");
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["bmc"]["username"], "root");
    assert_eq!(v["events"][0]["event"], "registered");
    // The password opens under the new key: the check gets as far as the network.
    let (ok, _, err) = pxed(&e, &["bmc", "check", "r2-u2"], "tok");
    assert!(!ok && err.contains("502: unreachable"), "{err}");
}

/// Waits for each child: whether it succeeded, and its stdout and stderr.
fn finished(children: Vec<std::process::Child>) -> Vec<(bool, String)> {
    children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            (o.status.success(), text)
        })
        .collect()
}

/// `pxed migrate` run by several processes at once on a new data dir (instances
/// starting together, a migrate beside a start): each one exits 0 with the same
/// schema version, and a daemon then serves from the result.
#[test]
fn migrate_from_several_processes_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let children: Vec<_> = (0..4)
        .map(|_| {
            Command::new(pxed_bin())
                .args(["migrate", "--data-dir"])
                .arg(&data)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<String> = finished(children)
        .into_iter()
        .map(|(ok, text)| {
            assert!(ok, "pxed migrate failed: {text}");
            text
        })
        .collect();
    assert!(outs[0].starts_with("schema version "), "{}", outs[0]);
    assert!(outs.iter().all(|o| *o == outs[0]), "{outs:?}");
    let d = daemon_in(dir, &[]);
    let (ok, out, err) = pxed(&d, &["node", "list"], "tok");
    assert!(ok, "{out}{err}");
}

/// `pxed migrate --database postgres://…` from several processes at once against one
/// new PostgreSQL database (a private cluster): each exits 0 with the same schema
/// version and names the server as primary; the password is never printed; a serving
/// SQLite deployment is exported, imported there and exported again unchanged; and a
/// daemon then serves that node from PostgreSQL (its BMC password opening under the
/// shared key), saying so in `/healthz`.
#[test]
fn migrate_a_postgresql_database_from_several_processes_at_once() {
    let cluster = store_pg::cluster::Cluster::start().unwrap();
    cluster.create_database("pxed").unwrap();
    cluster
        .psql(
            "postgres",
            "CREATE ROLE pxed LOGIN PASSWORD 'hunter2'; ALTER DATABASE pxed OWNER TO pxed",
        )
        .unwrap();
    let url = format!(
        "postgres://pxed:hunter2@localhost/pxed?host={}",
        cluster.socket_dir().display()
    );
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(pxed_bin())
            .args(args)
            .arg("--data-dir")
            .arg(dir.path())
            .env("PXED_DATABASE_URL", &url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let outs = finished((0..4).map(|_| run(&["migrate"])).collect());
    let migrations = std::fs::read_dir("store-pg/migrations").unwrap().count();
    for (ok, text) in &outs {
        assert!(ok, "pxed migrate failed: {text}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(
            text.starts_with(&format!("schema version {migrations} (postgresql ")),
            "{text}"
        );
        assert!(
            text.trim_end().ends_with(&format!(
                "postgres://pxed@localhost:5432/pxed?host={}, primary, schema version {migrations})",
                cluster.socket_dir().display()
            )),
            "{text}"
        );
    }
    assert!(
        cluster
            .psql(
                "pxed",
                "SELECT count(*) FROM _sqlx_migrations WHERE success"
            )
            .unwrap()
            == migrations.to_string()
    );
    // The SQLite data dir was not touched by any of it.
    assert!(!dir.path().join("pxed.sqlite").exists());

    // A serving SQLite deployment moves to that database: export, import (refused
    // without the old key, then re-sealed under the data dir's key), export again.
    let d = daemon_in(tempfile::tempdir().unwrap(), &[("TEST_DATABASE", "sqlite")]);
    let (ok, out, err) = pxed(
        &d,
        &[
            "node",
            "add",
            "--mac",
            "52:54:00:00:31:01",
            "--name",
            "pg-u1",
            "--bmc-driver",
            "redfish",
            "--bmc-address",
            "http://127.0.0.1:9",
            "--bmc-user",
            "root",
        ],
        "tok",
    );
    assert!(ok, "{out}{err}");
    let sqlite_json = dir.path().join("sqlite.json");
    let pg_json = dir.path().join("pg.json");
    let cli = |args: &[&str], pg: bool| {
        let mut c = Command::new(pxed_bin());
        c.args(args).env_remove("PXED_API_TOKEN");
        if pg {
            c.env("PXED_DATABASE_URL", &url)
                .arg("--data-dir")
                .arg(dir.path());
        }
        crate::common::run(&mut c)
    };
    let data_dir = d.data_dir();
    let (ok, _, err) = cli(
        &[
            "export",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "-o",
            sqlite_json.to_str().unwrap(),
        ],
        false,
    );
    assert!(ok, "{err}");
    let f = sqlite_json.to_str().unwrap();
    let (ok, _, err) = cli(&["import", f], true);
    assert!(!ok && err.contains("--secret-key"), "{err}");
    let key = data_dir.join("secret-key");
    let (ok, _, err) = cli(&["import", "--secret-key", key.to_str().unwrap(), f], true);
    assert!(ok, "{err}");
    assert!(err.contains("1 BMC passwords sealed"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    let (ok, _, err) = cli(&["export", "-o", pg_json.to_str().unwrap()], true);
    assert!(ok, "{err}");
    let read = |p: &std::path::Path| {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        v["exported_at"] = serde_json::Value::Null;
        v["tables"].as_object_mut().unwrap().remove("bmc_secrets");
        v
    };
    assert_eq!(read(&pg_json), read(&sqlite_json));
    assert_eq!(
        cluster.psql("pxed", "SELECT name FROM nodes").unwrap(),
        "pg-u1"
    );

    // Served from PostgreSQL: a daemon whose data dir holds the key the import sealed
    // with (every instance on one database shares it).
    let served = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(served.path().join("data")).unwrap();
    std::fs::copy(
        dir.path().join("secret-key"),
        served.path().join("data/secret-key"),
    )
    .unwrap();
    let e = daemon_in(
        served,
        &[("PXED_DATABASE_URL", &url), ("PXED_BMC__RETRIES", "0")],
    );
    let (ok, out, err) = pxed(&e, &["node", "show", "pg-u1", "--json"], "tok");
    assert!(ok, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["bmc"]["username"], "root");
    assert_eq!(v["events"][0]["event"], "registered");
    let (ok, _, err) = pxed(&e, &["bmc", "check", "pg-u1"], "tok");
    assert!(!ok && err.contains("502: unreachable"), "{err}");
    let (ok, body, _) = crate::common::run(Command::new("curl").args(["-s", &e.url("/healthz")]));
    assert!(ok && body.starts_with("ok\nstore: writable\n"), "{body}");
    assert!(
        body.contains("database: postgresql 15.")
            && body.contains(&format!(
                "postgres://pxed@localhost:5432/pxed?host={}, primary, schema version {migrations}",
                cluster.socket_dir().display()
            )),
        "{body}"
    );
    assert!(!body.contains("hunter2") && !e.log_text().contains("hunter2"));
    // A second daemon on that database serves beside the first: one inventory, and
    // each sees what the other changed.
    let second = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(second.path().join("data")).unwrap();
    std::fs::copy(
        dir.path().join("secret-key"),
        second.path().join("data/secret-key"),
    )
    .unwrap();
    let f = daemon_in(second, &[("PXED_DATABASE_URL", &url)]);
    let (ok, out, err) = pxed(&f, &["node", "show", "pg-u1", "--json"], "tok");
    assert!(ok, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["bmc"]["username"], "root");
    let (ok, out, err) = pxed(
        &f,
        &[
            "node",
            "add",
            "--mac",
            "52:54:00:00:31:02",
            "--name",
            "pg-u2",
        ],
        "tok",
    );
    assert!(ok, "{out}{err}");
    let (ok, out, err) = pxed(&e, &["node", "show", "pg-u2", "--json"], "tok");
    assert!(ok, "{out}{err}");
    assert!(!f.log_text().contains("hunter2"));
}
