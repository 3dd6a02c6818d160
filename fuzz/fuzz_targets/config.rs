//! Config: text → `config::load` from a TOML file, `PXED_*` environment pairs and the
//! `--lease-time` / `--pool` flags.
//!
//! Input (UTF-8): the TOML file, then optionally a line `%%env` followed by lines
//! `NAME=VALUE` (environment; `--lease-time=V` and `--pool=V` lines set those flags).
//! The file part is written to one scratch file per process (unlinked, read through
//! `/proc/self/fd`), since `load` reads a path.
//!
//! Invariants, besides "no panic" (a config that loads is one `pxed serve` can run):
//! - `check-config` can print it (`toml::to_string_pretty`);
//! - `Policy::from_config` and the BMC call policy build;
//! - every duration can be added to `Instant::now()` (tokio timers and deadlines do),
//!   the TFTP timeout is not zero, the DHCP lease time is at least 60 s;
//! - `tftp_server.max_transfers` fits a tokio semaphore (1..=`Semaphore::MAX_PERMITS`).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use pxed::config::{Config, Flags, load};
use pxed::dhcp::Policy;

/// The scratch file `load` reads: created and unlinked at once, then reached through
/// `/proc/self/fd`, so nothing is left behind however the process ends.
fn scratch() -> &'static (std::fs::File, PathBuf) {
    static P: OnceLock<(std::fs::File, PathBuf)> = OnceLock::new();
    P.get_or_init(|| {
        let dir = PathBuf::from("/dev/shm");
        let dir = if dir.is_dir() {
            dir
        } else {
            std::env::temp_dir()
        };
        let path = dir.join(format!("pxed-fuzz-config-{}.toml", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("scratch file");
        std::fs::remove_file(&path).expect("unlink scratch file");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        (file, PathBuf::from(format!("/proc/self/fd/{fd}")))
    })
}

/// Semaphore::MAX_PERMITS of tokio 1.x (`usize::MAX >> 3`).
const MAX_PERMITS: usize = usize::MAX >> 3;

fn check(c: &Config) {
    toml::to_string_pretty(c).expect("check-config prints what it accepted");
    let _ = Policy::from_config(c);
    let _ = c.bmc.call_policy();
    let now = Instant::now();
    let mut durations: Vec<(&str, Duration)> = vec![
        ("dhcp.lease_time", c.dhcp.lease_time),
        ("tftp_server.timeout", c.tftp_server.timeout),
        ("lifecycle.backoff", c.lifecycle.backoff),
        ("bmc.request_timeout", c.bmc.request_timeout),
        ("bmc.power_deadline", c.bmc.power_deadline),
        ("bmc.restart_observe", c.bmc.restart_observe),
        ("bmc.poll_interval", c.bmc.poll_interval),
        ("webhooks.backoff", c.webhooks.backoff),
        ("webhooks.max_backoff", c.webhooks.max_backoff),
        ("webhooks.timeout", c.webhooks.timeout),
    ];
    durations.extend(
        c.lifecycle
            .deadlines
            .values()
            .map(|d| ("lifecycle.deadlines", *d)),
    );
    for (k, d) in durations {
        // The lifecycle worker doubles the backoff up to ten minutes: room for that too.
        assert!(
            now.checked_add(d.saturating_mul(2)).is_some(),
            "{k} = {d:?} overflows an Instant"
        );
    }
    assert!(c.dhcp.lease_time >= Duration::from_secs(60));
    assert!(
        !c.tftp_server.timeout.is_zero(),
        "tftp_server.timeout is zero"
    );
    assert!(
        (1..=MAX_PERMITS).contains(&c.tftp_server.max_transfers),
        "tftp_server.max_transfers = {} does not fit a semaphore",
        c.tftp_server.max_transfers
    );
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (file, env) = match text.split_once("\n%%env\n") {
        Some((f, e)) => (f, e),
        None => (text, ""),
    };
    let mut flags = Flags::default();
    let mut vars = Vec::new();
    for line in env.lines() {
        if let Some(v) = line.strip_prefix("--lease-time=") {
            flags.dhcp.lease_time = Some(v.to_string());
        } else if let Some(v) = line.strip_prefix("--pool=") {
            flags.dhcp.pool = Some(v.to_string());
        } else if let Some((k, v)) = line.split_once('=') {
            vars.push((k.to_string(), v.to_string()));
        }
    }
    let (scratch, path) = scratch();
    {
        use std::io::{Seek, Write};
        let mut f = scratch;
        f.set_len(0).expect("truncate scratch file");
        f.rewind().expect("rewind scratch file");
        f.write_all(file.as_bytes()).expect("write scratch file");
    }
    if let Ok(c) = load(Some(path), vars.clone(), &flags) {
        check(&c);
    }
    // The environment alone, as a systemd unit with no config file would run it.
    if !vars.is_empty()
        && let Ok(c) = load(None, vars, &flags)
    {
        check(&c);
    }
});
