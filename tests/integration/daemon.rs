//! The real binary: HTTP boot paths, config errors, signals, systemd unit.

use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::common::{Daemon, need, poll_blocking, pxed_bin, repo, run};

fn curl(args: &[&str]) -> (bool, String, String) {
    need("curl");
    run(Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args))
}

#[test]
fn healthz_and_boot_script() {
    let d = Daemon::start(&[]);
    let (ok, body, _) = curl(&[&d.url("/healthz")]);
    assert!(ok && body.starts_with("ok\nstore: writable\n"), "{body}");
    let db = body
        .lines()
        .find(|l| l.starts_with("database: "))
        .unwrap_or("");
    if crate::common::test_database(d.dir.path()).is_some() {
        assert!(
            db.starts_with("database: postgresql ") && db.contains(", primary, "),
            "{body}"
        );
    } else {
        assert!(
            db.starts_with("database: sqlite /") && db.contains("pxed.sqlite, primary"),
            "{body}"
        );
    }
    let schema: i64 = db.rsplit(' ').next().unwrap().parse().unwrap();
    let migrations = std::fs::read_dir(crate::common::repo().join("migrations"))
        .unwrap()
        .count();
    assert_eq!(schema, i64::try_from(migrations).unwrap(), "{body}");
    let (ok, body, _) = curl(&["-f", &d.url("/readyz")]);
    assert!(ok && body == "ready\n", "{body}");
    let (ok, body, _) = curl(&["-f", &d.url("/boot/52:54:00:12:34:56.ipxe")]);
    assert!(ok, "script fetch failed");
    assert!(body.starts_with("#!ipxe\n"), "{body}");
    assert!(body.contains("52:54:00:12:34:56"), "{body}");
    // BIOS iPXE 1.0 URL-encodes ':' in ${mac}.
    let (ok, body, _) = curl(&["-f", &d.url("/boot/52%3A54%3A00%3A12%3A34%3A56.ipxe")]);
    assert!(ok && body.contains("52:54:00:12:34:56"), "{body}");
    let (_, code, _) = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &d.url("/boot/zz.ipxe"),
    ]);
    assert_eq!(code, "404");
}

#[test]
fn ipxe_binaries_with_range_and_etag() {
    let d = Daemon::start(&[]);
    let file = repo().join("ipxe/bin/snponly.efi");
    let bytes = std::fs::read(&file).expect("ipxe/bin/snponly.efi: run ipxe/fetch.sh");
    let dl = d.dir.path().join("part");
    let (ok, out, err) = curl(&[
        "-D",
        "-",
        "-r",
        "100-1123",
        "-o",
        dl.to_str().unwrap(),
        &d.url("/ipxe/snponly.efi"),
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("HTTP/1.1 206"), "{out}");
    assert_eq!(std::fs::read(&dl).unwrap(), &bytes[100..1124]);
    let etag = out
        .lines()
        .find_map(|l| {
            l.strip_prefix("etag: ")
                .or_else(|| l.strip_prefix("ETag: "))
        })
        .map(|s| s.trim().to_string())
        .expect("ETag header");
    let (_, code, _) = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-H",
        &format!("If-None-Match: {etag}"),
        &d.url("/ipxe/snponly.efi"),
    ]);
    assert_eq!(code, "304");
    let (ok, _, _) = curl(&[
        "-f",
        "-o",
        dl.to_str().unwrap(),
        &d.url("/ipxe/snponly.efi"),
    ]);
    assert!(ok);
    assert_eq!(std::fs::read(&dl).unwrap(), bytes);
}

#[test]
fn sigterm_and_sigint_exit_within_two_seconds() {
    for sig in [Signal::SIGTERM, Signal::SIGINT] {
        let mut d = Daemon::start(&[]);
        // An open keep-alive connection must not hold shutdown up.
        let _conn = std::net::TcpStream::connect(&d.http).unwrap();
        let (st, took) = d.stop_with(sig);
        assert!(st.success(), "{sig}: exit {st}\n{}", d.log_text());
        assert!(took < Duration::from_secs(2), "{sig}: took {took:?}");
    }
}

#[test]
fn check_config_masks_secrets_and_reports_errors() {
    let (ok, out, err) = run(Command::new(pxed_bin())
        .args(["check-config", "--demo"])
        .env("PXED_API_TOKEN", "very-secret-token")
        .env_remove("PXED_CONFIG"));
    assert!(ok, "{err}");
    assert!(out.contains("api_token = \"********\""), "{out}");
    assert!(!out.contains("very-secret-token"));

    let (ok, _, err) = run(Command::new(pxed_bin()).args([
        "check-config",
        "--dhcp",
        "full",
        "--pool",
        "10.0.0.10-10.0.0.20",
    ]));
    assert!(!ok && err.contains("no --interface"), "{err}");
    // Valid, but the pool is never served: said on stderr, the config still printed.
    let (ok, out, err) = run(Command::new(pxed_bin()).args([
        "check-config",
        "--dhcp",
        "proxy",
        "--interface",
        "lo",
        "--pool",
        "10.0.0.10-10.0.0.20",
    ]));
    assert!(ok && out.contains("mode = \"proxy\""), "{out}{err}");
    assert!(
        err.contains("warning: dhcp.pool (10.0.0.10-10.0.0.20) is not used: proxy mode"),
        "{err}"
    );

    let (ok, _, err) = run(Command::new(pxed_bin())
        .args(["check-config"])
        .env("PXED_DHCPP__MODE", "full"));
    assert!(!ok && err.contains("dhcpp"), "{err}");
}

/// Issue 10, finding 7: hostile numbers from the environment, a flag or the file are
/// refused with the key and its range and exit 2 (config error); they once panicked
/// (lease time) or passed `check-config` and panicked at `serve` (max_transfers).
#[test]
fn check_config_refuses_out_of_range_values_without_panic() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pxed.toml");
    std::fs::write(
        &file,
        "[tftp_server]\nmax_transfers = 4611686018427387904\n",
    )
    .unwrap();
    let huge = "99999999999999999999d";
    let lease = "dhcp.lease_time: must be between 1m and 365d (got 99999999999999999999d)";
    let check = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(pxed_bin());
        c.args(["check-config", "--demo"])
            .args(args)
            .env_remove("PXED_CONFIG")
            .envs(env.iter().copied());
        c
    };
    let cases = [
        (check(&[], &[("PXED_DHCP__LEASE_TIME", huge)]), lease),
        (check(&["--lease-time", huge], &[]), lease),
        (
            check(&["--config", file.to_str().unwrap()], &[]),
            "tftp_server.max_transfers: must be between 1 and 65536 (got 4611686018427387904)",
        ),
        (
            check(&[], &[("PXED_TFTP_SERVER__TIMEOUT", "0s")]),
            "tftp_server.timeout: must be between 100ms and 255s (got 0s)",
        ),
    ];
    for (mut cmd, want) in cases {
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {err}");
        assert_eq!(err.trim(), format!("error: {want}"), "{cmd:?}");
    }
}

#[test]
fn startup_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = listener.local_addr().unwrap().to_string();
    let dhcp = |iface: &'static str| {
        vec![
            "--dhcp",
            "full",
            "--interface",
            iface,
            "--pool",
            "10.0.0.10-10.0.0.20",
        ]
    };
    let cases: [(Vec<&str>, &str); 3] = [
        (dhcp("nope0"), "nope0 does not exist"),
        (
            [dhcp("lo"), vec!["--netmask", "255.255.255.0"]].concat(),
            "outside the subnet of lo",
        ),
        (vec!["--http", &busy], "already in use"),
    ];
    for (flags, want) in cases {
        let (ok, _, err) = run(Command::new(pxed_bin())
            .current_dir(repo())
            .args(["serve", "--demo", "--data-dir", data])
            .args(&flags));
        assert!(!ok && err.contains(want), "{flags:?}: {err}");
    }
    // A data dir that is a file; the reason is printed once, not once per layer.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let (ok, _, err) = run(Command::new(pxed_bin())
        .current_dir(repo())
        .args(["serve", "--demo", "--data-dir"])
        .arg(&file));
    assert!(!ok, "{err}");
    let want = format!("data dir {}: Not a directory", file.display());
    assert!(err.contains(&want), "{err}");
    assert_eq!(err.matches("Not a directory").count(), 1, "{err}");
}

#[test]
fn systemd_unit_verifies() {
    need("systemd-analyze");
    let dir = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(repo().join("systemd/pxed.service")).unwrap();
    assert!(unit.contains("CapabilityBoundingSet=CAP_NET_BIND_SERVICE CAP_NET_RAW"));
    assert!(unit.contains("ProtectSystem=strict"));
    assert!(unit.contains("StateDirectory=pxed"));
    // `[pacing] transfer_nice`: @resources is denied but for setpriority, after it.
    let filters: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("SystemCallFilter="))
        .collect();
    assert_eq!(
        filters,
        ["@system-service", "~@privileged @resources", "setpriority"]
    );
    // verify checks that ExecStart exists: point it at the binary under test.
    let p = dir.path().join("pxed.service");
    std::fs::write(&p, unit.replace("/usr/bin/pxed", pxed_bin())).unwrap();
    let (ok, out, err) = run(Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&p));
    assert!(
        ok && err.trim().is_empty(),
        "systemd-analyze verify: {out}{err}"
    );
    // The sandbox: systemd's own exposure score stays at or under 2.0 (of 10).
    let (_, out, err) = run(Command::new("systemd-analyze")
        .args(["security", "--offline=true"])
        .arg(&p));
    let score: f64 = out
        .lines()
        .find_map(|l| l.split("Overall exposure level for pxed.service: ").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no exposure score in {out}{err}"));
    assert!(score <= 2.0, "exposure {score}: {out}");
    assert!(unit.contains("LimitNOFILE=65536"));
}

/// An open status page (`/events`, a stream that never ends by itself) must not hold
/// SIGTERM up for the drain deadline.
#[test]
fn sigterm_with_an_open_event_stream_exits_within_two_seconds() {
    use std::io::{Read, Write};
    let mut d = Daemon::start(&[]);
    let mut conn = std::net::TcpStream::connect(&d.http).unwrap();
    conn.write_all(b"GET /events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = [0u8; 512];
    let n = conn.read(&mut head).unwrap();
    assert!(
        String::from_utf8_lossy(&head[..n]).contains("text/event-stream"),
        "{}",
        String::from_utf8_lossy(&head[..n])
    );
    let (st, took) = d.stop_with(Signal::SIGTERM);
    assert!(st.success(), "exit {st}\n{}", d.log_text());
    assert!(took < Duration::from_secs(2), "took {took:?}");
    // And the stream was ended, not cut: the server closed it.
    let mut rest = Vec::new();
    let _ = conn.read_to_end(&mut rest);
}

/// Idle connections cannot take HTTP down: under a service manager's 1,024 open files,
/// 1,500 connections that never finish their request head fill the ordinary slots
/// and the reserve, the rest are closed at once, health is answered again within a
/// second or two from the reserve (1 s header timeout there), and every idle
/// connection is closed by the 10 s header-read timeout. (Before: all were held
/// forever and, at the descriptor limit, `/healthz` stopped answering.)
#[test]
fn an_idle_connection_flood_leaves_health_answering() {
    use std::io::Write;
    use std::time::Instant;
    let (soft, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    if soft < 4096 {
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
            .unwrap();
    }
    let d = Daemon::start_limited(tempfile::tempdir().unwrap(), &[], &[], Some(1024));
    let addr: std::net::SocketAddr = d.http.parse().unwrap();
    let mut flood = Vec::new();
    for _ in 0..1500 {
        let Ok(mut s) = std::net::TcpStream::connect(addr) else {
            break;
        };
        let _ = s.write_all(b"GET /ipxe/ HTTP/1.1\r\nHost: x\r\n");
        flood.push(s);
    }
    assert!(flood.len() >= 1200, "opened {}", flood.len());
    let started = Instant::now();
    let answered = poll_blocking(Duration::from_secs(5), || {
        let (ok, body, _) = curl(&["-s", "--max-time", "1", &d.url("/healthz")]);
        (ok && body.starts_with("ok\n")).then_some(())
    });
    assert!(answered.is_some(), "health never answered under the flood");
    let waited = started.elapsed();
    eprintln!(
        "health answered {waited:?} into a flood of {} idle connections",
        flood.len()
    );
    assert!(
        waited < Duration::from_secs(4),
        "health answered after {waited:?}"
    );
    let metric = |name: &str| -> Option<f64> {
        let (_, m, _) = curl(&["-s", "--max-time", "2", &d.url("/metrics")]);
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse().ok())
    };
    let refused = poll_blocking(Duration::from_secs(3), || {
        metric("pxed_http_connections_refused_total")
    })
    .unwrap_or(0.0);
    assert!(refused > 0.0, "no connection was refused");
    // The header-read timeout closes the idle ones (the flood is still open here).
    let drained = poll_blocking(Duration::from_secs(15), || {
        metric("pxed_http_connections").filter(|&open| open <= 2.0)
    });
    assert!(
        drained.is_some(),
        "idle connections were not closed: {:?}",
        metric("pxed_http_connections")
    );
    drop(flood);
}

/// SIGHUP (the unit's `ExecReload`) re-reads the configuration: the lifecycle policy
/// and the power-on waves change live, other changes are named as needing a restart, an invalid file is
/// reported and the running configuration kept, and the daemon never dies of it.
#[test]
fn sighup_rereads_the_configuration() {
    let conf_dir = tempfile::tempdir().unwrap();
    let conf = conf_dir.path().join("pxed.toml");
    std::fs::write(&conf, "[lifecycle]\nmax_attempts = 2\n").unwrap();
    let d = Daemon::start(&["--config", conf.to_str().unwrap()]);
    let pid = nix::unistd::Pid::from_raw(d.child.id() as i32);
    let hup_and_wait = |marker: &str| {
        nix::sys::signal::kill(pid, Signal::SIGHUP).unwrap();
        poll_blocking(Duration::from_secs(10), || {
            d.log
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|l| l.contains(marker))
                .cloned()
        })
        .unwrap_or_else(|| panic!("no `{marker}` in\n{}", d.log_text()))
    };
    std::fs::write(
        &conf,
        "hostname_prefix = \"rack7\"\n[lifecycle]\nmax_attempts = 5\n[pacing]\npower_on_wave_size = 10\n",
    )
    .unwrap();
    let line = hup_and_wait("SIGHUP: configuration re-read");
    assert!(line.contains("reloaded=lifecycle.max_attempts"), "{line}");
    // The power-on waves change live too (issue 14).
    let live = line.split("needs_restart=").next().unwrap_or("");
    assert!(live.contains("pacing.power_on_wave_size"), "{line}");
    assert!(line.contains("needs_restart=hostname_prefix"), "{line}");

    std::fs::write(&conf, "[lifecycle]\nmax_attempts = \"many\"\n").unwrap();
    let line = hup_and_wait("SIGHUP: the configuration is invalid");
    assert!(line.contains("\"many\""), "{line}");

    let (ok, body, _) = curl(&["-s", &d.url("/healthz")]);
    assert!(ok && body.starts_with("ok\n"), "{body}");
    let mut d = d;
    assert!(d.child.try_wait().unwrap().is_none(), "pxed died of SIGHUP");
}

/// HTTP serves regular files inside its trees only: a FIFO (which would hang a reader
/// thread), a directory and a symlink leading out are 404 at once; a symlink inside
/// the tree is served.
#[test]
fn http_serves_regular_files_inside_the_tree_only() {
    let tree = tempfile::tempdir().unwrap();
    let t = tree.path();
    std::fs::write(t.join("snponly.efi"), b"real file").unwrap();
    std::os::unix::fs::symlink("snponly.efi", t.join("alias.efi")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", t.join("passwd")).unwrap();
    std::fs::create_dir(t.join("sub")).unwrap();
    nix::unistd::mkfifo(&t.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    let d = Daemon::start(&["--ipxe-dir", t.to_str().unwrap()]);
    let code = |path: &str| {
        let (_, out, _) = curl(&[
            "-s",
            "--max-time",
            "2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &d.url(path),
        ]);
        out
    };
    assert_eq!(code("/ipxe/snponly.efi"), "200");
    assert_eq!(code("/ipxe/alias.efi"), "200");
    for refused in [
        "/ipxe/fifo",
        "/ipxe/passwd",
        "/ipxe/sub",
        "/ipxe/..%2f..%2fetc%2fpasswd",
    ] {
        assert_eq!(code(refused), "404", "{refused}");
    }
}

/// Plain file GETs go out with sendfile (the metric counts them), byte for byte, and
/// keep the connection: two files and then a request only hyper answers come back in
/// order on one connection. HEAD sends no body; Range and conditional requests are
/// hyper's (`ServeDir`), with its 206 and 304.
#[test]
fn http_sends_files_with_sendfile_and_keeps_the_connection() {
    use std::io::{BufRead, BufReader, Read, Write};
    let tree = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..5 * 1024 * 1024u32)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    std::fs::write(tree.path().join("snponly.efi"), &big).unwrap();
    std::fs::write(tree.path().join("small.ipxe"), b"#!ipxe\n").unwrap();
    let d = Daemon::start(&["--ipxe-dir", tree.path().to_str().unwrap()]);
    let metric = |name: &str| -> u64 {
        let (_, out, _) = curl(&["-s", &d.url("/metrics")]);
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} "))?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in metrics"))
    };
    let before = metric("pxed_http_sendfile_bytes_total");

    let addr = d.http.trim_start_matches("http://").to_string();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    conn.write_all(
        b"GET /ipxe/snponly.efi HTTP/1.1\r\nHost: x\r\n\r\n\
          GET /ipxe/small.ipxe HTTP/1.1\r\nHost: x\r\n\r\n\
          GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let mut r = BufReader::new(conn);
    let mut response = || {
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        let mut len = None;
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = Some(v.trim().parse::<usize>().unwrap());
            }
            headers.push(lower);
        }
        let mut body = vec![0; len.expect("content-length")];
        r.read_exact(&mut body).unwrap();
        (status, headers, body)
    };
    let (status, headers, body) = response();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert!(body == big, "the 5 MiB file came back different");
    assert!(
        headers.iter().any(|h| h.starts_with("last-modified:")),
        "{headers:?}"
    );
    let (status, _, body) = response();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(body, b"#!ipxe\n");
    let (status, _, body) = response();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert!(
        String::from_utf8_lossy(&body).starts_with("ok"),
        "hyper answered healthz"
    );
    assert_eq!(
        metric("pxed_http_sendfile_bytes_total") - before,
        big.len() as u64 + 7,
        "both files went out with sendfile"
    );

    let (_, head, _) = curl(&["-sI", &d.url("/ipxe/snponly.efi")]);
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-length: {}", big.len())),
        "{head}"
    );
    let (_, range, _) = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{size_download}",
        "-r",
        "100-199",
        &d.url("/ipxe/snponly.efi"),
    ]);
    assert_eq!(range, "206 100", "Range is served by ServeDir");
    let (_, cond, _) = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-H",
        "If-Modified-Since: Fri, 01 Jan 2100 00:00:00 GMT",
        &d.url("/ipxe/snponly.efi"),
    ]);
    assert_eq!(cond, "304");
    assert_eq!(
        metric("pxed_http_sendfile_bytes_total") - before,
        big.len() as u64 + 7,
        "HEAD, Range and If-Modified-Since sent no file bytes with sendfile"
    );
}
